# Session 25: why a jetrl actor layer peaks at 4.06 GiB against BF16's 2.20 (bench_actor's memory probe, H100, call B).
# For bf16 and jetrl at 1 and 2 Qwen3-8B layers: memory held between steps and the peak of a one-micro-batch step,
# and, at 2 layers, the allocations alive at the step's peak grouped by the project/megatron frame that made them
# (from torch's allocator trace). Run like bench_actor (PYTHONPATH=/tmp/dg:/tmp/mcore:$PWD).
import collections, math, os, sys, json
sys.path.insert(0, "tools")
import torch
import bench_actor as B

def frame_key(frames):
    for f in frames:
        fn = f.get("filename", "")
        if ("megatron_jetrl" in fn or "/megatron/" in fn or "torch/optim" in fn or "torch/autograd" in fn) and "s25_mem" not in fn:
            return f"{fn.split('site-packages/')[-1].split('main/')[-1]}:{f.get('line')} {f.get('name')}"
    return "other"

def alive_at_peak(trace):
    alive, cur, peak, best = {}, 0, 0, {}
    for e in trace:
        a = e["action"]
        if a == "alloc":
            alive[e["addr"]] = (e["size"], frame_key(e.get("frames", [])))
            cur += e["size"]
            if cur > peak:
                peak, best = cur, dict(alive)
        elif a == "free_completed" and e["addr"] in alive:
            cur -= alive.pop(e["addr"])[0]
    groups = collections.Counter()
    for size, key in best.values():
        groups[key] += size
    return peak, groups

for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
    os.environ.setdefault(k, v)
os.environ.setdefault("MASTER_PORT", str(B._free_port()))
from megatron_jetrl.actor.parallel import init_parallel
from megatron_jetrl.actor.logprobs import response_start
init_parallel(tp=1, pp=1)
dev = torch.device("cuda", 0)
out = {}
for mode in ("bf16", "jetrl"):
    cfg = B.load_preset(mode)
    arch = cfg.arch()
    tokens, mask, adv = B.make_batch(arch.vocab_size, 1, 4096, dev)
    lp0 = torch.full((1, 4095), -math.log(arch.vocab_size), device=dev)
    extras = {"old": lp0, "adv": adv, "mask": mask, "rollout": lp0, "ref": lp0, "first": response_start(mask)}
    for n in (1, 2):
        base = torch.cuda.memory_allocated()
        run = B.StepRun(mode, cfg, arch, n, dev)
        built = torch.cuda.memory_allocated() - base
        run.step(tokens, extras, 1); torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        if n == 2:
            torch.cuda.memory._record_memory_history(max_entries=500000)
        run.step(tokens, extras, 1); torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        held2 = torch.cuda.memory_allocated() - base
        row = dict(built_gib=built / 2**30, held_after_step_gib=held2 / 2**30, peak_gib=peak / 2**30)
        if n == 2:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            p, groups = alive_at_peak(snap["device_traces"][0])
            row["traced_peak_gib"] = p / 2**30
            row["alive_at_peak_by_frame_gib"] = {k: round(v / 2**30, 3) for k, v in groups.most_common(25)}
            # what the step leaves allocated, by frame
            held_groups = collections.Counter()
            for seg in snap["segments"]:
                for blk in seg["blocks"]:
                    if blk["state"] == "active_allocated":
                        held_groups[frame_key(blk.get("frames", []))] += blk["size"]
            row["held_by_frame_gib"] = {k: round(v / 2**30, 3) for k, v in held_groups.most_common(20)}
        out[f"{mode}_{n}"] = row
        print(mode, n, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if not isinstance(v, dict)}, flush=True)
        run.close()
for mode in ("bf16", "jetrl"):
    print(f"\n== {mode}: per layer held {out[f'{mode}_2']['held_after_step_gib'] - out[f'{mode}_1']['held_after_step_gib']:.3f} GiB, "
          f"peak {out[f'{mode}_2']['peak_gib'] - out[f'{mode}_1']['peak_gib']:.3f} GiB")
    print("alive at peak (2 layers, traced, of the step only):")
    for k, v in out[f"{mode}_2"]["alive_at_peak_by_frame_gib"].items():
        print(f"  {v:8.3f}  {k}")
    print("held after the step (2 layers, allocated while tracing):")
    for k, v in out[f"{mode}_2"]["held_by_frame_gib"].items():
        print(f"  {v:8.3f}  {k}")
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "mem.json", "w"), indent=1)
