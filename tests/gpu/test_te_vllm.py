"""A TE-trained actor's FP8 bytes in vLLM 0.26.0, on the GPU (tools/gpu/gpu_te.sh vllm: the vLLM kit unpacked, TE installed).

The TE-spec actor of test_te.py (gpu_helpers.ARCH: qwen2-shaped, hidden 512, 2 layers, every GEMM dim a multiple of
128) in `jetrl`, for each scale mode (fp32, ue8m0):

* disk: one optimizer step, `save_checkpoint(spec="te")` + `convert(dtype="fp8")` (as test_te.py's export test); vLLM
  loads that directory with its real weights (`load_format="auto"`; `VllmEngine` pins VLLM_USE_DEEP_GEMM_E8M0 for the
  scale mode through `engine_env`/`pin_environment` before `import vllm`, and checks its kernels and activation
  quantizer at start-up). After vLLM's own post-load processing, every FP8 weight and weight_scale_inv it holds must
  equal TE's bytes (`te_recipe.te_fp8_weights`) byte for byte, every BF16 tensor the checkpoint's;
* sync: a second optimizer step, then the live weight stream (`actor_weight_stream`, the one mapping table) goes
  into the same engine through `update_weights` (the trainer's on-device copy): every FP8 weight and scale in vLLM
  equals TE's new bytes;
* generate: vLLM greedy-generates from those bytes; its sampled-token logprobs against the TE actor's on the same
  tokens (two programs, one flow: reported, loosely bounded as in test_vllm.py).

One scale mode per process. vLLM's environment is read when vLLM is imported and its engine built, and
`pin_environment` refuses a process whose vLLM was imported with the other VLLM_USE_DEEP_GEMM_E8M0 (0 for fp32: no
re-quantization of FP32 scales; 1 for ue8m0); and an in-process (external launcher) vLLM engine holds process-wide
state (distributed groups, compilation config), so a process gets one engine, which serves the disk check first and
then the sync. So `test_scale_mode_in_its_own_process[mode]` re-runs this file in a child pytest with
JETRL_TE_VLLM_SCALE=mode, where the `test_in_process_*` tests run (they skip in the parent); the child's output is
echoed. Each check prints one line starting with `TEVLLM `.

ue8m0 caveat, from vLLM's source (fp8_utils.requant_weight_ue8m0_inplace, run at load with E8M0 on): vLLM
re-quantizes the checkpoint's weights with power-of-two scales, amax floored at 1e-4. For TE's ue8m0 bytes this is
the identity except in a block whose largest |q| is 224 (vLLM then halves the scale and doubles q: same values, other
bytes) or whose amax is below 1e-4; the random init here (std 0.02, amax/s ~ 330) has neither. A failure message
says whether the differing tensors still dequantize to the same values.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gpu_helpers import ARCH, arch, build, dequantized, hf_fp8, logprobs, tokens, vllm_bytes, vllm_tensor

from megatron_jetrl.fp8 import PrecisionFlow

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available()
        or importlib.util.find_spec("vllm") is None
        or importlib.util.find_spec("transformer_engine") is None,
        reason="needs a CUDA GPU, vLLM 0.26.0 (shared/kits/vllm) and Transformer Engine (shared/kits/te)",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
SCALE = os.environ.get("JETRL_TE_VLLM_SCALE")
"""Set in the child process: the scale mode it runs (None in the parent)."""
MODES = {"fp32": 29541, "ue8m0": 29542}  # scale mode -> the child's MASTER_PORT
CHILD_TIMEOUT_S = 420
PROMPTS, PROMPT_LEN, NEW = 8, 32, 16  # 8 x 48 tokens: a multiple of 128 tokens for TE's FP8 GEMMs


# ---- parent: one child process per scale mode -------------------------------------------------------------------


@pytest.mark.parametrize("mode", sorted(MODES))
def test_scale_mode_in_its_own_process(mode, tmp_path):
    if SCALE is not None:
        pytest.skip("this is a child process (it runs the test_in_process_* tests)")
    env = dict(
        os.environ,
        JETRL_TE_VLLM_SCALE=mode,
        MASTER_PORT=str(MODES[mode]),
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-s",
        "-p",
        "no:cacheprovider",
        "-k",
        "in_process",
        "--basetemp",
        str(tmp_path / "child"),
        __file__,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(CHILD_TIMEOUT_S, proc.kill)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:  # echoed as it comes (the TEVLLM lines land in the caller's log)
            print(line, end="", flush=True)
            lines.append(line)
        rc = proc.wait()
    finally:
        timer.cancel()
    tail = "".join(lines[-60:])
    assert rc == 0, f"child pytest for scale mode {mode} exited {rc} (killed after {CHILD_TIMEOUT_S} s if -9):\n{tail}"
    summary = "".join(lines[-5:])
    assert re.search(r"\b3 passed\b", summary) and "skipped" not in summary, f"the child did not run all 3 checks:\n{tail}"


# ---- child: one scale mode, one engine --------------------------------------------------------------------------


def _step(ddp, opt, toks):
    from megatron_jetrl.actor.train_step import train_step

    return train_step(
        ddp, opt, toks, lambda lp, _: (-lp.mean(), {}), vocab_size=ARCH["vocab_size"], micro_batch_size=toks.shape[0]
    )


def _expected(ddp, a, flow):
    """(the live stream's pairs, what vLLM must hold: TE's FP8 bytes and scales from `te_fp8_weights`, BF16 from the
    stream). The stream's FP8 tensors are first checked against TE's bytes (test_te.py checks this too)."""
    from megatron_jetrl.actor.te_recipe import te_fp8_weights
    from megatron_jetrl.actor.weight_stream import actor_weight_stream

    te_bytes = hf_fp8(te_fp8_weights(ddp, flow), a)
    pairs = {name: t.detach().clone() for name, t in actor_weight_stream(ddp, a, flow)}
    for name, t in te_bytes.items():
        got = pairs[name].view(torch.uint8) if t.dtype == torch.uint8 else pairs[name]
        assert torch.equal(got, t), f"the live stream's {name} is not TE's bytes"
    return pairs, {**pairs, **te_bytes}


def _summary(result: dict, want: dict) -> dict:
    """Counts per kind (FP8 weights, scales, BF16 tensors): (equal tensors, tensors), FP8 byte fraction."""
    kinds = {"weight": [], "scale": [], "bf16": []}
    for name, (same, n) in result.items():
        kind = "scale" if name.endswith("weight_scale_inv") else "weight" if want[name].dtype == torch.uint8 else "bf16"
        kinds[kind].append((same, n))
    fp8 = kinds["weight"] + kinds["scale"]
    return {k: (sum(s == n for s, n in v), len(v)) for k, v in kinds.items()} | {
        "fp8_bytes": sum(n for _, n in fp8),
        "fp8_equal": sum(s for s, _ in fp8) / max(1, sum(n for _, n in fp8)),
    }


def _line(what: str, s: dict) -> str:
    return (
        f"FP8 weights {s['weight'][0]}/{s['weight'][1]}, weight_scale_inv {s['scale'][0]}/{s['scale'][1]} byte-equal "
        f"to TE's (te_fp8_weights); FP8 bytes equal {s['fp8_equal']:.6f} of {s['fp8_bytes']}; "
        f"BF16 tensors equal {s['bf16'][0]}/{s['bf16'][1]} to {what}"
    )


def _explain(engine, result: dict, want: dict) -> str:
    """The tensors that differ; for FP8 weights whether vLLM's bytes still dequantize to TE's values."""
    bad = sorted(n for n, (same, total) in result.items() if same != total)
    notes = []
    for name in bad[:12]:
        same, total = result[name]
        note = f"{name}: {total - same} of {total} bytes differ"
        scale = name.removesuffix("weight") + "weight_scale_inv"
        if want[name].dtype == torch.uint8 and scale in want:
            vq, vs = vllm_tensor(engine, name), vllm_tensor(engine, scale)
            if vq.shape == want[name].shape and vs.shape == want[scale].shape:
                same_values = torch.equal(dequantized(vq, vs), dequantized(want[name], want[scale]))
                note += f" (dequantized values {'equal' if same_values else 'DIFFER'})"
        notes.append(note)
    return f"{len(bad)} tensor(s) differ:\n  " + "\n  ".join(notes)


@pytest.fixture(scope="module")
def world(te_ready, tmp_path_factory):
    """The TE actor after one step, its checkpoint converted and loaded by vLLM (load_format=auto); the disk
    comparison is taken at once (the sync test overwrites the engine's weights)."""
    if SCALE not in MODES:
        pytest.skip(f"runs in a child process per scale mode (JETRL_TE_VLLM_SCALE in {sorted(MODES)}; got {SCALE!r})")
    from test_vllm import ENGINE

    from megatron_jetrl.actor.checkpoint import save_checkpoint
    from megatron_jetrl.actor.train_step import OptimConfig, wrap_for_training
    from megatron_jetrl.convert.converter import convert
    from megatron_jetrl.rollout.vllm_engine import VllmEngine

    flow = PrecisionFlow(mode="jetrl", scale_mode=SCALE)
    a = arch()
    ddp, opt = wrap_for_training(build("te", flow), OptimConfig(lr=1e-3))
    _step(ddp, opt, tokens(4))
    _, want = _expected(ddp, a, flow)
    root = tmp_path_factory.mktemp("te_vllm")
    save_checkpoint(ddp, root / "ckpt", hf_config=ARCH, flow=flow, iteration=1, spec="te")
    convert(root / "ckpt", root / "hf", dtype="fp8", rollout_tp=1, force=True)
    t0 = time.perf_counter()
    engine = VllmEngine(
        root / "hf", flow, load_format="auto", **dict(ENGINE, max_model_len=ARCH["max_position_embeddings"], glue="vllm")
    )  # TE's norms, as the session picks
    start_s = time.perf_counter() - t0
    return SimpleNamespace(
        flow=flow, arch=a, ddp=ddp, opt=opt, engine=engine, want1=want, start_s=start_s, disk=vllm_bytes(engine, a, want)
    )


def test_in_process_converted_te_checkpoint_loads_in_vllm_with_tes_bytes(world):
    engine, want, result = world.engine, world.want1, world.disk
    s = _summary(result, want)
    print(
        f"\nTEVLLM disk {SCALE}: vLLM loaded the converter's export (load_format=auto, "
        f"VLLM_USE_DEEP_GEMM_E8M0={os.environ.get('VLLM_USE_DEEP_GEMM_E8M0')}, start {world.start_s:.1f} s, "
        f"kernels {engine.numerics['kernels']}): {_line('the checkpoint', s)}",
        flush=True,
    )
    assert len(result) == len(want), sorted(set(want) - set(result))
    assert all(same == n for same, n in result.values()), _explain(engine, result, want)


def test_in_process_live_sync_puts_tes_new_bytes_in_vllm(world):
    from megatron_jetrl.actor.weight_stream import actor_weight_stream

    engine, a, flow = world.engine, world.arch, world.flow
    _step(world.ddp, world.opt, tokens(5))
    _, want = _expected(world.ddp, a, flow)
    fp8 = [n for n, t in want.items() if t.dtype == torch.uint8]
    moved = sum(int((want[n] != world.want1[n]).sum()) for n in fp8) / sum(want[n].numel() for n in fp8)
    t0 = time.perf_counter()
    stats = engine.update_weights(actor_weight_stream(world.ddp, a, flow))  # the live stream, as the trainer syncs
    torch.cuda.synchronize()
    sync_ms = (time.perf_counter() - t0) * 1e3
    result = vllm_bytes(engine, a, want)
    s = _summary(result, want)
    print(
        f"\nTEVLLM sync {SCALE}: step 2's live stream -> vLLM ({stats['tensors']} tensors, {stats['bytes'] / 2**20:.1f} MiB, "
        f"{sync_ms:.0f} ms; {moved:.4f} of the FP8 weight bytes changed since step 1): "
        f"{_line('the stream', s)}",
        flush=True,
    )
    assert moved > 0.01, "the second step left TE's FP8 bytes (almost) unchanged: the sync check would prove nothing"
    assert len(result) == len(want), sorted(set(want) - set(result))
    assert all(same == n for same, n in result.values()), _explain(engine, result, want)


def test_in_process_vllm_generates_from_tes_bytes(world):
    from megatron_jetrl.rollout.engine import SamplingParams

    engine = world.engine
    if not engine.ready:
        pytest.fail("the engine holds no verified weights (the sync test failed)")
    prompts = tokens(6, batch=PROMPTS, seq=PROMPT_LEN).tolist()
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True))
    comps = [o.completions[0] for o in outs]
    assert [len(c.token_ids) for c in comps] == [NEW] * PROMPTS
    assert all(0 <= t < ARCH["vocab_size"] for c in comps for t in c.token_ids)
    theirs = torch.tensor([c.logprobs for c in comps])
    seqs = torch.tensor([list(o.prompt_token_ids) + list(c.token_ids) for o, c in zip(outs, comps)], device="cuda")
    ours = logprobs(world.ddp, seqs, micro_batch_size=PROMPTS)[:, PROMPT_LEN - 1 :].float().cpu()
    diff = (theirs - ours).abs()
    distinct = len({tuple(c.token_ids) for c in comps})
    print(
        f"\nTEVLLM generate {SCALE}: {PROMPTS} greedy completions x {NEW} tokens ({distinct} distinct); vLLM vs the TE "
        f"actor on the same tokens: mean |dlogp| {diff.mean():.4f}, max {diff.max():.4f}, "
        f"mean logp vLLM {theirs.mean():.3f} actor {ours.mean():.3f}",
        flush=True,
    )
    assert torch.isfinite(theirs).all() and diff.mean() < 0.5
