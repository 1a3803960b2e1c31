"""Every config key that can be `auto` is resolved by one function (`rl.resolve.resolve`, run by load_config), for every
preset in every precision mode on either device: no `auto` is left but the policies, no bool key holds a word, and each
value follows its rule -- the rules restated here as the four places computed them before (rl/config.py for
exact_logprobs and optim.distributed, rl/session.py for batch_invariant and the GEMM backend, rl/config_schema.py for
bf16_linear_weights, rollout/vllm_engine.py for the glue)."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import torch

from megatron_jetrl.models.arch import ModelArch
from megatron_jetrl.rl.config import ConfigError, config_from_dict, load_config, raw_data
from megatron_jetrl.rl.config_schema import balanced_last_layers
from megatron_jetrl.rl.resolve import AUTO_KEYS, POLICIES, resolve, resolve_saved, unresolved

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PRESETS = {p.stem: [p] for p in sorted(CONFIGS.glob("*.yaml")) if not p.stem.startswith("e2e_8b")}  # e2e_8b*: overlays
PRESETS |= {f"models/{p.stem}": [p] for p in sorted((CONFIGS / "models").glob("*.yaml"))}
PRESETS["qwen3-8b-base+e2e_8b"] = [CONFIGS / "models/qwen3-8b-base.yaml", CONFIGS / "e2e_8b.yaml"]
PRESETS["qwen3-8b-base+e2e_8b+long"] = [*PRESETS["qwen3-8b-base+e2e_8b"], CONFIGS / "e2e_8b_long.yaml"]
MODES = sorted(p.stem for p in (CONFIGS / "modes").glob("*.yaml"))
VARIANTS = {  # overrides on top of preset + mode: as shipped, on whatever machine, and the auto keys' other branches
    "as shipped": [],
    "run.device=auto": ["run.device=auto"],
    "vllm": ["run.device=auto", "rollout.engine=vllm"],
    "dp 2": ["optim.distributed=auto", "parallel.dp=2"],
    "all auto": [
        "run.device=auto",
        "model.batch_invariant=auto",
        "model.bf16_linear_weights=auto",
        "rollout.glue=auto",
        "precision.exact_logprobs=auto",
        "optim.distributed=auto",
        "parallel.pp_last_layers=auto",
    ],
}


def test_the_matrix_covers_every_preset_and_mode():
    assert {"tiny", "gpu_1p5b", "models/qwen3-8b-base", "models/llama-3.1-8b"} <= set(PRESETS)
    assert MODES == ["bf16", "bf16-train-fp8-rollout", "jetrl"]


def raw(data: dict, key: str, absent):
    section, name = key.split(".")
    return (data.get(section) or {}).get(name, absent)


def expected(data: dict, cfg, device: str) -> dict:
    """What each auto key must resolve to: the rules, from the raw mapping and the resolved config's other keys."""
    p, m, r = cfg.precision, cfg.model, cfg.rollout
    want = {}
    gpu_only = r.engine == "vllm" or m.spec == "te"
    want["run.device"] = raw(data, "run.device", "auto")
    if want["run.device"] == "auto":
        want["run.device"] = "cuda" if gpu_only else device
    bi = raw(data, "model.batch_invariant", "auto")
    if bi in ("auto", None):  # session.py: true for CPU runs (a GPU backend named on the CPU: refused by the preflight)
        bi = want["run.device"] == "cpu" and (p.mode == "bf16" or raw(data, "precision.backend", "auto") in ("auto", "emulated"))
    want["model.batch_invariant"] = bi
    backend = raw(data, "precision.backend", "auto")  # session.py: a batch-invariant FP8 run pins the emulated GEMM
    want["precision.backend"] = "emulated" if backend == "auto" and bi and p.mode != "bf16" else backend
    dist = raw(data, "optim.distributed", False)  # config.py: ZeRO-1 where there are DP ranks to shard over
    want["optim.distributed"] = cfg.parallel.dp > 1 if dist == "auto" else dist
    release = raw(data, "model.bf16_linear_weights", "auto")  # config_schema.py: release wherever it applies
    if release == "auto":
        applies = p.mode == "jetrl" and m.spec == "local" and cfg.optim.bf16 and not want["optim.distributed"]
        release = "release" if applies else "keep"
    want["model.bf16_linear_weights"] = release
    glue = raw(data, "rollout.glue", "auto")  # vllm_engine.py: the trainer's, but vLLM's for a scaled RoPE or TE
    if glue == "auto":
        glue = "vllm" if ModelArch.from_hf_config(m.architecture()).rope_scaling or m.spec == "te" else "trainer"
    want["rollout.glue"] = glue
    exact = raw(data, "precision.exact_logprobs", "auto")  # config.py: on in jetrl with vLLM at TP 1-2 where it holds
    if exact == "auto":
        exact = (
            p.mode == "jetrl"
            and r.engine == "vllm"
            and cfg.parallel.tp <= 2
            and m.spec == "local"
            and not bi
            and glue != "vllm"
            and not m.hf_config.get("rope_scaling")
            and r.tp == cfg.parallel.tp
        )
    want["precision.exact_logprobs"] = exact
    kv = raw(data, "precision.kv_scales", "auto")  # flow.py: running_max under exact logprobs, else engine; none for BF16
    if kv == "auto":
        kv = ("running_max" if exact else "engine") if raw(data, "precision.kv_cache", "bf16") == "fp8" else "none"
    want["precision.kv_scales"] = kv
    last = raw(data, "parallel.pp_last_layers", 0)  # config_schema.py: the split that leaves the busiest stage least busy
    if last == "auto":
        last = balanced_last_layers(cfg.arch(), cfg.parallel.pp, p.train_fp8, r.max_new_tokens)
    want["parallel.pp_last_layers"] = last
    return want


