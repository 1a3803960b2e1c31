"""Native rollout engine: FP8 forward through fp8_linear_forward, KV-cache decode == score, disk == live,
sampling, and refusal of bad weight updates."""

import json

import pytest
import torch
import torch.nn.functional as F

from megatron_jetrl.fp8 import PrecisionFlow, QuantizedWeight, dequantize_blockwise, fp8_linear_forward
from megatron_jetrl.models import ModelArch, from_hf, hf_tensors, model_entries
from megatron_jetrl.models import batch_invariant_ops as ops
from megatron_jetrl.rollout import NativeEngine, SamplingParams, WeightUpdateError, expected_tensors
from megatron_jetrl.rollout.sampling import sample_tokens, sequence_generator, top_p_filter

JETRL, BF16 = PrecisionFlow("jetrl"), PrecisionFlow("bf16")


def tiny_config(model_type="qwen3", **overrides):
    config = dict(
        model_type=model_type,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=300,
        max_position_embeddings=256,
        eos_token_id=299,
    )
    if model_type == "llama":
        config["rope_scaling"] = dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
        )
    config.update(overrides)
    return config


def bf16_state(arch, seed=0):
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, (shape, _) in expected_tensors(arch, BF16).items():
        if "norm" in name:
            t = 1 + 0.1 * torch.randn(shape, generator=g)
        elif "embed" in name:
            t = torch.randn(shape, generator=g)
        elif "lm_head" in name:
            t = torch.randn(shape, generator=g) * (3 / shape[-1] ** 0.5)
        else:
            t = torch.randn(shape, generator=g) * (0.5 / shape[-1] ** 0.5 if len(shape) == 2 else 0.05)
        state[name] = t.to(torch.bfloat16)
    return state


def live_stream(arch, state, flow):
    """The trainer's export stream: Megatron tensors fused by the mapping table, through `hf_tensors`."""
    entries = model_entries(arch)
    megatron = {e.megatron: from_hf(e, arch, {n: state[n] for n in e.hf}) for e in entries}
    return hf_tensors(arch, flow, entries, lambda name: [megatron[name]])


def make_engine(model_type="qwen3", flow=JETRL, seed=0, **kwargs):
    config = tiny_config(model_type)
    arch = ModelArch.from_hf_config(config)
    engine = NativeEngine(arch, flow, eos_token_ids=[config["eos_token_id"]], **kwargs)
    engine.update_weights(live_stream(arch, bf16_state(arch, seed), flow), require_complete=True)
    return engine


def write_checkpoint(path, config, tensors, flow, shards=1):
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    qc = flow.quantization_config()
    (path / "config.json").write_text(json.dumps(dict(config, **({"quantization_config": qc} if qc else {}))))
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(path / "model.safetensors"))
        return
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        save_file({n: tensors[n].contiguous() for n in part}, str(path / file))
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ---- (a) the forward is fp8_linear_forward on the shipped bytes ----------------------------------------


