"""Compile a config's GPU kernels ahead of its run, into the cache its runs read (`run.jit_cache_dir`, `rl.jit_cache`).

    JETRL_TRAIN_MODULE=megatron_jetrl.rl.warm_cache bash launch/train_grpo.sh [CONFIG.yaml ...] [section.key=value ...]
    python -m megatron_jetrl.rl.warm_cache CONFIG.yaml ...   # a one-process config

It runs `WARM_STEPS` GRPO steps of the config -- the vLLM engine's start-up and CUDA-graph capture, rollouts at the
config's lengths, the logprob pass, the update, the weight sync, and all of it again after one sync -- in a temporary
directory beside the run's own (`<run.out_dir>.warm_cache`) that it deletes (no checkpoint, no export, at most one SFT step), then says how many kernels the caches hold.
Responses of a random-init model run to rollout.max_new_tokens, so the largest micro-batches are among those compiled;
a later run whose shapes fall in a class not seen here compiles that kernel once, and says so. On the CPU nothing is
compiled and it says so.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from megatron_jetrl.rl import train
from megatron_jetrl.rl.config import ConfigError, load_config, split_args
from megatron_jetrl.rl.config import main as config_main
from megatron_jetrl.rl.jit_cache import cache_dirs, count_kernels

WARM_STEPS = 2


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if "-h" in args or "--help" in args:
        print(__doc__.strip())
        return 0
    if "--get" in args or "--print" in args:  # launch/train_grpo.sh asks its module how many processes the run needs
        return config_main(args)
    try:
        cfg = load_config(*split_args(args))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    dirs = cache_dirs(cfg.run.jit_cache_dir)
    main_rank = int(os.environ.get("RANK", "0")) == 0
    if cfg.run.device_type() != "cuda":
        if main_rank:
            print("warm_cache: this config runs on the CPU, where nothing is JIT-compiled: nothing to warm")
        return 0
    before, t0 = count_kernels(dirs), time.monotonic()
    scratch = cfg.run.directory.with_name(cfg.run.directory.name + ".warm_cache")  # where the run writes: every rank sees it
    warm = [
        f"run.steps={WARM_STEPS}",
        "run.checkpoint=false",
        "run.export=false",
        "run.eval_every=0",
        "run.resume=auto",
        f"warmup.steps={min(cfg.warmup.steps, 1)}",
        f"run.out_dir={scratch}",
        "run.name=jit_cache",
    ]
    try:
        rc = train.main([*args, *warm])
    finally:
        if main_rank:
            shutil.rmtree(scratch, ignore_errors=True)
    if main_rank and rc == 0:
        after = count_kernels(dirs)
        where = ", ".join(f"{k} {v}" for k, v in dirs.items() if v is not None)
        print(
            f"warm_cache: {after} compiled kernels ({after - before} new, {time.monotonic() - t0:.0f} s) in {where}; runs "
            f"of this config{' with run.jit_cache_dir=' + cfg.run.jit_cache_dir if cfg.run.jit_cache_dir else ''} start warm"
        )
    return rc


if __name__ == "__main__":
    sys.exit(main())
