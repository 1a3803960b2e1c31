"""patches/vllm_0_26_0_seeded_sampling.py on the CPU (vLLM itself is not installed here: a stand-in module with
vLLM 0.26.0's two helpers): the noise hash, the per-generator draw counts, batch independence, the exponential race
it feeds, and the version pin. The Triton kernel is checked against `reference_exponential` in tests/gpu."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from megatron_jetrl.patching import load_patch

patch = load_patch("vllm_0_26_0_seeded_sampling")


@pytest.fixture
def vllm_sampler(monkeypatch):
    """A stand-in for `vllm.v1.sample.ops.topk_topp_sampler` with vLLM 0.26.0's helpers (same semantics)."""
    mod = types.ModuleType(patch.MODULE)

    def empty_exponential_noise_like(probs, use_fp64_gumbel):
        return torch.empty(probs.shape, dtype=torch.float64 if use_fp64_gumbel else probs.dtype, device=probs.device)

    def sample_with_exponential_noise(probs, q):
        return (probs / q).argmax(dim=-1).view(-1)

    mod.empty_exponential_noise_like, mod.sample_with_exponential_noise = (
        empty_exponential_noise_like,
        sample_with_exponential_noise,
    )
    mod.random_sample = "vLLM's own"
    monkeypatch.setitem(sys.modules, patch.MODULE, mod)
    monkeypatch.setattr(patch, "DRAWS", patch._Draws())
    return mod


def generator(seed):
    return torch.Generator().manual_seed(seed)


def test_the_hash_is_splitmix64_and_the_noise_is_exponential():
    assert patch.mix64(patch.GOLDEN) == 0xE220A8397B1DCDAF  # SplitMix64's first output from state 0
    assert patch.mix64((patch.GOLDEN * 2) & patch.MASK64) == 0x6E789E6AA1B965F4
    q = patch.reference_exponential([patch.draw_key(s, d) for s in (1, 2) for d in range(4)], 4096)
    assert q.dtype == torch.float32 and bool((q > 0).all()) and float(q.max()) < 17.4
    assert abs(float(q.double().mean()) - 1.0) < 0.02 and abs(float(q.double().var()) - 1.0) < 0.05
    assert len({tuple(r.tolist()) for r in q}) == 8  # every (seed, draw) its own row


def test_a_rows_noise_depends_on_its_seed_and_draw_only(vllm_sampler):
    a, b, c = generator(11), generator(12), generator(11)  # c: another request with a's seed
    state = a.get_state().clone()
    rows, keys = patch.DRAWS.keys({0: a, 3: b})
    assert rows == [0, 3] and keys == [patch.draw_key(11, 0), patch.draw_key(12, 0)]
    rows, keys = patch.DRAWS.keys({1: b, 2: c, 5: a})  # b and a moved rows, c joined
    assert rows == [1, 2, 5] and keys == [patch.draw_key(12, 1), patch.draw_key(11, 0), patch.draw_key(11, 1)]
    assert torch.equal(a.get_state(), state)  # the generators are not advanced
    probs = torch.softmax(torch.randn(6, 300, generator=generator(0)), -1)
    first = patch.seeded_random_sample(probs.clone(), {0: generator(7), 4: generator(8)})
    q = torch.empty(6, 300)
    patch.seeded_exponential(q, [0, 4], [patch.draw_key(7, 0), patch.draw_key(8, 0)])
    want = (probs / q).argmax(-1)
    assert first[0] == want[0] and first[4] == want[4]  # the seeded rows: exactly the race against their noise


def test_unseeded_rows_keep_vllms_draw_and_stale_generators_are_dropped(vllm_sampler):
    probs = torch.full((4, 50), 1 / 50)
    torch.manual_seed(0)
    x = patch.seeded_random_sample(probs.clone(), {})
    y = patch.seeded_random_sample(probs.clone(), {})
    assert not torch.equal(x, y)  # q.exponential_() from the global generator, as vLLM draws unseeded rows
    for i in range(200):
        patch.DRAWS.keys({0: generator(i)})
    assert len(patch.DRAWS.table) <= 2 + 64 + 1


def test_the_race_samples_the_distribution(vllm_sampler):
    probs = torch.tensor([[0.25, 0.75, 0.0]]).repeat(4000, 1)
    gens = {i: generator(1000 + i) for i in range(4000)}
    tokens = patch.seeded_random_sample(probs.clone(), gens)
    assert set(tokens.tolist()) <= {0, 1} and abs(float((tokens == 1).double().mean()) - 0.75) < 0.03


def test_apply_replaces_random_sample_of_vllm_0_26_0_only(vllm_sampler, monkeypatch):
    monkeypatch.setattr(patch, "installed_version", lambda: "0.25.1")
    with pytest.raises(patch.VllmVersionError, match=r"targets vllm==0.26.0 .* but vllm==0.25.1 is installed"):
        patch.apply()
    assert vllm_sampler.random_sample == "vLLM's own"
    monkeypatch.setattr(patch, "installed_version", lambda: "0.26.0")
    monkeypatch.setattr(patch, "_APPLIED", False)
    assert patch.apply() and vllm_sampler.random_sample is patch.seeded_random_sample
