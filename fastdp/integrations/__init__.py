"""Integrations of the :class:`fastdp.PrivacyEngine` with training frameworks.

* :mod:`fastdp.integrations.hf`: ``DPTrainer``, private training with Hugging Face ``transformers.Trainer``.

Each integration imports its framework lazily (importing ``fastdp`` never imports ``transformers``).
"""
