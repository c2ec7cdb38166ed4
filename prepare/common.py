"""The on-disk dataset format shared by every prepare script, and its writers.

A prepared dataset is a folder holding one raw binary per split plus `meta.json`:

    data/<name>/train.bin, val.bin, test.bin   token ids, C order, dtype from meta.json
    data/<name>/meta.json                      written last: its presence means the folder is complete

meta.json keys (format 1):
    format       1
    dataset      name of the prepare script
    vocab_size   number of token ids the model needs (ids lie in [0, vocab_size))
    dtype        numpy dtype of the .bin files ('uint8', 'uint16' or 'int32')
    layout       'stream': each split is one 1-D token stream; training takes random crops
                 'rows':   each split is a 2-D (n_rows, row_len) array of whole examples, padded
                           on the right with pad_id; training samples whole rows
    splits       {split: {"file": "train.bin", "shape": [...], "tokens": n_real_tokens}}
    pad_id       id that fills rows past their end (rows layout), else null
    loss         'all': predict every next real token; 'last': only each row's final token;
                 'after_sep': only the tokens right after every k-th occurrence of the separator id s
                 in a row, given as loss_sep = {"id": s, "every": k} (indirect indexing with several
                 queries per row: each query's target follows its third ',')
    tokenizer    {"kind": "char" | "gpt2" | ..., plus what decoding needs, e.g. "itos"}
    documents    {split: {"file": "<split>.docs.bin", "dtype": "int64", "n_docs": n, "unit": "tokens" | "rows",
                 "meaning": ...}}: where the split's documents start (write_documents). The file holds n + 1
                 int64 offsets, 0 first and the split's length (tokens of a stream, rows of a rows split)
                 last: document i is [off[i], off[i + 1]). A rows split never puts two documents in one row.
                 Optional: a dataset without it is one document per split (data.py; train.py's block_causal).
Prepare scripts may add keys (bos_id, eos_id, notes, ...); readers ignore unknown keys.

Every split holds at least one row (one token for streams): write_meta refuses an empty split
with EmptySplitError naming the script's fix, because training on it would fail much later.

Everything is written atomically (cli.atomic_open: a temporary file in the same folder renamed into
place), so a crash leaves either the previous complete dataset or no meta.json, never a half-written
one that looks complete.

Also shared by the scripts: download (a raw file fetched once into data/<name>/raw/), arg_parser and
run_cli (the command line: flags named like prepare()'s parameters; bad input exits 2 with one line).
"""

import argparse
import hashlib
import json
import os
import shutil
import urllib.request

import numpy as np

from cli import UserError, atomic_open, atomic_write_json, exit_on_user_error


