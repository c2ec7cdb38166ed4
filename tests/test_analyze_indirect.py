"""study/analyze_indirect.py: attention weights recomputed from captured queries and keys agree with the
model's own attention; the attention picture and the learning curves draw what they claim."""

import json
import os
from dataclasses import asdict

import numpy as np
import pytest
import torch

import analyze_indirect as ai
import train
from model import GPT, GPTConfig
from pope import pope_attention_reference
from prepare.indirect_indexing import Variant, prepare

VARIANT = Variant(n_letters=8, min_len=4, max_len=8, max_shift=3, n_queries=2)
TINY = [
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--batch_size=8",
    "--eval_iters=2",
    "--log_interval=1",
    "--warmup_iters=1",
    "--attn_backend=torch",
    "--compile=False",
    "--block_size=32",
    "--max_iters=3",
    "--eval_interval=1",
    "--learning_rate=1e-2",
]


def sharp_model(**kw):
    """A random 2-layer GPT whose queries and keys are scaled up, so its attention is far from uniform."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=4, n_embd=32, attn_backend="torch", **kw))
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(15.0)
    return model.eval()


@pytest.mark.parametrize(
    "kw",
    [
        dict(pos_encoding="pope"),
        dict(pos_encoding="pope", n_kv_head=2),
        dict(pos_encoding="pope", pope_magnitude="relu"),
        dict(pos_encoding="pope", pope_use_delta=False),
        dict(pos_encoding="rope"),
        dict(pos_encoding="rope_half"),
        dict(pos_encoding="rope", rope_scaling=2.0, rope_original_block_size=8),
        dict(pos_encoding="alibi_half"),
        dict(pos_encoding="learned"),
        dict(pos_encoding="sinusoidal"),
        dict(pos_encoding="none"),
    ],
    ids=lambda kw: "-".join(map(str, kw.values())),
)
def test_attention_weights_reproduce_the_models_attention_output(kw):
    """Rows sum to 1, later keys get exactly 0, and weights @ values equal what each layer's attention
    gave its output projection (c_proj's input) in the model's own forward pass (SDPA / pope_attention);
    for PoPE also pope_attention_reference's float64 output."""
    model = sharp_model(**kw)
    cfg = model.config
    H, d = cfg.n_head, cfg.n_embd // cfg.n_head
    H_kv = cfg.n_kv_head or H
    idx = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(1))
    w = ai.attention_weights(model, idx)
    assert w.shape == (2, H, 12, 12) and w.dtype == torch.float64
    torch.testing.assert_close(w.sum(-1), torch.ones(2, H, 12, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (w.triu(1) == 0).all()
    assert w.max() > 0.9  # sharp: a wrong position or phase would show
    torch.testing.assert_close(ai.final_token_attention(model, idx), w[:, :, -1])
    seen = {}
    hooks = [
        h
        for i, b in enumerate(model.transformer.h)
        for h in (
            b.attn.c_attn.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(("qkv", i), out[0].detach())),
            b.attn.c_proj.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(("y", i), a[0][0].detach())),
        )
    ]
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    for i, block in enumerate(model.transformer.h):
        q, k, v = seen["qkv", i].split((H * d, H_kv * d, H_kv * d), dim=-1)
        q, k, v = (t.view(12, -1, d).transpose(0, 1) for t in (q, k, v))  # (heads, T, d)
        y = w[i] @ v.double().repeat_interleave(H // H_kv, dim=0)  # (H, T, d)
        torch.testing.assert_close(y.transpose(0, 1).reshape(12, H * d).float(), seen["y", i], rtol=1e-4, atol=1e-5)
        if cfg.pos_encoding == "pope":
            ref = pope_attention_reference(
                q[None].double(),
                k[None].double(),
                v[None].double(),
                block.attn.pope_delta,
                magnitude=cfg.pope_magnitude,
            )[0]
            torch.testing.assert_close(y, ref, rtol=1e-9, atol=1e-11)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A PoPE and a RoPE run, 3 steps each, on a small variant (8 letters, 2 queries per row)."""
    root = tmp_path_factory.mktemp("ai")
    data_root = str(root / "data")
    prepare(os.path.join(data_root, VARIANT.name), n_train=300, n_val=20, n_test=20, seed=0, **asdict(VARIANT))
    runs = []
    for enc in ("pope", "rope"):
        run = str(root / enc)
        train.main(
            TINY
            + [f"--dataset={VARIANT.name}", f"--data_root={data_root}", f"--pos_encoding={enc}", f"--out_dir={run}"]
        )
        runs.append(run)
    return {"runs": runs, "data_root": data_root, "root": root}


def capture_figures(monkeypatch):
    figs = []
    real = ai._save

    def save(fig, path):
        figs.append(fig)
        real(fig, path)

    monkeypatch.setattr(ai, "_save", save)
    return figs


def test_attention_picture_on_trained_checkpoints(trained, monkeypatch, tmp_path):
    """Each panel shows the run's final-token weights (layer x head rows) over the row's characters, for the
    test split's row 3, and the weights are those of attention_weights on the row without its target."""
    from checkpoint import load_run
    from data import Dataset

    figs = capture_figures(monkeypatch)
    png = str(tmp_path / "att.png")
    path, weights = ai.plot_attention(trained["runs"], png, example=3, data_root=trained["data_root"])
    assert path == png and open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    ds = Dataset(os.path.join(trained["data_root"], VARIANT.name))
    row = [int(t) for t in ds.array("test")[3] if t != ds.pad_id]
    text = "".join(VARIANT.vocab[t] for t in row)
    axes = [ax for ax in figs[0].axes if ax.get_images()]
    assert len(axes) == 2
    for ax, run in zip(axes, trained["runs"]):
        model, _ = load_run(run)
        want = ai.final_token_attention(model, torch.tensor([row[:-1]]))
        assert weights[run].shape == (2, 2, len(row) - 1)
        np.testing.assert_array_equal(weights[run], want.numpy())
        np.testing.assert_array_equal(ax.get_images()[0].get_array(), want.reshape(4, -1).numpy())
        assert [t.get_text() for t in ax.get_xticklabels()] == list(text[:-1])
        assert os.path.basename(run) in ax.get_title()


def test_attention_command_line(trained, tmp_path, capsys):
    out = str(tmp_path / "a.png")
    assert ai.main(["attention", *trained["runs"], f"--out={out}", "--text=ABCDEFGH,C,+2,E,A,+1,B"]) == out
    assert os.path.getsize(out) > 0
    for argv, message in (
        (["attention", *trained["runs"], "--text=ABCDEFGH,C,+2,F"], "not the letter at the shift"),
        (["attention", *trained["runs"], "--text=ABCXYZ,C,+1,X"], "not in this dataset's vocabulary"),
        (["attention", *trained["runs"], "--text=ABCD,A,+1,B,C"], "is not an indirect-indexing row"),
        (["attention", *trained["runs"], "--example=20"], "--example must be in 0..19"),
        (["attention"], "give one or more run folders"),
        (["frequencies", "x"], "usage"),
    ):
        with pytest.raises(SystemExit) as e:
            ai.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1, (argv, err)


def test_attention_marks_the_source_blue_and_the_target_red(trained, tmp_path, monkeypatch):
    """The title says "source blue, target red": the last query C,+2,E of ABCDEFGH has its source C at
    position 2 (blue) and its target E at 4 (red); every other character keeps the default colour."""
    figs = capture_figures(monkeypatch)
    ai.plot_attention(trained["runs"][:1], str(tmp_path / "a.png"), text="ABCDEFGH,A,+1,B,C,+2,E")
    ax = next(ax for ax in figs[0].axes if ax.get_images())
    colors = {i: t.get_color() for i, t in enumerate(ax.get_xticklabels())}
    assert colors.pop(2) == "tab:blue" and colors.pop(4) == "tab:red"
    assert set(colors.values()) == {ax.get_xticklabels()[0].get_color()} != {"tab:blue"}
    assert "source blue, target red" in figs[0].get_suptitle()


def fake_run(folder, enc, rows, data_root, dataset="toy"):
    os.makedirs(folder)
    with open(os.path.join(folder, "log.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    with open(os.path.join(folder, "metrics.json"), "w") as f:
        json.dump({"config": {"pos_encoding": enc, "dataset": dataset, "data_root": data_root}}, f)


def test_curves_draw_every_run_coloured_by_encoding(tmp_path, monkeypatch):
    """One line per run with its logged val accuracy (%) at each evaluated step (a step logged twice by a
    resumed run: its last value), the encoding's colour, one legend entry per encoding, chance at 1/K."""
    data_root = str(tmp_path / "data")
    os.makedirs(os.path.join(data_root, "toy"))
    with open(os.path.join(data_root, "toy", "meta.json"), "w") as f:
        json.dump({"tokenizer": {"kind": "char", "itos": list("ABCDEFGH0123456789,+-") + ["<pad>"]}}, f)
    a, b, c = (str(tmp_path / n) for n in ("pope-s1", "rope-s1", "pope-s2"))
    fake_run(
        a,
        "pope",
        [
            {"iter": 0, "val_loss": 3, "val_acc": 0.1},
            {"iter": 50, "loss": 2.0},
            {"iter": 100, "val_loss": 2, "val_acc": 0.5},
            {"iter": 100, "val_loss": 2, "val_acc": 0.6},
            {"iter": 200, "val_loss": 1, "val_acc": 0.9},
        ],
        data_root,
    )
    fake_run(
        b,
        "rope",
        [{"iter": 0, "val_loss": 3, "val_acc": 0.12}, {"iter": 200, "val_loss": 3, "val_acc": 0.2}],
        data_root,
    )
    fake_run(
        c, "pope", [{"iter": 0, "val_loss": 3, "val_acc": 0.1}, {"iter": 200, "val_loss": 1, "val_acc": 0.7}], data_root
    )
    figs = capture_figures(monkeypatch)
    png = str(tmp_path / "curves.png")
    assert ai.main(["curves", a, b, c, f"--out={png}"]) == png
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    ax = figs[0].axes[0]
    lines = ax.get_lines()
    assert len(lines) == 4  # three runs and chance
    for line, steps, acc, enc in zip(
        lines, ([0, 100, 200], [0, 200], [0, 200]), ([10, 60, 90], [12, 20], [10, 70]), ("pope", "rope", "pope")
    ):
        assert list(line.get_xdata()) == steps and np.allclose(line.get_ydata(), acc)
        assert line.get_color() == ai.COLORS[enc]
    assert np.allclose(lines[3].get_ydata(), 100 / 8)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["pope (2 runs)", "rope (1 run)", "chance (1/8)"]
    with pytest.raises(ai.UserError, match="no .*log.jsonl"):
        ai.read_curve(str(tmp_path))


def test_curves_from_docs_runs_records_match_the_run_folders(tmp_path, monkeypatch):
    """A record as lane.sh keeps it (docs/runs/NAME.json with its config, NAME.log.jsonl beside it) draws
    the same line, colour and chance as the run folder it was copied from; a record without a config and
    one without its log are refused with what to give instead."""
    data_root = str(tmp_path / "data")
    os.makedirs(os.path.join(data_root, "toy"))
    with open(os.path.join(data_root, "toy", "meta.json"), "w") as f:
        json.dump({"tokenizer": {"kind": "char", "itos": list("ABCDEFGHIJ0123456789,+-")}}, f)
    rows = {
        "pope": [{"iter": 0, "val_acc": 0.1}, {"iter": 500, "val_acc": 0.4}, {"iter": 1000, "val_acc": 0.95}],
        "rope": [{"iter": 0, "val_acc": 0.1}, {"iter": 500, "val_acc": 0.3}, {"iter": 1000, "val_acc": 0.2}],
    }
    records = tmp_path / "docs_runs"
    records.mkdir()
    for enc, r in rows.items():
        fake_run(str(tmp_path / enc), enc, r, data_root)
        # the record: metrics.json plus lane.sh's "run" key; the log under the record's name
        m = json.load(open(tmp_path / enc / "metrics.json"))
        m["run"] = {"name": f"ii-{enc}", "cpu_s": 1.0}
        (records / f"ii-{enc}.json").write_text(json.dumps(m))
        (records / f"ii-{enc}.log.jsonl").write_text((tmp_path / enc / "log.jsonl").read_text())
    figs = capture_figures(monkeypatch)
    ai.main(["curves", str(tmp_path / "pope"), str(tmp_path / "rope"), f"--out={tmp_path / 'a.png'}"])
    ai.main(["curves", str(records / "ii-pope.json"), str(records / "ii-rope.json"), f"--out={tmp_path / 'b.png'}"])
    from_folders, from_records = (fig.axes[0].get_lines() for fig in figs)
    assert len(from_records) == 3  # two runs and chance (1/10)
    for a, b, enc in zip(from_folders, from_records, ("pope", "rope", None)):
        assert list(a.get_xdata()) == list(b.get_xdata()) and np.allclose(a.get_ydata(), b.get_ydata())
        assert b.get_color() == (ai.COLORS[enc] if enc else a.get_color())
    assert np.allclose(from_records[0].get_ydata(), [10, 40, 95]) and np.allclose(from_records[2].get_ydata(), 10)
    (records / "bare.json").write_text(json.dumps({"val": {}}))
    (records / "bare.log.jsonl").write_text(json.dumps({"iter": 0, "val_acc": 0.1}) + "\n")
    with pytest.raises(ai.UserError, match="has no 'config'"):
        ai.run_settings(str(records / "bare.json"))
    (records / "ii-rope.log.jsonl").unlink()
    with pytest.raises(ai.UserError, match="ii-rope.log.jsonl"):
        ai.read_curve(str(records / "ii-rope.json"))


def test_curves_over_different_alphabets_draw_no_chance_line(tmp_path, monkeypatch):
    """Runs on an 8-letter and a 10-letter variant have no common chance level: no chance line at all."""
    data_root = str(tmp_path / "data")
    for name, letters in (("toy8", "ABCDEFGH"), ("toy10", "ABCDEFGHIJ")):
        os.makedirs(os.path.join(data_root, name))
        with open(os.path.join(data_root, name, "meta.json"), "w") as f:
            json.dump({"tokenizer": {"kind": "char", "itos": list(letters + "0123456789,+-")}}, f)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    fake_run(a, "pope", [{"iter": 0, "val_acc": 0.1}, {"iter": 10, "val_acc": 0.5}], data_root, dataset="toy8")
    fake_run(b, "rope", [{"iter": 0, "val_acc": 0.1}, {"iter": 10, "val_acc": 0.3}], data_root, dataset="toy10")
    figs = capture_figures(monkeypatch)
    ai.plot_curves([a, b], str(tmp_path / "c.png"))
    ax = figs[0].axes[0]
    assert len(ax.get_lines()) == 2
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["pope (1 run)", "rope (1 run)"]
