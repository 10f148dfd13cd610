"""Bad input across ranks (issue 14, item 7): a clear error on EVERY rank, never a hang beyond the process group's
short timeout, never a silent wrong release.

* A rank that skips backward (and does not call empty_step), a rank that froze a parameter without telling the
  engine, and a rank that changed its trainable set with update_trainable() alone: the step is refused on every
  rank, naming the rank and why; nothing is released (p.grad stays None, parameters unchanged, steps and the ledger
  0) on any rank, and the next valid step releases exactly the oracle of ITS batch (the refused step's sums were
  discarded everywhere, not folded in).
* A rank that calls set_noise_multiplier() alone: refused on every rank, naming the noise multiplier.
* A rank whose loss is a token mean over its batch (fastdp.loss_check), or couples its samples through in-batch
  negatives (fastdp.loss_trace): refused on every rank at the step, not by that rank's backward pass alone (which
  would leave the others waiting in the all-reduce); the next step, with per-sample losses everywhere, releases
  the same gradient on every rank.
* Ranks that disagree at construction: a frozen parameter on one rank (the error names it, and not the parameters
  the ranks agree on), a different max_grad_norm; a model wrapped
  in DistributedDataParallel (refused, naming the supported pattern); ``distributed=True`` with no process group.
* ``distributed=False`` inside a world: independent one-process engines (each releases the oracle of its own shard).
* engine.empty_step() after a backward pass on one rank: an agreed refusal (the others are told at once, not by a
  timeout).
* A rank that never calls optimizer.step(): the others' error says the collective timed out (process group timeout
  3 s), with nothing released.
* Rank 0 alone records another release (a DP evaluation on rank 0 only): the ranks' accountants must not diverge
  silently (every rank refuses, or every rank reports the same epsilon), and an ``enforce_budget`` refusal that only
  rank 0's ledger triggers must be agreed, not leave rank 1 waiting for a collective.
* state_dict() carries world_size and rank; a one-process checkpoint does not load into a 2-rank engine.
"""

from __future__ import annotations

import re

import pytest
import torch
from dist_checks import assert_bit_identical, refused_everywhere
from dist_refusal_cases import (
    run_construct,
    run_distributed_flags,
    run_empty_step_misuse,
    run_local_release,
    run_loss_check_refusal,
    run_loss_trace_refusal,
    run_never_step,
    run_refused_step,
    run_state,
    run_zero_policy_paths,
)
from dist_specs import LOSSES, Spec, build, oracle_for, shard_batches
from harness import Case, register, shared_world
from oracle import assert_grads_close, clipped_sum, make_engine, oracle_model, per_sample_grads, trainable_names

SHORT_TIMEOUT = 3.0
REFUSE = Spec("mixed", ((3,), (2,)), seed=80)
#: case -> (scenario, culprit rank, what every rank's error must name besides the culprit)
SCENARIOS = {"skip_backward": ("skip_backward", 1, ("backward",)),
             "skip_backward-rank0": ("skip_backward", 0, ("backward",)),  # the rank that draws the noise
             "frozen": ("frozen", 1, ("fc.weight",)),
             "update_trainable": ("update_trainable", 1, ("trainable", "fc.weight")),
             "sigma": ("sigma", 1, ("noise multiplier",)),
             "nonfinite_deferred": ("nonfinite_deferred", 1, ("NaN", "backward pass 1"))}
FLAGS = Spec("mixed", ((3,), (2,)), seed=81)
ZERO = Spec("mixed", ((3,), (2,)), seed=84)
FLAGS_R = 0.05
NEVER = Spec("mixed", ((2,), (2,)), seed=82)
LOCAL = Spec("mixed", ((2,), (1,)), seed=83, batch_size=4)


def _refused_builder(case: str):
    scenario, culprit, _ = SCENARIOS[case]

    def builder():
        oracle = oracle_for(REFUSE)
        return Case(f"refuse-{case}", run_refused_step,
                    {"spec": REFUSE, "R": oracle["R"], "scenario": scenario, "culprit": culprit}), oracle
    return builder


for _s in SCENARIOS:
    register(2, f"refuse-{_s}", _refused_builder(_s))
