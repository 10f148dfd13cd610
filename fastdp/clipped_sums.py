"""The clipped sum ``sum_i C_i g_i`` per parameter, once a backward pass is complete.

Input: the *records* of one backward pass (:mod:`fastdp.records`). Output: ``sum_i C_i g_i`` per trainable
parameter, where ``g_i`` is sample ``i``'s gradient of its own loss and ``C_i`` its clipping factor for the
parameter's group. The three steps of the clipping stage (Bu et al. 2023, "book-keeping"; Li et al. 2021, "ghost
clipping"):

1. per-sample squared norms per parameter (:mod:`fastdp.norms`);
2. per clipping group ``k``: ``n_ik = sqrt(sum over the group's parameters of ||g_i||^2)`` and
   ``C_ik = clip_fn(n_ik, R_k)`` (:mod:`fastdp.clipping`);
3. per parameter: ``sum_i C_ik g_i`` -- from kept per-sample gradients (``einsum``), from one contraction of
   activations and output gradients (book-keeping), or, in ``"ghost"`` mode, by a second, layer-local autograd
   backward of ``sum_i C_i L_i`` (GhostClip).

The captured gradients are those of the user's loss. With ``loss_reduction="mean"`` that loss is
``(1/B) sum_i L_i``, so every captured gradient is ``1/B`` times the per-sample one: norms are multiplied by ``B``
and so are the factors applied to the captured tensors. Sums go to the release stage (:mod:`fastdp.release`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from fastdp.clipping import ClipFn
from fastdp.deferred import DeferredCheck, defers
from fastdp.layers import _guard_batch
from fastdp.layers._grams import shared_input_grams
from fastdp.layers._matmul import reused_scratch, shared_rounding
from fastdp.layers._rounding import Exact
from fastdp.layers.base import accumulation_dtype, to_accumulation
from fastdp.modes import ClippingMode
from fastdp.norms import batch_size_of, norm_sq, per_sample_grad, shared_norm_sq, use_ghost
from fastdp.records import Record


@dataclass
class ClipConfig:
    """What :func:`clipped_sums` needs besides the records."""

    mode: ClippingMode
    clip_fn: ClipFn
    thresholds: Sequence[float]  # R_k per group
    group_of: dict[nn.Parameter, int]  # parameter -> group index
    mean_reduction: bool
    on_nonfinite: str = "raise"  # "raise" or "zero" (clipping factor 0 for samples with non-finite gradients)
    #: the loss scale ``S`` of the backward pass (``torch.amp.GradScaler``, :mod:`fastdp.amp`), read at the end of
    #: each pass; ``None``: 1. The captured gradients are ``S`` times the loss's, so norms and factors divide by it.
    loss_scale: Callable[[], float | torch.Tensor] | None = None
    count_unclipped: bool = False  # count samples with ||g_i|| <= R_0 (adaptive clipping, fastdp.adaptive)


class NonFiniteGradientError(RuntimeError):
    """Some sample's per-sample gradient contains NaN or infinity."""


def nonfinite_step_error(step: int, where: list[str]) -> NonFiniteGradientError:
    """The error of a step refused by the deferred non-finite check (:mod:`fastdp.deferred`); ``where`` names the
    samples and backward passes."""
    return NonFiniteGradientError(
        f"step {step}: the per-sample gradients of {'; '.join(where)} of this step (positions in each physical "
        "batch) contain NaN or infinity (or a layer's input or output gradient of about 1e19 or more, where squared "
        "norms overflow float32). Nothing was released and this step's gradients were discarded: run the "
        "step's backward passes again. Fix the model or data (e.g. a log of 0, an overflow in half precision), or "
        "build the engine with on_nonfinite='zero' to give such samples clipping factor 0 (still private). (On an "
        "accelerator this check runs when the step is released, so that the backward pass never waits for the "
        "device.)")


