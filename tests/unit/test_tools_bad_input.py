"""The tools keep the exit codes their --help promises when an input file is missing, truncated or corrupt, or the
output cannot be written: one line on stderr, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A sealed actor checkpoint and its FP8 export (the converter's own output)."""
    from megatron_jetrl.convert import convert
    from megatron_jetrl.convert.synthetic import save_synthetic_checkpoint, tiny_config
    from megatron_jetrl.fp8 import PrecisionFlow

    d = tmp_path_factory.mktemp("good")
    save_synthetic_checkpoint(d / "ckpt", tiny_config(), flow=PrecisionFlow(mode="jetrl"), iteration=1)
    convert(d / "ckpt", d / "export", dtype="fp8", rollout_tp=1)
    return d


def tool(name: str, *args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / name), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def damaged(src: Path, dst: Path, file_glob: str, how: str) -> Path:
    import shutil

    shutil.copytree(src, dst)
    f = next(dst.glob(file_glob))
    data = f.read_bytes()
    f.write_bytes({"truncate": data[: len(data) // 2], "head": data[:1000], "garbage": b"\x00garbage{" * 20}[how])
    return dst


def one_clear_line(r: subprocess.CompletedProcess, code: int, *words: str) -> None:
    err = r.stderr.strip()
    assert r.returncode == code, r.stdout + r.stderr
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("error: ") and all(w in err for w in words), err


@pytest.mark.parametrize(
    "file_glob, how",
    [
        ("*.safetensors", "truncate"),
        ("*.safetensors", "head"),
        ("config.json", "garbage"),
        ("model.safetensors.index.json", "truncate"),
    ],
)
def test_verify_exits_2_on_an_unreadable_export(good, tmp_path, file_glob, how):
    bad = damaged(good / "export", tmp_path / "export", file_glob, how)
    one_clear_line(tool("verify_fp8_checkpoint.py", bad, cwd=tmp_path), 2, str(bad), "truncated or corrupt")
    one_clear_line(tool("verify_fp8_checkpoint.py", tmp_path / "missing", cwd=tmp_path), 2, "has no config.json")


@pytest.mark.parametrize("file_glob, how", [("*.safetensors", "truncate"), ("meta.json", "garbage")])
def test_convert_exits_2_on_an_unreadable_checkpoint(good, tmp_path, file_glob, how):
    bad = damaged(good / "ckpt", tmp_path / "ckpt", file_glob, how)
    for extra in ((), ("--skip-sha256",)):
        one_clear_line(tool("convert_checkpoint.py", bad, tmp_path / "out", "--quiet", *extra, cwd=tmp_path), 2, str(bad))
    assert not (tmp_path / "out").exists()


def test_convert_exits_2_when_the_output_cannot_be_written(good, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory goes")
    one_clear_line(tool("convert_checkpoint.py", good / "ckpt", blocker / "out", "--quiet", cwd=tmp_path), 2, str(blocker))


def test_plot_and_sweep_report_on_unreadable_runs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(b"\x00\xff" * 500 + b'{"step": 0, "reward/mean"')  # corrupt, then torn
    (run / "summary.json").write_text('{"reward": ')
    one_clear_line(
        tool("plot_run.py", run, tmp_path / "missing", "-o", tmp_path / "p.png", cwd=tmp_path), 2, "no run has metrics"
    )
    good = tmp_path / "good"
    good.mkdir()
    (good / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.5}) + "\n")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    one_clear_line(tool("plot_run.py", good, "-o", blocker / "p.png", cwd=tmp_path), 2, "cannot write")
    one_clear_line(tool("sweep_report.py", good, "-o", blocker / "report", cwd=tmp_path), 2, "cannot write the report")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.5, "time/step": 1.0}) + "\n")
    r = tool("sweep_report.py", run, "-o", tmp_path / "report", "--strict", cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "summary.json unreadable (truncated or corrupt)" in r.stderr
