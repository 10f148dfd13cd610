"""examples/distributed.py (data-parallel) and examples/fully_shard.py (FSDP2) under torchrun with 2 CPU processes
(gloo), --quick: each job runs, and its table has the accounted epsilon and the bytes communicated."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _torchrun_quick(script: str) -> str:
    """Run ``script --quick`` on two gloo processes; its stdout.

    A rank killed by SIGABRT with "terminate called without an active exception" after rank 0 printed the whole
    table (which comes after the collectives of training and evaluation, in which every rank took part) is a
    warning, not a failure: a rare gloo teardown race in torch's process-group shutdown, seen in full-suite runs
    even with the examples' barrier before ``destroy_process_group`` (tests/distributed/test_fsdp.py tolerates the
    same). Any other failure, or one before the table, fails the test."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "examples" / script), "--quick"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    teardown_abort = ("terminate called without an active exception" in res.stderr and "SIGABRT" in res.stderr
                      and re.search(r"^delta = .*; accountant", res.stdout, re.M) is not None)
    if res.returncode != 0 and teardown_abort:
        warnings.warn(f"{script}: every rank finished, then one aborted in process-group shutdown (a torch gloo "
                      "teardown race, not a failure of the example)", stacklevel=2)
    else:
        assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def _row(out: str, label: str) -> tuple[float, float, int, float, float]:
    row = re.search(rf"^{label}\s+([0-9.]+)\s+([0-9.]+)\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s*$", out, re.M)
    assert row, out
    eps, sigma, steps, acc, mb = float(row[1]), float(row[2]), int(row[3]), float(row[4]), float(row[6])
    assert 0 < eps <= 3.0 and sigma > 0 and steps >= 1 and 0 <= acc <= 1
    assert mb > 0  # bytes all-reduced / reduce-scattered per step
    return eps, sigma, steps, acc, mb


def test_distributed_example_quick_on_two_processes():
    out = _torchrun_quick("distributed.py")
    assert "world size 2 (gloo)" in out
    assert "parameters bit-identical on every rank: True" in out
    _row(out, "DP full fine-tuning")


def test_fully_shard_example_quick_on_two_processes():
    out = _torchrun_quick("fully_shard.py")
    m = re.search(r"world size 2 \(gloo\), device cpu; rank 0 holds (\d+) of (\d+) parameters", out)
    assert m, out
    assert int(m[1]) < int(m[2])  # sharded: rank 0 holds a part only
    _row(out, "DP FSDP2 fine-tuning")
