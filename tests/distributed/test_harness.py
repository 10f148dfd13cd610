"""The multi-process harness itself (tests/distributed/harness.py): results come back per rank, a rank's exception
is re-raised in the parent with its traceback, the world recovers for the next case (a fresh process group), a
collective that a rank never joins fails within the process group's short timeout, and a hung rank is killed and
reported."""

from __future__ import annotations

import time

import harness_cases as hc
import pytest
from harness import Case, RankError, run_world


@pytest.fixture(scope="module")
def world():
    return run_world(2, [
        Case("sum", hc.rank_sum),
        Case("boom", hc.boom_on_rank1),
        Case("sum-after-boom", hc.rank_sum),
        Case("left-alone", hc.collective_left_alone, pg_timeout=1.0, fresh_group=True),
        Case("sum-after-timeout", hc.rank_sum, fresh_group=True),
    ], timeout=120)


def test_values_per_rank(world):
    vals = world.values("sum")
    assert [v["rank"] for v in vals] == [0, 1]
    assert all(v["sum"] == 3.0 and v["threads"] == 1 and v["timeout"] == 30.0 for v in vals)


def test_rank_exception_reraised_with_traceback(world):
    with pytest.raises(RankError) as info:
        world.values("boom")
    msg = str(info.value)
    assert "case 'boom' failed on rank(s) [1]" in msg
    assert "ValueError: boom from rank 1" in msg and "in boom_on_rank1" in msg  # the rank's traceback


def test_world_recovers_after_a_failed_case(world):
    assert all(v["sum"] == 3.0 for v in world.values("sum-after-boom"))


def test_collective_timeout_is_short(world):
    with pytest.raises(RankError) as info:
        world.values("left-alone")
    msg = str(info.value)
    assert "rank(s) [0]" in msg, msg
    assert "timed out" in msg.lower() or "timeout" in msg.lower(), msg
    assert all(v["sum"] == 3.0 and v["timeout"] == 30.0 for v in world.values("sum-after-timeout"))


@pytest.mark.slow
def test_hung_rank_is_killed_and_reported():
    t0 = time.monotonic()
    w = run_world(2, [Case("hang", hc.hang_on_rank1)], timeout=15, pg_timeout=2)
    assert time.monotonic() - t0 < 30
    with pytest.raises(RankError, match="rank 1 hung"):
        w.values("hang")
