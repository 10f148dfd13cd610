"""How a tensor computed from the model's outputs depends on the samples: the algebra of the loss trace.

Pure rules, no torch function interception (that is :mod:`fastdp.loss_trace`). A traced tensor carries a
:class:`Dep`. The engine's clipping is exact only if the loss is ``L = c + Σ_k f_k(Y_k)``: a sum of terms each of
which depends on one sample's outputs ``Y_k`` (and on constants, which may be that sample's own data). Then
``dL/dY_k`` depends on sample ``k`` only. The kinds, from the most to the least structured:

* ``ROWS``: along dimension ``dims[0]``, each index depends on one sample, given by the row map ``maps[0]``
  ``(base, block, offset)``: row ``r`` belongs to sample ``(r + offset) // block`` of the pass ``base`` (a
  :class:`Book`; the outputs of the model are ``(book, 1, 0)``: row ``k`` is sample ``k``);
* ``ONE``: the whole tensor depends on one sample ``maps[0]`` ``(base, sample)`` (``Y[3]``, an item of
  ``for y in Y``);
* ``PAIRS``: index ``(i, j)`` of dimensions ``dims`` depends on two samples (``Y @ Y.T``, ``Y[:, None] - Y[None]``);
* ``SEP``: each element is additively separable, ``c + Σ_k f_k(Y_k)`` (a sum or mean over the samples);
* ``COUPLED``: samples combined in any other way (proven by the operation named in ``why``: a log-sum-exp over the
  batch, a product of two batch sums, weights computed from other samples).

``grad`` says whether the tensor is on a gradient path from the outputs. A tensor with ``grad=False`` (detached,
compared, an ``argmax``) is *data*: added to a gradient term it changes nothing (``SEP`` at worst), but as a factor
of one it is a per-sample weight, which must come from the same sample (``ROWS`` with the same map) or the result is
``COUPLED``. The rules never decide ``COUPLED`` without a combination of samples that is not a sum: an operation
they do not know makes the result untraced (and the pass unverified), never coupled.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

ROWS, ONE, PAIRS, SEP, COUPLED = "rows", "one", "pairs", "sep", "coupled"
#: a rule's answer for a result (or an item of a tuple result) that depends on no sample: left untraced, and the
#: pass stays verified (``None`` instead means the rules cannot follow it: the pass is unverified)
CONST = "const"


class Book:
    """One pass of the loss trace: the forward calls whose outputs share sample indices (those a backward pass
    reaches together), and the operations on their traced tensors that the rules did not know."""

    __slots__ = ("__weakref__", "closed", "state", "unknown")

    def __init__(self) -> None:
        self.unknown: dict[str, str] = {}  # what the trace did not follow -> where it first happened (file:line)
        self.closed = False  # a backward pass ran through it: the next forward call starts another book
        self.state: Any = None  # a weak reference to the engine's fastdp.loss_trace.LossTrace

    def miss(self, what: str) -> None:
        """Record an operation the trace does not follow (the pass is then unverified), with the caller's line."""
        if what not in self.unknown:
            self.unknown[what] = where()

    def seen(self) -> Book:
        """A copy of what the trace did not follow so far: a backward pass is judged by the operations before it
        (those after it, such as ``running_loss += loss.detach()``, cannot change its gradients)."""
        snap = Book()
        snap.unknown = dict(self.unknown)
        snap.closed = True
        return snap


@dataclass(frozen=True)
class Dep:
    """How a tensor depends on the samples (see the module docstring)."""

    kind: str
    grad: bool
    book: Book
    dims: tuple[int, ...] = ()
    maps: tuple[Any, ...] = ()
    why: str = ""


def output_dep(book: Book) -> Dep:
    """A model output ``(B, ...)``: row ``k`` is sample ``k``."""
    return Dep(ROWS, True, book, (0,), ((book, 1, 0),))


def where() -> str:
    """The caller's place outside torch and fastdp (``file:line``), for the refusal's message."""
    f = sys._getframe(1)
    while f is not None:
        module = str(f.f_globals.get("__name__", ""))
        if module.split(".")[0] not in ("torch", "fastdp"):
            return f"{f.f_code.co_filename}:{f.f_lineno}"
        f = f.f_back
    return "?"


