"""One table of finished runs: mean ± sd over seeds for each group of runs that share their settings.

    python results.py out/ablation/*/                                  # run folders (train.py out_dir)
    python results.py docs/runs/abl-*.json --extrapolation=4096        # copies of metrics.json, + ppl at 4096
    python results.py docs/runs/jsb-*.json --by=pos_encoding --csv     # choose the grouping; CSV on stdout

Inputs: run folders, each with the metrics.json that train.py writes at the end of a run, and/or JSON
files that are copies of one (docs/runs/NAME.json, written by docs/runs/lane.sh: metrics.json plus a
"run" entry {name, out_dir, wall_s_processes, cpu_s}). A run's settings are metrics.json's "config"
(every train.py setting; train.py writes it since commit 7a6c53b). Without it they are read from the
"config" of the run's best.pt: FOLDER/best.pt, or for a JSON file the checkpoint that metrics.json
names ("checkpoint"), else <run.out_dir>/best.pt.

Groups: runs are grouped by the settings whose values differ between them, leaving out IGNORED
(bookkeeping that does not change what is trained: seed, out_dir, wandb_*, init_from, ...), so seeds of
one setting fall into one group; a setting missing from a run's config (older train.py) counts as the
value "(not set)". --by=KEY[,KEY] groups by those settings instead, and names on stderr any other
setting that differs inside a group. Groups appear in the order of their first run.

Per group: n (runs), their seeds, then mean ± sd over the runs, sd the sample standard deviation
(n − 1 in the denominator; "—" for a single run), of the --split's (default test) numbers in
metrics.json: loss in nats (4 decimals), perplexity (each run's exp(loss), averaged), accuracy in %;
the wall time per run in minutes (the sum of the "run" entry's wall_s_processes, one per process of a
resumed run, where a JSON copy has it; else metrics.json's wall_time_s, which counts the last process
only); and, if any run's "run" entry has cpu_s, the CPU time (user + system) per run in minutes, over
the runs that have it (with "(n=k)" where not all do).

--extrapolation=L[,L...] adds, per length L, the mean ± sd of the perplexity at context L from
eval_extrapolate.py's extrapolation.csv (columns: run, label, protocol, length, tokens, ppl, ...):
FOLDER/extrapolate/extrapolation.csv for a run folder, NAME.extrapolation.csv beside NAME.json for a
copy. A CSV that holds several runs is matched to this one by its run folder (run.out_dir or the
folder of "checkpoint"). All runs must have been scored with one protocol.

Output: a markdown table (a caption line, then the table) or with --csv a CSV with one column per
number (mean and sd apart, full precision, times in seconds, sd empty for a single run).
Bad input exits 2 with one line: no runs, a path that does not exist, a folder without metrics.json,
runs on different datasets, a run without the split, settings found nowhere, the same run given twice,
an unknown --by key, or with --extrapolation a run without its CSV or without that length.
"""

import argparse
import csv
import io
import json
import os
import statistics
import sys

from cli import UserError, exit_on_user_error

# Settings that name, log or place a run rather than change what it trains: never a reason to split groups.
IGNORED = ("seed", "out_dir", "wandb_log", "wandb_project", "wandb_run_name", "init_from", "init_ckpt",
           "eval_only", "data_root", "device", "compile", "attn_backend", "log_interval", "peak_flops")
NOT_SET = "(not set)"


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2 (main), instead of usage + message
        raise UserError(f"{message} (see python results.py --help)")


