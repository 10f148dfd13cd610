"""fastdp.data.DistributedPoissonSampler: partitions, equality with the one-process PoissonSampler under a shared seed,
inclusion statistics, independence between ranks, empty partitions, the loader, bad input; one 2-process gloo run
for the defaults from torch.distributed."""

from __future__ import annotations

import datetime
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scipy import stats
from torch.utils.data import TensorDataset

from fastdp.data import DistributedPoissonSampler, PoissonSampler, is_poisson, poisson_loader


def _gen(seed: int = 0) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _ranks(n: int, world: int, seeds: list[int] | None = None, **kw) -> list[DistributedPoissonSampler]:
    """One sampler per rank; ``seeds=None``: all ranks share seed 0."""
    seeds = [0] * world if seeds is None else seeds
    return [DistributedPoissonSampler(n, rank=r, world_size=world, generator=_gen(seeds[r]), **kw)
            for r in range(world)]


def _per_rank(samplers: list[DistributedPoissonSampler]) -> list[list[list[int]]]:
    return [list(s) for s in samplers]


# ------------------------------------------------------------------------------------------------ partitions
@pytest.mark.parametrize(("n", "world"), [(1, 1), (1, 3), (5, 2), (10, 3), (12, 4), (3, 5), (7, 7), (100, 8)])
def test_partitions_disjoint_and_covering(n, world):
    samplers = _ranks(n, world, batch_size=1)
    parts = [set(s.partition) for s in samplers]
    assert sum(len(p) for p in parts) == n and set().union(*parts) == set(range(n))  # disjoint and covering
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1  # balanced; ranks >= n own nothing
    assert all(sizes[r] == 0 for r in range(n, world))
    # every batch lies in the rank's partition, sorted, without repeats
    for s, p in zip(samplers, parts, strict=True):
        for batch in s:
            assert batch == sorted(set(batch)) and set(batch) <= p


# ------------------------------------------------------------------- shared seed: the one-process batches
@pytest.mark.parametrize(("n", "world", "b"), [(1, 1, 1), (1, 2, 1), (13, 1, 4), (13, 2, 4), (13, 3, 13), (13, 5, 1),
                                               (13, 13, 6), (5, 9, 2), (200, 3, 50)])
def test_union_with_shared_seed_equals_poisson_sampler(n, world, b):
    """Each rank seeded alike: the union of the ranks' batches at every step is PoissonSampler's batch (same seed),
    over two passes (the generator continues its stream)."""
    steps = 6
    samplers = _ranks(n, world, batch_size=b, steps=steps)
    single = PoissonSampler(n, batch_size=b, steps=steps, generator=_gen(0))
    for _ in range(2):
        per_rank = _per_rank(samplers)
        expected = list(single)
        for t in range(steps):
            union = sorted(i for r in range(world) for i in per_rank[r][t])
            assert union == expected[t]


def test_default_generator_follows_torch_manual_seed():
    """No generator: seeded from torch's global RNG per pass, so torch.manual_seed on every rank reproduces the
    one-process run; a different seed gives different batches."""
    n, world, b = 40, 3, 10

    def run(seed: int, make):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return list(make())

    expected = run(5, lambda: PoissonSampler(n, batch_size=b, steps=5))
    per_rank = [run(5, lambda r=r: DistributedPoissonSampler(n, batch_size=b, steps=5, rank=r, world_size=world))
                for r in range(world)]
    assert [sorted(sum((per_rank[r][t] for r in range(world)), [])) for t in range(5)] == expected
    other = run(6, lambda: DistributedPoissonSampler(n, batch_size=b, steps=5, rank=0, world_size=world))
    assert other != per_rank[0]


# -------------------------------------------------------------------------------------------- statistics
def _inclusion_counts(per_rank: list[list[list[int]]], n: int) -> np.ndarray:
    flat = [i for batches in per_rank for batch in batches for i in batch]
    return np.bincount(np.asarray(flat, dtype=np.int64), minlength=n)


