"""Engine vs oracle on specific models and shapes: batch size 1, shared/tied weights, broadcast-free
shapes, 4-D Linear inputs, grouped/depthwise convs, "same" padding with even kernels, padding modes,
Embedding padding_idx, DP-BiTFiT, a mixed transformer-like model and a small CNN."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from oracle import (
    FNS,
    MODES,
    ce_per_sample,
    compare_engine_to_oracle,
    mse_per_sample,
    trainable_names,
)
from torch import nn

D = torch.float64
MODE_FN = list(itertools.product(MODES, FNS))


def _style_for(i, names, tied=False):
    """Cycle deterministically through the styles (layer-wise is ambiguous for parameters tied across
    modules, so tied models use the other three)."""
    styles = ["all-layer", "param-wise", "explicit"] if tied else ["all-layer", "layer-wise", "param-wise", "explicit"]
    s = styles[i % len(styles)]
    if s == "explicit":
        names = list(names)
        # deterministic non-trivial partition: alternate names into two groups (or one if a single name)
        if len(names) == 1:
            return [names]
        return [names[0::2], names[1::2]]
    return s


def _mse_batches(make_x, out_tail, sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        x = make_x(n, g)
        y = torch.randn((n, *out_tail), generator=g, dtype=D)
        out.append((x, y))
    return out


def _randn(*shape):
    return lambda n, g: torch.randn((n, *shape), generator=g, dtype=D)


# --------------------------------------------------------------------------- batch size 1


@pytest.mark.parametrize("mode,fn", MODE_FN)
def test_batch_size_one(mode, fn):
    batches = _mse_batches(_randn(3), (2,), [1])
    for where in ("below", "above"):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
        compare_engine_to_oracle(
            model,
            mse_per_sample,
            batches,
            mode=mode,
            fn=fn,
            batch_size=1,
            where=where,
            style=_style_for(MODES.index(mode), trainable_names(model)),
        )


@pytest.mark.parametrize("mode", MODES)
def test_batch_size_one_accumulated(mode):
    """Three physical batches of one sample each, expected batch size 3."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv1d(2, 3, 2), nn.Tanh(), nn.Flatten(), nn.Linear(9, 2)).to(D)
    batches = _mse_batches(_randn(2, 4), (2,), [1, 1, 1], seed=3)
    compare_engine_to_oracle(model, mse_per_sample, batches, mode=mode, fn="abadi", batch_size=3)


# --------------------------------------------------------------------------- shared / tied weights


