"""Mixed precision: ``torch.amp.GradScaler`` with an attached engine (``engine.attach(optimizer, scaler=scaler)``).

A loss scaler multiplies the loss by ``S`` before the backward pass, so every gradient the engine captures is ``S``
times the loss's. :class:`ScalerLink` gives the engine what it needs to stay exact and private:

* **Unscaled clipping.** The clipping stage takes ``S``, the scaler's scale (a tensor on the device, never read on
  the host), at the end of each backward pass
  (:attr:`fastdp.clipped_sums.ClipConfig.loss_scale`): per-sample norms are ``||captured_i|| / S`` and the factors
  applied to the captured tensors are ``C_i / S``, so the clipped sum is ``sum_i C_i g_i`` of the *unscaled*
  gradients and the threshold is ``R`` whatever the scale. (Whatever ``S`` the engine reads, each sample's
  contribution has norm at most ``R``: a wrong scale could cost accuracy, never privacy.)
* **Overflow, privately.** A sample whose scaled gradient has NaN/inf (float16 overflow) gets clipping factor 0,
  as under ``on_nonfinite="zero"``: its contribution depends on its own data only. Whether a step overflowed is
  decided from a *noisy* count: the released vector gets one more coordinate, ``R`` for each overflowed sample
  and 0 otherwise (each sample's whole contribution still has norm at most ``R``, so the sensitivity and the
  accounting are unchanged), noised with the same ``sigma R``. The step is skipped when
  ``n_overflow + sigma xi > OVERFLOW_THRESHOLD + OVERFLOW_SIGMAS * sigma`` (``xi ~ N(0, 1)``); with
  ``sigma = 0`` that is "any sample overflowed", as without DP. Skipping on the raw count would publish, unnoised,
  whether some sample of the batch overflowed: one outlier could be detected with certainty.
* **The scaler's protocol.** The engine releases the step inside ``scaler.unscale_(optimizer)`` (called by
  ``scaler.step``, or by the user before reading ``.grad``, e.g. for ``clip_grad_norm_``): ``p.grad`` then holds
  the unscaled released gradient, and the scaler's inf check sees a non-finite probe exactly when the step is
  skipped, so ``scaler.step`` skips ``optimizer.step()`` and ``scaler.update()`` backs off as without DP. A skipped
  step is accounted (its backward passes touched the batch) and nothing of it is kept.

Owns: the link between one engine and one scaler. May touch: the scaler's ``unscale_`` attribute (an instance
attribute shadowing the class's method, removed by :meth:`ScalerLink.remove`), ``.grad`` of the attached
optimizer's parameters inside ``unscale_``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from fastdp.noise import secure_gaussian
from fastdp.torch_api import grad_scaler_scale

logger = logging.getLogger(__name__)

#: the step is skipped when the noisy count of overflowed samples exceeds this plus ``OVERFLOW_SIGMAS * sigma``
OVERFLOW_THRESHOLD = 0.5
#: false skips of a step without overflow: P(xi > 3) ~ 0.13 %
OVERFLOW_SIGMAS = 3.0


def check_scaler(scaler: Any) -> None:
    """Refuse what is not a ``torch.amp.GradScaler`` (or subclass): the engine relies on its ``unscale_``/``step``
    protocol and on ``get_scale()``."""
    if not isinstance(scaler, torch.amp.GradScaler):
        raise ValueError(f"attach(scaler=...) needs a torch.amp.GradScaler, got {type(scaler).__name__}; pass the "
                         "scaler whose scale(loss).backward() and step(optimizer) your loop calls")
    if "unscale_" in vars(scaler):
        raise RuntimeError("this GradScaler is already linked to a PrivacyEngine (or its unscale_ was replaced); "
                           "one engine per scaler: detach() the other engine first")


class ScalerLink:
    """The link between an engine's release stage and one ``GradScaler`` (see the module docstring).

    Args:
        release: the engine's :class:`fastdp.release.Release`.
        scaler: the user's ``torch.amp.GradScaler``.
    """

    def __init__(self, release: Any, scaler: torch.amp.GradScaler) -> None:
        check_scaler(scaler)
        self.release = release
        self.scaler = scaler
        self.in_unscale = False
        self.skipped_steps = 0
        self._original = scaler.unscale_  # the bound class method
        link = self

        def unscale_(optimizer: torch.optim.Optimizer) -> None:
            link.unscale_(optimizer)

        scaler.unscale_ = unscale_  # type: ignore[method-assign]

    def loss_scale(self) -> torch.Tensor | float:
        """``S`` of the backward pass in progress (1 when the scaler is disabled): a 0-dim tensor on the scaler's
        device where it has one, so that the clipping stage need not read it on the host
        (:func:`fastdp.torch_api.grad_scaler_scale`)."""
        return grad_scaler_scale(self.scaler)

    def remove(self) -> None:
        """Give the scaler its own ``unscale_`` back."""
        if vars(self.scaler).get("unscale_") is not None:
            del self.scaler.unscale_

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """``scaler.unscale_``: for the attached optimizer, release (or skip) the step, then let the scaler record
        its inf check on a probe gradient; other optimizers are the scaler's own business."""
        rel = self.release
        if optimizer is not rel.engine.optimizer or not self.scaler.is_enabled():
            self._original(optimizer)
            return
        self.in_unscale = True
        try:
            rel.pre_step(optimizer, (optimizer,), {})
        finally:
            self.in_unscale = False
        skipped = rel.last_step_skipped
        params = [p for g in optimizer.param_groups for p in g["params"]]
        released = {p: p.grad for p in params}
        probes: dict[torch.device, torch.Tensor] = {}
        for p in params:  # the scaler's inf check runs on one probe per device, never on the released gradient
            p.grad = None
            if p.device not in probes:
                probes[p.device] = torch.full_like(p, math.nan if skipped else 0.0)
                p.grad = probes[p.device]
        try:
            self._original(optimizer)
        finally:
            for p in params:
                p.grad = None if skipped else released[p]
        rel.released_early = not skipped

    def overflowed(self, samples: int, sigma: float, generator: torch.Generator | None, secure: bool,
                   device: torch.device) -> bool:
        """Whether the step is skipped: the noisy count of overflowed samples (the release's extra coordinate,
        in units of ``R``) against the threshold; see the module docstring."""
        noise = 0.0
        if sigma > 0:
            if secure:
                noise = float(secure_gaussian((1,), sigma, device, torch.float64)[0])
            else:
                noise = float(torch.empty(1, dtype=torch.float64, device=device).normal_(
                    0.0, sigma, generator=generator)[0])
        skip = samples + noise > OVERFLOW_THRESHOLD + OVERFLOW_SIGMAS * sigma
        if skip:
            self.skipped_steps += 1
            logger.info("step skipped for the loss scaler (overflow; %d sample(s) non-finite); accounted",
                        samples)
        elif samples:
            logger.info("%d sample(s) overflowed under the loss scale: clipping factor 0, step released", samples)
        return skip


__all__ = ["OVERFLOW_SIGMAS", "OVERFLOW_THRESHOLD", "ScalerLink", "check_scaler"]
