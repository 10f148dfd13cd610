"""Moved to ``fastdp/layers/kinds/`` (one file per layer kind; shared math in :mod:`fastdp.layers._norm`); these
names stay importable."""

from fastdp.layers.kinds.batchnorm_eval import BatchNormEvalKind
from fastdp.layers.kinds.groupnorm import GroupNormKind
from fastdp.layers.kinds.instancenorm import InstanceNormKind
from fastdp.layers.kinds.layernorm import LayerNormKind
from fastdp.layers.kinds.rmsnorm import RMSNormKind

__all__ = ["BatchNormEvalKind", "GroupNormKind", "InstanceNormKind", "LayerNormKind", "RMSNormKind"]
