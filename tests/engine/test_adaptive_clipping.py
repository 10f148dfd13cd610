"""Adaptive clipping (clipping_fn="adaptive", fastdp.adaptive): against the brute-force oracle and by hand.

* without noise, R_t follows the exact recursion R_{t+1} = R_t exp(-eta (frac_t - gamma)) with frac_t the exact
  fraction of samples whose oracle norm is <= R_t, and settles on the target quantile of a fixed set of norms;
* the released gradient of every step is the oracle's clipped at that step's R_t;
* epsilon is that of the pair (gradient at sigma_grad, centred count at sigma_b) composed by hand;
* the noise really has those standard deviations; checkpoints round-trip bit-identically; bad arguments refused.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from fastdp import AdaptiveClipping, PrivacyEngine, accounting
from fastdp.adaptive import combined_noise_multiplier, grad_noise_multiplier
from tests.oracle import (
    assert_grads_close,
    clipped_sum,
    group_norms,
    make_engine,
    mse_per_sample,
    per_sample_grads,
    released_grads,
    trainable_names,
    user_loss,
)


def sum_loss(out, y):
    """Per-sample loss whose gradient w.r.t. a bias-free Linear(d, 1) is the sample's input: norms are known."""
    return out.reshape(out.shape[0], -1).sum(1)


