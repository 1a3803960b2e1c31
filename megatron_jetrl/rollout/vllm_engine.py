"""`VllmEngine`: the rollout engine on real vLLM, written against vllm==0.26.0 (read in the wheel's source:
`entrypoints/llm.py`, `v1/executor/uniproc_executor.py`, `v1/worker/gpu_worker.py`, `model_executor/layers/
quantization/fp8.py`, `model_executor/kernels/linear/scaled_mm/deep_gemm.py`, `.../input_quant_fp8.py`).

One engine per torchrun rank (`distributed_executor_backend="external_launcher"`: vLLM runs in this process,
on the process group the trainer already made, with `rollout_tp` consecutive ranks as one vLLM TP group;
`rollout.colocated` arranges the pool). vLLM is imported lazily, only here; everything that does not need
it is plain code tested on CPU (tests/unit/test_rollout_vllm.py), the rest on the GPU (tests/gpu/test_vllm.py).

Numerics are pinned, then checked at start-up, because vLLM's defaults change the trainer's bytes:
- `VLLM_USE_DEEP_GEMM_E8M0` follows the flow's scale mode (on, vLLM re-quantizes FP32 weight scales to
  powers of two at load and rounds activation scales up to powers of two);
- `VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0` (FlashInfer's block GEMM quantizes small batches itself);
- compiled graphs keep the `quant_fp8` custom op (the CUDA kernel `per_token_group_fp8_quant`, equal to
  `quantize_blockwise` byte for byte) and no RMSNorm/SiLU/attention+quant fusion: vLLM's `forward_native`
  and the fused kernels floor the scale at 1/(448*512) instead of flooring amax at 1e-10.
`check_numerics` (`rollout.vllm_checks`) reads back the kernel of every FP8 linear, the E8M0 switch, the compile passes, and runs the
kernels' own activation quantizer on a probe against ours; any difference refuses the engine, naming it.
vLLM's own RMSNorm and RoPE round unlike the trainer's (a fifth of their outputs); `glue="trainer"` (the default,
`resolve_glue`) registers the trainer's (`rollout.vllm_glue`) and probes them at start-up the same way.

Weights never leave the device. The engine starts on dummy weights (`load_format="dummy"`, a config-only
model directory) and every sync -- the first included -- writes the trainer's FP8 bytes, scales and BF16
tensors straight into vLLM's parameters: `copy_plan` (`rollout.vllm_params`) maps each HF tensor to a slice of a fused vLLM
parameter (q/k/v -> qkv_proj, gate/up -> gate_up_proj, this rank's TP piece, vocab rows), after checking that
the live parameter has the checkpoint layout (with E8M0 off, vLLM's DeepGEMM post-processing keeps it) and
that every vLLM parameter is covered (a level-2 sleep discards them all). An update is validated whole before
the first byte is written, and the bytes are compared with the trainer's after the copy (one host sync).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from megatron_jetrl.fp8 import PrecisionFlow
from megatron_jetrl.models import ModelArch
from megatron_jetrl.rollout.engine import Completion, RequestOutput, SamplingParams, request_seeds_for
from megatron_jetrl.rollout.native import WeightUpdateError, collect_batch, expected_tensors, validate_weights
from megatron_jetrl.rollout.sampling import sample_seed
from megatron_jetrl.rollout.sync import Phases
from megatron_jetrl.rollout.vllm_checks import (
    UNFUSED,
    EngineConformanceError,
    check_kv_cache,
    check_numerics,
    exact_problems,
    fp8_kernels,
)
from megatron_jetrl.rollout.vllm_params import apply_plan, attention_layers, copy_plan, kv_scale_params, sync_scale_floats

VLLM_VERSION = "0.26.0"
INSTALL = f"pip install vllm=={VLLM_VERSION}"
# ---- availability and environment -------------------------------------------------------------------


def vllm_problem(device: str) -> str | None:
    """Why `rollout.engine=vllm` cannot run on `device` ('cuda' or 'cpu'; None: it can), without importing vLLM."""
    import importlib.metadata
    import importlib.util

    if device != "cuda":
        return (
            f"rollout.engine=vllm needs a CUDA GPU and this run is on the {device}: set rollout.engine=native, "
            f"or run on a GPU node with vLLM ({INSTALL})"
        )
    if importlib.util.find_spec("vllm") is None:
        return f"rollout.engine=vllm but vLLM is not installed in this environment: {INSTALL}, or set rollout.engine=native"
    try:
        found = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        found = "unknown (no package metadata)"
    if found != VLLM_VERSION:
        return (
            f"rollout.engine=vllm needs vLLM {VLLM_VERSION} (the version its engine is written against), "
            f"found {found}: {INSTALL}, or set rollout.engine=native"
        )
    return None


def engine_env(flow: PrecisionFlow, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment vLLM must see for this flow (`flow.vllm_env()`, FlashInfer's block GEMM off) plus extras."""
    env = dict(flow.vllm_env())
    if flow.rollout_fp8:
        env["VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER"] = "0"
    for key, value in (extra or {}).items():
        if key in env and env[key] != value:
            raise ValueError(
                f"{key}={value!r} contradicts the precision flow, which needs {key}={env[key]!r} "
                "(vLLM would re-quantize the trainer's FP8 weights or quantize activations its own way)"
            )
        env[key] = value
    return env


