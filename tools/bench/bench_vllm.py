"""vLLM 0.26.0 as the rollout engine on one GPU, or one engine over TP GPUs: engine start, on-device weight sync, decode tokens/s.

    python tools/bench/bench_vllm.py --mode jetrl [--layers 36] [--batches 64 128 256] [--prompt 256] [--new 512] --json out.json
    python tools/bench/bench_vllm.py --mode bf16 ...         # the same engine in BF16 (vLLM's own BF16 kernels)
    python tools/bench/bench_vllm.py --mode jetrl --kv-cache fp8 ...  # with an FP8 KV cache (precision.kv_cache)
    torchrun --nproc-per-node 4 tools/bench/bench_vllm.py --tp 4 --mode jetrl ...   # rollout TP 4, as rollout.tp=4 runs it

One engine per process (vLLM's external launcher on a one-rank NCCL group, as the trainer runs it), or with --tp one
engine's TP rank per process (every rank passes the same prompts and seeds, as the colocated pool does; rank 0 prints
and writes the JSON, with its own share of the linears as `linear_GB` and its NCCL time in the profile), built by
`megatron_jetrl.rollout.vllm_engine.VllmEngine` with the shipped settings: the trainer's numerics pinned and checked
at start-up, CUDA graphs + torch.compile unless --eager. Qwen3-8B shapes (hidden 4096, 32/8 heads, 12288 MLP,
vocab 151936), random weights made on the device and quantized by the flow, as the trainer's FP8 bytes are.

* start: seconds to a ready engine (the DeepGEMM JIT cache in ~/.deep_gemm decides cold vs warm);
* sync: `VllmEngine.update_weights` of the whole model (validate, copy into vLLM's parameters, compare the bytes:
  what every GRPO step does), best and median of --sync-reps, against the device copy rate measured here; and one
  full pool cycle from sleep (wake weights, sync, wake KV cache);
* decode: batch x (prompt, new) with ignore_eos, random prompt tokens; the first run of each batch (DeepGEMM
  JIT-compiles new shapes inside it) and the best of --reps after it (--reps 0: the first run only, for long
  responses whose decode dwarfs the compile; where DeepGEMM compiled kernels inside it, the JSON's
  `compiled_in_timed_run` counts them and the line says it is not a rate: warm the engine's shapes first). tokens/s counts generated tokens. The engine is built for the largest
  batch (`max_num_seqs`, as the trainer builds it for its share of a step), and each batch records how many of its
  sequences the KV cache holds at their full length (`at_once`, from vLLM's block count) and the preemptions;
* profile (--profile-batch B ...): one decode step's kernel time by category at each batch B, measured at the timed
  runs' mean KV-cache length, and the bytes of the layers' linear weights (`linear_GB`). From a jetrl and a bf16 run
  tools/bench/rollout_report.py computes what FP8 weights can buy at that setting (its ceiling table).
Needs the vLLM kit (shared/kits/README.md); tools/gpu/gpu_vllm.sh runs both modes and prints the table.

The engine's attention is pinned as a run's would be: `--exact-logprobs auto` resolves as a run config of this mode,
rollout TP and KV cache does (`rl.resolve`: on for jetrl at TP 1 and 2), and exact logprobs pin vLLM's attention to
the actor's kernels (one KV split; with an FP8 cache FA3's two-warpgroup kernel and the trainer's K/V scales, here
1.0). `--exact-logprobs false --pins one-split` (or `fp8-tile`) applies one pin alone, to see what each costs.

`--variant` measures what a setting would buy, in the same process layout (the JSON records it; tools/bench/rollout_report.py
puts each variant in its own column):
* shipped: the engine as the trainer builds it (numerics pinned and checked; `rollout.glue: auto`, i.e. the trainer's
  RMSNorm and RoPE, full CUDA graphs of decode steps, no torch.compile; in jetrl the norms and SiLU write the FP8
  input of the linear after them, `rollout.vllm_fused_quant`);
* unfused-quant (jetrl only): the shipped engine with vLLM's own quantizer kernel before each FP8 linear, instead of
  the norms and SiLU writing the FP8 input (`rollout.vllm_fused_quant=false`; same bytes, still checked at start-up);
* vllm-glue: vLLM's own RMSNorm and RoPE (`rollout.glue: vllm`) in its compiled engine (torch.compile, the
  byte-changing fusion passes off; the start-up check still runs): what the trainer's glue costs against it;
* fused (jetrl only): vLLM's default compilation with its own glue, whose passes fuse RMSNorm+quant and SiLU-mul+quant into kernels with
  their own scale floor and no BF16 rounding before the quantizer. The bytes are no longer the trainer's, so the
  start-up check is skipped (`VllmEngine(verify_numerics=False)`): an upper bound for adopting those numerics, not a
  rollout setting;
* triton-attn: vLLM's Triton attention backend instead of FlashAttention 3 (the numerics check still runs);
* cutlass-gemm (jetrl only): `VLLM_USE_DEEP_GEMM=0`, so that vLLM's FP8 linears run its CUTLASS block kernel instead
  of DeepGEMM (same activation quantizer and bytes; another reduction order than the trainer's DeepGEMM): whether
  DeepGEMM's small-M GEMMs (74% of the copy rate at batch 128, BENCHMARKS.md) are what holds decode back;
* triton-gemm (jetrl only): `linear_backend="triton"`, vLLM's Triton block-FP8 kernel (`TritonFp8BlockScaledMMKernel`,
  same quantizer and bytes, another reduction order; with vLLM's quantizer before each linear, since these linears
  do not take the bytes the fused norm and SiLU leave: the start-up probe refuses that pairing; vLLM 0.26 ships no tuned configs for Qwen3-8B's shapes, so its
  default launch settings): whether a kernel other than DeepGEMM's, whose 64-row tiles read the narrow linears'
  weights at 62-69% of the copy rate at batch 128, does better there;
* unseeded: the shipped engine, sampling without per-request seeds. With seeds (what the rollout pool passes, so that
  a prompt samples the same tokens whichever engine serves it) vLLM 0.26's V1 sampler draws each request's noise in a
  Python loop, one kernel per request and step (`random_sample` in `v1/sample/ops/topk_topp_sampler.py`): whether that
  host work is what holds FP8 decode back once its GPU time is shorter than BF16's;
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_jetrl.fp8 import PrecisionFlow, QuantizedWeight  # noqa: E402
from megatron_jetrl.models import ModelArch  # noqa: E402
from megatron_jetrl.models.mapping import KV_SCALE_SUFFIXES  # noqa: E402
from megatron_jetrl.rollout.engine import SamplingParams  # noqa: E402
from megatron_jetrl.rollout.native import expected_tensors  # noqa: E402
from tools.bench import common  # noqa: E402
from tools.bench.rollout_report import attention_label  # noqa: E402

QWEN3_8B = dict(common.QWEN3_8B, eos_token_id=151645)


def device_stream(arch: ModelArch, flow: PrecisionFlow, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every HF tensor of the model on the GPU: FP8 bytes + scales quantized by the flow, BF16 rest."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for name, (shape, dtype) in expected_tensors(arch, flow).items():
        if name.endswith(".weight_scale_inv"):
            continue
        if name.endswith(KV_SCALE_SUFFIXES):  # the trainer's Q/K/V scales (exact logprobs with an FP8 cache)
            out[name] = torch.ones(shape, device="cuda", dtype=dtype)
            continue
        w = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
        w = w * (0.02 if len(shape) == 2 else 0.05) + (1.0 if "norm" in name else 0.0)
        if dtype == torch.float8_e4m3fn:
            q = QuantizedWeight.quantize(w, flow)
            out[name], out[name.removesuffix(".weight") + ".weight_scale_inv"] = q.q, q.s
        else:
            out[name] = w
    return out


def linear_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes a decode step reads for the decoder layers' linear weights (FP8 bytes and scales, or BF16): every 2-D
    tensor under `model.layers.` (the norms' weights are 1-D; the embedding and lm_head sit outside the layers)."""
    return sum(t.numel() * t.element_size() for name, t in tensors.items() if ".layers." in name and t.dim() == 2)


