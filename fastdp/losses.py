"""Per-sample losses for language models and classifiers: one loss per sample, shape ``(B,)``.

DP training needs the loss that is backpropagated to be the **mean (or sum) over samples of per-sample losses**
``L = (1/B) Σ_i L_i`` (``loss_reduction="mean"``) or ``L = Σ_i L_i`` (``"sum"``), where ``L_i`` depends on sample
``i`` only. The loss Hugging Face models compute from ``labels=`` is a token mean over the *whole batch*,
``Σ_{i,t} ℓ_{i,t} / Σ_j n_j``: each sample's gradient is scaled by ``B n_i / Σ_j n_j``, a factor that depends on
every other sample's number of label tokens, so clipping and the sensitivity bound would be wrong (the engine
refuses it, see :mod:`fastdp.hf_guard`). These helpers average *within* each sample instead::

    logits = model(input_ids, attention_mask=mask).logits            # no labels=
    fastdp.losses.causal_lm_loss(logits, labels).mean().backward()   # engine loss_reduction="mean"

Conventions (those of Hugging Face): a label equal to ``ignore_index`` (default ``-100``, e.g. padding or prompt
tokens) contributes nothing; a sample with no label token gets loss ``0`` (and gradient ``0``, never NaN).
Logits in float16/bfloat16 are upcast to float32 for the cross entropy (as Hugging Face does); float32 and
float64 keep their dtype. An empty batch (``B = 0``) gives a tensor of shape ``(0,)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["per_sample_mean", "causal_lm_loss", "seq2seq_loss", "token_classification_loss",
           "sequence_classification_loss", "check_per_sample_loss"]


def per_sample_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the positions of each sample where ``mask`` is true.

    ``values``: ``(B, T, ...)`` floating; ``mask``: bool of the same shape. Returns ``(B,)`` with
    ``out_i = Σ_t mask_it v_it / max(1, Σ_t mask_it)`` (all trailing dimensions are positions). Masked-out values
    are replaced by 0 before the sum (so a NaN/inf there does not leak into the loss or its gradient); a sample
    with no true position gets 0.
    """
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise ValueError(f"per_sample_mean needs floating-point values, got "
                         f"{getattr(values, 'dtype', type(values).__name__)}")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != values.shape:
        raise ValueError(f"per_sample_mean needs a bool mask of the values' shape {tuple(values.shape)}, got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)} of shape "
                         f"{tuple(getattr(mask, 'shape', ()))}")
    if values.dim() < 1:
        raise ValueError("per_sample_mean needs values with a batch dimension, got a 0-d tensor")
    if values.dim() == 1:  # one position per sample
        values, mask = values[:, None], mask[:, None]
    v = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    total = v.flatten(1).sum(1)
    count = mask.flatten(1).sum(1).clamp(min=1).to(total.dtype)
    return total / count


def _ce_dtype(logits: torch.Tensor) -> torch.Tensor:
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def _check_int_labels(name: str, labels: torch.Tensor, what: str) -> None:
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex() \
            or labels.dtype == torch.bool:
        raise ValueError(f"{name}: labels must be an integer tensor of {what}, got "
                         f"{getattr(labels, 'dtype', type(labels).__name__)}")


def _check_range(name: str, labels: torch.Tensor, num_classes: int, ignore_index: int) -> None:
    """Every label is a class index in [0, num_classes) or ignore_index (one device sync)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= num_classes))
    if labels.numel() and bool(bad.any()):
        v = int(labels[bad][0])
        raise ValueError(f"{name}: label {v} is not a class index in [0, {num_classes}) nor ignore_index="
                         f"{ignore_index}; mark positions without a target with ignore_index")


def _token_loss(name: str, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                shift: bool) -> torch.Tensor:
    """Per-sample token-mean cross entropy: logits (B, T, V), labels (B, T) -> (B,)."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() != 3:
        raise ValueError(f"{name}: logits must be a floating-point tensor of shape (B, T, V), got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)} of shape "
                         f"{tuple(getattr(logits, 'shape', ()))}")
    _check_int_labels(name, labels, "shape (B, T)")
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"{name}: labels of shape {tuple(labels.shape)} do not match logits of shape "
                         f"{tuple(logits.shape)}: need labels (B, T) for logits (B, T, V)")
    B, T, V = logits.shape
    if V == 0:
        raise ValueError(f"{name}: logits have 0 classes (shape {tuple(logits.shape)})")
    if shift:  # position t predicts token t + 1 (Hugging Face's labels= convention for causal LMs)
        logits, labels = logits[:, :-1], labels[:, 1:]
    _check_range(name, labels, V, ignore_index)
    Tn = labels.shape[1]
    lg = _ce_dtype(logits).reshape(B * Tn, V)
    ce = F.cross_entropy(lg, labels.reshape(B * Tn).long(), ignore_index=ignore_index, reduction="none")
    return per_sample_mean(ce.reshape(B, Tn), labels != ignore_index)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                   shift: bool = True) -> torch.Tensor:
    """Per-sample next-token cross entropy of a causal language model.

    ``logits``: ``(B, T, V)``; ``labels``: integer ``(B, T)``, the same ids Hugging Face's ``labels=`` takes
    (usually ``input_ids`` with padding / prompt positions set to ``ignore_index``). With ``shift=True`` (the
    Hugging Face convention) position ``t`` predicts ``labels[:, t + 1]``. Returns ``(B,)``::

        L_i = (1 / n_i) Σ_{t: y_{i,t+1} != ignore}  -log softmax(logits_{i,t})[y_{i,t+1}],

    ``n_i`` the number of sample ``i``'s own label tokens (``L_i = 0`` when ``n_i = 0``).
    """
    return _token_loss("causal_lm_loss", logits, labels, ignore_index, shift)


