"""The engine on the ledger: sigma = 0 steps recorded (engine.steps == ledger steps), other releases joining the
training budget (engine.record_release), the budget look-ahead (epsilon_after, no accountant rebuilt by name),
checkpoints of version 3 and the older versions 2 and 1."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from engine_helpers import D, attached_engine, tiny_model
from torch import nn

from fastdp import PrivacyBudgetExceeded, PrivacyEngine, accounting
from fastdp.accounting import Composed, Gaussian, NonPrivate, PoissonSampledGaussian, RDPAccountant

_model = tiny_model


def _engine(model: nn.Module, **kw) -> tuple[PrivacyEngine, torch.optim.Optimizer]:
    return attached_engine(model, **{"sample_size": 64, **kw})


def _step(model: nn.Module, opt: torch.optim.Optimizer, n: int = 16) -> None:
    model(torch.randn(n, D, dtype=torch.float64)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fixed-size batches, sigma = 0 warnings: not what these tests are about
        yield


def _phased_engine() -> tuple[nn.Module, PrivacyEngine, torch.optim.Optimizer]:
    """Three steps: sigma 1, sigma 0, sigma 1."""
    model = _model()
    engine, opt = _engine(model)
    _step(model, opt)
    engine.set_noise_multiplier(0.0)
    _step(model, opt)
    engine.set_noise_multiplier(1.0)
    _step(model, opt)
    return model, engine, opt


def test_sigma_zero_steps_are_in_the_ledger():
    _, engine, _ = _phased_engine()
    ledger = engine.accountant.ledger
    assert engine.steps == ledger.steps == 3 and engine.noiseless_steps == ledger.noiseless_steps == 1
    assert [(e.event.noise_multiplier, e.count) for e in ledger.entries] == [(1.0, 1), (0.0, 1), (1.0, 1)]
    assert engine.accountant.history == [(1.0, 0.25, 2)]  # the noised steps, as before the ledger
    assert engine.get_privacy_spent()["epsilon"] == math.inf == engine.accountant.get_epsilon(1e-3)
    with pytest.raises(AttributeError, match="read-only"):
        engine.noiseless_steps = 0  # type: ignore[misc]


def test_checkpoint_round_trip_keeps_the_order():
    _, engine, _ = _phased_engine()
    state = engine.state_dict()
    assert state["version"] == 5 and state["noiseless_steps"] == 1
    assert [e[0] for e in state["accountant"]["history"]] == [1.0, 0.0, 1.0]
    fresh, _ = _engine(_model())
    fresh.load_state_dict(copy.deepcopy(state))
    assert fresh.accountant.ledger == engine.accountant.ledger
    assert fresh.steps == 3 and fresh.noiseless_steps == 1
    assert fresh.get_privacy_spent()["epsilon"] == math.inf


def test_version_2_checkpoint_loads_and_records_its_sigma_zero_steps():
    _, engine, _ = _phased_engine()
    v2 = copy.deepcopy(engine.state_dict())
    v2["version"] = 2  # version 2 kept sigma = 0 steps out of a version-1 accountant state
    v2["accountant"].update(version=1, history=[e for e in v2["accountant"]["history"] if e[0] != 0.0])
    fresh, _ = _engine(_model())
    fresh.load_state_dict(copy.deepcopy(v2))
    assert fresh.steps == fresh.accountant.ledger.steps == 3 and fresh.noiseless_steps == 1
    assert fresh.accountant.history == [(1.0, 0.25, 2)]
    assert fresh.get_privacy_spent()["epsilon"] == math.inf
    # a version-2 checkpoint whose accountant also holds the sigma = 0 step would count it twice: refused
    doubled = copy.deepcopy(v2)
    doubled["accountant"] = copy.deepcopy(engine.state_dict()["accountant"])
    other, _ = _engine(_model())
    with pytest.raises(ValueError, match="inconsistent checkpoint.*noiseless_steps"):
        other.load_state_dict(doubled)
    assert other.steps == 0 and other.accountant.ledger.steps == 0


def test_edited_sigma_zero_steps_are_refused():
    _, engine, _ = _phased_engine()
    state = copy.deepcopy(engine.state_dict())
    state["accountant"]["history"] = [e for e in state["accountant"]["history"] if e[0] != 0.0]
    fresh, _ = _engine(_model())
    with pytest.raises(ValueError, match="inconsistent checkpoint"):
        fresh.load_state_dict(state)  # hiding the step without noise would report a finite epsilon
    state = copy.deepcopy(engine.state_dict())
    state["accountant"]["history"][1][1] = 0.5  # a sigma = 0 step at another sample rate
    with pytest.raises(ValueError, match="sample rates"):
        fresh.load_state_dict(state)
    assert fresh.steps == 0


def test_record_release_joins_the_budget_and_the_checkpoint():
    model = _model()
    engine, opt = _engine(model)
    _step(model, opt)
    engine.record_release(Gaussian(5.0), label="eval")
    _step(model, opt)
    ref = RDPAccountant()
    ref.step(1.0, 0.25, 2)
    ref.record(Gaussian(5.0), label="eval")
    assert engine.get_privacy_spent()["epsilon"] == ref.get_epsilon(engine.target_delta)
    assert engine.get_privacy_spent()["epsilon"] > RDPAccountant().epsilon_of(
        Composed([PoissonSampledGaussian(1.0, 0.25)] * 2), engine.target_delta)
    assert engine.steps == 2 and engine.accountant.ledger.releases == 1
    assert [e.label for e in engine.accountant.ledger.entries] == ["step", "eval", "step"]
    state = engine.state_dict()
    fresh, _ = _engine(_model())
    fresh.load_state_dict(copy.deepcopy(state))
    assert fresh.accountant.ledger == engine.accountant.ledger
    assert fresh.get_privacy_spent() == engine.get_privacy_spent()
    engine.record_release(NonPrivate(), label="printed a training example")
    assert engine.get_privacy_spent()["epsilon"] == math.inf
    with pytest.raises(ValueError, match="not a DpEvent"):
        engine.record_release(5.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="label"):
        engine.record_release(Gaussian(1.0), label="step")
    assert engine.accountant.ledger.releases == 2


def test_steps_recorded_behind_the_engine_are_refused_releases_are_not():
    model = _model()
    engine, opt = _engine(model)
    _step(model, opt)
    engine.accountant.record(Gaussian(3.0), label="eval")  # a release through the accountant: fine
    _step(model, opt)
    engine.accountant.record_step(0.0, 0.25)  # a training step the engine did not take
    with pytest.raises(RuntimeError, match="changed outside the engine"):
        _step(model, opt)
    assert engine.steps == 2


def _budget_engine(model: nn.Module) -> tuple[PrivacyEngine, torch.optim.Optimizer]:
    return _engine(model, noise_multiplier=None, target_epsilon=8.0, steps=20, enforce_budget=True)


def test_enforce_budget_refuses_a_release_that_does_not_fit():
    model = _model()
    engine, opt = _budget_engine(model)
    with pytest.raises(PrivacyBudgetExceeded, match="release 'eval'.*not recorded"):
        engine.record_release(Gaussian(0.05), label="eval")
    assert engine.accountant.ledger.releases == 0
    with pytest.raises(PrivacyBudgetExceeded, match="inf"):
        engine.record_release(NonPrivate())
    for _ in range(3):
        _step(model, opt)  # the calibrated steps go on
    assert engine.steps == 3


def test_after_a_release_every_step_is_checked():
    """The calibration covers the planned steps alone: once a release used part of the budget, the step that
    would exceed it is refused even within the planned steps."""
    model = _model()
    engine, opt = _budget_engine(model)
    acc, d = engine.accountant, engine.target_delta
    step = PoissonSampledGaussian(engine.noise_multiplier, engine.sample_rate)
    lo, hi = 0.05, 100.0  # bisection on the release's sigma: it fits, but it and one step do not
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if acc.epsilon_after(Composed([Gaussian(mid), step]), d) > 8.0:
            lo = mid
        else:
            hi = mid
    release = Gaussian(lo)
    assert acc.epsilon_after(release, d) <= 8.0 < acc.epsilon_after(Composed([release, step]), d)
    engine.record_release(release, label="eval")
    with pytest.raises(PrivacyBudgetExceeded, match="step 1 would take epsilon"):
        _step(model, opt)
    assert engine.steps == 0 and engine.accountant.ledger.steps == 0


def test_budget_look_ahead_does_not_rebuild_an_accountant(monkeypatch):
    model = _model()
    engine, opt = _budget_engine(model)
    engine.set_noise_multiplier(engine.noise_multiplier * 1.01)  # outside the calibration: every step checked

    def refuse(*a, **k):
        raise AssertionError("the look-ahead rebuilt an accountant by name")

    monkeypatch.setattr(accounting, "make_accountant", refuse)
    expected = engine.accountant.epsilon_after(PoissonSampledGaussian(engine.noise_multiplier, engine.sample_rate),
                                               engine.target_delta)
    _step(model, opt)
    assert engine.get_privacy_spent()["epsilon"] == expected


def test_a_checkpoint_of_other_trainable_parameters_is_refused():
    """A checkpoint carries the trainable parameters' names and shapes (version 5): loading it into an engine of
    another model (another output size) or with another parameter frozen is refused, naming them; a version 4
    checkpoint, without them, still loads."""
    _, engine, _ = _phased_engine()
    state = engine.state_dict()
    assert state["trainable"] == {"bias": [1], "weight": [1, D]}

    def fresh(model: nn.Module) -> PrivacyEngine:
        return PrivacyEngine(model, batch_size=16, sample_size=64, noise_multiplier=1.0, accountant="rdp")

    with pytest.raises(ValueError, match=r"other trainable parameters \(bias: saved \[1\], this engine \[3\]"):
        fresh(nn.Linear(D, 3).double()).load_state_dict(copy.deepcopy(state))
    frozen = _model()
    frozen.bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"other trainable parameters \(bias: saved \[1\], this engine None"):
        fresh(frozen).load_state_dict(copy.deepcopy(state))
    v4 = copy.deepcopy(state)
    v4["version"] = 4
    del v4["trainable"]
    resumed = fresh(_model())
    resumed.load_state_dict(v4)
    assert resumed.steps == engine.steps == 3
