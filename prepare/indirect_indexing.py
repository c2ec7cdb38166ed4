"""Indirect indexing, the paper's diagnostic task (appendix "Indirect indexing"), and its variants.

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

Variants (not the paper's task; for CPU-scale experiments, docs/indirect_indexing_cpu.md). Flags:
    --n_letters=K     the alphabet is the first K letters of [A-Za-z] (2..52; paper 52)
    --min_len, --max_len   the string length range (paper 20, 40; max_len <= n_letters)
    --max_shift=S     shifts in [-S, +S] without 0 (paper 15; S >= 1; S >= max_len: any other position)
    --n_queries=Q     Q queries per row, each the paper's task on the row's string (paper 1; Q <= min_len):
                          NZTUIGWk,N,+4,I,T,-2,N,...     string, then Q x (source, shift, target)
                      The sources of a row are distinct positions (drawn without replacement, so each
                      query's source is uniform on the string); each target is drawn given its source
                      as above. The loss falls on every target and nothing else (meta.json: loss =
                      'after_sep': the token after every 3rd ','); accuracy is over all targets.
The vocabulary is the K letters, 10 digits, ',', '+', '-' and a padding id (ids in that order); rows
are padded to max_len + Q * (6 + digits of S). A variant has a name, the folder it is written to and
the `dataset=` that train.py builds on first use: 'indirect_indexing' plus, in this order, only the
fields that differ from the paper, e.g.

    indirect_indexing_letters16_len8-16_shift4_q8    K=16, L in 8..16, S=4, Q=8

meta.json records the variant ("variant": its name, "sampling": its parameters and the seed).

    python prepare/indirect_indexing.py                 # -> data/indirect_indexing/
    python prepare/indirect_indexing.py --n_train=20000 --out_dir=data/ii_small
    python prepare/indirect_indexing.py --n_letters=16 --min_len=8 --max_len=16 --max_shift=4 --n_queries=8
                                                        # -> data/indirect_indexing_letters16_len8-16_shift4_q8/
"""

import json
import os
import random
import re
import string
import sys
from dataclasses import asdict, dataclass, fields
from functools import cached_property

import numpy as np
from tqdm import tqdm

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from prepare.common import arg_parser, is_complete, run_cli, summarize, write_rows_dataset

LETTERS = string.ascii_uppercase + string.ascii_lowercase
NAME = "indirect_indexing"
MAX_STALL = 10_000  # consecutive already-seen draws before prepare gives up (the variant has too few examples)


