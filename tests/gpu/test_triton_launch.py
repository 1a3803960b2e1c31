"""`fp8.launch.Launcher` on the GPU: the cached direct launch gives what Triton's own launch gives, for every
specialization it must tell apart (pointer alignment, ints divisible by 16 or equal to 1, constexpr values),
and falls back to Triton for arguments it does not key."""

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def kernel():
    """The launcher's own probe kernel: (a * x[i * stride] + y[i]) * SCALE + ADD, ADD a constexpr defaulting to 1."""
    pytest.importorskip("triton")
    from megatron_jetrl.fp8.launch import _probe_kernel

    return _probe_kernel()


def test_launcher_equals_triton_launch_across_specializations(kernel):
    from megatron_jetrl.fp8 import launch
    from megatron_jetrl.fp8.launch import Launcher

    assert launch._direct_ok(), "the first-use probe refused the direct launch on this Triton"
    fast = Launcher(kernel)
    base = torch.randn(70000, device="cuda")
    y = torch.randn(70000, device="cuda")
    cases = []
    for off in (0, 1, 4):  # 16-byte aligned and not
        for n in (1, 16, 1000, 4099):  # == 1, divisible by 16, neither
            for stride in (1, 2, 16):
                cases.append((off, n, stride))
    for rounds in range(2):  # round 2: every key is cached, every launch is the direct one
        for off, n, stride in cases:
            x = base[off:]
            for scale in (1.0, 2.0):
                want = torch.full((n,), float("nan"), device="cuda")
                got = torch.full((n,), float("nan"), device="cuda")
                grid = (triton_cdiv(n, 256),)
                kernel[grid](x, y, want, n, stride, 0.5, SCALE=scale, BLOCK=256)
                fast[grid](x, y, got, n, stride, 0.5, SCALE=scale, BLOCK=256)
                assert torch.equal(got, want), (off, n, stride, scale, rounds)
                assert torch.allclose(
                    want, (0.5 * x[: n * stride : stride] + y[:n]) * scale + 1.0, rtol=1e-6, atol=1e-6
                )  # Triton may fuse an FMA
    assert (
        len(fast._cache)
        == len({(off % 4 == 0, n == 1, n % 16 == 0, stride == 1, stride % 16 == 0) for off, n, stride in cases}) * 2
    )


def test_launcher_takes_tritons_path_for_callable_grids_and_launch_hooks(kernel):
    from triton import knobs

    from megatron_jetrl.fp8.launch import Launcher

    fast = Launcher(kernel)
    x, y, out = (torch.randn(300, device="cuda") for _ in range(3))
    fast[lambda meta: (2,)](x, y, out, 300, 1, 2.0, SCALE=1.0, BLOCK=256)  # a callable grid
    assert torch.allclose(out, 2.0 * x + y + 1.0, rtol=1e-6, atol=1e-6) and not fast._cache
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731 -- what a profiler registers
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for a in (3.0, 4.0):
            fast[(2,)](x, y, out, 300, 1, a, SCALE=1.0, BLOCK=256)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["probe", "probe"] and torch.allclose(out, 4.0 * x + y + 1.0, rtol=1e-6, atol=1e-6) and not fast._cache


def test_project_quantizer_goes_direct_and_keeps_the_reference_bytes():
    """The shipped 1x128 quantizer through its Launcher: the second call of a shape is a direct launch (its key is
    cached) and the bytes are still the reference quantizer's."""
    from megatron_jetrl.fp8 import kernels, quantize_blockwise

    x = torch.randn(257, 640, device="cuda", dtype=torch.bfloat16) * 3
    want_q, want_s = quantize_blockwise(x, (1, 128))
    launcher = kernels._k()["quant_1x128"]
    before = len(launcher._cache)  # other tests may have filled keys already
    for _ in range(3):
        q, s = kernels.quantize_1x128(x, check_finite=False)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    assert len(launcher._cache) >= max(before, 1)


def triton_cdiv(a, b):
    return -(-a // b)
