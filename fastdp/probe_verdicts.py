"""How the structure probe (:mod:`fastdp.probe`) reads a pass that did not simply agree or disagree: the engine's
pass refused non-finite samples that the engine's policy zeroes (:func:`_nonfinite_data`), layer calls saw a part of
the batch (:func:`_sub_batches`) or rows that do not follow it (:func:`_no_batch_dim`), expansions lost the batch
dimension (:func:`_batch_lost`), or the model raises by itself (:func:`_model_raises`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fastdp.clipped_sums import NonFiniteGradientError
from fastdp.layers import layout
from fastdp.layers.generic import GENERIC
from fastdp.probe_passes import _ENGINE_FAILED, Finding, _Inert, _restore_buffers, _slice
from fastdp.torch_api import tree_flatten


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
