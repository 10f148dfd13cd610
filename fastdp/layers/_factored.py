"""Factored per-sample gradients and their inner products: the ghost form of shared (tied) parameters.

Many weight gradients are sums of outer products over positions. Sample ``i``'s gradient of one use is

    g_i[j] = sum_t  L_i[j, t] (x) R_i[j, t]          (group j; an (m x n) block)

with a *left* factor ``L`` ``(B, g, T, m)`` along the weight's rows and a *right* factor ``R`` ``(B, g, T, n)``
along its columns:

* ``nn.Linear`` weight ``(p, d)``: ``L = G`` (output gradients), ``R = A`` (inputs);
* HF ``Conv1D`` weight ``(d, p)`` (transposed Linear): ``L = A``, ``R = G``;
* ``nn.Conv*`` weight ``(g p, d)`` per group: ``L = G``, ``R`` = unfolded patches;
* ``nn.Embedding`` weight ``(V, d)``: ``L`` = one-hot token ids (kept as ids, never a dense ``V``-wide tensor),
  ``R = G``.

For two uses ``u`` and ``v`` of one parameter (a weight tied into an embedding and an LM head; a module called
twice) the inner product needs only position-by-position Gram matrices::

    <g_i^u, g_i^v> = sum_j sum_{t,s} <L^u_i[j,t], L^v_i[j,s]> <R^u_i[j,t], R^v_i[j,s]>

so ``||sum_u g_i^u||^2 = sum_{u,v} <g_i^u, g_i^v>`` costs ``O(T_u T_v (m + n))`` per pair and sample, never
``O(m n)``. A one-hot factor turns its Gram matrix into a token-equality mask (against another one-hot factor)
or a gather of the other factor's columns at the token ids (against a dense factor, e.g. the LM head's output
gradient at the input tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OneHot:
    """A left/right factor whose rows are one-hot vectors: ``ids`` ``(B, g, T)`` into a dimension of ``size``."""

    ids: torch.Tensor
    size: int


Side = torch.Tensor | OneHot


@dataclass(frozen=True)
class Factors:
    """``g_i[j] = sum_t left[i, j, t] (x) right[i, j, t]``; ``left`` ``(B, g, T, m)``, ``right`` ``(B, g, T, n)``."""

    left: Side
    right: Side

    @property
    def layout(self) -> tuple[int, int, int]:
        """``(g, m, n)``: two factored gradients can be paired only if their layouts agree."""
        return (_groups(self.left), _width(self.left), _width(self.right))

    @property
    def positions(self) -> int:
        return _positions(self.left)


def _groups(s: Side) -> int:
    return s.ids.shape[1] if isinstance(s, OneHot) else s.shape[1]


def _positions(s: Side) -> int:
    return s.ids.shape[2] if isinstance(s, OneHot) else s.shape[2]


def _width(s: Side) -> int:
    return s.size if isinstance(s, OneHot) else s.shape[3]


def gram(a: Side, b: Side, dtype: torch.dtype) -> torch.Tensor:
    """``<a[i, j, t], b[i, j, s]>`` for all samples, groups and position pairs: ``(B, g, T_a, T_b)``."""
    if isinstance(a, OneHot) and isinstance(b, OneHot):
        return (a.ids.unsqueeze(-1) == b.ids.unsqueeze(-2)).to(dtype)  # exact integer comparison
    if isinstance(a, OneHot):
        return gram(b, a, dtype).transpose(-1, -2)
    if isinstance(b, OneHot):  # a dense (B, g, Ta, m): a[i, j, t, ids[i, j, s]]
        Ta, Tb = a.shape[2], b.ids.shape[2]
        index = b.ids.unsqueeze(2).expand(*b.ids.shape[:2], Ta, Tb)
        return a.to(dtype).gather(-1, index)
    return torch.matmul(a.to(dtype), b.to(dtype).transpose(-1, -2))


def inner(u: Factors, v: Factors, dtype: torch.dtype) -> torch.Tensor:
    """Per-sample ``<g_i^u, g_i^v>``, shape ``(B,)``, from Gram matrices (see the module docstring)."""
    if u.layout != v.layout:
        raise ValueError(f"factored gradients of layouts {u.layout} and {v.layout} cannot be paired")
    gl = gram(u.left, v.left, dtype)
    gr = gram(u.right, v.right, dtype)
    return gram_inner(gl, gr)


def inner_parts(u: Factors, v: Factors, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`inner` and the ``sum |K_ts L_ts|`` of its Gram inner product (for :func:`guarded_sq`)."""
    if u.layout != v.layout:
        raise ValueError(f"factored gradients of layouts {u.layout} and {v.layout} cannot be paired")
    return gram_inner_parts(gram(u.left, v.left, dtype), gram(u.right, v.right, dtype))


def position_norms(s: Side, dtype: torch.dtype) -> torch.Tensor:
    """``(B, g, T)``: the norms of a factor's rows (1 for a one-hot factor)."""
    if isinstance(s, OneHot):
        return torch.ones(s.ids.shape, dtype=dtype, device=s.ids.device)
    return torch.linalg.vector_norm(s.to(dtype), dim=-1)


def norm_bound(f: Factors, dtype: torch.dtype) -> torch.Tensor:
    """``(B,)``: an upper bound of ``||g_i||`` whatever cancels (:func:`triangle_bound_sq`'s root)."""
    return triangle_bound_sq(position_norms(f.left, dtype), position_norms(f.right, dtype)).sqrt()