def reference_logits(arch, state, tokens, flow):
    """One sequence, no cache, no batching: every linear is fp8_linear_forward on the HF bytes (or F.linear-
    equivalent BF16), everything else the engine's batch-invariant primitives."""
    p, a = state, arch

    def linear(x, name):
        bias = p.get(name + ".bias")
        if flow.rollout_fp8:
            return fp8_linear_forward(x, QuantizedWeight(p[name + ".weight"], p[name + ".weight_scale_inv"]), bias, flow=flow)
        return ops.bi_linear(x, p[name + ".weight"], bias)

    t = len(tokens)
    ids = torch.tensor(tokens)[None]
    pos = torch.arange(t)[None]
    cos, sin = ops.rope_tables(a.head_dim, t, a.rope_theta, a.rope_scaling, "cpu")
    cos, sin = cos[pos], sin[pos]
    h = p["model.embed_tokens.weight"][ids]
    for i in range(a.num_layers):
        pre = f"model.layers.{i}."
        x = ops.rms_norm(h, p[pre + "input_layernorm.weight"], a.rms_norm_eps)
        q = linear(x, pre + "self_attn.q_proj").view(1, t, a.num_heads, a.head_dim)
        k = linear(x, pre + "self_attn.k_proj").view(1, t, a.num_kv_heads, a.head_dim)
        v = linear(x, pre + "self_attn.v_proj").view(1, t, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q = ops.rms_norm(q, p[pre + "self_attn.q_norm.weight"], a.rms_norm_eps)
            k = ops.rms_norm(k, p[pre + "self_attn.k_norm.weight"], a.rms_norm_eps)
        q, k = ops.apply_rope(q.transpose(1, 2), cos, sin), ops.apply_rope(k.transpose(1, 2), cos, sin)
        o = ops.attention(q, k, v.transpose(1, 2), pos, torch.tensor([t]))
        h = h + linear(o.transpose(1, 2).reshape(1, t, -1), pre + "self_attn.o_proj")
        x = ops.rms_norm(h, p[pre + "post_attention_layernorm.weight"], a.rms_norm_eps)
        h = h + linear(ops.silu(linear(x, pre + "mlp.gate_proj")) * linear(x, pre + "mlp.up_proj"), pre + "mlp.down_proj")
    h = ops.rms_norm(h, p["model.norm.weight"], a.rms_norm_eps)
    return ops.bi_linear(h, p["lm_head.weight"]).float()[0]


def plain_logits(arch, state, tokens):
    """Textbook HF-style forward in FP32 on dequantized weights (SDPA, F.linear): a semantic check only."""
    p, a = state, arch

    def w(name):
        if name + ".weight_scale_inv" in p:
            return dequantize_blockwise(p[name + ".weight"], p[name + ".weight_scale_inv"], (128, 128))
        return p[name + ".weight"].float()

    def lin(x, name):
        b = p.get(name + ".bias")
        return F.linear(x, w(name), None if b is None else b.float())

    def norm(x, weight):
        return weight.float() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + a.rms_norm_eps)

    t = len(tokens)
    cos, sin = ops.rope_tables(a.head_dim, t, a.rope_theta, a.rope_scaling, "cpu")

    def rope(x):
        half = a.head_dim // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    h = p["model.embed_tokens.weight"].float()[torch.tensor(tokens)]
    for i in range(a.num_layers):
        pre = f"model.layers.{i}."
        x = norm(h, p[pre + "input_layernorm.weight"])
        q = lin(x, pre + "self_attn.q_proj").view(t, a.num_heads, a.head_dim)
        k = lin(x, pre + "self_attn.k_proj").view(t, a.num_kv_heads, a.head_dim)
        v = lin(x, pre + "self_attn.v_proj").view(t, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = norm(q, p[pre + "self_attn.q_norm.weight"]), norm(k, p[pre + "self_attn.k_norm.weight"])
        q, k = rope(q.transpose(0, 1)), rope(k.transpose(0, 1)).repeat_interleave(a.q_per_group, 0)
        o = F.scaled_dot_product_attention(q, k, v.transpose(0, 1).repeat_interleave(a.q_per_group, 0), is_causal=True)
        h = h + lin(o.transpose(0, 1).reshape(t, -1), pre + "self_attn.o_proj")
        x = norm(h, p[pre + "post_attention_layernorm.weight"])
        h = h + lin(F.silu(lin(x, pre + "mlp.gate_proj")) * lin(x, pre + "mlp.up_proj"), pre + "mlp.down_proj")
    return F.linear(norm(h, p["model.norm.weight"]), p["lm_head.weight"].float())


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
def test_jetrl_forward_is_fp8_linear_forward_on_shipped_bytes(model_type):
    engine = make_engine(model_type)
    tokens = [5, 17, 42, 3, 250, 7, 99, 11, 64]
    t = len(tokens)
    hidden = engine.hidden_states(torch.tensor([tokens]), torch.arange(t)[None], torch.tensor([t]))
    got = engine.logits(hidden)[0]
    ref = reference_logits(engine.arch, engine.state_dict(), tokens, JETRL)
    assert torch.equal(got, ref)
    # the same semantics as a textbook FP32 forward on the dequantized weights (BF16 rounding apart)
    plain = plain_logits(engine.arch, engine.state_dict(), tokens)
    assert (got - plain).abs().max() < 0.1 * plain.abs().max()
    # and the FP8 flow is not the BF16 one: same BF16 master weights, different logits
    bf16 = make_engine(model_type, BF16)
    bf16_logits = bf16.logits(bf16.hidden_states(torch.tensor([tokens]), torch.arange(t)[None], torch.tensor([t])))[0]
    assert torch.equal(reference_logits(bf16.arch, bf16.state_dict(), tokens, BF16), bf16_logits)
    assert not torch.equal(got, bf16_logits)
    assert (got - bf16_logits).abs().max() < 0.1 * bf16_logits.abs().max()


def test_engine_weights_are_the_trainers_bytes():
    config = tiny_config()
    arch = ModelArch.from_hf_config(config)
    state = bf16_state(arch)
    engine = make_engine()
    w = state["model.layers.1.mlp.down_proj.weight"]
    q = QuantizedWeight.quantize(w, JETRL)
    assert torch.equal(engine.params["model.layers.1.mlp.down_proj.weight"].view(torch.uint8), q.q.view(torch.uint8))
    assert torch.equal(engine.params["model.layers.1.mlp.down_proj.weight_scale_inv"], q.s)


# ---- (b) KV-cache decode == teacher-forced score, whatever the batch -----------------------------------


@pytest.mark.parametrize("flow", [JETRL, BF16], ids=["jetrl", "bf16"])
def test_decode_logprobs_equal_score_bitwise_across_batches(flow):
    engine = make_engine("qwen2", flow)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12]]
    outs = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=3, ignore_eos=True))
    seqs = [(o.prompt_token_ids, c) for o in outs for c in o.completions]
    batched = engine.score([p + c.token_ids for p, c in seqs])
    for (prompt, c), scored in zip(seqs, batched):
        assert len(c.logprobs) == 6
        assert scored[len(prompt) - 1 :] == c.logprobs  # bitwise: Python floats compare exactly
        alone = engine.score([prompt + c.token_ids])[0]
        assert alone == scored
    # a sequence generated alone samples and scores the same as inside the batch above
    solo = engine.generate([prompts[1]], SamplingParams(n=2, max_new_tokens=6, ignore_eos=True), request_seeds=[4])
    assert [c.token_ids for c in solo[0].completions] == [c.token_ids for c in outs[1].completions]
    assert [c.logprobs for c in solo[0].completions] == [c.logprobs for c in outs[1].completions]


