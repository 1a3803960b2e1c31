"""cProfile of one megatron layer fwd+bwd (4096x1), bf16 and jetrl: where the host time goes."""
import cProfile, io, os, pstats, sys, time
import torch
sys.path.insert(0, "tools"); sys.path.insert(0, ".")
import bench_actor as B
from megatron_jetrl.actor.parallel import init_parallel
from megatron_jetrl.models.arch import ModelArch
for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555").items():
    os.environ.setdefault(k, v)
init_parallel(tp=1, pp=1)
arch = ModelArch.from_hf_config(B.QWEN3_8B)
seq = int(os.environ.get("SEQ", "4096"))
x0 = torch.randn(seq, 1, arch.hidden_size, device="cuda", dtype=torch.bfloat16)
dy = torch.randn_like(x0) * 1e-2
for name in sys.argv[1:]:
    layer = B.build_layer(arch, B.variant_flow(name), torch.bfloat16)
    mods = B.fp8_modules(layer)
    for m in mods:
        m.weight.main_grad = torch.zeros_like(m.weight, dtype=torch.float32)
    x = x0.clone().requires_grad_(True)
    params = [x] + list(layer.parameters())
    def fwd_bwd():
        layer(x, attention_mask=None)[0].backward(dy)
    for _ in range(5):
        fwd_bwd(); torch.cuda.synchronize()
    pr = cProfile.Profile()
    host = []
    for _ in range(10):
        for t in params: t.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter(); pr.enable(); fwd_bwd(); pr.disable(); host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    print(f"==== {name}: host ms per fwd+bwd (under cProfile) median {sorted(host)[5]*1e3:.2f}")
    for key in ("tottime", "cumulative"):
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(key).print_stats(40)
        lines = [l for l in s.getvalue().splitlines() if l.strip()]
        start = next(i for i, l in enumerate(lines) if "ncalls" in l)
        print(f"-- by {key}"); print("\n".join(l[:200] for l in lines[start:start + 41]))
    del layer, mods
