"""A stand-in for `python -m megatron_jetrl.rl.train` and `python -m megatron_jetrl.rl.config`, for launcher tests.

Same command line as the trainer: `[CONFIG.yaml] [section.key=value ...]` (values YAML-parsed, later ones win),
plus `--get KEY` to print one resolved value (as the config module does for `parallel.world_size`).

Under torchrun (RANK/WORLD_SIZE set) it joins torch.distributed with gloo through the env:// rendezvous,
checks WORLD_SIZE against tp*pp (dp = WORLD_SIZE / (tp*pp)) and all-reduces the ranks. Without torchrun it
runs as a single process (dp = parallel.dp). Rank 0 then writes what the trainer writes in `run.out_dir`
(default runs/<run.name>): metrics.jsonl + tb/ (through megatron_jetrl.rl.metrics), checkpoints/step_XXXXXX/,
export/ (a real HF FP8 checkpoint, made by the project's converter from a tiny random actor checkpoint at the
run's TP), summary.json and config.yaml. Step times are synthetic and deterministic (FP8 modes faster, larger
TP slower), so sweep reports look plausible.

Every rank writes `<out_dir>/stub_rank<R>.json`: its argv and distributed environment, for tests.

Stub-only keys (section `stub`):
  stub.exit_code=N      exit with N (default 0; after writing nothing)
  stub.fail_rank=R      only rank R exits with stub.exit_code (default: every rank)
  stub.fail_mode=MODE   only fail when precision.mode == MODE
  stub.export=false     skip the checkpoint + FP8 export (faster)
  stub.tensorboard=false  no tb/ (no torch import in single-process runs)
  stub.max_tp=N         refuse parallel.tp > N as the config module refuses a TP the model cannot be split into
  stub.sleep=S          every rank sleeps S seconds after recording itself (to test signals)
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULTS = {
    "run": {"name": "tiny", "out_dir": None, "seed": 0, "steps": 3, "save_every": 0},
    "model": {"family": "qwen3", "hidden_size": 256, "num_layers": 2},
    "precision": {"mode": "jetrl"},
    "parallel": {"tp": 1, "pp": 1, "dp": 1},
    "data": {"task": "arithmetic"},
    "rollout": {"group_size": 4, "max_new_tokens": 16},
    "grpo": {"clip": 0.2, "kl_coef": 0.0},
    "optim": {"lr": 1e-5},
    "warmup": {"steps": 0},
    "stub": {
        "exit_code": 0,
        "fail_rank": None,
        "fail_mode": None,
        "export": True,
        "tensorboard": True,
        "max_tp": None,
        "sleep": 0,
    },
}
MODES = ("bf16", "bf16-train-fp8-rollout", "jetrl")


def usage_error(msg: str) -> SystemExit:
    print(f"stub_train: error: {msg}", file=sys.stderr)
    return SystemExit(2)


def parse_args(argv: list[str]) -> tuple[dict, str | None]:
    get = None
    rest = []
    i = 0
    while i < len(argv):
        if argv[i] == "--get":
            if i + 1 >= len(argv):
                raise usage_error("--get needs a KEY")
            get = argv[i + 1]
            i += 2
            continue
        rest.append(argv[i])
        i += 1
    config = copy.deepcopy(DEFAULTS)
    if rest and "=" not in rest[0]:
        path = Path(rest.pop(0))
        if not path.is_file():
            raise usage_error(f"config file {path} not found")
        loaded = yaml.safe_load(path.read_text()) or {}
        for section, values in loaded.items():
            config.setdefault(section, {}).update(values or {})
    for item in rest:
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or not section or not name:
            raise usage_error(f"override {item!r} is not section.key=value")
        if section not in config:
            raise usage_error(f"unknown config section {section!r} in {item!r} (sections: {', '.join(config)})")
        try:
            config[section][name] = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            config[section][name] = value
    if config["precision"]["mode"] not in MODES:
        raise usage_error(f"precision.mode {config['precision']['mode']!r} is not one of {MODES}")
    par = config["parallel"]
    max_tp = config["stub"]["max_tp"]
    if max_tp is not None and int(par["tp"]) > int(max_tp):
        raise usage_error(f"parallel.tp={par['tp']}: TP={par['tp']} does not divide num_key_value_heads={max_tp}")
    par["world_size"] = int(par["tp"]) * int(par["pp"]) * int(par["dp"])
    if config["run"]["out_dir"] in (None, ""):
        config["run"]["out_dir"] = f"runs/{config['run']['name']}"
    return config, get


def lookup(config: dict, key: str):
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise usage_error(f"unknown key {key!r}")
        node = node[part]
    return node


def synthetic_row(step: int, steps: int, mode: str, tp: int, pp: int, dp: int) -> dict:
    fp8_rollout = mode != "bf16"
    fp8_train = mode == "jetrl"
    comm = 1.0 + 0.15 * (tp - 1)
    rollout = 1.0 * (0.8 if fp8_rollout else 1.0) * comm / tp**0.5
    evaluation = 0.3 * (0.7 if fp8_train else 1.0) * comm / tp**0.5
    update = 0.8 * (0.65 if fp8_train else 1.0) * comm / tp**0.5
    sync = 0.05 * (1.2 if fp8_rollout else 1.0)
    warm = 2.0 if step == 1 else 1.0
    rollout, evaluation, update = rollout * warm, evaluation * warm, update * warm
    total = rollout + evaluation + update + sync
    mismatch = {"bf16": 0.002, "bf16-train-fp8-rollout": 0.05, "jetrl": 0.002}[mode]
    frac = step / max(steps, 1)
    return {
        "step": step,
        "reward/mean": round(0.2 + 0.5 * frac, 6),
        "reward/std": 0.3,
        "response_length/mean": round(16.0 - 4.0 * frac, 6),
        "mismatch/mean_abs_diff": mismatch,
        "mismatch/k3_kl": mismatch**2 / 2,
        "mismatch/max_abs_diff": mismatch * 10,
        "loss/pg": -0.01 * step,
        "loss/kl": 0.001,
        "grad_norm": 0.5,
        "time/rollout": rollout,
        "time/eval": evaluation,
        "time/update": update,
        "time/sync": sync,
        "time/step": total,
        "throughput/tokens_per_s": 64 * 14 / total,
        "mode": mode,
        "tp": tp,
        "pp": pp,
        "dp": dp,
    }


def export_checkpoint(out: Path, step: int, tp: int, pp: int, mode: str) -> None:
    from megatron_jetrl.convert import convert
    from megatron_jetrl.convert.synthetic import save_synthetic_checkpoint, tiny_config
    from megatron_jetrl.fp8 import PrecisionFlow

    ckpt = out / "checkpoints" / f"step_{step:06d}"
    flow = PrecisionFlow(mode="jetrl" if mode == "bf16" else mode)
    save_synthetic_checkpoint(ckpt, tiny_config(), tp=tp, pp=pp, flow=flow, iteration=step)
    convert(ckpt, out / "export", dtype="fp8", rollout_tp=1, force=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        config, get = parse_args(argv)
        if get is not None:
            value = lookup(config, get)
            print(json.dumps(value) if isinstance(value, (dict, list)) else value)
            return 0
    except SystemExit as e:
        return int(e.code)

    run, par, stub = config["run"], config["parallel"], config["stub"]
    tp, pp = int(par["tp"]), int(par["pp"])
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", par["world_size"]))
    if world % (tp * pp):
        print(f"stub_train: error: WORLD_SIZE={world} is not a multiple of tp*pp={tp * pp}", file=sys.stderr)
        return 2
    dp = world // (tp * pp) if distributed else int(par["dp"])
    out = Path(run["out_dir"])
    out.mkdir(parents=True, exist_ok=True)

    if distributed:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        x = torch.ones(1)
        dist.all_reduce(x)
        assert int(x.item()) == world, (x, world)

    (out / f"stub_rank{rank}.json").write_text(
        json.dumps(
            {
                "argv": argv,
                "rank": rank,
                "world_size": world,
                "pid": os.getpid(),
                "env": {
                    k: os.environ.get(k)
                    for k in (
                        "RANK",
                        "LOCAL_RANK",
                        "WORLD_SIZE",
                        "LOCAL_WORLD_SIZE",
                        "MASTER_ADDR",
                        "MASTER_PORT",
                        "OMP_NUM_THREADS",
                        "OMP_WAIT_POLICY",
                        "TORCHELASTIC_RUN_ID",
                        "PYTHONPATH",
                        "JETRL_EXIT_DIR",
                    )
                },
                "cwd": os.getcwd(),
            },
            indent=1,
        )
    )

    if stub["sleep"]:
        time.sleep(float(stub["sleep"]))
    code = int(stub["exit_code"] or 0)
    if (
        code
        and (stub["fail_rank"] is None or int(stub["fail_rank"]) == rank)
        and (stub["fail_mode"] in (None, "") or stub["fail_mode"] == config["precision"]["mode"])
    ):
        print(f"stub_train: rank {rank} exits with {code} as asked (stub.exit_code)", file=sys.stderr)
        sys.stdout.flush()
        os._exit(code)  # no distributed teardown: a crashing rank

    if rank == 0:
        from megatron_jetrl.rl.metrics import MetricsWriter, format_summary, read_metrics, summarize

        steps, mode = int(run["steps"]), config["precision"]["mode"]
        with MetricsWriter(out, tensorboard=bool(stub["tensorboard"])) as writer:
            for step in range(1, steps + 1):
                writer.write(synthetic_row(step, steps, mode, tp, pp, dp))
        if stub["export"]:
            export_checkpoint(out, steps, tp, pp, mode)
        (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        rows = read_metrics(out)
        (out / "summary.json").write_text(json.dumps(summarize(rows), indent=1))
        print(format_summary(rows))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
