"""The run directory's checkpoints: saved, pruned, resumed, exported, and checked for room before a run starts.

`checkpoints/step_XXXXXX/` = the actor's sharded checkpoint with optimizer state (`actor.checkpoint`), the reference
under `ref/`, and `trainer_state.json` (step, prompt sampler, warm-up done, the FP8 KV cache's scales) written last; a
directory is complete only once `trainer_state.json` exists, and is staged under a `.partial` name and renamed, so a
run killed mid-save resumes from the previous one (`rl.run_state`: which checkpoint a run resumes from, and whether
it may). The functions taking `s` take the run's `rl.session.Session`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from megatron_jetrl.actor.checkpoint import load_checkpoint, save_checkpoint
from megatron_jetrl.models.shards import CheckpointError, atomic_write_bytes
from megatron_jetrl.rl.config import ConfigError, JetRLConfig
from megatron_jetrl.rl.kv_scales import KvScaleState
from megatron_jetrl.rl.resolve import resolve_saved
from megatron_jetrl.rl.run_state import STATE_FILE, complete_checkpoints, newest_checkpoint, sound_checkpoint


def checkpoint_root(cfg: JetRLConfig) -> Path:
    return cfg.run.directory / "checkpoints"


def latest_checkpoint(cfg: JetRLConfig) -> Path | None:
    """The newest complete checkpoint (has its trainer_state.json), or None."""
    return newest_checkpoint(checkpoint_root(cfg))


def write_config(cfg: JetRLConfig) -> None:
    """`<run directory>/config.yaml`: the resolved config of the run (written once every check has passed)."""
    import yaml

    cfg.run.directory.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(cfg.run.directory / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False).encode())


def check_output_space(cfg: JetRLConfig) -> None:
    """Before any work: this rank can create files in `checkpoints/` (probed there, or in the nearest directory
    above it that exists: nothing is created, so a run that fails early leaves no empty `checkpoints/`), and its
    file system has room for one more checkpoint the size of the newest (ConfigError otherwise: a run that cannot
    save would lose its steps)."""
    root = checkpoint_root(cfg)
    where = next(p for p in (root, *root.parents) if p.exists())
    probe = where / f".write-probe-{dist.get_rank()}-{os.getpid()}"
    try:
        probe.write_bytes(b"probe")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"cannot write checkpoints to {root} ({e}): make it writable or set run.out_dir to a directory this user can write"
        ) from None
    newest = latest_checkpoint(cfg)
    need = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()) if newest else 0
    free = shutil.disk_usage(where).free
    if need > free:
        raise ConfigError(
            f"{root} has {free / 2**20:.1f} MiB free but a checkpoint takes {need / 2**20:.1f} MiB "
            f"({newest.name}): free space there or set run.out_dir to a larger disk"
        )


def save(s, step: int, warmup_done: bool) -> Path:
    """Collective. Stages `step_XXXXXX.partial`, then rank 0 writes trainer_state.json and renames it."""
    root = checkpoint_root(s.cfg)
    final = root / f"step_{step:06d}"
    staging = root / f"step_{step:06d}.partial"
    if s.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    hf_config = s.cfg.model.architecture()
    spec = s.cfg.model.spec  # the mapping naming of the parameters (TE fuses the norms into linear_qkv / linear_fc1)
    save_checkpoint(s.model, staging, hf_config=hf_config, flow=s.flow, iteration=step, spec=spec, optimizer=s.optimizer)
    s.run.event("checkpoint_staged", step=step, directory=staging)
    if s.reference is not None:
        if s.is_main:
            (staging / "ref").mkdir()
        dist.barrier()
        save_checkpoint(s.reference, staging / "ref", hf_config=hf_config, flow=s.flow, iteration=step, spec=spec)
    if s.is_main:
        state = {"step": step, "warmup_done": warmup_done, "sampler": s.sampler.state_dict(), "config": s.cfg.to_dict()}
        if s.kv_scales is not None:
            state["kv_scales"] = s.kv_scales.to_dict()
        atomic_write_bytes(staging / STATE_FILE, json.dumps(state, indent=1).encode())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        prune_checkpoints(root, s.cfg.run.keep_checkpoints)
    dist.barrier()
    return final


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Delete the complete checkpoints older than the newest `keep` (0: keep all); the deleted ones. Unfinished
    `.partial` directories and the newest complete checkpoint are never touched."""
    done = complete_checkpoints(root)
    old = done[:-keep] if keep and len(done) > keep else []
    for p in old:
        shutil.rmtree(p)
    return old


