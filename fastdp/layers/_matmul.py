"""Shared math of layers whose weight gradient is a sum of outer products (Linear, Conv).

Canonical shapes, with ``B`` samples, ``g`` groups (1 for Linear and ungrouped Conv), ``T`` positions,
``d`` inputs and ``p`` outputs per group:

* ``A``: activations ``(B, g, T, d)``;
* ``G``: output gradients ``(B, g, T, p)``.

The per-sample weight gradient of group ``j`` is ``g_i[j] = G_i[j]^T A_i[j]`` (``p x d``), so

* instantiation: ``einsum('bgtp,bgtd->bgpd')``;
* ghost norm (Li et al. 2021; Bu et al. 2023): ``||g_i||^2 = sum_j <A_i[j] A_i[j]^T, G_i[j] G_i[j]^T>`` from two
  ``T x T`` Gram matrices per sample and group, never forming ``g_i``;
* book-keeping clipped sum: ``sum_i c_i g_i = einsum('bgtp,bgtd->gpd', c * G, A)``, one contraction.

The cost model picks the ghost norm when ``2 T^2 < p d`` (two Gram matrices against one per-sample gradient); the
default mode also instantiates when ``p d <= T (p + d)`` (:func:`instantiation_fits`, see
``fastdp.norms.use_ghost``).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from fastdp.layers import _factored, _rounding
from fastdp.layers._factored import Factors
from fastdp.layers.base import LayerKind, to_accumulation
from fastdp.torch_api import bf16_matmul_float32


def prefers_ghost(A: torch.Tensor, G: torch.Tensor) -> bool:
    """``2 T^2 < p d`` for canonical ``A`` ``(B,g,T,d)`` and ``G`` ``(B,g,T,p)``."""
    T, d, p = A.shape[2], A.shape[3], G.shape[3]
    return 2 * T * T < p * d


#: how much larger than what book-keeping keeps of a call a per-sample gradient may be and still be instantiated by
#: the default mode (:func:`instantiation_fits`). 1: instantiation never holds more than book-keeping would. Above 1
#: it trades memory for the ghost norm's Gram products (``python benchmarks/levers.py --slack``, with the Gram strips:
#: at 1.25, GPT-2-small at T 512 ran 1.145x -> 1.043x non-private matrix-product FLOPs at an unchanged live peak,
#: RoBERTa-base at T 512 1.145x -> 1.002x FLOPs but 1.006x -> 1.126x live peak); not adopted as the default, which
#: keeps memory first.
INSTANTIATION_SLACK = 1.0


def instantiation_fits(A: torch.Tensor, G: torch.Tensor, readers: int = 1) -> bool:
    """``p d <= s T (p + d / readers)``, ``s`` = :data:`INSTANTIATION_SLACK`: a per-sample gradient ``(p, d)`` is no
    more than ``s`` times the ``T`` rows of output gradient ``p`` and the call's share of the ``T`` rows of input
    ``d`` that book-keeping keeps per sample (and per group); an input read by ``readers`` calls (``q``, ``k``,
    ``v``) is kept once for all of them."""
    T, d, p = A.shape[2], A.shape[3], G.shape[3]
    return p * d * readers <= INSTANTIATION_SLACK * T * (p * readers + d)


#: device types on which a Linear-like call that ran in bfloat16 (under bfloat16 autocast, or in a bfloat16 model) has
#: the matrix products of its weight's per-sample norm and clipped sum formed from bfloat16 operands with float32
#: accumulation and output (:func:`fastdp.torch_api.bf16_matmul_float32`: tensor cores on CUDA) instead of IEEE
#: float32 ones. Exact in the same sense as the float32 path: the input is taken rounded to bfloat16 as the forward's
#: own product took it (:func:`narrow_dtype`), so both operands hold bfloat16 values and every product of two is exact
#: in float32; the scaled operand ``coef_i G_i`` of the clipped sum, a float32 tensor, is split exactly into three
#: bfloat16 tensors (:func:`split_bf16`), one product each. Norms, clipped sums and GhostClip's replay all read the
#: same rounded input, so ``||coef_i g_i|| <= R`` holds to float32 rounding. Empty (off everywhere): on an H200 it took
#: a GPT-2-small T 512 bf16-autocast step from 2.65x to 2.26x non-private bf16 training's, but RoBERTa-base held 8051
#: against 3193 MB (each call keeps a rounded float32 copy of its input; docs/results/cuda.md, 2026-11-28).
BF16_PRODUCTS: frozenset[str] = frozenset()


def narrow_dtype(grad_output: torch.Tensor) -> torch.dtype | None:
    """``torch.bfloat16`` when a call's products may run in bfloat16 (:data:`BF16_PRODUCTS`): its output gradient is
    bfloat16 (its forward product ran in bfloat16, so it read its input rounded to bfloat16) on such a device; else
    ``None``."""
    if grad_output.dtype == torch.bfloat16 and grad_output.device.type in BF16_PRODUCTS:
        return torch.bfloat16
    return None


class Operands(tuple):
    """The canonical ``(A, G)`` of a call (a pair: ``A, G = ctx`` unpacks it), with :attr:`narrow`: ``None`` (both in
    float32 or wider), or ``torch.bfloat16`` when both are held in bfloat16 (the kept tensors themselves where they
    are bfloat16 already: no copy) and their products run in bfloat16 with float32 accumulation
    (:data:`BF16_PRODUCTS`); every sum and scaling of them is then taken in float32."""

    narrow: torch.dtype | None

    def __new__(cls, A: torch.Tensor | None, G: torch.Tensor, narrow: torch.dtype | None = None) -> Operands:
        self = super().__new__(cls, (A, G))
        self.narrow = narrow
        return self


def narrow_of(ctx: Any) -> torch.dtype | None:
    """The :attr:`Operands.narrow` of a call's canonical form (``None`` for a plain pair)."""
    return getattr(ctx, "narrow", None)


