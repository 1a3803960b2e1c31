"""The native Jet-RL layer spec: megatron-core's local transformer layer whose linears run the core FP8 linear.

`FP8ColumnParallelLinear` / `FP8RowParallelLinear` subclass megatron's `ColumnParallelLinear` /
`RowParallelLinear` and replace only their GEMM (`_forward_impl`), so TP semantics stay megatron's:
column-parallel holds an out-dim shard (input copied to the TP region, dgrad all-reduced, or all-gathered
along the sequence under sequence parallelism: in FP8, each rank's rows quantized before the gather); row-parallel
holds an in-dim shard and megatron's `forward` all-reduces (or reduce-scatters) the partial outputs and adds the bias
afterwards.

The GEMM is `megatron_jetrl.fp8.fp8_linear` (FP8 FProp/DGrad/WGrad in mode `jetrl`, see `megatron_jetrl.fp8`).
Each module quantizes its weight shard once per weight version (`quantized_weight()`); those are the
bytes the weight sync and the converter ship (`fp8_weights(model)`). Because every split dimension is a
multiple of 128 (`ModelArch.check_fp8_tp`, checked by the provider), a shard's bytes are exactly the
corresponding blocks of the full weight's bytes.

Why not `TransformerConfig(fp8="e4m3", fp8_recipe="blockwise")` with the local spec: megatron then
builds plain linears without a word (FP8 only exists through TE modules); tests prove FP8 is in this
spec's forward.

With `batch_invariant=True` every BF16 piece runs `megatron_jetrl.models.batch_invariant_ops`, the functions the native
rollout engine runs: the norms (`RMSNorm`), RoPE + causal attention (`BatchInvariantAttention`, built with
GPTModel's own RoPE off), SwiGLU (`ops.silu`, set by the provider) and the BF16 lm_head
(`BatchInvariantOutputLayer`); the log-softmax is `actor.logprobs`'. With BF16 params and the emulated
FP8 backend, a sequence's logprobs are then the engine's to the bit at TP1 (at TP>1 the row-parallel
all-reduce and the vocab-parallel sum-exp add in another order: a bound, not bits).
"""

from __future__ import annotations

from functools import lru_cache, partial

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from megatron_jetrl.actor.fused import fused_rms_norm, fused_rope, rms_norm, rope
from megatron_jetrl.actor.gpt import rope_kwargs, unwrap  # noqa: F401 (unwrap: imported from here by the actor modules)
from megatron_jetrl.actor.layer_graphs import GraphedTransformerLayer
from megatron_jetrl.fp8 import GatedGradHandoff, PrecisionFlow, QuantizedWeight, finite, fp8_linear
from megatron_jetrl.fp8.sequence_parallel import NO_OVERLAP, SPOverlap
from megatron_jetrl.models import batch_invariant_ops as ops
from megatron_jetrl.models.arch import ModelArch


