"""Book-keeping: per-sample norms, clipping factors and the clipped sum, once a backward pass is complete.

Input: the *records* of one backward pass -- one per call of a hooked module, each with its kept activation and
the output gradient captured in the backward pass. Output: ``sum_i C_i g_i`` per trainable parameter, where
``g_i`` is sample ``i``'s gradient of its own loss and ``C_i`` its clipping factor for the parameter's group.

Steps (Bu et al. 2023, "book-keeping"; Li et al. 2021, "ghost clipping"):

1. Per parameter, ``||g_i||^2``: by the ghost norm or by instantiating ``g_i``, per clipping mode and the layer's
   cost model. A parameter used by several calls (a module called twice, a weight tied into two modules) gets the
   norm of its per-sample *sum* over all uses, from instantiated per-sample gradients.
2. Per clipping group ``k``: ``n_ik = sqrt(sum over the group's parameters of ||g_i||^2)`` and
   ``C_ik = clip_fn(n_ik, R_k)``.
3. Per parameter: ``sum_i C_ik g_i`` -- from kept per-sample gradients (``einsum``), from one contraction of
   activations and output gradients (book-keeping), or, in ``"ghost"`` mode, by a second, layer-local autograd
   backward of ``sum_i C_i L_i`` (GhostClip).

The captured gradients are those of the user's loss. With ``loss_reduction="mean"`` that loss is
``(1/B) sum_i L_i``, so every captured gradient is ``1/B`` times the per-sample one: norms are multiplied by ``B``
and so are the factors applied to the captured tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from fastdp.clipping import ClipFn
from fastdp.layers import _factored
from fastdp.layers.base import LayerKind, accumulation_dtype, replay_autocast

CLIPPING_MODES = ("BK-MixOpt", "BK-MixGhostClip", "BK-ghost", "ghost", "instantiate")


@dataclass(eq=False)
class Record:
    """One call of a hooked module: what the forward kept and what the backward delivered.

    ``grads`` holds one entry per hooked output (layer kinds have one output; generic owners may have several).
    """

    module: nn.Module
    kind: LayerKind
    names: frozenset[str]  # the module's trainable parameter names (paths relative to the module)
    activation: Any
    grads: list[torch.Tensor | None] = field(default_factory=lambda: [None])
    autocast: tuple[tuple[str, torch.dtype], ...] = ()
    ctx: Any = field(default=None, repr=False)
    #: per-sample gradients instantiated when the output gradient arrived (:func:`instantiate_on_arrival`); the
    #: activation and the output gradient are then dropped and ``batch`` holds the call's batch size
    psg: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    batch: int | None = None
    #: the engine's id of the model's forward call that made this record (records of a failed pass are dropped
    #: together with the other records of the same forward call)
    forward: int = -1

    @property
    def grad_output(self) -> torch.Tensor | None:
        return self.grads[0]

    @property
    def reached(self) -> bool:
        """Whether the backward pass delivered a gradient to any of the call's outputs."""
        return self.psg is not None or any(g is not None for g in self.grads)


@dataclass
class ClipConfig:
    """What :func:`clipped_sums` needs besides the records."""

    mode: str
    clip_fn: ClipFn
    thresholds: Sequence[float]  # R_k per group
    group_of: dict[nn.Parameter, int]  # parameter -> group index
    mean_reduction: bool
    on_nonfinite: str = "raise"  # "raise" or "zero" (clipping factor 0 for samples with non-finite gradients)


class NonFiniteGradientError(RuntimeError):
    """Some sample's per-sample gradient contains NaN or infinity."""


@dataclass
class BackwardResult:
    """What one backward pass contributes: ``sum_i C_i g_i`` per parameter, the number of samples, and how many of
    them had non-finite gradients (given clipping factor 0 under ``on_nonfinite="zero"``)."""

    sums: dict[nn.Parameter, torch.Tensor]
    batch_size: int
    nonfinite: int = 0


