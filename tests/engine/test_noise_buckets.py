"""Noise drawn in buckets (``fastdp.noise.NOISE_BUCKETS``, off by default; meant for accelerators, where each draw
and add of the per-parameter release is a kernel launch): one draw and one fused add per bucket of parameters, larger
parameters in place in chunks. Tested on the CPU with the switch on for it: the clipped sums are released exactly,
the noise has the stated scale and is independent across parameters, seeded runs repeat, dtypes are kept."""

from __future__ import annotations

import copy

import pytest
import torch
from oracle import make_engine, released_grads, trainable_names
from torch import nn

from fastdp import noise


@pytest.fixture
def buckets(monkeypatch):
    monkeypatch.setattr(noise, "NOISE_BUCKETS", frozenset({"cpu"}))
    return monkeypatch


def _params(*shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g, dtype=dtype) for s in shapes]


def test_buckets_release_the_clipped_sums_exactly(buckets):
    buckets.setattr(noise, "BUCKET_NUMBERS", 50)  # several buckets, and a parameter of its own in chunks
    params = _params((3, 4), (7,), (10, 10), (5,), (2, 2, 2), (0,))
    sums = {p: torch.randn(p.shape, dtype=p.dtype) * 3 for p in params[:-2]}  # (2,2,2) and (0,): noise only
    want = {id(p): s / 8 for p, s in sums.items()}
    got = noise.noisy_means(params, dict(sums), 1e-30, 8)
    for p, g in zip(params, got, strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype
        if id(p) in want:
            torch.testing.assert_close(g, want[id(p)], rtol=1e-6, atol=1e-6)
        else:
            assert g.abs().max() < 1e-29 if g.numel() else True


def test_bucket_noise_has_the_stated_scale_and_is_independent(buckets):
    params = _params((300, 200), (100, 300), (50_000,))
    std, B = 2.0, 4
    got = noise.noisy_means(params, {}, std, B, torch.Generator().manual_seed(1))
    for g in got:
        n = g.numel()
        assert abs(float(g.mean())) < 6 * (std / B) / n**0.5
        assert abs(float(g.std()) / (std / B) - 1) < 6 / (2 * n) ** 0.5
    a, b = got[0].flatten()[:20_000], got[1].flatten()[:20_000]
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 6 / 20_000**0.5  # not the same numbers


def test_buckets_repeat_under_a_seed_and_differ_across_seeds(buckets):
    params = _params((30, 20), (7,))
    runs = [noise.noisy_means(params, {}, 1.0, 2, torch.Generator().manual_seed(s)) for s in (3, 3, 4)]
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1], strict=True))
    assert not torch.equal(runs[0][0], runs[2][0])


def test_buckets_keep_each_parameters_dtype(buckets):
    params = [*_params((4, 3)), *_params((5,), dtype=torch.float64), *_params((6,), dtype=torch.bfloat16)]
    sums = {p: torch.ones(p.shape, dtype=noise.noise_dtype(p)) for p in params}
    got = noise.noisy_means(params, dict(sums), 1e-30, 2)
    assert [g.dtype for g in got] == [torch.float32, torch.float64, torch.bfloat16]
    for g in got:
        torch.testing.assert_close(g.double(), torch.full(g.shape, 0.5, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_a_parameter_larger_than_a_bucket_is_released_in_place(buckets):
    buckets.setattr(noise, "BUCKET_NUMBERS", 64)
    (p,) = _params((20, 10))
    s = torch.randn(20, 10)
    want = s / 4
    got = noise.noisy_means([p], {p: s}, 1e-30, 4)[0]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got.data_ptr() == s.data_ptr()  # the sum's storage became the gradient (no second tensor)


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost"])
def test_the_engine_releases_the_same_with_buckets(mode, monkeypatch):
    """A whole step with noise so small it is below float64 rounding of the sums: the release with buckets equals
    the per-parameter release; training goes on (the gradients are views of one buffer: SGD and zero_grad work)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    released = []
    calls = []
    real = noise._bucketed_noisy_means
    monkeypatch.setattr(noise, "_bucketed_noisy_means", lambda *a: calls.append(1) or real(*a))
    for on in (False, True):
        monkeypatch.setattr(noise, "NOISE_BUCKETS", frozenset({"cpu"}) if on else frozenset())
        m = copy.deepcopy(model)
        engine = make_engine(m, batch_size=6, R=0.5, mode=mode, sigma=1e-300)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        engine.attach(opt)
        for _ in range(2):
            opt.zero_grad()
            (0.5 * (m(x) - y).pow(2).sum(1)).mean().backward()
            opt.step()
        released.append((released_grads(m, trainable_names(m)), [p.detach().clone() for p in m.parameters()]))
        engine.detach()
    assert len(calls) == 2  # the second run's two steps went through the buckets
    (g0, p0), (g1, p1) = released
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-12, atol=0)
    for a, b in zip(p0, p1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