for _s in ("frozen", "max_grad_norm", "ddp", "frozen-many"):
    register(2, f"construct-{_s}", lambda _s=_s: (Case(f"construct-{_s}", run_construct, {
        "kind": "many" if _s == "frozen-many" else "mixed", "scenario": _s.replace("-many", "")}), None))
register(2, "zero-policy", lambda: (Case("zero-policy", run_zero_policy_paths, {"spec": ZERO, "R": 0.5}), None))
register(2, "flags", lambda: (Case("flags", run_distributed_flags, {"spec": FLAGS, "R": FLAGS_R}), None))
register(2, "state", lambda: (Case("state", run_state, {"spec": FLAGS, "R": 1.0}), None))
register(2, "never-step", lambda: (Case("never-step", run_never_step,
                                        {"spec": NEVER, "R": 1.0, "sleep": SHORT_TIMEOUT + 3},
                                        pg_timeout=SHORT_TIMEOUT, fresh_group=True), None))
register(2, "empty-step-misuse", lambda: (Case("empty-step-misuse", run_empty_step_misuse,
                                               {"spec": NEVER, "R": 1.0}, pg_timeout=SHORT_TIMEOUT,
                                               fresh_group=True), None))
for _enforce in (True, False):
    _name = f"local-release-{'budget' if _enforce else 'epsilon'}"
    register(2, _name, lambda _name=_name, _enforce=_enforce: (
        Case(_name, run_local_release, {"spec": LOCAL, "R": 1.0, "enforce": _enforce}, pg_timeout=SHORT_TIMEOUT,
             fresh_group=True), None))


@pytest.mark.parametrize("case", list(SCENARIOS))
def test_refused_step_on_every_rank(case):
    world = shared_world(2)
    name = f"refuse-{case}"
    vals = world.values(name)
    _, culprit, needles = SCENARIOS[case]
    refused_everywhere([v["first"] for v in vals], name, f"rank {culprit}", *needles)
    for r, v in enumerate(vals):
        a = v["after_first"]
        released = [n for n, g in a["grads"].items() if g is not None]
        assert not released, f"{name}: rank {r} released {released} in the refused step"
        assert a["unchanged"], f"{name}: rank {r}'s parameters changed in the refused step"
        assert a["steps"] == 0 and a["ledger"] == 0, f"{name}: rank {r} counted the refused step ({a})"
        assert not v["second"]["raised"], f"{name}: rank {r}'s next, valid step raised: {v['second']['msg']}"
        assert v["steps"] == 1
    oracle = world.extra(name)
    for r, v in enumerate(vals):
        assert_grads_close(v["grads2"], oracle["want"], rtol=1e-6, atol=oracle["atol"],
                           msg=f"{name}: the step after the refused one, rank {r}")
    assert_bit_identical([v["grads2"] for v in vals], f"{name}: the step after the refused one")


@pytest.mark.parametrize("scenario,needles", [
    ("frozen", ("fc.weight", "rank 1")),
    ("max_grad_norm", ("max_grad_norm", "rank 0 1.0", "rank 1 2.0")),
    ("ddp", ("DistributedDataParallel", "PrivacyEngine(model")),
])
def test_construction_refused_on_every_rank(scenario, needles):
    refused_everywhere(shared_world(2).values(f"construct-{scenario}"), scenario, *needles)


def test_construction_names_only_the_difference():
    """120 trainable tensors, rank 1 froze one: the error names that one, not the 119 the ranks agree on (a 7B model
    has hundreds; an error listing them all does not name the difference)."""
    vals = shared_world(2).values("construct-frozen-many")
    refused_everywhere(vals, "frozen-many", "layers.layer030.weight", "rank 1")
    for r, v in enumerate(vals):
        assert "layers.layer017.weight" not in v["msg"], (
            f"rank {r}'s error lists parameters the ranks agree on ({len(v['msg'])} characters): {v['msg'][:400]}...")


def test_distributed_true_without_process_group():
    if torch.distributed.is_initialized():
        pytest.skip("this pytest process has a process group (left by another test)")
    with pytest.raises(RuntimeError, match="init_process_group"):
        make_engine(build("mixed", 0), batch_size=4, distributed=True)
    engine = make_engine(build("mixed", 0), batch_size=4)  # the default: one process
    assert (engine.world_size, engine.rank) == (1, 0)


