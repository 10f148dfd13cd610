"""The structure probe takes back broadcast expansions that lose the batch dimension (fastdp/probe.py), vs the oracle.

A layer output of leading size 1 is taken as one value for the whole batch and expanded to ``(B, ...)``. Two models
for which that is false used to be refused by a shape error from inside torch that named nothing: ``x.chunk(2)`` of
an odd batch (the last chunk is ONE sample; expanded, the model got ``B + 1`` rows) and ``torch.cat`` along dim 0 of
a broadcast position embedding with the batch (``2B - 1`` rows). The probe now sees that no output of the model has
leading size ``B`` after its expansions, and its fallback replays the expanded modules' parameters from an ancestor
(the forward untouched). Likewise layers that saw a part of the batch (the chunks of an even batch, 2 rows each of
4). Exact in every clipping mode, at B = 3 (chunks 2 + 1), 4 (2 + 2) and 5 (3 + 2) alike (the judge of
tests/layout_oracle.py: float64 brute-force oracle, 1e-6). A model that couples samples through such a concatenation
is refused by a :class:`fastdp.StructureError` that names the expanded module, why, and the fix, before anything is
released.
"""

from __future__ import annotations

import pytest
import torch
from layout_oracle import assert_exact_or_refused
from oracle import MODES, make_engine, mse_per_sample
from test_layout_fuzz import _case
from torch import nn

from fastdp import StructureError

D = torch.float64


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout,relation", [("chunk:batch", "distinct"), ("chunk:batch", "T==1"),
                                             ("chunk:batch", "B==d"), ("chunk:batch", "B==T"),
                                             ("pos:cat0", "distinct"), ("pos:cat0", "B==T")])
def test_expansion_taken_back_exact(layout, relation, mode):
    model, batches, reduction, bs = _case(layout, relation)
    assert assert_exact_or_refused(model, mse_per_sample, batches, reduction=reduction, batch_size=bs,
                                   mode=mode, expect="exact") == "exact"


def test_fallback_is_logged_and_kept(caplog):
    """The fallback is visible: a warning naming the modules and their new owner, and ``engine._extra_owned``."""
    model, batches, reduction, bs = _case("pos:cat0", "distinct")
    engine = make_engine(model, batch_size=bs)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    (x, y), = batches
    with caplog.at_level("WARNING", logger="fastdp.probe"):
        mse_per_sample(model(x), y).mean().backward()
    assert "pe" in caplog.text and "<root>" in caplog.text
    assert engine._extra_owned == {"": ("pe.weight",)}
    engine.detach()


class CatCouple(nn.Module):
    """ids (B, T) -> token embedding; the (1, T, d) position embedding concatenated before the batch along dim 0; every
    row gets the position row AND the batch mean (couples samples: no per-sample gradient exists)."""

    def __init__(self, V=11, T=5, d=6, C=7):
        super().__init__()
        self.tok, self.pe = nn.Embedding(V, d), nn.Embedding(T + 2, d)
        self.mid, self.out = nn.Linear(d, d), nn.Linear(d, C)

    def forward(self, ids):
        pos = self.pe(torch.arange(ids.shape[1])[None])
        z = torch.cat([pos, self.tok(ids)], 0)
        h = z[1:] + z[:1] + z[1:].mean(0, keepdim=True)
        return self.out(torch.tanh(self.mid(h)))


def test_refusal_names_the_expanded_module():
    torch.manual_seed(0)
    model = CatCouple().to(D)
    engine = make_engine(model, batch_size=3)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, y = torch.randint(0, 11, (3, 5)), torch.randn(3, 5, 7, dtype=D)
    with pytest.raises(StructureError) as ei:
        mse_per_sample(model(ids), y).mean().backward()
        opt.step()
    msg = str(ei.value)
    assert "'pe'" in msg and "pe.weight" in msg  # the module and its parameter
    assert "expanded their outputs of leading size 1" in msg and "did not pass either" in msg  # what it saw, tried
    assert "Fix:" in msg
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert engine._extra_owned == {}  # the fallback's owners were restored
    engine.detach()


class Scale(nn.Module):
    """A generic owner (a raw parameter)."""

    def __init__(self, d):
        super().__init__()
        self.s = nn.Parameter(torch.randn(d))

    def forward(self, h):
        return h * self.s


class ChunkedOwner(nn.Module):
    """The batch split by ``chunk(2)`` and each half through a generic owner."""

    def __init__(self, d=6, C=7):
        super().__init__()
        self.inp, self.scale, self.out = nn.Linear(d, d), Scale(d), nn.Linear(d, C)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(torch.cat([torch.tanh(self.scale(p)) for p in h.chunk(2)]))


@pytest.mark.parametrize("B", [3, 4])
def test_generic_owner_on_a_part_of_the_batch_refused(B):
    """A generic owner called on a part of the batch has outputs without a batch dimension: refused at every B >= 2
    (its 2-row half comes first), naming the owner, before anything is released."""
    torch.manual_seed(0)
    model = ChunkedOwner().to(D)
    x, y = torch.randn(B, 5, 6, dtype=D), torch.randn(B, 5, 7, dtype=D)
    assert assert_exact_or_refused(model, mse_per_sample, [((x,), y)], batch_size=B, expect="refused") == "refused"
    engine = make_engine(ChunkedOwner().to(D), batch_size=B)
    engine.attach(torch.optim.SGD(engine.model.parameters(), lr=1.0))
    with pytest.raises(RuntimeError, match="'scale'"):
        mse_per_sample(engine.model(x), y).mean().backward()


class ScalarLoss(nn.Module):
    """HF-style (1, T) position embedding added to the tokens (expanded by the engine), and the loss computed inside
    the model: ``forward(ids, y)`` returns the SUM of the per-sample losses, a scalar (no output of leading size B)."""

    def __init__(self, V=11, T=5, d=6, C=7):
        super().__init__()
        self.tok, self.pe = nn.Embedding(V, d), nn.Embedding(T + 2, d)
        self.mid, self.out = nn.Linear(d, d), nn.Linear(d, C)

    def forward(self, ids, y):
        h = self.tok(ids) + self.pe(torch.arange(ids.shape[1])[None])
        return mse_per_sample(self.out(torch.tanh(self.mid(h))), y).sum()


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost"])
def test_scalar_output_with_expansion_not_taken_for_lost_batch(mode):
    """No output of leading size B after an expansion is a lost batch only if the model has per-sample outputs (on a
    batch of one): a model returning a scalar loss has nothing to verify, and stays exact (as before)."""
    from model_oracle import check_engine

    torch.manual_seed(0)
    model = ScalarLoss().to(D)
    g = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 11, (3, 5), generator=g), torch.randn(3, 5, 7, generator=g, dtype=D)
    check_engine(model, lambda out, _: out.reshape(1), [((ids, y), y)], mode=mode, reduction="sum", batch_size=3)
