"""Where does a method's step time go? ``torch.profiler`` on the harness's workloads, two methods side by side.

Usage::

    python benchmarks/profile_step.py --model gpt2 --size 64                       # default mode vs non-private
    python benchmarks/profile_step.py --model vit --size 64 --methods non-private "fastdp BK-MixOpt" --top 15
    python benchmarks/profile_step.py --model gpt2 --size 64 --by-function          # fastdp's Python functions

For each method: ``--warmup`` steps, then ``--steps`` profiled steps. Prints the operators with the largest total
self CPU time (CUDA time on a GPU) per step, and, with ``--by-function``, the fastdp functions with the largest
cumulative time (``cProfile``), so that the extra time of a DP method can be attributed: which operators it adds
and which of fastdp's stages (norms, clipped sums, noise, hooks) they come from.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import zoo  # noqa: E402


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", choices=zoo.MODELS)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--preset", default="cpu", choices=sorted(zoo.WIDTHS))
    p.add_argument("--methods", nargs="+", default=["non-private", zoo.DEFAULT_METHOD], choices=zoo.METHODS)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--by-function", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    w = zoo.Workload(args.model, args.size, args.batch or zoo.default_batch(args.model, args.size, args.preset),
                     args.preset)
    print(f"{w.tag}: {w.describe()}, batch {w.batch}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for m in args.methods:
        print(profile_method(w, m, torch.device(args.device), args.warmup, args.steps, args.top, args.by_function))


if __name__ == "__main__":
    main()
