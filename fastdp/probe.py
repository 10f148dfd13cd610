"""Structure probe: verify, once per input signature, that the engine's per-sample gradients are the model's.

The engine *assumes* the per-sample structure of a model: a tensor is batched iff its leading size is the batch size
``B`` (the leading size of the model's first tensor input), and a layer output of leading size 1 is one value shared
by the batch (it is expanded to ``(B, ...)``). Where the assumption is false (a sequence-first model, a model that
splits or reorders its batch, a forward hook that rescales a layer's output, a broadcast output indexed with
``[0]``, a position table read with ``arange(T)`` when ``T == B``) the per-sample gradients would be silently wrong.
The probe checks the assumption against a brute-force computation instead of trusting it.

(This module is about 750 lines, over the project's ~500: its passes -- engine pass, references, learned owner
layouts, comparison, fallback -- share one state machine (the capture stage's ``ProbeState``) and one set of
tolerances, and reading them together is how a reviewer checks that the probe cannot pass a wrong model. Splitting
the comparison helpers into their own module is the next step if it grows.)

**When.** From the model's root forward pre-hook, before the user's forward runs, when grad is enabled, ``B >= 1``
and the call's :func:`signature` is new. The signature holds, per tensor leaf of ``(args, kwargs)``: its position,
ndim, dtype, whether its leading size is ``B``, which other dimensions equal ``B``, which dimensions are 1; plus
grad mode, autocast state and the model's training flag -- not the exact sizes, so Poisson batch sizes and padded
lengths do not re-probe, but a new coincidence (``T == B``) is a new signature and is probed then.

**What.** With every random generator forked (nothing the user sees changes: no RNG draw, no pending record, no
accumulated sum, no step, no ``generic_stats``), under a torch-function mode that turns dropout into the identity
in every pass (:class:`DeterministicDropout`):

a. *engine pass*: the model on the batch with the engine's capture hooks active (records kept apart from the
   step's: nothing reaches its pending records or sums); seeded random cotangents ``V_j`` (a private generator)
   for every floating output leaf of leading size ``B``; backward of ``sum_j <V_j, y_j>``; from the records, by
   instantiation on the probe samples' rows, the engine's per-sample gradients ``g_i`` of the probe samples 0 and
   ``B - 1``, and, by the step's own code in the engine's clipping mode (:func:`fastdp.clipped_sums.clipped_sums` with
   random clipping factors ``w_i`` on the probe samples and 0 elsewhere), the weighted sum ``sum_i w_i g_i``;
b. *reference*: per probe sample ``i``, the model with every engine hook inert on the batch of one (leaves of
   leading size ``B`` sliced ``[i:i+1]``, the others as given); its outputs must equal row ``i`` of the batch's
   outputs, the gradient ``r_i`` of ``sum_j <V_j[i], y_j(x_i)>`` must equal the engine's ``g_i``, and
   ``sum_i w_i r_i`` must equal the clipping mode's weighted sum (this catches rescaling hooks, parameters
   released as zero or counted twice, a mode's contraction that disagrees with instantiation, even at ``B = 1``).
   The engine pass's generic owners are replayed (for ``g_i`` and the weighted sum) only after the references:
   each owner call's batch-of-one twin tells which of its tensors are per sample (a tensor of the same shape in
   both is shared, whatever its leading size: :mod:`fastdp.layers.layout`), and that layout is applied to the
   engine pass's records, kept for the signature, and used by every later call with it (``B == T`` or any other
   coincidence inside the model does not decide).

A model that fails on a batch of one (``x.chunk(2)`` unpacked into two halves) is refused. A failure of the engine's
pass (an error the engine raises itself: a weight used outside its module, layers that saw different batch sizes)
is left to the real pass, which raises it as before.

**Fallback.** When the probe fails and the engine's pass expanded broadcast outputs (leading size 1) or saw a
parameter used outside its module -- ``wpe(position_ids)[0]``, HF DeBERTa-v2 relative attention, peft prompt
tuning -- those modules' parameters are given to an ancestor on the exact generic path (its per-sample replay
differentiates only them; the forward is untouched) and the probe runs again; the ancestor moves up one level per
try (all suspects together, possibly up to the root: exact, but the replay then re-runs the whole model per sample),
until the probe passes or the root failed too (then the owners are restored and the failure is reported, naming
the modules whose outputs were expanded). An expansion after which no output of the model has leading size ``B``,
while on a batch of one an output has leading size 1 (a no-grad forward of sample 0, run only in that case), is
such a failure, not "nothing to verify": ``x.chunk(2)`` of an odd batch (the last chunk, one sample, was expanded
to ``B`` rows), ``torch.cat`` along dim 0 of a broadcast position embedding and the batch. So are layer-kind calls
that saw more than one but fewer than ``B`` rows (the chunks of an even batch).

Errors are relative to the largest per-sample gradient norm of the parameter (``_PROBE_RTOL`` per dtype). On a
mismatch the engine raises :class:`StructureError` naming the worst parameters, the evidence and the fix. If the
passes disagree and a random operation other than dropout ran, the probe is retried once with the model in eval
mode (logged); a second failure is refused, naming the random operations.

When every per-sample gradient of the probe samples is at rounding level (a LayerNorm over positions whose inputs
are all equal outputs exactly 0, and so is every gradient through it), nothing can be compared: the other samples of
the batch are probed two at a time until one pair is conclusive; if none is, every gradient of the batch is rounding
noise, the call runs, and its signature is probed again at its next call.

**What it does NOT catch.**

* A mistake the batch-of-one reference shares: a sequence-first model ``(T, B, d)`` made only of position-wise
  layers (Linear, LayerNorm) is exactly row-independent along dim 0, so "rows" are positions in both the engine and
  the reference, and each *position* is clipped (several samples merged). Sequence-first models with attention or a
  convolution over time mix rows and are caught.
* Outputs without a batch dimension (a scalar loss returned by the model) get no cotangent: what flows through them
  is not checked. Return per-sample outputs (logits) and compute the loss outside the model to be verified.
* Behaviour that changes between calls with the same signature (data-dependent control flow, state kept across
  calls) is checked only on the probed call's inputs; randomness other than dropout is checked only as far as the
  eval-mode retry reaches.
* Samples other than the probe samples (0 and ``B - 1``) are not checked: a structural mistake that spares both
  (e.g. mixing only samples 1 and 2) passes. (A full-batch plain pass would check the sum over all samples, at about
  one more step's cost: left out to keep the probe under 2 % of a 100-step run.)

``verify_structure=False`` on the engine turns the probe off (then these failures are silent again).
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.clipped_sums import ClipConfig, NonFiniteGradientError, clipped_sums
from fastdp.layers import checkpointing, generic, layout
from fastdp.layers.base import autocast_state, clipping_precision
from fastdp.layers.generic import GENERIC
from fastdp.plan import trainable_change
from fastdp.torch_api import TorchFunctionMode, grad_hooks, ieee_float32, tree_flatten, tree_map

logger = logging.getLogger(__name__)

#: relative tolerance per parameter dtype: ||g_engine - g_ref|| / max_i ||g_i||  (structural errors are O(1))
_PROBE_RTOL = {torch.float64: 1e-5, torch.float32: 5e-3, torch.bfloat16: 1e-1, torch.float16: 5e-2}
_SEED = 0x5EED
#: parameters are compared relative to at least this fraction of the largest per-sample gradient norm of any parameter
_FLOOR = 1e-3
#: per-sample gradients all below this many machine epsilons (times the largest parameter entry) are rounding noise:
#: the probe is inconclusive for that batch and runs again at the signature's next call
_NOISE = 1e3
_ENGINE_FAILED = "engine pass"  # the engine's capture or book-keeping raised (left to the real pass)
_LOST_BATCH = "batch dimension lost"  # the engine's expansions left no output of leading size B
_SUB_BATCH = "part of the batch"  # layers saw fewer rows than the batch (x.chunk(2))
_NO_BATCH_OUT = "no per-sample output"  # outputs that require grad, none of leading size B (a sequence-first input)


class StructureError(RuntimeError):
    """The engine's per-sample gradients of this model do not match a batch-of-one computation (see
    :mod:`fastdp.probe`): training would not be private as stated, so the engine refuses."""


# ---------------------------------------------------------------------------------------------- determinism
_DROPOUTS = {F.dropout, F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d, F.dropout2d, F.dropout3d,
             torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout}
_SDPA = F.scaled_dot_product_attention
#: nn.MultiheadAttention's functional form: it calls dropout inside, where the mode does not reach (a mode is off
#: while its own handler runs a function), so its ``dropout_p`` (argument 10) is set to 0 instead
_MHA = F.multi_head_attention_forward
_MHA_DROPOUT = 10
_RANDOM = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.bernoulli, torch.normal, torch.multinomial,
           torch.rand_like, torch.randn_like, torch.randint_like, torch.poisson,
           torch.Tensor.bernoulli, torch.Tensor.bernoulli_, torch.Tensor.uniform_, torch.Tensor.normal_,
           torch.Tensor.random_, torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.cauchy_,
           torch.Tensor.log_normal_, torch.Tensor.multinomial}


class DeterministicDropout(TorchFunctionMode):
    """Dropout (``F.dropout*``, alpha dropout, ``scaled_dot_product_attention``'s and
    ``multi_head_attention_forward``'s ``dropout_p``) becomes the identity, so the batched and the batch-of-one
    passes compute the same function; other random operations run as usual and are recorded in ``random_ops``."""

    def __init__(self) -> None:
        super().__init__()
        self.random_ops: set[str] = set()
        #: a dropout ran (and was made the identity): torch function modes do not reach the backward pass, so
        #: where non-reentrant checkpointing recomputes a block there, its dropout is a real one again
        self.dropout = False

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            self.dropout = True
            x = args[0] if args else kwargs["input"]
            return x
        if func is _MHA:
            self.dropout = True
            if len(args) > _MHA_DROPOUT:
                args = (*args[:_MHA_DROPOUT], 0.0, *args[_MHA_DROPOUT + 1:])
            else:
                kwargs = {**kwargs, "dropout_p": 0.0}
        if func is _SDPA:
            self.dropout = True
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            kwargs = {**kwargs, "dropout_p": 0.0} if "dropout_p" in kwargs or len(args) <= 4 else kwargs
        elif func in _RANDOM and kwargs.get("generator") is None:  # (the probe's own draws use a private one)
            self.random_ops.add(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------- signature
def signature(args: tuple[Any, ...], kwargs: dict[str, Any], batch: int, training: bool) -> tuple[Any, ...]:
    """What decides the per-sample structure of a forward call, without the exact sizes (see the module docstring).
    """
    flat, spec = tree_flatten((tuple(args), dict(kwargs)))
    leaves = []
    for k, x in enumerate(flat):
        if isinstance(x, torch.Tensor):
            shape = tuple(x.shape)
            leaves.append((k, x.dim(), x.dtype, x.device.type, bool(shape and shape[0] == batch),
                           frozenset(d for d, s in enumerate(shape) if d > 0 and s == batch),
                           frozenset(d for d, s in enumerate(shape) if s == 1), x.requires_grad))
        elif isinstance(x, (bool, int, float, str, type(None))):
            leaves.append((k, type(x).__name__, x if isinstance(x, (bool, str, type(None))) else None))
        else:
            leaves.append((k, type(x).__name__))
    return (str(spec), tuple(leaves), torch.is_grad_enabled(), autocast_state(), training, batch == 1)


# ---------------------------------------------------------------------------------------------- findings
@dataclass
class Finding:
    """One disagreement: which check, where, how large."""

    check: str  # "per-sample gradient", "sum of per-sample gradients", "output", "engine pass", "batch of one"
    where: str  # parameter name / output leaf / ""
    error: float  # relative error (inf: a pass failed)
    index: int | None = None
    detail: str = ""
    params: tuple[str, ...] = ()  # parameters a failed pass named (a generic owner whose replay raised)

    def line(self) -> str:
        at = f" of sample {self.index}" if self.index is not None else ""
        err = "" if math.isinf(self.error) else f": relative error {self.error:.3g}"
        return f"{self.check}{at} {self.where}{err}{' (' + self.detail + ')' if self.detail else ''}"


def _probe_indices(B: int) -> list[int]:
    return sorted({0, B - 1})


def _slice(args: Any, kwargs: Any, B: int, i: int) -> tuple[Any, Any]:
    def cut(x: Any) -> Any:
        return x[i:i + 1] if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == B else x
    return tree_map(cut, (tuple(args), dict(kwargs)))


def _batched_outputs(out: Any, B: int) -> tuple[list[Any], list[int]]:
    leaves = tree_flatten(out)[0]
    idx = [j for j, y in enumerate(leaves) if isinstance(y, torch.Tensor) and y.is_floating_point() and y.dim() >= 1
           and y.shape[0] == B and y.requires_grad]
    return leaves, idx


def _dot(cots: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> torch.Tensor:
    return sum((c.to(y.dtype) * y).sum() for c, y in zip(cots, outs, strict=True))


def _grads(loss: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    return list(torch.autograd.grad(loss, params, allow_unused=True))


def _rel(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    d = float((a.double() - b.double()).norm())
    return 0.0 if d == 0 else d / max(scale, 1e-300)


def _out_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return math.inf
    scale = float(want.detach().double().abs().max()) if want.numel() else 0.0
    diff = float((got.detach().double() - want.detach().double()).abs().max()) if want.numel() else 0.0
    if not math.isfinite(diff):
        return 0.0 if torch.equal(got.isfinite(), want.isfinite()) else math.inf
    return 0.0 if diff == 0 else diff / max(scale, 1e-300)


class _Inert:
    """Every engine hook inert (as in book-keeping) for the plain and the reference passes."""

    def __init__(self, engine: Any) -> None:
        self.e = engine

    def __enter__(self) -> None:
        cap = self.e._capture
        self.saved = cap.probe.reference
        cap.inert_depth += 1
        cap.probe.reference = True

    def __exit__(self, *exc: Any) -> None:
        cap = self.e._capture
        cap.inert_depth -= 1
        cap.probe.reference = self.saved


# ---------------------------------------------------------------------------------------------- the probe
def _restore_buffers(buffers: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]) -> None:
    """Put every buffer back as it was before the probe (same tensor object, same values), so that each probe pass
    starts from the state the real forward will see (a stateful forward, e.g. spectral_norm's power iteration in
    train mode, would otherwise give the passes different weights)."""
    with torch.no_grad():
        for m, n, b, saved in buffers:
            m._buffers[n] = b
            b.copy_(saved)


def maybe_probe(engine: Any, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], B: int,
                sig: tuple[Any, ...] | None = None) -> None:
    """Run the probe if this call's signature ``sig`` (:func:`signature`, computed here if not given) is new (see
    the module docstring); raise :class:`StructureError` on a mismatch. Called by the engine's root forward
    pre-hook."""
    if sig is None:
        sig = signature(args, kwargs, B, model.training)
    if sig in engine._capture.probe.seen:
        engine._capture.owner_layouts.start(sig)  # the generic owners' layouts learned for this signature
        return
    changed = trainable_change(model, engine.plan)  # the probe's passes would fail with a misleading error
    if changed is not None:
        raise RuntimeError(f"{changed}. Call engine.update_trainable() after freezing or unfreezing parameters, "
                           "before the next forward pass.")
    t0 = time.perf_counter()
    # inputs computed with autograd outside the model (model(inputs_embeds=emb(ids)), a layer called before it):
    # the probe's passes start from them as leaves, so that its backward passes stay inside the model and do not
    # reach (and consume) the outside layers' records, which the real backward pass reaches once
    args, kwargs = tree_map(lambda x: x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.requires_grad
                            and x.grad_fn is not None else x, (tuple(args), dict(kwargs)))
    flat = tree_flatten((args, kwargs))[0]
    devices = sorted({x.device for x in flat if isinstance(x, torch.Tensor) and x.device.type == "cuda"},
                     key=str)
    training = [(m, m.training) for m in model.modules()]
    # the probe's passes must leave no trace: buffers a forward updates (spectral_norm's power iteration, running
    # statistics) are put back, in place and as the same tensor objects
    buffers = [(m, n, b, b.detach().clone()) for m in model.modules() for n, b in m._buffers.items()
               if isinstance(b, torch.Tensor)]
    engine._capture.probe.buffers = buffers
    stats = engine.probe_stats
    findings: list[Finding] | None = None
    random_ops: set[str] = set()
    engine._capture.probe.inconclusive = False
    engine._capture.probe.running = True
    engine._capture.probe.sig = sig
    engine._capture.probe.folds.pop(sig, None)  # the fold factors its engine pass sees (fastdp.capture)
    engine._capture.probe.chooses.discard(sig)  # and whether it sees rows chosen by the data (fastdp.capture_fold)
    engine._capture.probe.broadcast, engine._capture.probe.outside = [], []
    broadcast = engine_failed = False
    suspects: list[str] = []
    fell_back: bool | None = None
    try:
        # every pass of the probe at full float32 precision (a user's TF32 / bf16 setting would put rounding noise of
        # about 1e-2 between the engine's and the reference's per-sample gradients; autocast still applies)
        with torch.random.fork_rng(devices=devices, device_type="cuda"), torch.enable_grad(), ieee_float32():
            with DeterministicDropout() as det, checkpointing.counted_checkpoints() as checkpoints:
                findings = _run(engine, model, args, kwargs, B)
                for k in range(1, B - 1, 2):  # rounding noise only: the other samples, two at a time
                    if findings or not engine._capture.probe.inconclusive:
                        break
                    engine._capture.probe.inconclusive = False
                    findings = _run(engine, model, args, kwargs, B, sorted({k, min(k + 1, B - 2)}))
            random_ops = set(det.random_ops)
            if findings and det.dropout and checkpoints.used:
                # non-reentrant checkpointing recomputed blocks in the backward passes, where this mode does not
                # reach: their dropout was a real one there. Again with the blocks' activations kept (no recompute)
                logger.info("structure probe: dropout inside checkpointed blocks; probing again without recomputation")
                engine._capture.probe.broadcast, engine._capture.probe.outside = [], []
                with DeterministicDropout(), checkpointing.plain_checkpoints():
                    findings = _run(engine, model, args, kwargs, B)
            if findings and random_ops and model.training:
                logger.warning("structure probe: the passes disagree and random operations ran (%s); retrying the "
                               "probe in eval mode", sorted(random_ops))
                stats["eval_retries"] += 1
                model.eval()
                engine._capture.probe.broadcast, engine._capture.probe.outside = [], []
                with DeterministicDropout():
                    findings = _run(engine, model, args, kwargs, B)
            broadcast = bool(engine._capture.probe.broadcast)
            engine_failed = bool(engine._capture.probe.outside)  # the real pass raises the outside use itself
            suspects = _labels(model, engine._capture.probe.broadcast)
            if findings and _nonfinite_data(engine, findings):
                # the engine's pass refused a sample with non-finite gradients, which the engine's policy zeroes in
                # the real pass: nothing about the structure can be read from this batch; probed at the next call
                logger.info("structure probe postponed: a sample of this batch has non-finite gradients "
                            "(on_nonfinite=%r); the signature is probed again at its next call",
                            engine.clip_config.on_nonfinite)
                findings = None
            elif findings and (broadcast or engine_failed):
                fell_back = _fallback(engine, model, args, kwargs, B)
                if fell_back:
                    findings = []
                elif _model_raises(engine, model, args, kwargs, findings):
                    findings = None  # the model's own error (T5 without decoder_input_ids): the real pass raises it
    finally:
        engine._capture.probe.running = False
        engine._capture.probe.broadcast, engine._capture.probe.outside = [], []
        _restore_buffers(buffers)
        for m, flag in training:
            m.training = flag
        stats["seconds"] += time.perf_counter() - t0
    stats["probes"] += 1
    unverified = engine._capture.probe.unverified
    if findings is None or (findings and not broadcast and (
            engine_failed or all(f.check == _ENGINE_FAILED for f in findings))):
        # the model raised in a plain pass, or the engine's pass raised: the real pass raises the same error
        first = ((findings[0].detail or findings[0].check).splitlines() or [""])[0][:300] if findings else ""
        unverified[sig] = (f"its engine pass raised {first}" if first else
                           "it was postponed: a sample of the batch had non-finite gradients, or the model raised")
        return
    if findings:
        raise StructureError(_message(engine, findings, B, sig, random_ops, suspects, fell_back is False))
    if engine._capture.probe.inconclusive:
        engine._capture.owner_layouts.by_signature.pop(sig, None)
        unverified[sig] = "every per-sample gradient of the batch was at rounding level"
        logger.info("structure probe inconclusive (batch %d): every per-sample gradient is at rounding level; the "
                    "signature is probed again at its next call", B)
        return
    unverified.pop(sig, None)
    engine._capture.probe.seen.add(sig)
    engine._capture.owner_layouts.by_signature[sig] = engine._capture.probe.learned
    engine._capture.owner_layouts.start(sig)
    stats["signatures"] = len(engine._capture.probe.seen)
    logger.info("structure probe passed (batch %d, %d probe samples, %.3fs)", B, len(_probe_indices(B)),
                time.perf_counter() - t0)


def _fallback(engine: Any, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], B: int) -> bool | None:
    """Broadcast outputs were expanded and the probe failed (e.g. ``wpe(position_ids)[0]``, or the expansion broke
    the model): stop expanding them by making an ancestor the generic owner of their parameters (the ancestor's
    per-sample replay differentiates only those; the forward is untouched), nearest first, and probe again. Returns
    whether some ancestor passed (the owners are restored otherwise), ``None`` if it could not be tried."""
    if engine._capture.pending:
        return None  # pending records of the old owners
    name_of = {id(m): n for n, m in model.named_modules()}
    trainable = {id(p) for p in engine._trainable.values()}
    saved = dict(engine._extra_owned)
    level: dict[str, str] = {}  # suspect module -> the candidate owner of its parameters, moved up one level a try
    owned: dict[str, list[str]] = {}

    def add_suspects() -> None:
        for m in (*engine._capture.probe.broadcast, *engine._capture.probe.outside):
            c = name_of.get(id(m))
            if c and c not in level:
                owned[c] = [n for n, p in m.named_parameters() if id(p) in trainable]
                if owned[c]:
                    level[c] = c

    add_suspects()
    while level and any(level.values()):
        extra: dict[str, list[str]] = {k: list(v) for k, v in saved.items()}
        for c in level:
            level[c] = level[c].rpartition(".")[0] if level[c] else ""
            anc = level[c]
            prefix = c[len(anc) + 1:] if anc else c
            extra.setdefault(anc, []).extend(f"{prefix}.{n}" for n in owned[c])
        engine._extra_owned = {k: tuple(dict.fromkeys(v)) for k, v in extra.items()}
        engine._rebuild_owners()
        engine._capture.probe.broadcast, engine._capture.probe.outside = [], []
        with DeterministicDropout():
            findings = _run(engine, model, args, kwargs, B)
        outside = bool(engine._capture.probe.outside)  # (the real pass would refuse: e.g. an owner never called as a
        add_suspects()  # module, timm's rel_pos.get_bias() reading rel_pos.mlp from the attention's forward)
        if findings == [] and not outside:
            culprits = sorted(level)
            logger.warning("structure probe: the parameters of %s could not be attributed to samples where they are "
                           "(a broadcast output, an output without batch dimension, or a parameter read outside its "
                           "module's call); they are now replayed per sample by %s (exact, slower)", culprits,
                           sorted({level[c] or "<root>" for c in culprits}))
            # the root's pre-hooks as an owner (it was one, or became one) for this call: those torch listed for it
            # were removed by the replan and do nothing
            engine._capture.run_root_pres(model, args, kwargs)
            return True
    engine._extra_owned = saved
    engine._rebuild_owners()
    engine._capture.run_root_pres(model, args, kwargs)
    return False


def _run(engine: Any, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
         B: int, indices: list[int] | None = None) -> list[Finding]:
    names = list(engine._trainable)
    params = [engine._trainable[n] for n in names]
    indices = _probe_indices(B) if indices is None else indices
    engine._capture.probe.learned = {}
    # a. engine pass (forward and backward; its generic owners' replays wait for the layouts learned in b.)
    engine._capture.owner_layouts.start()  # the size rule; the layouts learned below are applied to its records
    layers = {id(e.module): e.module for e in engine.plan.entries if not e.generic}
    on_batch = layout.Recorder(list(layers.values()))  # the layer kinds' calls on the batch (see _no_batch_dim)
    try:
        _restore_buffers(engine._capture.probe.buffers)
        res = _engine_pass(engine, model, args, kwargs, B)
    except (torch.OutOfMemoryError, MemoryError):
        raise  # not a finding about the structure: the caller halves the batch and retries (probed again)
    except Exception as e:  # noqa: BLE001 - the real pass raises the same error (the user's or the engine's)
        return [_engine_failed(e)]
    finally:
        layer_calls = on_batch.restart()
        on_batch.close()
    if res is None:
        if engine._capture.probe.broadcast and _batch_lost(engine, model, args, kwargs, B):
            # the expansions changed what the model computes (x.chunk(2) of an odd batch, torch.cat along dim 0)
            return [Finding(_LOST_BATCH, "", math.inf, detail=(
                f"after the engine expanded the outputs of leading size 1 of "
                f"{_labels(model, engine._capture.probe.broadcast)} to the batch size {B}, no output of the model that "
                f"requires grad has leading size {B}, but on a batch of one an output has leading size 1"))]
        leads = sorted(set(engine._capture.probe.out_grad_leads))
        if leads:
            return [Finding(_NO_BATCH_OUT, "", math.inf, detail=(
                f"the model's outputs that require grad have leading sizes {leads}, none the batch size {B} that the "
                f"engine read from the inputs' leading dimension: the engine would clip each of {B} rows that are not "
                f"the samples (a sequence-first input (T, B) gives T as the batch size; an output of leading size 1 "
                f"pools the batch). Pass the batch first in every input and output"))]
        logger.info("structure probe: no output with a batch dimension requires grad; nothing to verify")
        return []
    batch_out, idx, cots, records, gen = res
    sub = _sub_batches(records, B)
    if sub:  # layers that saw a part of the batch (x.chunk(2)), or rows that are not the batch's: suspects for the
        # fallback, as expanded outputs are
        engine._capture.probe.broadcast.extend(m for m, _ in sub)
        _free(records)
        return [Finding(_SUB_BATCH, "", math.inf, detail=(
            f"layers {_labels(model, [m for m, _ in sub])} saw {sorted({n for _, n in sub})} rows of a batch of "
            f"{B} (a part of the batch, e.g. x.chunk(2), or a tensor without batch dimension): their rows cannot be "
            "attributed to samples by position"))]
    findings: list[Finding] = []
    # b. references; the generic owners' calls on a batch of one tell which of their tensors are per sample
    refs: dict[int, list[torch.Tensor | None]] = {}
    recorder = layout.Recorder([e.module for e in engine.plan.entries])
    ref_calls = []
    try:
        for i in indices:
            recorder.restart()
            _reference(engine, model, args, kwargs, B, i, idx, batch_out, cots, params, refs, findings)
            ref_calls.append(recorder.restart())
    finally:
        recorder.close()
    if findings and all(f.check == "batch of one" for f in findings):
        _free(records)
        return findings
    # the engine's per-sample gradients (with the learned layouts) and its clipping mode's weighted sum
    learned = layout.learn(ref_calls, _batch_calls(records), B) if len(ref_calls) == len(indices) else {}
    changed = False
    try:
        kept, found, changed = _apply_layouts(records, learned, B)
        findings += found
        rows, total, weights = _engine_sums(engine, kept, params, indices, B, gen)
    except (torch.OutOfMemoryError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - the real pass raises the same error (with the size rule: see below)
        f = _engine_failed(e)
        if changed:  # the learned layout changed the records: the real pass may not raise it, so refuse here
            f.check = "per-sample replay with the learned layout"
        return [*findings, f]
    finally:
        _free(records)
    engine._capture.probe.learned = learned
    findings += _compare(engine, names, params, indices, rows, refs, total, weights)
    if findings:  # layers whose rows did not follow the batch: suspects for the fallback, as expanded outputs are
        engine._capture.probe.broadcast.extend(layers[k] for k in _no_batch_dim(layer_calls, ref_calls, B))
    return findings


def _model_raises(engine: Any, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  findings: list[Finding]) -> bool:
    """Whether every finding is a failed engine pass and the model, on the same batch with every engine hook inert
    (nothing expanded), raises the same error: then the failure is the model's own (a wrong call), not a sign of
    mixed samples, and the real pass is left to raise it, not a :class:`StructureError` naming no parameter."""
    if not findings or any(f.check != _ENGINE_FAILED for f in findings):
        return False
    try:
        _restore_buffers(engine._capture.probe.buffers)
        with _Inert(engine):
            model(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - compared with the engine pass's error
        return all(f.detail == f"{type(e).__name__}: {e}" for f in findings)
    return False


def _batch_lost(engine: Any, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], B: int) -> bool:
    """The engine pass (which expanded broadcast outputs) returned no output of leading size ``B``: whether the
    model has per-sample outputs at all, i.e. whether on sample 0 alone (hooks inert, no grad) a floating output of
    leading size 1 sits where the engine pass's output had another leading size. A model that returns only a scalar
    (a loss computed inside it) has nothing to verify, as before."""
    a_0, k_0 = _slice(args, kwargs, B, 0)
    try:
        _restore_buffers(engine._capture.probe.buffers)
        with _Inert(engine), torch.no_grad():
            leaves = tree_flatten(model(*a_0, **k_0))[0]
    except Exception:  # noqa: BLE001 - the model fails on a batch of one: not this finding
        return False
    got = engine._capture.probe.out_leaves
    return len(leaves) == len(got) and any(
        isinstance(y, torch.Tensor) and y.is_floating_point() and y.dim() >= 1 and y.shape[0] == 1
        and s is not None and (len(s) == 0 or s[0] != B) for y, s in zip(leaves, got, strict=True))


def _no_batch_dim(on_batch: dict[tuple[int, int], layout.CallShapes],
                  on_one: list[dict[tuple[int, int], layout.CallShapes]], B: int) -> set[int]:
    """``id``s of the layer-kind modules with a call whose first input had leading size ``B`` on the batch and the
    same on every batch of one: its rows do not follow the batch (a tensor built from buffers or parameters whose
    leading size equals the batch size by coincidence, as timm's relative-position MLP's ``(3, 3, 2)`` table at
    ``B = 3``); the engine took them as the samples' rows."""
    def lead(call: layout.CallShapes | None) -> int | None:
        first = next((s for s in call.shapes_in if s is not None), None) if call is not None else None
        return first[0] if first else None

    return {key[0] for key, call in on_batch.items()
            if B >= 2 and lead(call) == B and on_one and all(lead(r.get(key)) == B for r in on_one)}


