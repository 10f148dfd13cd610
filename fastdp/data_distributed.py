"""Distributed Poisson sampling: each of ``world_size`` ranks draws the part of a Poisson batch that falls in its shard.

The privacy accounting of a distributed run is that of one Poisson-subsampled Gaussian mechanism over the whole
data set: at every logical step each of the ``n = sample_size`` examples joins the (global) batch independently with
probability ``q = batch_size / sample_size``, ``batch_size`` and ``sample_size`` being GLOBAL. This module splits
that sampling over the ranks:

* the examples are partitioned among the ranks, strided: rank ``r`` of ``W`` owns ``P_r = {i in [0, n) : i mod W =
  r}`` (disjoint, covering ``range(n)``; a rank owns ``ceil((n - r) / W)`` examples, none when ``r >= n``);
* at every step rank ``r`` yields ``{i in P_r : u_i < q}``. Each example of ``P_r`` is included independently with
  probability ``q``, and the partitions are disjoint, so the union over ranks includes every example of
  ``range(n)`` independently with probability ``q``: it is a Poisson sample of the whole data set, whatever the
  relation between the ranks' random streams (shared or independent), because no example is drawn by two ranks.

Two ways to seed, both correct:

* **shared seed** (e.g. ``torch.manual_seed(s)`` on every rank, or generators seeded alike): every rank draws the
  same ``u ~ U[0, 1)^n`` (float64, as :class:`fastdp.data.PoissonSampler` does) and keeps its own part; the union is
  then exactly the batch :class:`~fastdp.data.PoissonSampler` yields for that seed, so a distributed run reproduces
  the batches of a one-process run (and every rank knows the whole batch's membership, which it never uses);
* **independent streams** (seeds that differ per rank, or ``secure_mode=True``): the ranks' parts are independent;
  the union is still a Poisson sample (each ``u_i`` is read by exactly one rank).

See docs/guide/data.md (distributed Poisson sampling) and docs/reference/data.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import torch
from torch.utils.data import Sampler

from fastdp.noise import secure_generator

logger = logging.getLogger(__name__)


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r} must be an int (got {type(value).__name__})")
    return int(value)


def _resolve_rank(rank: Any, world_size: Any, process_group: Any) -> tuple[int, int, bool]:
    """``(rank, world_size, from_torch_distributed)``: the explicit pair, or the process group's."""
    if rank is None and world_size is None:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("rank=None and world_size=None: DistributedPoissonSampler takes them from "
                             "torch.distributed, whose default process group is not initialised. Call "
                             "torch.distributed.init_process_group(...) first, or pass rank=... and world_size=... "
                             "(use fastdp.data.PoissonSampler for a single process)")
        return dist.get_rank(process_group), dist.get_world_size(process_group), True
    if rank is None or world_size is None:
        raise ValueError(f"give both rank and world_size, or neither (then they come from torch.distributed); got "
                         f"rank={rank!r}, world_size={world_size!r}")
    if process_group is not None:
        raise ValueError("process_group= selects where rank and world_size come from; it cannot be combined with "
                         "an explicit rank= and world_size=")
    world_size = _check_int("world_size", world_size)
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1 (the number of ranks sharing the sampling)")
    rank = _check_int("rank", rank)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size}); ranks are numbered 0 .. "
                         f"world_size - 1 (torch.distributed.get_rank())")
    return rank, world_size, False


