"""The engine's privacy configuration: argument checks and the noise multiplier calibrated from a target epsilon.

:func:`check` validates every argument of :class:`fastdp.PrivacyEngine` that is not the model, and returns a
:class:`Settings`; a bad value raises ValueError naming it, why it cannot be private, and the fix. Nothing here
touches the model.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastdp import accounting
from fastdp.clipping import ClipFn, get_clipping_fn
from fastdp.modes import ClippingMode, get_mode

logger = logging.getLogger(__name__)

LOSS_REDUCTIONS = ("mean", "sum")
ON_NONFINITE = ("raise", "zero")


def default_delta(sample_size: int) -> float:
    """The default target delta: ``1 / (2 * sample_size)``, below ``1 / sample_size`` as it must be."""
    return 1.0 / (2.0 * sample_size)


@dataclass(frozen=True)
class Settings:
    """The checked configuration (the engine's read-only attributes of the same names)."""

    batch_size: int
    sample_size: int
    sample_rate: float
    max_grad_norm: float
    clipping_fn: str
    clip_fn: ClipFn
    clipping_mode: str
    mode: ClippingMode
    clipping_style: str | Sequence[Sequence[str]]
    loss_reduction: str
    noise_generator: torch.Generator | None
    secure_mode: bool
    on_nonfinite: str
    enforce_budget: bool
    target_epsilon: float | None
    target_delta: float
    accountant: Any
    noise_multiplier: float
    #: steps the calibration guarantees within target_epsilon (0 without a target)
    planned_steps: int


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


def check(*, batch_size: int, sample_size: int, epochs: float | None, steps: int | None,
          noise_multiplier: float | None, target_epsilon: float | None, target_delta: float | None,
          max_grad_norm: float, clipping_fn: str, clipping_style: str | Sequence[Sequence[str]], clipping_mode: str,
          accountant: str, loss_reduction: str, noise_generator: torch.Generator | None, secure_mode: bool,
          enforce_budget: bool, on_nonfinite: str) -> Settings:
    """Check the arguments of :class:`fastdp.PrivacyEngine` (see its docstring) and calibrate sigma."""
    batch_size = _check_positive_int("batch_size", batch_size)
    sample_size = _check_positive_int("sample_size", sample_size)
    if batch_size > sample_size:
        raise ValueError(f"batch_size={batch_size} is larger than sample_size={sample_size}; the sample rate "
                         "batch_size / sample_size must be in (0, 1]")
    sample_rate = batch_size / sample_size
    if not (isinstance(max_grad_norm, (int, float)) and math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm={max_grad_norm!r} must be a finite number > 0")
    clip_fn = get_clipping_fn(clipping_fn)
    mode = get_mode(clipping_mode)
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction={loss_reduction!r} is not one of {list(LOSS_REDUCTIONS)}")
    if noise_generator is not None and not isinstance(noise_generator, torch.Generator):
        raise ValueError(f"noise_generator must be a torch.Generator, got {type(noise_generator).__name__}")
    if secure_mode and noise_generator is not None:
        raise ValueError("secure_mode=True draws noise from the OS CSPRNG; do not pass a noise_generator")
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite={on_nonfinite!r} is not one of {list(ON_NONFINITE)}")
    if enforce_budget and target_epsilon is None:
        raise ValueError("enforce_budget=True needs target_epsilon (the budget to enforce)")
    acct = accounting.make_accountant(accountant)
    delta = default_delta(sample_size) if target_delta is None else float(target_delta)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"target_delta={target_delta!r} must be in (0, 1)")
    if delta >= 1.0 / sample_size:
        warnings.warn(f"target_delta={delta:g} is not below 1/sample_size={1 / sample_size:g}; "
                      "such a delta allows releasing a whole record. Use a smaller delta.", stacklevel=3)
    sigma, planned = _resolve_sigma(noise_multiplier, target_epsilon, epochs, steps, delta, sample_rate, acct.name)
    return Settings(batch_size=batch_size, sample_size=sample_size, sample_rate=sample_rate,
                    max_grad_norm=float(max_grad_norm), clipping_fn=clipping_fn, clip_fn=clip_fn,
                    clipping_mode=clipping_mode, mode=mode, clipping_style=clipping_style,
                    loss_reduction=loss_reduction, noise_generator=noise_generator, secure_mode=bool(secure_mode),
                    on_nonfinite=on_nonfinite, enforce_budget=bool(enforce_budget),
                    target_epsilon=None if target_epsilon is None else float(target_epsilon), target_delta=delta,
                    accountant=acct, noise_multiplier=sigma, planned_steps=planned)


def _resolve_sigma(noise_multiplier: float | None, target_epsilon: float | None, epochs: float | None,
                   steps: int | None, delta: float, sample_rate: float, accountant: str) -> tuple[float, int]:
    """sigma, and the number of steps its calibration covers (0 when sigma was given)."""
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError("give exactly one of noise_multiplier and target_epsilon "
                         f"(got noise_multiplier={noise_multiplier!r}, target_epsilon={target_epsilon!r})")
    if noise_multiplier is not None:
        if not (isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier)
                and noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier={noise_multiplier!r} must be a finite number >= 0")
        if noise_multiplier == 0:
            warnings.warn("noise_multiplier=0.0: gradients are clipped but not noised, so training is NOT "
                          "differentially private (epsilon is infinite). Use this only to test clipping.",
                          stacklevel=4)
        return float(noise_multiplier), 0
    if (epochs is None) == (steps is None):
        raise ValueError("target_epsilon needs exactly one of epochs and steps to calibrate the noise "
                         f"(got epochs={epochs!r}, steps={steps!r})")
    sigma = accounting.get_noise_multiplier(target_epsilon, delta, sample_rate, steps=steps, epochs=epochs,
                                            accountant=accountant)
    planned = steps if steps is not None else accounting.steps_from_epochs(epochs, sample_rate)
    logger.info("calibrated noise_multiplier=%.4f for epsilon=%g, delta=%g, q=%g (%s)", sigma, target_epsilon,
                delta, sample_rate, accountant)
    return float(sigma), planned


__all__ = ["LOSS_REDUCTIONS", "ON_NONFINITE", "Settings", "check", "default_delta"]
