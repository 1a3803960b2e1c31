#!/usr/bin/env python3
"""One decode table at Qwen3-8B shapes: the native engine beside vLLM, FP8 (jetrl numerics) against BF16 in each.

    python tools/bench/rollout_report.py [--native bench_rollout.json] --vllm bench_jetrl.json bench_bf16.json [-o report.md]

Inputs: the JSON of `tools/bench/bench_rollout.py` (native engine, both precisions; optional) and of `tools/bench/bench_vllm.py
--mode jetrl` and `--mode bf16` (one engine each). Only settings that match are compared: the same layers, prompt length and new tokens;
a row per batch size that the vLLM runs have. Throughput is generated tokens per second of the whole generate() call,
prefill included, as vLLM's benchmark times it: for the native engine b * n / (prefill_s + decode_s) of its end-to-end
run. vLLM: best of its repeated runs (the first, which JIT-compiles DeepGEMM kernels for new shapes, in its own column).
A vLLM run of another `--variant` than shipped (fused, triton-attn) gets two more columns: its tokens/s and its ratio to
vLLM BF16 of the same variant when that ran, else to the shipped BF16 run.

Ceiling: where both vLLM runs profiled a batch (`bench_vllm.py --profile-batch`, at the same context), a second table
bounds what FP8 weights can buy a decode step there. FP8 changes only the decoder layers' linears; attention over the
BF16 KV cache, the BF16 lm_head, norms and sampling are the same work in both modes (the trainer runs them in BF16, so
the rollout must). The FP8 step therefore takes at least BF16's step minus BF16's linear GEMMs plus the FP8 GEMMs'
floor: the longer of reading the FP8 linears' bytes once at the device copy rate and their FLOPs (2 x batch x
parameters; the parameters are the BF16 run's linear bytes / 2) at the FP8 tensor-core peak (--fp8-tflops, default
1979: H100 and H200 SXM, dense), with every FP8-only pass free. The ceiling is BF16's step over that; no FP8 GEMM
kernel beats it with the trainer's numerics kept, up to reading somewhat above the copy rate (towards the memory's
peak): the last column gives the FP8 GEMM time (and weight read rate) that 1.3x would need with today's FP8-only
work, unreachable where it is below the floor. Steps are GPU-busy ms. At rollout TP k (`bench_vllm.py --tp k` under
torchrun) the same bound holds per rank: each reads its 1/k of the linears (`linear_GB` is that share), and the
row-parallel all-reduces (the NCCL column) are the same work in both modes, so they lower the ceiling as attention does.

KV cache (`--kv`, instead of `--vllm`): bench_vllm.py runs of one setting with `--kv-cache bf16` and `fp8`, each with
the attention pins it ran (exact logprobs, one pin alone, none; tools/gpu/gpu_vllm.sh kv-rollout): tokens/s and the sequences the cache holds at once, each against bf16 with a BF16
cache (no ratio where a timed run compiled DeepGEMM kernels inside it), and the bandwidth ceiling of a decode step: the bytes it reads (the decoder's linear weights, the BF16 lm_head,
and the KV cache of every sequence at the mean context, prompt + new / 2) in BF16 over the same in the run's precision.

Exit status: 0 written; 2 a file unreadable or the settings do not match (one line says which).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def attention_label(run: dict) -> str:
    """How a bench_vllm.py run's attention was pinned: `exact` (every exact-logprob pin), the pins it applied alone
    (`one-split`, `fp8-tile`), or `none` (a result from before the field: none); a --variant other than shipped
    follows (`exact, aot-schedule`)."""
    label = "exact" if run.get("exact_logprobs") else "+".join(run.get("pins") or ()) or "none"
    variant = run.get("variant", "shipped")
    return label if variant == "shipped" else f"{label}, {variant}"


def load(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read a benchmark JSON ({e})") from None


def run_key(r: dict) -> str:
    """'jetrl' / 'bf16' for the shipped engine, 'jetrl fused' etc. for a --variant run."""
    variant = r.get("variant", "shipped")
    return r["mode"] if variant == "shipped" else f"{r['mode']} {variant}"


def vllm_runs(paths: list[str]) -> dict[str, dict]:
    """{"jetrl": json, "bf16": json, "jetrl fused": json, ...} from bench_vllm.py outputs, each mode and variant once,
    with matching settings."""
    runs = {}
    for path in paths:
        r = load(path)
        if r.get("mode") not in ("jetrl", "bf16") or "decode" not in r:
            raise ValueError(f"{path}: not a tools/bench/bench_vllm.py result (needs 'mode' jetrl|bf16 and 'decode')")
        if run_key(r) in runs:
            raise ValueError(f"{path}: a second vLLM {run_key(r)} run; give one per mode and variant")
        runs[run_key(r)] = r
    for r in runs.values():
        r.setdefault("tp", 1)  # (runs before --tp)
    keys = ("layers", "prompt", "new_tokens", "tp")
    if len({tuple(r.get(k) for k in keys) for r in runs.values()}) > 1:
        raise ValueError(
            "the vLLM runs differ in " + ", ".join(f"{m}: {dict((k, r.get(k)) for k in keys)}" for m, r in runs.items())
        )
    return runs


def native_rate(native: dict, precision: str, batch: int, new: int) -> float | None:
    """Generated tokens/s of the native engine's end-to-end run (prefill + decode), or None if it did not run."""
    for r in native.get("results", []):
        if (r.get("precision"), r.get("batch"), r.get("new_tokens")) == (precision, batch, new) and isinstance(
            r.get("e2e"), dict
        ):
            return batch * new / (r["e2e"]["prefill_s"] + r["e2e"]["decode_s"])
    return None


