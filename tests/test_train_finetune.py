"""train.py init_from='finetune' (weights of a checkpoint, new block_size / YaRN, fresh optimizer), and the
fine-tune and appendix-baseline configs checked against the configs they derive from."""

import json
import os
import shutil

import pytest
import torch
from test_train import REPO, TINY, run

import train


def test_finetune_loads_weights_new_block_size_and_yarn_with_a_fresh_optimizer(toy_stream, tmp_path, capsys):
    pre, ft = str(tmp_path / "pre"), str(tmp_path / "ft")
    common = TINY + [f"--data_root={toy_stream}", "--dataset=toy", "--pos_encoding=rope", "--batch_size=32"]
    run(common + ["--block_size=32", "--max_iters=4", "--eval_interval=4", f"--out_dir={pre}"])
    # lr 0: AdamW leaves the weights as loaded, so the fine-tune's checkpoint must hold the pretrained ones
    run(
        common
        + [
            "--init_from=finetune",
            f"--init_ckpt={pre}/best.pt",
            "--block_size=64",
            "--rope_scaling=2.0",
            "--max_iters=1",
            "--eval_interval=1",
            "--learning_rate=0.0",
            f"--out_dir={ft}",
        ]
    )
    a = torch.load(os.path.join(pre, "best.pt"), weights_only=True)
    b = torch.load(os.path.join(ft, "ckpt.pt"), weights_only=True)
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert b["iter_num"] == 1 and {s["step"].item() for s in b["optimizer"]["state"].values()} == {1.0}  # fresh
    assert (
        b["model_args"]["block_size"],
        b["model_args"]["rope_scaling"],
        b["model_args"]["rope_original_block_size"],
    ) == (64, 2.0, 32)
    for bad, message in [
        ("--pos_encoding=pope", "pos_encoding='rope'"),
        ("--n_embd=48", "n_embd=32"),
        (f"--out_dir={pre}", "would overwrite"),
    ]:
        with pytest.raises(SystemExit) as e:
            run(common + ["--init_from=finetune", f"--init_ckpt={pre}/best.pt", f"--out_dir={ft}2", bad])
        assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("size", ["", "_253m", "_774m", "_1558m"])
@pytest.mark.parametrize("kind,enc", [("yarn", "rope"), ("pope", "pope")])
def test_finetune_configs_keep_the_pretraining_architecture(size, kind, enc):
    """What train.py's fine-tune check would refuse on a GPU after hours of pretraining, caught here."""
    from configurator import configure

    ft = configure(train.DEFAULTS, [os.path.join(REPO, f"config/finetune_owt{size}_{kind}_4096.py")])
    pre = configure(train.DEFAULTS, [os.path.join(REPO, f"config/train_owt{size}_{enc}.py")])
    assert ft["init_from"] == "finetune" and os.path.dirname(ft["init_ckpt"]) == pre["out_dir"] != ft["out_dir"]
    arch = (
        "n_layer",
        "n_head",
        "n_embd",
        "bias",
        "pos_encoding",
        "rope_theta",
        "pope_magnitude",
        "pope_use_delta",
        "dataset",
    )
    assert {k: ft[k] for k in arch} == {k: pre[k] for k in arch}
    assert (ft["block_size"], ft["max_iters"], ft["warmup_iters"], ft["learning_rate"], ft["min_lr"]) == (
        4096,
        500,
        20,
        6e-5,
        6e-5,
    )
    assert ft["batch_size"] * ft["gradient_accumulation_steps"] == 64
    assert (ft["rope_scaling"], ft["rope_original_block_size"]) == ((4.0, 1024) if kind == "yarn" else (1.0, 0))


@pytest.mark.parametrize("enc", ["rope_half", "alibi_half", "learned", "sinusoidal"])
def test_indirect_baseline_configs_differ_from_rope_only_in_the_encoding(enc):
    from configurator import configure

    cfg = configure(train.DEFAULTS, [os.path.join(REPO, f"config/train_indirect_{enc}.py")])
    rope = configure(train.DEFAULTS, [os.path.join(REPO, "config/train_indirect_rope.py")])
    assert cfg["pos_encoding"] == enc
    assert {k: v for k, v in cfg.items() if cfg[k] != rope[k]}.keys() == {"pos_encoding", "out_dir"}


