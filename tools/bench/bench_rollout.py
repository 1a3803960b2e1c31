#!/usr/bin/env python3
"""Decode throughput of the native rollout engine on one GPU: FP8 (jetrl) against BF16.

    PYTHONPATH=. python3 tools/bench/bench_rollout.py [--layers 36] [--batches 64 128] [--new-tokens 1024 2048 4096]
                                                     [--budget-s 400] [--json PATH] [--quick]
    PYTHONPATH=. python3 tools/bench/bench_rollout.py --device cpu --tiny        # CPU smoke run

Model: random weights with Qwen3-8B shapes (hidden 4096, intermediate 12288, 32 heads, 8 KV heads,
head_dim 128, vocab 151936, untied lm_head), `--layers` of them. The weights are drawn as BF16 directly
on the device, one layer at a time, and installed through `NativeEngine.update_weights` (the live-sync
path); the FP8 engine gets the same BF16 weights quantized on the device (128x128 blocks, the trainer's
quantizer), and shares the BF16 embedding / lm_head / norms with the BF16 engine. Both engines run with
`batch_invariant=False` (library kernels). FP8: `PrecisionFlow("jetrl", backend=--backend,
check_finite="off")` unless `--check-finite` (which adds a host sync per quantization).

Two measurements per (precision, batch, new tokens), prompts of `--prompt` random ids:

* model step (all configs, cheap): one prefill forward (`hidden_states` on a fresh KV cache of the
  generate() capacity prompt + new tokens) and the median of a few single-token decode forwards +
  lm_head of every row halfway through the generation (attention span as generate() rounds it), both
  launched eagerly and replayed as the CUDA graph generate() uses (`rollout/decode_graphs.py`). This is
  the engine's model throughput with no sampling or Python bookkeeping; "model decode" is the graph's.
* end to end: `engine.generate()` with `SamplingParams(temperature=1.0, ignore_eos=True,
  max_new_tokens=N, seed=...)`. Prefill = its first forward (timed inside generate by wrapping
  `hidden_states`); decode = the rest of the call (N sampled tokens per row, N-1 decode steps with their
  graph captures, the batched sampling). decode tok/s = batch * N / decode seconds.

The end-to-end runs take the whole time of N steps, so they are scheduled cheapest first and only
while their predicted time (from the model-step numbers and the per-row sampling cost seen so far)
fits in `--budget-s` of wall time for the whole script; the others are reported as skipped with their
estimate. Times: torch.cuda.synchronize + perf_counter. Peak memory: torch.cuda.max_memory_allocated
per measurement (weights of both engines included).
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # the budget counts the imports too

import argparse
import datetime
import json
import os
import platform
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_jetrl.fp8 import PrecisionFlow, QuantizedWeight  # noqa: E402
from megatron_jetrl.fp8.gemm import resolve_backend  # noqa: E402
from megatron_jetrl.models import ModelArch  # noqa: E402
from megatron_jetrl.rollout.decode_graphs import SPAN_STEP, DecodeGraphs  # noqa: E402
from megatron_jetrl.rollout.engine import SamplingParams  # noqa: E402
from megatron_jetrl.rollout.native import E4M3, SCALE_SUFFIX, KVCache, NativeEngine  # noqa: E402
from tools.bench.common import sync, timed  # noqa: E402

QWEN3_8B = dict(
    hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936
)
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=300)
GiB = 1 << 30
ROW_COST_GUESS_S = 2.5e-4  # per row per decode step for sampling + bookkeeping, until a run has measured it


def hf_config(shape: dict, layers: int) -> dict:
    return dict(
        model_type="qwen3",
        num_hidden_layers=layers,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **shape,
    )


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None


# ---- model ------------------------------------------------------------------------------------------


def build_engines(arch: ModelArch, fp8_flow: PrecisionFlow, device, seed: int):
    """BF16 and FP8 engines over the same random weights, drawn on `device` one layer at a time."""
    bf16 = NativeEngine(arch, PrecisionFlow("bf16"), device=device, batch_invariant=False)
    fp8 = NativeEngine(arch, fp8_flow, device=device, batch_invariant=False)
    fp8_specs = fp8.specs
    g = torch.Generator(device=device).manual_seed(seed)
    groups: dict[str, list[str]] = {}
    for name in bf16.specs:
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
        groups.setdefault(key, []).append(name)
    for names in groups.values():
        batch = {}
        for name in names:
            shape, _ = bf16.specs[name]
            if len(shape) == 1:  # norms: around 1
                batch[name] = (1.0 + 0.05 * torch.randn(shape, device=device, generator=g)).to(torch.bfloat16)
            else:
                batch[name] = 0.02 * torch.randn(shape, device=device, generator=g, dtype=torch.bfloat16)
        bf16.update_weights(batch.items())
        fp8_batch = {}
        for name, w in batch.items():
            if fp8_specs.get(name, (None, None))[1] == E4M3:
                qw = QuantizedWeight.quantize(w, fp8_flow)
                fp8_batch[name], fp8_batch[name.removesuffix(".weight") + SCALE_SUFFIX] = qw.q, qw.s
        fp8.update_weights(fp8_batch.items())
        del batch, fp8_batch
    shared = [n for n, (_, dt) in fp8_specs.items() if dt == torch.bfloat16]
    for name in shared:  # embedding, lm_head, norms: one copy for both engines (read-only in forward)
        fp8.params[name] = bf16.params[name]
    assert not bf16.missing_weights() and not fp8.missing_weights()
    return bf16, fp8


def weight_gib(engine):
    return sum(t.numel() * t.element_size() for t in engine.params.values()) / GiB


# ---- measurements -------------------------------------------------------------------------------------


def random_prompts(batch, prompt, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, prompt), generator=g)


@torch.no_grad()
def model_step(engine: NativeEngine, batch: int, prompt: int, new: int, reps: int, seed: int):
    """Prefill forward; one decode step of every row (+ lm_head) halfway through the generation, launched
    eagerly and (on CUDA) replayed as generate()'s graph. Seconds: (prefill, eager step, graph step or None)."""
    dev = engine.device
    tokens = random_prompts(batch, prompt, engine.arch.vocab_size, seed).to(dev)
    cache = KVCache(engine.arch, batch, prompt + new, dev)
    positions = torch.arange(prompt, device=dev).expand(batch, prompt)
    lengths = torch.full((batch,), prompt, device=dev)
    prefill_s, hidden = timed(dev, lambda: engine.hidden_states(tokens, positions, lengths, cache, span=prompt))
    last = engine.logits(hidden[:, -1])
    at = prompt + new // 2 - 1
    span = min(prompt + new, -(-(at + 1) // SPAN_STEP) * SPAN_STEP)
    pos = torch.full((batch, 1), at, device=dev, dtype=torch.long)
    new_tok = last.argmax(-1)[:, None]

    def median_of(fn):
        return statistics.median([timed(dev, fn)[0] for _ in range(reps + 1)][1:])  # the first is a warm-up

    eager = median_of(lambda: engine.logits(engine.hidden_states(new_tok, pos, pos[:, 0] + 1, cache, span=span)[:, 0]))
    graph = None
    if dev.type == "cuda":
        graphs = DecodeGraphs(engine, cache)
        args = (new_tok[:, 0].tolist(), [at] * batch)
        graph = median_of(lambda: graphs.step(*args))
        del graphs
    del cache, hidden, last
    return prefill_s, eager, graph


@torch.no_grad()
def end_to_end(engine: NativeEngine, batch: int, prompt: int, new: int, seed: int):
    """engine.generate() timed whole, its prefill forward timed inside it; returns a result dict."""
    dev = engine.device
    prompts = random_prompts(batch, prompt, engine.arch.vocab_size, seed).tolist()
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=seed)
    original = engine.hidden_states
    prefill = []

    def hidden_states(*args, **kwargs):
        if prefill:
            return original(*args, **kwargs)
        t, out = timed(dev, lambda: original(*args, **kwargs))
        prefill.append(t)
        return out

    engine.hidden_states = hidden_states
    try:
        total_s, outs = timed(dev, lambda: engine.generate(prompts, sampling))
    finally:
        del engine.hidden_states
    lengths = [len(c.token_ids) for o in outs for c in o.completions]
    in_vocab = all(0 <= t < engine.arch.vocab_size for o in outs for c in o.completions for t in c.token_ids)
    finite = all(lp == lp and lp <= 0 for o in outs for c in o.completions for lp in c.logprobs)
    return {
        "total_s": total_s,
        "prefill_s": prefill[0],
        "decode_s": total_s - prefill[0],
        "tokens_generated": sum(lengths),
        "tokens_ok": lengths == [new] * batch and in_vocab and finite,
        "first_tokens": outs[0].completions[0].token_ids[:8],
    }


# ---- driver -------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 36; --quick 4; --tiny 2)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 64 128")
    ap.add_argument("--new-tokens", type=int, nargs="+", default=None, help="default 1024 2048 4096")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (random ids), default 512")
    ap.add_argument("--backend", default="auto", help="FP8 GEMM backend of the jetrl flow (auto: fastest the device has)")
    ap.add_argument("--check-finite", action="store_true", help="FP8 quantizer NaN/inf check (one host sync per quantization)")
    ap.add_argument(
        "--budget-s", type=float, default=None, help="wall-time budget of the whole script (default 400; --quick 150)"
    )
    ap.add_argument("--reps", type=int, default=5, help="timed single-token decode forwards per model-step measurement")
    ap.add_argument("--no-e2e", action="store_true", help="model-step measurements only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="4 layers, new tokens 128 256, budget 150 s")
    ap.add_argument(
        "--tiny", action="store_true", help="tiny model (hidden 256, 2 layers, vocab 300), batch 2, prompt 8, new 4: smoke run"
    )
    ap.add_argument("--json", default=None, help="default $OUT/bench_rollout.json when $OUT is set")
    args = ap.parse_args(argv)
    if args.tiny:
        defaults = dict(layers=2, batches=[2], new_tokens=[4], prompt=8, budget_s=600.0, reps=2)
    elif args.quick:
        defaults = dict(layers=4, batches=[64, 128], new_tokens=[128, 256], prompt=512, budget_s=150.0)
    else:
        defaults = dict(layers=36, batches=[64, 128], new_tokens=[1024, 2048, 4096], prompt=512, budget_s=400.0)
    for k, v in defaults.items():
        if getattr(args, k, None) is None or (k == "reps" and args.tiny):
            setattr(args, k, v)
    if args.json is None and os.environ.get("OUT"):
        args.json = os.path.join(os.environ["OUT"], "bench_rollout.json")
    return args


def main(argv=None) -> dict:
    start = _T0 if argv is None else time.perf_counter()
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu --tiny for a CPU smoke run")
    deadline = start + args.budget_s
    shape = TINY if args.tiny else QWEN3_8B
    arch = ModelArch.from_hf_config(hf_config(shape, args.layers))
    backend = resolve_backend(args.backend, device)
    fp8_flow = PrecisionFlow("jetrl", backend=backend, check_finite="sync" if args.check_finite else "off")
    res = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": " ".join(sys.argv) if argv is None else " ".join(argv),
        "model": {"shape": "tiny" if args.tiny else "Qwen3-8B", "layers": args.layers, **shape},
        "fp8_flow": fp8_flow.to_dict(),
        "fp8_backend": backend,
        "batch_invariant": False,
        "prompt": args.prompt,
        "batches": args.batches,
        "new_tokens": args.new_tokens,
        "budget_s": args.budget_s,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    print(
        f"{res['date']}  {res['device']}  torch {res['torch']}  model {res['model']['shape']} x {args.layers} layers  "
        f"FP8 backend {backend} (check_finite={args.check_finite})  prompt {args.prompt}",
        flush=True,
    )
    if not args.tiny and args.layers < 36:
        print(
            f"NOTE: {args.layers} of Qwen3-8B's 36 layers (per-layer costs are the same; embedding/lm_head/sampling weigh more)",
            flush=True,
        )

    t_build, (bf16, fp8) = timed(device, lambda: build_engines(arch, fp8_flow, device, args.seed))
    engines = {"fp8": fp8, "bf16": bf16}
    res["setup_s"] = t_build
    res["weights_GiB"] = {
        "bf16": weight_gib(bf16),
        "fp8": weight_gib(fp8)
        - sum(t.numel() * t.element_size() for n, t in fp8.params.items() if t.dtype == torch.bfloat16) / GiB,
        "shared_bf16": sum(t.numel() * t.element_size() for n, t in fp8.params.items() if t.dtype == torch.bfloat16) / GiB,
    }
    print(
        f"weights on {device} in {t_build:.1f} s: BF16 engine {res['weights_GiB']['bf16']:.2f} GiB, FP8 engine own "
        f"{res['weights_GiB']['fp8']:.2f} GiB (+ {res['weights_GiB']['shared_bf16']:.2f} GiB BF16 embed/lm_head/norms shared)",
        flush=True,
    )

    configs = sorted(((b, n) for b in args.batches for n in args.new_tokens), key=lambda c: c[0] * (args.prompt + c[1]))
    rows: dict[tuple, dict] = {}
    for prec in engines:
        for b in args.batches:
            rows.update({(prec, b, n): {"precision": prec, "batch": b, "new_tokens": n} for n in args.new_tokens})

    # warm-up: kernels compile / pick algorithms on the shapes measured below (one prefill + decode per batch)
    for prec, eng in engines.items():
        for b in args.batches:
            t, _ = timed(device, lambda: model_step(eng, b, args.prompt, min(args.new_tokens), 1, args.seed))
            print(f"warm-up {prec} batch {b}: {t:.1f} s", flush=True)

    print(
        "model step (prefill forward; single-token decode step + lm_head of every row, graph and eager, no sampling):", flush=True
    )
    for b, n in configs:
        for prec, eng in engines.items():
            r = rows[(prec, b, n)]
            if time.perf_counter() > deadline - 30:
                r["model_step"] = "skipped (budget)"
                continue
            reset_peak(device)
            try:
                pre, eager, graph = model_step(eng, b, args.prompt, n, args.reps, args.seed)
                step = graph if graph is not None else eager
            except torch.cuda.OutOfMemoryError as e:
                r["model_step"] = f"OOM: {str(e).splitlines()[0][:160]}"
                print(f"  {prec:4s} B={b:4d} new={n:5d}: OOM", flush=True)
                torch.cuda.empty_cache()
                continue
            r.update(
                prefill_fwd_s=pre,
                prefill_tok_s=b * args.prompt / pre,
                decode_step_s=step,
                eager_decode_step_s=eager,
                model_decode_tok_s=b / step,
                eager_decode_tok_s=b / eager,
                model_step_peak_GiB=peak_gib(device),
            )
            print(
                f"  {prec:4s} B={b:4d} new={n:5d}: prefill {pre * 1e3:9.1f} ms ({b * args.prompt / pre:9.0f} tok/s)  "
                f"decode step {step * 1e3:8.2f} ms ({b / step:8.0f} tok/s; eager {eager * 1e3:8.2f} ms)"
                + (f"  peak {peak_gib(device):6.1f} GiB" if device.type == "cuda" else ""),
                flush=True,
            )

    res["e2e_skipped"] = []
    if not args.no_e2e:
        row_cost = {"value": ROW_COST_GUESS_S, "measured": False}

        def predict(b, n):
            total = 0.0
            for prec in engines:
                r = rows[(prec, b, n)]
                if "decode_step_s" not in r:
                    return None
                total += r["prefill_fwd_s"] + n * (r["decode_step_s"] + b * row_cost["value"])
            return 1.15 * total + 2.0

        print("end to end: engine.generate(temperature 1.0, ignore_eos), cheapest first, within the budget:", flush=True)
        for b, n in sorted(configs, key=lambda c: predict(*c) or float("inf")):
            est = predict(b, n)
            left = deadline - time.perf_counter()
            if est is None or est > left:
                why = (
                    "no model-step numbers"
                    if est is None
                    else f"est. {est:.0f} s for FP8+BF16 > {max(left, 0):.0f} s left of --budget-s {args.budget_s:.0f}"
                )
                res["e2e_skipped"].append({"batch": b, "new_tokens": n, "estimate_s": est, "why": why})
                print(f"  B={b:4d} new={n:5d}: skipped ({why})", flush=True)
                continue
            for prec, eng in engines.items():
                r = rows[(prec, b, n)]
                reset_peak(device)
                try:
                    e = end_to_end(eng, b, args.prompt, n, args.seed)
                except torch.cuda.OutOfMemoryError as exc:
                    r["e2e"] = f"OOM: {str(exc).splitlines()[0][:160]}"
                    print(f"  {prec:4s} B={b:4d} new={n:5d}: OOM", flush=True)
                    torch.cuda.empty_cache()
                    continue
                e.update(
                    decode_tok_s=b * n / e["decode_s"], prefill_tok_s=b * args.prompt / e["prefill_s"], peak_GiB=peak_gib(device)
                )
                e["sampling_overhead_per_step_s"] = (
                    max(0.0, e["decode_s"] / n - r["decode_step_s"]) if "decode_step_s" in r else None
                )
                r["e2e"] = e
                if e["sampling_overhead_per_step_s"] is not None:
                    seen = e["sampling_overhead_per_step_s"] / b
                    row_cost["value"] = seen if not row_cost["measured"] else max(row_cost["value"], seen)
                    row_cost["measured"] = True
                print(
                    f"  {prec:4s} B={b:4d} new={n:5d}: {e['total_s']:7.1f} s  prefill {e['prefill_tok_s']:9.0f} tok/s  "
                    f"decode {e['decode_tok_s']:8.0f} tok/s  sampling+python {1e3 * (e['sampling_overhead_per_step_s'] or 0):6.1f} ms/step  "
                    f"tokens {'ok' if e['tokens_ok'] else 'WRONG'}"
                    + (f"  peak {e['peak_GiB']:6.1f} GiB" if e["peak_GiB"] is not None else ""),
                    flush=True,
                )
            sync(device)
        res["row_cost_s"] = row_cost

    # ratios FP8/BF16 (throughput ratios: > 1 means FP8 is faster)
    ratios = []
    for b, n in configs:
        f, h = rows[("fp8", b, n)], rows[("bf16", b, n)]
        q = {"batch": b, "new_tokens": n}

        def ratio(get):
            try:
                return get(f) / get(h)
            except (KeyError, TypeError, ZeroDivisionError):
                return None

        q["e2e_decode"] = ratio(lambda r: r["e2e"]["decode_tok_s"])
        q["model_decode"] = ratio(lambda r: r["model_decode_tok_s"])
        q["eager_decode"] = ratio(lambda r: r["eager_decode_tok_s"])
        q["prefill"] = ratio(lambda r: r["prefill_tok_s"])
        ratios.append(q)
    res["results"] = list(rows.values())
    res["ratios_fp8_over_bf16"] = ratios
    res["wall_s"] = time.perf_counter() - start

    def fmt(v, spec):
        return format(v, spec) if isinstance(v, (int, float)) else "-".rjust(int(spec.split(".")[0]))

    def e2e(r, key):
        return r["e2e"].get(key) if isinstance(r.get("e2e"), dict) else None

    lines = [
        f"=== native rollout engine, {res['model']['shape']} x {args.layers} layers, prompt {args.prompt}, batch_invariant=False, "
        f"FP8 = jetrl/{backend}{'' if args.check_finite else ' (check_finite off)'} ===",
        f"{'B':>4s} {'new':>5s} {'prec':>4s} | {'e2e decode':>10s} {'e2e prefill':>11s} {'peak':>6s} | {'model decode':>12s} {'model prefill':>13s} {'peak':>6s}",
        f"{'':>4s} {'':>5s} {'':>4s} | {'tok/s':>10s} {'tok/s':>11s} {'GiB':>6s} | {'tok/s':>12s} {'tok/s':>13s} {'GiB':>6s}",
    ]
    for b, n in configs:
        for prec in engines:
            r = rows[(prec, b, n)]
            lines.append(
                f"{b:4d} {n:5d} {prec:>4s} | {fmt(e2e(r, 'decode_tok_s'), '10.0f')} {fmt(e2e(r, 'prefill_tok_s'), '11.0f')} "
                f"{fmt(e2e(r, 'peak_GiB'), '6.1f')} | {fmt(r.get('model_decode_tok_s'), '12.0f')} "
                f"{fmt(r.get('prefill_tok_s'), '13.0f')} {fmt(r.get('model_step_peak_GiB'), '6.1f')}"
            )
    lines.append("FP8/BF16 throughput ratio (>1: FP8 faster):")
    for q in ratios:
        lines.append(
            f"{q['batch']:4d} {q['new_tokens']:5d}      | e2e decode {fmt(q['e2e_decode'], '5.2f')}x   "
            f"model decode {fmt(q['model_decode'], '5.2f')}x (eager {fmt(q['eager_decode'], '5.2f')}x)   prefill {fmt(q['prefill'], '5.2f')}x"
        )
    if res["e2e_skipped"]:
        lines.append(
            "e2e not run (budget): "
            + ", ".join(
                f"B={s['batch']}/new={s['new_tokens']}" + (f" (~{s['estimate_s']:.0f} s)" if s["estimate_s"] else "")
                for s in res["e2e_skipped"]
            )
        )
    lines.append(f"wall {res['wall_s']:.0f} s (budget {args.budget_s:.0f} s)")
    res["table"] = lines
    print("\n" + "\n".join(lines), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
        print(f"wrote {args.json}")
    return res


if __name__ == "__main__":
    main()
