"""Verified expansion of broadcast raw parameters (fastdp/layers/expand.py) against the batch-of-one oracle
(float64, 1e-6 relative).

A generic owner's parameters of shape (1, *rest) are replaced during its forward by E = P.expand(B, *rest); the
gradient reaching E is the per-sample gradient, so the owner is not replayed. Valid uses (timm ViT's class / register
tokens and position embedding, x + P, P.expand(B, -1, -1) then cat) must take that path; invalid ones (P[0],
P.sum(0), a (1, d) parameter added to (B, N, d), P.view(-1), a custom autograd.Function, a tainted output, a stored
tensor) must fall back to the per-sample replay and stay exact. Which path ran is read from
``engine.generic_stats`` and by counting the replay's vmap calls.

Sizes: toy models d=6, N=5 positions, batches of 1, 3, 4 (and 0); ViT as in tests/models/test_models_timm.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from model_oracle import D, check_engine, cls_loss, mse_loss, rel_err
from oracle import make_engine, released_grads
from torch import nn

import fastdp.layers.generic as generic_mod

pytest.importorskip("timm")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the timm ViT configs of the model tests
from test_models_timm import CONFIGS, IDS, images, vit  # noqa: E402

N, DM = 5, 6


@pytest.fixture
def replays(monkeypatch):
    """Counts the generic path's vmapped per-sample replays."""
    count = {"n": 0}
    real = generic_mod.vmap

    def counting(*a, **k):
        count["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(generic_mod, "vmap", counting)
    return count


def _stats(engine, label="<root>"):
    return engine.generic_stats.get(label, {"expanded": 0, "replayed": 0})


# --------------------------------------------------------------------------- timm ViT


VIT_CONFIGS = [pytest.param(*c, id=i, marks=() if i == "BK-MixOpt" else pytest.mark.slow)
               for c, i in zip(CONFIGS, IDS, strict=True)]


@pytest.mark.parametrize("mode,fn,style,reduction,sizes", VIT_CONFIGS)
def test_vit_expanded_not_replayed(mode, fn, style, reduction, sizes, replays):
    engine, *_ = check_engine(vit(1), cls_loss, images(sizes, 2, 16), mode=mode, fn=fn, style=style,
                              reduction=reduction, where="below" if sizes == [1] else "middle")
    assert _stats(engine) == {"expanded": len(sizes), "replayed": 0}
    assert replays["n"] == 0  # no whole-model replay


@pytest.mark.parametrize("mode", ["BK-MixOpt", pytest.param("ghost", marks=pytest.mark.slow),
                                  pytest.param("instantiate", marks=pytest.mark.slow)])
def test_vit_register_tokens_avg_pool_no_embed_class(mode, replays):
    model = vit(3, class_token=False, global_pool="avg", reg_tokens=2, no_embed_class=True)
    with torch.no_grad():
        model.reg_token.normal_()
    engine, *_ = check_engine(model, cls_loss, images([3, 1], 4, 16), mode=mode, fn="automatic", style="layer-wise",
                              reduction="sum")
    assert _stats(engine) == {"expanded": 2, "replayed": 0} and replays["n"] == 0


def test_vit_class_and_register_tokens(replays):
    model = vit(5, reg_tokens=1)
    with torch.no_grad():
        model.reg_token.normal_()
    engine, *_ = check_engine(model, cls_loss, images([4], 6, 16), mode="BK-MixOpt", fn="abadi")
    assert _stats(engine) == {"expanded": 1, "replayed": 0} and replays["n"] == 0


def test_vit_empty_batch_and_virtual_batches(replays):
    """Three backward passes before one step (3, 0 and 4 samples)."""
    engine, *_ = check_engine(vit(7), cls_loss, images([3, 0, 4], 8, 16), mode="BK-MixOpt", reduction="sum")
    assert _stats(engine)["expanded"] == 2  # the empty batch takes the (trivial) replay path


def test_vit_bf16_autocast_matches_replay():
    """float32 weights under bf16 autocast: the expansion and the forced replay release the same gradient."""
    x, y = images([4], 9, 16)[0]
    x = (x[0].float(),)
    got = []
    for force_replay in (False, True):
        model = vit(11).float()
        engine = make_engine(model, batch_size=4, R=0.1, mode="BK-MixOpt")
        if force_replay:
            engine._capture.expand_off.add(id(model))
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        engine.attach(opt)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = cls_loss(model(*x), y).mean()
        loss.backward()
        opt.step()
        got.append(released_grads(model, [n for n, _ in model.named_parameters()]))
        assert _stats(engine) == ({"expanded": 0, "replayed": 1} if force_replay else {"expanded": 1, "replayed": 0})
    for n in ("cls_token", "pos_embed"):
        assert rel_err({n: got[0][n]}, {n: got[1][n]}) < 2e-2, n


def test_vit_no_grad_forward_does_not_expand():
    model = vit(1)
    engine = make_engine(model, batch_size=4)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    seen = []
    h = model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(type(model.cls_token)))
    x = images([3], 2, 16)[0][0][0]
    with torch.no_grad():
        model(x)
    assert seen == [nn.Parameter] and engine.generic_stats == {}
    model(x)
    assert seen[-1] is torch.Tensor and type(model.cls_token) is nn.Parameter  # E during the forward only
    h.remove()


