"""Data side of private training: Poisson sampling, empty-batch-safe collation, virtual batches.

The accountants (:mod:`fastdp.accounting`) bound the privacy of the *Poisson-subsampled* Gaussian mechanism: at every
step each of the ``n = sample_size`` examples joins the batch independently with probability ``q``. This module
provides exactly that sampling:

* :class:`PoissonSampler`: a batch sampler yielding index lists ``{i : u_i < q}`` with ``u_i ~ U[0, 1)`` fresh per
  step, so the batch size is ``Binomial(n, q)`` (mean ``n q``, variance ``n q (1 - q)``) and may be 0;
* :func:`poisson_loader`: a ``DataLoader`` over a dataset (or rebuilt from an existing loader) driven by it, whose
  collate function turns an empty index list into an empty batch (:class:`EmptyBatchCollate`);
* :func:`is_poisson`: whether a loader (or batch sampler) samples this way;
* :class:`VirtualBatches`: split one logical batch into physical micro-batches that fit in memory;
* :class:`DistributedPoissonSampler` (in :mod:`fastdp.data_distributed`): each rank's part of a Poisson batch.

See docs/guide/data.md and docs/reference/data.md.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    default_collate,
)

from fastdp.data_distributed import DistributedPoissonSampler, _batch_sampler
from fastdp.noise import secure_generator

logger = logging.getLogger(__name__)


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return int(value)


def _init_sampler(sampler: Any, sample_size: int, sample_rate: float | None, batch_size: int | None,
                  steps: int | None, generator: torch.Generator | None, secure_mode: bool) -> None:
    """The checked settings both Poisson samplers share: ``sample_size``, ``sample_rate`` (from ``batch_size`` if
    given), ``steps`` (default ``round(1 / q)``), ``generator``, ``secure_mode``."""
    sampler.sample_size = _check_positive_int("sample_size", sample_size)
    sampler.sample_rate = _resolve_rate(sampler.sample_size, sample_rate, batch_size)
    sampler.steps = (max(1, round(1.0 / sampler.sample_rate)) if steps is None
                     else _check_positive_int("steps", steps))
    _check_generator(generator, secure_mode)
    sampler.generator = generator
    sampler.secure_mode = bool(secure_mode)


def _check_generator(generator: Any, secure_mode: bool) -> None:
    """A sampler's ``generator``: ``None``, or a CPU ``torch.Generator`` without ``secure_mode``."""
    if generator is None:
        return
    if secure_mode:
        raise ValueError("secure_mode=True draws every batch from the OS CSPRNG and refuses a seeded "
                         "generator (a known seed makes the batches predictable); pass generator=None")
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if generator.device.type != "cpu":
        raise ValueError(f"generator is on device {generator.device}; the sampler draws on CPU: "
                         "use torch.Generator() (CPU)")


def _resolve_rate(sample_size: int, sample_rate: float | None, batch_size: int | None) -> float:
    """``q`` from exactly one of ``sample_rate`` and ``batch_size`` (``q = batch_size / sample_size``)."""
    if (sample_rate is None) == (batch_size is None):
        raise ValueError(f"give exactly one of sample_rate={sample_rate!r} and batch_size={batch_size!r} "
                         "(the expected batch size; q = batch_size / sample_size)")
    if batch_size is not None:
        batch_size = _check_positive_int("batch_size", batch_size)
        if batch_size > sample_size:
            raise ValueError(f"batch_size={batch_size} is larger than sample_size={sample_size}; the sample rate "
                             "batch_size / sample_size must be in (0, 1]")
        return batch_size / sample_size
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate={sample_rate!r} must be a number in (0, 1]")
    return float(sample_rate)


