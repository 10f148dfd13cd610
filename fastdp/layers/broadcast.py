"""A hooked module's output for the whole batch (leading size 1), expanded so its gradient arrives per sample, and
repeated over the batch by the model as the unexpanded one would be.

The engine expands such an output to ``(B, ...)`` in its forward hook (:mod:`fastdp.capture`): a model that
broadcasts it (``x + pos``) computes the same values, and the gradient reaching the expanded tensor is the stack of
per-sample gradients. A model that *repeats* it instead (``pos.repeat(B, 1, 1, 1)``: XCiT's Fourier position
encoder, whose ``token_projection`` convolution runs on a batch-free grid) would repeat the expanded tensor to
``B^2`` rows. So the expanded output is handed to the model as a :class:`BatchRows` tensor, on which ``repeat`` and
``tile`` (function or method) by exactly ``(B, 1, ..., 1)`` give a copy of the expanded rows (what the unexpanded
output repeated ``B`` times is, value for value). Every other function sees a plain tensor and returns one. The
structure probe verifies the result like any broadcast output (its per-sample gradients against batch-of-one
references), per input signature at two batch sizes (:data:`fastdp.probe.SIZES_PER_SIGNATURE`): an operation whose
effect on the rows depends on the batch size (``roll`` by a constant) can pass the probe at one batch size and mix
rows at another of the same signature (a red-team pass, 2026-11-28), which the second size's probe catches unless
both sizes hide it (docs/internals/structure-probe.md).
"""

from __future__ import annotations

from typing import Any

import torch

from fastdp.torch_api import torch_function_subclasses_off


class BatchRows(torch.Tensor):
    """An expanded broadcast output ``(rows, ...)``; ``rows`` in :attr:`rows` (see the module docstring)."""

    rows: int

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        with torch_function_subclasses_off():
            if func in (torch.Tensor.repeat, torch.Tensor.tile, torch.tile) and args and isinstance(args[0], BatchRows):
                sizes = _sizes(args[1:], kwargs)
                if sizes is not None and list(sizes) == [args[0].rows] + [1] * (args[0].dim() - 1):
                    return args[0].clone(memory_format=torch.contiguous_format)
            return func(*args, **kwargs)


def _sizes(rest: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    """The repeats of ``t.repeat(*sizes)``, ``t.repeat(sizes)``, ``t.tile(dims)`` or ``torch.tile(t, dims)``; ``None``
    if not ints."""
    sizes = kwargs.get("repeats", kwargs.get("dims", rest[0] if len(rest) == 1 else rest))
    if isinstance(sizes, torch.Size | tuple | list) and all(isinstance(s, int) for s in sizes):
        return tuple(sizes)
    return None


def batch_rows(out: torch.Tensor, rows: int) -> torch.Tensor:
    """``out`` (already expanded to ``rows`` leading rows) as a :class:`BatchRows` alias, attached to the same
    autograd graph."""
    view = out.as_subclass(BatchRows)
    view.rows = rows
    return view
