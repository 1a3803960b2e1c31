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


def _engine_fp8_attention(rk, q, k, v, scales, lengths, queries, page=16):
    """What vLLM computes over an FP8 KV cache: Q by its quantizer, K/V written to a paged cache (blocks shuffled) by its
    cache op, FA3 through the patched launch; `queries[i]` = (first, count) of sequence i's query positions."""
    from vllm import _custom_ops as ops

    from megatron_jetrl.patching import load_patch

    load_patch("vllm_0_26_0_fp8_attention_tile").apply()
    from vllm.v1.attention.backends import flash_attn as backend

    heads, groups, d = q.shape[-2], k.shape[-2], q.shape[-1]
    pages = [-(-n // page) for n in lengths]
    order = torch.randperm(sum(pages) + 2, generator=torch.Generator().manual_seed(0))
    cache = torch.zeros(sum(pages) + 2, page, groups, 2 * d, dtype=torch.uint8, device="cuda")
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32, device="cuda")
    slots, at = [], 0
    for i, (n, p) in enumerate(zip(lengths, pages)):
        blocks = order[at : at + p]
        at += p
        table[i, :p] = blocks.to("cuda", torch.int32)
        t = torch.arange(n)
        slots.append(blocks[t // page] * page + t % page)
    kc, vc = cache[..., :d], cache[..., d:]
    flat = [torch.cat([x[i, :n] for i, n in enumerate(lengths)]) for x in (k, v)]
    ops.reshape_and_cache_flash(*flat, kc, vc, torch.cat(slots).to("cuda"), "fp8", scales[1:2], scales[2:3])
    qs = torch.cat([q[i, a : a + c] for i, (a, c) in enumerate(queries)])
    q8, _ = ops.scaled_fp8_quant(qs.reshape(len(qs), -1), scales[0:1])
    counts = [c for _, c in queries]
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    used = torch.tensor([a + c for a, c in queries], dtype=torch.int32, device="cuda")
    descale = [scales[i : i + 1].expand(len(lengths), groups) for i in range(3)]
    out = backend.flash_attn_varlen_func(
        q=q8.view(-1, heads, d), k=kc.view(torch.float8_e4m3fn), v=vc.view(torch.float8_e4m3fn), max_seqlen_q=max(counts),
        cu_seqlens_q=cu, max_seqlen_k=int(used.max()), seqused_k=used, block_table=table, softmax_scale=d**-0.5,
        causal=True, fa_version=3, num_splits=1, q_descale=descale[0], k_descale=descale[1], v_descale=descale[2],
    )  # fmt: skip
    return out.split(counts)


def test_fp8_attention_is_vllms_over_its_fp8_cache_on_prefill_chunks_and_decode(rk):
    """The actor's FP8 attention over whole rows against vLLM's over its paged FP8 cache, bit for bit: a prefill of the
    whole sequence, a chunk after a prefix in the cache, a decode batch (one query a sequence) and a decode beside a
    prefill; Qwen3-8B (32/8 heads) and Qwen2-1.5B (12/2) head ratios; scales that saturate some elements too."""
    for heads, groups in ((32, 8), (12, 2)):
        b, s = 3, 1100
        q, k, v = _qkv(b, s, heads, groups, seed=4)
        q, k = q * 3, k * 2
        for scales in (torch.stack([t.abs().amax() / 448 for t in (q, k, v)]).float(), torch.tensor([0.004, 0.002, 0.001])):
            scales = scales.cuda()
            want = rk.fa3_fp8_causal_attention(q, k, v, scales, 128**-0.5)
            lengths = [s, 700, 1024]
            for name, queries in {
                "prefill": [(0, n) for n in lengths],
                "chunk": [(512, n - 512) for n in lengths],
                "decode": [(n - 1, 1) for n in lengths],
                "decode beside a prefill": [(0, 40), (699, 1), (900, 1)],
                "early decode": [(16, 1), (3, 1), (200, 1)],
            }.items():
                got = _engine_fp8_attention(rk, q, k, v, scales, lengths, queries)
                for i, (a, c) in enumerate(queries):
                    assert torch.equal(got[i], want[i, a : a + c]), (heads, name, i, scales.tolist())
        alone = rk.fa3_fp8_causal_attention(q[1:2, :700], k[1:2, :700], v[1:2, :700], scales, 128**-0.5)
        assert torch.equal(alone[0], want[1, :700])  # a row's bytes do not depend on its batch or the padding after it


def test_the_actors_fp8_q_k_v_are_vllms_quantizers_bytes(rk):
    """Q by vLLM's query quantizer (x times the scale's reciprocal), K and V by its cache write (x divided by the scale),
    at scales that are not powers of two and with elements that saturate."""
    from vllm import _custom_ops as ops

    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(1, 4096, 64, 128, generator=g, device="cuda").bfloat16() * 5
    for value in (0.0123, 0.0371, 0.00291, 0.7, 0.0513):
        scales = torch.full((3,), value, device="cuda")
        q8, k8, _ = rk.fp8_qkv(x, x[..., :8, :], x[..., :8, :], scales)
        vllm_q8 = ops.scaled_fp8_quant(x.reshape(4096, -1), scales[:1])[0]
        assert torch.equal(q8.view(torch.uint8).flatten(), vllm_q8.view(torch.uint8).flatten())
        divided = (x.float() / scales[0]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(k8.view(torch.uint8), divided[..., :8, :])


def test_fp8_attention_backward_is_the_bf16_gradient_at_the_dequantized_inputs(rk):
    q, k, v = (t.requires_grad_() for t in _qkv(2, 512, 32, 8, seed=5))
    scales = torch.stack([t.detach().abs().amax() / 448 for t in (q, k, v)]).float()
    out = rk.fa3_fp8_causal_attention(q, k, v, scales, 128**-0.5)
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    deq = [(t.float() * scales[i]).double() for i, t in enumerate(rk.fp8_qkv(q.detach(), k.detach(), v.detach(), scales))]
    qt, kt, vt = (t.transpose(1, 2).requires_grad_() for t in deq)
    ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=128**-0.5, enable_gqa=True)
    rq, rk_, rv = torch.autograd.grad(ref, (qt, kt, vt), grad.double().transpose(1, 2))
    assert (out.double() - ref.transpose(1, 2)).norm() / ref.norm() < 3e-2  # FP8 probabilities in the P @ V product
    for mine, want in ((dq, rq), (dk, rk_), (dv, rv)):
        want = want.transpose(1, 2)
        assert (mine.double() - want).norm() / want.norm() < 2e-2
    exact = torch.nn.functional.scaled_dot_product_attention(
        *(t.detach().double().transpose(1, 2) for t in (q, k, v)), is_causal=True, scale=128**-0.5, enable_gqa=True
    )
    assert (out.double() - exact.transpose(1, 2)).norm() / exact.norm() < 8e-2  # against BF16 attention: FP8's error


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


def _train(cmd: list[str], out_dir) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """A training run in its own process (it pins vLLM's environment before importing it): the finished process and
    its metrics rows."""
    env = dict(
        os.environ,
        MASTER_PORT=os.environ.get("EXACT_TEST_PORT", "29679"),
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    return done, [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


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
    _, rows = _train(cmd, tmp_path)
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


@pytest.mark.parametrize("shape,kv", [("qwen2", "bf16"), ("qwen3", "bf16"), ("qwen3", "fp8")])
def test_grpo_with_layer_graphs_has_mismatch_exactly_zero_at_every_step(tmp_path, shape, kv):
    """The actor's layers as CUDA graphs (`model.cuda_graphs=all`, `actor.layer_graphs`): micro-batches of 4 sequences,
    so that the logprob passes and the update each run one eager micro-batch, capture, and replay the other seven; with
    an FP8 KV cache the graphed attention also records the K/V amax the next scales come from."""
    base = QWEN2 if shape == "qwen2" else QWEN3
    cmd = [
        sys.executable, "-m", "megatron_jetrl.rl.train", *base, "precision.mode=jetrl", "precision.exact_logprobs=true",
        f"precision.kv_cache={kv}", "rollout.engine=vllm", "rollout.max_new_tokens=320", "model.cuda_graphs=all", "run.steps=3",
        "run.checkpoint=false", "grpo.prompts_per_step=8", "grpo.micro_batch_size=4", "loss.tis_cap=2.0",
        f"run.out_dir={tmp_path}", "run.name=exact_graphs",
    ]  # fmt: skip
    _, rows = _train(cmd, tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["mismatch/tokens"] > 0
        assert r["mismatch/mean_abs_diff"] == r["mismatch/max_abs_diff"] == r["mismatch/k3_kl"] == 0.0, r["step"]
    if kv == "fp8":  # scales decided from the amax the graphed passes saw
        assert all(0 < r["sync/kv_scale_k_min"] < 1.0 for r in rows[1:]), rows


@pytest.mark.parametrize("shape,new_tokens,eager,scales", [("qwen2", 320, True, "amax"), ("qwen3", 320, False, "running_max")])
def test_grpo_with_an_fp8_kv_cache_has_mismatch_exactly_zero_at_every_step(tmp_path, shape, new_tokens, eager, scales):
    """The FP8 KV cache with the trainer's scales: step 0 at 1.0, later steps at the scales decided from the amax the
    actor saw; every step's rollout, logprob pass and update at the same scales."""
    base = QWEN2 if shape == "qwen2" else QWEN3
    cmd = [
        sys.executable, "-m", "megatron_jetrl.rl.train", *base, "precision.mode=jetrl", "precision.exact_logprobs=true",
        "precision.kv_cache=fp8", f"precision.kv_scales={scales}", "rollout.engine=vllm",
        f"rollout.enforce_eager={str(eager).lower()}", f"rollout.max_new_tokens={new_tokens}", "run.steps=3",
        "run.checkpoint=false", "grpo.prompts_per_step=8", "grpo.micro_batch_size=32", "loss.tis_cap=2.0",
        f"run.out_dir={tmp_path}", "run.name=exact_fp8_kv",
    ]  # fmt: skip
    _, rows = _train(cmd, tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["sync/kv_scale_k_max"] == rows[0]["sync/kv_scale_k_min"] == 1.0  # nothing seen yet
    for r in rows:
        assert r["mismatch/tokens"] > 0
        assert r["mismatch/mean_abs_diff"] == r["mismatch/max_abs_diff"] == r["mismatch/k3_kl"] == 0.0, r["step"]
    for r in rows[1:]:
        assert 0 < r["sync/kv_scale_k_min"] < 1.0 and r["sync/kv_scale_k_max"] != 1.0, r


GRAPHED = ["grpo.micro_batch_size=4"]  # 8 micro-batches a pass: one eager, one captured, six replayed
MULTI_GPU = [
    pytest.param(["parallel.tp=2", "rollout.tp=2"], 2, id="tp2"),
    pytest.param(["parallel.pp=2", "rollout.tp=1"], 2, id="pp2"),
    pytest.param(["parallel.tp=4", "rollout.tp=4"], 4, id="tp4"),
    pytest.param(["parallel.tp=2", "rollout.tp=2", "model.cuda_graphs=all", *GRAPHED], 2, id="tp2-graphs"),
    pytest.param(["parallel.pp=2", "rollout.tp=1", "model.cuda_graphs=all", *GRAPHED], 2, id="pp2-graphs"),
    pytest.param(["parallel.tp=4", "rollout.tp=4", "model.cuda_graphs=all", *GRAPHED], 4, id="tp4-graphs"),
]


@pytest.mark.parametrize("layout,gpus", MULTI_GPU)
def test_grpo_on_several_gpus_has_mismatch_exactly_zero(tmp_path, layout, gpus):
    """Trainer TP 2 and rollout TP 2: both sides add two BF16 partial outputs per row-parallel linear, an order-free
    sum, so NCCL keeps its default settings on both. PP 2: each stage runs its layers with the engine's kernels and
    passes BF16 activations on unchanged; every rank's engine holds the whole model at TP 1. TP 4: a row-parallel
    output is a sum of four partial sums, which the actor and vLLM both add in rank order (`models.ordered_reduce`,
    patches/vllm_0_26_0_ordered_all_reduce.py; Qwen3-8B's layer shapes: two KV heads and 1024 hidden columns a rank).
    The `-graphs` layouts replay the actor's layers as CUDA graphs (`model.cuda_graphs`), the TP collectives inside."""
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    cmd = [
        "bash", "launch/train_grpo.sh", *QWEN3, "rollout.engine=vllm", "precision.exact_logprobs=true",
        "rollout.max_new_tokens=128", "run.steps=3", "run.checkpoint=false", "grpo.prompts_per_step=8",
        "grpo.micro_batch_size=32", "loss.tis_cap=2.0", f"run.out_dir={tmp_path}", "run.name=several_gpus", *layout,
    ]  # fmt: skip
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


@pytest.mark.parametrize(
    "kv_cache_gb,fit,kv",
    [(0.0, 32, "bf16"), (0.22, 12, "bf16"), (0.11, 12, "fp8")],
    ids=["all-at-once", "in-turns", "fp8-in-turns"],
)
def test_long_responses_have_mismatch_exactly_zero_and_sync_the_trainers_bytes(tmp_path, kv_cache_gb, fit, kv):
    """2048-token responses, 32 a step (4 prompts x 8). With a KV cache for 12 of them at their full 2112 tokens (2 layers
    x 8 KiB a token, slabs of 2,304 tokens: 0.22 GiB), vLLM preempts sequences as the cache fills and recomputes them
    later: a resumed sequence's logprobs are still the actor's bit for bit. An FP8 cache holds the same 12 in half the
    bytes. Every sync ships every tensor the engine holds (with an FP8 cache, its scales too)."""
    from megatron_jetrl.rl.config import load_config, split_args
    from megatron_jetrl.rollout.native import expected_tensors

    args = [
        *LONG,
        "precision.mode=jetrl",
        "precision.exact_logprobs=true",
        "rollout.engine=vllm",
        f"rollout.kv_cache_gb={kv_cache_gb}",
        f"precision.kv_cache={kv}",
        "run.steps=2",
        "run.checkpoint=false",
        "loss.tis_cap=2.0",
    ]
    cfg = load_config(*split_args(args))
    want = sum(
        torch.Size(shape).numel() * dtype.itemsize for shape, dtype in expected_tensors(cfg.arch(), cfg.precision).values()
    )
    cmd = [sys.executable, "-m", "megatron_jetrl.rl.train", *args, f"run.out_dir={tmp_path}", "run.name=long"]
    done, rows = _train(cmd, tmp_path)
    assert ("holds 12 of the 32 sequences" in done.stderr) == (fit < 32), done.stderr[-2000:]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["response_length/mean"] > 1024 and r["mismatch/tokens"] > 32 * 1024, r["step"]
        assert r["mismatch/mean_abs_diff"] == r["mismatch/max_abs_diff"] == r["mismatch/k3_kl"] == 0.0, r["step"]
        assert r["sync/bytes"] == want, (r["sync/bytes"], want)
        assert r["rollout/fit_at_once"] == fit
        assert (r["rollout/preemptions"] > 0) == (fit < 32), r["rollout/preemptions"]
