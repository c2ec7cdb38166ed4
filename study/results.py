"""One table of finished runs: mean ± sd over seeds for each group of runs that share their settings.

    python study/results.py out/ablation/*/                                  # run folders (train.py out_dir)
    python study/results.py docs/runs/abl-*.json --extrapolation=4096        # copies of metrics.json, + ppl at 4096
    python study/results.py docs/runs/jsb-*.json --by=pos_encoding --csv     # choose the grouping; CSV on stdout
    python study/results.py docs/runs/s37-jsb-*.json --compare=pos_encoding  # two arms: difference, 95 % CI, p
    python study/results.py docs/runs/s37-ii-*.json --compare=pos_encoding --solved=0.9   # solve rates, Fisher
    python study/results.py out/a-*/ out/b-*/ --compare=pos_encoding --retrieval=passkey@256,copy@4096

Inputs: run folders, each with the metrics.json that train.py writes at the end of a run, and/or JSON
files that are copies of one (docs/runs/NAME.json, written by study/lane.sh: metrics.json plus a
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
eval_extrapolate.py's extrapolation.csv (columns: run, label, protocol, one_document, length, tokens, ppl, ...):
FOLDER/extrapolate/extrapolation.csv for a run folder, NAME.extrapolation.csv beside NAME.json for a
copy. A CSV that holds several runs is matched to this one by its run folder (run.out_dir or the
folder of "checkpoint"). All runs must have been scored with one protocol (a split scored with
eval_extrapolate.py --one_document counts as its own, "tiled, one document": the label says the flag was passed,
so a CSV from before the column, or one scored without the flag on a dataset that declares no documents, reads
"tiled" though it read the split the same way).

--retrieval=TASK@L[,...] (with --compare): per item, each run's eval_retrieval.py accuracy in %: passkey,
correct / trials at window length L pooled over the depths (FOLDER/retrieval/passkey.csv, or
NAME.passkey.csv beside a copy); copy, the next-token accuracy on the second copy (retrieval/copy.csv,
NAME.copy.csv); compared between the arms like the other metrics.

Provenance: each group whose runs (any process of a resumed run included) mix machines (CPU model, ATen's SIMD
level, MKL's and oneDNN's instruction sets and the variables that force them, e.g. ATEN_CPU_CAPABILITY, where
recorded: provenance.machine; or GPUs), code commits or library versions gets one "warning:" line on stderr naming
what differs; runs from before train.py recorded provenance count as "unknown" and are still read.

--compare=KEY: the runs must fall into exactly two groups by KEY and differ in nothing else (change one thing), but
the settings --allow=KEY,... names: those that belong to the method compared, such as DroPE's recalibration recipe
against its RoPE run (the caption names them). For each metric (loss, ppl, accuracy, and each --extrapolation
length), the difference of the means B − A (A: the group of the first run given) with its 95 % confidence interval
and p-value from Welch's t-test (two-sided; scipy.stats.ttest_ind, equal_var=False); and, when both groups hold the
same seeds, each once, and every run's provenance names one and the same machine, the paired difference over seeds
(scipy.stats.ttest_rel) as well. "separated" means p < 0.05 (two-sided) in the test --decide names: welch (the
default) or perm, the exact permutation p; the column's header names it ("separated (Welch p)"). Each arm is labelled
by the setting that differs: KEY's value, followed by the allowed settings that differ between the arms and belong
to that value (named VALUE_*: rope_scaling=4.0 and rope_original_block_size=256 make a rope arm RoPE + YaRN, so it
reads "rope (rope_original_block_size=256, rope_scaling=4.0)", not "rope"). Beside Welch's p, which leans on normal
tails that a few skewed runs do not give: the exact permutation p of the difference of means (every relabeling
counted, permutation_p; up to 30 runs in all, else "—"), the Mann–Whitney U p, and "complete separation" where
every run of one arm lies above every run of the other (the smallest p a permutation test can give then:
2 / C(nA + nB, nA) for equal arms, 1.55e-4 at 8 against 8).
--tost=MARGIN (with --compare; nats, > 0): equivalence of the two arms' --split loss, Schuirmann's two one-sided
tests (TOST) on Welch's t (unequal variances, Welch-Satterthwaite df): H0 |B − A| >= MARGIN against |B − A| <
MARGIN; p = the larger of the two one-sided p-values, "equivalent" when p < 0.05, that is when the 90 % confidence
interval of B − A lies inside (−MARGIN, +MARGIN). A test of "no more than MARGIN apart", which Welch's test (no
difference found) cannot give.
--solved=THRESHOLD (test accuracy as a fraction, in [0, 1]): per group, the runs with accuracy >= THRESHOLD, k / n
with its Wilson 95 % interval (scipy.stats.binomtest), and with --compare Fisher's exact test (two-sided) of the two
groups' k / n; for bimodal outcomes (a run solves a task or stalls).

Output: a markdown table (a caption line, then the table) or with --csv a CSV with one column per
number (mean and sd apart, full precision, times in seconds, sd empty for a single run).
Bad input exits 2 with one line: no runs, a path that does not exist, a folder without metrics.json,
runs on different datasets, a run without the split, settings found nowhere, the same run given twice,
an unknown --by key, with --extrapolation a run without its CSV or without that length, with
--compare a key that does not split the runs into exactly two groups, arms that differ in another
setting too, a group of one run, and a --solved threshold outside [0, 1].
"""

import argparse
import csv
import io
import json
import os
import statistics
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: cli.py, model.py ...

import provenance as prov
from cli import ArgumentParser, UserError, exit_on_user_error

# Settings that name, log or place a run rather than change what it trains: never a reason to split groups.
IGNORED = (
    "seed",
    "out_dir",
    "wandb_log",
    "wandb_project",
    "wandb_run_name",
    "init_from",
    "init_ckpt",
    "eval_only",
    "data_root",
    "device",
    "compile",
    "attn_backend",
    "log_interval",
    "peak_flops",
)
NOT_SET = "(not set)"


