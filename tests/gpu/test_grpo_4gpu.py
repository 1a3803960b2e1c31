"""GRPO with colocated vLLM on 4 GPUs of one host (skipped below 4): trainer TP 4 with rollout TP 4, and TP 2 x PP 2
with rollout TP 2, two steps each in jetrl at Qwen3-8B layer shapes (configs/gpu_8b_shapes.yaml, 8 layers).

Every rank's engine compares its weights with the bytes it was sent after every sync, the first included
(rollout/vllm_engine.py), and refuses to go on otherwise: a run that ends is a run whose every rank received the
trainer's FP8 bytes at every sync. Under PP 2 each engine holds the whole model, so its first stage's ranks received
the second stage's layers over the pipeline broadcast (actor/weight_stream.py). The mismatch is checked against the
FP8 floor's scale, the sync against the model's size.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 4 or importlib.util.find_spec("vllm") is None,
                                 reason="needs 4 CUDA GPUs of one host and vLLM 0.26.0 (shared/kits/vllm)")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP8_BYTES_8_LAYERS = 8 * 193e6 + 2 * 151936 * 4096 * 2  # the layers' FP8 linears and the BF16 embedding and lm_head


@pytest.mark.parametrize("layout", [["parallel.tp=4", "rollout.tp=4"], ["parallel.tp=2", "parallel.pp=2", "rollout.tp=2"]],
                         ids=["tp4", "tp2xpp2"])
def test_two_grpo_steps_sync_the_trainers_bytes_to_every_rank(tmp_path, layout):
    cmd = ["bash", "launch/train_grpo.sh", "configs/gpu_8b_shapes.yaml", *layout, "rollout.engine=vllm", "run.steps=2",
           "rollout.max_new_tokens=128", "grpo.prompts_per_step=16", "grpo.micro_batch_size=16", f"run.out_dir={tmp_path}",
           "run.name=grpo_4gpu"]
    env = dict(os.environ, PYTHON=sys.executable, NCCL_NVLS_ENABLE="0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["sync/bytes"] > 0.9 * FP8_BYTES_8_LAYERS, r["sync/bytes"]
        assert all(r[f"sync/{part}_s"] >= 0 for part in ("stream", "validate", "copy"))
        assert 0 < r["mismatch/mean_abs_diff"] < 0.3 and r["mismatch/tokens"] > 0
        assert r["tp"] * r["pp"] == 4 and r["rollout_tp"] == r["tp"]
