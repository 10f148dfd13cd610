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
from fastdp.layers.row_functions import (
    ALONG_DIM,
    BY_INDEX,
    BY_VALUE,
    CAT,
    FACTORIES,
    INDEX_PUT,
    KEEP_MOVED,
    LOOKUP,
    MASKED_SCATTER,
    MOVES,
    OTHER_STACKS,
    PARTS,
    REORDERS,
    ROW_PRODUCTS,
    SCATTERS,
    SELECTS,
    SKIP,
    WHERE,
    WRITES,
    arg_of,
    is_dim0,
    lookup_args,
    tensors_of,
)
from fastdp.torch_api import TorchFunctionMode, tree_flatten, view_base

_T = torch.Tensor
_F = torch.nn.functional
#: :meth:`RowGuard._joined` along a dimension other than 0
_NOT_JOINED = object()

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
        if func in SKIP or func in FACTORIES or not self.derived:
            return out
        ins = tensors_of(args)
        if kwargs:
            ins += tensors_of(kwargs)
        if not any(t in self.derived for t in ins):
            return out
        chosen_in = bool(self.chosen) and any(t in self.chosen for t in ins)
        part_in = bool(self.parts) and any(t in self.parts for t in ins)
        # (a write of tracked rows is followed by the write's rule, whatever its index: each written row must be
        # its slot's sample's)
        chooses = self._chooses(func, args, kwargs) or ((chosen_in or part_in) and func in WRITES)
        targets = tensors_of(out)
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
                marks = self.chosen if own is None and func in WHERE and args and args[0] in self.derived else \
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
        moved = (x in self.moved and func in KEEP_MOVED) or (
            func in MOVES and not row_owners.keeps_dim0(func, args, kwargs, x))
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
        if func in PARTS:
            pos, default = PARTS[func]
            return is_dim0(x, arg_of(args, kwargs, pos, ("dim",), default))
        if func in REORDERS:  # the rows reordered by the shapes: followed, so that a choice between orders is seen
            dims = arg_of(args, kwargs, REORDERS[func], ("dims",))
            dims = dims if isinstance(dims, (tuple, list)) else (dims,) if dims is not None else ()
            return any(is_dim0(x, v) for v in dims if isinstance(v, int))
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
            start, length = arg_of(args, kwargs, 2, ("start",)), arg_of(args, kwargs, 3, ("length",))
            own = base[start:start + length] if isinstance(start, int) and isinstance(length, int) else None
            return [own if own is not None and own.shape[0] == targets[0].shape[0] else None]
        if func in (torch.select, _T.select):
            i = arg_of(args, kwargs, 2, ("index",))
            t = targets[0]
            return [base[i].expand(t.shape[0]).clone() if isinstance(i, int) and t.dim() else None]
        if func in REORDERS:
            dims = arg_of(args, kwargs, REORDERS[func], ("dims",))
            dims = tuple(dims) if isinstance(dims, (tuple, list)) else (dims,)
            if func in (torch.flip, _T.flip):
                return [base.flip(0)] if len(dims) == 1 else [None]
            shifts = arg_of(args, kwargs, 1, ("shifts",))
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
        if func in CAT or func is torch.stack:
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
        pieces = [p for p in (arg_of(args, kwargs, 0, ("tensors",)) or ()) if isinstance(p, torch.Tensor)]
        dim = arg_of(args, kwargs, 1, ("dim", "axis"), 0)
        if not pieces or not isinstance(dim, int):
            return None
        if func in OTHER_STACKS:
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
        if not is_dim0(pieces[0], dim):
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
        if func in ALONG_DIM:
            dim_pos, default, index_pos = ALONG_DIM[func]
            src = arg_of(args, kwargs, 0, ("input",))
            index = arg_of(args, kwargs, index_pos, ("index", "indices"))
            if not is_dim0(src, arg_of(args, kwargs, dim_pos, ("dim",), default)):
                if func in SELECTS:  # positions of each row chosen: the rows stay, and the index's are theirs
                    return row_owners.rowwise(self.owners(src), self._source(index)) if (
                        isinstance(src, torch.Tensor) and target.dim() and src.dim()
                        and target.shape[0] == src.shape[0]) else None
                value = arg_of(args, kwargs, 3, ("source", "src", "value"))
                return row_owners.rowwise(self.owners(src), self._source(value))
            if func in SELECTS:
                return row_owners.selected(self.owners(src), (index,), target)
            value = arg_of(args, kwargs, 3, ("source", "src", "value"))
            if func in SCATTERS:
                return row_owners.scattered(self.owners(src), src, index, self._source(value), value)
            return row_owners.written(self.owners(src), (index,), self._source(value))
        if func in MASKED_SCATTER:
            value = arg_of(args, kwargs, 2, ("source",))
            return row_owners.masked_written(self.owners(args[0]), args[0], args[1], self._source(value), value)
        if func in INDEX_PUT:
            indices, value = arg_of(args, kwargs, 1, ("indices",)), arg_of(args, kwargs, 2, ("values",))
            return row_owners.written(self.owners(args[0]), tuple(indices or ()), self._source(value))
        if func in LOOKUP:
            index, table = lookup_args(func, args, kwargs)
            return row_owners.selected(self.owners(table), (index,), target)
        if func in CAT or func is torch.stack or func in OTHER_STACKS:
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
        if func in ALONG_DIM:
            dim_pos, default, index_pos = ALONG_DIM[func]
            src = arg_of(args, kwargs, 0, ("input",))
            dim = arg_of(args, kwargs, dim_pos, ("dim",), default)
            index = arg_of(args, kwargs, index_pos, ("index", "indices"))
            rows = [t for t in tensors_of(args) + tensors_of(kwargs) if t is not index]
            return (is_dim0(src, dim) and isinstance(index, torch.Tensor) and index in d
                    and any(t in d for t in rows))
        if func in BY_INDEX:
            index = tensors_of(args[1:2]) + [t for k, t in kwargs.items()
                                             if k in ("index", "indices", "mask", "repeats")
                                             and isinstance(t, torch.Tensor)]
            rows = tensors_of(args[:1]) + tensors_of(args[2:]) + [kwargs[k] for k in ("source", "values", "input")
                                                                if isinstance(kwargs.get(k), torch.Tensor)]
            return any(t in d for t in index) and any(t in d for t in rows)
        if func in BY_VALUE:
            src = arg_of(args, kwargs, 0, ("input",))
            pos, default = BY_VALUE[func]
            # (a 1-D tensor's sort reorders per-sample scalars, such as lengths: rows follow only if its order
            # indexes them, which the index rules see)
            return (src in d and isinstance(src, torch.Tensor) and src.dim() >= 2
                    and is_dim0(src, arg_of(args, kwargs, pos, ("dim",), default)))
        if func in LOOKUP:
            index, table = lookup_args(func, args, kwargs)
            return isinstance(table, torch.Tensor) and table in d and isinstance(index, torch.Tensor) and index in d
        if func in ROW_PRODUCTS or func is torch.einsum:
            return self._contracts_rows(func, args)
        if func in OTHER_STACKS:  # (vstack of rows, hstack of 1-D pieces: along dimension 0)
            parts = [t for t in arg_of(args, kwargs, 0, ("tensors",), ()) if isinstance(t, torch.Tensor)]
            return any(t in self.chosen for t in parts) or self._known_parts(parts) or (
                func in (torch.vstack, torch.row_stack) and len({t.shape[0] for t in parts if t.dim() > 1}) > 1
                and any(t in d for t in parts))
        if func in CAT or func is torch.stack:
            parts = arg_of(args, kwargs, 0, ("tensors",), ())
            dim = arg_of(args, kwargs, 1, ("dim",), 0)
            parts = [t for t in parts if isinstance(t, torch.Tensor) and t.dim() > 0]
            if not parts or not isinstance(dim, int) or not any(t in d for t in parts):
                return False
            if func is torch.stack:  # pieces of samples stacked into rows: which sample each is must be followed
                return dim in (0, -parts[0].dim() - 1) and self._known_parts(parts)
            # pieces of different leading sizes (cut per sample at lengths read from the data), or parts of the
            # batch's rows joined back (h[j] for j in an order read from the data)
            return all(is_dim0(t, dim) for t in parts) and (
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
        if func in ROW_PRODUCTS:
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
