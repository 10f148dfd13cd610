"""``nn.GroupNorm``: see :mod:`fastdp.layers._norm` for the math.

Where the weight trains and a sample has at least :data:`FOLDED_MIN_POSITIONS` positions, both parameters'
per-sample gradients come from one fused call of torch's group-norm backward kernel on the batch folded into the
channels (:func:`fastdp.torch_api.group_norm_affine_grads`): the input ``(B, C, *S)`` viewed as one sample of
``B C`` channels in ``B g`` groups has exactly the same groups (sample ``b``'s group ``j`` is folded group
``b g + j``: consecutive channels), so that kernel's weight and bias gradients, ``(B C,)``, are the per-sample ones
``sum_s G_b * x_hat_b`` and ``sum_s G_b``, without writing ``x_hat`` or ``G * x_hat``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.layers._norm import ChannelNormKind, randomised_affine
from fastdp.layers.base import to_accumulation
from fastdp.layers.registry import register
from fastdp.layers.spec import DocRow, OracleCase
from fastdp.torch_api import group_norm_affine_grads

#: the fused per-sample gradients (:func:`fastdp.torch_api.group_norm_affine_grads`) are used from this many positions
#: per channel (``prod(S)``) on; below, the kernel's per-channel overhead makes recomputing ``x_hat`` the faster.
#: ``0`` disables them. On a 2-core CPU the fused form took 0.72-0.98x the time on ResNet-18's feature maps of 4 x 4
#: and larger, but 1.2-2.3x on its 2 x 2 and 1 x 1 ones (``python benchmarks/levers.py --norm-ops``).
FOLDED_MIN_POSITIONS = 16


@dataclass
class FoldedGrads:
    """Per-sample gradients of both affine parameters, ``(B, C)`` each (the ``ctx`` of a folded call)."""

    weight: torch.Tensor
    bias: torch.Tensor


@register
class GroupNormKind(ChannelNormKind):
    module_types = (nn.GroupNorm,)
    doc = DocRow("`nn.GroupNorm`", "weight, bias", "instantiated (from one fused group-norm backward over the "
                 "batch folded into the channels, where a sample has 16 positions or more)",
                 "per-channel parameters, summed over spatial positions.")

    def oracle_cases(self) -> tuple[OracleCase, ...]:
        return (OracleCase("2d, C = B", lambda: randomised_affine(nn.GroupNorm(1, 3)), (3, 2, 2)),
                OracleCase("1d, 2 groups", lambda: randomised_affine(nn.GroupNorm(2, 4)), (4, 3)),
                OracleCase("(B, C) input", lambda: randomised_affine(nn.GroupNorm(2, 6)), (6,)),
                OracleCase("2d, 3 groups, 4 x 5 positions", lambda: randomised_affine(nn.GroupNorm(3, 6)),
                           (6, 4, 5)))

    def normalize(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"GroupNorm needs a batched input (B, C, ...), got shape {tuple(x.shape)}")
        return F.group_norm(x, module.num_groups, None, None, module.eps)

    def prepare(self, module: nn.Module, activation: torch.Tensor | None, grad_output: torch.Tensor) -> Any:
        if activation is not None and activation.dim() > 2 and activation.numel() > 0:
            positions = math.prod(activation.shape[2:])
            if FOLDED_MIN_POSITIONS and positions >= FOLDED_MIN_POSITIONS:
                x, G = to_accumulation(activation), to_accumulation(grad_output)
                B, C = x.shape[0], x.shape[1]
                w, b = group_norm_affine_grads(x.reshape(1, B * C, positions),
                                               G.reshape(1, B * C, positions).to(x.dtype),
                                               B * module.num_groups, module.eps)
                return FoldedGrads(w.view(B, C), b.view(B, C))
        return super().prepare(module, activation, grad_output)

    def per_sample_grad(self, module: nn.Module, ctx: Any, name: str) -> torch.Tensor:
        if isinstance(ctx, FoldedGrads):
            return ctx.bias if name == "bias" else ctx.weight
        return super().per_sample_grad(module, ctx, name)
