r"""Audits of a training run: canaries, any training procedure, scores, the one-run bound.

:func:`audit_training` is the whole audit: draw each of ``m`` canaries in with probability 1/2, call the user's
``train_fn(membership)`` (it trains on the real data plus the canaries ``i`` with ``membership[i]``, with any
procedure -- fastdp's engine, a non-private loop, DP-FP, another library -- and returns what ``score_fn`` needs),
score the canaries with ``score_fn(trained) -> (m,)`` (higher = more likely included) and bound epsilon
(:func:`fastdp.audit.audit_from_scores`, Steinke, Nasr & Jagielski 2023).

Two kinds of canaries:

* **White-box Dirac gradient canaries** (:class:`DiracCanaries`; Nasr et al. 2023 "Tight auditing of
  differentially private machine learning", and the gradient-space canaries of Steinke et al. 2023): a module
  with one weight per canary, ``theta in R^m`` (initialized to 0), whose per-sample loss term is
  ``scale * theta[j]`` for canary ``j`` and 0 for a real sample. Canary ``j``'s gradient is therefore exactly
  ``scale * e_j`` on ``theta`` and nothing elsewhere (its task loss must be masked out, see
  :meth:`DiracCanaries.loss_term`), and a real sample's gradient has no component on ``theta``: DP-SGD with
  clipping norm ``R <= scale`` adds ``R e_j`` at every step that samples canary ``j``, plus the noise. The score
  is ``theta_j(0) - theta_j(T)`` (:meth:`DiracCanaries.scores`): gradient descent lowers ``theta_j`` only when
  canary ``j`` is trained on. The canaries ride along with any model: add the module to the model so that the
  engine clips its parameter with the others.
* **Black-box input canaries** (:func:`loss_scores`): real-looking inputs with random labels, score = minus the
  canary's loss under the trained model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from fastdp.audit.guesses import AuditResult, audit_from_scores, draw_membership

__all__ = ["DiracCanaries", "audit_training", "loss_scores"]


class DiracCanaries(nn.Module):
    r"""``m`` white-box gradient canaries: one parameter ``theta (m,)``; canary ``j``'s gradient is ``scale e_j``.

    ``forward(canary_index)`` takes ``(B,)`` long indices (``-1`` for a real sample) and returns the ``(B,)``
    per-sample loss terms ``scale * theta[index]`` (0 for ``-1``), computed as ``Linear(m -> 1)`` applied to
    ``scale * one_hot(index)``, a layer fastdp's engine clips per sample like any other. Add the output to the
    per-sample loss, with the task loss of canary rows masked out (:meth:`loss_term` does both).
    """

    def __init__(self, num_canaries: int, scale: float = 1.0) -> None:
        super().__init__()
        if isinstance(num_canaries, bool) or not isinstance(num_canaries, int) or num_canaries < 1:
            raise ValueError(f"num_canaries={num_canaries!r} must be a positive integer")
        if not (isinstance(scale, float | int) and np.isfinite(scale) and scale > 0):
            raise ValueError(f"scale={scale!r} must be a finite number > 0 (the norm of each canary's gradient; "
                             "set it >= the clipping norm so every canary's gradient is clipped to exactly R)")
        self.num_canaries = num_canaries
        self.scale = float(scale)
        self.linear = nn.Linear(num_canaries, 1, bias=False)
        nn.init.zeros_(self.linear.weight)

    def forward(self, canary_index: torch.Tensor) -> torch.Tensor:
        """``(B,)`` long (``-1`` = not a canary) -> ``(B,)`` loss terms ``scale * theta[index]``."""
        if canary_index.dim() != 1 or canary_index.dtype != torch.long:
            raise ValueError(f"canary_index must be a (B,) long tensor, got {canary_index.dtype} "
                             f"{tuple(canary_index.shape)}")
        if canary_index.numel() and (canary_index.min() < -1 or canary_index.max() >= self.num_canaries):
            raise ValueError(f"canary_index values must be in [-1, {self.num_canaries - 1}] (-1 = real sample)")
        w = self.linear.weight
        onehot = torch.zeros(canary_index.shape[0], self.num_canaries, dtype=w.dtype, device=w.device)
        rows = (canary_index >= 0).nonzero(as_tuple=True)[0]
        onehot[rows, canary_index[rows]] = self.scale
        return self.linear(onehot).squeeze(1)

    def loss_term(self, task_loss: torch.Tensor, canary_index: torch.Tensor) -> torch.Tensor:
        """``(B,)`` per-sample losses: the task loss for real rows, ``scale * theta[j]`` for canary ``j``'s row."""
        if task_loss.shape != canary_index.shape:
            raise ValueError(f"task_loss {tuple(task_loss.shape)} and canary_index {tuple(canary_index.shape)} "
                             "must both be (B,)")
        real = (canary_index < 0).to(task_loss.dtype)
        return task_loss * real + self(canary_index)

    def theta(self) -> torch.Tensor:
        """``(m,)`` a detached copy of the canary weights."""
        return self.linear.weight.detach()[0].clone()

    def scores(self, initial: torch.Tensor | None = None) -> torch.Tensor:
        """``(m,)`` ``theta(0) - theta(T)`` (``theta(0) = initial``, default 0): larger = trained on more."""
        start = torch.zeros(self.num_canaries) if initial is None else initial.detach().cpu()
        return start.double() - self.theta().cpu().double()


@torch.no_grad()
def loss_scores(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``(m,)`` minus each canary's loss under ``model`` (eval mode; black-box input canaries).

    ``loss_fn(logits, labels) -> (m,)`` per-sample losses; default cross-entropy with ``reduction='none'``.
    """
    fn = loss_fn or (lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"))
    was_training = model.training
    model.eval()
    try:
        loss = fn(model(inputs), labels)
    finally:
        model.train(was_training)
    if loss.shape != (inputs.shape[0],):
        raise ValueError(f"loss_fn must return one loss per canary, shape ({inputs.shape[0]},), got "
                         f"{tuple(loss.shape)}")
    return -loss.detach().double().cpu()


def audit_training(train_fn: Callable[[np.ndarray], Any], score_fn: Callable[[Any], Any], num_canaries: int,
                   delta: float, *, claimed_epsilon: float | None = None, beta: float = 0.05,
                   guess_counts: Sequence[tuple[int, int]] | None = None, seed: int = 0) -> AuditResult:
    """One-run audit of a training procedure.

    ``membership = draw_membership(num_canaries, seed)``; ``trained = train_fn(membership)`` (train on the real
    data and the canaries ``i`` with ``membership[i]``; ``membership`` is a ``(m,)`` bool numpy array);
    ``scores = score_fn(trained)`` (``(m,)``, higher = more likely included); then
    :func:`fastdp.audit.audit_from_scores` with ``delta`` (the delta of the claim being audited), ``beta``
    (1 - confidence) and ``guess_counts``. ``claimed_epsilon`` is only recorded, to compare.
    """
    membership = draw_membership(num_canaries, seed)
    trained = train_fn(membership.copy())
    scores = score_fn(trained)
    result = audit_from_scores(scores, membership, delta, beta=beta, guess_counts=guess_counts,
                               claimed_epsilon=claimed_epsilon)
    result.extra["scores"] = np.asarray(scores.detach().cpu() if hasattr(scores, "detach") else scores)
    result.extra["membership"] = membership
    return result
