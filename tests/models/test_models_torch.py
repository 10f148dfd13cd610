"""Plain-torch models against the batch-of-one oracle (float64, 1e-6 relative): nn.TransformerEncoderLayer and
nn.MultiheadAttention (batch_first=True; raw in_proj_weight / q_proj_weight / bias_k, out_proj used through
F.multi_head_attention_forward rather than its own forward), modules called several times in one forward, raw
nn.Parameters used by broadcasting (x + pos with pos (1, T, d), an expanded class token, a 0-dim temperature) and
custom modules with their own nn.Parameter (x * self.scale); plus what the engine must refuse.

Sizes: batches of 1, 3 or 4; T=7 (memory S=5), d=16 with 2 heads of 8, ffn 24, 5 classes, vocabulary 29.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from model_oracle import D, check_engine, cls_loss, mse_loss
from oracle import FNS, MODES, make_engine
from torch import nn

V, T, S, DM, FF, C = 29, 7, 5, 16, 24, 5


def _ids(sizes, seed, with_mask=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        ids = torch.randint(0, V, (n, T), generator=g)
        y = torch.randint(0, C, (n,), generator=g)
        if with_mask:
            pad = torch.zeros(n, T, dtype=torch.bool)
            for i in range(n):
                pad[i, T - (i % 3):] = True  # True = padding (key_padding_mask convention); sample 0 unpadded
            out.append(((ids, pad), y))
        else:
            out.append(((ids,), y))
    return out


# --------------------------------------------------------------------------- models


class Scale(nn.Module):
    """A custom module with its own parameter: x * self.scale (broadcast over all but the last dim)."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.3 * torch.randn(d))

    def forward(self, x):
        return x * self.scale


class EncoderClassifier(nn.Module):
    """Embedding + raw positional parameter (1, T, d) -> TransformerEncoderLayer(s) -> Scale -> mean-pool head."""

    def __init__(self, norm_first=False, layers=1, activation="gelu"):
        super().__init__()
        self.emb = nn.Embedding(V, DM)
        self.pos = nn.Parameter(0.5 * torch.randn(1, T, DM))
        layer = nn.TransformerEncoderLayer(DM, 2, FF, dropout=0.0, batch_first=True, norm_first=norm_first,
                                           activation=activation)
        if layers == 1:
            self.enc = layer
        else:
            self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.post = Scale(DM)
        self.head = nn.Linear(DM, C)

    def forward(self, ids, pad=None):
        h = self.emb(ids) + self.pos
        h = self.enc(h, src_key_padding_mask=pad)
        h = self.post(h)
        if pad is None:
            return self.head(h.mean(1))
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


class CrossAttention(nn.Module):
    """nn.MultiheadAttention(batch_first=True) used as cross-attention, optionally with kdim/vdim (separate raw
    q/k/v projection weights), add_bias_kv (raw bias_k / bias_v of shape (1, 1, E)) and add_zero_attn."""

    def __init__(self, kdim=None, add_bias_kv=False, add_zero_attn=False, bias=True):
        super().__init__()
        kd = kdim or DM
        self.q_in = nn.Linear(6, DM)
        self.kv_in = nn.Linear(6, kd)
        self.attn = nn.MultiheadAttention(DM, 2, batch_first=True, kdim=kdim, vdim=kdim, add_bias_kv=add_bias_kv,
                                          add_zero_attn=add_zero_attn, bias=bias)
        if add_bias_kv:
            with torch.no_grad():
                self.attn.bias_k.normal_()
                self.attn.bias_v.normal_()
        if bias:
            with torch.no_grad():
                self.attn.in_proj_bias.normal_(std=0.3)
                self.attn.out_proj.bias.normal_(std=0.3)
        self.head = nn.Linear(DM, 3)

    def forward(self, x, mem):
        kv = torch.tanh(self.kv_in(mem))
        out, _ = self.attn(torch.tanh(self.q_in(x)), kv, kv, need_weights=False)
        return self.head(out)


class SelfAttention(nn.Module):
    """MultiheadAttention self-attention (query is key is value: the packed in_proj path) with a padding mask."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, DM)
        self.attn = nn.MultiheadAttention(DM, 2, batch_first=True)
        with torch.no_grad():
            self.attn.in_proj_bias.normal_(std=0.3)
        self.head = nn.Linear(DM, C)

    def forward(self, ids, pad):
        h = self.emb(ids)
        a, _ = self.attn(h, h, h, key_padding_mask=pad)
        return self.head((h + a).mean(1))


class SharedBlocks(nn.Module):
    """ALBERT-style weight sharing: one block (Linear, LayerNorm, Scale) applied three times, and one Linear used
    both inside the block and for the readout."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, DM)
        self.fc = nn.Linear(DM, DM)
        self.ln = nn.LayerNorm(DM)
        self.scale = Scale(DM)
        self.head = nn.Linear(DM, C)

    def block(self, h):
        return h + self.scale(torch.tanh(self.fc(self.ln(h))))

    def forward(self, ids):
        h = self.emb(ids) + 0.5 * self.emb(ids.flip(1))
        for _ in range(3):
            h = self.block(h)
        return self.head(self.fc(h).mean(1))


