"""Issues 54's and 60's per-arm tables and plot (a notebook record, not a tool): perplexity against context for
the arms of a registered comparison (issue 54: RoPE, PoPE, RoPE + YaRN, DroPE; issue 60: RoPE, PoPE, RoPE + YaRN
at their searched recipes), mean ± sd over seeds per length, from the runs' copies in docs/runs/. The registered
tests are study/results.py's (docs/extrapolation.md, issues 54 and 60);
this prints what results.py does not read: the loss on the last 256 characters per length (eval_extrapolate.py's
last_loss) and the sliding protocol at 16x (NAME.sliding.csv), and draws the plot (log-log: each arm's mean ± sd
per length and every run as a dot). From the repo root:

    python docs/runs/i54-report.py                         # the registered runs: i54-{rope,pope,yarn,drope}-s*
    python docs/runs/i54-report.py --prefix=i54-pilot --png=/tmp/pilot.png   # the pilot
    python docs/runs/i54-report.py --prefix=i60 --png=assets/extrapolation_i60_cpu.png   # issue 60's registered runs
    python docs/runs/i54-report.py --prefix=i74 --png=assets/extrapolation_i74_cpu.png   # issue 74's: + PoPE+ft
"""

import argparse
import csv
import glob
import os
import re
import statistics as st

ARMS = [
    ("rope", "RoPE"),
    ("pope", "PoPE (δ at zero)"),
    ("yarn", "RoPE + YaRN (s = 4, 15-step fine-tune at 4x)"),
    ("drope", "DroPE (60-step recalibration)"),
]
ARMS_I60 = [  # issue 60: the recipes its search chose on validation (docs/extrapolation.md); no DroPE arm
    ("rope", "RoPE (lr 2e-3)"),
    ("pope", "PoPE (δ at zero, lr 2e-3)"),
    ("yarn", "RoPE + YaRN (s = 4, 960-step fine-tune at 4x, lr 3e-4)"),
]
ARMS_I74 = [  # issue 74: YaRN and PoPE+ft on one budget; their steps and lr are read from the records
    ("rope", "RoPE (lr 2e-3)"),
    ("pope", "PoPE (δ at zero, lr 2e-3)"),
    ("yarn", "RoPE + YaRN (s = 4, {max_iters}-step fine-tune at 4x, lr {lr})"),
    ("popeft", "PoPE+ft ({max_iters}-step fine-tune at 4x, lr {lr})"),
]


def read(path):
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("length")]


def pm(xs, digits):
    if not xs:
        return "—"
    return f"{st.fmean(xs):.{digits}f} ± " + (f"{st.stdev(xs):.{digits}f}" if len(xs) > 1 else "—")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prefix", default="i54")
    p.add_argument("--runs", default=os.path.join(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--png", default="")
    p.add_argument("--seeds", default="", help="comma-separated seeds to keep (default: every seed found)")
    a = p.parse_args()
    keep = {s.strip() for s in a.seeds.split(",") if s.strip()}
    arms = list({"i60": ARMS_I60, "i74": ARMS_I74}.get(a.prefix, ARMS))
    if a.prefix == "i74":  # the fine-tunes' steps and lr, from the first record of each arm (the queue's, one value)
        import json

        for i, (arm, label) in enumerate(arms):
            first = sorted(glob.glob(os.path.join(a.runs, f"i74-{arm}-s*.json")))
            if "{" in label and first:
                with open(first[0]) as f:
                    cfg = json.load(f)["config"]
                lr = f"{cfg['learning_rate']:.0e}".replace("e-0", "e-")  # 3e-4, as the queues write it
                arms[i] = (arm, label.format(max_iters=cfg["max_iters"], lr=lr))
    data = {}
    for arm, _ in arms:
        runs = {}
        for path in sorted(glob.glob(os.path.join(a.runs, f"{a.prefix}-{arm}-s*.extrapolation.csv"))):
            seed = re.search(r"-s(\d+)\.extrapolation\.csv$", path).group(1)
            if keep and seed not in keep:
                continue
            sliding = path.replace(".extrapolation.csv", ".sliding.csv")
            runs[seed] = {"tiled": read(path), "sliding": read(sliding) if os.path.exists(sliding) else []}
        data[arm] = runs
    lengths = sorted({int(r["length"]) for runs in data.values() for run in runs.values() for r in run["tiled"]})
    print("| arm | n | seeds | " + " | ".join(f"ppl at {L}" for L in lengths) + " | sliding ppl at 4096 |")
    print("|---|---:|---|" + "---:|" * (len(lengths) + 1))
    for arm, label in arms:
        runs = data[arm]
        cells = [
            pm([float(r["ppl"]) for run in runs.values() for r in run["tiled"] if int(r["length"]) == L], 3)
            for L in lengths
        ]
        sl = [float(r["ppl"]) for run in runs.values() for r in run["sliding"] if int(r["length"]) == 4096]
        print(
            f"| {label} | {len(runs)} | {', '.join(runs)} | " + " | ".join(cells) + f" | {pm(sl, 3)} (n = {len(sl)}) |"
        )
    print("\nloss (nats) on the last 256 characters of each chunk, the same characters at every length")
    print("| arm | " + " | ".join(f"at {L}" for L in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    for arm, label in arms:
        runs = data[arm]
        cells = [
            pm([float(r["last_loss"]) for run in runs.values() for r in run["tiled"] if int(r["length"]) == L], 4)
            for L in lengths
        ]
        print(f"| {label} | " + " | ".join(cells) + " |")
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.6))
        for k, ((arm, label), marker) in enumerate(zip(arms, "osD^")):
            runs = data[arm]
            if not runs:
                continue
            xs, ms, sds, dots = [], [], [], []
            for L in lengths:
                v = [float(r["ppl"]) for run in runs.values() for r in run["tiled"] if int(r["length"]) == L]
                if v:
                    xs.append(L), ms.append(st.fmean(v)), sds.append(st.stdev(v) if len(v) > 1 else 0.0)
                    dots += [(L * 2 ** (0.08 + 0.03 * k), y) for y in v]  # beside the mean, each arm a little apart
            line = ax.errorbar(xs, ms, yerr=sds, marker=marker, capsize=3, label=f"{label}, n = {len(runs)}")
            lo, hi = [m - s for m, s in zip(ms, sds)], [m + s for m, s in zip(ms, sds)]
            ax.fill_between(xs, lo, hi, color=line[0].get_color(), alpha=0.12, linewidth=0)  # the mean ± sd band
            ax.scatter(*zip(*dots), s=9, alpha=0.45, color=line[0].get_color(), linewidths=0, zorder=3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        from matplotlib.ticker import FormatStrFormatter

        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.set_xticks(lengths, [f"{L}\n({L // lengths[0]}x)" for L in lengths])
        ax.set_xlabel("context (characters, log scale; training context 256)")
        ax.set_ylabel("tiled perplexity (log scale): mean ± sd, dots: runs")
        ax.set_title(
            "Character-level Shakespeare, 4 x 128: perplexity against context\n"
            "RoPE, PoPE as trained at 256; "
            + ("YaRN and DroPE" if any(arm == "drope" for arm, _ in arms) else "YaRN")
            + " fine-tuned from RoPE"
            + (", PoPE+ft from PoPE" if any(arm == "popeft" for arm, _ in arms) else ""),
            fontsize=10,
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.png, dpi=120)
        print(f"\nwrote {a.png}")


if __name__ == "__main__":
    main()
