"""The FP8 export through transformers' real FineGrainedFP8 kernels on the GPU, against our own FP8 forward.

transformers quantizes activations 1x128 on the fly and runs its block-FP8 matmul on the shipped
`weight` + `weight_scale_inv`; our native engine runs `fp8_linear_forward` (cuBLASLt) on the same bytes.
Both quantize the same operands, so they differ only by accumulation order and last-bit differences in
the activation scales; the dequantized-BF16 load skips activation quantization altogether and must be
clearly further away.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")
# transformers >= 5 runs FineGrainedFP8 through hub-fetched kernels (`kernels` 0.16.x downloads them at
# load): on a GPU host without network this test cannot run (seen on an H200 without network).
pytest.importorskip("kernels", reason="transformers' FP8 kernels come from the `kernels` package (hub download)")

from megatron_jetrl.convert import convert  # noqa: E402
from megatron_jetrl.convert.synthetic import save_synthetic_checkpoint, tiny_config  # noqa: E402
from megatron_jetrl.fp8 import PrecisionFlow  # noqa: E402
from megatron_jetrl.rollout.native import NativeEngine  # noqa: E402


def hf_logprobs(model, tokens):
    with torch.no_grad():
        logits = model(torch.tensor(tokens, device="cuda")).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.tensor(tokens, device="cuda")[:, 1:, None])[..., 0].cpu()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_transformers_fp8_kernels_match_our_fp8_forward(tmp_path, family):
    flow = PrecisionFlow(backend="auto")
    save_synthetic_checkpoint(tmp_path / "ckpt", tiny_config(family), tp=2, pp=1, seed=3, flow=flow)
    convert(tmp_path / "ckpt", tmp_path / "fp8")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 300, (16, 64), generator=g).tolist()

    fp8 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16).cuda()
    assert any("FP8" in type(m).__name__ for m in fp8.modules()), "transformers did not build FP8 linears"
    deq = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16
    ).cuda()
    ours = NativeEngine.from_pretrained(tmp_path / "fp8", flow, device="cuda", batch_invariant=False)
    a, c = hf_logprobs(fp8, tokens), hf_logprobs(deq, tokens)
    b = torch.tensor(ours.score(tokens))
    fp8_vs_ours = (a - b).abs().mean().item()
    fp8_vs_dequant = (a - c).abs().mean().item()
    print(f"{family}: mean |dlogp| transformers-FP8 vs ours {fp8_vs_ours:.3g}, vs dequantized BF16 {fp8_vs_dequant:.3g}")
    assert fp8_vs_ours < 0.5 * fp8_vs_dequant and fp8_vs_ours < 2e-2
