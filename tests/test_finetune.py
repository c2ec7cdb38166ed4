"""train.py init_from='finetune' (weights of a checkpoint, new block_size / YaRN, fresh optimizer), and the
fine-tune and appendix-baseline configs checked against the configs they derive from."""

import os

import pytest
import torch

import train
from test_train import REPO, TINY, run, toy_stream  # noqa: F401 (toy_stream is a fixture)


def test_finetune_loads_weights_new_block_size_and_yarn_with_a_fresh_optimizer(toy_stream, tmp_path, capsys):
    pre, ft = str(tmp_path / "pre"), str(tmp_path / "ft")
    common = TINY + [f"--data_root={toy_stream}", "--dataset=toy", "--pos_encoding=rope", "--batch_size=32"]
    run(common + ["--block_size=32", "--max_iters=4", "--eval_interval=4", f"--out_dir={pre}"])
    # lr 0: AdamW leaves the weights as loaded, so the fine-tune's checkpoint must hold the pretrained ones
    run(common + ["--init_from=finetune", f"--init_ckpt={pre}/best.pt", "--block_size=64", "--rope_scaling=2.0",
                  "--max_iters=1", "--eval_interval=1", "--learning_rate=0.0", f"--out_dir={ft}"])
    a = torch.load(os.path.join(pre, "best.pt"), weights_only=True)
    b = torch.load(os.path.join(ft, "ckpt.pt"), weights_only=True)
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert b["iter_num"] == 1 and {s["step"].item() for s in b["optimizer"]["state"].values()} == {1.0}  # fresh
    assert (b["model_args"]["block_size"], b["model_args"]["rope_scaling"], b["model_args"]["rope_original_block_size"]) == (64, 2.0, 32)
    for bad, message in [("--pos_encoding=pope", "pos_encoding='rope'"), ("--n_embd=48", "n_embd=32"),
                         (f"--out_dir={pre}", "would overwrite")]:
        with pytest.raises(SystemExit) as e:
            run(common + ["--init_from=finetune", f"--init_ckpt={pre}/best.pt", f"--out_dir={ft}2", bad])
        assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("size", ["", "_253m", "_774m"])
@pytest.mark.parametrize("kind,enc", [("yarn", "rope"), ("pope", "pope")])
def test_finetune_configs_keep_the_pretraining_architecture(size, kind, enc):
    """What train.py's fine-tune check would refuse on a GPU after hours of pretraining, caught here."""
    from configurator import configure
    ft = configure(train.DEFAULTS, [os.path.join(REPO, f"config/finetune_owt{size}_{kind}_4096.py")])
    pre = configure(train.DEFAULTS, [os.path.join(REPO, f"config/train_owt{size}_{enc}.py")])
    assert ft["init_from"] == "finetune" and os.path.dirname(ft["init_ckpt"]) == pre["out_dir"] != ft["out_dir"]
    arch = ("n_layer", "n_head", "n_embd", "bias", "pos_encoding", "rope_theta", "pope_magnitude", "pope_use_delta", "dataset")
    assert {k: ft[k] for k in arch} == {k: pre[k] for k in arch}
    assert (ft["block_size"], ft["max_iters"], ft["warmup_iters"], ft["learning_rate"], ft["min_lr"]) == (4096, 500, 20, 6e-5, 6e-5)
    assert ft["batch_size"] * ft["gradient_accumulation_steps"] == 64
    assert (ft["rope_scaling"], ft["rope_original_block_size"]) == ((4.0, 1024) if kind == "yarn" else (1.0, 0))


@pytest.mark.parametrize("enc", ["rope_half", "alibi_half", "learned", "sinusoidal"])
def test_indirect_baseline_configs_differ_from_rope_only_in_the_encoding(enc):
    from configurator import configure
    cfg = configure(train.DEFAULTS, [os.path.join(REPO, f"config/train_indirect_{enc}.py")])
    rope = configure(train.DEFAULTS, [os.path.join(REPO, "config/train_indirect_rope.py")])
    assert cfg["pos_encoding"] == enc
    assert {k: v for k, v in cfg.items() if cfg[k] != rope[k]}.keys() == {"pos_encoding", "out_dir"}
