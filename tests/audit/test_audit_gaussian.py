"""Audits of the Gaussian mechanism with known epsilon (no training): fastdp.audit.gaussian and audit_from_scores.

The mechanism is exactly (epsilon, delta)-DP (sigma from the GDP conversion), so every bound must be <= epsilon;
the settings below are seeded and the bounds they reach are stated as fractions of epsilon.
"""

from __future__ import annotations

import numpy as np
import pytest

from fastdp.accounting.gdp import delta_from_mu
from fastdp.audit import (
    audit_from_scores,
    audit_gaussian_many_runs,
    audit_gaussian_one_run,
    default_guess_counts,
    draw_membership,
    epsilon_lower_bound_one_run,
    gaussian_sigma,
    guesses_from_scores,
)

DELTA = 1e-5


@pytest.mark.parametrize("eps", [1.0, 4.0, 8.0])
def test_gaussian_sigma_is_exact(eps: float) -> None:
    sigma = gaussian_sigma(eps, DELTA)
    assert delta_from_mu(eps, 1 / sigma) == pytest.approx(DELTA, rel=1e-6)


# one run, m = 10,000 Dirac canaries, 95 %: measured 0.98 (eps=2), 1.78 (eps=4), 3.18 (eps=8) at seed 0
@pytest.mark.parametrize("eps", [2.0, 4.0, 8.0])
def test_one_run_gaussian_close_below(eps: float) -> None:
    res = audit_gaussian_one_run(eps, DELTA, num_canaries=10_000, seed=0)
    assert res.epsilon_lower_bound <= eps
    assert res.epsilon_lower_bound >= 0.35 * eps, res
    assert not res.exceeds_claim and res.confidence == 0.95


# many runs, 200,000 releases, Clopper-Pearson at 95 %: measured 1.16 (eps=2), 2.50 (eps=4), 4.85 (eps=8)
@pytest.mark.parametrize("eps", [2.0, 4.0, 8.0])
def test_many_runs_gaussian_close_below(eps: float) -> None:
    res = audit_gaussian_many_runs(eps, DELTA, runs=200_000, seed=0)
    assert res.epsilon_lower_bound <= eps
    assert res.epsilon_lower_bound >= 0.5 * eps, res


def test_one_run_gaussian_never_above_over_seeds() -> None:
    bounds = [audit_gaussian_one_run(2.0, DELTA, num_canaries=1000, seed=s).epsilon_lower_bound for s in range(20)]
    assert max(bounds) <= 2.0 and min(bounds) > 0


def test_audit_detects_a_weaker_mechanism_than_claimed() -> None:
    # the noise of eps = 8 released while eps = 1 is claimed: the bound refutes the claim
    res = audit_gaussian_one_run(8.0, DELTA, num_canaries=10_000, seed=0)
    claimed = 1.0
    assert res.epsilon_lower_bound > claimed
    rng = np.random.default_rng(3)
    sigma = gaussian_sigma(8.0, DELTA)
    mem = draw_membership(5000, rng)
    res = audit_from_scores(mem + sigma * rng.standard_normal(5000), mem, DELTA, claimed_epsilon=claimed)
    assert res.exceeds_claim


def test_guesses_from_scores() -> None:
    s = np.array([0.3, -1.0, 2.0, 0.0, 5.0])
    assert guesses_from_scores(s, 2, 1).tolist() == [0, -1, 1, 0, 1]
    assert guesses_from_scores(s, 0, 0).tolist() == [0] * 5
    assert guesses_from_scores(s, 5, 0).tolist() == [1] * 5
    with pytest.raises(ValueError, match="k_pos \\+ k_neg = 6 guesses exceed the 5 canaries"):
        guesses_from_scores(s, 3, 3)
    with pytest.raises(ValueError, match="k_pos=-1 must be a non-negative integer"):
        guesses_from_scores(s, -1, 0)
    with pytest.raises(ValueError, match="1 non-finite values"):
        guesses_from_scores(np.array([0.0, np.nan]), 1, 0)


def test_audit_from_scores_perfect_and_random() -> None:
    m = 1000
    mem = draw_membership(m, 0)
    perfect = audit_from_scores(mem.astype(float), mem, DELTA)
    # perfect scores: the top k_pos are right up to the n_in included, the bottom k_neg up to the n_out excluded;
    # each candidate is tested at beta / (number of candidates) (Bonferroni)
    n_in = int(mem.sum())
    cands = default_guess_counts(m)
    want = max(epsilon_lower_bound_one_run(m, kp + kn, min(kp, n_in) + min(kn, m - n_in), DELTA, 0.05 / len(cands))
               for kp, kn in cands)
    assert perfect.epsilon_lower_bound == pytest.approx(want) and perfect.candidates == len(cands) == 6
    rng = np.random.default_rng(0)
    assert audit_from_scores(rng.standard_normal(m), mem, DELTA).epsilon_lower_bound < 0.3
    # a single fixed (k_pos, k_neg), as in the paper: no correction
    fixed = audit_from_scores(mem.astype(float), mem, DELTA, guess_counts=[(50, 50)])
    assert fixed.candidates == 1 and fixed.epsilon_lower_bound == pytest.approx(
        epsilon_lower_bound_one_run(m, 100, 100, DELTA, 0.05))


def test_audit_from_scores_bad_inputs() -> None:
    with pytest.raises(ValueError, match="membership must be a bool array"):
        audit_from_scores(np.zeros(3), np.array([1, 0, 1]), DELTA)
    with pytest.raises(ValueError, match=r"beta=1.0 must be in \(0, 1\)"):
        audit_from_scores(np.zeros(3), np.array([True, False, True]), DELTA, beta=1.0)
    with pytest.raises(ValueError, match="guess_counts is empty"):
        audit_from_scores(np.zeros(3), np.array([True, False, True]), DELTA, guess_counts=[])
    with pytest.raises(ValueError, match="scores must be a non-empty 1-D array"):
        audit_from_scores(np.zeros((0,)), np.zeros((0,), dtype=bool), DELTA)
    with pytest.raises(ValueError, match="num_canaries=0 must be a positive integer"):
        draw_membership(0)
    with pytest.raises(ValueError, match="runs=1 must be an integer >= 2"):
        audit_gaussian_many_runs(1.0, DELTA, runs=1)
