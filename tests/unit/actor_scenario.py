"""The per-rank scenario of tests/unit/test_actor_parallel.py (runs inside spawned gloo ranks)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from actor_helpers import CONFIGS, tokens_for

VOCAB = CONFIGS["qwen3"]["vocab_size"]
LR, STEPS, MICRO = 1e-3, 3, 2


def _build(
    family: str,
    mode: str,
    ckpt_root: str,
    sequence_parallel: bool = False,
    bf16_linear_weights: str = "keep",
    params_dtype: torch.dtype = torch.float32,
):
    from megatron_jetrl.actor.hf_import import load_hf_weights
    from megatron_jetrl.actor.provider import ActorOptions, build_model
    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.models.arch import ModelArch

    arch = ModelArch.from_hf_config(CONFIGS[family])
    flow = PrecisionFlow(mode=mode, backend="emulated")
    model = build_model(
        arch,
        flow,
        ActorOptions(sequence_parallel=sequence_parallel, bf16_linear_weights=bf16_linear_weights, params_dtype=params_dtype),
    )
    load_hf_weights(model, arch, Path(ckpt_root) / family)
    return model, arch, flow


def _full_logits(model, tokens):
    """Gathered full-vocab logits on the last stage (None elsewhere)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    with torch.no_grad():
        if ps.get_pipeline_model_parallel_world_size() > 1:
            return None
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        logits = model(tokens, positions, None)
        return gather_from_tensor_model_parallel_region(logits)[..., :VOCAB]


def grpo_like_loss(logprobs, extras):
    """A policy-gradient-shaped loss: -mean(advantage * logprob) over the micro-batch."""
    loss = -(logprobs * extras["advantages"][:, None]).mean()
    return loss, {"mean_logprob": logprobs.detach().mean()}


def forward_all(ckpt_root: str, modes=("bf16", "jetrl")) -> dict:
    """Import every family in every mode; full logits (PP1) and logprobs (last stage)."""
    from megatron_jetrl.actor.logprobs import compute_logprobs

    out = {}
    for family, config in CONFIGS.items():
        tokens = tokens_for(config)
        for mode in modes:
            model, _, _ = _build(family, mode, ckpt_root)
            out[family, mode] = {
                "logits": _full_logits(model, tokens),
                "logprobs": compute_logprobs(model, tokens, vocab_size=VOCAB, micro_batch_size=MICRO),
            }
    return out


def _adam_state_numel(optimizer) -> int:
    """Elements of Adam's first moment this rank holds (all of them, or its ZeRO-1 shard)."""
    return sum(st["exp_avg"].numel() for o in optimizer.chained_optimizers for st in o.optimizer.state.values())


def train(
    ckpt_root: str, mode: str, save_dir: str | None = None, sequence_parallel: bool = False, distributed: bool = False
) -> dict:
    """3 steps of train_step on qwen3 (this DP rank's share of a fixed batch); optional save + reload."""
    from megatron.core import parallel_state as ps

    from megatron_jetrl.actor.checkpoint import load_checkpoint, save_checkpoint
    from megatron_jetrl.actor.fp8_layers import fp8_weights
    from megatron_jetrl.actor.logprobs import compute_logprobs
    from megatron_jetrl.actor.provider import build_model
    from megatron_jetrl.actor.train_step import OptimConfig, train_step, unallocated_state_bytes, wrap_for_training
    from megatron_jetrl.fp8 import QuantizedWeight

    model, arch, flow = _build("qwen3", mode, ckpt_root, sequence_parallel)
    optim = OptimConfig(lr=LR, clip_grad=1.0, distributed=distributed)
    ddp, optimizer = wrap_for_training(model, optim)
    unallocated = unallocated_state_bytes(optimizer)
    tokens = tokens_for(CONFIGS["qwen3"], batch=4, seed=2)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)
    steps, fresh_fp8 = [], []
    for _ in range(STEPS):
        before = fp8_weights(model)
        steps.append(
            train_step(
                ddp,
                optimizer,
                tokens[local],
                grpo_like_loss,
                vocab_size=VOCAB,
                micro_batch_size=MICRO,
                extras={"advantages": advantages[local]},
            )
        )
        after = fp8_weights(model)
        params = dict(model.named_parameters())
        fresh_fp8.append(
            all(
                after[n] is not before[n]
                and torch.equal(after[n].q.view(torch.uint8), QuantizedWeight.quantize(params[n], flow).q.view(torch.uint8))
                for n in after
            )
        )
    result = {
        "steps": steps,
        "fp8_requantized": fresh_fp8,
        "fp8_names": sorted(fp8_weights(model)),
        "adam_state_numel": _adam_state_numel(optimizer),
        "param_numel": sum(p.numel() for p in model.parameters()),
        "unallocated_bytes": [unallocated, unallocated_state_bytes(optimizer)],
    }
    result["logprobs"] = compute_logprobs(ddp, tokens, vocab_size=VOCAB, micro_batch_size=MICRO)
    if save_dir is not None:
        save_checkpoint(ddp, save_dir, hf_config=CONFIGS["qwen3"], flow=flow, iteration=STEPS, optimizer=optimizer)
        fresh = build_model(arch, flow)
        fresh_ddp, fresh_opt = wrap_for_training(fresh, optim)
        meta = load_checkpoint(fresh_ddp, save_dir, optimizer=fresh_opt)
        result["resumed_iteration"] = meta["iteration"]
        result["resumed_logprobs"] = compute_logprobs(fresh_ddp, tokens, vocab_size=VOCAB, micro_batch_size=MICRO)
        # two more steps from both: same state -> same steps (the first loss is the restored params' forward; the
        # second follows an update that used the restored optimizer state)
        step = dict(vocab_size=VOCAB, micro_batch_size=MICRO, extras={"advantages": advantages[local]})
        result["next_losses"] = [train_step(ddp, optimizer, tokens[local], grpo_like_loss, **step).get("loss") for _ in range(2)]
        result["resumed_next_losses"] = [
            train_step(fresh_ddp, fresh_opt, tokens[local], grpo_like_loss, **step).get("loss") for _ in range(2)
        ]
    return result


