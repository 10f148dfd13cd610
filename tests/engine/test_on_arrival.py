"""Instantiation on arrival (fastdp.norms.instantiate_on_arrival), the default mode's memory/time refinement.

When no trainable parameter of a layer call gets the ghost norm, the default mode computes its per-sample gradients
as the output gradient arrives and drops the kept input and output gradient. These tests check that the path is
taken exactly where the cost model says (and never in modes that need the kept tensors), that its releases equal
the batch-of-one oracle in float64, and the cases that touch it: a weight used by two calls, virtual batches,
non-finite samples, the empty batch and batch size 1.
"""

from __future__ import annotations

import pytest
import torch
from oracle import assert_grads_close, ce_per_sample, oracle_release, run_engine_once
from torch import nn

from fastdp import capture as capture_mod
from fastdp import clipped_sums, norms
from fastdp.layers import kind_for
from fastdp.modes import CLIPPING_MODES, get_mode

MODES = list(CLIPPING_MODES)


class Seq(nn.Module):
    """Per-position classifier on (B, T, d) with a LayerNorm; ``twice`` applies ``fc2`` twice (a weight used by two
    calls)."""

    def __init__(self, d: int, h: int, classes: int = 3, twice: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.ln = nn.LayerNorm(h)
        self.fc2 = nn.Linear(h, h)
        self.head = nn.Linear(h, classes)
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc2(torch.tanh(self.ln(self.fc1(x))))
        if self.twice:
            z = self.fc2(torch.tanh(z))
        return self.head(z)  # (B, T, classes)


@pytest.fixture
def arrivals(monkeypatch):
    """Count the calls of instantiate_on_arrival that instantiated (True) and that did not (False)."""
    counts = {True: 0, False: 0}
    real = norms.instantiate_on_arrival

    def counting(rec, mode):
        done = real(rec, mode)
        counts[done] += 1
        return done

    monkeypatch.setattr(capture_mod, "instantiate_on_arrival", counting)
    return counts


def _data(B: int, T: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (B, T), generator=g)
    return x, y


def _model(d: int, h: int, twice: bool = False) -> nn.Module:
    torch.manual_seed(1)
    return Seq(d, h, twice=twice).double()


def _check(model, batches, B, mode, fn="abadi", R=0.05, **kw):
    kw.setdefault("verify_structure", False)  # the structure probe's own passes would add arrivals
    want = oracle_release(model, ce_per_sample, batches, fn=fn, R=R, batch_size=B)
    _, _, got = run_engine_once(model, ce_per_sample, batches, batch_size=B, R=R, fn=fn, style="all-layer",
                                mode=mode, reduction="mean", **kw)
    assert_grads_close(got, want)
    return want


@pytest.mark.parametrize("R", [0.05, 1e3])  # every sample clipped / none (then a wrong scale cannot cancel)
@pytest.mark.parametrize("mode", MODES)
def test_long_sequences_instantiate_on_arrival_exactly(mode, R, arrivals):
    # T = 12, d = h = 6: p d = 36 <= T (p + d) = 144, so every layer's per-sample gradient fits
    model = _model(6, 6)
    B = 5
    _check(model, [_data(B, 12, 6)], B, mode, R=R)
    if mode in ("BK-MixOpt", "instantiate"):
        assert arrivals[True] == 4 and arrivals[False] == 0  # fc1, ln, fc2, head
    else:
        assert arrivals[True] == 0


def test_short_sequences_keep_the_ghost_norm(arrivals):
    # T = 2, d = h = 16: p d = 256 > T (p + d) = 64 and 2 T^2 < p d: fc2 takes the ghost norm, nothing is dropped
    model = _model(16, 16)
    B = 4
    _check(model, [_data(B, 2, 16)], B, "BK-MixOpt")
    assert arrivals[True] >= 1  # the LayerNorm (no ghost norm) and the (B, T, 3) head still instantiate
    assert arrivals[False] >= 1  # fc1 / fc2 keep their tensors for the book-keeping contraction


def test_cost_model_of_the_default_mode():
    lin = nn.Linear(8, 8)
    kind = kind_for(lin)
    a16, g16 = torch.zeros(2, 1, 16, 8), torch.zeros(2, 1, 16, 8)  # T 16: 64 <= 256: instantiate
    a2, g2 = torch.zeros(2, 1, 2, 8), torch.zeros(2, 1, 2, 8)  # T 2: 2*4 < 64 and 64 > 32: ghost
    assert not norms.use_ghost(kind, lin, (a16, g16), "weight", get_mode("BK-MixOpt"))
    assert norms.use_ghost(kind, lin, (a2, g2), "weight", get_mode("BK-MixOpt"))
    # BK-MixGhostClip keeps the paper's rule only (2 T^2 < p d), and the ghost modes always use the ghost norm
    a5, g5 = torch.zeros(2, 1, 5, 8), torch.zeros(2, 1, 5, 8)  # T 5: 50 < 64 (ghost by 2T^2), 64 <= 80 (fits)
    assert norms.use_ghost(kind, lin, (a5, g5), "weight", get_mode("BK-MixGhostClip"))
    assert not norms.use_ghost(kind, lin, (a5, g5), "weight", get_mode("BK-MixOpt"))
    assert norms.use_ghost(kind, lin, (a16, g16), "weight", get_mode("BK-ghost"))
    assert not norms.use_ghost(kind, lin, (a2, g2), "weight", get_mode("instantiate"))
    assert not norms.use_ghost(kind, lin, (a2, g2), "bias", get_mode("BK-MixOpt"))


@pytest.mark.parametrize("mode", ["BK-MixOpt", "instantiate"])
def test_weight_used_by_two_calls(mode, arrivals):
    model = _model(6, 6, twice=True)
    B = 4
    _check(model, [_data(B, 12, 6)], B, mode)
    assert arrivals[True] == 5  # fc2's two calls both instantiated; their per-sample sum gives the norm


def test_virtual_batches_and_batch_of_one(arrivals):
    model = _model(6, 6)
    _check(model, [_data(3, 12, 6, seed=1), _data(1, 12, 6, seed=2), _data(2, 12, 6, seed=3)], 6, "BK-MixOpt")
    assert arrivals[True] == 12


def test_empty_batch_releases_noise_only(arrivals):
    model = _model(6, 6)
    x, y = _data(0, 12, 6)
    _, _, got = run_engine_once(model, ce_per_sample, [(x, y)], batch_size=4, R=1.0, fn="abadi",
                                style="all-layer", mode="BK-MixOpt", reduction="mean", sigma=0.0)
    assert all(float(g.abs().max()) == 0.0 for g in got.values())


def test_nonfinite_sample_zeroed_on_the_arrival_path(arrivals):
    model = _model(6, 6)
    B = 5
    x, y = _data(B, 12, 6)
    x_bad = x.clone()
    x_bad[2, 3, 1] = float("nan")
    good = [i for i in range(B) if i != 2]
    want = oracle_release(model, ce_per_sample, [(x[good], y[good])], fn="abadi", R=0.05, batch_size=B)
    engine, _, got = run_engine_once(model, ce_per_sample, [(x_bad, y)], batch_size=B, R=0.05, fn="abadi",
                                     style="all-layer", mode="BK-MixOpt", reduction="mean",
                                     on_nonfinite="zero", verify_structure=False)
    assert arrivals[True] == 4 and engine.nonfinite_samples == 1
    assert_grads_close(got, want)


def test_nonfinite_sample_raises_by_default(arrivals):
    model = _model(6, 6)
    x, y = _data(4, 12, 6)
    x[1, 0, 0] = float("inf")
    with pytest.raises(clipped_sums.NonFiniteGradientError, match=r"\[1\]"):
        run_engine_once(model, ce_per_sample, [(x, y)], batch_size=4, R=0.05, fn="abadi", style="all-layer",
                        mode="BK-MixOpt", reduction="mean", verify_structure=False)


def test_clipping_matters_here():
    """The oracle comparisons above are not vacuous: at R = 0.05 clipping changes the release a lot."""
    model = _model(6, 6)
    batches = [_data(5, 12, 6)]
    clipped = oracle_release(model, ce_per_sample, batches, fn="abadi", R=0.05, batch_size=5)
    loose = oracle_release(model, ce_per_sample, batches, fn="abadi", R=1e6, batch_size=5)
    diff = max(float((clipped[n] - loose[n]).abs().max()) for n in clipped)
    assert diff > 1e-3


class TiedLM(nn.Module):
    """Embedding -> Linear -> LM head tied to the embedding (GPT-2's layout, in small)."""

    def __init__(self, vocab: int = 5, d: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(self.emb(ids))))


@pytest.mark.parametrize("R", [0.05, 1e3])
def test_tied_weights_keep_their_tensors_for_the_cross_terms(R, arrivals):
    torch.manual_seed(2)
    model = TiedLM().double()
    g = torch.Generator().manual_seed(3)
    B, T = 4, 12
    ids = torch.randint(0, 5, (B, T), generator=g)
    y = torch.randint(0, 5, (B, T), generator=g)
    _check(model, [(ids, y)], B, "BK-MixOpt", R=R)
    # the head and the embedding hold the tied weight: no on-arrival call for them; fc instantiates on arrival
    assert arrivals[True] == 1 and arrivals[False] == 0