def use_ghost(kind: LayerKind, module: nn.Module, ctx: Any, name: str, mode: str) -> bool:
    """Whether parameter ``name`` of a call gets its per-sample norm from the ghost norm (else by instantiation).

    * ``"BK-ghost"``, ``"ghost"``: always, where the kind has a ghost norm; ``"instantiate"``: never.
    * ``"BK-MixGhostClip"``: the paper's cost model, ghost when ``2 T^2 < p d`` (:meth:`LayerKind.prefers_ghost`).
    * ``"BK-MixOpt"`` (default): the same, except that a per-sample gradient no larger than what book-keeping keeps
      of the call anyway (``p d <= T (p + d)``, :meth:`LayerKind.instantiation_fits`) is instantiated: it is then
      computed as the output gradient arrives and replaces the kept input and output gradient
      (:func:`instantiate_on_arrival`), so it costs no memory, and it saves the ``T x T`` Gram matrices' time.
    """
    if name not in kind.ghost_names(module) or mode == "instantiate":
        return False
    if mode in ("BK-ghost", "ghost"):
        return True
    if not kind.prefers_ghost(module, ctx, name):
        return False
    return not (mode == "BK-MixOpt" and kind.instantiation_fits(module, ctx, name))


#: modes whose clipped sum of instantiated parameters comes from the kept per-sample gradients
ON_ARRIVAL_MODES = ("BK-MixOpt", "instantiate")


def instantiate_on_arrival(rec: Record, mode: str) -> bool:
    """When the output gradient of a layer-kind call arrives in the backward pass and none of its trainable
    parameters gets the ghost norm (:func:`use_ghost`), compute their per-sample gradients now (``rec.psg``) and drop
    the kept activation and output gradient, instead of holding both until the backward pass ends. Only in the
    modes that use kept per-sample gradients for the clipped sum (``BK-MixOpt``, ``instantiate``). Exact: the same
    per-sample gradients the end of the backward pass would compute. Returns whether it did."""
    if (mode not in ON_ARRIVAL_MODES or rec.psg is not None or rec.activation is None or len(rec.grads) != 1
            or rec.grads[0] is None or not rec.kind.replayable):
        return False
    kind, module = rec.kind, rec.module
    ctx = kind.prepare(module, rec.activation, rec.grad_output)
    names = sorted(rec.names)
    if any(use_ghost(kind, module, ctx, n, mode) for n in names):
        return False
    rec.batch = kind.batch_size(rec.activation, rec.grad_output)
    rec.psg = {n: kind.per_sample_grad(module, ctx, n) for n in names}
    rec.activation, rec.grads = None, [None]
    return True


def _per_sample_grad(rec: Record, name: str) -> torch.Tensor:
    return rec.psg[name] if rec.psg is not None else rec.kind.per_sample_grad(rec.module, rec.ctx, name)


def _batch_size(records: list[Record]) -> int:
    sizes = {id(r): r.batch if r.psg is not None else r.kind.batch_size(r.activation, r.grad_output)
             for r in records}
    distinct = set(sizes.values())
    if len(distinct) > 1:
        detail = ", ".join(f"{type(r.module).__name__}: {sizes[id(r)]}" for r in records)
        raise RuntimeError(
            "hooked layers saw different batch sizes in one backward pass "
            f"({detail}). fastdp needs the batch dimension first in every layer's input; an input without it "
            "(shared by all samples) must have size 1 there (it is then broadcast). A layer whose input folds "
            "the batch into another dimension (a leading size that is a multiple of the batch size, as in "
            "x.reshape(-1, d) before a Linear: HF OPT's decoder layers do this), or has no batch dimension, cannot "
            "be attributed to samples. Keep the batch dimension in the model's forward, or freeze those layers.")
    return distinct.pop()


