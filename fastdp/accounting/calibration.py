"""One-call epsilon computation and noise calibration.

* :func:`get_epsilon` -- epsilon of ``steps`` homogeneous DP-SGD steps under one accountant.
* :func:`get_noise_multiplier` -- the (nearly) smallest noise multiplier whose epsilon does not exceed a
target.

Calibration guarantees:

* **conservative**: the returned sigma has ``epsilon(sigma) <= target_epsilon`` under the *same* accountant
  (it is the upper end of a bracket whose every end point was evaluated);
* **tight**: the bracket is shrunk until ``hi / lo - 1 <= rtol`` (2e-4 for RDP, 4e-3 for PRV) where
  ``epsilon(lo) > target``, so the result is within 1 % of the smallest admissible sigma;
* **fast**: RDP is searched from the GDP closed form, PRV from the RDP answer (PRV sigma is typically 0.8-1.0x
  the RDP sigma, so PRV is never probed at tiny sigma), with log-log secant steps that usually bracket the
  root
  in 3-5 evaluations. GDP has a closed-form inverse.

Step convention: ``epochs`` means ``steps = ceil(epochs / sample_rate)`` (values within 1e-9 of an integer are
rounded, so ``epochs=3, sample_rate=0.01`` gives 300 steps, not 301).
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable

from fastdp.accounting import gdp as _gdp
from fastdp.accounting.base import (
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_sample_rate,
    check_steps,
)
from fastdp.accounting.prv import DEFAULT_EPS_ERROR, PRVFallbackWarning, _prv_cached
from fastdp.accounting.rdp import DEFAULT_ORDERS, rdp_epsilon_for_history
from fastdp.accounting.registry import make_accountant, resolve_name

__all__ = ["get_epsilon", "get_noise_multiplier", "steps_from_epochs"]

logger = logging.getLogger(__name__)

SIGMA_MIN = 1e-2
SIGMA_MAX = 1e5
_RTOL = {"rdp": 2e-4, "prv": 4e-3, "gdp": 1e-6}
_COARSE_EPS_ERROR = 0.1
_PRV_TIME_BUDGET_S = 27.0  # stop refining when another evaluation would overrun this


def steps_from_epochs(epochs: float, sample_rate: float) -> int:
    """``ceil(epochs / sample_rate)``; values within 1e-9 (relative) of an integer count as that integer."""
    if (
        isinstance(epochs, bool)
        or not isinstance(epochs, (int, float))
        or not math.isfinite(epochs)
        or epochs <= 0
    ):
        raise ValueError(f"epochs must be a finite number > 0, got {epochs!r}")
    q = check_sample_rate(sample_rate)
    x = float(epochs) / q
    r = round(x)
    if abs(x - r) <= 1e-9 * max(1.0, x):
        return max(int(r), 1)
    return max(int(math.ceil(x)), 1)


def _resolve_steps(sample_rate: float, steps: int | None, epochs: float | None) -> int:
    if (steps is None) == (epochs is None):
        raise ValueError(f"pass exactly one of steps or epochs (got steps={steps!r}, epochs={epochs!r})")
    if steps is not None:
        return check_steps(steps)
    return steps_from_epochs(epochs, sample_rate)  # type: ignore[arg-type]


def get_epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "prv"
) -> float:
    """Epsilon of ``steps`` DP-SGD steps with noise multiplier ``noise_multiplier`` and sampling rate
    ``sample_rate`` at the given ``delta``.

    Args:
        noise_multiplier: sigma > 0.
        sample_rate: Poisson sampling probability q in (0, 1].
        steps: number of steps, an integer >= 1.
        delta: target delta in (0, 1).
        accountant: ``"prv"`` (default; tight upper bound), ``"rdp"`` (looser upper bound) or ``"gdp"``
            (CLT approximation that can underestimate; warns once).

    Raises:
        ValueError: for invalid input; the message names the value and the valid range.
    """
    name = resolve_name(accountant)
    sigma = check_noise_multiplier(noise_multiplier)
    q = check_sample_rate(sample_rate)
    n = check_steps(steps)
    delta = check_delta(delta)
    acc = make_accountant(name)
    acc.step(sigma, q, n)
    return acc.get_epsilon(delta)


def _epsilon_fn(name: str, q: float, steps: int, delta: float) -> Callable[[float], float]:
    """sigma -> epsilon for homogeneous steps, without warnings (probing helper)."""
    if name == "rdp":
        return lambda s: rdp_epsilon_for_history(
            [(s, q, steps)], delta, DEFAULT_ORDERS, warn_at_boundary=False
        )[0]
    if name == "prv":
        delta_error = delta / 1000.0
        return lambda s: _prv_cached(((s, q, steps),), delta, DEFAULT_EPS_ERROR, delta_error).upper
    return lambda s: _gdp.epsilon_from_mu(_gdp.gdp_mu([(s, q, steps)]), delta)


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


def _search(
    f: Callable[[float], float],
    target: float,
    sigma0: float,
    rtol: float,
    sigma_min: float,
    sigma_max: float,
    slope0: float = -1.0,
    max_evals: int = 60,
    deadline: float | None = None,
) -> tuple[float, float]:
    """Near-smallest sigma with ``f(sigma) <= target`` for decreasing ``f``; returns ``(hi, f(hi))``.

    Keeps a bracket ``lo < hi`` with ``f(lo) > target >= f(hi)``, proposing log-log secant points padded by
    ``rtol/3`` towards the side that has not moved last (so a good secant step closes the bracket in one
    pair of
    evaluations), with geometric bisection as the safeguard. Past ``deadline`` (``time.monotonic()``) the
    current upper end is returned as soon as one exists and another evaluation (estimated to cost as much
    as the last one) would overrun it: still conservative, possibly less tight.
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


