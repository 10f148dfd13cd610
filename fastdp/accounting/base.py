"""Common accountant interface: an :class:`Accountant` reads a :class:`~fastdp.accounting.ledger.Ledger` of events.

Every accountant in :mod:`fastdp.accounting` bounds the same thing: the composition of the events in its ledger,
which for DP-SGD are Poisson-subsampled Gaussian steps with noise multiplier ``sigma`` (noise std divided by the
clipping norm) and sampling rate ``q`` (probability that a given example is in the batch), under add/remove-one
adjacency. Other releases (a DP evaluation, :class:`~fastdp.accounting.events.NonPrivate`) join the same ledger.

A subclass implements one method, :meth:`Accountant._epsilon`, which receives the ledger reduced to a merged,
non-empty history ``[(sigma > 0, q, count), ...]`` (see :class:`~fastdp.accounting.events.Parts`); the base class
answers 0 for an empty ledger and ``inf`` for one with a release that has no guarantee (``sigma = 0``, NonPrivate).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

from fastdp.accounting.checks import (
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_sample_rate,
    check_steps,
)
from fastdp.accounting.events import DpEvent, Parts, PoissonSampledGaussian, SelfComposed, decompose
from fastdp.accounting.ledger import Ledger
from fastdp.accounting.search import CalibrationPlan, SearchStage

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

#: accountant state format: 2 stores the ledger as "history" (sigma = 0 steps and other releases included);
#: 1 stored the noised steps only, as [sigma > 0, q, count] triples (still loaded)
STATE_DICT_VERSION = 2


class Accountant(ABC):
    """Abstract privacy accountant over a :class:`~fastdp.accounting.ledger.Ledger` of events.

    Recording: :meth:`step` (noised DP-SGD steps, ``sigma > 0``: the original API), :meth:`record_step` (any
    training step, ``sigma = 0`` included), :meth:`record` (another release, e.g. a DP evaluation).
    Reading: :meth:`get_epsilon` (the ledger), :meth:`epsilon_after` (the ledger plus one more event, without
    recording it), :meth:`epsilon_of` (any event or ledger under this accountant's settings).

    ``history`` is the run-length-compressed ``(sigma, q, count)`` of the noised training steps:
    ``step(1.0, 0.01, 10)`` then ``step(1.0, 0.01, 5)`` is the single entry ``(1.0, 0.01, 15)``. Changing ``sigma``
    or ``q`` starts a new entry, and every accountant composes the entries heterogeneously.
    """

    #: short identifier, also stored in :meth:`state_dict`
    name: str = ""

    def __init__(self) -> None:
        self._ledger = Ledger()

    # ------------------------------------------------------------------ recording
    def step(self, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Record ``num_steps`` steps of the Poisson-subsampled Gaussian mechanism.

        Args:
            noise_multiplier: sigma, the noise std divided by the clipping norm (> 0, finite; record a step
                without noise with :meth:`record_step`).
            sample_rate: q, the Poisson sampling probability, in (0, 1].
            num_steps: number of identical steps to record (integer >= 1).
        """
        sigma = check_noise_multiplier(noise_multiplier)
        q = check_sample_rate(sample_rate)
        n = check_steps(num_steps, name="num_steps")
        self._ledger.record_step(sigma, q, n)

    def record_step(self, noise_multiplier: float, sample_rate: float, count: int = 1) -> None:
        """Record ``count`` training steps; ``noise_multiplier = 0`` (no noise) is recorded too, and makes epsilon
        inf from then on. This is the one call a training loop (the engine) makes per step."""
        self._ledger.record_step(noise_multiplier, sample_rate, count)

    def record(self, event: DpEvent, count: int = 1, label: str = "release") -> None:
        """Record ``count`` repetitions of a release other than a training step (e.g. ``Gaussian(sigma)`` for a
        noisy evaluation metric), so it joins the same budget. See :meth:`Ledger.record`."""
        self._ledger.record(event, count, label)

    @property
    def ledger(self) -> Ledger:
        """The ledger this accountant reads (live: recording in it records in the accountant)."""
        return self._ledger

    @property
    def history(self) -> list[HistoryEntry]:
        """Run-length-compressed list of ``(noise_multiplier, sample_rate, count)`` of the noised training steps
        (a copy; ``sigma = 0`` steps and other releases are in :attr:`ledger`)."""
        return self._ledger.step_history()

    @property
    def steps(self) -> int:
        """Number of noised training steps (``sigma > 0``); ``ledger.steps`` counts ``sigma = 0`` steps too."""
        return self._ledger.steps - self._ledger.noiseless_steps

    def reset(self) -> None:
        """Forget everything recorded."""
        self._ledger = Ledger()

    def __len__(self) -> int:
        return self.steps

    def __repr__(self) -> str:
        return f"{type(self).__name__}(steps={self.steps}, history={self.history!r}, ledger={self._ledger!r})"

    # ------------------------------------------------------------------ epsilon
    def get_epsilon(self, delta: float) -> float:
        """Epsilon such that everything recorded is (epsilon, delta)-DP (0 when nothing is recorded, inf when a
        release without a guarantee is); see the subclass for the kind of bound."""
        return self._epsilon_of_parts(self._ledger.parts(), delta)

    def epsilon_after(self, event: DpEvent, delta: float, count: int = 1) -> float:
        """Epsilon if ``count`` repetitions of ``event`` were recorded now (nothing is recorded): the budget
        look-ahead. Equal to recording them in a copy of this accountant and calling :meth:`get_epsilon`."""
        parts = self._ledger.parts()
        if not isinstance(event, DpEvent):
            raise ValueError(f"event={event!r} is not a DpEvent")
        event.add_to(parts, check_steps(count, name="count"))
        return self._epsilon_of_parts(parts, delta)

    def epsilon_of(self, what: DpEvent | Ledger, delta: float) -> float:
        """Epsilon of an event or a ledger on its own, under this accountant's settings (records nothing)."""
        parts = what.parts() if isinstance(what, Ledger) else decompose(what)
        return self._epsilon_of_parts(parts, delta)

    def _epsilon_of_parts(self, parts: Parts, delta: float) -> float:
        delta = check_delta(delta)
        if parts.non_private:
            return math.inf
        if not parts.gaussians:
            return 0.0
        return float(self._epsilon(parts.history(), delta))

    @abstractmethod
    def _epsilon(self, history: list[HistoryEntry], delta: float) -> float:
        """Epsilon of a non-empty merged history ``[(sigma > 0, q, count), ...]`` at a validated ``delta``."""

    # ------------------------------------------------------------------ calibration
    def calibration_plan(self, target_epsilon: float, delta: float, sample_rate: float,
                         steps: int) -> CalibrationPlan:
        """How :func:`fastdp.accounting.get_noise_multiplier` finds sigma for this accountant: by default one
        bracket search on :meth:`epsilon_of` of ``steps`` steps (relative tolerance 1e-3). Subclasses give
        cheaper starting points or closed forms."""
        def f(sigma: float) -> float:
            return self.epsilon_of(SelfComposed(PoissonSampledGaussian(sigma, sample_rate), steps), delta)

        return CalibrationPlan(stages=(SearchStage(f, rtol=1e-3),))

    # ------------------------------------------------------------------ state
    def _config(self) -> dict[str, Any]:
        """Accountant-specific settings stored in :meth:`state_dict` (JSON-serialisable)."""
        return {}

    def _load_config(self, config: dict[str, Any]) -> None:
        """Restore settings saved by :meth:`_config` (nothing to restore by default)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Plain-python (JSON-serialisable) snapshot: ``{"accountant", "version": 2, "history": the ledger's
        entries (:meth:`Ledger.to_list`), "config"}``."""
        return {
            "accountant": self.name,
            "version": STATE_DICT_VERSION,
            "history": self._ledger.to_list(),
            "config": self._config(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a snapshot made by :meth:`state_dict` (version 2, or version 1 from before the ledger),
        validating every field; on error nothing changes.

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
        version = state_dict.get("version", 1)
        if version not in (1, STATE_DICT_VERSION):
            raise ValueError(f"unsupported state_dict version {version!r}; expected 1 or {STATE_DICT_VERSION}")
        ledger = Ledger.from_list(state_dict.get("history"), noised_steps_only=version == 1)
        config = state_dict.get("config", {})
        if not isinstance(config, dict):
            raise ValueError(f"state_dict['config'] must be a dict, got {config!r}")
        self._load_config(config)
        self._ledger = ledger
