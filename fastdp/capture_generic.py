"""Capture for generic owners: the hooks of a module whose parameters take the exact generic path.

Part of the capture stage (:mod:`fastdp.capture`), for the plan entries of kind ``generic.GENERIC``
(:mod:`fastdp.layers.generic`). A generic owner's call is either

* **expanded** (:mod:`fastdp.layers.expand`): its broadcast parameters are replaced for the call by verified
  per-sample expansions ``E`` of shape ``(B, *p.shape)``; the gradients reaching ``E`` are the per-sample gradients
  and nothing of the call is kept; or
* **replayed**: its inputs, the random generators' state at its start and its outputs are kept in a
  :class:`fastdp.layers.generic.GenericCall`, every output with a batch dimension is hooked, and after the backward
  pass the clipping stage replays the owner per sample (``vmap`` of a ``vjp``).

These functions read and write only the :class:`fastdp.capture.Capture` they are given and the call's frame.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
from torch import nn

from fastdp import capture_fold
from fastdp.layers import batchdim, expand, generic
from fastdp.layers.base import autocast_state
from fastdp.plan import Plan, PlanEntry
from fastdp.records import Record
from fastdp.torch_api import set_parameter_slot, tree_flatten, tree_unflatten

logger = logging.getLogger(__name__)


def expandable(entry: PlanEntry, plan: Plan) -> dict[str, nn.Parameter] | None:
    """The owner's parameters if all are its own (no submodule path) and expandable, else ``None`` (replayed)."""
    params = {n: plan.param_of[(id(entry.module), n)] for n in sorted(entry.names)}
    if all("." not in n and expand.expandable(p) for n, p in params.items()):
        return params
    return None


def generic_pre(cap: Any, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                params: list[nn.Parameter], expand: dict[str, nn.Parameter] | None) -> None:
    """Pre-hook of a generic owner: ghost differentiation (the call's frame), the random generators' state (so the
    per-sample replay draws the same dropout masks), and a verified expansion of its broadcast parameters if it has
    them."""
    frame = cap.detach_params(module, params)
    idle = cap.inert or cap.paused
    if idle:
        return
    frame.rng = generic.rng_state(args, kwargs)
    if (expand and torch.is_grad_enabled() and id(module) not in cap.expand_off
            and all(module._parameters.get(n) is p for n, p in expand.items())):  # not a nested call of itself
        B = cap.batch()
        if B is None:
            B = batchdim.infer_batch_size(args, kwargs, where=type(module).__name__)
        if B is not None and B >= 1:
            frame.expansion = _start_expansion(module, expand, B, cap.anchor)


def _start_expansion(module: nn.Module, params: dict[str, nn.Parameter], batch: int,
                     anchor: Any) -> expand.ExpandedCall | None:
    try:
        call = expand.ExpandedCall(module, params, batch, anchor)
        call.begin()
    except Exception as e:  # noqa: BLE001 - never fatal: the call is replayed instead
        logger.info("module %s: expansion not started (%s); replaying", type(module).__name__, e)
        for n, p in params.items():
            set_parameter_slot(module, n, p)
        return None
    return call


def _unattributable(label: str, j: int, grad: torch.Tensor) -> None:
    if not bool(grad.any()):
        return  # (a zero gradient carries nothing)
    raise RuntimeError(
        f"output {j} of module {label!r} has no batch dimension but received a gradient: its contribution to "
        "the owner's trainable parameters cannot be attributed to samples. Freeze that module's parameters, or "
        "compute what it returns (a function of parameters only, such as a weight norm) inside the layer that uses "
        "it, so that one module's per-sample outputs carry the gradient (peft's DoRA on an Embedding layer does "
        "this: use DoRA on Linear layers, or plain LoRA on the embedding).")


