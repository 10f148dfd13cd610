"""Edge cases beyond the basic grid: attention-style residual block, parameter-free modules, both sides
of the ghost/instantiate trade-off (long and short sequences), unused trainable parameters, optimizers
with several param groups, zero_grad(set_to_none=False), forwards without backward, step counting with
accumulation."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from oracle import (
    FNS,
    MODES,
    ce_per_sample,
    clipped_sum,
    compare_engine_to_oracle,
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
MODE_FN = [(m, f) for m in MODES for f in FNS]


class Block(nn.Module):
    """Pre-norm single-head self-attention + MLP with residuals; token embedding in, logits out."""

    def __init__(self, V=7, d=6):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.ln1 = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.ln2 = nn.RMSNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, V)

    def forward(self, tok):
        h = self.emb(tok)
        a = self.ln1(h)
        att = torch.softmax(self.q(a) @ self.k(a).transpose(1, 2) / math.sqrt(a.shape[-1]), -1)
        h = h + self.o(att @ self.v(a))
        h = h + self.down(F.gelu(self.up(self.ln2(h))))
        return self.head(h)


@pytest.mark.parametrize("mode,fn", MODE_FN)
def test_attention_block(mode, fn):
    torch.manual_seed(60)
    model = Block().to(D)
    g = torch.Generator().manual_seed(61)
    batches = [(torch.randint(0, 7, (n, 5), generator=g), torch.randint(0, 7, (n, 5), generator=g)) for n in (3, 2)]
    style = ["all-layer", "layer-wise", "param-wise"][(MODES.index(mode) + FNS.index(fn)) % 3]
    compare_engine_to_oracle(
        model,
        ce_per_sample,
        batches,
        mode=mode,
        fn=fn,
        batch_size=5,
        style=style,
        reduction=["mean", "sum"][FNS.index(fn) % 2],
    )


class ParamFree(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.5),
            nn.Flatten(),
            nn.Linear(16, 5),
            nn.Softplus(),
            nn.Identity(),
            nn.Linear(5, 3),
            nn.Unflatten(1, (3, 1)),
            nn.AvgPool1d(1),
            nn.Flatten(),
        )

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("mode", MODES)
def test_parameter_free_modules_eval_mode(mode):
    torch.manual_seed(62)
    model = ParamFree().to(D).eval()  # dropout in eval mode
    g = torch.Generator().manual_seed(63)
    batches = [(torch.randn(n, 2, 4, 4, generator=g, dtype=D), torch.randn(n, 3, generator=g, dtype=D)) for n in (2, 3)]
    compare_engine_to_oracle(
        model, mse_per_sample, batches, mode=mode, fn=FNS[MODES.index(mode) % 3], batch_size=5, style="layer-wise"
    )


# ------------------------------------------------------------- ghost vs instantiate regimes (T^2 vs p*d)

REGIMES = {
    # long sequence, tiny layer: T^2 >> p*d (ghost norm expensive)
    "linear_long": (lambda: nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)), (40, 2), (40, 1)),
    # short sequence, wide layer: T^2 << p*d
    "linear_wide": (lambda: nn.Sequential(nn.Linear(24, 20), nn.Tanh(), nn.Linear(20, 16)), (2, 24), (2, 16)),
    "conv1d_long": (
        lambda: nn.Sequential(nn.Conv1d(1, 2, 3, padding=1), nn.Tanh(), nn.Conv1d(2, 1, 5, padding=2)),
        (1, 50),
        (1, 50),
    ),
    "conv2d_wide": (lambda: nn.Sequential(nn.Conv2d(8, 12, 3), nn.Tanh(), nn.Conv2d(12, 6, 2)), (8, 4, 4), (6, 1, 1)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(REGIMES))
def test_ghost_and_instantiate_regimes(name, mode):
    torch.manual_seed(64)
    make, xs, ys = REGIMES[name]
    model = make().to(D)
    g = torch.Generator().manual_seed(65)
    batches = [(torch.randn(n, *xs, generator=g, dtype=D), torch.randn(n, *ys, generator=g, dtype=D)) for n in (3, 2)]
    compare_engine_to_oracle(
        model,
        mse_per_sample,
        batches,
        mode=mode,
        fn=FNS[MODES.index(mode) % 3],
        batch_size=5,
        style="param-wise" if MODES.index(mode) % 2 else "all-layer",
    )


@pytest.mark.parametrize("mode", MODES)
def test_embedding_long_sequence_repeated_tokens(mode):
    torch.manual_seed(66)
    model = nn.Sequential(nn.Embedding(3, 2, padding_idx=1), nn.Linear(2, 3)).to(D)
    g = torch.Generator().manual_seed(67)
    batches = [(torch.randint(0, 3, (n, 30), generator=g), torch.randint(0, 3, (n, 30), generator=g)) for n in (2, 2)]
    compare_engine_to_oracle(model, ce_per_sample, batches, mode=mode, fn="abadi", batch_size=4, style="layer-wise")


# ------------------------------------------------------------------------------ unused trainable parameter


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.head_a = nn.Linear(4, 2)
        self.head_b = nn.Linear(4, 2)  # trainable but not used in forward

    def forward(self, x):
        return self.head_a(torch.tanh(self.body(x)))


@pytest.mark.parametrize("mode", MODES)
def test_unused_trainable_parameter_gets_zero(mode):
    """g_i = 0 for a parameter not used in the forward: released gradient is 0 (sigma=0), not stale/None."""
    torch.manual_seed(68)
    model = TwoHeads().to(D)
    x, y = torch.randn(4, 3, dtype=D), torch.randn(4, 2, dtype=D)
    _, _, got, _, _ = compare_engine_to_oracle(
        model, mse_per_sample, [(x, y)], mode=mode, fn="abadi", batch_size=4, style="layer-wise"
    )
    assert torch.count_nonzero(got["head_b.weight"]) == 0 and torch.count_nonzero(got["head_b.bias"]) == 0


# ------------------------------------------------------------------------------ optimizer usage patterns


@pytest.mark.parametrize("mode", MODES)
def test_optimizer_with_two_param_groups_and_zero_grad_to_zeros(mode):
    torch.manual_seed(69)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.LayerNorm(5), nn.Linear(5, 2)).to(D)
    ref = copy.deepcopy(model)
    names = trainable_names(model)
    fn, style, R, B = "abadi", "layer-wise", 0.4, 4
    engine = make_engine(model, batch_size=B, R=R, fn=fn, style=style, mode=mode, reduction="mean")
    ps = list(model.parameters())
    opt = torch.optim.SGD([{"params": ps[:2], "lr": 0.5}, {"params": ps[2:], "lr": 0.05, "momentum": 0.5}], lr=0.1)
    engine.attach(opt)
    rps = list(ref.parameters())
    ref_opt = torch.optim.SGD(
        [{"params": rps[:2], "lr": 0.5}, {"params": rps[2:], "lr": 0.05, "momentum": 0.5}], lr=0.1
    )
    groups = make_groups(ref, style, names)
    g = torch.Generator().manual_seed(70)
    for _ in range(3):
        batches = [(torch.randn(n, 3, generator=g, dtype=D), torch.randn(n, 2, generator=g, dtype=D)) for n in (2, 3)]
        want = clipped_sum(per_sample_grads(ref, mse_per_sample, batches, names), groups, fn, R, B)
        for n, p in zip(names, rps, strict=True):
            p.grad = want[n].clone()
        ref_opt.step()
        ref_opt.zero_grad()
        engine_step(model, opt, mse_per_sample, batches, "mean")
        opt.zero_grad(set_to_none=False)  # grads become zero tensors, not None
    for (n, p), q in zip(model.named_parameters(), rps, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-10, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("mode", MODES)
def test_no_grad_forward_between_passes_is_ignored(mode):
    """A validation forward under torch.no_grad() in the middle of an accumulation does not change the step."""
    torch.manual_seed(71)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(9, 2), nn.LayerNorm(2)).to(D)
    names = trainable_names(model)
    g = torch.Generator().manual_seed(72)
    batches = [(torch.randn(n, 2, 5, generator=g, dtype=D), torch.randn(n, 2, generator=g, dtype=D)) for n in (3, 2)]
    want = clipped_sum(per_sample_grads(copy.deepcopy(model), mse_per_sample, batches, names), [names], "abadi", 0.5, 5)
    engine = make_engine(model, batch_size=5, R=0.5, mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    for i, (x, y) in enumerate(batches):
        if i == 1:
            with torch.no_grad():
                model(torch.randn(7, 2, 5, dtype=D))
        user_loss(mse_per_sample(model(x), y), "mean").backward()
        with torch.no_grad():
            model(torch.randn(4, 2, 5, dtype=D))
    opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-10, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("mode", MODES)
def test_steps_counted_per_logical_step(mode):
    torch.manual_seed(73)
    model = nn.Linear(3, 2).to(D)
    engine = make_engine(
        model, batch_size=6, R=1.0, sigma=1.0, mode=mode, accountant="rdp", target_delta=1e-5, sample_size=600
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    for _ in range(3):
        for n in (2, 4):
            user_loss(mse_per_sample(model(torch.randn(n, 3, dtype=D)), torch.zeros(n, 2, dtype=D)), "mean").backward()
        opt.step()
        opt.zero_grad()
    assert engine.get_privacy_spent()["steps"] == 3


@pytest.mark.parametrize("mode", MODES)
def test_float32_tied_embedding_head(mode):
    torch.manual_seed(74)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(6, 4)
            self.head = nn.Linear(4, 6)
            self.head.weight = self.emb.weight

        def forward(self, tok):
            return self.head(torch.tanh(self.emb(tok)))

    model = Tied()
    g = torch.Generator().manual_seed(75)
    batches = [(torch.randint(0, 6, (n, 4), generator=g), torch.randint(0, 6, (n, 4), generator=g)) for n in (3, 3)]
    compare_engine_to_oracle(
        model, ce_per_sample, batches, mode=mode, fn="automatic", batch_size=6, style="param-wise", rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("mode", MODES)
def test_grad_enabled_forward_without_backward_is_ignored(mode):
    """A forward with autograd enabled whose output is never backpropagated (e.g. computing a training
    metric) must not change the released gradient. (Not spelled out by the contract; a natural usage.)"""
    torch.manual_seed(76)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    names = trainable_names(model)
    g = torch.Generator().manual_seed(77)
    batches = [(torch.randn(n, 3, generator=g, dtype=D), torch.randn(n, 2, generator=g, dtype=D)) for n in (3, 2)]
    want = clipped_sum(per_sample_grads(copy.deepcopy(model), mse_per_sample, batches, names), [names], "abadi", 0.5, 5)
    engine = make_engine(model, batch_size=5, R=0.5, mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    for x, y in batches:
        metric = model(torch.randn(6, 3, dtype=D))  # never backpropagated
        del metric
        user_loss(mse_per_sample(model(x), y), "mean").backward()
    opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-10, msg=lambda m, n=n: f"{n}: {m}")
