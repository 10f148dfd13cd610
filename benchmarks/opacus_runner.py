"""One Opacus (1.6) DP-SGD training step for a given model, so the benchmark harness can time Opacus next to fastdp.

``make_opacus_step(model, mode, ...)`` wraps ``model`` with Opacus's public API
(``opacus.PrivacyEngine().make_private(..., poisson_sampling=False)``) and returns ``step((inputs, targets))``,
which does one complete step: zero grads, forward, loss, backward, ``optimizer.step()``. The optimizer is
``torch.optim.SGD(lr=lr)`` (no momentum) over the parameters that require grad. Both modes release
``(sum_i clip(g_i) + sigma R xi) / batch_size`` with ``clip(g) = g min(1, R / (||g|| + 1e-6))`` over all trainable
parameters together (Opacus ``clipping="flat"``), the same thing fastdp releases with ``clipping_fn="abadi"``,
``clipping_style="all-layer"``, ``loss_reduction="mean"``; ``tests/models/test_opacus_parity.py`` checks that they
agree.

Modes
-----
* ``"hooks"``: ``GradSampleModule`` + ``DPOptimizer``. One backward pass; hooks instantiate every per-sample
  gradient (``p.grad_sample``, shape ``(B, *p.shape)``), then the optimizer computes the norms and the clipped sum.
  Layers without a hand-written grad sampler (HF ``Conv1D``, any module holding raw parameters) go through
  ``torch.func`` (``vmap(grad(...))`` of that module's forward).
* ``"ghost"``: ``grad_sample_mode="ghost"``: ``GradSampleModuleFastGradientClipping`` +
  ``DPOptimizerFastGradientClipping`` + ``DPLossFastGradientClipping`` (the criterion wrapper). Two backward passes
  (inside ``loss.backward()``): the first computes the per-sample gradient norms (ghost norms for ``nn.Linear`` and
  ``nn.Embedding`` only; every other layer instantiates its per-sample gradient, takes its norm and drops it), the
  second back-propagates ``sum_i C_i loss_i`` with the hooks off.

Loss: ``task="cls"``: logits ``(B, C)``, targets ``(B,)``, cross-entropy averaged over the batch. ``task="lm"``:
logits ``(B, T, V)``, targets ``(B, T)``, cross-entropy averaged over all ``B*T`` tokens (per sample the mean of its
``T`` tokens, then the mean over samples; in ghost mode via ``criterion(..., shape=(B, T))``).

Model support (Opacus 1.6.0, torch 2.14, transformers 5.23, timm 1.0.31; pinned by
``tests/models/test_opacus_parity.py``):

* HF ``RobertaForSequenceClassification``: runs in both modes (Linear, Embedding, LayerNorm hooks).
* timm ``VisionTransformer``: runs in both modes, but the ``VisionTransformer`` module itself owns raw parameters
  (``cls_token``, ``pos_embed``) and has no Opacus grad sampler, and Opacus does not recurse below such a module:
  the *whole model* is one hooked module whose per-sample gradients come from one ``torch.func``
  ``vmap(grad(model))`` call, in both modes (so ``"ghost"`` uses no ghost norms at all on ViT).
* HF ``GPT2LMHeadModel``: fails on the first step in both modes.
  ``"hooks"``: ``GPT2Model`` builds position ids of shape ``(1, T)``, so the position embedding ``wpe`` sees a batch
  of 1 and Opacus computes a "per-sample" gradient of batch size 1 for ``wpe.weight`` (the batch sum); the
  optimizer then fails to stack its norm with the ``(B,)`` norms of the other parameters (``RuntimeError: stack
  expects each tensor to be equal size, but got [B] at entry 0 and [1] at entry 1``): Opacus cannot clip the
  position embedding per sample. ``"ghost"``: the LM head is tied to the word embedding and Opacus raises
  ``NotImplementedError: Parameter tying is not supported with Ghost Clipping`` in the forward pass.
* timm ResNet-18 layout with GroupNorm: fails on the first step (in the forward pass) in both modes with
  ``RuntimeError: Output 0 of BackwardHookFunction is a view and is being modified inplace``: Opacus puts
  ``register_full_backward_hook`` on every Conv2d / GroupNorm / Linear, and timm's ``BasicBlock`` modifies those
  outputs in place (``ReLU(inplace=True)`` and ``x += shortcut``), which PyTorch forbids for full backward hooks
  (pytorch/pytorch#61519). Passing a non-in-place ``act_layer`` is not enough (``x += shortcut`` remains).

Untying weights, freezing ``wpe``, or rewriting timm's blocks would change the model or its code, so these are
reported as unsupported instead.

When :class:`OpacusUnsupported` is raised: at build time for ``ModuleValidator`` errors (BatchNorm and friends:
the validator's message, no ``ModuleValidator.fix``), Opacus's refusal to wrap (trainable layers with buffers) and
a missing ``opacus``; on the **first step** for errors Opacus raises only once it sees data (tied parameters in ghost
mode, mismatched per-sample batch sizes, in-place ops on hooked outputs, functorch failures; ``torch.OutOfMemoryError``
passes through unchanged). A failed step leaves the model with Opacus's hooks
removed but possibly stale ``.grad``: build a fresh model for the next configuration.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["OpacusUnsupported", "make_opacus_step"]

MODES = ("hooks", "ghost")
TASKS = ("cls", "lm")


class OpacusUnsupported(Exception):
    """Raised with a short human-readable reason when Opacus cannot run this model/mode."""


class _LenOnly(torch.utils.data.Dataset):
    """A data set of ``n`` dummy items: ``make_private`` only reads the loader's length and the data set's size."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Tensor:
        return torch.zeros(1)


