"""Communication of the private step (issue 14, item 4): every torch.distributed collective the engine calls in one
step, counted on each rank. The clipped sums cross ranks once, as an all-reduce of exactly the trainable
parameters' size (float64 here: what non-private DDP all-reduces for this model), plus one small header exchange;
nothing grows with the number of samples (per-sample norms never cross ranks, all-layer style), nothing is
broadcast; ``engine.communication`` reports the same bytes."""

from __future__ import annotations

from dist_cases import run_communication
from dist_specs import Spec
from harness import Case, register, shared_world

SMALL = Spec("mixed", ((1,), (2,)), seed=90)
BIG = Spec("mixed", ((6,), (7,)), seed=91)

register(2, "communication", lambda: (Case("communication", run_communication, {"spec": SMALL, "big": BIG}), None))


def test_one_all_reduce_of_the_parameters_and_a_fixed_header():
    vals = shared_world(2).values("communication")
    for r, v in enumerate(vals):
        small, big = v["small"], v["big"]
        for label, one in (("small", small), ("big", big)):
            c = one["counted"]
            others = sorted(set(c) - {"all_reduce", "all_gather"})
            assert not others, f"rank {r} {label}: the step also called {others}"
            assert sum(c["all_reduce"]) == one["param_bytes"], (
                f"rank {r} {label}: all-reduced {sum(c['all_reduce'])} bytes, the trainable parameters are "
                f"{one['param_bytes']}")
            assert one["engine"] == {"all_reduce_bytes": one["param_bytes"], "steps": 1, "reduce_scatter_bytes": 0}, \
            one["engine"]
            assert len(c.get("all_gather", [])) == 1 and sum(c["all_gather"]) <= 256, (
                f"rank {r} {label}: header traffic {c.get('all_gather')}")
        assert small["counted"] == big["counted"], (
            f"rank {r}: the step's traffic depends on the number of samples: {small['counted']} vs "
            f"{big['counted']}")
