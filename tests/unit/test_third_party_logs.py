"""The two third-party lines megatron_jetrl/third_party_logs.py drops: only those lines, everything else passes."""

import logging

import megatron_jetrl  # noqa: F401  (installs the filters)


def test_only_the_two_lines_are_dropped(caplog):
    caplog.set_level(logging.INFO)
    layer, ext = logging.getLogger("megatron.core.transformer.transformer_layer"), logging.getLogger("torch.utils.cpp_extension")
    layer.warning("Unknown MLP type: <class 'megatron.core.transformer.spec_utils.ModuleSpec'>. Using default kwargs.")
    ext.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local/cuda")
    layer.warning("Unknown MLP type: <class 'something.Else'>. Using default kwargs.")
    ext.warning("Error building extension 'x'")
    assert [r.getMessage() for r in caplog.records] == [
        "Unknown MLP type: <class 'something.Else'>. Using default kwargs.",
        "Error building extension 'x'",
    ]


def test_a_run_prints_neither_line():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import megatron_jetrl.actor.fp8_layers, torch.utils.cpp_extension"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "No CUDA runtime is found" not in out.stderr, out.stderr
