"""Matrix products of the weight's per-sample norms and clipped sums, in float32 or from bfloat16 operands.

``product(x, y)`` is ``x @ y`` over the last two dimensions: IEEE float32 (or wider) products, or, where a call ran
in bfloat16 (:data:`fastdp.layers._matmul.BF16_PRODUCTS`), bfloat16 products accumulated in float32
(:func:`fastdp.torch_api.bf16_matmul_float32`). A float32 operand that must enter a bfloat16 product exactly (the
clipped sum's scaled ``coef_i G_i``) is split into three bfloat16 tensors whose sum it is (:func:`split_bf16`).
Used by the Gram matrices (:mod:`fastdp.layers._grams`), the outer-product kinds (:mod:`fastdp.layers._matmul`) and
HF's Conv1D kind.
"""

from __future__ import annotations

import math

import torch

from fastdp.torch_api import bf16_matmul_float32


def product(x: torch.Tensor, y: torch.Tensor, narrow: torch.dtype | None = None) -> torch.Tensor:
    """``x @ y`` over the last two dimensions (leading dimensions equal), in float32: IEEE float32 products, or with
    ``narrow`` (operands holding bfloat16 values) bfloat16 products accumulated in float32."""
    if narrow is None:
        return torch.matmul(x, y)
    lead = x.shape[:-2]
    n = math.prod(lead)  # explicit: a tensor of zero positions has zero elements
    out = bf16_matmul_float32(x.to(narrow).reshape(n, *x.shape[-2:]), y.to(narrow).reshape(n, *y.shape[-2:]))
    return out.view(*lead, x.shape[-2], y.shape[-1])


def _truncated_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` cut to bfloat16 toward zero (its low 16 bits dropped): a bfloat16 value never larger in
    magnitude than ``x``, so it cannot overflow where rounding to nearest would (above bfloat16's largest finite)."""
    return (x.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three bfloat16 tensors whose sum is the float32 ``x`` exactly: ``hi`` = ``x`` cut to bfloat16 (toward zero,
    :func:`_truncated_bf16`), ``mid`` the remainder cut the same way, ``lo`` the rest. ``x``'s 24 significant bits
    span 24 positions; ``hi`` takes the top 8, the remainder (exact in float32) spans at most the 16 below, ``mid``
    takes its top 8 significant bits and the rest spans at most 8 positions, which bfloat16 holds exactly (it has
    float32's exponent range; only a rest below bfloat16's smallest subnormal, ``2^-133``, where ``|x| < 2^-110``,
    is lost)."""
    hi = _truncated_bf16(x)
    rest = x - hi.float()
    mid = _truncated_bf16(rest)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return hi, mid, lo


def split_product(x: torch.Tensor, y: torch.Tensor, narrow: torch.dtype | None) -> torch.Tensor:
    """``x @ y`` (2-D) for a float32 ``x`` and a ``y`` holding ``narrow`` values: IEEE float32 without ``narrow``;
    with it, the sum of the products of ``x``'s exact three-way bfloat16 split (:func:`split_bf16`) with ``y``."""
    if narrow is None:
        return torch.mm(x, y)
    yb = y.to(narrow)
    out = None
    for part in split_bf16(x):
        term = bf16_matmul_float32(part, yb)
        out = term if out is None else out.add_(term)
    return out