def autos_left(cfg) -> list[str]:
    """Every key of the dataclass tree that says auto (or null for model.batch_invariant), the policies apart."""
    left = []
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            key, value = f"{section.name}.{f.name}", getattr(values, f.name)
            if (value == "auto" or (key == "model.batch_invariant" and value is None)) and key not in POLICIES:
                left.append(key)
    return left


def types_hold(cfg) -> list[str]:
    """Keys whose value is not of its declared type: a bool key holding anything else, or a word outside its Literal."""
    wrong = []
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        hints = typing.get_type_hints(type(values))
        for f in dataclasses.fields(values):
            value, hint = getattr(values, f.name), hints[f.name]
            if hint is bool and not isinstance(value, bool):
                wrong.append(f"{section.name}.{f.name}={value!r}")
            if typing.get_origin(hint) is typing.Literal and value not in typing.get_args(hint):
                wrong.append(f"{section.name}.{f.name}={value!r}")
    return wrong


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset", PRESETS)
def test_every_auto_of_every_preset_and_mode_resolves_by_its_rule(preset, mode, variant, device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("resolve asked the machine though told its device"))
    files = [*PRESETS[preset], CONFIGS / "modes" / f"{mode}.yaml"]
    data = raw_data(files, VARIANTS[variant])
    try:
        cfg = load_config(files, VARIANTS[variant], device=device)
    except ConfigError as e:  # a layout the preset's batch does not split into: refused as before, nothing to resolve
        assert variant == "dp 2" and "do not split into parallel.dp=2" in str(e), e
        return
    assert autos_left(cfg) == [] and unresolved(cfg) == []
    assert types_hold(cfg) == []
    got = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in AUTO_KEYS}
    assert got == expected(data, cfg, device)
    if cfg.precision.backend == "auto":  # the policy: left to each GEMM, never on a batch-invariant FP8 run
        assert not (cfg.model.batch_invariant and cfg.precision.mode != "bf16")
    assert resolve(cfg, device) is cfg and resolve(cfg, "cuda" if device == "cpu" else "cpu") is cfg  # idempotent
    assert config_from_dict(cfg.to_dict(), device) == cfg  # config.yaml, loaded again, is the same config


def test_the_machine_is_asked_only_for_run_device_auto(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or False)
    assert load_config(None, ["run.device=cpu"]).run.device == "cpu" and not asked
    assert load_config(None, ["run.device=cuda"]).run.device == "cuda" and not asked  # checked anywhere
    assert load_config(None, ["rollout.engine=vllm"]).run.device == "cuda" and not asked  # vLLM: a GPU run on any machine
    cfg = load_config()
    assert asked == [1] and cfg.run.device == "cpu" and cfg.model.batch_invariant and cfg.precision.backend == "emulated"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = load_config()
    assert cfg.run.device == "cuda" and not cfg.model.batch_invariant and cfg.precision.backend == "auto"


