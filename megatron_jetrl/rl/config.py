"""The GRPO run's configuration: typed, frozen dataclasses filled from a YAML file plus `section.key=value`
overrides (`section.key.name=value` for one entry of a mapping: `model.hf_config.num_hidden_layers=28`), checked
completely before any heavy work starts.

Sections and the classes they fill: `run` (RunConfig), `model` (ModelConfig), `precision`
(`fp8.PrecisionFlow`, the one object trainer and rollout share), `parallel` (ParallelConfig), `data`
(DataConfig), `rollout` (RolloutConfig), `grpo` (GRPOConfig), `loss` (`rl.loss.PolicyLossConfig`), `optim`
(`actor.train_step.OptimConfig`), `warmup` (WarmupConfig). Unknown sections or keys, wrong types and
settings that do not fit together (batch sizes that do not divide, 128-block misalignment at the requested
TP, ...) are refused with a message that names the key and the fix.

    python -m megatron_jetrl.rl.config configs/tiny.yaml parallel.tp=2 --get parallel.world_size
    python -m megatron_jetrl.rl.config configs/models/qwen3-8b-base.yaml configs/modes/jetrl.yaml --print

`--get` is the launchers' question on the machine that will run the ranks, so it also refuses what this machine
or the run directory cannot run (`rl/preflight.py`: `run.device=cuda` without a visible GPU, `rollout.engine=vllm`
without vLLM, a missing `model.path` or `data.path`, a changed hyper-parameter of a run that would resume, ...);
a config checked alone is valid on any machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_jetrl.actor.train_step import OptimConfig
from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.models.arch import ModelArch
from megatron_jetrl.rl.loss import PolicyLossConfig

_CONFIGS = [Path(__file__).resolve().parents[2] / "configs", Path(__file__).resolve().parents[1] / "_configs"]
DEFAULT_CONFIG = next((d / "tiny.yaml" for d in _CONFIGS if (d / "tiny.yaml").is_file()), _CONFIGS[0] / "tiny.yaml")
"""configs/tiny.yaml of the repository, else the copy an installed package carries (pyproject.toml's package data)."""


class ConfigError(ValueError):
    """A configuration problem, found before the run starts."""


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
    """GRPO steps."""
    save_every: int = 10
    """Checkpoint every this many steps (and at the end); 0: only at the end."""
    checkpoint: bool = True
    """False: write no checkpoint at all -- for timing runs and sweeps at large shapes, where one checkpoint with
    optimizer state is ~16 bytes per parameter. A stopped run then cannot resume (it starts over), and run.export,
    which converts the final checkpoint, must be false."""
    keep_checkpoints: int = 3
    """Complete checkpoints kept in `checkpoints/`: after each save the oldest beyond this many are deleted (the
    newest complete one is always kept); 0: keep every one."""
    resume: str = "auto"
    """`auto`: continue from the newest complete checkpoint in out_dir if there is one; `never`: refuse to
    start when out_dir already holds checkpoints (pick another name or delete them)."""
    export: bool = True
    """Write the final policy as an HF FP8 (or BF16) checkpoint to `<out_dir>/export` (the converter's format)."""
    device: str = "auto"
    """`auto` (CUDA when available, else CPU), `cpu` or `cuda`."""
    timeout_s: float = 300.0
    """Collective timeout: if a rank dies, the others fail within this many seconds with the lost rank named."""
    on_nonfinite: str = "stop"
    """NaN/Inf in rewards, loss or gradients: `stop` the run, or `skip` the update (the step is logged as skipped)."""

    def __post_init__(self):
        _check(self.steps >= 1, f"run.steps must be >= 1, got {self.steps}")
        _check(self.save_every >= 0, f"run.save_every must be >= 0 (0: only at the end), got {self.save_every}")
        _check(self.checkpoint or not self.export, "run.checkpoint=false writes no checkpoint, but run.export=true "
               "converts the final one: set run.export=false too (or keep run.checkpoint=true)")
        _check(self.keep_checkpoints >= 0, f"run.keep_checkpoints must be >= 0 (0: keep every checkpoint), got {self.keep_checkpoints}")
        _check(self.resume in ("auto", "never"), f"run.resume must be 'auto' or 'never', got {self.resume!r}")
        _check(self.device in ("auto", "cpu", "cuda"), f"run.device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        _check(0 < self.timeout_s < 1e7, f"run.timeout_s must be positive, got {self.timeout_s:g} (seconds, below 1e7)")
        _check(0 <= self.seed < 2**63, f"run.seed must be in [0, 2**63), got {self.seed}")
        _check(self.on_nonfinite in ("stop", "skip"), f"run.on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}")
        _check(bool(self.name) and "/" not in self.name and self.name not in (".", ".."),
               f"run.name must be a plain directory name (not empty, '.', '..', no '/'), got {self.name!r}")

    @property
    def directory(self) -> Path:
        return Path(self.out_dir or f"runs/{self.name}")

    def device_type(self) -> str:
        """'cuda' or 'cpu': where this machine runs the config. A fact of the machine, not of the config (presets
        say `cuda` and are checked anywhere), so load_config does not call it; the launchers' `--get` and the
        trainer do, before any work."""
        import torch

        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("run.device='cuda' but no CUDA device is visible on this machine: run on a GPU node "
                              "(check CUDA_VISIBLE_DEVICES and the driver) or set run.device=cpu")
        return "cuda" if self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available()) else "cpu"


@dataclass(frozen=True)
class ModelConfig:
    """The policy: architecture, initial weights and tokenizer."""

    hf_config: dict = field(default_factory=dict)
    """HF config.json fields of the architecture, inline (the tiny default, and the presets so that their TP
    alignment is checked without the weights). With `path` too, they must agree with its config.json."""
    path: str = ""
    """Local HF model directory (config.json, safetensors, tokenizer): the initial weights. Empty: random init."""
    tokenizer: str = "sentencepiece"
    """`sentencepiece`: the embedded tokenizer, trained on the synthetic corpus at first run (tiny default);
    `hf`: the tokenizer in `path`."""
    batch_invariant: bool | None = None
    """true / false / null (auto: true for CPU runs): the actor and the native engine run `models.batch_invariant_ops`, which
    makes their logprobs equal bit for bit in `jetrl`/`bf16` on the emulated FP8 backend (slow; a reference)."""
    fused: bool = True
    """Local spec on CUDA: RMSNorm and RoPE as one Triton kernel per op and direction and megatron's fused
    SwiGLU for BF16 MLPs (`actor.fused`); false: eager torch ops (several kernels each; what megatron runs without
    apex or TE). The CPU always runs eagerly."""
    spec: str = "local"
    """The actor's megatron layer spec. `local`: megatron's local layers with this project's FP8 linears (runs anywhere;
    bit-exact with the rollout's quantizer). `te`: megatron's Transformer Engine spec (TE fused norm+linear, TE
    attention), FP8 through TE's own kernels with the recipe the precision flow derives (`actor.te_recipe`): CUDA and
    TE 2.20.2 needed; in `jetrl` with `scale_mode: fp32` a small fraction of activation elements differ by one E4M3 step
    from the rollout's (weights are shipped as TE trained them), with `ue8m0` the bytes agree (`fp8/te.py`);
    `precision.backend` then applies to the native rollout engine only. Checkpoints
    of the two specs name the norms differently: resume with the spec you trained with."""

    def __post_init__(self):
        _check(bool(self.hf_config) or bool(self.path),
               "model: give model.hf_config (an inline architecture: random init) and/or model.path (a local HF directory)")
        _check(self.tokenizer in ("sentencepiece", "hf"), f"model.tokenizer must be 'sentencepiece' or 'hf', got {self.tokenizer!r}")
        _check(self.tokenizer != "hf" or bool(self.path), "model.tokenizer='hf' needs model.path (the directory that holds the tokenizer)")
        _check(self.spec in ("local", "te"), f"model.spec must be 'local' or 'te', got {self.spec!r}")
        if self.spec == "te":
            from megatron_jetrl.fp8.te import INSTALL_HINT, te_installed

            _check(te_installed(), f"model.spec=te: {INSTALL_HINT}")
            _check(not self.batch_invariant, "model.spec=te runs Transformer Engine's own norm, attention and GEMM kernels, "
                                             "not models.batch_invariant_ops: set model.batch_invariant=false (or null), or "
                                             "model.spec=local")

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
            raise ConfigError(f"model.hf_config disagrees with {self.path}/config.json on " + ", ".join(
                f"{k} (config {a!r}, checkpoint {b!r})" for k, (a, b) in sorted(odd.items())) + ": fix the preset or the path")


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron parallelism of the actor; the run needs tp * pp * dp processes."""

    tp: int = 1
    """Tensor parallel size (every split dimension must stay a multiple of 128 for FP8)."""
    pp: int = 1
    """Pipeline parallel size. The GRPO loop's live weight sync gathers over TP only: 1."""
    dp: int = 1
    """Data parallel size."""

    def __post_init__(self):
        for name in ("tp", "pp", "dp"):
            _check(getattr(self, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        _check(self.pp == 1, f"parallel.pp={self.pp}: the GRPO loop's live weight sync gathers over TP only; run it at "
                             "pp=1 (the actor itself trains at PP>1: see megatron_jetrl.actor)")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class DataConfig:
    """Where the prompts come from and how answers are checked."""

    source: str = "arithmetic"
    """`arithmetic` (generated in-process, the embedded default), `multiplication_trace` (generated in-process: long
    worked answers, `rl.data.MultiplicationTraceTask`), `gsm8k`, `math` or `deepmath`."""
    path: str = ""
    """Local jsonl/parquet file or directory of the dataset (not used by the generated sources)."""
    template: str = "arithmetic"
    """Prompt template (`rl.data.PROMPT_TEMPLATES`)."""
    reward_style: str = "number"
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
    multiplier_sampling: str = "uniform"
    """multiplication_trace only: `uniform` draws b uniformly; `log` draws log(b) uniformly, so every octave of lengths
    (5-10, 10-20, ... lines) gets the same share: short answers a small model gets right beside long ones."""

    GENERATED = ("arithmetic", "multiplication_trace")

    def __post_init__(self):
        sources = (*self.GENERATED, "gsm8k", "math", "deepmath")
        _check(self.source in sources, f"data.source must be one of {sources}, got {self.source!r}")
        _check(self.source in self.GENERATED or bool(self.path), f"data.source={self.source!r} needs data.path (a local jsonl/parquet file or directory)")
        _check(self.operand_max >= 1, f"data.operand_max must be >= 1, got {self.operand_max}")
        _check(self.reward_style in ("number", "final", "gsm8k", "boxed"),
               f"data.reward_style must be 'number', 'final', 'gsm8k' or 'boxed', got {self.reward_style!r}")
        _check(1 <= self.multiplier_min <= self.multiplier_max,
               f"data.multiplier_min={self.multiplier_min} and data.multiplier_max={self.multiplier_max} must satisfy "
               "1 <= multiplier_min <= multiplier_max")
        _check(self.multiplier_sampling in ("uniform", "log"),
               f"data.multiplier_sampling must be 'uniform' or 'log', got {self.multiplier_sampling!r}")
        _check(self.source != "multiplication_trace" or self.reward_style == "final",
               f"data.source=multiplication_trace answers with a worked trace whose result follows the last '=': set "
               f"data.reward_style=final (got {self.reward_style!r}, which would score every answer 0)")
        _check(self.source != "multiplication_trace" or not self.path,
               f"data.source=multiplication_trace is generated in-process: drop data.path ({self.path!r})")


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout pool and its sampling."""

    engine: str = "native"
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
    the world / tp engines share each step's prompts). Independent of parallel.tp, but when training in FP8 (jetrl)
    keep it equal to parallel.tp (the trainer prints a note otherwise): an engine with another split sums the
    row-parallel linears' outputs in another order, the next FP8 quantization amplifies that, and the mismatch rises
    about fourfold (trainer TP 2 on 4 H100s: mean |dlogp| 0.032 at rollout TP 2, 0.137 at rollout TP 1;
    BENCHMARKS.md)."""
    kv_cache_fraction: float = 0.5
    """vLLM only: the most of the GPU memory free at engine start (after the actor is built and the engine's weights
    are counted) that the KV cache may take. Below that it gets what a step can use: the engine's share of the
    step's sequences at max_model_len each (`rollout.colocated.kv_cache_need`). The cache is dropped while the actor
    trains and mapped again for rollout, at a cost that grows with its size."""
    kv_cache_gb: float = 0.0
    """vLLM only: KV cache size in GiB per engine rank; 0 sizes it as kv_cache_fraction says."""
    max_model_len: int = 0
    """vLLM only: longest prompt + response; 0 means 1024 prompt tokens + max_new_tokens (capped by the model's
    max_position_embeddings)."""
    enforce_eager: bool = False
    """vLLM only: no CUDA graphs / torch.compile (start-up in seconds, decode several times slower)."""
    glue: str = "auto"
    """vLLM only: whose RMSNorm and RoPE vLLM runs. `trainer`: the actor's functions, registered in vLLM's op registry
    (`rollout/vllm_glue.py`) and checked at start-up; with enforce_eager false it runs full decode CUDA graphs without
    torch.compile. `vllm`: its own kernels, which round differently from the trainer's in about a fifth of their
    outputs, inside its compiled engine (measured at hidden 2048: jetrl's mismatch 0.161 with vLLM's, 0.044 with the
    trainer's, eager or graphs; vLLM's decodes 6% faster at batch 128, BENCHMARKS.md). `auto`: trainer, except vllm
    with model.spec=te, whose norms are Transformer Engine's, and for a scaled RoPE (llama3), whose vLLM class the
    glue does not replace."""

    vllm_fused_quant: bool = True
    """vLLM only, with the trainer's glue, an FP8 rollout and FP32 scales: the decoder layers' RMSNorm and SiLU-and-mul
    kernels also write the FP8 bytes and scales of their output, which the FP8 linear after them then reads instead of
    quantizing again (three launches fewer per layer and decode step; the same bytes, checked at start-up:
    `rollout/vllm_glue.py`). Decode at Qwen3-8B shapes, batch 128: 1.05x faster than without it (H200),
    1.22-1.23x vLLM BF16 with it (H100; BENCHMARKS.md). `false` lets vLLM's own quantizer kernel run, with
    the same bytes."""

    def __post_init__(self):
        _check(self.engine in ("native", "vllm"), f"rollout.engine must be 'native' or 'vllm', got {self.engine!r}")
        _check(self.num_engines >= 1 and self.n >= 1, "rollout.num_engines and rollout.n must be >= 1")
        _check(self.n >= 2, f"rollout.n={self.n}: GRPO needs at least 2 samples per prompt (group-normalized advantages)")
        _check(0 < self.temperature < 1e3, f"rollout.temperature must be a finite number > 0 for GRPO sampling, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"rollout.top_p must be in (0, 1], got {self.top_p}")
        _check(self.max_new_tokens >= 1, f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(self.bucket_mb >= 1, f"rollout.bucket_mb must be >= 1, got {self.bucket_mb}")
        _check(self.tp >= 1, f"rollout.tp must be >= 1, got {self.tp}")
        _check(0 < self.kv_cache_fraction < 1, f"rollout.kv_cache_fraction must be in (0, 1), got {self.kv_cache_fraction}")
        _check(self.kv_cache_gb >= 0, f"rollout.kv_cache_gb must be >= 0 (0: use kv_cache_fraction), got {self.kv_cache_gb}")
        _check(self.max_model_len == 0 or self.max_model_len > self.max_new_tokens,
               f"rollout.max_model_len={self.max_model_len} must exceed rollout.max_new_tokens={self.max_new_tokens} (0: automatic)")
        _check(self.glue in ("auto", "vllm", "trainer"), f"rollout.glue must be 'auto', 'vllm' or 'trainer', got {self.glue!r}")
        _check(self.engine == "vllm" or self.tp == 1, f"rollout.tp={self.tp} is for rollout.engine=vllm (the native engine is not tensor parallel)")


@dataclass(frozen=True)
class GRPOConfig:
    """Batch shape of one GRPO step."""

    prompts_per_step: int = 16
    """Prompts per step; the batch is prompts_per_step * rollout.n sequences (the paper: 256 sequences)."""
    micro_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank."""
    updates_per_step: int = 1
    """Optimizer steps per GRPO step (1: on-policy; more: PPO-style reuse of the batch, in equal chunks)."""
    advantage_scale: str = "std"
    """`std` (GRPO: divide by the group std) or `none` (Dr. GRPO)."""

    def __post_init__(self):
        _check(self.prompts_per_step >= 1 and self.micro_batch_size >= 1 and self.updates_per_step >= 1,
               "grpo.prompts_per_step, grpo.micro_batch_size and grpo.updates_per_step must be >= 1")
        _check(self.advantage_scale in ("std", "none"), f"grpo.advantage_scale must be 'std' or 'none', got {self.advantage_scale!r}")


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
        _check(self.steps >= 0 and self.lr > 0 and self.batch_size >= 1, "warmup.steps >= 0, warmup.lr > 0, warmup.batch_size >= 1")


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
        _check(sequences % per_rank == 0,
               f"grpo.prompts_per_step * rollout.n = {sequences} sequences do not split into parallel.dp={self.parallel.dp} "
               f"x grpo.updates_per_step={self.grpo.updates_per_step} x grpo.micro_batch_size={self.grpo.micro_batch_size}: "
               f"pick sizes whose product divides {sequences}")
        _check(self.warmup.steps == 0 or self.warmup.batch_size % self.parallel.dp == 0,
               f"warmup.batch_size={self.warmup.batch_size} must be a multiple of parallel.dp={self.parallel.dp}")
        fp8 = self.precision.mode != "bf16"
        _check(not (self.model.batch_invariant and fp8 and self.precision.backend not in ("auto", "emulated")),
               f"model.batch_invariant=true needs the emulated FP8 GEMM (exact block products), got precision.backend="
               f"{self.precision.backend!r}: set precision.backend=emulated or model.batch_invariant=false")
        _check(self.rollout.engine != "vllm" or self.parallel.world_size % self.rollout.tp == 0,
               f"rollout.tp={self.rollout.tp} must divide the number of ranks parallel.tp * pp * dp = {self.parallel.world_size} "
               "(each rank runs one TP rank of one vLLM engine)")
        _check(self.rollout.engine != "vllm" or self.run.device != "cpu",
               "rollout.engine=vllm needs a GPU run, not run.device=cpu (use rollout.engine=native on CPU)")
        if self.model.spec == "te":
            _check(self.rollout.glue != "trainer",
                   "rollout.glue=trainer runs the local spec's RMSNorm and RoPE inside vLLM, but model.spec=te trains with "
                   "Transformer Engine's: use rollout.glue=auto (vLLM's, with this spec) or vllm")
            _check(not self.precision.train_fp8 or self.grpo.micro_batch_size % 8 == 0,
                   f"model.spec=te in mode jetrl runs TE's FP8 GEMMs, which need the tokens of a micro-batch (micro-batch x "
                   f"sequence length, any length) to be a multiple of 8: set grpo.micro_batch_size to a multiple of 8 "
                   f"(got {self.grpo.micro_batch_size})")
            _check(not self.precision.train_fp8 or self.warmup.steps == 0 or (self.warmup.batch_size // self.parallel.dp) % 8 == 0,
                   f"model.spec=te in mode jetrl: the warm-up's micro-batches (warmup.batch_size / parallel.dp = "
                   f"{self.warmup.batch_size // self.parallel.dp} sequences per rank) must be a multiple of 8 sequences for TE's "
                   "FP8 GEMMs: set warmup.batch_size accordingly")
            _check(self.run.device != "cpu", "model.spec=te needs a GPU run (Transformer Engine has no CPU kernels), not "
                                             "run.device=cpu: set run.device=cuda (or auto) or model.spec=local")
            _check(self.precision.eps == PrecisionFlow().eps,
                   f"model.spec=te quantizes with vLLM's amax floor eps={PrecisionFlow().eps} (megatron resolves the TE "
                   f"quantizer factory by import path, one per scale mode); got precision.eps={self.precision.eps}: leave "
                   "precision.eps at its default or use model.spec=local")
        if self.model.hf_config:
            self.arch()  # architecture problems surface here, before anything is built

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
        return arch

    def notices(self) -> list[str]:
        """Valid settings a user should know cost something (the trainer prints them at start, rank 0)."""
        out = []
        if self.rollout.engine == "vllm" and self.precision.train_fp8 and self.rollout.tp != self.parallel.tp:
            out.append(f"rollout.tp={self.rollout.tp} differs from parallel.tp={self.parallel.tp}: the engines add the row-parallel "
                       "linears' partial outputs in another order than the trainer, and FP8 re-quantization amplifies it "
                       "(trainer TP 2: mismatch 0.137 with TP-1 engines against 0.032 with TP-2 ones, BENCHMARKS.md); "
                       f"set rollout.tp={self.parallel.tp} for the lowest mismatch")
        return out

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            out[f.name] = {g.name: _plain(getattr(section, g.name)) for g in dataclasses.fields(section) if g.init}
        return out


# ---- loading --------------------------------------------------------------------------------------------


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


_EXACT = {int: ("an integer", ""), bool: ("true or false", ""), str: ("a string", " (quote it in YAML)"), dict: ("a mapping", "")}
"""Types a value must already have (YAML gives them directly): what to call them, and a hint."""


def _coerce(value, hint, where: str):
    """`value` as type `hint` (int, float, str, bool, dict, tuple[...], X | None), or a ConfigError."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        args = typing.get_args(hint)
        item = args[0] if args else object
        return tuple(value) if item is object or item is Ellipsis else tuple(_coerce(v, item, where) for v in value)
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 5e-4 (no dot) as a string; it is a number all the same
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if hint in _EXACT:
        what, hint_text = _EXACT[hint]
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ConfigError(f"{where} must be {what}, got {value!r}{hint_text}")
        return value
    return value


def _unknown(key, known, where: str) -> ConfigError:
    key = str(key)  # YAML keys may be null, numbers, ...
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"
    return ConfigError(f"unknown key {where}{key!r}{hint}")


def _build(cls, data, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"section {where.rstrip('.') or 'top level'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown(key, fields, where)
        kwargs[key] = _coerce(value, hints[key], f"{where}{key}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where.rstrip('.')}: {e}") from None


def _is_mapping_field(section: str, key: str) -> bool:
    """Is `section.key` a mapping-typed field (e.g. model.hf_config)?"""
    hint = typing.get_type_hints(typing.get_type_hints(JetRLConfig)[section]).get(key)
    return hint is dict or typing.get_origin(hint) is dict


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`section.key=value` strings (values parsed as YAML) merged into a config dict; `section.key.name=value` sets
    one entry of a mapping field (e.g. `model.hf_config.num_hidden_layers=28`) and keeps the others."""
    sections = {f.name for f in dataclasses.fields(JetRLConfig)}
    for item in overrides:
        key, sep, raw = item.partition("=")
        parts = key.split(".")
        entry = len(parts) == 3 and all(parts) and parts[0] in sections and _is_mapping_field(parts[0], parts[1])
        if not sep or not all(parts) or not (len(parts) == 2 or entry):
            raise ConfigError(f"override {item!r} is not of the form section.key=value (e.g. parallel.tp=2), or "
                              "section.key.name=value for one entry of a mapping (e.g. model.hf_config.num_hidden_layers=28)")
        if parts[0] not in sections:
            raise _unknown(parts[0], sections, "")
        data.setdefault(parts[0], {})
        if not isinstance(data[parts[0]], dict):
            raise ConfigError(f"section {parts[0]} must be a mapping")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({str(e).splitlines()[0]}); quote it") from None
        if entry:
            current = data[parts[0]].get(parts[1]) or {}
            if not isinstance(current, dict):
                raise ConfigError(f"override {item!r}: {parts[0]}.{parts[1]} is {current!r}, not a mapping")
            data[parts[0]][parts[1]] = {**current, parts[2]: value}
        else:
            data[parts[0]][parts[1]] = value
    return data


def config_from_dict(data: dict) -> JetRLConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"a config is a mapping of sections, got {type(data).__name__}")
    hints = typing.get_type_hints(JetRLConfig)
    sections = {f.name for f in dataclasses.fields(JetRLConfig)}
    kwargs = {}
    for name, value in data.items():
        if name not in sections:
            raise _unknown(name, sections, "")
        kwargs[name] = _build(hints[name], value if value is not None else {}, f"{name}.")
    try:
        return JetRLConfig(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (configs/ holds tiny.yaml, models/ and modes/)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) or v is None for v in data.values()):
        raise ConfigError(f"{path} must be a mapping of sections (run:, model:, precision:, ...) to mappings")
    return data


def load_config(paths: str | Path | list | None = None, overrides: list[str] = ()) -> JetRLConfig:
    """YAML files (default `configs/tiny.yaml`; later files override earlier ones key by key, e.g. a model
    preset then a precision mode) plus overrides -> a validated JetRLConfig."""
    if paths is None or paths == []:
        paths = [DEFAULT_CONFIG]
    elif isinstance(paths, (str, Path)):
        paths = [paths]
    data: dict = {}
    for path in paths:
        for section, values in _read_yaml(Path(path)).items():
            data.setdefault(section, {}).update(values or {})
    return config_from_dict(apply_overrides(data, list(overrides)))


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """`[CONFIG.yaml ...] [section.key=value ...]` -> (config paths, overrides); an `--option` is refused with the
    override it probably means (`--steps 10` -> run.steps=10)."""
    files = []
    for i, arg in enumerate(argv):
        if arg.startswith("-"):
            raise ConfigError(_option_hint(argv, i))
        if "=" in arg:
            return files, list(argv[i:])
        files.append(arg)
    return files, []


def _option_hint(argv: list[str], i: int) -> str:
    name, sep, value = argv[i].lstrip("-").partition("=")
    if not sep and i + 1 < len(argv) and not argv[i + 1].startswith("-") and "=" not in argv[i + 1]:
        value = argv[i + 1]
    value = value or "VALUE"
    if "." in name:
        keys = [name]
    else:
        keys = [f"{section}.{g.name}" for section, cls in typing.get_type_hints(JetRLConfig).items()
                for g in dataclasses.fields(cls) if g.name == name.replace("-", "_")]
    example = " or ".join(f"{k}={value}" for k in keys) if keys else "run.steps=10"
    return (f"{argv[i]!r} is not an option: settings are section.key=value overrides after the config files, e.g. {example} "
            "(--help lists the sections; `python -m megatron_jetrl.rl.config --print` shows every key)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Validate a megatron-jetrl GRPO config and print parts of it.")
    parser.add_argument("args", nargs="*", help="[CONFIG.yaml ...] [section.key=value ...]")
    parser.add_argument("--get", help="print one value, e.g. parallel.world_size (also refuses what this machine or the "
                                      "run directory cannot run: rl/preflight.py)")
    parser.add_argument("--print", action="store_true", help="print the resolved config as YAML")
    argv = sys.argv[1:] if argv is None else argv
    ns, unknown = parser.parse_known_args(argv)
    try:
        if unknown:
            raise ConfigError(_option_hint(argv, argv.index(unknown[0])))
        cfg = load_config(*split_args(ns.args))
        if ns.get:  # the launchers' question before they start the ranks here: can this machine run it?
            from megatron_jetrl.rl.preflight import check

            check(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if ns.get:
        section, _, key = ns.get.partition(".")
        try:
            print(getattr(getattr(cfg, section), key))
        except AttributeError:
            print(f"config error: no value {ns.get!r}", file=sys.stderr)
            return 2
    if ns.print or not ns.get:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    from megatron_jetrl.rl import config  # the imported module: its ConfigError is the one rl/preflight.py raises

    sys.exit(config.main())
