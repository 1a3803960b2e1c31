# Session 26 diagnostic (not product code): in the GRPO trainer process, sample every thread's CPU time, the main
# thread's preemptions and CPU, and which phase the main thread is in (rollout / actor / other, from its stack),
# every 0.1 s; at exit write per-phase totals per thread to $DIAG_OUT/threads_<pid>.txt.
import os
import sys
import threading
import time

def _cmd():
    try:
        return open("/proc/self/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return ""

if "megatron_jetrl.rl.train" in _cmd() and os.environ.get("DIAG_OUT"):
    import atexit
    import collections

    _main = threading.main_thread().ident
    _tick = os.sysconf("SC_CLK_TCK")
    _acc = collections.defaultdict(float)        # (phase, thread name) -> cpu s
    _wall = collections.defaultdict(float)       # phase -> wall s
    _csw = collections.defaultdict(int)          # phase -> main thread nonvoluntary switches
    _cpus = collections.defaultdict(collections.Counter)
    _last = {}
    _main_tid = os.getpid()

    def _phase():
        f = sys._current_frames().get(_main)
        names = []
        while f is not None:
            fn = f.f_code.co_filename
            if "megatron_jetrl" in fn:
                names.append(fn.split("megatron_jetrl/")[-1] + ":" + f.f_code.co_name)
            f = f.f_back
        for n in names:
            if n.startswith("rollout/"):
                return "rollout"
        for n in names:
            if n.startswith("actor/") or n.startswith("rl/loss"):
                return "actor"
        return "other" if names else "none"

    def _read():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                st = open(f"/proc/self/task/{tid}/stat").read()
                comm = st[st.index("(") + 1: st.rindex(")")]
                rest = st[st.rindex(")") + 2:].split()
                cpu = (int(rest[11]) + int(rest[12])) / _tick
                proc = int(rest[36])
                nv = 0
                if int(tid) == _main_tid:
                    for line in open(f"/proc/self/task/{tid}/status"):
                        if line.startswith("nonvoluntary_ctxt_switches"):
                            nv = int(line.split()[1])
                out[int(tid)] = (comm, cpu, nv, proc)
            except (OSError, ValueError, IndexError):
                pass
        return out

    def _loop():
        global _last
        prev_t = time.perf_counter()
        _last = _read()
        while True:
            time.sleep(0.1)
            ph = _phase()
            now = _read()
            t = time.perf_counter()
            _wall[ph] += t - prev_t
            prev_t = t
            for tid, (comm, cpu, nv, proc) in now.items():
                old = _last.get(tid)
                if old:
                    name = "MAIN" if tid == _main_tid else f"{comm}/{tid}"
                    _acc[(ph, name)] += cpu - old[1]
                    if tid == _main_tid:
                        _csw[ph] += nv - old[2]
                        _cpus[ph][proc] += 1
            _last = now

    def _dump():
        with open(os.path.join(os.environ["DIAG_OUT"], f"threads_{os.getpid()}.txt"), "w") as f:
            f.write(f"mode args: {_cmd()[-200:]}\naffinity: {sorted(os.sched_getaffinity(0))}\n")
            for ph in sorted(_wall):
                f.write(f"phase {ph}: wall {_wall[ph]:.2f} s, main nonvoluntary switches {_csw[ph]}, main on cpus {dict(_cpus[ph].most_common(6))}\n")
                rows = sorted(((v, n) for (p, n), v in _acc.items() if p == ph), reverse=True)
                for v, n in rows[:12]:
                    f.write(f"    {n:24s} {v:7.2f} cpu s ({100 * v / max(_wall[ph], 1e-9):5.1f}% of the phase)\n")

    if os.environ.get("DIAG_AVOID_CPU0"):
        os.sched_setaffinity(0, set(range(1, os.cpu_count())))
    threading.Thread(target=_loop, daemon=True, name="diag-sampler").start()
    atexit.register(_dump)
