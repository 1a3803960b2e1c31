"""Helpers shared by the GPU tests (plain functions and constants; the `te_ready` fixture is in conftest.py).

The TE test model (`ARCH`, built by `build`) is the one tests/gpu/test_te.py trains: qwen2-shaped, hidden 512,
2 layers, every GEMM dimension a multiple of 128 at TP1 and TP2 (so vLLM's DeepGEMM/CUTLASS block kernels and
megatron's TP2 shards take it as is). Importable from tests/gpu (pytest puts the test file's folder on sys.path;
te_tp_run.py, run as a script, has it as its own folder).
"""

from __future__ import annotations

import torch

from megatron_jetrl.fp8 import PrecisionFlow

ARCH = {
    "model_type": "qwen2",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "vocab_size": 1024,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
SEQ, BATCH = 128, 4


def arch(config: dict = ARCH):
    from megatron_jetrl.models import ModelArch

    return ModelArch.from_hf_config(config)


def build(spec: str, flow: PrecisionFlow, config: dict = ARCH):
    from megatron_jetrl.actor.provider import ActorOptions, build_model

    return build_model(arch(config), flow, ActorOptions(spec=spec, params_dtype=torch.bfloat16))


def pair(flow: PrecisionFlow, config: dict = ARCH):
    """A local-spec and a TE-spec model with the same weights (copied through the mapping table)."""
    from megatron_jetrl.actor.provider import copy_weights

    local, te = build("local", flow, config), build("te", flow, config)
    copy_weights(local, te, arch(config), src_spec="local", dst_spec="te")
    return local, te


def tokens(seed=0, batch=BATCH, seq=SEQ, vocab=ARCH["vocab_size"]):
    """Random token ids on the current GPU (Philox: the same ids on every GPU for the same seed)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)


def logprobs(model, toks, vocab=ARCH["vocab_size"], micro_batch_size=BATCH):
    from megatron_jetrl.actor.logprobs import compute_logprobs

    return compute_logprobs(model, toks, vocab_size=vocab, micro_batch_size=micro_batch_size)


def hf_fp8(weights: dict, arch_) -> dict[str, torch.Tensor]:
    """HF tensors of TP1 FP8 weights given by megatron name (`te_fp8_weights`' output, or TE's held workspaces as
    `QuantizedWeight`s): `<hf>.weight` as uint8 bytes, `<hf>.weight_scale_inv` FP32, cut by the one mapping table."""
    from megatron_jetrl.models import model_entries
    from megatron_jetrl.models.mapping import to_hf

    out = {}
    for e in model_entries(arch_, spec="te"):
        if e.fp8:
            w = weights[e.megatron]
            q, s = to_hf(e, arch_, w.q.view(torch.uint8)), to_hf(e, arch_, w.s, unit=128)
            for name in e.hf:
                out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = q[name], s[name]
    return out


def _is_vocab(hf_name: str) -> bool:
    return "embed_tokens" in hf_name or hf_name.startswith("lm_head")


def vllm_bytes(engine, arch_, expected: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """For every HF tensor a `VllmEngine` holds (its copy plan): `(equal bytes, bytes)` of this rank's piece of
    `expected[name]` against vLLM's live parameter slice, read back from vLLM's parameters (not the sync's own
    check). A dtype width or shape that differs counts as no byte equal."""
    from megatron_jetrl.rollout.vllm_params import rank_piece

    out = {}
    for hf_name, slot in engine.plan.items():
        param = engine.params[slot.param]
        piece = rank_piece(
            arch_, hf_name, expected[hf_name], engine.tp_rank, engine.tp, param.shape[0] if _is_vocab(hf_name) else None
        )
        got = vllm_tensor(engine, hf_name).contiguous().view(torch.uint8)
        want = piece.contiguous().view(torch.uint8).to(got.device)
        out[hf_name] = (int((got == want).sum()), want.numel()) if got.shape == want.shape else (0, want.numel())
    return out


def vllm_tensor(engine, hf_name: str) -> torch.Tensor:
    """This rank's piece of one HF tensor as the `VllmEngine` holds it: a row slice of vLLM's (fused) parameter."""
    slot = engine.plan[hf_name]
    return engine.params[slot.param].data.narrow(0, slot.row, slot.rows)


def dequantized(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """FP32 values of a 128x128 block-quantized weight (`q` E4M3 or its uint8 bytes, `s` FP32 weight_scale_inv)."""
    q = q.view(torch.float8_e4m3fn) if q.dtype == torch.uint8 else q
    rows, cols = q.shape
    grid = s.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return q.float() * grid.to(q.device)


def train_step_comparison(flow: PrecisionFlow) -> tuple[dict, object]:
    """The local and TE actors from the same weights take one Adam step on the same tokens and advantages (test_te.py's
    TRAINSTEP check; te_tp_run.py's at TP 2): (|dlogp| before and after, losses, grad norms and their relative
    differences, seconds; the TE actor, DDP-wrapped, for export checks)."""
    import time

    from megatron_jetrl.actor.train_step import OptimConfig, train_step, wrap_for_training

    local, te = pair(flow)
    toks = tokens(2)
    adv = torch.randn(BATCH, 1, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    before = [logprobs(m, toks) for m in (local, te)]
    loss_fn = lambda lp, extra: ((-(lp * extra["adv"])).mean(), {})  # noqa: E731
    results = []
    t0 = time.perf_counter()
    for m in (local, te):
        ddp, opt = wrap_for_training(m, OptimConfig(lr=1e-4))
        results.append(
            (ddp, train_step(ddp, opt, toks, loss_fn, vocab_size=ARCH["vocab_size"], micro_batch_size=BATCH, extras={"adv": adv}))
        )
    seconds = time.perf_counter() - t0
    after = [logprobs(ddp, toks) for ddp, _ in results]
    (_, r_local), (te_ddp, r_te) = results
    rel = lambda a, b: abs(a - b) / max(abs(b), 1e-12)  # noqa: E731
    d0, d1 = (before[1] - before[0]).abs(), (after[1] - after[0]).abs()
    row = {
        "ok": bool(r_local["ok"] and r_te["ok"]),
        "before": {"mean": float(d0.mean()), "max": float(d0.max())},
        "after": {"mean": float(d1.mean()), "max": float(d1.max())},
        "loss_local": float(r_local["loss"]),
        "loss_te": float(r_te["loss"]),
        "grad_norm_local": float(r_local["grad_norm"]),
        "grad_norm_te": float(r_te["grad_norm"]),
        "loss_rel": rel(r_te["loss"], r_local["loss"]),
        "grad_norm_rel": rel(r_te["grad_norm"], r_local["grad_norm"]),
        "steps_s": seconds,
    }
    return row, te_ddp