def get_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int | None = None,
    epochs: float | None = None,
    accountant: str = "prv",
) -> float:
    """Smallest noise multiplier (within 1 %) such that training is (target_epsilon, target_delta)-DP.

    Exactly one of ``steps`` and ``epochs`` must be given; ``epochs`` means ``steps = ceil(epochs /
    sample_rate)``. The returned sigma satisfies ``epsilon(sigma) <= target_epsilon`` under the chosen
    accountant (for ``"gdp"`` that epsilon is itself only an approximation).

    Raises:
        ValueError: for invalid input, or if the target cannot be reached even with a huge noise multiplier.
    """
    start = time.monotonic()
    name = resolve_name(accountant)
    target = check_epsilon(target_epsilon)
    delta = check_delta(target_delta, name="target_delta")
    q = check_sample_rate(sample_rate)
    n = _resolve_steps(q, steps, epochs)

    if name == "gdp":
        return _calibrate_gdp(target, delta, q, n)
    sigma_gdp = _sigma_gdp_quiet(target, delta, q, n)
    rdp_f = _epsilon_fn("rdp", q, n, delta)
    sigma_rdp, _ = _search(rdp_f, target, 1.15 * sigma_gdp, _RTOL["rdp"], SIGMA_MIN, SIGMA_MAX, slope0=-1.5)
    if name == "rdp":
        return sigma_rdp
    # PRV: start below the RDP answer with the local log-log slope of the RDP curve as the first secant slope.
    e1, e2 = rdp_f(sigma_rdp), rdp_f(0.9 * sigma_rdp)
    slope0 = -1.5
    if min(e1, e2) > 0 and math.isfinite(e2):
        slope0 = min((math.log(e1) - math.log(e2)) / math.log(1 / 0.9), -0.05)
    # Coarse pass: PRV estimate at eps_error=0.1 (10x coarser mesh, ~10x cheaper) plus the fine eps_error
    # predicts the fine upper bound to ~1e-3; then a fine pass brackets the root, usually in two evaluations.
    sigma_floor = SIGMA_MIN  # tiny sigma is safe to probe: hopeless PRV grids fall back to RDP at once
    delta_error = delta / 1000.0

    def coarse_f(s: float) -> float:
        res = _prv_cached(((s, q, n),), delta, _COARSE_EPS_ERROR, delta_error)
        if res.fallback_reason is not None:
            return res.upper
        return min(res.estimate + DEFAULT_EPS_ERROR, rdp_f(s))  # the fine result is also capped by RDP

    sigma_c, _ = _search(coarse_f, target, 0.92 * sigma_rdp, 2e-3, sigma_floor, SIGMA_MAX, slope0=slope0)
    rtol = _RTOL["prv"]
    prv_f = _epsilon_fn("prv", q, n, delta)
    sigma_prv, _ = _search(
        prv_f,
        target,
        sigma_c * (1 + rtol / 3),
        rtol,
        sigma_floor,
        SIGMA_MAX,
        slope0=slope0,
        deadline=start + _PRV_TIME_BUDGET_S,
    )
    res = _prv_cached(((sigma_prv, q, n),), delta, DEFAULT_EPS_ERROR, delta / 1000.0)
    if res.fallback_reason is not None:
        warnings.warn(
            f"PRV accountant not used at noise_multiplier={sigma_prv:.6g} ({res.fallback_reason}); the "
            "calibration used the RDP upper bound instead",
            PRVFallbackWarning,
            stacklevel=2,
        )
    return sigma_prv


def _sigma_gdp_quiet(target: float, delta: float, q: float, steps: int) -> float:
    mu = _gdp.mu_from_epsilon_delta(target, delta)
    return _gdp.sigma_from_mu(mu, q, steps)


def _calibrate_gdp(target: float, delta: float, q: float, steps: int) -> float:
    """Closed form: mu* solves delta(target; mu) = delta, then sigma from mu (nudged up to eps <= target)."""
    if q < 1.0:
        _gdp._warn_once()
    sigma = _sigma_gdp_quiet(target, delta, q, steps)
    f = _epsilon_fn("gdp", q, steps, delta)
    for _ in range(100):
        if f(sigma) <= target:
            return sigma
        sigma *= 1 + 1e-9
    raise RuntimeError("GDP calibration failed to find a conservative noise multiplier")
