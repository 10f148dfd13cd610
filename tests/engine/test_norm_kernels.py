"""The per-sample norm kernels of the performance issue (15): fused row norms (``fastdp.norms.norm_sq``), Gram inner
products (``fastdp.layers._factored.gram_inner``) and one input Gram shared by layers that read the same input
(``fastdp.layers._grams.shared_input_grams``). Each must release what the batch-of-one oracle releases; the
kernels are also checked against the plain formulas they replaced, including the shapes that take other branches.
"""

from __future__ import annotations

import math

import pytest
import torch
from oracle import assert_grads_close, ce_per_sample, oracle_release, run_engine_once
from torch import nn

from fastdp import norms
from fastdp.layers import _factored, _grams, _matmul


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.double().reshape(t.shape[0], math.prod(t.shape[1:])).square().sum(dim=1)


@pytest.mark.parametrize("shape", [
    (4,), (4, 3), (4, 5000), (4, 300, 300), (4, 7, 4099), (4, 64, 3, 3, 3), (0, 10, 10), (3, 0), (4, 5121),
    (2, 2048, 3), (1, 1 << 18)])
def test_norm_sq_equals_the_sum_of_squares(shape):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(*shape, generator=g, dtype=torch.float64) * 3
    want = _plain(t)
    got = norms.norm_sq(t)
    assert got.shape == (shape[0],) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    # float32: as accurate as the two-pass sum (the row split keeps single-pass accumulation short)
    got32 = norms.norm_sq(t.float())
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, rtol=2e-6, atol=1e-30)


def test_norm_sq_row_split_keeps_float32_accuracy_on_long_rows():
    # one sample of 2^20 entries: an unsplit single-pass vector_norm drifts past 1e-6 relative here
    t = torch.randn(2, 1 << 20, generator=torch.Generator().manual_seed(1)) * 3
    rel = ((norms.norm_sq(t).double() - _plain(t)) / _plain(t)).abs().max()
    assert rel < 1e-6, rel


def test_norm_sq_propagates_nonfinite_values_and_upcasts_half():
    t = torch.randn(4, 10000)
    t[1, 5], t[2, 7] = float("nan"), float("inf")
    out = norms.norm_sq(t)
    assert torch.isnan(out[1]) and torch.isinf(out[2]) and torch.isfinite(out[[0, 3]]).all()
    half = torch.randn(3, 5000).half()
    assert norms.norm_sq(half).dtype == torch.float32
    torch.testing.assert_close(norms.norm_sq(half).double(), _plain(half.float()), rtol=1e-6, atol=0)


def test_row_length_choices():
    assert norms._row_length((10,), 10) == 10  # small: one row
    assert norms._row_length((300, 300), 90000) == 300  # the trailing dimension
    assert norms._row_length((64, 3, 3, 3), 1728) == 1728
    assert norms._row_length((2048, 3, 3), 18432) == 1024  # 9 < 256: fall back to rows of 1024
    assert norms._row_length((4, 1024), 4096 * 1) == 4096
    assert norms._row_length((7, 4099), 28693) is None  # a trailing row over 4096 that 1024 does not divide
    assert norms._row_length((5121,), 5121) is None  # neither: the two-pass form


def test_gram_inner_is_the_per_sample_dot_product():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(5, 2, 7, 7, generator=g, dtype=torch.float64)
    b = torch.randn(5, 2, 7, 7, generator=g, dtype=torch.float64)
    torch.testing.assert_close(_factored.gram_inner(a, b), (a * b).sum(dim=(1, 2, 3)), rtol=1e-13, atol=0)
    empty = torch.zeros(0, 1, 3, 3)
    assert _factored.gram_inner(empty, empty).shape == (0,)


