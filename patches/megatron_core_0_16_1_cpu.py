"""Run megatron-core **0.16.1** on CPU over gloo (runtime monkeypatch).

Targets exactly ``megatron-core==0.16.1`` (``megatron.core.package_info.__version__``);
``apply()`` refuses any other version, because every change below replaces or
wraps a specific upstream function whose body was read from that release.
``apply()`` is idempotent and is a no-op when ``torch.cuda.is_available()``:
on a GPU megatron-core runs unmodified.

Nothing in site-packages is edited; every change is an attribute assignment made
at runtime (``revert()`` undoes them), and only these -- each found by running GPTModel
TP1/TP2/PP2/DP2 training with megatron DDP + optimizer on a CPU-only torch
(tests/unit/test_megatron_cpu.py):

1. ``tensor_parallel.random.CudaRNGStatesTracker.add`` / ``.fork`` -- upstream
   reads/writes the CUDA generator (``torch.cuda.get_rng_state``,
   ``_set_cuda_rng_state``), which raises without CUDA.  Replaced by versions
   that keep one torch *CPU* generator state per name and swap it into
   ``torch.default_generator`` inside ``fork()``.  Same names, seeds and
   bookkeeping as upstream, so TP ranks get different ``model-parallel-rng``
   streams (seed + 2718 + tp_rank) for dropout and GPU-style init, while the
   default stream is equal across TP ranks, exactly as megatron intends.  The
   upstream "CPU RNG state changed within GPU RNG context" warning is dropped:
   on CPU changing that state is what ``fork()`` does.
2. ``tensor_parallel.random.model_parallel_cuda_manual_seed`` (and its re-export
   ``megatron.core.tensor_parallel.model_parallel_cuda_manual_seed``) -- upstream
   seeds the default stream with ``torch.cuda.manual_seed``, which a CPU-only
   torch silently queues and never applies.  Replacement: upstream body with
   ``torch.default_generator.manual_seed``.
3. The module-global name ``torch`` in the modules of ``_CUDA_DEVICE_MODULES``
   is replaced by a proxy of ``torch`` that differs only in:
   ``torch.cuda.current_device()`` returns ``torch.device("cpu")``,
   ``torch.cuda.synchronize()`` is a no-op, and tensor factories
   (``empty/zeros/ones/full/tensor/...``) map a CUDA ``device=`` to CPU.
   Reason: those modules hard-code ``device="cuda"`` or
   ``device=torch.cuda.current_device()`` in code every CPU step hits (the
   per-module comment in ``_CUDA_DEVICE_MODULES`` says where), incl.
   ``GlobalMemoryBuffer.get_tensor`` in ``megatron.core.utils``, the token
   counter of every ``forward_backward_*`` schedule, and the p2p shape/receive
   buffers plus ``torch.cuda.synchronize()`` after ``batch_isend_irecv``.
   Scoped to those modules: the real ``torch`` module and every other module
   are untouched.  (One proxy instead of copying ~10 upstream functions.)
4. ``optimizer.clip_grads.clip_grad_by_total_norm_fp32`` (and the copy imported
   into ``optimizer.optimizer``) -- asserts
   ``param.grad.type() == 'torch.cuda.FloatTensor'``, false for a CPU fp32 grad.
   Replacement: upstream body with the check on ``dtype == float32``.

5. ``LanguageModule.setup_embeddings_and_output_layer`` -- with tied embeddings
   and PP > 1 it moves the shared weight with ``weight.data = weight.data.cuda()``
   before all-reducing it over the embedding group, which raises without CUDA
   (GPTModel's constructor calls it; found by megatron_jetrl's tied Qwen2 PP2 test,
   tests/unit/test_actor_parallel.py). Wrapped: upstream runs unchanged with
   ``torch.Tensor.cuda`` mapped to the identity for the duration of that one call.

6. ``optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__`` and
   ``optimizer.distrib_optimizer.DistributedOptimizer.__init__`` -- sort parameters into
   BF16/FP16 params (which get FP32 main copies) and FP32 params by ``param.type()`` against
   ``'torch.cuda.*Tensor'`` names and raise for anything else, so BF16 params with FP32 main
   params (the actor's GPU configuration, and the one whose BF16 forward the rollout engine
   reproduces bit for bit) and the distributed (ZeRO-1) optimizer are refused on CPU. Wrapped:
   upstream runs unchanged with ``Tensor.type()`` (no arguments, CPU tensor) answering the CUDA
   name of the same dtype for the duration of that one call; the steps need nothing else
   (change 3 covers their ``device='cuda'`` buffers; gloo has the reduce-scatter and
   all-gather-into-tensor the distributed optimizer's buffers use).

Not patched (not needed for the tested paths; they still fail on CPU): activation
recompute (``CheckpointFunction`` calls the CUDA RNG getters), ``enable_autocast``
(``torch.autocast("cuda")``), CUDA graphs, TE, inference dynamic batching,
symmetric-memory buffers.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from typing import Any

import torch

TARGET_VERSION = "0.16.1"

# Modules whose global ``torch`` is replaced by the CPU-device proxy (change 3).
# Found by running; each hard-codes a CUDA device in code that the CPU paths hit.
_CUDA_DEVICE_MODULES = (
    "megatron.core.pipeline_parallel.schedules",  # device="cuda" token counter
    "megatron.core.pipeline_parallel.p2p_communication",  # current_device(), synchronize()
    "megatron.core.optimizer.clip_grads",  # device='cuda' norm buffers
    "megatron.core.distributed.param_and_grad_buffer",  # current_device() DDP param/grad buffers
    "megatron.core.optimizer.optimizer",  # device='cuda' loss-scale / found-inf tensors
    "megatron.core.optimizer.distrib_optimizer",  # current_device() optimizer-state shards (parameter-state load)
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # inv_freq.to(current_device())
    "megatron.core.tensor_parallel.layers",  # current_device() weights (use_cpu_initialization=False)
    "megatron.core.tensor_parallel.mappings",  # current_device() all-gather outputs (logits gather)
    "megatron.core.transformer.utils",  # get_default_causal_mask: device="cuda"
    # local_multi_tensor_l2_norm (grad norm without apex): device="cuda";
    # GlobalMemoryBuffer.get_tensor (sequence-parallel all-gather buffer): current_device()
    "megatron.core.utils",
)

_APPLIED = False
_ORIGINALS: dict[tuple[Any, str], Any] = {}

_FACTORIES = frozenset(
    {
        "empty",
        "zeros",
        "ones",
        "full",
        "tensor",
        "as_tensor",
        "arange",
        "rand",
        "randn",
        "randint",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
    }
)
_CPU = torch.device("cpu")


class MegatronVersionError(RuntimeError):
    """Installed megatron-core is not the version this patch was written for."""


def installed_version() -> str:
    """Version string of the installed megatron-core."""
    from megatron.core import package_info

    return str(package_info.__version__)


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:0"``, int ordinal, torch.device) to CPU."""
    if device is None:
        return None
    if isinstance(device, int):  # a CUDA ordinal, e.g. from torch.cuda.current_device()
        return _CPU
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return _CPU
    return device


