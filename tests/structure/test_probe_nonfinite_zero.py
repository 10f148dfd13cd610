"""A known bug, kept as a strict ``xfail`` so that whoever fixes it sees this test pass and removes the marker.

Found by a red-team pass on 2026-11-26 (also present at 55b77ef, before that session's changes): on the CPU, with
``on_nonfinite="zero"`` and the structure probe on, a model with a module whose output is broadcast over the batch
(a position embedding of shape ``(1, T, d)``) and a non-finite sample in the first batch of a new input signature
is refused with a ``StructureError`` naming the broadcast module. The probe's engine pass clips with
``on_nonfinite="raise"`` (``fastdp.probe._engine_sums``) instead of the engine's policy, and reports the
``NonFiniteGradientError`` as a structure mismatch. It fails closed (nothing is released), but the error is
misleading; with ``verify_structure=False``, a finite first batch, or the accelerator path, the release matches
the batch-of-one oracle.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fastdp


class _Broadcast(nn.Module):
    def __init__(self):
        super().__init__()
        self.pe, self.x, self.o = nn.Embedding(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        pos = self.pe(torch.arange(x.shape[1])[None])  # (1, T, d): broadcast over the batch
        return self.o(torch.tanh(self.x(x) + pos))


@pytest.mark.xfail(strict=True, raises=fastdp.StructureError,
                   reason="the structure probe clips with on_nonfinite='raise' whatever the engine's policy")
def test_a_nonfinite_first_batch_under_the_zero_policy_passes_the_probe():
    torch.manual_seed(0)
    model = _Broadcast().double()
    x, y = torch.randn(3, 4, 8, dtype=torch.float64), torch.randn(3, 4, 3, dtype=torch.float64)
    x[1, 2, 2] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fastdp.PrivacyEngine(model, batch_size=3, sample_size=1000, noise_multiplier=0.0,
                                      max_grad_norm=0.5, on_nonfinite="zero")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    (0.5 * (model(x) - y).pow(2).flatten(1).sum(1)).mean().backward()
    opt.step()
    assert engine.nonfinite_samples == 1
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
