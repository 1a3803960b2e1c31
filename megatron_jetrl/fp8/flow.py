"""`PrecisionFlow`: the one frozen object that decides quantization for the trainer and the rollout."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from megatron_jetrl.fp8.finite import CHECK_MODES
from megatron_jetrl.fp8.gemm import BACKENDS as GEMM_BACKENDS
from megatron_jetrl.fp8.quant import EPS, SCALE_MODES

MODES = ("bf16", "bf16-train-fp8-rollout", "jetrl")
GEMMS = ("fprop", "dgrad", "wgrad")
KV_CACHES = ("bf16", "fp8")
KV_SCALES = ("auto", "none", "amax", "running_max", "fixed", "engine")
TRAINER_KV_SCALES = ("amax", "running_max", "fixed")


@dataclass(frozen=True)
class PrecisionFlow:
    """Precision of every linear GEMM in training and rollout (see `megatron_jetrl.fp8` for the numerics)."""

    mode: str = "jetrl"
    """`bf16` (baseline), `bf16-train-fp8-rollout` (the unstable foil: two forward graphs) or `jetrl`
    (FP8 FProp/DGrad/WGrad in training and the identical FP8 forward in rollout)."""

    fmt: str = "e4m3"
    """FP8 format of activations, weights and gradients. Only E4M3 (max 448): the rollout checkpoint
    format (`fmt: e4m3`) and the paper use it for all three."""

    act_group: int = 128
    """Group size of the 1x128 activation/gradient quantization (and of the 128x1 WGrad groups)."""

    weight_block: tuple[int, int] = (128, 128)
    """Weight tile; 128x128 so that DGrad reuses the forward's weight bytes, and the block the
    rollout checkpoint declares in `weight_block_size`."""

    scale_mode: str = "fp32"
    """`fp32`: s = amax / 448. `ue8m0`: s rounded up to a power of two (InfiR2; what DeepGEMM's UE8M0
    path and Blackwell MXFP8 want)."""

    eps: float = EPS
    """Floor of a group's amax before the scale is taken (vLLM uses 1e-10). Changing it breaks bit
    identity with a vLLM rollout, which always uses 1e-10."""

    check_finite: str = "step"
    """NaN/Inf input to the quantizer (`megatron_jetrl.fp8.finite`): `step` records it on the device and
    `train_step` refuses the step naming the layer and tensor (no host sync per quantization); `sync`
    raises at the quantization itself, naming the element (one host sync each: debugging); `off` lets
    NaN propagate as NaN (never as a silent 448)."""

    backend: str = "auto"
    """FP8 GEMM backend: `auto`, a per-call dispatch policy (deepgemm > cublaslt > triton > emulated: the first the device
    has for the GEMM's shape, `megatron_jetrl.fp8.gemm.available_backends`; `rl.resolve` pins it to `emulated` only in a
    batch-invariant FP8 run), or one of those by name."""

    gemm_sms: int = 0
    """SMs DeepGEMM's persistent GEMM kernels may use in this process (the colocated vLLM engine's too): 0, all of the
    device's. A communication kernel that runs beside a GEMM (under TP the input gradient's all-reduce during WGrad,
    `fp8_linear`'s `dgrad_group`) holds SMs that the GEMM's one-CTA-per-SM grid then waits for; fewer leave them
    free. A tile's products and their order do not depend on it: the bytes are the same. DeepGEMM only (`backend`
    auto or deepgemm)."""

    exact_logprobs: bool = False
    """vLLM rollouts (GPU): the actor's forward runs the rollout engine's own kernels wherever they are not already the
    same -- FlashAttention 3 with one KV split, DeepGEMM's BF16 GEMM for the lm_head (in vLLM too, through the
    trainer's glue), vLLM's log-softmax kernel, and in mode `bf16` vLLM's batch-invariant GEMM for every other linear
    -- and vLLM's attention runs with one KV split and no cascade. With the trainer's RMSNorm and RoPE in vLLM
    (`rollout.glue`) and the FP8 linears both sides already share (DeepGEMM, one quantizer), every sampled token's
    logprob is then the actor's bit for bit: mismatch exactly 0 and TIS weights exactly 1
    (`megatron_jetrl/actor/rollout_kernels.py`). An FP8 rollout pins the attention alone
    (patches/vllm_0_26_0_one_split_attention.py); a BF16 rollout, whose linears vLLM makes batch-invariant only in its
    process-wide batch-invariant mode, runs in that mode (`VLLM_BATCH_INVARIANT=1`). Backward takes flash attention's
    gradient from FA3's output; only the forward must match. Not for `bf16-train-fp8-rollout`, whose two forwards
    differ by design. Above TP 2 both sides also add the TP ranks' partial outputs of every row-parallel linear in rank
    order (`models.ordered_reduce`; patches/vllm_0_26_0_ordered_all_reduce.py in vLLM), where NCCL and vLLM's own
    all-reduces would each add in an order of their own. A run config's default is `auto`, resolved when it loads
    (`rl.resolve`, by `JetRLConfig.exact_logprobs_holds`): on in mode jetrl with vLLM at TP 1 and 2 wherever it can
    hold (its cost in the step: BENCHMARKS.md), else off; above TP 2 only `true` turns it on, until the ordered
    all-reduce's cost is measured."""

    kv_cache: str = "bf16"
    """The rollout engine's KV cache: `bf16`, or `fp8` (E4M3, one scale per layer for each of K and V; vLLM's FA3 then
    quantizes Q too and runs its FP8 attention). The trainer and the engine read this one field: under
    `exact_logprobs` the actor's attention quantizes Q, K and V to the engine's bytes with the same scales and calls the
    same FP8 kernel (`actor.rollout_kernels`); its backward is a BF16 attention gradient on the dequantized inputs,
    passed straight through the quantizers. vLLM engines on Hopper only."""

    kv_scales: str = "auto"
    """Who decides the FP8 KV cache's Q/K/V scales, and how (s = amax / 448 per layer and tensor, all ranks agreeing):
    `amax` the trainer, from the amax its attention saw in the previous step's passes; `running_max` the trainer, from
    the largest amax of any step so far; `fixed` the trainer, once, after the first step; `engine` vLLM, from its own
    first forward (`calculate_kv_scales`), which the actor cannot know: never under `exact_logprobs`. The trainer's
    scales are shipped with the weights at every sync; the first step runs at 1.0 (vLLM's default for a checkpoint
    without scales). `none` with a BF16 cache. A run config's `auto` resolves (`rl.resolve`) to `running_max` with
    `exact_logprobs`, else `engine` (`none` with a BF16 cache)."""

    gemms: tuple[str, ...] = field(init=False)
    """Derived: the training GEMMs that run in FP8."""

    def __post_init__(self):
        weight_block = tuple(self.weight_block)
        object.__setattr__(self, "weight_block", weight_block)
        problems = []
        if self.mode not in MODES:
            problems.append(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.fmt != "e4m3":
            problems.append(
                f"fmt {self.fmt!r} is not supported: the rollout format is E4M3 for weights and activations; use fmt='e4m3'"
            )
        if self.act_group != 128:
            problems.append(
                f"act_group must be 128 (1x128 groups align with the 128x128 weight blocks DGrad reuses), got {self.act_group}"
            )
        if weight_block != (128, 128):
            problems.append(f"weight_block must be (128, 128) (vLLM's and DeepGEMM's block), got {weight_block}")
        if self.scale_mode not in SCALE_MODES:
            problems.append(f"scale_mode must be one of {SCALE_MODES}, got {self.scale_mode!r}")
        elif self.mode == "bf16" and self.scale_mode != "fp32":
            problems.append(
                "scale_mode='ue8m0' has no effect in mode='bf16' (nothing is quantized): pick an FP8 mode or leave scale_mode='fp32'"
            )
        if not (isinstance(self.eps, float) and math.isfinite(self.eps) and 0 < self.eps < 1e-3):
            problems.append(f"eps must be a small positive float (vLLM uses 1e-10), got {self.eps!r}")
        if self.check_finite not in CHECK_MODES:
            hint = " (booleans are gone: true is now 'sync', false 'off')" if isinstance(self.check_finite, bool) else ""
            problems.append(f"check_finite must be one of {CHECK_MODES}, got {self.check_finite!r}{hint}")
        if self.backend not in GEMM_BACKENDS:
            problems.append(f"backend must be one of {GEMM_BACKENDS}, got {self.backend!r}")
        if isinstance(self.gemm_sms, bool) or not isinstance(self.gemm_sms, int) or self.gemm_sms < 0:
            problems.append(f"gemm_sms must be a whole number of SMs, 0 for all of the device's, got {self.gemm_sms!r}")
        elif self.gemm_sms and self.backend not in ("auto", "deepgemm"):
            problems.append(
                f"gemm_sms={self.gemm_sms} limits DeepGEMM's kernels, but backend={self.backend!r} never runs them: "
                "use backend auto or deepgemm, or leave gemm_sms at 0"
            )
        if not isinstance(self.exact_logprobs, bool):
            problems.append(
                f"exact_logprobs must be true or false (a run config also takes auto, its default), got {self.exact_logprobs!r}"
            )
        elif self.exact_logprobs and self.mode == "bf16-train-fp8-rollout":
            problems.append(
                "exact_logprobs cannot hold in mode 'bf16-train-fp8-rollout': it trains in BF16 and samples in "
                "FP8, two forwards by design; use mode 'jetrl' (or 'bf16') with exact_logprobs"
            )
        problems += self._kv_problems()
        if problems:
            raise ValueError("invalid PrecisionFlow: " + "; ".join(problems))
        object.__setattr__(self, "gemms", GEMMS if self.mode == "jetrl" else ())

    def _kv_problems(self) -> list[str]:
        if self.kv_cache not in KV_CACHES:
            return [f"kv_cache must be one of {KV_CACHES}, got {self.kv_cache!r}"]
        if self.kv_scales not in KV_SCALES:
            return [f"kv_scales must be one of {KV_SCALES}, got {self.kv_scales!r}"]
        if self.kv_cache == "bf16" and self.kv_scales not in ("auto", "none"):
            return [
                f"kv_scales={self.kv_scales!r} scales an FP8 KV cache, but kv_cache='bf16': set kv_cache='fp8' or kv_scales='none'"
            ]
        if self.kv_cache == "fp8" and self.kv_scales == "none":
            return ["kv_cache='fp8' needs scales: kv_scales auto, amax, running_max, fixed or engine, not 'none'"]
        if self.kv_cache == "fp8" and self.exact_logprobs is True and self.kv_scales == "engine":
            return [
                "kv_scales='engine' lets vLLM compute its own K/V scales from its first forward, which the actor cannot "
                "know, so exact_logprobs cannot hold: use kv_scales running_max, amax or fixed (the trainer's)"
            ]
        return []

    @property
    def trainer_kv_scales(self) -> bool:
        """Whether the trainer decides the FP8 KV cache's scales and ships them at every sync (`kv_scales`; it reads the
        amax in its exact-logprob attention: a run refuses a trainer policy without `exact_logprobs`, `rl.resolve`)."""
        if self.kv_cache != "fp8":
            return False
        return self.kv_scales in TRAINER_KV_SCALES or (self.kv_scales == "auto" and self.exact_logprobs is True)

    @property
    def kv_scale_policy(self) -> str:
        """`kv_scales` with `auto` resolved by this flow's `exact_logprobs` (see the field)."""
        if self.kv_cache != "fp8":
            return "none"
        if self.kv_scales != "auto":
            return self.kv_scales
        return "running_max" if self.exact_logprobs is True else "engine"

    @property
    def train_fp8(self) -> bool:
        """Whether the trainer's linears run FP8 GEMMs."""
        return bool(self.gemms)

    @property
    def rollout_fp8(self) -> bool:
        """Whether the rollout engine runs FP8 linears (on FP8 weights shipped by the trainer)."""
        return self.mode != "bf16"

    @property
    def same_forward(self) -> bool:
        """Whether rollout's forward is a subgraph of training's (the Jet-RL property)."""
        return self.train_fp8 == self.rollout_fp8

    def quantization_config(self) -> dict | None:
        """`quantization_config` of the rollout checkpoint's config.json (None: a plain BF16 checkpoint)."""
        if not self.rollout_fp8:
            return None
        config = {
            "quant_method": "fp8",
            "fmt": self.fmt,
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.weight_block),
        }
        if self.scale_mode == "ue8m0":
            config["scale_fmt"] = "ue8m0"
        return config

    def vllm_env(self) -> dict[str, str]:
        """Environment for a vLLM engine so it runs this flow's forward and re-quantizes nothing.

        vLLM's `is_deep_gemm_e8m0_used()` turns on UE8M0 activation scales and re-quantizes 128x128
        weight scales to UE8M0 at load on Hopper when DeepGEMM is used with E8M0; with FP32 scales that
        would change the weight bytes and the activation scales, so it is switched off. With `ue8m0`
        scales the re-quantization is the identity (already powers of two) and DeepGEMM may use them.
        `exact_logprobs` pins the model runner whose logprob kernel the actor calls (`actor.logprobs.exact_logprobs`) and, with
        a BF16 rollout, turns on vLLM's batch-invariant mode (the field's docstring says why only there).
        """
        env = {"VLLM_USE_V2_MODEL_RUNNER": "1"} if self.exact_logprobs else {}
        if self.exact_logprobs and not self.rollout_fp8:
            env["VLLM_BATCH_INVARIANT"] = "1"
        if self.rollout_fp8:
            env["VLLM_USE_DEEP_GEMM_E8M0"] = "1" if self.scale_mode == "ue8m0" else "0"
        return env

    def te_env(self) -> dict[str, str]:
        """Environment Transformer Engine reads once at import for its default block-scaling QParams."""
        return {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1" if self.scale_mode == "fp32" else "0"}

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    @classmethod
    def from_dict(cls, data: dict) -> PrecisionFlow:
        known = {f.name for f in fields(cls) if f.init}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown PrecisionFlow keys {sorted(unknown)}; known keys: {sorted(known)}")
        return cls(**data)
