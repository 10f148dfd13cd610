"""Gram matrices of wide rows summed in chunks of columns (``fastdp.layers._grams.gram_product``), and the width the
cancellation guard charges for them (``gram_width``).

The guard (``fastdp.layers._rounding``) flags a ghost norm ``sq`` when it is below ``2^6`` times a worst-case bound
``err`` of its rounding, which grows with the width of the Grams' rows. A language model head's output gradients are
vocabulary wide, and GPT-2's tied head flagged every sample at ``sq / err`` 53-64 although its norm was within 3e-7
of the exact one. Summing a Gram's entries in chunks of at most ``GRAM_CHUNK`` columns bounds an entry's rounding by
``(w + c) u`` of its terms instead of ``m u``; these tests check that bound against the exact (float64) entries,
and that the guard then leaves such a head alone while staying sound.
"""

from __future__ import annotations

import math

import pytest
import torch

from fastdp.layers import _grams, _matmul, _rounding

U = 2.0**-24


@pytest.mark.parametrize("m", [1, 7, 1024, 1025, 4608, 8000, 50257])
def test_chunks_cover_the_width_within_the_limit(m):
    X = torch.zeros(1, 1, 2, m)
    w, c = _grams._chunking(X)
    limit = _grams.GRAM_CHUNK["cpu"]
    assert c == max(1, math.ceil(m / limit)) and w <= max(limit, m if c == 1 else 0) and w * c >= m
    assert (w - 1) * c < m  # no empty chunk
    assert _grams.gram_width(X) == (m if c == 1 else w + c) <= m
    assert _grams._chunking(torch.zeros(1, 1, 2, m, device="meta")) == (m, 1)  # a device not listed: one product


@pytest.mark.parametrize("T,m", [(130, 3000), (64, 1500), (17, 4608)])
def test_chunked_entries_stay_within_the_charged_bound(T, m):
    """Every entry of the strips, against the float64 Gram: off by at most ``gram_width u sum_k |x_k y_k|``; and the
    chunked strips equal the whole product's to that rounding."""
    gen = torch.Generator().manual_seed(T + m)
    X = torch.randn(2, 1, T, m, generator=gen) + 3.0 * torch.randn(m, generator=gen)  # rows sharing a pattern
    strips = _grams.gram_strips(X)
    whole = X.double() @ X.double().transpose(-1, -2)
    mags = X.double().abs() @ X.double().abs().transpose(-1, -2)
    width = _grams.gram_width(X)
    assert width < m
    lo = 0
    for s in strips:
        h = s.shape[2]
        exact, mag = whole[:, :, lo:lo + h, lo:], mags[:, :, lo:lo + h, lo:]
        assert bool(((s.double() - exact).abs() <= width * U * mag).all())
        lo += h
    assert lo == T


def _head_case(offset: float, seed: int = 0, B: int = 2, T: int = 256, d: int = 64, V: int = 8000):
    """A language model head's operands: hidden states ``(B, 1, T, d)`` and the softmax cross-entropy's output
    gradients ``softmax - onehot`` ``(B, 1, T, V)``, each row summing to 0."""
    gen = torch.Generator().manual_seed(seed)
    H = torch.randn(B, 1, T, d, generator=gen) + offset
    G = torch.randn(B, 1, T, V, generator=gen).softmax(-1)
    G -= torch.nn.functional.one_hot(torch.randint(0, V, (B, 1, T), generator=gen), V).float()
    return H, G


@pytest.mark.parametrize("chunked", [True, False])
def test_a_vocabulary_wide_head_is_not_flagged_by_the_bounds_looseness(chunked, monkeypatch):
    """Chunked: ``sq / err`` far above the guard's ``2^6``. Over the whole width (the mutation: ``GRAM_CHUNK``
    empty) the same head is flagged, as GPT-2's was. Both ways the computed norm is within ``err`` of the exact one."""
    if not chunked:
        monkeypatch.setattr(_grams, "GRAM_CHUNK", {})
    H, G = _head_case(0.0)
    sq, err, bound = _matmul.ghost_norm_parts(H, G, share=False)
    exact = torch.einsum("bgtp,bgtd->bgpd", G.double(), H.double()).square().sum(dim=(1, 2, 3))
    assert bool(((sq.double() - exact).abs() <= err.double()).all())
    assert bool((bound.double() >= exact).all())
    ratio = float((sq / err).min())
    if chunked:
        assert ratio > 4 * _rounding.CANCELLATION_GUARD, ratio
        assert torch.equal(_rounding.guarded_sq(sq, err, bound), sq)
    else:
        assert ratio < _rounding.CANCELLATION_GUARD, ratio


def test_a_head_that_cancels_is_still_flagged():
    """Hidden states sharing a large offset and output gradients centred over positions (each column sums to 0 over
    ``T``): the offset's part of the gradient cancels across positions, far below its terms, and the guard flags it
    with the chunked bound too."""
    H, G = _head_case(1e3)
    G -= G.mean(2, keepdim=True)
    sq, err, _ = _matmul.ghost_norm_parts(H, G, share=False)
    exact = torch.einsum("bgtp,bgtd->bgpd", G.double(), H.double()).square().sum(dim=(1, 2, 3))
    assert bool(((sq.double() - exact).abs() <= err.double()).all())
    assert bool((sq < _rounding.CANCELLATION_GUARD * err).all())
