"""Gram matrices ``X_i X_i^T`` of the ghost norm, per sample and group, for ``X`` ``(B, g, T, m)``.

The ghost norm of an outer-product layer (:mod:`fastdp.layers._matmul`) is ``<A_i A_i^T, G_i G_i^T>``: two ``T x T``
Gram matrices per sample and group. This module forms them:

* in strips (:func:`gram_strips`): the upper triangle only, a Gram matrix being symmetric; cut by device type
  (:data:`GRAM_STRIP`, :data:`GRAM_ALIGN`), with their inner product, Frobenius norm and diagonal read from the
  strips (:func:`strips_inner`, :func:`strips_frobenius`, :func:`strips_diagonal`);
* in chunks of columns where the rows are wide (:data:`GRAM_CHUNK`, :func:`gram_product`), so that each entry's
  rounding, which the cancellation guard charges (:func:`gram_width`, :mod:`fastdp.layers._rounding`), stays small;
* once per input for the layers that read the same input tensor in one pass (:func:`shared_input_grams`,
  :func:`input_grams`: ``q``, ``k``, ``v``).

Every constant here is read at the call (tests and benchmarks/levers.py set them).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from fastdp.layers import _factored, _products

#: how :func:`gram_strips` cuts a ``T x T`` Gram matrix, by device type (others: ``"default"``): ``(h, K)``, strips of
#: at least ``h`` rows and at most ``K`` of them. On a 2-core CPU (``python benchmarks/levers.py --gram-ops``,
#: benchmarks/results/gram_strips/gram_ops.json) a ghost norm's two Gram products and their inner product took
#: 0.61-0.85x the whole matrices' time at T 128 to 1024 with this rule (2 strips at T 128, 4 from T 256); 8 or 16
#: strips gained little more at T 512 and 1024 and lost at T 128 and 256. Below T 128 the whole matrices: two strips
#: at T 64 were 0.91-0.95x alone but 0.975-0.988x in whole steps (``--levers gram-strips``, gram_strips/
#: time_cpu_T64_two_strips.json: the strips' extra calls).
#: Elsewhere (``"default"``) the whole matrices: on an NVIDIA H200 (torch 2.11, ``python benchmarks/levers.py
#: --gram-ops --device cuda``, benchmarks/results/gram_strips/gram_ops_cuda_h200.json) 2 to 16 strips took 1.46-13.75x
#: the whole matrices' time at T 64 to 1024, growing with the number of strips, and a GPT-2-small T 512 step took
#: 218.7 ms with the strips (128, 8) against 214.5 ms with whole matrices (docs/results/cuda.md, 2026-11-27).
GRAM_STRIP = {"cpu": (64, 4), "default": (1, 1)}


#: on these device types a Gram matrix whose ``T`` is not a multiple of the value is cut so that its ``T mod a``
#: leading positions form a strip of their own and the other strips cover a multiple of ``a`` positions
#: (:func:`gram_strips`). Empty (no device type): measured on CPU and not adopted. torch's CPU ``bmm`` runs a
#: ``17 x 17`` product far below its rate at ``16 x 16``, and the aligned cut took 0.80-1.00x the time of the
#: products on warm inputs (``python benchmarks/levers.py --gram-ops --odd-t``) but 0.99-1.09x at T 17 and 65 on
#: inputs not in the cache (``--cold``: the leading strip reads every row again), and whole ViT steps were no faster
#: (``fastdp BK-MixOpt, aligned Grams`` in ``benchmarks/run.py``: 1.37x against 1.38x non-private at 32², 1.38x
#: against 1.37x at 64², 1.16x both at 128²). Not measured on a GPU.
GRAM_ALIGN: dict[str, int] = {}


#: on these device types a Gram matrix ``X X^T`` whose rows are wider than the value (a language model head's
#: output gradients, vocabulary wide) is summed in chunks of at most that many columns, each chunk's product formed
#: on its own and the chunks then added (:func:`gram_product`): an entry's rounding is then bounded by ``(w + c) u``
#: of its terms' magnitudes (``w`` the chunk width, ``c`` the chunks: :func:`gram_width`) instead of ``m u`` for the
#: whole width ``m``, in any order of summation within a product. The cancellation guard (fastdp/layers/_rounding.py)
#: charges that bound, so a ghost norm whose worst-case rounding was within ``1 / 64`` of it is no longer flagged:
#: GPT-2's tied embedding and LM head (vocabulary 8000, T 256) flagged every sample at ``sq / err`` 53-64, its
#: output Gram's width-8000 term 100 times its input Gram's (lever ``gram-chunks`` of benchmarks/levers.py).
#: On CUDA (where flagged samples keep the raised norm: over-clipped) chunks of 4096: on an H200 at GPT-2-small
#: width, T 512, batch 16, whole products flagged every sample of the tied head (vocabulary 50257, ``sq / err`` from
#: 1.8) and of most MLP projections, which raised the norm of a sample's ghost-norm parameters by 1.25 % (median;
#: 1.49 % at most); chunks of 4096 cut that to 0.28 % (0.43 %) at 221.7 against 219.8 ms a step (one run of 5
#: rounds), chunks of 1024 to 0.01 % at 230.0 ms (``benchmarks/guard_flags.py``, docs/results/cuda.md, 2026-11-28).
GRAM_CHUNK: dict[str, int] = {"cpu": 1024, "cuda": 4096}


def _chunking(X: torch.Tensor) -> tuple[int, int]:
    """``(w, c)``: :func:`gram_product`'s chunk width and chunk count for rows of ``X``'s width ``m`` (``(m, 1)``:
    one product)."""
    m = X.shape[-1]
    limit = GRAM_CHUNK.get(X.device.type, 0)  # (read at the call: tests and benchmarks set it)
    if limit < 1 or m <= limit:
        return m, 1
    c = -(-m // limit)
    return -(-m // c), c


def gram_width(X: torch.Tensor) -> int:
    """The width a :func:`gram_strips` entry of ``X`` ``(..., m)`` is charged with by the rounding bound
    (:func:`fastdp.layers._rounding.gram_rounding`): ``m`` for one product; ``w + c`` for ``c`` chunks of at most
    ``w`` columns (:func:`gram_product`). Each term of an entry passes through at most ``w + c - 1`` roundings (its
    product, unless fused, the chunk's additions, the ``c - 1`` additions of the chunks' sums), so the entry is off
    by at most ``gamma_{w+c-1} sum_k |x_k y_k|`` (``gamma_n = n u / (1 - n u)``) in any order of summation, which
    ``(w + c) u`` covers while ``(w + c)^2 u <= 1`` (chunks of 1024: up to about ``2^21`` columns). A red-team pass
    (2026-11-28) found at most 0.37 of the charged width used by float32 entries (MKL sums chains of about 190
    products) and 0.995 by float64 ones (one chunk in one register)."""
    w, c = _chunking(X)
    return w if c == 1 else w + c


def gram_product(x: torch.Tensor, y: torch.Tensor, narrow: torch.dtype | None = None) -> torch.Tensor:
    """``x @ y`` (``x`` ``(..., h, m)``, ``y`` ``(..., m, n)``, rows of one :func:`gram_strips` matrix) as
    :func:`product` forms it, in chunks of columns where ``m`` exceeds :data:`GRAM_CHUNK` (:func:`gram_width`): each
    chunk's product on its own, then their sum in float32."""
    w, c = _chunking(x)
    if c == 1:
        return _products.product(x, y, narrow)
    out = _products.product(x[..., :w], y[..., :w, :], narrow)
    for lo in range(w, x.shape[-1], w):
        out.add_(_products.product(x[..., lo:lo + w], y[..., lo:lo + w, :], narrow))
    return out


