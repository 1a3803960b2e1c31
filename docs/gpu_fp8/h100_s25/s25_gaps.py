# Session 25: where megatron's layer (4 x 8192 tokens) leaves the GPU idle. bench_actor --layer's do_bench wall is
# ~10 ms above its profiled kernel sum in both modes (call C). Here: wall of 10 back-to-back fwd+bwd (CUDA events, no
# L2 flush) against do_bench's median, and a torch.profiler trace of 3 passes: every gap > 20 us between kernels with
# the kernel before and after it and the CPU op running when the next kernel was launched.
import os, sys, json, time
sys.path.insert(0, "tools")
import torch
import bench_actor as B
for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
    os.environ.setdefault(k, v)
os.environ.setdefault("MASTER_PORT", str(B._free_port()))
from megatron_jetrl.actor.parallel import init_parallel
from megatron_jetrl.models.arch import ModelArch
from torch.profiler import ProfilerActivity, profile
init_parallel(tp=1, pp=1)
dev = torch.device("cuda", 0)
arch = ModelArch.from_hf_config(B.QWEN3_8B)
out = {}
for name in ("bf16", "jetrl"):
    torch.manual_seed(0)
    layer = B.build_layer(arch, B.variant_flow(name), torch.bfloat16)
    mods = B.fp8_modules(layer)
    for m in mods:
        m.weight.main_grad = torch.zeros_like(m.weight, dtype=torch.float32)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(8192, 4, arch.hidden_size, generator=g, device=dev, dtype=torch.bfloat16).requires_grad_(True)
    dy = torch.randn(8192, 4, arch.hidden_size, generator=g, device=dev, dtype=torch.bfloat16) * 1e-2
    params = [x] + list(layer.parameters())
    def fwd_bwd():
        layer(x, attention_mask=None)[0].backward(dy)
    for _ in range(3):
        fwd_bwd()
    for t in params: t.grad = None
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(10):
        for t in params: t.grad = None
        fwd_bwd()
    e1.record(); torch.cuda.synchronize()
    wall = e0.elapsed_time(e1) / 10
    t0 = time.perf_counter()
    for _ in range(3):
        for t in params: t.grad = None
        fwd_bwd()
    host = (time.perf_counter() - t0) / 3 * 1e3
    torch.cuda.synchronize()
    from triton.testing import do_bench
    db = do_bench(fwd_bwd, warmup=50, rep=200, grad_to_none=params, return_mode="median")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            for t in params: t.grad = None
            fwd_bwd()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0]
    evs.sort(key=lambda e: e.time_range.start)
    busy = sum(e.time_range.elapsed_us() for e in evs) / 3 / 1e3
    span = (evs[-1].time_range.end - evs[0].time_range.start) / 3 / 1e3
    gaps = []
    end = evs[0].time_range.end
    for a, b in zip(evs, evs[1:]):
        end = max(end, a.time_range.end)
        gap = b.time_range.start - end
        if gap > 20:
            gaps.append((gap, a.name[:70], b.name[:70]))
    gaps.sort(reverse=True)
    tot = sum(g for g, _, _ in gaps) / 3 / 1e3
    out[name] = dict(wall_events_ms=wall, do_bench_ms=db, host_issue_ms_per_pass=host, profiled_span_ms=span, kernel_busy_ms=busy,
                     gaps_over_20us_ms_per_pass=tot, top_gaps=[(round(g), a, b) for g, a, b in gaps[:25]])
    print(f"{name}: wall (events, 10 passes) {wall:.2f} ms, do_bench {db:.2f}, host {host:.2f}, profiled span {span:.2f}, kernels {busy:.2f}, "
          f"gaps > 20 us {tot:.2f} ms per pass", flush=True)
    for g, a, b in gaps[:12]:
        print(f"   {g:8.0f} us  after {a}  before {b}", flush=True)
    del layer, x, dy, params, mods
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "gaps.json", "w"), indent=1)
