"""The CPU configs of the music and genome miniatures (config/train_{jsb,genome}_cpu.py) train on the
data their prepare scripts make: JSB from the Bach chorales that the music21 package ships, the genome
from a small fabricated FASTA put where the Debian package kleborate-examples installs its genome
(the tests never need that package). Each run loads the config file itself, with only max_iters,
eval_iters and batch_size cut; the expected target counts come from the prepared arrays, counted here."""

import json
import lzma
import math
import os

import numpy as np
import pytest

import train
from data import Dataset
from prepare import genome, jsb
from prepare.indirect_indexing import Variant

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = ["--max_iters=2", "--eval_iters=1", "--log_interval=1", "--batch_size=1"]  # the config's model, 2 small steps


def arrays(folder):
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    return meta, {
        s: np.fromfile(os.path.join(folder, v["file"]), dtype=meta["dtype"]).reshape(v["shape"])
        for s, v in meta["splits"].items()
    }


def next_token_targets(rows, pad_id):
    """Targets of right-padded rows: every real token but each row's first."""
    return int((rows != pad_id).sum() - len(rows))


def train_config(config, data_root, out_dir, *extra):
    return train.main(
        [os.path.join(REPO, "config", config), *SHORT, f"--data_root={data_root}", f"--out_dir={out_dir}", *extra]
    )


def test_jsb_cpu_config_trains_on_the_music21_chorales(tmp_path):
    data = jsb.prepare(out_dir=str(tmp_path / "jsb_music21"), source="music21", num_proc=2, limit=8)
    metrics = train_config("train_jsb_cpu.py", str(tmp_path), str(tmp_path / "out"))
    cfg = metrics["config"]
    assert (metrics["dataset"], cfg["dataset"], metrics["pos_encoding"]) == ("jsb_music21", "jsb_music21", "pope")
    assert (cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["block_size"]) == (4, 4, 128, 2048)
    assert cfg["pope_delta_init"] == "uniform" and metrics["iter_num"] == 2
    _, arr = arrays(data)
    for split in ("val", "test"):  # every real token of the split scored once
        assert metrics[split]["targets"] == next_token_targets(arr[split], jsb.PAD_ID)
        assert math.isfinite(metrics[split]["loss"])


def write_fasta(path, records, opener=open):
    with opener(path, "wt") as f:
        for header, seq in records:
            f.write(f">{header}\n" + "\n".join(seq[i : i + 80] for i in range(0, len(seq), 80)) + "\n")


@pytest.fixture
def fake_kleborate(tmp_path, monkeypatch):
    """Random DNA (a 180-kb "chromosome" and an 18-kb "plasmid", .xz) put where SOURCES looks for the
    package's file; returns (records, path). The chromosome's name sends its 30-kb block 0 to test and
    block 4 to val under --split fraction, so every split has rows."""
    rng = np.random.default_rng(0)
    records = [("fake19 a chromosome of random DNA", 6 * 30_000 + 7), ("pfake a plasmid", 3 * 6000 + 5)]
    records = [(h, np.frombuffer(b"ACGT", np.uint8)[rng.integers(0, 4, n)].tobytes().decode()) for h, n in records]
    path = str(tmp_path / "pkg" / "MGH78578.fna.xz")
    os.makedirs(os.path.dirname(path))
    write_fasta(path, records, lambda p, mode: lzma.open(p, mode, preset=0))
    src = genome.SOURCES["kleborate-examples"]
    monkeypatch.setitem(genome.SOURCES, "kleborate-examples", (path, *src[1:]))
    return records, path


