"""Privacy accounting for DP-SGD: RDP, PRV and GDP-CLT accountants and noise calibration.

Quick use::

    from fastdp.accounting import get_epsilon, get_noise_multiplier
    eps = get_epsilon(noise_multiplier=1.0, sample_rate=0.01, steps=1000, delta=1e-5)          # PRV, ~1.838
    sigma = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.01, steps=1000)

Accountants (all share :class:`Accountant`: ``step``, ``get_epsilon``, ``history``, ``steps``,
``state_dict``/``load_state_dict``, and the ledger API ``record_step``, ``record``, ``epsilon_after``,
``epsilon_of``, ``ledger``):

* ``"prv"`` -- :class:`PRVAccountant` (Gopi et al. 2021), tight upper bound within ``eps_error``; the default.
* ``"rdp"`` -- :class:`RDPAccountant` (Mironov et al. 2019, improved conversion), looser upper bound.
* ``"gdp"`` -- :class:`GDPAccountant` (Bu et al. 2020 CLT), an APPROXIMATION that can underestimate epsilon.

Accounting is a :class:`Ledger` of events (:class:`PoissonSampledGaussian`, :class:`NonPrivate`, :class:`Composed`,
:class:`SelfComposed`) that every accountant reads: a step without noise or a non-private release is recorded and
gives epsilon = inf; other private releases (e.g. a DP evaluation, ``Gaussian(sigma)``) join the same budget.

See ``docs/guide/accounting.md`` (choosing) and ``docs/reference/accounting.md``. Command line:
``python -m fastdp.accounting --help``.
"""

from __future__ import annotations

from fastdp.accounting.base import Accountant
from fastdp.accounting.calibration import get_epsilon, get_noise_multiplier, steps_from_epochs
from fastdp.accounting.events import (
    Composed,
    DpEvent,
    Gaussian,
    NonPrivate,
    PoissonSampledGaussian,
    SelfComposed,
    event_from_dict,
)
from fastdp.accounting.gdp import GDPAccountant
from fastdp.accounting.ledger import Ledger, LedgerEntry
from fastdp.accounting.prv import PRVAccountant, PRVFallbackWarning
from fastdp.accounting.rdp import DEFAULT_ORDERS, RDPAccountant
from fastdp.accounting.registry import ACCOUNTANTS, make_accountant, resolve_factory
from fastdp.accounting.search import CalibrationPlan, SearchStage

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "CalibrationPlan",
    "Composed",
    "DEFAULT_ORDERS",
    "DpEvent",
    "GDPAccountant",
    "Gaussian",
    "Ledger",
    "LedgerEntry",
    "NonPrivate",
    "PRVAccountant",
    "PRVFallbackWarning",
    "PoissonSampledGaussian",
    "RDPAccountant",
    "SearchStage",
    "SelfComposed",
    "event_from_dict",
    "get_epsilon",
    "get_noise_multiplier",
    "make_accountant",
    "resolve_factory",
    "steps_from_epochs",
]