def test_library_kernels_path_is_close_but_not_required_exact():
    exact, fast = make_engine("qwen3"), make_engine("qwen3", batch_invariant=False)
    seq = [[3, 1, 4, 1, 5, 9, 2, 6]]
    a, b = torch.tensor(exact.score(seq)[0]), torch.tensor(fast.score(seq)[0])
    assert (a - b).abs().max() < 2e-2 * a.abs().max()
    # its KV-cache decode (grouped-query attention read in place over a span of the cache, rows of different
    # lengths, some finishing early) reports what the exact engine scores for the same tokens, within that bound
    prompts = [[3, 1, 4], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8], [5]]
    outs = fast.generate(prompts, SamplingParams(n=2, max_new_tokens=12, seed=1, stop_token_ids=(7, 11)))
    seqs = [(o.prompt_token_ids, c) for o in outs for c in o.completions]
    assert len({len(c.token_ids) for _, c in seqs}) > 1  # some rows stopped early
    for (prompt, c), scored in zip(seqs, exact.score([p + c.token_ids for p, c in seqs])):
        ref = torch.tensor(scored[len(prompt) - 1 :])
        assert (torch.tensor(c.logprobs) - ref).abs().max() < 2e-2 * ref.abs().max()


def test_library_kernels_path_normalizes_as_the_trainer_not_as_torchs_rms_norm():
    """The fast path's RMSNorm is the trainer's (`actor.fused`: the normalized row rounded to BF16, then the weight).
    torch's `F.rms_norm` (and vLLM 0.26's kernel, measured on the GPU) rounds once, at the end: a quarter of the
    outputs differ by an ulp, and each such difference can move a whole E4M3 step in the next quantized GEMM input."""
    from megatron_jetrl.actor.fused import rms_norm

    fast = make_engine("qwen3", batch_invariant=False)
    name, eps = "model.layers.0.input_layernorm.weight", fast.arch.rms_norm_eps
    x = (torch.randn(3, 5, fast.arch.hidden_size, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    w = fast.params[name]
    got = fast._norm(x, name)
    assert torch.equal(got, rms_norm(x, w, eps))
    assert (got != torch.nn.functional.rms_norm(x, x.shape[-1:], w, eps)).float().mean() > 0.1


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_library_kernels_path_rotates_as_the_trainers_attention(family):
    """The fast path's RoPE is the trainer's SDPAttention's: megatron's FP32 tables (`rope_cos_sin`, llama3 scaling
    included) and `actor.fused.rope`, at each token's own position. The batch-invariant path keeps its FP64-angle
    tables, which differ from megatron's in some rotated outputs."""
    from megatron_jetrl.actor.fp8_layers import rope_cos_sin, rope_key
    from megatron_jetrl.actor.fused import rope

    config = tiny_config(family)
    if family == "llama":  # factors megatron implements (tiny_config's are HF-only: those keep FP64 tables)
        config["rope_scaling"]["original_max_position_embeddings"] = 8192
    arch = ModelArch.from_hf_config(config)
    fast, exact = (NativeEngine(arch, JETRL, batch_invariant=bi, eos_token_ids=[299]) for bi in (False, True))
    a, t = fast.arch, 40
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, t, a.num_heads + a.num_kv_heads, a.head_dim, generator=g) * 4).bfloat16()
    positions = torch.stack([torch.arange(t), torch.arange(t) + 7])  # rows at different positions
    cos_t, sin_t = fast._rope_tables(t + 7)
    got = fast._rotate(x, cos_t[positions], sin_t[positions])
    cos, sin = rope_cos_sin(a.head_dim, rope_key(a), t + 7, torch.device("cpu"))
    for row in range(2):
        want = rope(x[row].unsqueeze(1), cos[positions[row]], sin[positions[row]]).squeeze(1).transpose(0, 1)
        assert torch.equal(got[row], want)
    cos_e, sin_e = exact._rope_tables(t + 7)
    assert torch.equal(
        exact._rotate(x, cos_e[positions], sin_e[positions]),
        ops.apply_rope(x.transpose(1, 2), cos_e[positions], sin_e[positions]),
    )