class RMSNorm(torch.nn.Module):
    """RMSNorm as HF Qwen2/Qwen3/Llama compute it (FP32 statistics), usable with sequence parallelism: the engine's
    `ops.rms_norm` with `batch_invariant`, else `actor.fused.rms_norm` (one Triton kernel per direction on CUDA with
    `fused`, eager torch ops otherwise).

    megatron's torch-norm fallback refuses sequence parallelism; this norm marks its weight
    `sequence_parallel` so megatron's `finalize_model_grads` all-reduces its grad over the TP group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, batch_invariant: bool = False, fused: bool = True):
        super().__init__()
        self.eps = eps
        self.norm = ops.rms_norm if batch_invariant else fused_rms_norm if fused else rms_norm
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        return self.norm(x, self.weight, self.eps)


class CausalCoreAttention(torch.nn.Module):
    """What the local spec's core attentions share: megatron's `DotProductAttention` constructor, causal self-attention
    only, no attention dropout, and softmax at 1/sqrt(head_dim) -- or at the `softmax_scale` megatron passes where a
    subclass takes one (`any_scale`)."""

    any_scale = False

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        *,
        arch: ModelArch,
    ):
        super().__init__()
        name = type(self).__name__
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"{name} is causal only, got attn_mask_type={attn_mask_type}")
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) != 0:
            raise ValueError(f"{name} has no attention dropout (RL fine-tuning runs with attention_dropout=0)")
        if not self.any_scale and softmax_scale not in (None, arch.head_dim**-0.5):
            raise ValueError(f"{name} scales by 1/sqrt(head_dim); softmax_scale={softmax_scale} is not supported")
        self.arch, self.head_dim, self.softmax_scale = arch, arch.head_dim, softmax_scale


class BatchInvariantAttention(CausalCoreAttention):
    """Core attention of the batch-invariant spec: RoPE at positions 0..s-1, then causal softmax attention,
    both `models.batch_invariant_ops` (the engine's). GPTModel is built without its own RoPE for this spec (the provider
    sets `position_embedding_type="none"`), so q/k arrive here after megatron's q/k norms, un-rotated.
    Megatron layout in and out: q `[s, b, heads, d]`, k/v `[s, b, groups, d]` -> `[s, b, heads * d]`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def _tables(self, length: int, device):
        if self._rope is None or self._rope[0].shape[0] < length or self._rope[0].device != device:
            a = self.arch
            self._rope = ops.rope_tables(a.head_dim, max(length, a.max_position_embeddings), a.rope_theta, a.rope_scaling, device)
        return self._rope

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("BatchInvariantAttention takes unpacked sequences without attention bias")
        s, b = query.shape[:2]
        cos_t, sin_t = self._tables(s, query.device)
        positions = torch.arange(s, device=query.device).expand(b, s)
        cos, sin = cos_t[positions], sin_t[positions]
        q = ops.apply_rope(query.permute(1, 2, 0, 3), cos, sin)  # [b, heads, s, d]
        k = ops.apply_rope(key.permute(1, 2, 0, 3), cos, sin)
        out = ops.attention(q, k, value.permute(1, 2, 0, 3), positions, torch.full((b,), s, device=query.device))
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


@lru_cache(maxsize=8)
def _rotary(head_dim: int, rope: tuple, device: torch.device):
    """megatron's `RotaryEmbedding` for `rope` (`gpt.rope_kwargs` items), one per model shape and device."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding(kv_channels=head_dim, use_cpu_initialization=device.type == "cpu", **dict(rope))


def rope_key(arch: ModelArch) -> tuple:
    """`rope_cos_sin`'s `rope` argument for an arch: GPTModel's RoPE arguments (`gpt.rope_kwargs`), sorted."""
    return tuple(sorted((k, v) for k, v in rope_kwargs(arch).items() if k != "position_embedding_type"))


@lru_cache(maxsize=2)
def rope_cos_sin(head_dim: int, rope: tuple, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 cos/sin `[length, 1, 1, head_dim]` at positions 0..length-1: the tables GPTModel's own RoPE would use
    (`RotaryEmbedding.get_emb`, llama3 scaling included), shared by every layer; the newest lengths are kept.
    On a CPU-only host `get_emb` moves the frequencies to `torch.cuda.current_device()`: the CPU patch answers CPU."""
    if device.type == "cpu":
        from megatron_jetrl.actor.parallel import apply_cpu_patch_if_needed

        apply_cpu_patch_if_needed()
    emb = _rotary(head_dim, rope, device).get_emb(length)
    return emb.cos(), emb.sin()


