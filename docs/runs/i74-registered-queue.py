"""Issue 74's registered queue (docs/extrapolation.md, "The headline at equal budget (issue 74)"), written from the
repo root with YaRN's step count N (the doubling rule), the lrs the search chose at N and the n of the power rule:

    python docs/runs/i74-registered-queue.py --n=5 --steps=7680 --yarn_lr=3e-4 --popeft_lr=3e-4
    # -> docs/runs/i74-registered.tsv
    python docs/runs/i74-registered-queue.py --verdicts   # once every registered run is in: H2a, H2b (Holm), H2c
    python docs/runs/i74-registered-queue.py --cpu        # the issue's CPU time: records + uncounted ledger; per arm
    python docs/runs/i74-registered-queue.py --take_records MAIN_RUNS WORKTREE   # i74-registered-resume.sh's step
    python docs/runs/i74-registered-queue.py --land /work/wt-i74r   # the lane's new records into main, with bullets

One block per seed (7401, 7402, ...: no other study's), in order: RoPE pretraining, YaRN (ramp `code`) from it, PoPE
pretraining, PoPE+ft from it (each parent directly before its fine-tune: BLOCK). The pretrainings are issue 60's
registered recipes (both lr 2e-3, min_lr 2e-4, the lrs chosen on validation; YaRN's search ran from RoPE parents at
1e-3, issue 60's caveat 1); both fine-tunes run N steps at the same batch with the search's schedule
(docs/runs/i74-search-queue.py: warmup 4 % of the steps rounded up, constant lr, evaluations every N / 16 steps).
Every run is scored tiled at 256, 512, 1024, 2048 and 4096 over the whole test split (--max_tokens=0: every
4097-character chunk; --one_document: the split read as one document, as issues 54 and 60 read it, though meta.json
now declares its two works), the arms' table at 1x-16x; H2a and H2b read ppl at 4096 (16x), H2c the fine-tunes' test
loss at their block_size, 1024 (4x). --verdicts runs ANALYSIS's H2 commands through study/results.py's compare() and
prints the exact permutation p at full precision (the table rounds to 3 decimals, which at n = 6 prints 46 / 924 =
0.0498 as 0.050), the Holm-adjusted p and each verdict, and H2c's TOST.
"""

import argparse
import csv
import filecmp
import glob
import json
import math
import os
import re
import shlex
import shutil
import sys

H = "\t"
SEED0 = 7401
ARMS = ("rope", "pope", "yarn", "popeft")
# A block's order in the queue: each parent directly followed by its fine-tune, so that a session's end (and a
# new machine at the next) catches at most one parent whose fine-tune has not landed (the rule that a parent and
# its fine-tune share a machine: resume_plan()).
BLOCK = ("rope", "yarn", "pope", "popeft")
PARENT = {"yarn": "rope", "popeft": "pope"}
RECORD_FILES = (".json", ".log.jsonl", ".extrapolation.csv")  # what study/lane.sh writes to docs/runs per run
LRS = ("1e-4", "3e-4", "1e-3", "3e-5", "3e-3")  # the search's grid at N, and the edge rule's one step past it
# The registered analysis, run once when the last registered run is in (docs/extrapolation.md, the amendment of
# issue 74's rules). Arm A is the PoPE arm, so B - A is YaRN minus it. The fine-tunes differ from their parents'
# recipe in the settings ALLOW names (YaRN's scaling, the fine-tune's context and schedule): part of each method.
ALLOW = (
    "block_size,eval_interval,learning_rate,log_interval,lr_decay_iters,max_iters,min_lr,"
    "rope_original_block_size,rope_scaling,rope_yarn_ramp,warmup_iters"
)
LEDGER = "i74-cpu-uncounted.csv"  # CPU time no record holds (killed processes, hand-run work), in docs/runs
LENGTHS = "4096,256,512,1024,2048"  # the first, 4096 (16x), is the primary's row
ANALYSIS = {
    "table": f"python study/results.py docs/runs/i74-*-s*.json --by=pos_encoding,block_size --extrapolation={LENGTHS}",
    # H2a: the row 'ppl at 4096 (tiled, one document)', its exact permutation p; Holm over H2a and H2b (--verdicts)
    "H2a": "python study/results.py docs/runs/i74-pope-s*.json docs/runs/i74-yarn-s*.json --compare=pos_encoding "
    f"--decide=perm --allow={ALLOW} --extrapolation={LENGTHS}",
    # H2b: the same row; H2c: the TOST line (test loss at 1024, both arms' own block_size)
    "H2b,H2c": "python study/results.py docs/runs/i74-popeft-s*.json docs/runs/i74-yarn-s*.json --compare=pos_encoding "
    f"--decide=perm --allow={ALLOW} --extrapolation={LENGTHS} --tost=0.05",
    "RoPE-PoPE (no verdict)": "python study/results.py docs/runs/i74-rope-s*.json docs/runs/i74-pope-s*.json "
    f"--compare=pos_encoding --extrapolation={LENGTHS}",
}


