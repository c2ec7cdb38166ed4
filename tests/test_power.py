"""study/power.py: the power of Welch's, the paired t- and Fisher's tests and the n a study needs, against
independent references (scipy's tests applied to simulated or enumerated outcomes) and the numbers
docs/cpu_scale.md section 5 registered."""

import itertools
import math

import numpy as np
import pytest
from scipy import integrate, stats

import power


@pytest.mark.parametrize("n", [2, 3, 5, 8, 11])
def test_fisher_pvalues_are_scipys_for_every_table(n):
    got = power.fisher_pvalues(n)
    for k_a, k_b in itertools.product(range(n + 1), repeat=2):
        want = stats.fisher_exact([[k_a, n - k_a], [k_b, n - k_b]]).pvalue
        assert got[k_a, k_b] == pytest.approx(want, rel=1e-9, abs=1e-15), (k_a, k_b)


@pytest.mark.parametrize("p_a, p_b, n", [(7 / 9, 1 / 9, 11), (0.9, 0.3, 7), (0.2, 0.2, 9), (1.0, 0.0, 4)])
def test_fisher_power_sums_the_binomial_probability_of_every_separated_outcome(p_a, p_b, n):
    want = sum(
        stats.binom.pmf(k_a, n, p_a) * stats.binom.pmf(k_b, n, p_b)
        for k_a, k_b in itertools.product(range(n + 1), repeat=2)
        if stats.fisher_exact([[k_a, n - k_a], [k_b, n - k_b]]).pvalue < 0.05
    )
    assert power.fisher_power(p_a, p_b, n) == pytest.approx(want, abs=1e-12)


def _simulated_power(diff, sd_a, sd_b, n, equal_var, sims=200_000, seed=0):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(0.0, sd_a, (sims, n)), rng.normal(diff, sd_b, (sims, n))
    return float((stats.ttest_ind(b, a, axis=1, equal_var=equal_var).pvalue < 0.05).mean())


@pytest.mark.parametrize("diff, sd, n", [(1.0, 1.0, 8), (0.3, 0.2, 4), (-0.5, 0.4, 12)])
def test_welch_power_is_exact_when_the_sds_are_equal(diff, sd, n):
    # equal sds and n: the Welch-Satterthwaite df is 2n − 2 and the noncentral t is the exact power of
    # Student's t-test; the simulation's standard error is below 0.0012
    assert power.welch_power(diff, sd, sd, n) == pytest.approx(_simulated_power(diff, sd, sd, n, True), abs=0.004)


@pytest.mark.parametrize(
    "diff, sd_a, sd_b, n", [(0.0165, 0.0153, 0.0058, 10), (0.374, 0.243, 0.132, 6), (0.0165, 0.0153, 0.0058, 4)]
)
def test_welch_power_approximates_the_welch_test_with_unequal_sds(diff, sd_a, sd_b, n):
    sim = _simulated_power(diff, sd_a, sd_b, n, False)
    assert power.welch_power(diff, sd_a, sd_b, n) == pytest.approx(sim, abs=0.015)


def test_paired_power_is_the_one_sample_t_tests_known_answer():
    # one-sample t-test, two-sided alpha 0.05, effect size 1 (mean / sd), n = 10: power 0.8031 (R's
    # pwr.t.test(n = 10, d = 1, type = "one.sample") gives 0.8030962; checked below by integration too)
    assert power.paired_power(1.0, 1.0, 10) == pytest.approx(0.8031, abs=5e-5)
    assert power.paired_power(-0.38, 0.38, 10) == pytest.approx(0.8031, abs=5e-5)  # sign and unit free
    # the same power as an integral over the chi-square of the sample variance, without the noncentral t
    df, t = 9, stats.t.ppf(0.975, 9)
    reject = lambda v: (
        (
            stats.norm.sf(t * np.sqrt(v / df) - np.sqrt(10))  # noqa: E731
            + stats.norm.cdf(-t * np.sqrt(v / df) - np.sqrt(10))
        )
        * stats.chi2.pdf(v, df)
    )
    assert power.paired_power(1.0, 1.0, 10) == pytest.approx(integrate.quad(reject, 0, np.inf)[0], abs=1e-7)


