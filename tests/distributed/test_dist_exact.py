"""Exactness across ranks (issue 14, item 1): with sigma = 0, N gloo processes that each hold a shard of the logical
batch release, on every rank, the brute-force batch-of-one oracle's gradient of the UNION batch (float64, 1e-6
relative), bit-identical across ranks. N = 2 and 3; even and uneven shards (3/1/0); a rank whose shard is empty
(a 0-row batch through forward and backward, or engine.empty_step()); virtual batches (different numbers of
backward passes per rank); every clipping mode; styles all-layer, layer-wise, param-wise and explicit groups;
clipping functions abadi, automatic, global; sum and mean reductions; tied weights; the generic path (raw class
token and position embedding); layers that see the batch folded into their rows (x.reshape(-1, d)); a weight read
outside its module's call (given to the root's replay by each rank's structure probe); rows chosen by the data
(one per sample into a trainable layer, unpadded rows written back by sample; each rank's guard checks them);
DP-BiTFiT; two views of each sample in engine.same_samples() after a pass that optimizer.zero_grad() forgets;
rank 0's parameters broadcast at construction; ``process_group=`` a sub-group (one without global rank 0 too); the
same update_trainable() on every rank; all-reduce buckets of a few bytes; ten random 3-rank steps (shards, virtual
batches, empty steps, model, mode, style, function, reduction).

Each world runs every case of its table in one set of processes (tests/distributed/harness.py); the oracle runs in
the pytest process before the world starts (it chooses R between the per-sample norms, so clipping changes the
result far beyond the tolerance: a test an unclipped or per-rank-clipped release cannot pass).
"""

from __future__ import annotations

import random

import pytest
import torch
from dist_cases import run_exact, run_input_grads, run_subgroup, run_update_both, run_views
from dist_checks import check_exact
from dist_specs import Spec, oracle_for
from harness import Case, register, run_world, shared_world

from fastdp.modes import CLIPPING_MODES

N2: dict[str, Spec] = {
    "even": Spec("mixed", ((3,), (3,)), seed=1),
    "uneven": Spec("mixed", ((4,), (1,)), seed=2),
    "one-sample": Spec("mixed", ((1,), (0,)), seed=3, where="below"),
    "zero-row-shard": Spec("mixed", ((3,), (0,)), seed=4),
    "zero-row-shard-sum": Spec("mixed", ((0,), (5,)), seed=5, reduction="sum"),
    "empty-step-rank": Spec("mixed", ((4,), None), seed=6),
    "virtual": Spec("mixed", ((2, 0, 1), (3,)), seed=7),
    "layer-wise": Spec("mixed", ((3,), (2,)), seed=8, style="layer-wise"),
    "param-wise": Spec("mixed", ((2,), (3,)), seed=9, style="param-wise", fn="automatic"),
    "groups": Spec("mixed", ((3,), (3,)), seed=10, style="groups"),
    "global-fn": Spec("mixed", ((2, 2), (3,)), seed=11, fn="global"),
    "automatic-sum": Spec("mixed", ((3,), (1, 1)), seed=12, fn="automatic", reduction="sum"),
    "expected-B": Spec("mixed", ((3,), (2,)), seed=13, batch_size=8),  # divisor: the declared B, not the count
    "vit-generic": Spec("vit", ((2, 1), (3,)), seed=14),
    "vit-generic-layer-wise": Spec("vit", ((5,), (1,)), seed=15, style="layer-wise", reduction="sum"),
    "tied": Spec("tied", ((3,), (2,)), seed=16),
    "bitfit": Spec("mixed", ((3,), (2,)), seed=17, bitfit=True),
    "bitfit-virtual": Spec("mixed", ((1, 2), (0,)), seed=18, bitfit=True, style="layer-wise"),
    "broadcast-rank0": Spec("mixed", ((3,), (2,)), seed=19, model_seeds=(19, 91)),
    "broadcast-rank0-bitfit": Spec("mixed", ((2,), (2,)), seed=23, model_seeds=(23, 32), bitfit=True),
    "all-empty-step": Spec("mixed", (None, None), seed=20),
    "all-zero-rows": Spec("mixed", ((0,), (0, 0)), seed=21),
    "cnn": Spec("cnn", ((3,), (2,)), seed=24),
    "cnn-bitfit": Spec("cnn", ((2, 1), (3,)), seed=25, bitfit=True),
    "folded": Spec("folded", ((3,), (2,)), seed=26),  # the batch folded into the rows of fc and norm
    "folded-ghost-one-sample": Spec("folded", ((2, 1), (1,)), seed=27, mode="ghost", style="layer-wise"),
    "outside-use": Spec("outside", ((3,), (2,)), seed=28),  # a weight read outside its module: the root replays it
    # rows chosen by the data: one per sample into a trainable Linear, unpadded rows written back by sample
    "chosen": Spec("chosen", ((3,), (2,)), seed=29),
    "chosen-virtual-ghost": Spec("chosen", ((2, 1), (1, 2)), seed=80, mode="ghost", style="layer-wise"),
}
for _i, _mode in enumerate(CLIPPING_MODES):
    N2[f"mode-{_mode}"] = Spec("mixed", ((3, 1), (2,)), seed=30 + _i, mode=_mode, style="layer-wise")
    N2[f"mode-{_mode}-vit"] = Spec("vit", ((2,), (4,)), seed=40 + _i, mode=_mode)