def strip_count(X: torch.Tensor) -> int:
    """``K = min(K_max, T // h)`` (at least 1) strips for ``X`` ``(B, g, T, m)`` on its device (:data:`GRAM_STRIP`),
    not counting the strip of :func:`leading_rows`; ``T`` is then the positions after it."""
    h, k_max = GRAM_STRIP.get(X.device.type, GRAM_STRIP["default"])
    return max(1, min(k_max, (X.shape[2] - leading_rows(X)) // h))


def leading_rows(X: torch.Tensor) -> int:
    """``r = T mod a`` (``a`` = :data:`GRAM_ALIGN` of ``X``'s device type) when ``T > a``, else 0: the positions
    :func:`gram_strips` gives a strip of their own so that the rest is a multiple of ``a``."""
    a = GRAM_ALIGN.get(X.device.type, 0)
    T = X.shape[2]
    return T % a if a > 1 and T > a else 0


def gram_strips(X: torch.Tensor, narrow: torch.dtype | None = None) -> list[torch.Tensor]:
    """The upper triangle of ``X_i X_i^T`` (``X`` ``(B, g, T, m)``) in strips: strip ``k`` is rows ``[s_k, s_{k+1})``
    against columns ``[s_k, T)``, ``(B, g, s_{k+1} - s_k, T - s_k)``, its leading square block on the diagonal.

    * When :func:`leading_rows` gives ``r > 0``, the first strip is rows ``[0, r)`` (against all ``T`` columns) and
      the rest is cut as below over the last ``T - r`` positions, a multiple of :data:`GRAM_ALIGN`.
    * The ``T'`` positions left are cut into ``K`` = :func:`strip_count` strips of about equal height
      ``h = ceil(T' / K)``.

    A Gram matrix is symmetric, so the strips hold everything; ``K`` strips take about ``(K + 1) / 2K`` of the full
    product's multiply-adds (5/8 for 4 strips), and the largest is ``h x T``, not ``T x T``. One strip (``K = 1``,
    ``r = 0``): the full Gram matrix. ``narrow``: the products as :func:`fastdp.layers._products.product` forms
    them; rows wider than :data:`GRAM_CHUNK` in chunks of columns (:func:`gram_product`, charged
    :func:`gram_width`)."""
    T = X.shape[2]
    r = leading_rows(X)
    K = strip_count(X)
    if K == 1 and r == 0:
        return [gram_product(X, X.transpose(-1, -2), narrow)]
    h = -(-(T - r) // K)
    starts = ([0] if r else []) + list(range(r, T, h))
    ends = starts[1:] + [T]
    return [gram_product(X[:, :, lo:hi], X[:, :, lo:].transpose(-1, -2), narrow)
            for lo, hi in zip(starts, ends, strict=True)]


def strips_inner(P: list[torch.Tensor], Q: list[torch.Tensor]) -> torch.Tensor:
    """``<P_i, Q_i>`` per sample (summed over groups), shape ``(B,)``, of two symmetric ``T x T`` Gram matrices given
    as :func:`gram_strips` cut the same way: each strip's leading ``h_k x h_k`` block (on the diagonal) counts once,
    the rest of the strip (above the diagonal) twice, for its mirror image below."""
    if len(P) != len(Q) or any(p.shape != q.shape for p, q in zip(P, Q, strict=False)):
        raise ValueError(f"Gram strips of shapes {[tuple(p.shape) for p in P]} and {[tuple(q.shape) for q in Q]} "
                         "are not cut the same way")
    if len(P) == 1:
        return _factored.gram_inner(P[0], Q[0])
    total = None
    for p, q in zip(P, Q, strict=True):  # (each block's sum accumulated in float64: _factored.gram_inner)
        n = p.shape[2]
        term = _factored.gram_inner(p[..., :n], q[..., :n])
        if p.shape[3] > n:
            term = term + 2.0 * _factored.gram_inner(p[..., n:], q[..., n:])
        total = term if total is None else total + term
    return total


def strips_frobenius(P: list[torch.Tensor]) -> torch.Tensor:
    """``(B, g)``: the Frobenius norm of the symmetric Gram matrix that :func:`gram_strips` cut (each strip's leading
    block once, the rest twice, for its mirror image)."""
    total = None
    for q in P:
        n = q.shape[2]
        sq = torch.linalg.vector_norm(q[..., :n], dim=(-2, -1)).square()
        if q.shape[3] > n:
            sq = sq + 2.0 * torch.linalg.vector_norm(q[..., n:], dim=(-2, -1)).square()
        total = sq if total is None else total + sq
    return total.sqrt()


def strips_diagonal(P: list[torch.Tensor]) -> torch.Tensor:
    """``(B, g, T)``: the diagonal of the Gram matrix that :func:`gram_strips` cut, clamped at 0 (each strip's leading
    square block holds its part of it), as :func:`fastdp.layers._rounding.symmetric_reductions` reads a whole
    Gram's."""
    parts = [torch.diagonal(p[..., :p.shape[2]], dim1=-2, dim2=-1).clamp(min=0) for p in P]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


#: the input Gram matrices of one clipping pass, keyed by the input's storage and view (None: no sharing)
_input_grams: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fastdp_input_grams", default=None)


#: whether :func:`shared_input_grams` shares them (a switch for benchmarks/levers.py's A/B, always on otherwise)
SHARE_INPUT_GRAMS = True


@contextlib.contextmanager
def shared_input_grams() -> Iterator[None]:
    """Within this context, layers that read the same input tensor one after another (the ``q``, ``k``, ``v``
    projections of one attention block) share one input Gram ``A_i A_i^T`` in their ghost norms instead of forming
    one each. Only the latest Gram is kept (a layer reading another input replaces it), so the pass holds one
    Gram at a time, not one per layer; the cache is freed when the context (one pass of per-sample norms) ends."""
    token = _input_grams.set({} if SHARE_INPUT_GRAMS else None)
    try:
        yield
    finally:
        _input_grams.reset(token)


def view_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What identifies the data a tensor shows, for the per-pass caches (:func:`input_grams`,
    :meth:`OuterProductKind.operand_activation`): storage address, device, dtype, shape, strides and version counter
    (views of one input kept by several calls are different objects with the same key)."""
    return (t.data_ptr(), t.device, t.dtype, tuple(t.shape), t.stride(), t._version)


def input_grams(A: torch.Tensor, narrow: torch.dtype | None = None) -> list[torch.Tensor]:
    """:func:`gram_strips` of ``A`` (``A_i A_i^T`` per sample and group), from the pass's cache when the same input
    (same storage, offset, shape, strides, dtype and version counter) was the latest one seen."""
    cache = _input_grams.get()
    if cache is None:
        return gram_strips(A, narrow)
    key = (*view_key(A), narrow)
    strips = cache.get(key)
    if strips is None:
        cache.clear()  # free the previous input's Gram before forming this one
        strips = cache[key] = gram_strips(A, narrow)
    return strips
