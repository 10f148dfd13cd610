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
    """:func:`inner` and a bound of its rounding (:func:`gram_rounding`), both ``(B,)``. A Gram of a one-hot factor
    (a token-equality mask or a gather) is exact; a dense one rounds like any product of its width."""
    if u.layout != v.layout:
        raise ValueError(f"factored gradients of layouts {u.layout} and {v.layout} cannot be paired")
    gl, gr = gram(u.left, v.left, dtype), gram(u.right, v.right, dtype)
    err = torch.zeros(gl.shape[0], dtype=gl.dtype, device=gl.device)
    for other, a, b in ((gr, u.left, v.left), (gl, u.right, v.right)):  # each Gram's rounding, against the other
        if not (isinstance(a, OneHot) or isinstance(b, OneHot)):
            err = err + gram_rounding(other, position_norms(a, dtype), position_norms(b, dtype), _width(a))
    return gram_inner(gl, gr), err


def position_norms(s: Side, dtype: torch.dtype) -> torch.Tensor:
    """``(B, g, T)``: the norms of a factor's rows (1 for a one-hot factor)."""
    if isinstance(s, OneHot):
        return torch.ones(s.ids.shape, dtype=dtype, device=s.ids.device)
    return torch.linalg.vector_norm(s.to(dtype), dim=-1)


def norm_bound(f: Factors, dtype: torch.dtype) -> torch.Tensor:
    """``(B,)``: an upper bound of ``||g_i||`` whatever cancels (:func:`triangle_bound_sq`'s root)."""
    return triangle_bound_sq(position_norms(f.left, dtype), position_norms(f.right, dtype)).sqrt()


#: A ghost norm ``sq_i = sum_{t,s} K_ts L_ts`` (two Gram matrices, ``K_ts = <l_t, l_s>``, ``L_ts = <r_t, r_s>``) is
#: flagged as ruled by rounding when ``sq_i < CANCELLATION_GUARD * err_i``, ``err_i`` a worst-case bound of its
#: rounding (:func:`gram_rounding`). The per-sample gradient ``sum_t l_t r_t^T`` then cancels across positions (or
#: uses) to far below its terms, and the computed ``sq_i`` can be anything from 0 to several times the true one,
#: while the book-keeping contraction releases the true gradient (plus a far smaller rounding). Red-team
#: constructions released 170 R (two positions with one input and output gradients ``g``, ``-(1 + 2^-12) g``: ``sq``
#: clamped to 0, clipping factor 1) and, against an estimate that assumed rounding growing like ``sqrt(width)``,
#: 1.03-2.8 R (float32 sums in 8 or 4 lanes, float64 in one register, each dropping a tail of products). A flagged
#: sample's squared norm becomes ``max(sq_i, 0) + FLAGGED_INFLATION * err_i`` (at most the triangle bound
#: ``(sum_t ||l_t|| ||r_t||)^2``, which no cancellation can exceed): never below the true one. Not flagged, the
#: rounding is below ``1 / CANCELLATION_GUARD`` of ``sq_i``, so ``||C_i g_i|| <= sqrt(1 + 2^-6) R = 1.008 R`` at
#: worst, whatever the summation order (to the rounding of the final sum over ``T^2`` products and of the
#: contraction, both far smaller in practice).
CANCELLATION_GUARD = 2.0 ** 6
#: how many rounding bounds a flagged sample's squared norm is raised by (:data:`CANCELLATION_GUARD`)
FLAGGED_INFLATION = 2.0


def gram_rounding(other: torch.Tensor, norms_t: torch.Tensor, norms_s: torch.Tensor, width: int) -> torch.Tensor:
    """``(B,)``: ``u width sum_{t,s} ||x_t|| ||y_s|| |M_ts|``, a bound of what the rounding of one Gram ``X Y^T``
    moves ``<X Y^T, M>``: an entry of ``width`` products is off by at most ``(width - 1) u sum_j |x_tj y_sj| <= width u
    ||x_t|| ||y_s||`` in any order of summation (``u`` the unit roundoff of its dtype). ``other`` ``(B, g, Tx, Ty)``:
    the Gram ``M`` it is paired with; ``norms_t``, ``norms_s``: ``(B, g, Tx)``, ``(B, g, Ty)``, the rows' norms of
    ``X`` and ``Y``."""
    u = torch.finfo(other.dtype).eps / 2
    quad = (torch.matmul(other.abs(), norms_s.unsqueeze(-1)).squeeze(-1) * norms_t).sum(dim=(1, 2))
    return quad * (u * max(width, 1))


