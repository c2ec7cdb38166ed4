"""Where a run came from: the code, the libraries, the machine and the data.

At CPU scale a seed is a draw that depends on the machine (the same seed on an AVX2 and an AVX512 CPU
can leave a plateau or not), so every result records what produced it. train.py stores
`provenance(...)` in metrics.json and in its checkpoints, eval_extrapolate.py in every CSV row
(`flat(...)`), and study/results.py warns when a group of runs mixes machines, commits or libraries.

    {"code":     {"commit": "5e30c42...", "dirty": False},        # "unknown" outside a git checkout
     "versions": {"python": "3.11.7", "torch": "2.13.0+cpu", "triton": "3.7.1", "numpy": "2.4.6"},
     "device":   {"device": "cpu", "cpu": "AMD EPYC 7B13", "cpu_capability": "AVX2",
                  "mkl_isa": "Intel(R) Architecture processors", "onednn_isa": "Intel AVX2",
                  "isa_env": {},                                   # e.g. {"ATEN_CPU_CAPABILITY": "avx2"}
                  "threads": 1, "gpus": {}},                       # or {"NVIDIA H100 80GB HBM3": 8}
     "world_size": 1,
     "data":     {"dir": "data/shakespeare_char", "meta_sha256": "...",
                  "splits": {"train": {"bytes": 2003214, "sha256_ends": "..."}, ...}, "digest": "1f3a..."}}

Nothing here raises: what cannot be read is "unknown".
"""

import hashlib
import json
import os
import platform
import subprocess

from prepare.common import sha256_file

UNKNOWN = "unknown"
REPO = os.path.dirname(os.path.abspath(__file__))
END_BYTES = 1 << 20  # the data fingerprint hashes the first and the last MB of each split


def code_version(path=REPO):
    """{"commit": the HEAD sha of the git checkout holding `path`, "dirty": True if a tracked file differs
    from it}; both "unknown" outside a git checkout or without git. Untracked files (out/, data/) do not count."""

    def git(*args):
        return subprocess.run(["git", "-C", path, *args], capture_output=True, text=True, timeout=20)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": UNKNOWN, "dirty": UNKNOWN}
        status = git("status", "--porcelain", "--untracked-files=no")
        return {
            "commit": head.stdout.strip(),
            "dirty": bool(status.stdout.strip()) if status.returncode == 0 else UNKNOWN,
        }
    except (OSError, subprocess.SubprocessError):
        return {"commit": UNKNOWN, "dirty": UNKNOWN}


def library_versions():
    """{"python", "torch", "triton", "numpy"}: version strings, "unknown" for a library that is not installed."""
    out = {"python": platform.python_version()}
    for name in ("torch", "triton", "numpy"):
        try:
            out[name] = str(__import__(name).__version__)  # plain str: checkpoints load with weights_only
        except Exception:  # not installed, or broken
            out[name] = UNKNOWN
    return out


def cpu_model():
    """The CPU's model name ("AMD EPYC 7B13"), from /proc/cpuinfo on Linux, else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or UNKNOWN


ISA_ENV = (
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_DEBUG_CPU_TYPE",
    "MKL_CBWR",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
)  # the variables that force an instruction set on torch's ATen, MKL and oneDNN


def _stdout_of(fn):
    """What fn() writes to file descriptor 1 (C libraries' printf included), captured through a temporary file."""
    import ctypes
    import sys
    import tempfile

    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 1)
        try:
            fn()
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        return f.read().decode("utf-8", "replace")


_LIBRARY_ISA = {}


def library_isa():
    """{"mkl": MKL's code path, "onednn": oneDNN's instruction set}, as each library names it in its verbose
    output for one tiny call: oneDNN "Intel AVX2", "Intel AVX-512 with Intel DL Boost and bfloat16 support";
    MKL the processors its header names ("Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled
    processors" on Intel CPUs; "Intel(R) Architecture processors", its generic path, on this AMD EPYC).
    "unavailable" where torch was built without the library, "unknown" where nothing could be read. Read
    once per process (the first reading is the one the process's numbers come from)."""
    if _LIBRARY_ISA:
        return dict(_LIBRARY_ISA)
    import re

    out = {"mkl": UNKNOWN, "onednn": UNKNOWN}
    try:
        import torch

        if not torch.backends.mkl.is_available():
            out["mkl"] = "unavailable"
        else:

            def mkl():
                with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
                    a = torch.ones(8, 8)
                    a @ a

            m = re.search(r"architecture (.*?processors)", _stdout_of(mkl))
            out["mkl"] = m.group(1) if m else UNKNOWN
        if not torch.backends.mkldnn.is_available():
            out["onednn"] = "unavailable"
        else:

            def onednn():
                with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                    torch.ones(4, 4).to_mkldnn().to_dense()

            m = re.search(r"info,cpu,isa:([^\n]*)", _stdout_of(onednn))
            out["onednn"] = m.group(1).strip() if m else UNKNOWN
    except Exception:
        pass
    if UNKNOWN not in out.values():
        _LIBRARY_ISA.update(out)
    return out


