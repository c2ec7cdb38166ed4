"""A run folder is self-contained: sampling needs no dataset folder (checkpoint.py, sample.py)."""

import itertools
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import sample
import train
from checkpoint import miditok_tokenizer, tokenizer_to_checkpoint
from cli import atomic_write_json
from prepare.common import BinWriter, write_meta

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--batch_size=8",
    "--eval_iters=2",
    "--log_interval=2",
    "--warmup_iters=2",
    "--attn_backend=torch",
    "--compile=False",
    "--block_size=32",
    "--device=cpu",  # float comparisons across processes: on a GPU machine too
]
TEXT = "to be, or not to be: that is the question. " * 40


def char_dataset(folder):
    """A character-level stream dataset like data/shakespeare_char (tokenizer kind 'char')."""
    itos = sorted(set(TEXT))
    ids = np.array([itos.index(c) for c in TEXT])
    for split in ("train", "val", "test"):
        with BinWriter(os.path.join(folder, f"{split}.bin"), np.uint8) as w:
            w.write(ids)
    write_meta(
        folder,
        {
            "dataset": "toychar",
            "vocab_size": len(itos),
            "dtype": "uint8",
            "layout": "stream",
            "splits": {
                s: {"file": f"{s}.bin", "shape": [len(ids)], "tokens": len(ids)} for s in ("train", "val", "test")
            },
            "pad_id": None,
            "loss": "all",
            "tokenizer": {"kind": "char", "itos": itos},
        },
    )


def sample_text(out_dir):
    return sample.main(
        [
            f"--out_dir={out_dir}",
            "--start=to be",
            "--max_new_tokens=30",
            "--num_samples=2",
            "--device=cpu",
            "--attn_backend=torch",
        ]
    )


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory):
    """A tiny run trained with the relative data_root 'data', as a user would (from its folder)."""
    root = tmp_path_factory.mktemp("repo")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        char_dataset("data/toychar")
        train.main(
            TINY
            + [
                "--dataset=toychar",
                "--data_root=data",
                "--max_iters=6",
                "--eval_interval=3",
                "--out_dir=out-x-pope",
                "--learning_rate=3e-3",
            ]
        )
    finally:
        os.chdir(cwd)
    return root


