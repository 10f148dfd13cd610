"""What :func:`fastdp.validate.fix` puts in place of a BatchNorm with a fused activation (timm's ``BatchNormAct2d``).

timm fuses the activation (and a drop layer) into its BatchNorm: ``BatchNormAct2d(x) = act(drop(BN(x)))``, a
subclass of ``nn.BatchNorm2d`` whose ``forward`` does all three. Replacing it by a plain ``nn.GroupNorm`` would drop
the activation and change the model. :func:`replacement` returns instead a :class:`GroupNormAct`:
``act(drop(GroupNorm(x)))`` with the BatchNorm's own ``drop`` and ``act`` modules. Its parameters stay in a plain
``nn.GroupNorm`` child (``.norm``), so the engine clips them per sample with its GroupNorm layer kind (a module
whose ``forward`` also applied the activation would take the slower generic path: the layer kinds handle only
modules whose ``forward`` is the layer's own).

A BatchNorm subclass that overrides ``forward`` in another way is refused (``ValueError`` naming it): ``fix``
cannot know what else its forward computes, and a plain GroupNorm in its place could change the model silently.

It may touch: nothing (it builds new modules; :func:`fastdp.validate.fix` puts them in the model).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

#: BatchNorm subclasses whose forward is ``act(drop(batch_norm(x)))`` with child modules ``drop`` and ``act``
#: (timm >= 0.9 and its older ``timm.models.layers`` path)
FUSED = frozenset({
    "timm.layers.norm_act.BatchNormAct2d", "timm.layers.norm_act.SyncBatchNormAct",
    "timm.models.layers.norm_act.BatchNormAct2d", "timm.models.layers.norm_act.SyncBatchNormAct"})
#: where torch's own BatchNorm forwards are defined (BatchNorm1d/2d/3d, lazy, SyncBatchNorm)
_TORCH_BATCHNORM = "torch.nn.modules.batchnorm"


class GroupNormAct(nn.Module):
    """``act(drop(norm(x)))``: a GroupNorm followed by the drop layer and the activation of the fused BatchNorm it
    replaced (:func:`fastdp.validate.fix`).

    Shapes: ``x`` ``(B, C, *)`` -> ``(B, C, *)``. ``norm`` is a plain ``nn.GroupNorm`` (its ``weight`` and ``bias``,
    per channel, are the trainable parameters, clipped by the engine's GroupNorm kind); ``drop`` and ``act`` are the
    replaced module's (``nn.Identity`` where it had none). ``num_groups``, ``num_channels``, ``eps`` and ``affine``
    read the GroupNorm's.

    The state dict holds ``norm.weight`` and ``norm.bias``; a state dict of a plain GroupNorm in its place (keys
    ``weight`` and ``bias``, as ``fix`` wrote before it kept the activation) loads too.
    """

    def __init__(self, norm: nn.GroupNorm, drop: nn.Module | None = None, act: nn.Module | None = None) -> None:
        super().__init__()
        if type(norm) is not nn.GroupNorm:
            raise ValueError(f"GroupNormAct needs a plain nn.GroupNorm, got {type(norm).__name__}")
        self.norm = norm
        self.drop = nn.Identity() if drop is None else drop
        self.act = nn.Identity() if act is None else act
        self.register_load_state_dict_pre_hook(_legacy_keys)

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.drop(self.norm(x)))

    @property
    def num_groups(self) -> int:
        return self.norm.num_groups

    @property
    def num_channels(self) -> int:
        return self.norm.num_channels

    @property
    def eps(self) -> float:
        return self.norm.eps

    @property
    def affine(self) -> bool:
        return self.norm.affine


def _legacy_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """A plain GroupNorm's keys (``prefix + "weight"``) -> this module's (``prefix + "norm.weight"``)."""
    for key in ("weight", "bias"):
        if prefix + key in state_dict and prefix + "norm." + key not in state_dict:
            state_dict[prefix + "norm." + key] = state_dict.pop(prefix + key)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def replacement(bn: nn.Module, gn: nn.GroupNorm, where: str) -> nn.Module:
    """What replaces the BatchNorm ``bn`` (named ``where`` in errors), given its GroupNorm ``gn``: ``gn`` itself for
    torch's BatchNorms and for a fused one without activation and drop; a :class:`GroupNormAct` keeping ``bn``'s
    ``drop`` and ``act`` modules for a fused BatchNorm (:data:`FUSED`).

    Raises:
        ValueError: ``bn`` is another BatchNorm subclass that overrides ``forward``.
    """
    fwd = type(bn).forward
    if fwd.__module__ == _TORCH_BATCHNORM:
        return gn
    fused = next((c for c in type(bn).__mro__ if _qualified(c) in FUSED), None)
    if fused is None or fused.forward is not fwd:
        raise ValueError(
            f"{where} is a BatchNorm subclass whose forward is {fwd.__qualname__} (not torch's): fastdp.validate.fix "
            "cannot know what else it computes, and a plain GroupNorm in its place could change the model silently. "
            "Replace it yourself by a GroupNorm followed by what its forward adds (fastdp.norm_act.GroupNormAct does "
            "act(drop(GroupNorm(x)))), or keep it in eval mode with its running statistics")
    drop, act = getattr(bn, "drop", None), getattr(bn, "act", None)
    if all(m is None or type(m) is nn.Identity for m in (drop, act)):
        return gn
    return GroupNormAct(gn, drop, act)


__all__ = ["FUSED", "GroupNormAct", "replacement"]
