"""The rank side of the distributed worlds' happy-path cases: each function runs on every rank (``fn(ctx, **kw)``,
see tests/distributed/harness.py), drives a distributed engine through its shard of a :class:`dist_specs.Spec`, and
returns what it released for the pytest process to compare with the oracle (tests/distributed/dist_specs.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from dist_specs import LOSSES, D, Spec, build, prepare, resolve_style, shard_batches
from oracle import call_model, make_engine, released_grads, trainable_names, user_loss
from torch import nn


def engine_and_opt(model: nn.Module, spec: Spec, R: float, lr: float = 1.0, **kw: Any):
    """An engine (tests/oracle.py ``make_engine``: the sample-rate check off unless ``check_rate=True``) with
    ``spec``'s clipping, attached to SGD(lr) over the trainable parameters; returns (engine, optimizer, names)."""
    names = trainable_names(model)
    engine = make_engine(model, batch_size=spec.global_batch_size, R=R, fn=spec.fn,
                         style=resolve_style(spec, names), mode=spec.mode, reduction=spec.reduction, **kw)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD([params[n] for n in names], lr=lr)
    engine.attach(opt)
    return engine, opt, names


def run_shard(model: nn.Module, spec: Spec, batches: list[tuple]) -> None:
    """Forward and backward of every physical batch (cast to the model's dtype), the loss reduced as the spec says."""
    dtype = next(model.parameters()).dtype
    for x, y in batches:
        if dtype != D:
            x = tuple(t.to(dtype) if t.is_floating_point() else t for t in x)
            y = y.to(dtype) if y.is_floating_point() else y
        per = LOSSES[spec.model](call_model(model, x), y)
        user_loss(per, spec.reduction).backward()