def load_run(path):
    """One run from a run folder or a metrics.json copy: {"path", "metrics", "config", "extrapolation_csv",
    "out_dir"}. Raises UserError when the path does not exist, has no metrics.json, is not JSON, or has
    no settings anywhere (see the module docstring)."""
    if os.path.isdir(path):
        folder, file = path, os.path.join(path, "metrics.json")
        if not os.path.isfile(file):
            raise UserError(
                f"{path} holds no metrics.json: the run has not finished (train.py writes it at the "
                "end; an interrupted run resumes with --init_from=resume)"
            )
        csv_path = os.path.join(path, "extrapolate", "extrapolation.csv")
        retrieval = {t: os.path.join(path, "retrieval", f"{t}.csv") for t in RETRIEVAL_TASKS}
    elif os.path.isfile(path):
        folder, file = None, path
        stem = path[: -len(".json")] if path.endswith(".json") else path
        csv_path = stem + ".extrapolation.csv"
        retrieval = {t: f"{stem}.{t}.csv" for t in RETRIEVAL_TASKS}
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
    out_dir = (
        folder or run.get("out_dir") or (os.path.dirname(metrics["checkpoint"]) if metrics.get("checkpoint") else None)
    )
    config = metrics.get("config")
    if config is None:
        config = _config_from_checkpoint(file, folder, metrics)
    return {
        "path": path,
        "metrics": metrics,
        "config": config,
        "extrapolation_csv": csv_path,
        "out_dir": out_dir,
        "retrieval_csv": retrieval,
    }


def _config_from_checkpoint(file, folder, metrics):
    """The "config" of the run's best.pt, for metrics.json files written before train.py stored it."""
    if folder is not None:
        candidates = [os.path.join(folder, "best.pt")]
    else:
        run = metrics.get("run") or {}
        candidates = [
            p for p in (metrics.get("checkpoint"), run.get("out_dir") and os.path.join(run["out_dir"], "best.pt")) if p
        ]
    for ckpt in candidates:
        if os.path.isfile(ckpt):
            from checkpoint import load_checkpoint  # torch, only for old runs

            state = load_checkpoint(os.path.dirname(ckpt) or ".", os.path.basename(ckpt))
            if isinstance(state.get("config"), dict):
                return state["config"]
    raise UserError(
        f"{file} has no 'config' (written before train.py stored the settings in metrics.json) and no "
        f"best.pt with one was found ({', '.join(candidates) or 'no checkpoint path named'}); "
        "give the run folder that holds best.pt"
    )


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


PROVENANCE_FIELDS = (("machines", prov.machine), ("commits", prov.commit), ("library versions", prov.libraries))


def processes(run):
    """The provenance dicts of every process that trained a run (earlier ones of a resumed run first); [None]
    for a run from before train.py recorded provenance."""
    m = run["metrics"]
    return list(m.get("provenance_earlier") or []) + [m.get("provenance")]


def provenance_counts(runs, name):
    """{value: number of runs} of one PROVENANCE_FIELDS entry (e.g. "machines") over `runs`; a run trained by
    processes with different values counts under each."""
    field = dict(PROVENANCE_FIELDS)[name]
    counts = {}
    for r in runs:
        for v in {field(p) for p in processes(r)}:
            counts[v] = counts.get(v, 0) + 1
    return counts


def _counted(counts):
    return ", ".join(f"{v} x{n}" for v, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def mix_warning(runs):
    """What the runs' provenance mixes, as one phrase ("machines (A x3, unknown x2); commits (...)"), or ""."""
    parts = [f"{name} ({_counted(c)})" for name, _ in PROVENANCE_FIELDS if len(c := provenance_counts(runs, name)) > 1]
    return "; ".join(parts)


def mean_sd(xs):
    """(mean, sample sd with n − 1; None for one value) of a non-empty list of floats."""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def wall_s(metrics):
    """Wall time of a run in seconds: the sum of the "run" entry's wall_s_processes if any, else wall_time_s."""
    procs = (metrics.get("run") or {}).get("wall_s_processes")
    return float(sum(procs)) if procs else metrics.get("wall_time_s")


def extrapolation_ppl(run, length):
    """(perplexity, protocol) of a run at context `length` from its extrapolation.csv; UserError if missing.
    protocol: the CSV's, with ", one document" where eval_extrapolate.py read the split as one (--one_document), so
    that runs scored over other chunks count as another protocol."""
    path = run["extrapolation_csv"]
    if not os.path.isfile(path):
        raise UserError(
            f"{run['path']} has no length-extrapolation results ({path} does not exist); score it with "
            f"eval_extrapolate.py ... --out_dir=<run folder>/extrapolate, or drop --extrapolation"
        )
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    lengths = sorted({int(r["length"]) for r in rows if r.get("length")})
    rows = [r for r in rows if r.get("length") and int(r["length"]) == length]
    if not rows:
        raise UserError(
            f"{path} has no length {length} (it has {', '.join(map(str, lengths)) or 'none'}); "
            "choose one of those for --extrapolation"
        )
    if len({r["run"] for r in rows}) > 1:  # several runs in one CSV: this run's rows
        mine = os.path.normpath(run["out_dir"] or "")
        rows = [r for r in rows if os.path.normpath(r["run"]) == mine]
        if not rows:
            raise UserError(
                f"{path} holds several runs and none is {run['out_dir']!r} ({run['path']}); give one CSV per run"
            )
    if len(rows) > 1:
        raise UserError(
            f"{path} has {len(rows)} rows for length {length} of one run (protocols "
            f"{', '.join(r['protocol'] for r in rows)}); keep one protocol per CSV"
        )
    if not rows[0].get("ppl"):
        raise UserError(f"{path} has no perplexity at length {length} (an absolute encoding past its block_size?)")
    protocol = rows[0].get("protocol", "")
    if rows[0].get("one_document") == "True":  # eval_extrapolate.py --one_document: other chunks than the documents'
        protocol += ", one document"
    return float(rows[0]["ppl"]), protocol


RETRIEVAL_TASKS = ("passkey", "copy")  # eval_retrieval.py's CSVs: passkey.csv, copy.csv


def retrieval_accuracy(run, task, length):
    """A run's retrieval accuracy (a fraction) at window `length` from eval_retrieval.py's CSVs:
    passkey, correct / trials pooled over the depths; copy, acc_second (next-token accuracy on the second
    copy). Read from FOLDER/retrieval/TASK.csv for a run folder, NAME.TASK.csv beside NAME.json for a copy;
    a CSV of several runs is matched by run folder as for --extrapolation. UserError if missing."""
    path = run["retrieval_csv"][task]
    if not os.path.isfile(path):
        raise UserError(
            f"{run['path']} has no {task} results ({path} does not exist); score it with "
            f"eval_retrieval.py ... --out_dir=<run folder>/retrieval, or drop --retrieval"
        )
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("length")]
    if len({r["run"] for r in rows}) > 1:
        mine = os.path.normpath(run["out_dir"] or "")
        rows = [r for r in rows if os.path.normpath(r["run"]) == mine]
    got = [r for r in rows if int(r["length"]) == length]
    if not got:
        raise UserError(
            f"{path} has no length {length} for {run['path']} (it has "
            f"{', '.join(sorted({r['length'] for r in rows}, key=int)) or 'none'}); choose one of those"
        )
    if task == "passkey":
        return sum(int(r["correct"]) for r in got) / sum(int(r["trials"]) for r in got)
    return float(got[0]["acc_second"])


