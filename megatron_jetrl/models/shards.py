"""On-disk layout of a TP x PP sharded actor checkpoint (written by the actor, read by the converter).

    <dir>/
      tp00_pp000.safetensors ...   one file per (TP rank, PP rank): that rank's Megatron parameters,
                                    local names (layer indices local to the pipeline stage), as trained
      meta.json                     written last, atomically: format, iteration, tp, pp, layer spec,
                                    the HF config.json of the model, the PrecisionFlow, sha256 + size of
                                    every shard. A directory without meta.json is incomplete.

Every file is written under a temporary name and renamed when complete, so a killed save never leaves a
file that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_jetrl.models.arch import ModelArch

FORMAT = "megatron-jetrl-shards/1"
META = "meta.json"


def shard_name(tp_rank: int, pp_rank: int) -> str:
    return f"tp{tp_rank:02d}_pp{pp_rank:03d}.safetensors"


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_rank_shard(directory: str | Path, state: dict[str, torch.Tensor], tp_rank: int, pp_rank: int) -> dict:
    """Write one rank's parameters; returns its manifest entry {file, sha256, bytes}."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / shard_name(tp_rank, pp_rank)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp))
    os.replace(tmp, path)
    return {"file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size}


def write_meta(directory: str | Path, *, iteration: int, tp: int, pp: int, spec: str, hf_config: dict, flow: dict,
               shards: list[dict], extra: dict | None = None) -> None:
    """Seal the checkpoint (call after every rank's shard is written)."""
    expected = {shard_name(t, p) for t in range(tp) for p in range(pp)}
    got = {s["file"] for s in shards}
    if got != expected:
        raise ValueError(f"checkpoint shards {sorted(got)} do not cover TP={tp} x PP={pp}: missing {sorted(expected - got)}")
    meta = {"format": FORMAT, "iteration": iteration, "tp": tp, "pp": pp, "spec": spec, "hf_config": hf_config,
            "flow": flow, "shards": sorted(shards, key=lambda s: s["file"]), **(extra or {})}
    atomic_write_bytes(Path(directory) / META, json.dumps(meta, indent=1).encode())


class CheckpointError(ValueError):
    """A sharded checkpoint that is incomplete, corrupt or not what the caller expects."""


def _check_meta_schema(meta: dict, meta_path: Path) -> None:
    """The fields `open` and its users read, with their types; a hand-edited or foreign meta.json is refused."""
    def positive_int(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    problems = [f"{k} must be a positive integer, got {meta.get(k)!r}" for k in ("tp", "pp") if not positive_int(meta.get(k))]
    shards = meta.get("shards")
    if not isinstance(shards, list) or not shards:
        problems.append(f"shards must be a non-empty list, got {shards!r}")
    else:
        for i, shard in enumerate(shards):
            ok = (isinstance(shard, dict) and isinstance(shard.get("file"), str) and shard["file"]
                  and "/" not in shard["file"] and shard["file"] not in (".", "..")
                  and isinstance(shard.get("bytes"), int) and not isinstance(shard.get("bytes"), bool)
                  and isinstance(shard.get("sha256"), str))
            if not ok:
                problems.append(f"shards[{i}] must be {{file: <name in this directory>, bytes: int, sha256: str}}, got {shard!r}")
    if problems:
        raise CheckpointError(f"{meta_path} is malformed: " + "; ".join(problems[:5]))


@dataclass
class ShardedCheckpoint:
    """A sealed checkpoint directory; tensors are read lazily, one at a time."""

    directory: Path
    meta: dict

    @classmethod
    def open(cls, directory: str | Path, *, verify: bool = True) -> "ShardedCheckpoint":
        directory = Path(directory)
        meta_path = directory / META
        if not meta_path.is_file():
            raise CheckpointError(f"{directory} has no {META}: not a megatron-jetrl checkpoint, or one whose save did not finish")
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{meta_path} is not valid JSON ({e})") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
            raise CheckpointError(f"{meta_path}: format {found!r}, expected {FORMAT!r}")
        _check_meta_schema(meta, meta_path)
        for shard in meta["shards"]:
            path = directory / shard["file"]
            if not path.is_file():
                raise CheckpointError(f"{directory}: shard {shard['file']} is missing (TP={meta['tp']} x PP={meta['pp']} needs all)")
            if path.stat().st_size != shard["bytes"]:
                raise CheckpointError(f"{path}: {path.stat().st_size} bytes, the manifest says {shard['bytes']} (truncated or replaced)")
            if verify and sha256_file(path) != shard["sha256"]:
                raise CheckpointError(f"{path}: sha256 differs from the manifest (corrupt shard)")
        return cls(directory, meta)

    @property
    def tp(self) -> int:
        return self.meta["tp"]

    @property
    def pp(self) -> int:
        return self.meta["pp"]

    @property
    def arch(self) -> ModelArch:
        return ModelArch.from_hf_config(self.meta["hf_config"])

    def fetch(self, pp_rank: int):
        """`fetch(megatron_name) -> [tensor on TP rank 0, 1, ...]` for one pipeline stage."""

        def get(name: str) -> list[torch.Tensor]:
            out = []
            for tp_rank in range(self.tp):
                with safe_open(self.directory / shard_name(tp_rank, pp_rank), framework="pt") as f:
                    if name not in f.keys():
                        raise CheckpointError(f"{shard_name(tp_rank, pp_rank)} has no tensor {name!r} (layer spec {self.meta['spec']!r})")
                    out.append(f.get_tensor(name))
            return out

        return get
