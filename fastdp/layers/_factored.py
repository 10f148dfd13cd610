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


def instantiate(f: Factors, dtype: torch.dtype) -> torch.Tensor:
    """``g_i[j] = sum_t left[i, j, t] (x) right[i, j, t]``, ``(B, g, m, n)``, in ``dtype`` (a one-hot side by a
    scatter of the other side's rows: its ``size`` rows, so only for the few samples it is asked for)."""
    if isinstance(f.left, OneHot) and isinstance(f.right, OneHot):
        raise ValueError("a gradient with two one-hot factors has no dense form here")
    if isinstance(f.right, OneHot):
        return instantiate(Factors(f.right, f.left), dtype).transpose(-1, -2)
    if isinstance(f.left, OneHot):
        ids, rows = f.left.ids, f.right.to(dtype)
        out = rows.new_zeros(*ids.shape[:2], f.left.size, rows.shape[-1])
        return out.scatter_add_(2, ids.unsqueeze(-1).expand(*ids.shape, rows.shape[-1]), rows)
    return torch.einsum("bgtm,bgtn->bgmn", f.left.to(dtype), f.right.to(dtype))


def select(f: Factors, index: torch.Tensor) -> Factors:
    """The factored gradients of the samples ``index`` ``(k,)`` only: both sides indexed along the batch."""
    return Factors(*(OneHot(s.ids[index], s.size) if isinstance(s, OneHot) else s[index] for s in (f.left, f.right)))


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


def gram_inner(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``<a_i, b_i>`` per sample of two ``(B, ...)`` tensors of one shape (Gram matrices, or blocks of them), shape
    ``(B,)``: the products in ``a``'s dtype, their sum accumulated in float64. A ghost norm's final sum over ``T^2``
    products is where a sample's cancellation shows: summed in float32 lanes (``torch.linalg.vecdot``), a red-team
    construction lost 15 products of ``u`` times a lane's first one in every lane and released 1.4 R past the
    rounding guard (fastdp/layers/_rounding.py). In float64 a float32 sum of up to ``2^29`` products loses less than
    one float32 roundoff of ``sum |a_i b_i|``. (A batched ``(1 x n) @ (n x 1)`` product, ``bmm``, is a
    matrix-vector shape that CPU BLAS ran about 50 times slower: benchmarks/levers.py.)"""
    dims = tuple(range(1, a.dim()))
    if not dims:
        return a * b
    return (a * b).sum(dim=dims, dtype=torch.float64).to(torch.promote_types(a.dtype, b.dtype))
