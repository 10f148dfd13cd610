"""Parameters frozen / unfrozen between steps (two-phase training) with ``engine.update_trainable()``.

Contract tested (one engine, one optimizer, one accountant across both phases):

* after ``optimizer.step()``, the user changes ``requires_grad`` and calls ``engine.update_trainable()``; the next
  step's released gradient equals the oracle's for the NEW trainable set, with the clipping groups (and so the
  per-group thresholds R / sqrt(K)) recomputed for that set;
* parameters frozen in phase 2 stay in the optimizer, get ``.grad is None`` at the step (even without
  ``zero_grad()``: a stale phase-1 gradient must not be applied again) and do not change;
* newly unfrozen parameters are added to the optimizer with ``add_param_group``;
* freezing or unfreezing WITHOUT ``update_trainable()`` raises RuntimeError mentioning ``update_trainable`` at the
  next forward call (or, if the change came after it, at the next ``optimizer.step()``), and nothing is updated;
  following the error's advice (call ``update_trainable()``, redo the step) then works and releases nothing computed
  before the change;
* ``update_trainable()`` in the middle of an accumulation (after backward, before step) raises RuntimeError.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from model_oracle import D, check_discriminates, cls_loss, oracle_for, synced_copy
from oracle import (
    assert_grads_close,
    clipped_sum,
    engine_step,
    group_norms,
    make_engine,
    max_clip_factor,
    released_grads,
    trainable_names,
)
from torch import nn

V, T, DM, C = 23, 6, 12, 5
LR = 1e-3


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, DM)
        self.fc = nn.Linear(DM, 20)
        self.ln = nn.LayerNorm(20)
        self.fc2 = nn.Linear(20, DM)
        self.head = nn.Linear(DM, C)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.fc2(torch.tanh(self.ln(self.fc(h))))
        return self.head(h.mean(1))


def _small_batches(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randint(0, V, (n, T), generator=g),), torch.randint(0, C, (n,), generator=g)) for n in sizes]


def build(name, seed=0):
    torch.manual_seed(seed)
    if name == "torch":
        return Small().to(D), cls_loss, _small_batches
    pytest.importorskip("transformers")
    from model_oracle import build_hf

    model, batches, loss = build_hf(name, seed=seed)
    return model, loss, batches


def _is_bias(n):
    return n.endswith(".bias")


def _expected(template, model, loss, data, style, fn, R, batch_size, rtol=1e-6):
    """Oracle release for the model's current weights and trainable set (computed on a hook-free copy, see
    synced_copy); asserts that R is not ambiguous for these norms."""
    om, names, groups, psg = oracle_for(synced_copy(template, model), loss, data, style=style)
    v = group_norms(psg, groups) * math.sqrt(len(groups))
    assert ((v / R - 1).abs() > 1e-6).all(), "R too close to a per-sample norm: choose another seed"
    want = clipped_sum(psg, groups, fn, R, batch_size)
    check_discriminates(psg, groups, fn, R, batch_size, want, rtol)
    atol = 1e-10 * max(1.0, max_clip_factor(psg, groups, fn, R))
    return names, groups, want, atol


def _R_for(model, loss, data, style, names):
    """A threshold in the middle of the per-sample norms of the parameter subset ``names`` (phase 2) at the current
    weights: with a small learning rate the phase-2 norms stay close, so some samples are clipped in phase 2 (and
    all in phase 1, whose norms include every parameter)."""
    from oracle import choose_R

    om, _, groups, psg = oracle_for(model, loss, data, style=style, names=names)
    return choose_R(psg, groups, "middle", gap=1e-3)


CASES = [
    # (model, mode, fn, style)
    ("torch", "BK-MixOpt", "abadi", "layer-wise"),
    ("torch", "ghost", "automatic", "all-layer"),
    ("bert", "BK-MixOpt", "abadi", "layer-wise"),
    ("gpt2", "instantiate", "automatic", "layer-wise"),
]


@pytest.mark.parametrize("name,mode,fn,style", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_freeze_all_but_biases_between_steps(name, mode, fn, style):
    model, loss, batches = build(name)
    B = 4
    d1, d2 = batches([3, 1], 60), batches([4], 61)
    bias_names = [n for n in trainable_names(model) if _is_bias(n)]
    R = _R_for(model, loss, d2, style, bias_names)
    names1 = trainable_names(model)
    template = copy.deepcopy(model)
    engine = make_engine(model, batch_size=B, R=R, fn=fn, style=style, mode=mode, reduction="mean")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    engine.attach(opt)

    # phase 1: everything trains
    _, groups1, want1, atol1 = _expected(template, model, loss, d1, style, fn, R, B)
    engine_step(model, opt, loss, d1, "mean")
    assert_grads_close(released_grads(model, names1), want1, atol=atol1, msg="[phase 1]")

    # phase 2: biases only (no zero_grad: the stale phase-1 .grad of the frozen weights must not be reused)
    for n, p in model.named_parameters():
        p.requires_grad_(_is_bias(n))
    engine.update_trainable()
    assert sorted(engine.trainable_parameters) == sorted(bias_names)
    names2, groups2, want2, atol2 = _expected(template, model, loss, d2, style, fn, R, B)
    assert names2 == bias_names
    if style == "layer-wise":
        assert len(groups2) != len(groups1)  # the thresholds R / sqrt(K) change with the trainable set
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    bias_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    engine_step(model, opt, loss, d2, "mean")
    got2 = released_grads(model, names2)
    assert_grads_close(got2, want2, atol=atol2, msg="[phase 2]")
    params = dict(model.named_parameters())
    for n, before in frozen_before.items():
        assert params[n].grad is None, f"frozen {n}: .grad is not None after the phase-2 step"
        assert torch.equal(params[n].detach(), before), f"frozen {n} changed in phase 2"
    for n in names2:  # plain SGD: p <- p - lr * released grad
        torch.testing.assert_close(params[n].detach(), bias_before[n] - LR * got2[n], rtol=0, atol=1e-15)
    assert engine.steps == 2


@pytest.mark.parametrize("name,mode", [("torch", "BK-ghost"), ("bert", "ghost"), ("gpt2", "BK-MixOpt")])
def test_unfreeze_between_steps(name, mode):
    """Phase 1 trains the biases only (DP-BiTFiT), phase 2 everything; the new parameters join the optimizer
    through add_param_group."""
    model, loss, batches = build(name, seed=1)
    B = 4
    d1, d2 = batches([4], 62), batches([3, 1], 63)
    for n, p in model.named_parameters():
        p.requires_grad_(_is_bias(n))
    names1 = trainable_names(model)
    R = _R_for(model, loss, d1, "all-layer", names1)
    template = copy.deepcopy(model)
    engine = make_engine(model, batch_size=B, R=R, fn="abadi", style="all-layer", mode=mode, reduction="sum")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    engine.attach(opt)
    _, _, want1, atol1 = _expected(template, model, loss, d1, "all-layer", "abadi", R, B)
    engine_step(model, opt, loss, d1, "sum")
    assert_grads_close(released_grads(model, names1), want1, atol=atol1, msg="[phase 1]")
    opt.zero_grad()

    new = [p for n, p in model.named_parameters() if not _is_bias(n)]
    for p in new:
        p.requires_grad_(True)
    engine.update_trainable()
    opt.add_param_group({"params": new})
    names2, _, want2, atol2 = _expected(template, model, loss, d2, "all-layer", "abadi", R, B)
    assert len(names2) > len(names1)
    engine_step(model, opt, loss, d2, "sum")
    assert_grads_close(released_grads(model, names2), want2, atol=atol2, msg="[phase 2]")


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_unchanged(model, snap):
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), snap[n]), f"{n} changed although the step raised"


@pytest.mark.parametrize("name", ["torch", "bert"])
@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_change_without_update_trainable_raises_at_step(name, change):
    model, loss, batches = build(name, seed=2)
    if change == "unfreeze":
        for n, p in model.named_parameters():
            p.requires_grad_(_is_bias(n))
    engine = make_engine(model, batch_size=4, R=1.0, fn="abadi", mode="BK-MixOpt")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine.attach(opt)
    engine_step(model, opt, loss, batches([4], 64), "mean")
    opt.zero_grad()
    if change == "freeze":
        for n, p in model.named_parameters():
            p.requires_grad_(_is_bias(n))
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    snap = _snapshot(model)
    (x, y), = batches([4], 65)
    with pytest.raises(RuntimeError, match="update_trainable"):  # at the next forward call (also at the step)
        loss(model(*x), y).mean().backward()
    _assert_unchanged(model, snap)
    assert engine.steps == 1


@pytest.mark.parametrize("name", ["torch", "bert"])
def test_recover_after_missing_update_trainable(name):
    """After the error, doing what it says (update_trainable(), then the step again) releases exactly the oracle's
    gradient for the new trainable set: nothing accumulated before the change leaks into the release."""
    model, loss, batches = build(name, seed=3)
    B = 4
    d1, d_lost, d2 = batches([4], 66), batches([4], 67), batches([3, 1], 68)
    bias_names = [n for n in trainable_names(model) if _is_bias(n)]
    R = _R_for(model, loss, d2, "all-layer", bias_names)
    template = copy.deepcopy(model)
    engine = make_engine(model, batch_size=B, R=R, fn="automatic", mode="BK-MixOpt", reduction="mean")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    engine.attach(opt)
    engine_step(model, opt, loss, d1, "mean")
    opt.zero_grad()
    for n, p in model.named_parameters():
        p.requires_grad_(_is_bias(n))
    with pytest.raises(RuntimeError, match="update_trainable"):
        engine_step(model, opt, loss, d_lost, "mean")
    opt.zero_grad()
    engine.update_trainable()
    names2, _, want2, atol2 = _expected(template, model, loss, d2, "all-layer", "automatic", R, B)
    engine_step(model, opt, loss, d2, "mean")
    assert_grads_close(released_grads(model, names2), want2, atol=atol2, msg="[after recovery]")
    assert all(p.grad is None for n, p in model.named_parameters() if n not in names2)


def test_update_trainable_in_the_middle_of_accumulation_is_refused():
    model, loss, batches = build("torch", seed=4)
    engine = make_engine(model, batch_size=4, R=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    (x, y), = batches([3], 69)
    loss(model(*x), y).mean().backward()
    with pytest.raises(RuntimeError):
        engine.update_trainable()


def test_update_trainable_without_change_is_harmless():
    model, loss, batches = build("torch", seed=5)
    d = batches([3, 1], 70)
    template = copy.deepcopy(model)
    _, _, want, atol = _expected(template, model, loss, d, "layer-wise", "automatic", 0.5, 4)
    engine = make_engine(model, batch_size=4, R=0.5, fn="automatic", style="layer-wise", mode="BK-MixOpt")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine.attach(opt)
    engine.update_trainable()
    engine_step(model, opt, loss, d, "mean")
    assert_grads_close(released_grads(model, trainable_names(model)), want, atol=atol)


def test_freeze_before_the_first_forward_names_the_change_not_the_probe():
    """A parameter frozen after attach, before the first forward (the structure probe's first run): the forward
    raises the trainable-set error naming the parameter and update_trainable(), not a StructureError; after
    update_trainable() training goes on."""
    import fastdp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    engine = fastdp.PrivacyEngine(model, batch_size=4, sample_size=40, noise_multiplier=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    model[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"frozen: \['0.weight'\].*update_trainable") as err:
        model(torch.randn(4, 4)).sum().backward()
    assert not isinstance(err.value, fastdp.StructureError)
    engine.update_trainable()
    model(torch.randn(4, 4)).sum().backward()
    opt.step()
    assert engine.steps == 1 and model[0].weight.grad is None
