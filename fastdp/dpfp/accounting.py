r"""Privacy accounting for DP-FP: the bound fastdp claims, and the paper's figure, side by side.

Notation: ``s = noise_multiplier`` (noise std ``s C`` per coordinate, ``C`` the representation clip norm),
``p = sample_rate`` (each micro-batch is an independent Poisson sample of the ``D`` records with rate ``p``),
``M = micro_batches`` per step, ``T = steps``, ``K = T M`` micro-batches in all.

**What fastdp claims** (:func:`dpfp_epsilon`; the reasoning is in docs/guide/dpfp.md). Adjacency: *replace one record's
input*, its label unchanged (labels are treated as public, as the paper does). Released per micro-batch: the set of the
sampled records' noisy representations with their labels; with the encoder frozen, every later quantity (head
weights, logits, losses) is post-processing of these sets. A record's row appears in a micro-batch with probability
``p`` in both neighbouring datasets, and when it appears its centre moves by at most ``2C``: per micro-batch the pair

.. math::  P = (1-p)\,\bot + p\,\mathcal N(0, 1), \qquad Q = (1-p)\,\bot + p\,\mathcal N(\mu, 1), \qquad \mu = 2/s

dominates the release (``bot``: "the record is not in this micro-batch", which the worst-case adversary may see, e.g.
from the labels). Composing ``K`` of them, the record appears ``j ~ Binomial(K, p)`` times and is then a Gaussian
mechanism with ``mu sqrt(j)``, so, exactly for this pair,

.. math::  \delta(\varepsilon) = \sum_{j=0}^{K} \binom{K}{j} p^j (1-p)^{K-j}\; \delta_{G}(\varepsilon; \mu\sqrt{j}),
           \qquad \delta_G(\varepsilon;m) = \Phi(-\tfrac{\varepsilon}{m} + \tfrac{m}{2})
           - e^{\varepsilon}\Phi(-\tfrac{\varepsilon}{m} - \tfrac{m}{2}).

The sum is cut where the binomial tail is below ``delta * e^-10`` and that tail mass is added to delta (conservative).
``accountant="rdp"`` gives an RDP upper bound of the same pair (Renyi divergence
``log((1-p) + p e^{a(a-1) mu^2 / 2}) / (a - 1)`` per micro-batch) as a cross-check; it is never below the exact value.
Under add/remove adjacency fastdp claims nothing: a record's row (and its label) appears or not, which no amount of
noise on the representation hides (see the guide).

**What the paper computes** (:func:`paper_mu_tot`, :func:`paper_epsilon`, :func:`paper_noise_multiplier`): ``K``
compositions of a Poisson-subsampled Gaussian with ``mu = C/sigma = 1/s`` under add/remove adjacency, i.e. the DP-SGD
mechanism of :class:`fastdp.accounting.PoissonSampledGaussian`; its GDP-CLT value is Eq. (11)
``mu_tot = p sqrt(T M (e^{(C/sigma)^2} - 1))``. It is reported for comparison only, labelled as the paper's.
"""

from __future__ import annotations

import logging
import math

import numpy as np
from scipy import optimize, special, stats

from fastdp.accounting.calibration import get_epsilon, get_noise_multiplier
from fastdp.accounting.checks import check_delta, check_epsilon, check_noise_multiplier, check_sample_rate, check_steps
from fastdp.accounting.gdp import epsilon_from_mu, mu_from_epsilon_delta
from fastdp.accounting.rdp import DEFAULT_ORDERS, rdp_to_epsilon
from fastdp.accounting.search import search_sigma

__all__ = [
    "ADJACENCY",
    "dpfp_delta",
    "dpfp_epsilon",
    "dpfp_noise_multiplier",
    "paper_epsilon",
    "paper_mu_tot",
    "paper_noise_multiplier",
]

logger = logging.getLogger(__name__)

#: the adjacency under which :func:`dpfp_epsilon` is a guarantee
ADJACENCY = ("replace-one-input: neighbouring datasets differ in one record's input, its label unchanged "
             "(labels public); sensitivity 2C per appearance, Poisson sampling only decides how often a record "
             "appears")

_ACCOUNTANTS = ("exact", "rdp")
_TAIL_LOG_FACTOR = -10.0


