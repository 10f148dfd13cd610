"""Find modules that prevent private training, and replace BatchNorm by GroupNorm.

Per-sample clipping bounds each example's influence only if the forward pass of example ``i`` depends on example
``i`` alone, and the released model contains nothing computed from the private data without noise. The checks:

=================================================  =============================================================
module, configuration                              why it is a problem
=================================================  =============================================================
BatchNorm (1d/2d/3d, lazy, SyncBatchNorm) in       normalises with statistics of the batch (mixes samples; across
train mode                                         processes for SyncBatchNorm) and updates the running statistics
                                                   from private data without noise
BatchNorm in eval mode with                        still normalises with batch statistics
``track_running_stats=False``
InstanceNorm with ``track_running_stats=True`` in  updates running statistics from private data without noise;
train mode                                         they are released with the model
Embedding / EmbeddingBag with ``max_norm``         renormalises the rows looked up by the batch in place during
                                                   forward: the weight changes with the private data
Embedding / EmbeddingBag with                      the gradient scale depends on token frequencies over the batch
``scale_grad_by_freq=True`` (trainable)            (mixes samples)
Embedding / EmbeddingBag with ``sparse=True``      sparse gradients are not supported
(trainable)
MultiheadAttention, TransformerEncoderLayer,       tensors are ``(T, B, ...)`` while fastdp takes dimension 0 as
TransformerDecoderLayer, RNN/LSTM/GRU with         the batch
``batch_first=False``
=================================================  =============================================================

BatchNorm in eval mode with running statistics is fine, whether its affine parameters are frozen or trainable: it
is a fixed per-channel affine map applied to each sample. Keep it in eval mode: a later ``model.train()`` puts it
back in train mode.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

logger = logging.getLogger(__name__)

#: default upper bound on the number of groups chosen by :func:`fix` (the GroupNorm paper's 32).
MAX_GROUPS = 32

_BATCH_FIRST_TYPES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention, nn.TransformerEncoderLayer,
                                                   nn.TransformerDecoderLayer, nn.RNNBase)


def _where(path: str, module: nn.Module) -> str:
    return f"module {path or '<model>'!r} ({type(module).__name__})"


def _batch_first(module: nn.Module) -> bool | None:
    """``batch_first`` of the module, or of its ``self_attn`` (Transformer layers keep it there); None if unknown."""
    for m in (module, getattr(module, "self_attn", None)):
        value = getattr(m, "batch_first", None) if m is not None else None
        if isinstance(value, bool):
            return value
    return None


def _requires_grad(module: nn.Module, name: str) -> bool:
    p = getattr(module, name, None)
    return isinstance(p, torch.Tensor) and p.requires_grad


def find_problems(model: nn.Module) -> list[str]:
    """Human-readable problems that prevent private training of ``model`` in its current modes, one per finding.

    Each message starts with ``module '<path>' (<Type>)`` (``'<model>'`` for the root), says why, and how to fix it.
    An empty list means none of the checks in the module docstring fired; it does not prove that the model is
    per-sample (a custom forward or the loss can still mix samples).

    Raises:
        ValueError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    problems: list[str] = []
    time_major: list[str] = []
    for path, m in model.named_modules():
        where = _where(path, m)
        if isinstance(m, _BatchNorm):
            if m.training:
                mix = ("synchronises batch statistics across processes" if isinstance(m, nn.SyncBatchNorm)
                       else "normalises with statistics of the batch")
                problems.append(f"{where} is in train mode: it {mix}, which mixes the samples of a batch (no "
                                "per-sample gradient exists), and updates running statistics from private data. "
                                "Fix: fastdp.validate.fix(model) replaces it with GroupNorm; or keep it with "
                                "frozen statistics: call .eval() on it and freeze its parameters")
            elif m.running_mean is None:
                problems.append(f"{where} has track_running_stats=False, so even in eval mode it normalises with "
                                "statistics of the batch (mixes samples). Fix: fastdp.validate.fix(model) replaces "
                                "it with GroupNorm")
        elif isinstance(m, _InstanceNorm):
            if m.track_running_stats and m.training:
                problems.append(f"{where} has track_running_stats=True in train mode: it updates running statistics "
                                "from private data without noise, and they are released with the model. Fix: "
                                "construct it with track_running_stats=False")
        elif isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            if m.max_norm is not None:
                problems.append(f"{where} has max_norm={m.max_norm}: forward renormalises the looked-up rows of the "
                                "weight in place, so the weight changes with the private data. Fix: max_norm=None")
            if m.scale_grad_by_freq and _requires_grad(m, "weight"):
                problems.append(f"{where} has scale_grad_by_freq=True: the gradient is scaled by token frequencies "
                                "over the batch, which mixes samples. Fix: scale_grad_by_freq=False")
            if m.sparse and _requires_grad(m, "weight"):
                problems.append(f"{where} has sparse=True: sparse gradients are not supported. Fix: sparse=False")
        if isinstance(m, _BATCH_FIRST_TYPES) and _batch_first(m) is False:
            if any(p == "" or path.startswith(p + ".") for p in time_major):
                continue  # e.g. the self_attn of a layer already reported
            time_major.append(path)
            problems.append(f"{where} has batch_first=False: its tensors are (T, B, ...) while fastdp takes "
                            "dimension 0 as the batch, so layers that see them would treat time steps as samples. "
                            "Fix: construct it with batch_first=True and feed (B, T, ...) tensors")
    return problems


