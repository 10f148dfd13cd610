"""What a user reads when the model's own forward fails on an empty batch (zero rows).

Under Poisson sampling a logical batch, or one micro-batch of it, can be empty. The engine handles a batch of zero
rows (it contributes nothing; the step still releases noise once and is accounted), but many models cannot run one:
every Hugging Face attention layer reshapes its projections with ``view(B, T, -1, head_dim)``, which raises
``RuntimeError: cannot reshape tensor of 0 elements ...`` for ``B = 0``, with or without an engine. That message
says nothing about sampling. The capture stage calls :func:`note_failed_empty_forward` when an outermost forward
call of the model with batch size 0 raises: the model's exception is re-raised unchanged (same type, same message,
nothing wrapped), with a note (:meth:`BaseException.add_note`, printed under the traceback) that says what to do.

It may touch: the ``__notes__`` of the exception it is given; nothing else.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: the note added to the exception of a model that failed on a batch of zero rows under a PrivacyEngine
EMPTY_BATCH_NOTE = (
    "fastdp: this forward call of the model had a batch of 0 rows (an empty Poisson batch), and the model itself "
    "raised on it; many models cannot run 0 rows (Hugging Face attention layers reshape with -1). Nothing of this "
    "call was recorded. Skip the forward and backward pass for an empty batch: if the whole logical batch is empty, "
    "call engine.empty_step() instead of optimizer.step() (the step still counts: it releases noise only and is "
    "accounted); if only one micro-batch of a larger step is empty, just skip it "
    "(docs/guide/huggingface.md#empty-batches).")


def note_failed_empty_forward(exc: BaseException | None) -> None:
    """Add :data:`EMPTY_BATCH_NOTE` to ``exc``, the exception a forward call of the model with batch size 0 raised
    (once; an ``Exception`` only: a ``KeyboardInterrupt`` is left alone). The exception is otherwise unchanged."""
    if not isinstance(exc, Exception):
        return
    if EMPTY_BATCH_NOTE in getattr(exc, "__notes__", ()):
        return
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(EMPTY_BATCH_NOTE)
    else:  # pragma: no cover - Python 3.10: the note goes to the log
        logger.error("%s", EMPTY_BATCH_NOTE)


__all__ = ["EMPTY_BATCH_NOTE", "note_failed_empty_forward"]
