"""fastdp.validate: find_problems names every module that prevents private training; fix replaces BatchNorm."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fastdp import validate
from fastdp.validate import check, default_num_groups, find_problems, fix


def _one(model: nn.Module, *fragments: str) -> str:
    problems = find_problems(model)
    assert len(problems) == 1, problems
    for f in fragments:
        assert f in problems[0], (f, problems[0])
    return problems[0]


# ---------------------------------------------------------------------------------------------- BatchNorm
@pytest.mark.parametrize("bn", [nn.BatchNorm1d(4), nn.BatchNorm2d(4), nn.BatchNorm3d(4),
                                nn.BatchNorm2d(4, affine=False), nn.LazyBatchNorm2d()])
def test_batchnorm_in_train_mode(bn):
    model = nn.Sequential(nn.Identity(), nn.Sequential(nn.Identity(), bn))
    _one(model, "module '1.1'", type(bn).__name__, "train mode", "fastdp.validate.fix")
    if not isinstance(bn, nn.modules.lazy.LazyModuleMixin):
        bn.requires_grad_(False)  # frozen parameters do not help: the batch statistics still mix samples
        _one(model, "module '1.1'")


def test_syncbatchnorm_in_train_mode():
    _one(nn.Sequential(nn.SyncBatchNorm(4)), "module '0' (SyncBatchNorm)", "across processes")


def test_batchnorm_in_eval_mode_with_running_stats_is_fine():
    bn = nn.BatchNorm2d(4)
    bn(torch.randn(8, 4, 3, 3))  # some running statistics
    model = nn.Sequential(nn.Conv2d(2, 4, 1), bn, nn.ReLU())
    bn.eval()
    bn.requires_grad_(False)
    assert find_problems(model) == []
    check(model)
    model.train()  # a later model.train() puts it back in train mode
    _one(model, "module '1'")


def test_batchnorm_without_running_stats_mixes_even_in_eval():
    bn = nn.BatchNorm1d(4, track_running_stats=False).eval()
    _one(nn.Sequential(bn), "track_running_stats=False", "eval mode")


# --------------------------------------------------------------------------------------- other problems
def test_embedding_options():
    _one(nn.Embedding(10, 3, max_norm=1.0), "module '<model>' (Embedding)", "max_norm=1.0")
    frozen = nn.Embedding(10, 3, max_norm=1.0).requires_grad_(False)
    _one(frozen, "max_norm")  # in-place renormalisation changes the weight even when frozen
    _one(nn.Embedding(10, 3, scale_grad_by_freq=True), "scale_grad_by_freq")
    _one(nn.Embedding(10, 3, sparse=True), "sparse=True")
    _one(nn.EmbeddingBag(10, 3, max_norm=2.0), "EmbeddingBag", "max_norm=2.0")
    assert find_problems(nn.Embedding(10, 3, scale_grad_by_freq=True, sparse=True).requires_grad_(False)) == []
    assert find_problems(nn.Embedding(10, 3, padding_idx=0)) == []


def test_instancenorm_running_stats():
    _one(nn.Sequential(nn.InstanceNorm2d(4, track_running_stats=True)), "module '0' (InstanceNorm2d)",
         "track_running_stats=True")
    assert find_problems(nn.InstanceNorm2d(4, track_running_stats=True).eval()) == []
    assert find_problems(nn.InstanceNorm1d(4, affine=True)) == []


def test_time_major_modules():
    _one(nn.MultiheadAttention(8, 2), "(MultiheadAttention)", "batch_first=False")
    _one(nn.TransformerEncoderLayer(8, 2), "(TransformerEncoderLayer)")  # its self_attn is not reported again
    _one(nn.Sequential(nn.TransformerDecoderLayer(8, 2)), "module '0' (TransformerDecoderLayer)")
    _one(nn.LSTM(4, 4), "(LSTM)")
    for m in (nn.MultiheadAttention(8, 2, batch_first=True), nn.TransformerEncoderLayer(8, 2, batch_first=True),
              nn.TransformerDecoderLayer(8, 2, batch_first=True), nn.GRU(4, 4, batch_first=True)):
        assert find_problems(m) == [], m
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer = nn.Transformer(8, 2, num_encoder_layers=2, num_decoder_layers=1, dim_feedforward=16)
    problems = find_problems(transformer)
    assert [p.split(" (")[0] for p in problems] == ["module 'encoder.layers.0'", "module 'encoder.layers.1'",
                                                   "module 'decoder.layers.0'"]


def test_clean_model_and_check():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.Flatten(), nn.LayerNorm(8 * 4 * 4),
                          nn.Linear(128, 4), nn.Embedding(3, 3))
    assert find_problems(model) == []
    bad = nn.Sequential(nn.BatchNorm2d(3), nn.Embedding(3, 3, max_norm=1.0))
    with pytest.raises(ValueError, match=r"cannot be trained privately(.|\n)*'0'(.|\n)*'1'"):
        check(bad)
    with pytest.raises(ValueError, match="torch.nn.Module"):
        find_problems("model")


# --------------------------------------------------------------------------------------------------- fix
class Block(nn.Module):
    def __init__(self, c: int, shared: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.shared(self.bn(self.conv(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = nn.BatchNorm2d(48, affine=False, eps=1e-3)
        self.stem = nn.Sequential(nn.Conv2d(3, 48, 3, padding=1), nn.BatchNorm2d(48))
        self.blocks = nn.Sequential(Block(48, shared), Block(48, shared))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(48, 20), nn.BatchNorm1d(20), nn.Linear(20, 5))
        self.sync = nn.SyncBatchNorm(5)
        self.tail = nn.BatchNorm3d(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head(self.pool(self.blocks(self.stem(x))))
        return h


def test_fix_replaces_every_batchnorm():
    torch.manual_seed(0)
    model = Net().double()
    with torch.no_grad():
        model.stem[1].weight.uniform_(0.5, 1.5)
        model.stem[1].bias.uniform_(-1, 1)
    model.stem[1].bias.requires_grad_(False)
    weight, bias = model.stem[1].weight.clone(), model.stem[1].bias.clone()
    x = torch.randn(6, 3, 8, 8, dtype=torch.float64)
    shape = model(x).shape
    assert len(find_problems(model)) == 7
    out = fix(model)
    assert out is model
    assert not any(isinstance(m, _BatchNorm) for m in model.modules())
    assert find_problems(model) == []
    assert model(x).shape == shape
    stem = model.stem[1]
    assert isinstance(stem, nn.GroupNorm) and (stem.num_groups, stem.num_channels) == (24, 48)
    assert stem.weight.dtype == torch.float64 and torch.equal(stem.weight, weight) and torch.equal(stem.bias, bias)
    assert stem.weight.requires_grad and not stem.bias.requires_grad
    shared = model.blocks[0].shared
    assert shared is model.blocks[1].shared and not shared.affine and shared.eps == 1e-3
    assert model.head[2].num_groups == 1  # BatchNorm1d: one group, never one channel per group
    assert (model.sync.num_groups, model.tail.num_groups) == (5, 32)


def test_fixed_model_is_accepted_by_the_engine():
    from fastdp import PrivacyEngine

    model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 2))
    kw = dict(batch_size=4, sample_size=100, noise_multiplier=1.0, accountant="rdp")
    with pytest.raises(ValueError, match="BatchNorm"):
        PrivacyEngine(model, **kw)
    PrivacyEngine(fix(model), **kw)


def test_fix_options_and_logging(caplog):
    model = nn.Sequential(nn.BatchNorm2d(12), nn.BatchNorm1d(6, affine=False))
    with caplog.at_level(logging.INFO, logger="fastdp.validate"):
        fix(model, num_groups=3)
    assert [m.num_groups for m in model] == [3, 3]
    assert "0 BatchNorm2d" in caplog.text and "GroupNorm(3, 12" in caplog.text
    with pytest.raises(ValueError, match=r"num_groups=5 does not divide the 12 channels of module '0'.*\[1, 2, 3, 4"):
        fix(nn.Sequential(nn.BatchNorm2d(12)), num_groups=5)
    with pytest.raises(ValueError, match="num_groups=0"):
        fix(nn.Sequential(), num_groups=0)
    root = nn.BatchNorm2d(8).eval()
    gn = fix(root)
    assert isinstance(gn, nn.GroupNorm) and gn.num_groups == 8 and not gn.training
    with pytest.raises(ValueError, match="lazy BatchNorm"):
        fix(nn.Sequential(nn.LazyBatchNorm1d()))
    lazy = nn.Sequential(nn.LazyBatchNorm2d())
    lazy(torch.randn(2, 6, 3, 3))
    assert fix(lazy)[0].num_channels == 6


@pytest.mark.parametrize("c, g", [(1, 1), (3, 3), (32, 32), (37, 1), (48, 24), (64, 32), (96, 32), (100, 25),
                                  (1024, 32)])
def test_default_num_groups(c, g):
    assert default_num_groups(c) == g
    assert c % g == 0 and g <= validate.MAX_GROUPS


def test_default_num_groups_rejects_bad_input():
    with pytest.raises(ValueError, match="num_channels=0"):
        default_num_groups(0)


# ---------------------------------------------------------------------------------------------- fused activations
class Halve(nn.Module):
    """A deterministic stand-in for timm's drop layer (dropout, DropBlock), so that keeping it shows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x


