"""The engine's checkpoint: what :meth:`fastdp.PrivacyEngine.state_dict` saves and how a load is validated.

Nothing in a checkpoint is trusted: the privacy configuration must equal the engine's, ``steps`` and
``noiseless_steps`` must equal the training steps (and the sigma = 0 ones) of the accountant's ledger, every training
step must have the engine's sample rate, and the budget state of ``enforce_budget`` is recomputed from the ledger,
never read. Versions 1 and 2 kept sigma = 0 steps out of the accountant; they are added to the ledger on load. A
failed load leaves the engine unchanged (everything is checked before anything is applied). Reads and writes only
the release stage's state (:class:`fastdp.release.Release`) and the engine's noise generator.
"""

from __future__ import annotations

import math
from typing import Any

from fastdp import accounting, shard_noise
from fastdp.sampling_check import SampleRateMonitor

#: checkpoint format: 2 adds the sample-rate monitor, the noiseless step count and the current noise multiplier;
#: 3 records sigma = 0 steps (and other releases) in the accountant's ledger; 4 adds the world size and rank of a
#: distributed run (absent before: one process); 5 adds the trainable parameters' names and shapes
STATE_VERSION = 5


def trainable_shapes(engine: Any) -> dict[str, list[int]]:
    """The engine's trainable parameters: path -> shape (of the whole parameter, also when it is sharded)."""
    return {name: list(p.shape) for name, p in sorted(engine.plan.trainable.items())}


def privacy_config(engine: Any) -> dict[str, Any]:
    """The configuration a checkpoint must match to be resumed by ``engine``."""
    style = engine.clipping_style if isinstance(engine.clipping_style, str) else [list(g) for g in engine._groups]
    return {"noise_multiplier": engine._initial_sigma, "sample_rate": engine.sample_rate,
            "batch_size": engine.batch_size, "sample_size": engine.sample_size, "max_grad_norm": engine.max_grad_norm,
            "clipping_fn": engine.clipping_fn, "clipping_style": style, "clipping_mode": engine.clipping_mode,
            "loss_reduction": engine.loss_reduction, "target_delta": engine.target_delta,
            "accountant": engine.accountant.name, "secure_mode": engine.secure_mode,
            "adaptive_clipping": None if engine._adaptive is None else engine._adaptive.config()}


def state_dict(engine: Any) -> dict[str, Any]:
    """See :meth:`fastdp.PrivacyEngine.state_dict`."""
    rel = engine._release
    if rel.summed:
        raise RuntimeError("state_dict() with gradients accumulated for the next step: save after "
                           "optimizer.step()")
    gen = engine.noise_generator
    return {"version": STATE_VERSION, "steps": rel.steps, "noiseless_steps": rel.noiseless_steps,
            "noise_multiplier_now": rel.sigma, "accountant": rel.accountant.state_dict(),
            "noise_generator": None if gen is None else gen.get_state(),
            "config": privacy_config(engine), "sampling": rel.sampling.state_dict(),
            "nonfinite_samples": rel.nonfinite_samples, "world_size": engine.world_size, "rank": engine.rank,
            "sharded_noise": shard_noise.checkpoint_state(engine), "trainable": trainable_shapes(engine),
            "adaptive_clipping": None if engine._adaptive is None else engine._adaptive.state_dict()}


def _count(state: dict[str, Any], key: str, default: Any = None) -> int:
    v = state.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"state[{key!r}]={v!r} must be an integer >= 0")
    return v


