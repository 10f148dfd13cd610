"""The rank side of the distributed worlds' bad-input cases (tests/distributed/test_dist_refusals.py): each
function runs on every rank and returns the outcome (raised or not, the error's type and message) and what was or
was not released, for the pytest process to judge."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from dist_cases import engine_and_opt, grads_or_none, outcome, params_of, run_shard, take_step
from dist_specs import Spec, build, shard_batches
from oracle import make_engine, released_grads

import fastdp.deferred as deferred
from fastdp.losses import causal_lm_loss


def run_refused_step(ctx: Any, spec: Spec, R: float, scenario: str, culprit: int = 1,
                     sigma: float = 0.0) -> dict[str, Any]:
    """A first step that rank ``culprit`` spoils (``scenario``), then a valid step on ``spec``'s shards.

    Scenarios: ``"skip_backward"`` (the culprit runs no backward and calls optimizer.step()), ``"frozen"`` (after
    its backward pass it freezes ``fc.weight`` without telling the engine), ``"update_trainable"`` (it freezes
    ``fc.weight`` and calls engine.update_trainable(), the others do not), ``"sigma"`` (it calls
    engine.set_noise_multiplier(0.5) alone), ``"nonfinite_deferred"`` (a NaN in its first sample, with the
    accelerator's deferred non-finite check switched on everywhere: the culprit raises only at the step). The
    first step's data come from another seed, so a leak of its sums into the second step shows against the oracle
    of ``spec``. Returns the outcome of the first step on this
    rank, the gradients and steps right after it, and the second step's released gradients (or its outcome)."""
    model = build(spec.model, spec.seed)
    engine, opt, names = engine_and_opt(model, spec, R, sigma=sigma,
                                         noise_generator=torch.Generator().manual_seed(5))
    before = params_of(model)
    bad = replace(spec, seed=spec.seed + 77)
    culprit_here = ctx.rank == culprit
    res: dict[str, Any] = {}
    if culprit_here and scenario == "update_trainable":
        model.fc.weight.requires_grad_(False)
        res["update"] = outcome(engine.update_trainable)
    if culprit_here and scenario == "sigma":
        engine.set_noise_multiplier(0.5)
    mine = shard_batches(bad)[ctx.rank]
    nan_hook = None
    if culprit_here and scenario == "nonfinite_deferred":
        # NaN in the output of every sample whose first token is that of this rank's first sample (a function of
        # the sample's own data, as the structure probe requires): those samples' gradients are NaN
        token = mine[0][0][0][0, 0]

        def poison(module, args, out):
            hit = (args[0][:, 0] == token).view(-1, *([1] * (out.dim() - 1)))
            return out + torch.where(hit, float("nan"), 0.0).to(out.dtype)  # the NaN flows back into out
        nan_hook = model.register_forward_hook(poison)
    saved_defer = deferred.DEFER_ON
    if scenario == "nonfinite_deferred":  # the accelerator behaviour on every rank: the check waits for the step
        deferred.DEFER_ON = {"cpu": True, "default": True}
    try:
        if not (culprit_here and scenario == "skip_backward"):
            run_shard(model, bad, mine)
        if culprit_here and scenario == "frozen":  # after its backward pass, before the step
            model.fc.weight.requires_grad_(False)
        res["first"] = outcome(opt.step)
    finally:
        deferred.DEFER_ON = saved_defer
        if nan_hook is not None:
            nan_hook.remove()
    res["after_first"] = {"grads": grads_or_none(model), "steps": engine.steps,
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
    before2 = params_of(model)
    second = outcome(lambda: (run_shard(model, spec, shard_batches(spec)[ctx.rank]), opt.step()))
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
    return outcome(lambda: make_engine(model, batch_size=4, R=R))


def run_distributed_flags(ctx: Any, spec: Spec, R: float) -> dict[str, Any]:
    """``distributed=False`` inside an initialised world: an independent one-process engine per rank (its release
    is the oracle of its own shard); ``engine.world_size`` / ``engine.rank`` of both kinds of engine."""
    model = build(spec.model, spec.seed + ctx.rank)  # different models: nothing may be broadcast
    engine, opt, names = engine_and_opt(model, spec, R, distributed=False)
    before = params_of(model)
    take_step(engine, opt, model, spec, ctx.rank, shard_batches(spec)[ctx.rank])
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


def run_state(ctx: Any, spec: Spec, R: float) -> dict[str, Any]:
    """state_dict() of a distributed engine carries world_size and rank; a one-process engine's state loads into
    a distributed engine only with an error naming both world sizes."""
    model = build(spec.model, spec.seed)
    engine, opt, _ = engine_and_opt(model, spec, R)
    take_step(engine, opt, model, spec, ctx.rank, shard_batches(spec)[ctx.rank])
    st = engine.state_dict()
    solo_model = build(spec.model, spec.seed)
    solo = make_engine(solo_model, batch_size=spec.global_batch_size, R=R, distributed=False)
    solo_state = solo.state_dict()
    fresh = build(spec.model, spec.seed)
    eng2 = make_engine(fresh, batch_size=spec.global_batch_size, R=R)
    load = outcome(lambda: eng2.load_state_dict(solo_state))
    return {"world_size": st.get("world_size"), "rank": st.get("rank"), "load_solo": load}


def run_never_step(ctx: Any, spec: Spec, R: float, sleep: float) -> dict[str, Any]:
    """Rank 1 runs its backward but never calls optimizer.step() (it sleeps past the process group's timeout);
    the others must get an error that says the collective timed out, with nothing released."""
    model = build(spec.model, spec.seed)
    engine, opt, _ = engine_and_opt(model, spec, R)
    run_shard(model, spec, shard_batches(spec)[ctx.rank])
    if ctx.rank == 1:
        time.sleep(sleep)
        return {"slept": True}
    t0 = time.monotonic()
    out = outcome(opt.step)
    out["seconds"] = time.monotonic() - t0
    out["grads"] = grads_or_none(model)
    out["steps"] = engine.steps
    return out


def run_empty_step_misuse(ctx: Any, spec: Spec, R: float) -> dict[str, Any]:
    """Rank 1 runs its backward pass, then calls engine.empty_step() (refused in one process: the batch is not
    empty); rank 0 runs its backward and calls optimizer.step(). The refusal must be agreed: every rank raises,
    naming rank 1's reason, without waiting for the process group's timeout; nothing is released."""
    model = build(spec.model, spec.seed)
    engine, opt, _ = engine_and_opt(model, spec, R)
    run_shard(model, spec, shard_batches(spec)[ctx.rank])
    t0 = time.monotonic()
    out = outcome(engine.empty_step if ctx.rank == 1 else opt.step)
    out["seconds"] = time.monotonic() - t0
    out["grads"] = grads_or_none(model)
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
    engine, opt, _ = engine_and_opt(model, spec, R, **kw)
    res: dict[str, Any] = {}
    if ctx.rank == 0:
        ev = accounting.Gaussian(release_sigma)
        res["record"] = outcome(lambda: engine.record_release(ev, label="eval"))
        step_ev = accounting.PoissonSampledGaussian(engine.noise_multiplier, engine.sample_rate)
        res["eps_after_step_here"] = engine.accountant.epsilon_after(step_ev, engine.target_delta)
    t0 = time.monotonic()
    res["step"] = outcome(lambda: take_step(engine, opt, model, spec, ctx.rank, shard_batches(spec)[ctx.rank]))
    res["seconds"] = time.monotonic() - t0
    res["steps"] = engine.steps
    res["epsilon"] = engine.get_privacy_spent()["epsilon"]
    return res


def run_zero_policy_paths(ctx: Any, spec: Spec, R: float) -> dict[str, Any]:
    """``on_nonfinite="zero"`` with a NaN sample on rank 1, on both clipping paths of every rank: the CPU's (the
    bad sample found with a host read) and an accelerator's (zeroed on the device, counted at the release;
    ``fastdp.deferred.DEFER_ON``). Returns, per path, the released gradients and this rank's count."""
    out: dict[str, Any] = {}
    saved_defer = deferred.DEFER_ON
    try:
        for defer in (False, True):
            deferred.DEFER_ON = {"cpu": defer, "default": defer}
            model = build(spec.model, spec.seed)
            engine, opt, names = engine_and_opt(model, spec, R, on_nonfinite="zero")
            mine = shard_batches(spec)[ctx.rank]
            hook = None
            if ctx.rank == 1:  # NaN in the output of every sample whose first token is that of this rank's first
                # sample (a function of the sample's own data, as the structure probe requires)
                token = mine[0][0][0][0, 0]

                def poison(module, args, y, token=token):
                    hit = (args[0][:, 0] == token).view(-1, *([1] * (y.dim() - 1)))
                    return y + torch.where(hit, float("nan"), 0.0).to(y.dtype)
                hook = model.register_forward_hook(poison)
            run_shard(model, spec, mine)
            if hook is not None:
                hook.remove()
            opt.step()
            out["device" if defer else "host"] = {"grads": released_grads(model, names),
                                                  "nonfinite": engine.nonfinite_samples}
    finally:
        deferred.DEFER_ON = saved_defer
    return out


def run_loss_check_refusal(ctx: Any, R: float) -> dict[str, Any]:
    """A tiny LM on padded batches (samples with 5, 1, 3 and 2 label tokens): rank 1's first loss is the token
    mean over its batch, rank 0's the per-sample mean; then both use the per-sample mean."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)).double()
    engine = make_engine(model, batch_size=8, R=R, sigma=1.0, noise_generator=torch.Generator().manual_seed(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    ids = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(10 + ctx.rank))
    labels = ids.clone()
    for i, n in enumerate((5, 1, 3, 2)):
        labels[i, 1 + n:] = -100
    out = model(ids)
    if ctx.rank == 1:
        F.cross_entropy(out[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=-100).backward()
    else:
        causal_lm_loss(out, labels).mean().backward()
    res: dict[str, Any] = {"first": outcome(opt.step)}
    res["after_first"] = {"released": [n for n, g in grads_or_none(model).items() if g is not None],
                          "steps": engine.steps}
    opt.zero_grad(set_to_none=True)
    causal_lm_loss(model(ids), labels).mean().backward()
    res["second"] = outcome(opt.step)
    res["grads2"] = grads_or_none(model)
    res["verdicts"] = dict(engine.probe_stats["loss_verdicts"])
    return res


def run_loss_trace_refusal(ctx: Any, R: float, strict: bool = False) -> dict[str, Any]:
    """A small encoder: rank 1's first loss uses in-batch negatives (a cross-entropy over its batch's similarity
    matrix: it couples samples, fastdp.loss_trace), rank 0's a per-sample cross-entropy; then both use the
    per-sample loss. ``strict``: verify_loss="strict", and rank 1's first loss one the trace cannot verify (an FFT)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double()
    engine = make_engine(model, batch_size=8, R=R, sigma=1.0, noise_generator=torch.Generator().manual_seed(3),
                         verify_loss="strict" if strict else True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    g = torch.Generator().manual_seed(10 + ctx.rank)
    x, y = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (4,), generator=g)
    out = model(x)
    if ctx.rank == 1 and strict:
        torch.fft.fft(out).real.pow(2).mean().backward()
    elif ctx.rank == 1:
        z = F.normalize(out, dim=-1)
        F.cross_entropy(z @ z.T / 0.1, torch.arange(4)).backward()
    else:
        F.cross_entropy(out, y).backward()
    res: dict[str, Any] = {"first": outcome(opt.step)}
    res["after_first"] = {"released": [n for n, g in grads_or_none(model).items() if g is not None],
                          "steps": engine.steps}
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    res["second"] = outcome(opt.step)
    res["grads2"] = grads_or_none(model)
    res["traces"] = dict(engine.probe_stats["loss_traces"])
    return res