def norm_model(d: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(d, 1, bias=False).double()


def inputs_with_norms(norms: torch.Tensor, d: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(norms), d, generator=g, dtype=torch.float64)
    return x / x.norm(dim=1, keepdim=True) * norms.view(-1, 1)


def adaptive_engine(model, *, batch_size, R=1.0, sigma=0.0, count_sigma=0.0, gamma=0.5, eta=0.2, **kw):
    return make_engine(model, batch_size=batch_size, R=R, fn="adaptive", sigma=sigma,
                       adaptive_clipping=AdaptiveClipping(gamma, eta, count_sigma), **kw)


def step(model, opt, x, y, loss=sum_loss, reduction="mean"):
    user_loss(loss(model(x), y), reduction).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("gamma", [0.25, 0.5, 0.9])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_threshold_follows_exact_recursion_and_settles_on_the_quantile(gamma, reduction):
    B, eta = 40, 0.2
    norms = torch.exp(torch.linspace(math.log(0.1), math.log(10.0), B, dtype=torch.float64))
    model = norm_model()
    x, y = inputs_with_norms(norms), torch.zeros(B, 1, dtype=torch.float64)
    true_norms = group_norms(per_sample_grads(model, sum_loss, [(x, y)], ["weight"]), [["weight"]])[:, 0]
    assert torch.allclose(true_norms, norms, rtol=1e-12)
    eng = adaptive_engine(model, batch_size=B, R=1.0, gamma=gamma, eta=eta, reduction=reduction)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    eng.attach(opt)
    r = 1.0
    for t in range(150):
        assert eng.adaptive_clipping.max_grad_norm == pytest.approx(r, rel=1e-12), t
        step(model, opt, x, y, reduction=reduction)
        frac = float((true_norms <= r).sum()) / B
        assert eng.adaptive_clipping.noisy_unclipped_fractions[t] == pytest.approx(frac, abs=1e-12)
        r = r * math.exp(-eta * (frac - gamma))
    # settled: R within one step of the empirical gamma-quantile of the norms
    k = round(gamma * B)  # R between norms[k-1] and norms[k] gives exactly k unclipped (fraction gamma)
    final = eng.adaptive_clipping.max_grad_norm
    lo, hi = norms[k - 1] * math.exp(-eta), norms[k] * math.exp(eta)
    assert lo <= final <= hi, (final, float(norms[k - 1]), float(norms[k]))
    recent = torch.tensor(eng.adaptive_clipping.noisy_unclipped_fractions[-40:], dtype=torch.float64)
    assert abs(float(recent.mean()) - gamma) <= 1.5 / B
    assert eng.adaptive_clipping.thresholds[0] == 1.0 and len(eng.adaptive_clipping.thresholds) == 150


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost", "instantiate"])
@pytest.mark.parametrize("batch_sizes", [(6,), (3, 4), (1,), (0, 5)])
def test_released_gradient_is_oracle_clipped_at_each_steps_threshold(mode, batch_sizes):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    ref = copy.deepcopy(model)  # the oracle's copy, updated with the oracle's gradient
    ref_params = dict(ref.named_parameters())
    names = trainable_names(model)
    B = 6  # expected batch size (divisor); batches of other sizes under virtual batching
    eng = adaptive_engine(model, batch_size=B, R=0.05, gamma=0.5, eta=0.3, mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng.attach(opt)
    g = torch.Generator().manual_seed(4)
    seen_r = set()
    for t in range(6):
        batches = [(torch.randn(n, 5, generator=g, dtype=torch.float64),
                    torch.randn(n, 3, generator=g, dtype=torch.float64)) for n in batch_sizes]
        r = eng.adaptive_clipping.max_grad_norm
        seen_r.add(r)
        psg = per_sample_grads(ref, mse_per_sample, batches, names)
        want = clipped_sum(psg, [names], "abadi", r, B)
        n = group_norms(psg, [names])[:, 0]
        for xb, yb in batches:
            user_loss(mse_per_sample(model(xb), yb), "mean").backward()
        opt.step()
        assert_grads_close(released_grads(model, names), want, msg=f"step {t}")
        opt.zero_grad()
        with torch.no_grad():
            for k in names:
                ref_params[k].sub_(0.1 * want[k])
        frac = float((n <= r).sum() - len(n) / 2) / B + 0.5
        assert eng.adaptive_clipping.noisy_unclipped_fractions[t] == pytest.approx(frac, abs=1e-12)
        clamped = min(1.0, max(0.0, frac))  # 7 samples for B = 6: the fraction can exceed 1
        assert eng.adaptive_clipping.max_grad_norm == pytest.approx(r * math.exp(-0.3 * (clamped - 0.5)),
                                                                    rel=1e-12)
    assert len(seen_r) > 1  # the threshold moved: the oracle was compared at several thresholds


def test_epsilon_is_the_composed_pair_by_hand():
    model = norm_model()
    B, N, z, sb = 8, 200, 1.1, 2.0
    eng = adaptive_engine(model, batch_size=B, sample_size=N, sigma=z, count_sigma=sb, accountant="rdp")
    sg = eng.adaptive_clipping.grad_noise_multiplier(z)
    assert sg == pytest.approx((z ** -2 - (2 * sb) ** -2) ** -0.5, rel=1e-14)
    assert sg > z
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng.attach(opt)
    x = torch.randn(B, 3, dtype=torch.float64)
    for _ in range(5):
        step(model, opt, x, torch.zeros(B, 1, dtype=torch.float64))
    # by hand: the gradient release (sensitivity 1 in units of R_t, noise sg) and the centred count (sensitivity
    # 1/2, noise sb) as one Gaussian: shift norm sqrt(sg^-2 + (2 sb)^-2) in units of the noise
    z_hand = 1.0 / math.sqrt(sg ** -2 + (1 / (2 * sb)) ** 2)
    assert z_hand == pytest.approx(z, rel=1e-12)
    assert combined_noise_multiplier(sg, sb) == pytest.approx(z, rel=1e-12)
    for name in ("rdp", "prv"):
        acc = accounting.make_accountant(name)
        acc.step(z_hand, B / N, 5)
        eps_hand = acc.get_epsilon(eng.target_delta)
        if name == "rdp":
            assert eng.get_privacy_spent()["epsilon"] == pytest.approx(eps_hand, rel=1e-9)
        # the count's noise is paid for: the gradient alone at sg would claim a smaller epsilon
        alone = accounting.get_epsilon(sg, B / N, 5, eng.target_delta, accountant=name)
        assert alone < eps_hand


def test_calibration_from_target_epsilon_includes_the_count():
    model = norm_model()
    B, N = 64, 6400
    eng = PrivacyEngine(model, batch_size=B, sample_size=N, steps=50, target_epsilon=2.0, clipping_fn="adaptive",
                        accountant="rdp")
    z = eng.noise_multiplier
    assert z == pytest.approx(accounting.get_noise_multiplier(2.0, eng.target_delta, B / N, steps=50,
                                                              accountant="rdp"))
    sb = eng.adaptive_clipping.count_noise_multiplier
    assert sb == B / 20
    sg = eng.adaptive_clipping.grad_noise_multiplier(z)
    assert combined_noise_multiplier(sg, sb) == pytest.approx(z, rel=1e-12)
    assert accounting.get_epsilon(combined_noise_multiplier(sg, sb), B / N, 50, eng.target_delta,
                                  accountant="rdp") <= 2.0 + 1e-9


def test_noise_standard_deviations():
    """The gradient noise has std sigma_grad R_t / B, the fraction's noise sigma_b / B."""
    torch.manual_seed(5)
    model = nn.Linear(60, 60, bias=False).double()
    B, z, sb = 10, 1.0, 0.6  # 2 sb close to z: sigma_grad = 1.81 z, far from z
    eng = adaptive_engine(model, batch_size=B, sample_size=1000, sigma=z, count_sigma=sb, R=2.0, eta=1e-3,
                          noise_generator=torch.Generator().manual_seed(6))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    eng.attach(opt)
    # gradients of norm 1e-3 << R (R stays above 1.8 with eta = 1e-3): all unclipped, the release is ~ the noise
    x = 1e-3 * torch.nn.functional.normalize(torch.randn(B, 60, dtype=torch.float64), dim=1)
    fracs, r = [], []
    for _ in range(200):
        r.append(eng.adaptive_clipping.max_grad_norm)
        user_loss(sum_loss(model(x), None), "mean").backward()
        opt.step()
        if len(r) == 1:
            grad_std = float(model.weight.grad.std())
        opt.zero_grad()
    fracs = torch.tensor(eng.adaptive_clipping.noisy_unclipped_fractions)
    sg = grad_noise_multiplier(z, sb)
    assert sg == pytest.approx(1 / math.sqrt(1 - 1 / 1.2 ** 2), rel=1e-12) and sg > 1.8
    assert grad_std == pytest.approx(sg * 2.0 / B, rel=5 / math.sqrt(2 * 3600))  # 5 standard errors
    # every sample is unclipped: b~ = 1 + N(0, sb^2) / B
    assert float(fracs.mean()) == pytest.approx(1.0, abs=5 * sb / B / math.sqrt(200))
    assert float(fracs.std()) == pytest.approx(sb / B, rel=5 / math.sqrt(2 * 200))


def test_checkpoint_round_trip_is_bit_identical():
    def run(split):
        torch.manual_seed(7)
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()
        def build(m):
            return adaptive_engine(m, batch_size=6, sample_size=600, sigma=0.8, count_sigma=1.0, R=0.3,
                                   noise_generator=torch.Generator().manual_seed(8))
        eng = build(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        eng.attach(opt)
        g = torch.Generator().manual_seed(9)
        for t in range(6):
            if t == split:
                state = eng.state_dict()
                eng.detach()
                eng = build(model)
                eng.load_state_dict(state)
                eng.attach(opt)
            x, y = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 2, generator=g,
                                                                                      dtype=torch.float64)
            step(model, opt, x, y, loss=mse_per_sample)
        return ([p.detach().clone() for p in model.parameters()], eng.adaptive_clipping.thresholds,
                eng.adaptive_clipping.max_grad_norm, eng.get_privacy_spent()["epsilon"])

    a, b = run(None), run(3)
    assert all(torch.equal(p, q) for p, q in zip(a[0], b[0], strict=True))
    assert a[1] == b[1] and a[2] == b[2] and a[3] == b[3]
    assert len(set(a[1])) == 6  # R moved at every step


def test_checkpoint_is_validated():
    model = norm_model()
    eng = adaptive_engine(model, batch_size=4, sample_size=400, sigma=0.5, count_sigma=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng.attach(opt)
    for _ in range(2):
        step(model, opt, torch.randn(4, 3, dtype=torch.float64), torch.zeros(4, 1, dtype=torch.float64))
    state = eng.state_dict()
    assert state["adaptive_clipping"] == {"noisy_unclipped_fractions": eng.adaptive_clipping.noisy_unclipped_fractions}
    fresh = adaptive_engine(norm_model(), batch_size=4, sample_size=400, sigma=0.5, count_sigma=1.0)
    bad = {**state, "adaptive_clipping": {"noisy_unclipped_fractions": state["adaptive_clipping"][
        "noisy_unclipped_fractions"][:1]}}
    with pytest.raises(ValueError, match="1 noisy unclipped fractions of adaptive clipping for 2 released steps"):
        fresh.load_state_dict(bad)
    with pytest.raises(ValueError, match="noisy_unclipped_fractions"):
        fresh.load_state_dict({**state, "adaptive_clipping": None})
    assert fresh.steps == 0 and fresh.adaptive_clipping.max_grad_norm == 1.0  # failed loads changed nothing
    other = adaptive_engine(norm_model(), batch_size=4, sample_size=400, sigma=0.5, count_sigma=1.0, gamma=0.6)
    with pytest.raises(ValueError, match="adaptive_clipping"):
        other.load_state_dict(state)
    plain = make_engine(norm_model(), batch_size=4, sample_size=400, sigma=0.5)
    with pytest.raises(ValueError, match="adaptive_clipping"):
        plain.load_state_dict(state)
    fresh.load_state_dict(state)
    assert fresh.adaptive_clipping.max_grad_norm == eng.adaptive_clipping.max_grad_norm
    assert fresh.clip_config.thresholds == [eng.adaptive_clipping.max_grad_norm]


@pytest.mark.parametrize(("kw", "match"), [
    (dict(adaptive_clipping=AdaptiveClipping(target_quantile=0.0)), r"target_quantile=0.0 must be in \(0, 1\)"),
    (dict(adaptive_clipping=AdaptiveClipping(target_quantile=1.0)), r"target_quantile=1.0 must be in \(0, 1\)"),
    (dict(adaptive_clipping=AdaptiveClipping(target_quantile=float("nan"))), "target_quantile=nan"),
    (dict(adaptive_clipping=AdaptiveClipping(learning_rate=0.0)), "learning_rate=0.0 must be a finite number > 0"),
    (dict(adaptive_clipping=AdaptiveClipping(learning_rate=-1)), "learning_rate=-1"),
    (dict(adaptive_clipping=AdaptiveClipping(count_noise_multiplier=-1.0)), "count_noise_multiplier=-1.0"),
    (dict(adaptive_clipping=AdaptiveClipping(count_noise_multiplier=0.0)), "exact count of unclipped samples"),
    (dict(adaptive_clipping=AdaptiveClipping(count_noise_multiplier=0.5)), "needs count_noise_multiplier > "),
    (dict(clipping_style="layer-wise"), "supports clipping_style='all-layer' only"),
    (dict(clipping_fn="abadi", adaptive_clipping=AdaptiveClipping()), "pass clipping_fn='adaptive'"),
    (dict(adaptive_clipping={"target_quantile": 0.5}), "must be a fastdp.AdaptiveClipping"),
])
def test_bad_arguments_are_refused(kw, match):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    args = dict(batch_size=20, sample_size=1000, noise_multiplier=1.2, clipping_fn="adaptive")
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        PrivacyEngine(model, **args)


def test_default_count_noise_too_small_for_sigma_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"noise_multiplier=2 .* needs count_noise_multiplier > .* = 1, got 0.5"):
        PrivacyEngine(norm_model(), batch_size=10, sample_size=1000, noise_multiplier=2.0, clipping_fn="adaptive")


def test_set_noise_multiplier_beyond_the_count_noise_is_refused():
    model = norm_model()
    eng = adaptive_engine(model, batch_size=4, sample_size=400, sigma=0.5, count_sigma=1.0)
    with pytest.raises(ValueError, match="needs count_noise_multiplier >"):
        eng.set_noise_multiplier(2.0)
    eng.set_noise_multiplier(1.5)
    assert eng.noise_multiplier == 1.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zero = adaptive_engine(norm_model(), batch_size=4, sigma=0.0, count_sigma=0.0)
    with pytest.raises(ValueError, match="needs count_noise_multiplier >"):
        zero.set_noise_multiplier(0.1)  # an exact count cannot be made private by the gradient's noise


def test_empty_step_releases_a_noisy_count_of_zero():
    model = norm_model()
    eng = adaptive_engine(model, batch_size=4, sample_size=400, R=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng.attach(opt)
    eng.empty_step()
    assert eng.adaptive_clipping.noisy_unclipped_fractions == [0.5]  # (0 - 0/2) / B + 1/2: no information
    assert eng.adaptive_clipping.max_grad_norm == pytest.approx(1.0)
    assert eng.steps == 1


def test_fully_sharded_models_are_refused(monkeypatch):
    import fastdp.engine

    monkeypatch.setattr(fastdp.engine, "is_fully_sharded", lambda model: True)
    with pytest.raises(ValueError, match="not supported on fully_shard"):
        adaptive_engine(norm_model(), batch_size=4, sample_size=400, sigma=0.5, count_sigma=1.0)


def test_noisy_fraction_outside_0_1_is_clipped_in_the_update():
    from fastdp.adaptive import AdaptiveState

    st = AdaptiveState(AdaptiveClipping(0.5, 0.2, 1.0), 1.0, 10)
    st.update(20.0)  # b~ = 20 / 10 + 1/2 = 2.5: the update uses 1
    assert st.noisy_unclipped_fractions == [2.5]
    assert st.max_grad_norm == pytest.approx(math.exp(-0.2 * 0.5), rel=1e-15)
    st.update(-30.0)  # b~ = -2.5: the update uses 0
    assert st.max_grad_norm == pytest.approx(1.0, rel=1e-15)
    assert st.thresholds == [1.0, pytest.approx(math.exp(-0.1))]


def test_secure_mode_draws_the_count_noise():
    model = norm_model()
    eng = adaptive_engine(model, batch_size=4, sample_size=400, sigma=0.5, count_sigma=1.0, secure_mode=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng.attach(opt)
    step(model, opt, torch.randn(4, 3, dtype=torch.float64), torch.zeros(4, 1, dtype=torch.float64))
    f = eng.adaptive_clipping.noisy_unclipped_fractions[0]
    assert abs(f * 8 - round(f * 8)) > 1e-9  # off the exact count's grid of 1/(2B): noise was added


def test_adaptive_clipping_with_a_grad_scaler_is_refused_at_attach():
    import fastdp

    model = torch.nn.Linear(4, 2)
    engine = fastdp.PrivacyEngine(model, batch_size=40, sample_size=400, noise_multiplier=1.0,
                                  clipping_fn="adaptive")
    with pytest.raises(ValueError, match="adaptive"):
        engine.attach(torch.optim.SGD(model.parameters(), lr=0.1), scaler=torch.amp.GradScaler("cpu"))
    assert engine.optimizer is None