def device_info(device="cpu"):
    """The machine: {"device" (the torch device the run used), "cpu" (model name), "cpu_capability" (the SIMD
    level torch's ATen kernels use: "AVX2", "AVX512", ...), "mkl_isa" and "onednn_isa" (the instruction sets
    MKL and oneDNN chose on their own: library_isa), "isa_env" ({name: value} of the ISA_ENV variables set,
    which force them), "threads" (torch's intra-op threads), "gpus" ({name: count} of the visible CUDA GPUs;
    {} on a CPU run)}. ATEN_CPU_CAPABILITY=avx2 alone on an AVX512 machine moves ATen, not MKL nor oneDNN:
    the numbers then match neither machine, and only all three name what ran."""
    info = {
        "device": str(device),
        "cpu": cpu_model(),
        "cpu_capability": UNKNOWN,
        "mkl_isa": UNKNOWN,
        "onednn_isa": UNKNOWN,
        "isa_env": {k: os.environ[k] for k in ISA_ENV if k in os.environ},
        "threads": UNKNOWN,
        "gpus": {},
    }
    lib = library_isa()
    info["mkl_isa"], info["onednn_isa"] = lib["mkl"], lib["onednn"]
    try:
        import torch

        info["cpu_capability"] = str(torch.backends.cpu.get_cpu_capability())
        info["threads"] = int(torch.get_num_threads())
        if str(device).startswith("cuda") and torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                name = str(torch.cuda.get_device_name(i))
                info["gpus"][name] = info["gpus"].get(name, 0) + 1
    except Exception:
        pass
    return info


def _sha256_ends(path, size):
    """sha256 of the file's first and last END_BYTES (the whole file if it is smaller than two of them)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(END_BYTES))
        if size > END_BYTES:
            f.seek(max(END_BYTES, size - END_BYTES))
            h.update(f.read(END_BYTES))
    return h.hexdigest()


def dataset_fingerprint(data_dir):
    """A cheap fingerprint of a prepared dataset folder (meta.json + one .bin per split): the sha256 of
    meta.json, each split's size in bytes and the sha256 of its first and last MB, and "digest", 16 hex
    characters over all of it (equal digests: the same data for every practical purpose)."""
    out = {"dir": str(data_dir), "meta_sha256": UNKNOWN, "splits": {}, "digest": UNKNOWN}
    meta_path = os.path.join(data_dir, "meta.json")
    try:
        out["meta_sha256"] = sha256_file(meta_path)
        with open(meta_path) as f:
            splits = json.load(f).get("splits", {})
        for name, s in sorted(splits.items()):
            path = os.path.join(data_dir, s["file"])
            size = os.path.getsize(path)
            out["splits"][name] = {"bytes": size, "sha256_ends": _sha256_ends(path, size)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return out
    summary = json.dumps([out["meta_sha256"], out["splits"]], sort_keys=True)
    out["digest"] = hashlib.sha256(summary.encode()).hexdigest()[:16]
    return out


def provenance(data_dir=None, device="cpu", world_size=1):
    """Everything above for one process of a run (module docstring); data_dir None leaves "data" out."""
    out = {
        "code": code_version(),
        "versions": library_versions(),
        "device": device_info(device),
        "world_size": world_size,
    }
    if data_dir is not None:
        out["data"] = dataset_fingerprint(data_dir)
    return out


def machine(prov):
    """A one-line name of the machine in a provenance dict: "AMD EPYC 7B13 (AVX2)" (the CPU model and ATen's
    capability), then, where recorded (issue 53), what else decides the numbers: "AMD EPYC 7B13 (AVX512; MKL
    Intel(R) Architecture processors; oneDNN Intel AVX2; ONEDNN_MAX_CPU_ISA=AVX2)"; or the GPUs,
    "8 x NVIDIA H100 80GB HBM3"; "unknown" for None (runs from before provenance was recorded). Two runs
    whose names differ in any part differ in what produced their numbers (study/results.py warns)."""
    if not prov:
        return UNKNOWN
    dev = prov.get("device") or {}
    if dev.get("gpus"):
        return ", ".join(f"{n} x {name}" for name, n in sorted(dev["gpus"].items()))
    parts = [str(dev.get("cpu_capability", UNKNOWN))]
    if "mkl_isa" in dev or "onednn_isa" in dev or "isa_env" in dev:  # records before issue 53 keep their name
        parts += [
            f"MKL {dev.get('mkl_isa', UNKNOWN)}",
            f"oneDNN {dev.get('onednn_isa', UNKNOWN)}",
            *(f"{k}={v}" for k, v in sorted((dev.get("isa_env") or {}).items())),
        ]
    return f"{dev.get('cpu', UNKNOWN)} ({'; '.join(parts)})"


def commit(prov):
    """The code's commit in a provenance dict, with "+dirty" after an uncommitted edit; "unknown" if not known."""
    code = (prov or {}).get("code") or {}
    sha = code.get("commit", UNKNOWN)
    if sha == UNKNOWN:
        return UNKNOWN
    return sha[:12] + ("+dirty" if code.get("dirty") is True else "")


def libraries(prov):
    """ "torch 2.13.0+cpu, triton 3.7.1, numpy 2.4.6, python 3.11.7" of a provenance dict; "unknown" for None."""
    v = (prov or {}).get("versions")
    if not v:
        return UNKNOWN
    return ", ".join(f"{k} {v.get(k, UNKNOWN)}" for k in ("torch", "triton", "numpy", "python"))


def flat(prov):
    """The columns eval_extrapolate.py's CSV rows carry (FLAT_COLUMNS): commit, libraries, machine, threads,
    world size, data digest, as strings."""
    prov = prov or {}
    return {
        "commit": commit(prov),
        "libraries": libraries(prov),
        "machine": machine(prov),
        "threads": str((prov.get("device") or {}).get("threads", UNKNOWN)),
        "world_size": str(prov.get("world_size", UNKNOWN)),
        "data_digest": (prov.get("data") or {}).get("digest", UNKNOWN),
    }


FLAT_COLUMNS = ("commit", "libraries", "machine", "threads", "world_size", "data_digest")
