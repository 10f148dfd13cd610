"""Run test cases on N gloo processes (a "world") and bring each rank's result back to the pytest process.

One world = N processes started with ``torch.multiprocessing``'s ``spawn`` context, a ``gloo`` process group
initialised from a ``file://`` store in a fresh temporary directory (no ports), one thread each, and a short
``timeout=`` for ``init_process_group`` so that a collective no rank answers becomes an error in seconds, not a
hang. Starting a process costs seconds (importing torch, fastdp, transformers), so a world runs MANY cases, in
order, on every rank::

    world = run_world(2, [Case("exact-mlp", dist_cases.run_exact, {"spec": spec}), ...])
    values = world.values("exact-mlp")      # [rank 0's return value, rank 1's, ...]; re-raises a rank's error

A case is ``fn(ctx, **kwargs)`` with ``ctx`` a :class:`RankContext`; its return value must be picklable. Between
cases the ranks meet at a barrier kept in a separate ``FileStore`` (independent of the process group, so a case
that broke the group cannot hang the barrier); when any rank's case raised, or when the world asks for it
(``fresh_group=True``), every rank destroys the process group and joins a new one before the next case, so one
failure (a collective that timed out, a rank left behind) does not cascade into the next case.

An exception that escapes a case is recorded with its traceback, and :meth:`WorldResult.values` re-raises it in
the parent (:class:`RankError`, naming the case and the rank, with the rank's traceback). A rank that does not
finish within the world's ``timeout`` is killed and reported as hung.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: extra seconds a rank waits at the barrier between cases beyond the process group's timeout
BARRIER_SLACK = 10.0


@dataclass
class Case:
    """One test case of a world: ``fn(ctx, **kwargs)`` runs on every rank (``fn`` must be importable by name).

    ``pg_timeout``: run it in a new process group with this collective timeout (a case that waits for a timeout);
    ``fresh_group``: run it in a new process group (a case that leaves its group broken)."""

    name: str
    fn: Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    pg_timeout: float | None = None
    fresh_group: bool = False


@dataclass
class RankContext:
    """What a case function learns about its process."""

    rank: int
    world_size: int
    tmpdir: str
    pg_timeout: float
    case: str = ""


class RankError(AssertionError):
    """A case raised on a rank (or a rank hung / died); the message carries the rank's traceback."""


@dataclass
class Record:
    ok: bool
    value: Any = None
    error: str = ""  # "Type: message"
    tb: str = ""
    seconds: float = 0.0


@dataclass
class WorldResult:
    world_size: int
    cases: list[str]
    records: dict[str, list[Record | None]]  # case -> per rank (None: the rank never reached / finished it)
    problems: list[str]  # per-rank process problems (hung, died with exit code ...)
    seconds: float

    def values(self, name: str) -> list[Any]:
        """Every rank's return value of case ``name``; raises :class:`RankError` if the case failed on any rank."""
        if name not in self.records:
            raise KeyError(f"no case {name!r} in this world (cases: {self.cases})")
        recs = self.records[name]
        failed = [(r, rec) for r, rec in enumerate(recs) if rec is not None and not rec.ok]
        missing = [r for r, rec in enumerate(recs) if rec is None]
        if failed or missing:
            head = f"case {name!r} failed on rank(s) {[r for r, _ in failed]}"
            if missing:
                head += f"; no result from rank(s) {missing} (hung, died, or an earlier case broke the world)"
            parts = [head]
            for r, rec in failed:
                parts.append(f"--- rank {r}: {rec.error}\n{rec.tb}")
            if self.problems:
                parts.append("world problems: " + "; ".join(self.problems))
            raise RankError("\n".join(parts))
        return [rec.value for rec in recs]

    def timing(self) -> dict[str, float]:
        """Case -> the slowest rank's seconds."""
        return {n: max((rec.seconds for rec in recs if rec is not None), default=0.0)
                for n, recs in self.records.items()}


