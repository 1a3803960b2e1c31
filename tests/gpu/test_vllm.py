"""vLLM 0.26.0 as the rollout engine, on the GPU (run with the kit: shared/kits/README.md; tools/gpu/gpu_vllm.sh).

One colocated engine in this process (external launcher on a one-rank NCCL group, as the trainer runs it), a
random Qwen3-shaped model (4 layers, hidden 1024). Checked:
* start-up conformance: the kernel class of every FP8 linear, UE8M0 off, the activation quantizer probe, the glue
  (`rollout.glue`: the trainer's RMSNorm and RoPE return the trainer's bytes); the same read-back refuses the running
  engine for a flow with another scale mode, and a BF16 plan for its FP8 params;
* the on-device sync: every vLLM parameter holds the trainer's bytes (read back independently of the sync's own
  check), an update with a bad scale is refused with nothing written, and the engine still serves;
* sleep(level 2) -> wake weights -> sync -> wake KV cache: greedy generations equal those before the sleep;
* a new update drops the prefix cache (KV blocks of the old weights are not reused);
* vLLM's sampled-token logprobs against the native FP8 engine's teacher-forced scores on the same bytes
  (two programs, one flow: bounded, reported).
"""

import importlib.util
import json
import os
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
        reason="needs a CUDA GPU and vLLM 0.26.0 (shared/kits/vllm)",
    ),
]

