"""``nn.Linear`` with any number of leading dimensions: input ``(B, *, d)``, output ``(B, *, p)``.

Positions ``T`` are all dimensions between the batch and the features. Weight ``(p, d)``: see
:mod:`fastdp.layers._matmul`. Bias ``(p,)``: ``g_i = sum_t G_i[t]`` (no activation needed).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fastdp.layers import _matmul, register
from fastdp.layers.base import LayerKind, to_accumulation


@register
class LinearKind(LayerKind):
    module_types = (nn.Linear,)

    def prepare(self, module: nn.Module, activation: torch.Tensor | None, grad_output: torch.Tensor) -> Any:
        B, p = grad_output.shape[0], grad_output.shape[-1]
        if grad_output.dim() < 2:
            raise ValueError(
                f"{type(module).__name__} input has no batch dimension (output {tuple(grad_output.shape)})")
        T = math.prod(grad_output.shape[1:-1])  # explicit: B may be 0 (empty batch)
        G = to_accumulation(grad_output).reshape(B, 1, T, p)
        A = None
        if activation is not None:
            A = to_accumulation(activation).reshape(B, 1, T, activation.shape[-1])
        return A, G

    def ghost_names(self, module: nn.Module) -> frozenset[str]:
        return frozenset({"weight"})

    def prefers_ghost(self, module: nn.Module, ctx: Any, name: str) -> bool:
        return _matmul.prefers_ghost(*ctx)

    def ghost_norm_sq(self, module: nn.Module, ctx: Any, name: str) -> torch.Tensor:
        return _matmul.ghost_norm_sq(*ctx)

    def per_sample_grad(self, module: nn.Module, ctx: Any, name: str) -> torch.Tensor:
        A, G = ctx
        if name == "bias":
            return G.sum(dim=(1, 2))
        return _matmul.per_sample_grad(A, G)[:, 0]

    def clipped_sum(self, module: nn.Module, ctx: Any, name: str, coef: torch.Tensor) -> torch.Tensor:
        A, G = ctx
        if name == "bias":
            return torch.einsum("b,bp->p", coef.to(G.dtype), G.sum(dim=(1, 2)))
        return _matmul.clipped_sum(A, G, coef)[0]
