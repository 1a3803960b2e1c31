"""Transformer Engine 2.20.2 on the GPU: the recipe TE really runs, its bytes against `quantize_blockwise` (thus vLLM),
a TE-spec train step against the local spec, and the export of TE's own bytes (tools/gpu/gpu_te.sh runs this file).

Skipped without CUDA or without TE (install it from the kit: `fp8.te.INSTALL_LINE`). Byte conformance prints one
line per tensor kind and scale mode (`CONFORMANCE kind mode: identical bytes ..., identical scales ...`) and asserts
the characterisation derived from TE's source in `megatron_jetrl/fp8/te.py`:
  * TE's bytes and scale_inv == `fp8.te.te_quantize` (TE's rule in torch) for every tensor, 100%;
  * ue8m0: differences from `quantize_blockwise` only in groups with max(amax, eps) <= 448 * 2**-34;
  * fp32: differing bytes are the adjacent E4M3 code, scales differ by at most one FP32 ulp.
The train step bound (stated in BOUNDS) compares the TE spec with the local spec on the same weights and tokens.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import ARCH, BATCH, arch, build, hf_fp8, logprobs, tokens

from megatron_jetrl.fp8 import PrecisionFlow, quantize_blockwise
from megatron_jetrl.fp8 import te as te_mod

pytestmark = pytest.mark.gpu

# (mean |d logprob|, max |d logprob|, relative loss difference, relative grad-norm difference): TE spec vs local spec,
# same weights and tokens, before and after one Adam step. bf16: the two specs differ only in attention / norm kernels
# and GEMM order; jetrl: also FP8 roundings that flip (fp32 scales: ~1e-4 of activation bytes differ by an E4M3 step).
BOUNDS = {"bf16": (0.01, 0.1, 1e-2, 2e-2), "jetrl": (0.05, 0.5, 3e-2, 5e-2)}


def check_conformance(kind: str, mode: str, x: torch.Tensor, q_te, s_te, block) -> dict:
    """Assert the characterisation for one tensor quantized by TE; return byte_diff's numbers vs the reference."""
    q_emu, s_emu = te_mod.te_quantize(x, block, mode)
    assert torch.equal(q_te.view(torch.uint8), q_emu.view(torch.uint8)), f"{kind} {mode}: TE's bytes are not te_quantize's"
    assert torch.equal(s_te, s_emu), f"{kind} {mode}: TE's scale_inv is not te_quantize's"
    q_ref, s_ref = quantize_blockwise(x, block, mode, check_finite=False)
    d = te_mod.byte_diff(q_te, s_te, q_ref, s_ref, block)
    if mode == "ue8m0":
        tiny = te_mod.group_amax(x, block).clamp_min(1e-10) <= te_mod.UE8M0_TE_DIFFERS_AT_OR_BELOW
        assert torch.equal(d["groups_with_scale_diff"], tiny), f"{kind}: scales differ outside the tiny-amax groups"
        assert not (d["groups_with_byte_diff"] & ~tiny).any(), f"{kind}: bytes differ outside the tiny-amax groups"
        d["tiny_groups"] = int(tiny.sum())
    else:
        assert d["differing_bytes_adjacent"] and d["max_scale_ulps"] <= 1, (
            f"{kind}: {d['max_scale_ulps']} ulps, non-adjacent codes"
        )
    return d


def report(kind, mode, stats: list[dict]):
    n = sum(s["n"] for s in stats)
    same = sum(s["bytes_identical"] * s["n"] for s in stats) / n
    scales = sum(s["scales_identical"] for s in stats) / len(stats)
    extra = f", tiny-amax groups {sum(s.get('tiny_groups', 0) for s in stats)}" if mode == "ue8m0" else ""
    print(
        f"CONFORMANCE {kind:<22} {mode:<5}: identical bytes {same:.6f}, identical scales {scales:.4f} "
        f"({len(stats)} tensors, {n} elements{extra})",
        flush=True,
    )


def _quantize_like_te(flow, tensor_type, x):
    q = te_mod.make_block_quantizer(flow, tensor_type)  # the factory's settings (test_recipe_mapping checks them)
    return te_mod.te_tensor_parts(q(x.contiguous()))


