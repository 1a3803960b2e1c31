"""The colocated SPMD pool (megatron_jetrl/rollout/colocated.py) on gloo ranks with stand-in engines: each rollout
group of `rollout_tp` consecutive ranks samples its share with the global request seeds, every rank receives all
outputs in prompt order -- the same list one engine would return -- and the sync wakes weights before the copy and
the KV cache after it. vLLM itself runs in tests/gpu/test_vllm.py."""

import pytest
import torch
from actor_helpers import spawn

from megatron_jetrl.models import ModelArch
from megatron_jetrl.rollout.colocated import (
    ColocatedPool,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_cache_need,
    my_share,
    rollout_groups,
)
from megatron_jetrl.rollout.engine import Completion, RequestOutput, SamplingParams


class SeededEngine:
    """Completions are a pure function of (prompt, request seed): what SPMD vLLM engines with one seed give."""

    def __init__(self):
        self.calls, self.events = [], []

    def generate(self, prompts, sampling, *, request_seeds=None):
        self.calls.append((len(prompts), list(request_seeds)))
        return [
            RequestOutput(list(p), [Completion([sum(p) % 97, s % 89], [-0.5, -1.5], "length")], s)
            for p, s in zip(prompts, request_seeds)
        ]

    def wake(self, tags=("weights", "kv_cache")):
        self.events.append(("wake", tuple(tags)))

    def sleep(self):
        self.events.append(("sleep",))

    def mapped_bytes(self):
        return 0

    def update_weights(self, weights, phases=None):
        with phases("stream"):
            pairs = list(weights)
        self.events.append(("update", len(pairs)))
        return {"tensors": len(pairs), "bytes": sum(t.numel() * t.element_size() for _, t in pairs)}


def _pool_scenario(rollout_tp):
    import torch.distributed as dist

    engine = SeededEngine()
    pool = ColocatedPool(engine, rollout_tp=rollout_tp)
    prompts = [[i, i + 1, 2 * i] for i in range(11)]
    outputs = pool.generate(prompts, SamplingParams(seed=1000, max_new_tokens=2))
    pool.sleep()
    stats = pool.sync([("a.weight", torch.zeros(3, dtype=torch.bfloat16)), ("b.weight", torch.zeros(2))])
    return (
        dist.get_rank(),
        engine.calls,
        [(o.prompt_token_ids, o.completions[0].token_ids, o.request_seed) for o in outputs],
        engine.events,
        (stats.tensors, stats.bytes),
    )


@pytest.mark.parametrize("rollout_tp", [2])  # tp=1 is the same code with one-rank groups
def test_every_rank_gets_all_outputs_in_prompt_order_from_its_groups_share(rollout_tp):
    results = spawn(4, 1, 1, _pool_scenario, rollout_tp)
    alone = SeededEngine().generate([[i, i + 1, 2 * i] for i in range(11)], None, request_seeds=[1000 + i for i in range(11)])
    want = [(o.prompt_token_ids, o.completions[0].token_ids, o.request_seed) for o in alone]
    groups = 4 // rollout_tp
    for rank, calls, outputs, events, stats in results:
        assert outputs == want  # the same list a single engine returns, on every rank
        start, end = my_share(11, rank, 4, rollout_tp)
        assert calls == [(end - start, list(range(1000 + start, 1000 + end)))]
        assert events == [("sleep",), ("wake", ("weights",)), ("update", 2), ("wake", ("kv_cache",))]
        assert stats == (2, 14)
    shares = {my_share(11, r, 4, rollout_tp) for r in range(4)}
    assert len(shares) == groups and sum(e - s for s, e in shares) == 11


