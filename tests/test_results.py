"""study/results.py: grouping by the settings that differ, mean ± sample sd per group (against numbers worked out
by hand), the markdown and CSV outputs, the extrapolation column, and every bad input's exit 2."""

import csv
import io
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import results

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = {
    "dataset": "shakespeare_char",
    "pos_encoding": "pope",
    "pope_magnitude": "softplus",
    "n_layer": 4,
    "learning_rate": 1e-3,
    "wandb_log": False,
    "init_from": "scratch",
    "device": "auto",
}


def metrics(config, loss, acc, wall, run=None, splits=("val", "test"), dataset=None):
    """A train.py metrics.json dict for a run with these settings and test/val numbers."""
    m = {
        "dataset": dataset or config["dataset"],
        "pos_encoding": config["pos_encoding"],
        "iter_num": 3000,
        "best_val_loss_fixed_batches": loss,
        "checkpoint": os.path.join(config["out_dir"], "best.pt"),
        "wall_time_s": wall,
        "config": config,
    }
    for s in splits:
        m[s] = {"loss": loss, "ppl": math.exp(loss), "acc": acc, "targets": 1000}
    if run is not None:
        m["run"] = run
    return m


def make_run(tmp_path, name, loss, acc, wall=600.0, seed=1337, run=None, **settings):
    """A run folder tmp_path/name whose metrics.json holds these numbers; settings override BASE."""
    folder = tmp_path / name
    folder.mkdir(parents=True)
    config = {**BASE, **settings, "seed": seed, "out_dir": str(folder), "wandb_run_name": name}
    (folder / "metrics.json").write_text(json.dumps(metrics(config, loss, acc, wall, run)))
    return str(folder)