class PoissonSampler(Sampler[list[int]]):
    """Poisson sampling: each of ``sample_size`` examples joins each batch independently with probability ``q``.

    Use it as a DataLoader's ``batch_sampler`` (or through :func:`poisson_loader`). Every batch is the index list
    ``{i in [0, sample_size) : u_i < q}``, ``u ~ U[0, 1)^sample_size`` drawn in float64 (so ``q`` is resolved to
    ``2^-53``), in increasing order. The batch size is ``Binomial(sample_size, q)``; **empty batches are yielded**
    (with probability ``(1 - q)^sample_size`` each): under Poisson sampling they are ordinary steps that still add
    noise and are accounted.

    Args:
        sample_size: ``n``, the number of examples; indices are drawn from ``range(n)``.
        sample_rate: ``q`` in (0, 1].
        batch_size: the expected batch size; ``q = batch_size / sample_size``. Give exactly one of the two.
        steps: batches per pass over the sampler (``len(sampler)``); default ``round(1 / q)`` (at least 1), one
            "epoch" in expectation. The accountant counts steps, not epochs.
        generator: a CPU ``torch.Generator`` to draw from (reproducible batches; iterating again continues its
            stream). Default: a generator seeded from torch's global RNG at the start of each pass, so
            ``torch.manual_seed`` makes the batches reproducible.
        secure_mode: draw every batch from a fresh generator whose state comes from the OS CSPRNG
            (:func:`fastdp.noise.secure_generator`); batches are then not reproducible. Refuses ``generator``.

    Attributes ``sample_size``, ``sample_rate``, ``steps`` and ``secure_mode`` hold the resolved values.
    """

    #: marks a batch sampler as Poisson for :func:`is_poisson`; other samplers may set it to declare the same.
    fastdp_poisson: ClassVar[bool] = True

    def __init__(self, sample_size: int, sample_rate: float | None = None, batch_size: int | None = None,
                 steps: int | None = None, generator: torch.Generator | None = None,
                 secure_mode: bool = False) -> None:
        _init_sampler(self, sample_size, sample_rate, batch_size, steps, generator, secure_mode)

    @property
    def expected_batch_size(self) -> float:
        """``sample_size * sample_rate``."""
        return self.sample_size * self.sample_rate

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        gen = self.generator
        if gen is None and not self.secure_mode:
            gen = torch.Generator()
            gen.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        for _ in range(self.steps):
            g = secure_generator("cpu") if self.secure_mode else gen
            mask = torch.rand(self.sample_size, generator=g, dtype=torch.float64) < self.sample_rate
            yield mask.nonzero().flatten().tolist()

    def __repr__(self) -> str:
        return (f"PoissonSampler(sample_size={self.sample_size}, sample_rate={self.sample_rate:g}, "
                f"steps={self.steps}, secure_mode={self.secure_mode})")


def is_poisson(loader_or_sampler: Any) -> bool:
    """Whether batches come from Poisson sampling.

    True for a ``DataLoader`` whose ``batch_sampler`` is marked Poisson (class attribute ``fastdp_poisson = True``,
    as :class:`PoissonSampler` has), or for such a sampler itself. A loader with ``batch_size`` set
    (shuffle-and-split, fixed-size batches) is not Poisson.
    """
    sampler = loader_or_sampler.batch_sampler if isinstance(loader_or_sampler, DataLoader) else loader_or_sampler
    return getattr(type(sampler), "fastdp_poisson", False) is True


