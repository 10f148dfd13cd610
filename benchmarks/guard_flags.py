"""How many samples the cancellation guard flags in one private step of a benchmark workload, and how far it raises
their norms, with wide Gram matrices summed whole or in chunks of columns (``python benchmarks/guard_flags.py``).

A ghost norm's guard (``fastdp.layers._rounding``) flags a sample whose squared norm ``sq`` is below
``CANCELLATION_GUARD`` (64) times a worst-case bound ``err`` of its rounding. The bound grows with the width of the
Gram matrices' rows: a language model head's output gradients are vocabulary wide (50257 for GPT-2-small), so at
initialisation its samples may be flagged for the bound's looseness alone. Where the checks wait for the release
(CUDA) a flagged sample keeps the raised norm ``sq + 2 err`` (over-clipped); the CPU takes it apart unless the raise
is below ``EXACT_WORTH``. ``fastdp.layers._grams.GRAM_CHUNK`` sums rows wider than its value in chunks, which
charges the bound with the chunk's width instead (on the CPU: 1024; on CUDA: 4096 since 2026-11-28, set from this
script's run on an H200).

For each ``--chunks`` value (0: one product over the whole width), one workload, one warm-up step (the structure
probe's), ``--train-steps`` private steps (0: the flags at initialisation) and one measured step of the default
mode; every ghost-norm parameter's guard is recorded by wrapping ``_rounding.exact_flagged``. Printed and saved
per chunk setting: the ghost-norm parameters with a flagged sample (shape, flagged count, smallest ``sq / err``,
largest raise of that parameter's norm ``sqrt(guarded / sq)``) and, per sample, the raise of the norm of its
ghost-norm parameters together (an upper bound of the raise of the sample's whole norm, which also counts the
instantiated parameters).

Usage::

    python benchmarks/guard_flags.py --widths paper --models gpt2 --sizes 512 --device cuda --chunks 0 1024 4096 \\
        --json OUT/guard_flags_cuda.json
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import zoo
from results_file import write_rows

from fastdp.layers import _grams, _guard_batch, _rounding


def measure(w: zoo.Workload, device: torch.device, chunk: int, train_steps: int = 0, lr: float = 1e-4) -> dict:
    """One warm-up step (the structure probe's), ``train_steps`` private steps on other batches at learning rate
    ``lr``, and one measured step of the default mode with ``GRAM_CHUNK[device.type] = chunk`` (0: unset); the
    measured step's guard records summarised."""
    records: list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor, torch.Tensor]] = []
    original = _rounding.exact_flagged

    def recording(sq, err, bound_sq, factors_of, shape, positions):
        guarded = _rounding.guarded_sq(sq, err, bound_sq)
        records.append((tuple(shape), sq.detach().double(), err.detach().double(), guarded.detach().double()))
        return original(sq, err, bound_sq, factors_of, shape, positions)

    chunks = {k: v for k, v in _grams.GRAM_CHUNK.items() if k != device.type}
    if chunk > 0:
        chunks[device.type] = chunk
    step = zoo.make_step(w, zoo.DEFAULT_METHOD, device, lr=lr)
    batch = zoo.make_batch(w, device)
    # (each parameter's guard on its own, so that every ghost norm passes through exact_flagged)
    with zoo.patched([(_grams, "GRAM_CHUNK", chunks), (_rounding, "exact_flagged", recording),
                      (_guard_batch, "BATCHED", False)]):
        step(batch)
        for seed in range(train_steps):
            step(zoo.make_batch(w, device, seed=100 + seed))
        records.clear()
        step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    flagged_params, total_sq, total_guarded = [], 0.0, 0.0
    for shape, sq, err, guarded in records:
        sq, err, guarded = sq.cpu(), err.cpu(), guarded.cpu()
        total_sq, total_guarded = total_sq + sq, total_guarded + guarded
        flagged = ~(sq >= _rounding.CANCELLATION_GUARD * err)
        if bool(flagged.any()):
            ratio = (sq / err)[flagged]
            raise_ = (guarded / sq.clamp(min=1e-300)).sqrt()[flagged]
            flagged_params.append({"shape": list(shape), "flagged": int(flagged.sum()), "samples": int(sq.numel()),
                                   "min_sq_over_err": float(ratio.min()), "max_norm_raise": float(raise_.max())})
    per_sample = (total_guarded / total_sq).sqrt() if records else torch.ones(1)
    return {"workload": w.tag, "device": device.type, "gram_chunk": chunk, "train_steps": train_steps, "lr": lr,
            "ghost_parameters": len(records),
            "flagged_parameters": flagged_params,
            "sample_raise_max": float(per_sample.max()), "sample_raise_median": float(per_sample.median())}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt2"])
    p.add_argument("--sizes", nargs="+", type=int, default=[256])
    p.add_argument("--widths", default="cpu")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--chunks", nargs="+", type=int, default=[0, 1024])
    p.add_argument("--train-steps", type=int, default=0, help="private steps before the measured one")
    p.add_argument("--lr", type=float, default=1e-4, help="their SGD learning rate")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for model in args.models:
        for size in args.sizes:
            batch = args.batch or zoo.default_batch(model, size, args.widths)
            w = zoo.Workload(model, size, batch, args.widths)
            for chunk in args.chunks:
                row = measure(w, device, chunk, args.train_steps, args.lr)
                rows.append(row)
                print(f"{w.tag} chunk {chunk or 'none'}, after {args.train_steps} steps: "
                      f"{len(row['flagged_parameters'])} of "
                      f"{row['ghost_parameters']} ghost-norm parameters flag a sample; sample norm raised by "
                      f"x{row['sample_raise_median']:.6f} (median) .. x{row['sample_raise_max']:.6f} (max)", flush=True)
                for f in row["flagged_parameters"]:
                    print(f"    {f['shape']}: {f['flagged']}/{f['samples']} flagged, sq/err >= "
                          f"{f['min_sq_over_err']:.3g}, norm raised up to x{f['max_norm_raise']:.6f}", flush=True)
                if not math.isfinite(row["sample_raise_max"]):
                    print("    (a non-finite raise: a sample whose ghost norms are all 0)", flush=True)
    if args.json:
        write_rows(args.json, rows, **{k: v for k, v in vars(args).items() if k != "json"})


if __name__ == "__main__":
    main()