def test_a_gpu_only_config_resolved_to_cuda_is_refused_on_a_cpu_machine_naming_the_setting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(None, ["rollout.engine=vllm"])
    with pytest.raises(
        ConfigError, match=r"^rollout.engine=vllm needs a CUDA GPU and this run is on the cpu: set rollout.engine=native"
    ):
        cfg.run.device_type()
    with pytest.raises(ConfigError, match=r"^run.device='cuda' but no CUDA device is visible"):
        load_config(None, ["run.device=cuda"]).run.device_type()
    with pytest.raises(ConfigError, match="rollout.engine=vllm needs a GPU run, not run.device=cpu"):
        load_config(None, ["rollout.engine=vllm", "run.device=cpu"])


def test_what_resolve_decided_is_recorded():
    cfg = load_config(None, ["optim.distributed=true"], device="cpu")
    assert cfg.resolved_autos() == {
        "run.device",
        "model.batch_invariant",
        "precision.backend",
        "model.bf16_linear_weights",
        "rollout.glue",
        "precision.exact_logprobs",
        "precision.kv_scales",
    }
    assert load_config(None, ["optim.distributed=auto"], device="cpu").resolved_autos() >= {"optim.distributed"}


def test_the_bool_keys_that_take_auto_refuse_other_words():
    with pytest.raises(ConfigError, match=r"optim.distributed must be true or false, got 'sometimes'"):
        load_config(None, ["optim.distributed=sometimes"])
    with pytest.raises(ConfigError, match=r"precision.exact_logprobs must be true or false, got 'always'"):
        load_config(None, ["precision.exact_logprobs=always"])
    with pytest.raises(ConfigError, match=r"model.batch_invariant must be true, false or auto, got 'maybe'"):
        load_config(None, ["model.batch_invariant=maybe"])
    assert load_config(None, ["model.batch_invariant=null"], device="cuda").model.batch_invariant is False  # null: auto


def test_gemm_sms_on_a_batch_invariant_run_is_refused_with_the_fix():
    with pytest.raises(
        ConfigError,
        match=r"precision.gemm_sms=120 .* batch-invariant \(model.batch_invariant: auto, true on "
        r"the CPU\) .*leave precision.gemm_sms at 0 or set model.batch_invariant=false",
    ):
        load_config(None, ["precision.gemm_sms=120"], device="cpu")
    assert load_config(None, ["precision.gemm_sms=120"], device="cuda").precision.gemm_sms == 120


def test_a_checkpoint_saved_with_autos_compares_as_resolved():
    """trainer_state.json of a run started before configs were resolved holds the raw autos (and null for
    model.batch_invariant); `resolve_saved` reads them as this config's values, and keeps every given value."""
    cfg = load_config(None, [], device="cpu")
    old = cfg.to_dict()
    old["run"]["device"], old["model"]["batch_invariant"], old["model"]["bf16_linear_weights"] = "auto", None, "auto"
    old["rollout"]["glue"], old["precision"]["backend"] = "auto", "auto"
    assert resolve_saved(old, cfg) == cfg.to_dict()
    del old["rollout"]["glue"]  # a key added since: its default, auto, resolved too
    assert resolve_saved(old, cfg) == cfg.to_dict()
    del old["precision"]["kv_cache"], old["precision"]["kv_scales"]  # keys added since, one with a plain default
    assert resolve_saved(old, cfg) == cfg.to_dict()
    old["model"]["batch_invariant"], old["precision"]["exact_logprobs"] = False, True
    kept = resolve_saved(old, cfg)
    assert kept["model"]["batch_invariant"] is False and kept["precision"]["exact_logprobs"] is True  # given values stay
    assert old["run"]["device"] == "auto"  # a copy


NUMBER = re.compile(r"\b\d+(\.\d+)?x\b|\b\d+(\.\d+)?%|\b0\.\d{2,}\b|\b\d+(\.\d+)? ?ms\b|tok/s")
"""A measured ratio, share, mismatch or time (the rules' own thresholds, e.g. hidden_size 4096, are not measurements)."""


