"""Loading the version-pinned runtime patches of `patches/` (see its README), from the repository or from the copy an
installed package carries (`megatron_jetrl/_patches/`, pyproject.toml's package data)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


def load_patch(stem: str):
    """The module `patches/<stem>.py` (imported once; call its `apply()`)."""
    name = f"patches.{stem}"
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        pass
    here = Path(__file__).resolve().parent
    tried = [here.parent / "patches" / f"{stem}.py", here / "_patches" / f"{stem}.py"]
    path = next((p for p in tried if p.is_file()), None)
    if path is None:
        raise ModuleNotFoundError(f"runtime patch {stem!r} not found (tried import {name!r} and {', '.join(map(str, tried))})")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def require_megatron_core(patch: str, target: str) -> None:
    """Refuse to apply `patches/<patch>.py` to a megatron-core other than `target` (the release its bodies match)."""
    from megatron.core import package_info

    found = str(package_info.__version__)
    if found != target:
        raise RuntimeError(
            f"patches/{patch}.py targets megatron-core=={target}, found {found}: pin megatron-core=={target} or port the patch"
        )