@pytest.mark.parametrize("secure", [False, True])
def test_inclusion_frequency_is_q_per_example(secure):
    """Every example is included at rate q: its count over T steps is Binomial(T, q). Each count lies within 6
    standard deviations of T q (T q = 100, sd ~9.5 resp. ~8.7: rate 2q or q/2 puts it 10 or more sd away), the
    chi-square over all examples is inside its 1e-6 quantiles, and each rank's batch size has the Binomial mean
    and variance (a fixed-size sampler has variance 0). Independent seeds per rank (secure mode: CSPRNG)."""
    n, world, b, steps = (300, 3, 30, 1000) if not secure else (60, 2, 15, 400)
    q = b / n
    if secure:
        samplers = [DistributedPoissonSampler(n, batch_size=b, steps=steps, secure_mode=True, rank=r, world_size=world)
                    for r in range(world)]
    else:
        samplers = _ranks(n, world, seeds=[11, 12, 13], batch_size=b, steps=steps)
    per_rank = _per_rank(samplers)
    counts = _inclusion_counts(per_rank, n)
    sd = math.sqrt(steps * q * (1 - q))
    assert np.abs(counts - steps * q).max() < 6 * sd
    chi2 = ((counts - steps * q) ** 2 / sd**2).sum()
    assert stats.chi2.ppf(1e-6, n) < chi2 < stats.chi2.isf(1e-6, n)
    for s, batches in zip(samplers, per_rank, strict=True):
        m = len(s.partition)
        sizes = np.array([len(x) for x in batches], dtype=np.float64)
        var = m * q * (1 - q)
        assert abs(sizes.mean() - m * q) < 5 * math.sqrt(var / steps)
        assert abs(sizes.var(ddof=1) - var) < 6 * var * math.sqrt(2 / (steps - 1))
        assert s.expected_local_batch_size == pytest.approx(m * q)
        assert s.expected_batch_size == pytest.approx(b)


@pytest.mark.parametrize("shared", [True, False])
def test_rank_batch_sizes_are_independent(shared):
    """The ranks' batch sizes are uncorrelated (Pearson |r| < 4 / sqrt(T)), with a shared seed (disjoint
    coordinates of one uniform vector) and with independent seeds. A rank reusing another rank's uniforms would
    give r ~ 1."""
    n, world, b, steps = 200, 2, 40, 2000
    samplers = _ranks(n, world, seeds=None if shared else [3, 4], batch_size=b, steps=steps)
    sizes = np.array([[len(x) for x in batches] for batches in _per_rank(samplers)], dtype=np.float64)
    r = np.corrcoef(sizes[0], sizes[1])[0, 1]
    assert abs(r) < 4 / math.sqrt(steps)
    if not shared:  # the streams really differ: the union is not the one-process batch of either seed
        single = list(PoissonSampler(n, batch_size=b, steps=steps, generator=_gen(3)))
        unions = [sorted(a + c) for a, c in zip(*_per_rank(_ranks(n, world, seeds=[3, 4], batch_size=b,
                                                                  steps=steps)), strict=True)]
        assert unions != single


def test_batch_sizes_differ_across_ranks_and_steps():
    n, world, b, steps = 100, 3, 30, 20
    sizes = [[len(x) for x in batches] for batches in _per_rank(_ranks(n, world, batch_size=b, steps=steps))]
    assert all(len(set(row)) > 1 for row in sizes)  # over steps, on every rank
    assert any(len({sizes[r][t] for r in range(world)}) > 1 for t in range(steps))  # between ranks at a step


# --------------------------------------------------------------------------- empty partitions, len, loader
def test_empty_partitions_yield_empty_batches_and_len_is_equal():
    n, world = 3, 5
    samplers = _ranks(n, world, batch_size=2, steps=7)
    per_rank = _per_rank(samplers)
    assert {len(s) for s in samplers} == {7} and all(len(batches) == 7 for batches in per_rank)
    for r in (3, 4):
        assert samplers[r].partition == range(r, 3, 5) and len(samplers[r].partition) == 0
        assert per_rank[r] == [[]] * 7
    assert sum(len(x) for r in range(3) for x in per_rank[r]) > 0
    secure = DistributedPoissonSampler(n, batch_size=2, steps=4, secure_mode=True, rank=4, world_size=world)
    assert list(secure) == [[]] * 4


