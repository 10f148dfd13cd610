r"""Algorithm 1's micro-batches: every step draws ``M`` micro-batches, each an independent Poisson sample.

Micro-batch ``m`` of step ``t`` is ``{i in [0, D) : u_{t,m,i} < p}`` with all ``u`` i.i.d. ``U[0, 1)``: a record can be
in several micro-batches of one step (independently, each time with probability ``p``). The paper sets
``p = B / (M D)`` for an expected ``B`` records per step; one epoch in expectation is ``T = D / B`` steps.

How to consume them (either way the released rows, hence the guarantee, are the same, because the noise of
:class:`~fastdp.dpfp.RepresentationNoise` is drawn per sample, independently of the rest of the batch):

* ``M`` forwards per step, accumulating gradients, one optimizer step (or one optimizer step per micro-batch, as
  Algorithm 1's line 7 is written): iterate :class:`MicroBatchSampler` directly (``len = T M`` micro-batches);
* one forward on the concatenation of the step's ``M`` micro-batches: :meth:`MicroBatchSampler.per_step` (a record
  drawn twice appears twice, with independent noise). That sampler is not itself a Poisson sample of rate ``M p``
  (duplicates are possible), so it is not marked Poisson: do not hand it to :class:`fastdp.PrivacyEngine`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from fastdp.data import EmptyBatchCollate, PoissonSampler, _check_positive_int

__all__ = ["MicroBatchSampler", "StepSampler", "micro_batch_loader"]


class MicroBatchSampler(PoissonSampler):
    """A batch sampler yielding the ``T M`` micro-batches of DP-FP, each a Poisson sample of rate ``p``.

    Args:
        sample_size: ``D``, the number of records.
        micro_batches: ``M >= 1`` micro-batches per step.
        sample_rate: ``p`` in (0, 1], the rate of each micro-batch; or
        batch_size: ``B``, the expected records per step, so that ``p = B / (M D)``. Give exactly one.
        steps: ``T``, the number of steps per pass; default ``round(D / B)`` (one epoch in expectation,
            ``T M p = 1``).
        generator, secure_mode: as :class:`fastdp.data.PoissonSampler` (seeded generator, or OS CSPRNG batches).

    Attributes: ``micro_batches`` (M), ``num_steps`` (T), ``sample_rate`` (p), ``sample_size`` (D); ``steps`` and
    ``len()`` count micro-batches (``T M``), as for any batch sampler. Marked Poisson (:func:`fastdp.data.is_poisson`).
    """

    fastdp_poisson: ClassVar[bool] = True

    def __init__(self, sample_size: int, micro_batches: int, sample_rate: float | None = None,
                 batch_size: int | None = None, steps: int | None = None,
                 generator: torch.Generator | None = None, secure_mode: bool = False) -> None:
        d = _check_positive_int("sample_size", sample_size)
        m = _check_positive_int("micro_batches", micro_batches)
        if (sample_rate is None) == (batch_size is None):
            raise ValueError(f"give exactly one of sample_rate={sample_rate!r} (p, per micro-batch) and "
                             f"batch_size={batch_size!r} (B, expected records per step; p = B / (M D))")
        if batch_size is not None:
            b = _check_positive_int("batch_size", batch_size)
            if b > m * d:
                raise ValueError(f"batch_size={b} exceeds micro_batches * sample_size = {m * d}; p = B / (M D) "
                                 "must be <= 1")
            sample_rate = b / (m * d)
        t = max(1, round(1.0 / (m * sample_rate))) if steps is None else _check_positive_int("steps", steps)
        super().__init__(d, sample_rate=sample_rate, steps=t * m, generator=generator, secure_mode=secure_mode)
        self.micro_batches = m
        self.num_steps = t

    @property
    def expected_step_size(self) -> float:
        """``M D p``, the expected number of records per step (``B``)."""
        return self.micro_batches * self.sample_size * self.sample_rate

    def iter_steps(self) -> Iterator[list[list[int]]]:
        """The same draws grouped by step: ``T`` lists of ``M`` micro-batches (index lists)."""
        step: list[list[int]] = []
        for mb in self:
            step.append(mb)
            if len(step) == self.micro_batches:
                yield step
                step = []

    def per_step(self) -> StepSampler:
        """A batch sampler yielding, per step, the concatenation of its ``M`` micro-batches (for one forward)."""
        return StepSampler(self)

    def __repr__(self) -> str:
        return (f"MicroBatchSampler(sample_size={self.sample_size}, micro_batches={self.micro_batches}, "
                f"sample_rate={self.sample_rate:g}, num_steps={self.num_steps}, secure_mode={self.secure_mode})")


class StepSampler(Sampler[list[int]]):
    """Per step, the concatenated index list of the ``M`` micro-batches of a :class:`MicroBatchSampler` (``len = T``).
    Not marked Poisson (a record may appear more than once)."""

    fastdp_poisson: ClassVar[bool] = False

    def __init__(self, micro: MicroBatchSampler) -> None:
        self.micro = micro

    def __len__(self) -> int:
        return self.micro.num_steps

    def __iter__(self) -> Iterator[list[int]]:
        for step in self.micro.iter_steps():
            yield [i for mb in step for i in mb]


def micro_batch_loader(dataset: Dataset, micro_batches: int, batch_size: int | None = None, *,
                       sample_rate: float | None = None, steps: int | None = None,
                       generator: torch.Generator | None = None, secure_mode: bool = False,
                       per_step: bool = False, **loader_kwargs: Any) -> DataLoader:
    """A ``DataLoader`` over ``dataset`` drawing DP-FP micro-batches (``per_step=False``: ``T M`` batches) or their
    per-step concatenations (``per_step=True``: ``T`` batches). Empty draws give empty batches
    (:class:`fastdp.data.EmptyBatchCollate`). ``loader_kwargs`` go to ``DataLoader`` (``collate_fn``, ...)."""
    n = len(dataset)  # type: ignore[arg-type]
    micro = MicroBatchSampler(n, micro_batches, sample_rate=sample_rate, batch_size=batch_size, steps=steps,
                              generator=generator, secure_mode=secure_mode)
    collate = EmptyBatchCollate(loader_kwargs.pop("collate_fn", None), dataset)
    sampler: Sampler[list[int]] = micro.per_step() if per_step else micro
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, **loader_kwargs)
