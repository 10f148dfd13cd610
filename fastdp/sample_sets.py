"""Which forward calls of the model one backward pass may merge: the engine's record of ``engine.same_samples()``.

One backward pass that reaches several forward calls of the model takes row ``i`` of every call as sample ``i``
(their records are summed per row, then clipped once: :mod:`fastdp.clipped_sums`). That is right for calls that see
the same samples (two views of each sample, a siamese pair, an output fed back) and wrong for different samples (two
halves of a batch, a labelled and an unlabelled batch), where it would clip two samples as one; merging different
samples, or clipping views apart, bounds what one sample changes by ``2R``, not ``R``. The engine cannot tell them
apart, so the user says which calls are the same samples (:meth:`fastdp.PrivacyEngine.same_samples`), and
:meth:`SampleSets.check` refuses a backward pass that would merge calls not declared so, or that backpropagates
declared calls in separate passes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

#: entries kept per table before the oldest half goes (forward calls that never got a backward pass keep theirs)
_KEEP = 4096


class SampleSets:
    """The forward calls made in ``same_samples()`` blocks (``group_of``: forward id -> the block's group) and the
    backward pass that reached each group's calls (``group_pass``)."""

    def __init__(self) -> None:
        self.group: int | None = None  # the block in progress: its group id
        self.group_of: dict[int, int] = {}
        self.group_pass: dict[int, int] = {}

    @contextlib.contextmanager
    def block(self, first_id: int) -> Iterator[None]:
        """A ``same_samples()`` block; ``first_id``: the id the next forward call gets (the group's id). A nested
        block belongs to the outer one."""
        outer = self.group
        if outer is None:
            self.group = first_id
        try:
            yield
        finally:
            self.group = outer

    def note(self, fid: int) -> None:
        """Forward call ``fid`` starts (an outermost call of the model, or a submodule's hooked call on its own)."""
        if self.group is not None:
            self.group_of[fid] = self.group

    def check(self, done: list[Any], number: int) -> None:
        """Refuse (``RuntimeError``) backward pass ``number`` with records ``done`` if it merges forward calls not
        declared the same samples, or reaches calls of a group that an earlier pass reached."""
        for table in (self.group_of, self.group_pass):
            if len(table) > _KEEP:
                for k in sorted(table)[:_KEEP // 2]:
                    del table[k]
        fids = sorted({r.forward for r in done if not r.rootless})
        # layers of a submodule called on its own carry no call of the model (each record its own id): a module
        # with several such records was called several times, on the same samples only inside one block
        calls: dict[int, list[int]] = {}
        for r in done:
            if r.rootless:
                calls.setdefault(id(r.module), []).append(r.forward)
        again = [type(r.module).__name__ for r in done if r.rootless and len(calls[id(r.module)]) > 1
                 and len({self.group_of.get(f, -1 - f) for f in calls[id(r.module)]}) > 1]
        if again:
            raise RuntimeError(
                f"one backward pass reached several calls of {sorted(set(again))[:4]} made outside a call of the "
                "engine's model (a submodule called on its own, such as model.body(x)) and outside one `with "
                "engine.same_samples():` block. The engine would take row i of every call as the same sample i and "
                "clip their sum once. Call the model itself; if the calls see the same samples (two views of each "
                "sample), run them inside `with engine.same_samples():`; if they see different samples, concatenate "
                "them into one call (torch.cat along dimension 0) or call backward after each call with that call's "
                "own loss. Nothing of this backward pass was released.")
        groups = {self.group_of[f] for r in done if (f := r.forward) in self.group_of}
        split = sorted(g for g in groups if self.group_pass.setdefault(g, number) != number)
        if split:
            raise RuntimeError(
                "a second backward pass reached forward calls of the model made in one `with engine.same_samples():` "
                "block: the block says they see the same samples, so each sample's gradient is the sum over those "
                "calls, clipped once; a backward pass per call would clip each part on its own (a sample then counts "
                "up to twice). Compute one loss from all the block's outputs and call backward once, or, for "
                "different samples, make the calls outside the block. Nothing of this backward pass was released.")
        if len(fids) <= 1 or len({self.group_of.get(f, -1 - f) for f in fids}) == 1:
            return
        raise RuntimeError(
            f"one backward pass reached {len(fids)} forward calls of the model, made outside one `with "
            "engine.same_samples():` block. The engine would take row i of every call as the same sample i and clip "
            "their sum once. If the calls see the same samples (two views of each sample, a siamese pair, an output "
            "fed back), run them inside `with engine.same_samples():`. If they see different samples (a labelled "
            "and an unlabelled batch, two halves of a batch), concatenate them into one call (torch.cat along "
            "dimension 0), or call backward after each call with that call's own loss (each backward pass adds its own "
            "samples to the step, as micro-batches do). "
            "Nothing of this backward pass was released.")
