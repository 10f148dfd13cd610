"""Training audits: Dirac gradient canaries under fastdp's engine (against the brute-force oracle), the one-run
audit of DP-SGD (never above the claimed epsilon, and above it when the noise is weaker than claimed), loss
scores, and audit_training's contract."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import fastdp
from fastdp.audit import DiracCanaries, audit_training, loss_scores
from fastdp.modes import MODES
from tests.oracle import compare_engine_to_oracle

DELTA = 1e-5


class Audited(nn.Module):
    """A small classifier plus Dirac canaries; returns (logits, canary loss term, real-row mask)."""

    def __init__(self, d: int, m: int, scale: float = 1.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 6), nn.Tanh(), nn.Linear(6, 3))
        self.canaries = DiracCanaries(m, scale=scale)

    def forward(self, x: torch.Tensor, idx: torch.Tensor):
        return self.net(x), self.canaries(idx), (idx < 0).to(x.dtype)


def _loss(out, y: torch.Tensor) -> torch.Tensor:
    logits, canary, real = out
    return nn.functional.cross_entropy(logits, y, reduction="none") * real + canary


def test_dirac_canary_gradient_is_exactly_scale_e_j() -> None:
    torch.manual_seed(0)
    model = Audited(4, 5, scale=2.5).double()
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.tensor([0, 1, 2])
    idx = torch.tensor([-1, 3, 0])
    for i in range(3):
        model.zero_grad()
        _loss(model(x[i:i + 1], idx[i:i + 1]), y[i:i + 1]).sum().backward()
        g_theta = model.canaries.linear.weight.grad[0]
        g_net = torch.cat([p.grad.flatten() for p in model.net.parameters()])
        if idx[i] < 0:  # a real row: nothing on theta
            assert torch.count_nonzero(g_theta) == 0 and torch.count_nonzero(g_net) > 0
        else:  # canary j: exactly scale * e_j on theta, nothing on the network
            want = torch.zeros(5, dtype=torch.float64)
            want[idx[i]] = 2.5
            assert torch.equal(g_theta, want) and torch.count_nonzero(g_net) == 0


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("B", [1, 5, 6])  # 1; 5 = the number of canaries; 6 = the hidden width
def test_engine_clips_dirac_canaries_exactly(mode: str, B: int) -> None:
    torch.manual_seed(1)
    model = Audited(4, 5, scale=3.0).double()
    x, y = torch.randn(B, 4, dtype=torch.float64), torch.randint(0, 3, (B,))
    idx = torch.tensor([-1, 2, 4, -1, 0, 1][:B])
    compare_engine_to_oracle(model, _loss, [((x, idx), y)], mode=mode, fn="abadi", R=1.0)


def test_dirac_canaries_bad_inputs() -> None:
    with pytest.raises(ValueError, match="num_canaries=0 must be a positive integer"):
        DiracCanaries(0)
    with pytest.raises(ValueError, match="scale=-1 must be a finite number > 0"):
        DiracCanaries(3, scale=-1)
    c = DiracCanaries(3)
    with pytest.raises(ValueError, match=r"canary_index values must be in \[-1, 2\]"):
        c(torch.tensor([3]))
    with pytest.raises(ValueError, match="canary_index must be a \\(B,\\) long tensor"):
        c(torch.tensor([0.0]))
    assert c(torch.zeros(0, dtype=torch.long)).shape == (0,)


# ------------------------------------------------------------------------------------------------ DP-SGD audits
def _train_fn(m: int, steps: int, *, noise_for: float | None, claim: dict, n_real: int = 200):
    """Full-batch SGD on real rows + the included Dirac canaries; DP-SGD with the noise of ``noise_for``."""

    def train(membership: np.ndarray) -> Audited:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        inc = torch.from_numpy(np.flatnonzero(membership)).long()
        x = torch.cat([torch.randn(n_real, 4, generator=g), torch.zeros(len(inc), 4)])
        y = torch.cat([torch.randint(0, 3, (n_real,), generator=g), torch.zeros(len(inc), dtype=torch.long)])
        idx = torch.cat([torch.full((n_real,), -1, dtype=torch.long), inc])
        n = x.shape[0]
        model = Audited(4, m)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        engine = None
        if noise_for is not None:
            engine = fastdp.PrivacyEngine(model, batch_size=n, sample_size=n, steps=steps, target_epsilon=noise_for,
                                          target_delta=DELTA, noise_generator=torch.Generator().manual_seed(1))
            engine.attach(opt)
        for _ in range(steps):
            _loss(model(x, idx), y).mean().backward()
            opt.step()
            opt.zero_grad()
        claim["eps"] = math.inf if engine is None else engine.get_privacy_spent()["epsilon"]
        if engine is not None:
            engine.detach()
        return model

    return train


@pytest.mark.parametrize("eps", [1.0, 8.0])
def test_dp_sgd_audit_stays_below_the_claim(eps: float) -> None:
    claim: dict = {}
    res = audit_training(_train_fn(400, 4, noise_for=eps, claim=claim), lambda mdl: mdl.canaries.scores(), 400,
                         DELTA, seed=0)
    assert claim["eps"] <= eps + 1e-9
    assert res.epsilon_lower_bound <= claim["eps"], res
    if eps == 8.0:  # full-batch Dirac canaries are a strong audit: measured 2.2 at eps = 8 (m = 400)
        assert res.epsilon_lower_bound >= 0.2 * eps, res
    assert res.extra["membership"].shape == (400,) and res.extra["scores"].shape == (400,)


def test_non_private_training_is_caught() -> None:
    claim: dict = {}
    res = audit_training(_train_fn(400, 2, noise_for=None, claim=claim), lambda mdl: mdl.canaries.scores(), 400,
                         DELTA, claimed_epsilon=1.0, seed=0)
    assert res.num_correct == res.num_guesses and res.epsilon_lower_bound > 3.5 and res.exceeds_claim


def test_dp_sgd_with_less_noise_than_claimed_is_caught() -> None:
    # the noise of eps = 8 while eps = 1 is claimed (a miscalibration bug): the audit refutes the claim
    claim: dict = {}
    res = audit_training(_train_fn(400, 4, noise_for=8.0, claim=claim), lambda mdl: mdl.canaries.scores(), 400,
                         DELTA, claimed_epsilon=1.0, seed=0)
    assert res.exceeds_claim, res


def test_loss_scores_and_audit_training_contract() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 0, 1, 1])
    s = loss_scores(model, x, y)
    assert s.shape == (5,) and s.dtype == torch.float64 and model.training
    want = -nn.functional.cross_entropy(model(x), y, reduction="none").double()
    assert torch.allclose(s, want.detach())
    seen = {}

    def train(mem: np.ndarray) -> np.ndarray:
        seen["mem"] = mem
        return mem.astype(float)

    res = audit_training(train, lambda scores: scores, 50, DELTA, seed=3, guess_counts=[(5, 5)])
    assert np.array_equal(seen["mem"], res.extra["membership"]) and seen["mem"].dtype == np.bool_
    assert res.num_correct == res.num_guesses == 10  # the scores were the membership itself
    with pytest.raises(ValueError, match="scores must be a non-empty 1-D array"):
        audit_training(train, lambda scores: scores[:, None], 50, DELTA)