def _sub_batches(records: list[Any], B: int) -> list[tuple[nn.Module, int]]:
    """Layer-kind calls of the engine pass that saw more than one row but neither ``B`` rows nor a multiple of ``B``
    (a fold, which :func:`fastdp.capture_fold.fold_of` judges): ``(module, rows)``."""
    out = []
    for rec in records:
        if rec.kind is GENERIC:
            continue
        try:
            n = rec.batch if rec.psg is not None else rec.kind.batch_size(rec.activation, rec.grad_output)
        except Exception:  # noqa: BLE001 - no batch size to read: not a part of the batch (the sums judge it)
            continue
        if n is not None and 1 < n and n != B and (n < B or n % B):
            out.append((rec.module, n))
    return out


def _nonfinite_data(engine: Any, findings: list[Finding]) -> bool:
    """Whether every finding is the engine's pass refusing a sample with non-finite gradients while the engine's
    policy gives such samples factor 0 (``on_nonfinite="zero"``, or a GradScaler's overflow): a fact about this
    batch's data, not about the model's structure."""
    return (engine.clip_config.on_nonfinite in ("zero", "scaler")
            and all(f.check == _ENGINE_FAILED and f.detail.startswith(f"{NonFiniteGradientError.__name__}:")
                    for f in findings))