class DyingEngine(SeededEngine):
    def generate(self, prompts, sampling, *, request_seeds=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _failure_scenario(bad_rank):
    import torch.distributed as dist

    engine = DyingEngine() if dist.get_rank() == bad_rank else SeededEngine()
    pool = ColocatedPool(engine, rollout_tp=1)
    try:
        pool.generate([[1, 2, 3]] * 4, SamplingParams(seed=7, max_new_tokens=2))
    except RuntimeError as e:
        return str(e)
    return None


def test_an_engine_that_fails_stops_every_rank_at_once_naming_it():
    messages = spawn(2, 1, 1, _failure_scenario, 1)
    assert (
        messages
        == [
            "the rollout engine failed during generate on rank 1: RuntimeError: CUDA error: an illegal "
            "memory access was encountered"
        ]
        * 2
    )


def test_rank_layout_and_kv_cache_sizing():
    assert rollout_groups(8, 2) == 4 and [my_share(10, r, 4, 2) for r in range(4)] == [(0, 5), (0, 5), (5, 10), (5, 10)]
    with pytest.raises(ValueError, match="rollout.tp=3 must divide the number of ranks \\(4\\)"):
        rollout_groups(4, 3)
    assert kv_cache_bytes(40 << 30, 8 << 30, 0.5) == 16 << 30
    with pytest.raises(ValueError, match="no GPU memory left for vLLM's KV cache"):
        kv_cache_bytes(4 << 30, 8 << 30, 0.5)


def _arch(layers=28, kv_heads=2, head_dim=128):
    return ModelArch(
        family="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=layers,
        num_heads=12,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=151936,
        max_position_embeddings=1024,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qkv_bias=True,
        qk_norm=False,
    )


def test_kv_cache_is_what_the_step_can_use_at_most_the_fraction():
    arch = _arch()
    # K and V, BF16: 28 layers x 2 x 2 heads x 128 = 28 KiB a token; with TP 2 one head each, with TP 4 still one
    assert kv_bytes_per_token(arch) == 28 * 2 * 2 * 128 * 2 == 28 << 10
    assert kv_bytes_per_token(arch, 2) == kv_bytes_per_token(arch, 4) == 14 << 10
    # configs/gpu_1p5b.yaml: 128 sequences of 1024 tokens, one slab more for vLLM's reserved blocks: 3.6 GiB
    need = kv_cache_need(arch, 128, 1024)
    assert need == 129 * 1024 * (28 << 10)
    # a length is rounded up to whole 256-token slabs (any vLLM block size divides them)
    assert kv_cache_need(arch, 4, 1000) == kv_cache_need(arch, 4, 1024) == 5 * 1024 * (28 << 10)
    assert kv_cache_bytes(100 << 30, 2 << 30, 0.5, need) == need  # was 49 GiB: mapped and unmapped every step
    assert kv_cache_bytes(6 << 30, 2 << 30, 0.5, need) == 2 << 30  # the fraction still bounds it


class FakeCuda:
    """torch.cuda as the pool sees it: free memory that sleep/wake move, and a count of empty_cache calls."""

    def __init__(self, monkeypatch, free, engine_bytes):
        self.free, self.engine_bytes, self.emptied, self.trainer_cached = free, engine_bytes, 0, 8 << 30
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (self.free, 80 << 30))
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)

    def empty_cache(self):
        self.emptied += 1
        self.free += 10 << 30  # the trainer's cached blocks


class MemoryEngine(SeededEngine):
    def __init__(self, cuda):
        super().__init__()
        self.cuda = cuda

    def mapped_bytes(self):
        return self.cuda.engine_bytes

    def sleep(self):
        super().sleep()
        self.cuda.free += self.cuda.engine_bytes + self.cuda.trainer_cached  # vLLM's sleep also empties torch's cache
        self.cuda.trainer_cached = 0

    def wake(self, tags=("weights", "kv_cache")):
        super().wake(tags)
        self.cuda.free -= self.cuda.engine_bytes // 2


