"""DP-FP (Du & Mi, "DP-Forward"): clip and noise a representation in the forward pass, train with any optimizer.

Public names:

* :class:`RepresentationNoise` -- the layer: per-sample clip to ``C``, add ``N(0, (s C)^2 I_k)``, training only.
* :func:`insert_noise` -- put it in front of (or after) a named submodule without editing the model; removable.
* :class:`DPForwardPass` -- inserts the layer, REFUSES trainable parameters below it (or, with the documented opt-in
  ``allow_uncovered_encoder_training=True``, reports "not covered"), counts steps, reports epsilon.
* :class:`MicroBatchSampler` -- Algorithm 1's micro-batches: ``M`` independent Poisson samples per step.
* :func:`dpfp_epsilon` / :func:`dpfp_noise_multiplier` / :func:`dpfp_delta` -- the guarantee fastdp claims
  (replace-one-input adjacency, public labels, frozen encoder; see docs/guide/dpfp.md).
* :func:`paper_mu_tot` / :func:`paper_epsilon` / :func:`paper_noise_multiplier` -- the paper's figure, for comparison.

Read docs/guide/dpfp.md before relying on any number: DP-FP does not give the guarantee of DP-SGD.
"""

from __future__ import annotations

from fastdp.dpfp.accounting import (
    ADJACENCY,
    dpfp_delta,
    dpfp_epsilon,
    dpfp_noise_multiplier,
    paper_epsilon,
    paper_mu_tot,
    paper_noise_multiplier,
)
from fastdp.dpfp.forward_pass import DPForwardPass, DPFPPrivacy, UncoveredTrainingError
from fastdp.dpfp.noise_layer import NoiseHandle, RepresentationNoise, insert_noise
from fastdp.dpfp.sampling import MicroBatchSampler, StepSampler, micro_batch_loader

__all__ = [
    "ADJACENCY",
    "DPFPPrivacy",
    "DPForwardPass",
    "MicroBatchSampler",
    "NoiseHandle",
    "RepresentationNoise",
    "StepSampler",
    "UncoveredTrainingError",
    "dpfp_delta",
    "dpfp_epsilon",
    "dpfp_noise_multiplier",
    "insert_noise",
    "micro_batch_loader",
    "paper_epsilon",
    "paper_mu_tot",
    "paper_noise_multiplier",
]
