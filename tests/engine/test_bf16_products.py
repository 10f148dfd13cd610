"""bfloat16 products of the clipping stage (``fastdp.layers._matmul.BF16_PRODUCTS``, off by default).

For a Linear-like call that ran in bfloat16, the per-sample norms and clipped sums may be formed from bfloat16
operands with float32 accumulation: the input rounded to bfloat16 as the forward's product read it, and the scaled
operand ``coef_i G_i`` split exactly into three bfloat16 tensors. On the CPU the products themselves run in float32
on the same values (``fastdp.torch_api.bf16_matmul_float32``), so these tests check the algebra: the split is exact,
and with inputs that hold bfloat16 values already the release equals the float32 path's to float32 rounding in
every mode; the CUDA kernels are checked by tests/cuda (bf16 autocast cases with the switch on).
"""

from __future__ import annotations

import copy

import pytest
import torch
from model_oracle import LMWrap, gpt2, lm_batches, lm_loss, quiet_transformers, rel_err
from oracle import make_engine, released_grads, trainable_names
from torch import nn

from fastdp import torch_api
from fastdp.layers import _grams, _matmul, _products

quiet_transformers()

MODES = ["BK-MixOpt", "BK-MixGhostClip", "BK-ghost", "ghost", "instantiate"]


def test_the_three_way_split_is_exact():
    g = torch.Generator().manual_seed(0)
    sign = torch.randint(0, 2, (20000,), generator=g).float() * 2 - 1
    x = sign * (1 + torch.rand(20000, generator=g)) * torch.exp2(torch.randint(-109, 127, (20000,),
                                                                              generator=g).float())
    # 3.4e38 is above bfloat16's largest finite (3.39e38): rounded to nearest it would overflow
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1.0, -3.0, 2.0**-109, 3.4e38, -3.4028e38, 1 + 2.0**-23])])
    parts = _products.split_bf16(x)
    assert all(p.dtype == torch.bfloat16 for p in parts)
    total = sum(p.double() for p in parts)
    assert torch.equal(total, x.double())
    assert not torch.equal(parts[0].double(), x.double())  # the split is needed: bf16 alone rounds


def test_the_split_loses_only_below_bfloat16s_subnormals():
    x = torch.tensor([1.2345678e-35, 3.3e-36, -1.7550e-38])  # |x| < 2^-110
    total = sum(p.double() for p in _products.split_bf16(x))
    assert torch.all((total - x.double()).abs() <= 2.0**-133)


def test_bf16_matmul_float32_takes_matrices_or_batches_of_them():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, 4, 5, generator=g).bfloat16()
    b = torch.randn(3, 5, 2, generator=g).bfloat16()
    out = torch_api.bf16_matmul_float32(a, b)
    assert out.dtype == torch.float32
    assert torch.allclose(out, a.float() @ b.float(), rtol=1e-6, atol=0)
    assert torch.allclose(torch_api.bf16_matmul_float32(a[0], b[0]), out[0], rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="two matrices or two batches"):
        torch_api.bf16_matmul_float32(a, b[0])


def test_the_split_product_equals_the_float32_product():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 40, generator=g) * 1e3
    y = torch.randn(40, 7, generator=g).bfloat16().float()
    got = _products.split_product(x, y, torch.bfloat16)
    want = x.double() @ y.double()
    assert rel_err({"p": got}, {"p": want}) < 1e-6
    assert rel_err({"p": (x.bfloat16().float() @ y)}, {"p": want}) > 1e-4  # one bf16 term alone is off