class SDPAttention(CausalCoreAttention):
    """Core attention of the (non batch-invariant) local spec: RoPE, then causal GQA through torch's
    `scaled_dot_product_attention` (FlashAttention / cuDNN on GPU), after megatron's q/k norms.

    RoPE is applied here, not by megatron (the provider builds GPTModel with `position_embedding_type="none"`):
    megatron's fused RoPE needs Transformer Engine and its unfused one is five kernels per tensor and direction.
    Here it is `actor.fused.rope` with megatron's tables (`rope_cos_sin`) and formula: one Triton kernel per
    tensor and direction on CUDA (`fused=True`), megatron's ops to the bit on FP32 tensors (the CPU).
    megatron's local `DotProductAttention` materialises FP32 [b * heads, s, s] scores: at long sequences they take most
    of a layer's time and memory. Megatron layout in and out, as
    `BatchInvariantAttention`; megatron passes no mask for causal self-attention, so `is_causal` is the mask."""

    any_scale = True  # torch's SDPA takes megatron's softmax_scale as it is

    def __init__(self, *args, fused: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.rope_kwargs = rope_key(self.arch)
        self.rope = fused_rope if fused else rope

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if attention_mask is not None or packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention takes unpacked causal sequences without an explicit mask or bias")
        s, b = query.shape[:2]
        cos, sin = rope_cos_sin(self.head_dim, self.rope_kwargs, s, query.device)
        query, key = self.rope(query, cos, sin), self.rope(key, cos, sin)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=True)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def _column_parallel_input(layer, input, allreduce_dgrad, sequence_parallel):
    """The communication megatron's `linear_with_grad_accumulation_and_async_allreduce` does for a column-parallel
    input, done by its autograd mappings: all-gather along the sequence (backward: reduce-scatter), or identity
    forward with an all-reduce of dgrad."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=layer.tp_group)
    if allreduce_dgrad:
        return copy_to_tensor_model_parallel_region(input, group=layer.tp_group)
    return input


class BatchInvariantColumnParallelLinear(ColumnParallelLinear):
    """megatron `ColumnParallelLinear` with the engine's batch-invariant BF16 GEMM (`ops.bi_linear`): the
    BF16 linears of the batch-invariant spec and GPTModel's vocab-parallel lm_head."""

    def _forward_impl(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, **_):
        return ops.bi_linear(_column_parallel_input(self, input, allreduce_dgrad, sequence_parallel), weight, bias)


class BatchInvariantRowParallelLinear(RowParallelLinear):
    """megatron `RowParallelLinear` (megatron all-reduces the output) with `ops.bi_linear`."""

    def _forward_impl(self, input, weight, bias, **_):
        return ops.bi_linear(input, weight, bias)


class _FP8Weight:
    """Mixin: the FP8 weight of this module's shard, quantized once per weight version."""

    def _init_fp8(self, flow: PrecisionFlow):
        self.flow = flow
        self.fp8_site = type(self).__name__  # the module's name once `name_fp8_layers` has run (non-finite reports)
        self._fp8_cache: tuple[tuple, QuantizedWeight] | None = None
        self.keep_weight_t = True  # DGrad's W^T bytes kept per weight version, or made per backward (`name_fp8_layers`)
        self.fp8_device: torch.device | None = None  # where the FP8 bytes live when the BF16 weight is in host memory
        self.release_bf16 = False  # the BF16 weight's storage freed through each train step (`release_bf16_weights`)
        self.sp_overlap = NO_OVERLAP  # how its sequence-parallel forward overlaps its communication (`name_fp8_layers`)
        self.bf16_released = False

    def forget_fp8(self) -> None:
        """Drop the cached FP8 weight: the next forward (or `fp8_weights`) re-quantizes the current weight."""
        self._fp8_cache = None

    def quantized_weight(self) -> QuantizedWeight:
        """This rank's FP8 weight for the current version. In-place updates through the parameter itself
        invalidate it (version counter); megatron's mixed-precision optimizer writes the new BF16 weights
        through `param.data`, which the counter does not see, so `train_step` calls `requantize_weights`."""
        if self.bf16_released:  # until the optimizer step these bytes are all this linear holds
            return self._fp8_cache[1]
        w = self.weight
        key = _cache_key(w)
        if self._fp8_cache is None or self._fp8_cache[0] != key:
            keep_t = self.keep_weight_t and w.requires_grad  # a frozen weight (the KL reference) has no DGrad: no W^T bytes
            source = w if self.fp8_device is None else w.detach().to(self.fp8_device)  # (`offload_frozen_weights`)
            self._fp8_cache = (
                key,
                QuantizedWeight.quantize(source, self.flow, site=self.fp8_site, transposed=keep_t, keep_t=keep_t),
            )
        return self._fp8_cache[1]

    def _fp8_gemm(self, x, weight, bias, dgrad_group=None, sp_group=None, rs_group=None):
        if weight is not self.weight:
            raise RuntimeError(
                f"{type(self).__name__} quantizes its own weight only; a weight passed to forward() is not supported"
            )
        return fp8_linear(
            x,
            weight,
            bias,
            flow=self.flow,
            weight_q=self.quantized_weight(),
            site=self.fp8_site,
            gated_act=getattr(self, "gated_act", None),
            handoff=getattr(self, "grad_handoff", None),
            dgrad_group=dgrad_group,
            sp_group=sp_group,
            rs_group=rs_group,
            sp_overlap=self.sp_overlap,
        )


