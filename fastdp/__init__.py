"""fastdp: differentially private training of PyTorch models at close to non-private cost.

Public entry points:

* :class:`fastdp.PrivacyEngine` -- per-sample clipping (ghost norm / instantiation / bias-only, book-keeping)
  plus Gaussian noise and privacy accounting, attached to any ``torch.optim`` optimizer.
* :mod:`fastdp.accounting` -- RDP, PRV and GDP-CLT accountants and noise calibration.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())



def __getattr__(name: str):
    # Imported lazily so that `fastdp.accounting` works without importing torch-heavy engine code.
    if name == "PrivacyEngine":
        from fastdp.engine import PrivacyEngine

        return PrivacyEngine
    if name == "accounting":
        import importlib

        return importlib.import_module("fastdp.accounting")
    raise AttributeError(f"module 'fastdp' has no attribute {name!r}")


__all__ = ["PrivacyEngine", "accounting", "__version__"]