def pin_environment(env: dict[str, str], environ=None, modules=None) -> None:
    """Write `env` into the process environment before vLLM is imported (its envs are read at import).

    If vLLM is already imported, its environment is read already: refuse unless it already agrees.
    `VLLM_DEEP_GEMM_WARMUP` defaults to `skip` (its full warm-up JIT-compiles ~1600 kernels, > 20 min).
    """
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if "vllm" in modules:
        wrong = {k: (environ.get(k), v) for k, v in env.items() if environ.get(k) != v}
        if wrong:
            raise RuntimeError(
                "vLLM was imported before the precision flow pinned its environment; these differ "
                f"(current, needed): {wrong}. Create the VllmEngine (or call pin_environment) before importing vllm."
            )
        return
    environ.update(env)
    environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")


def write_model_dir(directory: str | Path, hf_config: dict, flow: PrecisionFlow) -> Path:
    """A config-only HF directory vLLM starts from (dummy weights; the first sync writes the real ones)."""
    from megatron_jetrl.convert.converter import rollout_hf_config

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = rollout_hf_config(hf_config, ModelArch.from_hf_config(hf_config), flow)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


# ---- arguments --------------------------------------------------------------------------------------

GLUES = ("auto", "vllm", "trainer")


def resolve_glue(glue: str, arch: ModelArch | None, spec: str = "local") -> str:
    """The rule of `rollout.glue: auto` (a run config's is resolved once, when it loads: `rl.resolve`; an engine built
    with glue="auto" resolves here): the trainer's RMSNorm and RoPE, which cut jetrl's mismatch several times against
    vLLM's (BENCHMARKS.md), except vLLM's for a scaled RoPE (llama3: vLLM builds another class, which
    `rollout.vllm_glue` does not replace) and for an actor of `model.spec=te` (its norms are Transformer Engine's, not
    the local spec's). `arch` None: not known here (no RoPE scaling read)."""
    if glue not in GLUES:
        raise ValueError(f"glue must be one of {GLUES}, got {glue!r}")
    if glue == "auto":
        return "vllm" if (arch is not None and arch.rope_scaling) or spec == "te" else "trainer"
    return glue


