"""What a GRPO run is made of, built from its config: the process group, tokenizer, problems, the actor
(megatron-core, optimizer), the frozen reference and the rollout pool. Its checkpoints: `rl.checkpoints`.

Rank layout: the actor spans all ranks (TP x PP x DP). Native engines live on global rank 0,
which samples the whole batch; vLLM engines run on every rank (`rollout.colocated`: each group of rollout.tp
ranks samples its share and every rank receives all outputs).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_jetrl.actor.offload import TrainStateOffload
from megatron_jetrl.actor.provider import ActorOptions, build_model
from megatron_jetrl.actor.train_step import unallocated_state_bytes, wrap_for_training
from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.fp8.sequence_parallel import SPOverlap
from megatron_jetrl.grpo.data import (
    HELDOUT_SEED,
    ArithmeticTask,
    MultiplicationTraceTask,
    Problem,
    PromptSampler,
    format_prompt,
    load_problems,
    split_heldout,
)
from megatron_jetrl.models import ModelArch
from megatron_jetrl.rl import checkpoints
from megatron_jetrl.rl.config import ConfigError, JetRLConfig
from megatron_jetrl.rl.context import RunContext
from megatron_jetrl.rl.jit_cache import pin_cache_dirs
from megatron_jetrl.rl.kv_scales import KvScaleState
from megatron_jetrl.rollout.engine import TrainerPool
from megatron_jetrl.rollout.native import expected_tensors

SFT_CORPUS = 20000  # arithmetic strings the tokenizer is trained on
ARITHMETIC_PROBLEMS = 4096  # GRPO prompts of the arithmetic task


def generated_task(cfg: JetRLConfig):
    """The in-process task that warm-starts the policy: data.source's when it is generated, else arithmetic."""
    d = cfg.data
    if d.source == "multiplication_trace":
        return MultiplicationTraceTask(d.operand_max, d.multiplier_min, d.multiplier_max, d.multiplier_sampling)
    return ArithmeticTask(high=d.operand_max)


@dataclass
class Session:
    cfg: JetRLConfig
    arch: ModelArch
    flow: PrecisionFlow
    device: torch.device
    batch_invariant: bool
    tokenizer: object
    sampler: PromptSampler
    model: object  # megatron DDP-wrapped GPTModel
    optimizer: object
    reference: object | None  # frozen GPTModel (KL term), None when loss.kl_coef == 0
    run: RunContext  # where the run is, and who watches it (rl/context.py)
    pool: TrainerPool | None = None  # the rollout engines (`start_pool`, once the policy is warm)
    heldout: list[Problem] = field(default_factory=list)  # data.heldout problems, never trained on
    offload: TrainStateOffload | None = None  # rollout.offload: the actor's state off the GPU while the engine is awake
    kv_scales: KvScaleState | None = None  # the FP8 KV cache's scales when the trainer decides them (rl/kv_scales.py)

    @property
    def is_main(self) -> bool:
        return dist.get_rank() == 0


def resolve_device(cfg: JetRLConfig) -> torch.device:
    if cfg.run.device_type() == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(cfg: JetRLConfig) -> None:
    from megatron_jetrl.actor.parallel import init_parallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.parallel.world_size:
        raise ConfigError(
            f"this run needs parallel.tp * pp * dp = {cfg.parallel.world_size} processes but WORLD_SIZE={world}: "
            "launch it with `bash launch/train_grpo.sh` (it starts the right number) or fix parallel.*"
        )
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    pin_cache_dirs(cfg.run.jit_cache_dir)  # before DeepGEMM or Triton is imported: one cache for trainer and engines
    if cfg.rollout.engine == "vllm":
        pin_vllm_environment(cfg.precision)
    init_parallel(tp=cfg.parallel.tp, pp=cfg.parallel.pp, seed=cfg.run.seed, timeout_minutes=cfg.run.timeout_s / 60)


