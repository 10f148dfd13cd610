"""A hooked module run once for the whole batch (no batch dimension, leading size 1) whose output the model
``repeat``s over the batch, as XCiT's Fourier position encoder does (``token_projection(grid).repeat(B, 1, 1, 1)``).

The engine expands such an output so that its gradient arrives per sample; ``repeat`` (or ``torch.tile``) of it by
exactly ``(B, 1, ...)`` gives the expanded rows (``fastdp.layers.broadcast``). Every case is compared with the
brute-force oracle (one backward per sample, float64, 1e-6) in every clipping mode, at batch size 1 and at a batch
size equal to another dimension of the model. Rows that the model mixes after the repeat, and a repeat by another
count, fall back to the per-sample replay (exact).
"""

from __future__ import annotations

import pytest
import torch
from model_oracle import check_engine, mse_loss
from oracle import MODES, make_engine, user_loss
from torch import nn

from fastdp.layers.broadcast import BatchRows

D = torch.float64
T, DIM = 4, 3


class RepeatedTable(nn.Module):
    """Tokens ``(B, T, d)`` plus a position code computed from a grid without batch dimension and repeated over the
    batch: ``proj(grid)`` is ``(1, T, d)`` (a Linear) and ``conv(grid)`` ``(1, d, T)`` (a Conv1d)."""

    def __init__(self, how: str = "repeat"):
        super().__init__()
        self.proj = nn.Linear(2, DIM)
        self.conv = nn.Conv1d(2, DIM, 1)
        self.head = nn.Linear(DIM, 2)
        self.how = how

    def grid(self) -> torch.Tensor:
        t = torch.arange(T, dtype=D) / T
        return torch.stack([torch.sin(t), torch.cos(t)], -1).unsqueeze(0)  # (1, T, 2), no batch dimension

    def forward(self, x):
        B = x.shape[0]
        g = self.grid()
        if self.how == "repeat":
            pos = self.proj(g).repeat(B, 1, 1) + self.conv(g.transpose(1, 2)).repeat(B, 1, 1).transpose(1, 2)
        elif self.how == "tile":  # the function and the method
            pos = torch.tile(self.proj(g), (B, 1, 1)) + self.conv(g.transpose(1, 2)).tile(B, 1, 1).mT
        elif self.how == "flip":  # the repeated rows reordered (equal values): row i is no longer sample i's
            pos = self.proj(g).repeat(B, 1, 1).flip(0)
        else:  # "twice": repeated to 2 B rows, folded back by summing pairs
            pos = self.proj(g).repeat(2 * B, 1, 1).view(2, B, T, DIM).sum(0)
        return self.head(torch.tanh(x + pos)).mean(1)


def _batches(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(n, T, DIM, generator=g, dtype=D),), torch.randn(n, 2, generator=g, dtype=D))
            for n in sizes]


@pytest.mark.parametrize("how", ["repeat", "tile"])
@pytest.mark.parametrize("sizes", [[3, 1], [T], [1]], ids=["B=3,1", "B=T", "B=1"])
@pytest.mark.parametrize("mode", MODES)
def test_repeated_broadcast_outputs_match_the_oracle(mode, sizes, how):
    torch.manual_seed(0)
    check_engine(RepeatedTable(how).to(D), mse_loss, _batches(sizes, 1), mode=mode,
                 where="below" if sizes == [1] else "middle")


def test_only_a_repeat_by_the_batch_gives_the_expanded_rows():
    """``repeat(B, 1, 1)`` and ``tile`` of a :class:`BatchRows` copy its rows; any other count repeats them, and
    every other function returns a plain tensor."""
    rows = torch.arange(6.0).view(1, 2, 3).expand(4, 2, 3).as_subclass(BatchRows)
    rows.rows = 4
    for got in (rows.repeat(4, 1, 1), rows.repeat((4, 1, 1)), torch.tile(rows, (4, 1, 1)), rows.tile(4, 1, 1)):
        assert type(got) is torch.Tensor and got.shape == (4, 2, 3) and got.is_contiguous()
        assert torch.equal(got, torch.arange(6.0).view(1, 2, 3).repeat(4, 1, 1))
    assert rows.repeat(2, 1, 1).shape == (8, 2, 3) and rows.repeat(4, 2, 1).shape == (16, 4, 3)
    assert type(rows + 1) is torch.Tensor and type(rows[0]) is torch.Tensor


@pytest.mark.parametrize("how", ["flip", "twice"])
def test_rows_mixed_after_the_repeat_fall_back_to_the_replay(how):
    """After the repeat the model reorders the rows (``flip``: equal values, but row ``i`` is no longer sample
    ``i``'s) or repeats to ``2 B`` rows and sums pairs (``twice``): taking the expanded rows as the samples' would be
    wrong, which the structure probe sees (its batch-of-one references), and it moves ``proj`` to the root's
    per-sample replay: exact."""
    torch.manual_seed(2)
    engine = check_engine(RepeatedTable(how).to(D), mse_loss, _batches([3, 2], 3), mode="BK-MixOpt")[0]
    assert engine._extra_owned == {"": ("proj.weight", "proj.bias")}


def _engine_step(model, seed):
    engine = make_engine(model, batch_size=3, mode="BK-MixOpt", fn="abadi", style="all-layer", reduction="mean")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    (x,), y = _batches([3], seed)[0]
    user_loss(mse_loss(model(x), y), "mean").backward()
    opt.step()
    return engine


def test_the_repeat_keeps_the_layers_on_their_kinds():
    """With the repeat path the position code's Linear and Conv1d stay on their layer kinds (ghost norms or
    instantiation, book-keeping). The mutation it answers: with :class:`BatchRows` passing ``repeat`` through,
    ``repeat(B, ...)`` of the expanded output gives ``B^2`` rows, the structure probe's engine pass fails, and both
    are moved to the root's per-sample replay (exact, but the generic path)."""
    torch.manual_seed(4)
    engine = _engine_step(RepeatedTable("repeat").to(D), 5)
    assert not engine._extra_owned and not engine.generic_stats
    original = BatchRows.__torch_function__
    try:
        BatchRows.__torch_function__ = classmethod(lambda cls, func, types, args=(), kwargs=None:
                                                   torch.Tensor.__torch_function__.__func__(
                                                       torch.Tensor, func, types, args, kwargs or {}))
        torch.manual_seed(4)
        engine = _engine_step(RepeatedTable("repeat").to(D), 5)
        assert {n for names in engine._extra_owned.values() for n in names} >= {"proj.weight", "conv.weight"}
    finally:
        BatchRows.__torch_function__ = original
