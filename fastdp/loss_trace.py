"""The loss trace: follow the model's outputs through the loss, and refuse a loss that couples samples.

The engine clips each sample's gradient. That is exact only if the loss it backpropagates is a sum of terms each of
which depends on one sample: ``L = c + Σ_k f_k(Y_k)`` (``Y_k``: sample ``k``'s outputs; ``c`` and ``f_k`` may use
constants and that sample's own data). A loss that couples samples -- in-batch negatives and contrastive losses
(``Y @ Y.T`` then a cross-entropy over the batch), a log-sum-exp or a softmax over the batch dimension, a loss
divided by a batch statistic of the outputs, per-sample weights computed from other samples' outputs (a batch-mean
baseline, hard-example mining over the batch) -- makes every sample's gradient depend on the others: per-sample
clipping no longer bounds what one sample changes, and the privacy guarantee fails. The engine never sees the
loss, so on the first passes of each input signature it *traces* it.

**How.** After a forward call of the model (the root's, with autograd on and ``B >= 2``), each floating output ``(B,
...)`` that requires grad is returned as a :class:`Traced` tensor: the same values and autograd graph (an alias,
``Tensor.as_subclass``), plus a :class:`fastdp.loss_deps.Dep` -- row ``k`` depends on sample ``k``. Every torch
function that receives a traced tensor (``__torch_function__``: operators, methods, ``torch.*``,
``torch.nn.functional.*``) runs unchanged, and its result gets the ``Dep`` that the function's rule
(:mod:`fastdp.loss_trace_rules`) derives; a function without a rule returns an untraced result and makes the pass
*unverified*. When ``backward`` is called on a traced tensor (``loss.backward()``, ``torch.autograd.backward``,
``scaler.scale(loss).backward()``), its ``Dep`` is the pass's verdict: ``separable`` (a sum of per-sample terms),
``coupled`` (refused) or ``unverified``, judged by the operations before that ``backward`` (what the loop does
afterwards, ``running += loss.detach()`` or a NaN check, cannot change the pass's gradients). Forward calls between
two backward passes share sample indices (the engine merges their records by index), so their outputs share one
:class:`fastdp.loss_deps.Book`; a tensor kept from an earlier pass (a memory bank, a queue of earlier outputs) belongs
to another book, and combining it with this pass's rows couples samples too.

**Gradient hooks.** ``register_hook`` on a model output (traced) is wrapped: a hook that changes the gradient
raises in the backward pass (the engine reads each layer's output gradient before such a hook runs, so the per-sample
gradients would miss the change); a hook on another traced tensor leaves the pass unverified.

**The refusal** is a :class:`fastdp.probe.StructureError` from ``optimizer.step()`` before anything is released
(the step's sums are discarded; on several ranks every rank raises), naming the operation that coupled samples and
the line of the user's code that called it. A refusal starts the signature's count again.

**Budget** (the state, the verdicts and the refusal are in :mod:`fastdp.loss_trace_verdicts`). ``TRACE_PASSES``
judged passes per input signature (:func:`fastdp.probe.signature`; every pass under ``verify_loss="strict"``, which
also refuses unverified passes), and at most ``MAX_ARMS`` forward calls traced per signature (forward calls without
a backward pass). The cost is Python's: one ``__torch_function__`` call per
torch function on a traced tensor, in the traced passes only.

**What it does not see.** Anything the rules do not know (the pass is then ``unverified``: logged, not refused):
functions without a rule, traced values or indices written in place into untraced tensors, in-place writes through
views, Python branches (``bool``) and sizes read from traced values (one sample's too), copies made outside torch
(``copy.deepcopy``, pickle), ``out=``, custom autograd functions, code run under ``torch.compile`` (a compiled loss is
not traced). Values that leave torch (``.item()``, ``.tolist()``, ``float``, numpy) are constants to it (under
``"strict"``, a read before the backward pass leaves the pass unverified). A loss computed inside the model's forward
(Hugging Face models called with ``labels=``) is not traced: it never leaves the model as an output. Data that is not
a model output is a constant to the trace: a divisor counted from the labels (a token mean) is the loss check's
(:mod:`fastdp.loss_check`); a per-sample weight from the batch's labels is neither's. A traced tensor fed back into
the model is given to it as a plain alias (the model, the engine's hooks and the structure probe never see traced
tensors): the call's outputs are the batch's rows again, so an input that was not (a value of several samples) leaves
the pass unverified. The rules follow structure, not algebra, and err towards refusing (docs/reference/losses.md lists
the known false refusals). Selecting rows reads the index's content on the host (the same selection gives the same
rows).

It may touch: the model's outputs (returned as aliases of the same tensors) and its own state.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from fastdp import torch_api
from fastdp.loss_deps import (
    ONE,
    PHANTOM,
    ROWS,
    Book,
    Dep,
    combine,
    data,
    one_from_row,
    output_dep,
    reduce,
    same_map,
    single_sample,
)
from fastdp.loss_trace_rules import ALIASES, CONST, RULES
from fastdp.loss_trace_verdicts import MAX_ARMS, TRACE_PASSES, LossTrace, settle, verdict

__all__ = ["MAX_ARMS", "TRACE_PASSES", "LossTrace", "Traced", "arm", "dep_of", "plain_inputs", "settle", "verdict"]

logger = logging.getLogger(__name__)

_DEPTH = 4  # nesting of tuples, lists and dicts searched for outputs
#: reads of a traced value to the host (under verify_loss="strict", before the backward pass: unverified)
_HOST_READS = frozenset({"item", "tolist", "numpy", "__float__", "__int__", "__complex__", "__array__"})
#: functions whose result is never traced (queries, hooks, the gradient)
_PASS = frozenset({"__repr__", "__format__", "__str__", "numpy", "tolist", "item", "__bool__", "__len__", "__hash__",
                   "register_hook", "retain_grad", "grad", "grad_fn", "is_leaf", "requires_grad", "shape", "dtype",
                   "device", "_version", "__reduce_ex__", "__setstate__", "__getstate__", "data_ptr", "storage",
                   "untyped_storage", "element_size", "stride", "storage_offset", "is_contiguous", "__dlpack__",
                   "__array__", "__iter__", "__deepcopy__", "layout", "names", "__index__"})


class Traced(torch.Tensor):
    """A model output, or a tensor computed from one, while the loss trace follows it: a torch function on it runs
    unchanged and its result is traced by the function's rule (:mod:`fastdp.loss_trace_rules`)."""

    _fdp_dep: Dep

    def __reduce_ex__(self, proto: Any) -> Any:  # torch.save, pickle, copy.copy: the plain tensor it aliases
        self._fdp_dep.book.miss("a copy made outside torch (copy.copy, pickle, torch.save)")
        with torch_api.torch_function_subclasses_off():
            return self.as_subclass(torch.Tensor).__reduce_ex__(proto)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:  # copy.deepcopy: a plain tensor (the copy is not traced)
        self._fdp_dep.book.miss("copy.deepcopy")
        with torch_api.torch_function_subclasses_off():
            return self.as_subclass(torch.Tensor).__deepcopy__(memo)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if name == "backward":
            _on_backward(args, kwargs)
        elif name == "register_hook" and len(args) > 1:
            args = (args[0], _guard_hook(args[0], args[1])) + tuple(args[2:])
        with torch_api.torch_function_subclasses_off():
            res = func(*args, **kwargs)
        if name == "__setitem__":
            _on_setitem(args)
        elif name in ("__bool__", "__index__"):  # a branch, or a slice bound / length read from the value
            _on_branch(args[0])
        elif name in _HOST_READS:
            _on_host_read(args[0], name)
        elif name == "_base" and res is not None:  # the tensor a traced view was taken from: not followed
            for book in _books(args, kwargs):
                book.miss("_base of a traced view")
            return res
        if name in _PASS or name == "backward" or not _has_tensor(res) or torch.compiler.is_compiling():
            return _plain(res, args)
        return _follow(name, args, kwargs, res)

    def __format__(self, spec: str) -> str:  # f"{loss:.4f}": formatted as the plain tensor it aliases
        with torch_api.torch_function_subclasses_off():
            return self.as_subclass(torch.Tensor).__format__(spec)