@pytest.mark.parametrize(("kw", "steps"), [({"batch_size": 7}, round(100 / 7)), ({"sample_rate": 0.3}, 3),
                                           ({"batch_size": 5, "steps": 11}, 11)])
def test_len_equal_on_all_ranks(kw, steps):
    assert {len(s) for s in _ranks(100, 6, **kw)} == {steps}


def test_loader_yields_empty_batches_that_collate():
    n, world = 3, 5
    x = torch.randn(n, 4, dtype=torch.float64)
    y = torch.arange(n)
    ds = TensorDataset(x, y)
    empty_rank = poisson_loader(ds, batch_size=2, steps=6, rank=4, world_size=world, generator=_gen())
    assert isinstance(empty_rank.batch_sampler, DistributedPoissonSampler) and is_poisson(empty_rank)
    assert len(empty_rank) == 6
    batches = list(empty_rank)
    assert len(batches) == 6
    for xb, yb in batches:
        assert xb.shape == (0, 4) and xb.dtype == torch.float64 and yb.shape == (0,) and yb.dtype == torch.int64
    # a rank with examples gets the rows of its sampler's indices, empty ones collated too
    loader = poisson_loader(ds, batch_size=1, steps=30, rank=1, world_size=2, generator=_gen(2))
    indices = list(DistributedPoissonSampler(n, batch_size=1, steps=30, rank=1, world_size=2, generator=_gen(2)))
    assert any(len(i) == 0 for i in indices) and any(len(i) > 0 for i in indices)
    for (xb, yb), idx in zip(loader, indices, strict=True):
        assert torch.equal(yb, torch.tensor(idx, dtype=torch.int64)) and torch.equal(xb, x[idx])
    # rebuilt from that loader: rank and world size kept
    rebuilt = poisson_loader(loader, batch_size=1)
    assert (rebuilt.batch_sampler.rank, rebuilt.batch_sampler.world_size) == (1, 2)


def test_loader_distributed_choice_without_process_group():
    ds = TensorDataset(torch.zeros(10, 2))
    assert type(poisson_loader(ds, batch_size=2).batch_sampler) is PoissonSampler  # not initialised: one process
    assert type(poisson_loader(ds, batch_size=2, distributed=False).batch_sampler) is PoissonSampler
    with pytest.raises(ValueError, match="init_process_group"):
        poisson_loader(ds, batch_size=2, distributed=True)
    with pytest.raises(ValueError, match="distributed=False contradicts rank=0"):
        poisson_loader(ds, batch_size=2, distributed=False, rank=0, world_size=2)


# --------------------------------------------------------------------------------------------- bad input
class _CudaGenerator(torch.Generator):
    @property
    def device(self) -> torch.device:  # a generator that reports a CUDA device, without needing a GPU
        return torch.device("cuda", 0)


@pytest.mark.parametrize(("kw", "match"), [
    ({"rank": 2, "world_size": 2}, r"rank=2 is outside \[0, world_size=2\)"),
    ({"rank": -1, "world_size": 2}, r"rank=-1 is outside"),
    ({"rank": 0, "world_size": 0}, r"world_size=0 must be at least 1"),
    ({"rank": 0, "world_size": -3}, r"world_size=-3 must be at least 1"),
    ({"rank": 0, "world_size": 2.0}, r"world_size=2.0 must be an int \(got float\)"),
    ({"rank": "1", "world_size": 2}, r"rank='1' must be an int \(got str\)"),
    ({"rank": True, "world_size": 2}, r"rank=True must be an int \(got bool\)"),
    ({"rank": 0}, r"give both rank and world_size, or neither.*world_size=None"),
    ({"world_size": 2}, r"give both rank and world_size, or neither.*rank=None"),
    ({}, r"torch.distributed.*not initialised.*init_process_group.*rank=\.\.\. and world_size=\.\.\."),
    ({"rank": 0, "world_size": 2, "process_group": object()}, r"process_group= .*cannot be combined"),
    ({"rank": 0, "world_size": 2, "generator": _CudaGenerator()}, r"on device cuda:0.*torch.Generator\(\)"),
    ({"rank": 0, "world_size": 2, "generator": 3}, r"generator must be a torch.Generator, got int"),
    ({"rank": 0, "world_size": 2, "generator": torch.Generator(), "secure_mode": True}, r"refuses a seeded generator"),
    ({"rank": 0, "world_size": 2, "sample_size": 0}, r"sample_size=0 must be a positive integer"),
    ({"rank": 0, "world_size": 2, "batch_size": 11}, r"batch_size=11 is larger than sample_size=10"),
])
def test_bad_input(kw, match):
    kw = {"sample_size": 10, "batch_size": 2, **kw}
    with pytest.raises(ValueError, match=match):
        DistributedPoissonSampler(**kw)


