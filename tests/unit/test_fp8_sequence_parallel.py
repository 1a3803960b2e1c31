"""Sequence parallelism in FP8 (`fp8.linear.fp8_linear(sp_group=...)`, the column-parallel FP8 linear under
`sequence_parallel`), on two gloo ranks of one TP group.

Each rank quantizes its own rows and the group all-gathers the E4M3 bytes and the scales: those are, byte for byte,
the quantization of the gathered BF16 rows, so the forward is the unsharded-sequence linear's to the bit; the
backward's input gradient is the TP-summed gradient's rows of this rank, and WGrad (the rows gathered again in FP8)
the unsharded linear's to the bit. A row-parallel linear reduce-scatters its output and gathers its BF16 output
gradient (quantized whole), with the plain TP linear's gradients to the bit. Either forward overlapped with its GEMM (`SPOverlap`: in
pieces, each piece's GEMM overlapping the next piece's communication, or round the ring of ranks) gives the
one-collective outputs and gradients (at two ranks a sum of two partial outputs does not depend on its order; at four,
the ring's reduce-scatter is the rank-by-rank sum it says, within BF16 rounding of the FP64 one). The whole actor's logprobs at TP 2 with sequence parallelism are plain TP 2's to
the bit, at odd lengths too (padded to a multiple of the TP size and cut back); its training against TP 1:
tests/unit/test_actor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from actor_helpers import CONFIGS, spawn, tokens_for

SHAPES = [(8, 2, 256, 256), (6, 1, 384, 128), (4, 3, 200, 256)]  # (sequence, batch, in features, out features per rank)


def _overlaps():
    from megatron_jetrl.fp8.sequence_parallel import SPOverlap

    return [SPOverlap("chunks", 2), SPOverlap("chunks", 3), SPOverlap("ring")]


def _sp_linear_on_a_rank():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.fp8.linear import ACT, fp8_linear, gather_rows
    from megatron_jetrl.fp8.quant import quantize_blockwise

    group = ps.get_tensor_model_parallel_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flow = PrecisionFlow(mode="jetrl", backend="emulated")
    out = []
    for seq, batch, k, n in SHAPES:
        g = torch.Generator().manual_seed(seq * 1000 + k)
        x_full = (torch.randn(seq, batch, k, generator=g) * 3).to(torch.bfloat16)
        w_full = (torch.randn(world * n, k, generator=g) * 0.05).to(torch.bfloat16)
        dy_full = torch.randn(world, seq, batch, n, generator=g).to(torch.bfloat16)  # each rank's output gradient
        rows = slice(rank * seq // world, (rank + 1) * seq // world)
        w = w_full[rank * n : (rank + 1) * n]

        q_loc, s_loc = quantize_blockwise(x_full[rows].reshape(-1, k), ACT, flow.scale_mode, eps=flow.eps)
        q_all, s_all = gather_rows(q_loc, s_loc, group)
        q_ref, s_ref = quantize_blockwise(x_full.reshape(-1, k), ACT, flow.scale_mode, eps=flow.eps)

        x_ref = x_full.clone().requires_grad_(True)
        w_ref = w.clone().requires_grad_(True)
        y_ref = fp8_linear(x_ref, w_ref, flow=flow)
        y_ref.backward(dy_full[rank])
        dx_ref = x_ref.grad.clone()
        dist.all_reduce(dx_ref, group=group)  # the column-parallel input's gradient: summed over the TP group

        x = x_full[rows].clone().requires_grad_(True)
        w_sp = w.clone().requires_grad_(True)
        y = fp8_linear(x, w_sp, flow=flow, sp_group=group)
        y.backward(dy_full[rank])
        with torch.no_grad():
            y_nograd = fp8_linear(x, w_sp, flow=flow, sp_group=group)
        chunked = []
        for overlap in _overlaps():  # the gather in pieces or round the ring, each GEMM overlapping communication
            x_c, w_c = x_full[rows].clone().requires_grad_(True), w.clone().requires_grad_(True)
            y_c = fp8_linear(x_c, w_c, flow=flow, sp_group=group, sp_overlap=overlap)
            y_c.backward(dy_full[rank])
            with torch.no_grad():
                y_c_nograd = fp8_linear(x_c, w_c, flow=flow, sp_group=group, sp_overlap=overlap)
            chunked.append(
                torch.equal(y_c, y)
                and torch.equal(y_c_nograd, y)
                and torch.equal(x_c.grad, x.grad)
                and torch.equal(w_c.grad, w_sp.grad)
            )
        out.append(
            {
                "chunked": chunked,
                "bytes": torch.equal(q_all.view(torch.uint8), q_ref.view(torch.uint8)),
                "scales": torch.equal(s_all, s_ref),
                "forward": torch.equal(y, y_ref) and y.shape == y_ref.shape,
                "forward_no_grad": torch.equal(y_nograd, y_ref),
                "dgrad": torch.equal(x.grad, dx_ref[rows]),
                "wgrad": torch.equal(w_sp.grad, w_ref.grad),
                "wire_bytes": (q_loc.numel() + 4 * s_loc.numel(), 2 * x.numel()),
            }
        )
    return out


ROW_SHAPES = [(128, 2, 128, 256, False), (6, 3, 256, 128, False), (4, 2, 128, 128, True)]
"""(sequence, batch, in features per rank, out features, gated): a row-parallel linear; 128 x 2 rows make each rank's
dY rows whole 128-token groups, 6 x 3 and 4 x 2 do not."""


def _row_parallel_on_a_rank():
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps

    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.fp8.linear import fp8_linear

    group = ps.get_tensor_model_parallel_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flow = PrecisionFlow(mode="jetrl", backend="emulated")
    out = []
    for seq, batch, k, n, gated in ROW_SHAPES:
        g = torch.Generator().manual_seed(seq * 100 + k + gated)
        width = 2 * k if gated else k
        x = (torch.randn(world, seq, batch, width, generator=g) * 2).to(torch.bfloat16)[rank]  # this rank's in-dim shard
        w = (torch.randn(world, n, k, generator=g) * 0.05).to(torch.bfloat16)[rank]
        dy = torch.randn(seq, batch, n, generator=g).to(torch.bfloat16)  # the summed output's gradient
        rows = slice(rank * seq // world, (rank + 1) * seq // world)
        act = F.silu if gated else None

        x_ref, w_ref = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y_ref = fp8_linear(x_ref, w_ref, flow=flow, gated_act=act)
        y_sum = y_ref.detach().clone()
        dist.all_reduce(y_sum, group=group)  # megatron's plain TP: the row-parallel partial outputs all-reduced
        y_ref.backward(dy)

        x_sp, w_sp = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = fp8_linear(x_sp, w_sp, flow=flow, gated_act=act, rs_group=group)
        y.backward(dy[rows])  # under sequence parallelism each rank gets its rows' gradient
        with torch.no_grad():
            y_nograd = fp8_linear(x_sp, w_sp, flow=flow, gated_act=act, rs_group=group)
        chunked = []
        for overlap in _overlaps():  # the reduce-scatter in pieces or round the ring, sums travelling while GEMMs run
            x_c, w_c = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            y_c = fp8_linear(x_c, w_c, flow=flow, gated_act=act, rs_group=group, sp_overlap=overlap)
            y_c.backward(dy[rows])
            with torch.no_grad():
                y_c_nograd = fp8_linear(x_c, w_c, flow=flow, gated_act=act, rs_group=group, sp_overlap=overlap)
            chunked.append(
                torch.equal(y_c, y)
                and torch.equal(y_c_nograd, y)
                and torch.equal(x_c.grad, x_sp.grad)
                and torch.equal(w_c.grad, w_sp.grad)
            )
        out.append(
            {
                "chunked": chunked,
                "forward": torch.equal(y, y_sum[rows]) and torch.equal(y_nograd, y_sum[rows]),
                "dgrad": torch.equal(x_sp.grad, x_ref.grad),
                "wgrad": torch.equal(w_sp.grad, w_ref.grad),
            }
        )
    return out


@pytest.fixture(scope="module")
def row_ranks():
    return spawn(2, 2, 1, _row_parallel_on_a_rank)


@pytest.mark.parametrize("index", range(len(ROW_SHAPES)), ids=[str(s) for s in ROW_SHAPES])
def test_row_parallel_output_is_reduce_scattered_and_its_gradient_gathered_in_fp8(row_ranks, index):
    for rank in row_ranks:
        assert rank[index] == {"chunked": [True, True, True], "forward": True, "dgrad": True, "wgrad": True}, rank[index]


@pytest.fixture(scope="module")
def ranks():
    return spawn(2, 2, 1, _sp_linear_on_a_rank)


@pytest.mark.parametrize("index", range(len(SHAPES)), ids=[str(s) for s in SHAPES])
@pytest.mark.parametrize("rank", [0, 1])
def test_gathered_fp8_rows_are_the_gathered_bf16_quantized_and_the_linear_is_unchanged(ranks, rank, index):
    r = ranks[rank][index]
    assert r["bytes"] and r["scales"], r
    assert r["forward"] and r["forward_no_grad"], r
    assert r["dgrad"] and r["wgrad"], r
    assert r["chunked"] == [True, True, True], r  # in 2 and 3 pieces and round the ring: the one-collective gather's
    fp8, bf16 = r["wire_bytes"]  # E4M3 bytes + FP32 scales against the BF16 rows megatron would gather
    assert fp8 < 0.6 * bf16


def _overlaps_on_a_tp4_rank():
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps

    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.fp8.linear import fp8_linear

    group = ps.get_tensor_model_parallel_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flow = PrecisionFlow(mode="jetrl", backend="emulated")
    g = torch.Generator().manual_seed(7)
    seq, batch, k, n = 8, 3, 256, 128
    rows = slice(rank * seq // world, (rank + 1) * seq // world)

    def run(x, w, dy, **kw):
        x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = fp8_linear(x, w, flow=flow, **kw)
        y.backward(dy)
        return y.detach(), x.grad, w.grad

    # column-parallel: every overlap gathers the same rows, so every output and gradient is the one-collective one's
    x_full = (torch.randn(seq, batch, k, generator=g) * 3).to(torch.bfloat16)
    w = (torch.randn(world, n, k, generator=g) * 0.05).to(torch.bfloat16)[rank]
    dy = torch.randn(world, seq, batch, n, generator=g).to(torch.bfloat16)[rank]
    plain = run(x_full[rows], w, dy, sp_group=group)
    gathered = {
        o.kind + str(o.chunks): all(map(torch.equal, run(x_full[rows], w, dy, sp_group=group, sp_overlap=o), plain))
        for o in _overlaps()
    }

    # row-parallel (a gated down projection): the ring sums rank by rank, from the rank after the rows' owner round to it
    x = (torch.randn(world, seq, batch, 2 * k, generator=g) * 2).to(torch.bfloat16)[rank]
    w = (torch.randn(world, n, k, generator=g) * 0.05).to(torch.bfloat16)[rank]
    dy = torch.randn(seq, batch, n, generator=g).to(torch.bfloat16)
    partial = fp8_linear(x, w, flow=flow, gated_act=F.silu).detach()
    partials = [torch.empty_like(partial) for _ in range(world)]
    dist.all_gather(partials, partial, group=group)
    ring_sum = partials[(rank + 1) % world][rows]
    for step in range(2, world + 1):
        ring_sum = partials[(rank + step) % world][rows] + ring_sum  # BF16, rounded at each step as the ring adds
    exact = sum(p[rows].double() for p in partials)
    bound = (world - 1) * 2.0**-8 * sum(p[rows].double().abs() for p in partials)
    plain = run(x, w, dy[rows], gated_act=F.silu, rs_group=group)
    scattered = {}
    for o in [None, *_overlaps()]:
        y, dx, dw = plain if o is None else run(x, w, dy[rows], gated_act=F.silu, rs_group=group, sp_overlap=o)
        scattered["none1" if o is None else o.kind + str(o.chunks)] = {
            "within_bf16_rounding": bool(((y.double() - exact).abs() <= bound).all()),
            "ring_order": torch.equal(y, ring_sum),
            "grads": torch.equal(dx, plain[1]) and torch.equal(dw, plain[2]),
        }
    return {"gathered": gathered, "scattered": scattered}


def test_every_overlap_at_tp4_gathers_the_same_bits_and_the_ring_sums_rank_by_rank():
    for rank in spawn(4, 4, 1, _overlaps_on_a_tp4_rank):
        assert rank["gathered"] == {"chunks2": True, "chunks3": True, "ring1": True}, rank
        for kind, r in rank["scattered"].items():
            assert r["within_bf16_rounding"] and r["grads"], (kind, r)
        assert rank["scattered"]["ring1"]["ring_order"], rank


def test_sp_group_refuses_what_it_cannot_gather():
    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.fp8.linear import fp8_linear

    x, w = torch.randn(4, 128), torch.randn(128, 128)
    with pytest.raises(ValueError, match="no dgrad_group"):
        fp8_linear(x, w, flow=PrecisionFlow(mode="jetrl", backend="emulated"), sp_group=object(), dgrad_group=object())
    with pytest.raises(ValueError, match="FP8 training flow"):
        fp8_linear(x, w, flow=PrecisionFlow(mode="bf16"), sp_group=object())


def test_overlaps_refuse_what_they_do_not_define():
    from megatron_jetrl.actor.provider import ActorOptions
    from megatron_jetrl.fp8.sequence_parallel import SPOverlap

    for kind, chunks in (("chunks", 1), ("ring", 2), ("none", 0), ("chunks", 0)):
        with pytest.raises(ValueError, match="chunks is the piece count of kind 'chunks' \\(2 or more\\) and 1 for the other"):
            SPOverlap(kind, chunks)
    with pytest.raises(ValueError, match="SPOverlap.kind must be one of \\('none', 'chunks', 'ring'\\), got 'async'"):
        SPOverlap("async")
    with pytest.raises(ValueError, match="overlaps the local spec's FP8 sequence-parallel communication: it needs"):
        ActorOptions(sp_overlap=SPOverlap("ring"))
    with pytest.raises(ValueError, match="needs spec='local' and sequence_parallel=True"):
        ActorOptions(spec="te", sequence_parallel=True, sp_overlap=SPOverlap("chunks", 2))
    assert ActorOptions(sequence_parallel=True, sp_overlap=SPOverlap("chunks", 3)).sp_overlap.chunks == 3


def _logprobs_with_and_without_sequence_parallel():
    from megatron_jetrl.actor.hf_import import init_hf_weights
    from megatron_jetrl.actor.logprobs import compute_logprobs
    from megatron_jetrl.actor.provider import ActorOptions, build_model
    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.fp8.sequence_parallel import NO_OVERLAP, SPOverlap
    from megatron_jetrl.models.arch import ModelArch

    arch = ModelArch.from_hf_config(CONFIGS["qwen3"])
    out = {}
    for mode, batch_invariant in (("jetrl", True), ("jetrl", False), ("bf16", False)):
        flow = PrecisionFlow(mode=mode, backend="emulated")
        lps = {}
        layouts = [(False, NO_OVERLAP), (True, NO_OVERLAP)]
        layouts += [(True, SPOverlap("chunks", 2)), (True, SPOverlap("ring"))] if flow.train_fp8 else []  # FP8 linears only
        for sp, chunks in layouts:
            options = ActorOptions(sequence_parallel=sp, batch_invariant=batch_invariant, sp_overlap=chunks)
            model = build_model(arch, flow, options)
            init_hf_weights(model, arch, 3)
            for length in (16, 17):
                tokens = tokens_for(CONFIGS["qwen3"], batch=2, seed=1)[:, :length]
                lps[sp, chunks, length] = compute_logprobs(model, tokens, vocab_size=arch.vocab_size, micro_batch_size=2)
        out[mode, batch_invariant] = {
            (n, chunks): torch.equal(lps[True, chunks, n], lps[False, NO_OVERLAP, n]) and lps[True, chunks, n].shape[1] == n - 1
            for n in (16, 17)
            for _, chunks in layouts[1:]
        }
    return out


def test_the_actors_logprobs_with_sequence_parallelism_are_plain_tp2s():
    for rank in spawn(2, 2, 1, _logprobs_with_and_without_sequence_parallel):
        assert all(all(v.values()) for v in rank.values()), rank
