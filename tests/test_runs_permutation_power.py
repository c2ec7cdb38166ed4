"""docs/runs/i69-permutation-power.py (issue 69's correction in docs/extrapolation.md: the permutation test's power is
0.827 at the registration's inputs), run by a test (issue 76, pw-exact-exponent): its exact power against an
independent integration and against cases known in closed form, and a short simulated run."""

import contextlib
import importlib.util
import io
import math
import os
import re
import sys

import pytest
from scipy import integrate, stats

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "docs", "runs", "i69-permutation-power.py")
REGISTRATION = dict(diff=4.160, sd_a=0.216, sd_b=2.338, n=4)  # docs/extrapolation.md, "The registration (issue 60)"


@pytest.fixture(scope="module")
def power():
    spec = importlib.util.spec_from_file_location("i69_permutation_power", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _separation_by_the_other_arm(diff, sd_a, sd_b, n):
    """P(every b above every a) + P(every b below every a), integrated over b's extreme run instead of a's: the density
    of min(b) at y times P(all a < y), plus the density of max(b) at y times P(all a > y)."""
    a, b = stats.norm(0, sd_a), stats.norm(diff, sd_b)
    lo, hi = diff - 12 * sd_b, diff + 12 * sd_b
    above = integrate.quad(lambda y: n * b.pdf(y) * b.sf(y) ** (n - 1) * a.cdf(y) ** n, lo, hi, limit=200)[0]
    below = integrate.quad(lambda y: n * b.pdf(y) * b.cdf(y) ** (n - 1) * a.sf(y) ** n, lo, hi, limit=200)[0]
    return above + below


def test_the_exact_power_at_the_registration_is_the_documented_0_827(power):
    """The docs' 0.827 (docs/extrapolation.md, issue 69's corrections) is exact_power at the registration's inputs, and
    equals the same probability integrated over the other arm's extreme run, to 1e-7; so does a second case with
    the spreads the other way round and n = 3."""
    got = power.exact_power(**REGISTRATION)
    doc = open(os.path.join(REPO, "docs", "extrapolation.md"), encoding="utf-8").read()
    assert re.search(r"\b0\.827 integrated", doc) and round(got, 3) == 0.827, got
    assert got == pytest.approx(_separation_by_the_other_arm(**REGISTRATION), abs=1e-7)
    case = dict(diff=1.5, sd_a=1.2, sd_b=0.4, n=3)
    assert power.exact_power(**case) == pytest.approx(_separation_by_the_other_arm(**case), abs=1e-7)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_exchangeable_arms_separate_with_probability_2_over_c_2n_n(power, n):
    """With no difference and equal spreads the 2n runs are exchangeable: each of the C(2n, n) ways to split their
    order is equally likely and two of them are complete separation, so the power is 2 / C(2n, n) (0.029 at n = 4,
    the permutation test's size); far apart, 1."""
    assert power.exact_power(0.0, 1.0, 1.0, n) == pytest.approx(2 / math.comb(2 * n, n), abs=1e-9)
    assert power.exact_power(50.0, 1.0, 1.0, n) == pytest.approx(1.0, abs=1e-9)


def test_a_short_run_prints_the_simulated_power_beside_the_exact_one(power, monkeypatch):
    """The script's command with 300 draws (seed 69): the permutation test's simulated power, scored with
    study/results.py's own permutation_p, lies within 4 standard errors of the exact 0.827, and Welch's within 4 of
    study/power.py's 0.668 (docs/extrapolation.md)."""
    monkeypatch.setattr(sys, "argv", [SCRIPT, "--draws=300"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        power.main()
    text = out.getvalue()
    sim = re.search(r"permutation test, simulated: ([0-9.]+) ± ([0-9.]+)", text)
    exact = re.search(r"permutation test, exact \(complete separation\): ([0-9.]+)", text)
    welch = re.search(r"Welch's t-test, simulated: ([0-9.]+) ± ([0-9.]+)", text)
    assert sim and exact and welch, text
    assert float(exact.group(1)) == 0.827, text
    assert abs(float(sim.group(1)) - 0.827) < 4 * float(sim.group(2)), text
    assert abs(float(welch.group(1)) - 0.668) < 4 * float(welch.group(2)), text
