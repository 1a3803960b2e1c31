"""tools/bench/bench_host.py --against: a directory that is not a checkout is refused before any process starts."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench_host():
    spec = importlib.util.spec_from_file_location("bench_host", ROOT / "tools" / "bench" / "bench_host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_against_a_directory_without_the_package_is_refused(tmp_path, capsys, monkeypatch):
    bench = _bench_host()
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("no process")))
    assert bench.main(["--against", str(tmp_path)]) == 2
    assert "holds no megatron_jetrl package" in capsys.readouterr().err
