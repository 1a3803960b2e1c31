"""The distributed (ZeRO-1) optimizer on a GPU, where megatron-core runs unpatched: one rank (NCCL), BF16 params,
jetrl on the default backend. Its checkpoint round trip restores every optimizer tensor bit for bit and leaves
each parameter its own Adam step counter (megatron-core 0.16.1 with torch's Adam, as here without apex/TE, shares
one step tensor between all parameters on load: `actor.checkpoint` works around it; without that the counters
read 22 instead of 4 after one step, seen on an H200, where this test passed). Needs megatron-core
importable (the cp312 wheel, see tests/gpu/test_actor_tp_gpu.py); skipped otherwise."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

CONFIG = {
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "vocab_size": 512,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def one_rank():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    pytest.importorskip("megatron.core")
    from megatron_jetrl.actor.parallel import destroy_parallel, init_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    init_parallel(tp=1, pp=1, seed=1234)
    yield
    destroy_parallel()


def _loss(logprobs, extras):
    return -(logprobs * extras["advantages"][:, None]).mean(), {}


def _actor(
    distributed: bool,
    init: dict | None,
    fused: bool = True,
    mode: str = "jetrl",
    wgrad_fusion: bool = True,
    bf16_linear_weights: str = "keep",
):
    from megatron_jetrl.actor.provider import ActorOptions, build_model
    from megatron_jetrl.actor.train_step import OptimConfig, wrap_for_training
    from megatron_jetrl.fp8 import PrecisionFlow
    from megatron_jetrl.models.arch import ModelArch

    arch, flow = ModelArch.from_hf_config(CONFIG), PrecisionFlow(mode=mode)
    torch.manual_seed(0)
    model = build_model(arch, flow, ActorOptions(params_dtype=torch.bfloat16, bf16_linear_weights=bf16_linear_weights)).cuda()
    if init is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(init[name])
    ddp, optimizer = wrap_for_training(
        model, OptimConfig(lr=1e-3, clip_grad=1.0, distributed=distributed, fused=fused, wgrad_fusion=wgrad_fusion)
    )
    return model, ddp, optimizer, flow


def _batch_and_init(seed: int):
    """Tokens, `train_step` keyword arguments and initial weights shared by the variants a test compares."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG["vocab_size"], (4, 64), generator=g).cuda()
    step = dict(
        vocab_size=CONFIG["vocab_size"], micro_batch_size=2, extras={"advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]).cuda()}
    )
    return tokens, step, {k: v.detach().clone() for k, v in _actor(False, None)[0].named_parameters()}


def _states(optimizer) -> list[dict]:
    return [
        {"param": p.detach().clone(), **{k: v.clone() for k, v in o.optimizer.state[p].items()}}
        for o in optimizer.chained_optimizers
        for g in o.optimizer.param_groups
        for p in g["params"]
    ]


def test_distributed_optimizer_checkpoint_round_trip_on_gpu(one_rank, tmp_path):
    from megatron_jetrl.actor.checkpoint import load_checkpoint, save_checkpoint
    from megatron_jetrl.actor.train_step import train_step

    tokens, step, init = _batch_and_init(1)

    losses = {}
    for distributed in (False, True):
        _, ddp, optimizer, flow = _actor(distributed, init)
        losses[distributed] = [train_step(ddp, optimizer, tokens, _loss, **step)["loss"] for _ in range(3)]
    assert losses[True] == pytest.approx(losses[False], rel=1e-3), losses  # measured: equal or FP8-rounding close

    save_checkpoint(ddp, tmp_path, hf_config=CONFIG, flow=flow, iteration=3, optimizer=optimizer)
    _, fresh_ddp, fresh_optimizer, _ = _actor(True, None)
    load_checkpoint(fresh_ddp, tmp_path, optimizer=fresh_optimizer)
    saved, loaded = _states(optimizer), _states(fresh_optimizer)
    assert len(saved) == len(loaded) > 0
    for a, b in zip(saved, loaded, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k].float(), b[k].float()), k

    train_step(fresh_ddp, fresh_optimizer, tokens, _loss, **step)
    inner = [o.optimizer for o in fresh_optimizer.chained_optimizers]
    if all(isinstance(o, (torch.optim.Adam, torch.optim.AdamW)) for o in inner):
        # torch's Adam keeps a step counter per parameter, the one megatron-core 0.16.1 shares on load. With Transformer
        # Engine importable megatron picks TE's FusedAdam, which counts per parameter group, and this fault cannot occur
        # (seen on an H100 with TE installed: no per-parameter "step" at all)
        assert all(g["fused"] for o in inner for g in o.param_groups)  # actor.train_step.use_fused_adam, after load too
        counters = [st["step"] for o in inner for st in o.state.values() if "step" in st]
        assert counters and all(float(c) == 4 for c in counters), sorted({float(c) for c in counters})


