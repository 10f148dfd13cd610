"""Name -> accountant class registry and :func:`make_accountant`."""

from __future__ import annotations

from fastdp.accounting.base import Accountant
from fastdp.accounting.gdp import GDPAccountant
from fastdp.accounting.prv import PRVAccountant
from fastdp.accounting.rdp import RDPAccountant

__all__ = ["ACCOUNTANTS", "make_accountant", "resolve_name"]

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
