r"""PRV accountant (Gopi, Lee, Wutschitz 2021, "Numerical composition of differential privacy").

The privacy loss random variable (PRV) of one step is :math:`Y = \log(P(o)/Q(o))`, :math:`o \sim P`, with
:math:`P = (1-q)\,\mathcal N(0,\sigma^2) + q\,\mathcal N(1,\sigma^2)` and :math:`Q = \mathcal N(0,\sigma^2)`
(add/remove adjacency). Composition adds independent PRVs, so their densities convolve; the accountant
discretises each PRV on a mesh of width :math:`h = \varepsilon_{err} / \sqrt{(T/2)\log(12/\delta_{err})}`
over :math:`[-L, L]` and composes with FFTs. Then
:math:`\delta(\varepsilon) = \mathbb E[(1 - e^{\varepsilon - Y})_+]`, and Theorem 5.5 of the paper gives

.. math:: \delta(\varepsilon + \varepsilon_{err}) - \delta_{err} \le \tilde\delta(\varepsilon)
          \le \delta(\varepsilon - \varepsilon_{err}) + \delta_{err},

so the true epsilon lies in ``[eps_lower, eps_upper]``. fastdp reports the guaranteed **upper** bound
``eps_upper`` with ``eps_error = 0.01`` and ``delta_error = delta / 1000`` (the Opacus convention).

The numerics are done by the ``prv-accountant`` package (v0.2.0): one PRV per distinct ``(sigma, q)`` history
entry (``PoissonSubsampledGaussianMechanism(q, sigma)``, or ``GaussianMechanism(sigma)`` when ``q = 1``),
composed heterogeneously by ``prv_accountant.PRVAccountant`` with ``max_self_compositions`` = the entry
counts.
fastdp chooses the half-width ``L`` itself (the remark-5.6 rule, with fastdp's RDP as the tail bound, rounded
*up* to an FFT-friendly grid size), which lets it:

* predict the cost up front: if the grid would be too large (tiny sigma / huge epsilon, where prv-accountant
  0.2.0 takes minutes and then raises ``RuntimeError("Discrete mean differs ...")`` or exhausts memory), it
  does not try;
* fall back to the RDP upper bound whenever prv-accountant fails (``RuntimeError``, ``ValueError``
  "Floating point errors will dominate", overflow, ...). The fallback is announced with a
  :class:`PRVFallbackWarning` saying that the RDP upper bound is reported instead.

Both PRV's ``eps_upper`` and the RDP epsilon are valid upper bounds, so the reported value is their minimum
(in practice PRV's, except where ``eps_error`` dominates a tiny epsilon).
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from scipy.fft import next_fast_len

from fastdp.accounting.base import Accountant, HistoryEntry
from fastdp.accounting.checks import check_delta
from fastdp.accounting.rdp import DEFAULT_ORDERS, RDPAccountant, rdp_epsilon_for_history
from fastdp.accounting.search import CalibrationPlan, SearchStage

__all__ = ["PRVAccountant", "PRVFallbackWarning", "PRVResult", "prv_epsilon_for_history"]

logger = logging.getLogger(__name__)

#: Largest discretisation grid (number of points) attempted: prv-accountant 0.2.0 needs about 2-3.5 s per
#: million points (long-double FFTs) on a 2-core CPU, so this keeps one call well under 20 s.
MAX_GRID_POINTS = 4_000_000
#: Largest total work (grid points x distinct history entries) attempted before falling back to RDP.
MAX_TOTAL_WORK = 8_000_000

DEFAULT_EPS_ERROR = 0.01
_COARSE_EPS_ERROR = 0.1  # the calibration's cheap first PRV pass
_CALIBRATION_RTOL = 4e-3  # the calibration's bracket on the PRV sigma: hi / lo - 1 <= this
_CALIBRATION_TIME_BUDGET_S = 27.0  # stop refining the PRV sigma when another evaluation would overrun this


class PRVFallbackWarning(RuntimeWarning):
    """The PRV accountant could not be used; the RDP upper bound is reported instead."""


class PRVResult(NamedTuple):
    """Result of a PRV computation: bounds on epsilon and whether the RDP fallback was used."""

    lower: float
    estimate: float
    upper: float
    fallback_reason: str | None = None


def _grid(
    total_steps: int, eps_error: float, delta_error: float, half_width: float
) -> tuple[float, int, float]:
    """Mesh width, FFT-friendly even grid size and the half-width L to pass as ``eps_max``.

    ``Domain.create_aligned(-L, L, h)`` produces ``2m + 2`` points when ``L = (m - 1/4) h``; we pick the
    smallest
    ``m >= L_safe / h`` that makes ``2m + 2`` a 5-smooth number (fast FFT), i.e. a domain at least as large as
    the safe one.
    """
    mesh = eps_error / np.sqrt(total_steps / 2 * np.log(12 / delta_error))
    m = int(math.ceil(half_width / mesh)) + 1
    n = next_fast_len(2 * m + 2, real=True)
    while n % 2:
        n = next_fast_len(n + 1, real=True)
    m = n // 2 - 1
    return float(mesh), int(n), (m - 0.25) * float(mesh)


def _safe_half_width(history: Sequence[HistoryEntry], eps_error: float, delta_error: float) -> float:
    """Domain half-width L (Gopi et al. remark 5.6), with fastdp's RDP bound as the tail bound.

    ``L = max(eps_RDP(all, delta_error/4), max_k eps_RDP(one step of entry k, delta_error/(8 T)),
    eps_error) + 3``.
    """
    total = sum(n for _, _, n in history)
    big = rdp_epsilon_for_history(history, delta_error / 4, DEFAULT_ORDERS, warn_at_boundary=False)[0]
    for sigma, q, _ in history:
        one = rdp_epsilon_for_history(
            [(sigma, q, 1)], delta_error / (8 * total), DEFAULT_ORDERS, warn_at_boundary=False
        )[0]
        big = max(big, one)
    return max(big, eps_error) + 3.0


@functools.lru_cache(maxsize=256)
def _prv_cached(
    history: tuple[HistoryEntry, ...], delta: float, eps_error: float, delta_error: float
) -> PRVResult:
    rdp_eps = rdp_epsilon_for_history(history, delta, DEFAULT_ORDERS, warn_at_boundary=False)[0]

    def fallback(reason: str) -> PRVResult:
        logger.info("PRV fallback to RDP (%s)", reason)
        return PRVResult(0.0, rdp_eps, rdp_eps, reason)

    total = sum(n for _, _, n in history)
    half_width = _safe_half_width(history, eps_error, delta_error)
    if not math.isfinite(half_width):
        return fallback("the RDP tail bound needed for the PRV domain is infinite")
    mesh, n_points, eps_max = _grid(total, eps_error, delta_error, half_width)
    if n_points > MAX_GRID_POINTS or n_points * len(history) > MAX_TOTAL_WORK:
        return fallback(
            f"the PRV discretisation would need {n_points:,} grid points x {len(history)} distinct "
            f"(sigma, q) "
            f"entries (limit {MAX_GRID_POINTS:,} points, {MAX_TOTAL_WORK:,} in total); this happens for very "
            "small noise multipliers / very large epsilon or many distinct (sigma, q) phases"
        )
    try:
        import prv_accountant
        from prv_accountant import GaussianMechanism, PoissonSubsampledGaussianMechanism

        prvs = [
            GaussianMechanism(sigma) if q == 1.0 else PoissonSubsampledGaussianMechanism(q, sigma)
            for sigma, q, _ in history
        ]
        counts = [int(n) for _, _, n in history]
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            acc = prv_accountant.PRVAccountant(
                prvs=prvs,
                eps_error=eps_error,
                delta_error=delta_error,
                max_self_compositions=counts,
                eps_max=eps_max,
            )
            lower, estimate, upper = acc.compute_epsilon(delta=delta, num_self_compositions=counts)
    except (RuntimeError, ValueError, ArithmeticError, MemoryError, AssertionError, TypeError) as exc:
        return fallback(f"prv-accountant raised {type(exc).__name__}: {exc}")
    lower, estimate, upper = float(lower), float(estimate), float(upper)
    if math.isnan(upper) or math.isnan(estimate):
        return fallback("prv-accountant returned NaN")
    if upper > rdp_eps:
        logger.debug("PRV upper bound %.6g exceeds the RDP bound %.6g; reporting RDP", upper, rdp_eps)
        upper = rdp_eps
        estimate = min(estimate, rdp_eps)
    return PRVResult(max(lower, 0.0), max(estimate, 0.0), max(upper, 0.0), None)


def prv_epsilon_for_history(
    history: Sequence[HistoryEntry],
    delta: float,
    eps_error: float = DEFAULT_EPS_ERROR,
    delta_error: float | None = None,
) -> PRVResult:
    """(lower, estimate, upper) epsilon of a (possibly heterogeneous) history via the PRV accountant.

    Never raises for valid input: if prv-accountant cannot be used, a :class:`PRVFallbackWarning` is issued
    and the RDP upper bound is returned as ``estimate`` and ``upper`` (``lower`` is then 0).
    """
    delta = check_delta(delta)
    if delta_error is None:
        delta_error = delta / 1000.0
    if not history:
        return PRVResult(0.0, 0.0, 0.0, None)
    # composition commutes: entries with the same (sigma, q) are one PRV composed sum(counts) times
    merged: dict[tuple[float, float], int] = {}
    for s, q, n in history:
        merged[(float(s), float(q))] = merged.get((float(s), float(q)), 0) + int(n)
    key = tuple((s, q, n) for (s, q), n in merged.items())
    result = _prv_cached(key, delta, float(eps_error), float(delta_error))
    if result.fallback_reason is not None:
        warnings.warn(
            f"PRV accountant not used ({result.fallback_reason}); reporting the RDP upper bound "
            f"epsilon={result.upper:.6g} instead, which is valid but looser",
            PRVFallbackWarning,
            stacklevel=3,
        )
    return result


class PRVAccountant(Accountant):
    """Privacy-random-variable accountant (Gopi, Lee, Wutschitz 2021); fastdp's default.

    ``get_epsilon`` returns the guaranteed **upper bound** ``eps_upper`` (true epsilon <= eps_upper <= true
    epsilon + 2 * eps_error). It is tight -- within ``eps_error`` of the exact value -- so it is the
    recommended
    accountant. When prv-accountant cannot handle a regime (very small noise multiplier, very large epsilon,
    tiny delta) the RDP upper bound is reported instead, with a :class:`PRVFallbackWarning`.

    Args:
        eps_error: allowed error on epsilon (default 0.01).
        delta_error: allowed error on delta; default ``delta / 1000`` at each ``get_epsilon`` call.
    """

    name = "prv"

    def __init__(self, eps_error: float = DEFAULT_EPS_ERROR, delta_error: float | None = None) -> None:
        super().__init__()
        self._set_errors(eps_error, delta_error)

    def _set_errors(self, eps_error: float, delta_error: float | None) -> None:
        if (
            isinstance(eps_error, bool)
            or not isinstance(eps_error, (int, float))
            or not (0 < eps_error < 1 and math.isfinite(eps_error))
        ):
            raise ValueError(f"eps_error must be in (0, 1), got {eps_error!r}")
        if delta_error is not None and (
            isinstance(delta_error, bool)
            or not isinstance(delta_error, (int, float))
            or not 0 < delta_error < 1
        ):
            raise ValueError(f"delta_error must be None or in (0, 1), got {delta_error!r}")
        self.eps_error = float(eps_error)
        self.delta_error = None if delta_error is None else float(delta_error)

    def _delta_error(self, delta: float) -> float:
        delta_error = delta / 1000.0 if self.delta_error is None else self.delta_error
        if delta_error >= delta:
            raise ValueError(f"delta_error={delta_error!r} must be smaller than delta={delta!r}")
        return delta_error

    def get_epsilon_bounds(self, delta: float) -> tuple[float, float, float]:
        """``(eps_lower, eps_estimate, eps_upper)`` for the ledger (all 0.0 when empty, all inf when it has a
        release without a guarantee)."""
        delta = check_delta(delta)
        parts = self.ledger.parts()
        if parts.non_private:
            return math.inf, math.inf, math.inf
        if not parts.gaussians:
            return 0.0, 0.0, 0.0
        res = prv_epsilon_for_history(parts.history(), delta, self.eps_error, self._delta_error(delta))
        return res.lower, res.estimate, res.upper

    def _epsilon(self, history: list[HistoryEntry], delta: float) -> float:
        return prv_epsilon_for_history(history, delta, self.eps_error, self._delta_error(delta)).upper

    def calibration_plan(self, target_epsilon: float, delta: float, sample_rate: float,
                         steps: int) -> CalibrationPlan:
        """Three searches: the RDP sigma (the RDP accountant's plan); then a PRV about 10x cheaper
        (``eps_error = 0.1``; its estimate plus this accountant's ``eps_error`` predicts the fine upper bound to
        ~1e-3) started at 0.92x the RDP sigma; then this accountant's own upper bound, started just above the
        coarse answer (usually two evaluations; stops refining after 27 s). Both PRV stages use the log-log slope
        of the RDP curve at the RDP sigma. The result falls back to RDP (with a :class:`PRVFallbackWarning`)
        where PRV cannot be used."""
        rdp_plan = RDPAccountant().calibration_plan(target_epsilon, delta, sample_rate, steps)
        rdp_f = rdp_plan.stages[-1].epsilon
        delta_error = self._delta_error(delta)
        eps_error = self.eps_error

        def coarse(sigma: float) -> float:
            res = _prv_cached(((sigma, sample_rate, steps),), delta, _COARSE_EPS_ERROR, delta_error)
            if res.fallback_reason is not None:
                return res.upper
            return min(res.estimate + eps_error, rdp_f(sigma))  # the fine result is also capped by RDP

        def fine(sigma: float) -> float:
            return _prv_cached(((sigma, sample_rate, steps),), delta, eps_error, delta_error).upper

        def finish(sigma: float) -> None:
            res = _prv_cached(((sigma, sample_rate, steps),), delta, eps_error, delta_error)
            if res.fallback_reason is not None:
                warnings.warn(
                    f"PRV accountant not used at noise_multiplier={sigma:.6g} ({res.fallback_reason}); the "
                    "calibration used the RDP upper bound instead",
                    PRVFallbackWarning,
                    stacklevel=4,
                )

        rtol = _CALIBRATION_RTOL
        stages = rdp_plan.stages + (
            SearchStage(coarse, rtol=2e-3, start=0.92),
            SearchStage(fine, rtol=rtol, start=1 + rtol / 3, time_budget_s=_CALIBRATION_TIME_BUDGET_S),
        )
        return CalibrationPlan(stages=stages, seed=rdp_plan.seed, slope0=rdp_plan.slope0, finish=finish)

    def _config(self) -> dict:
        return {"eps_error": self.eps_error, "delta_error": self.delta_error}

    def _load_config(self, config: dict) -> None:
        self._set_errors(config.get("eps_error", DEFAULT_EPS_ERROR), config.get("delta_error"))
