r"""Audits of the Gaussian mechanism itself (no training): a mechanism whose epsilon is known exactly.

The mechanism: sensitivity 1, noise ``N(0, sigma^2)`` with ``sigma`` the smallest noise for which it is
(epsilon, delta)-DP. The Gaussian mechanism with ``sigma`` is exactly ``1/sigma``-GDP (Dong, Roth & Su 2022,
Theorem 2.7) and ``mu``-GDP is (epsilon, delta)-DP iff ``delta >= Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``
(their Corollary 2.13; the analytic Gaussian mechanism of Balle & Wang 2018, Theorem 8); so
``sigma = 1 / mu_from_epsilon_delta(epsilon, delta)`` (:mod:`fastdp.accounting.gdp`).

* :func:`audit_gaussian_one_run`: ``m`` Dirac canaries ``e_i`` in ``R^m``, each included with probability 1/2;
  the output is ``Y = sum_{i included} e_i + sigma Z``; each canary's inclusion changes one coordinate by 1, so
  the release is (epsilon, delta)-DP with respect to each canary. Score ``Y_i``; one-run bound
  (:func:`fastdp.audit.audit_from_scores`).
* :func:`audit_gaussian_many_runs`: ``runs`` independent releases of one canary (``Y = b + sigma Z``, ``b`` in
  {0, 1} with probability 1/2), the rejection region ``Y > t`` with ``t`` fixed in advance from the mechanism's
  claimed ``sigma`` and ``runs`` (the threshold whose bound is largest at the expected error counts),
  Clopper-Pearson bound (:func:`fastdp.audit.epsilon_lower_bound_many_runs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import stats

from fastdp.accounting.gdp import mu_from_epsilon_delta
from fastdp.audit.bounds import epsilon_lower_bound_many_runs
from fastdp.audit.guesses import AuditResult, audit_from_scores, draw_membership

__all__ = ["audit_gaussian_many_runs", "audit_gaussian_one_run", "gaussian_sigma"]


def gaussian_sigma(epsilon: float, delta: float) -> float:
    """The smallest noise ``sigma`` for which the sensitivity-1 Gaussian mechanism is (epsilon, delta)-DP."""
    return 1.0 / mu_from_epsilon_delta(epsilon, delta)


def audit_gaussian_one_run(epsilon: float, delta: float, *, num_canaries: int = 1000, beta: float = 0.05,
                           guess_counts: Sequence[tuple[int, int]] | None = None, seed: int = 0) -> AuditResult:
    """One-run audit of the (epsilon, delta)-DP Gaussian mechanism with ``num_canaries`` Dirac canaries (seeded)."""
    rng = np.random.default_rng(seed)
    sigma = gaussian_sigma(epsilon, delta)
    membership = draw_membership(num_canaries, rng)
    y = membership.astype(np.float64) + sigma * rng.standard_normal(num_canaries)
    res = audit_from_scores(y, membership, delta, beta=beta, guess_counts=guess_counts, claimed_epsilon=epsilon)
    res.extra["sigma"] = sigma
    return res


def _best_threshold(sigma: float, delta: float, runs: int, alpha: float) -> float:
    """The threshold ``t`` whose many-runs bound is largest at the EXPECTED counts of ``runs`` releases.

    Expected false positives ``runs/2 * P[sigma Z > t]`` and false negatives ``runs/2 * P[1 + sigma Z <= t]``
    (rounded), through the same Clopper-Pearson bound; computed from the claimed mechanism and the number of runs
    only, never from the sampled releases (grid of 401 thresholds over ``[-2 sigma, 1 + 8 sigma]``).
    """
    half = runs // 2
    best_t, best = 0.5, -1.0
    for t in np.linspace(-2 * sigma, 1 + 8 * sigma, 401):
        fp = round(half * float(stats.norm.sf(t / sigma)))
        fn = round(half * float(stats.norm.cdf((t - 1) / sigma)))
        eps = epsilon_lower_bound_many_runs(fp, fn, half, half, delta, alpha)
        if eps > best:
            best_t, best = float(t), eps
    return best_t


def audit_gaussian_many_runs(epsilon: float, delta: float, *, runs: int = 200_000, alpha: float = 0.05,
                             seed: int = 0, threshold: float | None = None) -> AuditResult:
    """Many-runs audit of the (epsilon, delta)-DP Gaussian mechanism: ``runs`` releases, Clopper-Pearson bound.

    The threshold is fixed before the runs (default: the best one at the claimed ``sigma`` and ``runs``, a property of
    the mechanism, not of the sampled runs), so the bound's confidence ``1 - alpha`` holds.
    """
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 2:
        raise ValueError(f"runs={runs!r} must be an integer >= 2")
    rng = np.random.default_rng(seed)
    sigma = gaussian_sigma(epsilon, delta)
    t = _best_threshold(sigma, delta, runs, alpha) if threshold is None else float(threshold)
    b = rng.random(runs) < 0.5
    y = b.astype(np.float64) + sigma * rng.standard_normal(runs)
    guess_in = y > t
    fp = int(np.count_nonzero(guess_in & ~b))
    fn = int(np.count_nonzero(~guess_in & b))
    negatives, positives = int(np.count_nonzero(~b)), int(np.count_nonzero(b))
    eps = epsilon_lower_bound_many_runs(fp, fn, negatives, positives, delta, alpha)
    return AuditResult(epsilon_lower_bound=eps, confidence=1 - alpha, delta=delta, num_canaries=runs,
                       num_guesses=runs, num_correct=runs - fp - fn, k_pos=int(np.count_nonzero(guess_in)),
                       k_neg=int(np.count_nonzero(~guess_in)), candidates=1, claimed_epsilon=epsilon,
                       method="many runs, Clopper-Pearson (Jagielski et al. 2020; Nasr et al. 2021)",
                       extra={"sigma": sigma, "threshold": t, "fp": fp, "fn": fn, "negatives": negatives,
                              "positives": positives})
