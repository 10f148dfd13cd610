"""The :class:`PrivacyEngine`: exact per-sample clipping and Gaussian noise for any ``torch.optim`` optimizer.

A thin facade over the stages of the data flow, one module each (docs/architecture.md)::

    plan (fastdp.plan) -> capture (fastdp.capture, fastdp.capture_generic)
      -> per-sample norms (fastdp.norms) -> clipping factors (fastdp.clipping) -> clipped sums (fastdp.clipped_sums)
      -> [all-reduce over ranks: fastdp.distributed] -> noise (fastdp.noise) -> optimizer (fastdp.release)

1. **Forward.** A forward hook on every module of the plan keeps its input (only when a trainable parameter needs
   it: a bias-only layer keeps nothing) and registers a tensor hook on its output.
2. **Backward.** Each hooked module's trainable parameters stop requiring grad for the duration of its own
   forward call (*ghost differentiation*), so the graph has no edge to them: the user's ``loss.backward()``
   computes only the gradients that flow between layers, never the non-private weight gradients, and
   ``requires_grad`` reads as the user set it at all other times. The tensor hooks capture each layer's output
   gradient. When the backward pass is complete, :func:`fastdp.clipped_sums.clipped_sums` turns the records into
   ``sum_i C_i g_i`` per parameter and adds it to the step's accumulator (several backward passes before one
   step accumulate).
3. **Step.** A step pre-hook on the optimizer writes ``p.grad = (sum_i C_i g_i + sigma R xi) / batch_size`` for
   every trainable parameter, counts the step in the accountant, and lets the optimizer update.

(The ``PrivacyEngine`` class is about 360 lines, over the project's ~300, because about 150 of them are the public
API's docstrings; its logic is in the stage modules.) This module owns construction, ``attach``/``detach``, the
trainable set, and reporting; checkpoints are in
:mod:`fastdp.checkpoint`, argument checks in :mod:`fastdp.config`. All state lives in the engine's own tables
(plan, capture, release) keyed by module and parameter; :meth:`PrivacyEngine.detach` removes every hook and
restores ``requires_grad``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from fastdp import adaptive, amp, checkpoint, config, engine_registry, zero_grad
from fastdp import distributed as fdist
from fastdp.capture import Capture
from fastdp.clipped_sums import ClipConfig, NonFiniteGradientError
from fastdp.clipping import group_threshold, resolve_groups
from fastdp.config import default_delta
from fastdp.plan import Plan, build_plan
from fastdp.probe import StructureError
from fastdp.release import ATTACHED, PrivacyBudgetExceeded, Release, check_optimizer, register_other_step_hook
from fastdp.sharding import Sharding, is_fully_sharded

logger = logging.getLogger(__name__)

STATE_VERSION = checkpoint.STATE_VERSION
#: attributes that are read-only once the engine is built (the privacy configuration and its accounting)
_READ_ONLY = frozenset({
    "noise_multiplier", "max_grad_norm", "batch_size", "sample_size", "sample_rate", "target_delta",
    "target_epsilon", "enforce_budget", "clipping_fn", "clipping_style", "clipping_mode", "loss_reduction",
    "accountant", "secure_mode", "noise_generator", "on_nonfinite", "model", "steps", "noiseless_steps"})
#: the settings copied onto the engine as (read-only) attributes
_SETTINGS = ("batch_size", "sample_size", "sample_rate", "max_grad_norm", "clipping_fn", "clipping_mode",
             "clipping_style", "loss_reduction", "noise_generator", "secure_mode", "on_nonfinite", "enforce_budget",
             "target_epsilon", "target_delta")


class PrivacyEngine:
    """Differentially private training by adding one object to an ordinary PyTorch loop.

    Example::

        engine = PrivacyEngine(model, batch_size=256, sample_size=50_000, epochs=3, target_epsilon=3.0)
        engine.attach(optimizer)
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        engine.get_privacy_spent()

    The released gradient of every trainable parameter is ``(sum_{i in batch} C_i g_i + sigma R xi) / batch_size``
    with ``g_i`` the gradient of sample ``i``'s loss, ``C_i`` its clipping factor (``clipping_fn``,
    ``clipping_style``), ``R = max_grad_norm``, ``sigma = noise_multiplier`` and ``xi ~ N(0, I)`` drawn once per
    parameter per logical step.

    Args:
        model: the model; its parameters with ``requires_grad=True`` now are the trainable set. Every one must
            belong to a supported layer (``fastdp.layers.supported_types()``) or take the exact generic path
            (:mod:`fastdp.layers.generic`); what cannot be trained privately is refused, naming the parameter.
        batch_size: the expected logical batch size ``B``; the sample rate is ``q = B / sample_size``.
        sample_size: the number of examples in the private data set.
        epochs, steps: the planned training length, needed only to calibrate ``noise_multiplier`` from
            ``target_epsilon`` (give one of them; ``steps = ceil(epochs / q)``).
        noise_multiplier: ``sigma``; ``0.0`` is allowed (no privacy; a warning) to check clipping alone.
        target_epsilon: calibrate ``sigma`` so that epsilon after the planned steps is at most this.
        target_delta: delta; default :func:`default_delta` = ``1 / (2 sample_size)``.
        max_grad_norm: the clipping threshold ``R`` (total per-sample sensitivity).
        clipping_fn: ``"abadi"``, ``"automatic"`` or ``"global"`` (see :mod:`fastdp.clipping`), or ``"adaptive"``:
            ``"abadi"`` at a threshold ``R_t`` (starting at ``max_grad_norm``) that follows a quantile of the
            per-sample norms privately (Andrew et al. 2021; :mod:`fastdp.adaptive`, docs/guide/clipping.md).
            ``noise_multiplier`` is then the privacy of each step *with* the count's noise.
        adaptive_clipping: the settings of ``clipping_fn="adaptive"`` (:class:`fastdp.adaptive.AdaptiveClipping`:
            target quantile, learning rate, count noise); default ``AdaptiveClipping()``.
        clipping_style: ``"all-layer"``, ``"layer-wise"``, ``"param-wise"`` or a list of lists of parameter names.
        clipping_mode: ``"BK-MixOpt"`` (default), ``"BK-MixGhostClip"``, ``"BK-ghost"``, ``"ghost"`` or
            ``"instantiate"`` (:mod:`fastdp.modes`); all give the same gradient up to rounding.
        accountant: ``"prv"`` (default), ``"rdp"`` or ``"gdp"`` (an approximation).
        loss_reduction: ``"mean"`` if the loss averages the per-sample losses over the physical batch, ``"sum"``
            if it adds them.
        noise_generator: a ``torch.Generator`` on the parameters' device to draw the noise from (its state is
            saved by :meth:`state_dict`, so a resumed run continues the same noise stream; on CPU a large step's
            noise comes from child generators seeded from it, :func:`fastdp.noise.noisy_means`).
        secure_mode: draw the noise from generators seeded by the operating system's CSPRNG at every step, as the
            sum of four Gaussians divided by two (floating-point attack mitigation); see
            docs/guide/secure-mode.md. About 15-35x slower noise; no ``noise_generator``.
        enforce_budget: with ``target_epsilon``, a step that would take epsilon above it raises
            :class:`PrivacyBudgetExceeded` before anything is released.
        on_nonfinite: ``"raise"`` (default): a sample whose gradient has NaN/inf stops the step with an error
            (raised by the backward pass on the CPU, by ``optimizer.step()`` on an accelerator);
            ``"zero"``: such samples get clipping factor 0 (still private), counted in ``nonfinite_samples`` (on an
            accelerator when the step is released: the backward pass zeroes them without reading the flags).
        verify_structure: run the structure probe (:mod:`fastdp.probe`) once per new input signature of the model's
            forward: the engine's per-sample gradients of a few samples are compared with a batch-of-one
            computation, and a mismatch raises :class:`fastdp.probe.StructureError`. Turning it off gives up that
            check: a model whose batch axis is not first (per-position clipping), that mixes or reorders samples,
            or whose hooks rescale a layer's output then trains silently without the stated privacy guarantee.
            Its cost is in ``probe_stats``.
        verify_loss: read, on the first backward passes of each input signature, the weight the loss gives each
            label row of the model's logits (from their gradient, :mod:`fastdp.loss_check`), and refuse a token
            mean over the whole batch at ``optimizer.step()``, before anything is released
            (:class:`fastdp.probe.StructureError`). Only a softmax cross-entropy of a model output is read; verdicts
            are counted in ``probe_stats["loss_verdicts"]``. On the first two backward passes of each input
            signature it also *traces* the loss (:mod:`fastdp.loss_trace`: the model's outputs are returned as
            aliases whose torch operations are followed) and refuses a loss that couples samples (in-batch
            negatives, a softmax or log-sum-exp over the batch, weights or divisors computed from other samples'
            outputs); verdicts in ``probe_stats["loss_traces"]``. A loss the trace cannot verify (an operation it
            does not follow before the backward pass) is logged (a warning, the first time) and trained;
            ``"strict"`` traces every backward pass (not the first two) and refuses it too, the same way. ``False``
            turns both checks off.
        distributed: ``None`` (default): data-parallel over ``torch.distributed``'s default group when it is
            initialised (every rank builds the engine with the same arguments; ``batch_size`` and ``sample_size``
            are global; each rank runs forward and backward on its part of the batch; the clipped sums are
            all-reduced and the noise drawn once, by rank 0; see docs/guide/distributed.md and
            :mod:`fastdp.distributed`). ``False``: one independent engine per process. ``True``: refuse to run
            without an initialised process group.
        process_group: the ``torch.distributed`` group to train over (default: the default group).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        batch_size: int,
        sample_size: int,
        epochs: float | None = None,
        steps: int | None = None,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        max_grad_norm: float = 1.0,
        clipping_fn: str = "abadi",
        clipping_style: str | Sequence[Sequence[str]] = "all-layer",
        clipping_mode: str = "BK-MixOpt",
        accountant: str = "prv",
        loss_reduction: str = "mean",
        noise_generator: torch.Generator | None = None,
        secure_mode: bool = False,
        enforce_budget: bool = False,
        on_nonfinite: str = "raise",
        verify_structure: bool = True,
        verify_loss: bool | str = True,
        distributed: bool | None = None,
        process_group: Any = None,
        adaptive_clipping: adaptive.AdaptiveClipping | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        fdist.refuse_wrapped(model)
        self._group = fdist.Group.resolve(distributed, process_group)
        self._sharding: Sharding | None = None  # fully_shard (FSDP2) parameters (fastdp.sharding): set below
        s = config.check(batch_size=batch_size, sample_size=sample_size, epochs=epochs, steps=steps,
                         noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, target_delta=target_delta,
                         max_grad_norm=max_grad_norm, clipping_fn=clipping_fn, clipping_style=clipping_style,
                         clipping_mode=clipping_mode, accountant=accountant, loss_reduction=loss_reduction,
                         noise_generator=noise_generator, secure_mode=secure_mode, enforce_budget=enforce_budget,
                         on_nonfinite=on_nonfinite)
        for name in _SETTINGS:
            setattr(self, name, getattr(s, name))
        self._clip_fn = s.clip_fn
        ad = adaptive.resolve(clipping_fn, clipping_style, adaptive_clipping, s.batch_size, s.noise_multiplier)
        self._adaptive = None if ad is None else adaptive.AdaptiveState(ad, s.max_grad_norm, s.batch_size)
        self._mode = s.mode
        self._initial_sigma = s.noise_multiplier  # the constructed value (checked against checkpoints)
        self.model = model
        self.verify_structure = bool(verify_structure)
        if verify_loss not in (True, False, "strict"):
            raise ValueError(f"verify_loss={verify_loss!r}: expected True (refuse the losses found to couple samples, "
                             "log those that cannot be verified), \"strict\" (refuse those too) or False (no "
                             "check)")
        self.verify_loss: bool | str = "strict" if verify_loss == "strict" else bool(verify_loss)
        #: module name -> parameter paths it owns on the generic path (the probe's fallback for broadcast outputs)
        self._extra_owned: dict[str, tuple[str, ...]] = {}
        self.plan: Plan = build_plan(model, self._extra_owned)
        self._configure_groups()
        self._release = Release(self, s.accountant, s.noise_multiplier, s.planned_steps)
        if self._adaptive is not None:  # the report's clipped fraction: the mechanism's private noisy count
            ad = self._adaptive

            def _noisy_fraction() -> dict[str, Any] | None:
                f = ad.noisy_clipped_fraction()
                return None if f is None else {"fraction": f, "mechanism": "adaptive clipping's noisy count"}
            self._release.clip_counter.set_private_source(_noisy_fraction)
        self._capture = Capture(self, self._release)
        self._handles: list[Any] = []  # the optimizer's hooks (the model's are the capture stage's)
        self.optimizer: torch.optim.Optimizer | None = None
        others = engine_registry.conflicts(self._trainable.values())
        if others:  # refused here already (friendlier than at attach)
            raise RuntimeError(engine_registry.conflict_message(
                self._trainable.values(), {id(p): n for n, p in self._trainable.items()}, others))
        if self._group is not None:
            self._group.agree({**checkpoint.privacy_config(self), "verify_structure": self.verify_structure,
                               "verify_loss": self.verify_loss,
                               "on_nonfinite": self.on_nonfinite, "enforce_budget": self.enforce_budget,
                               "target_epsilon": self.target_epsilon,
                               "trainable": sorted((n, tuple(p.shape), str(p.dtype))
                                                   for n, p in self.plan.trainable.items())})
            n = self._group.broadcast_module(model)
            logger.info("data-parallel over %d ranks (rank %d, backend %s): rank 0's %d parameters and buffers "
                        "broadcast", self._group.world_size, self._group.rank, self._group.backend, n)
        if is_fully_sharded(model):
            if self._adaptive is not None:
                raise ValueError("clipping_fn='adaptive' is not supported on fully_shard (FSDP2) models yet (its "
                                 "count of unclipped samples is tested with data-parallel engines only); use "
                                 "clipping_fn='abadi' with a fixed max_grad_norm, or data-parallel training")
            self._sharding = Sharding(self)
        self._config_locked = True

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _READ_ONLY and self.__dict__.get("_config_locked", False):
            if name == "noise_multiplier":
                how = ("use engine.set_noise_multiplier(sigma): it takes effect at the next step and the "
                       "accountant records the change")
            elif name in ("steps", "noiseless_steps"):
                how = "the engine counts the steps it releases; resume from a checkpoint with load_state_dict()"
            else:
                how = ("build a new PrivacyEngine (after old_engine.detach()); it starts a new privacy budget, so "
                       "compose its epsilon with the old engine's yourself")
            raise AttributeError(f"PrivacyEngine.{name} is read-only after construction: changing it silently "
                                 f"would make the reported epsilon wrong. To change it, {how}.")
        object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ state of the stages, read-only views
    @property
    def world_size(self) -> int:
        """Processes the logical batch is spread over (1 without ``torch.distributed``)."""
        return 1 if self._group is None else self._group.world_size

    @property
    def rank(self) -> int:
        """This process's rank in the engine's group (0 without ``torch.distributed``)."""
        return 0 if self._group is None else self._group.rank

    @property
    def communication(self) -> dict[str, int]:
        """``{"all_reduce_bytes": B, "steps": n, "reduce_scatter_bytes": S}``: the bytes this rank put into the
        all-reduces of clipped sums over ``n`` released steps (the flat buffers' size; 0 on one process). The
        per-step figure equals the trainable parameters' size in the clipped sums' accumulation dtype: what
        non-private DDP all-reduces. ``S``: the same for the reduce-scatters of ``fully_shard`` parameters' sums
        (one per backward pass, FSDP2's padded size; :mod:`fastdp.sharding`)."""
        return {"all_reduce_bytes": self._release.bytes_reduced, "steps": self._release.steps,
                "reduce_scatter_bytes": 0 if self._sharding is None else self._sharding.bytes_scattered}

    @property
    def noise_multiplier(self) -> float:
        """sigma of the next step (:meth:`set_noise_multiplier` changes it)."""
        return self._release.sigma

    @property
    def steps(self) -> int:
        """Logical steps released so far."""
        return self._release.steps

    @property
    def noiseless_steps(self) -> int:
        """Steps released with ``noise_multiplier=0``, recorded in the accountant's ledger (epsilon is ``inf``)."""
        return self._release.noiseless_steps

    @property
    def accountant(self) -> Any:
        """The accountant of this engine's steps (:mod:`fastdp.accounting`)."""
        return self._release.accountant

    @property
    def nonfinite_samples(self) -> int:
        """Samples given clipping factor 0 for non-finite gradients (``on_nonfinite="zero"``), in the steps released
        so far (on an accelerator a step's count is read when it is released)."""
        return self._release.nonfinite_samples

    @property
    def generic_stats(self) -> dict[str, dict[str, int]]:
        """Owner label -> ``{"expanded": calls, "replayed": calls}`` of the generic path
        (docs/internals/generic-path.md)."""
        return self._capture.generic_stats

    @property
    def probe_stats(self) -> dict[str, Any]:
        """Structure probe cost: ``{"probes": runs, "signatures": verified, "seconds": time, "eval_retries"}``, and
        the loss check's ``"loss_checks"`` (outputs checked) and ``"loss_verdicts"`` (verdict -> count)."""
        return self._capture.probe.stats

    @property
    def adaptive_clipping(self) -> adaptive.AdaptiveState | None:
        """With ``clipping_fn="adaptive"``: the threshold now (``.max_grad_norm``, ``R_t``), per released step
        (``.thresholds``), the released noisy fractions of unclipped samples (``.noisy_unclipped_fractions``;
        ``.noisy_clipped_fraction()`` is the fraction clipped so far, a private estimate), the count's and the
        gradient's noise multipliers; ``None`` otherwise. Read-only: the engine updates it at each step."""
        return self._adaptive

    @property
    def clip_counter(self) -> Any:
        """Samples whose per-sample norm exceeded their group's threshold, per step and over the run
        (:class:`fastdp.clip_stats.ClipCounter`; a NON-PRIVATE diagnostic read by :meth:`privacy_report`; an
        adaptive-clipping mechanism registers its noisy count with ``clip_counter.set_private_source``)."""
        return self._release.clip_counter

    @property
    def clip_config(self) -> ClipConfig:
        """What the clipping stage needs besides the records: mode, function, thresholds, groups, reduction."""
        return self._clip_cfg

    @property
    def _trainable(self) -> dict[str, nn.Parameter]:
        return self.plan.trainable

    @property
    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """Name -> parameter, the engine's trainable set (a copy)."""
        return dict(self.plan.trainable)

    def _configure_groups(self) -> None:
        owner = {n: n.rpartition(".")[0] for n in self.plan.trainable}
        groups = resolve_groups(self.clipping_style, list(self.plan.trainable), owner)
        self._groups = groups
        group_of = {self.plan.trainable[n]: k for k, g in enumerate(groups) for n in g}
        r = self.max_grad_norm if self._adaptive is None else self._adaptive.max_grad_norm  # R_t (adaptive)
        self._clip_cfg = ClipConfig(mode=self._mode, clip_fn=self._clip_fn,
                                    thresholds=[group_threshold(r, len(groups))] * len(groups),
                                    group_of=group_of, mean_reduction=self.loss_reduction == "mean",
                                    on_nonfinite=self.on_nonfinite, count_unclipped=self._adaptive is not None)
        link = getattr(getattr(self, "_release", None), "scaler", None)
        if link is not None:  # a replan while attached with a GradScaler keeps the loss scale
            self._clip_cfg.loss_scale = link.loss_scale
            self._clip_cfg.on_nonfinite = "scaler"

    def _replan(self, *, reinstall: bool) -> None:
        """Build the plan again (trainable set or owners changed) and, if attached, reinstall the model hooks."""
        if reinstall:
            self._capture.remove(keep_guards=True)  # the labels= guards do not depend on the plan
        self.plan = build_plan(self.model, self._extra_owned)
        self._configure_groups()
        if reinstall:
            self._capture.install()

    def _rebuild_owners(self) -> None:
        """Re-discover owners and re-install the model hooks (the structure probe's fallback changed owners)."""
        self._replan(reinstall=True)

    # ------------------------------------------------------------------ attach / detach
    def attach(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None) -> None:
        """Start private training with ``optimizer``: install hooks, turn on ghost differentiation.

        Every parameter the optimizer updates must be one of the engine's trainable parameters. With ``scaler``
        (a ``torch.amp.GradScaler``) the loop is ``scaler.scale(loss).backward(); scaler.step(optimizer);
        scaler.update()``: clipping uses the unscaled gradients (threshold ``R`` whatever the scale), the step is
        released inside ``scaler.unscale_``, and an overflow skips the step as without DP, decided from a noisy
        count of overflowed samples; a skipped step is accounted (:mod:`fastdp.amp`, docs/guide/integrations.md).
        """
        if scaler is not None:
            amp.check_scaler(scaler)
            if self._group is not None or self._sharding is not None:
                raise ValueError("attach(scaler=...) is not supported on several processes (torch.distributed or "
                                 "fully_shard) yet: train in bfloat16 autocast without a GradScaler there")
            if self._adaptive is not None:
                raise ValueError("attach(scaler=...) with clipping_fn='adaptive' is not supported yet: a step the "
                                 "scaler skips releases no noisy count for the threshold update. Use a fixed "
                                 "max_grad_norm with the GradScaler, or adaptive clipping in bfloat16 autocast "
                                 "without a scaler")
        if self.optimizer is not None:
            raise RuntimeError("this PrivacyEngine is already attached to an optimizer; call detach() first")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"attach() needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if optimizer in ATTACHED:
            raise RuntimeError("this optimizer is already attached to another PrivacyEngine; detach() that engine "
                               "first (one engine per optimizer, or its gradients would be noised twice)")
        others = engine_registry.conflicts(self._trainable.values(), exclude=self)
        if others:
            raise RuntimeError(engine_registry.conflict_message(
                self._trainable.values(), {id(p): n for n, p in self._trainable.items()}, others))
        check_optimizer(self, optimizer, allow_frozen=False)
        self.optimizer = optimizer
        engine_registry.register(self)
        self._capture.install()
        self._handles.append(optimizer.register_step_pre_hook(self._release.pre_step))
        self._handles.append(register_other_step_hook(self._release))
        self._handles.extend(zero_grad.hooks(self, (optimizer, self.model)))
        ATTACHED.add(optimizer)
        if scaler is not None:
            self._release.scaler = amp.ScalerLink(self._release, scaler)
            self._clip_cfg.loss_scale = self._release.scaler.loss_scale
            self._clip_cfg.on_nonfinite = "scaler"
        logger.info("attached: %d trainable tensors in %d hooked modules, mode %s, sigma=%g",
                    len(self._trainable), len(self.plan.entries), self.clipping_mode, self.noise_multiplier)

    def update_trainable(self) -> None:
        """Re-read which parameters train (``requires_grad``) after freezing or unfreezing some between steps.

        Two-phase training (e.g. full fine-tuning, then DP-BiTFiT) keeps one engine, one optimizer and one
        accountant, so epsilon composes over both phases::

            for p in model.parameters(): p.requires_grad_(False)   # phase 2: biases only
            for n, p in model.named_parameters(): p.requires_grad_("bias" in n)
            engine.update_trainable()

        Parameters frozen now get ``.grad = None`` at every step (optimizers skip them); newly trainable ones are
        clipped and noised from the next step on. Call it between ``optimizer.step()`` and the next backward pass;
        a step taken after a change without this call raises.
        """
        if self._release.summed:
            raise RuntimeError("update_trainable() was called with gradients accumulated for the next step; call it "
                               "after optimizer.step() and before the next backward pass")
        self._capture.pending.clear()  # forward calls that never got a backward pass
        self._capture.restore_params()
        self._replan(reinstall=self.optimizer is not None)
        logger.info("trainable set updated: %d tensors in %d hooked modules", len(self.plan.trainable),
                    len(self.plan.entries))

    def detach(self) -> None:
        """Remove every hook and restore ``requires_grad``: model and optimizer are as before :meth:`attach`.

        Clipped sums accumulated since the last step (micro-batches of a step in progress) are discarded, with a
        warning: nothing of them is released or accounted, and a new ``attach`` starts a new step."""
        if self._release.summed or self._release.backward_seen:
            logger.warning("detach() discarded the clipped sums of %d backward pass(es) accumulated since the last "
                           "step: nothing of them is released or accounted; call optimizer.step() before detach() to "
                           "release them", self._release.step_passes)
        self._capture.remove()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._capture.clear()
        self._release.clear_step()
        if self._release.scaler is not None:
            self._release.scaler.remove()
            self._release.scaler = None
            self._release.released_early = False
            self._configure_groups()  # the clipping configuration without the loss scale
        self._release.clip_counter.discard()
        if self.optimizer is not None:
            ATTACHED.discard(self.optimizer)
        self.optimizer = None
        engine_registry.unregister(self)

    # ------------------------------------------------------------------ steps
    def empty_step(self) -> None:
        """Take a step for an empty logical batch without a forward pass: noise only, counted by the accountant.

        Under Poisson sampling a batch can be empty; running the model on a batch of size 0 does the same.
        """
        if self.optimizer is None:
            raise RuntimeError("empty_step() needs an attached optimizer")
        rel = self._release
        if rel.holds_gradients():
            msg = "empty_step() after a backward pass: the batch is not empty; call optimizer.step()"
            if self._group is None:
                raise RuntimeError(msg)
            rel.refusal = msg  # several ranks: refused through the step's agreement, so every rank raises at once
        rel.empty_step = True
        try:
            self.optimizer.step()
        finally:
            rel.empty_step = False
            rel.refusal = None

    def set_noise_multiplier(self, noise_multiplier: float) -> None:
        """Change ``sigma`` from the next step on; the accountant records each step with the sigma it used.

        ``0.0`` is allowed (a warning; epsilon becomes ``inf`` at the next step and stays so). With
        ``enforce_budget`` every further step is checked against ``target_epsilon`` (the calibration no longer
        covers them), and a ``sigma = 0`` step is refused.
        """
        self._release.set_sigma(noise_multiplier)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forward passes run inside ``with engine.paused():`` are not private training passes: the engine records
        nothing for them, and the trainable parameters get no gradient from them.

        For a loss that must backpropagate *through* the private model without training it, e.g. a GAN's
        generator loss through the private discriminator ``D``::

            with engine.paused():
                g_loss = -D(G(z)).mean()
            g_loss.backward()   # gradients reach G's parameters (for G's optimizer) through D's layers
            opt_g.step()

        Ghost differentiation still holds: during each hooked layer's forward call its trainable parameters do not
        require grad, so the graph has no edge to them and they get no ``.grad`` (no non-private gradient); the
        gradient flows through the layers to their inputs only. A parameter used outside its layer still raises
        (see :mod:`fastdp.capture`). What matters is where the *forward* runs; the backward may run outside. The
        pause covers the forward calls made inside the block (threads share it).
        """
        self._capture.paused += 1
        try:
            yield
        finally:
            self._capture.paused -= 1

    @contextlib.contextmanager
    def same_samples(self) -> Iterator[None]:
        """The model's forward calls inside ``with engine.same_samples():`` see the **same samples**, row ``i`` of
        every call being sample ``i``'s: two augmented views of each sample (contrastive learning), a siamese pair,
        R-Drop's two dropout passes, an output fed back to the model, a cell unrolled over time steps::

            with engine.same_samples():
                z1, z2 = model(view1(x)), model(view2(x))
            loss = per_sample_contrastive(z1, z2).mean()   # loss_i reads row i of both calls
            loss.backward()

        Sample ``i``'s gradient is then the sum over the calls of what row ``i`` contributed, clipped once. One
        backward pass that reaches two forward calls of the model made *outside* such a block is refused: the engine
        cannot tell two views of the same samples (one clipping unit per row) from two different sets of samples (a
        labelled and an unlabelled batch: one unit per row of each), and either guess would bound a sample's
        contribution by ``2R``, not ``R``. Different samples go in one call (``torch.cat`` along dimension 0) or in
        separate backward passes, each on its own call's loss (each adds its samples to the step, as micro-batches
        do). The calls must have the same batch size.
        """
        with self._capture.sample_sets.block(self._capture.next_forward):
            yield

    def record_release(self, event: Any, label: str = "release") -> None:
        """Record another private release on this engine's data (e.g. a noisy evaluation metric:
        ``accounting.Gaussian(sigma)``) in the accountant's ledger, so :meth:`get_privacy_spent` covers training and
        the release together. With ``enforce_budget``, a release that would take epsilon above ``target_epsilon`` is
        refused (:class:`PrivacyBudgetExceeded`, nothing recorded), and every later step is checked."""
        self._release.record_release(event, label)

    # ------------------------------------------------------------------ reporting
    def get_privacy_spent(self, delta: float | None = None) -> dict[str, Any]:
        """Privacy spent by the steps taken so far.

        Returns:
            ``{"epsilon": float, "delta": float, "accountant": str, "steps": int, "upper_bound": bool}``; epsilon
            is ``inf`` when steps were taken with ``noise_multiplier=0``; ``upper_bound`` is ``False`` for the GDP
            accountant's CLT approximation, which can underestimate epsilon.
        """
        delta = self.target_delta if delta is None else delta
        if self.noiseless_steps > 0:
            eps = math.inf
        else:
            eps = float(self.accountant.get_epsilon(delta))
        return {"epsilon": eps, "delta": delta, "accountant": self.accountant.name, "steps": self.steps,
                "upper_bound": self.accountant.name != "gdp"}

    def live_epsilon(self, delta: float | None = None) -> float:
        """A cheap running epsilon for progress bars and logs: the RDP upper bound of the steps so far
        (:mod:`fastdp.accounting.live`; tens of microseconds, independent of the step count). It is never below
        :meth:`get_privacy_spent`'s PRV value, and looser (most of all in the first steps); report that tight
        value at checkpoints and at the end. ``inf`` after a ``sigma = 0`` step."""
        from fastdp.accounting.live import live_epsilon
        return live_epsilon(self.accountant.ledger, self.target_delta if delta is None else delta)

    def privacy_report(self, delta: float | None = None) -> Any:
        """sigma, q, steps taken and planned, delta, epsilon under every accountant (GDP labelled an approximation),
        the clipping configuration and the fraction of samples clipped so far (a NON-PRIVATE diagnostic from the
        raw per-sample norms): a ``dict`` with a readable ``str`` (:class:`fastdp.report.PrivacyReport`). Costs
        one PRV computation (0.3-8 s) when steps were taken since the last."""
        from fastdp.report import privacy_report
        return privacy_report(self, delta)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume privately: step count, accountant history, noise generator state, and the
        privacy configuration (checked on load). Save it with the model's and optimizer's state dicts.

        ``config["noise_multiplier"]`` is the constructed sigma; ``noise_multiplier_now`` the current one
        (:meth:`set_noise_multiplier`). ``steps`` == the training steps of the accountant's ledger, of which
        ``noiseless_steps`` have sigma = 0."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`. The engine must be built with the same privacy configuration
        (noise multiplier, sample rate, clipping, accountant, delta); a mismatch raises ValueError naming it.

        Nothing in the checkpoint is trusted: ``steps`` and ``noiseless_steps`` must equal the training steps (and
        the sigma = 0 ones) of the accountant's ledger (so a checkpoint cannot report epsilon 0 after steps were
        taken), every training step must have this engine's sample rate, and the budget state of
        ``enforce_budget`` is recomputed from the ledger. Version-1 and -2 checkpoints (sigma = 0 steps kept out of
        the accountant, so they are added to the ledger on load; version 1 also before the sample-rate monitor,
        whose test restarts) load with the same checks. A failed load leaves the engine unchanged.
        """
        checkpoint.load_state_dict(self, state)

    def __repr__(self) -> str:
        return (f"PrivacyEngine(batch_size={self.batch_size}, sample_size={self.sample_size}, "
                f"noise_multiplier={self.noise_multiplier:.4g}, max_grad_norm={self.max_grad_norm:g}, "
                f"clipping_mode={self.clipping_mode!r}, clipping_fn={self.clipping_fn!r}, "
                f"accountant={self.accountant.name!r}, steps={self.steps})")


__all__ = ["NonFiniteGradientError", "PrivacyBudgetExceeded", "PrivacyEngine", "StructureError", "default_delta"]
