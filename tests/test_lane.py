"""study/lane.sh, the experiment queue: each line trained once, resumed after a kill, copied to
docs/runs/NAME.json with the wall and CPU time of every process, the after-command run once, a run that
another lane holds left to it. The lane runs for real (bash, flock, /usr/bin/time) in a sandbox whose
train.py is a stub that writes what train.py writes (ckpt.pt, best.pt, log.jsonl, metrics.json) in
milliseconds and records its arguments, so every test sees exactly what the lane asked of train.py."""

import fcntl
import json
import os
import re
import subprocess
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LANE = os.path.join(REPO, "study", "lane.sh")
STUB = r'''"""train.py's outputs, instantly: --out_dir=D [--seed=S] [--init_from=resume] [--fail=1]."""
import json, os, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
out = args["out_dir"]
with open(os.path.join(out, "calls.txt"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\n")
with open(os.path.join(out, "threads.txt"), "a") as f:
    f.write(os.environ.get("OMP_NUM_THREADS", "unset") + " " + os.environ.get("MKL_NUM_THREADS", "unset") + "\n")
if args.get("init_from") == "resume" and not os.path.exists(os.path.join(out, "ckpt.pt")):
    sys.exit(f"error: init_from='resume' but {out}/ckpt.pt does not exist")
if args.get("fail") == "1":
    sys.exit("error: training diverged")
for name in ("best.pt", "ckpt.pt"):
    open(os.path.join(out, name), "w").write("weights")
with open(os.path.join(out, "log.jsonl"), "a") as f:
    f.write(json.dumps({"iter": 10, "val_acc": 0.5}) + "\n")
with open(os.path.join(out, "metrics.json"), "w") as f:
    seed = int(args.get("seed", 0))
    record = {"dataset": "stub", "wall_time_s": 0.1, "test": {"loss": 1.0}, "config": {"seed": seed}}
    json.dump(record, f)
'''


@pytest.fixture
def repo(tmp_path):
    """A sandbox repository: the real lane.sh and cli.py (linked), a stub train.py, an empty docs/runs."""
    return sandbox(tmp_path / "repo")


def sandbox(root):
    """Makes the `repo` fixture's sandbox at `root` (a new folder); returns root."""
    (root / "docs" / "runs").mkdir(parents=True)
    (root / "study").mkdir()
    os.symlink(LANE, root / "study" / "lane.sh")
    os.symlink(os.path.join(REPO, "cli.py"), root / "cli.py")
    (root / "train.py").write_text(STUB)
    return root


def queue(root, name, *lines, newline_at_end=True):
    """A queue file of tab-separated lines (each a tuple of fields, or a string as is); returns its path."""
    path = root / name
    text = "\n".join(line if isinstance(line, str) else "\t".join(line) for line in lines)
    path.write_text(text + ("\n" if newline_at_end else ""))
    return str(path)


