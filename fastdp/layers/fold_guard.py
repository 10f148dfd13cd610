"""Rows chosen by the data: the guard that keeps them from being taken as a fold of the batch.

A fold (:func:`fastdp.layers.batchdim.fold_factor`: a layer sees ``k B`` rows, sample ``i`` owning rows
``i k .. i k + k - 1``) is verified by the structure probe once per input signature. That verification holds for the
signature's later calls only if which rows a sample owns is a function of the shapes, as ``reshape``/``view`` make
it. Rows *chosen by the data* are not: ``h[mask]`` (unpadding), ``index_select``/``gather`` at data-derived
indices, a sort along dimension 0, a scatter into rows. Their count can be ``k B`` with the probe's ``k`` while each
sample owns a different number of them, and taking them as a fold would charge one sample's rows to another's
clipping budget, silently.

:class:`RowGuard` is a :class:`torch.overrides.TorchFunctionMode` active during the forward calls of an input
signature whose probe saw a fold or that the probe has not verified, and during the probe's own engine pass. It
follows two properties of tensors:

* **derived**: computed from the model's inputs (every tensor of the forward call's arguments, and everything
  computed from one, also written into a buffer by ``buf[...] = x``). Parameters, buffers, constants built inside
  the forward (``arange``, a relative position index) and new tensors of a derived one's size (``new_ones``,
  ``zeros_like``) are not;
* **row-chosen**: rows of a derived tensor selected, reordered, scattered or counted by derived values, and
  everything computed from such a tensor. Marked by: ``[]`` reads and writes whose dimension-0 index is a derived
  tensor (or a list holding one); ``index_select``, ``gather``, ``take_along_dim``, ``scatter*``, ``index_add``/
  ``index_copy``/``index_fill``/``index_reduce`` along dimension 0 at a derived index; ``take``, ``put``,
  ``masked_select``, ``masked_scatter``, ``index_put``, ``repeat_interleave`` with a derived index, mask or counts;
  ``F.embedding`` of a derived table at derived indices; ``sort``/``argsort``/``topk``/``kthvalue``/``msort`` of a
  derived tensor of two or more dimensions along dimension 0, ``unique``; ``cat`` along dimension 0 of derived
  pieces of different leading sizes (pieces cut per sample at lengths read from the data). A table that is not
  derived (a parameter) read at derived indices is a lookup, as an embedding is: its rows follow the index's rows.

:func:`fastdp.capture_fold.fold_of` refuses a folded call whose input is row-chosen.

**Not seen** (a deny-list, not a proof; a red-team pass found these and they stay open): rows chosen through the
host (indices or lengths read with ``.item()``/``.tolist()``/``.numpy()`` and used as Python numbers: a loop over
samples ``torch.stack([h[j] for j in order])``, a slice ``x[:n]``; ``torch.tensor(list)`` copies), a choice along
another dimension after the rows were moved off dimension 0 (``h.t()[:, idx].t()``), ``torch.ops.aten`` called
directly, and operations that bypass ``__torch_function__`` (C++ extensions). The probe still compares every folded
call's per-sample gradients with batch-of-one references at each new signature, and a later factor must follow
the shapes (:func:`fastdp.layers.batchdim.fold_follows`).

Cost: a Python call per torch function of the forward (metadata queries such as ``.shape`` return at once), which
weighs most on small models of many small operations: ``benchmarks/run.py --preset folded``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from fastdp.torch_api import TorchFunctionMode, tree_flatten

_T = torch.Tensor
_F = torch.nn.functional
#: functions that choose rows along a dimension by an index argument: (position of ``dim``, its default, position
#: of the index); the rows come from the first argument (and a ``src``/``source``/``values`` argument if any)
_ALONG_DIM = {
    **dict.fromkeys((torch.index_select, _T.index_select, torch.gather, _T.gather), (1, None, 2)),
    **dict.fromkeys((torch.take_along_dim, _T.take_along_dim), (2, None, 1)),
    **dict.fromkeys((torch.scatter, _T.scatter, _T.scatter_, torch.scatter_add, _T.scatter_add, _T.scatter_add_,
                     torch.scatter_reduce, _T.scatter_reduce, _T.scatter_reduce_, torch.index_add, _T.index_add,
                     _T.index_add_, torch.index_copy, _T.index_copy, _T.index_copy_, torch.index_fill, _T.index_fill,
                     _T.index_fill_, torch.index_reduce, _T.index_reduce, _T.index_reduce_), (1, None, 2)),
}
#: functions whose second argument (flat indices, a mask, repeats) chooses the first argument's elements or rows
_BY_INDEX = {torch.take, _T.take, torch.masked_select, _T.masked_select, _T.masked_scatter, _T.masked_scatter_,
             torch.masked_scatter, torch.index_put, _T.index_put, _T.index_put_, torch.repeat_interleave,
             _T.repeat_interleave, _T.put, _T.put_, torch.put}
#: functions that reorder or choose rows by their values along ``dim``: (position of ``dim``, its default; ``None``:
#: the flattened input)
_BY_VALUE = {torch.sort: (1, -1), _T.sort: (1, -1), torch.argsort: (1, -1), _T.argsort: (1, -1),
             torch.topk: (2, -1), _T.topk: (2, -1), torch.kthvalue: (2, -1), _T.kthvalue: (2, -1),
             torch.msort: (99, 0), _T.msort: (99, 0), torch.unique: (4, None), _T.unique: (4, None),
             torch.unique_consecutive: (3, None), _T.unique_consecutive: (3, None)}
_CAT = {torch.cat, torch.concat, torch.concatenate}
#: table lookups: ``(index, table)``; the rows of a derived table chosen at derived indices
_LOOKUP = {_F.embedding, torch.embedding}
#: new tensors of a given size, dtype and device, whatever the values of their tensor argument: not derived
_FACTORIES = {_T.new_ones, _T.new_zeros, _T.new_full, _T.new_empty, torch.zeros_like, torch.ones_like,
              torch.full_like, torch.empty_like, torch.rand_like, torch.randn_like, torch.randint_like}

#: metadata queries (properties and methods that return sizes, flags, devices): nothing to follow, skipped at once
_SKIP = {getattr(_T, n).__get__ for n in ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "ndim",
                                          "layout", "is_cuda", "is_sparse", "is_meta", "is_quantized", "names")
         if hasattr(getattr(_T, n, None), "__get__")} | {
    getattr(_T, n) for n in ("dim", "size", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
                             "is_floating_point", "is_complex", "element_size", "data_ptr", "register_hook",
                             "__len__", "get_device", "item", "tolist", "__bool__", "__int__", "__float__",
                             "__index__", "untyped_storage", "_is_view", "is_inference") if hasattr(_T, n)}


class _Marks:
    """A set of tensors by identity (weak: a tensor freed leaves it)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def __bool__(self) -> bool:
        return bool(self._refs)

    def add(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            self._refs[id(t)] = weakref.ref(t)

    def __contains__(self, t: Any) -> bool:
        r = self._refs.get(id(t))
        return r is not None and r() is t


def _tensors(tree: Any) -> list[torch.Tensor]:
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


def _dim0(t: Any, dim: Any) -> bool:
    """Whether ``dim`` (an int, or ``None`` for "flattened") names dimension 0 of ``t``."""
    if dim is None:
        return True
    if not isinstance(dim, int) or not isinstance(t, torch.Tensor):
        return False
    return dim == 0 or (t.dim() > 0 and dim == -t.dim())


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, names: tuple[str, ...], default: Any = None) -> Any:
    if len(args) > pos:
        return args[pos]
    return next((kwargs[n] for n in names if n in kwargs), default)


