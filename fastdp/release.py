"""Release: the private step -- accumulated clipped sums, checks, noise, accounting, ``.grad`` for the optimizer.

Last stages of the data flow (plan -> capture -> per-sample norms -> clipping factors -> clipped sums ->
(all-reduce) -> **noise -> optimizer**). :class:`Release` owns

* the step's accumulator: ``sum_i C_i g_i`` per parameter over every backward pass since the last step (virtual
  batches), the number of samples they held, and the count of samples given factor 0 for non-finite gradients;
* the step counters (``steps``, ``noiseless_steps``), the accountant, the current noise multiplier, the sample-rate
  monitor (:mod:`fastdp.sampling_check`) and the budget look-ahead of ``enforce_budget``;
* the optimizer's step pre-hook (:meth:`Release.pre_step`) that refuses a step that cannot be private (nothing
  released, nothing accounted), then writes ``p.grad = (S + sigma R xi) / B`` (:mod:`fastdp.noise`, the one place
  noise is drawn) and counts the step; and the global pre-hook that refuses another optimizer's step while the
  engine holds gradients (:meth:`Release.other_step`).

On several ranks (:mod:`fastdp.distributed`) the step's checks are agreed by every rank first, and the clipped sums
are all-reduced with rank 0's noise (:meth:`Release._release_reduced`), so every rank releases the same gradient.
It may touch: ``.grad`` of the model's parameters in the optimizer's step pre-hook, and its own state.
"""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fastdp import accounting, adaptive, deferred, distributed, loss_check, loss_trace
from fastdp.clip_stats import ClipCounter
from fastdp.clipped_sums import BackwardResult, nonfinite_step_error
from fastdp.deferred import DeferredCheck
from fastdp.noise import noise_dtype, noisy_means, secure_gaussian, secure_noisy_mean
from fastdp.plan import trainable_change
from fastdp.sampling_check import SampleRateMonitor

logger = logging.getLogger(__name__)

#: optimizers some engine is attached to
ATTACHED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


class PrivacyBudgetExceeded(RuntimeError):
    """The next step would take epsilon above the engine's ``target_epsilon`` (with ``enforce_budget=True``)."""


