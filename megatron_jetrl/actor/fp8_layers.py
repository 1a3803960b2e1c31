"""The native Jet-RL layer spec: megatron-core's local transformer layer whose linears run the core FP8 linear.

`FP8ColumnParallelLinear` / `FP8RowParallelLinear` subclass megatron's `ColumnParallelLinear` /
`RowParallelLinear` and replace only their GEMM (`_forward_impl`), so TP semantics stay megatron's:
column-parallel holds an out-dim shard (input copied to the TP region, dgrad all-reduced, or all-gathered
along the sequence under sequence parallelism); row-parallel holds an in-dim shard and megatron's
`forward` all-reduces (or reduce-scatters) the partial outputs and adds the bias afterwards.

The GEMM is `megatron_jetrl.fp8.fp8_linear` (FP8 FProp/DGrad/WGrad in mode `jetrl`, see `megatron_jetrl.fp8`).
Each module quantizes its weight shard once per weight version (`quantized_weight()`); those are the
bytes the weight sync and the converter ship (`fp8_weights(model)`). Because every split dimension is a
multiple of 128 (`ModelArch.check_fp8_tp`, checked by the provider), a shard's bytes are exactly the
corresponding blocks of the full weight's bytes.

Why not `TransformerConfig(fp8="e4m3", fp8_recipe="blockwise")` with the local spec: megatron then
builds plain linears without a word (FP8 only exists through TE modules); tests prove FP8 is in this
spec's forward.
"""

from __future__ import annotations

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_jetrl.fp8 import PrecisionFlow, QuantizedWeight, fp8_linear


class RMSNorm(torch.nn.Module):
    """RMSNorm as HF Qwen2/Qwen3/Llama compute it (FP32 statistics), usable with sequence parallelism.

    megatron's torch-norm fallback refuses sequence parallelism; this norm marks its weight
    `sequence_parallel` so megatron's `finalize_model_grads` all-reduces its grad over the TP group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _FP8Weight:
    """Mixin: the FP8 weight of this module's shard, quantized once per weight version."""

    def _init_fp8(self, flow: PrecisionFlow):
        self.flow = flow
        self._fp8_cache: tuple[tuple, QuantizedWeight] | None = None

    def quantized_weight(self) -> QuantizedWeight:
        """This rank's FP8 weight for the current version (optimizer steps and `.data` swaps invalidate it)."""
        w = self.weight
        key = (w._version, w.data_ptr(), w.dtype, tuple(w.shape))
        if self._fp8_cache is None or self._fp8_cache[0] != key:
            self._fp8_cache = (key, QuantizedWeight.quantize(w, self.flow))
        return self._fp8_cache[1]

    def _fp8_gemm(self, x, weight, bias):
        if weight is not self.weight:
            raise RuntimeError(f"{type(self).__name__} quantizes its own weight only; a weight passed to forward() is not supported")
        return fp8_linear(x, weight, bias, flow=self.flow, weight_q=self.quantized_weight())


class FP8ColumnParallelLinear(_FP8Weight, ColumnParallelLinear):
    """megatron `ColumnParallelLinear` (out-dim shard) whose GEMM is the Jet-RL FP8 linear."""

    def __init__(self, *args, flow: PrecisionFlow, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fp8(flow)

    def _forward_impl(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, **_):
        # The communication megatron's linear_with_grad_accumulation_and_async_allreduce does, done by its
        # autograd mappings: all-gather along the sequence (backward: reduce-scatter), or identity forward
        # with an all-reduce of dgrad.
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=self.tp_group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=self.tp_group)
        return self._fp8_gemm(input, weight, bias)


class FP8RowParallelLinear(_FP8Weight, RowParallelLinear):
    """megatron `RowParallelLinear` (in-dim shard; megatron all-reduces the output) with the Jet-RL FP8 GEMM."""

    def __init__(self, *args, flow: PrecisionFlow, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fp8(flow)

    def _forward_impl(self, input, weight, bias, **_):
        return self._fp8_gemm(input, weight, bias)


def _linears(flow: PrecisionFlow):
    if not flow.train_fp8:  # bf16 and bf16-train-fp8-rollout train with plain linears
        return ColumnParallelLinear, RowParallelLinear
    return (ModuleSpec(module=FP8ColumnParallelLinear, params={"flow": flow}),
            ModuleSpec(module=FP8RowParallelLinear, params={"flow": flow}))


def native_layer_spec(flow: PrecisionFlow, qk_norm: bool) -> ModuleSpec:
    """megatron's local GPT layer (RMSNorm, GQA self-attention, gated MLP) with the flow's linears."""
    column, row = _linears(flow)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=column,
                    core_attention=DotProductAttention,
                    linear_proj=row,
                    q_layernorm=RMSNorm if qk_norm else IdentityOp,
                    k_layernorm=RMSNorm if qk_norm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def native_block_spec(flow: PrecisionFlow, qk_norm: bool, num_layers: int):
    """The decoder of one pipeline stage: `num_layers` native layers and this module's RMSNorm as final norm
    (megatron would otherwise pick its torch-norm fallback, which refuses sequence parallelism)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    return TransformerBlockSubmodules(layer_specs=[native_layer_spec(flow, qk_norm)] * num_layers, layer_norm=RMSNorm)


def unwrap(model):
    """The GPTModel inside megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def fp8_weights(model) -> dict[str, QuantizedWeight]:
    """This rank's FP8 weights by megatron parameter name (`...linear_qkv.weight`, as in models.mapping).

    The very objects the forward used for the current weight version (quantized now if not yet):
    feed them to `models.export.hf_tensors(..., fetch_fp8=...)` so the rollout gets those bytes.
    """
    return {f"{name}.weight": m.quantized_weight() for name, m in unwrap(model).named_modules() if isinstance(m, _FP8Weight)}