def test_distributed_false_gives_independent_engines():
    vals = shared_world(2).values("flags")
    for r, v in enumerate(vals):
        assert (v["local"]["world_size"], v["local"]["rank"]) == (1, 0), f"rank {r}: distributed=False"
        assert (v["default"]["world_size"], v["default"]["rank"]) == (2, r), f"rank {r}: default"
        assert (v["explicit"]["world_size"], v["explicit"]["rank"]) == (2, r), f"rank {r}: distributed=True"
        model = build(FLAGS.model, FLAGS.seed + r)
        names = trainable_names(model)
        assert all(torch.equal(v["local"]["before"][n], p) for n, p in model.named_parameters()), (
            f"rank {r}: distributed=False must not broadcast rank 0's parameters")
        psg = per_sample_grads(oracle_model(model), LOSSES[FLAGS.model], shard_batches(FLAGS)[r], names)
        want = clipped_sum(psg, [names], FLAGS.fn, FLAGS_R, FLAGS.global_batch_size)
        assert_grads_close(v["local"]["grads"], want, rtol=1e-6, atol=1e-10, msg=f"rank {r} distributed=False")


def test_state_dict_world_size_and_rank():
    vals = shared_world(2).values("state")
    for r, v in enumerate(vals):
        assert (v["world_size"], v["rank"]) == (2, r)
        assert v["load_solo"]["raised"], f"rank {r}: a one-process checkpoint loaded into a 2-rank engine"
        msg = v["load_solo"]["msg"]
        low = msg.lower()
        assert re.search(r"\b1\b", msg) and re.search(r"\b2\b", msg), f"both world sizes must be named: {msg}"
        assert "world" in low or "process" in low, msg


def test_rank_that_never_steps_times_out():
    vals = shared_world(2).values("never-step")
    assert vals[1] == {"slept": True}
    v = vals[0]
    assert v["raised"], "rank 0's optimizer.step() returned although rank 1 never stepped"
    assert "RuntimeError" in v["mro"], v["type"]
    assert "timed out" in v["msg"].lower() or "timeout" in v["msg"].lower(), v["msg"]
    assert v["seconds"] < SHORT_TIMEOUT + 10, f"the refusal took {v['seconds']:.1f} s"
    assert all(g is None for g in v["grads"].values()) and v["steps"] == 0


def test_empty_step_after_backward_on_one_rank_is_agreed():
    """engine.empty_step() after a backward pass is refused in one process; on rank 1 alone (rank 0 steps normally)
    the refusal is a check of the step like any other: every rank raises naming rank 1 and empty_step, at once."""
    vals = shared_world(2).values("empty-step-misuse")
    detail = "; ".join(f"rank {r} ({v['seconds']:.1f} s): {v.get('type')}: {v.get('msg', '')[:300]}"
                       for r, v in enumerate(vals))
    for r, v in enumerate(vals):
        assert v["raised"], f"rank {r} did not raise: {detail}"
        assert all(g is None for g in v["grads"].values()) and v["steps"] == 0, f"rank {r} released: {detail}"
    assert "empty_step" in vals[0]["msg"] and "rank 1" in vals[0]["msg"], (
        f"rank 0's error does not name rank 1's reason: {detail}")
    assert vals[0]["seconds"] < SHORT_TIMEOUT, f"rank 0 waited for the collective's timeout: {detail}"


@pytest.mark.parametrize("kind", ["budget", "epsilon"])
def test_release_recorded_on_one_rank_only(kind):
    """Rank 0 alone calls engine.record_release (a DP evaluation on rank 0, as people write it)."""
    vals = shared_world(2).values(f"local-release-{kind}")
    assert not vals[0]["record"]["raised"], vals[0]["record"]["msg"]
    if kind == "budget":  # the premise: rank 0's ledger now refuses the step, rank 1's alone would not
        assert vals[0]["eps_after_step_here"] > 1.0
    raised = [v["step"]["raised"] for v in vals]
    detail = "; ".join(f"rank {r}: " + (f"{v['step']['type']}: {v['step']['msg'][:300]}" if v["step"]["raised"]
                                        else f"released, epsilon {v['epsilon']}") for r, v in enumerate(vals))
    if any(raised):
        assert all(raised), f"the step was refused on some ranks only: {detail}"
        for r, v in enumerate(vals):
            assert v["steps"] == 0, f"rank {r} counted a step that was refused elsewhere: {detail}"
            assert "epsilon" in v["step"]["msg"] or "record_release" in v["step"]["msg"], (
                f"rank {r}'s error does not say why (the budget / the ranks' ledgers differ): {detail}")
            assert v["seconds"] < SHORT_TIMEOUT, f"rank {r} waited for a timeout instead of an agreed refusal"
    else:
        eps = [v["epsilon"] for v in vals]
        assert all(e == eps[0] for e in eps), f"get_privacy_spent() differs between ranks: {detail}"


