"""tools/README.md, tools/bench/README.md and tools/gpu/README.md: each one's table has a row for every tool in its
folder, and names no tool that is not there; patches/README.md has an entry for every patch, and none for another."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.mark.parametrize("folder", [TOOLS, TOOLS / "bench", TOOLS / "gpu"], ids=["tools", "bench", "gpu"])
def test_the_readme_has_one_row_per_tool(folder):
    rows = re.findall(r"^\| `([\w.]+\.(?:py|sh))` \|", (folder / "README.md").read_text(), flags=re.M)
    tools = sorted(p.name for p in folder.iterdir() if p.suffix in (".py", ".sh"))
    assert sorted(rows) == tools, {"no row": sorted(set(tools) - set(rows)), "no such tool": sorted(set(rows) - set(tools))}


def test_the_patches_readme_has_one_entry_per_patch():
    patches = TOOLS.parent / "patches"
    entries = re.findall(r"^- `(\w+\.py)` ", (patches / "README.md").read_text(), flags=re.M)
    files = sorted(p.name for p in patches.glob("*.py"))
    assert sorted(entries) == files, {
        "no entry": sorted(set(files) - set(entries)),
        "no such patch": sorted(set(entries) - set(files)),
    }
