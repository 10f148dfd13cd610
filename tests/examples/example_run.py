"""Run one example script in a subprocess the way a user would, from the repository root with the working tree on
``PYTHONPATH`` and no Hugging Face hub access; shared by the example tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_example(script: Path, *args: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    """``python script *args`` with ``env`` added to the environment; fails the test (with the script's output) if
    it exits non-zero. Returns the finished process (``stdout``/``stderr`` as text)."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout}\n{proc.stderr[-5000:]}"
    return proc
