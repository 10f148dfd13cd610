"""fastdp.dpfp.RepresentationNoise and insert_noise against a per-sample float64 oracle.

Oracle: each sample's flattened representation clipped on its own (a batch of one, float64), then the same noise draw
(same seeded generator) added. Sizes: batches 0, 1, 3 and B = k (the batch size equal to the representation size).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fastdp.dpfp import RepresentationNoise, insert_noise

D = torch.float64


def oracle(x: torch.Tensor, c: float, s: float, seed: int) -> torch.Tensor:
    rows = []
    for i in range(x.shape[0]):
        v = x[i : i + 1].reshape(1, -1).to(D)
        n = float(v.norm())
        rows.append((v * min(1.0, c / n) if n > 0 else v).reshape(x[i : i + 1].shape))
    clipped = torch.cat(rows) if rows else x.to(D)
    g = torch.Generator().manual_seed(seed)
    return clipped + torch.randn(x.shape, generator=g, dtype=D) * (s * c)


@pytest.mark.parametrize("shape", [(0, 4), (1, 4), (3, 4), (4, 4), (3, 2, 5), (6,), (10, 10)])
def test_matches_per_sample_oracle(shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=D) * 3
    if x.numel():
        x[0] = x[0] * 0.01  # one sample below the clip norm, left unchanged
    layer = RepresentationNoise(2.0, 0.7, generator=torch.Generator().manual_seed(5))
    out = layer(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    if x.shape[0] == 0:
        assert out.numel() == 0
        return
    want = oracle(x, 2.0, 0.7, 5)
    assert torch.allclose(out, want, rtol=1e-6, atol=1e-12), (out - want).abs().max()


def test_clip_norm_per_sample():
    x = torch.randn(50, 3, 7) * torch.logspace(-3, 3, 50).view(50, 1, 1)
    clipped = RepresentationNoise(1.5, 0.0)(x)  # s = 0: clip only
    norms = clipped.reshape(50, -1).norm(dim=1)
    assert (norms <= 1.5 * (1 + 1e-6)).all()
    big = x.reshape(50, -1).norm(dim=1) > 1.5
    assert big.any() and (~big).any()
    assert torch.allclose(norms[big], torch.full_like(norms[big], 1.5), rtol=1e-5)
    assert torch.equal(clipped[~big], x[~big])  # below C: untouched
    # direction kept
    cos = torch.nn.functional.cosine_similarity(clipped.reshape(50, -1), x.reshape(50, -1), dim=1)
    assert torch.allclose(cos, torch.ones(50), atol=1e-5)


def test_noise_std_and_independence():
    layer = RepresentationNoise(2.0, 0.5, generator=torch.Generator().manual_seed(1))
    out = layer(torch.zeros(4000, 8))  # noise only: std s C = 1.0
    n = out.numel()
    assert abs(out.std().item() - 1.0) < 5 / math.sqrt(2 * n)
    assert abs(out.mean().item()) < 5 / math.sqrt(n)
    corr = torch.corrcoef(out[:, :2].T)[0, 1].item()  # coordinates independent
    assert abs(corr) < 5 / math.sqrt(4000)
    again = layer(torch.zeros(4000, 8))
    assert not torch.equal(out, again)  # fresh per forward


def test_eval_identity_and_gradient():
    layer = RepresentationNoise(1.0, 3.0)
    x = torch.randn(5, 3, requires_grad=True) * 10
    layer.eval()
    assert layer(x) is x
    layer.train()
    big = RepresentationNoise(1e6, 1.0, generator=torch.Generator().manual_seed(0))
    y = torch.randn(4, 3, requires_grad=True)
    big(y).sum().backward()
    assert torch.allclose(y.grad, torch.ones_like(y))  # no clipping at C = 1e6: gradient passes through


def test_bad_input():
    with pytest.raises(ValueError, match="clip_norm"):
        RepresentationNoise(0.0, 1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        RepresentationNoise(1.0, -1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        RepresentationNoise(1.0, float("nan"))
    with pytest.raises(ValueError, match="sample dimension"):
        RepresentationNoise(1.0, 1.0)(torch.tensor(3.0))
    with pytest.raises(TypeError, match="floating-point"):
        RepresentationNoise(1.0, 1.0)(torch.ones(3, 2, dtype=torch.int64))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 6)
        self.classifier = nn.Linear(6, 2)

    def forward(self, x):
        return self.classifier(self.enc(x))


def test_insert_noise_input_output_and_remove():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(5, 4)
    plain = net(x)
    seen = {}
    handle = insert_noise(net, "classifier", RepresentationNoise(0.1, 0.0))  # clip only: deterministic
    spy = net.classifier.register_forward_pre_hook(lambda m, a: seen.__setitem__("h", a[0]))  # runs after the noise
    out = net(x)
    assert (seen["h"].norm(dim=1) <= 0.1 * (1 + 1e-6)).all()
    assert not torch.allclose(out, plain)
    net.eval()
    assert torch.allclose(net(x), plain)  # identity in eval mode
    net.train()
    handle.remove()
    spy.remove()
    assert not handle.active and torch.allclose(net(x), plain)
    h2 = insert_noise(net, "enc", RepresentationNoise(0.1, 0.0), where="output")
    assert torch.allclose(net(x), net.classifier(RepresentationNoise(0.1, 0.0)(net.enc(x))))
    h2.remove()
    with pytest.raises(ValueError, match="no submodule 'head'"):
        insert_noise(net, "head", RepresentationNoise(1.0, 1.0))
    with pytest.raises(ValueError, match="where="):
        insert_noise(net, "enc", RepresentationNoise(1.0, 1.0), where="middle")


def test_concatenated_forward_equals_separate_micro_batches():
    """The noise is per sample: one forward on the concatenation of M micro-batches clips each row as M forwards do
    (checked without noise; with noise, each row's draw is independent of the others by construction)."""
    layer = RepresentationNoise(1.0, 0.0)
    parts = [torch.randn(n, 5) * 4 for n in (0, 2, 1, 3)]
    assert torch.equal(layer(torch.cat(parts)), torch.cat([layer(p) for p in parts]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_rows_never_exceed_the_clip_norm(dtype):
    """Rounding the clipped rows to half precision may lengthen them by the unit roundoff (up to 1.004 C in
    bfloat16 before the margin): every returned row, measured exactly, has norm <= C, and clipping costs at most
    2 eps of it."""
    g = torch.Generator().manual_seed(3)
    layer = RepresentationNoise(1.0, 0.0)
    eps = torch.finfo(dtype).eps
    for _ in range(50):
        x = (torch.randn(64, 96, generator=g) * 10).to(dtype)
        out = layer.clip(x)
        assert out.dtype == dtype
        n = out.double().norm(dim=1)
        assert (n <= 1.0).all(), float(n.max())
        assert (n >= 1.0 - 2 * eps).all(), float(n.min())


def test_secure_mode():
    with pytest.raises(ValueError, match="secure_mode"):
        RepresentationNoise(1.0, 1.0, generator=torch.Generator(), secure_mode=True)
    layer = RepresentationNoise(2.0, 0.5, secure_mode=True)
    out = layer(torch.zeros(2000, 8))
    assert abs(out.std().item() - 1.0) < 5 / math.sqrt(2 * out.numel())
    torch.manual_seed(0)
    a = layer(torch.zeros(3, 4))
    torch.manual_seed(0)
    assert not torch.equal(a, layer(torch.zeros(3, 4)))  # not reproducible from torch's seed
