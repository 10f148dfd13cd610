"""The structure probe verifies each input signature at two batch sizes (``fastdp.probe.SIZES_PER_SIGNATURE``): its
first call's, and the first other size it is called with.

A signature does not fix the batch size, and an operation's effect on the rows can depend on it: rows rolled by a
constant 4 are the identity at batch size 2 (and 4) and a shift at 3. A red-team pass (2026-11-28) had such models
released 5.7e-2 to 0.25 off the oracle after a probe at batch size 2. Each case here is a model the probe passes at
its first batch size and fails at the second: a rolled broadcast table then goes to the root's per-sample replay
(exact), rolled folded rows are refused; and (the mutation: one size per signature) each is released wrong without
the second probe. Models whose rows follow the batch are exact against the brute-force oracle (float64, 1e-6) over
batch sizes that change from call to call, and are probed twice per signature, not at every new size.
"""

from __future__ import annotations

import pytest
import torch
from model_oracle import check_engine, mse_loss
from oracle import MODES, make_engine, user_loss
from torch import nn

from fastdp import probe
from fastdp.probe import StructureError

D = torch.float64
T, DIM = 4, 3


class Rolled(nn.Module):
    """Tokens ``(B, T, d)`` whose rows the model rolls over the batch by a constant ``shift`` (zero: rows follow the
    batch) around a trainable layer:

    * ``"repeat"``: a position table ``proj(grid)`` without batch dimension, repeated over the batch, rolled;
    * ``"broadcast"``: the same table added by broadcasting after ``expand(B, ...)`` (the engine expands the leading 1);
    * ``"folded-linear"``: a Linear on the rows folded to ``(B T, d)``, rolled before and rolled back after;
    * ``"folded-bn"``: the same around an eval-mode BatchNorm1d with trainable affine parameters.
    """

    def __init__(self, how: str, shift: int):
        super().__init__()
        self.how, self.shift = how, shift
        self.proj = nn.Linear(2, DIM) if how in ("repeat", "broadcast") else None
        self.inner = (nn.Linear(DIM, DIM) if how == "folded-linear" else nn.BatchNorm1d(DIM) if how == "folded-bn"
                      else None)
        self.head = nn.Linear(DIM, 2)
        if how == "folded-bn":
            with torch.no_grad():
                self.inner.running_mean.uniform_(-0.5, 0.5)
                self.inner.running_var.uniform_(0.5, 1.5)
                self.inner.weight.uniform_(0.5, 1.5)
                self.inner.bias.uniform_(-0.5, 0.5)
            self.inner.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        if self.how == "folded-bn":
            self.inner.eval()  # frozen statistics: the same affine map at every row
        return self

    def forward(self, x):
        B = x.shape[0]
        if self.how in ("repeat", "broadcast"):
            t = torch.arange(T, dtype=x.dtype) / T
            grid = torch.stack([torch.sin(t), torch.cos(t)], -1).unsqueeze(0)  # (1, T, 2): no batch dimension
            table = self.proj(grid)
            pos = table.repeat(B, 1, 1) if self.how == "repeat" else table.expand(B, T, DIM)
            h = x + pos.roll(self.shift, 0)
        else:
            rows = x.flatten(0, 1).roll(self.shift, 0)  # (B T, d), row r is sample r // T's before the roll
            h = self.inner(rows).roll(-self.shift, 0).view(B, T, DIM)
        return self.head(torch.tanh(h)).mean(1)


def _batches(sizes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(n, T, DIM, generator=g, dtype=D),), torch.randn(n, 2, generator=g, dtype=D))
            for n in sizes]


#: (how, shift): the identity on the rows at batch size 2 (the probe's first size), a shift at batch size 5 (sizes
#: that equal no other dimension: 3 == DIM would be another signature)
HIDDEN = [("repeat", 4), ("broadcast", 4), ("folded-linear", 8), ("folded-bn", 8)]


@pytest.mark.parametrize("how,shift", HIDDEN[:2], ids=[h for h, _ in HIDDEN[:2]])
@pytest.mark.parametrize("mode", MODES)
def test_a_rolled_broadcast_falls_back_to_the_replay_at_the_second_size(mode, how, shift, caplog):
    """The table's layer output (leading size 1) was expanded: when the second size's probe fails, its parameters
    go to the root's per-sample replay (the probe's fallback), which is exact whatever the rows' order."""
    torch.manual_seed(0)
    with caplog.at_level("WARNING", logger="fastdp.probe"):
        engine, *_ = check_engine(Rolled(how, shift).to(D), mse_loss, _batches([2, 5, 2]), mode=mode)
    assert "the parameters of ['proj']" in caplog.text and "replayed per sample by ['<root>']" in caplog.text
    assert engine.probe_stats["signatures"] == 1


