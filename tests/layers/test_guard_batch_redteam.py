"""Red-team of the grouped guards (fastdp/layers/_guard_batch.py): a release that differs from each parameter's own
guard (``_guard_batch.BATCHED = False``) by far more than rounding.

Grams cut in strips (the CPU from T 128: ``_grams.GRAM_STRIP``) take two routes. With ``BATCHED`` they give their
reductions (``_grams.strips_diagonal``, ...) and ``_rounding.symmetric_finish`` forms ``err`` from the sum of the
diagonal's upper bounds; without it ``_matmul.ghost_norm_pieces`` forms ``err`` from ``gram_rounding`` of
``strips_diagonal_norms`` (the square roots of those bounds, then their vector norm squared). The two ``err`` differ by
about 1e-7 relative (the batched one smaller on every input tried), so a sample whose ``sq / err`` lies between the
two values of the flag (``CANCELLATION_GUARD`` = 64) is flagged on one route and not on the other: narrowly flagged, it
keeps the raised norm (``sq + 2 err``, 3.1 % more), and the released gradient differs by about 1.5 % between the two
routes, in BK-ghost, ghost and BK-MixGhostClip, with the checks read or deferred. (No sample exceeds R on either
route: both bounds are valid; the claim broken is "the same values up to the order of sums", checked by
tests/layers/test_guard_batch.py to 1e-12 on whole Grams only, T 4.)

Fixed (2026-11-28): Grams in strips give their reductions on both routes and ``symmetric_finish`` forms ``err`` from
them, grouped or alone, so a sample's flag no longer depends on the route. The test bisects to the flag on the
grouped route and checks the two releases agree.
"""

from __future__ import annotations

import copy

import pytest
import torch
from oracle import make_engine
from torch import nn

from fastdp import deferred
from fastdp.layers import _grams, _guard_batch, _matmul, _rounding

T, D = 130, 192  # two strips on the CPU (T // 64); 2 T^2 < D^2: a ghost norm in BK-MixGhostClip too


def _operands(eps: float, v: float | None = None, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ``(1, T, D)`` and output gradient ``(1, T, D)``: random rows with two positions ``a``, ``a`` against
    ``g``, ``-(1 + eps) g`` (the sample's gradient cancels to about ``eps`` of those terms); ``v``: one background
    entry, a fine adjustment of ``sq``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, D, generator=gen)
    y = 0.01 * torch.randn(1, T, D, generator=gen)
    a, g = torch.randn(D, generator=gen) * 10, torch.randn(D, generator=gen) * 10
    x[0, 0] = x[0, 1] = a
    y[0, 0], y[0, 1] = g, -(1 + eps) * g
    if v is not None:
        y[0, 2, 0] = v
    return x, y


def _ratio(x: torch.Tensor, y: torch.Tensor, batched: bool, monkeypatch) -> float:
    """``sq / (64 err)`` of the weight's ghost norm as the clipping stage forms it on each route."""
    monkeypatch.setattr(_guard_batch, "BATCHED", batched)
    sq, err, _ = _matmul.ghost_norm_parts(x[:, None], y[:, None], share=False)
    return float(sq / (_rounding.CANCELLATION_GUARD * err))


def _at_the_flag(monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Operands whose batched ``sq / err`` is the least at or above 64 that a bisection on ``eps`` then ``v`` finds."""
    lo, hi = 0.0625, 0.125  # sq / err about 31 and 116
    for _ in range(60):
        mid = (lo + hi) / 2
        if _ratio(*_operands(mid), True, monkeypatch) < 1:
            lo = mid
        else:
            hi = mid
    base = float(_operands(lo)[1][0, 2, 0])
    grid = [base + k / 16 for k in range(-32, 33)]
    side = [_ratio(*_operands(lo, v), True, monkeypatch) < 1 for v in grid]
    pair = next(i for i in range(len(grid) - 1) if side[i] != side[i + 1])  # (sq / err crosses 1 between them)
    below, above = (grid[pair], grid[pair + 1]) if side[pair] else (grid[pair + 1], grid[pair])
    for _ in range(80):
        mid = (below + above) / 2
        if _ratio(*_operands(lo, mid), True, monkeypatch) < 1:
            below = mid
        else:
            above = mid
    return _operands(lo, above)


def _release(x: torch.Tensor, y: torch.Tensor, mode: str, R: float, batched: bool, monkeypatch) -> torch.Tensor:
    monkeypatch.setattr(_guard_batch, "BATCHED", batched)
    torch.manual_seed(0)
    model = nn.Linear(D, D, bias=False)
    engine = make_engine(model, batch_size=1, R=R, mode=mode, reduction="sum")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    (model(x) * y).sum().backward()
    opt.step()
    return model.weight.grad.double().clone()


@pytest.mark.parametrize("checks", ["read", "deferred"])
@pytest.mark.parametrize("mode", ["BK-ghost", "ghost", "BK-MixGhostClip"])
def test_strips_at_the_flag_release_what_each_parameters_own_guard_releases(mode, checks, monkeypatch):
    monkeypatch.setattr(_grams, "GRAM_STRIP", {"cpu": (64, 4), "default": (1, 1)})
    monkeypatch.setattr(_grams, "GRAM_ALIGN", {})
    if checks == "deferred":
        monkeypatch.setattr(deferred, "DEFER_ON", {"cpu": True, "default": True})
    x, y = _at_the_flag(monkeypatch)
    assert len(_grams.gram_strips(x[:, None])) == 2  # (the strips route)
    exact = float(torch.einsum("btp,btd->pd", y.double(), x.double()).norm())
    R = exact / 100  # clipped
    grouped = _release(copy.deepcopy(x), copy.deepcopy(y), mode, R, True, monkeypatch)
    alone = _release(copy.deepcopy(x), copy.deepcopy(y), mode, R, False, monkeypatch)
    flags = (_ratio(x, y, True, monkeypatch) < 1, _ratio(x, y, False, monkeypatch) < 1)
    rel = float((grouped - alone).norm() / alone.norm())
    assert rel <= 1e-6, (f"released gradient differs by {rel:.3e} relative from the per-parameter guard's "
                         f"(flagged grouped / alone: {flags}; ||release|| / R {float(grouped.norm()) / R:.6f} "
                         f"against {float(alone.norm()) / R:.6f})")
