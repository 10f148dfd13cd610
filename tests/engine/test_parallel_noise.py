"""Noise drawn on several CPU threads (``fastdp.noise.noisy_means``): the same distribution, reproducible from the
noise generator, independent between the threads' runs, and the same engine behaviour (seeded runs, checkpoint
resume, clipped sums) as the one-thread draw."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import make_engine, mse_per_sample, user_loss
from torch import nn

from fastdp import noise

D = torch.float64


@pytest.fixture
def parallel(monkeypatch):
    """Every step's noise on two threads, however small the model."""
    monkeypatch.setattr(noise, "NOISE_THREADS", 2)
    monkeypatch.setattr(noise, "PARALLEL_NOISE_MIN", 1)


def _params(sizes=(3000, 7, 5000, 4000, 1)):
    return [torch.empty(n, dtype=D) for n in sizes]


def test_runs_deal_the_parameters_into_balanced_runs():
    """Largest first to the least-loaded run: a partition of the indices, each run in the parameters' order,
    deterministic, no run above an equal share by more than the largest parameter; a single tensor is one run."""
    ps = _params((10, 10, 10, 10))
    runs = noise._runs(ps, 2)
    assert sorted(i for r in runs for i in r) == [0, 1, 2, 3] and all(r == sorted(r) for r in runs)
    assert [sum(ps[i].numel() for i in r) for r in runs] == [20, 20]
    assert noise._runs(_params((100,)), 2) == [[0]]
    assert noise._runs(_params((1, 1000, 1)), 2) == [[1], [0, 2]]
    sizes = (2_359_296, 7, 1_179_648, 2_359_296, 64, 590_000, 2_359_296, 5, 2_359_296, 1_179_648, 300_000)
    ps = _params(sizes)
    runs = noise._runs(ps, 2)
    assert runs == noise._runs(_params(sizes), 2)  # the same sizes, the same runs
    loads = [sum(sizes[i] for i in r) for r in runs]
    assert sorted(i for r in runs for i in r) == list(range(len(sizes)))
    assert max(loads) - sum(sizes) / 2 <= max(sizes)
    assert noise._runs(_params((600, 500, 500, 400)), 2) == [[0, 3], [1, 2]]  # 1000 each (consecutive: 1100)
    three = noise._runs(ps, 3)
    assert len(three) == 3 and sorted(i for r in three for i in r) == list(range(len(sizes)))


def test_same_generator_same_noise_and_another_seed_differs(parallel):
    ps = _params()
    a = noise.noisy_means(ps, {}, 1.0, 1, torch.Generator().manual_seed(3))
    b = noise.noisy_means(ps, {}, 1.0, 1, torch.Generator().manual_seed(3))
    c = noise.noisy_means(ps, {}, 1.0, 1, torch.Generator().manual_seed(4))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(torch.cat(a), torch.cat(c))


def test_threads_draw_independent_standard_normals(parallel):
    ps = _params((200_000, 200_000))
    std, B = 0.6, 3
    out = noise.noisy_means(ps, {}, std, B, torch.Generator().manual_seed(0))
    assert len(noise._runs(ps, 2)) == 2  # one run per thread
    for g in out:  # each run: N(0, (std/B)^2)
        assert g.dtype == D and abs(float(g.std()) / (std / B) - 1) < 0.01
        assert abs(float(g.mean())) < 5 * (std / B) / math.sqrt(g.numel())
    corr = float(torch.corrcoef(torch.stack([out[0], out[1]]))[0, 1])
    assert abs(corr) < 0.01, corr  # the two child streams are not copies or shifts of each other
    assert not torch.equal(out[0][:1000], out[1][:1000])


def test_sums_are_added_scaled_and_popped(parallel):
    ps = _params((4000, 4000))
    s0 = torch.full((4000,), 6.0, dtype=D)
    sums = {ps[0]: s0}
    out = noise.noisy_means(ps, sums, 0.0 + 1e-12, 2, torch.Generator().manual_seed(0))
    torch.testing.assert_close(out[0], s0 / 2, rtol=0, atol=1e-9)
    assert float(out[1].abs().max()) < 1e-9 and sums == {}  # noise only; the sum was freed after use


def test_one_thread_is_the_per_parameter_draw(monkeypatch):
    monkeypatch.setattr(noise, "NOISE_THREADS", 1)
    ps = _params()
    got = noise.noisy_means(ps, {}, 1.0, 2, torch.Generator().manual_seed(9))
    gen = torch.Generator().manual_seed(9)
    want = [noise.noisy_mean(p, None, 1.0, 2, gen) for p in ps]
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


