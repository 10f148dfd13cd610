"""Smoke test of examples/audit.py --quick: every row printed, no DP row's measured lower bound above its claimed
epsilon, the non-private run and DP-FP with a trained encoder (not covered) caught, DP-SGD's audit not vacuous."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from example_run import run_example

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "audit.py"
ROW = re.compile(r"^(\([a-d]\) .+?)\s{2,}(inf|not covered|[0-9.]+)\s+([0-9.]+)\s+(\d+)/(\d+)\s+([0-9.]+)\s*$", re.M)


def test_audit_quick_runs_and_no_claim_is_refuted() -> None:
    proc = run_example(SCRIPT, "--quick", timeout=120, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    rows = {m.group(1).strip(): (m.group(2), float(m.group(3)), int(m.group(4)), int(m.group(5)))
            for m in ROW.finditer(proc.stdout)}
    assert len(rows) == 16, proc.stdout  # (a), 3 + 3 x (b), 3 x 2 (c), 3 x (d)
    claimed, bound, correct, guesses = rows["(a) non-private SGD"]
    assert claimed == "inf" and correct == guesses and bound > 3.5, proc.stdout
    for name, (claimed, bound, _, _) in rows.items():
        if name.startswith(("(b)", "(c)")):
            assert 0 <= bound <= float(claimed), f"{name}: bound {bound} above claimed {claimed}\n{proc.stdout}"
        if name.startswith("(d)"):
            assert claimed == "not covered" and bound > 1.0, proc.stdout  # above the eps = 1 claim of its noise
    assert rows["(b) DP-SGD eps=8"][1] > 1.5, proc.stdout


@pytest.mark.slow
def test_audit_full_run_no_claim_is_refuted() -> None:
    """The full run (m = 5000 canaries; about 2 minutes on 2 CPU cores): the table of docs/guide/audit.md."""
    proc = run_example(SCRIPT, timeout=900, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    rows = {m.group(1).strip(): (m.group(2), float(m.group(3))) for m in ROW.finditer(proc.stdout)}
    assert len(rows) == 16, proc.stdout
    for name, (claimed, bound) in rows.items():
        if name.startswith(("(b)", "(c)")):
            assert bound <= float(claimed), f"{name}: bound {bound} above claimed {claimed}\n{proc.stdout}"
    assert rows["(b) DP-SGD eps=8"][1] > 2.5 and rows["(a) non-private SGD"][1] > 5, proc.stdout
