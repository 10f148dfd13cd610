"""``nn.GroupNorm``: see :mod:`fastdp.layers._norm` for the math."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.layers._norm import ChannelNormKind, randomised_affine
from fastdp.layers.registry import register
from fastdp.layers.spec import DocRow, OracleCase


@register
class GroupNormKind(ChannelNormKind):
    module_types = (nn.GroupNorm,)
    doc = DocRow("`nn.GroupNorm`", "weight, bias", "instantiated",
                 "per-channel parameters, summed over spatial positions.")

    def oracle_cases(self) -> tuple[OracleCase, ...]:
        return (OracleCase("2d, C = B", lambda: randomised_affine(nn.GroupNorm(1, 3)), (3, 2, 2)),
                OracleCase("1d, 2 groups", lambda: randomised_affine(nn.GroupNorm(2, 4)), (4, 3)),
                OracleCase("(B, C) input", lambda: randomised_affine(nn.GroupNorm(2, 6)), (6,)))

    def normalize(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"GroupNorm needs a batched input (B, C, ...), got shape {tuple(x.shape)}")
        return F.group_norm(x, module.num_groups, None, None, module.eps)
