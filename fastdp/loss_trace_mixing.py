"""Loss-trace rules for functions that mix the elements of a sample along its own dimensions: ``diff`` and
``cumsum`` (linear along a dimension, also along the batch), convolutions and pooling, ``unfold``, scatters and
index additions, ``repeat_interleave``, ``sum_to_size``, ``ctc_loss``, ``multinomial``, ``broadcast_tensors``.

Part of the loss trace's table (:mod:`fastdp.loss_trace_rules` registers them; the algebra is
:mod:`fastdp.loss_deps`). A function that combines elements along dimensions that hold no samples keeps each row
one sample's; a *linear* one along the batch dimension gives a sum of one-sample terms (``SEP``); a nonlinear one
across samples is left unverified (``None``) rather than called coupled, since the rules do not prove it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastdp.loss_deps import (
    CONST,
    COUPLED,
    ONE,
    PAIRS,
    ROWS,
    SEP,
    Dep,
    along_linear,
    combine,
    data,
    reduce,
    same_map,
    take_map,
    unary,
)
from fastdp.loss_trace_shapes import arg, rule_concat, rule_expand

DepOf = Callable[[Any], Dep | None]

CONV = {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "avg_pool1d",
        "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices",
        "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
        "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
        "adaptive_max_pool1d_with_indices", "adaptive_max_pool2d_with_indices", "adaptive_max_pool3d_with_indices",
        "lp_pool1d", "lp_pool2d", "lp_pool3d", "interpolate", "pixel_shuffle", "pixel_unshuffle"}
#: fixed linear combinations of the input's elements (interpolate: in every mode)
_LINEAR_CONV = {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
                "adaptive_avg_pool3d", "pixel_shuffle", "pixel_unshuffle", "interpolate"}
SCATTER = {"scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy", "index_fill", "index_reduce"}
VALIDATION = {"_is_all_true", "_is_any_true"}
#: functions of each matrix of a batch (..., n, m) (and, for solves, of a right-hand side (..., n[, k]))
MATRIX = {"det", "linalg_det", "logdet", "slogdet", "linalg_slogdet", "inverse", "linalg_inv", "linalg_inv_ex",
          "cholesky", "linalg_cholesky", "linalg_cholesky_ex", "linalg_solve", "linalg_solve_ex",
          "linalg_solve_triangular", "cholesky_solve", "triangular_solve", "linalg_matrix_exp", "matrix_exp",
          "linalg_eigh", "linalg_eigvalsh", "linalg_svd", "linalg_svdvals", "svd", "linalg_matrix_norm",
          "linalg_qr", "qr", "linalg_matrix_power", "matrix_power", "linalg_lstsq", "pinverse", "linalg_pinv",
          "linalg_matrix_rank", "trace"}


def _mixed(d: Dep, dims: tuple[int, ...]) -> bool:
    """Whether one of ``dims`` holds samples."""
    return d.kind in (ROWS, PAIRS) and any(k in d.dims for k in dims)


def rule_linear_along(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """``x.cumsum(dim)``, ``x.diff(n, dim, prepend, append)``: fixed linear combinations along ``dim`` (over the
    batch: a sum of one-sample terms); ``diff``'s ``prepend``/``append`` are concatenated first."""
    x = args[0]
    d = dep(x)
    if name.rstrip("_") == "cumsum":
        dim = arg(args, kwargs, 1, "dim")
    else:
        dim = arg(args, kwargs, 2, "dim", -1)
        if arg(args, kwargs, 1, "n", 1) == 0:
            return d  # the input itself
        extra = [arg(args, kwargs, 3, "prepend"), arg(args, kwargs, 4, "append")]
        if any(isinstance(t, torch.Tensor) and dep(t) is not None for t in extra):
            parts = [t for t in (extra[0], x, extra[1]) if isinstance(t, torch.Tensor)]
            if any(t.dim() != x.dim() for t in parts):
                return None
            d = rule_concat("cat", (parts, dim), {}, torch.cat(parts, dim), dep)
    if d is None or not isinstance(dim, int):
        return None
    return along_linear(d, x.dim(), (dim,), name)


