"""Several forward calls of the model before one backward pass: the same samples (``engine.same_samples()``:
two views of each sample, an output fed back) or different samples (refused).

Row ``i`` of every call reached by one backward pass is merged into sample ``i``'s gradient. That is right for views
of the same samples, where ``loss_i`` reads row ``i`` of each call; for different samples (two halves of a batch, a
labelled and an unlabelled batch of the same size) it clipped two samples' gradients as one (a red-team pass found
it released silently, 0.5-1.4 relative error against the oracle, also under ``verify_loss="strict"``). Such a pass
is now refused unless its calls ran in one ``with engine.same_samples():`` block. Oracle: float64, one backward pass
per sample through every call of that sample (tests/oracle.py), clipped, summed, divided by the batch size.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import (
    choose_R,
    clipped_sum,
    make_engine,
    make_groups,
    oracle_model,
    per_sample_grads,
    release_of,
    released_grads,
    trainable_names,
)
from torch import nn

from fastdp.modes import CLIPPING_MODES

D = torch.float64
B = 4


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)).to(D)


class TwoViews(nn.Module):
    """The oracle's model: both views of each sample through the same network, in one call."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, a, b):
        return self.net(a), torch.tanh(self.net(torch.tanh(b)))


def pair_loss(out, y):  # per sample: (B,)
    a, b = out
    return F.cross_entropy(a, y, reduction="none") + (a * b).sum(1)


def _data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 6, generator=g, dtype=D)
    return x, x + 0.3 * torch.randn(B, 6, generator=g, dtype=D), torch.randint(0, 3, (B,), generator=g)


def _attached(R: float = 0.1):
    """A fresh model with an engine and SGD(lr=0) attached."""
    net = _model()
    engine = make_engine(net, batch_size=B, R=R)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    engine.attach(opt)
    return net, engine, opt


def _two_views(model, engine, x1, x2, y):
    with engine.same_samples():
        a, b = model(x1), model(x2)
    (F.cross_entropy(a, y) + F.cross_entropy(b, y)).backward()


@pytest.mark.parametrize("mode", CLIPPING_MODES)
def test_views_of_the_same_samples_match_the_oracle(mode):
    """Two calls (the second on ``tanh`` of the other view, its output ``tanh``-ed) inside ``same_samples()``,
    a loss reading row ``i`` of both: exact, over three steps (the first is the structure probe's)."""
    net = _model()
    x1, x2, y = _data()
    om = oracle_model(TwoViews(net))
    names = trainable_names(om.net)
    psg = per_sample_grads(om, pair_loss, [((x1, x2), y)], [f"net.{n}" for n in names])
    psg = {n[len("net."):]: g for n, g in psg.items()}
    groups = make_groups(net, "all-layer", names)
    R = choose_R(psg, groups, "middle")
    want = clipped_sum(psg, groups, "abadi", R, B)
    engine = make_engine(net, batch_size=B, R=R, mode=mode)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    engine.attach(opt)
    for _ in range(3):
        with engine.same_samples():
            a, b = net(x1), torch.tanh(net(torch.tanh(x2)))
        (F.cross_entropy(a, y, reduction="none") + (a * b).sum(1)).mean().backward()
        opt.step()
        got = released_grads(net, names)
        for n in names:
            torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-10, msg=n)


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost", "instantiate"])
def test_different_samples_in_two_calls_are_refused(mode):
    """Two halves of a batch in two calls, one backward pass: refused at the backward pass, naming both ways out;
    nothing of the pass is released (the step releases only what other passes added: here nothing)."""
    net = _model()
    x1, x2, y = _data()
    engine = make_engine(net, batch_size=B, R=0.1, mode=mode)
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    engine.attach(opt)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    h = B // 2
    loss = (F.cross_entropy(net(x1[:h]), y[:h], reduction="sum") + F.cross_entropy(net(x1[h:]), y[h:], reduction="sum"))
    with pytest.raises(RuntimeError, match="same_samples") as e:
        (loss / B).backward()
    assert "torch.cat" in str(e.value) and "backward after each call" in str(e.value)
    assert all(p.grad is None for p in net.parameters())
    # the user's fix: one call on the concatenated batch (exact; compared with the single-call release)
    want = release_of(_model(), lambda m, e: F.cross_entropy(m(torch.cat([x1[:h], x1[h:]])), y).backward(),
                      batch_size=B, R=0.1, mode=mode)
    # or a backward pass per call, each loss the mean over its own rows (as with virtual batches): each adds its
    # own samples to the step
    opt.zero_grad()
    for sl in (slice(0, h), slice(h, B)):
        F.cross_entropy(net(x1[sl]), y[sl]).backward()
    for n, p in net.named_parameters():  # nothing was stepped by the refused pass
        assert torch.equal(p.detach(), before[n]), n
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-9, atol=1e-12, msg=n)


def test_two_calls_in_separate_blocks_are_refused():
    """Each ``same_samples()`` block is its own set of samples: calls from two blocks in one backward pass are
    refused as two calls outside a block are."""
    net, engine, opt = _attached()
    x1, x2, y = _data()
    with engine.same_samples():
        a = net(x1)
    with engine.same_samples():
        b = net(x2)
    with pytest.raises(RuntimeError, match="same_samples"):
        (a + b).sum().backward()


def test_a_forward_without_backward_does_not_join_the_next_pass():
    """An evaluation call with grad on whose output never gets a backward pass is not reached by the next pass:
    not a second call of that pass (no refusal), and the release is the single call's."""
    net, engine, opt = _attached()
    x1, x2, y = _data()
    net(x2)  # (grad on, no backward)
    F.cross_entropy(net(x1), y).backward()
    opt.step()
    want = release_of(_model(), lambda m, e: F.cross_entropy(m(x1), y).backward(), batch_size=B, R=0.1)
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-12, atol=0.0, msg=n)


def test_a_nested_block_belongs_to_the_outer_one():
    """A call after a nested block's end is still in the outer block: one group, exact as one block."""
    net, engine, opt = _attached()
    x1, x2, y = _data()
    with engine.same_samples():
        with engine.same_samples():
            a = net(x1)
        b = net(x2)
    (F.cross_entropy(a, y) + F.cross_entropy(b, y)).backward()
    opt.step()
    want = release_of(_model(), lambda m, e: _two_views(m, e, x1, x2, y), batch_size=B, R=0.1)
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-12, atol=0.0, msg=n)


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.body(x))


def test_a_submodule_called_twice_on_its_own_is_refused_unless_in_a_block():
    """``model.body(x_a)``, ``model.body(x_b)`` outside a call of the model: each layer record gets its own id, so
    the calls are told apart by the module called twice. Different samples: refused; the same samples inside
    ``same_samples()``: released as one call of views is (compared with the model-level calls)."""
    torch.manual_seed(3)
    model = Body().to(D)
    x1, x2, y = _data()
    engine = make_engine(model, batch_size=B, R=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    h = B // 2
    loss = (F.cross_entropy(model.head(model.body(x1[:h])), y[:h])
            + F.cross_entropy(model.head(model.body(x1[h:])), y[h:]))
    with pytest.raises(RuntimeError, match="submodule called on its own"):
        loss.backward()
    with engine.same_samples():
        a, b = model.head(model.body(x1)), model.head(model.body(x2))
    (F.cross_entropy(a, y) + F.cross_entropy(b, y)).backward()
    opt.step()
    torch.manual_seed(3)
    want = release_of(Body().to(D), lambda m, e: _two_views(m, e, x1, x2, y), batch_size=B, R=0.1)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-10, atol=1e-14, msg=n)
