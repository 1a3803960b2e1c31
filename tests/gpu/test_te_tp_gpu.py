"""The TE layer spec at TP2 on 2 GPUs (tools/gpu/gpu_te.sh tp): `torchrun --nproc-per-node=2 tests/gpu/te_tp_run.py`.

Per scale mode of jetrl (fp32, ue8m0), on one TP2 group, test_te.py's model and data:
* TE spec vs local spec from the same init, one train step each: logprobs before and after, loss and grad norm
  within test_te.py's jetrl BOUNDS (the TP1 bound of the same comparison), and both TP ranks report the same numbers;
* the TE export at TP2 (the live weight stream: TE's shard bytes gathered over TP) equals, byte for byte, TE's
  quantizer applied to the full TP1 tensors (shards gathered and fused into megatron's TP1 layout): every FP8
  weight and weight_scale_inv, on each rank.
Skipped without 2 GPUs, Transformer Engine or megatron-core. `JETRL_TE_TP_JSON=path` checks an existing `--json`
output instead of running. The tool prints `TETP ...` lines (echoed here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_te import BOUNDS

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
MODES = ("fp32", "ue8m0")
FP8_TENSORS = 7 * 2  # q, k, v, o, gate, up, down per layer; gpu_helpers.ARCH has 2 layers


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    given = os.environ.get("JETRL_TE_TP_JSON")
    if given:
        return {r["mode"]: r for r in json.loads(Path(given).read_text())["rows"]}
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    try:
        import megatron.core  # noqa: F401
    except Exception:  # noqa: BLE001
        pytest.skip("megatron-core is not importable")
    from megatron_jetrl.fp8 import te as te_mod

    if not te_mod.te_installed():
        pytest.skip(te_mod.INSTALL_HINT)
    out = tmp_path_factory.mktemp("te_tp") / "te_tp.json"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        NCCL_NVLS_ENABLE="0",
        CUDA_DEVICE_MAX_CONNECTIONS="1",
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-port=29535",
        str(REPO / "tests" / "gpu" / "te_tp_run.py"),
        "--modes",
        *MODES,
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    for line in proc.stdout.splitlines():
        if line.startswith("TETP "):
            print(line, flush=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return {r["mode"]: r for r in json.loads(out.read_text())["rows"]}


@pytest.mark.parametrize("mode", MODES)
def test_te_tp2_train_step_matches_local_spec(rows, mode):
    r = rows[mode]
    mean_lp, max_lp, rel_loss, rel_norm = BOUNDS["jetrl"]
    assert r["ok"], r
    assert r["ranks_agree"], "the two TP ranks report different losses, grad norms or logprob differences"
    for when in ("before", "after"):
        assert r[when]["mean"] <= mean_lp and r[when]["max"] <= max_lp, (when, r[when])
    assert r["loss_rel"] <= rel_loss, (r["loss_local"], r["loss_te"])
    assert r["grad_norm_rel"] <= rel_norm, (r["grad_norm_local"], r["grad_norm_te"])


@pytest.mark.parametrize("mode", MODES)
def test_te_tp2_export_equals_tes_full_tp1_tensors(rows, mode):
    for rank, e in enumerate(rows[mode]["export_by_rank"]):
        assert e["weights"] == [FP8_TENSORS, FP8_TENSORS] and e["scales"] == [FP8_TENSORS, FP8_TENSORS], (rank, e["differ"][:8])
        assert e["bytes_equal"] == e["bytes"] > 0, (rank, e["fraction"])
