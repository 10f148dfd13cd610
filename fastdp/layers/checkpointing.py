"""Reentrant activation checkpointing: detected and refused.

``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)`` runs ``fn`` under ``torch.no_grad()`` and
recomputes it in the backward pass only if one of ``args`` requires grad. Under ghost differentiation a hooked layer's
parameters do not require grad during its forward, so an input that required grad only through them (a raw
parameter of an ancestor, say) does not, the recomputation never happens, and the layers inside ``fn`` would be
released without their gradient (plain autograd computes it). Non-reentrant checkpointing (``use_reentrant=False``,
the default of HF ``gradient_checkpointing_enable``) records the graph as usual and is exact.

Inside a generic owner's per-sample replay (``torch.func.vjp``, which does not support saved-tensor hooks), a
non-reentrant checkpoint is run as a plain call (:func:`plain_checkpoints`): the replay is one sample at a time, so
the memory checkpointing saves does not matter there.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils import checkpoint as _checkpoint

_REENTRANT_FORWARD = getattr(getattr(_checkpoint, "CheckpointFunction", None), "forward", None)
_CODE = getattr(_REENTRANT_FORWARD, "__code__", None)


def in_reentrant_checkpoint(max_depth: int = 64) -> bool:
    """Whether the caller runs inside the forward of a reentrant ``torch.utils.checkpoint`` (looks at most
    ``max_depth`` frames up the Python stack)."""
    if _CODE is None:  # pragma: no cover - a torch without the reentrant implementation
        return False
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code is _CODE:
            return True
        frame = frame.f_back
    return False


class _NoHook:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_LOCK = threading.RLock()  # re-entered: a replay (plain_checkpoints) inside counted_checkpoints


@contextlib.contextmanager
def _hook_class(make: Callable[[type], type]) -> Iterator[bool]:
    """Within this context, non-reentrant ``torch.utils.checkpoint`` uses ``make(original)`` as its saved-tensor hook
    class (the one private torch name both contexts below replace). Yields whether that internal exists."""
    with _LOCK:
        original = getattr(_checkpoint, "_checkpoint_hook", None)
        if original is None:  # pragma: no cover - a torch without the internal
            yield False
            return
        _checkpoint._checkpoint_hook = make(original)
        try:
            yield True
        finally:
            _checkpoint._checkpoint_hook = original


@contextlib.contextmanager
def plain_checkpoints() -> Iterator[None]:
    """Within this context, non-reentrant ``torch.utils.checkpoint`` saves activations as usual instead of installing
    its saved-tensor hooks (which ``torch.func`` transforms refuse). A no-op on a torch without that internal (a
    replay then fails loudly)."""
    with _hook_class(lambda original: _NoHook):
        yield


class CheckpointCount:
    """Whether non-reentrant ``torch.utils.checkpoint`` ran within :func:`counted_checkpoints`."""

    used = False


@contextlib.contextmanager
def counted_checkpoints() -> Iterator[CheckpointCount]:
    """Within this context, each non-reentrant ``torch.utils.checkpoint`` region sets ``used`` on the yielded
    :class:`CheckpointCount` (its saved-tensor hooks are wrapped, otherwise unchanged). A no-op on a torch without
    that internal."""
    count = CheckpointCount()

    def counted(original: type) -> type:
        class _Counted(original):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                count.used = True
                super().__init__(*args, **kwargs)
        return _Counted

    with _hook_class(counted):
        yield count


def reentrant_message(label: str, type_name: str, names: list[str]) -> str:
    return (f"module {label!r} ({type_name}) with trainable parameters {names} runs inside "
            "torch.utils.checkpoint.checkpoint(..., use_reentrant=True). Reentrant checkpointing runs the forward "
            "without autograd and recomputes it only when an input of the checkpointed function requires grad; "
            "under fastdp's ghost differentiation that input may not, and the layer's per-sample gradients would be "
            "silently lost. Use checkpoint(..., use_reentrant=False) (Hugging Face: "
            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})).")


__all__ = ["counted_checkpoints", "in_reentrant_checkpoint", "plain_checkpoints", "reentrant_message"]
