"""metrics.jsonl / TensorBoard writer, summaries, progress, and the tools that read runs: sweep report and plots."""

from __future__ import annotations

import csv
import io
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_jetrl.rl.metrics import METRIC_KEYS, MetricsWriter, format_summary, progress, read_metrics, summarize

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import plot_run  # noqa: E402
import sweep_report  # noqa: E402


def _strict_lines(path: Path) -> list[dict]:
    def no_constants(name):
        raise ValueError(f"non-JSON constant {name}")

    return [json.loads(line, parse_constant=no_constants) for line in path.read_text().splitlines()]


def row(step: int, **extra) -> dict:
    base = {k: 0.0 for k in METRIC_KEYS}
    base.update({"step": step, "reward/mean": 0.1 * step, "time/step": 1.0 + step, "mode": "jetrl", "tp": 2, "pp": 1, "dp": 1})
    base.update(extra)
    return base


# ---------------------------------------------------------------- MetricsWriter


def test_writer_one_strict_json_line_per_step(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(row(0, **{"loss/pg": torch.tensor(-0.5), "grad_norm": float("nan"), "loss/kl": float("inf")}))
        w.write(row(1, **{"grad_norm": torch.tensor(2.0, dtype=torch.bfloat16)}))
        w.write({"step": torch.tensor(2), "reward/mean": 1})
    lines = _strict_lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in lines] == [0, 1, 2]
    assert lines[0]["loss/pg"] == -0.5 and lines[0]["grad_norm"] is None and lines[0]["loss/kl"] is None
    assert lines[1]["grad_norm"] == 2.0 and lines[1]["mode"] == "jetrl" and lines[1]["tp"] == 2
    assert lines[2] == {"step": 2, "reward/mean": 1}
    assert not (tmp_path / "tb").exists()


def test_writer_each_line_is_on_disk_before_close(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    w.write(row(0))
    w.write(row(1))
    # a killed run never closes the writer: the lines are already in the file
    assert [r["step"] for r in _strict_lines(tmp_path / "metrics.jsonl")] == [0, 1]
    w.close()
    w.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        w.write(row(2))


def test_writer_resume_drops_steps_from_resume_step_and_torn_line(tmp_path, capsys):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for s in range(5):
            w.write(row(s))
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 5, "reward/me')  # killed mid-line
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=3) as w:
        assert [r["step"] for r in _strict_lines(path)] == [0, 1, 2]
        with pytest.raises(ValueError, match="steps must increase"):
            w.write(row(2))
        w.write(row(3))
        w.write(row(4))
    assert [r["step"] for r in _strict_lines(path)] == [0, 1, 2, 3, 4]
    err = capsys.readouterr().err
    assert "dropped 2 line(s) with step >= 3 and 1 unreadable line(s); kept 3 (resuming at step 3)" in err
    # a fresh run (resume_step 0, the default) in the same directory starts the file afresh
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(row(0))
    assert [r["step"] for r in _strict_lines(path)] == [0]
    assert "fresh run" in capsys.readouterr().err


def test_writer_resume_without_anything_to_drop_leaves_file_alone(tmp_path, capsys):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(row(0))
        w.write(row(1))
    before = (tmp_path / "metrics.jsonl").stat().st_ino
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=2) as w:
        w.write(row(2))
    assert (tmp_path / "metrics.jsonl").stat().st_ino == before
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    assert capsys.readouterr().err == ""


def test_writer_rejects_bad_steps(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        with pytest.raises(ValueError, match="integer 'step'"):
            w.write({"reward/mean": 1.0})
        with pytest.raises(ValueError, match="integer 'step'"):
            w.write({"step": 1.5})
        w.write(row(3))
        with pytest.raises(ValueError, match="step 3 after step 3"):
            w.write(row(3))


def test_writer_disabled_on_other_ranks_touches_nothing(tmp_path):
    out = tmp_path / "run"
    with MetricsWriter(out, enabled=False) as w:
        w.write(row(0))
        w.write(row(0))  # not even checked
    assert not out.exists()


def test_writer_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path) as w:
        for s in range(3):
            w.write(row(s, **{"grad_norm": float("nan") if s == 1 else 0.5}))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward/mean", "time/step", "mismatch/k3_kl", "throughput/tokens_per_s"} <= tags
    assert not tags & {"step", "tp", "pp", "dp", "mode"}
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/mean")] == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert [e.step for e in acc.Scalars("grad_norm")] == [0, 2]  # the NaN step is not plotted


