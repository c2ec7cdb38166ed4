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
for path in (os.path.join(REPO, "study"), REPO):  # the study scripts import as `import results`, as they run
    if path not in sys.path:
        sys.path.insert(0, path)


def _fp32_precision_flags():
    """The (object, attribute) pairs that decide whether fp32 CUDA matmuls may use TF32: torch >= 2.9's
    fp32_precision of cuda.matmul and cudnn and the process-wide torch.backends.fp32_precision that their 'none'
    inherits (transformers' enable_tf32 sets that one), else the legacy allow_tf32 flags."""
    b = torch.backends
    flags = [(o, "fp32_precision") for o in (b, b.cuda.matmul, b.cudnn)]  # the process-wide one first
    if not all(hasattr(o, a) for o, a in flags):  # torch < 2.9: the legacy flags only
        flags = [(o, "allow_tf32") for o in (b.cuda.matmul, b.cudnn)]
    return flags


# What the process started with, read before any fixture runs: a session or module fixture that trains on CUDA
# (train.main turns TF32 on) runs before a test's function fixtures, so a value read per test could already be TF32.
_FP32_PRECISION_AT_START = [(o, a, getattr(o, a)) for o, a in _fp32_precision_flags()]
_MATMUL_PRECISION_AT_START = torch.get_float32_matmul_precision()  # read now: after a mix of APIs reading raises


def _set_fp32_precision(saved):
    # the legacy setting first (train.py's allow_tf32 = True leaves it 'high', which Inductor reads), then the flags
    torch.set_float32_matmul_precision(_MATMUL_PRECISION_AT_START)
    for o, a, value in saved:
        if getattr(o, a) != value:
            setattr(o, a, value)


@pytest.fixture(autouse=True)
def _tf32_restored():
    """Every test starts and ends with the process's starting fp32 matmul precision (no TF32 unless the process
    started with it). train.main turns TF32 on for a CUDA run (setup_processes), for the whole process: on a GPU
    machine a training test, or a session fixture that trains, left later tests in its worker with TF32 matmuls,
    so that the Triton kernel's fp32 dots (pope_kernel.dot_precision follows torch's setting) missed their 1e-5
    references by 1e-3 (seen on an H200, twice: per-test saving missed the fixtures' and the process-wide flag)."""
    _set_fp32_precision(_FP32_PRECISION_AT_START)
    yield
    _set_fp32_precision(_FP32_PRECISION_AT_START)


def old_triton_interpreter():
    """A skip reason where the installed Triton's interpreter cannot run pope_kernel, else None. Triton 3.6's
    interpreter (the H200 image's) fails every kernel at its first key loop (`range(lo, hi, BLOCK_N)`: "only
    0-dimensional arrays can be converted to Python scalars"); 3.7.1 (requirements.txt) and 3.9.0 run them. For the
    tests that run gloo ranks with TRITON_INTERPRET=1 also on a GPU machine."""
    try:
        import triton
    except ImportError:
        return None
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7):
        return f"Triton {triton.__version__}'s interpreter cannot run pope_kernel's loops (3.7.1 can: requirements.txt)"
    return None


@pytest.fixture(scope="session")
def tiny_indirect(tmp_path_factory):
    """A small indirect-indexing dataset (2,000 / 200 / 200 examples) in a session temp dir."""
    from prepare.indirect_indexing import prepare

    root = tmp_path_factory.mktemp("data")
    prepare(str(root / "indirect_indexing"), n_train=2000, n_val=200, n_test=200, seed=0)
    return str(root)


CHAR_TEXT = "to be, or not to be: that is the question. " * 40


@pytest.fixture
def small_indirect_splits(monkeypatch):
    """Call it with (n_train, n_val, n_test): from then on, building an indirect-indexing dataset (what
    train.py does on first use) writes splits of those sizes instead of 1M / 10k / 10k, so a test is fast."""
    from prepare import indirect_indexing

    real = indirect_indexing.prepare

    def shrink(n_train, n_val, n_test):
        def small(out_dir, n_train_=None, n_val_=None, n_test_=None, seed=1337, **variant):
            return real(out_dir, n_train=n_train, n_val=n_val, n_test=n_test, seed=seed, **variant)

        monkeypatch.setattr(indirect_indexing, "prepare", small)

    return shrink