def _check_accountant(accountant: str) -> str:
    if accountant in _ACCOUNTANTS:
        return accountant
    if accountant in ("prv", "gdp"):
        raise ValueError(
            f"accountant={accountant!r} models a Poisson-subsampled Gaussian on a noisy SUM under add/remove "
            "adjacency (DP-SGD, and the paper's DP-FP analysis), which is not what DP-FP releases: it releases each "
            "sampled record's noisy representation. Use accountant='exact' (default) or 'rdp' for the guarantee "
            f"fastdp claims, or paper_epsilon(..., accountant={accountant!r}) for the paper's figure")
    raise ValueError(f"accountant={accountant!r} must be one of {_ACCOUNTANTS}")


def _check_m(micro_batches: int) -> int:
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, (int, np.integer)) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r} must be a positive integer (M micro-batches per step)")
    return int(micro_batches)


def _appearances(sample_rate: float, micro_batches: int, steps: int, delta: float) -> tuple[np.ndarray, np.ndarray,
                                                                                              float]:
    """``(j, log P(J = j), tail)`` for ``J ~ Binomial(K, p)``, ``j = 0..jmax`` with ``P(J > jmax) = tail`` below
    ``delta * e^-10``."""
    k = _check_m(micro_batches) * check_steps(steps)
    p = check_sample_rate(sample_rate)
    if p == 1.0:
        return np.array([k]), np.array([0.0]), 0.0
    jmax = int(stats.binom.isf(delta * math.exp(_TAIL_LOG_FACTOR), k, p))
    jmax = min(max(jmax, 0), k)
    j = np.arange(jmax + 1)
    tail = float(stats.binom.sf(jmax, k, p))
    return j, stats.binom.logpmf(j, k, p), tail


def _log_delta_gauss(eps: float, m: np.ndarray) -> np.ndarray:
    """``log delta_G(eps; m)`` elementwise (``-inf`` where ``m = 0``)."""
    out = np.full(m.shape, -np.inf)
    pos = m > 0
    mm = m[pos]
    a = special.log_ndtr(-eps / mm + mm / 2)
    b = eps + special.log_ndtr(-eps / mm - mm / 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        val = np.where(b < a, a + np.log(-np.expm1(np.minimum(b - a, 0.0))), -np.inf)
    out[pos] = val
    return out


def dpfp_delta(epsilon: float, noise_multiplier: float, sample_rate: float, micro_batches: int, steps: int,
               cut_delta: float = 1e-12) -> float:
    """delta(epsilon) of the bound fastdp claims (module docstring), exact up to a binomial tail below
    ``cut_delta * e^-10``, which is added (so the value is an upper bound)."""
    s = check_noise_multiplier(noise_multiplier)
    j, logpmf, tail = _appearances(sample_rate, micro_batches, steps, cut_delta)
    mu = 2.0 / s
    terms = logpmf + _log_delta_gauss(float(epsilon), mu * np.sqrt(j.astype(float)))
    return min(1.0, float(np.exp(special.logsumexp(terms))) + tail)


def _exact_epsilon(s: float, p: float, m: int, t: int, delta: float) -> float:
    j, logpmf, tail = _appearances(p, m, t, delta)
    if tail >= delta:
        return math.inf
    log_target = math.log(delta - tail)
    mus = (2.0 / s) * np.sqrt(j.astype(float))

    def f(eps: float) -> float:
        return float(special.logsumexp(logpmf + _log_delta_gauss(eps, mus))) - log_target

    if f(0.0) <= 0:
        return 0.0
    hi = 1.0
    while f(hi) > 0:
        hi *= 2.0
        if hi > 1e8:
            return math.inf
    return float(optimize.brentq(f, 0.0, hi, xtol=1e-12, rtol=1e-12, maxiter=500))


def _rdp_epsilon(s: float, p: float, m: int, t: int, delta: float) -> float:
    alphas = np.asarray(DEFAULT_ORDERS, dtype=float)
    mu2 = (2.0 / s) ** 2
    x = alphas * (alphas - 1.0) * mu2 / 2.0
    log_1mp = math.log1p(-p) if p < 1.0 else -math.inf
    per = np.logaddexp(log_1mp, math.log(p) + x) / (alphas - 1.0)
    eps, _ = rdp_to_epsilon(alphas, per * (m * t), delta, warn_at_boundary=False)
    return eps


def dpfp_epsilon(noise_multiplier: float, sample_rate: float, micro_batches: int, steps: int, delta: float,
                 accountant: str = "exact") -> float:
    """Epsilon fastdp claims for DP-FP with a frozen encoder (everything below the noise layer not trained on the
    private data), public labels, under replace-one-input adjacency (:data:`ADJACENCY`).

    Args:
        noise_multiplier: ``s > 0``; the representation noise std is ``s * C``.
        sample_rate: ``p`` in (0, 1], the Poisson rate of each micro-batch (the paper's ``p = B / (M D)``).
        micro_batches: ``M >= 1`` micro-batches per step.
        steps: ``T >= 1`` steps (``T M`` micro-batches in all).
        delta: in (0, 1).
        accountant: ``"exact"`` (default; the binomial mixture of Gaussian mechanisms, exact for the dominating
            pair) or ``"rdp"`` (an RDP upper bound of the same pair, never smaller). ``"prv"`` / ``"gdp"`` are
            refused: they model the paper's mechanism (:func:`paper_epsilon`).

    Returns:
        epsilon (``inf`` if no finite epsilon reaches ``delta``).
    """
    acc = _check_accountant(accountant)
    s = check_noise_multiplier(noise_multiplier)
    p = check_sample_rate(sample_rate)
    m, t = _check_m(micro_batches), check_steps(steps)
    delta = check_delta(delta)
    return _exact_epsilon(s, p, m, t, delta) if acc == "exact" else _rdp_epsilon(s, p, m, t, delta)


def dpfp_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, micro_batches: int, steps: int,
                          accountant: str = "exact", rtol: float = 1e-3) -> float:
    """Smallest noise multiplier ``s`` (within ``rtol``) with ``dpfp_epsilon(s, ...) <= target_epsilon``, found by
    :func:`fastdp.accounting.search.search_sigma` (conservative: the returned ``s`` was evaluated and meets the
    target)."""
    acc = _check_accountant(accountant)
    target = check_epsilon(target_epsilon)
    delta = check_delta(delta)
    p = check_sample_rate(sample_rate)
    m, t = _check_m(micro_batches), check_steps(steps)
    # seed: a Gaussian mechanism with sensitivity 2 applied E[J] = p T M times (at least once)
    seed = 2.0 * math.sqrt(max(p * m * t, 1.0)) / mu_from_epsilon_delta(target, delta)

    def f(s: float) -> float:
        return _exact_epsilon(s, p, m, t, delta) if acc == "exact" else _rdp_epsilon(s, p, m, t, delta)

    sigma, _ = search_sigma(f, target, seed, rtol)
    return sigma