def test_read_metrics_tolerates_torn_and_duplicate_lines(tmp_path):
    assert read_metrics(tmp_path) == []
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "a": 1}\n{"step": 0, "a": 0}\n\n{"step": 1, "a": 2}\n[1]\n{"step": 2, "a"'
    )
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "a": 0}, {"step": 1, "a": 2}]


# ---------------------------------------------------------------- summary and progress

ROWS = [
    {
        "step": 0,
        "reward/mean": 0.25,
        "response_length/mean": 12.0,
        "mismatch/mean_abs_diff": 0.0,
        "mismatch/k3_kl": 0.0,
        "mismatch/max_abs_diff": 0.0,
        "time/rollout": 1.0,
        "time/eval": 0.2,
        "time/update": 0.6,
        "time/sync": 0.05,
        "time/step": 1.85,
        "throughput/tokens_per_s": 300.0,
        "mode": "jetrl",
        "tp": 2,
        "pp": 1,
        "dp": 1,
    },
    {
        "step": 1,
        "reward/mean": 0.5,
        "response_length/mean": 9.0,
        "mismatch/mean_abs_diff": 0.002,
        "mismatch/k3_kl": 1e-6,
        "mismatch/max_abs_diff": 0.02,
        "time/rollout": 2.0,
        "time/eval": 0.4,
        "time/update": 0.8,
        "time/sync": 0.15,
        "time/step": 3.35,
        "throughput/tokens_per_s": 340.0,
        "mode": "jetrl",
        "tp": 2,
        "pp": 1,
        "dp": 1,
    },
]


def test_summarize():
    s = summarize(ROWS)
    assert s["steps"] == 2 and s["mode"] == "jetrl" and (s["tp"], s["pp"], s["dp"]) == (2, 1, 1)
    assert s["reward"] == {"first": 0.375, "last": 0.375, "window": 2}  # means of the first / last min(10, steps)
    assert s["response_length"] == {"first": 12.0, "last": 9.0}
    assert s["mismatch"] == {"mean_abs_diff": 0.001, "k3_kl": 5e-7, "max_abs_diff": 0.02}
    assert s["time"] == pytest.approx({"rollout": 1.5, "eval": 0.3, "update": 0.7, "sync": 0.1, "step": 2.6})
    assert s["throughput_tokens_per_s"] == 320.0
    empty = summarize([{"step": 0, "reward/mean": None}])
    assert empty["reward"] == {"first": None, "last": None, "window": 0} and empty["time"]["step"] is None


def test_headline_reward_is_a_mean_over_the_first_and_last_10_steps():
    rows = [{"step": i, "reward/mean": i / 100} for i in range(30)]
    assert summarize(rows)["reward"] == pytest.approx({"first": 0.045, "last": 0.245, "window": 10})
    assert "  reward           0.045 -> 0.245  (mean of the first -> last 10 steps)" in format_summary(rows).splitlines()


def test_format_summary():
    assert format_summary(ROWS) == "\n".join(
        [
            "GRPO run: 2 steps, mode jetrl, TP 2 PP 1 DP 1",
            "  reward           0.375 -> 0.375  (mean of the first -> last 2 steps)",
            "  response length  12 -> 9",
            "  mismatch         mean |logp diff| 0.001, k3 KL 5e-07, max |logp diff| 0.02",
            "  time/step (s)    rollout 1.5 | eval 0.3 | update 0.7 | sync 0.1 | total 2.6  (mean of 2 steps)",
            "  throughput       320 tokens/s",
        ]
    )
    assert format_summary([]) == "GRPO run: no steps logged"
    assert "reward           n/a -> n/a  (mean of the first -> last 0 steps)" in format_summary([{"step": 0}])


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_lines_off_a_terminal_bar_on_one():
    log = io.StringIO()
    with progress(3, "GRPO jetrl", stream=log, interval=3600) as bar:
        assert bar.active
        for _ in range(3):
            bar.update(1, reward=0.123456, mismatch="0")
    lines = log.getvalue().splitlines()  # first step and last step only (interval not reached)
    assert len(lines) == 2
    assert lines[0].startswith("GRPO jetrl: 1/3 steps, ") and lines[0].endswith(", reward=0.1235, mismatch=0")
    assert lines[1].startswith("GRPO jetrl: 3/3 steps, ")
    quiet = io.StringIO()
    for kwargs in ({"enabled": False}, {"interval": None}):
        with progress(3, "x", stream=quiet, **kwargs) as bar:
            bar.update(1)
    assert quiet.getvalue() == ""
    tty = _Tty()
    with progress(2, "bar", stream=tty) as bar:
        bar.update(1, loss=0.5)
        bar.update(1)
    assert "bar" in tty.getvalue() and "2/2" in tty.getvalue()


