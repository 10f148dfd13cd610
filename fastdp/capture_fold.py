"""The batch folded into dimension 0: which hooked calls see ``k B`` rows, and whether the engine may take row ``r``
as sample ``r // k``'s (:func:`fastdp.layers.batchdim.fold_factor`; docs/internals/structure-probe.md, "The batch
folded into dimension 0").

Part of the capture stage (:mod:`fastdp.capture`): its layer hook and the generic owners' hook
(:mod:`fastdp.capture_generic`) ask :func:`fold_of` for every call, :func:`note_rows` remembers the fold of the
latest per-sample call (a broadcast output is expanded to its rows, :func:`broadcast_fold`), and
:func:`enter_guard` starts the rows-chosen-by-the-data guard (:mod:`fastdp.layers.fold_guard`) for a forward call.
A fold is accepted only where the structure probe (:mod:`fastdp.probe`) verified it, per input signature; the probe's
engine pass records how the factors it saw follow the inputs' sizes (:func:`fastdp.layers.batchdim.fold_rules`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fastdp.layers import batchdim, fold_guard


def enter_guard(frame: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Enter the rows-chosen-by-the-data guard for the forward call of ``frame`` (a
    :class:`fastdp.capture.RootFrame`; left in :meth:`fastdp.capture.Capture._root_post`)."""
    frame.guard = fold_guard.RowGuard()
    frame.guard.start(args, kwargs, frame.batch)
    frame.guard.__enter__()


def note_rows(cap: Any, rows: int | None, fold: int, B: int | None) -> None:
    """A hooked call had ``rows`` output rows: its fold factor is what a broadcast output is expanded to next
    (:func:`broadcast_fold`), if the rows are per sample (``B`` or a fold of it)."""
    if cap.roots and B is not None and rows in (B, B * fold):
        cap.roots[-1].last_fold = fold


def broadcast_fold(cap: Any) -> int:
    """The fold factor of the latest per-sample hooked call of this forward call (1: none, or unfolded)."""
    return cap.roots[-1].last_fold if cap.roots else 1


def _refused(cap: Any, message: str) -> RuntimeError:
    """A refusal of this call that depends on the batch's data (the same batch is refused again): the logical step's
    gradients accumulated from earlier batches are discarded with it, so that skipping the batch does not carry
    them into the next step, whose sampled batch they are not (the accountant would count that step's sampling
    rate too low). Not in the structure probe's passes, which raise inside the probe."""
    if not cap.probe.running and cap.engine._release.holds_gradients():
        cap.engine._release.discard()
        message += (" The gradients this step accumulated from earlier batches were discarded too (nothing of them "
                    "is released or accounted): start the step again with the next batch.")
    return RuntimeError(message)


def _guard(cap: Any) -> Any:
    return next((f.guard for f in reversed(cap.roots) if f.guard is not None), None)


def check_chosen_rows(cap: Any, module: nn.Module, label: str, B: int | None, inputs: Any) -> None:
    """A hooked call of ``B`` rows, row ``i`` taken as sample ``i``'s: if its inputs' rows were chosen by the data
    (:mod:`fastdp.layers.fold_guard`), they must be the samples' rows in order, which
    :mod:`fastdp.layers.row_owners` checks at every call (the structure probe sees one batch; a later mask of the
    same total would charge one sample's rows to another). Refused (``RuntimeError``, nothing recorded) if not.
    The probe's engine pass notes the signature, so that the guard runs at its later calls."""
    guard = _guard(cap)
    if guard is None or B is None or B < 2 or not guard.row_chosen(inputs):
        return
    if cap.probe.running:  # its own batch is verified by its comparison, which names what mixes samples
        cap.probe.chooses.add(cap.probe.sig)
        return
    reason = guard.unowned(inputs, B, 1)
    if reason is not None:
        raise _refused(cap,
            f"module {label!r} ({type(module).__name__}) takes row i of its input as sample i's (batch size {B}), "
            f"but the rows were chosen by the data (selected, gathered or scattered at indices computed from the "
            f"inputs, e.g. h[mask]) and {reason}: its per-sample gradients would mix samples. Keep the padded "
            "(B, T, ...) layout (mask the padding instead of dropping it), or freeze the module's parameters. "
            "Nothing of this call was recorded.")


