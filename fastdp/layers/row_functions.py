"""The torch functions the guard of rows chosen by the data reads (:mod:`fastdp.layers.fold_guard`,
:mod:`fastdp.layers.row_owners`): which choose rows, write them, cut or join them, keep, move, reduce or mix them
along a dimension, and small helpers to read their arguments. Tables only: what each kind means is said where it
is used.
"""

from __future__ import annotations

from typing import Any

import torch

_T = torch.Tensor
_F = torch.nn.functional

#: functions that choose rows along a dimension by an index argument: (position of ``dim``, its default, position
#: of the index); the rows come from the first argument (and a ``src``/``source``/``values`` argument if any)
ALONG_DIM = {
    **dict.fromkeys((torch.index_select, _T.index_select, torch.gather, _T.gather), (1, None, 2)),
    **dict.fromkeys((torch.take_along_dim, _T.take_along_dim), (2, None, 1)),
    **dict.fromkeys((torch.scatter, _T.scatter, _T.scatter_, torch.scatter_add, _T.scatter_add, _T.scatter_add_,
                     torch.scatter_reduce, _T.scatter_reduce, _T.scatter_reduce_, torch.index_add, _T.index_add,
                     _T.index_add_, torch.index_copy, _T.index_copy, _T.index_copy_, torch.index_fill, _T.index_fill,
                     _T.index_fill_, torch.index_reduce, _T.index_reduce, _T.index_reduce_), (1, None, 2)),
}
#: functions whose second argument (flat indices, a mask, repeats) chooses the first argument's elements or rows
BY_INDEX = {torch.take, _T.take, torch.masked_select, _T.masked_select, _T.masked_scatter, _T.masked_scatter_,
            torch.masked_scatter, torch.index_put, _T.index_put, _T.index_put_, torch.repeat_interleave,
            _T.repeat_interleave, _T.put, _T.put_, torch.put}
#: functions that reorder or choose rows by their values along ``dim``: (position of ``dim``, its default; ``None``:
#: the flattened input)
BY_VALUE = {torch.sort: (1, -1), _T.sort: (1, -1), torch.argsort: (1, -1), _T.argsort: (1, -1),
            torch.topk: (2, -1), _T.topk: (2, -1), torch.kthvalue: (2, -1), _T.kthvalue: (2, -1),
            torch.msort: (99, 0), _T.msort: (99, 0), torch.unique: (4, None), _T.unique: (4, None),
            torch.unique_consecutive: (3, None), _T.unique_consecutive: (3, None)}
CAT = {torch.cat, torch.concat, torch.concatenate}
#: products whose second operand's rows (dimension 0 of a 1-D or 2-D tensor) are summed over
ROW_PRODUCTS = {torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__, torch.mm, _T.mm, torch.sparse.mm,
                torch.mv, _T.mv, torch.addmm, _T.addmm}
#: joins other than cat and stack
OTHER_STACKS = {torch.vstack, torch.row_stack, torch.hstack, torch.dstack, torch.column_stack}
#: the selection between two tensors by a condition
WHERE = {torch.where, _T.where}
#: functions that cut a tensor into parts along a dimension: (position of ``dim``, its default)
PARTS = {**dict.fromkeys((torch.chunk, _T.chunk, torch.split, _T.split, torch.tensor_split, _T.tensor_split),
                          (2, 0)),
         **dict.fromkeys((torch.unbind, _T.unbind), (1, 0)),
         **dict.fromkeys((torch.narrow, _T.narrow, torch.select, _T.select), (1, None))}
#: writes of rows into a tensor
WRITES = {_T.__setitem__, torch.index_add, _T.index_add, _T.index_add_, torch.index_copy, _T.index_copy,
          _T.index_copy_, torch.index_reduce, _T.index_reduce, _T.index_reduce_, torch.index_put, _T.index_put,
          _T.index_put_, _T.masked_scatter, _T.masked_scatter_, torch.masked_scatter, torch.scatter, _T.scatter,
          _T.scatter_, torch.scatter_add, _T.scatter_add, _T.scatter_add_, torch.scatter_reduce, _T.scatter_reduce,
          _T.scatter_reduce_}
#: functions that reorder rows by their shapes along the dimensions they are given: the position of ``dims``
REORDERS = {torch.flip: 1, _T.flip: 1, torch.roll: 2, _T.roll: 2}
#: functions that can move another dimension to dimension 0 (:func:`row_owners.keeps_dim0` says whether they did)
MOVES = {torch.permute, _T.permute, torch.transpose, _T.transpose, torch.swapaxes, _T.swapaxes, torch.swapdims,
         _T.swapdims, torch.t, _T.t, torch.movedim, _T.movedim, torch.moveaxis, _T.moveaxis} | {
    getattr(_T, n).__get__ for n in ("T", "mT") if hasattr(getattr(_T, n, None), "__get__")}
