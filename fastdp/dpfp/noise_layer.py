r"""The DP-FP representation noise layer (Du & Mi, "DP-Forward", Eq. (8)-(9)).

For a representation tensor ``h`` of shape ``(B, *rest)`` (dim 0 = sample, the other dims flattened into one vector of
size ``k = prod(rest)``), in training mode:

.. math::  \tilde h_i = h_i \cdot \min\left(1, \frac{C}{\lVert h_i \rVert_2}\right) + \mathcal N(0, (s C)^2 I_k)

with ``C = clip_norm`` and ``s = noise_multiplier``; a fresh noise vector per sample per forward. In eval mode the layer
is the identity. The layer alone guarantees nothing: what is private, and under which adjacency, is worked out in
docs/guide/dpfp.md and enforced by :class:`fastdp.dpfp.DPForwardPass`.

Insertion without editing the model: :func:`insert_noise` registers a hook on a named submodule that noises its input
(``where="input"``, e.g. the classifier head) or its output (``where="output"``, e.g. ``"bert.pooler"``), and returns a
removable handle. A tensor the user computes can also be passed to the layer directly: ``noise(tensor)``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from fastdp.noise import secure_gaussian

__all__ = ["NoiseHandle", "RepresentationNoise", "insert_noise"]

logger = logging.getLogger(__name__)


def _check_positive(name: str, value: Any, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        need = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value!r} must be a finite number {need}")
    return float(value)


class RepresentationNoise(nn.Module):
    """Per-sample clipping to L2 norm ``<= clip_norm`` plus Gaussian noise of std ``noise_multiplier * clip_norm``.

    Args:
        clip_norm: ``C > 0``; each sample's flattened representation is scaled by ``min(1, C / ||h_i||)``.
        noise_multiplier: ``s >= 0``; the noise std is ``s * C`` per coordinate. ``s = 0`` clips without noise (no
            privacy; :class:`~fastdp.dpfp.DPForwardPass` refuses it).
        generator: a ``torch.Generator`` for the noise (reproducible runs); default torch's global RNG. If it lives
            on another device than the input, the noise is drawn there and moved.
        secure_mode: draw the noise with :func:`fastdp.noise.secure_gaussian` (fresh OS-CSPRNG-seeded generators and
            the floating-point attack mitigation of docs/guide/secure-mode.md); refuses ``generator``.

    Shapes: input ``(B, *rest)`` with ``B >= 0`` and at least one dim; output the same shape and dtype. ``B = 0``
    returns the (empty) input. Gradients flow through the clipping into the input.
    """

    def __init__(self, clip_norm: float, noise_multiplier: float, *,
                 generator: torch.Generator | None = None, secure_mode: bool = False) -> None:
        super().__init__()
        if secure_mode and generator is not None:
            raise ValueError("secure_mode=True draws the noise from the OS CSPRNG and refuses a seeded generator "
                             "(a known seed makes the noise predictable); pass generator=None")
        self.secure_mode = bool(secure_mode)
        self.clip_norm = _check_positive("clip_norm", clip_norm)
        self.noise_multiplier = _check_positive("noise_multiplier", noise_multiplier, allow_zero=True)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        self.generator = generator

    @property
    def noise_std(self) -> float:
        """``noise_multiplier * clip_norm``, the per-coordinate noise standard deviation."""
        return self.noise_multiplier * self.clip_norm

    def clip(self, h: torch.Tensor) -> torch.Tensor:
        """``h_i * min(1, C / ||h_i||)`` per sample (dim 0), without noise; shape ``(B, *rest)``.

        Half precision (float16, bfloat16): computed in float32 and rounded once at the end; rounding to nearest
        can lengthen a row by the unit roundoff ``u = eps / 2`` (0.4 % in bfloat16), so such rows are clipped to
        ``C / (1 + eps)`` and every returned row has norm at most ``C`` (the sensitivity bound holds exactly)."""
        if h.dim() == 0:
            raise ValueError("RepresentationNoise needs a tensor with a sample dimension (dim 0), got a scalar")
        flat = h.reshape(h.shape[0], -1)
        low = flat.dtype in (torch.float16, torch.bfloat16)
        work = flat.float() if low else flat
        bound = self.clip_norm / (1.0 + torch.finfo(flat.dtype).eps) if low else self.clip_norm
        norms = work.norm(dim=1)
        scale = torch.where(norms > bound, bound / norms.clamp_min(1e-30), torch.ones_like(norms))
        return (work * scale.unsqueeze(1)).to(flat.dtype).reshape(h.shape)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Clip and noise in training mode; identity in eval mode. ``(B, *rest) -> (B, *rest)``."""
        if not isinstance(h, torch.Tensor):
            raise TypeError(f"RepresentationNoise expects a tensor, got {type(h).__name__}")
        if h.dim() == 0:
            raise ValueError("RepresentationNoise needs a tensor with a sample dimension (dim 0), got a scalar")
        if not self.training or h.shape[0] == 0:
            return h
        if not h.is_floating_point():
            raise TypeError(f"RepresentationNoise expects a floating-point representation, got dtype {h.dtype}")
        clipped = self.clip(h)
        if self.noise_multiplier == 0.0:
            return clipped
        if self.secure_mode:
            return clipped + secure_gaussian(h.shape, self.noise_std, device=h.device, dtype=h.dtype)
        gen = self.generator
        dev = h.device if gen is None else gen.device
        noise = torch.randn(h.shape, generator=gen, device=dev, dtype=h.dtype)
        return clipped + noise.to(h.device) * self.noise_std

    def extra_repr(self) -> str:
        secure = ", secure_mode=True" if self.secure_mode else ""
        return f"clip_norm={self.clip_norm:g}, noise_multiplier={self.noise_multiplier:g}{secure}"


