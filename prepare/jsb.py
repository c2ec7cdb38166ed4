"""JSB Chorales (Bach), 16th-note grid, four voices serialized in raster-scan order (paper App. B.1).

Source (default): Jsb16thSeparated.json from github.com/czhuang/JSB-Chorales-dataset, the
Boulanger-Lewandowski (2012) train/valid/test split. Checked format (commit 9a7f733): a JSON object
{"train": [229 pieces], "valid": [76], "test": [77]}; a piece is a list of 16th-note time steps; a
step is a list of exactly 4 ints, soprano, alto, tenor, bass: a MIDI pitch, or -1 for silence (the
.npz version uses NaN instead). The real file holds pitches 36..81 and pieces of 100..640 steps.

Serialization (paper App. B.1, after Huang et al. 2019): the (voices x time) matrix is read going
down the voices, then right through time: s(0), a(0), t(0), b(0), s(1), a(1), ... One token per cell.

Vocabulary, 90 ids (paper: "MIDI notes, silence and padding"):
    id = pitch - 21   for MIDI pitch 21..108 (the 88 piano keys)   ids 0..87
    88 = silence (-1 in the JSON)
    89 = padding
Rows: a piece of T steps is 4T tokens. Pieces longer than 2048 tokens (512 steps; 6 of the 382) are
cut into consecutive windows of 512 steps, so every window starts on soprano. Each window is one row,
right-padded with 89 to 2048 (layout 'rows', loss 'all'). Splits: train/val/test = 229/76/77 pieces.

Offline alternative, --source music21: the Bach chorales shipped with music21
(music21.corpus.getComposer('bach'); Roman-numeral analyses .rntxt are not scores and are left out),
turned into the same matrix by sampling each part on the 16th-note grid (the pitch sounding at each
grid point, -1 if none; the top note of a chord). Scores without exactly 4 parts are skipped and
counted. NOT the official split: the kept chorales are shuffled (seeded) and split in the 229/76/77
proportions; meta.json says official_split false.

    python prepare/jsb.py --input Jsb16thSeparated.json        # -> data/jsb/
    python prepare/jsb.py                                       # downloads the JSON first
    python prepare/jsb.py --source music21                      # -> data/jsb_music21/ (offline)
"""

import json
import math
import os
import random
import sys
import time
from multiprocessing import Pool

import numpy as np
from tqdm import tqdm

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from prepare.common import arg_parser, download, is_complete, run_cli, summarize, write_rows_dataset

URL = "https://raw.githubusercontent.com/czhuang/JSB-Chorales-dataset/master/Jsb16thSeparated.json"
PITCH_MIN, PITCH_MAX = 21, 108
SILENCE_ID = PITCH_MAX - PITCH_MIN + 1  # 88
PAD_ID = SILENCE_ID + 1  # 89
VOCAB_SIZE = PAD_ID + 1  # 90
VOICES = 4
STEP = 0.25  # a 16th note, in quarter lengths (music21)
OFFICIAL = {"train": 229, "val": 76, "test": 77}
ITOS = [f"p{p}" for p in range(PITCH_MIN, PITCH_MAX + 1)] + ["rest", "<pad>"]


