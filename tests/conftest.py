import os
import sys

import pytest
import torch
from hypothesis import settings

# CI draws the same examples on every run (a landing never depends on luck); a developer's run draws new ones
# and keeps finding cases. JETRL_HYPOTHESIS=ci is set by .ci/run.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.load_profile(os.environ.get("JETRL_HYPOTHESIS", "default"))

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run tools/gpu/run_gpu_tests.sh on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def scratch_tmpdir():
    """The processes the tests start (torchrun makes a torchelastic_* directory per launch, the launcher its exit
    directories) write their temporary files under one directory, removed when the session ends; pytest's own
    tmp_path directories are kept only for failed tests (pyproject.toml: tmp_path_retention_policy)."""
    import shutil
    import tempfile

    scratch = tempfile.mkdtemp(prefix="jetrl-tests-")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = scratch
    yield scratch
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    shutil.rmtree(scratch, ignore_errors=True)
