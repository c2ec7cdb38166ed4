"""MAESTRO v3.0.0 piano MIDI -> REMI tokens (miditok), rows of up to 2048 tokens (paper App. B.1).

Tokenizer: miditok 3.1.0 REMI. The paper says "REMI with EOS, BOS, MASK and PAD tokens, vocabulary
328" but not its settings; this configuration gives exactly 328: TokenizerConfig defaults (beat_res
{(0,4): 8, (4,12): 4}, 32 velocities, time signatures, special tokens PAD, BOS, EOS, MASK) except
pitch_range=(21, 108) (the 88 piano keys), use_tempos=True, use_sustain_pedals=True,
use_pitchdrum_tokens=False. Vocabulary: PAD 0, BOS 1, EOS 2, MASK 3, Bar 1, Position 96, Pitch 88
(ids 5..92), Velocity 32, Duration 64, Tempo 32, TimeSig 9, Pedal 1, PedalOff 1 = 328.
(Rest tokens instead of tempo tokens also give 328; the paper does not say which it used.)
The tokenizer is saved to out_dir/tokenizer.json (miditok's format) for decoding.

A piece is one file: all its tracks merged into one piano track, tokenized, wrapped as
[BOS] + REMI + [EOS]. Rows: windows of 2048 tokens overlapping by one token (window i starts at token
i * 2047), so every token after BOS is a prediction target exactly once; the last window is
right-padded with PAD (0). Layout 'rows', loss 'all'.

Augmentation (train split only; val and test are untransposed): pitch transposition by each
k in {-3, ..., +3} semitones, so every training piece is written 7 times. Sampling rows uniformly at
train time then draws k uniformly, as in the paper. Transposing shifts the Pitch ids by k, which
equals tokenizing the transposed score (tested); a k that would push a note off the 88 keys is
skipped for that piece and counted in meta.json.

Split: 90/5/5 percent by file (seeded shuffle of the sorted relative paths), as in the paper. Caveat:
MAESTRO holds several performances of some compositions, which this split may put in different
splits. --split official instead uses the split column of maestro-v3.0.0.csv (found under --input),
which keeps each composition in one split (about 962/137/177 files; not 90/5/5).

Unreadable or corrupt MIDI files are skipped and counted, never fatal. Tokenization runs in a
multiprocessing pool. Default input: the official zip is downloaded from URL into out_dir/raw.

    python prepare/maestro.py --input path/to/maestro-v3.0.0      # a folder of .mid/.midi, any depth
"""

import csv
import glob
import os
import random
import sys
import time
import warnings
import zipfile
from multiprocessing import Pool

import numpy as np
from tqdm import tqdm

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cli import atomic_write_json
from prepare.common import (
    BinWriter,
    arg_parser,
    document_offsets,
    download,
    is_complete,
    run_cli,
    summarize,
    write_documents,
    write_meta,
)

URL = "https://storage.googleapis.com/magentadata/datasets/maestro/v3.0.0/maestro-v3.0.0-midi.zip"
VOCAB_SIZE = 328
TRANSPOSITIONS = tuple(range(-3, 4))
PITCH_MIN, PITCH_MAX = 21, 108
SPLIT_FRACTIONS = {"val": 0.05, "test": 0.05}  # train gets the rest (90%)


def make_tokenizer():
    """The REMI tokenizer described in the module docstring (328 ids). Requires miditok 3.1."""
    from miditok import REMI, TokenizerConfig

    cfg = TokenizerConfig(
        pitch_range=(PITCH_MIN, PITCH_MAX),
        use_tempos=True,
        use_sustain_pedals=True,
        use_pitchdrum_tokens=False,
        special_tokens=["PAD", "BOS", "EOS", "MASK"],
    )
    return REMI(cfg)


def encode_score(tok, score):
    """symusic Score -> 1-D int64 array of ids [BOS, REMI tokens..., EOS] in 0..327 (paper App. B.1).
    All tracks are merged into one piano track first. Errors from symusic/miditok propagate."""
    if len(score.tracks) > 1:
        score = score.copy()
        first = score.tracks[0]
        for tr in list(score.tracks)[1:]:
            first.notes.extend(tr.notes)
            first.pedals.extend(tr.pedals)
        first.notes.sort()
        first.pedals.sort()
        while len(score.tracks) > 1:
            score.tracks.pop(-1)
    seqs = tok.encode(score)
    ids = seqs[0].ids if seqs else []
    return np.asarray([tok["BOS_None"], *ids, tok["EOS_None"]], dtype=np.int64)


def decode(tok, ids):
    """Token ids (BOS/EOS/PAD allowed) -> symusic Score. Inverse of encode_score up to REMI quantization."""
    specials = {tok.pad_token_id, tok["BOS_None"], tok["EOS_None"], tok["MASK_None"]}
    return tok.decode([[int(i) for i in ids if int(i) not in specials]])


