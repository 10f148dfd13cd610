"""The ghost norms' guards finished in groups of like parameters (fastdp/layers/_guard_batch.py) give what each
parameter's guard gives on its own, and the released gradients are the brute-force oracle's.

Grouping stacks parameters whose reductions share shapes, dtypes, widths and positions and runs the guard's
element-wise operations once on the stack. A wrong grouping key (widths or positions of the first member used for
all) or a row put back in the wrong place would change norms by whole factors; a lost flagged sample would release
an unclipped gradient. Each case runs with the checks read at once (the CPU's exact path) and deferred to the release
(CUDA's raised norms)."""

from __future__ import annotations

import copy

import pytest
import torch
from oracle import make_engine, oracle_release
from torch import nn

from fastdp import deferred
from fastdp.layers import _grams, _guard_batch, _matmul, _rounding
from fastdp.layers._factored import Factors


@pytest.fixture(params=["read", "deferred"])
def checks(request, monkeypatch) -> str:
    if request.param == "deferred":
        monkeypatch.setattr(deferred, "DEFER_ON", {"cpu": True, "default": True})
    return request.param


def _operands(B: int, T: int, d: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, 1, T, d, generator=gen, dtype=dtype)


def _reductions(B: int, T: int, d: int, p: int, seed: int, dtype=torch.float32) -> _rounding.SymmetricReductions:
    A, G = _operands(B, T, d, seed, dtype), _operands(B, T, p, seed + 1, dtype)
    return _rounding.symmetric_reductions(A @ A.transpose(-1, -2), G @ G.transpose(-1, -2), d, p)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=0)


def test_finish_all_gives_each_parameters_own_result():
    # three like parameters (one group), others differing only in a width, in T, in the batch or the dtype, and a
    # finished tuple passed through; every result as symmetric_finish gives it alone
    parts = [_reductions(4, 6, 8, 8, 0), _reductions(4, 6, 8, 8, 10), _reductions(4, 6, 8, 32, 20),
             _reductions(4, 6, 8, 8, 30), _reductions(4, 6, 32, 8, 40), _reductions(4, 5, 8, 8, 50),
             _reductions(3, 6, 8, 8, 60), _reductions(4, 6, 8, 8, 70, torch.float64),
             _reductions(4, 6, 8, 8, 80, torch.float64)]
    done = (torch.ones(4), torch.zeros(4), torch.ones(4))
    got = _guard_batch.finish_all([*parts, done])
    assert got[-1] is done
    for r, g in zip(parts, got, strict=False):
        want = _rounding.symmetric_finish(r)
        assert all(_same(x, y) for x, y in zip(g, want, strict=True))
    # the widths are part of the key: the same Grams charged with other widths give another bound
    assert not _same(got[2][1], _rounding.symmetric_finish(_rounding.SymmetricReductions(
        **{**parts[2].__dict__, "width_l": 8}))[1])


def test_finish_all_matches_symmetric_parts():
    A, G = _operands(5, 7, 16, 1), _operands(5, 7, 24, 2)
    K, L = A @ A.transpose(-1, -2), G @ G.transpose(-1, -2)
    want = _rounding.symmetric_parts(K, L, 16, 24)
    got = _guard_batch.finish_all([_rounding.symmetric_reductions(K, L, 16, 24)] * 3)
    for g in got:
        assert all(torch.equal(x, y) for x, y in zip(g, want, strict=True))


@pytest.mark.parametrize("strip", [(2, 4), (3, 2)])
def test_strips_give_the_per_parameter_bounds(strip, monkeypatch):
    # Grams in strips (the CPU at T >= 128): their reductions finished as whole Grams' give the bound the strips had
    # their own formula for before (gram_rounding of the positions' norms), to rounding
    monkeypatch.setattr(_grams, "GRAM_STRIP", {"cpu": strip, "default": (1, 1)})
    A, G = _operands(3, 7, 16, 3), _operands(3, 7, 24, 4)
    sq, err, bound = _matmul.ghost_norm_parts(A, G, share=False)
    aat, ggt = _grams.gram_strips(A), _grams.gram_strips(G)
    assert len(aat) > 1
    na, ng = (torch.cat([_rounding.diagonal_norms(q[..., :q.shape[2]], w) for q in P], dim=-1)
              for P, w in ((aat, 16), (ggt, 24)))
    red = _rounding.reduction_width(A.dtype, 7 * 7)
    want_err = (_rounding.gram_rounding(_grams.strips_frobenius(ggt), na, na, 16 + red)
                + _rounding.gram_rounding(_grams.strips_frobenius(aat), ng, ng, 24))
    assert _same(sq, _grams.strips_inner(aat, ggt)) and _same(err, want_err)
    assert _same(bound, _rounding.triangle_bound_sq(na, ng))


