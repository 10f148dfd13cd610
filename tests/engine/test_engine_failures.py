"""Failures leave nothing behind; passes for other optimizers are never folded into a private step.

Every failure is injected at one stage of a forward or backward pass; afterwards the engine must be clean (no
records, no sums, no queued callback, ``requires_grad`` restored, no step or accountant entry) and a retry on a
smaller batch must release exactly the brute-force oracle's result for the retried batch alone.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from oracle import assert_grads_close, make_engine, mse_per_sample, oracle_release, trainable_names
from torch import nn

import fastdp.capture as capture_mod
from fastdp import NonFiniteGradientError, PrivacyEngine
from fastdp.layers import kind_for

D = torch.float64
B = 6  # expected batch size; failed batches have 5 samples, retries 3


class Injected(RuntimeError):
    pass


class Boom(torch.autograd.Function):
    """Identity whose backward raises ``Boom.armed`` once (e.g. an out-of-memory error in the middle of the model)."""

    armed: BaseException | None = None

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if Boom.armed is not None:
            e, Boom.armed = Boom.armed, None
            raise e
        return g


class Scale(nn.Module):
    """A raw parameter: the generic per-sample path (expansion or replay)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.fail = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h * self.s
        if self.fail:  # raises midway through a hooked module's forward
            self.fail = False
            raise Injected("generic owner forward")
        return h


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.scale, self.l2, self.l3 = nn.Linear(4, 5), Scale(5), nn.Linear(5, 5), nn.Linear(5, 3)
        self.fail_forward = False
        self.user_hook_fails = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        h = Boom.apply(self.scale(h))
        if self.fail_forward:  # the user's code raises after some hooked layers ran
            self.fail_forward = False
            raise Injected("user forward")
        h = torch.tanh(self.l2(h))
        if self.user_hook_fails:
            self.user_hook_fails = False

            def bad(g):
                raise Injected("user tensor hook")

            h.register_hook(bad)
        return self.l3(h)


def data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=D), torch.randn(n, 3, generator=g, dtype=D)


