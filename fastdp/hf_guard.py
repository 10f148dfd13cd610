"""Refuse the loss Hugging Face models compute from ``labels=`` when it mixes samples.

A Hugging Face model called with ``labels=`` returns a loss that it computes itself. For language modelling,
masked LM, token classification and seq2seq heads that loss is a token mean over the *whole batch*::

    L_hf = Σ_{i,t} ℓ_{i,t} / N,   N = Σ_j n_j   (n_j: sample j's label tokens that are not ignore_index)

With ``loss_reduction="mean"`` the engine takes ``B · L_hf = Σ_i (B n_i / N) L_i`` as the sum of per-sample
losses, so sample ``i``'s gradient is scaled by ``B n_i / N``, which depends on every other sample's token
count: the clipping acts on the wrong per-sample gradients, and removing one sample changes every other
sample's contribution, so the released sum can move by more than ``R`` (the sensitivity bound is wrong).
(The same holds with ``num_items_in_batch``: a divisor taken from the whole batch.)

Heads and decisions (transformers' ``loss/loss_utils.py`` and the models' own forwards):

* causal LM (``...ForCausalLM``, ``...LMHeadModel``), ``...ForConditionalGeneration`` / ``...ForSeq2SeqLM``,
  ``...ForMaskedLM``, ``...ForTokenClassification``, pre-training heads: token mean over the batch -> refused,
  the message names the :mod:`fastdp.losses` helper to use on the logits;
* ``...ForQuestionAnswering`` (``start_positions``/``end_positions``): positions outside the sequence are ignored
  and change the divisor -> refused (use ``sequence_classification_loss`` on the start and end logits);
* ``...ForSequenceClassification`` (and image / audio / video classification, multiple choice): the loss is the
  mean over the batch of per-sample losses (cross entropy, MSE for one output, BCE mean over classes for
  multi-label), exactly what ``loss_reduction="mean"`` assumes -> allowed, after verifying what would break
  it: no integer label equals -100 (an ignored sample changes the divisor), no ``num_items_in_batch``, and the
  engine's ``loss_reduction`` is ``"mean"``;
* ``return_loss=True`` (CLIP, SigLIP and the other dual encoders): an in-batch contrastive loss, every sample's
  loss depends on the others -> refused;
* any other keyword that carries training targets (``label``, ``*_label``, ``*_labels`` except inputs such as
  ``input_labels``) on any Hugging Face model -> refused.

Only calls with grad enabled are checked (evaluation under ``torch.no_grad()`` may pass ``labels=``).
transformers is never imported here: a model is recognised by a class named ``PreTrainedModel`` from a
``transformers`` module in its MRO.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import torch
from torch import nn

_IGNORE_INDEX = -100
_CLASSIFIERS = ("ForSequenceClassification", "ForImageClassification", "ForAudioClassification",
                "ForVideoClassification", "ForMultipleChoice")
# not training targets: SAM-style point/box labels are inputs; num_labels is a count
_INPUT_LABELS = ("input_labels", "input_boxes_labels", "num_labels")
_params_cache: dict[type, tuple[str, ...]] = {}


def is_hf_model(module: nn.Module) -> bool:
    """True if ``type(module)`` derives from a class named ``PreTrainedModel`` defined in a transformers module."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.split(".")[0] == "transformers"
               for c in type(module).__mro__)


