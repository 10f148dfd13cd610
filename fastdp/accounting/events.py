r"""Privacy events: what a release costs, described independently of how an accountant bounds it.

In the manner of Google's ``dp_accounting`` (same ideas, fastdp's own code), a release is described by an
immutable *event*, and accountants compose events:

* :class:`PoissonSampledGaussian` ``(noise_multiplier, sample_rate)`` -- each example joins the batch with
  probability ``q`` (Poisson sampling), the batch's clipped sum (sensitivity 1 after dividing by the clipping
  norm) gets Gaussian noise of standard deviation ``sigma``. ``q = 1`` is the plain Gaussian mechanism (see
  :func:`Gaussian`). ``sigma = 0`` is allowed and means *no noise*: the event has no guarantee
  (epsilon is infinite), and recording it keeps that fact in the ledger instead of leaving the step out.
* :class:`NonPrivate` -- a release with no privacy guarantee at all (epsilon infinite).
* :class:`Composed` ``([e1, e2, ...])`` -- the events one after the other (adaptive composition).
* :class:`SelfComposed` ``(event, count)`` -- ``count`` repetitions of one event.

Every event reduces to :class:`Parts`: a multiset of Gaussian pieces ``(sigma > 0, q) -> count`` plus a flag for
pieces without a guarantee. That is all the RDP, PRV and GDP accountants need, because composition commutes.

Events serialise to plain JSON-compatible dicts (:meth:`DpEvent.to_dict`, :func:`event_from_dict`), validated on
the way back in.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fastdp.accounting.checks import check_sample_rate, check_steps, is_real

__all__ = [
    "Composed",
    "DpEvent",
    "Gaussian",
    "NonPrivate",
    "Parts",
    "PoissonSampledGaussian",
    "SelfComposed",
    "decompose",
    "event_from_dict",
]

#: deepest nesting of Composed / SelfComposed accepted from a serialised event (a guard against corrupt input)
MAX_DEPTH = 64


@dataclass
class Parts:
    """An event reduced to what accountants compose.

    Attributes:
        gaussians: ``(sigma, q) -> count`` of Poisson-subsampled Gaussian pieces with ``sigma > 0``, in the order
            the pieces were first seen (composition commutes, so equal pieces anywhere are merged: exact).
        non_private: some piece has no guarantee (a :class:`NonPrivate` event or ``sigma = 0``); epsilon is inf.
    """

    gaussians: dict[tuple[float, float], int] = field(default_factory=dict)
    non_private: bool = False

    def add_gaussian(self, noise_multiplier: float, sample_rate: float, count: int) -> None:
        """Add ``count`` pieces ``(noise_multiplier, sample_rate)`` (``noise_multiplier = 0``: no guarantee)."""
        if noise_multiplier == 0.0:
            self.non_private = True
            return
        key = (float(noise_multiplier), float(sample_rate))
        self.gaussians[key] = self.gaussians.get(key, 0) + int(count)

    def history(self) -> list[tuple[float, float, int]]:
        """The Gaussian pieces as a merged history ``[(sigma, q, count), ...]`` (first-seen order)."""
        return [(s, q, n) for (s, q), n in self.gaussians.items()]

    def copy(self) -> Parts:
        """An independent copy."""
        return Parts(dict(self.gaussians), self.non_private)

    @property
    def empty(self) -> bool:
        """Nothing to compose: epsilon is 0."""
        return not self.gaussians and not self.non_private


class DpEvent(ABC):
    """Base class of privacy events (immutable, hashable, comparable, serialisable)."""

    #: the ``"type"`` field of :meth:`to_dict`
    type_name: ClassVar[str] = ""

    @abstractmethod
    def add_to(self, parts: Parts, times: int = 1) -> None:
        """Add ``times`` repetitions of this event to ``parts``."""

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-compatible description; :func:`event_from_dict` reverses it."""

    @property
    def is_private(self) -> bool:
        """Whether the event has a finite-epsilon guarantee (no :class:`NonPrivate` and no ``sigma = 0`` part)."""
        return not decompose(self).non_private


@dataclass(frozen=True)
class PoissonSampledGaussian(DpEvent):
    """One DP-SGD step: Poisson sampling at rate ``sample_rate``, then the Gaussian mechanism with noise
    multiplier ``noise_multiplier`` (noise std / sensitivity), add/remove adjacency.

    ``noise_multiplier = 0`` is accepted and means no noise: the event has no guarantee (epsilon is inf).

    Raises:
        ValueError: ``noise_multiplier`` not finite or < 0, or ``sample_rate`` not in (0, 1].
    """

    noise_multiplier: float
    sample_rate: float
    type_name: ClassVar[str] = "poisson_sampled_gaussian"

    def __post_init__(self) -> None:
        s = self.noise_multiplier
        if not is_real(s) or not math.isfinite(s) or s < 0:
            raise ValueError(f"noise_multiplier must be a finite number >= 0 (0 means no noise, epsilon = inf), "
                             f"got {s!r}")
        object.__setattr__(self, "noise_multiplier", float(s))
        object.__setattr__(self, "sample_rate", check_sample_rate(self.sample_rate))

    def add_to(self, parts: Parts, times: int = 1) -> None:
        parts.add_gaussian(self.noise_multiplier, self.sample_rate, times)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type_name, "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate}


