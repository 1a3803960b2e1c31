"""A short GRPO run with vLLM on the GPU (kit: shared/kits/README.md): two steps of configs/gpu_1p5b.yaml in jetrl with
rollout.engine=vllm (eager), the same command `tools/gpu/gpu_vllm.sh grpo` runs for BENCHMARKS.md. Asserts the run
finished, synced the whole model every step, measured a mismatch of exactly 0 (jetrl's default at TP 1: exact
logprobs; without them 0.135 was measured on an H100), reported the sync's parts, and that the engine's sleep released only
its weights (1.8 GB) and the KV cache a step can use (129 x 1024 tokens x 28 KiB = 3.6 GiB), not half the GPU."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
        reason="needs a CUDA GPU and vLLM 0.26.0 (shared/kits/vllm)",
    ),
]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_grpo_with_vllm_runs_rollout_update_sync(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "megatron_jetrl.rl.train",
        "configs/gpu_1p5b.yaml",
        "rollout.engine=vllm",
        "rollout.enforce_eager=true",
        "run.steps=2",
        "run.checkpoint=false",  # no 24 GB checkpoint at the end
        f"run.out_dir={tmp_path}",
        "run.name=vllm_grpo",
    ]
    env = dict(os.environ, MASTER_PORT="29677", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["sync/bytes"] > 1.7e9  # the whole 1.5B model, FP8 + BF16 rest
        assert r["time/sync"] < 2.0 or r["step"] == 0  # step 0 opens with the first sync (its kernels' first use)
        assert r["mismatch/mean_abs_diff"] == 0 and r["mismatch/max_abs_diff"] == 0 and r["mismatch/tokens"] > 0
        parts = [f"sync/{p}_s" for p in ("empty_cache", "wake_weights", "stream", "validate", "copy", "wake_kv")]
        assert all(r[k] >= 0 for k in parts) and sum(r[k] for k in parts) <= r["sync/seconds"]
        assert 5.0 < r["rollout/sleep_released_gib"] < 6.5
