"""The batch size of a forward call, from the agreement of its tensor inputs.

Per-sample inputs have the batch dimension first; inputs shared by the whole batch have leading size 1 (HF position
ids ``(1, T)``) or are not tensors. The batch size ``B`` of a call is therefore the leading size, other than 1, that
the most tensor inputs share (all of them in the usual case); 1 when every tensor input has leading size 1 (a batch
of one). Taking the first tensor argument instead gets ``B = 1`` for a model whose first argument is a shared
``(1, T)`` tensor, and then every output is taken for one value broadcast over the batch.

Two different leading sizes other than 1, equally common, do not identify the batch: :func:`infer_batch_size`
refuses them (:class:`AmbiguousBatchError`) rather than guess, naming the shapes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


class AmbiguousBatchError(ValueError):
    """The tensor inputs of a forward call disagree about the batch size."""


def infer_batch_size(args: tuple[Any, ...], kwargs: dict[str, Any], *, where: str = "the model") -> int | None:
    """The batch size of a forward call with inputs ``args``, ``kwargs`` (``None`` if no input tensor has a
    dimension).

    Leading sizes ``n_j`` of the tensor inputs with at least one dimension; among those ``!= 1``, the most common
    one; ``1`` if there are none. Raises :class:`AmbiguousBatchError` when two or more sizes ``!= 1`` are equally
    most common.
    """
    shapes = [tuple(leaf.shape) for leaf in tree_flatten((args, kwargs))[0]
              if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1]
    if not shapes:
        return None
    counts = Counter(s[0] for s in shapes if s[0] != 1)
    if not counts:
        return 1
    ranked = counts.most_common()
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        tied = sorted(n for n, c in ranked if c == ranked[0][1])
        raise AmbiguousBatchError(
            f"cannot tell the batch size of this forward call of {where}: its tensor inputs have shapes "
            f"{shapes}, and the leading sizes {tied} are equally common. fastdp takes the batch size from the "
            "leading dimension that the inputs agree on; a per-sample input needs the batch dimension first, a "
            "tensor shared by the whole batch leading size 1 (or make it a buffer or a parameter of the model).")
    return ranked[0][0]


__all__ = ["AmbiguousBatchError", "infer_batch_size"]
