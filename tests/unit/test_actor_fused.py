"""`actor.fused` on the CPU: the eager formulas are megatron's / HF's to the bit, and a failed torch.compile build
names the way out. (The compiled CUDA kernels: tests/gpu/test_fused.py.)"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_jetrl.actor import fused


def test_rope_is_megatrons_rope_bit_for_bit_in_fp32():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_jetrl.actor.fp8_layers import _rotary, rope_cos_sin
    from megatron_jetrl.actor.parallel import apply_cpu_patch_if_needed

    apply_cpu_patch_if_needed()
    s, d = 37, 128
    kwargs = (("rope_scaling", True), ("rope_scaling_factor", 8.0), ("rotary_base", 500000.0), ("rotary_percent", 1.0))
    cos, sin = rope_cos_sin(d, kwargs, s, torch.device("cpu"))
    freqs = _rotary(d, kwargs, torch.device("cpu")).get_emb(s)
    t = torch.randn(s, 2, 4, d, generator=torch.Generator().manual_seed(0))
    assert torch.equal(fused.fused_rope(t, cos, sin), _apply_rotary_pos_emb_bshd(t, freqs))
    assert torch.equal(fused.rope(t, cos, sin)[0], t[0])  # position 0: no rotation


def test_rms_norm_is_the_hf_formula():
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    w = torch.rand(64, generator=torch.Generator().manual_seed(2)).bfloat16()
    h = x.float()
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(fused.fused_rms_norm(x, w, 1e-6), want)


def test_a_failed_compile_names_model_fused(monkeypatch):
    from torch._dynamo.exc import BackendCompilerFailed

    def broken_compile(fn, **kwargs):
        def raise_(*args):
            raise BackendCompilerFailed(lambda: None, RuntimeError("no working C compiler"), None)

        return raise_

    monkeypatch.setattr(torch, "compile", broken_compile)
    run = fused.on_cuda_compiled(fused.rms_norm)
    with pytest.raises(RuntimeError, match=r"(?s)fused rms_norm kernel.*no working C compiler.*model\.fused=false"):
        run(types.SimpleNamespace(is_cuda=True), None, 1e-6)


def test_rollout_glue_forms_on_the_cpu_and_a_bad_residual():
    """The vLLM glue's forms (`fused_add_rms_norm`, `fused_rope_at`) are the two-step formulas on the CPU (their CUDA
    kernels: tests/gpu/test_fused.py); the kernel's wrapper refuses a residual it cannot read in place."""
    from megatron_jetrl.actor import glue_kernels
    from megatron_jetrl.actor.fp8_layers import rope_cos_sin

    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(5, 256, generator=g).bfloat16() for _ in range(2))
    w = (1 + 0.1 * torch.randn(256, generator=g)).bfloat16()
    y, h = fused.fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, x + r) and torch.equal(y, fused.rms_norm(x + r, w, 1e-6))
    cos, sin = rope_cos_sin(128, (("rotary_base", 1e6), ("rotary_percent", 1.0)), 64, torch.device("cpu"))
    pos = torch.tensor([7, 0, 63, 7, 30])
    t = torch.randn(5, 1, 4, 128, generator=g).bfloat16()
    assert torch.equal(fused.fused_rope_at(t, cos, sin, pos), fused.rope(t, cos[pos], sin[pos]))
    with pytest.raises(ValueError, match=r"contiguous residual of x's shape and dtype, got \(5, 128\)"):
        glue_kernels.add_rms_norm(x, r[:, :128], w, 1e-6)
