"""Verified expansion: per-sample gradients of broadcast raw parameters without replaying their owner.

A generic owner's raw parameter ``P`` of shape ``(1, *rest)`` -- a ViT's class token ``(1, 1, d)``, register tokens
``(1, r, d)``, position embedding ``(1, N, d)`` -- is usually used by broadcasting its leading dimension against the
batch (``P.expand(B, -1, -1)``, ``x + P``). Then sample ``i``'s rows only ever see ``P``, and if the forward pass
uses a separate copy ``E[i] = P`` for every sample::

    E = P.expand(B, *rest)                   (a view: no copy)
    dL/dE[i] = dL_i/dP = g_i                 (row i of E only reaches sample i's rows)

so the gradient that reaches ``E`` in the ordinary backward pass *is* the ``(B, *rest)`` stack of per-sample
gradients: no per-sample replay of the owner (for a ViT the owner is the whole model) is needed.

The substitution is only valid if *every* use of ``P`` in the forward broadcasts its dimension 0 against the batch
dimension. ``P[0]``, ``P.sum(0)``, ``P.view(-1, d)``, ``x @ P``, or a ``(1, d)`` parameter added to a ``(B, N, d)``
input (dimension 0 of ``P`` meets dimension 1 of the input) are not. So every forward call is *verified* while it
runs, by a :class:`torch.overrides.TorchFunctionMode` that sees every torch function that receives a tensor
derived from ``E`` (*tainted*) and accepts only:

* ``expand`` / ``expand_as`` keeping ``ndim`` and dimension 0 of size ``B`` (output tainted);
* ``t[idx]`` whose first index is ``:`` (or an ``...`` that covers dimension 0), with only ints, slices, ``None``
  and ``...`` (output tainted);
* casts and copies (``to``, ``float``, ``double``, ``half``, ``bfloat16``, ``type_as``, ``contiguous``,
  ``clone``) with unchanged shape (output tainted);
* ``add``/``sub``/``rsub``/``mul``/``div``/``true_divide`` (functions, methods and operators, not in place, no
  ``out=``) where every tainted operand has dimension 0 of size ``B`` and the output's ``ndim`` and every other
  tensor operand has either fewer dimensions (aligned with trailing dimensions) or the same ``ndim`` with
  dimension 0 in ``{1, B}``: row ``i`` of the output depends on ``E[i]`` and shared values only;
* ``cat`` along a dimension other than 0 of operands of equal ``ndim``, all with dimension 0 of size ``B``.

An elementwise or ``cat`` output that also combines a non-tainted operand whose dimension 0 is ``B`` (per-sample
data) is an ordinary per-sample activation and is no longer tracked; otherwise it stays tainted. Shape queries
(``shape``, ``size()``, ``dim()``, ...) are answered for the original parameter, so the forward's control flow is
the unmodified one. Any other function that receives a tainted tensor makes the call *unverified*: from then on
every tainted argument is replaced by its *shadow* -- the value the unmodified forward would have had (computed
from ``P`` itself) -- so the forward returns exactly what it returns without the substitution, and the engine falls
back to the generic replay (:mod:`fastdp.layers.generic`) for this call.

Two checks after the forward close the gaps of function interception:

* **the graph**: every autograd node of the call that has an edge to ``E`` or to a tainted tensor must have been
  created by an accepted function (a custom ``autograd.Function``, or anything that bypasses
  ``__torch_function__``, fails this);
* **escape**: an output of the owner that is tainted (its shape differs from the unmodified one) is replaced by its
  shadow, and a tainted tensor other than ``E`` still alive after the forward (stored somewhere) makes the call
  unverified.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fastdp.torch_api import TorchFunctionMode, set_parameter_slot

logger = logging.getLogger(__name__)

_T = torch.Tensor
_METADATA_METHODS = {_T.size, _T.dim, _T.ndimension, _T.numel, _T.nelement, _T.is_floating_point, _T.is_complex,
                     _T.__len__, _T.is_contiguous, _T.element_size, _T.get_device, _T.stride}
_METADATA_PROPERTIES = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "is_cpu", "layout", "requires_grad",
                                  "is_leaf", "is_sparse", "is_quantized", "is_meta", "is_nested", "names"})
_EXPAND = {_T.expand, _T.expand_as}
_CAST = {_T.to, _T.float, _T.double, _T.half, _T.bfloat16, _T.type_as, _T.contiguous, _T.clone}
_ELEMENTWISE = {torch.add, torch.sub, torch.subtract, torch.rsub, torch.mul, torch.multiply, torch.div,
                torch.divide, torch.true_divide, _T.add, _T.sub, _T.subtract, _T.mul, _T.multiply, _T.div,
                _T.divide, _T.true_divide, _T.__add__, _T.__radd__, _T.__sub__, _T.__rsub__, _T.__mul__,
                _T.__rmul__, _T.__truediv__, _T.__rtruediv__}
_CAT = {torch.cat, torch.concat, torch.concatenate}


def expandable(p: torch.Tensor) -> bool:
    """Whether a parameter has the broadcast shape ``(1, *rest)`` that expansion handles."""
    return p.dim() >= 1 and p.shape[0] == 1


class _Reject(Exception):
    pass


def _is_metadata(func: Any) -> bool:
    if func in _METADATA_METHODS:
        return True
    owner = getattr(func, "__self__", None)
    return getattr(func, "__name__", None) == "__get__" and getattr(owner, "__name__", None) in _METADATA_PROPERTIES


def _name(func: Any) -> str:
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", None) == "__get__" and owner is not None:
        return f"Tensor.{getattr(owner, '__name__', '?')}"
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


class ExpandedCall:
    """One forward call of an owner whose generic parameters ``names`` are replaced by expansions ``E``.

    Args:
        module: the owner.
        params: attribute name -> the real parameter ``P`` (shape ``(1, *rest)``), as ``module._parameters`` holds it.
        batch: ``B >= 1``, the batch size of the call.
        anchor: a zero scalar that requires grad, of ``P``'s dtype and device (makes ``E`` a non-leaf so its gradient
            can be captured by a tensor hook without being accumulated anywhere large).

    Lifecycle: :meth:`begin` (owner's pre-hook: ``E`` into ``module._parameters``, mode pushed), the forward,
    :meth:`end` (forward hook, also when the forward raised: mode popped, parameters restored, checks). After
    :meth:`end`, ``verified`` tells whether the gradients reaching :attr:`expanded` are the per-sample gradients.
    """

    def __init__(self, module: nn.Module, params: dict[str, nn.Parameter], batch: int,
                 anchor: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.module = module
        self.batch = batch
        self.names = tuple(sorted(params))
        self.params = params
        self.expanded: dict[str, torch.Tensor] = {}
        self.reason: str | None = None
        self._taint: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (tainted tensor, its shadow)
        self._sources: set[Any] = set()  # grad_fn of E and of every tainted tensor
        self._made: set[Any] = set()  # grad_fn of every output of an accepted function
        self._start = None
        for n in self.names:
            p = params[n]
            base = p.detach() + anchor(p)
            if self._start is None:
                self._start = base.grad_fn._sequence_nr()
            e = base.expand(batch, *p.shape[1:])
            self.expanded[n] = e
            self._taint[id(e)] = (e, p)
            self._sources.add(e.grad_fn)
        self._mode = _ExpansionMode(self)
        self._active = False

    @property
    def verified(self) -> bool:
        return self.reason is None

    # ------------------------------------------------------------------ lifecycle
    def begin(self) -> None:
        for n, e in self.expanded.items():
            set_parameter_slot(self.module, n, e)
        self._active = True
        if self.batch > 1:
            self._mode.__enter__()

    def end(self, leaves: list[Any] | None) -> list[Any] | None:
        """Pop the mode, restore the parameters, run the graph and escape checks.

        ``leaves``: the flattened output of the forward (``None`` if it raised). Returns them with every tainted
        leaf replaced by its shadow (the unmodified forward's value), which also makes the call unverified.
        """
        if not self._active:
            return leaves
        self._active = False
        try:
            if self.batch > 1:
                self._mode.__exit__(None, None, None)
        finally:
            for n, p in self.params.items():
                set_parameter_slot(self.module, n, p)
        if self.batch == 1:
            # A batch of one: E is P itself (same shape and value) and whatever the forward does with it, the
            # gradient reaching E is dL/dP = g_1, the only sample's gradient. Nothing to verify.
            self._release()
            return leaves
        if leaves is None:
            self._fail("the forward raised")
            self._release()
            return None
        out = []
        for leaf in leaves:
            hit = self._find_one(leaf)
            if hit is not None:
                self._fail("an output of the owner is derived from the parameter without the batch's data")
                leaf = hit[1]
            out.append(leaf)
        if self.verified:
            self._check_graph([x for x in out if isinstance(x, torch.Tensor)])
        self._release()
        return out

    def _release(self) -> None:
        taint, self._taint = self._taint, {}
        alive = [weakref.ref(t) for t, _ in taint.values() if not any(t is e for e in self.expanded.values())]
        del taint
        if self.verified and any(r() is not None for r in alive):
            self._fail("a tensor derived from the parameter outlives the forward (stored by the module?)")
        self._sources.clear()
        self._made.clear()

    def _fail(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def _check_graph(self, outputs: list[torch.Tensor]) -> None:
        """Every node of this call with an edge to ``E`` or a tainted tensor was made by an accepted function."""
        start, sources, made = self._start, self._sources, self._made
        seen: set[Any] = set()
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                if nxt in sources and node not in made and node not in sources:
                    self._fail(f"autograd node {type(node).__name__} uses the parameter outside the verified "
                               "functions (a custom autograd.Function?)")
                    return
                if nxt not in seen and nxt._sequence_nr() >= start and not _is_accumulate(nxt):
                    stack.append(nxt)

    # ------------------------------------------------------------------ taint tracking
    def _find_one(self, x: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        if isinstance(x, torch.Tensor):
            hit = self._taint.get(id(x))
            if hit is not None and hit[0] is x:
                return hit
        return None

    def find(self, tree: Any) -> bool:
        if isinstance(tree, torch.Tensor):
            return self._find_one(tree) is not None
        if isinstance(tree, (list, tuple)):
            return any(self.find(x) for x in tree)
        if isinstance(tree, dict):
            return any(self.find(x) for x in tree.values())
        return False

    def shadowed(self, tree: Any) -> Any:
        """``tree`` with every tainted tensor replaced by its shadow."""
        if isinstance(tree, torch.Tensor):
            hit = self._find_one(tree)
            return tree if hit is None else hit[1]
        if isinstance(tree, (list, tuple)):
            items = [self.shadowed(x) for x in tree]
            if isinstance(tree, list):
                return items
            return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
        if isinstance(tree, dict):
            return {k: self.shadowed(v) for k, v in tree.items()}
        return tree

    def _accept(self, out: torch.Tensor, shadow: torch.Tensor | None) -> torch.Tensor:
        """Record ``out`` as made by an accepted function; tainted (with its shadow) unless ``shadow`` is None."""
        if out.grad_fn is not None:
            self._made.add(out.grad_fn)
        if shadow is not None:
            self._taint[id(out)] = (out, shadow)
            if out.grad_fn is not None:
                self._sources.add(out.grad_fn)
        return out

    def handle(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)`` with at least one tainted argument."""
        if _is_metadata(func):
            return func(*self.shadowed(args), **self.shadowed(kwargs))
        if self.reason is None:
            rule = _rule_for(func)
            if rule is None:
                self._fail(f"{_name(func)} receives the parameter")
            else:
                try:
                    return rule(self, func, args, kwargs)
                except _Reject as e:
                    self._fail(f"{_name(func)}: {e}")
                except Exception as e:  # noqa: BLE001 - the unmodified call below raises it again if it is real
                    self._fail(f"{_name(func)} failed on the expansion ({type(e).__name__})")
        return func(*self.shadowed(args), **self.shadowed(kwargs))

    # ------------------------------------------------------------------ rules
    def _rule_expand(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        t = args[0]
        if self._find_one(t) is None or self.find(args[1:]) or self.find(kwargs):
            raise _Reject("tainted tensor in a non-self position")
        out = func(*args, **kwargs)
        if out.dim() != t.dim() or out.shape[0] != self.batch:
            raise _Reject("moves the batch dimension")
        return self._accept(out, func(*self.shadowed(args), **kwargs))

    def _rule_cast(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        t = args[0]
        if self._find_one(t) is None or self.find(args[1:]) or self.find(kwargs) or "out" in kwargs:
            raise _Reject("tainted tensor in a non-self position")
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or out.shape != t.shape:
            raise _Reject("changes the shape")
        if out is t:
            return out
        return self._accept(out, func(*self.shadowed(args), **kwargs))

    def _rule_getitem(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        t, idx = args[0], args[1]
        if kwargs or self._find_one(t) is None:
            raise _Reject("unexpected arguments")
        idx = idx if isinstance(idx, tuple) else (idx,)
        for k in idx:
            if not (k is None or k is Ellipsis or isinstance(k, slice) or (isinstance(k, int)
                                                                              and not isinstance(k, bool))):
                raise _Reject("advanced indexing")
            if isinstance(k, slice) and any(isinstance(v, torch.Tensor) for v in (k.start, k.stop, k.step)):
                raise _Reject("tensor slice bounds")
        first = idx[0] if idx else slice(None)
        if first is Ellipsis:
            used = sum(1 for k in idx[1:] if k is not None and k is not Ellipsis)
            if used >= t.dim():
                raise _Reject("indexes dimension 0")
        elif first != slice(None):
            raise _Reject("indexes dimension 0")
        out = func(*args, **kwargs)
        if out.dim() < 1 or out.shape[0] != self.batch:
            raise _Reject("moves the batch dimension")
        return self._accept(out, func(*self.shadowed(args), **kwargs))

    def _rule_elementwise(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if "out" in kwargs:
            raise _Reject("out=")
        operands = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
        nd = max(x.dim() for x in operands)
        per_sample = False
        for x in operands:
            if self._find_one(x) is not None:
                if x.dim() != nd or x.shape[0] != self.batch:
                    raise _Reject("dimension 0 of the parameter does not meet the batch dimension")
            elif x.dim() == nd:
                if x.shape[0] not in (1, self.batch):
                    raise _Reject("an operand's dimension 0 is not 1 or the batch")
                per_sample = per_sample or (x.shape[0] == self.batch and self.batch > 1)
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or out.dim() != nd or out.shape[0] != self.batch:
            raise _Reject("moves the batch dimension")
        if per_sample:
            want = torch.broadcast_shapes(*[(self._find_one(x) or (x, x))[1].shape for x in operands])
            if tuple(want) != tuple(out.shape):
                raise _Reject("the unmodified result has another shape")
            return self._accept(out, None)
        return self._accept(out, func(*self.shadowed(args), **self.shadowed(kwargs)))

    def _rule_cat(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if "out" in kwargs or not isinstance(args[0], (list, tuple)):
            raise _Reject("out= or unexpected arguments")
        tensors = list(args[0])
        dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
        if not tensors or not isinstance(dim, int) or self.find(args[1:]) or self.find(kwargs):
            raise _Reject("unexpected arguments")
        nd = tensors[0].dim()
        if nd < 2 or any(x.dim() != nd for x in tensors) or dim % nd == 0:
            raise _Reject("concatenates along the batch dimension")
        per_sample = False
        for x in tensors:
            if x.shape[0] != self.batch:
                raise _Reject("an operand's dimension 0 is not the batch")
            hit = self._find_one(x)
            if hit is None:
                per_sample = per_sample or self.batch > 1
            elif hit[1].shape != x.shape:
                raise _Reject("the unmodified operands have other shapes")
        out = func(*args, **kwargs)
        if per_sample:
            return self._accept(out, None)
        return self._accept(out, func(*self.shadowed(args), **kwargs))


def _is_accumulate(node: Any) -> bool:
    return type(node).__name__ == "AccumulateGrad"


def _rule_for(func: Any) -> Callable[..., Any] | None:
    if func in _EXPAND:
        return ExpandedCall._rule_expand
    if func in _CAST:
        return ExpandedCall._rule_cast
    if func is _T.__getitem__:
        return ExpandedCall._rule_getitem
    if func in _ELEMENTWISE:
        return ExpandedCall._rule_elementwise
    if func in _CAT:
        return ExpandedCall._rule_cat
    return None


class _ExpansionMode(TorchFunctionMode):
    """Routes every torch function that receives a tainted tensor to :meth:`ExpandedCall.handle`."""

    def __init__(self, call: ExpandedCall) -> None:
        super().__init__()
        self.call = call

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        call = self.call
        if not (call.find(args) or (kwargs and call.find(kwargs))):
            return func(*args, **kwargs)
        return call.handle(func, args, kwargs)