def dep_of(x: Any) -> Dep | None:
    """The trace's ``Dep`` of ``x``: ``None`` for an untraced value."""
    return getattr(x, "_fdp_dep", None) if isinstance(x, Traced) else None


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property getter (t.T, t.data)
        return getattr(getattr(func, "__self__", None), "__name__", "")
    return name


def _check_gradient_paths(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A traced value made by a custom ``autograd.Function`` (its forward ran without autograd, so the trace saw
    data; its backward, which may combine samples, is not followed): the pass is unverified."""
    with torch_api.torch_function_subclasses_off():
        for a in list(args) + list(kwargs.values()):
            for x in (a if isinstance(a, (list, tuple)) else (a,)):
                d = dep_of(x)
                if d is not None and isinstance(x.grad_fn, torch.autograd.function.BackwardCFunction):
                    d.book.miss("a gradient path the trace does not follow (a custom autograd Function)")


def _guard_hook(t: Traced, hook: Any) -> Any:
    """``register_hook`` on a traced tensor. On a model output: the hook wrapped so that it raises if it changes the
    gradient (the engine reads each layer's output gradient before such a hook runs: its per-sample gradients would
    miss the change, and a hook that combines samples would break the guarantee). On another traced tensor: the
    pass is unverified (the hook may combine samples)."""
    d = dep_of(t)
    if d is None:
        return hook
    if not getattr(t, "_fdp_output", False):
        d.book.miss("a gradient hook on a traced tensor")
        return hook

    def guarded(g: torch.Tensor) -> Any:
        before = g.detach().clone()
        out = hook(g)
        if (out is not None and out is not g) or not torch.equal(g.detach(), before):
            raise RuntimeError(
                "a gradient hook registered on the model's output changed its gradient. The engine reads each "
                "layer's output gradient before such a hook runs, so its per-sample gradients would not include the "
                "change (and a hook that combines samples, e.g. normalising over the batch, would break the privacy "
                "guarantee). Change the loss instead (scale the output, or add the term to the loss); a hook that "
                "only reads the gradient is fine. Nothing of this backward pass is released.")
        return out

    return guarded


def _on_setitem(args: tuple[Any, ...]) -> None:
    """``t[index] = value``: a traced value or index written into a tensor is not followed (the pass is unverified);
    constants written into a traced tensor leave its dependence as it is."""
    target, rest = args[0], args[1:]
    books = _books(rest, {}) + _books(tuple(i for r in rest if isinstance(r, tuple) for i in r), {})
    if books:
        for book in books + _books((target,), {}):
            book.miss("__setitem__ (a traced value or index written in place)")


def _on_branch(t: Any) -> None:
    """``bool(t)`` (``if``, Python's ``max``, ``sorted``) or ``t.__index__()`` (a slice bound, a length): a branch or
    a size read from a traced value is not followed, even one sample's (``if out[0].sum() > 0: loss = 2 * loss``
    scales every sample's term by sample 0's value; a per-sample loop that branches on each sample's own value is
    separable, but the trace cannot tell which terms a branch decides)."""
    d = dep_of(t)
    if d is not None:
        what = "several samples" if d.kind not in (ROWS, ONE) else "one sample"
        d.book.miss(f"a Python branch (bool) or a size read from a value of {what}")


def _on_host_read(t: Any, name: str) -> None:
    """``t.item()``, ``float(t)``, ``t.tolist()``, ``t.numpy()`` before the backward pass: the values leave torch,
    and weights computed from them are not seen (``loss / loss.sum().item()``). Under ``verify_loss="strict"`` the
    pass is then unverified; by default it is not (``loss.item()`` for logging is common and harmless)."""
    d = dep_of(t)
    state = d.book.state() if d is not None and d.book.state is not None else None
    if state is not None and state.every and not d.book.closed:
        d.book.miss(f"a value read to the host ({name}) before the backward pass")


def _has_tensor(res: Any) -> bool:
    return isinstance(res, torch.Tensor) or (isinstance(res, (tuple, list)) and any(
        isinstance(r, torch.Tensor) for r in res))


def _books(args: Any, kwargs: dict[str, Any]) -> list[Book]:
    found = []
    for a in list(args) + list(kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            d = dep_of(x)
            if d is not None and d.book not in found:
                found.append(d.book)
    return found


def _plain(res: Any, args: tuple[Any, ...]) -> Any:
    """``res`` without the trace (an in-place result that is a traced argument keeps its type and its ``Dep``)."""
    if isinstance(res, Traced) and not any(res is a for a in args):
        return res.as_subclass(torch.Tensor)
    if isinstance(res, (tuple, list)) and any(isinstance(r, Traced) for r in res):
        return _rebuild(res, [_plain(r, args) for r in res])
    return res


def _rebuild(res: tuple[Any, ...] | list[Any], items: list[Any]) -> Any:
    """A tuple, named tuple, torch return type or list like ``res`` holding ``items``."""
    if isinstance(res, list):
        return items
    if hasattr(res, "_fields"):  # a named tuple
        return type(res)(*items)
    return type(res)(items)  # a tuple, or a torch.return_types structseq


#: functions whose arguments after the first are sizes, indices or counts (a traced one is not followed)
_SIZE_ARGS = frozenset({"narrow", "select", "split", "chunk", "tensor_split", "split_with_sizes", "view", "reshape",
                        "expand", "repeat", "unflatten", "topk", "kthvalue", "roll", "diagonal", "diag", "flatten",
                        "movedim", "transpose", "permute", "squeeze", "unsqueeze", "index_select", "new_zeros",
                        "new_ones", "new_empty", "pad", "unbind"})


def _follow(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any) -> Any:
    name = ALIASES.get(name, name)
    _check_gradient_paths(args, kwargs)
    rule = RULES.get(name)
    if name.rstrip("_") in _SIZE_ARGS and _books(args[1:], kwargs):  # o.narrow(0, 0, k) with k from the batch
        rule = None
    deps = None
    if rule is not None and kwargs.get("out") is None:
        try:
            with torch_api.torch_function_subclasses_off():  # a rule's own torch calls are not traced
                deps = rule(name, args, kwargs, res, dep_of)
        except Exception as e:  # a rule that cannot read these arguments: unverified, never an error of the loss
            logger.debug("loss trace: the rule of %s raised %r", name, e)
            deps = None
    if deps is CONST:
        return _plain(res, args)
    if deps is not None and not torch.is_grad_enabled():  # no gradient path (no_grad, a custom Function's forward)
        deps = tuple(data(d) if isinstance(d, Dep) else d for d in deps) if isinstance(deps, tuple) else data(deps)
    if deps is None:
        return _unfollowed(name, args, kwargs, res)
    try:
        return _result(name, args, kwargs, res, deps)
    except Exception as e:  # a Dep that does not fit the result: unverified, never an error of the loss
        logger.debug("loss trace: the result of %s was not traced: %r", name, e)
        return _unfollowed(name, args, kwargs, res)


def _unfollowed(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any) -> Any:
    """``res`` untraced, and the passes of the traced arguments unverified (the rules could not follow ``name``)."""
    for book in _books(args, kwargs):
        book.miss(name)
    return _plain(res, args)


def _result(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, deps: Any) -> Any:
    """``res`` traced with ``deps`` (in place where it is a traced argument)."""
    if isinstance(res, torch.Tensor):
        if isinstance(deps, tuple):
            return _unfollowed(name, args, kwargs, res)
        if not isinstance(res, Traced) and any(res is a for a in args):  # traced values written in place into an
            for book in _books(args, kwargs):  # untraced tensor (buf += x, w.masked_fill_(mask_of_x, 0))
                book.miss(f"{name} (into an untraced tensor)")
            return res
        if isinstance(res, Traced) and any(res is a for a in args):
            if not _in_place(name):
                return res  # an argument returned as is (x.contiguous(), x.to(its dtype)): nothing changed
            if _stale_views(res, deps):
                deps.book.miss(f"{name} (in place)")
        return _wrap(res, deps)
    if not isinstance(deps, tuple):
        deps = tuple(deps for _ in res)
    if len(deps) != len(res) or any(isinstance(r, torch.Tensor) and not isinstance(d, Dep) and d != CONST
                                    for r, d in zip(res, deps, strict=True)):
        return _unfollowed(name, args, kwargs, res)
    items = [_wrap(r, d) if isinstance(r, torch.Tensor) and isinstance(d, Dep) else r
             for r, d in zip(res, deps, strict=True)]
    return _rebuild(res, items)


def _in_place(name: str) -> bool:
    return (name.endswith("_") and not name.startswith("__")) or name in {"__iadd__", "__isub__", "__imul__",
                                                                          "__itruediv__", "__setitem__"}


def _stale_views(t: Traced, new: Dep) -> bool:
    """Whether an in-place write into traced ``t`` may leave other tensors' ``Dep`` wrong: ``t`` is a view (its base
    changed too: ``x[0] += x[1]``), or its dependence changed (views of ``t`` taken before keep the old one)."""
    old = dep_of(t)
    return getattr(t, "_fdp_view", True) or old is None or (
        (old.kind, old.dims, old.maps) != (new.kind, new.dims, new.maps))


def _wrap(t: torch.Tensor, dep: Dep) -> torch.Tensor:
    with torch_api.torch_function_subclasses_off():
        shape = tuple(t.shape)
    if any(x >= len(shape) for x in dep.dims):
        raise ValueError(f"a rule gave sample dimensions {dep.dims} to a tensor of {len(shape)} dimensions")
    if dep.kind == ROWS and single_sample(dep.maps[0], shape[dep.dims[0]]):  # x[i:i+1], one sample's tokens
        dep = Dep(ONE, dep.grad, dep.book, (), (one_from_row(dep.maps[0], 0),))
    if dep.kind == ONE and dep.maps[0][1] == PHANTOM and not isinstance(t, Traced):
        return t  # rows of no sample (a constant concatenated with the batch's): untraced
    if isinstance(t, Traced):
        out = t
    else:
        view = t._is_view()  # (the alias made here is a view of t: whether t itself is a view of another tensor)
        out = t.as_subclass(Traced)
        out._fdp_view = view
    out._fdp_dep = dep
    return out


#: why a pass is unverified when the model returned no per-sample output
NO_SAMPLE_OUTPUT = ("the model's outputs, none of which has the batch dimension (a loss computed inside the model's "
                    "forward: return per-sample outputs or losses and reduce them outside the model)")


def _outputs(out: Any, B: int, book: Book, depth: int = 0) -> tuple[Any, int]:
    """``out`` with its floating outputs ``(B, ...)`` that require grad returned as traced aliases; and how many."""
    if isinstance(out, torch.Tensor):
        if (not isinstance(out, Traced) and out.is_floating_point() and out.requires_grad and out.dim() >= 1
                and out.shape[0] == B):
            traced = _wrap(out, output_dep(book))
            traced._fdp_output = True  # a model output itself (fastdp.loss_trace._guard_hook)
            return traced, 1
        return out, 0
    if depth >= _DEPTH:
        return out, 0
    if isinstance(out, Mapping):
        n = 0
        try:
            for k in list(out.keys()):
                v, m = _outputs(out[k], B, book, depth + 1)
                if m:
                    out[k] = v  # dicts and Hugging Face ModelOutputs (their attribute too)
                    n += m
        except TypeError:  # a read-only mapping: left untraced
            return out, n
        return out, n
    if isinstance(out, (tuple, list)):
        items, n = [], 0
        for v in out:
            v, m = _outputs(v, B, book, depth + 1)
            items.append(v)
            n += m
        if not n:
            return out, 0
        if isinstance(out, list):
            out[:] = items
            return out, n
        return _rebuild(out, items), n
    return out, 0


def arm(state: LossTrace, sig: Any, output: Any, B: int) -> Any:
    """After a traced forward call of the model with signature ``sig`` and batch ``B``: its output, with the
    tensors the loss may be computed from returned as traced aliases."""
    if state.book is None or state.book.closed:
        state.book = Book()
        state.book.state = weakref.ref(state)
    book = state.book
    out, n = _outputs(output, B, book)
    if n:
        state.sigs.setdefault(id(book), set()).add(sig)
    elif any(isinstance(y, torch.Tensor) and y.is_floating_point() and y.requires_grad
             for y in torch_api.tree_flatten(output)[0]):
        # outputs that require grad, none per sample (a loss or a reduction over the batch computed inside the
        # model's forward): nothing to trace, so the backward pass through them is unverified (strict refuses it)
        book.miss(NO_SAMPLE_OUTPUT)
        state.sigs.setdefault(id(book), set()).add(sig)
    return out


def _holds_traced(x: Any) -> bool:
    if isinstance(x, Traced):
        return True
    if isinstance(x, (list, tuple)):
        return any(isinstance(v, Traced) for v in x)
    if type(x) is dict:
        return any(isinstance(v, Traced) for v in x.values())
    return False


def plain_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A forward call of the model with traced inputs (its outputs fed back): the inputs as plain aliases, so that
    the model, the engine's hooks and the structure probe never see traced tensors (``None``: none was traced). An
    input that is not the batch's own rows (a value of several samples, rows of other samples) is not followed
    through the model (the call's outputs are the batch's rows again), so its pass is unverified."""
    if not any(_holds_traced(v) for v in (*args, *kwargs.values())):  # every forward call: the common case
        return None
    found = False

    def plain(x: Any) -> Any:
        nonlocal found
        if isinstance(x, Traced):
            found = True
            d = dep_of(x)
            if d is not None and not (d.kind == ROWS and d.dims == (0,) and same_map(d.maps[0], (d.book, 1, 0),
                                                                                     x.shape[0])):
                d.book.miss("a traced value of several samples fed back into the model")
            with torch_api.torch_function_subclasses_off():
                return x.as_subclass(torch.Tensor)
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(plain(v) for v in x)
        if type(x) is dict:
            return {k: plain(v) for k, v in x.items()}
        return x

    new_args = tuple(plain(a) for a in args)
    new_kwargs = {k: plain(v) for k, v in kwargs.items()}
    return (new_args, new_kwargs) if found else None


def _on_backward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``backward`` called on traced tensors: each one's ``Dep`` is its pass's verdict."""
    roots = args[0] if args else kwargs.get("tensors")
    grads = args[1] if len(args) > 1 else kwargs.get("gradient", kwargs.get("grad_tensors"))
    roots = list(roots) if isinstance(roots, (list, tuple)) else [roots]
    grads = list(grads) if isinstance(grads, (list, tuple)) else [grads] * len(roots)
    for t, g in zip(roots, grads, strict=False):
        d = dep_of(t)
        if d is None:
            continue
        state = d.book.state() if getattr(d.book, "state", None) is not None else None
        if state is None:
            continue
        _check_gradient_paths((t,), {})
        if isinstance(t, torch.Tensor) and t.dim() > 0:  # backward(gradient=w): the loss is sum(w * t)
            gd = dep_of(g)
            if gd is not None:
                d = combine([(d, tuple(t.shape)), (gd, tuple(g.shape))], tuple(t.shape), False, "backward(gradient=)")
            d = reduce(d, t.dim(), None, False, True, "backward(gradient=)")
        d.book.closed = True
        state.pending.append((d, d.book.seen(), frozenset(state.sigs.pop(id(d.book), ()))))
