"""tools/plot_mismatch.py: a PNG from metrics files with floors; one line and exit 2 on unreadable input."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("plot_mismatch", ROOT / "tools" / "plot_mismatch.py")
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)


def metrics(path: Path, mean_abs: float) -> Path:
    """A GRPO run's metrics.jsonl, four steps, with the mismatch keys the trainer logs (and a few it logs beside them)."""
    rows = [
        {
            "step": i,
            "mode": "jetrl",
            "reward/mean": 0.0,
            "mismatch/tokens": 8192,
            "mismatch/mean_abs_diff": mean_abs * (1 + i / 10),
            "mismatch/k3_kl": mean_abs / 10,
            "mismatch/max_abs_diff": mean_abs * 6,
        }
        for i in range(4)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plot_from_gpu_shaped_runs_and_refusals(tmp_path, capsys):
    jetrl, bf16 = metrics(tmp_path / "jetrl.jsonl", 0.13), metrics(tmp_path / "bf16.jsonl", 0.04)
    out = tmp_path / "m.png"
    assert plot.main([f"jetrl={jetrl}", "--floor", f"bf16={bf16}", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "cut.jsonl").write_text(json.dumps({"step": 0})[:7])
    (tmp_path / "plain.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 1.0}) + "\n")
    for spec_, message in [
        (f"a={tmp_path / 'missing.jsonl'}", "cannot read metrics"),
        (f"a={tmp_path / 'cut.jsonl'}", "cannot read metrics"),
        (f"a={tmp_path / 'plain.jsonl'}", "no mismatch metrics"),
        (str(tmp_path / "cut.jsonl"), "write label=path"),
    ]:
        assert plot.main([spec_, "-o", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("plot_mismatch:") and message in err and "\n" not in err
