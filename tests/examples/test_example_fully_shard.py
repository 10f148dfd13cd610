"""examples/fully_shard.py under torchrun with 2 CPU processes (gloo), --quick: the sharded private job runs, each rank
holds half of the parameters, and the table has the accounted epsilon and the bytes reduce-scattered."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def test_fully_shard_example_quick_on_two_processes():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "examples" / "fully_shard.py"), "--quick"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    m = re.search(r"world size 2 \(gloo\), device cpu; rank 0 holds (\d+) of (\d+) parameters", out)
    assert m, out
    assert int(m[1]) < int(m[2])  # sharded: rank 0 holds a part only
    row = re.search(r"^DP FSDP2 fine-tuning\s+([0-9.]+)\s+([0-9.]+)\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s*$",
                    out, re.M)
    assert row, out
    eps, sigma, steps, acc = float(row[1]), float(row[2]), int(row[3]), float(row[4])
    assert 0 < eps <= 3.0 and sigma > 0 and steps >= 1 and 0 <= acc <= 1
    assert float(row[6]) > 0  # MB reduce-scattered per step