class NoiseHandle:
    """What :func:`insert_noise` returns: ``remove()`` takes the hook off; ``module``, ``name``, ``where``, ``noise``
    describe it."""

    def __init__(self, hook: Any, module: nn.Module, name: str, where: str, noise: nn.Module) -> None:
        self._hook = hook
        self.module, self.name, self.where, self.noise = module, name, where, noise

    def remove(self) -> None:
        """Remove the hook (idempotent)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @property
    def active(self) -> bool:
        """Whether the hook is still registered."""
        return self._hook is not None


def insert_noise(model: nn.Module, name: str, noise: nn.Module, where: str = "input",
                 check: Any = None) -> NoiseHandle:
    """Apply ``noise`` to the input (``where="input"``) or output (``"output"``) of ``model.get_submodule(name)``.

    ``"input"`` noises the first positional argument of the submodule's forward (e.g. the pooled ``[CLS]`` vector
    entering ``"classifier"``); ``"output"`` noises the submodule's output, which must be a tensor. The noise is applied
    while ``model.training`` is true and is the identity after ``model.eval()``.
    ``check`` (optional) is called with no arguments before each training-mode application (used by
    :class:`~fastdp.dpfp.DPForwardPass` to re-check the trainable set).

    Raises:
        ValueError: ``name`` is not a submodule of ``model`` (the message lists a few names), or ``where`` is not
            ``"input"`` / ``"output"``.
    """
    if where not in ("input", "output"):
        raise ValueError(f"where={where!r} must be 'input' (noise the submodule's input) or 'output'")
    try:
        sub = model.get_submodule(name)
    except AttributeError as exc:
        names = [n for n, _ in model.named_modules() if n][:12]
        raise ValueError(f"model has no submodule {name!r}; some of its submodules: {names}") from exc

    def apply(h: Any) -> Any:
        noise.train(model.training)
        if not isinstance(h, torch.Tensor):
            raise TypeError(f"the {where} of {name!r} is a {type(h).__name__}, not a tensor; name a submodule whose "
                            f"{where} is the representation tensor")
        if model.training and check is not None:
            check()
        return noise(h)

    if where == "input":
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            if args:
                return (apply(args[0]), *args[1:]), kwargs
            if len(kwargs) == 1:
                key = next(iter(kwargs))
                return args, {key: apply(kwargs[key])}
            raise TypeError(f"{name!r} was called without a positional input; cannot find the representation")

        hook = sub.register_forward_pre_hook(pre_hook, with_kwargs=True)
    else:
        def post_hook(module: nn.Module, args: tuple, output: Any) -> Any:
            return apply(output)

        hook = sub.register_forward_hook(post_hook)
    logger.debug("DP-FP noise inserted at the %s of %r (%r)", where, name, noise)
    return NoiseHandle(hook, sub, name, where, noise)
