"""The README's commands work as written after its two set-up commands, and say what the code does."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    inline = re.findall(r"(?<!its )`((?:\.venv/bin/)?python[^`]*)`", README)
    return [line.strip() for b in blocks for line in b.splitlines() if line.strip()] + inline


def test_python_commands_use_the_venv():
    """A fresh clone's python3 has none of the requirements: every command names .venv's interpreter."""
    bare = [c for c in commands() if re.match(r"python3? ", c)]
    assert not bare, bare


def test_the_check_only_example_passes():
    line = next(c for c in commands() if c.endswith("# check only"))
    args = line.split("#")[0].split()
    assert args[:3] == [".venv/bin/python", "-m", "megatron_jetrl.rl.config"], line
    r = subprocess.run([sys.executable, *args[1:]], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_the_plot_example_does_not_overwrite_tracked_files():
    plot = next(c for c in commands() if "tools/plot_run.py" in c)
    out = plot.split("-o")[1].split()[0]
    assert out.startswith("runs/"), plot  # runs/ is not tracked; docs/tiny_run.png is
    assert re.search(
        r"~[0-9.]+ min on 2 cores", README.split("tools/plot_run.py")[0][-400:]
    )  # the foil run it needs, and its cost


def test_the_tools_table_lists_every_tool():
    """Every user tool in tools/ (tools/bench/ and tools/gpu/ have their own READMEs: tests/unit/test_tools_readmes.py)."""
    row = next(line for line in README.splitlines() if line.startswith("| `tools/` |"))
    missing = [p.name for p in (REPO / "tools").iterdir() if p.suffix in (".py", ".sh") and f"`{p.name}`" not in row]
    assert not missing, missing


def test_the_headline_reward_line_is_what_the_summary_prints():
    from megatron_jetrl.rl.metrics import format_summary

    line = next(line for line in README.splitlines() if line.strip().startswith("reward ") and "->" in line)
    printed = next(x for x in format_summary([{"step": i, "reward/mean": 0.5} for i in range(60)]).splitlines() if "reward" in x)
    pattern = re.escape(printed).replace("0\\.5", r"[0-9.]+")
    assert re.fullmatch(pattern, line), (line, printed)
