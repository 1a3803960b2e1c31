"""tools/plot_length_mismatch.py: per-length aggregation over steps, the PNG, exit 2 on unreadable input."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("plot_length_mismatch", REPO / "tools" / "plot_length_mismatch.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def row(step: int, **buckets) -> dict:
    r = {
        "step": step,
        "reward/mean": 0.5,
        "mismatch/tokens": sum(b[0] for b in buckets.values()),
        "mismatch/mean_abs_diff": 0.1,
        "mismatch/k3_kl": 0.01,
        "mismatch/max_abs_diff": 0.5,
        "mismatch/abs_diff_gt1_frac": 0.0,
    }
    for tag, (tokens, responses, mean, mx, seq) in buckets.items():
        r |= {
            f"mismatch/{tag}/{k}": v
            for k, v in dict(
                tokens=tokens,
                responses=responses,
                mean_abs_diff=mean,
                k3_kl=mean / 10,
                max_abs_diff=mx,
                abs_diff_gt1_frac=0.0,
                seq_abs_log_ratio=seq,
            ).items()
        }
    return r


def write(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_buckets_are_weighted_over_steps():
    rows = [
        row(0, **{"len4-8": (10, 2, 0.1, 0.3, 0.2)}),
        row(1, **{"len4-8": (30, 4, 0.2, 0.2, 0.5), "len16-32": (40, 2, 0.4, 1.5, 3.0)}),
    ]
    b = tool.by_length(rows)
    assert list(b) == [(4, 8), (16, 32)]
    assert b[(4, 8)]["mean_abs_diff"] == pytest.approx((10 * 0.1 + 30 * 0.2) / 40)  # token-weighted
    assert b[(4, 8)]["seq_abs_log_ratio"] == pytest.approx((2 * 0.2 + 4 * 0.5) / 6)  # response-weighted
    assert b[(4, 8)]["max_abs_diff"] == 0.3 and b[(16, 32)]["tokens"] == 40
    assert tool.floor_level(rows, "mean_abs_diff") == pytest.approx(0.1)


def test_png_and_exit_2(tmp_path, capsys):
    run = write(tmp_path / "run", [row(0, **{"len4-8": (10, 2, 0.1, 0.3, 0.2), "len32-64": (90, 2, 0.3, 1.2, 2.0)})])
    old = write(tmp_path / "old", [{"step": 0, "reward/mean": 0.1}])
    out = tmp_path / "p.png"
    assert tool.main([f"a={run}", "--floor", f"f={run / 'metrics.jsonl'}", "-o", str(out), "--min-responses", "1"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    for spec, message in [
        (str(run), "write LABEL=RUN"),
        (f"b={tmp_path}/nowhere", "no metrics.jsonl there"),
        (f"b={old}", "no mismatch/len* buckets"),
    ]:
        assert tool.main([spec, "-o", str(tmp_path / "no.png")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert tool.main([f"a={run}", "--floor", f"f={old}", "-o", str(tmp_path / "no.png")]) == 2
    assert "no mismatch/tokens and mismatch/mean_abs_diff rows" in capsys.readouterr().err
    assert not (tmp_path / "no.png").exists()


def test_table_has_a_row_per_bucket_and_a_column_per_run(tmp_path):
    a = write(tmp_path / "a", [row(0, **{"len4-8": (10, 2, 0.1, 0.3, 0.2), "len32-64": (90, 2, 0.3, 1.2, 2.0)})])
    floor_without_buckets = {
        "step": 0,
        "reward/mean": 0.4,
        "mismatch/tokens": 50,
        "mismatch/mean_abs_diff": 0.05,
        "mismatch/k3_kl": 0.001,
        "mismatch/max_abs_diff": 0.2,
    }
    f = write(tmp_path / "f", [floor_without_buckets])
    out, md = tmp_path / "p.png", tmp_path / "t.md"
    assert tool.main([f"a={a}", "--floor", f"f={f}", "-o", str(out), "--table", str(md), "--min-responses", "1"]) == 0
    lines = md.read_text().splitlines()
    assert lines[0].startswith("| length bucket | a: responses | f: responses | a: mean \\|dlogp\\| | f: mean \\|dlogp\\|")
    assert lines[2] == "| 4-8 | 2 | - | 0.1000 | - | 1.00e-02 | - | 0.0e+00 | - | 0.200 | - |"
    assert lines[3].startswith("| 32-64 | 2 | - | 0.3000 |") and len(lines) == 4


def test_sparse_buckets_are_left_out_of_the_curves_and_named(tmp_path, capsys):
    rows = [row(0, **{"len4-8": (6, 3, 0.9, 0.3, 0.2), "len32-64": (900, 20, 0.3, 1.2, 2.0)})]
    run = write(tmp_path / "run", rows)
    assert tool.curve(rows, "mean_abs_diff", 8) == ([45.0], [0.3])
    assert tool.curve(rows, "mean_abs_diff") == ([2.0, 45.0], [0.9, 0.3])
    md = tmp_path / "t.md"
    assert tool.main([f"a={run}", "-o", str(tmp_path / "p.png"), "--table", str(md)]) == 0
    assert "left out of the curves (under --min-responses 8): a len4-8 (3 responses)" in capsys.readouterr().out
    assert md.read_text().splitlines()[2].startswith("| 4-8 | 3 |")  # the table keeps it
    assert tool.main([f"a={run}", "-o", str(tmp_path / "q.png"), "--min-responses", "0"]) == 2
    assert "--min-responses 0: give 1 or more" in capsys.readouterr().err
    assert tool.main([f"a={run}", "-o", str(tmp_path / "q.png"), "--min-responses", "21"]) == 2
    assert "every length bucket of the runs has fewer than 21 responses" in capsys.readouterr().err


def test_confidence_table_for_runs_that_log_the_buckets(tmp_path):
    conf = lambda tokens, mean: {"tokens": tokens, "mean_abs_diff": mean, "k3_kl": mean / 100}

    def with_conf(step, buckets):
        r = row(step, **{"len32-64": (90, 9, 0.3, 1.2, 2.0)})
        for tag, c in buckets.items():
            r |= {f"mismatch/{tag}/{k}": v for k, v in c.items()}
        return r

    a = write(
        tmp_path / "a",
        [
            with_conf(0, {"p0-0.5": conf(10, 0.2), "p0.99-1": conf(30, 0.001)}),
            with_conf(1, {"p0-0.5": conf(30, 0.1), "p0.99-1": conf(30, 0.003)}),
        ],
    )
    old = write(tmp_path / "old", [row(0, **{"len32-64": (90, 9, 0.3, 1.2, 2.0)})])
    md = tmp_path / "t.md"
    assert tool.main([f"a={a}", f"old={old}", "-o", str(tmp_path / "p.png"), "--table", str(md)]) == 0
    conf_lines = md.read_text().split("\n\n")[1].splitlines()
    assert conf_lines[0] == "| p(sampled token), trainer | a: share of tokens | a: mean \\|dlogp\\| | a: k3 KL |"
    assert conf_lines[2] == "| 0-0.5 | 0.400 | 0.1250 | 1.25e-03 |"  # (10*0.2 + 30*0.1) / 40; 40 of 100 tokens
    assert conf_lines[3] == "| 0.99-1 | 0.600 | 0.0020 | 2.00e-05 |"
