"""`VllmEngine`: the rollout engine on real vLLM, written against vllm==0.26.0 (read in the wheel's source:
`entrypoints/llm.py`, `v1/executor/uniproc_executor.py`, `v1/worker/gpu_worker.py`, `model_executor/layers/
quantization/fp8.py`, `model_executor/kernels/linear/scaled_mm/deep_gemm.py`, `.../input_quant_fp8.py`).

One engine per torchrun rank (`distributed_executor_backend="external_launcher"`: vLLM runs in this process,
on the process group the trainer already made, with `rollout_tp` consecutive ranks as one vLLM TP group;
`rollout.colocated` arranges the pool). vLLM is imported lazily, only here; everything that does not need
it is plain code tested on CPU (tests/unit/test_rollout_vllm.py), the rest on the GPU (tests/gpu/test_vllm.py).

Numerics are pinned, then checked at start-up, because vLLM's defaults change the trainer's bytes:
- `VLLM_USE_DEEP_GEMM_E8M0` follows the flow's scale mode (on, vLLM re-quantizes FP32 weight scales to
  powers of two at load and rounds activation scales up to powers of two);
- `VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0` (FlashInfer's block GEMM quantizes small batches itself);
- compiled graphs keep the `quant_fp8` custom op (the CUDA kernel `per_token_group_fp8_quant`, equal to
  `quantize_blockwise` byte for byte) and no RMSNorm/SiLU/attention+quant fusion: vLLM's `forward_native`
  and the fused kernels floor the scale at 1/(448*512) instead of flooring amax at 1e-10.
`check_numerics` reads back the kernel of every FP8 linear, the E8M0 switch, the compile passes, and runs the
kernels' own activation quantizer on a probe against ours; any difference refuses the engine, naming it.
vLLM's own RMSNorm and RoPE round unlike the trainer's (a fifth of their outputs); `glue="trainer"` (the default,
`resolve_glue`) registers the trainer's (`rollout.vllm_glue`) and probes them at start-up the same way.

Weights never leave the device. The engine starts on dummy weights (`load_format="dummy"`, a config-only
model directory) and every sync -- the first included -- writes the trainer's FP8 bytes, scales and BF16
tensors straight into vLLM's parameters: `copy_plan` maps each HF tensor to a slice of a fused vLLM
parameter (q/k/v -> qkv_proj, gate/up -> gate_up_proj, this rank's TP piece, vocab rows), after checking that
the live parameter has the checkpoint layout (with E8M0 off, vLLM's DeepGEMM post-processing keeps it) and
that every vLLM parameter is covered (a level-2 sleep discards them all). An update is validated whole before
the first byte is written, and the bytes are compared with the trainer's after the copy (one host sync).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_jetrl.fp8 import PrecisionFlow, quantize_blockwise
from megatron_jetrl.models import ModelArch
from megatron_jetrl.rollout.engine import Completion, RequestOutput, SamplingParams, request_seeds_for
from megatron_jetrl.rollout.native import SCALE_SUFFIX, WeightUpdateError, collect_batch, expected_tensors, validate_weights
from megatron_jetrl.rollout.sampling import sample_seed
from megatron_jetrl.rollout.sync import Phases

VLLM_VERSION = "0.26.0"
INSTALL = f"pip install vllm=={VLLM_VERSION}"
ALLOWED_KERNELS = ("DeepGemmFp8BlockScaledMMKernel", "CutlassFp8BlockScaledMMKernel", "TritonFp8BlockScaledMMKernel")
"""Block-FP8 linear kernels whose activation quantizer is `QuantFP8` per 1x128 group (ours, byte for byte)."""
UNFUSED = {"fuse_norm_quant": False, "fuse_act_quant": False, "fuse_attn_quant": False, "fuse_allreduce_rms": False}


class EngineConformanceError(RuntimeError):
    """vLLM would not run the precision flow's forward (a kernel, switch or quantizer differs)."""


# ---- availability and environment -------------------------------------------------------------------


def vllm_problem(device: str) -> str | None:
    """Why `rollout.engine=vllm` cannot run on `device` ('cuda' or 'cpu'; None: it can), without importing vLLM."""
    import importlib.metadata
    import importlib.util

    if device != "cuda":
        return (
            f"rollout.engine=vllm needs a CUDA GPU and this run is on the {device}: set rollout.engine=native, "
            f"or run on a GPU node with vLLM ({INSTALL})"
        )
    if importlib.util.find_spec("vllm") is None:
        return f"rollout.engine=vllm but vLLM is not installed in this environment: {INSTALL}, or set rollout.engine=native"
    try:
        found = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        found = "unknown (no package metadata)"
    if found != VLLM_VERSION:
        return (
            f"rollout.engine=vllm needs vLLM {VLLM_VERSION} (the version its engine is written against), "
            f"found {found}: {INSTALL}, or set rollout.engine=native"
        )
    return None


