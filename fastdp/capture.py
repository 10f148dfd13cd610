"""Capture: the forward and backward hooks that fill the records of each call of a hooked module.

Second stage of the data flow (plan -> **capture** -> per-sample norms -> clipping factors -> clipped sums ->
noise -> optimizer). From the :class:`fastdp.plan.Plan`, :class:`Capture` installs on the model:

* a forward pre-hook on the root: the batch size of the call (the leading size its tensor inputs agree on), the
  call's :class:`RootFrame`, and the structure probe for a new input signature (:mod:`fastdp.probe`);
* per hooked module, a pre-hook that turns off ``requires_grad`` of its trainable parameters for the duration of its
  own call (*ghost differentiation*: autograd never computes their non-private gradients) and pushes a
  :class:`CallFrame`; and a forward hook that keeps the input (a layer kind) or the call (a generic owner,
  :mod:`fastdp.capture_generic`), makes a :class:`fastdp.records.Record`, and hooks the outputs;
* tensor hooks on the outputs that store the output gradients, and queue the end of the backward pass
  (:mod:`fastdp.session`), where the records reached go to the clipping stage
  (:func:`fastdp.clipped_sums.clipped_sums`) and the sums to the step's accumulator (:class:`fastdp.release.StepSums`).

It may touch: the model's hooks, ``requires_grad`` of trainable parameters inside a hooked call, and its own state.
It never writes ``.grad`` (that is the release stage's). After a failed forward or backward pass the records of the
failed calls are discarded (``drop_forwards``) and the next outermost forward call starts clean (``recover``).
While the clipping stage replays modules (GhostClip, the generic path) or the probe runs its reference passes, the
hooks are inert (``inert``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from fastdp import (
    capture_fold,
    capture_generic,
    deferred,
    empty_batch,
    hf_guard,
    loss_check,
    loss_trace,
    probe,
    session,
)
from fastdp.clipped_sums import ClipConfig, NonFiniteGradientError, clipped_sums
from fastdp.layers import batchdim, checkpointing, expand, generic, layout
from fastdp.layers import broadcast as broadcast_rows
from fastdp.layers.base import LayerKind, clipping_precision
from fastdp.norms import instantiate_on_arrival
from fastdp.plan import Plan, PlanEntry, trainable_change
from fastdp.records import Record
from fastdp.sample_sets import SampleSets
from fastdp.torch_api import (
    batch_norm_layout_hooks,
    grad_accumulator,
    is_batchnorm,
    pass_accumulates,
    run_by_torch_compile,
    set_requires_grad,
)

logger = logging.getLogger(__name__)


@dataclass
class RootFrame:
    """One forward call of the model in progress (calls nest: the probe's passes run inside one)."""

    fid: int  # the engine's id of the call (records carry it)
    handled: BaseException | None  # the exception being handled when the call started (to see whether it raised)
    grad_enabled: bool
    batch: int | None = None
    loss_sig: Any = None  # the input signature, when the loss check (fastdp.loss_check) reads this call's outputs
    trace_sig: Any = None  # the input signature, when the loss trace (fastdp.loss_trace) follows this call's outputs
    sig: Any = None  # the input signature (computed when the call records: batch size >= 1, autograd on)
    last_fold: int = 1  # the fold factor of the latest per-sample hooked call (capture_fold.note_rows)
    sizes: tuple[int, ...] = ()  # the non-batch sizes of the per-sample inputs (batchdim.input_sizes)
    canary: bool = False  # an output of a hooked call of it carries the anchor (Capture.hook_output)
    #: the rows-chosen-by-the-data guard (fastdp.layers.fold_guard), active during the call when its signature's
    #: probe saw a fold or rows chosen by the data, or did not verify it, and during the probe's engine pass
    guard: Any = None


@dataclass
class CallFrame:
    """One call of a hooked module in progress: what its pre-hook detached, and for a generic owner the random
    generators' state at the call's start and its verified expansion (``None``: the call is replayed)."""

    detached: list[nn.Parameter] = field(default_factory=list)
    #: sharded parameters (fully_shard) of the call, whose unsharded parameters are restored at its end
    sharded: list[nn.Parameter] = field(default_factory=list)
    rng: Any = None
    expansion: expand.ExpandedCall | None = None


@dataclass
class ProbeState:
    """The structure probe's state (see :mod:`fastdp.probe`)."""

    running: bool = False  # the probe's engine pass is running
    reference: bool = False  # its plain / batch-of-one passes: every hook inert
    seen: set[Any] = field(default_factory=set)  # input signatures verified (at one batch size or more)
    #: input signature -> the batch sizes it was verified at (fastdp.probe.SIZES_PER_SIGNATURE of them at most)
    sizes: dict[Any, set[int]] = field(default_factory=dict)
    buffers: list[Any] = field(default_factory=list)  # the model's buffers at the probe's start
    broadcast: list[nn.Module] = field(default_factory=list)  # modules whose broadcast output the pass expanded
    outside: list[nn.Module] = field(default_factory=list)  # modules whose parameters were used outside them
    stats: dict[str, Any] = field(default_factory=lambda: {"probes": 0, "signatures": 0, "seconds": 0.0,
                                                           "eval_retries": 0, "loss_checks": 0,
                                                           "loss_verdicts": {}, "loss_traces": {}})
    #: the generic owners' layouts learned by the last probe run (fastdp.layers.layout), kept per signature
    learned: Any = None
    #: the engine pass's outputs (the probe's check that the batch dimension survived its expansions)
    out_leaves: Any = None
    out_grad_leads: list[int] = field(default_factory=list)  # leading sizes of those that require grad
    #: the last probe run compared only rounding noise (every per-sample gradient ~0): its signature is not verified
    inconclusive: bool = False
    sig: Any = None  # the input signature the probe is verifying
    #: input signature -> id(module) -> how the fold factors of its calls in the probe's engine pass follow the
    #: inputs' shapes (:func:`fastdp.layers.batchdim.fold_rules`): later calls of the signature must fold the same
    #: way
    folds: dict[Any, dict[int, set[tuple[Any, ...]]]] = field(default_factory=dict)
    #: input signature -> why its last probe did not verify it (postponed, inconclusive, its engine pass raised)
    unverified: dict[Any, str] = field(default_factory=dict)
    #: input signatures whose probe's engine pass saw a hooked call of rows chosen by the data: the guard
    #: (fastdp.layers.fold_guard) runs at their later calls, to check each call's rows (fastdp.capture_fold)
    chooses: set[Any] = field(default_factory=set)

    def verified(self, sig: Any, batch: int | None) -> bool:
        """Whether a call of input signature ``sig`` with ``batch`` samples is verified: the probe passed at this
        batch size, or at :data:`fastdp.probe.SIZES_PER_SIGNATURE` sizes (a call at a size whose probe was postponed
        or inconclusive is not)."""
        sizes = self.sizes.get(sig)
        return bool(sizes) and (batch in sizes or len(sizes) >= probe.SIZES_PER_SIGNATURE)


#: why a model run under ``torch.compile`` is refused, and what to do (docs/guide/integrations.md#torchcompile)
COMPILE_REFUSAL = (
    "torch.compile is not supported with a PrivacyEngine: the engine's per-layer hooks (ghost differentiation, "
    "output-gradient capture, the structure probe) break the compiled graph at every layer, and code compiled "
    "before attach() runs without them, which the engine refuses. Call the uncompiled model (model, not "
    "torch.compile(model)) and build the PrivacyEngine on it; nothing of the refused call was recorded.")


class RootOwnerPre:
    """A forward pre-hook of the root module as an owner of parameters (a class token on the model itself).

    The structure probe's fallback replans inside the root's forward call. Torch then still calls the pre-hooks it
    listed for that call, a removed one without keyword arguments: a removed one (``live`` false) does nothing, and
    the fallback runs the new ones itself (:meth:`Capture.run_root_pres`), so that each runs once per call."""

    def __init__(self, fn: Any, with_kwargs: bool = True) -> None:
        self.fn, self.with_kwargs, self.live = fn, with_kwargs, True

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
        if not self.live:
            return
        self.fn(module, args, kwargs) if self.with_kwargs else self.fn(module, args)


class Capture:
    """The capture stage of one engine (see the module docstring).

    Args:
        engine: the owning :class:`fastdp.PrivacyEngine` (read: ``plan``, ``clip_config``, ``clipping_mode``,
            ``verify_structure``, ``loss_reduction``, ``model``; the probe's fallback calls its
            ``_rebuild_owners``).
        sink: where the clipped sums of each completed backward pass go (``add(result)``, ``step_number``).
    """

    def __init__(self, engine: Any, sink: Any) -> None:
        self.engine = engine
        self.sink = sink
        self.pending: list[Record] = []  # records of forward calls whose backward pass has not completed
        self.roots: list[RootFrame] = []
        self.calls: list[CallFrame] = []
        self.next_forward = 0
        self.dead_forwards: set[int] = set()  # forward calls whose records were discarded after a failure
        self.input_grad_forwards: set[int] = set()  # of those, the ones a pass of torch.autograd.grad reached
        self.callback_queued = False
        self.passes = 0  # backward passes that reached the hooks (the current one's number identifies it)
        self.inert_depth = 0  # > 0: replays and the probe's reference passes run; every hook does nothing
        self.paused = 0  # depth of `with engine.paused()`
        self.sample_sets = SampleSets()  # which forward calls see the same samples (engine.same_samples)
        self.anchors: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self.expand_off: set[int] = set()  # owners whose expansion failed verification once: always replayed
        #: owner label -> {"expanded": calls, "replayed": calls} of the generic path
        self.generic_stats: dict[str, dict[str, int]] = {}
        self.on_arrival = True  # instantiation on arrival (fastdp.norms.instantiate_on_arrival); off: benchmarks
        self.probe = ProbeState()
        self.loss = loss_check.LossCheck()  # the loss check's passes and verdicts per input signature
        # the loss trace's passes and verdicts per input signature (strict: every backward pass traced)
        self.trace = loss_trace.LossTrace(every=getattr(engine, "verify_loss", True) == "strict")
        #: the generic owners' input/output layouts learned by the structure probe (fastdp.layers.layout)
        self.owner_layouts = layout.OwnerLayouts()
        self.moe_of: dict[int, list[str] | None] = {}  # id(module) -> its type chain when a MoE part (capture_fold)
        self.anchor_nodes: dict[Any, Any] = {}  # the anchors' AccumulateGrad nodes (torch_api.grad_accumulator)
        self.accumulates: bool | None = None  # whether the backward pass in progress accumulates into leaves
        self.root_hook_fns: list[RootOwnerPre] = []  # the root's pre-hooks as an owner (the probe's fallback runs them)
        self._handles: list[Any] = []
        #: the Hugging Face labels= guards (fastdp.hf_guard): independent of the plan, so kept across the replans of
        #: the probe's fallback, which run inside the model's forward call (see remove)
        self._guard_handles: list[Any] = []

    # ------------------------------------------------------------------ install / remove
    @property
    def plan(self) -> Plan:
        return self.engine.plan

    @property
    def inert(self) -> bool:
        return self.inert_depth > 0

    @contextlib.contextmanager
    def inert_hooks(self) -> Iterator[None]:
        """Every hook does nothing inside (replays of modules by the clipping stage, the probe's own passes)."""
        self.inert_depth += 1
        try:
            yield
        finally:
            self.inert_depth -= 1

    def install(self) -> None:
        """Model hooks from the plan: batch size, ghost differentiation, capture, guards."""
        hooks = self._handles = []
        root = self.engine.model
        capture_all = self.engine.clip_config.mode.capture_all
        self.root_hook_fns = []
        for entry in self.plan.entries:
            module = entry.module
            params = [self.plan.param_of[(id(module), n)] for n in sorted(entry.names)]
            # prepended: it runs before the module's own pre-hooks (legacy weight_norm and prune compute the weight
            # from the trainable originals there)
            if entry.generic:
                pre = partial(capture_generic.generic_pre, self, params=params,
                              expand=capture_generic.expandable(entry, self.plan))
                if module is root:
                    pre = RootOwnerPre(pre)
                    self.root_hook_fns.append(pre)
                hooks.append(module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
                hook = partial(capture_generic.generic_hook, self, names=entry.names, label=entry.label)
            else:
                pre = partial(self._layer_pre, params=params)
                if module is root:
                    pre = RootOwnerPre(pre, with_kwargs=False)
                    self.root_hook_fns.append(pre)
                hooks.append(module.register_forward_pre_hook(pre, prepend=True))
                needs_act = capture_all or entry.kind.needs_activation(module, entry.names)
                hook = partial(self._layer_hook, kind=entry.kind, names=entry.names, needs_act=needs_act,
                               label=entry.label)
            hooks.append(module.register_forward_hook(hook, with_kwargs=True, always_call=True))
        # prepended after the modules' pre-hooks, so it runs first of all: the call's batch size and forward id
        hooks.append(root.register_forward_pre_hook(self._root_pre, with_kwargs=True, prepend=True))
        for name, p in self.plan.trainable.items():
            # Fires only if autograd computes a gradient for p, i.e. p was used outside its module's forward.
            hooks.append(p.register_hook(partial(self._outside_use, name)))
        for mname, module in root.named_modules():
            if is_batchnorm(module):
                hooks.append(module.register_forward_pre_hook(partial(_batchnorm_guard, mname)))
        # torch's CPU batch-norm kernels misread some layouts in the backward pass (a batch of one through a view):
        # every pass (the structure probe's batch-of-one passes included) gets layouts they read correctly
        hooks.extend(batch_norm_layout_hooks(root))
        # Hugging Face models called with labels=: their internal loss mixes samples (fastdp.hf_guard)
        if not self._guard_handles:
            self._guard_handles = hf_guard.install(root, self.engine.loss_reduction)
        # registered last, so it runs after every other forward hook of the root
        hooks.append(root.register_forward_hook(self._root_post, always_call=True))

    def run_root_pres(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Run the root's owner pre-hooks for the call in progress (after a replan inside it: see RootOwnerPre)."""
        for pre in self.root_hook_fns:
            pre(module, args, kwargs)

    def remove(self, keep_guards: bool = False) -> None:
        """Remove the model hooks and restore ``requires_grad`` of a call left open.

        ``keep_guards`` (a replan): the ``labels=`` guards stay. The probe's fallback replans inside the root's
        forward pre-hook, and torch then still calls the pre-hooks it listed for that call, a removed one as if it
        took no keyword arguments: a removed guard would fail with a ``TypeError`` (T5 with a key/value cache)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for pre in self.root_hook_fns:
            pre.live = False
        if not keep_guards:
            for h in self._guard_handles:
                h.remove()
            self._guard_handles = []
        sharding = getattr(self.engine, "_sharding", None)
        if sharding is not None:
            sharding.forget_hooks()
        self.restore_params()

    def clear(self) -> None:
        """Forget everything of passes in progress (``detach``)."""
        self.restore_params()
        self.pending.clear()
        self.anchors.clear()
        self.callback_queued = False
        self.roots.clear()

    # ------------------------------------------------------------------ frames
    def anchor(self, like: torch.Tensor) -> torch.Tensor:
        """A zero scalar that requires grad, added to an output that does not, so the backward pass reaches it."""
        key = (like.dtype, like.device)
        if key not in self.anchors:
            self.anchors[key] = torch.zeros((), dtype=like.dtype, device=like.device, requires_grad=True)
            with torch.enable_grad():
                self.anchor_nodes[key] = grad_accumulator(self.anchors[key])  # (kept: graphs reuse this node)
        return self.anchors[key]

    def detach_params(self, module: nn.Module, params: list[nn.Parameter]) -> CallFrame:
        """Ghost differentiation: during this module's call its trainable parameters do not require grad, so the
        graph has no edge to them and autograd never computes their (non-private) gradients. Pushes the call's
        frame (always: the forward hook always pops it)."""
        frame = CallFrame()
        self.calls.append(frame)
        if self.inert:
            return frame
        if (not torch.is_grad_enabled() and self.roots and self.roots[-1].grad_enabled
                and checkpointing.in_reentrant_checkpoint()):
            entry = self.plan.entry_of(module)
            names = [n for n, p in self.plan.trainable.items() if any(p is q for q in params)]
            raise RuntimeError(checkpointing.reentrant_message(entry.label if entry else "?",
                                                               type(module).__name__, names))
        sharding = getattr(self.engine, "_sharding", None)
        for p in params:
            if p.requires_grad:
                # a sharded parameter (fully_shard): the unsharded one the forward reads too (fastdp.sharding)
                targets = [p] if sharding is None else sharding.detach_targets(p, self._outside_use, self._handles)
                for t in targets:
                    set_requires_grad(t, False)
                    frame.detached.append(t)
                if sharding is not None and sharding.is_sharded(p):
                    frame.sharded.append(p)
        return frame

    def end_call(self) -> CallFrame | None:
        """End of a hooked module's call: pop its frame, restore what its pre-hook detached (not its ancestors')."""
        if not self.calls:
            return None
        frame = self.calls.pop()
        for p in frame.detached:
            set_requires_grad(p, True)
        if frame.sharded:  # unsharded parameters FSDP made during the call (it copied the sharded flag, False)
            for t in self.engine._sharding.unsharded_of(frame.sharded):
                set_requires_grad(t, True)
        return frame

    def restore_params(self) -> None:
        """Close every open call frame (after a failure): ``requires_grad`` and expanded parameters restored."""
        while self.calls:
            frame = self.end_call()
            if frame is not None and frame.expansion is not None:
                frame.expansion.end(None)

    def batch(self) -> int | None:
        return self.roots[-1].batch if self.roots else None

    def current_forward(self) -> int:
        """The id of the model's forward call in progress (a fresh one for a submodule called on its own)."""
        if self.roots:
            return self.roots[-1].fid
        self.next_forward += 1
        self.sample_sets.note(self.next_forward - 1)  # (a submodule's call: its record's own id)
        return self.next_forward - 1

    def idle(self) -> bool:
        """Whether this call records nothing: inert, paused, or autograd off."""
        return self.inert or bool(self.paused) or not torch.is_grad_enabled()

    # ------------------------------------------------------------------ root hooks
    def _root_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The batch size of this forward call of the model: the leading size its tensor inputs agree on
        (:func:`fastdp.layers.batchdim.infer_batch_size`). An outermost call first discards what a failed forward
        or backward pass left behind; a new input signature is verified by the structure probe
        (:mod:`fastdp.probe`) before the call runs. Traced inputs (:mod:`fastdp.loss_trace`: outputs fed back) are
        replaced by plain aliases (returned, as ``(args, kwargs)``)."""
        if not self.roots and run_by_torch_compile():
            raise RuntimeError(COMPILE_REFUSAL)
        if not self.roots:
            self.recover()
            if torch.is_grad_enabled() and not (self.inert or self.paused or self.probe.running):
                _check_trainable(self.engine)
        replaced = loss_trace.plain_inputs(args, kwargs)  # outputs fed back: the model sees plain tensors
        if replaced is not None:
            args, kwargs = replaced
        frame = RootFrame(self.next_forward, sys.exc_info()[1], torch.is_grad_enabled())
        if not self.roots:
            self.sample_sets.note(frame.fid)
        self.next_forward += 1
        self.roots.append(frame)  # popped by _root_post, which runs also when this pre-hook raises
        frame.batch = B = batchdim.infer_batch_size(args, kwargs)
        if len(self.roots) == 1:
            self.owner_layouts.start()  # the size rule, unless the probe knows this call's signature
        if B is not None and B >= 2:
            frame.sizes = batchdim.input_sizes(args, kwargs, B)
            if self.probe.running and not self.probe.reference and torch.is_grad_enabled():
                # the probe's engine pass: folds are checked as in the real pass
                capture_fold.enter_guard(frame, args, kwargs)
        if (B is None or B < 1 or len(self.roots) != 1 or self.inert or self.paused or self.probe.running
                or not torch.is_grad_enabled()):
            return replaced
        # the input signature, computed once for both checks (the structure probe, the loss check)
        frame.sig = sig = probe.signature(args, kwargs, B, module.training)
        if self.engine.verify_structure:
            probe.maybe_probe(self.engine, module, args, kwargs, B, sig)
        if self.engine.verify_loss and B >= 2:
            frame.loss_sig = sig if self.loss.take(sig) else None
            frame.trace_sig = sig if self.trace.take(sig) and not run_by_torch_compile() else None
        if B >= 2 and self.engine.verify_structure and (self.probe.folds.get(sig) or sig in self.probe.chooses
                                                        or not self.probe.verified(sig, B)):
            # (an unverified signature: a fold is refused, and why is said first)
            capture_fold.enter_guard(frame, args, kwargs)
        return replaced

    def _root_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """End of a forward call of the model (also when it raised: the hook is ``always_call``)."""
        if not self.roots:
            return
        frame = self.roots.pop()
        if frame.guard is not None:
            frame.guard.__exit__(None, None, None)
            frame.guard = None
        if sys.exc_info()[1] is frame.handled and frame.loss_sig is not None:
            loss_check.arm(self.engine, self.loss, frame.loss_sig, output, frame.batch)
        if sys.exc_info()[1] is frame.handled and frame.trace_sig is not None:
            return loss_trace.arm(self.trace, frame.trace_sig, output, frame.batch)  # the output, traced
        if sys.exc_info()[1] is not frame.handled:  # called from Module.__call__'s `except`: the forward raised
            self.drop_forwards({frame.fid}, f"the model's forward call raised {type(sys.exc_info()[1]).__name__}")
            if not self.roots:
                self.reset_call_stacks()
                if frame.batch == 0:  # an empty batch the model cannot run: say what to do (fastdp.empty_batch)
                    empty_batch.note_failed_empty_forward(sys.exc_info()[1])

    def _outside_use(self, name: str, grad: torch.Tensor) -> None:
        if self.probe.reference:  # the structure probe's reference passes differentiate the parameters
            return
        if self.probe.running:  # the probe's engine pass: a suspect for its fallback (fastdp.probe); it restores .grad
            self.probe.outside.append(self.engine.model.get_submodule(name.rpartition(".")[0]))
            return
        if torch.is_grad_enabled():  # (grad mode is on inside a backward pass only with create_graph=True)
            raise RuntimeError(
                f"trainable parameter {name!r} received a gradient in a backward pass run with create_graph=True (a "
                "gradient penalty on the inputs, or a double backward through the model): the second-order terms "
                "reach the parameters outside their layers' calls, where fastdp cannot clip them per sample. Double "
                "backward through the private model is not supported under a PrivacyEngine; compute such a penalty "
                "under engine.paused() only if it must not train the model, or drop it.")
        raise RuntimeError(
            f"trainable parameter {name!r} received a gradient from outside the forward of the layer that owns it "
            "(e.g. a weight read directly by another module, as in weight tying through F.linear). fastdp cannot "
            "clip that use per sample. Tie weights through modules (assign the same nn.Parameter to both), or "
            "freeze the parameter. A parameter that belongs to the model itself (a position embedding or class "
            "token held by the root module, as timm's ViT holds pos_embed) is used outside its owner's forward "
            "when the model is run through another method (model.forward_features(x) then model.forward_head(h)): "
            "call the model itself, model(x). (A model run through torch.compile before the engine was attached "
            "does this too: its compiled code skips the engine's hooks. " + COMPILE_REFUSAL + ")")

    # ------------------------------------------------------------------ layer kinds
    def _layer_pre(self, module: nn.Module, args: tuple[Any, ...], *, params: list[nn.Parameter]) -> None:
        self.detach_params(module, params)

    def hook_output(self, out: torch.Tensor, rec: Record, k: int) -> torch.Tensor:
        """Register the output-gradient hook of output ``k`` of ``rec``'s call (an anchor added if needed).

        The first hooked output of each forward call of the model carries the anchor in any case (a zero scalar
        leaf: one addition): a backward pass that reaches it runs the anchor's ``AccumulateGrad`` node only if it
        accumulates into leaves (``loss.backward()``), not for ``torch.autograd.grad(loss, x)`` (an input's gradient,
        as adversarial training takes it), whose records the engine then discards (:meth:`_on_backward_end`)."""
        frame = self.roots[-1] if self.roots else None
        if not out.requires_grad or (frame is not None and not frame.canary):
            # Nothing upstream requires grad (first layer; weights are detached by ghost differentiation):
            # add a zero that does, so the backward pass reaches this output.
            out = out + self.anchor(out)
            rec.canary = True
            if frame is not None:
                frame.canary = True
        out.register_hook(partial(self.on_output_grad, rec, k))
        return out

    def _layer_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, *,
                    kind: LayerKind, names: frozenset[str], needs_act: bool, label: str) -> Any:
        self.end_call()  # always called, also when forward raised
        if self.idle() or not isinstance(output, torch.Tensor):
            return None
        B = self.batch()
        out = output
        broadcast = B is not None and generic.is_broadcast(out, B)
        if broadcast:
            if self.probe.running:
                self.probe.broadcast.append(module)
            # One output for the whole batch (input with batch dimension 1, e.g. HF position ids (1, T)): expand
            # it, so the gradient arrives per sample instead of summed over the batch; to the rows of the latest
            # per-sample call when that one saw the batch folded (a multiple-choice model's position table, added
            # to (B C, T, d) embeddings), which the structure probe verifies like any fold
            rows = B * capture_fold.broadcast_fold(self)
            fold = capture_fold.fold_of(self, module, label, kind.foldable, rows, B, (args, kwargs))
            out = out.expand(rows, *out.shape[1:])
        else:
            fold = 1 if out.dim() == 0 else capture_fold.fold_of(self, module, label, kind.foldable, out.shape[0], B,
                                                                 (args, kwargs))  # (an input given by keyword too)
            capture_fold.note_rows(self, out.shape[0] if out.dim() else None, fold, B)
        activation = None
        if needs_act:
            inputs = args if args else tuple(kwargs.values())
            activation = kind.capture(module, inputs)
            if broadcast and activation.dim() >= 1 and activation.shape[0] == 1:
                activation = activation.expand(B * fold, *activation.shape[1:])
            activation = kind.unfold_rows(activation, fold)
        rec = Record(module=module, kind=kind, names=names, activation=activation, forward=self.current_forward(),
                     rootless=not self.roots, fold=fold)
        if self.pending and _same_tensor(self.pending[-1].activation, activation):  # q, k, v: one input, kept once
            rec.readers = self.pending[-1].readers
            rec.readers[0] += 1
        out = self.hook_output(out, rec, 0)
        if broadcast and type(out) is torch.Tensor:  # repeated over the batch as the unexpanded output would be
            out = broadcast_rows.batch_rows(out, out.shape[0])
        self.pending.append(rec)
        return out if out is not output else None

    # ------------------------------------------------------------------ backward
    def on_output_grad(self, rec: Record, k: int, grad: torch.Tensor) -> None:
        if not self.callback_queued and not self.probe.running:  # first, so that a failure below is discarded with
            # the rest of the pass (the structure probe runs its own clipping)
            self.callback_queued = True
            self.passes += 1
            self.accumulates = None
            session.queue_end_of_backward(self._on_backward_end, partial(self.on_backward_dropped, self.passes))
        if rec.canary and not self.probe.running and self.accumulates is not True:
            self.accumulates = not self.anchor_nodes or any(pass_accumulates(n) for n in self.anchor_nodes.values())
        if rec.forward in self.input_grad_forwards:
            raise RuntimeError(
                f"a backward pass reached {type(rec.module).__name__} through a forward call that a pass of "
                "torch.autograd.grad (or backward(inputs=...)) already went through: that pass does not train, so "
                "the engine discarded the call's records. Run the forward pass again for the training pass, or take "
                "the input's gradient from a forward call under engine.paused(). (A gradient penalty through the "
                "model, create_graph=True, is not supported.)")
        if rec.forward in self.dead_forwards:
            raise RuntimeError(
                f"a backward pass reached {type(rec.module).__name__} through a forward call whose records the "
                "engine discarded after a failed forward or backward pass (nothing of it can be released). Run "
                "the forward pass again and call backward on its new output.")
        if rec.grads[k] is not None or rec.psg is not None or rec.summed:
            raise RuntimeError(
                f"a second backward pass reached the same forward call of {type(rec.module).__name__}: each "
                "sample may contribute once per logical step. Do not call backward twice on one graph "
                "(retain_graph=True) under a PrivacyEngine.")
        grad = rec.kind.unfold_rows(grad.detach(), rec.fold)
        if rec.activation is None and rec.kind.replayable:  # bias-only: keep B x p, not B x T x p
            # a float32 (or wider) sum over positions: no product, so neither autocast nor a TF32 / bf16 setting
            # changes it, and it runs without the clipping stage's numerics switch (about 25 us per hook)
            grad = rec.kind.reduce_without_activation(rec.module, grad)
        rec.grads[k] = grad
        if rec.activation is not None and self.on_arrival and id(rec.module) not in self.plan.tied_modules:
            with clipping_precision():  # float32 at full precision, also in a backward pass inside torch.autocast
                instantiate_on_arrival(rec, self.engine.clip_config.mode)  # frees the kept tensors where cheaper

    def _on_backward_end(self) -> None:
        self.callback_queued = False
        self.trace.close()
        done = [r for r in self.pending if r.reached]
        if self.accumulates is False:  # torch.autograd.grad(loss, x): not a training pass (see hook_output)
            self.input_grad_forwards |= {r.forward for r in done}
            self.drop_forwards({r.forward for r in done}, "a backward pass that does not accumulate into the "
                               "parameters (torch.autograd.grad, or backward(inputs=...)) reached the engine's layers",
                               level=logging.INFO)
            return
        self.pending = [r for r in self.pending if not r.reached]
        cfg: ClipConfig = self.engine.clip_config
        sharding = getattr(self.engine, "_sharding", None)
        try:
            self.sample_sets.check(done, self.passes)
            # fully_shard: each sharded sum is reduce-scattered to this rank's rows as it is formed
            stream = None if sharding is None else sharding.stream(done, self.plan.param_of)
            try:
                # GhostClip's and the generic path's replays call the modules again (inert hooks; the generic
                # path re-enters the forward's own autocast regions, GhostClip's second backward runs in float32);
                # the rest runs outside any autocast region
                with self.inert_hooks(), clipping_precision(), deferred.collecting() as checks:
                    result = clipped_sums(done, self.plan.param_of, cfg, stream)
            except BaseException:
                if stream is not None:
                    stream.fail()  # tell the other ranks, which raise too
                raise
            if stream is not None:
                result = stream.finish(result)
            result.deferred.extend(checks)
        except BaseException as e:
            self.pending.extend(done)
            self.drop_forwards({r.forward for r in done}, f"the end-of-backward clipping raised {type(e).__name__}")
            if isinstance(e, NonFiniteGradientError):
                raise NonFiniteGradientError(f"step {self.sink.step_number}: {e}") from None
            raise
        self.plan.last_norms.update(result.norms)
        self.sink.add(result)

    # ------------------------------------------------------------------ failures
    def on_backward_dropped(self, number: int | None = None) -> None:
        """The backward pass ``number`` (``None``: the current one) raised before it completed: discard every record
        it reached, with the other records of the same forward calls (nothing of the pass is summed, released or
        accounted). A late notice (autograd may release the callback on another thread, after the next pass began,
        or after :meth:`recover` handled it) is ignored."""
        if not self.callback_queued or (number is not None and number != self.passes):
            return
        self.callback_queued = False
        self.drop_forwards({r.forward for r in self.pending if r.reached},
                           "the backward pass raised before it completed")

    def drop_forwards(self, fids: set[int], why: str, level: int = logging.WARNING) -> None:
        """Discard the pending records of the forward calls ``fids`` (and free what they keep); a later backward
        pass through those calls' outputs raises."""
        if not fids:
            return
        drop = [r for r in self.pending if r.forward in fids]
        self.pending = [r for r in self.pending if r.forward not in fids]
        self.dead_forwards |= fids
        for ids in (self.dead_forwards, self.input_grad_forwards):
            if len(ids) > 4096:  # (a backward pass through a call that old is not expected: the oldest go)
                ids.difference_update(sorted(ids)[:2048])
        for r in drop:
            r.activation, r.psg = None, None
            r.grads[:] = [None] * len(r.grads)
        mods = sorted({type(r.module).__name__ for r in drop})
        logger.log(level, "%s: discarded %d record(s) of %d forward call(s) (modules %s); nothing of them is released "
                   "or accounted, the next step holds only the passes that completed", why, len(drop), len(fids),
                   mods[:8])

    def reset_call_stacks(self) -> None:
        """Restore ``requires_grad`` and close the open call frames (after a forward call that raised)."""
        if self.calls:
            logger.warning("a failed forward pass left %d module call(s) open; requires_grad restored",
                           len(self.calls))
        self.restore_params()

    def recover(self) -> None:
        """Outside any forward call: discard a backward pass whose end never came (fallback of
        :meth:`on_backward_dropped`) and the frames of a forward call that never ended."""
        if session.in_backward():
            return
        if self.callback_queued:
            self.on_backward_dropped()
        self.reset_call_stacks()
        self.roots.clear()

    def reached_forwards(self) -> set[int]:
        """Forward ids of pending records that a backward pass reached (it has not completed)."""
        return {r.forward for r in self.pending if r.reached}


def _check_trainable(engine: Any) -> None:
    """Refuse a forward call (with autograd on) after the model's trainable set changed without
    ``engine.update_trainable()``: a parameter unfrozen since (peft's ``set_adapter``, ``requires_grad_(True)``) has no
    hook, so an optimizer the engine is not attached to would update it with its ordinary gradient, unclipped and
    unnoised. Checked at every outermost forward call (a walk of the model's parameters); the step checks it again
    (:mod:`fastdp.release`)."""
    changed = trainable_change(engine.model, engine.plan)
    if changed is not None:
        engine._release.discard()  # (sums of the old trainable set; update_trainable() needs none pending)
        raise RuntimeError(
            f"{changed}: the engine would not clip or noise a parameter it does not know, and an optimizer it is not "
            "attached to would update it with its ordinary gradient. Call engine.update_trainable() after freezing "
            "or unfreezing parameters (peft's set_adapter() does), before the next forward pass; to step them with "
            "another optimizer: engine.detach(), engine.update_trainable(), engine.attach(that_optimizer). "
            "Nothing of this call was recorded, and this step's accumulated gradients were discarded.")


def _batchnorm_guard(mname: str, module: nn.Module, args: tuple[Any, ...]) -> None:
    if module.training and torch.is_grad_enabled():
        raise RuntimeError(f"module {mname!r} ({type(module).__name__}) runs in train mode under a "
                           "PrivacyEngine: batch statistics mix samples. Call .eval() on it.")


def _same_tensor(a: Any, b: Any) -> bool:
    """Whether two kept activations are views of the same data (same storage offset, shape, strides, dtype and
    device): two calls that read one input tensor."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr()
            and a.numel() > 0 and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and a.device == b.device)


__all__ = ["CallFrame", "Capture", "PlanEntry", "ProbeState", "RootFrame"]
