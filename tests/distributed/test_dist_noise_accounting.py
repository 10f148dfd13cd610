"""Noise exactly once and accounting across ranks (issue 14, items 2 and 3).

Noise: after k = 3 noisy steps (sigma = 1) every rank's parameters are bit-identical; the released gradient minus
the noiseless oracle (the batch-of-one clipped sum of the union batch, float64) over the 200,400 coordinates of a
Linear(500, 400) has standard deviation sigma R / B within 8 standard errors (1.3 %), a bound that fails for
sqrt(N) sigma R / B (noise drawn on every rank: +41 % at N = 2, +73 % at N = 3) and for 0 (no noise); the same
with secure-mode noise, and for a float32 model on 3 ranks. The noise is rank 0's: with the same noise_generator
seed on rank 0, a different seed on rank 1 releases the same bits, and a different seed on rank 0 does not.

Accounting: every rank's ``engine.steps`` and ``get_privacy_spent()`` equal a one-process engine's after the same
number of logical steps (rdp and prv), and the sample-rate monitor sees the global batch: its running total is the
sum over ranks, and a step whose union is far above the declared rate (30 samples at B = 6 of 60, 10 per rank: a
single rank's 10 would pass) is refused on every rank with nothing released or accounted. Fixed-size global batches
warn on every rank at the step one process warns; an exhausted budget (enforce_budget) refuses on every rank.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_cases import (
    run_accounting,
    run_budget_exhausted,
    run_fixed_size,
    run_noise,
    run_rate_refused,
)
from dist_checks import assert_bit_identical, refused_everywhere
from dist_specs import Spec, build, noise_std_bound, oracle_for
from harness import Case, register, shared_world
from oracle import make_engine
from scipy import stats

SIGMA, R_NOISE, B_NOISE, K_STEPS = 1.0, 1.0, 8, 3
NOISE = {2: Spec("big", ((3,), (1,)), seed=70, batch_size=B_NOISE),
         3: Spec("big", ((2,), (0,), (3,)), seed=71, batch_size=B_NOISE)}
NOISE_RANK0_EMPTY = Spec("big", (None, (2,), (3,)), seed=75, batch_size=B_NOISE)  # rank 0 (the drawer): empty_step
FIXED = Spec("mixed", ((1,), (2,), (1,)), seed=76, batch_size=4)  # 4 samples at every step (q = 4 / 1000)
GEN = Spec("mixed", ((2,), (1,)), seed=72, batch_size=4)
ACCT = Spec("mixed", ((2,), (1,)), seed=73, batch_size=4)
RATE = Spec("mixed", ((10,), (10,), (10,)), seed=74, batch_size=6)  # 30 samples at q = 6 / 60
RATE_SAMPLE_SIZE = 60


def _plain(case: Case):
    return lambda: (case, None)


def _noise_case(n: int, name: str, **kw) -> Case:
    return Case(name, run_noise, {"spec": NOISE[n], "R": R_NOISE, "sigma": SIGMA, "steps": K_STEPS, "lr": 0.5,
                                  **kw})


def _gen_case(name: str, seeds: tuple[int, int]) -> Case:
    return Case(name, run_noise, {"spec": GEN, "R": 1.0, "sigma": 1.0, "steps": 1, "lr": 0.0, "gen_seeds": seeds})


for _case in (
    _noise_case(2, "noise"),
    _noise_case(2, "noise-secure", secure_mode=True),
    _gen_case("gen-same", (5, 5)),
    _gen_case("gen-rank1-differs", (5, 9)),
    _gen_case("gen-rank0-differs", (9, 5)),
    Case("acct-rdp", run_accounting, {"spec": ACCT, "steps": 3, "sigma": 1.0, "sample_size": 1000,
                                      "accountant": "rdp"}),
    Case("acct-prv", run_accounting, {"spec": ACCT, "steps": 2, "sigma": 1.0, "sample_size": 1000,
                                      "accountant": "prv"}),
):
    register(2, _case.name, _plain(_case))
for _case in (_noise_case(3, "noise"), _noise_case(3, "noise-float32", float32=True),
              Case("noise-rank0-empty", run_noise, {"spec": NOISE_RANK0_EMPTY, "R": R_NOISE, "sigma": SIGMA,
                                                    "steps": K_STEPS, "lr": 0.5}),
              Case("fixed-size", run_fixed_size, {"spec": FIXED, "steps": 6, "sample_size": 1000}),
              Case("budget-exhausted", run_budget_exhausted, {"spec": FIXED, "planned": 2}),
              Case("rate", run_rate_refused, {"spec": RATE, "sample_size": RATE_SAMPLE_SIZE})):
    register(3, _case.name, _plain(_case))


def _check_noise(vals: list[dict], n_ranks: int, spec: Spec | None = None) -> None:
    spec = NOISE[n_ranks] if spec is None else spec
    for r, v in enumerate(vals):
        assert v["steps"] == K_STEPS, f"rank {r}: engine.steps={v['steps']} after {K_STEPS} steps"
    assert_bit_identical([v["params"] for v in vals], f"parameters after {K_STEPS} noisy steps")
    assert_bit_identical([v["grad1"] for v in vals], "first released gradient")
    assert all(v["spent"] == vals[0]["spent"] for v in vals), [v["spent"] for v in vals]
    want = oracle_for(spec, R=R_NOISE)["want"]  # noiseless release of step 1 (initial parameters)
    noise = torch.cat([(vals[0]["grad1"][k] - want[k]).flatten() for k in want])
    n = noise.numel()
    assert n >= 200_000
    expected = SIGMA * R_NOISE / B_NOISE
    std = float(noise.std())
    bound = noise_std_bound(n)
    for wrong, label in ((math.sqrt(n_ranks) * expected, f"sqrt({n_ranks}) sigma R / B"), (0.0, "0")):
        assert abs(wrong / expected - 1) > 3 * bound, f"the bound cannot tell sigma R / B from {label}"
    assert abs(std / expected - 1) < bound, (
        f"empirical noise std {std:.6g} over {n} coordinates, expected sigma R / B = {expected:.6g} "
        f"(ratio {std / expected:.4f}; sqrt(N) sigma R / B would be ratio {math.sqrt(n_ranks):.4f})")
    assert abs(float(noise.mean())) < 8 * expected / math.sqrt(n), f"noise mean {float(noise.mean()):.3g}"


def test_noise_once_two_ranks():
    _check_noise(shared_world(2).values("noise"), 2)


def test_noise_once_three_ranks():
    _check_noise(shared_world(3).values("noise"), 3)


def test_noise_once_three_ranks_float32():
    """A float32 model: the sums and the noise cross ranks in float32; still bit-identical on every rank."""
    vals = shared_world(3).values("noise-float32")
    assert all(t.dtype == torch.float32 for t in vals[0]["params"].values())
    _check_noise(vals, 3)


def test_noise_once_when_rank0_has_an_empty_shard():
    """Rank 0, the rank that draws the noise, calls engine.empty_step() while the others run backward passes."""
    _check_noise(shared_world(3).values("noise-rank0-empty"), 3, NOISE_RANK0_EMPTY)


def test_fixed_size_warning_on_every_rank():
    """Global batches of 4 at every step (shards 1 / 2 / 1): every rank warns at the step one process warns."""
    from fastdp.sampling_check import _fixed_size_steps

    k_star = _fixed_size_steps(1000, FIXED.global_batch_size / 1000, 1e-3)
    assert k_star is not None and k_star <= 6
    vals = shared_world(3).values("fixed-size")
    assert [v["warned_at"] for v in vals] == [k_star] * 3, (
        f"fixed-size warning at steps {[v['warned_at'] for v in vals]}; one process warns at step {k_star}")


def test_budget_exhausted_on_every_rank():
    vals = shared_world(3).values("budget-exhausted")
    refused_everywhere(vals, "budget after the planned steps", "epsilon", "target_epsilon")
    for r, v in enumerate(vals):
        assert "PrivacyBudgetExceeded" in v["mro"], f"rank {r}: {v['type']}"
        assert v["steps"] == 2 and v["unchanged"], f"rank {r}: steps {v['steps']}, parameters changed"
        assert all(g is None for g in v["grads"].values()), f"rank {r}: released in the refused step"
    assert len({v["epsilon"] for v in vals}) == 1


def test_secure_noise_once_two_ranks():
    _check_noise(shared_world(2).values("noise-secure"), 2)


def test_noise_is_rank0s_generator():
    world2 = shared_world(2)
    same = world2.values("gen-same")
    r1 = world2.values("gen-rank1-differs")
    r0 = world2.values("gen-rank0-differs")
    for vals, what in ((same, "same seeds"), (r1, "rank 1's seed differs"), (r0, "rank 0's seed differs")):
        assert_bit_identical([v["grad1"] for v in vals], f"released gradient ({what})")
    assert_bit_identical([same[0]["grad1"], r1[0]["grad1"]], "rank 1's noise_generator must not matter")
    assert any(not torch.equal(same[0]["grad1"][n], r0[0]["grad1"][n]) for n in same[0]["grad1"]), (
        "changing rank 0's noise_generator seed did not change the noise")


@pytest.mark.parametrize("accountant,steps", [("rdp", 3), ("prv", 2)])
def test_accounting_matches_one_process(accountant, steps):
    vals = shared_world(2).values(f"acct-{accountant}")
    solo = make_engine(build(ACCT.model, ACCT.seed), batch_size=ACCT.global_batch_size, sigma=1.0,
                       sample_size=1000, accountant=accountant, distributed=False)
    solo.attach(torch.optim.SGD(solo.model.parameters(), lr=0.1))
    assert solo.world_size == 1 and solo.rank == 0
    per_step_samples = ACCT.samples
    for k in range(steps):
        solo.empty_step()
        want = solo.get_privacy_spent()
        for r, v in enumerate(vals):
            got = v["per_step"][k]
            assert got["steps"] == k + 1, f"rank {r} step {k + 1}: engine.steps={got['steps']}"
            assert got["spent"] == want, f"rank {r} step {k + 1}: {got['spent']} != one process's {want}"
            assert got["sampled"] == (k + 1) * per_step_samples, (
                f"rank {r}: the sample-rate monitor saw {got['sampled']} samples after {k + 1} steps, the global "
                f"batches hold {(k + 1) * per_step_samples} (this rank's shard: {sum(ACCT.shards[r])} per step)")
    solo.detach()


def test_sample_rate_sees_the_global_batch():
    q = RATE.global_batch_size / RATE_SAMPLE_SIZE
    alpha_1 = 1e-6 / 2 / 3  # the monitor's first-step threshold (fastdp.sampling_check)
    assert stats.binom.sf(10 - 1, RATE_SAMPLE_SIZE, q) > alpha_1, "one rank's shard alone must pass the check"
    assert stats.binom.sf(30 - 1, RATE_SAMPLE_SIZE, q) < alpha_1, "the union must fail it"
    vals = shared_world(3).values("rate")
    refused_everywhere(vals, "30 samples at B=6 of 60", "30", "refused")
    for r, v in enumerate(vals):
        assert all(g is None for g in v["grads"].values()), f"rank {r}: a gradient was released"
        assert v["steps"] == 0 and v["ledger"] == 0, f"rank {r}: the refused step was counted"