def sha256_file(path):
    """Hex sha256 of the file at `path`, read in 1 MB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


FORMAT = 1


class BinWriter:
    """Streams token arrays into `path` atomically: chunks go to a temporary file that is renamed
    to `path` only when the `with` block exits without error. Use for splits too large for RAM.

        with BinWriter("data/owt/train.bin", np.uint16) as w:
            for ids in chunks:
                w.write(ids)
        w.count  # tokens written
    """

    def __init__(self, path, dtype):
        self.path, self.dtype, self.count = path, np.dtype(dtype), 0

    def write(self, ids):
        arr = np.asarray(ids)
        info = np.iinfo(self.dtype)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise ValueError(f"token ids outside {self.dtype} range [{info.min}, {info.max}] while writing {self.path}")
        arr.astype(self.dtype, copy=False).tofile(self.f)
        self.count += arr.size

    def __enter__(self):
        self._file = atomic_open(self.path)
        self.f = self._file.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        return self._file.__exit__(exc_type, exc, tb)


def download(url, path, instead):
    """Download `url` to the file `path` (atomically, folders created) unless `path` exists; returns path.

    The offline path: a file the user already has, put at `path` or given to the script's --input,
    is used as is. Raises RuntimeError naming the URL, the error and `instead` (what the user can do
    instead, e.g. "download it elsewhere and pass --input PATH") when the download fails.
    """
    if os.path.exists(path):
        return path
    print(f"downloading {url} -> {path}")
    try:
        with urllib.request.urlopen(url, timeout=60) as r, atomic_open(path) as f:
            shutil.copyfileobj(r, f, 1 << 20)
    except OSError as e:
        raise RuntimeError(f"could not download {url} ({e}); {instead}") from e
    return path


def smallest_dtype(vocab_size):
    """uint8, uint16 or int32: the narrowest dtype that holds ids 0..vocab_size-1."""
    for dt in (np.uint8, np.uint16):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt).name
    return "int32"


class EmptySplitError(ValueError):
    """A split would hold no rows or tokens; the message names the split and the fix."""


EMPTY_FIX = "give more input data (see the script's --help for how splits are made)"


def check_nonempty(sizes, fix=EMPTY_FIX, where=""):
    """Raise EmptySplitError if any of {split: number of rows or tokens} is 0, naming them and `fix`."""
    empty = [name for name, n in sizes.items() if n == 0]
    if empty:
        raise EmptySplitError(
            f"{where + ': ' if where else ''}split{'s' if len(empty) > 1 else ''} "
            f"{', '.join(map(repr, empty))} would be empty; {fix}"
        )


def write_meta(out_dir, meta, empty_fix=EMPTY_FIX):
    """Validate `meta` against the .bin files already in out_dir and write meta.json last, atomically.
    Raises ValueError if a split file is missing or its size disagrees with its declared shape, and
    EmptySplitError (naming `empty_fix`) if a split has no rows or tokens: then no meta.json is written."""
    meta = {"format": FORMAT, **meta}
    for key in ("dataset", "vocab_size", "dtype", "layout", "splits", "loss", "tokenizer"):
        if key not in meta:
            raise ValueError(f"meta.json needs key {key!r}")
    check_nonempty({name: int(np.prod(s["shape"])) for name, s in meta["splits"].items()}, empty_fix, out_dir)
    _check_files(out_dir, meta)
    _check_documents(out_dir, meta)
    atomic_write_json(os.path.join(out_dir, "meta.json"), meta)
    return meta


def document_offsets(lengths):
    """Document lengths (n,) -> int64 offsets (n + 1,): 0, then their running sum. Zero lengths are dropped."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(lengths[lengths > 0])]).astype(np.int64)


def write_documents(out_dir, offsets, unit="tokens", meaning=None):
    """Write each split's document offsets {split: int64 (n_docs + 1,)} to out_dir/<split>.docs.bin (atomically)
    and return meta.json's "documents" entry (module docstring). Raises ValueError unless each starts at 0 and
    rises strictly (no empty document); write_meta checks the last offset against the split's length."""
    entries = {}
    for split, off in offsets.items():
        off = np.asarray(off, dtype=np.int64)
        if off.ndim == 1 and len(off) == 1:  # an empty split: write_meta refuses it, naming the fix
            continue
        if off.ndim != 1 or len(off) < 2 or off[0] != 0 or np.any(np.diff(off) <= 0):
            raise ValueError(f"split {split!r}: document offsets must start at 0 and rise strictly, got {off[:8]}...")
        with BinWriter(os.path.join(out_dir, f"{split}.docs.bin"), np.int64) as w:
            w.write(off)
        entries[split] = {
            "file": f"{split}.docs.bin",
            "dtype": "int64",
            "n_docs": len(off) - 1,
            "unit": unit,
            "meaning": meaning or f"document i = {unit} off[i]:off[i+1] of {split}",
        }
    return entries


def _check_documents(out_dir, meta):
    for name, d in meta.get("documents", {}).items():
        path = os.path.join(out_dir, d["file"])
        if name not in meta["splits"] or not os.path.exists(path) or os.path.getsize(path) != 8 * (d["n_docs"] + 1):
            raise ValueError(f"documents of split {name!r}: {path} is missing or not n_docs + 1 int64 offsets")
        last, length = int(np.fromfile(path, dtype=np.int64)[-1]), meta["splits"][name]["shape"][0]
        if last != length:
            raise ValueError(f"documents of split {name!r} end at {last}, the split has {length}")


