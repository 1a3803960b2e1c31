"""The GRPO run's configuration: typed, frozen dataclasses filled from a YAML file plus `section.key=value`
overrides (`section.key.name=value` for one entry of a mapping: `model.hf_config.num_hidden_layers=28`), checked
completely before any heavy work starts.

Sections and the classes they fill: `run` (RunConfig), `model` (ModelConfig), `precision`
(`fp8.PrecisionFlow`, the one object trainer and rollout share), `parallel` (ParallelConfig), `data`
(DataConfig), `rollout` (RolloutConfig), `grpo` (GRPOConfig), `loss` (`grpo.loss.PolicyLossConfig`), `optim`
(`actor.train_step.OptimConfig`), `warmup` (WarmupConfig). Unknown sections or keys, wrong types and
settings that do not fit together (batch sizes that do not divide, 128-block misalignment at the requested
TP, ...) are refused with a message that names the key and the fix. The classes are defined in
`rl/config_sections.py` (one per section) and `rl/config_schema.py` (`JetRLConfig`: how they fit together) and
re-exported here; this module loads them and is the CLI, which calls `rl/preflight.py`.
A loaded config is resolved (`rl/resolve.py`): every key a YAML file or override left at `auto` holds its value.

    python -m megatron_jetrl.rl.config configs/tiny.yaml parallel.tp=2 --get parallel.world_size
    python -m megatron_jetrl.rl.config configs/models/qwen3-8b-base.yaml configs/modes/jetrl.yaml --print

`--get` is the launchers' question on the machine that will run the ranks, so it also refuses what this machine
or the run directory cannot run (`rl/preflight.py`: `run.device=cuda` without a visible GPU, `rollout.engine=vllm`
without vLLM, a missing `model.path` or `data.path`, a changed hyper-parameter of a run that would resume, ...);
a config checked alone is valid on any machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import textwrap
import types
import typing
from pathlib import Path

import yaml

from megatron_jetrl.rl.config_schema import (  # noqa: F401
    ConfigError,
    DataConfig,
    GRPOConfig,
    JetRLConfig,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
    RunConfig,
    WarmupConfig,
)
from megatron_jetrl.rl.resolve import BOOL_AUTOS, resolve

_CONFIGS = [Path(__file__).resolve().parents[2] / "configs", Path(__file__).resolve().parents[1] / "_configs"]
DEFAULT_CONFIG = next((d / "tiny.yaml" for d in _CONFIGS if (d / "tiny.yaml").is_file()), _CONFIGS[0] / "tiny.yaml")
"""configs/tiny.yaml of the repository, else the copy an installed package carries (pyproject.toml's package data)."""


# ---- loading --------------------------------------------------------------------------------------------


_EXACT = {int: ("an integer", ""), bool: ("true or false", ""), str: ("a string", " (quote it in YAML)"), dict: ("a mapping", "")}
"""Types a value must already have (YAML gives them directly): what to call them, and a hint."""


def _coerce(value, hint, where: str):
    """`value` as type `hint` (int, float, str, bool, dict, tuple[...], Literal[...], X | None, bool | Literal[...]), or a
    ConfigError. A Literal of words takes any string (its class's check names the choices)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        words = [w for a in args if typing.get_origin(a) is typing.Literal for w in typing.get_args(a)]
        if value in words and not isinstance(value, bool):
            return value
        others = [a for a in args if a is not type(None) and typing.get_origin(a) is not typing.Literal]
        if words and others == [bool] and not isinstance(value, bool):
            raise ConfigError(f"{where} must be true, false or {' or '.join(map(str, words))}, got {value!r}")
        if words and others == [int] and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{where} must be an integer or {' or '.join(map(str, words))}, got {value!r}")
        return _coerce(value, next(a for a in args if a is not type(None)), where)
    if origin is typing.Literal:
        return _coerce(value, str, where) if all(isinstance(a, str) for a in typing.get_args(hint)) else value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        args = typing.get_args(hint)
        item = args[0] if args else object
        return tuple(value) if item is object or item is Ellipsis else tuple(_coerce(v, item, where) for v in value)
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 5e-4 (no dot) as a string; it is a number all the same
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if hint in _EXACT:
        what, hint_text = _EXACT[hint]
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ConfigError(f"{where} must be {what}, got {value!r}{hint_text}")
        return value
    return value


def _unknown(key, known, where: str) -> ConfigError:
    key = str(key)  # YAML keys may be null, numbers, ...
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"
    return ConfigError(f"unknown key {where}{key!r}{hint}")


def _build(cls, data, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"section {where.rstrip('.') or 'top level'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown(key, fields, where)
        kwargs[key] = _coerce(value, hints[key], f"{where}{key}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where.rstrip('.')}: {e}") from None


def _is_mapping_field(section: str, key: str) -> bool:
    """Is `section.key` a mapping-typed field (e.g. model.hf_config)?"""
    hint = typing.get_type_hints(typing.get_type_hints(JetRLConfig)[section]).get(key)
    return hint is dict or typing.get_origin(hint) is dict


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`section.key=value` strings (values parsed as YAML) merged into a config dict; `section.key.name=value` sets
    one entry of a mapping field (e.g. `model.hf_config.num_hidden_layers=28`) and keeps the others."""
    sections = {f.name for f in dataclasses.fields(JetRLConfig)}
    for item in overrides:
        key, sep, raw = item.partition("=")
        parts = key.split(".")
        entry = len(parts) == 3 and all(parts) and parts[0] in sections and _is_mapping_field(parts[0], parts[1])
        if not sep or not all(parts) or not (len(parts) == 2 or entry):
            raise ConfigError(
                f"override {item!r} is not of the form section.key=value (e.g. parallel.tp=2), or "
                "section.key.name=value for one entry of a mapping (e.g. model.hf_config.num_hidden_layers=28)"
            )
        if parts[0] not in sections:
            raise _unknown(parts[0], sections, "")
        data.setdefault(parts[0], {})
        if not isinstance(data[parts[0]], dict):
            raise ConfigError(f"section {parts[0]} must be a mapping")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({str(e).splitlines()[0]}); quote it") from None
        if entry:
            current = data[parts[0]].get(parts[1]) or {}
            if not isinstance(current, dict):
                raise ConfigError(f"override {item!r}: {parts[0]}.{parts[1]} is {current!r}, not a mapping")
            data[parts[0]][parts[1]] = {**current, parts[2]: value}
        else:
            data[parts[0]][parts[1]] = value
    return data


def config_from_dict(data: dict, device: str | None = None) -> JetRLConfig:
    """The run config of a mapping of sections, checked and resolved (`rl.resolve.resolve`: every `auto` turned into
    its value; `device`, 'cpu' or 'cuda', is what `run.device: auto` stands for, None: this machine's)."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config is a mapping of sections, got {type(data).__name__}")
    autos = []
    for key, absent_is_auto in BOOL_AUTOS.items():  # bool fields of classes outside rl/: held at false until resolved
        section, name = key.split(".")
        values = data.get(section) or {}
        if isinstance(values, dict) and values.get(name, "auto" if absent_is_auto else False) == "auto":
            data = {**data, section: {**values, name: False}}
            autos.append(key)
    return resolve(_config(data), device, autos=autos)


def _config(data: dict) -> JetRLConfig:
    hints = typing.get_type_hints(JetRLConfig)
    sections = {f.name for f in dataclasses.fields(JetRLConfig)}
    kwargs = {}
    for name, value in data.items():
        if name not in sections:
            raise _unknown(name, sections, "")
        kwargs[name] = _build(hints[name], value if value is not None else {}, f"{name}.")
    try:
        return JetRLConfig(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def config_path(path: str | Path) -> Path:
    """`path` as given where it exists; else, for a relative path, the same file in the project's configs (the
    repository's `configs/`, or the copy an installed package carries), so `configs/models/qwen3-8b-base.yaml` or
    `models/qwen3-8b-base.yaml` resolve from any directory."""
    path = Path(path)
    if path.is_file() or path.is_absolute():
        return path
    inside = Path(*path.parts[1:]) if path.parts and path.parts[0] == "configs" else path
    return next((d / inside for d in _CONFIGS if (d / inside).is_file()), path)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        here = next((d for d in _CONFIGS if d.is_dir()), _CONFIGS[0])
        raise ConfigError(
            f"config file {path} does not exist, in {Path.cwd()} nor in {here} (which holds tiny.yaml, models/ and modes/)"
        )
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) or v is None for v in data.values()):
        raise ConfigError(f"{path} must be a mapping of sections (run:, model:, precision:, ...) to mappings")
    return data


def raw_data(paths: str | Path | list | None = None, overrides: list[str] = ()) -> dict:
    """The mapping of sections that YAML files (default `configs/tiny.yaml`; later files override earlier ones key by
    key, e.g. a model preset then a precision mode) plus overrides give, as written: nothing checked or resolved."""
    if paths is None or paths == []:
        paths = [DEFAULT_CONFIG]
    elif isinstance(paths, (str, Path)):
        paths = [paths]
    data: dict = {}
    for path in paths:
        for section, values in _read_yaml(config_path(path)).items():
            data.setdefault(section, {}).update(values or {})
    return apply_overrides(data, list(overrides))


def load_config(paths: str | Path | list | None = None, overrides: list[str] = (), device: str | None = None) -> JetRLConfig:
    """YAML files plus overrides (`raw_data`) -> a validated, resolved JetRLConfig (`config_from_dict`; `device`:
    what `run.device: auto` stands for, None: this machine's)."""
    return config_from_dict(raw_data(paths, overrides), device)


def sections_help() -> str:
    """Every section and its keys, for `--help` (`python -m megatron_jetrl.rl.config --print` shows their values)."""
    lines = ["config sections and their keys (section.key=value; --print in megatron_jetrl.rl.config shows the values):"]
    for section, cls in typing.get_type_hints(JetRLConfig).items():
        names = [f.name for f in dataclasses.fields(cls)]
        lines.append(
            textwrap.fill(" ".join(names), width=118, initial_indent=f"  {section + ':':<11}", subsequent_indent=" " * 13)
        )
    return "\n".join(lines)


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """`[CONFIG.yaml ...] [section.key=value ...]` -> (config paths, overrides); an `--option` is refused with the
    override it probably means (`--steps 10` -> run.steps=10)."""
    files = []
    for i, arg in enumerate(argv):
        if arg.startswith("-"):
            raise ConfigError(_option_hint(argv, i))
        if "=" in arg:
            return files, list(argv[i:])
        files.append(arg)
    return files, []


def _option_hint(argv: list[str], i: int) -> str:
    name, sep, value = argv[i].lstrip("-").partition("=")
    if not sep and i + 1 < len(argv) and not argv[i + 1].startswith("-") and "=" not in argv[i + 1]:
        value = argv[i + 1]
    value = value or "VALUE"
    if "." in name:
        keys = [name]
    else:
        keys = [
            f"{section}.{g.name}"
            for section, cls in typing.get_type_hints(JetRLConfig).items()
            for g in dataclasses.fields(cls)
            if g.name == name.replace("-", "_")
        ]
    example = " or ".join(f"{k}={value}" for k in keys) if keys else "run.steps=10"
    return (
        f"{argv[i]!r} is not an option: settings are section.key=value overrides after the config files, e.g. {example} "
        "(--help lists the sections; `python -m megatron_jetrl.rl.config --print` shows every key)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Validate a megatron-jetrl GRPO config and print parts of it.",
        epilog=sections_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("args", nargs="*", help="[CONFIG.yaml ...] [section.key=value ...]")
    parser.add_argument(
        "--get",
        help="print one value, e.g. parallel.world_size (also refuses what this machine or the "
        "run directory cannot run: rl/preflight.py)",
    )
    parser.add_argument("--print", action="store_true", help="print the resolved config as YAML")
    argv = sys.argv[1:] if argv is None else argv
    ns, unknown = parser.parse_known_args(argv)
    try:
        if unknown:
            raise ConfigError(_option_hint(argv, argv.index(unknown[0])))
        cfg = load_config(*split_args(ns.args))
        if ns.get:  # the launchers' question before they start the ranks here: can this machine run it?
            from megatron_jetrl.rl.preflight import check

            check(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if ns.get:
        section, _, key = ns.get.partition(".")
        try:
            print(getattr(getattr(cfg, section), key))
        except AttributeError:
            print(f"config error: no value {ns.get!r}", file=sys.stderr)
            return 2
    if ns.print or not ns.get:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    from megatron_jetrl.rl import config  # the imported module: its ConfigError is the one rl/preflight.py raises

    sys.exit(config.main())
