"""`fp8.launch.Launcher` on the CPU, against a stand-in for Triton's JITFunction: which calls take the direct path,
and that a direct launch passes exactly what `JITFunction.run` passes to the compiled launcher (Triton 3.6: the grid
padded to 3-D, the stream, the function, its packed metadata, launch metadata and hooks, then every parameter in
signature order). tests/gpu/test_triton_launch.py runs the real thing."""

import inspect
import sys
import types

import pytest
import torch

from megatron_jetrl.fp8 import launch


class FakeKernel:
    function, packed_metadata = "cufunction", "packed"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("direct", args))


class FakeJIT:
    """What Launcher reads of a `triton.jit` function: `signature`, and `fn[grid](*args, **kw)` returning the kernel."""

    def __init__(self):
        def kern(x_ptr, y_ptr, n, a, SCALE: "tl.constexpr", BLOCK: "tl.constexpr", ADD: "tl.constexpr" = 1.0):
            pass

        self.signature, self.__name__, self.log = inspect.signature(kern), "kern", []

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.log.append(("triton", grid, args, kw))
            return FakeKernel(self.log)

        return run


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    monkeypatch.setattr(launch, "_hooks_active", lambda: False)
    monkeypatch.setattr(launch, "_direct_ok", lambda: True)


def test_second_launch_of_a_key_is_direct_with_tritons_arguments(fake_cuda):
    jit = FakeJIT()
    fast = launch.Launcher(jit)
    x, y = torch.zeros(64), torch.zeros(64)
    fast[(3,)](x, y, 32, 0.5, SCALE=2.0, BLOCK=128)
    assert jit.log[-1] == ("triton", (3,), (x, y, 32, 0.5), {"SCALE": 2.0, "BLOCK": 128})
    fast[(5, 2)](x, y, 64, 0.25, SCALE=2.0, BLOCK=128)  # same key: another grid, other values of the same kinds
    kind, args = jit.log[-1]
    assert kind == "direct"
    assert args[:9] == (5, 2, 1, 77, "cufunction", "packed", None, None, None)
    assert args[9:13] == (x, y, 64, 0.25) and args[13:] == (2.0, 128, 1.0)  # keywords then the default, in signature order
    assert len(jit.log) == 2 and len(fast._cache) == 1


@pytest.mark.parametrize(
    "change", ["unaligned", "dtype", "n=1", "n%16", "n>2**31", "bool", "constexpr", "num_warps", "positional constexpr"]
)
def test_a_specialization_triton_would_tell_apart_is_a_new_key(fake_cuda, change):
    jit = FakeJIT()
    fast = launch.Launcher(jit)
    x, y = torch.zeros(64), torch.zeros(64)
    call = dict(args=[x, y, 32, 0.5], kw={"SCALE": 2.0, "BLOCK": 128})
    fast[(1,)](*call["args"], **call["kw"])
    args, kw = list(call["args"]), dict(call["kw"])
    if change == "unaligned":
        args[0] = x[1:]  # 4 bytes off the 16-byte alignment
    elif change == "dtype":
        args[0] = x.double()
    elif change == "n=1":
        args[2] = 1
    elif change == "n%16":
        args[2] = 33
    elif change == "n>2**31":
        args[2] = 2**31 + 32
    elif change == "bool":
        args[2] = True
    elif change == "constexpr":
        kw["BLOCK"] = 256
    elif change == "num_warps":
        kw["num_warps"] = 8
    else:  # the constexprs given by position: their values are part of the key, as in Triton's
        fast[(1,)](*args, 2.0, 128)
        args, kw = args + [3.0, 128], {}
    fast[(1,)](*args, **kw)
    n_keys = 3 if change == "positional constexpr" else 2
    assert [e[0] for e in jit.log] == ["triton"] * n_keys and len(fast._cache) == n_keys


def test_unkeyed_arguments_callable_grids_hooks_and_a_failed_probe_take_tritons_path(fake_cuda, monkeypatch):
    jit = FakeJIT()
    fast = launch.Launcher(jit)
    x = torch.zeros(64)
    for _ in range(2):
        fast[(1,)](x, object(), 32, 0.5, SCALE=2.0, BLOCK=128)  # e.g. a TMA TensorDescriptor
        fast[lambda meta: (1,)](x, x, 32, 0.5, SCALE=2.0, BLOCK=128)
    monkeypatch.setattr(launch, "_hooks_active", lambda: True)
    for _ in range(2):
        fast[(1,)](x, x, 32, 0.5, SCALE=2.0, BLOCK=128)
    monkeypatch.setattr(launch, "_hooks_active", lambda: False)
    monkeypatch.setattr(launch, "_direct_ok", lambda: False)
    for _ in range(2):
        fast[(1,)](x, x, 32, 0.5, SCALE=2.0, BLOCK=128)
    assert [e[0] for e in jit.log] == ["triton"] * 8 and not fast._cache


def test_a_missing_parameter_is_named(fake_cuda):
    fast = launch.Launcher(FakeJIT())
    with pytest.raises(TypeError, match="kern: no value for parameter 'BLOCK'"):
        fast[(1,)](torch.zeros(4), torch.zeros(4), 4, 0.5, SCALE=2.0)


def test_probe_verdict_once_per_process_never_inside_a_graph_capture_or_sync_debug(monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "_DIRECT", None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(launch, "_probe", lambda: calls.append(1) or True)
    assert launch._direct_ok() is False and launch._DIRECT is None and not calls  # capturing: Triton's path, no verdict yet
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 2)  # "error": the probe's sync would raise
    assert launch._direct_ok() is False and launch._DIRECT is None and not calls
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    assert launch._direct_ok() is True and launch._direct_ok() is True and calls == [1]

    def broken():
        raise AttributeError("CompiledKernel has no attribute 'packed_metadata'")

    monkeypatch.setattr(launch, "_DIRECT", None)
    monkeypatch.setattr(launch, "_probe", broken)
    with pytest.warns(RuntimeWarning, match="direct-launch probe failed \\(AttributeError: CompiledKernel has no"):
        assert launch._direct_ok() is False
    assert launch._DIRECT is False


def test_environment_turns_the_direct_launch_off_or_names_a_bad_value(monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "_probe", lambda: calls.append(1) or True)
    monkeypatch.setattr(launch, "_DIRECT", None)
    monkeypatch.setenv(launch.ENV, "triton")
    assert launch._direct_ok() is False and launch._DIRECT is False and not calls  # no probe either
    monkeypatch.setattr(launch, "_DIRECT", None)
    monkeypatch.setenv(launch.ENV, "fast")
    with pytest.raises(ValueError, match="MEGATRON_JETRL_TRITON_LAUNCH='fast': use 'direct'"):
        launch._direct_ok()
    monkeypatch.setenv(launch.ENV, "direct")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    assert launch._direct_ok() is True and calls == [1]


def test_hooks_active_reads_tritons_hook_chains(monkeypatch):
    class HookChain:
        def __init__(self, calls):
            self.calls = calls

    runtime = types.SimpleNamespace(launch_enter_hook=HookChain([]), launch_exit_hook=HookChain([]))
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(knobs=types.SimpleNamespace(runtime=runtime)))
    assert not launch._hooks_active()  # Triton 3.6's defaults: empty chains
    runtime.launch_exit_hook = HookChain([print])
    assert launch._hooks_active()
    runtime.launch_enter_hook, runtime.launch_exit_hook = None, None  # older Triton: None when unset
    assert not launch._hooks_active()
    runtime.launch_enter_hook = print
    assert launch._hooks_active()
