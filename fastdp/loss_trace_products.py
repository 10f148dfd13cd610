"""Loss-trace rules for products: ``matmul`` and its forms, ``einsum`` (with ``...`` and the implicit output),
``addmm`` and its kin, ``tensordot`` and ``bilinear`` (how their results depend on the samples).

Part of the loss trace's table (:mod:`fastdp.loss_trace_rules` registers them). Every product is written as an
einsum and handed to :func:`fastdp.loss_deps.contract`: a letter that carries samples and is summed over gives a sum
over the samples (``SEP``) when it is the only one, and couples them when other samples remain (``Y @ Y.T`` keeps
two: ``PAIRS``). A rule returns ``None`` (the pass is then unverified, never refused) for a form it does not read.
"""

from __future__ import annotations

import string
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from fastdp.loss_deps import Dep, combine, contract, unary
from fastdp.loss_trace_shapes import arg

DepOf = Callable[[Any], Dep | None]

MATMUL = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "einsum", "linear", "inner", "dot", "vdot", "outer",
          "ger", "mv"}
ADD_PRODUCTS = {"addmm", "addmv", "addr", "baddbmm", "addbmm"}


def rule_matmul(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    if name == "einsum":
        if not args or not isinstance(args[0], str):
            return None  # the sublist form einsum(a, [0, 1], b, [1, 2])
        ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
        parsed = einsum_specs(args[0], ops)
        if parsed is None:
            return None
        specs, out = parsed
        if isinstance(res, torch.Tensor) and res.dim() != len(out):
            return None
    else:
        if name == "__rmatmul__":
            a, b = args[1], args[0]
        elif name == "linear":
            a, b = args[0], arg(args, kwargs, 1, "weight")
        else:
            a, b = args[0], args[1]
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            return None
        if a.dim() > 8 or b.dim() > 8:
            return None
        if name == "linear":
            bias = arg(args, kwargs, 2, "bias")
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
    return _contract(name, ops, specs, out, dep)


def _contract(name: str, ops: list[Any], specs: list[str], out: str, dep: DepOf) -> Dep | None:
    if len(ops) != len(specs) or any(not isinstance(t, torch.Tensor) or t.dim() != len(s)
                                     for t, s in zip(ops, specs, strict=True)):
        return None
    if all(dep(t) is None for t in ops):
        return None
    return contract([(dep(t), s) for t, s in zip(ops, specs, strict=True)], out, name,
                    [tuple(t.shape) for t in ops])


def _lead(n: int) -> str:
    """Letters for ``n`` leading dimensions of a product (none of ``i j k n``)."""
    return "abcdefgh"[:n]


def einsum_specs(equation: str, ops: list[Any]) -> tuple[list[str], str] | None:
    """The operands' letters and the output's for ``torch.einsum(equation, *ops)``, with ``...`` written out as
    letters of its own (right-aligned, as torch broadcasts it) and the implicit output (no ``->``: the ellipsis,
    then the letters that occur once, in torch's order: upper case before lower case) made explicit."""
    eq = equation.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    specs = lhs.split(",")
    if len(specs) != len(ops) or not all(isinstance(t, torch.Tensor) for t in ops):
        return None
    if any(c not in string.ascii_letters for s in specs + [out] for c in s.replace("...", "")):
        return None
    free = [c for c in string.ascii_letters if c not in eq]
    widths = [t.dim() - len(s.replace("...", "")) for s, t in zip(specs, ops, strict=True)]
    n_ell = max([w for s, w in zip(specs, widths, strict=True) if "..." in s], default=0)
    if n_ell > len(free) or any(w < 0 for w in widths):
        return None
    ell = "".join(free[:n_ell])
    full = [s.replace("...", ell[n_ell - w:] if w else "") for s, w in zip(specs, widths, strict=True)]
    if arrow:
        out = out.replace("...", ell)
    else:
        once = Counter(c for s in specs for c in s.replace("...", ""))
        out = ell + "".join(sorted(c for c, k in once.items() if k == 1))
    return full, out


def rule_add_product(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    """``addmm(input, a, b)`` = ``beta * input + alpha * a @ b`` (``addmv``, ``addr``: ``outer``, ``baddbmm``,
    ``addbmm``: the batch of products summed): the product's dependence plus the input's."""
    x, a, b = args[0], arg(args, kwargs, 1, "mat1"), arg(args, kwargs, 2, "mat2")
    if not all(isinstance(t, torch.Tensor) for t in (x, a, b)) or not isinstance(res, torch.Tensor):
        return None
    if any(dep(v) is not None for v in (kwargs.get("beta"), kwargs.get("alpha"))):
        return None
    base = name.rstrip("_")
    if base == "addr":
        prod = _contract(name, [a, b], ["i", "j"], "ij", dep)
    elif base == "addbmm":
        prod = _contract(name, [a, b], ["bik", "bkj"], "ij", dep)
    else:
        prod = rule_matmul("matmul", (a, b), {}, None, dep)
    if prod is None and (dep(a) is not None or dep(b) is not None):
        return None
    terms = [] if kwargs.get("beta", 1) == 0 or dep(x) is None else [(unary(dep(x), True, name), tuple(x.shape))]
    if prod is not None:
        terms.append((prod, tuple(res.shape)))
    return combine(terms, tuple(res.shape), True, name) if terms else None


def rule_tensordot(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    """``tensordot(a, b, dims)``: ``dims`` an int (a's last with b's first dimensions) or two lists."""
    a, b = args[0], args[1]
    dims = arg(args, kwargs, 2, "dims", 2)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() + b.dim() > 40:
        return None
    if isinstance(dims, int):
        da, db = list(range(a.dim() - dims, a.dim())), list(range(dims))
    elif isinstance(dims, (list, tuple)) and len(dims) == 2:
        da, db = [dims[0]] if isinstance(dims[0], int) else list(dims[0]), \
            [dims[1]] if isinstance(dims[1], int) else list(dims[1])
    else:
        return None
    da, db = [k % a.dim() for k in da], [k % b.dim() for k in db]
    letters = iter(string.ascii_letters)
    sa = [next(letters) for _ in range(a.dim())]
    sb = [next(letters) for _ in range(b.dim())]
    for i, j in zip(da, db, strict=True):
        sb[j] = sa[i]
    out = "".join(c for k, c in enumerate(sa) if k not in da) + "".join(c for k, c in enumerate(sb) if k not in db)
    return _contract(name, [a, b], ["".join(sa), "".join(sb)], out, dep)


def rule_bilinear(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], res: Any, dep: DepOf) -> Dep | None:
    """``F.bilinear(x1, x2, W, b)``: ``y[..., o] = Σ_ij x1[..., i] W[o, i, j] x2[..., j] + b[o]``."""
    x1, x2, w = args[0], args[1], arg(args, kwargs, 2, "weight")
    bias = arg(args, kwargs, 3, "bias")
    if not all(isinstance(t, torch.Tensor) for t in (x1, x2, w)) or x1.dim() != x2.dim() or x1.dim() > 8:
        return None
    if isinstance(bias, torch.Tensor) and dep(bias) is not None:
        return None
    lead = _lead(x1.dim() - 1)
    return _contract(name, [x1, x2, w], [lead + "i", lead + "j", "oij"], lead + "o", dep)
