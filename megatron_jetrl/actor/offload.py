"""The actor's training state off the GPU while the rollout runs (`rollout.offload`), as slime and verl do it.

Between an optimizer step and the next backward the actor needs neither its gradients nor its optimizer state, and
a colocated engine's KV cache is what a long rollout is short of (Qwen3-8B at TP 4: 7.6 GiB of FP32 gradients and
22.9 GiB of FP32 main params and Adam moments a GPU, beside 3.8 GiB of BF16 weights). `release` frees them just
before the engine wakes; `restore` brings them back once it sleeps:

* `grads`: megatron DDP's FP32 gradient buffers are freed (`offload_grad_buffers`: their storage resized to 0,
  every view kept) and come back zeroed; nothing is copied, since the next step zeroes them before its backward.
* `optimizer`: also the optimizer's tensors, this rank's FP32 main params and Adam moments (its ZeRO-1 shard under
  the distributed optimizer; an FP32 weight that the optimizer steps in place stays, as the sync reads it): each
  storage is copied to a pinned host buffer of its size (kept from step to step)
  and resized to 0; `restore` resizes it and copies the bytes back on a side stream, which overlaps the logprob
  passes that follow the rollout, and `wait` orders the update after the copy. The same tensor objects throughout:
  megatron's and torch's references to them stay valid, and the bytes come back unchanged (the run is bit for bit
  the run without offload).

A storage is freed only once: two tensors that share one (views) are copied as that storage. Freed memory returns to
torch's caching allocator; the colocated pool hands it to vLLM before a wake (`rollout.colocated`). On the CPU the
same steps run on host tensors (no pinning, no streams): they keep the bytes and save nothing.
"""

from __future__ import annotations

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
    """`release` / `restore` / `wait` of the actor's gradients (`what="grads"`) or gradients and optimizer state
    (`what="optimizer"`); each is a no-op when there is nothing to do, so the loop may call them unconditionally."""

    def __init__(self, ddp_model, optimizer, what: str):
        if what not in OFFLOAD_CHOICES[1:]:
            raise ValueError(f"offload must be one of {OFFLOAD_CHOICES[1:]}, got {what!r}")
        self.ddp, self.optimizer, self.what = ddp_model, optimizer, what
        self._weights = {p.untyped_storage().data_ptr() for p in ddp_model.module.parameters()}
        self.released = False
        self._host: list[torch.Tensor] = []  # pinned host bytes, one per storage, kept from step to step
        self._held: list[tuple[torch.UntypedStorage, int, torch.Tensor]] = []  # (storage, bytes, host copy)
        self._stream = None
        self._ready = None

    def release(self) -> int:
        """Free the state; the bytes freed on this rank (0 if already released)."""
        if self.released:
            return 0
        self.wait()
        freed = sum(b.grad_data.untyped_storage().nbytes() for b in self.ddp.buffers + self.ddp.expert_parallel_buffers
                    if b.grad_data is not None)
        self.ddp.offload_grad_buffers(synchronize=False, empty_cache=False)
        if self.what == "optimizer":
            for storage in self._optimizer_storages():
                host = self._host_buffer(len(self._held), storage.nbytes(), storage.device.type == "cuda")
                host.copy_(_bytes(storage), non_blocking=storage.device.type == "cuda")
                self._held.append((storage, storage.nbytes(), host))
            for storage, size, _ in self._held:  # once every copy is queued: the allocator orders reuse after them
                storage.resize_(0)
                freed += size
        self.released = True
        return freed

    def _optimizer_storages(self) -> list[torch.UntypedStorage]:
        storages, seen = [], set()
        for t in _optimizer_tensors(self.optimizer):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            if key in self._weights:  # an FP32 param the optimizer steps in place: a weight the sync and rollout read
                continue
            storages.append(storage)
        return storages

    def _host_buffer(self, index: int, size: int, pinned: bool) -> torch.Tensor:
        if index == len(self._host):
            self._host.append(torch.empty(0, dtype=torch.uint8))
        if self._host[index].numel() != size:  # the first release comes before Adam's moments exist
            self._host[index] = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        return self._host[index]

    def restore(self) -> None:
        """Reallocate the state: gradients zeroed, optimizer bytes copied back (asynchronously on CUDA: `wait`)."""
        if not self.released:
            return
        self.ddp.restore_grad_buffers(synchronize=False)
        for storage, size, _ in self._held:
            storage.resize_(size)
        device = self._held[0][0].device if self._held else None
        if device is not None and device.type == "cuda":
            self._stream = self._stream or torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                for storage, _, host in self._held:
                    _bytes(storage).copy_(host, non_blocking=True)
                self._ready = torch.cuda.Event()
                self._ready.record(self._stream)
        else:
            for storage, _, host in self._held:
                _bytes(storage).copy_(host)
        self._held = []
        self.released = False

    def wait(self) -> None:
        """Order the current stream after `restore`'s copies (before anything reads the optimizer state)."""
        if self._ready is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(self._ready)
            self._ready = None


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