def hf_models(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every Hugging Face model in ``root`` (``root`` itself included): ``(qualified name, module)``."""
    return [(n or "<root>", m) for n, m in root.named_modules() if is_hf_model(m)]


def helper_for(cls_name: str, is_encoder_decoder: bool = False) -> str:
    """The :mod:`fastdp.losses` call to use instead of ``labels=`` for a Hugging Face class name."""
    if cls_name.endswith(("ForCausalLM", "LMHeadModel")):
        return "fastdp.losses.causal_lm_loss(outputs.logits, labels)"
    if cls_name.endswith(("ForConditionalGeneration", "ForSeq2SeqLM")):
        if is_encoder_decoder:
            return "fastdp.losses.seq2seq_loss(outputs.logits, labels)"
        return "fastdp.losses.causal_lm_loss(outputs.logits, labels)"
    if cls_name.endswith(("ForTokenClassification", "ForMaskedLM")):
        return "fastdp.losses.token_classification_loss(outputs.logits, labels)"
    if cls_name.endswith(_CLASSIFIERS):
        return "fastdp.losses.sequence_classification_loss(outputs.logits, labels)"
    if cls_name.endswith("ForQuestionAnswering"):
        return ("(fastdp.losses.sequence_classification_loss(outputs.start_logits, start_positions) + "
                "fastdp.losses.sequence_classification_loss(outputs.end_logits, end_positions)) / 2")
    return ("a per-sample loss of shape (B,) computed from the model's outputs (see fastdp.losses: "
            "causal_lm_loss, seq2seq_loss, token_classification_loss, sequence_classification_loss)")


def _target_key(key: str) -> bool:
    if key in _INPUT_LABELS:
        return False
    return (key in ("labels", "label", "start_positions", "end_positions")
            or key.endswith(("_labels", "_label")))


def _arg_names(module: nn.Module) -> tuple[str, ...]:
    cls = type(module)
    if cls not in _params_cache:
        try:
            ps = inspect.signature(module.forward).parameters.values()
            names = tuple(p.name for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
            names = ()
        _params_cache[cls] = names
    return _params_cache[cls]


def _targets(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The non-None target arguments of this call, keyword or positional."""
    found = {k: v for k, v in kwargs.items() if v is not None and _target_key(k)}
    for name, v in zip(_arg_names(module), args, strict=False):
        if v is not None and _target_key(name):
            found[name] = v
    return found


def _returns_loss(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the call asks the model for its own (in-batch contrastive) loss: ``return_loss`` truthy."""
    v = kwargs.get("return_loss")
    if v is None:
        names = _arg_names(module)
        if "return_loss" in names and names.index("return_loss") < len(args):
            v = args[names.index("return_loss")]
    return bool(v) if isinstance(v, (bool, int)) else False


def check_call(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, label: str,
               loss_reduction: str) -> None:
    """Raise ValueError if this call of Hugging Face model ``module`` would compute a loss that mixes samples.

    Called as a forward pre-hook (``with_kwargs=True``) of every Hugging Face model in an engine's model.
    """
    if not torch.is_grad_enabled():
        return
    if _returns_loss(module, args, kwargs):
        raise ValueError(
            f"{label!r} ({type(module).__name__}) was called with return_loss=True under a PrivacyEngine. Its "
            "internal loss is contrastive over the batch (CLIP, SigLIP, ALIGN, ...): each sample's loss depends on "
            "every other sample of the batch, so per-sample gradients, clipping and the sensitivity bound R do not "
            "exist for it (removing one sample moves the release by more than R). Call the model without "
            "return_loss and train with a loss that is a sum of per-sample terms (e.g. a classification head on the "
            "embeddings, or each sample's own image-text pair only), or use another way than DP-SGD for "
            "contrastive pre-training.")
    targets = _targets(module, args, kwargs)
    if not targets:
        return
    cls = type(module).__name__
    cfg = getattr(module, "config", None)
    helper = helper_for(cls, bool(getattr(cfg, "is_encoder_decoder", False)))
    keys = ", ".join(f"{k}=" for k in targets)
    if cls.endswith(_CLASSIFIERS) and set(targets) == {"labels"}:
        why = _classifier_problem(targets["labels"], kwargs, loss_reduction)
        if why is None:
            return  # a mean over the batch of per-sample losses: exactly loss_reduction="mean"
        raise ValueError(
            f"{label!r} ({cls}) was called with labels= under a PrivacyEngine, and {why}. Call the model without "
            f"labels= and use {helper} (shape (B,)), then .mean() with loss_reduction='mean' (or .sum() with "
            "loss_reduction='sum').")
    raise ValueError(
        f"{label!r} ({cls}) was called with {keys} under a PrivacyEngine. The model's internal loss averages over "
        "all (token) targets of the batch, which mixes samples: each sample's gradient is scaled by a factor that "
        "depends on the other samples' numbers of targets (e.g. B n_i / sum_j n_j label tokens), so per-sample "
        "clipping and the sensitivity bound R would be wrong. Call the model without "
        f"{keys} and compute the loss on its outputs with {helper} (one loss per sample, averaged within the "
        "sample), then .mean() with loss_reduction='mean' (or .sum() with loss_reduction='sum').")


def _classifier_problem(labels: Any, kwargs: dict[str, Any], loss_reduction: str) -> str | None:
    """Why a classifier's internal loss (mean over the batch of per-sample losses) is not safe here, or None."""
    if "num_items_in_batch" in kwargs and kwargs["num_items_in_batch"] is not None:
        return "num_items_in_batch= divides the loss by a count taken from the whole batch"
    if loss_reduction != "mean":
        return (f"its loss is the mean over the batch while the engine has loss_reduction={loss_reduction!r} "
                "(each per-sample gradient would be seen divided by B)")
    if not isinstance(labels, torch.Tensor):
        return f"labels is a {type(labels).__name__}, not a tensor, so it cannot be verified"
    if not labels.is_floating_point() and labels.numel() and bool((labels == _IGNORE_INDEX).any()):
        return ("a label equals -100 (ignore_index): the model's cross entropy then divides by the number of "
                "labelled samples of the batch, not B, which mixes samples")
    return None


def install(root: nn.Module, loss_reduction: str) -> list[Any]:
    """Register :func:`check_call` as a forward pre-hook on every Hugging Face model in ``root`` (also ``root``,
    and models wrapped by peft or a user module). Appended after the engine's own pre-hooks, so a refusal
    unwinds through the engine's always-called forward hooks. Returns the hook handles."""
    return [m.register_forward_pre_hook(partial(_hook, label=name, loss_reduction=loss_reduction),
                                        with_kwargs=True)
            for name, m in hf_models(root)]


def _hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, label: str,
          loss_reduction: str) -> None:
    check_call(module, args, kwargs, label=label, loss_reduction=loss_reduction)
