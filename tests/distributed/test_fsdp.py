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
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from oracle import (
    assert_grads_close,
    ce_per_sample,
    choose_R,
    clipped_sum,
    make_engine,
    make_groups,
    oracle_model,
    per_sample_grads,
    trainable_names,
)
from torch import nn

V, D, T, H = 7, 5, 3, 3  # vocabulary, width, positions, head outputs: none divisible by 2 (or 3 for V, D)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.ln = nn.LayerNorm(D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.ln(torch.tanh(self.lin(h)))


class Tiny(nn.Module):
    def __init__(self, blocks: int = 2, heads: int = H) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.head = nn.Linear(D, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)  # (B, T, H)


class TiedTiny(Tiny):
    """The head's weight is the embedding's (tied through modules, as GPT-2's lm_head and wte)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight


def build(seed: int = 0, variant: str = "default") -> nn.Module:
    torch.manual_seed(seed)
    m = (TiedTiny() if variant == "tied" else Tiny(heads=4) if variant == "head4" else Tiny()).double()
    with torch.no_grad():  # non-trivial LayerNorm affine parameters
        for b in m.blocks:
            b.ln.weight.add_(0.3 * torch.randn(D, dtype=torch.float64))
            b.ln.bias.add_(0.3 * torch.randn(D, dtype=torch.float64))
    return m


def shard(model: nn.Module, blocks=None, root: bool = True) -> nn.Module:
    """``fully_shard`` on each block and (``root``) the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for b in (model.blocks if blocks is None else blocks):
        fully_shard(b, mesh=mesh)
    if root:
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
        if not p.requires_grad:
            assert p.grad is None, f"{n} is frozen but has a .grad"
            continue
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


