"""Checks whose verdict is a tensor on the device, looked at when the step is released instead of at once.

Some checks of the clipping stage decide whether a step may be released: a sample's gradient with NaN/inf
(``on_nonfinite="raise"``), a generic module whose replay does not reproduce its real output. Looking at such a
verdict (``bool(tensor)``) reads it on the host, and on an accelerator that makes the host wait for the device
inside ``loss.backward()``, once per check. On a device type where :data:`DEFER_ON` says so, the clipping stage
instead keeps the verdict as a 0-dim bool tensor with a function that builds the error, and
``Release.pre_step`` looks at all of a step's verdicts with one host read before anything is released; a failed one
refuses the whole step (its sums discarded, nothing released or accounted). On the CPU a read costs nothing, so the
check raises in the backward pass that made it.

Data flow: ``collecting()`` around the end-of-backward clipping gathers the checks that :func:`check` defers;
they travel in ``BackwardResult.deferred`` to the release, which reads every verdict of the step at
once (``Release._check_deferred``, together with the deferred non-finite masks).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

#: Per device type: whether a check's verdict waits for the step's release (``"default"``: device types not
#: listed). The CPU checks at once.
DEFER_ON: dict[str, bool] = {"cpu": False, "default": True}


def defers(device: torch.device) -> bool:
    """Whether verdicts on ``device`` wait for the step's release."""
    return DEFER_ON.get(device.type, DEFER_ON["default"])


@dataclass
class DeferredCheck:
    """``failed``: a 0-dim bool tensor on the device; ``error()`` builds the exception to raise if it is true."""

    failed: torch.Tensor
    error: Callable[[], BaseException]


_COLLECTOR: contextvars.ContextVar[list[DeferredCheck] | None] = contextvars.ContextVar("fastdp_deferred",
                                                                                        default=None)


@contextlib.contextmanager
def collecting() -> Iterator[list[DeferredCheck]]:
    """Gather the checks that :func:`check` defers inside the block (the end-of-backward clipping)."""
    checks: list[DeferredCheck] = []
    token = _COLLECTOR.set(checks)
    try:
        yield checks
    finally:
        _COLLECTOR.reset(token)


def check(failed: torch.Tensor, error: Callable[[], BaseException]) -> None:
    """Raise ``error()`` if ``failed`` (a 0-dim bool tensor) is true: at once (one host read), or, inside
    :func:`collecting` on a device that :func:`defers`, when the step is released."""
    checks = _COLLECTOR.get()
    if checks is not None and defers(failed.device):
        checks.append(DeferredCheck(failed.detach(), error))
        return
    if bool(failed):
        raise error()


__all__ = ["DEFER_ON", "DeferredCheck", "check", "collecting", "defers"]
