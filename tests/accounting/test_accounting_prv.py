"""PRV accountant: published values, PLD cross-checks, heterogeneous composition, fallback robustness."""

from __future__ import annotations

import math
import time
import warnings

import pytest

from fastdp.accounting import PRVAccountant, PRVFallbackWarning, get_epsilon
from fastdp.accounting.prv import prv_epsilon_for_history


def _pld_epsilon(history, delta):
    dp_accounting = pytest.importorskip("dp_accounting")
    acc = dp_accounting.pld.PLDAccountant()
    for sigma, q, n in history:
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), n)
    return acc.get_epsilon(delta)


def test_opacus_prv_reference():
    # Opacus accountants_test: PRV sigma=1.5, q=0.04, 2249 steps, delta=1e-5 -> ~6.7774 (upper bound).
    assert get_epsilon(1.5, 0.04, 2249, 1e-5) == pytest.approx(6.7774, abs=1e-4)


@pytest.mark.parametrize(
    "sigma,q,steps,expected",
    [
        # Opacus tests/prv_accountant.py table (from microsoft/prv_accountant), delta=1e-6, eps_upper.
        (0.8, 0.001, 100, 0.270403364),
        (0.8, 0.001, 1000, 0.477771266),
        (1.5, 0.05, 1000, 6.209969247),
        (3.0, 0.2, 100, 3.381220510),
        (2.0, 0.05, 1000, 4.172799867),
        (1.5, 0.001, 20000, 0.437005109),
    ],
)
def test_opacus_prv_table(sigma, q, steps, expected):
    assert get_epsilon(sigma, q, steps, 1e-6, accountant="prv") == pytest.approx(expected, abs=1e-5)


def test_opacus_prv_table_100k_steps():
    assert get_epsilon(2.0, 0.001, 100000, 1e-6) == pytest.approx(0.706719901, abs=1e-5)


def test_opacus_prv_table_huge_epsilon_falls_back():
    # (0.8, 0.05, 20000) -> 140.655 in the table needs a 16.6M-point grid (> 20 s here): fastdp reports RDP.
    with pytest.warns(PRVFallbackWarning, match="RDP upper bound"):
        eps = get_epsilon(0.8, 0.05, 20000, 1e-6)
    assert 140.655 <= eps <= 150.0


@pytest.mark.parametrize(
    "sigma,q,steps,delta",
    [
        (1.0, 0.01, 1000, 1e-5),
        (0.8, 256 / 60000, 703, 1e-5),
        (2.0, 0.001, 10000, 1e-6),
        (0.6, 0.05, 200, 1e-5),
        (5.0, 1.0, 10, 1e-5),
    ],
)
def test_upper_bound_brackets_pld(sigma, q, steps, delta):
    acc = PRVAccountant()
    acc.step(sigma, q, steps)
    lower, estimate, upper = acc.get_epsilon_bounds(delta)
    pld = _pld_epsilon([(sigma, q, steps)], delta)
    assert upper == acc.get_epsilon(delta)
    assert pld - 1e-3 <= upper <= pld + 2 * acc.eps_error
    assert lower <= estimate <= upper
    assert estimate == pytest.approx(pld, abs=2e-3)


def test_q_one_matches_exact_gaussian():
    # T=10 steps at sigma=5 is exactly the Gaussian mechanism with mu=sqrt(10)/5: eps(1e-5) = 2.5943834.
    acc = PRVAccountant()
    acc.step(5.0, 1.0, 10)
    lower, _, upper = acc.get_epsilon_bounds(1e-5)
    assert lower <= 2.5943834 <= upper
    assert upper == pytest.approx(2.60454, abs=1e-4)


def test_heterogeneous_vs_pld():
    history = [(1.0, 0.01, 300), (2.0, 0.05, 200), (1.0, 0.01, 100)]
    acc = PRVAccountant()
    for sigma, q, n in history:
        acc.step(sigma, q, n)
    assert acc.history == history  # the third phase is a new run, not merged with the first
    pld = _pld_epsilon(history, 1e-5)
    assert pld - 1e-3 <= acc.get_epsilon(1e-5) <= pld + 2 * acc.eps_error


def test_heterogeneous_gaussians_bracket_exact():
    # prv_accountant test: Gaussians sigma 10 x50 and sigma 5 x50 -> mu = sqrt(0.5 + 2) = 1.5811 (exact GDP).
    from fastdp.accounting.gdp import epsilon_from_mu

    acc = PRVAccountant()
    acc.step(10.0, 1.0, 50)
    acc.step(5.0, 1.0, 50)
    exact = epsilon_from_mu(math.sqrt(2.5), 1e-5)
    lower, _, upper = acc.get_epsilon_bounds(1e-5)
    assert lower <= exact <= upper


def test_small_sigma_falls_back_quickly():
    # prv-accountant 0.2.0 needs ~60 s and then raises "Discrete mean differs ..." here.
    start = time.perf_counter()
    with pytest.warns(PRVFallbackWarning, match="RDP upper bound"):
        eps = get_epsilon(0.1, 0.01, 1000, 1e-5)
    assert time.perf_counter() - start < 20
    assert isinstance(eps, float) and eps > 100
    assert eps == pytest.approx(get_epsilon(0.1, 0.01, 1000, 1e-5, accountant="rdp"))


def test_tiny_delta_does_not_crash():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PRVFallbackWarning)
        eps = get_epsilon(4.0, 0.00038, 10000, 1.13e-18)
    assert math.isfinite(eps) and eps > 0


def test_prv_never_above_rdp():
    eps_prv = get_epsilon(50.0, 0.01, 100, 1e-5)
    eps_rdp = get_epsilon(50.0, 0.01, 100, 1e-5, accountant="rdp")
    assert eps_prv <= eps_rdp


def test_prv_50k_steps_within_20s():
    start = time.perf_counter()
    eps = get_epsilon(0.9, 0.004, 50000, 1e-5)
    assert time.perf_counter() - start < 20
    assert math.isfinite(eps)
    assert eps < get_epsilon(0.9, 0.004, 50000, 1e-5, accountant="rdp")


def test_custom_errors_and_state():
    acc = PRVAccountant(eps_error=0.1)
    acc.step(1.0, 0.01, 1000)
    lower, estimate, upper = acc.get_epsilon_bounds(1e-5)
    assert upper - lower == pytest.approx(0.2, abs=1e-3)
    fresh = PRVAccountant()
    fresh.load_state_dict(acc.state_dict())
    assert fresh.eps_error == 0.1
    with pytest.raises(ValueError, match="eps_error"):
        PRVAccountant(eps_error=0.0)
    with pytest.raises(ValueError, match="delta_error"):
        PRVAccountant(delta_error=2.0)


def test_history_helper_empty():
    assert prv_epsilon_for_history([], 1e-5).upper == 0.0
