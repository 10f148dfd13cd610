"""Moved to :mod:`fastdp.layers.kinds.embedding` (one file per layer kind); these names stay importable."""

from fastdp.layers.kinds.embedding import EmbeddingKind

__all__ = ["EmbeddingKind"]