# -------------------------------------------------------------------------------------------- empty batches
def _empty_like(obj: Any, path: str) -> Any:
    """A batch of size 0 with the structure of ``obj``, a collated batch (batch dimension 0 on every tensor)."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            raise TypeError(f"{path} is a 0-dimensional tensor, which has no batch dimension to make empty")
        return obj.new_empty((0, *obj.shape[1:]))
    if isinstance(obj, np.ndarray):
        if obj.ndim == 0:
            raise TypeError(f"{path} is a 0-dimensional array, which has no batch dimension to make empty")
        return np.empty((0, *obj.shape[1:]), dtype=obj.dtype)
    if isinstance(obj, Mapping):
        items = {k: _empty_like(v, f"{path}[{k!r}]") for k, v in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_empty_like(v, f"{path}.{f}") for f, v in zip(obj._fields, obj, strict=True)))
    if isinstance(obj, (list, tuple)):
        if obj and all(isinstance(v, (str, bytes)) for v in obj):
            return type(obj)()  # default_collate keeps strings as a list over the batch
        return type(obj)(_empty_like(v, f"{path}[{i}]") for i, v in enumerate(obj))
    raise TypeError(f"cannot build an empty batch for {path} of type {type(obj).__name__}: only tensors, numpy "
                    "arrays, lists of strings and containers (dict, tuple, list) of them are supported. Make the "
                    "collate function return tensors, or pass empty_batch=<callable returning the empty batch>")


class EmptyBatchCollate:
    """A collate function that also handles the empty batch of Poisson sampling.

    For a non-empty list of samples it returns ``collate_fn(samples)``. For an empty list it returns the structure
    of ``collate_fn([dataset[example_index]])`` with every tensor (and numpy array) replaced by an empty one of
    shape ``(0, *shape[1:])`` and the same dtype, e.g. ``(images (0, 3, 32, 32) float32, labels (0,) int64)`` for a
    dataset of ``(tensor(3, 32, 32), int)`` pairs; sequences of strings become empty ones. So the empty batch has the
    non-batch shape of ``dataset[0]``: for variable-shape data (sequences of different lengths) that is the shape of
    example 0 (reading it touches no other example and releases nothing but shapes and dtypes). ``empty_batch``, a
    callable with no argument, overrides all this.

    Picklable when ``collate_fn`` and ``dataset`` are (needed by DataLoader workers under the "spawn" start method).
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None = None, dataset: Any = None,
                 empty_batch: Callable[[], Any] | None = None, example_index: int = 0) -> None:
        if isinstance(collate_fn, EmptyBatchCollate):
            collate_fn = collate_fn.collate_fn
        self.collate_fn = default_collate if collate_fn is None else collate_fn
        if dataset is None and empty_batch is None:
            raise ValueError("EmptyBatchCollate needs the dataset (to read the shapes of an example) or an "
                             "empty_batch callable")
        self.dataset = dataset
        self.empty_batch = empty_batch
        self.example_index = example_index

    def __call__(self, samples: list[Any]) -> Any:
        if len(samples) > 0:
            return self.collate_fn(samples)
        if self.empty_batch is not None:
            return self.empty_batch()
        return _empty_like(self.collate_fn([self.dataset[self.example_index]]), "the collated batch")


# ------------------------------------------------------------------------------------------------- loader
#: DataLoader arguments copied from an existing loader by :func:`poisson_loader`.
_COPIED = ("num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context", "prefetch_factor",
           "persistent_workers", "pin_memory_device", "in_order")
_REFUSED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


def _check_loader_sampler(loader: DataLoader) -> None:
    """Refuse loaders whose sampling would be silently discarded (weighted, subset, distributed, custom)."""
    bs = loader.batch_sampler
    if is_poisson(bs):
        return
    if type(bs) is BatchSampler:
        s = bs.sampler
        if type(s) is SequentialSampler:
            return
        if type(s) is RandomSampler and not s.replacement and s._num_samples is None:
            return
        what = f"sampler {type(s).__name__}"
    else:
        what = f"batch_sampler {type(bs).__name__}"
    raise ValueError(f"the loader's {what} would be replaced by Poisson sampling over the whole dataset, which is "
                     "what the privacy accounting assumes; its own sampling (weights, a subset, sharding) would be "
                     "lost. Pass the dataset to sample from instead (e.g. torch.utils.data.Subset for a subset); "
                     "for sharding over ranks, poisson_loader(dataset, ..., distributed=True)")


