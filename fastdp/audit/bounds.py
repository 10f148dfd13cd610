r"""Lower bounds on epsilon from membership guesses: the one-run audit and the classic many-runs audit.

Plain functions of counts (numpy/scipy only); the canaries, the training and the scores are in
:mod:`fastdp.audit.canaries`.

**One training run** (Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS 2023,
arXiv:2305.08846). ``m`` canaries, each included independently with probability 1/2 (``S in {-1, +1}^m``
uniform); the auditor sees the output and makes ``r`` guesses (abstaining on ``m - r``), of which ``v`` are
correct. The paper's main result for an (epsilon, delta)-DP algorithm bounds the number ``W`` of correct guesses
(cited as Corollary 5.4, pp. 15-16 of arXiv:2305.08846v1, by a third-party port; the numbering could not be
checked against the PDF here): for every ``v``,

.. math::

    P[W \ge v] \le f(v) + 2 m \delta \cdot \max_{i = 1..v} \frac{f(v - i) - f(v)}{i},
    \qquad f(v) = P[\mathrm{Binomial}(r, q) \ge v], \quad q = \frac{e^\varepsilon}{e^\varepsilon + 1}.

The right-hand side is a p-value for the null hypothesis "the algorithm is (epsilon, delta)-DP" (``q`` is the
accuracy of epsilon-DP randomized response). :func:`one_run_p_value` evaluates it exactly (scipy's binomial
tails, no normal approximation), exactly as the paper's own code in its Appendix D (``p_value_DP_audit``,
``get_eps_audit``) computes it (the same computation is ``_one_run_p_value`` in google-deepmind/jax_privacy
``auditing.py``); tests/audit reproduces the paper's printed values 0.673 (Appendix D) and 2.675 (Section 7).
The reported bound is the largest epsilon the observation rejects at level ``beta``, found by bisection on epsilon
(:func:`epsilon_lower_bound_one_run`): a larger epsilon makes ``v`` correct guesses more plausible (the p-value
grows with epsilon), so the rejected epsilons form an interval ``[0, eps_lb)``.

**Many runs** (Jagielski, Ullman & Oprea, "Auditing Differentially Private Machine Learning: How Private is
Private SGD?", NeurIPS 2020; Nasr, Song, Thakurta, Papernot & Carlini, "Adversary Instantiation", IEEE S&P 2021).
From ``N`` independent trainings, half with the canary (positives) and half without (negatives), a fixed
rejection region gives false positives ``fp`` out of ``negatives`` and false negatives ``fn`` out of
``positives``. (epsilon, delta)-DP implies ``FPR + e^eps FNR >= 1 - delta`` and ``FNR + e^eps FPR >= 1 - delta``
(the hypothesis-testing view of DP, Kairouz, Oh & Viswanath 2015), hence

.. math::

    \varepsilon \ge \max\Big(\log\frac{1 - \delta - \overline{\mathrm{FNR}}}{\overline{\mathrm{FPR}}},\;
                              \log\frac{1 - \delta - \overline{\mathrm{FPR}}}{\overline{\mathrm{FNR}}}\Big)

with :math:`\overline{\cdot}` the upper ends of Clopper-Pearson intervals (:func:`clopper_pearson`).
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

import numpy as np
from scipy import stats

__all__ = ["clopper_pearson", "epsilon_lower_bound_many_runs", "epsilon_lower_bound_one_run", "one_run_p_value"]

#: bisection stops when the bracket on epsilon is this narrow
_EPS_TOL = 1e-7
#: the largest epsilon the one-run bisection searches (beyond it q = e^eps/(1+e^eps) is 1 in float64)
_EPS_MAX = 60.0


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer (a count)")
    return int(value)


def _probability(name: str, value: Any, *, open_low: bool = True, open_high: bool = True) -> float:
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > 0 if open_low else value >= 0) and (value < 1 if open_high else value <= 1)
    if not ok:
        lo, hi = ("(" if open_low else "["), (")" if open_high else "]")
        raise ValueError(f"{name}={value!r} must be a number in {lo}0, 1{hi}")
    return float(value)


def clopper_pearson(k: int, n: int, alpha: float) -> tuple[float, float]:
    r"""The two-sided Clopper-Pearson (exact) ``1 - alpha`` confidence interval for a binomial proportion.

    ``k`` successes out of ``n`` trials. ``lower = Beta(alpha/2; k, n - k + 1)`` (0 when ``k = 0``) and
    ``upper = Beta(1 - alpha/2; k + 1, n - k)`` (1 when ``k = n``), the quantiles of the Beta distribution
    (Clopper & Pearson 1934); each end fails with probability at most ``alpha / 2``. ``n = 0`` gives
    ``(0, 1)``: no trials say nothing.
    """
    k, n = _count("k", k), _count("n", n)
    if k > n:
        raise ValueError(f"k={k} successes out of n={n} trials: k must be <= n")
    alpha = _probability("alpha", alpha)
    if n == 0:
        return 0.0, 1.0
    lower = 0.0 if k == 0 else float(stats.beta.ppf(alpha / 2, k, n - k + 1))
    upper = 1.0 if k == n else float(stats.beta.ppf(1 - alpha / 2, k + 1, n - k))
    return lower, upper


def epsilon_lower_bound_many_runs(fp: int, fn: int, negatives: int, positives: int, delta: float,
                                  alpha: float = 0.05) -> float:
    r"""Lower bound on epsilon, with confidence ``1 - alpha``, from the errors of a membership test over many runs.

    ``fp`` false positives among ``negatives`` runs without the canary, ``fn`` false negatives among
    ``positives`` runs with it, for a rejection region fixed before the runs. Both directions of the test
    (the region and its complement) are bounded, and the larger is returned (module docstring; Jagielski et al.
    2020, Nasr et al. 2021)::

        eps >= max(log((1 - delta - FNR_hi) / FPR_hi), log((1 - delta - FPR_hi) / FNR_hi), 0)

    ``FPR_hi``, ``FNR_hi``: upper ends of the two-sided Clopper-Pearson ``1 - alpha`` intervals; each fails with
    probability at most ``alpha / 2``, so both hold, and so does the bound, with probability ``>= 1 - alpha``.
    Returns 0.0 when the errors prove nothing (``1 - delta - rate_hi <= 0`` in both directions).
    """
    fp, fn = _count("fp", fp), _count("fn", fn)
    negatives, positives = _count("negatives", negatives), _count("positives", positives)
    if fp > negatives:
        raise ValueError(f"fp={fp} false positives out of negatives={negatives} runs without the canary: "
                         "fp must be <= negatives")
    if fn > positives:
        raise ValueError(f"fn={fn} false negatives out of positives={positives} runs with the canary: "
                         "fn must be <= positives")
    delta = _probability("delta", delta, open_low=False)
    alpha = _probability("alpha", alpha)
    fpr_hi = clopper_pearson(fp, negatives, alpha)[1]
    fnr_hi = clopper_pearson(fn, positives, alpha)[1]
    best = 0.0
    for num, den in ((1.0 - delta - fnr_hi, fpr_hi), (1.0 - delta - fpr_hi, fnr_hi)):
        if num > 0 and den > 0:
            best = max(best, math.log(num / den))
    return best


def _check_guesses(num_canaries: Any, num_guesses: Any, num_correct: Any) -> tuple[int, int, int]:
    m = _count("num_canaries", num_canaries)
    r = _count("num_guesses", num_guesses)
    v = _count("num_correct", num_correct)
    if r > m:
        raise ValueError(f"num_guesses={r} is larger than num_canaries={m}: one guess at most per canary")
    if v > r:
        raise ValueError(f"num_correct={v} is larger than num_guesses={r}")
    return m, r, v


def one_run_p_value(num_canaries: int, num_guesses: int, num_correct: int, epsilon: float, delta: float) -> float:
    r"""P-value of ``num_correct`` (or more) correct guesses if the algorithm is (epsilon, delta)-DP.

    The right-hand side of Steinke, Nasr & Jagielski's main theorem (module docstring), capped at 1::

        q     = e^eps / (1 + e^eps)
        f(v)  = P[Binomial(r, q) >= v]
        alpha = max_{i = 1..v} (f(v - i) - f(v)) / i = max_i P[v - i <= Binomial(r, q) < v] / i
        p     = f(v) + 2 * m * delta * alpha

    ``m = num_canaries`` (guesses and abstentions), ``r = num_guesses``, ``v = num_correct``; all binomial
    probabilities exact (scipy).
    """
    m, r, v = _check_guesses(num_canaries, num_guesses, num_correct)
    if not (isinstance(epsilon, Real) and math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon={epsilon!r} must be a finite number >= 0")
    delta = _probability("delta", delta, open_low=False)
    q = float(1.0 / (1.0 + math.exp(-epsilon)))
    tail = float(stats.binom.sf(v - 1, r, q))  # f(v) = P[B >= v]
    if delta == 0 or v == 0:
        return min(tail, 1.0)
    i = np.arange(1, v + 1)
    # P[v - i <= B < v] = cdf(v - 1) - cdf(v - i - 1), one value per i
    between = stats.binom.cdf(v - 1, r, q) - stats.binom.cdf(v - i - 1, r, q)
    alpha = float(np.max(np.maximum(between, 0.0) / i))
    return min(tail + 2.0 * m * delta * alpha, 1.0)


def epsilon_lower_bound_one_run(num_canaries: int, num_guesses: int, num_correct: int, delta: float,
                                beta: float = 0.05) -> float:
    r"""The one-run lower bound on epsilon: the largest epsilon rejected at level ``beta`` (confidence ``1 - beta``).

    ``sup {eps >= 0 : one_run_p_value(m, r, v, eps, delta) < beta}``, by bisection on epsilon to ``1e-7``
    (the p-value increases with epsilon). Returns 0.0 when even epsilon = 0 is not rejected (for example no
    guesses, or no more correct guesses than chance). The bound is capped at 60 (where ``q`` rounds to 1).

    Steinke, Nasr & Jagielski 2023 (module docstring): with probability at least ``1 - beta`` over the canaries'
    inclusion, an (epsilon, delta)-DP algorithm does not produce a result whose bound exceeds its epsilon.
    """
    m, r, v = _check_guesses(num_canaries, num_guesses, num_correct)
    delta = _probability("delta", delta, open_low=False)
    beta = _probability("beta", beta)
    if one_run_p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(m, r, v, hi, delta) < beta:
        lo, hi = hi, 2 * hi
        if hi > _EPS_MAX:
            return _EPS_MAX
    while hi - lo > _EPS_TOL:
        mid = 0.5 * (lo + hi)
        if one_run_p_value(m, r, v, mid, delta) < beta:
            lo = mid
        else:
            hi = mid
    return lo