# --------------------------------------------------------------------------- toy owners


class Owner(nn.Module):
    """Linear -> use of the raw parameter(s) -> Linear; ``use`` picks how P (shape ``pshape``) is used."""

    def __init__(self, use, pshape=(1, N, DM), seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(DM, DM)
        self.P = nn.Parameter(torch.randn(*pshape))
        self.out = nn.Linear(DM, 3)
        self.use = use

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = self.use(self, h)
        return self.out(h).mean(1)


class _Twice(torch.autograd.Function):
    generate_vmap_rule = True  # so the fallback replay (vmap) can run it

    @staticmethod
    def forward(p):
        return p * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 2


def _cat(m, h):
    return torch.cat([m.P.expand(h.shape[0], -1, -1), h], dim=1)


VALID = {
    "x+P": (lambda m, h: h + m.P, (1, N, DM)),
    "P*x": (lambda m, h: m.P * h, (1, N, DM)),
    "expand+cat": (_cat, (1, 2, DM)),
    "scaled P[:, ...] + x": (lambda m, h: h - 0.5 * m.P[:, :N].to(h.dtype).contiguous(), (1, N + 2, DM)),
}

INVALID = {
    "P[0]": (lambda m, h: h + m.P[0], (1, N, DM)),
    "P.sum(0)": (lambda m, h: h + m.P.sum(0), (1, N, DM)),
    "(1,d)+(B,N,d)": (lambda m, h: h + m.P, (1, DM)),
    "P.view(-1)": (lambda m, h: h * m.P.view(-1), (1, DM)),
    "P.mean()": (lambda m, h: h * m.P.mean(), (1, N, DM)),
    "x@P": (lambda m, h: h @ m.P, (1, DM, DM)),
    "autograd.Function": (lambda m, h: h + _Twice.apply(m.P), (1, N, DM)),
    "P.squeeze(0)": (lambda m, h: h + m.P.squeeze(0), (1, N, DM)),
}


def _data(sizes, seed, n=N):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(b, n, DM, generator=g, dtype=D),), torch.randn(b, 3, generator=g, dtype=D))
            for b in sizes]


@pytest.mark.parametrize("name", list(VALID))
@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost"])
def test_valid_uses_are_expanded(name, mode, replays):
    use, shape = VALID[name]
    engine, *_ = check_engine(Owner(use, shape).to(D), mse_loss, _data([3, 4], 1), mode=mode, fn="abadi")
    assert _stats(engine) == {"expanded": 2, "replayed": 0} and replays["n"] == 0


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_uses_fall_back_exactly(name, replays):
    use, shape = INVALID[name]
    engine, *_ = check_engine(Owner(use, shape).to(D), mse_loss, _data([3, 4], 2), mode="BK-MixOpt", fn="abadi",
                              verify_structure=False)  # replays counted: without the structure probe's
    assert _stats(engine) == {"expanded": 0, "replayed": 2}
    assert replays["n"] == 2
    assert id(engine.model) in engine._capture.expand_off  # sticky: not tried again


