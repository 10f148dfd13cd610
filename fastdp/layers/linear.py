"""Moved to :mod:`fastdp.layers.kinds.linear` (one file per layer kind); these names stay importable."""

from fastdp.layers.kinds.linear import LinearKind

__all__ = ["LinearKind"]
