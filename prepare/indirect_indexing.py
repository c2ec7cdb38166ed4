"""Indirect indexing, the paper's diagnostic task (appendix "Indirect indexing").

Each example is a source string of 20-40 distinct letters, a character from it, a shift, and the
character found at that shift from the source character:

    NZTUIGWkXFrhCJDzscat,N,+4,I      string, source char, shift, target

Sampling (sample_example): the string length L is uniform on [20, 40]; its letters are L distinct
draws without replacement from [A-Za-z]; the source position i is uniform on [0, L); the target
position j is uniform over the positions inside the string with 1 <= |j - i| <= 15. That equals
drawing the shift uniformly from [-15, +15] without 0 and redrawing until the target lies inside
the string (the paper samples "shifts in the range [-15, +15]" and shows only nonzero ones; a shift
of 0 would be a plain copy of the source, so it never occurs here). Positive shifts carry a '+'.

Tokens: one per character: 52 letters, 10 digits, ',', '+', '-' (ids 0..64) and a padding id 65.
Rows are padded to 48 = 40 + len(",X,+15,Y"). The model sees everything but the target; the loss
is on the target alone (meta.json: loss = 'last'). Splits: 1,000,000 / 10,000 / 10,000 examples,
pairwise disjoint (test is drawn first, then val, then train, each skipping examples already seen).

    python prepare/indirect_indexing.py                 # -> data/indirect_indexing/
    python prepare/indirect_indexing.py --n_train=20000 --out_dir=data/ii_small
"""

import os
import random
import string
import sys

import numpy as np
from tqdm import tqdm

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from prepare.common import arg_parser, is_complete, run_cli, summarize, write_rows_dataset

LETTERS = string.ascii_uppercase + string.ascii_lowercase
VOCAB = LETTERS + string.digits + ",+-"  # ids 0..64
PAD_ID = len(VOCAB)  # 65
MIN_LEN, MAX_LEN, MAX_SHIFT = 20, 40, 15
ROW_LEN = MAX_LEN + len(",X,+15,Y")  # 48
STOI = {ch: i for i, ch in enumerate(VOCAB)}


def sample_example(rng):
    """One example as text, e.g. 'NZTUIGWkXFrhCJDzscat,N,+4,I'. rng: random.Random (deterministic
    for a seed). See the module docstring for the distribution."""
    n = rng.randint(MIN_LEN, MAX_LEN)
    letters = rng.sample(LETTERS, n)
    i = rng.randrange(n)
    lo, hi = max(0, i - MAX_SHIFT), min(n - 1, i + MAX_SHIFT)
    j = rng.randint(lo, hi - 1)  # hi - lo >= 15 >= 1 candidates besides i
    j += j >= i  # skip the source position itself
    return f"{''.join(letters)},{letters[i]},{j - i:+d},{letters[j]}"


def encode(text):
    """Text -> list of token ids (raises KeyError on a character outside the vocabulary)."""
    return [STOI[ch] for ch in text]


def decode(ids):
    """Token ids -> text; the padding id is dropped."""
    return "".join(VOCAB[i] for i in ids if i != PAD_ID)


def _draw(rng, n, seen, desc):
    rows = np.full((n, ROW_LEN), PAD_ID, dtype=np.uint8)
    lut = np.full(128, PAD_ID, dtype=np.uint8)
    lut[[ord(c) for c in VOCAB]] = np.arange(len(VOCAB))
    k = 0
    with tqdm(total=n, desc=desc, unit="ex", mininterval=1.0, disable=n < 50_000) as bar:
        while k < n:
            text = sample_example(rng)
            if text in seen:
                continue
            seen.add(text)
            rows[k, : len(text)] = lut[np.frombuffer(text.encode(), dtype=np.uint8)]
            k += 1
            bar.update(1)
    return rows


def prepare(out_dir="data/indirect_indexing", n_train=1_000_000, n_val=10_000, n_test=10_000, seed=1337):
    """Write the three splits and meta.json to out_dir (skipped if already complete). Returns out_dir."""
    if is_complete(out_dir):
        print(f"{out_dir} is complete; nothing to do")
        return out_dir
    rng, seen = random.Random(seed), set()
    splits = {}
    for name, n in (("test", n_test), ("val", n_val), ("train", n_train)):
        splits[name] = _draw(rng, n, seen, name)
    write_rows_dataset(
        out_dir, splits, empty_fix="give --n_train, --n_val and --n_test of at least 1", dataset="indirect_indexing", vocab_size=len(VOCAB) + 1, pad_id=PAD_ID, loss="last",
        tokenizer={"kind": "char", "itos": list(VOCAB) + ["<pad>"]},
        sampling={"seed": seed, "min_len": MIN_LEN, "max_len": MAX_LEN, "max_shift": MAX_SHIFT, "zero_shift": False},
    )
    summarize(out_dir)
    return out_dir


if __name__ == "__main__":
    p = arg_parser(__doc__, "data/indirect_indexing")
    p.add_argument("--n_train", type=int, default=1_000_000)
    p.add_argument("--n_val", type=int, default=10_000)
    p.add_argument("--n_test", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=1337)
    run_cli(prepare, p)
