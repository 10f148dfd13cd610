"""Clipping functions and clipping styles: everything that turns per-sample norms into per-sample factors.

Clipping functions map a per-sample norm ``n_i`` of a group with threshold ``R_k`` to a factor ``C_i``:

* ``"abadi"``: ``C_i = min(1, R_k / (n_i + 1e-6))`` (Abadi et al. 2016);
* ``"automatic"``: ``C_i = R_k / (n_i + 0.01)`` (AUTO-S, Bu et al. 2023): every sample is normalised, so
  ``||C_i g_i|| < R_k``;
* ``"global"``: ``C_i = 1`` if ``n_i <= R_k`` else ``0`` (Bu et al. 2021, without rescaling): samples whose
  gradient is larger than the threshold are dropped.

In all three ``||C_i g_i|| <= R_k``. Clipping styles split the trainable parameters into ``K`` groups, each clipped
to ``R_k = R / sqrt(K)``, so the whole per-sample gradient has norm at most ``R`` (the sensitivity the noise is
calibrated to):

* ``"all-layer"``: one group with every trainable parameter;
* ``"layer-wise"``: one group per module that owns trainable parameters (by the names in
  ``model.named_parameters()``, so a shared parameter belongs to the module that lists it first);
* ``"param-wise"``: one group per parameter;
* a list of lists of parameter names: the groups given; every trainable parameter in exactly one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

ABADI_STABILITY = 1e-6
AUTOMATIC_STABILITY = 0.01

ClipFn = Callable[[torch.Tensor, float], torch.Tensor]


def _abadi(norm: torch.Tensor, threshold: float) -> torch.Tensor:
    return (threshold / (norm + ABADI_STABILITY)).clamp(max=1.0)


def _automatic(norm: torch.Tensor, threshold: float) -> torch.Tensor:
    return threshold / (norm + AUTOMATIC_STABILITY)


def _global(norm: torch.Tensor, threshold: float) -> torch.Tensor:
    return (norm <= threshold).to(norm.dtype)


CLIPPING_FUNCTIONS: dict[str, ClipFn] = {"abadi": _abadi, "automatic": _automatic, "global": _global}
CLIPPING_STYLES = ("all-layer", "layer-wise", "param-wise")


def get_clipping_fn(name: str) -> ClipFn:
    """The clipping function called ``name`` (see the module docstring); ``"adaptive"`` clips as ``"abadi"`` at a
    threshold that moves (:mod:`fastdp.adaptive`)."""
    if name == "adaptive":
        return _abadi
    if name not in CLIPPING_FUNCTIONS:
        raise ValueError(f"clipping_fn={name!r} is not one of {sorted(CLIPPING_FUNCTIONS) + ['adaptive']}")
    return CLIPPING_FUNCTIONS[name]


def resolve_groups(style: str | Sequence[Sequence[str]], trainable: Sequence[str],
                   owner: dict[str, str]) -> list[list[str]]:
    """Split the trainable parameter names into clipping groups.

    Args:
        style: a style name from :data:`CLIPPING_STYLES` or a list of lists of parameter names.
        trainable: the trainable parameter names, in ``named_parameters()`` order.
        owner: parameter name -> name of the module that owns it (for ``"layer-wise"``).

    Returns:
        The groups, each a list of parameter names; together they partition ``trainable``.
    """
    if isinstance(style, str):
        if style == "all-layer":
            return [list(trainable)]
        if style == "param-wise":
            return [[n] for n in trainable]
        if style == "layer-wise":
            by_module: dict[str, list[str]] = {}
            for n in trainable:
                by_module.setdefault(owner[n], []).append(n)
            return list(by_module.values())
        raise ValueError(f"clipping_style={style!r} is not one of {list(CLIPPING_STYLES)} "
                         "nor a list of groups of parameter names")
    groups = [list(g) for g in style]
    if not groups or any(isinstance(g, str) or not g for g in style):
        raise ValueError("clipping_style as groups must be a non-empty list of non-empty lists of parameter "
                         f"names, got {style!r}")
    seen: dict[str, int] = {}
    known = set(trainable)
    for k, g in enumerate(groups):
        for n in g:
            if n not in known:
                raise ValueError(f"clipping_style group {k} names {n!r}, which is not a trainable parameter "
                                 f"of the model (trainable: {list(trainable)})")
            if n in seen:
                raise ValueError(f"parameter {n!r} is in clipping groups {seen[n]} and {k}; each trainable "
                                 "parameter must be in exactly one group")
            seen[n] = k
    missing = [n for n in trainable if n not in seen]
    if missing:
        raise ValueError(f"trainable parameters {missing} are in no clipping group; add them to a group "
                         "(or freeze them with requires_grad_(False) before building the engine)")
    return groups


def group_threshold(max_grad_norm: float, num_groups: int) -> float:
    """``R / sqrt(K)``: each of ``K`` groups gets this threshold, so the total sensitivity stays ``R``."""
    return max_grad_norm / math.sqrt(num_groups)