def load_run(path):
    """One run from a run folder or a metrics.json copy: {"path", "metrics", "config", "extrapolation_csv",
    "out_dir"}. Raises UserError when the path does not exist, has no metrics.json, is not JSON, or has
    no settings anywhere (see the module docstring)."""
    if os.path.isdir(path):
        folder, file = path, os.path.join(path, "metrics.json")
        if not os.path.isfile(file):
            raise UserError(f"{path} holds no metrics.json: the run has not finished (train.py writes it at the "
                            "end; an interrupted run resumes with --init_from=resume)")
        csv_path = os.path.join(path, "extrapolate", "extrapolation.csv")
    elif os.path.isfile(path):
        folder, file = None, path
        csv_path = (path[:-len(".json")] if path.endswith(".json") else path) + ".extrapolation.csv"
    else:
        raise UserError(f"{path} does not exist; give run folders or copies of their metrics.json")
    try:
        with open(file) as f:
            metrics = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {file} as JSON ({e}); give a run folder or a copy of its metrics.json") from None
    if not isinstance(metrics, dict) or "dataset" not in metrics:
        raise UserError(f"{file} is not a train.py metrics.json (no 'dataset')")
    run = metrics.get("run") or {}
    out_dir = folder or run.get("out_dir") or (os.path.dirname(metrics["checkpoint"]) if metrics.get("checkpoint") else None)
    config = metrics.get("config")
    if config is None:
        config = _config_from_checkpoint(file, folder, metrics)
    return {"path": path, "metrics": metrics, "config": config, "extrapolation_csv": csv_path, "out_dir": out_dir}


def _config_from_checkpoint(file, folder, metrics):
    """The "config" of the run's best.pt, for metrics.json files written before train.py stored it."""
    if folder is not None:
        candidates = [os.path.join(folder, "best.pt")]
    else:
        run = metrics.get("run") or {}
        candidates = [p for p in (metrics.get("checkpoint"),
                                  run.get("out_dir") and os.path.join(run["out_dir"], "best.pt")) if p]
    for ckpt in candidates:
        if os.path.isfile(ckpt):
            from checkpoint import load_checkpoint  # torch, only for old runs
            state = load_checkpoint(os.path.dirname(ckpt) or ".", os.path.basename(ckpt))
            if isinstance(state.get("config"), dict):
                return state["config"]
    raise UserError(f"{file} has no 'config' (written before train.py stored the settings in metrics.json) and no "
                    f"best.pt with one was found ({', '.join(candidates) or 'no checkpoint path named'}); "
                    "give the run folder that holds best.pt")


def _freeze(v):
    return tuple(_freeze(x) for x in v) if isinstance(v, list) else v


def differing_keys(configs):
    """Settings (sorted) whose values are not all equal across `configs` (dicts), IGNORED left out; a key
    missing from some configs differs unless it is missing from all."""
    keys = sorted(set().union(*configs) - set(IGNORED))
    return [k for k in keys if len({repr(_freeze(c.get(k, NOT_SET))) for c in configs}) > 1]


def group_runs(runs, by):
    """[(values, runs)] in the order of each group's first run; values: the tuple of the `by` settings."""
    groups = {}
    for r in runs:
        groups.setdefault(tuple(_freeze(r["config"].get(k, NOT_SET)) for k in by), []).append(r)
    return list(groups.items())


def mean_sd(xs):
    """(mean, sample sd with n − 1; None for one value) of a non-empty list of floats."""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def wall_s(metrics):
    """Wall time of a run in seconds: the sum of the "run" entry's wall_s_processes if any, else wall_time_s."""
    procs = (metrics.get("run") or {}).get("wall_s_processes")
    return float(sum(procs)) if procs else metrics.get("wall_time_s")


def extrapolation_ppl(run, length):
    """(perplexity, protocol) of a run at context `length` from its extrapolation.csv; UserError if missing."""
    path = run["extrapolation_csv"]
    if not os.path.isfile(path):
        raise UserError(f"{run['path']} has no length-extrapolation results ({path} does not exist); score it with "
                        f"eval_extrapolate.py ... --out_dir=<run folder>/extrapolate, or drop --extrapolation")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    lengths = sorted({int(r["length"]) for r in rows if r.get("length")})
    rows = [r for r in rows if r.get("length") and int(r["length"]) == length]
    if not rows:
        raise UserError(f"{path} has no length {length} (it has {', '.join(map(str, lengths)) or 'none'}); "
                        "choose one of those for --extrapolation")
    if len({r["run"] for r in rows}) > 1:  # several runs in one CSV: this run's rows
        mine = os.path.normpath(run["out_dir"] or "")
        rows = [r for r in rows if os.path.normpath(r["run"]) == mine]
        if not rows:
            raise UserError(f"{path} holds several runs and none is {run['out_dir']!r} ({run['path']}); give one "
                            "CSV per run")
    if len(rows) > 1:
        raise UserError(f"{path} has {len(rows)} rows for length {length} of one run (protocols "
                        f"{', '.join(r['protocol'] for r in rows)}); keep one protocol per CSV")
    if not rows[0].get("ppl"):
        raise UserError(f"{path} has no perplexity at length {length} (an absolute encoding past its block_size?)")
    return float(rows[0]["ppl"]), rows[0].get("protocol", "")


