"""Where floating point can break the clip bound ``||C_i g_i|| <= R``, and the guards that keep it.

The clipping stage computes a sample's norm one way (Gram matrices, or an instantiated per-sample gradient) and its
clipped sum another (the book-keeping contraction ``sum_i (coef_i X_i)^T Y_i``). Exact arithmetic makes them agree;
floating point agrees to rounding *relative to the terms*, which is not enough in two cases:

* **range**: a huge operand (an entry near ``2^64 / sqrt(width)`` or beyond) overflows a ghost norm's squared
  position norms (the sample is then non-finite), or, where the norm was instantiated, lets the scaled operand
  ``coef_i X_i`` fall below the normal range and round off (:func:`beyond_norm_range`);
* **cancellation**: a gradient that cancels across positions (or uses of a shared weight) to far below its terms,
  where the rounding of the Grams, or the two roundings of one sum, rule the result (:func:`guarded_sq`,
  :func:`guarded_instantiated_sq`).

Each guard flags what it cannot bound and gives such a sample a norm that no rounding can undercut (infinite, i.e.
non-finite; raised by the rounding bound; at most the triangle bound ``sum_t ||l_t|| ||r_t||``), with no host
synchronisation. On the CPU, where a host read is free, the samples a ghost norm flags are then instantiated and
summed apart from the contraction (:func:`exact_flagged`), so legitimate gradients that cancel are not over-clipped.
docs/internals/clipping.md ("Gradients that cancel") has the red-team constructions each guard answers and what they
leave.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fastdp import deferred
from fastdp.layers import _factored
from fastdp.layers._factored import Factors, OneHot, Side


def inner_parts(u: Factors, v: Factors, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fastdp.layers._factored.inner` and a bound of its rounding (:func:`gram_rounding`), both ``(B,)``. A
    Gram of a one-hot factor (a token-equality mask or a gather) is exact; a dense one rounds like any product of its
    width."""
    if u.layout != v.layout:
        raise ValueError(f"factored gradients of layouts {u.layout} and {v.layout} cannot be paired")
    gl, gr = _factored.gram(u.left, v.left, dtype), _factored.gram(u.right, v.right, dtype)
    err = torch.zeros(gl.shape[0], dtype=gl.dtype, device=gl.device)
    _, m, n = u.layout
    red = reduction_width(gl.dtype, math.prod(gl.shape[1:]))  # the final sum's, charged to one dense Gram's term
    for other, a, b, width in ((gr, u.left, v.left, m), (gl, u.right, v.right, n)):  # each Gram against the other
        if not (isinstance(a, OneHot) or isinstance(b, OneHot)):
            err = err + gram_rounding(frobenius(other), position_norms(a, dtype), position_norms(b, dtype),
                                      width + red)
            red = 0
    return _factored.gram_inner(gl, gr), err


def position_norms(s: Side, dtype: torch.dtype) -> torch.Tensor:
    """``(B, g, T)``: upper bounds of the norms of a factor's rows (1 for a one-hot factor): :func:`row_norms`."""
    if isinstance(s, OneHot):
        return torch.ones(s.ids.shape, dtype=dtype, device=s.ids.device)
    return row_norms(s, dtype)