def holm_adjusted(p_h2a, p_h2b):
    """Holm-adjusted p of the two primaries: the smaller p doubled, the other the larger of itself and that.
    Returns {"H2a": p, "H2b": p}."""
    (first, p1), (second, p2) = sorted({"H2a": p_h2a, "H2b": p_h2b}.items(), key=lambda kv: kv[1])
    a1 = min(1.0, 2 * p1)
    return {first: a1, second: max(a1, p2)}


def holm(p_h2a, p_h2b, alpha=0.05):
    """Holm's step-down verdicts over the two primaries, each adjusted p below alpha: the smaller p separated below
    alpha / 2 (0.025), then the other below alpha; neither if the first is not. Returns {"H2a": bool, "H2b": bool}."""
    return {h: p < alpha for h, p in holm_adjusted(p_h2a, p_h2b).items()}


def _compare(cmd):
    """study/results.py's compare() on one ANALYSIS command (its runs' globs expanded from the current folder)."""
    import results

    words = shlex.split(cmd)[2:]  # after "python study/results.py"
    flags = dict(w[2:].split("=", 1) for w in words if w.startswith("--"))
    runs = [r for w in words if not w.startswith("--") for r in sorted(glob.glob(w))]
    tost = float(flags["tost"]) if "tost" in flags else None
    lengths = results.parse_lengths(flags["extrapolation"])
    allow = flags["allow"].split(",")
    return results.compare(runs, flags["compare"], "test", lengths, None, (), allow, tost, flags["decide"])


