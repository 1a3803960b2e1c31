"""Transformer Engine (TE) for the Jet-RL flow: recipes from a `PrecisionFlow`, TE's quantizer numerics, TE tensors.

Matched against TransformerEngine 2.20.2 (the kit in shared/kits/te) and megatron-core 0.16.1. TE is imported
lazily: nothing here needs it on a CPU machine except the functions that say so.

The recipe decision
-------------------
The actor's TE layers run `TransformerConfig(fp8="e4m3", fp8_recipe="custom", fp8_quantizer_factory=...)`
(`actor.te_recipe`). megatron's `get_fp8_recipe` then builds `CustomRecipe(qfactory=<our factory>)` and TE asks
the factory for one quantizer per GEMM operand: `quantizer_factory(flow)` answers with TE's own
`Float8BlockQuantizer` -- 128x128 tiles for `linear` weights, 1x128 groups for inputs and output gradients, E4M3,
`amax_epsilon = flow.eps` (1e-10, vLLM's) and `force_pow_2_scales = (flow.scale_mode == "ue8m0")` -- and an
`IdentityQuantizer` for every other slot (the output and grad-input slots come with role `None`). So TE's own CUDA
kernels and cuBLASLt block GEMMs run, with the flow's eps and scale mode. Why not megatron's
`fp8_recipe="blockwise"`: it builds `Float8BlockScaling(fp8_format=...)`, whose QParams are class attributes fixed
from `NVTE_FP8_BLOCK_SCALING_FP32_SCALES` when TE is first imported, with `amax_epsilon=0.0` (all-zero groups then
get scale 1, not vLLM's eps/448). Why not quantizers written in Python (TE's `custom` quantizer protocol): TE's
fused norm+quantize and its backward would bypass or slow them, and they would need our GEMM inside TE.

What TE computes (read in `common/recipe/recipe_common.cuh` `compute_scale_from_amax` and
`common/transpose/quantize_transpose_{vector,square}_blockwise.cu`), per group G, in FP32::

    amax  = max(max(|x|) over G, eps)
    scale = RN(448 / amax)                     (__fdiv_rn; if it overflows: the input dtype's max)
    pow2:   scale = bits(scale) & 0xFF800000   (mantissa cut: rounds the *quantize* multiplier down)
    q     = e4m3_satfinite(RN(x * scale))
    scale_inv = RN(1 / scale)                  (what TE stores and its GEMM multiplies by)

Our contract (vLLM's) is `s = RN(amax / 448)`, ue8m0 `s = 2**ceil(log2(max(s, 1e-10)))`, `q = e4m3(x / s)`.
`te_quantize` below is TE's rule in torch; the GPU test proves it equals TE's kernels byte for byte, and the CPU
tests compare it with `quantize_blockwise`. Consequences (asserted in tests/unit/test_te_cpu.py and tests/gpu/test_te.py):

* `ue8m0`: identical bytes and scales in every group with max(amax, eps) > 448 * 2**-34 = 2.6e-8. There, 1/scale is
  2**ceil(log2(amax/448)) exactly: neither RN(448/amax) nor RN(amax/448) can round onto a power of two unless it
  is one already (for amax with a 24-bit mantissa, 7 * 2**p = m * 2**q(1 +- 2**-24) forces equality), and x*2**-k
  equals x/2**k exactly (vLLM's floor s >= 1e-10 gives 2**-33 either way above that amax). Groups at or below it
  (all-zero groups included) differ: vLLM's CUDA kernel floors s at 1e-10 (scale 2**-33), TE does not (it gives
  2**ceil(log2(max(amax, eps)/448)) <= 2**-34); their bytes differ too unless the group is zero.
* `fp32`: scale_inv = RN(1/RN(448/amax)) and s = RN(amax/448) differ by at most one FP32 ulp, in a fraction of
  the groups; RN(x * scale) and RN(x / s) differ by about an FP32 ulp, so after the E4M3 rounding a small fraction
  of elements (those next to an E4M3 rounding midpoint) land on the *adjacent* E4M3 code. No other difference.

So with `ue8m0` the TE actor and a vLLM/native rollout run the same forward bytes (tiny groups aside); with `fp32`
the *weights* still agree exactly -- the export ships the bytes and `scale_inv` TE trained with
(`actor.te_recipe.te_fp8_weights`, and `te_quantize` in the converter), which the rollout dequantizes unchanged --
but the rollout re-quantizes activations with `x / s`, so a small fraction of activation elements differ by one
E4M3 step from TE's. That is measured and reported (tools/gpu/gpu_te.sh), not hidden; use `ue8m0` (or the local spec)
for a bit-identical activation flow.

TE tensor layouts (`Float8BlockwiseQTensor`, GEMM-ready, TE 2.20.2 `Float8BlockQuantizer.get_scale_shape`): data
is uint8 of the tensor's shape (row-wise) or of its transpose (column-wise). 128x128 row-wise scales are
`[ceil(M/128), roundup(ceil(K/128), 4)]`; 1x128 row-wise scales are *transposed*, `[ceil(K/128), roundup(M, 4)]`;
column-wise (128x1 along M) scales are `[ceil(M/128), roundup(K, 4)]`. `from_te_*` cut the padding and return our
layout (`quant.scale_shape`).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch
import torch.nn.functional as F

from megatron_jetrl.fp8.flow import PrecisionFlow
from megatron_jetrl.fp8.quant import E4M3, E4M3_MAX, EPS, UE8M0_FLOOR, scale_shape

TE_VERSION = "2.20.2"
INSTALL_LINE = "bash .kits/te/bin/build.sh 2.20.2 .kits/te/v2.20.2/base .kits/te/v2.20.2/core-sm90 && source .kits/te/bin/env.sh"
"""How TE gets onto the GPU machine (shared/kits/README.md, after `cp -r shared/kits .kits`)."""
INSTALL_HINT = (
    f"Transformer Engine {TE_VERSION} is not importable here (transformer_engine and transformer_engine_torch). "
    f"On the GPU machine install it from the kit: `{INSTALL_LINE}` (shared/kits/te/README.md); or use the "
    "local spec (model.spec=local), which runs anywhere"
)

QUANTIZED_ROLES = {"input": 1, "weight": 2, "grad_output": 1}  # tensor -> block scaling dim (1: 1x128, 2: 128x128)
UE8M0_TE_DIFFERS_AT_OR_BELOW = E4M3_MAX * 2.0 ** math.floor(math.log2(UE8M0_FLOOR))
"""ue8m0: exactly the groups with max(amax, eps) <= 448 * 2**-34 (2.6e-8) get another scale from TE (2**ceil(log2(amax/448)),
below 2**-33) than from vLLM (floored at 1e-10, i.e. 2**-33); see above."""
_INPUT_MAX = {
    torch.bfloat16: torch.finfo(torch.bfloat16).max,
    torch.float16: torch.finfo(torch.float16).max,
    torch.float32: torch.finfo(torch.float32).max,
}


@functools.cache
def te_installed() -> bool:
    """Whether TE's PyTorch side imports. `transformer_engine_torch` is not on sys.path in the kit's install (TE's
    loader puts it in sys.modules when `transformer_engine.pytorch` imports), so it is imported, not looked up;
    a machine without the `transformer_engine` package answers at once."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or present without its CUDA libraries: not usable here
        return False
    return True


