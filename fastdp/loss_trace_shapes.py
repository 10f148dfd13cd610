"""Loss-trace rules for the functions that move, select or combine rows: views, indexing, selections,
concatenation, padding (how their results depend on the samples).

Part of the loss trace's table (:mod:`fastdp.loss_trace_rules` registers them; the algebra is
:mod:`fastdp.loss_deps`). A rule receives the arguments, the result and ``dep(x)`` and returns the result's
``Dep`` (a tuple of them for a tuple result) or ``None`` where it cannot follow the samples. Selecting rows keeps
each row one sample's: the new rows get a row map that says which sample each row is
(:func:`fastdp.loss_deps.narrow_map` for a range, :func:`fastdp.loss_deps.take_map` for an index or a mask, read on
the host in the traced passes), so that selections of the same samples give the same rows however they are written
(``x[mask]`` and ``x[mask.nonzero()]``, ``x[1:3]`` and ``x[[1, 2]]``, ``x[idx][inverse]`` and ``x``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastdp.loss_deps import (
    COUPLED,
    MAX_ROWS,
    ONE,
    PAIRS,
    PHANTOM,
    ROWS,
    SEP,
    Dep,
    combine,
    concat_maps,
    explicit,
    narrow_map,
    one_from_row,
    permute,
    reshape,
    same_map,
    take_map,
)

DepOf = Callable[[Any], Dep | None]


#: numpy-style keywords torch accepts in place of its own
_KEYWORD_ALIASES = {"dim": "axis", "keepdim": "keepdims"}


def arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a torch function: by keyword (or its numpy alias: ``axis``, ``keepdims``), or at
    position ``i``."""
    if name in kwargs:
        return kwargs[name]
    alias = _KEYWORD_ALIASES.get(name)
    if alias in kwargs:
        return kwargs[alias]
    return args[i] if len(args) > i else default


def dims_arg(d: Any) -> tuple[int, ...] | None:
    """A ``dim`` argument as a tuple (``None``: all dimensions); ``TypeError`` for anything else (a bool is not a
    dimension: ``x.var(True)`` is ``unbiased``)."""
    if d is None:
        return None
    if isinstance(d, bool):
        raise TypeError
    if isinstance(d, int):
        return (d,)
    if isinstance(d, (list, tuple)) and all(isinstance(x, int) for x in d):
        return tuple(d)
    raise TypeError