def _importable():
    """The repo root and study/ on sys.path (results.py, cli.py), from wherever this file is run."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for path in (os.path.join(root, "study"), root):
        if path not in sys.path:
            sys.path.insert(0, path)


def verdicts():
    """The registered verdicts from the records in docs/runs (run from the repo root): {"p": exact permutation p of
    ppl at 4096 per primary, "holm": holm(), "holm_p": holm_adjusted(), "tost": H2c's results.compare TOST dict}."""
    _importable()
    p, tost = {}, None
    for what, key in (("H2a", "H2a"), ("H2b", "H2b,H2c")):
        c = _compare(ANALYSIS[key])
        (row,) = [r for r in c["rows"] if r["metric"].startswith("ppl at 4096 ")]
        p[what] = row["rank"][0]
        tost = c["tost"] if what == "H2b" else tost
    return {"p": p, "holm": holm(p["H2a"], p["H2b"]), "holm_p": holm_adjusted(p["H2a"], p["H2b"]), "tost": tost}


def cpu_total(folder="docs/runs"):
    """Issue 74's CPU time (user + system, seconds) from the files in `folder`: {"search": the i74s-*.json records'
    run.cpu_s summed, "registered": the i74-*-s*.json records', "uncounted": LEDGER's cpu_s column (processes no
    record holds), "total": the three summed, "no_cpu": the records without cpu_s, which count as 0, "arms": per
    registered arm (ARMS) {"runs": records, "cpu_s": their cpu_s summed, "ledger_s": the ledger's rows whose
    `what` starts with one of its runs' names (i74-ARM-sSEED: a registered run's killed process), "characters": the
    characters one run trains on, sorted distinct values of max_iters x batch_size x gradient_accumulation_steps x
    block_size (one process, as every registered run), "parent_characters": the same of its parent's arm (PARENT; []
    for a pretraining)}}. Raises SystemExit naming the row of a ledger cpu_s that is not a number."""
    out, no_cpu = {}, []
    arms = {arm: {"runs": 0, "cpu_s": 0.0, "ledger_s": 0.0, "characters": set()} for arm in ARMS}
    for part, pattern in (("search", "i74s-*.json"), ("registered", "i74-*-s*.json")):
        out[part] = 0.0
        for path in sorted(glob.glob(os.path.join(folder, pattern))):
            with open(path) as f:
                record = json.load(f)
            cpu = (record.get("run") or {}).get("cpu_s")
            if cpu is None:
                no_cpu.append(os.path.basename(path))
            out[part] += cpu or 0.0
            arm = os.path.basename(path).split("-")[1]
            if part == "registered" and arm in arms:
                arms[arm]["runs"] += 1
                arms[arm]["cpu_s"] += cpu or 0.0
                c = record.get("config") or {}
                if c:
                    steps = c["max_iters"] * c["batch_size"] * c.get("gradient_accumulation_steps", 1)
                    arms[arm]["characters"].add(steps * c["block_size"])
    for a in arms.values():
        a["characters"] = sorted(a["characters"])
    for arm, a in arms.items():
        a["parent_characters"] = arms[PARENT[arm]]["characters"] if arm in PARENT else []
    out["arms"] = arms
    with open(os.path.join(folder, LEDGER)) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    out["uncounted"] = 0.0
    for i, row in enumerate(rows, 1):
        try:
            out["uncounted"] += float(row["cpu_s"])
        except (TypeError, ValueError):
            bad = f"{LEDGER}, row {i} ({row.get('what')!r}): cpu_s {row.get('cpu_s')!r} is not seconds"
            raise SystemExit(bad) from None
        run = re.match(rf"i74-({'|'.join(ARMS)})-s\d+\b", row.get("what") or "")  # "i74-popeft-s7404, killed ..."
        if run:
            arms[run[1]]["ledger_s"] += float(row["cpu_s"])
    out["total"] = out["search"] + out["registered"] + out["uncounted"]
    out["no_cpu"] = no_cpu
    return out


def resume_plan(main_runs, worktree, queue="docs/runs/i74-registered.tsv"):
    """Which of main's registered records a session's worktree of the registration commit takes in before its lane
    starts (docs/runs/i74-registered-resume.sh). A record in main and not in the worktree is copied in (so the lane
    skips its run), except a parent's (RoPE or PoPE at seed s) whose fine-tune (YaRN or PoPE+ft at s) has no record
    in main and whose checkpoint the worktree lacks (out-i74/ARM-sS/best.pt: a new machine). That parent runs again
    through the lane, so that its fine-tune starts from the run it descends from and whose scores stand for the
    parent's arm (a parent retrained on another CPU differs at float32 rounding); the new record replaces main's when
    it lands. `main_runs`: main's docs/runs folder; `worktree`: the worktree's root (its `queue` lists the runs).
    Returns {"copy": [NAME, ...], "rerun": [NAME, ...]}, in queue order. Raises SystemExit if the queue is missing."""
    path = os.path.join(worktree, queue)
    if not os.path.exists(path):
        raise SystemExit(f"{path} is missing: is {worktree} a checkout of the registration commit?")
    with open(path) as f:
        rows = [line.rstrip("\n").split(H) for line in f if line.strip() and not line.startswith("#")]
    out_dir = {r[0]: r[1] for r in rows}
    landed = {name for name in out_dir if os.path.exists(os.path.join(main_runs, name + ".json"))}
    child_of = {parent: child for child, parent in PARENT.items()}
    plan = {"copy": [], "rerun": []}
    for name in out_dir:
        if name not in landed or os.path.exists(os.path.join(worktree, "docs", "runs", name + ".json")):
            continue
        arm, seed = name.split("-")[1], name.rsplit("-s", 1)[1]
        child = child_of.get(arm)
        if (
            child
            and f"i74-{child}-s{seed}" not in landed
            and not os.path.exists(os.path.join(worktree, out_dir[name], "best.pt"))
        ):
            plan["rerun"].append(name)
        else:
            plan["copy"].append(name)
    return plan


def take_records(main_runs, worktree):
    """resume_plan() carried out: copies each record to copy (RECORD_FILES, those main has) into the worktree's
    docs/runs and prints what it did. Returns the plan."""
    plan = resume_plan(main_runs, worktree)
    for name in plan["copy"]:
        for ext in RECORD_FILES:
            src = os.path.join(main_runs, name + ext)
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(worktree, "docs", "runs", name + ext))
        print(f"copied in {name}")
    for name in plan["rerun"]:
        print(f"rerun {name}: its fine-tune has not landed and this machine lacks its best.pt (a new machine)")
    return plan


