"""Host time of the FP8 linear and of each of its pieces, on the GPU (where the GPU never holds the host up).

    python3 tools/bench/bench_host.py [--m 256] [--iters 300] [--rounds 5] [--profile]
    python3 tools/bench/bench_host.py --against DIR [--rounds 5]     # A/B: this tree against another checkout

With a small M (default 256 tokens; N = K = 4096, the Qwen3-8B `o` projection) every kernel is shorter than the host
work that issues it, so the time per call of a loop without syncs is the host's: Python, torch's dispatcher and
allocator, Triton's and DeepGEMM's launch paths, autograd. Rows: a BF16 nn.Linear fwd+bwd beside the FP8 linear
(shipped defaults: DeepGEMM, check_finite='step', inside and outside a `finite.watch`), then each piece of the FP8
linear on its own. `--profile` adds cProfile's top functions of the FP8 fwd+bwd. Host timings on a shared machine
move by 10-20% between runs, so the two Triton launch paths (`fp8.launch`: the cached direct launch, and every
launch through `JITFunction.run`) are timed in one process, alternating in `--rounds` rounds per row (median).

`--against DIR` compares the code of two trees (DIR: e.g. `git worktree add /tmp/base HEAD~1`): the linear rows
(BF16 and FP8 fwd+bwd, FP8 fwd with and without gradients) run in a fresh process per tree, alternating the trees for `--rounds` rounds, each
importing its tree's `megatron_jetrl` first on PYTHONPATH. On these shared machines a process's host speed moves by
up to 50% from one minute to the next (BENCHMARKS.md), more than most changes: compare medians of rounds run
side by side, never two separate runs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time

import torch


def host_us(fn, iters: int) -> tuple[float, float]:
    """(host us, wall us) per call of `fn` over `iters` calls issued without a sync (after 5 warm-up calls)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6, (time.perf_counter() - t0) / iters * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=256, help="tokens per call (small: the GPU must outrun the host)")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5, help="alternations of the two launch paths per row")
    p.add_argument("--profile", action="store_true", help="cProfile of the FP8 linear fwd+bwd in a watch")
    p.add_argument(
        "--torch-profile",
        action="store_true",
        help="torch.profiler (host side) of the FP8 linear fwd+bwd in a watch: ops and autograd nodes by self host time, "
        "every thread (the backward runs on autograd's device thread)",
    )
    p.add_argument("--against", metavar="DIR", help="another checkout: A/B of the linear rows, a process per tree and round")
    p.add_argument("--linear-rows", action="store_true", help=argparse.SUPPRESS)  # one --against process: JSON line
    args = p.parse_args(argv)
    if args.against:
        return against(args)
    if not torch.cuda.is_available():
        print("bench_host.py: needs a CUDA GPU (it times the host work of the GPU FP8 linear)", file=sys.stderr)
        return 2

    from megatron_jetrl.fp8 import FP8Linear, PrecisionFlow, backends, finite, kernels, launch
    from megatron_jetrl.fp8.gemm import _check_operands, blockwise_gemm

    dev, m, n, k = torch.device("cuda"), args.m, 4096, 4096
    flow = PrecisionFlow(mode="jetrl")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    lin = FP8Linear(k, n, bias=False, flow=flow, device=dev, dtype=torch.bfloat16)
    lin.weight.main_grad = torch.zeros(n, k, device=dev, dtype=torch.float32)
    lin.weight.grad_added_to_main_grad = False
    bf16 = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    qw = lin.quantized_weight()
    xq, xs = kernels.quantize_1x128(x.detach(), check_finite=False)
    dq, ds, dtq, dts = kernels.quantize_dual(dy, check_finite=False)
    _, _, xtq, xts = kernels.quantize_dual(xq, check_finite=False, rows=False, x_scale=xs)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    dg = backends.deep_gemm_module()
    watch = finite.FiniteWatch()
    for _ in range(2 * watch.CHUNK):  # the watch's multi-tensor reduction is loaded before it is timed
        watch.record("warm-up", xs)

    def fwd_bwd(module, in_watch=False):
        def run():
            if in_watch:
                with finite.watch():
                    module(x).backward(dy)
            else:
                module(x).backward(dy)

        return run

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()

        return run

    rows = [
        ("bf16 nn.Linear fwd+bwd", fwd_bwd(bf16)),
        ("FP8Linear fwd+bwd", fwd_bwd(lin)),
        ("FP8Linear fwd+bwd in a finite.watch (as in a train step)", fwd_bwd(lin, in_watch=True)),
        ("FP8Linear fwd", lambda: lin(x)),
        ("FP8Linear fwd under no_grad (old and reference logprobs)", no_grad(lambda: lin(x))),
        ("  kernels.quantize_1x128 (FProp input)", lambda: kernels.quantize_1x128(x.detach(), check_finite=False)),
        ("  kernels.quantize_dual rows+cols (dY)", lambda: kernels.quantize_dual(dy, check_finite=False)),
        (
            "  kernels.quantize_dual cols from E4M3 (X for WGrad)",
            lambda: kernels.quantize_dual(xq, check_finite=False, rows=False, x_scale=xs),
        ),
        ("  FiniteWatch.record", lambda: watch.record("x", xs)),
        ("  blockwise_gemm FProp", lambda: blockwise_gemm(xq, xs, qw.q, qw.s)),
        (
            "  blockwise_gemm WGrad into main_grad",
            lambda: blockwise_gemm(dtq, dts, xtq, xts, b_block=(1, 128), acc=lin.weight.main_grad),
        ),
        ("  _check_operands", lambda: _check_operands(xq, xs, qw.q, qw.s, (128, 128), None)),
        ("  torch.empty(M, N)", lambda: torch.empty(m, n, device=dev, dtype=torch.bfloat16)),
    ]
    if dg is not None:
        rows.append(
            (
                "  deep_gemm.fp8_gemm_nt 1D2D, called directly",
                lambda: dg.fp8_gemm_nt((xq, xs), (qw.q, qw.s), out, disable_ue8m0_cast=True),
            )
        )
    if args.linear_rows:  # which tree this process imported rides along: the parent checks it is the one it meant
        import megatron_jetrl

        times = {name: host_us(fn, args.iters)[0] for name, fn in rows[:5]}
        print(
            json.dumps({"imported": os.path.dirname(os.path.dirname(os.path.abspath(megatron_jetrl.__file__))), **times}),
            flush=True,
        )
        return 0
    direct = launch._direct_ok()  # the probe's verdict for this process
    print(
        f"{torch.cuda.get_device_name()}, M={m} N={n} K={k}, {args.iters} calls per row and path; flow {flow}; "
        f"direct launch {'allowed' if direct else 'REFUSED by ' + launch.ENV + ' or the probe'}"
    )
    print(
        "| what | host us, direct launch | host us, JITFunction.run | direct / Triton | wall us, direct |\n|---|---|---|---|---|"
    )
    for name, fn in rows:
        times = {True: [], False: []}
        for _ in range(args.rounds):
            for path in (True, False):
                launch._DIRECT = path and direct
                times[path].append(host_us(fn, max(1, args.iters // args.rounds)))
        launch._DIRECT = direct
        hd, wd = sorted(times[True])[args.rounds // 2]
        ht = sorted(times[False])[args.rounds // 2][0]
        print(f"| {name} | {hd:.1f} | {ht:.1f} | {hd / ht:.2f} | {wd:.1f} |", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        run = fwd_bwd(lin, in_watch=True)
        prof.enable()
        for _ in range(100):
            run()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue())
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        run = fwd_bwd(lin, in_watch=True)
        for _ in range(10):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(100):
                run()
            torch.cuda.synchronize()
        print("torch.profiler, 100 FP8Linear fwd+bwd in a finite.watch, host side (us are totals over the 100):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=70))
    return 0


def against(args) -> int:
    """`--against DIR`: the linear rows of this tree and of DIR, a fresh process each, alternating for --rounds rounds."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    trees = {"this tree": here, f"against {args.against}": os.path.abspath(args.against)}
    if not os.path.isfile(os.path.join(trees[f"against {args.against}"], "megatron_jetrl", "__init__.py")):
        print(
            f"bench_host.py --against: {args.against} holds no megatron_jetrl package; give the root of another checkout "
            "(e.g. `git worktree add /tmp/base HEAD~1`, then --against /tmp/base)",
            file=sys.stderr,
        )
        return 2
    times: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, root in trees.items():
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
            done = subprocess.run(
                [
                    sys.executable,
                    "-W",
                    "ignore",
                    os.path.abspath(__file__),
                    "--linear-rows",
                    "--m",
                    str(args.m),
                    "--iters",
                    str(args.iters),
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if done.returncode:
                print(f"bench_host.py --against: the process for {name} ({root}) failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                return 1
            row = json.loads(done.stdout.strip().splitlines()[-1])
            if os.path.realpath(row.pop("imported")) != os.path.realpath(root):
                print(
                    f"bench_host.py --against: the process for {name} imported megatron_jetrl from elsewhere, not {root} "
                    "(an installed copy ahead of PYTHONPATH?): the A/B would compare one tree with itself",
                    file=sys.stderr,
                )
                return 1
            times[name].append(row)
    rows = list(times["this tree"][0])
    print(f"host us per call, median of {args.rounds} alternating rounds ({args.iters} calls each), M={args.m} N=K=4096")
    print("| what | " + " | ".join(trees) + " | this / against |\n|---|---|---|---|")
    for row in rows:
        a, b = (statistics.median(r[row] for r in times[name]) for name in trees)
        print(f"| {row} | {a:.1f} | {b:.1f} | {a / b:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
