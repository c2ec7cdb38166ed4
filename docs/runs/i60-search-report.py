"""Issue 60's search, read and decided (a notebook record, not a tool): the tables of every setting (each seed's
validation loss, their mean, the curve) and the rules fixed before the runs (docs/extrapolation.md, "The search
(issue 60)") applied to them. Reads only the validation numbers of docs/runs/i60s-*.json (metrics.json's whole
val split at the run's own context) and their curves (NAME.log.jsonl's val_loss, 20 fixed batches); never test.
From the repo root:

    python docs/runs/i60-search-report.py                       # the tables and the decisions
    python docs/runs/i60-search-report.py --png=assets/i60_search_curves.png    # and the curves

A setting is decided on only when both seeds are in; until then it is listed as pending and no rule reads it.
"""

import argparse
import glob
import json
import os
import statistics as st

SEEDS = (6001, 6002)
TOL_YARN, TOL_960, TOL_DROPE, TOL_POPE = 0.01, 0.01, 0.05, 0.01
RUNS = os.path.dirname(os.path.abspath(__file__))


def load(runs_dir):
    """{name: (config, val loss, curve [(iter, val_loss)])} for every i60s-*.json in runs_dir."""
    out = {}
    for path in sorted(glob.glob(os.path.join(runs_dir, "i60s-*.json"))):
        name = os.path.basename(path)[: -len(".json")]
        with open(path) as f:
            rec = json.load(f)
        curve = []
        log = path[: -len(".json")] + ".log.jsonl"
        if os.path.exists(log):
            with open(log) as f:
                curve = [(r["iter"], r["val_loss"]) for r in map(json.loads, f) if "val_loss" in r]
        out[name] = (rec["config"], rec["val"]["loss"], curve)
    return out


def grid(runs, prefix, key, last_step=None):
    """{setting: {seed: val}} for the runs whose name starts with prefix; key(config) -> setting. last_step, a
    dict, gets {(setting, seed): the curve's last val_loss minus the one before}."""
    g = {}
    for name, (cfg, val, curve) in runs.items():
        if name.startswith(prefix):
            g.setdefault(key(cfg), {})[cfg["seed"]] = val
            if last_step is not None and len(curve) > 1:
                last_step[(key(cfg), cfg["seed"])] = curve[-1][1] - curve[-2][1]
    return g


def complete(g):
    """{setting: mean over the seeds} for the settings with every seed in."""
    return {k: st.fmean(v[s] for s in SEEDS) for k, v in g.items() if all(s in v for s in SEEDS)}


def choose_yarn(v):
    """v {(steps, lr, ramp): mean val at 1024} -> (decision dict). The 960 row is called for when the best
    240-step v is more than 0.01 below the best 60-step v; the choice: the shortest length within 0.01 of the best
    v, at that length the lowest v; a `paper` choice names the best `code` setting of its length as secondary."""
    if sum(k[0] in (15, 60, 240) for k in v) < 12:
        return {"status": "pending: the 15-240 grid is not complete"}
    best_at = {n: min(x for k, x in v.items() if k[0] == n) for n in (60, 240)}
    need_960 = best_at[60] - best_at[240] > TOL_960
    if need_960 and sum(k[0] == 960 for k in v) < 4:
        return {"status": "pending: the 960 row is called for and not complete", "need_960": True}
    pool = {k: x for k, x in v.items() if need_960 or k[0] != 960}
    best = min(pool.values())
    cands = {k: x for k, x in pool.items() if x <= best + TOL_YARN}
    n = min(k[0] for k in cands)
    choice = min((k for k in cands if k[0] == n), key=lambda k: cands[k])
    out = {"status": "decided", "need_960": need_960, "best": best, "choice": choice, "v": v[choice]}
    if choice[2] == "paper":
        out["secondary"] = min((k for k in v if k[0] == n and k[2] == "code"), key=lambda k: v[k])
    return out


