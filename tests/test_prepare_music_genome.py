"""prepare/jsb.py, prepare/maestro.py and prepare/genome.py on small generated inputs.

Expected values come from hand-computed token lists, from an independent path (score-level
transposition with symusic versus the script's token-level shift; a plain-Python cleaner for DNA),
or from the documented format (raster order, 6-mer edge cases, vocab sizes 90 / 328 / 4107).
"""

import gzip
import json
import os
import random
import sys
from collections import Counter

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from prepare import common, genome, jsb, maestro  # noqa: E402


def mtimes(folder):
    return {f: os.stat(os.path.join(folder, f)).st_mtime_ns for f in sorted(os.listdir(folder))}


def docs(out, meta):
    """{split: document offsets} from meta.json's "documents" (prepare/common.py write_documents)."""
    d = meta["documents"]
    return {s: np.fromfile(os.path.join(out, d[s]["file"]), dtype=np.int64).tolist() for s in d}


def load(folder):
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    arrays = {
        s: np.fromfile(os.path.join(folder, v["file"]), dtype=meta["dtype"]).reshape(v["shape"])
        for s, v in meta["splits"].items()
    }
    return meta, arrays


def assert_second_run_is_noop(prepare_fn, out_dir, **kw):
    before = mtimes(out_dir)
    assert prepare_fn(out_dir=out_dir, **kw) == out_dir
    assert mtimes(out_dir) == before


# ---------------------------------------------------------------- JSB


def test_jsb_raster_order_vocab_and_round_trip():
    piece = [[60, 64, 67, 72], [61, -1, 68, 48]]
    # step 0: S A T B, then step 1: S A T B; id = pitch - 21, silence 88
    assert jsb.encode(piece).tolist() == [39, 43, 46, 51, 40, 88, 47, 27]
    assert (jsb.VOCAB_SIZE, jsb.SILENCE_ID, jsb.PAD_ID, len(jsb.ITOS)) == (90, 88, 89, 90)
    assert jsb.encode([[21, 108, -1, -1]]).tolist() == [0, 87, 88, 88]
    assert jsb.decode(list(jsb.encode(piece)) + [jsb.PAD_ID] * 5) == piece
    with pytest.raises(ValueError, match="4 voices"):
        jsb.encode([[60, 64, 67]])
    with pytest.raises(ValueError, match="neither -1"):
        jsb.encode([[60, 64, 67, 20]])


def test_jsb_prepare_json(tmp_path):
    rng = random.Random(0)
    piece = lambda n: [[rng.choice([-1] + list(range(36, 82))) for _ in range(4)] for _ in range(n)]  # noqa: E731
    long = piece(600)  # > 512 steps: two windows
    data = {"train": [piece(10), long, piece(3)], "valid": [piece(7), piece(2)], "test": [piece(5)]}
    src = tmp_path / "Jsb16thSeparated.json"
    src.write_text(json.dumps(data))
    out = str(tmp_path / "jsb")
    jsb.prepare(out_dir=out, input=str(src))
    meta, arr = load(out)
    assert meta["vocab_size"] == 90 and meta["pad_id"] == 89 and meta["loss"] == "all"
    assert meta["official_split"] is True and meta["pieces"] == {"train": 3, "val": 2, "test": 1}
    assert {s: a.shape for s, a in arr.items()} == {"train": (4, 2048), "val": (2, 2048), "test": (1, 2048)}
    row0 = arr["train"][0]
    assert row0[:40].tolist() == jsb.encode(data["train"][0]).tolist() and (row0[40:] == 89).all()
    # the long piece: window 1 = steps 0..511, window 2 starts on soprano of step 512
    assert arr["train"][1].tolist() == jsb.encode(long[:512]).tolist()
    assert jsb.decode(arr["train"][2]) == long[512:]
    assert jsb.decode(arr["val"][1]) == data["valid"][1]
    assert docs(out, meta) == {"train": [0, 1, 3, 4], "val": [0, 1, 2], "test": [0, 1]}  # one per piece (rows)
    assert_second_run_is_noop(jsb.prepare, out, input=str(src))


