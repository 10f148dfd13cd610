"""The loss check: read, from the gradient it sends to the model's logits, how the loss weights each sample.

The engine clips the gradient of each sample's own loss: it assumes that the loss it backpropagates is
``L = (1/B) Σ_i L_i`` (``loss_reduction="mean"``) or ``Σ_i L_i`` (``"sum"``), each ``L_i`` depending on sample ``i``
only. It never sees the loss. The common way to break this is a **token mean over the whole batch**: with ``n_i``
label tokens in sample ``i`` and ``N = Σ_j n_j``, ``Σ_{i,t} ℓ_it / N`` (``F.cross_entropy(logits.view(-1, V),
labels.view(-1), ignore_index=-100)`` on a padded batch) weighs sample ``i`` by ``B n_i / N`` under ``"mean"``, a
factor set by the *other* samples: clipping acts on the wrong per-sample gradients and removing one sample rescales
all the others. This check finds it where the loss is a softmax cross-entropy of a model output, and refuses.

**What it reads.** An output ``Y`` of the model (the root's forward: a tensor, or one inside tuples, lists, dicts
or a Hugging Face ``ModelOutput``, up to ``MAX_OUTPUTS``) of shape ``(B, ..., V)`` with ``V >= 2``, floating, that
requires grad: its rows ``r`` (one per index of ``B, ...``) are logits. At the forward pass the check keeps, per row,
the log-sum-exp and the ``TOP`` largest logits with their classes (``rows x 7`` numbers, not the logits). In the
backward pass a tensor hook on ``Y`` receives ``G = dL/dY``. A softmax cross-entropy term ``w_r CE(Y_r, y_r)`` gives
``G_r = w_r (softmax(Y_r) - e_{y_r})``: the label is the row's one negative entry (or, when the label's probability
rounded to 1, its zero entry at the most probable class), the row sums to 0, and ``G_rk / p_rk = w_r`` for every
other class ``k``. So each row's weight ``w_r`` is read at the most probable kept classes other than the label (all
such estimates must agree), and the row must sum to 0 and imply a label probability ``1 + G_ry / w_r`` in
``[0, 1]``, within the tolerance of ``G``'s dtype (half precision: 6 %, a bf16 log-softmax's own rounding is about
2 % at ``V = 50k``). A row whose gradient is 0 carries no label (padding, ``ignore_index``, a position shifted out).
A ``GradScaler``'s scale is divided out. The weights are judged when the step is released (:func:`settle`).

**Verdicts**, with ``s = B`` (``"mean"``) or ``1`` (``"sum"``), ``n_i`` sample ``i``'s label rows, ``N = Σ_i n_i``
and ``N_step`` the label rows of every checked pass of the step (a token mean may divide by those of the logical
batch, as Hugging Face's ``num_items_in_batch`` does under gradient accumulation):

* ``"per-sample mean"``: ``w_r s n_i = 1`` on every label row (the :mod:`fastdp.losses` helpers);
  ``"per-sample mean (scaled)"``: ``w_r s n_i = κ``, the same ``κ != 1`` on every row (divided by a constant);
* ``"equal weights"``: every label row has the same weight ``c``: a per-sample sum or a token mean, each times a
  constant. Judged (:func:`judge`) by ``c s`` and ``c N_step``:

  - ``c s = 1 != c N_step``: ``"per-sample sum"``;
  - ``c N_step = 1 != c s``: ``"batch token mean"``, **refused**, unless an earlier step of the signature had
    ``c N_step != 1``;
  - otherwise, at a later step with another ``N_step``: ``c s`` kept, ``"per-sample sum (scaled)"``; ``c N_step``
    kept, ``"batch token mean"`` (refused); neither, ``"unverified weights"``.

  When every *labelled* sample has the same ``n`` rows (one label per sample, as a classifier with ignored labels
  has, or one labelled sample), a token mean, a per-sample sum and a per-sample mean differ by constants only: no
  refusal from one step, only from the comparison with another (``c s n`` kept also verifies);
* ``"uninformative"``: every sample has the same number of label rows (the token mean *is* the per-sample mean,
  exact), or none;
* ``"not recognised"``: rows that are not a plain softmax cross-entropy's (label smoothing, a temperature, another
  loss, two losses on the same logits, a class-weighted cross-entropy reads as "unverified weights");
* ``"unverified weights"``: a cross-entropy whose weights fit none of these forms: logged, not refused.

A refusal is a :class:`fastdp.probe.StructureError` raised by ``optimizer.step()`` before anything is released,
naming the output, the weight, the counts and the fix; the step's sums are discarded, and on several ranks every
rank raises (as for the engine's other checks). The check of an input signature (:func:`fastdp.probe.signature`)
ends with a verdict other than uninformative, not recognised and equal weights, or after ``MAX_TRIES`` judged passes
without one (or ``MAX_ARMS`` forward calls); a refusal starts the count again (a loop that catches the error is
refused again). ``PrivacyEngine(verify_loss=False)`` turns it off.

**What it does not see**, and so does not refuse: a loss that is not a softmax cross-entropy of a model output as
returned (a temperature or label smoothing make the rows "not recognised"; slicing keeps the form), a divisor that
depends on the batch in another way (e.g. the padded length, the batch's sum of class weights), and losses that
couple samples through the outputs (in-batch negatives, contrastive losses): their gradient has no per-row form to
read. ``fastdp.losses.check_per_sample_loss`` checks any loss function, when called. A token mean times a constant
other than 1, and a mean over the labelled samples of one-label rows, are refused only at a later step with another
label count: the steps before are released with their wrong per-sample weights. A per-sample token sum divided by a
constant that happens to give every label row the weight ``1/N_step`` in the first informative step is refused (a
false refusal: ``verify_loss=False``).

Cost, per checked pass: one read of the logits at the forward (log-sum-exp and top-3, in row chunks of at most
``CHUNK`` elements) and one of their gradient in the backward pass, both on the device without a host read; the
verdicts are read on the host when the step is released, a few reads per checked pass.

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
MAX_TRIES = 8  # checked backward passes per input signature without a verdict (a refusal starts the count again)
MAX_ARMS = 64  # forward calls per input signature summarised for the check (a backward pass may not follow)
CHUNK = 1 << 22  # elements of the logits (or their gradient) read at once
MAX_OUTPUTS = 32  # model outputs checked per call
_DEPTH = 4  # nesting of tuples, lists and dicts searched for outputs
_TINY = 1e-30  # a kept class's probability below this (underflow) gives no estimate
#: relative tolerance of the weights read from a gradient of this dtype (float32: rounding of p and of G's sum)
_TOL = {torch.float64: 1e-6, torch.float32: 1e-3}
_HALF_TOL = 6e-2  # a bf16 log-softmax's output rounding, |log p| 2^-9, is 2 % at V = 50k
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
class Observation:
    """An ``"equal weights"`` step of a signature: ``c s``, ``c N_step`` (``N_step``: the step's label rows) and,
    when every labelled sample had ``n`` rows, ``c s n`` (else ``None``)."""

    step: int
    per_sample: float
    per_token: float
    rows: int
    per_sample_mean: float | None


@dataclass
class LossCheck:
    """The loss check's state in one engine, per input signature: the passes checked (``tries``) and forward calls
    summarised (``arms``), whether a verdict came (``done``), the first ``"equal weights"`` step (``equal``); and the
    passes of the step in progress (``pending``, judged by :func:`settle`)."""

    tries: dict[Any, int] = field(default_factory=dict)
    arms: dict[Any, int] = field(default_factory=dict)
    done: set[Any] = field(default_factory=set)
    equal: dict[Any, Observation] = field(default_factory=dict)
    pending: list[Pending] = field(default_factory=list)
    steps: int = 0  # steps settled

    def wanted(self, sig: Any) -> bool:
        return (sig not in self.done and self.tries.get(sig, 0) < MAX_TRIES
                and self.arms.get(sig, 0) < MAX_ARMS)


def _outputs(out: Any, label: str, depth: int = 0) -> Iterator[tuple[str, Any]]:
    if isinstance(out, torch.Tensor):
        yield label, out
    elif depth < _DEPTH and isinstance(out, Mapping):
        for k, v in out.items():
            yield from _outputs(v, f"{label}[{k!r}]", depth + 1)
    elif depth < _DEPTH and isinstance(out, (tuple, list)):
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
    ``k`` other than the label (``argmin_k G_rk``, or the most probable class when no entry is negative: a
    saturated row); ``labelled``: the row's gradient is not 0; ``fits``: the row is
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
            # a saturated row (the label's probability rounded to 1: its entry 0, none negative): the most probable
            y = torch.where(gc.gather(-1, y) < 0, y, cls[:, :1])
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
            ok = has & agree & sums_to_zero & (gy <= 0) & (p_label >= -tol) & (p_label <= 1 + tol)
            ws.append(torch.where(has, w, torch.zeros_like(w)))
            labs.append(labelled)
            fits.append(ok | ~labelled)
    return torch.cat(ws), torch.cat(labs), torch.cat(fits)


@dataclass
class Verdict:
    """One checked output of one backward pass: ``kind`` (see the module docstring), its ``N`` label rows, and for
    ``"equal weights"`` (or a scaled per-sample mean) the weight ``c`` (``κ``), the smallest and largest count of
    a sample, and ``n`` when every labelled sample has ``n`` label rows (else 0)."""

    kind: str
    total: int = 0
    weight: float = 0.0
    counts: tuple[int, int] = (0, 0)
    same_count: int = 0


def verdict(w: torch.Tensor, labelled: torch.Tensor, fits: torch.Tensor, B: int, scale: float, mean: bool,
            tol: float) -> Verdict:
    """The verdict on rows of ``B`` samples (``w``, ``labelled``, ``fits``: ``(B*R,)`` from :func:`row_weights`),
    the weights divided by the loss scale ``scale``; ``mean``: ``loss_reduction == "mean"``.

    A pass alone tells a per-sample mean (weights ``1/(s n_i)``, or ``κ/(s n_i)``) from equal weights ``c`` (a
    per-sample sum or a token mean, each times a constant), which :func:`judge` tells apart with the step's label
    count and earlier steps. When every sample has as many label rows, a token mean *is* a per-sample mean:
    ``"uninformative"``."""
    if not bool(fits.all()):
        return Verdict("not recognised")
    lab = labelled.reshape(B, -1)
    n = lab.sum(1)
    N = int(n.sum())
    counts = (int(n.min()), int(n.max()))
    if N == 0 or counts[0] == counts[1]:
        return Verdict("uninformative", N)
    wl = w.reshape(B, -1)[lab].double() / scale
    n_row = n[:, None].expand_as(lab)[lab].double()
    c = float(wl.median())
    if bool(((wl / c - 1).abs() <= tol).all()):
        same = counts[1] if int(n[n > 0].min()) == counts[1] else 0
        return Verdict("equal weights", N, c, counts, same)
    q = wl * (float(B) if mean else 1.0) * n_row  # 1 on every label row for a per-sample mean
    if bool(((q - 1).abs() <= 3 * tol).all()):
        return Verdict("per-sample mean", N)
    kappa = float(q.median())
    if bool(((q / kappa - 1).abs() <= 3 * tol).all()):
        return Verdict("per-sample mean (scaled)", N, kappa, counts)
    return Verdict("unverified weights", N, c, counts)


def observe(v: Verdict, s: float, step_rows: int, step: int) -> Observation:
    c = v.weight
    return Observation(step, c * s, c * step_rows, step_rows, c * s * v.same_count if v.same_count else None)


def judge(now: Observation, first: Observation | None, tol: float) -> str:
    """An ``"equal weights"`` pass (weight ``c``; ``s`` = ``B`` or 1; ``N_step`` the label rows of every pass of
    its step: a token mean divides by those of the logical batch, e.g. Hugging Face's ``num_items_in_batch`` under
    gradient accumulation), given the signature's first such step ``first``:

    * when the labelled samples' counts differ (a per-sample mean is excluded): ``c s = 1 != c N_step``:
      ``"per-sample sum"``; ``c N_step = 1 != c s``: ``"batch token mean"``, unless an earlier step had
      ``c N_step != 1`` (then it is no plain token mean: compared as below);
    * when every labelled sample has ``n`` rows, a token mean, a per-sample sum and a per-sample mean differ by
      constants only (e.g. one labelled sample): compared as below, never refused from one step;
    * against ``first`` (another step, another ``N_step``): ``c s`` (or ``c s n``) kept and ``c N_step`` not:
      ``"per-sample sum (scaled)"``; ``c N_step`` kept and neither other: ``"batch token mean"``; none kept:
      ``"unverified weights"``; otherwise ``"equal weights"`` (judged again at a later step)."""
    token, per_sample = abs(now.per_token - 1) <= tol, abs(now.per_sample - 1) <= 3 * tol
    if now.per_sample_mean is None:
        if per_sample and not token:
            return "per-sample sum"
        if token and not per_sample and (first is None or abs(first.per_token - 1) <= tol):
            return "batch token mean"
    if first is None or first.step == now.step or first.rows == now.rows:
        return "equal weights"
    keeps_token = abs(now.per_token / first.per_token - 1) <= tol
    keeps_sum = abs(now.per_sample / first.per_sample - 1) <= 3 * tol
    keeps_mean = (now.per_sample_mean is not None and first.per_sample_mean is not None
                  and abs(now.per_sample_mean / first.per_sample_mean - 1) <= 3 * tol)
    if (keeps_sum or keeps_mean) and not keeps_token:
        kept = now.per_sample if keeps_sum else now.per_sample_mean
        form = "per-sample sum" if keeps_sum else "per-sample mean"
        return form if abs(kept - 1) <= 3 * tol else f"{form} (scaled)"
    if keeps_token and not keeps_sum and not keeps_mean:
        return "batch token mean"
    return "equal weights" if keeps_token else "unverified weights"


def arm(engine: Any, state: LossCheck, sig: Any, output: Any, B: int) -> None:
    """After a forward call of the model with signature ``sig`` and batch ``B``: summarise its candidate logits
    and hook their gradients (the check runs in the backward pass)."""
    cands = _candidates(output, B)
    if not cands:
        return
    state.arms[sig] = state.arms.get(sig, 0) + 1
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
    """The tensor hook on a checked output: read the rows' weights (no host read: judged at the step). A second
    gradient of the same output (``retain_graph``, ``torch.autograd.grad``) replaces the first: its rows are
    counted once in the step's label rows."""
    state.pending = [p for p in state.pending if p.summ is not summ]
    state.pending.append(Pending(sig, summ, row_weights(g, summ), _loss_scale(engine), _tol(g.dtype)))


def settle(engine: Any, state: LossCheck) -> StructureError | None:
    """Judge the backward passes checked since the last step (called when a step is released, before anything
    is): count the verdicts, end the check of the signatures that got one, and return the refusal of a token mean
    over the batch (the release stage raises it and discards the step; on several ranks, on every rank)."""
    pending, state.pending = state.pending, []
    if not pending:
        return None
    state.steps += 1
    stats = engine.probe_stats
    mean = engine.loss_reduction == "mean"
    judged = [(p, verdict(*p.weights, p.summ.batch, float(p.scale), mean, p.tol)) for p in pending]
    step_rows = sum(v.total for _, v in judged if v.kind != "not recognised")
    error = None
    for p, v in judged:
        stats["loss_checks"] += 1
        state.tries[p.sig] = state.tries.get(p.sig, 0) + 1
        kind = v.kind
        if kind == "equal weights":
            obs = observe(v, float(p.summ.batch) if mean else 1.0, step_rows, state.steps)
            kind = judge(obs, state.equal.get(p.sig), p.tol)
            if kind == "equal weights":
                state.equal.setdefault(p.sig, obs)
        stats["loss_verdicts"][kind] = stats["loss_verdicts"].get(kind, 0) + 1
        if kind == "batch token mean":
            state.tries[p.sig] = 0  # refused again while the loss stays what it is
            error = error or StructureError(_message(engine, p.summ, v, step_rows, len(pending), p.tol))
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


def _message(engine: Any, summ: RowSummary, v: Verdict, step_rows: int, passes: int, tol: float) -> str:
    mean = engine.loss_reduction == "mean"
    c = v.weight
    over = (f"the {step_rows} label rows of this step's {passes} checked backward passes" if passes > 1
            else f"the batch's {step_rows} label rows")
    weight = (f"weight {c:.6g} = 1/{step_rows}, one over {over}" if abs(c * step_rows - 1) <= tol
              else f"weight {c:.6g} = {c * step_rows:.6g}/{step_rows}, a constant over {over}, the same constant "
                   "as in an earlier step with another number of label rows")
    return (f"the loss is a token mean over the whole batch: every label row of the model's {summ.label} has "
            f"{weight} (a sample has {v.counts[0]} to {v.counts[1]}; batch of {summ.batch}). Under "
            f"loss_reduction={engine.loss_reduction!r} sample i is then weighted by {'B * ' if mean else ''}"
            f"n_i/{step_rows} (up to a constant), a factor set by the other samples' numbers of labels: clipping "
            "acts on the wrong per-sample gradients and removing one sample rescales all the others, so the privacy "
            "guarantee fails. Nothing was released. Average within each sample instead: "
            "fastdp.losses.causal_lm_loss(logits, labels).mean() (token_classification_loss, seq2seq_loss, or "
            "per_sample_mean(values, mask) for other token losses), or sum the tokens of each sample; under "
            "gradient accumulation let the engine average (one loss_reduction='mean' loss per backward pass), not "
            "a divisor counted over the accumulated batches. This check (verify_loss=True; "
            "docs/reference/losses.md) reads the weights of a softmax cross-entropy from its gradient; a loss that "
            "sums the tokens within each sample and is divided by a constant reads the same if that constant "
            f"happens to give every label row the weight {c:.6g} here: only then pass verify_loss=False.")
