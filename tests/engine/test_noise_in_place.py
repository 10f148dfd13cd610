"""A large clipped sum becomes its released gradient in place (``fastdp.noise._noisy_mean_in_place``): its noise
is drawn in chunks of ``NOISE_CHUNK`` numbers into one buffer, so the release holds one chunk more instead of a
second tensor of the parameter's size. On CPU the chunks draw exactly the numbers one draw would, so the released
gradient is bitwise the one of the fresh-buffer path (checked here at chunk boundaries, with and without noise, on
one thread and two, and through the engine); sums the path cannot overwrite keep the fresh buffer."""

from __future__ import annotations

import pytest
import torch
from oracle import make_engine, mse_per_sample, user_loss
from torch import nn

from fastdp import noise


def _fresh(param, clipped_sum, std, batch_size, seed):
    """The fresh-buffer path of :func:`noise.noisy_mean` (noise drawn for the whole tensor, the sum added)."""
    g = torch.Generator().manual_seed(seed)
    out = noise.gaussian_noise(param, std / batch_size, g)
    return out.add_(clipped_sum.to(out.dtype), alpha=1.0 / batch_size).to(param.dtype)


@pytest.mark.parametrize("n", [65, 64 * 2, 64 * 3 + 5, 64 * 3 + 16, 64 * 5 + 63])
@pytest.mark.parametrize("std", [0.0, 1.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_in_place_release_is_bitwise_the_fresh_one(n, std, dtype, monkeypatch):
    monkeypatch.setattr(noise, "NOISE_CHUNK", 64)
    param = torch.zeros(n, dtype=dtype)
    total = torch.randn(n, dtype=dtype)
    want = _fresh(param, total, std, 3, seed=11)
    got = noise.noisy_mean(param, total, std, 3, torch.Generator().manual_seed(11))
    assert got.data_ptr() == total.data_ptr()  # written into the sum: no second tensor of the parameter's size
    assert torch.equal(got, want)


@pytest.mark.parametrize("case", ["small", "half", "strided", "grad", "bucket view"])
def test_sums_it_cannot_overwrite_keep_the_fresh_buffer(case, monkeypatch):
    """At most one chunk, a bfloat16 parameter (float32 sum, bfloat16 gradient), a non-contiguous sum, a sum that
    requires grad, a view into a larger buffer: a fresh tensor, the same numbers."""
    monkeypatch.setattr(noise, "NOISE_CHUNK", 16)
    param, total = torch.zeros(8, 40), torch.randn(8, 40)
    if case == "small":
        param, total = torch.zeros(16), torch.randn(16)
    elif case == "half":
        param = param.bfloat16()
    elif case == "strided":
        total = torch.randn(40, 8).t()
    elif case == "grad":
        total.requires_grad_(True)
    elif case == "bucket view":  # rows of a larger buffer (a sharded bucket): others share its storage
        total = torch.randn(2 * 320)[:320].view(8, 40)
    got = noise.noisy_mean(param, total, 1.0, 2, torch.Generator().manual_seed(5))
    assert got.data_ptr() != total.data_ptr() and got.shape == param.shape and got.dtype == param.dtype
    assert torch.equal(got, _fresh(param, total.detach(), 1.0, 2, seed=5))


def test_the_engine_releases_the_same_gradients_with_chunks(monkeypatch):
    """A model with a parameter of many chunks, seeded noise, the parallel draw on: the same released gradients
    whatever the chunk size (the in-place path against a chunk larger than every parameter)."""
    monkeypatch.setattr(noise, "NOISE_THREADS", 2)
    monkeypatch.setattr(noise, "PARALLEL_NOISE_MIN", 1)

    def release(chunk):
        monkeypatch.setattr(noise, "NOISE_CHUNK", chunk)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(300, 16), nn.Flatten(), nn.Linear(16 * 4, 3))
        engine = make_engine(model, batch_size=5, sigma=0.8, noise_generator=torch.Generator().manual_seed(9))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        engine.attach(opt)
        x, y = torch.randint(0, 300, (5, 4)), torch.randn(5, 3)
        user_loss(mse_per_sample(model(x), y), "mean").backward()
        opt.step()
        return [p.grad.clone() for p in model.parameters()]

    small, large = release(64), release(1 << 30)
    assert all(torch.equal(a, b) for a, b in zip(small, large, strict=True))
    assert any(p.abs().sum() > 0 for p in small)
