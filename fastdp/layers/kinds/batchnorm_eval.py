"""``nn.BatchNorm1d/2d/3d`` in eval mode: it normalises with its frozen running statistics, a per-sample operation,
so its affine parameters train like GroupNorm's (e.g. DP-BiTFiT of a pretrained CNN); see
:mod:`fastdp.layers._norm` for the math. Train mode, and eval mode without running statistics, mix the samples of
a batch: refused (for every BatchNorm class, SyncBatchNorm and the lazy ones included)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.layers._norm import ChannelNormKind, with_running_statistics
from fastdp.layers.registry import register
from fastdp.layers.spec import DocRow, OracleCase, Refusal
from fastdp.torch_api import BatchNormBase as _BatchNorm


def _train_mode(m: nn.Module) -> str:
    mix = ("synchronises batch statistics across processes" if isinstance(m, nn.SyncBatchNorm)
           else "normalises with statistics of the batch")
    return (f"is in train mode: it {mix}, which mixes the samples of a batch (no per-sample gradient exists), and "
            "updates running statistics from private data. Fix: fastdp.validate.fix(model) replaces it with "
            "GroupNorm; or keep it with frozen statistics: call .eval() on it and freeze its parameters")


@register
class BatchNormEvalKind(ChannelNormKind):
    module_types = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    refusals = (
        Refusal((_BatchNorm,), lambda m: m.training, _train_mode, example=lambda: nn.BatchNorm2d(3),
                summary="train mode (any `_BatchNorm`, `SyncBatchNorm` included)"),
        Refusal((_BatchNorm,), lambda m: not m.training and (m.running_mean is None or m.running_var is None),
                lambda m: "has track_running_stats=False, so even in eval mode it normalises with statistics of the "
                          "batch (mixes samples). Fix: fastdp.validate.fix(model) replaces it with GroupNorm",
                example=lambda: nn.BatchNorm1d(3, track_running_stats=False).eval(),
                summary="`track_running_stats=False` (batch statistics even in eval mode)"),
    )
    doc = DocRow("`nn.BatchNorm1d/2d/3d` in eval mode", "weight, bias", "instantiated",
                 "normalises with its frozen running statistics: a fixed per-channel affine map per sample, so it "
                 "trains as GroupNorm. `fastdp.validate.fix` replaces BatchNorm by GroupNorm.")

    def oracle_cases(self) -> tuple[OracleCase, ...]:
        return (OracleCase("2d, C = B", lambda: with_running_statistics(nn.BatchNorm2d(3)), (3, 2, 2)),
                OracleCase("1d on (B, C)", lambda: with_running_statistics(nn.BatchNorm1d(4)), (4,)),
                OracleCase("1d on (B, C, L), bias only", lambda: with_running_statistics(nn.BatchNorm1d(2)), (2, 5),
                           frozen=("weight",)),
                OracleCase("3d", lambda: with_running_statistics(nn.BatchNorm3d(2)), (2, 2, 2, 2)))

    def normalize(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, module.running_mean, module.running_var, None, None, False, 0.0, module.eps)
