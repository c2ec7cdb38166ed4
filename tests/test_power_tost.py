"""study/power.py tost: the power of Schuirmann's two one-sided Welch tests (study/results.py --tost) against the
same tests applied by scipy to simulated arms, and its edges (no power at n = 2 for a margin the sds swamp, power
rising with n, bad input)."""

import numpy as np
import pytest
from scipy import stats

import power
import results


def _simulated_tost_power(margin, sd_a, sd_b, n, diff, sims=100_000, seed=0):
    """How often results.tost's two one-sided Welch tests (scipy, per simulated pair of arms) both reject."""
    rng = np.random.default_rng(seed)
    a, b = rng.normal(0.0, sd_a, (sims, n)), rng.normal(diff, sd_b, (sims, n))
    low = stats.ttest_ind(b + margin, a, axis=1, equal_var=False, alternative="greater").pvalue
    high = stats.ttest_ind(b - margin, a, axis=1, equal_var=False, alternative="less").pvalue
    return float((np.maximum(low, high) < results.ALPHA).mean())


@pytest.mark.parametrize(
    "margin, sd_a, sd_b, n, diff",
    [
        (0.05, 0.03, 0.03, 6, 0.0),
        (0.05, 0.04, 0.02, 8, 0.01),
        (0.02, 0.01, 0.012, 5, -0.005),
        (0.05, 0.0054, 0.0047, 3, 0.0),
    ],
)
def test_tost_power_is_the_simulated_tost(margin, sd_a, sd_b, n, diff):
    # an approximation (the true sds' Welch df, Bonferroni's bound of both rejecting): 0.004 to 0.018 above the
    # simulated test here (0.7011 against 0.6852 at n = 6, equal sds); the simulation's standard error is below 0.0016
    sim = _simulated_tost_power(margin, sd_a, sd_b, n, diff)
    assert power.tost_power(margin, sd_a, sd_b, n, diff) == pytest.approx(sim, abs=0.025)


def test_a_results_tost_of_one_draw_agrees_with_the_simulation_path():
    # the simulation's vectorised tests are results.tost's, run on one pair of arms
    rng = np.random.default_rng(3)
    a, b = rng.normal(0.0, 0.02, 5), rng.normal(0.004, 0.03, 5)
    low = stats.ttest_ind(b + 0.05, a, equal_var=False, alternative="greater").pvalue
    high = stats.ttest_ind(b - 0.05, a, equal_var=False, alternative="less").pvalue
    assert results.tost(list(a), list(b), 0.05)[2] == pytest.approx(max(low, high), rel=1e-12)


def test_tost_power_grows_with_n_and_mirrors_the_difference():
    curve = [power.tost_power(0.02, 0.015, 0.015, n, 0.005) for n in range(2, 30)]
    assert curve[0] == 0.0 and all(x <= y + 1e-12 for x, y in zip(curve, curve[1:])) and curve[-1] > 0.9
    assert power.tost_power(0.02, 0.015, 0.01, 7, 0.005) == pytest.approx(
        power.tost_power(0.02, 0.01, 0.015, 7, -0.005)
    )


def test_the_command_line_and_bad_input(capsys):
    power.main(["tost", "0.01", "0.0054", "0.0047", "--diff=0.003"])
    out = capsys.readouterr().out
    assert "alpha = 0.05 per one-sided test" in out and "from n = 8 runs per arm" in out
    assert f"| 8 | {power.tost_power(0.01, 0.0054, 0.0047, 8, 0.003):.3f} |" in out
    for argv, message in (
        (["tost", "0.05", "0.01", "0.01", "--diff=0.06"], "true difference inside it"),
        (["tost", "0", "0.01", "0.01"], "margin must be > 0"),
        (["tost", "0.05", "0.01"], "takes MARGIN SD_A SD_B"),
    ):
        with pytest.raises(SystemExit) as e:
            power.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
