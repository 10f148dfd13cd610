"""``nn.Conv1d/2d/3d``: any stride, dilation, padding (ints, tuples, "same", "valid"), padding mode and groups.

The input ``(B, C_in, *spatial)`` is padded exactly as the module pads it (``padding_mode`` included) and unfolded
into patches ``(B, T, C_in * prod(k))`` where ``T`` is the number of output positions. With ``g`` groups, group
``j`` sees input channels ``[j C_in/g, (j+1) C_in/g)`` and owns output channels ``[j C_out/g, (j+1) C_out/g)``, so
the canonical shapes of :mod:`fastdp.layers._matmul` are ``A: (B, g, T, C_in/g * prod(k))`` and
``G: (B, g, T, C_out/g)``; the per-sample weight gradient ``(B, g, C_out/g, C_in/g * prod(k))`` reshapes to
``(B, C_out, C_in/g, *k)``. Bias ``(C_out,)``: ``g_i = sum_t G_i[:, t]``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.layers import _matmul
from fastdp.layers.base import to_accumulation
from fastdp.layers.registry import register
from fastdp.layers.spec import DocRow, OracleCase


def unfold_patches(x: torch.Tensor, kernel: tuple[int, ...], dilation: tuple[int, ...],
                   stride: tuple[int, ...]) -> torch.Tensor:
    """Patches of an already padded input ``(B, C, *spatial)`` as ``(B, T, C * prod(kernel))``.

    Channel-major within a patch, matching the flattening of a conv weight ``(C_out, C, *kernel)``.
    """
    n = len(kernel)
    for i, (k, dil, s) in enumerate(zip(kernel, dilation, stride, strict=True)):
        span = (k - 1) * dil + 1
        x = x.unfold(2 + i, span, s)  # appends a window dimension of size `span`
        if dil > 1:
            x = x[..., ::dil]
    # x: (B, C, L_1..L_n, k_1..k_n)
    B, C = x.shape[0], x.shape[1]
    x = x.permute(0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n))
    T = math.prod(x.shape[1:1 + n])
    return x.reshape(B, T, C * math.prod(kernel))


@register
class ConvKind(_matmul.OuterProductKind):
    module_types = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    doc = DocRow(
        "`nn.Conv1d`, `nn.Conv2d`, `nn.Conv3d`", "weight, bias",
        "weight: ghost norm or instantiation on unfolded patches; bias: instantiated",
        'any stride, dilation, padding (ints, tuples, `"same"`, `"valid"`), `padding_mode`, `groups`. Needs a '
        "batched input.")

    def oracle_cases(self) -> tuple[OracleCase, ...]:
        return (OracleCase("1d, C = B", lambda: nn.Conv1d(3, 4, 3, padding=1), (3, 5)),
                OracleCase("2d, strided, dilated, reflect", lambda: nn.Conv2d(
                    2, 4, (2, 3), stride=(2, 1), dilation=(1, 2), padding=1, padding_mode="reflect"), (2, 5, 6)),
                OracleCase("2d, groups, same", lambda: nn.Conv2d(4, 6, 3, padding="same", groups=2), (4, 3, 3)),
                OracleCase("3d, circular, no bias", lambda: nn.Conv3d(
                    2, 2, 2, padding=1, padding_mode="circular", bias=False), (2, 3, 2, 3)),
                OracleCase("2d, bias only", lambda: nn.Conv2d(2, 3, 3), (2, 4, 4), frozen=("weight",)))

    def _padded(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        pad = list(module._reversed_padding_repeated_twice)
        if any(pad):
            x = F.pad(x, pad, mode=mode)
        return x

    def position_dims(self, grad_output: torch.Tensor) -> tuple[int, ...]:
        return tuple(range(2, grad_output.dim()))  # (B, C, *spatial)

    def prepare(self, module: nn.Module, activation: torch.Tensor | None, grad_output: torch.Tensor) -> Any:
        n = len(module.kernel_size)
        if grad_output.dim() != n + 2:
            raise ValueError(
                f"{type(module).__name__} needs a batched input of {n + 2} dimensions (B, C, ...); "
                f"got an output of shape {tuple(grad_output.shape)}. Add a batch dimension.")
        B, g, c_out = grad_output.shape[0], module.groups, module.out_channels
        T = math.prod(grad_output.shape[2:])  # explicit sizes throughout: B may be 0 (empty batch)
        G = to_accumulation(grad_output).reshape(B, g, c_out // g, T).transpose(2, 3)  # (B, g, T, p)
        A = None
        if activation is not None:
            x = self._padded(module, to_accumulation(activation))
            U = unfold_patches(x, module.kernel_size, module.dilation, module.stride)  # (B, T, C_in*K)
            A = U.reshape(B, T, g, U.shape[2] // g).transpose(1, 2)  # (B, g, T, C_in/g*K)
        return A, G