class SeqMLP(nn.Module):
    """Linear layers over ``(B, T, d)``: at T 12 the first two take the ghost norm and the last is instantiated."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _family(name):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "seq":
        # inputs holding bfloat16 values: the forward's rounding of its input to bf16 changes nothing
        data = [((torch.randn(n, 12, 16, generator=g).bfloat16().float(),), torch.randn(n, 12, 4, generator=g))
                for n in (3, 1)]

        def loss(out, y):
            return 0.5 * (out.float() - y).pow(2).sum(dim=(1, 2))
        return SeqMLP(), loss, data
    return LMWrap(gpt2()), lm_loss, [((x,), y) for (x,), y in lm_batches([3, 1], 80)]


def _release(model, loss, data, mode, R, on, monkeypatch):
    monkeypatch.setattr(_matmul, "BF16_PRODUCTS", frozenset({"cpu"}) if on else frozenset())
    B = sum(x[0].shape[0] for x, _ in data)
    engine = make_engine(model, batch_size=B, R=R, mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lo = loss(model(*x), y).mean()
        lo.backward()
    opt.step()
    engine.detach()
    return released_grads(model, trainable_names(model))


@pytest.mark.parametrize("R", [1e-3, 1e3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["seq", "gpt2"])
def test_bf16_products_release_what_the_float32_path_releases(name, mode, R, monkeypatch):
    """Under bf16 autocast, with every Linear-like input already holding bfloat16 values (the token embedding's
    output does, GPT-2's LayerNorm outputs do not: there the switch rounds them, as the forward's products did), the
    release with bfloat16 products equals the float32 path's; with ``R`` small every sample is clipped, with ``R``
    large none. The switch must have formed bfloat16 products and, in the book-keeping modes, split a scaled
    operand."""
    calls = {"products": 0, "splits": 0}
    real_mm, real_split = _products.bf16_matmul_float32, _products.split_bf16

    def mm(a, b):
        calls["products"] += 1
        assert a.dtype == b.dtype == torch.bfloat16
        return real_mm(a, b)

    def split(x):
        calls["splits"] += 1
        return real_split(x)

    monkeypatch.setattr(_products, "bf16_matmul_float32", mm)
    monkeypatch.setattr(_products, "split_bf16", split)
    model, loss, data = _family(name)
    if name == "gpt2":  # round the LayerNorm outputs in both runs, so that only the products' path differs
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.register_forward_hook(lambda mod, args, out: out.bfloat16().float())
    base = _release(copy.deepcopy(model), loss, data, mode, R, False, monkeypatch)
    assert calls == {"products": 0, "splits": 0}
    got = _release(copy.deepcopy(model), loss, data, mode, R, True, monkeypatch)
    assert calls["products"] > 0
    assert (calls["splits"] > 0) == mode.startswith("BK-")  # ghost: a second backward; instantiate: weighted sums
    assert rel_err(got, base) < 2e-6, rel_err(got, base)


def test_bf16_products_take_the_input_as_the_forward_rounded_it(monkeypatch):
    """An input that does not hold bfloat16 values (float32 data into the first Linear under bf16 autocast): with
    the switch on the engine's per-sample gradients are those of the input rounded to bf16, which the forward's
    product read, so its release moves (by about bf16's unit roundoff) from the float32 path's, and in every mode
    to the same values."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    data = [((torch.randn(3, 12, 16, generator=g),), torch.randn(3, 12, 4, generator=g))]

    def loss(out, y):
        return 0.5 * (out.float() - y).pow(2).sum(dim=(1, 2))
    model = SeqMLP()
    base = _release(copy.deepcopy(model), loss, data, "BK-MixOpt", 1e-3, False, monkeypatch)
    got = {m: _release(copy.deepcopy(model), loss, data, m, 1e-3, True, monkeypatch) for m in MODES}
    assert rel_err(got["BK-MixOpt"], base) > 1e-4
    for m in MODES[1:]:
        assert rel_err(got[m], got["BK-MixOpt"]) < 2e-6, (m, rel_err(got[m], got["BK-MixOpt"]))


@pytest.mark.parametrize("R", [1e-6, 1.0])
@pytest.mark.parametrize("mode", MODES)
def test_each_clipped_gradient_stays_within_the_threshold_with_bf16_products(mode, R, monkeypatch):
    """``||C_1 g_1|| <= R`` to float32 rounding for a batch of one under bf16 autocast with the switch on, the
    input not holding bfloat16 values (so the norms and sums must both read it rounded)."""
    torch.manual_seed(3)
    model = SeqMLP()
    g = torch.Generator().manual_seed(4)
    worst = 0.0
    for _ in range(3):
        data = [((torch.randn(1, 12, 16, generator=g) * 3,), torch.randn(1, 12, 4, generator=g))]
        grads = _release(copy.deepcopy(model), lambda out, y: 0.5 * (out.float() - y).pow(2).sum(dim=(1, 2)),
                         data, mode, R, True, monkeypatch)
        worst = max(worst, float(torch.sqrt(sum(v.double().square().sum() for v in grads.values()))) / R)
    assert 0.99 < worst <= 1 + 1e-5, worst


class WithExtraTokens(nn.Module):
    """A Linear over a second input of zero positions ``(B, 0, d)`` (no extra tokens in this batch)."""

    def __init__(self):
        super().__init__()
        self.tok, self.extra, self.head = nn.Linear(5, 8), nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x, extra):
        return self.head(torch.tanh(torch.cat([self.tok(x), self.extra(extra)], dim=1)))


@pytest.mark.parametrize("mode", MODES)
def test_a_linear_over_zero_positions_with_bf16_products(mode, monkeypatch):
    """Zero positions (found by a red-team pass: the bfloat16 product's reshape was ambiguous on zero elements)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 6, 5, generator=g).bfloat16().float()
    data = [((x, torch.randn(4, 0, 5, generator=g)), torch.randn(4, 6, 3, generator=g))]

    def loss(out, y):
        return 0.5 * (out.float() - y).pow(2).sum(dim=(1, 2))
    model = WithExtraTokens()
    base = _release(copy.deepcopy(model), loss, data, mode, 1e-3, False, monkeypatch)
    got = _release(copy.deepcopy(model), loss, data, mode, 1e-3, True, monkeypatch)
    assert rel_err(got, base) < 2e-6, rel_err(got, base)


class QKV(nn.Module):
    """Three Linear layers reading one input (an attention block's ``q``, ``k``, ``v``), at T 20: ghost norms."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        h = self.norm(x)
        return self.q(h) * torch.tanh(self.k(h)) + self.v(h)


def test_q_k_v_share_one_rounded_input_and_its_gram(monkeypatch):
    """With bf16 products the three calls that read one kept input get one rounded copy, so they share one input
    Gram as on the float32 path (a red-team pass counted 8 Gram products a pass with the switch on against 6 off)."""
    counts = []
    real = _grams.gram_strips
    monkeypatch.setattr(_grams, "gram_strips", lambda X, *a: counts.append(1) or real(X, *a))
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    data = [((torch.randn(3, 20, 64, generator=g),), torch.randn(3, 20, 64, generator=g))]

    def loss(out, y):
        return 0.5 * (out.float() - y).pow(2).sum(dim=(1, 2))
    formed = []
    for on in (False, True):
        counts.clear()
        _release(QKV(), loss, data, "BK-ghost", 1e-3, on, monkeypatch)
        formed.append(len(counts))
    assert formed[0] == formed[1] > 0, formed
