"""Which sample owns each row of a tensor whose rows were chosen by the data (the guard of
:mod:`fastdp.layers.fold_guard`).

Rows chosen by the data (``h[mask]``, ``h.index_select(0, idx)``) can be ``B`` in number while each sample owns a
different number of them: a layer that takes row ``i`` as sample ``i``'s would then charge one sample's rows to
another's clipping budget. The structure probe verifies one batch per input signature, so it cannot see a later
batch whose mask differs. The guard follows, for every row-chosen tensor, its *owners*: an ``int64`` vector on the
host, ``owners[r]`` the sample of row ``r`` (along dimension 0), computed from the actual indices at every call; a
hooked layer's call of ``B`` rows is accepted when they are ``0, 1, …, B - 1``
(:func:`fastdp.capture_fold.check_chosen_rows`). ``None`` is "not known": the call is refused.

* **At a choice** (:func:`selected`): ``x[mask]`` (a boolean mask over ``x``'s leading dimensions: the first
  coordinate of each ``True``), ``x[idx]`` and ``x.index_select(0, idx)`` (``owners(x)[idx]``). The owners of a
  tensor whose rows were not chosen are *natural* (:func:`natural`): row ``r`` of ``N = k B`` rows is sample
  ``r // k``'s, the sample-major layout the structure probe verified for its batch (a tensor whose dimension 0 is
  positions, ``h.transpose(0, 1)``, is not told apart by its shape; the probe is).
* **At a write back** (:func:`written`): ``buf[mask] = f``, ``buf.masked_scatter(mask, f)``, ``buf.index_add(0,
  idx, f)`` / ``index_copy`` / ``index_put((idx,), f)``: each written row must be its source row's sample (its
  slot's natural owner); then the result's rows are natural again (an unpadded block padded back), else unknown.
* **Carried** (:func:`carried`) through functions that keep the rows: element-wise ones, ``F.linear`` and products
  whose first operand is the row-chosen one, reshapes that keep, group (all rows of a group one sample's) or split
  rows, indexing along other dimensions, ``torch.cat`` along dimension 0 (owners concatenated) or others. Lost
  (unknown) through anything that moves, reduces, sorts or scans along dimension 0 (``transpose``/``permute``/
  ``t``, ``sum(0)``, ``softmax(dim=0)``, ``cumsum(0)``, ``flip``, ``roll``, ``cov``, ``einsum``), a product whose
  second operand is the row-chosen one, and a function that combines the rows with another tensor computed from the
  inputs whose rows belong to other samples. ``x[j]`` (an ``int``) leaves rows all of sample ``owners[j]``; a
  constant row joined to the batch's (a position table) is :data:`NO_SAMPLE`'s.

Not seen: functions that mix rows without a dimension argument and keep dimension 0's size (none in torch's
element-wise or row-wise functions; a custom one would be), rows chosen through the host (``.tolist()`` indices),
``torch.ops.aten`` calls, C++ extensions (as :mod:`fastdp.layers.fold_guard` says).
"""

from __future__ import annotations

from typing import Any

import torch

from fastdp.layers.row_functions import ALONG, CAT, LOST, PERMUTE, PRODUCTS, RESHAPES, SECOND, arg_of, dims_of

_T = torch.Tensor
_F = torch.nn.functional

#: the owner of a row that holds no sample's data (a constant joined to the batch's rows: a position table)
NO_SAMPLE = -1
#: the owners of a value written into rows that holds no sample's data (a constant, a fill value)
CONSTANT = torch.empty(0, dtype=torch.long)


def natural(t: torch.Tensor, B: int | None) -> torch.Tensor | None:
    """The owners of ``t``'s rows when they were not chosen: ``r // k`` for ``N = k B`` rows (sample-major), else
    ``None``."""
    if B is None or B < 1 or t.dim() == 0 or t.shape[0] % B:
        return None
    return torch.arange(B).repeat_interleave(t.shape[0] // B)


def _rows_of_index(first: Any) -> torch.Tensor | None:
    """The rows of dimension 0 an index chooses, in the result's order: a boolean mask's first coordinates, an
    integer tensor's values (constant along its other dimensions, or ``None``)."""
    if isinstance(first, list):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in first):
            return None
        first = torch.tensor(first, dtype=torch.long)
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return None
    first = first.detach().cpu()
    if first.dtype in (torch.bool, torch.uint8):  # (a uint8 index is a mask, as for torch's indexing)
        return first.nonzero()[:, 0]
    if first.is_floating_point() or first.is_complex():
        return None
    return first.long()


def _index_tuple(index: Any) -> tuple[Any, ...]:
    return index if isinstance(index, tuple) else (index,)