def llm_kwargs(
    model_dir: str | Path,
    flow: PrecisionFlow,
    *,
    tensor_parallel_size: int = 1,
    seed: int = 0,
    kv_cache_memory_bytes: int | None = None,
    gpu_memory_utilization: float = 0.9,
    enforce_eager: bool = False,
    max_model_len: int | None = None,
    glue: str = "auto",
    **extra,
) -> dict:
    """Keyword arguments of `vllm.LLM(...)`: colocated SPMD engine, dummy load, the flow's numerics pinned.

    A non-eager engine with the trainer's glue runs no torch.compile (Dynamo does not trace the trainer's kernels) and
    captures full CUDA graphs of decode steps (`FULL_DECODE_ONLY`: vLLM 0.26 supports full graphs without
    compilation; prefill runs eagerly); with vLLM's glue it compiles, with the fusion passes that change bytes off."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    arch = ModelArch.from_hf_config(config)
    if flow.rollout_fp8:
        arch.check_fp8_tp(tensor_parallel_size)
    elif arch.num_kv_heads % tensor_parallel_size:
        raise ValueError(f"TP={tensor_parallel_size} does not divide num_key_value_heads={arch.num_kv_heads}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    kwargs = dict(
        model=str(model_dir),
        dtype="bfloat16",
        seed=seed,
        load_format="dummy",
        skip_tokenizer_init=True,
        quantization="fp8" if flow.rollout_fp8 else None,  # the config's quantization_config (block FP8)
        tensor_parallel_size=tensor_parallel_size,
        distributed_executor_backend="external_launcher",
        enable_sleep_mode=True,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        enforce_eager=enforce_eager,
        max_model_len=max_model_len,
        logprobs_mode="raw_logprobs",  # log_softmax of the logits, as the trainer computes them
        disable_custom_all_reduce=True,  # NCCL for TP > 1: custom all-reduce's IPC buffers are outside the sleep pool
    )
    if flow.exact_logprobs:
        kwargs["disable_cascade_attn"] = True  # (vLLM 0.26's default; a shared prefix's two kernels would differ)
    if flow.kv_cache == "fp8":  # scales: the trainer's, written at every sync, or vLLM's from its first forward
        kwargs["kv_cache_dtype"] = "fp8"
        kwargs["calculate_kv_scales"] = flow.kv_scale_policy == "engine"
    if resolve_glue(glue, arch) == "trainer" and not enforce_eager:
        kwargs["compilation_config"] = {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY", "custom_ops": ["+quant_fp8"]}
    elif flow.rollout_fp8 and not enforce_eager:
        kwargs["compilation_config"] = {"custom_ops": ["+quant_fp8"], "pass_config": dict(UNFUSED)}
    kwargs.update(extra)
    return {k: v for k, v in kwargs.items() if v is not None}


def sampling_kwargs(sampling: SamplingParams, request_seed: int | None, eos_token_ids: Sequence[int] = ()) -> dict:
    """Keyword arguments of `vllm.SamplingParams(...)`: `logprobs=0` returns the sampled token's logprob. The
    model's EOS ids join `stop_token_ids` (without a tokenizer vLLM knows no EOS).

    The seed: vLLM seeds sample j of a request with `seed + j` (`v1/engine/parallel_sampling.py`), and the pool's
    request seeds are consecutive (`seed + prompt index`), so prompt i's sample j + 1 and prompt i + 1's sample j
    would draw the same noise at every step. vLLM gets `sample_seed(request_seed, 0)` instead: sample j's seed is
    then the native engine's (`rollout.sampling.sample_seed`), distinct for every (prompt, sample) below 10^6
    samples a prompt."""
    stop_ids = list(dict.fromkeys([*sampling.stop_token_ids, *([] if sampling.ignore_eos else eos_token_ids)]))
    kwargs = dict(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_new_tokens,
        stop=list(sampling.stop) or None,
        stop_token_ids=stop_ids or None,
        ignore_eos=sampling.ignore_eos,
        logprobs=0,
        seed=None if request_seed is None else sample_seed(request_seed, 0),
    )
    return {k: v for k, v in kwargs.items() if v is not None}


def parse_output(output) -> RequestOutput:
    """A vLLM `RequestOutput` -> ours (token ids, sampled-token logprobs, finish reason, text)."""
    result = RequestOutput(prompt_token_ids=list(output.prompt_token_ids))
    for c in output.outputs:
        ids = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise RuntimeError(
                f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} logprob entries for "
                f"{len(ids)} tokens: was SamplingParams(logprobs=0) passed?"
            )
        lps = []
        for tok, entry in zip(ids, c.logprobs):
            if tok not in entry:
                raise RuntimeError(f"vLLM logprobs lack the sampled token {tok}")
            lps.append(float(entry[tok].logprob))
        result.completions.append(Completion(ids, lps, c.finish_reason or "length", c.stop_reason, c.text or None))
    return result


# ---- the engine -------------------------------------------------------------------------------------


def _driver_model(worker):
    return worker.model_runner.model


class VllmEngine:  # pragma: no cover - needs vLLM and a GPU (tests/gpu/test_vllm.py)
    """`RolloutEngine` over an in-process `vllm.LLM` on this rank (external launcher, one TP rank of one engine)."""

    def __init__(
        self,
        model_dir: str | Path,
        flow: PrecisionFlow,
        *,
        tp: int = 1,
        tp_rank: int = 0,
        eos_token_ids: Sequence[int] = (),
        seed: int = 0,
        env: dict[str, str] | None = None,
        verify_numerics: bool = True,
        glue: str = "auto",
        fused_quant: bool = True,
        **llm_extra,
    ):
        """`verify_numerics=False` skips `check_numerics` and records what vLLM chose: only for benchmarks of vLLM's
        own (fused) numerics (tools/bench/bench_vllm.py --variant fused), never for a rollout that must run the trainer's bytes.
        `glue` (`resolve_glue`): with the trainer's, vLLM runs the trainer's RMSNorm and RoPE (`rollout.vllm_glue`)
        and the engine refuses to start unless layer 0's modules then return the trainer's bytes. `fused_quant`
        (with the trainer's glue, FP8 rollout, FP32 scales; `rollout.vllm_fused_quant`): the norms and SiLU also write
        the FP8 input of the linear after them (`vllm_glue.configure`), checked the same way."""
        problem = vllm_problem("cuda" if torch.cuda.is_available() else "cpu")
        if problem:
            raise RuntimeError(problem)
        self.arch = ModelArch.from_pretrained(model_dir)
        glue = resolve_glue(glue, self.arch)
        pin_environment(engine_env(flow, env))
        import vllm

        from megatron_jetrl.patching import load_patch
        from megatron_jetrl.rollout import vllm_glue

        load_patch("vllm_0_26_0_seeded_sampling").apply()  # seeded requests' noise in one kernel, not one per request

        if flow.exact_logprobs and flow.rollout_fp8:  # (a BF16 rollout runs vLLM's batch-invariant mode: flow.vllm_env)
            load_patch("vllm_0_26_0_one_split_attention").apply()
        if flow.exact_logprobs and flow.kv_cache == "fp8":
            load_patch("vllm_0_26_0_fp8_attention_tile").apply()
        if flow.exact_logprobs and tp > 2:  # the actor sums its row-parallel outputs in rank order too
            load_patch("vllm_0_26_0_ordered_all_reduce").apply()
        if glue == "trainer":
            vllm_glue.register()
            fused = fused_quant and flow.rollout_fp8 and flow.scale_mode == "fp32"
            vllm_glue.configure(flow.eps if fused else None, self.arch.hidden_size)
        elif vllm_glue.registered():
            raise RuntimeError(
                "an engine with vLLM's glue was asked for, but this process registered the trainer's in "
                "vLLM's op registry (global to the process): start it in a fresh process"
            )

        self._vllm = vllm
        self.flow, self.tp, self.tp_rank = flow, tp, tp_rank
        self.eos_token_ids = tuple(eos_token_ids)
        self.specs = expected_tensors(self.arch, flow)
        kwargs = llm_kwargs(model_dir, flow, tensor_parallel_size=tp, seed=seed, glue=glue, **llm_extra)
        self.llm = vllm.LLM(**kwargs)
        self.model = self.llm.collective_rpc(_driver_model)[0]
        core = getattr(self.llm.llm_engine.engine_core, "engine_core", None)  # in-process (the external launcher's)
        self.scheduler = getattr(core, "scheduler", None)
        if self.scheduler is not None:
            load_patch("vllm_0_26_0_preemption_count").apply(self.scheduler)
        if flow.exact_logprobs:
            vllm_glue.use_trainer_lm_head(self.model)
        compilation = self.llm.llm_engine.vllm_config.compilation_config
        compiled, pass_config = int(compilation.mode) != 0, compilation.pass_config  # CompilationMode.NONE == 0
        if verify_numerics:
            self.numerics = check_numerics(self.model, flow, pass_config, compiled=compiled)
        else:
            self.numerics = {
                "verified": False,
                "kernels": sorted({type(k).__name__ for k in fp8_kernels(self.model).values()}),
                "fused_passes": [k for k in UNFUSED if getattr(pass_config, k, False)],
            }
        self.numerics["glue"] = self._check_glue(glue, verify_numerics)
        if flow.exact_logprobs:
            self.numerics["exact_logprobs"] = self._check_exact(glue)
        self.numerics["compilation"] = {"mode": str(compilation.mode), "cudagraph_mode": str(compilation.cudagraph_mode)}
        self.attention = attention_layers(self.model)
        self.numerics["kv_cache"] = check_kv_cache(self.attention, flow)
        self.params = dict(self.model.named_parameters())
        if flow.trainer_kv_scales:  # the trainer's scales land in the buffers vLLM's attention reads
            self.params |= kv_scale_params(self.attention)
        self.plan = copy_plan(self.arch, flow, self.params, tp_rank, tp)
        self.ready = False  # dummy weights until the first complete, verified update
        self.sleeping: set[str] = set()

    def _check_glue(self, glue: str, verify: bool) -> dict:
        """Layer 0's RMSNorm and RoPE against the trainer's functions: the share of outputs that differ, per op.
        With the trainer's glue any difference refuses the engine (the registry did not take, or a model uses
        another class, e.g. llama3's scaled RoPE)."""
        from megatron_jetrl.rollout import vllm_glue

        layer = self.model.model.layers[0]
        device = next(self.model.parameters()).device
        shares = vllm_glue.probe(layer, self.arch, device)
        if glue == "trainer" and verify and any(shares.values()):
            raise EngineConformanceError(
                "vLLM does not run the trainer's glue although rollout.glue=trainer: outputs that differ from the "
                f"trainer's functions {shares} (modules {type(layer.input_layernorm).__name__}, "
                f"{type(layer.self_attn.rotary_emb).__name__})"
            )
        fused = None
        if glue == "trainer" and getattr(layer.input_layernorm, "quant_eps", None) is not None:
            fused = vllm_glue.probe_fused(layer, self.arch, device)
            if verify and (fused["mlp_took_stash"] != 1.0 or any(v for k, v in fused.items() if k != "mlp_took_stash")):
                raise EngineConformanceError(
                    "the FP8 activation quantization fused into vLLM's norm and SiLU does not give the quantizer's bytes "
                    f"or is not taken by the linear ({fused}): run with rollout.vllm_fused_quant=false and report this"
                )
        return {"mode": glue, "differ": shares, "fused_quant": fused}

    def _check_exact(self, glue: str) -> dict:
        """`exact_problems` read back from this engine; any refuses it."""
        impls = {name: m.impl for name, m in self.model.named_modules() if hasattr(m, "impl") and hasattr(m, "kv_cache")}
        config = self.llm.llm_engine.vllm_config
        method = type(getattr(self.model.lm_head, "quant_method", None)).__name__
        one_split = bool(impls) and all(getattr(i, "batch_invariant_enabled", False) for i in impls.values())
        from megatron_jetrl.patching import load_patch

        ordered = self.tp <= 2 or load_patch("vllm_0_26_0_ordered_all_reduce").applied()
        problems = exact_problems(
            impls,
            one_split,
            bool(config.model_config.disable_cascade_attn),
            glue,
            method,
            bool(config.use_v2_model_runner),
            ordered,
        )
        if problems:
            raise EngineConformanceError(
                "precision.exact_logprobs: vLLM would not compute the actor's bytes:\n  - " + "\n  - ".join(problems)
            )
        return {
            "attention": sorted({type(i).__name__ for i in impls.values()}),
            "layers": len(impls),
            "lm_head": method,
            "one_split": "process-wide batch-invariant mode" if not self.flow.rollout_fp8 else "attention backend only",
            "all_reduce": "rank order" if self.tp > 2 else "two partial sums (any order)" if self.tp == 2 else "none",
        }

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | None = None,
        *,
        request_seeds: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        sampling = sampling or SamplingParams()
        if not self.ready or self.sleeping:
            raise WeightUpdateError(
                "the vLLM engine holds no complete, verified weights (asleep, or the last update "
                "failed): sync the trainer's weights first"
            )
        if sampling.stop:
            raise ValueError("stop strings need vLLM's tokenizer, which the colocated engine does not load: use stop_token_ids")
        if request_seeds is None:
            request_seeds = request_seeds_for(sampling, len(prompts))
        seeds = list(request_seeds) if request_seeds is not None else [None] * len(prompts)
        params = [self._vllm.SamplingParams(**sampling_kwargs(sampling, s, self.eos_token_ids)) for s in seeds]
        requests = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        except Exception as e:
            raise RuntimeError(f"the vLLM engine failed while generating ({type(e).__name__}: {e})") from e
        results = [parse_output(o) for o in outputs]
        for r, s in zip(results, seeds):
            r.request_seed = s
        return results

    def kv_cache_blocks(self) -> tuple[int, int] | None:
        """(blocks, tokens a block) of the engine's KV cache, as vLLM sized it (None: not an in-process engine core)."""
        cache = getattr(self.scheduler, "cache_config", None)
        if cache is None or not cache.num_gpu_blocks:
            return None
        return int(cache.num_gpu_blocks), int(cache.block_size)

    def preemptions(self) -> int | None:
        """Requests the scheduler has preempted since the engine started (None: not an in-process engine core)."""
        return getattr(self.scheduler, "jetrl_preemptions", None)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], phases: Phases | None = None) -> dict:
        """The whole model: validated first (nothing written if refused), copied on the device, bytes compared.
        `phases` (a `Phases`) gets the seconds of each part: stream (pulling `weights`: the trainer's quantization
        and gathers), validate, copy (and compare)."""
        phases = Phases("sync/", "_s") if phases is None else phases
        with phases("stream"):
            batch = collect_batch(weights)
        with phases("validate"):
            problems = validate_weights(self.specs, batch, require_complete=True, family=self.arch.family)
        if problems:
            raise WeightUpdateError("refused a weight update; nothing was written:\n  - " + "\n  - ".join(problems[:20]))
        self.ready = False
        with phases("copy"):
            differ = apply_plan(self.arch, self.plan, self.params, batch, self.tp_rank, self.tp)
        if differ:
            raise WeightUpdateError(
                f"after the copy, vLLM's bytes differ from the trainer's in {len(differ)} tensor(s): "
                f"{differ[:5]}; the engine refuses to generate until a complete update lands"
            )
        if self.flow.trainer_kv_scales:
            sync_scale_floats(self.attention)
        self.ready = True
        if "kv_cache" not in self.sleeping:
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        return {"tensors": len(batch), "bytes": sum(t.numel() * t.element_size() for t in batch.values())}

    def mapped_bytes(self) -> int:
        """Device bytes this engine holds through vLLM's sleep-mode allocator (weights, KV cache): what a level-2 sleep
        releases and a full wake maps again. Read from the allocator, not from free memory: vLLM's sleep also runs
        `torch.cuda.empty_cache()`, which hands back the trainer's cached blocks too (5.4 GiB mapped against 14.5
        GiB more free memory at 1.5B, H100)."""
        return sum(data.handle[1] for data in _allocations())

    def unmapped_bytes(self) -> int:
        """Device bytes of this engine's allocations that sleep now: unmapped, yet still counted by torch's caching
        allocator (their tensors live on in vLLM's memory pool)."""
        return sum(data.handle[1] for data in _allocations() if data.is_asleep)

    def sleep(self) -> None:
        """Level 2: weights and KV cache are discarded (the next sync rewrites every weight)."""
        if not self.sleeping:
            self.llm.sleep(level=2)
            self.sleeping, self.ready = {"weights", "kv_cache"}, False

    def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Map the memory of the tags that sleep (vLLM maps a tag twice if asked while it is awake)."""
        tags = [t for t in tags if t in self.sleeping]
        if tags:
            self.llm.wake_up(tags)
            self.sleeping -= set(tags)
            if "kv_cache" in tags:
                self.llm.reset_prefix_cache()


def _allocations():  # pragma: no cover - needs vLLM
    """Every allocation of vLLM's sleep-mode allocator (one engine a process): its handle (size second) and state."""
    from vllm.device_allocator.cumem import CuMemAllocator

    return CuMemAllocator.get_instance().pointer_to_data.values()