def land(worktree, main_runs, notebook, commit="91ff1b1", meta_sha256="72b99c53", now=None):
    """Lands the registered records the worktree's lane has written and main lacks (or holds an older version of,
    a parent rerun on a new machine): copies RECORD_FILES (those the worktree has, the record last) into
    `main_runs` and appends one bullet per run to `notebook` (docs/extrapolation.md, whose last section is the
    registered runs' record): steps, CPU and wall minutes, the CPU, threads, and whether the record names the
    registration `commit`, not dirty, with the search's data (`meta_sha256`, a prefix); it prints no test number.
    `now`: the bullet's time (default: the clock, UTC). Returns the landed names, in sorted order; [] when there is
    none. Raises SystemExit if the notebook's last section is not the registered runs' record."""
    import textwrap
    import time

    names = []
    for src in sorted(glob.glob(os.path.join(worktree, "docs", "runs", "i74-*-s*.json"))):
        dst = os.path.join(main_runs, os.path.basename(src))
        if not os.path.exists(dst) or not filecmp.cmp(src, dst, shallow=False):
            names.append(os.path.basename(src)[: -len(".json")])
    if not names:
        return []
    head = "### The registered runs (issue 74)"
    with open(notebook) as f:
        text = f.read()
    if text.count(head) != 1 or "\n#" in text.split(head, 1)[1]:
        raise SystemExit(f"{notebook}: its last section is not '{head}', where the records' bullets go")
    now = now or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    said = []
    for name in names:
        replaced = os.path.exists(os.path.join(main_runs, name + ".json"))
        for ext in sorted(RECORD_FILES, key=lambda e: e == ".json"):  # the record last: it marks the run landed
            src = os.path.join(worktree, "docs", "runs", name + ext)
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(main_runs, name + ext))
        with open(os.path.join(main_runs, name + ".json")) as f:
            m = json.load(f)
        prov, run = m["provenance"], m["run"]
        ok = (
            prov["code"]["commit"].startswith(commit)
            and not prov["code"]["dirty"]
            and prov["data"]["meta_sha256"].startswith(meta_sha256)
        )
        bullet = (
            f"- {now}, `{name}` in"
            + (" (replacing main's earlier record: a parent run again)" if replaced else "")
            + f": {m['iter_num']} steps, {run['cpu_s'] / 60:.1f} CPU min, wall {sum(run['wall_s_processes']) / 60:.1f}"
            f" min over {len(run['wall_s_processes'])} process(es), on an {prov['device']['cpu']} at "
            f"{prov['device']['threads']} threads; the record names {prov['code']['commit'][:7]}, "
            f"{'dirty' if prov['code']['dirty'] else 'not dirty'}, "
            f"data meta sha256 {prov['data']['meta_sha256'][:8]}..., "
            f"evaluations run: {str(run['after_done']).lower()}. No test number read."
            + ("" if ok else f" NOT the registration's code or data ({commit}, {meta_sha256}...): see the record.")
        )
        text = (
            text.rstrip("\n")
            + "\n"
            + textwrap.fill(bullet, 117, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False)
            + "\n"
        )
        said.append(f"landed {name}" + ("" if ok else " (provenance mismatch)"))
    with open(notebook + ".tmp", "w") as f:
        f.write(text)
    os.replace(notebook + ".tmp", notebook)
    print("\n".join(said))  # after the notebook is written: a reader that stops early (grep -q) loses nothing
    return names


def after(out):
    """The registered evaluation: tiled at 1x-16x over the whole test split."""
    return (
        f"python eval_extrapolate.py {out} --dataset=shakespeare_char --lengths=256,512,1024,2048,4096 "
        f"--max_tokens=0 --one_document --out_dir={out}/extrapolate --device=cpu"
    )


