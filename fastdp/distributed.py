"""Data-parallel private training on several processes: the engine's use of ``torch.distributed``.

N processes (ranks) each hold the whole model and a part (shard) of the logical batch. Each rank clips its own
samples exactly as one process would (per-sample norms never leave the rank), and the release stage
(:mod:`fastdp.release`) combines the ranks' clipped sums with one all-reduce per logical step::

    S = sum_{ranks r} sum_{i in shard r} C_i g_i          (all-reduce, bucketed, in plan order)
    p.grad = (S + sigma R xi) / B      on every rank      (xi drawn once, by rank 0, added before the all-reduce)

so every rank releases, bit for bit, the same gradient, equal up to rounding to what one process releases on the
whole batch. ``B = batch_size`` and ``sample_size`` are global. The sum ``S`` crosses ranks once; its size is that
of the trainable parameters in the clipped sums' accumulation dtype (float32, float64 for float64 parameters),
the same bytes as non-private DDP's gradient all-reduce for float32 models.

Before anything is released, the ranks agree: a small header (one ``all_gather`` of a few numbers per rank) carries
each rank's verdict on its own checks, its sample count, step count, noise multiplier and a fingerprint of its
trainable set; if any rank refuses, every rank raises and nothing is released or accounted anywhere. At
construction the ranks check they share the configuration and the trainable set (:meth:`Group.agree`) and rank 0's
parameters and buffers are broadcast (:meth:`Group.broadcast_module`), as ``DistributedDataParallel`` does.

Only ``torch.distributed`` collectives are used; this module is the engine's only caller of them. It may touch: the
model's parameters and buffers at construction (the broadcast), and the tensors the release stage hands it.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: all-reduce bucket size in bytes (DistributedDataParallel's default ``bucket_cap_mb=25``)
BUCKET_BYTES = 25 * 1024 * 1024

T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective of the engine failed (another rank crashed, or did not reach the same call before the process
    group's timeout)."""


def available() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def refuse_wrapped(model: nn.Module) -> None:
    """Refuse a model wrapped for non-private data parallelism: its gradient reduction would never see the private
    gradients (ghost differentiation keeps autograd from computing the weight gradients), and the engine does the
    reduction itself.

    Raises:
        ValueError: ``model`` is a ``DistributedDataParallel``, ``DataParallel`` or FSDP1 wrapper.
    """
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    wrappers: list[type] = [DistributedDataParallel, DataParallel]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        wrappers.append(FullyShardedDataParallel)
    except ImportError:  # pragma: no cover - torch built without distributed
        pass
    for w in wrappers:
        if isinstance(model, w):
            raise ValueError(
                f"the model is wrapped in {w.__name__}: under a PrivacyEngine the non-private gradient reduction "
                "of that wrapper never sees the private gradients, and the engine all-reduces the clipped sums "
                "itself. Pass the unwrapped module on every rank instead: after "
                "torch.distributed.init_process_group(...), build `engine = fastdp.PrivacyEngine(model, ...)` with "
                "the same arguments on every rank (batch_size and sample_size global), feed each rank its part of "
                "the batch (fastdp.data.DistributedPoissonSampler), and call loss.backward(); optimizer.step() as "
                "usual (docs/guide/distributed.md).")


@dataclass(frozen=True)
class StepHeader:
    """What one rank says about the step it is about to release (exchanged by :meth:`Group.exchange_headers`)."""

    refused: bool  # this rank's own checks refused the step
    samples: int  # samples of this rank's backward passes since the last step
    backward_seen: bool  # a backward pass reached the hooks (or an empty step was asked for)
    steps: int  # steps this rank's engine has released
    sigma: float  # this rank's noise multiplier for the step
    trainable: int  # fingerprint of the trainable set (names, shapes, dtypes)
    ledger: int  # fingerprint of the accountant's ledger (every step and release recorded so far)

    def as_list(self) -> list[float]:
        return [float(self.refused), float(self.samples), float(self.backward_seen), float(self.steps),
                self.sigma, float(self.trainable), float(self.ledger)]

    @classmethod
    def from_list(cls, v: Sequence[float]) -> StepHeader:
        return cls(bool(v[0]), int(v[1]), bool(v[2]), int(v[3]), float(v[4]), int(v[5]), int(v[6]))