def poisson_loader(data: Dataset | DataLoader, batch_size: int | None = None, sample_size: int | None = None, *,
                   sample_rate: float | None = None, steps: int | None = None,
                   generator: torch.Generator | None = None, secure_mode: bool = False,
                   empty_batch: Callable[[], Any] | None = None, distributed: bool | None = None,
                   rank: int | None = None, world_size: int | None = None, process_group: Any = None,
                   **loader_kwargs: Any) -> DataLoader:
    """A ``DataLoader`` drawing batches by Poisson sampling (:class:`PoissonSampler`) from a map-style dataset.

    Args:
        data: a map-style ``Dataset``, or a ``DataLoader`` over one. From a loader, its ``collate_fn`` (wrapped,
            see below), ``num_workers``, ``pin_memory``, ``timeout``, ``worker_init_fn``,
            ``multiprocessing_context``, ``prefetch_factor``, ``persistent_workers``, ``pin_memory_device`` and
            ``in_order`` are kept, and its ``generator`` is used for sampling if ``generator`` is not given (and not
            ``secure_mode``). Its sampler must be the plain sequential or shuffling one: a weighted, subset,
            distributed or custom sampler raises ``ValueError`` (it would be silently discarded). Its ``drop_last``
            is ignored with a warning.
        batch_size: the expected batch size ``B``; ``q = B / sample_size``. Default: the loader's ``batch_size``.
        sample_size: ``n``; default ``len(dataset)`` (must equal it when both are known).
        sample_rate: ``q``, instead of ``batch_size``.
        steps, generator, secure_mode: as in :class:`PoissonSampler`.
        empty_batch: a callable returning the batch for an empty index list (see :class:`EmptyBatchCollate`).
        distributed, rank, world_size, process_group: sample this rank's part of the global Poisson batch with a
            :class:`~fastdp.data_distributed.DistributedPoissonSampler` (``batch_size``/``sample_size`` global) when
            ``distributed=True``, when ``rank``/``world_size``/``process_group`` is given, when ``data``'s batch
            sampler is one, or (``distributed=None``) when torch.distributed is initialised; ``False``: a
            :class:`PoissonSampler` of the whole data set on this process.
        **loader_kwargs: other ``DataLoader`` arguments (``collate_fn``, ``num_workers``, ...); they override the
            ones copied from a loader. ``batch_size``, ``shuffle``, ``sampler``, ``batch_sampler`` and
            ``drop_last`` are refused.

    Returns:
        A ``DataLoader`` with a :class:`PoissonSampler` (or :class:`DistributedPoissonSampler`) as
        ``batch_sampler`` (``len(loader)`` = its ``steps``) and an
        :class:`EmptyBatchCollate` as ``collate_fn``. :func:`is_poisson` is true for it.
    """
    for key in _REFUSED:
        if key in loader_kwargs:
            raise ValueError(f"{key}={loader_kwargs[key]!r} is not allowed: Poisson sampling draws the batches "
                             "(give the expected batch size as batch_size=..., or sample_rate=...)")
    kwargs: dict[str, Any] = {}
    collate_fn = None
    if isinstance(data, DataLoader):
        loader = data
        dataset = loader.dataset
        if isinstance(dataset, IterableDataset):
            raise ValueError("the loader's dataset is an IterableDataset; Poisson sampling needs a map-style dataset "
                             "(indexable, with a known size)")
        _check_loader_sampler(loader)
        if loader.drop_last:
            warnings.warn("the loader's drop_last=True is ignored: Poisson batches have random sizes and none is "
                          "dropped", stacklevel=2)
        if batch_size is None and sample_rate is None:
            if loader.batch_size is None:
                raise ValueError("give batch_size=... (the expected batch size) or sample_rate=...: the loader has "
                                 "no batch_size to take it from")
            batch_size = loader.batch_size
            logger.info("poisson_loader: expected batch size %d taken from the loader", batch_size)
        for key in _COPIED:
            if hasattr(loader, key):
                kwargs[key] = getattr(loader, key)
        collate_fn = loader.collate_fn
        if generator is None and not secure_mode:
            generator = loader.generator
    else:
        dataset = data
        if isinstance(dataset, IterableDataset):
            raise ValueError("the dataset is an IterableDataset; Poisson sampling needs a map-style dataset "
                             "(indexable, with a known size)")
        if batch_size is None and sample_rate is None:
            raise ValueError("give batch_size=... (the expected batch size) or sample_rate=...")
    try:
        n = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        n = None
    if sample_size is None:
        if n is None:
            raise ValueError("the dataset has no len(); give sample_size=... (its number of examples)")
        sample_size = n
    elif n is not None and sample_size != n:
        raise ValueError(f"sample_size={sample_size} differs from len(dataset)={n}; the sampler draws from "
                         "every example of the dataset, so they must be equal (use torch.utils.data.Subset to "
                         "sample from part of it)")
    if loader_kwargs.get("num_workers", kwargs.get("num_workers", 0)) == 0:
        kwargs.pop("prefetch_factor", None)  # DataLoader refuses a prefetch_factor without workers
    kwargs.update(loader_kwargs)
    collate_fn = kwargs.pop("collate_fn", collate_fn)
    sampler = _batch_sampler(sample_size, sample_rate=sample_rate, batch_size=batch_size, steps=steps,
                             generator=generator, secure_mode=secure_mode, distributed=distributed, rank=rank,
                             world_size=world_size, process_group=process_group,
                             previous=data.batch_sampler if isinstance(data, DataLoader) else None)
    collate = EmptyBatchCollate(collate_fn, dataset, empty_batch=empty_batch)
    logger.debug("poisson_loader: %r over %s", sampler, type(dataset).__name__)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, **kwargs)


