"""GDP-CLT accountant: reference values, exact q=1 case, warning, and documented underestimation."""

from __future__ import annotations

import math
import warnings

import pytest

from fastdp.accounting import GDPAccountant, get_epsilon, get_noise_multiplier
from fastdp.accounting import gdp as gdp_mod


@pytest.fixture(autouse=True)
def _quiet_gdp():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The GDP accountant")
        yield


def test_opacus_reference():
    # Opacus test_gdp_accountant uses steps = int(90 // 0.04) = 2249 (float floor division), not 2250.
    eps = get_epsilon(1.5, 0.04, 2249, 1e-5, accountant="gdp")
    assert 6.59 < eps < 6.6
    assert eps == pytest.approx(6.59982, abs=1e-5)
    assert get_epsilon(1.5, 0.04, 2250, 1e-5, accountant="gdp") == pytest.approx(6.60157, abs=1e-5)


def test_bu_et_al_mnist():
    # Bu et al. README: MNIST n=60000, B=256, sigma=1.3, 15 epochs, delta=1e-5: mu=0.227274, eps=0.83446
    # (with the non-integer T = 15 n / B of their code).
    q = 256 / 60000
    mu = gdp_mod.gdp_mu([(1.3, q, 15 * 60000 / 256)])
    assert mu == pytest.approx(0.227274, rel=2e-6)
    assert gdp_mod.epsilon_from_mu(mu, 1e-5) == pytest.approx(0.83446, abs=1e-5)


@pytest.mark.parametrize(
    "sigma,q,steps,delta,eps,mu",
    [
        (1.0, 0.01, 1000, 1e-5, 1.61771, 0.414522),
        (0.8, 256 / 60000, 703, 1e-5, 0.80396, 0.219674),
        (2.0, 0.001, 10000, 1e-6, 0.20256, 0.053294),
        (0.6, 0.05, 200, 1e-5, 14.88253, 2.746201),
    ],
)
def test_reference_table_e2(sigma, q, steps, delta, eps, mu):
    acc = GDPAccountant()
    acc.step(sigma, q, steps)
    assert acc.get_mu() == pytest.approx(mu, abs=1e-6)
    assert acc.get_epsilon(delta) == pytest.approx(eps, abs=1e-5)
    # formula check to rel 1e-9
    expected_mu = q * math.sqrt(steps * math.expm1(1 / sigma**2))
    assert acc.get_mu() == pytest.approx(expected_mu, rel=1e-12)


def test_full_batch_is_exact_gaussian():
    # q=1: mu = sqrt(T)/sigma exactly; (5.0, 10 steps) -> 2.5943834 (analytic Gaussian, dp_accounting).
    assert get_epsilon(5.0, 1.0, 10, 1e-5, accountant="gdp") == pytest.approx(2.5943834, abs=1e-6)
    acc = GDPAccountant()
    acc.step(10.0, 1.0, 50)
    acc.step(5.0, 1.0, 50)
    assert acc.get_mu() == pytest.approx(math.sqrt(50 / 100 + 50 / 25), rel=1e-14)


def test_delta_of_mu_one():
    # dp_accounting PLD test: mu = 1 -> delta(eps=1) = 0.126936.
    assert gdp_mod.delta_from_mu(1.0, 1.0) == pytest.approx(0.1269367, abs=1e-7)


def test_heterogeneous_mu_squares_add():
    acc = GDPAccountant()
    acc.step(1.0, 0.01, 300)
    acc.step(2.0, 0.05, 200)
    mu1 = gdp_mod.gdp_mu([(1.0, 0.01, 300)])
    mu2 = gdp_mod.gdp_mu([(2.0, 0.05, 200)])
    assert acc.get_mu() == pytest.approx(math.hypot(mu1, mu2), rel=1e-14)


@pytest.mark.parametrize(
    "sigma,q,steps,delta",
    [(1.0, 0.01, 1000, 1e-5), (0.8, 256 / 60000, 703, 1e-5), (0.6, 0.05, 200, 1e-5), (1.5, 0.04, 2250, 1e-5)],
)
def test_gdp_underestimates_pld(sigma, q, steps, delta):
    """Documents that the CLT approximation is *below* the tight (PLD) epsilon for q < 1."""
    dp_accounting = pytest.importorskip("dp_accounting")
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    assert get_epsilon(sigma, q, steps, delta, accountant="gdp") < pld.get_epsilon(delta)


def test_warns_once_per_process():
    gdp_mod._reset_warning()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        get_epsilon(1.0, 0.01, 100, 1e-5, accountant="gdp")
        get_epsilon(1.1, 0.01, 100, 1e-5, accountant="gdp")
        get_noise_multiplier(2.0, 1e-5, 0.01, steps=100, accountant="gdp")
    messages = [str(w.message) for w in record if "GDP accountant" in str(w.message)]
    assert len(messages) == 1
    assert "UNDERESTIMATE" in messages[0]


def test_no_warning_for_exact_full_batch():
    gdp_mod._reset_warning()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        get_epsilon(5.0, 1.0, 10, 1e-5, accountant="gdp")
    assert not [w for w in record if "GDP accountant" in str(w.message)]


def test_calibration_closed_form():
    # E.3: target eps=3, delta=1e-5, q=0.01, T=1000 -> 0.741268 (Opacus bisection: 0.742188).
    sigma = get_noise_multiplier(3.0, 1e-5, 0.01, steps=1000, accountant="gdp")
    assert sigma == pytest.approx(0.741268, abs=1e-6)
    assert get_epsilon(sigma, 0.01, 1000, 1e-5, accountant="gdp") <= 3.0
    # Opacus get_noise_multiplier gdp, eps=8, epochs=90, q=0.04 -> 1.3232421875 (bisection to 0.01 in eps)
    sigma = get_noise_multiplier(8.0, 1e-5, 0.04, epochs=90, accountant="gdp")
    assert 1.3227 < sigma < 1.3233


def test_extreme_values():
    assert get_epsilon(0.01, 0.5, 10, 1e-5, accountant="gdp") == math.inf
    assert get_epsilon(1e4, 0.001, 10, 0.5, accountant="gdp") == 0.0


def test_a_privacy_report_does_not_use_up_the_warning_of_a_later_gdp_engine():
    """The report computes GDP for every engine and labels it an approximation itself; silencing the warning there
    must not count it as shown, or a GDP engine built later in the process would never warn."""
    import torch
    from torch import nn

    from fastdp import PrivacyEngine

    gdp_mod._reset_warning()

    def engine(accountant):
        model = nn.Linear(3, 2)
        eng = PrivacyEngine(model, batch_size=10, sample_size=1000, noise_multiplier=1.0, max_grad_norm=1.0,
                            accountant=accountant)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        eng.attach(opt)
        model(torch.randn(10, 3)).sum().backward()
        opt.step()
        return eng

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert "APPROXIMATION" in str(engine("prv").privacy_report())
        assert not [w for w in record if "GDP accountant" in str(w.message)]
        spent = engine("gdp").get_privacy_spent()
    assert [w for w in record if "GDP accountant" in str(w.message)]
    assert spent["accountant"] == "gdp" and spent["upper_bound"] is False