class DistributedPoissonSampler(Sampler[list[int]]):
    """Poisson sampling over ``world_size`` ranks: this rank's part of a Poisson batch of the whole data set.

    Rank ``r`` owns the examples ``partition = range(r, sample_size, world_size)``; every batch it yields is
    ``{i in partition : u_i < q}`` in increasing order, with ``q = batch_size / sample_size`` (both GLOBAL: the
    expected batch over all ranks, the whole data set) and ``u ~ U[0, 1)^sample_size`` drawn fresh per step in
    float64. Each rank's batch size is ``Binomial(len(partition), q)``, so sizes differ between ranks and steps, and
    are 0 at every step on a rank with an empty partition (``world_size > sample_size``). The union over the ranks
    is a Poisson sample of ``range(sample_size)`` (each example included independently with probability ``q``), and
    with a shared seed it equals :class:`fastdp.data.PoissonSampler`'s batch for that seed (see the module
    docstring). Use it as a DataLoader's ``batch_sampler`` (or through ``poisson_loader(..., distributed=True)``).

    Args:
        sample_size: ``n``, the number of examples of the whole data set (global); every rank's dataset holds all
            ``n`` (indices are global).
        sample_rate: ``q`` in (0, 1].
        batch_size: the GLOBAL expected batch size; ``q = batch_size / sample_size``. Give exactly one of the two.
        steps: batches per pass (``len(sampler)``, the same on every rank); default ``round(1 / q)`` (at least 1).
        generator: a CPU ``torch.Generator`` (reproducible batches; a second pass continues its stream). It draws
            ``n`` uniforms per step on every rank, so generators seeded alike on all ranks stay in step and give
            the one-process batches. Default: a generator seeded from torch's global RNG at the start of each pass
            (so ``torch.manual_seed(s)`` on every rank reproduces the one-process run with seed ``s``).
        secure_mode: every step draws this rank's uniforms from a fresh generator seeded by the OS CSPRNG
            (:func:`fastdp.noise.secure_generator`), independent between ranks and steps; not reproducible; refuses
            ``generator``.
        rank, world_size: this rank and the number of ranks; give both, or neither (then
            ``torch.distributed.get_rank(process_group)`` and ``get_world_size(process_group)``, which needs an
            initialised process group). ``0 <= rank < world_size``; ``world_size > sample_size`` is allowed
            (ranks ``>= sample_size`` own no example and yield only empty batches).
        process_group: the group to take rank and world size from (default: the default group).
        verify: when rank and world size come from torch.distributed, check at construction (one
            ``all_gather_object`` over the group, so every rank must construct the sampler) that all ranks agree on
            ``sample_size``, ``q``, ``steps`` and ``secure_mode``; a difference raises ``ValueError`` on every rank,
            naming it. ``False`` skips the check. (Under NCCL, object collectives run on
            ``torch.cuda.current_device()``: call ``torch.cuda.set_device(local_rank)`` first, as torch requires.)

    Resuming: the sampler keeps no state of its own. To resume mid-run with the same batches, pass a ``generator``
    and checkpoint ``generator.get_state()`` (restore it with ``generator.set_state``); with the default generator a
    new pass starts from torch's global RNG, so restoring that (``torch.get_rng_state`` / ``set_rng_state``) before
    the pass reproduces it.

    Attributes ``sample_size``, ``sample_rate``, ``steps``, ``secure_mode``, ``rank``, ``world_size`` and
    ``partition`` (a ``range``) hold the resolved values.
    """

    #: marks the batch sampler as Poisson for :func:`fastdp.data.is_poisson`.
    fastdp_poisson: ClassVar[bool] = True

    def __init__(self, sample_size: int, sample_rate: float | None = None, batch_size: int | None = None,
                 steps: int | None = None, generator: torch.Generator | None = None, secure_mode: bool = False, *,
                 rank: int | None = None, world_size: int | None = None, process_group: Any = None,
                 verify: bool = True) -> None:
        from fastdp.data import _init_sampler  # fastdp.data imports this module

        _init_sampler(self, sample_size, sample_rate, batch_size, steps, generator, secure_mode)
        self.rank, self.world_size, from_dist = _resolve_rank(rank, world_size, process_group)
        #: the global indices this rank samples from
        self.partition = range(self.rank, self.sample_size, self.world_size)
        if from_dist and verify:
            self._verify(process_group)
        logger.debug("%r", self)

    def _verify(self, process_group: Any) -> None:
        """All ranks of the group hold the same sampling configuration, else ``ValueError`` on every rank."""
        mine = {"sample_size": self.sample_size, "sample_rate": self.sample_rate, "steps": self.steps,
                "secure_mode": self.secure_mode}
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, mine, group=process_group)
        diffs = [f"rank {r}: {key}={theirs[key]!r} but rank 0: {key}={gathered[0][key]!r}"
                 for r, theirs in enumerate(gathered) for key in mine if theirs[key] != gathered[0][key]]
        if diffs:
            raise ValueError("the ranks' DistributedPoissonSampler arguments differ (" + "; ".join(diffs) + "); "
                             "build it with the same global sample_size, batch_size/sample_rate, steps and "
                             "secure_mode on every rank, or the union over ranks is not the Poisson sample the "
                             "accountant assumes")

    @property
    def expected_batch_size(self) -> float:
        """The GLOBAL expected batch size ``sample_size * sample_rate`` (summed over the ranks)."""
        return self.sample_size * self.sample_rate

    @property
    def expected_local_batch_size(self) -> float:
        """This rank's expected batch size ``len(partition) * sample_rate``."""
        return len(self.partition) * self.sample_rate

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        n, q, start, stride = self.sample_size, self.sample_rate, self.rank, self.world_size
        if self.secure_mode:
            # independent between ranks anyway: draw only this rank's uniforms
            m = len(self.partition)
            for _ in range(self.steps):
                u = torch.rand(m, generator=secure_generator("cpu"), dtype=torch.float64)
                yield ((u < q).nonzero().flatten() * stride + start).tolist()
            return
        gen = self.generator
        if gen is None:
            gen = torch.Generator()
            gen.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        for _ in range(self.steps):
            u = torch.rand(n, generator=gen, dtype=torch.float64)  # all n, so shared seeds stay in step
            yield ((u[start::stride] < q).nonzero().flatten() * stride + start).tolist()

    def __repr__(self) -> str:
        return (f"DistributedPoissonSampler(sample_size={self.sample_size}, sample_rate={self.sample_rate:g}, "
                f"steps={self.steps}, secure_mode={self.secure_mode}, rank={self.rank}, "
                f"world_size={self.world_size})")