@pytest.mark.parametrize("diff, sd_diff, n", [(0.5, 1.0, 6), (0.38, 0.2, 3), (-0.2, 0.3, 12)])
def test_paired_power_is_the_simulated_paired_test(diff, sd_diff, n):
    # pairs whose shared part (the seed) is large and cancels: only the differences' sd matters
    rng = np.random.default_rng(1)
    seed_effect = rng.normal(0.0, 5.0, (200_000, n, 1))
    pairs = seed_effect + np.stack([np.zeros((200_000, n)), rng.normal(diff, sd_diff, (200_000, n))], -1)
    sim = float((stats.ttest_rel(pairs[..., 1], pairs[..., 0], axis=1).pvalue < 0.05).mean())
    assert power.paired_power(diff, sd_diff, n) == pytest.approx(sim, abs=0.004)


def test_far_tails_stay_finite():
    # scipy's nct.cdf is nan far in a tail (df = 1, ncp ~ 70): section 5's C pairs at n = 2
    assert power.paired_power(0.380, 0.0055, 2) == pytest.approx(1.0, abs=1e-9)
    for n in range(2, 8):
        for ncp in (50.0, 70.0, 120.0):
            assert np.isfinite(power.paired_power(ncp / np.sqrt(n), 1.0, n))
            assert power.welch_power(-ncp, 1.0, 1.0, n) == pytest.approx(power.welch_power(ncp, 1.0, 1.0, n))


def test_no_difference_has_the_power_alpha():
    assert power.welch_power(0.0, 0.3, 0.1, 7) == pytest.approx(0.05, abs=1e-12)
    assert power.welch_power(0.0, 0.3, 0.1, 7, alpha=0.01) == pytest.approx(0.01, abs=1e-12)
    assert power.paired_power(0.0, 0.3, 4) == pytest.approx(0.05, abs=1e-12)


def test_the_registered_study_sizes_reproduce():
    # docs/cpu_scale.md section 5: power by n per arm and the registered n of each comparison
    fisher = lambda n: power.fisher_power(7 / 9, 1 / 9, n)  # noqa: E731
    jsb = lambda n: power.welch_power(0.0165, 0.0153, 0.0058, n)  # noqa: E731
    delta = lambda n: power.welch_power(0.374, 0.243, 0.132, n)  # noqa: E731
    for power_at, table, registered in (
        (fisher, {9: 0.77, 10: 0.78, 11: 0.86, 12: 0.91}, 11),
        (jsb, {8: 0.72, 9: 0.78, 10: 0.83, 12: 0.90}, 10),
        (delta, {5: 0.72, 6: 0.82, 7: 0.89}, 6),
    ):
        assert {n: round(power_at(n), 2) for n in table} == table
        assert power.n_required(power_at, max_n=30)[0] == registered


def test_n_required_is_where_the_power_stays_above_the_target():
    # not monotone (Fisher at small n): 5 reaches 0.8, 6 falls back, from 7 on it holds
    curve = {2: 0.1, 3: 0.5, 4: 0.7, 5: 0.85, 6: 0.79, 7: 0.81, 8: 0.9, 9: 0.95, 10: 0.97}
    n, powers = power.n_required(curve.get, max_n=10)
    assert n == 7 and powers == curve
    assert power.n_required(lambda n: 0.5, max_n=10)[0] is None


@pytest.mark.parametrize(
    "call",
    [
        lambda: power.welch_power(1, 1, 1, 1),
        lambda: power.welch_power(1, 0, 0, 5),
        lambda: power.welch_power(1, -1, 1, 5),
        lambda: power.fisher_power(1.2, 0.5, 5),
        lambda: power.fisher_power(0.5, 0.5, 5, alpha=0),
        lambda: power.paired_power(1, 0, 5),
        lambda: power.paired_power(1, 1, 1),
        lambda: power.n_required(lambda n: 1.0, target=1.0),
    ],
)
def test_bad_values_raise(call):
    with pytest.raises(ValueError):
        call()


