"""How many runs per arm a comparison needs before it is run, or what power a given number has: the
calculation behind a pre-registered study (docs/cpu_scale.md, section 5). study/results.py reads the runs
afterwards, with the same tests.

    python study/power.py welch 0.0165 0.0153 0.0058        # difference B − A, sd of A, sd of B: power by n
    python study/power.py welch 0.374 0.243 0.132 --n=4       # the power 4 runs per arm have
    python study/power.py perm 4.16 0.216 2.338 --alpha=0.025 # the exact permutation test's power, simulated
    python study/power.py fisher 7/9 1/9                       # solve rates of A and B (k/n or a fraction)
    python study/power.py paired 0.380 0.0057                  # mean and sd of the per-seed differences B − A
    python study/power.py tost 0.05 0.0054 0.0047              # equivalence margin, sd of A, sd of B (true diff 0)
    python study/power.py tost 0.05 0.0054 0.0047 --diff=0.01  # ... with a true difference B − A of 0.01

Welch: the two-sided Welch t-test at level alpha of two normal arms with n runs each and the given sds; power
from the noncentral t with the Welch-Satterthwaite degrees of freedom of those sds (the usual approximation:
the test itself uses the sample sds). Paired: the two-sided paired t-test (a one-sample t-test of the n per-
seed differences B − A, df n − 1), exact for normal differences; for arms that run the same seeds on one
machine, where a seed fixes much of the outcome in both (section 5, C: the per-seed values of the two arms
correlate at r = 0.9997). TOST: Schuirmann's two one-sided Welch tests of equivalence within (−MARGIN,
+MARGIN) (study/results.py --tost), each at level alpha; the power to conclude equivalence when the true
difference is --diff (default 0), from the noncentral t of each one-sided test with the Welch-Satterthwaite df
of the true sds: P(both reject) ~ P(lower rejects) + P(upper rejects) − 1 (Bonferroni's bound, close where the
power is high, the case a study plans for). Like welch's, an approximation: the true sds' df overstate the
test's at small n, by up to 0.03 in power at n = 4 to 6 (tests/test_power_tost.py, against the simulated
test). Perm: the exact two-sided permutation test of the difference of means (study/results.py --decide=perm), its
power simulated (--draws pairs of normal arms, --seed; n up to 15 per arm). Fisher: the two-sided Fisher exact test
of the 2 x 2 table of solved / not solved with n runs per arm, each run of arm X solving with probability p_X; power
exact, summed over all (n + 1)² outcomes. "Separated" is
p < alpha, as in study/results.py.

Fisher's power is not monotone in n at these sizes (the test is discrete): the n required is the
smallest n from which on every n up to --max_n reaches the target power. Output: a markdown table of
the power by n (2 to two past the n required, at most --max_n; if the power is never reached, 2 to 10
and --max_n), then the n required; with --n, the power at that n.
Bad input (welch: an sd < 0 or both 0; paired: an sd <= 0; a rate outside [0, 1]; n < 2; alpha or power
outside (0, 1)) exits 2 with one line.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: cli.py, model.py ...

from cli import UserError, exit_on_user_error
from results import ALPHA, PERMUTATION_MAX_RUNS, permutation_p  # "separated": p < ALPHA, as results.py reads runs

POWER = 0.8


def welch_power(diff, sd_a, sd_b, n, alpha=ALPHA):
    """Power of the two-sided Welch t-test at level `alpha` for a true difference of means `diff` (B − A,
    any unit) between two normal arms with standard deviations `sd_a`, `sd_b` (same unit), `n` runs each.

    Noncentral t: ncp = diff / sqrt((sd_a² + sd_b²) / n), df = Welch-Satterthwaite of the true sds;
    power = P(|T| > t_{1 − alpha/2, df}). Raises ValueError for n < 2, an sd < 0, both sds 0, or alpha
    outside (0, 1)."""
    _check(n=n, alpha=alpha)
    if sd_a < 0 or sd_b < 0 or sd_a == sd_b == 0:
        raise ValueError(f"the sds must be >= 0 and not both 0, got {sd_a} and {sd_b}")
    va, vb = sd_a**2 / n, sd_b**2 / n
    df = (va + vb) ** 2 / ((va**2 + vb**2) / (n - 1))
    return _t_test_power(df, diff / np.sqrt(va + vb), alpha)


def paired_power(diff, sd_diff, n, alpha=ALPHA):
    """Power of the two-sided paired t-test at level `alpha` (a one-sample t-test of the n per-pair
    differences B − A) when those differences are normal with mean `diff` and standard deviation `sd_diff`
    (any unit, the same for both); `n` pairs (seeds run in both arms).

    Noncentral t: df = n − 1, ncp = diff / (sd_diff / sqrt(n)); power = P(|T| > t_{1 − alpha/2, n − 1}),
    exact under normality. Raises ValueError for n < 2, sd_diff <= 0 or alpha outside (0, 1)."""
    _check(n=n, alpha=alpha)
    if not sd_diff > 0:
        raise ValueError(f"the sd of the differences must be > 0, got {sd_diff}")
    return _t_test_power(n - 1, diff / (sd_diff / np.sqrt(n)), alpha)


def tost_power(margin, sd_a, sd_b, n, diff=0.0, alpha=ALPHA):
    """Power of TOST (two one-sided Welch t-tests at level `alpha`) to conclude |B − A| < `margin` when the true
    difference of means is `diff` (|diff| < margin), arms of `n` normal runs with sds `sd_a`, `sd_b`.

    Each one-sided test rejects when its t passes t_{1 − alpha, df} (df: Welch-Satterthwaite of the true sds);
    P(lower) = P(T(df, (diff + margin) / se) > t), P(upper) = P(T(df, (margin − diff) / se) > t); the power is
    max(0, P(lower) + P(upper) − 1) (Bonferroni's bound of P(both); with the true sds' df an approximation that
    runs up to 0.03 above the simulated test at n = 4 to 6). Raises ValueError for n < 2, an
    sd < 0, both sds 0, margin <= 0, |diff| >= margin, or alpha outside (0, 1)."""
    from scipy import stats

    _check(n=n, alpha=alpha)
    if sd_a < 0 or sd_b < 0 or sd_a == sd_b == 0:
        raise ValueError(f"the sds must be >= 0 and not both 0, got {sd_a} and {sd_b}")
    if not margin > 0 or not abs(diff) < margin:
        raise ValueError(f"the margin must be > 0 and the true difference inside it, got margin {margin}, diff {diff}")
    va, vb = sd_a**2 / n, sd_b**2 / n
    df = (va + vb) ** 2 / ((va**2 + vb**2) / (n - 1))
    se, t = np.sqrt(va + vb), stats.t.ppf(1 - alpha, df)
    lower, upper = (float(stats.nct.sf(t, df, (margin + s * diff) / se)) for s in (1, -1))
    return max(0.0, lower + upper - 1.0)


def perm_power(diff, sd_a, sd_b, n, alpha=ALPHA, draws=20000, seed=0):
    """The exact two-sided permutation test's power (study/results.py's permutation_p, its --decide=perm), simulated:
    the fraction of `draws` pairs of normal arms of n runs each, a ~ N(0, sd_a) and b ~ N(diff, sd_b), whose p <
    alpha; standard error sqrt(P (1 − P) / draws), at most 0.0035 at 20000 draws. Seeded: a registration's number
    repeats. No p falls below 2 / C(2n, n) (0.029 at n = 4, 0.0079 at 5), so the power is 0 where that is >= alpha
    (n = 4 under Holm's 0.025). Raises ValueError for n past PERMUTATION_MAX_RUNS / 2 or a bad sd."""
    _check(n, alpha)
    if 2 * n > PERMUTATION_MAX_RUNS:
        raise ValueError(f"the exact permutation p is computed for up to {PERMUTATION_MAX_RUNS // 2} runs per arm")
    if sd_a < 0 or sd_b < 0 or draws < 1:
        raise ValueError(f"the sds must be >= 0 and draws >= 1, got {sd_a}, {sd_b}, {draws}")
    rng = np.random.default_rng(seed)
    a, b = rng.normal(0.0, sd_a, (draws, n)), rng.normal(diff, sd_b, (draws, n))
    return float(np.mean([permutation_p(x, y) < alpha for x, y in zip(a, b)]))


def _t_test_power(df, ncp, alpha):
    """P(|T| > t_{1 − alpha/2, df}) for T noncentral t (df, ncp). The lower tail P(T < −t) is taken as
    P(−T > t), an upper tail at −ncp: scipy's nct.cdf returns nan far in a tail (df = 1, ncp = 70)."""
    from scipy import stats

    t = stats.t.ppf(1 - alpha / 2, df)
    return float(stats.nct.sf(t, df, ncp) + stats.nct.sf(t, df, -ncp))


def fisher_pvalues(n):
    """(n + 1, n + 1) array: the two-sided Fisher exact p of the table [[k_a, n − k_a], [k_b, n − k_b]] at
    [k_a, k_b]; the sum of the hypergeometric probabilities, given the margins, of every table no more
    likely than the one seen (relative tolerance 1e-7, as scipy.stats.fisher_exact)."""
    from scipy import stats

    p = np.ones((n + 1, n + 1))
    k = np.arange(n + 1)
    for total in range(1, 2 * n):  # total solved; 0 and 2n leave one table, p = 1
        k_a = k[(k <= total) & (total - k <= n)]  # the tables with this margin
        pmf = stats.hypergeom.pmf(k_a, 2 * n, total, n)
        p[k_a, total - k_a] = [pmf[pmf <= x * (1 + 1e-7)].sum() for x in pmf]
    return np.minimum(p, 1.0)


def fisher_power(p_a, p_b, n, alpha=ALPHA):
    """Power of the two-sided Fisher exact test at level `alpha` (separated: p < alpha) when each of the `n`
    runs of arm A solves with probability `p_a` and each of arm B with `p_b`, independently: the binomial
    probability of the outcomes (k_a, k_b) the test separates. Raises ValueError for n < 2, a rate outside
    [0, 1] or alpha outside (0, 1)."""
    from scipy import stats

    _check(n=n, alpha=alpha)
    if not (0 <= p_a <= 1 and 0 <= p_b <= 1):
        raise ValueError(f"the solve rates must lie in [0, 1], got {p_a} and {p_b}")
    k = np.arange(n + 1)
    prob = np.outer(stats.binom.pmf(k, n, p_a), stats.binom.pmf(k, n, p_b))
    return float(prob[fisher_pvalues(n) < alpha].sum())


def n_required(power_at, target=POWER, max_n=100):
    """(n, {n: power}): the smallest n in [2, max_n] from which on power_at(m) >= target for every m up to
    max_n, or None if power_at(max_n) < target; the dict holds power_at for every n in [2, max_n]."""
    _check(power=target)
    powers = {m: power_at(m) for m in range(2, max_n + 1)}
    n = None
    for m in range(max_n, 1, -1):
        if powers[m] < target:
            break
        n = m
    return n, powers


def _check(n=2, alpha=ALPHA, power=POWER):
    if int(n) != n or n < 2:
        raise ValueError(f"n (runs per arm) must be an integer >= 2, got {n}")
    for name, x in (("alpha", alpha), ("power", power)):
        if not 0 < x < 1:
            raise ValueError(f"{name} must lie in (0, 1), got {x}")


def _rate(text):
    """'7/9' or '0.778' -> a float in [0, 1]."""
    try:
        k, _, n = text.partition("/")
        x = float(k) / float(n) if n else float(k)
    except (ValueError, ZeroDivisionError):
        raise UserError(f"a solve rate is k/n or a fraction, got {text!r}") from None
    return x


def _number(text):
    try:
        return float(text)
    except ValueError:
        raise UserError(f"expected a number, got {text!r}") from None


@exit_on_user_error
def main(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("test", choices=["welch", "perm", "paired", "fisher", "tost"])
    p.add_argument(
        "values",
        nargs="+",
        help="welch, perm: DIFF SD_A SD_B; paired: DIFF SD_DIFF; fisher: RATE_A RATE_B; tost: MARGIN SD_A SD_B",
    )
    p.add_argument("--draws", type=int, default=20000, help="perm: simulated pairs of arms per n (default 20000)")
    p.add_argument("--seed", type=int, default=0, help="perm: the simulation's seed (default 0)")
    p.add_argument("--diff", type=float, default=0.0, help="tost: the true difference B − A (default 0)")
    p.add_argument("--n", type=int, default=None, help="runs per arm: print the power at this n only")
    p.add_argument("--alpha", type=float, default=ALPHA, help="two-sided significance level (default 0.05)")
    p.add_argument("--power", type=float, default=POWER, help="the power to reach (default 0.8)")
    p.add_argument("--max_n", type=int, default=100, help="the largest n per arm searched (default 100)")
    a = p.parse_args(argv)
    takes = {
        "welch": "DIFF SD_A SD_B",
        "perm": "DIFF SD_A SD_B",
        "paired": "DIFF SD_DIFF",
        "fisher": "RATE_A RATE_B",
        "tost": "MARGIN SD_A SD_B",
    }[a.test]
    if len(a.values) != len(takes.split()):
        raise UserError(f"{a.test} takes {takes}, got {len(a.values)} values")
    if a.test == "welch":
        diff, sd_a, sd_b = map(_number, a.values)
        power_at = lambda n: welch_power(diff, sd_a, sd_b, n, a.alpha)  # noqa: E731
        what = f"Welch's t-test: difference {diff:g}, sd {sd_a:g} (A) and {sd_b:g} (B)"
    elif a.test == "perm":
        diff, sd_a, sd_b = map(_number, a.values)
        power_at = lambda n: perm_power(diff, sd_a, sd_b, n, a.alpha, a.draws, a.seed)  # noqa: E731
        what = (
            f"exact permutation test (simulated, {a.draws} draws, seed {a.seed}): difference {diff:g}, sd {sd_a:g} (A) "
            f"and {sd_b:g} (B)"
        )
        a.max_n = min(a.max_n, PERMUTATION_MAX_RUNS // 2)
    elif a.test == "paired":
        diff, sd_diff = map(_number, a.values)
        power_at = lambda n: paired_power(diff, sd_diff, n, a.alpha)  # noqa: E731
        what = f"paired t-test: mean difference {diff:g}, sd of the differences {sd_diff:g}"
    elif a.test == "tost":
        margin, sd_a, sd_b = map(_number, a.values)
        power_at = lambda n: tost_power(margin, sd_a, sd_b, n, a.diff, a.alpha)  # noqa: E731
        what = (
            f"TOST (two one-sided Welch tests): margin ±{margin:g}, true difference {a.diff:g}, "
            f"sd {sd_a:g} (A) and {sd_b:g} (B)"
        )
    else:
        r_a, r_b = map(_rate, a.values)
        power_at = lambda n: fisher_power(r_a, r_b, n, a.alpha)  # noqa: E731
        what = f"Fisher's exact test: solve rates {r_a:.3f} (A) and {r_b:.3f} (B)"
    level = f"alpha = {a.alpha:g} per one-sided test" if a.test == "tost" else f"two-sided alpha = {a.alpha:g}"
    try:
        if a.n is not None:
            print(f"{what}, {level}: power {power_at(a.n):.3f} at n = {a.n} per arm")
            return
        _check(n=a.max_n)
        n, powers = n_required(power_at, a.power, a.max_n)
    except ValueError as e:
        raise UserError(str(e)) from None
    print(f"{what}, {level}\n\n| n per arm | power |\n|---|---|")
    for m in range(2, min(a.max_n, n + 2) + 1) if n else sorted({*range(2, min(a.max_n, 10) + 1), a.max_n}):
        print(f"| {m} | {powers[m]:.3f} |")
    if n:
        print(f"\n{a.power:.0%} power from n = {n} runs per arm on (every n from there to --max_n = {a.max_n})")
    else:
        print(f"\n{a.power:.0%} power is not reached by n = {a.max_n} runs per arm (--max_n)")


if __name__ == "__main__":
    main(sys.argv[1:])
