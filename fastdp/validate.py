"""Find modules that prevent private training, and replace BatchNorm by GroupNorm.

Per-sample clipping bounds each example's influence only if the forward pass of example ``i`` depends on example
``i`` alone, and the released model contains nothing computed from the private data without noise. The checks are
the refusal rules of the layer registry (:func:`fastdp.layers.registry.refusals`), declared by each layer kind in
its file under ``fastdp/layers/kinds/`` and by the generic path -- the rules the engine applies, so this module
keeps no copy. At the time of writing they are: BatchNorm (any, SyncBatchNorm and lazy included) in train mode, or
in eval mode without running statistics; InstanceNorm with ``track_running_stats=True`` in train mode; Embedding /
EmbeddingBag with ``max_norm``, or (trainable) ``scale_grad_by_freq`` or ``sparse``; MultiheadAttention,
Transformer encoder/decoder layers and RNNs with ``batch_first=False``. docs/internals/engine.md's supported-layer table
lists them per layer.

BatchNorm in eval mode with running statistics is fine, whether its affine parameters are frozen or trainable: it
is a fixed per-channel affine map applied to each sample. Keep it in eval mode: a later ``model.train()`` puts it
back in train mode.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from fastdp import norm_act
from fastdp.layers.registry import refusals
from fastdp.torch_api import BatchNormBase as _BatchNorm
from fastdp.torch_api import tree_map

logger = logging.getLogger(__name__)

#: default upper bound on the number of groups chosen by :func:`fix` (the GroupNorm paper's 32).
MAX_GROUPS = 32


def _where(path: str, module: nn.Module) -> str:
    return f"module {path or '<model>'!r} ({type(module).__name__})"


def find_problems(model: nn.Module) -> list[str]:
    """Human-readable problems that prevent private training of ``model`` in its current modes, one per finding.

    The checks are the refusal rules of the layer registry (:func:`fastdp.layers.registry.refusals`: every layer
    kind's and the generic path's), the same the engine applies; each finding is ``module '<path>' (<Type>)``
    (``'<model>'`` for the root) followed by the rule's message, which says why and how to fix it. A rule with
    ``covers_subtree`` reports a module but not its descendants that it also matches.
    An empty list means none of the checks fired; it does not prove that the model is per-sample (a custom forward
    or the loss can still mix samples).

    Raises:
        ValueError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    rules = refusals()
    problems: list[str] = []
    reported: dict[int, list[str]] = {}  # rule index -> paths reported by a covers_subtree rule
    for path, m in model.named_modules():
        for k, rule in enumerate(rules):
            if not rule.applies(m):
                continue
            if rule.covers_subtree:
                above = reported.setdefault(k, [])
                if any(p == "" or path.startswith(p + ".") for p in above):
                    continue  # e.g. the self_attn of a layer already reported
                above.append(path)
            problems.append(f"{_where(path, m)} {rule.message(m)}")
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


