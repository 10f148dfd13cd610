"""The loss check's verdicts: from the weights a softmax cross-entropy gives each label row, which loss it is.

Pure functions over the rows' weights that :func:`fastdp.loss_check.row_weights` reads (see
:mod:`fastdp.loss_check` for what is read and when). Notation: ``B`` samples; ``s = B`` under
``loss_reduction="mean"``, ``1`` under ``"sum"``; ``n_i`` label rows of sample ``i``; ``N = Σ_i n_i`` those of one
backward pass of one output, ``N_step`` those of every checked pass of that output in the step (the micro-batches of
gradient accumulation); ``w_r`` the weight of label row ``r`` (the loss scale divided out).

**One pass** (:func:`verdict`):

* the same number of label rows in every sample, or none, or one labelled sample: ``"uninformative"`` (a token
  mean *is* then a per-sample mean, exact; one sample says nothing about how samples are weighted), unless the
  rows' weights differ (``"unverified weights"``: a class-weighted mean over the batch, say);
* every label row the same weight ``c``: ``"equal weights"``, a per-sample token sum or a token mean, each times a
  constant, judged by :func:`judge`. When the labelled samples' counts are within ``6 tol`` of each other (one
  label per sample, nearly full rows), a per-sample mean reads the same: the observation is
  *ambiguous* and carries ``c s n`` for that hypothesis too;
* ``w_r s n_i = 1``: ``"per-sample mean"``; ``= κ`` on every row: ``"per-sample mean (scaled)"``;
* otherwise ``"unverified weights"``.

**Equal weights** (:func:`judge`): four hypotheses, each with a quantity it keeps from pass to pass:

=====================  ==============  ===========================================================
hypothesis             keeps           meaning
=====================  ==============  ===========================================================
per-sample sum         ``c s``         token losses summed within each sample, times a constant
per-sample mean        ``c s n``       (ambiguous passes only) averaged within each sample
token mean (pass)      ``c N``         divided by the pass's label rows, times a constant
token mean (step)      ``c N_step``    divided by the step's label rows (``num_items_in_batch``)
=====================  ==============  ===========================================================

A hypothesis is consistent when its quantity is the same (within ``tol``; ``3 tol`` for the per-sample ones) in
this pass and in every earlier equal-weights pass of the output (where the count is the same, that is the weight:
the hypothesis predicts it unchanged). The consistent hypotheses decide: only token means: refused
(``"batch token mean"``); only per-sample ones: ``"per-sample sum"``/``"per-sample mean"`` (``" (scaled)"`` unless
the quantity is 1); none: ``"unverified weights"``; both kinds: the constant-1 versions break the tie on
unambiguous passes (``c N = 1`` or ``c N_step = 1`` against ``c s = 1``), else ``"equal weights"`` (judged again
at the next pass). With no earlier pass only the constant-1 versions can decide, and only on an unambiguous pass.

These hypotheses are per-sample forms times a *global* constant. A per-sample loss weighted by each sample's own
data (legitimate) gives unequal weights within a pass, "unverified weights", except where every labelled sample of a
pass happens to get the same weight: two such ambiguous passes can then read as a token mean and be refused (a false
refusal; ``verify_loss=False``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: an ambiguous pass: the labelled samples' counts within this many tolerances of each other
_AMBIGUOUS = 6
#: per-sample hypotheses are compared at this many tolerances (their quantities vary with the counts' rounding)
_LOOSE = 3


@dataclass
class Verdict:
    """One checked output of one backward pass: ``kind``, its ``N`` label rows, the weight ``c`` (or ``κ``), the
    smallest and largest count of a sample, and for an ambiguous pass the labelled samples' median count."""

    kind: str
    total: int = 0
    weight: float = 0.0
    counts: tuple[int, int] = (0, 0)
    typical_count: float = 0.0


