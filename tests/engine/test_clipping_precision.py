"""The clipping stage's numerics do not follow the user's reduced-precision settings.

A user may make float32 products faster and less exact (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``
on CPU, TF32 on CUDA, where cuDNN convolutions use TF32 by default). The engine's per-sample norms and clipped sums
must stay at float32 precision anyway (``fastdp.torch_api.ieee_float32`` inside
``fastdp.layers.base.clipping_precision``): a norm underestimated by rounding lets a clipped gradient exceed the
threshold. Here the ghost norms and book-keeping contractions the engine forms under a bf16 setting are compared with
float64 ones of the same captured tensors, and the user's settings must be left as they were.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fastdp
import fastdp.layers._matmul as matmul_mod
from fastdp.torch_api import _fp32_precision_targets, ieee_float32


def _targets():
    return _fp32_precision_targets()


def _reduced_precision_matmul_available() -> bool:
    a = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    exact = a.double() @ a.double().t()
    saved = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        err = ((a @ a.t()).double() - exact).abs().max() / exact.abs().max()
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = saved
    return float(err) > 1e-5


def test_ieee_float32_sets_and_restores_every_backend():
    targets = _targets()
    assert len(targets) == 6
    saved = [t.fp32_precision for t in targets]
    try:
        for t in targets:
            t.fp32_precision = "tf32"
        targets[3].fp32_precision = "bf16"
        before = [t.fp32_precision for t in targets]
        with pytest.raises(ValueError, match="inside"):
            with ieee_float32():
                assert [t.fp32_precision for t in targets] == ["ieee"] * 6
                raise ValueError("inside")
        assert [t.fp32_precision for t in targets] == before
    finally:
        for t, v in zip(targets, saved, strict=True):
            t.fp32_precision = v


def _observed() -> tuple:
    """Every TF32 setting as the user (and cuBLAS / cuDNN) reads it; "raises" where torch refuses a legacy read
    because the legacy and new settings disagree (cuBLAS makes the same check before every float32 product)."""
    def read(get):
        try:
            return get()
        except RuntimeError:
            return "raises"
    return (read(lambda: torch.backends.cuda.matmul.allow_tf32), read(torch.get_float32_matmul_precision),
            read(lambda: torch.backends.cudnn.allow_tf32), tuple(t.fp32_precision for t in _targets()))


USER_SETTINGS = {
    "untouched": lambda: None,
    "legacy cuda.matmul.allow_tf32": lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    "legacy matmul precision high": lambda: torch.set_float32_matmul_precision("high"),
    "legacy matmul precision medium": lambda: torch.set_float32_matmul_precision("medium"),
    "legacy cudnn.allow_tf32 off": lambda: setattr(torch.backends.cudnn, "allow_tf32", False),
    "new cuda.matmul tf32": lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
    "new mkldnn.matmul bf16": lambda: setattr(torch.backends.mkldnn.matmul, "fp32_precision", "bf16"),
    "new cudnn.conv ieee": lambda: setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee"),
    "legacy high then new cuda ieee": lambda: (torch.set_float32_matmul_precision("high"),
                                               setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee")),
}


@pytest.fixture
def pristine_tf32_settings():
    saved = [(t, t.fp32_precision) for t in _targets()]
    yield
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True
    for t, v in saved:
        t.fp32_precision = v


@pytest.mark.skipif(len(_targets()) < 6, reason="torch < 2.9 has only the legacy TF32 settings")
@pytest.mark.parametrize("setting", list(USER_SETTINGS))
def test_inside_the_block_every_setting_reads_ieee_and_the_users_settings_come_back(setting,
                                                                                    pristine_tf32_settings):
    """Whatever mix of legacy and new TF32 settings the user made, inside ``ieee_float32`` every reader (the
    legacy getters that cuBLAS and cuDNN consult included) sees IEEE float32 without raising, and afterwards every
    setting reads as before. With only the new settings switched to "ieee", a user's legacy
    ``set_float32_matmul_precision("high")`` made the legacy read raise inside the block, the check cuBLAS makes
    before each float32 product on CUDA."""
    USER_SETTINGS[setting]()
    before = _observed()
    with ieee_float32():
        inside = _observed()
    assert inside == (False, "highest", False, ("ieee",) * 6), inside
    assert _observed() == before


class _Net(nn.Module):
    """Linear and Conv weights (ghost norms and contractions), a generic-path parameter (PReLU) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 16, 3, padding=1)
        self.act = nn.PReLU()
        self.lin = nn.Linear(16, 64)
        self.head = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.conv(x)).transpose(1, 2)  # (B, T, 16)
        return self.head(torch.tanh(self.lin(h))).mean(1)


@pytest.mark.skipif(not _reduced_precision_matmul_available(),
                    reason="this CPU's oneDNN does not reduce float32 matmul precision (no bf16 support)")
@pytest.mark.parametrize("mode", ["BK-MixOpt", "BK-ghost", "ghost", "instantiate"])
def test_norms_and_sums_stay_exact_under_a_bf16_float32_setting(mode, monkeypatch):
    errors: list[float] = []

    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30))

    real_ghost, real_sum = matmul_mod.ghost_norm_sq, matmul_mod.clipped_sum

    def ghost(A, G, share=True, narrow=None):
        got = real_ghost(A, G, share, narrow)
        want = torch.einsum("bgtp,bgtd->bgpd", G.double(), A.double()).flatten(1).square().sum(1)
        errors.append(rel(got, want))
        return got

    def contraction(A, G, coef, narrow=None):
        got = real_sum(A, G, coef, narrow)
        want = torch.einsum("b,bgtp,bgtd->gpd", coef.double(), G.double(), A.double())
        errors.append(rel(got, want))
        return got

    monkeypatch.setattr(matmul_mod, "ghost_norm_sq", ghost)
    monkeypatch.setattr(matmul_mod, "clipped_sum", contraction)
    targets = _targets()
    saved = [t.fp32_precision for t in targets]
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    torch.backends.mkldnn.conv.fp32_precision = "bf16"
    try:
        user = [t.fp32_precision for t in targets]
        torch.manual_seed(0)
        model = _Net()
        engine = fastdp.PrivacyEngine(model, batch_size=6, sample_size=60, noise_multiplier=0.0,
                                      max_grad_norm=1e-3, clipping_mode=mode)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine.attach(opt)
        x = torch.randn(6, 4, 12)
        model(x).pow(2).sum().backward()
        opt.step()
        assert [t.fp32_precision for t in targets] == user  # the user's settings are back
    finally:
        for t, v in zip(targets, saved, strict=True):
            t.fp32_precision = v
    if mode != "instantiate":
        assert errors, "no ghost norm or contraction ran"
    assert max(errors, default=0.0) < 1e-5, errors
