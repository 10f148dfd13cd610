"""Random model fuzzing: random chains of supported layers (with transposes, activations and module reuse)
on (B, C, L) activations, random clipping mode / function / style / reduction / accumulation, engine vs
the brute-force oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st
from oracle import (
    FNS,
    MODES,
    STYLES,
    assert_grads_close,
    choose_R,
    clipped_sum,
    explicit_groups,
    make_groups,
    max_clip_factor,
    mse_per_sample,
    oracle_model,
    per_sample_grads,
    run_engine_once,
    trainable_names,
    well_conditioned,
)
from torch import nn

from fastdp.layers import _grams

D = torch.float64
SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


class Transpose(nn.Module):
    def forward(self, x):
        return x.transpose(1, 2)


class Chain(nn.Module):
    """Applies ``self.order`` (indices into ``self.mods``; an index may repeat = shared module)."""

    def __init__(self, mods, order, embed):
        super().__init__()
        self.mods = nn.ModuleList(mods)
        self.order = list(order)
        self.embed = embed

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for i in self.order:
            x = self.mods[i](x)
        return x


def draw_chain(draw):
    C, L = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    use_emb = draw(st.booleans())
    embed = None
    if use_emb:
        V = draw(st.integers(2, 6))
        embed = nn.Embedding(V, L, padding_idx=draw(st.one_of(st.none(), st.integers(0, V - 1))))

        def make_x(n, C=C, V=V):
            return torch.randint(0, V, (n, C))
    else:

        def make_x(n, C=C, L=L):
            return torch.randn(n, C, L, dtype=D)

    mods, order = [], []
    n_ops = draw(st.integers(1, 5))
    for _ in range(n_ops):
        # reuse a shape-preserving module already in the chain?
        reusable = [i for i, (m, cl) in enumerate(mods) if cl == (C, L)]
        if reusable and draw(st.integers(0, 3)) == 0:
            order.append(draw(st.sampled_from(reusable)))
            order.append(len(mods))
            mods.append((nn.Tanh(), None))
            continue
        op = draw(
            st.sampled_from(
                [
                    "linear",
                    "conv1d",
                    "layernorm",
                    "layernorm2",
                    "rmsnorm",
                    "groupnorm",
                    "instancenorm",
                    "act",
                    "transpose",
                ]
            )
        )
        preserve = False
        if op == "linear":
            L2 = draw(st.integers(1, 6))
            m = nn.Linear(L, L2, bias=draw(st.booleans()))
            preserve, L = L2 == L, L2
        elif op == "conv1d":
            g = draw(st.sampled_from([d for d in range(1, C + 1) if C % d == 0]))
            C2 = g * draw(st.integers(1, 2))
            k = draw(st.integers(1, 3))
            pad = draw(st.sampled_from(["same", 0, 1]))
            pm = draw(st.sampled_from(["zeros", "replicate", "circular"]))
            if pad == 0 and L < k:
                pad = "same"
            if pm == "circular" and pad == "same" and L < k // 2 + 1:
                pm = "zeros"
            m = nn.Conv1d(C, C2, k, padding=pad, groups=g, padding_mode=pm, bias=draw(st.booleans()))
            with torch.no_grad():
                L2 = m(torch.zeros(1, C, L)).shape[-1]
            preserve, C, L = (C2, L2) == (C, L), C2, L2
        elif op == "layernorm":
            # (a single normalized element gives x_hat = rounding noise: excluded, ill-conditioned downstream; over
            # two, x_hat = +-1 up to eps and the input gradient is cancellation noise, exactly 0 at eps = 0, so the
            # gradients of everything upstream are float64 rounding: excluded too, like every mean-and-variance
            # norm below over fewer than 3 values)
            m, preserve = (nn.LayerNorm(L) if L >= 3 else nn.GELU()), True
        elif op == "layernorm2":
            m, preserve = (nn.LayerNorm((C, L), bias=draw(st.booleans())) if C * L >= 3 else nn.GELU()), True
        elif op == "rmsnorm":
            # RMSNorm over one element is sign(x)*w: its input gradient is pure cancellation noise (excluded)
            m, preserve = (nn.RMSNorm(L) if L >= 2 else nn.GELU()), True
        elif op == "groupnorm":
            G = draw(st.sampled_from([d for d in range(1, C + 1) if C % d == 0]))
            m = nn.GroupNorm(G, C) if (C // G) * L >= 3 else nn.GELU()  # (torch needs > 1 value per group)
            preserve = True
        elif op == "instancenorm":
            if L < 3:
                m = nn.GELU()
            else:
                m = nn.InstanceNorm1d(C, affine=True)
            preserve = True
        elif op == "act":
            m = draw(st.sampled_from([nn.Tanh, nn.GELU, nn.SiLU, nn.Softplus]))()
        else:
            m = Transpose()
            C, L = L, C
        with torch.no_grad():
            for p in m.parameters():
                if p.dim() == 1 and not isinstance(m, (nn.Linear, nn.Conv1d)):
                    p.normal_()
        order.append(len(mods))
        mods.append((m, (C, L) if preserve and any(True for _ in m.parameters()) else None))
    model = Chain([m for m, _ in mods], order, embed).to(D)
    return model, make_x, (C, L)


def fuzz_once(data, mode=None, fn=None):
    torch.manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    model, make_x, out_tail = draw_chain(data.draw)
    names = trainable_names(model)
    if not names:
        return
    mode = mode or data.draw(st.sampled_from(MODES), label="mode")
    fn = fn or data.draw(st.sampled_from(FNS), label="fn")
    style = data.draw(st.sampled_from(STYLES), label="style")
    shared = len(set(model.order)) < len(model.order)
    if style == "explicit":
        style = explicit_groups(names, data.draw)
    reduction = data.draw(st.sampled_from(["mean", "sum"]), label="reduction")
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3), label="sizes")
    batch_size = data.draw(st.integers(1, 10), label="batch_size")
    batches = [(make_x(n), torch.randn(n, *out_tail, dtype=D)) for n in sizes]
    om = oracle_model(model)
    groups = make_groups(om, style, names)
    psg = per_sample_grads(om, mse_per_sample, batches, names)
    assume(well_conditioned(om, mse_per_sample, batches, names, psg))
    R = choose_R(psg, groups, data.draw(st.sampled_from(["middle", "above", "below"]), label="where"), gap=1e-6)
    want = clipped_sum(psg, groups, fn, R, batch_size)
    cmax = max(1.0, max_clip_factor(psg, groups, fn, R))
    note(
        f"{model}\norder={model.order} shared={shared} mode={mode} fn={fn} style={style} groups={groups} "
        f"reduction={reduction} sizes={sizes} batch_size={batch_size} R={R}"
    )
    _, _, got = run_engine_once(
        model, mse_per_sample, batches, batch_size=batch_size, R=R, fn=fn, style=style, mode=mode, reduction=reduction
    )
    assert_grads_close(got, want, rtol=1e-6, atol=1e-10 * cmax, msg=f"[fuzz {mode} {fn}]")


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=40, **SETTINGS)
@given(data=st.data())
def test_fuzz_random_chains(mode, data):
    fuzz_once(data, mode=mode)


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=20, **SETTINGS)
@given(data=st.data())
def test_fuzz_random_chains_with_gram_strips(mode, data):
    """The same chains with the ghost norms' Gram matrices cut into strips of 1 to 3 rows (the chains' positions
    are few, so the default rule would keep them whole): every ghost norm goes through ``strips_inner``."""
    rows = data.draw(st.integers(1, 3), label="strip rows")
    saved = _grams.GRAM_STRIP
    _grams.GRAM_STRIP = {"cpu": (rows, 1 << 30), "default": (rows, 1 << 30)}
    try:
        fuzz_once(data, mode=mode)
    finally:
        _grams.GRAM_STRIP = saved


@pytest.mark.slow
@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=300, **SETTINGS)
@given(data=st.data())
def test_fuzz_random_chains_slow(mode, fn, data):
    fuzz_once(data, mode=mode, fn=fn)
