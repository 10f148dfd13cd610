"""Quickstart: differentially private training of a small CNN on scikit-learn's handwritten digits.

Data: ``sklearn.datasets.load_digits`` (1797 8x8 grey-scale images, 10 classes; bundled with scikit-learn,
no download), split 80/20 (stratified, seeded). For each target epsilon (delta = the engine default
1/(2 n_train)) the script trains the same model with the same optimizer and number of epochs under a
``fastdp.PrivacyEngine``, then once without privacy, and prints a table of epsilon spent, noise multiplier,
steps, test accuracy and wall time.

Run::

    python examples/quickstart.py                # epsilon in {1, 3, 8} + non-private baseline
    python examples/quickstart.py --quick        # one epsilon, few epochs (a smoke test, < 30 s)
    python examples/quickstart.py --epsilons 2 4 --epochs 30 --seed 1

The only DP-specific lines are the engine's construction and ``engine.attach(optimizer)``; the training
loop is an ordinary PyTorch loop, except that batches are drawn by Poisson sampling (see ``poisson_batches``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

try:
    import fastdp
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fastdp
from fastdp.accounting import steps_from_epochs


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits as ``(N, 1, 8, 8)`` float tensors in [-1, 1] and int64 labels, split 80/20, stratified, seeded.

    The pixel scaling uses the fixed range 0..16 of the data format, not statistics of the training set,
    so the preprocessing itself does not touch the private data.
    """
    digits = load_digits()
    x = digits.images.astype(np.float32) / 8.0 - 1.0  # pixel values 0..16 -> [-1, 1]
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
    as_x = lambda a: torch.from_numpy(a).unsqueeze(1)  # noqa: E731
    return as_x(x_tr), torch.from_numpy(y_tr), as_x(x_te), torch.from_numpy(y_te)


def make_model() -> nn.Module:
    """A small CNN built only from layers fastdp supports (no BatchNorm: it mixes the samples of a batch)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),             # (B, 16, 8, 8)
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),  # (B, 32, 4, 4)
        nn.GroupNorm(4, 32),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


def poisson_batches(n: int, sample_rate: float, steps: int, generator: torch.Generator):
    """Yield ``steps`` index tensors; each example is in a batch independently with prob. ``sample_rate``.

    The privacy accountants assume exactly this (Poisson subsampling), so the batch size varies from step to
    step (mean ``sample_rate * n``) and a batch can be empty. Shuffling and cutting the data into fixed-size
    batches would NOT match the accounting.
    """
    for _ in range(steps):
        yield torch.nonzero(torch.rand(n, generator=generator) < sample_rate).squeeze(1)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    acc = (model(x).argmax(dim=1) == y).float().mean().item()
    model.train()
    return acc


def train(x_tr, y_tr, x_te, y_te, *, epsilon: float | None, args) -> dict:
    """Train one model; ``epsilon=None`` trains without privacy (same model, optimizer, sampling, steps)."""
    n = len(x_tr)
    q = args.batch_size / n
    steps = steps_from_epochs(args.epochs, q)  # the same count the engine calibrates sigma for
    torch.manual_seed(args.seed)  # the same initial weights for every setting
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    engine = None
    t0 = time.perf_counter()
    if epsilon is not None:
        engine = fastdp.PrivacyEngine(
            model,
            batch_size=args.batch_size,   # the EXPECTED batch size q * n; gradients are divided by it
            sample_size=n,
            epochs=args.epochs,
            target_epsilon=epsilon,       # sigma is calibrated for this epsilon after `steps` steps
            max_grad_norm=args.max_grad_norm,
            clipping_fn="automatic",      # per-sample normalisation (AUTO-S): R hardly matters with Adam
            clipping_mode="BK-MixOpt",
            accountant=args.accountant,
            loss_reduction="mean",        # the loss below is a mean over the (physical) batch
            noise_generator=torch.Generator().manual_seed(args.seed + 1),
        )
        engine.attach(optimizer)
    loss_fn = nn.CrossEntropyLoss()  # reduction="mean"
    sampler = torch.Generator().manual_seed(args.seed + 2)
    batches = poisson_batches(n, q, steps, sampler)
    if engine is not None and not args.no_progress:
        # a progress bar (tqdm, on stderr) with the steps and the epsilon spent so far (a live RDP upper bound;
        # the tight PRV value is the table's, from engine.get_privacy_spent())
        batches = fastdp.progress(batches, engine, desc=f"eps={epsilon:g}", total=steps, file=sys.stderr)
    for idx in batches:
        if len(idx) == 0:
            if engine is not None:
                # An empty Poisson batch: there is nothing to back-propagate, but the accounting
                # counts this step, so release pure noise / batch_size with empty_step().
                engine.empty_step()
                optimizer.zero_grad()
            continue
        loss = loss_fn(model(x_tr[idx]), y_tr[idx])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    seconds = time.perf_counter() - t0
    result = {"setting": "non-private" if engine is None else f"DP eps={epsilon:g}",
              "epsilon": math.inf, "sigma": 0.0, "steps": steps,
              "accuracy": accuracy(model, x_te, y_te), "seconds": seconds}
    if engine is not None:
        spent = engine.get_privacy_spent()
        result.update(epsilon=spent["epsilon"], sigma=engine.noise_multiplier, steps=spent["steps"],
                      delta=spent["delta"])
        engine.detach()
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one epsilon (8), few epochs: a fast smoke test")
    parser.add_argument("--epsilons", type=float, nargs="+", default=None,
                        help="target epsilons (default 1 3 8)")
    parser.add_argument("--epochs", type=float, default=None,
                        help="epochs per run (default 40; 5 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=256, help="expected (Poisson) batch size")
    parser.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--accountant", default="prv", choices=["prv", "rdp", "gdp"])
    parser.add_argument("--no-baseline", action="store_true", help="skip the non-private run")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: this model's ops are too small to gain)")
    args = parser.parse_args(argv)
    if args.epsilons is None:
        args.epsilons = [8.0] if args.quick else [1.0, 3.0, 8.0]
    if args.epochs is None:
        args.epochs = 5.0 if args.quick else 40.0

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    n = len(x_tr)
    print(f"digits: {n} train / {len(x_te)} test examples; expected batch {args.batch_size} "
          f"(q = {args.batch_size / n:.4f}), {args.epochs:g} epochs, delta = 1/(2n) = {1 / (2 * n):.3g}, "
          f"accountant {args.accountant}, torch threads {torch.get_num_threads()}")
    results = []
    for eps in args.epsilons:
        results.append(train(x_tr, y_tr, x_te, y_te, epsilon=eps, args=args))
        print(f"  done: {results[-1]['setting']} acc={results[-1]['accuracy']:.4f}", flush=True)
    if not args.no_baseline:
        results.append(train(x_tr, y_tr, x_te, y_te, epsilon=None, args=args))

    print()
    print(f"{'setting':<14} {'epsilon':>8} {'sigma':>8} {'steps':>6} {'test acc':>9} {'time (s)':>9}")
    for r in results:
        eps = "inf" if math.isinf(r["epsilon"]) else f"{r['epsilon']:.3f}"
        sigma = "-" if r["sigma"] == 0 else f"{r['sigma']:.3f}"
        print(f"{r['setting']:<14} {eps:>8} {sigma:>8} {r['steps']:>6} {r['accuracy']:>9.4f} "
              f"{r['seconds']:>9.2f}")
    print(f"\ntotal time: {time.perf_counter() - t_start:.1f} s")
    return results


if __name__ == "__main__":
    main()
