"""Sizes never decide which inputs of a generic owner are per sample (fastdp/layers/layout.py), against the oracle.

A generic owner (a module with raw parameters, replayed per sample by ``torch.func``) that receives a tensor shared
by the batch -- a ``(T, T)`` relative-position table, a ``(K, d)`` memory bank -- used to take it for a batched one
when its leading size equalled the batch size (HF Funnel at ``B == T``): the replay check then refused the step, so
a run stopped at the first batch of that size. The structure probe now learns each owner call's layout from its
batch-of-one pass (a tensor of the same shape on the batch and on one sample is shared), and the engine reuses it for
every call with the same input signature. Every test compares with the brute-force oracle (float64, one backward per
sample, clip, sum; 1e-6 relative) at ``B`` equal to and different from the coinciding size, and ``B = 1``.
"""

from __future__ import annotations

import pytest
import torch
from model_oracle import LABELS, ClsWrap, V, check_engine, cls_batches, cls_loss
from oracle import make_engine, mse_per_sample
from torch import nn

from fastdp.layers import layout

D = torch.float64
T, DIM, C, K = 6, 4, 3, 5  # K: rows of the memory bank (in no input shape)


class RelMix(nn.Module):
    """A generic owner: attention of ``h`` (B, T, d) over itself with a shared additive (T, T) table, and over a
    shared (K, d) memory bank; raw parameters only. Optionally also returns the (T, d) position term it computes
    (an output without a batch dimension)."""

    def __init__(self, d: int, emit_table: bool = False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) * 0.4)
        self.v = nn.Parameter(torch.randn(d, d) * 0.4)
        self.u = nn.Parameter(torch.randn(d) * 0.3)
        self.emit_table = emit_table

    def forward(self, h, table, bank):
        scores = h @ self.w @ h.transpose(1, 2) + table  # (B, T, T) + (T, T)
        a = torch.softmax(scores, -1) @ h
        m = torch.softmax(h @ self.v @ bank.t(), -1) @ bank  # (B, T, K) @ (K, d)
        out = a + m + self.u
        if self.emit_table:
            return out, table[:, :1] * self.u  # (T, d): no batch dimension
        return out


class SharedTables(nn.Module):
    """x (B, T, d) -> Linear -> RelMix(h, (T, T) table built from arange(T), (K, d) bank buffer) -> Linear (B, T, C)."""

    def __init__(self, emit_table: bool = False):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.rel = RelMix(DIM, emit_table)
        self.out = nn.Linear(DIM, C)
        self.register_buffer("bank", torch.randn(K, DIM))

    def forward(self, x):
        n = x.shape[1]
        pos = torch.arange(n, dtype=x.dtype, device=x.device)
        table = -(pos[:, None] - pos[None, :]).abs() / n
        h = torch.tanh(self.inp(x))
        r = self.rel(h, table, self.bank)
        if isinstance(r, tuple):
            r = r[0] + r[1]
        return self.out(torch.tanh(r))


def _model(seed=0, emit_table=False):
    torch.manual_seed(seed)
    return SharedTables(emit_table).to(D)


def _batches(sizes, seed=1, t=T):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(n, t, DIM, generator=g, dtype=D),), torch.randn(n, t, C, generator=g, dtype=D))
            for n in sizes]


MODES = ("BK-MixOpt", "BK-ghost", "instantiate")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B", [3, T, K, 1], ids=["B=3", "B==T", "B==K", "B=1"])
def test_shared_tables_exact_at_every_batch_size(B, mode):
    """The (T, T) table and the (K, d) bank are shared whatever B is: exact at B == T (a new input signature, probed)
    and at B == K (the same signature as B = 3: no input dimension equals K)."""
    check_engine(_model(), mse_per_sample, _batches([B]), mode=mode)


@pytest.mark.parametrize("first", [3, K], ids=["B=3-then-B==K", "B==K-then-B=3"])
def test_learned_layout_reused_across_batch_sizes(first):
    """Two backward passes in one logical step (Poisson-style sizes) with the same input signature: the layout
    learned at the first is used at the second (B == K there, or before), exact either way."""
    other = K if first == 3 else 3
    model = _model()
    check_engine(model, mse_per_sample, _batches([first, other]), mode="BK-MixOpt", reduction="sum")


def test_learned_layout_recorded_per_signature():
    """The engine keeps one learned table per input signature; the owner's table input is in it as shared."""
    model = _model()
    engine = make_engine(model, batch_size=T)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    for n in (3, T):
        (x,), y = _batches([n])[0]
        mse_per_sample(model(x), y).mean().backward()
    tables = engine._capture.owner_layouts.by_signature
    assert len(tables) == 2  # B = 3 and B == T are two signatures
    for table in tables.values():
        (lay,) = [v for (mid, _), v in table.items() if mid == id(model.rel)]
        # (h, table, bank) -> flat indices 0, 1, 2: h per sample, table and bank shared
        assert lay.shared_in == frozenset({1, 2}), lay
    engine.detach()


def test_without_the_probe_sizes_still_decide():
    """With verify_structure=False nothing is learned: at B == T the size rule takes the (T, T) table for a batched
    input and the replay check refuses the step, naming the owner (the failure the probe's layout fixes); B = 3 is
    exact."""
    check_engine(_model(), mse_per_sample, _batches([3]), mode="BK-MixOpt", verify_structure=False)
    with pytest.raises(RuntimeError, match="'rel'"):
        check_engine(_model(), mse_per_sample, _batches([T]), mode="BK-MixOpt", verify_structure=False)