class FusedNet(nn.Module):
    """Conv -> timm BatchNormAct2d (GELU, not in place; a drop layer) -> Conv -> BatchNormAct2d (SiLU in place, no
    drop) -> BatchNormAct2d without activation -> pool -> Linear. 8 channels, 5x5 images."""

    def __init__(self) -> None:
        super().__init__()
        from timm.layers.norm_act import BatchNormAct2d

        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = BatchNormAct2d(8, act_layer=nn.GELU, inplace=False, drop_layer=Halve)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = BatchNormAct2d(8, act_layer=nn.SiLU)
        self.bn3 = BatchNormAct2d(8, apply_act=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn3(self.bn2(self.conv2(self.bn1(self.conv1(x)))))
        return self.head(h.mean((2, 3)))


def _fused_fixed() -> nn.Module:
    pytest.importorskip("timm")
    torch.manual_seed(0)
    model = FusedNet().double()
    with torch.no_grad():
        for bn in (model.bn1, model.bn2, model.bn3):
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-1, 1)
    return fix(model, num_groups=4)


def test_fix_keeps_a_fused_activation_and_drop_layer(caplog):
    from fastdp.norm_act import GroupNormAct

    pytest.importorskip("timm")
    torch.manual_seed(0)
    model = FusedNet().double()
    acts = model.bn1.act, model.bn2.act
    weight = model.bn1.weight.detach().clone()
    with caplog.at_level(logging.INFO, logger="fastdp.validate"):
        fix(model, num_groups=4)
    assert "bn1 BatchNormAct2d" in caplog.text and "fused activation GELU and drop layer Halve kept" in caplog.text
    assert "fused activation SiLU and drop layer Identity kept" in caplog.text
    assert not any(isinstance(m, _BatchNorm) for m in model.modules()) and find_problems(model) == []
    for bn, act in zip((model.bn1, model.bn2), acts, strict=True):
        assert isinstance(bn, GroupNormAct) and type(bn.norm) is nn.GroupNorm and bn.act is act
        assert (bn.num_groups, bn.num_channels, bn.eps, bn.affine) == (4, 8, 1e-5, True)
    assert isinstance(model.bn1.drop, Halve) and type(model.bn3) is nn.GroupNorm  # no activation: a plain GroupNorm
    assert torch.equal(model.bn1.norm.weight, weight)
    assert sorted(n for n, _ in model.bn1.named_parameters()) == ["norm.bias", "norm.weight"]
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    gn = model.bn1.norm
    torch.testing.assert_close(model.bn1(x), nn.functional.gelu(0.5 * gn(x)), rtol=0, atol=0)
    torch.testing.assert_close(model.bn2(x), nn.functional.silu(model.bn2.norm(x)), rtol=0, atol=0)