def setup(mode="BK-MixOpt", sigma=0.0, **kw):
    # The injected failures count calls; the structure probe's passes (tests/structure/test_probe.py) would consume
    # them, so it is off here unless a test asks for it (test_failure_inside_the_probe_leaves_the_engine_clean).
    kw.setdefault("verify_structure", False)
    torch.manual_seed(0)
    model = Net().to(D)
    engine = make_engine(model, batch_size=B, R=0.3, mode=mode, sigma=sigma, accountant="rdp", **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the model is unchanged, releases stay comparable
    PRISTINE[id(model)] = copy.deepcopy(model)  # the oracle's copy, taken before attach (no engine hooks)
    engine.attach(opt)
    return model, engine, opt


PRISTINE: dict[int, nn.Module] = {}


def oracle(model, batches):
    """The oracle's release for ``batches`` on the model as it was before attach (lr 0: it is unchanged)."""
    return oracle_release(PRISTINE[id(model)], mse_per_sample, batches, R=0.3, batch_size=B)


def backward(model, x, y):
    mse_per_sample(model(x), y).mean().backward()


def assert_clean(engine: PrivacyEngine, model: nn.Module, acc_state) -> None:
    assert engine._capture.pending == []
    assert engine._release.summed == {}
    assert not engine._capture.callback_queued
    assert not engine._release.backward_seen and engine._release.step_samples == 0
    assert engine._capture.calls == []  # no module call left open (detached parameters, RNG, expansions)
    assert engine._capture.roots == []  # no forward call of the model left open
    assert all(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    assert engine.steps == 0 and engine.accountant.state_dict() == acc_state


def retry_matches_oracle(model, engine, opt, x, y) -> None:
    want = oracle(model, [(x, y)])
    backward(model, x, y)
    opt.step()
    got = {n: p.grad for n, p in model.named_parameters()}
    assert_grads_close(got, want)
    assert engine.steps == 1 and engine._capture.pending == []


def inject_forward_user(model, engine, monkeypatch):
    model.fail_forward = True


def inject_forward_generic(model, engine, monkeypatch):
    model.scale.fail = True


def inject_forward_hook(model, engine, monkeypatch):
    kind = kind_for(model.l2)
    orig = kind.capture
    calls = []

    def capture(module, args):
        if module is model.l2 and not calls:
            calls.append(1)
            raise Injected("forward hook")
        return orig(module, args)

    monkeypatch.setattr(kind, "capture", capture)


def inject_output_grad(model, engine, monkeypatch):
    orig = capture_mod.instantiate_on_arrival
    calls = []

    def on_arrival(rec, mode):
        calls.append(1)
        if len(calls) == 2:  # the second hooked output of the pass: one record was reached already
            raise Injected("output-gradient hook")
        return orig(rec, mode)

    monkeypatch.setattr(capture_mod, "instantiate_on_arrival", on_arrival)


def inject_user_tensor_hook(model, engine, monkeypatch):
    model.user_hook_fails = True


def inject_oom(model, engine, monkeypatch):
    Boom.armed = torch.OutOfMemoryError("injected: CUDA out of memory")


def inject_bookkeeping(model, engine, monkeypatch):
    orig = capture_mod.clipped_sums
    calls = []

    def clipped(*a, **k):
        if not calls:
            calls.append(1)
            raise Injected("bookkeeping")
        return orig(*a, **k)

    monkeypatch.setattr(capture_mod, "clipped_sums", clipped)


STAGES = {
    "forward_user": (inject_forward_user, Injected),
    "forward_generic_owner": (inject_forward_generic, Injected),
    "forward_hook": (inject_forward_hook, Injected),
    "output_grad_hook": (inject_output_grad, Injected),
    "user_tensor_hook": (inject_user_tensor_hook, Injected),
    "out_of_memory": (inject_oom, torch.OutOfMemoryError),
    "bookkeeping": (inject_bookkeeping, Injected),
}


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost", "instantiate"])
@pytest.mark.parametrize("stage", list(STAGES))
def test_failure_then_retry_on_smaller_batch(stage, mode, monkeypatch):
    model, engine, opt = setup(mode)
    acc = engine.accountant.state_dict()
    inject, exc = STAGES[stage]
    inject(model, engine, monkeypatch)
    x, y = data(5, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "always_call hook raised" warnings of torch for the forward-hook stage
        with pytest.raises(exc):
            backward(model, x, y)
    assert_clean(engine, model, acc)
    retry_matches_oracle(model, engine, opt, *data(3, 2))
    Boom.armed = None


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost"])
def test_nonfinite_gradient_then_retry(mode):
    model, engine, opt = setup(mode)
    acc = engine.accountant.state_dict()
    x, y = data(5, 1)
    x[2, 1] = float("nan")
    with pytest.raises(NonFiniteGradientError, match="step 1"):
        backward(model, x, y)
    assert_clean(engine, model, acc)
    retry_matches_oracle(model, engine, opt, *data(3, 2))


@pytest.fixture
def deferred_nonfinite_check(monkeypatch):
    """The accelerator behaviour on the CPU: the on_nonfinite="raise" check waits for the step's release."""
    import fastdp.deferred as deferred

    monkeypatch.setattr(deferred, "DEFER_ON", {"cpu": True, "default": True})


@pytest.mark.parametrize("bad_pass", [1, 2])
@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost", "instantiate"])
def test_deferred_nonfinite_check_refuses_the_step_then_retry(mode, bad_pass, deferred_nonfinite_check):
    """On an accelerator the backward pass does not wait for the non-finite check: the step's release makes it,
    names the backward pass and the sample, discards the step (nothing released or accounted) and a retried step
    releases exactly the oracle's result."""
    model, engine, opt = setup(mode)
    acc = engine.accountant.state_dict()
    batches = [data(3, 1), data(2, 3)]
    batches[bad_pass - 1][0][1, 2] = float("nan")
    for x, y in batches:
        backward(model, x, y)  # no error here: the check is deferred
    assert len(engine._release.deferred_nonfinite) == 2
    with pytest.raises(NonFiniteGradientError, match=rf"step 1: .*samples \[1\] of backward pass {bad_pass} "):
        opt.step()
    assert engine._release.deferred_nonfinite == [] and engine._release.step_passes == 0
    opt.zero_grad(set_to_none=True)
    assert_clean(engine, model, acc)
    retry_matches_oracle(model, engine, opt, *data(3, 2))


def test_deferred_nonfinite_check_passes_finite_steps_unchanged(deferred_nonfinite_check):
    model, engine, opt = setup()
    batches = [data(3, 1), data(3, 3)]
    want = oracle(model, batches)
    for x, y in batches:
        backward(model, x, y)
    opt.step()
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want)
    assert engine.steps == 1 and engine._release.deferred_nonfinite == []


def test_the_zero_policy_counts_at_the_release(deferred_nonfinite_check):
    """on_nonfinite="zero" on an accelerator refuses nothing: the bad sample is zeroed on the device (no verdict
    to defer), and its count is read when the step is released; a refused step's count is dropped with it."""
    model, engine, opt = setup(on_nonfinite="zero")
    x, y = data(5, 1)
    x[2, 1] = float("nan")
    backward(model, x, y)
    assert engine._release.deferred_nonfinite == [] and engine.nonfinite_samples == 0
    assert len(engine._release.step_nonfinite) == 1
    opt.step()
    assert engine.nonfinite_samples == 1 and engine._release.step_nonfinite == []
    backward(model, x, y)
    engine._release.discard()  # a refused step: its count goes with its sums
    assert engine._release.step_nonfinite == [] and engine.nonfinite_samples == 1


def test_step_after_failure_without_retry_is_refused_and_counts_nothing():
    model, engine, opt = setup()
    Boom.armed = torch.OutOfMemoryError("injected")
    with pytest.raises(torch.OutOfMemoryError):
        backward(model, *data(5, 1))
    with pytest.raises(RuntimeError, match="without a backward pass"):
        opt.step()
    assert engine.steps == 0
    retry_matches_oracle(model, engine, opt, *data(3, 2))


def test_failed_pass_logs_what_was_dropped(caplog):
    model, engine, opt = setup()
    Boom.armed = torch.OutOfMemoryError("injected")
    with caplog.at_level(logging.WARNING, logger="fastdp.engine"), pytest.raises(torch.OutOfMemoryError):
        backward(model, *data(5, 1))
    assert "backward pass raised" in caplog.text and "discarded" in caplog.text and "Linear" in caplog.text


def test_dropped_callback_without_notice_is_discarded_at_the_next_forward(monkeypatch, caplog):
    """Fallback: if autograd dropped the end-of-backward callback without releasing it (so ``on_dropped`` never
    ran), the next forward call of the model finds the callback marked queued outside a backward pass."""

    def queue_without_notice(on_end, on_dropped):
        torch.autograd.Variable._execution_engine.queue_callback(on_end)

    monkeypatch.setattr(capture_mod.session, "queue_end_of_backward", queue_without_notice)
    model, engine, opt = setup()
    acc = engine.accountant.state_dict()
    Boom.armed = torch.OutOfMemoryError("injected")
    with pytest.raises(torch.OutOfMemoryError):
        backward(model, *data(5, 1))
    # the wedge this guards against
    assert engine._capture.callback_queued and any(r.reached for r in engine._capture.pending)
    x, y = data(3, 2)
    want = oracle(model, [(x, y)])
    with caplog.at_level(logging.WARNING, logger="fastdp.engine"):
        out = model(x)
    assert "discarded" in caplog.text
    assert not engine._capture.callback_queued and all(not r.reached for r in engine._capture.pending)
    mse_per_sample(out, y).mean().backward()
    assert engine.steps == 0 and engine.accountant.state_dict() == acc
    opt.step()
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want)


def test_dropped_callback_without_notice_is_discarded_at_the_step(monkeypatch):
    def queue_without_notice(on_end, on_dropped):
        torch.autograd.Variable._execution_engine.queue_callback(on_end)

    monkeypatch.setattr(capture_mod.session, "queue_end_of_backward", queue_without_notice)
    model, engine, opt = setup()
    Boom.armed = torch.OutOfMemoryError("injected")
    with pytest.raises(torch.OutOfMemoryError):
        backward(model, *data(5, 1))
    with pytest.raises(RuntimeError, match="without a backward pass"):
        opt.step()
    assert not engine._capture.callback_queued and engine._capture.pending == [] and engine.steps == 0


def test_backward_again_on_a_discarded_graph_is_refused():
    model, engine, opt = setup()
    x, y = data(5, 1)
    loss = mse_per_sample(model(x), y).mean()
    Boom.armed = torch.OutOfMemoryError("injected")
    with pytest.raises(torch.OutOfMemoryError):
        loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="discarded"):
        loss.backward()
    assert engine._capture.pending == [] and engine._release.summed == {}
    retry_matches_oracle(model, engine, opt, *data(3, 2))


