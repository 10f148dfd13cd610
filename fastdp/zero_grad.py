"""``zero_grad()`` under an attached engine: the optimizer's and the model's ``zero_grad`` also forget the clipped sums
the engine holds for the next step (:class:`ZeroGradHook`), installed by ``PrivacyEngine.attach`` and removed by
``detach``."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class ZeroGradHook:
    """``optimizer.zero_grad()`` / ``model.zero_grad()`` while attached: besides resetting ``.grad`` (the original
    method), forget the clipped sums the engine holds for the next step, as torch forgets ``.grad``. The engine keeps
    its sums apart from ``.grad`` (ghost differentiation), so without this a ``zero_grad()`` between two backward
    passes (adversarial training: a clean pass for the input's gradient, ``zero_grad()``, then the adversarial pass)
    released both passes, one sample counting twice. Removed by :meth:`remove` (``detach``): an instance attribute
    over the class's method."""

    def __init__(self, engine: Any, owner: Any) -> None:
        self.engine, self.owner = engine, owner
        self.original = owner.zero_grad
        owner.zero_grad = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rel = self.engine._release
        if rel.summed or rel.backward_seen:
            logger.info("%s.zero_grad(): the clipped sums of %d backward pass(es) since the last step are discarded, "
                        "as .grad is", type(self.owner).__name__, rel.step_passes)
            rel.clear_step()
            rel.clip_counter.discard()
        return self.original(*args, **kwargs)

    def remove(self) -> None:
        if self.owner.__dict__.get("zero_grad") is self:
            del self.owner.zero_grad


def hooks(engine: Any, owners: tuple[Any, ...]) -> list[ZeroGradHook]:
    """A :class:`ZeroGradHook` on each of ``owners`` (the optimizer, the model); handles with ``remove()``."""
    return [ZeroGradHook(engine, o) for o in owners]