def profile_context(prompt: int, new: int, steps: int, context: int | None, error) -> int:
    """The profiled prompts' length: `context`, or the timed runs' mean decode context centred on the profiled steps.
    `error(message)` (argparse's) when the window does not fit the engine's `prompt + new` tokens."""
    if steps < 3:
        error(f"--profile-steps must be at least 3 (the profile subtracts a 2-token generate), got {steps}")
    context = prompt + new // 2 - steps // 2 if context is None else context
    if context < 1 or context + steps > prompt + new:
        error(
            f"the profiled window (prompt {context}, {steps} steps) does not fit the engine's {prompt} + {new} tokens: "
            "give --profile-context and --profile-steps with context + steps <= prompt + new"
        )
    return context


def deep_gemm_cache_dir() -> Path:
    """Where DeepGEMM keeps its JIT-compiled kernels in a vLLM process: DG_JIT_CACHE_DIR, which vLLM 0.26 sets to
    $VLLM_CACHE_ROOT/deep_gemm when unset (`vllm/utils/deep_gemm.py`; VLLM_CACHE_ROOT defaults to
    $XDG_CACHE_HOME/vllm, else ~/.cache/vllm). Its kernel count before the engine starts tells a cold start from a warm one."""
    root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "vllm"
    )
    return Path(os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(root, "deep_gemm")).expanduser()