class FP8ColumnParallelLinear(_FP8Weight, ColumnParallelLinear):
    """megatron `ColumnParallelLinear` (out-dim shard) whose GEMM is the Jet-RL FP8 linear."""

    def __init__(self, *args, flow: PrecisionFlow, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fp8(flow)

    def _forward_impl(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, **_):
        if sequence_parallel and self.flow.train_fp8:  # the sequence gathered in FP8 (`fp8_linear`'s sp_group)
            return self._fp8_gemm(input, weight, bias, sp_group=self.tp_group)
        if allreduce_dgrad and not sequence_parallel and self.flow.train_fp8:  # the all-reduce overlaps WGrad, as megatron's
            return self._fp8_gemm(input, weight, bias, dgrad_group=self.tp_group)
        return self._fp8_gemm(_column_parallel_input(self, input, allreduce_dgrad, sequence_parallel), weight, bias)


def _bias_after_sum(layer, output):
    """The end of megatron's `RowParallelLinear.forward`: the bias added to the summed output (or given back beside it
    under `skip_bias_add`)."""
    if layer.skip_bias_add:
        return output, layer.bias
    return (output + layer.bias if layer.bias is not None else output), None


def row_parallel_in_rank_order(layer, input_):
    """A row-parallel linear's forward with its TP ranks' partial outputs summed in rank order
    (`models.ordered_reduce`, the sum vLLM takes under its ordered all-reduce patch) instead of megatron's all-reduce:
    what `use_ordered_reduce` gives the actor's row-parallel linears."""
    from megatron_jetrl.models.ordered_reduce import OrderedAllReduce

    return _bias_after_sum(layer, OrderedAllReduce.apply(layer._forward_impl(input_, layer.weight, None), layer.tp_group))


def use_ordered_reduce(model) -> int:
    """Sum every row-parallel linear's output in rank order (`row_parallel_in_rank_order`); returns how many. Raises for a
    row-parallel linear that does not take it (another spec's) or one under sequence parallelism (reduce-scattered)."""
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, RowParallelLinear):
            continue
        if not hasattr(type(module), "ordered_reduce") or module.sequence_parallel:
            raise ValueError(
                f"{name} ({type(module).__name__}) cannot sum in rank order: the ordered all-reduce needs the local spec's "
                "row-parallel linears without sequence parallelism"
            )
        module.ordered_reduce = True
        count += 1
    return count


