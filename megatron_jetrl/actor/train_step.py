"""One optimizer step of the actor through megatron's `forward_backward_func`, with a logprob loss callback.

`wrap_for_training` puts the GPTModel under megatron DDP and builds megatron's optimizer: BF16 params with FP32
main params, replicated or distributed (ZeRO-1) over DP (on CPU through patches/megatron_core_0_16_1_cpu.py).
`train_step` runs the micro-batches (pipeline schedule included) and the step; the loss callback sees the
per-token logprobs `[b, s-1]` of each micro-batch (GRPO builds its clipped loss from them). After the step
the FP8 weights are re-quantized lazily on the next forward (`fp8_layers.fp8_weights` returns them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_jetrl.actor.layer_graphs import autograd_stream
from megatron_jetrl.actor.logprobs import forward_step_func, micro_batches, pad_length, run_schedule, sequence_multiple
from megatron_jetrl.actor.optim_config import OptimConfig
from megatron_jetrl.actor.wgrad_fusion import fuse_wgrad_accumulation
from megatron_jetrl.fp8 import finite
from megatron_jetrl.fp8.gemm import token_multiple
from megatron_jetrl.patching import load_patch

LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


class NonFiniteError(FloatingPointError):
    """A NaN/Inf reached the loss or the gradients; the optimizer step was not taken."""


def wrap_for_training(model, optim: OptimConfig | None = None):
    """(megatron DDP-wrapped model, megatron optimizer) for `model` (a GPTModel of this stage); `optim` defaults to
    `OptimConfig()`."""
    optim = OptimConfig() if optim is None else optim
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = model.config
    with autograd_stream(model):  # update graphs: the gradient accumulators DDP makes live on the graphs' stream
        ddp = DistributedDataParallel(
            config=config,
            module=model,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=optim.distributed
            ),
        )
    config.finalize_model_grads_func = finalize_model_grads
    load_patch("megatron_core_0_16_1_grad_clip_scale").apply()  # clipping scales the gradients in place, in one pass
    if optim.wgrad_fusion and torch.cuda.is_available():
        fuse_wgrad_accumulation(ddp)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2,
            clip_grad=optim.clip_grad,
            bf16=optim.bf16,
            use_distributed_optimizer=optim.distributed,
        ),
        [ddp],
    )
    use_fused_adam(optimizer, optim.fused)
    return ddp, optimizer


def copy_main_params_to_weights(optimizer) -> None:
    """The BF16 weights written from the optimizer's FP32 main params, as megatron 0.16.1's mixed-precision optimizer
    does after a step (its `_copy_main_params_to_model_params`): the bits the weights had, since each step leaves
    weight = bf16(main param)."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        o._copy_main_params_to_model_params()


def unallocated_state_bytes(optimizer) -> int:
    """Bytes that Adam's two moments will take on this rank when the first step allocates them (0 once they exist; this
    rank's ZeRO-1 shard under the distributed optimizer): memory free now that will not be free later, which a
    colocated engine sizing its KV cache at start-up must leave to the trainer."""
    total = 0
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(o, "optimizer", o)
        for group in getattr(inner, "param_groups", []):
            total += sum(2 * p.numel() * p.element_size() for p in group["params"] if not inner.state.get(p))
    return total


def _torch_adams(optimizer) -> list:
    """The torch Adam/AdamW inside megatron's (chained) optimizer whose params all live on CUDA in FP32."""
    found = []
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(o, "optimizer", None)
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):  # not TE's or apex's FusedAdam: fused already
            params = [p for group in inner.param_groups for p in group["params"]]
            if params and all(p.is_cuda and p.dtype == torch.float32 for p in params):
                found.append(inner)
    return found


def adam_is_fused(optimizer) -> bool:
    return any(group.get("fused") for inner in _torch_adams(optimizer) for group in inner.param_groups)


def use_fused_adam(optimizer, fused: bool = True) -> None:
    """Step megatron's torch Adam on CUDA as torch's fused Adam (`fused`) or in its foreach form.

    The foreach Adam makes seven passes over the FP32 state (about 72 bytes per parameter read and written); the
    fused kernel reads and writes each tensor once (28 bytes), so the optimizer step moves 2.5x fewer bytes. The same update up to FP32 rounding. Call it again after loading a
    state (a checkpoint brings its own flags): the step counters move to where the kernel wants them, the
    parameters' device for fused, the CPU for foreach."""
    for inner in _torch_adams(optimizer):
        for group in inner.param_groups:
            group["fused"], group["foreach"] = fused, not fused
        for p, state in inner.state.items():
            if "step" in state:
                state["step"] = state["step"].to(device=p.device if fused else "cpu", dtype=torch.float32)


def _grads(ddp_model) -> list[tuple[str, torch.Tensor]]:
    """This rank's (DDP main) gradients by parameter name."""
    named = []
    for name, p in ddp_model.module.named_parameters():
        grad = getattr(p, "main_grad", None)
        grad = p.grad if grad is None else grad
        if grad is not None:
            named.append((name, grad))
    return named


def _all_finite(out: list[dict], grads, watch) -> torch.Tensor:
    """One device bool for loss/metrics, gradients and the FP8 quantizer record together: no host sync."""
    parts = []
    if values := [torch.isfinite(v).all() for o in out for v in o.values()]:
        parts.append(torch.stack(values).all())
    if grads:  # one multi-tensor read of every gradient: an L1 norm is finite when every element is (or the sum
        # overflowed FP32 at 3.4e38, which _check_finite's exact look then clears); isfinite per tensor made 5 passes
        norms = torch._foreach_norm([g for _, g in grads], 1)
        parts.append(torch.isfinite(torch.stack([n.float() for n in norms])).all())
    if (quantized := watch.finite()) is not None:
        parts.append(quantized)
    device = parts[0].device if parts else None
    return torch.stack([p.to(device) for p in parts]).all() if parts else torch.tensor(True)