# ---------------------------------------------------------------- sweep report


def make_run(
    directory: Path,
    tp,
    mode,
    times: list[dict] | None,
    *,
    status=None,
    summary=True,
    tokens=100.0,
    rollout=("native", 1),
    mismatch=None,
    profiled=None,
    memory=None,
):
    """A run dir as the trainer + tp_sweep.sh leave it; times: per step {phase: seconds}; tokens: per step;
    mismatch: per step mean |dlogp| (k3 KL a tenth of it, the max ten times it); profiled: the step run.profile_step named;
    memory: per step {phase: GiB} (the loop's memory/<phase>_gib)."""
    directory.mkdir(parents=True)
    if times is not None:
        with open(directory / "metrics.jsonl", "w") as f:
            for i, t in enumerate(times):
                r = {
                    "step": i,
                    "reward/mean": 0.5,
                    **{f"time/{k}": v for k, v in t.items()},
                    "mode": mode,
                    "tp": tp,
                    "rollout_engine": rollout[0],
                    "rollout_tp": rollout[1],
                }
                if mismatch is not None:
                    r |= {
                        "mismatch/mean_abs_diff": mismatch[i],
                        "mismatch/k3_kl": mismatch[i] / 10,
                        "mismatch/max_abs_diff": mismatch[i] * 10,
                    }
                r["throughput/tokens_per_s"] = tokens / t["step"]
                if i == profiled:
                    r["profiled"] = 1
                if memory is not None:
                    r |= {f"memory/{k}_gib": v for k, v in memory[i].items()}
                f.write(json.dumps(r) + "\n")
    if summary:
        (directory / "summary.json").write_text("{}")
    if status is not None:
        (directory / "sweep_status.json").write_text(json.dumps(status))


def phases(rollout, evaluation, update, sync):
    return {"rollout": rollout, "eval": evaluation, "update": update, "sync": sync, "step": rollout + evaluation + update + sync}


@pytest.fixture
def sweep(tmp_path):
    d = tmp_path / "sweep"
    warm = phases(9.0, 9.0, 9.0, 9.0)  # first step: left out of the medians
    ok = lambda tp, mode: {"status": "ok", "tp": tp, "mode": mode, "rc": 0}  # noqa: E731
    make_run(
        d / "sweep_tp1_bf16",
        1,
        "bf16",
        [warm, phases(2.0, 0.5, 1.0, 0.5), phases(2.2, 0.5, 1.2, 0.5), phases(1.8, 0.5, 0.8, 0.5)],
        status=ok(1, "bf16"),
    )
    # jetrl answers with longer responses: its rollout speedup is in tokens/s (120/1.6 vs 100/2.0), not in time
    make_run(
        d / "sweep_tp1_jetrl",
        1,
        "jetrl",
        [warm, phases(1.6, 0.4, 0.5, 0.5)],
        status=ok(1, "jetrl"),
        tokens=120.0,
        mismatch=[0.5, 0.125],
    )
    # TP2 with vLLM (rollout TP2): its own bf16 baseline, not the native engine's
    make_run(d / "multi_tp2_rtp2_bf16", 2, "bf16", [warm, phases(2.0, 0.5, 1.0, 0.5)], rollout=("vllm", 2), mismatch=[0.02, 0.02])
    make_run(
        d / "multi_tp2_rtp2_jetrl",
        2,
        "jetrl",
        [warm, phases(1.0, 0.5, 0.5, 0.5)],
        rollout=("vllm", 2),
        mismatch=[0.2, 0.1],
        memory=[{"rollout": 50.25, "update": 40.5}, {"rollout": 51.0, "update": 39.0}],
    )  # the most over all steps
    (d / "multi_tp2_rtp2_jetrl" / "gpu_memory.csv").write_text("0, 4\n1, 4\n0, 62976\n1, 60093\n0, 27049\n")  # nvidia-smi
    make_run(
        d / "sweep_tp1_bf16-train-fp8-rollout",
        1,
        "bf16-train-fp8-rollout",
        [warm],
        status={"status": "failed", "tp": 1, "mode": "bf16-train-fp8-rollout", "rc": 3},
        summary=False,
    )
    # TP2: no bf16 run at all (its directory was never written) -> n/a speedups
    make_run(d / "sweep_tp2_jetrl", 2, "jetrl", [phases(1.0, 0.25, 0.5, 0.25)], status=ok(2, "jetrl"))
    # a run without sweep_status.json that did not finish, and one identified only by its config
    make_run(d / "manual_tp2", 2, "bf16-train-fp8-rollout", [phases(1.0, 0.1, 0.1, 0.1)], summary=False)
    make_run(
        d / "tp4_skip",
        None,
        None,
        None,
        summary=False,
        status={"status": "skipped", "tp": 4, "mode": "jetrl", "rc": None, "reason": "needs 4 processes, 2 available"},
    )
    make_run(
        d / "sweep_tp8_jetrl",
        None,
        None,
        None,
        summary=False,
        status={"status": "invalid", "tp": 8, "mode": "jetrl", "rc": None, "reason": "config error: TP=8 does not divide 2"},
    )
    dirs = [
        d / n
        for n in (
            "sweep_tp2_jetrl",
            "tp4_skip",
            "sweep_tp1_jetrl",
            "sweep_tp1_bf16-train-fp8-rollout",
            "manual_tp2",
            "sweep_tp1_bf16",
            "sweep_tp2_bf16",
            "sweep_tp8_jetrl",
            "multi_tp2_rtp2_jetrl",
            "multi_tp2_rtp2_bf16",
        )
    ]
    return d, [str(x) for x in dirs]


