"""The rank side of the adaptive-clipping worlds (tests/distributed/test_dist_adaptive.py): ``steps`` logical
steps of a :class:`dist_specs.Spec` (step ``k``'s shards from ``spec.seed + k``) through a distributed engine with
``clipping_fn="adaptive"``; returns every step's released gradient and the adaptive state."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from dist_cases import engine_and_opt, params_of, take_step
from dist_specs import Spec, build, prepare, shard_batches
from oracle import released_grads

from fastdp import AdaptiveClipping


def run_adaptive(ctx: Any, spec: Spec, R: float, steps: int, sigma: float = 0.0, count_sigma: float = 0.0,
                 gamma: float = 0.5, eta: float = 0.3, lr: float = 0.5, gen_seed: int | None = None) -> dict[str, Any]:
    model = build(spec.model, spec.seed)
    prepare(model, spec)
    gen = None if gen_seed is None else torch.Generator().manual_seed(gen_seed + ctx.rank)
    engine, opt, names = engine_and_opt(model, replace(spec, fn="adaptive"), R, lr=lr, sigma=sigma,
                                        noise_generator=gen,
                                        adaptive_clipping=AdaptiveClipping(gamma, eta, count_sigma))
    grads = []
    for k in range(steps):
        s = replace(spec, seed=spec.seed + k)
        opt.zero_grad()
        take_step(engine, opt, model, s, ctx.rank, shard_batches(s)[ctx.rank])
        grads.append(released_grads(model, names))
    ad = engine.adaptive_clipping
    return {"grads": grads, "params": params_of(model), "thresholds": list(ad.thresholds),
            "fractions": list(ad.noisy_unclipped_fractions), "R": ad.max_grad_norm, "steps": engine.steps,
            "bytes": engine.communication["all_reduce_bytes"]}
