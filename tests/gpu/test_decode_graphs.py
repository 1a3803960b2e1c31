"""The native engine's CUDA-graph decode (megatron_jetrl/rollout/decode_graphs.py) on the GPU.

* A replayed step is the eager step, bit for bit (same shapes: every row, the same span), in BF16 and in
  FP8, and it writes the same K/V into the cache; also after the span grows past SPAN_STEP (a second graph).
* generate() with graphs samples tokens whose reported logprobs agree with teacher-forced score() as well
  as the eager engine's do (a bound relative to the eager path, not an absolute one).
* NaN in the weights stops generate() with NonFiniteInputError naming the completions (graphs run the
  quantizer without its host-side check; the logits check replaces it).
"""

import importlib.util
import os

import pytest
import torch

from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.fp8.quant import NonFiniteInputError
from megatron_jetrl.models import ModelArch
from megatron_jetrl.rollout.decode_graphs import SPAN_STEP, DecodeGraphs
from megatron_jetrl.rollout.engine import SamplingParams
from megatron_jetrl.rollout.native import KVCache

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=1000)


@pytest.fixture(scope="module")
def engines():
    spec = importlib.util.spec_from_file_location("bench_rollout", os.path.join(ROOT, "tools", "bench", "bench_rollout.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    arch = ModelArch.from_hf_config(bench.hf_config(SHAPE, 3))
    bf16, fp8 = bench.build_engines(arch, PrecisionFlow("jetrl"), torch.device("cuda"), seed=0)
    assert bf16.cuda_graphs and fp8.cuda_graphs  # auto: CUDA and batch_invariant=False
    return {"bf16": bf16, "fp8": fp8}


@pytest.mark.parametrize("prec", ["bf16", "fp8"])
@torch.no_grad()
def test_replayed_step_is_the_eager_step_bit_for_bit(engines, prec):
    eng = engines[prec]
    b, prompt, capacity = 16, 12, 2 * SPAN_STEP + 8
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, eng.arch.vocab_size, (b, prompt), device="cuda", generator=g)
    caches = [KVCache(eng.arch, b, capacity, "cuda") for _ in range(2)]
    for cache in caches:
        eng.hidden_states(
            tokens,
            torch.arange(prompt, device="cuda").expand(b, prompt),
            torch.full((b,), prompt, device="cuda"),
            cache,
            span=prompt,
        )
    graphs = DecodeGraphs(eng, caches[0])
    for at in (prompt, prompt + 1, SPAN_STEP + 3):  # the last one needs the second graph (span 2 * SPAN_STEP)
        new = torch.randint(0, eng.arch.vocab_size, (b,), generator=g, device="cuda").tolist()
        got = graphs.step(new, [at] * b).clone()
        pos = torch.full((b, 1), at, device="cuda")
        span = -(-(at + 1) // SPAN_STEP) * SPAN_STEP
        want = eng.logits(
            eng.hidden_states(torch.tensor(new, device="cuda")[:, None], pos, pos[:, 0] + 1, caches[1], span=span)[:, 0]
        )
        assert torch.equal(got, want), (prec, at, (got - want).abs().max().item())
    assert sorted(graphs.graphs) == [SPAN_STEP, 2 * SPAN_STEP]
    for layer in range(eng.arch.num_layers):
        assert torch.equal(caches[0].k[layer], caches[1].k[layer]) and torch.equal(caches[0].v[layer], caches[1].v[layer])


def mismatch(eng, outs):
    seqs = [o.prompt_token_ids + c.token_ids for o in outs for c in o.completions]
    reported = [lp for o in outs for c in o.completions for lp in c.logprobs]
    scored = [
        lp
        for s, o_c in zip(eng.score(seqs), [(o, c) for o in outs for c in o.completions])
        for lp in s[len(o_c[0].prompt_token_ids) - 1 :]
    ]
    return max(abs(a - b) for a, b in zip(reported, scored))


@pytest.mark.parametrize("prec", ["bf16", "fp8"])
def test_generate_with_graphs_agrees_with_score_as_well_as_eager(engines, prec):
    eng = engines[prec]
    prompts = [[1, 2, 3, 4, 5], list(range(7, 40)), [9] * 20]  # rows of different lengths; 300 new crosses a span
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=300, seed=4, ignore_eos=True)
    with_graphs = eng.generate(prompts, sampling)
    eng.cuda_graphs = False
    try:
        eager = eng.generate(prompts, sampling)
    finally:
        eng.cuda_graphs = True
    for outs in (with_graphs, eager):
        assert all(len(c.token_ids) == 300 for o in outs for c in o.completions)
    graph_err, eager_err = mismatch(eng, with_graphs), mismatch(eng, eager)
    print(f"{prec}: max |reported - score| graphs {graph_err:.3g}, eager {eager_err:.3g}")
    assert graph_err <= 2 * eager_err + 1e-3


@torch.no_grad()
def test_nan_weights_stop_generate_naming_the_completions(engines):
    eng = engines["fp8"]
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    saved = eng.params[name].clone()
    eng.params[name][0, 0] = float("nan")
    eng._qweights.clear()
    try:
        with pytest.raises(NonFiniteInputError, match=r"NaN/Inf logits for completion\(s\) \[0, 1\]"):
            eng.generate([[1, 2, 3]], SamplingParams(n=2, max_new_tokens=4, seed=0))
    finally:
        eng.params[name].copy_(saved)
        eng._qweights.clear()
