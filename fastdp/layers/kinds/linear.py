"""``nn.Linear`` with any number of leading dimensions: input ``(B, *, d)``, output ``(B, *, p)``.

Positions ``T`` are all dimensions between the batch and the features. Weight ``(p, d)``: see
:mod:`fastdp.layers._matmul`. Bias ``(p,)``: ``g_i = sum_t G_i[t]`` (no activation needed).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fastdp.layers import _matmul
from fastdp.layers.registry import register
from fastdp.layers.spec import DocRow, OracleCase


@register
class LinearKind(_matmul.OuterProductKind):
    module_types = (nn.Linear,)
    foldable = True
    narrow_products = True
    doc = DocRow(
        "`nn.Linear`", "weight, bias", "weight: ghost norm or instantiation (cost model); bias: instantiated",
        "any number of leading dims `(B, *, d)`; positions `T` = all dims between batch and features. A bias-only "
        "trainable Linear keeps no activation (DP-BiTFiT).")

    def oracle_cases(self) -> tuple[OracleCase, ...]:
        return (OracleCase("2d", lambda: nn.Linear(4, 3), (4,)),
                OracleCase("3d, T = B", lambda: nn.Linear(4, 5), (3, 4)),
                OracleCase("4d, no bias", lambda: nn.Linear(3, 2, bias=False), (2, 3, 3)),
                OracleCase("bias only", lambda: nn.Linear(4, 3), (3, 4), frozen=("weight",)))

    def prepare(self, module: nn.Module, activation: torch.Tensor | None, grad_output: torch.Tensor) -> Any:
        B = grad_output.shape[0]
        if grad_output.dim() < 2:
            raise ValueError(
                f"{type(module).__name__} input has no batch dimension (output {tuple(grad_output.shape)})")
        T = math.prod(grad_output.shape[1:-1])  # explicit: B may be 0 (empty batch)
        return self.canonical(activation, grad_output, B, T)
