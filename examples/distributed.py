"""Data-parallel DP fine-tuning on several processes: the same private step as one process, N times faster.

Launch with torchrun (CPU: gloo; one GPU per process: NCCL, unchanged)::

    torchrun --standalone --nproc-per-node 2 examples/distributed.py            # about 25 s on 2 CPU cores
    torchrun --standalone --nproc-per-node 2 examples/distributed.py --quick    # a few seconds

Model: a small BERT sequence classifier built from a config with ``transformers`` (nothing downloaded). Data: a
synthetic task (does the sequence contain the token 7?), 20,000 training and
1,000 test sequences, the same on every rank (seeded).

What is distributed and what is private:

* every rank builds the same model and the same ``fastdp.PrivacyEngine`` (``batch_size`` and ``sample_size`` are
  global); the engine sees ``torch.distributed`` initialised, checks that the ranks agree on its configuration,
  and broadcasts rank 0's parameters;
* ``fastdp.data.DistributedPoissonSampler`` gives each rank the Poisson-sampled examples of its part of the data
  set, so the union over the ranks is one Poisson sample of the whole set (shards of random, unequal sizes; an
  empty one takes ``engine.empty_step()``);
* each rank clips its own samples; ``optimizer.step()`` all-reduces the clipped sums once, with the noise drawn
  once by rank 0, so every rank applies the same update and the accountant counts one step per logical batch.

Rank 0 prints the table: epsilon, sigma, steps, test accuracy, time, and the bytes all-reduced per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fastdp
from fastdp.data import DistributedPoissonSampler, VirtualBatches

VOCAB, LENGTH = 64, 16


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random token sequences (tokens 8..63) and balanced labels: label 1 sequences contain the token 7 at three
    random positions, label 0 sequences never do."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(8, VOCAB, (n, LENGTH), generator=g)
    y = (torch.rand(n, generator=g) < 0.5).long()
    pos = torch.randint(1, LENGTH, (n, 3), generator=g)
    rows = torch.arange(n).unsqueeze(1).expand(n, 3)
    x[rows[y == 1], pos[y == 1]] = 7
    x[:, 0] = 1  # [CLS]
    return x, y


def make_model() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=LENGTH, num_labels=2,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


def parse_args(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--batch-size", type=int, default=512, help="global expected logical batch size")
    ap.add_argument("--physical", type=int, default=64, help="largest micro-batch per rank")
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--quick", action="store_true", help="a few steps on a subset")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (rank 0 shows steps and epsilon)")
    return ap.parse_args()


def setup() -> tuple[int, int, torch.device]:
    """``init_process_group`` (NCCL with one GPU per process, else gloo); returns rank, world size, device."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return rank, world, device


def training_data(args: argparse.Namespace) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                     float]:
    """n_train, the training and test sets, and the epochs (``--quick``: 600 examples, half an epoch)."""
    n_train = 600 if args.quick else 20000
    x_train, y_train = make_data(n_train, seed=1)
    x_test, y_test = make_data(1000, seed=2)
    return n_train, x_train, y_train, x_test, y_test, 0.5 if args.quick else args.epochs


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rank, world, device = setup()
    n_train, x_train, y_train, x_test, y_test, epochs = training_data(args)

    model = make_model().to(device)
    engine = fastdp.PrivacyEngine(model, batch_size=args.batch_size, sample_size=n_train, epochs=epochs,
                                  target_epsilon=args.epsilon, max_grad_norm=1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    engine.attach(optimizer)
    steps = fastdp.accounting.steps_from_epochs(epochs, engine.sample_rate)  # the steps sigma was calibrated for
    sampler = DistributedPoissonSampler(n_train, batch_size=args.batch_size, steps=steps,
                                        generator=torch.Generator().manual_seed(100 + rank))

    t0 = time.perf_counter()
    model.train()
    local_sizes = []
    # rank 0's bar shows the steps and the live epsilon (an RDP upper bound; the tight value is printed at the end)
    for idx in fastdp.progress(sampler, engine, desc="DP training", file=sys.stderr,
                               disable=rank != 0 or args.no_progress):
        local_sizes.append(len(idx))
        if not idx:
            engine.empty_step()  # this rank's shard of the logical batch is empty: noise only on rank 0
            continue
        batch = (x_train[idx].to(device), y_train[idx].to(device))
        for xb, yb in VirtualBatches(batch, args.physical):
            logits = model(input_ids=xb).logits
            # the mean over the physical batch (loss_reduction="mean"): the engine scales each sample back
            F.cross_entropy(logits, yb).backward()
        optimizer.step()
        optimizer.zero_grad()
    train_s = time.perf_counter() - t0

    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(input_ids=x_test[i:i + 500].to(device)).logits.argmax(-1).cpu()
                          for i in range(0, len(x_test), 500)])
    acc = (pred == y_test).float().mean().item()
    spent = engine.get_privacy_spent()
    sizes = torch.tensor(local_sizes, dtype=torch.float64)
    gathered = [torch.zeros_like(sizes) for _ in range(world)]
    dist.all_gather(gathered, sizes)
    with torch.no_grad():  # a checksum of the parameters: equal on every rank if the updates were identical
        same = torch.cat([p.double().flatten() for p in model.parameters()])
        same = torch.stack([same.sum(), (same * torch.arange(len(same), dtype=torch.float64)).sum()])
    sums = [torch.zeros_like(same) for _ in range(world)]
    dist.all_gather(sums, same)
    if rank == 0:
        per_rank = ", ".join(f"rank {r}: {g.mean():.1f}" for r, g in enumerate(gathered))
        print(f"world size {world} ({dist.get_backend()}), device {device.type}; mean shard size per step: {per_rank}")
        print(f"parameters bit-identical on every rank: {all(torch.equal(s, sums[0]) for s in sums)}")
        print(f"test set: {y_test.float().mean():.3f} of the labels are 1")
        print(f"{'setting':<22}{'epsilon':>9}{'sigma':>8}{'steps':>7}{'test acc':>10}{'time (s)':>10}"
              f"{'MB all-reduced/step':>21}")
        mb = engine.communication["all_reduce_bytes"] / max(1, engine.steps) / 2**20
        print(f"{'DP full fine-tuning':<22}{spent['epsilon']:>9.3f}{engine.noise_multiplier:>8.3f}"
              f"{engine.steps:>7}{acc:>10.4f}{train_s:>10.1f}{mb:>21.3f}")
        print(f"delta = {spent['delta']:.2g}; accountant {spent['accountant']}")
    dist.barrier()  # every rank done with its collectives: gloo can abort a rank torn down while a peer still talks
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
