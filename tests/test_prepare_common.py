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


def _stream_meta(folder, n=10):
    """Three stream splits of n tokens 0..n-1 in `folder`; returns their meta (not yet written)."""
    import numpy as np

    for split in ("train", "val", "test"):
        with common.BinWriter(os.path.join(folder, f"{split}.bin"), np.uint8) as w:
            w.write(np.arange(n))
    return {
        "dataset": "toy",
        "vocab_size": n,
        "dtype": "uint8",
        "layout": "stream",
        "splits": {s: {"file": f"{s}.bin", "shape": [n], "tokens": n} for s in ("train", "val", "test")},
        "pad_id": None,
        "loss": "all",
        "tokenizer": {"kind": "none"},
    }


def test_document_offsets_drop_empty_documents_and_the_dataset_serves_no_empty_one(tmp_path):
    """Hand-worked: lengths [3, 0, 2, 0, 5] (a script that meets an empty work or line) -> offsets [0, 3, 5, 10]:
    three documents, not five with two empty. Written and read back (data.Dataset), the ten tokens' ids are
    0 0 0 1 1 2 2 2 2 2."""
    from data import Dataset

    off = common.document_offsets([3, 0, 2, 0, 5])
    assert off.tolist() == [0, 3, 5, 10] and off.dtype.name == "int64"
    assert common.document_offsets([0, 4, 0]).tolist() == [0, 4]
    meta = _stream_meta(str(tmp_path))
    meta["documents"] = common.write_documents(str(tmp_path), dict.fromkeys(("train", "val", "test"), off))
    assert meta["documents"]["train"]["n_docs"] == 3
    common.write_meta(str(tmp_path), meta)
    ds = Dataset(str(tmp_path), batch_size=1, block_size=9, documents=True)
    x, _, ids = next(ds.full_split_batches("val"))
    assert x.tolist() == [list(range(9))] and ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    assert ds.offsets("train").tolist() == [0, 3, 5, 10]


@pytest.mark.parametrize(
    "offsets",
    [[0, 3, 3, 10], [0, 3, 10, 10], [1, 3, 10], [0, 5, 3, 10], [[0, 10]], [0]],
    ids=["repeated", "repeated_last", "not_from_0", "falling", "two_d", "one_offset_for_a_nonempty_split"],
)
def test_offsets_that_repeat_fall_or_miss_0_are_refused_in_one_line_and_write_nothing(tmp_path, offsets):
    """write_documents refuses offsets that do not start at 0 and rise strictly (a repeated offset is an empty
    document) with one ValueError line, before any .docs.bin is written. A single offset [0] is an empty split:
    nothing is recorded for it (write_meta refuses the empty split itself, naming the fix)."""
    import numpy as np

    if offsets == [0]:
        assert common.write_documents(str(tmp_path), {"train": np.array(offsets)}) == {}
        assert not os.path.exists(tmp_path / "train.docs.bin")
        return
    with pytest.raises(ValueError, match="must start at 0 and rise strictly") as e:
        common.write_documents(str(tmp_path), {"train": np.array(offsets)})
    assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "train.docs.bin")


@pytest.mark.parametrize("last", [9, 11, 10])
def test_offsets_must_end_at_the_splits_length(tmp_path, last):
    """A split of ten tokens: offsets ending at 9 (its last token in no document) or 11 (past its end) are refused
    by write_meta in one ValueError line that gives both numbers, and no meta.json is written (the folder is not a
    complete dataset); ending at exactly 10 is written."""
    meta = _stream_meta(str(tmp_path))
    off = {"train": [0, 4, 10], "val": [0, 4, last], "test": [0, 10]}
    meta["documents"] = common.write_documents(str(tmp_path), off)
    if last == 10:
        common.write_meta(str(tmp_path), meta)
        assert common.is_complete(str(tmp_path))
        return
    with pytest.raises(ValueError, match=f"documents of split 'val' end at {last}, the split has 10") as e:
        common.write_meta(str(tmp_path), meta)
    assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "meta.json")