def take_step(engine: Any, opt: torch.optim.Optimizer, model: nn.Module, spec: Spec, rank: int,
              batches: list[tuple]) -> None:
    """This rank's part of one logical step: ``engine.empty_step()`` for a ``None`` shard, else its batches and
    ``optimizer.step()``."""
    if spec.shards[rank] is None:
        engine.empty_step()
    else:
        run_shard(model, spec, batches)
        opt.step()


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def grads_or_none(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def outcome(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return {"raised": True, "type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
                "msg": str(e)}
    return {"raised": False}


def run_exact(ctx: Any, spec: Spec, R: float, bucket_bytes: int | None = None,
              gram_strip: tuple[int, int] | None = None, **kw: Any) -> dict[str, Any]:
    """One logical step of ``spec`` on this rank; returns what it released (and the parameters after SGD).
    ``bucket_bytes``: the engine's all-reduce buckets that small (many buckets; its default argument, patched for
    this case only). ``gram_strip``: the ghost norms' Gram matrices cut into strips of at least ``h`` rows, at most
    ``K`` (``fastdp.layers._grams.GRAM_STRIP``, patched for this case only)."""
    if gram_strip is not None:
        from fastdp.layers import _grams

        saved = _grams.GRAM_STRIP
        _grams.GRAM_STRIP = {"cpu": gram_strip, "default": gram_strip}
        try:
            return run_exact(ctx, spec, R, bucket_bytes, **kw)
        finally:
            _grams.GRAM_STRIP = saved
    if bucket_bytes is None:
        return run_exact_unpatched(ctx, spec, R, **kw)
    from fastdp.distributed import Group

    old = Group.all_reduce_sum.__defaults__
    Group.all_reduce_sum.__defaults__ = (bucket_bytes,)
    try:
        return run_exact_unpatched(ctx, spec, R, **kw)
    finally:
        Group.all_reduce_sum.__defaults__ = old


def run_exact_unpatched(ctx: Any, spec: Spec, R: float, **kw: Any) -> dict[str, Any]:
    model = build(spec.model, spec.model_seeds[ctx.rank] if spec.model_seeds else spec.seed)
    prepare(model, spec)
    engine, opt, names = engine_and_opt(model, spec, R, **kw)
    take_step(engine, opt, model, spec, ctx.rank, shard_batches(spec)[ctx.rank])
    return {"grads": released_grads(model, names), "params": params_of(model), "world_size": engine.world_size,
            "rank": engine.rank, "steps": engine.steps}


def run_views(ctx: Any, spec: Spec, R: float) -> dict[str, Any]:
    """``spec.views`` identical calls of this rank's batch inside ``engine.same_samples()`` and one backward pass of
    the summed loss, after a clean pass that ``optimizer.zero_grad()`` forgets (an input-gradient pass of
    adversarial training): the step releases the views' pass only, its rows merged per sample on every rank."""
    model = build(spec.model, spec.seed)
    engine, opt, names = engine_and_opt(model, spec, R)
    ((x, y),) = shard_batches(spec)[ctx.rank]
    loss = LOSSES[spec.model]
    user_loss(loss(call_model(model, x), y), spec.reduction).backward()
    opt.zero_grad()
    with engine.same_samples():
        outs = [call_model(model, x) for _ in range(spec.views)]
    user_loss(sum(loss(o, y) for o in outs), spec.reduction).backward()
    opt.step()
    return {"grads": released_grads(model, names), "params": params_of(model), "world_size": engine.world_size,
            "rank": engine.rank, "steps": engine.steps}


def run_input_grads(ctx: Any, spec: Spec, R: float) -> dict[str, Any]:
    """Two input-gradient passes on this rank's batch, as adversarial training takes them
    (``torch.autograd.grad(loss, x)`` and ``loss.backward(inputs=[x])``: neither accumulates into a parameter), then
    a training pass on the same batch: the step releases the training pass only, on every rank."""
    model = build(spec.model, spec.seed)
    engine, opt, names = engine_and_opt(model, spec, R)
    ((x, y),) = shard_batches(spec)[ctx.rank]
    loss = LOSSES[spec.model]
    xs = tuple(t.clone().requires_grad_() for t in x)
    (gx,) = torch.autograd.grad(user_loss(loss(call_model(model, xs), y), spec.reduction), xs)
    xs2 = tuple(t.clone().requires_grad_() for t in x)
    user_loss(loss(call_model(model, xs2), y), spec.reduction).backward(inputs=list(xs2))
    assert xs2[0].grad is not None and torch.allclose(xs2[0].grad, gx)  # the passes ran, into the input only
    user_loss(loss(call_model(model, x), y), spec.reduction).backward()
    opt.step()
    return {"grads": released_grads(model, names), "params": params_of(model), "world_size": engine.world_size,
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
    engine, opt, names = engine_and_opt(model, spec, R, lr=lr, sigma=sigma, noise_generator=gen,
                                         secure_mode=secure_mode)
    first = None
    for k in range(steps):
        s = replace(spec, seed=spec.seed + k)
        opt.zero_grad()
        take_step(engine, opt, model, s, ctx.rank, shard_batches(s)[ctx.rank])
        if first is None:
            first = released_grads(model, names)
    return {"grad1": first, "params": params_of(model), "steps": engine.steps,
            "spent": engine.get_privacy_spent()}


def run_accounting(ctx: Any, spec: Spec, steps: int, sigma: float, sample_size: int, accountant: str,
                   check_rate: bool = False) -> dict[str, Any]:
    """``steps`` noisy steps; per step: the engine's steps and get_privacy_spent() on this rank."""
    model = build(spec.model, spec.seed)
    engine, opt, _ = engine_and_opt(model, spec, 1.0, lr=0.1, sigma=sigma, sample_size=sample_size,
                                     accountant=accountant, check_rate=check_rate)
    out = []
    for k in range(steps):
        s = replace(spec, seed=spec.seed + k)
        take_step(engine, opt, model, s, ctx.rank, shard_batches(s)[ctx.rank])
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
        engine, opt, names = engine_and_opt(model, s, 1.0)
        counted.clear()
        for n in real:
            setattr(dist, n, wrap(n))
        try:
            take_step(engine, opt, model, s, ctx.rank, shard_batches(s)[ctx.rank])
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
    engine, opt, _ = engine_and_opt(model, spec, 1.0, lr=0.0, sigma=1.0, sample_size=sample_size,
                                     check_rate=True)
    warned = None
    for k in range(steps):
        s = replace(spec, seed=spec.seed + k)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            take_step(engine, opt, model, s, ctx.rank, shard_batches(s)[ctx.rank])
        if warned is None and any("fixed-size" in str(w.message) for w in caught):
            warned = k + 1
    return {"warned_at": warned, "steps": engine.steps}


def run_budget_exhausted(ctx: Any, spec: Spec, planned: int) -> dict[str, Any]:
    """enforce_budget with sigma calibrated for ``planned`` steps: step ``planned + 1`` must be refused on every
    rank (PrivacyBudgetExceeded), nothing released, epsilon the same everywhere."""
    model = build(spec.model, spec.seed)
    engine, opt, _ = engine_and_opt(model, spec, 1.0, lr=0.1, sigma=None, target_epsilon=1.0, steps=planned,
                                     enforce_budget=True, sample_size=1000, accountant="rdp")
    for k in range(planned):
        opt.zero_grad(set_to_none=True)
        s = replace(spec, seed=spec.seed + k)
        take_step(engine, opt, model, s, ctx.rank, shard_batches(s)[ctx.rank])
    opt.zero_grad(set_to_none=True)
    before = params_of(model)
    s = replace(spec, seed=spec.seed + planned)
    out = outcome(lambda: take_step(engine, opt, model, s, ctx.rank, shard_batches(s)[ctx.rank]))
    out["grads"] = grads_or_none(model)
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    out["steps"] = engine.steps
    out["epsilon"] = engine.get_privacy_spent()["epsilon"]
    return out


def run_rate_refused(ctx: Any, spec: Spec, sample_size: int) -> dict[str, Any]:
    """A step whose GLOBAL batch is far above the declared rate while each rank's shard alone is not: the
    sample-rate check (the real monitor) must refuse it on every rank, with nothing released."""
    model = build(spec.model, spec.seed)
    engine, opt, _ = engine_and_opt(model, spec, 1.0, sigma=1.0, sample_size=sample_size, check_rate=True)
    out = outcome(lambda: take_step(engine, opt, model, spec, ctx.rank, shard_batches(spec)[ctx.rank]))
    out["grads"] = grads_or_none(model)
    out["steps"] = engine.steps
    out["ledger"] = engine.accountant.ledger.steps
    return out


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
    engine, opt, _ = engine_and_opt(model, replace(spec, frozen=()), R)
    prepare(model, spec)
    engine.update_trainable()
    names = trainable_names(model)
    take_step(engine, opt, model, spec, ctx.rank, shard_batches(spec)[ctx.rank])
    return {"grads": released_grads(model, names), "params": params_of(model), "world_size": engine.world_size,
            "rank": engine.rank, "steps": engine.steps}


def run_resume(ctx: Any, spec: Spec, R: float, sigma: float, steps: int, split: int) -> dict[str, Any]:
    """A distributed run of ``steps`` noisy steps (Adam, a seeded noise generator on every rank) against the same
    run saved after ``split`` steps (model, optimizer and every rank's engine state, through bytes) and resumed in a
    fresh model, optimizer and engine whose noise generator is seeded differently (the checkpoint restores it).
    Also loads the next rank's engine state, which must be refused naming both ranks."""
    import io

    def fresh(seed_gen: int):
        model = build(spec.model, spec.seed)
        gen = torch.Generator().manual_seed(seed_gen)
        engine = make_engine(model, batch_size=spec.global_batch_size, R=R, sigma=sigma, noise_generator=gen)
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
        engine.attach(opt)
        return model, engine, opt

    def run(model, engine, opt, ks):
        for k in ks:
            s = replace(spec, seed=spec.seed + k)
            take_step(engine, opt, model, s, ctx.rank, shard_batches(s)[ctx.rank])
            opt.zero_grad()

    model, engine, opt = fresh(5)
    run(model, engine, opt, range(steps))
    straight = params_of(model)
    engine.detach()

    model, engine, opt = fresh(5)
    run(model, engine, opt, range(split))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "engine": engine.state_dict()}, buf)
    engine.detach()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    model, engine, opt = fresh(999)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    engine.load_state_dict(ckpt["engine"])
    run(model, engine, opt, range(split, steps))
    resumed = params_of(model)
    engine.detach()

    everyone = [None] * ctx.world_size
    torch.distributed.all_gather_object(everyone, ckpt["engine"])
    model, engine, _ = fresh(5)
    other = outcome(lambda: engine.load_state_dict(everyone[(ctx.rank + 1) % ctx.world_size]))
    engine.detach()
    return {"straight": straight, "resumed": resumed, "other_rank": other, "steps": ckpt["engine"]["steps"],
            "world_size": ckpt["engine"]["world_size"]}


def run_cancel(ctx: Any, spec: Spec, R: float, raised: bool = False) -> dict[str, Any]:
    """One logical step of ``spec`` (the float32 ``cancel`` model) on this rank, recording which samples of each of
    its layers' calls the ghost norms' guard took apart (``fastdp.layers._rounding.exact_flagged``). ``raised``: the
    engine runs as on CUDA (``fastdp.deferred.DEFER_ON``: no host read, the flagged samples keep the raised norm)."""
    from fastdp import deferred
    from fastdp.layers import _rounding

    taken: list[list[int]] = []
    original, defer_on = _rounding.exact_flagged, deferred.DEFER_ON

    def spy(*args: Any) -> Any:
        sq, ex = original(*args)
        if ex is not None:
            taken.append(ex.index.tolist())
        return sq, ex

    _rounding.exact_flagged = spy
    if raised:
        deferred.DEFER_ON = {"cpu": True, "default": True}
    try:
        out = run_exact_unpatched(ctx, spec, R)
    finally:
        _rounding.exact_flagged, deferred.DEFER_ON = original, defer_on
    return {**out, "taken": taken}
