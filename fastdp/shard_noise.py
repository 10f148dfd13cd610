"""The noise stream of a rank's rows of FSDP2-sharded parameters, and its part of the engine's checkpoint.

Under ``fully_shard`` each rank draws the noise of its own rows (:mod:`fastdp.sharding`); :class:`ShardNoise` is that
rank's generator, and :func:`checkpoint_state` / :func:`check_checkpoint_state` save and validate it as the
checkpoint's ``"sharded_noise"`` entry (:mod:`fastdp.checkpoint`). It may touch: its own generators.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch


class ShardNoise:
    """This rank's noise stream for its rows of the sharded parameters.

    Ranks must not share a stream (rows of different ranks would get equal noise, which cancels in their
    difference), and a user who seeds every rank alike (as for identical initialisation) would give them one. So each
    rank uses its own ``torch.Generator`` seeded from a hash of the engine's ``noise_generator`` state (or the
    global RNG's, without one) at construction and its rank: reproducible from the user's seed, distinct per rank
    (checked at construction: an equal seed on two ranks raises). Its state is saved in the engine's checkpoint.
    Secure mode draws from fresh CSPRNG-seeded generators instead (:func:`fastdp.noise.secure_noisy_mean`).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        group = engine._group
        base = engine.noise_generator if engine.noise_generator is not None else torch.default_generator
        digest = hashlib.sha256(base.get_state().numpy().tobytes()
                                + f"fastdp-shard-noise:{group.rank}".encode()).digest()
        self.seed = int.from_bytes(digest[:4], "little")  # CPU generators keep 32 bits of a seed
        self._gens: dict[str, torch.Generator] = {}
        self._pending_state: Any = None
        if not engine.secure_mode:
            seeds = group.gather_objects(self.seed, "check that the ranks' shard noise streams differ")
            if len(set(seeds)) != len(seeds):  # pragma: no cover - a 32-bit hash collision
                raise RuntimeError(f"the shard noise seeds of the ranks collide ({seeds}); build the engine with "
                                   "another noise_generator seed")

    def generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        gen = self._gens.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            if self._pending_state is not None and self._pending_state.get("device") == key:
                gen.set_state(self._pending_state["state"])
                self._pending_state = None
            self._gens[key] = gen
        return gen

    def state_dict(self) -> dict[str, Any]:
        if len(self._gens) > 1:  # pragma: no cover - parameters on several devices of one rank
            raise RuntimeError("sharded parameters on several devices of one rank: not supported by checkpoints")
        if not self._gens:  # no step yet since construction or a load: the stream has not moved
            pending = self._pending_state or {"device": None, "state": None}
            return {"seed": self.seed, **pending}
        key, gen = next(iter(self._gens.items()))
        return {"seed": self.seed, "device": key, "state": gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self._gens.clear()
        self._pending_state = None if state["state"] is None else {"device": state["device"],
                                                                    "state": state["state"]}


def checkpoint_state(engine: Any) -> dict[str, Any] | None:
    """The engine checkpoint's ``"sharded_noise"`` entry: this rank's shard noise stream (``None``: no
    fully_shard parameters)."""
    sharding = getattr(engine, "_sharding", None)
    return None if sharding is None else sharding.state_dict()


def check_checkpoint_state(engine: Any, saved: Any) -> Callable[[], None]:
    """Validate a checkpoint's ``"sharded_noise"`` entry against ``engine`` (raises ValueError naming the
    difference) and return the function that applies it (called once every other check passed)."""
    sharding = getattr(engine, "_sharding", None)
    if sharding is None:
        if saved is not None:
            raise ValueError("the checkpoint was saved by an engine over a fully_shard (FSDP2) model, this engine's "
                             "model is not sharded: resume with the same sharding")
        return lambda: None
    if saved is None:
        raise ValueError("this engine's model is sharded with fully_shard (FSDP2) but the checkpoint has no shard "
                         "noise state (saved by an engine over an unsharded model): resume with the same sharding")
    group = engine._group
    if not isinstance(saved, dict) or (saved.get("world_size"), saved.get("rank")) != (group.world_size, group.rank):
        who = (saved.get("rank"), saved.get("world_size")) if isinstance(saved, dict) else ("?", "?")
        raise ValueError(f"the shard noise state was saved by rank {who[0]!r} of {who[1]!r}, but this engine is "
                         f"rank {group.rank} of {group.world_size}: load each rank's own engine state")
    noise = saved.get("noise")
    if not isinstance(noise, dict) or not {"seed", "device", "state"} <= set(noise):
        raise ValueError(f"the checkpoint's shard noise state {noise!r} is not the one state_dict() saves")
    return lambda: sharding.load_state_dict(saved)


__all__ = ["ShardNoise", "check_checkpoint_state", "checkpoint_state"]