def args(arm, seed, steps, lr):
    """train.py's arguments of one arm's run at seed (lr: the fine-tune's; pretraining lrs are fixed)."""
    if arm == "rope":
        return f"--pos_encoding=rope --seed={seed} --learning_rate=2e-3 --min_lr=2e-4"
    if arm == "pope":
        return f"--seed={seed} --learning_rate=2e-3 --min_lr=2e-4"
    if arm == "yarn":
        head = f"config/finetune_shakespeare_char_yarn.py --rope_yarn_ramp=code --init_ckpt=out-i74/rope-s{seed}"
    else:
        head = f"config/finetune_shakespeare_char_pope.py --init_ckpt=out-i74/pope-s{seed}"
    warm, ev = math.ceil(0.04 * steps), steps // 16
    return (
        f"{head}/best.pt --seed={seed} --max_iters={steps} --lr_decay_iters={steps} --warmup_iters={warm} "
        f"--learning_rate={lr} --min_lr={lr} --eval_interval={ev} --log_interval={ev}"
    )


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    if argv == ["--verdicts"]:
        _importable()
        from cli import UserError

        try:
            v = verdicts()
        except UserError as e:
            raise SystemExit(f"error: {e}") from None
        for h in ("H2a", "H2b"):
            print(
                f"{h}: exact permutation p {v['p'][h]!r}, Holm-adjusted {v['holm_p'][h]!r}: "
                + ("separated" if v["holm"][h] else "not separated")
            )
        t = v["tost"]
        print(
            f"H2c: TOST ±{t['margin']:g} on the {t['metric']}, B − A {t['diff']!r}, 90 % CI {t['ci90']}, "
            f"p {t['p']!r}: " + ("equivalent" if t["p"] < 0.05 else "not shown equivalent")
        )
        return v
    if len(argv) == 3 and argv[0] == "--take_records":  # docs/runs/i74-registered-resume.sh: MAIN_RUNS WORKTREE
        return take_records(argv[1], argv[2])
    if len(argv) == 2 and argv[0] == "--land":  # from main's root: WORKTREE (see land(); the session commits)
        return land(argv[1], "docs/runs", "docs/extrapolation.md")
    if len(argv) == 3 and argv[0] == "--resume_plan":  # the same, only said (its DRY=1)
        plan = resume_plan(argv[1], argv[2])
        print(plan)
        return plan
    if argv == ["--cpu"]:
        c = cpu_total()
        for part in ("search", "registered", "uncounted", "total"):
            print(f"{part}: {c[part]:.0f} CPU-s = {c[part] / 3600:.1f} core-hours")
        if c["no_cpu"]:
            print("records without cpu_s (counted as 0): " + ", ".join(c["no_cpu"]))
        print("registered, per arm: runs, CPU, characters per run (a fine-tune's after its parent's)")
        for arm, a in c["arms"].items():
            chars = "/".join(f"{x / 1e6:.1f} M" for x in a["characters"]) or "-"
            parent = "/".join(f"{x / 1e6:.1f} M" for x in a["parent_characters"])
            per_run = a["cpu_s"] / a["runs"] / 3600 if a["runs"] else 0.0
            print(
                f"  {arm}: {a['runs']} runs, {a['cpu_s'] / 3600:.1f} core-hours ({per_run:.2f} per run), {chars}"
                + (f" + {PARENT[arm]}'s {parent}" if parent else "")
                + (
                    f"; the ledger's killed processes of its runs: {a['ledger_s'] / 3600:.1f} more"
                    if a["ledger_s"]
                    else ""
                )
            )
        return c
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, required=True, help="seeds per arm, from the registration's power rule")
    ap.add_argument("--steps", type=int, required=True, help="N, YaRN's step count (the doubling rule)")
    ap.add_argument(
        "--yarn_lr",
        required=True,
        help="YaRN's lr at N, chosen on validation (1e-4, 3e-4, 1e-3; 3e-5, 3e-3 by the edge rule)",
    )
    ap.add_argument("--popeft_lr", required=True, help="PoPE+ft's lr at N, chosen on validation")
    ap.add_argument("--out", default="docs/runs/i74-registered.tsv")
    a = ap.parse_args(argv)
    if a.n < 1 or a.steps < 16 or {a.yarn_lr, a.popeft_lr} - set(LRS):
        raise SystemExit(
            "--n >= 1, --steps >= 16, and each lr one of the search's: 1e-4, 3e-4, 1e-3, or the edge rule's 3e-5, 3e-3"
        )
    lr = {"rope": None, "pope": None, "yarn": a.yarn_lr, "popeft": a.popeft_lr}
    lines = []
    for s in range(SEED0, SEED0 + a.n):
        for arm in BLOCK:
            name, out = f"i74-{arm}-s{s}", f"out-i74/{arm}-s{s}"
            lines.append(H.join((name, out, args(arm, s, a.steps, lr[arm]), after(out))))
    head = (
        '# issue 74, the registered comparison (docs/extrapolation.md, "The headline at equal budget"): seeds '
        f"{SEED0} .. {SEED0 + a.n - 1},\n# one block per seed in order. Arms: RoPE (lr 2e-3), PoPE (lr 2e-3), "
        f"YaRN ({a.steps} steps, lr {a.yarn_lr}, ramp code), PoPE+ft ({a.steps} steps, lr {a.popeft_lr}).\n"
        "# Every run scored tiled at 1x-16x over the whole test split. Written by docs/runs/i74-registered-queue.py\n"
        f"# --n={a.n} --steps={a.steps} --yarn_lr={a.yarn_lr} --popeft_lr={a.popeft_lr}. One lane on both cores,\n"
        "# each parent followed by its fine-tune; started each session from main's root, with this commit:\n"
        "#   nohup bash docs/runs/i74-registered-resume.sh COMMIT > /work/i74-registered-resume.log 2>&1 &\n"
    )
    with open(a.out, "w") as f:
        f.write(head + "\n".join(lines) + "\n")
    print(f"wrote {a.out}: {len(lines)} runs; the registered analysis, once they are all in:")
    for what, cmd in ANALYSIS.items():
        print(f"  {what}: {cmd}")


if __name__ == "__main__":
    main()
