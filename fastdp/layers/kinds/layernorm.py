"""``nn.LayerNorm`` (and timm's LayerNorm, the same function): see :mod:`fastdp.layers._norm` for the math."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.layers._norm import TrailingNormKind, randomised_affine
from fastdp.layers.registry import register
from fastdp.layers.spec import DocRow, OracleCase


@register
class LayerNormKind(TrailingNormKind):
    module_types = (nn.LayerNorm,)
    # timm's LayerNorm overrides forward only to call F.layer_norm (or its fused equivalent): the same function
    module_type_names = ("timm.layers.norm.LayerNorm",)
    doc = DocRow(
        "`nn.LayerNorm` (also timm's `LayerNorm`)", "weight, bias", "instantiated",
        "`g_i` = sum over positions of `G_i ⊙ x̂_i` (weight) / `G_i` (bias), `x̂` recomputed from the kept input with "
        "torch's own functional.")

    def oracle_cases(self) -> tuple[OracleCase, ...]:
        return (OracleCase("last dim, T = B", lambda: randomised_affine(nn.LayerNorm(4)), (3, 4)),
                OracleCase("2 normalized dims, no bias", lambda: randomised_affine(nn.LayerNorm((2, 3), bias=False)),
                           (2, 2, 3)),
                OracleCase("bias only", lambda: randomised_affine(nn.LayerNorm(5)), (3, 5), frozen=("weight",)))

    def normalize(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # with a weight of ones: the same numbers (x_hat * 1 is x_hat), from torch's CPU kernel with an affine
        # weight, the faster one (benchmarks/levers.py, lever ln-weighted-kernel)
        return F.layer_norm(x, module.normalized_shape, x.new_ones(module.normalized_shape), None, module.eps)
