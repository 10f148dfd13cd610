"""Sharded DP fine-tuning with FSDP2 (``fully_shard``): each rank holds 1/N of the parameters; the step is exact.

Launch with torchrun (CPU: gloo; one GPU per process: NCCL, unchanged)::

    torchrun --standalone --nproc-per-node 2 examples/fully_shard.py            # about 15 s on 2 CPU cores: acc 1.0
    torchrun --standalone --nproc-per-node 2 examples/fully_shard.py --quick    # a few seconds

The model and the data are those of ``examples/distributed.py`` (a small BERT classifier from a config; a synthetic
task). Here the model is sharded: ``fully_shard`` on each encoder layer and on the root, before the engine is built.
What changes against the data-parallel example:

* the structure probe runs once, on the unsharded model in this process (``fastdp.validate.verify_structure`` on a
  batch of the training shapes), and the engine is built with ``verify_structure=False`` (the probe's extra passes
  would run FSDP's collectives on one rank only);
* every rank runs the same number of forward/backward passes per step, because FSDP all-gathers the parameters of
  each layer on every rank: the ranks agree on the number of micro-batches (the largest over the ranks) and each
  rank splits its samples evenly into that many (Hugging Face BERT cannot run an empty batch; with a model that
  can, a rank with fewer samples than micro-batches, or none, runs empty ones); an empty logical batch is an
  ``engine.empty_step()`` on every rank;
* ``optimizer.step()``: each sharded parameter's clipped sum was reduce-scattered at the end of each backward pass,
  and each rank adds the noise of its own rows, drawn once; ``p.grad`` is a sharded DTensor.

Rank 0 prints the table: epsilon, sigma, steps, test accuracy, time, and the MB reduce-scattered per step.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fastdp
from fastdp.data import DistributedPoissonSampler, VirtualBatches

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed import make_model, parse_args, setup, training_data  # noqa: E402  (the data-parallel example's)


def micro_batches(batch: tuple[torch.Tensor, torch.Tensor], physical: int, device: torch.device) -> list:
    """This rank's samples in as many micro-batches (of at most ``physical`` rows) as the rank that needs the most:
    every rank runs the same number of forward/backward passes, as FSDP requires."""
    n = torch.tensor([len(VirtualBatches(batch, physical))], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    rows = len(batch[0])
    if rows < int(n):  # not with this example's batch sizes (a shard of 256 expected samples)
        raise RuntimeError(f"{rows} samples on this rank for {int(n)} micro-batches: Hugging Face BERT cannot run an "
                           "empty micro-batch (a model that can would run it); use a larger batch size")
    return list(zip(*(torch.tensor_split(t, int(n)) for t in batch), strict=True))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rank, world, device = setup()
    n_train, x_train, y_train, x_test, y_test, epochs = training_data(args)

    model = make_model().to(device)
    # the structure probe on the unsharded model, in this process (no collectives), at the training input shapes
    fastdp.validate.verify_structure(model, input_ids=x_train[:8].to(device))
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = fastdp.PrivacyEngine(model, batch_size=args.batch_size, sample_size=n_train, epochs=epochs,
                                  target_epsilon=args.epsilon, max_grad_norm=1.0, verify_structure=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    engine.attach(optimizer)
    steps = fastdp.accounting.steps_from_epochs(epochs, engine.sample_rate)
    sampler = DistributedPoissonSampler(n_train, batch_size=args.batch_size, steps=steps,
                                        generator=torch.Generator().manual_seed(100 + rank))

    t0 = time.perf_counter()
    model.train()
    for idx in sampler:
        batch = (x_train[idx].to(device), y_train[idx].to(device))
        total = torch.tensor([len(idx)], device=device)
        dist.all_reduce(total)
        if int(total) == 0:  # the whole logical batch is empty: every rank takes a noise-only step, no forward
            engine.empty_step()
            continue
        for xb, yb in micro_batches(batch, args.physical, device):
            F.cross_entropy(model(input_ids=xb).logits, yb).backward()
        optimizer.step()
        optimizer.zero_grad()
    train_s = time.perf_counter() - t0
    local = sum(p.to_local().numel() for p in model.parameters())  # the sharded parameters (outside a forward)
    total = sum(p.numel() for p in model.parameters())

    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(input_ids=x_test[i:i + 500].to(device)).logits.argmax(-1).cpu()
                          for i in range(0, len(x_test), 500)])
    acc = (pred == y_test).float().mean().item()
    spent = engine.get_privacy_spent()
    if rank == 0:
        print(f"world size {world} ({dist.get_backend()}), device {device.type}; rank 0 holds {local} of {total} "
              f"parameters")
        print(f"{'setting':<22}{'epsilon':>9}{'sigma':>8}{'steps':>7}{'test acc':>10}{'time (s)':>10}"
              f"{'MB reduce-scattered/step':>26}")
        mb = engine.communication["reduce_scatter_bytes"] / max(1, engine.steps) / 2**20
        print(f"{'DP FSDP2 fine-tuning':<22}{spent['epsilon']:>9.3f}{engine.noise_multiplier:>8.3f}"
              f"{engine.steps:>7}{acc:>10.4f}{train_s:>10.1f}{mb:>26.3f}")
        print(f"delta = {spent['delta']:.2g}; accountant {spent['accountant']}")
    dist.barrier()  # every rank done with its collectives: gloo can abort a rank torn down while a peer still talks
    dist.destroy_process_group()
    assert math.isfinite(spent["epsilon"])


if __name__ == "__main__":
    main()