@dataclass(frozen=True)
class Variant:
    """The generator's parameters; the defaults are the paper's task. Raises ValueError (saying which
    flag to change) for parameters that cannot be sampled."""

    n_letters: int = 52  # alphabet: LETTERS[:n_letters]
    min_len: int = 20  # string length range, letters
    max_len: int = 40
    max_shift: int = 15  # shifts in [-max_shift, +max_shift] without 0, positions
    n_queries: int = 1  # (source, shift, target) queries per row

    def __post_init__(self):
        if not all(type(getattr(self, f.name)) is int for f in fields(self)):
            raise ValueError(f"indirect-indexing parameters must be integers, got {asdict(self)}")
        if not 2 <= self.n_letters <= len(LETTERS):
            raise ValueError(f"n_letters must be in 2..{len(LETTERS)}, got {self.n_letters}")
        if not 2 <= self.min_len <= self.max_len <= self.n_letters:
            raise ValueError(
                f"need 2 <= min_len <= max_len <= n_letters (the letters of a string are distinct), "
                f"got min_len={self.min_len}, max_len={self.max_len}, n_letters={self.n_letters}"
            )
        if self.max_shift < 1:
            raise ValueError(f"max_shift must be >= 1 (a shift of 0 would copy the source), got {self.max_shift}")
        if not 1 <= self.n_queries <= self.min_len:
            raise ValueError(
                f"n_queries must be in 1..min_len = {self.min_len} (the sources of a row are distinct "
                f"positions), got {self.n_queries}"
            )

    @property
    def letters(self):
        return LETTERS[: self.n_letters]

    @property
    def vocab(self):
        """The characters of token ids 0..len-1 (the padding id is len(vocab))."""
        return self.letters + string.digits + ",+-"

    @property
    def pad_id(self):
        return len(self.vocab)

    @property
    def row_len(self):
        """Tokens per padded row: the longest string and Q queries ',X,+S,Y' with S's widest shift."""
        return self.max_len + self.n_queries * (6 + len(str(self.max_shift)))

    @cached_property
    def stoi(self):
        return {ch: i for i, ch in enumerate(self.vocab)}

    @property
    def name(self):
        """The variant's dataset name: 'indirect_indexing' plus the fields that differ from the paper."""
        d = Variant()
        parts = [
            f"letters{self.n_letters}" if self.n_letters != d.n_letters else "",
            f"len{self.min_len}-{self.max_len}" if (self.min_len, self.max_len) != (d.min_len, d.max_len) else "",
            f"shift{self.max_shift}" if self.max_shift != d.max_shift else "",
            f"q{self.n_queries}" if self.n_queries != d.n_queries else "",
        ]
        return "_".join([NAME] + [p for p in parts if p])

    @classmethod
    def from_name(cls, name):
        """Parse a dataset name written by Variant.name; raises ValueError naming the grammar (or the
        canonical spelling) if it is not one."""
        grammar = (
            "'indirect_indexing' plus, in this order, the fields that differ from the paper: _letters<K>, "
            "_len<min>-<max>, _shift<S>, _q<Q>, e.g. indirect_indexing_letters16_len8-16_shift4_q8"
        )
        m = re.fullmatch(NAME + r"(?:_letters(\d+))?(?:_len(\d+)-(\d+))?(?:_shift(\d+))?(?:_q(\d+))?", name)
        if not m:
            raise ValueError(f"dataset {name!r} is not an indirect-indexing variant: write {grammar}")
        k, lo, hi, s, q = (int(g) if g is not None else None for g in m.groups())
        d = cls()
        v = cls(
            n_letters=k or d.n_letters,
            min_len=d.min_len if lo is None else lo,
            max_len=d.max_len if hi is None else hi,
            max_shift=d.max_shift if s is None else s,
            n_queries=d.n_queries if q is None else q,
        )
        if v.name != name:
            raise ValueError(f"dataset {name!r} names the variant {v.name!r}: write it that way ({grammar})")
        return v

    @classmethod
    def from_meta(cls, meta):
        """The variant of a prepared dataset's meta.json (data prepared before variants existed: the paper's)."""
        s = meta.get("sampling", {})
        return cls(**{f.name: s[f.name] for f in fields(cls) if f.name in s})


PAPER = Variant()
VOCAB = PAPER.vocab  # ids 0..64
PAD_ID = PAPER.pad_id  # 65
MIN_LEN, MAX_LEN, MAX_SHIFT = PAPER.min_len, PAPER.max_len, PAPER.max_shift
ROW_LEN = PAPER.row_len  # 48
STOI = PAPER.stoi


def sample_example(rng, variant=PAPER):
    """One example as text, e.g. 'NZTUIGWkXFrhCJDzscat,N,+4,I' (with Q queries: Q times ',source,shift,target').
    rng: random.Random (deterministic for a seed). See the module docstring for the distribution."""
    v = variant
    n = rng.randint(v.min_len, v.max_len)
    letters = rng.sample(v.letters, n)
    free = list(range(n))  # source positions not used yet in this row
    parts = ["".join(letters)]
    for _ in range(v.n_queries):
        i = free.pop(rng.randrange(len(free)))  # one query: rng.randrange(n), as the paper's task
        lo, hi = max(0, i - v.max_shift), min(n - 1, i + v.max_shift)
        j = rng.randint(lo, hi - 1)  # hi - lo >= 1: a string of >= 2 letters and max_shift >= 1
        j += j >= i  # skip the source position itself
        parts.append(f"{letters[i]},{j - i:+d},{letters[j]}")
    return ",".join(parts)


def encode(text, variant=PAPER):
    """Text -> list of token ids (raises KeyError on a character outside the variant's vocabulary)."""
    return [variant.stoi[ch] for ch in text]


