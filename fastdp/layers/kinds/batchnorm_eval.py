"""``nn.BatchNorm1d/2d/3d`` in eval mode: it normalises with its frozen running statistics, a per-sample operation,
so its affine parameters train like GroupNorm's (e.g. DP-BiTFiT of a pretrained CNN); see
:mod:`fastdp.layers._norm` for the math. Train mode, and eval mode without running statistics, mix the samples of
a batch: refused (for every BatchNorm class, SyncBatchNorm and the lazy ones included).

In eval mode the map is the same at every position, so a call that sees the batch folded into its rows (LeViT's
``bn(x.flatten(0, 1))`` on ``(B N, C)`` tokens, sample ``i`` owning rows ``i N .. i N + N - 1``) is a call on
``(B, C, N)``: :meth:`BatchNormEvalKind.unfold_rows` moves a sample's rows behind the channel, where they are
positions the per-sample sums run over."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.layers import batchdim
from fastdp.layers._norm import ChannelNormKind, with_running_statistics
from fastdp.layers.registry import register
from fastdp.layers.spec import DocRow, OracleCase, Refusal
from fastdp.torch_api import BatchNormBase as _BatchNorm
from fastdp.torch_api import dense_layout


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
                 "trains as GroupNorm; also on rows with the batch folded in (`bn(x.flatten(0, 1))`, LeViT), a "
                 "sample's rows being positions. `fastdp.validate.fix` replaces BatchNorm by GroupNorm.")
    #: a folded call ``(k B, C, *L)`` is taken as ``(B, C, k, *L)`` (:meth:`unfold_rows`)
    foldable = True

    def oracle_cases(self) -> tuple[OracleCase, ...]:
        return (OracleCase("2d, C = B", lambda: with_running_statistics(nn.BatchNorm2d(3)), (3, 2, 2)),
                OracleCase("1d on (B, C)", lambda: with_running_statistics(nn.BatchNorm1d(4)), (4,)),
                OracleCase("1d on (B, C, L), bias only", lambda: with_running_statistics(nn.BatchNorm1d(2)), (2, 5),
                           frozen=("weight",)),
                OracleCase("3d", lambda: with_running_statistics(nn.BatchNorm3d(2)), (2, 2, 2, 2)))

    def unfold_rows(self, t: torch.Tensor, fold: int) -> torch.Tensor:
        """``(k B, C, *L)`` as ``(B, C, k, *L)`` (a view): the channel stays dimension 1 and a sample's ``k`` rows
        join its positions."""
        return batchdim.unfold_rows(t, fold).movedim(1, 2) if fold > 1 and t.dim() >= 2 else t

    def fold_rows(self, t: torch.Tensor, fold: int) -> torch.Tensor:
        return t.movedim(2, 1).flatten(0, 1) if fold > 1 and t.dim() >= 3 else t

    def normalize(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # a folded call's permuted view (unfold_rows) handed over row-major: torch's CPU batch-norm kernels misread
        # some layouts (fastdp.torch_api.dense_layout)
        x = dense_layout(x, channels_last=True)
        return F.batch_norm(x, module.running_mean, module.running_var, None, None, False, 0.0, module.eps)