def char_dataset(folder, text, name):
    """A character-level stream dataset like data/shakespeare_char: the same text in train, val and
    test, tokenizer {"kind": "char", "itos": sorted characters of text}."""
    import numpy as np

    from prepare.common import BinWriter, write_meta

    itos = sorted(set(text))
    ids = np.array([itos.index(c) for c in text])
    for split in ("train", "val", "test"):
        with BinWriter(os.path.join(folder, f"{split}.bin"), np.uint8) as w:
            w.write(ids)
    write_meta(
        folder,
        {
            "dataset": name,
            "vocab_size": len(itos),
            "dtype": "uint8",
            "layout": "stream",
            "splits": {
                s: {"file": f"{s}.bin", "shape": [len(ids)], "tokens": len(ids)} for s in ("train", "val", "test")
            },
            "pad_id": None,
            "loss": "all",
            "tokenizer": {"kind": "char", "itos": itos},
        },
    )


@pytest.fixture(scope="session")
def char_pretrained(tmp_path_factory):
    """Three character-level datasets under <root>/data and a tiny RoPE run pretrained on one of them
    (block_size 16, 60 steps), for the fine-tuning and evaluation guards:
      chars           CHAR_TEXT;
      chars_shuffled  CHAR_TEXT's characters in a random order: the same tokenizer, a higher loss;
      chars_upper     CHAR_TEXT upper-cased: the same vocab_size, other symbols (another tokenizer).
    Returns {"root", "data_root", "run", "args"}; args: train.py arguments of the run but out_dir.
    Tests that write must copy the run folder first."""
    import random

    import train

    root = tmp_path_factory.mktemp("char_pretrained")
    data_root = str(root / "data")
    shuffled = list(CHAR_TEXT)
    random.Random(0).shuffle(shuffled)
    for name, text in (("chars", CHAR_TEXT), ("chars_shuffled", "".join(shuffled)), ("chars_upper", CHAR_TEXT.upper())):
        char_dataset(os.path.join(data_root, name), text, name)
    args = [
        "--n_layer=2",
        "--n_head=2",
        "--n_embd=32",
        "--batch_size=8",
        "--eval_iters=2",
        "--log_interval=4",
        "--warmup_iters=2",
        "--attn_backend=torch",
        "--compile=False",
        "--device=cpu",
        "--block_size=16",
        "--pos_encoding=rope",
        "--dropout=0.0",
        "--bias=False",
        "--gradient_accumulation_steps=1",
        "--grad_clip=1.0",
        "--weight_decay=0.01",
        f"--data_root={data_root}",
        "--dataset=chars",
    ]  # all explicit: defaults may change
    run = str(root / "pre")
    train.main(
        args + ["--max_iters=60", "--eval_interval=30", "--learning_rate=1e-2", "--min_lr=1e-3", f"--out_dir={run}"]
    )
    return {"root": str(root), "data_root": data_root, "run": run, "args": args}


@pytest.fixture
def toy_stream(tmp_path):
    """A stream dataset whose next token is a fixed function of the current one: learnable fast."""
    import numpy as np

    from prepare.common import BinWriter, write_meta

    root = tmp_path / "data"
    path = root / "toy"
    seq = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7] * 300) % 16
    for split in ("train", "val", "test"):
        with BinWriter(str(path / f"{split}.bin"), np.uint16) as w:
            w.write(seq)
    write_meta(
        str(path),
        {
            "dataset": "toy",
            "vocab_size": 16,
            "dtype": "uint16",
            "layout": "stream",
            "splits": {
                s: {"file": f"{s}.bin", "shape": [len(seq)], "tokens": len(seq)} for s in ("train", "val", "test")
            },
            "pad_id": None,
            "loss": "all",
            "tokenizer": {"kind": "none"},
        },
    )
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


if os.environ.get("POPE_FAILLOG") and not os.environ.get("PYTEST_XDIST_WORKER"):
    # tests/gpu_check.sh: each failure's report is appended as it happens, so a run stopped at its time
    # limit still names its failures and their tracebacks (pytest's summary comes only at the end); under
    # pytest-xdist the controller writes them, once each
    def pytest_runtest_logreport(report):
        if report.failed:
            with open(os.environ["POPE_FAILLOG"], "a") as f:
                f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}\n")