EXPECTED_TABLE = """\
| TP | mode | rollout | status | timed steps | rollout (s) | eval (s) | update (s) | sync (s) | step (s) | tokens/s | rollout tokens/s | rollout speedup | update speedup | step speedup | mean abs dlogp | k3 KL | max abs dlogp | peak GPU GiB | rollout GiB | update GiB |
|---:|:---|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|
| 1 | bf16 | native tp1 | ok | 3 | 2.000 | 0.500 | 1.000 | 0.500 | 4.000 | 25.0 | 50.0 | 1.00x | 1.00x | 1.00x | - | - | - | - | - | - |
| 1 | bf16-train-fp8-rollout | native tp1 | FAILED: exit code 3 | 1 | 9.000 | 9.000 | 9.000 | 9.000 | 36.000 | 2.8 | 11.1 | - | - | - | - | - | - | - | - | - |
| 1 | jetrl | native tp1 | ok | 1 | 1.600 | 0.400 | 0.500 | 0.500 | 3.000 | 40.0 | 75.0 | 1.50x | 2.00x | 1.33x | 0.125 | 0.0125 | 5 | - | - | - |
| 2 | bf16 | - | FAILED: run directory missing | - | - | - | - | - | - | - | - | - | - | - | - | - | - | - | - | - |
| 2 | bf16-train-fp8-rollout | native tp1 | FAILED: no summary.json (run did not finish) | 1 | 1.000 | 0.100 | 0.100 | 0.100 | 1.300 | 76.9 | 100.0 | - | - | - | - | - | - | - | - | - |
| 2 | jetrl | native tp1 | ok | 1 | 1.000 | 0.250 | 0.500 | 0.250 | 2.000 | 50.0 | 100.0 | n/a | n/a | n/a | - | - | - | - | - | - |
| 2 | bf16 | vllm tp2 | ok | 1 | 2.000 | 0.500 | 1.000 | 0.500 | 4.000 | 25.0 | 50.0 | 1.00x | 1.00x | 1.00x | 0.02 | 0.002 | 0.2 | - | - | - |
| 2 | jetrl | vllm tp2 | ok | 1 | 1.000 | 0.500 | 0.500 | 0.500 | 2.500 | 40.0 | 100.0 | 2.00x | 2.00x | 1.60x | 0.1 | 0.01 | 2 | 61.5 | 51.0 | 40.5 |
| 4 | jetrl | - | skipped: needs 4 processes, 2 available | - | - | - | - | - | - | - | - | - | - | - | - | - | - | - | - | - |
| 8 | jetrl | - | invalid: config error: TP=8 does not divide 2 | - | - | - | - | - | - | - | - | - | - | - | - | - | - | - | - | - |
"""


