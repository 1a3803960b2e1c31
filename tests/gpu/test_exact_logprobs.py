"""`precision.exact_logprobs` on the GPU (vLLM 0.26.0 kit: shared/kits/README.md).

The kernels first: FA3 attention gives a row the same bytes whatever the micro-batch's length and neighbours, and its
backward is flash attention's gradient; the exact log-softmax is vLLM's kernel to the bit and its gradient
softmax - onehot. Then GRPO with vLLM at two model shapes (Qwen2-style: QKV bias, tied embeddings; Qwen3-style: QK
norm) and two step kinds (a few decoded tokens after the prompt; hundreds): every sampled token's logprob equals the
actor's bit for bit at every step, so the mismatch's mean, max and k3 KL are exactly 0 and every TIS weight exactly 1.

The GRPO runs start their own processes, where the trainer pins vLLM's environment before vLLM is imported (on one
H100 the file takes about 9 minutes): `python -m pytest -q tests/gpu/test_exact_logprobs.py`, or
`TESTS=tests/gpu/test_exact_logprobs.py bash tools/gpu/gpu_vllm.sh tests` after the vLLM kit.
"""

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


@pytest.fixture(scope="module")
def rk():
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    from megatron_jetrl.actor import rollout_kernels

    return rollout_kernels


def _qkv(b, s, heads=8, groups=2, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16) for h in (heads, groups, groups)]


def test_fa3_rows_do_not_depend_on_the_batch_or_the_padding_after_them(rk):
    q, k, v = _qkv(4, 384)
    full = rk.fa3_causal_attention(q, k, v, 128**-0.5)
    for row, length in ((1, 200), (3, 1), (0, 383)):
        alone = rk.fa3_causal_attention(
            q[row : row + 1, :length], k[row : row + 1, :length], v[row : row + 1, :length], 128**-0.5
        )
        assert torch.equal(alone[0], full[row, :length]), (row, length)


def test_fa3_forward_is_attention_and_its_backward_is_flash_attentions_gradient(rk):
    q, k, v = (t.requires_grad_() for t in _qkv(2, 256, seed=1))
    out = rk.fa3_causal_attention(q, k, v, 128**-0.5)
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    qt, kt, vt = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=128**-0.5, enable_gqa=True)
    rq, rk_, rv = torch.autograd.grad(ref, (qt, kt, vt), grad.double().transpose(1, 2))
    assert (out.double() - ref.transpose(1, 2)).abs().max() < 2e-2
    for mine, want in ((dq, rq), (dk, rk_), (dv, rv)):
        want = want.transpose(1, 2)
        assert (mine.double() - want).norm() / want.norm() < 2e-2


def test_exact_logprobs_are_vllms_sampled_token_logprobs_and_differentiable(rk):
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    from megatron_jetrl.actor.logprobs import exact_logprobs

    vocab, padded = 1000, 1024
    g = torch.Generator(device="cuda").manual_seed(2)
    logits = (torch.randn(3, 50, padded, generator=g, device="cuda") * 4).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (3, 50), generator=g, device="cuda")
    lp = exact_logprobs(logits, targets, vocab)
    want = compute_token_logprobs(logits.detach().reshape(-1, padded)[:, :vocab], targets.reshape(-1, 1)).view(3, 50)
    assert torch.equal(lp, want)
    one = exact_logprobs(logits[1:2, 7:9], targets[1:2, 7:9], vocab)  # a row's value does not depend on its batch
    assert torch.equal(one, lp[1:2, 7:9])
    x = logits.detach().double()[..., :vocab]
    assert (lp.double() - torch.log_softmax(x, -1).gather(-1, targets[..., None])[..., 0]).abs().max() < 1e-4
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    ref = -torch.softmax(x, -1) + torch.nn.functional.one_hot(targets, vocab)
    assert (grad[..., :vocab].double() - ref).abs().max() < 1e-2 and not grad[..., vocab:].any()