def lane(root, *queues, env=None):
    """Run one lane to its end: (stdout's messages without their timestamps, seconds it took). env: variables
    added to the lane's environment."""
    t = time.time()
    p = subprocess.run(
        ["bash", str(root / "study" / "lane.sh"), *queues],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    assert p.returncode == 0 and p.stderr == "", p.stderr
    return [re.sub(r"^\S+Z ", "", line) for line in p.stdout.splitlines()], time.time() - t


def calls(root, out):
    """train.py's command lines for a run folder, in order ([] if never called)."""
    path = root / out / "calls.txt"
    return path.read_text().splitlines() if path.exists() else []


def record(root, name):
    return json.loads((root / "docs" / "runs" / f"{name}.json").read_text())


def test_a_queue_of_two_runs_is_trained_copied_and_finished_once(repo):
    # the after-command reads stdin (as ssh does): it must get nothing, not the queue's remaining lines
    after = (
        "mkdir -p out/a/extrapolate out/a/retrieval && echo run,ppl > out/a/extrapolate/extrapolation.csv"
        " && echo run,correct > out/a/retrieval/passkey.csv && echo x >> out/a/after.count && cat > out/a/stdin.txt"
    )
    q = queue(repo, "q.tsv", "# a comment", ("a", "out/a", "--seed=1", after), "", ("b", "out/b", "--seed=2 "))
    log, seconds = lane(repo, q)
    assert log == [
        "start a: python train.py --seed=1 --out_dir=out/a ",
        f"after a: {after}",
        "done a",
        "start b: python train.py --seed=2  --out_dir=out/b ",
        "done b",
        "lane finished",
    ]
    assert calls(repo, "out/a") == ["--seed=1 --out_dir=out/a"] and calls(repo, "out/b") == ["--seed=2 --out_dir=out/b"]
    for name, seed in (("a", 1), ("b", 2)):
        out = repo / "out" / name
        m = record(repo, name)
        run = m.pop("run")
        assert m == json.loads((out / "metrics.json").read_text()) and m["config"]["seed"] == seed
        assert run["name"] == name and run["out_dir"] == f"out/{name}" and len(run["wall_s_processes"]) == 1
        assert 0 <= run["wall_s_processes"][0] <= seconds and 0 <= run["cpu_s"] <= seconds
        assert (repo / "docs" / "runs" / f"{name}.log.jsonl").read_text() == (out / "log.jsonl").read_text()
    assert (repo / "docs" / "runs" / "a.extrapolation.csv").read_text() == "run,ppl\n"
    assert not (repo / "docs" / "runs" / "b.extrapolation.csv").exists()
    assert (repo / "docs" / "runs" / "a.passkey.csv").read_text() == "run,correct\n"  # eval_retrieval.py's CSVs
    assert not (repo / "docs" / "runs" / "a.copy.csv").exists()
    assert (repo / "out" / "a" / "after.done").exists() and not (repo / "out" / "b" / "after.done").exists()
    assert (repo / "out" / "a" / "stdin.txt").read_text() == ""
    log, _ = lane(repo, q)  # all done: nothing trained, run or copied again
    assert log == ["lane finished"]
    assert len(calls(repo, "out/a")) == len(calls(repo, "out/b")) == 1
    assert (repo / "out" / "a" / "after.count").read_text() == "x\n"


def test_a_lane_killed_between_training_and_copy_finishes_the_run_next_time(repo):
    """a: the lane is killed (SIGKILL) inside a's after-command, after training, before the copy; b (no
    after-command): trained, then its copy lost, as when a lane dies right after training. The next lane
    trains neither again, runs a's after-command and writes both records."""
    kill = "[ -f out/a/killed ] || { touch out/a/killed; kill -9 $PPID; }; echo ok > out/a/after.txt"
    q = queue(repo, "q.tsv", ("b", "out/b", "--seed=2"), ("a", "out/a", "--seed=1", kill))
    p = subprocess.run(
        ["bash", str(repo / "study" / "lane.sh"), q], cwd=repo, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == -9 and (repo / "out" / "a" / "metrics.json").exists()
    assert not (repo / "docs" / "runs" / "a.json").exists() and not (repo / "out" / "a" / "after.done").exists()
    (repo / "docs" / "runs" / "b.json").unlink()
    log, _ = lane(repo, q)
    assert log == ["done b", f"after a: {kill}", "done a", "lane finished"]
    assert calls(repo, "out/a") == ["--seed=1 --out_dir=out/a"] and calls(repo, "out/b") == ["--seed=2 --out_dir=out/b"]
    assert record(repo, "a")["run"]["name"] == "a" and record(repo, "b")["run"]["name"] == "b"
    assert (repo / "out" / "a" / "after.done").exists() and (repo / "out" / "a" / "after.txt").read_text() == "ok\n"


def test_empty_fields_stay_in_place_and_every_queue_file_is_read(repo):
    """NAME<tab>OUT<tab><tab>CMD has no train.py arguments and CMD as its after-command (tab is IFS
    whitespace: read with IFS=$'\\t' merges the two tabs and hands CMD to train.py); a line without OUT_DIR
    is skipped with a message; two queue files, the first without a final newline, give all their lines."""
    q1 = queue(
        repo,
        "q1.tsv",
        ("e", "out/e", "", "echo after-ran > out/e/after.txt"),
        ("x", "", "--seed=3"),
        ("f", "out/f", "--seed=4"),
        newline_at_end=False,
    )
    q2 = queue(repo, "q2.tsv", ("g", "out/g", "--seed=5"))
    log, _ = lane(repo, q1, q2)
    assert (
        calls(repo, "out/e") == ["--out_dir=out/e"] and (repo / "out" / "e" / "after.txt").read_text() == "after-ran\n"
    )
    assert "skipped x: no OUT_DIR (the second field)" in log
    assert calls(repo, "out/f") == ["--seed=4 --out_dir=out/f"] and calls(repo, "out/g") == ["--seed=5 --out_dir=out/g"]
    assert sorted(os.listdir(repo / "docs" / "runs")) == [
        "e.json",
        "e.log.jsonl",
        "f.json",
        "f.log.jsonl",
        "g.json",
        "g.log.jsonl",
    ]


TIME_V = """\tCommand being timed: "python train.py --out_dir=out/r"
\tUser time (seconds): {user}
\tSystem time (seconds): {system}
\tPercent of CPU this job got: 99%
\tElapsed (wall clock) time (h:mm:ss or m:ss): {wall}
\tMaximum resident set size (kbytes): 512000
\tExit status: 0
"""


def test_a_killed_run_resumes_and_its_record_sums_every_process(repo):
    """r was killed twice (time.txt holds 1:02:03 = 3723 s and 2:05.50 = 125.5 s of wall clock, and
    102.75 + 10.25 s of CPU) with ckpt.pt written: the lane resumes it, and NAME.json lists the wall clock
    of all three processes, parsed h:mm:ss / m:ss, and their CPU time summed. s holds best.pt but no
    ckpt.pt (killed between the two writes): a resume would fail, so it starts afresh, as does n, whose
    folder is new. A run whose training fails is reported, not copied, and tried again by the next lane;
    an after-command that fails runs again next time."""
    out = repo / "out"
    for name in ("r", "s"):
        (out / name).mkdir(parents=True)
    (out / "r" / "ckpt.pt").write_text("weights")
    (out / "r" / "time.txt").write_text(
        TIME_V.format(user="100.50", system="2.25", wall="1:02:03")
        + TIME_V.format(user="10.00", system="0.25", wall="2:05.50")
    )
    (out / "s" / "best.pt").write_text("weights")
    flaky = "[ -f out/t/tried ] || { touch out/t/tried; exit 3; }"
    q = queue(
        repo,
        "q.tsv",
        ("r", "out/r", "--seed=1"),
        ("n", "out/n", "--seed=2"),
        ("f", "out/f", "--fail=1", "touch out/f/ran"),
        ("s", "out/s", "--seed=3"),
        ("t", "out/t", "--seed=4", flaky),
    )
    log, seconds = lane(repo, q)
    assert calls(repo, "out/r") == ["--seed=1 --out_dir=out/r --init_from=resume"]
    assert calls(repo, "out/n") == ["--seed=2 --out_dir=out/n"] and calls(repo, "out/s") == ["--seed=3 --out_dir=out/s"]
    run = record(repo, "r")["run"]
    assert run["wall_s_processes"][:2] == [3723.0, 125.5] and len(run["wall_s_processes"]) == 3
    assert 0 <= run["wall_s_processes"][2] <= seconds
    assert 113.0 <= run["cpu_s"] <= 113.0 + seconds
    assert (
        "FAILED f (see out/f/train.log)" in log
        and "done f" not in log
        and "start s: python train.py --seed=3 --out_dir=out/s " in log
    )
    assert not (repo / "docs" / "runs" / "f.json").exists() and not (out / "f" / "ran").exists()
    assert "FAILED after-command of t" in log and not (out / "t" / "after.done").exists()
    log, _ = lane(repo, q)
    assert log == [
        "start f: python train.py --fail=1 --out_dir=out/f ",
        "FAILED f (see out/f/train.log)",
        f"after t: {flaky}",
        "done t",
        "lane finished",
    ]
    assert len(calls(repo, "out/f")) == 2 and (out / "t" / "after.done").exists() and len(calls(repo, "out/t")) == 1


def test_a_run_another_lane_holds_is_left_to_it(repo):
    """h's lock is held (as by a lane training it): this lane takes the next line, i, and leaves h; once
    the lock is free, the next lane trains h."""
    q = queue(repo, "q.tsv", ("h", "out/h", "--seed=1"), ("i", "out/i", "--seed=2"))
    (repo / "out" / "h").mkdir(parents=True)
    with open(repo / "out" / "h" / "lane.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        log, _ = lane(repo, q)
        assert calls(repo, "out/h") == [] and calls(repo, "out/i") == ["--seed=2 --out_dir=out/i"]
        assert log == ["start i: python train.py --seed=2 --out_dir=out/i ", "done i", "lane finished"]
    log, _ = lane(repo, q)
    assert calls(repo, "out/h") == ["--seed=1 --out_dir=out/h"] and log[-2:] == ["done h", "lane finished"]


def test_a_fine_tune_waits_for_the_run_it_starts_from_and_never_starts_from_an_unfinished_one(repo):
    """d fine-tunes r's best.pt (DroPE): with r unfinished and no lane on it, d is skipped (r's best.pt
    is an intermediate one); with r's lock held by a lane, d waits until that lane lets go, then runs
    once r has finished."""
    import threading

    q = queue(repo, "q.tsv", ("d", "out/d", "--seed=1 --init_ckpt=out/r/best.pt"))
    (repo / "out" / "r").mkdir(parents=True)
    (repo / "out" / "r" / "best.pt").write_text("an intermediate best.pt")
    log, _ = lane(repo, q)
    assert calls(repo, "out/d") == [] and log[0] == (
        "skipped d: the run it starts from (out/r) has not finished; a later lane takes it"
    )
    held = open(repo / "out" / "r" / "lane.lock", "w")
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def finish_r():  # the other lane: r finishes 1.5 s later, then its lock is released
        time.sleep(1.5)
        (repo / "out" / "r" / "metrics.json").write_text("{}")
        held.close()

    threading.Thread(target=finish_r).start()
    log, seconds = lane(repo, q)
    assert seconds >= 1.5 and calls(repo, "out/d") == ["--seed=1 --init_ckpt=out/r/best.pt --out_dir=out/d"]
    assert log[-2:] == ["done d", "lane finished"]


def test_editing_lane_sh_while_a_lane_runs_does_not_break_it(repo):
    """A git pull that changes lane.sh rewrites the file a running lane reads; bash reads a script as it
    goes, so without the braces around lane.sh's body the lane dies at its next command ('syntax error')."""
    import shutil

    os.remove(repo / "study" / "lane.sh")
    shutil.copy(LANE, repo / "study" / "lane.sh")  # a file of the sandbox's own, rewritten in place below
    edit = (
        "{ head -n 2 study/lane.sh; printf '# an edit that shifts every byte after it%.0s\\n' 1 2 3; "
        "tail -n +3 study/lane.sh; } > edited.sh && cat edited.sh > study/lane.sh"
    )
    q = queue(repo, "q.tsv", ("a", "out/a", "--seed=1", edit), ("b", "out/b", "--seed=2"))
    log, _ = lane(repo, q)
    assert "# an edit" in (repo / "study" / "lane.sh").read_text()
    assert log[-1] == "lane finished" and calls(repo, "out/b") == ["--seed=2 --out_dir=out/b"]


def test_a_committed_record_is_done_in_a_fresh_checkout_without_out(repo):
    """A study spans sessions: the next checkout has docs/runs/NAME.json but no out/. Its runs are not trained
    again (that would redraw them, on another machine, and overwrite the record); the others are."""
    import shutil

    after = "mkdir -p out/b/extrapolate && echo run,ppl > out/b/extrapolate/extrapolation.csv"
    q = queue(repo, "q.tsv", ("a", "out/a", "--seed=1"), ("b", "out/b", "--seed=2", after), ("c", "out/c", "--seed=3"))
    lane(repo, q)
    shutil.rmtree(repo / "out")
    (repo / "docs" / "runs" / "c.json").unlink()  # c's record was never committed
    before = (repo / "docs" / "runs" / "a.json").read_text()
    log, _ = lane(repo, q)
    assert [line for line in log if line.startswith("start")] == ["start c: python train.py --seed=3 --out_dir=out/c "]
    assert calls(repo, "out/a") == calls(repo, "out/b") == []
    assert (repo / "docs" / "runs" / "a.json").read_text() == before


# ---- issue 53, round six ------------------------------------------------------------------------


def test_both_retrieval_csvs_are_copied_beside_the_record(repo):
    """eval_retrieval.py's passkey.csv and copy.csv (OUT_DIR/retrieval) become docs/runs/NAME.passkey.csv
    and NAME.copy.csv, byte for byte, with no temporary file left."""
    after = (
        "mkdir -p out/a/retrieval && printf 'run,correct\\nout/a,3\\n' > out/a/retrieval/passkey.csv"
        " && printf 'run,acc_second\\nout/a,0.25\\n' > out/a/retrieval/copy.csv"
    )
    lane(repo, queue(repo, "q.tsv", ("a", "out/a", "--seed=1", after)))
    runs = repo / "docs" / "runs"
    assert (runs / "a.passkey.csv").read_text() == "run,correct\nout/a,3\n"
    assert (runs / "a.copy.csv").read_text() == "run,acc_second\nout/a,0.25\n"
    assert sorted(os.listdir(runs)) == ["a.copy.csv", "a.json", "a.log.jsonl", "a.passkey.csv"]


def test_init_ckpt_followed_by_other_arguments_names_the_run_it_starts_from(repo):
    """--init_ckpt=out/r/best.pt is not the line's last argument: the run it starts from is still out/r
    (the path ends at the next space). Unfinished r: d is skipped naming out/r; finished: d trains."""
    args = "--init_ckpt=out/r/best.pt --seed=1 --data_root=data/x"
    q = queue(repo, "q.tsv", ("d", "out/d", args))
    (repo / "out" / "r").mkdir(parents=True)
    (repo / "out" / "r" / "best.pt").write_text("an intermediate best.pt")
    log, _ = lane(repo, q)
    assert (
        log == ["skipped d: the run it starts from (out/r) has not finished; a later lane takes it", "lane finished"]
        and calls(repo, "out/d") == []
    )
    (repo / "out" / "r" / "metrics.json").write_text("{}")
    log, _ = lane(repo, q)
    assert calls(repo, "out/d") == [f"{args} --out_dir=out/d"] and log[-2:] == ["done d", "lane finished"]


def test_a_lane_killed_while_copying_a_retrieval_csv_leaves_no_half_copy(repo):
    """The lane dies (SIGKILL) half-way through copying copy.csv: docs/runs/a.copy.csv still holds the whole
    earlier copy (the record was deleted to run a again), never a half-written file; the next lane copies it
    whole. `cp` is a shim on PATH that writes half of a retrieval CSV, then kills its lane, once."""
    import shutil

    real_cp = shutil.which("cp")
    shim = repo / "bin"
    shim.mkdir()
    (shim / "cp").write_text(f'''#!/bin/bash
if [[ "${{@: -2:1}}" == */retrieval/*.csv && ! -e out/a/cp.killed ]]; then
  touch out/a/cp.killed; head -c 20 "${{@: -2:1}}" > "${{@: -1}}"; kill -9 $PPID; exit 1
fi
exec {real_cp} "$@"
''')
    (shim / "cp").chmod(0o755)
    runs = repo / "docs" / "runs"
    (runs / "a.copy.csv").write_text("run,acc_second\nout/a,0.10\n")  # the earlier copy
    new = "run,acc_second\\nout/a,0.25\\n" + "out/a,0.5\\n" * 20
    after = f"mkdir -p out/a/retrieval && printf '{new}' > out/a/retrieval/copy.csv"
    q = queue(repo, "q.tsv", ("a", "out/a", "--seed=1", after))
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"}
    p = subprocess.run(
        ["bash", str(repo / "study" / "lane.sh"), q], cwd=repo, capture_output=True, text=True, timeout=60, env=env
    )
    assert p.returncode == -9 and (repo / "out" / "a" / "cp.killed").exists()
    assert (runs / "a.copy.csv").read_text() == "run,acc_second\nout/a,0.10\n" and not (runs / "a.json").exists()
    p = subprocess.run(
        ["bash", str(repo / "study" / "lane.sh"), q], cwd=repo, capture_output=True, text=True, timeout=60, env=env
    )
    assert p.returncode == 0 and (runs / "a.json").exists()
    assert (runs / "a.copy.csv").read_text() == (repo / "out" / "a" / "retrieval" / "copy.csv").read_text()
    assert (runs / "a.copy.csv").read_text().count("\n") == 22


def test_a_record_whose_after_command_wrote_no_extrapolation_csv_is_done_in_a_fresh_checkout(repo):
    """An after-command that runs eval_retrieval.py only (no NAME.extrapolation.csv): once it has run, the
    record says so ("after_done": true) and a fresh checkout without out/ does not train the run again (it
    did: the record counted as done only beside NAME.extrapolation.csv). A record whose after-command failed
    says false, and that run is trained again, as one without a record."""
    import shutil

    ok = "mkdir -p out/a/retrieval && echo run,acc_second > out/a/retrieval/copy.csv"
    q = queue(repo, "q.tsv", ("a", "out/a", "--seed=1", ok), ("b", "out/b", "--seed=2", "exit 3"))
    lane(repo, q)
    assert record(repo, "a")["run"]["after_done"] is True and record(repo, "b")["run"]["after_done"] is False
    runs = repo / "docs" / "runs"
    assert (runs / "a.copy.csv").exists() and not (runs / "a.extrapolation.csv").exists()
    shutil.rmtree(repo / "out")
    log, _ = lane(repo, q)
    assert [line for line in log if line.startswith("start")] == ["start b: python train.py --seed=2 --out_dir=out/b "]
    assert calls(repo, "out/a") == []


def test_an_after_command_that_fails_after_writing_its_csv_is_not_done(repo):
    """An after-command that writes the tiled extrapolation.csv and then fails (the sliding evaluation after it,
    say) leaves a record that says "after_done": false: the next lane runs the after-command again (same checkout,
    out/ kept: no training), although NAME.extrapolation.csv is there; the rule "extrapolation.csv means done"
    holds only for records from before "after_done"."""
    after = "mkdir -p out/a/extrapolate && echo length,ppl > out/a/extrapolate/extrapolation.csv && exit 3"
    q = queue(repo, "q.tsv", ("a", "out/a", "--seed=1", after))
    lane(repo, q)
    assert record(repo, "a")["run"]["after_done"] is False
    assert (repo / "docs" / "runs" / "a.extrapolation.csv").exists()
    log, _ = lane(repo, q)
    assert not [line for line in log if line.startswith("start")]
    assert [line.split(":")[0] for line in log if line.startswith("after")] == ["after a"]


def test_a_record_from_before_after_done_is_done_in_a_fresh_checkout(repo):
    """Every committed record with an after-command predates "after_done" (its "run" entry has no such key): it
    counts as done where NAME.extrapolation.csv is beside it, so a fresh checkout without out/ neither trains the
    run again (redrawing it, and overwriting the record) nor reruns its after-command. Such a record without its
    CSV is not done: that run is trained. The records are written by hand, as the committed ones are."""
    runs = repo / "docs" / "runs"
    old = {"dataset": "stub", "test": {"loss": 1.0}, "run": {"name": "a", "out_dir": "out/a", "cpu_s": 1.0}}
    for name in ("a", "b"):
        (runs / f"{name}.json").write_text(json.dumps({**old, "run": {**old["run"], "name": name}}, indent=1))
    (runs / "a.extrapolation.csv").write_text("length,ppl\n64,3.0\n")
    before = (runs / "a.json").read_text()
    after = "mkdir -p out/{0}/extrapolate && echo length,ppl > out/{0}/extrapolate/extrapolation.csv"
    lines = [(n, f"out/{n}", f"--seed={i + 1}", after.format(n)) for i, n in enumerate("ab")]
    q = queue(repo, "q.tsv", *lines)
    log, _ = lane(repo, q)
    assert [line for line in log if line.startswith(("start", "after"))] == [
        "start b: python train.py --seed=2 --out_dir=out/b ",
        f"after b: {after.format('b')}",
    ]
    assert calls(repo, "out/a") == [] and not (repo / "out" / "a").exists()
    assert (runs / "a.json").read_text() == before
    assert (runs / "a.extrapolation.csv").read_text() == "length,ppl\n64,3.0\n"
    assert record(repo, "b")["run"]["after_done"] is True


def test_each_run_gets_one_core_unless_lane_threads_says_more(repo):
    """OMP_NUM_THREADS and MKL_NUM_THREADS are the lane's, whatever the caller's environment says: 1 by default,
    LANE_THREADS when given (a run that must end within one session takes both cores); a bad value is refused."""
    q = queue(repo, "q.tsv", ("one", "out/one", "--seed=1"), ("two", "out/two", "--seed=2"))
    lane(repo, q, env={"OMP_NUM_THREADS": "7", "MKL_NUM_THREADS": "7"})
    assert (repo / "out/one/threads.txt").read_text() == "1 1\n"
    q2 = queue(repo, "q2.tsv", ("three", "out/three", "--seed=3"))
    lane(repo, q2, env={"LANE_THREADS": "2"})
    assert (repo / "out/three/threads.txt").read_text() == "2 2\n"
    for bad in ("0", "two", "-1"):
        p = subprocess.run(
            ["bash", str(repo / "study" / "lane.sh"), q2],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "LANE_THREADS": bad},
        )
        assert p.returncode == 2 and "LANE_THREADS" in p.stderr and "not a number of cores" in p.stderr
