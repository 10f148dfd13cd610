"""Shared by the accounting tests that drive a PrivacyEngine: a tiny float64 model and an attached engine."""

from __future__ import annotations

import torch
from torch import nn

from fastdp import PrivacyEngine

D = 3  # the tiny model's input width


def tiny_model() -> nn.Module:
    """``Linear(D, 1)`` in float64, seeded."""
    torch.manual_seed(0)
    return nn.Linear(D, 1).double()


def attached_engine(model: nn.Module, *, sample_size: int, **kw) -> tuple[PrivacyEngine, torch.optim.Optimizer]:
    """A PrivacyEngine (batch 16, sigma 1, RDP unless ``kw`` says otherwise) attached to SGD(lr=0.1) on ``model``."""
    kw.setdefault("batch_size", 16)
    kw.setdefault("noise_multiplier", 1.0)
    kw.setdefault("accountant", "rdp")
    engine = PrivacyEngine(model, sample_size=sample_size, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    return engine, opt
