"""The FP8 benchmark tools (tools/bench/bench_fp8.py, bench_actor.py, bench_sp_overlap.py, bench_ordered_reduce.py, bench_pipeline.py, tools/gpu/gpu_fp8.sh) parse their arguments and refuse
cleanly where they cannot run: exit 2 and one line on stderr, no traceback. Nothing here asserts a time."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")


def run(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([*map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300)


def tiny_on_ranks(tool: str, ranks: int, out: Path, *args) -> tuple[subprocess.CompletedProcess, dict]:
    """`tool --tiny --json out *args` under torchrun on `ranks` CPU processes: the run (exit 0 asserted) and its JSON."""
    r = run(sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", tool, "--tiny", "--json", out, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads(out.read_text())


def one_line(r: subprocess.CompletedProcess, code: int, *words: str) -> None:
    err = r.stderr.strip()
    assert r.returncode == code, r.stdout + r.stderr
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert all(w in last for w in words), err


def test_bench_fp8_help_names_every_section():
    r = run(sys.executable, "tools/bench/bench_fp8.py", "--help")
    assert r.returncode == 0, r.stderr
    for section in ("ceilings", "quant", "gemm", "linear", "layer", "profile", "--json", "--sections"):
        assert section in r.stdout


def test_bench_fp8_refuses_an_unknown_section():
    one_line(run(sys.executable, "tools/bench/bench_fp8.py", "--sections", "linear", "bogus"), 2, "unknown section", "bogus")
    one_line(run(sys.executable, "tools/bench/bench_fp8.py", "--linear-m", "100"), 2, "--linear-m")


@no_cuda
@pytest.mark.parametrize("sections", [["linear", "layer", "profile"], ["quant,gemm"]])
def test_bench_fp8_without_cuda_exits_2_in_one_line(tmp_path, sections):
    r = run(
        sys.executable, REPO / "tools/bench/bench_fp8.py", "--sections", *sections, "--json", tmp_path / "b.json", cwd=tmp_path
    )
    one_line(r, 2, "error: ", "needs a CUDA GPU")
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "b.json").exists()


def test_bench_actor_help_and_bad_arguments():
    r = run(sys.executable, "tools/bench/bench_actor.py", "--help")
    assert r.returncode == 0 and "--layers" in r.stdout and "--modes" in r.stdout and "--layer" in r.stdout, r.stderr
    one_line(run(sys.executable, "tools/bench/bench_actor.py", "--layers", "0"), 2, "--layers")
    one_line(run(sys.executable, "tools/bench/bench_actor.py", "--modes", "fp4"), 2, "no precision mode preset", "fp4", "jetrl")
    one_line(run(sys.executable, "tools/bench/bench_actor.py", "--modes", "jetrl+backend"), 2, "section.key=value")
    one_line(
        run(sys.executable, "tools/bench/bench_actor.py", "--layer", "--variants", "bf16", "--profile", "jetrl"),
        2,
        "--profile",
        "jetrl",
    )


def test_bench_actor_profile_variants():
    """A bare --profile profiles every layer variant (it profiled none before: argparse's empty list); absent, bf16 and
    jetrl where they run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_actor", REPO / "tools/bench/bench_actor.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    variants = ["bf16", "jetrl", "jetrl/cublaslt"]
    assert bench.profile_variants([], variants) == variants
    assert bench.profile_variants(None, variants) == ["bf16", "jetrl"]
    assert bench.profile_variants(None, ["bf16", "jetrl/cublaslt"]) == ["bf16"]
    assert bench.profile_variants(["jetrl/cublaslt"], variants) == ["jetrl/cublaslt"]


@no_cuda
def test_bench_actor_without_cuda_exits_2_in_one_line(tmp_path):
    r = run(sys.executable, REPO / "tools/bench/bench_actor.py", "--json", tmp_path / "a.json", cwd=tmp_path)
    one_line(r, 2, "error: ", "needs a CUDA GPU", "--tiny")
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "a.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run")
def test_bench_actor_tiny_step_times_the_shipped_presets_and_the_offload(tmp_path):
    """`--tiny` composes the Qwen3-8B preset (TP 4, rollout TP 4) at TP 1 as the bench runs it, trains every variant
    from the same weights, and a `rollout.offload` variant also reports its round trip: on the CPU the bench trains FP32
    weights in place, so the FP32 grads and both Adam moments of the tiny actor's ~1.73M parameters leave, 12 bytes a
    parameter (the weights stay: the sync reads them)."""
    r = run(
        sys.executable,
        REPO / "tools/bench/bench_actor.py",
        "--tiny",
        "--modes",
        "bf16",
        "jetrl+rollout.offload=optimizer",
        "--json",
        tmp_path / "a.json",
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((tmp_path / "a.json").read_text())["rows"]
    assert [row["variant"] for row in rows] == ["bf16", "jetrl+rollout.offload=optimizer"] and all(
        "step_ms" in row for row in rows
    )
    assert "offload_gib" not in rows[0]
    params = rows[1]["offload_gib"] * 2**30 / 12
    assert 1.6e6 < params < 1.9e6 and rows[1]["offload_release_ms"] > 0 and rows[1]["offload_restore_ms"] > 0
    # the policy's FP8 W and W^T, about 2 bytes a linear parameter, dropped and made again
    assert 0 < rows[1]["fp8_dropped_gib"] * 2**30 / 2 < params and rows[1]["offload_requantize_ms"] > 0
    assert "| 2 | jetrl+rollout.offload=optimizer | " in r.stdout and "FP8 again ms" in r.stdout


def test_gpu_fp8_refuses_unknown_stages_and_lists_its_carry():
    r = run("bash", "tools/gpu/gpu_fp8.sh")
    assert r.returncode == 2 and "usage" in r.stdout
    r = run("bash", "tools/gpu/gpu_fp8.sh", "setup", "benchmark")
    assert r.returncode == 2 and "unknown stage benchmark" in r.stdout
    header = (REPO / "tools/gpu/gpu_fp8.sh").read_text()
    carry = json.loads(re.search(r"^#\s+(\[\"\.kits.*\])$", header, re.M).group(1))
    assert carry == [
        ".kits/deep_gemm/deep_gemm.tar.xz",
        ".kits/te/bin",
        ".kits/te/v2.20.2/base",
        ".kits/te/v2.20.2/core-sm90",
        ".whl",
    ]


def test_profile_timeline_measures_idle_between_kernels():
    """bench_fp8's profile reads the idle time off the kernel timeline: overlaps merged, each gap charged to the kernel
    that ended it, everything per pass."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_fp8", REPO / "tools/bench/bench_fp8.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ms = 1_000_000  # ns
    kernels = [
        (0, 4 * ms, "gemm"),
        (1 * ms, 2 * ms, "overlapped"),
        (5 * ms, 6 * ms, "quant"),
        (6 * ms, 9 * ms, "gemm"),
        (12 * ms, 13 * ms, "quant"),
        (13 * ms, 14 * ms, "gemm"),
    ]
    tl = bench.timeline(kernels[::-1], passes=2)
    assert tl["span_ms"] == 14 / 2 and tl["busy_ms"] == (4 + 1 + 3 + 1 + 1) / 2 and tl["idle_ms"] == (1 + 3) / 2
    assert tl["idle_before"] == [["quant", 2.0]]
    first = [(t - 20 * ms, e - 20 * ms, name) for t, e, name in kernels[:3]]  # a first pass, left out with skip=1
    assert bench.timeline(kernels[:3] + first, passes=1, skip=1) == bench.timeline(kernels[:3], passes=1)
    with pytest.raises(ValueError, match="at least one pass"):
        bench.timeline([], passes=1)
    with pytest.raises(ValueError, match="same kernels"):
        bench.timeline(kernels[:5], passes=2)


def test_linear_floor_adds_the_recipes_quantization_bytes_at_the_copy_rate(capsys):
    """bench_fp8's floor: DeepGEMM's GEMMs plus X's and dY's bytes at the copy rate (X: BF16 read, rows written, read
    back and re-quantized along tokens; dY: BF16 read, rows and token groups written; FP32 scales); worked numbers
    for M = N = K = 256 and one 128-multiple-free shape."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_fp8", REPO / "tools/bench/bench_fp8.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # [256, 256]: row scales 256 * 2 and token-group scales 256 * 2, 4 B each
    # X: 2 + 1 (forward) + 1 + 1 (backward) B per element, row scales written and read back, token-group scales written
    # dY: 2 + 1 + 1 B per element, both scale sets written
    sc = 4 * 256 * 2
    assert bench.recipe_quant_bytes(256, 256, 256) == (5 * 256 * 256 + 3 * sc) + (4 * 256 * 256 + 2 * sc)
    # partial groups count whole: 100 tokens (1 token group), 130 features (2 feature groups)
    rows_sc, cols_sc = 4 * 100 * 2, 4 * 130 * 1
    assert bench.recipe_quant_bytes(100, 130, 130) == (5 * 100 * 130 + 2 * rows_sc + cols_sc) + (
        4 * 100 * 130 + rows_sc + cols_sc
    )
    rows = [{"linear": "a", "M": 256, "N": 256, "K": 256, "ceiling_ms": 1.0, "bf16_ms": 3.0}]
    tot = {"bf16_ms": 3.0, "ours_ms": 2.0}
    gbps = bench.recipe_quant_bytes(256, 256, 256) / 1e6  # the bytes take exactly 1 ms
    bench.linear_floor(rows, tot, gbps)
    assert rows[0]["floor_ms"] == pytest.approx(2.0) and rows[0]["floor_ratio"] == pytest.approx(1.5)
    assert tot["floor_ratio"] == pytest.approx(1.5)
    assert "a 1.50x; sum 1.50x (2.000 ms); shipped defaults reach 100% of it" in capsys.readouterr().out


@no_cuda
def test_bench_host_without_cuda_exits_2_in_one_line():
    one_line(run(sys.executable, "tools/bench/bench_host.py"), 2, "bench_host.py: needs a CUDA GPU")
    r = run(sys.executable, "tools/bench/bench_host.py", "--help")
    assert r.returncode == 0 and "--profile" in r.stdout, r.stderr


def test_jit_cache_carries_deep_gemm_kernels_from_one_home_to_another(tmp_path):
    """tools/gpu/jit_cache.sh: `save` packs vLLM's and the trainer's DeepGEMM caches (relative to $HOME), `load` unpacks
    them into a fresh $HOME without overwriting what is there, and without a tarball does nothing."""
    import os

    script = REPO / "tools" / "gpu" / "jit_cache.sh"
    old, new = tmp_path / "old", tmp_path / "new"
    for rel in (".cache/vllm/deep_gemm/cache/kernel.a", ".deep_gemm/cache/kernel.b"):
        (old / rel).mkdir(parents=True)
        (old / rel / "kernel.cubin").write_bytes(b"sm_90 " + rel.encode())
    env = dict(os.environ, HOME=str(old))
    saved = subprocess.run(["bash", str(script), "save", str(tmp_path / "out")], env=env, capture_output=True, text=True)
    assert saved.returncode == 0 and "2 kernels" in saved.stdout, saved.stdout + saved.stderr
    (new / ".deep_gemm/cache/kernel.b").mkdir(parents=True)
    (new / ".deep_gemm/cache/kernel.b/kernel.cubin").write_bytes(b"mine")
    env = dict(os.environ, HOME=str(new), JIT_CACHE_TARBALL=str(tmp_path / "out" / "deep_gemm_jit.tgz"))
    loaded = subprocess.run(["bash", str(script), "load"], env=env, capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert (
        new / ".cache/vllm/deep_gemm/cache/kernel.a/kernel.cubin"
    ).read_bytes() == b"sm_90 .cache/vllm/deep_gemm/cache/kernel.a"
    assert (new / ".deep_gemm/cache/kernel.b/kernel.cubin").read_bytes() == b"mine"
    env["JIT_CACHE_TARBALL"] = str(tmp_path / "missing.tgz")
    nothing = subprocess.run(["bash", str(script), "load"], env=env, capture_output=True, text=True)
    assert nothing.returncode == 0 and nothing.stdout == ""


def test_bench_kv_scales_refuses_bad_arguments_and_needs_cuda(tmp_path):
    one_line(
        run(sys.executable, "tools/bench/bench_kv_scales.py", "--rows", "3", "--micro-batch", "2"), 2, "multiple of --micro-batch"
    )
    if not torch.cuda.is_available():
        r = run(sys.executable, REPO / "tools/bench/bench_kv_scales.py", "--json", tmp_path / "k.json", cwd=tmp_path)
        one_line(r, 2, "error: ", "needs a CUDA GPU")
        assert not (tmp_path / "k.json").exists()


def test_bench_sp_overlap_tiny_checks_every_overlap_on_two_gloo_ranks(tmp_path):
    """The TP benchmark's smoke run: both modes' sequence-parallel linears and each FP8 overlap, checked against the
    one-collective FP8 linear before timing (gathered outputs and gradients to the bit), on 2 CPU ranks."""
    r, report = tiny_on_ranks("tools/bench/bench_sp_overlap.py", 2, tmp_path / "sp.json")
    assert report["world"] == 2 and set(report["linears"]) == {"qkv", "o", "gate_up", "down"}
    for name, row in report["linears"].items():
        assert set(row["check"]) == {"none", "chunks2", "chunks4", "ring"}, name
        assert all(c["ok"] for c in row["check"].values()), (name, row["check"])
        if name in ("o", "down"):  # two partial sums: the same bits in any order
            assert all(c["output_rel_err"] == 0.0 for c in row["check"].values()), (name, row["check"])
        assert all(row[v] > 0 for v in ("bf16", "bf16-local", "jetrl-none", "jetrl-ring", "jetrl-local")), row
    assert "| all four |" in r.stdout


def test_bench_ordered_reduce_tiny_gives_every_rank_the_same_rank_order_bytes(tmp_path):
    """The rank-order TP sum's smoke run on 3 gloo ranks (shares that do not split evenly): the actor's all-to-all sum,
    vLLM's all-gathered one and torch's adds give the same bytes on every rank, NCCL's stand-in sums in its own order."""
    r, report = tiny_on_ranks("tools/bench/bench_ordered_reduce.py", 3, tmp_path / "ordered.json")
    assert report["world"] == 3 and len(report["rows"]) == 2
    for row in report["rows"].values():
        assert row["check"]["same"] and row["check"]["as_rank0"], row["check"]
        assert all(row[v] > 0 for v in ("nccl", "gather-torch", "gather", "ordered")), row
        assert row["check"]["nccl_max_rel"] < 0.02, row["check"]  # another order: within BF16 rounding of the sum
    assert "same on every rank" in r.stdout and "DIFFER" not in r.stdout


def test_bench_ordered_reduce_needs_torchrun_and_a_gpu_for_graphs():
    tool = (sys.executable, "tools/bench/bench_ordered_reduce.py")
    one_line(run(*tool, "--tiny"), 2, "torchrun")
    as_a_rank = dict(os.environ, WORLD_SIZE="1", RANK="0")  # what torchrun sets: the refusal comes before any group
    r = subprocess.run([*tool, "--tiny", "--graphs"], cwd=REPO, env=as_a_rank, capture_output=True, text=True, timeout=300)
    one_line(r, 2, "--graphs", "GPU")


def test_bench_pipeline_needs_torchrun_and_a_gpu():
    one_line(run(sys.executable, "tools/bench/bench_pipeline.py", "--tiny"), 2, "torchrun")
    r = run(sys.executable, "tools/bench/bench_pipeline.py", "--steps", "0")
    one_line(r, 2, "--steps must be >= 1")


def test_bench_pipeline_tiny_checks_fp8_against_bf16_in_two_stages_and_at_tp_2(tmp_path):
    """The update bench's smoke run on CPU ranks (gloo, emulated FP8): two pipeline stages, and TP 2 with sequence
    parallelism (one stage is bench_actor's own run). FP8's logprobs sit within FP8 noise of BF16's on the same weights, and its first step's
    gradient norm within 10% of BF16's."""
    for ranks, args in ((2, ()), (2, ("--tp", "2", "--override", "parallel.sequence_parallel=true"))):
        r, report = tiny_on_ranks("tools/bench/bench_pipeline.py", ranks, tmp_path / f"{ranks}{len(args)}.json", *args)
        rows = {row["variant"]: row for row in report["rows"]}
        assert report["world"] == ranks and report["tp"] * report["pp"] == ranks and "| jetrl |" in r.stdout
        assert rows["bf16"]["lp_rel_err_vs_bf16"] == 0 and 0 < rows["jetrl"]["lp_rel_err_vs_bf16"] < 0.5
        assert rows["jetrl"]["first_grad_norm"] == pytest.approx(rows["bf16"]["first_grad_norm"], rel=0.1)
        assert all(r["step_ms"] > 0 and r["logprob_ms"] > 0 for r in rows.values())


def test_bench_pipeline_report_reads_each_stage_and_bounds_1f1b(capsys):
    """The per-stage table: compute per micro-batch is busy less the pipeline's send/recv, and 1F1B's bound is
    (M + P - 1) x the busiest stage's compute per micro-batch."""
    from types import SimpleNamespace

    from tools.bench.bench_pipeline import report

    def stage(busy, p2p, gemm):
        cats = {"pipeline send/recv": p2p, "GEMM BF16": gemm}
        return dict(wall_ms=100.0, busy_ms=busy, idle_ms=100.0 - busy, launches=10, categories=cats, peak_gib=1.0)

    def row(variant, step_ms, err, stages):
        return dict(variant=variant, step_ms=step_ms, logprob_ms=step_ms / 10, lp_rel_err_vs_bf16=err, first_loss=0.1,
                    first_grad_norm=1.0, stages=stages)  # fmt: skip

    rows = [
        row("bf16", 100.0, 0.0, [stage(90.0, 10.0, 50.0), stage(80.0, 20.0, 40.0)]),
        row("jetrl", 80.0, 0.1, [stage(70.0, 10.0, 0.0), stage(75.0, 35.0, 0.0)]),
    ]
    report(rows, SimpleNamespace(layers=4, micro_batch=2, micro_batches=8, seq=64), pp=2)
    out = capsys.readouterr().out
    assert rows[0]["stages"][0]["compute_per_mb_ms"] == 10.0 and rows[0]["stages"][1]["compute_per_mb_ms"] == 7.5
    assert rows[0]["bound_1f1b_ms"] == 9 * 10.0 and rows[1]["bound_1f1b_ms"] == 9 * 7.5
    assert "jetrl vs bf16: step 1.25x, stage compute 1.33x, 1.50x, 1F1B bound 1.33x" in out


def test_gpu_queue_outlives_its_command_and_packs_its_output_in_one_file(tmp_path):
    """tools/gpu/queue.sh: `start` copies the checkout (not the kits or wheels) and runs the stages there in their own
    process session, OUT pointing into the queue; a second start while it runs is refused; `poll` says running or done
    with the stages' exit status, and packs the log, the stages and OUT into one tarball."""
    import os
    import tarfile

    script = REPO / "tools" / "gpu" / "queue.sh"
    checkout, queue, out = tmp_path / "checkout", tmp_path / "q", tmp_path / "out"
    (checkout / ".kits").mkdir(parents=True)
    (checkout / ".kits" / "big.tar.xz").write_bytes(b"kit")
    wait = "for i in $(seq 600); do [ -f go ] && break; sleep 0.1; done"  # until the test lets it end (60 s at most)
    (checkout / "stage.sh").write_text(f'echo "stage in $PWD"; echo made >"$OUT/result.txt"; {wait}; exit 3\n')
    env = dict(os.environ, QUEUE_DIR=str(queue), OUT=str(out))
    queue_sh = lambda *a: subprocess.run(["bash", str(script), *a], cwd=checkout, env=env, capture_output=True, text=True)  # noqa: E731
    started = queue_sh("start", "bash stage.sh")
    assert started.returncode == 0 and "queue: started" in started.stdout, started.stdout + started.stderr
    assert (queue / "repo" / "stage.sh").is_file() and not (queue / "repo" / ".kits").exists()
    again = queue_sh("start", "true")
    assert again.returncode == 2 and "one is running" in again.stdout
    assert "queue: running" in queue_sh("poll", "0").stdout
    (queue / "repo" / "go").touch()
    done = queue_sh("poll", "60")
    assert "queue: done, exit 3" in done.stdout and f"stage in {queue / 'repo'}" in done.stdout, done.stdout
    with tarfile.open(out / "queue.tgz") as tar:
        names = tar.getnames()
        assert {"out/result.txt", "log", "stages"} <= set(names), names
        assert tar.extractfile("stages").read() == b"bash stage.sh\n"
    assert queue_sh("start", "true").returncode == 0  # a finished queue gives way to the next
    assert queue_sh("bogus").returncode == 2