def encode(piece):
    """Piece -> 1-D int64 token ids in raster order (paper App. B.1).

    piece: (T, 4) nested list or array of MIDI pitches (21..108) or -1 for silence, voices ordered
    soprano, alto, tenor, bass. Returns ids of shape (4T,): step 0's four voices, then step 1's, ...
    Raises ValueError if a step does not have 4 voices or a value is neither -1 nor in 21..108."""
    arr = np.asarray(piece, dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != VOICES:
        raise ValueError(
            f"a piece must be a list of time steps of {VOICES} voices, got shape {arr.shape}; "
            "pass the voice-separated file Jsb16thSeparated.json"
        )
    bad = (arr != -1) & ((arr < PITCH_MIN) | (arr > PITCH_MAX))
    if bad.any():
        raise ValueError(f"pitch {arr[bad][0]} is neither -1 (silence) nor a MIDI pitch in {PITCH_MIN}..{PITCH_MAX}")
    return np.where(arr == -1, SILENCE_ID, arr - PITCH_MIN).reshape(-1)  # C order = raster order


def decode(ids):
    """Token ids -> (T, 4) list of lists of MIDI pitches (-1 = silence); pad ids are dropped.
    Raises ValueError if the remaining length is not a multiple of 4 or an id is out of range."""
    ids = np.asarray(ids, dtype=np.int64)
    ids = ids[ids != PAD_ID]
    if ids.size % VOICES or ((ids < 0) | (ids > SILENCE_ID)).any():
        raise ValueError(f"cannot decode {ids.size} ids: need a multiple of {VOICES} ids in 0..{SILENCE_ID}")
    return np.where(ids == SILENCE_ID, -1, ids + PITCH_MIN).reshape(-1, VOICES).tolist()


def piece_rows(piece, max_len=2048):
    """A piece -> (n_windows, max_len) uint8 rows: windows of max_len // 4 steps, right-padded with PAD_ID."""
    if max_len % VOICES:
        raise ValueError(f"max_len must be a multiple of {VOICES} so windows start on soprano, got {max_len}")
    ids = encode(piece)
    n = max(1, math.ceil(ids.size / max_len))
    rows = np.full((n, max_len), PAD_ID, dtype=np.uint8)
    for i in range(n):
        chunk = ids[i * max_len : (i + 1) * max_len]
        rows[i, : chunk.size] = chunk
    return rows


def chorale_matrix(score):
    """A music21 Score -> (T, 4) int16 matrix on the 16th-note grid, or None unless it has exactly 4 parts.
    Cell (t, v) is the MIDI pitch part v sounds at offset t/4 quarter notes (top note of a chord), or -1."""
    parts = list(score.parts)
    if len(parts) != VOICES:
        return None
    n_steps = math.ceil(float(score.highestTime) / STEP - 1e-9)
    mat = np.full((n_steps, VOICES), -1, dtype=np.int16)
    for v, part in enumerate(parts):
        for n in part.flatten().notes:
            pitch = max(p.midi for p in n.pitches)
            start = float(n.offset) / STEP
            lo, hi = math.ceil(start - 1e-9), math.ceil(start + float(n.quarterLength) / STEP - 1e-9)
            mat[lo:hi, v] = pitch
    return mat


def _parse_chorale(path):
    from music21 import corpus

    try:
        mat = chorale_matrix(corpus.parse(path))
    except Exception as e:  # a score music21 cannot read is skipped, like a non-4-part one
        return os.path.basename(str(path)), None, repr(e)
    return os.path.basename(str(path)), mat, None


def load_json(path):
    """Read Jsb16thSeparated.json -> {'train','val','test': list of pieces}. Raises ValueError on other layouts."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not {"train", "valid", "test"} <= set(data):
        raise ValueError(
            f"{path}: expected a JSON object with keys train/valid/test "
            "(the voice-separated Jsb16thSeparated.json), got something else"
        )
    return {"train": data["train"], "val": data["valid"], "test": data["test"]}


def load_music21(seed=1337, num_proc=None, limit=None):
    """The music21 Bach chorales as {split: list of (T, 4) matrices} plus {name: reason} of skipped scores.
    Deterministic split in the official 229/76/77 proportions (not the official pieces)."""
    from music21 import corpus

    paths = sorted((p for p in corpus.getComposer("bach") if not str(p).endswith(".rntxt")), key=str)
    paths = paths[:limit] if limit else paths
    kept, skipped = [], {}
    with Pool(num_proc or os.cpu_count()) as pool:
        for name, mat, err in tqdm(pool.imap(_parse_chorale, paths, chunksize=4), total=len(paths), desc="music21"):
            if mat is None:
                skipped[name] = err or "not exactly 4 parts"
            else:
                kept.append((name, mat))
    random.Random(seed).shuffle(kept)
    total = sum(OFFICIAL.values())
    n_val, n_test = round(len(kept) * OFFICIAL["val"] / total), round(len(kept) * OFFICIAL["test"] / total)
    parts = {"train": kept[n_val + n_test :], "val": kept[:n_val], "test": kept[n_val : n_val + n_test]}
    return {k: [m for _, m in v] for k, v in parts.items()}, {k: [n for n, _ in v] for k, v in parts.items()}, skipped


def prepare(out_dir=None, input=None, source="json", max_len=2048, seed=1337, num_proc=None, limit=None):
    """Write train/val/test rows and meta.json to out_dir (skipped if complete). Returns out_dir.

    source 'json': input is Jsb16thSeparated.json (downloaded from URL into out_dir/raw if None).
    source 'music21': the chorales in music21's corpus, own seeded split (limit: first N scores, for tests).
    Raises ValueError on malformed input, RuntimeError if the download fails."""
    out_dir = out_dir or ("data/jsb" if source == "json" else "data/jsb_music21")
    if is_complete(out_dir):
        print(f"{out_dir} is complete; nothing to do")
        return out_dir
    t0 = time.time()
    extra = {}
    if source == "json":
        if input is None:
            input = download(
                URL,
                os.path.join(out_dir, "raw", "Jsb16thSeparated.json"),
                "download Jsb16thSeparated.json elsewhere and pass --input PATH, or use --source "
                "music21 (offline, not the official split)",
            )
        pieces = load_json(input)
        extra = {"source": "Jsb16thSeparated.json (czhuang/JSB-Chorales-dataset)", "official_split": True}
    elif source == "music21":
        pieces, names, skipped = load_music21(seed, num_proc, limit)
        extra = {
            "source": "music21 corpus, composer bach",
            "official_split": False,
            "split_seed": seed,
            "split_pieces": names,
            "skipped_not_4_parts": len(skipped),
            "skipped": skipped,
        }
    else:
        raise ValueError(f"source must be 'json' or 'music21', got {source!r}")
    rows = {name: [piece_rows(p, max_len) for p in ps] for name, ps in pieces.items()}
    splits = {name: np.concatenate(r) if r else np.zeros((0, max_len), np.uint8) for name, r in rows.items()}
    seconds = time.time() - t0
    n_tok = int(sum((s != PAD_ID).sum() for s in splits.values()))
    write_rows_dataset(
        out_dir,
        splits,
        empty_fix="use the full Jsb16thSeparated.json (--source json), or more music21 chorales "
        "(the 229/76/77 proportions need about 7 kept pieces)",
        documents={name: [len(x) for x in r] for name, r in rows.items()},
        documents_meaning="one document per piece: its windows, rows off[i]:off[i+1]",
        dataset="jsb",
        vocab_size=VOCAB_SIZE,
        pad_id=PAD_ID,
        loss="all",
        tokenizer={
            "kind": "jsb_raster",
            "itos": ITOS,
            "pitch_min": PITCH_MIN,
            "silence_id": SILENCE_ID,
            "voices": ["soprano", "alto", "tenor", "bass"],
            "order": "time-major: voices 1-4 of step t, then t+1",
        },
        pieces={k: len(v) for k, v in pieces.items()},
        max_len=max_len,
        throughput={"seconds": round(seconds, 3), "tokens_per_sec": round(n_tok / max(seconds, 1e-9))},
        **extra,
    )
    summarize(out_dir)
    print(f"throughput: {n_tok:,} tokens in {seconds:.2f} s = {n_tok / max(seconds, 1e-9):,.0f} tokens/s")
    return out_dir


if __name__ == "__main__":
    p = arg_parser(__doc__, None, "path to Jsb16thSeparated.json (source json)", num_proc=True)  # data/jsb(_music21)
    p.add_argument("--source", choices=["json", "music21"], default="json")
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=1337)
    run_cli(prepare, p)
