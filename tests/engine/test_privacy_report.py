"""``engine.privacy_report()`` and the clipping stage's count of clipped samples (norm > R_k in some group),
checked against the brute-force oracle (one backward per sample, float64): the count, its fractions over steps
and virtual batches, batch sizes 0, 1 and equal to another dimension of the model; the report's epsilons
against the accountants; the private-source hook."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from fastdp.accounting import Gaussian, GDPAccountant, PRVAccountant, RDPAccountant
from tests.oracle import (
    choose_R,
    compare_engine_to_oracle,
    group_norms,
    make_engine,
    make_groups,
    mse_per_sample,
    oracle_model,
    per_sample_grads,
    trainable_names,
)

T, D_IN, HID, D_OUT = 6, 5, 4, 3


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(D_IN, HID), nn.Tanh(), nn.Linear(HID, D_OUT)).double()


def _batch(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, T, D_IN, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, max(n, 1))[:n, None, None]
    return x, torch.randn(n, T, D_OUT, generator=g, dtype=torch.float64)


def _oracle_clipped(model, batches, style, R) -> int:
    names = trainable_names(model)
    om = oracle_model(model)
    groups = make_groups(om, style, names)
    psg = per_sample_grads(om, mse_per_sample, batches, names)
    if next(iter(psg.values())).shape[0] == 0:
        return 0
    norms = group_norms(psg, groups)  # (N, K)
    return int((norms > R / math.sqrt(len(groups))).any(1).sum())


@pytest.mark.parametrize("mode", ["BK-MixOpt", "BK-ghost", "ghost", "instantiate"])
@pytest.mark.parametrize("style", ["all-layer", "layer-wise"])
@pytest.mark.parametrize("sizes", [(1,), (HID,), (T,), (7,), (3, 5)])  # (3, 5): two physical batches, one step
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_clipped_count_matches_oracle(mode, style, sizes, reduction):
    model = _model()
    batches = [_batch(n, seed=10 + k) for k, n in enumerate(sizes)]
    om = oracle_model(model)
    names = trainable_names(model)
    R = choose_R(per_sample_grads(om, mse_per_sample, batches, names), make_groups(om, style, names), "middle",
                 gap=1e-6)
    want = _oracle_clipped(model, batches, style, R)
    eng, *_ = compare_engine_to_oracle(model, mse_per_sample, batches, mode=mode, fn="abadi", style=style,
                                       reduction=reduction, R=R)
    k = eng.privacy_report()["clipped"]
    n = sum(sizes)
    assert k["samples"] == n and k["clipped"] == want
    assert k["fraction"] == pytest.approx(want / n) and k["last_step_fraction"] == pytest.approx(want / n)
    assert k["private"] is False
    if n > 1:  # choose_R puts R between the norms: the count is informative, not all or nothing
        assert 0 < want < n


def test_clipped_count_over_steps_and_empty_batch():
    model = _model()
    R = 12.0  # between the norms of the first batch (8.6 .. 20.2)
    sizes = [5, 0, 2]
    batches = [_batch(n, seed=step) for step, n in enumerate(sizes)]
    wants = [_oracle_clipped(model, [b], "all-layer", R) for b in batches]  # before attach (the oracle copies)
    assert 0 < wants[0] < 5
    eng = make_engine(model, batch_size=4, R=R, fn="global", sigma=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step sees the same model
    eng.attach(opt)
    assert eng.privacy_report()["clipped"]["fraction"] is None
    total_want = total_n = 0
    for (x, y), n, want in zip(batches, sizes, wants, strict=True):
        mse_per_sample(model(x), y).mean().backward()
        opt.step()
        opt.zero_grad()
        total_want += want
        total_n += n
        k = eng.privacy_report()["clipped"]
        assert (k["clipped"], k["samples"]) == (total_want, total_n)
        assert k["last_step_fraction"] == (None if n == 0 else pytest.approx(want / n))
    assert eng.steps == 3


def test_report_contents_and_epsilons():
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fastdp import PrivacyEngine

        eng = PrivacyEngine(model, batch_size=4, sample_size=40, epochs=1, target_epsilon=4.0, max_grad_norm=0.5,
                            clipping_style="layer-wise")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng.attach(opt)
    r0 = eng.privacy_report()
    assert r0["steps"] == 0 and all(e["value"] == 0.0 for e in r0["epsilon"].values())
    for s in range(3):
        x, y = _batch(4, seed=s)
        mse_per_sample(model(x), y).mean().backward()
        opt.step()
        opt.zero_grad()
    eng.record_release(Gaussian(30.0), label="eval")
    r = eng.privacy_report()
    delta = eng.target_delta
    assert r["steps"] == 3 and r["planned_steps"] == 10 and r["noiseless_steps"] == 0 and r["other_releases"] == 1
    assert r["sample_rate"] == pytest.approx(0.1) and r["noise_multiplier"] == eng.noise_multiplier
    assert r["sigma_history"] == [(eng.noise_multiplier, 0.1, 3)] and r["target_epsilon"] == 4.0
    led = eng.accountant.ledger
    assert r["epsilon"]["prv"]["value"] == pytest.approx(PRVAccountant().epsilon_of(led, delta), rel=1e-9)
    assert r["epsilon"]["rdp"]["value"] == pytest.approx(RDPAccountant().epsilon_of(led, delta), rel=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert r["epsilon"]["gdp"]["value"] == pytest.approx(GDPAccountant().epsilon_of(led, delta), rel=1e-12)
    assert r["epsilon"]["prv"]["value"] == pytest.approx(eng.get_privacy_spent()["epsilon"], rel=1e-12)
    assert "APPROXIMATION" in r["epsilon"]["gdp"]["kind"] and "upper bound" in r["epsilon"]["prv"]["kind"]
    assert r["epsilon_live"] == pytest.approx(r["epsilon"]["rdp"]["value"], rel=1e-12)
    c = r["clipping"]
    assert c == {"max_grad_norm": 0.5, "clipping_fn": "abadi", "clipping_style": "layer-wise",
                 "clipping_mode": "BK-MixOpt", "groups": 2, "group_threshold": pytest.approx(0.5 / math.sqrt(2)),
                 "loss_reduction": "mean"}
    text = str(r)
    assert "NON-PRIVATE diagnostic" in text and "APPROXIMATION" in text and "3 taken / 10 planned" in text
    assert isinstance(r, dict) and r["clipped"]["samples"] == 12


def test_report_noiseless_steps_is_inf_and_private_hook():
    model = _model()
    eng = make_engine(model, batch_size=4, sigma=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng.attach(opt)
    x, y = _batch(4, seed=0)
    mse_per_sample(model(x), y).mean().backward()
    opt.step()
    r = eng.privacy_report()
    assert r["noiseless_steps"] == 1 and all(math.isinf(e["value"]) for e in r["epsilon"].values())
    assert math.isinf(r["epsilon_live"]) and "inf" in str(r)
    counter = eng.clip_counter
    counter.set_private_source(lambda: {"fraction": 0.25, "mechanism": "noisy count (test)"})
    k = eng.privacy_report()["clipped"]
    assert k == {"fraction": 0.25, "last_step_fraction": None, "samples": None, "clipped": None, "private": True,
                 "source": "noisy count (test)"}
    assert "NON-PRIVATE" not in str(eng.privacy_report()) and "[private" in str(eng.privacy_report())
    counter.set_private_source(lambda: None)  # no noisy value yet: the raw diagnostic again
    assert eng.privacy_report()["clipped"]["private"] is False
    with pytest.raises(ValueError, match="callable"):
        counter.set_private_source(0.25)  # type: ignore[arg-type]
