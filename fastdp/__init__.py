"""fastdp: differentially private training of PyTorch models at close to non-private cost.

Public entry points:

* :class:`fastdp.PrivacyEngine` -- per-sample clipping (ghost norm / instantiation / bias-only, book-keeping)
  plus Gaussian noise and privacy accounting, attached to any ``torch.optim`` optimizer.
* :func:`fastdp.make_private` -- ``(engine, poisson_loader)`` from a model, optimizer and loader in one call.
* :func:`fastdp.progress` -- a progress bar over a loader showing the epsilon spent so far.
* :mod:`fastdp.accounting` -- RDP, PRV and GDP-CLT accountants and noise calibration.
* :mod:`fastdp.audit` -- empirical lower bounds on epsilon from canaries (one-run and many-runs audits).
* :mod:`fastdp.dpfp` -- DP-FP (noise on a representation in the forward pass), with the guarantee it really has.
* :mod:`fastdp.data` -- Poisson sampling (sampler, loader wrapper) and virtual batches.
* :mod:`fastdp.losses` -- per-sample losses ``(B,)`` for language models and classifiers (use them instead of
  Hugging Face's ``labels=``, whose token mean over the batch mixes samples).
* :mod:`fastdp.validate` -- find what prevents private training (``find_problems``) and fix BatchNorm (``fix``).
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

_ENGINE_NAMES = ("PrivacyEngine", "PrivacyBudgetExceeded", "NonFiniteGradientError")
_SUBMODULES = ("accounting", "data", "validate", "bitfit", "losses", "dpfp", "audit")


def __getattr__(name: str):
    # Imported lazily so that `fastdp.accounting` works without importing torch-heavy engine code.
    import importlib

    if name in _ENGINE_NAMES:
        return getattr(importlib.import_module("fastdp.engine"), name)
    if name == "engines_on":
        return importlib.import_module("fastdp.engine_registry").engines_on
    if name == "AdaptiveClipping":
        return importlib.import_module("fastdp.adaptive").AdaptiveClipping
    if name == "StructureError":
        return importlib.import_module("fastdp.probe").StructureError
    if name == "make_private":
        return importlib.import_module("fastdp.private").make_private
    if name == "progress":
        return importlib.import_module("fastdp.progress_bar").progress
    if name in _SUBMODULES:
        return importlib.import_module(f"fastdp.{name}")
    raise AttributeError(f"module 'fastdp' has no attribute {name!r}")


__all__ = ["PrivacyEngine", "AdaptiveClipping", "make_private", "progress", "PrivacyBudgetExceeded",
           "NonFiniteGradientError", "StructureError", "engines_on", "accounting", "audit", "data", "dpfp", "losses",
           "validate", "__version__"]
