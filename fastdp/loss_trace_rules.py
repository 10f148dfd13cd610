"""Per torch function: how its result depends on the samples, given how its traced arguments do.

The table of the loss trace (:mod:`fastdp.loss_trace`), keyed by the function's name (``torch.add``,
``Tensor.add``, ``Tensor.__add__`` and ``add_`` share one rule). Each rule receives the arguments, the result and
``dep(x)`` (the :class:`fastdp.loss_deps.Dep` of a traced tensor, ``None`` for anything else) and returns the
result's ``Dep``, a tuple of them for a tuple result, or ``None`` where it cannot follow the samples (the result is
then untraced and the pass unverified: never a refusal). The algebra itself is :mod:`fastdp.loss_deps`.
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
    along,
    combine,
    contract,
    data,
    narrow_map,
    one_from_row,
    permute,
    reduce,
    reshape,
    selected,
    unary,
)

DepOf = Callable[[Any], Dep | None]
Rule = Callable[[str, tuple[Any, ...], dict[str, Any], Any, DepOf], Any]

_LINEAR = {"neg", "negative", "positive", "clone", "contiguous", "to", "float", "double", "half", "bfloat16",
           "type_as", "cpu", "cuda", "requires_grad_", "conj", "resolve_conj", "resolve_neg", "__neg__", "__pos__",
           "real"}
_NONLINEAR = {"exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sigmoid", "tanh", "relu", "relu6", "abs",
              "absolute", "sqrt", "rsqrt", "square", "reciprocal", "sin", "cos", "sinh", "cosh", "atan", "asin",
              "acos", "erf", "erfc", "erfinv", "clamp", "clip", "clamp_min", "clamp_max", "nan_to_num", "lgamma",
              "digamma", "logit", "softplus", "gelu", "silu", "mish", "elu", "selu", "celu", "leaky_relu",
              "hardtanh", "logsigmoid", "hardsigmoid", "hardswish", "tanhshrink", "softsign", "dropout",
              "threshold", "__abs__", "sigmoid_", "pow", "__pow__", "float_power", "frac"}
_DATA_UNARY = {"sign", "sgn", "floor", "ceil", "round", "trunc", "isnan", "isinf", "isfinite", "isposinf",
               "isneginf", "signbit", "logical_not", "__invert__", "bool", "long", "int", "short", "byte", "char",
               "detach", "data"}
_CONSTANT = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
             "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor", "size", "dim", "numel"}
_INPLACE_DUNDER = {"__iadd__": "__add__", "__isub__": "__sub__", "__imul__": "__mul__", "__itruediv__": "__truediv__"}
#: a rule's answer for a result that does not depend on the samples (it is left untraced; the pass stays verified)
CONST = "const"
_ADDITIVE = {"add", "sub", "subtract", "rsub", "__add__", "__radd__", "__sub__", "__rsub__", "__iadd__", "__isub__"}
_MULTIPLICATIVE = {"mul", "multiply", "__mul__", "__rmul__", "__imul__", "masked_fill", "addcmul", "lerp"}
_DIVISION = {"div", "divide", "true_divide", "__truediv__", "__itruediv__"}  # nonlinear in the divisor
_NONLINEAR_BINARY = {"__rtruediv__", "__rpow__", "maximum", "minimum", "fmax", "fmin", "atan2", "xlogy", "hypot",
                     "logaddexp",
                     "copysign", "fmod", "remainder", "__mod__", "floor_divide", "__floordiv__", "__rfloordiv__",
                     "addcdiv"}
_COMPARE = {"eq", "ne", "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
            "logical_and", "logical_or", "logical_xor", "__and__", "__or__", "__xor__", "isclose", "greater",
            "less", "greater_equal", "less_equal", "not_equal", "equal_"}
_LINEAR_REDUCE = {"sum", "mean", "nansum", "nanmean"}
_NONLINEAR_REDUCE = {"logsumexp", "amax", "amin", "std", "var", "prod", "norm", "vector_norm", "nanmedian",
                     "median", "max", "min"}
_DATA_REDUCE = {"all", "any", "count_nonzero", "argmax", "argmin"}
_ALONG = {"softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp", "normalize", "argsort", "gumbel_softmax"}
_MATMUL = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "einsum", "linear", "inner", "dot", "vdot", "outer",
           "ger", "mv"}
_ELEMENT_LOSSES = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
                   "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss", "soft_margin_loss",
                   "hinge_embedding_loss", "margin_ranking_loss", "gaussian_nll_loss"}
_CLASS_LOSSES = {"cross_entropy", "nll_loss", "multi_margin_loss", "multilabel_margin_loss",
                 "multilabel_soft_margin_loss"}
_DIM_POS = {"norm": 2, "vector_norm": 2, "normalize": 2, "kthvalue": 2, "topk": 2}  # dim's position
_DIM_DEFAULT = {"normalize": 1, "sort": -1, "argsort": -1, "topk": -1, "gumbel_softmax": -1}


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _tensors(args: Any) -> list[Any]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _dims(d: Any) -> tuple[int, ...] | None:
    if d is None:
        return None
    if isinstance(d, int):
        return (d,)
    if isinstance(d, (list, tuple)) and all(isinstance(x, int) for x in d):
        return tuple(d)
    raise TypeError


def _elementwise(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    if not isinstance(res, torch.Tensor):
        return None
    base = _INPLACE_DUNDER.get(name, name) if name.startswith("__") else name.rstrip("_")
    ts = _tensors(list(args) + list(kwargs.values()))
    traced = [(t, dep(t)) for t in ts if dep(t) is not None]
    if not traced:
        return None
    if base in _COMPARE or base in _DATA_UNARY:
        return _data(combine([(d, tuple(t.shape)) for t, d in traced], tuple(res.shape), False, name))
    if len(traced) == 1 and (base in _LINEAR or base in _NONLINEAR) and len(ts) == 1:
        return unary(traced[0][1], base in _LINEAR, name)
    deps = []
    for i, (t, d) in enumerate(traced):
        nonlinear = (base in _NONLINEAR or base in _NONLINEAR_BINARY
                     or (base in _DIVISION and any(t is a for a in args[1:2]))
                     or (base in {"pow", "__pow__", "float_power"}))
        if base == "__rtruediv__" and i == 0 and t is args[0]:
            nonlinear = True
        deps.append((unary(d, not nonlinear, name), tuple(t.shape)))
    return combine(deps, tuple(res.shape), base in _ADDITIVE, name)


def _where(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    """``torch.where(cond, a, b)`` (``a.where(cond, b)``): each element is ``a``'s or ``b``'s, so the values
    combine as a sum does (a detached value of other samples only shifts); ``cond`` weighs, as a factor does."""
    ts = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    conds = [t for t in ts if t.dtype == torch.bool]
    if len(ts) != 3 or len(conds) != 1 or not isinstance(res, torch.Tensor):
        return None
    cond = conds[0]
    values = [t for t in ts if t is not cond]
    out = tuple(res.shape)
    traced = [(dep(t), tuple(t.shape)) for t in values if dep(t) is not None]
    picked = combine(traced, out, True, name) if traced else None
    if dep(cond) is None:
        return picked
    factors = [(dep(cond), tuple(cond.shape))] + ([(picked, out)] if picked is not None else [])
    return combine(factors, out, False, name)


def _data(d: Dep) -> Dep:
    return data(d)


def _reduce(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    x = args[0]
    d = dep(x)
    if d is None:
        return None
    base = name.rstrip("_")
    if base in {"max", "min"} and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return _elementwise("maximum", args, kwargs, res, dep)
    pos = _DIM_POS.get(base, 1)
    try:
        dims = _dims(_arg(args, kwargs, pos, "dim"))
    except TypeError:
        return None
    keepdim = bool(_arg(args, kwargs, pos + 1, "keepdim", False))
    if base in _DATA_REDUCE:
        return _data(reduce(d, x.dim(), dims, keepdim, True, name))
    r = reduce(d, x.dim(), dims, keepdim, base in _LINEAR_REDUCE, name)
    if base in {"std_mean", "var_mean"}:
        return (r, reduce(d, x.dim(), dims, keepdim, True, name))
    if isinstance(res, tuple):  # (values, indices)
        return (r, _data(r))
    return r


def _along(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    x = args[0]
    d = dep(x)
    if d is None:
        return None
    base = name.rstrip("_")
    dim = _arg(args, kwargs, _DIM_POS.get(base, 1), "dim", _DIM_DEFAULT.get(base))
    if not isinstance(dim, int):
        return None
    r = along(d, x.dim(), dim, name)
    if base == "argsort":
        return _data(r)
    if isinstance(res, tuple):
        return (r, _data(r))
    return r


def _constant(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> str:
    return CONST


def _reshape(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    d = dep(args[0])
    if d is None or not isinstance(res, torch.Tensor):
        return None
    return reshape(d, tuple(args[0].shape), tuple(res.shape))


def _permute(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    x = args[0]
    d = dep(x)
    if d is None or not isinstance(res, torch.Tensor):
        return None
    n = x.dim()
    perm = list(range(n))
    if name in {"transpose", "swapaxes", "swapdims", "transpose_"}:
        a, b = (_arg(args, kwargs, 1, "dim0"), _arg(args, kwargs, 2, "dim1"))
        a, b = a % n, b % n
        perm[a], perm[b] = perm[b], perm[a]
    elif name == "T":
        perm = perm[::-1]
    elif name in {"t", "mT", "adjoint", "mH", "H"}:
        if n >= 2:
            perm[-1], perm[-2] = perm[-2], perm[-1]
    elif name == "permute":
        p = args[1:] if len(args) > 2 or isinstance(_arg(args, kwargs, 1, "dims"), int) else _arg(args, kwargs, 1,
                                                                                                     "dims")
        perm = [int(v) % n for v in p]
    elif name == "movedim":
        src, dst = _dims(_arg(args, kwargs, 1, "source")), _dims(_arg(args, kwargs, 2, "destination"))
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


def _expand(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
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


def _getitem(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
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


def _select_like(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    x = args[0]
    d = dep(x)
    if d is None:
        return None
    if d.kind in (SEP, COUPLED, ONE):
        return tuple(d for _ in res) if isinstance(res, (tuple, list)) else d
    n = x.dim()
    if name in {"select", "unbind"}:
        dim = _arg(args, kwargs, 1, "dim", 0) % n
        if dim in d.dims:
            if d.kind != ROWS:
                return None
            m = d.maps[0]
            if name == "select":
                return Dep(ONE, d.grad, d.book, (), (one_from_row(m, _arg(args, kwargs, 2, "index") % x.shape[dim]),))
            return tuple(Dep(ONE, d.grad, d.book, (), (one_from_row(m, r),)) for r in range(len(res)))
        kept = tuple(k - (k > dim) for k in d.dims)
        r = Dep(d.kind, d.grad, d.book, kept, d.maps)
        return r if name == "select" else tuple(r for _ in res)
    if name in {"narrow"}:
        dim = _arg(args, kwargs, 1, "dim") % n
        start = _arg(args, kwargs, 2, "start")
        if dim in d.dims and d.kind == ROWS:
            length = _arg(args, kwargs, 3, "length")
            return Dep(ROWS, d.grad, d.book, d.dims, (narrow_map(d.maps[0], int(start), int(length)),))
        return d if dim not in d.dims else None
    if name in {"split", "chunk", "tensor_split", "split_with_sizes"}:
        dim = _arg(args, kwargs, 2, "dim", 0) % n
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
        dim = _arg(args, kwargs, 1, "dim") % n
        if dim not in d.dims:
            return d
        m = _rows_of(x, d, dim, _arg(args, kwargs, 2, "index")) if d.kind == ROWS else None
        return Dep(ROWS, d.grad, d.book, d.dims, (m,)) if m is not None else None
    if name in {"gather", "take_along_dim"}:
        dim = _arg(args, kwargs, 1 if name == "gather" else 2, "dim")
        index = _arg(args, kwargs, 2 if name == "gather" else 1, "index" if name == "gather" else "indices")
        if dim is None or not isinstance(index, torch.Tensor) or dep(index) is not None:
            return None
        dim %= n
        if dim in d.dims or index.dim() != n or any(index.shape[k] != x.shape[k] for k in d.dims):
            return None
        return d
    if name in {"diagonal", "diag"}:
        if name == "diag" and n != 2:
            return None
        off = _arg(args, kwargs, 1, "offset" if name == "diagonal" else "diagonal", 0)
        d1 = _arg(args, kwargs, 2, "dim1", 0) % n if name == "diagonal" else 0
        d2 = _arg(args, kwargs, 3, "dim2", 1) % n if name == "diagonal" else 1
        rest = [k for k in range(n) if k not in (d1, d2)]
        if d.kind == PAIRS and set(d.dims) == {d1, d2} and off == 0 and d.maps[0] == d.maps[1]:
            return Dep(ROWS, d.grad, d.book, (res.dim() - 1,), (d.maps[0],))
        if d.kind == ROWS and d.dims[0] in (d1, d2) and off == 0:
            return Dep(ROWS, d.grad, d.book, (res.dim() - 1,), d.maps)
        if d.kind == ROWS and d.dims[0] in rest:
            return Dep(ROWS, d.grad, d.book, (rest.index(d.dims[0]),), d.maps)
        return None
    return None


def _concat(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    ts = list(_arg(args, kwargs, 0, "tensors"))
    dim = _arg(args, kwargs, 1, "dim", 0)
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


def _matmul(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    if name == "einsum":
        eq = args[0].replace(" ", "")
        ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
        if "..." in eq or "->" not in eq:
            return None
        lhs, out = eq.split("->")
        specs = lhs.split(",")
    else:
        if name == "__rmatmul__":
            a, b = args[1], args[0]
        elif name == "linear":
            a, b = args[0], _arg(args, kwargs, 1, "weight")
        else:
            a, b = args[0], args[1]
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            return None
        if a.dim() > 8 or b.dim() > 8:
            return None
        if name == "linear":
            bias = _arg(args, kwargs, 2, "bias")
            if isinstance(bias, torch.Tensor) and dep(bias) is not None or b.dim() > 2:
                return None
            sa, sb, out = _lead(a.dim() - 1) + "k", "nk"[2 - b.dim():], _lead(a.dim() - 1) + "n"[:b.dim() - 1]
        elif name in {"outer", "ger"}:
            sa, sb, out = "i", "j", "ij"
        elif a.dim() == 1 and b.dim() == 1:
            sa, sb, out = "k", "k", ""
        elif name in {"inner", "dot", "vdot"}:
            return None
        elif b.dim() == 1:
            sa, sb, out = _lead(a.dim() - 1) + "k", "k", _lead(a.dim() - 1)
        elif a.dim() == 1:
            sa, sb, out = "k", _lead(b.dim() - 2) + "kj", _lead(b.dim() - 2) + "j"
        else:
            n = max(a.dim(), b.dim()) - 2
            lead = _lead(n)
            sa = lead[n - (a.dim() - 2):] + "ik"
            sb = lead[n - (b.dim() - 2):] + "kj"
            out = lead + "ij"
        ops, specs = [a, b], [sa, sb]
    if len(ops) != len(specs) or any(not isinstance(t, torch.Tensor) or t.dim() != len(s)
                                     for t, s in zip(ops, specs, strict=True)):
        return None
    return contract([(dep(t), s) for t, s in zip(ops, specs, strict=True)], out, name,
                    [tuple(t.shape) for t in ops])


def _lead(n: int) -> str:
    """Letters for ``n`` leading dimensions of a product (none of ``i j k n``)."""
    return "abcdefgh"[:n]


def _class_loss(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    x, target = args[0], _arg(args, kwargs, 1, "target")
    d = dep(x)
    if d is None:
        return None
    reduction = _arg(args, kwargs, 99, "reduction", "mean")
    weight = _arg(args, kwargs, 2, "weight")
    if isinstance(weight, torch.Tensor) and dep(weight) is not None:
        return None
    n = x.dim()
    cls = 1 if n >= 2 else 0
    r = along(d, n, cls, name)  # the classes of a row: normalised across them
    t = dep(target) if isinstance(target, torch.Tensor) else None
    if t is not None and target.shape == x.shape:  # soft targets, one per class
        r = combine([(r, tuple(x.shape)), (unary(t, False, name), tuple(target.shape))], tuple(x.shape), False,
                    name)
        t = None
    rows = reduce(r, n, (cls,), False, True, name)
    if t is not None:
        if target.dim() != n - 1 or rows.kind == COUPLED:
            return rows if rows.kind == COUPLED else None
        row_shape = tuple(x.shape[:cls]) + tuple(x.shape[cls + 1:])
        rows = combine([(rows, row_shape), (t, tuple(target.shape))], row_shape, False, name)
    return rows if reduction == "none" else reduce(rows, max(n - 1, 0), None, False, True, name)


def _element_loss(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    ts = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    traced = [(dep(t), tuple(t.shape)) for t in ts if dep(t) is not None]
    if not traced:
        return None
    out = tuple(torch.broadcast_shapes(*[t.shape for t in ts]))
    n = len(out)
    r = combine([(unary(d, False, name), k) for d, k in traced], out, False, name)
    reduction = kwargs.get("reduction", "mean")
    if reduction == "none":
        return r
    return reduce(r, n, None, False, True, name)


def _pair_fn(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    """cosine_similarity, pairwise_distance, cosine_embedding_loss, triplet_margin_loss, cdist."""
    ts = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    traced = [(dep(t), tuple(t.shape)) for t in ts if dep(t) is not None]
    if not traced:
        return None
    if name == "cdist":
        a, b = args[0], args[1]
        if a.dim() != 2 or b.dim() != 2:
            return None
        return contract([(unary(dep(a), False, name) if dep(a) else None, "ik"),
                         (unary(dep(b), False, name) if dep(b) else None, "jk")], "ij", name,
                        [tuple(a.shape), tuple(b.shape)])
    out = tuple(torch.broadcast_shapes(*[t.shape for t in ts]))
    n = len(out)
    r = combine([(unary(d, False, name), k) for d, k in traced], out, False, name)
    if name == "cosine_similarity":
        dim = _arg(args, kwargs, 2, "dim", 1)
        return reduce(r, n, (dim,), False, False, name)
    if name == "pairwise_distance":
        return reduce(r, n, (-1,), bool(kwargs.get("keepdim", False)), False, name)
    r = reduce(r, n, (-1,) if n >= 2 else None, False, False, name)
    reduction = kwargs.get("reduction", "mean")
    return r if reduction == "none" else reduce(r, max(n - 1, 0), None, False, True, name)


def _pad(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    x = args[0]
    d = dep(x)
    pad = _arg(args, kwargs, 1, "pad")
    if d is None or not isinstance(pad, (list, tuple)):
        return None
    first = x.dim() - len(pad) // 2
    if d.kind in (ROWS, PAIRS) and any(k >= first for k in d.dims):
        return None
    return d


def _masking(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    """tril, triu, flip/roll off the sample dimensions: a fixed pattern of elements."""
    d = dep(args[0])
    if d is None:
        return None
    if name in {"flip", "roll"}:
        dims = _arg(args, kwargs, 1 if name == "flip" else 2, "dims")
        dims = _dims(dims) if dims is not None else None
        if dims is None or any(k % args[0].dim() in d.dims for k in dims):
            return None
    return d


RULES: dict[str, Rule] = {}
for _names, _rule in (
        (_LINEAR | _NONLINEAR | _DATA_UNARY | _ADDITIVE | _MULTIPLICATIVE | _DIVISION | _NONLINEAR_BINARY | _COMPARE,
         _elementwise),
        (_LINEAR_REDUCE | _NONLINEAR_REDUCE | _DATA_REDUCE | {"std_mean", "var_mean", "kthvalue", "mode"}, _reduce),
        (_ALONG | {"sort", "topk"}, _along),
        ({"view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze", "ravel",
          "squeeze_", "unsqueeze_"}, _reshape),
        ({"transpose", "swapaxes", "swapdims", "t", "T", "mT", "adjoint", "permute", "movedim", "transpose_"},
         _permute),
        ({"expand", "expand_as", "broadcast_to"}, _expand),
        ({"__getitem__"}, _getitem),
        ({"select", "unbind", "narrow", "split", "chunk", "tensor_split", "split_with_sizes", "index_select",
          "gather", "take_along_dim", "diagonal", "diag"}, _select_like),
        ({"cat", "concat", "concatenate", "stack"}, _concat),
        (_MATMUL, _matmul),
        (_CLASS_LOSSES, _class_loss),
        (_ELEMENT_LOSSES, _element_loss),
        ({"cosine_similarity", "pairwise_distance", "cosine_embedding_loss", "triplet_margin_loss", "cdist"},
         _pair_fn),
        ({"pad"}, _pad),
        ({"where"}, _where),
        (_CONSTANT, _constant),
        ({"tril", "triu", "flip", "roll", "fill_diagonal_"}, _masking),
):
    for _n in _names:
        RULES[_n] = _rule
        if not _n.startswith("__"):
            RULES.setdefault(_n + "_", _rule)
#: torch.linalg.* and torch.special.* report prefixed names: the name their rule knows them by
ALIASES = {"linalg_vector_norm": "vector_norm", "linalg_norm": "norm", "special_xlogy": "xlogy",
           "special_expit": "sigmoid", "special_logsumexp": "logsumexp", "special_logit": "logit",
           "special_log_softmax": "log_softmax", "special_softmax": "softmax", "special_erf": "erf",
           "special_log1p": "log1p", "special_expm1": "expm1", "special_exp2": "exp2"}
