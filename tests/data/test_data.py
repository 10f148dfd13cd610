"""fastdp.data: Poisson sampling (statistics, empty batches, seeds, secure mode), the loader wrapper, empty-batch
collation, and virtual batches (exact cover; equal to the unsplit step under the engine)."""

from __future__ import annotations

import math
import warnings
from collections import namedtuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from torch import nn
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from fastdp.data import EmptyBatchCollate, PoissonSampler, VirtualBatches, is_poisson, poisson_loader


def _gen(seed: int = 0) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# ------------------------------------------------------------------------------------------- PoissonSampler
def test_batch_size_is_binomial():
    """2000 batches, n=1000, q=0.05: mean within 5 standard errors of n q, variance within 5 standard errors of
    n q (1 - q) (a fixed-size sampler has variance 0), and every index is included at rate q."""
    n, b, steps = 1000, 50, 2000
    q = b / n
    sampler = PoissonSampler(n, batch_size=b, steps=steps, generator=_gen(1))
    batches = list(sampler)
    assert len(batches) == steps == len(sampler)
    sizes = np.array([len(x) for x in batches], dtype=np.float64)
    var = n * q * (1 - q)
    assert abs(sizes.mean() - n * q) < 5 * math.sqrt(var / steps)
    assert abs(sizes.var(ddof=1) - var) < 5 * var * math.sqrt(2 / (steps - 1))
    # each index: Binomial(steps, q) inclusion count; chi-square over the n indices ~ chi2(n) approximately
    counts = np.bincount(np.concatenate([np.asarray(x, dtype=np.int64) for x in batches]), minlength=n)
    chi2 = ((counts - steps * q) ** 2 / (steps * q * (1 - q))).sum()
    assert stats.chi2.ppf(1e-6, n) < chi2 < stats.chi2.isf(1e-6, n)
    # batches are sorted, without repeats, within range
    for x in batches[:50]:
        assert x == sorted(set(x)) and all(0 <= i < n for i in x)


@pytest.mark.parametrize("q", [0.3, 0.05])
def test_sample_rate_and_default_steps(q):
    s = PoissonSampler(200, sample_rate=q, generator=_gen())
    assert s.sample_rate == q and len(s) == round(1 / q) and s.expected_batch_size == pytest.approx(200 * q)
    assert len(PoissonSampler(10, sample_rate=1.0)) == 1
    assert len(PoissonSampler(10, sample_rate=0.7)) == 1
    assert list(PoissonSampler(5, sample_rate=1.0, steps=2)) == [[0, 1, 2, 3, 4]] * 2


def test_empty_batches_are_yielded():
    # P(empty) = 0.95 ** 10 ~ 0.6 per batch
    s = PoissonSampler(10, sample_rate=0.05, steps=200, generator=_gen(2))
    batches = list(s)
    assert len(batches) == 200
    n_empty = sum(len(x) == 0 for x in batches)
    assert 80 < n_empty < 160


def test_seeded_generator_is_deterministic():
    a = [list(PoissonSampler(300, batch_size=30, generator=_gen(7))) for _ in range(2)]
    assert a[0] == a[1]
    s = PoissonSampler(300, batch_size=30, generator=_gen(7))
    first, second = list(s), list(s)
    assert first == a[0] and second != first  # a second pass continues the generator's stream
    assert list(PoissonSampler(300, batch_size=30, generator=_gen(8))) != first


def test_default_generator_follows_torch_manual_seed():
    s = PoissonSampler(300, batch_size=30)
    torch.manual_seed(123)
    a = list(s)
    torch.manual_seed(123)
    assert list(s) == a