def parse_retrieval(text):
    """[(task, length)] from 'passkey@256,copy@4096'; UserError otherwise."""
    out = []
    for item in (t.strip() for t in (text or "").split(",") if t.strip()):
        task, _, length = item.partition("@")
        if task not in RETRIEVAL_TASKS or not length.isdigit() or int(length) <= 0:
            raise UserError(
                f"--retrieval takes TASK@LENGTH items, TASK one of {', '.join(RETRIEVAL_TASKS)}, "
                f"e.g. passkey@256,copy@4096; got {item!r}"
            )
        out.append((task, int(length)))
    return out


def read_runs(paths, split="test"):
    """load_run for each path, checked: one dataset, no run twice, each with the split's metrics. UserError
    otherwise (module docstring)."""
    if not paths:
        raise UserError(
            "no runs: give run folders (train.py out_dir) or copies of their metrics.json, "
            "e.g. python study/results.py out/ablation/*/"
        )
    runs = [load_run(p) for p in paths]
    datasets = {}
    for r in runs:
        datasets.setdefault(r["metrics"]["dataset"], []).append(r["path"])
    if len(datasets) > 1:
        raise UserError(
            "runs on different datasets: "
            + "; ".join(f"{d}: {', '.join(p)}" for d, p in datasets.items())
            + "; tabulate one dataset at a time"
        )
    seen = {}
    for r in runs:
        key = json.dumps(r["config"], sort_keys=True)
        if key in seen:
            raise UserError(
                f"{seen[key]} and {r['path']} are the same run (identical settings, out_dir and seed); "
                "give each run once"
            )
        seen[key] = r["path"]
    for r in runs:
        if not isinstance(r["metrics"].get(split), dict):
            raise UserError(
                f"{r['path']} has no {split!r} metrics (splits: "
                f"{', '.join(s for s in ('val', 'test') if s in r['metrics']) or 'none'}); "
                "choose one it has with --split"
            )
    return runs


def summarize(paths, by=None, split="test", extrapolation=(), solved=None):
    """Read the runs at `paths` and aggregate them per group.

    Returns (by, rows, info): by, the grouping settings (chosen, or those that differ); rows, one dict per
    group {"values", "n", "seeds", "loss", "ppl", "acc", "wall_s", "cpu_s", "cpu_n", "ext": {L: ...}},
    each number a (mean, sd) pair (acc in %, times in seconds, cpu_s None where no run has it);
    info {"dataset", "split", "protocol", "cpu", "notes", "machines"}. With `solved` (an accuracy threshold
    in [0, 1]) each row also has "solved": (k, n, rate, (low, high)), Wilson's 95 % interval. Raises
    UserError for bad input (module docstring).
    """
    if solved is not None and not 0 <= solved <= 1:
        raise UserError(f"--solved is a test accuracy as a fraction in [0, 1] (e.g. 0.9 for 90 %), got {solved}")
    runs = read_runs(paths, split)
    configs = [r["config"] for r in runs]
    notes = []
    if by:
        known = set().union(*configs)
        unknown = [k for k in by if k not in known]
        if unknown:
            raise UserError(
                f"--by: no run has the setting(s) {', '.join(unknown)}; settings that differ here: "
                f"{', '.join(differing_keys(configs)) or 'none'}"
            )
    else:
        by = differing_keys(configs)
    rows, protocols = [], set()
    for values, members in group_runs(runs, by):
        inside = [k for k in differing_keys([r["config"] for r in members]) if k not in by]
        if inside:
            notes.append(f"note: the group {dict(zip(by, values)) or 'all'} also differs in {', '.join(inside)}")
        mixed = mix_warning(members)
        if mixed:
            notes.append(f"warning: the group {dict(zip(by, values)) or 'all'} mixes {mixed}")
        ms = [r["metrics"] for r in members]
        cpu = [m["run"]["cpu_s"] for m in ms if (m.get("run") or {}).get("cpu_s") is not None]
        walls = [wall_s(m) for m in ms if wall_s(m) is not None]
        ext = {}
        for L in extrapolation:
            got = [extrapolation_ppl(r, L) for r in members]
            protocols.update(p for _, p in got)
            ext[L] = mean_sd([p for p, _ in got])
        rows.append(
            {
                "values": values,
                "n": len(members),
                "seeds": [r["config"].get("seed") for r in members],
                "loss": mean_sd([m[split]["loss"] for m in ms]),
                "ppl": mean_sd([m[split]["ppl"] for m in ms]),
                "acc": mean_sd([100 * m[split]["acc"] for m in ms]),
                "wall_s": mean_sd(walls) if walls else None,
                "wall_n": len(walls),
                "cpu_s": mean_sd(cpu) if cpu else None,
                "cpu_n": len(cpu),
                "ext": ext,
            }
        )
        if solved is not None:
            k = sum(m[split]["acc"] >= solved for m in ms)
            rows[-1]["solved"] = (k, len(ms), *wilson(k, len(ms)))
    if len(protocols) > 1:
        raise UserError(
            f"the runs' extrapolation.csv files use different protocols ({', '.join(sorted(protocols))}); "
            "compare runs scored with one protocol"
        )
    info = {
        "dataset": runs[0]["metrics"]["dataset"],
        "split": split,
        "protocol": next(iter(protocols), ""),
        "cpu": any(r["cpu_s"] for r in rows),
        "notes": notes,
        "machines": provenance_counts(runs, "machines"),
        "solved": solved,
    }
    return by, rows, info


