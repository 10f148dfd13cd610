"""Structure probe: verify, once per input signature, that the engine's per-sample gradients are the model's.

The engine *assumes* the per-sample structure of a model: a tensor is batched iff its leading size is the batch size
``B`` (the leading size of the model's first tensor input), and a layer output of leading size 1 is one value shared
by the batch (it is expanded to ``(B, ...)``). Where the assumption is false (a sequence-first model, a model that
splits or reorders its batch, a forward hook that rescales a layer's output, a broadcast output indexed with
``[0]``, a position table read with ``arange(T)`` when ``T == B``) the per-sample gradients would be silently wrong.
The probe checks the assumption against a brute-force computation instead of trusting it.

(Four modules: this one holds the state machine -- when to probe, the retries, the fallback, the verdict; the
passes, the comparison, their tolerances and the determinism are in :mod:`fastdp.probe_passes`; how a pass that
neither agreed nor disagreed is read (non-finite samples, a part of the batch, a lost batch dimension) in
:mod:`fastdp.probe_verdicts`; the refusal's message is in :mod:`fastdp.probe_message`.)

**When.** From the model's root forward pre-hook, before the user's forward runs, when grad is enabled, ``B >= 1``
and the call's :func:`signature` is new. The signature holds, per tensor leaf of ``(args, kwargs)``: its position,
ndim, dtype, whether its leading size is ``B``, which other dimensions equal ``B``, which dimensions are 1; plus
grad mode, autocast state and the model's training flag -- not the exact sizes, so Poisson batch sizes and padded
lengths do not re-probe, but a new coincidence (``T == B``) is a new signature and is probed then. A verified
signature is probed once more at the first call with another batch size (``SIZES_PER_SIGNATURE``: two sizes): what
a model does to the rows can depend on the batch size, which the signature does not fix (rows rolled by a constant 4
are the identity at ``B = 2``). That second probe's fold rules, data-chosen rows and learned layouts add to the
first's; if it is inconclusive or postponed, the first size's stay, the call is unverified (as a first size's would
be: a fold there is refused), and the next new size is probed.

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
  calls) is checked only on the probed calls' inputs; randomness other than dropout is checked only as far as the
  eval-mode retry reaches. That includes rows that depend on the batch size in a way both probed sizes hide (rows
  rolled by a constant that is a multiple of both).
* Samples other than the probe samples (0 and ``B - 1``) are not checked: a structural mistake that spares both
  (e.g. mixing only samples 1 and 2) passes. (A full-batch plain pass would check the sum over all samples, at about
  one more step's cost: left out to keep the probe under 2 % of a 100-step run.)

``verify_structure=False`` on the engine turns the probe off (then these failures are silent again).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
from torch import nn

from fastdp.layers import checkpointing, layout
from fastdp.layers.base import autocast_state
from fastdp.plan import trainable_change
from fastdp.probe_message import _message
from fastdp.probe_passes import (
    _ENGINE_FAILED,
    _LOST_BATCH,
    _NO_BATCH_OUT,
    _SUB_BATCH,
    DeterministicDropout,
    Finding,
    _apply_layouts,
    _batch_calls,
    _compare,
    _engine_failed,
    _engine_pass,
    _engine_sums,
    _free,
    _labels,
    _probe_indices,
    _reference,
    _restore_buffers,
)
from fastdp.probe_verdicts import _batch_lost, _model_raises, _no_batch_dim, _nonfinite_data, _sub_batches
from fastdp.torch_api import ieee_float32, tree_flatten, tree_map

logger = logging.getLogger(__name__)

#: batch sizes at which each input signature is verified: its first call's, and the first other size it is called
#: with (an operation whose effect on the rows depends on the batch size, which a signature does not fix, e.g. rows
#: rolled by a constant that is a multiple of the first size, is then probed at a second size). Read at call time.
SIZES_PER_SIGNATURE = 2


class StructureError(RuntimeError):
    """The engine's per-sample gradients of this model do not match a batch-of-one computation (see
    :mod:`fastdp.probe`): training would not be private as stated, so the engine refuses."""


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


def maybe_probe(engine: Any, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], B: int,
                sig: tuple[Any, ...] | None = None) -> None:
    """Run the probe if this call's signature ``sig`` (:func:`signature`, computed here if not given) is new (see
    the module docstring); raise :class:`StructureError` on a mismatch. Called by the engine's root forward
    pre-hook."""
    if sig is None:
        sig = signature(args, kwargs, B, model.training)
    verified_at = engine._capture.probe.sizes.get(sig, set())
    again = sig in engine._capture.probe.seen  # verified at another batch size: probed at a second one
    if again and (B in verified_at or len(verified_at) >= SIZES_PER_SIGNATURE):
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
    if not again:  # (a second batch size adds to what the first one saw)
        engine._capture.probe.folds.pop(sig, None)  # the fold factors its engine pass sees (fastdp.capture)
        engine._capture.probe.chooses.discard(sig)  # and whether it sees rows chosen by the data (capture_fold)
    engine._capture.probe.broadcast, engine._capture.probe.outside = [], []
    broadcast = engine_failed = False
    retry: tuple[list[int] | None, str] = (None, "raise")  # the probe samples and policy of a retry (non-finite)
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
            if findings and _nonfinite_data(engine, findings):
                # the engine's pass refused samples with non-finite gradients, which the engine's policy zeroes in
                # the real pass: probe again on the other samples, with that policy (the structure at this batch
                # size is read from them; the probe is postponed only when none is left)
                bad = {i for f in findings for i in f.samples}
                good = [i for i in range(B) if i not in bad]
                if bad and good:
                    logger.info("structure probe: samples %s of the batch have non-finite gradients; probing samples "
                                "%s instead", sorted(bad)[:10], sorted({good[0], good[-1]}))
                    engine._capture.probe.broadcast, engine._capture.probe.outside = [], []
                    engine._capture.probe.inconclusive = False
                    retry = (sorted({good[0], good[-1]}), "zero")
                    with DeterministicDropout():
                        findings = _run(engine, model, args, kwargs, B, *retry)
            broadcast = bool(engine._capture.probe.broadcast)
            engine_failed = bool(engine._capture.probe.outside)  # the real pass raises the outside use itself
            suspects = _labels(model, engine._capture.probe.broadcast)
            if findings and _nonfinite_data(engine, findings):
                logger.info("structure probe postponed: a sample of this batch has non-finite gradients "
                            "(on_nonfinite=%r); the signature is probed again at its next call",
                            engine.clip_config.on_nonfinite)
                findings = None
            elif findings and (broadcast or engine_failed):
                fell_back = _fallback(engine, model, args, kwargs, B, *retry)
                if fell_back:
                    findings = []
                    _forget_others(engine, sig)
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
        at = f" at batch size {B} (verified at {sorted(verified_at)})" if again else ""
        unverified[sig] = (f"its engine pass raised{at} {first}" if first else f"it was postponed{at}: a sample of "
                           "the batch had non-finite gradients, or the model raised")
        if again:  # verified at another batch size: its layouts stay; probed again at the next new size
            engine._capture.owner_layouts.start(sig)
        return
    if findings:
        raise StructureError(_message(engine, findings, B, sig, random_ops, suspects, fell_back is False,
                                      sorted(verified_at)))
    if engine._capture.probe.inconclusive:
        unverified[sig] = "every per-sample gradient of the batch was at rounding level" + (
            f" at batch size {B} (verified at {sorted(verified_at)})" if again else "")
        if again:
            engine._capture.owner_layouts.start(sig)
        else:
            engine._capture.owner_layouts.by_signature.pop(sig, None)
        logger.info("structure probe inconclusive (batch %d): every per-sample gradient is at rounding level; the "
                    "signature is probed again at its next call%s", B, " with a new batch size" if again else "")
        return
    unverified.pop(sig, None)
    engine._capture.probe.seen.add(sig)
    engine._capture.probe.sizes.setdefault(sig, set()).add(B)
    # a second size's layouts add to the first's (a call its probe samples did not see alike keeps the first's)
    engine._capture.owner_layouts.by_signature[sig] = {
        **((engine._capture.owner_layouts.by_signature.get(sig) or {}) if again else {}),
        **engine._capture.probe.learned}
    engine._capture.owner_layouts.start(sig)
    stats["signatures"] = len(engine._capture.probe.seen)
    logger.info("structure probe passed (batch %d%s, %d probe samples, %.3fs)", B,
                f", the signature's second batch size after {sorted(verified_at)}" if again else "",
                len(_probe_indices(B)), time.perf_counter() - t0)


def _forget_others(engine: Any, sig: tuple[Any, ...]) -> None:
    """The fallback changed the owners: what the probe verified for the other input signatures (their sizes, fold
    rules, the old owners' learned layouts) was about the old owners, so each is probed again at its next call.
    (Kept, a signature whose ``B`` equals a sequence length met the new owner without a layout: its replay failed.)"""
    st = engine._capture.probe
    for other in [k for k in st.seen if k != sig]:
        st.seen.discard(other)
        st.sizes.pop(other, None)
        st.folds.pop(other, None)
        st.chooses.discard(other)
        engine._capture.owner_layouts.by_signature.pop(other, None)
    engine.probe_stats["signatures"] = len(st.seen)


def _fallback(engine: Any, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], B: int,
              indices: list[int] | None = None, on_nonfinite: str = "raise") -> bool | None:
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
            findings = _run(engine, model, args, kwargs, B, indices, on_nonfinite)
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
         B: int, indices: list[int] | None = None, on_nonfinite: str = "raise") -> list[Finding]:
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
        rows, total, weights = _engine_sums(engine, kept, params, indices, B, gen, on_nonfinite)
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