@pytest.mark.parametrize("gemm", ["persistent_gemm", "lm_head_gemm"])
def test_rollout_linear_rows_do_not_depend_on_the_number_of_rows(rk, gemm):
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(300, 1536, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 1536, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    full = rk.rollout_linear(x, w, None, getattr(rk, gemm))
    for rows in (slice(0, 1), slice(7, 8), slice(100, 229)):
        assert torch.equal(rk.rollout_linear(x[rows], w, None, getattr(rk, gemm)), full[rows])
    ref = x[:16].double() @ w.double().t()
    assert ((full[:16].double() - ref).abs().max() / ref.abs().max()) < 1e-2


QWEN2 = ["configs/gpu_1p5b.yaml", "model.hf_config.num_hidden_layers=4"]  # QKV bias, tied embeddings
QWEN3 = ["configs/gpu_8b_shapes.yaml", "model.hf_config.num_hidden_layers=2"]  # QK norm


@pytest.mark.parametrize(
    "shape,new_tokens,eager", [("qwen2", 6, True), ("qwen2", 320, True), ("qwen3", 6, False), ("qwen3", 320, False)]
)
def test_grpo_with_vllm_has_mismatch_exactly_zero_at_every_step(tmp_path, shape, new_tokens, eager):
    """Eager engines and full decode CUDA graphs (one KV split in both)."""
    base = QWEN2 if shape == "qwen2" else QWEN3
    cmd = [
        sys.executable,
        "-m",
        "megatron_jetrl.rl.train",
        *base,
        "precision.mode=jetrl",
        "precision.exact_logprobs=true",
        "rollout.engine=vllm",
        f"rollout.enforce_eager={str(eager).lower()}",
        f"rollout.max_new_tokens={new_tokens}",
        "run.steps=3",
        "run.checkpoint=false",
        "grpo.prompts_per_step=8",
        "grpo.micro_batch_size=32",
        "loss.tis_cap=2.0",
        f"run.out_dir={tmp_path}",
        "run.name=exact",
    ]
    env = dict(
        os.environ,
        MASTER_PORT=os.environ.get("EXACT_TEST_PORT", "29679"),
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["mismatch/tokens"] > 0
        got = {
            k: r[f"mismatch/{k}"]
            for k in ("mean_abs_diff", "max_abs_diff", "k3_kl", "ratio_min", "ratio_max", "tis_weight_mean", "tis_weight_std")
        }
        assert got == {
            "mean_abs_diff": 0.0,
            "max_abs_diff": 0.0,
            "k3_kl": 0.0,
            "ratio_min": 1.0,
            "ratio_max": 1.0,
            "tis_weight_mean": 1.0,
            "tis_weight_std": 0.0,
        }, (r["step"], got)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (trainer TP 2 and rollout TP 2, or PP 2)")
@pytest.mark.parametrize("layout", [["parallel.tp=2", "rollout.tp=2"], ["parallel.pp=2", "rollout.tp=1"]], ids=["tp2", "pp2"])
def test_grpo_on_two_gpus_has_mismatch_exactly_zero(tmp_path, layout):
    """Trainer TP 2 and rollout TP 2: both sides add two BF16 partial outputs per row-parallel linear, an order-free
    sum, so NCCL keeps its default settings on both. PP 2: each stage runs its layers with the engine's kernels and
    passes BF16 activations on unchanged; every rank's engine holds the whole model at TP 1."""
    cmd = [
        "bash",
        "launch/train_grpo.sh",
        *QWEN3,
        *layout,
        "rollout.engine=vllm",
        "precision.exact_logprobs=true",
        "rollout.max_new_tokens=128",
        "run.steps=3",
        "run.checkpoint=false",
        "grpo.prompts_per_step=8",
        "grpo.micro_batch_size=32",
        "loss.tis_cap=2.0",
        f"run.out_dir={tmp_path}",
        "run.name=two_gpus",
    ]
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["mismatch/tokens"] > 0 and r["mismatch/max_abs_diff"] == 0.0 and r["mismatch/k3_kl"] == 0.0, r["step"]


LONG = [
    *QWEN3,
    "model.hf_config.max_position_embeddings=4096",
    "rollout.max_new_tokens=2048",
    "rollout.max_model_len=2112",
    "rollout.enforce_eager=false",
    "grpo.prompts_per_step=4",
    "grpo.micro_batch_size=4",
    "grpo.logprob_micro_batch_size=8",
]


@pytest.mark.parametrize("kv_cache_gb,fit", [(0.0, 32), (0.22, 12)], ids=["all-at-once", "in-turns"])
def test_long_responses_have_mismatch_exactly_zero_and_sync_the_trainers_bytes(tmp_path, kv_cache_gb, fit):
    """2048-token responses, 32 a step (4 prompts x 8). With a KV cache for 12 of them at their full 2112 tokens (2 layers
    x 8 KiB a token, slabs of 2,304 tokens: 0.22 GiB), vLLM preempts sequences as the cache fills and recomputes them
    later: a resumed sequence's logprobs are still the actor's bit for bit. Every sync ships every tensor the engine
    holds."""
    from megatron_jetrl.rl.config import load_config, split_args
    from megatron_jetrl.rollout.native import expected_tensors

    args = [
        *LONG,
        "precision.mode=jetrl",
        "precision.exact_logprobs=true",
        "rollout.engine=vllm",
        f"rollout.kv_cache_gb={kv_cache_gb}",
        "run.steps=2",
        "run.checkpoint=false",
        "loss.tis_cap=2.0",
    ]
    cfg = load_config(*split_args(args))
    want = sum(
        torch.Size(shape).numel() * dtype.itemsize for shape, dtype in expected_tensors(cfg.arch(), cfg.precision).values()
    )
    cmd = [sys.executable, "-m", "megatron_jetrl.rl.train", *args, f"run.out_dir={tmp_path}", "run.name=long"]
    env = dict(
        os.environ,
        MASTER_PORT=os.environ.get("EXACT_TEST_PORT", "29679"),
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    assert ("holds 12 of the 32 sequences" in done.stderr) == (fit < 32), done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["response_length/mean"] > 1024 and r["mismatch/tokens"] > 32 * 1024, r["step"]
        assert r["mismatch/mean_abs_diff"] == r["mismatch/max_abs_diff"] == r["mismatch/k3_kl"] == 0.0, r["step"]
        assert r["sync/bytes"] == want, (r["sync/bytes"], want)
        assert r["rollout/fit_at_once"] == fit
        assert (r["rollout/preemptions"] > 0) == (fit < 32), r["rollout/preemptions"]
