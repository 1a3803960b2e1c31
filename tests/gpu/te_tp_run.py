#!/usr/bin/env python3
"""The TE layer spec at TP2 on 2 GPUs: a jetrl train step against the local spec, and the TE export gathered over TP.

    torchrun --nproc-per-node=2 tests/gpu/te_tp_run.py [--json PATH] [--modes fp32 ue8m0]

Needs 2 GPUs, Transformer Engine (after `source .kits/te/bin/env.sh`) and megatron-core. One TP2 group
(`actor.parallel.init_parallel(tp=2)`); per scale mode of `jetrl`:

* a local-spec and a TE-spec model with the same weights (`provider.copy_weights`; a run's random init is the same
  in both specs, `actor.hf_import.init_hf_weights`): test_te.py's model and tokens (tests/gpu/gpu_helpers.py: qwen2-shaped,
  hidden 512, 2 layers; every TP2 shard a multiple of 128);
* test_te.py's TRAINSTEP check at TP2: logprobs before, one train step each (same tokens, advantages, loss, lr),
  logprobs after; mean/max |d logprob| TE vs local, relative loss and grad-norm differences;
* the TE export: `actor_weight_stream(to="all")` -- TE's shard bytes (`te_fp8_weights` on each rank), gathered
  over TP and cut by the one mapping table -- against the full tensors TE holds at TP1: every rank's BF16 shard
  gathered, fused into megatron's TP1 layout (`mapping.from_hf`), quantized by TE's weight quantizer
  (`fp8.te.make_block_quantizer(flow, "weight")`, what a TP1 TE forward quantizes), cut into HF tensors. Counted:
  FP8 weights and weight_scale_inv byte-equal, and the fraction of equal bytes; each rank checks its own copy.

Rank 0 prints one `TETP ...` line per check and writes everything to --json; tests/gpu/test_te_tp_gpu.py runs it and
asserts test_te.py's jetrl bounds and full byte equality. (It lives beside its test, like gpu_helpers.py, rather than
in tools/: it is that test's worker, not a user-facing tool.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_helpers: the model, tokens and mapping helpers of test_te.py


def tp_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """This BF16 tensor on every TP rank, in TP rank order (independent of the weight stream's own gather)."""
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(tensor) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, tensor.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return parts


def tp1_te_bytes(model, arch, flow) -> dict[str, torch.Tensor]:
    """HF FP8 tensors of the full (TP1) weights as TE's quantizer makes them (collective over TP)."""
    from gpu_helpers import hf_fp8

    from megatron_jetrl.actor.fp8_layers import unwrap
    from megatron_jetrl.fp8.te import make_block_quantizer, te_weight
    from megatron_jetrl.models import model_entries
    from megatron_jetrl.models.mapping import from_hf, gather_ranks, to_hf

    params = dict(unwrap(model).named_parameters())
    quantizer = make_block_quantizer(flow, "weight", rowwise=True, columnwise=False)
    full = {}
    with torch.no_grad():
        for e in model_entries(arch, spec="te"):
            if not e.fp8:
                continue
            pieces = [to_hf(e, arch, shard) for shard in tp_gather(params[e.megatron])]
            hf_full = {name: gather_ranks(e, [p[name] for p in pieces]) for name in e.hf}
            tp1 = from_hf(e, arch, hf_full).contiguous()  # the tensor a TP1 TE linear holds
            full[e.megatron] = te_weight(quantizer(tp1))
    return hf_fp8(full, arch)


def export_check(model, arch, flow) -> dict:
    from megatron_jetrl.actor.weight_stream import actor_weight_stream

    want = tp1_te_bytes(model, arch, flow)
    pairs = dict(actor_weight_stream(model, arch, flow, to="all"))
    out = {"weights": [0, 0], "scales": [0, 0], "bytes": 0, "bytes_equal": 0, "differ": []}
    for name, t in want.items():
        got = pairs[name].contiguous().view(torch.uint8)
        ref = t.contiguous().view(torch.uint8)
        same = int((got == ref).sum()) if got.shape == ref.shape else 0
        kind = out["scales" if name.endswith("weight_scale_inv") else "weights"]
        kind[0] += same == ref.numel()
        kind[1] += 1
        out["bytes"] += ref.numel()
        out["bytes_equal"] += same
        if same != ref.numel():
            out["differ"].append(f"{name}: {ref.numel() - same} of {ref.numel()} bytes")
    out["fraction"] = out["bytes_equal"] / max(1, out["bytes"])
    return out


def train_check(mode: str) -> dict:
    """test_te.py's test_te_train_step_matches_local_spec at the current TP size, and the export check."""
    from gpu_helpers import arch, train_step_comparison

    from megatron_jetrl.fp8 import PrecisionFlow

    flow = PrecisionFlow(mode="jetrl", scale_mode=mode)
    row, te_ddp = train_step_comparison(flow)
    row = {"mode": mode, **row}
    row["export"] = export_check(te_ddp, arch(), flow)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="*", default=["fp32", "ue8m0"], help="scale modes of jetrl")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA GPUs (the TE spec has no CPU kernels)")

    from megatron_jetrl.actor.parallel import destroy_parallel, init_parallel
    from megatron_jetrl.fp8.te import require_te

    require_te()
    init_parallel(tp=2, pp=1, seed=1234)
    if dist.get_world_size() != 2:
        raise SystemExit("run with torchrun --nproc-per-node=2 (one TP2 group)")
    import transformer_engine.pytorch  # noqa: F401  (fails loudly here if the kit is broken)

    rank = dist.get_rank()
    rows = []
    for mode in a.modes:
        row = train_check(mode)
        gathered = [None, None]
        dist.all_gather_object(gathered, row)
        row["ranks_agree"] = all(
            g[k] == gathered[0][k]
            for g in gathered
            for k in ("loss_local", "loss_te", "grad_norm_local", "grad_norm_te", "before", "after")
        )
        row["export_by_rank"] = [g["export"] for g in gathered]
        rows.append(row)
        if rank == 0:
            e = row["export"]
            print(
                f"TETP train {mode}: TP2 TE spec vs local spec, same init and tokens: before mean|dlogp| "
                f"{row['before']['mean']:.3g} max {row['before']['max']:.3g}; after one step mean {row['after']['mean']:.3g} "
                f"max {row['after']['max']:.3g}; loss local {row['loss_local']:.6g} te {row['loss_te']:.6g} "
                f"(rel {row['loss_rel']:.2g}); grad norm local {row['grad_norm_local']:.6g} te {row['grad_norm_te']:.6g} "
                f"(rel {row['grad_norm_rel']:.2g}); ranks agree {row['ranks_agree']}",
                flush=True,
            )
            print(
                f"TETP export {mode}: TP2 live stream gathered over TP vs TE's quantizer on the full TP1 tensors: "
                f"FP8 weights {e['weights'][0]}/{e['weights'][1]}, weight_scale_inv {e['scales'][0]}/{e['scales'][1]} "
                f"byte-equal; bytes equal {e['fraction']:.6f} of {e['bytes']} (rank 1: "
                f"{row['export_by_rank'][1]['fraction']:.6f})" + (f"; differ: {e['differ'][:4]}" if e["differ"] else ""),
                flush=True,
            )
        torch.cuda.empty_cache()
    destroy_parallel()
    if rank == 0 and a.json:
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        Path(a.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
