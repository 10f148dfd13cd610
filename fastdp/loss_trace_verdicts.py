"""The loss trace's state and verdicts: the budget per input signature, the passes of the step in progress, and the
refusal of a loss that couples samples (judged when the step is released).

Part of :mod:`fastdp.loss_trace` (which traces the loss and records, at each ``backward``, the loss's
:class:`fastdp.loss_deps.Dep` and its :class:`fastdp.loss_deps.Book`). A pass is ``separable`` (a sum of per-sample
terms: the engine's clipping is exact), ``coupled`` (refused: :class:`fastdp.probe.StructureError` before anything
is released) or ``unverified`` (a function without a rule, or a gradient path the trace did not follow: logged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from fastdp.loss_deps import COUPLED, PAIRS, Book, Dep
from fastdp.probe import StructureError

logger = logging.getLogger(__name__)

TRACE_PASSES = 2  # judged backward passes per input signature (a refusal starts the count again)
MAX_ARMS = 64  # forward calls traced per input signature (a backward pass may not follow)
_LOST = "backward from an untraced tensor"  # the trace lost the loss (why: the functions in Book.unknown)


@dataclass
class LossTrace:
    """The loss trace's state in one engine: per input signature, the passes judged (``passes``) and the forward
    calls traced (``arms``); the book of the forward calls since the last backward pass (``book``) and its
    signatures; the backward passes of the step in progress (``pending``: the loss's ``Dep``, its book, the
    signatures)."""

    every: bool = False  # trace every backward pass (verify_loss="strict"), not the first TRACE_PASSES
    warned: bool = False  # an unverified pass was logged as a warning (once per engine)
    passes: dict[Any, int] = field(default_factory=dict)
    arms: dict[Any, int] = field(default_factory=dict)
    book: Book | None = None
    sigs: dict[int, set[Any]] = field(default_factory=dict)  # id(book) -> signatures of its forward calls
    pending: list[tuple[Dep | None, Book, frozenset[Any]]] = field(default_factory=list)

    def take(self, sig: Any) -> bool:
        """Whether to trace this forward call of signature ``sig`` (counted)."""
        if (not self.every and self.passes.get(sig, 0) >= TRACE_PASSES) or self.arms.get(sig, 0) >= MAX_ARMS:
            return False
        self.arms[sig] = self.arms.get(sig, 0) + 1
        return True

    def close(self) -> None:
        """End of a backward pass: the next forward call starts a new book (other samples). A book whose outputs
        were traced but whose backward pass started from an untraced tensor (the trace lost the loss) is judged
        unverified."""
        book, self.book = self.book, None
        if book is not None and not book.closed and id(book) in self.sigs:
            book.closed = True
            book.miss(_LOST)
            self.pending.append((None, book, frozenset(self.sigs.pop(id(book)))))


def verdict(d: Dep | None, book: Book) -> str:
    """``"coupled"``, ``"separable"`` or ``"unverified"`` (an operation on a traced tensor had no rule, or the
    backward pass did not start from a traced tensor: ``d`` is ``None``)."""
    if d is not None and d.kind in (COUPLED, PAIRS) and d.grad:
        return "coupled"
    return "unverified" if book.unknown else "separable"


def settle(engine: Any, state: LossTrace) -> StructureError | None:
    """Judge the traced backward passes of the step (called when the step is released, before anything is):
    count the verdicts, end the trace of the signatures that have ``TRACE_PASSES``, and return the refusal of a
    coupled loss (and, with ``verify_loss="strict"``, of an unverified one)."""
    pending, state.pending = state.pending, []
    error = None
    strict = getattr(engine, "verify_loss", True) == "strict"
    stats = engine.probe_stats.setdefault("loss_traces", {})
    for d, book, sigs in pending:
        v = verdict(d, book)
        stats[v] = stats.get(v, 0) + 1
        refused = v == "coupled" or (strict and v == "unverified")
        for sig in sigs:
            state.passes[sig] = 0 if refused else state.passes.get(sig, 0) + 1
            if refused or state.every:  # (every pass traced: MAX_ARMS bounds the calls between judged passes)
                state.arms[sig] = 0
        unknown = _unknown(book)
        if v == "coupled" and error is None and d is not None:
            error = StructureError(_message(engine, d))
        elif v == "unverified" and strict:
            error = error or StructureError(_strict_message(unknown))
        elif v == "unverified":
            log = logger.info if state.warned else logger.warning
            state.warned = True
            log("loss trace: the loss was not verified to be a sum of per-sample terms (it was not refused either): "
                "the trace does not follow %s. verify_loss=\"strict\" refuses such passes; "
                "docs/reference/losses.md lists what the trace follows", unknown)
        else:
            logger.debug("loss trace: %s", v)
    return error


def _unknown(book: Book) -> str:
    """What the trace did not follow; that the backward pass then started from an untraced tensor is a
    consequence, named only when it is the whole story (the loss was built from values the trace never saw)."""
    named = [f"{k} (at {v})" for k, v in sorted(book.unknown.items()) if k != _LOST]
    return ", ".join(named) if named else _LOST


def _strict_message(unknown: str) -> str:
    return (f"verify_loss=\"strict\": the loss was not verified to be a sum of per-sample terms: the loss trace does "
            f"not follow {unknown}. Nothing was released. The engine's clipping bounds what one sample changes only "
            "if the loss is a sum (or mean) of terms that each depend on one sample, and in strict mode a loss the "
            "trace cannot verify is refused. Write the loss with operations the trace follows (docs/reference/"
            "losses.md, \"The loss trace\"), or pass verify_loss=True, which refuses the losses it finds coupled "
            "and logs the ones it cannot verify.")


def _message(engine: Any, d: Dep) -> str:
    why = d.why or ("pairs of samples reach the loss" if d.kind == PAIRS else "samples combined")
    return (f"the loss couples samples: {why}. The engine clips each sample's gradient, which bounds what one sample "
            "changes only if the loss is a sum (or mean) of terms that each depend on one sample; here a sample's "
            "gradient depends on the other samples' outputs, so removing one sample changes every other sample's "
            "contribution and the privacy guarantee fails. Nothing was released. Typical causes: in-batch "
            "negatives or a contrastive loss over the batch (logits = a @ b.T with a cross-entropy across samples), "
            "a softmax or log-sum-exp over the batch dimension, dividing by a statistic of the batch's outputs, "
            "weights or a baseline computed from other samples (a batch mean). Compute the loss of each sample from "
            "that sample alone (negatives from public data or from within the sample), or use a method built for "
            "such losses. This check (verify_loss=True; docs/reference/losses.md) traces the loss's torch "
            "operations from the model's outputs; if it is wrong here, pass verify_loss=False.")