def pitch_id_range(tok):
    """(first, last) id of the contiguous Pitch_21..Pitch_108 block."""
    lo, hi = tok[f"Pitch_{PITCH_MIN}"], tok[f"Pitch_{PITCH_MAX}"]
    assert hi - lo == PITCH_MAX - PITCH_MIN, "Pitch ids are not contiguous in this miditok version"
    return lo, hi


def transpose(ids, k, lo, hi):
    """1-D int ids -> a copy with every Pitch id (lo..hi) shifted by k semitones, or None if a pitch
    would leave the 88 keys. Equals tokenizing the score transposed by k (paper App. B.1 augmentation)."""
    is_pitch = (ids >= lo) & (ids <= hi)
    if not is_pitch.any():
        return ids.copy()
    p = ids[is_pitch]
    if p.min() + k < lo or p.max() + k > hi:
        return None
    out = ids.copy()
    out[is_pitch] += k
    return out


def windows(ids, max_len, pad_id):
    """1-D ids -> (n, max_len) rows; window i is ids[i*(max_len-1) : i*(max_len-1)+max_len], right-padded."""
    stride = max_len - 1
    n = max(1, -(-(len(ids) - 1) // stride))
    rows = np.full((n, max_len), pad_id, dtype=np.int64)
    for i in range(n):
        chunk = ids[i * stride : i * stride + max_len]
        rows[i, : len(chunk)] = chunk
    return rows


_TOK = None


def _init_worker():
    global _TOK
    warnings.filterwarnings("ignore")
    _TOK = make_tokenizer()


def _tokenize_file(path):
    from symusic import Score

    try:
        return path, encode_score(_TOK, Score(path)), None
    except Exception as e:  # corrupt or unreadable file: skipped and counted by the caller
        return path, None, f"{type(e).__name__}: {e}"


def find_midis(root):
    """Sorted .mid/.midi paths under root (any depth). Raises ValueError if there are none."""
    paths = sorted(
        {
            p
            for ext in ("mid", "midi", "MID", "MIDI")
            for p in glob.glob(os.path.join(root, "**", f"*.{ext}"), recursive=True)
        }
    )
    if not paths:
        raise ValueError(f"no .mid/.midi files under {root}; pass --input the unzipped maestro-v3.0.0 folder")
    return paths


def assign_splits(paths, root, split="random", seed=1337):
    """{path: 'train'|'val'|'test'}. 'random': seeded 90/5/5 by file; 'official': the split column of
    maestro-v3.0.0.csv (files it does not list are left out of the mapping). Raises ValueError if
    'official' finds no CSV under root, or on an unknown split name."""
    rel = {p: os.path.relpath(p, root) for p in paths}
    if split == "random":
        order = sorted(paths, key=lambda p: rel[p])
        random.Random(seed).shuffle(order)
        n_val = max(1, round(SPLIT_FRACTIONS["val"] * len(order))) if len(order) >= 3 else 0
        n_test = max(1, round(SPLIT_FRACTIONS["test"] * len(order))) if len(order) >= 3 else 0
        return {p: "val" if i < n_val else "test" if i < n_val + n_test else "train" for i, p in enumerate(order)}
    if split == "official":
        csvs = glob.glob(os.path.join(root, "**", "maestro-v3.0.0.csv"), recursive=True)
        if not csvs:
            raise ValueError(f"--split official needs maestro-v3.0.0.csv under {root}; use --split random")
        base = os.path.dirname(csvs[0])
        with open(csvs[0], newline="") as f:
            table = {os.path.normpath(r["midi_filename"]): r["split"] for r in csv.DictReader(f)}
        names = {"train": "train", "validation": "val", "test": "test"}
        out = {}
        for p in paths:
            s = table.get(os.path.normpath(os.path.relpath(p, base)))
            if s is not None:
                out[p] = names[s]
        return out
    raise ValueError(f"split must be 'random' or 'official', got {split!r}")


def _download(out_dir):
    """The official zip, downloaded into out_dir/raw and unzipped there; returns that folder."""
    raw = os.path.join(out_dir, "raw")
    zpath = download(
        URL, os.path.join(raw, os.path.basename(URL)), "download and unzip it elsewhere and pass --input DIR"
    )
    if not glob.glob(os.path.join(raw, "**", "*.midi"), recursive=True):
        with zipfile.ZipFile(zpath) as z:
            z.extractall(raw)
    return raw


def prepare(
    out_dir="data/maestro",
    input=None,
    split="random",
    max_len=2048,
    seed=1337,
    num_proc=None,
    transpositions=TRANSPOSITIONS,
):
    """Tokenize every MIDI file under `input` and write train/val/test rows + meta.json (skipped if
    complete). Returns out_dir. Files are tokenized first (in a pool), then the readable ones are split,
    so a corrupt file never shifts the split. Raises ValueError if input holds no readable MIDI file."""
    if is_complete(out_dir):
        print(f"{out_dir} is complete; nothing to do")
        return out_dir
    t0 = time.time()
    root = input if input is not None else _download(out_dir)
    paths = find_midis(root)
    warnings.filterwarnings("ignore")
    tok = make_tokenizer()
    assert len(tok) == VOCAB_SIZE, f"miditok gave {len(tok)} ids, expected {VOCAB_SIZE}"
    lo, hi = pitch_id_range(tok)
    pad = tok.pad_token_id
    ok, skipped = {}, {}
    with Pool(num_proc or os.cpu_count(), initializer=_init_worker) as pool:
        for path, ids, err in tqdm(pool.imap(_tokenize_file, paths, chunksize=2), total=len(paths), desc="maestro"):
            if ids is None:
                skipped[os.path.relpath(path, root)] = err
            else:
                ok[path] = ids.astype(np.uint16)  # all of MAESTRO tokenized is ~50 MB
    if not ok:
        raise ValueError(f"none of the {len(paths)} MIDI files under {root} could be read")
    where = assign_splits(sorted(ok), root, split, seed)
    not_in_csv = sorted(os.path.relpath(p, root) for p in ok if p not in where)  # 'official' only
    files = {s: [p for p in sorted(where) if where[p] == s] for s in ("train", "val", "test")}
    rows_n, real, dropped_k = dict.fromkeys(files, 0), dict.fromkeys(files, 0), 0
    doc_rows = {s: [] for s in files}  # rows of each piece (each transposition of a piece its own document)
    atomic_write_json(os.path.join(out_dir, "tokenizer.json"), tok.to_dict())  # what tok.save writes, atomically
    for s, todo in files.items():
        with BinWriter(os.path.join(out_dir, f"{s}.bin"), np.uint16) as w:
            for path in todo:
                for k in transpositions if s == "train" else (0,):
                    t = transpose(ok[path].astype(np.int64), k, lo, hi)
                    if t is None:
                        dropped_k += 1
                        continue
                    rows = windows(t, max_len, pad)
                    w.write(rows)
                    rows_n[s] += len(rows)
                    doc_rows[s].append(len(rows))
                    real[s] += int((rows != pad).sum())
    seconds = time.time() - t0
    n_tok = sum(real.values())
    write_meta(
        out_dir,
        {
            "dataset": "maestro",
            "vocab_size": VOCAB_SIZE,
            "dtype": "uint16",
            "layout": "rows",
            "pad_id": pad,
            "loss": "all",
            "bos_id": tok["BOS_None"],
            "eos_id": tok["EOS_None"],
            "mask_id": tok["MASK_None"],
            "splits": {s: {"file": f"{s}.bin", "shape": [rows_n[s], max_len], "tokens": real[s]} for s in files},
            "documents": write_documents(
                out_dir,
                {s: document_offsets(n) for s, n in doc_rows.items()},
                "rows",
                "one document per piece (and transposition): its windows, rows off[i]:off[i+1]",
            ),
            "tokenizer": {
                "kind": "miditok",
                "class": "REMI",
                "file": "tokenizer.json",
                "miditok_version": "3.1.0",
                "config": "defaults + pitch_range (21,108), use_tempos, use_sustain_pedals, no pitchdrum",
            },
            "split": split,
            "split_seed": seed,
            "max_len": max_len,
            "split_files": {s: [os.path.relpath(p, root) for p in v] for s, v in files.items()},
            "transpositions": {"train": list(transpositions), "val": [0], "test": [0]},
            "transpositions_skipped_out_of_range": dropped_k,
            "skipped_files": len(skipped),
            "skipped": skipped,
            "not_in_csv": not_in_csv,
            "throughput": {
                "seconds": round(seconds, 3),
                "files_per_sec": round(len(paths) / max(seconds, 1e-9), 2),
                "tokens_per_sec": round(n_tok / max(seconds, 1e-9)),
                "untransposed_tokens_per_sec": round(sum(map(len, ok.values())) / max(seconds, 1e-9)),
            },
        },
        "give --input at least 3 readable MIDI files (--split random puts 5 % of the files, at least one, "
        "in val and in test), or use --split random if maestro-v3.0.0.csv lists no file of a split",
    )
    summarize(out_dir)
    print(f"skipped {len(skipped)} unreadable files, {dropped_k} out-of-range transpositions")
    print(
        f"throughput: {len(paths)} files, {n_tok:,} tokens written ({sum(map(len, ok.values())):,} before "
        f"transposition) in {seconds:.1f} s = {n_tok / max(seconds, 1e-9):,.0f} tokens/s"
    )
    return out_dir


if __name__ == "__main__":
    p = arg_parser(__doc__, "data/maestro", "folder of .mid/.midi files (default: download URL)", num_proc=True)
    p.add_argument("--split", choices=["random", "official"], default="random")
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=1337)
    run_cli(prepare, p)
