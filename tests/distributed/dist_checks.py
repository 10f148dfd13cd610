"""Parent-side checks of the distributed worlds' results (shared by the test modules of tests/distributed/)."""

from __future__ import annotations

from typing import Any

import torch
from oracle import assert_grads_close


def assert_bit_identical(per_rank: list[dict[str, torch.Tensor]], what: str) -> None:
    """Every rank's tensors equal rank 0's bit for bit (torch.equal)."""
    ref = per_rank[0]
    for r, got in enumerate(per_rank[1:], start=1):
        assert set(got) == set(ref), f"{what}: rank {r} has {sorted(got)}, rank 0 {sorted(ref)}"
        for n in ref:
            if not torch.equal(got[n], ref[n]):
                diff = float((got[n].double() - ref[n].double()).abs().max())
                raise AssertionError(f"{what}: {n} on rank {r} differs from rank 0's (max |diff| {diff:.3g}); "
                                     "every rank must hold the same bits")


def check_exact(values: list[dict[str, Any]], oracle: dict[str, Any], world_size: int, what: str) -> None:
    """Every rank released the oracle's gradient (float64, 1e-6 relative) and the same bits as rank 0; the engine
    reports the world and the step."""
    for r, v in enumerate(values):
        assert v["world_size"] == world_size, f"{what}: rank {r} engine.world_size={v['world_size']}"
        assert v["rank"] == r, f"{what}: rank {r} engine.rank={v['rank']}"
        assert v["steps"] == 1, f"{what}: rank {r} engine.steps={v['steps']} after one step"
        assert_grads_close(v["grads"], oracle["want"], rtol=1e-6, atol=oracle["atol"], msg=f"{what} rank {r}")
    assert_bit_identical([v["grads"] for v in values], f"{what} released p.grad")
    assert_bit_identical([v["params"] for v in values], f"{what} parameters after the step")


def refused_everywhere(outcomes: list[dict[str, Any]], what: str, *needles: str) -> None:
    """Every rank raised, and every rank's message contains each of ``needles`` (case-insensitive)."""
    for r, o in enumerate(outcomes):
        assert o["raised"], f"{what}: rank {r} did not raise"
        low = o["msg"].lower()
        for needle in needles:
            assert needle.lower() in low, f"{what}: rank {r}'s error does not name {needle!r}: {o['msg']}"
