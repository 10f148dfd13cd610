"""Self-checks of the brute-force oracle (tests/oracle.py) against plain autograd; no engine needed."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import (
    FNS,
    LAYER_KINDS,
    build_case,
    choose_R,
    clip_factors,
    clipped_sum,
    group_norms,
    make_groups,
    oracle_model,
    per_sample_grads,
    plain_gradient,
    trainable_names,
)
from torch import nn

SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("kind", LAYER_KINDS)
@settings(max_examples=4, **SETTINGS)
@given(data=st.data())
def test_oracle_matches_autograd_when_unclipped(kind, data):
    torch.manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    case = build_case(kind, data.draw)
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    batches = [case.batch(n) for n in sizes]
    names = trainable_names(case.model)
    om = oracle_model(case.model)
    psg = per_sample_grads(om, case.per_sample_loss, batches, names)
    assert all(psg[n].shape[0] == sum(sizes) for n in names)
    for reduction in ("mean", "sum"):
        plain = plain_gradient(case.model, case.per_sample_loss, batches, reduction)
        if reduction == "sum":
            want = clipped_sum(psg, [names], "abadi", 1e9, 1)
        else:
            # mean over each physical batch == per-sample grads weighted by 1/B_phys
            want = {}
            off = 0
            for n in names:
                want[n] = torch.zeros_like(psg[n][0])
            for b in sizes:
                part = {n: psg[n][off : off + b] for n in names}
                s = clipped_sum(part, [names], "abadi", 1e9, b)
                for n in names:
                    want[n] += s[n]
                off += b
        for n in names:
            torch.testing.assert_close(want[n], plain[n], rtol=1e-9, atol=1e-12)


def test_clip_factor_formulas():
    norms = torch.tensor([[0.0, 0.5, 1.0, 2.0, 4.0]], dtype=torch.float64).T
    r = 1.0
    ab = clip_factors(norms, "abadi", r).flatten()
    assert ab[0] == 1 and ab[1] == 1
    assert math.isclose(float(ab[3]), 1 / (2 + 1e-6))
    au = clip_factors(norms, "automatic", r).flatten()
    assert math.isclose(float(au[3]), 1 / 2.01)
    gl = clip_factors(norms, "global", r).flatten()
    assert gl.tolist() == [1, 1, 1, 0, 0]


def test_groups_and_R_per_group():
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2, bias=False), nn.LayerNorm(2)).double()
    names = trainable_names(m)
    assert make_groups(m, "all-layer") == [names]
    assert make_groups(m, "layer-wise") == [["0.weight", "0.bias"], ["2.weight"], ["3.weight", "3.bias"]]
    assert make_groups(m, "param-wise") == [[n] for n in names]
    # R_k = R / sqrt(K): a sample whose every group has norm exactly R/sqrt(K)/2 is not clipped by abadi
    psg = {n: torch.zeros((1, *p.shape), dtype=torch.float64) for n, p in m.named_parameters()}
    groups = make_groups(m, "layer-wise")
    for g in groups:
        psg[g[0]].view(-1)[0] = 1.0 / math.sqrt(3) / 2
    res = clipped_sum(psg, groups, "abadi", 1.0, 1)
    for g in groups:
        assert math.isclose(float(res[g[0]].view(-1)[0]), 1 / math.sqrt(3) / 2)
    n = group_norms(psg, groups)
    assert torch.allclose(n, torch.full((1, 3), 1 / math.sqrt(3) / 2, dtype=torch.float64))
    # global: each group norm 1/sqrt(3)*1.5 > R_k -> zeroed
    for g in groups:
        psg[g[0]].view(-1)[0] = 1.5 / math.sqrt(3)
    res = clipped_sum(psg, groups, "global", 1.0, 1)
    assert all(float(v.abs().sum()) == 0 for v in res.values())


def test_choose_R_separates():
    torch.manual_seed(0)
    m = nn.Linear(3, 2).double()
    psg = {"weight": torch.randn(6, 2, 3, dtype=torch.float64), "bias": torch.randn(6, 2, dtype=torch.float64)}
    for style_groups in ([["weight", "bias"]], [["weight"], ["bias"]]):
        for where in ("middle", "above", "below"):
            R = choose_R(psg, style_groups, where)
            v = group_norms(psg, style_groups) * math.sqrt(len(style_groups))
            assert (((v / R) - 1).abs() > 1e-3).all()
            for fn in FNS:
                clipped_sum(psg, style_groups, fn, R, 6)
    del m