def pin_vllm_environment(flow: PrecisionFlow) -> None:
    """vLLM's environment for the flow, before anything imports vLLM (the actor's `rollout_kernels` do) and before the
    process group exists. The trainer's collectives keep NCCL's defaults: under `exact_logprobs` above TP 2 both sides
    add the TP ranks' partial sums in rank order themselves (`models.ordered_reduce`), whatever NCCL's algorithm."""
    from megatron_jetrl.rollout.vllm_engine import engine_env, pin_environment

    pin_environment(engine_env(flow))


def _tokenizer(cfg: JetRLConfig, arch: ModelArch):
    from megatron_jetrl.grpo.tokenizer import HFTokenizer, SentencePieceTokenizer, ensure_sentencepiece

    if cfg.model.tokenizer == "hf":
        tok = HFTokenizer(cfg.model.path)
    else:
        path = cfg.run.directory / "tokenizer.model"
        if dist.get_rank() == 0:
            ensure_sentencepiece(path, ArithmeticTask().sft_corpus(SFT_CORPUS, cfg.run.seed), arch.vocab_size)
        dist.barrier()
        tok = SentencePieceTokenizer(path)
    if tok.vocab_size > arch.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {arch.vocab_size}")
    return tok


ENGINE_START_SPARE = 2 << 30
"""Free memory vLLM's start-up check may find missing against the measurement before it (its own NCCL communicators
at rollout TP > 1): the KV cache is sized explicitly, so the utilization only passes that check."""


def start_pool(s: Session) -> TrainerPool:
    """The run's rollout engines (collective), as `s.pool`: rollout.engine=native, `rollout.num_engines` native engines on
    global rank 0; vllm, one vLLM engine per rank (`vllm_pool`). The first sync writes the actor's weights into them."""
    from megatron_jetrl.rollout.native import NativeEngine
    from megatron_jetrl.rollout.pool import RankZeroPool, RolloutPool

    cfg = s.cfg
    if cfg.rollout.engine == "vllm":
        s.pool = vllm_pool(s)
    elif s.is_main:
        engines = [
            NativeEngine(
                s.arch,
                s.flow,
                device=s.device,
                eos_token_ids=[s.tokenizer.eos_id],
                tokenizer=s.tokenizer,
                batch_invariant=s.batch_invariant,
            )
            for _ in range(cfg.rollout.num_engines)
        ]
        s.pool = RankZeroPool(RolloutPool(engines, bucket_bytes=cfg.rollout.bucket_mb << 20))
    else:
        s.pool = RankZeroPool(None)
    return s.pool


