"""The registry of layer kinds: module type -> :class:`~fastdp.layers.base.LayerKind`, and the rules read from it.

A module is handled by a kind when its type is one of the kind's ``module_types`` (or is named in its
``module_type_names``, ``"package.module.Class"``, for classes of optional packages fastdp does not import), or a
subclass of one that does not override ``forward`` (so the math still describes what it computes). Modules with
trainable parameters that no kind handles go to the exact generic path (:mod:`fastdp.layers.generic`).

Kinds register themselves with :func:`register` in their own file under ``fastdp/layers/kinds/``;
:func:`discover` imports every module of that folder (called once by ``fastdp.layers``). The registry is the only
list of kinds: :func:`refusals` (what :mod:`fastdp.validate` checks and the generic path refuses), :func:`docs_table`
(the supported-layer table of docs/reference/layers.md) and the oracle test of every kind read it.
"""

from __future__ import annotations

import importlib
import pkgutil

from torch import nn

from fastdp.layers.base import LayerKind
from fastdp.layers.spec import Refusal

_REGISTRY: list[LayerKind] = []


def register(kind_cls: type[LayerKind]) -> type[LayerKind]:
    """Class decorator: add a layer kind (one instance of ``kind_cls``) to the registry.

    Raises:
        ValueError: a kind of the same qualified name is already registered (a kind file imported twice under two
            names would make two kinds claim the same modules).
    """
    name = f"{kind_cls.__module__}.{kind_cls.__qualname__}"
    if any(f"{type(k).__module__}.{type(k).__qualname__}" == name for k in _REGISTRY):
        raise ValueError(f"layer kind {name} is already registered")
    _REGISTRY.append(kind_cls())
    return kind_cls


def discover() -> None:
    """Import every module of ``fastdp.layers.kinds`` (alphabetical order), which registers its kinds."""
    from fastdp.layers import kinds

    for info in pkgutil.iter_modules(kinds.__path__):
        importlib.import_module(f"{kinds.__name__}.{info.name}")


def kinds() -> tuple[LayerKind, ...]:
    """The registered kinds, in registration order (the order :func:`kind_for` tries them)."""
    return tuple(_REGISTRY)


def kind_for(module: nn.Module) -> LayerKind | None:
    """The kind that handles ``module``, or ``None`` if no supported kind does."""
    mtype = type(module)
    for kind in _REGISTRY:
        for base in kind.module_types:
            if mtype is base or (issubclass(mtype, base) and mtype.forward is base.forward):
                return kind
        if kind.module_type_names:
            for base in mtype.__mro__:
                if _qualified(base) in kind.module_type_names and mtype.forward is base.forward:
                    return kind
    return None


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def supported_types() -> list[str]:
    """Names of the supported module classes (for error messages and docs)."""
    return [t.__name__ for kind in _REGISTRY for t in kind.module_types] + [
        n.rpartition(".")[2] for kind in _REGISTRY for n in kind.module_type_names]


def refusals() -> tuple[Refusal, ...]:
    """Every refusal rule: the registered kinds', then the generic path's, in that order."""
    from fastdp.layers.generic import GENERIC

    return tuple(rule for kind in (*_REGISTRY, GENERIC) for rule in kind.refusals)


def unsupported_reason(module: nn.Module) -> str | None:
    """Why ``module`` cannot be trained privately by any path (the first rule of :func:`refusals` that applies to
    it, as ``"it <message>"``), or ``None``. Used for modules on the generic path, whose type may be one that a
    kind's rule describes without the kind handling it (``nn.EmbeddingBag`` with ``max_norm``)."""
    for rule in refusals():
        if rule.applies(module):
            return f"it {rule.message(module)}"
    return None


def frozen_reason(module: nn.Module) -> str | None:
    """Why ``module`` breaks privacy even with every parameter frozen (a rule with ``frozen_too`` and no
    ``when_trainable`` that fires: its forward rewrites its state from the private data, or mixes samples), or
    ``None``."""
    for rule in refusals():
        if rule.frozen_too and not rule.when_trainable and rule.applies(module):
            return f"it {rule.message(module)}"
    return None


def docs_table() -> str:
    """The supported-layer table of docs/reference/layers.md: header, one row per registered kind, the generic
    path's row."""
    from fastdp.layers.generic import GENERIC

    rows = ["| layer | parameters | per-sample norm | notes |", "|---|---|---|---|"]
    rows += [k.doc.markdown(k.refusals) for k in (*_REGISTRY, GENERIC) if k.doc is not None]
    return "\n".join(rows)


__all__ = ["discover", "docs_table", "frozen_reason", "kind_for", "kinds", "refusals", "register",
           "supported_types", "unsupported_reason"]