def write_extrapolation(path, rows):
    """eval_extrapolate.py's extrapolation.csv: rows of (run, protocol, length, ppl)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("run,label,protocol,length,tokens,ppl,ppl_window_mean,last_loss\n")
        for run, protocol, length, ppl in rows:
            f.write(f"{run},pope,{protocol},{length},65536,{ppl},,1.5\n")


@pytest.fixture
def ablation(tmp_path):
    """Three PoPE seeds (test loss 1.4 / 1.5 / 1.6, acc 40 / 50 / 60 %), two RoPE seeds (1.70 / 1.80), one ReLU run."""
    runs = [
        make_run(tmp_path, f"pope-s{s}", loss, acc, wall=w, seed=s)
        for s, loss, acc, w in ((1, 1.4, 0.40, 600.0), (2, 1.5, 0.50, 660.0), (3, 1.6, 0.60, 720.0))
    ]
    runs += [
        make_run(tmp_path, f"rope-s{s}", loss, 0.45, seed=s, pos_encoding="rope") for s, loss in ((1, 1.70), (2, 1.80))
    ]
    runs.append(make_run(tmp_path, "relu-s1", 1.55, 0.5, seed=1, pope_magnitude="relu"))
    return runs


def run_main(argv, capsys):
    """results.main(argv) -> (exit code, stdout, stderr)."""
    try:
        results.main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_groups_by_the_settings_that_differ_with_mean_and_sample_sd(ablation):
    by, rows, info = results.summarize(ablation)
    # seed, out_dir and wandb_run_name differ between every run: bookkeeping, not a group
    assert by == ["pope_magnitude", "pos_encoding"]
    assert [(r["values"], r["n"], r["seeds"]) for r in rows] == [
        (("softplus", "pope"), 3, [1, 2, 3]),
        (("softplus", "rope"), 2, [1, 2]),
        (("relu", "pope"), 1, [1]),
    ]
    pope, rope, relu = rows
    # by hand: 1.4, 1.5, 1.6 -> mean 1.5, sample sd sqrt((0.1² + 0² + 0.1²) / 2) = 0.1 (population sd: 0.0816)
    assert pope["loss"] == pytest.approx((1.5, 0.1))
    assert pope["acc"] == pytest.approx((50.0, 10.0))  # in %
    ppls = [math.exp(1.4), math.exp(1.5), math.exp(1.6)]  # each run's perplexity, then their mean and sample sd
    mean = sum(ppls) / 3
    assert pope["ppl"] == pytest.approx((mean, math.sqrt(sum((p - mean) ** 2 for p in ppls) / 2)))
    assert pope["wall_s"] == pytest.approx((660.0, 60.0))  # 600, 660, 720 s
    # 1.70, 1.80 -> 1.75 ± sqrt(2 · 0.05² / 1) = 0.0707
    assert rope["loss"] == pytest.approx((1.75, 0.05 * math.sqrt(2)))
    assert relu["loss"] == (1.55, None) and relu["cpu_s"] is None
    assert info == {
        "dataset": "shakespeare_char",
        "split": "test",
        "protocol": "",
        "cpu": False,
        "notes": [],
        "machines": {"unknown": 6},
        "solved": None,
    }


def test_by_chooses_the_grouping_and_names_what_else_differs(ablation, capsys):
    by, rows, info = results.summarize(ablation, by=["pos_encoding"])
    assert by == ["pos_encoding"] and [(r["values"], r["n"]) for r in rows] == [(("pope",), 4), (("rope",), 2)]
    assert rows[0]["loss"][0] == pytest.approx((1.4 + 1.5 + 1.6 + 1.55) / 4)
    assert info["notes"] == ["note: the group {'pos_encoding': 'pope'} also differs in pope_magnitude"]
    code, out, err = run_main(ablation[:3] + ablation[5:] + ["--by=pos_encoding"], capsys)
    assert code == 0 and err == "note: the group {'pos_encoding': 'pope'} also differs in pope_magnitude\n"


def test_a_setting_missing_from_older_runs_and_the_split_option(tmp_path):
    a = make_run(tmp_path, "a", 1.0, 0.5)
    b = make_run(tmp_path, "b", 2.0, 0.5, seed=2)
    m = json.loads(open(os.path.join(b, "metrics.json")).read())
    del m["config"]["pope_magnitude"]  # a train.py from before the setting existed
    m["val"]["loss"], m["val"]["ppl"] = 3.0, math.exp(3.0)
    open(os.path.join(b, "metrics.json"), "w").write(json.dumps(m))
    by, rows, _ = results.summarize([a, b])
    assert by == ["pope_magnitude"] and [r["values"] for r in rows] == [("softplus",), (results.NOT_SET,)]
    _, rows, info = results.summarize([a, b], by=["pos_encoding"], split="val")
    assert rows[0]["loss"] == pytest.approx((2.0, math.sqrt(2)))  # val: 1.0 and 3.0
    assert rows[0]["ppl"][0] == pytest.approx((math.exp(1.0) + math.exp(3.0)) / 2)  # the val perplexities too
    assert info["split"] == "val"


def test_markdown_table(ablation, capsys):
    code, out, _ = run_main(ablation[:3] + [ablation[5]], capsys)
    assert code == 0
    assert out == (
        "shakespeare_char, test split: mean ± sd over the runs of each group (sample sd, n − 1; — for one run); "
        "machines: unknown x4\n\n"
        "| pope_magnitude | n | seeds | test loss (nats) | test ppl | test acc (%) | wall per run (min) |\n"
        "|---|---:|---|---:|---:|---:|---:|\n"
        "| softplus | 3 | 1, 2, 3 | 1.5000 ± 0.1000 | 4.497 ± 0.449 | 50.00 ± 10.00 | 11.0 ± 1.0 |\n"  # e^1.4.. e^1.6
        "| relu | 1 | 1 | 1.5500 ± — | 4.711 ± — | 50.00 ± — | 10.0 ± — |\n"
    )


def test_csv_output(ablation, capsys):
    code, out, _ = run_main(ablation + ["--csv"], capsys)
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == [
        "pope_magnitude",
        "pos_encoding",
        "n",
        "seeds",
        "loss_mean",
        "loss_sd",
        "ppl_mean",
        "ppl_sd",
        "acc_pct_mean",
        "acc_pct_sd",
        "wall_s_mean",
        "wall_s_sd",
        "cpu_s_mean",
        "cpu_s_sd",
    ]
    assert [(r["pope_magnitude"], r["pos_encoding"], r["n"], r["seeds"]) for r in rows] == [
        ("softplus", "pope", "3", "1 2 3"),
        ("softplus", "rope", "2", "1 2"),
        ("relu", "pope", "1", "1"),
    ]
    assert float(rows[0]["loss_mean"]) == pytest.approx(1.5, abs=1e-12)
    assert float(rows[0]["loss_sd"]) == pytest.approx(0.1, abs=1e-12)
    assert float(rows[0]["acc_pct_sd"]) == pytest.approx(10.0) and float(rows[0]["wall_s_mean"]) == 660.0
    assert rows[2]["loss_sd"] == "" and rows[2]["cpu_s_mean"] == ""  # one run: no sd; no "run" entry: no CPU time


def test_wall_and_cpu_time_from_the_run_entry(tmp_path, capsys):
    """docs/runs/NAME.json: wall time = the sum over the processes of a resumed run; CPU time where present."""
    a = make_run(
        tmp_path,
        "a",
        1.0,
        0.5,
        wall=100.0,
        run={"name": "a", "out_dir": "x", "wall_s_processes": [300.0, 420.0], "cpu_s": 1500.0},
    )
    b = make_run(tmp_path, "b", 1.0, 0.5, wall=900.0, seed=2)
    _, rows, info = results.summarize([a, b])
    assert rows[0]["wall_s"] == pytest.approx((810.0, math.sqrt(2) * 90.0))  # 720 and 900 s, not 100
    assert rows[0]["cpu_s"] == (1500.0, None) and rows[0]["cpu_n"] == 1 and info["cpu"]
    code, out, _ = run_main([a, b], capsys)
    assert (
        out.splitlines()[-1]
        == "| all | 2 | 1337, 2 | 1.0000 ± 0.0000 | 2.718 ± 0.000 | 50.00 ± 0.00 | 13.5 ± 2.1 | 25.0 ± — (n=1) |"
    )
    c = make_run(tmp_path, "c", 1.0, 0.5, wall=None, seed=3)  # no wall time (a metrics.json without it)
    _, rows, _ = results.summarize([a, b, c])
    assert rows[0]["wall_s"] == pytest.approx((810.0, math.sqrt(2) * 90.0)) and rows[0]["wall_n"] == 2  # not a 0 s run


def test_json_copies_and_settings_from_best_pt(tmp_path):
    """A docs/runs copy reads like its folder; a metrics.json without "config" (older train.py) takes best.pt's."""
    folder = make_run(tmp_path, "run", 1.2, 0.5)
    m = json.loads(open(os.path.join(folder, "metrics.json")).read())
    config = m.pop("config")
    (tmp_path / "copy.json").write_text(json.dumps(m))
    with pytest.raises(results.UserError, match="no 'config'.*give the run folder that holds best.pt"):
        results.summarize([str(tmp_path / "copy.json")])
    torch.save(
        {"model": {}, "model_args": {}, "config": {**config, "pope_magnitude": "relu"}}, os.path.join(folder, "best.pt")
    )
    open(os.path.join(folder, "metrics.json"), "w").write(json.dumps(m))
    for path in (folder, str(tmp_path / "copy.json")):  # the folder's best.pt, or the one "checkpoint" names
        by, rows, _ = results.summarize([path], by=["pope_magnitude"])
        assert rows[0]["values"] == ("relu",) and rows[0]["loss"] == (1.2, None)