# ---- (c) disk == live ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 3])
def test_load_from_disk_equals_live_update(tmp_path, shards):
    config = tiny_config("qwen3")
    arch = ModelArch.from_hf_config(config)
    live = make_engine("qwen3")
    write_checkpoint(tmp_path / "ckpt", config, dict(live_stream(arch, bf16_state(arch), JETRL)), JETRL, shards)
    disk = NativeEngine.from_pretrained(tmp_path / "ckpt")
    assert disk.flow.rollout_fp8 and disk.eos_token_ids == (299,)
    a, b = live.state_dict(), disk.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    seq = [[7, 8, 9, 10, 11, 12]]
    assert live.score(seq) == disk.score(seq)


def test_checkpoint_precision_must_match_flow(tmp_path):
    config = tiny_config()
    arch = ModelArch.from_hf_config(config)
    write_checkpoint(tmp_path / "bf16", config, bf16_state(arch), BF16)
    with pytest.raises(ValueError, match="no quantization_config.*jetrl"):
        NativeEngine.from_pretrained(tmp_path / "bf16", JETRL)
    assert not NativeEngine.from_pretrained(tmp_path / "bf16").flow.rollout_fp8
    write_checkpoint(tmp_path / "fp8", config, dict(live_stream(arch, bf16_state(arch), JETRL)), JETRL)
    with pytest.raises(ValueError, match="scale_fmt"):
        NativeEngine.from_pretrained(tmp_path / "fp8", PrecisionFlow("jetrl", scale_mode="ue8m0"))


# ---- (d) sampling --------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    engine = make_engine("llama")
    sp = SamplingParams(n=3, temperature=1.0, max_new_tokens=5, seed=11, ignore_eos=True)
    a = engine.generate([[1, 2], [3, 4, 5]], sp)
    b = engine.generate([[1, 2], [3, 4, 5]], sp)
    assert [[c.token_ids for c in o.completions] for o in a] == [[c.token_ids for c in o.completions] for o in b]
    toks = [c.token_ids for c in a[0].completions]
    assert len({tuple(t) for t in toks}) > 1  # the n samples of a request differ
    other = engine.generate([[1, 2]], SamplingParams(n=3, max_new_tokens=5, seed=12, ignore_eos=True))
    assert [c.token_ids for c in other[0].completions] != toks
    assert [o.request_seed for o in a] == [11, 12]


