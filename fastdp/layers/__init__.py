"""Layer kinds: the per-sample gradient math of each supported module family, and the exact generic path.

* :mod:`fastdp.layers.base`: the :class:`LayerKind` interface; :mod:`fastdp.layers.spec`: what a kind declares
  besides its math (refusal rules, docs row, oracle cases);
* :mod:`fastdp.layers.registry`: the registry (:func:`register`, :func:`kind_for`, :func:`supported_types`, and the
  rules, docs table and cases read from it);
* ``fastdp/layers/kinds/``: one file per kind; every file there is imported here, which registers its kinds;
* :mod:`fastdp.layers.generic`: parameters no kind covers (the owner's per-sample replay); the other modules are
  helpers of the engine (ownership, batch dimension, broadcast expansion, checkpointing).
"""

from __future__ import annotations

from fastdp.layers.base import LayerKind
from fastdp.layers.registry import discover, kind_for, register, supported_types

discover()

__all__ = ["LayerKind", "kind_for", "register", "supported_types"]
