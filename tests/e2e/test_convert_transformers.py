"""The emitted FP8 checkpoint through an independent consumer: transformers' FineGrainedFP8 loader.

transformers reads the same block format as vLLM (`weight` E4M3 + `weight_scale_inv` [ceil(N/128),
ceil(K/128)], `quantization_config` with `weight_block_size: [128, 128]`); on CPU it dequantizes at load
(`FineGrainedFP8Config(dequantize=True)`, needs `accelerate`).
"""

import json

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from megatron_jetrl.convert import convert  # noqa: E402
from megatron_jetrl.convert.synthetic import save_synthetic_checkpoint, tiny_config  # noqa: E402
from megatron_jetrl.convert.verify import HFCheckpoint, compare_logits, verify_checkpoint  # noqa: E402
from megatron_jetrl.fp8 import PrecisionFlow, dequantize_blockwise  # noqa: E402


@pytest.mark.parametrize("family,scale_mode", [("qwen2", "fp32"), ("qwen3", "ue8m0"), ("llama", "fp32")])
def test_transformers_loads_fp8_export_bit_exact_and_logits_within_bound(tmp_path, family, scale_mode):
    save_synthetic_checkpoint(
        tmp_path / "ckpt", tiny_config(family), tp=2, pp=2, seed=7, flow=PrecisionFlow(scale_mode=scale_mode)
    )
    convert(tmp_path / "ckpt", tmp_path / "fp8", max_shard_size="700KB")
    convert(tmp_path / "ckpt", tmp_path / "bf16", dtype="bf16")
    assert len(json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]) > 0

    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16
    )
    state = model.state_dict()
    ckpt = HFCheckpoint(tmp_path / "fp8")
    fp8_names = [n.removesuffix("_scale_inv") for n in ckpt.weight_map if n.endswith("weight_scale_inv")]
    assert len(fp8_names) == 14
    for name in fp8_names:  # each dequantized weight is (q * s) per 128x128 block, rounded to BF16, bit for bit
        q, s = ckpt.get(name), ckpt.get(name + "_scale_inv")
        expected = dequantize_blockwise(q, s, (128, 128)).to(torch.bfloat16)
        assert state[name].dtype == torch.bfloat16 and torch.equal(state[name].view(torch.int16), expected.view(torch.int16)), (
            name
        )
    bf16 = HFCheckpoint(tmp_path / "bf16")
    for name in bf16.weight_map:
        if name not in fp8_names and name in state:  # embeddings, norms, biases, lm_head: untouched BF16
            assert torch.equal(state[name].view(torch.int16), bf16.get(name).view(torch.int16)), name

    report = verify_checkpoint(tmp_path / "fp8", rollout_tps=(1, 2), reference=tmp_path / "bf16")
    assert report.ok, report.problems
    logits = compare_logits(tmp_path / "fp8", tmp_path / "bf16", report)
    assert logits["exact_vs_dequantized_bf16"]  # same program + bf16(q*s) weights -> identical logits
    assert logits["within_bound"], logits
    assert 0 < logits["rel_l2"] < logits["bound"] < 0.25
