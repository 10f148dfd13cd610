"""DP-BiTFiT end to end (issue 5): the helpers in fastdp.bitfit, the activation-free path, DP-BiTFiT-Add, BatchNorm
in eval mode as a trainable per-sample layer, and two-phase X+BiTFiT under one accountant -- exact against the
batch-of-one oracle."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from oracle import MODES, compare_engine_to_oracle, mse_per_sample, trainable_names, user_loss
from torch import nn

from fastdp import PrivacyEngine
from fastdp.bitfit import add_missing_biases, freeze_all_but_bias, is_bias

D = torch.float64


def ce_per_sample(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, y, reduction="none")


class TinyLM(nn.Module):
    """Embedding, bias-free Linear layers (Llama-style), a LayerNorm and a classifier head."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.up = nn.Linear(6, 8, bias=bias)
        self.down = nn.Linear(8, 6, bias=bias)
        self.norm = nn.LayerNorm(6)
        self.classifier = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.down(torch.tanh(self.up(h)))
        return self.classifier(self.norm(h).mean(1))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _lm_data(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 11, (n, 7), generator=g), torch.randint(0, 3, (n,), generator=g))]


# --------------------------------------------------------------------------- helpers


def test_freeze_all_but_bias_keeps_biases_and_the_head():
    model = TinyLM(bias=True)
    names = freeze_all_but_bias(model, keep=("classifier",))
    assert names == [n for n, p in model.named_parameters() if p.requires_grad]
    assert set(names) == {"up.bias", "down.bias", "norm.bias", "classifier.weight", "classifier.bias"}
    names = freeze_all_but_bias(model, keep="classifier")  # a single string is one module name
    assert "classifier.weight" in names
    assert set(freeze_all_but_bias(model)) == {"up.bias", "down.bias", "norm.bias", "classifier.bias"}


def test_freeze_all_but_bias_errors():
    with pytest.raises(ValueError, match="matches no module"):
        freeze_all_but_bias(TinyLM(), keep=("head",))
    with pytest.raises(ValueError, match="add_missing_biases"):
        freeze_all_but_bias(nn.Sequential(nn.Linear(3, 2, bias=False)))


def test_is_bias():
    assert is_bias("layer.0.bias") and is_bias("attn.in_proj_bias") and is_bias("bias_k")
    assert not is_bias("bias_layer.weight") and not is_bias("weight")


def test_add_missing_biases_keeps_outputs_and_adds_zero_biases():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4, bias=False), nn.Conv1d(1, 2, 2, bias=False), nn.LayerNorm(3, bias=False),
                          nn.Linear(2, 2)).to(D)
    x = torch.randn(5, 3, dtype=D)

    def run(m):
        h = m[0](x).unsqueeze(1)  # (5, 1, 4)
        h = m[1](h)  # (5, 2, 3)
        return m[3](m[2](h).transpose(1, 2))

    before = run(model)
    added = add_missing_biases(model)
    assert added == ["0", "1", "2"]
    assert torch.equal(run(model), before)
    for name in added:
        b = model.get_submodule(name).bias
        assert isinstance(b, nn.Parameter) and b.requires_grad and torch.count_nonzero(b) == 0 and b.dtype == D
    assert add_missing_biases(model) == []  # idempotent


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("mode", MODES)
def test_dp_bitfit_add_is_exact(mode):
    torch.manual_seed(1)
    model = TinyLM(bias=False).to(D)
    add_missing_biases(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if is_bias(n):
                p.normal_(0, 0.3)  # non-zero biases: a stronger check than the zero initialisation
    freeze_all_but_bias(model, keep=("classifier",))
    compare_engine_to_oracle(model, ce_per_sample, _lm_data(), mode=mode, fn="abadi", batch_size=5)


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_in_eval_mode_trains_its_affine_parameters_exactly(mode):
    torch.manual_seed(2)
    model = ConvNet().to(D)
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2.0)
        model.bn.weight.normal_()
    model.eval()
    x, y = torch.randn(4, 2, 6, 6, dtype=D), torch.randn(4, 3, dtype=D)
    compare_engine_to_oracle(model, mse_per_sample, [(x, y)], mode=mode, fn="automatic", batch_size=4,
                             style="layer-wise")
    bitfit = ConvNet().to(D).eval()
    freeze_all_but_bias(bitfit)
    compare_engine_to_oracle(bitfit, mse_per_sample, [(x, y)], mode=mode, fn="abadi", batch_size=4)


