"""Per torch function: how its result depends on the samples, given how its traced arguments do.

The table of the loss trace (:mod:`fastdp.loss_trace`), keyed by the function's name (``torch.add``,
``Tensor.add``, ``Tensor.__add__`` and ``add_`` share one rule). Each rule receives the arguments, the result and
``dep(x)`` (the :class:`fastdp.loss_deps.Dep` of a traced tensor, ``None`` for anything else) and returns the
result's ``Dep``, a tuple of them for a tuple result, or ``None`` where it cannot follow the samples (the result is
then untraced and the pass unverified: never a refusal). The algebra itself is :mod:`fastdp.loss_deps`; the rules
of the functions that move, select or combine rows are in :mod:`fastdp.loss_trace_shapes`; this module has the
elementwise functions, reductions, products and losses, and the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastdp.layers.row_functions import tensors_of
from fastdp.loss_deps import (
    CONST,
    COUPLED,
    ONE,
    PAIRS,
    ROWS,
    SEP,
    Dep,
    along,
    combine,
    contract,
    coupled,
    data,
    reduce,
    single_sample,
    unary,
)
from fastdp.loss_trace_mixing import (
    CONV,
    MATRIX,
    SCATTER,
    VALIDATION,
    rule_broadcast_tensors,
    rule_conv,
    rule_ctc,
    rule_diag_embed,
    rule_linear_along,
    rule_matrix,
    rule_multinomial,
    rule_repeat_interleave,
    rule_scatter,
    rule_sum_to_size,
    rule_trapezoid,
    rule_unfold,
    rule_validation,
)
from fastdp.loss_trace_products import (
    ADD_PRODUCTS,
    MATMUL,
    rule_add_product,
    rule_bilinear,
    rule_matmul,
    rule_tensordot,
)
from fastdp.loss_trace_shapes import (
    arg,
    dims_arg,
    rule_concat,
    rule_expand,
    rule_getitem,
    rule_masked_select,
    rule_masking,
    rule_pad,
    rule_permute,
    rule_repeat,
    rule_reshape,
    rule_select,
)

DepOf = Callable[[Any], Dep | None]
Rule = Callable[[str, tuple[Any, ...], dict[str, Any], Any, DepOf], Any]

_LINEAR = {"neg", "negative", "positive", "clone", "contiguous", "to", "float", "double", "half", "bfloat16", "type",
           "type_as", "cpu", "cuda", "requires_grad_", "conj", "resolve_conj", "resolve_neg", "__neg__", "__pos__",
           "real"}
_NONLINEAR = {"exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sigmoid", "tanh", "relu", "relu6", "abs",
              "absolute", "sqrt", "rsqrt", "square", "reciprocal", "sin", "cos", "sinh", "cosh", "atan", "asin",
              "acos", "erf", "erfc", "erfinv", "clamp", "clip", "clamp_min", "clamp_max", "nan_to_num", "lgamma",
              "digamma", "logit", "softplus", "gelu", "silu", "mish", "elu", "selu", "celu", "leaky_relu",
              "hardtanh", "logsigmoid", "hardsigmoid", "hardswish", "tanhshrink", "softsign", "dropout",
              "threshold", "__abs__", "sigmoid_", "pow", "__pow__", "float_power", "frac", "entr"}
_DATA_UNARY = {"sign", "sgn", "floor", "ceil", "round", "trunc", "isnan", "isinf", "isfinite", "isposinf",
               "isneginf", "signbit", "logical_not", "__invert__", "bool", "long", "int", "short", "byte", "char",
               "detach", "data", "bernoulli"}
_CONSTANT = {"zeros_like", "ones_like", "empty_like", "rand_like", "randn_like", "randint_like", "new_zeros",
             "new_ones", "new_empty", "size", "dim", "numel"}
_INPLACE_DUNDER = {"__iadd__": "__add__", "__isub__": "__sub__", "__imul__": "__mul__", "__itruediv__": "__truediv__"}
_ADDITIVE = {"add", "sub", "subtract", "rsub", "__add__", "__radd__", "__sub__", "__rsub__", "__iadd__", "__isub__"}
_MULTIPLICATIVE = {"mul", "multiply", "__mul__", "__rmul__", "__imul__", "addcmul", "lerp"}
_DIVISION = {"div", "divide", "true_divide", "__truediv__", "__itruediv__"}  # nonlinear in the divisor
_NONLINEAR_BINARY = {"__rtruediv__", "__rpow__", "maximum", "minimum", "fmax", "fmin", "atan2", "xlogy", "hypot",
                     "logaddexp",
                     "copysign", "fmod", "remainder", "__mod__", "floor_divide", "__floordiv__", "__rfloordiv__",
                     "addcdiv"}
_COMPARE = {"eq", "ne", "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
            "logical_and", "logical_or", "logical_xor", "__and__", "__or__", "__xor__", "isclose", "greater",
            "less", "greater_equal", "less_equal", "not_equal", "equal_", "heaviside"}
_LINEAR_REDUCE = {"sum", "mean", "nansum", "nanmean"}
_NONLINEAR_REDUCE = {"logsumexp", "amax", "amin", "std", "var", "prod", "norm", "vector_norm", "nanmedian",
                     "median", "max", "min"}
_DATA_REDUCE = {"all", "any", "count_nonzero", "argmax", "argmin"}
_ALONG = {"softmax", "log_softmax", "cumprod", "logcumsumexp", "normalize", "argsort", "gumbel_softmax",
          "softmin"}
_ELEMENT_LOSSES = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
                   "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss", "soft_margin_loss",
                   "hinge_embedding_loss", "margin_ranking_loss", "gaussian_nll_loss"}
_CLASS_LOSSES = {"cross_entropy", "nll_loss", "multi_margin_loss", "multilabel_margin_loss",
                 "multilabel_soft_margin_loss"}
_DIM_POS = {"norm": 2, "vector_norm": 2, "normalize": 2, "kthvalue": 2, "topk": 2}  # dim's position
_DIM_DEFAULT = {"normalize": 1, "sort": -1, "argsort": -1, "topk": -1, "gumbel_softmax": -1, "kthvalue": -1,
                "mode": -1, "softmin": None}


def _elementwise(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    if not isinstance(res, torch.Tensor):
        return None
    base = _INPLACE_DUNDER.get(name, name) if name.startswith("__") else name.rstrip("_")
    ts = tensors_of(list(args) + list(kwargs.values()))
    traced = [(t, dep(t)) for t in ts if dep(t) is not None]
    if not traced:
        return None
    if base in _COMPARE or base in _DATA_UNARY:
        return data(combine([(d, tuple(t.shape)) for t, d in traced], tuple(res.shape), False, name))
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
    """``torch.where(cond, a, b)`` (``a.where(cond, b)``, ``a.masked_fill(cond, b)``): each element is ``a``'s or
    ``b``'s, so the values combine as a sum does (a detached value of other samples only shifts); ``cond`` weighs, as
    a factor does."""
    ts = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    conds = [t for t in ts if t.dtype == torch.bool]
    if len(ts) < 2 or len(conds) != 1 or not isinstance(res, torch.Tensor):  # torch.where(cond, x, 0.0) too
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


def _reduce(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    x = args[0]
    d = dep(x)
    if d is None:
        return None
    base = name.rstrip("_")
    if base in {"max", "min"} and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return _elementwise("maximum", args, kwargs, res, dep)
    pos = _DIM_POS.get(base, 1)
    variance = base in {"std", "var", "std_mean", "var_mean"}
    if variance and len(args) > 1 and isinstance(args[1], bool):  # x.var(unbiased): over every dimension
        args = (args[0],)
    try:
        dims = dims_arg(arg(args, kwargs, pos, "dim", _DIM_DEFAULT.get(base)))
    except TypeError:
        return None
    # std/var(x, dim, unbiased, keepdim): a positional bool after dim is `unbiased`
    kpos = pos + 2 if variance and len(args) > pos + 1 and isinstance(args[pos + 1], bool) else pos + 1
    keepdim = bool(arg(args, kwargs, kpos, "keepdim", False))
    if base in _DATA_REDUCE:
        return data(reduce(d, x.dim(), dims, keepdim, True, name))
    r = reduce(d, x.dim(), dims, keepdim, base in _LINEAR_REDUCE, name)
    if base in {"std_mean", "var_mean"}:
        return (r, reduce(d, x.dim(), dims, keepdim, True, name))
    if base == "aminmax":  # (min, max)
        return (r, r)
    if isinstance(res, tuple):  # (values, indices)
        return (r, data(r))
    return r


def _along(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    x = args[0]
    d = dep(x)
    if d is None:
        return None
    base = name.rstrip("_")
    dim = arg(args, kwargs, _DIM_POS.get(base, 1), "dim", _DIM_DEFAULT.get(base))
    if not isinstance(dim, int):
        return None
    r = along(d, x.dim(), dim, name)
    if base == "argsort":
        return data(r)
    if isinstance(res, tuple):
        return (r, data(r))
    return r


def _constant(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> str:
    return CONST


def _one_hot(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """``F.one_hot(x)``: data, one more (trailing) dimension; the sample dimensions stay."""
    d = dep(args[0])
    return None if d is None else data(d)


def _normalised(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """``F.layer_norm(x, shape)`` normalises over the last ``len(shape)`` dimensions, ``F.group_norm(x, groups)``
    over each sample's dimensions 1.. (dimension 0 is the batch): over a sample dimension, samples are combined."""
    x = args[0]
    d = dep(x)
    if d is None or any(dep(t) is not None for t in list(args[1:]) + list(kwargs.values())
                        if isinstance(t, torch.Tensor)):
        return None
    if name == "layer_norm":
        k = len(arg(args, kwargs, 1, "normalized_shape"))
        dims = tuple(range(x.dim() - k, x.dim()))
    else:
        dims = tuple(range(1, x.dim()))
    if d.kind in (ROWS, PAIRS) and any(k in d.dims for k in dims):
        return coupled(d.book, d.grad, f"{name} over the samples (the batch dimension)", d)
    return unary(d, False, name)


