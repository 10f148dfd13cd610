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
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from fastdp.layers import _grams, _guard_batch, _products, _rounding
from fastdp.layers._factored import Factors
from fastdp.layers.base import LayerKind, to_accumulation


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
#: accumulation and output (:func:`fastdp.torch_api.bf16_matmul_float32`: tensor cores on CUDA) instead of IEEE float32
#: ones. Exact in the same sense as the float32 path: the input is taken rounded to bfloat16 as the forward's own
#: product took it (:func:`narrow_dtype`), so both operands hold bfloat16 values and every product of two is exact in
#: float32; the scaled operand ``coef_i G_i`` of the clipped sum, a float32 tensor, is split exactly into three bfloat16
#: tensors (:func:`fastdp.layers._products.split_bf16`), one product each. Norms, clipped sums and GhostClip's replay
#: all read the same rounded input, so ``||coef_i g_i|| <= R`` holds to float32 rounding. Empty (off everywhere): on an
#: H200 it took a GPT-2-small T 512 bf16-autocast step from 2.65x to 2.26x non-private bf16 training's, but RoBERTa-base
#: held 8051 against 3193 MB (each call keeps a rounded float32 copy of its input; docs/results/cuda.md, 2026-11-28).
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


def per_sample_grad(A: torch.Tensor, G: torch.Tensor, narrow: torch.dtype | None = None) -> torch.Tensor:
    """Per-sample weight gradients ``(B, g, p, d)``: ``G_i^T A_i`` (:func:`fastdp.layers._products.product`)."""
    if narrow is None:
        return torch.einsum("bgtp,bgtd->bgpd", G, A)
    return _products.product(G.transpose(-1, -2), A, narrow)


def ghost_norm_sq(A: torch.Tensor, G: torch.Tensor, share: bool = True,
                  narrow: torch.dtype | None = None) -> torch.Tensor:
    """``||G_i^T A_i||_F^2`` summed over groups, shape ``(B,)``, from Gram matrices in strips
    (:func:`fastdp.layers._grams.gram_strips`, :func:`fastdp.layers._grams.strips_inner`), guarded against rounding
    where the gradient cancels across positions (:func:`fastdp.layers._rounding.guarded_sq` of
    :func:`ghost_norm_parts`)."""
    return _rounding.guarded_sq(*ghost_norm_parts(A, G, share, narrow))


def ghost_norm_parts(A: torch.Tensor, G: torch.Tensor, share: bool = True, narrow: torch.dtype | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sq, err, bound_sq)`` ``(B,)`` each: the unguarded ghost norm ``||G_i^T A_i||_F^2``, a bound of its
    rounding and the triangle bound's square (:func:`fastdp.layers._rounding.guarded_sq`). ``share``: the input Gram
    may come from (and go to) the cache of :func:`fastdp.layers._grams.shared_input_grams` (only for an ``A`` that
    stays alive for the whole pass: the cache is keyed by its storage). ``narrow``: the Gram products in bfloat16
    with float32 accumulation (:func:`fastdp.layers._products.product`)."""
    parts = ghost_norm_pieces(A, G, share, narrow)
    return _rounding.symmetric_finish(parts) if isinstance(parts, _rounding.SymmetricReductions) else parts


def ghost_norm_pieces(A: torch.Tensor, G: torch.Tensor, share: bool = True, narrow: torch.dtype | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | _rounding.SymmetricReductions:
    """:func:`ghost_norm_parts`, left as the Grams' reductions (whole or in strips; their element-wise rest done with
    other parameters', :mod:`fastdp.layers._guard_batch`), except at one position."""
    if A.shape[2] == 1:  # one position: ||a||^2 ||g||^2, a product of two sums of squares (nothing cancels)
        A, G = to_accumulation(A), to_accumulation(G)
        # each sum raised by what its squares can lose below the normal range (half the smallest subnormal each):
        # output gradients of 2^-76 against inputs of 2^60 otherwise gave ||g||^2 = 0, a clipping factor of 1, and
        # the contraction's normal terms released (the red-team construction of _rounding.gram_rounding, at T 1)
        eta = _rounding.roundoffs(A.dtype)[1]
        sq = ((A.square().sum(-1) + A.shape[-1] * eta) * (G.square().sum(-1) + G.shape[-1] * eta)).sum(dim=(1, 2))
        return sq, torch.zeros_like(sq), sq
    aat = _grams.input_grams(A, narrow) if share else _grams.gram_strips(A, narrow)
    ggt = _grams.gram_strips(G, narrow)
    d, p = _grams.gram_width(A), _grams.gram_width(G)  # each Gram's entries' rounding, as gram_strips summed them
    if len(aat) == 1:
        if not _guard_batch.BATCHED:  # (benchmarks/levers.py's "before": the whole guard per parameter)
            return _rounding.symmetric_parts(aat[0], ggt[0], d, p)
        return _rounding.symmetric_reductions(aat[0], ggt[0], d, p)
    # the same reductions as whole Grams give, read from the strips (finished by the same formula, so that a sample's
    # flag does not depend on how the Grams were cut or grouped)
    red = _rounding.reduction_width(aat[0].dtype, A.shape[1] * A.shape[2] ** 2)  # the final sum's rounding
    return _rounding.SymmetricReductions(
        _grams.strips_inner(aat, ggt), _grams.strips_diagonal(aat), _grams.strips_diagonal(ggt),
        _grams.strips_frobenius(aat), _grams.strips_frobenius(ggt), d, p, red)


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
    (:func:`fastdp.layers._products.split_bf16`); the other operand holds bfloat16 values already."""
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
            return _products.split_product(A2.t(), Gt.t(), narrow).t().unsqueeze(0)
        return _products.split_product(Gt, A2, narrow).unsqueeze(0)
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
        that they also share its input Gram (:func:`fastdp.layers._grams.input_grams`)."""
        narrow = narrow_dtype(grad_output) if self.narrow_products else None
        if narrow is None or activation.dtype == narrow:
            return activation
        cache = _rounded.get()
        if cache is None:
            return activation.to(narrow)
        # the same data (calls of one input keep views of it, not one object), held by the entry so that its
        # storage is not freed and reused while the entry lives
        key = (*_grams.view_key(activation), narrow)
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

    def ghost_norm_pieces(self, module: nn.Module, ctx: Any, name: str
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | _rounding.SymmetricReductions:
        if type(self).ghost_norm_parts is not OuterProductKind.ghost_norm_parts:  # (a kind with its own: conv)
            return self.ghost_norm_parts(module, ctx, name)
        A, G = ctx
        return ghost_norm_pieces(A, G, narrow=narrow_of(ctx))

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
