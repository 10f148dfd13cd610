"""FSDP2 (``fully_shard``) under the PrivacyEngine, on gloo CPU processes (fastdp.sharding).

Every rank builds the same small transformer-like model (Embedding, blocks of Linear + LayerNorm, a head), applies
``fully_shard`` to each block and the root (uneven shards: no dimension divides by the world size), and runs its
part of a logical batch; the released gradient (``p.grad.full_tensor()``) must equal, on every rank, the brute-force
batch-of-one oracle on the union batch (float64, 1e-6). Noise: each rank draws its rows' noise once (std test and
distinct streams); checkpoints through ``torch.distributed.checkpoint`` resume bit-identically.
"""

from __future__ import annotations

import copy
import datetime
import math
import os
import socket
import sys
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from oracle import assert_grads_close, ce_per_sample, choose_R, make_engine, make_groups  # noqa: E402
from oracle import clipped_sum, oracle_model, per_sample_grads, trainable_names  # noqa: E402

V, D, T, H = 7, 5, 3, 3  # vocabulary, width, positions, head outputs: none divisible by 2 (or 3 for V, D)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.ln = nn.LayerNorm(D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.ln(torch.tanh(self.lin(h)))


class Tiny(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.head = nn.Linear(D, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)  # (B, T, H)


def build(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = Tiny().double()
    with torch.no_grad():  # non-trivial LayerNorm affine parameters
        for b in m.blocks:
            b.ln.weight.add_(0.3 * torch.randn(D, dtype=torch.float64))
            b.ln.bias.add_(0.3 * torch.randn(D, dtype=torch.float64))
    return m


def shard(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def union_batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n, T), generator=g), torch.randint(0, H, (n, T), generator=g)


def split(x: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    return x[start:start + sizes[rank]]


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter's released gradient, gathered (a collective: every rank calls it)."""
    out = {}
    for n, p in model.named_parameters():
        assert p.grad is not None, f"{n}: no .grad after optimizer.step()"
        g = p.grad
        out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------------ spawn helper
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn_name: str, kwargs: dict) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        globals()[fn_name](rank, world, **kwargs)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn_name: str, world: int, **kwargs) -> None:
    """Run ``fn_name(rank, world, **kwargs)`` (a function of this module) on ``world`` gloo processes; an exception
    on any rank fails the test with that rank's traceback."""
    mp.spawn(_entry, args=(world, _free_port(), fn_name, kwargs), nprocs=world, join=True)


# ------------------------------------------------------------------------------------------------ workers
def _oracle(model: nn.Module, x: torch.Tensor, y: torch.Tensor, style, fn: str, where: str, batch_size: int):
    om = oracle_model(model)
    names = trainable_names(om)
    psg = per_sample_grads(om, ce_per_sample, [(x, y)], names)
    groups = make_groups(om, style, names)
    if x.shape[0] == 0:  # the empty batch: nothing to clip, the released gradient is zero at sigma = 0
        return 1.0, {n: torch.zeros_like(p) for n, p in om.named_parameters()}
    R = choose_R(psg, groups, where)
    return R, clipped_sum(psg, groups, fn, R, batch_size)


def exact_worker(rank: int, world: int, sizes: list[list[int]], style="all-layer", fn="abadi", mode="BK-MixOpt",
                 where="middle", reduction="mean") -> None:
    """``sizes[k][r]``: samples of rank ``r`` in backward pass ``k`` of the one logical step."""
    model = build()
    n = sum(sum(s) for s in sizes)
    x, y = union_batch(n)
    batch_size = max(n, 1)  # the expected batch (the divisor); the empty logical batch releases zeros at sigma 0
    R, want = _oracle(model, x, y, style, fn, where, batch_size)
    shard(model)
    engine = make_engine(model, batch_size=batch_size, R=R, fn=fn, style=style, mode=mode, reduction=reduction,
                         verify_structure=False)
    assert engine._sharding is not None and len(engine._sharding.params) == len(want)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    start = 0
    for pass_sizes in sizes:
        xs, ys = x[start:start + sum(pass_sizes)], y[start:start + sum(pass_sizes)]
        start += sum(pass_sizes)
        xr, yr = split(xs, pass_sizes, rank), split(ys, pass_sizes, rank)
        per = ce_per_sample(model(xr), yr)
        (per.mean() if reduction == "mean" else per.sum()).backward()
    for p in model.parameters():
        assert p.grad is None, "FSDP's own (non-private) reduce-scatter wrote a gradient"
    opt.step()
    got = full_grads(model)
    assert_grads_close(got, want, msg=f"rank {rank}/{world} sizes {sizes} {style} {fn} {mode}")
    assert engine.steps == 1


@pytest.mark.parametrize("sizes", [
    [[3, 2]],  # uneven shards
    [[1, 0]],  # batch size 1, an empty shard
    [[0, 0]],  # the empty logical batch
    [[2, 1], [0, 2]],  # virtual batches (two backward passes), an empty shard in one of them
])
def test_fsdp_exact_two_ranks(sizes):
    spawn("exact_worker", 2, sizes=sizes)


@pytest.mark.parametrize("style,fn,mode", [
    ("layer-wise", "automatic", "BK-MixOpt"),
    ("all-layer", "global", "instantiate"),
    ("param-wise", "abadi", "BK-ghost"),
])
def test_fsdp_exact_styles(style, fn, mode):
    spawn("exact_worker", 2, sizes=[[2, 3]], style=style, fn=fn, mode=mode, reduction="sum")


def test_fsdp_exact_three_ranks():
    spawn("exact_worker", 3, sizes=[[2, 0, 3]])