def test_extrapolation_column(tmp_path, capsys):
    a = make_run(tmp_path, "a", 1.5, 0.5)  # a folder: a/extrapolate/extrapolation.csv
    write_extrapolation(
        os.path.join(a, "extrapolate", "extrapolation.csv"), [(a, "tiled", 256, 4.5), (a, "tiled", 4096, 5.0)]
    )
    b = make_run(tmp_path, "b", 1.5, 0.5, seed=2)  # a copy: b.json and b.extrapolation.csv beside it
    (tmp_path / "b.json").write_text(open(os.path.join(b, "metrics.json")).read())
    write_extrapolation(str(tmp_path / "b.extrapolation.csv"), [(b, "tiled", 4096, 6.0)])
    c = make_run(tmp_path, "c", 1.7, 0.5, pos_encoding="rope")  # a CSV of two runs: c's rows are c's
    write_extrapolation(
        os.path.join(c, "extrapolate", "extrapolation.csv"),
        [("elsewhere/pope", "tiled", 4096, 1.0), (c, "tiled", 4096, 14.0)],
    )
    by, rows, info = results.summarize([a, str(tmp_path / "b.json"), c], extrapolation=[4096])
    assert rows[0]["ext"] == {4096: pytest.approx((5.5, math.sqrt(0.5)))} and rows[1]["ext"] == {4096: (14.0, None)}
    assert results.summarize([c + "/"], extrapolation=[4096])[1][0]["ext"] == {4096: (14.0, None)}  # as out/*/ gives it
    assert info["protocol"] == "tiled"
    code, out, _ = run_main([a, str(tmp_path / "b.json"), c, "--extrapolation=4096"], capsys)
    lines = out.splitlines()
    assert lines[2].endswith("| ppl at 4096 (tiled) |") and lines[4].endswith("| 5.500 ± 0.707 |")
    assert lines[5].endswith("| 14.000 ± — |")
    code, out, _ = run_main([a, str(tmp_path / "b.json"), "--extrapolation=4096", "--csv"], capsys)
    row = next(csv.DictReader(io.StringIO(out)))
    assert float(row["ppl_at_4096_mean"]) == 5.5 and float(row["ppl_at_4096_sd"]) == pytest.approx(math.sqrt(0.5))


