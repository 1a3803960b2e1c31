"""The actor's model provider: a megatron-core GPTModel for a Qwen2/Qwen2.5, Qwen3 or Llama-3 `ModelArch`.

`build_model(arch, flow)` validates first (FP8 block alignment for the model x TP, before any weight is
allocated), then builds the GPTModel for this rank's pipeline stage with the layer spec of the flow:
`spec="local"` (megatron's local layer with `fp8_layers`' FP8 linears in mode `jetrl`, plain linears
otherwise; runs on CPU and on GPUs without TE; `"native"` is accepted as its old name) or `spec="te"` (megatron's
TE layer spec with the flow's recipe, `te_recipe`; CUDA + Transformer Engine). Parallel sizes come from megatron's
parallel state (`actor.parallel.init_parallel`). `copy_weights` moves weights between the two specs' namings.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from megatron_jetrl.actor.gpt import LLAMA3_ROPE_DEFAULTS, rope_kwargs, stage_entries, unwrap  # noqa: F401 (re-exported: provider API)
from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.fp8.sequence_parallel import NO_OVERLAP, SPOverlap
from megatron_jetrl.models import batch_invariant_ops as ops
from megatron_jetrl.models.arch import ModelArch
from megatron_jetrl.models.mapping import padded_vocab_size, stage_layers


@dataclass(frozen=True)
class ActorOptions:
    """How the actor model is built (everything not fixed by the model's config.json)."""

    spec: str = "local"
    """`local` (megatron local layers + megatron_jetrl FP8 linears; `native` is an alias) or `te` (megatron's
    Transformer Engine layer spec, FP8 through TE with the flow's recipe: `actor.te_recipe`)."""
    params_dtype: torch.dtype = torch.float32
    """Parameter dtype. On CPU keep float32: megatron's bf16 optimizer and DistributedOptimizer need CUDA."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1); the native spec's RMSNorm supports it."""
    sp_overlap: SPOverlap = NO_OVERLAP
    """Local spec, FP8 training under sequence parallelism: how the forward's FP8 gathers and reduce-scatters overlap
    their GEMMs (`fp8.sequence_parallel.SPOverlap`: in pieces, or round the ring); the default: one collective, then
    the GEMM."""
    max_sequence_length: int | None = None
    """RoPE table length; default: the config's max_position_embeddings."""
    fused: bool = True
    """Local spec on CUDA: RMSNorm and RoPE as one Triton kernel per op and direction (`actor.fused`), and BF16
    SwiGLU as megatron's fused one. Any spec: the logprobs read the BF16 logits in three row kernels instead of
    megatron's cross entropy on FP32 copies (`actor.logprobs`; on the CPU eagerly, megatron's bits). False: eager torch ops and megatron's cross entropy (the CPU always runs eagerly). Not
    used with `batch_invariant` (its own kernels); the TE spec keeps TE's layers."""
    batch_invariant: bool = False
    """Native spec only: norms, RoPE + attention, SwiGLU, lm_head and log-softmax from `models.batch_invariant_ops` (the native
    engine's functions). With BF16 params and the emulated FP8 backend the actor's logprobs then equal the
    engine's bit for bit (TP1). A slow reference path: meant for CPU runs and tests."""
    fp8_weight_t: str = "step"
    """FP8 linears of the local spec: DGrad's W^T bytes kept from the first backward to the next optimizer step
    (`step`), or made in each backward and freed (`backward`: less memory, a transpose per micro-batch)."""
    bf16_linear_weights: str = "keep"
    """FP8 linears of the local spec: `release` frees each BF16 weight's storage from a train step's start to its
    optimizer step, which writes it again from the FP32 main param (megatron's mixed-precision optimizer, not the
    distributed one: that keeps the parameters in one buffer), so through forward and backward the linears hold
    their FP8 bytes alone (`fp8_layers.release_bf16_weights`); `keep` holds both."""
    pp_last_layers: int = 0
    """Decoder layers of the last pipeline stage; 0: an even split (`models.mapping.stage_layers`, megatron's
    `num_layers_in_last_pipeline_stage`)."""
    ordered_reduce: bool = False
    """Local spec, TP > 2, no sequence parallelism: every row-parallel linear sums the TP ranks' outputs in rank order
    (`models.ordered_reduce`, `fp8_layers.use_ordered_reduce`), as vLLM does under its ordered all-reduce patch:
    `precision.exact_logprobs` above TP 2."""
    rollout_kernels: bool = False
    """Local spec on CUDA, with a vLLM rollout (`precision.exact_logprobs`): attention, the lm_head (and BF16 linears) and
    the log-softmax run the vLLM engine's kernels (`actor.rollout_kernels`), so the actor's logprobs are the engine's
    bit for bit. Needs vLLM 0.26.0 importable."""
    logprob_graphs: bool = False
    """Local spec on CUDA: the forward-only logprob passes replay each decoder layer as a CUDA graph captured in the
    pass (`actor.layer_graphs`; the eager forward's bytes, one host call per layer)."""
    update_graphs: bool = False
    """Local spec on CUDA: a train step replays each decoder layer's forward and backward as CUDA graphs captured in the
    step, a copy per micro-batch a pipeline stage holds at once (`actor.layer_graphs`; the eager step's bytes and
    gradients)."""

    def __post_init__(self):
        if self.spec == "native":
            object.__setattr__(self, "spec", "local")
        if self.spec not in ("local", "te"):
            raise ValueError(f"spec must be 'local' or 'te', got {self.spec!r}")
        if self.batch_invariant and self.spec != "local":
            raise ValueError("batch_invariant=True needs spec='local' (TE layers run TE's own kernels)")
        if self.fp8_weight_t not in ("step", "backward"):
            raise ValueError(f"fp8_weight_t must be 'step' or 'backward', got {self.fp8_weight_t!r}")
        if self.bf16_linear_weights not in ("keep", "release"):
            raise ValueError(f"bf16_linear_weights must be 'keep' or 'release', got {self.bf16_linear_weights!r}")
        if self.sp_overlap.kind != "none" and (self.spec != "local" or not self.sequence_parallel):
            raise ValueError(
                f"sp_overlap={self.sp_overlap} overlaps the local spec's FP8 sequence-parallel communication: it needs "
                "spec='local' and sequence_parallel=True"
            )
        if self.ordered_reduce and (self.spec != "local" or self.sequence_parallel):
            raise ValueError(
                "ordered_reduce=True needs spec='local' without sequence_parallel (it replaces the row-parallel all-reduce)"
            )
        if (self.logprob_graphs or self.update_graphs) and (self.spec != "local" or self.batch_invariant):
            raise ValueError(
                "logprob_graphs / update_graphs need spec='local' without batch_invariant (they graph the local spec's "
                "layers; the batch-invariant reference path runs eagerly)"
            )
        if self.rollout_kernels and (self.spec != "local" or self.batch_invariant):
            raise ValueError(
                "rollout_kernels=True needs spec='local' without batch_invariant (it replaces the local spec's "
                "attention, lm_head and log-softmax by vLLM's kernels)"
            )


def transformer_config(arch: ModelArch, flow: PrecisionFlow, *, tp: int, pp: int, options: ActorOptions = ActorOptions()):
    """megatron TransformerConfig for the arch; refuses FP8-misaligned TP (names layer, dimension, working TP sizes)."""
    if flow.train_fp8:
        arch.check_fp8_tp(tp)
    elif arch.num_kv_heads % tp:
        raise ValueError(f"TP={tp} does not divide num_key_value_heads={arch.num_kv_heads}")
    stage_layers(arch.num_layers, pp, options.pp_last_layers)  # refuses a split megatron would refuse, naming the fix
    from megatron.core.transformer import TransformerConfig

    te_kwargs = {}
    if options.spec == "te":
        from megatron_jetrl.actor.te_recipe import te_config_kwargs

        te_kwargs = te_config_kwargs(flow)
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=arch.qk_norm,
        gated_linear_unit=True,
        activation_func=ops.silu if options.batch_invariant else F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=_fused_swiglu(options),
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=options.sequence_parallel,
        num_layers_in_last_pipeline_stage=options.pp_last_layers or None,
        # no device-wide sync after each batched pipeline send/recv: megatron keeps it for PyTorch before the fix of
        # batch_isend_irecv's stream recording (pytorch#82450, 2022); waiting on the requests orders the streams, and the
        # sync stopped the host at every micro-batch boundary (upstream removed it for torch>=2.6: Megatron-LM#6919)
        batch_p2p_sync=False,
        params_dtype=options.params_dtype,
        pipeline_dtype=options.params_dtype,
        bf16=options.params_dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        **te_kwargs,
    )


