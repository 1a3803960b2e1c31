"""The GRPO config's types: `JetRLConfig`, one run, which checks how its sections fit together (batch sizes that
divide, FP8 blocks whole at the requested TP, what exact logprobs and TE need, ...) and says what valid settings cost
(`notices`); the sections and `ConfigError` are defined in `rl/config_sections.py` and re-exported here. `rl/config.py`
fills them from YAML and overrides and re-exports the classes; `rl/preflight.py` and `rl/run_state.py` read them from
here, so that the config CLI (rl/config.py) can call the preflight without an import circle.

A key that may say `auto` holds it only in a raw config: `rl/resolve.py` turns every `auto` into its value when the
config loads. Docstrings and notices state rules; the measurements behind them are in BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_jetrl.actor.optim_config import OptimConfig
from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.grpo.loss import PolicyLossConfig
from megatron_jetrl.models.arch import ModelArch
from megatron_jetrl.rl.config_sections import (  # noqa: F401
    PROFILED_PHASES,
    ConfigError,
    DataConfig,
    GRPOConfig,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
    RunConfig,
    WarmupConfig,
    _check,
)


@dataclass(frozen=True)
class JetRLConfig:
    """One GRPO run."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=lambda: ModelConfig(hf_config={"model_type": "qwen2"}))
    precision: PrecisionFlow = field(default_factory=PrecisionFlow)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)

    def __post_init__(self):
        sequences = self.grpo.prompts_per_step * self.rollout.n
        per_rank = self.parallel.dp * self.grpo.micro_batch_size * self.grpo.updates_per_step
        _check(
            sequences % per_rank == 0,
            f"grpo.prompts_per_step * rollout.n = {sequences} sequences do not split into parallel.dp={self.parallel.dp} "
            f"x grpo.updates_per_step={self.grpo.updates_per_step} x grpo.micro_batch_size={self.grpo.micro_batch_size}: "
            f"pick sizes whose product divides {sequences}",
        )
        rows = sequences // self.parallel.dp
        _check(
            rows % self.grpo.logprob_batch == 0,
            f"grpo.logprob_micro_batch_size={self.grpo.logprob_batch} does not divide the {rows} sequences each "
            f"data-parallel rank scores (grpo.prompts_per_step * rollout.n / parallel.dp): pick a divisor of {rows}",
        )
        _check(
            self.warmup.steps == 0 or self.warmup.batch_size % self.parallel.dp == 0,
            f"warmup.batch_size={self.warmup.batch_size} must be a multiple of parallel.dp={self.parallel.dp}",
        )
        fp8 = self.precision.mode != "bf16"
        _check(
            not (self.model.batch_invariant is True and fp8 and self.precision.backend not in ("auto", "emulated")),
            f"model.batch_invariant=true needs the emulated FP8 GEMM (exact block products), got precision.backend="
            f"{self.precision.backend!r}: set precision.backend=emulated or model.batch_invariant=false",
        )
        _check(
            self.rollout.engine != "vllm" or self.parallel.world_size % self.rollout.tp == 0,
            f"rollout.tp={self.rollout.tp} must divide the number of ranks parallel.tp * pp * dp = {self.parallel.world_size} "
            "(each rank runs one TP rank of one vLLM engine)",
        )
        _check(
            self.rollout.engine != "vllm" or self.run.device != "cpu",
            "rollout.engine=vllm needs a GPU run, not run.device=cpu (use rollout.engine=native on CPU)",
        )
        if self.model.spec == "te":
            _check(
                self.rollout.glue != "trainer",
                "rollout.glue=trainer runs the local spec's RMSNorm and RoPE inside vLLM, but model.spec=te trains with "
                "Transformer Engine's: use rollout.glue=auto (vLLM's, with this spec) or vllm",
            )
            _check(
                not self.precision.train_fp8 or self.grpo.micro_batch_size % 8 == 0 and self.grpo.logprob_batch % 8 == 0,
                f"model.spec=te in mode jetrl runs TE's FP8 GEMMs, which need the tokens of a micro-batch (micro-batch x "
                f"sequence length, any length) to be a multiple of 8: set grpo.micro_batch_size and "
                f"grpo.logprob_micro_batch_size to multiples of 8 (got {self.grpo.micro_batch_size} and {self.grpo.logprob_batch})",
            )
            _check(
                not self.precision.train_fp8 or self.warmup.steps == 0 or (self.warmup.batch_size // self.parallel.dp) % 8 == 0,
                f"model.spec=te in mode jetrl: the warm-up's micro-batches (warmup.batch_size / parallel.dp = "
                f"{self.warmup.batch_size // self.parallel.dp} sequences per rank) must be a multiple of 8 sequences for TE's "
                "FP8 GEMMs: set warmup.batch_size accordingly",
            )
            _check(
                self.run.device != "cpu",
                "model.spec=te needs a GPU run (Transformer Engine has no CPU kernels), not "
                "run.device=cpu: set run.device=cuda (or auto) or model.spec=local",
            )
            _check(
                not self.precision.gemm_sms,
                f"precision.gemm_sms={self.precision.gemm_sms} limits DeepGEMM's kernels, but model.spec=te trains with "
                "Transformer Engine's GEMMs: leave precision.gemm_sms at 0 or use model.spec=local",
            )
            _check(
                self.precision.eps == PrecisionFlow().eps,
                f"model.spec=te quantizes with vLLM's amax floor eps={PrecisionFlow().eps} (megatron resolves the TE "
                f"quantizer factory by import path, one per scale mode); got precision.eps={self.precision.eps}: leave "
                "precision.eps at its default or use model.spec=local",
            )
        _check(
            not self.run.eval_every or self.data.heldout > 0,
            f"run.eval_every={self.run.eval_every} scores the policy on held-out problems, but data.heldout=0 holds none "
            "out: set data.heldout (e.g. 128) or run.eval_every=0",
        )
        if self.model.bf16_linear_weights == "release":
            problem = self._bf16_release_problem()
            _check(problem is None, f"{problem}: set it to auto or keep")
        _check(
            self.parallel.sp_overlap == "none" or (self.precision.train_fp8 and self.model.spec == "local"),
            f"parallel.sp_overlap={self.parallel.sp_overlap} overlaps the local spec's FP8 gathers and reduce-scatters; "
            f"precision.mode={self.precision.mode} with model.spec={self.model.spec} runs megatron's BF16 ones: set "
            "parallel.sp_overlap=none",
        )
        if self.model.cuda_graphs in ("logprobs", "all"):
            problem = self.layer_graphs_problem()
            _check(problem is None, f"model.cuda_graphs={self.model.cuda_graphs}: {problem}: set it to none")
        if self.precision.exact_logprobs:
            self._check_exact_logprobs()
        if self.precision.kv_cache == "fp8":
            _check(
                self.rollout.engine == "vllm",
                f"precision.kv_cache=fp8 is vLLM's FP8 KV cache (FlashAttention 3 on Hopper); the {self.rollout.engine} "
                "engine keeps a BF16 cache: set rollout.engine=vllm or precision.kv_cache=bf16",
            )
        if self.model.hf_config:
            arch = self.arch()  # architecture problems surface here, before anything is built
            self.rollout.check_positions(arch.max_position_embeddings)
            try:
                if self.parallel.pp_last_layers != "auto":  # (resolved before anything reads the split)
                    self.parallel.stage_layers(arch.num_layers)
            except ValueError as e:
                raise ConfigError(str(e)) from None

    def resolved_autos(self) -> frozenset[str]:
        """The keys `rl.resolve.resolve` turned from `auto` into their value in this config (empty for a config built
        otherwise, or copied with dataclasses.replace)."""
        return self.__dict__.get("_resolved_autos", frozenset())

    def bf16_linears_released(self) -> bool:
        """Whether the FP8 linears' BF16 weights are freed through a train step: `model.bf16_linear_weights`, whose
        `auto` (`rl.resolve`) releases wherever `release` is allowed."""
        if self.model.bf16_linear_weights != "auto":
            return self.model.bf16_linear_weights == "release"
        return self._bf16_release_problem() is None

    def layer_graphs_problem(self) -> str | None:
        """Why the actor's layers cannot replay CUDA graphs here (`model.cuda_graphs`), or None."""
        if self.run.device == "cpu":
            return "CUDA graphs need a GPU run, not run.device=cpu"
        if self.model.spec != "local":
            return f"it graphs the local spec's layers, not model.spec={self.model.spec}'s"
        if self.model.batch_invariant is True:
            return "the batch-invariant reference path (model.batch_invariant=true) runs eagerly"
        if self.precision.check_finite == "sync":
            return "precision.check_finite=sync reads every quantization's scales on the host, which a graph cannot"
        return None

    def _bf16_release_problem(self) -> str | None:
        """Why the FP8 linears' BF16 weights cannot be freed through a train step here, or None."""
        if not (self.precision.train_fp8 and self.model.spec == "local"):
            return (
                f"model.bf16_linear_weights=release frees the BF16 weights of the local spec's FP8 linears; mode "
                f"{self.precision.mode!r} with model.spec={self.model.spec} trains none"
            )
        if not self.optim.bf16 or self.optim.distributed:
            return (
                "model.bf16_linear_weights=release needs megatron's mixed-precision optimizer (optim.bf16=true, "
                "optim.distributed=false): the distributed optimizer keeps the parameters in one buffer, and FP32 "
                "weights are the optimizer's own"
            )
        return None

    def exact_logprobs_holds(self) -> bool:
        """Where `precision.exact_logprobs: auto` (a run config's default, `rl.resolve`) turns it on: mode jetrl with
        vLLM at TP 1 or 2, with or without pipeline stages (under PP every layer runs the same kernels on the same rows
        and the stages pass BF16 activations unchanged; above TP 2 both sides sum the row-parallel outputs in rank
        order, an all-gather in place of an all-reduce whose cost is not measured yet: `true` turns it on there),
        wherever every requirement of `_check_exact_logprobs` holds. Mode bf16 keeps it off:
        it would put vLLM in its process-wide batch-invariant mode (`precision.exact_logprobs=true` asks for that)."""
        if self.precision.mode != "jetrl" or self.rollout.engine != "vllm" or self.parallel.tp > 2:
            return False
        try:
            self._check_exact_logprobs()
        except ConfigError:
            return False
        return True

    def _check_exact_logprobs(self) -> None:
        """`precision.exact_logprobs` holds only where both sides can run the same kernels (its docstring)."""
        fix = "set precision.exact_logprobs=false"
        _check(
            self.rollout.engine == "vllm",
            f"precision.exact_logprobs pairs the actor with vLLM's kernels and needs rollout.engine=vllm, got "
            f"{self.rollout.engine!r} ({fix}; the native engine is exact with model.batch_invariant=true)",
        )
        _check(
            self.model.spec == "local",
            f"precision.exact_logprobs needs model.spec=local (Transformer Engine's layers "
            f"run TE's attention and norms, not vLLM's), got {self.model.spec!r}: {fix}",
        )
        _check(
            self.model.batch_invariant is not True,
            "precision.exact_logprobs runs vLLM's kernels in the actor and "
            "model.batch_invariant=true the native engine's: set model.batch_invariant=false",
        )
        _check(
            self.rollout.glue != "vllm",
            "precision.exact_logprobs needs the trainer's RMSNorm and RoPE inside vLLM "
            "(vLLM's own round differently): set rollout.glue=auto or trainer",
        )
        scaled = (self.model.hf_config or {}).get("rope_scaling")
        _check(
            not scaled,
            f"precision.exact_logprobs: this model's scaled RoPE ({scaled}) runs vLLM's own RoPE class, "
            f"which the trainer's glue does not replace: {fix}",
        )
        _check(
            not (self.precision.kv_cache == "fp8" and self.precision.kv_scales == "engine"),
            "precision.exact_logprobs with precision.kv_scales=engine: vLLM would compute its own K/V scales from its "
            f"first forward, which the actor cannot know: use kv_scales auto, running_max, amax or fixed, or {fix}",
        )
        _check(
            self.rollout.tp == self.parallel.tp,
            f"precision.exact_logprobs needs rollout.tp == parallel.tp (an engine split otherwise adds the row-parallel "
            f"partial sums in another order): got rollout.tp={self.rollout.tp}, parallel.tp={self.parallel.tp}",
        )
        _check(
            not self.parallel.sequence_parallel,
            "precision.exact_logprobs with parallel.sequence_parallel: the actor's reduce-scattered row-parallel "
            f"outputs have not been checked against vLLM's all-reduced ones on GPUs: {fix}, or parallel.sequence_parallel=false",
        )

    def arch(self) -> ModelArch:
        """The model architecture, with the FP8 block alignment at this TP checked."""
        try:
            arch = ModelArch.from_hf_config(self.model.architecture())
        except KeyError as e:
            raise ConfigError(f"model.hf_config lacks {e.args[0]!r} (an HF config.json field)") from None
        except (ValueError, TypeError, ZeroDivisionError) as e:
            raise ConfigError(f"model.hf_config is not a usable architecture: {e}") from None
        if self.precision.train_fp8 or self.precision.rollout_fp8:
            try:
                arch.check_fp8_tp(self.parallel.tp)
            except ValueError as e:
                raise ConfigError(f"parallel.tp={self.parallel.tp}: {e}") from None
        elif arch.num_kv_heads % self.parallel.tp:
            raise ConfigError(f"parallel.tp={self.parallel.tp} does not divide num_key_value_heads={arch.num_kv_heads}")
        if self.rollout.engine == "vllm" and self.precision.rollout_fp8 and self.rollout.tp != self.parallel.tp:
            try:  # the engines load the same FP8 blocks split rollout.tp ways (the converter's --rollout-tp check)
                arch.check_fp8_tp(self.rollout.tp)
            except ValueError as e:
                raise ConfigError(f"rollout.tp={self.rollout.tp}: {e}") from None
        return arch

    def notices(self) -> list[str]:
        """Valid settings a user should know cost something (the trainer prints them at start, rank 0): each says the
        rule and the fix; what was measured is in BENCHMARKS.md."""
        out = []
        if self.rollout.engine == "vllm" and self.precision.train_fp8 and self.rollout.tp != self.parallel.tp:
            out.append(
                f"rollout.tp={self.rollout.tp} differs from parallel.tp={self.parallel.tp}: the engines add the row-parallel "
                "linears' partial outputs in another order than the trainer, and FP8 re-quantization amplifies it "
                "into a mismatch several times that of engines split as the trainer (BENCHMARKS.md); "
                f"set rollout.tp={self.parallel.tp} for the lowest mismatch"
            )
        hidden = (self.model.hf_config or {}).get("hidden_size")
        if self.rollout.engine == "vllm" and self.precision.rollout_fp8 and hidden and hidden < SMALL_FP8_HIDDEN:
            out.append(
                f"hidden_size={hidden}: at this width the FP8 GEMMs are too small to pay for their quantization, and "
                f"vLLM's FP8 decode adds host work per step: below hidden_size {SMALL_FP8_HIDDEN} a GRPO step with vLLM "
                "is usually slower in FP8 than in bf16, while the same flow with the native engine is usually faster "
                "(BENCHMARKS.md; rollout.engine=native: one engine on rank 0)"
                + (", which fits a one-rank run" if self.parallel.world_size == 1 else "")
            )
        if self.precision.train_fp8 and hidden and self.parallel.tp > 1 and hidden // self.parallel.tp <= THIN_FP8_SHARD:
            out.append(
                f"parallel.tp={self.parallel.tp} leaves each rank {hidden // self.parallel.tp} of hidden_size={hidden}: its FP8 GEMMs "
                f"are too small to beat BF16's once quantized, and the step waits on the TP all-reduces: at {THIN_FP8_SHARD} "
                "columns a rank or fewer the FP8 step is usually slower than bf16's, and fewer TP ranks are faster in both "
                "modes (Qwen3-8B on 4 GPUs: TP 1 x PP 4 against TP 4, BENCHMARKS.md): where the model fits, use fewer "
                "TP ranks and more pipeline stages"
            )
        if (
            "precision.exact_logprobs" in self.resolved_autos()
            and not self.precision.exact_logprobs
            and self.precision.mode == "jetrl"
            and self.rollout.engine == "vllm"
            and self.parallel.tp > 2
        ):
            out.append(
                f"precision.exact_logprobs resolved to false at parallel.tp={self.parallel.tp}: above TP 2 it adds every "
                "row-parallel linear's partial outputs in rank order on both sides (collectives and a sum in place of "
                "each all-reduce, whose cost in a step is not measured yet), so auto leaves it off; precision.exact_logprobs=true "
                "turns it on (train/rollout mismatch exactly 0)"
            )
        left_to_auto = self.model.bf16_linear_weights == "auto" or "model.bf16_linear_weights" in self.resolved_autos()
        if (
            left_to_auto
            and self.optim.distributed
            and self.parallel.dp == 1
            and self.model.hf_config
            and self.precision.train_fp8
            and self.model.spec == "local"
            and self.optim.bf16
        ):  # only the optimizer keeps them
            arch = self.arch()
            gib = arch.linear_params * max(self.parallel.stage_layers(arch.num_layers)) * 2 / self.parallel.tp / 2**30
            out.append(
                f"optim.distributed=true at parallel.dp=1 shards nothing, and its parameter buffers keep the FP8 "
                f"linears' BF16 weights through every train step; optim.distributed=false frees them ({gib:.1f} GiB "
                "a GPU here, model.bf16_linear_weights)"
            )
        if self.parallel.pp > 1 and not self.parallel.pp_last_layers and self.model.hf_config:
            last = balanced_last_layers(self.arch(), self.parallel.pp, self.precision.train_fp8, self.rollout.max_new_tokens)
            if last:
                out.append(
                    f"parallel.pp={self.parallel.pp} splits the layers evenly, but the last stage also runs the output layer "
                    "and the logprobs, about as much work as several layers (BENCHMARKS.md); "
                    f"parallel.pp_last_layers={last} (what auto gives here) evens the stages"
                )
        return out

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            out[f.name] = {g.name: _plain(getattr(section, g.name)) for g in dataclasses.fields(section) if g.init}
        return out


SMALL_FP8_HIDDEN = 4096
"""Below this hidden size a GRPO step with vLLM rollouts is usually slower in FP8 than in BF16 (`JetRLConfig.notices`;
BENCHMARKS.md)."""
THIN_FP8_SHARD = 1024
"""At or below this many hidden columns per TP rank the FP8 actor is usually slower than BF16's (`JetRLConfig.notices`;
BENCHMARKS.md)."""


FP8_LINEAR_SPEEDUP = 1.4
"""How much faster a decoder layer's linears run in FP8 than in BF16, forward and backward (the four Qwen3-8B linears'
measured ratio, rounded down: BENCHMARKS.md, the FP8 linear): `balanced_last_layers`' FP8 layer cost."""
HEAD_OVERHEAD = 1.1
"""The output layer's time (lm_head GEMM and log-softmax, forward and backward) over its GEMM's share of the FLOPs:
its log-softmax passes over the logits. From the stage profiles of an 18-layer Qwen3-8B pipeline in two stages
(BENCHMARKS.md, pipeline parallelism)."""


def balanced_last_layers(arch, pp: int, fp8: bool = False, tokens: int = 0) -> int:
    """The last stage's decoder layers (`parallel.pp_last_layers`, its `auto`) that make the busiest of `pp` stages
    least busy, among the splits megatron takes (the others hold (layers - last) / (pp - 1) each); 0 when that is the
    even split, and at pp 1.

    Costs per token, forward and backward alike, in units of one BF16 linear weight: a decoder layer
    `linear_params / r + heads x head_dim x tokens` (its GEMMs, `r` = `FP8_LINEAR_SPEEDUP` where it trains in FP8 (`fp8`),
    and causal attention over sequences of `tokens`, the responses' length); the output layer `vocab x hidden x
    HEAD_OVERHEAD` (BF16 in every mode). The last stage costs its layers plus the output layer, counted in layers."""
    from megatron_jetrl.models.mapping import stage_layers

    if pp == 1:
        return 0
    layer = arch.linear_params / (FP8_LINEAR_SPEEDUP if fp8 else 1.0) + arch.num_heads * arch.head_dim * tokens
    head = arch.vocab_size * arch.hidden_size * HEAD_OVERHEAD / layer

    def busiest(last: int) -> float:
        try:
            split = stage_layers(arch.num_layers, pp, last)
        except ValueError:  # a split megatron refuses (with no split at all, `stage_layers` names the fix later)
            return float("inf")
        return max(max(split[:-1]), split[-1] + head)

    even = arch.num_layers / pp  # ties go to the split nearest the even one, the even split (0) first
    return min(range(arch.num_layers), key=lambda last: (busiest(last), abs((last or even) - even)))


def _plain(value):
    return list(value) if isinstance(value, tuple) else value