def load_state_dict(engine: Any, state: dict[str, Any]) -> None:
    """See :meth:`fastdp.PrivacyEngine.load_state_dict`."""
    rel = engine._release
    if rel.steps > 0 or rel.holds_gradients():
        raise RuntimeError(
            f"load_state_dict() on an engine that has already released {rel.steps} step(s) (or holds "
            "gradients for the next one): the checkpoint would replace their accounting. Load checkpoints into "
            "a freshly built engine, before any backward pass.")
    version = state.get("version") if isinstance(state, dict) else None
    if version not in (1, 2, 3, 4, STATE_VERSION):
        raise ValueError(f"not a fastdp PrivacyEngine state (version {version!r}, expected 1 to "
                         f"{STATE_VERSION})")
    theirs = state.get("config")
    if not isinstance(theirs, dict):
        raise ValueError(f"state['config']={theirs!r} must be the dict saved by state_dict()")
    mine = privacy_config(engine)
    diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: saved {a!r}, this engine {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"the saved engine state has a different privacy configuration ({detail}); build the "
                         "engine with the saved configuration to resume")
    saved = state.get("trainable")  # absent before version 5
    if saved is not None and saved != trainable_shapes(engine):
        now = trainable_shapes(engine)
        diff = sorted(set(saved) ^ set(now)) + sorted(n for n in set(saved) & set(now) if saved[n] != now[n])
        detail = ", ".join(f"{n}: saved {saved.get(n)}, this engine {now.get(n)}" for n in diff[:5])
        raise ValueError(f"the checkpoint was saved by an engine with other trainable parameters ({detail}"
                         f"{', ...' if len(diff) > 5 else ''}): resume with the same model and the same parameters "
                         "frozen")
    world, rank = state.get("world_size", 1), state.get("rank", 0)
    if (world, rank) != (engine.world_size, engine.rank):
        raise ValueError(
            f"the checkpoint was saved by rank {rank!r} of {world!r} process(es), but this engine is rank "
            f"{engine.rank} of {engine.world_size}: resume a distributed run with the same world size, each rank "
            "loading the state its own rank saved (rank 0's holds the noise generator's state)")
    steps = _count(state, "steps")
    nonfinite = _count(state, "nonfinite_samples", 0)
    trial = accounting.make_accountant(rel.accountant.name)
    trial.load_state_dict(state.get("accountant"))
    if version == 1:  # sigma = 0 steps were never recorded in the accountant
        noiseless = steps if mine["noise_multiplier"] == 0 else 0
        sigma_now = mine["noise_multiplier"]
    else:
        noiseless = _count(state, "noiseless_steps")
        sigma_now = state.get("noise_multiplier_now")
        if (isinstance(sigma_now, bool) or not isinstance(sigma_now, (int, float))
                or not (math.isfinite(sigma_now) and sigma_now >= 0)):
            raise ValueError(f"state['noise_multiplier_now']={sigma_now!r} must be a finite number >= 0")
    if version < 3 and noiseless:  # sigma = 0 steps were kept out of the accountant: record them now
        trial.record_step(0.0, engine.sample_rate, noiseless)
    if trial.ledger.steps != steps or trial.ledger.noiseless_steps != noiseless:
        raise ValueError(
            f"inconsistent checkpoint: state['steps']={steps} and state['noiseless_steps']={noiseless}, but the "
            f"accountant's ledger records {trial.ledger.steps} steps, {trial.ledger.noiseless_steps} of them "
            "without noise; the checkpoint was edited or corrupted and cannot be resumed privately")
    bad_q = sorted({e.event.sample_rate for e in trial.ledger.entries
                    if e.is_step and e.event.sample_rate != engine.sample_rate})
    if bad_q:
        raise ValueError(f"the checkpoint's accountant history has sample rates {bad_q}, but this engine's is "
                         f"{engine.sample_rate!r}; the checkpoint was not saved by this configuration")
    sampling = SampleRateMonitor(engine.batch_size, engine.sample_size)
    if version != 1:
        sampling.load_state_dict(state.get("sampling"), max_steps=steps)
    gen = state.get("noise_generator")
    if gen is not None and engine.noise_generator is None:
        raise ValueError("the saved state has a noise generator state; build the engine with "
                         "noise_generator=torch.Generator(...) to resume the same noise stream")
    apply_sharded = shard_noise.check_checkpoint_state(engine, state.get("sharded_noise"))
    adaptive = None  # adaptive clipping: R_t recomputed from the released noisy fractions, never read
    if engine._adaptive is not None:
        adaptive = engine._adaptive.check_state(state.get("adaptive_clipping"), steps)
    # all checked: apply
    apply_sharded()
    if adaptive is not None:
        engine._adaptive.apply(adaptive)
        engine._clip_cfg.thresholds = [engine._adaptive.max_grad_norm]
    if gen is not None:
        engine.noise_generator.set_state(gen)
    rel.accountant.load_state_dict(trial.state_dict())
    rel.steps = steps
    rel.sigma = float(sigma_now)
    rel.sampling = sampling
    rel.nonfinite_samples = nonfinite
    # budget state recomputed, never read: the calibration covers a history of the constructed sigma only
    homogeneous = (noiseless == 0 and not trial.ledger.releases and float(sigma_now) == engine._initial_sigma
                   and all(s == engine._initial_sigma for s, _, _ in trial.history))
    rel.budget_verified = rel.planned_steps if homogeneous else 0


__all__ = ["STATE_VERSION", "load_state_dict", "privacy_config", "state_dict", "trainable_shapes"]
