"""tools/plot_mismatch.py: a PNG from metrics files with floors; one line and exit 2 on unreadable input."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("plot_mismatch", ROOT / "tools" / "plot_mismatch.py")
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)


def test_plot_from_the_shipped_gpu_runs_and_refusals(tmp_path, capsys):
    d = ROOT / "docs" / "gpu_vllm"
    out = tmp_path / "m.png"
    assert plot.main([f"jetrl={d / 'vllm_gpu_jetrl.metrics.jsonl'}", "--floor", f"bf16={d / 'vllm_gpu_bf16.metrics.jsonl'}", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "cut.jsonl").write_text(json.dumps({"step": 0})[:7])
    (tmp_path / "plain.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 1.0}) + "\n")
    for spec_, message in [(f"a={tmp_path / 'missing.jsonl'}", "cannot read metrics"), (f"a={tmp_path / 'cut.jsonl'}", "cannot read metrics"),
                           (f"a={tmp_path / 'plain.jsonl'}", "no mismatch metrics"), (str(tmp_path / "cut.jsonl"), "write label=path")]:
        assert plot.main([spec_, "-o", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("plot_mismatch:") and message in err and "\n" not in err
