"""Empirical lower bounds on epsilon: canary audits of a mechanism or a training run.

* :mod:`fastdp.audit.bounds` -- the bounds as plain functions of counts: :func:`epsilon_lower_bound_one_run`
  (Steinke, Nasr & Jagielski 2023), :func:`epsilon_lower_bound_many_runs` with :func:`clopper_pearson`
  (Jagielski et al. 2020; Nasr et al. 2021).
* :mod:`fastdp.audit.guesses` -- scores -> guesses -> bound (:func:`audit_from_scores`, :class:`AuditResult`).
* :mod:`fastdp.audit.gaussian` -- audits of the Gaussian mechanism itself (known epsilon).
* :mod:`fastdp.audit.canaries` -- audits of a training run: any ``train_fn(membership) -> model`` and
  ``score_fn(model) -> scores`` (:func:`audit_training`), white-box Dirac gradient canaries
  (:class:`DiracCanaries`) and black-box loss scores (:func:`loss_scores`).

An audit gives a LOWER bound on epsilon, valid with the stated confidence: a bound above the claimed epsilon
refutes the claim; a bound below it (however small) proves nothing about privacy. Imports numpy/scipy only;
torch is imported by :mod:`fastdp.audit.canaries` when used.
"""

from __future__ import annotations

from fastdp.audit.bounds import (
    clopper_pearson,
    epsilon_lower_bound_many_runs,
    epsilon_lower_bound_one_run,
    one_run_p_value,
)
from fastdp.audit.gaussian import audit_gaussian_many_runs, audit_gaussian_one_run, gaussian_sigma
from fastdp.audit.guesses import (
    AuditResult,
    audit_from_scores,
    default_guess_counts,
    draw_membership,
    guesses_from_scores,
)

_CANARY_NAMES = ("DiracCanaries", "audit_training", "loss_scores")


def __getattr__(name: str):
    if name in _CANARY_NAMES:
        import importlib

        return getattr(importlib.import_module("fastdp.audit.canaries"), name)
    raise AttributeError(f"module 'fastdp.audit' has no attribute {name!r}")


__all__ = ["AuditResult", "DiracCanaries", "audit_from_scores", "audit_gaussian_many_runs", "audit_gaussian_one_run",
           "audit_training", "clopper_pearson", "default_guess_counts", "draw_membership",
           "epsilon_lower_bound_many_runs", "epsilon_lower_bound_one_run", "gaussian_sigma", "guesses_from_scores",
           "loss_scores", "one_run_p_value"]
