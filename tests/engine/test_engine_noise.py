"""Noise, empty batches, reproducibility and privacy accounting."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import (
    FNS,
    MODES,
    clipped_sum,
    make_engine,
    make_groups,
    mse_per_sample,
    oracle_model,
    per_sample_grads,
    trainable_names,
    user_loss,
)
from torch import nn

D = torch.float64


def zero_loss(out, y):
    return 0.0 * out.flatten(1).sum(1)


def big_model(dtype=D):
    return nn.Sequential(nn.Linear(40, 60), nn.Tanh(), nn.Linear(60, 50), nn.LayerNorm(50)).to(dtype)


def _check_std(values: torch.Tensor, expected: float, rel=0.04, what=""):
    values = values.double().flatten()
    n = values.numel()
    std = float(values.std())
    mean = float(values.mean())
    assert abs(std / expected - 1) < rel, f"{what}: empirical std {std:.6g} vs expected {expected:.6g} (n={n})"
    assert abs(mean) < 5 * expected / math.sqrt(n), f"{what}: mean {mean:.3g} too far from 0 (n={n})"


def _released(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode", MODES)
def test_noise_std_zero_gradient(mode):
    torch.manual_seed(30)
    model = big_model()
    sigma, R, B = 1.3, 0.7, 4
    engine = make_engine(
        model,
        batch_size=B,
        R=R,
        sigma=sigma,
        mode=mode,
        fn=FNS[MODES.index(mode) % 3],
        style="layer-wise",
        noise_generator=torch.Generator().manual_seed(1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    x, y = torch.randn(B, 40, dtype=D), torch.randn(B, 50, dtype=D)
    user_loss(zero_loss(model(x), y), "mean").backward()
    opt.step()
    g1 = _released(model)
    # noise is sigma * R (not R_k) / batch_size, for every parameter
    _check_std(torch.cat([v.flatten() for v in g1.values()]), sigma * R / B, what="all params")
    for n, v in g1.items():
        if v.numel() >= 2000:
            _check_std(v, sigma * R / B, rel=0.08, what=n)
    opt.zero_grad()
    user_loss(zero_loss(model(x), y), "mean").backward()
    opt.step()
    g2 = _released(model)
    a = torch.cat([v.flatten() for v in g1.values()])
    b = torch.cat([v.flatten() for v in g2.values()])
    corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    assert abs(corr) < 0.1, f"noise of consecutive steps correlated: {corr}"
    # different parameters get independent noise
    w1, w2 = g1["0.weight"].flatten()[:2000], g1["2.weight"].flatten()[:2000]
    assert abs(float(torch.corrcoef(torch.stack([w1, w2]))[0, 1])) < 0.1


@pytest.mark.parametrize("mode", MODES)
def test_noise_plus_clipped_sum_with_accumulation(mode):
    """released - oracle clipped sum has std sigma*R/batch_size: noise added once per logical step
    (3 physical batches), not per physical batch, and independent of the number of groups."""
    torch.manual_seed(31)
    model = big_model()
    sigma, R, B = 0.9, 0.5, 10
    fn = FNS[MODES.index(mode) % 3]
    style = "param-wise"
    om = oracle_model(model)
    names = trainable_names(model)
    batches = [(torch.randn(n, 40, dtype=D), torch.randn(n, 50, dtype=D)) for n in (3, 4, 2)]
    psg = per_sample_grads(om, mse_per_sample, batches, names)
    want = clipped_sum(psg, make_groups(om, style, names), fn, R, B)
    engine = make_engine(model, batch_size=B, R=R, sigma=sigma, mode=mode, fn=fn, style=style, reduction="mean")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    for x, y in batches:
        user_loss(mse_per_sample(model(x), y), "mean").backward()
    opt.step()
    got = _released(model)
    resid = torch.cat([(got[n] - want[n]).flatten() for n in names])
    _check_std(resid, sigma * R / B, what="released - clipped sum")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_noise_std_float32_and_float64(dtype):
    torch.manual_seed(32)
    model = big_model(dtype)
    sigma, R, B = 2.0, 1.5, 32
    engine = make_engine(model, batch_size=B, R=R, sigma=sigma, mode="BK-MixOpt")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    engine.empty_step()  # empty logical batch: noise only
    g = _released(model)
    for v in g.values():
        assert v.dtype == dtype
    _check_std(torch.cat([v.flatten() for v in g.values()]), sigma * R / B, what=str(dtype))


def _train(seed, mode="BK-MixOpt", steps=3):
    torch.manual_seed(33)  # identical initial model and data for every call
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(D)
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    engine = make_engine(model, batch_size=4, R=1.0, sigma=1.0, mode=mode, noise_generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    engine.attach(opt)
    g = torch.Generator().manual_seed(34)
    for _ in range(steps):
        x, y = torch.randn(4, 4, generator=g, dtype=D), torch.randn(4, 3, generator=g, dtype=D)
        user_loss(mse_per_sample(model(x), y), "mean").backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_run(mode):
    a, b, c = _train(5, mode), _train(5, mode), _train(6, mode)
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q), "same noise seed must give identical parameters"
    assert any(not torch.allclose(p, q) for p, q in zip(a, c, strict=True)), "different seeds gave the same run"


def test_same_seed_same_noise_across_modes():
    """Not strictly in the contract for different modes, but the noise draw must not depend on the
    clipping mode when the gradients are identical up to rounding."""
    a = _train(7, "BK-MixOpt")
    for mode in MODES[1:]:
        b = _train(7, mode)
        for p, q in zip(a, b, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9)


# --------------------------------------------------------------------------- empty batches


@pytest.mark.parametrize("mode", MODES)
def test_empty_step_no_backward(mode):
    torch.manual_seed(35)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    engine = make_engine(model, batch_size=5, R=1.0, sigma=0.0, mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    before = [p.detach().clone() for p in model.parameters()]
    engine.empty_step()  # no backward at all
    for p, b in zip(model.parameters(), before, strict=True):
        assert p.grad is not None, "empty step must release a (zero + noise) gradient"
        assert torch.count_nonzero(p.grad) == 0
        assert torch.equal(p.detach(), b)
    # after a real step and zero_grad, another empty step is again zero
    x, y = torch.randn(2, 3, dtype=D), torch.randn(2, 2, dtype=D)
    user_loss(mse_per_sample(model(x), y), "mean").backward()
    opt.step()
    opt.zero_grad()
    engine.empty_step()
    for p in model.parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0, "stale gradient leaked into empty step"


@pytest.mark.parametrize("mode", MODES)
def test_empty_physical_batch_sum(mode):
    torch.manual_seed(36)
    model = nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.Tanh(), nn.LayerNorm(5), nn.Linear(5, 2)).to(D)
    engine = make_engine(model, batch_size=5, R=1.0, sigma=0.0, mode=mode, reduction="sum")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    x, y = torch.randn(0, 2, 5, dtype=D), torch.randn(0, 3, 2, dtype=D)
    user_loss(mse_per_sample(model(x), y), "sum").backward()
    opt.step()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0, n


@pytest.mark.parametrize("mode", MODES)
def test_empty_physical_batch_inside_accumulation(mode):
    """An empty physical batch among non-empty ones contributes nothing (sum reduction)."""
    torch.manual_seed(37)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    names = trainable_names(model)
    om = oracle_model(model)
    batches = [(torch.randn(n, 3, dtype=D), torch.randn(n, 2, dtype=D)) for n in (2, 0, 3)]
    want = clipped_sum(per_sample_grads(om, mse_per_sample, batches, names), [names], "abadi", 0.3, 6)
    engine = make_engine(model, batch_size=6, R=0.3, sigma=0.0, mode=mode, reduction="sum")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    for x, y in batches:
        user_loss(mse_per_sample(model(x), y), "sum").backward()
    opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-10)


@pytest.mark.parametrize("kind", ["no_backward", "zero_samples"])
def test_empty_batch_noise_and_accounting(kind):
    torch.manual_seed(38)
    model = big_model()
    sigma, R, B = 1.1, 2.0, 8
    engine = make_engine(
        model,
        batch_size=B,
        R=R,
        sigma=sigma,
        reduction="sum",
        accountant="rdp",
        target_delta=1e-5,
        sample_size=1000,
        noise_generator=torch.Generator().manual_seed(3),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    eps = []
    for _ in range(3):
        if kind == "zero_samples":
            x, y = torch.randn(0, 40, dtype=D), torch.randn(0, 50, dtype=D)
            user_loss(mse_per_sample(model(x), y), "sum").backward()
            opt.step()
        else:
            engine.empty_step()
        g = _released(model)
        _check_std(torch.cat([v.flatten() for v in g.values()]), sigma * R / B, what=kind)
        opt.zero_grad()
        spent = engine.get_privacy_spent()
        eps.append(spent["epsilon"])
    assert spent["steps"] == 3
    assert eps[0] > 0 and eps[0] < eps[1] < eps[2]


# --------------------------------------------------------------------------- accounting


def test_privacy_spent_keys_and_steps():
    torch.manual_seed(39)
    model = nn.Linear(3, 2).to(D)
    engine = make_engine(model, batch_size=10, sample_size=1000, sigma=1.0, accountant="rdp", target_delta=1e-5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    for i in range(4):
        x = torch.randn(3 + i, 3, dtype=D)
        model(x).pow(2).sum(1).mean().backward()
        opt.step()
        opt.zero_grad()
    spent = engine.get_privacy_spent()
    assert {"epsilon", "delta", "accountant", "steps"} <= set(spent)
    assert spent["steps"] == 4
    assert spent["delta"] == pytest.approx(1e-5)
    assert "rdp" in str(spent["accountant"]).lower()
    assert 0 < spent["epsilon"] < math.inf


@pytest.mark.parametrize("budget", [dict(epochs=2), dict(steps=30)])
@pytest.mark.parametrize("target_epsilon", [1.0, 4.0])
def test_calibration_meets_target(target_epsilon, budget):
    import warnings

    from fastdp import PrivacyEngine

    torch.manual_seed(40)
    model = nn.Linear(3, 2).to(D)
    sample_size, batch_size = 1000, 50
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(
            model,
            batch_size=batch_size,
            sample_size=sample_size,
            target_epsilon=target_epsilon,
            target_delta=1e-5,
            accountant="rdp",
            **budget,
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    planned = budget.get("steps") or budget["epochs"] * sample_size // batch_size
    x = torch.zeros(batch_size, 3, dtype=D)
    for i in range(planned):
        model(x).sum(1).mean().backward()
        opt.step()
        if i == planned - 1:
            # zero input => per-sample gradient of the weight is 0, so its released gradient is pure noise
            assert model.weight.grad is not None and torch.count_nonzero(model.weight.grad) == 6
        opt.zero_grad()
    spent = engine.get_privacy_spent()
    assert spent["steps"] == planned
    assert spent["epsilon"] <= target_epsilon * (1 + 1e-9), spent
    assert spent["epsilon"] > 0.5 * target_epsilon, f"calibration far from tight: {spent}"
