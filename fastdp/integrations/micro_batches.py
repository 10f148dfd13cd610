"""Poisson logical batches split into a fixed number of micro-batches: :class:`PoissonMicroBatchSampler`.

Frameworks that count micro-batches per optimizer step (the Hugging Face ``Trainer``'s
``gradient_accumulation_steps``) need every logical batch to arrive as the same number of index lists; this batch
sampler draws each logical batch by Poisson sampling, exactly as :class:`fastdp.data.PoissonSampler`, and cuts it
into that many parts. No framework is imported here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import ClassVar

import torch
from torch.utils.data import Sampler

__all__ = ["PoissonMicroBatchSampler"]

_SEED_MIX = 0x9E3779B97F4A7C15


class PoissonMicroBatchSampler(Sampler[list[int]]):
    """Poisson logical batches, each split into ``micro_batches`` consecutive micro-batches (a batch sampler).

    For each of ``steps`` logical steps per pass, draws ``{i in [0, sample_size) : u_i < q}`` with
    ``u ~ U[0, 1)^sample_size`` in float64, ``q = batch_size / sample_size`` (as :class:`fastdp.data.PoissonSampler`),
    and yields it as ``micro_batches`` index lists: the sorted indices cut into parts whose sizes differ by at most
    one (the first ``|batch| mod micro_batches`` parts one longer; parts may be empty). ``len(sampler)`` is
    ``steps * micro_batches`` index lists.

    The draws of pass ``e`` come from a generator seeded with ``(seed + e * 0x9E3779B97F4A7C15) mod 2^63``, ``e``
    given by ``epoch_fn()`` when the pass starts (default: passes started so far), so a pass can be replayed
    exactly (resuming mid-epoch re-draws the epoch's batches and skips the ones already trained). Keep ``seed``
    secret (the privacy analysis assumes the batches' membership is unknown).
    """

    #: marks the batch sampler as Poisson for :func:`fastdp.data.is_poisson`
    fastdp_poisson: ClassVar[bool] = True

    def __init__(self, sample_size: int, batch_size: int, micro_batches: int, steps: int, seed: int,
                 epoch_fn: Callable[[], int] | None = None) -> None:
        for name, v in (("sample_size", sample_size), ("batch_size", batch_size), ("micro_batches", micro_batches),
                        ("steps", steps)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if batch_size > sample_size:
            raise ValueError(f"the expected logical batch size {batch_size} is larger than the {sample_size} training "
                             "examples: the sample rate batch_size / sample_size must be at most 1")
        self.sample_size, self.batch_size, self.micro_batches, self.steps = (sample_size, batch_size,
                                                                             micro_batches, steps)
        self.sample_rate = batch_size / sample_size
        self.seed = int(seed)
        self.epoch_fn = epoch_fn
        self._passes = 0

    def __len__(self) -> int:
        return self.steps * self.micro_batches

    def generator(self, epoch: int) -> torch.Generator:
        """The generator of pass ``epoch``."""
        return torch.Generator().manual_seed((self.seed + epoch * _SEED_MIX) % 2**63)

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch_fn() if self.epoch_fn is not None else self._passes
        self._passes += 1
        return self._draw(self.generator(epoch))

    def _draw(self, gen: torch.Generator) -> Iterator[list[int]]:
        k = self.micro_batches
        for _ in range(self.steps):
            batch = (torch.rand(self.sample_size, generator=gen, dtype=torch.float64) < self.sample_rate)
            idx = batch.nonzero().flatten().tolist()
            base, extra = divmod(len(idx), k)
            start = 0
            for j in range(k):
                stop = start + base + (j < extra)
                yield idx[start:stop]
                start = stop
