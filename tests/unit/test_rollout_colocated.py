"""The colocated SPMD pool (megatron_jetrl/rollout/colocated.py) on gloo ranks with stand-in engines: each rollout
group of `rollout_tp` consecutive ranks samples its share with the global request seeds, every rank receives all
outputs in prompt order -- the same list one engine would return -- and the sync wakes weights before the copy and
the KV cache after it. vLLM itself runs in tests/gpu/test_vllm.py."""

import pytest
import torch

from actor_helpers import spawn
from megatron_jetrl.rollout.colocated import ColocatedPool, kv_cache_bytes, my_share, rollout_groups
from megatron_jetrl.rollout.engine import Completion, RequestOutput, SamplingParams


class SeededEngine:
    """Completions are a pure function of (prompt, request seed): what SPMD vLLM engines with one seed give."""

    def __init__(self):
        self.calls, self.events = [], []

    def generate(self, prompts, sampling, *, request_seeds=None):
        self.calls.append((len(prompts), list(request_seeds)))
        return [RequestOutput(list(p), [Completion([sum(p) % 97, s % 89], [-0.5, -1.5], "length")], s)
                for p, s in zip(prompts, request_seeds)]

    def wake(self, tags=("weights", "kv_cache")):
        self.events.append(("wake", tuple(tags)))

    def sleep(self):
        self.events.append(("sleep",))

    def update_weights(self, weights):
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
    return dist.get_rank(), engine.calls, [(o.prompt_token_ids, o.completions[0].token_ids, o.request_seed) for o in outputs], \
        engine.events, (stats.tensors, stats.bytes)


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
    assert messages == ["the rollout engine failed during generate on rank 1: RuntimeError: CUDA error: an illegal "
                        "memory access was encountered"] * 2


def test_rank_layout_and_kv_cache_sizing():
    assert rollout_groups(8, 2) == 4 and [my_share(10, r, 4, 2) for r in range(4)] == [(0, 5), (0, 5), (5, 10), (5, 10)]
    with pytest.raises(ValueError, match="rollout.tp=3 must divide the number of ranks \\(4\\)"):
        rollout_groups(4, 3)
    assert kv_cache_bytes(40 << 30, 8 << 30, 0.5) == 16 << 30
    with pytest.raises(ValueError, match="no GPU memory left for vLLM's KV cache"):
        kv_cache_bytes(4 << 30, 8 << 30, 0.5)
