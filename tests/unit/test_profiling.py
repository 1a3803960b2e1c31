"""rl.profiling: the per-phase profile of one GRPO step (run.profile_step), on synthetic kernel timelines and a real
CPU profile; the config's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_jetrl.rl.config import ConfigError, load_config
from megatron_jetrl.rl.profiling import CATEGORIES, GAP_BINS_US, StepProfiler, category, gap_labels, kernel_timeline, summarize
from megatron_jetrl.rollout.sync import Phases

US = 1000  # ns


def test_kernel_timeline_merges_overlaps_and_bins_the_gaps():
    # two streams overlap (compute and NCCL), then gaps of 2 us, 10 us and 500 us before three kernels
    ivs = [
        (0, 100 * US, "gemm"),
        (50 * US, 150 * US, "ncclKernel"),
        (152 * US, 160 * US, "quant"),
        (170 * US, 180 * US, "quant"),
        (680 * US, 700 * US, "flash_fwd"),
    ]
    tl = kernel_timeline(ivs[::-1])  # any order
    assert tl["busy_ms"] == pytest.approx((150 + 8 + 10 + 20) / 1e3)
    assert tl["span_ms"] == pytest.approx(0.7)
    assert tl["idle_ms_by_gap_us"] == pytest.approx({"0-4": 0.002, "4-20": 0.010, "20-200": 0.0, ">200": 0.5})
    assert tl["late"] == pytest.approx({"quant": 0.012, "flash_fwd": 0.5})
    assert kernel_timeline([]) == {"busy_ms": 0, "span_ms": 0, "idle_ms_by_gap_us": dict.fromkeys(gap_labels(), 0.0), "late": {}}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 10**5), st.sampled_from("abc")), min_size=1, max_size=40))
def test_busy_plus_idle_is_the_span(raw):
    ivs = [(s, s + d, n) for s, d, n in raw]
    tl = kernel_timeline(ivs)
    covered = set()
    for s, e, _ in ivs:  # the union of the intervals, counted in whole nanoseconds
        covered.update(range(s, e))
    assert tl["busy_ms"] == pytest.approx(len(covered) / 1e6)
    assert tl["busy_ms"] + sum(tl["idle_ms_by_gap_us"].values()) == pytest.approx(tl["span_ms"])
    assert sum(tl["late"].values()) == pytest.approx(sum(tl["idle_ms_by_gap_us"].values()))


@pytest.mark.parametrize(
    "kernel, expected",
    [
        ("void deep_gemm::sm90_fp8_gemm_1d2d_impl<0u, 4096u, 128u>", "GEMM FP8"),
        ("_gemm_tma", "GEMM FP8"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "GEMM BF16"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "GEMM BF16"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication (NCCL)"),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "pipeline send/recv"),
        ("_quant_dual", "quantize"),
        ("_quant_1x128", "quantize"),
        ("per_token_group_quant_8bit_kernel", "quantize"),
        ("swiglu_bwd_tile_kernel", "quantize"),
        ("_swiglu_bwd", "logprobs, norms, glue (Triton, Inductor)"),
        ("flash_fwd_splitkv_kernel", "attention"),
        ("pytorch_flash::flash_bwd_dq_dk_dv_loop_kernel", "attention"),
        ("triton_red_fused__to_copy_amax_0", "logprobs, norms, glue (Triton, Inductor)"),
        ("void at::native::multi_tensor_apply_kernel<FusedAdam>", "optimizer"),
        ("_transpose_bytes", "copy/fill/layout"),
        ("Memcpy DtoD (Device -> Device)", "copy/fill/layout"),
        ("void at::native::vectorized_elementwise_kernel<4, add>", "elementwise/reduce"),
        ("some_unknown_kernel", "other"),
    ],
)
def test_kernel_categories(kernel, expected):
    assert category(kernel) == expected
    assert expected == "other" or expected in dict(CATEGORIES)


def test_summarize_a_gpu_phase():
    events = [
        ("kernel", "deep_gemm::sm90_fp8_gemm_1d2d", 0, 400 * US),
        ("launch", "cudaLaunchKernel", 0, 5 * US),
        ("kernel", "_quant_1x128", 450 * US, 500 * US),
        ("launch", "cudaLaunchKernel", 10 * US, 15 * US),
        ("kernel", "ncclDevKernel_AllReduce", 900 * US, 1000 * US),
    ]
    p = summarize(events, wall_s=1.2e-3, cuda=True)
    assert p["wall_ms"] == pytest.approx(1.2) and p["kernel_ms"] == pytest.approx(0.55) and p["launches"] == 2
    assert p["busy_ms"] == pytest.approx(0.55) and p["idle_ms"] == pytest.approx(0.65)
    assert p["categories"] == pytest.approx({"GEMM FP8": 0.4, "communication (NCCL)": 0.1, "quantize": 0.05})
    assert list(p["categories"]) == ["GEMM FP8", "communication (NCCL)", "quantize"]  # largest first
    assert p["late"][0][0] == "ncclDevKernel_AllReduce" and p["late"][0][1] == pytest.approx(0.4)
    assert p["top"][0] == ["deep_gemm::sm90_fp8_gemm_1d2d", pytest.approx(0.4)]


def test_a_cpu_phase_is_profiled_through_the_run_context(tmp_path, capsys):
    """The profiler, a subscriber of the run context, profiles the phases it wants of its step; `Phases(around=...)`
    times every phase as before; the step's row is marked and the table said (`announce`)."""
    from megatron_jetrl.rl.context import RunContext

    prof = StepProfiler(3, ("update",), tmp_path, rank=0, device=torch.device("cpu"), announce=True)
    run = RunContext(step=2)
    run.subscribe(prof)
    with Phases(around=run.phase)("update"):  # step 2: not profiled
        pass
    assert not prof.results
    run.step = 3
    t = Phases(around=run.phase)
    x = torch.randn(256, 256)
    with t("eval"):
        x @ x
    with t("update"):
        for _ in range(4):
            x = torch.tanh(x @ x)
    assert set(t) == {"time/eval", "time/update"} and list(prof.results) == ["update"]
    p = prof.results["update"]
    assert "aten::mm" in dict(p["top"]) and p["categories"]["GEMM BF16"] > 0  # aten::mm, by name
    assert 0 < p["kernel_ms"] <= p["wall_ms"] * 1.05 and "busy_ms" not in p
    saved = json.loads(prof.write().read_text())
    assert saved["step"] == 3 and saved["rank"] == 0 and list(saved["phases"]) == ["update"]
    assert (tmp_path / "profile_step3_rank0.json").exists()
    assert prof.table().splitlines()[2].startswith("| update |")
    row = {}
    run.end_step(row)
    assert row == {"profiled": 1} and "| update |" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["run.steps=3", "run.profile_step=3"], "run.profile_step=3 is not a step of this run (0 .. run.steps - 1 = 2)"),
        (["run.steps=3", "run.profile_step=-2"], "run.profile_step=-2 is not a step"),
        (["run.steps=0", "run.profile_step=0"], "run.profile_step=0 is not a step"),
        (
            ["run.profile_step=1", "run.profile_phases=update,backward"],
            "run.profile_phases must name one or more of rollout, eval, update, sync",
        ),
        (["run.profile_phases=' ,'"], "run.profile_phases must name one or more"),
    ],
)
def test_profile_settings_are_refused_with_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config("configs/tiny.yaml", overrides=overrides)