def require_te() -> None:
    """RuntimeError with the install line when TE is not importable here."""
    if not te_installed():
        raise RuntimeError(INSTALL_HINT)


def _require_fp8_training(flow: PrecisionFlow) -> None:
    if not flow.train_fp8:
        raise ValueError(f"mode={flow.mode!r} trains in BF16: no Transformer Engine FP8 recipe applies (use mode='jetrl')")


# ---- recipes ----------------------------------------------------------------------------------------------


def te_qparams_kwargs(flow: PrecisionFlow) -> dict:
    """Keyword arguments of TE's `QParams` for activations, weights and gradients alike."""
    return {"power_2_scale": flow.scale_mode == "ue8m0", "amax_epsilon": flow.eps}


def block_scaling_recipe(flow: PrecisionFlow, recipe_module=None):
    """A TE `Float8BlockScaling` matching the flow (E4M3, 1D inputs/grads, 2D weights, the flow's QParams).

    For direct use with `te.autocast(recipe=...)` (tests, tools); megatron's layers take `actor.te_recipe`'s
    custom recipe instead. QParams are class attributes in TE, so they are set on the instance.
    """
    _require_fp8_training(flow)
    os.environ.update(flow.te_env())
    if recipe_module is None:
        import transformer_engine.common.recipe as recipe_module
    recipe = recipe_module.Float8BlockScaling(
        fp8_format=recipe_module.Format.E4M3, x_block_scaling_dim=1, w_block_scaling_dim=2, grad_block_scaling_dim=1
    )
    qparams = recipe_module.QParams(**te_qparams_kwargs(flow))
    recipe.fp8_quant_fwd_inp = recipe.fp8_quant_fwd_weight = recipe.fp8_quant_bwd_grad = qparams
    return recipe


