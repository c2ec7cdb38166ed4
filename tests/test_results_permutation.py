"""results.py --compare's exact permutation p, Mann–Whitney p and "complete separation" (issue 60): a 3 vs 3
case enumerated by hand, scipy.stats.permutation_test on larger arms, and the printed table."""

import math

import numpy as np
import pytest
from scipy import stats
from test_results_compare import arms, row

import results

A, B = [1.0, 2.0, 4.0], [3.0, 5.0, 6.0]
# All C(6, 3) = 20 ways to call three of the pooled 1..6 "B", with the B-sum S; mean(B) − mean(A) = (2 S − 21) / 3.
# The observed split {3, 5, 6} has S = 14, difference +7/3; |difference| >= 7/3 means S >= 14 or S <= 7.
SPLITS = {
    (1, 2, 3): 6, (1, 2, 4): 7, (1, 2, 5): 8, (1, 2, 6): 9, (1, 3, 4): 8,
    (1, 3, 5): 9, (1, 3, 6): 10, (1, 4, 5): 10, (1, 4, 6): 11, (1, 5, 6): 12,
    (2, 3, 4): 9, (2, 3, 5): 10, (2, 3, 6): 11, (2, 4, 5): 11, (2, 4, 6): 12,
    (2, 5, 6): 13, (3, 4, 5): 12, (3, 4, 6): 13, (3, 5, 6): 14, (4, 5, 6): 15,
}  # fmt: skip


def test_three_against_three_enumerated_by_hand():
    assert len(SPLITS) == math.comb(6, 3) and all(sum(k) == v for k, v in SPLITS.items())
    extreme = [k for k, s in SPLITS.items() if abs(2 * s - 21) >= 7]
    assert extreme == [(1, 2, 3), (1, 2, 4), (3, 5, 6), (4, 5, 6)]  # two in each tail
    assert results.permutation_p(A, B) == pytest.approx(4 / 20, abs=1e-15)
    assert results.permutation_p(B, A) == pytest.approx(4 / 20, abs=1e-15)  # two-sided: the arms' order is moot
    # Mann–Whitney: U(B) = pairs with b > a = 2 + 3 + 3 = 8 of 9; exact P(U >= 8) = 2 / 20, two-sided 4 / 20
    assert results.mann_whitney(A, B) == pytest.approx(0.2, abs=1e-12)
    assert not results.complete_separation(A, B)
    assert results.complete_separation([1, 2, 3], [4, 5, 6]) and results.complete_separation([4, 5, 6], [1, 2, 3])
    assert not results.complete_separation([1, 2, 3], [3, 4, 5])  # a tie at the edge is no separation


def test_complete_separation_of_8_against_8_gives_2_over_c_16_8():
    """The smallest two-sided p with 8 runs per arm: only the observed split and its mirror are as extreme."""
    a, b = [5.6, 5.8, 6.0, 5.9, 5.7, 6.2, 5.65, 6.05], [21.0, 26.8, 19.0, 20.1, 19.3, 21.9, 19.5, 19.9]
    assert results.permutation_p(a, b) == pytest.approx(2 / math.comb(16, 8), rel=1e-12)  # 1.554e-4
    assert 2 / math.comb(16, 8) * 4 == pytest.approx(6.22e-4, abs=1e-6)  # Holm's x4 at the first step


@pytest.mark.parametrize("na, nb, seed, ties", [(5, 7, 0, False), (7, 9, 1, False), (6, 6, 2, True), (4, 8, 3, True)])
def test_against_scipy_permutation_test_exact(na, nb, seed, ties):
    """scipy enumerates every relabeling (n_resamples=inf, permutation_type='independent'); the statistic
    |mean(b) − mean(a)| with alternative 'greater' is our two-sided p, also for unequal arms, whose null
    distribution of the difference is not symmetric (scipy's own 'two-sided' doubles a tail instead)."""
    rng = np.random.default_rng(seed)
    a, b = rng.gamma(2.0, size=na), rng.gamma(2.0, size=nb) + 0.7
    if ties:  # whole numbers: many exact ties among the splits
        a, b = np.round(3 * a), np.round(3 * b)
    ref = stats.permutation_test(
        (a, b),
        lambda x, y, axis: np.abs(np.mean(y, axis=axis) - np.mean(x, axis=axis)),
        permutation_type="independent",
        n_resamples=np.inf,
        alternative="greater",
        vectorized=True,
    )
    got = results.permutation_p(list(a), list(b))
    assert got == pytest.approx(ref.pvalue, abs=1e-12) and 0 < got < 1
    assert results.mann_whitney(list(a), list(b)) == pytest.approx(
        stats.mannwhitneyu(b, a, alternative="two-sided").pvalue
    )


def test_large_arms_are_not_computed_and_12_against_12_is_quick():
    assert math.isnan(results.permutation_p(list(range(16)), list(range(20, 35))))  # 31 runs > 30
    a, b = list(range(12)), [x + 11.5 for x in range(12)]  # one overlap: 11 against 11.5
    assert results.permutation_p(a, b) < 1e-5  # C(24, 12) = 2,704,156 splits, meet in the middle


def test_the_table_prints_both_ps_and_the_separation(tmp_path):
    c = results.compare(arms(tmp_path, [1.0, 2.0, 4.0], [3.0, 5.0, 6.0]), "pos_encoding")
    perm, mw, apart = row(c, "test loss")["rank"]
    assert perm == pytest.approx(0.2) and mw == pytest.approx(0.2) and not apart
    line = next(ln for ln in results.compare_markdown(c).splitlines() if ln.startswith("| test loss"))
    cells = [x.strip() for x in line.strip("|").split("|")]
    assert cells[5:9] == ["0.200", "0.200", "no", "overlap"]
    csv_rows = results.compare_csv(c).splitlines()
    assert csv_rows[0].endswith(",perm_p,mannwhitney_p,complete_separation")
    assert csv_rows[1].endswith(",0.2,0.2,False")


