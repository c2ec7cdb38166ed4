"""cli.py: the one-line exit 2, the atomic file writes and the device / dtype "auto" every script uses."""

import json
import os
import stat
import subprocess
import sys

import pytest

from cli import (
    ArgumentParser,
    UserError,
    atomic_open,
    atomic_write,
    atomic_write_json,
    autocast_context,
    exit_on_user_error,
    resolve_device,
    resolve_dtype,
)


def test_user_error_exits_2_with_one_line_and_other_errors_keep_their_traceback(capsys):
    @exit_on_user_error
    def main(kind):
        if kind == "user":
            raise UserError("no checkpoint at x/best.pt; train first")
        if kind == "details":
            raise UserError("unknown config key 'q'", details="valid keys:\n  a = 1")
        if kind == "bug":
            raise KeyError("a bug")
        return 7

    assert main("ok") == 7
    with pytest.raises(SystemExit) as e:
        main("user")
    assert e.value.code == 2 and capsys.readouterr().err == "error: no checkpoint at x/best.pt; train first\n"
    with pytest.raises(SystemExit) as e:
        main("details")
    assert e.value.code == 2 and capsys.readouterr().err == "error: unknown config key 'q'\nvalid keys:\n  a = 1\n"
    with pytest.raises(KeyError):
        main("bug")


@pytest.mark.parametrize("script", ["eval_retrieval", "eval_extrapolate", "study.results"])
def test_a_bad_flag_is_one_line_naming_the_scripts_help_and_exit_2(script, capsys):
    import importlib

    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as e:
        module.main(["some-run", "--no_such_flag=1"])
    err = capsys.readouterr().err
    name = script.replace(".", "/") + ".py"
    assert e.value.code == 2 and err == f"error: unrecognized arguments: --no_such_flag=1 (see python {name} --help)\n"
    p = ArgumentParser(prog="x.py")
    p.add_argument("--n", type=int)
    with pytest.raises(UserError, match=r"^argument --n: invalid int value: 'a' \(see python x.py --help\)$"):
        p.parse_args(["--n=a"])


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = str(tmp_path / "sub" / "metrics.json")  # the folder is created
    atomic_write_json(path, {"loss": 1.5, "iter": [1, 2]})
    with open(path) as f:
        assert json.load(f) == {"loss": 1.5, "iter": [1, 2]}
    atomic_write(path, "é\n")  # str is written as UTF-8
    assert open(path, "rb").read() == "é\n".encode()
    atomic_write(path, b"\x00\x01")
    assert open(path, "rb").read() == b"\x00\x01"
    assert os.listdir(tmp_path / "sub") == ["metrics.json"]
    plain = tmp_path / "plain"
    plain.write_bytes(b"")  # the mode open() gives under this umask
    assert os.stat(path).st_mode & 0o777 == os.stat(plain).st_mode & 0o777


