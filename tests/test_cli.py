"""cli.py: the one-line exit 2 and the atomic file writes every script uses."""

import json
import os

import pytest

from cli import UserError, atomic_open, atomic_write, atomic_write_json, exit_on_user_error


def test_user_error_exits_2_with_one_line_and_other_errors_keep_their_traceback(capsys):
    @exit_on_user_error
    def main(kind):
        if kind == "user":
            raise UserError("no checkpoint at x/best.pt; train first")
        if kind == "details":
            raise UserError("unknown config key 'q'", details="valid keys:\n  a = 1")
        if kind == "bug":
            raise KeyError("a bug")
        return 7

    assert main("ok") == 7
    with pytest.raises(SystemExit) as e:
        main("user")
    assert e.value.code == 2 and capsys.readouterr().err == "error: no checkpoint at x/best.pt; train first\n"
    with pytest.raises(SystemExit) as e:
        main("details")
    assert e.value.code == 2 and capsys.readouterr().err == "error: unknown config key 'q'\nvalid keys:\n  a = 1\n"
    with pytest.raises(KeyError):
        main("bug")


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = str(tmp_path / "sub" / "metrics.json")  # the folder is created
    atomic_write_json(path, {"loss": 1.5, "iter": [1, 2]})
    with open(path) as f:
        assert json.load(f) == {"loss": 1.5, "iter": [1, 2]}
    atomic_write(path, "é\n")  # str is written as UTF-8
    assert open(path, "rb").read() == "é\n".encode()
    atomic_write(path, b"\x00\x01")
    assert open(path, "rb").read() == b"\x00\x01"
    assert os.listdir(tmp_path / "sub") == ["metrics.json"]
    plain = tmp_path / "plain"
    plain.write_bytes(b"")  # the mode open() gives under this umask
    assert os.stat(path).st_mode & 0o777 == os.stat(plain).st_mode & 0o777


def test_a_crash_while_writing_keeps_the_old_file(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    atomic_write(path, b"old checkpoint")
    with pytest.raises(RuntimeError, match="crash"):
        with atomic_open(path) as f:
            f.write(b"half of a new one")
            raise RuntimeError("crash")
    assert open(path, "rb").read() == b"old checkpoint"
    assert os.listdir(tmp_path) == ["ckpt.pt"]
