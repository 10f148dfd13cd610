"""Adaptive clipping across ranks (issue 16, item 4): the count of unclipped samples is summed over the ranks in the
clipped sums' all-reduce, its noise drawn once (by rank 0).

* sigma = 0 and count noise 0: on every rank, every step's released gradient is the brute-force oracle's of the
  UNION batch clipped at that step's R_t, where R_t is recomputed in the pytest process from the oracle's per-sample
  norms of the union batches (R_{t+1} = R_t exp(-eta (frac_t - gamma))); shards even, uneven, empty (0 rows and
  engine.empty_step()) and virtual;
* with noise: every rank ends with the same thresholds, noisy fractions and parameters bit for bit, although each
  rank's generator is seeded differently (only rank 0 draws), and the fraction is not the exact one (noise drawn).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from dist_adaptive_cases import run_adaptive
from dist_specs import LOSSES, Spec, build, prepare, shard_batches
from harness import Case, register, shared_world
from oracle import clipped_sum, group_norms, oracle_model, per_sample_grads, trainable_names

STEPS, R0, GAMMA, ETA, LR = 4, 0.2, 0.5, 0.3, 0.5
EXACT = {"even": Spec("mixed", ((3,), (3,)), seed=60),
         "uneven-virtual": Spec("mixed", ((2, 2), (1,)), seed=61, batch_size=5),
         "empty-shard": Spec("mixed", ((4,), (0,)), seed=62),
         "empty-step-rank": Spec("mixed", ((3,), None), seed=63, batch_size=3)}
NOISY = Spec("mixed", ((3,), (2,)), seed=64)

for _name, _spec in EXACT.items():
    register(2, f"adaptive-{_name}", lambda _spec=_spec, _name=_name: (
        Case(f"adaptive-{_name}", run_adaptive, {"spec": _spec, "R": R0, "steps": STEPS, "gamma": GAMMA, "eta": ETA,
                                        "lr": LR}), None))
register(2, "adaptive-noisy", lambda: (Case("adaptive-noisy", run_adaptive, {
    "spec": NOISY, "R": R0, "steps": STEPS, "sigma": 0.8, "count_sigma": 1.0, "gamma": GAMMA, "eta": ETA, "lr": LR,
    "gen_seed": 5}), None))


def oracle_run(spec: Spec) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """R_t and the released gradient of every step, by batch-of-one passes on the union batches (float64), the
    model updated by SGD(LR) with the oracle's own gradient."""
    model = oracle_model(build(spec.model, spec.seed))
    prepare(model, spec)
    names = trainable_names(model)
    params = dict(model.named_parameters())
    B = spec.global_batch_size
    r, thresholds, wants = R0, [], []
    for k in range(STEPS):
        union = [b for bs in shard_batches(replace(spec, seed=spec.seed + k)) for b in bs]
        psg = per_sample_grads(model, LOSSES[spec.model], union, names)
        want = clipped_sum(psg, [names], "abadi", r, B)
        norms = group_norms(psg, [names])[:, 0]
        thresholds.append(r)
        wants.append(want)
        frac = float((norms <= r).sum() - len(norms) / 2) / B + 0.5
        r = r * math.exp(-ETA * (min(1.0, max(0.0, frac)) - GAMMA))
        with torch.no_grad():
            for n in names:
                params[n].sub_(LR * want[n])
    return thresholds, wants


@pytest.mark.parametrize("name", sorted(EXACT))
def test_every_rank_releases_the_oracle_clipped_at_each_steps_threshold(name):
    vals = shared_world(2).values(f"adaptive-{name}")
    thresholds, wants = oracle_run(EXACT[name])
    assert len(set(thresholds)) > 1, "the threshold never moved: the case cannot tell a fixed R from R_t"
    for rank, v in enumerate(vals):
        assert v["steps"] == STEPS
        for t, (got_r, want_r) in enumerate(zip(v["thresholds"], thresholds, strict=True)):
            assert got_r == pytest.approx(want_r, rel=1e-9), f"rank {rank} step {t}: R_t"
        for t, (got, want) in enumerate(zip(v["grads"], wants, strict=True)):
            for n, w in want.items():
                torch.testing.assert_close(got[n], w, rtol=1e-6, atol=1e-10,
                                           msg=lambda m, n=n, t=t, rank=rank: f"rank {rank} step {t} {n}: {m}")
        assert v["thresholds"] == vals[0]["thresholds"] and v["R"] == vals[0]["R"]
        # the count is one more float64 element of the clipped sums' all-reduce: 8 bytes a step
        params = build(EXACT[name].model, 0).parameters()
        assert v["bytes"] == STEPS * (8 * sum(p.numel() for p in params) + 8)


def test_the_count_noise_is_drawn_once_and_every_rank_agrees():
    vals = shared_world(2).values("adaptive-noisy")
    a, b = vals
    assert a["fractions"] == b["fractions"] and a["thresholds"] == b["thresholds"] and a["R"] == b["R"]
    for n, p in a["params"].items():
        assert torch.equal(p, b["params"][n]), n
    # the fractions are noisy: not multiples of 1/(2B) (the exact centred count's grid) except by a null event
    B = NOISY.global_batch_size
    assert all(abs(f * 2 * B - round(f * 2 * B)) > 1e-9 for f in a["fractions"])