CONFIG = dict(
    model_type="qwen3",
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    vocab_size=1024,
    max_position_embeddings=512,
    eos_token_id=1023,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
ENGINE = {
    **dict(seed=0, kv_cache_memory_bytes=2 << 30, gpu_memory_utilization=0.5, enforce_eager=True, max_model_len=512),
    **json.loads(os.environ.get("JETRL_VLLM_TEST_ENGINE", "{}")),
}
"""`VllmEngine` settings of the GPU tests (test_te_vllm.py starts its engine with these too). JETRL_VLLM_TEST_ENGINE
(JSON) overrides them, e.g. '{"enforce_eager": false}': the whole module with full decode CUDA graphs (the default
glue is the trainer's), '{"glue": "vllm"}': on vLLM's own RMSNorm and RoPE, or '{"fused_quant": false}': with vLLM's
own activation quantizer instead of the trainer's norm and SiLU writing the FP8 input (`rollout.vllm_fused_quant`)."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import torch.distributed as dist

    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.models import ModelArch
    from megatron_jetrl.rollout.vllm_engine import VllmEngine, write_model_dir

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29611", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    flow = PrecisionFlow("jetrl")
    arch = ModelArch.from_hf_config(CONFIG)
    model_dir = write_model_dir(tmp_path_factory.mktemp("vllm_model"), CONFIG, flow)
    engine = VllmEngine(model_dir, flow, eos_token_ids=[1023], **ENGINE)
    return engine, arch, flow


def stream(arch, flow, seed):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit"))
    from test_rollout_native import bf16_state, live_stream

    state = {k: v.cuda() for k, v in bf16_state(arch, seed).items()}
    return dict(live_stream(arch, state, flow))


def prompts(n=6, vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def test_startup_conformance_is_read_back_from_the_engine(setup):
    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.rollout.vllm_checks import EngineConformanceError, check_numerics
    from megatron_jetrl.rollout.vllm_params import copy_plan

    engine, arch, flow = setup
    print("numerics:", engine.numerics)
    assert engine.numerics["fp8_linears"] == 4 * arch.num_layers and engine.numerics["probed"] >= 1
    assert set(engine.numerics["kernels"]) <= {"DeepGemmFp8BlockScaledMMKernel", "CutlassFp8BlockScaledMMKernel"}
    glue = engine.numerics["glue"]
    if glue["mode"] == "trainer":  # the start-up probe refuses any difference; read it back independently too
        from megatron_jetrl.rollout import vllm_glue

        assert not any(glue["differ"].values())
        assert not any(vllm_glue.probe(engine.model.model.layers[-1], arch, "cuda").values())
        # the FP8 activation quantization fused into the norm and SiLU (the default) gives the quantizer's bytes and
        # the linear takes them; with JETRL_VLLM_TEST_ENGINE='{"fused_quant": false}' the engine has no such modules
        if ENGINE.get("fused_quant", True):
            want = {"norm_quant": 0.0, "silu_mul_quant": 0.0, "mlp_took_stash": 1.0, "mlp_output": 0.0}
            assert glue["fused_quant"] == want and vllm_glue.probe_fused(engine.model.model.layers[-1], arch, "cuda") == want
        else:
            assert glue["fused_quant"] is None
        if not ENGINE["enforce_eager"]:
            assert engine.numerics["compilation"]["cudagraph_mode"].endswith("FULL_DECODE_ONLY")
    else:
        assert glue["differ"]["rms_norm"] > 0.05  # vLLM's own kernel rounds once (25% measured at hidden 2048)
    with pytest.raises(EngineConformanceError, match="use_ue8m0=False.*ue8m0"):
        check_numerics(engine.model, PrecisionFlow("jetrl", scale_mode="ue8m0"), None, compiled=False)
    with pytest.raises(
        EngineConformanceError, match=r"qkv_proj.weight: vLLM holds \(1536, 1024\) torch.float8_e4m3fn .*bfloat16"
    ):
        copy_plan(arch, PrecisionFlow("bf16"), engine.params)


def test_sync_puts_the_trainers_bytes_in_every_vllm_parameter(setup):
    from gpu_helpers import vllm_bytes

    engine, arch, flow = setup
    batch = stream(arch, flow, seed=1)
    engine.update_weights(batch.items())
    for hf_name, (same, n) in vllm_bytes(engine, arch, batch).items():
        assert same == n, f"{hf_name}: {n - same} of {n} bytes differ"
    assert len(engine.plan) == len(batch)


def test_a_bad_update_is_refused_whole_and_the_engine_keeps_serving(setup):
    from megatron_jetrl.rollout.engine import SamplingParams
    from megatron_jetrl.rollout.native import WeightUpdateError

    engine, arch, flow = setup
    engine.update_weights(stream(arch, flow, seed=2).items())
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    before = [o.completions[0].token_ids for o in engine.generate(prompts(), greedy)]
    bad = stream(arch, flow, seed=3)
    name = "model.layers.2.mlp.down_proj.weight_scale_inv"
    bad[name] = bad[name].clone()
    bad[name][0, 0] = float("nan")
    with pytest.raises(WeightUpdateError, match="down_proj.weight_scale_inv: scales must be finite"):
        engine.update_weights(bad.items())
    assert [o.completions[0].token_ids for o in engine.generate(prompts(), greedy)] == before


def test_an_update_drops_kv_blocks_cached_with_the_old_weights(setup):
    from megatron_jetrl.rollout.engine import SamplingParams

    engine, arch, flow = setup
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    long = [list(range(100, 180)), list(range(300, 390))]  # several full KV blocks: prefix-cache hits
    engine.update_weights(stream(arch, flow, seed=6).items())
    engine.generate(long, greedy)
    engine.update_weights(stream(arch, flow, seed=7).items())
    warm = [o.completions[0].token_ids for o in engine.generate(long, greedy)]
    engine.llm.reset_prefix_cache()
    assert [o.completions[0].token_ids for o in engine.generate(long, greedy)] == warm


def test_sleep_wake_sync_cycle_restores_the_same_generations(setup):
    from megatron_jetrl.rollout.colocated import ColocatedPool
    from megatron_jetrl.rollout.engine import SamplingParams

    engine, arch, flow = setup
    batch = stream(arch, flow, seed=4)
    engine.update_weights(batch.items())
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    before = [o.completions[0].token_ids for o in engine.generate(prompts(), greedy)]
    pool = ColocatedPool(engine)
    free_awake = torch.cuda.mem_get_info()[0]
    assert engine.unmapped_bytes() == 0
    pool.sleep()
    freed = torch.cuda.mem_get_info()[0] - free_awake
    print(f"sleep(level=2) freed {freed / 2**30:.2f} GiB")
    assert freed > 0.9 * (2 << 30)  # at least the KV cache
    # what the loop's memory peaks leave out while the engine sleeps: every allocation, all of it freed on the device
    assert engine.unmapped_bytes() == engine.mapped_bytes() == pool.wake_bytes and freed >= 0.9 * pool.wake_bytes
    stats = pool.sync(batch.items())
    assert engine.unmapped_bytes() == 0
    print(f"sync: {stats.tensors} tensors, {stats.bytes / 2**20:.1f} MiB in {stats.seconds * 1e3:.1f} ms")
    after = [o.completions[0].token_ids for o in pool.generate(prompts(), greedy)]
    assert after == before


def test_vllm_logprobs_against_the_native_fp8_engine_on_the_same_bytes(setup):
    from megatron_jetrl.rollout.engine import SamplingParams
    from megatron_jetrl.rollout.native import NativeEngine

    engine, arch, flow = setup
    batch = stream(arch, flow, seed=5)
    engine.update_weights(batch.items())
    native = NativeEngine(arch, flow, device="cuda", batch_invariant=False, cuda_graphs=False)
    native.update_weights(batch.items(), require_complete=True)
    outs = engine.generate(prompts(16), SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True, seed=7))
    seqs = [o.prompt_token_ids + c.token_ids for o in outs for c in o.completions]
    theirs = [lp for o in outs for c in o.completions for lp in c.logprobs]
    ours = [lp for o, s in zip(outs, native.score(seqs)) for lp in s[len(o.prompt_token_ids) - 1 :]]
    diff = torch.tensor(theirs) - torch.tensor(ours)
    print(
        f"vLLM FP8 vs native FP8, same bytes: mean |dlogp| {diff.abs().mean():.4f}, max {diff.abs().max():.4f}, "
        f"{len(diff)} tokens"
    )
    assert diff.abs().mean() < 0.5 and torch.isfinite(diff).all()


def test_seeded_tokens_depend_on_the_seed_not_the_batch(setup):
    """With the seeded-sampling patch (patches/vllm_0_26_0_seeded_sampling.py, applied by the engine) a request's
    tokens follow from its seed and its own logits: the same on a second run, another seed gives other tokens, and
    alone it starts as in a batch of 8 (vLLM's GEMMs need not give a row the same bits at another batch size, so only
    the first tokens are compared). The patch's kernel equals its Python reference."""
    import importlib

    from megatron_jetrl.patching import load_patch
    from megatron_jetrl.rollout.engine import SamplingParams

    patch = load_patch("vllm_0_26_0_seeded_sampling")
    assert importlib.import_module(patch.MODULE).random_sample is patch.seeded_random_sample
    engine, arch, flow = setup
    engine.update_weights(stream(arch, flow, seed=8).items())
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    ps = prompts(8, seed=3)
    seeds = [100 + i for i in range(8)]
    batch = [c.token_ids for o in engine.generate(ps, sampling, request_seeds=seeds) for c in o.completions]
    alone = [engine.generate([ps[i]], sampling, request_seeds=[seeds[i]])[0].completions[0].token_ids for i in (2, 5)]
    print(
        f"alone vs in a batch of 8: {[sum(x == y for x, y in zip(a, batch[i])) for a, i in zip(alone, (2, 5))]} of 24 tokens equal"
    )
    assert [a[:4] for a in alone] == [batch[2][:4], batch[5][:4]]
    again = [c.token_ids for o in engine.generate(ps, sampling, request_seeds=seeds) for c in o.completions]
    assert again == batch
    other = [c.token_ids for o in engine.generate(ps, sampling, request_seeds=[s + 1000 for s in seeds]) for c in o.completions]
    assert sum(a != b for a, b in zip(other, batch)) >= 6
    q = torch.zeros(5, 3000, device="cuda")
    keys = [patch.draw_key(s, d) for s, d in ((1, 0), (1, 1), (2, 0))]
    patch.seeded_exponential(q, [0, 2, 4], keys)
    want = patch.reference_exponential(keys, 3000).cuda()
    assert torch.allclose(q[[0, 2, 4]], want, rtol=1e-5, atol=1e-6) and not q[[1, 3]].any()
