"""The accounting cannot be fooled by a mistake: declared sample rate checked against the logical batch sizes,
one engine per model, read-only privacy configuration, validated checkpoints, fast epsilon for long histories."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch
from engine_helpers import D, attached_engine, tiny_model
from torch import nn

import fastdp
from fastdp import PrivacyBudgetExceeded, PrivacyEngine
from fastdp.accounting import PRVAccountant, RDPAccountant, make_accountant
from fastdp.accounting.prv import prv_epsilon_for_history
from fastdp.accounting.rdp import _rdp_cached, compute_rdp, rdp_to_epsilon
from fastdp.sampling_check import SampleRateMonitor, _fixed_size_steps

_model = tiny_model


def _engine(model: nn.Module, **kw) -> tuple[PrivacyEngine, torch.optim.Optimizer]:
    return attached_engine(model, **{"sample_size": 1000, **kw})


def _step(model: nn.Module, opt: torch.optim.Optimizer, sizes: int | list[int]) -> None:
    """One logical step: one backward per micro-batch size in ``sizes`` (gradient accumulation), then step."""
    for n in [sizes] if isinstance(sizes, int) else sizes:
        x = torch.randn(n, D, dtype=torch.float64)
        model(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


# --------------------------------------------------------------------------- the statistical test alone


@pytest.mark.parametrize("q", [0.002, 0.016, 0.1, 0.5])
def test_poisson_loader_never_flagged(q):
    N = 1000
    B = max(1, round(q * N))
    for seed in range(5):
        rng = np.random.default_rng(seed)
        mon = SampleRateMonitor(B, N)
        for _ in range(200):
            v = mon.observe(int(rng.binomial(N, B / N)))
            assert v.refuse is None and not v.warnings, (q, seed, v)


def _first_flag(mon: SampleRateMonitor, draw, *, refuse: bool, steps: int = 50) -> int | None:
    for k in range(1, steps + 1):
        v = mon.observe(draw())
        if refuse and v.refuse is not None:
            return k
        if not refuse and any("far below" in w for w in v.warnings):
            return k
    return None


def test_twice_the_declared_rate_refused_within_a_few_steps():
    rng = np.random.default_rng(1)
    ks = [_first_flag(SampleRateMonitor(16, 1000), lambda: int(rng.binomial(1000, 32 / 1000)), refuse=True)
          for _ in range(10)]
    assert all(k is not None and k <= 10 for k in ks), ks
    # a fixed-size loader drawing 32 or 64 per step while 16 is declared
    assert _first_flag(SampleRateMonitor(16, 1000), lambda: 32, refuse=True) <= 3
    assert _first_flag(SampleRateMonitor(16, 1000), lambda: 64, refuse=True) == 1


def test_half_the_declared_rate_warned_within_ten_steps():
    rng = np.random.default_rng(2)
    ks = [_first_flag(SampleRateMonitor(16, 1000), lambda: int(rng.binomial(1000, 8 / 1000)), refuse=False)
          for _ in range(10)]
    assert all(k is not None for k in ks) and np.median(ks) <= 10, ks
    assert _first_flag(SampleRateMonitor(16, 1000), lambda: 8, refuse=False) <= 10


def test_accumulated_poisson_micro_batches_refused():
    rng = np.random.default_rng(3)
    k = _first_flag(SampleRateMonitor(16, 1000),
                    lambda: int(sum(rng.binomial(1000, 16 / 1000) for _ in range(4))), refuse=True)
    assert k is not None and k <= 2


def _always_scipy_verdicts(B: int, N: int, sizes: list[int], alpha: float = 1e-6) -> list[tuple[bool, bool]]:
    """(refused, warned low) per step by the three binomial tests evaluated at every step (no shortcut)."""
    from scipy import stats

    q, s, out, refused, warned = B / N, 0, [], False, False
    for k, size in enumerate(sizes, start=1):
        s += size
        a_k = alpha / (k * (k + 1)) / 3.0
        low = False
        if not refused:
            refused = size > N or stats.binom.sf(size - 1, N, q) < a_k or stats.binom.sf(s - 1, k * N, q) < a_k
            if not refused and not warned and stats.binom.cdf(s, k * N, q) < a_k:
                warned = low = True
        out.append((refused, low))
    return out


@pytest.mark.parametrize("B,N", [(1, 10), (3, 7), (16, 1000), (64, 50_000), (999, 1000)])
def test_the_median_shortcut_gives_every_verdict_of_the_full_tests(B, N, monkeypatch):
    """The monitor calls scipy only for counts above the mean (upper tests) or below it (lower test): the verdicts
    of random, low, high and extreme size sequences equal those of the three tests evaluated at every step, and
    a run at the declared rate makes fewer scipy calls than three per step."""
    from scipy import stats

    rng = np.random.default_rng(B * 7 + N)
    q = B / N
    runs = [[int(rng.binomial(N, q)) for _ in range(40)], [int(rng.binomial(N, min(1.0, 2 * q))) for _ in range(40)],
            [int(rng.binomial(N, q / 3)) for _ in range(40)], [B] * 10 + [N] + [0] * 5, [0] * 30,
            [min(N, B + 1)] * 40, [max(0, B - 1)] * 40]
    for sizes in runs:
        mon = SampleRateMonitor(B, N)
        got = []
        for size in sizes:
            v = mon.observe(size)
            got.append((v.refuse is not None, any("far below" in w for w in v.warnings)))
        assert got == _always_scipy_verdicts(B, N, sizes), (B, N, sizes)
    calls = {"n": 0}
    for name in ("sf", "cdf"):
        real = getattr(stats.binom, name)

        def counted(*a, _real=real, **k):
            calls["n"] += 1
            return _real(*a, **k)

        monkeypatch.setattr(stats.binom, name, counted)
    mon = SampleRateMonitor(B, N)
    for size in runs[0]:
        mon.observe(size)
    assert calls["n"] < 2 * len(runs[0])


def test_single_implausible_batch_refused():
    mon = SampleRateMonitor(16, 1000)
    for n in [14, 18, 16, 15]:
        assert mon.observe(n).refuse is None
    v = mon.observe(60)  # P(Binomial(1000, 0.016) >= 60) ~ 1e-15
    assert v.refuse is not None and "60 samples" in v.refuse
    assert mon.observe(16).refuse is not None  # sticky


def test_fixed_size_steps_and_false_alarm_bound():
    assert _fixed_size_steps(1000, 16 / 1000, 1e-3) == 4
    assert _fixed_size_steps(64, 16 / 64, 1e-3) == 4
    assert _fixed_size_steps(10, 1.0, 1e-3) is None
    # the bound is an exact probability: all of the first k* equal under Binomial(N, q)
    from scipy import stats
    k = _fixed_size_steps(100, 0.05, 1e-3)
    assert float(np.sum(stats.binom.pmf(np.arange(101), 100, 0.05) ** k)) < 1e-3


def test_state_roundtrip_and_validation():
    mon = SampleRateMonitor(16, 1000)
    for n in [10, 20, 16]:
        mon.observe(n)
    other = SampleRateMonitor(16, 1000)
    other.load_state_dict(mon.state_dict(), max_steps=3)
    assert other.state_dict() == mon.state_dict()
    with pytest.raises(ValueError, match="steps"):
        other.load_state_dict(mon.state_dict(), max_steps=2)
    bad = dict(mon.state_dict(), first_sizes=[10, 20, 16, 5])
    with pytest.raises(ValueError, match="first_sizes"):
        other.load_state_dict(bad, max_steps=10)


# --------------------------------------------------------------------------- the engine's sample-rate check


def test_engine_refuses_a_loader_drawing_4x_before_release():
    model = _model()
    engine, opt = _engine(model)
    before = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"batch_size=16.*mean logical batch size of 64|64 samples"):
        _step(model, opt, 64)
    assert torch.equal(model.weight.detach(), before)  # nothing released
    assert engine.steps == 0 and engine.accountant.steps == 0
    with pytest.raises(RuntimeError, match="refused"):  # sticky: a new engine with the right batch_size is needed
        _step(model, opt, 16)


def test_engine_refuses_accumulated_micro_batches():
    model = _model()
    _, opt = _engine(model, batch_size=16, sample_size=1000)
    gen = np.random.default_rng(0)
    with pytest.raises(RuntimeError, match="logical batch") as info:
        for _ in range(10):
            _step(model, opt, [int(gen.binomial(1000, 0.016)) for _ in range(4)])
    assert "sum" in str(info.value) and "poisson_loader" in str(info.value)


def test_engine_poisson_steps_pass_and_empty_steps_count():
    model = _model()
    engine, opt = _engine(model, batch_size=4, sample_size=100)
    gen = np.random.default_rng(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(30):
            n = int(gen.binomial(100, 0.04))
            if n == 0:
                engine.empty_step()
            else:
                _step(model, opt, n)
    assert engine.steps == engine.accountant.steps == 30


def test_engine_warns_fixed_size_epochs_of_four_batches():
    model = _model()
    _, opt = _engine(model, batch_size=16, sample_size=64)
    with pytest.warns(UserWarning, match="first 4 logical batches all had exactly 16"):
        for _ in range(4):
            _step(model, opt, 16)


def test_engine_warns_a_rate_far_below_declared():
    model = _model()
    _, opt = _engine(model, batch_size=16, sample_size=1000)
    with pytest.warns(UserWarning, match="far below the declared batch_size=16"):
        for _ in range(10):
            _step(model, opt, 4)


# --------------------------------------------------------------------------- one engine per model


def test_second_engine_on_an_attached_model_refused_until_detach():
    model = _model()
    first, _ = _engine(model)
    with pytest.raises(RuntimeError, match=r"old_engine\.detach\(\)"):
        PrivacyEngine(model, batch_size=16, sample_size=1000, noise_multiplier=1.0)
    # a module sharing a trainable parameter is refused too
    shared = nn.Sequential(nn.Linear(2, 2))
    shared[0].weight = model.weight
    shared[0].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="weight"):
        PrivacyEngine(shared, batch_size=16, sample_size=1000, noise_multiplier=1.0)
    assert fastdp.engines_on(model) == [first]
    first.detach()
    assert fastdp.engines_on(model) == []
    second, opt = _engine(model)
    _step(model, opt, 16)
    assert second.steps == 1


def test_two_constructed_engines_only_one_attaches():
    model = _model()
    a = PrivacyEngine(model, batch_size=16, sample_size=1000, noise_multiplier=1.0)
    b = PrivacyEngine(model, batch_size=16, sample_size=1000, noise_multiplier=1.0)
    a.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="another PrivacyEngine"):
        b.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    a.detach()
    b.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    b.detach()


def test_notebook_cell_run_twice():
    model = _model()
    engine, _ = _engine(model)  # cell run once
    with pytest.raises(RuntimeError, match="engines_on"):
        engine, _ = _engine(model)  # run again: the old engine's reference is lost
    for e in fastdp.engines_on(model):
        e.detach()
    engine, _ = _engine(model)
    assert fastdp.engines_on(model) == [engine]


# --------------------------------------------------------------------------- read-only configuration


@pytest.mark.parametrize("name,value", [
    ("noise_multiplier", 0.0), ("max_grad_norm", 10.0), ("batch_size", 4), ("sample_size", 10),
    ("sample_rate", 0.5), ("target_delta", 0.1), ("clipping_fn", "automatic"), ("clipping_style", "layer-wise"),
    ("clipping_mode", "ghost"), ("loss_reduction", "sum"), ("accountant", make_accountant("rdp")),
    ("enforce_budget", False), ("target_epsilon", 100.0), ("steps", 0)])
def test_privacy_configuration_is_read_only(name, value):
    engine, _ = _engine(_model())
    old = getattr(engine, name)
    with pytest.raises(AttributeError, match=f"PrivacyEngine.{name} is read-only"):
        setattr(engine, name, value)
    assert getattr(engine, name) is old


def test_set_noise_multiplier_is_accounted_in_phases():
    model = _model()
    engine, opt = _engine(model, batch_size=16, sample_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fixed-size batches here
        for _ in range(2):
            _step(model, opt, 16)
        engine.set_noise_multiplier(2.0)
        _step(model, opt, 16)
    assert engine.accountant.history == [(1.0, 0.25, 2), (2.0, 0.25, 1)]
    ref = RDPAccountant()
    ref.step(1.0, 0.25, 2)
    ref.step(2.0, 0.25, 1)
    assert engine.get_privacy_spent()["epsilon"] == ref.get_epsilon(engine.target_delta)
    with pytest.raises(ValueError, match="noise_multiplier"):
        engine.set_noise_multiplier(-1.0)


def test_sigma_zero_steps_are_counted_and_make_epsilon_infinite():
    model = _model()
    engine, opt = _engine(model, batch_size=16, sample_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _step(model, opt, 16)
        engine.set_noise_multiplier(0.0)
        _step(model, opt, 16)
        engine.set_noise_multiplier(1.0)
        _step(model, opt, 16)
    assert engine.steps == 3 and engine.noiseless_steps == 1
    assert engine.accountant.steps + engine.noiseless_steps == engine.steps
    assert engine.get_privacy_spent()["epsilon"] == math.inf


def test_sigma_zero_refused_under_enforce_budget():
    model = _model()
    engine, opt = _engine(model, batch_size=16, sample_size=64, noise_multiplier=None, target_epsilon=8.0,
                          steps=20, enforce_budget=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _step(model, opt, 16)
        engine.set_noise_multiplier(0.0)
        with pytest.raises(PrivacyBudgetExceeded, match="noise_multiplier=0"):
            _step(model, opt, 16)
    assert engine.steps == 1


def test_accountant_tampering_refused():
    model = _model()
    engine, opt = _engine(model)
    _step(model, opt, 16)
    engine.accountant.reset()
    with pytest.raises(RuntimeError, match="changed outside the engine"):
        _step(model, opt, 16)


# --------------------------------------------------------------------------- checkpoints


def _trained_state(n_steps: int = 3, **kw) -> dict:
    model = _model()
    engine, opt = _engine(model, **kw)
    gen = np.random.default_rng(0)
    for _ in range(n_steps):
        _step(model, opt, max(1, int(gen.binomial(engine.sample_size, engine.sample_rate))))
    state = engine.state_dict()
    engine.detach()
    return state


def _fresh(**kw) -> PrivacyEngine:
    kw.setdefault("batch_size", 16)
    kw.setdefault("sample_size", 1000)
    kw.setdefault("noise_multiplier", 1.0)
    kw.setdefault("accountant", "rdp")
    return PrivacyEngine(_model(), **kw)


def test_checkpoint_roundtrip():
    state = _trained_state()
    engine = _fresh()
    engine.load_state_dict(state)
    assert engine.steps == 3 and engine.accountant.steps == 3
    assert engine.state_dict()["sampling"] == state["sampling"]


@pytest.mark.parametrize("edit,field", [
    (lambda s: s.update(steps=0), "steps"),
    (lambda s: s.update(steps=5), "steps"),
    (lambda s: s.update(steps=-1), "steps"),
    (lambda s: s.update(steps=True), "steps"),
    (lambda s: s.update(noiseless_steps=2), "noiseless_steps"),
    (lambda s: s["accountant"].update(history=[]), "steps"),
    (lambda s: s["accountant"].update(history=[[1.0, 0.5, 3]]), "sample rates"),
    (lambda s: s.update(noise_multiplier_now=-1.0), "noise_multiplier_now"),
    (lambda s: s["sampling"].update(steps=99), "sampling"),
    (lambda s: s.update(version=7), "version"),
])
def test_edited_checkpoints_refused(edit, field):
    state = copy.deepcopy(_trained_state())
    edit(state)
    engine = _fresh()
    with pytest.raises(ValueError, match=field):
        engine.load_state_dict(state)
    assert engine.steps == 0 and engine.accountant.steps == 0  # unchanged


def test_checkpoint_cannot_overwrite_released_steps():
    state = _trained_state()
    model = _model()
    engine, opt = _engine(model)
    _step(model, opt, 16)
    with pytest.raises(RuntimeError, match="already released 1 step"):
        engine.load_state_dict(state)
    assert engine.steps == engine.accountant.steps == 1


def test_budget_state_recomputed_not_trusted():
    kw = dict(noise_multiplier=None, target_epsilon=1.0, steps=10, enforce_budget=True, batch_size=16,
              sample_size=1000)
    state = copy.deepcopy(_trained_state(**kw))
    state["budget_verified"] = 10**9  # an old-format field: ignored
    engine = _fresh(**kw)
    engine.load_state_dict(state)
    assert engine._release.budget_verified == engine._release.planned_steps == 10
    # a history at another sigma is not covered by the calibration: every further step is checked
    state["accountant"]["history"] = [[0.5, 0.016, 3]]
    engine = _fresh(**kw)
    engine.load_state_dict(state)
    assert engine._release.budget_verified == 0


def test_version_1_checkpoint_loads_with_validation():
    state = copy.deepcopy(_trained_state())
    v1 = {k: state[k] for k in ("steps", "accountant", "noise_generator", "config", "nonfinite_samples")}
    v1.update(version=1, logical_sizes=[16] * 3, budget_verified=0)
    engine = _fresh()
    engine.load_state_dict(v1)
    assert engine.steps == 3 and engine.noiseless_steps == 0
    v1["steps"] = 0  # a v1 checkpoint claiming no steps with a non-empty history
    with pytest.raises(ValueError, match="steps"):
        _fresh().load_state_dict(v1)


# --------------------------------------------------------------------------- long phased histories


def _phased(n_phases: int) -> list[tuple[float, float, int]]:
    return [(0.8 + 0.001 * k, 0.004 + 1e-6 * (k % 7), 1 + k % 3) for k in range(n_phases)]


def test_history_rdp_matches_naive_composition_and_merges_repeats():
    hist = [(1.0, 0.01, 3), (2.0, 0.02, 1), (1.0, 0.01, 4), (1.5, 0.01, 2)]
    acc = RDPAccountant()
    for s, q, n in hist:
        acc.step(s, q, n)
    naive = sum(compute_rdp(q, s, n) for s, q, n in hist)
    np.testing.assert_allclose(acc.get_rdp(), naive, rtol=1e-12)
    assert acc.get_epsilon(1e-5) == pytest.approx(rdp_to_epsilon(acc.orders, naive, 1e-5)[0], rel=1e-12)
    # PRV composes the repeated (sigma, q) once: same result as the merged history
    a = prv_epsilon_for_history(hist, 1e-5)
    b = prv_epsilon_for_history([(1.0, 0.01, 7), (2.0, 0.02, 1), (1.5, 0.01, 2)], 1e-5)
    assert a == b


def test_many_phases_do_not_thrash_the_cache():
    orders = (1.5, 2.0, 4.0, 8.0, 16.0, 32.0)
    acc = RDPAccountant(orders=orders)
    for s, q, n in _phased(2000):
        acc.step(s, q, n)
    eps = acc.get_epsilon(1e-5)
    misses = _rdp_cached.cache_info().misses
    assert acc.get_epsilon(1e-5) == eps
    assert _rdp_cached.cache_info().misses == misses  # every curve came from the cache
    naive = sum(compute_rdp(q, s, n, orders) for s, q, n in _phased(2000))
    np.testing.assert_allclose(acc.get_rdp(), naive, rtol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rdp", "prv"])
def test_two_thousand_phases_default_orders(name):
    acc = make_accountant(name)
    for s, q, n in _phased(2000):
        acc.step(s, q, n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps = acc.get_epsilon(1e-5)
    assert math.isfinite(eps) and eps > 0
    if name == "prv":
        assert isinstance(acc, PRVAccountant)