def role_tensor_type(role) -> str | None:
    """'input' / 'weight' / 'grad_output' for the linear roles we quantize, None for any other role.

    Accepts the old string roles ("linear_input") and TE 2.20's `QuantizerRole(module_type, tensor_type, name)`.
    """
    if role is None:
        return None
    if isinstance(role, str):
        module_type, _, tensor_type = role.partition("_")
        if module_type == "grouped":
            module_type, _, tensor_type = tensor_type.partition("_")
            module_type = "grouped_linear" if module_type == "linear" else module_type
    else:
        module_type, tensor_type = getattr(role, "module_type", ""), getattr(role, "tensor_type", "")
    if module_type not in ("linear", "grouped_linear") or tensor_type not in QUANTIZED_ROLES:
        return None
    return tensor_type


def quantizer_kwargs(flow: PrecisionFlow, tensor_type: str) -> dict:
    """Keyword arguments of TE's `Float8BlockQuantizer` for one operand (besides `fp8_dtype`)."""
    _require_fp8_training(flow)
    return {
        "rowwise": True,
        "columnwise": True,
        "amax_epsilon": flow.eps,
        "force_pow_2_scales": flow.scale_mode == "ue8m0",
        "block_scaling_dim": QUANTIZED_ROLES[tensor_type],
    }


def _identity_quantizer():
    try:
        from transformer_engine.pytorch.tensor.identity_tensor import IdentityQuantizer  # TE 2.20
    except ImportError:  # pragma: no cover - older TE
        from transformer_engine.pytorch.quantization import IdentityQuantizer
    return IdentityQuantizer()


def make_block_quantizer(flow: PrecisionFlow, tensor_type: str, *, rowwise: bool = True, columnwise: bool = True):
    """TE's `Float8BlockQuantizer` for `tensor_type` ('input', 'weight', 'grad_output') under the flow (needs TE)."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    kwargs = quantizer_kwargs(flow, tensor_type) | {"rowwise": rowwise, "columnwise": columnwise}
    return Float8BlockQuantizer(fp8_dtype=tex.DType.kFloat8E4M3, **kwargs)


def quantizer_factory(flow: PrecisionFlow):
    """A `CustomRecipe` qfactory: TE's blockwise quantizers for the linear operands, identity for every other slot."""
    _require_fp8_training(flow)

    def factory(role=None):
        tensor_type = role_tensor_type(role)
        if tensor_type is None:
            return _identity_quantizer()  # TE 2.20 refuses None ("return an IdentityQuantizer")
        return make_block_quantizer(flow, tensor_type)

    return factory


def custom_recipe(flow: PrecisionFlow, recipe_module=None):
    """TE >= 2.9 `CustomRecipe` whose quantizers come from `quantizer_factory(flow)`."""
    if recipe_module is None:
        import transformer_engine.common.recipe as recipe_module
    if not hasattr(recipe_module, "CustomRecipe"):
        raise RuntimeError("this Transformer Engine has no CustomRecipe (added in TE 2.9); use block_scaling_recipe(flow)")
    return recipe_module.CustomRecipe(qfactory=quantizer_factory(flow), fp8_format=recipe_module.Format.E4M3)


# ---- TE's quantizer numerics in torch -------------------------------------------------------------------------


def te_scale(amax: torch.Tensor, scale_mode: str, *, eps: float = EPS, input_dtype=torch.bfloat16) -> torch.Tensor:
    """TE's quantize multiplier `scale` for FP32 group amaxes (compute_scale_from_amax, TE 2.20.2)."""
    amax = torch.where(amax < eps, torch.full_like(amax, eps), amax)
    scale = torch.tensor(E4M3_MAX, dtype=torch.float32, device=amax.device) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _INPUT_MAX[input_dtype]), scale)
    if scale_mode == "ue8m0":
        scale = (scale.view(torch.int32) & -(1 << 23)).view(torch.float32)  # & 0xFF800000
    return scale