def test_genome_source_reads_the_packaged_xz_like_the_same_fasta_given_plainly(fake_kleborate, tmp_path):
    records, _ = fake_kleborate
    out = genome.prepare(out_dir=str(tmp_path / "genome_klebsiella"), source="kleborate-examples", num_proc=2)
    write_fasta(tmp_path / "plain.fa", records)
    ref = genome.prepare(
        out_dir=str(tmp_path / "ref"), input=str(tmp_path / "plain.fa"), split="fraction", block_bp=30_000, num_proc=2
    )
    meta, arr = arrays(out)
    _, ref_arr = arrays(ref)
    assert all(np.array_equal(arr[s], ref_arr[s]) for s in ("train", "val", "test"))
    assert (meta["package"], meta["split"], meta["block_bp"]) == ("kleborate-examples", "fraction", 30_000)
    expected = {"train": "", "val": "", "test": ""}  # 30-kb blocks by the documented hash rule
    for header, seq in records:
        for k in range(0, len(seq), 30_000):
            expected[genome.split_of(header, k // 30_000, "fraction")] += seq[k : k + 30_000]
    assert {s: genome.decode(a.ravel()) for s, a in arr.items()} == expected
    assert all(expected.values())


def test_genome_source_without_the_package_names_apt_get(monkeypatch, tmp_path):
    monkeypatch.setitem(
        genome.SOURCES, "kleborate-examples", (str(tmp_path / "absent.fna.xz"), str(tmp_path / "g"), "fraction", 30_000)
    )
    with pytest.raises(FileNotFoundError, match="apt-get install kleborate-examples"):
        genome.prepare(source="kleborate-examples")
    with pytest.raises(ValueError, match="not both"):
        genome.prepare(source="kleborate-examples", input="x.fa")


def test_genome_cpu_config_trains_on_the_source_layout(fake_kleborate, tmp_path):
    data = genome.prepare(out_dir=str(tmp_path / "genome_klebsiella"), source="kleborate-examples", num_proc=2)
    metrics = train_config("train_genome_cpu.py", str(tmp_path), str(tmp_path / "out"), "--pos_encoding=rope")
    cfg = metrics["config"]
    assert (metrics["dataset"], metrics["pos_encoding"]) == ("genome_klebsiella", "rope")
    assert (cfg["n_layer"], cfg["n_embd"], cfg["block_size"], cfg["beta2"]) == (4, 128, 1000, 0.999)
    _, arr = arrays(data)
    for split in ("val", "test"):
        assert metrics[split]["targets"] == next_token_targets(arr[split], genome.PAD_ID)
        assert math.isfinite(metrics[split]["loss"])


@pytest.mark.parametrize(
    "name, command",
    [
        ("jsb_music21", "python prepare/jsb.py --source music21"),
        ("genome_klebsiella", "python prepare/genome.py --source kleborate-examples"),
        ("maestro", "python prepare/maestro.py"),
        (
            "shakespeare_char_copyrand32",
            "python prepare/shakespeare_copymix.py --p_random=1 --min_span=4 --max_span=32",
        ),
    ],
)
def test_missing_dataset_names_its_prepare_command(tmp_path, name, command):
    with pytest.raises(FileNotFoundError, match=f"Run: {command} --out_dir="):
        Dataset(str(tmp_path / name))


def test_indirect_cpu_config_builds_its_variant_and_trains(tmp_path, small_indirect_splits):
    """`python train.py config/train_indirect_cpu.py` builds the variant its dataset names on first use
    (here with small splits, so the test is fast), and its block_size holds that variant's rows."""
    small_indirect_splits(300, 20, 30)
    metrics = train_config("train_indirect_cpu.py", str(tmp_path), str(tmp_path / "out"))
    cfg = metrics["config"]
    name = "indirect_indexing_letters8_len6-8_shift2_q6"
    assert (metrics["dataset"], metrics["pos_encoding"], cfg["rope_theta"]) == (name, "pope", 100.0)
    assert (cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["max_iters"]) == (2, 4, 64, 2)
    assert (cfg["learning_rate"], cfg["min_lr"]) == (3e-3, 3e-4)  # the pick of the LR grid, entry 7
    meta, arr = arrays(str(tmp_path / name))
    assert Variant.from_meta(meta) == Variant(n_letters=8, min_len=6, max_len=8, max_shift=2, n_queries=6)
    assert cfg["block_size"] >= arr["train"].shape[1] - 1  # a whole row, less its last target, fits
    assert metrics["test"]["targets"] == 30 * 6 and metrics["val"]["targets"] == 20 * 6