@pytest.mark.parametrize("B", [3, T], ids=["B=3", "B==T"])
def test_output_without_batch_dimension_refused_at_every_batch_size(B):
    """An owner output of shape (T, d) that receives a gradient cannot be attributed to samples: refused naming the
    owner at B != T (no batch dimension) and at B == T (learned: same shape on a batch of one), never released."""
    model = _model(emit_table=True)
    engine = make_engine(model, batch_size=B)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    (x,), y = _batches([B])[0]
    with pytest.raises(RuntimeError, match="rel") as ei:
        mse_per_sample(model(x), y).mean().backward()
        opt.step()
    assert "batch dimension" in str(ei.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# --------------------------------------------------------------------------- HF Funnel


# Funnel masks its attention scores with ``INF * (1 - mask.float())`` (INF = 1e6): scores of size 1e6 leave rounding
# of ~6e-10 in the (mathematically zero) key-bias gradients and in a few small entries of a float64 model, at any
# batch size; gradient entries are ~1e-3, so an absolute tolerance of 1e-8 still checks them to ~1e-5.
FUNNEL_ATOL = 1e-8


def funnel():
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.FunnelConfig(vocab_size=V, block_sizes=[1, 1], num_decoder_layers=1, d_model=16, n_head=2,
                                    d_head=8, d_inner=24, hidden_dropout=0.0, attention_dropout=0.0,
                                    activation_dropout=0.0, num_labels=LABELS)
    torch.manual_seed(0)
    return ClsWrap(transformers.FunnelForSequenceClassification(cfg)).to(D)


@pytest.mark.parametrize("B", [3, 6], ids=["B=3", "B==T"])
def test_funnel_exact_at_b_eq_t(B):
    """HF Funnel's relative attention (a generic owner) receives (T, T) masks and position tables; exact at B == T
    (6 samples of 6 tokens, padded) as at B = 3."""
    check_engine(funnel(), cls_loss, cls_batches([B], 0, pad_id=0), mode="BK-MixOpt", atol=FUNNEL_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["BK-MixGhostClip", "BK-ghost", "ghost", "instantiate"])
def test_funnel_exact_at_b_eq_t_modes(mode):
    check_engine(funnel(), cls_loss, cls_batches([6], 0, pad_id=0), mode=mode, atol=FUNNEL_ATOL)


# --------------------------------------------------------------------------- the learning rule itself


def test_learn_rule():
    """Same shape on the batch and on a batch of one: shared; a changed shape: per sample (whatever the dimension:
    an RNN state (layers, B, H) is per sample); probe samples that disagree, or another tree structure: nothing
    learned (size rule); a batch of one teaches nothing."""
    spec_in, shapes_b = layout.shapes(((torch.zeros(4, 6, 2), torch.zeros(4, 4), torch.zeros(2, 4, 3)), {}))
    _, shapes_1 = layout.shapes(((torch.zeros(1, 6, 2), torch.zeros(4, 4), torch.zeros(2, 1, 3)), {}))
    batch = {(7, 0): layout.CallShapes(spec_in, shapes_b, "", {0: (4, 6, 2), 1: (4, 2)})}
    ref = {(7, 0): layout.CallShapes(spec_in, shapes_1, "s", {0: (1, 6, 2), 1: (4, 2)})}
    got = layout.learn([ref, ref], batch, 4)
    assert got[(7, 0)].shared_in == frozenset({1}) and got[(7, 0)].shared_out == frozenset({1})
    other = {(7, 0): layout.CallShapes(spec_in, shapes_1[:2] + [(2, 2, 3)], "s", ref[(7, 0)].shapes_out)}
    assert layout.learn([ref, other], batch, 4) == {}
    spec2, _ = layout.shapes(((torch.zeros(1),), {}))
    assert layout.learn([{(7, 0): layout.CallShapes(spec2, [(1,)], "s", {})}], batch, 4) == {}
    assert layout.learn([ref], batch, 1) == {}


class PosTable(nn.Module):
    """A generic owner whose only output has no batch dimension: rows ``0..T-1`` of a raw table, (T, d) (the BART /
    Blenderbot learned positions called with ``arange(T)``)."""

    def __init__(self, n: int, d: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(n, d) * 0.3)

    def forward(self, positions):
        return self.table[positions]


class WithPosTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.pos = PosTable(T + 2, DIM)
        self.out = nn.Linear(DIM, C)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x) + self.pos(torch.arange(x.shape[1]))))


@pytest.mark.parametrize("B", [3, T], ids=["B=3", "B==T"])
def test_owner_without_batched_output_refused_at_every_batch_size(B):
    """Its (T, d) output has no batch dimension: refused naming the owner at B != T (at its forward) and at B == T
    (the probe: the same shape on a batch of one), never released; at B == T the size rule alone (probe off) would
    take the table's rows for samples."""
    torch.manual_seed(0)
    model = WithPosTable().to(D)
    engine = make_engine(model, batch_size=B)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    (x,), y = _batches([B])[0]
    with pytest.raises(RuntimeError, match="'pos'") as ei:
        mse_per_sample(model(x), y).mean().backward()
        opt.step()
    assert "batch dimension" in str(ei.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
