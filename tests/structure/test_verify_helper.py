"""fastdp.validate.verify_structure: the structure probe run once, in one process, on a model and a batch (what
FSDP2 users run before sharding, since their engine runs with verify_structure=False)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fastdp
from fastdp.validate import verify_structure


class Mixer(nn.Module):
    """Subtracts the batch mean: every sample's output depends on the others."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x - x.mean(0, keepdim=True))


def test_a_per_sample_model_is_verified_and_left_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.LayerNorm(5), nn.Linear(5, 2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = verify_structure(model, torch.randn(6, 4))
    assert stats["signatures"] == 1 and stats["probes"] >= 1
    assert not fastdp.engines_on(model)
    assert all(torch.equal(p, before[n]) and p.grad is None and p.requires_grad for n, p in model.named_parameters())
    assert not model._forward_hooks and not model._forward_pre_hooks and not model[0]._forward_pre_hooks
    fastdp.PrivacyEngine(model, batch_size=4, sample_size=40, noise_multiplier=1.0)  # no engine left behind


def test_a_model_that_mixes_samples_is_refused():
    torch.manual_seed(0)
    model = Mixer()
    with pytest.raises(fastdp.StructureError):
        verify_structure(model, torch.randn(5, 4))
    assert not fastdp.engines_on(model)


def test_a_batch_of_one_cannot_verify():
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="at least 2 samples"):
        verify_structure(model, torch.randn(1, 4))