@pytest.fixture
def trained_run(trained_once, tmp_path, monkeypatch):
    """A private copy of the trained run and its dataset; the current directory is its root."""
    for name in ("data", "out-x-pope"):
        shutil.copytree(trained_once / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_moved_run_folder_samples_the_same_text(trained_run, monkeypatch):
    before = sample_text("out-x-pope")
    elsewhere = trained_run / "laptop"
    shutil.move(str(trained_run / "out-x-pope"), str(elsewhere / "out-x-pope"))
    shutil.rmtree(trained_run / "data")
    monkeypatch.chdir(elsewhere)
    after = sample_text("out-x-pope")
    assert after == before and all(t.startswith("to be") for t in after)


def test_best_pt_and_ckpt_pt_hold_the_keys_of_the_format(trained_once):
    """checkpoint.py's format (module docstring): best.pt holds what evaluation, sampling and fine-tuning
    need; ckpt.pt adds what an exact resume needs. model_args has every GPTConfig field."""
    from dataclasses import fields

    from model import GPTConfig

    best = torch.load(trained_once / "out-x-pope" / "best.pt", weights_only=True)
    last = torch.load(trained_once / "out-x-pope" / "ckpt.pt", weights_only=True)
    shared = {"model", "model_args", "config", "iter_num", "best_val_loss", "tokenizer", "provenance"}
    assert set(best) == shared
    assert set(last) == shared | {"optimizer", "scaler", "rng", "data_position"}
    assert last["iter_num"] == 6 and last["data_position"] == {"seed": train.DEFAULTS["seed"], "iter_num": 6}
    assert set(last["model_args"]) == {f.name for f in fields(GPTConfig)}
    assert last["config"]["n_embd"] == last["model_args"]["n_embd"] == 32 and last["tokenizer"]["dataset"] == "toychar"
    assert len(last["provenance"]) == 1 and last["provenance"][0]["versions"]["torch"] == torch.__version__


def test_old_checkpoint_falls_back_to_meta_json_and_else_exits_2_naming_both(trained_run):
    path = trained_run / "out-x-pope" / "best.pt"
    want = sample_text("out-x-pope")
    state = torch.load(path, weights_only=True)
    del state["tokenizer"]  # a checkpoint written before tokenizers were stored
    torch.save(state, path)
    assert sample_text("out-x-pope") == want  # read from data/toychar/meta.json
    shutil.rmtree(trained_run / "data")
    p = subprocess.run(
        [sys.executable, os.path.join(REPO, "sample.py"), "--out_dir=out-x-pope", "--device=cpu"],
        cwd=trained_run,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert (
        os.path.join("out-x-pope", "best.pt") in p.stderr and os.path.join("data", "toychar", "meta.json") in p.stderr
    )


def test_miditok_tokenizer_file_travels_inside_the_checkpoint(tmp_path):
    """MAESTRO decodes with out_dir/tokenizer.json: the checkpoint embeds its text, so the tokenizer
    is rebuilt after the dataset folder is gone, with the same vocabulary and decoding."""
    from prepare import maestro

    tok = maestro.make_tokenizer()
    folder = tmp_path / "maestro"
    atomic_write_json(str(folder / "tokenizer.json"), tok.to_dict())  # as prepare/maestro.py writes it
    meta = {
        "dataset": "maestro",
        "vocab_size": 328,
        "pad_id": 0,
        "tokenizer": {"kind": "miditok", "class": "REMI", "file": "tokenizer.json"},
    }
    torch.save({"tokenizer": tokenizer_to_checkpoint(meta, str(folder))}, tmp_path / "best.pt")
    shutil.rmtree(folder)
    entry = torch.load(tmp_path / "best.pt", weights_only=True)["tokenizer"]
    rebuilt = miditok_tokenizer(entry)
    assert rebuilt.vocab == tok.vocab and len(rebuilt) == 328
    ids = [1, tok["Bar_None"], tok["Position_0"], tok["Pitch_60"], tok["Velocity_63"], tok["Duration_1.0.8"], 2]
    assert maestro.decode(rebuilt, ids).dumps_midi() == maestro.decode(tok, ids).dumps_midi()


def test_same_tokenizer_compares_what_ids_mean_not_where_the_tokenizer_came_from():
    from checkpoint import same_tokenizer

    def gpt2(dataset, source, **kw):
        return {
            "dataset": dataset,
            "vocab_size": 50257,
            "pad_id": None,
            "tokenizer": {
                "kind": "gpt2",
                "encoding": "gpt2",
                "n_vocab": 50257,
                "eot_id": 50256,
                "source": source,
                **kw,
            },
        }

    def remi(**kw):
        return {
            "dataset": "maestro",
            "vocab_size": 328,
            "pad_id": 0,
            "tokenizer": {"kind": "miditok", "class": "REMI", "file": "tokenizer.json", **kw},
        }

    def char(itos, pad_id=None):
        return {
            "dataset": "c",
            "vocab_size": len(itos),
            "pad_id": pad_id,
            "tokenizer": {"kind": "char", "itos": list(itos)},
        }

    assert same_tokenizer(gpt2("openwebtext", "tiktoken"), gpt2("pg19", "local"))  # same BPE, read two ways
    assert not same_tokenizer(gpt2("openwebtext", "tiktoken"), gpt2("pg19", "tiktoken", eot_id=0))
    assert same_tokenizer(remi(file_text="{a}"), remi(file_text="{a}")) and same_tokenizer(
        remi(file_text="{a}"), remi()
    )
    assert not same_tokenizer(remi(file_text="{a}"), remi(file_text="{b}"))  # another tokenizer.json
    assert same_tokenizer(char("abc"), char("abc")) and not same_tokenizer(char("abc"), char("abd"))
    assert not same_tokenizer(char("abc"), char("abc", pad_id=2)) and not same_tokenizer(char("abc"), char("abcd"))


def test_a_maestro_run_stores_its_tokenizer_json_in_best_pt(tmp_path):
    """A real (2-step) run on a MAESTRO-like dataset made by prepare/maestro.py from generated MIDI
    (rows of 33 REMI tokens): best.pt carries tokenizer.json's text, so the tokenizer is rebuilt
    from the run folder alone, with the vocabulary prepare/maestro.py defines."""
    import random

    from test_prepare_music_genome import write_midi

    from prepare import maestro

    rng, midi = random.Random(0), tmp_path / "midi"
    midi.mkdir()
    for i in range(4):  # 2 train (x 7 transpositions), 1 val, 1 test piece
        write_midi(
            str(midi / f"piece{i}.mid"), [(j * 240, 200, rng.randint(40, 90), rng.randint(30, 110)) for j in range(8)]
        )
    data = tmp_path / "data" / "maestro"
    maestro.prepare(out_dir=str(data), input=str(midi), max_len=33, num_proc=1)
    text = (data / "tokenizer.json").read_text(encoding="utf-8")
    out = str(tmp_path / "out")
    train.main(
        TINY
        + [
            f"--data_root={tmp_path / 'data'}",
            "--dataset=maestro",
            "--max_iters=2",
            "--eval_interval=2",
            f"--out_dir={out}",
            "--pos_encoding=pope",
            "--dropout=0.0",
            "--learning_rate=1e-2",
        ]
    )
    shutil.rmtree(tmp_path / "data")
    entry = torch.load(os.path.join(out, "best.pt"), weights_only=True)["tokenizer"]
    assert entry["tokenizer"]["file_text"] == text and entry["vocab_size"] == 328 and entry["pad_id"] == 0
    assert miditok_tokenizer(entry).vocab == maestro.make_tokenizer().vocab


def test_metrics_json_holds_the_runs_settings_and_its_whole_wall_time(tmp_path, monkeypatch):
    """metrics.json, which study/results.py groups and times runs by: "config" is every train.py setting as
    this run used it (DEFAULTS, then the command line), and wall_time_s (seconds) spans the whole run,
    each logged training step included. train.py reads a fake clock here that ticks 1 s per reading."""
    char_dataset(str(tmp_path / "data" / "toychar"))
    clock = itertools.count()
    monkeypatch.setattr(train, "time", SimpleNamespace(time=lambda: float(next(clock))))
    out = str(tmp_path / "out")
    m = train.main(
        TINY
        + [
            "--dataset=toychar",
            f"--data_root={tmp_path / 'data'}",
            "--max_iters=4",
            "--eval_interval=4",
            "--seed=7",
            f"--out_dir={out}",
        ]
    )
    on_disk = json.load(open(os.path.join(out, "metrics.json")))
    given = {
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 32,
        "batch_size": 8,
        "eval_iters": 2,
        "log_interval": 2,
        "warmup_iters": 2,
        "attn_backend": "torch",
        "compile": False,
        "block_size": 32,
        "device": "cpu",
        "dataset": "toychar",
        "data_root": str(tmp_path / "data"),
        "max_iters": 4,
        "eval_interval": 4,
        "seed": 7,
        "out_dir": out,
    }
    resolved = {"reset_position_ids": False}  # None resolves to False under attn_mask_type='causal'
    assert on_disk["config"] == m["config"] == {**train.DEFAULTS, **given, **resolved}
    with open(os.path.join(out, "log.jsonl")) as f:
        steps_s = sum(r["ms_per_iter"] * 2 / 1000 for r in map(json.loads, f) if "loss" in r)  # log_interval 2
    assert steps_s >= 4 and on_disk["wall_time_s"] > steps_s


def test_eval_only_resume_with_the_out_dir_alone_scores_and_records_the_checkpoints_model(trained_run):
    """`--eval_only=True --init_from=resume` without the run's model flags (here 2 x 32 at block_size 32,
    where the defaults say 4 x 128 at 256): metrics.json names the checkpoint's model, whose settings
    study/results.py groups by, and scores it at its own block_size: the numbers the run itself wrote."""
    first = json.load(open("out-x-pope/metrics.json"))
    again = train.main(
        [
            "--eval_only=True",
            "--init_from=resume",
            "--out_dir=out-x-pope",
            "--dataset=toychar",
            "--data_root=data",
            "--attn_backend=torch",
            "--compile=False",
            "--device=cpu",
        ]
    )
    assert {k: again["config"][k] for k in ("n_layer", "n_embd", "block_size")} == {
        "n_layer": 2,
        "n_embd": 32,
        "block_size": 32,
    }
    assert again["test"] == first["test"] and again["val"] == first["val"]


def test_the_repo_modules_import_one_another_without_a_circle():
    """Every import between the repo's top-level modules (at the top of a file or inside a function) forms no
    circle: checkpoint.py and sharding.py imported each other (the dcp folder's hint), the house's only one."""
    import ast

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    names = {f[:-3] for f in os.listdir(repo) if f.endswith(".py")}
    graph = {}
    for name in names:
        with open(os.path.join(repo, name + ".py")) as f:
            tree = ast.parse(f.read())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                deps.add(node.module.split(".")[0])
        graph[name] = (deps & names) - {name}
    assert {"checkpoint", "sharding", "train", "model"} <= names and "checkpoint" in graph["sharding"]

    def circle(start, node, path):
        for dep in sorted(graph[node]):
            if dep == start:
                return path + [dep]
            if dep not in path:
                found = circle(start, dep, path + [dep])
                if found:
                    return found
        return None

    circles = [c for c in (circle(n, n, [n]) for n in sorted(names)) if c]
    assert not circles, " -> ".join(circles[0])
