"""Gaussian noise for the released gradient: the one place noise is drawn.

The released gradient of a parameter is ``(sum_i C_i g_i + sigma * R * xi) / batch_size`` with
``xi ~ N(0, I)`` drawn once per parameter per logical step, in at least float32, on the parameter's device.
"""

from __future__ import annotations

import torch

from fastdp.layers.base import accumulation_dtype


def noise_dtype(param: torch.Tensor) -> torch.dtype:
    """float64 for float64 parameters, float32 otherwise (never half precision)."""
    return accumulation_dtype(param.dtype)


def gaussian_noise(param: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """``std * xi`` with ``xi ~ N(0, I)`` of ``param``'s shape, on ``param``'s device, in :func:`noise_dtype`.

    Raises:
        ValueError: if ``generator`` lives on another device than ``param``.
    """
    dtype = noise_dtype(param)
    if generator is not None and generator.device.type != param.device.type:
        raise ValueError(f"noise_generator is on device {generator.device} but a parameter is on {param.device}; "
                         f"create it with torch.Generator(device={str(param.device)!r})")
    out = torch.empty(param.shape, dtype=dtype, device=param.device)
    if std == 0.0:
        return out.zero_()
    return out.normal_(0.0, std, generator=generator)


def noisy_mean(param: torch.Tensor, clipped_sum: torch.Tensor | None, std: float, batch_size: int,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The released gradient ``(clipped_sum + std * xi) / batch_size``, cast to ``param``'s dtype.

    The noise is drawn already divided by ``batch_size`` and the clipped sum added in one fused pass.
    ``clipped_sum=None`` means an empty batch (noise only).
    """
    grad = gaussian_noise(param, std / batch_size, generator)
    if clipped_sum is not None:
        grad.add_(clipped_sum.to(grad.dtype), alpha=1.0 / batch_size)
    return grad.to(param.dtype)