def te_quantize(x: torch.Tensor, block, scale_mode: str = "fp32", *, eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's blockwise quantization of `x` [M, K] in torch: `(q, scale_inv)` in `quantize_blockwise`'s layout.

    block (1, 128): TE's 1D row-wise operand; (128, 1): its column-wise (WGrad) copy of the same tensor;
    (128, 128): its 2D weight. Bytes and scales equal TE's kernels (tests/gpu/test_te.py); no NaN/inf check.
    """
    block = tuple(block)
    if x.dim() != 2 or block not in ((1, 128), (128, 1), (128, 128)):
        raise ValueError(f"te_quantize takes a 2-D tensor and block (1,128), (128,1) or (128,128); got {tuple(x.shape)}, {block}")
    m, k = x.shape
    bm, bk = block
    mb, kb = -(-m // bm), -(-k // bk)
    x32 = F.pad(x.to(torch.float32), (0, kb * bk - k, 0, mb * bm - m))
    tiles = x32.view(mb, bm, kb, bk)
    scale = te_scale(tiles.abs().amax(dim=(1, 3)), scale_mode, eps=eps, input_dtype=x.dtype)
    q = torch.clamp(tiles * scale[:, None, :, None], -E4M3_MAX, E4M3_MAX).to(E4M3)  # satfinite, RNE
    scale_inv = torch.ones((), dtype=torch.float32, device=x.device) / scale
    return q.view(mb * bm, kb * bk)[:m, :k].contiguous(), scale_inv.reshape(scale_shape(x.shape, block))


def te_quantize_weight(weight: torch.Tensor, flow: PrecisionFlow):
    """A `QuantizedWeight` with TE's 128x128 bytes and scale_inv (what a TE-trained actor's forward used)."""
    from megatron_jetrl.fp8.linear import QuantizedWeight

    q, s = te_quantize(weight.detach(), (128, 128), flow.scale_mode, eps=flow.eps)
    return QuantizedWeight(q, s)


# ---- TE tensors -> our layout ---------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def from_te_rowwise(data: torch.Tensor, scale_inv: torch.Tensor, is_2d: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise data [.., K] (uint8 or e4m3) and GEMM-ready scale_inv of a TE block tensor -> `(q [M, K], s)`."""
    k = data.shape[-1]
    m = data.numel() // k if k else 0
    q = data.reshape(m, k).view(torch.uint8).view(E4M3)
    if is_2d:
        want = (_cdiv(m, 128), _cdiv(k, 128))
        s = scale_inv[: want[0], : want[1]]
    else:
        want = (_cdiv(k, 128), m)
        s = scale_inv[: want[0], : want[1]].t()
    if tuple(s.shape) != (want if is_2d else want[::-1]):
        raise ValueError(
            f"TE scale_inv {tuple(scale_inv.shape)} does not hold the {'128x128' if is_2d else '1x128'} scales "
            f"of data {tuple(data.shape)} (GEMM-ready layout of TE {TE_VERSION} expected)"
        )
    return q, s.contiguous()


