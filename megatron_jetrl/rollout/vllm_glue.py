"""The trainer's RMSNorm and RoPE inside vLLM 0.26, through vLLM's own out-of-tree op registry.

Why: measured on an H100 (`tools/gpu/diag_vllm_layers.py`, docs/benchmarks/mismatch_floors.md, "Per step, hidden 2048"), vLLM's
layer-0 modules differ from the trainer's functions on one input each:
- RMSNorm: 25% of outputs. vLLM rounds once, at the end; the trainer (the HF formula) rounds the normalized row to BF16
  before the weight multiplies it. vLLM's reference for the residual-fused variant (`vllm/ir/ops/layernorm.py`)
  also normalizes the FP32 sum, where the trainer normalizes the BF16-rounded residual.
- RoPE: 18-24% of outputs. vLLM uses BF16 cos/sin and BF16 math; the trainer uses megatron's FP32 tables and FP32 math.
SiLU-and-mul matched exactly. Each differing BF16 value before a quantizer can move a whole E4M3 step, so jetrl with
vLLM's own glue shows a larger mismatch than the native engine (docs/benchmarks/mismatch_floors.md).

`register()` makes vLLM build `TrainerRMSNorm` / `TrainerRotaryEmbedding` wherever a model asks for `RMSNorm` /
`RotaryEmbedding` (`CustomOp.register_oot`, read in vllm 0.26.0's `model_executor/custom_op.py`). They run `norm` and
`rope` below: `actor.fused`, the trainer's own Triton kernels on CUDA. They must be registered before the engine builds
its model. For engines without torch.compile only (eager, or full decode CUDA graphs without compilation, the
default): the kernels sit behind autograd Functions that Dynamo does not trace.

`VllmEngine(glue="trainer")` (`rollout.glue: auto` or `trainer`) registers them and `probe` checks at start-up that the model's
layer-0 modules now return the trainer's bytes. `norm` and `rope` are tested on the CPU against the trainer's
functions (tests/unit/test_rollout_vllm_glue.py); `tools/gpu/diag_vllm_layers.py --glue trainer` measures the effect.

Fused activation quantization (`rollout.vllm_fused_quant`, on by default; FP8 engines with FP32 scales, `configure`):
vLLM's FP8 linear quantizes its BF16 input in a kernel of its own (`QuantFP8`, 1x128 groups, our bytes), a launch per
linear per step that the norm or SiLU kernel before it could do while the row is in registers. The decoder layers'
RMSNorms and `SiluAndMul` then also write the 1x128 bytes and scales of the BF16 output they return (the quantizer's
FP32 steps: `fp8.kernels.quant_math`) and `stash` them; the `QuantFP8` of the linear that reads that very tensor (same
storage and shape, and version outside inference mode: `take`) uses them instead of quantizing again. The BF16 output
is still written, and any other reader falls back to vLLM's quantizer: the bytes are the same either way
(`probe_fused` checks them at start-up, and a layer's MLP output with and without the fusion). It needs Python to run
between the kernels, as in eager engines and full CUDA graphs captured without torch.compile (what the trainer's glue
runs); a stash is one tensor deep. The model's final norm quantizes too (its width is the hidden size), unused.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_jetrl.actor.fused import fused_add_rms_norm, fused_rms_norm, fused_rope, fused_rope_at

FUSED_QUANT = {"eps": None, "hidden_size": None, "active": True, "hits": 0}
"""`configure`'s settings for the modules vLLM builds next (eps None: no fusion), `active` (False inside `unfused`) and
the number of `take`s that found their tensor (counted while Python runs: eager steps and graph captures)."""
_stash: tuple | None = None


def configure(quant_eps: float | None, hidden_size: int | None = None) -> None:
    """Fuse the FP8 activation quantization (eps of the flow's quantizer) into the RMSNorms of width `hidden_size` and
    SiluAndMul of the engine built next, or not (None). Read when vLLM constructs the modules. Widths below 256 are
    not fused: there the norm's program holds 32 rows and tools/gpu/check_triton_kernels.py finds that the fused kernel
    does not compile the norm as the plain one does."""
    if hidden_size is not None and (hidden_size < 256 or hidden_size % 128):
        quant_eps = None
    FUSED_QUANT.update(eps=quant_eps, hidden_size=hidden_size)


@contextlib.contextmanager
def unfused():
    """The modules built with the fusion run without it (no stash, every linear quantizes itself)."""
    FUSED_QUANT["active"] = False
    try:
        yield
    finally:
        FUSED_QUANT["active"] = True


def tma_rows(rows: int) -> int:
    """vLLM's TMA-aligned scale layout: columns `rows` rounded up to 4 apart (16 bytes of FP32)."""
    return -(-rows // 4) * 4


def stash(y: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """Keep y's FP8 bytes and scales for the linear that reads y next (a reference to y too: its memory is not reused
    while stashed)."""
    global _stash
    _stash = (y, None if y.is_inference() else y._version, q, s)  # (vLLM runs in inference mode: no version counter)


def take(x: torch.Tensor, op) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The stashed `(q, s)` if `x` is the stashed tensor unchanged (a view of its storage from offset 0, same shape and,
    outside inference mode, version) and `op` (a vLLM `QuantFP8`) wants exactly them: dynamic 1x128 groups, FP32
    scales, column-major with the stash's column stride; else None (and the stash stays). Inference tensors (vLLM's)
    keep no version counter: an in-place change between the norm or SiLU and the linear would go unseen; no layer of
    the supported models (qwen2, qwen3, llama) makes one, and `probe_fused` checks a layer's MLP end to end."""
    global _stash
    if _stash is None or not FUSED_QUANT["active"]:
        return None
    y, version, q, s = _stash
    if (
        x.data_ptr() != y.data_ptr()
        or x.shape != y.shape
        or (version is not None and x._version != version)
        or x.dtype != y.dtype
        or not getattr(op, "is_group_quant", False)
        or op.static
        or op.group_size != 128
        or op.use_ue8m0
        or not op.column_major_scales
        or s.stride(1) != (tma_rows(x.shape[0]) if op.tma_aligned_scales else x.shape[0])
    ):
        return None
    _stash = None
    FUSED_QUANT["hits"] += 1
    return q, s


def norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, quant_eps: float):
    """`norm` on CUDA for a 2-D x, with the output's FP8 bytes and scales stashed (`take`)."""
    from megatron_jetrl.actor.glue_kernels import rms_norm_quant

    y, h, q, s = rms_norm_quant(
        x, None if residual is None else residual.contiguous(), weight, eps, quant_eps, tma_rows(x.shape[0])
    )
    stash(y, q, s)
    return y if h is None else (y, h)


def silu_mul_quant(x: torch.Tensor, quant_eps: float) -> torch.Tensor:
    """vLLM's SiluAndMul (`silu(x[:, :d]) * x[:, d:]`, torch's roundings) of a 2-D x on CUDA, with the product's FP8
    bytes and scales stashed (`take`)."""
    from megatron_jetrl.fp8 import kernels

    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    s = torch.empty_strided((rows, d // 128), (1, tma_rows(rows)), dtype=torch.float32, device=x.device)
    q, s = kernels.swiglu_quantize_1x128(x, eps=quant_eps, check_finite=False, product=out, scale=s)
    stash(out, q, s)
    return out


def norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """vLLM's RMSNorm contract with the trainer's numerics: `norm(x)`, or with a residual
    `(norm(x + residual), x + residual)`. The sum is the trainer's BF16 residual add, and its rounded value is what
    gets normalized (on CUDA the add is inside the norm's kernel)."""
    if residual is None:
        return fused_rms_norm(x, weight, eps)
    return fused_add_rms_norm(x, residual, weight, eps)


def rope_tables(head_size: int, base: float, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's FP32 cos/sin `[max_positions, 1, 1, head_size]` (`actor.fp8_layers.rope_cos_sin`, rotary_percent 1,
    no scaling). A module keeps its own reference: a captured CUDA graph reads them by address, after the
    trainer's calls may have evicted them from `rope_cos_sin`'s cache."""
    from megatron_jetrl.actor.fp8_layers import rope_cos_sin

    return rope_cos_sin(head_size, (("rotary_base", float(base)), ("rotary_percent", 1.0)), max_positions, torch.device(device))


def rope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor):
    """vLLM's rotary contract (`query` `[tokens, heads * head_size]` at `positions`) with the trainer's RoPE: the
    tables of `rope_tables` and the math of `actor.fused.rope`, the table rows read at `positions` inside the kernel
    on CUDA. Returns new tensors shaped as the inputs."""
    head_size = cos.shape[-1]
    pos = positions.flatten()
    t = pos.shape[0]
    q = fused_rope_at(query.reshape(t, 1, -1, head_size), cos, sin, pos).view_as(query)
    return q, None if key is None else fused_rope_at(key.reshape(t, 1, -1, head_size), cos, sin, pos).view_as(key)


def probe(layer, arch, device, tokens: int = 512, method: str | None = None) -> dict[str, float]:
    """Share of output elements in which a vLLM decoder layer's `input_layernorm` (alone, and with a residual: the
    normalized sum and the sum) and `rotary_emb` differ from the trainer's functions, on one random input each:
    through whatever forward they dispatch to, or through `method` (e.g. `forward_native`)."""
    from megatron_jetrl.actor.fp8_layers import rope_cos_sin, rope_key

    g = torch.Generator(device=device).manual_seed(1)
    x = (torch.randn(tokens, arch.hidden_size, device=device, generator=g) * 3).to(torch.bfloat16)
    ln, rot, d = layer.input_layernorm, layer.self_attn.rotary_emb, arch.head_dim
    norm_fn, rot_fn = (ln, rot) if method is None else (getattr(ln, method), getattr(rot, method))
    shares = {"rms_norm": (norm_fn(x.clone()) != fused_rms_norm(x, ln.weight, arch.rms_norm_eps)).float().mean().item()}
    r = (torch.randn(tokens, arch.hidden_size, device=device, generator=g) * 3).to(torch.bfloat16)
    y, h = norm_fn(x.clone(), r.clone())  # (clones: vLLM's fused add + norm writes its inputs in place)
    shares["rms_norm_residual"] = (
        torch.cat([(y != fused_rms_norm(x + r, ln.weight, arch.rms_norm_eps)).flatten(), (h != x + r).flatten()])
        .float()
        .mean()
        .item()
    )
    q = torch.randn(tokens, arch.num_heads * d, device=device, generator=g).to(torch.bfloat16)
    k = torch.randn(tokens, arch.num_kv_heads * d, device=device, generator=g).to(torch.bfloat16)
    got_q, got_k = rot_fn(torch.arange(tokens, device=device), q.clone(), k.clone())
    cos, sin = rope_cos_sin(d, rope_key(arch), tokens, q.device)
    want = [fused_rope(t.view(tokens, 1, -1, d), cos, sin).view(tokens, -1) for t in (q, k)]
    shares["rope"] = (
        torch.cat([(got_q.reshape(tokens, -1) != want[0]).flatten(), (got_k.reshape(tokens, -1) != want[1]).flatten()])
        .float()
        .mean()
        .item()
    )
    return shares


def probe_fused(layer, arch, device, tokens: int = 64) -> dict[str, float]:
    """For modules built with the fused quantization: the share of FP8 bytes and scales that the input norm and the
    MLP's SiluAndMul stash and that differ from the quantizer's (`fp8.kernels.quantize_1x128` of their BF16 output),
    and of the MLP's outputs that differ from the same MLP run `unfused`, with whether its down projection took the
    stash (`mlp_took_stash`: 0 means the fusion is not in effect)."""
    from megatron_jetrl.fp8 import kernels

    eps = FUSED_QUANT["eps"]
    g = torch.Generator(device=device).manual_seed(2)
    x = (torch.randn(tokens, arch.hidden_size, device=device, generator=g) * 3).to(torch.bfloat16)
    shares = {}
    for name, module, inp in (
        ("norm_quant", layer.input_layernorm, x),
        (
            "silu_mul_quant",
            layer.mlp.act_fn,
            (torch.randn(tokens, 2 * layer.mlp.down_proj.input_size_per_partition, device=device, generator=g) * 3).to(
                torch.bfloat16
            ),
        ),
    ):
        y = module(inp.clone())
        if _stash is None or _stash[0] is not y:
            shares[name] = 1.0
            continue
        want_q, want_s = kernels.quantize_1x128(y, eps=eps, check_finite=False)
        q, s = _stash[2], _stash[3]
        shares[name] = (
            torch.cat([(q.view(torch.uint8) != want_q.view(torch.uint8)).flatten(), (s != want_s).flatten()])
            .float()
            .mean()
            .item()
        )
    hits = FUSED_QUANT["hits"]
    fused = layer.mlp(x)
    shares["mlp_took_stash"] = float(FUSED_QUANT["hits"] > hits)
    with unfused():
        plain = layer.mlp(x)
    shares["mlp_output"] = (fused.view(torch.int16) != plain.view(torch.int16)).float().mean().item()
    return shares


def registered() -> bool:  # pragma: no cover - needs vLLM
    """Whether this process registered the trainer's classes (vLLM's registry is global: every later engine gets them)."""
    from vllm.model_executor.custom_op import op_registry_oot

    return getattr(op_registry_oot.get("RMSNorm"), "__name__", None) == "TrainerRMSNorm"


def register() -> None:  # pragma: no cover - needs vLLM (tools/gpu/diag_vllm_layers.py --glue trainer)
    """Register the trainer's RMSNorm, RotaryEmbedding and SiluAndMul, and the QuantFP8 that takes a stash, in vLLM's
    out-of-tree registry. Call it once, after the environment is pinned and before any engine is built; the fusion
    itself follows `configure` per engine (off: the last two behave as vLLM's own)."""
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if "RMSNorm" in op_registry_oot:
        return

    @CustomOp.register_oot(name="RMSNorm")
    class TrainerRMSNorm(RMSNorm):
        def __init__(self, hidden_size, *args, **kwargs):
            super().__init__(hidden_size, *args, **kwargs)
            self.quant_eps = FUSED_QUANT["eps"] if hidden_size == FUSED_QUANT["hidden_size"] else None

        def forward_cuda(self, x, residual=None):
            if self.quant_eps is not None and FUSED_QUANT["active"] and x.is_cuda and x.dim() == 2:
                return norm_quant(x, residual, self.weight, self.variance_epsilon, self.quant_eps)
            return norm(x, residual, self.weight, self.variance_epsilon)

        forward_native = forward_cuda

    @CustomOp.register_oot(name="SiluAndMul")
    class TrainerSiluAndMul(SiluAndMul):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.quant_eps = FUSED_QUANT["eps"]

        def forward_cuda(self, x):
            if self.quant_eps is not None and FUSED_QUANT["active"] and x.is_cuda and x.dim() == 2 and x.shape[1] % 256 == 0:
                return silu_mul_quant(x, self.quant_eps)
            return super().forward_cuda(x)

    @CustomOp.register_oot(name="QuantFP8")
    class TrainerQuantFP8(QuantFP8):
        def forward_cuda(self, x, scale=None, scale_ub=None, use_triton=False):
            found = take(x, self) if scale is None and scale_ub is None else None
            return found if found is not None else super().forward_cuda(x, scale, scale_ub, use_triton)

    @CustomOp.register_oot(name="RotaryEmbedding")
    class TrainerRotaryEmbedding(RotaryEmbedding):
        def forward_cuda(self, positions, query, key=None):
            if self.rotary_dim != self.head_size or not self.is_neox_style:
                raise NotImplementedError(
                    f"the trainer's RoPE rotates whole heads, rotate-half style; this model has "
                    f"rotary_dim {self.rotary_dim} of {self.head_size}, neox {self.is_neox_style}"
                )
            tables = getattr(self, "_trainer_tables", None)
            if tables is None or tables[0].device != query.device:  # made in vLLM's warm-up, before graph capture
                tables = self._trainer_tables = rope_tables(self.head_size, self.base, self.max_position_embeddings, query.device)
            return rope(positions, query, key, *tables)

        forward_native = forward_cuda


def use_trainer_lm_head(model) -> None:  # pragma: no cover - needs vLLM (tests/gpu/test_exact_logprobs.py)
    """Under `precision.exact_logprobs`: the engine's lm_head (an unquantized `ParallelLMHead`, or the tied embedding)
    computes its logits with the actor's lm_head GEMM (`actor.rollout_kernels.lm_head_gemm`, batch-invariant) instead
    of cuBLAS or vLLM's persistent GEMM. The logits are computed eagerly, outside vLLM's CUDA graphs, so the method can
    be swapped after the engine is built. Another lm_head method is left alone (the start-up read-back refuses it)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from megatron_jetrl.actor.rollout_kernels import lm_head_gemm

    class TrainerLMHeadMethod(UnquantizedEmbeddingMethod):
        def apply(self, layer, x, bias=None):  # the GEMM of the actor's output layer (`RolloutOutputLayer`)
            y = lm_head_gemm(x.reshape(-1, x.shape[-1]), layer.weight).view(*x.shape[:-1], -1)
            return y if bias is None else y + bias

    if type(model.lm_head.quant_method) is UnquantizedEmbeddingMethod:
        model.lm_head.quant_method = TrainerLMHeadMethod()