def generic_hook(cap: Any, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, *,
                 names: frozenset[str], label: str) -> Any:
    """Forward hook of a generic owner: keep its inputs, expand broadcast outputs, hook every output."""
    frame = cap.end_call()
    rng = frame.rng if frame is not None else None
    exp = frame.expansion if frame is not None else None
    leaves, spec = tree_flatten(output)
    replaced = False
    if exp is not None:
        new = exp.end(None if output is None else leaves)
        if new is not None and any(a is not b for a, b in zip(new, leaves, strict=True)):
            leaves, replaced = new, True  # a tainted output: the unmodified forward's value instead
    if cap.idle() or output is None:
        # (output is None when the forward raised)
        return tree_unflatten(leaves, spec) if replaced else None
    B = cap.batch()
    if B is None:
        B = batchdim.infer_batch_size(args, kwargs, where=label)
    k_call, lay = cap.owner_layouts.next_call(module, args, kwargs, output)  # learned by the probe, or None
    if exp is not None and exp.verified and exp.batch != B:
        exp.reason = f"batch size {exp.batch} at the call's start, {B} at its end"
    if exp is not None and not exp.verified:
        cap.expand_off.add(id(module))
        logger.info("module %r (%s): expansion of %s not verified (%s); its parameters are replayed per sample "
                    "from now on", label, type(module).__name__, list(exp.names), exp.reason)
    expanded = exp is not None and exp.verified
    stats = cap.generic_stats.setdefault(label, {"expanded": 0, "replayed": 0})
    stats["expanded" if expanded else "replayed"] += 1
    new_leaves = list(leaves)
    hooked: list[int] = []
    declared = generic.output_batch_dims(module, leaves) or [None] * len(leaves)
    fold, in_fold = _fold(cap, module, label, leaves, declared, B, lay, args, kwargs)
    rows = None if B is None else B * fold  # the leading size of the call's per-sample tensors
    if rows is not None:
        capture_fold.note_rows(cap, rows if any(isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == rows
                                  for x in leaves) else None, fold, B)
    out_dims: list[int] = []
    for j, leaf in enumerate(leaves):
        if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim() >= 1):
            continue
        d = declared[j]
        if d is not None and B is not None and leaf.shape[d] == B:  # batch dimension declared by the owner
            hooked.append(j)
            out_dims.append(d)
        elif d is None and B is not None and leaf.shape[0] == rows and (lay is None or j not in lay.shared_out):
            hooked.append(j)
            out_dims.append(0)
        elif d is None and B is not None and generic.is_broadcast(leaf, B):
            new_leaves[j] = leaf.expand(rows, *leaf.shape[1:])
            hooked.append(j)
            out_dims.append(0)
            if cap.probe.running:
                cap.probe.broadcast.append(module)
        else:
            # no batch dimension: a gradient reaching it cannot be attributed (it requires grad through the anchor
            # also when nothing upstream does, e.g. an RNN's state with batch_first=False in the first layer)
            new_leaves[j] = leaf + cap.anchor(leaf)  # a new node, not a view (see below)
            new_leaves[j].register_hook(partial(_unattributable, label, j))
    if expanded:
        return _expanded_record(cap, module, exp, names, label, leaves, new_leaves, spec)
    if B is None or not hooked:
        parts = label.split(".") if label != "<root>" else []
        model = cap.engine.model
        chain = [type(model.get_submodule(".".join(parts[:i]))).__name__ for i in range(len(parts), -1, -1)]
        why = batchdim.no_batch_message(label, chain, [args, kwargs], B)
        if why is not None:
            raise RuntimeError(why)
        raise RuntimeError(
            f"module {label!r} ({type(module).__name__}) owns trainable parameters {sorted(names)} but none of "
            "its outputs has a batch dimension (leading size equal to the batch size, or 1), so their gradients "
            "cannot be attributed to samples. Freeze them, or return per-sample outputs.")
    args_d, kwargs_d, in_dims = generic.capture_inputs(args, kwargs, B, module, lay.shared_in if lay else (),
                                                       fold=in_fold)
    call = generic.GenericCall(args=args_d, kwargs=kwargs_d, in_dims=in_dims, batch=B, leaf_index=hooked,
                               outputs=[new_leaves[j].detach() for j in hooked], names=tuple(sorted(names)),
                               label=label, autocast=autocast_state(), rng=rng, out_dims=out_dims,
                               call_index=k_call, fold=fold, in_fold=in_fold)
    rec = Record(module=module, kind=generic.GENERIC, names=names, activation=call, grads=call.grads,
                 forward=cap.current_forward())
    call.grads.extend([None] * len(hooked))
    for k, j in enumerate(hooked):
        out = new_leaves[j]
        if out is leaves[j] and out.requires_grad:
            # a new node: the hook must see only the gradient from outside the owner, not from uses of the same
            # tensor inside its forward (T5 adds its returned position bias to its own attention scores).
            # Not a view: a hook on a view that the caller modifies in place never fires (HF Falcon adds the
            # attention output to its MLP's output with +=), and the owner would be released without it.
            out = out + cap.anchor(out)
        new_leaves[j] = cap.hook_output(out, rec, k)
    cap.pending.append(rec)
    return tree_unflatten(new_leaves, spec)