@dataclass
class BackwardResult:
    """What one backward pass contributes: ``sum_i C_i g_i`` per parameter, the number of samples, and how many of
    them had non-finite gradients (given clipping factor 0 under ``on_nonfinite="zero"``)."""

    sums: dict[nn.Parameter, torch.Tensor]
    batch_size: int
    #: (a 0-dim int64 tensor on the device when counted without a host read: ``on_nonfinite="zero"`` on an
    #: accelerator; the release reads it once per step)
    nonfinite: int | torch.Tensor = 0
    #: id(parameter) -> how its per-sample norm was computed ("ghost", "instantiated", "generic"; "shared" added
    #: for a parameter with several uses), for :meth:`fastdp.plan.Plan.describe`
    norms: dict[int, str] = field(default_factory=dict)
    #: samples with total norm ``||g_i|| <= R`` (only with ``ClipConfig.count_unclipped``: adaptive clipping)
    unclipped: int | torch.Tensor = 0  # a 0-dim int64 tensor on the norms' device when counted (no host sync)
    #: samples of this pass whose per-sample norm exceeded the threshold ``R_k`` of at least one clipping group: a
    #: 0-dim int64 tensor on the norms' device (no host sync), or ``None`` when no norm was computed. Computed from
    #: the raw norms, so it is a NON-PRIVATE diagnostic (:mod:`fastdp.clip_stats`).
    clipped: torch.Tensor | None = None
    #: ``(B,)`` bool on the norms' device, samples whose gradient has NaN/inf, when the check under
    #: ``on_nonfinite="raise"`` is deferred to the step's release (:func:`fastdp.deferred.defers`); else ``None``
    nonfinite_mask: torch.Tensor | None = None
    #: other checks of this pass whose verdict waits for the step's release (:mod:`fastdp.deferred`)
    deferred: list[DeferredCheck] = field(default_factory=list)


def _weighted_sum(coef: torch.Tensor, psg: torch.Tensor) -> torch.Tensor:
    """``sum_i coef_i psg_i``, shape ``psg.shape[1:]``: one vector-matrix product ``(B,) @ (B, n)`` (``einsum``
    parses its equation on every call, a fixed cost that dominates for bias-sized tensors)."""
    acc = accumulation_dtype(psg.dtype)
    B = psg.shape[0]
    return (coef.to(acc) @ psg.to(acc).reshape(B, -1 if B else math.prod(psg.shape[1:]))).view(psg.shape[1:])


def _add(out: dict[nn.Parameter, torch.Tensor], param: nn.Parameter, value: torch.Tensor) -> None:
    out[param] = out[param] + value if param in out else value


def _replay_grads(rec: Record, names: list[str], coef: torch.Tensor) -> dict[str, torch.Tensor]:
    """GhostClip's second backward, layer-local: gradients of ``sum_i coef_i <G_i, out_i>`` w.r.t. ``names``.

    In at least float32 and outside every autocast region (the clipping stage's numerics), from the kept input and
    output gradient cast up: the per-sample norms that gave ``coef`` were formed from the same tensors in the same
    precision, so ``||coef_i g_i|| <= R`` holds to float32 rounding. Replaying the forward's float16 or bfloat16
    autocast instead rounded ``coef_i G_i`` and the products to that dtype (subnormal at a small threshold): a
    sample's clipped gradient came out up to 1.6 R."""
    module = rec.module
    with torch.enable_grad():
        leaves = {n: to_accumulation(getattr(module, n).detach()).requires_grad_(True) for n in names}
        operand = getattr(rec.kind, "operand_activation", None)  # the input as the norms read it (bf16 products)
        act = rec.activation if operand is None else operand(rec.activation, rec.grad_output)
        g = to_accumulation(rec.grad_output)
        if rec.fold > 1:  # the module called on its rows as it saw them, each row weighted by its sample's coef
            act, g = rec.kind.fold_rows(act, rec.fold), rec.kind.fold_rows(g, rec.fold)
            coef = coef.repeat_interleave(rec.fold)
        out = functional_call(module, leaves, (to_accumulation(act),))
        # the product in float32: under a loss scale, coef is ~1/S and g ~S (either alone may leave float16's range)
        weights = (g * coef.to(g.dtype).view(-1, *([1] * (g.dim() - 1)))).to(out.dtype)
        grads = torch.autograd.grad(out, list(leaves.values()), grad_outputs=weights)
    return dict(zip(names, grads, strict=True))


def clipped_sums(records: list[Record], param_of: dict[tuple[int, str], nn.Parameter],
                 cfg: ClipConfig, stream: Any = None) -> BackwardResult:
    """``sum_i C_i g_i`` per parameter for one backward pass (see the module docstring).

    Args:
        records: the calls whose output gradients arrived in this backward pass. They are finished by this
            call: what they keep is freed as their sums are formed (book-keeping and kept per-sample
            gradients; GhostClip's replays keep theirs to the end).
        param_of: ``(id(module), attribute name) -> parameter``.
        cfg: clipping mode, function, per-group thresholds and groups, loss reduction, non-finite policy.
        stream: optional consumer of the sums as they are formed (:mod:`fastdp.sharding` reduce-scatters a sharded
            parameter's sum at once, so full-size sums do not pile up): ``stream.begin()`` is called once the
            norms and factors are computed (nothing can fail for non-finite gradients after it), then
            ``stream.take(param, sum)`` for each parameter's finished sum; a sum it takes (returns True) is not
            in the result.

    Returns:
        the clipped sums (parameter -> tensor of ``param.shape``, in at least float32) and the batch size.

    Raises:
        NonFiniteGradientError: a sample's gradient has NaN/inf and ``cfg.on_nonfinite == "raise"``.
    """
    if not records:
        return BackwardResult({}, 0)
    try:
        return _clipped_sums(records, param_of, cfg, stream)
    finally:
        for rec in records:
            rec.ctx = None


