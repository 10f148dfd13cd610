"""Per-sample squared norms ``||g_i||^2`` of each parameter, from the records of one backward pass.

Step 1 of the clipping stage (after capture, before the clipping factors): per parameter, by the ghost norm or by
instantiating ``g_i``, as the clipping mode (:mod:`fastdp.modes`) and the layer kind's cost model decide. A parameter
used by several calls (a module called twice, a weight tied into two modules) gets the norm of its per-sample *sum*
over all uses: by Gram matrices of every pair of uses where that is cheaper, else from instantiated per-sample
gradients. Also: instantiation on arrival (during the backward pass, to free the kept tensors early) and the check
that every record of a pass saw the same batch size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fastdp.layers import _factored, _rounding
from fastdp.layers._rounding import Exact
from fastdp.layers.base import LayerKind, accumulation_dtype
from fastdp.modes import ClippingMode
from fastdp.records import Record


def use_ghost(kind: LayerKind, module: nn.Module, ctx: Any, name: str, mode: ClippingMode, readers: int = 1) -> bool:
    """Whether parameter ``name`` of a call gets its per-sample norm from the ghost norm (else by instantiation).

    * ``"BK-ghost"``, ``"ghost"``: always, where the kind has a ghost norm; ``"instantiate"``: never.
    * ``"BK-MixGhostClip"``: the paper's cost model, ghost when ``2 T^2 < p d`` (:meth:`LayerKind.prefers_ghost`).
    * ``"BK-MixOpt"`` (default): the same, except that a per-sample gradient no larger than what book-keeping keeps
      of the call anyway (``p d <= T (p + d)``, :meth:`LayerKind.instantiation_fits`; ``T (p + d / readers)`` when
      ``readers`` recorded calls read the same input, which is kept once for all of them) is instantiated: it is
      then computed as the output gradient arrives and replaces the kept input and output gradient
      (:func:`instantiate_on_arrival`), so it costs no memory, and it saves the ``T x T`` Gram matrices' time.
    """
    if name not in kind.ghost_names(module) or mode.norms == "never":
        return False
    if mode.norms == "always":
        return True
    if not kind.prefers_ghost(module, ctx, name):
        return False
    return not (mode.norms == "cost-fits" and kind.instantiation_fits(module, ctx, name, readers))


def instantiate_on_arrival(rec: Record, mode: ClippingMode) -> bool:
    """When the output gradient of a layer-kind call arrives in the backward pass and none of its trainable
    parameters gets the ghost norm (:func:`use_ghost`), compute their per-sample gradients now (``rec.psg``) and drop
    the kept activation and output gradient, instead of holding both until the backward pass ends. Only in the
    modes that use kept per-sample gradients for the clipped sum (``BK-MixOpt``, ``instantiate``). Exact: the same
    per-sample gradients the end of the backward pass would compute. Returns whether it did."""
    if (not mode.on_arrival or rec.psg is not None or rec.activation is None or len(rec.grads) != 1
            or rec.grads[0] is None or not rec.kind.replayable):
        return False
    kind, module = rec.kind, rec.module
    ctx = kind.prepare(module, rec.activation, rec.grad_output)
    names = sorted(rec.names)
    if any(use_ghost(kind, module, ctx, n, mode, rec.readers[0]) for n in names):
        return False
    rec.batch = kind.batch_size(rec.activation, rec.grad_output)
    rec.psg = {n: kind.per_sample_grad(module, ctx, n) for n in names}
    rec.activation, rec.grads = None, [None]
    return True


def per_sample_grad(rec: Record, name: str) -> torch.Tensor:
    return rec.psg[name] if rec.psg is not None else rec.kind.per_sample_grad(rec.module, rec.ctx, name)


def batch_size_of(records: list[Record]) -> int:
    sizes = {id(r): r.batch if r.psg is not None else r.kind.batch_size(r.activation, r.grad_output)
             for r in records}
    distinct = set(sizes.values())
    if len(distinct) > 1:
        detail = ", ".join(f"{type(r.module).__name__}: {sizes[id(r)]}" for r in records)
        raise RuntimeError(
            "hooked layers saw different batch sizes in one backward pass "
            f"({detail}). fastdp needs the batch dimension first in every layer's input; an input without it "
            "(shared by all samples) must have size 1 there (it is then broadcast). A layer whose input folds "
            "the batch into another dimension (a leading size that is a multiple of the batch size, as in "
            "x.reshape(-1, d) before a Linear: HF OPT's decoder layers do this), or has no batch dimension, cannot "
            "be attributed to samples. Keep the batch dimension in the model's forward, or freeze those layers."
            + (" Here some layers ran in a call of a submodule on its own (such as model.transformer(...) of a "
               "Hugging Face model), outside a call of the model the engine was built with: the engine learns the "
               "batch size from that call, and without it cannot broadcast an input of batch size 1 (a (1, T) "
               "position table). Call the engine's model itself (wrap the submodule and your head in one "
               "nn.Module and build the engine on it), or give every input its batch dimension (e.g. position_ids "
               "of shape (B, T))." if any(r.rootless for r in records) else ""))
    return distinct.pop()


#: rows of at most this many elements get one fused norm each (:func:`norm_sq`); longer rows are cut into pieces
_ROW = 4096


def norm_sq(t: torch.Tensor) -> torch.Tensor:
    """``||t_i||^2`` per sample of a ``(B, *shape)`` tensor (``shape`` may be empty: a scalar parameter), shape
    ``(B,)``, in at least float32.

    ``torch.linalg.vector_norm`` reads ``t`` once and allocates no full-size temporary (``t.square().sum()`` writes
    a second copy of every per-sample gradient: memory-bound, and on CPU a fresh allocation of that size is paid
    in page faults). Its single-pass accumulation loses accuracy on very long rows, so a sample's ``n`` entries are
    taken as rows of at most about :data:`_ROW` elements (the tensor's own trailing dimensions where they fit),
    normed one by one and the squared row norms summed: the accuracy of ``square().sum()``, at the speed of the
    fused kernel.
    """
    B = t.shape[0]
    n = math.prod(t.shape[1:])
    dtype = accumulation_dtype(t.dtype)
    if n == 0:
        return t.new_zeros(B, dtype=dtype)
    rows = _row_length(t.shape[1:], n)
    if rows is None:  # no row length that divides n: the two-pass form
        return t.reshape(B, n).to(dtype).square().sum(dim=1)
    norms = torch.linalg.vector_norm(t.reshape(B, n // rows, rows), dim=2, dtype=dtype)
    return norms.square().sum(dim=1)


def _row_length(shape: tuple[int, ...] | torch.Size, n: int) -> int | None:
    """A row length ``r`` dividing ``n`` with ``r <= _ROW`` (``n`` itself when small): the product of the trailing
    dimensions of ``shape`` while it stays under :data:`_ROW`, else 1024 when it divides ``n``; ``None`` if
    neither works."""
    if n <= _ROW:
        return n
    r = 1
    for size in reversed(tuple(shape)):
        if r * size > _ROW:
            break
        r *= size
    if r >= 256:
        return r
    return 1024 if n % 1024 == 0 else None


def shared_norm_sq(plist: list[tuple[Record, str]], mode: ClippingMode, shape: Sequence[int]
                   ) -> tuple[torch.Tensor, Exact | None] | None:
    """``||sum_u g_i^u||^2`` of a parameter of ``shape`` used by several calls, by Gram matrices (``None``:
    instantiate), and the samples taken apart where rounding rules it
    (:func:`fastdp.layers._rounding.exact_flagged`).

    ``sum_u ||g^u||^2 + 2 sum_{u<v} <g^u, g^v>``, every term in its ghost form (:mod:`fastdp.layers._factored`).
    Chosen in the ghost modes and, in the mixed modes, when ``2 (sum_u T_u)^2 < g m n`` (the single-layer rule with
    all uses' positions together).
    """
    if mode.norms == "never" or any(r.psg is not None for r, _ in plist):
        return None
    facs = [r.kind.factors(r.module, r.ctx, n) for r, n in plist]
    if any(f is None for f in facs) or len({f.layout for f in facs}) != 1:
        return None
    g, m, n = facs[0].layout
    positions = sum(f.positions for f in facs)
    if mode.norms in ("cost", "cost-fits") and not 2 * positions * positions < g * m * n:
        return None
    dtype = next(t.dtype for f in facs for t in (f.left, f.right) if isinstance(t, torch.Tensor))
    total = err = bound = None
    for u, (fu, (rec, name)) in enumerate(zip(facs, plist, strict=True)):
        if name in rec.kind.ghost_names(rec.module):
            term, term_err, _ = rec.kind.ghost_norm_parts(rec.module, rec.ctx, name)  # unguarded: the total is
        else:
            term, term_err = _rounding.inner_parts(fu, fu, dtype)
        for fv in facs[u + 1:]:
            cross, cross_err = _rounding.inner_parts(fu, fv, dtype)
            term, term_err = term + 2.0 * cross, term_err + 2.0 * cross_err
        total = term if total is None else total + term
        err = term_err if err is None else err + term_err
        b = _rounding.norm_bound(fu, dtype)
        bound = b if bound is None else bound + b
    # uses whose gradients cancel (a tied weight's) or positions within one: the guard on the total, whose rounding
    # is that of every Gram of every pair; the triangle bound sum_u ||g_i^u|| caps what a flagged sample gets
    return _rounding.exact_flagged(total, err, bound.square(),
                                   lambda index: [_factored.select(f, index) for f in facs], shape, positions)