def kernels_cached() -> int:
    """DeepGEMM kernels compiled into the cache so far (`deep_gemm_cache_dir`)."""
    return len(list(deep_gemm_cache_dir().glob("**/*.cubin")))


def copy_rate_gbps(nbytes: int = 4 << 30) -> float:
    """The device's copy rate (GB/s read + written) over two `nbytes` buffers, handed back to the device after."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    rate = 2 * nbytes * 10 / (time.perf_counter() - t0) / 1e9
    del a, b
    torch.cuda.empty_cache()  # vLLM sizes its memory from what the device has free
    return rate


VARIANTS = ("shipped", "unfused-quant", "vllm-glue", "fused", "triton-attn", "cutlass-gemm", "triton-gemm", "unseeded")


def variant_settings(variant: str, mode: str) -> tuple[dict, bool]:
    """(extra `vllm.LLM` keyword arguments, verify_numerics) of a --variant; ValueError for a variant the mode lacks."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown --variant {variant!r}; choose one of {VARIANTS}")
    if variant == "fused":
        if mode != "jetrl":
            raise ValueError("--variant fused changes how activations are quantized: it applies to --mode jetrl only")
        return {"compilation_config": None, "glue": "vllm"}, False  # None: vLLM's default compilation (fusions on)
    if variant == "triton-attn":
        return {"attention_config": {"backend": "TRITON_ATTN"}}, True
    if variant == "cutlass-gemm":
        if mode != "jetrl":
            raise ValueError("--variant cutlass-gemm picks vLLM's FP8 GEMM kernel: it applies to --mode jetrl only")
        return {"env": {"VLLM_USE_DEEP_GEMM": "0"}}, True
    if variant == "triton-gemm":
        if mode != "jetrl":
            raise ValueError("--variant triton-gemm picks vLLM's FP8 GEMM kernel: it applies to --mode jetrl only")
        return {"linear_backend": "triton", "fused_quant": False}, True  # its linears do not take the fused norm's bytes
    if variant == "vllm-glue":
        return {"glue": "vllm"}, True
    if variant == "unfused-quant":
        if mode != "jetrl":
            raise ValueError(
                "--variant unfused-quant changes where FP8 activations are quantized: it applies to --mode jetrl only"
            )
        return {"fused_quant": False}, True
    return {}, True


PINS = {"one-split": "vllm_0_26_0_one_split_attention", "fp8-tile": "vllm_0_26_0_fp8_attention_tile"}
"""--pins: the exact-logprob pins of vLLM's attention, each the patch that makes it."""


