"""Every `auto` of a run config turned into the value the run uses, in one pass: `resolve(cfg, device)`.

A raw config (YAML files and overrides, `rl/config.py`) may leave these keys to a rule; `load_config` returns the
config `resolve` made of it, so the run writes it (`config.yaml`, each checkpoint's `trainer_state.json`), every part
reads concrete values, and a resume compares resolved configs:

* `run.device` (auto, cpu, cuda): cuda for a config that runs on GPUs only (rollout.engine=vllm, model.spec=te), else
  this machine's: cuda where a GPU is visible, else cpu.
* `model.batch_invariant` (auto or null, true, false): true on the CPU, where the emulated FP8 GEMM is the only one (an
  FP8 mode whose precision.backend names a GPU backend keeps it false: the preflight refuses that backend there).
* `precision.backend` (auto, emulated, deepgemm, ...): emulated in a batch-invariant FP8 run (the one batch-invariant
  FP8 GEMM; precision.gemm_sms is then refused); otherwise `auto` stays, a policy (below).
* `optim.distributed` (auto, true, false): true where there are data-parallel ranks to shard over (parallel.dp > 1).
* `model.bf16_linear_weights` (auto, keep, release): release wherever it applies (`JetRLConfig.bf16_linears_released`:
  jetrl, local spec, megatron's mixed-precision optimizer), else keep.
* `rollout.glue` (auto, trainer, vllm): trainer, except vllm for a scaled RoPE (llama3) or model.spec=te
  (`rollout.vllm_engine.resolve_glue`, which an engine built with glue="auto" also applies).
* `precision.exact_logprobs` (auto, also when absent; true, false): true wherever it holds
  (`JetRLConfig.exact_logprobs_holds`: jetrl, vLLM, TP 1 or 2, ...).
* `precision.kv_scales` (auto, none, amax, running_max, fixed, engine): with an FP8 KV cache running_max under
  exact_logprobs, else engine; none with a BF16 cache (`PrecisionFlow.kv_scale_policy`). A trainer policy (amax,
  running_max, fixed) without exact_logprobs is refused: the trainer reads the amax in its exact-logprob attention.
* `parallel.pp_last_layers` (auto, or a count): the last pipeline stage's decoder layers that leave the busiest stage
  least busy (`config_schema.balanced_last_layers`); 0 (even) at pp 1.

Two keys say `auto` and keep it, for they are policies, not values (`POLICIES`): `run.resume` (what to do with a run
directory that holds checkpoints) and `precision.backend` outside a batch-invariant FP8 run, which `fp8.gemm.resolve_backend`
applies to each GEMM (the first backend the device has that takes its output width: on a GPU it depends on the shape
and on what is installed, so no one value names it; on the CPU it is the emulated one, left unwritten so that the
precision section, which a resume compares, does not depend on the machine).

Where it runs: in `load_config`, so that the launchers' question, the preflight and its resume check, the trainer and
its config.yaml all receive the resolved config (`rl.session.build_session` calls it again with the device it
found: a no-op on a resolved config). The device only matters where `run.device` is `auto`: `device`
names what it stands for (cpu or cuda: a test may say cuda on a machine without one); None asks this machine
(`torch.cuda.is_available()`, and only then). No rule needs more of a GPU than that it is there.

`precision.exact_logprobs` and `optim.distributed` belong to classes outside `rl/` (`fp8.PrecisionFlow`,
`actor.optim_config.OptimConfig`) that type them bool: the loader holds a raw `auto` there at false and names the key
in `autos` (`BOOL_AUTOS`); no bool field ever holds a string.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from megatron_jetrl.fp8.flow import TRAINER_KV_SCALES
from megatron_jetrl.rl.config_schema import ConfigError, JetRLConfig, _plain, balanced_last_layers

BOOL_AUTOS = {"precision.exact_logprobs": True, "optim.distributed": False}
"""Bool-typed keys a raw config may set to `auto`: whether an absent key means `auto` too (exact_logprobs: a run
config's default is auto; optim.distributed: false)."""

AUTO_KEYS = (
    "run.device",
    "model.batch_invariant",
    "precision.backend",
    "optim.distributed",
    "model.bf16_linear_weights",
    "rollout.glue",
    "precision.exact_logprobs",
    "precision.kv_scales",
    "parallel.pp_last_layers",
)
"""The keys `resolve` decides, in the order it decides them (a later rule reads the earlier keys' values)."""

POLICIES = {
    "run.resume": "auto continues from the newest complete checkpoint of run.out_dir, never refuses a directory that holds one",
    "precision.backend": "auto picks, for each FP8 GEMM, the first backend the device has that takes its output width "
    "(fp8.gemm.resolve_backend)",
}
"""Keys whose `auto` is a policy applied at each use, not a value: `resolve` leaves them (precision.backend only
outside a batch-invariant FP8 run, where it is pinned to emulated)."""

GPU_ONLY = {"rollout.engine": "vllm", "model.spec": "te"}
"""Settings that run on a CUDA GPU only: `run.device: auto` is cuda for them on any machine (the preflight then refuses a
machine without one)."""


def machine_device() -> str:
    """'cuda' where this machine has a visible CUDA device, else 'cpu'."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def gpu_only(cfg: JetRLConfig) -> str | None:
    """The setting of `cfg` that needs a CUDA GPU (`GPU_ONLY`, as `key=value`), or None."""
    for key, value in GPU_ONLY.items():
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) == value:
            return f"{key}={value}"
    return None


def batch_invariant_rule(device: str, mode: str, backend: str) -> bool:
    """`model.batch_invariant: auto`: true on the CPU, where the emulated FP8 GEMM (the one batch-invariant GEMM) is
    the only one; false on a GPU, and for an FP8 mode whose precision.backend names a GPU backend (which the CPU lacks:
    the preflight refuses it before this value is used)."""
    return device == "cpu" and (mode == "bf16" or backend in ("auto", "emulated"))


def resolve(cfg: JetRLConfig, device: str | None = None, *, autos: Collection[str] = ()) -> JetRLConfig:
    """`cfg` with every `auto` of `AUTO_KEYS` replaced by its rule's value (this module's docstring); `POLICIES` stay.

    `device`: what `run.device: auto` stands for on the machine that runs the config ('cpu' or 'cuda'; None: this
    machine's, `machine_device`), unless the config runs on GPUs only; a given run.device is kept. `autos`: the
    `BOOL_AUTOS` keys the raw config left at `auto` (the loader holds them at false). Idempotent: a resolved config
    comes back as it is. The keys it decided are `JetRLConfig.resolved_autos()` of the result."""
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or None (this machine's), got {device!r}")
    unknown = set(autos) - set(BOOL_AUTOS)
    if unknown:
        raise ValueError(f"autos names {sorted(unknown)}; only {sorted(BOOL_AUTOS)} are bool keys that may be auto")
    done: list[str] = []
    try:
        out = _resolve(cfg, device, set(autos), done)
    except ConfigError:
        raise
    except ValueError as e:  # a resolved section its own class refuses (PrecisionFlow's checks)
        raise ConfigError(str(e)) from None
    if not done:
        return cfg
    object.__setattr__(out, "_resolved_autos", cfg.resolved_autos() | frozenset(done))
    if "run.device" in done and gpu_only(out):  # RunConfig.device_type names it on a machine without a GPU
        object.__setattr__(out.run, "_cuda_for", gpu_only(out))
    return out


def _resolve(cfg: JetRLConfig, device: str | None, autos: set[str], done: list[str]) -> JetRLConfig:
    def put(key: str, value) -> None:
        nonlocal cfg
        section, name = key.split(".")
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: value})})
        done.append(key)

    if cfg.run.device == "auto":
        put("run.device", "cuda" if gpu_only(cfg) else device or machine_device())
    if cfg.model.batch_invariant in ("auto", None):
        put("model.batch_invariant", batch_invariant_rule(cfg.run.device, cfg.precision.mode, cfg.precision.backend))
    if cfg.precision.backend == "auto" and cfg.model.batch_invariant and cfg.precision.mode != "bf16":
        if cfg.precision.gemm_sms:
            said = "auto, true on the CPU" if "model.batch_invariant" in done else "true"
            raise ConfigError(
                f"precision.gemm_sms={cfg.precision.gemm_sms} limits DeepGEMM's kernels, but this run is batch-"
                f"invariant (model.batch_invariant: {said}) and runs the emulated FP8 GEMM: leave "
                "precision.gemm_sms at 0 or set model.batch_invariant=false"
            )
        put("precision.backend", "emulated")  # the one batch-invariant FP8 GEMM (exact block products)
    if "optim.distributed" in autos:
        put("optim.distributed", cfg.parallel.dp > 1)
    if cfg.model.bf16_linear_weights == "auto":
        put("model.bf16_linear_weights", "release" if cfg.bf16_linears_released() else "keep")
    if cfg.rollout.glue == "auto":
        from megatron_jetrl.rollout.vllm_engine import resolve_glue

        put("rollout.glue", resolve_glue("auto", _arch_or_none(cfg), cfg.model.spec))
    if "precision.exact_logprobs" in autos:
        put("precision.exact_logprobs", cfg.exact_logprobs_holds())
    if cfg.precision.kv_scales == "auto":
        put("precision.kv_scales", cfg.precision.kv_scale_policy)
    if cfg.precision.kv_scales in TRAINER_KV_SCALES and not cfg.precision.exact_logprobs:
        raise ConfigError(
            f"precision.kv_scales={cfg.precision.kv_scales}: the trainer reads the K/V amax in its exact-logprob "
            "attention, and precision.exact_logprobs is off here: set it true, or precision.kv_scales=engine"
        )
    if cfg.parallel.pp_last_layers == "auto":
        arch = _arch_or_none(cfg)
        if arch is None:
            raise ConfigError(
                "parallel.pp_last_layers=auto costs the stages from the model's shapes, which this machine cannot read "
                f"(model.path={cfg.model.path!r} has no config.json here): give the count, or run where the model is"
            )
        last = balanced_last_layers(arch, cfg.parallel.pp, cfg.precision.train_fp8, cfg.rollout.max_new_tokens)
        put("parallel.pp_last_layers", last)
    return cfg


def _arch_or_none(cfg: JetRLConfig):
    """The model's architecture (its RoPE scaling decides the glue): inline, else model.path's config.json where this
    machine has it; None where it has not (a config checked away from its weights: the rule then reads model.hf_config
    alone, which is empty)."""
    from megatron_jetrl.models.arch import ModelArch

    try:
        return ModelArch.from_hf_config(cfg.model.architecture())
    except (ConfigError, OSError, ValueError, KeyError, TypeError):
        return None


def unresolved(cfg: JetRLConfig) -> list[str]:
    """The keys of `cfg` that still hold `auto` (or null for model.batch_invariant), policies left out."""
    out = []
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            key = f"{section.name}.{f.name}"
            value = getattr(values, f.name)
            if key not in POLICIES and (value == "auto" or (key == "model.batch_invariant" and value is None)):
                out.append(key)
    if cfg.precision.backend == "auto" and cfg.model.batch_invariant is True and cfg.precision.mode != "bf16":
        out.append("precision.backend")
    return out


def resolve_saved(saved: dict, cfg: JetRLConfig) -> dict:
    """A config a checkpoint saved before `resolve` existed (`trainer_state.json`'s `config`), its raw `auto` values
    (and model.batch_invariant's null) replaced by `cfg`'s resolved ones, so that a resume compares resolved configs:
    such a run resolved them with the same rules when it started, as `cfg` does. A key the saved section lacks counts
    as its default (`run_state.changed_keys`); where that default is `auto` it is filled the same way. A key saved with
    a value stays."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in saved.items()}
    resolved = cfg.to_dict()
    defaults = {f.name: f.default_factory() for f in dataclasses.fields(JetRLConfig)}
    for section, values in out.items():  # keys added since it was saved: their defaults (autos resolved below)
        if isinstance(values, dict) and section in defaults:
            fields = dataclasses.fields(defaults[section])
            out[section] = {**{g.name: _plain(getattr(defaults[section], g.name)) for g in fields if g.init}, **values}
    for key in AUTO_KEYS:
        section, name = key.split(".")
        values = out.get(section)
        if not isinstance(values, dict):
            continue
        raw = values[name] if name in values else getattr(defaults[section], name)
        if raw == "auto" or (key == "model.batch_invariant" and raw is None):
            values[name] = resolved[section][name]
    return out
