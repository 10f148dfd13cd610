"""GradScaler (fastdp.amp) with an attached engine: exact against the unscaled brute-force oracle, overflow skips
the step privately (the skip is accounted, nothing is kept), and bf16/fp16 autocast against an oracle run under the
same autocast."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import (
    assert_grads_close,
    choose_R,
    clipped_sum,
    make_engine,
    make_groups,
    mse_per_sample,
    oracle_model,
    per_sample_grads,
    released_grads,
    trainable_names,
    user_loss,
)
from torch import nn

from fastdp import NonFiniteGradientError


def mlp(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)


def batches(sizes, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 5, generator=g, dtype=dtype), torch.randn(b, 3, generator=g, dtype=dtype)) for b in sizes]


def scaled_step(model, engine, opt, scaler, data, reduction="mean", poison=None):
    """One logical step through the scaler; ``poison=(batch, row)`` puts inf into one sample's input."""
    for j, (x, y) in enumerate(data):
        if poison is not None and poison[0] == j:
            x = x.clone()
            x[poison[1]] = math.inf
        per = mse_per_sample(model(x), y)
        scaler.scale(user_loss(per, reduction)).backward()
    scaler.step(opt)
    scaler.update()


def oracle(model, data, B, R=None, where="middle"):
    names = trainable_names(model)
    om = oracle_model(model)
    groups = make_groups(om, "all-layer", names)
    psg = per_sample_grads(om, mse_per_sample, data, names)
    if R is None:
        R = choose_R(psg, groups, where)
    return clipped_sum(psg, groups, "abadi", R, B), R


def setup(model, B, R, mode="BK-MixOpt", reduction="mean", sigma=0.0, init_scale=2.0**10, **kw):
    engine = make_engine(model, batch_size=B, R=R, mode=mode, reduction=reduction, sigma=sigma)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, **kw)
    engine.attach(opt, scaler=scaler)
    return engine, opt, scaler


@pytest.fixture(params=[False, True], ids=["host", "device"])
def defer(request, monkeypatch):
    """Both clipping paths of a scaled backward pass: the CPU's (overflowed samples found with a host read) and an
    accelerator's (zeroed on the device without one, counted at the release; ``fastdp.deferred.DEFER_ON``)."""
    import fastdp.deferred as deferred

    monkeypatch.setattr(deferred, "DEFER_ON", {"cpu": request.param, "default": request.param})
    return request.param


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost", "instantiate"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("sizes", [[4], [3, 1], [1], [0, 2], [7]])  # 7 = the hidden width
def test_scaler_exact_against_unscaled_oracle(mode, reduction, sizes, defer):
    model = mlp()
    data = batches(sizes)
    B = max(1, sum(sizes))
    want, R = oracle(model, data, B)
    engine, opt, scaler = setup(model, B, R, mode=mode, reduction=reduction)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scaled_step(model, engine, opt, scaler, data, reduction)
    got = released_grads(model, trainable_names(model))
    assert_grads_close(got, want)
    for n, p in model.named_parameters():  # the optimizer applied the unscaled release
        torch.testing.assert_close(p.detach(), before[n] - 0.1 * want[n], rtol=1e-6, atol=1e-12)
    assert engine.steps == engine.accountant.ledger.steps == 1
    assert scaler.get_scale() == 2.0**10  # no overflow, growth_interval not reached


def test_scale_does_not_change_the_threshold():
    """The same step at scales 1, 2**10, 2**20 releases the same gradient; the scaled gradient unclipped by the scale
    would differ by the scale (every sample clipped: R below the smallest norm)."""
    data = batches([4])
    want, R = oracle(mlp(), data, 4, where="below")
    for s in (1.0, 2.0**10, 2.0**20):
        model = mlp()
        engine, opt, scaler = setup(model, 4, R, init_scale=s)
        scaled_step(model, engine, opt, scaler, data)
        assert_grads_close(released_grads(model, trainable_names(model)), want)


def test_unscale_then_read_grad():
    """scaler.unscale_ releases: .grad is the unscaled private gradient before scaler.step (clip_grad_norm_ pattern),
    and the step then applies exactly it."""
    model = mlp()
    data = batches([3])
    want, R = oracle(model, data, 3)
    engine, opt, scaler = setup(model, 3, R)
    per = mse_per_sample(model(data[0][0]), data[0][1])
    scaler.scale(per.mean()).backward()
    assert all(p.grad is None for p in model.parameters())
    scaler.unscale_(opt)
    assert_grads_close(released_grads(model, trainable_names(model)), want)
    assert engine.steps == 1
    scaler.step(opt)
    scaler.update()
    assert engine.steps == engine.accountant.ledger.steps == 1


def test_overflow_skips_step_accounted_and_leaves_nothing(defer):
    """An inf in one sample's scaled backward: sigma=0, so the scaler skips the step as without DP; the parameters are
    unchanged, the scale backs off, the step is accounted, and the next step releases only its own batch."""
    model = mlp()
    data = batches([3, 2])
    nxt = batches([4], seed=5)
    want, _ = oracle(model, nxt, 5, R=1.0)  # before attach (a deepcopy of an attached model copies its hooks)
    engine, opt, scaler = setup(model, 5, 1.0, backoff_factor=0.25)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scaled_step(model, engine, opt, scaler, data, poison=(1, 0))  # the second physical batch overflows
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
        assert p.grad is None
    assert scaler.get_scale() == 2.0**10 * 0.25
    assert engine.steps == engine.accountant.ledger.steps == 1
    assert engine._release.scaler.skipped_steps == 1
    assert not engine._release.summed and engine._release.overflow_samples == 0
    # next step: exactly the oracle of its own batch (the first batch of the skipped step is not carried over)
    opt.zero_grad()
    scaled_step(model, engine, opt, scaler, nxt)
    assert_grads_close(released_grads(model, trainable_names(model)), want)
    assert engine.steps == engine.accountant.ledger.steps == 2


