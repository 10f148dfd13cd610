"""DP-BiTFiT helpers: train only the biases (Bu et al., "Differentially private bias-term fine-tuning").

A bias's per-sample gradient is the layer's output gradient summed over positions, ``g_i = sum_t G_i[t]``, so
bias-only training needs no stored activation and no weight gradient: the engine keeps nothing from the forward
pass of a bias-only layer, and autograd computes only the gradients that flow between layers.

Typical use, before building the optimizer and the engine::

    from fastdp.bitfit import freeze_all_but_bias
    freeze_all_but_bias(model, keep=("classifier",))   # biases + a new head train; everything else frozen
    engine = PrivacyEngine(model, ...)

Models without biases (Llama-style decoders, ResNet convolutions) get zero biases first with
:func:`add_missing_biases` (DP-BiTFiT-Add); that leaves the model's outputs unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)


def is_bias(name: str) -> bool:
    """Whether a parameter name (as ``named_parameters`` spells it) is a bias: its last component contains
    ``"bias"`` (``bias``, ``in_proj_bias``, ``bias_k``...)."""
    return "bias" in name.rpartition(".")[2]


def freeze_all_but_bias(model: nn.Module, keep: Iterable[str] = ()) -> list[str]:
    """Set ``requires_grad`` so that only biases, and every parameter of the modules named in ``keep``, train.

    Args:
        model: the model (changed in place).
        keep: module names (or name prefixes, e.g. ``"classifier"``) whose parameters all stay trainable, e.g. a
            freshly initialised classification head.

    Returns:
        the names of the trainable parameters afterwards.

    Raises:
        ValueError: a ``keep`` entry matches no module, or nothing remains trainable (the model has no bias:
            use :func:`add_missing_biases` first).
    """
    keep = (keep,) if isinstance(keep, str) else tuple(keep)
    modules = [n for n, _ in model.named_modules()]
    for k in keep:
        if not any(n == k or n.startswith(k + ".") for n in modules):
            raise ValueError(f"keep entry {k!r} matches no module of the model (module names look like "
                             f"{modules[1:4]!r})")
    trainable = []
    for name, p in model.named_parameters():
        kept = any(name.startswith(k + ".") for k in keep)
        p.requires_grad_(kept or is_bias(name))
        if p.requires_grad:
            trainable.append(name)
    if not trainable:
        raise ValueError("the model has no bias to train: call fastdp.bitfit.add_missing_biases(model) first "
                         "(DP-BiTFiT-Add), or keep a head trainable")
    logger.info("DP-BiTFiT: %d trainable tensors (%d parameters)", len(trainable),
                sum(p.numel() for p in model.parameters() if p.requires_grad))
    return trainable


def add_missing_biases(model: nn.Module, types: tuple[type[nn.Module], ...] | None = None) -> list[str]:
    """DP-BiTFiT-Add: give a zero-initialised, trainable bias to every Linear/Conv layer that has none.

    The model's outputs do not change (the new biases are zero). Call it before building the optimizer and the
    engine. Layers: ``nn.Linear``, ``nn.Conv1d/2d/3d`` (and subclasses that keep their ``forward``), and modules
    whose forward already reads an optional ``self.bias`` that is ``None`` (``nn.LayerNorm(bias=False)``).

    Returns:
        the names of the modules that got a bias.
    """
    types = types or (nn.Linear, nn.modules.conv._ConvNd, nn.LayerNorm)
    added = []
    for name, module in model.named_modules():
        if not isinstance(module, types) or getattr(module, "bias", "absent") is not None:
            continue
        if isinstance(module, nn.Linear):
            shape = (module.out_features,)
        elif isinstance(module, nn.modules.conv._ConvNd):
            shape = (module.out_channels,)
        elif isinstance(module, nn.LayerNorm):
            if not module.elementwise_affine:
                continue
            shape = tuple(module.normalized_shape)
        else:  # pragma: no cover - custom types: the caller chose them
            continue
        ref = next(module.parameters())
        module.bias = nn.Parameter(torch.zeros(shape, dtype=ref.dtype, device=ref.device))
        added.append(name)
    logger.info("DP-BiTFiT-Add: zero biases added to %d modules", len(added))
    return added


__all__ = ["add_missing_biases", "freeze_all_but_bias", "is_bias"]
