"""Compile a config's FP8 GEMM kernels ahead of its run, many at once: the minutes a cold FP8 run spends in nvcc, one
kernel after another, become one parallel wave over the node's cores.

    python -m megatron_jetrl.rl.warm_gemms CONFIG.yaml [...] [section.key=value ...] [--procs N]

DeepGEMM JIT-compiles a kernel per weight shape (N, K) and block configuration, and its heuristic picks the block
configuration from M, the rows of the call: decode batch sizes and prefill chunks in the vLLM engine, micro-batch
tokens in the trainer. A cold run meets them one by one inside its engine start-up and first step, which then take
minutes at Qwen3-8B shapes (BENCHMARKS.md). Here every FP8
linear of the config -- per rank, at the trainer's `parallel.tp` and the engines' `rollout.tp` (1 for the native
engine) -- runs through the
actor's own FP8 linear (`fp8.linear`: the same quantizers, layouts and DeepGEMM calls as the run, the engine's FProp
included) at every M where that choice can change, in `--procs` processes spread over the node's GPUs:

* FProp at M = 1, 2, 4, 8..64, every multiple of 64 up to the largest call, and every M at which a (block_m in 64,
  128, 256) x (block_n in 16..256) tiling of the output reaches one more wave of the GPU's SMs (1..10 waves): the
  points at which DeepGEMM 2.5's heuristic (csrc/jit_kernels/heuristics) can answer differently; vLLM's
  `VLLM_DEEP_GEMM_WARMUP=relax` warms at the same kind of boundary.
* DGrad and WGrad (a backward through the same linear) at those M from 128 up, in modes that train in FP8.
* Under `precision.exact_logprobs`, the lm_head's BF16 DeepGEMM GEMM (`actor.rollout_kernels.lm_head_gemm`, which both
  the actor and the engine run) at the same kind of M, up to the trainer's largest micro-batch.

Largest call: the trainer's micro-batch (grpo.micro_batch_size, or for the forward grpo.logprob_micro_batch_size, x the
longest sequence; a training micro-batch's rows lengthened to whole 128-token blocks, as `actor.train_step` does) or
the engine's prefill chunk (PREFILL_TOKENS), whichever is larger. The kernels land in the cache the run reads
(`run.jit_cache_dir`; `rl.jit_cache`). Kernels are cubins keyed by source, shape and flags, so a kernel another process is compiling at
the same moment is compiled twice and kept once. `rl.warm_cache` then runs two GRPO steps for everything else (CUDA
graphs, Triton); after this tool its JIT part is a cache read. Exit 0 with nothing to do for a BF16 config or on a
machine without a CUDA GPU (it says so); 1 if a GEMM failed (the first failure is printed); 2 for a bad config.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import sys
import time

from megatron_jetrl.fp8.gemm import token_multiple
from megatron_jetrl.models.mapping import padded_vocab_size
from megatron_jetrl.rl.config import ConfigError, load_config, split_args
from megatron_jetrl.rl.jit_cache import count_kernels, pin_cache_dirs

PREFILL_TOKENS = 16384
"""vLLM 0.26's default prefill chunk for an offline engine on a large GPU (`max_num_batched_tokens`)."""
ENGINE_ROWS = 1024
"""The most logits rows of one engine step warmed for the lm_head (vLLM 0.26's `max_num_seqs` on a large GPU)."""
VLLM_VOCAB_PADDING = 64
"""vLLM 0.26 pads its lm_head's vocabulary to a multiple of 64 before splitting it over TP (megatron: 128 x TP)."""
BACKWARD_FROM = 128
"""The smallest M warmed through backward: a training micro-batch is never fewer tokens."""