N3: dict[str, Spec] = {
    "3-1-0": Spec("mixed", ((3,), (1,), (0,)), seed=50),
    "uneven-virtual-empty-step": Spec("mixed", ((2, 2), None, (1, 0, 3)), seed=51),
    "groups": Spec("mixed", ((2,), (3,), (2,)), seed=52, style="groups", fn="automatic"),
    "vit-generic": Spec("vit", ((1,), (3,), (2,)), seed=53),
    "tied": Spec("tied", ((2,), (0,), (4,)), seed=54),
    "bitfit": Spec("mixed", ((1,), (2,), (3,)), seed=55, bitfit=True),
    "ghost": Spec("mixed", ((3,), (1,), (2,)), seed=56, mode="ghost"),
    "cnn": Spec("cnn", ((2,), (0,), (3,)), seed=58, style="layer-wise"),
}

def _random_specs(n: int, seed: int) -> dict[str, Spec]:
    """``n`` random steps on 3 ranks (a fixed seed, so the same every run): each rank gets 0-3 physical batches of
    0-4 samples or an empty_step(); model, mode, style, clipping function and reduction drawn too."""
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        shards = []
        for _ in range(3):
            k = rng.randint(0, 3)
            shards.append(None if k == 0 else tuple(rng.randint(0, 4) for _ in range(k)))
        if not any(s for s in shards):
            shards[0] = (2,)
        if sum(sum(s) for s in shards if s) == 0:
            shards[0] = (1,)
        out[f"random-{i}"] = Spec(rng.choice(["mixed", "vit", "tied"]), tuple(shards), seed=100 + i,
                                  mode=rng.choice(CLIPPING_MODES), fn=rng.choice(["abadi", "automatic", "global"]),
                                  style=rng.choice(["all-layer", "layer-wise", "groups"]),
                                  reduction=rng.choice(["mean", "sum"]))
    return out


N3.update(_random_specs(10, 14))

#: process_group= ranks {0, 1} and {1, 2} of the 3-rank world (shards by group rank)
SUBGROUP = Spec("mixed", ((3,), (2,)), seed=57)
SUBGROUP12 = Spec("mixed", ((1,), (4,)), seed=58)
#: every rank freezes fc.weight after building the engine and calls update_trainable()
UPDATE_BOTH = Spec("mixed", ((2,), (3,)), seed=59, frozen=("fc.weight",))

#: slow: the tiny GPT-2 (transformers import in every rank), every mode
GPT2: dict[str, Spec] = {f"gpt2-{m}": Spec("gpt2", ((2,), (1, 1)), seed=60 + i, mode=m)
                         for i, m in enumerate(CLIPPING_MODES)}


def _exact(spec: Spec, name: str, fn=run_exact, **extra):
    def builder():
        oracle = oracle_for(spec)
        return Case(name, fn, {"spec": spec, "R": oracle["R"], **extra}), oracle
    return builder


for _name, _spec in N2.items():
    register(2, f"exact-{_name}", _exact(_spec, f"exact-{_name}"))
for _name, _spec in N3.items():
    register(3, f"exact-{_name}", _exact(_spec, f"exact-{_name}"))
for _b in (64, 300):  # every tensor its own bucket; several tensors per bucket, cut between them
    register(3, f"exact-buckets-{_b}", _exact(Spec("mixed", ((2,), (1, 2), (3,)), seed=60 + _b, style="layer-wise"),
                                              f"exact-buckets-{_b}", bucket_bytes=_b))
for _m in ("BK-ghost", "ghost"):  # every ghost norm's Grams in strips of 2 rows (the default keeps these whole)
    register(3, f"exact-strips-{_m}", _exact(Spec("mixed", ((2,), (1, 2), (3,)), seed=70, mode=_m),
                                             f"exact-strips-{_m}", gram_strip=(2, 8)))
