"""The run a config would continue, read from its run directory before anything is written.

A run directory's newest complete checkpoint (`checkpoints/step_XXXXXX/trainer_state.json`) holds the step and
the config it was trained with. Started again with the same `run.name`, the run resumes there, and:

* if it already reached `run.steps` it is complete: the trainer says so, where the results are and how to
  train further (raise `run.steps`) or start anew (another `run.name`), and trains nothing;
* settings that do not change what is learnt may change on resume and are applied, each said in one line
  (`APPLIED_ON_RESUME`: the length of the run, checkpointing, export, device, timeouts, parallel layout and
  rollout plumbing);
* any other change (a hyper-parameter such as `optim.lr`, the data, the loss, the model, the precision) is
  refused naming every changed key: a resumed run keeps the hyper-parameters it was trained with.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from megatron_jetrl.rl.config_schema import ConfigError, JetRLConfig
from megatron_jetrl.rl.resolve import resolve_saved

STATE_FILE = "trainer_state.json"
APPLIED_ON_RESUME = frozenset(
    {
        "run.steps",
        "run.save_every",
        "run.checkpoint",
        "run.keep_checkpoints",
        "run.export",
        "run.device",
        "run.timeout_s",
        "run.on_nonfinite",
        "run.eval_every",
        "run.jit_cache_dir",
        "parallel.tp",
        "parallel.dp",
        "rollout.engine",
        "rollout.num_engines",
        "rollout.bucket_mb",
        "rollout.tp",
        "rollout.kv_cache_fraction",
        "rollout.kv_cache_gb",
        "rollout.offload",
        "rollout.max_model_len",
        "rollout.enforce_eager",
        "grpo.micro_batch_size",
        "grpo.logprob_micro_batch_size",
        "run.profile_step",
        "run.profile_phases",
        "model.fp8_weight_t",
        "model.bf16_linear_weights",  # where the same bytes live: memory, not numbers
        "model.cuda_graphs",  # how the same kernels are launched
        "precision.gemm_sms",  # how many SMs compute the same bytes
    }
)
"""Keys a resumed run may change (applied, and said); every other changed key is refused."""
IGNORED = frozenset({"run.name", "run.out_dir", "run.resume"})
"""Keys that name the run directory or the resume policy itself: not compared."""


@dataclass(frozen=True)
class PreviousRun:
    """The newest complete checkpoint of a run directory and what this config changes of its settings."""

    directory: Path
    checkpoint: Path
    step: int
    changes: dict  # "section.key" -> (old, new), every one of them in APPLIED_ON_RESUME

    def complete(self, cfg: JetRLConfig) -> bool:
        """Reached run.steps and wrote its summary (a run stopped during its export resumes to finish it)."""
        return (
            self.step >= cfg.run.steps
            and (self.directory / "summary.json").is_file()
            and manifest_problem(self.checkpoint) is None
        )

    def complete_message(self, cfg: JetRLConfig) -> str:
        d = self.directory
        results = ", ".join(str(p) for p in (d / "summary.json", d / "metrics.jsonl", d / "export") if p.exists())
        return (
            f"{d} is already complete at step {self.step} (run.steps={cfg.run.steps}); nothing to train. Results: "
            f"{results}. To train further, raise run.steps "
            f"(e.g. run.steps={self.step + max(cfg.run.steps, 1)}: it resumes at step {self.step}); for a new run, set another "
            f"run.name (e.g. run.name={d.name}-2)"
        )

    def resume_message(self, cfg: JetRLConfig) -> str:
        line = f"resuming {self.directory} at step {self.step} of {cfg.run.steps} ({self.checkpoint.name})"
        if self.changes:
            line += "; applied: " + ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in sorted(self.changes.items()))
        return line


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete `step_XXXXXX` directories under `root` (they have their trainer_state.json), oldest first."""
    return sorted(p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit() and (p / STATE_FILE).is_file())


