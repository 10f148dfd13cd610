"""Which backward passes train: an input's gradient (``torch.autograd.grad(loss, x)``, as adversarial training takes
it) does not; ``zero_grad()`` forgets the passes before it, as it forgets ``.grad``; calls declared the same samples
are backpropagated once.

A red-team pass found each of these released silently (2026-11-27): the clean pass of FGSM and the adversarial pass
were both summed into the step, so a sample counted twice (norm of one sample's contribution 1.97 R), whether the
clean pass ran through ``torch.autograd.grad`` or through ``backward()`` followed by ``optimizer.zero_grad()``; and
two calls inside ``same_samples()`` backpropagated one by one were clipped apart. Oracle: float64, one backward pass
per sample of the training pass only (tests/oracle.py), clipped, summed, divided by the batch size.
"""

from __future__ import annotations

import logging

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
    trainable_names,
)
from torch import nn

from fastdp.modes import CLIPPING_MODES

D = torch.float64
B = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)).to(D)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, 6, generator=g, dtype=D), torch.randint(0, 3, (B,), generator=g)


def ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _adversarial(model, x, y, how):
    """The clean pass that gives the input's gradient, in the user's way ``how``; returns x_adv."""
    xr = x.clone().requires_grad_(True)
    loss = F.cross_entropy(model(xr), y)
    if how == "autograd.grad":
        (gx,) = torch.autograd.grad(loss, xr)
    elif how == "backward(inputs=)":
        loss.backward(inputs=[xr])
        gx = xr.grad
    else:  # backward, then zero_grad (the textbook FGSM step)
        loss.backward()
        gx = xr.grad
        (model if how == "model.zero_grad" else model._opt).zero_grad()
    return (x + 0.3 * gx.sign()).detach()


@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=)", "optimizer.zero_grad", "model.zero_grad"])
@pytest.mark.parametrize("mode", CLIPPING_MODES)
def test_adversarial_training_releases_the_adversarial_pass_only(mode, how):
    model = _model()
    x, y = _data()
    ref = _model()
    engine = None
    for step in range(3):  # (the first step runs the structure probe)
        x_adv = _adversarial(ref, x, y, "autograd.grad")
        om = oracle_model(ref)
        names = trainable_names(om)
        psg = per_sample_grads(om, ce, [((x_adv,), y)], names)
        groups = make_groups(om, "all-layer", names)
        if engine is None:
            R = choose_R(psg, groups, "middle")
            engine = make_engine(model, batch_size=B, R=R, mode=mode)
            model._opt = opt = torch.optim.SGD(model.parameters(), lr=0.0)
            engine.attach(opt)
        want = clipped_sum(psg, groups, "abadi", R, B)
        x_adv_engine = _adversarial(model, x, y, how)
        torch.testing.assert_close(x_adv_engine, x_adv, rtol=1e-12, atol=1e-12)
        F.cross_entropy(model(x_adv_engine), y).backward()
        opt.step()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-10, msg=f"step {step} {n}")
        opt.zero_grad()
    assert engine.steps == 3


def test_zero_grad_between_micro_batches_keeps_only_the_later_ones():
    """As in plain torch, where ``zero_grad()`` between two micro-batches leaves only the second one's gradient."""
    model, (x, y) = _model(), _data()
    engine = make_engine(model, batch_size=B, R=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    F.cross_entropy(model(x[:2]), y[:2]).backward()
    opt.zero_grad()
    F.cross_entropy(model(x[2:]), y[2:]).backward()
    opt.step()
    want = release_of(_model(), lambda m, e: F.cross_entropy(m(x[2:]), y[2:]).backward(), batch_size=B, R=0.5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-12, atol=0.0, msg=n)


def test_zero_grad_after_the_forward_and_before_its_backward_keeps_that_pass():
    """``out = model(x); optimizer.zero_grad(); loss.backward(); optimizer.step()``: a common order; the forward's
    records are not sums yet and stay."""
    model, (x, y) = _model(), _data()
    engine = make_engine(model, batch_size=B, R=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    out = model(x)
    opt.zero_grad()
    F.cross_entropy(out, y).backward()
    opt.step()
    assert engine.steps == 1 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_detach_restores_zero_grad_and_warns_about_discarded_sums(caplog):
    model, (x, y) = _model(), _data()
    engine = make_engine(model, batch_size=B, R=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    assert "zero_grad" in opt.__dict__ and "zero_grad" in model.__dict__
    F.cross_entropy(model(x), y).backward()
    caplog.set_level(logging.WARNING, logger="fastdp.engine")
    engine.detach()
    assert "detach() discarded the clipped sums of 1 backward pass" in caplog.text
    assert "zero_grad" not in opt.__dict__ and "zero_grad" not in model.__dict__


def test_calls_declared_the_same_samples_backpropagated_one_by_one_are_refused():
    model, (x, y) = _model(), _data()
    engine = make_engine(model, batch_size=B, R=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    with engine.same_samples():
        z1, z2 = model(x), model(1.1 * x)
    F.cross_entropy(z1, y).backward()
    with pytest.raises(RuntimeError, match="second backward pass reached forward calls of the model made in one"):
        F.cross_entropy(z2, y).backward()


def test_a_training_pass_through_a_call_an_input_gradient_went_through_is_refused():
    """``torch.autograd.grad(loss, x, retain_graph=True)`` then ``loss.backward()`` on the same graph: the first pass
    does not train and its records are gone; the second is refused with what to do (nothing released)."""
    model, (x, y) = _model(), _data()
    engine = make_engine(model, batch_size=B, R=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    xr = x.clone().requires_grad_(True)
    loss = F.cross_entropy(model(xr), y)
    torch.autograd.grad(loss, xr, retain_graph=True)
    with pytest.raises(RuntimeError, match="already went through: that pass does not train"):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())