def test_greedy_and_top_p_semantics():
    engine = make_engine("qwen3")
    greedy = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))[0].completions[0]
    # greedy picks the argmax of the raw logprob at every step, so its logprob is the row maximum
    scored = engine.score([[5, 6, 7] + greedy.token_ids])[0][2:]
    assert scored == greedy.logprobs
    tiny_p = engine.generate([[5, 6, 7]], SamplingParams(top_p=1e-6, max_new_tokens=4, seed=1, ignore_eos=True))[0].completions[0]
    assert tiny_p.token_ids == greedy.token_ids

    probs = torch.tensor([0.1, 0.6, 0.3])
    assert torch.equal(top_p_filter(probs, 0.5), torch.tensor([0.0, 1.0, 0.0]))
    assert torch.allclose(top_p_filter(probs, 0.8), torch.tensor([0.0, 2 / 3, 1 / 3]))
    assert torch.equal(top_p_filter(probs, 1.0), probs)
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2])).expand(3000, 3)

    def draw(temperature):  # 3000 sequences of one request, one token each
        return sample_tokens(logits, temperature, 1.0, [sequence_generator(0, j) for j in range(3000)])

    assert torch.allclose(torch.bincount(draw(1.0), minlength=3) / 3000, torch.tensor([0.5, 0.3, 0.2]), atol=0.04)
    assert (torch.bincount(draw(100.0), minlength=3) / 3000 - 1 / 3).abs().max() < 0.04  # high temperature flattens
    assert set(draw(0.01).tolist()) == {0}
    assert torch.equal(
        top_p_filter(torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]), 0.5), torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    )  # row-wise
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_a_rows_token_does_not_depend_on_its_batch(temperature, top_p):
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(3)) * 4
    batched = sample_tokens(logits, temperature, top_p, [sequence_generator(9, j) for j in range(6)])
    alone = [int(sample_tokens(logits[j : j + 1], temperature, top_p, [sequence_generator(9, j)])) for j in range(6)]
    assert batched.tolist() == alone
    with pytest.raises(ValueError, match="2 generators for 6 rows"):
        sample_tokens(logits, 1.0, 1.0, [sequence_generator(9, 0)] * 2)


class Letters:
    def decode(self, ids):
        return "".join(chr(97 + t % 26) for t in ids)