#: functions whose result keeps its argument's dimension 0 as it is (reshapes, copies, casts)
KEEP_MOVED = {torch.reshape, _T.reshape, _T.view, _T.contiguous, _T.clone, torch.clone, _T.to, _T.float,
              _T.double, _T.half, _T.bfloat16, _T.type_as, torch.flatten, _T.flatten, torch.unflatten, _T.unflatten,
              _T.view_as, _T.reshape_as, _T.detach, torch.detach}
#: the choices of :data:`ALONG_DIM` that read rows (the others write them)
SELECTS = {torch.index_select, _T.index_select, torch.gather, _T.gather, torch.take_along_dim, _T.take_along_dim}
SCATTERS = {torch.scatter, _T.scatter, _T.scatter_, torch.scatter_add, _T.scatter_add, _T.scatter_add_,
            torch.scatter_reduce, _T.scatter_reduce, _T.scatter_reduce_}
MASKED_SCATTER = {_T.masked_scatter, _T.masked_scatter_, torch.masked_scatter}
INDEX_PUT = {torch.index_put, _T.index_put, _T.index_put_}
#: table lookups: ``(index, table)``; the rows of a derived table chosen at derived indices
LOOKUP = {_F.embedding, torch.embedding, _F.embedding_bag, torch.embedding_bag}
#: new tensors of a given size, dtype and device, whatever the values of their tensor argument: not derived
FACTORIES = {_T.new_ones, _T.new_zeros, _T.new_full, _T.new_empty, torch.zeros_like, torch.ones_like,
             torch.full_like, torch.empty_like, torch.rand_like, torch.randn_like, torch.randint_like}

#: metadata queries (properties and methods that return sizes, flags, devices): nothing to follow, skipped at once
SKIP = {getattr(_T, n).__get__ for n in ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "ndim",
                                          "layout", "is_cuda", "is_sparse", "is_meta", "is_quantized", "names")
        if hasattr(getattr(_T, n, None), "__get__")} | {
    getattr(_T, n) for n in ("dim", "size", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
                             "is_floating_point", "is_complex", "element_size", "data_ptr", "register_hook",
                             "__len__", "get_device", "item", "tolist", "__bool__", "__int__", "__float__",
                             "__index__", "untyped_storage", "_is_view", "is_inference") if hasattr(_T, n)}


#: functions that reduce, scan, sort, split or move along a dimension: the position of the dimension argument, its
#: names, and its default (``None``: every dimension, or the flattened tensor); dimension 0 among them loses the owners
ALONG: dict[Any, tuple[int, tuple[str, ...], Any]] = {
    **dict.fromkeys((torch.sum, _T.sum, torch.mean, _T.mean, torch.nansum, _T.nansum, torch.nanmean, _T.nanmean,
                     torch.prod, _T.prod, torch.std, _T.std, torch.var, _T.var, torch.std_mean, torch.var_mean,
                     torch.amax, _T.amax, torch.amin, _T.amin, torch.max, _T.max, torch.min, _T.min, torch.argmax,
                     _T.argmax, torch.argmin, _T.argmin, torch.logsumexp, _T.logsumexp, torch.softmax, _T.softmax,
                     _F.softmax, torch.log_softmax, _T.log_softmax, _F.log_softmax, _F.softmin, torch.cumsum,
                     _T.cumsum, torch.cumprod, _T.cumprod, torch.cummax, _T.cummax, torch.cummin, _T.cummin,
                     torch.logcumsumexp, _T.logcumsumexp, torch.median, _T.median, torch.nanmedian, _T.nanmedian,
                     torch.mode, _T.mode, torch.any, _T.any, torch.all, _T.all, torch.count_nonzero,
                     _T.count_nonzero, torch.narrow, _T.narrow), (1, ("dim", "axis"), None)),
    **dict.fromkeys((torch.sort, _T.sort, torch.argsort, _T.argsort, _F.glu), (1, ("dim",), -1)),
    **dict.fromkeys((torch.unbind, _T.unbind), (1, ("dim",), 0)),
    **dict.fromkeys((torch.chunk, _T.chunk, torch.split, _T.split, torch.tensor_split, _T.tensor_split),
                    (2, ("dim",), 0)),
    **dict.fromkeys((torch.topk, _T.topk, torch.kthvalue, _T.kthvalue, torch.diff, _T.diff, torch.cross,
                     torch.linalg.cross, _F.cosine_similarity), (2, ("dim",), -1)),
    **dict.fromkeys((torch.norm, _T.norm, torch.linalg.vector_norm, torch.renorm, _T.renorm), (2, ("dim",), None)),
    **dict.fromkeys((_F.normalize,), (2, ("dim",), 1)),
    **dict.fromkeys((torch.roll, _T.roll), (2, ("dims",), None)),
    **dict.fromkeys((torch.flip, _T.flip), (1, ("dims",), None)),
    **dict.fromkeys((torch.transpose, _T.transpose, torch.swapaxes, _T.swapaxes, torch.swapdims, _T.swapdims),
                    (1, ("dim0", "axis0"), None)),
}
#: the second dimension argument of the transposes
SECOND = dict.fromkeys((torch.transpose, _T.transpose, torch.swapaxes, _T.swapaxes, torch.swapdims, _T.swapdims),
                       2)