def _consumed(entry: Any) -> int:
    """How many dimensions of the indexed tensor an index entry stands for."""
    if entry is None or entry is Ellipsis:
        return 0
    if isinstance(entry, torch.Tensor) and entry.dtype in (torch.bool, torch.uint8):
        return max(entry.dim(), 1)
    return 1


def dim0_entry(x: torch.Tensor, index: Any) -> Any:
    """The entry of ``x[index]`` that picks along ``x``'s dimension 0: the first after leading ``None``s; after an
    ``...``, the next one when ``...`` stands for no dimension (``h[..., m, :]`` with ``m`` over the leading
    dimensions), else ``None`` (dimension 0 is in the ``...``)."""
    idx = [e for e in _index_tuple(index)]
    while idx and idx[0] is None:
        idx.pop(0)
    if not idx:
        return None
    if idx[0] is Ellipsis:
        rest = idx[1:]
        if sum(_consumed(e) for e in rest) < x.dim():
            return None
        rest = [e for e in rest if e is not None]
        return rest[0] if rest else None
    return idx[0]


def _plain(rest: tuple[Any, ...]) -> bool:
    """Whether the other entries of an index only pick along later dimensions (slices, ``...``, ``None``, ints)."""
    return all(r is None or r is Ellipsis or isinstance(r, (slice, int)) for r in rest)


def selected(base: torch.Tensor | None, index: Any, out: torch.Tensor) -> torch.Tensor | None:
    """The owners of ``x[index]`` (``index`` choosing dimension 0 first: a mask, an integer tensor or list, or
    several of them broadcast together, ``x[b, t]`` with ``b, t = m.nonzero(as_tuple=True)``), for ``base`` the
    owners of ``x``'s rows."""
    idx = _index_tuple(index)
    if base is None or not idx:
        return None
    lead = 0  # the advanced entries at the front: they pick together, their broadcast shape leads the result
    while lead < len(idx) and isinstance(idx[lead], (torch.Tensor, list)):
        lead += 1
    if lead == 0 or not _plain(idx[lead:]):
        return None
    if lead == 1:
        rows = _rows_of_index(idx[0])
    else:
        first = idx[0]
        if isinstance(first, list):
            first = torch.tensor(first) if all(isinstance(v, int) for v in first) else None
        if not isinstance(first, torch.Tensor) or first.dtype in (torch.bool, torch.uint8):
            return None
        try:
            others = [torch.as_tensor(e) if isinstance(e, list) else e for e in idx[1:lead]]
            if any(e.dtype in (torch.bool, torch.uint8) for e in others):
                return None
            rows = torch.broadcast_tensors(first.detach().cpu().long(), *[e.detach().cpu() for e in others])[0]
        except (RuntimeError, TypeError, ValueError):
            return None
    if rows is None:
        return None
    try:
        own = base[rows]
    except IndexError:
        return None
    if own.dim() > 1:  # an integer index of several dimensions: each result row gathers several rows
        flat = own.flatten(1)
        if not bool((flat == flat[:, :1]).all()):
            return None
        own = flat[:, 0]
    return own if out.dim() >= 1 and own.dim() == 1 and out.shape[0] == own.shape[0] else None


def written(slots: torch.Tensor | None, index: Any, src_owners: torch.Tensor | None) -> torch.Tensor | None:
    """The owners of a tensor after ``dest[index] = src`` (and the scatters of :mod:`fold_guard`): ``slots`` (the
    destination's owners) if each written row of ``src`` is owned by its slot's sample, else ``None``."""
    if src_owners is CONSTANT:
        return slots
    idx = _index_tuple(index)
    if slots is None or src_owners is None or not idx:
        return None
    if idx[0] == slice(None) or idx[0] is Ellipsis:  # along later dimensions: row r written from the value's row r
        return rowwise(slots, src_owners)
    if not _plain(idx[1:]):
        return None
    rows = _rows_of_index(idx[0])
    if rows is None or rows.dim() != 1 or rows.shape[0] != src_owners.shape[0]:
        return None
    try:
        return slots if torch.equal(slots[rows], src_owners) else None
    except IndexError:
        return None