def _engine_failed(e: BaseException) -> Finding:
    logger.info("structure probe: the engine's pass failed (%s: %s)", type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "")
    hint = ""
    if any(f.filename.replace("\\", "/").endswith("/cache_utils.py") for f in traceback.extract_tb(e.__traceback__)):
        hint = (" [raised inside transformers' key/value cache: the model updates a cache in its forward, which a "
                "per-sample replay repeats; call it with use_cache=False for training]")
    return Finding(_ENGINE_FAILED, "", math.inf, detail=f"{type(e).__name__}: {e}{hint}",
                   params=tuple(getattr(e, "fastdp_params", ())))


def _free(records: list[Any]) -> None:
    for r in records:
        r.ctx = None


def _batch_calls(records: list[Any]) -> dict[tuple[int, int], layout.CallShapes]:
    """The shapes of the engine pass's generic owner calls (inputs; hooked outputs as the engine kept them)."""
    out = {}
    for rec in records:
        call = rec.activation
        if rec.kind is GENERIC and not call.expanded and call.call_index >= 0:
            spec_in, shapes_in = layout.shapes((call.args, call.kwargs))
            out[(id(rec.module), call.call_index)] = layout.CallShapes(
                spec_in, shapes_in, "", {j: tuple(o.shape) for j, o in zip(call.leaf_index, call.outputs, strict=True)})
    return out


