"""Clipping modes: one typed description of how each mode gets per-sample norms and the clipped sum.

Every mode releases the same gradient up to rounding; they differ in cost. A mode answers three questions:

* **norms** -- where a layer kind has a ghost norm, when is it used instead of instantiating the per-sample
  gradient ``g_i``: ``"always"``, ``"never"``, ``"cost"`` (the book-keeping paper's rule: ghost when
  ``2 T^2 < p d``), or ``"cost-fits"`` (the same, except that a per-sample gradient no larger than what
  book-keeping keeps anyway, ``p d <= T (p + d)``, is instantiated);
* **sums** -- how ``sum_i C_i g_i`` is formed for a parameter whose norm was ghost: ``"contraction"`` (book-keeping:
  one contraction of the kept input and the output gradient scaled by ``C``) or ``"replay"`` (GhostClip: a second,
  layer-local backward of ``sum_i C_i L_i``);
* **capture** -- what the forward keeps: ``capture_all`` keeps the input of every hooked layer (the replay needs it,
  even for bias-only layers); ``on_arrival`` instantiates per-sample gradients as the output gradient arrives,
  where no ghost norm is needed, and uses the kept per-sample gradients for the clipped sum.

The engine, the oracle tests and the benchmarks read this table; nothing else tests mode names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ClippingMode:
    """One clipping mode (see the module docstring)."""

    name: str
    norms: Literal["always", "never", "cost", "cost-fits"]
    sums: Literal["contraction", "replay"]
    capture_all: bool
    on_arrival: bool
    description: str

    @property
    def keeps_instantiated(self) -> bool:
        """Whether an instantiated per-sample gradient is kept for the clipped sum (else: contraction or replay)."""
        return self.on_arrival

    def __str__(self) -> str:
        return self.name


MODES: dict[str, ClippingMode] = {m.name: m for m in (
    ClippingMode("BK-MixOpt", "cost-fits", "contraction", False, True,
                 "book-keeping; ghost or instantiated per layer by cost, small per-sample gradients instantiated "
                 "on arrival (default)"),
    ClippingMode("BK-MixGhostClip", "cost", "contraction", False, False,
                 "book-keeping; ghost or instantiated per layer by the paper's cost model"),
    ClippingMode("BK-ghost", "always", "contraction", False, False,
                 "book-keeping; ghost norms wherever a layer kind has one"),
    ClippingMode("ghost", "always", "replay", True, False,
                 "GhostClip: ghost norms, then a second layer-local backward for the clipped sum"),
    ClippingMode("instantiate", "never", "contraction", False, True,
                 "per-sample gradients instantiated for every parameter (Opacus-style)"),
)}

#: the mode names, default first
CLIPPING_MODES: tuple[str, ...] = tuple(MODES)


def get_mode(mode: str | ClippingMode) -> ClippingMode:
    """The :class:`ClippingMode` named ``mode`` (a mode passes through); ValueError naming the choices."""
    if isinstance(mode, ClippingMode):
        return mode
    if mode not in MODES:
        raise ValueError(f"clipping_mode={mode!r} is not one of {list(MODES)}")
    return MODES[mode]


__all__ = ["CLIPPING_MODES", "MODES", "ClippingMode", "get_mode"]
