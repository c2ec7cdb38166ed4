"""train.py --init_from=hf --init_ckpt=DIR (hf/load.py): an exported folder fine-tunes as its run's best.pt does.

Reference: the same fine-tune from the run's best.pt (init_from='finetune'), which tests/test_train_finetune.py
checks; both start from the same weights with the same seed, so their logs and checkpoints are equal bit for bit.
The run: conftest's char_pretrained (a trained character-level RoPE model)."""

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")

import train  # noqa: E402
from hf import export as hf_export  # noqa: E402


def fine_tune(pre, *extra):
    return train.main(pre["args"] + ["--max_iters=3", "--eval_interval=1", "--learning_rate=3e-3", *extra])


def log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [
            {k: v for k, v in r.items() if "ms" not in k and "tok" not in k and k != "mfu"} for r in map(json.loads, f)
        ]


def test_an_exported_folder_fine_tunes_as_its_best_pt(char_pretrained, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = hf_export.export(char_pretrained["run"], str(tmp_path / "hf"))
    a, b = str(tmp_path / "from_hf"), str(tmp_path / "from_pt")
    fine_tune(char_pretrained, "--init_from=hf", f"--init_ckpt={folder}", "--block_size=32", f"--out_dir={a}")
    fine_tune(
        char_pretrained,
        "--init_from=finetune",
        f"--init_ckpt={char_pretrained['run']}/best.pt",
        "--block_size=32",
        f"--out_dir={b}",
    )
    la, lb = log(a), log(b)
    assert la == lb and len({r["val_loss"] for r in la if "val_loss" in r}) == 4  # 4 evaluations, each different
    pre = torch.load(os.path.join(char_pretrained["run"], "best.pt"), weights_only=True)
    first = next(r["val_loss"] for r in la if r.get("iter") == 0 and "val_loss" in r)
    assert first < 2.0  # step 0 evaluates the pretrained weights (a fresh model: ~2.8 nats)
    ca, cb = (torch.load(os.path.join(d, "ckpt.pt"), weights_only=True) for d in (a, b))
    assert all(torch.equal(ca["model"][k], cb["model"][k]) for k in cb["model"])
    assert not all(torch.equal(ca["model"][k], pre["model"][k]) for k in pre["model"])  # it trained
    assert ca["model_args"]["block_size"] == 32 and ca["tokenizer"]["tokenizer"] == pre["tokenizer"]["tokenizer"]


def test_init_from_hf_refusals(char_pretrained, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = hf_export.export(char_pretrained["run"], str(tmp_path / "hf"))

    def refused(*extra):
        with pytest.raises(SystemExit) as e:
            fine_tune(char_pretrained, "--init_from=hf", *extra)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1, err
        return err

    out = f"--out_dir={tmp_path / 'ft'}"
    assert "'chars_upper'" in refused(f"--init_ckpt={folder}", "--dataset=chars_upper", out)  # another tokenizer
    assert "would overwrite" in refused(f"--init_ckpt={folder}", f"--out_dir={folder}")
    assert "n_embd=32" in refused(f"--init_ckpt={folder}", "--n_embd=48", out)
    assert "cannot read" in refused(f"--init_ckpt={tmp_path / 'nothing'}", out)
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    with open(bare / "config.json") as f:
        cfg = json.load(f)
    del cfg["pope_tokenizer"]
    with open(bare / "config.json", "w") as f:
        json.dump(cfg, f)
    assert "no pope_tokenizer" in refused(f"--init_ckpt={bare}", out)
    assert not os.path.exists(tmp_path / "ft" / "ckpt.pt")


@pytest.mark.parametrize("name", ["pope_identity_nodelta", "yarn_paper", "learned"])
def test_the_folder_reads_back_as_the_runs_checkpoint(name, tmp_path, monkeypatch):
    """hf/load.py inverts the export: the run's GPTConfig fields (but the training-only ones) and weights."""
    from dataclasses import asdict

    from test_hf_export import CHAR_TOKENIZER, ENCODINGS, ITOS, built_model, save_run

    from hf.load import checkpoint_from_folder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = built_model(len(ITOS), bias=True, **ENCODINGS[name])
    run = save_run(tmp_path / "run", model, CHAR_TOKENIZER)
    state = checkpoint_from_folder(hf_export.export(run, str(tmp_path / "hf")))
    want = {k: v for k, v in asdict(model.config).items() if k not in hf_export.TRAINING_ONLY}
    assert {k: state["model_args"][k] for k in want} == want and state["tokenizer"] == CHAR_TOKENIZER
    sd = model.state_dict()
    assert state["model"].keys() == sd.keys() and all(torch.equal(state["model"][k], sd[k]) for k in sd)


def test_step_0_of_a_fine_tune_from_hf_is_a_checkpoint_of_the_exported_weights(char_pretrained, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = hf_export.export(char_pretrained["run"], str(tmp_path / "hf"))
    out = str(tmp_path / "ft")
    train.main(
        char_pretrained["args"] + ["--init_from=hf", f"--init_ckpt={folder}", "--max_iters=0", f"--out_dir={out}"]
    )
    best = torch.load(os.path.join(out, "best.pt"), weights_only=True)
    pre = torch.load(os.path.join(char_pretrained["run"], "best.pt"), weights_only=True)
    assert best["iter_num"] == 0 and best["model"].keys() == pre["model"].keys()
    assert all(torch.equal(best["model"][k], pre["model"][k]) for k in pre["model"])


@pytest.mark.parametrize(
    "edit, words",
    [
        ({"model_type": "llama"}, "'llama' model"),
        ({"model_type": None}, "None model"),
        ({"attention_bias": True}, "attention_bias != mlp_bias"),
        ({"mlp_bias": True}, "attention_bias != mlp_bias"),
        ({"rope_scaling.beta_fast": 16.0}, "beta_fast/beta_slow"),
        ({"rope_scaling.beta_slow": 2.0}, "beta_fast/beta_slow"),
        ({"rope_scaling.attention_factor": 1.0}, "attention_factor"),
    ],
    ids=["llama", "no_model_type", "attention_bias", "mlp_bias", "beta_fast", "beta_slow", "attention_factor"],
)
def test_a_folder_model_py_cannot_represent_is_refused_in_one_line(edit, words, tmp_path, monkeypatch):
    """config.json edited (or written by other code) to what model.py has no setting for: another model_type, one
    bias setting per module, YaRN betas or temperature other than model.py's 32 / 1 and 0.1 ln s + 1. hf/load.py
    (train.py --init_from=hf) refuses it in one line instead of fine-tuning model.py's settings or failing at the
    state dict; the unedited folder reads."""
    from test_hf_export import CHAR_TOKENIZER, ENCODINGS, ITOS, built_model, save_run

    from cli import UserError
    from hf.load import checkpoint_from_folder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = save_run(tmp_path / "run", built_model(len(ITOS), **ENCODINGS["yarn_code"]), CHAR_TOKENIZER)
    folder = hf_export.export(run, str(tmp_path / "hf"))
    assert checkpoint_from_folder(folder)["model_args"]["rope_scaling"] == 4.0
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    for key, value in edit.items():
        *outer, last = key.split(".")
        (cfg[outer[0]] if outer else cfg)[last] = value
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(UserError) as e:
        checkpoint_from_folder(folder)
    assert words in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)