def test_profile_phases_parse():
    cfg = load_config("configs/tiny.yaml", overrides=["run.steps=4", "run.profile_step=2", "run.profile_phases=rollout, sync"])
    assert cfg.run.profile_step == 2 and cfg.run.profiled_phases() == ("rollout", "sync")
    assert load_config("configs/tiny.yaml").run.profile_step == -1
    assert GAP_BINS_US == (4, 20, 200)


def _profiled_run(directory, mode, phases, step=2, rank=0):
    directory.mkdir(parents=True)
    (directory / f"profile_step{step}_rank{rank}.json").write_text(
        json.dumps({"step": step, "rank": rank, "cuda": True, "phases": phases})
    )
    (directory / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "mode": mode}) + "\n" for s in range(step + 1)))


def _phase(wall, busy, gemm, idle_long, cat="GEMM BF16"):
    return {
        "wall_ms": wall,
        "busy_ms": busy,
        "kernel_ms": busy,
        "launches": 10,
        "categories": {cat: gemm, "attention": busy - gemm},
        "idle_ms_by_gap_us": {"0-4": 1.0, "4-20": 1.0, "20-200": idle_long / 2, ">200": idle_long / 2},
    }


def test_profile_report_says_what_bounds_each_phase(tmp_path, capsys):
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import profile_report

    _profiled_run(tmp_path / "bf16", "bf16", {"update": _phase(100.0, 95.0, 60.0, 3.0), "eval": _phase(40.0, 38.0, 20.0, 1.0)})
    # jetrl: GEMMs faster on the GPU, but the host holds the update up (GPU busy 60 of 120 ms)
    _profiled_run(
        tmp_path / "jetrl",
        "jetrl",
        {"update": _phase(120.0, 60.0, 25.0, 58.0, cat="GEMM FP8"), "eval": _phase(32.0, 30.0, 12.0, 1.0, cat="GEMM FP8")},
    )
    assert profile_report.main([str(tmp_path / "bf16"), str(tmp_path / "jetrl"), "-o", str(tmp_path / "rep")]) == 0
    rs = {
        (r["phase"], r["mode"]): r for r in profile_report.rows([profile_report.load(tmp_path / m, 0) for m in ("bf16", "jetrl")])
    }
    up = rs[("update", "jetrl")]
    assert up["wall_ratio"] == pytest.approx(100 / 120) and up["busy_ratio"] == pytest.approx(95 / 60)
    assert up["bound"] == "host" and rs[("update", "bf16")]["bound"] == "GPU" and rs[("eval", "jetrl")]["bound"] == "GPU"
    assert up["GEMM FP8"] == 25.0 and up["GEMM BF16"] == 0 and up["idle_long_ms"] == 58.0 and up["other_ms"] == 0
    text = (tmp_path / "rep.md").read_text()
    assert "| update | jetrl | 120.0 | 60.0 (50%) | 58.0 | 25.0 | 0.0 | 0.0 | 35.0 | 0.0 | 0.0 | 0.83x | 1.58x | host |" in text
    assert [line.split(" | ")[:2] for line in text.splitlines()[2:6]] == [
        ["| update", "bf16"],
        ["| update", "jetrl"],
        ["| eval", "bf16"],
        ["| eval", "jetrl"],
    ]
    assert profile_report.main([str(tmp_path / "bf16"), str(tmp_path / "nothing")]) == 2
    assert "has no profile_step*_rank0.json: run it with run.profile_step=N" in capsys.readouterr().err


