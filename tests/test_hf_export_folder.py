"""hf/export.py's OUT_DIR: what --force may replace, the current folder, what is left beside the folder, the files'
modes and fsyncs, the names it compares, the model card's pairing of losses and checkpoints, the character
tokenizer's pad token, and the one-line refusals of a checkpoint it cannot read. The command's main() in this process
(exit code and stderr), CPU, no network."""

import json
import os
import stat

import pytest
import torch

pytest.importorskip("transformers")

from test_hf_export import CHAR_TOKENIZER, ITOS, built_model, refused, save_run  # noqa: E402

from hf import export as hf_export  # noqa: E402


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A character-level PoPE run folder (best.pt, ckpt.pt, metrics.json), shared read-only by the module."""
    metrics = {s: {"loss": v, "ppl": 2.0, "acc": 0.5, "targets": 100} for s, v in (("val", 1.2345), ("test", 1.3456))}
    return save_run(tmp_path_factory.mktemp("run") / "run", built_model(len(ITOS)), CHAR_TOKENIZER, metrics=metrics)


def snapshot(folder):
    """{relative path: bytes} of every file under folder, and its sorted sub-folders."""
    files, dirs = {}, []
    for root, ds, fs in os.walk(folder):
        dirs += [os.path.relpath(os.path.join(root, d), folder) for d in ds]
        for f in fs:
            with open(os.path.join(root, f), "rb") as h:
                files[os.path.relpath(os.path.join(root, f), folder)] = h.read()
    return files, sorted(dirs)


# --- what --force replaces -------------------------------------------------------------------------------------------


def test_force_replaces_an_earlier_export_and_refuses_any_other_folder(run, tmp_path, capsys):
    """--force replaces a folder whose config.json has this export's auto_map, or one that holds only files an export
    writes; another run folder, another model's folder, a folder with a sub-folder or a file of its own are refused
    in one line, exit 2, every byte untouched. Nothing is left beside OUT_DIR (no .NAME.tmp-*, .NAME.old-*)."""
    other = save_run(tmp_path / "other-run", built_model(len(ITOS), seed=1, pos_encoding="rope"), CHAR_TOKENIZER)
    with open(os.path.join(other, "log.jsonl"), "w") as f:
        f.write('{"iter": 0}\n')
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (llama / "model.safetensors").write_bytes(b"weights")
    mixed = tmp_path / "mixed"
    hf_export.export(run, str(mixed))
    (mixed / "notes.txt").write_text("mine")  # an export with a file of the user's: auto_map says it is an export
    nested = tmp_path / "nested"
    (nested / "sub").mkdir(parents=True)
    (nested / "README.md").write_text("mine")
    for folder in (other, llama, nested):
        before = snapshot(folder)
        assert "--force replaces only" in refused([run, str(folder), "--force"], capsys)
        assert snapshot(folder) == before
    earlier = tmp_path / "earlier"
    hf_export.export(run, str(earlier))
    bare = tmp_path / "bare"  # only files an export writes, no config.json (a copy that lost it)
    bare.mkdir()
    (bare / "model.safetensors").write_bytes(b"old weights")
    (bare / "README.md").write_text("old card")
    for folder in (earlier, bare, mixed):
        hf_export.main([run, str(folder), "--force", "--ckpt=ckpt"])
        files, dirs = snapshot(folder)
        assert dirs == [] and "notes.txt" not in files and b"from `ckpt.pt`" in files["README.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare", "earlier", "llama", "mixed", "nested", "other-run"]


@pytest.mark.parametrize("how", ["dot", "absolute", "inside"])
def test_out_dir_that_is_or_holds_the_current_folder_is_refused_without_debris(how, run, tmp_path, capsys, monkeypatch):
    """OUT_DIR `.`, the current folder by its absolute path, or a folder that holds the current one: refused in one
    line, exit 2, with --force; the folder and its parent as they were."""
    out = tmp_path / "exports" / "hf"
    hf_export.export(run, str(out))
    if how == "inside":
        (out / "sub").mkdir()  # the current folder
    before, parent = snapshot(out), sorted(os.listdir(out.parent))
    monkeypatch.chdir(out / "sub" if how == "inside" else out)
    argv = {"dot": ".", "absolute": str(out), "inside": ".."}[how]
    err = refused([run, argv, "--force"], capsys)
    assert "current folder" in err
    assert snapshot(out) == before and sorted(os.listdir(out.parent)) == parent


def test_an_empty_current_folder_is_refused_without_debris(run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "empty"
    out.mkdir()
    monkeypatch.chdir(out)
    assert "current folder" in refused([run, "."], capsys)
    assert os.listdir(out) == [] and sorted(os.listdir(tmp_path)) == ["empty"]


def test_an_out_dir_whose_name_extends_the_runs_name_is_not_taken_for_its_parent(tmp_path):
    """Run out-x-pope, OUT_DIR out-x: a name prefix, not a folder that holds the run; out-x/.. does hold it."""
    run = save_run(tmp_path / "out-x-pope", built_model(len(ITOS)), CHAR_TOKENIZER)
    out = hf_export.export(run, str(tmp_path / "out-x"))
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    with pytest.raises(hf_export.UserError, match="holds it"):
        hf_export.export(run, str(tmp_path / "out-x" / ".."), force=True)


def test_a_failed_rename_puts_the_earlier_export_back_and_leaves_nothing_beside_it(run, tmp_path, monkeypatch):
    """--force moves the earlier export aside, then renames the new folder into place: if that rename fails, the
    earlier export is back under its name, byte for byte, and neither the new folder nor the aside folder stays."""
    out = tmp_path / "hf"
    hf_export.export(run, str(out))
    before = snapshot(out)
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(src).startswith(".hf.tmp-"):
            raise OSError(28, "No space left on device")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="No space"):
        hf_export.export(run, str(out), ckpt="ckpt", force=True)
    assert snapshot(out) == before and os.listdir(tmp_path) == ["hf"]


# --- what reaches the disk, with which modes -------------------------------------------------------------------------


def test_every_file_is_fsynced_before_the_rename_and_the_folders_after(run, tmp_path, monkeypatch):
    """A power cut after the export leaves the old OUT_DIR or a whole new one, never a folder of empty files: every
    file's data and the new folder reach the disk before the rename that publishes it, the parent after it. fsync and
    rename are recorded in order; each fsync by the inode it flushed."""
    events, real_fsync, real_rename = [], os.fsync, os.rename

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", st.st_ino))
        return real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", os.stat(src).st_ino, os.path.abspath(dst)))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    out = os.path.abspath(hf_export.export(run, str(tmp_path / "hf")))
    published = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == out]
    assert len(published) == 1
    flushed_before = {e[1] for e in events[: published[0]] if e[0] == "fsync"}
    files = {os.stat(os.path.join(out, f)).st_ino for f in os.listdir(out)}
    assert len(files) >= 7 and files <= flushed_before
    assert os.stat(out).st_ino in flushed_before  # the folder's entries
    assert ("fsync", os.stat(tmp_path).st_ino) in events[published[0] :]  # the rename itself


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_the_folder_and_its_files_get_the_modes_of_the_umask(umask, run, tmp_path):
    """OUT_DIR 0777 and its files 0666, minus the umask, as mkdir and open() give: another account (a shared model
    store, a serving user) reads the export where the umask lets it; mkdtemp's 0700 / mkstemp's 0600 never stay."""
    old = os.umask(umask)
    try:
        out = hf_export.export(run, str(tmp_path / "hf"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o777 & ~umask
    for name in os.listdir(out):
        assert stat.S_IMODE(os.stat(os.path.join(out, name)).st_mode) == 0o666 & ~umask, name


# --- the card, the tokenizer -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("ckpt", ["best", "ckpt"])
def test_the_model_card_pairs_the_losses_with_the_checkpoint_they_are_of(ckpt, run, tmp_path):
    """metrics.json holds best.pt's losses: "these weights" for an export of best.pt only."""
    out = hf_export.export(run, str(tmp_path / "hf"), ckpt=ckpt)
    with open(os.path.join(out, "README.md")) as f:
        lines = [s for s in f.read().splitlines() if s.startswith(("- val: 1.2345", "- test: 1.3456"))]
    assert len(lines) == 2
    for line in lines:
        if ckpt == "best":
            assert line.endswith("full split, these weights"), line
        else:
            assert line.endswith("full split, best.pt (not these weights: ckpt.pt was exported)"), line


