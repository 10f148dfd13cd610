"""Noise calibration as a search any accountant can describe: :class:`CalibrationPlan` and :func:`run_plan`.

An accountant says how to find the smallest noise multiplier meeting a target epsilon by returning a
:class:`CalibrationPlan` from :meth:`~fastdp.accounting.base.Accountant.calibration_plan`: either a closed form, or
a starting guess and a list of :class:`SearchStage`, each a decreasing function ``sigma -> epsilon`` searched in turn
(cheap proxies first, the accountant's own epsilon last), each started from the previous stage's answer. The
calibration (:func:`fastdp.accounting.get_noise_multiplier`) runs the plan without knowing which accountant made it.

:func:`search_sigma` keeps a bracket ``lo < hi`` with ``f(lo) > target >= f(hi)`` and returns ``hi`` once
``hi / lo - 1 <= rtol``: the answer is **conservative** (``f(hi) <= target`` was evaluated) and **tight** (within
``rtol`` of the smallest admissible sigma on the stage's function).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["SIGMA_MAX", "SIGMA_MIN", "CalibrationPlan", "SearchStage", "run_plan", "search_sigma"]

logger = logging.getLogger(__name__)

SIGMA_MIN = 1e-2
SIGMA_MAX = 1e5


@dataclass(frozen=True)
class SearchStage:
    """One search of a calibration plan.

    Attributes:
        epsilon: ``sigma -> epsilon``, decreasing in sigma; quiet (no warnings) since it is probed many times.
        rtol: stop when the bracket satisfies ``hi / lo - 1 <= rtol``.
        start: the first probe is ``start x`` the previous stage's answer (the plan's ``seed`` for the first stage).
        measure_slope: after this stage, measure the local log-log slope of ``epsilon`` at its answer and use it as
            the first secant slope of the following stages.
        time_budget_s: past this many seconds since the calibration started, return the current (conservative)
            upper end as soon as another evaluation would overrun.
    """

    epsilon: Callable[[float], float]
    rtol: float
    start: float = 1.0
    measure_slope: bool = False
    time_budget_s: float | None = None


@dataclass(frozen=True)
class CalibrationPlan:
    """How an accountant finds sigma for a target epsilon (see the module docstring).

    Attributes:
        stages: the searches, in order; the last one's ``epsilon`` must be the accountant's own epsilon, so the
            result is conservative for it.
        seed: the first stage's reference point (its first probe is ``stages[0].start * seed``).
        slope0: log-log slope of epsilon in sigma assumed for the first secant step.
        closed_form: the answer, when the accountant has a closed form (``stages`` are then not run).
        finish: called with the answer (e.g. to warn that the accountant fell back to a looser bound there).
    """

    stages: tuple[SearchStage, ...] = ()
    seed: float = 1.0
    slope0: float = -1.0
    closed_form: float | None = None
    finish: Callable[[float], None] | None = None


def _log_interp(x1: float, e1: float, x2: float, e2: float, target: float) -> float | None:
    """Root of the line through (log x, log e) points at log(target); None if undefined."""
    if min(e1, e2) <= 0 or not (math.isfinite(e1) and math.isfinite(e2)) or x1 == x2 or e1 == e2:
        return None
    l1, l2 = math.log(x1), math.log(x2)
    g1, g2 = math.log(e1), math.log(e2)
    slope = (g2 - g1) / (l2 - l1)
    if slope >= 0:
        return None
    return math.exp(l1 + (math.log(target) - g1) / slope)


def search_sigma(
    f: Callable[[float], float],
    target: float,
    sigma0: float,
    rtol: float,
    sigma_min: float = SIGMA_MIN,
    sigma_max: float = SIGMA_MAX,
    slope0: float = -1.0,
    max_evals: int = 60,
    deadline: float | None = None,
) -> tuple[float, float]:
    """Near-smallest sigma with ``f(sigma) <= target`` for decreasing ``f``; returns ``(hi, f(hi))``.

    Keeps a bracket ``lo < hi`` with ``f(lo) > target >= f(hi)``, proposing log-log secant points padded by
    ``rtol/3`` towards the side that has not moved last (so a good secant step closes the bracket in one pair of
    evaluations), with geometric bisection as the safeguard. Past ``deadline`` (``time.monotonic()``) the
    current upper end is returned as soon as one exists and another evaluation (estimated to cost as much
    as the last one) would overrun it: still conservative, possibly less tight.

    Raises:
        ValueError: even ``sigma_max`` gives an epsilon above ``target``.
        RuntimeError: no convergence in ``max_evals`` evaluations.
    """
    lo: float | None = None
    hi: float | None = None
    e_lo = e_hi = math.nan
    last: tuple[float, float] | None = None
    moved_hi_last = False
    x = min(max(sigma0, sigma_min), sigma_max)
    for it in range(max_evals):
        t_eval = time.monotonic()
        e = f(x)
        eval_cost = time.monotonic() - t_eval
        logger.debug("calibration probe %d: sigma=%.6g epsilon=%.6g", it, x, e)
        if e <= target:
            if hi is None or x < hi:
                hi, e_hi = x, e
            moved_hi_last = True
        else:
            if lo is None or x > lo:
                lo, e_lo = x, e
            moved_hi_last = False
        if hi is not None and lo is not None and hi / lo - 1.0 <= rtol:
            return hi, e_hi
        if deadline is not None and hi is not None and time.monotonic() + eval_cost > deadline:
            logger.info(
                "calibration time budget spent; returning sigma=%.6g (bracket [%s, %.6g])", hi, lo, hi
            )
            return hi, e_hi
        prev = last
        last = (x, e)
        if hi is None:  # need larger sigma
            if x >= sigma_max:
                raise ValueError(
                    f"target_epsilon={target!r} cannot be reached: even noise_multiplier={sigma_max:g} gives "
                    f"epsilon={e:.6g}; increase target_epsilon or target_delta, or reduce steps or "
                    f"sample_rate"
                )
            guess = None
            if prev is not None:
                guess = _log_interp(prev[0], prev[1], x, e, target)
            elif e > 0 and math.isfinite(e):
                guess = math.exp(math.log(x) + (math.log(target) - math.log(e)) / slope0)
            nxt = 2.0 * x if guess is None else min(max(guess * (1 + rtol / 3), x * (1 + rtol / 3)), 8.0 * x)
            x = min(nxt, sigma_max)
            continue
        if lo is None:  # need smaller sigma
            if x <= sigma_min:
                logger.info(
                    "every noise_multiplier >= %g meets target_epsilon=%g; returning it", sigma_min, target
                )
                return hi, e_hi
            guess = None
            if prev is not None:
                guess = _log_interp(prev[0], prev[1], x, e, target)
            elif e > 0 and math.isfinite(e):
                guess = math.exp(math.log(x) + (math.log(target) - math.log(e)) / slope0)
            nxt = 0.5 * x if guess is None else max(min(guess * (1 - rtol / 3), x / (1 + rtol / 3)), x / 8.0)
            x = max(nxt, sigma_min)
            continue
        guess = _log_interp(lo, e_lo, hi, e_hi, target)
        pad = rtol / 3.0
        if guess is not None:
            guess = guess * (1 - pad) if moved_hi_last else guess * (1 + pad)
        mid = math.sqrt(lo * hi)
        if guess is None or not (lo * (1 + rtol / 10) < guess < hi / (1 + rtol / 10)):
            guess = mid
        # safeguard: if the bracket is still wide after a secant step, alternate with bisection
        if it % 3 == 2 and hi / lo > 1 + 4 * rtol:
            guess = mid
        x = guess
    raise RuntimeError(f"noise calibration did not converge in {max_evals} evaluations (bracket {lo}, {hi})")


def _local_slope(f: Callable[[float], float], sigma: float, default: float) -> float:
    """Log-log slope of ``f`` between ``0.9 sigma`` and ``sigma`` (at most -0.05), or ``default``."""
    e1, e2 = f(sigma), f(0.9 * sigma)
    if min(e1, e2) > 0 and math.isfinite(e2):
        return min((math.log(e1) - math.log(e2)) / math.log(1 / 0.9), -0.05)
    return default


def run_plan(plan: CalibrationPlan, target: float, started: float | None = None) -> float:
    """Run a :class:`CalibrationPlan` for ``target`` epsilon; ``started`` (``time.monotonic()``) anchors the
    stages' time budgets (default: now). Returns the last stage's conservative sigma (or the closed form)."""
    started = time.monotonic() if started is None else started
    if plan.closed_form is not None:
        sigma = plan.closed_form
    else:
        if not plan.stages:
            raise ValueError("a calibration plan needs a closed form or at least one search stage")
        sigma, slope = plan.seed, plan.slope0
        for k, stage in enumerate(plan.stages):
            deadline = None if stage.time_budget_s is None else started + stage.time_budget_s
            sigma, _ = search_sigma(stage.epsilon, target, stage.start * sigma, stage.rtol, slope0=slope,
                                    deadline=deadline)
            if stage.measure_slope and k < len(plan.stages) - 1:
                slope = _local_slope(stage.epsilon, sigma, slope)
    if plan.finish is not None:
        plan.finish(sigma)
    return sigma
