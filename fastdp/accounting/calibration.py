"""One-call epsilon computation and noise calibration, over any accountant factory.

* :func:`get_epsilon` -- epsilon of ``steps`` homogeneous DP-SGD steps under one accountant.
* :func:`get_noise_multiplier` -- the (nearly) smallest noise multiplier whose epsilon does not exceed a
  target.

``accountant`` is a registry name (``"prv"``, ``"rdp"``, ``"gdp"``) or a *factory*: any callable returning a fresh
:class:`~fastdp.accounting.base.Accountant` (a class, a ``functools.partial`` with settings, ...). Calibration asks
the accountant for its :class:`~fastdp.accounting.search.CalibrationPlan` and runs it; it never looks at names.

Calibration guarantees (for the built-in plans):

* **conservative**: the returned sigma has ``epsilon(sigma) <= target_epsilon`` under the *same* accountant
  (it is the upper end of a bracket whose every end point was evaluated);
* **tight**: the bracket is shrunk until ``hi / lo - 1 <= rtol`` (2e-4 for RDP, 4e-3 for PRV) where
  ``epsilon(lo) > target``, so the result is within 1 % of the smallest admissible sigma;
* **fast**: RDP is searched from the GDP closed form, PRV from the RDP answer (PRV sigma is typically 0.8-1.0x
  the RDP sigma, so PRV is never probed at tiny sigma), with log-log secant steps that usually bracket the
  root in 3-5 evaluations. GDP has a closed-form inverse.

Step convention: ``epochs`` means ``steps = ceil(epochs / sample_rate)`` (values within 1e-9 of an integer are
rounded, so ``epochs=3, sample_rate=0.01`` gives 300 steps, not 301).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from fastdp.accounting.base import Accountant
from fastdp.accounting.checks import (
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_sample_rate,
    check_steps,
)
from fastdp.accounting.registry import resolve_factory
from fastdp.accounting.search import SIGMA_MAX, SIGMA_MIN, run_plan

__all__ = ["SIGMA_MAX", "SIGMA_MIN", "get_epsilon", "get_noise_multiplier", "steps_from_epochs"]

logger = logging.getLogger(__name__)

AccountantSpec = str | Callable[[], Accountant]


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
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: AccountantSpec = "prv"
) -> float:
    """Epsilon of ``steps`` DP-SGD steps with noise multiplier ``noise_multiplier`` and sampling rate
    ``sample_rate`` at the given ``delta``.

    Args:
        noise_multiplier: sigma > 0.
        sample_rate: Poisson sampling probability q in (0, 1].
        steps: number of steps, an integer >= 1.
        delta: target delta in (0, 1).
        accountant: ``"prv"`` (default; tight upper bound), ``"rdp"`` (looser upper bound) or ``"gdp"``
            (CLT approximation that can underestimate; warns once), or a factory returning a fresh accountant.

    Raises:
        ValueError: for invalid input; the message names the value and the valid range.
    """
    factory = resolve_factory(accountant)
    sigma = check_noise_multiplier(noise_multiplier)
    q = check_sample_rate(sample_rate)
    n = check_steps(steps)
    delta = check_delta(delta)
    acc = factory()
    acc.step(sigma, q, n)
    return acc.get_epsilon(delta)


def get_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int | None = None,
    epochs: float | None = None,
    accountant: AccountantSpec = "prv",
) -> float:
    """Smallest noise multiplier (within 1 %) such that training is (target_epsilon, target_delta)-DP.

    Exactly one of ``steps`` and ``epochs`` must be given; ``epochs`` means ``steps = ceil(epochs /
    sample_rate)``. The returned sigma satisfies ``epsilon(sigma) <= target_epsilon`` under the chosen
    accountant (for ``"gdp"`` that epsilon is itself only an approximation). ``accountant`` is a registry name or
    a factory; the search is the accountant's :meth:`~fastdp.accounting.base.Accountant.calibration_plan`.

    Raises:
        ValueError: for invalid input, or if the target cannot be reached even with a huge noise multiplier.
    """
    start = time.monotonic()
    factory = resolve_factory(accountant)
    target = check_epsilon(target_epsilon)
    delta = check_delta(target_delta, name="target_delta")
    q = check_sample_rate(sample_rate)
    n = _resolve_steps(q, steps, epochs)
    plan = factory().calibration_plan(target, delta, q, n)
    return run_plan(plan, target, started=start)