def _norm_sq(t: torch.Tensor) -> torch.Tensor:
    """``||t_i||^2`` per sample of a ``(B, *shape)`` tensor (``shape`` may be empty: a scalar parameter)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:])).square().sum(dim=1)


def _weighted_sum(coef: torch.Tensor, psg: torch.Tensor) -> torch.Tensor:
    return torch.einsum("b,b...->...", coef.to(psg.dtype), psg)


def _add(out: dict[nn.Parameter, torch.Tensor], param: nn.Parameter, value: torch.Tensor) -> None:
    out[param] = out[param] + value if param in out else value


def _shared_ghost_norm_sq(plist: list[tuple[Record, str]], mode: str) -> torch.Tensor | None:
    """``||sum_u g_i^u||^2`` of a parameter used by several calls, by Gram matrices (``None``: instantiate).

    ``sum_u ||g^u||^2 + 2 sum_{u<v} <g^u, g^v>``, every term in its ghost form (:mod:`fastdp.layers._factored`).
    Chosen in the ghost modes and, in the mixed modes, when ``2 (sum_u T_u)^2 < g m n`` (the single-layer rule with
    all uses' positions together).
    """
    if mode == "instantiate" or any(r.psg is not None for r, _ in plist):
        return None
    facs = [r.kind.factors(r.module, r.ctx, n) for r, n in plist]
    if any(f is None for f in facs) or len({f.layout for f in facs}) != 1:
        return None
    g, m, n = facs[0].layout
    positions = sum(f.positions for f in facs)
    if mode in ("BK-MixOpt", "BK-MixGhostClip") and not 2 * positions * positions < g * m * n:
        return None
    dtype = next(t.dtype for f in facs for t in (f.left, f.right) if isinstance(t, torch.Tensor))
    total = None
    for u, (fu, (rec, name)) in enumerate(zip(facs, plist, strict=True)):
        if name in rec.kind.ghost_names(rec.module):
            term = rec.kind.ghost_norm_sq(rec.module, rec.ctx, name)
        else:
            term = _factored.inner(fu, fu, dtype)
        for fv in facs[u + 1:]:
            term = term + 2.0 * _factored.inner(fu, fv, dtype)
        total = term if total is None else total + term
    return total


def _replay_grads(rec: Record, names: list[str], coef: torch.Tensor) -> dict[str, torch.Tensor]:
    """GhostClip's second backward, layer-local: gradients of ``sum_i coef_i <G_i, out_i>`` w.r.t. ``names``."""
    module = rec.module
    with torch.enable_grad(), replay_autocast(rec.autocast):
        leaves = {n: getattr(module, n).detach().requires_grad_(True) for n in names}
        out = functional_call(module, leaves, (rec.activation,))
        g = rec.grad_output
        weights = g * coef.to(g.dtype).view(-1, *([1] * (g.dim() - 1)))
        grads = torch.autograd.grad(out, list(leaves.values()), grad_outputs=weights)
    return dict(zip(names, grads, strict=True))


def clipped_sums(records: list[Record], param_of: dict[tuple[int, str], nn.Parameter],
                 cfg: ClipConfig) -> BackwardResult:
    """``sum_i C_i g_i`` per parameter for one backward pass (see the module docstring).

    Args:
        records: the calls whose output gradients arrived in this backward pass.
        param_of: ``(id(module), attribute name) -> parameter``.
        cfg: clipping mode, function, per-group thresholds and groups, loss reduction, non-finite policy.

    Returns:
        the clipped sums (parameter -> tensor of ``param.shape``, in at least float32) and the batch size.

    Raises:
        NonFiniteGradientError: a sample's gradient has NaN/inf and ``cfg.on_nonfinite == "raise"``.
    """
    if not records:
        return BackwardResult({}, 0)
    try:
        return _clipped_sums(records, param_of, cfg)
    finally:
        for rec in records:
            rec.ctx = None


def _sanitize(rec: Record, bad: torch.Tensor) -> None:
    """Zero sample rows flagged ``bad`` in a record (its captured tensors, or a generic kind's gradients)."""
    def zero_rows(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() == 0 or t.shape[0] != len(bad):
            return t
        return torch.where(bad.view(-1, *([1] * (t.dim() - 1))), torch.zeros((), dtype=t.dtype), t)

    if not rec.kind.replayable:  # generic: its context holds the per-sample gradients
        rec.ctx = {n: zero_rows(g) for n, g in rec.ctx.items()}
        return
    if rec.psg is not None:  # instantiated on arrival
        rec.psg = {n: zero_rows(g) for n, g in rec.psg.items()}
        return
    rec.grads = [zero_rows(g) for g in rec.grads]
    rec.activation = zero_rows(rec.activation)
    rec.ctx = None


def _clipped_sums(records: list[Record], param_of: dict[tuple[int, str], nn.Parameter],
                  cfg: ClipConfig) -> BackwardResult:
    B = _batch_size(records)
    scale = float(B) if cfg.mean_reduction else 1.0
    mode = cfg.mode

    uses: dict[nn.Parameter, list[tuple[Record, str]]] = {}
    for rec in records:
        if rec.ctx is None and rec.psg is None:
            rec.ctx = rec.kind.prepare(rec.module, rec.activation, rec.grad_output)
        for name in sorted(rec.names):
            uses.setdefault(param_of[(id(rec.module), name)], []).append((rec, name))

    norm_sq: dict[nn.Parameter, torch.Tensor] = {}
    kept: dict[nn.Parameter, torch.Tensor] = {}  # instantiated per-sample gradients kept for step 3
    for param, plist in uses.items():
        if len(plist) > 1:  # shared parameter: norm of the per-sample sum over uses
            sq = _shared_ghost_norm_sq(plist, mode)
            if sq is not None:
                norm_sq[param] = sq
                continue
            total = sum(_per_sample_grad(r, n) for r, n in plist)
            norm_sq[param] = _norm_sq(total)
            kept[param] = total
            continue
        rec, name = plist[0]
        kind, module = rec.kind, rec.module
        if rec.psg is None and use_ghost(kind, module, rec.ctx, name, mode):
            norm_sq[param] = kind.ghost_norm_sq(module, rec.ctx, name)
        else:
            psg = _per_sample_grad(rec, name)
            norm_sq[param] = _norm_sq(psg)
            if mode in ("BK-MixOpt", "instantiate") or not kind.replayable:
                kept[param] = psg

    # Step 2: per-group norms and factors.
    group_sq: dict[int, torch.Tensor] = {}
    for param, sq in norm_sq.items():
        k = cfg.group_of[param]
        group_sq[k] = group_sq[k] + sq if k in group_sq else sq
    if group_sq:
        total_sq = sum(group_sq.values())
        bad = ~torch.isfinite(total_sq)
        if bool(bad.any()):
            idx = bad.nonzero().flatten().tolist()
            if cfg.on_nonfinite != "zero":
                raise NonFiniteGradientError(
                    f"the per-sample gradients of samples {idx[:10]}{'...' if len(idx) > 10 else ''} of this batch "
                    "(positions in the physical batch) contain NaN or infinity. Nothing was released. Fix the "
                    "model or data (e.g. a log of 0, an overflow in half precision), or build the engine with "
                    "on_nonfinite='zero' to give such samples clipping factor 0 (still private).")
            for rec in records:
                _sanitize(rec, bad)
            result = _clipped_sums(records, param_of, cfg)
            return BackwardResult(result.sums, result.batch_size, len(idx))
    coefs: dict[int, torch.Tensor] = {}
    for k, sq in group_sq.items():
        norms = sq.clamp(min=0).sqrt() * scale
        coefs[k] = cfg.clip_fn(norms, cfg.thresholds[k]) * scale

    # Step 3: clipped sums.
    out: dict[nn.Parameter, torch.Tensor] = {}
    replay: dict[Record, list[str]] = {}
    for param, plist in uses.items():
        coef = coefs[cfg.group_of[param]]
        if param in kept:
            out[param] = _weighted_sum(coef, kept[param])
        elif mode == "ghost":
            for rec, name in plist:
                replay.setdefault(rec, []).append(name)
        else:  # book-keeping: one contraction per use, summed over uses
            for rec, name in plist:
                _add(out, param, rec.kind.clipped_sum(rec.module, rec.ctx, name, coef))
    for rec, names in replay.items():
        by_group: dict[int, list[str]] = {}
        for n in names:
            by_group.setdefault(cfg.group_of[param_of[(id(rec.module), n)]], []).append(n)
        for k, group_names in by_group.items():
            for n, g in _replay_grads(rec, group_names, coefs[k]).items():
                _add(out, param_of[(id(rec.module), n)], g)
    return BackwardResult({p: s.to(accumulation_dtype(s.dtype)) for p, s in out.items()}, B)