def _wrap_factory(fn):
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    factory.__name__ = getattr(fn, "__name__", "factory")
    factory.__wrapped__ = fn
    return factory


class _CudaOnCpu(types.ModuleType):
    """``torch.cuda`` seen from a patched megatron module: current device is the CPU."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """``torch`` seen from a patched megatron module: CUDA device specs land on CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        for name in _FACTORIES:
            setattr(self, name, _wrap_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


# --- change 1: CPU RNG tracker -------------------------------------------------------------


def _tracker_add(self, name, seed):
    """Track a CPU generator state seeded with ``seed`` under ``name`` (upstream semantics)."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cpu rng state {name} already exists")
    orig_rng_state = torch.get_rng_state()
    torch.default_generator.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig_rng_state)


def _make_tracker_fork(default_name: str):
    @contextlib.contextmanager
    def fork(self, name=default_name):
        """Swap the CPU generator to the ``name`` stream, run, save it back and restore."""
        if name not in self.states_:
            raise Exception(f"cpu rng state {name} is not added")
        orig_rng_state = torch.get_rng_state()
        orig_state_name = self._current_state_name
        if orig_state_name != "default-rng":
            self.states_[orig_state_name] = orig_rng_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise Exception(
                    f"current state name {self._current_state_name} is not the same as the desired state name {name}."
                )
            self.states_[name] = torch.get_rng_state()
            if orig_state_name != "default-rng":
                orig_rng_state = self.states_[orig_state_name]
            torch.set_rng_state(orig_rng_state)
            self._current_state_name = orig_state_name

    return fork


def _make_manual_seed(random_mod):
    def model_parallel_cuda_manual_seed(
        seed: int,
        te_rng_tracker: bool = False,
        inference_rng_tracker: bool = False,
        use_cudagraphable_rng: bool = False,
        tp_rank=None,
        ep_rank=None,
        etp_rank=None,
        force_reset_rng: bool = False,
    ):
        """CPU version of megatron's ``model_parallel_cuda_manual_seed`` (same seeds/streams)."""
        if te_rng_tracker or use_cudagraphable_rng:
            raise RuntimeError("megatron CPU patch: TE / cudagraph-safe RNG trackers are CUDA-only")
        if tp_rank is None:
            tp_rank = random_mod.get_tensor_model_parallel_rank()
        if ep_rank is None:
            ep_rank = random_mod.get_expert_model_parallel_rank()
        if etp_rank is None:
            etp_rank = random_mod.get_expert_tensor_parallel_rank()
        offset = seed + 2718
        tensor_model_parallel_seed = offset + tp_rank
        data_parallel_seed = seed

        random_mod.initialize_rng_tracker(
            te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset=force_reset_rng
        )
        tracker = random_mod._CUDA_RNG_STATE_TRACKER
        tracker.reset()
        # Upstream: torch.cuda.manual_seed(data_parallel_seed). On CPU the default stream is
        # torch's default CPU generator.
        torch.default_generator.manual_seed(data_parallel_seed)
        tracker.add(random_mod._DATA_PARALLEL_RNG_TRACKER_NAME, data_parallel_seed)
        tracker.add(random_mod._MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_model_parallel_seed)
        expert_parallel_seed = seed + 1024 + 100 * ep_rank + etp_rank
        tracker.add(random_mod._EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_parallel_seed)

    return model_parallel_cuda_manual_seed


# --- change 4: grad clipping type check ----------------------------------------------------


def _make_clip_grad_by_total_norm_fp32(clip_mod):
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        """Upstream body; the grad check is ``dtype == float32`` instead of a CUDA type name."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        grads = []
        for param in parameters:
            if use_decoupled_grad:
                if getattr(param, "decoupled_grad", None) is not None:
                    assert param.decoupled_grad.dtype in [torch.float32, torch.bfloat16]
                    grads.append(clip_mod.to_local_if_dtensor(param.decoupled_grad).detach())
            elif param.grad is not None:
                assert param.grad.dtype == torch.float32, param.grad.type()
                grads.append(clip_mod.to_local_if_dtensor(param.grad).detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device=_CPU)
            clip_mod.multi_tensor_applier(clip_mod.multi_tensor_scale_impl, dummy_overflow_buf, [grads, grads], clip_coeff)

    return clip_grad_by_total_norm_fp32


# --- change 5: tied-embedding setup without .cuda() ---------------------------------------


def _make_setup_embeddings(orig):
    def setup_embeddings_and_output_layer(self):
        """Upstream, with ``Tensor.cuda`` the identity while it runs (CPU: the weight stays on CPU)."""
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *args, **kwargs: t
        try:
            return orig(self)
        finally:
            torch.Tensor.cuda = cuda

    setup_embeddings_and_output_layer.__wrapped__ = orig
    return setup_embeddings_and_output_layer


# --- change 6: BF16 params + FP32 main params, the distributed optimizer ---------------------


def _with_cuda_type_names(orig):
    def __init__(self, *args, **kwargs):
        """Upstream, with ``Tensor.type()`` of a CPU tensor named like its CUDA twin while it runs."""
        type_name = torch.Tensor.type

        def cuda_named(t, *a, **k):
            name = type_name(t, *a, **k)
            if a or k or t.is_cuda:
                return name
            return name.replace("torch.", "torch.cuda.", 1)

        torch.Tensor.type = cuda_named
        try:
            return orig(self, *args, **kwargs)
        finally:
            torch.Tensor.type = type_name

    __init__.__wrapped__ = orig
    return __init__


# --- apply ---------------------------------------------------------------------------------


def _set(obj: Any, attr: str, value: Any) -> None:
    key = (obj, attr)
    if key not in _ORIGINALS:
        _ORIGINALS[key] = getattr(obj, attr)
    setattr(obj, attr, value)


def is_applied() -> bool:
    return _APPLIED


def apply() -> bool:
    """Patch megatron-core 0.16.1 for CPU/gloo. Returns True if patches are (now) active.

    No-op (returns False) when CUDA is available. Raises ``MegatronVersionError`` when the
    installed megatron-core is not 0.16.1. Safe to call any number of times.
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    version = installed_version()
    if version != TARGET_VERSION:
        raise MegatronVersionError(
            f"patches/megatron_core_0_16_1_cpu.py targets megatron-core=={TARGET_VERSION} but "
            f"megatron-core=={version} is installed; its CPU patches replace upstream function "
            f"bodies of that exact release. Install megatron-core=={TARGET_VERSION} or write "
            f"a new patch for {version}."
        )
    if _APPLIED:
        return True

    random_mod = importlib.import_module("megatron.core.tensor_parallel.random")
    tp_pkg = importlib.import_module("megatron.core.tensor_parallel")
    clip_mod = importlib.import_module("megatron.core.optimizer.clip_grads")
    optimizer_mod = importlib.import_module("megatron.core.optimizer.optimizer")

    # 1. RNG tracker on the CPU generator.
    tracker_cls = random_mod.CudaRNGStatesTracker
    _set(tracker_cls, "add", _tracker_add)
    _set(tracker_cls, "fork", _make_tracker_fork(random_mod._MODEL_PARALLEL_RNG_TRACKER_NAME))
    # 2. Seeding.
    seed_fn = _make_manual_seed(random_mod)
    _set(random_mod, "model_parallel_cuda_manual_seed", seed_fn)
    _set(tp_pkg, "model_parallel_cuda_manual_seed", seed_fn)
    # 3. Hard-coded CUDA devices in selected modules.
    proxy = _TorchOnCpu()
    for name in _CUDA_DEVICE_MODULES:
        _set(importlib.import_module(name), "torch", proxy)
    # 4. Grad clipping type check.
    clip_fn = _make_clip_grad_by_total_norm_fp32(clip_mod)
    _set(clip_mod, "clip_grad_by_total_norm_fp32", clip_fn)
    _set(optimizer_mod, "clip_grad_by_total_norm_fp32", clip_fn)
    # 5. Tied embeddings across pipeline stages.
    language_module = importlib.import_module("megatron.core.models.common.language_module.language_module").LanguageModule
    _set(
        language_module,
        "setup_embeddings_and_output_layer",
        _make_setup_embeddings(language_module.setup_embeddings_and_output_layer),
    )

    # 6. BF16 params with FP32 main params; the distributed optimizer.
    f16 = optimizer_mod.Float16OptimizerWithFloat16Params
    _set(f16, "__init__", _with_cuda_type_names(f16.__init__))
    dist_opt = importlib.import_module("megatron.core.optimizer.distrib_optimizer").DistributedOptimizer
    _set(dist_opt, "__init__", _with_cuda_type_names(dist_opt.__init__))

    _APPLIED = True
    return True


def revert() -> None:
    """Undo ``apply()`` (restores every replaced attribute). Mainly for tests."""
    global _APPLIED
    for (obj, attr), value in reversed(list(_ORIGINALS.items())):
        setattr(obj, attr, value)
    _ORIGINALS.clear()
    _APPLIED = False
