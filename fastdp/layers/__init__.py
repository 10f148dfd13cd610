"""Registry of supported layer kinds: module type -> :class:`~fastdp.layers.base.LayerKind`.

A module is handled by a kind when its type is one of the kind's ``module_types`` (or is named in its
``module_type_names``, ``"package.module.Class"``, for classes of optional packages fastdp does not import), or a
subclass of one that does not override ``forward`` (so the math still describes what it computes). Modules with
trainable parameters that no kind handles go to the exact generic path (:mod:`fastdp.layers.generic`).
"""

from __future__ import annotations

from torch import nn

from fastdp.layers.base import LayerKind

_REGISTRY: list[LayerKind] = []


def register(kind_cls: type[LayerKind]) -> type[LayerKind]:
    """Class decorator: add a layer kind to the registry."""
    _REGISTRY.append(kind_cls())
    return kind_cls


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


# Importing the kind modules registers them.
from fastdp.layers import conv, embedding, hf_conv1d, linear, norms  # noqa: E402,F401

__all__ = ["LayerKind", "kind_for", "register", "supported_types"]
