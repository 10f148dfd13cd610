"""Accounting as a ledger of events: events and their serialisation, the Ledger, every accountant reading it
(composition equals the history functions, sigma = 0 and NonPrivate give inf, look-ahead equals recording in a
copy), accountant states (round trip, version-1 states), calibration over accountant factories."""

from __future__ import annotations

import copy
import functools
import json
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdp.accounting import (
    Accountant,
    CalibrationPlan,
    Composed,
    Gaussian,
    GDPAccountant,
    Ledger,
    NonPrivate,
    PoissonSampledGaussian,
    PRVAccountant,
    RDPAccountant,
    SelfComposed,
    event_from_dict,
    get_epsilon,
    get_noise_multiplier,
    make_accountant,
    resolve_factory,
)
from fastdp.accounting.events import MAX_DEPTH, decompose
from fastdp.accounting.gdp import epsilon_from_mu, gdp_mu
from fastdp.accounting.prv import prv_epsilon_for_history
from fastdp.accounting.rdp import DEFAULT_ORDERS, _rdp_cached, rdp_epsilon_for_history

NAMES = ["rdp", "prv", "gdp"]
HIST = [(1.0, 0.01, 30), (2.0, 0.02, 10), (1.0, 0.01, 5), (1.5, 0.01, 20)]


@pytest.fixture(autouse=True)
def _quiet_gdp():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The GDP accountant")
        yield


def _history_epsilon(name: str, history: list[tuple[float, float, int]], delta: float) -> float:
    """The history functions the accountants used before the ledger (brute force over the raw, unmerged list)."""
    if name == "rdp":
        return rdp_epsilon_for_history(history, delta, DEFAULT_ORDERS)[0]
    if name == "prv":
        return prv_epsilon_for_history(history, delta).upper
    return epsilon_from_mu(gdp_mu(history), delta)


# --------------------------------------------------------------------------- events