def linear_shapes(arch, tp: int) -> list[tuple[str, int, int]]:
    """(linear, N, K) of each FP8 linear of a decoder layer on one rank at tensor parallelism `tp` (fused QKV and
    gate/up as both megatron and vLLM hold them)."""
    h, hd = arch.hidden_size, arch.head_dim
    return [
        ("linear_qkv", arch.num_kv_heads * (arch.q_per_group + 2) * hd // tp, h),
        ("linear_proj", h, arch.num_heads * hd // tp),
        ("linear_fc1", 2 * arch.intermediate_size // tp, h),
        ("linear_fc2", h, arch.intermediate_size // tp),
    ]


def m_values(max_m: int, n: int, num_sms: int) -> list[int]:
    """The M at which DeepGEMM's block configuration for an [M, K] x [N, K]^T call can change, up to `max_m`."""
    ms = {1, 2, 4, *range(8, 65, 8)}
    for block_m in (64, 128, 256):
        ms.update(range(block_m, max_m + 1, block_m))
        for block_n in range(16, min(256, n) + 1, 16):
            n_blocks = math.ceil(n / block_n)
            ms.update(wave * num_sms * block_m // n_blocks for wave in range(1, 11))
    return sorted(m for m in ms if 1 <= m <= max_m)


KINDS = {"fprop": "FProp", "train": "FProp+DGrad+WGrad", "lm_head": "BF16 lm_head"}
"""What a work item runs at each of its M: the FP8 forward; forward and backward (FProp, DGrad, WGrad); the BF16
lm_head GEMM of `precision.exact_logprobs` (`actor.rollout_kernels.lm_head_gemm`, DeepGEMM's, JIT-compiled too)."""


def work_items(cfg, num_sms: int, procs: int) -> list[tuple[int, int, list[int], str]]:
    """(N, K, M values, kind in KINDS) per chunk: every shape's M list cut into contiguous pieces (DeepGEMM's choice
    moves with M, so a piece mostly meets kernels no other piece needs) so that `procs` processes share them evenly."""
    flow, arch = cfg.precision, cfg.arch()
    tps = {cfg.parallel.tp} if flow.train_fp8 else set()
    if flow.rollout_fp8:  # the native engine holds the whole model on one GPU
        tps.add(cfg.rollout.tp if cfg.rollout.engine == "vllm" else 1)
    max_len = cfg.rollout.window(arch.max_position_embeddings)
    shards = cfg.parallel.tp if cfg.parallel.sequence_parallel else 1  # train_step lengthens the rows to whole 128-token blocks
    multiple = token_multiple(cfg.grpo.micro_batch_size, shards)  # (each TP rank's share of them, under sequence parallelism)
    train_m = cfg.grpo.micro_batch_size * -(-max_len // multiple) * multiple
    logprob_m = cfg.grpo.logprob_batch * max_len
    fwd, bwd = {}, {}  # (N, K) -> M values; a shape two linears share (Qwen3-8B's TP 4 fc1 is its TP 1 QKV) once
    for tp in sorted(tps):
        for _, n, k in linear_shapes(arch, tp):
            fwd.setdefault((n, k), set()).update(m_values(max(PREFILL_TOKENS, train_m, logprob_m), n, num_sms))
            if flow.train_fp8 and tp == cfg.parallel.tp:  # DGrad's output is K wide: its choice follows K as FProp's N
                bwd.setdefault((n, k), set()).update(
                    m for size in (n, k) for m in m_values(train_m, size, num_sms) if m >= BACKWARD_FROM
                )
    lists = [(n, k, sorted(ms - bwd.get((n, k), set())), "fprop") for (n, k), ms in fwd.items()]
    lists += [(n, k, sorted(ms), "train") for (n, k), ms in bwd.items()]
    if flow.exact_logprobs:  # the trainer's logits (micro-batch rows) and the engine's (a row per request and step)
        heads = {}
        n = padded_vocab_size(arch.vocab_size, cfg.parallel.tp) // cfg.parallel.tp
        heads.setdefault(n, set()).update(m_values(max(train_m, logprob_m), n, num_sms))
        n = -(-arch.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING // cfg.rollout.tp
        heads.setdefault(n, set()).update(m_values(ENGINE_ROWS, n, num_sms))
        lists += [(n, arch.hidden_size, sorted(ms), "lm_head") for n, ms in heads.items()]
    lists = [item for item in lists if item[2]]
    pieces = max(1, math.ceil(procs / max(1, len(lists))))
    items = []
    for n, k, ms, kind in lists:
        size = math.ceil(len(ms) / pieces)
        items += [(n, k, list(ms[i : i + size]), kind) for i in range(0, len(ms), size)]
    return sorted(items, key=lambda it: -len(it[2]) * (3 if it[3] == "train" else 1))


def _run_item(flow, n: int, k: int, ms: list[int], kind: str, device) -> None:
    import torch

    from megatron_jetrl.fp8.linear import QuantizedWeight, fp8_linear, fp8_linear_forward

    weight = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
    x = torch.randn(max(ms), k, device=device, dtype=torch.bfloat16)
    if kind == "lm_head":
        from megatron_jetrl.actor.rollout_kernels import lm_head_gemm

        for m in ms:
            lm_head_gemm(x[:m], weight)
        torch.cuda.synchronize(device)
        return
    weight.requires_grad_(True)
    weight.main_grad = torch.zeros(n, k, dtype=torch.float32, device=device)  # megatron DDP's buffer: WGrad accumulates into it
    weight_q = QuantizedWeight.quantize(weight.detach(), flow, transposed=True)
    for m in ms:
        if kind == "train":
            xm = x[:m].detach().requires_grad_(True)
            y = fp8_linear(xm, weight, flow=flow, weight_q=weight_q)
            y.backward(torch.ones_like(y))
        else:
            with torch.no_grad():
                fp8_linear_forward(x[:m], weight_q, flow=flow)
    torch.cuda.synchronize(device)


def _worker(gpu: int, jit_cache_dir: str, flow_dict: dict, queue, results) -> None:
    pin_cache_dirs(jit_cache_dir)
    import torch

    from megatron_jetrl.fp8.flow import PrecisionFlow

    torch.cuda.set_device(gpu)
    flow = PrecisionFlow.from_dict(flow_dict)
    while (item := queue.get()) is not None:
        n, k, ms, kind = item
        error = None
        for _ in range(2):  # a kernel another process renamed into the cache first: the second call reads it
            try:
                _run_item(flow, n, k, ms, kind, torch.device("cuda", gpu))
                error = None
                break
            except Exception as e:  # noqa: BLE001 -- reported with its item below
                error = f"{type(e).__name__}: {e}"
        results.put((n, k, len(ms), kind, error))


def warm(cfg, procs: int) -> int:
    import torch

    dirs = pin_cache_dirs(cfg.run.jit_cache_dir)
    gpus = torch.cuda.device_count()
    items = work_items(cfg, torch.cuda.get_device_properties(0).multi_processor_count, procs)
    if not items:
        print(f"warm_gemms: precision.mode={cfg.precision.mode} runs no FP8 GEMM: nothing to compile")
        return 0
    before, t0 = count_kernels(dirs), time.monotonic()
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    for item in items:
        queue.put(item)
    workers = [
        ctx.Process(target=_worker, args=(i % gpus, cfg.run.jit_cache_dir, cfg.precision.to_dict(), queue, results))
        for i in range(min(procs, len(items)))
    ]
    for w in workers:
        queue.put(None)
        w.start()
    failed = []
    for done in range(1, len(items) + 1):
        n, k, count, kind, error = results.get()
        if error:
            failed.append(f"[{n}, {k}] {KINDS[kind]} at {count} M values: {error}")
        if done % max(1, len(items) // 10) == 0 or done == len(items):
            print(
                f"warm_gemms: {done}/{len(items)} pieces, {count_kernels(dirs) - before} kernels compiled, "
                f"{time.monotonic() - t0:.0f} s",
                flush=True,
            )
    for w in workers:
        w.join()
    calls = sum(len(ms) for _, _, ms, _ in items)
    print(
        f"warm_gemms: {count_kernels(dirs)} kernels in {dirs['deep_gemm']} ({count_kernels(dirs) - before} new) from "
        f"{calls} GEMM calls over {len({(n, k) for n, k, _, _ in items})} shapes, {len(workers)} processes on {gpus} "
        f"GPU(s), {time.monotonic() - t0:.0f} s"
    )
    for line in failed[:5]:
        print(f"warm_gemms: FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True)
    parser.add_argument("--procs", type=int, default=0, help="processes (default: the CPU cores, at most 64)")
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    import torch

    if not torch.cuda.is_available():
        print("warm_gemms: no CUDA GPU here: nothing is JIT-compiled on this machine")
        return 0
    try:
        cfg = load_config(*split_args(rest))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if cfg.run.device_type() != "cuda":
        print("warm_gemms: this config runs on the CPU, where nothing is JIT-compiled: nothing to warm")
        return 0
    return warm(cfg, known.procs or min(64, os.cpu_count() or 1))


if __name__ == "__main__":
    sys.exit(main())
