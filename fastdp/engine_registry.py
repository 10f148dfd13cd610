"""One PrivacyEngine per model: an engine-owned registry of the engines that are attached.

Two engines hooked on the same parameters release every batch twice (each with its own noise) while each reports
the epsilon of one release, so the true epsilon is far above the reported one. The registry is a module-level
``WeakSet`` of the attached engines (never attributes on ``nn.Parameter`` or modules); an engine leaves it at
``detach()`` or when it is garbage collected. :func:`conflicts` finds an attached engine whose trainable
parameters overlap a given set (by identity: the engine holds its parameters, so their ids are stable while it is
registered).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from fastdp.engine import PrivacyEngine

__all__ = ["conflicts", "engines_on", "register", "unregister"]

_ATTACHED_ENGINES: weakref.WeakSet[PrivacyEngine] = weakref.WeakSet()


def register(engine: PrivacyEngine) -> None:
    """Record ``engine`` as attached."""
    _ATTACHED_ENGINES.add(engine)


def unregister(engine: PrivacyEngine) -> None:
    """Forget ``engine`` (at ``detach()``)."""
    _ATTACHED_ENGINES.discard(engine)


def conflicts(params: Iterable[nn.Parameter], exclude: PrivacyEngine | None = None) -> list[PrivacyEngine]:
    """The attached engines (other than ``exclude``) training any of ``params``."""
    ids = {id(p) for p in params}
    return [e for e in list(_ATTACHED_ENGINES)
            if e is not exclude and any(id(p) in ids for p in e._trainable.values())]


def engines_on(module: nn.Module) -> list[PrivacyEngine]:
    """The attached engines training any parameter of ``module`` (e.g. to detach one whose reference was lost
    when a notebook cell ran twice: ``for e in fastdp.engines_on(model): e.detach()``)."""
    return conflicts(module.parameters())


def conflict_message(params: Iterable[nn.Parameter], names: dict[int, str], others: list[PrivacyEngine]) -> str:
    """Error text for a second engine on parameters that ``others`` already train."""
    ids = {id(p) for p in params}
    shared = sorted({names.get(id(p), "?") for e in others for p in e._trainable.values() if id(p) in ids})
    return (
        f"another PrivacyEngine ({others[0]!r}) is attached to this model's trainable parameters "
        f"{shared[:5]}{'...' if len(shared) > 5 else ''}: with two engines every batch would be released twice "
        "while each engine reports the epsilon of one release. Detach the old engine first: old_engine.detach() "
        "(if its reference is lost, e.g. a notebook cell ran twice: "
        "`for e in fastdp.engines_on(model): e.detach()`), then build and attach the new one. Its accountant "
        "starts from zero: the steps taken by the old engine are not included in the new epsilon.")
