"""Name -> accountant class registry, :func:`make_accountant`, and :func:`resolve_factory` (a name or a factory).

An accountant *factory* is any callable returning a fresh :class:`~fastdp.accounting.base.Accountant`; the
registered classes are factories. Calibration and the engine's look-ahead work from factories or instances, never
from names.
"""

from __future__ import annotations

from collections.abc import Callable

from fastdp.accounting.base import Accountant
from fastdp.accounting.gdp import GDPAccountant
from fastdp.accounting.prv import PRVAccountant
from fastdp.accounting.rdp import RDPAccountant

__all__ = ["ACCOUNTANTS", "make_accountant", "resolve_factory", "resolve_name"]

#: Accountant classes by name. ``"prv"`` is the default everywhere.
ACCOUNTANTS: dict[str, type[Accountant]] = {
    "rdp": RDPAccountant,
    "prv": PRVAccountant,
    "gdp": GDPAccountant,
}


def resolve_name(name: object) -> str:
    """Normalise an accountant name (case-insensitive, surrounding blanks ignored) or raise ``ValueError``."""
    if isinstance(name, str) and name.strip().lower() in ACCOUNTANTS:
        return name.strip().lower()
    choices = ", ".join(repr(k) for k in ACCOUNTANTS)
    raise ValueError(f"unknown accountant {name!r}; valid choices are {choices}")


def make_accountant(name: str) -> Accountant:
    """Return a fresh accountant: ``"rdp"``, ``"prv"`` or ``"gdp"`` (case-insensitive).

    Raises:
        ValueError: for any other name; the message lists the valid choices.
    """
    return ACCOUNTANTS[resolve_name(name)]()


def resolve_factory(accountant: str | Callable[[], Accountant]) -> Callable[[], Accountant]:
    """A factory for ``accountant``: the registered class for a name, or the callable itself.

    Raises:
        ValueError: an unknown name, or a callable whose result is not a fresh :class:`Accountant` (it is called
            once to check).
    """
    if isinstance(accountant, str):
        return ACCOUNTANTS[resolve_name(accountant)]
    if isinstance(accountant, Accountant):
        raise ValueError(f"accountant={accountant!r} is an accountant instance; pass its name or a factory "
                         f"(e.g. {type(accountant).__name__}) so that calibration starts from an empty ledger")
    if callable(accountant):
        probe = accountant()
        if not isinstance(probe, Accountant):
            raise ValueError(f"the accountant factory {accountant!r} returned {probe!r}, not an Accountant")
        if probe.ledger.entries:
            raise ValueError(f"the accountant factory {accountant!r} returned an accountant that already records "
                             f"{probe.ledger!r}; a factory must return a fresh one (epsilon and calibration would "
                             "otherwise include those releases)")
        return accountant
    choices = ", ".join(repr(k) for k in ACCOUNTANTS)
    raise ValueError(f"unknown accountant {accountant!r}; give one of {choices} or a factory (a callable returning "
                     "a fresh Accountant)")
