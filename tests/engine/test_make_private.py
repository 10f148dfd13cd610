"""``fastdp.make_private``: (engine, Poisson loader) in one call; the engine matches one built by hand, its first
step's released gradient matches the brute-force oracle, the loader never exceeds the planned steps, and bad input
is refused with a clear message."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fastdp
from fastdp.data import is_poisson
from tests.oracle import assert_grads_close, mse_per_sample, oracle_release, released_grads, trainable_names


def _setup(n: int = 50, batch: int = 8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    ds = TensorDataset(torch.randn(n, 3, dtype=torch.float64), torch.randn(n, 2, dtype=torch.float64))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(ds, batch_size=batch, shuffle=True)


@pytest.mark.parametrize("epochs", [1, 2.5, 3])
def test_make_private_matches_a_hand_built_engine(epochs):
    model, opt, dl = _setup()
    eng, loader = fastdp.make_private(model, opt, dl, target_epsilon=2.0, epochs=epochs, max_grad_norm=0.7,
                                      accountant="rdp")
    ref = fastdp.PrivacyEngine(nn.Linear(1, 1), batch_size=8, sample_size=50, epochs=epochs, target_epsilon=2.0,
                               accountant="rdp")
    assert eng.optimizer is opt and eng.noise_multiplier == ref.noise_multiplier
    assert eng.sample_rate == pytest.approx(8 / 50) and eng.max_grad_norm == 0.7
    assert is_poisson(loader) and loader.batch_sampler.sample_rate == pytest.approx(8 / 50)
    planned = eng._release.planned_steps
    assert planned == math.ceil(epochs * 50 / 8)
    assert len(loader) * math.ceil(epochs) <= planned  # iterating ceil(epochs) times stays within the plan
    assert len(loader) * math.ceil(epochs) > planned - math.ceil(epochs)  # and loses fewer than ceil(epochs) steps
    eng.detach()
    ref.detach()


def test_make_private_step_matches_oracle():
    model, opt, dl = _setup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0: the not-private warning
        eng, loader = fastdp.make_private(model, opt, dl, noise_multiplier=0.0, epochs=1, max_grad_norm=0.3,
                                          generator=torch.Generator().manual_seed(1))
    names = trainable_names(model)
    batch = None
    for x, y in loader:
        if len(x) > 1:
            batch = (x, y)
            break
    assert batch is not None
    eng.detach()  # the oracle deep-copies the model: without the engine's hooks
    want = oracle_release(model, mse_per_sample, [batch], fn="abadi", R=0.3, batch_size=8)
    eng.attach(opt)
    mse_per_sample(model(batch[0]), batch[1]).mean().backward()
    opt.step()
    assert_grads_close(released_grads(model, names), want, rtol=1e-6)
    assert eng.steps == 1


def test_make_private_refusals():
    model, opt, dl = _setup()
    with pytest.raises(ValueError, match="DataLoader"):
        fastdp.make_private(model, opt, dl.dataset, target_epsilon=1.0, epochs=1)
    with pytest.raises(ValueError, match="epochs=None"):
        fastdp.make_private(model, opt, dl, target_epsilon=1.0)
    with pytest.raises(ValueError, match="epochs=0"):
        fastdp.make_private(model, opt, dl, target_epsilon=1.0, epochs=0)
    with pytest.raises(ValueError, match="sample_size="):
        fastdp.make_private(model, opt, dl, target_epsilon=1.0, epochs=1, sample_size=10)
    sampled = DataLoader(dl.dataset, batch_sampler=torch.utils.data.BatchSampler(
        torch.utils.data.SequentialSampler(dl.dataset), 5, False))
    with pytest.raises(ValueError, match="batch_size"):
        fastdp.make_private(model, opt, sampled, target_epsilon=1.0, epochs=1)
    assert not any(p.grad is not None for p in model.parameters())
    eng, _ = fastdp.make_private(model, opt, sampled, target_epsilon=1.0, epochs=1, batch_size=5,
                                 accountant="rdp")  # the batch size given explicitly
    assert eng.batch_size == 5
