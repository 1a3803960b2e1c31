"""The GRPO config's sections: `ConfigError` and one frozen dataclass per section (`run`, `model`, `parallel`, `data`,
`rollout`, `grpo`, `warmup`; `precision`, `loss` and `optim` are `fp8.PrecisionFlow`, `grpo.loss.PolicyLossConfig` and
`actor.optim_config.OptimConfig`), each checking its own values. How the sections fit together is checked by
`JetRLConfig` in `rl/config_schema.py`, which re-exports these names.

A choice among words is typed `Literal[...]`. A key that may say `auto` holds it only in a raw config: `rl/resolve.py`
turns every `auto` into its value when the config loads (its table lists each key and rule), so a loaded config holds
none (`run.resume`, a policy, keeps its `auto`). Docstrings state rules; the measurements behind them are in
BENCHMARKS.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megatron_jetrl.actor.offload import OFFLOAD_CHOICES
from megatron_jetrl.fp8.sequence_parallel import OVERLAPS


class ConfigError(ValueError):
    """A configuration problem, found before the run starts."""


PROFILED_PHASES = ("rollout", "eval", "update", "sync")
"""The GRPO loop's timed phases (`time/<phase>` in metrics.jsonl), which `run.profile_phases` may name."""


@dataclass(frozen=True)
class RunConfig:
    """What the run is called, where it writes, how long it runs and how it survives faults."""

    name: str = "tiny"
    """Run name; also the default output directory `runs/<name>`."""
    out_dir: str = ""
    """Output directory (metrics.jsonl, tb/, checkpoints/, export/, summary.json); empty: `runs/<name>`."""
    seed: int = 1234
    """Seed of everything random: init, data order, sampling (rollout seeds derive from seed and step)."""
    steps: int = 20
    """GRPO steps. 0: the warm-start alone (warmup.steps SFT steps), saved and, with run.export, exported: the one
    policy that several GRPO runs start from (`model.path=<out_dir>/export warmup.steps=0`)."""
    save_every: int = 10
    """Checkpoint every this many steps (and at the end); 0: only at the end."""
    checkpoint: bool = True
    """False: write no checkpoint at all -- for timing runs and sweeps at large shapes, where one checkpoint with
    optimizer state is ~16 bytes per parameter. A stopped run then cannot resume (it starts over), and run.export,
    which converts the final checkpoint, must be false."""
    keep_checkpoints: int = 3
    """Complete checkpoints kept in `checkpoints/`: after each save the oldest beyond this many are deleted (the
    newest complete one is always kept); 0: keep every one."""
    resume: Literal["auto", "never"] = "auto"
    """A policy, kept as given: `auto` continues from the newest complete checkpoint in out_dir if there is one;
    `never` refuses to start when out_dir already holds checkpoints (pick another name or delete them)."""
    export: bool = True
    """Write the final policy as an HF FP8 (or BF16) checkpoint to `<out_dir>/export` (the converter's format)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`cpu`, `cuda`, or `auto`, resolved when the config loads (`rl.resolve`): `cuda` for a config that runs on GPUs
    only (rollout.engine=vllm, model.spec=te), else the loading machine's (CUDA when a GPU is visible, else CPU)."""
    timeout_s: float = 300.0
    """Collective timeout: if a rank dies, the others fail within this many seconds with the lost rank named."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """NaN/Inf in rewards, loss or gradients: `stop` the run, or `skip` the update (the step is logged as skipped)."""
    jit_cache_dir: str = ""
    """Where the GPU kernels compiled on first use are kept (DeepGEMM's as `<dir>/deep_gemm`, Triton's as `<dir>/triton`),
    for the trainer and the vLLM engines alike: compiled once per machine, or once per cluster on shared storage, and
    reused by every later run; `python -m megatron_jetrl.rl.jit_cache CONFIG` fills it ahead of a run (`rl.jit_cache`).
    Empty: DG_JIT_CACHE_DIR if set, else vLLM's ~/.cache/vllm/deep_gemm, and Triton's default."""
    eval_every: int = 0
    """Score the policy on the held-out problems (data.heldout) every this many steps and at the last step: greedy
    answers, `heldout/accuracy` (and per response-length bucket), `heldout/response_length` in the row of the step whose
    rollout that policy samples, timed apart (`time/heldout`, not in time/step); 0: never."""
    profile_step: int = -1
    """Profile this step's phases (`run.profile_phases`) with torch.profiler on every rank: per phase the GPU's busy and
    idle time, the idle time by gap length, the kernels it waited for, kernel time by category (FP8 and BF16 GEMMs,
    quantizers, attention, NCCL, ...) and the host's launches -> `<out_dir>/profile_step<N>_rank<R>.json`, and a table
    from rank 0 (`rl.profiling`). The profiled step runs slower: its metrics row says `profiled: 1` and the sweep
    report leaves it out. -1: no profile."""
    profile_phases: str = "eval,update"
    """The phases `run.profile_step` profiles, comma-separated, of rollout, eval, update and sync."""

    def profiled_phases(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.profile_phases.split(",") if p.strip())

    def __post_init__(self):
        _check(self.steps >= 0, f"run.steps must be >= 0 (0: the warm-start alone), got {self.steps}")
        _check(self.save_every >= 0, f"run.save_every must be >= 0 (0: only at the end), got {self.save_every}")
        _check(
            self.checkpoint or not self.export,
            "run.checkpoint=false writes no checkpoint, but run.export=true "
            "converts the final one: set run.export=false too (or keep run.checkpoint=true)",
        )
        _check(self.eval_every >= 0, f"run.eval_every must be >= 0 (0: no held-out evaluation), got {self.eval_every}")
        _check(
            self.profile_step == -1 or 0 <= self.profile_step < self.steps,
            f"run.profile_step={self.profile_step} is not a step of this run (0 .. run.steps - 1 = {self.steps - 1}); -1: no profile",
        )
        phases = self.profiled_phases()
        _check(
            bool(phases) and set(phases) <= set(PROFILED_PHASES),
            f"run.profile_phases must name one or more of {', '.join(PROFILED_PHASES)} (comma-separated), got {self.profile_phases!r}",
        )
        _check(
            self.keep_checkpoints >= 0,
            f"run.keep_checkpoints must be >= 0 (0: keep every checkpoint), got {self.keep_checkpoints}",
        )
        _check(self.resume in ("auto", "never"), f"run.resume must be 'auto' or 'never', got {self.resume!r}")
        _check(self.device in ("auto", "cpu", "cuda"), f"run.device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        _check(0 < self.timeout_s < 1e7, f"run.timeout_s must be positive, got {self.timeout_s:g} (seconds, below 1e7)")
        _check(0 <= self.seed < 2**63, f"run.seed must be in [0, 2**63), got {self.seed}")
        _check(self.on_nonfinite in ("stop", "skip"), f"run.on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}")
        _check(
            bool(self.name) and "/" not in self.name and self.name not in (".", ".."),
            f"run.name must be a plain directory name (not empty, '.', '..', no '/'), got {self.name!r}",
        )

    @property
    def directory(self) -> Path:
        return Path(self.out_dir or f"runs/{self.name}")

    def device_type(self) -> str:
        """'cuda' or 'cpu': where this machine runs the config, refusing `cuda` on a machine without a visible GPU (a
        loaded config says `cuda` or `cpu`: `rl.resolve`; presets say `cuda` and are checked anywhere, so load_config
        does not refuse it); the launchers' `--get` and the trainer call it before any work. Where `rl.resolve` made
        `auto` cuda for a setting that runs on GPUs only, the refusal names that setting and its fix."""
        import torch

        if self.device == "cuda" and not torch.cuda.is_available():
            needs = self.__dict__.get("_cuda_for")  # set by rl.resolve: "rollout.engine=vllm" or "model.spec=te"
            if needs == "rollout.engine=vllm":
                from megatron_jetrl.rollout.vllm_engine import vllm_problem

                raise ConfigError(vllm_problem("cpu"))
            if needs:
                raise ConfigError(
                    f"{needs} needs a CUDA GPU and no CUDA device is visible on this machine: run on a GPU "
                    "node (check CUDA_VISIBLE_DEVICES and the driver), or use model.spec=local on the CPU"
                )
            raise ConfigError(
                "run.device='cuda' but no CUDA device is visible on this machine: run on a GPU node "
                "(check CUDA_VISIBLE_DEVICES and the driver) or set run.device=cpu"
            )
        return "cuda" if self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available()) else "cpu"


@dataclass(frozen=True)
class ModelConfig:
    """The policy: architecture, initial weights and tokenizer."""

    hf_config: dict = field(default_factory=dict)
    """HF config.json fields of the architecture, inline (the tiny default, and the presets so that their TP
    alignment is checked without the weights). With `path` too, they must agree with its config.json."""
    path: str = ""
    """Local HF model directory (config.json, safetensors, tokenizer): the initial weights. Empty: random init."""
    tokenizer: Literal["sentencepiece", "hf"] = "sentencepiece"
    """`sentencepiece`: the embedded tokenizer, trained on the synthetic corpus at first run (tiny default);
    `hf`: the tokenizer in `path`."""
    batch_invariant: bool | Literal["auto"] | None = "auto"
    """true: the actor and the native engine run `models.batch_invariant_ops`, which makes their logprobs equal bit for
    bit in `jetrl`/`bf16` on the emulated FP8 backend (slow; a reference); false: the fast kernels. `auto` (or null),
    resolved when the config loads (`rl.resolve`): true on the CPU, false on a GPU."""
    fused: bool = True
    """Local spec on CUDA: RMSNorm and RoPE as one Triton kernel per op and direction and megatron's fused
    SwiGLU for BF16 MLPs (`actor.fused`); false: eager torch ops (several kernels each; what megatron runs without
    apex or TE). The CPU always runs eagerly."""
    fp8_weight_t: Literal["step", "backward"] = "step"
    """Local spec, FP8 training: where DGrad's transposed weight bytes W^T live. `step`: made at the first backward
    after each optimizer step and kept until the next (fastest; one more FP8 copy of every weight held through the
    step, rollout included); `backward`: made in each linear's backward and freed after its DGrad (a transpose per
    micro-batch; the actor holds one FP8 weight copy, not two). The bytes are the same."""
    bf16_linear_weights: Literal["auto", "keep", "release"] = "auto"
    """Local spec, FP8 training: whether the BF16 weights of the FP8 linears stay on the device through a train step.
    `release`: each is freed at the step's start, once quantized, and written again by the optimizer step from its
    FP32 main param (the bits it had), so forward and backward hold the FP8 bytes alone: 2 bytes a linear parameter
    with W^T (as BF16 training holds its weight), 1 with `fp8_weight_t=backward`; the run is bit for bit the same.
    Needs megatron's mixed-precision optimizer: `optim.bf16=true` and `optim.distributed=false` (the distributed
    optimizer keeps the parameters in one buffer). `keep`: BF16 and FP8 both. `auto`, resolved when the config loads
    (`rl.resolve`): release where it applies (`JetRLConfig.bf16_linears_released`), else keep."""
    cuda_graphs: Literal["none", "logprobs", "all"] = "none"
    """Which of the actor's decoder-layer calls replay CUDA graphs captured in the call (`actor.layer_graphs`): the
    eager bytes and gradients, one host call per layer and direction instead of its few dozen launches. `logprobs`: the
    forward-only logprob passes (the old and the reference logprobs); `all`: those and the update's forwards and
    backwards (a pipeline stage captures a copy for each micro-batch it holds at once); `none`: eager. Local spec on a GPU, not batch-invariant, `precision.check_finite`
    not `sync`. They pay where a layer's GPU work is shorter than the host work that issues it (narrow GEMMs: a TP
    rank's, a small model's; short micro-batches) and cost one capture a call where it is not (the GPU idles while a
    micro-batch is captured); under TP each captured layer holds the TP collectives too."""
    spec: Literal["local", "te"] = "local"
    """The actor's megatron layer spec. `local`: megatron's local layers with this project's FP8 linears (runs anywhere;
    bit-exact with the rollout's quantizer). `te`: megatron's Transformer Engine spec (TE fused norm+linear, TE
    attention), FP8 through TE's own kernels with the recipe the precision flow derives (`actor.te_recipe`): CUDA and
    TE 2.20.2 needed; in `jetrl` with `scale_mode: fp32` a small fraction of activation elements differ by one E4M3 step
    from the rollout's (weights are shipped as TE trained them), with `ue8m0` the bytes agree (`fp8/te.py`);
    `precision.backend` then applies to the native rollout engine only. Checkpoints
    of the two specs name the norms differently: resume with the spec you trained with."""

    def __post_init__(self):
        _check(
            bool(self.hf_config) or bool(self.path),
            "model: give model.hf_config (an inline architecture: random init) and/or model.path (a local HF directory)",
        )
        _check(
            self.tokenizer in ("sentencepiece", "hf"), f"model.tokenizer must be 'sentencepiece' or 'hf', got {self.tokenizer!r}"
        )
        _check(
            self.tokenizer != "hf" or bool(self.path),
            "model.tokenizer='hf' needs model.path (the directory that holds the tokenizer)",
        )
        _check(self.spec in ("local", "te"), f"model.spec must be 'local' or 'te', got {self.spec!r}")
        _check(
            self.fp8_weight_t in ("step", "backward"),
            f"model.fp8_weight_t must be 'step' or 'backward', got {self.fp8_weight_t!r}",
        )
        _check(
            self.batch_invariant in (True, False, "auto", None),
            f"model.batch_invariant must be true, false or auto, got {self.batch_invariant!r}",
        )
        _check(
            self.cuda_graphs in ("none", "logprobs", "all"),
            f"model.cuda_graphs must be 'none', 'logprobs' or 'all', got {self.cuda_graphs!r}",
        )
        _check(
            self.bf16_linear_weights in ("auto", "keep", "release"),
            f"model.bf16_linear_weights must be 'auto', 'keep' or 'release', got {self.bf16_linear_weights!r}",
        )
        if self.spec == "te":
            from megatron_jetrl.fp8.te import INSTALL_HINT, te_installed

            _check(te_installed(), f"model.spec=te: {INSTALL_HINT}")
            _check(
                self.batch_invariant is not True,
                "model.spec=te runs Transformer Engine's own norm, attention and GEMM "
                "kernels, not models.batch_invariant_ops: set model.batch_invariant=false "
                "(or auto), or model.spec=local",
            )

    def architecture(self) -> dict:
        """The HF config dict: inline, else `path`'s config.json."""
        return dict(self.hf_config) if self.hf_config else self.path_config()

    def path_config(self) -> dict:
        config = Path(self.path) / "config.json"
        if not config.is_file():
            raise ConfigError(f"model.path={self.path!r} has no config.json: point it at a local HF model directory")
        return json.loads(config.read_text())

    def check_path_matches(self) -> None:
        """With both hf_config and path: every inline field must equal the checkpoint's."""
        if not (self.hf_config and self.path):
            return
        disk = self.path_config()
        odd = {k: (v, disk.get(k)) for k, v in self.hf_config.items() if disk.get(k) != v}
        if odd:
            raise ConfigError(
                f"model.hf_config disagrees with {self.path}/config.json on "
                + ", ".join(f"{k} (config {a!r}, checkpoint {b!r})" for k, (a, b) in sorted(odd.items()))
                + ": fix the preset or the path"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron parallelism of the actor; the run needs tp * pp * dp processes."""

    tp: int = 1
    """Tensor parallel size (every split dimension must stay a multiple of 128 for FP8)."""
    pp: int = 1
    """Pipeline parallel size: each stage holds a contiguous share of the decoder layers (the first also the embedding,
    the last the final norm, output layer and logprobs); every rank's engine holds the whole model."""
    pp_last_layers: int | Literal["auto"] = 0
    """Decoder layers on the last pipeline stage; 0 splits them evenly. The last stage also runs the output layer and
    the logprobs, so fewer layers there even out the stages (megatron's `num_layers_in_last_pipeline_stage`; the other
    stages split the rest evenly). `auto`, resolved when the config loads (`rl.config_schema.balanced_last_layers`): the count
    that leaves the busiest stage least busy, the output layer costed in decoder layers from the model's shapes, the
    response length and whether the layers train in FP8 (FP8 layers are cheaper, so its last stage takes fewer); 0 at
    pp 1. `tools/profile_report.py` shows each stage's work: move layers until it is level."""
    dp: int = 1
    """Data parallel size."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (needs tp > 1): outside the linears (norms, residuals, dropout) each TP rank
    holds 1/tp of the sequence, and the column-parallel linears all-gather it (in FP8 when they train in FP8: each
    rank quantizes its own tokens, the bytes of quantizing the gathered BF16) while the row-parallel ones
    reduce-scatter their outputs. Sequences are lengthened to a multiple of tp (the padding is masked out)."""
    sp_overlap: str = "none"
    """With `sequence_parallel` and FP8 training on the local spec, how each forward FP8 gather (QKV, gate/up) and
    reduce-scatter (o, down) overlaps its GEMM. `none`: one collective, then the GEMM. `chunks`: every rank's rows
    in `sp_chunks` pieces, piece c's GEMM running while the later pieces travel. `ring` (async TP's decomposition):
    tp - 1 point-to-point steps round the TP group, each shard's GEMM running while the next shard (gather) or the
    running sums (reduce-scatter) travel. Gathered outputs are the same bits in all three; a reduce-scattered output
    sums in its collective's order (the ring's: rank by rank). The backward overlaps its collectives with DGrad and
    WGrad in all three."""
    sp_chunks: int = 4
    """Pieces of every rank's rows under `sp_overlap=chunks` (2 or more); another value with another overlap is
    refused."""

    def __post_init__(self):
        for name in ("tp", "pp", "dp"):
            _check(getattr(self, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        _check(
            not self.sequence_parallel or self.tp > 1,
            "parallel.sequence_parallel splits the sequence over the TP ranks: set parallel.tp > 1 or "
            "parallel.sequence_parallel=false",
        )
        _check(
            self.sp_overlap in OVERLAPS,
            f"parallel.sp_overlap must be none, chunks or ring, got {self.sp_overlap!r}",
        )
        _check(
            self.sp_overlap == "none" or self.sequence_parallel,
            f"parallel.sp_overlap={self.sp_overlap} overlaps sequence parallelism's forward communication: set "
            "parallel.sequence_parallel=true, or parallel.sp_overlap=none",
        )
        _check(self.sp_chunks >= 2, f"parallel.sp_chunks={self.sp_chunks} pieces: give 2 or more")
        _check(
            self.sp_chunks == 4 or self.sp_overlap == "chunks",
            f"parallel.sp_chunks={self.sp_chunks} is the piece count of parallel.sp_overlap=chunks (here "
            f"{self.sp_overlap}): set parallel.sp_overlap=chunks, or leave sp_chunks at 4",
        )
        _check(
            self.pp_last_layers == "auto" or (isinstance(self.pp_last_layers, int) and self.pp_last_layers >= 0),
            f"parallel.pp_last_layers must be >= 0 (0: an even split) or auto, got {self.pp_last_layers!r}",
        )
        _check(
            self.pp_last_layers in (0, "auto") or self.pp > 1,
            f"parallel.pp_last_layers={self.pp_last_layers} needs pipeline stages: set parallel.pp > 1 or pp_last_layers=0",
        )

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers per pipeline stage (`models.mapping.stage_layers`)."""
        from megatron_jetrl.models.mapping import stage_layers

        if self.pp_last_layers == "auto":
            raise ValueError("parallel.pp_last_layers=auto has no split until the config is resolved (rl.resolve)")
        return stage_layers(num_layers, self.pp, self.pp_last_layers)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class DataConfig:
    """Where the prompts come from and how answers are checked."""

    source: Literal["arithmetic", "multiplication_trace", "gsm8k", "math", "deepmath"] = "arithmetic"
    """`arithmetic` (generated in-process, the embedded default), `multiplication_trace` (generated in-process: long
    worked answers, `grpo.data.MultiplicationTraceTask`), `gsm8k`, `math` or `deepmath`."""
    path: str = ""
    """Local jsonl/parquet file or directory of the dataset (not used by the generated sources)."""
    template: str = "arithmetic"
    """Prompt template (`grpo.data.PROMPT_TEMPLATES`)."""
    reward_style: Literal["number", "final", "gsm8k", "boxed"] = "number"
    """Answer extraction: `number` (arithmetic), `final` (multiplication_trace: the number after the last `=`),
    `gsm8k` (after `####`) or `boxed` (`\\boxed{}`)."""
    operand_max: int = 99
    """Generated sources: arithmetic operands are drawn from [0, operand_max], the multiplication_trace multiplicand
    from [1, operand_max]."""
    multiplier_min: int = 1
    """multiplication_trace only: the smallest multiplier = the fewest lines of a worked answer."""
    multiplier_max: int = 8
    """multiplication_trace only: the largest multiplier. A worked answer has b lines of ~2 + 2 * digits tokens each,
    b drawn from [multiplier_min, multiplier_max] (`multiplier_sampling`): this is the knob of the response length."""
    multiplier_sampling: Literal["uniform", "log"] = "uniform"
    """multiplication_trace only: `uniform` draws b uniformly; `log` draws log(b) uniformly, so every octave of lengths
    (5-10, 10-20, ... lines) gets the same share: short answers a small model gets right beside long ones."""

    heldout: int = 0
    """Problems held out of training (GRPO prompts and the warm-start's SFT pairs), scored every run.eval_every steps:
    of a generated task, this many distinct questions drawn with a fixed seed (`grpo.data.HELDOUT_SEED`: the same set for
    every run.seed); of a dataset, the distinct questions with the smallest SHA-256 (`grpo.data.split_heldout`). 0: none."""

    GENERATED = ("arithmetic", "multiplication_trace")

    def __post_init__(self):
        sources = (*self.GENERATED, "gsm8k", "math", "deepmath")
        _check(self.source in sources, f"data.source must be one of {sources}, got {self.source!r}")
        _check(
            self.source in self.GENERATED or bool(self.path),
            f"data.source={self.source!r} needs data.path (a local jsonl/parquet file or directory)",
        )
        _check(self.operand_max >= 1, f"data.operand_max must be >= 1, got {self.operand_max}")
        _check(
            self.reward_style in ("number", "final", "gsm8k", "boxed"),
            f"data.reward_style must be 'number', 'final', 'gsm8k' or 'boxed', got {self.reward_style!r}",
        )
        _check(
            1 <= self.multiplier_min <= self.multiplier_max,
            f"data.multiplier_min={self.multiplier_min} and data.multiplier_max={self.multiplier_max} must satisfy "
            "1 <= multiplier_min <= multiplier_max",
        )
        _check(
            self.multiplier_sampling in ("uniform", "log"),
            f"data.multiplier_sampling must be 'uniform' or 'log', got {self.multiplier_sampling!r}",
        )
        _check(
            self.source != "multiplication_trace" or self.reward_style == "final",
            f"data.source=multiplication_trace answers with a worked trace whose result follows the last '=': set "
            f"data.reward_style=final (got {self.reward_style!r}, which would score every answer 0)",
        )
        _check(self.heldout >= 0, f"data.heldout must be >= 0 (0: no held-out problems), got {self.heldout}")
        _check(
            self.source != "multiplication_trace" or not self.path,
            f"data.source=multiplication_trace is generated in-process: drop data.path ({self.path!r})",
        )


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout pool and its sampling."""

    engine: Literal["native", "vllm"] = "native"
    """`native` (pure torch, CPU and GPU) or `vllm` (GPU clusters; vLLM must be installed)."""
    num_engines: int = 1
    """Engines in the data-parallel pool (on global rank 0's host)."""
    n: int = 4
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature. Logprobs are always reported at temperature 1 (the policy's own)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1: off)."""
    max_new_tokens: int = 8
    """Response length limit."""
    bucket_mb: int = 256
    """Weight sync bucket size (MiB)."""
    tp: int = 1
    """vLLM only: tensor-parallel size of each engine (consecutive ranks; every rank runs one engine's TP rank and
    the world / tp engines share each step's prompts; in an FP8 rollout it must split the KV heads and keep the 128-blocks
    whole, as parallel.tp must). Independent of parallel.tp, but when training in FP8 (jetrl)
    keep it equal to parallel.tp (the trainer prints a note otherwise): an engine with another split sums the
    row-parallel linears' outputs in another order, the next FP8 quantization amplifies that, and the mismatch rises
    several times over (BENCHMARKS.md)."""
    kv_cache_fraction: float = 0.5
    """vLLM only: the most of the GPU memory free at engine start (after the actor is built and the engine's weights
    are counted) that the KV cache may take. Below that it gets what a step can use: the engine's share of the
    step's sequences at max_model_len each (`rollout.colocated.kv_cache_need`). The cache is dropped while the actor
    trains and mapped again for rollout, at a cost that grows with its size."""
    kv_cache_gb: float = 0.0
    """vLLM only: KV cache size in GiB per engine rank; 0 sizes it as kv_cache_fraction says."""
    offload: str = "none"
    """What of the actor's training state leaves the GPU from each weight sync until the engine sleeps after the
    rollout (`actor.offload`): `none`; `grads`, the FP32 gradient buffers (4 bytes a parameter of this rank, freed
    and zeroed again: nothing is copied) and, in jetrl with the local spec, the policy's FP8 weight copies once the
    sync has streamed them (W and W^T: about 2 bytes a linear parameter, quantized again by the next forward);
    `optimizer`, those and the optimizer's FP32 main params and Adam moments (12 bytes a parameter, this rank's
    ZeRO-1 shard) and the KL reference's FP8 bytes, copied to pinned host memory of the same size and back (the copy
    back overlaps the logprob passes). The run is bit for bit the same. The memory goes to the engine: a vLLM KV
    cache is sized with it at start-up, so long rollouts run in fewer passes (what it frees at Qwen3-8B:
    BENCHMARKS.md)."""
    max_model_len: int = 0
    """vLLM only: longest prompt + response; 0 means 1024 prompt tokens + max_new_tokens (capped by the model's
    max_position_embeddings)."""
    enforce_eager: bool = False
    """vLLM only: no CUDA graphs / torch.compile (start-up in seconds, decode several times slower)."""
    glue: Literal["auto", "vllm", "trainer"] = "auto"
    """vLLM only: whose RMSNorm and RoPE vLLM runs. `trainer`: the actor's functions, registered in vLLM's op registry
    (`rollout/vllm_glue.py`) and checked at start-up; with enforce_eager false it runs full decode CUDA graphs without
    torch.compile. `vllm`: its own kernels, which round differently from the trainer's in part of their outputs,
    inside its compiled engine: jetrl's mismatch is several times the trainer glue's, for a slightly faster decode
    (BENCHMARKS.md). `auto`, resolved when the config loads (`rl.resolve`): trainer, except vllm with model.spec=te,
    whose norms are Transformer Engine's, and for a scaled RoPE (llama3), whose vLLM class the glue does not
    replace."""

    vllm_fused_quant: bool = True
    """vLLM only, with the trainer's glue, an FP8 rollout and FP32 scales: the decoder layers' RMSNorm and SiLU-and-mul
    kernels also write the FP8 bytes and scales of their output, which the FP8 linear after them then reads instead of
    quantizing again (three launches fewer per layer and decode step; the same bytes, checked at start-up:
    `rollout/vllm_glue.py`), which makes decode faster (BENCHMARKS.md). `false` lets vLLM's own quantizer kernel run,
    with the same bytes."""

    def __post_init__(self):
        _check(self.engine in ("native", "vllm"), f"rollout.engine must be 'native' or 'vllm', got {self.engine!r}")
        _check(self.num_engines >= 1 and self.n >= 1, "rollout.num_engines and rollout.n must be >= 1")
        _check(self.n >= 2, f"rollout.n={self.n}: GRPO needs at least 2 samples per prompt (group-normalized advantages)")
        _check(
            0 < self.temperature < 1e3,
            f"rollout.temperature must be a finite number > 0 for GRPO sampling, got {self.temperature}",
        )
        _check(0 < self.top_p <= 1, f"rollout.top_p must be in (0, 1], got {self.top_p}")
        _check(self.max_new_tokens >= 1, f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(self.bucket_mb >= 1, f"rollout.bucket_mb must be >= 1, got {self.bucket_mb}")
        _check(self.tp >= 1, f"rollout.tp must be >= 1, got {self.tp}")
        _check(0 < self.kv_cache_fraction < 1, f"rollout.kv_cache_fraction must be in (0, 1), got {self.kv_cache_fraction}")
        _check(self.offload in OFFLOAD_CHOICES, f"rollout.offload must be one of {list(OFFLOAD_CHOICES)}, got {self.offload!r}")
        _check(self.kv_cache_gb >= 0, f"rollout.kv_cache_gb must be >= 0 (0: use kv_cache_fraction), got {self.kv_cache_gb}")
        _check(
            self.max_model_len == 0 or self.max_model_len > self.max_new_tokens,
            f"rollout.max_model_len={self.max_model_len} must exceed rollout.max_new_tokens={self.max_new_tokens} (0: automatic)",
        )
        _check(self.glue in ("auto", "vllm", "trainer"), f"rollout.glue must be 'auto', 'vllm' or 'trainer', got {self.glue!r}")
        _check(
            self.engine == "vllm" or self.tp == 1,
            f"rollout.tp={self.tp} is for rollout.engine=vllm (the native engine is not tensor parallel)",
        )

    def window(self, positions: int) -> int:
        """The most tokens, prompt and response, a sequence may reach on a model of `positions` (its
        max_position_embeddings): vLLM's max_model_len (0: 1024 prompt tokens + max_new_tokens, at most `positions`);
        the native engine's is the model's."""
        if self.engine == "vllm":
            return self.max_model_len or min(positions, 1024 + self.max_new_tokens)
        return positions

    def check_positions(self, positions: int) -> None:
        """What the engines refuse of a model with `positions` RoPE positions (max_position_embeddings): a vLLM engine
        longer than the model (vLLM's own start-up check), or responses with no room left for a prompt (a sequence
        past the model's positions: vLLM refuses the request, the native engine would run positions the model never
        had). The prompts themselves are checked when the data is built (`rl.session.check_prompt_room`)."""
        _check(
            self.max_model_len <= positions,
            f"rollout.max_model_len={self.max_model_len} is longer than the model's max_position_embeddings={positions} "
            f"(vLLM refuses an engine longer than the model): set rollout.max_model_len to at most {positions}",
        )
        _check(
            self.max_new_tokens < positions,
            f"rollout.max_new_tokens={self.max_new_tokens} leaves no position for a prompt in the model's "
            f"max_position_embeddings={positions} (a sequence may not pass them: vLLM refuses such a request, and the "
            f"native engine would run RoPE positions the model never had): set rollout.max_new_tokens below {positions} "
            "less the longest prompt",
        )


@dataclass(frozen=True)
class GRPOConfig:
    """Batch shape of one GRPO step."""

    prompts_per_step: int = 16
    """Prompts per step; the batch is prompts_per_step * rollout.n sequences (the paper: 256 sequences)."""
    micro_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank."""
    logprob_micro_batch_size: int = 0
    """Sequences per micro-batch of the forward-only passes that score the rollouts (old and reference logprobs),
    which keep no activations, so it can be several times micro_batch_size: fewer, larger passes, where a pass of a
    few thousand tokens per GPU waits on the host (TP > 1). 0: micro_batch_size. The update then recomputes the old
    logprobs at another batch shape; they stay equal bit for bit only where every kernel and all-reduce is
    batch-invariant (the FP8 linears are, cuBLAS and NCCL's ring need not be): its first ratio is 1 to the last bit or so."""
    updates_per_step: int = 1
    """Optimizer steps per GRPO step (1: on-policy; more: PPO-style reuse of the batch, in equal chunks)."""
    advantage_scale: Literal["std", "none"] = "std"
    """`std` (GRPO: divide by the group std) or `none` (Dr. GRPO)."""

    def __post_init__(self):
        _check(
            self.prompts_per_step >= 1 and self.micro_batch_size >= 1 and self.updates_per_step >= 1,
            "grpo.prompts_per_step, grpo.micro_batch_size and grpo.updates_per_step must be >= 1",
        )
        _check(
            self.logprob_micro_batch_size >= 0,
            f"grpo.logprob_micro_batch_size must be >= 0 (0: grpo.micro_batch_size), got {self.logprob_micro_batch_size}",
        )
        _check(
            self.advantage_scale in ("std", "none"), f"grpo.advantage_scale must be 'std' or 'none', got {self.advantage_scale!r}"
        )

    @property
    def logprob_batch(self) -> int:
        """Sequences per micro-batch of the logprob passes (`logprob_micro_batch_size`, 0: `micro_batch_size`)."""
        return self.logprob_micro_batch_size or self.micro_batch_size


@dataclass(frozen=True)
class WarmupConfig:
    """Supervised warm-start on the synthetic task before GRPO (the tiny default cannot download a model)."""

    steps: int = 0
    """SFT optimizer steps (0: none)."""
    lr: float = 1e-3
    """SFT learning rate."""
    batch_size: int = 32
    """SFT sequences per step (split over data-parallel ranks)."""

    def __post_init__(self):
        _check(
            self.steps >= 0 and self.lr > 0 and self.batch_size >= 1, "warmup.steps >= 0, warmup.lr > 0, warmup.batch_size >= 1"
        )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
