"""Moved to :mod:`fastdp.layers.kinds.hf_conv1d` (one file per layer kind); these names stay importable."""

from fastdp.layers.kinds.hf_conv1d import HFConv1DKind

__all__ = ["HFConv1DKind"]