def test_growth_then_skip_then_backoff():
    """growth_interval=1: the scale doubles after each good step until the float16 range overflows in the backward
    (activations cast to float16 with the scale), the overflowing step is skipped and the scale halves."""
    model = mlp()
    engine, opt, scaler = setup(model, 2, 1.0, init_scale=2.0**10, growth_interval=1)

    class Fp16Out(nn.Module):
        def forward(self, x):  # the loss's gradient passes through float16 here: overflows at scale > 65504 / |g|
            return x.to(torch.float16).to(torch.float64)

    model.append(Fp16Out())
    scales, skipped = [], []
    for _ in range(12):
        x, y = batches([2], seed=len(scales))[0]
        opt.zero_grad()
        scaled_step(model, engine, opt, scaler, [(x, y)])
        scales.append(scaler.get_scale())
        skipped.append(engine._release.last_step_skipped)
    assert any(skipped) and not all(skipped)
    for i in range(1, len(scales)):
        assert scales[i] == scales[i - 1] * (0.5 if skipped[i] else 2.0)
    assert engine.steps == engine.accountant.ledger.steps == 12


def test_noisy_overflow_decision_is_private():
    """With sigma > 0 one overflowed sample does not decide the skip by itself (threshold 0.5 + 3 sigma): the sample
    gets factor 0 and the step is released; many overflowed samples skip it."""
    model = mlp()
    engine, opt, scaler = setup(model, 8, 1.0, sigma=1.0)
    x, y = batches([8])[0]
    x = x.clone()
    x[2] = math.inf
    scaler.scale(mse_per_sample(model(x), y).mean()).backward()
    scaler.step(opt)
    scaler.update()
    # one overflowed sample: n + xi > 3.5 needs xi > 2.5 (P ~ 0.6 %); seeded default generator
    assert not engine._release.last_step_skipped
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    opt.zero_grad()
    x[:] = math.inf
    scaler.scale(mse_per_sample(model(x), y).mean()).backward()
    scaler.step(opt)
    scaler.update()
    assert engine._release.last_step_skipped  # 8 + xi > 3.5 unless xi < -4.5
    assert engine.steps == engine.accountant.ledger.steps == 2


def test_scaler_refusals_and_detach():
    model = mlp()
    engine, opt, scaler = setup(model, 2, 1.0)
    x, y = batches([2])[0]
    scaler.scale(mse_per_sample(model(x), y).mean()).backward()
    with pytest.raises(RuntimeError, match="scaler.step"):
        opt.step()  # bypasses the scaler
    assert engine.steps == 0 and not engine._release.summed
    engine.detach()
    assert "unscale_" not in vars(scaler)
    with pytest.raises(ValueError, match="GradScaler"):
        engine.attach(opt, scaler=object())
    engine.attach(opt)  # without a scaler: non-finite gradients raise as before
    x = x.clone()
    x[0] = math.inf
    with pytest.raises(NonFiniteGradientError):
        mse_per_sample(model(x), y).mean().backward()


def test_scaler_backward_after_unscale_refused():
    model = mlp()
    engine, opt, scaler = setup(model, 2, 1.0)
    x, y = batches([2])[0]
    scaler.scale(mse_per_sample(model(x), y).mean()).backward()
    scaler.unscale_(opt)
    scaler.scale(mse_per_sample(model(x), y).mean()).backward()
    with pytest.raises(RuntimeError, match="between scaler.unscale_"):
        scaler.step(opt)


def test_fused_optimizer_refused():
    model = mlp(torch.float32)
    engine = make_engine(model, batch_size=2, R=1.0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    engine.attach(opt, scaler=scaler)
    x, y = batches([2], dtype=torch.float32)[0]
    scaler.scale(mse_per_sample(model(x), y).mean()).backward()
    with pytest.raises(RuntimeError, match="fused=True"):
        scaler.step(opt)
    assert engine.steps == 0 and all(p.grad is None for p in model.parameters())


def test_skipped_step_in_checkpoint_and_epsilon():
    """A skipped step is in the ledger, so epsilon and a checkpoint cover it: a resumed engine reports the same."""
    model = mlp()
    engine, opt, scaler = setup(model, 5, 1.0, sigma=0.8)
    x, y = batches([5])[0]
    x = x.clone()
    x[:] = math.inf  # every sample overflows: skipped (5 + 0.8 xi > 2.9 unless xi < -2.6)
    scaler.scale(mse_per_sample(model(x), y).mean()).backward()
    scaler.step(opt)
    scaler.update()
    assert engine._release.last_step_skipped and engine.steps == 1
    eps = engine.get_privacy_spent()["epsilon"]
    assert 0 < eps < math.inf
    fresh = make_engine(mlp(), batch_size=5, R=1.0, sigma=0.8)
    fresh.load_state_dict(engine.state_dict())
    assert fresh.steps == 1 and fresh.get_privacy_spent()["epsilon"] == eps
