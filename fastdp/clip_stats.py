"""How many samples were clipped: a cheap, NON-PRIVATE diagnostic kept in the engine's own tables.

The clipping stage (:func:`fastdp.clipped_sums.clipped_sums`) marks, per backward pass, the samples whose
per-sample norm ``n_ik`` exceeds the threshold ``R_k`` of at least one clipping group ``k`` and returns their number
as a 0-dim tensor on the norms' device (``BackwardResult.clipped``; one comparison and one sum per group, no host
synchronisation). :class:`ClipCounter` adds these counts up per step and over the run; the tensor is read
(``.item()``, one sync) only when a report asks for it.

Privacy: the count is computed from the raw per-sample norms, so it is **not** differentially private. Report it as
a diagnostic (it tells whether ``max_grad_norm`` is far too small or too large); do not publish it or use it to
adapt training unless it is released through a private mechanism. An adaptive-clipping mechanism that releases a
*noisy* clipped fraction registers it with :meth:`ClipCounter.set_private_source`, and
:meth:`PrivacyEngine.privacy_report` then shows that value, labelled private, instead of the raw one.

On several ranks each engine counts the samples of its own rank (the counts are not all-reduced).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ClipCounter"]


class ClipCounter:
    """Counts of samples seen and samples clipped (norm > ``R_k`` in some group), per step and over the run.

    ``add`` is called for each completed backward pass, ``end_step`` when a step is released, ``discard`` when a
    step is refused (its passes are not counted)."""

    def __init__(self) -> None:
        self._step_clipped: torch.Tensor | int = 0
        self._step_samples = 0
        self._total_clipped: torch.Tensor | int = 0
        self._total_samples = 0
        self._last: tuple[torch.Tensor | int, int] = (0, 0)
        self._private: Callable[[], Any] | None = None

    def add(self, clipped: torch.Tensor | None, samples: int) -> None:
        """One backward pass: ``clipped`` of its ``samples`` samples had a norm above their group's threshold."""
        if clipped is not None:
            self._step_clipped = self._step_clipped + clipped.detach()
        self._step_samples += int(samples)

    def end_step(self) -> None:
        """The step was released: its counts join the run's."""
        self._last = (self._step_clipped, self._step_samples)
        self._total_clipped = self._total_clipped + self._step_clipped
        self._total_samples += self._step_samples
        self.discard()

    def discard(self) -> None:
        """The step was refused: forget its counts."""
        self._step_clipped, self._step_samples = 0, 0

    def set_private_source(self, source: Callable[[], Any] | None) -> None:
        """Hook for an adaptive-clipping mechanism: ``source()`` returns ``{"fraction": float, "mechanism": str}``
        (a clipped fraction released with noise, already accounted for) or ``None`` when it has none yet."""
        if source is not None and not callable(source):
            raise ValueError(f"source={source!r} must be callable (returning the noisy clipped fraction) or None")
        self._private = source

    @staticmethod
    def _fraction(clipped: torch.Tensor | int, samples: int) -> float | None:
        n = int(clipped.item()) if isinstance(clipped, torch.Tensor) else int(clipped)
        return None if samples == 0 else n / samples

    def summary(self) -> dict[str, Any]:
        """``{"fraction", "last_step_fraction", "samples", "clipped", "private", "source"}``; fractions are ``None``
        before any sample was seen. ``private`` is True only when a registered private source answered."""
        if self._private is not None:
            got = self._private()
            if got is not None:
                return {"fraction": float(got["fraction"]), "last_step_fraction": None, "samples": None,
                        "clipped": None, "private": True, "source": str(got.get("mechanism", "adaptive clipping"))}
        total = int(self._total_clipped.item()) if isinstance(self._total_clipped, torch.Tensor) \
            else int(self._total_clipped)
        return {"fraction": self._fraction(total, self._total_samples),
                "last_step_fraction": self._fraction(*self._last), "samples": self._total_samples,
                "clipped": total, "private": False,
                "source": "raw per-sample norms of this process's samples"}
