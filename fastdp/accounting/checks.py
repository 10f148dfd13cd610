"""Input validation shared by the accounting modules: each check returns the value as a plain number or raises a
``ValueError`` naming the argument, the value and the valid range."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = [
    "check_delta",
    "check_epsilon",
    "check_noise_multiplier",
    "check_sample_rate",
    "check_steps",
    "is_real",
]


def is_real(x: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_noise_multiplier(noise_multiplier: Any, name: str = "noise_multiplier") -> float:
    """Return ``noise_multiplier`` as a float, or raise ``ValueError`` unless it is finite and > 0."""
    if not is_real(noise_multiplier) or not math.isfinite(noise_multiplier) or noise_multiplier <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {noise_multiplier!r}")
    return float(noise_multiplier)


def check_sample_rate(sample_rate: Any, name: str = "sample_rate") -> float:
    """Return ``sample_rate`` as a float, or raise ``ValueError`` unless it lies in (0, 1]."""
    if not is_real(sample_rate) or not (0.0 < sample_rate <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {sample_rate!r}")
    return float(sample_rate)


def check_delta(delta: Any, name: str = "delta") -> float:
    """Return ``delta`` as a float, or raise ``ValueError`` unless it lies in the open interval (0, 1)."""
    if not is_real(delta) or not (0.0 < delta < 1.0):
        raise ValueError(f"{name} must be in (0, 1), got {delta!r}")
    return float(delta)


def check_epsilon(epsilon: Any, name: str = "target_epsilon") -> float:
    """Return ``epsilon`` as a float, or raise ``ValueError`` unless it is finite and > 0."""
    if not is_real(epsilon) or not math.isfinite(epsilon) or epsilon <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {epsilon!r}")
    return float(epsilon)


def check_steps(steps: Any, name: str = "steps", minimum: int = 1) -> int:
    """Return ``steps`` as an int, or raise ``ValueError`` unless it is an integer >= ``minimum``.

    Integral floats such as ``100.0`` are accepted; ``2.5``, booleans, NaN and infinities are not.
    """
    if isinstance(steps, numbers.Integral) and not isinstance(steps, bool):
        value = int(steps)
    elif is_real(steps) and math.isfinite(steps) and float(steps).is_integer():
        value = int(steps)
    else:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {steps!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {steps!r}")
    return value
