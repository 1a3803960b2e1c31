"""tools/bench/rollout_report.py: the native engine's and vLLM's decode rates in one table, refused when settings differ."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("rollout_report", REPO / "tools" / "bench" / "rollout_report.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def native(prompt=256, layers=36):
    rows = [
        {"precision": p, "batch": b, "new_tokens": 512, "e2e": {"prefill_s": 1.0, "decode_s": t}}
        for p, b, t in [("bf16", 64, 7.0), ("fp8", 64, 6.0), ("bf16", 256, 15.0)]
    ]
    rows.append({"precision": "fp8", "batch": 256, "new_tokens": 512, "e2e": "OOM: out of memory"})
    return {"model": {"layers": layers}, "prompt": prompt, "new_tokens": [512], "results": rows, "device": "H200"}


def vllm(mode, rates, new=512):
    return {
        "mode": mode,
        "layers": 36,
        "prompt": 256,
        "new_tokens": new,
        "device": "H200",
        "decode": {str(b): {"first_tok_s": r / 2, "best_tok_s": r} for b, r in rates.items()},
    }


def write(tmp_path, name, obj):
    (tmp_path / name).write_text(json.dumps(obj))
    return str(tmp_path / name)


def test_rows_per_batch_with_ratios(tmp_path, capsys):
    n = write(tmp_path, "n.json", native())
    f, b = (
        write(tmp_path, "f.json", vllm("jetrl", {64: 9000.0, 256: 26000.0})),
        write(tmp_path, "b.json", vllm("bf16", {64: 7500.0, 256: 20000.0})),
    )
    out = tmp_path / "r.md"
    assert tool.main(["--native", n, "--vllm", f, b, "-o", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[4] == "| 64 | 4096 | 4681 | 1.14x | 7500 | 9000 | 4500 | 1.20x | 1.92x |"  # 64*512/8 s, 64*512/7 s
    assert lines[5] == "| 256 | 8192 | n/a | n/a | 20000 | 26000 | 13000 | 1.30x | n/a |"  # the OOM row has no rate
    assert capsys.readouterr().out == out.read_text()


@pytest.mark.parametrize(
    "case, message",
    [
        (
            "prompt",
            "does not cover the vLLM runs' setting (layers 36, prompt 256, new tokens 512): run tools/bench/bench_rollout.py with",
        ),
        ("new", "the vLLM runs differ in"),
        ("twice", "a second vLLM jetrl run"),
        ("not json", "cannot read a benchmark JSON"),
        ("native keys", "the native JSON lacks ['model'"),
    ],
)
def test_mismatched_or_unreadable_inputs_exit_2(tmp_path, capsys, case, message):
    n = native(prompt=128) if case == "prompt" else native()
    if case == "native keys":
        n = {"results": []}
    f = vllm("jetrl", {64: 1.0})
    b = vllm("bf16", {64: 1.0}, new=1024 if case == "new" else 512)
    paths = [write(tmp_path, "f.json", f), write(tmp_path, "f2.json", f) if case == "twice" else write(tmp_path, "b.json", b)]
    npath = write(tmp_path, "n.json", n)
    if case == "not json":
        (tmp_path / "n.json").write_text("{")
    assert tool.main(["--native", npath, "--vllm", *paths]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_variant_runs_get_their_own_columns(tmp_path):
    n = write(tmp_path, "n.json", native())
    runs = [
        vllm("jetrl", {64: 9000.0}),
        vllm("bf16", {64: 7500.0}),
        dict(vllm("jetrl", {64: 9750.0}), variant="fused"),
        dict(vllm("jetrl", {64: 8800.0}), variant="triton-attn"),
        dict(vllm("bf16", {64: 8000.0}), variant="triton-attn"),
    ]
    paths = [write(tmp_path, f"{i}.json", r) for i, r in enumerate(runs)]
    out = tmp_path / "r.md"
    assert tool.main(["--native", n, "--vllm", *paths, "-o", str(out)]) == 0
    head, _, row = out.read_text().splitlines()[2:5]
    assert head.endswith(
        "| vLLM jetrl fused | vLLM jetrl fused / bf16 | vLLM jetrl triton-attn | vLLM jetrl triton-attn / bf16 triton-attn |"
    )
    assert row == "| 64 | 4096 | 4681 | 1.14x | 7500 | 9000 | 4500 | 1.20x | 1.92x | 9750 | 1.30x | 8800 | 1.10x |"
    assert tool.main(["--native", n, "--vllm", *paths, paths[2]]) == 2  # the fused run twice


def profiled(mode, busy, cats, context=768.0, **extra):
    r = dict(
        vllm(mode, {128: 1.0}),
        decode_profiles={"128": {"batch": 128, "context": context, "busy_ms": busy, "categories": cats}},
        **extra,
    )
    return r


def test_ceiling_bounds_the_fp8_step_by_the_fp8_weights_floor(tmp_path):
    """BF16 step 10 ms, 6 ms of it the linears' GEMMs (0.5 ms lm_head besides); FP8 linears 6 GB at 3000 GB/s: read in
    2 ms at best; their 6e9 parameters (the BF16 run's 12 GB / 2) x 2 x 128 rows take 0.78 ms at 1979 TFLOP/s. So the FP8
    step is at least 10 - 6 + 2 = 6 ms: a 1.67x ceiling. The FP8 run measured 8 ms busy with 3 ms of FP8 GEMMs (2/3 of
    the copy rate) and 1 ms of extra work (8 - (10 - 6 + 3)); 1.3x would need its GEMMs in 10/1.3 - 4 - 1 = 2.692 ms."""
    f8 = profiled("jetrl", 8.0, {"GEMM FP8": 3.0, "GEMM BF16": 0.5, "attention": 3.0}, linear_GB=6.0, copy_GBps=3000.0)
    bf = profiled("bf16", 10.0, {"GEMM BF16": 6.5, "attention": 3.0}, linear_GB=12.0)
    paths = [write(tmp_path, "f.json", f8), write(tmp_path, "b.json", bf)]
    out = tmp_path / "r.md"
    assert tool.main(["--vllm", *paths, "-o", str(out)]) == 0
    text = out.read_text()
    assert "| 128 | n/a | n/a | n/a | 1 | 1 | 0 | 1.00x | n/a |" in text  # no --native: its columns read n/a
    assert "the FP8 linears' 6.00 GB read at 3000 GB/s take 2.000 ms; FP8 peak 1979 TFLOP/s" in text
    assert text.rstrip().splitlines()[-1] == (
        "| 128 | 768 | 10.000 | 6.000 | 3.000 | 0.000 | 8.000 | 3.000 (67%) | 1.000 | "
        "2.000 (read) | 6.000 | **1.67x** | 1.25x | 2.692 ms (2.23 TB/s) |"
    )
    # a slow tensor core: 1.536 TFLOP at 500 TFLOP/s take 3.072 ms, above the read and above what 1.3x needs
    assert tool.main(["--vllm", *paths, "--fp8-tflops", "500", "-o", str(out)]) == 0
    assert (
        out.read_text()
        .rstrip()
        .splitlines()[-1]
        .endswith("| 3.072 (FLOPs) | 7.072 | **1.41x** | 1.25x | 2.692 ms (2.23 TB/s): below the floor, unreachable |")
    )


def test_the_ceiling_at_rollout_tp_counts_one_ranks_share_and_its_all_reduces(tmp_path, capsys):
    """Rollout TP 4 (`bench_vllm.py --tp 4`): a rank reads a quarter of the linears (`linear_GB` is its share: 1.5 GB at
    3000 GB/s, 0.5 ms), and its BF16 step of 4 ms holds 1.5 ms of linear GEMMs and 1 ms of NCCL all-reduces that FP8
    leaves as they are: the FP8 step is at least 4 - 1.5 + 0.5 = 3 ms, a 1.33x ceiling. Runs at another TP are refused."""
    f8 = profiled(
        "jetrl", 3.5, {"GEMM FP8": 0.75, "GEMM BF16": 0.25, "attention": 0.75, "NCCL": 1.0}, linear_GB=1.5, copy_GBps=3000.0, tp=4
    )
    bf = profiled("bf16", 4.0, {"GEMM BF16": 1.75, "attention": 0.75, "NCCL": 1.0}, linear_GB=3.0, tp=4)
    out = tmp_path / "r.md"
    assert tool.main(["--vllm", write(tmp_path, "f.json", f8), write(tmp_path, "b.json", bf), "-o", str(out)]) == 0
    text = out.read_text()
    assert "x 36 layers, rollout TP 4 (one engine over 4 GPUs), prompt 256" in text
    assert "the FP8 linears' 1.50 GB (one of 4 TP ranks' share) read at 3000 GB/s take 0.500 ms" in text
    assert (
        text.rstrip()
        .splitlines()[-1]
        .startswith(
            "| 128 | 768 | 4.000 | 1.500 | 0.750 | 1.000 | 3.500 | 0.750 (67%) | 0.250 | "
            "0.500 (read) | 3.000 | **1.33x** | 1.14x |"
        )
    )
    capsys.readouterr()
    assert tool.main(["--vllm", write(tmp_path, "f.json", f8), write(tmp_path, "b1.json", dict(bf, tp=1))]) == 2
    assert "the vLLM runs differ in" in capsys.readouterr().err


def test_ceiling_needs_profiles_at_one_context(tmp_path, capsys):
    f8 = profiled("jetrl", 8.0, {"GEMM FP8": 3.0}, context=512.0, linear_GB=6.0, copy_GBps=3000.0)
    bf = profiled("bf16", 10.0, {"GEMM BF16": 6.5}, context=768.0, linear_GB=12.0)
    assert tool.main(["--vllm", write(tmp_path, "f.json", f8), write(tmp_path, "b.json", bf)]) == 2
    assert "the jetrl profile ran at context 512.0, the bf16 one at 768.0" in capsys.readouterr().err
    bare = vllm("jetrl", {128: 1.0})  # profiles absent: the rates alone, no ceiling table
    assert tool.main(["--vllm", write(tmp_path, "f.json", bare), write(tmp_path, "b.json", bf)]) == 0
    assert "ceiling" not in capsys.readouterr().out


def kv_run(mode, kv, rate, at_once, kv_gb=40.0, exact=False, pins=()):
    capacity = 36 if kv == "bf16" else 72
    linear = {"bf16": 2 * 6.95, "jetrl": 6.95 + 0.01}[mode]
    return {
        "mode": mode, "kv_cache": kv, "layers": 36, "prompt": 8, "new_tokens": 8192, "kv_gb": kv_gb, "device": "H200",
        "exact_logprobs": exact, "pins": list(pins),
        "linear_GB": linear, "decode": {"32": {"best_tok_s": rate, "preemptions_per_run": 0, "at_once": at_once, "capacity": capacity}},
    }  # fmt: skip


def test_kv_table_compares_caches_with_the_bandwidth_ceiling(tmp_path):
    paths = [
        write(tmp_path, "a.json", kv_run("bf16", "bf16", 3000.0, 32)),
        write(tmp_path, "b.json", kv_run("jetrl", "bf16", 3600.0, 32)),
        write(tmp_path, "c.json", kv_run("jetrl", "fp8", 5400.0, 32)),
    ]
    lines = tool.kv_table(paths).splitlines()
    assert lines[0].startswith("36 layers, 32 sequences of 8 + 8192 tokens, 40 GiB of KV cache")
    # a decode step at the mean context 4104: KV 32 x 4104 x 36 x 4096 bytes = 19.37 GB in BF16, half in FP8
    kv = 32 * 4104 * 36 * 2 * 8 * 128 * 2 / 1e9
    head = 151936 * 4096 * 2 / 1e9
    bf16, fp8 = 13.9 + head + kv, 6.96 + head + kv / 2
    assert lines[4] == f"| bf16 | bf16 | none | 3,000 | 1.00x | 32 | 36 | 1.00x | 0 | {bf16:.1f} | 1.00x |"
    assert lines[6] == f"| jetrl | fp8 | none | 5,400 | 1.80x | 32 | 72 | 2.00x | 0 | {fp8:.1f} | {bf16 / fp8:.2f}x |"
    assert tool.main(["--kv", *paths]) == 0


def test_kv_table_puts_each_attention_pinning_in_its_own_row(tmp_path, capsys):
    """Runs of one mode and cache that differ in their attention pins (exact logprobs, one pin alone, none) are rows
    of their own against the one bf16 run; a second run of the same mode, cache and pins is refused, not dropped."""
    paths = [
        write(tmp_path, "a.json", kv_run("bf16", "bf16", 3000.0, 32)),
        write(tmp_path, "b.json", kv_run("jetrl", "fp8", 5400.0, 32)),
        write(tmp_path, "c.json", kv_run("jetrl", "fp8", 4500.0, 32, exact=True)),
        write(tmp_path, "d.json", kv_run("jetrl", "fp8", 5100.0, 32, pins=["one-split"])),
    ]
    rows = tool.kv_table(paths).splitlines()[4:]
    assert [r.split(" | ")[:5] for r in rows] == [
        ["| bf16", "bf16", "none", "3,000", "1.00x"],
        ["| jetrl", "fp8", "exact", "4,500", "1.50x"],
        ["| jetrl", "fp8", "none", "5,400", "1.80x"],
        ["| jetrl", "fp8", "one-split", "5,100", "1.70x"],
    ]
    again = write(tmp_path, "e.json", kv_run("jetrl", "fp8", 4400.0, 32, exact=True))
    assert tool.main(["--kv", *paths, again]) == 2
    assert "a second jetrl fp8 exact run" in capsys.readouterr().err
    other_base = write(tmp_path, "f.json", kv_run("bf16", "bf16", 3100.0, 32, pins=["one-split"]))
    assert tool.main(["--kv", *paths, other_base]) == 2
    assert "against one bf16 run with a BF16 cache" in capsys.readouterr().err


def test_kv_table_refuses_runs_of_other_settings(tmp_path, capsys):
    a = write(tmp_path, "a.json", kv_run("bf16", "bf16", 3000.0, 32))
    b = write(tmp_path, "b.json", kv_run("jetrl", "fp8", 5400.0, 32, kv_gb=20.0))
    assert tool.main(["--kv", a, b]) == 2
    assert "differ in ['kv_gb']" in capsys.readouterr().err
    assert tool.main(["--kv", b]) == 2
    assert "needs the bf16 run with a BF16 cache" in capsys.readouterr().err


def test_kv_table_gives_no_ratio_for_a_timed_run_that_compiled_kernels(tmp_path):
    cold = kv_run("jetrl", "fp8", 3201.0, 32)
    cold["decode"]["32"]["compiled_in_timed_run"] = 12
    paths = [write(tmp_path, "a.json", kv_run("bf16", "bf16", 3025.0, 32)), write(tmp_path, "b.json", cold)]
    row = tool.kv_table(paths).splitlines()[5]
    assert row.startswith("| jetrl | fp8 | none | 3,201 (not a rate: 12 kernels compiled inside) | n/a | 32 | 72 | 2.00x |"), row
