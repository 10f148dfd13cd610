"""Rows chosen by the data: the guard that keeps them from being taken as a fold of the batch.

A fold (:func:`fastdp.layers.batchdim.fold_factor`: a layer sees ``k B`` rows, sample ``i`` owning rows
``i k .. i k + k - 1``) is verified by the structure probe once per input signature. That verification holds for the
signature's later calls only if which rows a sample owns is a function of the shapes, as ``reshape``/``view`` make
it. Rows *chosen by the data* are not: ``h[mask]`` (unpadding), ``index_select``/``gather`` at data-derived
indices, a sort along dimension 0, a scatter into rows. Their count can be ``k B`` with the probe's ``k`` while each
sample owns a different number of them, and taking them as a fold would charge one sample's rows to another's
clipping budget, silently.

:class:`RowGuard` is a :class:`torch.overrides.TorchFunctionMode` active during the forward calls of an input
signature whose probe saw a fold (and during the probe's own passes). It follows two properties of tensors:

* **derived**: computed from the model's inputs (every tensor of the forward call's arguments, and everything
  computed from one). Buffers, parameters and constants built inside the forward (``arange``, a relative position
  index) are not, so a table lookup at a constant index chooses nothing;
* **row-chosen**: rows selected, reordered, scattered or counted by derived values, and everything computed from such
  a tensor. Marked by: ``__getitem__`` / ``__setitem__`` with a derived tensor (or list of them) indexing dimension
  0; ``index_select``, ``gather``, ``take_along_dim``, ``scatter*``, ``index_add``/``index_copy``/``index_fill``/
  ``index_put``/``index_reduce`` along dimension 0 with a derived index; ``take``, ``masked_select``,
  ``masked_scatter`` with a derived index or mask; ``sort``/``argsort``/``topk``/``kthvalue``/``msort`` along
  dimension 0, ``unique``/``unique_consecutive`` and ``repeat_interleave`` with derived repeats; ``cat`` along
  dimension 0 of operands of different leading sizes (pieces cut per sample at lengths read from the data).

:meth:`fastdp.capture.Capture.fold_of` refuses a folded call whose input is row-chosen.

Not seen: rows chosen through the host (a slice ``x[:n]`` of dimension 0 at a length ``n`` read with ``.item()``
whose rows happen to be ``k B``; the probe's fold factors per input shape still have to match, see
:mod:`fastdp.probe`), and operations that bypass ``__torch_function__`` (custom C++ extensions).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from fastdp.torch_api import TorchFunctionMode, tree_flatten

_T = torch.Tensor
#: functions that choose rows along their ``dim`` argument (position 1 or keyword ``dim``) by an index argument
_ALONG_DIM = {torch.index_select: 2, _T.index_select: 2, torch.gather: 2, _T.gather: 2,
              torch.take_along_dim: 1, _T.take_along_dim: 1,
              torch.scatter: 2, _T.scatter: 2, _T.scatter_: 2, torch.scatter_add: 2, _T.scatter_add: 2,
              _T.scatter_add_: 2, torch.scatter_reduce: 2, _T.scatter_reduce: 2, _T.scatter_reduce_: 2,
              torch.index_add: 2, _T.index_add: 2, _T.index_add_: 2, torch.index_copy: 2, _T.index_copy: 2,
              _T.index_copy_: 2, torch.index_fill: 2, _T.index_fill: 2, _T.index_fill_: 2,
              torch.index_reduce: 2, _T.index_reduce: 2, _T.index_reduce_: 2}
#: functions whose every tensor argument but the first chooses rows (flat indices, masks, repeats)
_BY_ANY = {torch.take, _T.take, torch.masked_select, _T.masked_select, _T.masked_scatter, _T.masked_scatter_,
           torch.masked_scatter, torch.index_put, _T.index_put, _T.index_put_, torch.repeat_interleave,
           _T.repeat_interleave}
#: functions that reorder or choose rows by their values along ``dim``: (position of ``dim``, its default; ``None``:
#: the flattened input)
_BY_VALUE = {torch.sort: (1, -1), _T.sort: (1, -1), torch.argsort: (1, -1), _T.argsort: (1, -1),
             torch.topk: (2, -1), _T.topk: (2, -1), torch.kthvalue: (2, -1), _T.kthvalue: (2, -1),
             torch.msort: (99, 0), _T.msort: (99, 0), torch.unique: (4, None), _T.unique: (4, None),
             torch.unique_consecutive: (3, None), _T.unique_consecutive: (3, None)}
_CAT = {torch.cat, torch.concat, torch.concatenate}


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
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)) and all(isinstance(x, (torch.Tensor, int, float, bool, type(None), slice))
                                               for x in tree):
        return [x for x in tree if isinstance(x, torch.Tensor)]
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _dim0(t: Any, dim: Any) -> bool:
    """Whether ``dim`` (an int, ``None`` for "flattened", or absent) names dimension 0 of ``t``."""
    if dim is None:
        return True
    if not isinstance(dim, int) or not isinstance(t, torch.Tensor):
        return False
    return dim == 0 or (t.dim() > 0 and dim == -t.dim())


class RowGuard(TorchFunctionMode):
    """The mode (see the module docstring). :meth:`start` marks a forward call's inputs as derived;
    :meth:`row_chosen` answers for a layer's input."""

    def __init__(self) -> None:
        super().__init__()
        self.derived = _Marks()
        self.chosen = _Marks()

    def start(self, args: Any, kwargs: Any) -> None:
        for t in _tensors((args, kwargs)):
            self.derived.add(t)

    def row_chosen(self, tree: Any) -> bool:
        return bool(self.chosen) and any(t in self.chosen for t in _tensors(tree))

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.derived:
            return out
        ins = _tensors(args) + (_tensors(kwargs) if kwargs else [])
        derived = [t for t in ins if t in self.derived]
        if not derived:
            return out
        outs = _tensors(out)
        if self.chosen and any(t in self.chosen for t in ins):
            chosen = True
        else:
            chosen = self._chooses(func, args, kwargs, derived)
        for t in outs:
            self.derived.add(t)
            if chosen:
                self.chosen.add(t)
        if chosen and func in (_T.__setitem__, _T.index_put_, _T.masked_scatter_, _T.scatter_, _T.scatter_add_,
                               _T.scatter_reduce_, _T.index_add_, _T.index_copy_, _T.index_fill_, _T.index_reduce_):
            self.chosen.add(args[0])  # written in place
        return out

    def _chooses(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], derived: list[torch.Tensor]
                 ) -> bool:
        """Whether this call chooses rows by derived values (see the module docstring)."""
        if func in (_T.__getitem__, _T.__setitem__):
            return len(args) > 1 and self._index_chooses(args[1])
        if func in _ALONG_DIM:
            src = args[0] if args else kwargs.get("input")
            dim = args[1] if len(args) > 1 else kwargs.get("dim", None)
            index = [t for t in _tensors(args[_ALONG_DIM[func]:]) + _tensors(kwargs) if t is not src]
            return _dim0(src, dim) and any(t in self.derived for t in index)
        if func in _BY_ANY:
            return any(t in self.derived for t in _tensors(args[1:]) + _tensors(kwargs))
        if func in _BY_VALUE:
            src = args[0] if args else kwargs.get("input")
            pos, default = _BY_VALUE[func]
            dim = kwargs.get("dim", args[pos] if len(args) > pos else default)
            return src in self.derived and _dim0(src, dim)
        if func in _CAT:
            parts = args[0] if args else kwargs.get("tensors", ())
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            sizes = {t.shape[0] for t in parts if isinstance(t, torch.Tensor) and t.dim() > 0}
            return len(sizes) > 1 and isinstance(dim, int) and all(_dim0(t, dim) for t in parts
                                                                    if isinstance(t, torch.Tensor) and t.dim() > 0)
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
