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

import itertools
import math
from collections import Counter
from typing import Any

import torch

from fastdp.torch_api import tree_flatten


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





_MOE = ("moe", "expert", "router")


def no_batch_message(label: str, type_names: list[str], inputs: list[Any], batch: int | None) -> str | None:
    """Why a module whose outputs have no batch dimension gets no per-sample gradients, when the shapes say why:
    tokens of the whole batch routed to experts (a module or ancestor type named like ``*MoE*``, ``*Experts``,
    ``*Router``), or the batch folded into dimension 0 (leading size ``X = k * B``, Swin's window partition, OPT's
    ``reshape(-1, d)``), or a leading size that is neither. ``type_names``: the module's type name, then its
    ancestors'; ``inputs``: the tensors the module received. ``None`` if no input has a leading size to blame."""
    sizes = [x.shape[0] for x in tree_flatten(inputs)[0] if isinstance(x, torch.Tensor) and x.dim() >= 1]
    if not batch or not sizes or all(s == batch for s in sizes):
        return None
    X = next(s for s in sizes if s != batch)
    head = f"module {label!r} ({type_names[0]})"
    fold = f"size {X} = {X // batch} * {batch}" if X % batch == 0 and X > batch else f"size {X}, batch size {batch}"
    if is_moe(type_names):
        return (f"{head} is part of a mixture-of-experts layer ({' < '.join(type_names[1:3])}): the tokens of the "
                f"whole batch are flattened into dimension 0 ({fold}) and the router sends them to experts across "
                "samples, so the router's and experts' gradients cannot be attributed to samples. Freeze the router "
                "and the experts (train the attention, embeddings and norms), or use a dense model.")
    if X % batch == 0 and X > batch:
        return (f"the batch axis is folded into dimension 0 ({fold}) before {head}, as in Swin's window partition "
                "or x.reshape(-1, d): rows of several samples share that axis, so its parameters' gradients cannot be "
                "attributed to samples. Keep the batch dimension first in the model's forward, or freeze the "
                "module's parameters.")
    return (f"{head} receives inputs with leading size {X}, neither the batch size {batch} nor a multiple of it: the "
            "samples are gathered, routed or mixed before it, so its parameters' gradients cannot be attributed to "
            "samples. Keep the batch dimension first, or freeze the module's parameters.")


def fold_factor(rows: int, batch: int | None) -> int:
    """``k`` when a call's ``rows`` are ``k * batch`` with ``k >= 2`` (the batch folded into dimension 0, as
    ``x.reshape(-1, d)`` on ``(B, T, d)`` or a multiple-choice model's ``(B, C, T) -> (B C, T)`` make it), else 1.

    Row ``r`` is then taken as sample ``r // k``'s: ``reshape``/``view`` flatten the leading dimensions sample-major.
    The shapes cannot show that a model flattened them in that order (``x.transpose(0, 1).reshape(-1, d)`` has the
    same size), so the engine accepts a fold only where the structure probe (:mod:`fastdp.probe`) verified it: per
    input signature, the per-sample gradients of the folded calls against a batch of one each, and every later
    call of the signature must fold its rows by the factor the probe saw. A batch of one needs no verification:
    every row is its one sample's."""
    if not batch or rows <= batch or rows % batch:
        return 1
    return rows // batch


def unfold_rows(t: Any, fold: int) -> Any:
    """A folded call's ``(k B, ...)`` tensor as ``(B, k, ...)`` (a view); anything else unchanged."""
    if fold > 1 and isinstance(t, torch.Tensor) and t.dim() >= 1:
        return t.unflatten(0, (t.shape[0] // fold, fold))
    return t


def input_sizes(args: tuple[Any, ...], kwargs: dict[str, Any], batch: int) -> tuple[int, ...]:
    """The non-batch sizes of a forward call's per-sample tensor inputs (leading size ``batch``), in order: what a
    fold factor that follows the shapes is a product of (``T`` for ``x.reshape(-1, d)`` on ``(B, T, d)``, ``C`` for
    a multiple-choice model's ``(B, C, T)`` ids)."""
    return tuple(s for x in tree_flatten((args, kwargs))[0]
                 if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == batch for s in x.shape[1:])


#: a fold factor is matched against products of at most this many of the inputs' sizes
_RULE_TERMS = 3


def fold_rules(k: int, sizes: tuple[int, ...]) -> set[tuple[Any, ...]]:
    """How a fold factor ``k`` seen with the inputs' ``sizes`` (:func:`input_sizes`) may follow the shapes: the
    constant ``("const", k)``, and ``("dims", idx)`` for every product of up to three of ``sizes`` (by position)
    that equals ``k``. A later call folds "the same way" if one of them gives its factor (:func:`fold_follows`):
    padded lengths change ``T``, and ``reshape(-1, d)`` then folds ``T`` rows per sample."""
    rules: set[tuple[Any, ...]] = {("const", k)}
    sizes = sizes[:12]  # (bounded: a call with many inputs keeps the constant and the first inputs' sizes)
    for n in range(1, _RULE_TERMS + 1):
        for idx in itertools.combinations(range(len(sizes)), n):
            if math.prod(sizes[i] for i in idx) == k:
                rules.add(("dims", idx))
    return rules


def fold_follows(rules: set[tuple[Any, ...]], k: int, sizes: tuple[int, ...]) -> bool:
    """Whether fold factor ``k`` with the inputs' ``sizes`` follows one of ``rules`` (:func:`fold_rules`)."""
    for rule in rules:
        if rule[0] == "const" and rule[1] == k:
            return True
        if rule[0] == "dims" and all(i < len(sizes) for i in rule[1]) and math.prod(sizes[i] for i in rule[1]) == k:
            return True
    return False


def is_moe(type_names: list[str]) -> bool:
    """Whether a module or an ancestor is named like a mixture-of-experts part (``*MoE*``, ``*Expert*``,
    ``*Router*``): its rows are tokens routed across samples, never a fold of the batch."""
    return any(k in t.lower() for t in type_names for k in _MOE)


__all__ = ["AmbiguousBatchError", "fold_factor", "fold_follows", "fold_rules", "infer_batch_size", "input_sizes",
           "is_moe", "no_batch_message", "unfold_rows"]
