"""Where one GRPO step's time goes, per phase and rank (`run.profile_step`): torch.profiler over the phases named in
`run.profile_phases`, reduced to a small table and a JSON file, so that a run at the scale users train answers what
limits each phase without a trace viewer.

Per phase, from the CUDA kernels the profiler recorded (on every stream: compute, NCCL):
- `wall_ms`: the phase's wall time (it ends with a device sync, as every timed phase does), under the profiler;
- `busy_ms`: the time some kernel ran (overlapping kernels merged) and `idle_ms` = wall - busy: where the GPU waited
  for the host (launches, Python, host syncs) or for nothing at all. `busy / wall` near 1: the GPU sets the pace;
  far below 1: the host does, and faster kernels cannot shorten the phase;
- `idle_ms_by_gap_us`: the idle time split by the length of each gap between kernels (a few us: back-to-back
  launches; tens: a launch that came late; hundreds and more: the host was busy elsewhere or synced);
- `late`: the kernels that ended the largest idle time, summed per kernel name (the launches the GPU waited for);
- `categories`: kernel time per category (FP8 GEMMs, BF16 GEMMs, quantizers, attention, communication, ...), and
  `top`: the kernels that took the most time. Communication kernels include the time a rank waits for its peers: at
  TP > 1 a long NCCL share means rank skew or a host-bound peer, not a slow link. Pipeline send/recv (PP > 1) is
  its own category: a stage's transfers plus its wait for the neighbouring stage, i.e. its share of the bubble.
- `launches`: CUDA kernel launches the host issued (runtime API events), i.e. how much host work the phase costs.

On a CPU run the profiler records CPU ops instead: the same table, with aten ops' own time in place of kernels and no
busy/idle split. The profiled step runs slower (the profiler's own overhead, mostly host-side): its metrics row says
`profiled: 1` and tools/sweep_report.py leaves it out of its medians.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch

CATEGORIES = (  # (category, kernel-name substrings), first match wins; names compared lower-case
    ("pipeline send/recv", ("sendrecv", "send_recv")),  # PP activations and gradients, and the stage waiting for them
    ("communication (NCCL)", ("nccl", "allreduce", "all_reduce", "allgather", "reducescatter", "cross_device_reduce")),
    ("optimizer", ("adam", "multi_tensor_apply", "normtwo", "foreach")),
    ("quantize", ("quant", "swiglu_bwd_tile")),
    ("GEMM FP8", ("fp8_gemm", "sm90_fp8", "deep_gemm", "deepgemm", "_gemm_tma", "_gemm_ptr", "e4m3")),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("GEMM BF16", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "sm90_")),
    (
        "logprobs, norms, glue (Triton, Inductor)",
        ("triton_", "rms", "rope", "rotary", "swiglu", "act_and_mul", "softmax", "_exp_", "amax"),
    ),
    ("copy/fill/layout", ("copy", "memcpy", "memset", "fill", "zero", "cat", "transpose", "pad")),
    ("elementwise/reduce", ("elementwise", "reduce", "unrolled", "vectorized")),
)
GAP_BINS_US = (4, 20, 200)
"""Upper edges of the idle-gap bins (us): back-to-back kernels, late launches, host work or syncs (and above)."""
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


def category(kernel: str) -> str:
    low = kernel.lower()
    return next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "other")


def gap_labels() -> list[str]:
    edges = (0, *GAP_BINS_US)
    return [f"{lo}-{hi}" for lo, hi in zip(edges, edges[1:])] + [f">{GAP_BINS_US[-1]}"]


def kernel_timeline(intervals) -> dict:
    """(start_ns, end_ns, name) intervals of GPU kernels -> the time some kernel ran (overlaps merged), the idle time
    between them per `GAP_BINS_US` bin, the idle time before each kernel name (the launch the GPU waited for) and the
    span from the first start to the last end, all in ms."""
    busy, span, gaps, late, cur, first = 0, 0, [0.0] * (len(GAP_BINS_US) + 1), {}, None, None
    for start, end, name in sorted(intervals):
        if cur is None:
            cur, first = [start, end], start
        elif start > cur[1]:
            busy += cur[1] - cur[0]
            gap_us = (start - cur[1]) / 1e3
            gaps[sum(gap_us >= edge for edge in GAP_BINS_US)] += gap_us / 1e3
            late[name] = late.get(name, 0.0) + gap_us / 1e3
            cur = [start, end]
        cur[1] = max(cur[1], end)
    if cur is not None:
        busy += cur[1] - cur[0]
        span = cur[1] - first
    return {"busy_ms": busy / 1e6, "span_ms": span / 1e6, "idle_ms_by_gap_us": dict(zip(gap_labels(), gaps)), "late": late}


def summarize(events, wall_s: float, cuda: bool, top: int = 12) -> dict:
    """One phase's profile (module docstring) from the profiler's events: (kind, name, start_ns, end_ns) tuples with
    kind "kernel" (a GPU kernel), "op" (a CPU aten op's own time, for CPU runs) or "launch" (a runtime launch call)."""
    by_name: dict[str, float] = {}
    for kind, name, start, end in events:
        if kind == ("kernel" if cuda else "op"):
            by_name[name] = by_name.get(name, 0.0) + (end - start) / 1e6
    cats: dict[str, float] = {}
    for name, ms in by_name.items():
        cats[category(name)] = cats.get(category(name), 0.0) + ms
    out = {
        "wall_ms": wall_s * 1e3,
        "kernel_ms": sum(by_name.values()),
        "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        "top": [[name[:160], ms] for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]],
        "launches": sum(kind == "launch" for kind, *_ in events),
    }
    if cuda:
        tl = kernel_timeline([(s, e, n) for kind, n, s, e in events if kind == "kernel"])
        out.update(
            busy_ms=tl["busy_ms"],
            idle_ms=max(0.0, wall_s * 1e3 - tl["busy_ms"]),
            idle_ms_by_gap_us=tl["idle_ms_by_gap_us"],
            late=[[name[:160], ms] for name, ms in sorted(tl["late"].items(), key=lambda kv: -kv[1])[:top]],
        )
    return out


def _events(prof) -> list[tuple[str, str, int, int]]:
    """(kind, name, start_ns, end_ns) of what a finished torch.profiler recorded (see `summarize`)."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.profiler.kineto_results.events():
        start, end = e.start_ns(), e.end_ns()
        if end <= start:
            continue
        if e.device_type() == DeviceType.CUDA:
            out.append(("kernel", e.name(), start, end))
        elif e.name() in LAUNCH_EVENTS:
            out.append(("launch", e.name(), start, end))
    if not any(kind == "kernel" for kind, *_ in out):  # a CPU run: aten ops' self time
        for ev in prof.key_averages():
            if ev.key.startswith("aten::") and ev.self_cpu_time_total > 0:
                out.append(("op", ev.key, 0, int(ev.self_cpu_time_total * 1e3)))
    return out


class StepProfiler:
    """Profiles the phases `phases` of step `step` (`run.profile_step`, `run.profile_phases`) into `directory`/
    profile_step<step>_rank<rank>.json: `phase(name)` around a phase, or as a subscriber of the run context
    (rl/context.py), which profiles the phases it wants of that step, marks its metrics row `profiled: 1`, writes the
    JSON and (`announce`: rank 0) prints the table."""

    def __init__(self, step: int, phases, directory, rank: int, device: torch.device, announce: bool = False):
        self.step, self.phases, self.directory, self.rank = step, tuple(phases), Path(directory), rank
        self.cuda = device.type == "cuda"
        self.announce = announce
        self.results: dict[str, dict] = {}
        self._open: list = []

    def on_phase(self, run, name: str) -> None:
        if run.step == self.step and self.wants(name):
            cm = self.phase(name)
            cm.__enter__()
            self._open.append((name, cm))

    def on_phase_end(self, run, name: str, error) -> None:
        if self._open and self._open[-1][0] == name:
            _, cm = self._open.pop()
            cm.__exit__(*((None, None, None) if error is None else (type(error), error, error.__traceback__)))

    def on_step_end(self, run, row: dict) -> None:
        if run.step != self.step:
            return
        row["profiled"] = 1
        path = self.write()
        if self.announce:
            print(f"profile of step {self.step} (rank 0; every rank's JSON beside {path}):\n{self.table()}", file=sys.stderr)

    def wants(self, name: str) -> bool:
        return name in self.phases

    @contextlib.contextmanager
    def phase(self, name: str):
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]  # (CUDA: kernels and launch calls)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            yield
            if self.cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        self.results[name] = summarize(_events(prof), wall, self.cuda)

    def write(self) -> Path:
        """The JSON of every profiled phase; the path."""
        path = self.directory / f"profile_step{self.step}_rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"step": self.step, "rank": self.rank, "cuda": self.cuda, "phases": self.results}, indent=1))
        return path

    def table(self) -> str:
        """Markdown: a row per phase (wall, GPU busy and idle, launches, kernel ms per category)."""
        cats = sorted({c for r in self.results.values() for c in r["categories"]})
        head = "| phase | wall ms | GPU busy ms | idle ms | launches | " + " | ".join(cats) + " |"
        rows = [head, "|---|" + "---:|" * (4 + len(cats))]
        for name, r in self.results.items():
            busy = f"{r['busy_ms']:.1f}" if "busy_ms" in r else "-"
            idle = f"{r['idle_ms']:.1f}" if "idle_ms" in r else "-"
            rows.append(
                f"| {name} | {r['wall_ms']:.1f} | {busy} | {idle} | {r['launches']} | "
                + " | ".join(f"{r['categories'].get(c, 0.0):.1f}" for c in cats)
                + " |"
            )
        return "\n".join(rows)