def check(model: nn.Module) -> None:
    """Raise ``ValueError`` listing every :func:`find_problems` finding; do nothing if there is none."""
    problems = find_problems(model)
    if problems:
        raise ValueError("the model cannot be trained privately as it is:\n  - " + "\n  - ".join(problems))


def default_num_groups(num_channels: int, max_groups: int = MAX_GROUPS) -> int:
    """The largest divisor of ``num_channels`` that is ``<= max_groups``.

    E.g. 64 -> 32, 48 -> 24, 100 -> 25, 3 -> 3, 37 -> 1. (Opacus uses ``gcd(32, C)``, the largest divisor that also
    divides 32: 48 -> 16, 100 -> 4.)
    """
    if isinstance(num_channels, bool) or not isinstance(num_channels, int) or num_channels < 1:
        raise ValueError(f"num_channels={num_channels!r} must be a positive integer")
    return max(g for g in range(1, min(num_channels, max_groups) + 1) if num_channels % g == 0)


def _group_norm_for(bn: _BatchNorm, path: str, num_groups: int | None) -> nn.GroupNorm:
    if isinstance(bn, nn.modules.lazy.LazyModuleMixin) and bn.has_uninitialized_params():
        raise ValueError(f"{_where(path, bn)} is a lazy BatchNorm that has not seen an input yet, so its number of "
                         "channels is unknown; run one forward pass before fastdp.validate.fix(model)")
    c = bn.num_features
    if num_groups is None:
        # BatchNorm1d usually sees (B, C) features: one channel per group would normalise single numbers to 0.
        g = 1 if isinstance(bn, nn.BatchNorm1d) else default_num_groups(c)
    else:
        g = num_groups
        if c % g:
            divisors = [d for d in range(1, c + 1) if c % d == 0]
            raise ValueError(f"num_groups={g} does not divide the {c} channels of {_where(path, bn)}; choose one "
                             f"of {divisors}, or num_groups=None for the default")
    ref = bn.weight if bn.weight is not None else bn.running_mean
    factory = {} if ref is None else {"device": ref.device, "dtype": ref.dtype}
    gn = nn.GroupNorm(g, c, eps=bn.eps, affine=bn.affine, **factory)
    if bn.affine:
        with torch.no_grad():
            gn.weight.copy_(bn.weight)
            gn.bias.copy_(bn.bias)
        gn.weight.requires_grad_(bn.weight.requires_grad)
        gn.bias.requires_grad_(bn.bias.requires_grad)
    gn.train(bn.training)
    return gn


def fix(model: nn.Module, num_groups: int | None = None) -> nn.Module:
    """Replace every BatchNorm (BatchNorm1d/2d/3d, their lazy forms, SyncBatchNorm) by ``nn.GroupNorm``, in place.

    Each replacement has the BatchNorm's number of channels ``C``, its ``eps``, ``affine`` iff it was affine (the
    learned per-channel ``weight``/``bias`` are copied, with their ``requires_grad``), its device, dtype and train
    mode. Running statistics are dropped (GroupNorm normalises each sample with its own statistics). The number of
    groups ``G``:

    * ``num_groups`` if given; it must divide every replaced ``C`` (``ValueError`` naming the module otherwise);
    * by default, for BatchNorm2d/3d, the largest divisor of ``C`` that is ``<= 32`` (:func:`default_num_groups`);
      for BatchNorm1d, ``1`` (normalise over all features of the sample): BatchNorm1d usually sees ``(B, C)``
      inputs, where a group of one channel holds a single number and normalises it to 0, erasing the signal (the
      failure of Opacus issue #567 with ``gcd(32, C)`` groups). The same happens with 2d/3d inputs whose spatial
      size is 1 when ``C <= 32``: pass ``num_groups`` there.

    A BatchNorm registered at several places is replaced by one shared GroupNorm. Each replacement is logged at
    INFO level. Call it before building the optimizer (the GroupNorm parameters are new tensors).

    Returns:
        ``model`` (or the new GroupNorm if ``model`` itself is a BatchNorm, which cannot be replaced in place).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if num_groups is not None and (isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1):
        raise ValueError(f"num_groups={num_groups!r} must be a positive integer or None")
    if isinstance(model, _BatchNorm):
        gn = _group_norm_for(model, "", num_groups)
        logger.info("fastdp.validate.fix: <model> %s -> %s", model, gn)
        return gn
    paths = {id(m): p for p, m in model.named_modules()}
    new: dict[int, nn.GroupNorm] = {}
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if not isinstance(child, _BatchNorm):
                continue
            if id(child) not in new:
                path = paths.get(id(child), name)
                new[id(child)] = _group_norm_for(child, path, num_groups)
                logger.info("fastdp.validate.fix: %s %s -> %s", path, child, new[id(child)])
            setattr(parent, name, new[id(child)])
    if not new:
        logger.info("fastdp.validate.fix: no BatchNorm to replace")
    return model


__all__ = ["MAX_GROUPS", "check", "default_num_groups", "find_problems", "fix"]
