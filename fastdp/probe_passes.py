"""The structure probe's passes (:mod:`fastdp.probe`): the engine pass on the batch, the batch-of-one references,
the generic owners' learned layouts applied to the engine pass's records, and the comparison, with the tolerances
and the determinism they share.

* :func:`_engine_pass`: the model with the engine's hooks capturing into records kept apart from the step's, seeded
  cotangents ``V_j`` on its batched outputs, backward;
* :func:`_reference`: sample ``i`` alone with every engine hook inert (:class:`_Inert`): its outputs against row
  ``i`` of the batch's, and the gradient ``r_i`` of ``sum_j <V_j[i], y_j(x_i)>``;
* :func:`_engine_sums`: the engine's per-sample gradients of the probe samples (:func:`_rows`) and its clipping
  mode's sum weighted by random factors;
* :func:`_compare`: both against the references, relative to the largest per-sample gradient norm
  (:data:`_PROBE_RTOL` per dtype);
* :class:`DeterministicDropout`: dropout as the identity in every pass, so that the passes compute one function.
"""

from __future__ import annotations

import logging
import math
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.clipped_sums import ClipConfig, NonFiniteGradientError, clipped_sums
from fastdp.layers import generic, layout
from fastdp.layers.base import autocast_state, clipping_precision
from fastdp.layers.generic import GENERIC
from fastdp.torch_api import TorchFunctionMode, tree_flatten, tree_map

logger = logging.getLogger("fastdp.probe")

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


@dataclass
class Finding:
    """One disagreement: which check, where, how large."""

    check: str  # "per-sample gradient", "sum of per-sample gradients", "output", "engine pass", "batch of one"
    where: str  # parameter name / output leaf / ""
    error: float  # relative error (inf: a pass failed)
    index: int | None = None
    detail: str = ""
    params: tuple[str, ...] = ()  # parameters a failed pass named (a generic owner whose replay raised)
    samples: tuple[int, ...] = ()  # samples a failed pass found non-finite (NonFiniteGradientError)

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
    """``||a - b|| / scale``; where either is not finite, ``inf`` unless both are non-finite at the same entries
    (then over the others). A NaN error compared as no mismatch: a reference gradient that was NaN where the
    engine's row was finite (rows of another sample mixed in) let a model pass (a red-team pass, 2026-11-28)."""
    diff = a.double() - b.double()
    finite = diff.isfinite()
    if not bool(finite.all()):
        if a.shape != b.shape or not all(torch.equal(f(a), f(b)) for f in (torch.isnan, torch.isposinf,
                                                                               torch.isneginf)):
            return math.inf
        diff = diff[finite]
    d = float(diff.norm())
    if d == 0:
        return 0.0
    r = d / max(scale, 1e-300) if math.isfinite(scale) else math.inf
    return r if math.isfinite(r) else math.inf


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


def _restore_buffers(buffers: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]) -> None:
    """Put every buffer back as it was before the probe (same tensor object, same values), so that each probe pass
    starts from the state the real forward will see (a stateful forward, e.g. spectral_norm's power iteration in
    train mode, would otherwise give the passes different weights). A buffer whose values did not change is not
    written: a copy would bump its version counter, and the backward pass of a forward call made before the probe
    (``la = loss(model(x)); lb = loss(model(x2)); la.backward()``, the probe running in the second call) would
    refuse a saved buffer "modified by an inplace operation" (a red-team pass, 2026-11-28)."""
    with torch.no_grad():
        for m, n, b, saved in buffers:
            m._buffers[n] = b
            if not torch.equal(b, saved):
                b.copy_(saved)


def _engine_failed(e: BaseException) -> Finding:
    logger.info("structure probe: the engine's pass failed (%s: %s)", type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "")
    hint = ""
    if any(f.filename.replace("\\", "/").endswith("/cache_utils.py") for f in traceback.extract_tb(e.__traceback__)):
        hint = (" [raised inside transformers' key/value cache: the model updates a cache in its forward, which a "
                "per-sample replay repeats; call it with use_cache=False for training]")
    return Finding(_ENGINE_FAILED, "", math.inf, detail=f"{type(e).__name__}: {e}{hint}",
                   params=tuple(getattr(e, "fastdp_params", ())), samples=tuple(getattr(e, "fastdp_samples", ())))


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
                 gen: torch.Generator, on_nonfinite: str = "raise") -> tuple[Any, ...]:
    """From the engine pass's records: per-sample rows for ``indices`` and, by the engine's clipping mode, the sum
    weighted by random factors on ``indices`` (zero elsewhere). ``on_nonfinite="zero"``: samples with non-finite
    gradients (none of ``indices``) get factor 0 and their rows are zeroed, as the engine's policy does."""
    w = torch.zeros(B, dtype=torch.float64)
    w[indices] = torch.rand(len(indices), generator=gen, dtype=torch.float64) + 0.5
    weights = {i: float(w[i]) for i in indices}
    engine._capture.inert_depth += 1
    try:
        with clipping_precision():  # the engine's clipping math in float32, as in training (fastdp.layers.base)
            rows = _rows(records, engine.plan.param_of, params, indices)
            cfg = ClipConfig(mode=engine.clip_config.mode, clip_fn=lambda n, R: w.to(device=n.device, dtype=n.dtype),
                             thresholds=[1.0], group_of=dict.fromkeys(params, 0), mean_reduction=False,
                             on_nonfinite=on_nonfinite)
            got = clipped_sums(records, engine.plan.param_of, cfg) if records else None
            bad = got.nonfinite_mask if got is not None else None
            if bad is not None and bool(bad.any()):  # deferred on an accelerator: read here (the probe reads anyway)
                idx = bad.nonzero().flatten().tolist()
                err = NonFiniteGradientError(f"the per-sample gradients of samples {idx[:10]} are not finite")
                err.fastdp_samples = tuple(idx)  # as the CPU path raises it: the probe then probes the others
                raise err
            res = got.sums if got is not None else {}
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
