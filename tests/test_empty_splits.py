"""An empty split stops the prepare script (exit 2, with the fix), and older empty data stops train.py."""

import os
import random
import subprocess
import sys

import numpy as np
import pytest

import train
from cli import atomic_write_json
from data import Dataset
from prepare import indirect_indexing
from prepare.common import EmptySplitError, write_meta

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_genome_fasta_of_chromosome_x_only_exits_2_naming_split_fraction(tmp_path):
    """The issue's case: a FASTA holding only chrX has no chromosome 21 (val) or 22 (test)."""
    rng = random.Random(0)
    dna = "".join(rng.choice("ACGT") for _ in range(6000 * 3))
    (tmp_path / "chrX.fa").write_text(">chrX\n" + "\n".join(dna[i : i + 60] for i in range(0, len(dna), 60)) + "\n")
    out = tmp_path / "genome"
    p = subprocess.run(
        [
            sys.executable,
            "prepare/genome.py",
            f"--input={tmp_path / 'chrX.fa'}",
            f"--out_dir={out}",
            "--block_bp=6000",
            "--num_proc=1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    error = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "'val', 'test'" in error[0] and "--split fraction" in error[0], p.stderr
    assert not os.path.exists(out / "meta.json") and not [f for f in os.listdir(out) if f.endswith(".bin")]


def test_shared_writers_refuse_an_empty_split(tmp_path):
    with pytest.raises(EmptySplitError, match=r"split 'val' would be empty; give --n_train, --n_val and --n_test"):
        indirect_indexing.prepare(str(tmp_path / "ii"), n_train=20, n_val=0, n_test=5)
    assert not list(tmp_path.glob("ii/*"))  # nothing written
    stream = tmp_path / "s"
    os.makedirs(stream)
    for name, n in (("train", 9), ("val", 0)):
        np.zeros(n, np.uint8).tofile(stream / f"{name}.bin")
    meta = {
        "dataset": "s",
        "vocab_size": 4,
        "dtype": "uint8",
        "layout": "stream",
        "pad_id": None,
        "loss": "all",
        "tokenizer": {"kind": "none"},
        "splits": {n: {"file": f"{n}.bin", "shape": [k], "tokens": k} for n, k in (("train", 9), ("val", 0))},
    }
    with pytest.raises(EmptySplitError, match="'val' would be empty; use a longer text"):
        write_meta(str(stream), meta, "use a longer text")
    assert not os.path.exists(stream / "meta.json")


def _old_genome_with_empty_splits(folder):
    """As the old genome.py left it: meta.json says val and test have 0 rows."""
    os.makedirs(folder)
    np.zeros((3, 9), np.uint16).tofile(folder / "train.bin")
    for name in ("val", "test"):
        open(folder / f"{name}.bin", "wb").close()
    atomic_write_json(
        str(folder / "meta.json"),
        {
            "format": 1,
            "dataset": "genome",
            "vocab_size": 8,
            "dtype": "uint16",
            "layout": "rows",
            "pad_id": 1,
            "loss": "all",
            "tokenizer": {"kind": "none"},
            "splits": {
                n: {"file": f"{n}.bin", "shape": [r, 9], "tokens": 9 * r}
                for n, r in (("train", 3), ("val", 0), ("test", 0))
            },
        },
    )


def test_old_data_with_an_empty_split_is_refused_and_train_exits_2(tmp_path, capsys):
    folder = tmp_path / "genome"
    _old_genome_with_empty_splits(folder)
    with pytest.raises(ValueError, match=r"split 'val', 'test' is empty .*prepare it again.*--split fraction"):
        Dataset(str(folder))
    with pytest.raises(SystemExit) as e:
        train.main([f"--data_root={tmp_path}", "--dataset=genome", f"--out_dir={tmp_path / 'out'}", "--block_size=8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "'val', 'test' is empty" in err


def test_eval_extrapolate_on_data_with_an_empty_split_exits_2_with_one_line(tmp_path, capsys):
    """The same data given to eval_extrapolate.py: one line naming the fix, exit 2 (no traceback)."""
    import eval_extrapolate

    _old_genome_with_empty_splits(tmp_path / "genome")
    with pytest.raises(SystemExit) as e:
        eval_extrapolate.main([str(tmp_path / "run"), f"--data_root={tmp_path}", "--dataset=genome"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "'val', 'test' is empty" in err and "prepare it again" in err