def resume(s) -> dict | None:
    """Load the newest sound checkpoint into the session (`run_state.sound_checkpoint`: newer damaged ones are skipped,
    said, and kept aside as `step_XXXXXX.damaged`); its trainer state, or None for a fresh run."""
    ckpt, skipped = sound_checkpoint(checkpoint_root(s.cfg))
    if ckpt is None:
        return None
    dist.barrier()  # every rank has chosen before one is moved aside
    if skipped and dist.get_rank() == 0:
        for bad, why in skipped:
            aside = next(
                bad.with_name(f"{bad.name}.damaged{f'-{i}' if i else ''}")
                for i in range(100)
                if not bad.with_name(f"{bad.name}.damaged{f'-{i}' if i else ''}").exists()
            )
            bad.rename(aside)
            print(
                f"note: skipped the damaged checkpoint {bad.name} ({why}); kept aside as {aside}, resuming from {ckpt.name}",
                file=sys.stderr,
            )
    dist.barrier()
    if s.cfg.run.resume == "never":
        raise ConfigError(
            f"{s.cfg.run.directory} already holds checkpoints ({ckpt.name}) and run.resume='never': "
            "choose another run.name / run.out_dir, or delete them"
        )
    elsewhere = f"move {ckpt} out of {ckpt.parent} and restart: the run resumes from the checkpoint before it"
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
        if not (
            isinstance(state, dict)
            and state.get("step") == int(ckpt.name.split("_")[1])
            and "sampler" in state
            and isinstance(state.get("config"), dict)
        ):
            raise ValueError(f"step, sampler and config do not match a {ckpt.name}")
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{ckpt / STATE_FILE} is damaged ({e}): {elsewhere}") from None
    state["config"] = resolve_saved(state["config"], s.cfg)  # compared resolved, as `run_state.changed_keys` does
    saved_model = state["config"].get("model")
    if isinstance(saved_model, dict):
        saved_model = {"spec": "local", **saved_model}  # written before model.spec existed: the local spec
    if saved_model != s.cfg.to_dict()["model"] or state["config"].get("precision") != s.cfg.to_dict()["precision"]:
        raise ConfigError(
            f"{ckpt} was written by a run with another model or precision section; "
            "resume with the same config or use a new run.name"
        )
    try:
        load_checkpoint(s.model, ckpt, optimizer=s.optimizer, verify=True)
        if s.reference is not None:
            load_checkpoint(s.reference, ckpt / "ref", verify=True)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; if it is damaged, {elsewhere}") from None
    s.sampler.load_state_dict(state["sampler"])
    if s.kv_scales is not None and "kv_scales" in state:
        s.kv_scales = KvScaleState.from_dict(state["kv_scales"])
    return state


def export(s, ckpt: Path, out: Path | None = None) -> Path:
    """Rank 0 converts a checkpoint into the rollout format (default `<out_dir>/export`); collective."""
    from megatron_jetrl.convert.converter import convert

    out = out or s.cfg.run.directory / "export"
    if s.is_main:  # with the tokenizer: a usable HF model directory
        dtype = "fp8" if s.flow.rollout_fp8 else "bf16"
        tokenizer = s.cfg.model.path
        if s.cfg.model.tokenizer != "hf":  # the embedded one: tokenizer.model + its tokenizer_config.json
            tokenizer = s.cfg.run.directory
            atomic_write_bytes(tokenizer / "tokenizer_config.json", json.dumps(s.tokenizer.hf_config(), indent=1).encode())
        convert(
            ckpt,
            out,
            dtype=dtype,
            rollout_tp=1,
            force=True,
            tokenizer_dir=tokenizer,
            on_shard=lambda path: s.run.event("export_shard", path=path),
        )
    dist.barrier()
    return out