def manifest_problem(ckpt: Path) -> str | None:
    """What is wrong with checkpoint `ckpt` by its own manifests, read in milliseconds without torch (every file that
    meta.json lists, in ckpt/ and in ckpt/ref/, there at the size it says; trainer_state.json readable and of this
    step), or None. The sha256 of every byte is checked when the checkpoint is loaded (`actor.checkpoint`)."""
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
        if not isinstance(state, dict) or state.get("step") != int(ckpt.name.split("_")[1]):
            return f"{STATE_FILE} is not the trainer state of {ckpt.name}"
        for directory in (ckpt, ckpt / "ref") if (ckpt / "ref").is_dir() else (ckpt,):
            meta = json.loads((directory / "meta.json").read_text())
            optimizer = meta.get("optimizer")
            for entry in [*meta["shards"], *(optimizer if isinstance(optimizer, list) else [])]:
                path = directory / entry["file"]
                if not path.is_file():
                    return f"{path.relative_to(ckpt.parent)} is missing"
                if path.stat().st_size != entry["bytes"]:
                    return f"{path.relative_to(ckpt.parent)} is {path.stat().st_size} bytes, its manifest says {entry['bytes']}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable manifest ({type(e).__name__}: {e})"
    return None


def sound_checkpoint(root: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint under `root` whose manifests hold (`manifest_problem`), and the newer ones
    skipped with why. Where none holds: the newest, whose load then names its damage, and no skipped list."""
    done = complete_checkpoints(root)
    skipped = []
    for ckpt in reversed(done):
        why = manifest_problem(ckpt)
        if why is None:
            return ckpt, skipped
        skipped.append((ckpt, why))
    return (done[-1] if done else None), []


def newest_checkpoint(root: Path) -> Path | None:
    """The checkpoint a run under `root` resumes from (`sound_checkpoint`), or None."""
    return sound_checkpoint(root)[0]


def _flat(config: dict) -> dict:
    return {
        f"{section}.{key}": value
        for section, values in config.items()
        if isinstance(values, dict)
        for key, value in values.items()
    }


def _defaults() -> dict:
    """{"section.key": default} of every field."""
    out = {}
    for f in dataclasses.fields(JetRLConfig):
        section = f.default_factory()
        for g in dataclasses.fields(section):
            value = getattr(section, g.name)
            if g.init:
                out[f"{f.name}.{g.name}"] = list(value) if isinstance(value, tuple) else value
    return out


def changed_keys(saved: dict, cfg: JetRLConfig) -> dict:
    """{"section.key": (saved value, this config's value)} for every compared key that differs (a key the saved
    config lacks, e.g. one added since, counts as its default)."""
    old, new = _flat(resolve_saved(saved, cfg)), _flat(cfg.to_dict())
    defaults = _defaults()
    return {k: (old.get(k, defaults.get(k)), v) for k, v in new.items() if k not in IGNORED and old.get(k, defaults.get(k)) != v}


def previous_run(cfg: JetRLConfig) -> PreviousRun | None:
    """The run `cfg` would resume, or None (a fresh run; also when the newest trainer state is unreadable: the
    resume itself then refuses it, naming the file). ConfigError for a change a resumed run cannot take."""
    ckpt = newest_checkpoint(cfg.run.directory / "checkpoints")
    if ckpt is None:
        return None
    if cfg.run.resume == "never":
        raise ConfigError(
            f"{cfg.run.directory} already holds checkpoints ({ckpt.name}) and run.resume='never': "
            "choose another run.name / run.out_dir, or delete them"
        )
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
        step, saved = int(state["step"]), state["config"]
        if not isinstance(saved, dict):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    changes = changed_keys(saved, cfg)
    identity = sorted(k for k in changes if k.split(".")[0] in ("model", "precision") and k not in APPLIED_ON_RESUME)
    if identity:
        raise ConfigError(
            f"{ckpt} was written by a run with another model or precision section ({', '.join(identity)}); "
            f"resume with the same config or use a new run.name (e.g. run.name={cfg.run.directory.name}-2)"
        )
    refused = {k: v for k, v in changes.items() if k not in APPLIED_ON_RESUME}
    if refused:
        what = "; ".join(f"{k}: trained with {old!r}, now {new!r}" for k, (old, new) in sorted(refused.items()))
        keep = " ".join(f"{k}={json.dumps(old)}" for k, (old, _) in sorted(refused.items()))
        raise ConfigError(
            f"{cfg.run.directory} (step {step}) would resume with changed hyper-parameters ({what}): a resumed "
            f"run keeps its own: drop the override(s) or pass {keep} (a config's auto may resolve otherwise "
            f"now), or start a new run with another run.name (e.g. run.name={cfg.run.directory.name}-2)"
        )
    return PreviousRun(cfg.run.directory, ckpt, step, changes)
