"""Per-layer exactness: engine released gradient (sigma=0) vs the brute-force oracle.

Grid: every supported layer type x every clipping mode x every clipping function (default run), with
the clipping style, loss reduction, gradient accumulation, expected batch size and threshold drawn by
hypothesis. The exhaustive style x reduction grid is marked slow.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st
from oracle import (
    FNS,
    LAYER_KINDS,
    MODES,
    STYLES,
    assert_grads_close,
    build_case,
    choose_R,
    clipped_sum,
    explicit_groups,
    make_groups,
    max_clip_factor,
    oracle_model,
    per_sample_grads,
    run_engine_once,
    trainable_names,
    well_conditioned,
)

SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


def check_case(kind, mode, fn, data, *, style=None, reduction=None, dtype=torch.float64, readout=None, max_passes=3):
    torch.manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    case = build_case(kind, data.draw, dtype=dtype, readout=readout)
    names = trainable_names(case.model)
    if style is None:
        style = data.draw(st.sampled_from(STYLES), label="style")
    if style == "explicit":
        style = explicit_groups(names, data.draw)
    if reduction is None:
        reduction = data.draw(st.sampled_from(["mean", "sum"]), label="reduction")
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=max_passes), label="physical sizes")
    batch_size = data.draw(st.integers(1, 12), label="batch_size")
    where = data.draw(st.sampled_from(["middle", "middle", "above", "below"]), label="R position")
    batches = [case.batch(n, dtype) for n in sizes]

    om = oracle_model(case.model)
    groups = make_groups(om, style, names)
    psg = per_sample_grads(om, case.per_sample_loss, batches, names)
    # skip numerically degenerate draws (rounding-dominated gradients); float32 engines need a wider margin
    if dtype == torch.float64:
        assume(well_conditioned(om, case.per_sample_loss, batches, names, psg))
    else:
        assume(well_conditioned(om, case.per_sample_loss, batches, names, psg, rel=1e-7, tol=1e-5))
    R = choose_R(psg, groups, where, gap=1e-6 if dtype == torch.float64 else 1e-3)
    want = clipped_sum(psg, groups, fn, R, batch_size)
    cmax = max(1.0, max_clip_factor(psg, groups, fn, R))
    note(
        f"model={case.model}\nstyle={style} groups={groups} reduction={reduction} sizes={sizes} "
        f"batch_size={batch_size} R={R}"
    )

    _, _, got = run_engine_once(
        case.model,
        case.per_sample_loss,
        batches,
        batch_size=batch_size,
        R=R,
        fn=fn,
        style=style,
        mode=mode,
        reduction=reduction,
    )
    for n in names:
        assert got[n].dtype == dtype, (n, got[n].dtype)
    if dtype == torch.float64:
        assert_grads_close(got, want, rtol=1e-6, atol=1e-10 * cmax, msg=f"[{kind} {mode} {fn}]")
    else:
        assert_grads_close(got, want, rtol=1e-4, atol=1e-5 * cmax, msg=f"[{kind} {mode} {fn} fp32]")


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", LAYER_KINDS)
@settings(max_examples=5, **SETTINGS)
@given(data=st.data())
def test_layer_mode_fn(kind, mode, fn, data):
    check_case(kind, mode, fn, data)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "kind", ["linear3d", "conv2d", "conv1d", "embedding", "layernorm", "groupnorm", "instancenorm2d", "rmsnorm"]
)
@settings(max_examples=4, **SETTINGS)
@given(data=st.data())
def test_layer_float32(kind, mode, data):
    fn = data.draw(st.sampled_from(FNS), label="fn")
    check_case(kind, mode, fn, data, dtype=torch.float32)


@pytest.mark.parametrize("style", ["all-layer", "layer-wise", "param-wise", "explicit"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["linear3d", "conv2d", "embedding", "groupnorm"])
@settings(max_examples=4, **SETTINGS)
@given(data=st.data())
def test_style_reduction_default(kind, reduction, style, data):
    mode = data.draw(st.sampled_from(MODES), label="mode")
    fn = data.draw(st.sampled_from(FNS), label="fn")
    check_case(kind, mode, fn, data, style=style, reduction=reduction, readout=True)


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", LAYER_KINDS)
@settings(max_examples=6, **SETTINGS)
@given(data=st.data())
def test_layer_full_grid_slow(kind, mode, fn, style, reduction, data):
    check_case(kind, mode, fn, data, style=style, reduction=reduction)


@pytest.mark.slow
@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", LAYER_KINDS)
@settings(max_examples=8, **SETTINGS)
@given(data=st.data())
def test_layer_float32_slow(kind, mode, fn, data):
    check_case(kind, mode, fn, data, dtype=torch.float32)
