"""Case functions for the harness's own tests (tests/distributed/test_harness.py): torch only, so a world starts
fast."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist


def rank_sum(ctx: Any) -> dict[str, Any]:
    """All-reduce of (rank + 1): every rank gets 1 + ... + N."""
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return {"rank": ctx.rank, "sum": float(t), "threads": torch.get_num_threads(), "timeout": ctx.pg_timeout}


def boom_on_rank1(ctx: Any) -> str:
    if ctx.rank == 1:
        raise ValueError("boom from rank 1")
    return "fine"


def collective_left_alone(ctx: Any) -> dict[str, Any]:
    """Rank 0 all-reduces, rank 1 never does (it waits past the timeout): rank 0's collective must fail within
    about the process group's timeout."""
    if ctx.rank == 1:
        time.sleep(ctx.pg_timeout + 1)
        return {"waited": True}
    t0 = time.monotonic()
    dist.all_reduce(torch.ones(1))
    return {"seconds": time.monotonic() - t0}


def hang_on_rank1(ctx: Any) -> str:
    if ctx.rank == 1:
        time.sleep(3600)
    return "fine"
