"""Sequence parallelism's FP8 gathers on the GPU's kernels (`fp8_linear(sp_group=...)`, `fp8_linear(rs_group=...)`), on a
one-rank NCCL group: the CUDA quantizers write their scales outer-dim-major and their WGrad operands K-major, and the
gathered operands must reach the GEMMs in those layouts. With one rank every gather is the identity, so forward, dX
and dW equal the plain linear's bit for bit, whatever the forward's overlap (`SPOverlap`: in pieces, the GEMM run piece
by piece, which rests on the GEMM's rows not depending on how many rows it runs at once: tested on its own below; or
round the ring, one step at one rank). Two and more ranks: tests/unit/test_fp8_sequence_parallel.py (CPU, gloo) and
`tools/bench/bench_sp_overlap.py` (its check before timing, on GPUs).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def group():
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29683")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    return dist.new_group([0])


def _run(x, w, dy, **kw):
    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.fp8.linear import fp8_linear

    flow = PrecisionFlow(mode="jetrl", backend="auto")
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fp8_linear(x, w, flow=flow, **kw)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("overlap", ["none", "chunks3", "ring"])
@pytest.mark.parametrize("tokens", [256, 200])  # whole 128-token groups, and not (dY's BF16 rows gathered)
@pytest.mark.parametrize("kind", ["sp_group", "rs_group", "rs_group+gated"])
def test_one_rank_gathers_change_no_byte(group, tokens, kind, overlap):
    from megatron_jetrl.fp8.sequence_parallel import SPOverlap

    g = torch.Generator(device="cuda").manual_seed(tokens)
    k, n = 512, 384
    gated = kind.endswith("gated")
    x = torch.randn(tokens, 2 * k if gated else k, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
    dy = torch.randn(tokens, n, generator=g, device="cuda").to(torch.bfloat16)
    extra = {"gated_act": F.silu} if gated else {}
    plain = _run(x, w, dy, **extra)
    sp_overlap = SPOverlap("chunks", 3) if overlap == "chunks3" else SPOverlap(overlap)
    sharded = _run(x, w, dy, **extra, **{kind.split("+")[0]: group}, sp_overlap=sp_overlap)
    for a, b, what in zip(plain, sharded, ("forward", "dX", "dW")):
        assert torch.equal(a, b), what


@pytest.mark.parametrize("backend", ["deepgemm", "cublaslt", "triton"])
@pytest.mark.parametrize("n,k", [(1536, 4096), (4096, 1024), (6144, 4096), (4096, 3072)])  # a TP 4 rank's four linears
def test_the_gemms_rows_do_not_depend_on_how_many_rows_run_at_once(backend, n, k):
    """FProp of a micro-batch's 4352 rows at once, and of its row pieces one by one (`SPOverlap`'s forward in pieces): the same
    bytes, on every backend the FP8 linear may use."""
    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.fp8.gemm import available_backends
    from megatron_jetrl.fp8.kernels import quantize
    from megatron_jetrl.fp8.linear import ACT, QuantizedWeight, _fprop

    if backend not in available_backends(torch.device("cuda")):
        pytest.skip(f"{backend} is not available here")
    flow = PrecisionFlow(mode="jetrl", backend=backend)
    g = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(4352, k, generator=g, device="cuda").to(torch.bfloat16)
    w = QuantizedWeight.quantize((torch.randn(n, k, generator=g, device="cuda") * 0.05).to(torch.bfloat16), flow)
    x_q, x_s = quantize(x, ACT, flow.scale_mode, eps=flow.eps)
    whole = _fprop(x_q, x_s, w, None, flow, torch.bfloat16)
    for a, b in [(0, 1088), (1088, 2176), (2176, 4352), (100, 1188)]:
        piece_q, piece_s = quantize(x[a:b].contiguous(), ACT, flow.scale_mode, eps=flow.eps)
        assert torch.equal(_fprop(piece_q, piece_s, w, None, flow, torch.bfloat16), whole[a:b]), (a, b)