# ------------------------------------------------------------------------------------------ virtual batches
def _batch_len(obj: Any, path: str) -> int | None:
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            raise ValueError(f"{path} is a 0-dimensional tensor; every tensor of a batch needs the batch as dim 0")
        return obj.shape[0]
    if isinstance(obj, Mapping):
        items = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    else:
        raise ValueError(f"{path} has type {type(obj).__name__}; a batch must be a tensor or a tuple, list or dict "
                         "of tensors (batch dimension 0)")
    size: int | None = None
    first = ""
    for p, v in items:
        s = _batch_len(v, p)
        if s is None:
            continue
        if size is None:
            size, first = s, p
        elif s != size:
            raise ValueError(f"{p} has {s} rows but {first} has {size}; all tensors of a batch must share dim 0")
    return size


def _slice(obj: Any, start: int, stop: int) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj[start:stop]
    if isinstance(obj, Mapping):
        items = {k: _slice(v, start, stop) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_slice(v, start, stop) for v in obj))
    return type(obj)(_slice(v, start, stop) for v in obj)


class VirtualBatches:
    """Split one logical batch into physical micro-batches of at most ``max_physical_batch_size`` rows.

    ``batch`` is a tensor, or a tuple, list or dict (nested allowed) of tensors that all have the batch as dimension 0
    and the same number of rows ``n``. Iterating yields ``ceil(n / m)`` micro-batches with the same structure,
    ``batch[k m : (k + 1) m]`` for ``k = 0, 1, ...`` (views, no copy), covering every row exactly once in order; an
    empty logical batch (``n = 0``) yields one empty micro-batch, so a loop over the micro-batches still reaches the
    optimizer step (a noise-only step under Poisson sampling).

    With the :class:`fastdp.PrivacyEngine`, run forward/backward on each micro-batch (skip the backward of an empty
    one) and call ``optimizer.step()`` once after the loop: the engine clips each sample in its own micro-batch,
    accumulates, and adds noise and counts the step once. ``len()`` is the number of micro-batches.
    """

    def __init__(self, batch: Any, max_physical_batch_size: int) -> None:
        self.max_physical_batch_size = _check_positive_int("max_physical_batch_size", max_physical_batch_size)
        size = _batch_len(batch, "batch")
        if size is None:
            raise ValueError("the batch holds no tensor; give a tensor or a tuple, list or dict of tensors")
        self.batch = batch
        #: ``n``, the number of rows of the logical batch.
        self.batch_size = size

    def __len__(self) -> int:
        return max(1, math.ceil(self.batch_size / self.max_physical_batch_size))

    def __iter__(self) -> Iterator[Any]:
        m = self.max_physical_batch_size
        if self.batch_size == 0:
            yield _slice(self.batch, 0, 0)
            return
        for start in range(0, self.batch_size, m):
            yield _slice(self.batch, start, min(start + m, self.batch_size))


__all__ = ["DistributedPoissonSampler", "EmptyBatchCollate", "PoissonSampler", "VirtualBatches", "is_poisson",
           "poisson_loader"]