def guarded_sq(sq: torch.Tensor, err: torch.Tensor, bound_sq: torch.Tensor) -> torch.Tensor:
    """``sq`` ``(B,)`` where rounding does not rule it (:data:`CANCELLATION_GUARD`), else ``max(sq, 0) +
    FLAGGED_INFLATION * err``, at most ``bound_sq`` (the triangle bound's square) times ``1 + 2^-10``. ``err``
    ``(B,)``: the bound of ``sq``'s rounding (:func:`gram_rounding`, summed over the Grams that gave it). No host
    synchronisation; a NaN ``sq`` stays NaN."""
    flagged = sq < CANCELLATION_GUARD * err
    raised = torch.minimum(sq.clamp(min=0) + FLAGGED_INFLATION * err, bound_sq * (1.0 + 2.0 ** -10))
    return torch.where(flagged, raised, sq)


def symmetric_parts(K: torch.Tensor, L: torch.Tensor, width_k: int, width_l: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sq, err, bound_sq)`` ``(B,)`` each, for :func:`guarded_sq`, of the ghost norm ``<K_i, L_i>`` of two whole
    symmetric Grams ``(B, g, T, T)`` whose entries are products of ``width_k`` and ``width_l`` numbers (``0``: an
    exact Gram, e.g. a token-equality mask)."""
    nk, nl = diagonal_norms(K), diagonal_norms(L)
    err = torch.zeros(K.shape[0], dtype=K.dtype, device=K.device)
    if width_k:
        err = err + gram_rounding(L, nk, nk, width_k)
    if width_l:
        err = err + gram_rounding(K, nl, nl, width_l)
    return gram_inner(K, L), err, triangle_bound_sq(nk, nl)


def guarded_instantiated_sq(sq: torch.Tensor, bound_sq: torch.Tensor) -> torch.Tensor:
    """For a norm taken from an instantiated per-sample gradient ``fl(sum_t l_t r_t^T)`` while the clipped sum is a
    separate contraction: ``max(sq, (2^12 u)^2 bound_sq)`` ``(B,)``, ``bound_sq`` the triangle bound's square
    ``(sum_t ||l_t|| ||r_t||)^2``. The two roundings of one sum differ by about ``k u sum_t ||l_t|| ||r_t||`` (``k``
    the summation's growth, far below ``2^12``), which rules a gradient cancelled that far: a red-team tie (``(2^16
    + 2^40) - 2^40``, 0 in the instantiation and ``2^17`` in the contraction, where another sample's term broke the
    tie) released 131072 R. The floor covers that difference; a gradient that is exactly 0 by symmetry keeps a norm
    of ``2^-41`` of its terms in float64 (``2^-12`` in float32), far below any threshold, so its clipping factor is
    unchanged. Legitimate data never comes near (random positions: ``||g_i||`` about ``T^-1/2`` of the bound)."""
    u = torch.finfo(sq.dtype).eps / 2
    return torch.maximum(sq, (2.0 ** 12 * u) ** 2 * bound_sq)


def triangle_bound_sq(norms_left: torch.Tensor, norms_right: torch.Tensor | float) -> torch.Tensor:
    """``sum_j (sum_t ||l_jt|| ||r_jt||)^2`` ``(B,)`` from position norms ``(B, g, T)``: the square of an upper bound
    of ``||g_i||`` (``g_i[j] = sum_t l_jt r_jt^T``, the triangle inequality per group) that holds whatever cancels."""
    return (norms_left * norms_right).sum(-1).square().sum(-1)


def diagonal_norms(gram: torch.Tensor) -> torch.Tensor:
    """``(B, g, T)``: ``sqrt`` of a Gram matrix's ``(B, g, T, T)`` diagonal, the positions' norms."""
    return torch.diagonal(gram, dim1=-2, dim2=-1).clamp(min=0).sqrt()


def gram_inner(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``<a_i, b_i>`` per sample of two ``(B, ...)`` tensors of one shape (Gram matrices), shape ``(B,)``.

    ``torch.linalg.vecdot`` over the flattened sample. (A batched ``(1 x n) @ (n x 1)`` product, ``bmm``, is a
    matrix-vector shape that CPU BLAS ran about 50 times slower than this multiply-and-sum: benchmarks/levers.py.)
    """
    B = a.shape[0]
    n = math.prod(a.shape[1:])  # explicit: B may be 0 (empty batch)
    return torch.linalg.vecdot(a.reshape(B, n), b.reshape(B, n), dim=1)
