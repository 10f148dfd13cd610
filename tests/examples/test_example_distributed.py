"""examples/distributed.py under torchrun with 2 CPU processes (gloo), --quick: the job runs, the ranks end with
bit-identical parameters, and the table has the accounted epsilon."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def test_distributed_example_quick_on_two_processes():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "examples" / "distributed.py"), "--quick"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "world size 2 (gloo)" in out
    assert "parameters bit-identical on every rank: True" in out
    row = re.search(r"^DP full fine-tuning\s+([0-9.]+)\s+([0-9.]+)\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s*$",
                    out, re.M)
    assert row, out
    eps, sigma, steps, acc = float(row[1]), float(row[2]), int(row[3]), float(row[4])
    assert 0 < eps <= 3.0 and sigma > 0 and steps >= 1 and 0 <= acc <= 1
    assert float(row[6]) > 0  # bytes all-reduced per step