class TwiceLinear(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


class TwiceConvNorm(nn.Module):
    """Conv1d, LayerNorm and Embedding each called twice."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.conv = nn.Conv1d(3, 3, 3, padding=1)
        self.ln = nn.LayerNorm(4)

    def forward(self, tok):
        h = self.emb(tok) + 0.5 * self.emb(tok.flip(1))  # (B, 4, 3)
        h = h.transpose(1, 2)  # (B, 3, 4)
        h = self.conv(torch.tanh(self.conv(h)))
        return self.ln(torch.tanh(self.ln(h)))


class TiedLinear(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin1 = nn.Linear(d, d)
        self.lin2 = nn.Linear(d, d)
        self.lin2.weight = self.lin1.weight

    def forward(self, x):
        return self.lin2(torch.tanh(self.lin1(x)))


class TiedEmbeddingHead(nn.Module):
    def __init__(self, V=7, d=4):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tok):
        return self.head(self.ln(self.emb(tok)))


@pytest.mark.parametrize("mode,fn", MODE_FN)
def test_module_called_twice(mode, fn):
    torch.manual_seed(3)
    model = TwiceLinear(4).to(D)
    batches = _mse_batches(_randn(3, 4), (3, 2), [3, 2], seed=4)
    compare_engine_to_oracle(
        model,
        mse_per_sample,
        batches,
        mode=mode,
        fn=fn,
        batch_size=6,
        style=_style_for(FNS.index(fn) + MODES.index(mode), trainable_names(model)),
        reduction=["mean", "sum"][MODES.index(mode) % 2],
    )


@pytest.mark.parametrize("mode,fn", MODE_FN)
def test_conv_norm_embedding_called_twice(mode, fn):
    torch.manual_seed(4)
    model = TwiceConvNorm().to(D)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, 5, (n, 4), generator=g), torch.randn(n, 3, 4, generator=g, dtype=D)) for n in (2, 3)]
    compare_engine_to_oracle(
        model,
        mse_per_sample,
        batches,
        mode=mode,
        fn=fn,
        batch_size=5,
        style=_style_for(FNS.index(fn) + MODES.index(mode), trainable_names(model)),
        reduction=["sum", "mean"][FNS.index(fn) % 2],
    )


@pytest.mark.parametrize("mode,fn", MODE_FN)
def test_tied_linear_weight(mode, fn):
    torch.manual_seed(5)
    model = TiedLinear(3).to(D)
    assert trainable_names(model) == ["lin1.weight", "lin1.bias", "lin2.bias"]
    batches = _mse_batches(_randn(2, 3), (2, 3), [4], seed=6)
    compare_engine_to_oracle(
        model,
        mse_per_sample,
        batches,
        mode=mode,
        fn=fn,
        batch_size=4,
        style=_style_for(FNS.index(fn) + MODES.index(mode), trainable_names(model), tied=True),
    )


@pytest.mark.parametrize("mode,fn", MODE_FN)
def test_tied_embedding_output_layer(mode, fn):
    torch.manual_seed(6)
    model = TiedEmbeddingHead().to(D)
    assert trainable_names(model) == ["emb.weight", "ln.weight", "ln.bias"]
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randint(0, 7, (n, 5), generator=g), torch.randint(0, 7, (n, 5), generator=g)) for n in (3, 2)]
    compare_engine_to_oracle(
        model,
        ce_per_sample,
        batches,
        mode=mode,
        fn=fn,
        batch_size=5,
        style=_style_for(FNS.index(fn) + MODES.index(mode), trainable_names(model), tied=True),
        reduction=["mean", "sum"][MODES.index(mode) % 2],
    )


# --------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("mode,fn", MODE_FN)
def test_broadcast_free_shapes(mode, fn):
    """All dimensions pairwise distinct (B=3, T=5, d_in=4, d_out=7; conv C_in=2, C_out=6, H=5, W=4)."""
    torch.manual_seed(7)
    lin = nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 6)).to(D)
    compare_engine_to_oracle(
        lin,
        mse_per_sample,
        _mse_batches(_randn(5, 4), (5, 6), [3], seed=8),
        mode=mode,
        fn=fn,
        batch_size=3,
        style="layer-wise",
    )
    conv = nn.Sequential(nn.Conv2d(2, 6, (3, 2), stride=(1, 2)), nn.Tanh(), nn.Linear(2, 7)).to(D)
    compare_engine_to_oracle(
        conv,
        mse_per_sample,
        _mse_batches(_randn(2, 5, 4), (6, 3, 7), [3], seed=9),
        mode=mode,
        fn=fn,
        batch_size=3,
        style="param-wise",
    )


@pytest.mark.parametrize("mode,fn", MODE_FN)
def test_linear_4d_input(mode, fn):
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(5, 6), nn.GELU(), nn.Linear(6, 3, bias=False)).to(D)
    compare_engine_to_oracle(
        model,
        mse_per_sample,
        _mse_batches(_randn(3, 4, 5), (3, 4, 3), [2, 3], seed=10),
        mode=mode,
        fn=fn,
        batch_size=4,
        reduction="sum",
        style=_style_for(MODES.index(mode) + FNS.index(fn), ["0.weight", "0.bias", "2.weight"]),
    )


CONVS = {
    "conv2d_groups2": (lambda: nn.Conv2d(4, 6, 3, groups=2, padding=1), (4, 5, 5)),
    "conv2d_depthwise": (lambda: nn.Conv2d(3, 3, 3, groups=3, stride=2), (3, 6, 5)),
    "conv2d_depthwise_mult": (lambda: nn.Conv2d(3, 6, (2, 3), groups=3, dilation=(2, 1)), (3, 5, 6)),
    "conv1d_depthwise": (lambda: nn.Conv1d(4, 4, 3, groups=4, padding=2, dilation=2), (4, 7)),
    "conv3d_groups2": (lambda: nn.Conv3d(2, 4, 2, groups=2, stride=(1, 2, 1)), (2, 3, 4, 3)),
    "conv1d_same_even": (lambda: nn.Conv1d(2, 3, 4, padding="same"), (2, 7)),
    "conv2d_same_even_dil": (lambda: nn.Conv2d(2, 2, (2, 4), padding="same", dilation=(1, 3)), (2, 5, 9)),
    "conv3d_same_even": (lambda: nn.Conv3d(1, 2, 2, padding="same", bias=False), (1, 3, 3, 2)),
    "conv2d_valid": (lambda: nn.Conv2d(2, 3, (1, 3), padding="valid", stride=(2, 1)), (2, 4, 5)),
}


@pytest.mark.parametrize("mode,fn", MODE_FN)
@pytest.mark.parametrize("name", list(CONVS))
def test_conv_variants(name, mode, fn):
    torch.manual_seed(9)
    make, in_shape = CONVS[name]
    conv = make().to(D)
    with torch.no_grad():
        out_shape = conv(torch.zeros(1, *in_shape, dtype=D)).shape[1:]
    model = nn.Sequential(conv, nn.Tanh()).to(D)
    batches = _mse_batches(_randn(*in_shape), out_shape, [3, 2], seed=11)
    compare_engine_to_oracle(
        model, mse_per_sample, batches, mode=mode, fn=fn, batch_size=5, reduction=["mean", "sum"][FNS.index(fn) % 2]
    )


def _padding_mode_case(nd, padding_mode, mode, fn):
    torch.manual_seed(10 + nd)
    Conv = getattr(nn, f"Conv{nd}d")
    conv = Conv(2, 3, 3, padding=2 if nd < 3 else 1, stride=2 if nd == 2 else 1, padding_mode=padding_mode).to(D)
    conv2 = Conv(3, 3, 2, padding="same", padding_mode=padding_mode, groups=3).to(D)
    in_shape = (2, *([5, 4, 3][:nd]))
    model = nn.Sequential(conv, nn.Tanh(), conv2).to(D)
    with torch.no_grad():
        out_shape = model(torch.zeros(1, *in_shape, dtype=D)).shape[1:]
    batches = _mse_batches(_randn(*in_shape), out_shape, [2, 2], seed=12)
    compare_engine_to_oracle(
        model,
        mse_per_sample,
        batches,
        mode=mode,
        fn=fn,
        batch_size=4,
        style="layer-wise",
        reduction=["mean", "sum"][nd % 2],
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_conv_padding_modes(nd, padding_mode, mode):
    _padding_mode_case(nd, padding_mode, mode, FNS[(MODES.index(mode) + nd) % 3])


@pytest.mark.slow
@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_conv_padding_modes_all_fns_slow(nd, padding_mode, mode, fn):
    _padding_mode_case(nd, padding_mode, mode, fn)


# --------------------------------------------------------------------------- embedding padding_idx


@pytest.mark.parametrize("mode,fn", MODE_FN)
def test_embedding_padding_idx_repeated_tokens(mode, fn):
    torch.manual_seed(11)
    emb = nn.Embedding(6, 3, padding_idx=2)
    model = nn.Sequential(emb, nn.Tanh(), nn.Linear(3, 2)).to(D)
    tok = torch.tensor([[2, 2, 1, 1, 1], [0, 2, 0, 5, 0], [2, 2, 2, 2, 2], [4, 4, 4, 3, 2]])
    y = torch.randn(4, 5, 2, dtype=D)
    batches = [(tok[:3], y[:3]), (tok[3:], y[3:])]
    _, _, got, want, _ = compare_engine_to_oracle(
        model,
        mse_per_sample,
        batches,
        mode=mode,
        fn=fn,
        batch_size=4,
        style=["all-layer", "layer-wise", "param-wise"][FNS.index(fn)],
    )
    assert torch.count_nonzero(got["0.weight"][2]) == 0, "padding_idx row must get no gradient"
    if torch.count_nonzero(want["0.weight"][1]) > 0:  # (global clipping may zero every sample using token 1)
        assert torch.count_nonzero(got["0.weight"][1]) > 0


# --------------------------------------------------------------------------- DP-BiTFiT


class BiasNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.conv2 = nn.Conv2d(4, 4, 3, groups=4)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.lin = nn.Linear(3, 5)
        self.ln = nn.LayerNorm(5)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        h = torch.tanh(self.gn(self.conv(x)))
        h = self.inorm(self.conv2(h))  # (B, 4, 3, 3)
        h = self.ln(torch.tanh(self.lin(h)))  # (B, 4, 3, 5)
        return self.head(h).mean((2,))  # (B, 4, 2)


@pytest.mark.parametrize("mode,fn", MODE_FN)
def test_bitfit_bias_only(mode, fn):
    torch.manual_seed(12)
    model = BiasNet().to(D)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("weight") and p.dim() == 1:
                p.normal_()
    for n, p in model.named_parameters():
        if not n.endswith("bias"):
            p.requires_grad_(False)
    names = trainable_names(model)
    assert all(n.endswith("bias") for n in names) and len(names) == 7
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    batches = _mse_batches(_randn(2, 5, 5), (4, 2), [3, 2], seed=13)
    compare_engine_to_oracle(
        model,
        mse_per_sample,
        batches,
        mode=mode,
        fn=fn,
        batch_size=5,
        style=_style_for(MODES.index(mode) + FNS.index(fn), names),
        reduction=["mean", "sum"][FNS.index(fn) % 2],
    )
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen_before[n]), f"frozen {n} changed"
            assert p.grad is None or torch.count_nonzero(p.grad) == 0, f"frozen {n} got a gradient"


# --------------------------------------------------------------------------- mixed model and small CNN


class Mixed(nn.Module):
    """Embedding -> LayerNorm -> Linear -> RMSNorm -> Linear head."""

    def __init__(self, V=9, d=5, h=6):
        super().__init__()
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, h)
        self.rms = nn.RMSNorm(h)
        self.head = nn.Linear(h, V)

    def forward(self, tok):
        return self.head(self.rms(F.gelu(self.fc(self.ln(self.emb(tok))))))


class SmallCNN(nn.Module):
    """Conv2d -> GroupNorm -> ReLU -> Conv2d(groups) -> InstanceNorm2d(affine) -> pool -> Linear."""

    def __init__(self, classes=3):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.c2 = nn.Conv2d(4, 6, 3, groups=2, stride=2, padding=1)
        self.inorm = nn.InstanceNorm2d(6, affine=True)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(24, classes)

    def forward(self, x):
        h = F.relu(self.gn(self.c1(x)))
        h = self.pool(F.relu(self.inorm(self.c2(h))))
        return self.fc(h.flatten(1))


def class_ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _mixed_batches(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 9, (n, 6), generator=g), torch.randint(0, 9, (n, 6), generator=g)) for n in sizes]


def _cnn_batches(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 3, 6, 6, generator=g, dtype=D), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


@pytest.mark.parametrize("style", ["all-layer", "layer-wise", "param-wise", "explicit"])
@pytest.mark.parametrize("mode,fn", MODE_FN)
def test_mixed_model(mode, fn, style):
    torch.manual_seed(13)
    model = Mixed().to(D)
    with torch.no_grad():
        model.ln.weight.normal_()
        model.rms.weight.normal_()
    if style == "explicit":
        style = [
            ["emb.weight", "head.bias"],
            ["ln.weight", "ln.bias", "fc.weight"],
            ["fc.bias", "rms.weight"],
            ["head.weight"],
        ]
    red = ["mean", "sum"][(MODES.index(mode) + FNS.index(fn)) % 2]
    compare_engine_to_oracle(
        model, ce_per_sample, _mixed_batches([3, 1, 2], 14), mode=mode, fn=fn, batch_size=7, style=style, reduction=red
    )


@pytest.mark.parametrize("style", ["all-layer", "layer-wise", "param-wise", "explicit"])
@pytest.mark.parametrize("mode,fn", MODE_FN)
def test_small_cnn(mode, fn, style):
    torch.manual_seed(14)
    model = SmallCNN().to(D)
    names = trainable_names(model)
    if style == "explicit":
        style = [names[:3], names[3:7], names[7:]]
    red = ["sum", "mean"][(MODES.index(mode) + FNS.index(fn)) % 2]
    compare_engine_to_oracle(
        model, class_ce, _cnn_batches([2, 3], 15), mode=mode, fn=fn, batch_size=4, style=style, reduction=red
    )


@pytest.mark.parametrize("mode", MODES)
def test_small_cnn_float32(mode):
    torch.manual_seed(15)
    model = SmallCNN()  # float32
    batches = [(x.float(), y) for x, y in _cnn_batches([3, 2], 16)]
    compare_engine_to_oracle(
        model, class_ce, batches, mode=mode, fn="abadi", batch_size=5, style="layer-wise", rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("mode", MODES)
def test_mixed_model_float32(mode):
    torch.manual_seed(16)
    model = Mixed()
    compare_engine_to_oracle(
        model,
        ce_per_sample,
        _mixed_batches([4, 2], 17),
        mode=mode,
        fn="automatic",
        batch_size=6,
        style="param-wise",
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.parametrize("mode", MODES)
def test_explicit_groups_random_partition(mode):
    """Random explicit partitions of the mixed model's parameters (deterministic seed)."""
    import random

    rnd = random.Random(MODES.index(mode))
    torch.manual_seed(17)
    model = Mixed().to(D)
    perm = trainable_names(model)
    rnd.shuffle(perm)
    k = rnd.randint(2, len(perm))
    cuts = sorted(rnd.sample(range(1, len(perm)), k - 1))
    groups, prev = [], 0
    for c in cuts + [len(perm)]:
        groups.append(perm[prev:c])
        prev = c
    compare_engine_to_oracle(
        model, ce_per_sample, _mixed_batches([3, 2], 18), mode=mode, fn="abadi", batch_size=5, style=groups
    )