def test_the_trainers_cache_is_emptied_only_when_the_wake_would_not_fit(monkeypatch):
    cuda = FakeCuda(monkeypatch, free=30 << 30, engine_bytes=6 << 30)
    engine = MemoryEngine(cuda)
    pool = ColocatedPool.__new__(ColocatedPool)
    pool.engine, pool.rollout_tp, pool.group, pool.last_sync, pool.sleep_seconds, pool.wake_bytes = (
        engine,
        1,
        None,
        None,
        None,
        None,
    )
    weights = [("a.weight", torch.zeros(3, dtype=torch.bfloat16))]
    stats = pool.sync(weights)  # the first sync: nothing known yet, so room is made
    assert cuda.emptied == 1
    assert set(stats.parts) == {"sync/empty_cache_s", "sync/wake_weights_s", "sync/stream_s", "sync/wake_kv_s"}
    assert all(v >= 0 for v in stats.parts.values()) and set(stats.parts) <= set(stats.as_metrics())
    pool.sleep()  # free memory grows by 14 GiB: 6 the engine's, 8 the trainer's cache
    assert pool.wake_bytes == 6 << 30 and pool.sleep_seconds >= 0
    pool.sync(weights)  # 40 GiB free >= 6 + 1: the trainer keeps its blocks
    assert cuda.emptied == 1
    pool.sleep()
    cuda.free = 6 << 30  # the trainer grew into the memory the engine released
    pool.sync(weights)
    assert cuda.emptied == 2


class PreemptingEngine(SeededEngine):
    """Stands in for a vLLM engine whose scheduler preempted `per_call` requests in each generate."""

    def __init__(self, per_call):
        super().__init__()
        self.count, self.per_call = 5, per_call  # the counter runs from engine start, not from the pool's

    def generate(self, prompts, sampling, *, request_seeds=None):
        self.count += self.per_call
        return super().generate(prompts, sampling, request_seeds=request_seeds)

    def preemptions(self):
        return self.count


def _preemption_scenario():
    import torch.distributed as dist

    rank = dist.get_rank()
    counted = ColocatedPool(PreemptingEngine(per_call=3 + rank), rollout_tp=1)
    plain = ColocatedPool(SeededEngine(), rollout_tp=1)
    seen = []
    for _ in range(2):
        counted.generate([[1, 2], [3, 4]], SamplingParams(seed=7, max_new_tokens=2))
        seen.append(counted.preemptions)
    plain.generate([[1, 2]], SamplingParams(seed=7, max_new_tokens=2))
    return rank, seen, plain.preemptions


def test_pool_counts_the_preemptions_of_each_generate_and_none_for_an_engine_that_cannot():
    results = dict((rank, (seen, plain)) for rank, seen, plain in spawn(2, 1, 1, _preemption_scenario))
    assert results == {0: ([3, 3], None), 1: ([4, 4], None)}  # each generate's own, from a counter that started earlier


def test_preemption_patch_counts_one_schedulers_preemptions_and_refuses_another_vllm(monkeypatch):
    from megatron_jetrl.patching import load_patch

    patch, sampling = load_patch("vllm_0_26_0_preemption_count"), load_patch("vllm_0_26_0_seeded_sampling")

    class Scheduler:
        def __init__(self):
            self.preempted = []

        def _preempt_request(self, request, timestamp):
            self.preempted.append((request, timestamp))

    monkeypatch.setattr(sampling, "installed_version", lambda: "0.27.0")
    with pytest.raises(sampling.VllmVersionError, match=r"targets vllm==0.26.0 .* but vllm==0.27.0 is installed"):
        patch.apply(Scheduler())
    monkeypatch.setattr(sampling, "installed_version", lambda: "0.26.0")
    one, other = Scheduler(), Scheduler()
    patch.apply(one)
    patch.apply(one)  # again: still one count per preemption
    one._preempt_request("a", 1.0)
    one._preempt_request("b", 2.0)
    other._preempt_request("c", 3.0)
    assert one.jetrl_preemptions == 2 and one.preempted == [("a", 1.0), ("b", 2.0)]
    assert not hasattr(other, "jetrl_preemptions") and other.preempted == [("c", 3.0)]