def summarize(paths, by=None, split="test", extrapolation=()):
    """Read the runs at `paths` and aggregate them per group.

    Returns (by, rows, info): by, the grouping settings (chosen, or those that differ); rows, one dict per
    group {"values", "n", "seeds", "loss", "ppl", "acc", "wall_s", "cpu_s", "cpu_n", "ext": {L: ...}},
    each number a (mean, sd) pair (acc in %, times in seconds, cpu_s None where no run has it);
    info {"dataset", "split", "protocol", "cpu", "notes"}. Raises UserError for bad input (module docstring).
    """
    if not paths:
        raise UserError("no runs: give run folders (train.py out_dir) or copies of their metrics.json, "
                        "e.g. python results.py out/ablation/*/")
    runs = [load_run(p) for p in paths]
    datasets = {}
    for r in runs:
        datasets.setdefault(r["metrics"]["dataset"], []).append(r["path"])
    if len(datasets) > 1:
        raise UserError("runs on different datasets: " + "; ".join(f"{d}: {', '.join(p)}" for d, p in datasets.items())
                        + "; tabulate one dataset at a time")
    seen = {}
    for r in runs:
        key = json.dumps(r["config"], sort_keys=True)
        if key in seen:
            raise UserError(f"{seen[key]} and {r['path']} are the same run (identical settings, out_dir and seed); "
                            "give each run once")
        seen[key] = r["path"]
    for r in runs:
        if not isinstance(r["metrics"].get(split), dict):
            raise UserError(f"{r['path']} has no {split!r} metrics (splits: "
                            f"{', '.join(s for s in ('val', 'test') if s in r['metrics']) or 'none'}); "
                            "choose one it has with --split")
    configs = [r["config"] for r in runs]
    notes = []
    if by:
        known = set().union(*configs)
        unknown = [k for k in by if k not in known]
        if unknown:
            raise UserError(f"--by: no run has the setting(s) {', '.join(unknown)}; settings that differ here: "
                            f"{', '.join(differing_keys(configs)) or 'none'}")
    else:
        by = differing_keys(configs)
    rows, protocols = [], set()
    for values, members in group_runs(runs, by):
        inside = [k for k in differing_keys([r["config"] for r in members]) if k not in by]
        if inside:
            notes.append(f"note: the group {dict(zip(by, values)) or 'all'} also differs in {', '.join(inside)}")
        ms = [r["metrics"] for r in members]
        cpu = [m["run"]["cpu_s"] for m in ms if (m.get("run") or {}).get("cpu_s") is not None]
        walls = [wall_s(m) for m in ms if wall_s(m) is not None]
        ext = {}
        for L in extrapolation:
            got = [extrapolation_ppl(r, L) for r in members]
            protocols.update(p for _, p in got)
            ext[L] = mean_sd([p for p, _ in got])
        rows.append({"values": values, "n": len(members), "seeds": [r["config"].get("seed") for r in members],
                     "loss": mean_sd([m[split]["loss"] for m in ms]), "ppl": mean_sd([m[split]["ppl"] for m in ms]),
                     "acc": mean_sd([100 * m[split]["acc"] for m in ms]),
                     "wall_s": mean_sd(walls) if walls else None, "wall_n": len(walls),
                     "cpu_s": mean_sd(cpu) if cpu else None, "cpu_n": len(cpu), "ext": ext})
    if len(protocols) > 1:
        raise UserError(f"the runs' extrapolation.csv files use different protocols ({', '.join(sorted(protocols))}); "
                        "compare runs scored with one protocol")
    info = {"dataset": runs[0]["metrics"]["dataset"], "split": split, "protocol": next(iter(protocols), ""),
            "cpu": any(r["cpu_s"] for r in rows), "notes": notes}
    return by, rows, info


