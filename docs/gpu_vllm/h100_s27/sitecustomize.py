# Session 27 diagnostic (not product code), loaded through PYTHONPATH into the GRPO trainer process only.
# Question: jetrl's vLLM rollout inside GRPO runs ~25% slower than bf16's with the same host code. Is the main thread's
# CPU slower (frequency, SMT sibling, cache/TLB: a machine or process effect) or does it run more work?
# Around every VllmEngine.generate: a fixed pure-Python loop timed in this thread and, at the same moment, in a bare
# helper process; the main thread's schedstat (run / runqueue-wait ns); per-CPU busy deltas (/proc/stat); other
# processes' CPU (/proc/*/stat); the CPU the main thread is on, its SMT siblings and their busy share; cpu MHz.
# DIAG_GC=1: gc.freeze() once and gc.disable() during generate (an intervention). Output: $DIAG_OUT/rollouts_<pid>.jsonl
import os
import sys

def _cmd():
    try:
        return open("/proc/self/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return ""

if "megatron_jetrl.rl.train" in _cmd() and os.environ.get("DIAG_OUT"):
    import gc
    import json
    import subprocess
    import threading
    import time

    _HELPER = ("import sys,time\n"
               "def c():\n"
               "    best=9\n"
               "    for _ in range(3):\n"
               "        t=time.perf_counter(); s=0; d={}\n"
               "        for i in range(200000):\n"
               "            s+=i*i&7; d[i&1023]=s\n"
               "        best=min(best,time.perf_counter()-t)\n"
               "    return best\n"
               "for line in sys.stdin:\n"
               "    sys.stdout.write(repr(c())+'\\n'); sys.stdout.flush()\n")
    _ns = {}
    exec(_HELPER.split("for line")[0], _ns)
    _calib = _ns["c"]
    _helper = subprocess.Popen([sys.executable, "-S", "-c", _HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env={"PATH": os.environ.get("PATH", "")})

    def _helper_calib():
        _helper.stdin.write("go\n"); _helper.stdin.flush()
        return float(_helper.stdout.readline())

    def _stat_fields(path):
        st = open(path).read()
        return st[st.index("(") + 1: st.rindex(")")], st[st.rindex(")") + 2:].split()

    def _main_sched():
        r, w, n = open(f"/proc/self/task/{os.getpid()}/schedstat").read().split()
        return int(r), int(w), int(n)

    def _main_cpu():
        return int(_stat_fields(f"/proc/self/task/{os.getpid()}/stat")[1][36])

    def _cpu_times():
        out = {}
        for line in open("/proc/stat"):
            if line.startswith("cpu") and line[3].isdigit():
                p = line.split()
                v = list(map(int, p[1:]))
                out[int(p[0][3:])] = (sum(v) - v[3] - v[4], sum(v))
        return out

    def _procs():
        out = {}
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    comm, rest = _stat_fields(f"/proc/{pid}/stat")
                    out[int(pid)] = (comm, int(rest[11]) + int(rest[12]))
                except (OSError, ValueError, IndexError):
                    pass
        return out

    def _mhz():
        return [float(l.split(":")[1]) for l in open("/proc/cpuinfo") if l.startswith("cpu MHz")]

    def _jit_count():
        n = 0
        for d in (os.path.expanduser("~/.cache/vllm/deep_gemm"), os.path.expanduser("~/.deep_gemm"), os.environ.get("DG_JIT_CACHE_DIR", "")):
            for _, _, files in (os.walk(d) if d and os.path.isdir(d) else ()):
                n += sum(f.endswith(".cubin") for f in files)
        return n

    def _siblings(cpu):
        try:
            s = open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read().strip()
        except OSError:
            return [cpu]
        out = []
        for part in s.split(","):
            a, _, b = part.partition("-")
            out += list(range(int(a), int(b or a) + 1))
        return out

    _tick = os.sysconf("SC_CLK_TCK")
    _path = os.path.join(os.environ["DIAG_OUT"], f"rollouts_{os.getpid()}.jsonl")
    _gc = os.environ.get("DIAG_GC") == "1"
    _parse = {"s": 0.0, "n": 0}

    def _wrap(orig):
        def generate(self, *a, **k):
            rec = {"calib_main_before": _calib(), "calib_helper_before": _helper_calib(), "mhz_before": _mhz(), "jit_before": _jit_count()}
            cpu0, ct0, pr0, sc0 = _main_cpu(), _cpu_times(), _procs(), _main_sched()
            _parse["s"] = 0.0; _parse["n"] = 0
            if _gc:
                gc.disable()
            t0, th0 = time.perf_counter(), time.thread_time()
            try:
                return orig(self, *a, **k)
            finally:
                wall, th = time.perf_counter() - t0, time.thread_time() - th0
                if _gc:
                    gc.enable()
                sc1, ct1, pr1, cpu1 = _main_sched(), _cpu_times(), _procs(), _main_cpu()
                rec.update(wall_s=wall, main_cpu_s=th, run_s=(sc1[0] - sc0[0]) / 1e9, runq_wait_s=(sc1[1] - sc0[1]) / 1e9,
                           slices=sc1[2] - sc0[2], parse_s=_parse["s"], parse_n=_parse["n"], main_cpu_start=cpu0,
                           main_cpu_end=cpu1, siblings=_siblings(cpu1), mhz_after=_mhz(), gc_counts=gc.get_count(),
                           gc_objects=len(gc.get_objects()) if os.environ.get("DIAG_COUNT") else None)
                busy = {c: (ct1[c][0] - ct0[c][0]) / max(ct1[c][1] - ct0[c][1], 1) for c in ct1 if c in ct0}
                rec["cpu_busy"] = {c: round(b, 3) for c, b in busy.items()}
                me = os.getpid()
                other = sorted(((v[1] - pr0[p][1]) / _tick, f"{v[0]}/{p}") for p, v in pr1.items()
                               if p in pr0 and p != me and v[1] > pr0[p][1])
                rec["other_procs_cpu_s"] = other[-8:][::-1]
                info = []
                for cpu_s, tag in other[-3:][::-1]:
                    pid = tag.rsplit("/", 1)[1]
                    try:
                        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:300]
                        ppid = _stat_fields(f"/proc/{pid}/stat")[1][1]
                        threads = sorted(_stat_fields(f"/proc/{pid}/task/{t}/stat")[0] for t in os.listdir(f"/proc/{pid}/task"))
                        info.append({"pid": pid, "ppid": ppid, "cpu_s": cpu_s, "cmd": cmd, "threads": threads[:12], "nthreads": len(threads)})
                    except (OSError, IndexError):
                        pass
                rec["other_procs_info"] = info
                rec["jit_after"] = _jit_count()
                rec["calib_main_after"] = _calib()
                rec["calib_helper_after"] = _helper_calib()
                with open(_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
        return generate

    def _wrap_parse(orig):
        def parse_output(o):
            t = time.perf_counter()
            try:
                return orig(o)
            finally:
                _parse["s"] += time.perf_counter() - t; _parse["n"] += 1
        return parse_output

    def _patcher():
        while True:
            m = sys.modules.get("megatron_jetrl.rollout.vllm_engine")
            if m is not None and hasattr(m, "VllmEngine") and hasattr(m, "parse_output"):
                m.VllmEngine.generate = _wrap(m.VllmEngine.generate)
                m.parse_output = _wrap_parse(m.parse_output)
                if _gc:
                    gc.freeze()
                with open(_path, "a") as f:
                    f.write(json.dumps({"patched": True, "gc": _gc, "affinity": sorted(os.sched_getaffinity(0)),
                                        "ncpu": os.cpu_count(), "siblings0": _siblings(0),
                                        "numa_nodes": sorted(os.listdir("/sys/devices/system/node")) if os.path.isdir("/sys/devices/system/node") else None,
                                        "model": next((l.split(":")[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")}) + "\n")
                return
            time.sleep(0.05)

    threading.Thread(target=_patcher, daemon=True, name="diag-patcher").start()
