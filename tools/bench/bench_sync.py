#!/usr/bin/env python3
"""Per-step weight sync cost, trainer -> native rollout engine, for an 8B-shaped model (one GPU; two for TP2).

    PYTHONPATH=. python3 tools/bench/bench_sync.py [--layers 36] [--repeats 3] [--json PATH]         # 1 GPU: TP1 only
    PYTHONPATH=. torchrun --nproc-per-node=2 tools/bench/bench_sync.py [...]                         # + TP2 gather over NCCL
    PYTHONPATH=. python3 tools/bench/bench_sync.py --tiny                                            # CPU smoke run

Model: random BF16 weights with Qwen3-8B shapes (hidden 4096, intermediate 12288, 32 heads, 8 KV heads,
head_dim 128, vocab 151936, untied lm_head), `--layers` of them (36 = the real model; with fewer, the
times are also shown scaled linearly to 36 layers, embedding and lm_head counted once). The trainer side
is the megatron-layout parameter set of a TP1 actor (fused linear_qkv per query group, fc1 = [gate; up]),
made from HF-named random tensors through the one mapping (`models.mapping.rank_slice` + `from_hf`).

What one sync is, per precision mode (`PrecisionFlow.mode`):

* `bf16`: `models.export.hf_tensors` yields every tensor in BF16 -> `rollout.sync.stream_weights` (buckets,
  uint8 wire pack/unpack) -> `rollout.native.NativeEngine.update_weights` (validate, copy) on the same GPU.
* `jetrl`: after an optimizer step the trainer re-quantizes each linear once (`QuantizedWeight.quantize`,
  128x128 blocks; what `actor.fp8_layers` caches and the forward uses); the sync ships exactly those bytes
  (`fetch_fp8` = the cache) + FP32 `weight_scale_inv`; embeddings, lm_head and norms in BF16.
* `bf16-train-fp8-rollout`: the trainer has no FP8 weights, so `hf_tensors` quantizes inside the sync
  (`quantize_ranks`); the same bytes on the wire as `jetrl`.

Phases, each timed with a device synchronize around it (median of `--repeats`):
  quantize   re-quantize all linears (jetrl: the trainer's cost after a step, paid once, also used by the forward)
  export     iterate `hf_tensors` only (megatron -> HF cut: q/k/v split per group, gate/up split; quantization
             for bf16-train-fp8-rollout)
  +wire      `stream_weights` into a sink engine that keeps nothing: export + bucketing + pack/unpack
  total      `stream_weights` into a real `NativeEngine`: + validation + the engine's copy
The engine's received bytes are checked against the export (bitwise), and it scores a short sequence.

TP2 (world size 2): each rank holds its megatron TP2 shards of the same weights; per sync each rank
re-quantizes its shards, rank 0 all-gathers every shard over NCCL (FP8 bytes as uint8, scales, the
vocab-parallel BF16 embeddings; replicated norms are not sent) and runs export + stream into its engine.
The exported stream is checked bit-equal to the TP1 export.

Live actor (`--actor-tp 1 2`, needs megatron-core): a megatron GPTModel of the same shapes (native spec,
BF16 params, megatron's random init) at each TP; per sync the FP8 caches are dropped (what an optimizer
step does), `fp8_weights` re-quantizes (jetrl), and `actor.weight_stream.actor_weight_stream` (all-gather
over the TP group, `hf_tensors`) feeds `stream_weights` into a NativeEngine on global rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_jetrl.convert.layout import hf_shape  # noqa: E402
from megatron_jetrl.fp8 import PrecisionFlow, QuantizedWeight  # noqa: E402
from megatron_jetrl.models import ModelArch, model_entries  # noqa: E402
from megatron_jetrl.models.export import hf_tensors  # noqa: E402
from megatron_jetrl.models.mapping import from_hf, padded_vocab_size, rank_slice  # noqa: E402
from megatron_jetrl.rollout.native import NativeEngine  # noqa: E402
from megatron_jetrl.rollout.sync import stream_weights  # noqa: E402
from tools.bench.common import QWEN3_8B, TINY, timed  # noqa: E402

MODES = ("bf16", "jetrl", "bf16-train-fp8-rollout")
GB = 1e9


class SinkEngine:
    """Receives buckets and keeps nothing (isolates export + wire from the engine's own work)."""

    def update_weights(self, weights):
        for _ in weights:
            pass


def hf_random(arch: ModelArch, name: str, device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    shape = hf_shape(arch, name)
    if len(shape) == 1:
        return (1.0 + 0.05 * torch.randn(shape, generator=g, device=device)).to(torch.bfloat16)
    return (0.02 * torch.randn(shape, generator=g, device=device, dtype=torch.float32)).to(torch.bfloat16)


def megatron_params(arch: ModelArch, entries, device, tp: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """This TP rank's megatron tensors of the same random HF weights (seed = entry index x HF piece)."""
    padded = padded_vocab_size(arch.vocab_size, tp)
    params = {}
    for i, entry in enumerate(entries):
        pieces = {}
        for j, name in enumerate(entry.hf):
            full = hf_random(arch, name, device, seed=1000 * i + j)
            pieces[name] = rank_slice(entry, full, tp_rank, tp, padded).clone()
            del full
        params[entry.megatron] = from_hf(entry, arch, pieces).contiguous()
    return params


def quantize_all(params, entries, flow) -> dict[str, QuantizedWeight]:
    return {e.megatron: QuantizedWeight.quantize(params[e.megatron], flow) for e in entries if e.fp8}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def export_stream(arch, flow, entries, fetch, fetch_fp8=None):
    return hf_tensors(arch, flow, entries, fetch, fetch_fp8)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype.itemsize == 1 else t.contiguous().reshape(-1).view(torch.uint8)


def bench_mode(mode, arch, entries, params, device, a, log) -> dict:
    flow = PrecisionFlow(mode, check_finite="off") if mode != "bf16" else PrecisionFlow("bf16")
    fetch = lambda name: [params[name]]  # noqa: E731
    cache: dict = {}
    fetch_fp8 = (lambda name: [cache[name]]) if mode == "jetrl" else None  # noqa: E731
    res = {"mode": mode}
    times = {k: [] for k in ("quantize", "quantize_checked", "export", "wire", "total", "engine_host")}
    engine = NativeEngine(arch, flow, device=device, batch_invariant=False)
    stats = None
    for r in range(a.repeats + 1):  # the first round warms up (Triton compiles, allocator)
        if mode == "jetrl":
            t, q = timed(device, lambda: quantize_all(params, entries, flow))
            cache.clear()
            cache.update(q)
            del q
            tc, _ = timed(device, lambda: quantize_all(params, entries, PrecisionFlow("jetrl", check_finite="sync")))
            if r:
                times["quantize"].append(t)
                times["quantize_checked"].append(tc)
        t_exp, _ = timed(device, lambda: sum(1 for _ in export_stream(arch, flow, entries, fetch, fetch_fp8)))
        t_wire, _ = timed(
            device,
            lambda: stream_weights(
                export_stream(arch, flow, entries, fetch, fetch_fp8), [SinkEngine()], bucket_bytes=a.bucket_mb << 20
            ),
        )
        t_tot, stats = timed(
            device,
            lambda: stream_weights(
                export_stream(arch, flow, entries, fetch, fetch_fp8), [engine], bucket_bytes=a.bucket_mb << 20
            ),
        )
        if r:
            times["export"].append(t_exp)
            times["wire"].append(t_wire)
            times["total"].append(t_tot)
            times["engine_host"].append(stats.per_engine_seconds[0])
    med = {k: statistics.median(v) if v else 0.0 for k, v in times.items()}
    # bitwise: what the engine holds is what the export yields
    mismatched = [
        n
        for n, t in export_stream(arch, flow, entries, fetch, fetch_fp8)
        if not torch.equal(as_bytes(engine.params[n]), as_bytes(t))
    ]
    missing = engine.missing_weights()
    fp8_bytes = sum(nbytes(t) for n, t in engine.params.items() if t.dtype == torch.float8_e4m3fn)
    scale_bytes = sum(nbytes(t) for n, t in engine.params.items() if n.endswith(".weight_scale_inv"))
    try:
        lp = engine.score([[1, 2, 3, 4, 5, 6, 7, 8]])[0]
        score_ok = all(v == v and abs(v) < 1e4 for v in lp)
    except Exception as e:  # noqa: BLE001 - reported, not fatal for the timing
        score_ok = f"{type(e).__name__}: {e}"
    res.update(
        bytes=stats.bytes,
        tensors=stats.tensors,
        buckets=stats.buckets,
        fp8_bytes=fp8_bytes,
        scale_bytes=scale_bytes,
        bf16_bytes=stats.bytes - fp8_bytes - scale_bytes,
        mismatched=mismatched[:5],
        n_mismatched=len(mismatched),
        missing=missing[:5],
        score_ok=score_ok,
        **{f"{k}_s": v for k, v in med.items()},
        samples={k: v for k, v in times.items()},
    )
    res["step_s"] = med["quantize"] + med["total"]  # jetrl: the trainer's re-quantize + the sync
    res["gbps_total"] = stats.bytes / med["total"] / GB
    log(
        f"{mode:24s} bytes {stats.bytes / GB:7.3f} GB ({stats.tensors} tensors, {stats.buckets} buckets)  quantize {med['quantize'] * 1e3:8.1f} ms "
        f"(checked {med['quantize_checked'] * 1e3:.1f})  export {med['export'] * 1e3:8.1f}  +wire {med['wire'] * 1e3:8.1f}  total {med['total'] * 1e3:8.1f} ms  "
        f"({res['gbps_total']:.1f} GB/s)  bitwise {'ok' if not mismatched and not missing else 'MISMATCH'}  score {score_ok}"
    )
    del engine
    return res


def gather_tp2(params, entries, arch, flow, device) -> tuple[dict, dict, float, float]:
    """Per-rank re-quantize, then all-gather every shard to every rank; returns (bf16 lists, fp8 lists, t_quant, t_gather)."""
    t_q, qcache = timed(device, lambda: quantize_all(params, entries, flow))
    world = dist.get_world_size()

    def all_gather(t: torch.Tensor) -> list[torch.Tensor]:
        wire = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).contiguous().reshape(-1)
        out = torch.empty(world * wire.numel(), dtype=wire.dtype, device=wire.device)
        dist.all_gather_into_tensor(out, wire)  # flat buffers: NCCL and gloo agree on that layout
        return [p.view(t.dtype).view(t.shape) for p in out.chunk(world)]

    def run():
        bf16, fp8 = {}, {}
        for e in entries:
            if e.fp8:
                w = qcache[e.megatron]
                fp8[e.megatron] = [QuantizedWeight(q, s) for q, s in zip(all_gather(w.q), all_gather(w.s))]
            elif e.tp_dim is None:
                bf16[e.megatron] = [params[e.megatron]]  # replicated (norms): every rank has it
            else:
                bf16[e.megatron] = all_gather(params[e.megatron])
        return bf16, fp8

    dist.barrier()
    t_g, (bf16, fp8) = timed(device, run)
    return bf16, fp8, t_q, t_g


def bench_actor_stream(a, arch: ModelArch, device, rank: int, log) -> list[dict]:
    """The live actor's stream (`actor.weight_stream.actor_weight_stream`) from a megatron GPTModel (native spec,
    BF16 params) at each TP in `a.actor_tp`, into a NativeEngine on global rank 0."""
    from megatron_jetrl.actor.fp8_layers import _FP8Weight, fp8_weights, unwrap
    from megatron_jetrl.actor.parallel import destroy_parallel, init_parallel
    from megatron_jetrl.actor.provider import ActorOptions, build_model
    from megatron_jetrl.actor.weight_stream import actor_weight_stream

    world = dist.get_world_size() if dist.is_initialized() else 1
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for tp in a.actor_tp:
        if world % tp:
            log(f"actor stream TP{tp}: skipped (world size {world})")
            continue
        init_parallel(tp=tp, pp=1)
        for mode in a.modes:
            flow = PrecisionFlow(mode, check_finite="off") if mode != "bf16" else PrecisionFlow("bf16")
            t_build, model = timed(device, lambda: build_model(arch, flow, ActorOptions(params_dtype=dtype)))
            if device.type == "cuda":
                model.cuda(device)  # the native RMSNorm weights are made on the CPU (see tools/gpu/gpu_actor_tp.py)
            mods = [m for m in unwrap(model).modules() if isinstance(m, _FP8Weight)]
            engine = NativeEngine(arch, flow, device=device, batch_invariant=False) if rank == 0 else None
            samples = []
            for r in range(a.repeats + 1):
                for m in mods:  # what an optimizer step does to the cache (new weight version)
                    m._fp8_cache = None
                t_q, _ = timed(device, lambda: fp8_weights(model) if flow.train_fp8 else None)
                if dist.is_initialized():
                    dist.barrier()
                if rank == 0:
                    t_s, stats = timed(
                        device,
                        lambda: stream_weights(actor_weight_stream(model, arch, flow), [engine], bucket_bytes=a.bucket_mb << 20),
                    )
                else:
                    t_s, stats = timed(device, lambda: sum(1 for _ in actor_weight_stream(model, arch, flow)))
                tt = torch.tensor([t_q, t_s], device=device, dtype=torch.float64)
                if dist.is_initialized():
                    dist.all_reduce(tt, op=dist.ReduceOp.MAX)
                if r:
                    samples.append((float(tt[0]), float(tt[1])))
            if rank == 0:
                missing = engine.missing_weights()
                try:
                    lp = engine.score([[1, 2, 3, 4, 5, 6, 7, 8]])[0]
                    score_ok = all(v == v and abs(v) < 1e4 for v in lp)
                except Exception as e:  # noqa: BLE001
                    score_ok = f"{type(e).__name__}: {e}"
                q = statistics.median(x[0] for x in samples)
                st = statistics.median(x[1] for x in samples)
                row = dict(
                    tp=tp,
                    mode=mode,
                    build_s=t_build,
                    quantize_s=q,
                    stream_s=st,
                    total_s=q + st,
                    bytes=stats.bytes,
                    tensors=stats.tensors,
                    buckets=stats.buckets,
                    missing=missing[:5],
                    score_ok=score_ok,
                    samples=samples,
                )
                rows.append(row)
                log(
                    f"actor stream TP{tp} {mode:24s} re-quantize {q * 1e3:7.1f} ms  gather+export+stream {st * 1e3:7.1f} ms  "
                    f"total {(q + st) * 1e3:7.1f} ms  {stats.bytes / GB:.3f} GB  complete {not missing}  score {score_ok}  (build {t_build:.1f}s)"
                )
            del model, engine, mods
            if device.type == "cuda":
                torch.cuda.empty_cache()
        destroy_parallel()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--modes", nargs="*", default=list(MODES))
    p.add_argument(
        "--actor-tp",
        type=int,
        nargs="*",
        default=[1, 2],
        help="TP sizes of the live-actor stream phase (megatron GPTModel + actor_weight_stream); none: skip",
    )
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (hidden 256, 2 layers)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    distributed = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not distributed and a.actor_tp:  # one process: the live-actor phase still needs a (1-rank) process group
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port).items():
            os.environ.setdefault(k, v)
        distributed = True
    if distributed:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if a.tiny:
        a.layers = 2
    cfg = dict(TINY if a.tiny else QWEN3_8B, num_hidden_layers=a.layers)
    arch = ModelArch.from_hf_config(cfg)
    entries = model_entries(arch)
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    log(
        f"device {torch.cuda.get_device_name(device) if cuda else 'cpu'}, torch {torch.__version__}; Qwen3-8B shapes, {a.layers} layers"
        f"{' (tiny)' if a.tiny else ''}; bucket {a.bucket_mb} MiB; world {world}"
    )
    results = {"tp1": [], "tp2": None}
    params = None
    if rank == 0:
        t, params = timed(device, lambda: megatron_params(arch, entries, device, 1, 0))
        total = sum(nbytes(v) for v in params.values())
        log(f"trainer params (TP1 megatron layout, BF16): {total / GB:.2f} GB, made in {t:.1f}s")
        for mode in a.modes:
            results["tp1"].append(bench_mode(mode, arch, entries, params, device, a, log))
            if cuda:
                torch.cuda.empty_cache()
    if world == 2:
        flow = PrecisionFlow("jetrl", check_finite="off")
        shards = megatron_params(arch, entries, device, 2, rank)
        rounds = []
        for r in range(a.repeats + 1):
            bf16, fp8, t_q, t_g = gather_tp2(shards, entries, arch, flow, device)
            tq = torch.tensor([t_q], device=device)
            dist.all_reduce(tq, op=dist.ReduceOp.MAX)
            if rank == 0:
                engine = NativeEngine(arch, flow, device=device, batch_invariant=False)
                t_s, stats = timed(
                    device,
                    lambda: stream_weights(
                        hf_tensors(arch, flow, entries, lambda n: bf16[n], lambda n: fp8[n]),
                        [engine],
                        bucket_bytes=a.bucket_mb << 20,
                    ),
                )
                if r == a.repeats:  # bytes of the TP2 export == TP1 export
                    cache = quantize_all(params, entries, flow)
                    tp1 = hf_tensors(arch, flow, entries, lambda n: [params[n]], lambda n: [cache[n]])
                    tp2 = hf_tensors(arch, flow, entries, lambda n: bf16[n], lambda n: fp8[n])
                    bad = [n1 for (n1, t1), (n2, t2) in zip(tp1, tp2) if n1 != n2 or not torch.equal(as_bytes(t1), as_bytes(t2))]
                    del cache
                else:
                    bad = None
                if r:
                    rounds.append(dict(quantize_max_rank_s=float(tq), gather_s=t_g, stream_s=t_s, bytes=stats.bytes, bad=bad))
                del engine
            del bf16, fp8
            dist.barrier()
        if rank == 0:
            med = {k: statistics.median(x[k] for x in rounds) for k in ("quantize_max_rank_s", "gather_s", "stream_s")}
            gathered = sum(
                nbytes(v) for e in entries for v in ([shards[e.megatron]] if not e.fp8 else []) if e.tp_dim is not None
            )
            results["tp2"] = dict(
                **med,
                total_s=sum(med.values()),
                bytes=rounds[-1]["bytes"],
                bitwise_vs_tp1=rounds[-1]["bad"] == [],
                bad=(rounds[-1]["bad"] or [])[:5],
                samples=rounds,
                vocab_parallel_bf16_bytes_per_rank=gathered,
            )
            log(
                f"TP2 jetrl: re-quantize shards {med['quantize_max_rank_s'] * 1e3:.1f} ms (slowest rank), all-gather {med['gather_s'] * 1e3:.1f} ms, "
                f"export+stream {med['stream_s'] * 1e3:.1f} ms, total {results['tp2']['total_s'] * 1e3:.1f} ms; "
                f"export bit-equal to TP1: {results['tp2']['bitwise_vs_tp1']}"
            )
    params = shards = None
    if cuda:
        torch.cuda.empty_cache()
    results["actor"] = bench_actor_stream(a, arch, device, rank, log) if a.actor_tp else []
    if rank == 0:
        scale = None
        if not a.tiny and a.layers != 36:
            scale = f"times x{36 / a.layers:.2f} would give 36 layers for the per-layer part only"
        print(
            "\n| mode | bytes/sync GB (FP8 + scales + BF16) | tensors | re-quantize ms | export ms | +wire ms | total sync ms | GB/s | quantize + sync ms |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in results["tp1"]:
            print(
                f"| {r['mode']} | {r['bytes'] / GB:.3f} ({r['fp8_bytes'] / GB:.3f} + {r['scale_bytes'] / GB:.4f} + {r['bf16_bytes'] / GB:.3f}) | "
                f"{r['tensors']} | {r['quantize_s'] * 1e3:.1f} | {r['export_s'] * 1e3:.1f} | {r['wire_s'] * 1e3:.1f} | {r['total_s'] * 1e3:.1f} | "
                f"{r['gbps_total']:.1f} | {r['step_s'] * 1e3:.1f} |"
            )
        if results["tp2"]:
            t2 = results["tp2"]
            print(
                f"| jetrl, TP2 trainer (2 GPUs, NCCL all-gather) | {t2['bytes'] / GB:.3f} | | {t2['quantize_max_rank_s'] * 1e3:.1f} (per rank) | "
                f"gather {t2['gather_s'] * 1e3:.1f} | | {t2['stream_s'] * 1e3:.1f} (export+stream) | | {t2['total_s'] * 1e3:.1f} |"
            )
        if results["actor"]:
            print(
                "\n| live actor stream (actor_weight_stream -> stream_weights -> NativeEngine) | trainer TP | bytes/sync GB | "
                "re-quantize ms | gather + export + stream ms | total ms |"
            )
            print("|---|---|---|---|---|---|")
            for r in results["actor"]:
                print(
                    f"| {r['mode']} | {r['tp']} | {r['bytes'] / GB:.3f} | {r['quantize_s'] * 1e3:.1f} | {r['stream_s'] * 1e3:.1f} | "
                    f"{r['total_s'] * 1e3:.1f} |"
                )
        if scale:
            print(scale)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(
                    {
                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "torch": torch.__version__,
                        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                        "layers": a.layers,
                        "bucket_mb": a.bucket_mb,
                        "results": results,
                    },
                    f,
                    indent=1,
                    default=str,
                )
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
