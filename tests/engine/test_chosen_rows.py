"""Rows chosen by the data (``h[mask]``, ``index_select``, a scatter back into the padded layout) reaching a layer
that takes row ``i`` as sample ``i``'s: the engine follows which sample owns each row at every call
(``fastdp.layers.row_owners``) and accepts the call only when its rows are the samples' in order.

The structure probe verifies one batch per input signature. A mask that picks one token per sample in that batch
and, in a later batch of the same shapes, two tokens of one sample and none of another (still ``B`` rows) was
released silently before, 17 % off the oracle: here it is refused, naming the rows each sample owns. Every accepted
step is checked against its own brute-force oracle (one backward per sample, float64, 1e-6 relative), in every
clipping mode, and a Hypothesis test draws masks at random over several steps: each step is exact or refused,
never released wrong.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_oracle import mse_loss, synced_copy
from oracle import MODES, call_model, choose_R, clipped_sum, make_engine, make_groups, per_sample_grads, user_loss
from torch import nn

D = torch.float64
V, T, DIM, B = 11, 4, 5, 3


class PickRows(nn.Module):
    """``h[mask]`` through a Linear (its ``N`` rows taken as the batch's when ``N = B``), then written back into
    ``(B, d)`` by each row's sample, then a head. ``back``: how the rows are written back."""

    def __init__(self, back: str = "index_add", frozen_fc: bool = False):
        super().__init__()
        self.emb = nn.Embedding(V, DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 2)
        self.back = back
        self.fc.requires_grad_(not frozen_fc)

    def forward(self, ids, mask):
        h = self.emb(ids)
        m = mask.bool()
        f = torch.tanh(self.fc(h[m]))  # (N, d)
        rows = m.nonzero()[:, 0]
        n = ids.shape[0]
        if self.back == "index_add":
            pooled = torch.zeros(n, DIM, dtype=f.dtype).index_add(0, rows, f)
        elif self.back == "masked_scatter":
            pooled = torch.zeros_like(h).masked_scatter(m.unsqueeze(-1), f).sum(1)
        elif self.back == "setitem":
            buf = torch.zeros_like(h)
            buf[m] = f
            pooled = buf.sum(1)
        elif self.back == "by position":  # row j of f written into row j % B: right only for one row per sample
            pooled = torch.zeros(n, DIM, dtype=f.dtype).index_add(0, torch.arange(f.shape[0]) % n, f)
        else:
            raise ValueError(self.back)
        return self.head(pooled)


class EosHead(nn.Module):
    """BART's classification head: the hidden states at the end-of-sequence tokens, ``h[eos].view(B, -1, d)[:, -1]``
    (every sample must have the same number of them: a model that does not check it is refused when they differ)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, DIM)
        self.enc = nn.Linear(DIM, DIM)
        self.dense = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, 2)

    def forward(self, ids, mask):
        h = torch.tanh(self.enc(self.emb(ids)))
        rep = h[mask.bool(), :].view(h.shape[0], -1, DIM)[:, -1, :]
        return self.out(torch.tanh(self.dense(rep)))


def _batch(counts, g, ends=False):
    """Token ids ``(len(counts), T)`` and a mask with ``counts[i]`` ones in row ``i`` (its first positions, or its
    last ones with ``ends``)."""
    m = torch.zeros(len(counts), T, dtype=torch.long)
    for i, c in enumerate(counts):
        if c and ends:
            m[i, T - c:] = 1
        elif c:
            m[i, :c] = 1
    return ((torch.randint(0, V, (len(counts), T), generator=g), m), torch.randn(len(counts), 2, dtype=D, generator=g))


def _run(model, steps, *, mode="BK-MixOpt", refused=()):
    """One engine over ``steps`` (each a list of physical batches), σ = 0. A step in ``refused`` (its index) must be
    refused at the forward call with the rows each sample owns named, releasing nothing; every other step must
    equal its own oracle (a float64 copy at the model's current weights: batches of one, clipped, summed)."""
    template = copy.deepcopy(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    first = next(i for i in range(len(steps)) if i not in refused)
    om = synced_copy(template, model)
    R = choose_R(per_sample_grads(om, mse_loss, steps[first], names), make_groups(om, "all-layer", names), "middle")
    engine = make_engine(model, batch_size=B, R=R, fn="abadi", style="all-layer", mode=mode, reduction="mean")
    params = dict(model.named_parameters())
    opt = torch.optim.SGD([params[n] for n in names], lr=0.05)
    engine.attach(opt)
    outcomes = []
    for s, batches in enumerate(steps):
        opt.zero_grad(set_to_none=True)
        if s in refused:
            with pytest.raises(RuntimeError, match=r"rows were chosen by the data .* and its \d+ rows belong to "
                                                   r"samples with \[") as info:
                for x, y in batches:
                    user_loss(mse_loss(call_model(model, x), y), "mean").backward()
            assert all(params[n].grad is None for n in names)
            outcomes.append(str(info.value))
            continue
        om = synced_copy(template, model)
        want = clipped_sum(per_sample_grads(om, mse_loss, batches, names), make_groups(om, "all-layer", names),
                           "abadi", R, B)
        for x, y in batches:
            user_loss(mse_loss(call_model(model, x), y), "mean").backward()
        opt.step()
        for n in names:
            torch.testing.assert_close(params[n].grad, want[n], rtol=1e-6, atol=1e-10)
        outcomes.append("exact")
    return outcomes


@pytest.mark.parametrize("mode", MODES)
def test_b_rows_chosen_one_per_sample_then_unequal_is_refused(mode):
    """The probe's batch: one token per sample (its rows are the samples', exact). A later batch: counts 2, 0, 1,
    ``B`` rows again, each not its sample's: refused naming the counts (it was released 17 % off the oracle). Then
    one per sample again: exact."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    steps = [[_batch([1, 1, 1], g)], [_batch([2, 0, 1], g)], [_batch([1, 1, 1], g)]]
    outcomes = _run(PickRows().to(D), steps, mode=mode, refused={1})
    assert outcomes[0] == outcomes[2] == "exact"
    assert "module 'fc' (Linear)" in outcomes[1] and "[2, 0, 1] rows each, not 1 each in order" in outcomes[1]


@pytest.mark.parametrize("back", ["index_add", "masked_scatter", "setitem"])
def test_rows_written_back_to_their_samples_are_natural_again(back):
    """Through a frozen ``fc``, unequal counts per sample are fine: written back by each row's sample (a scatter
    whose rows the guard checks), the head's input is the batch's rows again; exact at every step."""
    torch.manual_seed(2)
    g = torch.Generator().manual_seed(3)
    steps = [[_batch(c, g)] for c in ([1, 2, 0], [4, 0, 3], [1, 1, 1])]
    assert _run(PickRows(back, frozen_fc=True).to(D), steps) == ["exact"] * 3


def test_rows_written_back_to_other_samples_are_refused():
    """Written back by position (row ``j`` into row ``j % B``): right while each sample has one row (the probe's
    batch, exact), wrong for counts 2, 1, 0. The head's rows are then not known to be its samples': refused,
    although ``fc`` is frozen and the rows it saw are never checked."""
    torch.manual_seed(4)
    g = torch.Generator().manual_seed(5)
    steps = [[_batch([1, 1, 1], g)], [_batch([2, 1, 0], g)]]
    with pytest.raises(RuntimeError, match=r"module 'head' \(Linear\) takes row i .* was lost on the way"):
        _run(PickRows("by position", frozen_fc=True).to(D), steps)


@pytest.mark.parametrize("mode", MODES)
def test_bart_style_end_of_sequence_head(mode):
    """``h[eos].view(B, -1, d)[:, -1]``: exact when every sample has the same number of end tokens (two, then
    one); refused when they differ (3, 2, 1: six rows, grouped two per sample, the second group holding rows of
    samples 0 and 1)."""
    torch.manual_seed(6)
    g = torch.Generator().manual_seed(7)
    steps = [[_batch([2, 2, 2], g, ends=True)], [_batch([1, 1, 1], g, ends=True)], [_batch([3, 2, 1], g, ends=True)]]
    model = EosHead().to(D)
    with pytest.raises(RuntimeError, match=r"module 'dense' \(Linear\) takes row i .* was lost on the way"):
        _run(model, steps, mode=mode)
    torch.manual_seed(6)
    assert _run(EosHead().to(D), steps[:2], mode=mode) == ["exact"] * 2


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, T), min_size=B, max_size=B), min_size=2, max_size=4),
       st.sampled_from(["index_add", "masked_scatter", "setitem"]))
def test_random_masks_are_exact_or_refused(counts, back):
    """Random per-sample counts over several steps: a released step equals its oracle; a refused one names the
    rows. Never released wrong. Released: each sample owning the same number of rows in order (one each, or ``k``
    each, a fold the probe saw), or any counts once the probe's engine pass was refused for its batch and fell back
    to replaying the whole model per sample (a batch of one chosen row is a broadcast output for the probe)."""
    torch.manual_seed(8)
    g = torch.Generator().manual_seed(9)
    steps = [[_batch(c, g)] for c in counts]
    model = PickRows(back).to(D)
    template = copy.deepcopy(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    engine = make_engine(model, batch_size=B, R=1.0, fn="abadi", style="all-layer", mode="BK-MixOpt",
                         reduction="mean")
    params = dict(model.named_parameters())
    opt = torch.optim.SGD([params[n] for n in names], lr=0.05)
    engine.attach(opt)
    for c, batches in zip(counts, steps, strict=True):
        opt.zero_grad(set_to_none=True)
        (x, y), = batches
        try:
            user_loss(mse_loss(model(*x), y), "mean").backward()
        except RuntimeError:  # at the forward call (the guard, or the probe on its batch), or in the backward pass
            assert c != [1] * B, c  # one row per sample, in order: never refused
            continue
        om = synced_copy(template, model)
        want = clipped_sum(per_sample_grads(om, mse_loss, batches, names), make_groups(om, "all-layer", names),
                           "abadi", 1.0, B)
        opt.step()
        for n in names:
            torch.testing.assert_close(params[n].grad, want[n], rtol=1e-6, atol=1e-10)