class RawParams(nn.Module):
    """Raw parameters on the root module used by broadcasting: pos (1, T, d) added, cls (1, 1, d) expanded and
    concatenated, W (d, 6) used in a matmul, temp (0-dim) multiplying, and a Scale module called twice."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, DM)
        self.pos = nn.Parameter(0.5 * torch.randn(1, T, DM))
        self.cls = nn.Parameter(torch.randn(1, 1, DM))
        self.scale = Scale(DM)
        self.W = nn.Parameter(torch.randn(DM, 6) / 4)
        self.temp = nn.Parameter(torch.tensor(1.3))
        self.head = nn.Linear(6, C)

    def forward(self, ids):
        h = self.emb(ids) + self.pos
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1)
        h = self.scale(torch.tanh(self.scale(h)))
        h = torch.tanh(h @ self.W) * self.temp
        return self.head(h[:, 0] + h[:, 1:].mean(1))


class PosOnly(nn.Module):
    """The minimal broadcast case: Embedding + pos parameter (1, T, d) + Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, DM)
        self.pos = nn.Parameter(torch.randn(1, T, DM))
        self.head = nn.Linear(DM, C)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids) + self.pos).mean(1))


def _build(cls, seed=0, **kw):
    torch.manual_seed(seed)
    return cls(**kw).to(D)


def _xmem(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(n, T, 6, generator=g, dtype=D), torch.randn(n, S, 6, generator=g, dtype=D)),
             torch.randn(n, T, 3, generator=g, dtype=D)) for n in sizes]


# (mode, fn, style, reduction, sizes)
CONFIGS = [
    ("BK-MixOpt", "abadi", "all-layer", "mean", [3, 1]),
    ("BK-MixGhostClip", "automatic", "layer-wise", "sum", [4]),
    ("BK-ghost", "global", "param-wise", "mean", [3, 4]),
    ("ghost", "abadi", "layer-wise", "sum", [1]),
    ("instantiate", "automatic", "all-layer", "mean", [3]),
]
IDS = [c[0] for c in CONFIGS]


def _run(model, loss, data, mode, fn, style, reduction, sizes):
    return check_engine(model, loss, data, mode=mode, fn=fn, style=style, reduction=reduction,
                        where="below" if sizes == [1] else "middle")


@pytest.mark.parametrize("mode,fn,style,reduction,sizes", CONFIGS, ids=IDS)
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_layer(norm_first, mode, fn, style, reduction, sizes):
    model = _build(EncoderClassifier, 1, norm_first=norm_first)
    _run(model, cls_loss, _ids(sizes, 2, with_mask=sizes != [1]), mode, fn, style, reduction, sizes)


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost", "instantiate"])
def test_transformer_encoder_stack(mode):
    """nn.TransformerEncoder of two deep-copied layers, relu activation, no padding mask."""
    model = _build(EncoderClassifier, 3, layers=2, activation="relu")
    check_engine(model, cls_loss, _ids([3, 1], 4), mode=mode, fn="automatic", style="layer-wise", reduction="sum")


@pytest.mark.parametrize("mode,fn,style,reduction,sizes", CONFIGS, ids=IDS)
def test_multihead_self_attention(mode, fn, style, reduction, sizes):
    model = _build(SelfAttention, 5)
    _run(model, cls_loss, _ids(sizes, 6, with_mask=True), mode, fn, style, reduction, sizes)


@pytest.mark.parametrize(
    "kw",
    [{}, {"kdim": 12}, {"add_bias_kv": True}, {"add_zero_attn": True, "bias": False}],
    ids=["packed", "kdim", "bias_kv", "zero_attn_nobias"],
)
@pytest.mark.parametrize("mode", ["BK-MixOpt", "BK-ghost", "instantiate"])
def test_multihead_cross_attention(mode, kw):
    model = _build(CrossAttention, 7, **kw)
    names = [n for n, _ in model.named_parameters()]
    if "kdim" in kw:
        assert {"attn.q_proj_weight", "attn.k_proj_weight", "attn.v_proj_weight"} <= set(names)
    if kw.get("add_bias_kv"):
        assert {"attn.bias_k", "attn.bias_v"} <= set(names)
    style = "layer-wise" if mode == "BK-ghost" else "all-layer"
    check_engine(model, mse_loss, _xmem([3, 1], 8), mode=mode, fn="abadi", style=style)