ALPHA = 0.05  # "separated": p < ALPHA, two-sided
DECIDE = {"welch": "Welch p", "perm": "perm. p"}  # --decide: the test whose p says "separated", as the header names it


def metric_values(runs, split, extrapolation=(), retrieval=()):
    """[(metric name, [one value per run])]: loss (nats), ppl, accuracy (%), ppl at each length, then each
    (task, length) of `retrieval` as accuracy (%) (retrieval_accuracy)."""
    out = [
        (f"{split} loss (nats)", [r["metrics"][split]["loss"] for r in runs]),
        (f"{split} ppl", [r["metrics"][split]["ppl"] for r in runs]),
        (f"{split} acc (%)", [100 * r["metrics"][split]["acc"] for r in runs]),
    ]
    for L in extrapolation:
        got = [extrapolation_ppl(r, L) for r in runs]
        protocols = sorted({p for _, p in got})
        if len(protocols) > 1:
            raise UserError(
                f"the runs' extrapolation.csv files use different protocols ({', '.join(protocols)}); "
                "compare runs scored with one protocol"
            )
        out.append((f"ppl at {L} ({protocols[0]})" if protocols[0] else f"ppl at {L}", [p for p, _ in got]))
    for task, L in retrieval:
        out.append((f"{task} acc (%) at {L}", [100 * retrieval_accuracy(r, task, L) for r in runs]))
    return out


def welch(a, b):
    """Welch's t-test of mean(b) − mean(a): (difference, (CI low, CI high) at 95 %, two-sided p). Both groups
    need >= 2 values. With no spread in either group the interval shrinks to the difference, and p is nan
    for equal means (t = 0 / 0; printed "nan", separated "—") and 0 for unequal ones."""
    from scipy import stats

    with warnings.catch_warnings():  # identical values: scipy warns, the result is still defined or nan
        warnings.simplefilter("ignore", RuntimeWarning)
        res = stats.ttest_ind(b, a, equal_var=False)
    ci = res.confidence_interval(1 - ALPHA)
    return statistics.fmean(b) - statistics.fmean(a), (float(ci.low), float(ci.high)), float(res.pvalue)


PERMUTATION_MAX_RUNS = 30  # exact permutation p up to nA + nB runs (2^15 subset sums per half)