def test_the_command_line_prints_the_table_and_the_n(capsys):
    power.main(["fisher", "7/9", "1/9", "--max_n=30"])
    out = capsys.readouterr().out
    assert "| 11 | 0.860 |" in out and "| 10 | 0.783 |" in out and "from n = 11 runs per arm" in out
    power.main(["welch", "0.374", "0.243", "0.132", "--n=4"])
    assert "power 0.570 at n = 4 per arm" in capsys.readouterr().out
    power.main(["paired", "1", "1", "--max_n=30"])
    out = capsys.readouterr().out
    assert "| 10 | 0.803 |" in out and "from n = 10 runs per arm" in out
    for argv, value in (
        (["paired", "1", "1", "--n=10"], power.paired_power(1, 1, 10, 0.01)),
        (["welch", "0.374", "0.243", "0.132", "--n=4"], power.welch_power(0.374, 0.243, 0.132, 4, 0.01)),
        (["fisher", "7/9", "1/9", "--n=11"], power.fisher_power(7 / 9, 1 / 9, 11, 0.01)),
    ):
        power.main(argv + ["--alpha=0.01"])  # --alpha reaches every test
        assert f"alpha = 0.01: power {value:.3f}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["fisher", "7/9", "x"], "k/n or a fraction"),
        (["fisher", "7/9", "10/9"], "must lie in [0, 1]"),
        (["welch", "1", "1"], "takes DIFF SD_A SD_B"),
        (["paired", "1"], "takes DIFF SD_DIFF"),
        (["paired", "1", "0"], "must be > 0"),
        (["welch", "1", "0", "0"], "not both 0"),
        (["welch", "1", "1", "1", "--n=1"], "integer >= 2"),
        (["welch", "1", "1", "1", "--max_n=1"], "integer >= 2"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        power.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def _table(out):
    """The printed table's rows as [(n, power text)]."""
    return [
        (int(c[0]), c[1])
        for c in (ln.strip("|").split("|") for ln in out.splitlines() if ln.startswith("| "))
        if c[0].strip().isdigit()
    ]


def _paired_reference(diff, sd, n, alpha=0.05):
    """The paired t-test's power straight from scipy: P(T > t) + P(T < -t),
    T noncentral t (n - 1, diff sqrt(n) / sd)."""
    t = stats.t.ppf(1 - alpha / 2, n - 1)
    ncp = diff * math.sqrt(n) / sd
    return stats.nct.sf(t, n - 1, ncp) + stats.nct.cdf(-t, n - 1, ncp)


def test_the_table_runs_from_2_to_two_past_the_n_it_reports_and_brackets_it(capsys):
    power.main(["paired", "1", "1", "--max_n=30"])
    out = capsys.readouterr().out
    rows = _table(out)
    assert [m for m, _ in rows] == list(range(2, 13))
    for m, text in rows:
        assert text.strip() == f"{_paired_reference(1, 1, m):.3f}", m
    n = int(out.split("from n = ")[1].split()[0])
    assert n == 10 and _paired_reference(1, 1, n - 1) < 0.8 <= _paired_reference(1, 1, n)
    power.main(["paired", "1", "1", "--max_n=10"])  # reached at --max_n itself: no row past it
    out = capsys.readouterr().out
    assert [m for m, _ in _table(out)] == list(range(2, 11)) and "from n = 10 runs per arm" in out


@pytest.mark.parametrize("max_n, want", [(14, [*range(2, 11), 14]), (6, [2, 3, 4, 5, 6]), (10, list(range(2, 11)))])
def test_a_power_never_reached_prints_2_to_10_and_max_n_each_once(max_n, want, capsys):
    power.main(["paired", "0.1", "1", f"--max_n={max_n}"])
    out = capsys.readouterr().out
    rows = _table(out)
    assert [m for m, _ in rows] == want
    for m, text in rows:
        assert text.strip() == f"{_paired_reference(0.1, 1, m):.3f}", m
    assert out.rstrip().endswith(f"80% power is not reached by n = {max_n} runs per arm (--max_n)")
    assert "from n =" not in out


def test_the_target_counts_as_reached_and_alpha_as_not_separated():
    # n_required: power >= target reaches it (a curve that hits 0.8 exactly at n = 3)
    assert power.n_required({2: 0.5, 3: 0.8, 4: 0.9}.get, max_n=4)[0] == 3
    # Fisher at n = 2: the smallest two-sided p is 1/6 + 1/6 = 1/3 (2 of 4 runs solved, all in one arm; by hand
    # from the hypergeometric 1/6, 4/6, 1/6). "Separated" is p < alpha, as in study/results.py: at alpha = that p
    # nothing separates, just above it the two one-arm outcomes do, with probability 0.99^4 + 0.01^4
    p_min = power.fisher_pvalues(2).min()
    assert p_min == pytest.approx(1 / 3)
    assert power.fisher_power(0.99, 0.01, 2, alpha=p_min) == 0.0
    assert power.fisher_power(0.99, 0.01, 2, alpha=p_min * 1.0001) == pytest.approx(0.99**4 + 0.01**4)


def _complete_separation_power(diff, sd_a, sd_b, n):
    """P(every b > every a) + P(every b < every a), a ~ N(0, sd_a), b ~ N(diff, sd_b), n each: at n = 4 the exact
    permutation test's only p below 0.05 is 2 / C(8, 4) = 0.029, complete separation, so this is its power."""
    a, b = stats.norm(0, sd_a), stats.norm(diff, sd_b)
    up = integrate.quad(lambda x: n * a.pdf(x) * a.cdf(x) ** (n - 1) * b.sf(x) ** n, -12 * sd_a, 12 * sd_a)[0]
    down = integrate.quad(lambda x: n * a.pdf(x) * a.sf(x) ** (n - 1) * b.cdf(x) ** n, -12 * sd_a, 12 * sd_a)[0]
    return up + down


@pytest.mark.parametrize("diff,sd_a,sd_b", [(4.16, 0.216, 2.338), (1.0, 1.0, 1.0), (0.5, 0.2, 0.4)])
def test_perm_power_at_4_runs_is_the_complete_separation_probability(diff, sd_a, sd_b):
    got = power.perm_power(diff, sd_a, sd_b, 4, alpha=0.05, draws=20000, seed=3)
    want = _complete_separation_power(diff, sd_a, sd_b, 4)
    assert abs(got - want) < 4 * math.sqrt(want * (1 - want) / 20000) + 1e-9, (got, want)


def test_perm_power_is_zero_where_no_p_can_fall_below_alpha_and_counts_each_draws_exact_p():
    """n = 4 under Holm's 0.025: the smallest p is 0.029, so the power is 0 however far apart the arms are. At n = 3
    each draw's p from a loop over all C(6, 3) relabellings (a second code path) gives the same fraction."""
    assert power.perm_power(100.0, 0.1, 0.1, 4, alpha=0.025, draws=200) == 0.0
    assert power.perm_power(100.0, 0.1, 0.1, 5, alpha=0.025, draws=200) == 1.0
    rng = np.random.default_rng(7)
    a, b = rng.normal(0.0, 1.0, (500, 3)), rng.normal(1.5, 0.7, (500, 3))
    hits = 0
    for x, y in zip(a, b):
        pool, obs = np.r_[x, y], abs(y.mean() - x.mean())
        splits = [
            abs(pool[list(c)].mean() - np.delete(pool, list(c)).mean()) for c in itertools.combinations(range(6), 3)
        ]
        hits += np.mean([d >= obs - 1e-12 for d in splits]) < 0.2
    assert power.perm_power(1.5, 1.0, 0.7, 3, alpha=0.2, draws=500, seed=7) == hits / 500


def test_perm_on_the_command_line_stops_at_15_runs_per_arm(capsys):
    power.main(["perm", "0.3", "1", "1", "--draws=50", "--alpha=0.05"])  # never 80 %: 2 to 10, then max_n
    out = capsys.readouterr().out
    assert [n for n, _ in _table(out)] == [*range(2, 11), 15] and "not reached by n = 15 runs per arm" in out
    with pytest.raises(SystemExit) as e:
        power.main(["perm", "1", "1", "1", "--n=16"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "up to 15 runs per arm" in err and len(err.strip().splitlines()) == 1