@pytest.mark.parametrize("mode", ["fp32", "ue8m0"])
def test_recipe_mapping(te_ready, mode):
    """The quantizers TE's layers really hold after a forward + backward are the flow's: block dims, eps, pow2."""
    from transformer_engine.pytorch.constants import FP8BwdTensorIdx, FP8FwdTensorIdx
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    from megatron_jetrl.actor.te_recipe import te_linears

    flow = PrecisionFlow(mode="jetrl", scale_mode=mode)
    model = build("te", flow)
    out = model(tokens(), None, None)  # GPTModel(input_ids, position_ids, attention_mask) -> logits
    out.float().sum().backward()
    for name, m in te_linears(model).items():
        fwd, bwd = m.quantizers["scaling_fwd"], m.quantizers["scaling_bwd"]
        for q, dim in (
            (fwd[FP8FwdTensorIdx.GEMM1_INPUT], 1),
            (fwd[FP8FwdTensorIdx.GEMM1_WEIGHT], 2),
            (bwd[FP8BwdTensorIdx.GRAD_OUTPUT1], 1),
        ):
            assert isinstance(q, Float8BlockQuantizer), f"{name}: {type(q).__name__}"
            assert (q.block_scaling_dim, q.amax_epsilon, q.force_pow_2_scales) == (dim, 1e-10, mode == "ue8m0"), name


