"""SASS instruction counts of `fp8/cuda_tiles.py`'s quant_tile per variant, and the time a GPU needs just to issue them.

quant_tile is fully unrolled; on a [T, N] input its issue-bound time is tiles x 8 warps x count / (SMs x 4
schedulers x max SM clock). Set beside the memory-bound time (bytes at the device copy rate, tools/bench/bench_fp8.py) it
says which bound a variant is up against. Since the kernel carries a checked and a branch-free copy of its passes
(`fast_group`), the static count includes both: it bounds what a warp issues from above, and the time from above.
Needs the CUDA toolkit's nvcc and cuobjdump and a GPU (for the SM count and clock): run on the GPU machine.

    python3 tools/gpu/sass_cuda_tiles.py [--tokens 16384 --features 8192] [--source path/to/old_cuda_tiles.py] [--dump DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VARIANTS = {  # name: (FP8_IN, ROWS, COLS, UE8M0, BLOCK128)
    "dual": (0, 1, 1, 0, 0),
    "1x128 rows": (0, 1, 0, 0, 0),
    "128x1^T cols": (0, 0, 1, 0, 0),
    "128x1^T from E4M3": (1, 0, 1, 0, 0),
    "128x128": (0, 1, 0, 0, 1),
    "128x128 + T": (0, 1, 1, 0, 1),
    "dual ue8m0": (0, 1, 1, 1, 0),
}


def sass_ops(source: str, workdir: str, dump: Path | None = None) -> dict[str, int]:
    """Opcode -> count of quant_tile's SASS for sm_90 (the listing itself written to `dump` if given)."""
    cu = os.path.join(workdir, "tile.cu")
    Path(cu).write_text(source)
    subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-o", cu + ".cubin", cu], check=True, capture_output=True)
    sass = subprocess.run(
        ["cuobjdump", "-sass", "-fun", "quant_tile", cu + ".cubin"], check=True, capture_output=True, text=True
    ).stdout
    if dump:
        dump.write_text(sass)
    ops: dict[str, int] = {}
    for line in sass.splitlines():
        if re.match(r"\s+/\*[0-9a-f]{4}\*/\s+\S", line):
            words = line.split("*/", 1)[1].strip().split()
            op = (words[1] if words[0].startswith("@") else words[0]).split(".")[0].rstrip(";")
            ops[op] = ops.get(op, 0) + 1
    return ops


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--features", type=int, default=8192)
    ap.add_argument("--source", type=Path, help="another cuda_tiles.py to count (e.g. an older commit's)")
    ap.add_argument("--dump", type=Path, help="write each variant's SASS listing into this folder")
    a = ap.parse_args()
    if a.source:
        spec = importlib.util.spec_from_file_location("other_cuda_tiles", a.source)
        tiles = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tiles)
    else:
        from megatron_jetrl.fp8 import cuda_tiles as tiles
    props = torch.cuda.get_device_properties(0)
    clock = (
        float(
            subprocess.run(
                ["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.split()[0]
        )
        * 1e6
    )
    n_tiles = -(-a.tokens // 128) * -(-a.features // 128)
    print(
        f"{props.name}: {props.multi_processor_count} SMs, max SM clock {clock / 1e9:.2f} GHz; [{a.tokens}, {a.features}]: {n_tiles} tiles"
    )
    with tempfile.TemporaryDirectory() as d:
        for name, flags in VARIANTS.items():
            if a.dump:
                a.dump.mkdir(parents=True, exist_ok=True)
            ops = sass_ops(tiles.source(*flags), d, a.dump / f"{re.sub(r'[^0-9a-zA-Z]+', '_', name)}.sass" if a.dump else None)
            count = sum(ops.values())
            us = n_tiles * 8 * count / (props.multi_processor_count * 4 * clock) * 1e6
            top = " ".join(f"{k}:{v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:8])
            print(f"{name:18s} {count:5d} SASS per warp per tile -> {us:6.1f} us issue-bound  [{top}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