def test_batch_of_one_needs_no_verification(replays):
    """B = 1: E is P itself and whatever the forward does, the gradient at E is the only sample's (even P[0])."""
    use, shape = INVALID["P[0]"]
    engine, *_ = check_engine(Owner(use, shape).to(D), mse_loss, _data([1], 3), mode="BK-MixOpt", fn="abadi",
                              where="below")
    assert _stats(engine) == {"expanded": 1, "replayed": 0} and replays["n"] == 0


class Leaky(nn.Module):
    """Stores a tensor derived from P (it outlives the forward): not verified."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.inp = nn.Linear(DM, DM)
        self.P = nn.Parameter(torch.randn(1, 1, DM))
        self.out = nn.Linear(DM, 3)

    def forward(self, x):
        self.cache = self.P.expand(x.shape[0], -1, -1)
        return self.out(torch.cat([self.cache, self.inp(x)], 1)).mean(1)


class ReturnsP(nn.Module):
    """An owner whose output is derived from P alone (its shape would differ): replaced by the unmodified value."""

    def __init__(self):
        super().__init__()
        self.P = nn.Parameter(torch.randn(1, N, DM))

    def forward(self, x):
        return self.P * 2.0


class UsesReturnsP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.pe = ReturnsP()
        self.out = nn.Linear(DM, 3)

    def forward(self, x):
        return self.out(x + self.pe(x)).mean(1)


@pytest.mark.parametrize("model_cls,label", [(Leaky, "<root>"), (UsesReturnsP, "pe")])
def test_escapes_fall_back_exactly(model_cls, label, replays):
    engine, *_ = check_engine(model_cls().to(D), mse_loss, _data([3, 4], 6), mode="BK-MixOpt",
                              verify_structure=False)  # replays counted: without the structure probe's
    assert _stats(engine, label) == {"expanded": 0, "replayed": 2} and replays["n"] == 2


class PosEmb(nn.Module):
    def __init__(self):
        super().__init__()
        self.P = nn.Parameter(torch.randn(1, N, DM))

    def forward(self, x):
        return x + self.P


class CalledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.pe = PosEmb()
        self.mid = nn.Linear(DM, DM)
        self.out = nn.Linear(DM, 3)

    def forward(self, x):
        return self.out(self.pe(torch.tanh(self.mid(self.pe(x))))).mean(1)


@pytest.mark.parametrize("mode", ["BK-MixOpt", "instantiate", "ghost"])
def test_owner_called_twice(mode, replays):
    engine, *_ = check_engine(CalledTwice().to(D), mse_loss, _data([3, 1, 4], 7), mode=mode, fn="automatic")
    assert _stats(engine, "pe") == {"expanded": 6, "replayed": 0} and replays["n"] == 0


def test_empty_batch_toy():
    use, shape = VALID["x+P"]
    engine, *_ = check_engine(Owner(use, shape).to(D), mse_loss, _data([0, 3], 8), mode="BK-MixOpt",
                              reduction="sum", batch_size=3)
    assert _stats(engine) == {"expanded": 1, "replayed": 1}  # B = 0 is replayed (zeros), not expanded


class Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.P = nn.Parameter(torch.randn(1, N, DM))
        self.boom = True

    def forward(self, x):
        y = x + self.P
        if self.boom:
            raise ValueError("boom")
        return y


def test_forward_raising_restores_parameter():
    model = Raises().to(D)
    P = model.P
    engine = make_engine(model, batch_size=4)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="boom"):
        model(torch.randn(3, N, DM, dtype=D))
    assert model._parameters["P"] is P and P.requires_grad
    assert torch._C._len_torch_function_stack() == 0
    assert engine._capture.calls == []