def test_real_train_run_folder(char_pretrained, capsys):
    """The metrics.json that train.py writes: read as is, its numbers in the table."""
    m = json.load(open(os.path.join(char_pretrained["run"], "metrics.json")))
    by, rows, info = results.summarize([char_pretrained["run"]])
    assert by == [] and rows[0]["loss"] == (m["test"]["loss"], None) and rows[0]["seeds"] == [m["config"]["seed"]]
    assert rows[0]["wall_s"] == (m["wall_time_s"], None) and info["dataset"] == "chars"


def bad_inputs(tmp_path):
    """(argv, words the one-line error must hold) for each bad input."""
    a = make_run(tmp_path, "a", 1.0, 0.5)
    b = make_run(tmp_path, "b", 1.0, 0.5, seed=2)
    (tmp_path / "empty").mkdir()
    other = make_run(tmp_path, "other", 1.0, 0.5, dataset="jsb_music21")
    owt = tmp_path / "owt"
    owt.mkdir()
    cfg = {**BASE, "seed": 1, "out_dir": str(owt)}
    (owt / "metrics.json").write_text(json.dumps(metrics(cfg, 3.0, 0.3, 1.0, splits=("val",))))
    (tmp_path / "a-copy.json").write_text(open(os.path.join(a, "metrics.json")).read())
    (tmp_path / "broken.json").write_text("{not json")
    write_extrapolation(os.path.join(b, "extrapolate", "extrapolation.csv"), [(b, "tiled", 256, 4.5)])
    return [
        ([], "no runs"),
        ([str(tmp_path / "empty")], "holds no metrics.json"),
        ([str(tmp_path / "nowhere")], "does not exist"),
        ([str(tmp_path / "broken.json")], "cannot read"),
        ([a, other], "different datasets"),
        ([a, str(owt)], "no 'test' metrics"),
        ([a, str(tmp_path / "a-copy.json")], "same run"),
        ([a, b, "--by=nonsense"], "no run has the setting"),
        ([a, "--extrapolation=4096"], "no length-extrapolation results"),
        ([b, "--extrapolation=4096"], "has no length 4096 (it has 256)"),
        ([b, "--extrapolation=abc"], "comma-separated"),
        ([a, "--split=train"], "invalid choice"),
    ]


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    for argv, words in bad_inputs(tmp_path):
        code, out, err = run_main(argv, capsys)
        assert (code, out) == (2, ""), argv
        assert err.startswith("error: ") and err.count("\n") == 1 and words in err, (argv, err)


def test_the_script_exits_2_on_its_own(tmp_path):
    p = subprocess.run(
        [sys.executable, os.path.join(REPO, "study/results.py"), str(tmp_path)], capture_output=True, text=True
    )
    assert (
        p.returncode == 2
        and p.stderr
        == f"error: {tmp_path} holds no metrics.json: the run has not finished "
        "(train.py writes it at the end; an interrupted run resumes with --init_from=resume)\n"
    )


