"""study/results.py --compare and --solved: differences with their 95 % intervals and p-values against scipy and
against textbook cases worked by hand, solve rates with Wilson intervals and Fisher's test, the provenance
warnings, and every bad input's exit 2."""

import csv
import io
import json
import math

import pytest
from scipy import stats
from test_results import metrics

import results

BASE = {"dataset": "jsb", "pos_encoding": "pope", "n_layer": 4, "learning_rate": 1e-3}
T_975_DF4 = 2.7764451  # Student's t, 0.975 quantile, 4 degrees of freedom (any printed table)


def prov(cpu="AMD EPYC (AVX512)", commit="c" * 40, torch_version="2.13.0+cpu"):
    name, cap = cpu[:-1].split(" (")
    return {
        "code": {"commit": commit, "dirty": False},
        "versions": {"python": "3.11.7", "torch": torch_version, "triton": "3.7.1", "numpy": "2.4.6"},
        "device": {"device": "cpu", "cpu": name, "cpu_capability": cap, "threads": 1, "gpus": {}},
        "world_size": 1,
    }


def write_run(tmp_path, name, loss, acc=0.5, seed=1, provenance=None, **settings):
    """A metrics.json copy tmp_path/name.json; provenance None writes one from before provenance existed."""
    config = {**BASE, **settings, "seed": seed, "out_dir": f"out/{name}"}
    m = metrics(config, loss, acc, 600.0)
    if provenance is not None:
        m["provenance"] = provenance
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(m))
    return str(path)


def arms(tmp_path, a, b, key="pos_encoding", values=("pope", "rope"), seeds_b=None, provs=None, accs=None):
    """Runs of two arms with test losses a and b (seeds 1.. unless seeds_b), all on one known machine."""
    paths = []
    for arm, losses, seeds in ((values[0], a, range(1, len(a) + 1)), (values[1], b, seeds_b or range(1, len(b) + 1))):
        for i, (loss, seed) in enumerate(zip(losses, seeds)):
            p = (provs or {}).get((arm, i), prov())
            acc = (accs or {}).get(arm, [0.5] * len(losses))[i]
            paths.append(write_run(tmp_path, f"{arm}-s{seed}", loss, acc, seed, p, **{key: arm}))
    return paths


def row(c, metric_start):
    return next(r for r in c["rows"] if r["metric"].startswith(metric_start))


def test_welch_against_a_textbook_case_worked_by_hand(tmp_path):
    # A = 1, 2, 3; B = 3, 4, 5: equal n and variances, so Welch's df = 2 (n − 1) = 4 and t = 2 / sqrt(2/3) = sqrt 6.
    # With 4 df the t distribution's tail is closed-form: p = 1 − (3/2) u (1 − u²/3), u = t / sqrt(4 + t²).
    c = results.compare(arms(tmp_path, [1.0, 2.0, 3.0], [3.0, 4.0, 5.0], seeds_b=[7, 8, 9]), "pos_encoding")
    diff, (lo, hi), p = row(c, "test loss")["welch"]
    u = math.sqrt(6 / 10)
    assert diff == pytest.approx(2.0)
    assert p == pytest.approx(1 - 1.5 * u * (1 - u * u / 3), rel=1e-6)  # 0.070484
    half = T_975_DF4 * math.sqrt(2 / 3)
    assert (lo, hi) == (pytest.approx(2 - half, rel=1e-6), pytest.approx(2 + half, rel=1e-6))  # [-0.267, 4.267]
    assert row(c, "test loss")["paired"] is None and "same seeds" in c["paired_why"]


def test_paired_against_a_textbook_case_worked_by_hand(tmp_path):
    # B − A per seed = 1, 2, 3, 4, 5: mean 3, sd sqrt(2.5), t = 3 / sqrt(0.5) = sqrt 18 with 4 df.
    a = [10.0, 20.0, 30.0, 40.0, 50.0]
    c = results.compare(arms(tmp_path, a, [x + d for x, d in zip(a, [1, 2, 3, 4, 5])]), "pos_encoding")
    diff, (lo, hi), p = row(c, "test loss")["paired"]
    u = math.sqrt(18 / 22)
    assert diff == pytest.approx(3.0) and p == pytest.approx(1 - 1.5 * u * (1 - u * u / 3), rel=1e-6)  # 0.013236
    half = T_975_DF4 * math.sqrt(0.5)
    assert (lo, hi) == (pytest.approx(3 - half, rel=1e-6), pytest.approx(3 + half, rel=1e-6))  # [1.037, 4.963]
    assert row(c, "test loss")["welch"][2] > 0.5  # unpaired, the seeds' spread hides the shift


