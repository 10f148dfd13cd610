"""The :class:`PrivacyEngine`: exact per-sample clipping and Gaussian noise for any ``torch.optim`` optimizer.

How one logical step works (see docs/engine.md):

1. **Forward.** A forward hook on every supported module with trainable parameters keeps its input (only when a
   trainable parameter needs it: a bias-only layer keeps nothing) and registers a tensor hook on its output.
2. **Backward.** Each hooked module's trainable parameters stop requiring grad for the duration of its own
   forward call (*ghost differentiation*), so the graph has no edge to them: the user's ``loss.backward()``
   computes only the gradients that flow between layers, never the non-private weight gradients, and
   ``requires_grad`` reads as the user set it at all other times. The tensor hooks capture each layer's output
   gradient. When the backward pass is complete, :func:`fastdp.bookkeeping.clipped_sums` turns the records into
   ``sum_i C_i g_i`` per parameter and adds it to the engine's accumulator (several backward passes before one
   step accumulate).
3. **Step.** A step pre-hook on the optimizer writes ``p.grad = (sum_i C_i g_i + sigma R xi) / batch_size`` for
   every trainable parameter, counts the step in the accountant, and lets the optimizer update.

All state lives in the engine's own tables keyed by module and parameter; :meth:`PrivacyEngine.detach` removes
every hook and restores ``requires_grad``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import warnings
import weakref
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from fastdp import accounting, engine_registry, hf_guard, probe, session
from fastdp.bookkeeping import (
    CLIPPING_MODES,
    ClipConfig,
    NonFiniteGradientError,
    Record,
    clipped_sums,
    instantiate_on_arrival,
)
from fastdp.clipping import get_clipping_fn, group_threshold, resolve_groups
from fastdp.layers import batchdim, checkpointing, expand, generic, kind_for, layout
from fastdp.layers import owners as ownership
from fastdp.layers.base import LayerKind, autocast_state
from fastdp.noise import noisy_mean, secure_noisy_mean
from fastdp.probe import StructureError
from fastdp.sampling_check import SampleRateMonitor

logger = logging.getLogger(__name__)

LOSS_REDUCTIONS = ("mean", "sum")
ON_NONFINITE = ("raise", "zero")
#: checkpoint format: 2 adds the sample-rate monitor, the noiseless step count and the current noise multiplier
STATE_VERSION = 2
#: attributes that are read-only once the engine is built (the privacy configuration and its accounting)
_READ_ONLY = frozenset({
    "noise_multiplier", "max_grad_norm", "batch_size", "sample_size", "sample_rate", "target_delta",
    "target_epsilon", "enforce_budget", "clipping_fn", "clipping_style", "clipping_mode", "loss_reduction",
    "accountant", "secure_mode", "noise_generator", "on_nonfinite", "model", "steps", "noiseless_steps"})

_ATTACHED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # optimizers some engine is attached to


class PrivacyBudgetExceeded(RuntimeError):
    """The next step would take epsilon above the engine's ``target_epsilon`` (with ``enforce_budget=True``)."""


