"""What the GRPO loop needs beyond `pip install .` (the `train` extra of pyproject.toml), checked before it is imported."""

from __future__ import annotations

import importlib.util
import sys

TRAIN_EXTRAS = {
    "megatron.core": "megatron-core==0.16.1",
    "sentencepiece": "sentencepiece",
    "math_verify": "math-verify",
    "tqdm": "tqdm",
    "transformers": "transformers",
}
"""Module -> the package that provides it (pyproject.toml's `train` extra)."""


def missing_train_extras() -> list[str]:
    found = []
    for module, package in TRAIN_EXTRAS.items():
        try:
            present = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a missing parent package
            present = False
        if not present:
            found.append(package)
    return found


def require_train_extras(what: str) -> None:
    """Exit 2 with one line when the `train` extra is missing (a bare `pip install .`)."""
    missing = missing_train_extras()
    if missing:
        print(
            f"{what} needs {', '.join(missing)}, not installed here: pip install 'megatron-jetrl[train]' (from a clone: "
            "pip install '.[train]'; on a CPU machine install torch's CPU build first, as tools/setup.sh does)",
            file=sys.stderr,
        )
        sys.exit(2)
