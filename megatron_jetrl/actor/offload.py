"""The actor's training state off the GPU while the rollout runs (`rollout.offload`), as slime and verl do it.

Between an optimizer step and the next backward the actor needs neither its gradients nor its optimizer state, and
a colocated engine's KV cache is what a long rollout is short of (Qwen3-8B at TP 4: 7.6 GiB of FP32 gradients and
22.9 GiB of FP32 main params and Adam moments a GPU, beside 3.8 GiB of BF16 weights and, in jetrl, 3.2 GiB of the
policy's FP8 copies and 1.6 GiB of the reference's). `release` frees them just before the engine wakes; `restore`
brings them back once it sleeps:

* `grads`: megatron DDP's FP32 gradient buffers are freed (`offload_grad_buffers`: their storage resized to 0,
  every view kept) and come back zeroed; nothing is copied, since the next step zeroes them before its backward.
  The policy's FP8 weight copies (W, and W^T under `model.fp8_weight_t=step`; local spec) are dropped once the sync
  has streamed them into the engine (`streamed`) and made again by the next forward: the same bytes (the quantizer is
  deterministic), for one more quantization pass a step.
* `optimizer`: also the optimizer's tensors, this rank's FP32 main params and Adam moments (its ZeRO-1 shard under
  the distributed optimizer; an FP32 weight that the optimizer steps in place stays, as the sync reads it), and the
  KL reference's FP8 bytes (its BF16 weights already wait in host memory, `offload_frozen_weights`): each
  storage is copied to a pinned host buffer of its size (kept from step to step)
  and resized to 0; `restore` resizes it and copies the bytes back on a side stream, the reference's first, which
  overlaps the policy's logprob pass; `wait` orders the reference's pass (`reference=True`) or the update after
  the copy. The same tensor objects throughout:
  megatron's and torch's references to them stay valid, and the bytes come back unchanged (the run is bit for bit
  the run without offload).

A storage is freed only once: two tensors that share one (views) are copied as that storage. Freed memory returns to
torch's caching allocator; the colocated pool hands it to vLLM before a wake (`rollout.colocated`). On the CPU the
same steps run on host tensors (no pinning, no streams): they keep the bytes and save nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

OFFLOAD_CHOICES = ("none", "grads", "optimizer")


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors megatron's (chained) optimizer keeps: its inner optimizers' params (the FP32 main params) and
    per-parameter state (Adam's moments, and the fused Adam's step counters on the device)."""
    found = []
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(o, "optimizer", None)
        if inner is None:
            continue
        found += [p for group in inner.param_groups for p in group["params"]]
        found += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return found