def test_secure_mode_is_not_reproducible_and_refuses_a_generator():
    torch.manual_seed(0)
    a = list(PoissonSampler(1000, batch_size=100, secure_mode=True))
    torch.manual_seed(0)
    b = list(PoissonSampler(1000, batch_size=100, secure_mode=True))
    assert a != b
    sizes = [len(x) for x in a]
    assert len(sizes) == 10 and all(40 < k < 170 for k in sizes)  # Binomial(1000, 0.1): mean 100, sd 9.5
    with pytest.raises(ValueError, match="secure_mode"):
        PoissonSampler(10, batch_size=2, generator=_gen(), secure_mode=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(sample_size=0, batch_size=1), "sample_size=0"),
    (dict(sample_size=10), "exactly one"),
    (dict(sample_size=10, batch_size=2, sample_rate=0.2), "exactly one"),
    (dict(sample_size=10, batch_size=11), "batch_size=11 is larger"),
    (dict(sample_size=10, batch_size=2.5), "batch_size=2.5"),
    (dict(sample_size=10, sample_rate=0.0), "sample_rate=0.0"),
    (dict(sample_size=10, sample_rate=1.5), "sample_rate=1.5"),
    (dict(sample_size=10, batch_size=2, steps=0), "steps=0"),
    (dict(sample_size=10, batch_size=2, generator=42), "torch.Generator"),
])
def test_sampler_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoissonSampler(**kwargs)


# ---------------------------------------------------------------------------------------------- is_poisson
def test_is_poisson():
    ds = TensorDataset(torch.arange(20.0))
    assert not is_poisson(DataLoader(ds, batch_size=4, shuffle=True))
    assert is_poisson(poisson_loader(ds, batch_size=4))
    assert is_poisson(PoissonSampler(20, batch_size=4))
    assert not is_poisson(object())

    class Declared:  # a third-party sampler may declare itself Poisson
        fastdp_poisson = True

    assert is_poisson(Declared())


# -------------------------------------------------------------------------------------------------- loader
def test_loader_over_tensor_dataset():
    x = torch.arange(60.0).reshape(30, 2)
    y = torch.arange(30)
    loader = poisson_loader(TensorDataset(x, y), batch_size=5, generator=_gen(3))
    assert len(loader) == 6 and loader.batch_sampler.sample_rate == 5 / 30
    sampler_batches = list(PoissonSampler(30, batch_size=5, generator=_gen(3)))
    for (bx, by), idx in zip(loader, sampler_batches, strict=True):
        assert torch.equal(by, torch.tensor(idx, dtype=torch.int64))
        assert torch.equal(bx, x[idx].reshape(len(idx), 2))