def row_norms(X: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(...)``: upper bounds of the norms of ``X``'s rows ``(..., m)`` in ``dtype``, never below the true ones:
    ``torch.linalg.vector_norm`` in ``dtype``, its square raised by the rounding and underflow of a sum of ``m``
    squares (:func:`upper_sq`). In float32 a row of entries below ``2^-75`` otherwise has norm 0, and a triangle
    bound taken from it would be no bound (summing in float64 instead took GPT-2's vocabulary-wide LM head 70 ms a
    step)."""
    n = torch.linalg.vector_norm(X.to(dtype) if X.dtype != dtype else X, dim=-1)
    return upper_sq(n.square(), X.shape[-1] + 2).sqrt()  # (+2: the square root's rounding and the square's)


def roundoffs(dtype: torch.dtype) -> tuple[float, float]:
    """``(u, eta)`` of a floating dtype: its unit roundoff (``2^-24`` in float32) and half its smallest subnormal
    (``2^-150``), what one product or sum that falls below the normal range can lose whatever its size."""
    info = torch.finfo(dtype)
    return info.eps / 2, info.tiny * info.eps / 2


def upper_sq(sq: torch.Tensor, width: int) -> torch.Tensor:
    """``(sq + width eta) / (1 - width u)`` (``inf`` if ``width u >= 1/2``): at least ``||x||^2`` where ``sq`` is a
    computed sum of ``width`` squares of ``x``'s entries in ``sq``'s dtype, in any order (each off by at most ``u``
    of the running sum, and each square by at most ``eta``, half the smallest subnormal, below the normal range)."""
    u, eta = roundoffs(sq.dtype)
    return (sq.clamp(min=0) + width * eta) * (1.0 / (1.0 - width * u) if width * u < 0.5 else math.inf)


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
#: worst, whatever the summation order (the final sum over ``T^2`` products included: :func:`reduction_width`), and
#: with the contraction's own rounding of the sample's terms at most ``(1.008 + 2^-9) R = 1.010 R``
#: (:func:`with_contraction`).
CANCELLATION_GUARD = 2.0 ** 6
#: how many rounding bounds a flagged sample's squared norm is raised by (:data:`CANCELLATION_GUARD`)
FLAGGED_INFLATION = 2.0


def gram_rounding(other_fro: torch.Tensor, norms_t: torch.Tensor, norms_s: torch.Tensor, width: int) -> torch.Tensor:
    """``(B,)``: ``width sum_j (u ||x_j|| ||y_j|| + eta sqrt(Tx Ty)) ||M_j||_F``, a bound of what the rounding of one
    Gram ``X Y^T`` moves ``<X Y^T, M>`` (per group ``j``, summed). An entry of ``width`` products is off by at most
    ``(width - 1) u sum_k |x_tk y_sk| <= width u ||x_t|| ||y_s||`` in any order of summation (``u`` the unit roundoff
    of its dtype), plus ``eta`` (half the smallest subnormal, ``2^-150`` in float32) for each product or
    multiply-add whose result falls below the normal range (a sum of subnormals is exact). ``sum_{t,s} ||x_t|| ||y_s||
    |M_ts| <= ||(||x_t||)_t|| ||(||y_s||)_s|| ||M||_F`` and ``sum_{t,s} |M_ts| <= sqrt(Tx Ty) ||M||_F``
    (Cauchy-Schwarz): two reductions of ``M`` instead of a matrix-vector product per Gram, within about 2x of the sum
    itself on random positions. The underflow term is far below the relative one unless one operand's products
    underflow while the other's Gram is huge (a red-team pass, 2026-11-28: output gradients of ``2^-76`` against
    inputs of ``2^60`` gave a Gram of exact zeros, a ghost norm of 0 and 100 R released). ``other_fro`` ``(B, g)``:
    ``||M_j||_F`` of the Gram it is paired with (:func:`frobenius`); ``norms_t``, ``norms_s``: ``(B, g, Tx)``,
    ``(B, g, Ty)``, the rows' norms of ``X`` and ``Y``."""
    u, eta = roundoffs(other_fro.dtype)
    lengths = torch.linalg.vector_norm(norms_t, dim=-1) * torch.linalg.vector_norm(norms_s, dim=-1)
    lengths = lengths * u + eta * math.sqrt(norms_t.shape[-1] * norms_s.shape[-1])
    return (lengths * other_fro).sum(-1) * max(width, 1)


def frobenius(gram: torch.Tensor) -> torch.Tensor:
    """``(B, g)``: the Frobenius norm of each sample's and group's ``(B, g, Tx, Ty)`` Gram matrix."""
    return torch.linalg.vector_norm(gram, dim=(-2, -1))


def reduction_width(dtype: torch.dtype, products: int) -> int:
    """What the final sum of a ghost norm's ``products`` Gram products (:func:`fastdp.layers._factored.gram_inner`)
    adds to a :func:`gram_rounding` width, charged against ``sum |K_ts L_ts| <= sum ||x_t|| ||x_s|| |L_ts|``: 2 for
    float32 (or narrower) Grams (each product's rounding, and the float64 sum's, below one float32 roundoff up to
    ``2^29`` products), ``products + 1`` for float64 Grams (a float64 sum in any order)."""
    return products + 1 if dtype == torch.float64 else 2


