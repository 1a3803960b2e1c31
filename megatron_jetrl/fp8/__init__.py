"""The FP8 precision flow of Jet-RL: formats, scales, layouts, and why each GEMM is quantized as it is.

This is the one place where the numerics are explained; the code in this package follows it.

Format
------
E4M3 (`torch.float8_e4m3fn`): 1 sign, 4 exponent, 3 mantissa bits, largest finite value 448, no inf,
subnormals down to 2**-9. Every tensor that enters an FP8 GEMM is stored as E4M3 bytes plus one FP32
scale per group or block. The scale is the *dequant multiplier* (`x ~= q * s`); checkpoints call it
`weight_scale_inv`.

Granularity (Jet-RL paper, section 4.2; DeepSeek-V3 style)
---------------------------------------------------------
block (1, 128)     one scale per row per 128 consecutive columns       activations, output gradients
block (128, 1)     one scale per column per 128 consecutive rows       WGrad operands, along tokens
block (128, 128)   one scale per 128x128 tile                          weights

Partial groups at the end of a dimension get their own scale (ceil-division); the scale tensor of
`x[..., M, K]` is `[..., M, ceil(K/128)]`, `[..., ceil(M/128), K]` or `[..., ceil(M/128), ceil(K/128)]`.
For a weight `[N, K]` this is exactly the layout of vLLM's `weight_scale_inv`.

The quantizer (bit-exact contract)
----------------------------------
For each group G, computing in FP32::

    amax = max(max(|x|) over G, eps)            eps = 1e-10
    s    = amax / 448                           a true IEEE division, never amax * (1/448)
    ue8m0 only: s = 2**ceil(log2(max(s, 1e-10)))  (exact round-up to a power of two: the exponent is
                                                bumped when the mantissa is non-zero)
    q    = e4m3(clamp(x / s, -448, 448))        true division, round-to-nearest-even

"True division" is the correctly rounded quotient, however it is computed: the CUDA and Triton kernels form it
from one reciprocal per group, RN(x * RN(1/s)) plus one FMA correction (Markstein) for BF16 values, two for wider
ones, and tests/gpu checks that against the IEEE division for every 24-bit significand of s (`fp8/kernels.py`).

This is vLLM's activation quantizer, read in `csrc/quantization/w8a8/fp8/per_token_group_quant.cu`
(vllm-project/vllm commit 0f5257e2, 2026-11) and its Triton fallback `_per_token_group_quant_fp8` in
`vllm/model_executor/layers/quantization/utils/fp8_utils.py`; the pinned vLLM 0.26.0's CUDA op
`per_token_group_fp8_quant` gave our bytes exactly on an H200 (fp32 and ue8m0). Two notes
from reading it: the CUDA UE8M0 branch clamps `s` below at 1e-10 before rounding (only groups with
amax < 4.5e-8 notice), which we follow; its newest register kernel computes the power of two by bit
manipulation, which is the exact definition above (the Triton fallback's `exp2(ceil(log2(s)))` can
round down when the mantissa of `s` is a few ulp above a power of two; we follow the exact one).

An all-zero group gets `s = eps / 448` (finite) and zero bytes. NaN or +-inf input is an error that
names the element (`NonFiniteInputError`): torch on CPU would silently turn inf into 448. With the
check switched off (hot GPU paths), a non-finite group yields a NaN/inf scale and NaN bytes, so the
poison propagates to the loss instead of turning into a plausible number.

Why each GEMM is quantized as it is (Y = X W^T, X: [tokens, C], W: [D, C])
--------------------------------------------------------------------------
FProp   Y  = X(1x128 along C) . W(128x128)^T       the only forward GEMM: training and rollout share it
DGrad   dX = dY(1x128 along D) . W(128x128)        the *same* weight bytes and scales, used transposed;
                                                   a 128x128 block is symmetric in its two axes
WGrad   dW = dY^T(128x1 along tokens) . X(128x1 along tokens)
                                                   both operands reduced over tokens, so both are
                                                   grouped along tokens; X is the FP8 activation saved
                                                   by the forward, dequantized in FP32 (q * s) and
                                                   re-quantized along tokens (no BF16 copy is kept)

Gradients between ops stay BF16 (a SwiGLU MLP's d[gate | up] at most transiently: the down projection's backward
makes it and quantizes it for the up projection's DGrad and WGrad, `GatedGradHandoff`, the bytes of quantizing
the BF16 gradient); GEMMs output BF16 (or the input dtype). Master weights stay in their
own dtype; the weight is quantized once per optimizer step (cached by parameter version) and those
bytes serve every micro-batch forward, the backward, and the export to the rollout engine.
Embeddings, lm_head, norms and attention stay BF16.

GEMM backends
-------------
All backends take the same quantized operands and differ only in accumulation order:
`emulated` (any device) dequantizes exactly and accumulates each 128-wide K block in FP64 -- a product
of two E4M3 values has at most 8 significant bits, so a 128-term block sum is exact in FP64 -- then
scales and sums the blocks in a fixed order. Its result for a row depends on that row alone (batch
invariant), which is what lets the rollout engine reproduce the actor's logprobs bit for bit on CPU.
`cublaslt` (torch `F.scaled_mm`, sm90), `triton` (portable, sm89+) and `deepgemm` (when importable) are
the fast paths on GPUs; on CUDA the quantizers run as a CUDA tile kernel (`fp8/cuda_tiles.py`: BF16 1x128
rows, the backward's token-grouped 128x1 passes written transposed, 128x128 weight tiles) where the layout allows
its 16-byte accesses, and as Triton kernels (`fp8/kernels.py`) otherwise and for the SwiGLU-fused input, all
checked byte for byte against the torch reference in `tests/gpu`.

Precision modes (`PrecisionFlow.mode`)
--------------------------------------
bf16                     BF16 training and rollout (baseline)
bf16-train-fp8-rollout   BF16 training, FP8 rollout: two different forward graphs (the unstable foil)
jetrl                    FP8 FProp/DGrad/WGrad in training, the identical FP8 forward in rollout
"""

from megatron_jetrl.fp8.flow import PrecisionFlow
from megatron_jetrl.fp8.gemm import available_backends, blockwise_gemm
from megatron_jetrl.fp8.linear import (
    FP8Linear,
    GatedGradHandoff,
    QuantizedWeight,
    fp8_linear,
    fp8_linear_forward,
    fp8_linears_forward,
)
from megatron_jetrl.fp8.quant import (
    BLOCKS,
    E4M3_MAX,
    NonFiniteInputError,
    check_shard_alignment,
    dequantize_blockwise,
    quantize_blockwise,
    scale_shape,
)

__all__ = [
    "BLOCKS",
    "E4M3_MAX",
    "FP8Linear",
    "NonFiniteInputError",
    "PrecisionFlow",
    "QuantizedWeight",
    "available_backends",
    "blockwise_gemm",
    "check_shard_alignment",
    "dequantize_blockwise",
    "fp8_linear",
    "GatedGradHandoff",
    "fp8_linear_forward",
    "fp8_linears_forward",
    "quantize_blockwise",
    "scale_shape",
]