def test_event_validation_names_the_value():
    with pytest.raises(ValueError, match=r"noise_multiplier.*>= 0.*-1\.0"):
        PoissonSampledGaussian(-1.0, 0.1)
    with pytest.raises(ValueError, match=r"noise_multiplier.*nan"):
        PoissonSampledGaussian(math.nan, 0.1)
    with pytest.raises(ValueError, match=r"sample_rate.*\(0, 1\].*1\.5"):
        PoissonSampledGaussian(1.0, 1.5)
    with pytest.raises(ValueError, match=r"count.*>= 1.*0"):
        SelfComposed(NonPrivate(), 0)
    with pytest.raises(ValueError, match=r"events\[1\]"):
        Composed([NonPrivate(), (1.0, 0.1)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="not a DpEvent"):
        SelfComposed((1.0, 0.1), 3)  # type: ignore[arg-type]
    assert PoissonSampledGaussian(0, 1) == PoissonSampledGaussian(0.0, 1.0)  # sigma = 0 allowed; floats stored
    assert Gaussian(2.0) == PoissonSampledGaussian(2.0, 1.0)


def test_events_are_hashable_and_round_trip_through_json():
    ev = Composed([
        SelfComposed(PoissonSampledGaussian(1.0, 0.01), 7),
        Gaussian(3.0),
        Composed([]),
        SelfComposed(Composed([PoissonSampledGaussian(0.0, 0.5), NonPrivate()]), 2),
    ])
    back = event_from_dict(json.loads(json.dumps(ev.to_dict())))
    assert back == ev and hash(back) == hash(ev)
    assert {ev, back} == {ev}


@pytest.mark.parametrize("bad,match", [
    ("nope", "must be a dict"),
    ({"type": "laplace", "scale": 1.0}, r"unknown event type 'laplace'"),
    ({"type": "poisson_sampled_gaussian", "noise_multiplier": 1.0}, "sample_rate"),
    ({"type": "poisson_sampled_gaussian", "noise_multiplier": True, "sample_rate": 0.1}, "noise_multiplier"),
    ({"type": "composed", "events": "x"}, "list 'events'"),
    ({"type": "self_composed", "event": {"type": "non_private"}, "count": 2.5}, "count"),
])
def test_event_from_dict_refuses_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        event_from_dict(bad)


def test_event_from_dict_refuses_deep_nesting():
    d: dict = {"type": "non_private"}
    for _ in range(MAX_DEPTH + 2):
        d = {"type": "self_composed", "event": d, "count": 1}
    with pytest.raises(ValueError, match="nested deeper"):
        event_from_dict(d)


def test_decompose_merges_equal_pieces_and_flags_no_guarantee():
    ev = Composed([PoissonSampledGaussian(1.0, 0.1), SelfComposed(PoissonSampledGaussian(2.0, 0.1), 3),
                   SelfComposed(PoissonSampledGaussian(1.0, 0.1), 4)])
    parts = decompose(SelfComposed(ev, 2))
    assert parts.history() == [(1.0, 0.1, 10), (2.0, 0.1, 6)] and not parts.non_private
    assert ev.is_private
    for bad in (PoissonSampledGaussian(0.0, 0.1), NonPrivate(), Composed([ev, NonPrivate()])):
        assert decompose(bad).non_private and not bad.is_private
    assert decompose(Composed([])).empty


# --------------------------------------------------------------------------- the ledger


def test_ledger_records_merges_and_counts():
    led = Ledger()
    led.record_step(1.0, 0.1)
    led.record_step(1.0, 0.1, 4)
    led.record_step(0.0, 0.1, 2)  # no noise: recorded, not left out
    led.record(Gaussian(5.0), label="eval")
    led.record(Gaussian(5.0), label="eval")
    led.record_step(1.0, 0.1)
    assert [(e.count, e.label) for e in led.entries] == [(5, "step"), (2, "step"), (2, "eval"), (1, "step")]
    assert led.steps == 8 and led.noiseless_steps == 2 and led.releases == 2
    assert not led.is_private
    assert led.step_history() == [(1.0, 0.1, 6)]  # the noised steps only, as the old history recorded them
    with pytest.raises(ValueError, match="label"):
        led.record(Gaussian(1.0), label="step")
    with pytest.raises(ValueError, match="label"):
        led.record(Gaussian(1.0), label="")
    with pytest.raises(ValueError, match="not a DpEvent"):
        led.record((1.0, 1.0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="count"):
        led.record_step(1.0, 0.1, 0)
    assert led.steps == 8  # refused records change nothing


def test_ledger_copy_equality_and_state_round_trip():
    led = Ledger()
    led.record_step(1.0, 0.1, 3)
    led.record(SelfComposed(Composed([Gaussian(2.0), NonPrivate()]), 2), label="debug")
    led.record_step(0.0, 0.1)
    twin = led.copy()
    twin.record_step(1.0, 0.1)
    assert twin != led and led.steps == 4 and twin.steps == 5
    back = Ledger.from_state_dict(json.loads(json.dumps(led.state_dict())))
    assert back == led
    assert (back.steps, back.noiseless_steps, back.releases) == (4, 1, 1)
    assert back.parts() == led.parts()
    with pytest.raises(ValueError, match="version"):
        Ledger.from_state_dict({"version": 99, "entries": []})
    with pytest.raises(ValueError, match="unknown fields"):
        Ledger.from_list([{"event": {"type": "non_private"}, "count": 1, "label": "x", "note": 1}])
    with pytest.raises(ValueError, match="label"):
        Ledger.from_list([{"event": {"type": "non_private"}, "count": 1, "label": "step"}])


# --------------------------------------------------------------------------- accountants read the ledger


@pytest.mark.parametrize("name", NAMES)
def test_ledger_composition_equals_history_functions(name):
    acc = make_accountant(name)
    for s, q, n in HIST:
        acc.step(s, q, n)
    want = _history_epsilon(name, HIST, 1e-5)
    assert acc.get_epsilon(1e-5) == pytest.approx(want, rel=1e-12)
    # the same steps as one event: SelfComposed / Composed, in another order (composition commutes)
    ev = Composed([SelfComposed(PoissonSampledGaussian(s, q), n) for s, q, n in reversed(HIST)])
    assert make_accountant(name).epsilon_of(ev, 1e-5) == pytest.approx(want, rel=1e-12)
    assert acc.epsilon_of(acc.ledger.as_event(), 1e-5) == pytest.approx(want, rel=1e-12)
    # a release recorded with record() composes like steps at the same (sigma, q)
    other = make_accountant(name)
    for s, q, n in HIST[:-1]:
        other.step(s, q, n)
    other.record(SelfComposed(PoissonSampledGaussian(*HIST[-1][:2]), HIST[-1][2]), label="eval")
    assert other.get_epsilon(1e-5) == pytest.approx(want, rel=1e-12)
    assert other.steps == sum(n for _, _, n in HIST[:-1])  # a release is not a training step


@pytest.mark.parametrize("name", NAMES)
def test_no_guarantee_gives_infinite_epsilon(name):
    acc = make_accountant(name)
    acc.step(1.0, 0.01, 10)
    acc.record_step(0.0, 0.01)  # a step without noise: recorded honestly
    assert acc.steps == 10 and acc.ledger.steps == 11 and acc.ledger.noiseless_steps == 1
    assert acc.get_epsilon(1e-5) == math.inf
    with pytest.raises(ValueError, match="noise_multiplier"):
        acc.step(0.0, 0.01)  # the original API still requires sigma > 0
    acc2 = make_accountant(name)
    acc2.record(NonPrivate(), label="debug print")
    assert acc2.get_epsilon(1e-5) == math.inf and acc2.steps == 0
    assert make_accountant(name).epsilon_after(NonPrivate(), 1e-5) == math.inf
    assert make_accountant(name).get_epsilon(1e-5) == 0.0
    assert make_accountant(name).epsilon_of(Composed([]), 1e-5) == 0.0


def test_accountant_specific_readers_see_the_ledger():
    rdp, prv, gdp = RDPAccountant(), PRVAccountant(), GDPAccountant()
    for acc in (rdp, prv, gdp):
        acc.step(1.0, 0.01, 50)
        acc.record(Gaussian(20.0), label="eval")
    both = [(1.0, 0.01, 50), (20.0, 1.0, 1)]
    np.testing.assert_allclose(rdp.get_rdp(), sum(np.asarray(_rdp_cached(q, s, rdp.orders)) * n for s, q, n in both),
                               rtol=1e-12)
    assert gdp.get_mu() == pytest.approx(gdp_mu(both), rel=1e-12)
    assert prv.get_epsilon_bounds(1e-5)[2] == prv.get_epsilon(1e-5)
    for acc in (rdp, prv, gdp):
        acc.record_step(0.0, 0.01)
    assert np.all(np.isinf(rdp.get_rdp())) and rdp.get_epsilon_and_order(1e-5)[0] == math.inf
    assert gdp.get_mu() == math.inf and prv.get_epsilon_bounds(1e-5) == (math.inf,) * 3


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("event", [
    PoissonSampledGaussian(1.0, 0.01),  # merges with a phase already there
    PoissonSampledGaussian(0.7, 0.03),  # a new phase
    SelfComposed(Composed([Gaussian(8.0), PoissonSampledGaussian(1.5, 0.01)]), 3),
])
def test_look_ahead_equals_recording_in_a_copy(name, event):
    acc = make_accountant(name)
    for s, q, n in HIST:
        acc.step(s, q, n)
    before = copy.deepcopy(acc.state_dict())
    ahead = acc.epsilon_after(event, 1e-5)
    assert acc.state_dict() == before  # nothing recorded
    twin = make_accountant(name)
    twin.load_state_dict(acc.state_dict())
    twin.record(event, label="next")
    assert ahead == twin.get_epsilon(1e-5)
    twin2 = make_accountant(name)
    twin2.load_state_dict(acc.state_dict())
    twin2.record(event, count=2, label="next")
    assert acc.epsilon_after(event, 1e-5, count=2) == twin2.get_epsilon(1e-5)
    assert ahead > acc.get_epsilon(1e-5)


def test_look_ahead_on_many_phases_reuses_cached_curves():
    orders = (1.5, 2.0, 4.0, 8.0, 16.0, 32.0)
    acc = RDPAccountant(orders=orders)
    phases = [(0.8 + 0.001 * k, 0.004 + 1e-6 * (k % 7), 1 + k % 3) for k in range(2000)]
    for s, q, n in phases:
        acc.step(s, q, n)
    acc.get_epsilon(1e-5)
    misses = _rdp_cached.cache_info().misses
    s, q, _ = phases[-1]
    ahead = acc.epsilon_after(PoissonSampledGaussian(s, q), 1e-5)
    assert _rdp_cached.cache_info().misses == misses  # no curve recomputed for the look-ahead
    acc.step(s, q)
    assert acc.get_epsilon(1e-5) == ahead


# --------------------------------------------------------------------------- accountant states


@pytest.mark.parametrize("name", NAMES)
def test_state_round_trip_with_noiseless_steps_and_releases(name):
    acc = make_accountant(name)
    acc.step(1.0, 0.01, 20)
    acc.record(Gaussian(4.0), label="eval")
    acc.step(1.0, 0.01, 5)
    state = json.loads(json.dumps(acc.state_dict()))
    assert state["version"] == 2
    assert state["history"][0] == [1.0, 0.01, 20]  # training steps keep the compact version-1 triple
    fresh = make_accountant(name)
    fresh.load_state_dict(state)
    assert fresh.ledger == acc.ledger and fresh.history == acc.history == [(1.0, 0.01, 25)]
    assert fresh.get_epsilon(1e-5) == acc.get_epsilon(1e-5)
    acc.record_step(0.0, 0.01)
    fresh = make_accountant(name)
    fresh.load_state_dict(json.loads(json.dumps(acc.state_dict())))
    assert fresh.ledger.noiseless_steps == 1 and fresh.get_epsilon(1e-5) == math.inf


def test_version_1_states_load_and_are_held_to_their_format():
    v1 = {"accountant": "rdp", "version": 1, "history": [[1.0, 0.01, 20], [2.0, 0.01, 3]],
          "config": {"orders": list(DEFAULT_ORDERS)}}
    acc = RDPAccountant()
    acc.load_state_dict(v1)
    assert acc.history == [(1.0, 0.01, 20), (2.0, 0.01, 3)] and acc.ledger.steps == 23
    assert acc.get_epsilon(1e-5) == pytest.approx(_history_epsilon("rdp", [(1.0, 0.01, 20), (2.0, 0.01, 3)], 1e-5),
                                                  rel=1e-12)
    no_version = {k: v for k, v in v1.items() if k != "version"}
    acc2 = RDPAccountant()
    acc2.load_state_dict(no_version)
    assert acc2.ledger == acc.ledger
    # version 1 never held sigma = 0 steps or other releases
    with pytest.raises(ValueError, match="noise_multiplier.*> 0"):
        RDPAccountant().load_state_dict(dict(v1, history=[[0.0, 0.01, 2]]))
    with pytest.raises(ValueError, match="history entries"):
        RDPAccountant().load_state_dict(dict(v1, history=[{"event": {"type": "non_private"}, "count": 1,
                                                           "label": "x"}]))
    with pytest.raises(ValueError, match="version"):
        RDPAccountant().load_state_dict(dict(v1, version=3))
    assert acc.steps == 23


# --------------------------------------------------------------------------- calibration over factories


class _RenamedRDP(RDPAccountant):
    name = "renamed"


class _PlainGDP(Accountant):
    """An accountant outside the registry with only the base class's default calibration plan (q = 1 GDP: exact)."""

    name = "plain-gdp"

    def _epsilon(self, history, delta):
        return epsilon_from_mu(gdp_mu(history), delta)


def test_calibration_runs_the_accountants_plan_not_its_name():
    want = get_noise_multiplier(3.0, 1e-5, 0.01, steps=500, accountant="rdp")
    assert get_noise_multiplier(3.0, 1e-5, 0.01, steps=500, accountant=RDPAccountant) == want
    assert get_noise_multiplier(3.0, 1e-5, 0.01, steps=500, accountant=_RenamedRDP) == want
    orders = (2.0, 4.0, 8.0, 16.0, 32.0)
    coarse = functools.partial(RDPAccountant, orders=orders)
    sigma = get_noise_multiplier(3.0, 1e-5, 0.01, steps=500, accountant=coarse)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # optimum at an end of the short grid
        assert get_epsilon(sigma, 0.01, 500, 1e-5, accountant=coarse) <= 3.0
        assert get_epsilon(sigma / (1 + 1e-3), 0.01, 500, 1e-5, accountant=coarse) > 3.0
    assert sigma >= want  # fewer orders: a looser bound needs more noise


def test_default_plan_is_conservative_and_tight_for_a_new_accountant():
    plan = _PlainGDP().calibration_plan(2.0, 1e-6, 1.0, 50)
    assert isinstance(plan, CalibrationPlan) and plan.closed_form is None and len(plan.stages) == 1
    sigma = get_noise_multiplier(2.0, 1e-6, 1.0, steps=50, accountant=_PlainGDP)
    eps = get_epsilon(sigma, 1.0, 50, 1e-6, accountant=_PlainGDP)
    assert eps <= 2.0 and get_epsilon(sigma / (1 + 1.1e-3), 1.0, 50, 1e-6, accountant=_PlainGDP) > 2.0
    # q = 1 GDP is exact, so the GDP accountant's closed form is the same sigma to the search's tolerance
    closed = get_noise_multiplier(2.0, 1e-6, 1.0, steps=50, accountant="gdp")
    assert sigma == pytest.approx(closed, rel=1.1e-3) and sigma >= closed


def test_resolve_factory_refuses_what_is_not_a_factory():
    assert resolve_factory(" PRV ") is PRVAccountant
    with pytest.raises(ValueError, match="instance"):
        resolve_factory(RDPAccountant())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not an Accountant"):
        resolve_factory(lambda: 3)  # type: ignore[arg-type, return-value]
    used = RDPAccountant()
    used.step(1.0, 0.1)
    with pytest.raises(ValueError, match="fresh"):
        resolve_factory(lambda: used)
    with pytest.raises(ValueError, match="unknown accountant 3"):
        resolve_factory(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'moments'"):
        get_noise_multiplier(3.0, 1e-5, 0.01, steps=10, accountant="moments")


# --------------------------------------------------------------------------- random event trees

_leaf = st.one_of(
    st.builds(PoissonSampledGaussian, st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.sampled_from([0.01, 0.1, 1.0])),
    st.just(NonPrivate()),
)
_events = st.recursive(
    _leaf,
    lambda kids: st.one_of(st.lists(kids, max_size=4).map(Composed),
                           st.builds(SelfComposed, kids, st.integers(1, 5))),
    max_leaves=12,
)


def _naive_counts(event, times=1, out=None):
    """Count the Gaussian pieces by walking the tree (the oracle for decompose)."""
    out = {} if out is None else out
    if isinstance(event, PoissonSampledGaussian):
        key = (event.noise_multiplier, event.sample_rate)
        out[key] = out.get(key, 0) + times
    elif isinstance(event, Composed):
        for e in event.events:
            _naive_counts(e, times, out)
    elif isinstance(event, SelfComposed):
        _naive_counts(event.event, times * event.count, out)
    return out


def _has_no_guarantee(event) -> bool:
    if isinstance(event, NonPrivate):
        return True
    if isinstance(event, PoissonSampledGaussian):
        return event.noise_multiplier == 0.0
    if isinstance(event, Composed):
        return any(_has_no_guarantee(e) for e in event.events)
    return _has_no_guarantee(event.event)


@settings(max_examples=60, deadline=None)
@given(_events, st.integers(1, 3))
def test_random_events_serialise_and_decompose(event, times):
    assert event_from_dict(json.loads(json.dumps(event.to_dict()))) == event
    parts = decompose(event, times)
    naive = _naive_counts(event, times)
    assert parts.non_private == _has_no_guarantee(event)
    assert parts.gaussians == {k: n for k, n in naive.items() if k[0] > 0}
    led = Ledger()
    led.record(event, count=times, label="r")
    assert Ledger.from_list(json.loads(json.dumps(led.to_list()))) == led
    acc = RDPAccountant()
    acc.record(event, count=times, label="r")
    want = math.inf if parts.non_private else (
        0.0 if not parts.gaussians else rdp_epsilon_for_history(parts.history(), 1e-5, DEFAULT_ORDERS, False)[0])
    assert acc.get_epsilon(1e-5) == want == RDPAccountant().epsilon_after(event, 1e-5, count=times)