def check_native(native: dict, layers, prompt, new) -> None:
    missing = [k for k in ("model", "prompt", "new_tokens", "results", "device") if k not in native]
    if missing:
        raise ValueError(f"the native JSON lacks {missing}: give the output of tools/bench/bench_rollout.py --json")
    if (native["model"]["layers"], native["prompt"]) != (layers, prompt) or new not in native["new_tokens"]:
        raise ValueError(
            f"the native run (layers {native['model']['layers']}, prompt {native['prompt']}, new tokens "
            f"{native['new_tokens']}) does not cover the vLLM runs' setting (layers {layers}, prompt {prompt}, "
            f"new tokens {new}): run tools/bench/bench_rollout.py with --layers {layers} --prompt {prompt} --new-tokens {new}"
        )


def table(native: dict | None, runs: dict[str, dict]) -> str:
    ref = next(iter(runs.values()))
    layers, prompt, new = ref.get("layers"), ref.get("prompt"), ref.get("new_tokens")
    if native is not None:
        check_native(native, layers, prompt, new)
    else:
        native = {"device": None, "results": []}
    f = lambda v, spec=".0f": "n/a" if v is None else format(v, spec)
    ratio = lambda a, b: "n/a" if a is None or b is None else f"{a / b:.2f}x"
    variants = [k for k in runs if k not in ("jetrl", "bf16") and not k.startswith("bf16 ")]
    base = {k: f"bf16 {k.split(' ', 1)[1]}" if f"bf16 {k.split(' ', 1)[1]}" in runs else "bf16" for k in variants}
    extra_head = "".join(f" vLLM {k} | vLLM {k} / {base[k]} |" for k in variants)
    tp = f", rollout TP {ref['tp']} (one engine over {ref['tp']} GPUs)" if ref.get("tp", 1) > 1 else ""
    lines = [
        f"Generated tokens/s, Qwen3-8B shapes x {layers} layers{tp}, prompt {prompt}, {new} new tokens "
        + (
            f"(native on {native['device']}, vLLM on {ref['device']})."
            if native["device"]
            else f"(vLLM on {ref['device']}; the native engine not run)."
        ),
        "",
        "| batch | native BF16 | native FP8 | native FP8/BF16 | vLLM BF16 | vLLM FP8 | vLLM FP8 first run | vLLM FP8/BF16 | "
        "vLLM/native, FP8 |" + extra_head,
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * len(variants),
    ]
    batches = sorted({int(b) for r in runs.values() for b in r["decode"]})
    for b in batches:
        nb, nf = native_rate(native, "bf16", b, new), native_rate(native, "fp8", b, new)
        get = lambda run, key: runs.get(run, {}).get("decode", {}).get(str(b), {}).get(key)
        vb, vf, vf0 = get("bf16", "best_tok_s"), get("jetrl", "best_tok_s"), get("jetrl", "first_tok_s")
        extra = "".join(
            f" {f(get(k, 'best_tok_s'))} | {ratio(get(k, 'best_tok_s'), get(base[k], 'best_tok_s'))} |" for k in variants
        )
        lines.append(
            f"| {b} | {f(nb)} | {f(nf)} | {ratio(nf, nb)} | {f(vb)} | {f(vf)} | {f(vf0)} | {ratio(vf, vb)} | "
            f"{ratio(vf, nf)} |" + extra
        )
    return "\n".join(lines) + "\n"