def test_other_forward_survives_a_failed_backward():
    """Two forward calls, the backward of the first fails: the second forward's records stay usable."""
    model, engine, opt = setup()
    x1, y1 = data(5, 1)
    x2, y2 = data(3, 2)
    loss1 = mse_per_sample(model(x1), y1).mean()
    loss2 = mse_per_sample(model(x2), y2).mean()
    Boom.armed = torch.OutOfMemoryError("injected")
    with pytest.raises(torch.OutOfMemoryError):
        loss1.backward()
    want = oracle(model, [(x2, y2)])
    loss2.backward()
    opt.step()
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want)


def test_gradient_accumulation_second_pass_fails_only_that_pass_is_discarded():
    """Policy: only the failed pass is discarded; the completed first pass stays in the logical step."""
    model, engine, opt = setup()
    b1, b2 = data(2, 1), data(2, 3)
    backward(model, *b1)
    Boom.armed = torch.OutOfMemoryError("injected")
    with pytest.raises(torch.OutOfMemoryError):
        backward(model, *data(4, 2))
    assert engine._capture.pending == [] and engine._release.step_samples == 2
    assert set(engine._release.summed) == set(engine._trainable.values())
    want = oracle(model, [b1, b2])
    backward(model, *b2)
    opt.step()
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want)
    assert engine.steps == 1