class FP8RowParallelLinear(_FP8Weight, RowParallelLinear):
    """megatron `RowParallelLinear` (in-dim shard; megatron all-reduces the output) with the Jet-RL FP8 GEMM. Under
    sequence parallelism in FP8 the reduce-scatter moves into the FP8 linear (`fp8_linear`'s rs_group), whose backward
    gathers the output gradient in FP8 instead of megatron's BF16 all-gather; the bias is added after, as megatron's
    `forward` adds it."""

    ordered_reduce = False
    """Sum the TP ranks' outputs in rank order (`use_ordered_reduce`)."""

    def __init__(self, *args, flow: PrecisionFlow, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fp8(flow)

    def forward(self, input_):
        if self.ordered_reduce:
            return row_parallel_in_rank_order(self, input_)
        if not (self.sequence_parallel and self.flow.train_fp8 and self.input_is_parallel) or self.explicit_expert_comm:
            return super().forward(input_)
        return _bias_after_sum(self, self._fp8_gemm(input_, self.weight, None, rs_group=self.tp_group))

    def _forward_impl(self, input, weight, bias, **_):
        return self._fp8_gemm(input, weight, bias)


class FP8GatedMLP(MLP):
    """megatron's gated MLP (SwiGLU) in FP8: the down projection takes fc1's `[gate | up]` and forms its input
    `act(gate) * up` inside its 1x128 quantization (`fp8_linear(gated_act=...)`: one Triton kernel on CUDA), so
    the BF16 product is neither written nor saved; backward is torch's autograd of the same ops. With a bias-free
    fc1 (Qwen, Llama), each forward gives both linears one `GatedGradHandoff`: fc2's backward quantizes
    d[gate | up] for fc1's DGrad and WGrad itself (on CUDA from gate_up and its DGrad output in one kernel,
    `kernels.swiglu_backward_dual`), so fc1 never receives d[gate | up] in BF16."""

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        unsupported = {
            "gated_linear_unit": not config.gated_linear_unit,
            "glu_linear_offset": config.glu_linear_offset != 0,
            "activation_func_clamp_value": config.activation_func_clamp_value is not None,
        }
        if any(unsupported.values()):
            raise ValueError(
                f"FP8GatedMLP fuses a plain gated unit act(gate) * up; unsupported config: "
                f"{[k for k, v in unsupported.items() if v]}"
            )
        if not isinstance(self.linear_fc2, FP8RowParallelLinear):
            raise TypeError(f"FP8GatedMLP needs FP8RowParallelLinear as linear_fc2, got {type(self.linear_fc2).__name__}")
        self.linear_fc2.gated_act = config.activation_func

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None:
            raise NotImplementedError("FP8GatedMLP has no per-token (MoE expert) scales")
        handoff = (
            GatedGradHandoff() if self.linear_fc1.bias is None and isinstance(self.linear_fc1, FP8ColumnParallelLinear) else None
        )
        self.linear_fc1.grad_handoff = self.linear_fc2.grad_handoff = handoff
        try:
            gate_up, bias = self.linear_fc1(hidden_states)
            if bias is not None:
                gate_up = gate_up + bias
            return self.linear_fc2(gate_up)
        finally:
            self.linear_fc1.grad_handoff = self.linear_fc2.grad_handoff = None


def _linears(flow: PrecisionFlow, batch_invariant: bool):
    if not flow.train_fp8:  # bf16 and bf16-train-fp8-rollout train with BF16 linears
        if batch_invariant:
            return BatchInvariantColumnParallelLinear, BatchInvariantRowParallelLinear
        return ColumnParallelLinear, RowParallelLinear
    return (
        ModuleSpec(module=FP8ColumnParallelLinear, params={"flow": flow}),
        ModuleSpec(module=FP8RowParallelLinear, params={"flow": flow}),
    )


def _norm(batch_invariant: bool, fused: bool):
    return ModuleSpec(module=RMSNorm, params={"batch_invariant": batch_invariant, "fused": fused})


def native_layer_spec(
    flow: PrecisionFlow, arch: ModelArch, batch_invariant: bool = False, fused: bool = True, core=None, bf16_linears=None
) -> ModuleSpec:
    """megatron's local GPT layer (RMSNorm, GQA self-attention, gated MLP) with the flow's linears; its core attention
    applies RoPE (build GPTModel without RoPE). `batch_invariant`: the engine's norms, RoPE and attention; else
    `fused`: norms and RoPE as one kernel each on CUDA (`actor.fused`). `core` and `bf16_linears` (column, row) replace
    the core attention and the BF16 linears (`actor.rollout_kernels`: the vLLM engine's kernels)."""
    column, row = bf16_linears if bf16_linears and not flow.train_fp8 else _linears(flow, batch_invariant)
    norm = _norm(batch_invariant, fused)
    if core is None:
        core = partial(BatchInvariantAttention, arch=arch) if batch_invariant else partial(SDPAttention, arch=arch, fused=fused)
    return ModuleSpec(
        module=GraphedTransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=column,
                    core_attention=core,
                    linear_proj=row,
                    q_layernorm=norm if arch.qk_norm else IdentityOp,
                    k_layernorm=norm if arch.qk_norm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(
                module=FP8GatedMLP if flow.train_fp8 else MLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def native_block_spec(
    flow: PrecisionFlow,
    arch: ModelArch,
    num_layers: int,
    batch_invariant: bool = False,
    fused: bool = True,
    core=None,
    bf16_linears=None,
):
    """The decoder of one pipeline stage: `num_layers` native layers (`native_layer_spec`) and this module's RMSNorm as
    final norm (megatron would otherwise pick its torch-norm fallback, which refuses sequence parallelism)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = native_layer_spec(flow, arch, batch_invariant, fused, core, bf16_linears)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=_norm(batch_invariant, fused))


def name_fp8_layers(model, weight_t: str = "step", release_bf16: bool = False, sp_overlap: SPOverlap = NO_OVERLAP) -> None:
    """Give every FP8 linear its module name (`decoder.layers.3.mlp.linear_fc1`) for non-finite reports, where its
    DGrad's W^T bytes live (`ActorOptions.fp8_weight_t`: `step` kept per weight version, `backward` made per backward),
    whether train steps free its BF16 weight (`ActorOptions.bf16_linear_weights`, `release_bf16_weights`) and in how
    how its forward overlaps the sequence-parallel communication (`ActorOptions.sp_overlap`)."""
    for name, m in unwrap(model).named_modules():
        if isinstance(m, _FP8Weight):
            m.fp8_site = name
            m.keep_weight_t = weight_t == "step"
            m.release_bf16 = release_bf16
            m.sp_overlap = sp_overlap


def release_bf16_weights(model) -> int:
    """At a train step's start: each FP8 linear built to (`release_bf16`) quantizes its weight if not yet and frees its
    BF16 weight's storage: its forwards and backwards read only the FP8 bytes, and the optimizer step writes the weight
    again from its FP32 main param (`restore_bf16_weights` first). The linears then hold 2 bytes a parameter (W and W^T)
    through the step, as BF16 training holds its weight. The bytes freed on this rank."""
    freed = 0
    for m in unwrap(model).modules():
        if not isinstance(m, _FP8Weight) or not m.release_bf16 or m.bf16_released:
            continue
        w = m.weight
        storage = w.untyped_storage()
        if w.dtype not in (torch.bfloat16, torch.float16):
            raise RuntimeError(
                f"{m.fp8_site}: its weight is {w.dtype}, which the optimizer steps in place (no main param "
                "writes it back): only BF16 weights can be freed; set model.bf16_linear_weights=keep, or "
                "optim.bf16=true"
            )
        if storage.nbytes() != w.numel() * w.element_size():
            raise RuntimeError(
                f"{m.fp8_site}: its BF16 weight is a view into a larger buffer (megatron's distributed "
                "optimizer keeps the parameters in one): it cannot be freed alone; set "
                "model.bf16_linear_weights=keep, or optim.distributed=false"
            )
        m.quantized_weight()
        m.bf16_released = True
        freed += storage.nbytes()
        storage.resize_(0)
    return freed


def restore_bf16_weights(model) -> bool:
    """Before the optimizer step (or when a step stops early): the freed BF16 weights get their storage back, its
    contents undefined until the optimizer's copy of the FP32 main params writes them, and the FP8 copies go (the
    step makes new weights). Whether any weight was freed."""
    restored = False
    for m in unwrap(model).modules():
        if isinstance(m, _FP8Weight) and m.bf16_released:
            m.weight.untyped_storage().resize_(m.weight.numel() * m.weight.element_size())
            m.bf16_released = False
            m.forget_fp8()
            restored = True
    return restored


def offload_frozen_weights(model, host: torch.device | str = "cpu") -> int:
    """The KL reference's FP8 linears keep only their FP8 bytes on the device: a frozen (requires_grad False) FP8
    linear's BF16 weight moves to `host` memory (pinned where CUDA is), its bytes are made where the weight was. Its forward
    reads only the bytes; a new value (`load_state_dict`, a checkpoint load) lands in host memory and is quantized
    again on the device at the next forward, as any weight update is; checkpoints save it from there. Returns the
    bytes of device memory freed (0 when the weights are on `host` already: a CPU run)."""
    host, freed = torch.device(host), 0
    for m in unwrap(model).modules():
        w = getattr(m, "weight", None)
        if not isinstance(m, _FP8Weight) or not m.flow.train_fp8 or w.requires_grad or w.device == host:
            continue
        moved = w.detach().to(host)
        m.fp8_device = w.device
        freed += w.numel() * w.element_size()
        w.data = moved.pin_memory() if host.type == "cpu" and torch.cuda.is_available() else moved
        m.forget_fp8()  # the bytes are made on the device at the next forward (the weights are loaded before one runs)
    return freed


def _cache_key(w: torch.Tensor) -> tuple:
    return (w._version, w.data_ptr(), w.dtype, tuple(w.shape), w.requires_grad)


def fp8_copy_bytes(model, pending: bool = False) -> int:
    """Device bytes of the FP8 weight copies of `model`'s FP8 linears (local spec): each weight's E4M3 bytes and FP32
    128x128 scales, and W^T's as many again where DGrad keeps them (`keep_weight_t`, a trainable weight). All of them,
    or (`pending`) those of weights not quantized for their current version yet, which the next forward will make."""
    total = 0
    for m in unwrap(model).modules():
        if not isinstance(m, _FP8Weight) or (pending and m._fp8_cache is not None):
            continue
        n, k = m.weight.shape
        copies = 2 if m.keep_weight_t and m.weight.requires_grad else 1
        total += copies * (n * k + -(-n // 128) * -(-k // 128) * 4)
    return total


def fp8_copy_storages(model) -> list[torch.UntypedStorage]:
    """The storages of the FP8 weight copies `model`'s FP8 linears hold now (bytes, scales, kept W^T)."""
    found = []
    for m in unwrap(model).modules():
        if isinstance(m, _FP8Weight) and m._fp8_cache is not None:
            w = m._fp8_cache[1]
            found += [t.untyped_storage() for t in (w.q, w.s, *(w._t or ()))]
    return found


def trains_fp8_on_cuda(model) -> bool:
    """Whether any of this model's linears trains through the FP8 GEMMs on a GPU (`fp8.gemm.token_multiple` matters)."""
    return any(isinstance(m, _FP8Weight) and m.flow.train_fp8 and m.weight.is_cuda for m in unwrap(model).modules())


def requantize_weights(model) -> None:
    """After an optimizer step: every FP8 linear re-quantizes its weight on next use (once per step)."""
    for m in unwrap(model).modules():
        if isinstance(m, _FP8Weight):
            m.forget_fp8()


def fp8_weights(model) -> dict[str, QuantizedWeight]:
    """This rank's FP8 weights by megatron parameter name (`...linear_qkv.weight`, as in models.mapping).

    The very objects the forward used for the current weight version (quantized now if not yet):
    feed them to `models.export.hf_tensors(..., fetch_fp8=...)` so the rollout gets those bytes. Weights quantized
    here (after each optimizer step, for the weight sync) are checked for NaN/Inf together, one host sync, not one
    per weight (`check_finite="step"`); the error names the first bad weight."""
    with finite.watch() as watch:
        weights = {
            f"{name}.weight": m.quantized_weight() for name, m in unwrap(model).named_modules() if isinstance(m, _FP8Weight)
        }
    watch.check()
    return weights