def _zero_rows(t: Any, bad: torch.Tensor) -> Any:
    """``t`` with the sample rows flagged ``bad`` (``(B,)`` bool) set to 0, by ``masked_fill`` with a Python 0 (no host
    read, no host-to-device copy of a CPU scalar tensor, which CUDA's sync debug mode reports; a new tensor, ``t`` is
    never changed); anything that is not a floating tensor with ``B`` rows is returned as is."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() == 0 or t.shape[0] != len(bad):
        return t
    return t.masked_fill(bad.view(-1, *([1] * (t.dim() - 1))), 0)


def _sanitize(rec: Record, bad: torch.Tensor) -> None:
    """Zero sample rows flagged ``bad`` in a record (its captured tensors, or a generic kind's gradients)."""
    def zero_rows(t: Any) -> Any:
        return _zero_rows(t, bad)

    if not rec.kind.replayable:  # generic: its context holds the per-sample gradients
        rec.ctx = {n: zero_rows(g) for n, g in rec.ctx.items()}
        return
    if rec.psg is not None:  # instantiated on arrival
        rec.psg = {n: zero_rows(g) for n, g in rec.psg.items()}
        return
    rec.grads = [zero_rows(g) for g in rec.grads]
    rec.activation = zero_rows(rec.activation)
    rec.ctx = None


def _kept_bytes(rec: Record) -> int:
    """Bytes of the tensors ``rec`` keeps (input, output gradients, per-sample gradients)."""
    held = [rec.activation, *rec.grads, *(rec.psg or {}).values()]
    return sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))


def _net_bytes(param: nn.Parameter, plist: list[tuple[Record, str]]) -> int:
    """What forming ``param``'s clipped sum adds to memory: its sum, less what its records keep. Step 3 forms the
    sums in increasing order of this (without a sharded stream, whose collectives keep the records' order on every
    rank), so a large sum over small kept tensors (an embedding table's, after token ids and a ``B x T x d``
    gradient) is formed after the layers whose drop makes room for it."""
    return param.numel() * param.element_size() - max(_kept_bytes(rec) for rec, _ in plist)


def _drop_kept(rec: Record) -> None:
    """Free what ``rec`` keeps (input, output gradients, per-sample gradients, prepared context) once its clipped
    sums are formed; the record is finished (its pass is summed)."""
    rec.summed = True
    rec.ctx = None
    rec.activation = None
    rec.psg = None
    rec.grads[:] = [None] * len(rec.grads)