def choose_drope(gap):
    """gap {(steps, lr): mean over seeds of DroPE's val − its parent's, at 256} -> decision: the shortest
    recovered (gap <= 0.05) length, at it the lower lr; none recovered: H3 is not registered again."""
    if len(gap) < 6:
        return {"status": "pending: the DroPE grid is not complete"}
    rec = [k for k, x in gap.items() if x <= TOL_DROPE]
    if not rec:
        return {"status": "decided", "recovered": False}
    n = min(k[0] for k in rec)
    return {"status": "decided", "recovered": True, "choice": min(k for k in rec if k[0] == n)}


def choose_pope(v, what="PoPE"):
    """v {lr: mean val at 256} -> 1e-3 unless another lr's v is lower by more than 0.01 (then the lowest). The same
    rule picks RoPE's pretraining lr (the amendment: YaRN's parent gets PoPE's search)."""
    if len(v) < 3:
        return {"status": f"pending: the {what} lr grid is not complete"}
    lr, x = min(v.items(), key=lambda kv: kv[1])
    return {"status": "decided", "choice": lr if v[1e-3] - x > TOL_POPE else 1e-3}


def table(title, g, fmt, last_step):
    """One row per setting: each seed's val loss, the mean, and each seed's last change of the curve (the val loss
    at its last evaluation minus the one before: negative while it is still falling)."""
    print(f"\n{title}\n")
    print("| setting | " + " | ".join(f"val s{s}" for s in SEEDS) + " | mean | curve's last change per seed |")
    print("|---|" + "---:|" * (len(SEEDS) + 1) + "---|")
    for k in sorted(g):
        vals = [g[k].get(s) for s in SEEDS]
        cells = [f"{x:.4f}" if x is not None else "pending" for x in vals]
        mean = f"{st.fmean(vals):.4f}" if None not in vals else "—"
        slope = " / ".join(f"{last_step[(k, s)]:+.4f}" if (k, s) in last_step else "—" for s in SEEDS)
        print(f"| {fmt(k)} | " + " | ".join(cells) + f" | {mean} | {slope} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default=RUNS)
    p.add_argument("--png", default="")
    a = p.parse_args()
    runs = load(a.runs)
    parents = {cfg["seed"]: val for n, (cfg, val, _) in runs.items() if n.startswith("i60s-rope-s")}  # lr 1e-3
    last = {arm: {} for arm in ("yarn", "drope", "pope", "rope")}  # one per grid: PoPE's and RoPE's keys coincide
    yarn = grid(runs, "i60s-yarn-", lambda c: (c["max_iters"], c["learning_rate"], c["rope_yarn_ramp"]), last["yarn"])
    drope = grid(runs, "i60s-drope-", lambda c: (c["max_iters"], c["learning_rate"]), last["drope"])
    pope = grid(runs, "i60s-pope-", lambda c: c["learning_rate"], last["pope"])
    rope = grid(runs, "i60s-rope-", lambda c: c["learning_rate"], last["rope"])  # the parents (1e-3), the amendment
    print("RoPE parents (val at 256): " + ", ".join(f"s{s} {x:.4f}" for s, x in sorted(parents.items())))
    table("RoPE + YaRN, val loss at 1024 (nats)", yarn, lambda k: f"{k[0]} steps, lr {k[1]:g}, {k[2]}", last["yarn"])
    table("DroPE, val loss at 256 (nats)", drope, lambda k: f"{k[0]} steps, lr {k[1]:g}", last["drope"])
    table("PoPE, val loss at 256 (nats)", pope, lambda k: f"lr {k:g}", last["pope"])
    table("RoPE (YaRN's parent), val loss at 256 (nats)", rope, lambda k: f"lr {k:g}", last["rope"])
    gap = {
        k: st.fmean(x[s] - parents[s] for s in SEEDS)
        for k, x in drope.items()
        if all(s in x and s in parents for s in SEEDS)
    }
    print("\nDroPE − its parent, mean over seeds: " + ", ".join(f"{k}: {x:+.4f}" for k, x in sorted(gap.items())))
    print("\nDecisions (the rules of docs/extrapolation.md, issue 60):")
    print(f"- YaRN: {choose_yarn(complete(yarn))}")
    print(f"- DroPE: {choose_drope(gap)}")
    print(f"- PoPE: {choose_pope(complete(pope))}")
    print(f"- RoPE (the amendment): {choose_pope(complete(rope), 'RoPE')}")
    if a.png:
        plot(runs, a.png)


def plot(runs, png):
    """Every run's validation curve, three panels. YaRN and DroPE: colour = length, line = lr (YaRN's marker: the
    ramp), so 32 and 12 runs read from a short legend; the DroPE panel's dashed lines: each of the two parents'
    val + 0.05 (the recovery the rule asks for), one per parent. The y range shows every curve to its last step
    (the step-0 losses, 1.9 and 4.9, are cut: they would flatten the part the rules read)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    colour = {n: f"C{i}" for i, n in enumerate((15, 60, 240, 960, 1500))}
    style = {1e-4: ":", 3e-4: "-", 1e-3: "-"}
    panels = (
        ("i60s-yarn-", "RoPE + YaRN: val loss at 1024", (1.54, 1.75)),
        ("i60s-drope-", "DroPE: val loss at 256", (1.5, 2.7)),
        ("i60s-", "PoPE and RoPE pretraining: val loss at 256", (1.5, 2.2)),
    )
    for ax, (prefix, title, ylim) in zip(axes, panels):
        for name, (cfg, _, curve) in sorted(runs.items()):
            if not (name.startswith(prefix) and curve):
                continue
            if prefix == "i60s-":
                if name.startswith(("i60s-pope-", "i60s-rope-")):
                    ax.plot(*zip(*curve), marker=".", lw=1, label=name[len(prefix) :])
                continue
            drope = prefix == "i60s-drope-"
            ls = {3e-4: ":", 1e-3: "-"}[cfg["learning_rate"]] if drope else style[cfg["learning_rate"]]
            marker = "." if drope or cfg["rope_yarn_ramp"] == "code" else "x"
            ax.plot(*zip(*curve), c=colour[cfg["max_iters"]], ls=ls, marker=marker, ms=4, lw=1)
        handles = []
        if prefix == "i60s-yarn-":
            handles = [Line2D([], [], c=colour[n], label=f"{n} steps") for n in (15, 60, 240, 960)]
            handles += [Line2D([], [], c="k", ls=ls, label=f"lr {lr:g}") for lr, ls in ((1e-4, ":"), (3e-4, "-"))]
            handles += [
                Line2D([], [], c="k", marker=m, ls="", label=f"ramp {r}") for r, m in (("code", "."), ("paper", "x"))
            ]
        if prefix == "i60s-drope-":
            handles = [Line2D([], [], c=colour[n], label=f"{n} steps") for n in (60, 240, 1500)]
            handles += [Line2D([], [], c="k", ls=ls, label=f"lr {lr:g}") for lr, ls in ((3e-4, ":"), (1e-3, "-"))]
            for i, name in enumerate(sorted(n for n in runs if n.startswith("i60s-rope-s"))):  # the parents (lr 1e-3)
                val = runs[name][1]
                ax.axhline(val + TOL_DROPE, ls="--", c=("k", "0.5")[i % 2], lw=0.9)
                handles.append(Line2D([], [], c=("k", "0.5")[i % 2], ls="--", label=f"parent {name[10:]} + 0.05"))
        ax.set(title=title, xlabel="optimizer step", ylabel="val loss (nats, 20 batches)", ylim=ylim)
        where = "center left" if prefix == "i60s-drope-" else "upper right"  # clear of every curve
        ax.legend(handles=handles or None, fontsize=7, loc=where, ncol=1 if handles else 2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
