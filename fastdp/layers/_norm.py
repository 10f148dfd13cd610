"""Shared math of the normalisation kinds with an elementwise affine (``fastdp/layers/kinds/``: LayerNorm, RMSNorm,
GroupNorm, InstanceNorm1d/2d/3d, and BatchNorm1d/2d/3d in eval mode with frozen running statistics).

Each computes ``y = x_hat * weight + bias`` where ``x_hat`` is the input normalised *per sample* (so these layers
never mix samples). With output gradient ``G_i``, the per-sample gradients are

* ``weight``: ``sum over positions of G_i * x_hat_i``,
* ``bias``: ``sum over positions of G_i``,

where the positions are every dimension except the batch and the parameter's own dimensions: the trailing
``normalized_shape`` for LayerNorm/RMSNorm, the channel dimension 1 for GroupNorm/InstanceNorm. ``x_hat`` is
recomputed from the kept input with torch's own functional (affine off), so it matches the module exactly.
These parameters are small, so they are always instantiated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fastdp.layers.base import LayerKind, to_accumulation


class AffineNormKind(LayerKind):
    """Shared math; subclasses define :meth:`normalize` and :meth:`reduce_dims`."""

    def normalize(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def reduce_dims(self, module: nn.Module, G: torch.Tensor) -> tuple[int, ...]:
        """The dimensions of ``G`` summed over (all but batch and the parameter's dimensions)."""
        raise NotImplementedError

    def needs_activation(self, module: nn.Module, trainable: frozenset[str]) -> bool:
        return "weight" in trainable

    def reduce_without_activation(self, module: nn.Module, grad_output: torch.Tensor) -> torch.Tensor:
        dims = self.reduce_dims(module, grad_output)
        return to_accumulation(grad_output).sum(dim=dims, keepdim=True) if dims else grad_output

    def prepare(self, module: nn.Module, activation: torch.Tensor | None, grad_output: torch.Tensor) -> Any:
        G = to_accumulation(grad_output)
        x_hat = None
        if activation is not None:
            x_hat = to_accumulation(self.normalize(module, to_accumulation(activation)))
        return x_hat, G

    def per_sample_grad(self, module: nn.Module, ctx: Any, name: str) -> torch.Tensor:
        x_hat, G = ctx
        src = G if name == "bias" else G * x_hat
        dims = self.reduce_dims(module, G)
        return src.sum(dim=dims) if dims else src


class TrailingNormKind(AffineNormKind):
    """Parameters over the trailing ``normalized_shape`` (LayerNorm, RMSNorm): summed over the dimensions between."""

    foldable = True

    def reduce_dims(self, module: nn.Module, G: torch.Tensor) -> tuple[int, ...]:
        k = len(module.normalized_shape)
        return tuple(range(1, G.dim() - k))


class ChannelNormKind(AffineNormKind):
    """Per-channel parameters, channel dimension 1 (GroupNorm, InstanceNorm, BatchNorm): summed over spatial dims."""

    def reduce_dims(self, module: nn.Module, G: torch.Tensor) -> tuple[int, ...]:
        return tuple(range(2, G.dim()))


def randomised_affine(module: nn.Module) -> nn.Module:
    """``module`` with its parameters drawn from a standard normal (away from the (1, 0) initialisation of an affine
    norm, so the oracle cases test them); returns it."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


def with_running_statistics(module: nn.Module) -> nn.Module:
    """``module`` (a norm with running statistics) in eval mode with random running statistics (variance in
    [0.5, 1.5]) and affine parameters; returns it."""
    randomised_affine(module)
    with torch.no_grad():
        module.running_mean.normal_()
        module.running_var.uniform_(0.5, 1.5)
    return module.eval()
