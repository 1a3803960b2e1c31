"""`VllmEngine`: the rollout engine on real vLLM (GPU clusters), written against vllm==0.33.0.

vLLM cannot be installed on the development machines: it is imported lazily inside `VllmEngine`, and
everything that does not need it -- environment, `LLM(...)` and `SamplingParams(...)` arguments, output
parsing, HF name -> vLLM parameter mapping and TP slicing, payload packing -- is plain code tested on CPU
(tests/unit/test_rollout_vllm.py). The GPU paths below were written against the vLLM API as read in its
source (see /work/research/FINDINGS.md section 3) and have NOT been run here.

Identical precision with vLLM (FINDINGS 3b): vLLM's DeepGEMM path re-quantizes 128x128 weight scales to
UE8M0 at load when `VLLM_USE_DEEP_GEMM_E8M0` is on (its default), which changes the trainer's bytes
unless the flow's scales already are powers of two. `PrecisionFlow.vllm_env()` pins it; `pin_environment`
writes that into `os.environ` *before* vLLM is imported (its envs are read and cached at import /
first use) and refuses if vLLM is already imported with different values.

Weight sync: the trainer's stream (HF names, E4M3 `.weight` + FP32 `.weight_scale_inv`, BF16 rest) is
packed into uint8 buckets and handed to every worker through `collective_rpc` of the worker extension
`JetRLWorkerExtension` (passed as `worker_extension_cls`). The worker prefers vLLM's own reload path
(`model_runner.reload_weights(weights_iterator, process_weights_after_loading=True)`, which restores the
checkpoint-layout parameters, loads through the model's `load_weights` -- q/k/v and gate/up stacking
included -- and re-runs the FP8 post-processing, which with E8M0 off re-quantizes nothing). Without it,
FP8 bytes and scales are copied in place into the fused parameters at the offsets `vllm_target` computes,
after checking the parameter still has the checkpoint layout; BF16 tensors go through their weight_loader.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.models import ModelArch
from megatron_jetrl.rollout.engine import Completion, RequestOutput, SamplingParams, request_seeds_for
from megatron_jetrl.rollout.native import SCALE_SUFFIX, WeightUpdateError, check_quantization_config, collect_batch, expected_tensors, validate_weights
from megatron_jetrl.rollout.sync import TensorMeta, buckets, pack, unpack

VLLM_VERSION = "0.26.0"
WORKER_EXTENSION = "megatron_jetrl.rollout.vllm_engine.JetRLWorkerExtension"


# ---- environment ------------------------------------------------------------------------------------

def engine_env(flow: PrecisionFlow, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of the vLLM processes for this flow (`flow.vllm_env()` plus caller extras)."""
    env = dict(flow.vllm_env())
    for key, value in (extra or {}).items():
        if key in env and env[key] != value:
            raise ValueError(f"{key}={value!r} contradicts the precision flow, which needs {key}={env[key]!r} "
                             "(vLLM would re-quantize the trainer's FP8 weights)")
        env[key] = value
    return env


def pin_environment(env: dict[str, str], environ=None, modules=None) -> None:
    """Write `env` into the process environment before vLLM is imported (workers inherit it).

    If vLLM is already imported, its environment is read already: refuse unless it already agrees.
    """
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if "vllm" in modules:
        wrong = {k: (environ.get(k), v) for k, v in env.items() if environ.get(k) != v}
        if wrong:
            raise RuntimeError(
                "vLLM was imported before the precision flow pinned its environment; these differ "
                f"(current, needed): {wrong}. Create the VllmEngine (or call pin_environment) before importing vllm."
            )
        return
    environ.update(env)


# ---- arguments --------------------------------------------------------------------------------------

def llm_kwargs(model_path: str | Path, flow: PrecisionFlow, *, tensor_parallel_size: int = 1,
               gpu_memory_utilization: float = 0.5, enable_sleep_mode: bool = True, seed: int = 0,
               max_model_len: int | None = None, enforce_eager: bool = False, **extra) -> dict:
    """Keyword arguments of `vllm.LLM(...)` for a local HF checkpoint in the flow's rollout precision."""
    path = Path(model_path)
    config = json.loads((path / "config.json").read_text())
    check_quantization_config(config, flow, where=str(path / "config.json"))
    arch = ModelArch.from_hf_config(config)
    if flow.rollout_fp8:
        arch.check_fp8_tp(tensor_parallel_size)
    elif arch.num_kv_heads % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not divide num_key_value_heads={arch.num_kv_heads}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    tokenizer = extra.pop("tokenizer", None) or (str(path) if (path / "tokenizer_config.json").is_file() else None)
    kwargs = dict(
        model=str(path),
        tokenizer=tokenizer,
        dtype="bfloat16",
        quantization="fp8" if flow.rollout_fp8 else None,  # the checkpoint's quantization_config (block FP8)
        tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization,
        enable_sleep_mode=enable_sleep_mode,
        seed=seed,
        enforce_eager=enforce_eager,
        logprobs_mode="raw_logprobs",  # logprobs of the model's logits, as NativeEngine and the trainer compute them
        worker_extension_cls=WORKER_EXTENSION,
        skip_tokenizer_init=tokenizer is None,  # prompts are token ids; stop strings need a tokenizer
    )
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    kwargs.update(extra)
    return {k: v for k, v in kwargs.items() if v is not None}