def _item(A: torch.Tensor, G: torch.Tensor) -> _guard_batch.Guarded:
    sq, err, bound = _matmul.ghost_norm_parts(A, G, share=False)
    return (sq, err, bound, lambda index: [Factors(G[index], A[index])], (G.shape[-1], A.shape[-1]), G.shape[2])


def _cancelling(B: int, T: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random operands whose sample 1's gradient cancels across two positions (``g``, ``-(1 + 2^-12) g`` against one
    input): flagged by the guard."""
    A, G = _operands(B, T, d, seed), _operands(B, T, d, seed + 1)
    A[1, 0, 1] = A[1, 0, 0] * 1
    G[1, 0, 1] = -(1 + 2.0 ** -12) * G[1, 0, 0]
    A[1, 0, 2:], G[1, 0, 2:] = 0, 0
    A[1] *= 100
    return A, G


def test_exact_flagged_all_gives_each_parameters_own_result(checks):
    items = [_item(*_cancelling(3, 4, 8, 0)), _item(_operands(3, 4, 8, 2), _operands(3, 4, 8, 3)),
             _item(_operands(3, 4, 8, 4), _operands(3, 4, 8, 5)), _item(_operands(3, 6, 8, 6), _operands(3, 6, 8, 7)),
             _item(_operands(3, 6, 8, 8), _operands(3, 6, 8, 9)), _item(*_cancelling(3, 6, 8, 10)),
             _item(_operands(0, 4, 8, 12), _operands(0, 4, 8, 13)), _item(_operands(0, 4, 8, 14),
                                                                         _operands(0, 4, 8, 15))]
    flagged = [bool((~(sq >= _rounding.CANCELLATION_GUARD * err)).any()) for sq, err, *_ in items]
    assert flagged[:6] == [True, False, False, False, False, True]  # (the construction is flagged)
    got = _guard_batch.exact_flagged_all(items)
    for item, (sq, ex) in zip(items, got, strict=True):
        want_sq, want_ex = _rounding.exact_flagged(*item)
        assert _same(sq, want_sq)
        assert (ex is None) == (want_ex is None)
        if ex is not None:
            assert torch.equal(ex.index, want_ex.index) and torch.equal(ex.grads, want_ex.grads)
    if checks == "read":
        assert got[0][1] is not None and got[0][1].index.tolist() == [1]  # taken apart on the CPU


class Blocks(nn.Module):
    """Two blocks of q, k, v, o projections (one width, so their guards form one group) and an MLP; per-sample output
    ``(B,)``."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({n: nn.Linear(d, d) for n in "qkvo"}) for _ in range(2))
        self.fc, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b["o"](torch.tanh(b["q"](x)) * b["k"](x) + b["v"](x))
        return self.out(torch.relu(self.fc(x))).sum(dim=(1, 2))


def _per_sample(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return out * y


def _release(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str, R: float, style: str,
             batched: bool, monkeypatch) -> dict[str, torch.Tensor]:
    monkeypatch.setattr(_guard_batch, "BATCHED", batched)
    m = copy.deepcopy(model)
    engine = make_engine(m, batch_size=max(len(x), 1), R=R, mode=mode, style=style, reduction="sum")
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    engine.attach(opt)
    _per_sample(m(x), y).sum().backward()
    opt.step()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("B", [0, 1, 3, 4])
@pytest.mark.parametrize("mode", ["BK-MixOpt", "BK-ghost", "BK-MixGhostClip"])
@pytest.mark.parametrize("style", ["all-layer", "param-wise"])
@pytest.mark.parametrize("grams", ["whole", "strips"])
def test_grouped_guards_release_the_oracle(B, mode, style, grams, checks, monkeypatch):
    # T 4 at width 8 (2 T^2 < p d): the q, k, v, o and fc weights take ghost norms, eight of one group; B 4 equals T
    if grams == "strips":  # (Grams in two strips of two rows, as the CPU cuts them at T >= 128)
        monkeypatch.setattr(_grams, "GRAM_STRIP", {"cpu": (2, 4), "default": (2, 4)})
    torch.manual_seed(B)
    model = Blocks().double()
    x = torch.randn(B, 4, 8, dtype=torch.float64)
    y = torch.randn(B, dtype=torch.float64)
    R = 0.05
    got = _release(model, x, y, mode, R, style, True, monkeypatch)
    alone = _release(model, x, y, mode, R, style, False, monkeypatch)
    want = ({n: torch.zeros_like(p) for n, p in model.named_parameters()} if B == 0 else  # (nothing to clip)
            oracle_release(model, _per_sample, [(x, y)], style=style, R=R, batch_size=B))
    for n, w in want.items():
        assert torch.allclose(got[n], alone[n], rtol=1e-12, atol=1e-15), n
        assert float((got[n] - w).norm()) <= 1e-6 * float(w.norm()), n