@pytest.mark.parametrize("mode,fn,style,reduction,sizes", CONFIGS, ids=IDS)
def test_module_called_several_times(mode, fn, style, reduction, sizes):
    model = _build(SharedBlocks, 9)
    _run(model, cls_loss, _ids(sizes, 10), mode, fn, style, reduction, sizes)


@pytest.mark.parametrize("mode,fn,style,reduction,sizes", CONFIGS, ids=IDS)
def test_raw_parameters_broadcast(mode, fn, style, reduction, sizes):
    model = _build(RawParams, 11)
    _run(model, cls_loss, _ids(sizes, 12), mode, fn, style, reduction, sizes)


@pytest.mark.parametrize("mode", MODES)
def test_raw_positional_parameter_only(mode):
    model = _build(PosOnly, 13)
    check_engine(model, cls_loss, _ids([3, 1], 14), mode=mode, fn="abadi", style="param-wise")


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost", "instantiate"])
def test_custom_module_own_parameter_alone(mode):
    """Only the custom module's parameter is trainable (everything else frozen)."""
    model = _build(RawParams, 15)
    for n, p in model.named_parameters():
        p.requires_grad_(n == "scale.scale")
    check_engine(model, cls_loss, _ids([4], 16), mode=mode, fn="automatic", reduction="sum")


# --------------------------------------------------------------------------- refusals


class SeqFirst(nn.Module):
    def __init__(self, frozen_attn=False):
        super().__init__()
        self.inp = nn.Linear(6, DM)
        self.my_attn = nn.MultiheadAttention(DM, 2)  # batch_first=False
        if frozen_attn:
            self.my_attn.requires_grad_(False)

    def forward(self, x):
        h = self.inp(x)
        return self.my_attn(h, h, h)[0]


def test_multihead_attention_not_batch_first_is_refused():
    model = SeqFirst().to(D)
    with pytest.raises(ValueError, match="my_attn") as e:
        make_engine(model, batch_size=4)
    assert "batch_first=True" in str(e.value)


def test_transformer_encoder_layer_not_batch_first_is_refused():
    model = nn.Sequential(nn.TransformerEncoderLayer(DM, 2, FF, dropout=0.0)).to(D)
    with pytest.raises(ValueError, match="batch_first=True") as e:
        make_engine(model, batch_size=4)
    assert "0.self_attn" in str(e.value) or "'0'" in str(e.value)


class WithBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.my_bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.my_bn(self.conv(x)).mean((2, 3)))


def test_batchnorm_in_train_mode_is_refused():
    with pytest.raises(ValueError, match="my_bn"):
        make_engine(WithBN().to(D), batch_size=4)


def test_frozen_batchnorm_in_train_mode_is_refused():
    """Frozen, but still in train mode: its batch statistics mix the samples in the forward."""
    model = WithBN().to(D)
    model.my_bn.requires_grad_(False)
    with pytest.raises(ValueError, match="my_bn"):
        make_engine(model, batch_size=4)


# --------------------------------------------------------------------------- slow grid


SLOW_MODELS = {
    "encoder": lambda: (_build(EncoderClassifier, 20), cls_loss, _ids([3, 1], 21, with_mask=True)),
    "encoder_prenorm": lambda: (_build(EncoderClassifier, 22, norm_first=True), cls_loss, _ids([4], 23)),
    "self_attn": lambda: (_build(SelfAttention, 24), cls_loss, _ids([3, 1], 25, with_mask=True)),
    "cross_attn_kdim": lambda: (_build(CrossAttention, 26, kdim=12, add_bias_kv=True), mse_loss, _xmem([3], 27)),
    "shared": lambda: (_build(SharedBlocks, 28), cls_loss, _ids([3, 1], 29)),
    "raw": lambda: (_build(RawParams, 30), cls_loss, _ids([4], 31)),
}


@pytest.mark.slow
@pytest.mark.parametrize("style", ["all-layer", "layer-wise", "param-wise"])
@pytest.mark.parametrize("mode,fn", list(itertools.product(MODES, FNS)))
@pytest.mark.parametrize("name", list(SLOW_MODELS))
def test_torch_models_full_grid_slow(name, mode, fn, style):
    model, loss, data = SLOW_MODELS[name]()
    red = ["mean", "sum"][(MODES.index(mode) + FNS.index(fn)) % 2]
    check_engine(model, loss, data, mode=mode, fn=fn, style=style, reduction=red)