def product(x: torch.Tensor, y: torch.Tensor, narrow: torch.dtype | None = None) -> torch.Tensor:
    """``x @ y`` over the last two dimensions (leading dimensions equal), in float32: IEEE float32 products, or with
    ``narrow`` (operands holding bfloat16 values) bfloat16 products accumulated in float32."""
    if narrow is None:
        return torch.matmul(x, y)
    lead = x.shape[:-2]
    n = math.prod(lead)  # explicit: a tensor of zero positions has zero elements
    out = bf16_matmul_float32(x.to(narrow).reshape(n, *x.shape[-2:]), y.to(narrow).reshape(n, *y.shape[-2:]))
    return out.view(*lead, x.shape[-2], y.shape[-1])


def _truncated_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` cut to bfloat16 toward zero (its low 16 bits dropped): a bfloat16 value never larger in
    magnitude than ``x``, so it cannot overflow where rounding to nearest would (above bfloat16's largest finite)."""
    return (x.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three bfloat16 tensors whose sum is the float32 ``x`` exactly: ``hi`` = ``x`` cut to bfloat16 (toward zero,
    :func:`_truncated_bf16`), ``mid`` the remainder cut the same way, ``lo`` the rest. ``x``'s 24 significant bits
    span 24 positions; ``hi`` takes the top 8, the remainder (exact in float32) spans at most the 16 below, ``mid``
    takes its top 8 significant bits and the rest spans at most 8 positions, which bfloat16 holds exactly (it has
    float32's exponent range; only a rest below bfloat16's smallest subnormal, ``2^-133``, where ``|x| < 2^-110``,
    is lost)."""
    hi = _truncated_bf16(x)
    rest = x - hi.float()
    mid = _truncated_bf16(rest)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return hi, mid, lo


def _split_product(x: torch.Tensor, y: torch.Tensor, narrow: torch.dtype | None) -> torch.Tensor:
    """``x @ y`` (2-D) for a float32 ``x`` and a ``y`` holding ``narrow`` values: IEEE float32 without ``narrow``;
    with it, the sum of the products of ``x``'s exact three-way bfloat16 split (:func:`split_bf16`) with ``y``."""
    if narrow is None:
        return torch.mm(x, y)
    yb = y.to(narrow)
    out = None
    for part in split_bf16(x):
        term = bf16_matmul_float32(part, yb)
        out = term if out is None else out.add_(term)
    return out


def per_sample_grad(A: torch.Tensor, G: torch.Tensor, narrow: torch.dtype | None = None) -> torch.Tensor:
    """Per-sample weight gradients ``(B, g, p, d)``: ``G_i^T A_i`` (:func:`product`)."""
    if narrow is None:
        return torch.einsum("bgtp,bgtd->bgpd", G, A)
    return product(G.transpose(-1, -2), A, narrow)


def ghost_norm_sq(A: torch.Tensor, G: torch.Tensor, share: bool = True,
                  narrow: torch.dtype | None = None) -> torch.Tensor:
    """``||G_i^T A_i||_F^2`` summed over groups, shape ``(B,)``, from Gram matrices in strips
    (:func:`gram_strips`, :func:`strips_inner`), guarded against rounding where the gradient cancels across positions
    (:func:`fastdp.layers._rounding.guarded_sq` of :func:`ghost_norm_parts`)."""
    return _rounding.guarded_sq(*ghost_norm_parts(A, G, share, narrow))


def ghost_norm_parts(A: torch.Tensor, G: torch.Tensor, share: bool = True, narrow: torch.dtype | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sq, err, bound_sq)`` ``(B,)`` each: the unguarded ghost norm ``||G_i^T A_i||_F^2``, a bound of its
    rounding and the triangle bound's square (:func:`fastdp.layers._rounding.guarded_sq`). ``share``: the input Gram
    may come from (and go to) the cache of :func:`shared_input_grams` (only for an ``A`` that stays alive for the
    whole pass: the cache is keyed by its storage). ``narrow``: the Gram products in bfloat16 with float32
    accumulation (:func:`product`)."""
    if A.shape[2] == 1:  # one position: ||a||^2 ||g||^2, a product of two sums of squares (nothing cancels)
        A, G = to_accumulation(A), to_accumulation(G)
        # each sum raised by what its squares can lose below the normal range (half the smallest subnormal each):
        # output gradients of 2^-76 against inputs of 2^60 otherwise gave ||g||^2 = 0, a clipping factor of 1, and
        # the contraction's normal terms released (the red-team construction of _rounding.gram_rounding, at T 1)
        eta = _rounding.roundoffs(A.dtype)[1]
        sq = ((A.square().sum(-1) + A.shape[-1] * eta) * (G.square().sum(-1) + G.shape[-1] * eta)).sum(dim=(1, 2))
        return sq, torch.zeros_like(sq), sq
    aat = input_grams(A, narrow) if share else gram_strips(A, narrow)
    ggt = gram_strips(G, narrow)
    d, p = gram_width(A), gram_width(G)  # the rounding of each Gram's entries, as gram_strips summed them
    if len(aat) == 1:
        return _rounding.symmetric_parts(aat[0], ggt[0], d, p)
    na, ng = strips_diagonal_norms(aat, d), strips_diagonal_norms(ggt, p)
    red = _rounding.reduction_width(aat[0].dtype, A.shape[1] * A.shape[2] ** 2)  # the final sum's rounding
    err = (_rounding.gram_rounding(strips_frobenius(ggt), na, na, d + red)
           + _rounding.gram_rounding(strips_frobenius(aat), ng, ng, p))
    return strips_inner(aat, ggt), err, _rounding.triangle_bound_sq(na, ng)


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
#: Not on other devices (not measured there: each chunk is one more product call).
GRAM_CHUNK: dict[str, int] = {"cpu": 1024}


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
        return product(x, y, narrow)
    out = product(x[..., :w], y[..., :w, :], narrow)
    for lo in range(w, x.shape[-1], w):
        out.add_(product(x[..., lo:lo + w], y[..., lo:lo + w, :], narrow))
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
    ``r = 0``): the full Gram matrix. ``narrow``: the products as :func:`product` forms them; rows wider than
    :data:`GRAM_CHUNK` in chunks of columns (:func:`gram_product`, charged :func:`gram_width`)."""
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


def strips_diagonal_norms(P: list[torch.Tensor], width: int = 0) -> torch.Tensor:
    """``(B, g, T)``: the positions' norms, from the diagonal of the Gram matrix that :func:`gram_strips` cut (each
    strip's leading square block holds its part of it), each at least the true one for entries of ``width``
    products (:func:`fastdp.layers._rounding.diagonal_norms`)."""
    parts = [_rounding.diagonal_norms(p[..., :p.shape[2]], width) for p in P]
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


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
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
    key = (*_view_key(A), narrow)
    strips = cache.get(key)
    if strips is None:
        cache.clear()  # free the previous input's Gram before forming this one
        strips = cache[key] = gram_strips(A, narrow)
    return strips


#: the bfloat16 roundings of the kept inputs of one pass's calls (:meth:`OuterProductKind.operand_activation`)
_rounded: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fastdp_rounded", default=None)


@contextlib.contextmanager
def shared_rounding() -> Iterator[None]:
    """Within this context, the calls that read the same kept input and take it rounded to bfloat16
    (:data:`BF16_PRODUCTS`) get one rounded tensor instead of one copy each; the cache is freed when the context
    ends (the records' contexts keep what they use)."""
    token = _rounded.set({})
    try:
        yield
    finally:
        _rounded.reset(token)


#: the scratch buffers of one clipping pass's clipped sums, keyed by dtype and device (None: no reuse)
_scratch: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fastdp_scratch", default=None)


@contextlib.contextmanager
def reused_scratch() -> Iterator[None]:
    """Within this context, :func:`clipped_sum` writes each layer's scaled operand ``coef_i A_i`` into one buffer
    per dtype and device, reused from layer to layer (grown when a larger operand comes), instead of a fresh
    tensor per layer. Each product has finished reading the buffer before the next layer writes it (one stream),
    so a scaled operand is valid only until the next call. On CPU a fresh multi-megabyte tensor is paid in page
    faults (benchmarks/levers.py ``reused-scratch``). Freed when the context ends."""
    token = _scratch.set({})
    try:
        yield
    finally:
        _scratch.reset(token)


def _scaled(X: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``X * c`` (``c`` broadcast over ``X``), in the pass's reused scratch buffer when there is one."""
    cache = _scratch.get()
    if cache is None or X.requires_grad or c.requires_grad:
        return X * c
    dtype = torch.promote_types(X.dtype, c.dtype)
    key = (dtype, X.device)
    buf = cache.get(key)
    if buf is None or buf.numel() < X.numel():
        cache.pop(key, None)  # free the smaller one first
        buf = cache[key] = torch.empty(X.numel(), dtype=dtype, device=X.device)
    return torch.mul(X, c, out=buf[:X.numel()].view(X.shape))


def clipped_sum(A: torch.Tensor, G: torch.Tensor, coef: torch.Tensor,
                narrow: torch.dtype | None = None) -> torch.Tensor:
    """``sum_i coef_i G_i^T A_i``, shape ``(g, p, d)``: one contraction over samples and positions. The smaller
    operand is scaled (in the reused buffer of :func:`reused_scratch` when inside it). ``narrow`` (one group): the
    scaled operand split exactly into three bfloat16 tensors, each multiplied in bfloat16 with float32 accumulation
    (:func:`split_bf16`); the other operand holds bfloat16 values already."""
    B, g, T, p = G.shape
    c = coef.to(torch.promote_types(G.dtype, torch.float32)).view(-1, 1, 1, 1)  # (float32 for bfloat16 operands)
    scale_a = A.numel() < G.numel()  # scale whichever operand is smaller
    if scale_a:
        A = _scaled(A, c)
    else:
        G = _scaled(G, c)
    if g == 1:  # one matmul (p, B T) @ (B T, d) on views, like autograd's own weight gradient
        Gt, A2 = G.reshape(B * T, p).t(), A.reshape(B * T, A.shape[-1])
        if narrow is not None and scale_a:  # (A^T G)^T: the scaled operand on the left of the split product
            return _split_product(A2.t(), Gt.t(), narrow).t().unsqueeze(0)
        return _split_product(Gt, A2, narrow).unsqueeze(0)
    if narrow is not None:
        raise ValueError("bfloat16 products are formed for one group only (Linear-like calls)")
    return torch.einsum("bgtp,bgtd->gpd", G, A)


class OuterProductKind(LayerKind):
    """A layer kind whose :meth:`prepare` returns the canonical ``(A, G)`` above (``A`` is ``None`` when only the
    bias trains). Weight: ghost norm, instantiation or book-keeping contraction; bias ``(g * p,)``: ``G`` summed
    over positions."""

    #: whether :meth:`canonical` takes a call that ran in bfloat16 at its bfloat16 input, for bfloat16 products
    #: (:data:`BF16_PRODUCTS`): Linear-like kinds whose ``A`` is the input itself (not convolutions' patches)
    narrow_products: ClassVar[bool] = False

    def ghost_names(self, module: nn.Module) -> frozenset[str]:
        return frozenset({"weight"})

    def operand_activation(self, activation: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        """The input as the weight's products read it: rounded to bfloat16 where :func:`narrow_dtype` says so (for
        a kind with :attr:`narrow_products`), so that the norms, clipped sums and GhostClip's replay agree. Inside
        :func:`shared_rounding`, calls that read one kept input (``q``, ``k``, ``v``) get one rounded tensor, so
        that they also share its input Gram (:func:`input_grams`)."""
        narrow = narrow_dtype(grad_output) if self.narrow_products else None
        if narrow is None or activation.dtype == narrow:
            return activation
        cache = _rounded.get()
        if cache is None:
            return activation.to(narrow)
        # the same data (calls of one input keep views of it, not one object), held by the entry so that its
        # storage is not freed and reused while the entry lives
        key = (*_view_key(activation), narrow)
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = (activation, activation.to(narrow))
        return hit[1]

    def canonical(self, activation: torch.Tensor | None, grad_output: torch.Tensor, B: int, T: int) -> Operands:
        """``(A, G)`` ``(B, 1, T, d)``, ``(B, 1, T, p)`` in float32 from a Linear-like call's input ``(B, *, d)`` and
        output gradient ``(B, *, p)`` (``T`` positions), marked :attr:`Operands.narrow` where the products may run
        in bfloat16."""
        narrow = narrow_dtype(grad_output) if self.narrow_products else None
        cast = to_accumulation if narrow is None else (lambda t: t)  # bfloat16 operands are held as they are
        G = cast(grad_output).reshape(B, 1, T, grad_output.shape[-1])
        A = None
        if activation is not None:
            A = cast(self.operand_activation(activation, grad_output)).reshape(B, 1, T, activation.shape[-1])
        return Operands(A, G, narrow)

    def position_dims(self, grad_output: torch.Tensor) -> tuple[int, ...]:
        """The positions of an output gradient (Linear-like ``(B, *, p)``: the middle dimensions)."""
        return tuple(range(1, grad_output.dim() - 1))

    def reduce_without_activation(self, module: nn.Module, grad_output: torch.Tensor) -> torch.Tensor:
        dims = self.position_dims(grad_output)
        return to_accumulation(grad_output).sum(dim=dims, keepdim=True) if dims else grad_output

    def prefers_ghost(self, module: nn.Module, ctx: Any, name: str) -> bool:
        return prefers_ghost(*ctx)

    def instantiation_fits(self, module: nn.Module, ctx: Any, name: str, readers: int = 1) -> bool:
        return name == "bias" or instantiation_fits(*ctx, readers)

    def ghost_norm_parts(self, module: nn.Module, ctx: Any, name: str
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        A, G = ctx
        return ghost_norm_parts(A, G, narrow=narrow_of(ctx))

    def contraction_positions(self, module: nn.Module, ctx: Any, name: str) -> int:
        return ctx[1].shape[2]  # G (B, g, T, p)

    def guard_contracted(self, module: nn.Module, ctx: Any, name: str, sq: torch.Tensor) -> torch.Tensor:
        A, G = ctx
        if name == "bias" or A is None:  # the bias's sum reads G summed over positions, as its instantiation does
            return sq
        a_norms = _rounding.row_norms(A, torch.promote_types(A.dtype, torch.float32))  # (never below the true ones)
        return _rounding.guard_contracted(sq, A, A.shape[-1], a_norms, G)

    def per_sample_grad(self, module: nn.Module, ctx: Any, name: str) -> torch.Tensor:
        A, G = ctx
        if name == "bias":
            return to_accumulation(G).sum(dim=2).flatten(1)
        return per_sample_grad(A, G, narrow_of(ctx)).reshape(G.shape[0], *module.weight.shape)

    def clipped_sum(self, module: nn.Module, ctx: Any, name: str, coef: torch.Tensor) -> torch.Tensor:
        A, G = ctx
        if name == "bias":
            G = to_accumulation(G)
            return torch.einsum("b,bp->p", coef.to(G.dtype), G.sum(dim=2).flatten(1))
        return clipped_sum(A, G, coef, narrow_of(ctx)).reshape(module.weight.shape)

    def factors(self, module: nn.Module, ctx: Any, name: str) -> Factors | None:
        A, G = ctx
        G = to_accumulation(G)  # (bfloat16 operands: a shared weight's pairwise Grams are taken in float32)
        if name == "bias":  # (g p,) as g blocks of (p x 1): G against a column of ones
            return Factors(G, G.new_ones(*G.shape[:3], 1))
        return Factors(G, None if A is None else to_accumulation(A))
