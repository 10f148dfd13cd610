"""The lower-bound functions of fastdp.audit.bounds.

Published values. Two values printed in Steinke, Nasr & Jagielski (arXiv:2305.08846v1), as transcribed with their
page numbers by a third-party port of the paper's Appendix D (the PDF itself could not be read where this was
written): the Appendix D example (p. 46), ``m = 1000, r = 100, v = 75, delta = 1e-4, 95 %`` -> ``0.673``, and the
Section 7 result of Figure 11 (p. 28), ``m = 100000, r = 1510, v = 1439, delta = 1e-5, 95 %`` -> ``2.675``. Also
reproduced: the paper's own algorithm as printed in that appendix (``p_value_DP_audit`` / ``get_eps_audit``: pmf
sums accumulated one ``i`` at a time, a 30-step bisection from ``[0, 1]`` widened by +1), re-implemented here
independently of the library's vectorized tails, and closed forms the theorems imply. The many-runs tables of
Jagielski et al. 2020 could not be read; that bound is checked against its formula and Clopper-Pearson's closed
forms.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from fastdp.audit import (
    clopper_pearson,
    epsilon_lower_bound_many_runs,
    epsilon_lower_bound_one_run,
    one_run_p_value,
)


# ----------------------------------------------------------------------------- the paper's appendix algorithm
def _paper_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    q = 1 / (1 + math.exp(-eps))
    beta = stats.binom.sf(v - 1, r, q)
    pmf = stats.binom.pmf(np.arange(v + 1), r, q)  # one scipy call; the loop below is the paper's
    alpha, total = 0.0, 0.0
    for i in range(1, v + 1):
        total += pmf[v - i]
        if total > i * alpha:
            alpha = total / i
    return min(beta + alpha * delta * 2 * m, 1.0)


def _paper_eps(m: int, r: int, v: int, delta: float, p: float) -> float:
    lo, hi = 0.0, 1.0
    while _paper_p_value(m, r, v, hi, delta) < p:
        hi += 1
    for _ in range(30):
        mid = (lo + hi) / 2
        if _paper_p_value(m, r, v, mid, delta) < p:
            lo = mid
        else:
            hi = mid
    return lo


@pytest.mark.parametrize("m,r,v,delta,published", [
    (1000, 100, 75, 1e-4, 0.673),       # arXiv:2305.08846v1, Appendix D example (p. 46), printed 0.673
    (100000, 1510, 1439, 1e-5, 2.675),  # arXiv:2305.08846v1, Section 7 / Figure 11 (p. 28), printed 2.675
])
def test_one_run_reproduces_the_papers_printed_values(m: int, r: int, v: int, delta: float,
                                                      published: float) -> None:
    got = epsilon_lower_bound_one_run(m, r, v, delta, beta=0.05)
    assert abs(got - published) < 1e-3, got  # one unit of the last printed digit (0.67298, 2.67585)
    # and dropping the delta term (a plausible porting bug) moves the first one far outside that tolerance
    if delta == 1e-4:
        assert abs(epsilon_lower_bound_one_run(m, r, v, 0.0, beta=0.05) - published) > 0.02


CASES = [(1000, 100, 100, 1e-5), (1000, 1000, 1000, 1e-5), (1000, 600, 600, 1e-5), (100, 100, 100, 1e-5),
         (1000, 200, 180, 1e-5), (1000, 1000, 700, 1e-5), (5000, 500, 450, 1e-6), (1000, 100, 90, 0.0),
         (50, 40, 35, 1e-3)]


@pytest.mark.parametrize("m,r,v,delta", CASES)
def test_one_run_matches_the_papers_algorithm(m: int, r: int, v: int, delta: float) -> None:
    for eps in (0.0, 0.5, 2.0, 5.0):
        assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(_paper_p_value(m, r, v, eps, delta),
                                                                    rel=1e-9, abs=1e-15)
    want = _paper_eps(m, r, v, delta, 0.05)
    got = epsilon_lower_bound_one_run(m, r, v, delta, beta=0.05)
    # the paper's 30 bisection steps resolve epsilon to (bracket width) / 2^30
    assert got == pytest.approx(want, abs=2e-6 * max(1.0, want))


@pytest.mark.parametrize("r", [1, 10, 100, 1000])
def test_one_run_closed_form_all_correct_delta_zero(r: int) -> None:
    # delta = 0 and v = r: p(eps) = q^r, so the bound solves q^r = beta: eps = log(q / (1 - q)), q = beta^(1/r)
    # (floored at 0: with r = 1, q = 0.05 < 1/2 and one correct guess rejects no epsilon)
    q = 0.05 ** (1 / r)
    want = max(0.0, math.log(q / (1 - q)))
    assert epsilon_lower_bound_one_run(r, r, r, 0.0, 0.05) == pytest.approx(want, abs=1e-6)


def test_one_run_monotone() -> None:
    by_v = [epsilon_lower_bound_one_run(1000, 200, v, 1e-5) for v in range(100, 201, 10)]
    assert by_v == sorted(by_v) and by_v[0] == 0.0 and by_v[-1] > 3
    by_delta = [epsilon_lower_bound_one_run(1000, 200, 190, d) for d in (0.0, 1e-6, 1e-4, 1e-3)]
    assert by_delta == sorted(by_delta, reverse=True) and by_delta[0] > by_delta[-1]
    by_beta = [epsilon_lower_bound_one_run(1000, 200, 190, 1e-5, b) for b in (0.01, 0.05, 0.2)]
    assert by_beta == sorted(by_beta)


def test_one_run_edge_cases() -> None:
    assert epsilon_lower_bound_one_run(100, 0, 0, 1e-5) == 0.0  # no guesses: nothing learned
    assert epsilon_lower_bound_one_run(100, 10, 0, 1e-5) == 0.0  # all wrong
    assert epsilon_lower_bound_one_run(100, 100, 50, 1e-5) == 0.0  # chance level
    assert one_run_p_value(100, 0, 0, 3.0, 1e-5) == 1.0
    assert one_run_p_value(100, 100, 100, 0.0, 0.0) == pytest.approx(0.5 ** 100)
    # m = r = v = 1: one correct guess proves nothing at 95 % (its p-value at eps = 0 is 1/2)
    assert epsilon_lower_bound_one_run(1, 1, 1, 0.0) == 0.0
    # a large delta makes the bound vacuous: 2 m delta >= 1
    assert epsilon_lower_bound_one_run(1000, 1000, 1000, 1e-3) < epsilon_lower_bound_one_run(1000, 1000, 1000, 0.0)


@pytest.mark.parametrize("args,match", [
    ((10, 11, 5, 1e-5), "num_guesses=11 is larger than num_canaries=10"),
    ((10, 5, 6, 1e-5), "num_correct=6 is larger than num_guesses=5"),
    ((-1, 0, 0, 1e-5), "num_canaries=-1 must be a non-negative integer"),
    ((10, 5.0, 5, 1e-5), "num_guesses=5.0 must be a non-negative integer"),
    ((10, True, 1, 1e-5), "num_guesses=True"),
    ((10, 5, 5, 1.5), r"delta=1.5 must be a number in \[0, 1\)"),
    ((10, 5, 5, float("nan")), "delta=nan"),
])
def test_one_run_bad_inputs_named(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        epsilon_lower_bound_one_run(*args)


def test_one_run_bad_beta_and_epsilon() -> None:
    with pytest.raises(ValueError, match=r"beta=0 must be a number in \(0, 1\)"):
        epsilon_lower_bound_one_run(10, 5, 5, 1e-5, beta=0)
    with pytest.raises(ValueError, match="epsilon=-1 must be a finite number >= 0"):
        one_run_p_value(10, 5, 5, -1, 1e-5)


@pytest.mark.parametrize("eps,m,beta", [(1.0, 200, 0.1), (3.0, 100, 0.05), (0.2, 500, 0.05)])
def test_one_run_is_valid_for_randomized_response(eps: float, m: int, beta: float) -> None:
    # eps-randomized response is the extremal eps-DP mechanism: each of m guesses is correct with probability
    # q = e^eps / (1 + e^eps), independently. The probability (exact, summed over v ~ Binomial(m, q)) that the
    # bound exceeds eps must be at most beta; and the bound is not vacuous at the median.
    q = 1 / (1 + math.exp(-eps))
    vs = np.arange(m + 1)
    bounds = np.array([epsilon_lower_bound_one_run(m, m, int(v), 0.0, beta) for v in vs])
    pmf = stats.binom.pmf(vs, m, q)
    assert float(np.sum(pmf[bounds > eps])) <= beta
    median_v = int(stats.binom.median(m, q))
    assert bounds[median_v] > 0.1 * eps


# ----------------------------------------------------------------------------- Clopper-Pearson and many runs
@pytest.mark.parametrize("n", [1, 10, 1000])
def test_clopper_pearson_closed_forms(n: int) -> None:
    alpha = 0.05
    lo, hi = clopper_pearson(0, n, alpha)
    assert lo == 0.0 and hi == pytest.approx(1 - (alpha / 2) ** (1 / n), rel=1e-9)  # (1 - p)^n = alpha / 2
    lo, hi = clopper_pearson(n, n, alpha)
    assert hi == 1.0 and lo == pytest.approx((alpha / 2) ** (1 / n), rel=1e-9)  # p^n = alpha / 2
    assert clopper_pearson(0, 0, alpha) == (0.0, 1.0)


def test_clopper_pearson_tails_are_alpha_over_two() -> None:
    k, n, alpha = 7, 50, 0.1
    lo, hi = clopper_pearson(k, n, alpha)
    assert stats.binom.sf(k - 1, n, lo) == pytest.approx(alpha / 2, rel=1e-7)  # P[X >= k | lo] = alpha/2
    assert stats.binom.cdf(k, n, hi) == pytest.approx(alpha / 2, rel=1e-7)  # P[X <= k | hi] = alpha/2


def test_clopper_pearson_coverage() -> None:
    rng = np.random.default_rng(1)
    n, p, alpha = 40, 0.15, 0.1
    ks = rng.binomial(n, p, size=2000)
    covered = np.mean([lo <= p <= hi for lo, hi in (clopper_pearson(int(k), n, alpha) for k in ks)])
    assert covered >= 1 - alpha


def test_many_runs_closed_form_and_both_directions() -> None:
    n, delta, alpha = 500, 1e-5, 0.05
    hi = 1 - (alpha / 2) ** (1 / n)
    perfect = epsilon_lower_bound_many_runs(0, 0, n, n, delta, alpha)
    assert perfect == pytest.approx(math.log((1 - delta - hi) / hi), rel=1e-9)
    # the two directions (region S: TPR <= e^eps FPR + delta; its complement: 1 - FPR <= e^eps FNR + delta)
    # are symmetric in (FPR, FNR)
    assert epsilon_lower_bound_many_runs(100, 5, n, n, delta, alpha) == pytest.approx(
        epsilon_lower_bound_many_runs(5, 100, n, n, delta, alpha), rel=1e-12)
    # asymmetric: fp=5, fn=100 of 500 each
    fpr_hi, fnr_hi = clopper_pearson(5, n, alpha)[1], clopper_pearson(100, n, alpha)[1]
    want = max(math.log((1 - delta - fnr_hi) / fpr_hi), math.log((1 - delta - fpr_hi) / fnr_hi))
    assert epsilon_lower_bound_many_runs(5, 100, n, n, delta, alpha) == pytest.approx(want, rel=1e-12)
    assert epsilon_lower_bound_many_runs(250, 250, n, n, delta, alpha) == 0.0  # chance: nothing
    assert epsilon_lower_bound_many_runs(0, 0, 0, 0, delta, alpha) == 0.0  # no runs: nothing


@pytest.mark.parametrize("args,match", [
    ((6, 0, 5, 5, 1e-5), "fp=6 false positives out of negatives=5"),
    ((0, 6, 5, 5, 1e-5), "fn=6 false negatives out of positives=5"),
    ((0, 0, 5, 5, -0.1), "delta=-0.1"),
    ((0, 0, 5, 5, 1e-5, 1.0), r"alpha=1.0 must be a number in \(0, 1\)"),
    ((0.5, 0, 5, 5, 1e-5), "fp=0.5 must be a non-negative integer"),
])
def test_many_runs_bad_inputs_named(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        epsilon_lower_bound_many_runs(*args)


def test_clopper_pearson_bad_inputs() -> None:
    with pytest.raises(ValueError, match="k=3 successes out of n=2 trials"):
        clopper_pearson(3, 2, 0.05)