# ---------------------------------------------------------------------------------------------- child side


def _init_group(tmpdir: str, generation: int, rank: int, world_size: int, pg_timeout: float) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/pg{generation}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=pg_timeout))


def _barrier(store: Any, key: str, world_size: int, deadline: float) -> bool:
    store.add(key, 1)
    while time.monotonic() < deadline:
        if int(store.add(key, 0)) >= world_size:
            return True
        time.sleep(0.01)
    return False


def _reinit(tmpdir: str, generation: int, rank: int, world_size: int, pg_timeout: float, out: Path) -> bool:
    """A new default process group (the old one may be broken by a timed-out collective)."""
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group may not shut down cleanly
        pass
    try:
        _init_group(tmpdir, generation, rank, world_size, pg_timeout)
    except Exception as e:  # noqa: BLE001
        (out / f"fatal{rank}.txt").write_text(f"re-initialising the process group failed: {e!r}")
        return False
    return True


def _detach_engines() -> None:
    try:
        from fastdp import engine_registry
    except ImportError:  # pragma: no cover
        return
    for engine in list(engine_registry._ATTACHED_ENGINES):
        try:
            engine.detach()
        except Exception:  # noqa: BLE001 - best effort between cases
            pass


def _child(rank: int, world_size: int, tmpdir: str, cases: Sequence[Case], pg_timeout: float,
           fresh_group: bool) -> None:
    torch.set_num_threads(1)
    out = Path(tmpdir)
    store = dist.FileStore(str(out / "barrier_store"), world_size)
    generation = 0
    current_timeout = pg_timeout if not cases or cases[0].pg_timeout is None else cases[0].pg_timeout
    try:
        _init_group(tmpdir, generation, rank, world_size, current_timeout)
    except Exception as e:  # noqa: BLE001
        (out / f"fatal{rank}.txt").write_text(f"init_process_group failed: {e!r}\n{traceback.format_exc()}")
        return
    for i, case in enumerate(cases):
        want_timeout = pg_timeout if case.pg_timeout is None else case.pg_timeout
        if i > 0 and (case.fresh_group or want_timeout != current_timeout):
            generation += 1
            if not _reinit(tmpdir, generation, rank, world_size, want_timeout, out):
                return
            current_timeout = want_timeout
        ctx = RankContext(rank, world_size, tmpdir, current_timeout, case.name)
        t0 = time.monotonic()
        try:
            rec = Record(True, case.fn(ctx, **case.kwargs))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
            rec = Record(False, error=f"{type(e).__name__}: {e}", tb=traceback.format_exc())
        rec.seconds = time.monotonic() - t0
        _detach_engines()
        try:
            data = pickle.dumps(rec)
        except Exception as e:  # noqa: BLE001
            rec = Record(False, error=f"case result not picklable: {e!r}", seconds=rec.seconds)
            data = pickle.dumps(rec)
        (out / f"r{rank}_c{i}.pkl").write_bytes(data)
        if not rec.ok:
            store.add(f"failed{i}", 1)
        if not _barrier(store, f"done{i}", world_size, time.monotonic() + current_timeout + BARRIER_SLACK):
            (out / f"fatal{rank}.txt").write_text(f"barrier after case {case.name!r} timed out: another rank "
                                                  "did not finish it")
            return
        nxt = cases[i + 1] if i + 1 < len(cases) else None
        if nxt is not None and not nxt.fresh_group and (nxt.pg_timeout or pg_timeout) == current_timeout and (
                fresh_group or int(store.add(f"failed{i}", 0)) > 0):
            generation += 1
            if not _reinit(tmpdir, generation, rank, world_size, current_timeout, out):
                return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


# ---------------------------------------------------------------------------------------------- parent side