def _entry(rank: int, world: int, port: int, fn_name: str, kwargs: dict, done_dir: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        globals()[fn_name](rank, world, **kwargs)
        dist.barrier()
        with open(os.path.join(done_dir, f"{rank}.done"), "w") as f:  # every check of this rank passed
            f.write("ok")
    finally:
        dist.destroy_process_group()


def spawn(fn_name: str, world: int, **kwargs) -> None:
    """Run ``fn_name(rank, world, **kwargs)`` (a function of this module) on ``world`` gloo processes; an exception
    on any rank fails the test with that rank's traceback.

    A process killed by SIGABRT after *every* rank finished its checks and passed the final barrier (seen
    occasionally in full-suite runs on this torch: "terminate called without an active exception" while FSDP2 and
    gloo shut down) is reported as a warning, not a failure: the test's assertions all ran and passed. A rank that
    did not finish, or any other exit, still fails the test."""
    with tempfile.TemporaryDirectory() as done_dir:
        try:
            mp.spawn(_entry, args=(world, _free_port(), fn_name, kwargs, done_dir), nprocs=world, join=True)
        except mp.ProcessExitedException as e:
            finished = all(os.path.exists(os.path.join(done_dir, f"{r}.done")) for r in range(world))
            if not (finished and e.signal_name == "SIGABRT"):
                raise
            warnings.warn(f"{fn_name}: every rank passed its checks, then process {e.error_index} aborted during "
                          "process-group shutdown (a torch teardown crash, not a test failure)", stacklevel=2)


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
                 where="middle", reduction="mean", variant="default") -> None:
    """``sizes[k][r]``: samples of rank ``r`` in backward pass ``k`` of the one logical step. ``variant``: "tied"
    (the head's weight is the embedding's), "blocks-only" (the root is not sharded: its parameters are all-reduced,
    the blocks' reduce-scattered)."""
    model = build(variant=variant)
    n = sum(sum(s) for s in sizes)
    x, y = union_batch(n)
    y = y.clamp(max=model.head.out_features - 1)
    batch_size = max(n, 1)  # the expected batch (the divisor); the empty logical batch releases zeros at sigma 0
    bitfit = variant == "bitfit"  # DP-BiTFiT: weights frozen after attach, engine.update_trainable()
    if bitfit:
        om = copy.deepcopy(model)
        for name, p in om.named_parameters():
            p.requires_grad_(name.endswith("bias"))
        R, want = _oracle(om, x, y, style, fn, where, batch_size)
    else:
        R, want = _oracle(model, x, y, style, fn, where, batch_size)
    # "head-sharded": the head, a hooked layer, is itself fully_shard-ed (FSDP unshards it after the engine's
    # pre-hook ran); "head4" at N = 3: its 4 rows split 2, 2, 0 (a rank holds no row)
    shard(model, blocks=[*model.blocks, model.head] if variant == "head-sharded" else None,
          root=variant != "blocks-only")
    engine = make_engine(model, batch_size=batch_size, R=R, fn=fn, style=style, mode=mode, reduction=reduction,
                         verify_structure=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    if bitfit:
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith("bias"))
        engine.update_trainable()
    sharded = sum(1 for n in want if not (variant == "blocks-only" and not n.startswith("blocks.")))
    engine._sharding.refresh()
    assert engine._sharding is not None and len(engine._sharding.params) == sharded
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
    # one reduce-scatter of the padded sums per backward pass: FSDP2's bytes (float64 here), nothing per sample
    padded = sum(world * -(-p.shape[0] // world) * p[0].numel() * 8 for n, p in model.named_parameters()
                 if n in {sp.name for sp in engine._sharding.params.values()})
    assert engine.communication["reduce_scatter_bytes"] == len(sizes) * padded


EXACT_TWO = [
    dict(sizes=[[3, 2]]),  # uneven shards
    dict(sizes=[[1, 0]]),  # batch size 1, an empty shard
    dict(sizes=[[0, 0]]),  # the empty logical batch
    dict(sizes=[[2, 1], [0, 2]]),  # virtual batches (two backward passes), an empty shard in one of them
    dict(sizes=[[2, 3]], style="layer-wise", fn="automatic", reduction="sum"),
    dict(sizes=[[2, 3]], style="all-layer", fn="global", mode="instantiate"),
    dict(sizes=[[2, 3]], style="param-wise", mode="BK-ghost"),
    dict(sizes=[[2, 3]], mode="BK-MixGhostClip", where="below"),
    dict(sizes=[[3, 1]], variant="tied"),  # a weight shared by two modules of the root's FSDP unit
    dict(sizes=[[1, 3]], variant="blocks-only", style="layer-wise"),  # sharded and replicated parameters mixed
    dict(sizes=[[2, 2], [1, 0]], variant="head-sharded"),
    dict(sizes=[[3, 2]], variant="bitfit", style="layer-wise"),
]


def exact_cases_worker(rank: int, world: int, cases: list[dict]) -> None:
    for case in cases:
        exact_worker(rank, world, **case)


def test_fsdp_exact_two_ranks():
    """N = 2: uneven shards, batch size 1, empty shard and empty batch, virtual batches, every mode and style."""
    spawn("exact_cases_worker", 2, cases=EXACT_TWO)


def small_chunk_cases_worker(rank: int, world: int, cases: list[dict]) -> None:
    """The exact cases with every clipped sum above a 4-number noise chunk (``fastdp.noise.NOISE_CHUNK``): sums
    that own their storage are released in place, rows of a reduce-scattered bucket through a fresh tensor (their
    version counter is the bucket's, which the leaked-gradient check reads)."""
    from fastdp import noise

    noise.NOISE_CHUNK = 4
    exact_cases_worker(rank, world, cases)


def test_fsdp_exact_with_in_place_release():
    spawn("small_chunk_cases_worker", 2, cases=[dict(sizes=[[3, 2]]), dict(sizes=[[1, 3]], variant="blocks-only"),
                                                dict(sizes=[[2, 1], [0, 2]])])


def test_fsdp_exact_three_ranks():
    """N = 3: a rank with an empty shard; shards of one row (the head's 3 outputs) and of none (4 outputs)."""
    spawn("exact_cases_worker", 3, cases=[dict(sizes=[[2, 0, 3]]), dict(sizes=[[1, 1, 0], [0, 2, 1]], variant="head4")])


def gpt2_worker(rank: int, world: int, sizes: list[int]) -> None:
    """Hugging Face GPT-2 from a tiny config: Conv1D layers, tied wte / lm_head, broadcast position ids."""
    from model_oracle import LMWrap, gpt2, lm_batches, lm_loss, oracle_for

    torch.manual_seed(0)
    model = LMWrap(gpt2()).double().train()
    n = sum(sizes)
    [((ids,), tgt)] = lm_batches([n], 3)
    _, names, groups, psg = oracle_for(model, lm_loss, [((ids,), tgt)])
    R = choose_R(psg, groups, "middle")
    want = clipped_sum(psg, groups, "abadi", R, n)
    shard(model, blocks=model.m.transformer.h)
    engine = make_engine(model, batch_size=n, R=R, verify_structure=False)
    assert len(engine._sharding.params) == len(names)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    lm_loss(model(split(ids, sizes, rank)), split(tgt, sizes, rank)).mean().backward()
    opt.step()
    assert_grads_close(full_grads(model), want, msg=f"gpt2 rank {rank}")


@pytest.mark.slow
def test_fsdp_exact_gpt2():
    spawn("gpt2_worker", 2, sizes=[2, 1])


# ------------------------------------------------------------------------------------------------ noise
def noise_worker(rank: int, world: int, steps: int, sigma: float, R: float, B: int) -> None:
    model = shard(build())
    gen = torch.Generator().manual_seed(7)  # one seed on every rank, as a user seeds everything alike
    engine = make_engine(model, batch_size=B, R=R, sigma=sigma, verify_structure=False, noise_generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    draws = []
    for k in range(steps):
        if k % 2:
            engine.empty_step()  # noise only, no forward
        else:  # an empty batch through the model: noise only
            x, y = union_batch(0)
            ce_per_sample(model(x), y).sum().backward()
            opt.step()
        grads = full_grads(model)
        draws.append(torch.cat([g.flatten() for g in grads.values()]) * B / (sigma * R))
        if k == 0:  # rank 0's rows and rank 1's rows of the embedding: different streams, not one stream twice
            e = grads["emb.weight"]
            assert not torch.allclose(e[:3], e[4:7]), "two ranks drew the same noise for their rows"
        opt.zero_grad()
    z = torch.stack(draws)
    # each coordinate carries one N(0, sigma^2 R^2) / B draw: z ~ N(0, 1). sqrt(world) times that fails.
    n = z.numel()
    assert abs(float(z.std()) - 1.0) < 6 / math.sqrt(2 * n), f"std {float(z.std())} (n={n})"
    assert abs(float(z.mean())) < 6 / math.sqrt(n)
    assert engine.steps == steps


def secure_noise_worker(rank: int, world: int) -> None:
    model = shard(build())
    engine = make_engine(model, batch_size=2, R=1.0, sigma=1.0, verify_structure=False, secure_mode=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    draws = []
    for _ in range(6):
        engine.empty_step()
        draws.append(torch.cat([g.flatten() for g in full_grads(model).values()]) * 2.0)
    z = torch.stack(draws)
    assert abs(float(z.std()) - 1.0) < 6 / math.sqrt(2 * z.numel()), float(z.std())


def test_fsdp_noise_drawn_once_per_coordinate():
    spawn("noise_worker", 2, steps=16, sigma=1.7, R=0.8, B=4)


@pytest.mark.slow
def test_fsdp_secure_noise():
    spawn("secure_noise_worker", 2)


# ------------------------------------------------------------------------------------------------ checkpoints
def _ckpt_engine(model, opt, sigma: float = 0.6):
    gen = torch.Generator().manual_seed(3)
    engine = make_engine(model, batch_size=4, R=0.9, sigma=sigma, verify_structure=False, noise_generator=gen)
    engine.attach(opt)
    return engine


def _ckpt_step(model, opt, rank: int, k: int) -> None:
    x, y = union_batch(5, seed=100 + k)
    sizes = [3, 2]
    ce_per_sample(model(split(x, sizes, rank)), split(y, sizes, rank)).mean().backward()
    opt.step()
    opt.zero_grad()


def checkpoint_worker(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = shard(build())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = _ckpt_engine(model, opt)
    for k in range(2):
        _ckpt_step(model, opt, rank, k)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    torch.save(engine.state_dict(), os.path.join(path, f"engine{rank}.pt"))
    for k in range(2, 4):
        _ckpt_step(model, opt, rank, k)
    want, eps = full_params(model), engine.get_privacy_spent() if hasattr(engine, "get_privacy_spent") else None
    engine.detach()

    # torch.distributed.checkpoint first: get_state_dict initialises a fresh optimizer's state with a step of its
    # own, which an attached engine refuses (no backward pass); then the engine, attached, and its state
    model2 = shard(build(seed=5))
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    engine2 = _ckpt_engine(model2, opt2)
    other = torch.load(os.path.join(path, f"engine{1 - rank}.pt"), weights_only=False)
    with pytest.raises(ValueError, match="rank"):
        engine2.load_state_dict(other)  # another rank's state: refused, naming the ranks
    mine = torch.load(os.path.join(path, f"engine{rank}.pt"), weights_only=False)
    with pytest.raises(ValueError, match="no shard noise state"):
        engine2.load_state_dict({**mine, "sharded_noise": None})  # an unsharded engine's state: refused
    assert engine2.steps == 0  # a failed load leaves the engine unchanged
    engine2.load_state_dict(torch.load(os.path.join(path, f"engine{rank}.pt"), weights_only=False))
    for k in range(2, 4):
        _ckpt_step(model2, opt2, rank, k)
    got = full_params(model2)
    for n in want:
        assert torch.equal(got[n], want[n]), f"rank {rank}: {n} differs after resuming"
    assert engine2.steps == 4
    if eps is not None:
        assert engine2.get_privacy_spent() == eps


def test_fsdp_checkpoint_resumes_bit_identically():
    with tempfile.TemporaryDirectory() as d:
        spawn("checkpoint_worker", 2, path=d)


# ------------------------------------------------------------------------------------------------ refusals
class Scale(nn.Module):
    """A raw parameter: the generic per-sample path."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(D, dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.s


class TiedByFunction(Tiny):
    """The head's weight read by the root's forward through F.linear: a use outside its module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return nn.functional.linear(h, self.head.weight) + self.head(h)


def refusal_worker(rank: int, world: int) -> None:
    from fastdp.sharding import ShardingError

    def engine_for(model, **kw):
        kw.setdefault("verify_structure", False)
        return make_engine(model, batch_size=4, **kw)

    with pytest.raises(ShardingError, match="verify_structure=True"):
        engine_for(shard(build()), verify_structure=True)
    with pytest.raises(ShardingError, match="not distributed"):
        engine_for(shard(build()), distributed=False)
    with pytest.raises(ShardingError, match="clipping_mode='ghost'"):
        engine_for(shard(build()), mode="ghost")
    m = build()
    m.blocks[1].scale = Scale()
    with pytest.raises(ShardingError, match=r"blocks\.1\.scale\.s"):
        engine_for(shard(m))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    m = nn.Sequential(nn.Linear(4, 4)).double()
    fully_shard(m, mesh=init_device_mesh("cpu", (world,)), shard_placement_fn=lambda p: Shard(p.dim() - 1))
    with pytest.raises(ShardingError, match=r"'0\.weight' has placements \(Shard\(dim=1\),\)"):
        engine_for(m)
    # a rank whose clipping fails (non-finite gradients): every rank raises, nothing is released, no hang
    m = shard(build())
    engine = engine_for(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    engine.attach(opt)
    x, y = union_batch(4)
    loss = ce_per_sample(m(split(x, [2, 2], rank)), split(y, [2, 2], rank)).mean()
    with pytest.raises(RuntimeError, match="non-finite|NaN|rank\\(s\\) \\[1\\] failed"):
        (loss * (float("nan") if rank == 1 else 1.0)).backward()
    assert engine.steps == 0 and not engine._release.summed
    engine.detach()
    # a sharded parameter used outside its module: refused in the backward pass, on every rank, never released
    torch.manual_seed(0)
    m = shard(TiedByFunction().double())
    engine = engine_for(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    engine.attach(opt)
    x, y = union_batch(4)
    with pytest.raises(RuntimeError, match="outside"):
        ce_per_sample(m(split(x, [2, 2], rank)), split(y, [2, 2], rank)).mean().backward()
    assert engine.steps == 0


def test_fsdp_refusals():
    spawn("refusal_worker", 2)


def skipped_backward_worker(rank: int, world: int) -> None:
    """Rank 1 skips its backward pass. With FSDP's backward all-gathers (the default reshard_after_forward=True)
    that is a mismatch of FSDP's own collectives (gloo aborts); without them, the engine tells the ranks apart:
    rank 0 raises naming rank 1, rank 1's step fails once rank 0 is gone. Nothing is released on either."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fastdp.distributed import CollectiveError

    m = build()
    mesh = init_device_mesh("cpu", (world,))
    for b in m.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=False)
    fully_shard(m, mesh=mesh, reshard_after_forward=False)
    engine = make_engine(m, batch_size=4, verify_structure=False)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    engine.attach(opt)
    x, y = union_batch(4)
    loss = ce_per_sample(m(split(x, [2, 2], rank)), split(y, [2, 2], rank)).mean()
    if rank == 0:
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] called optimizer.step\(\)"):
            loss.backward()
    else:
        with pytest.raises(CollectiveError):
            opt.step()
    assert engine.steps == 0 and all(p.grad is None for p in m.parameters())
    os._exit(0)  # the ranks' collectives no longer match: leave without the harness's barrier


def test_fsdp_rank_skipping_backward():
    spawn("skipped_backward_worker", 2)