class Pairs(Dataset):
    """(image tensor, int label) pairs, like torchvision datasets."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 4, 4), float(i)), i % 10


def test_loader_over_tensor_int_pairs_with_empty_batches():
    loader = poisson_loader(Pairs(12), sample_rate=0.05, steps=100, generator=_gen(4))
    seen_empty = seen_full = False
    for images, labels in loader:
        assert images.dtype == torch.float32 and labels.dtype == torch.int64
        assert images.shape[1:] == (3, 4, 4) and labels.shape == (images.shape[0],)
        seen_empty |= images.shape[0] == 0
        seen_full |= images.shape[0] > 0
    assert seen_empty and seen_full


def test_loader_from_loader_keeps_its_settings():
    calls = []

    def collate(samples):
        calls.append(len(samples))
        return torch.stack([s[0] for s in samples])

    ds = TensorDataset(torch.randn(40, 3))
    base = DataLoader(ds, batch_size=8, shuffle=True, collate_fn=collate, pin_memory=False, timeout=0,
                      generator=_gen(5))
    loader = poisson_loader(base)
    assert loader.batch_sampler.sample_rate == 8 / 40 and len(loader) == 5
    out = list(loader)
    assert [o.shape[0] for o in out if o.shape[0] > 0] == [c for c in calls if c > 0]
    assert isinstance(loader.collate_fn, EmptyBatchCollate) and loader.collate_fn.collate_fn is collate
    # the loader's generator drives the sampling when none is given
    again = poisson_loader(DataLoader(ds, batch_size=8, shuffle=True, collate_fn=collate, generator=_gen(5)))
    assert [o.shape[0] for o in again] == [o.shape[0] for o in out]
    # overriding arguments; rebuilding a Poisson loader
    assert poisson_loader(base, batch_size=4).batch_sampler.sample_rate == 4 / 40
    assert poisson_loader(poisson_loader(base), batch_size=2).batch_sampler.sample_rate == 2 / 40


def test_loader_with_workers():
    loader = poisson_loader(Pairs(40), batch_size=4, num_workers=2, generator=_gen(6), steps=6)
    base = DataLoader(Pairs(40), batch_size=4, num_workers=2)
    rebuilt = poisson_loader(base, generator=_gen(6), steps=6)
    assert rebuilt.num_workers == 2
    a = [lab.tolist() for _, lab in loader]
    b = [lab.tolist() for _, lab in rebuilt]
    assert a == b and len(a) == 6
    assert poisson_loader(base, num_workers=0).num_workers == 0  # the copied prefetch_factor is dropped


def test_loader_refuses_samplers_it_would_discard():
    ds = TensorDataset(torch.randn(20, 2))
    with pytest.raises(ValueError, match="WeightedRandomSampler"):
        poisson_loader(DataLoader(ds, batch_size=4, sampler=WeightedRandomSampler(torch.ones(20), 128)))
    with pytest.raises(ValueError, match="SubsetRandomSampler.*Subset"):
        poisson_loader(DataLoader(ds, batch_size=4, sampler=SubsetRandomSampler(range(10))))
    with pytest.raises(ValueError, match="batch_sampler list"):
        poisson_loader(DataLoader(ds, batch_sampler=[[0, 1], [2]]))
    with pytest.raises(ValueError, match="no batch_size"):
        poisson_loader(DataLoader(ds, batch_sampler=PoissonSampler(20, batch_size=2)))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        poisson_loader(DataLoader(ds, batch_size=4, drop_last=True))
    assert any("drop_last" in str(x.message) for x in w)


def test_loader_rejects_bad_arguments():
    ds = TensorDataset(torch.randn(20, 2))

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(ValueError, match="IterableDataset"):
        poisson_loader(Stream(), batch_size=2, sample_size=3)
    with pytest.raises(ValueError, match="IterableDataset"):
        poisson_loader(DataLoader(Stream(), batch_size=2))
    with pytest.raises(ValueError, match="sample_size=30 differs from len"):
        poisson_loader(ds, batch_size=2, sample_size=30)
    with pytest.raises(ValueError, match="shuffle=True is not allowed"):
        poisson_loader(ds, batch_size=2, shuffle=True)
    with pytest.raises(ValueError, match="batch_size=... "):
        poisson_loader(ds)
    with pytest.raises(ValueError, match="secure_mode"):
        poisson_loader(ds, batch_size=2, secure_mode=True, generator=_gen())


def test_secure_loader_ignores_loader_generator():
    ds = TensorDataset(torch.arange(200))
    base = DataLoader(ds, batch_size=20, shuffle=True, generator=_gen(0))
    a = [b[0].tolist() for b in poisson_loader(base, secure_mode=True)]
    b = [b[0].tolist() for b in poisson_loader(base, secure_mode=True)]
    assert a != b


# ------------------------------------------------------------------------------------------- empty collate
Point = namedtuple("Point", ["x", "label"])


@pytest.mark.parametrize("example, check", [
    ((torch.zeros(5, dtype=torch.float64), 3),
     lambda e: e[0].shape == (0, 5) and e[0].dtype == torch.float64 and e[1].shape == (0,)
     and e[1].dtype == torch.int64),
    ({"ids": torch.zeros(7, dtype=torch.int32), "mask": torch.ones(7, dtype=torch.bool)},
     lambda e: e["ids"].shape == (0, 7) and e["ids"].dtype == torch.int32 and e["mask"].dtype == torch.bool),
    (Point(torch.zeros(2, 3), 1.5),
     lambda e: isinstance(e, Point) and e.x.shape == (0, 2, 3) and e.label.dtype == torch.float64),
    ((np.zeros((4,), dtype=np.float32), "text"),
     lambda e: e[0].shape == (0, 4) and e[0].dtype == torch.float32 and len(e[1]) == 0),
    (torch.zeros(()), lambda e: e.shape == (0,)),
])
def test_empty_batch_structure(example, check):
    collate = EmptyBatchCollate(dataset=[example])
    assert check(collate([]))


def test_empty_batch_errors_and_override():
    def to_none(samples):
        return None

    with pytest.raises(TypeError, match="empty_batch="):
        EmptyBatchCollate(to_none, dataset=[1])([])

    def scalar(samples):
        return torch.tensor(float(len(samples)))

    with pytest.raises(TypeError, match="0-dimensional"):
        EmptyBatchCollate(scalar, dataset=[1])([])
    assert EmptyBatchCollate(to_none, empty_batch=lambda: "empty")([]) == "empty"
    with pytest.raises(ValueError, match="dataset"):
        EmptyBatchCollate()


# ---------------------------------------------------------------------------------------- VirtualBatches
@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 150), m=st.integers(1, 40))
def test_virtual_batches_cover_each_row_once(n, m):
    x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
    y = torch.arange(n)
    vb = VirtualBatches((x, y), m)
    parts = list(vb)
    assert len(parts) == len(vb) == max(1, math.ceil(n / m)) and vb.batch_size == n
    assert all(isinstance(p, tuple) and len(p) == 2 for p in parts)
    sizes = [p[1].shape[0] for p in parts]
    assert all(s <= m for s in sizes) and all(s == m for s in sizes[:-1])
    assert torch.equal(torch.cat([p[1] for p in parts]), y)  # each row exactly once, in order
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    if n == 0:
        assert parts[0][0].shape == (0, 3)
    else:
        assert all(p[0].data_ptr() == x[i * m:].data_ptr() for i, p in enumerate(parts))  # views, no copy


def test_virtual_batches_structures_and_errors():
    batch = {"a": torch.zeros(5, 2), "b": [torch.arange(5), Point(torch.ones(5), torch.zeros(5, 1))]}
    parts = list(VirtualBatches(batch, 2))
    assert [p["b"][0].tolist() for p in parts] == [[0, 1], [2, 3], [4]]
    assert isinstance(parts[0]["b"][1], Point) and parts[2]["b"][1].label.shape == (1, 1)
    assert [p.shape[0] for p in VirtualBatches(torch.zeros(0, 4), 3)] == [0]
    with pytest.raises(ValueError, match=r"batch\[1\] has 4 rows but batch\[0\] has 5"):
        VirtualBatches((torch.zeros(5), torch.zeros(4)), 2)
    with pytest.raises(ValueError, match="0-dimensional"):
        VirtualBatches(torch.tensor(1.0), 2)
    with pytest.raises(ValueError, match="type str"):
        VirtualBatches((torch.zeros(2), "x"), 2)
    with pytest.raises(ValueError, match="max_physical_batch_size=0"):
        VirtualBatches(torch.zeros(2), 0)
    with pytest.raises(ValueError, match="no tensor"):
        VirtualBatches((), 2)


def _one_step(micro: int | None, x: torch.Tensor, y: torch.Tensor, sigma: float) -> list[torch.Tensor]:
    from fastdp import PrivacyEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    noise = torch.Generator()
    noise.manual_seed(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, batch_size=10, sample_size=100, noise_multiplier=sigma, max_grad_norm=0.1,
                               accountant="rdp", noise_generator=noise)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    parts = [(x, y)] if micro is None else VirtualBatches((x, y), micro)
    seen = 0
    for bx, by in parts:
        if len(bx):
            nn.functional.cross_entropy(model(bx), by).backward()
            seen += len(bx)
    if seen:
        opt.step()
    else:
        engine.empty_step()  # an empty logical batch: noise only, counted
    opt.zero_grad()
    assert engine.steps == 1
    engine.detach()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("sigma", [0.0, 1.0])
@pytest.mark.parametrize("n", [0, 1, 13])
def test_virtual_batches_step_equals_unsplit_step(sigma, n):
    """Per-sample clipping across micro-batches, noise once: the same update as the whole logical batch."""
    g = _gen(9)
    x = torch.randn(n, 4, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    whole = _one_step(None, x, y, sigma)
    for m in (1, 4, 64):
        for a, b in zip(whole, _one_step(m, x, y, sigma), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