def seq2seq_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-sample token-mean cross entropy of an encoder-decoder's decoder logits (no shift: Hugging Face
    seq2seq models shift the labels into ``decoder_input_ids`` themselves).

    ``logits``: ``(B, T_dec, V)``; ``labels``: integer ``(B, T_dec)``. Returns ``(B,)`` with
    ``L_i = (1 / n_i) Σ_{t: y_it != ignore} -log softmax(logits_it)[y_it]`` (0 when ``n_i = 0``).
    """
    return _token_loss("seq2seq_loss", logits, labels, ignore_index, False)


def token_classification_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-sample token-mean cross entropy of a token classifier (NER, ...) or a masked LM (no shift).

    ``logits``: ``(B, T, C)``; ``labels``: integer ``(B, T)`` (``ignore_index`` at positions without a target,
    e.g. unmasked tokens of an MLM). Returns ``(B,)`` with
    ``L_i = (1 / n_i) Σ_{t: y_it != ignore} -log softmax(logits_it)[y_it]`` (0 when ``n_i = 0``).
    """
    return _token_loss("token_classification_loss", logits, labels, ignore_index, False)


_PROBLEMS = ("regression", "single_label_classification", "multi_label_classification")


def sequence_classification_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                                 problem_type: str | None = None) -> torch.Tensor:
    """Per-sample loss of a sequence (or image, audio, multiple-choice) classifier, as Hugging Face picks it.

    ``logits``: ``(B, C)``. Returns ``(B,)``. ``problem_type`` (default: inferred like Hugging Face's
    ``config.problem_type``):

    * ``"single_label_classification"`` (integer ``labels`` ``(B,)``, ``C >= 2``):
      ``L_i = -log softmax(logits_i)[y_i]``; ``L_i = 0`` where ``y_i == ignore_index``;
    * ``"regression"`` (``C == 1``, float ``labels`` ``(B,)`` or ``(B, 1)``; or ``C > 1`` with float ``(B, C)``):
      ``L_i = (1/C) Σ_c (logits_ic - y_ic)²`` (MSE);
    * ``"multi_label_classification"`` (``C > 1``, float ``labels`` ``(B, C)`` in [0, 1]):
      ``L_i = (1/C) Σ_c BCEWithLogits(logits_ic, y_ic)``.

    The mean over the batch of these ``L_i`` is exactly Hugging Face's loss (without ignored labels).
    """
    name = "sequence_classification_loss"
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() != 2:
        raise ValueError(f"{name}: logits must be a floating-point tensor of shape (B, C), got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)} of shape "
                         f"{tuple(getattr(logits, 'shape', ()))}")
    if not isinstance(labels, torch.Tensor) or labels.dtype == torch.bool or labels.is_complex():
        raise ValueError(f"{name}: labels must be an integer (class) or float (regression, multi-label) tensor, "
                         f"got {getattr(labels, 'dtype', type(labels).__name__)}")
    B, C = logits.shape
    if C == 0:
        raise ValueError(f"{name}: logits have 0 classes (shape {tuple(logits.shape)})")
    if labels.dim() == 0 or labels.shape[0] != B:
        raise ValueError(f"{name}: labels of shape {tuple(labels.shape)} do not have the logits' batch size {B}")
    if problem_type is None:
        if C == 1:
            problem_type = "regression"
        elif not labels.is_floating_point():
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    if problem_type not in _PROBLEMS:
        raise ValueError(f"{name}: unknown problem_type {problem_type!r}; use one of {_PROBLEMS}")
    lg = _ce_dtype(logits)
    if problem_type == "single_label_classification":
        if labels.is_floating_point() or labels.dim() != 1:
            raise ValueError(f"{name}: single-label classification needs integer labels of shape ({B},), got "
                             f"{labels.dtype} of shape {tuple(labels.shape)} (float labels: pass "
                             "problem_type='regression' or 'multi_label_classification')")
        if C == 1:
            raise ValueError(f"{name}: single-label classification over C=1 class has zero loss; a single output "
                             "is regression: pass float labels")
        _check_range(name, labels, C, ignore_index)
        ce = F.cross_entropy(lg, labels.long(), ignore_index=ignore_index, reduction="none")
        return torch.where(labels != ignore_index, ce, torch.zeros((), dtype=ce.dtype, device=ce.device))
    if not labels.is_floating_point():
        raise ValueError(f"{name}: {problem_type} needs float labels, got {labels.dtype}")
    y = labels.reshape(B, 1) if (C == 1 and labels.dim() == 1) else labels
    if y.shape != (B, C):
        raise ValueError(f"{name}: {problem_type} needs labels of shape ({B}, {C})"
                         f"{' or (B,)' if C == 1 else ''}, got {tuple(labels.shape)}")
    y = y.to(lg.dtype)
    if problem_type == "regression":
        return (lg - y).pow(2).mean(1)
    return F.binary_cross_entropy_with_logits(lg, y, reduction="none").mean(1)


