"""The loss check: read, from the gradient it sends to the model's logits, how the loss weights each sample.

The engine clips the gradient of each sample's own loss: it assumes that the loss it backpropagates is
``L = (1/B) Σ_i L_i`` (``loss_reduction="mean"``) or ``Σ_i L_i`` (``"sum"``), each ``L_i`` depending on sample ``i``
only. It never sees the loss. The common way to break this is a **token mean over the whole batch**: with ``n_i``
label tokens in sample ``i`` and ``N = Σ_j n_j``, ``Σ_{i,t} ℓ_it / N`` (``F.cross_entropy(logits.view(-1, V),
labels.view(-1), ignore_index=-100)`` on a padded batch) weighs sample ``i`` by ``B n_i / N`` under ``"mean"``, a
factor set by the *other* samples: clipping acts on the wrong per-sample gradients and removing one sample rescales
all the others. This check finds it where the loss is a softmax cross-entropy of a model output, and refuses.

**What it reads.** An output ``Y`` of the model (the root's forward: a tensor, or one inside a tuple, list, dict or
Hugging Face ``ModelOutput``) of shape ``(B, ..., V)`` with ``V >= 2``, floating, that requires grad: its rows ``r``
(one per index of ``B, ...``) are logits. At the forward pass the check keeps, per row, the log-sum-exp and the
``TOP`` largest logits with their classes (``rows x 7`` numbers, not the logits). At the backward pass a tensor
hook on ``Y`` receives ``G = dL/dY``. A softmax cross-entropy term ``w_r CE(Y_r, y_r)`` gives
``G_r = w_r (softmax(Y_r) - e_{y_r})``: the label is the row's one negative entry, the row sums to 0, and
``G_rk / p_rk = w_r`` for every other class ``k``. So each row's weight ``w_r`` is read at the most probable kept
classes other than the label (all such estimates must agree), and the row must sum to 0 and imply a label
probability ``1 + G_ry / w_r`` in ``[0, 1]`` (within the tolerance of ``G``'s dtype). A row whose gradient is 0
carries no label (padding, ``ignore_index``, a position shifted out). A ``GradScaler``'s scale is divided out.

**Verdict**, with ``s = B`` (``"mean"``) or ``1`` (``"sum"``), ``n_i`` sample ``i``'s label rows and
``N = Σ_i n_i``:

* ``"per-sample mean"``: ``w_r s n_i = 1`` on every label row (the :mod:`fastdp.losses` helpers);
* ``"per-sample sum"``: ``w_r s = 1`` (token losses summed within each sample);
* ``"batch token mean"``: ``w_r N = 1`` on every label row while neither of the above fits: **refused**
  (:class:`fastdp.probe.StructureError`, naming the output, the weight, the counts and the fix), when the step is
  released: nothing is, the step's sums are discarded, and on several ranks every rank raises (as for the
  engine's other checks);
* ``"uninformative"``: every sample has the same number of label rows (where the token mean *is* the per-sample
  mean, exact), or none, or the batch's counts make a token mean read as a per-sample form too (``N = s``):
  checked again at the next call;
* ``"not recognised"``: rows that are not a plain softmax cross-entropy's (label smoothing, a temperature, another
  loss, the sum of two losses on the same logits) or that underflowed: checked again at the next call;
* ``"per-sample mean (scaled)"``: ``w_r s n_i = κ``, the same ``κ != 1`` on every label row (a per-sample mean
  divided by a constant, e.g. the number of accumulation steps; a factor common to the batch is taken as a
  constant: it is not compared across batches);
* ``"equal weights"``: every label row has the same weight ``c``, with ``c N != 1 != c s``: a per-sample sum or a
  token mean, times a constant (e.g. divided by the number of accumulation steps). One batch cannot tell them
  apart; a later batch with another ``N`` can: ``"per-sample sum (scaled)"`` when ``c s`` is the same in both,
  ``"batch token mean"`` (refused) when ``c N`` is;
* ``"unverified weights"``: a cross-entropy whose weights fit none of these forms: nothing is concluded; logged.

The check runs on the backward passes of each input signature of the model (:func:`fastdp.probe.signature`) until
a verdict other than the three "checked again" ones (uninformative, not recognised, equal weights), at most
``MAX_TRIES`` times per signature; a refusal does not end it (a loop that catches the error is refused again).
``PrivacyEngine(verify_loss=False)`` turns it off.

**What it does not see**, and so does not refuse: a loss that is not a softmax cross-entropy of a model output as
returned (a temperature or label smoothing make the rows "not recognised"; slicing keeps the form), a divisor that
depends on the batch in another way (e.g. the padded length), and losses that couple samples through the outputs
(in-batch negatives, contrastive losses): their gradient has no per-row form to read.
``fastdp.losses.check_per_sample_loss`` checks any loss function, when called. A token mean divided by a constant is
refused only at the second batch with another label count: the first step is released (with its wrong per-sample
weights).

Cost, per checked pass: one read of the logits at the forward (log-sum-exp and top-3, in row chunks of at most
``CHUNK`` elements) and one of their gradient in the backward pass, both on the device without a host read; the
verdicts are read on the host when the step is released (:func:`settle`), a few reads per checked pass.

It may touch: hooks on the model's output tensors and its own state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from fastdp.probe import StructureError

logger = logging.getLogger(__name__)

TOP = 3  # largest logits kept per row
MAX_TRIES = 8  # checked backward passes per input signature without a verdict
CHUNK = 1 << 22  # elements of the logits (or their gradient) read at once
MAX_OUTPUTS = 8  # model outputs checked per call
_TINY = 1e-30  # a kept class's probability below this (underflow) gives no estimate
#: relative tolerance of the weights read from a gradient of this dtype (float32: rounding of p and of G's sum)
_TOL = {torch.float64: 1e-6, torch.float32: 1e-3}
_HALF_TOL = 3e-2
#: verdicts after which a signature is checked again
AGAIN = ("uninformative", "not recognised", "equal weights")


def _tol(dtype: torch.dtype) -> float:
    return _TOL.get(dtype, _HALF_TOL)


@dataclass
class RowSummary:
    """What the forward pass leaves for the check of one output ``(B, ..., V)``: per row (``B * R`` of them),
    ``lse`` ``(B*R,)``, the ``k`` largest logits ``top`` ``(B*R, k)`` and their classes ``classes``."""

    label: str
    batch: int
    lse: torch.Tensor
    top: torch.Tensor
    classes: torch.Tensor


@dataclass
class LossCheck:
    """The loss check's state in one engine: per input signature the passes checked and whether a verdict came."""

    tries: dict[Any, int] = field(default_factory=dict)
    done: set[Any] = field(default_factory=set)
    equal: dict[Any, Verdict] = field(default_factory=dict)  # the first "equal weights" batch of a signature
    pending: list[Pending] = field(default_factory=list)  # checked passes, judged at the step (settle)

    def wanted(self, sig: Any) -> bool:
        return sig not in self.done and self.tries.get(sig, 0) < MAX_TRIES