def test_jsb_music21_matrix_on_a_hand_built_score():
    from music21 import chord, note, stream

    def part(*events):
        p = stream.Part()
        for e in events:
            p.append(e)
        return p

    score = stream.Score()
    score.insert(
        0, part(note.Note(72, quarterLength=1), note.Rest(quarterLength=0.5), note.Note(74, quarterLength=0.5))
    )
    score.insert(0, part(note.Note(67, quarterLength=2)))
    score.insert(
        0,
        part(
            chord.Chord([60, 64], quarterLength=1), note.Note(62, quarterLength=0.25), note.Note(63, quarterLength=0.75)
        ),
    )
    score.insert(0, part(note.Note(48, quarterLength=2)))
    expected = [[72, 67, 64, 48]] * 4 + [[-1, 67, 62, 48], [-1, 67, 63, 48], [74, 67, 63, 48], [74, 67, 63, 48]]
    assert jsb.chorale_matrix(score).tolist() == expected
    three = stream.Score()
    for _ in range(3):
        three.insert(0, part(note.Note(60, quarterLength=1)))
    assert jsb.chorale_matrix(three) is None


def test_jsb_music21_source_is_labelled_unofficial(tmp_path):
    out = str(tmp_path / "jsb21")
    jsb.prepare(out_dir=out, source="music21", num_proc=2, limit=8)
    meta, arr = load(out)
    assert meta["official_split"] is False and meta["vocab_size"] == 90
    kept = sum(meta["pieces"].values())
    assert kept + meta["skipped_not_4_parts"] == 8 and kept >= 4
    assert all(a.shape[1] == 2048 for a in arr.values())


# ---------------------------------------------------------------- MAESTRO


def write_midi(path, notes, tpq=480):
    """notes: (start_tick, duration_ticks, pitch, velocity); a sustain pedal is pressed over the first beat."""
    import mido

    mid = mido.MidiFile(ticks_per_beat=tpq)
    track = mido.MidiTrack()
    mid.tracks.append(track)
    events = [
        (0, 0, mido.Message("control_change", control=64, value=127)),
        (tpq, 0, mido.Message("control_change", control=64, value=0)),
    ]
    for t, d, p, v in notes:
        events += [(t, 1, mido.Message("note_on", note=p, velocity=v)), (t + d, 0, mido.Message("note_off", note=p))]
    now = 0
    for t, _, msg in sorted(events, key=lambda e: (e[0], e[1])):
        track.append(msg.copy(time=t - now))
        now = t
    mid.save(path)


@pytest.fixture(scope="module")
def midi_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("midis")
    rng = random.Random(1)
    for i in range(6):
        notes = [(j * 240, 200, rng.randint(40, 90), rng.randint(30, 110)) for j in range(12 + i)]
        write_midi(str(d / f"piece{i}.mid"), notes)
    write_midi(str(d / "low.mid"), [(0, 240, 22, 80), (240, 240, 60, 80)])  # k = -2, -3 leave the keyboard
    write_midi(str(d / "long.midi"), [(j * 120, 100, 40 + j % 40, 80) for j in range(800)])  # > 2048 tokens
    (d / "corrupt.mid").write_bytes(b"MThd\x00\x00\x00\x06" + bytes(range(200)))
    return d


def test_maestro_vocab_is_328_with_the_documented_breakdown():
    tok = maestro.make_tokenizer()
    assert len(tok) == 328
    kinds = Counter(t.split("_")[0] for t in tok.vocab)
    assert kinds == {
        "PAD": 1,
        "BOS": 1,
        "EOS": 1,
        "MASK": 1,
        "Bar": 1,
        "Position": 96,
        "Pitch": 88,
        "Velocity": 32,
        "Duration": 64,
        "Tempo": 32,
        "TimeSig": 9,
        "Pedal": 1,
        "PedalOff": 1,
    }
    assert (tok.pad_token_id, tok["BOS_None"], tok["EOS_None"]) == (0, 1, 2)