def test_sweep_report_table(sweep, capsys):
    d, dirs = sweep
    # a failed run shows the times it logged (here only its warm-up step) but no speedups
    assert sweep_report.main(dirs) == 0
    out = capsys.readouterr()
    md = (d / "sweep_report.md").read_text()
    assert md == EXPECTED_TABLE + "\n" + sweep_report.CAPTION + "\n"
    assert out.out.startswith(EXPECTED_TABLE)
    assert f"wrote {d / 'sweep_report'}.md and {d / 'sweep_report'}.csv" in out.out
    assert "3 run(s) FAILED" in out.err
    rows = list(csv.DictReader(open(d / "sweep_report.csv")))
    assert [(r["tp"], r["mode"], r["status"]) for r in rows] == [
        ("1", "bf16", "ok"),
        ("1", "bf16-train-fp8-rollout", "failed"),
        ("1", "jetrl", "ok"),
        ("2", "bf16", "failed"),
        ("2", "bf16-train-fp8-rollout", "failed"),
        ("2", "jetrl", "ok"),
        ("2", "bf16", "ok"),
        ("2", "jetrl", "ok"),
        ("4", "jetrl", "skipped"),
        ("8", "jetrl", "invalid"),
    ]
    jet1 = rows[2]
    assert float(jet1["speedup_update"]) == 2.0 and math.isclose(float(jet1["speedup_step"]), 4 / 3)
    assert float(jet1["speedup_rollout"]) == 1.5 and float(jet1["rollout_tokens_per_s"]) == 75.0
    assert jet1["steps_total"] == "2" and jet1["steps_timed"] == "1"
    assert rows[5]["reason"] == "no successful bf16 run at TP 2 with rollout native tp1" and rows[5]["speedup_step"] == ""
    vllm = rows[7]  # baseline: the vLLM-TP2 bf16 run, not the native one
    assert vllm["rollout"] == "vllm tp2" and float(vllm["speedup_step"]) == 1.6 and float(vllm["mismatch_mean_abs"]) == 0.1
    assert float(vllm["mismatch_max_abs"]) == 2.0 and float(jet1["mismatch_k3"]) == 0.0125
    assert float(vllm["peak_gpu_gib"]) == 61.5 and jet1["peak_gpu_gib"] == ""
    assert (float(vllm["rollout_gib"]), float(vllm["update_gib"])) == (51.0, 40.5) and jet1["update_gib"] == ""
    assert sweep_report.main(dirs + ["--strict", "-o", str(d / "again")]) == 1
    assert (d / "again.md").read_text() == md


def test_sweep_report_warmup_option(sweep):
    _, dirs = sweep
    rows = {(r.tp, r.mode): r for r in sweep_report.build_rows(dirs, warmup=0)}
    assert rows[(1, "bf16")].times["rollout"] == pytest.approx(2.1)  # median of 9, 2, 2.2, 1.8
    assert rows[(1, "bf16")].steps_timed == 4


def test_sweep_report_leaves_a_profiled_step_out(tmp_path):
    """A step profiled with run.profile_step runs slower: it leaves the medians unless it is the only timed step."""
    warm, slow = phases(9.0, 9.0, 9.0, 9.0), phases(5.0, 5.0, 5.0, 5.0)
    make_run(tmp_path / "a", 1, "bf16", [warm, phases(2.0, 0.5, 1.0, 0.5), slow, phases(2.0, 0.5, 1.0, 0.5)], profiled=2)
    make_run(tmp_path / "b", 1, "jetrl", [warm, slow], profiled=1)
    rows = {r.mode: r for r in sweep_report.build_rows([str(tmp_path / "a"), str(tmp_path / "b")])}
    assert rows["bf16"].steps_timed == 2 and rows["bf16"].times["rollout"] == 2.0
    assert rows["jetrl"].steps_timed == 1 and rows["jetrl"].times["rollout"] == 5.0


# ---------------------------------------------------------------- plots


def test_plot_run_writes_png(sweep, tmp_path, capsys):
    _, dirs = sweep
    out = tmp_path / "plots" / "runs.png"
    assert plot_run.main([dirs[2], dirs[5], dirs[0] + "/metrics.jsonl", dirs[1], "-o", str(out), "--title", "t"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 1000 and height > 1000
    assert "tp4_skip: no metrics.jsonl rows, left out of the plot" in capsys.readouterr().err
    assert plot_run.main([dirs[1], "-o", str(tmp_path / "none.png")]) == 2
    assert not (tmp_path / "none.png").exists()


def test_tools_run_as_scripts(sweep, tmp_path):
    _, dirs = sweep
    for tool in ("sweep_report.py", "plot_run.py"):
        r = subprocess.run([sys.executable, str(REPO / "tools" / tool), "--help"], capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 0 and "usage" in r.stdout, r.stderr


def test_reward_band_stays_within_0_and_1():
    rows = [{"step": 0, "reward/mean": 0.9, "reward/std": 0.3}, {"step": 1, "reward/mean": 0.1, "reward/std": 0.3}]
    lo, hi = plot_run.reward_band(rows, [0, 1], [0.9, 0.1])
    assert lo == pytest.approx([0.6, 0.0]) and hi == pytest.approx([1.0, 0.4])