__all__ = ["DistributedPoissonSampler"]


def _batch_sampler(sample_size: int, *, sample_rate: float | None, batch_size: int | None, steps: int | None,
                   generator: torch.Generator | None, secure_mode: bool, distributed: bool | None,
                   rank: int | None, world_size: int | None, process_group: Any,
                   previous: Any = None) -> Sampler[list[int]]:
    """The batch sampler :func:`fastdp.data.poisson_loader` installs: a :class:`~fastdp.data.PoissonSampler`, or a
    :class:`DistributedPoissonSampler` when ``distributed`` is true, when ``rank``/``world_size``/``process_group``
    is given, when ``previous`` (the rebuilt loader's batch sampler) is one (its rank and world size are kept), or,
    with ``distributed=None``, when torch.distributed's default process group is initialised (as the engine)."""
    from fastdp.data import PoissonSampler

    explicit = rank is not None or world_size is not None or process_group is not None
    if distributed is False:
        if explicit:
            raise ValueError(f"distributed=False contradicts rank={rank!r}, world_size={world_size!r}, "
                             f"process_group={process_group!r}: drop them, or pass distributed=True")
        return PoissonSampler(sample_size, sample_rate=sample_rate, batch_size=batch_size, steps=steps,
                              generator=generator, secure_mode=secure_mode)
    if not explicit and isinstance(previous, DistributedPoissonSampler):
        rank, world_size = previous.rank, previous.world_size
    elif distributed is None and not explicit:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return PoissonSampler(sample_size, sample_rate=sample_rate, batch_size=batch_size, steps=steps,
                                  generator=generator, secure_mode=secure_mode)
        logger.info("poisson_loader: torch.distributed is initialised, sampling this rank's part of the global "
                    "Poisson batch (DistributedPoissonSampler); pass distributed=False for independent loaders")
    return DistributedPoissonSampler(sample_size, sample_rate=sample_rate, batch_size=batch_size, steps=steps,
                                     generator=generator, secure_mode=secure_mode, rank=rank, world_size=world_size,
                                     process_group=process_group)
