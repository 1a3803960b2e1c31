"""The rank-order sum on CUDA (`models.ordered_reduce.ordered_sum`: one Triton kernel) against its torch formula on the
CPU, byte for byte: FP32 additions in rank order and one rounding to nearest even, for BF16, FP16 and FP32 partials,
1 to 8 ranks, sizes around the kernel's block, and sums that land on a rounding tie or cancel. The actor and vLLM
both take this kernel under exact logprobs above TP 2 (tests/gpu/test_exact_logprobs.py: mismatch exactly 0 at TP 4).
"""

import pytest
import torch

from megatron_jetrl.models.ordered_reduce import BLOCK, ordered_sum

pytestmark = pytest.mark.gpu


def _partials(world: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random partial sums over 6 decades, with planted ties (two halves of one rounding step) and cancellations."""
    g = torch.Generator().manual_seed(seed)
    parts = torch.randn(world, n, generator=g) * 10 ** torch.empty(1, n).uniform_(-3, 3, generator=g)
    if world >= 2 and n >= 8:
        step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10  # one unit in the last place at 1.0
        parts[:, 0::8] = 0
        parts[0, 0::8], parts[1, 0::8] = 1.0 + step, step / 2  # 1 + 1.5 steps: a tie, to even (1 + 2 steps, not 1 + 1)
        parts[:, 1::8] = 0
        parts[0, 1::8], parts[1, 1::8] = 3.0, -3.0  # an exact zero
    return parts.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_cuda_rank_order_sum_is_the_torch_formula_to_the_bit(dtype, world):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for n in (1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 33 * 4096 + 5):
        parts = _partials(world, n, dtype, seed=world * 1000 + n)
        got = ordered_sum(parts.cuda())
        want = ordered_sum(parts)  # the CPU: torch's FP32 adds and cast
        assert got.dtype == dtype and got.shape == (n,)
        assert torch.equal(got.cpu(), want), (dtype, world, n, int((got.cpu() != want).sum()))


def test_cuda_rank_order_sum_keeps_the_shape_and_takes_an_empty_sum():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    parts = _partials(4, 6 * 5 * 128, torch.bfloat16, seed=1).view(4, 6, 5, 128)
    assert torch.equal(ordered_sum(parts.cuda()).cpu(), ordered_sum(parts))
    empty = ordered_sum(torch.empty(4, 0, 16, dtype=torch.bfloat16, device="cuda"))
    assert empty.shape == (0, 16) and empty.is_cuda