def test_maestro_windows_overlap_by_one_token():
    ids = np.arange(1, 11)
    rows = maestro.windows(ids, 4, pad_id=0)
    assert rows.tolist() == [[1, 2, 3, 4], [4, 5, 6, 7], [7, 8, 9, 10]]
    assert maestro.windows(np.arange(1, 6), 4, 0).tolist() == [[1, 2, 3, 4], [4, 5, 0, 0]]


def test_maestro_prepare(midi_dir, tmp_path):
    from symusic import Score

    out = str(tmp_path / "maestro")
    maestro.prepare(out_dir=out, input=str(midi_dir), num_proc=2)
    meta, arr = load(out)
    assert meta["vocab_size"] == 328 and meta["pad_id"] == 0 and meta["loss"] == "all"
    assert meta["skipped_files"] == 1 and list(meta["skipped"]) == ["corrupt.mid"]
    files = meta["split_files"]
    assert sorted(sum(files.values(), [])) == sorted(["long.midi", "low.mid"] + [f"piece{i}.mid" for i in range(6)])
    assert len(files["val"]) == 1 and len(files["test"]) == 1
    assert meta["transpositions"] == {"train": [-3, -2, -1, 0, 1, 2, 3], "val": [0], "test": [0]}

    tok = maestro.make_tokenizer()
    dropped, pairs = 0, 0
    off = docs(out, meta)
    for split, names in files.items():  # rebuild every split by transposing the *score* (independent path)
        expected, doc_rows = [], [0]
        for name in names:
            score = Score(str(midi_dir / name))
            lowest = min(n.pitch for n in score.tracks[0].notes)
            for k in range(-3, 4) if split == "train" else [0]:
                if lowest + k < 21:
                    dropped += 1
                    continue
                ids = maestro.encode_score(tok, score.shift_pitch(k))
                pairs += 1
                for start in range(0, max(len(ids) - 1, 1), 2047):
                    chunk = ids[start : start + 2048]
                    expected.append(np.pad(chunk, (0, 2048 - len(chunk))))
                doc_rows.append(len(expected))  # one document per piece and transposition
        assert np.array_equal(arr[split], np.array(expected).reshape(-1, 2048)), split
        assert off[split] == doc_rows, split
    assert meta["transpositions_skipped_out_of_range"] == dropped == (2 if "low.mid" in files["train"] else 0)
    assert sum(map(len, arr.values())) > pairs  # the long piece spans two rows
    lo, hi = maestro.pitch_id_range(tok)
    low = maestro.encode_score(tok, Score(str(midi_dir / "low.mid")))
    assert maestro.transpose(low, -2, lo, hi) is None and maestro.transpose(low, -1, lo, hi) is not None

    val_ids = np.concatenate([arr["val"][0]] + [r[1:] for r in arr["val"][1:]])  # the one val piece, whole
    val_ids = val_ids[val_ids != 0]
    assert val_ids[0] == 1 and val_ids[-1] == 2  # BOS ... EOS
    assert np.array_equal(maestro.encode_score(tok, maestro.decode(tok, val_ids)), val_ids)  # encode(decode(x)) == x
    assert_second_run_is_noop(maestro.prepare, out, input=str(midi_dir))


# ---------------------------------------------------------------- genome


def nt_clean(s):
    return "".join(c if c in "ACGT" else "N" for c in s.upper())


@pytest.mark.parametrize(
    "seq, tokens",
    [
        ("ACGTACGTACNACG", ["ACGTAC", "G", "T", "A", "C", "N", "A", "C", "G"]),
        ("acgtacNNttttttA", ["ACGTAC", "N", "N", "TTTTTT", "A"]),
        ("NACGTACGTACGT", ["N", "ACGTAC", "GTACGT"]),
        ("ACGTRYACGTAC", ["A", "C", "G", "T", "N", "N", "ACGTAC"]),
        ("AAAAAAA", ["AAAAAA", "A"]),
        ("", []),
    ],
)
def test_genome_6mer_edge_cases(seq, tokens):
    ids = genome.encode(seq)
    assert [genome.ITOS[i] for i in ids] == tokens
    assert genome.decode(ids) == nt_clean(seq)