def permutation_p(a, b):
    """The exact two-sided permutation p of mean(b) − mean(a): the fraction of all C(nA + nB, nB) ways to
    relabel the pooled runs as nB "b" runs whose |difference of means| is >= the observed one (the observed
    split counts; Fisher's randomization test, e.g. Good, "Permutation Tests", ch. 3). Complete separation
    of 8 against 8 gives 2 / C(16, 8) = 1.55e-4. Ties within 1e-12 of the pooled sum of |x| count as equal.

    Every split is counted, none sampled: the difference is monotone in the b-sum S, so the pooled values are
    cut in two halves, each half's subset sums enumerated by size, and the pairs with S at least as extreme
    counted by binary search (meet in the middle). Returns nan when nA + nB > PERMUTATION_MAX_RUNS (not
    computed) or an arm is empty."""
    import numpy as np

    x = np.asarray(list(a) + list(b), dtype=np.float64)
    n, k = len(x), len(b)
    if n > PERMUTATION_MAX_RUNS or not 0 < k < n:
        return float("nan")
    tol = 1e-12 * float(np.abs(x).sum())
    mid = k * float(x.sum()) / n  # the mean of S over all splits: difference 0
    dev = abs(float(x[len(a) :].sum()) - mid)
    if dev <= tol:
        return 1.0

    def subset_sums(part):
        masks = np.arange(2 ** len(part))
        bits = (masks[:, None] >> np.arange(len(part))) & 1
        return bits.sum(1), bits @ part

    (size_lo, sum_lo), (size_hi, sum_hi) = subset_sums(x[: n // 2]), subset_sums(x[n // 2 :])
    extreme, total = 0, 0
    for j in range(k + 1):
        left, right = sum_lo[size_lo == j], np.sort(sum_hi[size_hi == k - j])
        total += len(left) * len(right)
        extreme += int((len(right) - np.searchsorted(right, mid + dev - tol - left, "left")).sum())
        extreme += int(np.searchsorted(right, mid - dev + tol - left, "right").sum())
    return extreme / total


def complete_separation(a, b):
    """True when every value of one arm lies above every value of the other (no overlap)."""
    return min(b) > max(a) or min(a) > max(b)


def mann_whitney(a, b):
    """Mann–Whitney U test of b against a, two-sided (scipy.stats.mannwhitneyu, method 'auto': exact for
    small arms without ties, else the normal approximation): p."""
    from scipy import stats

    return float(stats.mannwhitneyu(b, a, alternative="two-sided").pvalue)


def paired(a, b):
    """The paired t-test of b − a (same order, one pair per seed): (mean difference, 95 % CI, two-sided p)."""
    from scipy import stats

    with warnings.catch_warnings():  # identical values: scipy warns, the result is still defined or nan
        warnings.simplefilter("ignore", RuntimeWarning)
        res = stats.ttest_rel(b, a)
    ci = res.confidence_interval(1 - ALPHA)
    return statistics.fmean(y - x for x, y in zip(a, b)), (float(ci.low), float(ci.high)), float(res.pvalue)


def tost(a, b, margin):
    """Schuirmann's two one-sided tests (TOST) that mean(b) − mean(a) lies within (−margin, +margin), each a
    one-sided Welch t-test (unequal variances, Welch-Satterthwaite df) at level ALPHA: H0 diff <= −margin and
    H0 diff >= +margin. Returns (difference, (low, high) of its (1 − 2 ALPHA) = 90 % interval, p = the larger
    one-sided p); equivalent when p < ALPHA, the same as the 90 % interval inside (−margin, +margin). Both
    groups need >= 2 values and some spread; margin > 0."""
    from scipy import stats

    if not margin > 0:
        raise ValueError(f"the equivalence margin must be > 0, got {margin}")
    shifted = lambda d: [x - d for x in b]  # noqa: E731  b − d against a: the test of diff = d
    low = stats.ttest_ind(shifted(-margin), a, equal_var=False, alternative="greater").pvalue  # H0 diff <= −margin
    high = stats.ttest_ind(shifted(margin), a, equal_var=False, alternative="less").pvalue  # H0 diff >= +margin
    ci = stats.ttest_ind(b, a, equal_var=False).confidence_interval(1 - 2 * ALPHA)
    return statistics.fmean(b) - statistics.fmean(a), (float(ci.low), float(ci.high)), float(max(low, high))


def wilson(k, n):
    """(k / n, (low, high)): the rate with its Wilson score 95 % interval (scipy.stats.binomtest)."""
    from scipy import stats

    ci = stats.binomtest(k, n).proportion_ci(1 - ALPHA, method="wilson")
    return k / n, (float(ci.low), float(ci.high))


def fisher(k_a, n_a, k_b, n_b):
    """Fisher's exact test (two-sided) of the 2 x 2 table [[k_a, n_a − k_a], [k_b, n_b − k_b]]: (odds ratio, p)."""
    from scipy import stats

    res = stats.fisher_exact([[k_a, n_a - k_a], [k_b, n_b - k_b]], alternative="two-sided")
    return float(res.statistic), float(res.pvalue)


def pairing(a_runs, b_runs):
    """(seeds, "") if the arms hold the same seeds, each once, all run on one known machine; else (None, why)."""
    seeds_a, seeds_b = [r["config"].get("seed") for r in a_runs], [r["config"].get("seed") for r in b_runs]
    if len(set(seeds_a)) < len(seeds_a) or sorted(seeds_a, key=repr) != sorted(seeds_b, key=repr):
        return None, "the arms do not hold the same seeds"
    machines = provenance_counts(a_runs + b_runs, "machines")
    if len(machines) > 1 or prov.UNKNOWN in machines:
        return None, f"not all runs are known to share one machine ({_counted(machines)})"
    return sorted(seeds_a, key=repr), ""


def arm_label(value, config, allowed):
    """An arm's name in the table: `value` (the arm's `key` setting, as text), then in parentheses each of the
    `allowed` settings (those the arms also differ in) that belongs to that value, i.e. is named VALUE_*, as
    name=value in name order: a rope arm with rope_scaling=4.0 and rope_original_block_size=256 is RoPE + YaRN,
    "rope (rope_original_block_size=256, rope_scaling=4.0)"; a pope arm, to which rope_* does not apply, stays
    "pope". The value alone when nothing belongs to it."""
    own = [f"{k}={_value(config.get(k, NOT_SET))}" for k in sorted(allowed) if k.startswith(f"{value}_")]
    return f"{value} ({', '.join(own)})" if own else value


def compare(
    paths, key, split="test", extrapolation=(), solved=None, retrieval=(), allow=(), tost_margin=None, decide="welch"
):
    """Two arms that differ in the setting `key` only: per metric, Welch's difference B − A (A: the arm of the
    first run given), its 95 % CI and p; the paired one when pairing() allows; with `solved` (a test accuracy
    threshold in [0, 1]) the solve counts, Wilson intervals and Fisher's exact test. `allow`: settings the arms
    may also differ in because they are part of the method compared (DroPE's recalibration recipe against
    the RoPE run it starts from); they are named in the output ("allowed"). `tost_margin` (nats): TOST
    equivalence of the split's loss within ±tost_margin (tost()). `decide`: the test whose p < ALPHA is called
    "separated", "welch" or "perm" (the exact permutation p), named in the table's header (DECIDE).

    Returns {"key", "arms": [(value, runs), (value, runs)], "labels": [arm_label() of A, of B], "decide",
    "rows": [{"metric", "a": (mean, sd, n), "b": ..., "welch": (diff, ci, p), "rank": (exact permutation p,
    Mann–Whitney p, complete separation) or None, "paired": (diff, ci, p) or None}], "paired_why", "solved": None
    or {"threshold", "a": (k, n, rate, ci), "b": ..., "fisher": (odds ratio, p)}, "tost": None or {"metric",
    "margin", "diff", "ci90", "p"}, "dataset", "split", "notes", "allowed"}.
    Raises UserError for the bad input the module docstring lists.
    """
    if solved is not None and not 0 <= solved <= 1:
        raise UserError(f"--solved is a test accuracy as a fraction in [0, 1] (e.g. 0.9 for 90 %), got {solved}")
    if tost_margin is not None and not tost_margin > 0:
        raise UserError(f"--tost is an equivalence margin in nats, > 0 (e.g. 0.05), got {tost_margin}")
    if decide not in DECIDE:
        raise UserError(f"--decide is one of {', '.join(DECIDE)} (the test whose p says 'separated'), got {decide!r}")
    runs = read_runs(paths, split)
    configs = [r["config"] for r in runs]
    if key not in set().union(*configs):
        raise UserError(
            f"--compare: no run has the setting {key!r}; settings that differ here: "
            f"{', '.join(differing_keys(configs)) or 'none'}"
        )
    groups = group_runs(runs, [key])
    if len(groups) != 2:
        raise UserError(
            f"--compare={key} splits the runs into {len(groups)} group(s) "
            f"({', '.join(_value(v[0]) for v, _ in groups)}); give the runs of exactly two values"
        )
    other = [k for k in differing_keys(configs) if k != key and k not in allow]
    if other:
        raise UserError(
            f"the two arms also differ in {', '.join(other)}; a comparison changes one setting: give "
            f"only the runs that differ in {key} (or --allow them, if they are part of the method)"
        )
    allowed = [k for k in differing_keys(configs) if k in allow]
    (va, a_runs), (vb, b_runs) = groups
    seeds, why = pairing(a_runs, b_runs)
    if solved is None:
        for v, members in groups:
            if len(members) < 2:
                raise UserError(
                    f"the group {key}={_value(v[0])} has 1 run; a t-test needs at least 2 runs per group "
                    "(3 or more to say much): add seeds"
                )
    rows = []
    n_a = len(a_runs)
    for name, values in metric_values(a_runs + b_runs, split, extrapolation, retrieval):  # one protocol for both
        a, b = values[:n_a], values[n_a:]
        row = {"metric": name, "a": (*mean_sd(a), len(a)), "b": (*mean_sd(b), len(b)), "welch": None, "paired": None}
        row["rank"] = None
        if len(a) > 1 and len(b) > 1:
            row["welch"] = welch(a, b)
            row["rank"] = (permutation_p(a, b), mann_whitney(a, b), complete_separation(a, b))
        if seeds is not None and len(seeds) > 1:
            by_seed_a = {r["config"].get("seed"): x for r, x in zip(a_runs, a)}
            by_seed_b = {r["config"].get("seed"): x for r, x in zip(b_runs, b)}
            row["paired"] = paired([by_seed_a[s] for s in seeds], [by_seed_b[s] for s in seeds])
        rows.append(row)
    out = {
        "key": key,
        "arms": [(_value(va[0]), a_runs), (_value(vb[0]), b_runs)],
        "labels": [arm_label(_value(v[0]), members[0]["config"], allowed) for v, members in groups],
        "decide": decide,
        "rows": rows,
        "paired_why": why,
        "solved": None,
        "dataset": runs[0]["metrics"]["dataset"],
        "split": split,
        "notes": [],
        "allowed": allowed,
        "tost": None,
    }
    if tost_margin is not None:
        loss = rows[0]  # metric_values' first row: the split's loss in nats
        a, b = [r["metrics"][split]["loss"] for r in a_runs], [r["metrics"][split]["loss"] for r in b_runs]
        if len(a) < 2 or len(b) < 2:
            raise UserError("--tost needs at least 2 runs per arm")
        diff, ci90, p = tost(a, b, tost_margin)
        out["tost"] = {"metric": loss["metric"], "margin": tost_margin, "diff": diff, "ci90": ci90, "p": p}
    if solved is not None:
        ks = [sum(r["metrics"][split]["acc"] >= solved for r in members) for members in (a_runs, b_runs)]
        ns = [len(a_runs), len(b_runs)]
        out["solved"] = {
            "threshold": solved,
            "a": (ks[0], ns[0], *wilson(ks[0], ns[0])),
            "b": (ks[1], ns[1], *wilson(ks[1], ns[1])),
            "fisher": fisher(ks[0], ns[0], ks[1], ns[1]),
        }
    for label, members in ((out["arms"][0][0], a_runs), (out["arms"][1][0], b_runs)):
        mixed = mix_warning(members)
        if mixed:
            out["notes"].append(f"warning: the group {key}={label} mixes {mixed}")
    across = {
        name: set(provenance_counts(a_runs, name)) != set(provenance_counts(b_runs, name))
        for name, _ in PROVENANCE_FIELDS
    }
    if any(across.values()):
        out["notes"].append(
            "warning: the two arms differ in "
            + ", ".join(n for n, d in across.items() if d)
            + " (see each arm's provenance)"
        )
    return out


def _num(x, digits):
    return "nan" if x != x else f"{x:+.{digits}f}"


def _p(p):
    return "nan" if p != p else (f"{p:.2g}" if p < 0.001 else f"{p:.3f}")


def compare_markdown(c):
    """compare()'s output as text: a caption, the table of differences, the solve rates and Fisher's test."""
    (_, a_runs), (_, b_runs) = c["arms"]
    a, b = c["labels"]
    key, decide = c["key"], c["decide"]
    digits = {"loss": 4, "acc": 2}
    lines = [
        f"{c['dataset']}, {c['split']} split: {key} = {a} (A, n = {len(a_runs)}) vs {b} (B, n = {len(b_runs)}); "
        f"B − A with its 95 % CI; Welch's t-test, two-sided; separated: p < {ALPHA} ({DECIDE[decide]})",
        f"p (perm.): exact two-sided permutation test of the difference of means over all relabelings (nA + nB <= "
        f"{PERMUTATION_MAX_RUNS}, else —); p (M–W): Mann–Whitney U; complete separation: no run of one arm "
        "reaches the other's",
        f"machines: A {_counted(provenance_counts(a_runs, 'machines'))}; "
        f"B {_counted(provenance_counts(b_runs, 'machines'))}",
        "",
    ]
    if c.get("allowed"):
        lines[-1:] = [f"allowed: the arms also differ in {', '.join(c['allowed'])} (part of the method, --allow)", ""]
    head = ["metric", f"A: {a}", f"B: {b}", "B − A [95 % CI]", "p (Welch)", "p (perm.)", "p (M–W)"]
    head += [f"separated ({DECIDE[decide]})", "runs"]
    paired_on = any(r["paired"] for r in c["rows"])
    if paired_on:
        head += ["paired B − A [95 % CI]", "p (paired)"]
    lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in c["rows"]:
        d = next((v for k, v in digits.items() if k in r["metric"]), 3)
        cells = [r["metric"], _pm(r["a"][:2], d) + f" ({r['a'][2]})", _pm(r["b"][:2], d) + f" ({r['b'][2]})"]
        if r["welch"]:
            diff, (lo, hi), p = r["welch"]
            perm, mw, apart = r["rank"]
            p_decides = p if decide == "welch" else perm
            cells += [
                f"{_num(diff, d)} [{_num(lo, d)}, {_num(hi, d)}]",
                _p(p),
                "—" if perm != perm else _p(perm),
                _p(mw),
                "—" if p_decides != p_decides else ("yes" if p_decides < ALPHA else "no"),
                "complete separation" if apart else "overlap",
            ]
        else:
            cells += ["—"] * 6
        if paired_on:
            diff, (lo, hi), p = r["paired"]
            cells += [f"{_num(diff, d)} [{_num(lo, d)}, {_num(hi, d)}]", _p(p)]
        lines.append("| " + " | ".join(cells) + " |")
    if not paired_on:
        lines += ["", f"paired: not computed ({c['paired_why'] or 'one seed per arm'})"]
    if c["solved"]:
        s = c["solved"]
        lines += [
            "",
            f"solved: {c['split']} accuracy >= {s['threshold']:g}; k / n with its Wilson 95 % interval",
            "",
            "| group | solved | rate [95 % CI] |",
            "|---|---:|---:|",
        ]
        for label, (k, n, rate, (lo, hi)) in ((f"A: {a}", s["a"]), (f"B: {b}", s["b"])):
            lines.append(f"| {label} | {k} / {n} | {100 * rate:.0f} % [{100 * lo:.0f}, {100 * hi:.0f}] |")
        odds, p = s["fisher"]
        lines += [
            "",
            f"Fisher's exact test (two-sided): p = {_p(p)}, odds ratio {odds:.3g}: "
            + ("separated" if p < ALPHA else "not separated")
            + f" (p < {ALPHA})",
        ]
    if c.get("tost"):
        t = c["tost"]
        lo, hi = t["ci90"]
        lines += [
            "",
            f"TOST (equivalence of the {t['metric']} within ±{t['margin']:g}, two one-sided Welch tests at "
            f"{ALPHA}): B − A {_num(t['diff'], 4)}, 90 % CI [{_num(lo, 4)}, {_num(hi, 4)}], p = {_p(t['p'])}: "
            + ("equivalent" if t["p"] < ALPHA else "not shown equivalent")
            + f" (p < {ALPHA})",
        ]
    return "\n".join(lines) + "\n"


def compare_csv(c):
    """compare()'s rows as CSV: metric, each arm's mean/sd/n, Welch's difference, CI, p, and the paired ones; with
    --solved a last row "solved (acc >= T), Fisher": each arm's rate k / n as its mean, n, the difference of
    the rates and Fisher's exact p."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(
        [
            "metric",
            "a",
            "a_mean",
            "a_sd",
            "a_n",
            "b",
            "b_mean",
            "b_sd",
            "b_n",
            "diff",
            "ci_low",
            "ci_high",
            "p",
            "paired_diff",
            "paired_ci_low",
            "paired_ci_high",
            "paired_p",
            "perm_p",
            "mannwhitney_p",
            "complete_separation",
        ]
    )
    a, b = c.get("labels") or [v for v, _ in c["arms"]]
    flat = lambda t: [] if t is None else [t[0], t[1][0], t[1][1], t[2]]  # noqa: E731
    for r in c["rows"]:
        cells = [r["metric"], a, *r["a"], b, *r["b"], *(flat(r["welch"]) or [""] * 4), *(flat(r["paired"]) or [""] * 4)]
        cells += list(r["rank"] or ("", "", ""))
        w.writerow(["" if x is None else (repr(x) if isinstance(x, float) else x) for x in cells])
    if c["solved"]:  # one more row: the solve rates (mean = k / n, sd empty), their difference, Fisher's p
        sa, sb = c["solved"]["a"], c["solved"]["b"]
        w.writerow(
            [
                f"solved (acc >= {c['solved']['threshold']:g}), Fisher",
                a,
                repr(sa[2]),
                "",
                sa[1],
                b,
                repr(sb[2]),
                "",
                sb[1],
                repr(sb[2] - sa[2]),
                "",
                "",
                repr(c["solved"]["fisher"][1]),
                *[""] * 7,
            ]
        )
    if c.get(
        "tost"
    ):  # one more row: the TOST of the loss, its 90 % interval in the CI columns, p the larger one-sided p
        t, r = c["tost"], c["rows"][0]
        w.writerow(
            [
                f"{t['metric']}, TOST ±{t['margin']:g} (90 % CI)",
                a,
                repr(r["a"][0]),
                repr(r["a"][1]),
                r["a"][2],
                b,
                repr(r["b"][0]),
                repr(r["b"][1]),
                r["b"][2],
                repr(t["diff"]),
                repr(t["ci90"][0]),
                repr(t["ci90"][1]),
                repr(t["p"]),
                *[""] * 7,
            ]
        )
    return buf.getvalue()


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
    head += [
        "n",
        "seeds",
        f"{info['split']} loss (nats)",
        f"{info['split']} ppl",
        f"{info['split']} acc (%)",
        "wall per run (min)",
    ] + (["CPU per run (min)"] if info["cpu"] else [])
    head += [f"ppl at {L} ({info['protocol']})" if info["protocol"] else f"ppl at {L}" for L in extrapolation]
    solved = rows and "solved" in rows[0]
    if solved:
        head.append(f"solved, acc >= {info['solved']:g} [Wilson 95 %]")
    n_text = len(by or [0]) + 1  # the grouping columns and seeds are text, left-aligned; numbers right-aligned
    align = ["---"] * (n_text - 1) + ["---:", "---"] + ["---:"] * (len(head) - n_text - 1)
    lines = [
        f"{info['dataset']}, {info['split']} split: mean ± sd over the runs of each group (sample sd, n − 1; "
        f"— for one run); machines: {_counted(info['machines'])}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(align) + "|",
    ]
    for r in rows:
        cells = [_value(v) for v in r["values"]] or ["all"]
        cells += [
            str(r["n"]),
            ", ".join(map(str, r["seeds"])),
            _pm(r["loss"], 4),
            _pm(r["ppl"], 3),
            _pm(r["acc"], 2),
            _pm(r["wall_s"], 1, 60) + ("" if r["wall_n"] in (0, r["n"]) else f" (n={r['wall_n']})"),
        ]
        if info["cpu"]:
            cells.append(_pm(r["cpu_s"], 1, 60) + ("" if r["cpu_n"] in (0, r["n"]) else f" (n={r['cpu_n']})"))
        cells += [_pm(r["ext"][L], 3) for L in extrapolation]
        if solved:
            k, n, _, (lo, hi) = r["solved"]
            cells.append(f"{k} / {n} [{100 * lo:.0f}, {100 * hi:.0f} %]")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_csv(by, rows, info, extrapolation=()):
    """summarize's output as CSV text: the grouping settings, n, seeds (space-separated), then *_mean and *_sd
    per number (acc in %, times in seconds; sd empty for one run, a time empty where no run has it); with
    --solved, solved_k, solved_n and Wilson's 95 % interval of k / n."""
    nums = ["loss", "ppl", "acc_pct", "wall_s", "cpu_s"] + [f"ppl_at_{L}" for L in extrapolation]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    solved = ["solved_k", "solved_n", "solved_ci_low", "solved_ci_high"] if rows and "solved" in rows[0] else []
    w.writerow([*by, "n", "seeds", *(f"{k}_{s}" for k in nums for s in ("mean", "sd")), *solved])
    for r in rows:
        pairs = [r["loss"], r["ppl"], r["acc"], r["wall_s"], r["cpu_s"]] + [r["ext"][L] for L in extrapolation]
        cells = [repr(x) if isinstance(x, float) else "" for p in pairs for x in (p or (None, None))]
        if solved:  # k, n, Wilson's 95 % interval of k / n
            cells += [r["solved"][0], r["solved"][1], repr(r["solved"][3][0]), repr(r["solved"][3][1])]
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
    p = ArgumentParser(
        prog="study/results.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("runs", nargs="*", help="run folders holding metrics.json, or copies of a metrics.json")
    p.add_argument("--by", default="", help="comma-separated settings to group by (default: those that differ)")
    p.add_argument("--split", default="test", choices=["val", "test"])
    p.add_argument("--extrapolation", default="", help="comma-separated context lengths: perplexity there per group")
    p.add_argument("--csv", action="store_true", help="print CSV instead of markdown")
    p.add_argument(
        "--compare",
        default="",
        metavar="KEY",
        help="two arms that differ in KEY only: differences with 95 %% CI and p (Welch; paired if possible)",
    )
    p.add_argument(
        "--solved",
        type=float,
        default=None,
        metavar="THRESHOLD",
        help="count runs with accuracy >= THRESHOLD (in [0, 1]): k / n, Wilson CI; Fisher with --compare",
    )
    p.add_argument(
        "--retrieval",
        default="",
        metavar="TASK@L,...",
        help="with --compare: eval_retrieval.py accuracies, e.g. passkey@256,copy@4096",
    )
    p.add_argument(
        "--tost",
        type=float,
        default=None,
        metavar="MARGIN",
        help="with --compare: TOST equivalence of the split's loss within ±MARGIN nats (e.g. 0.05)",
    )
    p.add_argument(
        "--allow",
        default="",
        metavar="KEY,...",
        help="with --compare: settings the arms may also differ in, as part of the method (e.g. DroPE's "
        "recalibration: learning_rate,max_iters,...); named in the caption",
    )
    p.add_argument(
        "--decide",
        default="welch",
        choices=list(DECIDE),
        help="with --compare: the test whose p < 0.05 is called separated: welch (default) or perm (exact permutation)",
    )
    a = p.parse_args(argv)
    lengths = parse_lengths(a.extrapolation)
    retrieval = parse_retrieval(a.retrieval)
    if retrieval and not a.compare:
        raise UserError("--retrieval applies with --compare=KEY only")
    if a.allow and not a.compare:
        raise UserError("--allow applies with --compare=KEY only")
    if a.tost is not None and not a.compare:
        raise UserError("--tost applies with --compare=KEY only")
    if a.compare:
        if a.by:
            raise UserError("--compare=KEY groups by KEY itself; drop --by")
        allow = [k.strip() for k in a.allow.split(",") if k.strip()]
        c = compare(a.runs, a.compare.strip(), a.split, lengths, a.solved, retrieval, allow, a.tost, a.decide)
        for note in c["notes"]:
            print(note, file=sys.stderr)
        text = (compare_csv if a.csv else compare_markdown)(c)
        print(text, end="")
        return text
    by = [k.strip() for k in a.by.split(",") if k.strip()] or None
    by, rows, info = summarize(a.runs, by, a.split, lengths, a.solved)
    for note in info["notes"]:
        print(note, file=sys.stderr)
    text = (to_csv if a.csv else markdown)(by, rows, info, lengths)
    print(text, end="")
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
