"""The backward pass never reads a tensor's value on the host (the CPU-checkable form of "no host synchronisation").

On CUDA every ``.item()``, ``bool(tensor)``, ``float(tensor)``, ``.tolist()``, ``.nonzero()`` or ``.cpu()`` makes
the host wait for the GPU; inside ``loss.backward()`` that stalls the queue of kernels once per pass. The CUDA test
(tests/cuda/test_cuda_paths.py, ``torch.cuda.set_sync_debug_mode``) runs only where a GPU is; this one runs
everywhere: it wraps those ``torch.Tensor`` methods and records every call made from fastdp's own code during
``loss.backward()``, on the CPU with the accelerator's behaviour switched on (the non-finite check deferred to the
step, ``fastdp.deferred.DEFER_ON``). Reads at ``optimizer.step()`` are allowed (one per step).
"""

from __future__ import annotations

import contextlib
import traceback

import pytest
import torch
from model_oracle import LMWrap, gpt2, lm_batches, lm_loss, quiet_transformers
from oracle import RawScale, make_engine, mse_per_sample
from torch import nn

import fastdp.deferred as deferred

quiet_transformers()

HOST_READS = ("__bool__", "item", "tolist", "__float__", "__int__", "__index__", "nonzero", "numpy", "cpu")


@contextlib.contextmanager
def fastdp_host_reads():
    """Record ``(method, "file:line")`` for every host read of a tensor made from a file under ``fastdp/``."""
    hits: list[tuple[str, str]] = []
    saved = {n: torch.Tensor.__dict__.get(n) for n in HOST_READS}

    def wrap(name, orig):
        def read(self, *args, **kwargs):
            ours = [f for f in traceback.extract_stack()[:-1] if "/fastdp/" in f.filename.replace("\\", "/")]
            if ours:
                hits.append((name, f"{ours[-1].filename.replace(chr(92), '/').split('/fastdp/')[-1]}:"
                                   f"{ours[-1].lineno}"))
            return orig(self, *args, **kwargs)
        return read

    for n in HOST_READS:
        setattr(torch.Tensor, n, wrap(n, getattr(torch.Tensor, n)))
    try:
        yield hits
    finally:
        for n, v in saved.items():
            if v is None:
                delattr(torch.Tensor, n)
            else:
                setattr(torch.Tensor, n, v)


def test_the_spy_sees_a_host_read_in_the_backward_pass(monkeypatch):
    """The check can fail: with the non-finite check left in the backward pass (the CPU's default), the spy
    reports its ``bool(tensor)``."""
    monkeypatch.setattr(deferred, "DEFER_ON", {"cpu": False, "default": False})
    model = nn.Linear(3, 2)
    engine = make_engine(model, batch_size=4, R=1.0, sigma=1.0, verify_structure=False)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    loss = mse_per_sample(model(torch.randn(4, 3)), torch.randn(4, 2)).mean()
    with fastdp_host_reads() as hits:
        loss.backward()
    assert any(n == "__bool__" and f.startswith("clipped_sums.py") for n, f in hits), hits


def build(name: str):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), RawScale(7), nn.Linear(7, 3))
        data = [((torch.randn(n, 5, generator=g),), torch.randn(n, 3, generator=g)) for n in (3, 2)]
        return model, mse_per_sample, data
    if name == "conv":
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(),
                              nn.Linear(4 * 36, 3))
        data = [((torch.randn(n, 3, 6, 6, generator=g),), torch.randn(n, 3, generator=g)) for n in (3, 2)]
        return model, mse_per_sample, data
    if name == "conv-grouped":  # 16 x 16 = 256 output positions: the grouped-convolution per-sample kernel
        model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 256, 2))
        data = [((torch.randn(n, 2, 16, 16, generator=g),), torch.randn(n, 2, generator=g)) for n in (3, 2)]
        return model, mse_per_sample, data
    if name == "tokens":
        model = nn.Sequential(nn.Embedding(11, 6), nn.LayerNorm(6), nn.Linear(6, 2))
        data = [((torch.randint(0, 11, (n, 5), generator=g),), torch.randn(n, 5, 2, generator=g)) for n in (3, 2)]
        return model, mse_per_sample, data
    return LMWrap(gpt2()), lm_loss, [((x,), y) for (x,), y in lm_batches([3, 2], 80)]


CASES = [(name, mode, {}) for name in ("mlp", "conv", "tokens", "gpt2")
         for mode in ("BK-MixOpt", "BK-MixGhostClip", "BK-ghost", "ghost", "instantiate")]
CASES += [("conv-grouped", "instantiate", {}), ("conv-grouped", "BK-MixOpt", {}), ("gpt2", "bitfit", {}),
          ("mlp", "BK-MixOpt", {"style": "layer-wise"}),
          ("mlp", "BK-MixOpt", {"fn": "automatic"})]


@pytest.mark.parametrize(("name", "mode", "kw"), CASES, ids=[f"{n}-{m}-{'-'.join(k.values())}" for n, m, k in CASES])
def test_no_host_read_inside_the_backward_pass(name, mode, kw, monkeypatch):
    monkeypatch.setattr(deferred, "DEFER_ON", {"cpu": True, "default": True})
    model, loss, data = build(name)
    if mode == "bitfit":
        for n, p in model.named_parameters():
            p.requires_grad_(n.endswith("bias"))
    B = sum(x[0].shape[0] for x, _ in data)
    engine = make_engine(model, batch_size=B, R=0.5, sigma=1.0, mode="BK-MixOpt" if mode == "bitfit" else mode, **kw)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    engine.attach(opt)
    for step in range(3):
        for x, y in data:
            lo = loss(model(*x), y).mean()
            with fastdp_host_reads() as hits:
                lo.backward()
            assert not hits, f"step {step}: {hits}"
        opt.step()
        opt.zero_grad()
    assert engine.steps == 3


def test_adaptive_clipping_counts_without_a_host_read(monkeypatch):
    from fastdp.adaptive import AdaptiveClipping

    monkeypatch.setattr(deferred, "DEFER_ON", {"cpu": True, "default": True})
    model, loss, data = build("mlp")
    engine = make_engine(model, batch_size=5, R=0.5, sigma=1.0, fn="adaptive",
                         adaptive_clipping=AdaptiveClipping(count_noise_multiplier=2.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine.attach(opt)
    thresholds = []
    for _ in range(2):
        for x, y in data:
            lo = loss(model(*x), y).mean()
            with fastdp_host_reads() as hits:
                lo.backward()
            assert not hits, hits
        opt.step()
        opt.zero_grad()
        thresholds.append(engine.adaptive_clipping.max_grad_norm)
    assert len(set(thresholds)) == 2  # the count moved the threshold