def _apply_layouts(records: list[Any], learned: dict[tuple[int, int], layout.OwnerLayout],
                   B: int) -> tuple[list[Any], list[Finding], bool]:
    """Give the engine pass's generic records the learned layouts, as the real pass's calls get them: shared inputs
    are not sliced per sample; an output learned to have no batch dimension is not hooked. Returns the records left
    (a call left without hooked outputs is dropped: the real pass refuses it at its forward), findings (a gradient
    that reached such an output, such a call: the real pass would refuse them) and whether anything changed."""
    findings, kept, changed = [], [], False
    for rec in records:
        call = rec.activation
        lay = None if rec.kind is not GENERIC or call.expanded else learned.get((id(rec.module), call.call_index))
        if lay is None:
            kept.append(rec)
            continue
        dims = generic.capture_inputs(call.args, call.kwargs, B, rec.module, shared=lay.shared_in,
                                      fold=call.in_fold)[2]
        changed |= tree_flatten(dims)[0] != tree_flatten(call.in_dims)[0]
        call.in_dims = dims
        drop = [k for k, j in enumerate(call.leaf_index) if j in lay.shared_out]
        changed |= bool(drop)
        for k in reversed(drop):
            g = call.grads[k]
            if g is not None and bool(g.any()):
                findings.append(Finding("output without batch dimension", repr(call.label), math.inf, detail=(
                    f"output {call.leaf_index[k]} of {call.label!r} has the same shape on a batch of one (its leading "
                    f"size is {B} by coincidence) and received a gradient, which cannot be attributed to samples")))
            for lst in (call.leaf_index, call.outputs, call.grads, call.out_dims):
                if k < len(lst):
                    del lst[k]
        if call.leaf_index:
            kept.append(rec)
        else:
            findings.append(Finding("output without batch dimension", repr(call.label), math.inf, detail=(
                f"module {call.label!r} owns trainable parameters {sorted(call.names)} but none of its outputs has a "
                f"batch dimension (their leading size is {B} by coincidence: the same shape on a batch of one), so "
                "their gradients cannot be attributed to samples; freeze them, or return per-sample outputs")))
    return kept, findings, changed


