"""Loss-trace rules for the functions that move, select or combine rows: views, indexing, selections,
concatenation, padding (how their results depend on the samples).

Part of the loss trace's table (:mod:`fastdp.loss_trace_rules` registers them; the algebra is
:mod:`fastdp.loss_deps`). A rule receives the arguments, the result and ``dep(x)`` and returns the result's
``Dep`` (a tuple of them for a tuple result) or ``None`` where it cannot follow the samples. Selecting rows keeps
each row one sample's: the new rows get a row map that says which (:func:`fastdp.loss_deps.narrow_map` for a range,
:func:`fastdp.loss_deps.selected` keyed by the index's content otherwise), so the same selection twice gives the
same rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from fastdp.loss_deps import (
    COUPLED,
    ONE,
    PAIRS,
    ROWS,
    SEP,
    Dep,
    combine,
    narrow_map,
    one_from_row,
    permute,
    reshape,
    selected,
)

DepOf = Callable[[Any], Dep | None]


def arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def dims_arg(d: Any) -> tuple[int, ...] | None:
    if d is None:
        return None
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


def content(t: torch.Tensor) -> tuple[Any, ...]:
    """A key for an index tensor's content (shape, dtype, digest): equal selections give equal row maps. A host
    read, on the traced passes only."""
    with torch.no_grad():
        raw = t.detach().to("cpu").contiguous().view(-1)
        return (tuple(t.shape), str(t.dtype), hashlib.sha1(raw.numpy().tobytes()).hexdigest())


def _rows_of(t: torch.Tensor, d: Dep, dim: int, index: Any) -> Any:
    """The row map after selecting rows ``index`` (a slice or a 1-D index tensor) of sample dimension ``dim``."""
    m = d.maps[d.dims.index(dim)]
    n = t.shape[dim]
    if isinstance(index, slice):
        start, stop, step = index.indices(n)
        if step == 1:
            return narrow_map(m, start, max(0, stop - start))
        return selected(m, "slice", start, stop, step)
    if isinstance(index, torch.Tensor) and index.dtype != torch.bool and index.dim() == 1 and index.numel() <= n:
        with torch.no_grad():
            ar = torch.arange(index.numel(), device=index.device)
            if bool(torch.equal(index.to(ar.dtype), ar)):
                return narrow_map(m, 0, index.numel())
    return selected(m, "index", content(index)) if isinstance(index, torch.Tensor) else None


def rule_getitem(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    x, idx = args[0], args[1]
    d = dep(x)
    if d is None:
        return None
    if not isinstance(res, torch.Tensor):
        return None
    if dep(idx) is not None or (isinstance(idx, tuple) and any(dep(i) is not None for i in idx)):
        return None
    if d.kind in (SEP, COUPLED, ONE):
        return d
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(i is Ellipsis for i in idx):
        k = next(j for j, i in enumerate(idx) if i is Ellipsis)
        fill = x.dim() - sum(i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
                             for i in idx if i is not None and i is not Ellipsis)
        idx = idx[:k] + (slice(None),) * fill + idx[k + 1:]
    tensors = [i for i in idx if isinstance(i, torch.Tensor)]
    if tensors and (len(tensors) > 1 or any(t.dtype == torch.bool for t in tensors) or d.kind != ROWS):
        return _advanced(x, d, idx, res)
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


def _advanced(x: Any, d: Dep, idx: tuple[Any, ...], res: Any) -> Dep | None:
    """Advanced indexing (masks, several index tensors, adjacent): the result's rows along the first indexed
    dimension each hold one sample when the batch dimension is among those indexed (the same rows when its index is
    ``arange``, as in ``logp[torch.arange(B), y]``; a fresh row map otherwise), and stay where they are when the
    batch dimension comes before the indexed ones."""
    if d.kind != ROWS:
        return None
    x_dim = 0
    first = None
    span: list[int] = []
    at_batch = None
    for i in idx:
        if i is None:
            return None
        n = i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
        if isinstance(i, torch.Tensor):
            if first is not None and span and span[-1] != x_dim - 1:
                return None  # advanced indices apart: torch moves their dimensions first
            first = x_dim if first is None else first
            span.extend(range(x_dim, x_dim + n))
            if x_dim == d.dims[0] and n == 1:
                at_batch = i
        x_dim += n
    if first is None:
        return None
    if d.dims[0] < first:
        return Dep(ROWS, d.grad, d.book, d.dims, d.maps) if res.dim() == x.dim() - len(span) + 1 else None
    if d.dims[0] in span:
        m = None
        lengths = {i.numel() for i in idx if isinstance(i, torch.Tensor)}
        if at_batch is not None and at_batch.dim() == 1 and len(lengths) == 1 and all(
                i.dim() == 1 for i in idx if isinstance(i, torch.Tensor)):
            m = _rows_of(x, d, d.dims[0], at_batch)
        if m is None:  # a mask over the batch and other dimensions, several index tensors: keyed by their content
            m = selected(d.maps[0], "advanced", d.dims[0] - first, tuple(
                content(i) if isinstance(i, torch.Tensor) else repr(i) for i in idx))
        return Dep(ROWS, d.grad, d.book, (first,), (m,))
    return None


def rule_select(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    x = args[0]
    d = dep(x)
    if d is None:
        return None
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
        start = arg(args, kwargs, 2, "start")
        if dim in d.dims and d.kind == ROWS:
            length = arg(args, kwargs, 3, "length")
            return Dep(ROWS, d.grad, d.book, d.dims, (narrow_map(d.maps[0], int(start), int(length)),))
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
        if dim is None or not isinstance(index, torch.Tensor) or dep(index) is not None:
            return None
        dim %= n
        if dim in d.dims or index.dim() != n or any(index.shape[k] != x.shape[k] for k in d.dims):
            return None
        return d
    if name in {"diagonal", "diag"}:
        if name == "diag" and n != 2:
            return None
        off = arg(args, kwargs, 1, "offset" if name == "diagonal" else "diagonal", 0)
        d1 = arg(args, kwargs, 2, "dim1", 0) % n if name == "diagonal" else 0
        d2 = arg(args, kwargs, 3, "dim2", 1) % n if name == "diagonal" else 1
        rest = [k for k in range(n) if k not in (d1, d2)]
        if d.kind == PAIRS and set(d.dims) == {d1, d2} and off == 0 and d.maps[0] == d.maps[1]:
            return Dep(ROWS, d.grad, d.book, (res.dim() - 1,), (d.maps[0],))
        if d.kind == ROWS and d.dims[0] in (d1, d2) and off == 0:
            return Dep(ROWS, d.grad, d.book, (res.dim() - 1,), d.maps)
        if d.kind == ROWS and d.dims[0] in rest:
            return Dep(ROWS, d.grad, d.book, (rest.index(d.dims[0]),), d.maps)
        return None
    return None


def rule_concat(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    ts = list(arg(args, kwargs, 0, "tensors"))
    dim = arg(args, kwargs, 1, "dim", 0)
    traced = [(t, dep(t)) for t in ts if dep(t) is not None]
    if not traced or not isinstance(res, torch.Tensor):
        return None
    n = res.dim()
    dim %= n
    if name == "stack":
        ones = [d for _, d in traced if d.kind == ONE]
        if len(ones) == len(ts) == len(traced) and dim == 0:
            samples = [d.maps[0] for d in ones]
            book = ones[0].book
            if all(s == (book, r) for r, s in enumerate(samples)):
                return Dep(ROWS, any(d.grad for d in ones), book, (0,), ((book, 1, 0),))
            return Dep(ROWS, any(d.grad for d in ones), book, (0,), ((("stack", tuple(samples)), 1, 0),))
        if len(traced) == len(ts) and len({(d.kind, d.dims, d.maps) for _, d in traced}) == 1 and (
                traced[0][1].kind in (ROWS, PAIRS)):
            d = traced[0][1]
            return Dep(d.kind, any(e.grad for _, e in traced), d.book, tuple(k + (k >= dim) for k in d.dims), d.maps)
        return combine([(d, tuple(t.shape[:dim]) + (1,) + tuple(t.shape[dim:])) for t, d in traced],
                       tuple(res.shape), True, name)  # stacked: separate values
    first = traced[0][1]
    if first.kind == ROWS and dim in first.dims:
        if all(d.kind == ROWS and d.dims == first.dims for _, d in traced) and len(traced) == len(ts):
            parts = tuple((d.maps[0], t.shape[dim]) for t, d in traced)
            return Dep(ROWS, any(d.grad for _, d in traced), first.book, first.dims, ((("cat", parts), 1, 0),))
        return None
    return combine([(d, tuple(t.shape)) for t, d in traced], tuple(res.shape), True, name)


def rule_pad(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    x = args[0]
    d = dep(x)
    pad = arg(args, kwargs, 1, "pad")
    if d is None or not isinstance(pad, (list, tuple)):
        return None
    first = x.dim() - len(pad) // 2
    if d.kind in (ROWS, PAIRS) and any(k >= first for k in d.dims):
        return None
    return d


def rule_masking(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    """tril, triu, flip/roll off the sample dimensions: a fixed pattern of elements."""
    d = dep(args[0])
    if d is None:
        return None
    if name in {"flip", "roll"}:
        dims = arg(args, kwargs, 1 if name == "flip" else 2, "dims")
        dims = dims_arg(dims) if dims is not None else None
        if dims is None or any(k % args[0].dim() in d.dims for k in dims):
            return None
    return d