class Attention(nn.Module):
    """Separate q, k, v projections of one input (the case the shared input Gram is for), then a head."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d, bias=False)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        att = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / x.shape[-1] ** 0.5, dim=-1)
        return self.head(att @ self.v(x))


@pytest.fixture
def gram_calls(monkeypatch):
    """Count the input Grams formed and the ones taken from the cache."""
    counts = {"formed": 0, "shared": 0}
    real_input_grams = _grams.input_grams

    def counting(A, narrow=None):
        cache = _grams._input_grams.get()
        key = None if cache is None else (A.data_ptr(), A.device, A.dtype, tuple(A.shape), A.stride(), A._version,
                                          narrow)
        counts["shared" if key is not None and key in cache else "formed"] += 1
        return real_input_grams(A, narrow)

    monkeypatch.setattr(_grams, "input_grams", counting)
    return counts


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("B", [1, 4, 6])  # B = 6 = T: a batch size equal to another dimension
@pytest.mark.parametrize("R", [0.05, 1e3])
def test_q_k_v_share_one_input_gram_exactly(share, B, R, gram_calls, monkeypatch):
    # T = 6, d = 16: 2 T^2 = 72 < p d = 256 and p d > T (p + d) = 192: q, k, v take the ghost norm
    monkeypatch.setattr(_grams, "SHARE_INPUT_GRAMS", share)
    torch.manual_seed(0)
    model = Attention(16).double()
    g = torch.Generator().manual_seed(B)
    x = torch.randn(B, 6, 16, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (B, 6), generator=g)
    want = oracle_release(model, ce_per_sample, [(x, y)], fn="abadi", R=R, batch_size=B)
    _, _, got = run_engine_once(model, ce_per_sample, [(x, y)], batch_size=B, R=R, fn="abadi", style="all-layer",
                                mode="BK-MixOpt", reduction="mean", verify_structure=False)
    assert_grads_close(got, want)
    # q, k and v read one input: with sharing one Gram is formed and reused twice; without, three are formed
    assert (gram_calls["formed"], gram_calls["shared"]) == ((1, 2) if share else (3, 0))


def test_the_gram_cache_lives_for_one_pass_only():
    A = torch.randn(2, 1, 3, 4)
    assert _grams._input_grams.get() is None
    with _grams.shared_input_grams():
        first = _grams.input_grams(A)
        assert _grams.input_grams(A) is first  # same tensor: the cached Gram
        A.mul_(2)  # an in-place change bumps the version counter: a new Gram, not the stale one
        torch.testing.assert_close(_grams.input_grams(A)[0], A @ A.transpose(-1, -2))
        assert _grams.input_grams(A.clone()) is not first  # another storage
        assert len(_grams._input_grams.get()) == 1  # only the latest input's Gram is held
        other = torch.randn(2, 1, 5, 4)
        _grams.input_grams(other)
        assert list(_grams._input_grams.get().values())[0][0].shape == (2, 1, 5, 5)
    assert _grams._input_grams.get() is None  # freed with the context
    assert _grams.input_grams(A) is not _grams.input_grams(A)  # outside: never cached


# ---------------------------------------------------------------------------------------------- Gram strips
@pytest.mark.parametrize("T,b", [(1, 4), (4, 4), (5, 4), (7, 4), (8, 4), (9, 4), (13, 3), (7, 1), (0, 4), (64, 64),
                                 (65, 64), (127, 64), (128, 64), (300, 64), (17, 64), (31, 8)])
@pytest.mark.parametrize("B,g", [(3, 1), (2, 3), (0, 1), (1, 2)])
@pytest.mark.parametrize("align", [0, 4, 16])
def test_gram_strips_give_the_full_gram_inner_product(T, b, B, g, align, monkeypatch):
    monkeypatch.setattr(_grams, "GRAM_STRIP", {"cpu": (b, 1 << 30), "default": (b, 1 << 30)})
    monkeypatch.setattr(_grams, "GRAM_ALIGN", {"cpu": align})
    gen = torch.Generator().manual_seed(T * 31 + b)
    A = torch.randn(B, g, T, 5, generator=gen, dtype=torch.float64)
    G = torch.randn(B, g, T, 7, generator=gen, dtype=torch.float64)
    strips = _grams.gram_strips(A)
    r = T % align if align > 1 and T > align else 0  # leading positions in a strip of their own
    K = max(1, (T - r) // b)  # then strips of equal height ceil((T - r) / K); one below 2b rows
    h = -(-(T - r) // K) if T else 1
    starts = ([0] if r else []) + list(range(r, T, h))
    if not starts:  # T = 0: the whole (empty) Gram
        starts = [0]
    assert len(strips) == len(starts)
    full = A @ A.transpose(-1, -2)
    for s, lo, hi in zip(strips, starts, starts[1:] + [T], strict=True):  # rows [lo, hi) against columns [lo, T)
        torch.testing.assert_close(s, full[:, :, lo:hi, lo:], rtol=1e-13, atol=1e-13)
        if r and lo == r:
            assert (T - lo) % align == 0  # the other strips cover a multiple of the alignment
    want = (full * (G @ G.transpose(-1, -2))).sum(dim=(1, 2, 3))
    got = _grams.strips_inner(strips, _grams.gram_strips(G))
    assert got.shape == (B,)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # the ghost norm itself: ||G_i^T A_i||_F^2 summed over groups
    psg = torch.einsum("bgtp,bgtd->bgpd", G, A)
    torch.testing.assert_close(_matmul.ghost_norm_sq(A, G, share=False), psg.square().sum(dim=(1, 2, 3)),
                               rtol=1e-11, atol=1e-11)


def test_odd_positions_get_a_leading_strip_when_aligned(monkeypatch):
    # an alignment of 16 (benchmarks' "aligned Grams"): a ViT's 17 tokens are cut 1 + 16 (whole below 64 rows
    # otherwise), 257 as 1 + 4 x 64; not the default
    assert _grams.leading_rows(torch.randn(2, 1, 17, 8)) == 0
    monkeypatch.setattr(_grams, "GRAM_ALIGN", {"cpu": 16})
    A = torch.randn(2, 1, 17, 8)
    assert [tuple(s.shape) for s in _grams.gram_strips(A)] == [(2, 1, 1, 17), (2, 1, 16, 16)]
    assert [tuple(s.shape[2:]) for s in _grams.gram_strips(torch.randn(1, 1, 257, 4))] == [
        (1, 257), (64, 256), (64, 192), (64, 128), (64, 64)]
    assert len(_grams.gram_strips(torch.randn(2, 1, 16, 8))) == 1  # a multiple of 16: whole
    assert len(_grams.gram_strips(torch.randn(2, 1, 15, 8))) == 1  # at most 16 positions: whole


def test_gram_strips_take_fewer_multiply_adds():
    # T 256, at most 4 strips of at least 64 rows: four strips of 64 take (4 + 1) / (2 * 4) = 5/8 of the full
    # product's multiply-adds
    from torch.utils.flop_counter import FlopCounterMode

    A = torch.randn(2, 1, 256, 32)

    def flops(f):
        with FlopCounterMode(display=False) as fc:
            f()
        return fc.get_total_flops()

    full = flops(lambda: torch.matmul(A, A.transpose(-1, -2)))
    strips = flops(lambda: _grams.gram_strips(A))
    assert _grams.strip_count(A) == 4 and strips * 8 == full * 5, (strips, full)
    assert _grams.strip_count(A[:, :, :127]) == 1 and _grams.strip_count(A[:, :, :128]) == 2  # T // 64, at least 1


@pytest.mark.parametrize("mode", ["BK-MixOpt", "BK-MixGhostClip", "BK-ghost", "ghost"])
@pytest.mark.parametrize("B", [1, 5, 6])  # B = 6 = T
@pytest.mark.parametrize("align", [0, 4])
def test_engine_with_gram_strips_matches_the_oracle(mode, B, align, monkeypatch):
    # strips of 2 rows over T = 6 positions (3 strips; with an alignment of 4, a leading strip of 2 rows and 2 strips
    # over the other 4), q/k/v sharing one input's strips
    monkeypatch.setattr(_grams, "GRAM_STRIP", {"cpu": (2, 8), "default": (2, 8)})
    monkeypatch.setattr(_grams, "GRAM_ALIGN", {"cpu": align})
    torch.manual_seed(1)
    model = Attention(16).double()
    gen = torch.Generator().manual_seed(B)
    x = torch.randn(B, 6, 16, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (B, 6), generator=gen)
    want = oracle_release(model, ce_per_sample, [(x, y)], fn="abadi", R=0.05, batch_size=B)
    _, _, got = run_engine_once(model, ce_per_sample, [(x, y)], batch_size=B, R=0.05, fn="abadi", style="all-layer",
                                mode=mode, reduction="mean", verify_structure=False)
    assert_grads_close(got, want)


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8 * 9, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1)).unsqueeze(1)  # (B, 1, 4)


@pytest.mark.parametrize("B", [1, 4])
def test_conv_patch_gram_in_strips_matches_the_oracle(B, monkeypatch):
    from fastdp.layers.kinds import conv as conv_kind

    monkeypatch.setattr(_grams, "GRAM_STRIP", {"cpu": (4, 8), "default": (4, 8)})
    monkeypatch.setattr(conv_kind, "PIXEL_GRAMS", False)  # the patches' Gram, in strips of 4 of the 9 positions
    torch.manual_seed(2)
    model = _ConvNet().double()
    gen = torch.Generator().manual_seed(B)
    x = torch.randn(B, 3, 3, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (B, 1), generator=gen)
    want = oracle_release(model, ce_per_sample, [(x, y)], fn="abadi", R=0.05, batch_size=B)
    _, _, got = run_engine_once(model, ce_per_sample, [(x, y)], batch_size=B, R=0.05, fn="abadi", style="all-layer",
                                mode="BK-ghost", reduction="mean", verify_structure=False)
    assert_grads_close(got, want)


def test_strips_cut_differently_are_refused(monkeypatch):
    monkeypatch.setattr(_grams, "GRAM_STRIP", {"cpu": (64, 4), "default": (64, 4)})
    A = torch.randn(2, 1, 256, 3)
    strips = _grams.gram_strips(A)
    assert len(strips) == 4
    with pytest.raises(ValueError, match="not cut the same way"):
        _grams.strips_inner(strips, [A @ A.transpose(-1, -2)])  # four strips against the whole matrix
    with pytest.raises(ValueError, match="not cut the same way"):
        _grams.strips_inner(strips[:1], [strips[0][..., :10]])  # one strip each, of other shapes