def _check_finite(ddp_model, out: list[dict], on_nonfinite: str, watch) -> str | None:
    """Collective, one host sync when all is well: None when loss, gradients and every FP8 quantizer input were
    finite on every rank; else what was not, on which ranks (every rank gets the same text), or NonFiniteError
    when `on_nonfinite="raise"`."""
    grads = _grads(ddp_model)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else None
    flag = (~_all_finite(out, grads, watch)).float().reshape(1).to(device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if not flag.item():
        return None
    # the rare path: name what is not finite (syncs allowed)
    local = sorted({k for o in out for k, v in o.items() if not bool(torch.isfinite(v).all())})
    bad = [name for name, g in grads if not bool(torch.isfinite(g).all())]
    quantizer = watch.first_problem()
    parts = (
        ([f"{local} from the loss callback"] if local else [])
        + ([f"the gradients of {bad[:3]}{' ...' if len(bad) > 3 else ''}"] if bad else [])
        + ([f"the FP8 quantizer input {quantizer}"] if quantizer else [])
    )
    mine = f"rank {torch.distributed.get_rank()}: NaN/Inf in {' and in '.join(parts)}" if parts else None
    reports = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(reports, mine)  # only on this rare path: every rank names every bad rank
    where = "; ".join(r for r in reports if r)
    if not where:  # a gradient's L1 norm overflowed, all finite: nothing to refuse
        return None
    if on_nonfinite == "raise":
        raise NonFiniteError(f"{where}; the optimizer step was not taken (run.on_nonfinite=skip skips such steps instead)")
    return where


def train_step(
    ddp_model,
    optimizer,
    tokens: torch.Tensor,
    loss_fn: LossFn,
    *,
    vocab_size: int,
    micro_batch_size: int,
    extras: dict | None = None,
    temperature: float = 1.0,
    on_nonfinite: str = "raise",
) -> dict:
    """Forward/backward over this DP rank's `tokens[B, S]` in micro-batches, then one optimizer step.

    `loss_fn(logprobs[b, s-1], extras_of_micro_batch) -> (scalar loss, {name: scalar})`: megatron divides each
    micro-batch loss by the number of micro-batches, and DDP averages grads over DP ranks. `extras` are
    per-sample tensors (leading dim B), e.g. advantages, old logprobs, response masks. Where FP8 linears train on a GPU
    (and, under sequence parallelism, to a multiple of the TP size everywhere)
    the sequences are first lengthened to whole 128-token blocks per micro-batch (`pad_length`, masked out of the loss;
    `fp8.gemm.token_multiple`): WGrad, which reduces over tokens, then runs on the bytes the quantizers wrote, not a
    padded copy, and the backward's quantizers on their CUDA tile kernel.
    Returns {"ok", "grad_norm", and on the last stage "loss" and each metric: the mean over micro-batches and
    DP ranks}. NaN/Inf in a returned loss/metric, in any gradient or at any FP8 quantizer input (found on the
    device, `megatron_jetrl.fp8.finite`; one host sync for all of it): `on_nonfinite="raise"` raises
    `NonFiniteError` naming rank and tensors, `"skip"` returns {"ok": False, "skipped": <where>} -- either
    way before the optimizer step, so the weights are untouched.
    """
    from megatron.core import parallel_state as ps

    from megatron_jetrl.actor.fp8_layers import release_bf16_weights, requantize_weights, restore_bf16_weights, trains_fp8_on_cuda

    # whole 128-token blocks per micro-batch where FP8 trains on a GPU (WGrad and the tile quantizers' fast paths), and
    # a length the TP ranks split evenly under sequence parallelism
    shards = sequence_multiple(ddp_model)
    tokens, extras = pad_length(
        tokens, extras, token_multiple(micro_batch_size, shards) if trains_fp8_on_cuda(ddp_model) else shards
    )
    micro = micro_batches(tokens, extras, micro_batch_size)
    ddp_model.train()
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    try:
        with finite.watch() as watch:  # FP8 quantizer inputs, recorded on the device (PrecisionFlow.check_finite="step")
            release_bf16_weights(ddp_model)  # FP8 linears built to run the step on their FP8 bytes alone (quantized here)
            out = run_schedule(ddp_model, micro, forward_step_func(vocab_size, temperature, loss_fn), forward_only=False)
        problem = _check_finite(ddp_model, out or [], on_nonfinite, watch)
        if problem is not None:
            return {"ok": False, "skipped": problem, "grad_norm": None}
        rewrite = restore_bf16_weights(ddp_model)  # the step below writes them from the FP32 main params
        ok, grad_norm, _ = optimizer.step()
        if rewrite and not ok:  # megatron skipped the step and its copy
            copy_main_params_to_weights(optimizer)
    finally:
        if restore_bf16_weights(ddp_model):  # a skipped step or an error: the weights as they were
            copy_main_params_to_weights(optimizer)
    requantize_weights(ddp_model)  # the optimizer wrote the new weights through param.data
    result = {"ok": bool(ok), "grad_norm": None if grad_norm is None else float(grad_norm)}
    if out:
        names = sorted(out[0])
        means = torch.stack([torch.stack([o[k] for o in out]).mean() for k in names])
        torch.distributed.all_reduce(means, group=ps.get_data_parallel_group())
        result.update(zip(names, (means / ps.get_data_parallel_world_size()).tolist()))
    return result