#: a ghost norm ``sq_i = sum_{t,s} K_i[t,s] L_i[t,s]`` (two Gram matrices) below ``CANCELLATION_GUARD * u *
#: sum_{t,s} |K_i[t,s] L_i[t,s]|`` (``u``: the unit roundoff of its dtype, 2^-24 in float32) is flagged as ruled by
#: rounding (:func:`guarded_sq`). The per-sample gradient ``sum_t l_t r_t^T`` then cancels across positions (or uses)
#: to far below its terms, so the Grams' rounding, ``~u`` times those terms, can make the computed ``sq`` anything
#: from 0 to several times the true one, while the book-keeping contraction releases the true gradient plus its own
#: rounding: a red-team construction (two positions with one input and output gradients ``g``, ``-(1 + 2^-12) g``)
#: had ``sq`` clamped to 0, clipping factor 1, and released 170 R. A flagged sample's norm is taken as the triangle
#: bound ``sum_t ||l_t|| ||r_t||`` instead (never below the true norm nor the contraction's): clipped harder than
#: exact arithmetic would, never above R. Not flagged, ``sq``'s rounding is at most ``~k / CANCELLATION_GUARD`` of it
#: (``k`` the rounding's growth, a few units to the square root of the products' length), so ``||C_i g_i|| <= R``
#: holds to that (0.1 % at ``k = 8``). A legitimate sample is flagged only if ``sum |K L|`` exceeds ``sq`` by
#: ``2^12`` (float32; ``2^41`` in float64): random positions give a ratio near ``1 + T / sqrt(m n)``.
CANCELLATION_GUARD = 2.0 ** 12


def guarded_sq(sq: torch.Tensor, absum: torch.Tensor, bound_sq: torch.Tensor) -> torch.Tensor:
    """``sq`` ``(B,)`` where it is not ruled by rounding, else ``bound_sq`` (the triangle bound's square, times
    ``1 + 2^-10`` for its own rounding and the contraction's): see :data:`CANCELLATION_GUARD`. ``absum`` ``(B,)``:
    ``sum |K_ts L_ts|`` of the Gram inner product that gave ``sq``. No host synchronisation; a NaN ``sq`` stays NaN."""
    u = torch.finfo(sq.dtype).eps / 2
    flagged = sq < (CANCELLATION_GUARD * u) * absum
    return torch.where(flagged, bound_sq * (1.0 + 2.0 ** -10), sq)


def guarded_instantiated_sq(sq: torch.Tensor, bound_sq: torch.Tensor) -> torch.Tensor:
    """For a norm taken from an instantiated per-sample gradient ``fl(sum_t l_t r_t^T)`` while the clipped sum is a
    separate contraction (whose rounding, ``~u sum_t ||l_t|| ||r_t||``, is not the instantiation's): ``sq`` ``(B,)``,
    or ``bound_sq`` (the triangle bound's square, times ``1 + 2^-10``) where ``||g_i|| < CANCELLATION_GUARD * u *
    sum_t ||l_t|| ||r_t||`` -- a gradient cancelled so far that the two roundings may differ by more than
    ``1 / CANCELLATION_GUARD`` of it. Legitimate data never comes near (random positions: ``||g_i||`` about
    ``T^-1/2`` of the bound)."""
    u = torch.finfo(sq.dtype).eps / 2
    flagged = sq < (CANCELLATION_GUARD * u) ** 2 * bound_sq
    return torch.where(flagged, bound_sq * (1.0 + 2.0 ** -10), sq)


def triangle_bound_sq(norms_left: torch.Tensor, norms_right: torch.Tensor | float) -> torch.Tensor:
    """``sum_j (sum_t ||l_jt|| ||r_jt||)^2`` ``(B,)`` from position norms ``(B, g, T)``: the square of an upper bound
    of ``||g_i||`` (``g_i[j] = sum_t l_jt r_jt^T``, the triangle inequality per group) that holds whatever cancels."""
    return (norms_left * norms_right).sum(-1).square().sum(-1)


def diagonal_norms(gram: torch.Tensor) -> torch.Tensor:
    """``(B, g, T)``: ``sqrt`` of a Gram matrix's ``(B, g, T, T)`` diagonal, the positions' norms."""
    return torch.diagonal(gram, dim1=-2, dim2=-1).clamp(min=0).sqrt()


def gram_inner_parts(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gram_inner` and ``sum |a_i b_i|`` per sample (the scale of its rounding, for :func:`guarded_sq`), from
    one product temporary (about :func:`gram_inner`'s time again on a 2-core CPU)."""
    B = a.shape[0]
    n = math.prod(a.shape[1:])
    prod = a.reshape(B, n) * b.reshape(B, n)
    return prod.sum(1), prod.abs_().sum(1)


def gram_inner(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``<a_i, b_i>`` per sample of two ``(B, ...)`` tensors of one shape (Gram matrices), shape ``(B,)``.

    ``torch.linalg.vecdot`` over the flattened sample. (A batched ``(1 x n) @ (n x 1)`` product, ``bmm``, is a
    matrix-vector shape that CPU BLAS ran about 50 times slower than this multiply-and-sum: benchmarks/levers.py.)
    """
    B = a.shape[0]
    n = math.prod(a.shape[1:])  # explicit: B may be 0 (empty batch)
    return torch.linalg.vecdot(a.reshape(B, n), b.reshape(B, n), dim=1)