def test_world_size_larger_than_sample_size_is_allowed():
    s = DistributedPoissonSampler(2, batch_size=1, rank=6, world_size=9)
    assert len(s.partition) == 0 and s.expected_local_batch_size == 0.0


# ------------------------------------------------------------------------------------ 2 processes, gloo
def _train(distributed: bool) -> dict:
    """4 noisy steps of a float64 linear model on the loader's batches (this rank's part when distributed; empty
    parts included), with the engine: the final parameters, the engine's step count and epsilon."""
    from fastdp import PrivacyEngine

    torch.manual_seed(3)
    n = 50
    x, y = torch.randn(n, 3, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    model = torch.nn.Linear(3, 1, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PrivacyEngine(model, batch_size=10, sample_size=n, steps=4, noise_multiplier=1.0,
                           loss_reduction="sum", noise_generator=_gen(99), distributed=distributed)
    engine.attach(optimizer)
    loader = poisson_loader(TensorDataset(x, y), batch_size=10, steps=4, generator=_gen(1), distributed=distributed)
    for xb, yb in loader:
        ((model(xb).squeeze(1) - yb) ** 2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return {"params": params, "steps": engine.steps, "privacy": engine.get_privacy_spent()}


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        torch.manual_seed(7)
        sampler = DistributedPoissonSampler(50, batch_size=10, steps=4)
        loader = poisson_loader(TensorDataset(torch.arange(50)), batch_size=10, steps=4, generator=_gen(1))
        try:
            DistributedPoissonSampler(50, batch_size=10 if rank == 0 else 5, steps=4)
            mismatch = ""
        except ValueError as e:
            mismatch = str(e)
        result = {"rank": sampler.rank, "world_size": sampler.world_size, "batches": list(sampler),
                  "loader": [type(loader.batch_sampler).__name__, loader.batch_sampler.rank],
                  "mismatch": mismatch, "train": _train(distributed=True)}
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_defaults_come_from_torch_distributed(tmp_path):
    """Two gloo processes: rank and world size come from torch.distributed; the union of the two ranks' batches
    under torch.manual_seed(7) is the one-process batch; poisson_loader is distributed automatically; ranks that
    disagree on batch_size both raise, naming it."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [(res["rank"], res["world_size"]) for res in results] == [(0, 2), (1, 2)]
    assert [res["loader"] for res in results] == [["DistributedPoissonSampler", 0], ["DistributedPoissonSampler", 1]]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        expected = list(PoissonSampler(50, batch_size=10, steps=4))
    assert [sorted(a + b) for a, b in zip(results[0]["batches"], results[1]["batches"], strict=True)] == expected
    for res in results:
        assert "rank 1: sample_rate=0.1 but rank 0: sample_rate=0.2" in res["mismatch"]
    # the engine on the distributed loader: identical parameters and privacy on both ranks, equal (float64
    # rounding) to one process on the same (shared-seed) batches with the same noise
    train = [res["train"] for res in results]
    assert train[0] == train[1]
    single = _train(distributed=False)
    np.testing.assert_allclose(train[0]["params"], single["params"], rtol=1e-10, atol=1e-12)
    assert train[0]["steps"] == single["steps"] == 4 and train[0]["privacy"] == single["privacy"]
