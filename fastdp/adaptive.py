"""Adaptive clipping (Andrew et al. 2021, "Differentially Private Learning with Adaptive Clipping").

With ``clipping_fn="adaptive"`` the clipping threshold ``R_t`` follows a target quantile ``gamma`` of the
per-sample gradient norms, privately. At step ``t`` (logical batch of ``n_t`` samples, expected size ``B``):

* every sample is clipped as with ``"abadi"`` at ``R_t``: ``C_i = min(1, R_t / (||g_i|| + 1e-6))``;
* besides the noisy clipped sum, the step releases the *centred* count of unclipped samples
  ``c~_t = sum_i (b_i - 1/2) + N(0, sigma_b^2)``, ``b_i = 1[||g_i|| <= R_t]`` (``sigma_b`` =
  ``count_noise_multiplier``, in samples). Adding or removing one sample moves it by 1/2;
* the noisy fraction of unclipped samples is ``b~_t = c~_t / B + 1/2`` (post-processing; equal to
  ``sum_i b_i / B`` when ``n_t = B`` and without noise), clipped to [0, 1], and the threshold moves geometrically:
  ``R_{t+1} = R_t * exp(-eta (clip(b~_t, 0, 1) - gamma))`` (``eta`` = ``learning_rate``). The history keeps
  ``b~_t`` as released (unclipped: its mean is an unbiased estimate of the fraction of unclipped samples).

Privacy. The step releases two Gaussian mechanisms on the same Poisson-sampled batch: the clipped sum
(sensitivity ``R_t``, noise std ``sigma_grad R_t``) and the centred count (sensitivity 1/2, noise std
``sigma_b``). Stacked and each divided by its noise std, they are one Gaussian mechanism with unit noise whose
sensitivity is ``sqrt(sigma_grad^-2 + (2 sigma_b)^-2)``, i.e. one Gaussian release with noise multiplier
``z = (sigma_grad^-2 + (2 sigma_b)^-2)^(-1/2)`` (the paper's Theorem 1). The engine's ``noise_multiplier`` (given,
or calibrated from ``target_epsilon``) is that ``z``: it is what the accountant records for each step
(``PoissonSampledGaussian(z, q)``, exact), and the gradient gets the larger
``sigma_grad = (z^-2 - (2 sigma_b)^-2)^(-1/2)``, which needs ``2 sigma_b > z``. ``R_t`` depends on the data only
through the released noisy counts, so it is post-processing. ``sigma_b = 0`` (an exact count) is accepted only
with ``noise_multiplier = 0`` (nothing private: a test of the mechanism).

Several ranks: each rank adds its samples' ``b_i - 1/2`` to one extra float64 element of the clipped sums'
all-reduce; rank 0 adds the count noise there (:meth:`fastdp.release.Release._release_reduced`), so every rank
gets the same noisy count and the same ``R_{t+1}``.

This module owns the configuration (:class:`AdaptiveClipping`), its checks (:func:`resolve`) and the state
(:class:`AdaptiveState`: ``R_t``, the history of noisy fractions, checkpoints). It touches nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fastdp.noise import secure_gaussian

#: the ``clipping_fn`` that turns adaptive clipping on
ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class AdaptiveClipping:
    """Settings of adaptive clipping (pass as ``PrivacyEngine(..., clipping_fn="adaptive", adaptive_clipping=...)``).

    Args:
        target_quantile: ``gamma`` in (0, 1): the fraction of samples that should be left unclipped (the paper
            recommends 0.5; higher keeps more samples unclipped, a larger ``R``).
        learning_rate: ``eta > 0`` of the geometric update ``R <- R exp(-eta (b~ - gamma))`` (paper: 0.2).
        count_noise_multiplier: ``sigma_b``, the standard deviation of the noise on the count of unclipped samples,
            in samples. Default ``batch_size / 20`` (the paper's choice: the noisy fraction has std 0.05). Must be
            ``> noise_multiplier / 2``; ``0`` only with ``noise_multiplier = 0``.
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise_multiplier: float | None = None


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def grad_noise_multiplier(z: float, count_noise_multiplier: float) -> float:
    """``sigma_grad = (z^-2 - (2 sigma_b)^-2)^(-1/2)``: the gradient's noise multiplier that makes the step's two
    releases together cost one Gaussian release at ``z`` (``0`` for ``z = 0``). Needs ``2 sigma_b > z``."""
    if z == 0:
        return 0.0
    two_b = 2.0 * count_noise_multiplier
    if not two_b > z:
        raise ValueError(
            f"adaptive clipping: noise_multiplier={z:.6g} (the privacy of each step, count included) needs "
            f"count_noise_multiplier > noise_multiplier / 2 = {z / 2:.6g}, got {count_noise_multiplier:.6g}: the "
            "count's noise alone would cost more than the whole step may. Pass "
            "adaptive_clipping=AdaptiveClipping(count_noise_multiplier=...) larger (e.g. batch_size / 20 or more), "
            "or a larger batch_size.")
    return (z ** -2 - two_b ** -2) ** -0.5


def combined_noise_multiplier(grad_sigma: float, count_noise_multiplier: float) -> float:
    """``z = (sigma_grad^-2 + (2 sigma_b)^-2)^(-1/2)``: one Gaussian release equivalent to the pair."""
    if grad_sigma == 0 or count_noise_multiplier == 0:
        return 0.0
    return (grad_sigma ** -2 + (2.0 * count_noise_multiplier) ** -2) ** -0.5


def resolve(clipping_fn: str, clipping_style: Any, adaptive_clipping: AdaptiveClipping | None, batch_size: int,
            noise_multiplier: float) -> AdaptiveClipping | None:
    """Check the adaptive-clipping arguments of :class:`fastdp.PrivacyEngine`; the settings (defaults filled) or
    ``None`` when adaptive clipping is off. Raises ValueError naming the bad value and the fix."""
    if clipping_fn != ADAPTIVE:
        if adaptive_clipping is not None:
            raise ValueError(f"adaptive_clipping={adaptive_clipping!r} is given but clipping_fn={clipping_fn!r}; "
                             "pass clipping_fn='adaptive' to clip at an adaptive threshold")
        return None
    cfg = AdaptiveClipping() if adaptive_clipping is None else adaptive_clipping
    if not isinstance(cfg, AdaptiveClipping):
        raise ValueError(f"adaptive_clipping must be a fastdp.AdaptiveClipping, got {type(cfg).__name__}")
    if clipping_style != "all-layer":
        raise ValueError(f"clipping_fn='adaptive' supports clipping_style='all-layer' only, got {clipping_style!r}: "
                         "the threshold follows a quantile of the whole per-sample gradient norm. Use "
                         "clipping_style='all-layer'.")
    g = cfg.target_quantile
    if not (_real(g) and 0 < g < 1):
        raise ValueError(f"target_quantile={g!r} must be in (0, 1): it is the fraction of samples left unclipped "
                         "(0.5 is the paper's default)")
    eta = cfg.learning_rate
    if not (_real(eta) and eta > 0):
        raise ValueError(f"learning_rate={eta!r} must be a finite number > 0 (the step of the geometric update of "
                         "R; 0.2 is the paper's default)")
    sb = cfg.count_noise_multiplier
    sb = batch_size / 20.0 if sb is None else sb
    if not (_real(sb) and sb >= 0):
        raise ValueError(f"count_noise_multiplier={sb!r} must be a finite number >= 0 (the std of the noise on the "
                         "count of unclipped samples, in samples)")
    if sb == 0 and noise_multiplier > 0:
        raise ValueError(f"count_noise_multiplier=0 releases the exact count of unclipped samples, which is not "
                         f"private, but noise_multiplier={noise_multiplier:g} > 0 asks for privacy. Give "
                         "count_noise_multiplier > noise_multiplier / 2 (default batch_size / 20).")
    grad_noise_multiplier(noise_multiplier, sb)  # raises if 2 sigma_b <= z
    return AdaptiveClipping(float(g), float(eta), float(sb))


class AdaptiveState:
    """The state of adaptive clipping in one engine: the current threshold and the released noisy fractions.

    Args:
        settings: the checked :class:`AdaptiveClipping`.
        initial_threshold: ``R_0`` (the engine's ``max_grad_norm``).
        batch_size: the expected logical batch size ``B``.
    """

    def __init__(self, settings: AdaptiveClipping, initial_threshold: float, batch_size: int) -> None:
        self.settings = settings
        self.initial_threshold = float(initial_threshold)
        self.batch_size = batch_size
        #: ``R_t``: the threshold the next step clips at
        self.max_grad_norm = self.initial_threshold
        #: ``R_t`` of every released step, in order
        self.thresholds: list[float] = []
        #: ``b~_t`` of every released step: the noisy fraction of unclipped samples (a private release; read it
        #: for the fraction of samples clipped so far)
        self.noisy_unclipped_fractions: list[float] = []

    @property
    def count_noise_multiplier(self) -> float:
        """``sigma_b``: the std of the noise on the count of unclipped samples (in samples)."""
        return float(self.settings.count_noise_multiplier)  # type: ignore[arg-type]

    def grad_noise_multiplier(self, z: float) -> float:
        """The gradient's noise multiplier for a step accounted at ``z`` (see the module docstring)."""
        return grad_noise_multiplier(z, self.count_noise_multiplier)

    def noisy_clipped_fraction(self) -> float | None:
        """``1 - mean_t b~_t``: the fraction of samples clipped so far as estimated from the private noisy counts
        (``None`` before the first step). A private release, no extra cost."""
        h = self.noisy_unclipped_fractions
        return None if not h else 1.0 - sum(h) / len(h)

    def draw_count_noise(self, device: torch.device, generator: torch.Generator | None, secure: bool) -> float:
        """One draw of ``N(0, sigma_b^2)`` (float64; from the engine's generator, or the secure sampler)."""
        sb = self.count_noise_multiplier
        if sb == 0:
            return 0.0
        if secure:
            return float(secure_gaussian((1,), sb, device, torch.float64)[0])
        return float(torch.empty(1, dtype=torch.float64, device=device).normal_(0.0, sb, generator=generator)[0])

    @staticmethod
    def _next(threshold: float, fraction: float, settings: AdaptiveClipping) -> float:
        clamped = min(1.0, max(0.0, fraction))  # the noise can take b~ outside [0, 1] (the paper clips it)
        return threshold * math.exp(-settings.learning_rate * (clamped - settings.target_quantile))

    def update(self, noisy_centred_count: float) -> float:
        """After a released step: record ``b~_t = c~_t / B + 1/2`` and move to ``R_{t+1}``; returns it."""
        fraction = float(noisy_centred_count) / self.batch_size + 0.5
        self.thresholds.append(self.max_grad_norm)
        self.noisy_unclipped_fractions.append(fraction)
        self.max_grad_norm = self._next(self.max_grad_norm, fraction, self.settings)
        return self.max_grad_norm

    def config(self) -> dict[str, Any]:
        """What a checkpoint must match (with ``R_0``)."""
        return {**asdict(self.settings), "initial_threshold": self.initial_threshold}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"noisy_unclipped_fractions": [...]}``: ``R_t`` is recomputed from them on load, never read."""
        return {"noisy_unclipped_fractions": list(self.noisy_unclipped_fractions)}

    def check_state(self, state: Any, steps: int) -> tuple[list[float], list[float], float]:
        """Validate a checkpoint's state for ``steps`` released steps; returns (thresholds, fractions, R_next)
        recomputed from the fractions (raise ValueError naming what is wrong)."""
        fr = state.get("noisy_unclipped_fractions") if isinstance(state, dict) else None
        if not isinstance(fr, Sequence) or isinstance(fr, str) or not all(_real(f) for f in fr):
            raise ValueError(f"state['adaptive_clipping']={state!r} must hold 'noisy_unclipped_fractions', a list of "
                             "finite numbers (saved by state_dict() of an engine with clipping_fn='adaptive')")
        if len(fr) != steps:
            raise ValueError(f"inconsistent checkpoint: {len(fr)} noisy unclipped fractions of adaptive clipping "
                             f"for {steps} released steps; the checkpoint was edited or corrupted")
        r, thresholds = self.initial_threshold, []
        for f in fr:
            thresholds.append(r)
            r = self._next(r, float(f), self.settings)
        if not (math.isfinite(r) and r > 0):
            raise ValueError(f"the checkpoint's noisy fractions give a threshold R={r!r}, not a finite number > 0")
        return thresholds, [float(f) for f in fr], r

    def apply(self, checked: tuple[list[float], list[float], float]) -> None:
        """Apply what :meth:`check_state` returned."""
        self.thresholds, self.noisy_unclipped_fractions, self.max_grad_norm = checked


def refuse_set_sigma(state: AdaptiveState | None, z: float) -> None:
    """``set_noise_multiplier(z)`` under adaptive clipping: refuse a ``z`` the count's noise cannot fit."""
    if state is not None:
        grad_noise_multiplier(z, state.count_noise_multiplier)


__all__ = ["ADAPTIVE", "AdaptiveClipping", "AdaptiveState", "combined_noise_multiplier", "grad_noise_multiplier",
           "resolve"]