def test_wilson_and_fisher_against_textbook_cases():
    # Wilson's interval for 7 / 9, from its formula: (p + z²/2n ± z sqrt(p(1 − p)/n + z²/4n²)) / (1 + z²/n)
    z, n, phat = 1.959964, 9, 7 / 9
    centre, half = phat + z * z / (2 * n), z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n))
    rate, (lo, hi) = results.wilson(7, 9)
    assert rate == phat
    assert lo == pytest.approx((centre - half) / (1 + z * z / n), rel=1e-5)  # 0.4526
    assert hi == pytest.approx((centre + half) / (1 + z * z / n), rel=1e-5)  # 0.9368
    # Fisher's lady tasting tea: 3 of 4 cups right each way; two-sided p = 17/35 (hypergeometric, by hand)
    odds, p = results.fisher(3, 4, 1, 4)
    assert p == pytest.approx(17 / 35) and odds == pytest.approx(9.0)
    # 7 / 9 vs 1 / 9: the tables at least as extreme, from the hypergeometric C(9,k)C(9,8−k)/C(18,8)
    probs = [math.comb(9, k) * math.comb(9, 8 - k) / math.comb(18, 8) for k in range(9)]
    assert results.fisher(7, 9, 1, 9)[1] == pytest.approx(sum(q for q in probs if q <= probs[7] * (1 + 1e-9)))


def test_every_number_of_the_comparison_against_scipy(tmp_path):
    a, b = [0.71, 0.69, 0.73, 0.70], [0.74, 0.72, 0.73, 0.728]
    accs = {"pope": [0.95, 0.97, 0.2, 0.91], "rope": [0.3, 0.92, 0.25, 0.4]}
    c = results.compare(arms(tmp_path, a, b, accs=accs), "pos_encoding", solved=0.9)
    welch, paired = stats.ttest_ind(b, a, equal_var=False), stats.ttest_rel(b, a)
    r = row(c, "test loss")
    assert r["a"][:2] == (pytest.approx(sum(a) / 4), pytest.approx(stats.tstd(a))) and r["a"][2] == 4
    assert r["welch"][1] == pytest.approx(tuple(welch.confidence_interval(0.95)))
    assert r["welch"][2] == pytest.approx(welch.pvalue)
    assert r["paired"][1] == pytest.approx(tuple(paired.confidence_interval(0.95)))
    assert r["paired"][2] == pytest.approx(paired.pvalue)
    ppl = row(c, "test ppl")["welch"][2]
    assert ppl == pytest.approx(
        stats.ttest_ind([math.exp(x) for x in b], [math.exp(x) for x in a], equal_var=False).pvalue
    )
    acc = row(c, "test acc")["welch"]
    assert acc[0] == pytest.approx(100 * (sum(accs["rope"]) - sum(accs["pope"])) / 4)
    s = c["solved"]
    assert s["a"][:2] == (3, 4) and s["b"][:2] == (1, 4)  # accuracy >= 0.9, the threshold included
    assert s["fisher"][1] == pytest.approx(stats.fisher_exact([[3, 1], [1, 3]]).pvalue)
    ci = stats.binomtest(3, 4).proportion_ci(0.95, method="wilson")
    assert s["a"][3] == (pytest.approx(ci.low), pytest.approx(ci.high))


