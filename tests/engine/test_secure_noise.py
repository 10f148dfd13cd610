"""Secure noise (fastdp.noise.secure_*): CSPRNG-filled generator state, the four-Gaussian sum, its statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from fastdp import noise
from fastdp.noise import secure_gaussian, secure_generator, secure_noisy_mean

N = 1_000_000
_MT = slice(noise._MT_OFFSET, noise._MT_OFFSET + 8 * noise._MT_WORDS)


def test_cpu_manual_seed_keeps_only_32_bits():
    """Why the CPU generator's whole state is filled from os.urandom (docs/guide/secure-mode.md states this)."""
    a, b = torch.Generator(), torch.Generator()
    a.manual_seed(12345)
    b.manual_seed(12345 + 2**32)
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))


def test_cpu_state_layout_is_recognised():
    assert noise._cpu_state_layout_ok()


def test_secure_generator_fills_the_whole_cpu_state():
    g1, g2 = secure_generator(), secure_generator("cpu")
    assert g1.device.type == "cpu"
    w1 = g1.get_state()[_MT].view(torch.int64)
    w2 = g2.get_state()[_MT].view(torch.int64)
    assert (w1 != w2).float().mean() > 0.99
    assert int(w1.max()) < 2**32 and int(w1.min()) >= 0
    # not the Mersenne-Twister initialisation from a seed: word 1 is not a function of word 0
    s0 = int(w1[0])
    assert int(w1[1]) != (1812433253 * (s0 ^ (s0 >> 30)) + 1) & 0xFFFFFFFF
    # the words look uniform on 32 bits: their mean is within 6 standard errors of 2^31
    mean = w1.double().mean().item()
    assert abs(mean - 2**31) < 6 * (2**32 / math.sqrt(12)) / math.sqrt(noise._MT_WORDS)
    assert not torch.equal(torch.rand(16, generator=g1), torch.rand(16, generator=g2))


def test_secure_generator_is_independent_of_the_global_seed():
    torch.manual_seed(0)
    a = torch.rand(4, generator=secure_generator())
    torch.manual_seed(0)
    b = torch.rand(4, generator=secure_generator())
    assert not torch.equal(a, b)


def test_secure_gaussian_does_not_touch_the_global_rng():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    secure_gaussian((10,), 1.0)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("std", [1.0, 2.5e-3])
def test_secure_gaussian_statistics(std):
    """Mean, variance (chi-square bounds) and shape (Kolmogorov-Smirnov against N(0, std^2)) of 10^6 draws.

    The bounds have false-failure probability about 1e-6 each; a wrong scale (no division by 2: std 2x; division by
    4: std / 2) or a lost summand (std * sqrt(3) / 2) fails them by hundreds of standard errors.
    """
    x = secure_gaussian((1000, 1000), std, dtype=torch.float64).flatten().numpy()
    assert x.dtype == np.float64 and x.shape == (N,)
    assert abs(x.mean()) < 5 * std / math.sqrt(N)
    chi2 = (N - 1) * x.var(ddof=1) / std**2
    assert stats.chi2.ppf(1e-6, N - 1) < chi2 < stats.chi2.isf(1e-6, N - 1)
    assert stats.kstest(x / std, "norm").pvalue > 1e-6
    assert abs(stats.kurtosis(x)) < 5 * math.sqrt(24 / N)  # excess kurtosis of a Gaussian is 0


def test_secure_gaussian_calls_differ():
    a, b = secure_gaussian(1000, 1.0), secure_gaussian(1000, 1.0)
    assert a.shape == (1000,) and not torch.equal(a, b)
    assert (a == b).sum() == 0


def test_secure_gaussian_dtypes_and_zero_std():
    assert secure_gaussian((2, 3), 1.0).dtype == torch.float32
    assert secure_gaussian((2, 3), 1.0, dtype=torch.float64).dtype == torch.float64
    assert secure_gaussian([4], 1.0, dtype=torch.float16).dtype == torch.float32  # never half-precision noise
    assert secure_gaussian(torch.Size([2]), 1.0, dtype=torch.bfloat16).dtype == torch.float32
    z = secure_gaussian((3, 2), 0.0, "cpu", torch.float64)
    assert z.dtype == torch.float64 and torch.equal(z, torch.zeros(3, 2, dtype=torch.float64))
    assert secure_gaussian((0, 5), 1.0).shape == (0, 5)


@pytest.mark.parametrize("std, match", [(-1.0, "std=-1.0"), (float("nan"), "std=nan"), (float("inf"), "std=inf"),
                                        (True, "std=True"), ("1", "std='1'")])
def test_secure_gaussian_rejects_bad_std(std, match):
    with pytest.raises(ValueError, match=match):
        secure_gaussian(3, std)


def test_secure_gaussian_rejects_integer_dtype():
    with pytest.raises(ValueError, match="torch.int64 is not a floating dtype"):
        secure_gaussian(3, 1.0, dtype=torch.int64)


def test_secure_noisy_mean():
    p = torch.zeros(200_000, dtype=torch.float16)
    g = secure_noisy_mean(p, None, 3.0, 10)
    assert g.dtype == torch.float16 and g.shape == p.shape
    assert abs(g.float().std().item() - 0.3) < 0.003  # sd of the sample sd ~ 0.3 / sqrt(2 n) = 5e-4
    s = torch.randn(5, dtype=torch.float64)
    torch.testing.assert_close(secure_noisy_mean(torch.zeros(5, dtype=torch.float64), s, 0.0, 4), s / 4,
                               rtol=0, atol=0)
    a = secure_noisy_mean(torch.zeros(5), s, 1.0, 4)
    b = secure_noisy_mean(torch.zeros(5), s, 1.0, 4)
    assert a.dtype == torch.float32 and not torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_secure_gaussian_on_cuda():
    g = secure_generator("cuda")
    assert g.device.type == "cuda"
    x = secure_gaussian((1000, 1000), 2.0, "cuda")
    assert x.device.type == "cuda" and x.dtype == torch.float32
    assert abs(x.double().std().item() - 2.0) < 5 * 2.0 / math.sqrt(2 * N)
    assert not torch.equal(x, secure_gaussian((1000, 1000), 2.0, "cuda"))
