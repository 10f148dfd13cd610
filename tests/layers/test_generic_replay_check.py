"""The generic path's replay check: a module whose one-sample-at-a-time replay does not reproduce its real output
(it mixes the samples of the batch) stops the step, in the backward pass on the CPU and when the step is released
on an accelerator (``fastdp.deferred``; the accelerator behaviour is switched on here on the CPU)."""

from __future__ import annotations

import pytest
import torch
from oracle import make_engine, mse_per_sample
from torch import nn

import fastdp.deferred as deferred
from fastdp.layers.generic import _REPLAY_RTOL, _mismatch


class Mixer(nn.Module):
    """A raw parameter (the generic path) and a forward that adds the batch mean: samples are mixed."""

    def __init__(self, d: int, mix: bool) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, d, dtype=torch.float64))
        self.mix = mix

    def forward(self, h):
        return h * self.s + (h.mean(0, keepdim=True) if self.mix else 0.0)


def _setup(mix: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4).double(), Mixer(4, mix), nn.Linear(4, 2).double())
    engine = make_engine(model, batch_size=4, R=1.0, verify_structure=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    return model, engine, opt, x, y


def test_on_the_cpu_the_backward_pass_raises():
    model, engine, opt, x, y = _setup(mix=True)
    with pytest.raises(RuntimeError, match=r"does not reproduce output 0"):
        mse_per_sample(model(x), y).mean().backward()
    assert engine.steps == 0


def test_deferred_the_step_raises_and_releases_nothing(monkeypatch):
    monkeypatch.setattr(deferred, "DEFER_ON", {"cpu": True, "default": True})
    model, engine, opt, x, y = _setup(mix=True)
    before = [p.detach().clone() for p in model.parameters()]
    mse_per_sample(model(x), y).mean().backward()  # no error here
    assert len(engine._release.deferred_checks) == 1
    with pytest.raises(RuntimeError, match=r"step 1 \(checked when the step was released.*does not reproduce output 0 "
                                           r".*max difference [0-9.e-]+\)"):
        opt.step()
    assert engine.steps == 0 and engine.accountant.ledger.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert engine._release.deferred_checks == [] and engine._release.summed == {}


def test_deferred_a_faithful_replay_passes(monkeypatch):
    monkeypatch.setattr(deferred, "DEFER_ON", {"cpu": True, "default": True})
    model, engine, opt, x, y = _setup(mix=False)
    mse_per_sample(model(x), y).mean().backward()
    assert len(engine._release.deferred_checks) == 1
    opt.step()
    assert engine.steps == 1 and engine._release.deferred_checks == []


def _close_reference(got, want, rtol):
    """The check as it was written with host reads (before it was made a device tensor)."""
    scale = want.abs().max().item() if want.numel() else 0.0
    if not (scale == scale and abs(scale) != float("inf")):
        return bool(torch.equal(got.isfinite(), want.isfinite())) and torch.allclose(
            got[want.isfinite()], want[want.isfinite()], rtol=rtol, atol=rtol)
    return torch.allclose(got, want, rtol=rtol, atol=rtol * max(scale, 1e-30))


@pytest.mark.parametrize("case", range(12))
def test_the_device_verdict_equals_the_host_one(case):
    g = torch.Generator().manual_seed(case)
    want = torch.randn(5, 6, generator=g, dtype=torch.float64)
    got = want.clone()
    if case % 4 == 1:
        got[2, 3] += 1e-5 * want.abs().max()  # beyond rtol 1e-7 (float64)
    if case % 4 == 2:
        got += 1e-9 * want.abs().max()  # within
    if case >= 4:
        want[1, 1] = float("inf") if case < 8 else float("nan")
        got[1, 1] = want[1, 1] if case % 2 == 0 else 0.0
    if case == 11:
        got[0, 0] = float("nan")
    rtol = _REPLAY_RTOL[torch.float64]
    assert bool(~_mismatch(got, want)) == _close_reference(got, want, rtol), case


def test_autocast_rounding_is_not_a_mismatch_but_a_wrong_replay_is():
    """Under autocast a float32 output computed through bf16 products is compared at the autocast dtype's tolerance
    (found by a red-team pass: T5's attention blocks under bf16 autocast differed from their one-sample replays by
    0.008 and the model was refused); an O(1) difference is still a mismatch."""
    want = torch.randn(8, 20, 16, generator=torch.Generator().manual_seed(0))
    rounded = want + 0.008 * torch.sign(torch.randn(8, 20, 16, generator=torch.Generator().manual_seed(1)))
    bf16 = (("cpu", torch.bfloat16),)
    assert bool(_mismatch(rounded, want))  # float32 without autocast: 0.008 is a mismatch
    assert not bool(_mismatch(rounded, want, bf16))
    assert bool(_mismatch(want.flip(0), want, bf16))  # samples reordered
    assert bool(_mismatch(want * 1.5, want, bf16))