def _reference(engine: Any, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], B: int, i: int,
               idx: list[int], batch_out: list[torch.Tensor], cots: list[torch.Tensor], params: list[nn.Parameter],
               refs: dict[int, list[torch.Tensor | None]], findings: list[Finding]) -> None:
    """The model on sample ``i`` alone, every engine hook inert: its outputs against row ``i`` of the batch's, and
    the gradient ``r_i`` of ``sum_j <V_j[i], y_j(x_i)>`` into ``refs[i]``; disagreements into ``findings``."""
    a_i, k_i = _slice(args, kwargs, B, i)
    try:
        _restore_buffers(engine._capture.probe.buffers)
        with _Inert(engine):
            out_i = model(*a_i, **k_i)
            leaves_i = tree_flatten(out_i)[0]
            ys = [leaves_i[j] if j < len(leaves_i) else None for j in idx]
            shapes_ok = all(isinstance(y, torch.Tensor) and y.requires_grad and tuple(y.shape) == (1, *p.shape[1:])
                            for y, p in zip(ys, batch_out, strict=True))
            if not shapes_ok:
                got = [tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__ for y in ys]
                findings.append(Finding("batch of one", "", math.inf, i,
                                        f"outputs {got} on a batch of one, expected leading size 1 and the "
                                        f"batch's other sizes {[tuple(p.shape) for p in batch_out]}"))
                return
            for j, y, p in zip(idx, ys, batch_out, strict=True):
                err = _out_err(y, p[i:i + 1])
                if err > _rtol(p.dtype):
                    findings.append(Finding("output", f"leaf {j}", err, i, "sample alone != its row in the batch"))
            refs[i] = _grads(_dot([c[i:i + 1] for c in cots], ys), params)
    except Exception as e:  # noqa: BLE001 - reported as the finding
        findings.append(Finding("batch of one", "", math.inf, i,
                                f"the model fails on a batch of one sample: {type(e).__name__}: {e}"))