def test_stop_token_ids_eos_and_stop_strings():
    engine = make_engine("qwen3", tokenizer=Letters())
    free = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))[0].completions[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    stop_tok = free.token_ids[3]
    first = free.token_ids.index(stop_tok)
    c = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(stop_tok,)))[0].completions[
        0
    ]
    assert c.token_ids == free.token_ids[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_tok
    assert c.logprobs == free.logprobs[: first + 1]
    engine.eos_token_ids = (stop_tok,)  # EOS from config.json works the same way, and ignore_eos turns it off
    c = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=8))[0].completions[0]
    assert c.token_ids == free.token_ids[: first + 1] and c.finish_reason == "stop" and c.stop_reason is None
    engine.eos_token_ids = ()
    text = Letters().decode(free.token_ids)
    stop = text[4:6]
    at = text.find(stop)
    c = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=8, stop=stop))[0].completions[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and c.text == text[:at]
    assert c.token_ids == free.token_ids[: at + len(stop)]
    with pytest.raises(ValueError, match="tokenizer"):
        make_engine("qwen3").generate([[1]], SamplingParams(stop="x"))


# ---- (e) refusing bad updates --------------------------------------------------------------------------


def _snapshot(engine):
    return {n: t.view(torch.uint8).clone() if t.dtype == torch.float8_e4m3fn else t.clone() for n, t in engine.params.items()}


def test_update_weights_refuses_bad_batches_and_applies_nothing():
    engine = make_engine("qwen2")
    before = _snapshot(engine)
    arch = engine.arch
    fresh = dict(live_stream(arch, bf16_state(arch, seed=1), JETRL))
    good = [
        (n, fresh[n])
        for n in ("model.norm.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight_scale_inv")
    ]
    cases = {
        r"model\.layers\.0\.mlp\.upp_proj\.weight: not a tensor .*did you mean 'model\.layers\.0\.mlp\.up_proj\.weight'": [
            ("model.layers.0.mlp.upp_proj.weight", fresh["model.layers.0.mlp.up_proj.weight"])
        ],
        r"q_proj\.bias: shape \(256,\), expected \(512,\)": [
            ("model.layers.0.self_attn.q_proj.bias", torch.zeros(256, dtype=torch.bfloat16))
        ],
        r"dtype torch\.uint8, expected torch\.float8_e4m3fn \(an FP8 byte view": [
            ("model.layers.1.mlp.down_proj.weight", fresh["model.layers.1.mlp.down_proj.weight"].view(torch.uint8)),
            ("model.layers.1.mlp.down_proj.weight_scale_inv", fresh["model.layers.1.mlp.down_proj.weight_scale_inv"]),
        ],
        r"lm_head\.weight: dtype torch\.float32, expected torch\.bfloat16": [("lm_head.weight", fresh["lm_head.weight"].float())],
        r"o_proj\.weight: FP8 weight without its .*o_proj\.weight_scale_inv.*missing scales": [
            ("model.layers.1.self_attn.o_proj.weight", fresh["model.layers.1.self_attn.o_proj.weight"])
        ],
        r"gate_proj\.weight_scale_inv: scales without their FP8 weight": [
            ("model.layers.1.mlp.gate_proj.weight_scale_inv", fresh["model.layers.1.mlp.gate_proj.weight_scale_inv"])
        ],
        r"scales must be finite and positive": [
            ("model.layers.1.mlp.gate_proj.weight", fresh["model.layers.1.mlp.gate_proj.weight"]),
            (
                "model.layers.1.mlp.gate_proj.weight_scale_inv",
                torch.zeros_like(fresh["model.layers.1.mlp.gate_proj.weight_scale_inv"]),
            ),
        ],
        r"dtype torch\.bfloat16, expected torch\.float8_e4m3fn": [
            ("model.layers.0.self_attn.k_proj.weight", torch.zeros(256, 256, dtype=torch.bfloat16)),
            ("model.layers.0.self_attn.k_proj.weight_scale_inv", fresh["model.layers.0.self_attn.k_proj.weight_scale_inv"]),
        ],
    }
    for pattern, bad in cases.items():
        with pytest.raises(WeightUpdateError, match=pattern) as info:
            engine.update_weights(good + bad)  # valid changes first: none of them may land
        assert "nothing was applied" in str(info.value)
        after = _snapshot(engine)
        assert all(torch.equal(before[n], after[n]) for n in before), pattern
    with pytest.raises(WeightUpdateError, match="sent twice"):
        engine.update_weights(good + good[:1])
    with pytest.raises(WeightUpdateError, match=r"missing \d+ tensor"):
        engine.update_weights(good, require_complete=True)
    engine.update_weights(good)  # a valid partial update lands
    assert torch.equal(engine.params["model.norm.weight"], fresh["model.norm.weight"])


def test_every_bad_scale_in_a_batch_is_named():
    """The scales of a batch are checked together (one host sync per device): each bad one is named, no good one."""
    engine = make_engine("qwen2")
    fresh = dict(live_stream(engine.arch, bf16_state(engine.arch, seed=1), JETRL))
    batch = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        base = f"model.layers.1.mlp.{proj}"
        batch[base + ".weight"], batch[base + ".weight_scale_inv"] = (
            fresh[base + ".weight"],
            fresh[base + ".weight_scale_inv"].clone(),
        )
    batch["model.layers.1.mlp.up_proj.weight_scale_inv"].view(-1)[-1] = float("nan")
    batch["model.layers.1.mlp.down_proj.weight_scale_inv"].view(-1)[0] = -1.0
    with pytest.raises(WeightUpdateError) as info:
        engine.update_weights(list(batch.items()))
    message = str(info.value)
    for proj, bad in (("gate_proj", False), ("up_proj", True), ("down_proj", True)):
        assert (f"mlp.{proj}.weight_scale_inv: scales must be finite and positive" in message) == bad, (proj, message)


def test_engine_without_weights_or_asleep_refuses_to_run():
    arch = ModelArch.from_hf_config(tiny_config())
    with pytest.raises(RuntimeError, match="no weights"):
        NativeEngine(arch, JETRL).generate([[1]])
    engine = make_engine()
    seq = [[1, 2, 3, 4]]
    before = engine.score(seq)
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.score(seq)
    engine.wake()
    assert engine.score(seq) == before


def test_good_scales_are_checked_in_one_concatenation(monkeypatch):
    """A batch whose scales are all fine is checked in one pass over their concatenation: no check per tensor (what
    names bad ones), which cost 15-25 ms of launches per sync at Qwen3-8B shapes."""
    from megatron_jetrl.rollout import native

    scales = {f"s{i}": torch.rand(3, i + 1) + 0.5 for i in range(5)}
    monkeypatch.setattr(torch, "stack", lambda *a, **k: pytest.fail("checked tensor by tensor"))
    assert native._invalid_scales(scales) == []
    monkeypatch.undo()
    scales["s3"][1, 2] = 0.0
    scales["s1"][0, 0] = float("inf")
    assert native._invalid_scales(scales) == ["s1", "s3"]