def describe_differences(per_rank: Sequence[Sequence[Any]], limit: int = 5) -> str:
    """Each rank's items that rank 0 lacks and rank 0's items it lacks, at most ``limit`` of each (lists of
    names or tuples can be long: only the difference is named)."""
    base = set(map(_hashable, per_rank[0]))
    parts = []
    for r, items in enumerate(per_rank[1:], start=1):
        mine = set(map(_hashable, items))
        extra, missing = sorted(mine - base, key=repr), sorted(base - mine, key=repr)
        if extra or missing:
            parts.append(f"rank {r} has {_some(extra, limit)} that rank 0 has not, and lacks "
                         f"{_some(missing, limit)} of rank 0's")
    return "; ".join(parts) or "the same items in another order"


def _some(xs: list[Any], limit: int) -> str:
    if not xs:
        return "nothing"
    return f"{xs[:limit]}" + (f" and {len(xs) - limit} more" if len(xs) > limit else "")


def _hashable(x: Any) -> Any:
    return tuple(_hashable(v) for v in x) if isinstance(x, (list, tuple)) else x


def text_fingerprint(text: str) -> int:
    """crc32 of ``text`` (32 bits: exact in a float64)."""
    return zlib.crc32(text.encode())


def fingerprint(named: dict[str, torch.Tensor]) -> int:
    """A 32-bit fingerprint of parameter names, shapes and dtypes (crc32; exact in a float64)."""
    return text_fingerprint(";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in sorted(named.items())))


class Group:
    """The engine's process group: rank, world size, and the engine's collectives.

    Args:
        process_group: a ``torch.distributed`` process group (``None``: the default group).
    """

    def __init__(self, process_group: Any = None) -> None:
        dist = torch.distributed
        self.pg = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.backend = str(dist.get_backend(process_group))

    @staticmethod
    def resolve(distributed: bool | None, process_group: Any) -> Group | None:
        """The engine's group: ``distributed=None`` uses ``torch.distributed`` when it is initialised.

        Raises:
            ValueError: ``distributed`` not a bool or None; ``distributed=False`` with a ``process_group``.
            RuntimeError: ``distributed=True`` or a ``process_group`` without an initialised process group.
        """
        if distributed is not None and not isinstance(distributed, bool):
            raise ValueError(f"distributed={distributed!r} must be True, False or None (None: use "
                             "torch.distributed when it is initialised)")
        if distributed is False:
            if process_group is not None:
                raise ValueError("distributed=False with a process_group: give one or the other")
            return None
        if not available():
            if distributed or process_group is not None:
                raise RuntimeError(
                    "distributed=True (or a process_group) but the default torch.distributed process group is not "
                    "initialised: call torch.distributed.init_process_group(backend=...) on every rank before "
                    "building the PrivacyEngine (torchrun sets the environment it reads)")
            return None
        return Group(process_group)

    # ------------------------------------------------------------------ collectives, each wrapped
    def _run(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except CollectiveError:
            raise
        except Exception as e:
            raise CollectiveError(
                f"rank {self.rank}/{self.world_size}: the engine's {what} failed ({type(e).__name__}: {e}). Another "
                "rank most likely crashed or did not reach the same call (every rank must build the engine, and "
                "call optimizer.step() or engine.empty_step() for every logical step); the process group's timeout "
                "bounds the wait (init_process_group(timeout=...)). Nothing of this step was released here.") from e

    def header_device(self, like: torch.device | None) -> torch.device:
        if self.backend == "nccl":
            return like if like is not None and like.type == "cuda" else torch.device("cuda",
                                                                                        torch.cuda.current_device())
        return torch.device("cpu")

    def gather_objects(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        out: list[Any] = [None] * self.world_size
        self._run(what, lambda: torch.distributed.all_gather_object(out, obj, group=self.pg))
        return out

    def agree(self, what: dict[str, Any]) -> None:
        """Refuse, on every rank, a construction where ranks differ in any value of ``what``.

        Raises:
            ValueError: naming each differing key with the ranks' values.
        """
        everyone = self.gather_objects(what, "configuration check at construction")
        diff = {k: [d.get(k) for d in everyone] for k in what if any(d.get(k) != everyone[0].get(k)
                                                                     for d in everyone)}
        if diff:
            detail = "; ".join(f"{k}: " + (describe_differences(vals) if all(isinstance(v, list) for v in vals)
                                           else ", ".join(f"rank {r} {v!r}" for r, v in enumerate(vals)))
                               for k, vals in list(diff.items())[:6])
            raise ValueError(
                f"the ranks disagree on the PrivacyEngine's configuration or trainable set ({detail}): every rank "
                "must build the same model, freeze the same parameters and pass the same arguments, or the "
                "released gradient would not be the one that was accounted.")

    def broadcast_module(self, model: nn.Module) -> int:
        """Copy rank 0's parameters and buffers to every rank (DDP does the same at construction); DTensor
        (sharded) parameters are left alone. Returns the number of tensors broadcast."""
        tensors = [t for t in list(model.parameters()) + list(model.buffers()) if not _is_dtensor(t)]

        def run() -> None:
            with torch.no_grad():
                for t in tensors:
                    torch.distributed.broadcast(t.detach(), src=self._global(0), group=self.pg)
        self._run("broadcast of rank 0's parameters at construction", run)
        return len(tensors)

    def exchange_headers(self, mine: StepHeader, device: torch.device | None) -> list[StepHeader]:
        """Every rank's :class:`StepHeader` (one small ``all_gather``)."""
        dev = self.header_device(device)
        local = torch.tensor(mine.as_list(), dtype=torch.float64, device=dev)
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        self._run("step header exchange (the ranks' checks before a release)",
                  lambda: torch.distributed.all_gather(out, local, group=self.pg))
        return [StepHeader.from_list(t.tolist()) for t in out]

    def all_reduce_sum(self, params: Sequence[nn.Parameter], dtype_of: Callable[[nn.Parameter], torch.dtype],
                       fill: Callable[[torch.Tensor, list[tuple[nn.Parameter, int]]], None],
                       bucket_bytes: int = BUCKET_BYTES) -> tuple[dict[nn.Parameter, torch.Tensor], int]:
        """Sum one tensor per parameter over the ranks, in flat buckets of at most ``bucket_bytes`` per (dtype,
        device), consecutive in the order of ``params`` (the plan's, the same on every rank).

        ``fill(flat, members)`` writes this rank's contribution into each bucket's flat buffer before it is
        all-reduced; ``members`` lists ``(param, offset)`` of the bucket. Returns ``param -> reduced tensor`` (a
        view of ``param``'s shape into its bucket) and the bytes this rank put into all-reduces (the buffers'
        size, not the algorithm's wire traffic).
        """
        out: dict[nn.Parameter, torch.Tensor] = {}
        sent = 0
        for bucket in _buckets(params, dtype_of, bucket_bytes):
            members, off = [], 0
            for p in bucket:
                members.append((p, off))
                off += p.numel()
            flat = torch.empty(off, dtype=dtype_of(bucket[0]), device=bucket[0].device)
            fill(flat, members)
            self._run("all-reduce of the clipped sums",
                      lambda flat=flat: torch.distributed.all_reduce(flat, group=self.pg))
            for p, o in members:
                out[p] = flat[o:o + p.numel()].view(p.shape)
            sent += flat.numel() * flat.element_size()
        return out, sent

    def _global(self, group_rank: int) -> int:
        if self.pg is None:
            return group_rank
        return torch.distributed.get_global_rank(self.pg, group_rank)


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor"


def bucket_runs(items: Sequence[T], key_of: Callable[[T], Any], nbytes_of: Callable[[T], int],
                cap: int) -> list[list[T]]:
    """Consecutive runs of ``items`` with one ``key_of`` (dtype, device, ...), each at most ``cap`` bytes by
    ``nbytes_of`` (a larger item is a run of its own)."""
    out: list[list[T]] = []
    key: Any = None
    size = 0
    for it in items:
        k, nbytes = key_of(it), nbytes_of(it)
        if not out or k != key or size + nbytes > cap:
            out.append([it])
            key, size = k, nbytes
        else:
            out[-1].append(it)
            size += nbytes
    return out


def _buckets(params: Sequence[nn.Parameter], dtype_of: Callable[[nn.Parameter], torch.dtype],
             cap: int) -> list[list[nn.Parameter]]:
    """Consecutive runs of ``params`` with one (dtype, device), each at most ``cap`` bytes."""
    return bucket_runs(params, lambda p: (dtype_of(p), p.device),
                       lambda p: p.numel() * torch.empty((), dtype=dtype_of(p)).element_size(), cap)


__all__ = ["BUCKET_BYTES", "CollectiveError", "Group", "StepHeader", "available", "bucket_runs", "describe_differences",
           "fingerprint", "refuse_wrapped"]