def test_fused_adam_is_the_foreach_update(one_rank):
    """`OptimConfig.fused` (torch's fused Adam, the default on CUDA) against megatron's foreach Adam from the same
    weights and gradients: the same FP32 main parameters after a step, up to FP32 rounding of the update."""
    from megatron_jetrl.actor.train_step import _torch_adams, adam_is_fused, train_step

    tokens, step, init = _batch_and_init(2)
    mains = {}
    for fused in (True, False):
        model, ddp, optimizer, _ = _actor(True, init, fused=fused)
        if not _torch_adams(optimizer):  # seen on an H200 with TE installed
            pytest.skip(
                "megatron-core picked Transformer Engine's FusedAdam (TE importable): a fused kernel already, "
                "with no torch Adam for optim.fused to switch"
            )
        assert adam_is_fused(optimizer) is fused
        train_step(ddp, optimizer, tokens, _loss, **step)
        mains[fused] = torch.cat(
            [
                p.detach().float().flatten()
                for o in optimizer.chained_optimizers
                for group in o.optimizer.param_groups
                for p in group["params"]
            ]
        )
    diff = (mains[True] - mains[False]).abs()
    assert float(diff.max()) <= 1e-6 * float(mains[False].abs().max()) + 1e-7, float(diff.max())


def test_fused_wgrad_accumulation_on_gpu(one_rank):
    """`OptimConfig.wgrad_fusion` (the default): the device check passes for BF16 operands into an FP32 main_grad
    (torch's `addmm(out_dtype=float32)` into cuBLAS), every megatron linear of a bf16-mode actor is switched, and
    after a step of two micro-batches each main_grad equals the unfused run's up to the BF16 rounding that the
    unfused run applies to each micro-batch's gradient (the fused one keeps the FP32 product)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_jetrl.actor.train_step import train_step
    from megatron_jetrl.actor.wgrad_fusion import _check

    assert _check(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, torch.float32) is None
    tokens, step, _ = _batch_and_init(3)
    init = {k: v.detach().clone() for k, v in _actor(False, None, mode="bf16")[0].named_parameters()}
    grads = {}
    for fusion in (False, True):
        model, ddp, optimizer, _ = _actor(False, init, mode="bf16", wgrad_fusion=fusion)
        linears = [m for m in model.modules() if type(m) in (ColumnParallelLinear, RowParallelLinear)]
        assert len(linears) == 1 + 4 * CONFIG["num_hidden_layers"]
        assert all(m.gradient_accumulation_fusion == fusion for m in linears)
        assert train_step(ddp, optimizer, tokens, _loss, **step)["ok"]
        grads[fusion] = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    for name, want in grads[False].items():
        got = grads[True][name]
        assert float((got - want).abs().max()) <= 2**-7 * float(want.abs().max()) + 1e-30, name


@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "zero1"])
def test_offload_frees_the_device_memory_and_brings_every_byte_back(one_rank, distributed):
    """`rollout.offload=optimizer` on CUDA (actor.offload): a release frees the gradient buffers, the optimizer's
    storages and the KL reference's FP8 bytes, and the drop after the sync frees the policy's FP8 copies, on the device
    (torch's allocated bytes drop by at least what they report); the copies back on the side stream restore every
    optimizer tensor and reference byte bit for bit, the policy's FP8 bytes are made again identical, and the steps
    after it match those of an actor that kept its state (same init, same batch; within the GPU backward's run-to-run
    noise, as the distributed-optimizer test above)."""
    from megatron_jetrl.actor.fp8_layers import fp8_weights, offload_frozen_weights
    from megatron_jetrl.actor.offload import TrainStateOffload
    from megatron_jetrl.actor.train_step import train_step

    def fp8_bytes(weights):
        return {n: (w.q.view(torch.uint8).clone(), w.s.clone()) for n, w in weights.items()}

    def same(a, b):
        return a.keys() == b.keys() and all(torch.equal(a[n][0], b[n][0]) and torch.equal(a[n][1], b[n][1]) for n in a)

    tokens, step, init = _batch_and_init(2)
    runs = {}
    for offload in (False, True):
        model, ddp, optimizer, _ = _actor(distributed, init)
        reference = _actor(distributed, init)[0].eval().requires_grad_(False)
        offload_frozen_weights(reference)
        reference_bytes = fp8_bytes(fp8_weights(reference))
        off = TrainStateOffload(ddp, optimizer, "optimizer", reference) if offload else None
        losses = [train_step(ddp, optimizer, tokens, _loss, **step)["loss"]]
        if off is not None:
            before, held = _states(optimizer), torch.cuda.memory_allocated()
            torch.cuda.synchronize()
            freed = off.release()
            # the allocator's blocks are at least the storages' bytes (rounded up, a large block by up to 1 MiB unsplit)
            assert freed > 0 and freed <= held - torch.cuda.memory_allocated() <= freed + (64 << 20)
            policy_bytes = fp8_bytes(fp8_weights(model))  # the sync's stream makes the policy's copies
            held = torch.cuda.memory_allocated()
            dropped = off.drop_fp8_copies()
            assert dropped > 0 and dropped <= held - torch.cuda.memory_allocated() <= dropped + (64 << 20)
            off.restore()
            off.wait(reference=True)
            assert same(fp8_bytes(fp8_weights(reference)), reference_bytes)
            off.wait()
            assert all(
                a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(_states(optimizer), before)
            )
            assert same(fp8_bytes(fp8_weights(model)), policy_bytes)
        losses += [train_step(ddp, optimizer, tokens, _loss, **step)["loss"] for _ in range(2)]
        runs[offload] = losses
    assert runs[True] == pytest.approx(runs[False], rel=1e-3)  # two actors: the GPU backward need not repeat bit for bit


def test_released_bf16_linear_weights_leave_the_step_and_train_as_kept(one_rank):
    """`model.bf16_linear_weights=release` on CUDA: while the loss runs, the FP8 linears' BF16 weights hold no device
    memory (torch's allocated bytes are lower by at least their size than with `keep` at the same point), the optimizer
    step writes them again, and three steps match `keep`'s (two actors: within the GPU backward's run-to-run noise)."""
    from megatron_jetrl.actor.fp8_layers import _FP8Weight, unwrap
    from megatron_jetrl.actor.train_step import train_step

    tokens, step, init = _batch_and_init(3)
    runs = {}
    for release in ("keep", "release"):
        model, ddp, optimizer, _ = _actor(False, init, bf16_linear_weights=release)
        linears = [m for m in unwrap(model).modules() if isinstance(m, _FP8Weight)]
        held = []

        def loss_fn(logprobs, extras):
            held.append(torch.cuda.memory_allocated())
            return _loss(logprobs, extras)

        base = torch.cuda.memory_allocated()  # this actor before its first step (an earlier one may linger)
        losses = [train_step(ddp, optimizer, tokens, loss_fn, **step)["loss"] for _ in range(3)]
        assert all(m.weight.untyped_storage().nbytes() == m.weight.numel() * 2 for m in linears)  # written back
        runs[release] = (losses, held[0] - base, sum(m.weight.numel() * 2 for m in linears))
    (keep, keep_held, bf16_bytes), (release, release_held, _) = runs["keep"], runs["release"]
    assert keep_held - release_held >= bf16_bytes  # the first micro-batch's loss: the same activations and FP8 copies
    assert release == pytest.approx(keep, rel=1e-3)