def test_docstrings_and_notices_state_rules_not_measurements():
    from megatron_jetrl.rl import config, config_schema
    from megatron_jetrl.rl import resolve as resolve_module

    for module in (config, config_schema, resolve_module):
        text = Path(module.__file__).read_text()
        assert not [m.group(0) for m in NUMBER.finditer(text)], module.__name__
    e2e = [CONFIGS / "models/qwen3-8b-base.yaml", CONFIGS / "e2e_8b.yaml"]
    noted = [
        *load_config(CONFIGS / "gpu_8b_shapes.yaml", ["rollout.engine=vllm", "parallel.tp=2", "rollout.tp=1"]).notices(),
        *load_config(CONFIGS / "learning_curves.yaml").notices(),
        *load_config(e2e, ["parallel.pp=1", "parallel.pp_last_layers=0", "parallel.tp=4", "rollout.tp=4"]).notices(),
        *load_config(e2e, ["parallel.pp_last_layers=0", "optim.distributed=true"]).notices(),
    ]
    assert len(noted) == 6 and all("BENCHMARKS.md" in n or "GiB a GPU here" in n or "not measured yet" in n for n in noted)
    assert not [m.group(0) for n in noted for m in NUMBER.finditer(n)]


def test_the_te_spec_resolves_to_a_gpu_run_with_vllms_glue(monkeypatch):
    from megatron_jetrl.fp8 import te as te_mod

    monkeypatch.setattr(te_mod, "te_installed", lambda: True)
    cfg = load_config(None, ["model.spec=te", "rollout.engine=vllm"], device="cpu")
    assert (cfg.run.device, cfg.model.batch_invariant, cfg.rollout.glue) == ("cuda", False, "vllm")
    assert (cfg.model.bf16_linear_weights, cfg.precision.exact_logprobs, cfg.precision.backend) == ("keep", False, "auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^rollout.engine=vllm needs a CUDA GPU"):  # the first GPU-only setting is named
        cfg.run.device_type()
    with pytest.raises(ConfigError, match=r"^model.spec=te needs a CUDA GPU .*use model.spec=local on the CPU"):
        load_config(None, ["model.spec=te"], device="cpu").run.device_type()


@pytest.mark.parametrize(
    "overrides,scales",
    [
        (["precision.kv_cache=fp8"], "running_max"),
        (["precision.kv_cache=fp8", "precision.exact_logprobs=false"], "engine"),
        (["precision.kv_cache=fp8", "precision.kv_scales=amax"], "amax"),
        (["precision.kv_cache=fp8", "precision.kv_scales=fixed"], "fixed"),
        ([], "none"),
    ],
)
def test_the_kv_cache_scales_resolve_to_the_trainers_under_exact_logprobs_else_the_engines(overrides, scales):
    cfg = load_config([CONFIGS / "gpu_1p5b.yaml"], ["rollout.engine=vllm", *overrides], device="cuda")
    assert cfg.precision.kv_scales == scales
    assert cfg.precision.trainer_kv_scales == (scales in ("running_max", "amax", "fixed"))


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["precision.kv_cache=fp8", "precision.kv_scales=amax", "precision.exact_logprobs=false"], "exact-logprob attention"),
        (["precision.kv_cache=fp8", "precision.kv_scales=engine", "precision.exact_logprobs=true"], "cannot know"),
        (["precision.kv_cache=fp8", "rollout.engine=native", "run.device=cuda"], "native engine keeps a BF16 cache"),
        (["precision.kv_scales=amax"], "kv_cache='bf16'"),
        (["precision.kv_cache=fp16"], "kv_cache must be one of"),
    ],
)
def test_kv_cache_settings_that_cannot_hold_are_refused_naming_the_fix(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_config([CONFIGS / "gpu_1p5b.yaml"], ["rollout.engine=vllm", *overrides], device="cuda")


def test_kv_scales_engine_keeps_exact_logprobs_auto_off():
    cfg = load_config(
        [CONFIGS / "gpu_1p5b.yaml"],
        ["rollout.engine=vllm", "precision.kv_cache=fp8", "precision.kv_scales=engine"],
        device="cuda",
    )
    assert cfg.precision.exact_logprobs is False and cfg.precision.kv_scale_policy == "engine"


def test_sequence_parallel_needs_tp_and_keeps_exact_logprobs_auto_off():
    base = [CONFIGS / "gpu_1p5b.yaml"]
    with pytest.raises(ConfigError, match="splits the sequence over the TP ranks: set parallel.tp > 1"):
        load_config(base, ["parallel.sequence_parallel=true"], device="cuda")
    two = ["rollout.engine=vllm", "parallel.tp=2", "rollout.tp=2", "parallel.sequence_parallel=true"]
    assert load_config(base, two, device="cuda").precision.exact_logprobs is False
    assert load_config(base, two[:-1], device="cuda").precision.exact_logprobs is True
    with pytest.raises(ConfigError, match="reduce-scattered row-parallel outputs have not been checked"):
        load_config(base, [*two, "precision.exact_logprobs=true"], device="cuda")
