"""Private training with the Hugging Face ``transformers.Trainer``: :class:`DPTrainer`.

A ``Trainer`` subclass that trains under a :class:`fastdp.PrivacyEngine`::

    from fastdp.integrations.hf import DPTrainer
    args = TrainingArguments(output_dir, per_device_train_batch_size=64, gradient_accumulation_steps=4,
                             num_train_epochs=3, max_grad_norm=0, report_to="none")
    trainer = DPTrainer(model=model, args=args, train_dataset=train, data_collator=collator,
                        privacy={"target_epsilon": 3.0, "max_grad_norm": 1.0},
                        per_sample_loss="sequence_classification")
    trainer.train()

What it changes, and why (everything else is the ``Trainer``'s):

* **Batches.** Training batches are drawn by Poisson sampling (:class:`PoissonMicroBatchSampler`): at every
  optimizer step each of the ``n = len(train_dataset)`` examples joins the logical batch independently with
  probability ``q = B / n``, ``B = per_device_train_batch_size * gradient_accumulation_steps``, and the logical batch
  is split into ``gradient_accumulation_steps`` micro-batches (virtual batches: one backward pass each, one noise
  draw per optimizer step). Micro-batches hold ``|batch| / gradient_accumulation_steps`` rows (rounded), about
  ``per_device_train_batch_size``, and may be empty. The ``Trainer``'s collator is kept (wrapped so an empty list of
  examples gives an empty batch, :class:`fastdp.data.EmptyBatchCollate`), and so are the loader options that do not
  change which examples are drawn (workers, pinned memory, prefetching). An epoch is ``round(1 / q)`` steps.
* **Loss.** The model is called without ``labels=`` and with ``use_cache=False`` (if its forward takes it); the loss
  backpropagated is the mean over the micro-batch of per-sample losses (``per_sample_loss``, by
  default chosen from the model's head among :mod:`fastdp.losses`); the model's own ``labels=`` loss mixes samples
  and is refused by the engine (:mod:`fastdp.hf_guard`). It is not divided by the accumulation steps: the engine
  divides the clipped sum by the expected logical batch size ``B``.
* **Noise.** sigma is the ``privacy`` dict's ``noise_multiplier``, or calibrated from its ``target_epsilon`` over
  the planned optimizer steps: ``max_steps`` if set, else ``ceil(num_train_epochs * round(n / B))``, the steps the
  ``Trainer`` runs.
* **Logs.** Every ``Trainer.log`` call (so the log history and every reporter) gets ``epsilon``, ``delta``,
  ``sigma`` and ``dp_steps`` (the engine's released steps).
* **Checkpoints.** Each ``Trainer`` checkpoint also holds ``fastdp_engine.pt`` (the engine's
  :meth:`~fastdp.PrivacyEngine.state_dict`: steps, accountant ledger, noise generator state; and the sampling seed).
  ``train(resume_from_checkpoint=...)`` loads it and continues bit-identically; a checkpoint without it is refused
  (the accounting would restart at zero). Checkpoints hold the noise and sampling state: keep them as private as
  the data (publish the model, not the checkpoint).
* **Evaluation** is the ``Trainer``'s, unchanged (under ``torch.no_grad`` the engine records nothing).

Refused, with an error naming the option (each would change the sampling, the per-sample gradients, or clip
the noisy gradient): ``max_grad_norm`` other than 0/None (the ``Trainer``'s global clipping; the engine clips per
sample with ``privacy["max_grad_norm"]``), ``train_sampling_strategy`` other than ``"random"`` (e.g.
``group_by_length``), a subclass's own ``_get_train_sampler``/``get_train_dataloader``, ``dataloader_drop_last``,
``auto_find_batch_size``, ``ignore_data_skip``, ``label_smoothing_factor``, ``neftune_noise_alpha``,
``compute_loss_func``, ``model_init``, ``fp16`` (GradScaler), ``torch_compile``, a second ``train()`` on the same
trainer (it would re-draw the same batches), several GPUs in one process (``DataParallel``),
several processes, DeepSpeed and FSDP, and training sets without ``__len__``.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer, TrainerCallback

from fastdp import losses as fl
from fastdp.data import EmptyBatchCollate
from fastdp.engine import PrivacyEngine
from fastdp.integrations.micro_batches import PoissonMicroBatchSampler

logger = logging.getLogger(__name__)

__all__ = ["DPTrainer", "PoissonMicroBatchSampler", "ENGINE_FILE", "LOSSES", "planned_steps"]

#: the engine's file inside a Trainer checkpoint folder
ENGINE_FILE = "fastdp_engine.pt"
#: ``per_sample_loss`` names -> per-sample loss ``(logits, labels) -> (B,)``
LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "causal_lm": fl.causal_lm_loss,
    "seq2seq": fl.seq2seq_loss,
    "token_classification": fl.token_classification_loss,
    "sequence_classification": fl.sequence_classification_loss,
}
#: model class name endings -> ``per_sample_loss`` name (the table of docs/guide/huggingface.md)
_HEADS = (("ForCausalLM", "causal_lm"), ("LMHeadModel", "causal_lm"), ("ForConditionalGeneration", "seq2seq"),
          ("ForSeq2SeqLM", "seq2seq"), ("ForTokenClassification", "token_classification"),
          ("ForMaskedLM", "token_classification"), ("ForSequenceClassification", "sequence_classification"),
          ("ForImageClassification", "sequence_classification"),
          ("ForAudioClassification", "sequence_classification"))
#: PrivacyEngine arguments the trainer sets itself
_SET_BY_TRAINER = ("batch_size", "sample_size", "epochs", "steps", "loss_reduction", "distributed", "process_group")


def planned_steps(args: Any, sample_size: int) -> tuple[int, int]:
    """``(steps per epoch, total optimizer steps)`` of a private run: ``round(n / B)`` (at least 1) and
    ``max_steps`` if positive, else ``ceil(num_train_epochs * steps per epoch)`` (the Trainer's own count for a
    loader of ``steps per epoch * gradient_accumulation_steps`` micro-batches)."""
    b = args.per_device_train_batch_size * args.gradient_accumulation_steps
    per_epoch = max(1, round(sample_size / b))
    total = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * per_epoch)
    return per_epoch, total


def _rows(inputs: Mapping[str, Any]) -> int:
    """The micro-batch's number of examples: the first dimension of its first tensor."""
    for v in inputs.values():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    raise ValueError(f"the training batch has no tensor with a batch dimension (keys {sorted(inputs)})")


