"""A streaming, size-capped safetensors writer for HF checkpoint directories.

`HFCheckpointWriter` is a sink for `(hf_name, tensor)` pairs. It keeps at most one shard's worth of
tensors in memory (plus the tensor being added), writes each shard itself in the safetensors format
(8-byte little-endian header length, JSON header, raw little-endian data; hashed while written, no
second copy of the data), and builds everything inside a *staging* directory next to the output:

    <out>.partial-<pid>/          everything is written here first
      .shard-00001.tmp            a shard being written; renamed to shard-00001.safetensors when complete
    -> at `finish()`: shards renamed model-0000i-of-0000N.safetensors, model.safetensors.index.json,
       the caller's JSON/extra files and `jetrl_manifest.json` (sha256 + size of every file) written,
       then the staging directory is renamed to <out> in one step.

A killed conversion leaves only `<out>.partial-<pid>`; `<out>` never exists half-written, and the next writer
of `<out>` removes the staging directories whose process is gone. An existing `<out>` is refused unless
`overwrite=True`, and then replaced only after the new one is complete.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_jetrl.models.shards import atomic_write_bytes, writing

SAFETENSORS_DTYPES = {
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "jetrl_manifest.json"


class OutputExistsError(FileExistsError):
    """The output directory exists and overwriting was not asked for."""


def parse_size(text: str | int) -> int:
    """'5GB', '500MiB', '2e9', 1000 -> bytes (decimal units for KB/MB/GB, binary for KiB/MiB/GiB)."""
    if isinstance(text, int):
        return text
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for unit, factor in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * factor)
    return int(float(t))


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict | None = None) -> str:
    """Write `tensors` (in order) as one safetensors file; return its sha256. Atomic (tmp + rename)."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, t in tensors:
        if t.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors code")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digest = hashlib.sha256()
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(tmp), open(tmp, "wb") as f:
        for chunk in (struct.pack("<Q", len(raw)), raw):
            f.write(chunk)
            digest.update(chunk)
        for _, t in tensors:
            data = _tensor_bytes(t)
            f.write(data)
            digest.update(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return digest.hexdigest()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def _alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


class HFCheckpointWriter:
    """Sink for `(hf_name, tensor)` pairs -> an HF safetensors directory, built in a staging directory."""

    def __init__(
        self,
        output: str | Path,
        *,
        max_shard_bytes: int = 5 * 10**9,
        overwrite: bool = False,
        on_shard: Callable[[Path], None] | None = None,
    ):
        """`on_shard(path)`: called once each shard is written (in the staging directory)."""
        self.output = Path(output).resolve()
        self.on_shard = on_shard
        if self.output.exists() and not overwrite:
            raise OutputExistsError(
                f"{self.output} exists; pass --force to replace it (it is replaced only once the new one is complete)"
            )
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.max_shard_bytes = max_shard_bytes
        self.overwrite = overwrite
        self.staging = self.output.with_name(f"{self.output.name}.partial-{os.getpid()}")
        for stale in self.output.parent.glob(f"{glob.escape(self.output.name)}.partial-*"):  # left by killed writers
            pid = stale.name.rsplit("-", 1)[1]
            if stale == self.staging or (pid.isdigit() and not _alive(int(pid))):
                shutil.rmtree(stale, ignore_errors=True)
        self.staging.mkdir(parents=True)
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._pending_bytes = 0
        self._shards: list[dict] = []  # {file (staging name), sha256, bytes, tensors: [names]}
        self._names: set[str] = set()
        self.total_size = 0
        self.peak_pending_bytes = 0
        self._closed = False

    # -- tensors -----------------------------------------------------------------------------
    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError("writer is closed")
        if name in self._names:
            raise ValueError(f"tensor {name!r} was already written")
        self._names.add(name)
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending.append((name, tensor.detach().contiguous()))
        self._pending_bytes += size
        self.total_size += size
        self.peak_pending_bytes = max(self.peak_pending_bytes, self._pending_bytes)

    def _flush(self) -> None:
        if not self._pending:
            return
        index = len(self._shards) + 1
        path = self.staging / f"shard-{index:05d}.safetensors"
        sha = write_safetensors(path, self._pending)
        self._shards.append(
            {"file": path.name, "sha256": sha, "bytes": path.stat().st_size, "tensors": [n for n, _ in self._pending]}
        )
        self._pending, self._pending_bytes = [], 0
        if self.on_shard is not None:
            self.on_shard(path)

    # -- other files ---------------------------------------------------------------------------
    def write_json(self, name: str, data: dict) -> None:
        atomic_write_bytes(self.staging / name, (json.dumps(data, indent=2, sort_keys=False) + "\n").encode())

    def copy_file(self, src: Path, name: str | None = None) -> None:
        dst = self.staging / (name or src.name)
        tmp = dst.with_name(f".{dst.name}.tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)

    # -- end -----------------------------------------------------------------------------------
    def finish(self, *, index_metadata: dict | None = None, manifest_extra: dict | None = None) -> Path:
        """Write the last shard, the index and the manifest, then move the directory into place."""
        self._flush()
        self._closed = True
        n = len(self._shards)
        if n == 0:
            raise ValueError("no tensors were written")
        weight_map = {}
        for i, shard in enumerate(self._shards, 1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(self.staging / shard["file"], self.staging / final)
            shard["file"] = final
            for name in shard["tensors"]:
                weight_map[name] = final
        self.write_json(
            INDEX_NAME, {"metadata": {"total_size": self.total_size, **(index_metadata or {})}, "weight_map": weight_map}
        )
        files = [{"file": s["file"], "sha256": s["sha256"], "bytes": s["bytes"]} for s in self._shards]
        for path in sorted(self.staging.iterdir()):
            if path.is_file() and not path.name.startswith(".") and path.name not in {s["file"] for s in self._shards}:
                files.append({"file": path.name, "sha256": _sha256_file(path), "bytes": path.stat().st_size})
        self.write_json(MANIFEST_NAME, {"format": "megatron-jetrl-hf/1", "files": files, **(manifest_extra or {})})
        self._fsync_dir(self.staging)
        old = None
        if self.output.exists():
            if not self.overwrite:
                raise OutputExistsError(
                    f"{self.output} appeared during the conversion; the new checkpoint is left in {self.staging}"
                )
            old = self.output.with_name(f"{self.output.name}.old-{os.getpid()}")
            os.replace(self.output, old)
        os.replace(self.staging, self.output)
        self._fsync_dir(self.output.parent)
        if old is not None:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        return self.output

    def abort(self) -> None:
        """Remove the staging directory (nothing under the output name was created)."""
        self._closed = True
        self._pending = []
        shutil.rmtree(self.staging, ignore_errors=True)

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)


def verify_manifest(directory: str | Path) -> list[str]:
    """Problems found when checking every file of `directory` against its manifest (empty: all good)."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not path.is_file():
        return [f"{directory} has no {MANIFEST_NAME}"]
    problems = []
    for entry in json.loads(path.read_text())["files"]:
        f = directory / entry["file"]
        if not f.is_file():
            problems.append(f"{entry['file']}: missing")
        elif f.stat().st_size != entry["bytes"]:
            problems.append(f"{entry['file']}: {f.stat().st_size} bytes, manifest says {entry['bytes']}")
        elif _sha256_file(f) != entry["sha256"]:
            problems.append(f"{entry['file']}: sha256 differs from the manifest")
    return problems