def sampling_kwargs(sampling: SamplingParams, request_seed: int | None) -> dict:
    """Keyword arguments of `vllm.SamplingParams(...)`: `logprobs=0` returns the sampled token's logprob."""
    kwargs = dict(
        n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_new_tokens,
        stop=list(sampling.stop) or None, stop_token_ids=list(sampling.stop_token_ids) or None,
        ignore_eos=sampling.ignore_eos, logprobs=0, seed=request_seed,
    )
    return {k: v for k, v in kwargs.items() if v is not None}


def parse_output(output) -> RequestOutput:
    """A vLLM `RequestOutput` -> ours (token ids, sampled-token logprobs, finish reason, text)."""
    result = RequestOutput(prompt_token_ids=list(output.prompt_token_ids))
    for c in output.outputs:
        ids = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} logprob entries for "
                               f"{len(ids)} tokens: was SamplingParams(logprobs=0) passed?")
        lps = []
        for tok, entry in zip(ids, c.logprobs):
            if tok not in entry:
                raise RuntimeError(f"vLLM logprobs lack the sampled token {tok}")
            lps.append(float(entry[tok].logprob))
        result.completions.append(Completion(ids, lps, c.finish_reason or "length", c.stop_reason, c.text))
    return result


# ---- HF name -> vLLM parameter ----------------------------------------------------------------------

_STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_ROW_PARALLEL = ("o_proj", "down_proj")


def vllm_target(arch: ModelArch, hf_name: str, tp_rank: int = 0, tp_size: int = 1):
    """Where an HF tensor lands in vLLM's model on one TP rank.

    Returns `(vllm_name, shard_id, split_dim, dst_offset)`: vLLM's fused parameter name and its
    stacked shard id (vLLM's `stacked_params_mapping`), the dim this rank slices (0 column-parallel,
    1 row-parallel, None replicated), and the row offset of this rank's slice inside the fused parameter
    (in rows for weights and biases, in 128-row blocks for `weight_scale_inv`).
    """
    parts = hf_name.split(".")
    module = parts[-2] if parts[-1] in ("weight", "bias", "weight_scale_inv") else None
    if module in _STACKED:
        fused, shard = _STACKED[module]
        unit = 128 if hf_name.endswith(SCALE_SUFFIX) else 1
        hd = arch.head_dim
        q_local, kv_local = arch.num_heads * hd // tp_size, arch.num_kv_heads * hd // tp_size
        inter_local = arch.intermediate_size // tp_size
        offset = {"q": 0, "k": q_local, "v": q_local + kv_local, 0: 0, 1: inter_local}[shard] // unit
        return hf_name.replace(module, fused), shard, 0, offset
    if module in _ROW_PARALLEL and not hf_name.endswith(".bias"):
        return hf_name, None, 1, 0
    if "embed_tokens" in hf_name or hf_name.startswith("lm_head"):
        return hf_name, None, 0, 0  # vocab parallel: vLLM's weight_loader pads and slices
    return hf_name, None, None, 0


