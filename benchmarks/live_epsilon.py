"""Cost of reporting epsilon at every step: the tight PRV value (``get_privacy_spent()``) against the live RDP
bound (``engine.live_epsilon()``, :mod:`fastdp.accounting.live`).

For each step count ``t`` the script times, on a ledger of ``t`` steps (sigma, q fixed):

* ``prv``: a fresh PRV computation (what ``get_privacy_spent()`` costs after each new step; PRV results are cached
  by history, so only an unchanged ledger is free);
* ``live``: recording one more step and calling ``live_epsilon`` (median of ``--reps``);

and prints both epsilons (live >= PRV). No accelerator needed; single-threaded numpy/scipy.

Usage::

    python benchmarks/live_epsilon.py                          # sigma 1.0, q 0.01, delta 1e-5, t up to 10^4
    python benchmarks/live_epsilon.py --steps 100 1000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdp.accounting import Ledger, PRVAccountant  # noqa: E402
from fastdp.accounting.live import live_epsilon  # noqa: E402


def measure(sigma: float, q: float, delta: float, steps: int, reps: int) -> dict:
    led = Ledger()
    led.record_step(sigma, q, steps)
    t0 = time.perf_counter()
    prv = PRVAccountant().epsilon_of(led, delta)
    prv_s = time.perf_counter() - t0
    live_epsilon(led, delta)  # warm the per-(sigma, q) RDP curve (computed once per run)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        led.record_step(sigma, q)
        eps = live_epsilon(led, delta)
        times.append(time.perf_counter() - t0)
    return {"steps": steps, "prv_epsilon": prv, "prv_seconds": prv_s, "live_epsilon": eps,
            "live_seconds_median": statistics.median(times)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--sample-rate", type=float, default=0.01)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--steps", type=int, nargs="+", default=[10, 100, 1000, 10000])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    rows = [measure(args.sigma, args.sample_rate, args.delta, t, args.reps) for t in args.steps]
    cpu = platform.processor() or platform.machine()
    print(f"sigma={args.sigma:g} q={args.sample_rate:g} delta={args.delta:g} ({cpu})")
    print(f"{'steps':>7} {'PRV eps':>9} {'PRV time':>10} {'live eps':>9} {'live time':>10} {'speed-up':>9}")
    for r in rows:
        print(f"{r['steps']:>7} {r['prv_epsilon']:>9.4f} {r['prv_seconds']:>9.3f}s {r['live_epsilon']:>9.4f} "
              f"{1e6 * r['live_seconds_median']:>8.1f}us {r['prv_seconds'] / r['live_seconds_median']:>8.0f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
