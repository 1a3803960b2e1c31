"""GPU smoke run of tools/bench/bench_rollout.py: the tiny model on CUDA, FP8 (jetrl) and BF16 engines both generate.

Batch 2 (auto falls back to Triton when cuBLASLt would get M=2) and batch 16 (the fastest backend the
GPU has, cuBLASLt on the H200); every row must come back with max_new_tokens in-vocab tokens and finite
logprobs, and both the model-step and the end-to-end numbers must be there.
"""

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench_module():
    spec = importlib.util.spec_from_file_location("bench_rollout", os.path.join(ROOT, "tools", "bench", "bench_rollout.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("batch", [2, 16])
def test_tiny_rollout_bench_generates_tokens_in_fp8_and_bf16(tmp_path, batch):
    out = tmp_path / "bench_rollout.json"
    res = bench_module().main(["--device", "cuda", "--tiny", "--batches", str(batch), "--json", str(out)])
    assert out.is_file()
    by_prec = {r["precision"]: r for r in res["results"]}
    assert set(by_prec) == {"fp8", "bf16"}
    for prec, r in by_prec.items():
        e2e = r["e2e"]
        assert isinstance(e2e, dict), (prec, e2e)
        assert e2e["tokens_ok"] and e2e["tokens_generated"] == batch * 4, (prec, e2e)
        assert e2e["decode_tok_s"] > 0 and e2e["prefill_tok_s"] > 0 and e2e["peak_GiB"] > 0
        assert r["model_decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
    assert res["fp8_backend"] != "emulated" and torch.cuda.is_available()
    q = res["ratios_fp8_over_bf16"][0]
    assert q["e2e_decode"] is not None and q["model_decode"] is not None