class RowGuard(TorchFunctionMode):
    """The mode (see the module docstring). :meth:`start` marks a forward call's inputs as derived;
    :meth:`row_chosen` answers for a layer's input."""

    def __init__(self) -> None:
        super().__init__()
        self.derived = _Marks()
        self.chosen = _Marks()

    def start(self, args: Any, kwargs: Any) -> None:
        for t in tree_flatten((args, kwargs))[0]:
            self.derived.add(t)

    def row_chosen(self, tree: Any) -> bool:
        """Whether a tensor of ``tree`` (a layer call's inputs, any nesting) is row-chosen."""
        return bool(self.chosen) and any(t in self.chosen for t in tree_flatten(tree)[0])

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _SKIP or func in _FACTORIES or not self.derived:
            return out
        ins = _tensors(args)
        if kwargs:
            ins += _tensors(kwargs)
        if not any(t in self.derived for t in ins):
            return out
        chosen = (bool(self.chosen) and any(t in self.chosen for t in ins)) or self._chooses(func, args, kwargs)
        targets = _tensors(out)
        if func is _T.__setitem__ and args:
            targets.append(args[0])  # written in place (in-place methods return their target)
        for t in targets:
            self.derived.add(t)
            if chosen:
                self.chosen.add(t)
        return out

    def _chooses(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether this call chooses rows of a derived tensor by derived values (see the module docstring)."""
        d = self.derived
        if func in (_T.__getitem__, _T.__setitem__):
            src = args[0] if func is _T.__getitem__ else (args[2] if len(args) > 2 else None)
            return (len(args) > 1 and self._index_chooses(args[1])
                    and (args[0] in d or (isinstance(src, torch.Tensor) and src in d)))
        if func in _ALONG_DIM:
            dim_pos, default, index_pos = _ALONG_DIM[func]
            src = _arg(args, kwargs, 0, ("input",))
            dim = _arg(args, kwargs, dim_pos, ("dim",), default)
            index = _arg(args, kwargs, index_pos, ("index", "indices"))
            rows = [t for t in _tensors(args) + _tensors(kwargs) if t is not index]
            return (_dim0(src, dim) and isinstance(index, torch.Tensor) and index in d
                    and any(t in d for t in rows))
        if func in _BY_INDEX:
            index = _tensors(args[1:2]) + [t for k, t in kwargs.items() if k in ("index", "indices", "mask", "repeats")
                                           and isinstance(t, torch.Tensor)]
            rows = _tensors(args[:1]) + _tensors(args[2:]) + [kwargs[k] for k in ("source", "values", "input")
                                                                if isinstance(kwargs.get(k), torch.Tensor)]
            return any(t in d for t in index) and any(t in d for t in rows)
        if func in _BY_VALUE:
            src = _arg(args, kwargs, 0, ("input",))
            pos, default = _BY_VALUE[func]
            # (a 1-D tensor's sort reorders per-sample scalars, such as lengths: rows follow only if its order
            # indexes them, which the index rules see)
            return (src in d and isinstance(src, torch.Tensor) and src.dim() >= 2
                    and _dim0(src, _arg(args, kwargs, pos, ("dim",), default)))
        if func in _LOOKUP:
            index, table = _arg(args, kwargs, 0, ("input", "indices")), _arg(args, kwargs, 1, ("weight",))
            return isinstance(table, torch.Tensor) and table in d and isinstance(index, torch.Tensor) and index in d
        if func in _CAT:
            parts = _arg(args, kwargs, 0, ("tensors",), ())
            dim = _arg(args, kwargs, 1, ("dim",), 0)
            parts = [t for t in parts if isinstance(t, torch.Tensor) and t.dim() > 0]
            return (len({t.shape[0] for t in parts}) > 1 and isinstance(dim, int) and any(t in d for t in parts)
                    and all(_dim0(t, dim) for t in parts))
        return False

    def _index_chooses(self, index: Any) -> bool:
        """Whether a ``[]`` index picks dimension 0 by a derived tensor (or a list holding one)."""
        first = index[0] if isinstance(index, tuple) and index else index
        if isinstance(first, torch.Tensor):
            return first in self.derived
        if isinstance(first, (list, tuple)):
            return any(isinstance(x, torch.Tensor) and x in self.derived for x in first)
        return False


__all__ = ["RowGuard"]
