"""Rollout pool (sharding, order, seeds) and live weight sync (buckets, uint8 wire, reports)."""

import torch
from test_rollout_native import JETRL, bf16_state, live_stream, make_engine, tiny_config

from megatron_jetrl.models import ModelArch
from megatron_jetrl.rollout import NativeEngine, RequestOutput, SamplingParams
from megatron_jetrl.rollout.engine import Completion, RolloutEngine
from megatron_jetrl.rollout.pool import RolloutPool, shard_bounds
from megatron_jetrl.rollout.sync import buckets, from_wire, pack, stream_weights, to_wire, unpack


class Echo:
    """A fake engine that records the prompts and seeds it served."""

    def __init__(self):
        self.calls, self.updates, self.asleep = [], [], False

    def generate(self, prompts, sampling, *, request_seeds=None):
        self.calls.append((list(prompts), request_seeds))
        return [
            RequestOutput(list(p), [Completion([p[0]], [0.0], "length")], s)
            for p, s in zip(prompts, request_seeds or [None] * len(prompts))
        ]

    def update_weights(self, weights):
        self.updates.append(list(weights))

    def sleep(self):
        self.asleep = True

    def wake(self):
        self.asleep = False


def test_shard_bounds_are_balanced_and_contiguous():
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert shard_bounds(0, 2) == [(0, 0), (0, 0)]


def test_pool_shards_prompts_keeps_order_and_global_seeds():
    engines = [Echo(), Echo(), Echo()]
    pool = RolloutPool(engines)
    assert isinstance(pool, RolloutEngine) and isinstance(engines[0], RolloutEngine)
    prompts = [[i] for i in range(7)]
    out = pool.generate(prompts, SamplingParams(seed=100))
    assert [o.prompt_token_ids for o in out] == prompts
    assert [o.request_seed for o in out] == [100 + i for i in range(7)]
    assert [c[0][0] for c in (e.calls for e in engines)] == [[[0], [1], [2]], [[3], [4]], [[5], [6]]]
    assert engines[1].calls[0][1] == [103, 104]
    pool.sleep()
    assert all(e.asleep for e in engines)
    pool.wake()
    assert not any(e.asleep for e in engines)


def test_pool_of_native_engines_equals_one_engine_and_sync_reaches_all():
    arch = ModelArch.from_hf_config(tiny_config("qwen3"))
    single = make_engine("qwen3")
    engines = [NativeEngine(arch, JETRL), NativeEngine(arch, JETRL)]
    pool = RolloutPool(engines, bucket_bytes=200_000)
    stats = pool.sync(live_stream(arch, bf16_state(arch), JETRL))
    assert stats.buckets > 1 and stats.tensors == len(single.specs) and len(stats.per_engine_seconds) == 2
    assert stats.bytes == sum(t.numel() * t.element_size() for t in single.params.values())
    for e in engines:
        assert all(torch.equal(e.params[n].view(torch.uint8), single.params[n].view(torch.uint8)) for n in single.params)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    sp = SamplingParams(n=2, max_new_tokens=4, seed=5, ignore_eos=True)
    a, b = single.generate(prompts, sp), pool.generate(prompts, sp)
    assert [[(c.token_ids, c.logprobs) for c in o.completions] for o in a] == [
        [(c.token_ids, c.logprobs) for c in o.completions] for o in b
    ]


def test_buckets_keep_fp8_weight_and_scale_together():
    w = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    s = torch.ones(2, 2)
    pairs = [
        ("a.weight", w),
        ("a.weight_scale_inv", s),
        ("n.weight", torch.zeros(100, dtype=torch.bfloat16)),
        ("b.weight", w),
        ("b.weight_scale_inv", s),
    ]
    got = [[n for n, _ in b] for b in buckets(pairs, bucket_bytes=1000)]
    assert got == [["a.weight", "a.weight_scale_inv"], ["n.weight"], ["b.weight", "b.weight_scale_inv"]]
    assert [[n for n, _ in b] for b in buckets(pairs, bucket_bytes=1 << 30)] == [[n for n, _ in pairs]]


def test_fp8_travels_as_uint8_bytes_unchanged():
    x = (torch.randn(130, 300) * 50).to(torch.float8_e4m3fn)
    wire, dtype = to_wire(x)
    assert wire.dtype == torch.uint8 and dtype == torch.float8_e4m3fn
    assert torch.equal(from_wire(wire, dtype).view(torch.uint8), x.view(torch.uint8))
    items = [("q", x), ("s", torch.rand(2, 3)), ("b", torch.randn(5, dtype=torch.bfloat16))]
    flat, metas = pack(items)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(m.nbytes for m in metas)
    for (n, t), (m, u) in zip(items, unpack(flat, metas)):
        assert n == m and t.dtype == u.dtype and torch.equal(t.view(torch.uint8), u.view(torch.uint8))


def test_stream_weights_reports_and_validates_per_bucket():
    fakes = [Echo(), Echo()]
    stats = stream_weights([("x.weight", torch.ones(4)), ("y.weight", torch.ones(4))], fakes, bucket_bytes=16)
    assert stats.buckets == 2 and stats.bytes == 32 and stats.tensors == 2 and stats.seconds >= 0
    assert [len(b) for b in fakes[0].updates] == [1, 1] and "sync/GBps" in stats.as_metrics()
