"""What the capture stage hands to the clipping stage: one :class:`Record` per call of a hooked module.

A record holds what the forward kept (the layer's input, or a generic owner's call) and what the backward delivered
(the output gradients), or, once instantiated on arrival (:func:`fastdp.norms.instantiate_on_arrival`), the call's
per-sample gradients. The capture stage (:mod:`fastdp.capture`) creates and fills records; the clipping stage
(:mod:`fastdp.norms`, :mod:`fastdp.clipped_sums`) reads them and may replace their kept tensors by per-sample
gradients or drop them; nothing else touches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fastdp.layers.base import LayerKind


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
    ctx: Any = field(default=None, repr=False)
    #: per-sample gradients instantiated when the output gradient arrived (:func:`instantiate_on_arrival`); the
    #: activation and the output gradient are then dropped and ``batch`` holds the call's batch size
    psg: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    batch: int | None = None
    #: the engine's id of the model's forward call that made this record (records of a failed pass are dropped
    #: together with the other records of the same forward call)
    forward: int = -1
    #: how many recorded calls of this forward read the same input tensor as this one (a one-element list shared by
    #: them: the ``q``, ``k``, ``v`` projections of an attention block read one hidden state); book-keeping keeps
    #: that input once for all of them (:func:`fastdp.norms.use_ghost`)
    readers: list[int] = field(default_factory=lambda: [1])
    #: the record's clipped sums are formed and what it kept is freed (:func:`fastdp.clipped_sums._drop_kept`); a
    #: later backward pass through the same call is refused as a second one
    summed: bool = False
    #: recorded in a call of a submodule on its own (no call of the engine's model around it): the call's batch size
    #: was unknown, so an output of leading size 1 (a position table) was not broadcast to the batch
    rootless: bool = False
    #: an output of this call carries the engine's anchor (the first hooked output of its forward call): its
    #: backward pass tells whether that pass accumulates into leaves (``Capture.on_output_grad``)
    canary: bool = False
    #: rows per sample of a call that saw the batch folded into dimension 0 (``k B`` rows; 1: none). Its kept input
    #: and output gradients are unflattened to ``(B, k, ...)`` (:func:`fastdp.layers.batchdim.unfold_rows`)
    fold: int = 1

    @property
    def grad_output(self) -> torch.Tensor | None:
        return self.grads[0]

    @property
    def reached(self) -> bool:
        """Whether the backward pass delivered a gradient to any of the call's outputs."""
        return self.summed or self.psg is not None or any(g is not None for g in self.grads)


__all__ = ["Record"]