def guarded_sq(sq: torch.Tensor, err: torch.Tensor, bound_sq: torch.Tensor) -> torch.Tensor:
    """``sq`` ``(B,)`` where rounding does not rule it (:data:`CANCELLATION_GUARD`), else ``max(sq, 0) +
    FLAGGED_INFLATION * err``, at most ``bound_sq`` (the triangle bound's square, from norms that no rounding
    undercuts: :func:`diagonal_norms`) times ``1 + 2^-10``. ``err`` ``(B,)``: the bound of ``sq``'s rounding
    (:func:`gram_rounding`, summed over the Grams that gave it); a NaN ``err`` (``0 * inf``: a Gram that overflowed
    paired with one that underflowed) is no bound, so the sample is flagged and gets ``bound_sq``. No host
    synchronisation; a NaN ``sq`` stays NaN."""
    flagged = ~(sq >= CANCELLATION_GUARD * err)
    raised = torch.fmin(sq.clamp(min=0) + FLAGGED_INFLATION * err, bound_sq * (1.0 + 2.0 ** -10))
    return torch.where(flagged & ~sq.isnan(), raised, sq)


#: the most numbers :func:`exact_flagged` instantiates for one parameter's flagged samples (their count times the
#: parameter's size); beyond it (an embedding table, many flagged samples) they keep the raised norm
EXACT_MAX_NUMBERS = 1 << 24
#: :func:`exact_flagged` takes a flagged sample apart only where its raised norm exceeds its computed one by more than
#: this share (``sq / err`` below about 31.5): a sample flagged narrowly (``31.5 <= sq / err < CANCELLATION_GUARD``)
#: keeps the raised norm, over-clipped by at most ``sqrt(1 + 2 / 31.5) - 1 = 3.1 %`` beyond the rounding itself.
#: GPT-2's tied embedding and LM head (vocabulary 8000, T 256, at initialisation) flagged every sample at ``sq /
#: err`` 53-64, where the worst-case bound was loose (the Grams' norm came out within 3e-7 of the exact one); taking
#: all 8 samples apart (8 x 2 M numbers formed in float64) took the step from 1.19x to 1.93x non-private training and
#: its live tensors from 1.00x to 1.42x (lever ``exact-worth`` of benchmarks/levers.py; docs/internals/clipping.md).
#: Its wide output Gram is now summed in chunks (:data:`fastdp.layers._grams.GRAM_CHUNK`): ``sq / err`` 267, not
#: flagged.
EXACT_WORTH = 2.0 ** -5


#: where the contraction's worst-case rounding of a sample's own terms exceeds this share of its norm, the norm is
#: raised by it (:func:`with_contraction`)
CONTRACTION_SHARE = 2.0 ** -9


