"""Every run says where it came from (provenance.py): the code's commit, the libraries, the machine, the data."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import provenance
from prepare.common import BinWriter, write_meta

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--dataset=toy",
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=16",
    "--block_size=16",
    "--batch_size=2",
    "--max_iters=2",
    "--eval_interval=2",
    "--eval_iters=1",
    "--log_interval=1",
    "--attn_backend=torch",
    "--compile=False",
    "--device=cpu",
    "--dtype=float32",
]


def _git(cwd, *args):
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def _code_copy(dest):
    """The repo's Python code (no tests, docs or data) copied to dest, which is not a git checkout."""
    shutil.copytree(
        REPO,
        dest,
        ignore=shutil.ignore_patterns(".git", "tests", "docs", "assets", "data", "out*", "__pycache__", "*.png"),
    )
    return dest


def _toy_data(root):
    seq = np.array([3, 1, 4, 1, 5, 9, 2, 6] * 40) % 16
    for split in ("train", "val", "test"):
        with BinWriter(str(root / "toy" / f"{split}.bin"), np.uint16) as w:
            w.write(seq)
    write_meta(
        str(root / "toy"),
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


def _train(code, data_root, out):
    """python train.py run from the code copy, with the working directory elsewhere; returns metrics.json."""
    p = subprocess.run(
        [sys.executable, os.path.join(code, "train.py"), *TINY, f"--data_root={data_root}", f"--out_dir={out}"],
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads((out / "metrics.json").read_text())


def test_a_run_records_the_commit_of_its_checkout_dirty_after_an_edit_and_unknown_outside_git(tmp_path):
    code = _code_copy(tmp_path / "code")
    _toy_data(tmp_path / "data")
    _git(code, "init", "-q")
    _git(code, "add", "-A")
    _git(code, "commit", "-q", "-m", "the code")
    head = _git(code, "rev-parse", "HEAD")
    with open(code / "model.py", "a") as f:
        f.write("\n# an uncommitted edit\n")
    m = _train(code, tmp_path / "data", tmp_path / "out-dirty")
    prov = m["provenance"]
    assert prov["code"] == {"commit": head, "dirty": True}  # the checkout it ran in, not the working directory's
    assert prov["versions"]["torch"] == torch.__version__ and prov["versions"]["numpy"] == np.__version__
    assert prov["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout if shutil.which("lscpu") else ""
    names = [ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")]
    if names:  # an independent reading of this CPU's model name
        assert prov["device"]["cpu"] == names[0]
    assert prov["device"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert prov["device"]["threads"] == 1 and prov["device"]["gpus"] == {} and prov["world_size"] == 1
    sizes = {s: os.path.getsize(tmp_path / "data" / "toy" / f"{s}.bin") for s in ("test", "train", "val")}
    assert {s: v["bytes"] for s, v in prov["data"]["splits"].items()} == sizes
    # the checkpoints carry it too, one entry per process
    state = torch.load(tmp_path / "out-dirty" / "best.pt", weights_only=True)
    assert state["provenance"] == [prov]

    shutil.rmtree(code / ".git")  # a tarball of the code: still runs, and says so
    m = _train(code, tmp_path / "data", tmp_path / "out-nogit")
    assert m["provenance"]["code"] == {"commit": "unknown", "dirty": "unknown"} and "test" in m


def test_untracked_files_do_not_make_the_tree_dirty(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-q", "-m", "a")
    (tmp_path / "out-run").mkdir()
    (tmp_path / "out-run" / "ckpt.pt").write_text("")  # what every run leaves beside the code
    assert provenance.code_version(str(tmp_path))["dirty"] is False
    (tmp_path / "a.py").write_text("x = 2\n")
    assert provenance.code_version(str(tmp_path))["dirty"] is True


def test_data_fingerprint_sees_a_change_at_either_end_of_a_split_and_nothing_else(tmp_path):
    seq = np.arange(3 << 19, dtype=np.uint16)  # 3 MB: a first MB, a middle, a last MB
    path = tmp_path / "d"
    with BinWriter(str(path / "train.bin"), np.uint16) as w:
        w.write(seq)
    write_meta(
        str(path),
        {
            "dataset": "d",
            "vocab_size": 1 << 16,
            "dtype": "uint16",
            "layout": "stream",
            "splits": {"train": {"file": "train.bin", "shape": [len(seq)], "tokens": len(seq)}},
            "loss": "all",
            "tokenizer": {"kind": "none"},
        },
    )
    base = provenance.dataset_fingerprint(str(path))
    assert base["splits"]["train"]["bytes"] == seq.nbytes and len(base["digest"]) == 16

    def digest_after(index):
        s = seq.copy()
        s[index] ^= 1  # flip one bit: a different token (no uint16 overflow at 65535)
        s.tofile(path / "train.bin")
        return provenance.dataset_fingerprint(str(path))["digest"]

    assert digest_after(0) != base["digest"]
    assert digest_after(len(seq) - 1) != base["digest"]  # the last MB is hashed too
    assert digest_after(len(seq) // 2) == base["digest"]  # the middle is not read: cheap at any size
    assert provenance.dataset_fingerprint(str(tmp_path / "missing"))["digest"] == "unknown"


def test_machine_commit_and_libraries_name_what_results_py_compares():
    prov = {
        "code": {"commit": "a" * 40, "dirty": True},
        "versions": {"python": "3.11.7", "torch": "2.13.0+cpu", "triton": "3.7.1", "numpy": "2.4.6"},
        "device": {"cpu": "AMD EPYC 7B13", "cpu_capability": "AVX2", "threads": 1, "gpus": {}},
    }
    assert provenance.machine(prov) == "AMD EPYC 7B13 (AVX2)"
    assert provenance.commit(prov) == "a" * 12 + "+dirty"
    assert provenance.libraries(prov) == "torch 2.13.0+cpu, triton 3.7.1, numpy 2.4.6, python 3.11.7"
    prov["device"]["gpus"] = {"NVIDIA H100 80GB HBM3": 8}
    assert provenance.machine(prov) == "8 x NVIDIA H100 80GB HBM3"
    assert provenance.machine(None) == provenance.commit(None) == provenance.libraries({}) == "unknown"


# ---- round five (issue 43): what tells two runs apart ----


def test_library_versions_are_the_installed_ones_triton_included_and_a_triton_change_is_a_mix(tmp_path):
    import platform

    import triton

    import results

    assert provenance.library_versions() == {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "numpy": np.__version__,
    }
    here = provenance.provenance()
    assert provenance.libraries(here) == (
        f"torch {torch.__version__}, triton {triton.__version__}, "
        f"numpy {np.__version__}, python {platform.python_version()}"
    )
    other = json.loads(json.dumps(here))
    another = "3.7.1" if triton.__version__ != "3.7.1" else "3.9.0"  # a Triton other than the installed one
    other["versions"]["triton"] = another
    assert provenance.libraries(other) != provenance.libraries(here)
    runs = []  # two runs of one setting, the second on another Triton: study/results.py warns that they mix libraries
    for i, p in enumerate((here, other)):
        config = {"dataset": "toy", "pos_encoding": "pope", "seed": i, "out_dir": f"out/{i}"}
        m = {"dataset": "toy", "config": config, "provenance": p, "test": {"loss": 1.0, "ppl": 2.7, "acc": 0.5}}
        (tmp_path / f"{i}.json").write_text(json.dumps(m))
        runs.append(str(tmp_path / f"{i}.json"))
    notes = results.summarize(runs)[2]["notes"]
    assert len(notes) == 1 and "mixes library versions" in notes[0] and f"triton {another}" in notes[0]


def test_a_gpu_run_records_how_many_gpus_of_each_kind(monkeypatch):
    names = ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: names[i])
    info = provenance.device_info("cuda:1")
    assert info["device"] == "cuda:1" and info["gpus"] == {"NVIDIA A100-SXM4-80GB": 2, "NVIDIA H100 80GB HBM3": 1}
    assert provenance.machine({"device": info}) == "2 x NVIDIA A100-SXM4-80GB, 1 x NVIDIA H100 80GB HBM3"
    names[:] = names[:1]  # one GPU of the same kind is another machine
    assert provenance.machine({"device": provenance.device_info("cuda")}) == "1 x NVIDIA A100-SXM4-80GB"
    cpu = provenance.device_info("cpu")  # a CPU run on a GPU machine names the CPU
    assert cpu["gpus"] == {} and provenance.machine({"device": cpu}).startswith(provenance.cpu_model())
    assert provenance.flat(provenance.provenance(device="cuda", world_size=8))["world_size"] == "8"


def test_the_same_token_ids_from_another_tokenizer_are_other_data(tmp_path):
    seq = (np.arange(4000) % 50).astype(np.uint16)
    folders = {}
    for name, chars in (
        ("a", "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWX"),
        ("b", "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "abcdefghijklmnopqrstuvwx"),
        ("c", "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWX"),
    ):
        path = tmp_path / name
        with BinWriter(str(path / "train.bin"), np.uint16) as w:
            w.write(seq)
        write_meta(
            str(path),
            {
                "dataset": "d",
                "vocab_size": 50,
                "dtype": "uint16",
                "layout": "stream",
                "splits": {"train": {"file": "train.bin", "shape": [len(seq)], "tokens": len(seq)}},
                "loss": "all",
                "tokenizer": {"kind": "char", "chars": chars},
            },
        )
        folders[name] = provenance.dataset_fingerprint(str(path))
    assert folders["a"]["splits"] == folders["b"]["splits"]  # the same bytes in the .bin
    assert folders["a"]["digest"] != folders["b"]["digest"]  # but another tokenizer: other text
    assert folders["a"]["digest"] == folders["c"]["digest"]  # the same preparation in another folder: the same


# ---- issue 53: the machine is what decides the numbers ----


def _device_record(**env):
    """provenance.device_info('cpu') of a fresh process with exactly these ISA variables set."""
    clean = {k: v for k, v in os.environ.items() if k not in provenance.ISA_ENV and k != "ONEDNN_VERBOSE"}
    p = subprocess.run(
        [sys.executable, "-c", "import json, provenance; print(json.dumps(provenance.device_info('cpu')))"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **env},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _onednn_isa_by_its_own_verbose(**env):
    """oneDNN's instruction set as ONEDNN_VERBOSE=1 prints it (the reference, read without provenance.py)."""
    clean = {k: v for k, v in os.environ.items() if k not in provenance.ISA_ENV}
    p = subprocess.run(
        [sys.executable, "-c", "import torch; torch.ones(4, 4).to_mkldnn().to_dense()"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, "ONEDNN_VERBOSE": "1", **env},
    )
    return next(line.split("isa:", 1)[1].strip() for line in p.stdout.splitlines() if ",isa:" in line)


def _mkl_isa_by_its_own_verbose():
    """MKL's code path as MKL_VERBOSE=1 names it for a float32 matmul, or "unknown" where MKL prints no header."""
    clean = {k: v for k, v in os.environ.items() if k not in provenance.ISA_ENV}
    code = "import torch; a = torch.ones(8, 8); a @ a"
    env = {**clean, "MKL_VERBOSE": "1"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    m = re.search(r"architecture (.*?processors)", p.stdout)
    return m.group(1) if m else provenance.UNKNOWN


def test_the_machine_names_atens_mkls_and_onednns_instruction_sets_and_what_forces_them(tmp_path):
    """ATEN_CPU_CAPABILITY=avx2 on an AVX512 machine moves ATen only: the record named it "<cpu> (AVX2)", the
    name of a real AVX2 machine. The record now holds the CPU model (/proc/cpuinfo), ATen's capability,
    MKL's and oneDNN's own instruction sets (oneDNN's as its ONEDNN_VERBOSE says) and the variables set, and
    study/results.py warns when the runs of a comparison differ in any of them."""
    from test_results_compare import arms, prov

    import results

    if not (torch.backends.mkldnn.is_available() and torch.backends.mkl.is_available()):
        pytest.skip("this torch has no MKL or oneDNN")
    plain = _device_record()
    with open("/proc/cpuinfo") as f:
        model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    assert plain["cpu"] == model and plain["isa_env"] == {}
    assert plain["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert plain["onednn_isa"] == _onednn_isa_by_its_own_verbose()
    # the processors MKL's verbose header names; "unknown" where this torch's matmul does not call MKL (torch
    # 2.11+cu130 on a Xeon: no MKL_VERBOSE line), as MKL's own verbose, read without provenance.py, says
    assert plain["mkl_isa"] == _mkl_isa_by_its_own_verbose(), plain
    if plain["cpu_capability"] not in ("AVX2", "AVX512"):
        pytest.skip(f"ATEN_CPU_CAPABILITY=avx2 needs an AVX2 CPU, this one has {plain['cpu_capability']}")
    aten = _device_record(ATEN_CPU_CAPABILITY="avx2")
    assert aten["cpu_capability"] == "AVX2" and aten["isa_env"] == {"ATEN_CPU_CAPABILITY": "avx2"}
    assert aten["onednn_isa"] == plain["onednn_isa"] and aten["mkl_isa"] == plain["mkl_isa"]  # ATen's alone moved
    assert provenance.machine({"device": aten}) != f"{model} (AVX2)"  # not the name of an AVX2 machine
    assert provenance.machine({"device": aten}) != provenance.machine({"device": plain})
    dnn = _device_record(ONEDNN_MAX_CPU_ISA="AVX2")
    assert dnn["onednn_isa"] == _onednn_isa_by_its_own_verbose(ONEDNN_MAX_CPU_ISA="AVX2")
    assert dnn["cpu_capability"] == plain["cpu_capability"] and "ONEDNN_MAX_CPU_ISA=AVX2" in provenance.machine(
        {"device": dnn}
    )
    assert provenance.machine({"device": dnn}) != provenance.machine({"device": plain})

    def with_device(device):
        return {**prov(), "device": device}

    for other in (aten, dnn):
        folder = tmp_path / next(iter(other["isa_env"]))
        folder.mkdir()
        paths = arms(
            folder,
            [1.0, 1.1, 1.2],
            [1.0, 1.1, 1.3],
            provs={("pope", i): with_device(plain) for i in range(3)}
            | {("rope", 0): with_device(other), ("rope", 1): with_device(plain), ("rope", 2): with_device(plain)},
        )
        c = results.compare(paths, "pos_encoding")
        assert any(n.startswith("warning: the group pos_encoding=rope mixes machines") for n in c["notes"]), c["notes"]
        assert any(n.startswith("warning: the two arms differ in machines") for n in c["notes"]), c["notes"]