def test_fused_groupnorm_is_clipped_by_the_groupnorm_kind():
    from model_oracle import check_engine
    from oracle import MODES, make_engine

    for k, (mode, b) in enumerate(zip(MODES, [3, 1, 8, 4, 3], strict=False)):  # 8: B equals the channels
        model = _fused_fixed()
        rows = {r["module"]: r["kind"] for r in make_engine(model, batch_size=b).plan.describe()}
        assert rows["bn1.norm"] == rows["bn2.norm"] == rows["bn3"] == "GroupNorm" and "bn1" not in rows, rows
        g = torch.Generator().manual_seed(k)
        data = [((torch.randn(n, 3, 5, 5, generator=g, dtype=torch.float64),),
                 torch.randn(n, 3, generator=g, dtype=torch.float64)) for n in ([b, 0, 2] if b == 3 else [b])]
        check_engine(model, lambda out, y: 0.5 * (out - y).pow(2).sum(1), data, mode=mode)


def test_fixed_fused_groupnorm_loads_a_plain_groupnorm_state_dict():
    model = _fused_fixed()
    old = {k.replace("norm.", ""): v + 1 for k, v in model.state_dict().items()}  # as fix wrote it before
    model.load_state_dict(old)
    assert torch.equal(model.bn1.norm.weight, old["bn1.weight"]) and torch.equal(model.bn2.norm.bias, old["bn2.bias"])
    model.load_state_dict({k: v - 1 for k, v in model.state_dict().items()})  # its own keys


def test_fix_refuses_a_batchnorm_with_an_unknown_forward():
    class Shifted(nn.BatchNorm2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + 1

    model = nn.Sequential(nn.BatchNorm2d(4), Shifted(4))
    with pytest.raises(ValueError, match=r"module '1' \(Shifted\) is a BatchNorm subclass whose forward is .*Shifted"
                                         r".*GroupNormAct"):
        fix(model)
    assert type(model[0]) is nn.BatchNorm2d  # nothing replaced: the model is unchanged
