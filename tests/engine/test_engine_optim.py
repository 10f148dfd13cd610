"""Several logical steps with different optimizers vs an oracle simulation, and sigma=0 / R huge vs plain
(non-private) training."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from oracle import (
    FNS,
    MODES,
    ce_per_sample,
    clipped_sum,
    engine_step,
    make_engine,
    make_groups,
    mse_per_sample,
    per_sample_grads,
    trainable_names,
    user_loss,
)
from torch import nn

D = torch.float64


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.conv = nn.Conv1d(4, 5, 3, padding=1)
        self.ln = nn.LayerNorm(5)
        self.head = nn.Linear(5, 8)

    def forward(self, tok):
        h = self.emb(tok).transpose(1, 2)  # (B, 4, T)
        h = F.gelu(self.conv(h)).transpose(1, 2)  # (B, T, 5)
        return self.head(self.ln(h))


def _batches(step, sizes):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randint(0, 8, (n, 5), generator=g), torch.randint(0, 8, (n, 5), generator=g)) for n in sizes]


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.3),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", MODES)
def test_multi_step_matches_oracle_simulation(mode, opt_name):
    torch.manual_seed(20)
    model = Net().to(D)
    ref = copy.deepcopy(model)
    names = trainable_names(model)
    fn = FNS[MODES.index(mode) % 3]
    style = ["all-layer", "layer-wise", "param-wise"][(MODES.index(mode) + 1) % 3]
    reduction = "mean" if MODES.index(mode) % 2 else "sum"
    R, batch_size = 0.8, 6
    engine = make_engine(model, batch_size=batch_size, R=R, fn=fn, style=style, mode=mode, reduction=reduction)
    opt = OPTIMIZERS[opt_name]([p for p in model.parameters() if p.requires_grad])
    engine.attach(opt)
    ref_params = dict(ref.named_parameters())
    ref_opt = OPTIMIZERS[opt_name]([ref_params[n] for n in names])
    groups = make_groups(ref, style, names)
    for step, sizes in enumerate([[3, 2], [4], [1, 2, 3]]):
        batches = _batches(step, sizes)
        psg = per_sample_grads(ref, ce_per_sample, batches, names)
        want = clipped_sum(psg, groups, fn, R, batch_size)
        for n in names:
            ref_params[n].grad = want[n].clone()
        ref_opt.step()
        ref_opt.zero_grad()
        engine_step(model, opt, ce_per_sample, batches, reduction)
        opt.zero_grad()
    got = dict(model.named_parameters())
    for n in names:
        torch.testing.assert_close(
            got[n].detach(), ref_params[n].detach(), rtol=1e-6, atol=1e-9, msg=lambda m, n=n: f"{n} after 3 steps: {m}"
        )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("mode", MODES)
def test_sigma0_huge_R_equals_plain_sgd(mode, reduction):
    """sigma=0, R=1e6 (abadi => C=1): released gradient = plain gradient sum / batch_size."""
    torch.manual_seed(21)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.LayerNorm(5), nn.Linear(5, 2)).to(D)
    plain = copy.deepcopy(model)
    sizes = [4, 4, 4]  # one physical batch per logical step
    batch_size = 4
    lr = 0.1
    engine = make_engine(model, batch_size=batch_size, R=1e6, fn="abadi", mode=mode, reduction=reduction)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    engine.attach(opt)
    # plain SGD on the user's loss; with "sum" the engine divides by batch_size, so plain lr is lr/batch_size
    plain_opt = torch.optim.SGD(plain.parameters(), lr=lr if reduction == "mean" else lr / batch_size)
    g = torch.Generator().manual_seed(22)
    for n in sizes:
        x = torch.randn(n, 3, 3, generator=g, dtype=D)
        y = torch.randn(n, 3, 2, generator=g, dtype=D)
        user_loss(mse_per_sample(model(x), y), reduction).backward()
        opt.step()
        released = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.zero_grad()
        user_loss(mse_per_sample(plain(x), y), reduction).backward()
        plain_grads = {k: p.grad.clone() for k, p in plain.named_parameters()}
        plain_opt.step()
        plain_opt.zero_grad()
        for k, v in released.items():
            want = plain_grads[k] if reduction == "mean" else plain_grads[k] / batch_size
            torch.testing.assert_close(v, want, rtol=1e-9, atol=1e-12)
    for (k, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-9, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("mode", MODES)
def test_sigma0_huge_R_equals_plain_with_accumulation(mode):
    """Accumulation over physical batches of sizes 2, 3, 1 with mean reduction and batch_size=6:
    released = sum_i g_i / 6 (each physical mean is undone per sample)."""
    torch.manual_seed(23)
    model = Net().to(D)
    plain = copy.deepcopy(model)
    engine = make_engine(model, batch_size=6, R=1e6, fn="abadi", mode=mode, reduction="mean")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    batches = _batches(7, [2, 3, 1])
    engine_step(model, opt, ce_per_sample, batches, "mean")
    for x, y in batches:
        ce_per_sample(plain(x), y).sum().backward()
    for (k, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad / 6, rtol=1e-9, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")
