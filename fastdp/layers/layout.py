"""Which inputs and outputs of a generic owner's call are per sample, learned by the structure probe, not by sizes.

The generic path (:mod:`fastdp.layers.generic`) replays an owner per sample; it must know which tensors of the call
have the batch dimension first. The size rule ("leading size equal to the batch size ``B``") is ambiguous when a
tensor shared by the batch has a leading size that equals ``B`` by coincidence: HF Funnel's relative attention
receives a ``(T, T)`` mask and ``(T, d)`` position tables, taken as batched when ``B == T`` (the replay check then
refuses the step, so a run under Poisson sampling stops at the first batch of size ``T``).

The structure probe (:mod:`fastdp.probe`) runs the model on the batch (``B > 1``) and on a batch of one sample:
a per-sample tensor has size ``B`` along its batch dimension in one and 1 in the other, so its shapes differ, and a
shared tensor has the same shape in both. For each generic owner call (the ``k``-th call of that owner in one
forward pass of the model), :func:`learn` compares the call on the batch with the same call on the batch of one:

* an input tensor of the same shape in both is **shared** (never batched, whatever its leading size);
* likewise an output tensor: it has no batch dimension (its gradient cannot be attributed to samples).

The table is kept per input signature (:func:`fastdp.probe.signature`) and used for every later call with that
signature (:class:`OwnerLayouts`), so a batch whose size equals some other dimension is replayed as every other
batch is. Calls the probe did not see (no probe, another structure on the batch of one) keep the size rule. Nothing
here is trusted blindly: the probe compares the engine's per-sample gradients, computed with the learned layout,
against the batch-of-one reference, and every replay checks its outputs against the real forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fastdp.torch_api import tree_flatten


@dataclass(frozen=True)
class OwnerLayout:
    """The learned layout of one owner call: flat indices (``tree_flatten((args, kwargs))`` / ``tree_flatten(out)``)
    of the tensors that are shared by the batch, and the tree structures it was learned on."""

    shared_in: frozenset[int]
    shared_out: frozenset[int]
    spec_in: str
    spec_out: str


def shapes(tree: Any) -> tuple[str, list[tuple[int, ...] | None]]:
    """``(str(tree spec), [shape of each leaf: None for a non-tensor or a 0-dim tensor])``."""
    flat, spec = tree_flatten(tree)
    return str(spec), [tuple(x.shape) if isinstance(x, torch.Tensor) and x.dim() >= 1 else None for x in flat]


@dataclass
class CallShapes:
    """The shapes of one owner call's input and output leaves (see :func:`shapes`; for a call on the batch, the
    outputs the engine hooked only, by leaf index)."""

    spec_in: str
    shapes_in: list[tuple[int, ...] | None]
    spec_out: str
    shapes_out: dict[int, tuple[int, ...] | None]


class Recorder:
    """Temporary forward hooks on the generic owners that record, per ``(id(owner), k)``, the shapes of the
    ``k``-th call's inputs and outputs (calls under grad mode only, as the engine counts them). Used by the probe on
    its batch-of-one passes; :meth:`close` removes the hooks."""

    def __init__(self, owners: list[nn.Module]) -> None:
        self.calls: dict[tuple[int, int], CallShapes] = {}
        self._counts: dict[int, int] = {}
        self._handles = [m.register_forward_hook(self._hook, with_kwargs=True, prepend=True)
                         for m in dict.fromkeys(owners)]

    def restart(self) -> dict[tuple[int, int], CallShapes]:
        """Start a new pass of the model; returns the previous pass's calls."""
        calls, self.calls, self._counts = self.calls, {}, {}
        return calls

    def _hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not torch.is_grad_enabled() or output is None:
            return
        k = self._counts.get(id(module), 0)
        self._counts[id(module)] = k + 1
        spec_in, shapes_in = shapes((tuple(args), dict(kwargs)))
        spec_out, shapes_out = shapes(output)
        self.calls[(id(module), k)] = CallShapes(spec_in, shapes_in, spec_out, dict(enumerate(shapes_out)))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def learn(refs: list[dict[tuple[int, int], CallShapes]], calls: dict[tuple[int, int], CallShapes],
          batch: int) -> dict[tuple[int, int], OwnerLayout]:
    """The layout of every owner call on the batch (``calls``) seen alike, with the same tree structure, in all
    batch-of-one passes ``refs`` (one per probe sample): a tensor of the same shape in both is shared. Empty at
    ``batch <= 1`` (a batch of one cannot tell)."""
    if batch <= 1 or not refs:
        return {}
    out: dict[tuple[int, int], OwnerLayout] = {}
    for key, b in calls.items():
        r = refs[0].get(key)
        if r is None or any(x.get(key) != r for x in refs[1:]) or r.spec_in != b.spec_in:
            continue  # not seen alike (data-dependent structure): keep the size rule
        shared_in = frozenset(j for j, (s, t) in enumerate(zip(b.shapes_in, r.shapes_in, strict=True))
                              if s is not None and s == t)
        shared_out = frozenset(j for j, s in b.shapes_out.items() if s is not None and s == r.shapes_out.get(j))
        out[key] = OwnerLayout(shared_in, shared_out, r.spec_in, r.spec_out)
    return out


@dataclass
class OwnerLayouts:
    """The engine's tables: learned layouts per input signature, the one of the forward pass in progress, and the
    count of each owner's calls in that pass."""

    by_signature: dict[Any, dict[tuple[int, int], OwnerLayout]] = field(default_factory=dict)
    active: dict[tuple[int, int], OwnerLayout] | None = None
    counts: dict[int, int] = field(default_factory=dict)

    def start(self, signature: Any = None) -> None:
        """A new outermost forward pass of the model, with this input signature (``None``: no learned layout)."""
        self.active = None if signature is None else self.by_signature.get(signature)
        self.counts = {}

    def next_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  output: Any) -> tuple[int, OwnerLayout | None]:
        """Count a call of ``module`` (an owner, in grad mode); its index and learned layout, if one was learned
        for a call of the same structure."""
        k = self.counts.get(id(module), 0)
        self.counts[id(module)] = k + 1
        lay = None if self.active is None else self.active.get((id(module), k))
        if lay is not None and (lay.spec_in != str(tree_flatten((tuple(args), dict(kwargs)))[1])
                                or lay.spec_out != str(tree_flatten(output)[1])):
            lay = None
        return k, lay


__all__ = ["CallShapes", "OwnerLayout", "OwnerLayouts", "Recorder", "learn", "shapes"]
