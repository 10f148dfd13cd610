"""The loss check's and the loss trace's cost on one checked pass, next to the loss (``python
benchmarks/loss_check_cost.py``).

For logits of ``rows x V`` (``rows = B * T`` label rows of a language model), float32, one process, alternating
rounds, medians of:

* **loss**: ``fastdp.losses.causal_lm_loss(logits, labels).mean()``, its forward and its backward to the logits
  (what every training step pays for the loss);
* **check**: what :mod:`fastdp.loss_check` adds on a checked pass: the forward's summary
  (``loss_check.summarise``: log-sum-exp and top-3 per row), the backward's weights (``loss_check.row_weights``)
  and the verdict at the step (``loss_check.verdict``);
* **traced**: the loss's forward and backward with the logits traced as the engine returns them on a traced pass
  (:mod:`fastdp.loss_trace`: a ``Traced`` alias, every torch function of the loss followed by its rule), and the
  verdict; its excess over **loss** is the trace's cost.

The check runs on the first backward passes of each input signature only (until a verdict, at most
``loss_check.MAX_TRIES``), the trace on the first ``loss_trace.TRACE_PASSES``; the ratios are the cost of such a
pass relative to the loss, not to a whole step.

Usage::

    python benchmarks/loss_check_cost.py --json benchmarks/results/loss_check_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time
import weakref
from pathlib import Path

import torch
from results_file import write_rows

from fastdp import loss_check, loss_trace
from fastdp.loss_deps import Book, output_dep
from fastdp.losses import causal_lm_loss

SHAPES = ((8, 128, 8192), (8, 256, 32000), (4, 512, 50257))  # (B, T, V)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> None:
    x = logits.detach().requires_grad_()
    causal_lm_loss(x, labels).mean().backward()


def _traced(logits: torch.Tensor, labels: torch.Tensor) -> str:
    """The loss on logits traced as on a traced pass of the engine; the trace's verdict."""
    state = loss_trace.LossTrace()
    book = Book()
    book.state = weakref.ref(state)
    state.book = book
    state.sigs[id(book)] = {"sig"}
    x = logits.detach().requires_grad_()
    causal_lm_loss(loss_trace._wrap(x, output_dep(book)), labels).mean().backward()  # an alias, as the engine
    (d, bk, _), = state.pending
    return loss_trace.verdict(d, bk)


def _check(logits: torch.Tensor, grad: torch.Tensor, B: int) -> str:
    summ = loss_check.summarise("output", logits)
    w, lab, fits = loss_check.row_weights(grad, summ)
    return loss_check.verdict(w, lab, fits, B, 1.0, True, loss_check._tol(grad.dtype)).kind


def measure(B: int, T: int, V: int, reps: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    for i in range(B):  # padded samples of different lengths
        labels[i, T - (i * T) // (2 * B):] = -100
    x = logits.clone().requires_grad_()
    causal_lm_loss(x, labels).mean().backward()
    grad = x.grad
    times: dict[str, list[float]] = {"loss": [], "check": [], "traced": []}
    _loss(logits, labels)
    kind = _check(logits, grad, B)  # warm-up; the verdicts show that the check and the trace read the loss
    traced = _traced(logits, labels)
    run = {"loss": lambda: _loss(logits, labels), "check": lambda: _check(logits, grad, B),
           "traced": lambda: _traced(logits, labels)}
    for r in range(reps):
        order = ("loss", "check", "traced")[r % 3:] + ("loss", "check", "traced")[:r % 3]
        for k in order:
            t0 = time.perf_counter()
            run[k]()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"B": B, "T": T, "V": V, "loss_ms": med["loss"], "check_ms": med["check"],
            "ratio": med["check"] / med["loss"], "verdict": kind, "traced_ms": med["traced"],
            "trace_ratio": (med["traced"] - med["loss"]) / med["loss"], "trace_verdict": traced}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--shapes", nargs="+", default=None, help="B,T,V triples (default: SHAPES)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    rows = [measure(B, T, V, args.reps) for B, T, V in shapes]
    print("| B x T | V | loss fwd+bwd (ms) | check (ms) | check / loss | verdict | traced loss (ms) | "
          "(traced - loss) / loss | trace verdict |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} x {r['T']} | {r['V']} | {r['loss_ms']:.1f} | {r['check_ms']:.1f} | {r['ratio']:.2f}x | "
              f"{r['verdict']} | {r['traced_ms']:.1f} | {r['trace_ratio']:+.3f} | {r['trace_verdict']} |")
    if args.json is not None:
        write_rows(args.json, rows, threads=args.threads, reps=args.reps)


if __name__ == "__main__":
    main()