def _compare(engine: Any, names: list[str], params: list[nn.Parameter], indices: list[int],
             rows: dict[int, list[torch.Tensor | None]], refs: dict[int, list[torch.Tensor | None]],
             total: list[torch.Tensor | None], weights: dict[int, float]) -> list[Finding]:
    """c. The engine's per-sample gradients and weighted sum against the references."""
    findings: list[Finding] = []
    # c. compare; a parameter whose gradients are mathematically ~0 (a key bias under softmax) is compared with an
    # absolute floor of _FLOOR times the largest per-sample gradient norm of any parameter
    norms = [float(t.detach().double().norm()) for r in (*rows.values(), *refs.values()) for t in r
             if t is not None]
    floor = _FLOOR * max(norms or [0.0])
    # every per-sample gradient at rounding level (e.g. a LayerNorm over positions whose inputs are all equal: its
    # output is 0 and so is every gradient through it): nothing can be compared; the signature is probed again
    noise = _NOISE * max(torch.finfo(p.dtype).eps if p.is_floating_point() else 0.0 for p in params) * max(
        [1.0] + [float(p.detach().abs().max()) for p in params if p.numel()])
    if max(norms or [0.0]) <= noise:
        engine._capture.probe.inconclusive = True
        return []
    for k, (n, p) in enumerate(zip(names, params, strict=True)):
        zero = torch.zeros(p.shape, dtype=torch.float64, device=p.device)

        def val(t: torch.Tensor | None, zero: torch.Tensor = zero) -> torch.Tensor:
            return zero if t is None else t.detach().double().reshape(zero.shape)

        eng = {i: val(rows[i][k]) for i in indices}
        ref = {i: val(refs[i][k]) for i in refs}
        scale = max([float(t.norm()) for t in (*eng.values(), *ref.values())] + [floor])
        rtol = _rtol(p.dtype)
        for i in ref:
            err = _rel(eng[i], ref[i], scale)
            if err > rtol:
                findings.append(Finding("per-sample gradient", repr(n), err, i))
        if len(ref) == len(indices):  # the clipping mode's own weighted sum against the references
            s_ref = sum((weights[i] * ref[i] for i in indices), zero)
            err = _rel(val(total[k]), s_ref, max(float(s_ref.norm()), scale))
            if err > rtol:
                findings.append(Finding(f"weighted sum ({engine.clipping_mode})", repr(n), err))
    return findings