def test_genome_vocab_follows_nucleotide_transformer_order():
    itos = genome.ITOS
    assert genome.VOCAB_SIZE == len(itos) == 4107
    assert itos[:4] == ["<unk>", "<pad>", "<mask>", "<cls>"] and itos[4105:] == ["<eos>", "<bos>"]
    assert itos[4100:4105] == ["A", "T", "C", "G", "N"]
    assert genome.encode("AAAAAA").tolist() == [4] and genome.encode("AAAAAT").tolist() == [5]
    assert genome.encode("TAAAAA").tolist() == [4 + 4**5] and genome.encode("GGGGGG").tolist() == [4099]
    assert genome.encode("ATCGN").tolist() == [4100, 4101, 4102, 4103, 4104]


def random_dna(rng, n):
    return "".join(rng.choice("ACGT") for _ in range(n))


def write_fasta(path, records, width=60):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt") as f:
        for header, seq in records:
            f.write(f">{header}\n" + "".join(seq[i : i + width] + "\n" for i in range(0, len(seq), width)))


@pytest.fixture(scope="module")
def fasta_records():
    rng = random.Random(2)
    chr1 = random_dna(rng, 20011)
    chr1 = chr1[:300] + chr1[300:900].lower() + chr1[900:5990] + "N" * 6020 + chr1[12010:15000] + "RYKM" + chr1[15004:]
    return [
        ("NC_000001.11 Homo sapiens chromosome 1, GRCh38.p14 Primary Assembly", chr1),
        ("chr21", random_dna(rng, 7003)),
        ("22 dna:chromosome chromosome:GRCh38:22", random_dna(rng, 6500)[:6100] + "acgtnnacgt"),
        ("chrM", random_dna(rng, 500)),
        ("chr1_KI270706v1_random", random_dna(rng, 300)),
    ]


def test_genome_prepare_plain_and_gz(fasta_records, tmp_path):
    outs = []
    for name in ("g.fa", "g.fa.gz"):
        write_fasta(tmp_path / name, fasta_records)
        out = str(tmp_path / f"out_{name}")
        genome.prepare(out_dir=out, input=str(tmp_path / name), block_bp=12000, num_proc=2)
        outs.append(out)
    meta, arr = load(outs[0])
    meta_gz, arr_gz = load(outs[1])
    assert all(np.array_equal(arr[s], arr_gz[s]) for s in arr)
    assert meta["vocab_size"] == 4107 and meta["pad_id"] == 1 and meta["loss"] == "all"
    assert meta["skipped_records"] == 2 and meta["all_n_chunks_dropped"] == 1
    assert meta["records"] == {"train": 1, "val": 1, "test": 1}
    assert docs(outs[0], meta) == {"train": [0, 5], "val": [0, 2], "test": [0, 2]}  # one per record
    for a in arr.values():
        assert a.shape[1] == 1001 and (a[:, 0] == genome.CLS_ID).all()
    chr1, chr21, chr22 = (nt_clean(s) for _, s in fasta_records[:3])
    assert genome.decode(arr["train"].ravel()) == chr1[:6000] + chr1[12000:]  # the all-N chunk 2 is dropped
    assert genome.decode(arr["val"].ravel()) == chr21
    assert genome.decode(arr["test"].ravel()) == chr22
    # chr21 = 6000 bp (1000 6-mers) + 1003 bp (167 6-mers + 1 base); chunk 2 of chr1 holds Ns -> 2 rows
    assert (arr["val"] != 1).sum(1).tolist() == [1001, 169]
    assert len(arr["train"]) == 5
    assert_second_run_is_noop(genome.prepare, outs[0], input=str(tmp_path / "g.fa"), block_bp=12000, num_proc=2)


