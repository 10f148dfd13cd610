"""``fastdp.make_private``: the one call that Opacus users look for, beside the two-line API.

::

    engine, loader = fastdp.make_private(model, optimizer, train_loader, target_epsilon=3.0, epochs=3)
    for epoch in range(3):
        for x, y in loader:          # Poisson batches (random size, possibly empty)
            loss_fn(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    print(engine.get_privacy_spent())

It builds a :class:`fastdp.PrivacyEngine` with ``batch_size`` the loader's (the *expected* batch size of Poisson
sampling) and ``sample_size = len(loader.dataset)``, attaches it to ``optimizer``, and returns it with a
Poisson-sampling loader (:func:`fastdp.data.poisson_loader`) built from ``data_loader``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

__all__ = ["make_private"]


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader, *,
                 target_epsilon: float | None = None, epochs: float | None = None,
                 noise_multiplier: float | None = None, batch_size: int | None = None,
                 generator: torch.Generator | None = None, **engine_kwargs: Any) -> tuple[Any, DataLoader]:
    """Build a :class:`fastdp.PrivacyEngine` for ``model``, attach it to ``optimizer``, and Poisson-sample the data.

    Args:
        model: the model to train (its parameters with ``requires_grad=True`` are the trainable set).
        optimizer: any ``torch.optim`` optimizer over those parameters.
        data_loader: a ``DataLoader`` over a map-style dataset with the ordinary sequential or shuffling sampler;
            its ``batch_size`` is the expected batch size ``B`` (global over ranks under ``torch.distributed``),
            its ``collate_fn``, workers and generator are kept.
        target_epsilon: calibrate sigma so that epsilon after ``epochs`` is at most this (or give
            ``noise_multiplier``).
        epochs: planned epochs; the engine plans ``T = ceil(epochs / q)`` steps with ``q = B / len(dataset)``.
        noise_multiplier: sigma, instead of ``target_epsilon``.
        batch_size: the expected batch size, if not the loader's.
        generator: a CPU ``torch.Generator`` for the Poisson sampling (default: the loader's).
        **engine_kwargs: any other :class:`fastdp.PrivacyEngine` argument (``max_grad_norm``, ``clipping_fn``,
            ``accountant``, ``target_delta``, ``secure_mode``, ...).

    Returns:
        ``(engine, loader)``. ``len(loader)`` is ``T // ceil(epochs)`` batches, so iterating it ``ceil(epochs)``
        times takes at most the planned ``T`` steps (epsilon stays within ``target_epsilon``); each batch
        contains every example independently with probability ``q`` (the accountants' assumption).

    Raises:
        ValueError: ``data_loader`` is not a ``DataLoader``, no epochs, or an engine/loader argument is invalid
            (the message names it).
    """
    from fastdp.accounting import steps_from_epochs
    from fastdp.data import poisson_loader
    from fastdp.engine import PrivacyEngine

    if not isinstance(data_loader, DataLoader):
        raise ValueError(f"data_loader must be a torch.utils.data.DataLoader, got {type(data_loader).__name__}; "
                         "wrap the dataset in DataLoader(dataset, batch_size=B) (B = the expected batch size)")
    if epochs is None or isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not epochs > 0 \
            or not math.isfinite(epochs):
        raise ValueError(f"epochs={epochs!r} must be a finite number > 0: make_private plans the run's steps from "
                         "it (and calibrates sigma for them with target_epsilon)")
    for bad in ("sample_size", "steps"):
        if bad in engine_kwargs:
            raise ValueError(f"{bad}= is not an argument of make_private: the sample size is len(dataset) and the "
                             "steps come from epochs; build fastdp.PrivacyEngine yourself to set them")
    b = data_loader.batch_size if batch_size is None else batch_size
    if b is None:
        raise ValueError("the loader has no batch_size (it uses a batch_sampler); give batch_size=... (the expected "
                         "batch size of Poisson sampling)")
    n = len(data_loader.dataset)  # type: ignore[arg-type]
    engine = PrivacyEngine(model, batch_size=b, sample_size=n, epochs=epochs, target_epsilon=target_epsilon,
                           noise_multiplier=noise_multiplier, **engine_kwargs)
    planned = steps_from_epochs(epochs, engine.sample_rate)
    per_pass = max(1, planned // math.ceil(epochs))
    loader = poisson_loader(data_loader, batch_size=b, steps=per_pass, generator=generator,
                            secure_mode=engine.secure_mode)
    engine.attach(optimizer)
    return engine, loader
