"""Moved to :mod:`fastdp.layers.kinds.conv` (one file per layer kind); these names stay importable."""

from fastdp.layers.kinds.conv import ConvKind, unfold_patches

__all__ = ["ConvKind", "unfold_patches"]