def fold_of(cap: Any, module: nn.Module, label: str, foldable: bool, rows: int, B: int | None,
            inputs: Any = ()) -> int:
    """The fold factor ``k`` of a hooked call with ``rows`` output rows (``k B``: the batch folded into
    dimension 0, :func:`fastdp.layers.batchdim.fold_factor`), 1 if none. ``foldable``: the layer kind's
    :attr:`~fastdp.layers.base.LayerKind.foldable` (a generic owner: True, its replay takes a sample's ``k``
    rows as its batch); ``inputs``: the call's inputs. Refused (``RuntimeError``, nothing recorded): a fold
    before a mixture-of-experts part or a channel-first kind, a fold without the structure probe or before it
    verified the signature, a fold of rows chosen by the data (:mod:`fastdp.layers.fold_guard`), and a fold
    factor that follows the inputs' shapes in none of the ways the probe saw (:func:`batchdim.fold_rules`)."""
    k = batchdim.fold_factor(rows, B)
    if k == 1:
        if rows == B:
            check_chosen_rows(cap, module, label, B, inputs)
        return 1
    if id(module) not in cap.moe_of:  # (once per module: the type names of it and its ancestors)
        parts = label.split(".") if label != "<root>" else []
        model = cap.engine.model
        chain = [type(model.get_submodule(".".join(parts[:i]))).__name__ for i in range(len(parts), -1, -1)]
        cap.moe_of[id(module)] = chain if batchdim.is_moe(chain) else None
    chain = cap.moe_of[id(module)]
    head = f"the batch axis is folded into dimension 0 (size {rows} = {k} * {B}) before module {label!r} " \
        f"({type(module).__name__})"
    if chain is not None:
        raise RuntimeError(batchdim.no_batch_message(label, chain, [torch.empty(rows, 0)], B))
    if not foldable:
        raise RuntimeError(
            f"{head}, a channel-first layer: fastdp unfolds such rows for layers whose rows are positions "
            "(Linear, Embedding, LayerNorm, RMSNorm, HF Conv1D, eval-mode BatchNorm), not for convolutions, "
            "GroupNorm or InstanceNorm, which treat each row on its own. Keep the batch dimension first in the "
            "model's forward, or freeze the module's parameters.")
    if B is None or B < 2:  # a batch of one: every row is its sample's
        return k
    if not cap.engine.verify_structure:
        raise RuntimeError(
            f"{head}. fastdp takes row r as sample r // {k}'s (the order x.reshape(-1, d) gives), which only the "
            "structure probe verifies, and it is off (PrivacyEngine(verify_structure=False)). Turn it on, or "
            "keep the batch dimension first in the model's forward.")
    guard = _guard(cap)
    reason = guard.unowned(inputs, rows, k) if guard is not None and guard.row_chosen(inputs) else None
    if guard is not None and guard.row_chosen(inputs) and cap.probe.running:
        cap.probe.chooses.add(cap.probe.sig)
    if reason is not None:
        raise _refused(cap,
            f"{head}, but its rows were chosen by the data (selected, gathered, sorted or scattered at indices "
            f"computed from the inputs, e.g. h[mask] to drop padding) and {reason}: they cannot be taken as "
            f"{k} rows per sample. Keep the padded (B, T, ...) layout (mask the padding instead of dropping it), or "
            "freeze the module's parameters. Nothing of this call was recorded.")
    frame = cap.roots[-1] if cap.roots else None
    if cap.probe.running:
        if frame is not None:
            cap.probe.folds.setdefault(cap.probe.sig, {}).setdefault(id(module), set()).update(
                batchdim.fold_rules(k, frame.sizes))
        return k
    sig = cap.roots[0].sig if cap.roots else None
    if not cap.probe.verified(sig, cap.roots[0].batch if cap.roots else None):
        why = cap.probe.unverified.get(sig, "it did not run" if cap.engine.verify_structure else "it is off")
        raise RuntimeError(
            f"{head}. The structure probe has not verified this input signature ({why}), and rows are taken as "
            "sample r // k's only where it did. Nothing of this call was recorded.")
    rules = cap.probe.folds.get(sig, {}).get(id(module), set())
    if not batchdim.fold_follows(rules, k, cap.roots[0].sizes):
        seen = sorted(r[1] for r in rules if r[0] == "const")
        raise _refused(cap,
            f"{head}, but the structure probe saw {'fold factors ' + str(seen) if seen else 'no fold'} there "
            f"for this input signature, and {k} is neither one of them nor the same product of the inputs' "
            f"sizes {list(cap.roots[0].sizes)}: its rows depend on something other than the batch's shape (tokens "
            "routed or selected by the data) and cannot be attributed to samples. Freeze the module's "
            "parameters, or keep the batch dimension first in the model's forward. Nothing of this call was "
            "recorded.")
    return k


__all__ = ["broadcast_fold", "check_chosen_rows", "enter_guard", "fold_of", "note_rows"]
