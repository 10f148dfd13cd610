"""The end of a backward pass, and knowing when it never came.

The engine turns the records of a backward pass into clipped sums once the pass is complete. PyTorch has no public
"end of backward" hook: :func:`torch.autograd.graph.register_multi_grad_hook` (torch 2.14) fires when the gradients
of a set of tensors *known in advance* are computed (``mode="all"``) or when the first of them is (``mode="any"``),
but which hooked outputs a pass reaches, and so when it is complete, is not known before it runs (a loss may use
only some of the forward calls, and several forward calls may share one backward pass). So the engine uses the
execution engine's callback queue (private API, tested with torch 2.14.1), wrapped here in
:func:`queue_end_of_backward`, the only place that touches it.

A queued callback is dropped, not run, when the backward pass raises (a hook raising, out of memory, ...). The
callback object is then released by autograd before the exception reaches the caller; :func:`queue_end_of_backward`
watches for that with :func:`weakref.finalize` and calls ``on_dropped``, so the engine discards the failed pass at
once instead of waiting for the next step. :func:`in_backward` is the fallback check (a callback marked queued
while no backward pass runs was dropped).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from fastdp import torch_api


def in_backward() -> bool:
    """Whether the calling thread runs inside a backward pass (of the autograd engine)."""
    return torch_api.current_graph_task_id() != -1


class _EndOfBackward:
    """The callable queued on the current backward pass; ``state[0]`` turns True once it ran."""

    __slots__ = ("__weakref__", "on_end", "state")

    def __init__(self, on_end: Callable[[], None], state: list[bool]) -> None:
        self.on_end = on_end
        self.state = state

    def __call__(self) -> None:
        self.state[0] = True  # before on_end: an exception of on_end is not a dropped callback
        self.on_end()


def _dropped(state: list[bool], on_dropped: Callable[[], None]) -> None:
    if not state[0]:
        on_dropped()


def queue_end_of_backward(on_end: Callable[[], None], on_dropped: Callable[[], None]) -> None:
    """Run ``on_end()`` when the backward pass in progress completes, or ``on_dropped()`` if it fails first.

    Must be called from inside a backward pass (a tensor hook). ``on_end`` runs on the thread that runs the pass,
    after every gradient of the pass is computed and before ``backward()`` returns; an exception it raises leaves
    ``backward()``. ``on_dropped`` runs when autograd releases the callback without calling it (the pass raised);
    it must not raise.
    """
    state = [False]
    cb = _EndOfBackward(on_end, state)
    weakref.finalize(cb, _dropped, state, on_dropped).atexit = False
    # private API (torch 2.14.1): no public hook runs at the end of a whole backward pass; see the module docstring
    torch_api.queue_engine_callback(cb)


__all__ = ["in_backward", "queue_end_of_backward"]