def test_genome_without_input_uses_the_fasta_already_in_raw_offline(fasta_records, tmp_path, monkeypatch):
    """No --input: the FASTA already at out_dir/raw/<name of URL> is used, the network never asked."""

    def no_network(*args, **kwargs):
        raise AssertionError("no download expected")

    monkeypatch.setattr(common.urllib.request, "urlopen", no_network)
    out = tmp_path / "genome"
    write_fasta(tmp_path / "g.fa.gz", fasta_records)  # the URL's file is a .fna.gz
    os.makedirs(out / "raw")
    os.replace(tmp_path / "g.fa.gz", out / "raw" / os.path.basename(genome.URL))
    genome.prepare(out_dir=str(out), block_bp=12000, num_proc=2)
    meta, arr = load(str(out))
    assert meta["records"] == {"train": 1, "val": 1, "test": 1} and len(arr["train"]) == 5


def test_genome_fraction_split_and_clear_error(tmp_path):
    rng = random.Random(3)
    records = [("contigA some text", random_dna(rng, 6000 * 40 + 17)), ("contigB", random_dna(rng, 6000 * 30))]
    path = tmp_path / "other.fa"
    write_fasta(path, records)
    with pytest.raises(ValueError, match="--split fraction"):
        genome.prepare(out_dir=str(tmp_path / "chrom"), input=str(path), block_bp=6000, num_proc=2)
    assert not os.path.exists(tmp_path / "chrom" / "meta.json")
    out = str(tmp_path / "frac")
    genome.prepare(out_dir=out, input=str(path), split="fraction", block_bp=6000, num_proc=2)
    _, arr = load(out)
    expected = {"train": "", "val": "", "test": ""}
    for header, seq in records:
        for k in range(0, len(seq), 6000):
            expected[genome.split_of(header, k // 6000, "fraction")] += seq[k : k + 6000]
    assert {s: genome.decode(a.ravel()) for s, a in arr.items()} == expected
    off = docs(out, load(out)[0])
    runs = {s: [] for s in arr}  # a document: consecutive blocks of one record in one split, one row each here
    for header, seq in records:
        for k in range(0, len(seq), 6000):
            s, j = genome.split_of(header, k // 6000, "fraction"), k // 6000
            if runs[s] and runs[s][-1][0] == (header, j - 1):
                runs[s][-1] = ((header, j), runs[s][-1][1] + 1)
            else:
                runs[s].append(((header, j), 1))
    assert off == {s: np.cumsum([0] + [n for _, n in r]).tolist() for s, r in runs.items()}


def test_genome_unwrapped_fasta_is_cut_into_the_same_blocks_as_a_wrapped_one(tmp_path):
    """A record on one line (no wrapping) is several blocks, not one block holding the whole rest."""
    rng = random.Random(4)
    records = [("contig17", random_dna(rng, 6000 * 12 + 5))]  # blocks 2, 6 -> val, 10 -> test
    arrays = []
    for width in (60, 10**6):
        write_fasta(tmp_path / f"w{width}.fa", records, width=width)
        out = str(tmp_path / f"out{width}")
        genome.prepare(out_dir=out, input=str(tmp_path / f"w{width}.fa"), split="fraction", block_bp=6000, num_proc=1)
        arrays.append(load(out)[1])
        assert [len(b) for _, _, b in genome.iter_blocks(str(tmp_path / f"w{width}.fa"), 6000)] == [6000] * 12 + [5]
    assert all(np.array_equal(arrays[0][s], arrays[1][s]) for s in ("train", "val", "test"))


def test_genome_source_takes_block_bp_and_the_hash_sends_known_blocks_to_val_and_test(tmp_path, monkeypatch):
    """--source with --block_bp=6000 cuts 6000-bp blocks (not the source's 30,000); the hash of
    (contig17, block) sends blocks 2 and 6 to val and 10 to test (crc32("contig17:k") / 2^32 is 0.031, 0.002
    and 0.055 for k = 2, 6, 10, and above 0.10 for the others: below 0.05 val, then up to 0.10 test, as the
    module docstring says); meta.json counts every row's <cls> among its tokens."""
    rng = random.Random(4)
    seq = random_dna(rng, 6000 * 12 + 5)
    write_fasta(tmp_path / "k.fa", [("contig17 plasmid", seq)])
    monkeypatch.setitem(
        genome.SOURCES, "kleborate-examples", (str(tmp_path / "k.fa"), str(tmp_path / "dflt"), "fraction", 30_000)
    )
    out = str(tmp_path / "out")
    genome.prepare(out_dir=out, source="kleborate-examples", block_bp=6000, num_proc=1)
    meta, arr = load(out)
    assert meta["block_bp"] == 6000 and meta["split"] == "fraction" and meta["package"] == "kleborate-examples"
    blocks = [seq[i : i + 6000] for i in range(0, len(seq), 6000)]
    assert genome.decode(arr["val"].ravel()) == blocks[2] + blocks[6]
    assert genome.decode(arr["test"].ravel()) == blocks[10]
    assert genome.decode(arr["train"].ravel()) == "".join(b for i, b in enumerate(blocks) if i not in (2, 6, 10))
    for s, a in arr.items():  # 1000 6-mers per clean block and one <cls> per row: all of them tokens
        assert meta["splits"][s]["tokens"] == int((a != genome.PAD_ID).sum()) == meta["dna_tokens"][s] + len(a)
    assert meta["splits"]["val"]["tokens"] == 2 * 1001


@pytest.mark.parametrize("block_bp", [0, 9000, 6001])
def test_genome_block_bp_off_the_6kb_grid_or_not_positive_is_refused(block_bp, tmp_path, monkeypatch):
    write_fasta(tmp_path / "k.fa", [("contig17", "ACGT" * 3000)])
    monkeypatch.setitem(
        genome.SOURCES, "kleborate-examples", (str(tmp_path / "k.fa"), str(tmp_path / "dflt"), "fraction", 30_000)
    )
    with pytest.raises(ValueError, match=f"block_bp must be a positive multiple of 6000, got {block_bp}"):
        genome.prepare(out_dir=str(tmp_path / "out"), source="kleborate-examples", block_bp=block_bp, num_proc=1)
    with pytest.raises(ValueError, match="positive multiple of 6000"):
        genome.prepare(out_dir=str(tmp_path / "out"), input=str(tmp_path / "k.fa"), block_bp=block_bp, num_proc=1)
    assert not os.path.exists(tmp_path / "out" / "meta.json")


def test_genome_negative_block_bp_exits_2_instead_of_hanging(tmp_path):
    """-6000 is a multiple of 6000: it used to pass the check, and the block loop then yielded empty blocks forever."""
    import subprocess

    write_fasta(tmp_path / "k.fa", [("contig17", "ACGT" * 3000)])
    p = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "prepare", "genome.py"),
            "--input",
            str(tmp_path / "k.fa"),
            "--block_bp=-6000",
            "--split",
            "fraction",
            "--out_dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and p.stderr == "error: block_bp must be a positive multiple of 6000, got -6000\n"


def test_maestro_official_split_from_csv(tmp_path):
    root = tmp_path / "maestro-v3.0.0"
    (root / "2018").mkdir(parents=True)
    rows = [("2018/a.midi", "train"), ("2018/b.midi", "validation"), ("2018/c.midi", "test")]
    for i, (name, _) in enumerate(rows + [("2018/unlisted.midi", None)]):
        write_midi(str(root / name), [(0, 240, 60 + i, 80)])
    (root / "maestro-v3.0.0.csv").write_text(
        "canonical_composer,canonical_title,split,year,midi_filename,audio_filename,duration\n"
        + "".join(f"X,T{i},{s},2018,{n},{n}.wav,1.0\n" for i, (n, s) in enumerate(rows))
    )
    out = str(tmp_path / "out")
    maestro.prepare(out_dir=out, input=str(tmp_path), split="official", num_proc=1)
    meta, arr = load(out)
    assert meta["split_files"] == {
        "train": ["maestro-v3.0.0/2018/a.midi"],
        "val": ["maestro-v3.0.0/2018/b.midi"],
        "test": ["maestro-v3.0.0/2018/c.midi"],
    }
    assert meta["not_in_csv"] == ["maestro-v3.0.0/2018/unlisted.midi"]
    assert [len(a) for a in arr.values()] == [7, 1, 1]
