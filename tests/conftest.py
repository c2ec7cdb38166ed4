import os
import sys

import pytest

# One thread per torch process: the suite's models are tiny, and on a shared 2-core machine two
# OpenMP threads per process spin against each other (a 60-step toy run: 55 s with 2 threads under
# load, 5 s with 1). Set before torch is imported, so subprocesses (train.py, sample.py) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after OMP_NUM_THREADS; importing torch does not import triton)

# Without CUDA the Triton kernels run in Triton's interpreter on CPU tensors. pope_kernel's @triton.jit
# decorators choose the interpreter when they run, at import, so the flag is set here, before any test
# module imports pope / pope_kernel / model. Subprocesses inherit it (harmless: on CPU they take the
# torch path); the compile-only kernel tests drop it from their subprocess's environment.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


@pytest.fixture(scope="session")
def tiny_indirect(tmp_path_factory):
    """A small indirect-indexing dataset (2,000 / 200 / 200 examples) in a session temp dir."""
    from prepare.indirect_indexing import prepare
    root = tmp_path_factory.mktemp("data")
    prepare(str(root / "indirect_indexing"), n_train=2000, n_val=200, n_test=200, seed=0)
    return str(root)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow (see README, Tests)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: longer than a few seconds on 2 CPU cores; run with --runslow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
