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

**Verdicts** (:mod:`fastdp.loss_verdicts`, which states the rules), per output and per pass, judged when the step
is released (:func:`settle`): ``"per-sample mean"`` / ``"per-sample sum"`` (each possibly ``" (scaled)"``: times a
constant), ``"batch token mean"`` (**refused**), ``"equal weights"`` (a per-sample sum or a token mean times a
constant, not told apart yet), ``"uninformative"`` (every sample has as many label rows: a token mean is then
exact), ``"not recognised"`` (no plain softmax cross-entropy: label smoothing, a temperature, another loss) and
``"unverified weights"`` (logged). A token mean is recognised by its weight ``c`` on every label row: ``1/N`` (the
pass's label rows) or ``1/N_step`` (the step's, as Hugging Face's ``num_items_in_batch`` counts them under gradient
accumulation) in one pass; times a constant, by ``c N`` (or ``c N_step``) staying the same from pass to pass while
``c s`` (``s = B`` or 1) does not. A pass whose labelled samples have about as many label rows each (one label per
sample, one labelled sample, nearly full rows) cannot tell a token mean from a per-sample one: it is only compared
with other passes, never refused alone.

A refusal is a :class:`fastdp.probe.StructureError` raised by ``optimizer.step()`` before anything is released,
naming the output, the weight, the counts and the fix; the step's sums are discarded (with the check's passes), and
on several ranks every rank raises (as for the engine's other checks). The check of an output of an input signature
(:func:`fastdp.probe.signature`) ends with a verdict other than uninformative, not recognised and equal weights, or
when it is not recognised in a pass where another output was (a hidden state, not logits). A signature is no longer
checked once all its outputs are done, or after ``MAX_TRIES`` judged passes without it (a pass whose outputs were
all uninformative counts toward ``MAX_UNINFORMATIVE`` instead, and after ``SPARSE_AFTER`` of them only one forward
call in ``SPARSE_EVERY`` is checked), or ``MAX_ARMS`` forward calls; a refusal starts the
count again (a loop that catches the error is refused again). When a signature's check ends with none of its outputs
ever read as a cross-entropy, one warning per engine says its loss was not verified.
``PrivacyEngine(verify_loss=False)`` turns the check off. Its state is not saved in checkpoints: after
``load_state_dict`` the check starts again (a token mean times a constant may then have one more step released).

**What it does not see**, and so does not refuse: a loss that is not a softmax cross-entropy of a model output as
returned (a temperature or label smoothing make the rows "not recognised"; slicing keeps the form), a divisor that
depends on the batch in another way (e.g. the padded length, the batch's sum of class weights), and losses that
couple samples through the outputs (in-batch negatives, contrastive losses): their gradient has no per-row form to
read (the loss trace, :mod:`fastdp.loss_trace`, refuses those). ``fastdp.losses.check_per_sample_loss`` checks any
loss function, when called. After ``SPARSE_AFTER`` fully labelled passes only one forward call in ``SPARSE_EVERY``
is checked: a token mean whose first padded batch comes later is refused at the next checked call, up to
``SPARSE_EVERY - 1`` steps later. A token mean times a constant other than 1, and a mean over the labelled samples
of one-label rows (a classifier with ignored labels), are refused only from the first pass that another pass with
another label count contradicts: the steps before are released with their wrong per-sample weights. A per-sample
token sum divided by a constant that happens to give every label row the weight ``1/N`` in the first pass of a
signature is refused (a false refusal: ``verify_loss=False``).

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

from fastdp.loss_verdicts import Observation, Verdict, judge, observe, verdict
from fastdp.probe import StructureError

logger = logging.getLogger(__name__)

TOP = 3  # largest logits kept per row
MAX_TRIES = 8  # judged passes per input signature without a verdict (a refusal starts the count again)
MAX_UNINFORMATIVE = 64  # passes per input signature whose outputs were all uninformative (equal label counts)
SPARSE_AFTER, SPARSE_EVERY = 2, 8  # after 2 such passes, one forward call in 8 is checked
MAX_ARMS = 256  # forward calls per input signature summarised for the check (a backward pass may not follow)
CHUNK = 1 << 22  # elements of the logits (or their gradient) read at once
MAX_OUTPUTS = 32  # model outputs checked per call
MAX_OBSERVATIONS = 16  # equal-weights passes kept per output (fastdp.loss_verdicts.judge compares with them)
_DEPTH = 4  # nesting of tuples, lists and dicts searched for outputs
_TINY = 1e-30  # a kept class's probability below this (underflow) gives no estimate
#: relative tolerance of the weights read from a gradient of this dtype (float32: rounding of p and of G's sum)
_TOL = {torch.float64: 1e-6, torch.float32: 1e-3}
_HALF_TOL = 6e-2  # a bf16 log-softmax's output rounding, |log p| 2^-9, is 2 % at V = 50k
#: verdicts after which an output is checked again
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
    """The loss check's state in one engine. Per input signature: the passes judged (``tries``), the forward calls
    summarised (``arms``), the outputs seen (``labels``); per (signature, output): whether a verdict came
    (``done``) and the equal-weights passes so far (``observations``); and the passes of the step in progress
    (``pending``, judged by :func:`settle`)."""

    tries: dict[Any, int] = field(default_factory=dict)
    arms: dict[Any, int] = field(default_factory=dict)
    labels: dict[Any, set[str]] = field(default_factory=dict)
    done: set[tuple[Any, str]] = field(default_factory=set)
    observations: dict[tuple[Any, str], list[Observation]] = field(default_factory=dict)
    pending: list[Pending] = field(default_factory=list)
    uninformative: dict[Any, int] = field(default_factory=dict)  # passes whose outputs were all uninformative
    forwards: dict[Any, int] = field(default_factory=dict)  # forward calls of the signature (checked or not)
    recognised: set[Any] = field(default_factory=set)  # signatures with an output read as a cross-entropy
    steps: int = 0  # steps settled
    calls: int = 0  # forward calls summarised (the id of a pass in Pending)
    warned: bool = False  # the warning that a loss could not be read (once per engine)

    def take(self, sig: Any) -> bool:
        """Whether to check this forward call of signature ``sig`` (counted). After ``SPARSE_AFTER`` passes whose
        outputs were all uninformative (fully labelled batches: every one of a classifier's, a packed LM's), only
        every ``SPARSE_EVERY``-th call is checked, so that steady training does not pay for the check."""
        calls = self.forwards[sig] = self.forwards.get(sig, 0) + 1
        labels = self.labels.get(sig)
        finished = bool(labels) and all((sig, label) in self.done for label in labels)
        uninformative = self.uninformative.get(sig, 0)
        if (finished or self.tries.get(sig, 0) >= MAX_TRIES or self.arms.get(sig, 0) >= MAX_ARMS
                or uninformative >= MAX_UNINFORMATIVE):
            return False
        return uninformative < SPARSE_AFTER or calls % SPARSE_EVERY == 0


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


def _row_chunks(t: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
    """``t`` ``(B, ..., V)`` as rows ``(B*R, V)``, in chunks of at most ``CHUNK`` elements, in the accumulation
    dtype: ``(rows, chunk)`` pairs."""
    V = t.shape[-1]
    x = t.detach().reshape(-1, V)
    step = max(1, CHUNK // V)
    for s in range(0, x.shape[0], step):
        yield slice(s, s + step), x[s:s + step].to(_acc(t.dtype))


def summarise(label: str, y: torch.Tensor) -> RowSummary:
    """Per row of ``y`` ``(B, ..., V)``: log-sum-exp and the ``TOP`` largest logits with their classes."""
    V = y.shape[-1]
    lse, top, classes = [], [], []
    with torch.no_grad():
        for _, xc in _row_chunks(y):
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
    tol = _tol(g.dtype)
    ws, labs, fits = [], [], []
    with torch.no_grad():
        for rows, gc in _row_chunks(g):
            lse, top, cls = summ.lse[rows], summ.top[rows], summ.classes[rows]
            y = gc.argmin(-1, keepdim=True)
            g_min = gc.gather(-1, y)[:, 0]
            labelled = ~((g_min == 0) & (gc.amax(-1) == 0))  # not all zero (a NaN row counts as labelled)
            # a saturated row (the label's probability rounded to 1: its entry 0, none negative): the most probable
            y = torch.where((g_min < 0)[:, None], y, cls[:, :1])
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


def arm(engine: Any, state: LossCheck, sig: Any, output: Any, B: int) -> None:
    """After a forward call of the model with signature ``sig`` and batch ``B``: summarise its candidate logits
    and hook their gradients (the check runs in the backward pass)."""
    cands = _candidates(output, B)
    if not cands:
        return
    state.arms[sig] = state.arms.get(sig, 0) + 1
    state.calls += 1
    for label, y in cands:
        state.labels.setdefault(sig, set()).add(label)
        if (sig, label) not in state.done:
            y.register_hook(partial(_on_grad, engine, state, sig, state.calls, summarise(label, y)))


def _loss_scale(engine: Any) -> torch.Tensor | float:
    link = engine._release.scaler
    return 1.0 if link is None else link.loss_scale()


@dataclass
class Pending:
    """A checked backward pass of one output, judged when the step is released: the rows' weights
    (:func:`row_weights`, on the device) and what the verdict needs."""

    sig: Any
    call: int  # the forward call (LossCheck.calls) whose output it is
    summ: RowSummary
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    scale: torch.Tensor | float
    tol: float


def _on_grad(engine: Any, state: LossCheck, sig: Any, call: int, summ: RowSummary, g: torch.Tensor) -> None:
    """The tensor hook on a checked output: read the rows' weights (no host read: judged at the step). A second
    gradient of the same output (``retain_graph``, ``torch.autograd.grad``) replaces the first: its rows are
    counted once in the step's label rows."""
    state.pending = [p for p in state.pending if p.summ is not summ]
    state.pending.append(Pending(sig, call, summ, row_weights(g, summ), _loss_scale(engine), _tol(g.dtype)))


def settle(engine: Any, state: LossCheck) -> StructureError | None:
    """Judge the backward passes checked since the last step (called when a step is released, before anything
    is; :mod:`fastdp.loss_verdicts`): count the verdicts, end the check of the outputs that got one, and return the
    refusal of a token mean (the release stage raises it and discards the step; on several ranks, on every rank).

    Budget, per input signature: a pass (one forward call's outputs) counts toward ``MAX_TRIES`` unless all its
    outputs were uninformative (those count toward ``MAX_UNINFORMATIVE``: a classifier whose batches are mostly
    fully labelled needs two passes with ignored labels to be judged). An output not recognised in a pass where
    another output was recognised is not logits (a hidden state): it is no longer checked."""
    pending, state.pending = state.pending, []
    if not pending:
        return None
    state.steps += 1
    stats = engine.probe_stats
    mean = engine.loss_reduction == "mean"
    judged = [(p, verdict(*p.weights, p.summ.batch, float(p.scale), mean, p.tol)) for p in pending]
    step_rows: dict[tuple[Any, str], int] = {}
    recognised_calls = set()
    for p, v in judged:
        if v.kind != "not recognised":
            step_rows[p.sig, p.summ.label] = step_rows.get((p.sig, p.summ.label), 0) + v.total
            recognised_calls.add(p.call)
            state.recognised.add(p.sig)
    for call, sig in {p.call: p.sig for p, _ in judged}.items():
        kinds = {v.kind for p, v in judged if p.call == call}
        budget = state.uninformative if kinds == {"uninformative"} else state.tries
        budget[sig] = budget.get(sig, 0) + 1
    error = None
    for p, v in judged:
        key = (p.sig, p.summ.label)
        stats["loss_checks"] += 1
        kind = v.kind
        if kind == "equal weights":
            earlier = state.observations.setdefault(key, [])
            obs = observe(v, float(p.summ.batch) if mean else 1.0, step_rows[key], state.steps)
            kind = judge(obs, earlier, p.tol)
            if len(earlier) < MAX_OBSERVATIONS:
                earlier.append(obs)
        stats["loss_verdicts"][kind] = stats["loss_verdicts"].get(kind, 0) + 1
        if kind == "batch token mean":
            state.tries[p.sig] = 0  # refused again while the loss stays what it is
            error = error or StructureError(_message(engine, p.summ, v, step_rows[key],
                                                     sum(1 for q, _ in judged if q.summ.label == p.summ.label), p.tol))
            continue
        if kind not in AGAIN or (kind == "not recognised" and p.call in recognised_calls):
            state.done.add(key)  # a verdict; or not the loss's logits (another output of the call was read)
        if kind == "unverified weights":
            logger.info("loss check: the gradient at %s has the form of a softmax cross-entropy's, with weights "
                        "that vary between label rows (median %.6g; %d label rows, %d to %d per sample) and fit "
                        "neither a per-sample mean nor a per-sample sum, nor a constant times either: per-sample "
                        "weights (a focal loss, importance weights) or weights that depend on the other samples' "
                        "labels (a class-weighted mean written by hand); not verified by the loss check",
                        p.summ.label, v.weight, v.total, *v.counts)
        else:
            logger.debug("loss check: %s: %s", p.summ.label, kind)
    for sig in {p.sig for p, _ in judged}:
        if state.tries.get(sig, 0) >= MAX_TRIES and sig not in state.recognised and not state.warned:
            state.warned = True
            logger.warning("loss check: the loss on the model's outputs (%s) is not a plain softmax cross-entropy "
                           "the check can read (label smoothing, a temperature, another loss), so the engine did "
                           "not verify that it is a mean or sum of per-sample losses; check it once with "
                           "fastdp.losses.check_per_sample_loss (docs/reference/losses.md)",
                           ", ".join(sorted(state.labels.get(sig, ()))))
    return error


def _message(engine: Any, summ: RowSummary, v: Verdict, step_rows: int, passes: int, tol: float) -> str:
    mean = engine.loss_reduction == "mean"
    c = v.weight
    over = (f"the {step_rows} label rows of this step's {passes} checked backward passes" if passes > 1
            else f"the batch's {v.total} label rows")
    if abs(c * step_rows - 1) <= tol:
        weight = f"weight {c:.6g} = 1/{step_rows}, one over {over}"
    elif abs(c * v.total - 1) <= tol:
        weight = f"weight {c:.6g} = 1/{v.total}, one over its backward pass's {v.total} label rows"
    else:
        weight = (f"weight {c:.6g}, a constant over the label rows ({v.total} in this pass), the same as in an "
                  "earlier pass with another number of label rows")
    return (f"the loss is a token mean over the whole batch: every label row of the model's {summ.label} has "
            f"{weight} (a sample has {v.counts[0]} to {v.counts[1]}; batch of {summ.batch}). Under "
            f"loss_reduction={engine.loss_reduction!r} sample i is then weighted by {'B * ' if mean else ''}"
            "n_i / (the label rows of the batch), up to a constant: a factor set by the other samples' numbers of "
            "labels, so clipping acts on the wrong per-sample gradients and removing one sample rescales all the "
            "others: the privacy guarantee fails. Nothing was released. Average within each sample instead: "
            "fastdp.losses.causal_lm_loss(logits, labels).mean() (token_classification_loss, seq2seq_loss, or "
            "per_sample_mean(values, mask) for other token losses), or sum the tokens of each sample; under "
            "gradient accumulation let the engine average (one loss_reduction='mean' loss per backward pass), not "
            "a divisor counted over the accumulated batches. This check (verify_loss=True; "
            "docs/reference/losses.md) reads the weights of a softmax cross-entropy from its gradient; a loss that "
            "sums the tokens within each sample and is divided by a constant reads the same if that constant "
            f"happens to give every label row the weight {c:.6g} here: only then pass verify_loss=False.")
