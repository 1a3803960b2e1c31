#!/usr/bin/env python3
"""What each FP8 KV scale policy does to the logprobs, against BF16 attention on the same weights, step by step.

    source /tmp/vllm-site/env.sh && PYTHONPATH=/tmp/mcore:. python3 tools/bench/bench_kv_scales.py \
        [--layers 8] [--seq 2048] [--rows 8] [--steps 4] [--lr 1e-6] [--json PATH]

The actor is the one a jetrl run with exact logprobs and `precision.kv_cache: fp8` trains (`tools/bench/bench_actor.py`'s
`StepRun`: the Qwen3-8B preset's layer shapes at `--layers` layers, random init, megatron's optimizer, the preset's
GRPO loss), over `--rows` random sequences of `--seq` tokens whose last three quarters count as the response. Every
step, for each policy the trainer can run (`precision.kv_scales`: amax, running_max, fixed; plus `one`, the scale 1.0
that vLLM assumes for a checkpoint without scales and that a run's step 0 uses):

1. its scales go into every layer's attention (`rl.kv_scales.apply`), and one logprob pass over the rows runs FA3's FP8
   attention at them; the pass records each layer's amax, from which the policy decides its next scales
   (`rl.kv_scales.decide`), as a run's sync does from the step's forwards;
2. the same pass with FA3's BF16 attention on the same weights is the reference: the policy's mismatch against it is
   `rollout.metrics.mismatch_metrics` of the two (mean and max |dlogp|, k3 KL), what the FP8 cache changes in the
   model's logprobs (the rollout and the trainer agree on them exactly either way);
3. `clipped`: the share of (layer, q/k/v) whose amax in this pass exceeded 448 x the scale in use, and `overshoot`, the
   largest amax / (448 x scale) - 1 (elements past 448 x scale are clipped to it: by at most this fraction).

Then one GRPO update at running_max's scales (the default under exact logprobs) moves the weights, at the preset's
learning rate unless `--lr` is given (a larger one shows how each policy follows activations that grow).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

POLICIES = ("one", "amax", "running_max", "fixed")


def layer_amax(cores: dict) -> torch.Tensor:
    """`[layers, 3]` FP32 on the CPU: the amax every attention module saw since its scales were applied."""
    out = torch.zeros(max(cores) + 1, 3)
    for index, core in cores.items():
        out[index] = core.kv_amax.float().cpu()
    return out


def compare(lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> dict:
    from megatron_jetrl.rollout.metrics import mismatch_metrics

    m = mismatch_metrics(lp.float().cpu(), ref.float().cpu(), mask.bool().cpu())
    return {k: m[k] for k in ("mean_abs_diff", "max_abs_diff", "k3_kl")}


def run(a) -> dict:
    from megatron_jetrl.actor.logprobs import response_start
    from megatron_jetrl.actor.parallel import destroy_parallel
    from megatron_jetrl.rl import kv_scales
    from tools.bench.bench_actor import DEFAULT_PRESET, StepRun, load_preset, make_batch, one_rank

    device = torch.device("cuda", torch.cuda.current_device())
    overrides = ["rollout.engine=vllm", "precision.exact_logprobs=true", "precision.kv_cache=fp8"]
    overrides += ["precision.kv_scales=running_max", *([f"optim.lr={a.lr}"] if a.lr is not None else [])]
    cfg = load_preset("jetrl", DEFAULT_PRESET, overrides)
    arch = one_rank(cfg.arch(), a.seq)
    model = StepRun("jetrl+kv_cache=fp8", cfg, arch, a.layers, device)
    cores = kv_scales.attention_modules(model.ddp)
    tokens, mask, adv = make_batch(arch.vocab_size, a.rows, a.seq, device)
    mb = a.micro_batch
    states = {p: kv_scales.KvScaleState.start(a.layers) for p in POLICIES}
    out = {
        "device": torch.cuda.get_device_name(device),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": vars(a),
        "lr": cfg.optim.lr,
        "steps": [],
    }
    print(f"{out['device']}: {a.layers} Qwen3-8B layers, {a.rows} x {a.seq} tokens, lr {cfg.optim.lr:g}", flush=True)
    print(
        "| step | policy | k scale (min..max) | mean \\|dlogp\\| vs BF16 attention | max \\|dlogp\\| | k3 KL | clipped | overshoot |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for step in range(a.steps):
        with torch.no_grad():
            for core in cores.values():
                core.kv_fp8 = False
            ref = model.logprobs(tokens, mb)
            for core in cores.values():
                core.kv_fp8 = True
            rows, seen = {}, {}
            for p in POLICIES:
                kv_scales.apply(model.ddp, states[p])
                lp = model.logprobs(tokens, mb)
                seen[p] = layer_amax(cores)
                scales = states[p].scales
                row = compare(lp, ref, mask)
                ratio = seen[p] / (scales * kv_scales.E4M3_MAX)
                row["clipped"], row["overshoot"] = float((ratio > 1).float().mean()), max(float(ratio.max()) - 1, 0.0)
                row["k_scale_min"], row["k_scale_max"] = float(scales[:, 1].min()), float(scales[:, 1].max())
                rows[p] = row
                print(
                    f"| {step} | {p} | {row['k_scale_min']:.3g}..{row['k_scale_max']:.3g} | {row['mean_abs_diff']:.4g} | "
                    f"{row['max_abs_diff']:.4g} | {row['k3_kl']:.3g} | {row['clipped']:.0%} | {row['overshoot']:.2%} |",
                    flush=True,
                )
        out["steps"].append({"step": step, "policies": rows})
        kv_scales.apply(model.ddp, states["running_max"])
        extras = {"old": ref, "adv": adv, "mask": mask, "rollout": ref, "ref": ref, "first": response_start(mask)}
        result = model.step(tokens, extras, mb)
        out["steps"][-1]["update"] = {k: result.get(k) for k in ("loss", "grad_norm", "ok")}
        for p in POLICIES:
            if p != "one":
                states[p] = kv_scales.decide(p, seen[p], states[p])
    model.close()
    destroy_parallel()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--rows", type=int, default=8, help="sequences per step")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=None, help="the update's learning rate (default: the preset's)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if min(a.layers, a.seq, a.rows, a.micro_batch, a.steps) < 1 or a.rows % a.micro_batch:
        p.error("--layers, --seq, --rows, --micro-batch and --steps must be positive, --rows a multiple of --micro-batch")
    if not torch.cuda.is_available():
        print("error: bench_kv_scales needs a CUDA GPU and the vLLM kit (FA3's FP8 attention)", file=sys.stderr)
        return 2
    out = run(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