def decode(ids, variant=PAPER):
    """Token ids -> text; the padding id is dropped."""
    return "".join(variant.vocab[i] for i in ids if i != variant.pad_id)


def _draw(rng, n, seen, desc, variant):
    rows = np.full((n, variant.row_len), variant.pad_id, dtype=np.uint8)
    lut = np.full(128, variant.pad_id, dtype=np.uint8)
    lut[[ord(c) for c in variant.vocab]] = np.arange(len(variant.vocab))
    k, stall = 0, 0
    with tqdm(total=n, desc=desc, unit="ex", mininterval=1.0, disable=n < 50_000) as bar:
        while k < n:
            text = sample_example(rng, variant)
            if text in seen:
                stall += 1
                if stall > MAX_STALL:
                    raise ValueError(
                        f"{variant.name}: only {len(seen):,} distinct examples found after {MAX_STALL:,} "
                        f"repeats in a row; the variant has too few for the splits asked: lower "
                        "--n_train (or widen the variant: more letters, queries, or a longer string)"
                    )
                continue
            seen.add(text)
            stall = 0
            rows[k, : len(text)] = lut[np.frombuffer(text.encode(), dtype=np.uint8)]
            k += 1
            bar.update(1)
    return rows


def prepare(
    out_dir=None,
    n_train=1_000_000,
    n_val=10_000,
    n_test=10_000,
    seed=1337,
    n_letters=52,
    min_len=20,
    max_len=40,
    max_shift=15,
    n_queries=1,
):
    """Write the three splits and meta.json of a variant (default: the paper's task) to out_dir
    (default data/<variant name>), skipped if already complete. Returns out_dir. Raises ValueError for
    parameters that cannot be sampled, a variant with too few distinct examples for the splits, or an
    out_dir that already holds another variant."""
    variant = Variant(n_letters, min_len, max_len, max_shift, n_queries)
    if Variant.from_name(variant.name) != variant:  # the name is the folder and train.py's dataset=
        raise ValueError(
            f"the name {variant.name!r} does not identify the variant {asdict(variant)}: its data would "
            "land in another variant's folder (a bug in Variant.name)"
        )
    out_dir = out_dir or os.path.join("data", variant.name)
    if is_complete(out_dir):
        with open(os.path.join(out_dir, "meta.json")) as f:
            have = Variant.from_meta(json.load(f))
        if have != variant:
            raise ValueError(
                f"{out_dir} holds the variant {have.name}, not {variant.name}; give another --out_dir "
                "or delete the folder"
            )
        print(f"{out_dir} is complete; nothing to do")
        return out_dir
    rng, seen = random.Random(seed), set()
    splits = {}
    for name, n in (("test", n_test), ("val", n_val), ("train", n_train)):
        splits[name] = _draw(rng, n, seen, name, variant)
    if n_queries == 1:  # the paper's layout: the target is the row's final token
        loss = {"loss": "last"}
    else:  # every query's target follows its third ','
        loss = {"loss": "after_sep", "loss_sep": {"id": variant.stoi[","], "every": 3}}
    write_rows_dataset(
        out_dir,
        splits,
        empty_fix="give --n_train, --n_val and --n_test of at least 1",
        dataset=NAME,
        vocab_size=variant.pad_id + 1,
        pad_id=variant.pad_id,
        **loss,
        tokenizer={"kind": "char", "itos": list(variant.vocab) + ["<pad>"]},
        sampling={
            "seed": seed,
            "min_len": min_len,
            "max_len": max_len,
            "max_shift": max_shift,
            "zero_shift": False,
            "n_letters": n_letters,
            "n_queries": n_queries,
            "distinct_sources": True,
        },
        variant=variant.name,
    )
    summarize(out_dir)
    return out_dir


if __name__ == "__main__":
    p = arg_parser(__doc__, None)
    p.add_argument("--n_train", type=int, default=1_000_000)
    p.add_argument("--n_val", type=int, default=10_000)
    p.add_argument("--n_test", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=1337)
    for f in fields(Variant):
        p.add_argument(f"--{f.name}", type=int, default=f.default)
    run_cli(prepare, p)
