"""The cases the distributed worlds run, and the oracle side of each (shared by the ranks and the pytest process).

Everything here is deterministic from a :class:`Spec`: the model (built from a seed), every rank's shard of the
logical batch (a list of physical batches, generated from the seed in rank order), and the engine's arguments. A
rank runs its shard through a distributed engine and returns what it released; the parent computes the
brute-force batch-of-one oracle (tests/oracle.py: float64 copy, one backward per sample, clip, sum) on the UNION of
the shards and compares.

Sizes: the mixed model has vocabulary 11, T=7 positions, widths 6 / 5 / 4 and 3 classes; shards of 0-7 samples, so
batch sizes equal to a width or T occur. The noise model is a Linear(500, 400) (200,400 coordinates).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from model_oracle import check_discriminates, lm_loss
from oracle import (
    call_model,
    choose_R,
    clipped_sum,
    make_engine,
    make_groups,
    max_clip_factor,
    oracle_model,
    per_sample_grads,
    released_grads,
    trainable_names,
    user_loss,
)
from torch import nn

D = torch.float64


# --------------------------------------------------------------------------------------------- models


class Mixed(nn.Module):
    """Embedding -> Conv1d -> (+ a buffer) -> LayerNorm -> Linear -> mean over positions -> Linear head:
    ids (B, 7) -> (B, 3). The buffer is part of the function, so rank 0's must be broadcast too."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.conv = nn.Conv1d(6, 5, 3, padding=1)
        self.norm = nn.LayerNorm(5)
        self.fc = nn.Linear(5, 4)
        self.head = nn.Linear(4, 3)
        self.register_buffer("shift", 0.5 * torch.randn(5))
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.3)
            self.norm.bias.normal_(0.0, 0.3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.emb(ids).transpose(1, 2)).transpose(1, 2) * (1 + self.shift)
        h = torch.tanh(self.fc(torch.tanh(self.norm(h))))
        return self.head(h.mean(1))


class TinyViT(nn.Module):
    """Patch Linear, a raw class token (1, 1, d) and position embedding (1, P + 1, d) (the generic path), LayerNorm,
    head: patches (B, 4, 5) -> (B, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(5, 6)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 6))
        self.pos_embed = nn.Parameter(0.5 * torch.randn(1, 5, 6))
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], 1) + self.pos_embed
        h = torch.tanh(self.norm(h))
        return self.head(h[:, 0] + h.mean(1))


class TiedLM(nn.Module):
    """Embedding whose weight is also the LM head's (GPT-2's tie), one Linear between: ids (B, 7) -> (B, 7, 13)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.fc = nn.Linear(6, 6)
        self.lm_head = nn.Linear(6, 13, bias=False)
        self.lm_head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.fc(self.emb(ids))))