def with_contraction(sq: torch.Tensor, bound_sq: torch.Tensor, positions: int, copies: int = 1,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """``sq`` ``(B,)`` with the book-keeping contraction's own rounding of each sample's terms added to its norm
    where that rounding is more than :data:`CONTRACTION_SHARE` of it: ``(sqrt(sq) + copies * kappa)^2``, ``kappa =
    positions u sqrt(bound_sq)``.

    The contraction sums a sample's ``positions`` terms ``l_t r_t^T`` in float32 (``u`` the unit roundoff of
    ``sq``'s dtype, the accumulation dtype), each addition off by at most ``u`` of the running sum, so it releases
    ``g_i + delta_i`` with ``||delta_i|| <= positions u sum_t ||l_t|| ||r_t||`` in any order of summation. BLAS sums a
    small layer's positions one after another, and a red-team construction (terms just over half an ulp of the
    running sum) reached that bound: an unflagged Linear(1, 1) sample at 1.028 R (T 2^12 + 2), 1.099 R (2^14),
    1.237 R (2^15). Random positions stay below the share up to about T 1024 (their norm is about ``T^-1/2`` of the
    triangle bound), so this costs them nothing below and at most ``T^1.5 u`` relative above (0.2 % at T 1024, 1.6 %
    at 4096). ``copies``: 2 where the norm was taken from a separately rounded instantiation of the same sum
    (:func:`guard_contracted`). ``keep`` ``(k,)``: samples not contracted (taken apart, :func:`exact_flagged`), left as
    they are. The rounding of the other samples' terms, which share the running sums, is not charged to a sample. No
    host synchronisation; a NaN ``sq`` stays NaN."""
    u = torch.finfo(sq.dtype).eps / 2
    reach = bound_sq.clamp(min=0).sqrt() * (copies * positions * u)
    norm = sq.clamp(min=0).sqrt()
    out = torch.where(reach > CONTRACTION_SHARE * norm, (norm + reach).square(), sq)
    return out if keep is None else out.index_put((keep,), sq[keep])


@dataclass(frozen=True)
class Exact:
    """Samples taken out of a parameter's book-keeping contraction (:func:`exact_flagged`): their positions in the
    batch ``index`` ``(k,)`` and their per-sample gradients ``grads`` ``(k, *param.shape)``, which the clipped sum
    adds as ``sum_k coef[index_k] grads_k``."""

    index: torch.Tensor
    grads: torch.Tensor


def exact_flagged(sq: torch.Tensor, err: torch.Tensor, bound_sq: torch.Tensor,
                  factors_of: Callable[[torch.Tensor], Sequence[Factors] | None], shape: Sequence[int],
                  positions: int) -> tuple[torch.Tensor, Exact | None]:
    """:func:`guarded_sq` ``(B,)``, and each flagged sample's gradient instantiated, where a host read is free; the
    samples left in the contraction (``positions`` terms each) raised by its rounding (:func:`with_contraction`).

    The guard raises a flagged sample's norm by twice the worst-case bound of its rounding, which over-clips a
    legitimate gradient that cancels far below its terms: a key projection whose inputs share a large offset (output
    gradients summing to 0 over positions) lost 25-65 % of its release under param-wise clipping. Its exact norm
    alone would not do: the book-keeping contraction rounds the sample's terms too, by up to about ``n u sum_t ||l_t||
    ||r_t||`` where BLAS sums ``n`` positions one after another (a red-team construction released 1.44 R with an
    exact norm floored at ``2^-12`` of the terms). So the flagged samples ``index`` ``(k,)`` are taken out of the
    contraction: their gradients ``g_i = sum_t l_t r_t^T`` are formed in float64 from their factors (every product
    of float32 or narrower operands exact) and rounded once to ``sq``'s dtype, ``grads`` ``(k, *shape)``; the norm
    is that of ``grads`` and the clipped sum adds ``coef_i grads_i`` itself (fastdp/clipped_sums.py), so norm and sum
    agree at any cancellation, as kept instantiated gradients do.

    Returns ``(sq, Exact(index, grads))``, or ``(sq, None)`` where nothing is flagged or the exact path does not
    apply (then every sample keeps its guarded norm, raised where flagged): device types whose checks wait for the
    release (:func:`fastdp.deferred.defers`: CUDA, where finding the flagged samples would synchronise with the host
    in the backward pass), where ``factors_of(index)`` (the parameter's uses restricted to the samples ``index``)
    gives ``None``, or beyond :data:`EXACT_MAX_NUMBERS`. A sample whose ``err`` or bound is not finite keeps the
    raised norm, and so does one flagged narrowly, whose raise is at most :data:`EXACT_WORTH` of its norm."""
    if deferred.defers(sq.device) or sq.numel() == 0:
        return with_contraction(guarded_sq(sq, err, bound_sq), bound_sq, positions), None
    if not bool((~(sq >= CANCELLATION_GUARD * err)).any()):  # (the common case, read first: guarded_sq is sq)
        return with_contraction(sq, bound_sq, positions), None
    guarded = guarded_sq(sq, err, bound_sq)
    raised = with_contraction(guarded, bound_sq, positions)
    flagged = ((sq < CANCELLATION_GUARD * err) & (guarded > (1.0 + EXACT_WORTH) ** 2 * sq.clamp(min=0))
               & err.isfinite() & bound_sq.isfinite())
    if not bool(flagged.any()):
        return raised, None
    index = flagged.nonzero().squeeze(1)
    if index.numel() * math.prod(shape) > EXACT_MAX_NUMBERS:
        return raised, None
    uses = factors_of(index)
    if uses is None:
        return raised, None
    wide = torch.promote_types(sq.dtype, torch.float64)
    grads = sum(_factored.instantiate(f, wide) for f in uses).to(sq.dtype).reshape(index.numel(), *shape)
    exact = torch.linalg.vector_norm(grads.flatten(1), dim=1, dtype=wide).square().to(sq.dtype)
    return raised.index_put((index,), exact), Exact(index, grads)


def symmetric_parts(K: torch.Tensor, L: torch.Tensor, width_k: int, width_l: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sq, err, bound_sq)`` ``(B,)`` each, for :func:`guarded_sq`, of the ghost norm ``<K_i, L_i>`` of two whole
    symmetric Grams ``(B, g, T, T)`` whose entries are products of ``width_k`` and ``width_l`` numbers (``0``: an
    exact Gram, e.g. a token-equality mask).

    ``err`` is :func:`gram_rounding` of each Gram against the other, written for a Gram's own rows (``X = Y``, so
    ``||(||x_t||)_t||^2`` is the sum of the diagonal's upper bounds, :func:`diagonal_squares`): the same bound in
    about two thirds of the small operations (a ghost norm's guard is a fixed cost per layer). In two halves: the
    reductions of the Grams' entries (:func:`symmetric_reductions`) and the element-wise rest
    (:func:`symmetric_finish`), which :mod:`fastdp.layers._guard_batch` runs once for many parameters."""
    return symmetric_finish(symmetric_reductions(K, L, width_k, width_l))


@dataclass(frozen=True)
class SymmetricReductions:
    """What :func:`symmetric_parts` reads of two symmetric Grams ``K``, ``L`` ``(B, g, T, T)`` (whole, or in strips:
    :func:`fastdp.layers._matmul.ghost_norm_pieces`): ``sq`` ``(B,)``
    their inner product (:func:`fastdp.layers._factored.gram_inner`), ``diag_k``, ``diag_l`` ``(B, g, T)`` their
    diagonals clamped at 0, ``fro_k``, ``fro_l`` ``(B, g)`` their Frobenius norms (``None`` where the other Gram is
    exact: not needed), the entries' widths, and ``red`` (:func:`reduction_width` of the final sum). Tensors may have
    leading dimensions before ``B`` (a stack of parameters', :mod:`fastdp.layers._guard_batch`)."""

    sq: torch.Tensor
    diag_k: torch.Tensor
    diag_l: torch.Tensor
    fro_k: torch.Tensor | None
    fro_l: torch.Tensor | None
    width_k: int
    width_l: int
    red: int

    def key(self) -> tuple:
        """Reductions with the same key are finished by the same operations with the same constants."""
        return (self.sq.dtype, self.diag_k.dtype, self.sq.device, tuple(self.diag_k.shape), self.width_k,
                self.width_l, self.red)


def symmetric_reductions(K: torch.Tensor, L: torch.Tensor, width_k: int, width_l: int) -> SymmetricReductions:
    """The reductions of :func:`symmetric_parts` (one pass over each Gram's entries); nothing of ``K`` or ``L`` is
    kept."""
    return SymmetricReductions(
        _factored.gram_inner(K, L), torch.diagonal(K, dim1=-2, dim2=-1).clamp(min=0),
        torch.diagonal(L, dim1=-2, dim2=-1).clamp(min=0), frobenius(K) if width_l else None,
        frobenius(L) if width_k else None, width_k, width_l, reduction_width(K.dtype, math.prod(K.shape[1:])))


def symmetric_finish(r: SymmetricReductions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`symmetric_parts` from its reductions: element-wise on them and sums over their last dimensions only,
    so a stack of several parameters' reductions gives the stack of their results."""
    sk, sl = diagonal_bound(r.diag_k, r.width_k), diagonal_bound(r.diag_l, r.width_l)
    nk, nl = sk.sqrt(), sl.sqrt()
    u, eta = roundoffs(r.diag_k.dtype)
    under = eta * r.diag_k.shape[-1]  # eta sqrt(Tx Ty), Tx = Ty = T
    red = r.red  # the final sum's, charged to one Gram's term
    terms = None
    if r.width_k:
        terms = sk.sum(-1).mul_(u).add_(under).mul_(r.fro_l).mul_(r.width_k + red)
        red = 0
    if r.width_l:
        t = sl.sum(-1).mul_(u).add_(under).mul_(r.fro_k).mul_(r.width_l + red)
        terms = t if terms is None else terms.add_(t)
    err = terms.sum(-1) if terms is not None else torch.zeros(r.sq.shape, dtype=r.diag_k.dtype,
                                                                 device=r.diag_k.device)
    return r.sq, err, triangle_bound_sq(nk, nl)


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


def diagonal_squares(gram: torch.Tensor, width: int = 0) -> torch.Tensor:
    """``(B, g, T)``: the positions' squared norms from a Gram matrix's ``(B, g, T, T)`` diagonal, each at least the
    true one: ``(D_t + width eta) / (1 - width u)``, ``D_t`` the computed ``||x_t||^2`` of ``width`` squares (off by
    at most ``width (u ||x_t||^2 + eta)`` in any order, :func:`gram_rounding`); ``width`` 0: an exact Gram (a
    token-equality mask). Without the slack a row of entries below ``2^-75`` (float32) had norm 0, and so did the
    triangle bound that caps a flagged sample's raised norm."""
    return diagonal_bound(torch.diagonal(gram, dim1=-2, dim2=-1).clamp(min=0), width)


def diagonal_bound(diag: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`diagonal_squares` from the diagonal itself, clamped at 0 (any shape)."""
    return upper_sq(diag, width) if width else diag


def diagonal_norms(gram: torch.Tensor, width: int = 0) -> torch.Tensor:
    """``(B, g, T)``: the square roots of :func:`diagonal_squares`, the positions' norms, never below the true ones."""
    return diagonal_squares(gram, width).sqrt()


#: an operand entry at or above ``NORM_RANGE / sqrt(width)`` (``width``: the entries of one position) puts its sample
#: outside what the clipping stage can bound: the squared norm of that position may overflow float32 (the ghost
#: norm's Gram diagonal ``||a_t||^2`` is then infinite, and the sample non-finite), and a contraction of the other
#: operand scaled by ``coef_i`` may fall below float32's normal range and round off by more than its rounding. See
#: :func:`beyond_norm_range`.
NORM_RANGE = 2.0 ** 64


def beyond_norm_range(X: torch.Tensor, width: int) -> torch.Tensor:
    """``(B,)`` bool: the samples of ``X`` ``(B, ...)`` with an entry of magnitude ``>= NORM_RANGE / sqrt(width)``.

    A sample not flagged has every position's norm (``width`` entries) below ``2^64``, so its ``T``-position operand's
    Frobenius norm is below ``2^64 sqrt(T)``, as the ghost norm's finite Gram diagonal guarantees. The clipped sum
    ``sum_i (coef_i X_i)^T Y_i`` then loses at most ``2^-150`` per subnormal entry of ``coef_i X_i`` (``2^-134`` for
    the last part of :func:`split_bf16`), so its error beyond float32 rounding is at most
    ``2^-150 sqrt(n_X) 2^64 sqrt(T)`` in absolute terms (``2^-134`` instead of ``2^-150`` with bfloat16 products):
    below ``1e-16`` (``1e-12``) for up to ``2^30`` numbers and positions per sample. Reads ``X`` twice (``amax``,
    ``amin``), no temporary of its size; a NaN entry is not flagged (the sample's norm is NaN anyway)."""
    B = X.shape[0]
    flat = X.reshape(B, math.prod(X.shape[1:]))
    if flat.shape[1] == 0:
        return torch.zeros(B, dtype=torch.bool, device=X.device)
    bound = NORM_RANGE / math.sqrt(max(width, 1))
    return torch.maximum(flat.amax(1), flat.amin(1).neg()).float() >= bound


def guard_contracted(sq: torch.Tensor, A: torch.Tensor, width: int, a_norms: torch.Tensor,
                     G: torch.Tensor) -> torch.Tensor:
    """:meth:`fastdp.layers.base.LayerKind.guard_contracted` for operands ``A`` (``(B, g, T, d)``, or a convolution's
    input whose patches of ``width`` entries are its positions) and ``G`` ``(B, g, T, p)``; ``a_norms`` ``(B, g, T)``:
    the norms of ``A``'s positions."""
    sq = sq.masked_fill(beyond_norm_range(A, width) | beyond_norm_range(G, G.shape[-1]), math.inf)
    g_norms = row_norms(G, torch.promote_types(G.dtype, torch.float32))  # (never below the true norms)
    bound_sq = triangle_bound_sq(a_norms, g_norms)
    return with_contraction(guarded_instantiated_sq(sq, bound_sq), bound_sq, G.shape[2], copies=2)