def _short(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def make_opacus_step(model: nn.Module, mode: str, *, task: str, batch_size: int, sample_size: int,
                     noise_multiplier: float = 1.0, max_grad_norm: float = 1.0, lr: float = 1e-4,
                     forward: Callable[[nn.Module, Tensor], Tensor]) -> Callable[[tuple[Tensor, Tensor]], None]:
    """Wrap ``model`` with Opacus and return a function doing one DP-SGD step on a batch ``(inputs, targets)``.

    Args:
        model: the model; Opacus attaches hooks to it (and wraps it) in place. Its parameters that require grad are
            trained, with ``torch.optim.SGD(lr=lr)``.
        mode: ``"hooks"`` (per-sample gradients instantiated) or ``"ghost"`` (Opacus fast gradient clipping, two
            backward passes).
        task: ``"cls"`` (logits ``(B, C)``, targets ``(B,)``) or ``"lm"`` (logits ``(B, T, V)``, targets ``(B, T)``).
        batch_size: the expected batch size ``B`` the clipped sum is divided by.
        sample_size: size of the (notional) private data set; only used to give Opacus a data loader.
        noise_multiplier, max_grad_norm: ``sigma`` and ``R`` (flat clipping over all trainable parameters).
        forward: ``forward(module, inputs) -> logits``; called with Opacus's wrapped module.

    Raises:
        ValueError: bad ``mode`` / ``task`` / sizes.
        OpacusUnsupported: at build time if opacus is missing, ``ModuleValidator`` rejects the model or Opacus
            refuses to wrap it; from the returned step (its first call) if Opacus fails on the first batch.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if batch_size < 1 or sample_size < batch_size:
        raise ValueError(f"need 1 <= batch_size <= sample_size, got {batch_size}, {sample_size}")
    try:
        import opacus
        from opacus.validators import ModuleValidator
    except ImportError as exc:
        raise OpacusUnsupported("opacus is not installed") from exc

    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        raise OpacusUnsupported("ModuleValidator: " + "; ".join(_short(e, 200) for e in errors))
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no parameter that requires grad")
    optimizer = torch.optim.SGD(params, lr=lr)
    # A dummy data set of a whole number of batches: make_private only reads its size and the loader's length (the
    # sample rate it gives the accountant is irrelevant here).
    n = batch_size * max(1, math.ceil(sample_size / batch_size))
    loader = torch.utils.data.DataLoader(_LenOnly(n), batch_size=batch_size)
    criterion = nn.CrossEntropyLoss(reduction="mean")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")  # expected: secure_mode=False
        engine = opacus.PrivacyEngine(accountant="rdp")
    try:
        made = engine.make_private(module=model, optimizer=optimizer, criterion=criterion, data_loader=loader,
                                   noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                                   poisson_sampling=False, loss_reduction="mean", clipping="flat",
                                   grad_sample_mode=mode)
    except Exception as exc:  # Opacus signals refusals with NotImplementedError, ValueError, UnsupportedModuleError
        raise OpacusUnsupported(f"Opacus refused to wrap the model ({mode}): {_short(exc)}") from exc
    if mode == "ghost":
        wrapped, dp_optimizer, dp_criterion, _ = made
    else:
        (wrapped, dp_optimizer, _), dp_criterion = made, None
    # make_private computes int(len(dataset) * (1 / len(loader))), which floating point can round to batch_size - 1
    # (e.g. batch_size 1024 with 49 batches): set the divisor the optimizer uses (DPOptimizer.scale_grad) exactly.
    dp_optimizer.expected_batch_size = batch_size

    def loss_of(logits: Tensor, targets: Tensor):
        if task == "lm":
            if logits.dim() != 3 or targets.shape != logits.shape[:2]:
                raise ValueError(f"lm: expected logits (B, T, V) and targets (B, T), got {tuple(logits.shape)}, "
                                 f"{tuple(targets.shape)}")
            flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
            if dp_criterion is not None:
                return dp_criterion(flat_logits, flat_targets, shape=tuple(logits.shape[:2]))
            return F.cross_entropy(flat_logits, flat_targets)
        if logits.dim() != 2 or targets.shape != logits.shape[:1]:
            raise ValueError(f"cls: expected logits (B, C) and targets (B,), got {tuple(logits.shape)}, "
                             f"{tuple(targets.shape)}")
        return (dp_criterion or criterion)(logits, targets)

    def one_step(batch: tuple[Tensor, Tensor]) -> None:
        inputs, targets = batch
        dp_optimizer.zero_grad(set_to_none=True)
        loss = loss_of(forward(wrapped, inputs), targets)
        loss.backward()  # ghost mode: both backward passes (DPTensorFastGradientClipping.backward)
        dp_optimizer.step()

    first = [True]

    def step(batch: tuple[Tensor, Tensor]) -> None:
        if not first[0]:
            one_step(batch)
            return
        try:
            one_step(batch)
        except torch.OutOfMemoryError:
            raise  # out of memory is a result to report, not a refusal
        except (NotImplementedError, RuntimeError, ValueError, IndexError) as exc:
            try:
                wrapped.cleanup()  # hooks off, Opacus's attributes removed from the parameters
            except Exception:  # noqa: BLE001 - best effort; the original error is what matters
                pass
            raise OpacusUnsupported(f"Opacus failed on the first step ({mode}): {_short(exc)}") from exc
        first[0] = False

    step.optimizer = dp_optimizer  # for tests / inspection
    step.module = wrapped
    return step