class Big(nn.Module):
    """Linear(500, 400): 200,400 coordinates for the noise statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(500, 400)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Many(nn.Module):
    """60 Linear(2, 2) layers named layer000 ... layer059 in a chain: 120 trainable tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({f"layer{i:03d}": nn.Linear(2, 2) for i in range(60)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


def _gpt2() -> nn.Module:
    from model_oracle import LMWrap, gpt2

    return LMWrap(gpt2())


BUILDERS = {"mixed": Mixed, "vit": TinyViT, "tied": TiedLM, "big": Big, "gpt2": _gpt2, "many": Many}


def build(kind: str, seed: int) -> nn.Module:
    """The float64 model ``kind`` with parameters from ``seed`` (the same on every process)."""
    torch.manual_seed(seed)
    model = BUILDERS[kind]().to(D)
    model.train()
    return model


def cls_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y, reduction="none")


def mse_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (out - y).pow(2).flatten(1).sum(1)


LOSSES = {"mixed": cls_loss, "vit": cls_loss, "tied": lm_loss, "big": mse_loss, "gpt2": lm_loss}


def make_batch(kind: str, n: int, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """One physical batch of ``n`` samples ``((x,), y)`` for model ``kind``."""
    g = torch.Generator().manual_seed(seed)
    if kind == "mixed":
        return (torch.randint(0, 11, (n, 7), generator=g),), torch.randint(0, 3, (n,), generator=g)
    if kind == "vit":
        return (torch.randn(n, 4, 5, generator=g, dtype=D),), torch.randint(0, 3, (n,), generator=g)
    if kind == "tied":
        ids = torch.randint(0, 13, (n, 7), generator=g)
        return (ids,), ids
    if kind == "gpt2":
        ids = torch.randint(0, 61, (n, 7), generator=g)
        return (ids,), ids
    if kind == "big":
        return (torch.randn(n, 500, generator=g, dtype=D),), torch.randn(n, 400, generator=g, dtype=D)
    raise ValueError(kind)


# --------------------------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class Spec:
    """One logical step on N ranks.

    ``shards[r]``: rank r's physical batch sizes (several = virtual batches; 0 = a 0-row batch run through forward
    and backward), or ``None``: rank r calls ``engine.empty_step()`` instead of ``optimizer.step()``.
    ``model_seeds``: a different model seed per rank (rank 0's parameters must be broadcast; the oracle uses them).
    ``style="groups"``: an explicit partition of the trainable names (even / odd positions).
    ``frozen``: parameter names frozen (``requires_grad=False``) before the engine is built.
    """

    model: str
    shards: tuple[tuple[int, ...] | None, ...]
    seed: int = 0
    mode: str = "BK-MixOpt"
    fn: str = "abadi"
    style: str = "all-layer"
    reduction: str = "mean"
    bitfit: bool = False
    batch_size: int | None = None
    model_seeds: tuple[int, ...] | None = None
    where: str = "middle"
    frozen: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.shards)

    @property
    def samples(self) -> int:
        return sum(sum(s) for s in self.shards if s is not None)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size if self.batch_size is not None else max(1, self.samples)


def shard_batches(spec: Spec) -> list[list[tuple]]:
    """Every rank's physical batches (generated in rank order from ``spec.seed``)."""
    out, k = [], 0
    for shard in spec.shards:
        mine = []
        for n in shard or ():
            mine.append(make_batch(spec.model, n, 1000 * spec.seed + k))
            k += 1
        out.append(mine)
    return out


def prepare(model: nn.Module, spec: Spec) -> None:
    """Freeze what the spec freezes (``frozen``; DP-BiTFiT: biases and the head train)."""
    params = dict(model.named_parameters())
    for n in spec.frozen:
        params[n].requires_grad_(False)
    if spec.bitfit:
        from fastdp.bitfit import freeze_all_but_bias

        freeze_all_but_bias(model, keep=("head",) if hasattr(model, "head") else ())


def resolve_style(spec: Spec, names: list[str]) -> Any:
    if spec.style == "groups":
        return [names[0::2], names[1::2]] if len(names) > 1 else [names]
    return spec.style


def oracle_for(spec: Spec, R: float | None = None) -> dict[str, Any]:
    """The oracle of one logical step on the union of the shards: R (chosen so that clipping matters, unless
    given), the wanted released gradient ``sum_i C_i g_i / B`` and the absolute tolerance."""
    model = build(spec.model, spec.model_seeds[0] if spec.model_seeds else spec.seed)
    prepare(model, spec)
    names = trainable_names(model)
    union = [b for bs in shard_batches(spec) for b in bs]
    om = oracle_model(model)
    style = resolve_style(spec, names)
    groups = make_groups(om, style, names)
    psg = per_sample_grads(om, LOSSES[spec.model], union, names)
    B = spec.global_batch_size
    if spec.samples:
        if R is None:
            R = choose_R(psg, groups, spec.where, gap=1e-6)
            want = clipped_sum(psg, groups, spec.fn, R, B)
            check_discriminates(psg, groups, spec.fn, R, B, want, 1e-6)
        else:
            want = clipped_sum(psg, groups, spec.fn, R, B)
        atol = 1e-10 * max(1.0, max_clip_factor(psg, groups, spec.fn, R))
    else:
        R, atol = (1.0 if R is None else R), 1e-10
        want = {n: torch.zeros_like(p) for n, p in om.named_parameters() if n in names}
    return {"R": R, "want": want, "atol": atol, "names": names}


# --------------------------------------------------------------------------------------------- rank side


def _engine_and_opt(model: nn.Module, spec: Spec, R: float, lr: float = 1.0, **kw: Any):
    names = trainable_names(model)
    engine = make_engine(model, batch_size=spec.global_batch_size, R=R, fn=spec.fn,
                         style=resolve_style(spec, names), mode=spec.mode, reduction=spec.reduction, **kw)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD([params[n] for n in names], lr=lr)
    engine.attach(opt)
    return engine, opt, names


def _run_shard(model: nn.Module, spec: Spec, batches: list[tuple]) -> None:
    dtype = next(model.parameters()).dtype
    for x, y in batches:
        if dtype != D:
            x = tuple(t.to(dtype) if t.is_floating_point() else t for t in x)
            y = y.to(dtype) if y.is_floating_point() else y
        per = LOSSES[spec.model](call_model(model, x), y)
        user_loss(per, spec.reduction).backward()


def _step(engine: Any, opt: torch.optim.Optimizer, model: nn.Module, spec: Spec, rank: int,
          batches: list[tuple]) -> None:
    if spec.shards[rank] is None:
        engine.empty_step()
    else:
        _run_shard(model, spec, batches)
        opt.step()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_exact(ctx: Any, spec: Spec, R: float, bucket_bytes: int | None = None, **kw: Any) -> dict[str, Any]:
    """One logical step of ``spec`` on this rank; returns what it released (and the parameters after SGD).
    ``bucket_bytes``: the engine's all-reduce buckets that small (many buckets; its default argument, patched for
    this case only)."""
    if bucket_bytes is None:
        return _run_exact(ctx, spec, R, **kw)
    from fastdp.distributed import Group

    old = Group.all_reduce_sum.__defaults__
    Group.all_reduce_sum.__defaults__ = (bucket_bytes,)
    try:
        return _run_exact(ctx, spec, R, **kw)
    finally:
        Group.all_reduce_sum.__defaults__ = old


def _run_exact(ctx: Any, spec: Spec, R: float, **kw: Any) -> dict[str, Any]:
    model = build(spec.model, spec.model_seeds[ctx.rank] if spec.model_seeds else spec.seed)
    prepare(model, spec)
    engine, opt, names = _engine_and_opt(model, spec, R, **kw)
    _step(engine, opt, model, spec, ctx.rank, shard_batches(spec)[ctx.rank])
    return {"grads": released_grads(model, names), "params": _params(model), "world_size": engine.world_size,
            "rank": engine.rank, "steps": engine.steps}


def run_noise(ctx: Any, spec: Spec, R: float, sigma: float, steps: int, lr: float,
              gen_seeds: tuple[int, ...] | None = None, secure_mode: bool = False,
              float32: bool = False) -> dict[str, Any]:
    """``steps`` noisy steps of the same shards (each step's data from ``spec.seed + step``); returns the first
    step's released gradient, the final parameters and the privacy spent. ``float32``: the model and its float
    inputs in float32 (the clipped sums and the noise then cross ranks in float32)."""
    model = build(spec.model, spec.seed)
    if float32:
        model = model.float()
    gen = None if gen_seeds is None else torch.Generator().manual_seed(gen_seeds[ctx.rank])
    engine, opt, names = _engine_and_opt(model, spec, R, lr=lr, sigma=sigma, noise_generator=gen,
                                         secure_mode=secure_mode)
    first = None
    for k in range(steps):
        s = replace(spec, seed=spec.seed + k)
        opt.zero_grad()
        _step(engine, opt, model, s, ctx.rank, shard_batches(s)[ctx.rank])
        if first is None:
            first = released_grads(model, names)
    return {"grad1": first, "params": _params(model), "steps": engine.steps,
            "spent": engine.get_privacy_spent()}


def run_accounting(ctx: Any, spec: Spec, steps: int, sigma: float, sample_size: int, accountant: str,
                   check_rate: bool = False) -> dict[str, Any]:
    """``steps`` noisy steps; per step: the engine's steps and get_privacy_spent() on this rank."""
    model = build(spec.model, spec.seed)
    engine, opt, _ = _engine_and_opt(model, spec, 1.0, lr=0.1, sigma=sigma, sample_size=sample_size,
                                     accountant=accountant, check_rate=check_rate)
    out = []
    for k in range(steps):
        s = replace(spec, seed=spec.seed + k)
        _step(engine, opt, model, s, ctx.rank, shard_batches(s)[ctx.rank])
        opt.zero_grad()
        out.append({"steps": engine.steps, "spent": engine.get_privacy_spent(),
                    "sampled": engine._release.sampling.total})
    return {"per_step": out}


def run_communication(ctx: Any, spec: Spec, big: Spec) -> dict[str, Any]:
    """Every torch.distributed collective the engine calls during one step, counted (calls and tensor bytes), for
    two shard sizes (``spec`` and ``big``: more samples per rank): the per-step traffic must not grow with the batch
    (per-sample norms never cross ranks) and the all-reduce must carry exactly the trainable parameters' size."""
    import torch.distributed as dist

    counted: dict[str, list[int]] = {}
    real = {n: getattr(dist, n) for n in ("all_reduce", "all_gather", "all_gather_object", "broadcast",
                                          "reduce_scatter", "all_to_all", "gather", "scatter",
                                          "broadcast_object_list", "all_gather_into_tensor")}

    def wrap(name: str):
        def f(*a: Any, **k: Any) -> Any:
            nbytes = 0
            for x in list(a) + list(k.values()):
                for t in (x if isinstance(x, (list, tuple)) else [x]):
                    if isinstance(t, torch.Tensor):
                        nbytes += t.numel() * t.element_size()
            counted.setdefault(name, []).append(nbytes)
            return real[name](*a, **k)
        return f

    out: dict[str, Any] = {}
    for label, s in (("small", spec), ("big", big)):
        model = build(s.model, s.seed)
        engine, opt, names = _engine_and_opt(model, s, 1.0)
        counted.clear()
        for n in real:
            setattr(dist, n, wrap(n))
        try:
            _step(engine, opt, model, s, ctx.rank, shard_batches(s)[ctx.rank])
        finally:
            for n, f in real.items():
                setattr(dist, n, f)
        out[label] = {"counted": {k: list(v) for k, v in counted.items()}, "engine": engine.communication,
                      "param_bytes": sum(p.numel() * p.element_size() for p in engine.trainable_parameters.values())}
        engine.detach()
    return out


def run_fixed_size(ctx: Any, spec: Spec, steps: int, sample_size: int) -> dict[str, Any]:
    """``steps`` steps whose global batch always has the same size (a plain shuffled loader's symptom), with the
    real sample-rate monitor: the step at which each rank warns about fixed-size batches (None: never)."""
    import warnings

    model = build(spec.model, spec.seed)
    engine, opt, _ = _engine_and_opt(model, spec, 1.0, lr=0.0, sigma=1.0, sample_size=sample_size,
                                     check_rate=True)
    warned = None
    for k in range(steps):
        s = replace(spec, seed=spec.seed + k)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(engine, opt, model, s, ctx.rank, shard_batches(s)[ctx.rank])
        if warned is None and any("fixed-size" in str(w.message) for w in caught):
            warned = k + 1
    return {"warned_at": warned, "steps": engine.steps}


def run_budget_exhausted(ctx: Any, spec: Spec, planned: int) -> dict[str, Any]:
    """enforce_budget with sigma calibrated for ``planned`` steps: step ``planned + 1`` must be refused on every
    rank (PrivacyBudgetExceeded), nothing released, epsilon the same everywhere."""
    model = build(spec.model, spec.seed)
    engine, opt, _ = _engine_and_opt(model, spec, 1.0, lr=0.1, sigma=None, target_epsilon=1.0, steps=planned,
                                     enforce_budget=True, sample_size=1000, accountant="rdp")
    for k in range(planned):
        opt.zero_grad(set_to_none=True)
        s = replace(spec, seed=spec.seed + k)
        _step(engine, opt, model, s, ctx.rank, shard_batches(s)[ctx.rank])
    opt.zero_grad(set_to_none=True)
    before = _params(model)
    s = replace(spec, seed=spec.seed + planned)
    out = _outcome(lambda: _step(engine, opt, model, s, ctx.rank, shard_batches(s)[ctx.rank]))
    out["grads"] = _grads_or_none(model)
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    out["steps"] = engine.steps
    out["epsilon"] = engine.get_privacy_spent()["epsilon"]
    return out


def run_rate_refused(ctx: Any, spec: Spec, sample_size: int) -> dict[str, Any]:
    """A step whose GLOBAL batch is far above the declared rate while each rank's shard alone is not: the
    sample-rate check (the real monitor) must refuse it on every rank, with nothing released."""
    model = build(spec.model, spec.seed)
    engine, opt, _ = _engine_and_opt(model, spec, 1.0, sigma=1.0, sample_size=sample_size, check_rate=True)
    out = _outcome(lambda: _step(engine, opt, model, spec, ctx.rank, shard_batches(spec)[ctx.rank]))
    out["grads"] = _grads_or_none(model)
    out["steps"] = engine.steps
    out["ledger"] = engine.accountant.ledger.steps
    return out


def _grads_or_none(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return {"raised": True, "type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
                "msg": str(e)}
    return {"raised": False}


def run_refused_step(ctx: Any, spec: Spec, R: float, scenario: str, culprit: int = 1,
                     sigma: float = 0.0) -> dict[str, Any]:
    """A first step that rank ``culprit`` spoils (``scenario``), then a valid step on ``spec``'s shards.

    Scenarios: ``"skip_backward"`` (the culprit runs no backward and calls optimizer.step()), ``"frozen"`` (after
    its backward pass it freezes ``fc.weight`` without telling the engine), ``"update_trainable"`` (it freezes
    ``fc.weight`` and calls engine.update_trainable(), the others do not), ``"sigma"`` (it calls
    engine.set_noise_multiplier(0.5) alone). The first step's data come from another seed, so a leak of its
    sums into the second step shows against the oracle of ``spec``. Returns the outcome of the first step on this
    rank, the gradients and steps right after it, and the second step's released gradients (or its outcome)."""
    model = build(spec.model, spec.seed)
    engine, opt, names = _engine_and_opt(model, spec, R, sigma=sigma,
                                         noise_generator=torch.Generator().manual_seed(5))
    before = _params(model)
    bad = replace(spec, seed=spec.seed + 77)
    culprit_here = ctx.rank == culprit
    res: dict[str, Any] = {}
    if culprit_here and scenario == "update_trainable":
        model.fc.weight.requires_grad_(False)
        res["update"] = _outcome(engine.update_trainable)
    if culprit_here and scenario == "sigma":
        engine.set_noise_multiplier(0.5)
    if not (culprit_here and scenario == "skip_backward"):
        _run_shard(model, bad, shard_batches(bad)[ctx.rank])
    if culprit_here and scenario == "frozen":  # after its backward pass, before the step
        model.fc.weight.requires_grad_(False)
    res["first"] = _outcome(opt.step)
    res["after_first"] = {"grads": _grads_or_none(model), "steps": engine.steps,
                          "unchanged": all(torch.equal(p, before[n]) for n, p in model.named_parameters()),
                          "ledger": engine.accountant.ledger.steps}
    # the second, valid step: the culprit undoes its change
    if culprit_here and scenario in ("frozen", "update_trainable"):
        model.fc.weight.requires_grad_(True)
        if scenario == "update_trainable":
            engine.update_trainable()
    if culprit_here and scenario == "sigma":
        engine.set_noise_multiplier(sigma)
    opt.zero_grad(set_to_none=True)
    before2 = _params(model)
    second = _outcome(lambda: (_run_shard(model, spec, shard_batches(spec)[ctx.rank]), opt.step()))
    res["second"] = second
    if not second["raised"]:
        res["grads2"] = released_grads(model, names)
        res["params_before2"] = before2
    res["steps"] = engine.steps
    return res


def run_construct(ctx: Any, kind: str, scenario: str) -> dict[str, Any]:
    """Build an engine where the ranks disagree (``"frozen"``: rank 1 froze ``fc.weight``; ``"max_grad_norm"``:
    rank 1 has R=2 instead of 1), or wrap the model in DistributedDataParallel (``"ddp"``); returns the outcome."""
    model = build(kind, 0)
    R = 1.0
    if scenario == "frozen" and ctx.rank == 1:
        dict(model.named_parameters())["layers.layer030.weight" if kind == "many" else "fc.weight"].requires_grad_(
            False)
    if scenario == "max_grad_norm" and ctx.rank == 1:
        R = 2.0
    if scenario == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    return _outcome(lambda: make_engine(model, batch_size=4, R=R))


def run_distributed_flags(ctx: Any, spec: Spec, R: float) -> dict[str, Any]:
    """``distributed=False`` inside an initialised world: an independent one-process engine per rank (its release
    is the oracle of its own shard); ``engine.world_size`` / ``engine.rank`` of both kinds of engine."""
    model = build(spec.model, spec.seed + ctx.rank)  # different models: nothing may be broadcast
    engine, opt, names = _engine_and_opt(model, spec, R, distributed=False)
    before = _params(model)
    _step(engine, opt, model, spec, ctx.rank, shard_batches(spec)[ctx.rank])
    res = {"local": {"world_size": engine.world_size, "rank": engine.rank,
                     "grads": released_grads(model, names), "before": before}}
    engine.detach()
    model2 = build(spec.model, spec.seed)
    engine2 = make_engine(model2, batch_size=4, R=1.0)
    res["default"] = {"world_size": engine2.world_size, "rank": engine2.rank}
    model3 = build(spec.model, spec.seed)
    engine3 = make_engine(model3, batch_size=4, R=1.0, distributed=True)
    res["explicit"] = {"world_size": engine3.world_size, "rank": engine3.rank}
    return res


def run_subgroup(ctx: Any, spec: Spec, R: float, ranks: tuple[int, ...] = (0, 1)) -> dict[str, Any]:
    """``process_group=`` a group of some ranks of a larger world: only they train; their union is the batch, and
    ``spec.shards[i]`` is the shard of the group's i-th rank (group rank i)."""
    import torch.distributed as dist

    sub = dist.new_group(list(ranks))  # every rank of the world must call new_group
    if ctx.rank not in ranks:
        return {"skipped": True}
    return run_exact(replace(ctx, rank=ranks.index(ctx.rank)), spec, R, process_group=sub)


def run_update_both(ctx: Any, spec: Spec, R: float) -> dict[str, Any]:
    """Every rank builds the engine on the whole model, then freezes ``spec.frozen`` and calls update_trainable()
    (the same change everywhere): the step releases the oracle of the new trainable set."""
    model = build(spec.model, spec.seed)
    engine, opt, _ = _engine_and_opt(model, replace(spec, frozen=()), R)
    prepare(model, spec)
    engine.update_trainable()
    names = trainable_names(model)
    _step(engine, opt, model, spec, ctx.rank, shard_batches(spec)[ctx.rank])
    return {"grads": released_grads(model, names), "params": _params(model), "world_size": engine.world_size,
            "rank": engine.rank, "steps": engine.steps}


def run_state(ctx: Any, spec: Spec, R: float) -> dict[str, Any]:
    """state_dict() of a distributed engine carries world_size and rank; a one-process engine's state loads into
    a distributed engine only with an error naming both world sizes."""
    model = build(spec.model, spec.seed)
    engine, opt, _ = _engine_and_opt(model, spec, R)
    _step(engine, opt, model, spec, ctx.rank, shard_batches(spec)[ctx.rank])
    st = engine.state_dict()
    solo_model = build(spec.model, spec.seed)
    solo = make_engine(solo_model, batch_size=spec.global_batch_size, R=R, distributed=False)
    solo_state = solo.state_dict()
    fresh = build(spec.model, spec.seed)
    eng2 = make_engine(fresh, batch_size=spec.global_batch_size, R=R)
    load = _outcome(lambda: eng2.load_state_dict(solo_state))
    return {"world_size": st.get("world_size"), "rank": st.get("rank"), "load_solo": load}


def run_never_step(ctx: Any, spec: Spec, R: float, sleep: float) -> dict[str, Any]:
    """Rank 1 runs its backward but never calls optimizer.step() (it sleeps past the process group's timeout);
    the others must get an error that says the collective timed out, with nothing released."""
    model = build(spec.model, spec.seed)
    engine, opt, _ = _engine_and_opt(model, spec, R)
    _run_shard(model, spec, shard_batches(spec)[ctx.rank])
    if ctx.rank == 1:
        time.sleep(sleep)
        return {"slept": True}
    t0 = time.monotonic()
    out = _outcome(opt.step)
    out["seconds"] = time.monotonic() - t0
    out["grads"] = _grads_or_none(model)
    out["steps"] = engine.steps
    return out


def run_empty_step_misuse(ctx: Any, spec: Spec, R: float) -> dict[str, Any]:
    """Rank 1 runs its backward pass, then calls engine.empty_step() (refused in one process: the batch is not
    empty); rank 0 runs its backward and calls optimizer.step(). The refusal must be agreed: every rank raises,
    naming rank 1's reason, without waiting for the process group's timeout; nothing is released."""
    model = build(spec.model, spec.seed)
    engine, opt, _ = _engine_and_opt(model, spec, R)
    _run_shard(model, spec, shard_batches(spec)[ctx.rank])
    t0 = time.monotonic()
    out = _outcome(engine.empty_step if ctx.rank == 1 else opt.step)
    out["seconds"] = time.monotonic() - t0
    out["grads"] = _grads_or_none(model)
    out["steps"] = engine.steps
    return out


def run_local_release(ctx: Any, spec: Spec, R: float, enforce: bool, release_sigma: float = 8.0) -> dict[str, Any]:
    """Rank 0 alone records another private release (a DP evaluation on rank 0 only, as people write it), then
    every rank takes a step. The ranks' accountants must not silently diverge: either every rank refuses the step,
    or every rank releases it and reports the same epsilon. With ``enforce``: target_epsilon=1 calibrated for ONE
    step (rdp, q = 4/1000), so rank 0's release fits the budget but the step after it does not -- on rank 0."""
    from fastdp import accounting

    model = build(spec.model, spec.seed)
    kw: dict[str, Any] = {"sample_size": 1000, "accountant": "rdp"}
    if enforce:
        kw.update(sigma=None, target_epsilon=1.0, steps=1, enforce_budget=True)
    else:
        kw.update(sigma=1.0)
    engine, opt, _ = _engine_and_opt(model, spec, R, **kw)
    res: dict[str, Any] = {}
    if ctx.rank == 0:
        ev = accounting.Gaussian(release_sigma)
        res["record"] = _outcome(lambda: engine.record_release(ev, label="eval"))
        step_ev = accounting.PoissonSampledGaussian(engine.noise_multiplier, engine.sample_rate)
        res["eps_after_step_here"] = engine.accountant.epsilon_after(step_ev, engine.target_delta)
    t0 = time.monotonic()
    res["step"] = _outcome(lambda: _step(engine, opt, model, spec, ctx.rank, shard_batches(spec)[ctx.rank]))
    res["seconds"] = time.monotonic() - t0
    res["steps"] = engine.steps
    res["epsilon"] = engine.get_privacy_spent()["epsilon"]
    return res


def noise_std_bound(n: int) -> float:
    """Relative bound on |std_hat / std - 1| for ``n`` Gaussian coordinates: 8 standard errors (1 / sqrt(2n))."""
    return 8.0 / math.sqrt(2 * n)
