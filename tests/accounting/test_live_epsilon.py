"""Live epsilon (fastdp.accounting.live): the RDP bound of the ledger, exact against the RDP accountant, never
below the PRV value the engine reports."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fastdp.accounting import Gaussian, Ledger, NonPrivate, PRVAccountant, RDPAccountant
from fastdp.accounting.live import live_epsilon
from tests.oracle import make_engine


def _mixed_ledger() -> Ledger:
    led = Ledger()
    led.record_step(1.1, 0.01, 300)
    led.record_step(0.9, 0.02, 50)
    led.record(Gaussian(20.0), label="eval")
    led.record_step(1.1, 0.01, 7)  # non-adjacent repeat of the first phase
    return led


def test_live_equals_rdp_accountant_and_bounds_prv():
    led = _mixed_ledger()
    rdp, prv = RDPAccountant(), PRVAccountant()
    want = rdp.epsilon_of(led, 1e-5)
    got = live_epsilon(led, 1e-5)
    assert got == pytest.approx(want, rel=1e-12)
    assert got >= prv.epsilon_of(led, 1e-5)
    assert 0 < got < 20


def test_live_grows_with_steps_and_matches_each_prefix():
    led = Ledger()
    prev = 0.0
    for t in range(1, 30):
        led.record_step(1.0, 0.05)
        eps = live_epsilon(led, 1e-5)
        assert eps > prev
        assert eps == pytest.approx(RDPAccountant().epsilon_of(led, 1e-5), rel=1e-12), t
        prev = eps


def test_live_empty_nonprivate_and_bad_input():
    led = Ledger()
    assert live_epsilon(led, 1e-5) == 0.0
    led.record_step(1.0, 0.1)
    led.record(NonPrivate(), label="leak")
    assert math.isinf(live_epsilon(led, 1e-5))
    led2 = Ledger()
    led2.record_step(0.0, 0.1)
    assert math.isinf(live_epsilon(led2, 1e-5))
    with pytest.raises(ValueError, match="delta"):
        live_epsilon(Ledger(), 1.5)
    with pytest.raises(ValueError, match="not a fastdp.accounting.Ledger"):
        live_epsilon([(1.0, 0.1, 3)], 1e-5)  # type: ignore[arg-type]


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_engine_live_epsilon(accountant):
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    eng = make_engine(model, batch_size=4, sigma=1.2, sample_size=40, accountant=accountant)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng.attach(opt)
    assert eng.live_epsilon() == 0.0
    for _ in range(5):
        model(torch.randn(4, 3, dtype=torch.float64)).pow(2).sum(1).mean().backward()
        opt.step()
        opt.zero_grad()
    live = eng.live_epsilon()
    spent = eng.get_privacy_spent()["epsilon"]
    assert live == pytest.approx(RDPAccountant().epsilon_of(eng.accountant.ledger, eng.target_delta), rel=1e-12)
    if accountant == "rdp":
        assert live == pytest.approx(spent, rel=1e-12)
    else:
        assert live >= spent
    assert eng.live_epsilon(1e-6) > live  # a smaller delta (default 1/80), a larger epsilon