def _fold(cap: Any, module: nn.Module, label: str, leaves: list[Any], declared: list[int | None], B: int | None,
          lay: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int]:
    """The fold factors of a generic owner's call (:func:`fastdp.layers.batchdim.fold_factor`), of its outputs and
    of its inputs: ``(k, k)`` when none of its floating outputs has leading size ``B`` and those with a multiple of
    it all have ``k B``; ``(1, k)`` when its outputs have ``B`` rows and its inputs ``k B`` (:func:`_input_fold`);
    else ``(1, 1)``. The checks of a fold are the layer kinds' (:func:`fastdp.capture_fold.fold_of`)."""
    if B is None or isinstance(module, nn.RNNBase) or any(d is not None for d in declared):
        return 1, 1
    sizes = {leaf.shape[0] for j, leaf in enumerate(leaves)
             if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim() >= 1
             and (lay is None or j not in lay.shared_out)}
    folds = {batchdim.fold_factor(s, B) for s in sizes} - {1}
    if B in sizes and not folds:
        capture_fold.check_chosen_rows(cap, module, label, B, [args, kwargs])
        return 1, _input_fold(cap, module, label, B, lay, args, kwargs)
    if B in sizes or len(folds) > 1:
        return 1, 1
    if not folds:  # broadcast outputs only (a relative position bias): the latest per-sample call's rows
        k = capture_fold.broadcast_fold(cap) if B > 1 and sizes == {1} else 1
    else:
        k = folds.pop()
    k = 1 if k == 1 else capture_fold.fold_of(cap, module, label, True, k * B, B, [args, kwargs])
    return k, k


def _input_fold(cap: Any, module: nn.Module, label: str, B: int, lay: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> int:
    """An owner whose outputs have ``B`` rows and whose per-sample inputs all have ``k B`` (an attention pooling of
    each sample's folded rows): ``k``, its inputs then folded (:attr:`fastdp.layers.generic.GenericCall.in_fold`);
    else 1. Not when any input has leading size ``B`` (its ``k B``-row inputs may then be tables shared by the
    batch whose size is a multiple of it by coincidence)."""
    flat = tree_flatten((tuple(args), dict(kwargs)))[0]
    shared = lay.shared_in if lay is not None else ()
    sizes = {x.shape[0] for j, x in enumerate(flat)
             if isinstance(x, torch.Tensor) and x.dim() >= 1 and j not in shared}
    folds = {batchdim.fold_factor(s, B) for s in sizes} - {1}
    if B in sizes or len(folds) != 1:
        return 1
    k = folds.pop()
    return capture_fold.fold_of(cap, module, label, True, k * B, B, [args, kwargs])


def _expanded_record(cap: Any, module: nn.Module, exp: expand.ExpandedCall, names: frozenset[str], label: str,
                     leaves: list[Any], new_leaves: list[Any], spec: Any) -> Any:
    """A verified expansion: the gradients reaching the expansions ``E`` (shape ``(B, *rest)``) are the
    per-sample gradients. Nothing of the call is kept (no inputs, no outputs): the record only waits for them."""
    call = generic.GenericCall(args=(), kwargs={}, in_dims=((), {}), batch=exp.batch, leaf_index=[], outputs=[],
                               names=tuple(sorted(names)), label=label, autocast=autocast_state(),
                               expanded=exp.names)
    rec = Record(module=module, kind=generic.GENERIC, names=names, activation=call, grads=call.grads,
                 forward=cap.current_forward())
    call.grads.extend([None] * len(exp.names))
    for k, n in enumerate(exp.names):
        exp.expanded[n].register_hook(partial(cap.on_output_grad, rec, k))
    cap.pending.append(rec)
    changed = any(a is not b for a, b in zip(new_leaves, leaves, strict=True))
    return tree_unflatten(new_leaves, spec) if changed else None


__all__ = ["expandable", "generic_hook", "generic_pre"]
