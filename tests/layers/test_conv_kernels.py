"""The convolution kind's weight paths (fastdp.layers.kinds.conv.ConvCall) against a batch-of-one oracle, float64.

Per-sample gradients come from one grouped convolution over the batch (``T >= GROUPED_MIN_POSITIONS``) or from
patches unfolded a few samples at a time (:data:`PATCH_CHUNK_BYTES`); the ghost norm from such chunks, or with the
input Gram from the Gram of the padded input's pixels (:data:`PIXEL_GRAMS`); the clipped sum from torch's
weight-gradient kernel on per-sample scaled operands or from chunks (:data:`CLIPPED_SUM`). Each path is forced here
(the constants patched) on convolutions of every shape feature -- 1d/2d/3d, stride, dilation, groups, padding modes,
an uneven ``"same"`` -- at batch sizes 1, 3 and 5 (chunks of 1, 2 and all samples) and 0, and in the engine, every
clipping mode against the oracle of tests/oracle.py.
"""

from __future__ import annotations

import pytest
import torch
from oracle import (
    FNS,
    MODES,
    assert_grads_close,
    choose_R,
    clipped_sum,
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

from fastdp.layers.kinds import conv as convmod
from fastdp.layers.kinds.conv import ConvCall, ConvKind

CONVS = {
    "1d k3 pad1": (lambda: nn.Conv1d(3, 4, 3, padding=1), (3, 7)),
    "2d stride 2 dilation 2 reflect": (lambda: nn.Conv2d(2, 4, (2, 3), stride=(2, 1), dilation=(1, 2), padding=1,
                                                         padding_mode="reflect"), (2, 6, 7)),
    "2d groups 2 same even kernel": (lambda: nn.Conv2d(4, 6, (2, 3), padding="same", groups=2), (4, 5, 4)),
    "2d per-dim padding": (lambda: nn.Conv2d(3, 2, 3, padding=(1, 2), bias=False), (3, 4, 5)),
    "3d circular": (lambda: nn.Conv3d(2, 2, 2, padding=1, padding_mode="circular"), (2, 3, 2, 3)),
    "2d depthwise stride 2": (lambda: nn.Conv2d(3, 3, 3, stride=2, padding=1, groups=3), (3, 7, 7)),
}


def _oracle(conv: nn.Module, x: torch.Tensor, go: torch.Tensor) -> torch.Tensor:
    """Per-sample weight gradients, one backward pass per sample."""
    rows = []
    for i in range(x.shape[0]):
        w = conv.weight.detach().clone().requires_grad_(True)
        out = torch.func.functional_call(conv, {"weight": w, "bias": conv.bias}, (x[i:i + 1],))
        rows.append(torch.autograd.grad(out, w, go[i:i + 1])[0])
    return torch.stack(rows) if rows else x.new_zeros(0, *conv.weight.shape)


def _call(name: str, B: int) -> tuple[nn.Module, ConvCall, torch.Tensor]:
    make, shape = CONVS[name]
    torch.manual_seed(B)
    conv = make().double()
    x = torch.randn(B, *shape, dtype=torch.float64)
    with torch.no_grad():
        go = torch.randn_like(conv(x))
    call = ConvKind().prepare(conv, x, go)
    assert isinstance(call, ConvCall)
    return conv, call, _oracle(conv, x, go)


@pytest.mark.parametrize("B", [1, 3, 5, 0])
@pytest.mark.parametrize("name", list(CONVS))
@pytest.mark.parametrize("per_chunk", [1, 2, None])
def test_every_weight_path_matches_the_batch_of_one_oracle(name, B, per_chunk, monkeypatch):
    conv, call, want = _call(name, B)
    per_sample_bytes = conv.groups * call.T * call.d * 8
    budget = 2 ** 40 if per_chunk is None else per_chunk * per_sample_bytes
    monkeypatch.setitem(convmod.PATCH_CHUNK_BYTES, "cpu", budget)
    chunks = call.chunks()
    assert chunks[0][0] == 0 and chunks[-1][1] == B
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
    if per_chunk is not None and B > per_chunk:
        assert len(chunks) == -(-B // per_chunk) and all(hi - lo <= per_chunk for lo, hi in chunks)
    kind = ConvKind()
    coef = torch.rand(B, dtype=torch.float64) + 0.5
    for grouped_from, how in ((0, "grouped"), (0, "patches"), (0, "measure"), (10 ** 9, "grouped")):
        # from 0 positions: the grouped kernel, patches, the faster of both; below the threshold: patches
        monkeypatch.setattr(convmod, "GROUPED_MIN_POSITIONS", grouped_from)
        monkeypatch.setattr(convmod, "PER_SAMPLE_GRADS", how)
        monkeypatch.setattr(convmod, "_per_sample_choice", {})
        psg = kind.per_sample_grad(conv, call, "weight")
        assert psg.shape == want.shape
        torch.testing.assert_close(psg, want, rtol=1e-10, atol=1e-12)
    for pixels in (True, False):  # the input Gram from the pixels' Gram (forced where it would not pay), patches
        monkeypatch.setattr(convmod, "PIXEL_GRAMS", pixels)
        monkeypatch.setattr(ConvCall, "pixel_gram_pays", lambda self: True)
        if pixels and B:
            for lo, hi in chunks:
                torch.testing.assert_close(call.input_gram(lo, hi), torch.matmul(
                    call.patches(lo, hi), call.patches(lo, hi).transpose(-1, -2)), rtol=1e-10, atol=1e-12)
        norms = kind.ghost_norm_sq(conv, call, "weight")
        torch.testing.assert_close(norms, want.flatten(1).square().sum(1), rtol=1e-10, atol=1e-12)
    for how in ("kernel", "patches", "measure"):  # torch's weight-gradient kernel on scaled operands, patches
        monkeypatch.setattr(convmod, "CLIPPED_SUM", how)
        monkeypatch.setattr(convmod, "_sum_choice", {})
        for scale_input in (True, False):  # the smaller operand is scaled: force each
            if how != "patches":
                monkeypatch.setattr(ConvCall, "_scale_input", lambda self, x, go, s=scale_input: s)
            total = kind.clipped_sum(conv, call, "weight", coef)
            assert total.shape == want.shape[1:]
            torch.testing.assert_close(total, torch.einsum("b,b...->...", coef, want), rtol=1e-10, atol=1e-12)
    factors = kind.factors(conv, call, "weight")  # a shared weight's cross terms: the whole batch's patches
    torch.testing.assert_close(torch.einsum("bgtp,bgtd->bgpd", factors.left, factors.right).reshape(want.shape),
                               want, rtol=1e-10, atol=1e-12)


def test_a_sample_larger_than_the_budget_is_its_own_chunk(monkeypatch):
    _, call, _ = _call("2d groups 2 same even kernel", 3)
    monkeypatch.setitem(convmod.PATCH_CHUNK_BYTES, "cpu", 1)
    assert call.chunks() == [(0, 1), (1, 2), (2, 3)]
    monkeypatch.setitem(convmod.PATCH_CHUNK_BYTES, "cpu", 2 ** 40)
    assert call.chunks() == [(0, 3)]


def test_half_precision_input_is_handled_in_float32():
    """A float16 call is prepared in float32 (the accumulation dtype): every path returns float32."""
    conv = nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(4, 2, 9, 9)
    go = torch.randn(4, 3, 9, 9)
    call = ConvKind().prepare(conv, x.half(), go.half())
    assert call.x.dtype == torch.float32 and call.grad_output.dtype == torch.float32
    want = _oracle(conv, x.half().float(), go.half().float())
    kind = ConvKind()
    torch.testing.assert_close(kind.per_sample_grad(conv, call, "weight"), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kind.clipped_sum(conv, call, "weight", torch.ones(4)), want.sum(0),
                               rtol=1e-5, atol=1e-5)


class _SmallCNN(nn.Module):
    """Convolutions with T above and below the grouped kernel's threshold (set to 9 in the test), a strided one,
    a grouped one, GroupNorm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.c2 = nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=2)
        self.head = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.gn(self.c1(x)))
        return self.head(torch.tanh(self.c2(h)).flatten(1))


@pytest.mark.parametrize("mode", MODES)
def test_engine_with_forced_chunks_and_grouped_kernel_matches_the_oracle(mode, monkeypatch):
    """c1 has T = 36 positions, c2 has 9: with the threshold at 10, c1's per-sample gradients come from the grouped
    kernel and c2's from one-sample chunks of patches; batches of 1, 0 and 3 samples, every clipping mode."""
    monkeypatch.setattr(convmod, "GROUPED_MIN_POSITIONS", 10)
    monkeypatch.setattr(convmod, "PER_SAMPLE_GRADS", "grouped")
    monkeypatch.setitem(convmod.PATCH_CHUNK_BYTES, "cpu", 1)
    i = MODES.index(mode)
    fn = FNS[i % len(FNS)]
    torch.manual_seed(7 + i)
    model = _SmallCNN().double()
    names = trainable_names(model)
    batches = []
    for n in (1, 0, 3):
        x = torch.randn(n, 2, 6, 6, dtype=torch.float64)
        with torch.no_grad():
            out = model(x)
        batches.append((x, torch.randn(out.shape, dtype=torch.float64)))
    om = oracle_model(model)
    psg = per_sample_grads(om, mse_per_sample, batches, names)
    assert well_conditioned(om, mse_per_sample, batches, names, psg)
    groups = make_groups(om, "all-layer", names)
    R = choose_R(psg, groups, "middle", gap=1e-6)
    want = clipped_sum(psg, groups, fn, R, 4)
    _, _, got = run_engine_once(model, mse_per_sample, batches, batch_size=4, R=R, fn=fn, style="all-layer",
                                mode=mode, reduction="sum")
    cmax = max(1.0, max_clip_factor(psg, groups, fn, R))
    assert_grads_close(got, want, rtol=1e-6, atol=1e-10 * cmax, msg=f"[{mode} {fn}]")


@pytest.mark.parametrize("name", list(CONVS))
def test_ghost_norm_inside_a_shared_gram_pass(name, monkeypatch):
    """Chunks' patches are fresh tensors that the allocator may place at the same address: the ghost norm must not
    take one chunk's input Gram from the cache of :func:`fastdp.layers._grams.shared_input_grams` for the next."""
    from fastdp.layers._grams import shared_input_grams

    conv, call, want = _call(name, 5)
    monkeypatch.setitem(convmod.PATCH_CHUNK_BYTES, "cpu", 1)
    with shared_input_grams():
        norms = ConvKind().ghost_norm_sq(conv, call, "weight")
    torch.testing.assert_close(norms, want.flatten(1).square().sum(1), rtol=1e-10, atol=1e-12)


def test_the_measured_per_sample_method_is_chosen_once_per_shape(monkeypatch):
    """``PER_SAMPLE_GRADS = "measure"``: from ``GROUPED_MIN_POSITIONS`` positions on, both forms are timed once per
    call shape on CPU and the choice kept; below it, patches (nothing timed); under
    ``torch.use_deterministic_algorithms`` and for an empty batch, the grouped kernel untimed; once
    ``SUM_CHOICE_MAX`` shapes are stored, new ones take the grouped kernel untimed."""
    monkeypatch.setattr(convmod, "PER_SAMPLE_GRADS", "measure")
    monkeypatch.setattr(convmod, "_per_sample_choice", {})
    monkeypatch.setattr(convmod, "GROUPED_MIN_POSITIONS", 1)
    _, call, want = _call("2d stride 2 dilation 2 reflect", 3)
    timed = []
    for form in ("grouped_weight_grads", "per_sample_grads_by_patches"):
        real = getattr(ConvCall, form)
        monkeypatch.setattr(ConvCall, form, lambda self, real=real, form=form: timed.append(form) or real(self))
    first = call.per_sample_method()
    assert first in ("grouped", "patches") and len(timed) == 4 and len(convmod._per_sample_choice) == 1
    assert sorted(set(timed)) == ["grouped_weight_grads", "per_sample_grads_by_patches"]
    assert call.per_sample_method() == first and len(timed) == 4  # kept, not timed again
    torch.testing.assert_close(ConvKind().per_sample_grad(call.module, call, "weight"), want, rtol=1e-10, atol=1e-12)
    monkeypatch.setattr(convmod, "_per_sample_choice", {})
    torch.use_deterministic_algorithms(True)
    try:
        assert call.per_sample_method() == "grouped" and not convmod._per_sample_choice
    finally:
        torch.use_deterministic_algorithms(False)
    _, empty, _ = _call("2d stride 2 dilation 2 reflect", 0)
    assert empty.per_sample_method() == "grouped"
    monkeypatch.setattr(convmod, "GROUPED_MIN_POSITIONS", 10 ** 9)
    assert call.per_sample_method() == "patches" and not convmod._per_sample_choice
    monkeypatch.setattr(convmod, "GROUPED_MIN_POSITIONS", 1)
    monkeypatch.setattr(convmod, "SUM_CHOICE_MAX", 0)  # full: grouped, nothing timed or stored
    n = len(timed)
    assert call.per_sample_method() == "grouped" and len(timed) == n and not convmod._per_sample_choice


def test_the_measured_clipped_sum_is_chosen_once_per_shape(monkeypatch):
    """``CLIPPED_SUM = "measure"``: on CPU both forms are timed once per call shape and the choice is kept (later
    calls of that shape are not timed again); under ``torch.use_deterministic_algorithms`` nothing is timed (the
    kernel), an empty batch takes the patches (no kernel call on zero samples), and once ``SUM_CHOICE_MAX`` shapes
    are stored new ones take the kernel untimed."""
    monkeypatch.setattr(convmod, "CLIPPED_SUM", "measure")
    monkeypatch.setattr(convmod, "_sum_choice", {})
    _, call, want = _call("2d stride 2 dilation 2 reflect", 3)
    timed = []
    for form in ("clipped_sum_by_kernel", "clipped_sum_by_patches"):
        real = getattr(ConvCall, form)
        monkeypatch.setattr(ConvCall, form, lambda self, coef, real=real, form=form: timed.append(form) or
                            real(self, coef))
    first = call.sum_method()
    assert first in ("kernel", "patches") and len(timed) == 4 and len(convmod._sum_choice) == 1
    assert call.sum_method() == first and len(timed) == 4  # kept, not timed again
    monkeypatch.setattr(convmod, "_sum_choice", {})
    torch.use_deterministic_algorithms(True)
    try:
        assert call.sum_method() == "kernel" and len(timed) == 4 and not convmod._sum_choice
    finally:
        torch.use_deterministic_algorithms(False)
    _, empty, _ = _call("2d stride 2 dilation 2 reflect", 0)
    assert empty.sum_method() == "patches"
    monkeypatch.setattr(convmod, "SUM_CHOICE_MAX", 0)  # full: the kernel, nothing timed or stored
    assert call.sum_method() == "kernel" and len(timed) == 4 and not convmod._sum_choice