def _norms(uses: dict[nn.Parameter, list[tuple[Record, str]]], mode: ClippingMode
           ) -> tuple[dict[nn.Parameter, torch.Tensor], dict[nn.Parameter, torch.Tensor], dict[int, str],
                      dict[nn.Parameter, Exact]]:
    """Step 1: ``||g_i||^2`` per parameter (``sq_of``), the instantiated per-sample gradients kept for step 3
    (``kept``), how each norm was formed (``how``, by ``id(param)``) and the samples of a ghost norm that rounding
    rules, taken out of the contraction (``exact``: :func:`fastdp.layers._rounding.exact_flagged`; in the replay
    mode such a parameter's sum is the contraction too)."""
    sq_of: dict[nn.Parameter, torch.Tensor] = {}
    kept: dict[nn.Parameter, torch.Tensor] = {}  # instantiated per-sample gradients kept for step 3
    how: dict[int, str] = {}
    exact: dict[nn.Parameter, Exact] = {}
    ghost: list[tuple] = []  # (param, its ghost norm's parts or reductions, factors_of, shape, positions)
    for param, plist in uses.items():
        shape = tuple(param.shape)
        if len(plist) > 1:  # shared parameter: norm of the per-sample sum over uses
            got = shared_norm_sq(plist, mode, shape)
            if got is not None:
                sq_of[param], ex = got
                if ex is not None:
                    exact[param] = ex
                how[id(param)] = "ghost (shared)"
                continue
            total = sum(per_sample_grad(r, n) for r, n in plist)
            sq_of[param] = norm_sq(total)
            kept[param] = total
            how[id(param)] = "instantiated (shared)"
            continue
        rec, name = plist[0]
        kind, module = rec.kind, rec.module
        if rec.psg is None and use_ghost(kind, module, rec.ctx, name, mode, rec.readers[0]):
            ctx = rec.ctx
            sq_of[param] = None  # (finished with the other ghost norms below; the order of sq_of kept)
            ghost.append((param, kind.ghost_norm_pieces(module, ctx, name),
                          lambda index, kind=kind, module=module, ctx=ctx, name=name: kind.sample_factors(
                              module, ctx, name, index), shape, kind.contraction_positions(module, ctx, name)))
            how[id(param)] = "ghost"
        else:
            how[id(param)] = "instantiated" if kind.replayable else "generic"
            psg = per_sample_grad(rec, name)
            sq_of[param] = norm_sq(psg)
            if mode.keeps_instantiated or not kind.replayable:
                kept[param] = psg
            else:  # the sum will contract the operands: guarded as a ghost norm is (range, cancellation)
                sq_of[param] = kind.guard_contracted(module, rec.ctx, name, sq_of[param])
    # the ghost norms' element-wise rest and guard, once per group of like parameters (fastdp/layers/_guard_batch.py)
    parts = _guard_batch.finish_all([g[1] for g in ghost])
    guarded = _guard_batch.exact_flagged_all([(*p, f, shape, positions)
                                              for p, (_, _, f, shape, positions) in zip(parts, ghost, strict=True)])
    for (param, *_), (sq, ex) in zip(ghost, guarded, strict=True):
        sq_of[param] = sq
        if ex is not None:
            exact[param] = ex
    return sq_of, kept, how, exact


