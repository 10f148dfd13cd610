"""The private way by default (issue 6), engine side: steps without backward, empty steps, one engine per optimizer,
the not-Poisson warning, checkpoints (fresh process), secure noise, the privacy budget, non-finite gradients, and
gradients that are never reused across steps."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from oracle import clipped_sum, mse_per_sample, per_sample_grads, trainable_names, user_loss
from torch import nn

from fastdp import NonFiniteGradientError, PrivacyBudgetExceeded, PrivacyEngine
from fastdp.data import poisson_loader

D = torch.float64
ROOT = Path(__file__).resolve().parents[2]


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(D)


def _engine(model, **kw):
    kw.setdefault("noise_multiplier", 0.0)
    kw.setdefault("batch_size", 4)
    kw.setdefault("sample_size", 100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine(model, **kw)


def _step(model, opt, x, y):
    user_loss(mse_per_sample(model(x), y), "mean").backward()
    opt.step()


# --------------------------------------------------------------------------- steps and empty batches


def test_step_without_backward_is_refused_and_releases_nothing():
    model = _model()
    engine = _engine(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="without a backward pass"):
        opt.step()
    assert engine.steps == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    # a second step after a real one is refused too (a forgotten backward)
    _step(model, opt, torch.randn(4, 3, dtype=D), torch.randn(4, 2, dtype=D))
    with pytest.raises(RuntimeError, match="without a backward pass"):
        opt.step()
    assert engine.steps == 1


def test_empty_step_adds_noise_and_is_counted():
    model = _model()
    engine = _engine(model, noise_multiplier=1.0, accountant="rdp")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    engine.empty_step()
    assert engine.steps == 1 and engine.accountant.steps == 1
    assert all(p.grad is not None and torch.count_nonzero(p.grad) > 0 for p in model.parameters())
    _step(model, opt, torch.randn(4, 3, dtype=D), torch.randn(4, 2, dtype=D))
    assert engine.steps == 2


def test_empty_step_after_backward_is_refused():
    model = _model()
    engine = _engine(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    user_loss(mse_per_sample(model(torch.randn(4, 3, dtype=D)), torch.randn(4, 2, dtype=D)), "mean").backward()
    with pytest.raises(RuntimeError, match="not empty"):
        engine.empty_step()


def test_one_engine_per_optimizer():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = _engine(model)
    first.attach(opt)
    second = _engine(copy.deepcopy(model))
    with pytest.raises(RuntimeError, match="already attached"):
        second.attach(opt)
    first.detach()
    third = _engine(model)
    third.attach(opt)  # free again after detach


def test_missing_zero_grad_never_reuses_a_released_gradient():
    """Without zero_grad between steps the second step's gradient is that of the second batch alone."""
    model = _model(1)
    names = trainable_names(model)
    x1, y1 = torch.randn(4, 3, dtype=D), torch.randn(4, 2, dtype=D)
    x2, y2 = torch.randn(4, 3, dtype=D), torch.randn(4, 2, dtype=D)
    engine = _engine(model, max_grad_norm=0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    engine.attach(opt)
    _step(model, opt, x1, y1)  # no zero_grad afterwards
    fresh = _model(1)  # (a deepcopy of an attached model would copy the engine's hooks too)
    fresh.load_state_dict(model.state_dict())
    want = clipped_sum(per_sample_grads(fresh, mse_per_sample, [(x2, y2)], names), [names], "abadi", 0.3, 4)
    _step(model, opt, x2, y2)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-12)


# --------------------------------------------------------------------------- Poisson sampling


def test_fixed_size_batches_warn_once_that_epsilon_assumes_poisson():
    model = _model()
    engine = _engine(model, batch_size=6, sample_size=60)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine.attach(opt)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(12):
            _step(model, opt, torch.randn(6, 3, dtype=D), torch.randn(6, 2, dtype=D))
            opt.zero_grad()
    hits = [w for w in rec if "Poisson" in str(w.message)]
    assert len(hits) == 1, [str(w.message) for w in rec]


def test_poisson_loader_batches_do_not_warn():
    model = _model()
    n, B = 200, 20
    data = torch.utils.data.TensorDataset(torch.randn(n, 3, dtype=D), torch.randn(n, 2, dtype=D))
    loader = poisson_loader(data, batch_size=B, generator=torch.Generator().manual_seed(0))
    engine = _engine(model, batch_size=B, sample_size=n)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine.attach(opt)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for x, y in loader:
            _step(model, opt, x, y)
            opt.zero_grad()
    assert not [w for w in rec if "Poisson" in str(w.message)]
    assert engine.steps == len(loader)


# --------------------------------------------------------------------------- checkpoints

_SCRIPT = textwrap.dedent("""
    import sys, warnings, torch
    from torch import nn
    sys.path.insert(0, {tests!r}); sys.path.insert(0, {root!r})
    from oracle import mse_per_sample, user_loss
    from fastdp import PrivacyEngine
    warnings.simplefilter("ignore")
    phase, path = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    engine = PrivacyEngine(model, batch_size=4, sample_size=100, noise_multiplier=1.0, max_grad_norm=0.5,
                           accountant="rdp", noise_generator=torch.Generator().manual_seed(7))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    engine.attach(opt)
    data = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, generator=data, dtype=torch.float64),
                torch.randn(4, 2, generator=data, dtype=torch.float64)) for _ in range(6)]
    if phase == "second":
        ckpt = torch.load(path, weights_only=False)
        model.load_state_dict(ckpt["model"]); opt.load_state_dict(ckpt["opt"]); engine.load_state_dict(ckpt["engine"])
    todo = {{"all": range(6), "first": range(3), "second": range(3, 6)}}[phase]
    for i in todo:
        x, y = batches[i]
        user_loss(mse_per_sample(model(x), y), "mean").backward()
        opt.step(); opt.zero_grad()
    if phase == "first":
        torch.save({{"model": model.state_dict(), "opt": opt.state_dict(), "engine": engine.state_dict()}}, path)
    else:
        torch.save({{"params": [p.detach() for p in model.parameters()], "steps": engine.steps,
                    "eps": engine.get_privacy_spent()["epsilon"]}}, path + ".out")
""")