def _fused_swiglu(options: ActorOptions) -> bool:
    """megatron's fused SwiGLU (`bias_swiglu_impl`, compiled by its `jit_fuser`) for the local spec's BF16 MLP on
    CUDA; the FP8 MLP fuses SwiGLU into its quantization instead (`FP8GatedMLP`)."""
    return (
        options.fused
        and options.spec == "local"
        and not options.batch_invariant
        and not options.rollout_kernels
        and torch.cuda.is_available()
    )


def layer_spec(
    arch: ModelArch,
    flow: PrecisionFlow,
    spec: str,
    layers: int,
    batch_invariant: bool = False,
    fused: bool = True,
    rollout_kernels: bool = False,
):
    """The decoder spec: TE's layer spec (megatron builds the stage's layers), or the native block (this stage's `layers`
    layers + RMSNorm final norm), with the vLLM engine's attention and BF16 linears under `rollout_kernels`."""
    if spec == "te":
        from megatron_jetrl.actor.te_recipe import te_layer_spec

        return te_layer_spec(arch.qk_norm)
    from megatron_jetrl.actor.fp8_layers import native_block_spec

    overrides = {}
    if rollout_kernels:
        from megatron_jetrl.actor import rollout_kernels as rk

        overrides = {
            "core": partial(rk.FA3Attention, arch=arch, kv_fp8=flow.kv_cache == "fp8"),
            "bf16_linears": (rk.RolloutColumnParallelLinear, rk.RolloutRowParallelLinear),
        }
    return native_block_spec(flow, arch, layers, batch_invariant, fused, **overrides)