def _replace(bn: _BatchNorm, path: str, num_groups: int | None) -> nn.Module:
    """The GroupNorm for ``bn``, with its fused activation and drop layer kept (:func:`fastdp.norm_act.replacement`);
    logged."""
    where = _where(path, bn)
    out = norm_act.replacement(bn, _group_norm_for(bn, path, num_groups), where)
    if isinstance(out, norm_act.GroupNormAct):
        logger.info("fastdp.validate.fix: %s %s -> %s (its fused activation %s and drop layer %s kept: "
                    "act(drop(GroupNorm(x))))", path or "<model>", bn, out.norm, type(out.act).__name__,
                    type(out.drop).__name__)
    else:
        logger.info("fastdp.validate.fix: %s %s -> %s", path or "<model>", bn, out)
    return out


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

    A BatchNorm with a fused activation (timm's ``BatchNormAct2d``: ``act(drop(BN(x)))``) becomes a
    :class:`fastdp.norm_act.GroupNormAct`, ``act(drop(GroupNorm(x)))`` with the BatchNorm's own activation and drop
    layer, its parameters in a plain ``nn.GroupNorm`` child ``.norm`` (clipped by the engine's GroupNorm kind); its
    parameter paths get ``.norm`` (``bn1.weight`` -> ``bn1.norm.weight``). Another BatchNorm subclass that
    overrides ``forward`` is refused (``ValueError`` naming it): what else it computes is unknown.

    A BatchNorm registered at several places is replaced by one shared GroupNorm. Each replacement is logged at
    INFO level (saying so where an activation was kept). Call it before building the optimizer (the GroupNorm
    parameters are new tensors).

    Returns:
        ``model`` (or the replacement if ``model`` itself is a BatchNorm, which cannot be replaced in place).

    Raises:
        ValueError: ``num_groups`` does not divide a BatchNorm's channels; a lazy BatchNorm not yet run; a BatchNorm
            subclass with an unknown ``forward``. The model is then left unchanged.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if num_groups is not None and (isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1):
        raise ValueError(f"num_groups={num_groups!r} must be a positive integer or None")
    if isinstance(model, _BatchNorm):
        return _replace(model, "", num_groups)
    paths = {id(m): p for p, m in model.named_modules()}
    new: dict[int, nn.Module] = {}
    slots = [(parent, name, child) for parent in model.modules() for name, child in parent._modules.items()
             if isinstance(child, _BatchNorm)]
    for _parent, name, child in slots:  # every replacement built (or refused) before the model changes
        if id(child) not in new:
            new[id(child)] = _replace(child, paths.get(id(child), name), num_groups)
    for parent, name, child in slots:
        setattr(parent, name, new[id(child)])
    if not new:
        logger.info("fastdp.validate.fix: no BatchNorm to replace")
    return model


def verify_structure(model: nn.Module, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run the engine's structure probe (:mod:`fastdp.probe`) on ``model(*args, **kwargs)`` in this process, as a
    ``PrivacyEngine``'s first forward call with that input signature would, and leave the model as it was.

    For models whose engine runs with ``verify_structure=False`` (FSDP2 ``fully_shard`` models: their probe would
    run collectives on one rank only): call it on the unsharded model, on one process, with a batch of the shapes
    training will use (batch size >= 2; the same sequence length, image size and keyword arguments), before
    sharding. It verifies that signature only: a later input of another shape is not verified by the sharded engine.
    As the engine does, it verifies the signature at two batch sizes: the batch's ``B``, and (for ``B >= 3``) its
    first ``B - 1`` samples (every input of leading size ``B`` cut to ``B - 1`` rows), a size coprime to ``B``, so
    that rows that depend on the batch size (rolled by a constant that ``B`` hides) show at one of them.

    Returns:
        the probe's statistics (``{"probes", "signatures", "seconds", "eval_retries"}``).

    Raises:
        fastdp.StructureError: the engine's per-sample gradients of ``model`` do not match a batch-of-one
            computation (batch axis not first, samples mixed, ...): the model cannot be trained privately as is.
        ValueError: a batch size below 2, or the probe could not verify this call at both batch sizes (every
            per-sample gradient ~0 at this input); a model the engine refuses raises the engine's error.
        fastdp.StructureError: also when the probe passed only after its fallback, which gives some parameters to
            an ancestor's per-sample replay: an engine with ``verify_structure=False`` does not make that change.
    """
    import warnings

    from fastdp.engine import PrivacyEngine
    from fastdp.layers.batchdim import infer_batch_size
    from fastdp.probe import StructureError

    B = infer_batch_size(args, kwargs)
    if B is None or B < 2:
        raise ValueError(f"verify_structure needs a batch of at least 2 samples (the inputs' leading size is {B}): "
                         "with one sample, samples mixed by the model cannot show")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # noise_multiplier=0: this engine never releases anything
        engine = PrivacyEngine(model, batch_size=1, sample_size=1, noise_multiplier=0.0, distributed=False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    engine.attach(optimizer)
    try:
        with torch.enable_grad():
            model(*args, **kwargs)
            if B >= 3 and engine.probe_stats["signatures"] >= 1:  # the second batch size
                first = tree_map(lambda x: x[:B - 1] if isinstance(x, torch.Tensor) and x.dim() >= 1
                                 and x.shape[0] == B else x, (tuple(args), dict(kwargs)))
                model(*first[0], **first[1])
        stats = dict(engine.probe_stats)
        sizes = sorted(n for s in engine._capture.probe.sizes.values() for n in s)
        moved = {k or "<root>": list(v) for k, v in engine._extra_owned.items()}
    finally:
        engine.detach()
    if stats["signatures"] < 1 or (B >= 3 and len(sizes) < 2):
        raise ValueError(
            f"the structure probe could not verify this call at batch size {B} and at its first {B - 1} samples "
            f"(verified at {sizes}): give a batch whose per-sample gradients are not all ~0, in its first {B - 1} "
            "samples too (e.g. random inputs)")
    if moved:
        raise StructureError(
            f"the structure probe verified this model only after giving parameters to an ancestor's per-sample "
            f"replay ({moved}: a layer output used without its batch dimension, e.g. emb(position_ids)[0], or a "
            "parameter read outside its module's call). An engine with verify_structure=False, as a sharded one "
            "runs, does not make that change, and would release those parameters' gradients wrong. Keep the batch "
            "dimension on such outputs (position ids of shape (1, T), without [0]), tie weights through modules, "
            "or freeze those parameters.")
    logger.info("verify_structure: model verified at this input signature in %.2f s", stats["seconds"])
    return stats


__all__ = ["MAX_GROUPS", "check", "default_num_groups", "find_problems", "fix", "verify_structure"]