def write_rows_dataset(out_dir, splits, empty_fix=EMPTY_FIX, documents=None, documents_meaning=None, **meta):
    """Write in-memory 2-D splits {name: (n_rows, row_len) int array} plus meta.json (rows layout).
    `meta` must give dataset, vocab_size, pad_id, loss, tokenizer; dtype is chosen from vocab_size.
    documents: {name: rows of each document, in order} (e.g. a piece cut into several windows), recorded as
    row offsets (write_documents, unit 'rows', explained by documents_meaning); None: one document per row.
    Raises EmptySplitError naming `empty_fix`, before writing anything, if a split has no rows."""
    check_nonempty({name: len(arr) for name, arr in splits.items()}, empty_fix, out_dir)
    dtype = meta.pop("dtype", None) or smallest_dtype(meta["vocab_size"])
    entries = {}
    for name, arr in splits.items():
        arr = np.asarray(arr)
        if arr.ndim != 2:
            raise ValueError(f"split {name!r} must be 2-D (n_rows, row_len), got shape {arr.shape}")
        with BinWriter(os.path.join(out_dir, f"{name}.bin"), dtype) as w:
            w.write(arr)
        real = int((arr != meta["pad_id"]).sum()) if meta.get("pad_id") is not None else int(arr.size)
        entries[name] = {"file": f"{name}.bin", "shape": list(arr.shape), "tokens": real}
    if documents is None:
        documents, documents_meaning = {n: np.ones(len(a), np.int64) for n, a in splits.items()}, "one per row"
    meta["documents"] = write_documents(
        out_dir, {n: document_offsets(rows) for n, rows in documents.items()}, "rows", documents_meaning
    )
    return write_meta(out_dir, {**meta, "dtype": dtype, "layout": "rows", "splits": entries})


def _check_files(out_dir, meta):
    itemsize = np.dtype(meta["dtype"]).itemsize
    for name, s in meta["splits"].items():
        path = os.path.join(out_dir, s["file"])
        if not os.path.exists(path):
            raise ValueError(f"split {name!r}: {path} is missing")
        want = int(np.prod(s["shape"])) * itemsize
        if os.path.getsize(path) != want:
            raise ValueError(f"split {name!r}: {path} has {os.path.getsize(path)} bytes, meta says {want}")


def arg_parser(doc, out_dir, input_help=None, num_proc=False):
    """The command line the prepare scripts share: the script's docstring as its --help, --out_dir
    (default `out_dir`; None: the script picks, as its docstring says), --input (files the user
    already has, if input_help is given) and --num_proc (if num_proc). A script adds its own
    options, each named like a parameter of its prepare()."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default=out_dir, help=f"default: {out_dir or 'see the usage above'}")
    if input_help:
        p.add_argument("--input", default=None, help=input_help)
    if num_proc:
        p.add_argument("--num_proc", type=int, default=None, help="worker processes (default: all cores)")
    return p


@exit_on_user_error
def run_cli(prepare, parser):
    """A script's __main__: prepare(**the command line parsed by `parser`). A ValueError
    (EmptySplitError included), RuntimeError or FileNotFoundError prints 'error: <message>' and
    exits with code 2."""
    try:
        return prepare(**vars(parser.parse_args()))
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        raise UserError(str(e)) from None


def is_complete(out_dir, splits=("train", "val", "test")):
    """True if out_dir holds a meta.json whose split files all exist with the declared sizes.
    Prepare scripts call this first and skip their work when it returns True (idempotence)."""
    path = os.path.join(out_dir, "meta.json")
    if not os.path.exists(path):
        return False
    try:
        with open(path) as f:
            meta = json.load(f)
        if any(s not in meta["splits"] for s in splits):
            return False
        _check_files(out_dir, meta)
    except (ValueError, KeyError, json.JSONDecodeError):
        return False
    return True


def summarize(out_dir):
    """One line per split (tokens, shape, bytes) plus vocab size, printed at the end of a prepare run."""
    with open(os.path.join(out_dir, "meta.json")) as f:
        meta = json.load(f)
    lines = [f"{meta['dataset']}: vocab_size {meta['vocab_size']}, dtype {meta['dtype']}, layout {meta['layout']}"]
    for name, s in meta["splits"].items():
        nbytes = os.path.getsize(os.path.join(out_dir, s["file"]))
        lines.append(f"  {name:>5}: {s['tokens']:>14,} tokens  shape {s['shape']}  {nbytes / 1e6:,.1f} MB")
    text = "\n".join(lines)
    print(text)
    return text
