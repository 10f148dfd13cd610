"""fastdp.dpfp.MicroBatchSampler: M independent Poisson micro-batches per step (Algorithm 1, line 5)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

from fastdp.data import is_poisson
from fastdp.dpfp import MicroBatchSampler, micro_batch_loader


def test_rate_and_lengths():
    s = MicroBatchSampler(2000, micro_batches=4, batch_size=40, generator=torch.Generator().manual_seed(0))
    assert s.sample_rate == pytest.approx(40 / (4 * 2000))
    assert s.num_steps == 50 and len(s) == 200 and s.expected_step_size == pytest.approx(40)
    sizes = torch.tensor([len(mb) for mb in s], dtype=torch.float64)
    mean, sd = 2000 * s.sample_rate, math.sqrt(2000 * s.sample_rate * (1 - s.sample_rate))
    assert abs(sizes.mean().item() - mean) < 5 * sd / math.sqrt(len(sizes))
    assert abs(sizes.std().item() - sd) < 0.25 * sd
    assert is_poisson(s) and not is_poisson(s.per_step())


def test_micro_batches_are_independent_not_a_partition():
    """Within a step, |mb1 & mb2| has mean D p^2 (independent draws), not 0 (a partition) nor D p (the same draw)."""
    d, p = 60, 0.3
    s = MicroBatchSampler(d, micro_batches=2, sample_rate=p, steps=400, generator=torch.Generator().manual_seed(3))
    overlaps = [len(set(a) & set(b)) for a, b in s.iter_steps()]
    mean = sum(overlaps) / len(overlaps)
    sd = math.sqrt(d * p * p * (1 - p * p) / len(overlaps))
    assert abs(mean - d * p * p) < 5 * sd
    # each index's inclusion frequency is p
    counts = torch.zeros(d)
    for mb in s:
        counts[mb] += 1
    assert abs(counts.mean().item() / len(s) - p) < 5 * math.sqrt(p * (1 - p) / (d * len(s)))


def test_seeding_and_per_step_concatenation():
    def draw(seed):
        return list(MicroBatchSampler(100, 3, sample_rate=0.05, steps=7, generator=torch.Generator().manual_seed(seed)))

    assert draw(1) == draw(1) and draw(1) != draw(2)
    s = MicroBatchSampler(100, 3, sample_rate=0.05, steps=7, generator=torch.Generator().manual_seed(1))
    steps = list(MicroBatchSampler(100, 3, sample_rate=0.05, steps=7,
                                   generator=torch.Generator().manual_seed(1)).iter_steps())
    assert len(steps) == 7 and all(len(st) == 3 for st in steps)
    cat = list(s.per_step())
    assert len(cat) == 7 and cat == [[i for mb in st for i in mb] for st in steps]


def test_empty_micro_batches_and_loader():
    ds = TensorDataset(torch.randn(30, 4), torch.arange(30))
    loader = micro_batch_loader(ds, micro_batches=8, sample_rate=0.01, steps=5,
                                generator=torch.Generator().manual_seed(0))
    batches = list(loader)
    assert len(batches) == 40
    assert any(b[0].shape[0] == 0 for b in batches)  # empty micro-batches are yielded, shaped (0, 4)
    assert all(b[0].shape[1:] == (4,) for b in batches)
    per_step = micro_batch_loader(ds, micro_batches=8, sample_rate=0.01, steps=5, per_step=True,
                                  generator=torch.Generator().manual_seed(0))
    assert len(list(per_step)) == 5


def test_bad_arguments():
    with pytest.raises(ValueError, match="exactly one of sample_rate"):
        MicroBatchSampler(10, 2)
    with pytest.raises(ValueError, match="exactly one of sample_rate"):
        MicroBatchSampler(10, 2, sample_rate=0.1, batch_size=2)
    with pytest.raises(ValueError, match="exceeds micro_batches"):
        MicroBatchSampler(10, 2, batch_size=21)
    with pytest.raises(ValueError, match="micro_batches"):
        MicroBatchSampler(10, 0, batch_size=2)
    with pytest.raises(ValueError, match="secure_mode"):
        MicroBatchSampler(10, 2, batch_size=2, generator=torch.Generator(), secure_mode=True)
    assert len(list(MicroBatchSampler(10, 2, batch_size=2, steps=3, secure_mode=True))) == 6