def test_a_crash_while_writing_keeps_the_old_file(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    atomic_write(path, b"old checkpoint")
    with pytest.raises(RuntimeError, match="crash"):
        with atomic_open(path) as f:
            f.write(b"half of a new one")
            raise RuntimeError("crash")
    assert open(path, "rb").read() == b"old checkpoint"
    assert os.listdir(tmp_path) == ["ckpt.pt"]


@pytest.mark.parametrize("how", ["atomic_write", "atomic_write_json", "atomic_open"])
def test_every_atomic_write_fsyncs_the_file_before_its_rename_and_then_the_folder(tmp_path, monkeypatch, how):
    """Durability: the data must be on disk before the rename is (else a power cut can leave an empty
    checkpoint under the final name), and the folder after it (POSIX). fsync and os.replace are recorded
    in order; each fsync is identified by the inode of what it flushed."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", st.st_ino, stat.S_ISDIR(st.st_mode)))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.stat(src).st_ino, False))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "out" / "ckpt.pt"
    if how == "atomic_write":
        atomic_write(str(path), b"weights")
    elif how == "atomic_write_json":
        atomic_write_json(str(path), {"iter": 1})
    else:
        with atomic_open(str(path)) as f:
            f.write(b"weights")
    ino = os.stat(path).st_ino  # the renamed temporary file keeps its inode
    assert events[:2] == [("fsync", ino, False), ("replace", ino, False)], events
    if os.name == "posix":
        assert events[2:] == [("fsync", os.stat(path.parent).st_ino, True)], events


def test_dtype_auto_is_float32_on_every_device_but_cuda(monkeypatch):
    """Not CUDA means float32, whatever the spelling: 'cpu:0' and 'mps' too, even where torch reports bf16."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    got = {d: resolve_dtype("auto", d) for d in ("cpu", "cpu:0", "mps", "mps:0", "cuda", "cuda:1")}
    assert got == {
        "cpu": "float32",
        "cpu:0": "float32",
        "mps": "float32",
        "mps:0": "float32",
        "cuda": "bfloat16",
        "cuda:1": "bfloat16",
    }


def test_device_and_dtype_auto(monkeypatch):
    """'auto' picks CUDA when torch sees it; dtype 'auto' is fp32 on a CPU, bf16 on a GPU of compute capability
    >= 8.0 (asked of the device named) and fp16 below (V100 sm_70, T4 sm_75); explicit names pass through,
    unknown ones are refused."""
    import torch

    for cuda, want in ((False, "cpu"), (True, "cuda")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        assert resolve_device("auto") == want
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == "cuda:1" and resolve_device("cpu") == "cpu"
    # a CUDA device that is not there: one line (exit 2 in the scripts), not a traceback at first use
    with pytest.raises(UserError, match=r"has 2 CUDA GPU\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0"):
        with pytest.raises(UserError, match="torch sees no CUDA GPU on this machine; use --device=cpu"):
            resolve_device(device)
    assert resolve_dtype("auto", "cpu") == "float32"
    asked = []

    def capability(device=None):
        asked.append(device)
        return cap

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    # torch 2.13's is_bf16_supported() counts emulation: True on a V100 / T4 too, so it must not decide
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    for cap, want in (
        ((9, 0), "bfloat16"),
        ((8, 0), "bfloat16"),
        ((8, 6), "bfloat16"),
        ((7, 5), "float16"),
        ((7, 0), "float16"),
    ):
        asked.clear()
        assert resolve_dtype("auto", "cuda") == resolve_dtype("auto", "cuda:1") == want, cap
        assert asked == [torch.device("cuda"), torch.device("cuda:1")]  # the device named, not the current one
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16" and resolve_dtype("float32", "cuda") == "float32"
    with pytest.raises(
        UserError, match=r"dtype must be 'auto' or one of \['bfloat16', 'float16', 'float32'\], got 'fp16'"
    ):
        resolve_dtype("fp16", "cpu")


def test_autocast_context_runs_matmuls_in_the_dtype():
    import torch

    a = torch.randn(4, 4)
    with autocast_context("cpu", "float32"):
        assert (a @ a).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
    ctx = autocast_context("cpu", "bfloat16")
    for _ in range(2):  # reusable, as train.py's loop uses it
        with ctx:
            assert (a @ a).dtype == torch.bfloat16
    assert (a @ a).dtype == torch.float32
    with autocast_context("cpu", "float16"):  # a float16 run's forward passes run in float16, not float32
        assert (a @ a).dtype == torch.float16


@pytest.mark.parametrize("cuda", [False, True])
def test_a_misspelled_device_is_refused_in_one_line_by_every_script(monkeypatch, capsys, cuda):
    """'gpu', 'cdua', 'cuda1', 'CPU': a name torch does not know exits 2 naming the valid ones, with or without a
    GPU (not a traceback at the first tensor moved there); names torch knows pass through."""
    import torch

    import bench
    import sample
    import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(cuda))
    for name in ("gpu", "cdua", "cuda1", "CPU", "cpu0", ""):
        with pytest.raises(UserError, match=f"device {name!r} is not a device name; use cuda, cuda:N, cpu or auto"):
            resolve_device(name)
    assert [resolve_device(d) for d in ("cpu", "cpu:0", "meta")] == ["cpu", "cpu:0", "meta"]
    for main, argv in (
        (train.main, ["--device=gpu", "--max_iters=1"]),
        (sample.main, ["--device=gpu"]),
        (bench.main, ["--device=gpu", "--only=memory"]),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        out = capsys.readouterr()
        assert e.value.code == 2 and out.out == "", main
        assert (
            out.err.strip()
            .splitlines()[-1]
            .endswith("device 'gpu' is not a device name; use cuda, cuda:N, cpu or auto")
        )
        assert "Traceback" not in out.err


def test_bench_on_cuda_without_a_gpu_exits_2_before_any_benchmark(monkeypatch, capsys):
    import torch

    import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ran = []
    for name in ("bench_train_step", "bench_attention", "bench_memory", "bench_decode"):
        monkeypatch.setattr(bench, name, lambda *a, _n=name, **k: ran.append(_n) or [])
    for device in ("cuda", "cuda:1"):
        with pytest.raises(SystemExit) as e:
            bench.main([f"--device={device}", "--rounds=5"])
        out = capsys.readouterr()
        assert e.value.code == 2 and out.out == "" and ran == []
        assert (
            out.err.strip()
            .splitlines()[-1]
            .endswith(f"device {device!r}: torch sees no CUDA GPU on this machine; use --device=cpu (or auto)")
        )


def test_compile_is_true_false_or_unset():
    """train.py's and sample.py's --compile: unset means on for CUDA only; the text 'false' (what --compile=false
    parses to) is refused, not taken as truthy."""
    from cli import UserError, resolve_compile

    assert resolve_compile(None, "cuda:1") is True and resolve_compile(None, "cpu") is False
    assert resolve_compile(False, "cuda") is False and resolve_compile(True, "cpu") is True
    for bad in ("false", "off", 0):
        with pytest.raises(UserError, match="compile must be True or False"):
            resolve_compile(bad, "cuda")


def test_a_setting_refused_under_torchrun_prints_its_line_once_and_every_rank_exits_2(tmp_path):
    """A real torchrun of 2 gloo processes with a refused setting (2 ranks, gradient_accumulation_steps=1): rank 0
    prints the one 'error:' line, the other rank nothing; each exits 2 (unless torchrun, seeing the first exit,
    stops it), and torchrun's report (it exits 1) shows the line as the root cause's traceback instead of
    '<N/A>', so the line buried in it is found there too."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
        + ["--device=cpu", "--gradient_accumulation_steps=1", f"--out_dir={tmp_path / 'out'}"],
        cwd=repo,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = "error: gradient_accumulation_steps=1 must be divisible by the 2 processes"
    assert p.returncode == 1, p.stderr[-2000:]
    printed = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(printed) <= 1 and all(x.startswith(line) for x in printed), p.stderr  # never once per rank
    root = p.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert "exitcode  : 2 " in root and f"traceback : {line}" in root, p.stderr
    # each rank exits 2 and says why, unless torchrun stopped it first (SIGTERM to the survivors of a failure)
    failures = p.stderr.split("Failures:", 1)[1].split("Root Cause", 1)[0]
    assert f"traceback : {line}" in failures or "SIGTERM" in failures or "<NO_OTHER_FAILURES>" in failures
    assert not os.path.exists(tmp_path / "out")