def attention_setting(mode: str, tp: int, kv_cache: str, exact: str, pins: list[str]) -> tuple[bool, list[str]]:
    """(exact_logprobs, pins to apply alone) of a run: `exact` auto resolves as a run config at this mode, rollout TP
    and KV cache does (`rl.resolve`). ValueError for pins beside exact logprobs (which apply them all) or a tile pin
    without an FP8 cache."""
    if exact == "auto":
        from megatron_jetrl.rl.config import load_config, split_args

        model = str(Path(__file__).resolve().parents[2] / "configs" / "models" / "qwen3-8b-base.yaml")  # this model's heads
        overrides = [f"precision.mode={mode}", "rollout.engine=vllm", f"rollout.tp={tp}", f"parallel.tp={tp}"]
        on = load_config(*split_args([model, *overrides, f"precision.kv_cache={kv_cache}"])).precision.exact_logprobs
    else:
        on = exact == "true"
    if pins and on:
        raise ValueError(f"--pins {' '.join(pins)} applies pins alone: exact logprobs apply them all; add --exact-logprobs false")
    if "fp8-tile" in pins and kv_cache != "fp8":
        raise ValueError("--pins fp8-tile pins FA3's FP8 kernel: it needs --kv-cache fp8")
    return on, list(pins)


def sampling_seed(variant: str) -> int | None:
    """The decode runs' `SamplingParams.seed`: per-request seeds from 1, or none for --variant unseeded."""
    return None if variant == "unseeded" else 1


DECODE_CATEGORIES = (  # (category, kernel-name substrings), first match wins; names compared lower-case. NCCL first
    # (rollout TP: the row-parallel all-reduces); attention next: FlashAttention 3's kernels are CUTLASS device kernels;
    # quantizers before GEMMs (DeepGEMM's names say fp8)
    ("NCCL", ("nccl",)),
    ("attention", ("flash", "fmha", "attn", "attention", "paged")),
    ("act quant", ("quant",)),
    ("GEMM FP8", ("fp8_gemm", "deep_gemm", "sm90_fp8", "w8a8", "scaled_mm", "blockwise")),
    ("GEMM BF16", ("nvjet", "xmma", "cutlass", "gemm", "cublas", "sm90_")),
    ("norm", ("rms", "norm")),
    ("rope", ("rotary", "rope")),
    ("SiLU*mul", ("act_and_mul", "silu")),
    ("sampling", ("sampl", "softmax", "topk", "top_k", "argmax", "exponential", "sort", "gumbel", "logsumexp", "log_prob")),
    ("copy/fill", ("copy", "memcpy", "memset", "fill", "cat")),
)


def decode_category(kernel: str) -> str:
    low = kernel.lower()
    return next((c for c, keys in DECODE_CATEGORIES if any(k in low for k in keys)), "other")


GAP_BINS_US = (4, 20, 200)
"""Upper edges of the idle-gap bins (us) in decode_profile: back-to-back kernels of one graph, short launches, host."""


def _kernels(run) -> tuple[dict[str, float], float, list[float]]:
    """Kernel ms by name, the ms some kernel ran (overlaps merged) and the idle ms between kernels per GAP_BINS_US bin
    (and above the last) of one profiled `run()`."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return kernel_timeline(
        sorted(
            (e.start_ns(), e.end_ns(), e.name())
            for e in prof.profiler.kineto_results.events()
            if e.device_type() == DeviceType.CUDA and e.end_ns() > e.start_ns()
        )
    )


def kernel_timeline(ivs: list[tuple[int, int, str]]) -> tuple[dict[str, float], float, list[float]]:
    """_kernels' sums over (start ns, end ns, name) intervals sorted by start."""
    by_name: dict[str, float] = {}
    gaps = [0.0] * (len(GAP_BINS_US) + 1)
    busy, cur = 0, None
    for start, end, name in ivs:
        by_name[name] = by_name.get(name, 0.0) + (end - start) / 1e6
        if cur is None or start > cur[1]:
            if cur is not None:
                busy += cur[1] - cur[0]
                gap_us = (start - cur[1]) / 1e3
                gaps[sum(gap_us >= edge for edge in GAP_BINS_US)] += gap_us / 1e3
            cur = [start, end]
        cur[1] = max(cur[1], end)
    busy += 0 if cur is None else cur[1] - cur[0]
    return by_name, busy / 1e6, gaps


