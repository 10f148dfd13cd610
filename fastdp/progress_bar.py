"""``fastdp.progress(loader, engine)``: a progress bar showing the epsilon spent so far, only where asked for.

Wraps any iterable (a data loader); after every item the bar's postfix shows the engine's released ``step`` and the
live epsilon (:meth:`PrivacyEngine.live_epsilon`: the RDP upper bound, cheap enough for every step; the tight PRV
value comes from ``engine.get_privacy_spent()`` at the end). The bar is ``tqdm``'s (a dependency of
``transformers``); without tqdm the same line is logged (``logging``, INFO) about ten times per pass. On several
ranks only rank 0 shows it (``disable`` overrides).
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["progress", "epsilon_postfix"]


def epsilon_postfix(engine: Any, delta: float | None = None) -> dict[str, str]:
    """``{"step": "n", "eps": "x.xx"}``: the engine's released steps and live epsilon (RDP upper bound)."""
    eps = engine.live_epsilon(delta)
    return {"step": str(engine.steps), "eps": "inf" if math.isinf(eps) else f"{eps:.3g}"}


def progress(iterable: Iterable[T], engine: Any, *, desc: str = "DP training", delta: float | None = None,
             disable: bool | None = None, **tqdm_kwargs: Any) -> Iterator[T]:
    """Yield the items of ``iterable`` while showing a progress bar with the steps released and epsilon so far.

    Args:
        iterable: what the training loop iterates (a loader); ``len()`` is used for the total when it has one.
        engine: the :class:`fastdp.PrivacyEngine` whose epsilon to show.
        desc: the bar's label.
        delta: delta of the epsilon shown (default the engine's ``target_delta``).
        disable: hide the bar (default: hidden on ranks other than 0).
        **tqdm_kwargs: passed to ``tqdm.tqdm`` (``file``, ``leave``, ``mininterval``, ...).

    The epsilon shown is the RDP upper bound of the steps released *before* each item is processed (a step is
    released by ``optimizer.step()`` in the loop body); it is never below the tight PRV value.
    """
    if not hasattr(engine, "live_epsilon"):
        raise ValueError(f"engine={engine!r} is not a fastdp.PrivacyEngine (progress(loader, engine))")
    if disable is None:
        disable = engine.rank != 0
    total = tqdm_kwargs.pop("total", None)
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    if importlib.util.find_spec("tqdm") is None:
        yield from _logged(iterable, engine, desc, delta, total, disable)
        return
    from tqdm import tqdm

    bar = tqdm(desc=desc, total=total, disable=disable, **tqdm_kwargs)
    last = -1
    try:
        n = 0
        for item in iterable:
            if n:
                bar.update(1)  # the previous item is done (its step released)
            if engine.steps != last and not disable:
                last = engine.steps
                bar.set_postfix(epsilon_postfix(engine, delta), refresh=False)
            n += 1
            yield item
        if n:
            bar.update(1)
        if not disable:
            bar.set_postfix(epsilon_postfix(engine, delta))
    finally:
        bar.close()


def _logged(iterable: Iterable[T], engine: Any, desc: str, delta: float | None, total: int | None,
            disable: bool) -> Iterator[T]:
    every = max(1, (total or 100) // 10)
    n = 0
    for n, item in enumerate(iterable, 1):
        yield item
        if not disable and n % every == 0:
            p = epsilon_postfix(engine, delta)
            logger.info("%s: %d/%s, step %s, epsilon %s", desc, n, total or "?", p["step"], p["eps"])
    if not disable:
        p = epsilon_postfix(engine, delta)
        logger.info("%s: done (%d items), step %s, epsilon %s", desc, n, p["step"], p["eps"])