def test_gradient_accumulation_still_works():
    model, engine, opt = setup("BK-MixGhostClip")
    batches = [data(2, 1), data(3, 2), data(1, 3)]
    want = oracle(model, batches)
    for b in batches:
        backward(model, *b)
    opt.step()
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want)
    assert engine.steps == 1


def test_failure_changes_neither_noise_nor_accounting():
    """With noise: a run with a failed attempt releases exactly what a run without it releases."""
    released, acc = [], []
    for fail in (False, True):
        torch.manual_seed(0)
        model = Net().to(D)
        engine = make_engine(model, batch_size=B, R=0.3, sigma=1.3, accountant="rdp", verify_structure=False,
                             noise_generator=torch.Generator().manual_seed(7))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine.attach(opt)
        if fail:
            Boom.armed = torch.OutOfMemoryError("injected")
            with pytest.raises(torch.OutOfMemoryError):
                backward(model, *data(5, 1))
        backward(model, *data(3, 2))
        opt.step()
        released.append({n: p.grad.clone() for n, p in model.named_parameters()})
        acc.append((engine.steps, engine.accountant.state_dict(), engine.get_privacy_spent()["epsilon"]))
    assert_grads_close(released[1], released[0], rtol=0, atol=0)
    assert acc[0] == acc[1] and acc[0][0] == 1


def test_detach_after_failed_forward_restores_everything():
    model, engine, opt = setup()
    model.scale.fail = True
    with pytest.raises(Injected):
        model(data(5, 1)[0])
    engine.detach()
    assert all(p.requires_grad for p in model.parameters())
    assert engine._capture.pending == [] and not engine._capture.callback_queued


# --------------------------------------------------------------------------- other optimizers (GAN)

class Gen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 4)

    def forward(self, z):
        return self.lin(z)


def gan(seed=0):
    torch.manual_seed(seed)
    disc, gen = Net().to(D), Gen().to(D)
    engine = make_engine(disc, batch_size=B, R=0.3, accountant="rdp", verify_structure=False)
    PRISTINE[id(disc)] = copy.deepcopy(disc)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.0)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    engine.attach(opt_d)
    return disc, gen, engine, opt_d, opt_g


def test_generator_step_after_unpaused_pass_through_private_model_is_refused():
    disc, gen, engine, opt_d, opt_g = gan()
    z = torch.randn(4, 2, dtype=D)
    g_loss = disc(gen(z)).sum()
    g_loss.backward()
    g_before = gen.lin.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"SGD.*not attached.*engine.paused\(\)"):
        opt_g.step()
    assert torch.equal(gen.lin.weight, g_before)  # refused before the update
    assert engine._release.summed == {} and not engine._release.backward_seen and engine.steps == 0
    # the generator's pass is not folded into the next private step
    x, y = data(3, 2)
    retry_matches_oracle(disc, engine, opt_d, x, y)


