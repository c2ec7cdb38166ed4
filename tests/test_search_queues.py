"""Issue 60's search queues (docs/runs/i60-search*.tsv, written by docs/runs/i60-search-queue.py): every line is
a train.py command that train.py's configurator accepts, the grids are complete, the search seeds are none of a
registered study's, every fine-tune starts from a RoPE run of the queue, and study/lane.sh runs them all once, each
fine-tune after its parent (in test_lane's sandbox, whose train.py is a stub). At the end, issue 74's queues."""

import itertools
import json
import math
import os
import re

import pytest
from test_lane import lane, record, repo, sandbox  # noqa: F401 (repo: the sandbox fixture)

import train
from configurator import configure

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUEUES = [os.path.join(REPO, "docs", "runs", q) for q in ("i60-search.tsv", "i60-search-960.tsv")]


def lines(path):
    with open(path) as f:
        return [ln.rstrip("\n").split("\t") for ln in f if ln.strip() and not ln.startswith("#")]


def test_every_line_is_a_train_command_and_the_grids_are_complete():
    rows = [r for q in QUEUES for r in lines(q)]
    assert all(len(r) == 3 for r in rows) and len({r[0] for r in rows}) == len({r[1] for r in rows}) == len(rows)
    yarn, drope, pope, parents = set(), set(), set(), []
    for name, out, args in rows:
        cfg = configure(train.DEFAULTS, args.split())  # raises on an unknown key or a wrong type
        assert "--out_dir" not in args and out.startswith("out-i60s/") and name.startswith("i60s-")
        assert cfg["seed"] in (6001, 6002)  # the search's seeds: none of issue 54's (5401-5408, 1337, 1338)
        if cfg["init_from"] == "finetune":
            parent = re.fullmatch(r"out-i60s/rope-s(\d+)/best.pt", cfg["init_ckpt"])
            assert parent and int(parent[1]) == cfg["seed"] and f"out-i60s/rope-s{parent[1]}" in parents
        if cfg["rope_scaling"] != 1.0:
            assert cfg["block_size"] == 1024 and cfg["min_lr"] == cfg["learning_rate"]  # YaRN's constant lr
            assert cfg["warmup_iters"] == -(-4 * cfg["max_iters"] // 100)  # 4 % of the steps, rounded up
            yarn.add((cfg["max_iters"], cfg["learning_rate"], cfg["rope_yarn_ramp"], cfg["seed"]))
        elif cfg["pos_encoding"] == "none":
            assert cfg["block_size"] == 256 and cfg["warmup_iters"] == -(-cfg["max_iters"] // 10)
            drope.add((cfg["max_iters"], cfg["learning_rate"], cfg["seed"]))
        elif cfg["pos_encoding"] == "pope":
            assert cfg["min_lr"] == pytest.approx(cfg["learning_rate"] / 10)
            pope.add((cfg["learning_rate"], cfg["seed"]))
        else:
            assert cfg["pos_encoding"] == "rope" and cfg["learning_rate"] == 1e-3
            parents.append(out)
    seeds = (6001, 6002)
    assert yarn == set(itertools.product((15, 60, 240, 960), (1e-4, 3e-4), ("code", "paper"), seeds))
    assert drope == set(itertools.product((60, 240, 1500), (3e-4, 1e-3), seeds))
    assert pope == set(itertools.product((5e-4, 1e-3, 2e-3), seeds))
    assert sum(r[0].startswith("i60s-yarn-n960") for r in lines(QUEUES[1])) == len(lines(QUEUES[1])) == 8


def test_lane_sh_runs_the_search_once_each_fine_tune_after_its_parent(repo):  # noqa: F811
    """A sample of the queues' lines as they are in the files (the whole 52 lines take 27 s in the sandbox, run
    once by hand for issue 60): both parents, then one line of each kind, the 960 block's from its own file."""
    kinds = "|".join(
        (
            "rope-s600.",
            "yarn-n15-lr1e-4-code-s6001",
            "drope-n60-lr3e-4-s6002",
            "pope-lr5e-4-s6001",
            "yarn-n960-lr3e-4-paper-s6002",
        )
    )
    keep = re.compile(rf"i60s-({kinds})\t")
    paths = []
    for q in QUEUES:
        with open(q) as f:
            text = "".join(ln for ln in f if ln.startswith("#") or keep.match(ln))
        (repo / os.path.basename(q)).write_text(text)
        paths.append(str(repo / os.path.basename(q)))
    out, _ = lane(repo, *paths)
    done = [m.split()[1] for m in out if m.startswith("done ")]
    rows = [r for q in paths for r in lines(q)]
    assert len(rows) == 6
    assert done == [r[0] for r in rows] and out[-1] == "lane finished"
    for name, path, args in rows:
        assert record(repo, name)["run"]["out_dir"] == path
        assert (repo / path / "calls.txt").read_text() == f"{args} --out_dir={path}\n"


GENERATOR = os.path.join(REPO, "docs", "runs", "i60-registered-queue.py")
REGISTERED = os.path.join(REPO, "docs", "runs", "i60-registered.tsv")


def registered_rows(tmp_path, *argv):
    import subprocess
    import sys

    out = tmp_path / "q.tsv"
    subprocess.run([sys.executable, GENERATOR, *argv, f"--out={out}"], check=True, cwd=REPO)
    with open(out) as f:
        return [ln.rstrip("\n").split("\t") for ln in f if ln.strip() and not ln.startswith("#")]


def search_line(name):
    """The search queue's train.py arguments for NAME: an independent writer of the same schedules."""
    rope_lr = os.path.join(REPO, "docs", "runs", "i60-search-rope-lr.tsv")
    (args,) = [r[2] for q in (*QUEUES, rope_lr) for r in lines(q) if r[0] == name]
    return args


@pytest.mark.parametrize(
    "yarn,yarn_code,drope,pope_lr,rope_lr",
    [
        ("240,3e-4,code", "", "", "1e-3", "1e-3"),
        ("960,1e-4,paper", "960,3e-4", "1500,1e-3", "2e-3", "2e-3"),
        ("15,3e-4,code", "", "60,3e-4", "5e-4", "5e-4"),
    ],
)
def test_registered_queue_repeats_the_chosen_search_settings_at_new_seeds(
    tmp_path, yarn, yarn_code, drope, pope_lr, rope_lr
):
    """Each registered fine-tune is the search's line of its setting with only the seed and parent changed, every
    run is scored by issue 54's after-command, and the blocks come in seed order, each parent before its children."""
    argv = ["--n=3", f"--pope_lr={pope_lr}", f"--rope_lr={rope_lr}", f"--yarn={yarn}", f"--yarn_code={yarn_code}"]
    argv.append(f"--drope={drope}")
    rows = registered_rows(tmp_path, *argv)
    per_seed = 3 + bool(yarn_code) + bool(drope)
    assert len(rows) == 3 * per_seed and len({r[0] for r in rows}) == len(rows)
    with open(os.path.join(REPO, "docs", "runs", "i54_registered.tsv")) as f:
        i54 = {r[0]: r[3] for r in (ln.rstrip("\n").split("\t") for ln in f if ln.startswith("i54-"))}
    n, lr, ramp = yarn.split(",")
    for k, (name, out, args, after) in enumerate(rows):
        seed = 6101 + k // per_seed
        arm = name.split("-")[1]
        assert name == f"i60-{arm}-s{seed}" and out == f"out-i60/{arm}-s{seed}"
        assert after == i54["i54-rope-s5401"].replace("out-i54/rope-s5401", out).replace("i54-rope-s5401", name)
        cfg = configure(train.DEFAULTS, args.split())
        assert cfg["seed"] == seed
        if arm == "rope":  # the search's RoPE line of the chosen lr (the parents' for 1e-3)
            want = search_line("i60s-rope-s6001" if rope_lr == "1e-3" else f"i60s-rope-lr{rope_lr}-s6001")
        elif arm == "pope":
            want = search_line(f"i60s-pope-lr{pope_lr}-s6001")
        elif arm == "yarn":
            want = search_line(f"i60s-yarn-n{n}-lr{lr}-{ramp}-s6001")
        elif arm == "yarncode":
            cn, clr = yarn_code.split(",")
            want = search_line(f"i60s-yarn-n{cn}-lr{clr}-code-s6001")
        else:
            dn, dlr = drope.split(",")
            want = search_line(f"i60s-drope-n{dn}-lr{dlr}-s6001")
        want = want.replace("--seed=6001", f"--seed={seed}").replace("out-i60s/rope-s6001", f"out-i60/rope-s{seed}")
        assert args == want
        assert rows[k - k % per_seed][0] == f"i60-rope-s{seed}"  # the block's parent comes first


def test_registered_queue_refuses_a_code_secondary_without_a_paper_choice(tmp_path):
    import subprocess

    with pytest.raises(subprocess.CalledProcessError):
        registered_rows(tmp_path, "--n=3", "--pope_lr=1e-3", "--yarn=240,3e-4,code", "--yarn_code=240,1e-4")


def test_rope_lr_queue_is_popes_lr_search_with_rope():
    """The amendment's RoPE lr block: for each lr and seed, PoPE's search line with --pos_encoding=rope added, so
    YaRN's parent gets the lr search PoPE got (1e-3 is the RoPE parents of i60-search.tsv)."""
    rows = lines(os.path.join(REPO, "docs", "runs", "i60-search-rope-lr.tsv"))
    assert len(rows) == 4
    for name, out, args in rows:
        cfg = configure(train.DEFAULTS, args.split())
        lr = name[len("i60s-rope-lr") :].rsplit("-s", 1)[0]
        assert cfg["pos_encoding"] == "rope" and name == f"i60s-rope-lr{lr}-s{cfg['seed']}" and lr in ("5e-4", "2e-3")
        assert out == f"out-i60s/rope-lr{lr}-s{cfg['seed']}"
        assert args == "--pos_encoding=rope " + search_line(f"i60s-pope-lr{lr}-s{cfg['seed']}")


I74_GENERATOR = os.path.join(REPO, "docs", "runs", "i74-search-queue.py")
SCHEDULE = ("max_iters", "lr_decay_iters", "warmup_iters", "learning_rate", "min_lr", "decay_lr", "eval_interval")
SCHEDULE += ("eval_iters", "log_interval", "batch_size", "block_size", "gradient_accumulation_steps", "seed")


def i74_rows(tmp_path, *argv):
    import subprocess
    import sys

    (tmp_path / "docs" / "runs").mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, I74_GENERATOR, *argv], check=True, cwd=tmp_path, capture_output=True)
    n = [a for a in argv if a.startswith("--n=")][0][4:]
    return lines(tmp_path / "docs" / "runs" / f"i74-search-n{n}.tsv")


