"""DroPE's rule against rope_theta: a fine-tune that drops RoPE (pos_encoding 'rope' -> 'none') may give any
rope_theta, since no rotation is left for it to set; a fine-tune that keeps a rotary encoding must keep the
checkpoint's rope_theta, since the weights were trained at its frequencies. And the DroPE configs name the
pretraining run's rope_theta."""

import os

import pytest
import torch
from test_train import REPO
from test_train_finetune import _finetune, _one_line_exit_2, _variant

import train


def test_drope_may_give_any_rope_theta_and_it_changes_nothing(char_pretrained, tmp_path):
    """Two DroPE fine-tunes of one RoPE checkpoint at lr 0, one at the checkpoint's rope_theta (10000) and
    one at 500: both run, their checkpoints hold the RoPE run's weights unchanged, and their logits and
    val losses are identical (no rotation is left for rope_theta to set)."""
    from checkpoint import load_run

    pre = torch.load(os.path.join(char_pretrained["run"], "best.pt"), weights_only=True)
    assert pre["model_args"]["rope_theta"] == 10000.0
    logits, vals = [], []
    for theta in (10000.0, 500.0):
        ft = str(tmp_path / f"drope-{theta:g}")
        m = _finetune(
            char_pretrained,
            "--pos_encoding=none",
            f"--rope_theta={theta}",
            "--max_iters=1",
            "--eval_interval=1",
            "--learning_rate=0.0",
            "--min_lr=0.0",
            f"--out_dir={ft}",
        )
        model, state = load_run(ft, "ckpt.pt", "cpu", attn_backend="torch")
        assert state["model_args"]["pos_encoding"] == "none" and state["iter_num"] == 1
        assert all(torch.equal(pre["model"][k], state["model"][k]) for k in pre["model"])
        x = torch.arange(16).remainder(15).unsqueeze(0)
        with torch.no_grad():
            logits.append(model(x)[0])
        vals.append(m["val"]["loss"])
    assert torch.equal(logits[0], logits[1]) and vals[0] == vals[1]


@pytest.mark.parametrize("encoding", ["rope", "rope_half"])
def test_a_fine_tune_that_keeps_a_rotary_encoding_keeps_its_rope_theta(char_pretrained, tmp_path, capsys, encoding):
    """rope -> rope (and rope_half -> rope_half) at another rope_theta would rotate the trained weights at
    other frequencies: one line, exit 2, naming both values; at the checkpoint's rope_theta it runs."""
    ckpt = (
        f"{char_pretrained['run']}/best.pt"
        if encoding == "rope"
        else _variant(char_pretrained, tmp_path, pos_encoding=encoding)
    )
    args = [a for a in char_pretrained["args"] if not a.startswith("--pos_encoding=")] + [
        f"--pos_encoding={encoding}",
        "--init_from=finetune",
        f"--init_ckpt={ckpt}",
        "--max_iters=0",
    ]
    err = _one_line_exit_2(capsys, train.main, args + ["--rope_theta=500.0", f"--out_dir={tmp_path / 'ft'}"])
    assert "rope_theta=10000.0" in err and "rope_theta=500.0" in err, err
    assert not os.path.exists(tmp_path / "ft" / "best.pt")
    m = train.main(args + ["--rope_theta=10000.0", f"--out_dir={tmp_path / 'ok'}"])
    assert m["iter_num"] == 0 and m["config"]["pos_encoding"] == encoding


def test_a_fine_tune_of_a_pope_checkpoint_keeps_its_rope_theta(char_pretrained, tmp_path, capsys):
    """PoPE's frequencies are rope_theta's too: pope -> pope at another rope_theta exits 2 in one line."""
    args = [a for a in char_pretrained["args"] if not a.startswith("--pos_encoding=")] + ["--pos_encoding=pope"]
    pre = str(tmp_path / "pre")
    train.main(args + ["--max_iters=2", "--eval_interval=2", "--learning_rate=1e-2", f"--out_dir={pre}"])
    ft = args + ["--init_from=finetune", f"--init_ckpt={pre}/best.pt", "--max_iters=0"]
    err = _one_line_exit_2(capsys, train.main, ft + ["--rope_theta=500.0", f"--out_dir={tmp_path / 'ft'}"])
    assert "rope_theta=10000.0" in err and "rope_theta=500.0" in err, err


@pytest.mark.parametrize(
    "name,pretraining",
    [
        ("finetune_owt_drope.py", ["config/train_owt_rope.py"]),
        ("finetune_owt_253m_drope.py", ["config/train_owt_253m_rope.py"]),
        ("finetune_owt_774m_drope.py", ["config/train_owt_774m_rope.py"]),
        ("finetune_shakespeare_char_drope.py", ["--pos_encoding=rope", "--out_dir=out-shakespeare-char-rope"]),
    ],
)
def test_drope_configs_name_the_rope_runs_rope_theta(name, pretraining):
    """Each DroPE config's rope_theta is its RoPE pretraining run's (moot without RoPE, but what its
    comments say and what a later RoPE fine-tune of the same weights would need)."""
    from configurator import configure

    ft = configure(train.DEFAULTS, [os.path.join(REPO, "config", name)])
    pre = configure(train.DEFAULTS, [os.path.join(REPO, p) if p.endswith(".py") else p for p in pretraining])
    assert ft["pos_encoding"] == "none" and pre["pos_encoding"] == "rope"
    assert os.path.dirname(ft["init_ckpt"]) == pre["out_dir"] and ft["rope_theta"] == pre["rope_theta"]
