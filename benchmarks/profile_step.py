"""Where does a method's step time go? ``torch.profiler`` on the harness's workloads (``python benchmarks/run.py
--profile``).

Usage::

    python benchmarks/run.py --profile --models gpt2 --sizes 64                       # default mode vs non-private
    python benchmarks/run.py --profile --models vit --sizes 64 --methods non-private "fastdp BK-MixOpt" --top 15
    python benchmarks/run.py --profile --models gpt2 --sizes 64 --by-function          # fastdp's Python functions

For each method: ``--warmup`` steps, then ``--reps`` profiled steps. Prints the operators with the largest total
self CPU time (CUDA time on a GPU) per step, and, with ``--by-function``, the fastdp functions with the largest
cumulative time (``cProfile``), so that the extra time of a DP method can be attributed: which operators it adds
and which of fastdp's stages (norms, clipped sums, noise, hooks) they come from.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch
import zoo
from torch.profiler import ProfilerActivity, profile


def profile_method(w: zoo.Workload, method: str, device: torch.device, warmup: int, steps: int, top: int,
                   by_function: bool) -> str:
    data = zoo.make_batch(w, device)
    step = zoo.make_step(w, method, device)
    for _ in range(warmup):
        step(data)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(data)
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    text = [f"== {method}: {1000 * wall:.1f} ms per profiled step (profiler overhead included)",
            prof.key_averages().table(sort_by=key, row_limit=top)]
    if by_function:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            step(data)
        pr.disable()
        buf = io.StringIO()
        stats = pstats.Stats(pr, stream=buf).sort_stats("cumulative")
        stats.print_stats(r"fastdp|opacus", top)
        text.append(buf.getvalue())
    return "\n".join(text)