def test_checkpoint_round_trip_in_a_fresh_process(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT.format(tests=str(ROOT / "tests"), root=str(ROOT)))

    def run(phase, path):
        subprocess.run([sys.executable, str(script), phase, str(path)], check=True, cwd=ROOT)

    run("all", tmp_path / "a")
    run("first", tmp_path / "ckpt")
    run("second", tmp_path / "ckpt")
    whole = torch.load(str(tmp_path / "a") + ".out")
    resumed = torch.load(str(tmp_path / "ckpt") + ".out")
    assert whole["steps"] == resumed["steps"] == 6
    assert whole["eps"] == pytest.approx(resumed["eps"], rel=1e-12)
    for a, b in zip(whole["params"], resumed["params"], strict=True):
        assert torch.equal(a, b)


def test_load_state_dict_refuses_a_different_configuration():
    model = _model()
    saved = _engine(model, noise_multiplier=1.0).state_dict()
    other = _engine(_model(), noise_multiplier=1.5)
    with pytest.raises(ValueError, match="noise_multiplier"):
        other.load_state_dict(saved)
    with pytest.raises(ValueError, match="version"):
        other.load_state_dict({"steps": 3})


def test_state_dict_with_a_generator_needs_a_generator_to_resume():
    saved = _engine(_model(), noise_multiplier=1.0, noise_generator=torch.Generator().manual_seed(1)).state_dict()
    with pytest.raises(ValueError, match="noise_generator"):
        _engine(_model(), noise_multiplier=1.0).load_state_dict(saved)


# --------------------------------------------------------------------------- secure mode


def test_secure_mode_noise_statistics_and_unpredictability():
    sigma, R, B = 1.5, 2.0, 8
    grads = []
    for _ in range(2):
        torch.manual_seed(0)  # the same torch seed: secure noise must still differ
        model = nn.Sequential(nn.Linear(60, 50)).to(torch.float32)
        engine = _engine(model, noise_multiplier=sigma, max_grad_norm=R, batch_size=B, secure_mode=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        engine.attach(opt)
        engine.empty_step()
        g = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        std, mean, n = float(g.std()), float(g.mean()), g.numel()
        assert abs(std / (sigma * R / B) - 1) < 0.05, std
        assert abs(mean) < 5 * sigma * R / B / math.sqrt(n)
        grads.append(g)
    assert not torch.equal(grads[0], grads[1])


def test_secure_mode_refuses_a_generator():
    with pytest.raises(ValueError, match="secure_mode"):
        _engine(_model(), noise_multiplier=1.0, secure_mode=True, noise_generator=torch.Generator())


# --------------------------------------------------------------------------- budget


def test_enforce_budget_stops_before_the_step_that_would_exceed_it():
    model = _model()
    target, delta = 1.0, 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, batch_size=10, sample_size=100, steps=20, target_epsilon=target,
                               target_delta=delta, accountant="rdp", enforce_budget=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine.attach(opt)
    x, y = torch.randn(10, 3, dtype=D), torch.randn(10, 2, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(200):
            user_loss(mse_per_sample(model(x), y), "mean").backward()
            before = [p.detach().clone() for p in model.parameters()]
            try:
                opt.step()
            except PrivacyBudgetExceeded as e:
                assert "target_epsilon" in str(e)
                break
            opt.zero_grad()
        else:
            pytest.fail("the budget was never enforced")
    assert engine.steps >= 20  # the planned steps always fit
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert engine.get_privacy_spent()["epsilon"] <= target
    # one more step really would exceed the budget
    from fastdp.accounting import get_epsilon

    over = get_epsilon(engine.noise_multiplier, engine.sample_rate, engine.steps + 1, delta, accountant="rdp")
    assert over > target


def test_enforce_budget_needs_a_target():
    with pytest.raises(ValueError, match="target_epsilon"):
        _engine(_model(), enforce_budget=True)


# --------------------------------------------------------------------------- non-finite gradients


def test_nonfinite_gradient_raises_naming_the_step():
    model = _model()
    engine = _engine(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    _step(model, opt, torch.randn(4, 3, dtype=D), torch.randn(4, 2, dtype=D))
    opt.zero_grad()
    x = torch.randn(4, 3, dtype=D)
    x[2, 0] = float("inf")
    with pytest.raises(NonFiniteGradientError, match=r"step 2.*samples \[2\]"):
        user_loss(mse_per_sample(model(x), torch.randn(4, 2, dtype=D)), "mean").backward()


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost", "instantiate"])
def test_nonfinite_samples_get_factor_zero_when_asked(mode):
    model = _model(3)
    names = trainable_names(model)
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D)
    x[1, 2] = float("nan")
    keep = [0, 2, 3, 4]
    psg = per_sample_grads(copy.deepcopy(model), mse_per_sample, [(x[keep], y[keep])], names)
    want = clipped_sum(psg, [names], "abadi", 0.4, 5)
    engine = _engine(model, batch_size=5, max_grad_norm=0.4, on_nonfinite="zero", clipping_mode=mode,
                     loss_reduction="sum")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    out = model(x)
    per = mse_per_sample(out, y)
    per.sum().backward()
    opt.step()
    assert engine.nonfinite_samples == 1
    for n, p in model.named_parameters():
        assert torch.isfinite(p.grad).all()
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-12)