def engine_env(flow: PrecisionFlow, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment vLLM must see for this flow (`flow.vllm_env()`, FlashInfer's block GEMM off) plus extras."""
    env = dict(flow.vllm_env())
    if flow.rollout_fp8:
        env["VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER"] = "0"
    for key, value in (extra or {}).items():
        if key in env and env[key] != value:
            raise ValueError(
                f"{key}={value!r} contradicts the precision flow, which needs {key}={env[key]!r} "
                "(vLLM would re-quantize the trainer's FP8 weights or quantize activations its own way)"
            )
        env[key] = value
    return env


def pin_environment(env: dict[str, str], environ=None, modules=None) -> None:
    """Write `env` into the process environment before vLLM is imported (its envs are read at import).

    If vLLM is already imported, its environment is read already: refuse unless it already agrees.
    `VLLM_DEEP_GEMM_WARMUP` defaults to `skip` (its full warm-up JIT-compiles ~1600 kernels, > 20 min).
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
    environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")


def write_model_dir(directory: str | Path, hf_config: dict, flow: PrecisionFlow) -> Path:
    """A config-only HF directory vLLM starts from (dummy weights; the first sync writes the real ones)."""
    from megatron_jetrl.convert.converter import rollout_hf_config

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = rollout_hf_config(hf_config, ModelArch.from_hf_config(hf_config), flow)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


# ---- arguments --------------------------------------------------------------------------------------

GLUES = ("auto", "vllm", "trainer")


def resolve_glue(glue: str, arch: ModelArch | None, spec: str = "local") -> str:
    """The rule of `rollout.glue: auto` (a run config's is resolved once, when it loads: `rl.resolve`; an engine built
    with glue="auto" resolves here): the trainer's RMSNorm and RoPE, which cut jetrl's mismatch several times against
    vLLM's (BENCHMARKS.md), except vLLM's for a scaled RoPE (llama3: vLLM builds another class, which
    `rollout.vllm_glue` does not replace) and for an actor of `model.spec=te` (its norms are Transformer Engine's, not
    the local spec's). `arch` None: not known here (no RoPE scaling read)."""
    if glue not in GLUES:
        raise ValueError(f"glue must be one of {GLUES}, got {glue!r}")
    if glue == "auto":
        return "vllm" if (arch is not None and arch.rope_scaling) or spec == "te" else "trainer"
    return glue


def llm_kwargs(
    model_dir: str | Path,
    flow: PrecisionFlow,
    *,
    tensor_parallel_size: int = 1,
    seed: int = 0,
    kv_cache_memory_bytes: int | None = None,
    gpu_memory_utilization: float = 0.9,
    enforce_eager: bool = False,
    max_model_len: int | None = None,
    glue: str = "auto",
    **extra,
) -> dict:
    """Keyword arguments of `vllm.LLM(...)`: colocated SPMD engine, dummy load, the flow's numerics pinned.

    A non-eager engine with the trainer's glue runs no torch.compile (Dynamo does not trace the trainer's kernels) and
    captures full CUDA graphs of decode steps (`FULL_DECODE_ONLY`: vLLM 0.26 supports full graphs without
    compilation; prefill runs eagerly); with vLLM's glue it compiles, with the fusion passes that change bytes off."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    arch = ModelArch.from_hf_config(config)
    if flow.rollout_fp8:
        arch.check_fp8_tp(tensor_parallel_size)
    elif arch.num_kv_heads % tensor_parallel_size:
        raise ValueError(f"TP={tensor_parallel_size} does not divide num_key_value_heads={arch.num_kv_heads}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    kwargs = dict(
        model=str(model_dir),
        dtype="bfloat16",
        seed=seed,
        load_format="dummy",
        skip_tokenizer_init=True,
        quantization="fp8" if flow.rollout_fp8 else None,  # the config's quantization_config (block FP8)
        tensor_parallel_size=tensor_parallel_size,
        distributed_executor_backend="external_launcher",
        enable_sleep_mode=True,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        enforce_eager=enforce_eager,
        max_model_len=max_model_len,
        logprobs_mode="raw_logprobs",  # log_softmax of the logits, as the trainer computes them
        disable_custom_all_reduce=True,  # NCCL for TP > 1: custom all-reduce's IPC buffers are outside the sleep pool
    )
    if flow.exact_logprobs:
        kwargs["disable_cascade_attn"] = True  # (vLLM 0.26's default; a shared prefix's two kernels would differ)
    if flow.kv_cache == "fp8":  # scales: the trainer's, written at every sync, or vLLM's from its first forward
        kwargs["kv_cache_dtype"] = "fp8"
        kwargs["calculate_kv_scales"] = flow.kv_scale_policy == "engine"
    if resolve_glue(glue, arch) == "trainer" and not enforce_eager:
        kwargs["compilation_config"] = {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY", "custom_ops": ["+quant_fp8"]}
    elif flow.rollout_fp8 and not enforce_eager:
        kwargs["compilation_config"] = {"custom_ops": ["+quant_fp8"], "pass_config": dict(UNFUSED)}
    kwargs.update(extra)
    return {k: v for k, v in kwargs.items() if v is not None}


def sampling_kwargs(sampling: SamplingParams, request_seed: int | None, eos_token_ids: Sequence[int] = ()) -> dict:
    """Keyword arguments of `vllm.SamplingParams(...)`: `logprobs=0` returns the sampled token's logprob. The
    model's EOS ids join `stop_token_ids` (without a tokenizer vLLM knows no EOS).

    The seed: vLLM seeds sample j of a request with `seed + j` (`v1/engine/parallel_sampling.py`), and the pool's
    request seeds are consecutive (`seed + prompt index`), so prompt i's sample j + 1 and prompt i + 1's sample j
    would draw the same noise at every step. vLLM gets `sample_seed(request_seed, 0)` instead: sample j's seed is
    then the native engine's (`rollout.sampling.sample_seed`), distinct for every (prompt, sample) below 10^6
    samples a prompt."""
    stop_ids = list(dict.fromkeys([*sampling.stop_token_ids, *([] if sampling.ignore_eos else eos_token_ids)]))
    kwargs = dict(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_new_tokens,
        stop=list(sampling.stop) or None,
        stop_token_ids=stop_ids or None,
        ignore_eos=sampling.ignore_eos,
        logprobs=0,
        seed=None if request_seed is None else sample_seed(request_seed, 0),
    )
    return {k: v for k, v in kwargs.items() if v is not None}


def parse_output(output) -> RequestOutput:
    """A vLLM `RequestOutput` -> ours (token ids, sampled-token logprobs, finish reason, text)."""
    result = RequestOutput(prompt_token_ids=list(output.prompt_token_ids))
    for c in output.outputs:
        ids = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise RuntimeError(
                f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} logprob entries for "
                f"{len(ids)} tokens: was SamplingParams(logprobs=0) passed?"
            )
        lps = []
        for tok, entry in zip(ids, c.logprobs):
            if tok not in entry:
                raise RuntimeError(f"vLLM logprobs lack the sampled token {tok}")
            lps.append(float(entry[tok].logprob))
        result.completions.append(Completion(ids, lps, c.finish_reason or "length", c.stop_reason, c.text or None))
    return result


# ---- HF name -> vLLM parameter ----------------------------------------------------------------------

_STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_ROW_PARALLEL = ("o_proj", "down_proj")


def _is_vocab(hf_name: str) -> bool:
    return "embed_tokens" in hf_name or hf_name.startswith("lm_head")


def vllm_target(arch: ModelArch, hf_name: str, tp_rank: int = 0, tp_size: int = 1):
    """Where an HF tensor lands in vLLM's model on one TP rank.

    Returns `(vllm_name, shard_id, split_dim, dst_offset)`: vLLM's fused parameter name and its
    stacked shard id (vLLM's `stacked_params_mapping`), the dim this rank slices (0 column-parallel and
    vocab-parallel, 1 row-parallel, None replicated), and the row offset of this rank's slice inside the fused
    parameter (in rows for weights and biases, in 128-row blocks for `weight_scale_inv`).
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
    if _is_vocab(hf_name):
        return hf_name, None, 0, 0
    return hf_name, None, None, 0


def rank_piece(
    arch: ModelArch, hf_name: str, tensor: torch.Tensor, tp_rank: int, tp_size: int, rows_per_rank: int | None = None
) -> torch.Tensor:
    """This rank's slice of a full HF tensor (a view; FP8 blocks never straddle ranks: `check_fp8_tp`).

    Vocab-parallel tensors (embedding, lm_head) take rows `[rank * rows_per_rank, ...)` of the vocabulary,
    `rows_per_rank` being vLLM's padded per-rank row count; the last ranks may hold fewer real rows (or none).
    """
    _, _, dim, _ = vllm_target(arch, hf_name, tp_rank, tp_size)
    if _is_vocab(hf_name):
        per = rows_per_rank or -(-tensor.shape[0] // tp_size)
        start = min(tp_rank * per, tensor.shape[0])
        return tensor[start : min(start + per, tensor.shape[0])]
    if dim is None or tp_size == 1:
        return tensor
    if tensor.shape[dim] % tp_size:
        raise ValueError(f"{hf_name}: dim {dim} of {tuple(tensor.shape)} does not split into TP={tp_size}")
    return tensor.chunk(tp_size, dim=dim)[tp_rank]


@dataclass(frozen=True)
class Slot:
    """Where one HF tensor goes on this rank: rows `[row, row + rows)` of vLLM parameter `param`."""

    param: str
    row: int
    rows: int


def copy_plan(
    arch: ModelArch, flow: PrecisionFlow, params: dict[str, torch.Tensor], tp_rank: int = 0, tp_size: int = 1
) -> dict[str, Slot]:
    """HF name -> `Slot` for every tensor of the trainer's stream, checked against vLLM's live parameters.

    Refuses (EngineConformanceError, every problem named) when a parameter is missing, has another dtype, width
    or layout (e.g. scales re-laid out for another kernel), or when a vLLM parameter would not be written whole.
    """
    plan, problems, covered = {}, [], {}
    for hf_name, (shape, dtype) in expected_tensors(arch, flow).items():
        target, _, _, offset = vllm_target(arch, hf_name, tp_rank, tp_size)
        param = params.get(target)
        if param is None:
            if hf_name.startswith("lm_head") and arch.tie_word_embeddings:
                continue  # tied: vLLM's lm_head is the embedding
            problems.append(f"{hf_name}: vLLM has no parameter {target}")
            continue
        per = param.shape[0] if _is_vocab(hf_name) else None
        piece = rank_piece(arch, hf_name, torch.empty(shape, dtype=dtype, device="meta"), tp_rank, tp_size, per)
        if param.dtype != dtype or tuple(param.shape[1:]) != tuple(piece.shape[1:]) or not param.is_contiguous():
            problems.append(
                f"{target}: vLLM holds {tuple(param.shape)} {param.dtype} (contiguous={param.is_contiguous()}); "
                f"{hf_name} needs rows of {tuple(piece.shape[1:])} {dtype}"
            )
            continue
        if offset + piece.shape[0] > param.shape[0]:
            problems.append(f"{target}: {param.shape[0]} rows cannot take {hf_name} at row {offset} (+{piece.shape[0]})")
            continue
        plan[hf_name] = Slot(target, offset, piece.shape[0])
        covered[target] = covered.get(target, 0) + piece.shape[0]
    for name, param in params.items():
        vocab = _is_vocab(name)
        if name not in covered:
            problems.append(f"{name}: no tensor of the trainer's stream writes this vLLM parameter")
        elif covered[name] != param.shape[0] and not vocab:
            problems.append(f"{name}: the stream writes {covered[name]} of its {param.shape[0]} rows")
    if problems:
        raise EngineConformanceError(
            "vLLM's parameters do not take the trainer's tensors as they are (was a setting "
            "changed that re-lays out weights, e.g. VLLM_USE_DEEP_GEMM_E8M0?):\n  - " + "\n  - ".join(problems[:20])
        )
    return plan


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def apply_plan(
    arch: ModelArch,
    plan: dict[str, Slot],
    params: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    tp_rank: int = 0,
    tp_size: int = 1,
) -> list[str]:
    """Copy every tensor of a validated batch into its slot, then compare the bytes; the names that differ."""
    checks = []
    for name, tensor in batch.items():
        slot = plan.get(name)
        if slot is None:
            continue  # lm_head of a tied model
        param = params[slot.param]
        piece = rank_piece(arch, name, tensor, tp_rank, tp_size, param.shape[0] if _is_vocab(name) else None)
        dst = param.data.narrow(0, slot.row, slot.rows)
        dst.copy_(piece)
        checks.append((name, (_bits(dst) != _bits(piece)).any()))
    if not checks:
        return []
    differ = torch.stack([c for _, c in checks]).tolist()  # one host sync for the whole model
    return [name for (name, _), bad in zip(checks, differ, strict=True) if bad]


# ---- numerics read back from the running engine ------------------------------------------------------


def fp8_kernels(model) -> dict[str, object]:
    """Module name -> the block-FP8 linear kernel object vLLM chose for it."""
    return {
        name: m.quant_method.fp8_linear
        for name, m in model.named_modules()
        if hasattr(getattr(m, "quant_method", None), "fp8_linear")
    }


def kernel_problems(kernels: dict[str, object], flow: PrecisionFlow) -> list[str]:
    """Every FP8 linear must run an allowed kernel whose activation quantizer is the CUDA `QuantFP8` op, with
    UE8M0 scales exactly when the flow's scale mode is ue8m0."""
    if flow.rollout_fp8 and not kernels:
        return ["no block-FP8 linear found in the vLLM model (was the checkpoint's quantization_config read?)"]
    problems = []
    for name, kernel in kernels.items():
        subs = [getattr(kernel, "base", None), getattr(kernel, "fallback", None)]
        for k in [s for s in subs if s is not None] or [kernel]:
            cls = type(k).__name__
            quant = getattr(k, "quant_fp8", None)
            if cls not in ALLOWED_KERNELS or not getattr(k, "apply_input_quant", True) or quant is None:
                problems.append(
                    f"{name}: kernel {cls} (allowed: {', '.join(ALLOWED_KERNELS)}; a kernel that quantizes "
                    "activations itself changes the bytes: set VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0)"
                )
                continue
            if bool(getattr(quant, "use_ue8m0", False)) != (flow.scale_mode == "ue8m0"):
                problems.append(
                    f"{name}: {cls} quantizes activations with use_ue8m0={quant.use_ue8m0} but the flow's "
                    f"scale_mode is {flow.scale_mode!r} (VLLM_USE_DEEP_GEMM_E8M0 must be "
                    f"{flow.vllm_env().get('VLLM_USE_DEEP_GEMM_E8M0')})"
                )
            method = getattr(getattr(quant, "_forward_method", None), "__name__", "forward_cuda")
            if method != "forward_cuda":
                problems.append(
                    f"{name}: the activation quantizer runs {method} (vLLM's torch version floors the scale "
                    "at 1/(448*512)): keep compilation_config custom_ops=['+quant_fp8']"
                )
    return problems[:20]


def pass_problems(pass_config) -> list[str]:
    """Compile passes that fuse quantization into other kernels (their own scale floor and rounding) must be off."""
    return [
        f"compilation pass {k}={getattr(pass_config, k, None)} (must be False: the fused kernel quantizes its own way)"
        for k in UNFUSED
        if getattr(pass_config, k, False)
    ]


def probe_tensor(device, dtype=torch.bfloat16, rows: int = 16, groups: int = 8, seed: int = 0) -> torch.Tensor:
    """Activations that test the quantizer's edges: a zero group, tiny groups, huge ones, rounding ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups * 128, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[0, :128] = 0.0  # amax 0: the eps floor
    x[1, 128:256] *= 1e-12  # amax below eps * 448
    x[2, 256:384] = 1e-30
    x[3, 384:512] = torch.tensor([448.0, 1.0625, -1.1875, 2.125, 3.25, 0.01171875] * 22)[:128]  # s = 1: e4m3 ties
    x[4, 512:640] = 60000.0 * torch.sign(torch.randn(128, generator=g))
    return x.to(dtype).to(device)


def probe_problems(quant_fp8, flow: PrecisionFlow, x: torch.Tensor) -> list[str]:
    """vLLM's activation quantizer (the kernel's own `QuantFP8`) against `quantize_blockwise` on `x`."""
    q, s = quant_fp8(x)
    q_ref, s_ref = quantize_blockwise(x, (1, 128), flow.scale_mode, eps=flow.eps)
    rows, groups = q_ref.shape[0], s_ref.shape[1]
    s = s.float()[:rows, :groups] if s.shape[0] >= rows else s.float().t()[:rows, :groups]
    problems = []
    if not torch.equal(q[:rows].view(torch.uint8), q_ref.view(torch.uint8)):
        bad = (q[:rows].view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()[:3].tolist()
        problems.append(f"activation bytes differ from quantize_blockwise at (row, col) {bad}")
    if not torch.equal(s.contiguous(), s_ref.float()):
        bad = (s.contiguous() != s_ref.float()).nonzero()[:3].tolist()
        problems.append(f"activation scales differ from quantize_blockwise at (row, group) {bad}")
    return problems


def exact_problems(
    attention_impls: dict[str, object],
    one_split: bool,
    cascade_disabled: bool,
    glue: str,
    lm_head_method: str,
    v2_runner: bool = True,
    ordered_reduce: bool = True,
) -> list[str]:
    """Under `precision.exact_logprobs`, what in a running engine would compute other bytes than the actor's
    `rollout_kernels`: attention with more than one KV split or not FA3, cascade attention, vLLM's own RMSNorm/RoPE,
    an lm_head without the actor's GEMM, a model runner whose logprob kernel the actor does not call, and above TP 2 a
    TP all-reduce that does not add in rank order (`ordered_reduce` False)."""
    problems = []
    if not ordered_reduce:
        problems.append(
            "vLLM's TP all-reduce would add the partial sums in an order of its own (patches/vllm_0_26_0_ordered_all_reduce.py "
            "did not take effect before the engine started): let VllmEngine build the engine"
        )
    if not v2_runner:
        problems.append(
            "vLLM runs its V1 model runner, whose sampler computes logprobs with another kernel than the one "
            "the actor calls (the V2 runner's compute_token_logprobs): keep VLLM_USE_V2_MODEL_RUNNER=1"
        )
    if not one_split:
        problems.append(
            "vLLM's attention may split the KV cache (neither patches/vllm_0_26_0_one_split_attention.py nor "
            "VLLM_BATCH_INVARIANT=1 took effect before the attention layers were built): create the engine, "
            "or call rl.session.pin_vllm_environment, before anything imports vllm"
        )
    if not cascade_disabled:
        problems.append(
            "cascade attention is on (a shared prefix's attention merged from two kernels): build the engine "
            "with disable_cascade_attn=True"
        )
    for name, impl in list(attention_impls.items())[:3]:
        cls, version = type(impl).__name__, getattr(impl, "vllm_flash_attn_version", None)
        if cls != "FlashAttentionImpl" or version != 3:
            problems.append(
                f"{name}: attention {cls} (FlashAttention version {version}); the actor computes FlashAttention "
                "3's bytes: leave vLLM's default attention backend on Hopper"
            )
    if glue != "trainer":
        problems.append(
            f"rollout.glue resolved to {glue!r}: vLLM's own RMSNorm and RoPE round unlike the actor's; use "
            "rollout.glue=auto or trainer (a llama3 scaled RoPE cannot)"
        )
    if lm_head_method != "TrainerLMHeadMethod":
        problems.append(
            f"the lm_head runs {lm_head_method}, not the actor's lm_head GEMM (rollout.vllm_glue.use_trainer_lm_head "
            "takes an unquantized lm_head only)"
        )
    return problems


def check_numerics(model, flow: PrecisionFlow, pass_config, *, compiled: bool) -> dict:
    """Everything the flow pins, read back from the engine; raises EngineConformanceError naming what differs."""
    kernels = fp8_kernels(model)
    problems = kernel_problems(kernels, flow) if flow.rollout_fp8 else []
    if flow.rollout_fp8 and compiled:
        problems += pass_problems(pass_config)
    probed = 0
    if flow.rollout_fp8 and not problems:
        device = next(model.parameters()).device
        for kernel in {type(k).__name__: k for k in kernels.values()}.values():
            problems += probe_problems(kernel.quant_fp8, flow, probe_tensor(device))
            probed += 1
    if problems:
        raise EngineConformanceError("vLLM would not run the precision flow's forward:\n  - " + "\n  - ".join(problems))
    return {"kernels": sorted({type(k).__name__ for k in kernels.values()}), "fp8_linears": len(kernels), "probed": probed}


def attention_layers(model) -> dict[str, object]:
    """HF layer prefix (`model.layers.N.self_attn`) -> vLLM's attention layer (`.attn`) of that decoder layer."""
    return {name.removesuffix(".attn"): m for name, m in model.named_modules() if name.endswith("self_attn.attn")}


def kv_scale_params(layers: dict[str, object]) -> dict[str, torch.Tensor]:
    """The mapping table's HF names of the FP8 KV cache's scales -> one-element views of the buffers vLLM's attention
    quantizes with and descales by (`_q_scale`, `_k_scale`, `_v_scale`)."""
    return {f"{prefix}.attn.{t}_scale": getattr(layer, f"_{t}_scale").view(1) for prefix, layer in layers.items() for t in "qkv"}


def sync_scale_floats(layers: dict[str, object]) -> None:
    """vLLM keeps host copies of the scales beside the buffers (read by backends other than FA3): set them too."""
    values = torch.stack([getattr(layer, f"_{t}_scale") for layer in layers.values() for t in "qkv"]).tolist()
    for i, layer in enumerate(layers.values()):
        layer._q_scale_float, layer._k_scale_float, layer._v_scale_float = values[3 * i : 3 * i + 3]
        layer._k_scale_cpu.fill_(layer._k_scale_float)
        layer._v_scale_cpu.fill_(layer._v_scale_float)


def kv_cache_problems(layers: dict[str, object], flow: PrecisionFlow, tile_patched: bool) -> list[str]:
    """What in a running engine's attention layers differs from the flow's KV cache: the cache dtype, who computes the
    scales, and under `exact_logprobs` with an FP8 cache, a query not quantized with the layer's scale, FA3's FP8 launch
    not pinned to one kernel (patches/vllm_0_26_0_fp8_attention_tile.py)."""
    problems = []
    fp8 = flow.kv_cache == "fp8"
    for name, layer in list(layers.items())[:3]:
        dtype = getattr(layer, "kv_cache_dtype", None)
        if str(dtype).startswith("fp8") != fp8:
            problems.append(f"{name}: vLLM's KV cache dtype is {dtype!r}, the flow's precision.kv_cache is {flow.kv_cache!r}")
            continue
        if not fp8:
            continue
        engine = bool(getattr(layer, "calculate_kv_scales", False))
        if engine and flow.kv_scale_policy != "engine":
            problems.append(
                f"{name}: vLLM computes its own K/V scales (calculate_kv_scales), the trainer's "
                f"({flow.kv_scale_policy}) would be overwritten: start the engine with calculate_kv_scales=False"
            )
        if flow.exact_logprobs and getattr(layer, "query_quant", None) is None:
            problems.append(
                f"{name}: vLLM's attention does not quantize the query with the layer's q scale (no query_quant), "
                "so its FP8 attention is not the actor's: use the FlashAttention 3 backend"
            )
    if fp8 and flow.exact_logprobs and not tile_patched:
        problems.append(
            "FA3's FP8 forward would pick its kernel by the batch (patches/vllm_0_26_0_fp8_attention_tile.py did not "
            "take effect before the engine started)"
        )
    return problems


def check_kv_cache(layers: dict[str, object], flow: PrecisionFlow) -> dict:
    """`kv_cache_problems` of a running engine; any refuses it."""
    tile = False
    if flow.exact_logprobs and flow.kv_cache == "fp8":
        from megatron_jetrl.patching import load_patch

        tile = load_patch("vllm_0_26_0_fp8_attention_tile").applied()
    problems = kv_cache_problems(layers, flow, tile)
    if problems:
        raise EngineConformanceError("vLLM's KV cache is not the flow's:\n  - " + "\n  - ".join(problems))
    return {"dtype": flow.kv_cache, "scales": flow.kv_scale_policy, "layers": len(layers)}


# ---- the engine -------------------------------------------------------------------------------------


def _driver_model(worker):
    return worker.model_runner.model


class VllmEngine:  # pragma: no cover - needs vLLM and a GPU (tests/gpu/test_vllm.py)
    """`RolloutEngine` over an in-process `vllm.LLM` on this rank (external launcher, one TP rank of one engine)."""

    def __init__(
        self,
        model_dir: str | Path,
        flow: PrecisionFlow,
        *,
        tp: int = 1,
        tp_rank: int = 0,
        eos_token_ids: Sequence[int] = (),
        seed: int = 0,
        env: dict[str, str] | None = None,
        verify_numerics: bool = True,
        glue: str = "auto",
        fused_quant: bool = True,
        **llm_extra,
    ):
        """`verify_numerics=False` skips `check_numerics` and records what vLLM chose: only for benchmarks of vLLM's
        own (fused) numerics (tools/bench/bench_vllm.py --variant fused), never for a rollout that must run the trainer's bytes.
        `glue` (`resolve_glue`): with the trainer's, vLLM runs the trainer's RMSNorm and RoPE (`rollout.vllm_glue`)
        and the engine refuses to start unless layer 0's modules then return the trainer's bytes. `fused_quant`
        (with the trainer's glue, FP8 rollout, FP32 scales; `rollout.vllm_fused_quant`): the norms and SiLU also write
        the FP8 input of the linear after them (`vllm_glue.configure`), checked the same way."""
        problem = vllm_problem("cuda" if torch.cuda.is_available() else "cpu")
        if problem:
            raise RuntimeError(problem)
        self.arch = ModelArch.from_pretrained(model_dir)
        glue = resolve_glue(glue, self.arch)
        pin_environment(engine_env(flow, env))
        import vllm

        from megatron_jetrl.patching import load_patch
        from megatron_jetrl.rollout import vllm_glue

        load_patch("vllm_0_26_0_seeded_sampling").apply()  # seeded requests' noise in one kernel, not one per request

        if flow.exact_logprobs and flow.rollout_fp8:  # (a BF16 rollout runs vLLM's batch-invariant mode: flow.vllm_env)
            load_patch("vllm_0_26_0_one_split_attention").apply()
        if flow.exact_logprobs and flow.kv_cache == "fp8":
            load_patch("vllm_0_26_0_fp8_attention_tile").apply()
        if flow.exact_logprobs and tp > 2:  # the actor sums its row-parallel outputs in rank order too
            load_patch("vllm_0_26_0_ordered_all_reduce").apply()
        if glue == "trainer":
            vllm_glue.register()
            fused = fused_quant and flow.rollout_fp8 and flow.scale_mode == "fp32"
            vllm_glue.configure(flow.eps if fused else None, self.arch.hidden_size)
        elif vllm_glue.registered():
            raise RuntimeError(
                "an engine with vLLM's glue was asked for, but this process registered the trainer's in "
                "vLLM's op registry (global to the process): start it in a fresh process"
            )

        self._vllm = vllm
        self.flow, self.tp, self.tp_rank = flow, tp, tp_rank
        self.eos_token_ids = tuple(eos_token_ids)
        self.specs = expected_tensors(self.arch, flow)
        kwargs = llm_kwargs(model_dir, flow, tensor_parallel_size=tp, seed=seed, glue=glue, **llm_extra)
        self.llm = vllm.LLM(**kwargs)
        self.model = self.llm.collective_rpc(_driver_model)[0]
        core = getattr(self.llm.llm_engine.engine_core, "engine_core", None)  # in-process (the external launcher's)
        self.scheduler = getattr(core, "scheduler", None)
        if self.scheduler is not None:
            load_patch("vllm_0_26_0_preemption_count").apply(self.scheduler)
        if flow.exact_logprobs:
            vllm_glue.use_trainer_lm_head(self.model)
        compilation = self.llm.llm_engine.vllm_config.compilation_config
        compiled, pass_config = int(compilation.mode) != 0, compilation.pass_config  # CompilationMode.NONE == 0
        if verify_numerics:
            self.numerics = check_numerics(self.model, flow, pass_config, compiled=compiled)
        else:
            self.numerics = {
                "verified": False,
                "kernels": sorted({type(k).__name__ for k in fp8_kernels(self.model).values()}),
                "fused_passes": [k for k in UNFUSED if getattr(pass_config, k, False)],
            }
        self.numerics["glue"] = self._check_glue(glue, verify_numerics)
        if flow.exact_logprobs:
            self.numerics["exact_logprobs"] = self._check_exact(glue)
        self.numerics["compilation"] = {"mode": str(compilation.mode), "cudagraph_mode": str(compilation.cudagraph_mode)}
        self.attention = attention_layers(self.model)
        self.numerics["kv_cache"] = check_kv_cache(self.attention, flow)
        self.params = dict(self.model.named_parameters())
        if flow.trainer_kv_scales:  # the trainer's scales land in the buffers vLLM's attention reads
            self.params |= kv_scale_params(self.attention)
        self.plan = copy_plan(self.arch, flow, self.params, tp_rank, tp)
        self.ready = False  # dummy weights until the first complete, verified update
        self.sleeping: set[str] = set()

    def _check_glue(self, glue: str, verify: bool) -> dict:
        """Layer 0's RMSNorm and RoPE against the trainer's functions: the share of outputs that differ, per op.
        With the trainer's glue any difference refuses the engine (the registry did not take, or a model uses
        another class, e.g. llama3's scaled RoPE)."""
        from megatron_jetrl.rollout import vllm_glue

        layer = self.model.model.layers[0]
        device = next(self.model.parameters()).device
        shares = vllm_glue.probe(layer, self.arch, device)
        if glue == "trainer" and verify and any(shares.values()):
            raise EngineConformanceError(
                "vLLM does not run the trainer's glue although rollout.glue=trainer: outputs that differ from the "
                f"trainer's functions {shares} (modules {type(layer.input_layernorm).__name__}, "
                f"{type(layer.self_attn.rotary_emb).__name__})"
            )
        fused = None
        if glue == "trainer" and getattr(layer.input_layernorm, "quant_eps", None) is not None:
            fused = vllm_glue.probe_fused(layer, self.arch, device)
            if verify and (fused["mlp_took_stash"] != 1.0 or any(v for k, v in fused.items() if k != "mlp_took_stash")):
                raise EngineConformanceError(
                    "the FP8 activation quantization fused into vLLM's norm and SiLU does not give the quantizer's bytes "
                    f"or is not taken by the linear ({fused}): run with rollout.vllm_fused_quant=false and report this"
                )
        return {"mode": glue, "differ": shares, "fused_quant": fused}

    def _check_exact(self, glue: str) -> dict:
        """`exact_problems` read back from this engine; any refuses it."""
        impls = {name: m.impl for name, m in self.model.named_modules() if hasattr(m, "impl") and hasattr(m, "kv_cache")}
        config = self.llm.llm_engine.vllm_config
        method = type(getattr(self.model.lm_head, "quant_method", None)).__name__
        one_split = bool(impls) and all(getattr(i, "batch_invariant_enabled", False) for i in impls.values())
        from megatron_jetrl.patching import load_patch

        ordered = self.tp <= 2 or load_patch("vllm_0_26_0_ordered_all_reduce").applied()
        problems = exact_problems(
            impls,
            one_split,
            bool(config.model_config.disable_cascade_attn),
            glue,
            method,
            bool(config.use_v2_model_runner),
            ordered,
        )
        if problems:
            raise EngineConformanceError(
                "precision.exact_logprobs: vLLM would not compute the actor's bytes:\n  - " + "\n  - ".join(problems)
            )
        return {
            "attention": sorted({type(i).__name__ for i in impls.values()}),
            "layers": len(impls),
            "lm_head": method,
            "one_split": "process-wide batch-invariant mode" if not self.flow.rollout_fp8 else "attention backend only",
            "all_reduce": "rank order" if self.tp > 2 else "two partial sums (any order)" if self.tp == 2 else "none",
        }

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | None = None,
        *,
        request_seeds: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        sampling = sampling or SamplingParams()
        if not self.ready or self.sleeping:
            raise WeightUpdateError(
                "the vLLM engine holds no complete, verified weights (asleep, or the last update "
                "failed): sync the trainer's weights first"
            )
        if sampling.stop:
            raise ValueError("stop strings need vLLM's tokenizer, which the colocated engine does not load: use stop_token_ids")
        if request_seeds is None:
            request_seeds = request_seeds_for(sampling, len(prompts))
        seeds = list(request_seeds) if request_seeds is not None else [None] * len(prompts)
        params = [self._vllm.SamplingParams(**sampling_kwargs(sampling, s, self.eos_token_ids)) for s in seeds]
        requests = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        except Exception as e:
            raise RuntimeError(f"the vLLM engine failed while generating ({type(e).__name__}: {e})") from e
        results = [parse_output(o) for o in outputs]
        for r, s in zip(results, seeds):
            r.request_seed = s
        return results

    def kv_cache_blocks(self) -> tuple[int, int] | None:
        """(blocks, tokens a block) of the engine's KV cache, as vLLM sized it (None: not an in-process engine core)."""
        cache = getattr(self.scheduler, "cache_config", None)
        if cache is None or not cache.num_gpu_blocks:
            return None
        return int(cache.num_gpu_blocks), int(cache.block_size)

    def preemptions(self) -> int | None:
        """Requests the scheduler has preempted since the engine started (None: not an in-process engine core)."""
        return getattr(self.scheduler, "jetrl_preemptions", None)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], phases: Phases | None = None) -> dict:
        """The whole model: validated first (nothing written if refused), copied on the device, bytes compared.
        `phases` (a `Phases`) gets the seconds of each part: stream (pulling `weights`: the trainer's quantization
        and gathers), validate, copy (and compare)."""
        phases = Phases("sync/", "_s") if phases is None else phases
        with phases("stream"):
            batch = collect_batch(weights)
        with phases("validate"):
            problems = validate_weights(self.specs, batch, require_complete=True, family=self.arch.family)
        if problems:
            raise WeightUpdateError("refused a weight update; nothing was written:\n  - " + "\n  - ".join(problems[:20]))
        self.ready = False
        with phases("copy"):
            differ = apply_plan(self.arch, self.plan, self.params, batch, self.tp_rank, self.tp)
        if differ:
            raise WeightUpdateError(
                f"after the copy, vLLM's bytes differ from the trainer's in {len(differ)} tensor(s): "
                f"{differ[:5]}; the engine refuses to generate until a complete update lands"
            )
        if self.flow.trainer_kv_scales:
            sync_scale_floats(self.attention)
        self.ready = True
        if "kv_cache" not in self.sleeping:
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        return {"tensors": len(batch), "bytes": sum(t.numel() * t.element_size() for t in batch.values())}

    def mapped_bytes(self) -> int:
        """Device bytes this engine holds through vLLM's sleep-mode allocator (weights, KV cache): what a level-2 sleep
        releases and a full wake maps again. Read from the allocator, not from free memory: vLLM's sleep also runs
        `torch.cuda.empty_cache()`, which hands back the trainer's cached blocks too (5.4 GiB mapped against 14.5
        GiB more free memory at 1.5B, H100)."""
        return sum(data.handle[1] for data in _allocations())

    def unmapped_bytes(self) -> int:
        """Device bytes of this engine's allocations that sleep now: unmapped, yet still counted by torch's caching
        allocator (their tensors live on in vLLM's memory pool)."""
        return sum(data.handle[1] for data in _allocations() if data.is_asleep)

    def sleep(self) -> None:
        """Level 2: weights and KV cache are discarded (the next sync rewrites every weight)."""
        if not self.sleeping:
            self.llm.sleep(level=2)
            self.sleeping, self.ready = {"weights", "kv_cache"}, False

    def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Map the memory of the tags that sleep (vLLM maps a tag twice if asked while it is awake)."""
        tags = [t for t in tags if t in self.sleeping]
        if tags:
            self.llm.wake_up(tags)
            self.sleeping -= set(tags)
            if "kv_cache" in tags:
                self.llm.reset_prefix_cache()


def _allocations():  # pragma: no cover - needs vLLM
    """Every allocation of vLLM's sleep-mode allocator (one engine a process): its handle (size second) and state."""
    from vllm.device_allocator.cumem import CuMemAllocator

    return CuMemAllocator.get_instance().pointer_to_data.values()
