"""``nn.InstanceNorm1d/2d/3d`` with ``affine=True``: see :mod:`fastdp.layers._norm` for the math."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.instancenorm import _InstanceNorm

from fastdp.layers._norm import ChannelNormKind, randomised_affine, with_running_statistics
from fastdp.layers.registry import register
from fastdp.layers.spec import DocRow, OracleCase, Refusal


@register
class InstanceNormKind(ChannelNormKind):
    module_types = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
    refusals = (
        Refusal((_InstanceNorm,), lambda m: m.track_running_stats and m.training,
                lambda m: "has track_running_stats=True in train mode: it updates running statistics from private "
                          "data without noise, and they are released with the model. Fix: construct it with "
                          "track_running_stats=False",
                example=lambda: nn.InstanceNorm1d(3, affine=True, track_running_stats=True),
                summary="`track_running_stats=True` in train mode"),
    )
    doc = DocRow("`nn.InstanceNorm1d/2d/3d` (affine)", "weight, bias", "instantiated",
                 "as GroupNorm.")

    def oracle_cases(self) -> tuple[OracleCase, ...]:
        return (OracleCase("1d, C = B", lambda: randomised_affine(nn.InstanceNorm1d(3, affine=True)), (3, 4)),
                OracleCase("2d", lambda: randomised_affine(nn.InstanceNorm2d(2, affine=True)), (2, 3, 2)),
                OracleCase("3d", lambda: randomised_affine(nn.InstanceNorm3d(2, affine=True)), (2, 2, 2, 2)),
                OracleCase("eval, running statistics", lambda: with_running_statistics(nn.InstanceNorm2d(
                    2, affine=True, track_running_stats=True)), (2, 3, 3)))

    def normalize(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        expected = {nn.InstanceNorm1d: 3, nn.InstanceNorm2d: 4, nn.InstanceNorm3d: 5}
        want = next(v for k, v in expected.items() if isinstance(module, k))
        if x.dim() != want:
            raise ValueError(f"{type(module).__name__} needs a batched input of {want} dimensions, "
                             f"got shape {tuple(x.shape)}")
        use_input_stats = module.training or not module.track_running_stats
        if use_input_stats:
            return F.instance_norm(x, None, None, None, None, True, 0.0, module.eps)
        return F.instance_norm(x, module.running_mean, module.running_var, None, None, False, 0.0, module.eps)
