"""The KL reference on the GPU in jetrl: its FP8 linears' BF16 weights wait in pinned host memory and only their FP8
bytes stay on the device (`actor.fp8_layers.offload_frozen_weights`, what `rl.session` does for every run with a KL
term). Device memory drops by the linears' BF16 bytes; the reference's logprobs equal the policy's bit for bit (the same
bytes); a new value loaded into it reaches its next forward, quantized on the device from the host copy."""

from __future__ import annotations

import pytest
import torch

from megatron_jetrl.fp8 import PrecisionFlow

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
JETRL = PrecisionFlow(mode="jetrl")


def test_the_offloaded_reference_frees_its_bf16_linears_and_computes_the_policys_logprobs(parallel):
    from gpu_helpers import build, logprobs, tokens

    from megatron_jetrl.actor.fp8_layers import _FP8Weight, offload_frozen_weights

    policy = build("local", JETRL)
    policy.cuda()
    reference = build("local", JETRL).cuda().eval().requires_grad_(False)
    reference.load_state_dict(policy.state_dict())
    linears = [m for m in reference.modules() if isinstance(m, _FP8Weight)]
    bf16_bytes = sum(m.weight.numel() * 2 for m in linears)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    freed = offload_frozen_weights(reference)
    torch.cuda.synchronize()
    assert freed == bf16_bytes
    assert before - torch.cuda.memory_allocated() >= 0.9 * bf16_bytes  # the FP8 bytes (quantized before) stay
    assert all(m.weight.device.type == "cpu" and m.weight.is_pinned() and m.fp8_device.type == "cuda" for m in linears)
    toks = tokens(seed=3)
    assert torch.equal(logprobs(policy, toks), logprobs(reference, toks))
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.25)
    reference.load_state_dict(policy.state_dict())  # as freeze_reference and a resume load it
    assert torch.equal(logprobs(policy, toks), logprobs(reference, toks))