def _full(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """``full_like(x, v)`` / ``x.new_full(size, v)``: constant, unless the fill value ``v`` is a traced scalar (its
    value everywhere: data)."""
    fill = arg(args, kwargs, 2 if name == "new_full" else 1, "fill_value")
    d = dep(fill)
    if d is None:
        return CONST
    return data(d) if d.kind in (ONE, SEP, COUPLED) else None


def _class_loss(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    x, target = args[0], arg(args, kwargs, 1, "target")
    d = dep(x)
    if d is None:
        return None
    reduction = arg(args, kwargs, 99, "reduction", "mean")
    weight = arg(args, kwargs, 2, "weight")
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
    if reduction == "mean" and _weighted_mean_of_samples(args, kwargs, rows, x, cls):
        return coupled(d.book, d.grad, f"{name} with class weights and reduction='mean', which divides by the sum of "
                                       "the weights of every sample's labels (a divisor from the other samples' "
                                       "labels; use reduction='none', then a sum divided by a constant)", d)
    return rows if reduction == "none" else reduce(rows, max(n - 1, 0), None, False, True, name)


def _weighted_mean_of_samples(args: tuple[Any, ...], kwargs: dict[str, Any], rows: Dep, x: torch.Tensor,
                              cls: int) -> bool:
    """Whether a class-weighted ``reduction="mean"`` divides rows of several samples by ``Σ_r w[y_r]``, a sum over
    their labels (unequal weights at the labels: with equal ones it is a constant times the row count)."""
    weight, target = arg(args, kwargs, 2, "weight"), arg(args, kwargs, 1, "target")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(target, torch.Tensor) \
            or target.is_floating_point() or rows.kind not in (ROWS, PAIRS):
        return False
    row_shape = tuple(x.shape[:cls]) + tuple(x.shape[cls + 1:])
    if rows.kind == ROWS and single_sample(rows.maps[0], row_shape[rows.dims[0]]):
        return False  # one sample's rows: the divisor is its own labels'

    labels = target.reshape(-1)
    labels = labels[(labels != arg(args, kwargs, 4, "ignore_index", -100)) & (labels >= 0)
                    & (labels < weight.numel())]
    w = weight.detach().to(torch.float64)[labels]
    return bool(w.numel()) and bool((w != w[0]).any())


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
    if name == "cdist":  # (..., P, M) and (..., R, M) -> (..., P, R)
        a, b = args[0], args[1]
        if a.dim() != b.dim() or not 2 <= a.dim() <= 6:
            return None
        lead = "abcd"[:a.dim() - 2]
        return contract([(unary(dep(a), False, name) if dep(a) else None, lead + "ik"),
                         (unary(dep(b), False, name) if dep(b) else None, lead + "jk")], lead + "ij", name,
                        [tuple(a.shape), tuple(b.shape)])
    if name in {"cosine_embedding_loss", "triplet_margin_loss"}:  # per pair first: (B, D) -> (B,), then a target
        pairs = [(t, dep(t)) for t in ts if t.dim() >= 2]
        target = [(t, dep(t)) for t in ts if t.dim() < 2 and dep(t) is not None]
        if not pairs:
            return None
        out = tuple(torch.broadcast_shapes(*[t.shape for t, _ in pairs]))
        r = combine([(unary(d, False, name), tuple(t.shape)) for t, d in pairs if d is not None], out, False, name)
        r = reduce(r, len(out), (-1,), False, False, name)
        if target:
            r = combine([(r, out[:-1])] + [(d, tuple(t.shape)) for t, d in target], out[:-1], False, name)
        reduction = kwargs.get("reduction", "mean")
        return r if reduction == "none" else reduce(r, len(out) - 1, None, False, True, name)
    out = tuple(torch.broadcast_shapes(*[t.shape for t in ts]))
    n = len(out)
    r = combine([(unary(d, False, name), k) for d, k in traced], out, False, name)
    if name == "cosine_similarity":
        dim = arg(args, kwargs, 2, "dim", 1)
        return reduce(r, n, (dim,), False, False, name)
    if name == "pairwise_distance":
        return reduce(r, n, (-1,), bool(kwargs.get("keepdim", False)), False, name)
    return None


RULES: dict[str, Rule] = {}
for _names, _rule in (
        (_LINEAR | _NONLINEAR | _DATA_UNARY | _ADDITIVE | _MULTIPLICATIVE | _DIVISION | _NONLINEAR_BINARY | _COMPARE,
         _elementwise),
        (_LINEAR_REDUCE | _NONLINEAR_REDUCE | _DATA_REDUCE | {"std_mean", "var_mean", "kthvalue", "mode", "aminmax"},
         _reduce),
        (_ALONG | {"sort", "topk"}, _along),
        ({"view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze", "ravel",
          "squeeze_", "unsqueeze_"}, rule_reshape),
        ({"transpose", "swapaxes", "swapdims", "t", "T", "mT", "adjoint", "permute", "movedim", "transpose_"},
         rule_permute),
        ({"expand", "expand_as", "broadcast_to"}, rule_expand),
        ({"__getitem__"}, rule_getitem),
        ({"select", "unbind", "narrow", "split", "chunk", "tensor_split", "split_with_sizes", "index_select",
          "gather", "take_along_dim", "diagonal", "diag"}, rule_select),
        ({"cat", "concat", "concatenate", "stack"}, rule_concat),
        (MATMUL, rule_matmul),
        (ADD_PRODUCTS, rule_add_product),
        ({"tensordot"}, rule_tensordot),
        ({"bilinear"}, rule_bilinear),
        (_CLASS_LOSSES, _class_loss),
        (_ELEMENT_LOSSES, _element_loss),
        ({"cosine_similarity", "pairwise_distance", "cosine_embedding_loss", "triplet_margin_loss", "cdist"},
         _pair_fn),
        ({"pad"}, rule_pad),
        ({"where", "masked_fill"}, _where),
        (_CONSTANT, _constant),
        ({"full_like", "new_full"}, _full),
        ({"one_hot"}, _one_hot),
        ({"masked_select"}, rule_masked_select),
        ({"repeat"}, rule_repeat),
        ({"layer_norm", "group_norm"}, _normalised),
        ({"tril", "triu", "flip", "roll", "fill_diagonal_"}, rule_masking),
        ({"cumsum", "diff"}, rule_linear_along),
        (CONV, rule_conv),
        ({"unfold"}, rule_unfold),
        (SCATTER, rule_scatter),
        ({"repeat_interleave"}, rule_repeat_interleave),
        ({"sum_to_size"}, rule_sum_to_size),
        ({"ctc_loss"}, rule_ctc),
        ({"multinomial"}, rule_multinomial),
        ({"broadcast_tensors"}, rule_broadcast_tensors),
        (VALIDATION, rule_validation),
        (MATRIX, rule_matrix),
        ({"diag_embed"}, rule_diag_embed),
        ({"trapezoid", "trapz", "cumulative_trapezoid"}, rule_trapezoid),
):
    for _n in _names:
        RULES[_n] = _rule
        if not _n.startswith("__"):
            RULES.setdefault(_n + "_", _rule)
#: torch.linalg.* and torch.special.* report prefixed names: the name their rule knows them by
ALIASES = {"linalg_vector_norm": "vector_norm", "linalg_norm": "norm", "special_xlogy": "xlogy",
           "special_expit": "sigmoid", "special_logsumexp": "logsumexp", "special_logit": "logit",
           "special_log_softmax": "log_softmax", "special_softmax": "softmax", "special_erf": "erf",
           "special_log1p": "log1p", "special_expm1": "expm1", "special_exp2": "exp2", "special_entr": "entr",
           "log_sigmoid": "logsigmoid"}