def _regrouped(own: torch.Tensor, rows: int) -> torch.Tensor | None:
    """The owners after a reshape from ``len(own)`` rows to ``rows`` (row-major: rows kept, grouped (each group of
    one sample) or split)."""
    n = own.shape[0]
    if rows == n:
        return own
    if rows and n and rows < n and n % rows == 0:
        g = own.view(rows, n // rows)
        return g[:, 0].clone() if bool((g == g[:, :1]).all()) else None
    if n and rows > n and rows % n == 0:
        return own.repeat_interleave(rows // n)
    return None


def keeps_dim0(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], first: torch.Tensor) -> bool:
    """Whether ``func`` leaves dimension 0 of its first argument ``first`` where it is and unmixed (``T`` and
    ``mT`` of a 2-D tensor, ``t``, ``movedim``: never)."""
    if func in LOST:
        return False
    ndim = first.dim()
    if func in PERMUTE:
        order = args[1:] if len(args) > 1 and isinstance(args[1], int) else arg_of(args, kwargs, 1, ("dims",))
        return bool(order) and dims_of(order[0], ndim) == {0}
    if func in ALONG:
        pos, names, default = ALONG[func]
        value = arg_of(args, kwargs, pos, names, default)
        if value is None:
            # every dimension (a reduction to a number: its result has no rows), the flattened tensor (a roll), or
            # the implicit dimension of a softmax: not kept
            return func not in (torch.roll, _T.roll, _F.softmax, _F.log_softmax, _F.softmin) and \
                func not in (torch.flip, _T.flip)
        dims = dims_of(value, ndim)
        if func in SECOND:
            dims |= dims_of(arg_of(args, kwargs, SECOND[func], ("dim1", "axis1")), ndim)
        if func in (torch.flip, _T.flip) and len(args) > 2:
            dims |= dims_of(args[1:], ndim)
        return 0 not in dims
    return True


def indexed(own: torch.Tensor | None, index: Any, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
    """The owners of ``x[index]`` for an index that does not choose rows by derived values (a slice, ``...``, other
    dimensions; a constant index is a choice of known rows)."""
    if own is None or out.dim() == 0:
        return None
    idx = _index_tuple(index)
    first = idx[0] if idx else Ellipsis
    if first is Ellipsis:
        picked = sum(1 for r in idx[1:] if r is not None)
        new = own if picked < x.dim() else None
    elif isinstance(first, slice):
        new = own[first]
    elif isinstance(first, (torch.Tensor, list)):
        return selected(own, index, out)
    elif isinstance(first, int) and not isinstance(first, bool):  # one row: what is left of it is its sample's
        return own[first].expand(out.shape[0]).clone() if -own.shape[0] <= first < own.shape[0] else None
    else:  # None adds a dimension in front
        return None
    return new if new is not None and new.shape[0] == out.shape[0] else None


def rowwise(slots: torch.Tensor | None, src_owners: torch.Tensor | None) -> torch.Tensor | None:
    """The owners after a write along dimensions other than 0 (row ``r`` of the value into row ``r``): ``slots`` if
    the value's rows are the same samples' (or a constant, or one row broadcast that is no sample's), else ``None``."""
    if src_owners is CONSTANT:
        return slots
    if slots is None or src_owners is None:
        return None
    if src_owners.shape == slots.shape and torch.equal(src_owners, slots):
        return slots
    return slots if bool((src_owners == NO_SAMPLE).all()) else None


def scattered(slots: torch.Tensor | None, dest: torch.Tensor, index: torch.Tensor, src_own: torch.Tensor | None,
               src: Any) -> torch.Tensor | None:
    """``dest.scatter(0, index, src)`` (and ``scatter_add``, ``scatter_reduce``): element ``index[r, ...]`` of
    ``dest``'s dimension 0 receives ``src[r, ...]``; each must be that row's sample."""
    if slots is None or not isinstance(index, torch.Tensor) or index.dim() == 0:
        return None
    if src_own is CONSTANT:
        return slots
    if src_own is None or src_own.shape[0] < index.shape[0]:
        return None
    rows = index.detach().cpu().long()
    want = src_own[:rows.shape[0]].view(-1, *([1] * (rows.dim() - 1))).expand(rows.shape)
    try:
        return slots if torch.equal(slots[rows], want) else None
    except IndexError:
        return None


def masked_written(slots: torch.Tensor | None, dest: torch.Tensor, mask: Any, src_own: torch.Tensor | None,
                   src: Any) -> torch.Tensor | None:
    """``dest.masked_scatter(mask, src)``: the ``True`` elements of ``mask`` (broadcast to ``dest``), in order,
    receive ``src``'s elements in order; each must come from its slot's sample."""
    if src_own is CONSTANT:
        return slots
    if slots is None or not isinstance(mask, torch.Tensor) or not isinstance(src, torch.Tensor):
        return None
    if src_own is None or src.dim() == 0 or src_own.shape[0] != src.shape[0]:
        return None
    try:
        rows = mask.detach().cpu().expand(dest.shape).nonzero()[:, 0]
    except RuntimeError:
        return None
    per_row = src[0].numel() if src.shape[0] else 1
    elems = src_own.repeat_interleave(per_row)[:rows.shape[0]]
    return slots if elems.shape == rows.shape and torch.equal(slots[rows], elems) else None


def carried(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor,
            owners: dict[int, torch.Tensor | None], others: list[torch.Tensor], B: int | None
            ) -> torch.Tensor | None:
    """The owners of ``out``, a result of ``func(*args, **kwargs)`` that chose no rows, whose row-chosen tensor
    arguments have ``owners`` (by ``id``). ``others``: its arguments computed from the inputs whose rows were not
    chosen (natural rows, :func:`natural`), which must not bring other samples' rows into the result's rows."""
    if any(o is None for o in owners.values()) or out.dim() == 0 or func in LOST:
        return None  # (einsum, cdist, kron, ...: whatever their operands, rows of several samples meet)
    if func in CAT:
        parts = [p for p in (arg_of(args, kwargs, 0, ("tensors",)) or ()) if isinstance(p, torch.Tensor)]
        dim = arg_of(args, kwargs, 1, ("dim", "axis"), 0)
        if parts and isinstance(dim, int) and 0 in dims_of(dim, parts[0].dim()):
            if any(id(p) not in owners for p in parts if p.numel()):
                return None  # rows of no sample, or natural rows, next to chosen ones
            own = torch.cat([owners[id(p)] for p in parts if id(p) in owners])
            return own if own.shape[0] == out.shape[0] else None
        chosen = [p for p in parts if id(p) in owners]
    elif func is torch.stack:
        parts = [p for p in (arg_of(args, kwargs, 0, ("tensors",)) or ()) if isinstance(p, torch.Tensor)]
        dim = arg_of(args, kwargs, 1, ("dim",), 0)
        if not parts or not isinstance(dim, int) or 0 in dims_of(dim, parts[0].dim() + 1):
            return None
        chosen = [p for p in parts if id(p) in owners]
    else:
        chosen = [a for a in args if isinstance(a, torch.Tensor) and id(a) in owners]
    if not chosen:  # owners only in keyword arguments (a weight=, an out=): not followed
        return None
    pos = PRODUCTS.get(func)
    if pos is not None:
        lead = args[pos] if len(args) > pos else None
        if not isinstance(lead, torch.Tensor) or id(lead) not in owners or lead.dim() < 2:
            return None  # the rows are the first operand's: a row-chosen second operand mixes its rows
        own = owners[id(lead)]
        if any(a is not lead and (a.dim() < 3 or not torch.equal(owners[id(a)], own)) for a in chosen):
            return None
    else:
        rows = out.shape[0]
        aligned = [a for a in chosen if a.dim() == out.dim() and a.shape[0] == rows]
        subject = args[0] if args and isinstance(args[0], torch.Tensor) and id(args[0]) in owners else None
        lead = subject
        if aligned and (subject is None or (subject.dim() and subject.shape[0] != rows and func not in RESHAPES)):
            lead = aligned[0]  # the subject broadcast along the rows (a constant row added to them)
        if lead is None:
            return None  # row-chosen operands broadcast along the result's rows only
        own = owners[id(lead)]
        wider = lead.dim() < out.dim() and any(isinstance(a, torch.Tensor) and a is not lead and a.dim() == out.dim()
                                               for a in args)
        if lead is subject and (not keeps_dim0(func, args, kwargs, lead) or (wider and func not in RESHAPES)):
            return None  # dimension 0 moved or mixed; or broadcast against a wider operand (its rows then spread
            # along a later dimension of the result); (a lookup, F.embedding(ids, table), adds trailing dimensions)
        for a in chosen:
            if a is lead:
                continue
            if any(a is b for b in aligned):
                if not torch.equal(owners[id(a)], own):
                    return None
            elif not bool((owners[id(a)] == NO_SAMPLE).all()):
                return None  # a row-chosen operand broadcast along the result's rows: one sample's row in each
        if own.shape[0] != rows:
            own = _regrouped(own, rows) if func in RESHAPES else None
            if own is None:
                return None
    for t in others:  # rows of other samples in the same result rows
        if t.dim() == out.dim() and t.shape[0] == out.shape[0] and t.shape[0] > 1:
            nat = natural(t, B)
            if nat is None or not torch.equal(nat, own):
                return None
    return own


__all__ = ["CONSTANT", "NO_SAMPLE", "carried", "dim0_entry", "indexed", "keeps_dim0", "masked_written", "natural",
           "rowwise", "scattered", "selected", "written"]