@pytest.mark.parametrize("pad_id", [0, 3, 6])
def test_a_character_vocabularys_pad_id_is_the_tokenizers_pad_token_wherever_it_is(pad_id, tmp_path):
    """pad_id 0 (the first symbol) as any other: the tokenizer's pad token, config.json's pad_token_id, the same id."""
    from transformers import AutoTokenizer

    itos = list("ab\n ,.")
    itos.insert(pad_id, "<pad>")
    meta = {"dataset": "ii", "vocab_size": len(itos), "pad_id": pad_id, "tokenizer": {"kind": "char", "itos": itos}}
    run = save_run(tmp_path / "run", built_model(len(itos)), meta)
    out = hf_export.export(run, str(tmp_path / f"hf-{tmp_path.name}"))
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["pad_token_id"] == pad_id
    assert tok.pad_token == "<pad>" and tok.pad_token_id == pad_id
    assert tok("a<pad>b")["input_ids"] == [itos.index("a"), pad_id, itos.index("b")]


# --- checkpoints the export cannot read ------------------------------------------------------------------------------


def test_a_corrupt_or_misfit_checkpoint_is_refused_in_one_line_naming_the_file(run, tmp_path, capsys):
    """Not a torch file, a truncated one, a pickle of other objects: one line naming the file, never a suggestion of
    weights_only=False. model_args that do not fit the weights: one line naming the file and a tensor that differs."""
    state = torch.load(os.path.join(run, "best.pt"), weights_only=True)
    with open(os.path.join(run, "best.pt"), "rb") as f:
        whole = f.read()
    cases = {
        "text": b"not a checkpoint at all\n",
        "truncated": whole[: len(whole) // 2],
    }
    for name, data in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "best.pt").write_bytes(data)
    (tmp_path / "pickle").mkdir()
    torch.save({"model": {}, "model_args": {}, "opt": torch.optim.SGD}, tmp_path / "pickle" / "best.pt")
    for name in (*cases, "pickle"):
        err = refused([str(tmp_path / name), str(tmp_path / "o")], capsys)
        assert str(tmp_path / name / "best.pt") in err and "weights_only" not in err, err
    misfit = tmp_path / "misfit"
    misfit.mkdir()
    state["model_args"]["n_embd"] = 32
    torch.save(state, misfit / "best.pt")
    err = refused([str(misfit), str(tmp_path / "o")], capsys)
    assert str(misfit / "best.pt") in err and "transformer.wte.weight" in err and f"({len(ITOS)}, 64)" in err, err
    assert not os.path.exists(tmp_path / "o")
