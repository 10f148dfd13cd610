"""Smoke test of examples/quickstart.py: the --quick run trains privately, spends at most its target epsilon
and learns something (test accuracy well above the 10 % chance level of 10 classes)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from example_run import run_example

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "quickstart.py"
ROW = re.compile(r"^(DP eps=\S+|non-private)\s+(\S+)\s+(\S+)\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)\s*$", re.M)


def test_quickstart_quick_runs_and_is_private():
    pytest.importorskip("sklearn")
    proc = run_example(SCRIPT, "--quick", timeout=120)
    rows = {m.group(1): m.groups()[1:] for m in ROW.finditer(proc.stdout)}
    assert "DP eps=8" in rows and "non-private" in rows, proc.stdout

    eps, sigma, steps, acc, _ = rows["DP eps=8"]
    eps, sigma, steps, acc = float(eps), float(sigma), int(steps), float(acc)
    assert math.isfinite(eps) and 0 < eps <= 8.0, proc.stdout
    assert sigma > 0 and steps > 0, proc.stdout
    assert acc > 0.5, proc.stdout

    np_eps, _, np_steps, np_acc, _ = rows["non-private"]
    assert np_eps == "inf" and int(np_steps) == steps and float(np_acc) > 0.5, proc.stdout