def _rtol(dtype: torch.dtype) -> float:
    """The tolerance of ``dtype``, or of the autocast dtype when autocast is on (the forward then rounds to it)."""
    tol = _PROBE_RTOL.get(dtype, 5e-3)
    for _, ac in autocast_state():
        tol = max(tol, _PROBE_RTOL.get(ac, 1e-1))
    return tol


def _cotangent(y: torch.Tensor, j: int) -> torch.Tensor:
    """A seeded standard-normal cotangent for the batched output ``y``, drawn on ``y``'s device in its dtype. (Drawn
    in float64 on the CPU and copied, a language model's logits, B x T x vocab, took ~12 s on the host per probe:
    411M numbers for GPT-2 at T 512, batch 16.)"""
    gen = torch.Generator(device=y.device).manual_seed(_SEED + j)
    return torch.randn(y.shape, generator=gen, device=y.device, dtype=y.dtype)


def _engine_pass(engine: Any, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 B: int) -> tuple[Any, ...] | None:
    """The model with the engine's hooks capturing into a separate session; seeded cotangents on its batched
    outputs, backward. Returns ``(detached batched outputs, their leaf indices, cotangents, reached records, the
    private generator)``, or ``None`` if no output has a batch dimension."""
    params = list(engine._trainable.values())
    gen = torch.Generator().manual_seed(_SEED)
    saved_pending, saved_stats = engine._capture.pending, {k: dict(v) for k, v in engine.generic_stats.items()}
    saved_off = set(engine._capture.expand_off)
    engine._capture.pending = []
    records = []
    try:
        out = model(*args, **kwargs)
        leaves, idx = _batched_outputs(out, B)
        if not idx:
            engine._capture.probe.out_leaves = [tuple(y.shape) if isinstance(y, torch.Tensor) else None for y in leaves]
            engine._capture.probe.out_grad_leads = [
                y.shape[0] for y in leaves if isinstance(y, torch.Tensor) and y.is_floating_point() and y.dim() >= 1
                and y.requires_grad]
            return None
        ys = [leaves[j] for j in idx]
        cots = [_cotangent(y, j) for j, y in enumerate(ys)]
        keep = [t for t in (*engine._capture.anchors.values(), *params,
                            *(x for x in tree_flatten((args, kwargs))[0]
                              if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf))]
        saved_grads = [(t, None if t.grad is None else t.grad.clone()) for t in keep]
        try:
            torch.autograd.backward(ys, cots)
        finally:
            for t, g in saved_grads:
                t.grad = g
        records = [r for r in engine._capture.pending if r.reached]
    finally:
        engine._capture.pending = saved_pending
        engine.generic_stats.clear()
        engine.generic_stats.update(saved_stats)
        engine._capture.expand_off.clear()
        engine._capture.expand_off.update(saved_off)
    return [y.detach() for y in ys], idx, cots, records, gen


def _engine_sums(engine: Any, records: list[Any], params: list[nn.Parameter], indices: list[int], B: int,
                 gen: torch.Generator) -> tuple[Any, ...]:
    """From the engine pass's records: per-sample rows for ``indices`` and, by the engine's clipping mode, the sum
    weighted by random factors on ``indices`` (zero elsewhere)."""
    w = torch.zeros(B, dtype=torch.float64)
    w[indices] = torch.rand(len(indices), generator=gen, dtype=torch.float64) + 0.5
    weights = {i: float(w[i]) for i in indices}
    engine._capture.inert_depth += 1
    try:
        with clipping_precision():  # the engine's clipping math in float32, as in training (fastdp.layers.base)
            rows = _rows(records, engine.plan.param_of, params, indices)
            cfg = ClipConfig(mode=engine.clip_config.mode, clip_fn=lambda n, R: w.to(device=n.device, dtype=n.dtype),
                             thresholds=[1.0], group_of=dict.fromkeys(params, 0), mean_reduction=False,
                             on_nonfinite="raise")
            res = clipped_sums(records, engine.plan.param_of, cfg).sums if records else {}
        total = [res.get(p) for p in params]
    finally:
        engine._capture.inert_depth -= 1
    return rows, total, weights