@pytest.mark.parametrize("how,shift", HIDDEN[2:], ids=[h for h, _ in HIDDEN[2:]])
@pytest.mark.parametrize("mode", ["BK-MixOpt", "BK-ghost"])
def test_rows_that_depend_on_the_batch_size_are_refused_at_the_second_size(mode, how, shift):
    torch.manual_seed(0)
    model = Rolled(how, shift).to(D)
    engine = make_engine(model, batch_size=5, R=1.0, mode=mode)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    (x2,), y2 = _batches([2])[0]
    user_loss(mse_loss(model(x2), y2), "mean").backward()  # batch size 2: the roll is the identity; verified
    assert engine.probe_stats["signatures"] == 1
    (x5,), y5 = _batches([5], seed=2)[0]
    with pytest.raises(StructureError) as err:
        model(x5)
    msg = str(err.value)
    assert "verified at batch size [2] and fails at batch size 5" in msg
    assert "depends on the batch" in msg


@pytest.mark.parametrize("how,shift", HIDDEN, ids=[h for h, _ in HIDDEN])
def test_one_size_per_signature_releases_them_wrong(monkeypatch, how, shift):
    """The mutation: with one batch size per signature (the probe before 2026-11-28) the same models are released
    off the oracle, so the refusal above is what stands between them and a wrong release."""
    monkeypatch.setattr(probe, "SIZES_PER_SIGNATURE", 1)
    torch.manual_seed(0)
    with pytest.raises(AssertionError):
        check_engine(Rolled(how, shift).to(D), mse_loss, _batches([2, 5]), mode="BK-MixOpt")


@pytest.mark.parametrize("how", ["repeat", "broadcast", "folded-linear", "folded-bn"])
@pytest.mark.parametrize("mode", MODES)
def test_rows_that_follow_the_batch_are_exact_at_changing_sizes(mode, how):
    """Shift 0: batch sizes 2, 3, 1, 5 within one step (3 == DIM is a signature of its own), against the oracle."""
    torch.manual_seed(0)
    check_engine(Rolled(how, 0).to(D), mse_loss, _batches([2, 3, 1, 5]), mode=mode)


def test_a_signature_is_probed_at_two_sizes_not_at_every_size():
    torch.manual_seed(0)
    model = Rolled("folded-linear", 0).to(D)
    engine = make_engine(model, batch_size=8, R=1.0, mode="BK-MixOpt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    probes = []
    for n in (2, 2, 6, 5, 7, 6, 2):  # (sizes equal to no other dimension: T 4 and DIM 3 are other signatures)
        (x,), y = _batches([n], seed=n)[0]
        user_loss(((model(x) - y) ** 2).sum(1), "mean").backward()
        opt.step()
        opt.zero_grad()
        probes.append(engine.probe_stats["probes"])
    assert probes == [1, 1, 2, 2, 2, 2, 2]
    assert engine.probe_stats["signatures"] == 1
    assert engine._capture.probe.sizes == {next(iter(engine._capture.probe.seen)): {2, 6}}


def test_the_second_size_keeps_the_first_sizes_fold_rules():
    """A folded module's fold factors seen at the first size stay allowed after the second size's probe (its
    rules are added, not replaced): both sizes' calls run, and the step is exact."""
    torch.manual_seed(0)
    check_engine(Rolled("folded-linear", 0).to(D), mse_loss, _batches([2, 3, 2, 3]), mode="BK-MixGhostClip")


def test_verify_structure_checks_a_second_batch_size():
    """``fastdp.validate.verify_structure`` (the offline check for sharded models) probes the batch and its first
    ``B - 1`` samples: rows rolled by 24 are the identity on 6 samples of 4 positions, a shift on 5."""
    from fastdp.validate import verify_structure

    torch.manual_seed(0)
    (x,), _ = _batches([6])[0]
    assert verify_structure(Rolled("folded-linear", 0).to(D), x)["signatures"] == 1
    with pytest.raises(StructureError, match="verified at batch size \\[6\\] and fails at batch size 5"):
        verify_structure(Rolled("folded-linear", 24).to(D), x)

