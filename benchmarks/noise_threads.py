"""What the noise worker thread's own OpenMP team costs the rest of the process (``python
benchmarks/noise_threads.py``).

fastdp draws a CPU step's noise on two threads (``fastdp.noise.noisy_means``): the calling thread and one worker of a
thread pool. Under OpenMP (torch's CPU parallel backend) a thread that runs a parallel operation gets a team of
``torch.get_num_threads()`` threads of its own, kept for the life of the process; beside the main thread's team there
are then more OpenMP threads than cores, and libgomp spins only briefly before putting a waiting team to sleep, so
every later parallel operation of the main thread waits for its team to be woken. Since 2026-11-28 the worker runs
its operations on itself alone (``fastdp.noise._worker_threads``).

The damage lasts for the whole process, so the two configurations cannot alternate in one process as the levers of
``benchmarks/levers.py`` do: each configuration runs in processes of its own (``--procs`` per configuration,
interleaved), each taking ``--warmup`` steps and then ``--reps`` alternating rounds of a non-private step and a
step of the default mode (``benchmarks/zoo.py``), and a third kind of process times non-private training with no
engine at all (the clean baseline). Reported: medians over every round of every process of a configuration.

* ``before``: the worker thread without the setting (its team of two threads), as fastdp was;
* ``after``: fastdp as it is.

Usage::

    python benchmarks/noise_threads.py --models tinycls vit resnet roberta --sizes 64 \
        --json benchmarks/results/noise_threads_cpu.json
    python benchmarks/noise_threads.py --ops      # small operations of the main thread before / after a noise step
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import zoo  # noqa: E402
from results_file import write_rows  # noqa: E402

CONFIGS = ("before", "after", "no engine")


def _patch_before() -> None:
    """The noise pool as it was: a worker thread that keeps torch's thread count (its own OpenMP team)."""
    import concurrent.futures

    from fastdp import noise

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, noise.NOISE_THREADS - 1),
                                                 thread_name_prefix="fastdp-noise")
    noise._noise_pool = lambda: pool  # type: ignore[assignment]


def run_process(model: str, size: int, config: str, reps: int, warmup: int) -> dict[str, list[float]]:
    """One process's step times (seconds): ``{"non-private": [...], "private": [...]}`` (no ``private`` for the
    configuration ``no engine``)."""
    if config == "before":
        _patch_before()
    device = torch.device("cpu")
    w = zoo.Workload(model, size, zoo.default_batch(model, size, "cpu"), "cpu")
    data = zoo.make_batch(w, device)
    steps = {"non-private": zoo.make_step(w, "non-private", device)}
    if config != "no engine":
        steps["private"] = zoo.make_step(w, zoo.DEFAULT_METHOD, device)
    times: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    for r in range(warmup + reps):
        for name in names[r % 2:] + names[:r % 2]:
            t0 = time.perf_counter()
            steps[name](data)
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def ops(reps: int) -> dict[str, float]:
    """Milliseconds of two small operations of the main thread (a Gram inner product's ``(a * b).sum`` over ``(32,
    1, 64, 64)`` in float64 and a ``vector_norm`` over its last two dimensions) before and after one parallel
    operation on a worker thread, with and without the worker's setting."""
    import concurrent.futures

    from fastdp.noise import _worker_threads

    def bench(f) -> float:
        for _ in range(5):
            f()
        t = time.perf_counter()
        for _ in range(reps):
            f()
        return (time.perf_counter() - t) / reps * 1e3

    a, b, big = torch.randn(32, 1, 64, 64), torch.randn(32, 1, 64, 64), torch.randn(1 << 22)
    inner = lambda: (a * b).sum(dim=(1, 2, 3), dtype=torch.float64)  # noqa: E731
    norm = lambda: torch.linalg.vector_norm(a, dim=(-2, -1))  # noqa: E731
    out = {"inner, no worker": bench(inner), "norm, no worker": bench(norm)}
    threads = torch.get_num_threads()
    with concurrent.futures.ThreadPoolExecutor(1, initializer=_worker_threads) as pool:
        pool.submit(torch.add, big, big, out=big).result()
        out["inner, worker with the setting"], out["norm, worker with the setting"] = bench(inner), bench(norm)
    # (as fastdp.noise does after each step: the count a new thread starts with, which the setting also stored, back
    # to this thread's; otherwise the plain worker below would start with one thread and no team)
    torch.set_num_threads(threads)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(torch.add, big, big, out=big).result()
        out["inner, worker without it"], out["norm, worker without it"] = bench(inner), bench(norm)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tinycls", "vit", "resnet"], choices=zoo.MODELS)
    p.add_argument("--sizes", nargs="+", type=int, default=[64])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--procs", type=int, default=2, help="processes per configuration (interleaved)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--ops", action="store_true", help="time small operations instead (one process)")
    p.add_argument("--child", nargs=3, metavar=("MODEL", "SIZE", "CONFIG"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        model, size, config = args.child
        print(json.dumps(run_process(model, int(size), config, args.reps, args.warmup)))
        return
    if args.ops:
        for k, v in ops(200).items():
            print(f"{k:34s} {v:.3f} ms")
        return
    rows = []
    for model in args.models:
        for size in args.sizes:
            got: dict[str, dict[str, list[float]]] = {c: {} for c in CONFIGS}
            for _ in range(args.procs):
                for config in CONFIGS:
                    cmd = [sys.executable, __file__, "--child", model, str(size), config, "--reps", str(args.reps),
                           "--warmup", str(args.warmup), "--threads", str(args.threads)]
                    res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                    for k, v in res.items():
                        got[config].setdefault(k, []).extend(v)
            med = {c: {k: 1e3 * statistics.median(v) for k, v in got[c].items()} for c in CONFIGS}
            row = {"workload": f"{model}-{size}", "clean non-private ms": med["no engine"]["non-private"]}
            for c in ("before", "after"):
                row[f"{c}: non-private ms"] = med[c]["non-private"]
                row[f"{c}: private ms"] = med[c]["private"]
                row[f"{c}: ratio"] = med[c]["private"] / med[c]["non-private"]
                row[f"{c}: private / clean non-private"] = med[c]["private"] / med["no engine"]["non-private"]
            rows.append(row)
            print(" | ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                  flush=True)
    if args.json:
        write_rows(args.json, rows, reps=args.reps, warmup=args.warmup, procs=args.procs, threads=args.threads)


if __name__ == "__main__":
    main()