def from_te_columnwise(data_t: torch.Tensor, scale_inv_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column-wise (1D, 128x1 along M) data [K, M] and scale_inv of a TE block tensor -> `(q [M, K], s [ceil(M/128), K])`,
    the layout of `quantize_blockwise(x, (128, 1))`."""
    k = data_t.shape[0]
    m = data_t.numel() // k if k else 0
    want = (_cdiv(m, 128), k)
    s = scale_inv_t[: want[0], : want[1]]
    if tuple(s.shape) != want:
        raise ValueError(
            f"TE column-wise scale_inv {tuple(scale_inv_t.shape)} does not hold the 128x1 scales of data {tuple(data_t.shape)}"
        )
    return data_t.reshape(k, m).view(torch.uint8).view(E4M3).t().contiguous(), s.contiguous()


def te_tensor_parts(qt) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`{"rowwise": (q, s), "columnwise": (q, s)}` (those present) of a TE `Float8BlockwiseQTensor(Storage)`."""
    parts = {}
    if getattr(qt, "_rowwise_data", None) is not None:
        parts["rowwise"] = from_te_rowwise(qt._rowwise_data, qt._rowwise_scale_inv, qt._is_2D_scaled)
    if getattr(qt, "_columnwise_data", None) is not None:
        if qt._is_2D_scaled:  # a 128x128 tile has one scale: the column-wise copy is the transpose
            q, s = from_te_rowwise(qt._columnwise_data, qt._columnwise_scale_inv, True)
            parts["columnwise"] = (q.t().contiguous(), s.t().contiguous())
        else:
            parts["columnwise"] = from_te_columnwise(qt._columnwise_data, qt._columnwise_scale_inv)
    if not parts:
        raise ValueError(f"{type(qt).__name__} holds neither row-wise nor column-wise data")
    return parts


def te_weight(qt):
    """The row-wise bytes + 128x128 scale_inv of a TE 2D block tensor as a `QuantizedWeight`."""
    from megatron_jetrl.fp8.linear import QuantizedWeight

    if not getattr(qt, "_is_2D_scaled", False):
        raise ValueError("a weight must be a 128x128 (2D) scaled TE tensor")
    q, s = te_tensor_parts(qt)["rowwise"]
    return QuantizedWeight(q, s)


# ---- comparing two quantizations ------------------------------------------------------------------------------


def byte_diff(q_a: torch.Tensor, s_a: torch.Tensor, q_b: torch.Tensor, s_b: torch.Tensor, block) -> dict:
    """How two quantizations of one tensor differ: identical fractions, whether every differing byte is the adjacent
    E4M3 code of the same sign, the largest scale difference in FP32 ulps, and the differing groups' mask."""
    a, b = q_a.view(torch.uint8).to(torch.int16), q_b.view(torch.uint8).to(torch.int16)
    same = a == b
    adjacent = ((a >> 7) == (b >> 7)) & (((a & 0x7F) - (b & 0x7F)).abs() == 1)
    ulps = (s_a.view(torch.int32).to(torch.int64) - s_b.view(torch.int32).to(torch.int64)).abs()
    bm, bk = tuple(block)
    m, k = q_a.shape
    pad = F.pad((~same).to(torch.int8), (0, _cdiv(k, bk) * bk - k, 0, _cdiv(m, bm) * bm - m))
    group_diff = pad.view(_cdiv(m, bm), bm, _cdiv(k, bk), bk).amax(dim=(1, 3)).bool().reshape(s_a.shape)
    return {
        "bytes_identical": float(same.float().mean()) if same.numel() else 1.0,
        "scales_identical": float((ulps == 0).float().mean()) if ulps.numel() else 1.0,
        "differing_bytes": int((~same).sum()),
        "differing_bytes_adjacent": bool((same | adjacent).all()),
        "max_scale_ulps": int(ulps.max()) if ulps.numel() else 0,
        "groups_with_byte_diff": group_diff,
        "groups_with_scale_diff": (ulps != 0).reshape(s_a.shape),
    }


def group_amax(x: torch.Tensor, block) -> torch.Tensor:
    """FP32 amax of every group/block of `x` [M, K] (the layout of its scales)."""
    bm, bk = tuple(block)
    m, k = x.shape
    x32 = F.pad(x.to(torch.float32).abs(), (0, _cdiv(k, bk) * bk - k, 0, _cdiv(m, bm) * bm - m))
    return x32.view(_cdiv(m, bm), bm, _cdiv(k, bk), bk).amax(dim=(1, 3)).reshape(scale_shape(x.shape, block))


def fraction(mask: torch.Tensor) -> float:
    return float(mask.float().mean()) if mask.numel() else 0.0


__all__ = [
    "INSTALL_HINT",
    "INSTALL_LINE",
    "TE_VERSION",
    "UE8M0_TE_DIFFERS_AT_OR_BELOW",
    "block_scaling_recipe",
    "byte_diff",
    "custom_recipe",
    "fraction",
    "from_te_columnwise",
    "from_te_rowwise",
    "group_amax",
    "make_block_quantizer",
    "quantizer_factory",
    "quantizer_kwargs",
    "require_te",
    "role_tensor_type",
    "te_installed",
    "te_quantize",
    "te_quantize_weight",
    "te_scale",
    "te_tensor_parts",
    "te_weight",
]