def test_batchnorm_without_running_statistics_is_refused_even_in_eval_mode():
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, track_running_stats=False)).eval()
    with pytest.raises(ValueError, match="track_running_stats"):
        PrivacyEngine(model, batch_size=2, sample_size=10, noise_multiplier=1.0)


def test_bias_only_layers_keep_no_activation():
    """The activation-free path: with only biases trainable (and no head kept), no hooked layer keeps its input."""
    model = TinyLM(bias=True).to(D)
    freeze_all_but_bias(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, batch_size=5, sample_size=50, noise_multiplier=0.0)
    engine.attach(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
    (x, y), = _lm_data()
    out = model(x)
    records = list(engine._capture.pending)
    assert records and all(r.activation is None for r in records), [type(r.module).__name__ for r in records]
    assert all(not p.requires_grad for n, p in model.named_parameters() if not is_bias(n))
    ce_per_sample(out, y).mean().backward()


# --------------------------------------------------------------------------- two phases, one accountant


def test_two_phase_full_then_bitfit_composes_epsilon_over_both_phases():
    from fastdp.accounting import get_epsilon

    torch.manual_seed(3)
    model = TinyLM(bias=True).to(D)
    sigma, B, n = 1.2, 5, 100
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, batch_size=B, sample_size=n, noise_multiplier=sigma, accountant="rdp",
                               noise_generator=torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine.attach(opt)
    data = _lm_data(B, seed=4) * 3
    for x, y in data:  # phase 1: full fine-tuning
        user_loss(ce_per_sample(model(x), y), "mean").backward()
        opt.step()
        opt.zero_grad()
    frozen = {nm: p.detach().clone() for nm, p in model.named_parameters() if not is_bias(nm)}
    freeze_all_but_bias(model)
    engine.update_trainable()
    for x, y in data:  # phase 2: DP-BiTFiT
        user_loss(ce_per_sample(model(x), y), "mean").backward()
        opt.step()
        opt.zero_grad()
    for nm, p in model.named_parameters():
        if nm in frozen:
            assert torch.equal(p.detach(), frozen[nm]), nm
            assert p.grad is None
    assert engine.steps == 6 and engine.accountant.steps == 6
    want = get_epsilon(sigma, B / n, 6, engine.target_delta, accountant="rdp")
    assert engine.get_privacy_spent()["epsilon"] == pytest.approx(want, rel=1e-9)


def test_two_phase_second_phase_is_exact():
    """After update_trainable(), the released bias gradients equal the oracle's for the bias-only model."""
    torch.manual_seed(5)
    model = TinyLM(bias=True).to(D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, batch_size=5, sample_size=100, noise_multiplier=0.0, max_grad_norm=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine.attach(opt)
    (x, y), = _lm_data(5, seed=6)
    user_loss(ce_per_sample(model(x), y), "mean").backward()
    opt.step()
    opt.zero_grad()
    freeze_all_but_bias(model)
    engine.update_trainable()
    fresh = TinyLM(bias=True).to(D)  # oracle copy (a deepcopy would copy the engine's hooks)
    fresh.load_state_dict(model.state_dict())
    freeze_all_but_bias(fresh)
    from oracle import clipped_sum, per_sample_grads

    names = trainable_names(fresh)
    want = clipped_sum(per_sample_grads(copy.deepcopy(fresh), ce_per_sample, [(x, y)], names), [names], "abadi",
                       0.05, 5)
    user_loss(ce_per_sample(model(x), y), "mean").backward()
    opt.step()
    for nm in names:
        torch.testing.assert_close(model.get_parameter(nm).grad, want[nm], rtol=1e-6, atol=1e-12)
