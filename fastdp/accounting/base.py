"""Common accountant interface, run-length-compressed history and input validation.

Every accountant in :mod:`fastdp.accounting` tracks the same thing: a sequence of DP-SGD steps, each one a
Poisson-subsampled Gaussian mechanism with noise multiplier ``sigma`` (noise std divided by the clipping norm)
and sampling rate ``q`` (probability that a given example is in the batch). The neighbouring relation is
add/remove-one. Consecutive steps with the same ``(sigma, q)`` are stored as a single history entry
``(sigma, q, count)``, so a history costs memory proportional to the number of *phases*, not steps.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from typing import Any

__all__ = [
    "Accountant",
    "HistoryEntry",
    "check_delta",
    "check_epsilon",
    "check_noise_multiplier",
    "check_sample_rate",
    "check_steps",
]

HistoryEntry = tuple[float, float, int]

STATE_DICT_VERSION = 1


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_noise_multiplier(noise_multiplier: Any, name: str = "noise_multiplier") -> float:
    """Return ``noise_multiplier`` as a float, or raise ``ValueError`` unless it is finite and > 0."""
    if not _is_real(noise_multiplier) or not math.isfinite(noise_multiplier) or noise_multiplier <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {noise_multiplier!r}")
    return float(noise_multiplier)


def check_sample_rate(sample_rate: Any, name: str = "sample_rate") -> float:
    """Return ``sample_rate`` as a float, or raise ``ValueError`` unless it lies in (0, 1]."""
    if not _is_real(sample_rate) or not (0.0 < sample_rate <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {sample_rate!r}")
    return float(sample_rate)


def check_delta(delta: Any, name: str = "delta") -> float:
    """Return ``delta`` as a float, or raise ``ValueError`` unless it lies in the open interval (0, 1)."""
    if not _is_real(delta) or not (0.0 < delta < 1.0):
        raise ValueError(f"{name} must be in (0, 1), got {delta!r}")
    return float(delta)


def check_epsilon(epsilon: Any, name: str = "target_epsilon") -> float:
    """Return ``epsilon`` as a float, or raise ``ValueError`` unless it is finite and > 0."""
    if not _is_real(epsilon) or not math.isfinite(epsilon) or epsilon <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {epsilon!r}")
    return float(epsilon)


def check_steps(steps: Any, name: str = "steps", minimum: int = 1) -> int:
    """Return ``steps`` as an int, or raise ``ValueError`` unless it is an integer >= ``minimum``.

    Integral floats such as ``100.0`` are accepted; ``2.5``, booleans, NaN and infinities are not.
    """
    if isinstance(steps, numbers.Integral) and not isinstance(steps, bool):
        value = int(steps)
    elif _is_real(steps) and math.isfinite(steps) and float(steps).is_integer():
        value = int(steps)
    else:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {steps!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {steps!r}")
    return value


class Accountant(ABC):
    """Abstract privacy accountant for DP-SGD with Poisson-subsampled Gaussian steps.

    Subclasses implement :meth:`_compute_epsilon`, which receives a non-empty history. The public
    :meth:`get_epsilon` validates ``delta`` and returns ``0.0`` when no step has been taken.

    The history is run-length compressed: ``step(1.0, 0.01, 10)`` followed by ``step(1.0, 0.01, 5)`` is stored
    as the single entry ``(1.0, 0.01, 15)``. Changing ``sigma`` or ``q`` starts a new entry, and every
    accountant composes the entries heterogeneously.
    """

    #: short identifier, also stored in :meth:`state_dict`
    name: str = ""

    def __init__(self) -> None:
        self._history: list[HistoryEntry] = []

    # ------------------------------------------------------------------ history
    def step(self, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Record ``num_steps`` steps of the Poisson-subsampled Gaussian mechanism.

        Args:
            noise_multiplier: sigma, the noise std divided by the clipping norm (> 0, finite).
            sample_rate: q, the Poisson sampling probability, in (0, 1].
            num_steps: number of identical steps to record (integer >= 1).
        """
        sigma = check_noise_multiplier(noise_multiplier)
        q = check_sample_rate(sample_rate)
        n = check_steps(num_steps, name="num_steps")
        if self._history and self._history[-1][0] == sigma and self._history[-1][1] == q:
            self._history[-1] = (sigma, q, self._history[-1][2] + n)
        else:
            self._history.append((sigma, q, n))

    @property
    def history(self) -> list[HistoryEntry]:
        """Run-length-compressed list of ``(noise_multiplier, sample_rate, count)`` (a copy)."""
        return list(self._history)

    @property
    def steps(self) -> int:
        """Total number of recorded steps."""
        return sum(entry[2] for entry in self._history)

    def reset(self) -> None:
        """Forget all recorded steps."""
        self._history = []

    def __len__(self) -> int:
        return self.steps

    def __repr__(self) -> str:
        return f"{type(self).__name__}(steps={self.steps}, history={self._history!r})"

    # ------------------------------------------------------------------ epsilon
    def get_epsilon(self, delta: float) -> float:
        """Return epsilon such that the recorded steps are (epsilon, delta)-DP (see the subclass)."""
        delta = check_delta(delta)
        if not self._history:
            return 0.0
        return float(self._compute_epsilon(delta))

    @abstractmethod
    def _compute_epsilon(self, delta: float) -> float:
        """Epsilon for the (non-empty) recorded history at the given (validated) ``delta``."""

    # ------------------------------------------------------------------ state
    def _config(self) -> dict[str, Any]:
        """Accountant-specific settings stored in :meth:`state_dict` (JSON-serialisable)."""
        return {}

    def _load_config(self, config: dict[str, Any]) -> None:
        """Restore settings saved by :meth:`_config` (nothing to restore by default)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Plain-python (JSON-serialisable) snapshot of the accountant."""
        return {
            "accountant": self.name,
            "version": STATE_DICT_VERSION,
            "history": [[float(s), float(q), int(n)] for s, q, n in self._history],
            "config": self._config(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a snapshot made by :meth:`state_dict`, validating every field.

        Raises:
            ValueError: if the snapshot belongs to another accountant or any entry is invalid.
        """
        if not isinstance(state_dict, dict):
            raise ValueError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        name = state_dict.get("accountant")
        if name != self.name:
            raise ValueError(
                f"state_dict is for accountant {name!r}, but this is a {self.name!r} accountant "
                f"({type(self).__name__})"
            )
        version = state_dict.get("version", STATE_DICT_VERSION)
        if version != STATE_DICT_VERSION:
            raise ValueError(f"unsupported state_dict version {version!r}; expected {STATE_DICT_VERSION}")
        raw = state_dict.get("history")
        if not isinstance(raw, (list, tuple)):
            raise ValueError(f"state_dict['history'] must be a list, got {raw!r}")
        history: list[HistoryEntry] = []
        for entry in raw:
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise ValueError(
                    f"history entries must be [noise_multiplier, sample_rate, count], got {entry!r}"
                )
            sigma = check_noise_multiplier(entry[0])
            q = check_sample_rate(entry[1])
            n = check_steps(entry[2], name="count")
            if history and history[-1][0] == sigma and history[-1][1] == q:
                history[-1] = (sigma, q, history[-1][2] + n)
            else:
                history.append((sigma, q, n))
        config = state_dict.get("config", {})
        if not isinstance(config, dict):
            raise ValueError(f"state_dict['config'] must be a dict, got {config!r}")
        self._load_config(config)
        self._history = history
