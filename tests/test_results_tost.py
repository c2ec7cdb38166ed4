"""study/results.py --tost: Schuirmann's two one-sided tests (TOST) of equivalence on Welch's t, against a
textbook case worked by hand (4 degrees of freedom, where Student's t has a closed-form tail), against scipy's
one-sided Welch tests computed from the formula, and the printed line, the CSV row and the bad input."""

import csv
import io
import math

import pytest
from scipy import stats
from test_results_compare import arms

import results

T_95_DF4 = 2.1318468  # Student's t, 0.95 quantile, 4 degrees of freedom (any printed table)


def t4_upper_tail(t):
    """P(T > t) for Student's t with 4 df: 1/2 − (3/4) u (1 − u²/3), u = t / sqrt(4 + t²)."""
    u = t / math.sqrt(4 + t * t)
    return 0.5 - 0.75 * u * (1 - u * u / 3)


@pytest.mark.parametrize("margin,equivalent", [(3.0, False), (4.0, True)])
def test_tost_against_a_textbook_case_worked_by_hand(margin, equivalent):
    # A = 1, 2, 3; B = 3, 4, 5: diff 2, se sqrt(2/3), Welch's df = 4. The upper test decides:
    # t = (2 − margin) / se; p = P(T4 > (margin − 2) / se). margin 3: t = 1.2247, p = 0.1439; margin 4: t = 2.4495,
    # p = 0.0352. The 90 % interval 2 ± t_{0.95,4} se = [0.2594, 3.7406] lies inside (−4, 4), not inside (−3, 3).
    diff, (lo, hi), p = results.tost([1.0, 2.0, 3.0], [3.0, 4.0, 5.0], margin)
    se = math.sqrt(2 / 3)
    assert diff == pytest.approx(2.0)
    assert p == pytest.approx(t4_upper_tail((margin - 2) / se), rel=1e-6)
    assert p == pytest.approx({3.0: 0.143932, 4.0: 0.035242}[margin], abs=2e-6)
    assert (lo, hi) == (pytest.approx(2 - T_95_DF4 * se, rel=1e-6), pytest.approx(2 + T_95_DF4 * se, rel=1e-6))
    assert (p < results.ALPHA) == equivalent == (-margin < lo and hi < margin)


def test_tost_is_the_larger_of_two_one_sided_welch_tests_with_unequal_sds():
    a, b = [1.531, 1.536, 1.529, 1.540, 1.534], [1.538, 1.551, 1.529, 1.547]
    margin = 0.02
    diff, ci, p = results.tost(a, b, margin)
    va, vb = stats.tvar(a) / len(a), stats.tvar(b) / len(b)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))  # Welch-Satterthwaite
    d, se = sum(b) / len(b) - sum(a) / len(a), math.sqrt(va + vb)
    p_low = stats.t.sf((d + margin) / se, df)  # H0 diff <= −margin
    p_high = stats.t.cdf((d - margin) / se, df)  # H0 diff >= +margin
    assert diff == pytest.approx(d) and p == pytest.approx(max(p_low, p_high), rel=1e-9)
    half = stats.t.ppf(0.95, df) * se
    assert ci == (pytest.approx(d - half, rel=1e-9), pytest.approx(d + half, rel=1e-9))
    # the swap of the arms mirrors the interval and keeps p
    diff2, ci2, p2 = results.tost(b, a, margin)
    assert (diff2, p2) == (pytest.approx(-diff), pytest.approx(p)) and ci2 == (
        pytest.approx(-ci[1]),
        pytest.approx(-ci[0]),
    )
    with pytest.raises(ValueError):
        results.tost(a, b, 0.0)


def test_the_printed_tost_line_and_its_csv_row(tmp_path):
    paths = arms(tmp_path, [1.0, 2.0, 3.0], [3.0, 4.0, 5.0], seeds_b=[7, 8, 9])
    out = results.main([*paths, "--compare=pos_encoding", "--tost=4"])
    line = next(ln for ln in out.splitlines() if ln.startswith("TOST"))
    assert line == (
        "TOST (equivalence of the test loss (nats) within ±4, two one-sided Welch tests at 0.05): "
        "B − A +2.0000, 90 % CI [+0.2594, +3.7406], p = 0.035: equivalent (p < 0.05)"
    )
    assert "not shown equivalent" in results.main([*paths, "--compare=pos_encoding", "--tost=3"])
    assert "TOST" not in results.main([*paths, "--compare=pos_encoding"])
    rows = list(csv.reader(io.StringIO(results.main([*paths, "--compare=pos_encoding", "--tost=4", "--csv"]))))
    last = rows[-1]
    assert last[0] == "test loss (nats), TOST ±4 (90 % CI)" and last[1] == "pope" and last[5] == "rope"
    assert float(last[9]) == pytest.approx(2.0) and float(last[10]) == pytest.approx(0.2594, abs=1e-4)
    assert float(last[12]) == pytest.approx(0.035242, abs=2e-6)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tost=0"], "--tost is an equivalence margin in nats, > 0"),
        (["--tost=-0.05"], "--tost is an equivalence margin in nats, > 0"),
    ],
)
def test_bad_tost_exits_2_with_one_line(tmp_path, capsys, args, message):
    paths = arms(tmp_path, [1.0, 2.0, 3.0], [3.0, 4.0, 5.0])
    with pytest.raises(SystemExit) as e:
        results.main([*paths, "--compare=pos_encoding", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as e:
        results.main([*paths, "--tost=0.05"])
    assert e.value.code == 2 and "--tost applies with --compare=KEY only" in capsys.readouterr().err


@pytest.mark.parametrize("a,b", [([1.0], [3.0, 4.0, 5.0]), ([1.0, 2.0, 3.0], [4.0]), ([2.0], [3.0])])
def test_tost_with_a_one_run_arm_exits_2_with_one_line(tmp_path, capsys, a, b):
    """A one-run arm has no spread: Welch's t is undefined (scipy would give nan, and a nan p reads "not shown
    equivalent" by accident). --solved lets a comparison hold one-run arms (Fisher's test counts runs), so --tost
    checks its own: either arm with one run, or both, exits 2 with one line; without --tost the same arms compare."""
    paths = arms(tmp_path, a, b)
    with pytest.raises(SystemExit) as e:
        results.main([*paths, "--compare=pos_encoding", "--solved=0.4", "--tost=4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--tost needs at least 2 runs per arm" in err, err
    assert "TOST" not in results.main([*paths, "--compare=pos_encoding", "--solved=0.4"])
