r"""DP-FP on a model: insert the noise layer, enforce the case the guarantee covers, count steps, report epsilon.

The guarantee (docs/guide/dpfp.md) covers the released noisy representations, and through post-processing whatever is
trained *above* the noise layer (the head), only if **nothing below the noise layer is trained on the private data**
(and the labels are public). :class:`DPForwardPass` therefore:

* refuses, with :class:`UncoveredTrainingError` naming them, trainable parameters below the noise layer -- at
  construction, at every training-mode forward through the layer, and at every :meth:`~DPForwardPass.step` (a user
  may unfreeze later). "Below" is every parameter not owned by the head's modules (conservative: a parameter shared
  between the head and the rest, e.g. tied weights, counts as below);
* refuses BatchNorm layers in training mode below the noise layer (they mix the samples of a micro-batch, so one
  record moves every row, and their running statistics are an un-noised release);
* with the documented opt-in ``allow_uncovered_encoder_training=True``, lets the run continue but marks it
  **not covered** for good: :meth:`~DPForwardPass.get_privacy_spent` then reports no epsilon.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from fastdp.accounting.calibration import steps_from_epochs
from fastdp.accounting.checks import check_delta
from fastdp.dpfp.accounting import ADJACENCY, dpfp_epsilon, dpfp_noise_multiplier, paper_epsilon
from fastdp.dpfp.noise_layer import RepresentationNoise, insert_noise
from fastdp.dpfp.sampling import MicroBatchSampler

__all__ = ["DPFPPrivacy", "DPForwardPass", "UncoveredTrainingError"]

logger = logging.getLogger(__name__)

NOT_COVERED = ("not covered: parameters below the noise layer were trained on the private data, so their updates "
               "depend on each sample's input directly and the post-processing argument does not apply; no epsilon "
               "is a guarantee for this run (use fastdp.PrivacyEngine, e.g. DP-BiTFiT or full DP fine-tuning)")


class UncoveredTrainingError(RuntimeError):
    """Trainable parameters (or sample-mixing layers) below the DP-FP noise layer: the guarantee would not hold."""


@dataclass(frozen=True)
class DPFPPrivacy:
    """What :meth:`DPForwardPass.get_privacy_spent` reports.

    Attributes:
        covered: whether the run is in the case the guarantee covers (frozen below the noise layer throughout).
        epsilon: the guarantee (:func:`~fastdp.dpfp.dpfp_epsilon`) when covered, else ``None``.
        delta: the delta it is for.
        steps: steps taken (``T``), each of ``micro_batches`` micro-batches of Poisson rate ``sample_rate``.
        adjacency: the neighbouring relation of the guarantee.
        paper_epsilon: the paper's GDP-CLT figure for the same run (Eq. (11)), NOT a guarantee; ``None`` if not
            covered.
        reason: why not covered (empty when covered).
    """

    covered: bool
    epsilon: float | None
    delta: float
    steps: int
    micro_batches: int
    sample_rate: float
    noise_multiplier: float
    adjacency: str
    paper_epsilon: float | None
    reason: str = ""

    def __str__(self) -> str:
        if not self.covered:
            return f"DP-FP after {self.steps} steps: {self.reason}"
        return (f"DP-FP after {self.steps} steps: ({self.epsilon:.4g}, {self.delta:.3g})-DP under {self.adjacency}; "
                f"the paper's GDP-CLT figure (not a guarantee): {self.paper_epsilon:.4g}")


class DPForwardPass:
    """DP-FP on ``model``: noise the input of ``model.get_submodule(head)``, refuse training below it, account.

    Args:
        model: the model; its code is not edited (a forward pre-hook on the head, removable with :meth:`remove`).
        head: name of the submodule above the noise layer (default ``"classifier"``, as in Hugging Face
            ``*ForSequenceClassification``); its parameters may train.
        clip_norm: ``C``, the per-sample representation clip norm.
        noise_multiplier: ``s``, noise std ``s C``; or
        target_epsilon: calibrate ``s`` (:func:`~fastdp.dpfp.dpfp_noise_multiplier`) for the planned run. Give one.
        sample_size: ``D``, the number of training records.
        micro_batches: ``M`` micro-batches per step.
        batch_size: ``B``, expected records per step; the micro-batch rate is ``p = B / (M D)``.
        epochs / steps: the planned run (``T = ceil(epochs D / B)``); needed with ``target_epsilon``.
        delta: the delta of the reported epsilon (the paper uses ``1 / (2 D)``).
        noise_at: name of a submodule whose OUTPUT is noised instead of the head's input (e.g. ``"bert.pooler"``);
            the refusal still treats every parameter outside ``head`` as below the noise layer.
        allow_uncovered_encoder_training: the documented opt-in: train parameters below the noise layer anyway;
            the run is then reported as not covered (no epsilon), permanently.
        generator: for the noise (reproducibility); ``None`` uses torch's global RNG.
        secure_mode: noise from the OS CSPRNG with the floating-point mitigation
            (:class:`~fastdp.dpfp.RepresentationNoise`); :meth:`sampler` then defaults to secure sampling too.

    Call :meth:`step` once per step (after the optimizer step that consumed the step's ``M`` micro-batches).
    """

    def __init__(self, model: nn.Module, head: str = "classifier", *, clip_norm: float,
                 noise_multiplier: float | None = None, target_epsilon: float | None = None,
                 sample_size: int, micro_batches: int, batch_size: int, epochs: float | None = None,
                 steps: int | None = None, delta: float, noise_at: str | None = None,
                 allow_uncovered_encoder_training: bool = False,
                 generator: torch.Generator | None = None, secure_mode: bool = False) -> None:
        self.model = model
        self.head = head
        self.delta = check_delta(delta)
        self.allow_uncovered = bool(allow_uncovered_encoder_training)
        plan = MicroBatchSampler(sample_size, micro_batches, batch_size=batch_size, steps=steps)
        self.sample_size, self.micro_batches, self.sample_rate = plan.sample_size, plan.micro_batches, plan.sample_rate
        if epochs is not None and steps is not None:
            raise ValueError(f"give at most one of epochs={epochs!r} and steps={steps!r}")
        self.planned_steps: int | None = (steps_from_epochs(epochs, self.micro_batches * self.sample_rate)
                                          if epochs is not None else steps)
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError(f"give exactly one of noise_multiplier={noise_multiplier!r} and "
                             f"target_epsilon={target_epsilon!r}")
        if target_epsilon is not None:
            if self.planned_steps is None:
                raise ValueError("target_epsilon needs the planned run: give epochs=... or steps=...")
            noise_multiplier = dpfp_noise_multiplier(target_epsilon, self.delta, self.sample_rate,
                                                     self.micro_batches, self.planned_steps)
            logger.info("DP-FP: noise_multiplier %.4g for epsilon %.4g over %d steps", noise_multiplier,
                        target_epsilon, self.planned_steps)
        if not noise_multiplier or noise_multiplier <= 0:  # type: ignore[operator]
            raise ValueError(f"noise_multiplier={noise_multiplier!r} must be > 0: without noise the representations "
                             "are released as they are and nothing is private")
        try:
            head_module = model.get_submodule(head)
        except AttributeError as exc:
            names = [n for n, _ in model.named_modules() if n][-12:]
            raise ValueError(f"model has no submodule head={head!r}; some of its submodules: {names}") from exc
        self._head_modules = {id(m) for m in head_module.modules()}
        self.noise = RepresentationNoise(clip_norm, float(noise_multiplier), generator=generator,
                                         secure_mode=secure_mode)
        self.steps_taken = 0
        self.uncovered = False
        self.check()
        where, name = ("input", head) if noise_at is None else ("output", noise_at)
        self._gate = _ProbeGate(self.noise)
        self.handle = insert_noise(model, name, self._gate, where=where, check=self.check)
        self.path_verified = False
        self._root_hook = model.register_forward_hook(self._verify_hook, with_kwargs=True)

    # ------------------------------------------------------------------------------------- path probe
    def _verify_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if self.path_verified or self._gate.probe or not module.training:
            return
        self.verify_path(*args, **kwargs)

    def verify_path(self, *args: object, **kwargs: object) -> bool:
        """Check on a batch that the model's output depends on the input only through the noise layer.

        Runs the model once more (eval mode, no grad) with the noised tensor replaced by zeros for every sample: the
        output rows must then all be equal. Rows that differ mean a path from the input to the output that bypasses
        the noise layer (e.g. a skip connection around the head), which the guarantee does not cover: refused with
        :class:`UncoveredTrainingError` (or, with the opt-in, the run is marked not covered). Runs automatically on
        the first training-mode forward with at least 2 samples; returns whether the check was conclusive.
        """
        states = {m: m.training for m in self.model.modules()}
        self._gate.probe, self._gate.seen = True, False
        try:
            self.model.eval()
            with torch.no_grad():
                out = self.model(*args, **kwargs)
        finally:
            self._gate.probe = False
            for m, t in states.items():
                m.training = t
        rows = _output_rows(out)
        if rows is None:
            self.path_verified = True  # nothing per-sample to compare: do not retry at every forward
            warnings.warn(f"DP-FP cannot check that every path goes through the noise layer: the model returns "
                          f"{type(out).__name__} without per-sample rows; call verify_path(...) with inputs for "
                          "which it returns logits", UserWarning, stacklevel=2)
            return False
        if rows.shape[0] < 2 or not self._gate.seen:
            logger.debug("DP-FP path check inconclusive (%d rows, gate reached: %s); will retry", rows.shape[0],
                         self._gate.seen)
            return False
        self.path_verified = True
        flat = rows.reshape(rows.shape[0], -1).double()
        scale = flat.abs().max().clamp_min(1.0)
        if bool(((flat - flat[:1]).abs() > 1e-6 * scale).any()):
            msg = ("the model's output still varies between samples when the noised representation is the same for "
                   f"all of them: some path from the input to the output bypasses the noise layer in front of "
                   f"{self.head!r}, so the output (and the head's gradient) depends on un-noised data. Noise a "
                   "tensor that every path goes through (noise_at=...), or use fastdp.PrivacyEngine")
            if not self.allow_uncovered:
                raise UncoveredTrainingError(msg)
            self.uncovered = True
            warnings.warn(msg + "; run marked NOT covered", UserWarning, stacklevel=2)
        return True

    # ----------------------------------------------------------------------------------------- checks
    def parameters_below(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of every parameter owned by a module outside the head (shared ones included)."""
        below_ids = {id(p) for m in self.model.modules() if id(m) not in self._head_modules
                     for p in m.parameters(recurse=False)}
        seen: set[int] = set()
        out = []
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in below_ids and id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
        return out

    def trainable_below(self) -> list[str]:
        """Names of the trainable (``requires_grad``) parameters below the noise layer."""
        return [n for n, p in self.parameters_below() if p.requires_grad]

    def _mixing_below(self) -> list[str]:
        return [n for n, m in self.model.named_modules()
                if id(m) not in self._head_modules and isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]

    def check(self) -> None:
        """Refuse (or, with the opt-in, mark not covered) trainable parameters / training-mode BatchNorm below the
        noise layer. Runs at construction, at each training forward through the layer, and at :meth:`step`."""
        bn = self._mixing_below()
        if bn:
            raise UncoveredTrainingError(
                f"BatchNorm layer(s) {bn[:8]} below the DP-FP noise layer are in training mode: they normalise with "
                "the statistics of the whole micro-batch, so one record moves every sample's representation (the "
                "per-sample sensitivity 2C no longer holds) and their running statistics are released without "
                "noise. Put them in eval mode (module.eval()) or replace them (fastdp.validate.fix)")
        names = self.trainable_below()
        if not names:
            return
        if self.allow_uncovered:
            if not self.uncovered:
                self.uncovered = True
                warnings.warn(f"DP-FP: {len(names)} trainable parameter(s) below the noise layer (e.g. {names[:3]}); "
                              "allow_uncovered_encoder_training=True, so this run is now reported as NOT covered",
                              UserWarning, stacklevel=3)
            return
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        raise UncoveredTrainingError(
            f"{len(names)} trainable parameter(s) below the DP-FP noise layer (in front of {self.head!r}): {shown}. "
            "DP-FP's guarantee covers only what is trained above the noise layer: the gradient of a parameter below "
            "it depends on each sample's input directly, not only on the noisy representation. Freeze them "
            "(p.requires_grad_(False)), or use fastdp.PrivacyEngine (DP-BiTFiT or full DP fine-tuning) for a "
            "guarantee on the whole model, or pass allow_uncovered_encoder_training=True to train them with no "
            "privacy claim (get_privacy_spent() then says 'not covered')")

    # ----------------------------------------------------------------------------------------- steps
    def step(self, n: int = 1) -> None:
        """Record ``n`` steps (each ``M`` micro-batches) after checking the trainable set again."""
        self.check()
        self.steps_taken += int(n)
        if self.planned_steps is not None and self.steps_taken == self.planned_steps + 1:
            warnings.warn(f"DP-FP: {self.steps_taken} steps taken, more than the {self.planned_steps} planned; "
                          "epsilon now exceeds the planned budget", UserWarning, stacklevel=2)

    def sampler(self, generator: torch.Generator | None = None,
                secure_mode: bool | None = None) -> MicroBatchSampler:
        """The :class:`~fastdp.dpfp.MicroBatchSampler` of the planned run (``T`` steps, one epoch if unplanned);
        ``secure_mode`` defaults to the noise layer's."""
        if secure_mode is None:
            secure_mode = self.noise.secure_mode and generator is None
        return MicroBatchSampler(self.sample_size, self.micro_batches, sample_rate=self.sample_rate,
                                 steps=self.planned_steps, generator=generator, secure_mode=secure_mode)

    def get_privacy_spent(self, delta: float | None = None) -> DPFPPrivacy:
        """The guarantee after the steps taken (``epsilon = 0`` before the first), or "not covered"."""
        delta = self.delta if delta is None else check_delta(delta)
        s, p, m, t = self.noise.noise_multiplier, self.sample_rate, self.micro_batches, self.steps_taken
        if self.uncovered:
            return DPFPPrivacy(False, None, delta, t, m, p, s, ADJACENCY, None, NOT_COVERED)
        if t == 0:
            return DPFPPrivacy(True, 0.0, delta, 0, m, p, s, ADJACENCY, 0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the GDP approximation warning: the figure is labelled as the paper's
            paper = paper_epsilon(s, p, m, t, delta, accountant="gdp")
        eps = dpfp_epsilon(s, p, m, t, delta)
        return DPFPPrivacy(True, eps, delta, t, m, p, s, ADJACENCY, paper)

    def get_epsilon(self, delta: float | None = None) -> float:
        """The covered epsilon, ``inf`` if the run is not covered (never a number presented as a guarantee)."""
        spent = self.get_privacy_spent(delta)
        return math.inf if spent.epsilon is None else spent.epsilon

    def remove(self) -> None:
        """Remove the noise hook and the path check (the model is as before)."""
        self.handle.remove()
        self._root_hook.remove()


class _ProbeGate(nn.Module):
    """The noise layer, or (while ``probe``) zeros shaped like its input (:meth:`DPForwardPass.verify_path`)."""

    def __init__(self, noise: RepresentationNoise) -> None:
        super().__init__()
        self.noise = noise
        self.probe = False
        self.seen = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.probe:
            self.seen = True
            return torch.zeros_like(h)
        self.noise.train(self.training)
        return self.noise(h)


def _output_rows(out: object) -> torch.Tensor | None:
    """The per-sample output tensor of a model call: a tensor, ``.logits``, or the first tensor of a tuple/dict."""
    if isinstance(out, torch.Tensor):
        return out if out.dim() >= 1 else None
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return v
    return None