def test_unknown_generator_layout_falls_back_to_one_thread(parallel, monkeypatch):
    monkeypatch.setattr(noise, "_cpu_state_layout_ok", lambda: False)
    ps = _params()
    got = noise.noisy_means(ps, {}, 1.0, 1, torch.Generator().manual_seed(9))
    gen = torch.Generator().manual_seed(9)
    assert all(torch.equal(x, noise.noisy_mean(p, None, 1.0, 1, gen)) for x, p in zip(got, ps, strict=True))


def _train(seed, steps=3, state=None):
    torch.manual_seed(33)
    model = nn.Sequential(nn.Linear(4, 60), nn.Tanh(), nn.Linear(60, 3)).to(D)
    gen = torch.Generator().manual_seed(seed)
    engine = make_engine(model, batch_size=4, R=1.0, sigma=1.0, mode="BK-MixOpt", noise_generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    if state is not None:
        model.load_state_dict(state["model"])
        engine.load_state_dict(state["engine"])
    g = torch.Generator().manual_seed(34 + (0 if state is None else 100))
    for _ in range(steps):
        x, y = torch.randn(4, 4, generator=g, dtype=D), torch.randn(4, 3, generator=g, dtype=D)
        user_loss(mse_per_sample(model(x), y), "mean").backward()
        opt.step()
        opt.zero_grad()
    return model, engine


def test_engine_runs_are_reproducible_and_resume_bit_identically(parallel):
    a, _ = _train(5)
    b, _ = _train(5)
    c, _ = _train(6)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters(), strict=True))
    # two steps, checkpoint, one more step == the same run continued (the children come from the saved generator)
    first, eng = _train(5, steps=2)
    state = {"model": {k: v.clone() for k, v in first.state_dict().items()}, "engine": eng.state_dict()}
    resumed, _ = _train(5, steps=1, state=state)
    cont_model, cont_engine = first, eng
    g = torch.Generator().manual_seed(134)
    opt = torch.optim.SGD(cont_model.parameters(), lr=0.1)
    cont_engine.detach()
    cont_engine.attach(opt)
    x, y = torch.randn(4, 4, generator=g, dtype=D), torch.randn(4, 3, generator=g, dtype=D)
    user_loss(mse_per_sample(cont_model(x), y), "mean").backward()
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), cont_model.parameters(), strict=True))


def _threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_the_noise_worker_runs_its_operations_on_itself(parallel):
    """Under OpenMP a thread that runs a parallel operation gets its own team of torch.get_num_threads() threads for
    the life of the process; beside the main thread's team the cores are oversubscribed and every later parallel
    operation of the main thread waits for its team to wake (4-8 times the time of small operations on 2 cores,
    benchmarks/noise_threads.py). The noise worker sets one thread for itself: a parallel operation on it starts no
    thread, while the same operation on a plain worker starts a team, and the main thread keeps its count."""
    import concurrent.futures

    from fastdp.torch_api import intra_op_threads_per_thread

    if not intra_op_threads_per_thread() or torch.get_num_threads() < 2:
        pytest.skip("needs torch's OpenMP backend and at least 2 intra-op threads")
    main_threads = torch.get_num_threads()
    noise.noisy_means(_params((4000, 4000)), {}, 1.0, 2, torch.Generator().manual_seed(0))  # the pool exists now
    big = torch.zeros(1 << 22)
    pool = noise._noise_pool()
    assert pool.submit(torch.get_num_threads).result() == 1
    before = _threads()
    pool.submit(torch.add, big, big, out=big).result()
    assert _threads() == before
    assert torch.get_num_threads() == main_threads
    # (a thread started after a noise step begins with the calling thread's count, not the worker's 1)
    noise.noisy_means(_params((4000, 4000)), {}, 1.0, 2, torch.Generator().manual_seed(0))
    with concurrent.futures.ThreadPoolExecutor(1) as fresh:
        assert fresh.submit(torch.get_num_threads).result() == main_threads
    with concurrent.futures.ThreadPoolExecutor(1) as plain:  # the mechanism: a plain worker starts its team
        plain.submit(lambda: None).result()
        before = _threads()
        plain.submit(torch.add, big, big, out=big).result()
        assert _threads() > before