def coupled(book: Book, grad: bool, why: str, *deps: Dep | None) -> Dep:
    """A ``COUPLED`` result; an operand that is coupled already keeps its own reason."""
    for d in deps:
        if d is not None and d.kind == COUPLED and d.grad == grad:
            return d
    if grad:
        why = f"{why} (at {where()})"
    return Dep(COUPLED, grad, book, why=why)


#: the most rows an explicit row map lists (a selection or concatenation beyond it is not followed)
MAX_ROWS = 1 << 20
#: the "sample" of a row that belongs to none: a constant concatenated with (or padded onto) the batch's rows. A
#: constant depends on no sample, so counting it as one more sample is sound; a tensor of such rows only is a
#: constant (:func:`fastdp.loss_trace._wrap` leaves it untraced)
PHANTOM = -1


def one_from_row(m: Any, r: int) -> Any:
    """The sample ``(book, index)`` of row ``r`` of rows with map ``m``."""
    if len(m) == 3:
        book, block, offset = m
        return (book, (r + offset) // block)
    return (m[0], m[1][r])


def row_samples(m: Any, start: int, length: int) -> list[int]:
    """The samples (indices in the map's book) of rows ``start .. start + length``."""
    if len(m) == 3:
        _, block, offset = m
        return [(r + offset) // block for r in range(start, start + length)]
    return list(m[1][start:start + length])


def explicit(book: Any, samples: list[int] | tuple[int, ...]) -> Any:
    """The row map whose row ``r`` is sample ``samples[r]`` of ``book``: arithmetic ``(book, block, offset)`` when
    the samples are consecutive runs of one length (so that a selection of every row, or ``cat`` of the batch's
    pieces, is the batch's map again), else ``(book, samples)``. Two maps are the same function of the row exactly
    when they are equal."""
    samples = tuple(samples)
    n = len(samples)
    if n == 0 or PHANTOM in samples:  # (rows of no sample: listed, never in the arithmetic form)
        return (book, samples)
    runs = []  # (sample, run length)
    for v in samples:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    consecutive = all(runs[i + 1][0] == runs[i][0] + 1 for i in range(len(runs) - 1))
    if consecutive:
        if len(runs) == 1:
            return (book, samples)  # one sample: a run of unknown block
        block = runs[1][1] if len(runs) > 2 else max(runs[0][1], runs[1][1])
        inner = runs[1:-1]
        if all(r[1] == block for r in inner) and runs[0][1] <= block and runs[-1][1] <= block:
            offset = runs[0][0] * block + (block - runs[0][1])
            return (book, block, offset)
    return (book, samples)


def same_map(a: Any, b: Any, n: int) -> bool:
    """Whether row maps ``a`` and ``b`` give the same sample on each of ``n`` rows (an arithmetic map over rows of
    at most two samples has several forms)."""
    if a == b:
        return True
    if a[0] is not b[0] or n > MAX_ROWS:
        return False
    return row_samples(a, 0, n) == row_samples(b, 0, n)


def single_sample(m: Any, n: int) -> bool:
    """Whether all ``n`` rows of map ``m`` are one sample's."""
    if n <= 1:
        return True
    if len(m) == 3:
        _, block, offset = m
        return offset // block == (n - 1 + offset) // block
    return len(set(m[1][:n])) == 1


def narrow_map(m: Any, start: int, length: int) -> Any:
    """The row map of rows ``start .. start + length`` (``start >= 0``) of rows with map ``m``."""
    if len(m) == 3:
        book, block, offset = m
        return (book, block, offset + start)
    return explicit(m[0], m[1][start:start + length])


def take_map(m: Any, rows: list[int], n: int) -> Any | None:
    """The row map of rows ``rows`` (indices into ``n`` rows with map ``m``, negative ones from the end); ``None``
    beyond ``MAX_ROWS``."""
    if len(rows) > MAX_ROWS:
        return None
    return explicit(m[0], [one_from_row(m, r % n if n else r)[1] for r in rows])


def concat_maps(parts: list[tuple[Any, int]]) -> Any | None:
    """The row map of ``torch.cat`` along the sample dimension of rows with maps and lengths ``parts``; ``None`` for
    rows of several books or beyond ``MAX_ROWS``."""
    books = {m[0] for m, _ in parts}
    if len(books) != 1 or sum(n for _, n in parts) > MAX_ROWS:
        return None
    samples: list[int] = []
    for m, n in parts:
        samples.extend(row_samples(m, 0, n))
    return explicit(books.pop(), samples)


def shift(d: Dep, dims: tuple[int, ...]) -> Dep:
    return replace(d, dims=dims)


def data(d: Dep) -> Dep:
    return replace(d, grad=False)


def unary(d: Dep, linear: bool, name: str) -> Dep:
    """An elementwise function of one traced tensor (same shape). Nonlinear functions of a sum over samples
    couple them."""
    if d.kind == SEP and not linear:
        return coupled(d.book, d.grad, f"{name} of a sum over samples", d)
    return d


def _aligned(deps: list[tuple[Dep, tuple[int, ...]]], out: tuple[int, ...]) -> list[tuple[Dep, tuple[int, ...]]]:
    """The traced operands of a broadcast elementwise operation, their sample dimensions in the output's. An
    operand whose sample dimension has size 1 where the output's does not is one sample's value broadcast to
    every row (``x[:1] - x``): ``ONE`` (rows) or coupled (pairs)."""
    res = []
    for d, shape in deps:
        off = len(out) - len(shape)
        if d.kind in (ROWS, PAIRS) and any(shape[x] == 1 and out[x + off] != 1 for x in d.dims):
            if d.kind == PAIRS:
                d = coupled(d.book, d.grad, "one sample's pairs broadcast against the batch")
            else:
                d = Dep(ONE, d.grad, d.book, (), (one_from_row(d.maps[0], 0),))
        res.append((d, tuple(x + off for x in d.dims)))
    return res


def combine(deps: list[tuple[Dep, tuple[int, ...]]], out: tuple[int, ...], additive: bool, name: str) -> Dep:
    """The result, of shape ``out``, of a broadcast elementwise operation whose traced operands are ``deps`` (each
    with its own shape); ``additive``: a sum or difference (a data operand shifts, never weighs). Untraced operands
    are constants and are not passed."""
    book = deps[0][0].book
    grad = any(d.grad for d, _ in deps)
    al = _aligned(deps, out)
    grads = [(d, dims) for d, dims in al if d.grad]
    datas = [(d, dims) for d, dims in al if not d.grad]
    for d, _ in al:
        if d.kind == COUPLED and (d.grad or not additive or not grad):  # (data only: a coupled value stays one)
            if grad and not d.grad:
                return coupled(book, grad, f"{name} by a value computed from several samples' outputs ({d.why})")
            return coupled(book, grad, name, d)
    if grad and additive:
        # data operands only shift the gradient terms: keep what the gradient operands are, at worst SEP
        kept = grads
        shifted = any(not (d.kind in (ROWS, ONE) and _same_rows(d, dims, grads, out)) for d, dims in datas)
    else:
        kept = al
        shifted = False
    res = _join(kept, out, additive, name, book, grad)
    if shifted and res.kind in (ROWS, ONE):
        return Dep(SEP, grad, book)
    if shifted and res.kind == PAIRS:
        return coupled(book, grad, f"{name} of pairs of samples and values of other samples")
    return res


def _same_rows(d: Dep, dims: tuple[int, ...], others: list[tuple[Dep, tuple[int, ...]]],
               out: tuple[int, ...]) -> bool:
    return all(o.kind == d.kind and odims == dims and all(
        same_map(a, b, out[x]) for a, b, x in zip(o.maps, d.maps, dims, strict=True)) for o, odims in others)


def _join(al: list[tuple[Dep, tuple[int, ...]]], out: tuple[int, ...], additive: bool, name: str, book: Book,
          grad: bool) -> Dep:
    kinds = {d.kind for d, _ in al}
    if SEP in kinds:
        if additive and kinds <= {SEP, ROWS, ONE}:
            return Dep(SEP, grad, book)
        if len(al) == 1:
            return al[0][0] if grad == al[0][0].grad else replace(al[0][0], grad=grad)
        return coupled(book, grad, f"{name} of a sum over samples and another traced value", *[d for d, _ in al])
    ones = {d.maps[0] for d, _ in al if d.kind == ONE}
    if ONE in kinds:
        if kinds == {ONE} and len(ones) == 1:
            return Dep(ONE, grad, book, (), (next(iter(ones)),))
        if additive and kinds <= {ONE, ROWS}:
            return Dep(SEP, grad, book)
        return coupled(book, grad, f"{name} of values of different samples", *[d for d, _ in al])
    # ROWS and PAIRS: the sample dimensions (output index -> row map)
    sample_dims: dict[int, Any] = {}
    for d, dims in al:
        for x, m in zip(dims, d.maps, strict=True):
            if x in sample_dims and not same_map(sample_dims[x], m, out[x]):
                if additive and kinds == {ROWS}:  # f(Y_r) + g(Y_s): still a sum of one-sample terms
                    return Dep(SEP, grad, book)
                return coupled(book, grad, f"{name} of rows of different samples (in another order)",
                               *[d for d, _ in al])
            sample_dims[x] = m
    if len(sample_dims) == 1:
        (x, m), = sample_dims.items()
        return Dep(ROWS, grad, book, (x,), (m,))
    if len(sample_dims) == 2:
        if additive and kinds == {ROWS}:  # f(Y_i) + g(Y_j) at (i, j): a sum of one-sample terms
            return Dep(SEP, grad, book)
        (x1, m1), (x2, m2) = sorted(sample_dims.items())
        return Dep(PAIRS, grad, book, (x1, x2), (m1, m2))
    return coupled(book, grad, f"{name} of three or more samples at once", *[d for d, _ in al])


def reduce(d: Dep, ndim: int, dims: tuple[int, ...] | None, keepdim: bool, linear: bool, name: str) -> Dep:
    """A reduction of a tensor of ``ndim`` dimensions over ``dims`` (``None`` or empty: all, as torch does), linear
    (sum, mean) or not (log-sum-exp, max, norm, variance, ...)."""
    red = set(range(ndim)) if not dims else {x % ndim if ndim else 0 for x in dims}
    if d.kind in (SEP, COUPLED, ONE):
        return d if (linear or d.kind != SEP) else coupled(d.book, d.grad, f"{name} of a sum over samples", d)
    hit = [x for x in d.dims if x in red]
    if not hit:
        kept = tuple(x if keepdim else x - sum(1 for r in red if r < x) for x in d.dims)
        return replace(d, dims=kept)
    if d.kind == ROWS and linear:
        return Dep(SEP, d.grad, d.book)
    what = "pairs of samples" if d.kind == PAIRS else "the samples"
    return coupled(d.book, d.grad, f"{name} over {what} (the batch dimension)", d)


def along(d: Dep, ndim: int, dim: int, name: str) -> Dep:
    """A function along one dimension that keeps the shape (softmax, log-softmax, normalize, sort, cumsum):
    over a sample dimension it combines samples."""
    if d.kind in (COUPLED, ONE):
        return d
    if d.kind == SEP:
        return coupled(d.book, d.grad, f"{name} of a sum over samples", d)
    if dim % ndim in d.dims:
        return coupled(d.book, d.grad, f"{name} across samples (along the batch dimension)", d)
    return d


def along_linear(d: Dep, ndim: int, dims: tuple[int, ...], name: str) -> Dep:
    """A linear function along dimensions ``dims`` (``cumsum``, ``diff``, a convolution, ``scatter_add``): each
    result element is a fixed linear combination of elements along them. Over a sample dimension of ``ROWS`` that is
    a sum of one-sample terms (``SEP``: ``x.cumsum(0).sum()`` is ``Σ_k (B - k) x_k``); over one of ``PAIRS``, pairs
    of samples are combined."""
    if d.kind in (SEP, COUPLED, ONE):
        return d
    if not any(x % ndim in d.dims for x in dims):
        return d
    if d.kind == ROWS:
        return Dep(SEP, d.grad, d.book)
    return coupled(d.book, d.grad, f"{name} across pairs of samples", d)


def permute(d: Dep, perm: list[int]) -> Dep:
    """``t.permute(perm)``: output dimension ``i`` is input dimension ``perm[i]``."""
    if d.kind not in (ROWS, PAIRS):
        return d
    inv = {p: i for i, p in enumerate(perm)}
    return replace(d, dims=tuple(inv[x] for x in d.dims))


def reshape(d: Dep, old: tuple[int, ...], new: tuple[int, ...]) -> Dep | None:
    """``t.reshape(new)`` of a tensor of shape ``old``; ``None`` where the rules cannot follow the rows."""
    if d.kind in (SEP, COUPLED, ONE):
        return d
    if d.kind != ROWS:
        return None
    x = d.dims[0]
    if _prod(old[:x]) != 1:
        return None
    k = 0
    while k < len(new) - 1 and new[k] == 1:
        k += 1
    if not new:
        return Dep(ONE, d.grad, d.book, (), (one_from_row(d.maps[0], 0),))
    s = _prod(new[k + 1:])  # elements per index of new dimension k
    inner = _prod(old[x + 1:])  # elements per old row
    m = d.maps[0]
    if len(m) == 2:  # an explicit map: new rows within old rows only
        if not s or inner % s or new[k] > MAX_ROWS:
            return None
        return Dep(ROWS, d.grad, d.book, (k,), (explicit(m[0], [m[1][(i * s) // inner] for i in range(new[k])]),))
    base, block, offset = m
    q = block * inner  # elements per sample (the first sample's may start at an offset)
    start = offset * inner  # element e belongs to sample (e + start) // q
    if s and q % s == 0 and start % s == 0:
        return Dep(ROWS, d.grad, d.book, (k,), ((base, q // s, start // s),))
    return None  # a row holding parts of several samples: not followed


def _prod(xs: Any) -> int:
    p = 1
    for v in xs:
        p *= int(v)
    return p


def contract(specs: list[tuple[Dep | None, str]], out: str, name: str,
             shapes: list[tuple[int, ...]] | None = None) -> Dep | None:
    """An einsum ``ops -> out`` (each operand a string of letters, its dependence or ``None`` for a constant, and
    optionally its shape): the sample dimensions follow their letters; a letter of samples summed over gives a sum
    over samples (``SEP``) when it is the only one, and couples them when other samples remain. A sample dimension
    of size 1 broadcast against a larger one (a batched product's leading dimension) is one sample's value."""
    size: dict[str, int] = {}
    if shapes is not None:
        for (_, s), shape in zip(specs, shapes, strict=True):
            for c, n in zip(s, shape, strict=True):
                size[c] = max(size.get(c, 1), int(n))
        specs = [(_broadcast_one(d, s, shape, size), s) for (d, s), shape in zip(specs, shapes, strict=True)]
    traced = [(d, s) for d, s in specs if d is not None]
    book = traced[0][0].book
    grad = any(d.grad for d, _ in traced)
    for d, _ in traced:
        if d.kind == COUPLED:
            return coupled(book, grad, name, d)
    if any(d.kind == SEP for d, _ in traced):
        if len(traced) == 1:
            return traced[0][0]
        return coupled(book, grad, f"{name} of a sum over samples and another traced value")
    if grad and any(not d.grad and d.kind not in (ROWS, PAIRS, ONE) for d, _ in traced):  # (ONE: below)
        return coupled(book, grad, f"{name} weighted by values of other samples")
    ones = {d.maps[0] for d, _ in traced if d.kind == ONE}
    letters: dict[str, Any] = {}
    for d, s in traced:
        if d.kind == ONE:
            continue
        for x, m in zip(d.dims, d.maps, strict=True):
            if s[x] in letters and not same_map(letters[s[x]], m, size.get(s[x], MAX_ROWS + 1)):
                return coupled(book, grad, f"{name} of rows of different samples", d)
            letters[s[x]] = m
    if ones:
        if letters or len(ones) > 1:
            return coupled(book, grad, f"{name} of values of different samples")
        return Dep(ONE, grad, book, (), (next(iter(ones)),))
    kept = {c: m for c, m in letters.items() if c in out}
    summed = [c for c in letters if c not in out]
    if summed:
        if len(letters) == 1:
            return Dep(SEP, grad, book)
        return coupled(book, grad, f"{name} summing over the samples of one operand against another's")
    if len(kept) == 1:
        (c, m), = kept.items()
        return Dep(ROWS, grad, book, (out.index(c),), (m,))
    if len(kept) == 2:
        (c1, m1), (c2, m2) = sorted(kept.items(), key=lambda cm: out.index(cm[0]))
        return Dep(PAIRS, grad, book, (out.index(c1), out.index(c2)), (m1, m2))
    return None


def _broadcast_one(d: Dep | None, s: str, shape: tuple[int, ...], size: dict[str, int]) -> Dep | None:
    if d is None or d.kind not in (ROWS, PAIRS) or not any(shape[x] == 1 and size[s[x]] > 1 for x in d.dims):
        return d
    if d.kind == PAIRS:
        return coupled(d.book, d.grad, "one sample's pairs broadcast against the batch")
    return Dep(ONE, d.grad, d.book, (), (one_from_row(d.maps[0], 0),))