def rank_piece(arch: ModelArch, hf_name: str, tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of a full HF tensor (FP8 blocks never straddle ranks: `check_fp8_tp`)."""
    _, _, dim, _ = vllm_target(arch, hf_name, tp_rank, tp_size)
    if dim is None or tp_size == 1 or "embed_tokens" in hf_name or hf_name.startswith("lm_head"):
        return tensor
    if tensor.shape[dim] % tp_size:
        raise ValueError(f"{hf_name}: dim {dim} of {tuple(tensor.shape)} does not split into TP={tp_size}")
    return tensor.chunk(tp_size, dim=dim)[tp_rank]


def payload(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[tuple]]:
    """A bucket as (uint8 CPU buffer, plain-tuple metadata): what `collective_rpc` pickles to workers."""
    flat, metas = pack([(n, t.detach().cpu()) for n, t in bucket])
    return flat, [(m.name, str(m.dtype).removeprefix("torch."), m.shape, m.offset, m.nbytes) for m in metas]


def from_payload(flat: torch.Tensor, metas: Sequence[tuple]) -> list[tuple[str, torch.Tensor]]:
    return unpack(flat, [TensorMeta(n, getattr(torch, d), tuple(s), o, b) for n, d, s, o, b in metas])


# ---- worker side (runs inside vLLM worker processes) ------------------------------------------------

class JetRLWorkerExtension:
    """Mixed into vLLM's GPU worker via `worker_extension_cls`; methods are called by `collective_rpc`."""

    def jetrl_load_weights(self, flat: torch.Tensor, metas: list, arch: dict, tp_size: int) -> int:  # pragma: no cover - needs vLLM
        pairs = from_payload(flat, metas)
        runner = self.model_runner
        device = next(runner.model.parameters()).device
        pairs = [(n, t.to(device)) for n, t in pairs]
        if hasattr(runner, "reload_weights"):
            runner.reload_weights(weights_iterator=iter(pairs), process_weights_after_loading=True)
            return len(pairs)
        from vllm.distributed import get_tensor_model_parallel_rank

        model_arch, rank = ModelArch(**arch), get_tensor_model_parallel_rank()
        params = dict(runner.model.named_parameters())
        for name, tensor in pairs:
            target, shard, _, offset = vllm_target(model_arch, name, rank, tp_size)
            param = params.get(target)
            if param is None:
                raise KeyError(f"vLLM model has no parameter {target} (for {name})")
            if tensor.dtype == torch.float8_e4m3fn or name.endswith(SCALE_SUFFIX):  # FP8 bytes/scales: copy in place
                piece = rank_piece(model_arch, name, tensor, rank, tp_size)
                dst = param.data.narrow(0, offset, piece.shape[0]) if shard is not None else param.data
                if dst.shape != piece.shape or dst.dtype != piece.dtype:
                    raise RuntimeError(f"{target}: vLLM holds {tuple(dst.shape)} {dst.dtype} (post-processed layout?), got "
                                       f"{tuple(piece.shape)} {piece.dtype}; set VLLM_USE_DEEP_GEMM=0 or use a vLLM with reload_weights")
                dst.copy_(piece)
            else:
                loader = getattr(param, "weight_loader")
                loader(param, tensor, shard) if shard is not None else loader(param, tensor)
        return len(pairs)


# ---- driver side ------------------------------------------------------------------------------------

class VllmEngine:  # pragma: no cover - needs vLLM and a GPU
    """`RolloutEngine` over `vllm.LLM` (in-process driver; TP workers managed by vLLM)."""

    def __init__(self, model_path: str | Path, flow: PrecisionFlow, *, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, enable_sleep_mode: bool = True, seed: int = 0,
                 bucket_bytes: int = 512 << 20, env: dict[str, str] | None = None, **llm_extra):
        pin_environment(engine_env(flow, env))
        kwargs = llm_kwargs(model_path, flow, tensor_parallel_size=tensor_parallel_size,
                            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
                            seed=seed, **llm_extra)
        import vllm

        if vllm.__version__ != VLLM_VERSION:
            import warnings

            warnings.warn(f"VllmEngine was written against vllm=={VLLM_VERSION}; found {vllm.__version__}", stacklevel=2)
        self._vllm = vllm
        self.flow, self.tp, self.bucket_bytes = flow, tensor_parallel_size, bucket_bytes
        self.arch = ModelArch.from_pretrained(model_path)
        self.specs = expected_tensors(self.arch, flow)
        self.sleep_mode = enable_sleep_mode
        self.llm = vllm.LLM(**kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None, *,
                 request_seeds: Sequence[int] | None = None) -> list[RequestOutput]:
        sampling = sampling or SamplingParams()
        if sampling.stop and self.llm.llm_engine.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: give the checkpoint a tokenizer or use stop_token_ids")
        if request_seeds is None:
            request_seeds = request_seeds_for(sampling, len(prompts))
        seeds = list(request_seeds) if request_seeds is not None else [None] * len(prompts)
        params = [self._vllm.SamplingParams(**sampling_kwargs(sampling, s)) for s in seeds]
        requests = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        results = [parse_output(o) for o in outputs]
        for r, s in zip(results, seeds):
            r.request_seed = s
        return results

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Validate each bucket as the native engine does, then load it on every TP worker."""
        for bucket in buckets(weights, self.bucket_bytes):
            batch = collect_batch(bucket)
            problems = validate_weights(self.specs, batch, family=self.arch.family)
            if problems:
                raise WeightUpdateError("refused a weight bucket; it was not sent:\n  - " + "\n  - ".join(problems[:20]))
            flat, metas = payload(list(batch.items()))
            self.llm.collective_rpc("jetrl_load_weights", args=(flat, metas, self.arch.to_dict(), self.tp))
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights

    def sleep(self) -> None:
        if self.sleep_mode:
            self.llm.sleep(level=1)

    def wake(self) -> None:
        if self.sleep_mode:
            self.llm.wake_up()