@pytest.mark.parametrize("mode", ["fp32", "ue8m0"])
def test_weight_bytes_conformance_and_export_equals_te(te_ready, mode):
    """Every TE linear's weight as TE holds it (its `_fp8_workspaces['weight']` after a forward): vs the reference,
    and `te_fp8_weights` (the export) == those bytes and scales."""
    from megatron_jetrl.actor.te_recipe import te_fp8_weights, te_linears

    flow = PrecisionFlow(mode="jetrl", scale_mode=mode)
    model = build("te", flow)
    with torch.no_grad():
        for p in model.parameters():  # realistic spread: some blocks large, some small
            p.mul_(torch.exp2(torch.randint(-6, 7, (), device=p.device).float()))
    logprobs(model, tokens())  # first micro-batch: TE quantizes and caches its weights
    exported = te_fp8_weights(model, flow)
    stats = []
    for name, m in te_linears(model).items():
        ws = m._fp8_workspaces.get("weight")
        assert ws is not None, f"{name}: TE cached no FP8 weight (is_first_microbatch not set?)"
        parts = te_mod.te_tensor_parts(ws)
        q, s = parts["rowwise"] if "rowwise" in parts else tuple(t.t().contiguous() for t in parts["columnwise"])
        w = m.weight.detach()
        d = check_conformance(f"weight {name}", mode, w, q, s, (128, 128))
        stats.append(d | {"n": w.numel()})
        e = exported[f"{name}.weight"]
        assert torch.equal(e.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(e.s, s), f"{name}: export != TE's bytes"
    report("weight 128x128", mode, stats)


@pytest.mark.parametrize("mode", ["fp32", "ue8m0"])
def test_activation_and_gradient_bytes_conformance(te_ready, mode):
    """The probe batch's real inputs and output gradients of TE's plain linears (linear_proj, linear_fc2), quantized
    by TE's quantizer as its forward/backward does: row-wise 1x128 (FProp/DGrad) and column-wise 128x1 (WGrad)."""
    from megatron_jetrl.actor.te_recipe import te_linears

    flow = PrecisionFlow(mode="jetrl", scale_mode=mode)
    model = build("te", flow)
    seen = {}
    hooks = []
    for name, m in te_linears(model).items():
        if name.endswith(("linear_proj", "linear_fc2")):
            hooks.append(m.register_forward_pre_hook(lambda mod, a, n=name: seen.__setitem__((n, "input"), a[0].detach())))
            hooks.append(
                m.register_full_backward_hook(lambda mod, gi, go, n=name: seen.__setitem__((n, "grad_output"), go[0].detach()))
            )
    model(tokens(1), None, None).float().pow(2).mean().backward()
    for h in hooks:
        h.remove()
    assert len(seen) == 4 * ARCH["num_hidden_layers"], sorted(seen)
    stats = {}
    for (name, what), x in seen.items():
        x2 = x.reshape(-1, x.shape[-1])
        parts = _quantize_like_te(flow, what, x2)
        for kind, block in (("rowwise", (1, 128)), ("columnwise", (128, 1))):
            d = check_conformance(f"{what} {kind} {name}", mode, x2, *parts[kind], block)
            stats.setdefault(f"{what} {'1x128' if kind == 'rowwise' else '128x1'}", []).append(d | {"n": x2.numel()})
    for kind, s in stats.items():
        report(kind, mode, s)


@pytest.mark.parametrize("mode", ["bf16", "jetrl-fp32", "jetrl-ue8m0"])
def test_te_train_step_matches_local_spec(te_ready, mode):
    """Same weights, tokens and loss: logprobs before and after one Adam step, loss and grad norm within BOUNDS."""
    from gpu_helpers import train_step_comparison

    flow = PrecisionFlow(mode="jetrl", scale_mode=mode.split("-")[1]) if mode.startswith("jetrl") else PrecisionFlow(mode="bf16")
    bound = BOUNDS["jetrl" if flow.train_fp8 else "bf16"]
    r, _ = train_step_comparison(flow)
    print(
        f"TRAINSTEP {mode}: before mean|dlogp| {r['before']['mean']:.3g} max {r['before']['max']:.3g}; after mean "
        f"{r['after']['mean']:.3g} max {r['after']['max']:.3g}; loss local {r['loss_local']:.6g} te {r['loss_te']:.6g}; "
        f"grad norm local {r['grad_norm_local']:.6g} te {r['grad_norm_te']:.6g}",
        flush=True,
    )
    for d in (r["before"], r["after"]):
        assert d["mean"] <= bound[0] and d["max"] <= bound[1], (mode, d)
    assert r["loss_rel"] <= bound[2]
    assert r["grad_norm_rel"] <= bound[3]


@pytest.mark.parametrize("mode", ["fp32", "ue8m0"])
def test_export_ships_te_bytes_to_native_engine_and_disk(te_ready, mode, tmp_path):
    """After an optimizer step: the live weight stream (the one mapping table) and the converter's on-disk export carry
    exactly the bytes and scales TE's next forward uses, and the native engine holds them unchanged."""
    from megatron_jetrl.actor.checkpoint import save_checkpoint
    from megatron_jetrl.actor.te_recipe import te_fp8_weights, te_linears
    from megatron_jetrl.actor.train_step import OptimConfig, train_step, wrap_for_training
    from megatron_jetrl.actor.weight_stream import actor_weight_stream
    from megatron_jetrl.convert.converter import convert
    from megatron_jetrl.rollout.native import NativeEngine

    flow = PrecisionFlow(mode="jetrl", scale_mode=mode)
    a = arch()
    ddp, opt = wrap_for_training(build("te", flow), OptimConfig(lr=1e-3))
    toks = tokens(4)
    train_step(ddp, opt, toks, lambda lp, _: (-lp.mean(), {}), vocab_size=ARCH["vocab_size"], micro_batch_size=BATCH)
    logprobs(ddp, toks)  # TE re-quantizes the updated weights on this first micro-batch
    held = {f"{n}.weight": te_mod.te_weight(m._fp8_workspaces["weight"]) for n, m in te_linears(ddp).items()}
    exported = te_fp8_weights(ddp, flow)
    for name, w in held.items():
        assert torch.equal(exported[name].q.view(torch.uint8), w.q.view(torch.uint8)), name
    want = hf_fp8(held, a)  # HF names through the one mapping table
    pairs = dict(actor_weight_stream(ddp, a, flow))
    for name, t in want.items():
        got = pairs[name].view(torch.uint8) if t.dtype == torch.uint8 else pairs[name]
        assert torch.equal(got.cpu(), t.cpu()), f"live stream {name}"
    engine = NativeEngine(a, flow, device="cuda", batch_invariant=False)
    engine.update_weights(pairs.items(), require_complete=True)
    for name, t in want.items():
        held_t = engine.state_dict()[name]
        assert torch.equal((held_t.view(torch.uint8) if t.dtype == torch.uint8 else held_t).cpu(), t.cpu()), f"engine {name}"
    save_checkpoint(ddp, tmp_path / "ckpt", hf_config=ARCH, flow=flow, iteration=1, spec="te")
    convert(tmp_path / "ckpt", tmp_path / "hf", dtype="fp8", rollout_tp=1, force=True)
    disk = NativeEngine.from_pretrained(tmp_path / "hf", flow, device="cuda", batch_invariant=False).state_dict()
    for name, t in want.items():
        assert torch.equal((disk[name].view(torch.uint8) if t.dtype == torch.uint8 else disk[name]).cpu(), t.cpu()), (
            f"disk {name}"
        )
    actor = logprobs(ddp, toks).float().cpu()
    rollout = torch.tensor(engine.score(toks.tolist()))
    gap = (
        f"{(actor - rollout).abs().mean():.4g}"
        if actor.shape == rollout.shape
        else f"n/a (shapes {tuple(actor.shape)}, {tuple(rollout.shape)})"
    )
    print(
        f"EXPORT {mode}: {len(want) // 2} FP8 tensors identical in the live stream, the native engine and on disk; "
        f"actor vs native engine on the same bytes mean|dlogp| {gap}",
        flush=True,
    )