def layout(ckpt_root: str, save_root: str, forward: bool) -> dict:
    """One spawned layout: forward of every family/mode (optional) and training + checkpoint round trip in both modes."""
    return {
        "forward": forward_all(ckpt_root) if forward else None,
        "train": {mode: train(ckpt_root, mode, str(Path(save_root) / mode)) for mode in ("bf16", "jetrl")},
    }


def sequence_parallel_layout(ckpt_root: str) -> dict:
    """TP2 with sequence parallelism: qwen3 training in both modes (no checkpoint)."""
    return {"train": {mode: train(ckpt_root, mode, None, sequence_parallel=True) for mode in ("bf16", "jetrl")}}


def distributed_optimizer_layout(ckpt_root: str, save_root: str) -> dict:
    """DP2 with megatron's DistributedOptimizer (ZeRO-1): training + checkpoint round trip in both modes
    (checkpoints in `save_root/<mode>`)."""
    return {"train": {mode: train(ckpt_root, mode, str(Path(save_root) / mode), distributed=True) for mode in ("bf16", "jetrl")}}


def resume_at_dp1(ckpt_root: str, save_dir: str, mode: str) -> dict:
    """One rank (DP1) resumes a DP2 distributed-optimizer checkpoint and takes the next two steps on the whole batch."""
    from megatron_jetrl.actor.checkpoint import load_checkpoint
    from megatron_jetrl.actor.train_step import OptimConfig, train_step, wrap_for_training

    model, _, _ = _build("qwen3", mode, ckpt_root)
    ddp, optimizer = wrap_for_training(model, OptimConfig(lr=LR, clip_grad=1.0, distributed=True))
    meta = load_checkpoint(ddp, save_dir, optimizer=optimizer)
    tokens = tokens_for(CONFIGS["qwen3"], batch=4, seed=2)
    step = dict(vocab_size=VOCAB, micro_batch_size=MICRO, extras={"advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])})
    return {
        "iteration": meta["iteration"],
        "next_losses": [train_step(ddp, optimizer, tokens, grpo_like_loss, **step)["loss"] for _ in range(2)],
    }


def offload_round_trips(ckpt_root: str, distributed: bool = False, bf16: bool = True) -> dict:
    """3 jetrl steps of train_step on qwen3, as the GRPO loop runs them under each `rollout.offload`: the state released
    before the first step (the engine's start) and after every step (the sync), the policy's FP8 copies made (the sync's
    stream) and dropped, and the state restored before the next step, with the KL reference's bytes waited for first.
    Per setting: losses, grad norms, final params and Adam state, the bytes each release and drop freed (with what this
    rank holds, counted independently), whether every released storage was empty, and whether the FP8 bytes made
    again (policy) and copied back (reference) are the ones before. `bf16=False`: FP32 weights, which the optimizer
    steps in place: they stay (counted out), Adam's moments leave."""
    from megatron.core import parallel_state as ps

    from megatron_jetrl.actor.fp8_layers import fp8_copy_bytes, fp8_weights
    from megatron_jetrl.actor.hf_import import load_hf_weights
    from megatron_jetrl.actor.offload import TrainStateOffload
    from megatron_jetrl.actor.provider import ActorOptions, build_model
    from megatron_jetrl.actor.train_step import OptimConfig, train_step, unallocated_state_bytes, wrap_for_training
    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.models.arch import ModelArch
    from megatron_jetrl.rl.session import awake_state_to_come

    tokens = tokens_for(CONFIGS["qwen3"], batch=4, seed=2)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)
    out = {}
    arch = ModelArch.from_hf_config(CONFIGS["qwen3"])
    flow = PrecisionFlow(mode="jetrl", backend="emulated")
    options = ActorOptions(params_dtype=torch.bfloat16 if bf16 else torch.float32)
    for what in ("none", "grads", "optimizer"):
        model = build_model(arch, flow, options)
        load_hf_weights(model, arch, Path(ckpt_root) / "qwen3")
        reference = build_model(arch, flow, options).eval().requires_grad_(False)
        load_hf_weights(reference, arch, Path(ckpt_root) / "qwen3")
        ddp, optimizer = wrap_for_training(model, OptimConfig(lr=LR, clip_grad=1.0, distributed=distributed, bf16=bf16))
        inner = [o.optimizer for o in optimizer.chained_optimizers]
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        mine = lambda ts: [t for t in ts if t.untyped_storage().data_ptr() not in weights]  # noqa: E731
        grads = [b.grad_data for b in ddp.buffers]
        off = None if what == "none" else TrainStateOffload(ddp, optimizer, what, reference)
        # what a colocated engine's KV sizing leaves to the actor (before the first step and the first forwards)
        session = SimpleNamespace(
            cfg=SimpleNamespace(rollout=SimpleNamespace(offload=what)), optimizer=optimizer, model=ddp, reference=reference
        )
        to_come = (
            awake_state_to_come(session),
            unallocated_state_bytes(optimizer),
            fp8_copy_bytes(ddp),
            fp8_copy_bytes(reference),
        )
        ref_fp8 = fp8_weights(reference)  # its first forward's bytes, kept from then on
        ref_before = {n: (w.q.clone(), w.s.clone()) for n, w in ref_fp8.items()}

        def fp8_bytes(ws):
            return sum(t.numel() * t.element_size() for w in ws.values() for t in (w.q, w.s, *(w._t or ())))

        def held_bytes():  # the grads, and (under `optimizer`) every optimizer tensor and the reference's FP8 bytes
            n = sum(g.numel() * g.element_size() for g in grads)
            if what == "optimizer":
                n += sum(p.numel() * p.element_size() for o in inner for group in o.param_groups for p in mine(group["params"]))
                n += sum(
                    v.numel() * v.element_size()
                    for o in inner
                    for st in o.state.values()
                    for v in st.values()
                    if isinstance(v, torch.Tensor)
                )
                n += fp8_bytes(ref_fp8)
            return n

        def released():
            tensors = grads + (
                mine([p for o in inner for group in o.param_groups for p in group["params"]])
                + [v for o in inner for st in o.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
                + [t for w in ref_fp8.values() for t in (w.q, w.s)]
                if what == "optimizer"
                else []
            )
            return all(t.untyped_storage().nbytes() == 0 for t in tensors) and all(
                p.untyped_storage().nbytes() > 0 for p in model.parameters()
            )

        run = {
            "freed": [],
            "expected": [],
            "empty": [],
            "steps": [],
            "fp8_freed": [],
            "fp8_expected": [],
            "fp8_same": [],
            "fp8_counted": [],
            "reference_same": [],
        }
        for step in range(STEPS + 1):
            if off is not None:
                run["expected"].append(held_bytes())
                run["freed"].append(off.release())
                run["empty"].append(released())
                assert off.release() == 0  # twice is once
                streamed = fp8_weights(model)  # the sync's stream quantizes the new weights
                made = {n: (w.q.clone(), w.s.clone(), *(t.clone() for t in w.transposed())) for n, w in streamed.items()}
                run["fp8_expected"].append(fp8_bytes(streamed))
                del streamed
                run["fp8_freed"].append(off.drop_fp8_copies())
                run["fp8_counted"].append((fp8_copy_bytes(model), fp8_copy_bytes(model, pending=True)))
                off.restore()
                off.wait(reference=True)
                run["reference_same"].append(
                    all(
                        torch.equal(w.q.view(torch.uint8), ref_before[n][0].view(torch.uint8))
                        and torch.equal(w.s, ref_before[n][1])
                        for n, w in ref_fp8.items()
                    )
                )
                off.wait()
                again = fp8_weights(model)  # the next forward makes them again
                assert fp8_copy_bytes(model, pending=True) == 0
                run["fp8_same"].append(
                    all(
                        torch.equal(again[n].q.view(torch.uint8), m[0].view(torch.uint8))
                        and torch.equal(again[n].s, m[1])
                        and torch.equal(again[n].transposed()[0].view(torch.uint8), m[2].view(torch.uint8))
                        for n, m in made.items()
                    )
                )
            if step < STEPS:
                run["steps"].append(
                    train_step(
                        ddp,
                        optimizer,
                        tokens[local],
                        grpo_like_loss,
                        vocab_size=VOCAB,
                        micro_batch_size=MICRO,
                        extras={"advantages": advantages[local]},
                    )
                )
        run["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        run["adam"] = [
            {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)} for o in inner for st in o.state.values()
        ]
        run["reference_fp8"] = fp8_bytes(ref_fp8)
        run["to_come"] = to_come
        out[what] = run
    return out


def bf16_release_round_trips(ckpt_root: str) -> dict:
    """jetrl train steps on qwen3 with the FP8 linears' BF16 weights kept and released (`bf16_linear_weights`): per
    setting, the losses, grad norms, final params and Adam state of 3 steps, then a step whose loss is NaN (skipped)
    and a step that raises in its loss callback; whether every FP8 linear's BF16 storage was empty while the loss ran,
    the bytes each release freed against this rank's FP8 linears' BF16 weights, and whether the weights after the
    skipped and the raising step are the ones before them."""
    from megatron_jetrl.actor.fp8_layers import _FP8Weight, unwrap
    from megatron_jetrl.actor.train_step import OptimConfig, train_step, wrap_for_training

    tokens = tokens_for(CONFIGS["qwen3"], batch=4, seed=2)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    out = {}
    for release in ("keep", "release"):
        model, _, _ = _build("qwen3", "jetrl", ckpt_root, bf16_linear_weights=release, params_dtype=torch.bfloat16)
        ddp, optimizer = wrap_for_training(model, OptimConfig(lr=LR, clip_grad=1.0))
        linears = [m for m in unwrap(model).modules() if isinstance(m, _FP8Weight)]
        bf16_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
        seen = []

        def loss_fn(logprobs, extras, poison=None):
            seen.append(all(m.weight.untyped_storage().nbytes() == 0 for m in linears))
            if poison == "raise":
                raise RuntimeError("the loss callback failed")
            loss, metrics = grpo_like_loss(logprobs, extras)
            return (loss * float("nan") if poison == "nan" else loss), metrics

        step = dict(vocab_size=VOCAB, micro_batch_size=MICRO, extras={"advantages": advantages})
        run = {"steps": [train_step(ddp, optimizer, tokens, loss_fn, **step) for _ in range(STEPS)]}
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        skipped = train_step(ddp, optimizer, tokens, lambda lp, ex: loss_fn(lp, ex, "nan"), on_nonfinite="skip", **step)
        run["skipped_ok"] = skipped["ok"]
        run["same_after_skip"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        try:
            train_step(ddp, optimizer, tokens, lambda lp, ex: loss_fn(lp, ex, "raise"), **step)
        except RuntimeError as e:
            run["raised"] = str(e)
        run["same_after_raise"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        with torch.no_grad():  # a NaN weight: quantized inside the step's finiteness watch (named there, no host sync each)
            linears[0].weight[0, 0] = float("nan")
        poisoned = train_step(ddp, optimizer, tokens, loss_fn, on_nonfinite="skip", **step)
        run["nan_weight"] = poisoned.get("skipped") or "not skipped"
        with torch.no_grad():
            linears[0].weight[0, 0] = before[next(n for n, p in model.named_parameters() if p is linears[0].weight)][0, 0]
        run["released_in_loss"] = seen
        run["bf16_bytes"] = bf16_bytes
        run["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        run["adam"] = [
            {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
            for o in optimizer.chained_optimizers
            for st in o.optimizer.state.values()
        ]
        out[release] = run
    return out


def bf16_release_refused_under_the_distributed_optimizer(ckpt_root: str) -> str:
    """The message of a release under megatron's distributed optimizer (its parameters are views of one buffer)."""
    from megatron_jetrl.actor.train_step import OptimConfig, train_step, wrap_for_training

    model, _, _ = _build("qwen3", "jetrl", ckpt_root, bf16_linear_weights="release", params_dtype=torch.bfloat16)
    ddp, optimizer = wrap_for_training(model, OptimConfig(lr=LR, clip_grad=1.0, distributed=True))
    try:
        train_step(
            ddp,
            optimizer,
            tokens_for(CONFIGS["qwen3"], batch=4, seed=2),
            grpo_like_loss,
            vocab_size=VOCAB,
            micro_batch_size=MICRO,
            extras={"advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])},
        )
    except RuntimeError as e:
        return str(e)
    return "not refused"