def decode_profile(engine, prompts, steps: int = 64, seed: int | None = 1) -> dict:
    """Where one decode step's time goes: torch.profiler over a generate of `steps` new tokens minus one of 2 (prefill
    and the first token cancel), per decode step: wall ms, GPU-busy ms, kernel ms by category, the top kernels, and
    the GPU's idle ms by gap length (gaps of a few us sit between the kernels of one CUDA graph; long ones wait on
    the host). `context`: the mean KV-cache length of the measured steps (prompt + steps / 2)."""
    per = {}
    for new in (2, steps):
        sampling = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=seed)
        engine.generate(prompts, sampling)  # warm: this batch and length's graphs and JIT
        wall = min(timed(lambda: engine.generate(prompts, sampling)) for _ in range(2))
        kernels, busy, gaps = _kernels(lambda: engine.generate(prompts, sampling))
        per[new] = (wall * 1e3, busy, kernels, gaps)
    n = steps - 2
    (w2, b2, k2, g2), (w, b, k, g) = per[2], per[steps]
    names = set(k) | set(k2)
    step_k = {name: (k.get(name, 0.0) - k2.get(name, 0.0)) / n for name in names}
    cats: dict[str, float] = {}
    for name, ms in step_k.items():
        cats[decode_category(name)] = cats.get(decode_category(name), 0.0) + ms
    top = sorted(step_k.items(), key=lambda kv: -kv[1])[:12]
    return {
        "batch": len(prompts),
        "steps": n,
        "context": len(prompts[0]) + steps / 2,
        "wall_ms": (w - w2) / n,
        "busy_ms": (b - b2) / n,
        "kernel_ms": sum(step_k.values()),
        "categories": cats,
        "top": [[name[:120], ms] for name, ms in top],
        "idle_ms_by_gap_us": {label: (g[i] - g2[i]) / n for i, label in enumerate(_gap_labels())},
    }


def _gap_labels() -> list[str]:
    edges = (0, *GAP_BINS_US)
    return [f"{lo}-{hi}" for lo, hi in zip(edges, edges[1:])] + [f">{GAP_BINS_US[-1]}"]


def print_decode_profile(tag: str, p: dict) -> None:
    print(
        f"[{tag}] decode step at batch {p['batch']}, context ~{p['context']:.0f} (mean of {p['steps']} steps): wall {p['wall_ms']:.3f} ms, GPU busy "
        f"{p['busy_ms']:.3f} ms, kernels {p['kernel_ms']:.3f} ms",
        flush=True,
    )
    idle = ", ".join(f"{label} us {ms:.3f}" for label, ms in p.get("idle_ms_by_gap_us", {}).items())
    print(f"[{tag}]   GPU idle ms by gap length: {idle}", flush=True)
    for cat, ms in sorted(p["categories"].items(), key=lambda kv: -kv[1]):
        print(f"[{tag}]   {cat:<12} {ms:8.3f} ms", flush=True)
    for name, ms in p["top"]:
        print(f"[{tag}]     {ms:8.3f} ms  {name}", flush=True)


