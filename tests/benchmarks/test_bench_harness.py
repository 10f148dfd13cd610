"""The benchmark harness's own logic (benchmarks/run.py, benchmarks/zoo.py): the largest-batch search, the target
checks, the reports, and one real timing worker on a tiny workload. No timing is asserted."""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

run = pytest.importorskip("run")
zoo = pytest.importorskip("zoo")


@pytest.mark.parametrize("limit", [1, 3, 5, 8, 13, 100, 1000, 5000])
@pytest.mark.parametrize("start", [1, 4, 16])
def test_max_batch_search_finds_the_limit(monkeypatch, limit, start):
    probes = []

    def fake_worker(args, kind, w, methods):
        probes.append(w.batch)
        return {"fits": w.batch <= limit}

    monkeypatch.setattr(run, "_call_worker", fake_worker)
    w = zoo.Workload("gpt2", 64, start)
    found = run.max_batch(argparse.Namespace(), w, "non-private", cap=4096)
    if limit >= 4096:
        assert found == 4096
    elif limit < 1:
        assert found is None
    else:
        assert found <= limit  # never reports a batch that did not fit
        assert found >= limit - max(1, limit // 16)  # and is within about 6 % of the limit
        assert all(b <= 4096 for b in probes)
    assert len(probes) < 40


def test_max_batch_search_none_when_nothing_fits(monkeypatch):
    monkeypatch.setattr(run, "_call_worker", lambda *a: {"fits": False})
    assert run.max_batch(argparse.Namespace(), zoo.Workload("gpt2", 64, 8), "x", cap=64) is None


def _result(default_t, default_m, opacus_t, bitfit_t, model="gpt2", size=64):
    w = zoo.Workload(model, size, 4)
    methods = {"non-private": {"median_s": 1.0, "time_ratio": 1.0, "memory_mb": 100.0, "memory_ratio": 1.0},
               zoo.DEFAULT_METHOD: {"median_s": default_t, "time_ratio": default_t, "memory_mb": 100 * default_m,
                                    "memory_ratio": default_m},
               "Opacus hooks": {"median_s": opacus_t, "time_ratio": opacus_t},
               "Opacus ghost": {"unsupported": "reason"},
               "DP-BiTFiT": {"median_s": bitfit_t, "time_ratio": bitfit_t}}
    return {"workload": {"model": model, "size": size, "batch": 4, "preset": "cpu"}, "tag": w.tag,
            "describe": w.describe(), "tokens": w.tokens, "methods": methods}


def test_targets_are_checked_against_the_thresholds():
    ok = run.evaluate_targets({"workloads": [_result(1.1, 1.05, 2.0, 0.6)]})
    assert [t["met"] for t in ok] == [True, True, True, True]
    bad = run.evaluate_targets({"workloads": [_result(1.3, 1.25, 1.5, 0.75)]})
    assert [t["met"] for t in bad] == [False, False, False, False]
    # T > 256 and ResNet: no <= 1.2x check
    long = run.evaluate_targets({"workloads": [_result(1.3, 1.3, 2.0, 0.6, size=1024),
                                               _result(1.3, 1.3, 2.0, 0.6, model="resnet", size=32)]})
    assert not any("1.2x" in t["target"] for t in long)


def test_reports_render_every_row(tmp_path):
    res = {"command": "c", "json": "j", "env": {"device": "cpu", "cpu": "x", "threads": 2, "torch": "t",
                                                "date": "d"},
           "config": {"reps": 1, "warmup": 1, "mem_steps": 1, "preset": "cpu"},
           "workloads": [_result(1.1, 1.05, 2.0, 0.6)]}
    text = run.render_markdown(res, "c")
    assert "not supported: reason" in text and "| DP-BiTFiT | 600.0 | 0.60x |" in text
    run.write_csv(res, tmp_path / "r.csv")
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert len(rows) == 5 and {r["status"] for r in rows} == {"ok", "not supported: reason"}


def test_timing_worker_runs_fastdp_and_baselines_on_a_tiny_workload():
    pytest.importorskip("transformers")
    import torch

    w = zoo.Workload("gpt2", 8, 2)
    saved = zoo.WIDTHS["cpu"]["gpt2"]
    zoo.WIDTHS["cpu"]["gpt2"] = (50, 16, 1, 2, 0)
    try:
        out = run.worker_time(w, ["non-private", zoo.DEFAULT_METHOD, "DP-BiTFiT"], torch.device("cpu"), reps=2,
                              warmup=1)
    finally:
        zoo.WIDTHS["cpu"]["gpt2"] = saved
    assert set(out) == {"non-private", zoo.DEFAULT_METHOD, "DP-BiTFiT"}
    assert all(len(r["times_s"]) == 2 for r in out.values()), out


def test_every_method_has_a_builder():
    with pytest.raises(ValueError, match="unknown method"):
        zoo.make_step(zoo.Workload("gpt2", 8, 2), "nope", device=None)
