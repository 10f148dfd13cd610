"""A/B of instantiation on arrival (docs/internals/clipping.md): default mode with and without it, next to non-private
training, alternating steps in one process.

Usage::

    python benchmarks/ab_on_arrival.py --model roberta --size 256 --reps 9

The switch is the engine's private attribute ``_on_arrival`` (for measurements like this one only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import zoo  # noqa: E402

from fastdp import PrivacyEngine  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="roberta", choices=zoo.MODELS)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    w = zoo.Workload(args.model, args.size, args.batch or zoo.default_batch(args.model, args.size, "cpu"))
    x, y = zoo.make_batch(w, torch.device("cpu"))
    forward, loss = zoo.forward_fn(w), zoo.loss_fn(w)

    def build(on_arrival: bool | None):
        torch.manual_seed(0)
        model = zoo.make_model(w)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        if on_arrival is not None:
            engine = PrivacyEngine(model, batch_size=w.batch, sample_size=100 * w.batch, noise_multiplier=1.0,
                                   accountant="rdp")
            engine.attach(opt)
            engine._capture.on_arrival = on_arrival

        def step() -> None:
            loss(forward(model, x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    steps = {"non-private": build(None), "default, on arrival": build(True), "default, off": build(False)}
    for s in steps.values():
        s()
        s()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.reps):
        for k, s in steps.items():
            t0 = time.perf_counter()
            s()
            times[k].append(time.perf_counter() - t0)
    base = statistics.median(times["non-private"])
    print(f"{w.tag}: {w.describe()}, batch {w.batch}; {args.reps} alternating rounds, torch {torch.__version__}")
    for k, ts in times.items():
        print(f"{k:22s} {1000 * statistics.median(ts):8.1f} ms  {statistics.median(ts) / base:.2f}x")


if __name__ == "__main__":
    main()