def Gaussian(noise_multiplier: float) -> PoissonSampledGaussian:  # noqa: N802 (reads like an event class)
    """The Gaussian mechanism without sampling (``sample_rate = 1``): e.g. a noisy statistic of a whole private
    evaluation set whose sensitivity is 1 (noise std = ``noise_multiplier`` x sensitivity)."""
    return PoissonSampledGaussian(noise_multiplier, 1.0)


@dataclass(frozen=True)
class NonPrivate(DpEvent):
    """A release with no privacy guarantee: whatever it is composed with has epsilon = inf."""

    type_name: ClassVar[str] = "non_private"

    def add_to(self, parts: Parts, times: int = 1) -> None:
        parts.non_private = True

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type_name}


@dataclass(frozen=True)
class Composed(DpEvent):
    """The events one after the other (adaptive composition); ``Composed([])`` costs nothing."""

    events: tuple[DpEvent, ...]
    type_name: ClassVar[str] = "composed"

    def __init__(self, events: Iterable[DpEvent]) -> None:
        evs = tuple(events)
        for k, e in enumerate(evs):
            if not isinstance(e, DpEvent):
                raise ValueError(f"Composed(events): events[{k}]={e!r} is not a DpEvent (use PoissonSampledGaussian, "
                                 "NonPrivate, Composed or SelfComposed)")
        object.__setattr__(self, "events", evs)

    def add_to(self, parts: Parts, times: int = 1) -> None:
        for e in self.events:
            e.add_to(parts, times)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type_name, "events": [e.to_dict() for e in self.events]}


@dataclass(frozen=True)
class SelfComposed(DpEvent):
    """``count`` repetitions of ``event`` (``count`` an integer >= 1)."""

    event: DpEvent
    count: int
    type_name: ClassVar[str] = "self_composed"

    def __post_init__(self) -> None:
        if not isinstance(self.event, DpEvent):
            raise ValueError(f"SelfComposed(event, count): event={self.event!r} is not a DpEvent")
        object.__setattr__(self, "count", check_steps(self.count, name="count"))

    def add_to(self, parts: Parts, times: int = 1) -> None:
        self.event.add_to(parts, times * self.count)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type_name, "event": self.event.to_dict(), "count": self.count}


def decompose(event: DpEvent, times: int = 1) -> Parts:
    """``times`` repetitions of ``event`` reduced to :class:`Parts`."""
    if not isinstance(event, DpEvent):
        raise ValueError(f"{event!r} is not a DpEvent (use PoissonSampledGaussian, NonPrivate, Composed or "
                         "SelfComposed from fastdp.accounting)")
    parts = Parts()
    event.add_to(parts, times)
    return parts


def event_from_dict(data: Any, _depth: int = 0) -> DpEvent:
    """Rebuild an event from :meth:`DpEvent.to_dict`, validating every field.

    Raises:
        ValueError: naming the bad field, for anything :meth:`DpEvent.to_dict` cannot have produced.
    """
    if _depth > MAX_DEPTH:
        raise ValueError(f"event nested deeper than {MAX_DEPTH} levels; the serialised event is corrupt")
    if not isinstance(data, dict):
        raise ValueError(f"a serialised event must be a dict with a 'type', got {data!r}")
    kind = data.get("type")
    if kind == PoissonSampledGaussian.type_name:
        return PoissonSampledGaussian(data.get("noise_multiplier"), data.get("sample_rate"))  # type: ignore[arg-type]
    if kind == NonPrivate.type_name:
        return NonPrivate()
    if kind == Composed.type_name:
        events = data.get("events")
        if not isinstance(events, list):
            raise ValueError(f"a composed event needs a list 'events', got {events!r}")
        return Composed(event_from_dict(e, _depth + 1) for e in events)
    if kind == SelfComposed.type_name:
        return SelfComposed(event_from_dict(data.get("event"), _depth + 1), data.get("count"))  # type: ignore[arg-type]
    known = [c.type_name for c in (PoissonSampledGaussian, NonPrivate, Composed, SelfComposed)]
    raise ValueError(f"unknown event type {kind!r}; known types are {known}")
