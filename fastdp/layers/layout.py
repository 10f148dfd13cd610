"""Which inputs and outputs of a generic owner's call are per sample, learned by the structure probe, not by sizes.

The generic path (:mod:`fastdp.layers.generic`) replays an owner per sample; it must know which tensors of the call
have the batch dimension first. The size rule ("leading size equal to the batch size ``B``") is ambiguous when a
tensor shared by the batch has a leading size that equals ``B`` by coincidence: HF Funnel's relative attention
receives a ``(T, T)`` mask and ``(T, d)`` position tables, taken as batched when ``B == T`` (the replay check then
refuses the step, so a run under Poisson sampling stops at the first batch of size ``T``).

The structure probe (:mod:`fastdp.probe`) runs the model on a batch of one sample: there every per-sample tensor has
leading size 1, and a shared tensor keeps its size. For each generic owner call (the ``k``-th call of that owner in
one forward pass of the model), :func:`learn` compares the call on the batch with the same call on the batch of one:

* an input tensor whose leading size in the batch-of-one pass is not 1 is **shared** (never batched, whatever its
  leading size in the batch);
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
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class OwnerLayout:
    """The learned layout of one owner call: flat indices (``tree_flatten((args, kwargs))`` / ``tree_flatten(out)``)
    of the tensors that are shared by the batch, and the tree structures it was learned on."""

    shared_in: frozenset[int]
    shared_out: frozenset[int]
    spec_in: str
    spec_out: str


def leading_sizes(tree: Any) -> tuple[str, list[int | None]]:
    """``(str(tree spec), [leading size of each leaf: None for a non-tensor or a 0-dim tensor])``."""
    flat, spec = tree_flatten(tree)
    return str(spec), [x.shape[0] if isinstance(x, torch.Tensor) and x.dim() >= 1 else None for x in flat]


@dataclass
class CallShapes:
    """The leading sizes of one owner call's inputs and outputs (see :func:`leading_sizes`)."""

    spec_in: str
    sizes_in: list[int | None]
    spec_out: str
    sizes_out: list[int | None]


class Recorder:
    """Temporary forward hooks on the generic owners that record, per ``(id(owner), k)``, the leading sizes of the
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
        spec_in, sizes_in = leading_sizes((tuple(args), dict(kwargs)))
        spec_out, sizes_out = leading_sizes(output)
        self.calls[(id(module), k)] = CallShapes(spec_in, sizes_in, spec_out, sizes_out)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def learn(refs: list[dict[tuple[int, int], CallShapes]], batch: int) -> dict[tuple[int, int], OwnerLayout]:
    """The layout of every owner call seen alike in all batch-of-one passes ``refs`` (one per probe sample): a
    tensor whose leading size there is not 1 is shared. Empty at ``batch <= 1`` (a batch of one cannot tell)."""
    if batch <= 1 or not refs:
        return {}
    out: dict[tuple[int, int], OwnerLayout] = {}
    for key, c in refs[0].items():
        if any(r.get(key) != c for r in refs[1:]):
            continue  # the probe samples disagree (data-dependent structure): keep the size rule

        def shared(sizes: list[int | None]) -> frozenset[int]:
            return frozenset(j for j, s in enumerate(sizes) if s is not None and s != 1)

        out[key] = OwnerLayout(shared(c.sizes_in), shared(c.sizes_out), c.spec_in, c.spec_out)
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


__all__ = ["CallShapes", "OwnerLayout", "OwnerLayouts", "Recorder", "leading_sizes", "learn"]