def run_world(world_size: int, cases: Sequence[Case], *, timeout: float = 240.0, pg_timeout: float = 30.0,
              fresh_group: bool = False) -> WorldResult:
    """Run ``cases`` in order on ``world_size`` spawned gloo processes; return every rank's result per case.

    Args:
        world_size: number of processes (ranks).
        cases: the cases; each runs on every rank.
        timeout: wall-clock seconds for the whole world; ranks still running then are killed (reported hung).
        pg_timeout: the process group's collective timeout (``init_process_group(timeout=...)``).
        fresh_group: a new process group before every case (for cases that leave the group broken).
    """
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"case names must be unique: {names}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fastdp-world-") as tmpdir:
        ctx = mp.get_context("spawn")
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # the children read it at import
        try:
            procs = [ctx.Process(target=_child, args=(r, world_size, tmpdir, list(cases), pg_timeout, fresh_group),
                                 daemon=True, name=f"fastdp-rank{r}") for r in range(world_size)]
            for p in procs:
                p.start()
        finally:
            if old is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = old
        deadline = t0 + timeout
        problems: list[str] = []
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()  # only the processes this function started
                p.join(5)
                problems.append(f"rank {r} hung: killed after the world's timeout of {timeout:g} s")
            elif p.exitcode != 0:
                problems.append(f"rank {r} exited with code {p.exitcode}")
            fatal = Path(tmpdir) / f"fatal{r}.txt"
            if fatal.exists():
                problems.append(f"rank {r}: {fatal.read_text()}")
        records: dict[str, list[Record | None]] = {}
        for i, name in enumerate(names):
            row: list[Record | None] = []
            for r in range(world_size):
                f = Path(tmpdir) / f"r{r}_c{i}.pkl"
                row.append(pickle.loads(f.read_bytes()) if f.exists() else None)
            records[name] = row
    return WorldResult(world_size, names, records, problems, time.monotonic() - t0)


# ---------------------------------------------------------------------------------------------- shared worlds
# Test modules register their cases at import (collection) time; the first test that needs a world of N ranks
# runs every case registered for N in ONE set of processes (process start-up and imports cost seconds per rank).

_REGISTRY: dict[int, dict[str, Callable[[], tuple[Case, Any]]]] = {}
_WORLDS: dict[int, SharedWorld] = {}


def register(world_size: int, name: str, builder: Callable[[], tuple[Case, Any]]) -> None:
    """Register a case for the shared world of ``world_size`` ranks. ``builder()`` runs in the pytest process just
    before the world starts and returns the :class:`Case` and any parent-side data (e.g. the oracle)."""
    table = _REGISTRY.setdefault(world_size, {})
    if name in table:
        raise ValueError(f"case {name!r} registered twice for world size {world_size}")
    if world_size in _WORLDS:
        raise RuntimeError(f"case {name!r} registered after the {world_size}-rank world ran")
    table[name] = builder


class SharedWorld:
    """Every registered case of one world size, run once; ``values(name)`` and ``extra(name)`` per case."""

    def __init__(self, world_size: int, **kw: Any) -> None:
        built = {name: b() for name, b in _REGISTRY.get(world_size, {}).items()}
        self._extra = {name: extra for name, (_, extra) in built.items()}
        cases = [case for case, _ in built.values()]
        # cases with their own process group (timeouts) last, so a broken group cannot touch the others
        cases.sort(key=lambda c: c.pg_timeout is not None or c.fresh_group)
        self.result = run_world(world_size, cases, **kw)

    def values(self, name: str) -> list[Any]:
        return self.result.values(name)

    def extra(self, name: str) -> Any:
        return self._extra[name]


def shared_world(world_size: int) -> SharedWorld:
    """The shared world of ``world_size`` ranks (run at the first call)."""
    if world_size not in _WORLDS:
        _WORLDS[world_size] = SharedWorld(world_size)
    return _WORLDS[world_size]


__all__ = ["Case", "RankContext", "RankError", "SharedWorld", "WorldResult", "register", "run_world",
           "shared_world"]
