"""Rows chosen by the data: the guard that keeps them from being taken as the batch's rows, or a fold of them.

A fold (:func:`fastdp.layers.batchdim.fold_factor`: a layer sees ``k B`` rows, sample ``i`` owning rows
``i k .. i k + k - 1``) is verified by the structure probe once per input signature. That verification holds for the
signature's later calls only if which rows a sample owns is a function of the shapes, as ``reshape``/``view`` make
it. Rows *chosen by the data* are not: ``h[mask]`` (unpadding), ``index_select``/``gather`` at data-derived
indices, a sort along dimension 0, a scatter into rows. Their count can be ``k B`` with the probe's ``k`` (or ``B``)
while each sample owns a different number of them, and taking them as a fold (or as the batch) would charge one
sample's rows to another's clipping budget, silently.

:class:`RowGuard` is a :class:`torch.overrides.TorchFunctionMode` active during the forward calls of an input
signature whose probe saw a fold or a hooked call of row-chosen rows, or that the probe has not verified, and during
the probe's own engine pass. It follows two properties of tensors:

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

:mod:`fastdp.layers.row_owners` follows, for every row-chosen tensor, which sample owns each of its rows (computed
from the actual indices at every call), and for *parts* of the batch cut by their shapes (``h[1:]``, ``h[j]``,
``h.chunk(2)``, ``h.unbind(0)``: not row-chosen, the probe verifies them) the same, so that joining them back along
dimension 0 (``torch.cat``, ``torch.stack``) is a choice whose owners are known. A hooked call whose input is
row-chosen is accepted when its rows are the samples' in order (:func:`fastdp.capture_fold.check_chosen_rows`,
:func:`fastdp.capture_fold.fold_of`), else refused.

**Not seen** (a deny-list, not a proof; a red-team pass found the first ones): rows chosen by a Python number read
from a tensor that is not itself cut from the batch (``x[:n]``, ``torch.tensor(list)``), a choice along another
dimension after the rows were moved off dimension 0 (``h.t()[:, idx].t()``), ``torch.ops.aten`` called directly, and
operations that bypass ``__torch_function__`` (C++ extensions). The probe still compares every folded call's
per-sample gradients with batch-of-one references at each new signature, and a later factor must follow the shapes
(:func:`fastdp.layers.batchdim.fold_follows`).

Cost: a Python call per torch function of the forward (metadata queries such as ``.shape`` return at once), which
weighs most on small models of many small operations: ``benchmarks/run.py --preset folded``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from fastdp.layers import row_owners
from fastdp.torch_api import TorchFunctionMode, tree_flatten, view_base

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
#: products whose second operand's rows (dimension 0 of a 1-D or 2-D tensor) are summed over
_ROW_PRODUCTS = {torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__, torch.mm, _T.mm, torch.sparse.mm,
                 torch.mv, _T.mv, torch.addmm, _T.addmm}
#: joins other than cat and stack
_OTHER_STACKS = {torch.vstack, torch.row_stack, torch.hstack, torch.dstack, torch.column_stack}
#: the selection between two tensors by a condition
_WHERE = {torch.where, _T.where}
#: functions that cut a tensor into parts along a dimension: (position of ``dim``, its default)
_PARTS = {**dict.fromkeys((torch.chunk, _T.chunk, torch.split, _T.split, torch.tensor_split, _T.tensor_split),
                          (2, 0)),
          **dict.fromkeys((torch.unbind, _T.unbind), (1, 0)),
          **dict.fromkeys((torch.narrow, _T.narrow, torch.select, _T.select), (1, None))}
#: writes of rows into a tensor
_WRITES = {_T.__setitem__, torch.index_add, _T.index_add, _T.index_add_, torch.index_copy, _T.index_copy,
           _T.index_copy_, torch.index_reduce, _T.index_reduce, _T.index_reduce_, torch.index_put, _T.index_put,
           _T.index_put_, _T.masked_scatter, _T.masked_scatter_, torch.masked_scatter, torch.scatter, _T.scatter,
           _T.scatter_, torch.scatter_add, _T.scatter_add, _T.scatter_add_, torch.scatter_reduce, _T.scatter_reduce,
           _T.scatter_reduce_}
#: functions that reorder rows by their shapes along the dimensions they are given: the position of ``dims``
_REORDERS = {torch.flip: 1, _T.flip: 1, torch.roll: 2, _T.roll: 2}
#: functions that can move another dimension to dimension 0 (:func:`row_owners.keeps_dim0` says whether they did)
_MOVES = {torch.permute, _T.permute, torch.transpose, _T.transpose, torch.swapaxes, _T.swapaxes, torch.swapdims,
          _T.swapdims, torch.t, _T.t, torch.movedim, _T.movedim, torch.moveaxis, _T.moveaxis} | {
    getattr(_T, n).__get__ for n in ("T", "mT") if hasattr(getattr(_T, n, None), "__get__")}
#: functions whose result keeps its argument's dimension 0 as it is (reshapes, copies, casts)
_KEEP_MOVED = {torch.reshape, _T.reshape, _T.view, _T.contiguous, _T.clone, torch.clone, _T.to, _T.float,
               _T.double, _T.half, _T.bfloat16, _T.type_as, torch.flatten, _T.flatten, torch.unflatten, _T.unflatten,
               _T.view_as, _T.reshape_as, _T.detach, torch.detach}
#: :meth:`RowGuard._joined` along a dimension other than 0
_NOT_JOINED = object()
#: the choices of :data:`_ALONG_DIM` that read rows (the others write them)
_SELECTS = {torch.index_select, _T.index_select, torch.gather, _T.gather, torch.take_along_dim, _T.take_along_dim}
_SCATTERS = {torch.scatter, _T.scatter, _T.scatter_, torch.scatter_add, _T.scatter_add, _T.scatter_add_,
             torch.scatter_reduce, _T.scatter_reduce, _T.scatter_reduce_}
_MASKED_SCATTER = {_T.masked_scatter, _T.masked_scatter_, torch.masked_scatter}
_INDEX_PUT = {torch.index_put, _T.index_put, _T.index_put_}
#: table lookups: ``(index, table)``; the rows of a derived table chosen at derived indices
_LOOKUP = {_F.embedding, torch.embedding, _F.embedding_bag, torch.embedding_bag}
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


def _lookup(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``(indices, table)`` of a lookup (``F.embedding(input, weight)``; ``torch.embedding(weight, indices)``)."""
    if func in (torch.embedding, torch.embedding_bag):
        return _arg(args, kwargs, 1, ("indices", "input")), _arg(args, kwargs, 0, ("weight",))
    return _arg(args, kwargs, 0, ("input", "indices")), _arg(args, kwargs, 1, ("weight",))


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
    :meth:`row_chosen` answers for a layer's input, :meth:`unowned` whether its row-chosen tensors' rows are the
    samples' (:mod:`fastdp.layers.row_owners`)."""

    def __init__(self) -> None:
        super().__init__()
        self.derived = _Marks()
        self.chosen = _Marks()
        #: parts of the batch's rows cut by their shapes (``h[1:]``, ``h[j]``, ``h.chunk(2)``) and what is computed
        #: from them: not checked at a layer's call (the structure probe verifies them), but their owners are
        #: followed, so that joining them back along dimension 0 (``torch.cat``, ``torch.stack``) is checked
        self.parts = _Marks()
        #: tensors whose dimension 0 is another dimension moved there (not cut into parts)
        self.moved = _Marks()
        self.batch: int | None = None
        #: id of a row-chosen tensor -> (a weak reference to it, its rows' owners or None: not known)
        self._owners: dict[int, tuple[weakref.ref, torch.Tensor | None]] = {}

    def start(self, args: Any, kwargs: Any, batch: int | None = None) -> None:
        self.batch = batch
        for t in tree_flatten((args, kwargs))[0]:
            self.derived.add(t)

    def row_chosen(self, tree: Any) -> bool:
        """Whether a tensor of ``tree`` (a layer call's inputs, any nesting) is row-chosen."""
        return bool(self.chosen) and any(t in self.chosen for t in tree_flatten(tree)[0])

    def owners(self, t: torch.Tensor) -> torch.Tensor | None:
        """The owners of a row-chosen tensor's rows, or of a part's (``None``: not known); the natural ones for any
        other."""
        if t in self.chosen or t in self.parts:
            entry = self._owners.get(id(t))
            return entry[1] if entry is not None and entry[0]() is t else None
        return row_owners.natural(t, self.batch)

    def unowned(self, tree: Any, rows: int, fold: int) -> str | None:
        """Why the row-chosen tensors of ``tree`` (a layer call's inputs) are not ``rows`` rows of the samples in
        order, ``fold`` each (``None``: they are, or there are none)."""
        if not self.chosen or self.batch is None:
            return None
        want = None
        for t in tree_flatten(tree)[0]:
            if not isinstance(t, torch.Tensor) or t not in self.chosen:
                continue
            own = self.owners(t)
            if own is None:
                return "which sample owns each row was lost on the way (an operation fastdp does not follow)"
            if want is None:
                want = torch.arange(self.batch).repeat_interleave(fold)
            if own.shape != want.shape or not torch.equal(own, want):
                counts = torch.bincount(own, minlength=self.batch)[:self.batch].tolist() \
                    if own.numel() and int(own.min()) >= 0 else []
                return (f"its {t.shape[0]} rows belong to samples with {counts} rows each, not {fold} each in order"
                        if counts else f"its {t.shape[0]} rows are not {fold} per sample in order")
        return None

    def _set(self, t: torch.Tensor, own: torch.Tensor | None) -> None:
        self._owners[id(t)] = (weakref.ref(t), own)

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
        chosen_in = bool(self.chosen) and any(t in self.chosen for t in ins)
        part_in = bool(self.parts) and any(t in self.parts for t in ins)
        # (a write of tracked rows is followed by the write's rule, whatever its index: each written row must be
        # its slot's sample's)
        chooses = self._chooses(func, args, kwargs) or ((chosen_in or part_in) and func in _WRITES)
        targets = _tensors(out)
        if func is _T.__setitem__ and args:
            targets.append(args[0])  # written in place (in-place methods return their target)
        for t in targets:
            self.derived.add(t)
        self._note_moved(func, args, kwargs, targets)
        if chosen_in or chooses:
            for t in targets:
                own = self._after(func, args, kwargs, t, ins, chooses)
                self.chosen.add(t)
                self._set(t, own)
                self._write_through(t, args, own, self.chosen)
        elif part_in or self._splits(func, args, kwargs):
            owners = self._split_owners(func, args, kwargs, targets) if not part_in else \
                [self._after(func, args, kwargs, t, ins, False) for t in targets]
            for t, own in zip(targets, owners, strict=True):
                # rows of different orders chosen between by the data (torch.where(flag, h.flip(0), h)): a choice
                marks = self.chosen if own is None and func in _WHERE and args and args[0] in self.derived else \
                    self.parts
                marks.add(t)
                self._set(t, own)
                self._write_through(t, args, own, marks)
        return out

    def _note_moved(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    targets: list[torch.Tensor]) -> None:
        """Mark results whose dimension 0 is another dimension moved there (``permute``, ``transpose``, ``t``,
        ``movedim``), and reshapes, copies and views of such results."""
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or x.dim() < 2:
            return
        moved = (x in self.moved and func in _KEEP_MOVED) or (
            func in _MOVES and not row_owners.keeps_dim0(func, args, kwargs, x))
        if moved:
            for t in targets:
                self.moved.add(t)

    def _write_through(self, t: torch.Tensor, args: tuple[Any, ...], own: torch.Tensor | None, marks: _Marks) -> None:
        """An in-place write into a view (``buf.view(n, d).index_add_(...)``, ``buf[:][idx] = f``) writes into the
        tensor it views: that one is marked too, with the same owners when it has the view's shape."""
        if not any(t is a for a in args[:1]):
            return
        base = view_base(t)
        while base is not None:
            self.derived.add(base)
            marks.add(base)
            self._set(base, own if base.shape == t.shape else None)
            base = view_base(base)

    def _splits(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether ``func`` cuts rows of a derived tensor along dimension 0 by their shapes (a part). Not a tensor
        whose dimension 0 was moved there (:meth:`_note_moved`: not the batch's rows)."""
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x not in self.derived or x in self.moved:
            return False
        if func is _T.__getitem__:
            first = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
            return (isinstance(first, int) and not isinstance(first, bool)) or (
                isinstance(first, slice) and first != slice(None))
        if func in _PARTS:
            pos, default = _PARTS[func]
            return _dim0(x, _arg(args, kwargs, pos, ("dim",), default))
        if func in _REORDERS:  # the rows reordered by the shapes: followed, so that a choice between orders is seen
            dims = _arg(args, kwargs, _REORDERS[func], ("dims",))
            dims = dims if isinstance(dims, (tuple, list)) else (dims,) if dims is not None else ()
            return any(_dim0(x, v) for v in dims if isinstance(v, int))
        return False

    def _split_owners(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                      targets: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The owners of the parts ``targets`` that ``func`` cut along dimension 0 (:meth:`_splits`), in order."""
        x = args[0]
        base = self.owners(x)
        if base is None:
            return [None] * len(targets)
        if func is _T.__getitem__:
            return [row_owners.indexed(base, args[1], x, targets[0])]
        if func in (torch.narrow, _T.narrow):
            start, length = _arg(args, kwargs, 2, ("start",)), _arg(args, kwargs, 3, ("length",))
            own = base[start:start + length] if isinstance(start, int) and isinstance(length, int) else None
            return [own if own is not None and own.shape[0] == targets[0].shape[0] else None]
        if func in (torch.select, _T.select):
            i = _arg(args, kwargs, 2, ("index",))
            t = targets[0]
            return [base[i].expand(t.shape[0]).clone() if isinstance(i, int) and t.dim() else None]
        if func in _REORDERS:
            dims = _arg(args, kwargs, _REORDERS[func], ("dims",))
            dims = tuple(dims) if isinstance(dims, (tuple, list)) else (dims,)
            if func in (torch.flip, _T.flip):
                return [base.flip(0)] if len(dims) == 1 else [None]
            shifts = _arg(args, kwargs, 1, ("shifts",))
            return [base.roll(shifts, 0)] if isinstance(shifts, int) and len(dims) == 1 else [None]
        if func in (torch.unbind, _T.unbind):
            return [base[j].expand(t.shape[0]).clone() if t.dim() else None for j, t in enumerate(targets)]
        out, start = [], 0  # chunk, split, tensor_split: consecutive pieces
        for t in targets:
            n = t.shape[0] if t.dim() else 0
            out.append(base[start:start + n] if start + n <= base.shape[0] else None)
            start += n
        return out

    def _source(self, v: Any) -> Any:
        """The owners of a value written into rows: ``row_owners.CONSTANT`` if it holds no sample's data."""
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v not in self.derived:
            return row_owners.CONSTANT
        return self.owners(v)

    def _after(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], target: torch.Tensor,
               ins: list[torch.Tensor], chooses: bool) -> torch.Tensor | None:
        """The owners of ``target``, a result of ``func`` on row-chosen tensors or a choice of rows."""
        if not isinstance(target, torch.Tensor):
            return None
        if chooses:
            return self._chosen_owners(func, args, kwargs, target)
        if func is _T.__getitem__ and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            tracked = args[0] in self.chosen or args[0] in self.parts
            if tracked and not any(isinstance(i, torch.Tensor) and (i in self.chosen or i in self.parts)
                                   for i in idx):
                return row_owners.indexed(self.owners(args[0]), args[1], args[0], target)
            return None
        if func in _CAT or func is torch.stack:
            joined = self._joined(func, args, kwargs, target)
            if joined is not _NOT_JOINED:
                return joined
        owners = {id(t): self.owners(t) for t in ins if t in self.chosen or t in self.parts}
        others = [t for t in ins if t in self.derived and t not in self.chosen and t not in self.parts]
        return row_owners.carried(func, args, kwargs, target, owners, others, self.batch)

    def _joined(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], target: torch.Tensor) -> Any:
        """The owners of ``torch.cat``/``torch.stack`` along dimension 0: each piece's, joined (a piece of no
        sample's rows, such as a constant, or of rows not known: ``None``); :data:`_NOT_JOINED` along another
        dimension."""
        pieces = [p for p in (_arg(args, kwargs, 0, ("tensors",)) or ()) if isinstance(p, torch.Tensor)]
        dim = _arg(args, kwargs, 1, ("dim", "axis"), 0)
        if not pieces or not isinstance(dim, int):
            return None
        if func in _OTHER_STACKS:
            if func in (torch.vstack, torch.row_stack):  # 1-D pieces are rows (a stack), others joined along 0
                own = []
                for p in pieces:
                    o = self.owners(p) if p in self.derived and p.dim() else None
                    if p.dim() <= 1:
                        if o is None or not o.numel() or not bool((o == o[0]).all()):
                            return None
                        o = o[:1]
                    elif o is None:
                        return None
                    own.append(o)
                joined = torch.cat(own)
                return joined if joined.shape[0] == target.shape[0] else None
            return None  # (hstack, dstack, column_stack: not followed)
        if func is torch.stack:
            if dim not in (0, -pieces[0].dim() - 1):
                return _NOT_JOINED
            own = []
            for p in pieces:  # each piece is one row of the result: all of it one sample's
                o = self.owners(p) if p in self.derived and p.dim() else None
                if o is None or not o.numel() or not bool((o == o[0]).all()):
                    return None
                own.append(o[:1])
            return torch.cat(own)
        if not _dim0(pieces[0], dim):
            return _NOT_JOINED
        own = [self.owners(p) if p in self.derived else torch.full((p.shape[0],), row_owners.NO_SAMPLE)
               for p in pieces if p.dim() and p.shape[0]]  # (a constant row: a position table, a class token)
        if any(o is None for o in own):
            return None
        joined = torch.cat(own) if own else torch.empty(0, dtype=torch.long)
        return joined if joined.shape[0] == target.shape[0] else None

    def _chosen_owners(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                       target: torch.Tensor) -> torch.Tensor | None:
        """The owners of a result of a choice of rows by derived values (:meth:`_chooses`); ``None`` for the choices
        :mod:`fastdp.layers.row_owners` does not follow (sorts, ``unique``, ``take``, ``put``, ``masked_select``,
        ``repeat_interleave``)."""
        if func is _T.__getitem__:
            return row_owners.selected(self.owners(args[0]), args[1], target)
        if func is _T.__setitem__:
            dest, index, value = args[0], args[1], args[2] if len(args) > 2 else None
            return row_owners.written(self.owners(dest), index, self._source(value))
        if func in _ALONG_DIM:
            dim_pos, default, index_pos = _ALONG_DIM[func]
            src = _arg(args, kwargs, 0, ("input",))
            index = _arg(args, kwargs, index_pos, ("index", "indices"))
            if not _dim0(src, _arg(args, kwargs, dim_pos, ("dim",), default)):
                if func in _SELECTS:  # positions of each row chosen: the rows stay, and the index's are theirs
                    return row_owners.rowwise(self.owners(src), self._source(index)) if (
                        isinstance(src, torch.Tensor) and target.dim() and src.dim()
                        and target.shape[0] == src.shape[0]) else None
                value = _arg(args, kwargs, 3, ("source", "src", "value"))
                return row_owners.rowwise(self.owners(src), self._source(value))
            if func in _SELECTS:
                return row_owners.selected(self.owners(src), (index,), target)
            value = _arg(args, kwargs, 3, ("source", "src", "value"))
            if func in _SCATTERS:
                return row_owners.scattered(self.owners(src), src, index, self._source(value), value)
            return row_owners.written(self.owners(src), (index,), self._source(value))
        if func in _MASKED_SCATTER:
            value = _arg(args, kwargs, 2, ("source",))
            return row_owners.masked_written(self.owners(args[0]), args[0], args[1], self._source(value), value)
        if func in _INDEX_PUT:
            indices, value = _arg(args, kwargs, 1, ("indices",)), _arg(args, kwargs, 2, ("values",))
            return row_owners.written(self.owners(args[0]), tuple(indices or ()), self._source(value))
        if func in _LOOKUP:
            index, table = _lookup(func, args, kwargs)
            return row_owners.selected(self.owners(table), (index,), target)
        if func in _CAT or func is torch.stack or func in _OTHER_STACKS:
            joined = self._joined(func, args, kwargs, target)
            return None if joined is _NOT_JOINED else joined
        return None

    def _chooses(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether this call chooses rows of a derived tensor by derived values (see the module docstring)."""
        d = self.derived
        if func in (_T.__getitem__, _T.__setitem__):
            src = args[0] if func is _T.__getitem__ else (args[2] if len(args) > 2 else None)
            return (len(args) > 1 and isinstance(args[0], torch.Tensor) and self._index_chooses(args[0], args[1])
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
            index, table = _lookup(func, args, kwargs)
            return isinstance(table, torch.Tensor) and table in d and isinstance(index, torch.Tensor) and index in d
        if func in _ROW_PRODUCTS or func is torch.einsum:
            return self._contracts_rows(func, args)
        if func in _OTHER_STACKS:  # (vstack of rows, hstack of 1-D pieces: along dimension 0)
            parts = [t for t in _arg(args, kwargs, 0, ("tensors",), ()) if isinstance(t, torch.Tensor)]
            return any(t in self.chosen for t in parts) or self._known_parts(parts) or (
                func in (torch.vstack, torch.row_stack) and len({t.shape[0] for t in parts if t.dim() > 1}) > 1
                and any(t in d for t in parts))
        if func in _CAT or func is torch.stack:
            parts = _arg(args, kwargs, 0, ("tensors",), ())
            dim = _arg(args, kwargs, 1, ("dim",), 0)
            parts = [t for t in parts if isinstance(t, torch.Tensor) and t.dim() > 0]
            if not parts or not isinstance(dim, int) or not any(t in d for t in parts):
                return False
            if func is torch.stack:  # pieces of samples stacked into rows: which sample each is must be followed
                return dim in (0, -parts[0].dim() - 1) and self._known_parts(parts)
            # pieces of different leading sizes (cut per sample at lengths read from the data), or parts of the
            # batch's rows joined back (h[j] for j in an order read from the data)
            return all(_dim0(t, dim) for t in parts) and (
                len({t.shape[0] for t in parts}) > 1 or self._known_parts(parts))
        return False

    def _known_parts(self, pieces: list[torch.Tensor]) -> bool:
        """Whether pieces joined along dimension 0 hold parts of the batch's rows, all with known owners (a join of
        pieces whose owners are not known, parts of a tensor whose dimension 0 is not the batch (``q, k, v =
        qkv.permute(2, 0, ...).unbind(0)``), is left to the structure probe, as any shape-determined layout)."""
        return any(t in self.parts for t in pieces) and all(
            self.owners(t) is not None for t in pieces if t in self.parts or t in self.chosen)

    def _index_chooses(self, x: torch.Tensor, index: Any) -> bool:
        """Whether a ``[]`` index picks dimension 0 of ``x`` by a derived tensor (or a list holding one): the entry
        at dimension 0, after leading ``None``s, or after an ``...`` that stands for no dimension (``h[None, m]``,
        ``h[..., m, :]``)."""
        first = row_owners.dim0_entry(x, index)
        if isinstance(first, torch.Tensor):
            return first in self.derived
        if isinstance(first, (list, tuple)):
            return any(isinstance(y, torch.Tensor) and y in self.derived for y in first)
        return False

    def _contracts_rows(self, func: Any, args: tuple[Any, ...]) -> bool:
        """Whether a product of two derived tensors sums over the rows (dimension 0) of one of them: rows combined
        by weights computed from the data, a choice (``F.one_hot(idx) @ flat``, ``torch.einsum("nr,rd->nd", ...)``,
        ``torch.sparse.mm``). A batched product (``(B, h, T, T) @ (B, h, T, d)``, attention) sums over a later
        dimension."""
        d = self.derived
        if func in _ROW_PRODUCTS:
            first = {_T.__rmatmul__: 1, torch.addmm: 1, _T.addmm: 1}.get(func, 0)
            a = args[first] if len(args) > first else None
            b = (args[0] if func is _T.__rmatmul__ else args[first + 1]) if len(args) > first + 1 else None
            return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a in d and b in d
                    and 1 <= b.dim() <= 2 and self.batch is not None and b.shape[0] % self.batch == 0)
        if func is torch.einsum and args and isinstance(args[0], str) and "->" in args[0]:
            ins, out = args[0].replace(" ", "").split("->")
            ops = [t for t in (args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:])]
            derived = [(spec, t) for spec, t in zip(ins.split(","), ops, strict=False)
                       if isinstance(t, torch.Tensor) and t in d]
            return len(derived) >= 2 and any(spec and spec[0] != "." and spec[0] not in out for spec, _ in derived)
        return False


__all__ = ["RowGuard"]