#: functions that lose the owners whatever their arguments (move dimension 0, or mix every row)
LOST = {torch.t, _T.t, torch.movedim, _T.movedim, torch.moveaxis, _T.moveaxis, torch.cov, _T.cov,
        torch.corrcoef, _T.corrcoef, torch.einsum, torch.tensordot, torch.kron, torch.cdist, torch.outer, _T.outer,
        torch.ger, torch.trace, _T.trace, torch.diagonal, _T.diagonal, torch.diag, _T.diag, torch.triu, _T.triu,
        torch.tril, _T.tril, torch.repeat_interleave, _T.repeat_interleave} | {
    getattr(_T, n).__get__ for n in ("T", "mT", "H", "mH") if hasattr(getattr(_T, n, None), "__get__")}
#: products: the position of the operand whose rows are the result's rows
PRODUCTS = {torch.matmul: 0, _T.matmul: 0, _T.__matmul__: 0, _T.__rmatmul__: 1, torch.mm: 0, _T.mm: 0,
            torch.bmm: 0, _T.bmm: 0, _F.linear: 0, torch.addmm: 1, _T.addmm: 1, torch.baddbmm: 1, _T.baddbmm: 1,
            torch.mv: 0, _T.mv: 0, torch.addmv: 1, _F.bilinear: 0}
#: reshapes: rows kept, grouped or split (:func:`_regrouped`)
RESHAPES = {torch.reshape, _T.reshape, _T.view, torch.flatten, _T.flatten, torch.unflatten, _T.unflatten,
            _T.view_as, _T.reshape_as, torch.squeeze, _T.squeeze, torch.unsqueeze, _T.unsqueeze}
PERMUTE = {torch.permute, _T.permute}


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """The tensors of a torch function's argument or result: itself, or the items of a tuple, list or dict and of
    the tuples and lists in them (``torch.cat``'s list, ``index_put``'s indices); deeper ones are not looked at."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = tuple(tree.values())
    elif not isinstance(tree, (tuple, list)):
        return []
    out = []
    for x in tree:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            out.extend(y for y in x if isinstance(y, torch.Tensor))
    return out


def lookup_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``(indices, table)`` of a lookup (``F.embedding(input, weight)``; ``torch.embedding(weight, indices)``)."""
    if func in (torch.embedding, torch.embedding_bag):
        return arg_of(args, kwargs, 1, ("indices", "input")), arg_of(args, kwargs, 0, ("weight",))
    return arg_of(args, kwargs, 0, ("input", "indices")), arg_of(args, kwargs, 1, ("weight",))


def is_dim0(t: Any, dim: Any) -> bool:
    """Whether ``dim`` (an int, or ``None`` for "flattened") names dimension 0 of ``t``."""
    if dim is None:
        return True
    if not isinstance(dim, int) or not isinstance(t, torch.Tensor):
        return False
    return dim == 0 or (t.dim() > 0 and dim == -t.dim())


def arg_of(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, names: tuple[str, ...], default: Any = None) -> Any:
    if len(args) > pos:
        return args[pos]
    return next((kwargs[n] for n in names if n in kwargs), default)


def dims_of(value: Any, ndim: int) -> set[int]:
    if isinstance(value, int):
        values = [value]
    elif isinstance(value, (tuple, list)):
        values = [v for v in value if isinstance(v, int)]
    else:
        return set()
    return {v % ndim if ndim else v for v in values}


__all__ = ["ALONG", "ALONG_DIM", "BY_INDEX", "BY_VALUE", "CAT", "FACTORIES", "INDEX_PUT", "KEEP_MOVED", "LOOKUP",
           "LOST", "MASKED_SCATTER", "MOVES", "OTHER_STACKS", "PARTS", "PERMUTE", "PRODUCTS", "REORDERS", "RESHAPES",
           "ROW_PRODUCTS", "SCATTERS", "SECOND", "SELECTS", "SKIP", "WHERE", "WRITES", "arg_of", "dims_of",
           "is_dim0", "lookup_args", "tensors_of"]
