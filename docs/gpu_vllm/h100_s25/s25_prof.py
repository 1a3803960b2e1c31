# Session 25: where a GRPO rollout's host time goes with vLLM (G4: jetrl 0.50 s a rollout against bf16's 0.36 s at
# configs/gpu_8b_shapes.yaml, while bench_vllm at that setting decodes both at 22.7K tok/s, host-bound). Wraps
# VllmEngine.generate in cProfile for calls 3-5 and the whole ColocatedPool.generate wall, then runs rl.train.
import cProfile, io, pstats, sys, time
import torch
from megatron_jetrl.rollout import vllm_engine, colocated
calls = {"n": 0}
prof = cProfile.Profile()
orig = vllm_engine.VllmEngine.generate
def wrapped(self, *a, **k):
    calls["n"] += 1
    on = 3 <= calls["n"] <= 5
    torch.cuda.synchronize(); t0 = time.perf_counter()
    if on: prof.enable()
    try:
        return orig(self, *a, **k)
    finally:
        if on: prof.disable()
        torch.cuda.synchronize()
        print(f"[prof] generate call {calls['n']}: {time.perf_counter() - t0:.3f} s", flush=True)
        if calls["n"] == 5:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
            print(s.getvalue()[:12000], flush=True)
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            print(s.getvalue()[:8000], flush=True)
vllm_engine.VllmEngine.generate = wrapped
from megatron_jetrl.rl import train
sys.exit(train.main(sys.argv[1:]))
