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
once with :func:`step_failure` (together with the deferred non-finite masks).
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


def step_failure(nonfinite: list[tuple[int, torch.Tensor]], checks: list[DeferredCheck], step: int,
                 nonfinite_error: Callable[[int, list[str]], BaseException]) -> BaseException | None:
    """All of a step's deferred verdicts, read with one host read: the error that refuses the step, or ``None``.

    ``nonfinite``: ``(backward pass number in the step, (B,) bool mask)`` of the samples with a non-finite gradient
    (``on_nonfinite="raise"``); any such sample gives ``nonfinite_error(step, ["samples [..] of backward pass k",
    ...])``. Otherwise the first failed check's error, its message prefixed with the step."""
    if not nonfinite and not checks:
        return None
    dev = (nonfinite[0][1] if nonfinite else checks[0].failed).device
    counts = torch.stack([m.sum().to(dev) for _, m in nonfinite]
                         + [c.failed.to(dev).reshape(()).long() for c in checks]).tolist()  # the one read
    bad_masks, bad_checks = counts[:len(nonfinite)], counts[len(nonfinite):]
    if any(bad_masks):
        where = []
        for (number, mask), c in zip(nonfinite, bad_masks, strict=True):
            if c:
                idx = mask.nonzero().flatten().tolist()
                where.append(f"samples {idx[:10]}{'...' if len(idx) > 10 else ''} of backward pass {number}")
        return nonfinite_error(step, where)
    for c, bad in zip(checks, bad_checks, strict=True):
        if bad:
            e = c.error()
            return type(e)(f"step {step} (checked when the step was released; nothing was released and this "
                           f"step's gradients were discarded): {e}")
    return None


def total_count(counts: list[torch.Tensor]) -> int:
    """The sum of a step's counts kept on the device (0-dim integer tensors: samples zeroed for non-finite
    gradients under ``on_nonfinite="zero"`` or a GradScaler's overflow), read with one host read; 0 for none."""
    if not counts:
        return 0
    return int(torch.stack([c.to(counts[0].device) for c in counts]).sum())


__all__ = ["DEFER_ON", "DeferredCheck", "check", "collecting", "defers", "step_failure", "total_count"]