@pytest.mark.parametrize("n,center", [(3840, False), (7680, True), (3840, True)])
def test_i74_search_queue_gives_yarn_and_pope_ft_the_same_schedule(tmp_path, n, center):
    """Issue 74's search at N: YaRN at 1e-4 and 1e-3 (and 3e-4 with --center, first: N = 7680 is the rule's cap),
    PoPE+ft at 1e-4, 3e-4, 1e-3, each PoPE+ft line YaRN's schedule key by key; the YaRN line at 3e-4, 3840 is the
    doubling queue's (i74-yarn-3840.tsv) and the PoPE parents are issue 60's registered-lr search lines."""
    rows = i74_rows(tmp_path, f"--n={n}", *(["--center"] if center else []))
    assert len(rows) == 12 + 2 * center and len({r[0] for r in rows}) == len({r[1] for r in rows}) == len(rows)
    cfgs = {name: configure(train.DEFAULTS, args.split()) for name, _, args in rows}
    assert all(out == "out-i74s/" + name[len("i74s-") :] for name, out, _ in rows)
    lrs = ("1e-4", "3e-4", "1e-3") if center else ("1e-4", "1e-3")
    want = {f"i74s-yarn-n{n}-lr{lr}-code-s{s}" for lr in lrs for s in (6001, 6002)}
    want |= {f"i74s-popeft-n{n}-lr{lr}-s{s}" for lr in ("1e-4", "3e-4", "1e-3") for s in (6001, 6002)}
    want |= {f"i74s-pope-lr2e-3-s{s}" for s in (6001, 6002)}
    assert set(cfgs) == want
    if center:
        assert [r[0] for r in rows[:2]] == [f"i74s-yarn-n{n}-lr3e-4-code-s{s}" for s in (6001, 6002)]
    with open(os.path.join(REPO, "docs", "runs", "i74-yarn-3840.tsv")) as f:
        doubling = {r[0]: r[2] for r in (ln.rstrip("\n").split("\t") for ln in f if ln.startswith("i74s-"))}
    for s in (6001, 6002):
        parent = configure(train.DEFAULTS, search_line(f"i60s-pope-lr2e-3-s{s}").split())
        assert cfgs[f"i74s-pope-lr2e-3-s{s}"] == parent
        if center and n == 3840:
            got = cfgs[f"i74s-yarn-n3840-lr3e-4-code-s{s}"]
            assert got == configure(train.DEFAULTS, doubling[f"i74s-yarn-n3840-lr3e-4-code-s{s}"].split())
        for lr in ("1e-4", "1e-3"):
            yarn, ft = cfgs[f"i74s-yarn-n{n}-lr{lr}-code-s{s}"], cfgs[f"i74s-popeft-n{n}-lr{lr}-s{s}"]
            assert {k: yarn[k] for k in SCHEDULE} == {k: ft[k] for k in SCHEDULE}
            assert yarn["max_iters"] == n and yarn["learning_rate"] == yarn["min_lr"] == float(lr)
            assert yarn["warmup_iters"] == -(-4 * n // 100) and yarn["eval_interval"] == n // 16
            assert yarn["init_ckpt"] == f"out-i74s/rope-s{s}/best.pt" and yarn["rope_yarn_ramp"] == "code"
            assert ft["init_ckpt"] == f"out-i74s/pope-lr2e-3-s{s}/best.pt" and ft["pos_encoding"] == "pope"


I74_REGISTERED = os.path.join(REPO, "docs", "runs", "i74-registered-queue.py")


@pytest.mark.parametrize("steps,yarn_lr,popeft_lr", [(7680, "3e-4", "1e-4"), (3840, "1e-3", "3e-4")])
def test_i74_registered_queue_repeats_the_search_lines_at_new_seeds(tmp_path, steps, yarn_lr, popeft_lr):
    """Each registered run is the search's line of its arm and lr (i74-search-queue.py's; RoPE: issue 60's registered
    lr 2e-3, its search line) with only the seed and the parent's folder changed; blocks in seed order, each parent
    directly before its fine-tune; every run scored tiled at 1x-16x over the whole test split."""
    import subprocess
    import sys

    out = tmp_path / "reg.tsv"
    argv = ["--n=3", f"--steps={steps}", f"--yarn_lr={yarn_lr}", f"--popeft_lr={popeft_lr}", f"--out={out}"]
    subprocess.run([sys.executable, I74_REGISTERED, *argv], check=True, cwd=REPO, capture_output=True)
    rows = lines(out)
    search = {r[0]: r[2] for r in i74_rows(tmp_path, f"--n={steps}", "--center")}
    search["i60s-rope-lr2e-3-s6001"] = search_line("i60s-rope-lr2e-3-s6001")  # issue 60's registered RoPE recipe
    assert [r[0] for r in rows] == [
        f"i74-{a}-s{s}" for s in (7401, 7402, 7403) for a in ("rope", "yarn", "pope", "popeft")
    ]
    want_name = {
        "rope": "i60s-rope-lr2e-3-s6001",
        "pope": "i74s-pope-lr2e-3-s6001",
        "yarn": f"i74s-yarn-n{steps}-lr{yarn_lr}-code-s6001",
        "popeft": f"i74s-popeft-n{steps}-lr{popeft_lr}-s6001",
    }
    for name, path, args, after in rows:
        arm, seed = name.split("-")[1], int(name.rsplit("-s", 1)[1])
        assert path == f"out-i74/{arm}-s{seed}"
        want = search[want_name[arm]].replace("--seed=6001", f"--seed={seed}")
        want = want.replace("out-i74s/rope-s6001", f"out-i74/rope-s{seed}")
        want = want.replace("out-i74s/pope-lr2e-3-s6001", f"out-i74/pope-s{seed}")
        assert configure(train.DEFAULTS, args.split()) == configure(train.DEFAULTS, want.split())
        assert after == (
            f"python eval_extrapolate.py {path} --dataset=shakespeare_char --lengths=256,512,1024,2048,4096 "
            f"--max_tokens=0 --one_document --out_dir={path}/extrapolate --device=cpu"
        )


@pytest.mark.parametrize("bad", ["--yarn_lr=2e-4", "--popeft_lr=1e-2", "--n=0"])
def test_i74_registered_queue_refuses_an_lr_outside_the_search(tmp_path, bad):
    import subprocess
    import sys

    argv = ["--n=3", "--steps=7680", "--yarn_lr=3e-4", "--popeft_lr=3e-4", f"--out={tmp_path / 'q.tsv'}", bad]
    p = subprocess.run([sys.executable, I74_REGISTERED, *argv], cwd=REPO, capture_output=True, text=True)
    assert p.returncode != 0 and "one of the search's" in p.stderr and not (tmp_path / "q.tsv").exists()


@pytest.mark.parametrize("extend", ["yarn:3e-3", "popeft:3e-5"])
def test_i74_search_extension_is_the_search_line_one_grid_step_past_the_edge(tmp_path, extend):
    """--extend=ARM:LR (the edge rule): the two seeds' lines of that arm at LR, equal to the search's line of the arm
    at the edge it extends with only the lr changed; its own file, so the running search's queue stays as it is."""
    import subprocess
    import sys

    arm, lr = extend.split(":")
    edge = {"3e-3": "1e-3", "3e-5": "1e-4"}[lr]
    (tmp_path / "docs" / "runs").mkdir(parents=True)
    subprocess.run([sys.executable, I74_GENERATOR, "--n=7680", f"--extend={extend}"], check=True, cwd=tmp_path)
    assert not (tmp_path / "docs" / "runs" / "i74-search-n7680.tsv").exists()  # the running search's queue: untouched
    ext = lines(tmp_path / "docs" / "runs" / f"i74-search-n7680-{arm}-lr{lr}.tsv")
    search = {r[0]: r for r in i74_rows(tmp_path, "--n=7680", "--center")}
    tag = {"yarn": "yarn-n7680-lr{}-code-s{}", "popeft": "popeft-n7680-lr{}-s{}"}[arm]
    assert [r[0] for r in ext] == [f"i74s-{tag.format(lr, s)}" for s in (6001, 6002)]
    for (_, out, args), s in zip(ext, (6001, 6002)):
        base = search[f"i74s-{tag.format(edge, s)}"][2].replace(f"--learning_rate={edge} --min_lr={edge}", "")
        assert out == f"out-i74s/{tag.format(lr, s)}"
        cfg = configure(train.DEFAULTS, args.split())
        assert cfg["learning_rate"] == cfg["min_lr"] == float(lr)
        assert cfg == configure(train.DEFAULTS, base.split() + [f"--learning_rate={lr}", f"--min_lr={lr}"])
    for bad in ("yarn:1e-3", "rope:3e-3", "popeft"):
        p = subprocess.run(
            [sys.executable, I74_GENERATOR, "--n=7680", f"--extend={bad}"], cwd=tmp_path, capture_output=True, text=True
        )
        assert p.returncode != 0 and "3e-5 or 3e-3" in p.stderr


def test_i74_registered_queue_takes_the_edge_rule_lrs(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "q.tsv"
    argv = ["--n=1", "--steps=7680", "--yarn_lr=3e-3", "--popeft_lr=3e-5", f"--out={out}"]
    subprocess.run([sys.executable, I74_REGISTERED, *argv], check=True, cwd=REPO, capture_output=True)
    cfg = {r[0]: configure(train.DEFAULTS, r[2].split()) for r in lines(out)}
    assert cfg["i74-yarn-s7401"]["learning_rate"] == 3e-3 and cfg["i74-popeft-s7401"]["min_lr"] == 3e-5


def _registered_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("i74_registered", I74_REGISTERED)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("popeft_loss,equivalent", [(1.46, True), (1.52, False)])
def test_i74_registered_analysis_runs_on_the_registered_arms(tmp_path, monkeypatch, capsys, popeft_loss, equivalent):
    """The registered analysis commands (i74-registered-queue.py's ANALYSIS, quoted in docs/extrapolation.md) run on
    records with the registered queue's own configs (study/results.py refuses arms that differ in a setting not
    --allow'ed), and read what the rule says: the permutation p at 4096 and the TOST at 1024. Known answer: PoPE arms
    below YaRN on all five seeds give the smallest exact p, 2 / C(10, 5) = 0.0079; PoPE+ft's test loss 0.01 nats from
    YaRN's with sd 0.008 is equivalent at +-0.05, 0.07 nats from it is not. --verdicts reads the same."""
    import glob
    import shlex
    import subprocess
    import sys

    import results

    mod = _registered_module()
    q = tmp_path / "reg.tsv"
    argv = ["--n=5", "--steps=7680", "--yarn_lr=3e-4", "--popeft_lr=1e-3", f"--out={q}"]
    subprocess.run([sys.executable, I74_REGISTERED, *argv], check=True, cwd=REPO, capture_output=True)
    runs = tmp_path / "docs" / "runs"
    runs.mkdir(parents=True)
    ppl16 = {"rope": 40.0, "pope": 8.0, "yarn": 14.0, "popeft": 7.0}
    loss = {"rope": 1.52, "pope": 1.50, "yarn": 1.45, "popeft": popeft_loss}
    for i, (name, out, args, _) in enumerate(lines(q)):
        arm, j = name.split("-")[1], i // 4
        m = {
            "dataset": "shakespeare_char",
            "config": configure(train.DEFAULTS, args.split() + [f"--out_dir={out}"]),
            "val": {"loss": loss[arm], "ppl": math.exp(loss[arm]), "acc": 0.5},
            "test": {"loss": loss[arm] + 0.005 * (j - 2), "ppl": math.exp(loss[arm]), "acc": 0.5},
            "run": {"name": name, "out_dir": out},
        }
        (runs / f"{name}.json").write_text(json.dumps(m))
        rows = ["run,label,protocol,one_document,length,tokens,ppl"]  # the after-command's --one_document
        rows += [
            f"{out},{arm},tiled,True,{L},249856,{ppl16[arm] * L / 4096 + 0.1 * j}" for L in (256, 512, 1024, 2048, 4096)
        ]
        (runs / f"{name}.extrapolation.csv").write_text("\n".join(rows) + "\n")
    monkeypatch.chdir(tmp_path)
    text = {}
    for what, cmd in mod.ANALYSIS.items():
        words = shlex.split(cmd)
        assert words[:2] == ["python", "study/results.py"]
        argv = [w2 for w in words[2:] for w2 in (sorted(glob.glob(w)) if "*" in w else [w])]
        text[what] = results.main(argv)
    groups = {tuple(c.strip() for c in ln.split("|")[1:3]) for ln in text["table"].splitlines() if ln.startswith("| ")}
    assert {("pope", "256"), ("pope", "1024"), ("rope", "256"), ("rope", "1024")} <= groups
    for what in ("H2a", "H2b,H2c"):
        head = next(ln for ln in text[what].splitlines() if ln.startswith("| metric"))
        row = next(ln for ln in text[what].splitlines() if ln.startswith("| ppl at 4096 (tiled, one document) |"))
        cells = dict(zip([c.strip() for c in head.split("|")], [c.strip() for c in row.split("|")]))
        assert float(cells["p (perm.)"]) == pytest.approx(2 / 252, abs=5e-4), row
    verdict = re.search(
        r"^TOST \(equivalence of the test loss .*: (equivalent|not shown equivalent) \(p <", text["H2b,H2c"], re.M
    )
    assert verdict and verdict.group(1) == ("equivalent" if equivalent else "not shown equivalent"), text["H2b,H2c"]
    v = mod.main(["--verdicts"])  # the registered verdicts at full precision
    assert v["p"] == {"H2a": 2 / 252, "H2b": 2 / 252} and v["holm"] == {"H2a": True, "H2b": True}
    assert v["holm_p"] == {"H2a": 4 / 252, "H2b": 4 / 252} and (v["tost"]["p"] < 0.05) == equivalent
    assert "H2a: exact permutation p 0.0079365" in capsys.readouterr().out
    assert "rope_scaling" in text["H2a"] and "rope_scaling" in text["H2b,H2c"]  # the allowed settings, named
    assert mod.holm(0.0079, 0.03) == {"H2a": True, "H2b": True}
    assert mod.holm(0.03, 0.0079) == {"H2a": True, "H2b": True}
    assert mod.holm(0.0079, 0.06) == {"H2a": True, "H2b": False}
    assert mod.holm(0.029, 0.03) == {"H2a": False, "H2b": False}  # n = 4's smallest p cannot pass Holm's first step
    assert mod.holm_adjusted(0.01, 0.03) == {"H2a": 0.02, "H2b": 0.03}
    assert mod.holm_adjusted(0.04, 0.01) == {"H2a": 0.04, "H2b": 0.02}
    assert mod.holm_adjusted(0.3, 0.9) == {"H2a": 0.6, "H2b": 0.9}


def test_i74_report_tables_and_draws_the_four_registered_arms(tmp_path):
    """The closing figure's command (docs/runs/i54-report.py --prefix=i74, named in docs/extrapolation.md) on records
    written from the registered queue's own configs: one row per arm, the fine-tunes labelled with the steps and lr
    their records hold (7680, 3e-3), mean ± sd per length against numpy's (ddof 1), the last-256 loss table, and a
    PNG. Other studies' records in the folder (i60-*) are not read."""
    import subprocess
    import sys

    import numpy as np

    q = tmp_path / "reg.tsv"
    argv = ["--n=5", "--steps=7680", "--yarn_lr=3e-3", "--popeft_lr=3e-3", f"--out={q}"]
    subprocess.run([sys.executable, I74_REGISTERED, *argv], check=True, cwd=REPO, capture_output=True)
    runs = tmp_path / "runs"
    runs.mkdir()
    lengths = (256, 512, 1024, 2048, 4096)
    base = {"rope": 40.0, "pope": 8.0, "yarn": 14.0, "popeft": 7.0}
    ppl = {}  # (arm, length) -> the five seeds' values
    for i, (name, out, args, _) in enumerate(lines(q)):
        arm, j = name.split("-")[1], i // 4
        cfg = configure(train.DEFAULTS, args.split() + [f"--out_dir={out}"])
        (runs / f"{name}.json").write_text(json.dumps({"config": cfg, "run": {"name": name}}))
        rows = ["run,label,protocol,one_document,length,tokens,ppl,last_loss"]
        for L in lengths:
            v = base[arm] * L / 4096 + 0.37 * j * j  # unequal spreads across seeds
            ppl.setdefault((arm, L), []).append(v)
            rows.append(f"{out},{arm},tiled,True,{L},249856,{v},{1.0 + j / 100}")
        (runs / f"{name}.extrapolation.csv").write_text("\n".join(rows) + "\n")
    (runs / "i60-yarn-s1.extrapolation.csv").write_text(
        "run,label,protocol,one_document,length,tokens,ppl,last_loss\nx,yarn,tiled,True,4096,1,999,9\n"
    )
    png = tmp_path / "fig.png"
    report = os.path.join(REPO, "docs", "runs", "i54-report.py")
    out = subprocess.run(
        [sys.executable, report, "--prefix=i74", f"--runs={runs}", f"--png={png}"],
        check=True,
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout
    labels = {
        "rope": "RoPE (lr 2e-3)",
        "pope": "PoPE (δ at zero, lr 2e-3)",
        "yarn": "RoPE + YaRN (s = 4, 7680-step fine-tune at 4x, lr 3e-3)",
        "popeft": "PoPE+ft (7680-step fine-tune at 4x, lr 3e-3)",
    }
    table = [ln for ln in out.split("\n\n")[0].splitlines() if ln.startswith("| ") and not ln.startswith("| arm")]
    assert [r.split("|")[1].strip() for r in table] == list(labels.values()), out
    for arm, row in zip(labels, table):
        cells = [c.strip() for c in row.split("|")[2:-1]]
        assert cells[0] == "5" and cells[1] == "7401, 7402, 7403, 7404, 7405"
        for L, cell in zip(lengths, cells[2:]):
            v = np.array(ppl[arm, L], dtype=np.float64)
            assert cell == f"{v.mean():.3f} ± {v.std(ddof=1):.3f}", (arm, L, cell)
    assert f"| {labels['popeft']} | " + " | ".join(["1.0200 ± 0.0158"] * 5) + " |" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_i74_cpu_total_sums_records_and_the_uncounted_ledger(tmp_path, monkeypatch, capsys):
    """--cpu: the issue's CPU time is its records' run.cpu_s (search i74s-*, registered i74-*-s*) plus the ledger of
    processes no record holds. Known sums; a record without cpu_s is named and counts 0; other studies' records,
    training logs (.log.jsonl) and other i74 files are not counted; a ledger row that is not seconds is refused."""
    mod = _registered_module()
    runs = tmp_path / "docs" / "runs"
    runs.mkdir(parents=True)
    cpu = {"i74s-rope-s6001": 700.0, "i74s-yarn-n7680-lr3e-4-code-s6001": 9000.5, "i74-yarn-s7401": 11000.0}
    cpu |= {"i74-pope-s7401": 1100.0, "i60-yarn-s6001": 1e6}  # another study's record: not counted
    for name, c in cpu.items():
        (runs / f"{name}.json").write_text(json.dumps({"run": {"name": name, "cpu_s": c}}))
        (runs / f"{name}.log.jsonl").write_text(json.dumps({"iter": 0, "cpu_s": 1e6}) + "\n")
    pre = {"max_iters": 3000, "batch_size": 8, "block_size": 256, "gradient_accumulation_steps": 1}
    rope = {"run": {"name": "i74-rope-s7401"}, "config": pre}  # no cpu_s
    (runs / "i74-rope-s7401.json").write_text(json.dumps(rope))
    ft = {"max_iters": 7680, "batch_size": 8, "block_size": 1024, "gradient_accumulation_steps": 2}
    (runs / "i74-yarn-s7401.json").write_text(json.dumps({"run": {"name": "y", "cpu_s": 11000.0}, "config": ft}))
    (runs / "i74-power-val16x-pope.csv").write_text("run,ppl\nx,7.6\n")
    ledger = runs / mod.LEDGER
    header = "what,steps,cpu_s_per_step,cpu_s,note\n"
    killed = '"i74-yarn-s7401, killed process (steps 0 to 300)",300,2.0,720,x\n'  # yarn's, in its arm's line
    killed += '"i74s-yarn-n7680-lr3e-3-code-s6002, x",1,1,5,\n"i74-yarn-3840 queue, x",1,1,5,\n'  # in no arm
    ledger.write_text(
        '# a comment, "with, commas"\n' + header + '"a, killed",300,2.0,600,x\nb,0,measured,88,\n' + killed
    )
    monkeypatch.chdir(tmp_path)
    c = mod.main(["--cpu"])
    assert c["search"] == 9700.5 and c["registered"] == 12100.0 and c["uncounted"] == 1418.0
    assert c["total"] == 9700.5 + 12100.0 + 1418.0 and c["no_cpu"] == ["i74-rope-s7401.json"]
    out = capsys.readouterr().out
    assert "total: 23218 CPU-s = 6.4 core-hours" in out and "i74-rope-s7401.json" in out
    want = {"runs": 1, "cpu_s": 11000.0, "ledger_s": 720.0, "characters": [7680 * 16 * 1024]}
    assert c["arms"]["yarn"] == want | {"parent_characters": [3000 * 8 * 256]}
    assert c["arms"]["rope"] == {
        "runs": 1,
        "cpu_s": 0.0,
        "ledger_s": 0.0,
        "characters": [6144000],
        "parent_characters": [],
    }
    assert c["arms"]["pope"]["characters"] == [] and c["arms"]["popeft"]["runs"] == 0  # pope: no config
    yarn = "  yarn: 1 runs, 3.1 core-hours (3.06 per run), 125.8 M + rope's 6.1 M; the ledger's killed processes"
    assert yarn + " of its runs: 0.2 more\n" in out and "  rope: 1 runs, 0.0 core-hours (0.00 per run), 6.1 M\n" in out
    ledger.write_text(header + "b,0,measured,,\n")
    with pytest.raises(SystemExit, match=r"row 1 \('b'\): cpu_s '' is not seconds"):
        mod.main(["--cpu"])


def test_i74_registered_resume_reruns_a_parent_whose_fine_tune_a_new_machine_lost(tmp_path):
    """A session on a new machine: main holds seed 7401's RoPE, YaRN and PoPE records but not PoPE+ft's (the last
    machine ended inside it, and took out-i74/ with it). take_records copies RoPE's and YaRN's in and withholds
    PoPE's, so the lane (LANE_THREADS=2, the real lane.sh, a stub train.py) trains PoPE again and then PoPE+ft from
    it, and touches neither RoPE nor YaRN. On the same machine (PoPE's best.pt there) PoPE's record is copied in and
    only PoPE+ft runs. Against a plan that copies every landed record: PoPE+ft would be skipped (its parent has no
    metrics.json), so nothing would run."""
    import subprocess
    import sys

    mod = _registered_module()
    main_runs = tmp_path / "main-runs"
    main_runs.mkdir()
    for machine in ("new", "same"):
        wt = sandbox(tmp_path / machine)
        q = wt / "docs" / "runs" / "i74-registered.tsv"
        argv = ["--n=1", "--steps=7680", "--yarn_lr=1e-3", "--popeft_lr=3e-4", f"--out={q}"]
        subprocess.run([sys.executable, I74_REGISTERED, *argv], check=True, cwd=REPO, capture_output=True)
        rows = lines(q)
        assert [r[0] for r in rows] == ["i74-rope-s7401", "i74-yarn-s7401", "i74-pope-s7401", "i74-popeft-s7401"]
        q.write_text("\n".join("\t".join(r[:3]) for r in rows) + "\n")  # no after-commands in the sandbox
        if machine == "new":  # main's records, as the old machine's lane wrote them
            for name in ("i74-rope-s7401", "i74-yarn-s7401", "i74-pope-s7401"):
                for ext in (".json", ".log.jsonl"):
                    (main_runs / (name + ext)).write_text(json.dumps({"run": {"name": name, "machine": "old"}}))
        else:
            (wt / "out-i74" / "pope-s7401").mkdir(parents=True)
            (wt / "out-i74" / "pope-s7401" / "best.pt").write_text("weights")
            (wt / "out-i74" / "pope-s7401" / "metrics.json").write_text("{}")
        plan = mod.take_records(str(main_runs), str(wt))
        want_rerun = ["i74-pope-s7401"] if machine == "new" else []
        assert plan == {
            "copy": [n for n in ("i74-rope-s7401", "i74-yarn-s7401", "i74-pope-s7401") if n not in want_rerun],
            "rerun": want_rerun,
        }
        for name in plan["copy"]:
            assert record(wt, name)["run"]["machine"] == "old"
            assert (wt / "docs" / "runs" / f"{name}.log.jsonl").exists()
        log, _ = lane(wt, str(q), env={"LANE_THREADS": "2"})
        started = [m.split(":")[0] for m in log if m.startswith("start ")]
        assert started == ["start " + n for n in (*want_rerun, "i74-popeft-s7401")]
        assert record(wt, "i74-popeft-s7401")["run"]["name"] == "i74-popeft-s7401"
        if machine == "new":
            assert record(wt, "i74-pope-s7401")["run"]["name"] == "i74-pope-s7401"  # the new run's, not main's
            assert "machine" not in record(wt, "i74-pope-s7401")["run"]
    # the plan again after the lane: every landed record is here, nothing to copy or rerun
    assert mod.resume_plan(str(main_runs), str(tmp_path / "new")) == {"copy": [], "rerun": []}
    # PoPE+ft lands; a later session on yet another machine copies the whole block in (no best.pt needed) and runs
    # nothing
    for ext in (".json", ".log.jsonl"):
        (main_runs / f"i74-popeft-s7401{ext}").write_text(
            (tmp_path / "new" / "docs" / "runs" / f"i74-popeft-s7401{ext}").read_text()
        )
    later = sandbox(tmp_path / "later")
    (later / "docs" / "runs" / "i74-registered.tsv").write_text(
        (tmp_path / "new" / "docs" / "runs" / "i74-registered.tsv").read_text()
    )
    block = ["i74-rope-s7401", "i74-yarn-s7401", "i74-pope-s7401", "i74-popeft-s7401"]
    assert mod.take_records(str(main_runs), str(later)) == {"copy": block, "rerun": []}
    log, _ = lane(later, str(later / "docs" / "runs" / "i74-registered.tsv"), env={"LANE_THREADS": "2"})
    assert [m for m in log if m.startswith("start ")] == []


def test_i74_land_copies_new_records_with_one_bullet_each_and_flags_a_wrong_provenance(tmp_path):
    """land(): the worktree's records main lacks or holds an older version of are copied (with their curves), one
    bullet each goes at the end of the notebook (the registered runs' section), a record not at the registration's
    commit or dirty is flagged, and a second call lands nothing."""
    mod = _registered_module()
    wt_runs, main_runs = tmp_path / "wt" / "docs" / "runs", tmp_path / "main"
    wt_runs.mkdir(parents=True)
    main_runs.mkdir()

    def rec(name, commit="91ff1b1958535c", dirty=False, cpu_s=600.0):
        prov = {
            "code": {"commit": commit, "dirty": dirty},
            "device": {"cpu": "AMD EPYC", "threads": 2},
            "data": {"meta_sha256": "72b99c53259150"},
        }
        run = {"name": name, "cpu_s": cpu_s, "wall_s_processes": [300.0, 60.0], "after_done": True}
        return json.dumps({"iter_num": 3000, "provenance": prov, "run": run, "test": {"loss": 1.0}})

    (wt_runs / "i74-rope-s7401.json").write_text(rec("i74-rope-s7401"))
    (wt_runs / "i74-rope-s7401.log.jsonl").write_text("curve\n")
    (wt_runs / "i74-pope-s7401.json").write_text(rec("i74-pope-s7401", dirty=True))
    (wt_runs / "i74-yarn-s7401.json").write_text(rec("i74-yarn-s7401", commit="abcdef0"))
    (wt_runs / "i74-power-val16x-pope.csv").write_text("not a record\n")
    (main_runs / "i74-pope-s7401.json").write_text(rec("i74-pope-s7401", cpu_s=1.0))  # an older machine's
    notebook = tmp_path / "extrapolation.md"
    notebook.write_text("# x\n\n### The registered runs (issue 74)\n\n- the lane started.\n")

    names = mod.land(str(tmp_path / "wt"), str(main_runs), str(notebook), now="T0")
    assert names == ["i74-pope-s7401", "i74-rope-s7401", "i74-yarn-s7401"]
    for name in names:
        assert (main_runs / f"{name}.json").read_text() == (wt_runs / f"{name}.json").read_text()
    assert (main_runs / "i74-rope-s7401.log.jsonl").read_text() == "curve\n"
    assert not (main_runs / "i74-power-val16x-pope.csv").exists()
    bullets = notebook.read_text().split("\n- ")[2:]
    assert [b.split("`")[1] for b in bullets] == names
    by = {b.split("`")[1]: " ".join(b.split()) for b in bullets}
    assert "10.0 CPU min, wall 6.0 min over 2 process(es)" in by["i74-rope-s7401"]
    assert "names 91ff1b1, not dirty" in by["i74-rope-s7401"] and "NOT" not in by["i74-rope-s7401"]
    assert (
        "replacing main's earlier record" in by["i74-pope-s7401"] and "NOT the registration's" in by["i74-pope-s7401"]
    )
    assert "names abcdef0" in by["i74-yarn-s7401"] and "NOT the registration's" in by["i74-yarn-s7401"]
    assert "1.0" not in notebook.read_text().split("- the lane started.")[1]  # no test number
    before = notebook.read_text()
    assert mod.land(str(tmp_path / "wt"), str(main_runs), str(notebook)) == []
    assert notebook.read_text() == before
    notebook.write_text(before + "\n### Another section\n")
    (wt_runs / "i74-rope-s7402.json").write_text(rec("i74-rope-s7402"))
    with pytest.raises(SystemExit, match="last section"):
        mod.land(str(tmp_path / "wt"), str(main_runs), str(notebook))
    assert not (main_runs / "i74-rope-s7402.json").exists()
