"""What a valid config still needs of this machine and of its run directory, checked in seconds before anything
is written or started: by the launchers' question (`python -m megatron_jetrl.rl.config ARGS --get KEY`, before
torchrun) and by the trainer (`rl/train.py`, before the process group).

`check(cfg)` refuses with a ConfigError naming the key and the fix:

* the machine: `run.device=cuda` without a GPU, or fewer GPUs than ranks on this node; `rollout.engine=vllm` without CUDA, without vLLM, or with a
  vLLM of another version than `rollout.vllm_engine.VLLM_VERSION` (found with importlib, vLLM is never
  imported here); an FP8 GEMM `precision.backend` this machine does not have;
* the inputs: a `model.path` that is missing, has no config.json, is of a family megatron-jetrl does not
  support, has no safetensors weights, or lacks the tokenizer `model.tokenizer=hf` reads; a `data.path`
  that is missing or holds no jsonl/parquet file;
* the GPU's memory: an actor whose state alone (weights, gradients, optimizer, reference, FP8 copies) would not fit
  (`check_memory`); the host's, for the optimizer state `rollout.offload=optimizer` pins there (`check_host_memory`);
* the run directory: another live run holding it (`run_lock`); a checkpoint of another model/precision (`run_state.previous_run`), `run.resume=never`,
  or a changed hyper-parameter of a run that would resume.

It returns the run it would resume (`run_state.PreviousRun`, or None for a fresh run); the trainer says what
that means (already complete, or resuming with the changes it applies).
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_jetrl.rl.config_schema import ConfigError, JetRLConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def check(cfg: JetRLConfig):
    """Every machine, input and run-directory check (ConfigError on the first problem); the previous run or None."""
    from megatron_jetrl.rl import run_lock
    from megatron_jetrl.rl.run_state import previous_run

    if os.environ.get("RANK", "0") == "0":  # the launchers' question, or the rank that takes the lock (rl/train.py)
        run_lock.check(cfg.run.directory)
    device = cfg.run.device_type()
    check_gpus(device)
    check_vllm(cfg, device)
    check_backend(cfg, device)
    check_model_path(cfg)
    check_data(cfg)
    if device == "cuda":
        import torch

        check_memory(cfg, torch.cuda.get_device_properties(0).total_memory)
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or min(cfg.parallel.world_size, torch.cuda.device_count())
        check_host_memory(cfg, host_available_bytes(), ranks)
    return previous_run(cfg)


def actor_state_bytes(cfg: JetRLConfig) -> dict[str, int]:
    """Bytes per GPU of what the actor keeps through a step, before activations, on its largest pipeline stage:
    parameters (BF16, or FP32 without optim.bf16), FP32 gradients (`main_grad`), the optimizer's FP32 main params
    and Adam moments (1/DP of them under optim.distributed), the frozen reference (loss.kl_coef > 0; in jetrl its FP8
    linears' BF16 weights wait in host memory), and in jetrl the FP8 weight copies (the policy's W, and W^T under
    model.fp8_weight_t=step, less the linears' BF16 weights they stand in for under model.bf16_linear_weights; the
    reference's W: it runs no backward). The colocated engine sleeps meanwhile; while it is awake `rollout.offload`
    takes some of these off the GPU."""
    arch, p = cfg.arch(), cfg.parallel
    heads = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    linear = arch.linear_params
    per_layer = linear + heads + 2 * arch.hidden_size + 2 * arch.head_dim  # + biases, norms (upper bounds)
    from megatron_jetrl.models.mapping import padded_vocab_size

    vocab = padded_vocab_size(arch.vocab_size, p.tp) * arch.hidden_size
    layers = p.stage_layers(arch.num_layers)

    def stage_params(
        i: int,
    ) -> float:  # the embedding on the first stage, the output layer (a copy when tied, at PP > 1) on the last
        last = i == p.pp - 1
        return (
            layers[i] * per_layer
            + vocab * (i == 0)
            + vocab * (last and (p.pp > 1 or not arch.tie_word_embeddings))
            + arch.hidden_size * last
        )

    stage = max(range(p.pp), key=stage_params)
    params = stage_params(stage) / p.tp
    fp8_linear = linear * layers[stage] / p.tp if cfg.precision.train_fp8 else 0
    weight = 2 if cfg.optim.bf16 else 4
    state = (4 + 8 if cfg.optim.bf16 else 8) / (p.dp if cfg.optim.distributed else 1)
    reference = cfg.loss.kl_coef > 0
    return {
        "parameters": int(params * weight),
        "gradients": int(params * 4),
        "optimizer": int(params * state),
        "reference": int((params - fp8_linear) * weight) if reference else 0,  # its FP8 linears: bytes only
        # with model.bf16_linear_weights released, the FP8 copies stand in for the linears' BF16 weights in a step
        "FP8 weights": int(
            max(0, fp8_linear * ((2 if cfg.model.fp8_weight_t == "step" else 1) - (weight if cfg.bf16_linears_released() else 0)))
        ),
        "reference FP8": int(fp8_linear) if reference else 0,
    }


def check_memory(cfg: JetRLConfig, gpu_bytes: int, share: float = 0.9) -> None:
    """Refuse a layout whose actor state alone (`actor_state_bytes`) passes `share` of a GPU: it could only run out
    of memory once built, after minutes of start-up."""
    parts = actor_state_bytes(cfg)
    need = sum(parts.values())
    if need <= share * gpu_bytes:
        return
    p = cfg.parallel
    said = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in parts.items() if v)
    raise ConfigError(
        f"the actor's state alone needs {need / 2**30:.1f} GiB per GPU ({said}) at parallel.tp={p.tp} pp={p.pp} "
        f"dp={p.dp}, more than {share:.0%} of this GPU's {gpu_bytes / 2**30:.1f} GiB, before any activation: raise "
        "parallel.tp or parallel.pp, or shard the optimizer state over data-parallel ranks (optim.distributed=true "
        "with parallel.dp > 1)"
    )


def host_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (the memory the kernel can give without swapping); 0 where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def check_host_memory(cfg: JetRLConfig, available: int, ranks_on_node: int, share: float = 0.8) -> None:
    """`rollout.offload=optimizer` pins each rank's FP32 main params and Adam moments, and the KL reference's FP8 bytes,
    in host memory (they cannot be swapped): refuse a node whose available memory (`available`, 0: unknown) would not
    hold `ranks_on_node` of them."""
    if cfg.rollout.offload != "optimizer" or not available:
        return
    parts = actor_state_bytes(cfg)
    need = (parts["optimizer"] + parts["reference FP8"]) * ranks_on_node
    if need > share * available:
        raise ConfigError(
            f"rollout.offload=optimizer pins {need / 2**30:.1f} GiB of host memory on this node ({ranks_on_node} "
            f"rank(s) x {need / ranks_on_node / 2**30:.1f} GiB of FP32 main params, Adam moments and the reference's "
            f"FP8 bytes), more than {share:.0%} of its {available / 2**30:.1f} GiB available: use rollout.offload=grads, or shard the "
            "optimizer state wider (optim.distributed=true with parallel.dp > 1)"
        )


def check_gpus(device: str) -> None:
    """A CUDA rank needs a GPU of its own on its node (LOCAL_WORLD_SIZE: torchrun's processes on this node)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if device != "cuda" or not local:
        return
    import torch

    have = torch.cuda.device_count()
    if local > have:
        raise ConfigError(
            f"{local} processes on this node but {have} visible GPU(s): each CUDA rank needs its own; lower "
            "parallel.tp * parallel.dp, spread the run over more nodes, or check CUDA_VISIBLE_DEVICES"
        )


def check_vllm(cfg: JetRLConfig, device: str) -> None:
    from megatron_jetrl.rollout.vllm_engine import vllm_problem

    problem = vllm_problem(device) if cfg.rollout.engine == "vllm" else None
    if problem:
        raise ConfigError(problem)


def check_backend(cfg: JetRLConfig, device: str) -> None:
    flow = cfg.precision
    if flow.mode == "bf16" or flow.backend in ("auto", "emulated"):
        return
    import torch

    from megatron_jetrl.fp8.gemm import available_backends

    have = available_backends(torch.device(device))
    if flow.backend not in have:
        raise ConfigError(
            f"precision.backend={flow.backend!r} is not available on this machine's {device} (available: "
            f"{', '.join(have)}): set precision.backend=auto"
        )


def check_model_path(cfg: JetRLConfig) -> None:
    m = cfg.model
    if not m.path:
        return
    path = Path(m.path)
    if not path.is_dir():
        raise ConfigError(
            f"model.path={m.path!r} does not exist or is not a directory: point it at a local HF model "
            "directory (config.json, *.safetensors, tokenizer files), e.g. one `huggingface-cli download` made"
        )
    try:
        disk = m.path_config()
    except (ValueError, OSError) as e:  # ConfigError (no config.json) is a ValueError too
        raise ConfigError(
            str(e) if isinstance(e, ConfigError) else f"model.path: {path}/config.json is unreadable ({e})"
        ) from None
    from megatron_jetrl.models.arch import FAMILIES

    if disk.get("model_type") not in FAMILIES:
        raise ConfigError(
            f"model.path={m.path!r} holds a {disk.get('model_type')!r} model; megatron-jetrl supports "
            f"model_type {sorted(FAMILIES)} (Qwen2/Qwen2.5, Qwen3, Llama-3): point model.path at one of those"
        )
    if not any(path.glob("*.safetensors")):
        raise ConfigError(
            f"model.path={m.path!r} has no *.safetensors weights: download the model's safetensors "
            "(or drop model.path for a random init from model.hf_config)"
        )
    m.check_path_matches()
    if m.tokenizer == "hf" and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(
            f"model.tokenizer=hf but model.path={m.path!r} holds none of {list(TOKENIZER_FILES)}: "
            "add the model's tokenizer files, or set model.tokenizer=sentencepiece"
        )


def check_data(cfg: JetRLConfig) -> None:
    if cfg.data.source in cfg.data.GENERATED:
        return
    from megatron_jetrl.grpo.data import data_files

    try:
        data_files(cfg.data.path)
    except (ValueError, OSError) as e:
        raise ConfigError(f"data.path (data.source={cfg.data.source}): {e}") from None