def default_delta(sample_size: int) -> float:
    """The default target delta: ``1 / (2 * sample_size)``, below ``1 / sample_size`` as it must be."""
    return 1.0 / (2.0 * sample_size)


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


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
        clipping_fn: ``"abadi"``, ``"automatic"`` or ``"global"`` (see :mod:`fastdp.clipping`).
        clipping_style: ``"all-layer"``, ``"layer-wise"``, ``"param-wise"`` or a list of lists of parameter names.
        clipping_mode: ``"BK-MixOpt"`` (default), ``"BK-MixGhostClip"``, ``"BK-ghost"``, ``"ghost"`` or
            ``"instantiate"``; all give the same gradient up to rounding (see docs/engine.md).
        accountant: ``"prv"`` (default), ``"rdp"`` or ``"gdp"`` (an approximation).
        loss_reduction: ``"mean"`` if the loss averages the per-sample losses over the physical batch, ``"sum"``
            if it adds them.
        noise_generator: a ``torch.Generator`` on the parameters' device to draw the noise from (its state is
            saved by :meth:`state_dict`, so a resumed run continues the same noise stream).
        secure_mode: draw the noise from generators seeded by the operating system's CSPRNG at every step, as the
            sum of four Gaussians divided by two (floating-point attack mitigation); see docs/security.md. About
            15-35x slower noise; no ``noise_generator``.
        enforce_budget: with ``target_epsilon``, a step that would take epsilon above it raises
            :class:`PrivacyBudgetExceeded` before anything is released.
        on_nonfinite: ``"raise"`` (default): a sample whose gradient has NaN/inf stops the step with an error;
            ``"zero"``: such samples get clipping factor 0 (still private), counted in ``nonfinite_samples``.
        verify_structure: run the structure probe (:mod:`fastdp.probe`) once per new input signature of the model's
            forward: the engine's per-sample gradients of a few samples are compared with a batch-of-one
            computation, and a mismatch raises :class:`fastdp.probe.StructureError`. Turning it off gives up that
            check: a model whose batch axis is not first (per-position clipping), that mixes or reorders samples,
            or whose hooks rescale a layer's output then trains silently without the stated privacy guarantee.
            Its cost is in ``probe_stats``.
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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.batch_size = _check_positive_int("batch_size", batch_size)
        self.sample_size = _check_positive_int("sample_size", sample_size)
        if batch_size > sample_size:
            raise ValueError(f"batch_size={batch_size} is larger than sample_size={sample_size}; the sample rate "
                             "batch_size / sample_size must be in (0, 1]")
        self.sample_rate = batch_size / sample_size
        if not (isinstance(max_grad_norm, (int, float)) and math.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm={max_grad_norm!r} must be a finite number > 0")
        self.max_grad_norm = float(max_grad_norm)
        self._clip_fn = get_clipping_fn(clipping_fn)
        self.clipping_fn = clipping_fn
        if clipping_mode not in CLIPPING_MODES:
            raise ValueError(f"clipping_mode={clipping_mode!r} is not one of {list(CLIPPING_MODES)}")
        self.clipping_mode = clipping_mode
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction={loss_reduction!r} is not one of {list(LOSS_REDUCTIONS)}")
        self.loss_reduction = loss_reduction
        if noise_generator is not None and not isinstance(noise_generator, torch.Generator):
            raise ValueError(f"noise_generator must be a torch.Generator, got {type(noise_generator).__name__}")
        self.noise_generator = noise_generator
        self.secure_mode = bool(secure_mode)
        if self.secure_mode and noise_generator is not None:
            raise ValueError("secure_mode=True draws noise from the OS CSPRNG; do not pass a noise_generator")
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite={on_nonfinite!r} is not one of {list(ON_NONFINITE)}")
        self.on_nonfinite = on_nonfinite
        if enforce_budget and target_epsilon is None:
            raise ValueError("enforce_budget=True needs target_epsilon (the budget to enforce)")
        self.enforce_budget = bool(enforce_budget)
        self.target_epsilon = None if target_epsilon is None else float(target_epsilon)
        self.accountant = accounting.make_accountant(accountant)
        self.target_delta = default_delta(sample_size) if target_delta is None else float(target_delta)
        if not 0.0 < self.target_delta < 1.0:
            raise ValueError(f"target_delta={target_delta!r} must be in (0, 1)")
        if self.target_delta >= 1.0 / sample_size:
            warnings.warn(f"target_delta={self.target_delta:g} is not below 1/sample_size={1 / sample_size:g}; "
                          "such a delta allows releasing a whole record. Use a smaller delta.", stacklevel=2)
        self._planned_steps: int | None = None  # steps the calibration guarantees within target_epsilon
        self.noise_multiplier = self._resolve_sigma(noise_multiplier, target_epsilon, epochs, steps)
        self.model = model
        self.clipping_style = clipping_style
        self._discover(model)
        self._configure_groups()
        # Mutable state (all of it engine-owned):
        self.steps = 0
        self._summed: dict[nn.Parameter, torch.Tensor] = {}
        self._pending: list[Record] = []
        self._callback_queued = False
        self._passes = 0  # backward passes that reached the hooks (the current one's number identifies it)
        self._in_bookkeeping = False
        self._handles: list[Any] = []
        self._anchors: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        # parameters detached by the forward calls in progress, one list per call (calls nest like a stack)
        self._detached_now: list[list[nn.Parameter]] = []
        self._forward_batch: list[int | None] = []  # batch size of the model's forward calls in progress
        # (forward id, exception being handled at the call's start) of the model's forward calls in progress
        self._forward_ids: list[tuple[int, BaseException | None]] = []
        self._next_forward = 0
        self._dead_forwards: set[int] = set()  # forward calls whose records were discarded after a failure
        self._paused = 0  # depth of `with engine.paused()`
        self._grad_at_root: list[bool] = []  # whether autograd was on at the start of those calls
        self._rng_stack: list[Any] = []  # RNG states at the start of the generic owners' calls in progress
        # verified expansions of the generic owners' calls in progress (None: the call is replayed)
        self._expand_stack: list[expand.ExpandedCall | None] = []
        self._expand_off: set[int] = set()  # owners whose expansion failed verification once: always replayed
        #: owner label -> {"expanded": calls, "replayed": calls} of the generic path (inspectable; see docs/engine.md)
        self.generic_stats: dict[str, dict[str, int]] = {}
        self._on_arrival = True  # instantiation on arrival (bookkeeping.instantiate_on_arrival); off: benchmarks
        self._step_samples = 0  # samples seen by the backward passes of the current logical step
        self._backward_seen = False  # a backward pass reached the hooks since the last step
        self._budget_verified = self._planned_steps or 0  # steps known to stay within target_epsilon
        self.nonfinite_samples = 0  # samples given clipping factor 0 for non-finite gradients
        self.verify_structure = bool(verify_structure)
        self._probing = False  # the structure probe's passes are running (fastdp.probe)
        self._probe_reference = False  # its plain / batch-of-one passes: engine hooks inert
        self._probe_seen: set[Any] = set()  # input signatures verified
        self._probe_buffers: list[Any] = []  # the model's buffers at the probe's start (restored before each pass)
        self._probe_broadcast: list[nn.Module] = []  # modules whose broadcast output the probe's pass expanded
        self._probe_outside: list[nn.Module] = []  # modules whose parameters the probe's pass saw used outside them
        #: module name -> parameter paths it owns on the generic path (the probe's fallback for broadcast outputs)
        self._extra_owned: dict[str, tuple[str, ...]] = {}
        #: the generic owners' input/output layouts learned by the structure probe (fastdp.layers.layout)
        self._owner_layouts = layout.OwnerLayouts()
        #: structure probe cost: {"probes": runs, "signatures": verified signatures, "seconds": time, "eval_retries"}
        self.probe_stats: dict[str, Any] = {"probes": 0, "signatures": 0, "seconds": 0.0, "eval_retries": 0}
        self.optimizer: torch.optim.Optimizer | None = None
        # steps released with noise_multiplier=0: not in the accountant (epsilon is infinite once there is one);
        # invariant: steps == accountant.steps + noiseless_steps
        self.noiseless_steps = 0
        self._initial_sigma = self.noise_multiplier  # the constructed value (checked against checkpoints)
        self._sampling = SampleRateMonitor(self.batch_size, self.sample_size)
        others = engine_registry.conflicts(self._trainable.values())
        if others:  # refused here already (friendlier than at attach)
            raise RuntimeError(engine_registry.conflict_message(
                self._trainable.values(), {id(p): n for n, p in self._trainable.items()}, others))
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

    def _configure_groups(self) -> None:
        owner = {n: n.rpartition(".")[0] for n in self._trainable}
        groups = resolve_groups(self.clipping_style, list(self._trainable), owner)
        self._groups = groups
        group_of = {self._trainable[n]: k for k, g in enumerate(groups) for n in g}
        self._clip_cfg = ClipConfig(mode=self.clipping_mode, clip_fn=self._clip_fn,
                                    thresholds=[group_threshold(self.max_grad_norm, len(groups))] * len(groups),
                                    group_of=group_of, mean_reduction=self.loss_reduction == "mean",
                                    on_nonfinite=self.on_nonfinite)

    # ------------------------------------------------------------------ construction helpers
    def _resolve_sigma(self, noise_multiplier: float | None, target_epsilon: float | None,
                       epochs: float | None, steps: int | None) -> float:
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError("give exactly one of noise_multiplier and target_epsilon "
                             f"(got noise_multiplier={noise_multiplier!r}, target_epsilon={target_epsilon!r})")
        if noise_multiplier is not None:
            if not (isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier)
                    and noise_multiplier >= 0):
                raise ValueError(f"noise_multiplier={noise_multiplier!r} must be a finite number >= 0")
            if noise_multiplier == 0:
                warnings.warn("noise_multiplier=0.0: gradients are clipped but not noised, so training is NOT "
                              "differentially private (epsilon is infinite). Use this only to test clipping.",
                              stacklevel=3)
            return float(noise_multiplier)
        if (epochs is None) == (steps is None):
            raise ValueError("target_epsilon needs exactly one of epochs and steps to calibrate the noise "
                             f"(got epochs={epochs!r}, steps={steps!r})")
        sigma = accounting.get_noise_multiplier(target_epsilon, self.target_delta, self.sample_rate,
                                                steps=steps, epochs=epochs, accountant=self.accountant.name)
        self._planned_steps = steps if steps is not None else accounting.steps_from_epochs(epochs, self.sample_rate)
        logger.info("calibrated noise_multiplier=%.4f for epsilon=%g, delta=%g, q=%g (%s)", sigma, target_epsilon,
                    self.target_delta, self.sample_rate, self.accountant.name)
        return float(sigma)

    def _discover(self, model: nn.Module) -> None:
        """Build the tables: trainable parameters, the modules that own them, and how each is clipped.

        A module whose trainable parameters a layer kind covers is hooked with that kind; any other module with
        trainable parameters (raw ``nn.Parameter`` s, unsupported layers, custom modules) is an *owner* on the exact
        generic path (:mod:`fastdp.layers.generic`). Raises ValueError naming a parameter that cannot be trained
        privately (BatchNorm in train mode, Embedding with max_norm, ...).
        """
        self._trainable: dict[str, nn.Parameter] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                self._trainable[name] = p
        if not self._trainable:
            raise ValueError("the model has no parameter with requires_grad=True: nothing to train")
        trainable_ids = {id(p) for p in self._trainable.values()}
        name_of = {id(p): n for n, p in self._trainable.items()}
        # (module name, module, kind, trainable parameter paths relative to the module)
        self._hooked: list[tuple[str, nn.Module, LayerKind, frozenset[str]]] = []
        self._param_of: dict[tuple[int, str], nn.Parameter] = {}
        self._tied_modules: set[int] = set()
        covered: set[int] = set()
        in_subtree: set[int] = set()  # parameters owned by an ancestor's generic entry
        for mname, module in model.named_modules():
            label = mname or "<root>"
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
                owned = [name_of[id(p)] for p in module.parameters(recurse=False) if id(p) in trainable_ids]
                raise ValueError(
                    f"module {label!r} ({type(module).__name__}"
                    f"{', trainable parameters ' + ', '.join(map(repr, owned)) if owned else ''}) "
                    "is in train mode: batch normalisation mixes the "
                    "samples of a batch, so per-sample gradients (and the privacy guarantee) do not exist. "
                    "Replace it with GroupNorm (fastdp.validate.fix), or call .eval() on it and freeze its "
                    "parameters.")
            entries: list[tuple[LayerKind, list[tuple[str, nn.Parameter]]]] = []
            sub = generic.subtree_owner(module)
            extra = getattr(self, "_extra_owned", {}).get(mname, ())  # the structure probe's fallback owners
            if extra:
                sub = (*(sub or ()), *extra)
            if sub:
                owned_sub = [(rel, module.get_parameter(rel)) for rel in sub]
                owned_sub = [(rel, p) for rel, p in owned_sub if id(p) in trainable_ids and id(p) not in in_subtree]
                if owned_sub:
                    entries.append((generic.GENERIC, owned_sub))
                    in_subtree.update(id(p) for _, p in owned_sub)
            direct = [(a, p) for a, p in module.named_parameters(recurse=False)
                      if id(p) in trainable_ids and id(p) not in in_subtree]
            # never-called containers, parametrizations, parameters also held by a descendant (layers/owners.py)
            extra = [(a, p) for a, p in ownership.extra_owned(module) if id(p) in trainable_ids
                     and id(p) not in in_subtree and all(p is not q for _, q in direct)]
            whole = bool(extra) or ownership.shared_with_descendants(module, direct)
            direct += extra
            if whole:
                in_subtree.update(id(p) for _, p in direct)
            if direct:
                kind = None if whole else kind_for(module)
                if kind is not None and all(a in ("weight", "bias") for a, _ in direct):
                    reason = kind.unsupported_reason(module)
                    if reason is not None:
                        raise ValueError(f"module {label!r} ({type(module).__name__}) with trainable parameters "
                                         f"{[name_of[id(p)] for _, p in direct]} cannot be trained privately: "
                                         f"{reason}")
                    entries.append((kind, direct))
                else:
                    entries.append((generic.GENERIC, direct))
            for kind, plist in entries:
                if kind is generic.GENERIC:
                    reason = generic.unsupported_reason(module)
                    if reason is not None:
                        raise ValueError(f"module {label!r} ({type(module).__name__}) with trainable parameters "
                                         f"{[name_of[id(p)] for _, p in plist]} cannot be trained privately: "
                                         f"{reason}")
                    logger.info("module %r (%s): parameters %s on the generic per-sample path", label,
                                type(module).__name__, [n for n, _ in plist])
                for rel, p in plist:
                    self._param_of[(id(module), rel)] = p
                    covered.add(id(p))
                self._hooked.append((mname, module, kind, frozenset(rel for rel, _ in plist)))
        # modules holding a parameter that another module holds too (tied weights): their calls keep the kept
        # tensors for the shared norm's ghost cross terms instead of instantiating on arrival
        owners: dict[int, set[int]] = {}
        for (mid, _), p in self._param_of.items():
            owners.setdefault(id(p), set()).add(mid)
        self._tied_modules = {mid for mids in owners.values() if len(mids) > 1 for mid in mids}
        missing = [n for n, p in self._trainable.items() if id(p) not in covered]
        if missing:  # pragma: no cover - every parameter is owned by some module
            raise ValueError(f"trainable parameters {missing} are not owned by any module")

    # ------------------------------------------------------------------ attach / detach
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Start private training with ``optimizer``: install hooks, turn on ghost differentiation.

        Every parameter the optimizer updates must be one of the engine's trainable parameters.
        """
        if self.optimizer is not None:
            raise RuntimeError("this PrivacyEngine is already attached to an optimizer; call detach() first")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"attach() needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if optimizer in _ATTACHED:
            raise RuntimeError("this optimizer is already attached to another PrivacyEngine; detach() that engine "
                               "first (one engine per optimizer, or its gradients would be noised twice)")
        others = engine_registry.conflicts(self._trainable.values(), exclude=self)
        if others:
            raise RuntimeError(engine_registry.conflict_message(
                self._trainable.values(), {id(p): n for n, p in self._trainable.items()}, others))
        self._check_optimizer(optimizer, allow_frozen=False)
        self.optimizer = optimizer
        engine_registry.register(self)
        self._install_hooks()
        self._handles.append(optimizer.register_step_pre_hook(self._pre_step))
        self._handles.append(_register_other_step_hook(self))
        _ATTACHED.add(optimizer)
        logger.info("attached: %d trainable tensors in %d hooked modules, mode %s, sigma=%g",
                    len(self._trainable), len(self._hooked), self.clipping_mode, self.noise_multiplier)

    def _install_hooks(self) -> None:
        """Model hooks (everything but the optimizer's): batch size, ghost differentiation, capture, guards."""
        hooks = self._model_handles = []
        root = self.model
        capture_all = self.clipping_mode == "ghost"
        self._root_hook_fns: list[Any] = []  # the root's own pre-hooks (the probe's fallback runs them once)
        for mname, module, kind, names in self._hooked:
            params = [self._param_of[(id(module), n)] for n in sorted(names)]
            # prepended: they run before the module's own pre-hooks (legacy weight_norm and prune compute the
            # weight from the trainable originals there), detach first, then the generic owner's pre-hook
            pre = [partial(self._detach_params, params=params)]
            if kind is generic.GENERIC:
                exp = {n: self._param_of[(id(module), n)] for n in sorted(names)}
                if not all("." not in n and expand.expandable(p) for n, p in exp.items()):
                    exp = None
                pre.append(partial(self._generic_pre, expand=exp))
                hooks.append(module.register_forward_pre_hook(pre[1], with_kwargs=True, prepend=True))
                hook = partial(self._generic_hook, names=names, label=mname or "<root>")
            else:
                needs_act = capture_all or kind.needs_activation(module, names)
                hook = partial(self._forward_hook, kind=kind, names=names, needs_act=needs_act)
            hooks.append(module.register_forward_pre_hook(pre[0], prepend=True))
            if module is root:
                self._root_hook_fns.extend((fn, k == 1) for k, fn in enumerate(pre))
            hooks.append(module.register_forward_hook(hook, with_kwargs=True, always_call=True))
        # prepended after the modules' pre-hooks, so it runs first of all: the call's batch size and forward id
        hooks.append(root.register_forward_pre_hook(self._root_pre, with_kwargs=True, prepend=True))
        for name, p in self._trainable.items():
            # Fires only if autograd computes a gradient for p, i.e. p was used outside its module's forward.
            hooks.append(p.register_hook(partial(self._outside_use, name)))
        for mname, module in root.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                hooks.append(module.register_forward_pre_hook(partial(self._batchnorm_guard, mname)))
        # Hugging Face models called with labels=: their internal loss mixes samples (fastdp.hf_guard)
        hooks.extend(hf_guard.install(root, self.loss_reduction))
        # registered last, so it runs after every other forward hook of the root
        hooks.append(root.register_forward_hook(self._root_post, always_call=True))
        self._handles.extend(hooks)

    def _remove_model_hooks(self) -> None:
        for h in getattr(self, "_model_handles", []):
            h.remove()
            if h in self._handles:
                self._handles.remove(h)
        self._model_handles = []

    def _rebuild_owners(self) -> None:
        """Re-discover owners and re-install the model hooks (the structure probe's fallback changed owners)."""
        self._remove_model_hooks()
        self._discover(self.model)
        self._configure_groups()
        self._install_hooks()

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
        if self._summed:
            raise RuntimeError("update_trainable() was called with gradients accumulated for the next step; call it "
                               "after optimizer.step() and before the next backward pass")
        self._pending.clear()  # forward calls that never got a backward pass
        self._restore_params()
        attached = self.optimizer is not None
        if attached:
            self._remove_model_hooks()
        self._discover(self.model)
        self._configure_groups()
        if attached:
            self._install_hooks()
        logger.info("trainable set updated: %d tensors in %d hooked modules", len(self._trainable),
                    len(self._hooked))

    def detach(self) -> None:
        """Remove every hook and restore ``requires_grad``: model and optimizer are as before :meth:`attach`."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._restore_params()
        self._pending.clear()
        self._summed.clear()
        self._anchors.clear()
        self._callback_queued = False
        self._rng_stack.clear()
        self._grad_at_root.clear()
        self._forward_batch.clear()
        self._forward_ids.clear()
        self._backward_seen = False
        self._step_samples = 0
        if self.optimizer is not None:
            _ATTACHED.discard(self.optimizer)
        self.optimizer = None
        engine_registry.unregister(self)

    def _check_optimizer(self, optimizer: torch.optim.Optimizer, *, allow_frozen: bool) -> None:
        """Every tensor the optimizer updates must be trainable (at :meth:`attach`), or, once training runs, a
        parameter of the model (frozen ones get ``.grad = None`` and are skipped by the optimizer)."""
        ours = {id(p) for p in (self.model.parameters() if allow_frozen else self._trainable.values())}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in ours:
                    raise ValueError(
                        f"the optimizer's param_groups[{gi}] holds a tensor of shape {tuple(p.shape)} that is not "
                        "a trainable parameter of the engine's model (frozen, or from another model); it would "
                        "be updated without clipping or noise. Build the optimizer from the trainable parameters "
                        "of this model only.")

    # ------------------------------------------------------------------ hooks
    @staticmethod
    def _batchnorm_guard(mname: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        if module.training and torch.is_grad_enabled():
            raise RuntimeError(f"module {mname!r} ({type(module).__name__}) runs in train mode under a "
                               "PrivacyEngine: batch statistics mix samples. Call .eval() on it.")

    def _anchor(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, like.device)
        if key not in self._anchors:
            self._anchors[key] = torch.zeros((), dtype=like.dtype, device=like.device, requires_grad=True)
        return self._anchors[key]

    def _detach_params(self, module: nn.Module, args: tuple[Any, ...], *, params: list[nn.Parameter]) -> None:
        """Ghost differentiation: during this module's forward its trainable parameters do not require grad,
        so the graph has no edge to them and autograd never computes their (non-private) gradients."""
        detached: list[nn.Parameter] = []
        self._detached_now.append(detached)  # always pushed: the forward hook always pops
        if self._in_bookkeeping:
            return
        if (not torch.is_grad_enabled() and self._grad_at_root and self._grad_at_root[-1]
                and checkpointing.in_reentrant_checkpoint()):
            label = next((n or "<root>" for n, m, _, _ in self._hooked if m is module), "?")
            names = [n for n, p in self._trainable.items() if any(p is q for q in params)]
            raise RuntimeError(checkpointing.reentrant_message(label, type(module).__name__, names))
        for p in params:
            if p.requires_grad:
                p.requires_grad_(False)
                detached.append(p)

    def _end_call(self) -> None:
        """End of a hooked module's forward call: restore what its pre-hook detached (not its ancestors')."""
        if self._detached_now:
            for p in self._detached_now.pop():
                p.requires_grad_(True)

    def _restore_params(self) -> None:
        while self._detached_now:
            self._end_call()
        while self._expand_stack:
            call = self._expand_stack.pop()
            if call is not None:
                call.end(None)

    def _outside_use(self, name: str, grad: torch.Tensor) -> None:
        if self._probe_reference:  # the structure probe's reference passes differentiate the parameters
            return
        if self._probing:  # the probe's engine pass: a suspect for its fallback (fastdp.probe); it restores .grad
            self._probe_outside.append(self.model.get_submodule(name.rpartition(".")[0]))
            return
        raise RuntimeError(
            f"trainable parameter {name!r} received a gradient from outside the forward of the layer that owns it "
            "(e.g. a weight read directly by another module, as in weight tying through F.linear). fastdp cannot "
            "clip that use per sample. Tie weights through modules (assign the same nn.Parameter to both), or "
            "freeze the parameter.")

    def _root_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The batch size of this forward call of the model: the leading size its tensor inputs agree on
        (:func:`fastdp.layers.batchdim.infer_batch_size`). An outermost call first discards what a failed forward
        or backward pass left behind; a new input signature is verified by the structure probe
        (:mod:`fastdp.probe`) before the call runs."""
        if not self._forward_ids:
            self._recover()
        self._grad_at_root.append(torch.is_grad_enabled())
        self._forward_ids.append((self._next_forward, sys.exc_info()[1]))
        self._next_forward += 1
        try:
            B = batchdim.infer_batch_size(args, kwargs)
        except batchdim.AmbiguousBatchError:
            self._forward_batch.append(None)  # popped by _root_post, which runs also when this pre-hook raises
            raise
        if len(self._forward_ids) == 1:
            self._owner_layouts.start()  # the size rule, unless the probe knows this call's signature
        if (self.verify_structure and B is not None and B >= 1 and not self._probing and not self._in_bookkeeping
                and torch.is_grad_enabled() and len(self._forward_ids) == 1 and not self._paused):
            try:
                probe.maybe_probe(self, module, args, kwargs, B)
            except BaseException:
                self._forward_batch.append(B)  # popped by _root_post
                raise
        self._forward_batch.append(B)

    def _root_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """End of a forward call of the model (also when it raised: the hook is ``always_call``)."""
        if self._forward_batch:
            self._forward_batch.pop()
        if self._grad_at_root:
            self._grad_at_root.pop()
        if not self._forward_ids:
            return
        fid, handled = self._forward_ids.pop()
        if sys.exc_info()[1] is not handled:  # called from Module.__call__'s `except`: the forward raised
            self._drop_forwards({fid}, f"the model's forward call raised {type(sys.exc_info()[1]).__name__}")
            if not self._forward_ids:
                self._reset_call_stacks()

    def _current_forward(self) -> int:
        """The id of the model's forward call in progress (a fresh one for a submodule called on its own)."""
        if self._forward_ids:
            return self._forward_ids[-1][0]
        self._next_forward += 1
        return self._next_forward - 1

    def _batch(self) -> int | None:
        return self._forward_batch[-1] if self._forward_batch else None

    def _hook_output(self, out: torch.Tensor, rec: Record, k: int) -> torch.Tensor:
        if not out.requires_grad:
            # Nothing upstream requires grad (first layer; weights are detached by ghost differentiation):
            # add a zero that does, so the backward pass reaches this output.
            out = out + self._anchor(out)
        out.register_hook(partial(self._on_output_grad, rec, k))
        return out

    def _forward_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, *,
                      kind: LayerKind, names: frozenset[str], needs_act: bool) -> Any:
        self._end_call()  # always called, also when forward raised
        if (self._in_bookkeeping or self._paused or not torch.is_grad_enabled()
                or not isinstance(output, torch.Tensor)):
            return None
        B = self._batch()
        out = output
        broadcast = B is not None and generic.is_broadcast(out, B)
        if broadcast:
            if self._probing:
                self._probe_broadcast.append(module)
            # One output for the whole batch (input with batch dimension 1, e.g. HF position ids (1, T)): expand
            # it, so the gradient arrives per sample instead of summed over the batch.
            out = out.expand(B, *out.shape[1:])
        activation = None
        if needs_act:
            inputs = args if args else tuple(kwargs.values())
            activation = kind.capture(module, inputs)
            if broadcast and activation.dim() >= 1 and activation.shape[0] == 1:
                activation = activation.expand(B, *activation.shape[1:])
        rec = Record(module=module, kind=kind, names=names, activation=activation, autocast=autocast_state(),
                     forward=self._current_forward())
        out = self._hook_output(out, rec, 0)
        self._pending.append(rec)
        return out if out is not output else None

    def _generic_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, *,
                      names: frozenset[str], label: str) -> Any:
        """Forward hook of a generic owner: keep its inputs, expand broadcast outputs, hook every output."""
        self._end_call()
        rng = self._rng_stack.pop() if self._rng_stack else None
        exp = self._expand_stack.pop() if self._expand_stack else None
        leaves, spec = tree_flatten(output)
        replaced = False
        if exp is not None:
            new = exp.end(None if output is None else leaves)
            if new is not None and any(a is not b for a, b in zip(new, leaves, strict=True)):
                leaves, replaced = new, True  # a tainted output: the unmodified forward's value instead
        if self._in_bookkeeping or self._paused or not torch.is_grad_enabled() or output is None:
            # (output is None when the forward raised)
            return tree_unflatten(leaves, spec) if replaced else None
        B = self._batch()
        if B is None:
            B = batchdim.infer_batch_size(args, kwargs, where=label)
        k_call, lay = self._owner_layouts.next_call(module, args, kwargs, output)  # learned by the probe, or None
        if exp is not None and exp.verified and exp.batch != B:
            exp.reason = f"batch size {exp.batch} at the call's start, {B} at its end"
        if exp is not None and not exp.verified:
            self._expand_off.add(id(module))
            logger.info("module %r (%s): expansion of %s not verified (%s); its parameters are replayed per sample "
                        "from now on", label, type(module).__name__, list(exp.names), exp.reason)
        expanded = exp is not None and exp.verified
        stats = self.generic_stats.setdefault(label, {"expanded": 0, "replayed": 0})
        stats["expanded" if expanded else "replayed"] += 1
        new_leaves = list(leaves)
        hooked: list[int] = []
        declared = generic.output_batch_dims(module, leaves) or [None] * len(leaves)
        out_dims: list[int] = []
        for j, leaf in enumerate(leaves):
            if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim() >= 1):
                continue
            d = declared[j]
            if d is not None and B is not None and leaf.shape[d] == B:  # batch dimension declared by the owner
                hooked.append(j)
                out_dims.append(d)
            elif d is None and B is not None and leaf.shape[0] == B and (lay is None or j not in lay.shared_out):
                hooked.append(j)
                out_dims.append(0)
            elif d is None and B is not None and generic.is_broadcast(leaf, B):
                new_leaves[j] = leaf.expand(B, *leaf.shape[1:])
                hooked.append(j)
                out_dims.append(0)
                if self._probing:
                    self._probe_broadcast.append(module)
            else:
                # no batch dimension: a gradient reaching it cannot be attributed (it requires grad through the anchor
                # also when nothing upstream does, e.g. an RNN's state with batch_first=False in the first layer)
                new_leaves[j] = leaf + self._anchor(leaf)  # a new node, not a view (see below)
                new_leaves[j].register_hook(partial(self._unattributable, label, j))
        if expanded:
            return self._expanded_record(module, exp, names, label, leaves, new_leaves, spec)
        if B is None or not hooked:
            parts = label.split(".") if label != "<root>" else []
            chain = [type(self.model.get_submodule(".".join(parts[:i]))).__name__ for i in range(len(parts), -1, -1)]
            why = batchdim.no_batch_message(label, chain, [args, kwargs], B)
            if why is not None:
                raise RuntimeError(why)
            raise RuntimeError(
                f"module {label!r} ({type(module).__name__}) owns trainable parameters {sorted(names)} but none of "
                "its outputs has a batch dimension (leading size equal to the batch size, or 1), so their gradients "
                "cannot be attributed to samples. Freeze them, or return per-sample outputs.")
        args_d, kwargs_d, in_dims = generic.capture_inputs(args, kwargs, B, module, lay.shared_in if lay else ())
        call = generic.GenericCall(args=args_d, kwargs=kwargs_d, in_dims=in_dims, batch=B, leaf_index=hooked,
                                   outputs=[new_leaves[j].detach() for j in hooked], names=tuple(sorted(names)),
                                   label=label, autocast=autocast_state(), rng=rng, out_dims=out_dims,
                                   call_index=k_call)
        rec = Record(module=module, kind=generic.GENERIC, names=names, activation=call, grads=call.grads,
                     autocast=call.autocast, forward=self._current_forward())
        call.grads.extend([None] * len(hooked))
        for k, j in enumerate(hooked):
            out = new_leaves[j]
            if out is leaves[j] and out.requires_grad:
                # a new node: the hook must see only the gradient from outside the owner, not from uses of the same
                # tensor inside its forward (T5 adds its returned position bias to its own attention scores).
                # Not a view: a hook on a view that the caller modifies in place never fires (HF Falcon adds the
                # attention output to its MLP's output with +=), and the owner would be released without it.
                out = out + self._anchor(out)
            new_leaves[j] = self._hook_output(out, rec, k)
        self._pending.append(rec)
        return tree_unflatten(new_leaves, spec)

    def _expanded_record(self, module: nn.Module, exp: expand.ExpandedCall, names: frozenset[str], label: str,
                         leaves: list[Any], new_leaves: list[Any], spec: Any) -> Any:
        """A verified expansion: the gradients reaching the expansions ``E`` (shape ``(B, *rest)``) are the
        per-sample gradients. Nothing of the call is kept (no inputs, no outputs): the record only waits for them."""
        call = generic.GenericCall(args=(), kwargs={}, in_dims=((), {}), batch=exp.batch, leaf_index=[], outputs=[],
                                   names=tuple(sorted(names)), label=label, autocast=autocast_state(),
                                   expanded=exp.names)
        rec = Record(module=module, kind=generic.GENERIC, names=names, activation=call, grads=call.grads,
                     autocast=call.autocast, forward=self._current_forward())
        call.grads.extend([None] * len(exp.names))
        for k, n in enumerate(exp.names):
            exp.expanded[n].register_hook(partial(self._on_output_grad, rec, k))
        self._pending.append(rec)
        changed = any(a is not b for a, b in zip(new_leaves, leaves, strict=True))
        return tree_unflatten(new_leaves, spec) if changed else None

    def _generic_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                     expand: dict[str, nn.Parameter] | None = None) -> None:
        """Keep the random number generators' state, so the per-sample replay draws the same dropout masks; start
        a verified expansion (:mod:`fastdp.layers.expand`) of the owner's broadcast parameters if it has them."""
        idle = self._in_bookkeeping or self._paused
        self._rng_stack.append(None if idle else generic.rng_state(args, kwargs))
        call = None
        if (expand and not idle and torch.is_grad_enabled() and id(module) not in self._expand_off
                and all(module._parameters.get(n) is p for n, p in expand.items())):  # not a nested call of itself
            B = self._batch()
            if B is None:
                B = batchdim.infer_batch_size(args, kwargs, where=type(module).__name__)
            if B is not None and B >= 1:
                call = _start_expansion(module, expand, B, self._anchor)
        self._expand_stack.append(call)

    @staticmethod
    def _unattributable(label: str, j: int, grad: torch.Tensor) -> None:
        if not bool(grad.any()):
            return  # (a zero gradient carries nothing)
        raise RuntimeError(
            f"output {j} of module {label!r} has no batch dimension but received a gradient: its contribution to "
            "the owner's trainable parameters cannot be attributed to samples.")

    def _on_output_grad(self, rec: Record, k: int, grad: torch.Tensor) -> None:
        if not self._callback_queued and not self._probing:  # first, so that a failure below is discarded with the
            # rest of the pass (the structure probe runs its own book-keeping)
            self._callback_queued = True
            self._passes += 1
            session.queue_end_of_backward(self._on_backward_end, partial(self._on_backward_dropped, self._passes))
        if rec.forward in self._dead_forwards:
            raise RuntimeError(
                f"a backward pass reached {type(rec.module).__name__} through a forward call whose records the "
                "engine discarded after a failed forward or backward pass (nothing of it can be released). Run "
                "the forward pass again and call backward on its new output.")
        if rec.grads[k] is not None or rec.psg is not None:
            raise RuntimeError(
                f"a second backward pass reached the same forward call of {type(rec.module).__name__}: each "
                "sample may contribute once per logical step. Do not call backward twice on one graph "
                "(retain_graph=True) under a PrivacyEngine.")
        grad = grad.detach()
        if rec.activation is None and rec.kind.replayable:  # bias-only: keep B x p, not B x T x p
            grad = rec.kind.reduce_without_activation(rec.module, grad)
        rec.grads[k] = grad
        if rec.activation is not None and self._on_arrival and id(rec.module) not in self._tied_modules:
            instantiate_on_arrival(rec, self.clipping_mode)  # frees the kept tensors where that is cheaper

    def _on_backward_dropped(self, number: int | None = None) -> None:
        """The backward pass ``number`` (``None``: the current one) raised before it completed: discard every record
        it reached, with the other records of the same forward calls (nothing of the pass is summed, released or
        accounted). A late notice (autograd may release the callback on another thread, after the next pass began,
        or after :meth:`_recover` handled it) is ignored."""
        if not self._callback_queued or (number is not None and number != self._passes):
            return
        self._callback_queued = False
        fids = {r.forward for r in self._pending if r.reached}
        self._drop_forwards(fids, "the backward pass raised before it completed")

    def _drop_forwards(self, fids: set[int], why: str) -> None:
        """Discard the pending records of the forward calls ``fids`` (and free what they keep); a later backward
        pass through those calls' outputs raises."""
        if not fids:
            return
        drop = [r for r in self._pending if r.forward in fids]
        self._pending = [r for r in self._pending if r.forward not in fids]
        self._dead_forwards |= fids
        for r in drop:
            r.activation, r.psg = None, None
            r.grads[:] = [None] * len(r.grads)
        mods = sorted({type(r.module).__name__ for r in drop})
        logger.warning("%s: discarded %d record(s) of %d forward call(s) (modules %s); nothing of them is released "
                       "or accounted, the next step holds only the passes that completed", why, len(drop), len(fids),
                       mods[:8])

    def _reset_call_stacks(self) -> None:
        """Restore ``requires_grad`` and empty the per-call stacks (after a forward call that raised)."""
        if self._detached_now or self._rng_stack or self._expand_stack:
            logger.warning("a failed forward pass left %d module call(s) open; requires_grad restored",
                           len(self._detached_now))
        self._restore_params()
        self._rng_stack.clear()
        self._grad_at_root.clear()

    def _recover(self) -> None:
        """Outside any forward call: discard a backward pass whose end never came (fallback of
        :meth:`_on_backward_dropped`) and the per-call stacks of a forward call that never ended."""
        if self._callback_queued and not session.in_backward():
            self._on_backward_dropped()
        if not session.in_backward():
            self._reset_call_stacks()
            self._forward_batch.clear()

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        done = [r for r in self._pending if r.reached]
        self._pending = [r for r in self._pending if not r.reached]
        self._in_bookkeeping = True  # GhostClip's replay calls the modules again: no hooks for that
        try:
            result = clipped_sums(done, self._param_of, self._clip_cfg)
        except BaseException as e:
            self._in_bookkeeping = False
            self._pending.extend(done)
            self._drop_forwards({r.forward for r in done}, f"the end-of-backward bookkeeping raised "
                                                           f"{type(e).__name__}")
            if isinstance(e, NonFiniteGradientError):
                raise NonFiniteGradientError(f"step {self.steps + 1}: {e}") from None
            raise
        finally:
            self._in_bookkeeping = False
        self._backward_seen = True
        self._step_samples += result.batch_size
        if result.nonfinite:
            self.nonfinite_samples += result.nonfinite
            logger.warning("step %d: %d sample(s) with non-finite gradients got clipping factor 0 (%d so far)",
                           self.steps + 1, result.nonfinite, self.nonfinite_samples)
        for p, s in result.sums.items():
            acc = self._summed.get(p)
            self._summed[p] = s if acc is None else acc + s

    # ------------------------------------------------------------------ step
    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # `args` starts with the optimizer itself (torch passes step's full positional arguments).
        if len(args) > 1 or kwargs.get("closure") is not None:
            raise RuntimeError("optimizer.step(closure) is not supported under a PrivacyEngine: call "
                               "loss.backward() yourself, then optimizer.step()")
        if not self._forward_ids:
            self._recover()
        self._check_optimizer(optimizer, allow_frozen=True)
        self._check_trainable_unchanged()
        if not self._backward_seen and not self._empty_step:
            raise RuntimeError(
                "optimizer.step() without a backward pass since the last step: nothing to release. Call "
                "loss.backward() first. For an empty batch (normal under Poisson sampling) run the forward and "
                "backward on it anyway (fastdp handles batch size 0), or call engine.empty_step().")
        if self.accountant.steps + self.noiseless_steps != self.steps:
            self._discard_step()
            raise RuntimeError(
                f"the accountant records {self.accountant.steps} noised steps but the engine released {self.steps} "
                f"({self.noiseless_steps} without noise): its history was changed outside the engine. Nothing was "
                "released; resume from a checkpoint (load_state_dict) or start a new engine.")
        self._check_budget()
        self._check_sample_rate()
        self._pending.clear()  # forward calls that never got a backward pass
        std = self.noise_multiplier * self.max_grad_norm
        for p in self._trainable.values():
            if self.secure_mode:
                p.grad = secure_noisy_mean(p, self._summed.pop(p, None), std, self.batch_size)
            else:
                p.grad = noisy_mean(p, self._summed.pop(p, None), std, self.batch_size, self.noise_generator)
        trainable = {id(p) for p in self._trainable.values()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in trainable:
                    p.grad = None  # frozen since attach (update_trainable): never updated
        self._summed.clear()
        object.__setattr__(self, "steps", self.steps + 1)
        if self.noise_multiplier > 0:
            self.accountant.step(self.noise_multiplier, self.sample_rate)
        else:  # no noise: infinite epsilon, recorded so that steps == accountant.steps + noiseless_steps
            object.__setattr__(self, "noiseless_steps", self.noiseless_steps + 1)
        self._step_samples = 0
        self._backward_seen = False

    _empty_step = False

    def empty_step(self) -> None:
        """Take a step for an empty logical batch without a forward pass: noise only, counted by the accountant.

        Under Poisson sampling a batch can be empty; running the model on a batch of size 0 does the same.
        """
        if self.optimizer is None:
            raise RuntimeError("empty_step() needs an attached optimizer")
        if self._summed or self._backward_seen:
            raise RuntimeError("empty_step() after a backward pass: the batch is not empty; call optimizer.step()")
        self._empty_step = True
        try:
            self.optimizer.step()
        finally:
            self._empty_step = False

    def _discard_step(self) -> None:
        """Drop the accumulated gradients of the step being refused (nothing is released)."""
        self._summed.clear()
        self._pending.clear()
        self._backward_seen = False
        self._step_samples = 0

    def _check_sample_rate(self) -> None:
        """Test this step's logical batch size against the declared rate (:mod:`fastdp.sampling_check`); a
        loader drawing more than declared is refused before anything is released."""
        verdict = self._sampling.observe(self._step_samples)
        for msg in verdict.warnings:
            warnings.warn(msg, stacklevel=4)
        if verdict.refuse is not None:
            self._discard_step()
            raise RuntimeError(f"step {self.steps + 1} refused: {verdict.refuse}")

    def set_noise_multiplier(self, noise_multiplier: float) -> None:
        """Change ``sigma`` from the next step on; the accountant records each step with the sigma it used.

        ``0.0`` is allowed (a warning; epsilon becomes ``inf`` at the next step and stays so). With
        ``enforce_budget`` every further step is checked against ``target_epsilon`` (the calibration no longer
        covers them), and a ``sigma = 0`` step is refused.
        """
        if self._summed or self._backward_seen:
            raise RuntimeError("set_noise_multiplier() with gradients accumulated for the next step; call it "
                               "after optimizer.step() and before the next backward pass")
        if not (isinstance(noise_multiplier, (int, float)) and not isinstance(noise_multiplier, bool)
                and math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier={noise_multiplier!r} must be a finite number >= 0")
        if noise_multiplier == 0:
            warnings.warn("noise_multiplier=0.0: the next steps are clipped but not noised, so training is NOT "
                          "differentially private from now on (epsilon is infinite).", stacklevel=2)
        if float(noise_multiplier) != self.noise_multiplier:
            self._budget_verified = min(self._budget_verified, self.steps)  # the calibration covered the old sigma
        logger.info("noise_multiplier %g -> %g from step %d", self.noise_multiplier, noise_multiplier,
                    self.steps + 1)
        object.__setattr__(self, "noise_multiplier", float(noise_multiplier))

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
        (see :meth:`_outside_use`). What matters is where the *forward* runs; the backward may run outside. The
        pause covers the forward calls made inside the block (threads share it).
        """
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _other_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Global optimizer step pre-hook (installed by :meth:`attach`): refuse a step of an optimizer that no
        PrivacyEngine is attached to while this engine holds gradients from backward passes since its last step.

        The engine cannot tell which optimizer a backward pass was for. A pass taken for another optimizer (a GAN's
        generator loss through the private discriminator, a second optimizer on other parameters of the model)
        reaches the engine's hooks like a private one; folded into the next private step, it would release two
        batches under one accounted step. When another optimizer steps while the engine holds such gradients, at
        least one of those passes was most likely for it, so the engine discards them all (nothing is released or
        accounted) and raises: privacy first, and a warning would leave the private step silently short. Run the
        other loss's forward under :meth:`paused`, or step the private optimizer before any other one.
        Optimizers attached to a PrivacyEngine are left to their own engine, and an optimizer that holds one of
        this engine's trainable parameters is taken for a wrapper of the attached one (HF ``accelerate``'s
        ``AcceleratedOptimizer`` steps itself, then the attached optimizer): it reads the ``.grad`` the engine
        writes, and before the private step that is ``None``.
        """
        if optimizer is self.optimizer or optimizer in _ATTACHED:
            return
        trainable = {id(p) for p in self._trainable.values()}
        if any(id(p) in trainable for g in optimizer.param_groups for p in g["params"]):
            return
        reached = [r for r in self._pending if r.reached]
        if not (self._summed or self._backward_seen or reached):
            return
        fids = {r.forward for r in reached}
        n_samples = self._step_samples
        self._summed.clear()
        self._backward_seen = False
        self._step_samples = 0
        self._drop_forwards(fids, f"another optimizer ({type(optimizer).__name__}) stepped")
        raise RuntimeError(
            f"{type(optimizer).__name__} (id {id(optimizer):#x}), an optimizer this PrivacyEngine is not attached "
            f"to, stepped while the engine held gradients of {n_samples} sample(s) from backward passes since its "
            f"last step for its own optimizer {type(self.optimizer).__name__} (id {id(self.optimizer):#x}). The "
            "engine cannot tell which optimizer a backward pass was for; folding another optimizer's pass into the "
            "private step would release two batches under one accounted step, so those gradients were discarded "
            "(nothing released or accounted). Run the forward of a loss that only trains other parameters under "
            "`with engine.paused():` (e.g. a GAN's generator loss through the private discriminator), and step "
            "the private optimizer before the other one. If this engine is stale (a model you no longer train), call "
            "its detach() (fastdp.engines_on(model) finds it).")

    def _check_budget(self) -> None:
        if not self.enforce_budget:
            return
        nxt = self.steps + 1
        if self.noise_multiplier == 0 or self.noiseless_steps > 0:
            raise PrivacyBudgetExceeded(
                f"step {nxt} with noise_multiplier=0 (now or earlier) would take epsilon to inf > target_epsilon="
                f"{self.target_epsilon:g}; nothing was released. Set a positive noise multiplier.")
        if nxt <= self._budget_verified:
            return
        trial = accounting.make_accountant(self.accountant.name)
        trial.load_state_dict(self.accountant.state_dict())
        trial.step(self.noise_multiplier, self.sample_rate)
        eps = float(trial.get_epsilon(self.target_delta))
        if eps > self.target_epsilon:
            raise PrivacyBudgetExceeded(
                f"step {nxt} would take epsilon to {eps:.4g} > target_epsilon={self.target_epsilon:g} "
                f"(delta={self.target_delta:g}, {self.accountant.name}); nothing was released. Stop training, or "
                "build the engine with a larger budget.")
        self._budget_verified = nxt

    def _check_trainable_unchanged(self) -> None:
        now = {n for n, p in self.model.named_parameters() if p.requires_grad}
        if now != set(self._trainable):
            frozen = sorted(set(self._trainable) - now)
            unfrozen = sorted(now - set(self._trainable))
            # this step's accumulated sums belong to a stale trainable set: drop them (nothing is released)
            self._summed.clear()
            self._pending.clear()
            self._backward_seen = False
            self._step_samples = 0
            raise RuntimeError(
                "the model's trainable parameters changed since the engine read them "
                f"(frozen: {frozen[:5]}{'...' if len(frozen) > 5 else ''}, "
                f"unfrozen: {unfrozen[:5]}{'...' if len(unfrozen) > 5 else ''}); nothing was released and this "
                "step's gradients were discarded. Call engine.update_trainable() after freezing or unfreezing "
                "parameters, before the next backward pass.")

    # ------------------------------------------------------------------ reporting
    def get_privacy_spent(self, delta: float | None = None) -> dict[str, Any]:
        """Privacy spent by the steps taken so far.

        Returns:
            ``{"epsilon": float, "delta": float, "accountant": str, "steps": int}``; epsilon is ``inf`` when
            steps were taken with ``noise_multiplier=0``.
        """
        delta = self.target_delta if delta is None else delta
        if self.noiseless_steps > 0:
            eps = math.inf
        else:
            eps = float(self.accountant.get_epsilon(delta))
        return {"epsilon": eps, "delta": delta, "accountant": self.accountant.name, "steps": self.steps}

    # ------------------------------------------------------------------ checkpoints
    def _config(self) -> dict[str, Any]:
        style = self.clipping_style if isinstance(self.clipping_style, str) else [list(g) for g in self._groups]
        return {"noise_multiplier": self._initial_sigma, "sample_rate": self.sample_rate,
                "batch_size": self.batch_size, "sample_size": self.sample_size, "max_grad_norm": self.max_grad_norm,
                "clipping_fn": self.clipping_fn, "clipping_style": style, "clipping_mode": self.clipping_mode,
                "loss_reduction": self.loss_reduction, "target_delta": self.target_delta,
                "accountant": self.accountant.name, "secure_mode": self.secure_mode}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume privately: step count, accountant history, noise generator state, and the
        privacy configuration (checked on load). Save it with the model's and optimizer's state dicts.

        ``config["noise_multiplier"]`` is the constructed sigma; ``noise_multiplier_now`` the current one
        (:meth:`set_noise_multiplier`). ``steps == len(accountant history) + noiseless_steps``."""
        if self._summed:
            raise RuntimeError("state_dict() with gradients accumulated for the next step: save after "
                               "optimizer.step()")
        return {"version": STATE_VERSION, "steps": self.steps, "noiseless_steps": self.noiseless_steps,
                "noise_multiplier_now": self.noise_multiplier, "accountant": self.accountant.state_dict(),
                "noise_generator": None if self.noise_generator is None else self.noise_generator.get_state(),
                "config": self._config(), "sampling": self._sampling.state_dict(),
                "nonfinite_samples": self.nonfinite_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`. The engine must be built with the same privacy configuration
        (noise multiplier, sample rate, clipping, accountant, delta); a mismatch raises ValueError naming it.

        Nothing in the checkpoint is trusted: ``steps`` must equal the accountant history's step count plus
        ``noiseless_steps`` (so a checkpoint cannot report epsilon 0 after steps were taken), every history
        entry must have this engine's sample rate, and the budget state of ``enforce_budget`` is recomputed from
        the history. Version-1 checkpoints (before the sample-rate monitor) load with the same checks; their
        sample-rate test restarts. A failed load leaves the engine unchanged.
        """
        if self.steps > 0 or self._summed or self._backward_seen:
            raise RuntimeError(
                f"load_state_dict() on an engine that has already released {self.steps} step(s) (or holds "
                "gradients for the next one): the checkpoint would replace their accounting. Load checkpoints into "
                "a freshly built engine, before any backward pass.")
        version = state.get("version") if isinstance(state, dict) else None
        if version not in (1, STATE_VERSION):
            raise ValueError(f"not a fastdp PrivacyEngine state (version {version!r}, expected 1 or "
                             f"{STATE_VERSION})")
        theirs = state.get("config")
        if not isinstance(theirs, dict):
            raise ValueError(f"state['config']={theirs!r} must be the dict saved by state_dict()")
        mine = self._config()
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: saved {a!r}, this engine {b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"the saved engine state has a different privacy configuration ({detail}); build the "
                             "engine with the saved configuration to resume")

        def count(key: str, default: Any = None) -> int:
            v = state.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"state[{key!r}]={v!r} must be an integer >= 0")
            return v

        steps = count("steps")
        nonfinite = count("nonfinite_samples", 0)
        trial = accounting.make_accountant(self.accountant.name)
        trial.load_state_dict(state.get("accountant"))
        if version == 1:  # sigma = 0 steps were never recorded in the accountant
            noiseless = steps if mine["noise_multiplier"] == 0 else 0
            sigma_now = mine["noise_multiplier"]
        else:
            noiseless = count("noiseless_steps")
            sigma_now = state.get("noise_multiplier_now")
            if (isinstance(sigma_now, bool) or not isinstance(sigma_now, (int, float))
                    or not (math.isfinite(sigma_now) and sigma_now >= 0)):
                raise ValueError(f"state['noise_multiplier_now']={sigma_now!r} must be a finite number >= 0")
        if trial.steps + noiseless != steps:
            raise ValueError(
                f"inconsistent checkpoint: state['steps']={steps}, but the accountant history records "
                f"{trial.steps} noised steps and state['noiseless_steps']={noiseless} (they must add up to steps); "
                "the checkpoint was edited or corrupted and cannot be resumed privately")
        bad_q = sorted({q for _, q, _ in trial.history if q != self.sample_rate})
        if bad_q:
            raise ValueError(f"the checkpoint's accountant history has sample rates {bad_q}, but this engine's is "
                             f"{self.sample_rate!r}; the checkpoint was not saved by this configuration")
        sampling = SampleRateMonitor(self.batch_size, self.sample_size)
        if version != 1:
            sampling.load_state_dict(state.get("sampling"), max_steps=steps)
        gen = state.get("noise_generator")
        if gen is not None and self.noise_generator is None:
            raise ValueError("the saved state has a noise generator state; build the engine with "
                             "noise_generator=torch.Generator(...) to resume the same noise stream")
        # all checked: apply
        if gen is not None:
            self.noise_generator.set_state(gen)
        self.accountant.load_state_dict(trial.state_dict())
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "noiseless_steps", noiseless)
        object.__setattr__(self, "noise_multiplier", float(sigma_now))
        self._sampling = sampling
        self.nonfinite_samples = nonfinite
        # budget state recomputed, never read: the calibration covers a history of the constructed sigma only
        homogeneous = (noiseless == 0 and float(sigma_now) == self._initial_sigma
                       and all(s == self._initial_sigma for s, _, _ in trial.history))
        self._budget_verified = (self._planned_steps or 0) if homogeneous else 0

    @property
    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """Name -> parameter, the engine's trainable set (a copy)."""
        return dict(self._trainable)

    def __repr__(self) -> str:
        return (f"PrivacyEngine(batch_size={self.batch_size}, sample_size={self.sample_size}, "
                f"noise_multiplier={self.noise_multiplier:.4g}, max_grad_norm={self.max_grad_norm:g}, "
                f"clipping_mode={self.clipping_mode!r}, clipping_fn={self.clipping_fn!r}, "
                f"accountant={self.accountant.name!r}, steps={self.steps})")


def _register_other_step_hook(engine: PrivacyEngine) -> Any:
    """Install :meth:`PrivacyEngine._other_step` as a global optimizer step pre-hook that holds the engine weakly
    (a global hook must not keep an engine and its model alive); it is removed by ``detach`` or with the engine."""
    ref = weakref.ref(engine)

    def hook(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        eng = ref()
        if eng is not None:
            eng._other_step(optimizer, args, kwargs)

    handle = register_optimizer_step_pre_hook(hook)
    weakref.finalize(engine, handle.remove).atexit = False
    return handle


def _start_expansion(module: nn.Module, params: dict[str, nn.Parameter], batch: int,
                     anchor: Any) -> expand.ExpandedCall | None:
    try:
        call = expand.ExpandedCall(module, params, batch, anchor)
        call.begin()
    except Exception as e:  # noqa: BLE001 - never fatal: the call is replayed instead
        logger.info("module %s: expansion not started (%s); replaying", type(module).__name__, e)
        for n, p in params.items():
            module._parameters[n] = p
        return None
    return call


__all__ = ["NonFiniteGradientError", "PrivacyBudgetExceeded", "PrivacyEngine", "StructureError", "default_delta"]
