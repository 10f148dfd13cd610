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
CASES += [(name, mode, {"on_nonfinite": "zero"}) for name, mode in (
    ("mlp", "BK-MixOpt"), ("mlp", "ghost"), ("mlp", "instantiate"), ("conv", "BK-MixOpt"), ("tokens", "BK-ghost"),
    ("gpt2", "BK-MixOpt"))]


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


@pytest.mark.parametrize("defer", [True, False])
def test_flagged_ghost_norms_are_taken_again_only_where_a_host_read_is_free(defer, monkeypatch):
    """Samples the cancellation guard flags (inputs with a large common offset, output gradients summing to 0 over
    positions) are instantiated and summed apart by finding them on the host (``_rounding.exact_flagged``): on the
    CPU only, never where checks are deferred (CUDA), where they keep the raised norm."""
    monkeypatch.setattr(deferred, "DEFER_ON", {"cpu": defer, "default": defer})
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, 256, generator=g) + 40
    y = torch.randn(2, 64, 64, generator=g)
    model = nn.Linear(256, 64, bias=False)
    engine = make_engine(model, batch_size=2, R=1e-3, sigma=1.0, mode="BK-ghost")
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.01))
    loss = (model(x) * (y - y.mean(1, keepdim=True))).sum()
    with fastdp_host_reads() as hits:
        loss.backward()
    assert any(f.startswith("layers/_rounding.py") for _, f in hits) == (not defer), hits


@pytest.mark.parametrize("mode", ["BK-MixOpt", "BK-MixGhostClip", "ghost", "instantiate"])
def test_the_zero_policy_zeroes_a_bad_sample_without_a_host_read(mode, monkeypatch):
    """on_nonfinite="zero" on an accelerator: a sample with NaN gradients gets factor 0 and zeroed rows with no host
    read in the backward pass; it is counted when the step is released, and the release is the oracle's over the
    other samples."""
    from oracle import oracle_release

    monkeypatch.setattr(deferred, "DEFER_ON", {"cpu": True, "default": True})
    model, loss, data = build("mlp")
    model = model.double()
    data = [((x.double(),), y.double()) for (x,), y in data]
    (x0,), y0 = data[0]
    x_bad = x0.clone()
    x_bad[1, 2] = float("nan")
    good = [0, 2]
    batches = [(x0[good], y0[good]), (data[1][0][0], data[1][1])]
    want = oracle_release(model, loss, batches, fn="abadi", R=0.5, batch_size=5)
    engine = make_engine(model, batch_size=5, R=0.5, sigma=0.0, mode=mode, reduction="sum",
                         on_nonfinite="zero", verify_structure=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    for x, y in [(x_bad, y0), (data[1][0][0], data[1][1])]:
        lo = loss(model(x), y).sum()
        with fastdp_host_reads() as hits:
            lo.backward()
        assert not hits, hits
    assert engine.nonfinite_samples == 0  # not read yet
    opt.step()
    assert engine.nonfinite_samples == 1
    for n, p in model.named_parameters():
        assert torch.isfinite(p.grad).all()
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-12)


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


@pytest.mark.parametrize("name, mode", [("gpt2", "BK-MixOpt"), ("gpt2", "BK-ghost"), ("tokens", "BK-MixOpt"),
                                        ("conv", "BK-MixOpt"), ("conv-grouped", "instantiate")])
def test_the_device_zero_policy_releases_what_the_host_one_does(name, mode, monkeypatch):
    """The same step with a sample whose gradients are non-finite, under on_nonfinite="zero": sanitized on the device
    without knowing whether any sample is bad (accelerators) or after reading that one is (CPU). Both release the
    same gradients (GPT-2: tied embedding and LM head, layer norms, Conv1D; an embedding; convolutions)."""
    import copy

    model, loss, data = build(name)
    model = model.double()
    data = [tuple((t[0].double() if t[0].is_floating_point() else t[0],) if isinstance(t, tuple) else
                  (t.double() if t.is_floating_point() else t) for t in pair) for pair in data]
    (x0,), y0 = data[0]
    tokens = not x0.is_floating_point()
    if not tokens:
        x0 = x0.clone()
        x0[1].view(-1)[0] = float("nan")
        data[0] = ((x0,), y0)

    def poison_first_call(module, args, out, calls=[]):  # noqa: B006 - the calls of this copy
        calls.append(1)
        return out.index_fill(0, torch.tensor([1]), float("nan")) if len(calls) == 1 else out

    grads = {}
    for defer in (False, True):
        monkeypatch.setattr(deferred, "DEFER_ON", {"cpu": defer, "default": defer})
        m = copy.deepcopy(model)
        if tokens:  # token ids: sample 1's embedding output in the first pass instead
            emb = m.m.transformer.wte if name == "gpt2" else m[0]
            emb.register_forward_hook(lambda mod, a, out, calls=[]: poison_first_call(mod, a, out, calls))
        B = sum(x[0].shape[0] for x, _ in data)
        engine = make_engine(m, batch_size=B, R=0.5, sigma=0.0, mode=mode, reduction="sum", on_nonfinite="zero",
                             verify_structure=False)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        engine.attach(opt)
        for (x,), y in data:
            loss(m(x), y).sum().backward()
        opt.step()
        assert engine.nonfinite_samples == 1
        grads[defer] = {n: p.grad.clone() for n, p in m.named_parameters()}
        assert all(torch.isfinite(g).all() for g in grads[defer].values())
    for n in grads[False]:
        torch.testing.assert_close(grads[True][n], grads[False][n], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("poison", [False, True])
def test_a_grad_scaler_needs_no_host_read_in_the_backward_pass(poison, monkeypatch):
    """With a GradScaler attached: the loss scale is taken as the scaler's tensor and an overflowed sample is zeroed
    on the device, so the scaled backward pass reads nothing on the host; the overflow count is read when
    ``scaler.step`` releases (sigma 0: one overflowed sample skips the step, as without DP)."""
    monkeypatch.setattr(deferred, "DEFER_ON", {"cpu": True, "default": True})
    model, loss, data = build("mlp")
    engine = make_engine(model, batch_size=5, R=0.5, sigma=0.0, verify_structure=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    engine.attach(opt, scaler=scaler)
    for step in range(2):
        for i, ((x,), y) in enumerate(data):
            if poison and step == 1 and i == 0:
                x = x.clone()
                x[0, 0] = float("inf")
            lo = scaler.scale(loss(model(x), y).mean())
            with fastdp_host_reads() as hits:
                lo.backward()
            assert not hits, hits
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert engine.steps == 2
    assert engine._release.scaler.skipped_steps == (1 if poison else 0)