register(3, "exact-subgroup", _exact(SUBGROUP, "exact-subgroup", run_subgroup))
register(3, "exact-subgroup12", _exact(SUBGROUP12, "exact-subgroup12", run_subgroup, ranks=(1, 2)))
register(2, "exact-update-both", _exact(UPDATE_BOTH, "exact-update-both", run_update_both))
#: two identical views of each sample in engine.same_samples(), after a clean pass optimizer.zero_grad() forgets
VIEWS = Spec("mixed", ((3,), (2,)), seed=31, views=2)
register(2, "exact-views-zero-grad", _exact(VIEWS, "exact-views-zero-grad", run_views))
#: two input-gradient passes (adversarial training's), then the training pass, on float inputs
INPUT_GRADS = Spec("vit", ((3,), (2,)), seed=33)
register(2, "exact-input-grads", _exact(INPUT_GRADS, "exact-input-grads", run_input_grads))


def _check(n: int, name: str) -> None:
    world = shared_world(n)
    check_exact(world.values(name), world.extra(name), n, f"N={n} {name}")


@pytest.mark.parametrize("name", list(N2))
def test_exact_two_ranks(name):
    _check(2, f"exact-{name}")


@pytest.mark.parametrize("name", list(N3))
def test_exact_three_ranks(name):
    _check(3, f"exact-{name}")


@pytest.mark.parametrize("bucket_bytes", [64, 300])
def test_exact_with_small_buckets(bucket_bytes):
    """All-reduce buckets of 64 or 300 bytes (the engine's are 25 MB): many buckets, exact and bit-identical."""
    _check(3, f"exact-buckets-{bucket_bytes}")


@pytest.mark.parametrize("mode", ["BK-ghost", "ghost"])
def test_exact_with_gram_strips(mode):
    """The ghost norms' Gram matrices cut into strips of 2 rows on each of 3 ranks: exact and bit-identical."""
    _check(3, f"exact-strips-{mode}")


def test_process_group_subgroup():
    """``process_group=`` ranks {0, 1} of a 3-rank world: those two release the oracle of their union."""
    world = shared_world(3)
    vals = world.values("exact-subgroup")
    assert vals[2] == {"skipped": True}
    check_exact(vals[:2], world.extra("exact-subgroup"), 2, "sub-group {0, 1}")
    vals = world.values("exact-subgroup12")
    assert vals[0] == {"skipped": True}
    check_exact(vals[1:], world.extra("exact-subgroup12"), 2, "sub-group {1, 2} (noise and broadcast from rank 1)")


def test_update_trainable_on_every_rank():
    """The same freeze + update_trainable() on every rank: the next step is exact for the new trainable set."""
    world = shared_world(2)
    vals = world.values("exact-update-both")
    assert all("fc.weight" not in v["grads"] for v in vals)
    check_exact(vals, world.extra("exact-update-both"), 2, "update_trainable on every rank")


def test_broadcast_made_the_ranks_identical():
    """The ranks built different models (seeds 19 and 91); rank 0's parameters and buffer were broadcast, so both
    released the oracle of rank 0's model (checked in test_exact_two_ranks) and hold the same parameters; with
    DP-BiTFiT the frozen weights (part of the function) too."""
    for name in ("exact-broadcast-rank0", "exact-broadcast-rank0-bitfit"):
        a, b = shared_world(2).values(name)
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
        assert len(a["params"]) == 9


@pytest.mark.slow
def test_exact_gpt2_every_mode():
    """Tied weights in a real model: the tiny GPT-2 of tests/model_oracle.py (wte tied to lm_head), every mode."""
    oracles = {name: oracle_for(spec) for name, spec in GPT2.items()}
    world = run_world(2, [Case(name, run_exact, {"spec": spec, "R": oracles[name]["R"]})
                          for name, spec in GPT2.items()])
    for name in GPT2:
        check_exact(world.values(name), oracles[name], 2, f"N=2 {name}")


def test_views_after_a_forgotten_pass_on_every_rank():
    """Each rank: a clean pass of its shard that ``optimizer.zero_grad()`` forgets, then two views of each sample in
    ``engine.same_samples()`` and one backward pass: the union's oracle of the views' loss (each sample's gradient
    twice its own, clipped once), bit-identical across ranks."""
    _check(2, "exact-views-zero-grad")


def test_input_gradient_passes_add_nothing_on_any_rank():
    """Each rank: ``torch.autograd.grad(loss, x)`` and ``loss.backward(inputs=[x])`` on its shard (adversarial
    training's input gradients), then a training pass on the same shard: the union's plain oracle, bit-identical
    across ranks (before the engine told the passes apart, each input-gradient pass was summed into the step)."""
    _check(2, "exact-input-grads")