class _EmptyStep(TrainerCallback):
    """Lets an optimizer step whose Poisson batch was empty (no backward pass) release noise only, as
    :meth:`fastdp.PrivacyEngine.empty_step` does, and counts the rows of each step."""

    def __init__(self, trainer: DPTrainer) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tr = self.trainer
        if tr.engine is not None and tr._step_rows == 0:
            tr.engine._release.empty_step = True  # see PrivacyEngine.empty_step

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tr = self.trainer
        if tr.engine is not None:
            tr.engine._release.empty_step = False
        tr._step_rows = 0


def _takes(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` has a parameter ``name``."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _logits(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if logits is None:
        logits = outputs[0] if isinstance(outputs, (tuple, list)) else outputs["logits"]
    return logits


def resolve_loss(model: nn.Module, per_sample_loss: str | Callable | None) -> tuple[str | None, Callable]:
    """``(name or None, loss (logits, labels) -> (B,))`` from ``per_sample_loss`` or the model's head."""
    if callable(per_sample_loss):
        return None, per_sample_loss
    name = per_sample_loss
    if name is None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
        cls = type(base).__name__
        name = next((loss for end, loss in _HEADS if cls.endswith(end)), None)
        if name is None:
            raise ValueError(f"DPTrainer cannot tell which per-sample loss fits a {cls}: pass per_sample_loss=one of "
                             f"{sorted(LOSSES)} or a callable (logits, labels) -> per-sample losses of shape (B,) "
                             "(see fastdp.losses)")
    if name not in LOSSES:
        raise ValueError(f"per_sample_loss={name!r} is not one of {sorted(LOSSES)} (or pass a callable "
                         "(logits, labels) -> per-sample losses of shape (B,))")
    return name, LOSSES[name]


class DPTrainer(Trainer):
    """``transformers.Trainer`` with differentially private training (see the module docstring).

    Args:
        *args, **kwargs: the ``Trainer``'s.
        privacy: :class:`fastdp.PrivacyEngine` arguments: ``noise_multiplier`` or ``target_epsilon`` (required),
            ``max_grad_norm`` (the per-sample clipping threshold R, default 1.0), ``target_delta``,
            ``clipping_fn``, ``clipping_mode``, ``accountant``, ``noise_generator``, ``secure_mode``, ... The
            trainer sets ``batch_size``, ``sample_size``, ``steps`` and ``loss_reduction`` itself. Without a
            ``noise_generator`` (and without ``secure_mode``) the noise comes from a generator seeded from the
            operating system, whose state the checkpoints keep.
        per_sample_loss: ``"causal_lm"``, ``"seq2seq"``, ``"token_classification"``,
            ``"sequence_classification"`` (:mod:`fastdp.losses`) or a callable ``(logits, labels) -> (B,)``;
            default: from the model's class name.
        sampling_seed: the seed of the Poisson batches (default: from the operating system). Give one only for
            reproducible tests; a known seed makes the batches' membership known.

    Attributes:
        engine: the :class:`fastdp.PrivacyEngine` (built when the ``Trainer`` creates its optimizer).
    """

    def __init__(self, *args: Any, privacy: Mapping[str, Any], per_sample_loss: str | Callable | None = None,
                 sampling_seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(privacy, Mapping):
            raise ValueError(f"privacy must be a dict of PrivacyEngine arguments, got {type(privacy).__name__}")
        given = sorted(k for k in _SET_BY_TRAINER if k in privacy)
        if given:
            raise ValueError(f"privacy={{{', '.join(repr(k) for k in given)}: ...}}: DPTrainer sets these itself "
                             "(batch_size = per_device_train_batch_size * gradient_accumulation_steps, sample_size "
                             "= len(train_dataset), steps from max_steps / num_train_epochs, loss_reduction='mean'); "
                             "change the TrainingArguments instead")
        self.privacy = dict(privacy)
        self._loss_name, self._loss_fn = resolve_loss(self.model, per_sample_loss)
        self.sampling_seed = secrets.randbits(63) if sampling_seed is None else int(sampling_seed)
        self.engine: PrivacyEngine | None = None
        self._sampler: PoissonMicroBatchSampler | None = None
        self._step_rows = 0  # examples in the micro-batches of the current optimizer step
        self._check_supported()
        self.add_callback(_EmptyStep(self))

    # ------------------------------------------------------------------ refusals
    def _check_supported(self) -> None:
        a = self.args
        bad = []
        if a.max_grad_norm not in (0, None):
            bad.append(f"max_grad_norm={a.max_grad_norm!r}: the Trainer would clip the noisy gradient's global norm; "
                       "the engine clips each sample's gradient instead (privacy={'max_grad_norm': R}). Set "
                       "TrainingArguments(max_grad_norm=0)")
        if a.train_sampling_strategy != "random":
            bad.append(f"train_sampling_strategy={a.train_sampling_strategy!r}: batches must be drawn by Poisson "
                       "sampling, which the privacy accounting assumes; use the default 'random' (DPTrainer "
                       "replaces it by Poisson sampling)")
        for cls_attr in ("_get_train_sampler", "get_train_dataloader"):
            if getattr(type(self), cls_attr) is not getattr(DPTrainer, cls_attr):
                bad.append(f"{type(self).__name__}.{cls_attr} is overridden: DPTrainer draws the training batches "
                           "by Poisson sampling, which the privacy accounting assumes; another sampler or loader "
                           "would break it. Remove the override")
        for flag, why in (("dataloader_drop_last", "drops examples from the Poisson batches"),
                          ("auto_find_batch_size", "changes the batch size, so the sample rate, during training"),
                          ("ignore_data_skip", "would re-draw already used batches on resume"),
                          ("fp16", "needs a GradScaler, which the engine does not support yet; use bf16"),
                          ("torch_compile", "is not supported with the engine's hooks in DPTrainer"),
                          ("deepspeed", "shards or wraps the model and optimizer"),
                          ("fsdp", "shards the model (see docs/guide/distributed.md for fastdp's FSDP2 support)")):
            if getattr(a, flag, None):
                bad.append(f"{flag}={getattr(a, flag)!r}: {why}")
        if a.label_smoothing_factor:
            bad.append(f"label_smoothing_factor={a.label_smoothing_factor!r}: the per-sample loss would ignore it; "
                       "pass a callable per_sample_loss that smooths")
        if a.neftune_noise_alpha is not None:
            bad.append(f"neftune_noise_alpha={a.neftune_noise_alpha!r}: NEFTune scales each sample's embedding noise "
                       "by the padded length of the whole batch, so a sample's gradient depends on the others")
        if self.model_init is not None:
            bad.append("model_init: the Trainer would build a new model at train(), away from the privacy engine "
                       "attached to this one; pass model=")
        if getattr(self, "compute_loss_func", None) is not None:
            bad.append("compute_loss_func: DPTrainer computes the per-sample loss itself (per_sample_loss=...)")
        if self.accelerator.mixed_precision == "fp16":
            bad.append("mixed precision fp16: needs a GradScaler, which the engine does not support yet; use bf16")
        if a.n_gpu > 1:
            bad.append(f"{a.n_gpu} GPUs in one process: the Trainer would wrap the model in DataParallel, which "
                       "splits each batch over replicas the engine cannot see; use one GPU (CUDA_VISIBLE_DEVICES)")
        if a.world_size > 1:
            bad.append(f"world_size={a.world_size}: DPTrainer runs in one process; for data-parallel private "
                       "training use fastdp's own loop (docs/guide/distributed.md)")
        ds = self.train_dataset
        if ds is not None and (isinstance(ds, IterableDataset) or not hasattr(ds, "__len__")):
            bad.append(f"train_dataset of type {type(ds).__name__} has no __len__: Poisson sampling needs a "
                       "map-style data set of known size")
        if bad:
            raise ValueError("DPTrainer cannot train privately with:\n- " + "\n- ".join(bad))

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; refused once this trainer's engine has released steps (a second ``train()`` would
        restart the Trainer's step count and draw the same Poisson batches again)."""
        if self.engine is not None and self.engine.steps > 0:
            raise RuntimeError(f"train() again on a DPTrainer whose engine has released {self.engine.steps} steps: "
                               "the Trainer would restart at step 0 and re-draw the same Poisson batches, which the "
                               "accounting does not allow. Raise max_steps and resume from a checkpoint with a new "
                               "DPTrainer (train(resume_from_checkpoint=...)), or build a new DPTrainer (a new "
                               "privacy budget: compose the epsilons yourself)")
        return super().train(*args, **kwargs)

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> DataLoader:
        """A loader of Poisson micro-batches (:class:`PoissonMicroBatchSampler`) with the Trainer's collator."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets
            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        a = self.args
        per_epoch, _ = planned_steps(a, len(dataset))
        if self._sampler is None:
            self._sampler = PoissonMicroBatchSampler(
                len(dataset), a.per_device_train_batch_size * a.gradient_accumulation_steps,
                a.gradient_accumulation_steps, per_epoch, self.sampling_seed,
                epoch_fn=lambda: self.state.global_step // per_epoch)
        kwargs: dict[str, Any] = {"num_workers": a.dataloader_num_workers, "pin_memory": a.dataloader_pin_memory}
        if a.dataloader_num_workers > 0:
            kwargs.update(persistent_workers=a.dataloader_persistent_workers,
                          prefetch_factor=a.dataloader_prefetch_factor,
                          multiprocessing_context=a.dataloader_multiprocessing_context)
        return DataLoader(dataset, batch_sampler=self._sampler,
                          collate_fn=EmptyBatchCollate(collator, dataset), **kwargs)

    # ------------------------------------------------------------------ engine
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, with the privacy engine attached (built on the first call)."""
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        if self.engine is None:
            a = self.args
            n = len(self.train_dataset)
            _, total = planned_steps(a, n)
            privacy = dict(self.privacy)
            if privacy.get("noise_generator") is None and not privacy.get("secure_mode", False):
                device = next((p.device for p in self.model.parameters() if p.requires_grad), torch.device("cpu"))
                privacy["noise_generator"] = torch.Generator(device=device).manual_seed(secrets.randbits(63))
            batch = a.per_device_train_batch_size * a.gradient_accumulation_steps
            self.engine = PrivacyEngine(self.model, batch_size=batch, sample_size=n, steps=total,
                                        loss_reduction="mean", distributed=False, **privacy)
            self.engine.attach(self.optimizer)
            logger.info("DPTrainer: %d planned steps, expected logical batch %d of %d examples, sigma=%g",
                        total, self.engine.batch_size, n, self.engine.noise_multiplier)
        return optimizer

    # ------------------------------------------------------------------ step
    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """Training: the mean over the micro-batch of per-sample losses (0 for an empty micro-batch). Evaluation
        (no grad, or the model in eval mode): the ``Trainer``'s own loss, unchanged."""
        if not (model.training and torch.is_grad_enabled()):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        inputs = dict(inputs)
        names = self.label_names or ["labels"]
        if len(names) != 1 or names[0] not in inputs:
            raise ValueError(f"DPTrainer needs the batch's targets under one key (label_names={names}); the batch has "
                             f"{sorted(inputs)}")
        labels = inputs.pop(names[0])
        if self._loss_name == "seq2seq" and "decoder_input_ids" not in inputs:
            inner = self.accelerator.unwrap_model(model)
            inputs["decoder_input_ids"] = inner.prepare_decoder_input_ids_from_labels(labels=labels)
        if "use_cache" not in inputs and _takes(self.accelerator.unwrap_model(model), "use_cache"):
            inputs["use_cache"] = False  # a key/value cache breaks per-sample attribution (docs/guide/huggingface.md)
        outputs = model(**inputs)
        per = self._loss_fn(_logits(outputs), labels)
        if not isinstance(per, torch.Tensor) or per.dim() != 1 or per.shape[0] != labels.shape[0]:
            raise ValueError(f"per_sample_loss returned {getattr(per, 'shape', type(per).__name__)}; it must return "
                             f"one loss per sample, shape ({labels.shape[0]},)")
        loss = per.mean() if per.numel() else per.sum()
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """Forward and backward of one micro-batch. The loss is backpropagated as is (not divided by the
        accumulation steps, not through accelerate's scaling): the engine turns the backward passes of one optimizer
        step into ``sum_i C_i g_i`` and divides by the expected logical batch size. Returns the loss divided by the
        micro-batches of the step, for the Trainer's logged mean."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        rows = _rows(inputs)
        if rows == 0:  # an empty micro-batch: nothing to run (many models fail on 0 rows), nothing to add
            return torch.zeros((), device=self.args.device)
        self._step_rows += rows
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        loss.backward()
        return loss.detach().to(self.args.device) / self.current_gradient_accumulation_steps

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        """No gradient norm to log: the gradient is formed (clipped, noised) at the optimizer step."""
        return None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log, plus ``epsilon``, ``delta``, ``sigma`` and ``dp_steps`` once the engine exists."""
        if self.engine is not None:
            spent = self.engine.get_privacy_spent()
            logs = {**logs, "epsilon": spent["epsilon"], "delta": spent["delta"],
                    "sigma": self.engine.noise_multiplier, "dp_steps": spent["steps"]}
        super().log(logs, start_time)

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.engine is not None:
            torch.save({"format": 1, "engine": self.engine.state_dict(), "sampling_seed": self.sampling_seed},
                       os.path.join(output_dir, ENGINE_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, ENGINE_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist: the checkpoint has no privacy engine state, so the "
                                    "accounting would restart at 0 steps and report too small an epsilon. Resume "
                                    "from a checkpoint saved by DPTrainer (not with save_only_model=True)")
        state = torch.load(path, map_location="cpu", weights_only=True)  # plain data and tensors only
        if not isinstance(state, dict) or state.get("format") != 1:
            raise ValueError(f"{path} is not a DPTrainer engine checkpoint (format 1)")
        if self.engine is None:
            raise RuntimeError("the privacy engine must exist before a checkpoint is loaded")
        self.engine.load_state_dict(state["engine"])
        self.sampling_seed = int(state["sampling_seed"])
        if self._sampler is not None:
            self._sampler.seed = self.sampling_seed