def test_profile_report_gives_each_pipeline_stage_and_the_bubble_share(tmp_path):
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import profile_report

    run = tmp_path / "pp2"
    run.mkdir()
    # TP 2 x PP 2: ranks 0, 1 are stage 0; ranks 2, 3 stage 1 (megatron's order: tp fastest, pp slowest)
    update = {0: (100.0, 70.0, 20.0), 1: (100.0, 74.0, 16.0), 2: (98.0, 90.0, 2.0), 3: (98.0, 92.0, 4.0)}  # wall, busy, send/recv
    for rank, (wall, busy, p2p) in update.items():
        phases = {
            "update": {
                "wall_ms": wall,
                "busy_ms": busy,
                "idle_ms": wall - busy,
                "kernel_ms": busy,
                "categories": {"GEMM BF16": busy - p2p, "pipeline send/recv": p2p},
                "top": [],
            },
            # a profile from before the send/recv category: its kernels among `top`; the rollout is not pipelined
            "eval": {
                "wall_ms": 50.0,
                "busy_ms": 40.0,
                "idle_ms": 10.0,
                "kernel_ms": 40.0,
                "categories": {"communication (NCCL)": 10.0},
                "top": [["ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 10.0 if rank < 2 else 0.0]],
            },
            "rollout": {"wall_ms": 9.0, "busy_ms": 9.0, "idle_ms": 0.0, "kernel_ms": 9.0, "categories": {}, "top": []},
        }
        (run / f"profile_step2_rank{rank}.json").write_text(json.dumps({"step": 2, "rank": rank, "cuda": True, "phases": phases}))
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "mode": "bf16", "tp": 2, "pp": 2, "dp": 1}) + "\n" for s in range(3))
    )
    (run / "config.yaml").write_text(
        "grpo: {prompts_per_step: 8, micro_batch_size: 2, logprob_micro_batch_size: 0}\nrollout: {n: 4}\n"
    )
    rs = {(r["phase"], r["stage"]): r for r in profile_report.stage_rows(run, "bf16", 2)}
    assert sorted(rs) == [("eval", 0), ("eval", 1), ("update", 0), ("update", 1)]
    s0, s1 = rs[("update", 0)], rs[("update", 1)]
    assert (s0["work_ms"], s0["p2p_ms"], s0["idle_ms"], s0["wall_ms"]) == (54.0, 18.0, 28.0, 100.0)
    assert (s1["work_ms"], s1["p2p_ms"], s1["wall_ms"]) == (88.0, 3.0, 98.0) and s1["busiest"] and not s0["busiest"]
    assert s0["bubble"] == pytest.approx(1 - 71 / 100) and s0["imbalance"] == pytest.approx(1 - 71 / 88)
    assert s0["schedule"] == pytest.approx(1 / 17)  # 32 sequences in micro-batches of 2: m = 16, p = 2
    assert rs[("eval", 0)]["p2p_ms"] == 10.0 and rs[("eval", 1)]["work_ms"] == 40.0
    text = profile_report.stage_table(profile_report.stage_rows(run, "bf16", 2))
    assert "| update | bf16 | 0 | 100.0 | 54.0 | 18.0 | 28.0 | 29.0% | 19.3% | 5.9% |" in text
    assert "| update | bf16 | 1 (busiest) | 98.0 | 88.0 | 3.0 | 7.0 |  |  |  |" in text
    profile = json.loads((run / "profile_step2_rank2.json").read_text())
    del profile["phases"]["eval"]  # a stage that did not profile a phase: no rows for that phase
    (run / "profile_step2_rank2.json").write_text(json.dumps(profile))
    (run / "profile_step2_rank3.json").write_text(json.dumps(profile))
    assert {r["phase"] for r in profile_report.stage_rows(run, "bf16", 2)} == {"update"}
    (run / "config.yaml").unlink()  # no config: no schedule column; PP 1 or missing ranks: no stage rows
    assert profile_report.stage_rows(run, "bf16", 2)[0]["schedule"] is None
    (run / "profile_step2_rank3.json").unlink()
    assert profile_report.stage_rows(run, "bf16", 2) == []
