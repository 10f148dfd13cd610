"""The JSON a small benchmark script writes: its rows under ``"rows"`` and what they were measured on under
``"meta"`` (date, torch, the repository's commit, the machine, and the script's own settings)."""

from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``; ``None`` where there is none): the same
    number of cores of another model runs these workloads at another speed (on 2026-11-28 an "AMD EPYC" machine ran
    the ResNet-18 step about three times as long as the run of the day before, whose model was not recorded)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def write_rows(path: Path, rows: list[dict[str, Any]], **settings: Any) -> None:
    """Write ``{"meta": {...}, "rows": rows}`` to ``path`` (its folder created if missing); ``settings`` (e.g.
    ``threads``, ``reps``) join the meta."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or None
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "commit": commit, **settings, "machine": platform.machine(), "cpu_model": cpu_model()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