GOAL = 1.3
"""The decode goal (FP8 / BF16): the ceiling table gives the FP8 GEMM time it would need."""
FP8_PEAK_TFLOPS = 1979.0
"""Dense E4M3 tensor-core peak of the H100 and H200 SXM: the ceiling's FLOP floor unless --fp8-tflops says otherwise."""


def ceiling(runs: dict[str, dict], fp8_tflops: float = FP8_PEAK_TFLOPS) -> str:
    """The ceiling table (module docstring) for every batch that the shipped jetrl and bf16 runs both profiled."""
    f8, b16 = runs.get("jetrl"), runs.get("bf16")
    if f8 is None or b16 is None:
        return ""
    pf, pb = f8.get("decode_profiles") or {}, b16.get("decode_profiles") or {}
    batches = sorted(set(pf) & set(pb), key=int)
    if batches and ("linear_GB" not in f8 or "copy_GBps" not in f8 or "linear_GB" not in b16):
        raise ValueError("a run lacks linear_GB / copy_GBps: rerun tools/bench/bench_vllm.py (this version) in both modes")
    lines = []
    for b in batches:
        F, B = pf[b], pb[b]
        if F.get("context") != B.get("context"):
            raise ValueError(
                f"batch {b}: the jetrl profile ran at context {F.get('context')}, the bf16 one at "
                f"{B.get('context')}: profile both with the same --prompt, --new and --profile-context"
            )
        lm_head = F["categories"].get("GEMM BF16", 0.0)  # the only BF16 GEMM of an FP8 engine
        lin_b = B["categories"].get("GEMM BF16", 0.0) - lm_head
        lin_f = F["categories"].get("GEMM FP8", 0.0)
        read_f = f8["linear_GB"] / f8["copy_GBps"] * 1e3
        flops_f = 2 * int(b) * b16["linear_GB"] * 1e9 / 2 / (fp8_tflops * 1e12) * 1e3
        floor = max(read_f, flops_f)
        extra = F["busy_ms"] - B["busy_ms"] + lin_b - lin_f
        best = B["busy_ms"] - lin_b + floor
        need = B["busy_ms"] / GOAL - (B["busy_ms"] - lin_b) - extra  # FP8 GEMM ms for the goal, with today's extra work
        need_rate = (
            "below zero: unreachable"
            if need <= 0
            else f"{need:.3f} ms ({f8['linear_GB'] / need:.2f} TB/s)" + (": below the floor, unreachable" if need < floor else "")
        )
        lines.append(
            f"| {b} | {B['context']:.0f} | {B['busy_ms']:.3f} | {lin_b:.3f} | {B['categories'].get('attention', 0.0):.3f} | "
            f"{B['categories'].get('NCCL', 0.0):.3f} | "
            f"{F['busy_ms']:.3f} | {lin_f:.3f} ({read_f / lin_f:.0%}) | {extra:.3f} | "
            f"{floor:.3f} ({'read' if read_f >= flops_f else 'FLOPs'}) | {best:.3f} | **{B['busy_ms'] / best:.2f}x** | "
            f"{B['busy_ms'] / F['busy_ms']:.2f}x | {need_rate} |"
        )
    if not lines:
        return ""
    share = f" (one of {f8['tp']} TP ranks' share)" if f8.get("tp", 1) > 1 else ""
    head = (
        f"What FP8 weights can buy one decode step (GPU-busy ms; the FP8 linears' {f8['linear_GB']:.2f} GB{share} read at "
        f"{f8['copy_GBps']:.0f} GB/s take {read_f:.3f} ms; FP8 peak {fp8_tflops:.0f} TFLOP/s).\n\n"
        "| batch | context | BF16 step | its linear GEMMs | attention | NCCL | FP8 step | its FP8 GEMMs (copy-rate share) | "
        "FP8's other extra work | FP8 GEMMs' floor | FP8 step at the ceiling | ceiling FP8/BF16 | measured FP8/BF16 | "
        f"FP8 GEMMs for {GOAL}x with today's extra work |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    return "\n" + head + "\n" + "\n".join(lines) + "\n"


KV_BYTES_PER_TOKEN_LAYER = 2 * 8 * 128
"""K and V elements a token keeps per layer at Qwen3-8B's shapes (8 KV heads x 128), bench_vllm.py's model."""
LM_HEAD_GB = 151936 * 4096 * 2 / 1e9
"""The BF16 lm_head a decode step reads in every mode."""


def kv_table(paths: list[str]) -> str:
    """The `--kv` table (module docstring) of bench_vllm.py runs at one setting."""
    runs = {}
    for path in paths:
        r = load(path)
        if "decode" not in r or "kv_cache" not in r:
            raise ValueError(f"{path}: not a tools/bench/bench_vllm.py result with a kv_cache field")
        key = (r["mode"], r["kv_cache"], attention_label(r))
        if key in runs:
            raise ValueError(f"{path}: a second {' '.join(key)} run; give one per mode, cache and attention")
        runs[key] = r
    base = next((r for (mode, kv, _), r in runs.items() if mode == kv == "bf16"), None)
    if sum(mode == kv == "bf16" for mode, kv, _ in runs) > 1:
        raise ValueError("--kv compares against one bf16 run with a BF16 cache; give one")
    if base is None:
        raise ValueError("--kv needs the bf16 run with a BF16 cache (bench_vllm.py --mode bf16 --kv-cache bf16)")
    keys = ("layers", "prompt", "new_tokens", "kv_gb")
    for r in runs.values():
        if any(r[k] != base[k] for k in keys):
            raise ValueError(f"--kv runs differ in {[k for k in keys if r[k] != base[k]]}: compare one setting")
    if len(base["decode"]) != 1:
        raise ValueError(f"--kv compares runs of one batch size; the bf16 run has {sorted(base['decode'])}")
    batch = int(next(iter(base["decode"])))
    context = base["prompt"] + base["new_tokens"] / 2

    def step_gb(r):
        kv = batch * context * base["layers"] * KV_BYTES_PER_TOKEN_LAYER * (1 if r["kv_cache"] == "fp8" else 2) / 1e9
        return r["linear_GB"] + LM_HEAD_GB + kv

    lines = [
        f"{base['layers']} layers, {batch} sequences of {base['prompt']} + {base['new_tokens']} tokens, "
        f"{base['kv_gb']:g} GiB of KV cache, {base.get('device', '?')}",
        "",
        "| mode | KV cache | attention pins | tok/s | vs bf16 | held at once | sequences the cache holds | vs bf16 | "
        "preemptions a run | GB read a decode step | ceiling |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    b0 = base["decode"][str(batch)]
    for (mode, kv, pins), r in sorted(runs.items(), key=lambda kv: (kv[0][0] != "bf16", kv[0][1], kv[0][2])):
        d = r["decode"][str(batch)]
        room = d.get("capacity")
        room_ratio = f"{room / b0['capacity']:.2f}x" if room and b0.get("capacity") else "n/a"
        cold = d.get("compiled_in_timed_run") or b0.get("compiled_in_timed_run")
        ratio = "n/a" if cold else f"{d['best_tok_s'] / b0['best_tok_s']:.2f}x"
        rate = f"{d['best_tok_s']:,.0f}" + (
            f" (not a rate: {d['compiled_in_timed_run']} kernels compiled inside)" if d.get("compiled_in_timed_run") else ""
        )
        lines.append(
            f"| {mode} | {kv} | {pins} | {rate} | {ratio} | {d.get('at_once')} | "
            f"{room} | {room_ratio} | "
            f"{d['preemptions_per_run']:.0f} | {step_gb(r):.1f} | {step_gb(base) / step_gb(r):.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--native", help="tools/bench/bench_rollout.py JSON (its columns read n/a without it)")
    runs_arg = ap.add_mutually_exclusive_group(required=True)
    runs_arg.add_argument("--vllm", nargs="+", help="tools/bench/bench_vllm.py JSON, one per mode and --variant")
    runs_arg.add_argument("--kv", nargs="+", help="bench_vllm.py JSON of one setting with a BF16 and an FP8 KV cache")
    ap.add_argument(
        "--fp8-tflops",
        type=float,
        default=FP8_PEAK_TFLOPS,
        help="the FP8 tensor-core peak for the ceiling's FLOP floor (default 1979: H100/H200 SXM, dense)",
    )
    ap.add_argument("-o", "--output", help="also write the table to this markdown file")
    a = ap.parse_args(argv)
    try:
        if a.kv:
            text = kv_table(a.kv)
        else:
            runs = vllm_runs(a.vllm)
            text = table(load(a.native) if a.native else None, runs) + ceiling(runs, a.fp8_tflops)
    except ValueError as e:
        print(f"rollout_report: {e}", file=sys.stderr)
        return 2
    print(text, end="")
    if a.output:
        Path(a.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