class Release:
    """The release stage of one engine (see the module docstring).

    Args:
        engine: the owning :class:`fastdp.PrivacyEngine` (read: its configuration, ``plan``, ``model``,
            ``optimizer``, ``_capture``).
        accountant: the accountant of this engine's steps.
        sigma: the noise multiplier of the next step.
        planned_steps: steps the calibration of sigma from ``target_epsilon`` covers (0 if none).
    """

    def __init__(self, engine: Any, accountant: Any, sigma: float, planned_steps: int) -> None:
        self.engine = engine
        self.accountant = accountant
        self.sigma = sigma
        self.planned_steps = planned_steps
        self.steps = 0  # invariant: steps == accountant.ledger.steps (sigma = 0 steps included)
        self.budget_verified = planned_steps  # steps known to stay within target_epsilon
        self.sampling = SampleRateMonitor(engine.batch_size, engine.sample_size)
        self.summed: dict[nn.Parameter, torch.Tensor] = {}
        self.step_samples = 0  # samples seen by the backward passes of the current logical step
        self.step_passes = 0  # backward passes of the current logical step
        #: (pass number in the step, (B,) bool mask) of the passes whose non-finite check was deferred to the step,
        #: and the other deferred checks of the step (fastdp.deferred): read once, before the release
        self.deferred_nonfinite: list[tuple[int, torch.Tensor]] = []
        self.deferred_checks: list[DeferredCheck] = []
        self.backward_seen = False  # a backward pass reached the hooks since the last step
        self.nonfinite_samples = 0  # samples given clipping factor 0 for non-finite gradients
        #: this step's counts of such samples still on the device (on_nonfinite="zero" on an accelerator; with a
        #: GradScaler, of overflowed samples): added to nonfinite_samples (overflow_samples) when the step is
        #: released, with one host read
        self.step_nonfinite: list[torch.Tensor] = []
        self.step_unclipped = 0  # samples with ||g_i|| <= R_t this step (adaptive clipping, fastdp.adaptive)
        self.empty_step = False  # an `engine.empty_step()` is running
        self.refusal: str | None = None  # a refusal decided before the step (several ranks: agreed in the step)
        self.bytes_reduced = 0  # bytes this rank put into all-reduces of clipped sums (several ranks)
        self._fp_cache: tuple[Any, int] | None = None  # (plan, fingerprint of its trainable set)
        self.scaler: Any = None  # fastdp.amp.ScalerLink while attached with a GradScaler
        self.overflow_samples = 0  # samples of this step whose scaled gradient was non-finite (GradScaler)
        self.released_early = False  # scaler.unscale_ released this step; optimizer.step() only applies it
        self.last_step_skipped = False  # the last accounted step was skipped for the loss scaler's overflow
        self.clip_counter = ClipCounter()  # samples clipped (norm > R_k): a non-private diagnostic

    @property
    def noiseless_steps(self) -> int:
        """Steps released with ``noise_multiplier=0``: recorded in the accountant's ledger (epsilon is inf)."""
        return self.accountant.ledger.noiseless_steps

    def record_release(self, event: Any, label: str) -> None:
        """Record another private release in the accountant's ledger (see ``PrivacyEngine.record_release``)."""
        eng = self.engine
        if eng.enforce_budget:
            eps = self.accountant.epsilon_after(event, eng.target_delta)
            if eps > eng.target_epsilon:
                raise PrivacyBudgetExceeded(
                    f"release {label!r} would take epsilon to {eps:.4g} > target_epsilon={eng.target_epsilon:g} "
                    f"(delta={eng.target_delta:g}, {self.accountant.name}); it was not recorded: do not release it.")
        self.accountant.record(event, label=label)

    # ------------------------------------------------------------------ accumulation
    @property
    def step_number(self) -> int:
        """The number the next released step will have (1-based)."""
        return self.steps + 1

    def add(self, result: BackwardResult) -> None:
        """Add one completed backward pass's clipped sums to this step's (called by the capture stage)."""
        self.backward_seen = True
        self.step_samples += result.batch_size
        self.step_passes += 1
        if result.nonfinite_mask is not None:
            self.deferred_nonfinite.append((self.step_passes, result.nonfinite_mask))
        self.deferred_checks.extend(result.deferred)
        self.step_unclipped += result.unclipped
        self.clip_counter.add(result.clipped, result.batch_size)
        if isinstance(result.nonfinite, torch.Tensor):  # not read on the host yet: counted at the release
            self.step_nonfinite.append(result.nonfinite)
        elif result.nonfinite and self.scaler is not None:  # overflow under the loss scale (fastdp.amp)
            self.overflow_samples += result.nonfinite
        elif result.nonfinite:
            self.nonfinite_samples += result.nonfinite
            logger.warning("step %d: %d sample(s) with non-finite gradients got clipping factor 0 (%d so far)",
                           self.step_number, result.nonfinite, self.nonfinite_samples)
        for p, s in result.sums.items():
            acc = self.summed.get(p)
            self.summed[p] = s if acc is None else acc + s

    def holds_gradients(self) -> bool:
        return bool(self.summed) or self.backward_seen

    def clear_step(self) -> None:
        """Forget the logical step in progress: its sums, counts and deferred verdicts (after a release, a refusal or
        a detach), the loss check's passes of the step included."""
        self.summed.clear()
        self.engine._capture.loss.pending.clear()
        self.engine._capture.trace.pending.clear()
        self.backward_seen = False
        self.step_samples = 0
        self.step_passes = 0
        self.deferred_nonfinite = []
        self.deferred_checks = []
        self.step_nonfinite = []
        self.overflow_samples = 0
        self.step_unclipped = 0

    def discard(self) -> None:
        """Drop the accumulated gradients of the step being refused (nothing is released)."""
        self.engine._capture.pending.clear()
        self.clear_step()
        self.clip_counter.discard()

    def grad_std(self) -> float:
        """The std of the gradient noise of the next step: ``sigma R``, or under adaptive clipping
        ``sigma_grad R_t`` (:mod:`fastdp.adaptive`: ``sigma`` is then the privacy of the step, count included)."""
        ad = self.engine._adaptive
        if ad is None:
            return self.sigma * self.engine.max_grad_norm
        return ad.grad_noise_multiplier(self.sigma) * ad.max_grad_norm

    def _adapt(self, noisy_centred_count: float) -> None:
        """Adaptive clipping: the released noisy count moves the threshold of the next step (fastdp.adaptive)."""
        eng = self.engine
        r = eng._adaptive.update(noisy_centred_count)
        eng._clip_cfg.thresholds = [r]  # all-layer only: one group
        logger.debug("step %d: adaptive clipping threshold -> %g", self.steps, r)

    def set_sigma(self, noise_multiplier: float) -> None:
        """``PrivacyEngine.set_noise_multiplier``: sigma from the next step on (checked; the budget look-ahead
        resumes, since the calibration covered the old sigma only)."""
        if self.holds_gradients():
            raise RuntimeError("set_noise_multiplier() with gradients accumulated for the next step; call it "
                               "after optimizer.step() and before the next backward pass")
        if not (isinstance(noise_multiplier, (int, float)) and not isinstance(noise_multiplier, bool)
                and math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier={noise_multiplier!r} must be a finite number >= 0")
        adaptive.refuse_set_sigma(self.engine._adaptive, float(noise_multiplier))
        if noise_multiplier == 0:
            warnings.warn("noise_multiplier=0.0: the next steps are clipped but not noised, so training is NOT "
                          "differentially private from now on (epsilon is infinite).", stacklevel=3)
        if float(noise_multiplier) != self.sigma:
            self.budget_verified = min(self.budget_verified, self.steps)  # the calibration covered the old sigma
        logger.info("noise_multiplier %g -> %g from step %d", self.sigma, noise_multiplier,
                    self.step_number)
        self.sigma = float(noise_multiplier)

    # ------------------------------------------------------------------ the step
    def pre_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The attached optimizer's step pre-hook: check, noise, account (see the module docstring). On several
        ranks the checks are agreed first (:meth:`_agree_step`) and the sums all-reduced (:meth:`_release_reduced`)."""
        eng = self.engine
        group = eng._group
        if self.scaler is not None and self._scaler_pre_step():
            return
        if group is None:
            self._local_checks(optimizer, args, kwargs)
            samples = self.step_samples
        else:
            samples = self._agree_step(group, optimizer, args, kwargs)
        self._check_budget()
        self._check_sample_rate(samples)
        self._count_nonfinite()
        eng._capture.pending.clear()  # forward calls that never got a backward pass
        noisy_count = 0.0  # adaptive clipping: sum_i (b_i - 1/2) + N(0, sigma_b^2) over every rank
        self.last_step_skipped = self.scaler is not None and self.scaler.overflowed(
            self.overflow_samples, self.sigma, eng.noise_generator, eng.secure_mode,
            next(iter(eng.plan.trainable.values())).device)
        if self.last_step_skipped:  # nothing released, the step accounted (fastdp.amp)
            self.summed.clear()
        elif group is None:
            sums = self.summed
            std = self.grad_std()
            params = list(eng.plan.trainable.values())
            if eng.secure_mode:
                grads = [secure_noisy_mean(p, sums.pop(p, None), std, eng.batch_size) for p in params]
            else:
                grads = noisy_means(params, sums, std, eng.batch_size, eng.noise_generator)
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            if eng._adaptive is not None:
                dev = next(iter(eng.plan.trainable.values())).device
                noisy_count = (float(self.step_unclipped) - samples / 2
                               + eng._adaptive.draw_count_noise(dev, eng.noise_generator, eng.secure_mode))
        else:
            noisy_count = self._release_reduced(group)
        trainable = {id(p) for p in eng.plan.trainable.values()}
        for group_ in optimizer.param_groups:
            for p in group_["params"]:
                if id(p) not in trainable:
                    p.grad = None  # frozen since attach (update_trainable): never updated
        self.summed.clear()
        self.steps += 1
        self.accountant.record_step(self.sigma, eng.sample_rate)  # sigma = 0 too: epsilon inf
        if eng._adaptive is not None:
            self._adapt(noisy_count)
        self.clip_counter.end_step()
        self.clear_step()

    def _scaler_pre_step(self) -> bool:
        """With a GradScaler (:mod:`fastdp.amp`): whether ``scaler.unscale_`` already released this step (then the
        optimizer only applies it); refuse an ``optimizer.step()`` that bypasses the scaler."""
        if self.released_early:
            self.released_early = False
            if self.holds_gradients():
                self.discard()
                raise RuntimeError("a backward pass ran between scaler.unscale_(optimizer) and the optimizer's step; "
                                   "its gradients were discarded (not released, not accounted). Run every backward "
                                   "pass of the step before scaler.unscale_ / scaler.step.")
            return True
        if not self.scaler.in_unscale and not self.empty_step:
            self.discard()
            raise RuntimeError("optimizer.step() was called directly on an optimizer attached with a GradScaler: the "
                               "gradients of this step are loss-scaled and the scaler's inf check would be skipped. "
                               "Call scaler.step(optimizer) then scaler.update(); nothing was released. (An "
                               "optimizer built with fused=True is stepped by the scaler without unscale_: build it "
                               "without fused=True.)")
        return False

    def _local_checks(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """This process's checks of the step (raise before anything is released)."""
        eng = self.engine
        loss_error = loss_check.settle(eng, eng._capture.loss)  # the loss check's verdicts on this step's passes
        trace_error = loss_trace.settle(eng, eng._capture.trace)  # the loss trace's (fastdp.loss_trace)
        loss_error = trace_error or loss_error
        if loss_error is not None:
            self.discard()
            raise loss_error
        if self.refusal is not None:
            self.discard()
            raise RuntimeError(self.refusal)
        self._check_deferred()
        # `args` starts with the optimizer itself (torch passes step's full positional arguments).
        # accelerate's AcceleratedOptimizer passes closure=None positionally: only a real closure is refused
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:
            raise RuntimeError("optimizer.step(closure) is not supported under a PrivacyEngine: call "
                               "loss.backward() yourself, then optimizer.step()")
        if not eng._capture.roots:
            eng._capture.recover()
        check_optimizer(eng, optimizer, allow_frozen=True)
        self._check_trainable_unchanged()
        if not self.backward_seen and not self.empty_step:
            raise RuntimeError(
                "optimizer.step() without a backward pass since the last step: nothing to release. Call "
                "loss.backward() first. For an empty batch (normal under Poisson sampling) run the forward and "
                "backward on it anyway (fastdp handles batch size 0), or call engine.empty_step().")
        if self.accountant.ledger.steps != self.steps:
            self.discard()
            raise RuntimeError(
                f"the accountant's ledger records {self.accountant.ledger.steps} training steps but the engine "
                f"released {self.steps}: its history was changed outside the engine. Nothing was "
                "released; resume from a checkpoint (load_state_dict) or start a new engine.")

    def _count_nonfinite(self) -> None:
        """Add this step's device-side counts of samples given factor 0 for non-finite gradients (one host read):
        to the overflowed samples of the step when a GradScaler is attached, else to ``nonfinite_samples``."""
        n = deferred.total_count(self.step_nonfinite)
        self.step_nonfinite = []
        if self.scaler is not None:
            self.overflow_samples += n
        elif n:
            self.nonfinite_samples += n
            logger.warning("step %d: %d sample(s) with non-finite gradients got clipping factor 0 (%d so far)",
                           self.step_number, n, self.nonfinite_samples)

    def _check_deferred(self) -> None:
        """The checks deferred from the backward passes of this step (on an accelerator, :mod:`fastdp.deferred`),
        read with one host synchronisation; a failure refuses the whole step (nothing released, sums discarded)."""
        masks, checks = self.deferred_nonfinite, self.deferred_checks
        self.deferred_nonfinite, self.deferred_checks = [], []
        error = deferred.step_failure(masks, checks, self.step_number, nonfinite_step_error)
        if error is not None:
            self.discard()
            raise error

    # ------------------------------------------------------------------ several ranks
    def _agree_step(self, group: distributed.Group, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> int:
        """Every rank's checks, agreed through one header exchange: if any rank refuses, or the ranks disagree on
        the step count, the noise multiplier or the trainable set, every rank discards its sums and raises (nothing
        is released or accounted anywhere). Returns the global number of samples of the step."""
        problem: Exception | None = None
        try:
            self._local_checks(optimizer, args, kwargs)
        except Exception as e:  # told to every rank before it is raised here
            problem = e
        mine = distributed.StepHeader(problem is not None, self.step_samples, self.backward_seen or self.empty_step,
                                      self.steps, self.sigma, self._trainable_fingerprint(),
                                      distributed.text_fingerprint(repr(self.accountant.ledger.to_list())))
        dev = next(iter(self.engine.plan.trainable.values())).device
        try:
            heads = group.exchange_headers(mine, dev)
        except distributed.CollectiveError:
            self.discard()
            raise
        refusing = [r for r, h in enumerate(heads) if h.refused]
        if refusing:
            msgs = group.gather_objects(None if problem is None else f"{type(problem).__name__}: {problem}",
                                        "exchange of the ranks' refusals")
            self.discard()
            why = "; ".join(f"rank {r}: {msgs[r]}" for r in refusing)
            if problem is not None:
                raise type(problem)(f"{problem} [rank {group.rank}; the step was refused on every rank, nothing "
                                    f"was released: {why}]") from problem
            raise RuntimeError(f"step {self.step_number} refused on every rank (nothing was released here): "
                               f"{why}")
        field_names = {"steps": "released steps (resume every rank from the same checkpoint)",
                       "sigma": "noise multiplier (call set_noise_multiplier on every rank)",
                       "trainable": "trainable set (call update_trainable on every rank after the same change)",
                       "ledger": "accountant's ledger (call record_release on every rank; resume every rank from "
                                 "the same checkpoint)"}
        for attr, what in field_names.items():
            vals = [getattr(h, attr) for h in heads]
            if any(v != vals[0] for v in vals):
                self.discard()
                if attr == "trainable":  # every rank sees the mismatch, so every rank joins this exchange
                    names = group.gather_objects(sorted(self.engine.plan.trainable), "exchange of trainable sets")
                    raise RuntimeError(
                        f"step {self.step_number} refused on every rank: the ranks disagree on the {what}: "
                        f"{distributed.describe_differences(names)}; nothing was released")
                raise RuntimeError(
                    f"step {self.step_number} refused on every rank: the ranks disagree on the {what}: "
                    + ", ".join(f"rank {r} {v!r}" for r, v in enumerate(vals)) + "; nothing was released")
        return sum(h.samples for h in heads)

    def _trainable_fingerprint(self) -> int:
        plan = self.engine.plan
        if self._fp_cache is None or self._fp_cache[0] is not plan:
            self._fp_cache = (plan, distributed.fingerprint(plan.trainable))
        return self._fp_cache[1]

    def _release_reduced(self, group: distributed.Group) -> float:
        """``p.grad = (sum over ranks of the clipped sums + sigma R xi) / B`` on every rank: rank 0 draws the noise
        into each all-reduce bucket at full scale (the secure mode's four-Gaussian sum there too), every rank adds
        its sums, the bucket is all-reduced, and each rank divides by ``B``. Ranks without a sum for a parameter
        (an empty shard, an unused branch) contribute zeros.

        Adaptive clipping (:mod:`fastdp.adaptive`): one more float64 element in the same all-reduce holds each
        rank's ``sum_i (b_i - 1/2)``, plus rank 0's count noise; returns the reduced noisy count (0 otherwise)."""
        eng = self.engine
        std = self.grad_std()
        draw = group.rank == 0 and std > 0
        sums = self.summed
        ad = eng._adaptive
        dev = next(iter(eng.plan.trainable.values())).device
        count = None if ad is None else torch.zeros(1, dtype=torch.float64, device=dev)
        if count is not None:
            noise = ad.draw_count_noise(dev, eng.noise_generator, eng.secure_mode) if group.rank == 0 else 0.0
            count_value = float(self.step_unclipped) - self.step_samples / 2 + noise

        def fill(flat: torch.Tensor, members: list[tuple[nn.Parameter, int]]) -> None:
            if not draw:
                flat.zero_()
            elif eng.secure_mode:
                flat.copy_(secure_gaussian(flat.shape, std, flat.device, flat.dtype))
            else:
                flat.normal_(0.0, std, generator=eng.noise_generator)
            for p, off in members:
                if p is count:
                    flat[off] = count_value
                    continue
                s = sums.get(p)
                if s is not None:
                    flat[off:off + p.numel()].add_(s.reshape(-1).to(flat.dtype))

        sharding = eng._sharding  # fully_shard: reduce-scattered in backward (fastdp.sharding), noised per rank
        params = [p for p in eng.plan.trainable.values() if sharding is None or not sharding.is_sharded(p)]
        if count is not None:
            params.append(count)  # type: ignore[arg-type]  (a float64 scalar: its own bucket, or the last element)
        try:
            reduced, sent = group.all_reduce_sum(params, noise_dtype, fill)
        except distributed.CollectiveError:
            self.discard()
            raise
        if sharding is not None:
            sharding.release(sums, std, eng.batch_size)
        sums.clear()
        noisy_count = 0.0
        if count is not None:
            params.pop()
            noisy_count = float(reduced.pop(count)[0])
        for p in params:
            p.grad = reduced.pop(p).div(eng.batch_size).to(p.dtype)
        self.bytes_reduced += sent
        return noisy_count

    def _check_sample_rate(self, samples: int) -> None:
        """Test this step's logical batch size (over every rank) against the declared rate
        (:mod:`fastdp.sampling_check`); a loader drawing more than declared is refused before anything is
        released."""
        verdict = self.sampling.observe(samples)
        for msg in verdict.warnings:
            warnings.warn(msg, stacklevel=5)
        if verdict.refuse is not None:
            self.discard()
            raise RuntimeError(f"step {self.step_number} refused: {verdict.refuse}")

    def _check_budget(self) -> None:
        eng = self.engine
        if not eng.enforce_budget:
            return
        nxt = self.step_number
        if self.sigma == 0 or self.noiseless_steps > 0:
            raise PrivacyBudgetExceeded(
                f"step {nxt} with noise_multiplier=0 (now or earlier) would take epsilon to inf > target_epsilon="
                f"{eng.target_epsilon:g}; nothing was released. Set a positive noise multiplier.")
        if nxt <= self.budget_verified and not self.accountant.ledger.releases:  # calibration covers steps only
            return
        eps = self.accountant.epsilon_after(accounting.PoissonSampledGaussian(self.sigma, eng.sample_rate),
                                            eng.target_delta)
        if eps > eng.target_epsilon:
            raise PrivacyBudgetExceeded(
                f"step {nxt} would take epsilon to {eps:.4g} > target_epsilon={eng.target_epsilon:g} "
                f"(delta={eng.target_delta:g}, {self.accountant.name}); nothing was released. Stop training, or "
                "build the engine with a larger budget.")
        self.budget_verified = nxt

    def _check_trainable_unchanged(self) -> None:
        msg = trainable_change(self.engine.model, self.engine.plan)
        if msg is not None:
            self.discard()  # this step's sums belong to a stale trainable set: dropped (nothing is released)
            raise RuntimeError(f"{msg}; nothing was released and this step's gradients were discarded. Call "
                               "engine.update_trainable() after freezing or unfreezing parameters, before the next "
                               "backward pass.")

    # ------------------------------------------------------------------ other optimizers
    def other_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Global optimizer step pre-hook (installed by ``attach``): refuse a step of an optimizer that no
        PrivacyEngine is attached to while this engine holds gradients from backward passes since its last step.

        The engine cannot tell which optimizer a backward pass was for. A pass taken for another optimizer (a GAN's
        generator loss through the private discriminator, a second optimizer on other parameters of the model)
        reaches the engine's hooks like a private one; folded into the next private step, it would release two
        batches under one accounted step. When another optimizer steps while the engine holds such gradients, at
        least one of those passes was most likely for it, so the engine discards them all (nothing is released or
        accounted) and raises: privacy first, and a warning would leave the private step silently short. Run the
        other loss's forward under ``engine.paused()``, or step the private optimizer before any other one.
        Optimizers attached to a PrivacyEngine are left to their own engine, and an optimizer that holds one of
        this engine's trainable parameters is taken for a wrapper of the attached one (HF ``accelerate``'s
        ``AcceleratedOptimizer`` steps itself, then the attached optimizer): it reads the ``.grad`` the engine
        writes, and before the private step that is ``None``.
        """
        eng = self.engine
        if optimizer is eng.optimizer or optimizer in ATTACHED:
            return
        trainable = {id(p) for p in eng.plan.trainable.values()}
        if any(id(p) in trainable for g in optimizer.param_groups for p in g["params"]):
            return
        fids = eng._capture.reached_forwards()
        if not (self.holds_gradients() or fids):
            return
        n_samples = self.step_samples
        self.clear_step()
        self.clip_counter.discard()
        eng._capture.drop_forwards(fids, f"another optimizer ({type(optimizer).__name__}) stepped")
        raise RuntimeError(
            f"{type(optimizer).__name__} (id {id(optimizer):#x}), an optimizer this PrivacyEngine is not attached "
            f"to, stepped while the engine held gradients of {n_samples} sample(s) from backward passes since its "
            f"last step for its own optimizer {type(eng.optimizer).__name__} (id {id(eng.optimizer):#x}). The "
            "engine cannot tell which optimizer a backward pass was for; folding another optimizer's pass into the "
            "private step would release two batches under one accounted step, so those gradients were discarded "
            "(nothing released or accounted). Run the forward of a loss that only trains other parameters under "
            "`with engine.paused():` (e.g. a GAN's generator loss through the private discriminator), and step "
            "the private optimizer before the other one. If this engine is stale (a model you no longer train), call "
            "its detach() (fastdp.engines_on(model) finds it).")


def check_optimizer(engine: Any, optimizer: torch.optim.Optimizer, *, allow_frozen: bool) -> None:
    """Every tensor the optimizer updates must be trainable (at :meth:`attach`), or, once training runs, a
    parameter of the model (frozen ones get ``.grad = None`` and are skipped by the optimizer)."""
    ours = {id(p) for p in (engine.model.parameters() if allow_frozen else engine.plan.trainable.values())}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in ours:
                raise ValueError(
                    f"the optimizer's param_groups[{gi}] holds a tensor of shape {tuple(p.shape)} that is not "
                    "a trainable parameter of the engine's model (frozen, or from another model); it would "
                    "be updated without clipping or noise. Build the optimizer from the trainable parameters "
                    "of this model only.")


def register_other_step_hook(release: Release) -> Any:
    """Install :meth:`Release.other_step` as a global optimizer step pre-hook that holds the release stage weakly
    (a global hook must not keep an engine and its model alive); it is removed by ``detach`` or with the engine."""
    ref = weakref.ref(release)

    def hook(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        rel = ref()
        if rel is not None:
            rel.other_step(optimizer, args, kwargs)

    handle = register_optimizer_step_pre_hook(hook)
    weakref.finalize(release, handle.remove).atexit = False
    return handle


__all__ = ["ATTACHED", "PrivacyBudgetExceeded", "Release", "check_optimizer", "register_other_step_hook"]
