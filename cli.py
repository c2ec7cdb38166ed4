"""What every script of this repo does the same way at its edges.

    UserError, exit_on_user_error   bad input: one line on stderr, "error: <what to do>", exit code 2
    atomic_open, atomic_write,      every file a script writes (checkpoints, prepared data, JSON,
    atomic_write_json               CSV, plots) appears complete or not at all
    resolve_device, resolve_dtype,  the settings device='auto' and dtype='auto', and the autocast
    autocast_context                context a dtype means
    note_renamed                    a setting given under its old name: one line, then it works

A script raises UserError wherever it finds input the user must fix (a missing checkpoint, an unknown
dataset, a bad setting) and decorates its main() with exit_on_user_error. Anything else is a bug and
keeps its traceback.
"""

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import time


class UserError(Exception):
    """Input the user must fix. str(e) is one line that says what to do; `details` (optional) are
    further lines printed after it, e.g. the valid keys of a config."""

    def __init__(self, message, details=""):
        super().__init__(message)
        self.details = details


def exit_on_user_error(main):
    """Decorator for a script's main(): a UserError prints 'error: <message>' (then its details) on
    stderr and exits with code 2; other exceptions propagate unchanged.

    Under torchrun (RANK set) every rank exits 2 but only rank 0 prints, so the line appears once; each rank
    also writes it to torchrun's error file (TORCHELASTIC_ERROR_FILE, torch.distributed.elastic's reply file),
    so torchrun's failure report shows it as each failed rank's "traceback", a rank-specific error included."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            line = f"error: {e}" + (f"\n{e.details}" if e.details else "")
            if os.environ.get("RANK", "0") == "0":
                print(line, file=sys.stderr)
            _torchrun_reply(line)
            sys.exit(2)

    return wrapper


def _torchrun_reply(message):
    """Write `message` to torchrun's per-worker error file, where torchrun sets one, in the JSON that
    torch.distributed.elastic's ErrorHandler.record_exception writes (the message in place of a Python traceback):
    torchrun prints it in its report instead of '<N/A>'."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            info = {"py_callstack": message, "timestamp": str(int(time.time()))}
            json.dump({"message": {"message": message, "extraInfo": info}}, f)
    except OSError:
        pass  # the report then says <N/A>; rank 0 has printed the line


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors (an unknown flag, a bad value) raise UserError, so that under
    exit_on_user_error they print one line naming `--help` and exit 2, instead of usage + message."""

    def error(self, message):
        raise UserError(f"{message} (see python {self.prog} --help)")


def note_renamed(old, new):
    """Print the one-line note for a setting given under its old name (it still works, as `new`)."""
    print(f"note: {old} is deprecated, use {new} (same meaning)", file=sys.stderr)


@contextlib.contextmanager
def atomic_open(path):
    """Context manager: a binary file object that becomes `path` when the block exits cleanly.

    The data goes to a temporary file beside `path` (same folder, so the rename stays on one file
    system), which is flushed, fsynced, given the usual mode (0666 minus the umask) and renamed onto
    `path` with os.replace; then the folder is fsynced (POSIX), so the rename too is on disk. The data
    reaches the disk before the rename: after a power cut `path` holds the old file or the new one,
    never an empty one. A crash or an exception in the block leaves the old `path` (or none) and no
    temporary file. Creates the folder if needed.

        with atomic_open("out/ckpt.pt") as f:
            torch.save(state, f)
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_folder(folder)


def _fsync_folder(folder):
    """fsync a folder, so that a rename inside it is durable. POSIX only (Windows cannot open a folder);
    best effort: some file systems refuse it (EINVAL), and the file itself is already on disk."""
    if os.name != "posix":
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def atomic_write(path, data):
    """Write `data` (bytes, or str as UTF-8) to `path` atomically (see atomic_open)."""
    with atomic_open(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def atomic_write_json(path, obj, indent=1, **dumps_kwargs):
    """Write `obj` as JSON (json.dumps(obj, indent=indent, **dumps_kwargs) plus a newline) atomically."""
    atomic_write(path, json.dumps(obj, indent=indent, **dumps_kwargs) + "\n")


DTYPES = ("float32", "bfloat16", "float16")


def resolve_compile(compile, device):
    """train.py's and sample.py's `compile` setting: None (unset) -> True on CUDA, False elsewhere; True / False as
    given. Raises UserError for anything else (`--compile=false` parses as the text 'false', which is truthy)."""
    if compile is None:
        return str(device).startswith("cuda")
    if isinstance(compile, bool):
        return compile
    raise UserError(f"compile must be True or False (or unset: on for CUDA, off elsewhere), got {compile!r}")


def resolve_device(device):
    """'auto' -> 'cuda' when torch sees a CUDA GPU, else 'cpu'; any other device torch can name ('cpu',
    'cuda:1', 'mps', ...) is returned as given. Raises UserError for a name torch does not know ('gpu',
    'cdua', 'cuda1') and for a CUDA device torch cannot see ('cuda' on a machine without a GPU, 'cuda:2'
    where there are two), instead of a traceback at its first use."""
    import torch  # here, so that prepare/ scripts import this module without torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        index = torch.device(device).index
    except (RuntimeError, TypeError):
        raise UserError(f"device {device!r} is not a device name; use cuda, cuda:N, cpu or auto") from None
    if not device.startswith("cuda"):
        return device
    if not torch.cuda.is_available():
        raise UserError(f"device {device!r}: torch sees no CUDA GPU on this machine; use --device=cpu (or auto)")
    if index is not None and index >= torch.cuda.device_count():
        raise UserError(
            f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )
    return device


BF16_CAPABILITY = (8, 0)  # native bf16 matmuls (tensor cores): Ampere (sm_80) and later


def resolve_dtype(dtype, device):
    """The compute dtype a setting names on `device`, one of DTYPES: 'auto' is 'float32' on a CPU, and on
    a CUDA GPU 'bfloat16' where it has native bf16 (compute capability >= 8.0, asked of that device),
    else 'float16' (V100 sm_70, T4 sm_75: fp16 with a GradScaler). torch.cuda.is_bf16_supported() is not
    used: it counts emulated bf16 by default and says True on any CUDA GPU. Raises UserError for a name
    that is neither 'auto' nor in DTYPES."""
    if dtype == "auto":
        if not str(device).startswith("cuda"):  # not CUDA: 'cpu', 'cpu:0', 'mps', ...
            return "float32"
        import torch

        native = torch.cuda.get_device_capability(torch.device(device)) >= BF16_CAPABILITY
        return "bfloat16" if native else "float16"
    if dtype not in DTYPES:
        raise UserError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return dtype


def autocast_context(device, dtype):
    """The context forward passes run in for a resolved dtype: nullcontext for 'float32', else
    torch.autocast on the device's type ('cuda' or 'cpu') in that dtype. Reusable across `with` blocks."""
    import torch

    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda" if str(device).startswith("cuda") else "cpu", dtype=getattr(torch, dtype))