def _rows(records: list[Any], param_of: dict[tuple[int, str], nn.Parameter], params: list[nn.Parameter],
          indices: list[int]) -> dict[int, list[torch.Tensor | None]]:
    """The engine's per-sample gradients of samples ``indices`` from the records (summed over a parameter's uses):
    kept per-sample gradients (instantiated on arrival) are indexed; a layer kind's call is instantiated on those
    rows only (its kept input and output gradient sliced); a generic owner's replay runs in full and is kept in
    ``rec.ctx`` for the clipped sum that follows."""
    acc: dict[nn.Parameter, torch.Tensor] = {}
    for rec in records:
        idx = None
        if rec.psg is not None:
            got = {n: g for n, g in rec.psg.items()}
        elif not rec.kind.replayable:
            rec.ctx = rec.kind.prepare(rec.module, rec.activation, rec.grad_output)
            got = {n: rec.kind.per_sample_grad(rec.module, rec.ctx, n) for n in rec.names}
        else:
            idx = torch.tensor(indices, device=rec.grad_output.device)
            act = rec.activation
            if isinstance(act, torch.Tensor) and act.dim() >= 1 and act.shape[0] == rec.grad_output.shape[0]:
                act = act.index_select(0, idx.to(act.device))
            grad = rec.grad_output.index_select(0, idx)
            ctx = rec.kind.prepare(rec.module, act, grad)
            got = {n: rec.kind.per_sample_grad(rec.module, ctx, n) for n in rec.names}
        for n, g in got.items():
            g = g if idx is not None else g[indices]
            p = param_of[(id(rec.module), n)]
            acc[p] = acc[p] + g if p in acc else g
    return {i: [acc[p][k] if p in acc else None for p in params] for k, i in enumerate(indices)}


def _labels(model: nn.Module, modules: Sequence[nn.Module]) -> list[str]:
    """The names of ``modules`` in ``model`` (``<root>`` for the model), sorted, without repeats."""
    name_of = {id(m): n or "<root>" for n, m in model.named_modules()}
    return sorted({name_of[id(m)] for m in modules if id(m) in name_of})


def _user_grad_hooks(engine: Any, p: torch.Tensor) -> list[Any]:
    """The gradient hooks on ``p`` other than the engine's own (its outside-use check: ``Capture._outside_use``)."""
    return [h for h in grad_hooks(p)
            if not (isinstance(h, partial) and getattr(h.func, "__self__", None) is engine._capture)]


def _message(engine: Any, findings: list[Finding], B: int, sig: tuple[Any, ...], random_ops: set[str],
             suspects: Sequence[str] = (), fell_back: bool = False) -> str:
    owner = {n: (n.rpartition(".")[0] or "<root>") for n in engine._trainable}
    worst = sorted(findings, key=lambda f: -f.error)[:5]
    params = sorted({f.where.strip("'") for f in findings if f.where.strip("'") in owner}
                    | {n for f in findings for n in f.params if n in owner})
    if not params and suspects:  # a pass failed: the expanded modules' parameters are the ones at stake
        params = sorted(n for n in owner if owner[n] in suspects)
    modules = sorted({owner[n] for n in params} | set(suspects))
    hooked = [n for n in params if _user_grad_hooks(engine, engine._trainable[n])]
    hooks = (f"\nParameters {hooked[:8]} have gradient hooks (Tensor.register_hook, as peft's OSF adapter registers): "
             "the engine computes their per-sample gradients itself, so the hooks do not run on them, while the "
             "batch-of-one reference runs them. Remove the hooks or freeze those parameters." if hooked else "")
    retry = (", and replaying those modules' parameters per sample from their ancestors, up to the whole model, did "
             "not pass either" if fell_back else "")
    exp = (f"\nModules {list(suspects)[:8]} do not see the batch as the engine assumes: it expanded their outputs of "
           f"leading size 1 to the batch size {B} (taken as one value shared by the batch), or they saw fewer rows "
           f"than the batch{retry}. An output of leading size 1 that is a part of the batch (a chunk of one sample, "
           "x.chunk(2) of an odd batch) or is combined with the batch along dimension 0 (torch.cat) is not a "
           "broadcast value, and the rows of a part of the batch are not the samples' rows." if suspects else "")
    lines = "\n".join(f"  - {f.line()}" for f in worst)
    more = f" (and {len(findings) - len(worst)} more)" if len(findings) > len(worst) else ""
    rnd = (f"\nRandom operations other than dropout ran in forward ({sorted(random_ops)}); the probe was retried in "
           "eval mode and still disagreed." if random_ops else "")
    return (
        f"structure probe: the engine's per-sample gradients of this model do not match a brute-force batch-of-one "
        f"computation (batch size {B}), so training would not be private as stated. Parameters: "
        f"{params[:8]}{'...' if len(params) > 8 else ''}; modules: {modules[:8]}{'...' if len(modules) > 8 else ''}.\n"
        f"Evidence{more}:\n{lines}{rnd}{exp}{hooks}\n"
        "Likely causes: the batch axis is not the first dimension of the model's first tensor input (a "
        "sequence-first model: pass batch_first inputs); the model mixes samples (x.chunk/split over the batch, "
        "BatchNorm, reordering or any cross-sample operation); a forward hook changes a layer's output; an output of "
        "a layer is used without its batch dimension (e.g. emb(position_ids)[0]), or a tensor built inside the "
        "model has a leading size equal to the batch size by coincidence (arange(T) with T == batch size: use "
        "position_ids of shape (1, T) or (B, T)).\n"
        "Fix: keep the batch dimension first and every sample's computation independent of the others' (and the "
        "probe then passes), or freeze the parameters named above. PrivacyEngine(verify_structure=False) turns this "
        f"check off, at the risk of silently wrong per-sample clipping. (input signature: {sig[1]})")