def test_generator_pass_under_paused_is_excluded_and_trains_the_generator():
    disc, gen, engine, opt_d, opt_g = gan()
    ref_d, ref_g = copy.deepcopy(PRISTINE[id(disc)]), copy.deepcopy(gen)
    x, y = data(3, 2)
    want = oracle(disc, [(x, y)])
    backward(disc, x, y)  # private pass for the discriminator
    z = torch.randn(4, 2, dtype=D)
    with engine.paused():
        g_loss = disc(gen(z)).pow(2).sum()
    g_loss.backward()
    assert all(p.grad is None for p in disc.parameters())  # no non-private gradient for the private model
    ref_d.requires_grad_(False)
    ref_g.zero_grad()
    ref_d(ref_g(z)).pow(2).sum().backward()
    for p, q in zip(gen.parameters(), ref_g.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    opt_d.step()  # the private step first: only the private batch
    assert_grads_close({n: p.grad for n, p in disc.named_parameters()}, want)
    opt_g.step()
    assert engine.steps == 1


def test_generator_step_after_private_step_is_allowed():
    disc, gen, engine, opt_d, opt_g = gan()
    backward(disc, *data(3, 2))
    opt_d.step()
    gen(torch.randn(2, 2, dtype=D)).sum().backward()  # the engine holds nothing: no pass through disc
    opt_g.step()
    assert engine.steps == 1


def test_two_engines_in_lockstep_are_not_refused():
    m1, m2 = Net().to(D), Net().to(D)
    e1, e2 = make_engine(m1, batch_size=B, R=0.3), make_engine(m2, batch_size=B, R=0.3)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    e1.attach(o1)
    e2.attach(o2)
    x, y = data(3, 1)
    backward(m1, x, y)
    backward(m2, x, y)
    o1.step()
    o2.step()
    assert e1.steps == e2.steps == 1
    e1.detach()
    e2.detach()


class Wrapper(torch.optim.Optimizer):
    """Like accelerate's AcceleratedOptimizer: steps itself, then the wrapped (attached) optimizer."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        super().__init__([p for g in inner.param_groups for p in g["params"]], {"lr": 0.0})

    def step(self, closure=None):
        return self.inner.step()


def test_wrapper_of_the_attached_optimizer_is_not_refused():
    model, engine, opt = setup()
    x, y = data(3, 2)
    want = oracle(model, [(x, y)])
    backward(model, x, y)
    Wrapper(opt).step()
    assert engine.steps == 1
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want)


def test_second_optimizer_on_frozen_parameters_of_the_same_model_is_refused():
    torch.manual_seed(0)
    model = Net().to(D)
    model.l3.requires_grad_(False)
    engine = make_engine(model, batch_size=B, R=0.3)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine.attach(opt)
    model.l3.requires_grad_(True)  # trained by a second, non-private optimizer (e.g. a head trained on public data)
    opt2 = torch.optim.SGD(model.l3.parameters(), lr=0.1)
    # refused at the first forward (the structure probe's first run sees the unfrozen l3) or at opt2's step
    with pytest.raises(RuntimeError, match=r"not attached|unfrozen: \['l3.bias', 'l3.weight'\]"):
        backward(model, *data(3, 1))
        opt2.step()
    assert engine.steps == 0 and engine._release.summed == {}


def test_detach_removes_the_other_optimizer_check():
    disc, gen, engine, opt_d, opt_g = gan()
    engine.detach()
    disc(gen(torch.randn(4, 2, dtype=D))).sum().backward()
    opt_g.step()  # no engine: an ordinary step


# --------------------------------------------------------------------------- clip_grad_norm_

def test_clip_grad_norm_before_step_sees_nothing_and_changes_nothing():
    """Under the engine .grad is None between backward and step: clip_grad_norm_ returns 0 and the release is the
    engine's (the engine clips per sample; remove clip_grad_norm_ from the loop)."""
    model, engine, opt = setup()
    x, y = data(3, 2)
    want = oracle(model, [(x, y)])
    backward(model, x, y)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-6)
    assert float(total) == 0.0
    opt.step()
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want)
    assert trainable_names(model) == list(engine.trainable_parameters)


@pytest.mark.parametrize("stage", ["out_of_memory"])
def test_failure_inside_the_probe_leaves_the_engine_clean(stage, monkeypatch):
    """With the structure probe on, the first forward of a signature runs the probe's passes first: an out-of-memory
    error there propagates at once, leaves nothing behind, and the retry (probed again, then trained) is exact.
    (Other errors of the probe's engine pass are left to the real pass, which raises them itself.)"""
    model, engine, opt = setup(verify_structure=True)
    acc = engine.accountant.state_dict()
    inject, exc = STAGES[stage]
    inject(model, engine, monkeypatch)
    x, y = data(5, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(exc):
            backward(model, x, y)
    assert_clean(engine, model, acc)
    Boom.armed = None
    retry_matches_oracle(model, engine, opt, *data(3, 2))
    assert engine.probe_stats["signatures"] >= 1


class _RootParameter(nn.Module):
    """A parameter held by the root module (timm's ViT holds pos_embed so), used in a method other than forward."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(1, 4))
        self.lin = nn.Linear(4, 3)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + self.pos)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


def test_a_root_parameter_used_through_another_method_is_refused_naming_the_fix():
    """``model.features(x)`` skips the root's forward, whose replay clips ``pos`` per sample: refused, and the
    message says to call the model itself (it blamed weight tying and torch.compile only; a red-team pass)."""
    torch.manual_seed(0)
    model = _RootParameter()
    engine = make_engine(model, batch_size=4, R=0.3)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"'pos' received a gradient from outside.*call the model itself"):
        model.features(torch.randn(4, 4)).pow(2).sum().backward()