def vllm_pool(s: Session):
    """One vLLM engine per rank: it starts on dummy weights from a config-only directory, with the KV cache its share
    of a step can use (at most a fraction of the memory free now)."""
    from megatron_jetrl.rollout.colocated import ColocatedPool, kv_cache_bytes, kv_cache_need, sequences_at_once, turns_note
    from megatron_jetrl.rollout.vllm_engine import VllmEngine, write_model_dir

    r = s.cfg.rollout
    model_dir = s.cfg.run.directory / "rollout_model"
    if s.is_main:
        write_model_dir(model_dir, s.cfg.model.architecture(), s.flow)
    dist.barrier()
    if s.offload is not None:  # the engine starts, and its KV cache is sized, with the state it will never see
        s.offload.release()
        s.offload.drop_fp8_copies()
        torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    later = free - awake_state_to_come(s)
    weights = sum(math.prod(shape) * dtype.itemsize for shape, dtype in expected_tensors(s.arch, s.flow).values()) // r.tp
    max_len = r.window(s.arch.max_position_embeddings)
    groups = dist.get_world_size() // r.tp
    seqs = -(-s.cfg.grpo.prompts_per_step // groups) * r.n  # an engine's share of a step: also bounds its CUDA graph sizes
    element = 1 if s.flow.kv_cache == "fp8" else 2
    kv = int(r.kv_cache_gb * 2**30) or kv_cache_bytes(
        later, weights, r.kv_cache_fraction, kv_cache_need(s.arch, seqs, max_len, r.tp, element)
    )
    try:
        at_once = sequences_at_once(kv, s.arch, seqs, max_len, r.tp, element)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    note = turns_note(kv, seqs, at_once, max_len)
    if note and s.is_main:
        print(f"note: {note}", file=sys.stderr)
    engine = VllmEngine(
        model_dir,
        s.flow,
        tp=r.tp,
        tp_rank=dist.get_rank() % r.tp,
        eos_token_ids=[s.tokenizer.eos_id],
        seed=s.cfg.run.seed,
        kv_cache_memory_bytes=kv,
        gpu_memory_utilization=max(0.05, (free - ENGINE_START_SPARE) / total),
        enforce_eager=r.enforce_eager,
        max_model_len=max_len,
        max_num_seqs=seqs,
        glue=r.glue,
        fused_quant=r.vllm_fused_quant,
    )
    return ColocatedPool(engine, rollout_tp=r.tp, at_once=at_once)


def awake_state_to_come(s: Session) -> int:
    """Bytes of this rank's free memory now that the actor will hold while the engine is awake, so not the KV cache's:
    Adam's moments (made by the first update) and FP8 weight copies not made yet (the policy's at the first sync, the
    reference's at its first forward), less what `rollout.offload` takes off the GPU then."""
    from megatron_jetrl.actor.fp8_layers import fp8_copy_bytes

    what = s.cfg.rollout.offload
    later = 0 if what == "optimizer" else unallocated_state_bytes(s.optimizer)
    if what == "none":
        later += fp8_copy_bytes(s.model, pending=True)
    if s.reference is not None and what != "optimizer":
        later += fp8_copy_bytes(s.reference, pending=True)
    return later


def check_exact_device(flow: PrecisionFlow, device: torch.device) -> None:
    """`precision.exact_logprobs` (jetrl's default at TP 1-2 with vLLM) runs Hopper kernels in the actor: refuse other GPUs
    before anything is built."""
    if flow.exact_logprobs and device.type == "cuda" and torch.cuda.get_device_capability(device) != (9, 0):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(
            f"precision.exact_logprobs runs vLLM's FlashAttention 3 and DeepGEMM's BF16 GEMM in the actor, "
            f"built here for Hopper (sm_90); this GPU is sm_{major}{minor}: set precision.exact_logprobs=false"
        )


def actor_options(cfg: JetRLConfig) -> ActorOptions:
    """How a run of `cfg` (resolved: `rl.resolve`) builds its actor, and the benchmarks theirs."""
    flow = cfg.precision
    par = cfg.parallel
    return ActorOptions(
        spec=cfg.model.spec,
        params_dtype=torch.bfloat16 if cfg.optim.bf16 else torch.float32,
        batch_invariant=cfg.model.batch_invariant,
        fused=cfg.model.fused,
        rollout_kernels=flow.exact_logprobs,
        sequence_parallel=par.sequence_parallel,
        sp_overlap=SPOverlap(par.sp_overlap, par.sp_chunks if par.sp_overlap == "chunks" else 1),
        ordered_reduce=flow.exact_logprobs and par.tp > 2,
        fp8_weight_t=cfg.model.fp8_weight_t,
        pp_last_layers=par.pp_last_layers,
        bf16_linear_weights="release" if cfg.bf16_linears_released() else "keep",
        logprob_graphs=cfg.model.cuda_graphs in ("logprobs", "all"),
        update_graphs=cfg.model.cuda_graphs == "all",
    )


def build_session(cfg: JetRLConfig, run: RunContext) -> Session:
    """Everything the loop needs (collective: every rank calls it)."""
    from megatron_jetrl.actor.fp8_layers import offload_frozen_weights
    from megatron_jetrl.actor.hf_import import init_hf_weights, load_hf_weights
    from megatron_jetrl.rl.resolve import resolve

    device = resolve_device(cfg)
    checkpoints.check_output_space(cfg)
    cfg.model.check_path_matches()
    cfg = resolve(cfg, device.type)  # a no-op on load_config's config, resolved already (batch invariance, GEMM backend, ...)
    arch = cfg.arch()
    flow = cfg.precision
    check_exact_device(flow, device)
    batch_invariant = cfg.model.batch_invariant
    tokenizer = _tokenizer(cfg, arch)
    problems, heldout = problem_sets(cfg)
    check_prompt_room(cfg, arch, tokenizer, problems, heldout)
    sampler = PromptSampler(problems, cfg.grpo.prompts_per_step, seed=cfg.run.seed)

    options = actor_options(cfg)
    model = build_model(arch, flow, options)
    if cfg.model.path:
        load_hf_weights(model, arch, cfg.model.path, spec=cfg.model.spec)
    else:  # the same weights for this seed at every TP, PP and spec
        init_hf_weights(model, arch, cfg.run.seed, spec=cfg.model.spec)
    reference = None
    if cfg.loss.kl_coef > 0:  # its FP8 linears' BF16 weights wait in host memory (only their FP8 bytes run)
        reference = build_model(arch, flow, options).eval().requires_grad_(False)
        offload_frozen_weights(reference)
    ddp, optimizer = wrap_for_training(model, cfg.optim)
    offload = None if cfg.rollout.offload == "none" else TrainStateOffload(ddp, optimizer, cfg.rollout.offload, reference)
    return Session(
        cfg,
        arch,
        flow,
        device,
        batch_invariant,
        tokenizer,
        sampler,
        ddp,
        optimizer,
        reference,
        run,
        heldout=heldout,
        offload=offload,
        kv_scales=KvScaleState.start(arch.num_layers) if flow.trainer_kv_scales else None,
    )


def problem_sets(cfg: JetRLConfig) -> tuple[list[Problem], list[Problem]]:
    """(GRPO problems, held-out problems): data.heldout questions set apart, never trained on (its docstring)."""
    d = cfg.data
    try:
        if d.source not in d.GENERATED:
            return (
                split_heldout(load_problems(d.source, d.path), d.heldout) if d.heldout else (load_problems(d.source, d.path), [])
            )
        task = generated_task(cfg)
        heldout = task.problems(d.heldout, seed=HELDOUT_SEED, distinct=True) if d.heldout else []
        return task.problems(ARITHMETIC_PROBLEMS, seed=cfg.run.seed, exclude=questions(heldout)), heldout
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_prompt_room(cfg: JetRLConfig, arch: ModelArch, tokenizer, problems: list[Problem], heldout: list[Problem]) -> None:
    """Every prompt, GRPO's and the held-out ones, as the rollout encodes it, has room for rollout.max_new_tokens inside
    the sequence window (`RolloutConfig.window`): a longer one is refused here, when the data is built, naming it,
    not in the middle of a step (vLLM refuses the request; the native engine would run positions the model never had)."""
    window, new = cfg.rollout.window(arch.max_position_embeddings), cfg.rollout.max_new_tokens
    named = [*problems, *heldout]
    if not named:
        return
    lengths = [len(tokenizer.encode(format_prompt(p, cfg.data.template))) for p in named]
    worst = max(range(len(named)), key=lengths.__getitem__)
    if lengths[worst] + new > window:
        over = sum(n + new > window for n in lengths)
        kind = "held-out problem" if worst >= len(problems) else "problem"
        limit = f"rollout.max_model_len={window}" if cfg.rollout.engine == "vllm" else f"max_position_embeddings={window}"
        raise ConfigError(
            f"{over} of the {len(named)} prompts leave no room for rollout.max_new_tokens={new} within the "
            f"model's {limit}: the longest, {kind} {named[worst].id}, is {lengths[worst]} tokens; lower "
            f"rollout.max_new_tokens to {max(window - lengths[worst], 0)}"
            + (", raise rollout.max_model_len" if cfg.rollout.engine == "vllm" else "")
            + " or leave the longest prompts out of the data"
        )


def questions(problems: list[Problem]) -> frozenset[str]:
    return frozenset(p.question for p in problems)


def freeze_reference(s: Session) -> None:
    """The reference policy := the actor now (after the warm-start; before any GRPO update)."""
    from megatron_jetrl.actor.fp8_layers import unwrap

    if s.reference is not None:
        s.reference.load_state_dict(unwrap(s.model).state_dict())