def test_the_printed_comparison(tmp_path, capsys):
    paths = arms(tmp_path, [1.0, 2.0, 3.0], [3.0, 4.0, 5.0], accs={"pope": [0.95, 0.9, 0.5], "rope": [0.1] * 3})
    out = results.main([*paths, "--compare=pos_encoding", "--solved=0.9"])
    assert "pos_encoding = pope (A, n = 3) vs rope (B, n = 3)" in out
    assert "machines: A AMD EPYC (AVX512) x3; B AMD EPYC (AVX512) x3" in out
    loss = next(ln for ln in out.splitlines() if ln.startswith("| test loss"))
    # Welch, the exact permutation p (pooled 1, 2, 3, 3, 4, 5: B-sum >= 12 or <= 6 in 4 of 20 splits), Mann–Whitney
    assert "| 2.0000 ± 1.0000 (3) | 4.0000 ± 1.0000 (3) | +2.0000 [-0.2670, +4.2670] | 0.070 |" in loss
    assert "| 0.070 | 0.200 | 0.121 | no | overlap |" in loss
    assert "| +2.0000 [+2.0000, +2.0000] |" in loss  # paired: every seed moved by exactly 2
    assert "| A: pope | 2 / 3 |" in out and "| B: rope | 0 / 3 |" in out
    assert "Fisher's exact test (two-sided): p = 0.400" in out and "not separated" in out
    text = results.main([*paths, "--compare=pos_encoding", "--csv", "--solved=0.9"])
    header, first = text.splitlines()[:2]
    solved = list(csv.reader(io.StringIO(text)))[-1]
    assert solved[0] == "solved (acc >= 0.9), Fisher" and float(solved[2]) == 2 / 3 and solved[4] == "3"
    assert float(solved[6]) == 0.0 and float(solved[12]) == pytest.approx(0.4)
    table = list(csv.reader(io.StringIO(results.main([*paths, "--solved=0.9", "--csv"]))))
    assert table[0][-4:] == ["solved_k", "solved_n", "solved_ci_low", "solved_ci_high"]
    assert table[1][-4:-2] == ["2", "3"] and float(table[1][-2]) == pytest.approx(results.wilson(2, 3)[1][0])
    assert header.startswith("metric,a,a_mean,a_sd,a_n,b,b_mean,b_sd,b_n,diff,ci_low,ci_high,p,paired_diff")
    assert first.startswith("test loss (nats),pope,2.0,1.0,3,rope,4.0,1.0,3,2.0,")


def test_extrapolation_lengths_are_compared_too(tmp_path):
    paths = arms(tmp_path, [1.5, 1.5, 1.5], [1.5, 1.5, 1.5], key="pope_use_delta", values=(True, False))
    ppl = {True: [5.6, 5.9, 5.4], False: [5.2, 5.3, 5.4]}
    for path in paths:
        m = json.load(open(path))
        arm, i = m["config"]["pope_use_delta"], m["config"]["seed"] - 1
        with open(path[: -len(".json")] + ".extrapolation.csv", "w") as f:
            f.write(f"run,label,protocol,length,tokens,ppl\nout/x,pope,tiled,4096,65536,{ppl[arm][i]}\n")
    c = results.compare(paths, "pope_use_delta", extrapolation=[4096])
    r = row(c, "ppl at 4096 (tiled)")
    assert r["welch"][2] == pytest.approx(stats.ttest_ind(ppl[False], ppl[True], equal_var=False).pvalue)
    assert r["welch"][0] == pytest.approx(sum(ppl[False]) / 3 - sum(ppl[True]) / 3)


def test_mixed_machines_and_commits_warn_and_unknown_runs_are_still_read(tmp_path, capsys):
    provs = {("pope", 0): prov(cpu="AMD EPYC (AVX2)"), ("rope", 1): prov(commit="d" * 40)}
    paths = arms(tmp_path, [1.0, 2.0, 3.0], [3.0, 4.0, 5.0], provs=provs)
    c = results.compare(paths, "pos_encoding")
    warn = [n for n in c["notes"] if n.startswith("warning: the group")]
    assert len(warn) == 2
    assert "pos_encoding=pope mixes machines (AMD EPYC (AVX512) x2, AMD EPYC (AVX2) x1)" in warn[0]
    assert "commits" not in warn[0]
    assert "pos_encoding=rope mixes commits (cccccccccccc x2, dddddddddddd x1)" in warn[1]
    assert "machines" not in warn[1]
    assert any(n.startswith("warning: the two arms differ in machines, commits") for n in c["notes"])
    assert c["rows"][0]["paired"] is None and "one machine" in c["paired_why"]
    # runs from before provenance: "unknown", read all the same; the plain table names the machines
    old = [write_run(tmp_path, f"old-s{s}", 1.0 + s, seed=s + 10) for s in range(2)]
    by, rows, info = results.summarize(old + paths[:3], by=["pos_encoding"])
    assert info["machines"] == {"unknown": 2, "AMD EPYC (AVX512)": 2, "AMD EPYC (AVX2)": 1}
    assert any("mixes machines (AMD EPYC (AVX512) x2, unknown x2, AMD EPYC (AVX2) x1)" in n for n in info["notes"])
    out = results.main(old)
    assert "machines: unknown x2" in out and capsys.readouterr().err == ""  # one machine, if unknown: no warning


