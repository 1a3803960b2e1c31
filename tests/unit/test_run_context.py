"""The run context (rl/context.py): phases said to subscribers in order, events and taps, plugins; and the trainer's
loop run on CPU through a pool that has the `TrainerPool` protocol and nothing else."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from megatron_jetrl.rl.context import PLUGINS_ENV, RunContext
from megatron_jetrl.rollout.engine import TrainerPool


class Recorder:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def on_phase(self, run, phase):
        self.log.append((self.name, "begin", run.step, phase, run.current))

    def on_phase_end(self, run, phase, error):
        self.log.append((self.name, "end", run.step, phase, type(error).__name__ if error else None))

    def on_step_end(self, run, row):
        self.log.append((self.name, "row", run.step, dict(row)))

    def on_event(self, run, name, info):
        self.log.append((self.name, "event", name, info))


def test_subscribers_see_each_phase_in_order_and_ends_in_reverse():
    log = []
    run = RunContext()
    run.subscribe(Recorder("a", log))
    run.subscribe(Recorder("b", log))
    with run.phase("start-up"):
        pass
    run.step = 4
    with run.phase("rollout"), run.phase("inner"):
        assert run.current == "inner"
    assert run.current is None
    run.end_step({"step": 4})
    run.event("checkpoint_staged", step=5, directory="d")
    assert log == [
        ("a", "begin", None, "start-up", "start-up"),
        ("b", "begin", None, "start-up", "start-up"),
        ("b", "end", None, "start-up", None),
        ("a", "end", None, "start-up", None),
        ("a", "begin", 4, "rollout", "rollout"),
        ("b", "begin", 4, "rollout", "rollout"),
        ("a", "begin", 4, "inner", "inner"),
        ("b", "begin", 4, "inner", "inner"),
        ("b", "end", 4, "inner", None),
        ("a", "end", 4, "inner", None),
        ("b", "end", 4, "rollout", None),
        ("a", "end", 4, "rollout", None),
        ("a", "row", 4, {"step": 4}),
        ("b", "row", 4, {"step": 4}),
        ("a", "event", "checkpoint_staged", {"step": 5, "directory": "d"}),
        ("b", "event", "checkpoint_staged", {"step": 5, "directory": "d"}),
    ]


def test_an_exception_in_a_phase_is_seen_by_the_subscribers_and_keeps_the_position():
    log = []
    run = RunContext(step=2)
    run.subscribe(Recorder("a", log))
    with pytest.raises(ZeroDivisionError), run.phase("update"):
        1 / 0  # noqa: B018
    assert log[-1] == ("a", "end", 2, "update", "ZeroDivisionError")
    assert (run.step, run.current) == (2, "update")  # what the failure report names


class Raises:
    def on_phase(self, run, name):
        if name == "eval":
            raise RuntimeError("the subscriber's own error")


def test_a_raising_subscriber_is_reported_not_swallowed():
    log = []
    run = RunContext()
    run.subscribe(Recorder("a", log))
    run.subscribe(Raises())
    body = []
    with pytest.raises(RuntimeError, match="the subscriber's own error") as e, run.phase("eval"):
        body.append(1)
    assert not body  # the phase did not run
    assert "(raised by the run subscriber Raises.on_phase)" in e.value.__notes__
    assert log[-1] == ("a", "end", None, "eval", "RuntimeError")  # who had seen it begin sees it end


def test_taps_pass_the_value_through_every_subscriber_and_unknown_points_are_refused():
    class Double:
        def tap(self, run, point, value):
            return [2 * v for v in value] if point == "rewards" else value

    run = RunContext()
    assert run.tap("rewards", [1.0]) == [1.0]
    run.subscribe(Double())
    run.subscribe(Double())
    assert run.tap("rewards", [1.0, 0.5]) == [4.0, 2.0]
    assert run.tap("loss", 3) == 3
    with pytest.raises(KeyError, match="unknown run tap 'reward'"):
        run.tap("reward", [1.0])
    with pytest.raises(KeyError, match="unknown run event 'saved'"):
        run.event("saved")
    with pytest.raises(TypeError, match="has none of the run's hooks"):
        run.subscribe(object())


def test_plugins_are_called_with_the_context(tmp_path, monkeypatch):
    (tmp_path / "my_plugin.py").write_text("def install(run):\n    run.installed = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(PLUGINS_ENV, " my_plugin:install ")
    run = RunContext()
    assert run.load_plugins() == ["my_plugin:install"] and run.installed
    with pytest.raises(ValueError, match=r"JETRL_PLUGINS: 'my_plugin' is not module:function"):
        run.load_plugins("my_plugin")


class ProtocolOnly:
    """A `TrainerPool` with the protocol and nothing else: any other attribute the loop reaches for fails."""

    __slots__ = ("inner", "calls")
    weight_target = "rank0"

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def generate(self, prompts, sampling, *, request_seeds=None):
        self.calls.append("generate")
        return self.inner.generate(prompts, sampling, request_seeds=request_seeds)

    def sync(self, weights):
        self.calls.append("sync")
        return self.inner.sync(weights)

    def sleep(self):
        self.calls.append("sleep")

    def unmapped_bytes(self):
        return 0

    def metrics(self):
        return {"rollout/fake": 1.0}


def test_the_loop_runs_on_a_pool_that_has_only_the_protocol(one_gloo_rank, tmp_path, monkeypatch):
    from megatron_jetrl.rl import session, train

    assert isinstance(ProtocolOnly(None), TrainerPool)
    real = session.start_pool
    pools = []

    def start_pool(s):
        pools.append(ProtocolOnly(real(s)))
        s.pool = pools[-1]
        return s.pool

    monkeypatch.setattr(session, "start_pool", start_pool)
    out = tmp_path / "run"
    assert train.main([f"run.out_dir={out}", "run.steps=2", "warmup.steps=1", "run.export=false"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["rollout/fake"] == 1.0 for r in rows)
    assert all(r["mismatch/mean_abs_diff"] == 0 for r in rows)  # the native engines run the trainer's FP8 forward
    assert pools[0].calls[:3] == ["sync", "generate", "sleep"]
    assert torch.isfinite(torch.tensor([r["reward/mean"] for r in rows])).all()


@pytest.fixture
def one_gloo_rank(monkeypatch):
    """This process as a run's only rank, the trainer making its process group; all of it undone after."""
    import torch.distributed as dist
    from gloo import free_port

    from megatron_jetrl.actor.parallel import destroy_parallel

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    hook = sys.excepthook
    yield
    sys.excepthook = hook
    destroy_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    from patches import megatron_core_0_16_1_cpu as patch

    patch.revert()
