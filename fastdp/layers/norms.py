"""Normalisation layers with an elementwise affine: LayerNorm, RMSNorm, GroupNorm, InstanceNorm1d/2d/3d, and
BatchNorm1d/2d/3d in eval mode (frozen running statistics).

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
import torch.nn.functional as F
from torch import nn

from fastdp.layers import register
from fastdp.layers.base import LayerKind, to_accumulation


class _AffineNormKind(LayerKind):
    """Shared math; subclasses define :meth:`normalize` and :meth:`param_dims`."""

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


class _TrailingNormKind(_AffineNormKind):
    def reduce_dims(self, module: nn.Module, G: torch.Tensor) -> tuple[int, ...]:
        k = len(module.normalized_shape)
        return tuple(range(1, G.dim() - k))


@register
class LayerNormKind(_TrailingNormKind):
    module_types = (nn.LayerNorm,)
    # timm's LayerNorm overrides forward only to call F.layer_norm (or its fused equivalent): the same function
    module_type_names = ("timm.layers.norm.LayerNorm",)

    def normalize(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)


@register
class RMSNormKind(_TrailingNormKind):
    module_types = (nn.RMSNorm,)

    def normalize(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, module.normalized_shape, None, module.eps)


class _ChannelNormKind(_AffineNormKind):
    def reduce_dims(self, module: nn.Module, G: torch.Tensor) -> tuple[int, ...]:
        return tuple(range(2, G.dim()))


@register
class GroupNormKind(_ChannelNormKind):
    module_types = (nn.GroupNorm,)

    def normalize(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"GroupNorm needs a batched input (B, C, ...), got shape {tuple(x.shape)}")
        return F.group_norm(x, module.num_groups, None, None, module.eps)


@register
class InstanceNormKind(_ChannelNormKind):
    module_types = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)

    def unsupported_reason(self, module: nn.Module) -> str | None:
        if module.track_running_stats and module.training:
            return ("track_running_stats=True in train mode updates running statistics from private data, "
                    "which are released with the model; use track_running_stats=False")
        return None

    def normalize(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        expected = {nn.InstanceNorm1d: 3, nn.InstanceNorm2d: 4, nn.InstanceNorm3d: 5}
        want = next(v for k, v in expected.items() if isinstance(module, k))
        if x.dim() != want:
            raise ValueError(f"{type(module).__name__} needs a batched input of {want} dimensions, "
                             f"got shape {tuple(x.shape)}")
        use_input_stats = module.training or not module.track_running_stats
        if use_input_stats:
            return F.instance_norm(x, None, None, None, None, True, 0.0, module.eps)
        return F.instance_norm(x, module.running_mean, module.running_var, None, None, False, 0.0, module.eps)


@register
class BatchNormEvalKind(_ChannelNormKind):
    """BatchNorm in eval mode: it normalises with its frozen running statistics, a per-sample operation, so its
    affine parameters train like GroupNorm's (e.g. DP-BiTFiT of a pretrained CNN). Train mode is refused."""

    module_types = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)

    def unsupported_reason(self, module: nn.Module) -> str | None:
        if module.training:
            return "train mode normalises with the batch's statistics, which mixes samples; call .eval() on it"
        if not module.track_running_stats or module.running_mean is None:
            return ("track_running_stats=False normalises with the batch's statistics even in eval mode, which "
                    "mixes samples; replace it with GroupNorm (fastdp.validate.fix)")
        return None

    def normalize(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, module.running_mean, module.running_var, None, None, False, 0.0, module.eps)
