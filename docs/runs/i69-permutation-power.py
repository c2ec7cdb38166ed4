"""The power of issue 60's deciding test, the exact two-sided permutation test at n = 4 per arm, at the
registration's inputs (docs/extrapolation.md, "The registration (issue 60)": D = 4.160, sd 0.216 for PoPE,
2.338 for YaRN, alpha 0.05), two ways:

- simulated: `draws` pairs of normal arms, each scored with study/results.py's own permutation_p (the function
  the registered command calls), "separated" when p < alpha; and Welch's p (results.welch) on the same draws;
- exact under the normal model: at 4 against 4 the only p below 0.05 is 2 / C(8, 4) = 0.029, complete
  separation in either direction (the next, 4 / 70, is 0.057), so the power is
  P(min YaRN > max PoPE) + P(max YaRN < min PoPE), integrated numerically over the extreme run of one arm.

    python docs/runs/i69-permutation-power.py            # 20000 draws, seed 69
"""

import argparse
import os
import sys

import numpy as np
from scipy import integrate, stats

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "study"))

import results  # noqa: E402


def exact_power(diff, sd_a, sd_b, n):
    """P(every b > every a) + P(every b < every a) for n normal runs per arm, a ~ N(0, sd_a), b ~ N(diff, sd_b)."""

    a, b = stats.norm(0, sd_a), stats.norm(diff, sd_b)

    def above(x):  # density of max(a) at x, times P(all b > x)
        return n * a.pdf(x) * a.cdf(x) ** (n - 1) * b.sf(x) ** n

    def below(x):  # density of min(a) at x, times P(all b < x)
        return n * a.pdf(x) * a.sf(x) ** (n - 1) * b.cdf(x) ** n

    lo, hi = -12 * sd_a, 12 * sd_a
    return integrate.quad(above, lo, hi, limit=200)[0] + integrate.quad(below, lo, hi, limit=200)[0]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--diff", type=float, default=4.160)
    p.add_argument("--sd_a", type=float, default=0.216)
    p.add_argument("--sd_b", type=float, default=2.338)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--draws", type=int, default=20000)
    p.add_argument("--seed", type=int, default=69)
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    perm = welch = 0
    for _ in range(a.draws):
        x, y = rng.normal(0, a.sd_a, a.n), rng.normal(a.diff, a.sd_b, a.n)
        perm += results.permutation_p(x, y) < results.ALPHA
        welch += results.welch(x, y)[2] < results.ALPHA
    se = lambda k: (k / a.draws * (1 - k / a.draws) / a.draws) ** 0.5  # noqa: E731
    print(f"D = {a.diff}, sd {a.sd_a} / {a.sd_b}, n = {a.n} per arm, alpha {results.ALPHA}, {a.draws} draws:")
    print(f"  permutation test, simulated: {perm / a.draws:.3f} ± {se(perm):.3f}")
    if a.n == 4:
        print(f"  permutation test, exact (complete separation): {exact_power(a.diff, a.sd_a, a.sd_b, a.n):.3f}")
    print(f"  Welch's t-test, simulated: {welch / a.draws:.3f} ± {se(welch):.3f}")


if __name__ == "__main__":
    main()