def paper_mu_tot(noise_multiplier: float, sample_rate: float, micro_batches: int, steps: int) -> float:
    """The paper's Eq. (11)/(16): ``mu_tot = p sqrt(T M (e^{(C/sigma)^2} - 1))`` with ``C/sigma = 1/s`` (GDP-CLT, add/
    remove adjacency, sensitivity C; an approximation of a claim fastdp does not make -- see the module docstring)."""
    s = check_noise_multiplier(noise_multiplier)
    p = check_sample_rate(sample_rate)
    k = _check_m(micro_batches) * check_steps(steps)
    inv = 1.0 / (s * s)
    return p * math.sqrt(k * (math.expm1(inv) if inv < 700 else math.inf))


def paper_epsilon(noise_multiplier: float, sample_rate: float, micro_batches: int, steps: int, delta: float,
                  accountant: str = "gdp") -> float:
    """The paper's epsilon: ``T M`` Poisson-subsampled Gaussian compositions with noise multiplier ``s`` (sensitivity
    C, add/remove) under a :mod:`fastdp.accounting` accountant: ``"gdp"`` (the paper's choice, Eq. (11) + (17); warns
    that GDP-CLT is an approximation), ``"prv"`` or ``"rdp"``. NOT a guarantee for DP-FP (docs/guide/dpfp.md)."""
    m, t = _check_m(micro_batches), check_steps(steps)
    if accountant == "gdp":
        check_delta(delta)
        return epsilon_from_mu(paper_mu_tot(noise_multiplier, sample_rate, m, t), delta)
    return get_epsilon(noise_multiplier, sample_rate, m * t, delta, accountant)


def paper_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, micro_batches: int, steps: int,
                           accountant: str = "gdp") -> float:
    """Algorithm 1, lines 1-2: the noise multiplier ``sigma / C`` the paper calibrates for ``(target_epsilon, delta)``
    (through :func:`fastdp.accounting.get_noise_multiplier` with ``T M`` steps). For comparison only."""
    m, t = _check_m(micro_batches), check_steps(steps)
    return get_noise_multiplier(target_epsilon, delta, sample_rate, steps=m * t, accountant=accountant)