def verdict(w: torch.Tensor, labelled: torch.Tensor, fits: torch.Tensor, B: int, scale: float, mean: bool,
            tol: float) -> Verdict:
    """The verdict on the rows of ``B`` samples (``w``, ``labelled``, ``fits``: ``(B*R,)``), weights divided by the
    loss scale ``scale``; ``mean``: ``loss_reduction == "mean"``; ``tol``: the weights' relative tolerance."""
    if not bool(fits.all()):
        return Verdict("not recognised")
    lab = labelled.reshape(B, -1)
    n = lab.sum(1)
    N = int(n.sum())
    counts = (int(n.min()), int(n.max()))
    if N == 0:
        return Verdict("uninformative", N)
    wl = w.reshape(B, -1)[lab].double() / scale
    c = float(wl.median())
    if counts[0] == counts[1]:  # every form gives every row one weight; unequal ones are none of them
        equal = c != 0 and bool(((wl / c - 1).abs() <= tol).all())
        return Verdict("uninformative", N) if equal else Verdict("unverified weights", N, c, counts)
    n_row = n[:, None].expand_as(lab)[lab].double()
    if bool(((wl / c - 1).abs() <= tol).all()):
        nl = n[n > 0].double()
        if nl.numel() == 1:  # one labelled sample: nothing about how samples are weighted against each other
            return Verdict("uninformative", N)
        ambiguous = float(nl.max() / nl.min()) - 1 <= _AMBIGUOUS * tol
        return Verdict("equal weights", N, c, counts, float(nl.median()) if ambiguous else 0.0)
    q = wl * (float(B) if mean else 1.0) * n_row  # 1 on every label row for a per-sample mean
    if bool(((q - 1).abs() <= _LOOSE * tol).all()):
        return Verdict("per-sample mean", N)
    kappa = float(q.median())
    if bool(((q / kappa - 1).abs() <= _LOOSE * tol).all()):
        return Verdict("per-sample mean (scaled)", N, kappa, counts)
    return Verdict("unverified weights", N, c, counts)


@dataclass
class Observation:
    """An equal-weights pass: its step, ``N`` and ``N_step``, and the quantities the hypotheses keep."""

    step: int
    rows: int
    step_rows: int
    per_sample: float  # c s
    per_pass: float  # c N
    per_step: float  # c N_step
    per_sample_mean: float | None  # c s n (ambiguous passes only)

    @property
    def ambiguous(self) -> bool:
        return self.per_sample_mean is not None


def observe(v: Verdict, s: float, step_rows: int, step: int) -> Observation:
    c = v.weight
    return Observation(step, v.total, step_rows, c * s, c * v.total, c * step_rows,
                       c * s * v.typical_count if v.typical_count else None)


def _close(a: float, b: float, tol: float) -> bool:
    return abs(a / b - 1) <= tol


def _consistent(now: Observation, earlier: Sequence[Observation], tol: float) -> dict[str, bool]:
    """Each hypothesis: is its quantity the same in ``now`` and every earlier pass? (Also where a count did not
    change: the hypothesis then predicts the same weight, and a weight that changed contradicts it.)"""
    loose = _LOOSE * tol
    ok = {"per-sample sum": True, "per-sample mean": now.ambiguous, "token mean (pass)": True,
          "token mean (step)": True}
    for e in earlier:
        ok["per-sample sum"] &= _close(now.per_sample, e.per_sample, loose)
        if now.ambiguous and e.ambiguous:
            ok["per-sample mean"] &= _close(now.per_sample_mean, e.per_sample_mean, loose)
        elif e.ambiguous is not now.ambiguous:
            ok["per-sample mean"] = False  # an unambiguous pass excludes it (equal weights, unequal counts)
        ok["token mean (pass)"] &= _close(now.per_pass, e.per_pass, tol)
        ok["token mean (step)"] &= _close(now.per_step, e.per_step, tol)
    return ok


def _at_one(now: Observation, earlier: Sequence[Observation], tol: float) -> dict[str, bool]:
    """The constant-1 versions (unambiguous passes only): the quantity is 1 in ``now`` and every earlier pass."""
    passes = [now, *earlier]
    loose = _LOOSE * tol
    return {"per-sample sum": all(abs(o.per_sample - 1) <= loose for o in passes),
            "token mean (pass)": all(abs(o.per_pass - 1) <= tol for o in passes),
            "token mean (step)": all(abs(o.per_step - 1) <= tol for o in passes)}


def _decide(consistent: dict[str, bool]) -> str | None:
    kinds = {"token" if h.startswith("token") else h for h, ok in consistent.items() if ok}
    if not kinds:
        return "unverified weights"
    if kinds == {"token"}:
        return "batch token mean"
    if "token" not in kinds:
        return "per-sample sum" if "per-sample sum" in kinds else "per-sample mean"
    return None


def judge(now: Observation, earlier: Sequence[Observation], tol: float) -> str:
    """The kind of an equal-weights pass ``now`` given the output's earlier ones (see the module docstring)."""
    unambiguous = not now.ambiguous and not any(e.ambiguous for e in earlier)
    if earlier:
        consistent = _consistent(now, earlier, tol)
        kind = _decide(consistent)
        if kind in ("per-sample sum", "per-sample mean"):
            kept = now.per_sample if kind == "per-sample sum" else now.per_sample_mean
            return kind if abs(kept - 1) <= _LOOSE * tol else f"{kind} (scaled)"
        if kind is not None:
            return kind
    if unambiguous:
        kind = _decide(_at_one(now, earlier, tol))
        if kind not in (None, "unverified weights"):
            return kind
    return "equal weights"
