"""RDP accountant: reference values, exactness of the series, cross-checks with dp_accounting."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from fastdp.accounting import DEFAULT_ORDERS, RDPAccountant, get_epsilon
from fastdp.accounting.rdp import _log_a_frac_one, compute_rdp, rdp_to_epsilon

OPACUS_GRID = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


def test_opacus_reference_value():
    # Opacus accountants_test: sigma=1.5, q=0.04, T=int(90/0.04)=2250, delta=1e-5 -> 7.32911117143.
    eps = get_epsilon(1.5, 0.04, 2250, 1e-5, accountant="rdp")
    assert eps == pytest.approx(7.32911117143, rel=1e-6)
    # With the Opacus grid exactly (our wider grid may only be <=; here the optimum is an Opacus order).
    acc = RDPAccountant(orders=OPACUS_GRID)
    acc.step(1.5, 0.04, 2250)
    assert acc.get_epsilon(1e-5) == pytest.approx(7.32911117143, rel=1e-9)
    assert eps <= acc.get_epsilon(1e-5) + 1e-12


@pytest.mark.parametrize(
    "sigma,q,steps,delta,expected",
    [
        (1.0, 0.01, 1000, 1e-5, 2.10137),
        (0.8, 256 / 60000, 703, 1e-5, 1.87174),
        (2.0, 0.001, 10000, 1e-6, 0.24472),
        (0.6, 0.05, 200, 1e-5, 17.52954),
        (5.0, 1.0, 10, 1e-5, 2.81365),
    ],
)
def test_reference_table_e2(sigma, q, steps, delta, expected):
    eps = get_epsilon(sigma, q, steps, delta, accountant="rdp")
    assert eps == pytest.approx(expected, abs=1e-5)


def test_dp_accounting_rdp_vector_integer_orders():
    # dp_accounting test_compute_rdp_poisson_sampled_gaussian: q=0.01, sigma=2.5, 50 steps.
    rdp = compute_rdp(0.01, 2.5, 50, orders=[5, 50, 100])
    np.testing.assert_allclose(rdp, [2.18075656e-03, 2.38460375e-02, 1.67416308e02], rtol=1e-6)


def _log_a_mpmath(q: float, sigma: float, alpha: float) -> float:
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 40

    def f(z):
        return mp.npdf(z, 0, sigma) * ((1 - q) + q * mp.exp((2 * z - 1) / (2 * sigma * sigma))) ** alpha

    pts = [-mp.inf] + [mp.mpf(x) for x in np.linspace(-20 * sigma, 20 * sigma + 1, 41)] + [mp.inf]
    return float(mp.log(mp.quad(f, pts)))


def test_dp_accounting_rdp_vector_fractional_orders_are_exact():
    # dp_accounting's test lists 6.70579741e-04 (order 1.5) and 1.08548710e-03 (order 2.5); its fractional
    # series stops too early. Direct numerical integration of A_alpha agrees with fastdp to 1e-10 instead:
    rdp = compute_rdp(0.01, 2.5, 50, orders=[1.5, 2.5])
    for alpha, value in zip([1.5, 2.5], rdp, strict=True):
        exact = 50 * _log_a_mpmath(0.01, 2.5, alpha) / (alpha - 1)
        assert value == pytest.approx(exact, rel=1e-10)
    assert rdp[0] == pytest.approx(6.70579741e-04, rel=0.04)
    assert rdp[1] == pytest.approx(1.08548710e-03, rel=1e-4)


@pytest.mark.parametrize(
    "q,sigma,alpha",
    [
        (0.01, 0.1, 1.05),
        (0.5, 0.3, 1.1),
        (0.05, 0.6, 1.3),
        (0.99, 0.1, 2.5),
        (1e-6, 0.1, 1.01),
        (0.2, 0.5, 7.3),
    ],
)
def test_fractional_series_matches_integral(q, sigma, alpha):
    assert _log_a_frac_one(q, sigma, alpha) == pytest.approx(_log_a_mpmath(q, sigma, alpha), rel=1e-9)


def test_q_one_is_plain_gaussian():
    orders = [1.5, 2.0, 10.0, 64.0]
    np.testing.assert_allclose(compute_rdp(1.0, 2.0, 3, orders), [3 * a / 8 for a in orders], rtol=1e-14)


def test_pure_dp_style_conversion():
    # dp_accounting: orders 2..32 with constant RDP 1.1, delta=1e-5 -> eps 1.32783806176 at order 32.
    orders = list(range(2, 33))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        eps, order = rdp_to_epsilon(orders, [1.1] * len(orders), 1e-5)
    assert eps == pytest.approx(1.32783806176, rel=1e-9)
    assert order == 32


def test_boundary_warning():
    with pytest.warns(RuntimeWarning, match="largest order"):
        rdp_to_epsilon([2.0, 3.0], [1e-6, 1e-6], 1e-5)


def test_default_grid_contains_reference_grids():
    grid = set(round(a, 6) for a in DEFAULT_ORDERS)
    assert all(round(a, 6) in grid for a in OPACUS_GRID)
    assert {11.0, 128.0, 256.0, 512.0, 1024.0, 1.01, 1.05} <= grid
    assert sorted(DEFAULT_ORDERS) == list(DEFAULT_ORDERS)


def test_heterogeneous_is_sum_of_curves():
    acc = RDPAccountant()
    acc.step(1.0, 0.01, 300)
    acc.step(2.0, 0.05, 200)
    expected = compute_rdp(0.01, 1.0, 300) + compute_rdp(0.05, 2.0, 200)
    np.testing.assert_allclose(acc.get_rdp(), expected, rtol=1e-14)
    eps, _ = rdp_to_epsilon(DEFAULT_ORDERS, expected, 1e-5)
    assert acc.get_epsilon(1e-5) == pytest.approx(eps, rel=1e-14)


@pytest.mark.parametrize(
    "sigma,q,steps,delta",
    [
        (1.0, 0.01, 1000, 1e-5),
        (0.8, 0.004, 703, 1e-5),
        (2.0, 0.001, 10000, 1e-6),
        (5.0, 1.0, 10, 1e-5),
        (1.5, 0.04, 2250, 1e-5),
        (4.0, 0.1, 50, 1e-7),
    ],
)
def test_matches_dp_accounting(sigma, q, steps, delta):
    dp_accounting = pytest.importorskip("dp_accounting")
    ref = dp_accounting.rdp.RdpAccountant()
    ref.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    ref_eps = ref.get_epsilon(delta)
    eps = get_epsilon(sigma, q, steps, delta, accountant="rdp")
    # Our grid is a superset of dp_accounting's: never larger, and close when the optimum is shared.
    assert eps <= ref_eps * (1 + 1e-6)
    assert eps == pytest.approx(ref_eps, rel=1e-3)


def test_wider_grid_is_tighter_for_tiny_sigma():
    dp_accounting = pytest.importorskip("dp_accounting")
    ref = dp_accounting.rdp.RdpAccountant()
    ref.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(0.1)), 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_eps = ref.get_epsilon(1e-5)
        eps = get_epsilon(0.1, 0.01, 1000, 1e-5, accountant="rdp")
    assert math.isfinite(eps) and eps < ref_eps


def test_rdp_is_fast():
    import time

    start = time.perf_counter()
    get_epsilon(1.234567, 0.0123, 5000, 1e-5, accountant="rdp")
    assert time.perf_counter() - start < 1.0
