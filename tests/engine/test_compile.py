"""torch.compile with an attached engine is refused with an error that says what to do (docs/guide/integrations.md):
at the first forward call when the model is compiled (before or after the engine is built), at the backward pass when
code compiled before attach() runs without the engine's hooks; nothing is released or accounted, and the uncompiled
model then trains exactly (oracle)."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_grads_close, make_engine, mse_per_sample, oracle_release, released_grads, trainable_names
from torch import nn

BACKENDS = ["eager", "aot_eager"]  # the refusal happens before any backend runs; inductor needs a C++ toolchain


def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x = torch.randn(4, 5, dtype=torch.float64)
    y = torch.randn(4, 3, dtype=torch.float64)
    want = oracle_release(model, mse_per_sample, [(x, y)], R=0.5, batch_size=4)
    return model, x, y, want


def uncompiled_step_is_exact(model, engine, opt, x, y, want, steps_before=0):
    assert engine.steps == engine.accountant.ledger.steps == steps_before
    assert not engine._release.holds_gradients()
    opt.zero_grad()
    mse_per_sample(model(x), y).mean().backward()
    opt.step()
    assert_grads_close(released_grads(model, trainable_names(model)), want)
    assert engine.steps == steps_before + 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("built_on", ["model", "compiled"])
def test_compiled_call_refused_at_first_forward(backend, built_on):
    torch._dynamo.reset()
    model, x, y, want = setup()
    compiled = torch.compile(model, backend=backend)
    engine = make_engine(model if built_on == "model" else compiled, batch_size=4, R=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    for _ in range(2):  # refused every time, not only at the first compilation
        with pytest.raises(RuntimeError, match="torch.compile is not supported with a PrivacyEngine"):
            compiled(x)
    assert all(p.grad is None for p in model.parameters())
    if built_on == "model":
        uncompiled_step_is_exact(model, engine, opt, x, y, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_before_attach_refused_at_backward(backend):
    """Code compiled and run before attach() has no engine hooks: its parameters get a gradient from outside their
    layers' forward, which the engine refuses (the message names torch.compile); nothing is released."""
    torch._dynamo.reset()
    model, x, y, want = setup()
    compiled = torch.compile(model, backend=backend)
    mse_per_sample(compiled(x), y).mean().backward()  # warm: compiled without hooks
    for p in model.parameters():
        p.grad = None
    engine = make_engine(model, batch_size=4, R=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    with pytest.raises(RuntimeError, match="torch.compile"):
        mse_per_sample(compiled(x), y).mean().backward()
    with pytest.raises(RuntimeError, match="without a backward pass"):
        opt.step()
    for p in model.parameters():
        p.grad = None
    uncompiled_step_is_exact(model, engine, opt, x, y, want)