def test_zero_policy_releases_the_same_on_both_paths_across_ranks():
    """A NaN sample on rank 1 under on_nonfinite="zero": the accelerator path (no host read in the backward pass,
    the count read at the release) releases on every rank what the CPU path releases (which the one-process oracle
    suites check), finite, with the samples counted on rank 1 only."""
    vals = shared_world(2).values("zero-policy")
    for r, v in enumerate(vals):
        assert v["host"]["nonfinite"] == v["device"]["nonfinite"]
        assert (v["device"]["nonfinite"] >= 1) if r == 1 else (v["device"]["nonfinite"] == 0)
        for n, g in v["device"]["grads"].items():
            assert torch.isfinite(g).all(), (r, n)
        assert_grads_close(v["device"]["grads"], v["host"]["grads"], rtol=1e-10, atol=1e-14, msg=f"rank {r}")
    assert_bit_identical([v["device"]["grads"] for v in vals], "zero policy, device path")


register(2, "loss-check", lambda: (Case("loss-check", run_loss_check_refusal, {"R": 0.5}), None))


def test_loss_check_refusal_on_one_rank_refuses_the_step_everywhere():
    vals = shared_world(2).values("loss-check")
    refused_everywhere([v["first"] for v in vals], "loss-check", "rank 1", "token mean over the whole batch")
    for r, v in enumerate(vals):
        assert v["after_first"] == {"released": [], "steps": 0}, f"rank {r}: {v['after_first']}"
        assert not v["second"]["raised"], f"rank {r}'s next, valid step raised: {v['second']['msg']}"
        assert v["verdicts"].get("per-sample mean") == 1, v["verdicts"]
    assert_bit_identical([v["grads2"] for v in vals], "loss-check: the step after the refused one")


register(2, "loss-trace", lambda: (Case("loss-trace", run_loss_trace_refusal, {"R": 0.5}), None))


def test_loss_trace_refusal_on_one_rank_refuses_the_step_everywhere():
    vals = shared_world(2).values("loss-trace")
    refused_everywhere([v["first"] for v in vals], "loss-trace", "rank 1", "couples samples")
    for r, v in enumerate(vals):
        assert v["after_first"] == {"released": [], "steps": 0}, f"rank {r}: {v['after_first']}"
        assert not v["second"]["raised"], f"rank {r}'s next, valid step raised: {v['second']['msg']}"
    assert vals[1]["traces"].get("coupled") == 1 and vals[0]["traces"].get("separable") == 2, [
        v["traces"] for v in vals]
    assert_bit_identical([v["grads2"] for v in vals], "loss-trace: the step after the refused one")


register(2, "loss-trace-strict", lambda: (Case("loss-trace-strict", run_loss_trace_refusal, {"R": 0.5,
                                                                                             "strict": True}), None))


def test_strict_refusal_of_an_unverified_loss_on_one_rank_refuses_the_step_everywhere():
    vals = shared_world(2).values("loss-trace-strict")
    refused_everywhere([v["first"] for v in vals], "loss-trace-strict", "rank 1", 'verify_loss="strict"')
    for r, v in enumerate(vals):
        assert v["after_first"] == {"released": [], "steps": 0}, f"rank {r}: {v['after_first']}"
        assert not v["second"]["raised"], f"rank {r}'s next, valid step raised: {v['second']['msg']}"
    assert vals[1]["traces"] == {"unverified": 1, "separable": 1} and vals[0]["traces"] == {"separable": 2}, [
        v["traces"] for v in vals]
    assert_bit_identical([v["grads2"] for v in vals], "loss-trace-strict: the step after the refused one")
