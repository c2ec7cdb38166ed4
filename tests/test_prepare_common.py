"""prepare/common.py: what the prepare scripts share (their command line, the download); the format
and its writers are tested through the scripts (test_data, test_empty_splits, test_prepare_*)."""

import inspect
import os
import runpy
import sys

import pytest

from prepare import common

SCRIPTS = ("genome", "indirect_indexing", "jsb", "maestro", "openwebtext", "pg19", "shakespeare")


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_command_line_is_its_prepare_signature(name, monkeypatch):
    """run_cli calls prepare(**the parsed flags): every flag must be a parameter of the script's
    prepare(), with the same default, or the command breaks (or disagrees with the function) only
    when run."""
    seen = {}

    def capture(prepare, parser):
        seen["args"], seen["params"] = vars(parser.parse_args([])), inspect.signature(prepare).parameters

    monkeypatch.setattr(common, "run_cli", capture)
    monkeypatch.setattr(sys, "argv", [name])
    runpy.run_path(os.path.join(os.path.dirname(common.__file__), f"{name}.py"), run_name="__main__")
    args, params = seen["args"], seen["params"]
    assert set(args) <= set(params), set(args) - set(params)
    assert args == {k: params[k].default for k in args}
    assert "out_dir" in args


def test_download_writes_atomically_and_names_the_way_around_a_failure(tmp_path, monkeypatch):
    """prepare.common.download (genome, MAESTRO, JSB): a file:// URL lands at the path (folders made);
    a file already there is used without the network; a failure, before or during the transfer,
    names the URL and what to do instead, and leaves no file."""
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 8000)  # 2 MB: more than one copy buffer
    dest = str(tmp_path / "raw" / "x.bin")
    assert common.download(src.as_uri(), dest, "pass --input PATH") == dest
    assert open(dest, "rb").read() == src.read_bytes()
    src.unlink()
    assert common.download(src.as_uri(), dest, "pass --input PATH") == dest  # there already: no fetch
    bad = str(tmp_path / "raw" / "y.bin")
    with pytest.raises(RuntimeError, match=r"could not download file://\S+src.bin \(.*\); pass --input PATH"):
        common.download(src.as_uri(), bad, "pass --input PATH")

    def reset_midway(r, f, length):
        f.write(r.read(1000))
        raise ConnectionResetError("connection reset")

    src.write_bytes(b"x" * 5000)
    monkeypatch.setattr(common.shutil, "copyfileobj", reset_midway)
    with pytest.raises(RuntimeError, match="connection reset"):
        common.download(src.as_uri(), bad, "pass --input PATH")
    assert sorted(os.listdir(tmp_path / "raw")) == ["x.bin"]


@pytest.mark.parametrize("ids", [[0, 65536], [-1, 5]])
def test_token_ids_outside_the_dtype_are_refused_and_leave_no_file(tmp_path, ids):
    """BinWriter (every prepare script's splits): an id that uint16 cannot hold, too large or negative,
    raises instead of wrapping around to another token, and the split file is not written."""
    import numpy as np

    with pytest.raises(ValueError, match=r"outside uint16 range \[0, 65535\]"):
        with common.BinWriter(str(tmp_path / "train.bin"), np.uint16) as w:
            w.write(np.array(ids, dtype=np.int64))
    assert os.listdir(tmp_path) == []


def test_smallest_dtype_is_the_narrowest_that_holds_every_id():
    """Ids run 0 .. vocab_size - 1: 256 ids fit uint8, 65,536 fit uint16 (a wider dtype doubles the files)."""
    got = [common.smallest_dtype(n) for n in (2, 256, 257, 65536, 65537)]
    assert got == ["uint8", "uint8", "uint16", "uint16", "int32"]


def test_a_folder_whose_meta_json_lacks_a_split_is_not_complete(tmp_path):
    """is_complete, which lets a prepare script skip its work: a meta.json without the test split (or whose
    split file is missing) is not a complete dataset, so the script writes it again."""
    import numpy as np

    for split in ("train", "val"):
        with common.BinWriter(str(tmp_path / f"{split}.bin"), np.uint8) as w:
            w.write(np.arange(4))
    common.write_meta(
        str(tmp_path),
        {
            "dataset": "toy",
            "vocab_size": 4,
            "dtype": "uint8",
            "layout": "stream",
            "splits": {s: {"file": f"{s}.bin", "shape": [4], "tokens": 4} for s in ("train", "val")},
            "pad_id": None,
            "loss": "all",
            "tokenizer": {"kind": "none"},
        },
    )
    assert common.is_complete(str(tmp_path), ("train", "val")) and not common.is_complete(str(tmp_path))
    os.remove(tmp_path / "val.bin")
    assert not common.is_complete(str(tmp_path), ("train", "val"))