def rule_reshape(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    d = dep(args[0])
    if d is None or not isinstance(res, torch.Tensor):
        return None
    return reshape(d, tuple(args[0].shape), tuple(res.shape))


def rule_permute(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    x = args[0]
    d = dep(x)
    if d is None or not isinstance(res, torch.Tensor):
        return None
    n = x.dim()
    perm = list(range(n))
    if name in {"transpose", "swapaxes", "swapdims", "transpose_"}:
        a, b = (arg(args, kwargs, 1, "dim0"), arg(args, kwargs, 2, "dim1"))
        a, b = a % n, b % n
        perm[a], perm[b] = perm[b], perm[a]
    elif name == "T":
        perm = perm[::-1]
    elif name in {"t", "mT", "adjoint", "mH", "H"}:
        if n >= 2:
            perm[-1], perm[-2] = perm[-2], perm[-1]
    elif name == "permute":
        p = args[1:] if len(args) > 2 or isinstance(arg(args, kwargs, 1, "dims"), int) else arg(args, kwargs, 1,
                                                                                                     "dims")
        perm = [int(v) % n for v in p]
    elif name == "movedim":
        src, dst = dims_arg(arg(args, kwargs, 1, "source")), dims_arg(arg(args, kwargs, 2, "destination"))
        src, dst = [s % n for s in src], [t % n for t in dst]
        rest = [i for i in range(n) if i not in src]
        perm = [-1] * n
        for s, t in zip(src, dst, strict=True):
            perm[t] = s
        it = iter(rest)
        perm = [p if p >= 0 else next(it) for p in perm]
    else:
        return None
    return permute(d, perm)


def rule_expand(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    x = args[0]
    d = dep(x)
    if d is None or not isinstance(res, torch.Tensor):
        return None
    off = res.dim() - x.dim()
    if d.kind in (ROWS, PAIRS):
        if any(x.shape[k] != res.shape[k + off] for k in d.dims):
            return None
        return Dep(d.kind, d.grad, d.book, tuple(k + off for k in d.dims), d.maps, d.why)
    return d


def _rows_of(t: torch.Tensor, d: Dep, dim: int, index: Any) -> Any:
    """The row map after selecting rows ``index`` (a slice or a 1-D integer index tensor: read on the host, in the
    traced passes only) of sample dimension ``dim``; ``None`` where it is not followed."""
    m = d.maps[d.dims.index(dim)]
    n = t.shape[dim]
    if isinstance(index, slice):
        start, stop, step = index.indices(n)
        if step == 1:
            return narrow_map(m, start, max(0, stop - start))
        return take_map(m, list(range(start, stop, step)), n)
    if isinstance(index, torch.Tensor) and not index.dtype.is_floating_point and index.dtype != torch.bool \
            and index.dim() == 1 and index.numel() <= MAX_ROWS:
        return take_map(m, index.tolist(), n)
    return None


def rule_getitem(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    x, idx = args[0], args[1]
    d = dep(x)
    if d is None:
        return None
    if not isinstance(res, torch.Tensor):
        return None
    parts = idx if isinstance(idx, tuple) else (idx,)
    bounds = [b for i in parts if isinstance(i, slice) for b in (i.start, i.stop, i.step)]
    if any(dep(i) is not None for i in bounds):  # a traced slice bound: not followed
        return None
    traced_idx = {id(i): dep(i) for i in parts if dep(i) is not None}
    if traced_idx and (d.kind != ROWS or any(not isinstance(i, torch.Tensor) or i.dtype == torch.bool
                                             for i in parts if id(i) in traced_idx)):
        return None  # a traced index: followed only as a sample's own index into its row (below)
    if d.kind in (SEP, COUPLED, ONE):
        return d
    idx = idx if isinstance(idx, tuple) else (idx,)
    # a list of ints or bools is an index tensor to torch; a uint8 index is a mask (deprecated, still honoured)
    idx = tuple(torch.tensor(i) if isinstance(i, list) and i and all(isinstance(v, (int, bool)) for v in i) else i
                for i in idx)
    idx = tuple(i.bool() if isinstance(i, torch.Tensor) and i.dtype == torch.uint8 else i for i in idx)
    if any(i is Ellipsis for i in idx):
        k = next(j for j, i in enumerate(idx) if i is Ellipsis)
        fill = x.dim() - sum(i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
                             for i in idx if i is not None and i is not Ellipsis)
        idx = idx[:k] + (slice(None),) * fill + idx[k + 1:]
    tensors = [i for i in idx if isinstance(i, torch.Tensor)]
    if tensors and (len(tensors) > 1 or any(t.dtype == torch.bool for t in tensors) or d.kind != ROWS
                    or traced_idx):
        return _advanced(x, d, idx, res, traced_idx)
    # basic indexing (and one integer index tensor): walk input and output dimensions
    dims, maps = [], []
    i_in = i_out = 0
    for i in idx:
        if i is None:
            i_out += 1
            continue
        if isinstance(i, bool):
            return None
        if isinstance(i, int):
            if i_in in d.dims:
                if d.kind != ROWS:
                    return None
                m = d.maps[d.dims.index(i_in)]
                return Dep(ONE, d.grad, d.book, (), (one_from_row(m, i % x.shape[i_in]),))
            i_in += 1
            continue
        if isinstance(i, (slice, torch.Tensor)):
            if i_in in d.dims and isinstance(i, torch.Tensor) and i.dim() != 1:
                return None
            if i_in in d.dims:
                m = _rows_of(x, d, i_in, i) if isinstance(i, slice) or i.dim() == 1 else None
                if m is None:
                    return None
                dims.append(i_out)
                maps.append(m)
            i_in += 1
            i_out += 1 if isinstance(i, slice) else i.dim()
            continue
        return None
    for k in range(i_in, x.dim()):
        if k in d.dims:
            dims.append(i_out + k - i_in)
            maps.append(d.maps[d.dims.index(k)])
    return Dep(d.kind, d.grad, d.book, tuple(dims), tuple(maps))


def _advanced(x: Any, d: Dep, idx: tuple[Any, ...], res: Any, traced: dict[int, Dep] | None = None) -> Dep | None:
    """Advanced indexing (adjacent index tensors). When the batch dimension is among the indexed ones, the result's
    dimension ``first`` holds the selected elements, each one sample's: for one boolean mask, the True positions in
    order (their batch coordinates read on the host); for 1-D integer index tensors of one length, the batch
    dimension's index. Any other form (broadcast index shapes) is not followed. Rows stay where they are when the
    batch dimension comes before the indexed ones. ``traced``: index tensors computed from the outputs (by ``id``),
    followed only off the batch dimension and only where each result row's index comes from that row's own sample
    (``x[arange(B), x.detach().argmax(-1)]``): an index that is data of other samples picks by their values."""
    traced = traced or {}
    if d.kind != ROWS:
        return None
    x_dim = 0
    first = None
    span: list[int] = []
    tensors = []
    for i in idx:
        if i is None:
            return None
        n = i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
        if isinstance(i, torch.Tensor):
            if first is not None and span and span[-1] != x_dim - 1:
                return None  # advanced indices apart: torch moves their dimensions first
            first = x_dim if first is None else first
            span.extend(range(x_dim, x_dim + n))
            tensors.append((x_dim, i))
        x_dim += n
    if first is None:
        return None
    b = d.dims[0]
    if b < first:
        if traced:
            return None
        return Dep(ROWS, d.grad, d.book, d.dims, d.maps) if res.dim() == x.dim() - len(span) + 1 else None
    if b not in span:
        return None
    m, rows = d.maps[0], x.shape[b]
    if traced and not all(t.dtype != torch.bool for _, t in tensors):
        return None
    if len(tensors) == 1 and tensors[0][1].dtype == torch.bool:
        start, mask = tensors[0]
        if mask.numel() > MAX_ROWS:
            return None
        coords = mask.nonzero()[:, b - start].tolist()
    elif all(t.dtype != torch.bool for _, t in tensors):
        # integer index tensors broadcast to one shape S; the batch dimension's index must vary along one axis a of
        # S only (x[arange(B)[:, None], pos]): the samples then run along result dimension first + a
        at = next((t for pos, t in tensors if pos == b), None)
        try:
            shape = torch.broadcast_shapes(*[t.shape for _, t in tensors])
        except RuntimeError:
            return None
        if at is None or at.numel() > MAX_ROWS or len(shape) == 0 or id(at) in traced:
            return None
        full = at.expand(shape)
        axes = [a for a in range(len(shape)) if shape[a] > 1 and at.dim() - len(shape) + a >= 0
                and at.shape[at.dim() - len(shape) + a] > 1]
        if len(axes) > 1:
            return None
        a = axes[0] if axes else 0
        line = full.movedim(a, 0).reshape(shape[a], -1)[:, 0]
        coords = line.tolist()
        new = take_map(m, coords, rows)
        for _, t in tensors:  # a traced index: its rows along axis a must be the samples selected there
            di = traced.get(id(t))
            k = t.dim() - len(shape) + a
            if di is not None and not (new is not None and di.kind == ROWS and di.dims == (k,)
                                       and t.shape[k] == shape[a] and same_map(di.maps[0], new, shape[a])):
                return None
        return None if new is None else Dep(ROWS, d.grad, d.book, (first + a,), (new,))
    else:
        return None
    new = take_map(m, coords, rows)
    return None if new is None else Dep(ROWS, d.grad, d.book, (first,), (new,))


def rule_select(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    x = args[0]
    d = dep(x)
    if d is None:
        return None
    if any(dep(t) is not None for t in list(args[1:]) + list(kwargs.values()) if isinstance(t, torch.Tensor)) and (
            name not in {"gather", "take_along_dim"} or d.kind != ROWS):
        return None  # an index computed from the samples: which element is taken depends on them
    if d.kind in (SEP, COUPLED, ONE):
        return tuple(d for _ in res) if isinstance(res, (tuple, list)) else d
    n = x.dim()
    if name in {"select", "unbind"}:
        dim = arg(args, kwargs, 1, "dim", 0) % n
        if dim in d.dims:
            if d.kind != ROWS:
                return None
            m = d.maps[0]
            if name == "select":
                return Dep(ONE, d.grad, d.book, (), (one_from_row(m, arg(args, kwargs, 2, "index") % x.shape[dim]),))
            return tuple(Dep(ONE, d.grad, d.book, (), (one_from_row(m, r),)) for r in range(len(res)))
        kept = tuple(k - (k > dim) for k in d.dims)
        r = Dep(d.kind, d.grad, d.book, kept, d.maps)
        return r if name == "select" else tuple(r for _ in res)
    if name in {"narrow"}:
        dim = arg(args, kwargs, 1, "dim") % n
        start = int(arg(args, kwargs, 2, "start"))
        if dim in d.dims and d.kind == ROWS:
            length = int(arg(args, kwargs, 3, "length"))
            start = start + x.shape[dim] if start < 0 else start  # torch counts a negative start from the end
            return Dep(ROWS, d.grad, d.book, d.dims, (narrow_map(d.maps[0], start, length),))
        return d if dim not in d.dims else None
    if name in {"split", "chunk", "tensor_split", "split_with_sizes"}:
        dim = arg(args, kwargs, 2, "dim", 0) % n
        if dim not in d.dims:
            return tuple(d for _ in res)
        if d.kind != ROWS:
            return None
        out, start = [], 0
        for piece in res:
            out.append(Dep(ROWS, d.grad, d.book, d.dims, (narrow_map(d.maps[0], start, piece.shape[dim]),)))
            start += piece.shape[dim]
        return tuple(out)
    if name in {"index_select"}:
        dim = arg(args, kwargs, 1, "dim") % n
        if dim not in d.dims:
            return d
        m = _rows_of(x, d, dim, arg(args, kwargs, 2, "index")) if d.kind == ROWS else None
        return Dep(ROWS, d.grad, d.book, d.dims, (m,)) if m is not None else None
    if name in {"gather", "take_along_dim"}:
        dim = arg(args, kwargs, 1 if name == "gather" else 2, "dim")
        index = arg(args, kwargs, 2 if name == "gather" else 1, "index" if name == "gather" else "indices")
        if dim is None or not isinstance(index, torch.Tensor):
            return None
        dim %= n
        if dim in d.dims or index.dim() != n or any(index.shape[k] != x.shape[k] for k in d.dims):
            return None
        di = dep(index)  # an index drawn from the rows themselves (x.gather(-1, x.argmax(-1, keepdim=True))): the
        if di is not None and not (di.kind == d.kind == ROWS and di.dims == d.dims  # same rows, or not followed
                                   and same_map(di.maps[0], d.maps[0], x.shape[d.dims[0]])):
            return None
        return d
    if name in {"diagonal", "diag"}:
        if name == "diag" and n != 2:
            return None
        off = arg(args, kwargs, 1, "offset" if name == "diagonal" else "diagonal", 0)
        d1 = arg(args, kwargs, 2, "dim1", 0) % n if name == "diagonal" else 0
        d2 = arg(args, kwargs, 3, "dim2", 1) % n if name == "diagonal" else 1
        rest = [k for k in range(n) if k not in (d1, d2)]
        if d.kind == PAIRS and set(d.dims) == {d1, d2} and off == 0 and same_map(d.maps[0], d.maps[1],
                                                                                  min(x.shape[d1], x.shape[d2])):
            return Dep(ROWS, d.grad, d.book, (res.dim() - 1,), (d.maps[0],))
        if d.kind == ROWS and d.dims[0] in (d1, d2) and off == 0:
            return Dep(ROWS, d.grad, d.book, (res.dim() - 1,), d.maps)
        if d.kind == ROWS and d.dims[0] in rest:
            return Dep(ROWS, d.grad, d.book, (rest.index(d.dims[0]),), d.maps)
        return None
    return None


def rule_concat(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    """``torch.stack`` / ``torch.cat``. Along the sample dimension (or stacking one-sample values) the result's rows
    are the operands' rows in order (:func:`fastdp.loss_deps.concat_maps`: the batch's pieces give the batch's map
    back); along another dimension the operands combine as a sum does."""
    ts = list(arg(args, kwargs, 0, "tensors"))
    dim = arg(args, kwargs, 1, "dim", 0)
    traced = [(t, dep(t)) for t in ts if dep(t) is not None]
    if not traced or not isinstance(res, torch.Tensor):
        return None
    n = res.dim()
    dim %= n
    grad = any(d.grad for _, d in traced)
    book = traced[0][1].book
    if name == "stack":
        if len(traced) == len(ts) and all(d.kind == ONE and d.maps[0][0] is book for _, d in traced):
            return Dep(ROWS, grad, book, (dim,), (explicit(book, [d.maps[0][1] for _, d in traced]),))
        if len(traced) == len(ts) and len({(d.kind, d.dims, d.maps) for _, d in traced}) == 1 and (
                traced[0][1].kind in (ROWS, PAIRS)):
            d = traced[0][1]
            return Dep(d.kind, grad, d.book, tuple(k + (k >= dim) for k in d.dims), d.maps)
        return combine([(d, tuple(t.shape[:dim]) + (1,) + tuple(t.shape[dim:])) for t, d in traced],
                       tuple(res.shape), True, name)  # stacked: separate values
    along_rows = [d.kind == ROWS and dim in d.dims for _, d in traced]
    if any(along_rows):
        ts = [t for t in ts if not (isinstance(t, torch.Tensor) and dep(t) is None and t.dim() == 1 and n != 1
                                    and t.numel() == 0)]  # torch.cat skips a legacy empty (0,) operand
        if not all((d.kind == ROWS and d.dims == (dim,)) or (d.kind == ONE and d.maps[0][0] is book)
                   for _, d in traced) or not all(isinstance(t, torch.Tensor) and t.dim() == n for t in ts):
            return None
        parts = []
        for t in ts:  # an untraced operand: constant rows (PHANTOM: of no sample)
            d = dep(t)
            rows = t.shape[dim]
            parts.append((d.maps[0], rows) if d is not None and d.kind == ROWS else
                         (explicit(book, [d.maps[0][1] if d is not None else PHANTOM] * rows), rows))
        m = concat_maps(parts)
        return None if m is None else Dep(ROWS, grad, book, (dim,), (m,))
    if len(traced) == len(ts) and all(d.kind == ONE and d.maps[0][0] is book for _, d in traced) and dim == 0 and (
            len({d.maps[0] for _, d in traced}) > 1):
        parts = [(explicit(book, [d.maps[0][1]] * t.shape[0]), t.shape[0]) for t, d in traced]
        m = concat_maps(parts)  # one-sample values joined along dimension 0: rows of those samples
        return None if m is None else Dep(ROWS, grad, book, (0,), (m,))
    return combine([(d, tuple(t.shape)) for t, d in traced], tuple(res.shape), True, name)


def rule_masked_select(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """``x.masked_select(mask)``: the elements at the True positions of ``mask`` broadcast to ``x``, in order, each
    one sample's (the positions read on the host)."""
    x, mask = args[0], arg(args, kwargs, 1, "mask")
    d = dep(x)
    if d is None or dep(mask) is not None or d.kind != ROWS or x.numel() > MAX_ROWS:
        return None
    coords = mask.expand(x.shape).nonzero()[:, d.dims[0]].tolist()
    m = take_map(d.maps[0], coords, x.shape[d.dims[0]])
    return None if m is None else Dep(ROWS, d.grad, d.book, (0,), (m,))


def rule_repeat(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """``x.repeat(*sizes)``: leading new dimensions shift the sample dimensions; repeating along one tiles its
    rows."""
    x = args[0]
    d = dep(x)
    sizes = args[1:] if len(args) > 2 or isinstance(arg(args, kwargs, 1, "repeats"), int) else arg(args, kwargs, 1,
                                                                                                    "repeats")
    if d is None or not isinstance(res, torch.Tensor):
        return None
    if d.kind in (SEP, COUPLED, ONE):
        return d
    if d.kind != ROWS:
        return None
    sizes = [int(v) for v in sizes]
    off = len(sizes) - x.dim()
    b = d.dims[0]
    n = x.shape[b]
    m = d.maps[0]
    if sizes[b + off] != 1:
        m = take_map(m, list(range(n)) * sizes[b + off], n)
        if m is None:
            return None
    return Dep(ROWS, d.grad, d.book, (b + off,), (m,))


def rule_pad(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    """``F.pad(x, pad)``: off the sample dimensions, a constant border; along the sample dimension in the constant
    mode, rows of no sample before and after the batch's (``PHANTOM``)."""
    x = args[0]
    d = dep(x)
    pad = arg(args, kwargs, 1, "pad")
    if d is None or not isinstance(pad, (list, tuple)) or not all(isinstance(v, int) for v in pad):
        return None
    first = x.dim() - len(pad) // 2
    if d.kind not in (ROWS, PAIRS) or not any(k >= first for k in d.dims):
        return d
    value = arg(args, kwargs, 3, "value")
    if d.kind != ROWS or arg(args, kwargs, 2, "mode", "constant") != "constant" or dep(value) is not None:
        return None
    b = d.dims[0]
    k = x.dim() - 1 - b  # pad lists the last dimension first
    before, after = pad[2 * k], pad[2 * k + 1]
    if before < 0 or after < 0:
        return None
    rows = x.shape[b]
    m = concat_maps([(explicit(d.book, [PHANTOM] * before), before), (d.maps[0], rows),
                     (explicit(d.book, [PHANTOM] * after), after)])
    return None if m is None else Dep(ROWS, d.grad, d.book, d.dims, (m,))


def rule_masking(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    """tril, triu, flip/roll off the sample dimensions: a fixed pattern of elements. Along the sample dimension
    (rows of one sample each) flip and roll reorder the rows: the row map follows (``x.flip(0)`` is ``x[B-1::-1]``,
    ``x.roll(s, 0)[r]`` is ``x[(r - s) % B]``)."""
    x = args[0]
    d = dep(x)
    if d is None:
        return None
    if name not in {"flip", "roll"}:
        return d
    dims = arg(args, kwargs, 1 if name == "flip" else 2, "dims")
    dims = dims_arg(dims) if dims is not None else None
    if dims is None:
        return None  # roll of the flattened tensor
    dims = tuple(k % x.dim() for k in dims)
    if not any(k in d.dims for k in dims):
        return d
    if d.kind != ROWS:
        return None
    b, rows = d.dims[0], x.shape[d.dims[0]]
    if name == "flip":
        order = list(range(rows - 1, -1, -1)) if dims.count(b) % 2 else list(range(rows))
    else:
        shifts = arg(args, kwargs, 1, "shifts")
        shifts = [shifts] if isinstance(shifts, int) else list(shifts)
        if len(shifts) != len(dims) or not all(isinstance(v, int) for v in shifts):
            return None
        shift = sum(v for k, v in zip(dims, shifts, strict=True) if k == b)
        order = [(r - shift) % rows for r in range(rows)] if rows else []
    m = take_map(d.maps[0], order, rows)
    return None if m is None else Dep(ROWS, d.grad, d.book, d.dims, (m,))