def _pm(pair, digits, scale=1.0):
    if pair is None:
        return "—"
    mean, sd = pair
    return f"{mean / scale:.{digits}f} ± " + ("—" if sd is None else f"{sd / scale:.{digits}f}")


def _value(v):
    return ",".join(map(str, v)) if isinstance(v, tuple) else str(v)


def markdown(by, rows, info, extrapolation=()):
    """The caption line and the markdown table of summarize's output."""
    head = list(by) or ["runs"]
    head += ["n", "seeds", f"{info['split']} loss (nats)", f"{info['split']} ppl", f"{info['split']} acc (%)",
             "wall per run (min)"] + (["CPU per run (min)"] if info["cpu"] else [])
    head += [f"ppl at {L} ({info['protocol']})" if info["protocol"] else f"ppl at {L}" for L in extrapolation]
    n_text = len(by or [0]) + 1  # the grouping columns and seeds are text, left-aligned; numbers right-aligned
    align = ["---"] * (n_text - 1) + ["---:", "---"] + ["---:"] * (len(head) - n_text - 1)
    lines = [f"{info['dataset']}, {info['split']} split: mean ± sd over the runs of each group (sample sd, n − 1; "
             "— for one run)", "", "| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in rows:
        cells = [_value(v) for v in r["values"]] or ["all"]
        cells += [str(r["n"]), ", ".join(map(str, r["seeds"])), _pm(r["loss"], 4), _pm(r["ppl"], 3), _pm(r["acc"], 2),
                  _pm(r["wall_s"], 1, 60) + ("" if r["wall_n"] in (0, r["n"]) else f" (n={r['wall_n']})")]
        if info["cpu"]:
            cells.append(_pm(r["cpu_s"], 1, 60) + ("" if r["cpu_n"] in (0, r["n"]) else f" (n={r['cpu_n']})"))
        cells += [_pm(r["ext"][L], 3) for L in extrapolation]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_csv(by, rows, info, extrapolation=()):
    """summarize's output as CSV text: the grouping settings, n, seeds (space-separated), then *_mean and *_sd
    per number (acc in %, times in seconds; sd empty for one run, a time empty where no run has it)."""
    nums = ["loss", "ppl", "acc_pct", "wall_s", "cpu_s"] + [f"ppl_at_{L}" for L in extrapolation]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([*by, "n", "seeds", *(f"{k}_{s}" for k in nums for s in ("mean", "sd"))])
    for r in rows:
        pairs = [r["loss"], r["ppl"], r["acc"], r["wall_s"], r["cpu_s"]] + [r["ext"][L] for L in extrapolation]
        cells = [repr(x) if isinstance(x, float) else "" for p in pairs for x in (p or (None, None))]
        w.writerow([*map(_value, r["values"]), r["n"], " ".join(map(str, r["seeds"])), *cells])
    return buf.getvalue()


def parse_lengths(text):
    try:
        lengths = [int(t) for t in text.split(",") if t.strip()] if text else []
    except ValueError:
        raise UserError(f"--extrapolation must be comma-separated context lengths, got {text!r}") from None
    if any(L <= 0 for L in lengths):
        raise UserError(f"--extrapolation must be positive context lengths, got {text!r}")
    return lengths


@exit_on_user_error
def main(argv):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", help="run folders holding metrics.json, or copies of a metrics.json")
    p.add_argument("--by", default="", help="comma-separated settings to group by (default: those that differ)")
    p.add_argument("--split", default="test", choices=["val", "test"])
    p.add_argument("--extrapolation", default="", help="comma-separated context lengths: perplexity there per group")
    p.add_argument("--csv", action="store_true", help="print CSV instead of markdown")
    a = p.parse_args(argv)
    lengths = parse_lengths(a.extrapolation)
    by = [k.strip() for k in a.by.split(",") if k.strip()] or None
    by, rows, info = summarize(a.runs, by, a.split, lengths)
    for note in info["notes"]:
        print(note, file=sys.stderr)
    text = (to_csv if a.csv else markdown)(by, rows, info, lengths)
    print(text, end="")
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
