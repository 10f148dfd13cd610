"""Distributed benchmark: the private data-parallel step against non-private DDP, on N CPU processes (gloo).

For each world size N (default 1 and 2) one world of N processes (one thread each) times, in alternating rounds
(the order rotates each round), one step of

* ``non-private DDP``: the workload's model in ``DistributedDataParallel``, plain SGD;
* ``fastdp``: the same model, unwrapped, under a data-parallel ``PrivacyEngine`` (default mode, sigma 1);
* ``non-private FSDP2`` and ``fastdp FSDP2`` (GPT-2 only): ``fully_shard`` on every block and the root, without
  and with the engine (``verify_structure=False``, as FSDP2 requires);

on the same global batch (each rank holds ``batch / N`` rows). A step's time is the slowest rank's (a barrier
before each step). Peak memory growth per rank (peak RSS) is measured in a fresh world per method. The bytes each
rank puts into all-reduces per step are counted, not computed: a DDP communication hook adds up its buckets, the
engine reports its own (``engine.communication``).

The target: the private step's ratio to its non-private counterpart at N = 2 within 1.1x of the ratio at N = 1,
so communication adds no DP-specific cost.

    python benchmarks/dist_bench.py                        # GPT-2 (cpu widths) T 128, global batch 16, N 1 and 2
    python benchmarks/dist_bench.py --quick                # a smoke run
    python benchmarks/dist_bench.py --write-docs           # also regenerates the table in docs/results

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

METHODS = ("non-private DDP", "fastdp", "non-private FSDP2", "fastdp FSDP2")
FSDP_METHODS = METHODS[2:]


def _ddp_step(w: zoo.Workload, counter: list[int]):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(zoo.make_model(w))

    def counting_hook(state, bucket):
        counter[0] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    return _train_step(w, model, torch.optim.SGD(model.parameters(), lr=1e-4))


def _train_step(w: zoo.Workload, model: torch.nn.Module, opt: torch.optim.Optimizer, engine=None):
    """``step(data)``: forward, the workload's loss, backward, optimizer step (``step.engine``: the engine)."""
    forward, loss = zoo.forward_fn(w), zoo.loss_fn(w)

    def step(data):
        x, y = data
        loss(forward(model, x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step.engine = engine  # type: ignore[attr-defined]
    return step


def _fsdp_step(w: zoo.Workload, private: bool):
    """GPT-2 with ``fully_shard`` on every block and the root (FSDP2); private: under a PrivacyEngine (the
    structure probe off, as FSDP2 requires: docs/guide/distributed.md)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if w.model != "gpt2":
        raise ValueError("the FSDP2 methods shard GPT-2's blocks (model.transformer.h); use --model gpt2")
    torch.manual_seed(0)
    model = zoo.make_model(w)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    engine = None
    if private:
        import fastdp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = fastdp.PrivacyEngine(model, batch_size=w.batch, sample_size=100 * w.batch, noise_multiplier=1.0,
                                          max_grad_norm=1.0, accountant="rdp", verify_structure=False)
        engine.attach(opt)
    return _train_step(w, model, opt, engine)


def _make(w: zoo.Workload, method: str, counter: list[int]):
    if method == "non-private DDP":
        return _ddp_step(w, counter)
    if method == "fastdp":
        return _private_step(w)
    return _fsdp_step(w, private=method == "fastdp FSDP2")


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
    methods = job["methods"]
    if job["kind"] == "time":
        counter = [0]
        steps = {m: _make(w, m, counter) for m in methods}
        for m in methods:
            for _ in range(job["warmup"]):
                steps[m](data)
        counter[0] = 0
        times: dict[str, list[float]] = {m: [] for m in methods}
        for r in range(job["rounds"]):
            order = methods[r % len(methods):] + methods[:r % len(methods)]
            for m in order:
                times[m].append(_timed(steps[m], data))
        comm = steps["fastdp"].engine.communication
        result = {"times_s": times,
                  "bytes_per_step": {"non-private DDP": counter[0] / job["rounds"],
                                     "fastdp": comm["all_reduce_bytes"] / max(1, comm["steps"])}}
        if "fastdp FSDP2" in steps:
            c = steps["fastdp FSDP2"].engine.communication
            result["bytes_per_step"]["fastdp FSDP2 (reduce-scatter + all-reduce)"] = (
                (c["reduce_scatter_bytes"] + c["all_reduce_bytes"]) / max(1, c["steps"]))
    else:
        m = job["method"]
        step = _make(w, m, [0])
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
    dist.barrier()  # every rank done with its collectives: gloo can abort a rank torn down while a peer still talks
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
    methods = list(METHODS if args.model == "gpt2" else METHODS[:2])
    base = {"model": args.model, "size": args.size, "batch": args.batch, "widths": args.widths, "methods": methods}
    rows = {}
    for n in args.worlds:
        if args.batch % n:
            raise SystemExit(f"--batch {args.batch} is not divisible by world size {n}")
        timing = run_world(n, {**base, "kind": "time", "rounds": args.rounds, "warmup": args.warmup})
        mem = {m: run_world(n, {**base, "kind": "memory", "method": m, "mem_steps": args.mem_steps})
               for m in methods}
        med = {m: statistics.median(ts) for m, ts in timing["times_s"].items()}
        rows[n] = {"median_s": med, "ratio": med["fastdp"] / med["non-private DDP"],
                   "memory_bytes_per_rank": {m: mem[m]["memory_bytes_per_rank"] for m in methods},
                   "bytes_per_step": timing["bytes_per_step"], "times_s": timing["times_s"]}
        if "fastdp FSDP2" in med:
            rows[n]["ratio_fsdp"] = med["fastdp FSDP2"] / med["non-private FSDP2"]
        print(f"N={n}: " + ", ".join(f"{m} {v * 1e3:.1f} ms" for m, v in med.items())
              + f"; ratio {rows[n]['ratio']:.3f}; bytes/step/rank {timing['bytes_per_step']}")
    command = " ".join(["python", "benchmarks/dist_bench.py", *(argv if argv is not None else sys.argv[1:])])
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
    """The markdown table of one result: per world size and method pair, medians, ratio (and its ratio to N = 1),
    peak memory growth per rank, and the bytes each rank communicated per step."""
    rows = result["rows"]
    lines = [f"{result['workload']}, global batch split evenly over N gloo processes (1 thread each), "
             f"{result['rounds']} alternating rounds, {result['env']['date']}, `{result['command']}`:", "",
             "| N | non-private | private | non-private (ms) | private (ms) | ratio | ratio / ratio at N=1 | "
             "peak memory growth per rank, non-private → private (MB) | bytes sent per step per rank, "
             "non-private / private |",
             "|---|---|---|---|---|---|---|---|---|"]
    pairs = [("non-private DDP", "fastdp", "ratio"), ("non-private FSDP2", "fastdp FSDP2", "ratio_fsdp")]
    for base, priv, key in pairs:
        one = rows.get("1", {}).get(key)
        for n, r in rows.items():
            if key not in r:
                continue
            mem = r["memory_bytes_per_rank"]
            mem_s = ", ".join(f"{a / 2**20:.0f} → {b / 2**20:.0f}" for a, b in zip(mem[base], mem[priv],
                                                                                    strict=True))
            b = r["bytes_per_step"]
            if priv == "fastdp":
                sent = f"{b['non-private DDP']:,.0f} / {b['fastdp']:,.0f}"
            else:
                sent = f"- / {b.get('fastdp FSDP2 (reduce-scatter + all-reduce)', 0):,.0f}"
            rel = f"{r[key] / one:.3f}" if one else "-"
            lines.append(f"| {n} | {base} | {priv} | {r['median_s'][base] * 1e3:.1f} | {r['median_s'][priv] * 1e3:.1f}"
                         f" | {r[key]:.3f} | {rel} | {mem_s} | {sent} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