def test_solved_without_compare_adds_the_rate_per_group(tmp_path):
    paths = arms(tmp_path, [1.0, 2.0, 3.0], [3.0, 4.0, 5.0], accs={"pope": [0.95, 0.9, 0.5], "rope": [0.1] * 3})
    out = results.main(paths + ["--solved=0.9"])
    lo, hi = results.wilson(2, 3)[1]
    assert f"| 2 / 3 [{100 * lo:.0f}, {100 * hi:.0f} %] |" in out and "| 0 / 3 [0, 56 %] |" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--compare=n_layer"], "splits the runs into 1 group(s) (4); give the runs of exactly two values"),
        (["--compare=no_such"], "no run has the setting 'no_such'"),
        (["--compare=pos_encoding", "--solved=90"], "in [0, 1] (e.g. 0.9 for 90 %), got 90.0"),
        (["--solved=-0.1"], "in [0, 1]"),
        (["--compare=pos_encoding", "--by=seed"], "drop --by"),
    ],
)
def test_bad_comparisons_exit_2_with_one_line(tmp_path, capsys, args, message):
    paths = arms(tmp_path, [1.0, 2.0], [3.0, 4.0])
    with pytest.raises(SystemExit) as e:
        results.main(paths + args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_arms_that_differ_in_more_than_one_thing_or_hold_one_run_are_refused(tmp_path, capsys):
    paths = arms(tmp_path, [1.0, 2.0], [3.0, 4.0])
    three = paths + [write_run(tmp_path, "alibi", 1.0, provenance=prov(), pos_encoding="alibi_half")]
    other = paths + [write_run(tmp_path, "lr", 1.0, seed=5, provenance=prov(), learning_rate=3e-3)]
    one = paths[:2] + paths[3:]
    for runs, message in (
        (three, "splits the runs into 3 group(s) (pope, rope, alibi_half)"),
        (other, "also differ in learning_rate; a comparison changes one setting"),
        (one, "the group pos_encoding=rope has 1 run; a t-test needs at least 2 runs per group"),
    ):
        with pytest.raises(SystemExit) as e:
            results.main(runs + ["--compare=pos_encoding"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err, err
    # a group of one is fine for the solve counts alone (Fisher's test needs no spread)
    c = results.compare(one, "pos_encoding", solved=0.6)
    assert c["solved"]["b"][:2] == (0, 1) and row(c, "test loss")["welch"] is None


def test_allow_lets_the_arms_differ_in_the_methods_own_settings_and_names_them(tmp_path, capsys):
    """DroPE against its RoPE runs: a recalibration with its own learning rate and length. --allow names
    the settings that belong to the method; any other difference is still refused, and the numbers are
    the plain comparison's (the same Welch test on the same values)."""
    rope = [
        write_run(tmp_path, f"rope-s{s}", x, seed=s, provenance=prov(), pos_encoding="rope")
        for s, x in ((1, 1.0), (2, 2.0), (3, 3.0))
    ]
    drope = [
        write_run(
            tmp_path, f"drope-s{s}", x, seed=s, provenance=prov(), pos_encoding="none", learning_rate=3e-4, max_iters=60
        )
        for s, x in ((1, 3.0), (2, 4.0), (3, 5.0))
    ]
    with pytest.raises(SystemExit) as e:
        results.main(rope + drope + ["--compare=pos_encoding"])
    assert e.value.code == 2 and "also differ in learning_rate, max_iters" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        results.main(rope + drope + ["--compare=pos_encoding", "--allow=learning_rate"])
    assert e.value.code == 2 and "also differ in max_iters; " in capsys.readouterr().err
    text = results.main(rope + drope + ["--compare=pos_encoding", "--allow=max_iters, learning_rate"])
    assert "allowed: the arms also differ in learning_rate, max_iters (part of the method, --allow)" in text
    c = results.compare(rope + drope, "pos_encoding", allow=("learning_rate", "max_iters"))
    assert c["rows"][0]["welch"][0] == pytest.approx(2.0) and c["rows"][0]["paired"][0] == pytest.approx(2.0)
    with pytest.raises(SystemExit) as e:
        results.main(rope + ["--allow=learning_rate"])
    assert e.value.code == 2 and "--allow applies with --compare=KEY only" in capsys.readouterr().err


def test_pairing_needs_a_known_machine_and_a_resume_on_another_machine_counts(tmp_path):
    a, b = [1.0, 2.0, 3.0], [3.0, 4.5, 5.0]
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    unknown = arms(tmp_path / "old", a, b, provs={(arm, i): None for arm in ("pope", "rope") for i in range(3)})
    c = results.compare(unknown, "pos_encoding")  # same seeds, but nothing says the machine was the same
    assert (
        c["rows"][0]["paired"] is None and c["paired_why"] == "not all runs are known to share one machine (unknown x6)"
    )
    paths = arms(tmp_path / "new", a, b)
    assert results.compare(paths, "pos_encoding")["rows"][0]["paired"] is not None
    m = json.load(open(paths[0]))  # pope seed 1 was resumed: its first process ran on an AVX2 machine
    m["provenance_earlier"] = [prov(cpu="AMD EPYC (AVX2)")]
    open(paths[0], "w").write(json.dumps(m))
    c = results.compare(paths, "pos_encoding")
    assert "pos_encoding=pope mixes machines (AMD EPYC (AVX512) x3, AMD EPYC (AVX2) x1)" in c["notes"][0]
    assert c["rows"][0]["paired"] is None


def test_arms_scored_with_different_protocols_are_refused(tmp_path, capsys):
    paths = arms(tmp_path, [1.5, 1.5], [1.5, 1.5])
    for i, path in enumerate(paths):  # arm A tiled, arm B sliding: the same length, another measurement
        protocol = "tiled" if i < 2 else "sliding"
        with open(path[: -len(".json")] + ".extrapolation.csv", "w") as f:
            f.write(f"run,label,protocol,length,tokens,ppl\nout/x,pope,{protocol},4096,65536,{5 + i}\n")
    with pytest.raises(SystemExit) as e:
        results.main(paths + ["--compare=pos_encoding", "--extrapolation=4096"])
    assert e.value.code == 2 and "different protocols (sliding, tiled)" in capsys.readouterr().err


# ---- round five (issue 43): the CSV's columns, printed p-values, no spread, repeated seeds, provenance counts ----


def _csv_rows(text):
    return {r["metric"]: r for r in csv.DictReader(io.StringIO(text))}


def test_compare_csv_columns_are_b_minus_a_with_the_low_end_first_against_scipy(tmp_path, capsys):
    # unequal arms (A: 3 runs, B: 4), B below A, paired off (B has a seed A lacks): every column by its name
    a, b = [2.10, 2.30, 2.05], [1.60, 1.75, 1.52, 1.90]
    paths = arms(tmp_path, a, b)
    rows = _csv_rows(results.main([*paths, "--compare=pos_encoding", "--csv"]))
    r = rows["test loss (nats)"]
    ref = stats.ttest_ind(b, a, equal_var=False)
    ci = ref.confidence_interval(0.95)
    assert (r["a"], r["b"], r["a_n"], r["b_n"]) == ("pope", "rope", "3", "4")
    assert float(r["a_mean"]) == pytest.approx(sum(a) / 3) and float(r["b_mean"]) == pytest.approx(sum(b) / 4)
    assert float(r["a_sd"]) == pytest.approx(stats.tstd(a)) and float(r["b_sd"]) == pytest.approx(stats.tstd(b))
    assert float(r["diff"]) == pytest.approx(sum(b) / 4 - sum(a) / 3) and float(r["diff"]) < 0
    assert float(r["ci_low"]) == pytest.approx(ci.low) and float(r["ci_high"]) == pytest.approx(ci.high)
    assert float(r["ci_low"]) < float(r["diff"]) < float(r["ci_high"])
    assert float(r["p"]) == pytest.approx(ref.pvalue)
    assert r["paired_diff"] == r["paired_ci_low"] == r["paired_ci_high"] == r["paired_p"] == ""
    # paired: seeds 1..3 in both arms, B − A per seed = −0.5, −0.3, −0.6
    b3 = [2.10 - 0.5, 2.30 - 0.3, 2.05 - 0.6]
    (tmp_path / "p").mkdir()
    r = _csv_rows(results.main([*arms(tmp_path / "p", a, b3), "--compare=pos_encoding", "--csv"]))["test loss (nats)"]
    ref = stats.ttest_rel(b3, a)
    ci = ref.confidence_interval(0.95)
    assert float(r["paired_diff"]) == pytest.approx(-1.4 / 3)
    assert float(r["paired_ci_low"]) == pytest.approx(ci.low) and float(r["paired_ci_high"]) == pytest.approx(ci.high)
    assert float(r["paired_ci_low"]) < float(r["paired_ci_high"]) < 0
    assert float(r["paired_p"]) == pytest.approx(ref.pvalue)
    # the markdown of the same comparison: B − A, then [low, high], for Welch and paired
    out = results.main([*arms(tmp_path / "p", a, b3), "--compare=pos_encoding"])
    cells = [
        x.strip() for x in next(ln for ln in out.splitlines() if ln.startswith("| test loss")).strip("|").split("|")
    ]
    w = stats.ttest_ind(b3, a, equal_var=False).confidence_interval(0.95)
    assert cells[3] == f"{-1.4 / 3:+.4f} [{w.low:+.4f}, {w.high:+.4f}]"
    assert cells[9] == f"{-1.4 / 3:+.4f} [{ci.low:+.4f}, {ci.high:+.4f}]"


def test_small_p_values_print_with_two_significant_digits_not_as_zero(tmp_path):
    # B − A = −1 with a tiny spread: p of order 1e-7; Welch and paired p both print as scipy's value, 2 digits
    a = [5.00, 5.01, 4.99, 5.02]
    b = [x - 1.0 + e for x, e in zip(a, [0.001, -0.002, 0.0015, 0.0])]
    out = results.main([*arms(tmp_path, a, b), "--compare=pos_encoding"])
    line = next(ln for ln in out.splitlines() if ln.startswith("| test loss"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    welch_p, paired_p = stats.ttest_ind(b, a, equal_var=False).pvalue, stats.ttest_rel(b, a).pvalue
    assert welch_p < 1e-5 and paired_p < 1e-5
    assert cells[4] == f"{welch_p:.2g}" and float(cells[4]) == pytest.approx(welch_p, rel=0.05)
    assert cells[7] == "yes" and cells[8] == "complete separation"
    assert cells[10] == f"{paired_p:.2g}" and float(cells[10]) == pytest.approx(paired_p, rel=0.05)
    # at and above 0.001: three decimals, within half a unit of the third
    for p in (0.001, 0.0123, 0.5):
        assert abs(float(results._p(p)) - p) <= 0.0005 and len(results._p(p).split(".")[1]) == 3
    for p in (0.00099, 3.2e-5, 1e-300):
        assert float(results._p(p)) == pytest.approx(p, rel=0.05) and float(results._p(p)) > 0


def test_a_metric_with_no_spread_in_either_arm_is_not_called_separated_or_not(tmp_path):
    # every run of both arms solves the task (acc 1.0): the accuracy difference is 0 with no spread; the t-test
    # is undefined (0 / 0), so p is nan and "separated" is a dash, in the markdown and in the CSV
    a, b = [1.0, 1.2, 1.1], [1.3, 1.5, 1.35]
    paths = arms(tmp_path, a, b, accs={"pope": [1.0] * 3, "rope": [1.0] * 3})
    c = results.compare(paths, "pos_encoding")
    diff, (lo, hi), p = row(c, "test acc")["welch"]
    assert diff == 0 and p != p
    out = results.compare_markdown(c)
    cells = [
        x.strip() for x in next(ln for ln in out.splitlines() if ln.startswith("| test acc")).strip("|").split("|")
    ]
    assert cells[1] == "100.00 ± 0.00 (3)" and cells[4] == "nan" and cells[7] == "—"
    r = _csv_rows(results.compare_csv(c))["test acc (%)"]
    assert r["a_sd"] == r["b_sd"] == "0.0" and r["p"] == "nan"
    # the loss row beside it is an ordinary test
    assert row(c, "test loss")["welch"][2] == pytest.approx(stats.ttest_ind(b, a, equal_var=False).pvalue)


def test_arms_that_repeat_a_seed_are_not_paired(tmp_path):
    a, b = [1.0, 1.4, 1.2], [1.5, 1.6, 1.9]
    # A runs seeds 1, 1, 2 (the same seed twice, in two folders), B 1, 1, 2: the multisets agree, yet a pair per
    # seed does not exist
    paths = []
    for arm, losses, seeds in (("pope", a, [1, 1, 2]), ("rope", b, [1, 1, 2])):
        for i, (loss, seed) in enumerate(zip(losses, seeds)):
            paths.append(write_run(tmp_path, f"{arm}-{i}", loss, seed=seed, provenance=prov(), pos_encoding=arm))
    c = results.compare(paths, "pos_encoding")
    assert c["rows"][0]["paired"] is None and "same seeds" in c["paired_why"]
    assert c["rows"][0]["welch"][2] == pytest.approx(stats.ttest_ind(b, a, equal_var=False).pvalue)
    # A 1, 2, 3 and B 1, 2, 2, 3: the same set of seeds, but B repeats one
    (tmp_path / "b").mkdir()
    paths = arms(tmp_path / "b", [1.0, 1.4, 1.2], [1.5, 1.6, 1.9, 1.7], seeds_b=[1, 2, 2, 3])
    paths = [p for p in paths if p.endswith(("pope-s1.json", "pope-s2.json", "pope-s3.json"))] + [
        write_run(tmp_path / "b", f"rope-{i}", x, seed=s, provenance=prov(), pos_encoding="rope")
        for i, (x, s) in enumerate(zip([1.5, 1.6, 1.9, 1.7], [1, 2, 2, 3]))
    ]
    c = results.compare(paths, "pos_encoding")
    assert c["rows"][0]["paired"] is None and "same seeds" in c["paired_why"]
    assert "paired: not computed (the arms do not hold the same seeds" in results.compare_markdown(c)


def test_machine_and_commit_counts_count_runs_not_processes_in_arms_of_unequal_size(tmp_path, capsys):
    # A: 3 runs, one of them resumed twice on the same machine and commit; B: 2 runs. Each run counts once.
    paths = arms(tmp_path, [1.0, 1.2, 1.1], [1.5, 1.7])
    m = json.load(open(paths[0]))
    m["provenance_earlier"] = [prov(), prov()]
    open(paths[0], "w").write(json.dumps(m))
    out = results.main([*paths, "--compare=pos_encoding"])
    assert "machines: A AMD EPYC (AVX512) x3; B AMD EPYC (AVX512) x2" in out
    assert "n = 3) vs rope (B, n = 2)" in out
    assert capsys.readouterr().err == ""  # one machine, one commit, one library set: nothing to warn about
    by, rows, info = results.summarize(paths)
    assert info["machines"] == {"AMD EPYC (AVX512)": 5} and info["notes"] == []
    # the resumed run's second process ran another commit: that run counts under both commits, once each
    m["provenance_earlier"] = [prov(), prov(commit="d" * 40)]
    open(paths[0], "w").write(json.dumps(m))
    c = results.compare(paths, "pos_encoding")
    assert c["notes"][0] == "warning: the group pos_encoding=pope mixes commits (cccccccccccc x3, dddddddddddd x1)"
    assert c["notes"][1] == "warning: the two arms differ in commits (see each arm's provenance)"
    # arms of unequal size on one machine do not "differ in machines"
    (tmp_path / "u").mkdir()
    c = results.compare(arms(tmp_path / "u", [1.0, 1.2, 1.1, 1.3], [1.5, 1.7]), "pos_encoding")
    assert c["notes"] == []
    r = row(c, "test loss")
    assert r["a"][2] == 4 and r["b"][2] == 2
    assert r["welch"][2] == pytest.approx(stats.ttest_ind([1.5, 1.7], [1.0, 1.2, 1.1, 1.3], equal_var=False).pvalue)


def test_solved_csv_columns_hold_k_n_and_wilsons_ends_in_order(tmp_path):
    accs = {"pope": [0.95, 0.97, 0.2, 0.91, 0.99], "rope": [0.3, 0.92, 0.25, 0.4, 0.1]}
    paths = arms(tmp_path, [1.0, 1.1, 1.2, 1.3, 1.4], [1.5, 1.6, 1.7, 1.8, 1.9], accs=accs)
    table = list(csv.DictReader(io.StringIO(results.main([*paths, "--solved=0.9", "--csv"]))))
    for r, k in zip(table, (4, 1)):
        ci = stats.binomtest(k, 5).proportion_ci(0.95, method="wilson")
        assert (r["solved_k"], r["solved_n"]) == (str(k), "5")
        assert float(r["solved_ci_low"]) == pytest.approx(ci.low) and float(r["solved_ci_high"]) == pytest.approx(
            ci.high
        )
    solved = _csv_rows(results.main([*paths, "--compare=pos_encoding", "--solved=0.9", "--csv"]))[
        "solved (acc >= 0.9), Fisher"
    ]
    assert (
        float(solved["a_mean"]) == 0.8
        and float(solved["b_mean"]) == 0.2
        and float(solved["diff"]) == pytest.approx(-0.6)
    )
    assert float(solved["p"]) == pytest.approx(stats.fisher_exact([[4, 1], [1, 4]]).pvalue)


def test_two_seeds_per_arm_are_paired_too(tmp_path):
    # B − A per seed = 0.5, 0.7: mean 0.6, sd 0.1 sqrt 2, t = 0.6 / 0.1 = 6 with 1 df, where Student's t is
    # Cauchy's distribution: two-sided p = 1 − (2 / π) atan 6, and t_{0.975, 1} = tan(0.475 π) = 12.706
    c = results.compare(arms(tmp_path, [1.0, 2.0], [1.5, 2.7]), "pos_encoding")
    diff, (lo, hi), p = row(c, "test loss")["paired"]
    half = math.tan(0.475 * math.pi) * 0.1
    assert diff == pytest.approx(0.6) and p == pytest.approx(1 - 2 * math.atan(6) / math.pi)
    assert (lo, hi) == (pytest.approx(0.6 - half), pytest.approx(0.6 + half))


def test_an_arm_is_labelled_by_the_setting_that_differs_and_the_header_names_the_deciding_test(tmp_path, capsys):
    """Issue 69: RoPE + YaRN (a rope run with rope_scaling and rope_original_block_size) against PoPE was printed
    "rope", and "separated" did not say which p decided it. The YaRN arm is named by its own settings; a setting
    that belongs to the method but not to an encoding (learning_rate) names no arm; the header names the test, and
    --decide=perm makes the exact permutation p decide: 3 against 3 in complete separation gives perm p = 2 / 20 =
    0.1 (not separated) where Welch's p is 1e-4 (separated)."""
    pope = [
        write_run(tmp_path, f"pope-s{s}", x, seed=s, provenance=prov(), rope_scaling=1.0, rope_original_block_size=0)
        for s, x in ((1, 1.0), (2, 1.1), (3, 1.2))
    ]
    yarn = [
        write_run(
            tmp_path,
            f"yarn-s{s}",
            x,
            seed=s,
            provenance=prov(),
            pos_encoding="rope",
            rope_scaling=4.0,
            rope_original_block_size=256,
            learning_rate=3e-4,
        )
        for s, x in ((1, 2.0), (2, 2.1), (3, 2.2))
    ]
    allow = "--allow=learning_rate,rope_original_block_size,rope_scaling"
    text = results.main(pope + yarn + ["--compare=pos_encoding", allow])
    yarn_label = "rope (rope_original_block_size=256, rope_scaling=4.0)"
    assert f"pos_encoding = pope (A, n = 3) vs {yarn_label} (B, n = 3)" in text
    head = next(ln for ln in text.splitlines() if ln.startswith("| metric"))
    cells = [x.strip() for x in head.strip("|").split("|")]
    assert cells[1:3] == ["A: pope", f"B: {yarn_label}"] and cells[7] == "separated (Welch p)"
    loss = [
        x.strip() for x in next(ln for ln in text.splitlines() if ln.startswith("| test loss")).strip("|").split("|")
    ]
    assert float(loss[4]) < 0.001 and loss[5] == "0.100" and loss[7] == "yes"
    assert text.splitlines()[0].endswith("separated: p < 0.05 (Welch p)")
    text = results.main(pope + yarn + ["--compare=pos_encoding", allow, "--decide=perm"])
    head = next(ln for ln in text.splitlines() if ln.startswith("| metric"))
    assert [x.strip() for x in head.strip("|").split("|")][7] == "separated (perm. p)"
    loss = [
        x.strip() for x in next(ln for ln in text.splitlines() if ln.startswith("| test loss")).strip("|").split("|")
    ]
    assert loss[5] == "0.100" and loss[7] == "no"
    assert (
        list(csv.reader(io.StringIO(results.main(pope + yarn + ["--compare=pos_encoding", allow, "--csv"]))))[1][5]
        == yarn_label
    )
    # a setting of the method that is no encoding's own names no arm: DroPE ("none", its own lr) against RoPE
    drope = [
        write_run(tmp_path, f"drope-s{s}", x, seed=s, provenance=prov(), pos_encoding="none", learning_rate=3e-4)
        for s, x in ((1, 3.0), (2, 3.1))
    ]
    rope = [
        write_run(tmp_path, f"rope-s{s}", x, seed=s, provenance=prov(), pos_encoding="rope")
        for s, x in ((1, 1), (2, 2))
    ]
    assert results.compare(rope + drope, "pos_encoding", allow=("learning_rate",))["labels"] == ["rope", "none"]
    with pytest.raises(SystemExit) as e:
        results.main(pope + yarn + ["--compare=pos_encoding", allow, "--decide=mw"])
    assert e.value.code == 2 and "--decide" in capsys.readouterr().err
