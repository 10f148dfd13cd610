"""What a layer kind declares besides its math: its refusal rules, its row in the docs, its oracle test cases.

These are plain data, read by three consumers that must agree with each other:

* the engine, when it discovers the model (:meth:`fastdp.layers.base.LayerKind.unsupported_reason`, and
  :func:`fastdp.layers.registry.unsupported_reason` for modules on the generic path);
* :mod:`fastdp.validate`, which lists every :class:`Refusal` of the registry that fires on a model;
* the tests (every kind's :class:`OracleCase` s run against the brute-force oracle in every clipping mode) and
  the docs (the supported-layer table in docs/reference/layers.md is :func:`fastdp.layers.registry.docs_table`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Refusal:
    """One module configuration that cannot be trained privately.

    ``message(module)`` completes the sentence ``"module 'path' (Type) ..."``: it says what is wrong (with the
    offending value), why it breaks privacy, and ends with ``"Fix: ..."``, e.g. ``"has max_norm=1.0: forward
    renormalises ... Fix: max_norm=None"``.
    """

    #: module classes (``isinstance``) the rule looks at; may be wider than the kind's own ``module_types``.
    types: tuple[type[nn.Module], ...]
    #: whether the configuration is present in ``module`` (its current mode included).
    fires: Callable[[nn.Module], bool]
    #: the sentence completion described above.
    message: Callable[[nn.Module], str]
    #: if not empty, the rule only matters while one of these direct parameters requires grad (``sparse=True`` on a
    #: frozen Embedding is harmless); if empty, it matters for frozen modules too (``max_norm`` rewrites the weight
    #: in place whether or not it is trained).
    when_trainable: tuple[str, ...] = ()
    #: report the module only, not its descendants that the same rule also matches (a TransformerEncoderLayer's
    #: ``self_attn`` shares its ``batch_first``).
    covers_subtree: bool = False
    #: a module (with trainable parameters) on which the rule fires: the tests check that :mod:`fastdp.validate`
    #: reports it and the engine refuses it.
    example: Callable[[], nn.Module] | None = None
    #: a few words for the "Refused:" note of the kind's docs row (markdown), e.g. ``"`max_norm`"``.
    summary: str = ""
    #: whether the engine refuses a *frozen* module on which the rule fires (``when_trainable`` empty): a forward that
    #: rewrites the module's state from the private data (``max_norm``, running statistics in train mode) or mixes
    #: samples (batch statistics) is not private whoever trains. False for a layout rule (``batch_first=False``) that a
    #: frozen module's caller may honour by transposing; the structure probe checks what it actually does.
    frozen_too: bool = True

    def applies(self, module: nn.Module) -> bool:
        """Whether the rule fires on ``module`` as it is now (type, trainable state, configuration)."""
        if not isinstance(module, self.types):
            return False
        if self.when_trainable and not any(
                isinstance(p := getattr(module, n, None), torch.Tensor) and p.requires_grad
                for n in self.when_trainable):
            return False
        return bool(self.fires(module))


@dataclass(frozen=True)
class DocRow:
    """A kind's row of the supported-layer table in docs/reference/layers.md (markdown cells)."""

    layer: str
    parameters: str
    per_sample_norm: str
    notes: str

    def markdown(self, refusals: tuple[Refusal, ...] = ()) -> str:
        """The row as one markdown table line; the ``summary`` of each of ``refusals`` is appended to the notes."""
        notes = self.notes
        if refusals:
            notes += " Refused: " + "; ".join(r.summary for r in refusals) + "."
        return f"| {self.layer} | {self.parameters} | {self.per_sample_norm} | {notes} |"


@dataclass(frozen=True)
class OracleCase:
    """A tiny configuration of a kind, run by the tests against the brute-force oracle in every clipping mode.

    ``build()`` returns the module (any dtype: the test casts it to float64; the loss reads its output, or the first
    element of a tuple output); its inputs are ``(n, *input_shape)``, standard normal floats, or integer ids in
    ``[0, vocab)`` when ``vocab`` is set. ``frozen`` names direct parameters to freeze (e.g. ``("weight",)`` for a
    bias-only, activation-free case). Let one input dimension equal a batch size the test uses (3) where the kind
    has one, so a coincidence of sizes is exercised.
    """

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    vocab: int | None = None
    frozen: tuple[str, ...] = ()

    def module(self) -> nn.Module:
        """A new module, float64, with ``frozen`` parameters frozen."""
        m = self.build().double()
        for n in self.frozen:
            getattr(m, n).requires_grad_(False)
        return m

    def inputs(self, n: int) -> torch.Tensor:
        """A batch of ``n`` inputs (float64, or int64 ids), from torch's global generator."""
        if self.vocab is not None:
            return torch.randint(0, self.vocab, (n, *self.input_shape))
        return torch.randn((n, *self.input_shape), dtype=torch.float64)


__all__ = ["DocRow", "OracleCase", "Refusal"]