# --- fine-tuning guards and the fine-tune's own best.pt (a shared pretrained char-level run) -------


def _finetune(pre, *extra):
    """train.main for a fine-tune of pre's best.pt with the pretraining's tiny settings."""
    return train.main(pre["args"] + ["--init_from=finetune", f"--init_ckpt={pre['run']}/best.pt", *extra])


def _one_line_exit_2(capsys, fn, *args):
    with pytest.raises(SystemExit) as e:
        fn(*args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_finetune_on_another_tokenizer_of_the_same_size_exits_2_naming_both(char_pretrained, tmp_path, capsys):
    """chars and chars_upper both have 16 ids, so every shape fits: only the tokenizer check stops it."""
    err = _one_line_exit_2(
        capsys, _finetune, char_pretrained, "--dataset=chars_upper", "--max_iters=1", f"--out_dir={tmp_path / 'ft'}"
    )
    assert "'chars'" in err and "'chars_upper'" in err and "' ,.:abehinoqrstu'" in err and "' ,.:ABEHINOQRSTU'" in err
    assert not os.path.exists(tmp_path / "ft" / "best.pt")


def test_finetune_first_evaluation_is_a_best_pt_candidate_and_best_val_loss_starts_fresh(char_pretrained, tmp_path):
    """learning_rate 0 on data of the same tokenizer that the pretrained model predicts worse: the
    weights never change, every evaluation gives the same loss, higher than the pretraining's best.
    best.pt must still be written (at iter 0, the first evaluation) holding the fine-tune's own loss."""
    ft = str(tmp_path / "ft")
    m = _finetune(
        char_pretrained,
        "--dataset=chars_shuffled",
        "--block_size=32",
        "--learning_rate=0.0",
        "--decay_lr=False",
        "--max_iters=2",
        "--eval_interval=1",
        f"--out_dir={ft}",
    )
    with open(os.path.join(ft, "log.jsonl")) as f:
        val = {r["iter"]: r["val_loss"] for r in map(json.loads, f) if "val_loss" in r}
    pre = torch.load(os.path.join(char_pretrained["run"], "best.pt"), weights_only=True)
    assert sorted(val) == [0, 1, 2] and len(set(val.values())) == 1 and val[0] > pre["best_val_loss"] + 0.5
    best = torch.load(os.path.join(ft, "best.pt"), weights_only=True)
    assert best["iter_num"] == 0 and best["best_val_loss"] == val[0]
    assert best["model_args"]["block_size"] == 32 and best["tokenizer"]["dataset"] == "chars_shuffled"
    assert all(torch.equal(best["model"][k], pre["model"][k]) for k in pre["model"])
    last = torch.load(os.path.join(ft, "ckpt.pt"), weights_only=True)
    assert last["iter_num"] == 2 and last["best_val_loss"] == val[0]
    assert m["best_val_loss_fixed_batches"] == val[0] and m["checkpoint"] == os.path.join(ft, "best.pt")


@pytest.mark.parametrize(
    "spelling",
    [
        "trailing_slash",
        "dot_slash",
        "absolute",
        "dot_dot",
        "symlink_out_dir",
        "symlink_init_ckpt",
        "symlinked_file",
        "symlinked_file_folder",
    ],
)
def test_finetune_refuses_the_pretraining_folder_under_any_spelling(
    char_pretrained, spelling, tmp_path, monkeypatch, capsys
):
    shutil.copytree(char_pretrained["run"], tmp_path / "pre")
    os.symlink(tmp_path / "pre", tmp_path / "link")
    (tmp_path / "alias").mkdir()
    os.symlink(tmp_path / "pre" / "best.pt", tmp_path / "alias" / "best.pt")
    monkeypatch.chdir(tmp_path)
    before = {f: (tmp_path / "pre" / f).read_bytes() for f in os.listdir(tmp_path / "pre")}
    init_ckpt, out_dir = {
        "trailing_slash": ("pre/best.pt", "pre/"),
        "dot_slash": ("pre/best.pt", "./pre"),
        "absolute": ("pre/best.pt", str(tmp_path / "pre")),
        "dot_dot": ("./pre/best.pt", "link/../pre"),
        "symlink_out_dir": ("pre/best.pt", "link"),  # link -> pre
        "symlink_init_ckpt": ("link/best.pt", "pre"),
        "symlinked_file": ("alias/best.pt", "pre"),  # alias/best.pt -> pre/best.pt
        "symlinked_file_folder": ("alias/best.pt", "alias"),
    }[spelling]
    args = char_pretrained["args"] + [
        "--init_from=finetune",
        f"--init_ckpt={init_ckpt}",
        f"--out_dir={out_dir}",
        "--max_iters=1",
        "--eval_interval=1",
        "--learning_rate=0.0",
    ]
    err = _one_line_exit_2(capsys, train.main, args)
    assert "would overwrite" in err
    assert {f: (tmp_path / "pre" / f).read_bytes() for f in os.listdir(tmp_path / "pre")} == before


def test_learned_embeddings_fine_tune_only_at_their_block_size(char_pretrained, tmp_path, capsys):
    """A learned run has one position embedding per position < block_size: a new block_size must be a
    one-line exit 2, not load_state_dict's traceback; at its own block_size the fine-tune runs."""
    args = [a for a in char_pretrained["args"] if not a.startswith("--pos_encoding")] + ["--pos_encoding=learned"]
    pre = str(tmp_path / "pre")
    train.main(args + ["--max_iters=2", "--eval_interval=2", "--learning_rate=1e-2", f"--out_dir={pre}"])
    ft = args + ["--init_from=finetune", f"--init_ckpt={pre}/best.pt", "--max_iters=0", f"--out_dir={tmp_path / 'ft'}"]
    err = _one_line_exit_2(capsys, train.main, ft + ["--block_size=32"])
    assert "block_size=16" in err and "block_size=32" in err and "learned" in err
    m = train.main(ft)
    assert m["iter_num"] == 0 and os.path.exists(tmp_path / "ft" / "best.pt")


def test_finetune_may_change_dropout(char_pretrained, tmp_path):
    """dropout is free in a fine-tune (README: block_size, rope_scaling, rope_original_block_size, dropout):
    the run starts, and its checkpoint keeps the fine-tune's dropout with the pretraining's shapes."""
    ft = str(tmp_path / "ft")
    m = _finetune(char_pretrained, "--dropout=0.1", "--max_iters=0", f"--out_dir={ft}")
    best = torch.load(os.path.join(ft, "best.pt"), weights_only=True)
    assert m["iter_num"] == 0 and best["model_args"]["dropout"] == 0.1 and best["model_args"]["n_embd"] == 32


# --- DroPE: the one change of encoding a fine-tune may make (rope -> none) ------------------------


def test_drope_finetune_drops_rope_keeps_every_weight_and_changes_the_logits(char_pretrained, tmp_path):
    from checkpoint import load_run

    ft = str(tmp_path / "drope")
    # lr 0: AdamW leaves the weights as loaded, so the fine-tune's checkpoint holds the RoPE run's weights
    _finetune(
        char_pretrained,
        "--pos_encoding=none",
        "--max_iters=1",
        "--eval_interval=1",
        "--learning_rate=0.0",
        "--min_lr=0.0",
        f"--out_dir={ft}",
    )
    rope, _ = load_run(char_pretrained["run"])
    nope, state = load_run(ft, "ckpt.pt")
    assert state["model_args"]["pos_encoding"] == "none" and state["iter_num"] == 1
    pre = torch.load(os.path.join(char_pretrained["run"], "best.pt"), weights_only=True)["model"]
    assert pre.keys() == state["model"].keys() and all(torch.equal(pre[k], state["model"][k]) for k in pre)
    x = torch.arange(16).remainder(15).unsqueeze(0)
    assert not torch.allclose(rope(x)[0], nope(x)[0], atol=1e-3)  # the same weights, no rotation: other logits


def _variant(char_pretrained, tmp_path, **model_args):
    """A copy of the pretrained RoPE run's best.pt with some model_args changed (same weights)."""
    state = torch.load(os.path.join(char_pretrained["run"], "best.pt"), weights_only=True)
    state["model_args"].update(model_args)
    os.makedirs(tmp_path / "variant", exist_ok=True)
    torch.save(state, tmp_path / "variant" / "best.pt")
    return str(tmp_path / "variant" / "best.pt")


@pytest.mark.parametrize(
    "start,asks,message",
    [
        ({}, "pope", "changes the encoding only from 'rope' to 'none' (DroPE)"),
        ({}, "rope_half", "has pos_encoding='rope' and this run asks for 'rope_half'"),
        ({"pos_encoding": "rope_half"}, "none", "has pos_encoding='rope_half' and this run asks for 'none'"),
        ({"pos_encoding": "none"}, "rope", "has pos_encoding='none' and this run asks for 'rope'"),
        ({"rope_scaling": 2.0, "rope_original_block_size": 8}, "none", "is a YaRN fine-tune"),
    ],
)
def test_finetune_refuses_every_other_change_of_encoding_with_one_line(
    char_pretrained, tmp_path, capsys, start, asks, message
):
    ckpt = _variant(char_pretrained, tmp_path, **start) if start else f"{char_pretrained['run']}/best.pt"
    err = _one_line_exit_2(
        capsys,
        train.main,
        char_pretrained["args"]
        + [
            "--init_from=finetune",
            f"--init_ckpt={ckpt}",
            f"--pos_encoding={asks}",
            "--max_iters=1",
            f"--out_dir={tmp_path / 'ft'}",
        ],
    )
    assert message in err, err
    assert not os.path.exists(tmp_path / "ft" / "best.pt")


@pytest.mark.parametrize("size", ["", "_253m", "_774m"])
def test_drope_configs_are_the_rope_run_without_rope_at_its_context(size):
    from configurator import configure

    ft = configure(train.DEFAULTS, [os.path.join(REPO, f"config/finetune_owt{size}_drope.py")])
    pre = configure(train.DEFAULTS, [os.path.join(REPO, f"config/train_owt{size}_rope.py")])
    assert ft["init_from"] == "finetune" and os.path.dirname(ft["init_ckpt"]) == pre["out_dir"] != ft["out_dir"]
    arch = ("n_layer", "n_head", "n_embd", "bias", "dataset", "block_size", "dropout")
    assert {k: ft[k] for k in arch} == {k: pre[k] for k in arch}
    assert (pre["pos_encoding"], ft["pos_encoding"], ft["rope_scaling"]) == ("rope", "none", 1.0)
    tokens = lambda c: c["max_iters"] * c["batch_size"] * c["gradient_accumulation_steps"] * c["block_size"]  # noqa: E731
    assert tokens(ft) == 0.02 * tokens(pre) == 500 * 64 * 4096  # 2 % of pretraining, the YaRN fine-tune's tokens
    assert ft["batch_size"] * ft["gradient_accumulation_steps"] == 64 and ft["lr_decay_iters"] == ft["max_iters"]


def test_cpu_drope_config_recalibrates_the_quick_start_rope_run():
    from configurator import configure

    ft = configure(train.DEFAULTS, [os.path.join(REPO, "config/finetune_shakespeare_char_drope.py")])
    rope = configure(train.DEFAULTS, ["--pos_encoding=rope", "--out_dir=out-shakespeare-char-rope"])
    assert ft["init_ckpt"] == os.path.join(rope["out_dir"], "best.pt") and ft["pos_encoding"] == "none"
    arch = ("n_layer", "n_head", "n_embd", "bias", "dataset", "block_size", "batch_size", "gradient_accumulation_steps")
    assert {k: ft[k] for k in arch} == {k: rope[k] for k in arch}
    assert ft["max_iters"] == 0.02 * rope["max_iters"]


def test_cpu_yarn_config_fine_tunes_the_quick_start_rope_run_at_4x_with_2_percent_of_its_tokens():
    from configurator import configure

    ft = configure(train.DEFAULTS, [os.path.join(REPO, "config/finetune_shakespeare_char_yarn.py")])
    rope = configure(train.DEFAULTS, ["--pos_encoding=rope", "--out_dir=out-shakespeare-char-rope"])
    assert (
        ft["init_from"] == "finetune" and ft["init_ckpt"] == os.path.join(rope["out_dir"], "best.pt") != ft["out_dir"]
    )
    arch = (
        "n_layer",
        "n_head",
        "n_embd",
        "bias",
        "dataset",
        "pos_encoding",
        "rope_theta",
        "batch_size",
        "gradient_accumulation_steps",
        "weight_decay",
        "beta1",
        "beta2",
        "grad_clip",
    )
    assert {k: ft[k] for k in arch} == {k: rope[k] for k in arch}
    assert (ft["rope_scaling"], ft["rope_original_block_size"], ft["block_size"]) == (
        4.0,
        rope["block_size"],
        4 * rope["block_size"],
    )
    tokens = lambda c: c["max_iters"] * c["batch_size"] * c["gradient_accumulation_steps"] * c["block_size"]  # noqa: E731
    assert tokens(ft) == 0.02 * tokens(rope)  # the OWT YaRN fine-tune's share: 131M of 6.55B
    assert ft["learning_rate"] == ft["min_lr"] == rope["learning_rate"] / 10 and ft["lr_decay_iters"] == ft["max_iters"]


def test_cpu_pope_ft_config_is_the_yarn_recipe_with_pope_from_the_quick_start_pope_run():
    """PoPE+ft (issue 74): the same characters and optimizer as the YaRN fine-tune; only the parent and encoding
    differ, and PoPE's frequencies are left as they are (no rope_scaling)."""
    from configurator import configure

    ft = configure(train.DEFAULTS, [os.path.join(REPO, "config/finetune_shakespeare_char_pope.py")])
    yarn = configure(train.DEFAULTS, [os.path.join(REPO, "config/finetune_shakespeare_char_yarn.py")])
    pope = configure(train.DEFAULTS, [])  # the quick start: python train.py
    assert ft["init_from"] == "finetune" and ft["init_ckpt"] == os.path.join(pope["out_dir"], "best.pt")
    assert ft["out_dir"] != pope["out_dir"] and ft["pos_encoding"] == pope["pos_encoding"] == "pope"
    assert ft["rope_scaling"] == pope["rope_scaling"] and ft["rope_theta"] == pope["rope_theta"]
    for k in ("pope_magnitude", "pope_use_delta", "n_layer", "n_head", "n_embd", "bias", "dataset"):
        assert ft[k] == pope[k], k
    differ = {"out_dir", "init_ckpt", "pos_encoding", "rope_scaling", "rope_original_block_size", "rope_yarn_ramp"}
    assert {k: v for k, v in ft.items() if k not in differ} == {k: v for k, v in yarn.items() if k not in differ}


def test_cpu_pope_ft_config_fine_tunes_a_pope_run_at_a_longer_context(char_pretrained, tmp_path):
    """The config runs as written (two steps) from a PoPE parent of the quick start's shape: the parent's weights
    load, the context grows (16 -> 64 here, 256 -> 1024 in the config) and the encoding stays PoPE."""
    data = [f"--data_root={char_pretrained['data_root']}", "--dataset=chars", "--eval_iters=1", "--batch_size=1"]
    pre = str(tmp_path / "pre")
    train.main([*data, "--max_iters=2", "--block_size=16", f"--out_dir={pre}"])
    cfg = os.path.join(REPO, "config/finetune_shakespeare_char_pope.py")
    ft = [cfg, *data, f"--init_ckpt={pre}/best.pt", f"--out_dir={tmp_path / 'ft'}", "--max_iters=2", "--block_size=64"]
    m = train.main(ft)
    assert (m["pos_encoding"], m["iter_num"], m["config"]["init_from"], m["config"]["block_size"]) == (
        "pope",
        2,
        "finetune",
        64,
    )
