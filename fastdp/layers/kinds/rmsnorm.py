"""``nn.RMSNorm``: see :mod:`fastdp.layers._norm` for the math."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.layers._norm import TrailingNormKind, randomised_affine
from fastdp.layers.registry import register
from fastdp.layers.spec import DocRow, OracleCase


@register
class RMSNormKind(TrailingNormKind):
    module_types = (nn.RMSNorm,)
    doc = DocRow("`nn.RMSNorm`", "weight", "instantiated", "as `nn.LayerNorm`, `x̂ = x / rms(x)`.")

    def oracle_cases(self) -> tuple[OracleCase, ...]:
        return (OracleCase("last dim, T = B", lambda: randomised_affine(nn.RMSNorm(4, eps=1e-5)), (3, 4)),
                OracleCase("2 normalized dims, eps=None", lambda: randomised_affine(nn.RMSNorm((2, 3))), (2, 3)))

    def normalize(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, module.normalized_shape, None, module.eps)
