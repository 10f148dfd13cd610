"""Where the private step's extra time goes, stage by stage (``python benchmarks/phases.py``).

For each workload, one process builds non-private training and fastdp's default mode (``benchmarks/zoo.py``), takes
``--warmup`` steps of each, then ``--reps`` alternating rounds of one step each. Each step is timed in three parts,
forward (model and loss), backward and optimizer step, and fastdp's stages inside them by wall-clock timers around
its functions (patched on the classes before the engines are built):

* **forward hooks**: the capture stage's module pre-hooks and forward hooks (``Capture._layer_pre``,
  ``Capture._layer_hook``; ghost differentiation's ``requires_grad`` switches, the inputs kept, the output hooks);
* **backward hooks**: the output-gradient hooks (``Capture.on_output_grad``; per-sample gradients instantiated on
  arrival where they replace the kept tensors);
* **clipping**: the end of the backward pass (``Capture._on_backward_end``), split into the per-sample **norms**
  (``fastdp.clipped_sums._norms``: ghost norms' Gram products, instantiated gradients' norms) and the rest, the
  **clipped sums** (book-keeping's contractions, which replace the weight-gradient products autograd no longer
  computes, plus factors and bookkeeping);
* **release**: the optimizer's step pre-hook (``Release.pre_step``), split into the **noise** (``noisy_means``: the
  draws and the noisy means) and the rest (checks, accounting).

The table gives medians in milliseconds. ``autograd`` is the backward pass less the clipping and the backward
hooks: for non-private training it includes the weight gradients, for fastdp not (ghost differentiation), so the
difference of the two autograd columns is about what the clipped sums add back. On CUDA every timer synchronises the
device (the stages then no longer overlap: use it to attribute, not to time the step).

Usage::

    python benchmarks/phases.py --json benchmarks/results/phases_cpu.json   # the targets' 15 workloads (~5 minutes)
    python benchmarks/phases.py --models roberta vit --sizes 64 --reps 21
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import zoo

import fastdp.clipped_sums
import fastdp.release
from fastdp.capture import Capture
from fastdp.release import Release

#: (owner, attribute, stage) of every timed function
TIMED = ((Capture, "_layer_pre", "forward hooks"), (Capture, "_layer_hook", "forward hooks"),
         (Capture, "on_output_grad", "backward hooks"), (Capture, "_on_backward_end", "clipping"),
         (fastdp.clipped_sums, "_norms", "norms"), (Release, "pre_step", "release"),
         (fastdp.release, "noisy_means", "noise"))
STAGES = ("forward hooks", "backward hooks", "clipping", "norms", "release", "noise")
COLUMNS = ("forward", "backward", "optimizer step", "autograd", *STAGES)


@contextlib.contextmanager
def timed_stages(spent: dict[str, float], sync: Callable[[], None]) -> Iterator[None]:
    """Within the context, every function of :data:`TIMED` adds its wall-clock time to ``spent[stage]`` (nested calls
    of one stage counted once)."""
    depth = dict.fromkeys(STAGES, 0)

    def wrap(fn: Callable, stage: str) -> Callable:
        @functools.wraps(fn)
        def timed(*args: object, **kwargs: object) -> object:
            if depth[stage]:
                return fn(*args, **kwargs)
            depth[stage] += 1
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                spent[stage] = spent.get(stage, 0.0) + time.perf_counter() - t0
                depth[stage] -= 1
        return timed

    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in TIMED]
    for owner, name, stage in TIMED:
        setattr(owner, name, wrap(getattr(owner, name), stage))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def measure(w: zoo.Workload, device: torch.device, reps: int, warmup: int) -> dict[str, dict[str, float]]:
    """Median milliseconds of every column of :data:`COLUMNS` for non-private training and the default mode."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    spent: dict[str, float] = {}
    data = zoo.make_batch(w, device)
    forward, loss_fn = zoo.forward_fn(w), zoo.loss_fn(w)
    with timed_stages(spent, sync), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parts = {}
        for method in ("non-private", zoo.DEFAULT_METHOD):
            step = zoo.make_step(w, method, device)
            parts[method] = step.parts  # type: ignore[attr-defined]
        rows: dict[str, dict[str, list[float]]] = {m: {c: [] for c in COLUMNS} for m in parts}
        names = list(parts)
        for r in range(warmup + reps):
            for method in names[r % 2:] + names[:r % 2]:
                model, opt = parts[method]
                spent.clear()
                x, y = data
                sync()
                t0 = time.perf_counter()
                loss = loss_fn(forward(model, x), y)
                sync()
                t1 = time.perf_counter()
                loss.backward()
                sync()
                t2 = time.perf_counter()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync()
                t3 = time.perf_counter()
                if r < warmup:
                    continue
                row = rows[method]
                row["forward"].append(t1 - t0)
                row["backward"].append(t2 - t1)
                row["optimizer step"].append(t3 - t2)
                row["autograd"].append(t2 - t1 - spent.get("clipping", 0.0) - spent.get("backward hooks", 0.0))
                for stage in STAGES:
                    row[stage].append(spent.get(stage, 0.0))
    return {m: {c: 1e3 * statistics.median(v) for c, v in row.items()} for m, row in rows.items()}


def print_rows(tag: str, result: dict[str, dict[str, float]]) -> None:
    for method, row in result.items():
        print(f"| {tag} | {method} | " + " | ".join(f"{row[c]:.1f}" for c in COLUMNS) + " |", flush=True)
    base, dp = result["non-private"], result[zoo.DEFAULT_METHOD]
    total = lambda r: r["forward"] + r["backward"] + r["optimizer step"]  # noqa: E731
    extra = total(dp) - total(base)
    print(f"| {tag} | extra | {dp['forward'] - base['forward']:+.1f} | {dp['backward'] - base['backward']:+.1f} | "
          f"{dp['optimizer step'] - base['optimizer step']:+.1f} | {dp['autograd'] - base['autograd']:+.1f} | "
          + " | ".join(f"{dp[s]:.1f}" for s in STAGES)
          + f" | (step {total(dp) / total(base):.2f}x, +{extra:.1f} ms) |", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2", "roberta", "vit", "resnet", "tinycls"], choices=zoo.MODELS)
    p.add_argument("--sizes", nargs="+", type=int, default=None, help="default: each model's sizes of the harness")
    p.add_argument("--widths", default="cpu")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print("| workload | method | " + " | ".join(COLUMNS) + " |")
    print("|---" * (2 + len(COLUMNS)) + "|")
    out = {}
    for m in args.models:
        for s in args.sizes or zoo.DEFAULT_SIZES[m]:
            w = zoo.Workload(m, s, args.batch or zoo.default_batch(m, s, args.widths), args.widths)
            out[w.tag] = measure(w, device, args.reps, args.warmup)
            print_rows(w.tag, out[w.tag])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": str(device), "threads": args.threads, "torch": torch.__version__,
                                         "reps": args.reps, "ms": out}, indent=1))


if __name__ == "__main__":
    main()
