r"""Gaussian-DP accountant via the central limit theorem -- an APPROXIMATION that can UNDERESTIMATE epsilon.

Math (Dong, Roth, Su 2019/2022 "Gaussian differential privacy"; Bu, Dong, Long, Su 2020 "Deep learning with
Gaussian differential privacy").

* A mechanism is mu-GDP if its trade-off curve is at least
  :math:`G_\mu(\alpha) = \Phi(\Phi^{-1}(1-\alpha) - \mu)`.
  The Gaussian mechanism with sensitivity 1 and noise multiplier sigma is exactly :math:`(1/\sigma)`-GDP, and
  GDP composes as :math:`\mu = \sqrt{\sum_k \mu_k^2}`. Hence ``T`` full-batch steps (``q = 1``) are exactly
  :math:`\sqrt{T}/\sigma`-GDP.
* For Poisson subsampling, the CLT (Bu et al. 2020) says that ``T`` steps behave like mu-GDP with
  :math:`\mu = q\sqrt{T(e^{1/\sigma^2} - 1)}` as :math:`T \to \infty` with :math:`q\sqrt T` fixed. This is a
  *limit*, not a bound: Gopi et al. 2021 show it falls below the true epsilon (e.g. 1.618 vs the tight
  1.828 at
  sigma=1, q=0.01, T=1000, delta=1e-5).
* A heterogeneous history adds the squares: :math:`\mu^2 = \sum_k q_k^2 T_k (e^{1/\sigma_k^2} - 1)`, using the
  exact :math:`T_k/\sigma_k^2` for entries with ``q = 1``.
* mu-GDP implies :math:`(\varepsilon, \delta(\varepsilon))`-DP for every epsilon >= 0 with
  :math:`\delta(\varepsilon) = \Phi(-\varepsilon/\mu + \mu/2) - e^\varepsilon\,\Phi(-\varepsilon/\mu -
  \mu/2)`,
  evaluated in log space with ``scipy.special.log_ndtr``; epsilon for a target delta is found by Brent's
  method
  on a bracket (delta is decreasing in epsilon).

A ``UserWarning`` that the result is an approximation is issued once per process.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Iterator, Sequence

from scipy import optimize, special

from fastdp.accounting.base import Accountant, HistoryEntry
from fastdp.accounting.checks import check_delta, check_epsilon, check_noise_multiplier, check_sample_rate
from fastdp.accounting.search import CalibrationPlan

__all__ = ["GDPAccountant", "delta_from_mu", "epsilon_from_mu", "gdp_mu", "mu_from_epsilon_delta"]

logger = logging.getLogger(__name__)

GDP_WARNING = (
    "The GDP accountant uses a central-limit-theorem approximation (Bu et al. 2020) that can UNDERESTIMATE "
    "epsilon for Poisson subsampling (q < 1); it is not a privacy guarantee. Use accountant='prv' "
    "(tight upper "
    "bound) or 'rdp' for guarantees."
)
_warned = False


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(GDP_WARNING, UserWarning, stacklevel=3)


@contextlib.contextmanager
def warning_labelled_elsewhere() -> Iterator[None]:
    """Within the context the approximation warning is not shown, and not counted as shown either: for callers that
    label GDP's value themselves (:func:`fastdp.report.privacy_report`), so that a GDP engine built later in the
    process still warns."""
    global _warned
    warned = _warned
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=GDP_WARNING.split(" (")[0])
            yield
    finally:
        _warned = warned


def _reset_warning() -> None:
    """Allow the once-per-process warning to be issued again (for tests)."""
    global _warned
    _warned = False


def gdp_mu(history: Sequence[HistoryEntry]) -> float:
    """mu of a history: sqrt of the sum of CLT ``q^2 T (e^{1/sigma^2} - 1)`` (``T / sigma^2`` if q = 1)."""
    mu_sq = 0.0
    for sigma, q, n in history:
        if q == 1.0:
            mu_sq += n / (sigma * sigma)
        else:
            inv = 1.0 / (sigma * sigma)
            term = math.expm1(inv) if inv < 700 else math.inf
            mu_sq += q * q * n * term
    return math.sqrt(mu_sq)


def log_delta_from_mu(epsilon: float, mu: float) -> float:
    """log delta(epsilon) of mu-GDP, computed stably (log of a difference of two log_ndtr terms)."""
    if mu <= 0:
        return -math.inf
    a = float(special.log_ndtr(-epsilon / mu + mu / 2))
    b = epsilon + float(special.log_ndtr(-epsilon / mu - mu / 2))
    if b >= a:
        return -math.inf
    return a + math.log(-math.expm1(b - a))


def delta_from_mu(epsilon: float, mu: float) -> float:
    """delta(epsilon) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) for mu-GDP."""
    return math.exp(log_delta_from_mu(epsilon, mu))


def epsilon_from_mu(mu: float, delta: float) -> float:
    """Smallest epsilon >= 0 with delta(epsilon; mu) <= delta (Brent's method on log delta)."""
    delta = check_delta(delta)
    if not math.isfinite(mu):
        return math.inf
    if mu <= 0:
        return 0.0
    log_target = math.log(delta)
    if log_delta_from_mu(0.0, mu) <= log_target:
        return 0.0
    hi = max(1.0, mu * mu)
    while log_delta_from_mu(hi, mu) > log_target:
        hi *= 2.0
        if hi > 1e12:
            return math.inf
    return float(
        optimize.brentq(
            lambda e: log_delta_from_mu(e, mu) - log_target, 0.0, hi, xtol=1e-12, rtol=1e-14, maxiter=500
        )
    )


def mu_from_epsilon_delta(epsilon: float, delta: float) -> float:
    """Largest mu such that mu-GDP implies (epsilon, delta)-DP (delta(eps; mu) is increasing in mu)."""
    epsilon = check_epsilon(epsilon, name="epsilon")
    delta = check_delta(delta)
    log_target = math.log(delta)
    lo, hi = 1e-12, 1.0
    while log_delta_from_mu(epsilon, hi) < log_target:
        lo, hi = hi, hi * 2.0
        if hi > 1e8:
            raise ValueError(f"no mu found for epsilon={epsilon!r}, delta={delta!r}")
    mu = float(
        optimize.brentq(
            lambda m: log_delta_from_mu(epsilon, m) - log_target, lo, hi, xtol=1e-15, rtol=1e-14, maxiter=500
        )
    )
    # make sure we are on the safe side of the root
    while log_delta_from_mu(epsilon, mu) > log_target:
        mu *= 1 - 1e-12
    return mu


def sigma_from_mu(mu: float, sample_rate: float, steps: int) -> float:
    """Inverse of the mu formula: ``sqrt(T)/mu`` for q = 1, else ``1 / sqrt(log(1 + mu^2 / (q^2 T)))``."""
    q = check_sample_rate(sample_rate)
    if q == 1.0:
        return math.sqrt(steps) / mu
    return 1.0 / math.sqrt(math.log1p(mu * mu / (q * q * steps)))


def gdp_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """GDP-CLT epsilon (APPROXIMATION, may underestimate) for homogeneous steps."""
    sigma = check_noise_multiplier(noise_multiplier)
    q = check_sample_rate(sample_rate)
    if q < 1.0:
        _warn_once()
    return epsilon_from_mu(gdp_mu([(sigma, q, int(steps))]), delta)


class GDPAccountant(Accountant):
    """Gaussian-DP accountant via the CLT (Bu et al. 2020) -- an APPROXIMATION, NOT an upper bound.

    For Poisson subsampling (q < 1) the CLT limit ``mu = q sqrt(T (e^{1/sigma^2} - 1))`` can underestimate
    epsilon (e.g. 6.60 vs the tight 6.77 at sigma=1.5, q=0.04, T=2250, delta=1e-5); use it only for
    comparison with papers that report it. For q = 1 it is exact (``mu = sqrt(T)/sigma``). Warns once per
    process.
    """

    name = "gdp"

    def get_mu(self) -> float:
        """mu of the ledger (0.0 when empty, inf with a release that has no guarantee)."""
        parts = self.ledger.parts()
        return math.inf if parts.non_private else gdp_mu(parts.history())

    def _epsilon(self, history: list[HistoryEntry], delta: float) -> float:
        if any(q < 1.0 for _, q, _ in history):
            _warn_once()
        return epsilon_from_mu(gdp_mu(history), delta)

    def calibration_plan(self, target_epsilon: float, delta: float, sample_rate: float,
                         steps: int) -> CalibrationPlan:
        """Closed form: mu* solves delta(target; mu) = delta, then sigma from mu, nudged up (relative steps of
        1e-9) until epsilon <= target. Warns once (q < 1) that GDP is an approximation."""
        q = check_sample_rate(sample_rate)
        if q < 1.0:
            _warn_once()
        sigma = sigma_from_mu(mu_from_epsilon_delta(target_epsilon, delta), q, steps)
        for _ in range(100):
            if epsilon_from_mu(gdp_mu([(sigma, q, steps)]), delta) <= target_epsilon:
                return CalibrationPlan(closed_form=sigma)
            sigma *= 1 + 1e-9
        raise RuntimeError("GDP calibration failed to find a conservative noise multiplier")