def _outputs(out: Any, label: str, depth: int = 0) -> Iterator[tuple[str, Any]]:
    if isinstance(out, torch.Tensor):
        yield label, out
    elif depth < 3 and isinstance(out, Mapping):
        for k, v in out.items():
            yield from _outputs(v, f"{label}[{k!r}]", depth + 1)
    elif depth < 3 and isinstance(out, (tuple, list)):
        for k, v in enumerate(out):
            yield from _outputs(v, f"{label}[{k}]", depth + 1)


def _candidates(output: Any, B: int) -> list[tuple[str, torch.Tensor]]:
    """The outputs that can be logits of ``B`` samples: floating, requiring grad, ``(B, ..., V >= 2)``."""
    found = []
    for label, y in _outputs(output, "output"):
        if (y.is_floating_point() and y.requires_grad and y.dim() >= 2 and y.shape[0] == B and y.shape[-1] >= 2
                and y.numel() > 0):
            found.append((label, y))
    return found[:MAX_OUTPUTS]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def summarise(label: str, y: torch.Tensor) -> RowSummary:
    """Per row of ``y`` ``(B, ..., V)``: log-sum-exp and the ``TOP`` largest logits with their classes."""
    V = y.shape[-1]
    x = y.detach().reshape(-1, V)
    step = max(1, CHUNK // V)
    lse, top, classes = [], [], []
    with torch.no_grad():
        for s in range(0, x.shape[0], step):
            xc = x[s:s + step].to(_acc(y.dtype))
            lse.append(torch.logsumexp(xc, -1))
            v, i = xc.topk(min(TOP, V), -1)
            top.append(v)
            classes.append(i)
    return RowSummary(label, y.shape[0], torch.cat(lse), torch.cat(top), torch.cat(classes))


def row_weights(g: torch.Tensor, summ: RowSummary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's softmax cross-entropy weight read from its gradient ``g`` ``(B, ..., V)``.

    Returns ``(w, labelled, fits)``, each ``(B*R,)``: ``w_r = G_rk / p_rk`` at the most probable kept class
    ``k`` other than the label (``argmin_k G_rk``); ``labelled``: the row's gradient is not 0; ``fits``: the row is
    ``w_r (p_r - e_y)`` within the dtype's tolerance (every kept estimate agrees, the row sums to 0, the implied
    label probability is in ``[0, 1]``), or unlabelled."""
    V = g.shape[-1]
    tol = _tol(g.dtype)
    x = g.detach().reshape(-1, V)
    step = max(1, CHUNK // V)
    ws, labs, fits = [], [], []
    with torch.no_grad():
        for s in range(0, x.shape[0], step):
            gc = x[s:s + step].to(_acc(g.dtype))
            lse, top, cls = summ.lse[s:s + step], summ.top[s:s + step], summ.classes[s:s + step]
            labelled = (gc != 0).any(-1)
            y = gc.argmin(-1, keepdim=True)
            gy = gc.gather(-1, y)[:, 0]
            p = torch.exp(top - lse[:, None])
            usable = (cls != y) & (p > _TINY)
            est = torch.where(usable, gc.gather(-1, cls) / p.clamp_min(_TINY), torch.zeros_like(p))
            first = usable.int().argmax(-1, keepdim=True)  # the most probable usable class (top is sorted)
            w = est.gather(-1, first)[:, 0]
            has = usable.any(-1) & (w > 0)
            agree = torch.where(usable, (est / w[:, None].clamp_min(_TINY) - 1).abs() <= tol, True).all(-1)
            sums_to_zero = gc.sum(-1).abs() <= tol * w.abs()
            p_label = 1 + gy / w.clamp_min(_TINY)
            ok = has & agree & sums_to_zero & (gy < 0) & (p_label >= -tol) & (p_label <= 1 + tol)
            ws.append(torch.where(has, w, torch.zeros_like(w)))
            labs.append(labelled)
            fits.append(ok | ~labelled)
    return torch.cat(ws), torch.cat(labs), torch.cat(fits)


@dataclass
class Verdict:
    """One checked output: ``kind`` (see the module docstring), with the numbers a refusal names: the weight ``c``
    of a label row (when all are equal), ``N`` label rows, the smallest and largest count of a sample, and
    ``c s`` (``s = B`` or 1)."""

    kind: str
    weight: float = 0.0
    total: int = 0
    counts: tuple[int, int] = (0, 0)
    per_sample: float = 0.0


def verdict(w: torch.Tensor, labelled: torch.Tensor, fits: torch.Tensor, B: int, scale: float, mean: bool,
            tol: float) -> Verdict:
    """The verdict on rows of ``B`` samples (``w``, ``labelled``, ``fits``: ``(B*R,)`` from :func:`row_weights`),
    the weights divided by the loss scale ``scale``; ``mean``: ``loss_reduction == "mean"``. ``"equal weights"``:
    every label row has the same weight ``c``, counts differ, and ``c N != 1 != c s``: a per-sample sum or a token
    mean times a constant, told apart across two batches (:func:`across_batches`)."""
    if not bool(fits.all()):
        return Verdict("not recognised")
    lab = labelled.reshape(B, -1)
    n = lab.sum(1)
    N = int(n.sum())
    if N == 0:
        return Verdict("uninformative")
    wl = w.reshape(B, -1)[lab].double() / scale
    n_row = n[:, None].expand_as(lab)[lab].double()
    c = float(wl.median())
    s = float(B) if mean else 1.0
    all_equal = bool(((wl / c - 1).abs() <= tol).all())
    token_mean = all_equal and abs(c * N - 1) <= tol
    per_sample_sum = all_equal and abs(c * s - 1) <= 3 * tol
    q = wl * s * n_row  # 1 on every label row for a per-sample mean; the same constant for one times a constant
    per_sample_mean = bool(((q - 1).abs() <= 3 * tol).all())
    kappa = float(q.median())
    scaled_mean = bool(((q / kappa - 1).abs() <= 3 * tol).all())
    counts = (int(n.min()), int(n.max()))
    if counts[0] == counts[1]:  # a token mean is then a per-sample mean times a constant
        return Verdict("uninformative")
    if token_mean and not per_sample_sum and not per_sample_mean:
        return Verdict("batch token mean", c, N, counts, c * s)
    if token_mean:  # the counts make a token mean read as a per-sample form here
        return Verdict("uninformative")
    if per_sample_mean:
        return Verdict("per-sample mean")
    if per_sample_sum:
        return Verdict("per-sample sum")
    if scaled_mean and not all_equal:
        return Verdict("per-sample mean (scaled)", kappa)
    return Verdict("equal weights" if all_equal else "unverified weights", c, N, counts, c * s)


def across_batches(first: Verdict, now: Verdict, tol: float) -> str | None:
    """Two ``"equal weights"`` batches: a per-sample sum times a constant keeps ``c s``; a token mean times a
    constant keeps ``c N``. ``None``: not told apart yet (the same ``N``, or both kept)."""
    if first.total == now.total:
        return None
    keeps_sum = abs(now.per_sample / first.per_sample - 1) <= 3 * tol
    keeps_mean = abs(now.weight * now.total / (first.weight * first.total) - 1) <= tol
    if keeps_sum and not keeps_mean:
        return "per-sample sum (scaled)"
    if keeps_mean and not keeps_sum:
        return "batch token mean"
    if keeps_sum and keeps_mean:
        return None
    return "unverified weights"


def arm(engine: Any, state: LossCheck, sig: Any, output: Any, B: int) -> None:
    """After a forward call of the model with signature ``sig`` and batch ``B``: summarise its candidate logits
    and hook their gradients (the check runs in the backward pass)."""
    cands = _candidates(output, B)
    if not cands:
        return
    state.tries[sig] = state.tries.get(sig, 0) + 1
    for label, y in cands:
        y.register_hook(partial(_on_grad, engine, state, sig, summarise(label, y)))


def _loss_scale(engine: Any) -> torch.Tensor | float:
    link = engine._release.scaler
    return 1.0 if link is None else link.loss_scale()


@dataclass
class Pending:
    """A checked backward pass of one output, judged when the step is released: the rows' weights
    (:func:`row_weights`, on the device) and what the verdict needs."""

    sig: Any
    summ: RowSummary
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    scale: torch.Tensor | float
    tol: float


def _on_grad(engine: Any, state: LossCheck, sig: Any, summ: RowSummary, g: torch.Tensor) -> None:
    """The tensor hook on a checked output: read the rows' weights (no host read: judged at the step)."""
    state.pending.append(Pending(sig, summ, row_weights(g, summ), _loss_scale(engine), _tol(g.dtype)))


def settle(engine: Any, state: LossCheck) -> StructureError | None:
    """Judge the backward passes checked since the last step (called when a step is released, before anything
    is): count the verdicts, end the check of the signatures that got one, and return the refusal of a token mean
    over the batch (the release stage raises it and discards the step; on several ranks, on every rank)."""
    pending, state.pending = state.pending, []
    stats = engine.probe_stats
    error = None
    for p in pending:
        stats["loss_checks"] += 1
        scale = float(p.scale)
        v = verdict(*p.weights, p.summ.batch, scale, engine.loss_reduction == "mean", p.tol)
        kind = v.kind
        if kind == "equal weights":
            first = state.equal.setdefault(p.sig, v)
            kind = (None if first is v else across_batches(first, v, p.tol)) or "equal weights"
        stats["loss_verdicts"][kind] = stats["loss_verdicts"].get(kind, 0) + 1
        if kind == "batch token mean":
            error = error or StructureError(_message(engine, p.summ, v, scaled=v.kind == "equal weights"))
            continue
        if kind not in AGAIN:
            state.done.add(p.sig)
        if kind == "per-sample mean (scaled)":
            logger.info("loss check: %s: a per-sample mean times %.6g (taken as a constant: the engine's clipping "
                        "sees each sample's gradient times it)", p.summ.label, v.weight)
        elif kind == "unverified weights":
            logger.info("loss check: %s is a softmax cross-entropy whose weights (%.6g on a label row; %d label "
                        "rows, %d to %d per sample) fit neither a per-sample mean nor a per-sample sum, nor a "
                        "constant times either: the loss is not verified", p.summ.label, v.weight, v.total,
                        *v.counts)
        else:
            logger.debug("loss check: %s: %s", p.summ.label, kind)
    return error


def _message(engine: Any, summ: RowSummary, v: Verdict, scaled: bool) -> str:
    mean = engine.loss_reduction == "mean"
    weight = (f"weight {v.weight:.6g} = {v.weight * v.total:.6g}/{v.total}, a constant over the batch's {v.total} "
              "label rows, the constant the same in two batches with different numbers of label rows" if scaled
              else f"weight {v.weight:.6g} = 1/{v.total}, one over the batch's {v.total} label rows")
    return (f"the loss is a token mean over the whole batch: every label row of the model's {summ.label} has "
            f"{weight} (a sample has {v.counts[0]} to {v.counts[1]}; batch of {summ.batch}). Under "
            f"loss_reduction={engine.loss_reduction!r} sample i is then weighted by {'B * ' if mean else ''}"
            f"n_i/{v.total}{' times a constant' if scaled else ''}, a factor set by the other samples' numbers of "
            "labels: clipping acts on the wrong per-sample gradients and removing one sample rescales all the "
            "others, so the privacy guarantee fails. Nothing was released. Average within each sample instead: "
            "fastdp.losses.causal_lm_loss(logits, labels).mean() (token_classification_loss, seq2seq_loss, or "
            "per_sample_mean(values, mask) for other token losses), or sum the tokens of each sample. This check "
            "(verify_loss=True; docs/reference/losses.md) reads the weights of a softmax cross-entropy from its "
            "gradient; a loss that sums the tokens within each sample and is divided by a constant reads the same "
            f"if that constant happens to give every label row the weight 1/{v.total} here: only then pass "
            "verify_loss=False.")
