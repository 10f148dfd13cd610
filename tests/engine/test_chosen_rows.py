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


# --------------------------------------------------------------------------- a red-team pass's cases (2026-11-27)


def _outcomes(model, counts_list, *, mode="BK-MixOpt"):
    """One engine over one batch per entry of ``counts_list``: each step is "exact" (equal to its own oracle, checked
    here) or "refused" (a RuntimeError at its forward or backward pass, nothing released). Never released wrong."""
    g = torch.Generator().manual_seed(11)
    steps = [[_batch(c, g)] for c in counts_list]
    template = copy.deepcopy(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    engine = make_engine(model, batch_size=B, R=1.0, fn="abadi", style="all-layer", mode=mode, reduction="mean")
    params = dict(model.named_parameters())
    opt = torch.optim.SGD([params[n] for n in names], lr=0.05)
    engine.attach(opt)
    out = []
    for batches in steps:
        opt.zero_grad(set_to_none=True)
        (x, y), = batches
        om = synced_copy(template, model)
        want = clipped_sum(per_sample_grads(om, mse_loss, batches, names), make_groups(om, "all-layer", names),
                           "abadi", 1.0, B)
        try:
            user_loss(mse_loss(model(*x), y), "mean").backward()
        except RuntimeError:
            out.append("refused")
            continue
        opt.step()
        for n in names:
            torch.testing.assert_close(params[n].grad, want[n], rtol=1e-6, atol=1e-10)
        out.append("exact")
    return out


def _choose(name, h, m):
    """``h`` (B, T, d), ``m`` (B, T) bool: the real tokens' rows, in the order of ``h[m]``, chosen in other ways."""
    n = h.shape[0]
    flat, idx = h.reshape(-1, DIM), m.reshape(-1).nonzero().squeeze(1)
    if name == "h[None, m].squeeze(0)":
        return h[None, m].squeeze(0)
    if name == "h[..., m, :]":
        return h[..., m, :]
    if name == "one_hot(idx) @ flat":
        return torch.nn.functional.one_hot(idx, n * T).to(h.dtype) @ flat
    if name == "einsum one-hot":
        return torch.einsum("nr,rd->nd", torch.nn.functional.one_hot(idx, n * T).to(h.dtype), flat)
    if name == "embedding_bag":
        return torch.nn.functional.embedding_bag(idx[:, None], flat, mode="sum")
    if name == "vstack of parts":  # (an order read on the host)
        return torch.vstack([h[i, j] for i, j in m.nonzero().tolist()]) if bool(m.any()) else flat[:0]
    if name == "h[m.nonzero(as_tuple=True)]":
        return h[m.nonzero(as_tuple=True)]
    if name == "h[torch.where(m)]":
        return h[torch.where(m)]
    if name == "h[m.byte()]":
        return h[m.byte()]
    raise ValueError(name)


class Chooser(nn.Module):
    """``fc`` (called with its input by keyword: ``fc(input=...)`` with ``kw``) on rows chosen by ``_choose``,
    written back into ``(B, d)`` by each row's sample."""

    def __init__(self, name, kw=False):
        super().__init__()
        self.emb, self.fc, self.name, self.kw = nn.Embedding(V, DIM), nn.Linear(DIM, DIM), name, kw

    def forward(self, ids, mask):
        m = mask.bool()
        rows = _choose(self.name, self.emb(ids), m) if self.name != "h[m]" else self.emb(ids)[m]
        f = torch.tanh(self.fc(input=rows) if self.kw else self.fc(rows))
        pooled = torch.zeros(ids.shape[0], DIM, dtype=f.dtype).index_add(0, m.nonzero()[:, 0], f)
        return pooled[:, :2]


UNFOLLOWED = ["h[None, m].squeeze(0)", "h[..., m, :]", "one_hot(idx) @ flat", "einsum one-hot", "embedding_bag",
              "vstack of parts"]
FOLLOWED = ["h[m.nonzero(as_tuple=True)]", "h[torch.where(m)]", "h[m.byte()]"]


@pytest.mark.parametrize("name", UNFOLLOWED)
def test_choices_in_other_forms_are_never_released_wrong(name):
    """Rows chosen in forms the guard did not see as choices (an index behind ``None`` or ``...``, a product with a
    one-hot matrix, ``embedding_bag`` of the hidden states, ``vstack`` of rows in an order read on the host): the
    later batch whose rows are not one per sample was released 10-15 % off the oracle. Now refused (the first batch
    too where the owners are lost)."""
    torch.manual_seed(12)
    out = _outcomes(Chooser(name).to(D), [[1, 1, 1], [2, 0, 1], [0, 1, 2]])
    assert out[1:] == ["refused", "refused"], out


@pytest.mark.parametrize("name", FOLLOWED)
def test_choices_by_coordinates_are_followed(name):
    """``h[m.nonzero(as_tuple=True)]``, ``h[torch.where(m)]`` and a uint8 mask are ``h[m]``: exact while each sample
    has one row, refused when not (they were refused at every batch)."""
    torch.manual_seed(13)
    assert _outcomes(Chooser(name).to(D), [[1, 1, 1], [2, 0, 1], [1, 1, 1]]) == ["exact", "refused", "exact"]


def test_layer_input_given_by_keyword_is_checked():
    """``fc(input=h[m])``: the hook saw only positional inputs, so a later batch of mixed rows was released (7-20 %
    off the oracle), also as a fold."""
    torch.manual_seed(14)
    assert _outcomes(Chooser("h[m]", kw=True).to(D), [[1, 1, 1], [2, 0, 1]]) == ["exact", "refused"]


class ViewWrite(nn.Module):
    """Rows written back by position through a view of the buffer the head reads (right only for one row per
    sample)."""

    def __init__(self, how):
        super().__init__()
        self.emb, self.fc, self.head, self.how = nn.Embedding(V, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, 2), how
        self.fc.requires_grad_(False)

    def forward(self, ids, mask):
        m = mask.bool()
        f = torch.tanh(self.fc(self.emb(ids)[m]))
        pooled = torch.zeros(ids.shape[0], DIM, dtype=f.dtype)
        pos = torch.arange(f.shape[0]) % ids.shape[0]
        if self.how == "view":
            pooled.view(ids.shape[0], DIM).index_add_(0, pos, f)
        else:
            pooled[:][pos] = f
        return self.head(pooled)


@pytest.mark.parametrize("how", ["view", "slice"])
def test_writes_through_a_view_are_followed(how):
    """An in-place write into a view writes into the tensor it views: marked too (released 0.8-1.6 off before)."""
    torch.manual_seed(15)
    assert _outcomes(ViewWrite(how).to(D), [[1, 1, 1], [2, 1, 0]]) == ["exact", "refused"]


class FlipWhere(nn.Module):
    """A flag read from the data chooses between the rows and the rows reversed (and reverses back after fc)."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(V, DIM), nn.Linear(DIM, DIM)

    def forward(self, ids, mask):
        h = self.emb(ids).mean(1)
        flag = (mask.sum() % 2 == 1).reshape(1, 1)
        y = torch.tanh(self.fc(torch.where(flag, h.flip(0), h)))
        return torch.where(flag, y.flip(0), y)[:, :2]


def test_a_choice_between_row_orders_is_refused():
    """``torch.where(flag, h.flip(0), h)`` with a flag from the data: the probe's batch cannot tell, so it is a choice
    (released 8-15 % off before on the batches whose flag differed from the probe's)."""
    torch.manual_seed(16)
    assert set(_outcomes(FlipWhere().to(D), [[1, 2, 3], [3, 1, 2], [3, 2, 1]])) == {"refused"}


def test_a_refused_micro_batch_discards_the_step():
    """Two micro-batches, the second refused (its rows are not one per sample); the user skips it and goes on with
    the next step. The first micro-batch's clipped sums used to stay and be released with the next step, whose
    sampled batch they are not (0.76 off that step's oracle in a red-team run): a refusal that depends on the batch's
    data discards the step, and says so. The next step equals its own oracle."""
    torch.manual_seed(17)
    g = torch.Generator().manual_seed(18)
    model = PickRows().to(D)
    template = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    engine = make_engine(model, batch_size=B, R=1.0, fn="abadi", style="all-layer", mode="BK-MixOpt",
                         reduction="mean")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    engine.attach(opt)
    first, mixed, nxt = _batch([1, 1, 1], g), _batch([2, 0, 1], g), _batch([1, 1, 1], g)
    user_loss(mse_loss(model(*first[0]), first[1]), "mean").backward()
    with pytest.raises(RuntimeError, match="accumulated from earlier batches were discarded too"):
        model(*mixed[0])
    opt.zero_grad(set_to_none=True)
    om = synced_copy(template, model)
    want = clipped_sum(per_sample_grads(om, mse_loss, [nxt], names), make_groups(om, "all-layer", names), "abadi",
                       1.0, B)
    user_loss(mse_loss(model(*nxt[0]), nxt[1]), "mean").backward()
    opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-10)
    assert engine.steps == 1
