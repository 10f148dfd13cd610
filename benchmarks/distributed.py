"""Distributed benchmark: the private data-parallel step against non-private DDP, on N CPU processes (gloo).

For each world size N (default 1 and 2) one world of N processes (one thread each) times, in alternating rounds
(the order rotates each round), one step of

* ``non-private DDP``: the workload's model in ``DistributedDataParallel``, plain SGD;
* ``fastdp``: the same model, unwrapped, under a data-parallel ``PrivacyEngine`` (default mode, sigma 1);

on the same global batch (each rank holds ``batch / N`` rows). A step's time is the slowest rank's (a barrier
before each step). Peak memory growth per rank (peak RSS) is measured in a fresh world per method. The bytes each
rank puts into all-reduces per step are counted, not computed: a DDP communication hook adds up its buckets, the
engine reports its own (``engine.communication``).

The target of the issue: the private step's ratio to non-private DDP at N = 2 within 1.1x of the one-process ratio
(N = 1), so communication adds no DP-specific cost.

    python benchmarks/distributed.py                        # GPT-2 (cpu widths) T 128, global batch 16, N 1 and 2
    python benchmarks/distributed.py --quick                # a smoke run
    python benchmarks/distributed.py --write-docs           # also regenerates the table in docs/results

Results go to ``benchmarks/results/distributed-cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workers  # noqa: E402
import zoo  # noqa: E402

METHODS = ("non-private DDP", "fastdp")


def _ddp_step(w: zoo.Workload, counter: list[int]):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(zoo.make_model(w))

    def counting_hook(state, bucket):
        counter[0] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    forward, loss = zoo.forward_fn(w), zoo.loss_fn(w)

    def step(data):
        x, y = data
        loss(forward(model, x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _private_step(w: zoo.Workload):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zoo.make_step(w, zoo.DEFAULT_METHOD, torch.device("cpu"))


def _local(data, rank: int, world: int):
    x, y = data
    per = x.shape[0] // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _timed(step, data) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    step(data)
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _world(rank: int, world: int, init: str, job: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    w = zoo.Workload(job["model"], job["size"], job["batch"], job["widths"])
    data = _local(zoo.make_batch(w, torch.device("cpu")), rank, world)
    result: dict = {}
    if job["kind"] == "time":
        counter = [0]
        steps = {"non-private DDP": _ddp_step(w, counter), "fastdp": _private_step(w)}
        for m in METHODS:
            for _ in range(job["warmup"]):
                steps[m](data)
        counter[0] = 0
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        for r in range(job["rounds"]):
            order = list(METHODS)[r % 2:] + list(METHODS)[:r % 2]
            for m in order:
                times[m].append(_timed(steps[m], data))
        eng = steps["fastdp"].engine
        comm = eng.communication
        result = {"times_s": times,
                  "bytes_per_step": {"non-private DDP": counter[0] / job["rounds"],
                                     "fastdp": comm["all_reduce_bytes"] / max(1, comm["steps"])}}
    else:
        m = job["method"]
        step = _ddp_step(w, [0]) if m == "non-private DDP" else _private_step(w)
        step(data)
        dist.barrier()
        before = workers._rss_bytes()
        workers._reset_peak_rss()
        for _ in range(job["mem_steps"]):
            step(data)
        peak = torch.tensor([float(workers._peak_rss_bytes() - before)])
        gathered = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(gathered, peak)
        result = {"memory_bytes_per_rank": [float(g) for g in gathered]}
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, job: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(_world, args=(world, f"file://{tmp}/init", job, out), nprocs=world, join=True,
                           start_method="spawn")
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="global batch (split evenly over the ranks)")
    ap.add_argument("--widths", default="cpu")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--mem-steps", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.widths, args.size, args.batch, args.rounds, args.warmup, args.mem_steps = "tiny", 16, 4, 1, 1, 1
    w = zoo.Workload(args.model, args.size, args.batch, args.widths)
    base = {"model": args.model, "size": args.size, "batch": args.batch, "widths": args.widths}
    rows = {}
    for n in args.worlds:
        if args.batch % n:
            raise SystemExit(f"--batch {args.batch} is not divisible by world size {n}")
        timing = run_world(n, {**base, "kind": "time", "rounds": args.rounds, "warmup": args.warmup})
        mem = {m: run_world(n, {**base, "kind": "memory", "method": m, "mem_steps": args.mem_steps})
               for m in METHODS}
        med = {m: statistics.median(ts) for m, ts in timing["times_s"].items()}
        rows[n] = {"median_s": med, "ratio": med["fastdp"] / med["non-private DDP"],
                   "memory_bytes_per_rank": {m: mem[m]["memory_bytes_per_rank"] for m in METHODS},
                   "bytes_per_step": timing["bytes_per_step"], "times_s": timing["times_s"]}
        print(f"N={n}: " + ", ".join(f"{m} {v * 1e3:.1f} ms" for m, v in med.items())
              + f"; ratio {rows[n]['ratio']:.3f}; all-reduce bytes/step/rank {timing['bytes_per_step']}")
    command = " ".join(["python", "benchmarks/distributed.py", *(argv if argv is not None else sys.argv[1:])])
    result = {"kind": "distributed", "workload": w.describe(), "tag": w.tag, "command": command,
              "env": {"torch": torch.__version__, "threads_per_rank": 1, "cpu_count": os.cpu_count(),
                      "date": time.strftime("%Y-%m-%d")},
              "rounds": args.rounds, "rows": {str(k): v for k, v in rows.items()}}
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    name = "distributed-cpu-quick.json" if args.quick else "distributed-cpu.json"
    (results / name).write_text(json.dumps(result, indent=1))
    print(table(result))
    if args.write_docs and not args.quick:
        import tables

        tables.write_docs()  # every <!-- table:distributed-cpu --> block


def table(result: dict) -> str:
    """The markdown table of one result: per world size, medians, ratio, memory and bytes."""
    rows = result["rows"]
    one = rows.get("1", {}).get("ratio")
    lines = [f"{result['workload']}, global batch split evenly over N gloo processes (1 thread each), "
             f"{result['rounds']} alternating rounds, {result['env']['date']}, "
             f"`{result['command']}`:", "",
             "| N | non-private DDP (ms) | fastdp (ms) | ratio | ratio / ratio at N=1 | peak memory growth per rank, "
             "DDP → fastdp (MB) | all-reduce bytes per step per rank, DDP / fastdp |",
             "|---|---|---|---|---|---|---|"]
    for n, r in rows.items():
        mem = r["memory_bytes_per_rank"]
        mem_s = ", ".join(f"{a / 2**20:.0f} → {b / 2**20:.0f}" for a, b in zip(mem["non-private DDP"],
                                                                                mem["fastdp"], strict=True))
        b = r["bytes_per_step"]
        rel = f"{r['ratio'] / one:.3f}" if one else "-"
        lines.append(f"| {n} | {r['median_s']['non-private DDP'] * 1e3:.1f} | {r['median_s']['fastdp'] * 1e3:.1f} | "
                     f"{r['ratio']:.3f} | {rel} | {mem_s} | {b['non-private DDP']:,.0f} / {b['fastdp']:,.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