def check_per_sample_loss(loss_fn: Callable[..., torch.Tensor], outputs: torch.Tensor, *targets: Any,
                          reduction: str = "mean", rtol: float = 1e-6) -> None:
    """Check once that a loss you wrote is what the engine assumes: the mean (``reduction="mean"``, the engine's
    ``loss_reduction``) or sum over samples of a loss of each sample alone. The engine cannot see inside your loss;
    this can.

    ``loss_fn(outputs, *targets)`` must return a scalar. In float64 (floating ``outputs`` cast up, ``targets`` as
    given), for every sample ``i`` the gradient of the batch loss with respect to row ``i`` of ``outputs`` must equal
    ``w`` times the gradient of ``loss_fn(outputs[i:i+1], *targets[i:i+1])`` (``w = 1/B`` for ``"mean"``, 1 for
    ``"sum"``), to ``rtol`` relative to the largest row. Targets whose leading size is ``B`` are sliced per sample,
    others passed whole. Use a batch like a real one (samples with different numbers of label tokens: a token mean
    over the batch is exact when every sample has the same count).

    Raises:
        ValueError: the loss mixes samples (a token mean over the whole batch, in-batch negatives, a loss normalised
            by a batch statistic), naming the samples and the factor found, or does not return a scalar.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: choose 'mean' or 'sum' (the engine's loss_reduction)")
    if not isinstance(outputs, torch.Tensor) or outputs.dim() == 0 or not outputs.is_floating_point():
        raise ValueError("outputs must be a floating tensor with the batch first, got "
                         f"{getattr(outputs, 'dtype', type(outputs).__name__)} {getattr(outputs, 'shape', '')}")
    B = outputs.shape[0]
    out = outputs.detach().to(torch.float64).requires_grad_(True)

    def per_sample(t: Any, i: int) -> Any:
        return t[i:i + 1] if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == B else t

    def grad_of(o: torch.Tensor, tg: tuple[Any, ...]) -> torch.Tensor:
        loss = loss_fn(o, *tg)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"loss_fn returned {getattr(loss, 'shape', loss)!r}; it must return a scalar (the "
                             f"batch's {reduction} of the per-sample losses, as backpropagated)")
        return torch.autograd.grad(loss.reshape(()), o, allow_unused=True)[0]

    batch = grad_of(out, targets)
    batch = torch.zeros_like(out) if batch is None else batch
    w = 1.0 / B if reduction == "mean" else 1.0
    alone = []
    for i in range(B):
        o = out[i:i + 1].detach().requires_grad_(True)
        g = grad_of(o, tuple(per_sample(t, i) for t in targets))
        alone.append(torch.zeros_like(o) if g is None else w * g)
    if not alone:
        return
    want = torch.cat(alone)
    scale = max(float(want.abs().max()), float(batch.abs().max()), 1e-300)
    bad = [i for i in range(B) if float((batch[i] - want[i]).abs().max()) > rtol * scale]
    if bad:
        factors = []
        for i in bad[:5]:
            d = float(want[i].norm())
            factors.append(f"sample {i}: x{float(batch[i].norm()) / d:.4g}" if d > 0 else f"sample {i}: nonzero")
        raise ValueError(
            f"the loss is not the {reduction} over samples of per-sample losses: the batch loss's gradient at "
            f"sample rows {bad[:10]}{'...' if len(bad) > 10 else ''} differs from {'1/B times ' if w != 1 else ''}"
            f"that of the sample alone ({', '.join(factors)}). A token mean over the whole batch "
            "(F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=...) with padding) or a loss "
            "normalised by a batch statistic mixes samples: average within each sample and then over the batch "
            "(fastdp.losses.causal_lm_loss(logits, labels).mean(), fastdp.losses.per_sample_mean), or check the "
            "engine's loss_reduction.")