def rule_trapezoid(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """``torch.trapezoid(y, x=None, dx=, dim=-1)`` (and ``trapz``): a fixed linear reduction along ``dim`` (``x``
    untraced); ``cumulative_trapezoid``: a fixed linear function along it."""
    y = args[0]
    d = dep(y)
    if d is None or any(dep(t) is not None for t in list(args[1:]) + list(kwargs.values())
                        if isinstance(t, torch.Tensor)):
        return None
    dim = kwargs.get("dim", args[2] if len(args) > 2 and isinstance(args[2], int) else -1)
    if not isinstance(dim, int):
        return None
    if name.startswith("cumulative"):
        return along_linear(d, y.dim(), (dim,), name)
    return reduce(d, y.dim(), (dim,), False, True, name)


def rule_conv(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """Convolutions, pooling, ``interpolate``, pixel shuffles of a batched input ``(N, C, *spatial)``: each output
    row ``n`` is a function of input row ``n`` (a fixed linear one for convolutions and averages). A traced weight
    or bias, an unbatched input, or samples along another dimension: not followed."""
    x = args[0]
    d = dep(x)
    if d is None or not isinstance(res, (torch.Tensor, tuple)):
        return None
    if any(dep(t) is not None for t in list(args[1:]) + list(kwargs.values()) if isinstance(t, torch.Tensor)):
        return None
    base = name.removesuffix("_with_indices")
    spatial = int(base[-2]) if base[-2:-1].isdigit() and base.endswith("d") else 2 if "pixel" in base else None
    if spatial is not None and x.dim() != spatial + 2:
        return None  # unbatched: the rows are channels
    if _mixed(d, tuple(range(1, x.dim()))):
        return None
    r = unary(d, base in _LINEAR_CONV, name)
    return (r, data(r)) if isinstance(res, tuple) else r


def rule_unfold(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """``x.unfold(dim, size, step)`` (windows along ``dim``, one more trailing dimension) and ``F.unfold(x, k)``
    (``(N, C, H, W) -> (N, C k k, L)``: within each row ``n``)."""
    x = args[0]
    d = dep(x)
    if d is None or not isinstance(res, torch.Tensor):
        return None
    if res.dim() == x.dim() + 1:  # Tensor.unfold(dimension, size, step)
        dim = arg(args, kwargs, 1, "dimension")
        return None if not isinstance(dim, int) or _mixed(d, (dim % x.dim(),)) else d
    if x.dim() != 4 or _mixed(d, (1, 2, 3)):
        return None
    return d


def rule_scatter(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """``x.scatter_add(dim, index, src)``, ``x.index_add(dim, index, source)`` and kin: ``src``'s elements are
    placed (added, or reduced) at positions along ``dim``; along every other dimension position stays position.
    The index must be untraced. Constants written into ``x`` (an untraced ``src``, a fill value) keep ``x``'s rows,
    whatever the dimension; traced values written along a dimension of samples are not followed."""
    x = args[0]
    base = name.rstrip("_")
    dim = arg(args, kwargs, 1, "dim")
    index = arg(args, kwargs, 2, "index")
    src = arg(args, kwargs, 3, "src" if base.startswith("scatter") else ("value" if base == "index_fill"
                                                                         else "source"))
    if src is None:
        src = kwargs.get("value")
    if not isinstance(res, torch.Tensor) or not isinstance(dim, int) or not isinstance(index, torch.Tensor) \
            or dep(index) is not None:
        return None
    how = arg(args, kwargs, 4, "reduce", "sum")
    linear = base in {"scatter", "scatter_add", "index_add", "index_copy", "index_fill"} or how in {"sum", "add",
                                                                                                     "mean"}
    dx = dep(x)
    ds = dep(src) if isinstance(src, torch.Tensor) else None
    dim %= x.dim()
    if ds is None:  # constants written into x
        return None if dx is None else unary(dx, linear, name)
    if src.dim() != x.dim() or _mixed(ds, (dim,)) or (dx is not None and _mixed(dx, (dim,))):
        return None
    if ds.kind in (ROWS, PAIRS) and any(src.shape[k] != x.shape[k] for k in ds.dims):
        return None
    terms = [(unary(ds, linear, name), tuple(res.shape))]
    if dx is not None:
        terms.append((unary(dx, linear, name), tuple(res.shape)))
    return combine(terms, tuple(res.shape), linear, name)


def rule_repeat_interleave(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """``x.repeat_interleave(repeats, dim)``: along a dimension of samples, each row repeated in place (the row map
    follows); without ``dim`` the tensor is flattened first."""
    x = args[0]
    d = dep(x)
    repeats, dim = arg(args, kwargs, 1, "repeats"), arg(args, kwargs, 2, "dim")
    if d is None or not isinstance(res, torch.Tensor) or (isinstance(repeats, torch.Tensor) and dep(repeats)):
        return None
    if d.kind in (SEP, COUPLED, ONE):
        return d
    if dim is None:
        return None
    dim %= x.dim()
    if not _mixed(d, (dim,)):
        return d
    if d.kind != ROWS:
        return None
    n = x.shape[dim]
    counts = repeats.tolist() if isinstance(repeats, torch.Tensor) and repeats.dim() else [int(repeats)] * n
    if len(counts) == 1:
        counts = counts * n
    m = take_map(d.maps[0], [r for r in range(n) for _ in range(int(counts[r]))], n)
    return None if m is None else Dep(ROWS, d.grad, d.book, d.dims, (m,))


def rule_sum_to_size(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """``x.sum_to_size(*size)``: sums over the leading dimensions ``size`` lacks and, keeping them, over those it
    has as 1."""
    x = args[0]
    d = dep(x)
    if d is None or not isinstance(res, torch.Tensor):
        return None
    lead = x.dim() - res.dim()
    ones = tuple(k for k in range(lead, x.dim()) if res.shape[k - lead] == 1 and x.shape[k] != 1)
    r = reduce(d, x.dim(), ones, True, True, name) if ones else d
    return reduce(r, x.dim(), tuple(range(lead)), False, True, name) if lead else r


def rule_ctc(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """``F.ctc_loss(log_probs (T, N, C), targets, input_lengths, target_lengths, ...)``: sample ``n``'s loss from
    column ``n`` (the batch is dimension 1) and its own targets and lengths; ``"mean"`` divides each by its target
    length (data) and averages, ``"sum"`` adds."""
    x = args[0]
    d = dep(x)
    if d is None or any(dep(t) is not None for t in list(args[1:]) + list(kwargs.values())
                        if isinstance(t, torch.Tensor)):
        return None
    if x.dim() != 3:
        return None
    per_sample = reduce(d, 3, (0, 2), False, False, name)  # (N,): nonlinear within each column
    if arg(args, kwargs, 5, "reduction", "mean") in ("none", 0):  # torch.ctc_loss takes the reduction as an int
        return per_sample
    return reduce(per_sample, 1, None, False, True, name)


def rule_multinomial(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """``torch.multinomial(p (N, C), k)``: indices drawn from each row's own distribution (data)."""
    x = args[0]
    d = dep(x)
    if d is None or x.dim() != 2 or _mixed(d, (1,)):
        return None
    return data(d)


def rule_broadcast_tensors(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """``torch.broadcast_tensors(*ts)``: each result is its operand expanded (``expand``'s rule)."""
    ts = list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else list(args)
    if not isinstance(res, (tuple, list)) or len(res) != len(ts):
        return None
    out = []
    for t, r in zip(ts, res, strict=True):
        if not isinstance(t, torch.Tensor) or dep(t) is None:
            out.append(CONST)
            continue
        e = rule_expand("expand", (t, tuple(r.shape)), {}, r, dep)
        if e is None:
            return None
        out.append(e)
    return tuple(out)


def rule_validation(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """``torch._is_all_true(x)``: torch's argument validation (``torch.distributions`` checks a value's support
    with it and raises where it is false): the loss goes on only where it is true, so nothing flows from it."""
    return CONST


def rule_matrix(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """Functions of each matrix of a batch (``det``, ``cholesky``, ``solve``, ``svdvals``, ``matrix_norm``, ...):
    followed where every operand is a batch of matrices ``(B, ..., n, m)`` and the traced ones hold their samples
    along dimension 0 only, with the same rows; each result (every item of a tuple) is then those rows' (a
    nonlinear function of each)."""
    ts = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    traced = [(t, dep(t)) for t in ts if dep(t) is not None]
    if not traced:
        return None
    items = list(res) if isinstance(res, (tuple, list)) else [res]
    if name == "trace":  # a 2-D matrix: the rows are its own
        t, d = traced[0]
        return reduce(d, 2, None, False, True, name) if len(traced) == 1 and t.dim() == 2 else None
    if all(d.kind in (ONE, SEP, COUPLED) for _, d in traced) and len({(d.kind, d.maps) for _, d in traced}) == 1:
        r = unary(traced[0][1], False, name)
        return tuple(r if isinstance(i, torch.Tensor) else CONST for i in items) if isinstance(res, (tuple, list)) \
            else r
    if "dim" in kwargs or (name == "linalg_matrix_norm" and len(args) > 2):
        return None  # matrices along other dimensions than the last two
    # every operand a batch of matrices (a solve's right-hand side of one dimension less would make dimension 0 a
    # matrix dimension when the batch is absent: not followed)
    if any(t.dim() < 3 for t in ts) or any(d.kind != ROWS or d.dims != (0,) for _, d in traced):
        return None
    n = traced[0][0].shape[0]
    m = traced[0][1].maps[0]
    if any(t.shape[0] not in (1, n) for t in ts) or any(t.shape[0] != n or not same_map(d.maps[0], m, n)
                                                         for t, d in traced):
        return None
    grad = any(d.grad for _, d in traced)
    r = Dep(ROWS, grad, traced[0][1].book, (0,), (m,))
    out = []
    for i in items:
        if not isinstance(i, torch.Tensor):
            out.append(CONST)
        elif i.dim() >= 1 and i.shape[0] == n:
            out.append(r if i.is_floating_point() or i.is_complex() else data(r))
        else:
            return None
    return tuple(out) if isinstance(res, (tuple, list)) else out[0]


def rule_diag_embed(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Any:
    """``x.diag_embed()`` (``(..., n) -> (..., n, n)``, the default ``dim1``/``dim2``): followed where the samples
    are not along the last dimension."""
    x = args[0]
    d = dep(x)
    if d is None or arg(args, kwargs, 2, "dim1", -2) != -2 or arg(args, kwargs, 3, "dim2", -1) != -1:
        return None
    return None if _mixed(d, (x.dim() - 1,)) else d