def at_once(blocks: tuple[int, int] | None, batch: int, length: int) -> int | None:
    """How many of `batch` sequences of `length` tokens a KV cache of (blocks, tokens a block) holds at once (None:
    the engine did not say its size). vLLM keeps one block back (its null block)."""
    if blocks is None:
        return None
    count, size = blocks
    return min(batch, (count - 1) // -(-length // size))


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="jetrl", choices=["jetrl", "bf16"])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batches", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2, help="timed runs after the first of each batch (0: the first only)")
    ap.add_argument("--sync-reps", type=int, default=5)
    ap.add_argument("--kv-gb", type=float, default=24.0)
    ap.add_argument(
        "--kv-cache",
        default="bf16",
        choices=["bf16", "fp8"],
        help="the engine's KV cache (precision.kv_cache; fp8 with vLLM's own scales: the kernels a run with the "
        "trainer's scales runs, without the exact-logprob pins)",
    )
    ap.add_argument(
        "--exact-logprobs",
        default="auto",
        choices=["auto", "true", "false"],
        help="precision.exact_logprobs of the engine's flow (auto: as a run at this mode, TP and cache resolves it; "
        "on, vLLM's attention is pinned to the actor's kernels)",
    )
    ap.add_argument(
        "--pins",
        nargs="+",
        default=[],
        choices=sorted(PINS),
        help="with --exact-logprobs false: these pins of vLLM's attention alone (one KV split; FA3's FP8 kernel "
        "choice), to see what each costs",
    )
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--variant", default="shipped", choices=VARIANTS, help="see the module docstring (default: shipped)")
    ap.add_argument(
        "--profile-batch",
        type=int,
        nargs="+",
        default=None,
        help="after the timings, where one decode step's time goes at each of these batches (torch.profiler; see decode_profile)",
    )
    ap.add_argument("--profile-steps", type=int, default=64, help="decode steps profiled per batch (default 64)")
    ap.add_argument(
        "--profile-context",
        type=int,
        default=None,
        help="prompt length of the profiled generates (default: the timed runs' mean decode context, "
        "prompt + new/2 - steps/2, so that the profiled steps' KV cache is the average one)",
    )
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="one engine over this many GPUs (vLLM TP, as rollout.tp); run it under torchrun --nproc-per-node TP (default 1)",
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.tp < 1 or world != a.tp:
        ap.error(
            f"--tp {a.tp} runs one process per GPU of the engine: start it as torchrun --nproc-per-node {a.tp} "
            f"tools/bench/bench_vllm.py --tp {a.tp} ... (this is {world} process(es))"
        )
    try:
        extra, verify = variant_settings(a.variant, a.mode)
        exact, pins = attention_setting(a.mode, a.tp, a.kv_cache, a.exact_logprobs, a.pins)
    except ValueError as e:
        ap.error(str(e))
    if a.eager and a.variant == "fused":
        ap.error("--variant fused needs torch.compile (its passes do the fusing): leave out --eager")
    if a.reps < 0 or not a.batches:
        ap.error(f"--reps must be >= 0 and --batches non-empty, got --reps {a.reps} --batches {a.batches}")
    if a.profile_batch:
        a.profile_context = profile_context(a.prompt, a.new, a.profile_steps, a.profile_context, ap.error)

    import torch.distributed as dist

    from megatron_jetrl.patching import load_patch
    from megatron_jetrl.rollout.colocated import ColocatedPool
    from megatron_jetrl.rollout.vllm_engine import VllmEngine, engine_env, pin_environment, write_model_dir

    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29631", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
        os.environ.setdefault(k, v)
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", rank=rank, world_size=a.tp)
    if rank:  # every rank runs the engine; rank 0 speaks
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the process's life
    fp8_cache_scales = "fixed" if exact else "engine"  # the trainer's scales under exact logprobs, else vLLM's own
    flow = PrecisionFlow(
        a.mode, exact_logprobs=exact, kv_cache=a.kv_cache, kv_scales=fp8_cache_scales if a.kv_cache == "fp8" else "none"
    )
    pin_environment(engine_env(flow, extra.get("env")))  # before a pin's patch imports vLLM, as the engine would
    for pin in pins:
        load_patch(PINS[pin]).apply()
    copy_gbps = copy_rate_gbps()  # before the engine takes the memory (its weights and KV cache leave no 8 GiB on an H100)
    config = dict(QWEN3_8B, num_hidden_layers=a.layers)
    arch = ModelArch.from_hf_config(config)
    res = {
        "mode": a.mode,
        "variant": a.variant,
        "kv_cache": a.kv_cache,
        "exact_logprobs": exact,
        "pins": pins,
        "kv_gb": a.kv_gb,
        "layers": a.layers,
        "tp": a.tp,
        "eager": a.eager,
        "device": torch.cuda.get_device_name(),
        "prompt": a.prompt,
        "new_tokens": a.new,
        "deep_gemm_cache": str(deep_gemm_cache_dir()),
        "deep_gemm_cache_entries": kernels_cached(),
    }
    model_dir = write_model_dir(Path(tempfile.mkdtemp()), config, flow)
    t0 = time.perf_counter()
    engine = VllmEngine(
        model_dir,
        flow,
        tp=a.tp,
        tp_rank=rank,
        eos_token_ids=[config["eos_token_id"]],
        seed=0,
        kv_cache_memory_bytes=int(a.kv_gb * 2**30),
        gpu_memory_utilization=0.9,
        enforce_eager=a.eager,
        max_model_len=a.prompt + a.new + 16,
        max_num_seqs=max(a.batches),
        verify_numerics=verify,
        **extra,
    )
    res["start_s"] = time.perf_counter() - t0
    res["numerics"] = engine.numerics
    res["kv_cache_blocks"] = engine.kv_cache_blocks()  # (blocks, tokens a block)
    batch = device_stream(arch, flow)
    res["model_GB"] = sum(t.numel() * t.element_size() for t in batch.values()) / 1e9
    res["linear_GB"] = linear_bytes(batch) / a.tp / 1e9  # one rank's share: TP splits every linear
    times = [timed(lambda: engine.update_weights(batch.items())) for _ in range(a.sync_reps)]
    res["sync_best_s"], res["sync_median_s"] = min(times), statistics.median(times)
    res["sync_GBps"] = res["model_GB"] / res["sync_best_s"]
    res["copy_GBps"] = copy_gbps
    pool = ColocatedPool(engine, rollout_tp=a.tp)
    pool.sleep()
    res["pool_cycle_s"] = timed(lambda: pool.sync(batch.items()))
    res["pool_cycle_parts"] = pool.last_sync.parts
    del batch
    torch.cuda.empty_cache()
    print(
        f"[{a.mode} {a.variant}] start {res['start_s']:.1f} s ({res['deep_gemm_cache_entries']} DeepGEMM kernels cached before it), sync best {res['sync_best_s']:.3f} s ({res['sync_GBps']:.0f} GB/s, "
        f"copy {res['copy_GBps']:.0f} GB/s), pool cycle {res['pool_cycle_s']:.3f} s",
        flush=True,
    )

    g = torch.Generator().manual_seed(0)
    res["decode"] = {}
    for b in a.batches:
        prompts = torch.randint(0, arch.vocab_size - 1, (b, a.prompt), generator=g).tolist()
        sampling = SamplingParams(temperature=1.0, max_new_tokens=a.new, ignore_eos=True, seed=sampling_seed(a.variant))
        before = engine.preemptions() or 0
        cached = kernels_cached()
        runs = [timed(lambda: engine.generate(prompts, sampling)) for _ in range(1 + a.reps)]
        compiled = kernels_cached() - cached  # by the first run: a --reps 0 rate with compiles inside is no rate
        res["decode"][b] = {
            "first_tok_s": b * a.new / runs[0],
            "best_tok_s": b * a.new / min(runs[1:] or runs),
            "compiled_in_timed_run": compiled if not a.reps else 0,
            "preemptions_per_run": ((engine.preemptions() or 0) - before) / len(runs),
            "at_once": at_once(res["kv_cache_blocks"], b, a.prompt + a.new),
            "capacity": at_once(res["kv_cache_blocks"], sys.maxsize, a.prompt + a.new),  # sequences at full length
        }
        d = res["decode"][b]
        print(
            f"[{a.mode} {a.variant} kv {a.kv_cache} attention {attention_label(res)}] batch {b}: first {d['first_tok_s']:.0f} tok/s, best "
            f"{d['best_tok_s']:.0f} tok/s, {d['at_once']} of {b} held at full length (room for {d['capacity']}), {d['preemptions_per_run']:.0f} "
            "preemptions a run"
            + (
                f"; NOT A RATE: {d['compiled_in_timed_run']} DeepGEMM kernels compiled inside it"
                if d["compiled_in_timed_run"]
                else ""
            ),
            flush=True,
        )
    res["decode_profiles"] = {}
    for b in a.profile_batch or ():
        prompts = torch.randint(0, arch.vocab_size - 1, (b, a.profile_context), generator=g).tolist()
        p = decode_profile(engine, prompts, steps=a.profile_steps, seed=sampling_seed(a.variant))
        res["decode_profiles"][str(b)] = p
        print_decode_profile(f"{a.mode} {a.variant}", p)
    if a.json and rank == 0:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
