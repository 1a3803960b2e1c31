"""vLLM 0.26.0: the sampler's noise for per-request seeds drawn for all seeded requests in one kernel.

Why: the rollout pool gives every prompt its own seed, so that a prompt samples the same tokens whichever engine
serves it (`megatron_jetrl.rollout.engine.request_seeds_for`). vLLM 0.26.0's V1 sampler then draws the exponential
race's noise one request at a time: `random_sample` in `vllm/v1/sample/ops/topk_topp_sampler.py` loops over the
requests' generators in Python, `q[i].exponential_(generator=g)`, with vLLM's own note "This can be slow because we
handle each request one by one". That is a host dispatch and a kernel launch per request and decode step: an
estimated 1 ms of host time a step at 128 requests (~7 us each; not measured), beside an FP8 decode step of about
9 ms of GPU time.

The change: `random_sample` is replaced by `seeded_random_sample`. Rows with a generator take their Exp(1) noise from
`seeded_exponential`: a counter-based hash (SplitMix64) of the generator's seed, the number of draws this function
has made for that generator, and the vocabulary index, as one Triton kernel for all of them. Rows without a
generator keep vLLM's `q.exponential_()`. A request's tokens still depend only on its seed, its step and its own
probabilities, never on the batch it shares, and every TP rank draws the same; they are not the tokens vLLM's own
Philox stream would give for the same seed. The generators themselves are not advanced.

`apply()` refuses any vLLM but 0.26.0. `VllmEngine` applies it in the process that builds the engine.
"""

from __future__ import annotations

import importlib
import importlib.metadata

import torch

TARGET_VERSION = "0.26.0"
MODULE = "vllm.v1.sample.ops.topk_topp_sampler"
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MASK64 = (1 << 64) - 1
_APPLIED = False


class VllmVersionError(RuntimeError):
    pass


def mix64(z: int) -> int:
    """SplitMix64's output function on a Python int (uint64 arithmetic)."""
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def draw_key(seed: int, draw: int) -> int:
    """The 64-bit key of a generator's `draw`-th noise row: a hash of (seed, draw)."""
    return mix64((seed * GOLDEN + draw) & MASK64)


def uniform24(key: int, col: int) -> int:
    """The 24-bit uniform integer of column `col` under `key`; the noise is -log((u + 0.5) / 2^24), in (0, 17.4)."""
    return mix64((key + (col + 1) * GOLDEN) & MASK64) >> 40


def reference_exponential(keys: list[int], width: int) -> torch.Tensor:
    """`seeded_exponential`'s values computed in Python (FP64 log, rounded to FP32): the CPU path and the tests'
    reference."""
    u = torch.tensor([[uniform24(k, c) for c in range(width)] for k in keys], dtype=torch.float64)
    return (-torch.log((u + 0.5) / 2**24)).float()


def _signed(k: int) -> int:
    return k - (1 << 64) if k >= 1 << 63 else k


@torch.compiler.disable
def seeded_exponential(q: torch.Tensor, rows: list[int], keys: list[int]) -> None:
    """Fill rows `rows` of `q` `[B, V]` with the noise of `keys` (one key per row)."""
    if not rows:
        return
    if not q.is_cuda:
        q[rows] = reference_exponential(keys, q.shape[1]).to(q.dtype)
        return
    meta = torch.tensor([rows, [_signed(k) for k in keys]], dtype=torch.int64).pin_memory().to(q.device, non_blocking=True)
    block = 1024
    _kernel()[(len(rows), -(-q.shape[1] // block))](q, q.stride(0), meta, len(rows), q.shape[1], BLOCK=block)


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _seeded_exponential(q_ptr, q_stride, meta_ptr, n, V, BLOCK: tl.constexpr):
            i = tl.program_id(0)
            row = tl.load(meta_ptr + i)
            key = tl.load(meta_ptr + n + i).to(tl.uint64)
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            z = key + (cols.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
            z = (z ^ (z >> 27)) * 0x94D049BB133111EB
            z = z ^ (z >> 31)
            u = ((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            tl.store(q_ptr + row * q_stride + cols, (-tl.log(u)).to(q_ptr.dtype.element_ty), mask=cols < V)

        _KERNEL = _seeded_exponential
    return _KERNEL


_KERNEL = None


class _Draws:
    """How many noise rows each live generator has had: {id(generator): [generator, seed, draws]}. Holding the
    generator keeps its id unique; entries of generators no longer in a batch are dropped once they outnumber it."""

    def __init__(self):
        self.table: dict[int, list] = {}

    def keys(self, generators: dict[int, torch.Generator]) -> tuple[list[int], list[int]]:
        rows, keys = [], []
        for row, g in generators.items():
            entry = self.table.get(id(g))
            if entry is None or entry[0] is not g:
                entry = self.table[id(g)] = [g, g.initial_seed(), 0]
            rows.append(row)
            keys.append(draw_key(entry[1], entry[2]))
            entry[2] += 1
        if len(self.table) > 2 * len(generators) + 64:
            live = {id(g) for g in generators.values()}
            self.table = {k: v for k, v in self.table.items() if k in live}
        return rows, keys


DRAWS = _Draws()


def seeded_random_sample(
    probs: torch.Tensor, generators: dict[int, torch.Generator], use_fp64_gumbel: bool = False
) -> torch.Tensor:
    """vLLM's `random_sample` (the exponential race), its seeded rows' noise from `seeded_exponential`."""
    ops = importlib.import_module(MODULE)
    q = ops.empty_exponential_noise_like(probs, use_fp64_gumbel)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    seeded_exponential(q, *DRAWS.keys(generators))
    return ops.sample_with_exponential_noise(probs, q)


def installed_version() -> str:
    return importlib.metadata.version("vllm")


def require_vllm(patch: str, changes: str, target: str = TARGET_VERSION) -> None:
    """Refuse to apply `patches/<patch>.py`, which `changes` (what of vLLM `target` it replaces or wraps), to another
    vLLM: `VllmVersionError` naming both versions."""
    version = installed_version()
    if version != target:
        raise VllmVersionError(
            f"patches/{patch}.py targets vllm=={target} (it {changes} of that release), but vllm=={version} is installed"
        )


def apply() -> bool:
    """Replace vLLM 0.26.0's `random_sample`. Raises `VllmVersionError` for another vLLM; safe to call again."""
    global _APPLIED
    require_vllm("vllm_0_26_0_seeded_sampling", f"replaces {MODULE}.random_sample")
    if not _APPLIED:
        importlib.import_module(MODULE).random_sample = seeded_random_sample
        _APPLIED = True
    return True
