"""Checkpoints of a data-parallel run (issue 14, item 6): saved after 2 of 4 noisy steps (model, Adam state, every
rank's engine state) and resumed in fresh objects whose noise generator is seeded differently, the run continues
bit-identically to the uninterrupted one, on every rank; another rank's engine state is refused naming both ranks.
(A one-process state into a 2-rank engine: tests/distributed/test_dist_refusals.py; FSDP2 through
torch.distributed.checkpoint: tests/distributed/test_fsdp.py.)"""

from __future__ import annotations

import pytest
import torch
from dist_cases import run_resume
from dist_specs import Spec
from harness import Case, register, shared_world

RESUME = {2: Spec("mixed", ((3,), (1,)), seed=90, batch_size=4),
          3: Spec("mixed", ((2,), None, (3,)), seed=91, batch_size=5)}

for _n, _spec in RESUME.items():
    register(_n, "resume", lambda _spec=_spec: (Case("resume", run_resume,
                                                      {"spec": _spec, "R": 0.5, "sigma": 1.0, "steps": 4,
                                                       "split": 2}), None))


@pytest.mark.parametrize("n", sorted(RESUME))
def test_resume_continues_bit_identically_on_every_rank(n):
    vals = shared_world(n).values("resume")
    for r, v in enumerate(vals):
        assert v["steps"] == 2 and v["world_size"] == n
        for name, p in v["straight"].items():
            assert torch.equal(p, v["resumed"][name]), f"rank {r}: {name} differs after the resume"
            assert torch.equal(p, vals[0]["straight"][name]), f"rank {r}: {name} differs from rank 0's"
        assert any(not torch.equal(p, q) for p, q in zip(v["straight"].values(), _initial(n).values(),
                                                          strict=True)), "the run did not train"
        other = v["other_rank"]
        assert other["raised"] and "ValueError" in other["mro"], other
        assert f"rank {(r + 1) % n}" in other["msg"] and f"rank {r} of {n}" in other["msg"], other["msg"]


def _initial(n: int) -> dict[str, torch.Tensor]:
    from dist_specs import build

    return {k: p.detach() for k, p in build(RESUME[n].model, RESUME[n].seed).named_parameters()}
