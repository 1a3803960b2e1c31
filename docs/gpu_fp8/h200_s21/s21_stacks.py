"""Which Python lines launch jetrl's extra kernels (Memcpy DtoD, FP32 mul by a scalar, fills): one profiled step at
2 layers with stacks. python3 .calls/s21_stacks.py [--layers 2] [--mode jetrl]"""
import argparse, os, sys, collections
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import torch
import bench_actor as B

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=2)
p.add_argument("--mode", default="jetrl")
p.add_argument("--seq", type=int, default=4096)
p.add_argument("--micro-batches", type=int, default=2)
p.add_argument("--pattern", nargs="*", default=["Memcpy DtoD", "MulFunctor<float>", "FillFunctor<float>", "Memset", "direct_copy", "bfloat16_copy", "CUDAFunctor_add<float>", "TensorListMetadata", "CompareEq", "AbsFunctor"])
a = p.parse_args()
cuda = torch.cuda.is_available()
device = torch.device("cuda", 0) if cuda else torch.device("cpu")
for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
    os.environ.setdefault(k, v)
os.environ.setdefault("MASTER_PORT", str(B._free_port()))
from megatron_jetrl.actor.parallel import init_parallel
init_parallel(tp=1, pp=1)
cfg = B.load_preset(a.mode)
arch = cfg.arch()
if not cuda:
    from megatron_jetrl.models.arch import ModelArch
    arch = ModelArch.from_hf_config(dict(B.TINY, num_hidden_layers=2)); a.seq = 64
run = B.StepRun(a.mode, cfg, arch, a.layers, device)
tokens, mask, adv = B.make_batch(arch.vocab_size, a.micro_batches, a.seq, device)
lp0 = torch.full((a.micro_batches, a.seq - 1), -5.0, device=device)
extras = {"old": lp0, "adv": adv, "mask": mask, "rollout": lp0, "ref": lp0}
for _ in range(2):
    run.step(tokens, extras, 1)
if cuda:
    torch.cuda.synchronize()
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []), with_stack=True) as prof:
    run.step(tokens, extras, 1)
    if cuda:
        torch.cuda.synchronize()
agg = collections.defaultdict(lambda: [0.0, 0])
for ev in prof.events():
    kern = getattr(ev, "kernels", None) or []
    for k in kern:
        if any(pt in k.name for pt in a.pattern):
            stack = [s for s in (ev.stack or []) if "site-packages/torch/" not in s and "bench_actor" not in s][:6]
            key = (k.name[:60], ev.name, " <- ".join(stack))
            agg[key][0] += k.duration / 1e3 if hasattr(k, "duration") else 0
            agg[key][1] += 1
for (kn, op, st), (ms, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:40]:
    print(f"{ms:8.3f} ms {n:5d}x  {kn} | {op}\n      {st}")