def test_runs_scored_with_two_protocols_are_refused_not_averaged(tmp_path, capsys):
    """A tiled and a sliding perplexity are different numbers: a group mixing them exits 2 naming both."""
    a = make_run(tmp_path, "a", 1.5, 0.5)
    b = make_run(tmp_path, "b", 1.5, 0.5, seed=2)
    write_extrapolation(os.path.join(a, "extrapolate", "extrapolation.csv"), [(a, "tiled", 4096, 5.0)])
    write_extrapolation(os.path.join(b, "extrapolate", "extrapolation.csv"), [(b, "sliding", 4096, 7.0)])
    code, out, err = run_main([a, b, "--extrapolation=4096"], capsys)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert "different protocols (sliding, tiled)" in err


def test_a_split_read_as_one_document_is_its_own_protocol(tmp_path, capsys):
    """eval_extrapolate.py --one_document scores other chunks than the split's documents: a group mixing the two
    exits 2 naming both, and runs all read so carry it in the column's header."""
    a = make_run(tmp_path, "a", 1.5, 0.5)
    b = make_run(tmp_path, "b", 1.5, 0.5, seed=2)
    head = "run,label,protocol,one_document,length,tokens,ppl,ppl_window_mean,last_loss\n"
    for run, flag in ((a, "True"), (b, "False")):
        os.makedirs(os.path.join(run, "extrapolate"))
        with open(os.path.join(run, "extrapolate", "extrapolation.csv"), "w") as f:
            f.write(head + f"{run},pope,tiled,{flag},4096,65536,5.0,,1.5\n")
    code, out, err = run_main([a, b, "--extrapolation=4096"], capsys)
    assert (code, out) == (2, "") and "different protocols (tiled, tiled, one document)" in err, err
    with open(os.path.join(b, "extrapolate", "extrapolation.csv"), "w") as f:
        f.write(head + f"{b},pope,tiled,True,4096,65536,7.0,,1.5\n")
    code, out, err = run_main([a, b, "--extrapolation=4096"], capsys)
    assert code == 0 and "ppl at 4096 (tiled, one document)" in out and "6.000 ± 1.414" in out, out


def test_an_empty_perplexity_cell_exits_2_with_one_line(tmp_path, capsys):
    """eval_extrapolate.py leaves ppl empty for an absolute encoding past its block_size: one line, exit 2."""
    a = make_run(tmp_path, "a", 1.5, 0.5, pos_encoding="learned")
    write_extrapolation(
        os.path.join(a, "extrapolate", "extrapolation.csv"), [(a, "tiled", 256, 4.5), (a, "tiled", 4096, "")]
    )
    code, out, err = run_main([a, "--extrapolation=256,4096"], capsys)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert "has no perplexity at length 4096" in err


def test_peak_flops_is_bookkeeping_not_a_group(tmp_path):
    """Two seeds that differ in seed and peak_flops (the MFU denominator, not what is trained): one group."""
    a = make_run(tmp_path, "a", 1.0, 0.5, peak_flops=0.0)
    b = make_run(tmp_path, "b", 2.0, 0.5, seed=2, peak_flops=312e12)
    by, rows, _ = results.summarize([a, b])
    assert by == [] and [(r["n"], r["seeds"]) for r in rows] == [(2, [1337, 2])]


def test_a_group_without_any_wall_time_shows_a_bare_dash(tmp_path, capsys):
    """No run of the group has a wall time: "—", not "— (n=0)"; a group where some runs have it: "(n=k)"."""
    a = make_run(tmp_path, "a", 1.0, 0.5, wall=None)
    b = make_run(tmp_path, "b", 1.0, 0.5, wall=None, seed=2)
    c = make_run(tmp_path, "c", 1.0, 0.5, wall=None, pos_encoding="rope")
    d = make_run(tmp_path, "d", 1.0, 0.5, wall=120.0, seed=2, pos_encoding="rope")
    code, out, _ = run_main([a, b, c, d], capsys)
    lines = out.splitlines()
    assert (
        code == 0
        and lines[-2].endswith("| 50.00 ± 0.00 | — |")
        and lines[-1].endswith("| 50.00 ± 0.00 | 2.0 ± — (n=1) |")
    )
