"""On-disk layout of a TP x PP sharded actor checkpoint (written by the actor, read by the converter).

    <dir>/
      tp00_pp000.safetensors ...   one file per (TP rank, PP rank): that rank's Megatron parameters,
                                    local names (layer indices local to the pipeline stage), as trained
      meta.json                     written last, atomically: format, iteration, tp, pp, layer spec,
                                    the HF config.json of the model, the PrecisionFlow, sha256 + size of
                                    every shard (and of the actor's optimizer files, `optimizer`, when
                                    saved with them). A directory without meta.json is incomplete.

Every file is written under a temporary name and renamed when complete, so a killed save never leaves a
file that looks finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
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


class CheckpointWriteError(OSError):
    """Writing a checkpoint file failed; the message names the file and the free space where it goes."""


@contextlib.contextmanager
def writing(path: Path):
    """Any error while writing `path` becomes a CheckpointWriteError naming the file, the cause and the free space
    of its file system (safetensors' full-disk `IoError` names no file)."""
    try:
        yield
    except Exception as e:
        where = next(p for p in path.parents if p.exists())
        free = shutil.disk_usage(where).free / 2**20
        fix = "make it writable" if isinstance(e, PermissionError) else "free space there"
        raise CheckpointWriteError(
            f"writing {path} failed: {type(e).__name__}: {e}; {free:.1f} MiB free on {where}: "
            f"{fix} (or write elsewhere) and restart"
        ) from e


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with writing(tmp):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def file_entry(path: Path) -> dict:
    """A manifest entry {file, sha256, bytes} of a written file."""
    return {"file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size}


def save_rank_shard(directory: str | Path, state: dict[str, torch.Tensor], tp_rank: int, pp_rank: int) -> dict:
    """Write one rank's parameters; returns its manifest entry {file, sha256, bytes}."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / shard_name(tp_rank, pp_rank)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with writing(tmp):
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp))
        os.replace(tmp, path)
    return file_entry(path)


def write_meta(
    directory: str | Path,
    *,
    iteration: int,
    tp: int,
    pp: int,
    spec: str,
    hf_config: dict,
    flow: dict,
    shards: list[dict],
    extra: dict | None = None,
) -> None:
    """Seal the checkpoint (call after every rank's shard is written)."""
    expected = {shard_name(t, p) for t in range(tp) for p in range(pp)}
    got = {s["file"] for s in shards}
    if got != expected:
        raise ValueError(f"checkpoint shards {sorted(got)} do not cover TP={tp} x PP={pp}: missing {sorted(expected - got)}")
    meta = {
        "format": FORMAT,
        "iteration": iteration,
        "tp": tp,
        "pp": pp,
        "spec": spec,
        "hf_config": hf_config,
        "flow": flow,
        "shards": sorted(shards, key=lambda s: s["file"]),
        **(extra or {}),
    }
    atomic_write_bytes(Path(directory) / META, json.dumps(meta, indent=1).encode())


class CheckpointError(ValueError):
    """A sharded checkpoint that is incomplete, corrupt or not what the caller expects."""


def _check_meta_schema(meta: dict, meta_path: Path) -> None:
    """The fields `open` and its users read, with their types; a hand-edited or foreign meta.json is refused."""

    def positive_int(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    problems = [f"{k} must be a positive integer, got {meta.get(k)!r}" for k in ("tp", "pp") if not positive_int(meta.get(k))]
    last = meta.get("pp_last_layers", 0)
    if not (isinstance(last, int) and not isinstance(last, bool) and last >= 0):
        problems.append(f"pp_last_layers must be a non-negative integer (0 or absent: an even split), got {last!r}")
    shards, optimizer = meta.get("shards"), meta.get("optimizer", False)
    if not isinstance(shards, list) or not shards:
        problems.append(f"shards must be a non-empty list, got {shards!r}")
    if not isinstance(optimizer, (bool, list)):
        problems.append(f"optimizer must be a list of files (or false), got {optimizer!r}")
    for key, entries in (("shards", shards), ("optimizer", optimizer)):
        for i, entry in enumerate(entries if isinstance(entries, list) else []):
            ok = (
                isinstance(entry, dict)
                and isinstance(entry.get("file"), str)
                and entry["file"]
                and "/" not in entry["file"]
                and entry["file"] not in (".", "..")
                and isinstance(entry.get("bytes"), int)
                and not isinstance(entry.get("bytes"), bool)
                and isinstance(entry.get("sha256"), str)
            )
            if not ok:
                problems.append(f"{key}[{i}] must be {{file: <name in this directory>, bytes: int, sha256: str}}, got {entry!r}")
    if problems:
        raise CheckpointError(f"{meta_path} is malformed: " + "; ".join(problems[:5]))


@dataclass
class ShardedCheckpoint:
    """A sealed checkpoint directory; tensors are read lazily, one at a time."""

    directory: Path
    meta: dict

    @classmethod
    def open(cls, directory: str | Path, *, verify: bool = True) -> ShardedCheckpoint:
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
        ckpt = cls(directory, meta)
        for shard in meta["shards"]:
            ckpt.check_file(shard, verify=verify)
        return ckpt

    def check_file(self, entry: dict, *, verify: bool = True, what: str = "shard") -> Path:
        """The path of a file of meta.json's manifest, once it exists with its size (and sha256 with `verify`)."""
        path = self.directory / entry["file"]
        if not path.is_file():
            raise CheckpointError(f"{self.directory}: {what} {entry['file']} is missing (TP={self.tp} x PP={self.pp} needs all)")
        if path.stat().st_size != entry["bytes"]:
            raise CheckpointError(
                f"{path}: {path.stat().st_size} bytes, the manifest says {entry['bytes']} (truncated or replaced)"
            )
        if verify and sha256_file(path) != entry["sha256"]:
            raise CheckpointError(f"{path}: sha256 differs from the manifest (corrupt {what})")
        return path

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
                        raise CheckpointError(
                            f"{shard_name(tp_rank, pp_rank)} has no tensor {name!r} (layer spec {self.meta['spec']!r})"
                        )
                    out.append(f.get_tensor(name))
            return out

        return get
