"""Hugging Face ``transformers.pytorch_utils.Conv1D`` (GPT-2, GPT): a Linear layer with a transposed weight.

Input ``(B, *, d)``, output ``(B, *, p)``, ``y = x W + b`` with ``W`` of shape ``(d, p)``. The per-sample weight
gradient is ``g_i = A_i^T G_i`` (``d x p``), the transpose of :mod:`fastdp.layers._matmul`'s ``G_i^T A_i``: the
ghost norm is the same, instantiation and the book-keeping contraction are transposed. The class is matched by its
qualified name, so fastdp does not import transformers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fastdp.layers import _matmul, _products
from fastdp.layers._factored import Factors
from fastdp.layers.base import to_accumulation
from fastdp.layers.registry import register
from fastdp.layers.spec import DocRow, OracleCase


def _conv1d(nf: int, nx: int) -> nn.Module:
    """A transformers ``Conv1D(nf, nx)`` (weight ``(nx, nf)``) with a non-zero bias; needs transformers."""
    from transformers.pytorch_utils import Conv1D

    m = Conv1D(nf, nx)
    with torch.no_grad():
        m.bias.normal_()
    return m


@register
class HFConv1DKind(_matmul.OuterProductKind):
    module_type_names = ("transformers.pytorch_utils.Conv1D",)
    foldable = True
    narrow_products = True
    doc = DocRow("HF `transformers.pytorch_utils.Conv1D` (GPT-2)", "weight, bias",
                 "as `nn.Linear` (the weight is stored transposed, `(d, p)`)",
                 "matched by qualified class name: fastdp does not import transformers.")

    def oracle_cases(self) -> tuple[OracleCase, ...]:
        return (OracleCase("3d, T = B", lambda: _conv1d(5, 4), (3, 4)),
                OracleCase("2d", lambda: _conv1d(2, 6), (6,)),
                OracleCase("bias only", lambda: _conv1d(3, 4), (2, 4), frozen=("weight",)))

    def prepare(self, module: nn.Module, activation: torch.Tensor | None, grad_output: torch.Tensor) -> Any:
        if grad_output.dim() < 2:
            raise ValueError(f"Conv1D input has no batch dimension (output {tuple(grad_output.shape)})")
        B = grad_output.shape[0]
        T = math.prod(grad_output.shape[1:-1])  # explicit: B may be 0 (empty batch)
        return self.canonical(activation, grad_output, B, T)

    def factors(self, module: nn.Module, ctx: Any, name: str) -> Factors | None:
        A, G = ctx
        if name == "bias":
            return super().factors(module, ctx, name)
        return Factors(to_accumulation(A), to_accumulation(G))  # (float32 for bfloat16 operands)

    def per_sample_grad(self, module: nn.Module, ctx: Any, name: str) -> torch.Tensor:
        if name == "bias":
            return super().per_sample_grad(module, ctx, name)
        A, G = ctx
        narrow = _matmul.narrow_of(ctx)
        if narrow is None:
            return torch.einsum("bgtd,bgtp->bdp", A, G)
        return _products.product(A.transpose(-1, -2), G, narrow).reshape(A.shape[0], A.shape[-1], G.shape[-1])

    def clipped_sum(self, module: nn.Module, ctx: Any, name: str, coef: torch.Tensor) -> torch.Tensor:
        if name == "bias":
            return super().clipped_sum(module, ctx, name, coef)
        A, G = ctx
        return _matmul.clipped_sum(G, A, coef, _matmul.narrow_of(ctx)).reshape(module.weight.shape)