class TrainStateOffload:
    """`release` / `restore` / `wait` of the actor's gradients (`what="grads"`) or gradients, optimizer state and the
    reference's FP8 bytes (`what="optimizer"`), and `streamed`, which drops the policy's FP8 copies after the sync;
    each is a no-op when there is nothing to do, so the loop may call them unconditionally. `freed`: the bytes the
    last release and drop freed on this rank (`state` and `fp8`)."""

    def __init__(self, ddp_model, optimizer, what: str, reference=None):
        if what not in OFFLOAD_CHOICES[1:]:
            raise ValueError(f"offload must be one of {OFFLOAD_CHOICES[1:]}, got {what!r}")
        self.ddp, self.optimizer, self.what, self.reference = ddp_model, optimizer, what, reference
        self.released = False
        self.freed = {"state": 0, "fp8": 0}
        self._host = {"reference": [], "optimizer": []}  # pinned host bytes, one per storage, kept from step to step
        self._held: dict[str, list[tuple[torch.UntypedStorage, int, torch.Tensor]]] = {"reference": [], "optimizer": []}
        self._stream = None
        self._ready: dict[str, torch.cuda.Event] = {}

    def release(self) -> int:
        """Free the state; the bytes freed on this rank (0 if already released)."""
        if self.released:
            return 0
        self.wait()
        freed = sum(
            b.grad_data.untyped_storage().nbytes()
            for b in self.ddp.buffers + self.ddp.expert_parallel_buffers
            if b.grad_data is not None
        )
        self.ddp.offload_grad_buffers(synchronize=False, empty_cache=False)
        if self.what == "optimizer":
            for kind, storages in self._storages().items():
                for storage in storages:
                    host = self._host_buffer(kind, len(self._held[kind]), storage.nbytes(), storage.device.type == "cuda")
                    host.copy_(_bytes(storage), non_blocking=storage.device.type == "cuda")
                    self._held[kind].append((storage, storage.nbytes(), host))
            for storage, size, _ in self._held["reference"] + self._held["optimizer"]:  # once every copy is queued
                storage.resize_(0)
                freed += size
        self.released = True
        self.freed = {"state": freed, "fp8": 0}
        return freed

    def streamed(self, pairs: Iterable) -> Iterator:
        """The sync's weight stream, after which the policy's FP8 weight copies are dropped (the engine holds copies of
        their bytes now; the next forward quantizes them again), before the engine wakes its KV cache."""
        yield from pairs
        self.freed["fp8"] = self.drop_fp8_copies()

    def drop_fp8_copies(self) -> int:
        """Drop the policy's FP8 weight copies; the bytes they held on this rank."""
        from megatron_jetrl.actor.fp8_layers import fp8_copy_storages, requantize_weights

        held = {s.data_ptr(): s.nbytes() for s in fp8_copy_storages(self.ddp)}
        requantize_weights(self.ddp)
        return sum(held.values())

    def _storages(self) -> dict[str, list[torch.UntypedStorage]]:
        """The storages to copy out, each once: the reference's FP8 copies, then the optimizer's tensors (not a
        weight's: an FP32 param the optimizer steps in place is a weight the sync and rollout read)."""
        from megatron_jetrl.actor.fp8_layers import fp8_copy_storages

        seen = {p.untyped_storage().data_ptr() for p in self.ddp.module.parameters()}  # now: a train step may move them
        found = {
            "reference": [] if self.reference is None else fp8_copy_storages(self.reference),
            "optimizer": [t.untyped_storage() for t in _optimizer_tensors(self.optimizer)],
        }
        for kind, storages in found.items():
            unique = []
            for storage in storages:
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    unique.append(storage)
            found[kind] = unique
        return found

    def _host_buffer(self, kind: str, index: int, size: int, pinned: bool) -> torch.Tensor:
        buffers = self._host[kind]
        if index == len(buffers):
            buffers.append(torch.empty(0, dtype=torch.uint8))
        if buffers[index].numel() != size:  # the first release comes before Adam's moments and the reference's bytes exist
            buffers[index] = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        return buffers[index]

    def restore(self) -> None:
        """Reallocate the state: gradients zeroed, the reference's and the optimizer's bytes copied back
        (asynchronously on CUDA: `wait`)."""
        if not self.released:
            return
        self.ddp.restore_grad_buffers(synchronize=False)
        for storage, size, _ in self._held["reference"] + self._held["optimizer"]:
            storage.resize_(size)
        for kind, held in self._held.items():  # the reference's first: its logprob pass comes before the update
            if held and held[0][0].device.type == "cuda":
                device = held[0][0].device
                self._stream = self._stream or torch.cuda.Stream(device)
                self._stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(self._stream):
                    for storage, _, host in held:
                        _bytes(storage).copy_(host, non_blocking=True)
                    self._ready[kind] = torch.cuda.Event()
                    self._ready[kind].record(self._stream)
            else:
                for storage, _, host in held:
                    _bytes(storage).copy_(host)
        self._held = {"reference": [], "optimizer": []}
        self.released = False

    def wait(self, reference: bool = False) -> None:
        """Order the current stream after `restore`'s copies of the reference's bytes (`reference=True`, before its
        logprob pass) or of everything (before anything reads the optimizer state)."""
        for kind in ("reference",) if reference else ("reference", "optimizer"):
            ready = self._ready.pop(kind, None)
            if ready is not None:
                torch.cuda.current_stream(self._stream.device).wait_event(ready)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
