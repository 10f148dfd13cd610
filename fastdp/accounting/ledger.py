"""The :class:`Ledger`: an ordered, serialisable record of every release that an accountant composes.

Each entry is ``(event, count, label)``: ``count`` consecutive repetitions of one :mod:`event
<fastdp.accounting.events>`, labelled ``"step"`` for a DP-SGD training step (recorded with
:meth:`Ledger.record_step`) or with any other label for another private release that joins the same budget (a DP
evaluation, a noisy statistic: :meth:`Ledger.record`). Consecutive identical entries are merged, so a ledger costs
memory proportional to the number of phases, not steps.

Nothing is left out: a step without noise (``sigma = 0``) and a :class:`~fastdp.accounting.events.NonPrivate`
release are entries like any other, and make every accountant report epsilon = inf.

Counts kept as entries are added (no pass over the ledger): :attr:`Ledger.steps` (all training steps, ``sigma = 0``
included), :attr:`Ledger.noiseless_steps`, :attr:`Ledger.releases`, and the composed :class:`Parts` that the
accountants read.

Serialised form (:meth:`Ledger.to_list`, stored as an accountant state's ``"history"``): a training step entry is
the compact triple ``[sigma, q, count]`` (the format of version-1 accountant states, where ``sigma > 0``); any other
entry is ``{"event": {...}, "count": n, "label": "..."}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastdp.accounting.checks import check_noise_multiplier, check_steps
from fastdp.accounting.events import (
    Composed,
    DpEvent,
    Parts,
    PoissonSampledGaussian,
    SelfComposed,
    event_from_dict,
)

__all__ = ["STEP", "Ledger", "LedgerEntry"]

#: label of DP-SGD training steps (reserved: other releases need another label)
STEP = "step"

#: version of :meth:`Ledger.state_dict`
LEDGER_VERSION = 1


@dataclass(frozen=True)
class LedgerEntry:
    """``count`` consecutive repetitions of ``event``; ``label == "step"`` marks DP-SGD training steps."""

    event: DpEvent
    count: int
    label: str

    @property
    def is_step(self) -> bool:
        """A DP-SGD training step (a :class:`PoissonSampledGaussian` recorded by :meth:`Ledger.record_step`)."""
        return self.label == STEP


def _check_label(label: Any) -> str:
    if not isinstance(label, str) or not label.strip() or label == STEP:
        raise ValueError(f"label={label!r}: a release needs a non-empty label other than {STEP!r} (which marks "
                         "training steps, recorded with record_step); e.g. label='eval'")
    return label


class Ledger:
    """Ordered record of privacy events (see the module docstring). Accountants read it; it computes nothing."""

    def __init__(self) -> None:
        self._entries: list[LedgerEntry] = []
        self._steps = 0
        self._noiseless = 0
        self._releases = 0
        self._parts = Parts()

    # ------------------------------------------------------------------ recording
    def record_step(self, noise_multiplier: float, sample_rate: float, count: int = 1) -> None:
        """Record ``count`` DP-SGD steps, each a ``PoissonSampledGaussian(noise_multiplier, sample_rate)``.

        ``noise_multiplier = 0`` (no noise) is recorded too: the ledger then has no guarantee (epsilon = inf).

        Raises:
            ValueError: naming the bad value (sigma < 0 or not finite, q outside (0, 1], count < 1).
        """
        self._append(PoissonSampledGaussian(noise_multiplier, sample_rate), check_steps(count, name="count"), STEP)

    def record(self, event: DpEvent, count: int = 1, label: str = "release") -> None:
        """Record ``count`` repetitions of a release other than a training step (e.g. a DP evaluation).

        Raises:
            ValueError: ``event`` is not a :class:`~fastdp.accounting.events.DpEvent`, ``count < 1``, or
                ``label`` is empty or ``"step"``.
        """
        if not isinstance(event, DpEvent):
            raise ValueError(f"event={event!r} is not a DpEvent (use PoissonSampledGaussian, Gaussian, NonPrivate, "
                             "Composed or SelfComposed from fastdp.accounting)")
        self._append(event, check_steps(count, name="count"), _check_label(label))

    def _append(self, event: DpEvent, count: int, label: str) -> None:
        last = self._entries[-1] if self._entries else None
        if last is not None and last.label == label and last.event == event:
            self._entries[-1] = LedgerEntry(event, last.count + count, label)
        else:
            self._entries.append(LedgerEntry(event, count, label))
        if label == STEP:
            self._steps += count
            if event.noise_multiplier == 0.0:  # type: ignore[attr-defined]  (steps are PoissonSampledGaussian)
                self._noiseless += count
        else:
            self._releases += count
        event.add_to(self._parts, count)

    # ------------------------------------------------------------------ reading
    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        """The entries in the order they were recorded (consecutive repeats merged)."""
        return tuple(self._entries)

    @property
    def steps(self) -> int:
        """Training steps recorded, ``sigma = 0`` steps included."""
        return self._steps

    @property
    def noiseless_steps(self) -> int:
        """Training steps recorded with ``sigma = 0`` (no noise; any one makes epsilon inf)."""
        return self._noiseless

    @property
    def releases(self) -> int:
        """Releases recorded with :meth:`record` (everything but training steps), counted with repetitions."""
        return self._releases

    @property
    def is_private(self) -> bool:
        """No entry without a guarantee (no ``sigma = 0`` step, no :class:`NonPrivate` release)."""
        return not self._parts.non_private

    def parts(self) -> Parts:
        """Everything recorded, reduced to what the accountants compose (an independent copy)."""
        return self._parts.copy()

    def step_history(self) -> list[tuple[float, float, int]]:
        """Run-length-compressed ``(sigma, q, count)`` of the *noised* training steps (``sigma > 0``), in order.

        This is the ``history`` of the accountants before the ledger: steps without noise and other releases are
        not in it (they are in :attr:`entries`).
        """
        out: list[tuple[float, float, int]] = []
        for e in self._entries:
            if not e.is_step or e.event.noise_multiplier == 0.0:  # type: ignore[attr-defined]
                continue
            s, q = e.event.noise_multiplier, e.event.sample_rate  # type: ignore[attr-defined]
            if out and out[-1][0] == s and out[-1][1] == q:
                out[-1] = (s, q, out[-1][2] + e.count)
            else:
                out.append((s, q, e.count))
        return out

    def as_event(self) -> DpEvent:
        """The whole ledger as one event (a :class:`~fastdp.accounting.events.Composed` of its entries)."""
        return Composed(e.event if e.count == 1 else SelfComposed(e.event, e.count) for e in self._entries)

    def copy(self) -> Ledger:
        """An independent copy (entries are immutable, so this is cheap)."""
        new = Ledger()
        new._entries = list(self._entries)
        new._steps, new._noiseless, new._releases = self._steps, self._noiseless, self._releases
        new._parts = self._parts.copy()
        return new

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ledger) and self._entries == other._entries

    __hash__ = None  # type: ignore[assignment]  (mutable)

    def __repr__(self) -> str:
        return (f"Ledger(steps={self._steps}, noiseless_steps={self._noiseless}, releases={self._releases}, "
                f"entries={len(self._entries)})")

    # ------------------------------------------------------------------ serialisation
    def to_list(self) -> list[Any]:
        """JSON-compatible entries: ``[sigma, q, count]`` for training steps, a dict for anything else."""
        out: list[Any] = []
        for e in self._entries:
            if e.is_step:
                ev = e.event
                out.append([ev.noise_multiplier, ev.sample_rate, e.count])  # type: ignore[attr-defined]
            else:
                out.append({"event": e.event.to_dict(), "count": e.count, "label": e.label})
        return out

    @classmethod
    def from_list(cls, raw: Any, *, noised_steps_only: bool = False, name: str = "history") -> Ledger:
        """Rebuild a ledger from :meth:`to_list`, validating every entry.

        Args:
            raw: the list.
            noised_steps_only: accept only ``[sigma > 0, q, count]`` triples (the version-1 accountant format,
                which had neither ``sigma = 0`` steps nor other releases).
            name: how to name ``raw`` in error messages.

        Raises:
            ValueError: naming the bad entry and field.
        """
        if not isinstance(raw, (list, tuple)):
            raise ValueError(f"state_dict[{name!r}] must be a list, got {raw!r}")
        ledger = cls()
        for entry in raw:
            if isinstance(entry, (list, tuple)) and len(entry) == 3:
                if noised_steps_only:
                    check_noise_multiplier(entry[0])
                ledger.record_step(entry[0], entry[1], entry[2])
            elif isinstance(entry, dict) and not noised_steps_only:
                extra = set(entry) - {"event", "count", "label"}
                if extra:
                    raise ValueError(f"{name} entry {entry!r} has unknown fields {sorted(extra)}")
                ledger.record(event_from_dict(entry.get("event")), entry.get("count"), entry.get("label"))
            else:
                also = "" if noised_steps_only else ' or {"event": {...}, "count": n, "label": "..."}'
                raise ValueError(f"{name} entries must be [noise_multiplier, sample_rate, count]{also}, got {entry!r}")
        return ledger

    def state_dict(self) -> dict[str, Any]:
        """``{"version": 1, "entries": to_list()}`` (JSON-serialisable)."""
        return {"version": LEDGER_VERSION, "entries": self.to_list()}

    @classmethod
    def from_state_dict(cls, state: Any) -> Ledger:
        """Rebuild a ledger from :meth:`state_dict` (validated; ``ValueError`` naming what is wrong)."""
        if not isinstance(state, dict) or state.get("version") != LEDGER_VERSION:
            got = state.get("version") if isinstance(state, dict) else state
            raise ValueError(f"not a fastdp Ledger state (version {got!r}, expected {LEDGER_VERSION})")
        return cls.from_list(state.get("entries"), name="entries")