def test_fifteen_against_fifteen_is_computed_exactly_and_sixteen_against_fifteen_is_not():
    """PERMUTATION_MAX_RUNS = 30 runs in all is the largest computed: 15 against 15, completely separated (1..15
    against 16..30), gives 2 / C(30, 15) (the observed split and its mirror); with 15 and 16 swapped, the B-sums
    344 and 345 and their mirrors 121 and 120 are as extreme: 4 / C(30, 15). 31 runs: nan (not computed)."""
    a, b = [float(x) for x in range(1, 16)], [float(x) for x in range(16, 31)]
    assert results.PERMUTATION_MAX_RUNS == 30
    assert results.permutation_p(a, b) == pytest.approx(2 / math.comb(30, 15), rel=1e-12)  # 1.29e-8
    a[-1], b[0] = b[0], a[-1]
    assert results.permutation_p(a, b) == pytest.approx(4 / math.comb(30, 15), rel=1e-12)
    assert math.isnan(results.permutation_p(a, b + [31.0]))


@pytest.mark.parametrize("scale", [1.0, 0.1, 1e-3])
def test_splits_tied_with_the_observed_one_in_the_upper_tail_count_as_extreme(scale):
    """A = 1, 2, 3 and B = 3, 4, 5 (times `scale`): the pooled runs hold two 3s, so C(6, 3) = 20 splits, and two of
    them have the observed B-sum 12 (B's 3 or A's 3 with 4 and 5): both count, as do the two with B-sum 6 in the
    lower tail, p = 4 / 20; as decimals (0.1, 0.2, 0.3 against 0.3, 0.4, 0.5) the tied sums differ in their last
    bits and still count. Shifted by 0.5, B = 3.5, 4.5, 5.5 ties no split: 2 / 20."""
    a, b = [scale * x for x in (1, 2, 3)], [scale * x for x in (3, 4, 5)]
    assert results.permutation_p(a, b) == pytest.approx(4 / 20, abs=1e-15)
    assert results.permutation_p(b, a) == pytest.approx(4 / 20, abs=1e-15)
    assert results.permutation_p(a, [x + 0.5 * scale for x in b]) == pytest.approx(2 / 20, abs=1e-15)


def _loss_cells(text):
    """The printed table's 'test loss' row, cell by cell, and its header's cells."""
    lines = text.splitlines()
    cells = lambda ln: [x.strip() for x in ln.strip("|").split("|")]  # noqa: E731
    head = cells(next(ln for ln in lines if ln.startswith("| metric")))
    return dict(zip(head, cells(next(ln for ln in lines if ln.startswith("| test loss")))))


@pytest.mark.parametrize("n_a, n_b", [(15, 15), (16, 15), (20, 20)])
def test_the_verdict_follows_the_deciding_p_and_is_a_dash_where_it_is_not_computed(tmp_path, n_a, n_b):
    """Issue 76, rs-decide-nan-check: "separated" is the deciding test's p < 0.05, and "—" where that p is not a
    number. Arms 1..n_a against n_a + 1..n_a + n_b in complete separation: Welch's p is below 1e-9, so under
    --decide=welch they are separated ("yes"); under --decide=perm 15 against 15 (30 runs) is computed exactly,
    2 / C(30, 15) ("yes"), while 31 and 40 runs are not computed (p (perm.) "—"): the verdict is "—", never the
    "no" that a comparison of nan with 0.05 gives, nor the Welch verdict."""
    a = [float(x) for x in range(1, n_a + 1)]
    b = [float(x) for x in range(n_a + 1, n_a + n_b + 1)]
    paths = arms(tmp_path, a, b)
    welch = _loss_cells(results.main(paths + ["--compare=pos_encoding", "--decide=welch"]))
    perm = _loss_cells(results.main(paths + ["--compare=pos_encoding", "--decide=perm"]))
    assert float(welch["p (Welch)"]) < 1e-9 and welch["separated (Welch p)"] == "yes", welch
    computed = n_a + n_b <= results.PERMUTATION_MAX_RUNS
    if computed:
        assert float(perm["p (perm.)"]) == pytest.approx(2 / math.comb(30, 15), rel=1e-2), perm
    else:
        assert perm["p (perm.)"] == "—", perm
    assert perm["separated (perm. p)"] == ("yes" if computed else "—"), perm


def test_decide_perm_calls_a_computed_p_above_alpha_not_separated_whatever_welch_says(tmp_path):
    """The other way round: 3 against 3 in complete separation, Welch's p 1e-4 ("yes" under welch) and the exact
    permutation p 2 / 20 = 0.1: under --decide=perm the verdict is "no" (the permutation p decides, not Welch's)."""
    paths = arms(tmp_path, [1.0, 1.1, 1.2], [2.0, 2.1, 2.2])
    welch = _loss_cells(results.main(paths + ["--compare=pos_encoding"]))
    perm = _loss_cells(results.main(paths + ["--compare=pos_encoding", "--decide=perm"]))
    assert welch["separated (Welch p)"] == "yes" and float(welch["p (Welch)"]) < 0.001, welch
    assert perm["p (perm.)"] == "0.100" and perm["separated (perm. p)"] == "no", perm
