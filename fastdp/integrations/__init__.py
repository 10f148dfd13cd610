"""Integrations of the :class:`fastdp.PrivacyEngine` with training frameworks.

* :mod:`fastdp.integrations.hf`: ``DPTrainer``, private training with Hugging Face ``transformers.Trainer``;
* :mod:`fastdp.integrations.micro_batches`: Poisson logical batches cut into a fixed number of micro-batches.

Each integration imports its framework lazily (importing ``fastdp`` never imports ``transformers``).
"""
