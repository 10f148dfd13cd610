"""The cancellation guard's element-wise work for all of a pass's ghost norms at once.

A ghost norm's guard (:mod:`fastdp.layers._rounding`) is a fixed number of small operations per parameter, on
tensors of ``B`` or ``B g T`` numbers: the bound of its rounding and the triangle bound from the Grams' diagonals
and Frobenius norms (:func:`~fastdp.layers._rounding.symmetric_finish`), then the guarded norm and the
contraction's raise (:func:`~fastdp.layers._rounding.exact_flagged`), about 40 operations. Each is a kernel launch
on a GPU and a dispatch on the CPU, whatever its size, so a 12-block transformer paid about 3000 of them a step.

Here the reductions that need a parameter's own Gram matrices are made per parameter, as its norm is taken
(:func:`~fastdp.layers._rounding.symmetric_reductions`: the inner product, the diagonals, the Frobenius norms), and
the rest once per *group* of parameters whose reductions have the same shapes, dtypes, widths and positions (in a
transformer, one group per kind of projection), on their stack: the same element-wise operations with the same
constants on the same values, so the same results up to the order in which a reduction over positions adds them.
On the CPU the host reads "is any sample flagged?" once per group instead of once per parameter; a parameter with a
flagged sample goes through :func:`~fastdp.layers._rounding.exact_flagged` on its own, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields

import torch

from fastdp import deferred
from fastdp.layers import _rounding
from fastdp.layers._factored import Factors
from fastdp.layers._rounding import Exact, SymmetricReductions

#: a ghost norm as a kind gives it: finished ``(sq, err, bound_sq)`` ``(B,)`` each, or its reductions
Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor] | SymmetricReductions

#: whether ghost norms are finished and guarded in groups (a switch for benchmarks/levers.py's A/B; read at the call)
BATCHED = True


def _groups(keys: Sequence[object]) -> list[list[int]]:
    """Indices of ``keys`` grouped by equal key, in order of first appearance."""
    out: dict[object, list[int]] = {}
    for i, k in enumerate(keys):
        out.setdefault(k, []).append(i)
    return list(out.values())


def _stack(group: list[SymmetricReductions]) -> SymmetricReductions:
    first = group[0]
    values = {}
    for f in fields(SymmetricReductions):
        v = getattr(first, f.name)
        values[f.name] = torch.stack([getattr(r, f.name) for r in group]) if isinstance(v, torch.Tensor) else v
    return SymmetricReductions(**values)


def finish_all(parts: Sequence[Parts]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(sq, err, bound_sq)`` for each of ``parts``: finished ones as they are, reductions finished in groups of
    equal :meth:`~fastdp.layers._rounding.SymmetricReductions.key` on their stack."""
    out: list = [p if not isinstance(p, SymmetricReductions) else None for p in parts]
    todo = [i for i, p in enumerate(parts) if isinstance(p, SymmetricReductions)]
    if not BATCHED:
        for i in todo:
            out[i] = _rounding.symmetric_finish(parts[i])
        return out
    for group in _groups([parts[i].key() for i in todo]):
        members = [todo[j] for j in group]
        if len(members) == 1:
            out[members[0]] = _rounding.symmetric_finish(parts[members[0]])
            continue
        stacked = _rounding.symmetric_finish(_stack([parts[i] for i in members]))
        for i, row in zip(members, zip(*(t.unbind(0) for t in stacked), strict=True), strict=True):
            out[i] = row
    return out


#: one ghost-norm parameter for :func:`exact_flagged_all`: ``(sq, err, bound_sq, factors_of, shape, positions)``,
#: the arguments of :func:`fastdp.layers._rounding.exact_flagged`
Guarded = tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable[[torch.Tensor], Sequence[Factors] | None],
                Sequence[int], int]


def exact_flagged_all(items: Sequence[Guarded]) -> list[tuple[torch.Tensor, Exact | None]]:
    """:func:`fastdp.layers._rounding.exact_flagged` of each item, the element-wise work done once per group of
    items with the same dtype, device, batch and positions.

    Where checks wait for the release (CUDA): the guarded and raised norms of the group's stack. On the CPU: one host
    read of whether any sample of each item is flagged; an item without one gets the contraction's raise from the
    stack, exactly as ``exact_flagged``'s common case; an item with one goes through ``exact_flagged`` on its own
    (its flagged samples taken apart)."""
    if not BATCHED:
        return [_rounding.exact_flagged(*item) for item in items]
    out: list = [None] * len(items)
    keys = [(sq.dtype, sq.device, tuple(sq.shape), err.dtype, bound.dtype, positions)
            for sq, err, bound, _, _, positions in items]
    for group in _groups(keys):
        if len(group) == 1 or items[group[0]][0].numel() == 0:
            for i in group:
                out[i] = _rounding.exact_flagged(*items[i])
            continue
        sq = torch.stack([items[i][0] for i in group])
        err = torch.stack([items[i][1] for i in group])
        bound_sq = torch.stack([items[i][2] for i in group])
        positions = items[group[0]][5]
        if deferred.defers(sq.device):
            rows = _rounding.with_contraction(_rounding.guarded_sq(sq, err, bound_sq), bound_sq, positions)
            for i, row in zip(group, rows.unbind(0), strict=True):
                out[i] = (row, None)
            continue
        flagged = (~(sq >= _rounding.CANCELLATION_GUARD * err)).any(1).tolist()  # (one host read per group)
        rows = _rounding.with_contraction(sq, bound_sq, positions).unbind(0)
        for i, row, f in zip(group, rows, flagged, strict=True):
            out[i] = _rounding.exact_flagged(*items[i]) if f else (row, None)
    return out
