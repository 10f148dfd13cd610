"""Constructor validation, refusals of uncovered parameters, attach checks, and detach restoring the
model and the optimizer."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from oracle import (
    MODES,
    ce_per_sample,
    compare_engine_to_oracle,
    make_engine,
    mse_per_sample,
    trainable_names,
    user_loss,
)
from torch import nn

import fastdp

D = torch.float64


def _engine(model, **kw):
    from fastdp import PrivacyEngine

    args = dict(batch_size=4, sample_size=100, noise_multiplier=1.0)
    args.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine(model, **args)


def small():
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)


# --------------------------------------------------------------------------- bad constructor arguments


@pytest.mark.parametrize(
    "kw",
    [
        dict(clipping_mode="BK"),
        dict(clipping_mode="opacus"),
        dict(clipping_fn="psac"),
        dict(clipping_fn="Abadi "),
        dict(clipping_style="block-wise"),
        dict(clipping_style="layerwise"),
        dict(loss_reduction="avg"),
        dict(loss_reduction="none"),
        dict(batch_size=101),
        dict(batch_size=0),
        dict(batch_size=-3),
        dict(noise_multiplier=1.0, target_epsilon=3.0, target_delta=1e-5, epochs=1),
        dict(noise_multiplier=None),
        dict(noise_multiplier=None, target_epsilon=None, epochs=1),
        dict(clipping_style=[["0.weight", "0.bias"], ["2.weight"]]),  # 2.bias missing
        dict(clipping_style=[["0.weight", "0.bias", "2.weight"], ["2.bias", "0.weight"]]),  # duplicate
        dict(clipping_style=[["0.weight", "0.bias"], ["2.weight", "2.bias", "3.weight"]]),  # unknown name
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_bad_constructor_arguments(kw):
    with pytest.raises(ValueError):
        _engine(small(), **kw)


def test_explicit_group_with_frozen_parameter_is_rejected():
    model = small()
    model[0].bias.requires_grad_(False)
    with pytest.raises(ValueError):
        _engine(model, clipping_style=[["0.weight", "0.bias"], ["2.weight", "2.bias"]])


def test_sigma_zero_allowed_with_warning():
    from fastdp import PrivacyEngine

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        PrivacyEngine(small(), batch_size=4, sample_size=100, noise_multiplier=0.0)
    assert len(w) >= 1, "noise_multiplier=0.0 should warn"


def test_valid_constructor_variants():
    for style in ["all-layer", "layer-wise", "param-wise", [["0.weight"], ["0.bias", "2.weight", "2.bias"]]]:
        for mode in MODES:
            for fn in ["abadi", "automatic", "global"]:
                for red in ["mean", "sum"]:
                    _engine(small(), clipping_style=style, clipping_mode=mode, clipping_fn=fn, loss_reduction=red)
    _engine(small(), batch_size=100)  # batch_size == sample_size is fine
    _engine(small(), noise_multiplier=None, target_epsilon=3.0, target_delta=1e-5, epochs=1, accountant="rdp")
    _engine(small(), noise_multiplier=None, target_epsilon=3.0, target_delta=1e-5, steps=10, accountant="rdp")


# --------------------------------------------------------------------------- refusals


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.lin(x) * self.scale


class WithRawParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Scaled()
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(self.block(x))


class WithBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        return self.bn(self.conv(x)).flatten(1)


class WithLayer(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.odd = layer

    def forward(self, x):
        return self.odd(self.inp(x))


def _assert_refused(model, names):
    with pytest.raises(ValueError) as ei:
        _engine(model)
    msg = str(ei.value)
    assert any(n in msg for n in names), f"message should name one of {names}: {msg!r}"


def test_raw_parameter_takes_generic_path_exactly():
    """A raw nn.Parameter (Scaled.scale) is no longer refused: the generic torch.func path clips it exactly."""
    torch.manual_seed(48)
    model = WithRawParam().to(D)
    with torch.no_grad():
        model.block.scale.uniform_(0.5, 1.5)
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D)
    for mode in MODES:
        compare_engine_to_oracle(copy.deepcopy(model), mse_per_sample, [(x, y)], mode=mode, fn="abadi", batch_size=5)


def test_refuse_batchnorm_train_mode():
    _assert_refused(WithBN().to(D).train(), ["bn.weight", "bn.bias"])


class Pair(nn.Module):
    """Feeds an unsupported layer, reading out the first output where the layer returns a tuple."""

    def __init__(self, layer, two_inputs=False, seq=False):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.odd = layer
        self.two_inputs, self.seq = two_inputs, seq

    def forward(self, x):
        h = self.inp(x)
        if self.seq:
            h = h.unsqueeze(1).expand(-1, 3, -1)  # (B, 3, 4): a short sequence per sample
        out = self.odd(h, h) if self.two_inputs else self.odd(h)
        if isinstance(out, tuple):
            out = out[0]
        return out.reshape(out.shape[0], -1).sum(-1, keepdim=True)


@pytest.mark.parametrize(
    "layer,kw",
    [
        (lambda: nn.PReLU(4), {}),
        (lambda: nn.Bilinear(4, 4, 2), {"two_inputs": True}),
        (lambda: nn.ConvTranspose1d(3, 2, 2), {"seq": True}),
        (lambda: nn.LSTM(4, 2, batch_first=True), {"seq": True}),
    ],
    ids=["prelu", "bilinear", "convtranspose", "lstm"],
)
def test_unsupported_layer_takes_generic_path_exactly(layer, kw):
    """Layers without a layer kind are owners on the generic path: exact against the batch-of-one oracle."""
    torch.manual_seed(49)
    model = Pair(layer(), **kw).to(D)
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 1, dtype=D)
    for mode in ("BK-MixOpt", "ghost", "instantiate"):
        compare_engine_to_oracle(copy.deepcopy(model), mse_per_sample, [(x, y)], mode=mode, fn="abadi",
                                 batch_size=5, style="layer-wise")


def test_frozen_unsupported_layer_is_fine():
    """Only TRAINABLE uncovered parameters are refused: a frozen PReLU in the middle is fine and exact."""
    torch.manual_seed(50)
    model = nn.Sequential(nn.Linear(3, 4), nn.PReLU(4), nn.Linear(4, 2)).to(D)
    with torch.no_grad():
        model[1].weight.uniform_(-0.5, 0.5)
    model[1].weight.requires_grad_(False)
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D)
    for mode in MODES:
        m = copy.deepcopy(model)
        compare_engine_to_oracle(m, mse_per_sample, [(x, y)], mode=mode, fn="abadi", batch_size=5, style="layer-wise")


def test_frozen_raw_parameter_is_fine():
    torch.manual_seed(51)
    model = WithRawParam().to(D)
    with torch.no_grad():
        model.block.scale.uniform_(0.5, 1.5)
    model.block.scale.requires_grad_(False)
    x, y = torch.randn(4, 3, dtype=D), torch.randn(4, 2, dtype=D)
    for mode in MODES:
        compare_engine_to_oracle(
            copy.deepcopy(model), mse_per_sample, [(x, y)], mode=mode, fn="automatic", batch_size=4
        )


def test_attach_foreign_parameter_refused():
    model = small()
    engine = _engine(model)
    foreign = nn.Parameter(torch.zeros(3, dtype=D))
    with pytest.raises(ValueError):
        engine.attach(torch.optim.SGD([*model.parameters(), foreign], lr=0.1))


def test_attach_frozen_model_parameter_refused():
    model = small()
    model[0].weight.requires_grad_(False)
    engine = _engine(model)
    with pytest.raises(ValueError):
        engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))  # includes the frozen 0.weight


def test_attach_exact_trainable_set_ok():
    """An optimizer over exactly the trainable set attaches."""
    model = small()
    engine = _engine(model)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))


# --------------------------------------------------------------------------- detach

HOOK_DICTS = [
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
]


def _snapshot(model, opt):
    snap = {}
    for mn, m in model.named_modules():
        for h in HOOK_DICTS:
            d = getattr(m, h, None)
            snap[(mn, h)] = None if d is None else len(d)
        snap[(mn, "__dict__")] = sorted(m.__dict__)
        snap[(mn, "training")] = m.training
        snap[(mn, "params")] = [(n, id(p)) for n, p in m.named_parameters(recurse=False)]
        snap[(mn, "buffers")] = [(n, id(b)) for n, b in m.named_buffers(recurse=False)]
    for n, p in model.named_parameters():
        snap[(n, "requires_grad")] = p.requires_grad
        snap[(n, "bwd_hooks")] = len(p._backward_hooks or {})
        snap[(n, "post_acc_hooks")] = len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    snap["global"] = tuple(
        len(getattr(torch.nn.modules.module, a))
        for a in [
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        ]
    )
    snap["opt_type"] = type(opt)
    snap["opt_dict"] = sorted(opt.__dict__)
    snap["opt_step"] = opt.__dict__.get("step", "class")
    snap["opt_zero_grad"] = opt.__dict__.get("zero_grad", "class")
    snap["opt_hooks"] = (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks))
    snap["opt_groups"] = [[id(p) for p in g["params"]] for g in opt.param_groups]
    snap["opt_hparams"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return snap


class DetachNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.ln = nn.LayerNorm(4)
        self.conv = nn.Conv1d(4, 4, 3, padding=1, groups=2)
        self.gn = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4, 6)
        self.rms = nn.RMSNorm(6)

    def forward(self, tok):
        h = self.ln(self.emb(tok)).transpose(1, 2)
        h = self.gn(torch.tanh(self.conv(h))).transpose(1, 2)
        return self.rms(self.fc(h))


@pytest.mark.parametrize("steps", [0, 2])
@pytest.mark.parametrize("mode", MODES)
def test_detach_restores_everything(mode, steps):
    torch.manual_seed(52)
    model = DetachNet().to(D)
    model.conv.bias.requires_grad_(False)  # a frozen parameter must stay frozen after detach
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    before = _snapshot(model, opt)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    engine = make_engine(model, batch_size=4, R=0.5, sigma=0.5, mode=mode, style="layer-wise")
    engine.attach(opt)
    g = torch.Generator().manual_seed(53)
    for _ in range(steps):
        tok, y = torch.randint(0, 6, (3, 5), generator=g), torch.randint(0, 6, (3, 5), generator=g)
        ce_per_sample(model(tok), y).mean().backward()
        opt.step()
        opt.zero_grad()
    engine.detach()
    after = _snapshot(model, opt)
    diffs = {k: (before[k], after.get(k)) for k in before if before[k] != after.get(k)}
    assert not diffs, f"detach left the model/optimizer changed: {diffs}"
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags

    # a plain backward now gives ordinary autograd gradients, and step is ordinary SGD
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    tok, y = torch.randint(0, 6, (3, 5), generator=g), torch.randint(0, 6, (3, 5), generator=g)
    opt.zero_grad()
    ce_per_sample(model(tok), y).mean().backward()
    ce_per_sample(ref(tok), y).mean().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
        else:
            assert p.grad is None
    opt.step()
    ref_opt.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m, n=n: f"{n} after plain step: {m}")
    # no stray attributes left on parameters
    for n, p in model.named_parameters():
        extra = set(p.__dict__) - set(nn.Parameter(torch.zeros(1)).__dict__)
        assert not extra, f"{n} keeps attributes {extra} after detach"


def test_detach_then_new_engine():
    """After detach, a fresh engine on the same model works and is exact."""
    torch.manual_seed(54)
    model = small()
    e1 = make_engine(model, batch_size=3, R=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    e1.attach(opt)
    x, y = torch.randn(3, 3, dtype=D), torch.randn(3, 2, dtype=D)
    user_loss(mse_per_sample(model(x), y), "mean").backward()
    opt.step()
    opt.zero_grad()
    e1.detach()
    compare_engine_to_oracle(
        model, mse_per_sample, [(x, y)], mode="ghost", fn="automatic", batch_size=3, style="param-wise"
    )


def test_trainable_set_fixed_at_construction():
    """The trainable set is the parameters with requires_grad=True at construction; names are as in
    model.named_parameters()."""
    torch.manual_seed(55)
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5)).to(D)
    model[0].weight.requires_grad_(False)
    assert trainable_names(model) == ["1.weight", "1.bias"]
    tok, y = torch.randint(0, 5, (4, 2)), torch.randint(0, 5, (4, 2))
    compare_engine_to_oracle(
        model, ce_per_sample, [(tok, y)], mode="BK-MixOpt", fn="abadi", batch_size=4, style=[["1.bias"], ["1.weight"]]
    )
    assert model[0].weight.grad is None


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_recurrent_layer_not_batch_first_is_refused(cls):
    model = nn.Sequential(cls(3, 4))
    with pytest.raises(ValueError, match="batch_first=True"):
        _engine(model)


def test_plan_describes_how_each_parameter_is_handled():
    """engine.plan: one row per hooked module (kind, parameters, why generic, tied) and, after a backward pass, how
    each parameter's per-sample norm was computed; printable."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(7, 4)
            self.scale = torch.nn.Parameter(torch.ones(4))  # a raw parameter: the root owns it on the generic path
            self.head = torch.nn.Linear(4, 7)
            self.out = torch.nn.Linear(4, 7, bias=False)
            self.out.weight = self.head.weight  # tied

        def forward(self, x):
            h = self.emb(x) * self.scale
            return (self.head(h) + self.out(h)).mean(1)

    model = Net()
    engine = fastdp.PrivacyEngine(model, batch_size=3, sample_size=30, noise_multiplier=0.0)
    rows = {r["module"]: r for r in engine.plan.describe()}
    assert set(rows) == {"<root>", "emb", "head", "out"}
    assert rows["<root>"]["kind"] == "generic" and rows["<root>"]["parameters"] == ["scale"]
    assert "no layer kind covers Net" in rows["<root>"]["why_generic"]
    assert rows["head"]["tied"] and rows["out"]["tied"] and not rows["emb"]["tied"]
    assert rows["emb"]["norm"] == {"weight": "not run yet"}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    x, y = torch.randint(0, 7, (3, 5)), torch.tensor([0, 1, 2])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    rows = {r["module"]: r for r in engine.plan.describe()}
    assert rows["<root>"]["norm"] == {"scale": "generic"}
    assert rows["head"]["norm"]["weight"].endswith("(shared)") and rows["head"]["norm"]["bias"] == "instantiated"
    assert rows["emb"]["norm"]["weight"] in ("ghost", "instantiated")
    text = str(engine.plan)
    assert text.startswith("fastdp plan: 4 trainable tensors in 4 hooked modules")
    assert "<root> (Net): generic [scale generic]; generic because no layer kind covers Net" in text
    engine.detach()