def build_model(arch: ModelArch, flow: PrecisionFlow, options: ActorOptions = ActorOptions()):
    """This rank's GPTModel (pipeline stage from megatron's parallel state). Vocabulary padded per `padded_vocab_size`.
    `options.spec="te"` refuses (install line) before anything is built when Transformer Engine is missing."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if options.spec == "te":
        from megatron_jetrl.fp8.te import require_te

        require_te()
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the TE layer spec needs a CUDA device (Transformer Engine has no CPU kernels): run on a GPU or use spec='local'"
            )
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    config = transformer_config(arch, flow, tp=tp, pp=pp, options=options)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(
            arch,
            flow,
            options.spec,
            stage_layers(arch.num_layers, pp, options.pp_last_layers)[ps.get_pipeline_model_parallel_rank()],
            options.batch_invariant,
            options.fused,
            options.rollout_kernels,
        ),
        vocab_size=padded_vocab_size(arch.vocab_size, tp),
        max_sequence_length=options.max_sequence_length or arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        # the local spec's core attention applies RoPE itself (fp8_layers.SDPAttention / BatchInvariantAttention)
        **({"position_embedding_type": "none"} if options.spec == "local" else rope_kwargs(arch)),
    )
    from megatron_jetrl.actor.embedding import use_main_grad_embedding
    from megatron_jetrl.actor.fp8_layers import name_fp8_layers, use_ordered_reduce
    from megatron_jetrl.actor.output_layer import use_output_layer

    name_fp8_layers(model, options.fp8_weight_t, options.bf16_linear_weights == "release", options.sp_overlap)
    use_main_grad_embedding(model)
    if options.ordered_reduce:
        use_ordered_reduce(model)
    use_output_layer(model, _output_layer_class(options))
    model.actor_options = options  # read by actor.logprobs (which log-softmax)
    if torch.cuda.is_available():  # megatron builds some modules (our RMSNorm) on the CPU; its own setup calls .cuda()
        model.cuda(torch.cuda.current_device())
    return model


def _output_layer_class(options: ActorOptions) -> type:
    """The lm_head's class: the batch-invariant GEMM, the GEMM vLLM runs (exact logprobs), or torch's with
    token-major logits (`actor.output_layer`)."""
    if options.batch_invariant:
        from megatron_jetrl.actor.fp8_layers import BatchInvariantColumnParallelLinear

        return BatchInvariantColumnParallelLinear
    if options.rollout_kernels:
        from megatron_jetrl.actor.rollout_kernels import RolloutOutputLayer

        return RolloutOutputLayer
    from megatron_jetrl.actor.output_layer import TokenMajorOutputLayer

    return TokenMajorOutputLayer


def copy_weights(src, dst, arch: ModelArch, *, src_spec: str, dst_spec: str) -> list[str]:
    """Copy every parameter of this pipeline stage's `src` model into `dst` (same TP x PP layout), names mapped
    through the one mapping table (`models.mapping.model_entries`: both specs hold the same HF tensors); returns the
    destination names. E.g. a TE-spec actor starts from the weights the local spec draws for the same seed."""
    spec_name = {"native": "local"}
    pairs = list(
        zip(
            stage_entries(dst, arch, spec=spec_name.get(src_spec, src_spec)),
            stage_entries(dst, arch, spec=spec_name.get(dst_spec, dst_spec)),
        )
    )
    src_params, dst_params = dict(unwrap(src).named_parameters()), dict(unwrap(dst).named_parameters())
    missing = sorted({d.megatron for _, d in pairs} ^ set(dst_params)) + sorted({s.megatron for s, _ in pairs} ^ set(src_params))
    if missing:
        raise KeyError(f"the models' parameters and the mapping table disagree on {missing} (spec {src_spec!r} -> {dst_spec!r})")
    with torch.no_grad():
        for s_entry, d_entry in pairs:
            dst_params[d_entry.megatron].copy_(src_params[s_entry.megatron])
    return [d.megatron for _, d in pairs]
