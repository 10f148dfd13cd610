"""Opacus (``benchmarks/opacus_runner.py``) and fastdp release the same clipped gradient, so timing them side by side
compares the same computation.

With ``noise_multiplier=0`` both should release ``(1/B) sum_i g_i min(1, R / (||g_i|| + 1e-6))`` (flat / all-layer
clipping). For each model x Opacus mode that Opacus runs we take one step of each library on the same float64 batch
and compare the gradients their optimizers applied (``p.grad`` after ``step()``: both write the released gradient
there and SGD leaves it). ``R`` lies between the two middle brute-force per-sample gradient norms, so half the
samples are clipped and half are not, and each test first checks that the clipped mean differs from the unclipped
mean by far more than the tolerance (a test that cannot pass with clipping switched off or done differently).

The model x mode pairs Opacus refuses are pinned with the reason it gives (if an Opacus upgrade changes that, the
test fails and the runner's docstring needs updating).
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("opacus")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from opacus_runner import OpacusUnsupported, make_opacus_step  # noqa: E402

import fastdp  # noqa: E402

B = 4
T = 6
D = torch.float64
TOL = 1e-9  # relative, float64


# ---------------------------------------------------------------------------------------------- models
def _toy_lm():
    """Untied embedding -> linear LM (exercises task="lm" in both modes)."""
    g = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Embedding(40, 8), nn.Tanh(), nn.Linear(8, 40)).to(D)
    x = torch.randint(0, 40, (B, T), generator=g)
    y = torch.randint(0, 40, (B, T), generator=g)
    return model, "lm", (x, y), lambda m, x: m(x)


def _gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2, n_positions=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).to(D)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 300, (B, T), generator=g)
    return model, "lm", (x, torch.roll(x, -1, 1)), lambda m, x: m(input_ids=x).logits


def _roberta():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.RobertaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, num_labels=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.RobertaForSequenceClassification(cfg).to(D)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(3, 300, (B, T), generator=g)
    y = torch.tensor([0, 1, 1, 0])
    return model, "cls", (x, y), lambda m, x: m(input_ids=x).logits


def _vit():
    pytest.importorskip("torchvision")
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=16, embed_dim=32, depth=1,
                                                             num_heads=2, num_classes=10).to(D)
    with torch.no_grad():  # timm initialises these near zero; make their gradients non-trivial
        model.cls_token.normal_()
        model.pos_embed.normal_(std=0.5)
    g = torch.Generator().manual_seed(4)
    return model, "cls", (torch.randn(B, 3, 32, 32, generator=g, dtype=D), torch.tensor([1, 3, 5, 7])), \
        lambda m, x: m(x)


def _resnet_gn():
    pytest.importorskip("torchvision")
    pytest.importorskip("timm")
    from timm.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    model = ResNet(BasicBlock, [2, 2, 2, 2], num_classes=10,
                   norm_layer=lambda c, **k: nn.GroupNorm(min(32, c), c)).to(D)
    g = torch.Generator().manual_seed(5)
    return model, "cls", (torch.randn(B, 3, 32, 32, generator=g, dtype=D), torch.tensor([1, 3, 5, 7])), \
        lambda m, x: m(x)


# ---------------------------------------------------------------------------------------------- helpers
def _loss(task, logits, y):
    if task == "lm":
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return F.cross_entropy(logits, y)


def _per_sample_grads(model, task, batch, forward):
    """Brute force: one backward per sample (its own mean loss)."""
    x, y = batch
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(len(x)):
        grads = torch.autograd.grad(_loss(task, forward(model, x[i:i + 1]), y[i:i + 1]), params, allow_unused=True)
        out.append([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)])
    return out


def _flat(grads):
    return torch.cat([g.reshape(-1) for g in grads])


def _opacus_grad(model, mode, task, batch, forward, R):
    step = make_opacus_step(model, mode, task=task, batch_size=B, sample_size=10 * B, noise_multiplier=0.0,
                            max_grad_norm=R, lr=1.0, forward=forward)
    step(batch)
    return _flat([p.grad for p in model.parameters() if p.requires_grad])


def _fastdp_grad(model, task, batch, forward, R):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # noise_multiplier=0 warns (not private): intended here
        engine = fastdp.PrivacyEngine(model, batch_size=B, sample_size=10 * B, noise_multiplier=0.0,
                                      max_grad_norm=R, clipping_fn="abadi", loss_reduction="mean")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    engine.attach(opt)
    x, y = batch
    _loss(task, forward(model, x), y).backward()
    opt.step()
    grad = _flat([p.grad for p in model.parameters() if p.requires_grad])
    engine.detach()
    return grad


def _check_parity(build, mode):
    model, task, batch, forward = build()
    per_sample = [_flat(g) for g in _per_sample_grads(copy.deepcopy(model), task, batch, forward)]
    norms = torch.stack([g.norm() for g in per_sample])
    low, high = norms.sort().values[B // 2 - 1: B // 2 + 1].tolist()
    R = (low + high) / 2
    assert low < R < high, norms  # half the samples clipped, half not
    clipped = sum(g * min(1.0, R / (n.item() + 1e-6)) for g, n in zip(per_sample, norms, strict=True)) / B
    unclipped = sum(per_sample) / B
    gap = ((clipped - unclipped).norm() / clipped.norm()).item()
    assert gap > 1e3 * TOL, gap

    got_fastdp = _fastdp_grad(copy.deepcopy(model), task, batch, forward, R)
    got_opacus = _opacus_grad(copy.deepcopy(model), mode, task, batch, forward, R)
    rel = ((got_opacus - got_fastdp).norm() / got_fastdp.norm()).item()
    rel_oracle = ((got_opacus - clipped).norm() / clipped.norm()).item()
    assert rel < TOL, f"opacus vs fastdp: relative difference {rel:.3e} (clipping changes the mean by {gap:.3e})"
    assert rel_oracle < TOL, f"opacus vs brute force: {rel_oracle:.3e}"
    return rel


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_parity_toy_lm(mode):
    _check_parity(_toy_lm, mode)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_parity_roberta(mode):
    _check_parity(_roberta, mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_parity_vit(mode):
    _check_parity(_vit, mode)


@pytest.mark.parametrize(("build", "mode", "reason"), [
    # wpe sees position ids of shape (1, T): a batch of 1, so its "per-sample" gradient has batch size 1
    (_gpt2, "hooks", "stack expects each tensor to be equal size"),
    # lm_head.weight is wte.weight
    (_gpt2, "ghost", "Parameter tying is not supported with Ghost Clipping"),
    # full backward hooks on GroupNorm/Conv outputs + timm's in-place ReLU / `x += shortcut` (pytorch#61519)
    (_resnet_gn, "hooks", "Output 0 of BackwardHookFunction is a view and is being modified inplace"),
    (_resnet_gn, "ghost", "Output 0 of BackwardHookFunction is a view and is being modified inplace"),
], ids=["gpt2-hooks", "gpt2-ghost", "resnet_gn-hooks", "resnet_gn-ghost"])
def test_unsupported(build, mode, reason):
    model, task, batch, forward = build()
    step = make_opacus_step(model, mode, task=task, batch_size=B, sample_size=10 * B, forward=forward)
    with pytest.raises(OpacusUnsupported, match="first step") as info:
        step(batch)
    assert reason in str(info.value)
    assert not hasattr(next(model.parameters()), "_forward_counter")  # Opacus cleaned up after itself


def test_validator_errors_are_reported_not_fixed():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(OpacusUnsupported, match="ModuleValidator.*BatchNorm"):
        make_opacus_step(model, "hooks", task="cls", batch_size=B, sample_size=10 * B, forward=lambda m, x: m(x))
    assert isinstance(model[1], nn.BatchNorm1d)


def test_expected_batch_size_is_exact():
    # int(1024 * 49 * (1 / 49)) == 1023 in floating point: the runner must not inherit that from make_private
    step = make_opacus_step(nn.Linear(3, 2), "hooks", task="cls", batch_size=1024, sample_size=49 * 1024,
                            forward=lambda m, x: m(x))
    assert step.optimizer.expected_batch_size == 1024


def test_opacus_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "opacus", None)  # import opacus -> ImportError
    with pytest.raises(OpacusUnsupported, match="opacus is not installed"):
        make_opacus_step(nn.Linear(3, 2), "hooks", task="cls", batch_size=B, sample_size=10, forward=lambda m, x: m(x))


def test_bad_arguments():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="mode"):
        make_opacus_step(model, "ew", task="cls", batch_size=B, sample_size=10, forward=lambda m, x: m(x))
    with pytest.raises(ValueError, match="task"):
        make_opacus_step(model, "hooks", task="seq", batch_size=B, sample_size=10, forward=lambda m, x: m(x))
