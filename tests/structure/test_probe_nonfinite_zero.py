"""The structure probe under ``on_nonfinite="zero"`` with a non-finite sample in the first batch of a new input
signature.

Found by a red-team pass on 2026-11-26 (present since before that session): on the CPU, with a module whose output
is broadcast over the batch (a position embedding of shape ``(1, T, d)``), the probe's engine pass refused the
sample (``NonFiniteGradientError``) and the probe reported that as a structure mismatch (a misleading
``StructureError``; nothing was released). A non-finite sample under a policy that zeroes it says nothing about
the model's structure: the probe was then postponed to the signature's next call
(``fastdp.probe_verdicts._nonfinite_data``).
Since 2026-11-28 (a red-team pass found a postponed call released unverified, and wrong, for rows rolled by a
constant at a signature's second batch size) the probe runs again on the other samples, with the engine's policy
(the non-finite samples' rows zeroed), and verifies the batch size there; the step is released as the policy says
(the batch-of-one oracle over the other samples), and the next, finite batch is released exactly.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn


class _Broadcast(nn.Module):
    def __init__(self):
        super().__init__()
        self.pe, self.x, self.o = nn.Embedding(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        pos = self.pe(torch.arange(x.shape[1])[None])  # (1, T, d): broadcast over the batch
        return self.o(torch.tanh(self.x(x) + pos))


@pytest.mark.parametrize("deferred", [False, True], ids=["host", "deferred"])
@pytest.mark.parametrize("bad", [0, 1, 2])  # 0 and 2 are the probe's own samples
def test_a_nonfinite_first_batch_under_the_zero_policy_is_probed_on_the_other_samples(bad, deferred, monkeypatch):
    """``deferred``: the non-finite check waits for the release, as on an accelerator (``fastdp.deferred.DEFER_ON``):
    the probe reads its engine pass's mask itself."""
    from oracle import assert_grads_close, oracle_release

    import fastdp.deferred

    monkeypatch.setattr(fastdp.deferred, "DEFER_ON", {"cpu": deferred, "default": deferred})
    torch.manual_seed(0)
    model = _Broadcast().double()
    x, y = torch.randn(3, 4, 8, dtype=torch.float64), torch.randn(3, 4, 3, dtype=torch.float64)
    x2, y2 = torch.randn(3, 4, 8, dtype=torch.float64), torch.randn(3, 4, 3, dtype=torch.float64)
    good = [i for i in range(3) if i != bad]

    def per_sample(out, target):
        return 0.5 * (out - target).pow(2).flatten(1).sum(1)

    # the oracles before the engine is attached (a copy of an attached model would carry its hooks)
    want = oracle_release(model, per_sample, [(x[good], y[good])], fn="abadi", R=0.5, batch_size=3)
    want2 = oracle_release(model, per_sample, [(x2, y2)], fn="abadi", R=0.5, batch_size=3)
    x[bad, 2, 2] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fastdp.PrivacyEngine(model, batch_size=3, sample_size=1000, noise_multiplier=0.0,
                                      max_grad_norm=0.5, on_nonfinite="zero")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    (0.5 * (model(x) - y).pow(2).flatten(1).sum(1)).mean().backward()
    opt.step()
    assert engine.nonfinite_samples == 1
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want)
    assert engine.probe_stats["signatures"] == 1  # verified on the other samples of that batch
    opt.zero_grad()
    (0.5 * (model(x2) - y2).pow(2).flatten(1).sum(1)).mean().backward()
    opt.step()
    assert engine.probe_stats["signatures"] == 1 and engine.probe_stats["probes"] == 1  # (the same batch size)
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want2)