def _clipped_sums(records: list[Record], param_of: dict[tuple[int, str], nn.Parameter],
                  cfg: ClipConfig, stream: Any = None) -> BackwardResult:
    B = batch_size_of(records)
    scale = float(B) if cfg.mean_reduction else 1.0
    if cfg.loss_scale is not None:  # captured gradients are S times the loss's: C_i from ||g_i|| = ||captured_i|| / S
        S = cfg.loss_scale()  # a 0-dim tensor on the device (no host read), or a float
        scale = scale / (S if isinstance(S, torch.Tensor) else float(S))
    mode = cfg.mode

    uses: dict[nn.Parameter, list[tuple[Record, str]]] = {}
    with shared_rounding():  # q, k, v of one block under bf16 products: one rounded input
        for rec in records:
            if rec.ctx is None and rec.psg is None:
                rec.ctx = rec.kind.prepare(rec.module, rec.activation, rec.grad_output)
            for name in sorted(rec.names):
                uses.setdefault(param_of[(id(rec.module), name)], []).append((rec, name))

    with shared_input_grams():  # q, k, v of one block: one input Gram
        sq_of, kept, how, exact = _norms(uses, mode)

    # Step 2: per-group norms and factors.
    group_sq: dict[int, torch.Tensor] = {}
    for param, sq in sq_of.items():
        k = cfg.group_of[param]
        group_sq[k] = group_sq[k] + sq if k in group_sq else sq
    nonfinite_mask: torch.Tensor | None = None  # the non-finite samples, checked when the step is released
    nonfinite_count: int | torch.Tensor = 0  # samples given factor 0 (a device tensor when not read here)
    zero: torch.Tensor | None = None  # samples whose rows step 3 zeroes (on_nonfinite "zero" on an accelerator)
    if group_sq:
        total_sq = sum(group_sq.values())
        bad = ~torch.isfinite(total_sq)
        if cfg.on_nonfinite == "raise" and defers(total_sq.device):
            nonfinite_mask = bad  # no host synchronisation here: Release checks it before anything is released
        elif cfg.on_nonfinite in ("zero", "scaler") and defers(total_sq.device):
            # no host synchronisation: whether or not a sample is bad, give the flagged samples norm 0 and let
            # step 3 zero their rows of each record just before it is summed (one record's copy at a time), as
            # the branch below does for the whole pass once it has seen one
            zero = bad
            group_sq = {k: sq.masked_fill(bad, 0) for k, sq in group_sq.items()}
            nonfinite_count = bad.sum()
        elif bool(bad.any()):
            idx = bad.nonzero().flatten().tolist()
            if cfg.on_nonfinite not in ("zero", "scaler"):
                err = NonFiniteGradientError(
                    f"the per-sample gradients of samples {idx[:10]}{'...' if len(idx) > 10 else ''} of this batch "
                    "(positions in the physical batch) contain NaN or infinity (or a layer's input or output "
                    "gradient of about 1e19 or more, where squared norms overflow float32). Nothing was released. "
                    "Fix the model or data (e.g. a log of 0, an overflow in half precision), or build the engine with "
                    "on_nonfinite='zero' to give such samples clipping factor 0 (still private).")
                err.fastdp_samples = tuple(idx)  # (the structure probe probes the other samples)
                raise err
            for rec in records:
                _sanitize(rec, bad)
            result = _clipped_sums(records, param_of, cfg, stream)
            return BackwardResult(result.sums, result.batch_size, len(idx), result.norms, result.unclipped,
                                  result.clipped)
    coefs: dict[int, torch.Tensor] = {}
    unclipped: int | torch.Tensor = 0
    over: torch.Tensor | None = None  # sample's norm > R_k in some group (the non-private clipped count)
    for k, sq in group_sq.items():
        norms = sq.clamp(min=0).sqrt() * scale
        coefs[k] = cfg.clip_fn(norms, cfg.thresholds[k]) * scale
        if cfg.count_unclipped:  # one group (all-layer): b_i = 1[||g_i|| <= R]
            unclipped = unclipped + (norms <= cfg.thresholds[k]).sum()  # a 0-dim tensor: no host sync
        above = norms > cfg.thresholds[k]
        over = above if over is None else over | above

    # Step 3: clipped sums. A record's kept tensors are dropped as soon as every parameter it serves has its sum,
    # so the sums take the place of the activations and output gradients instead of piling up on top of them.
    if stream is not None:
        stream.begin()
    out: dict[nn.Parameter, torch.Tensor] = {}
    replay: dict[Record, list[str]] = {}
    uses_left: dict[Record, int] = {}
    for plist in uses.values():
        for rec, _ in plist:
            uses_left[rec] = uses_left.get(rec, 0) + 1
    order = list(uses) if stream is not None else sorted(uses, key=lambda q: _net_bytes(q, uses[q]))
    zeroed: set[Record] = set()

    def ready(rec: Record) -> None:  # the flagged rows of a record zeroed before its first sum (once)
        if zero is not None and rec not in zeroed:
            zeroed.add(rec)
            _sanitize(rec, zero)
            if rec.kind.replayable and rec.psg is None:
                rec.ctx = rec.kind.prepare(rec.module, rec.activation, rec.grad_output)

    with reused_scratch():
        for param in order:
            plist = uses[param]
            coef = coefs[cfg.group_of[param]]
            if param in kept:
                psg = kept.pop(param)
                out[param] = _weighted_sum(coef, psg if zero is None else _zero_rows(psg, zero))
                del psg
            elif mode.sums == "replay" and param not in exact:  # (with samples taken apart: the contraction)
                for rec, name in plist:
                    replay.setdefault(rec, []).append(name)
                continue
            else:  # book-keeping: one contraction per use, summed over uses
                ex = exact.pop(param, None)  # samples taken apart: out of the contraction, their gradients summed
                for rec, name in plist:
                    ready(rec)
                    c = coef if ex is None else coef.index_fill(0, ex.index, 0)
                    _add(out, param, rec.kind.clipped_sum(rec.module, rec.ctx, name, c))
                if ex is not None:
                    _add(out, param, _weighted_sum(coef[ex.index], ex.grads).reshape(out[param].shape))
            for rec, _ in plist:
                uses_left[rec] -= 1
                if not uses_left[rec]:
                    _drop_kept(rec)
            if stream is not None and stream.take(param, out[param].to(accumulation_dtype(out[param].dtype))):
                del out[param]
    for rec, names in replay.items():
        ready(rec)
        by_group: dict[int, list[str]] = {}
        for n in names:
            by_group.setdefault(cfg.group_of[param_of[(id(rec.module), n)]], []).append(n)
        for k, group_names in by_group.items():
            for n, g in _replay_grads(rec, group_names, coefs[k]).items():
                _add(out, param_of[(id(rec.module), n)], g)
    if stream is not None and replay:
        replayed = {param_of[(id(rec.module), n)] for rec, names in replay.items() for n in names}
        for param in [q for q in out if q in replayed]:
            if stream.take(param, out[param].to(accumulation_dtype(out[param].dtype))):
                del out[param]
    clipped = None if over is None else over.sum()
    return BackwardResult({p: s.to(accumulation_dtype(s.dtype)) for p, s in out.items()}, B, nonfinite_count, how,
                          unclipped, clipped, nonfinite_mask=nonfinite_mask)
