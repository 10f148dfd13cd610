"""The benchmark harness's own logic (benchmarks/run.py, zoo.py, presets.py, workers.py, tables.py): the
largest-batch search, the target checks, the reports, every preset end to end in quick mode on tiny models, and the
docs' generated tables. No timing is asserted."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

run = pytest.importorskip("run")
zoo = pytest.importorskip("zoo")
tables = pytest.importorskip("tables")
workers = pytest.importorskip("workers")
presets = pytest.importorskip("presets")


@pytest.mark.parametrize("limit", [1, 3, 5, 8, 13, 100, 1000, 5000])
@pytest.mark.parametrize("start", [1, 4, 16])
def test_max_batch_search_finds_the_limit(monkeypatch, limit, start):
    probes = []

    def fake_worker(args, kind, w, methods):
        probes.append(w.batch)
        return {"fits": w.batch <= limit}

    monkeypatch.setattr(run, "_call_worker", fake_worker)
    w = zoo.Workload("gpt2", 64, start)
    found = run.max_batch(argparse.Namespace(max_batch_probes="process"), w, "non-private", cap=4096)
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
    assert run.max_batch(argparse.Namespace(max_batch_probes="process"), zoo.Workload("gpt2", 64, 8), "x",
                         cap=64) is None


@pytest.mark.parametrize("limit", [3, 20, 37])
def test_max_batch_in_one_process_drops_each_probe(monkeypatch, limit):
    """The one-process search (worker_max_batch): a probe above ``limit`` runs out of memory (simulated) in its
    first step; the search still finds the limit to ~6 %, every probe's engine is detached (none left attached),
    and the structure probe is off for the probes."""
    from fastdp import engine_registry

    built = []
    real = zoo.make_step

    def make_step(w, method, device, **kw):
        step = real(w, method, device, **kw)
        built.append((w.batch, kw, step.engine))

        def oom_step(data):
            if w.batch > limit:
                raise torch.OutOfMemoryError("simulated")
            step(data)
        oom_step.engine = step.engine
        return oom_step

    monkeypatch.setattr(zoo, "make_step", make_step)
    w = zoo.Workload("tinylm", 8, 2, "tiny")
    found = workers.worker_max_batch(w, zoo.DEFAULT_METHOD, torch.device("cpu"), cap=64)["max_batch"]
    assert limit - max(1, limit // 16) <= found <= limit
    assert all(kw == {"verify_structure": False} for _, kw, _ in built)
    assert not any(e in engine_registry._ATTACHED_ENGINES for _, _, e in built)


def test_max_batch_in_one_process_through_run(monkeypatch):
    calls = []
    monkeypatch.setattr(run, "_call_worker", lambda args, kind, w, methods, elements=0: (
        calls.append((kind, elements)), {"max_batch": 48})[1])
    args = argparse.Namespace(max_batch_probes="one-process")
    assert run.max_batch(args, zoo.Workload("gpt2", 64, 8), "x", cap=1024) == 48
    assert calls == [("max_batch", 1024)]


def _result(default_t, default_m, opacus_t, bitfit_t, model="gpt2", size=64, bitfit_m=None):
    w = zoo.Workload(model, size, 4)
    methods = {"non-private": {"median_s": 1.0, "time_ratio": 1.0, "memory_mb": 100.0, "memory_ratio": 1.0},
               "non-private BiTFiT": {"median_s": 0.5, "time_ratio": 0.5, "memory_mb": 50.0, "memory_ratio": 0.5},
               zoo.DEFAULT_METHOD: {"median_s": default_t, "time_ratio": default_t, "memory_mb": 100 * default_m,
                                    "memory_ratio": default_m},
               "Opacus hooks": {"median_s": opacus_t, "time_ratio": opacus_t},
               "Opacus ghost": {"unsupported": "reason"},
               "DP-BiTFiT": {"median_s": bitfit_t, "time_ratio": bitfit_t, "memory_mb": bitfit_m or 50 * bitfit_t / 0.5,
                             "memory_ratio": (bitfit_m or 50 * bitfit_t / 0.5) / 100}}
    return {"workload": {"model": model, "size": size, "batch": 4, "widths": "cpu"}, "tag": w.tag,
            "describe": w.describe(), "tokens": w.tokens, "methods": methods}


def test_targets_are_checked_against_the_thresholds():
    # default time 1.08x, memory 1.05x, 2x faster than Opacus hooks, DP-BiTFiT 1.04x non-private BiTFiT
    ok = tables.evaluate_targets({"workloads": [_result(1.08, 1.05, 2.16, 0.52)]})
    assert [t["met"] for t in ok] == [True] * 5, ok
    bad = tables.evaluate_targets({"workloads": [_result(1.15, 1.12, 1.5, 0.55, bitfit_m=60.0)]})
    assert [t["met"] for t in bad] == [False] * 5, bad
    assert {t["target"].split(" <=")[0].split(" >=")[0] for t in bad} == {
        "default mode step time", "default mode peak memory growth", "default mode", "DP-BiTFiT time",
        "DP-BiTFiT memory"}
    # T < 64 text: no transformer check; ResNet: its own 1.4x limit; the ViT at every size
    short = tables.evaluate_targets({"workloads": [_result(1.3, 1.3, 2.0, 0.5, size=32)]})
    assert not any(t["target"].startswith("default mode step") for t in short)
    resnet = tables.evaluate_targets({"workloads": [_result(1.3, 1.5, 2.0, 0.5, model="resnet", size=32)]})
    assert [(t["target"], t["met"]) for t in resnet if "1.4x non-private" in t["target"]] == [
        ("default mode step time <= 1.4x non-private (ResNet-GroupNorm)", True),
        ("default mode peak memory growth <= 1.4x non-private (ResNet-GroupNorm)", False)]
    vit = tables.evaluate_targets({"workloads": [_result(1.3, 1.0, 2.0, 0.5, model="vit", size=32)]})
    assert ("default mode step time <= 1.1x non-private (transformers, T >= 64)", False) in [
        (t["target"], t["met"]) for t in vit]


def test_reports_render_every_row(tmp_path):
    res = {"command": "c", "json": "j", "env": {"device": "cpu", "cpu": "x", "threads": 2, "torch": "t",
                                                "date": "d", "cpu_count": 2},
           "config": {"reps": 1, "warmup": 1, "mem_steps": 1, "preset": "cpu"},
           "workloads": [_result(1.1, 1.05, 2.0, 0.6)]}
    text = tables.render_steps(res, targets=True)
    assert "not supported: reason" in text and "| DP-BiTFiT | 600.0 | 0.60x |" in text
    tables.write_csv(res, tmp_path / "r.csv")
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert "Targets" in text and "checks met" in text
    assert len(rows) == 6 and {r["status"] for r in rows} == {"ok", "not supported: reason"}


def test_timing_worker_runs_fastdp_and_baselines_on_a_tiny_workload():
    pytest.importorskip("transformers")
    import torch

    w = zoo.Workload("gpt2", 8, 2, "tiny")
    out = workers.worker_time(w, ["non-private", zoo.DEFAULT_METHOD, "DP-BiTFiT"], torch.device("cpu"), reps=2,
                              warmup=1)
    assert set(out) == {"non-private", zoo.DEFAULT_METHOD, "DP-BiTFiT"}
    assert all(len(r["times_s"]) == 2 for r in out.values()), out


def test_every_method_has_a_builder():
    with pytest.raises(ValueError, match="unknown method"):
        zoo.make_step(zoo.Workload("gpt2", 8, 2), "nope", device=None)


def test_variants_set_their_switches():
    import torch

    w = zoo.Workload("tinylm", 8, 2, "tiny")
    on = zoo.make_step(w, zoo.DEFAULT_METHOD, torch.device("cpu"))
    off = zoo.make_step(w, f"{zoo.DEFAULT_METHOD}, on arrival off", torch.device("cpu"))
    unprobed = zoo.make_step(w, f"{zoo.DEFAULT_METHOD}, no probe", torch.device("cpu"))
    assert on.engine._capture.on_arrival and not off.engine._capture.on_arrival
    assert on.engine.verify_structure and not unprobed.engine.verify_structure
    assert zoo.make_step(w, "non-private", torch.device("cpu")).engine is None
    import fastdp.layers._grams as grams
    import fastdp.layers._matmul as matmul
    import fastdp.layers._products as products_mod

    seen = []
    slack = zoo.make_step(w, f"{zoo.DEFAULT_METHOD}, slack 1.25", torch.device("cpu"))
    real = matmul.instantiation_fits
    try:
        matmul.instantiation_fits = lambda *a, **k: seen.append(matmul.INSTANTIATION_SLACK) or real(*a, **k)
        slack(zoo.make_batch(w, torch.device("cpu")))
    finally:
        matmul.instantiation_fits = real
    assert seen and set(seen) == {1.25} and matmul.INSTANTIATION_SLACK == 1.0  # set for its steps only

    strips = []
    full = zoo.make_step(w, f"{zoo.DEFAULT_METHOD}, full Grams", torch.device("cpu"))
    real_strips = grams.gram_strips
    try:
        grams.gram_strips = lambda X, *a: strips.append(grams.strip_count(X)) or real_strips(X, *a)
        full(zoo.make_batch(w, torch.device("cpu")))
    finally:
        grams.gram_strips = real_strips
    assert strips and set(strips) == {1} and grams.GRAM_STRIP["cpu"] == (64, 4)  # whole Grams for its steps only

    aligned = zoo.make_step(w, f"{zoo.DEFAULT_METHOD}, aligned Grams", torch.device("cpu"))
    seen_align = []
    try:
        grams.gram_strips = lambda X, *a: seen_align.append(dict(grams.GRAM_ALIGN)) or real_strips(X, *a)
        aligned(zoo.make_batch(w, torch.device("cpu")))
    finally:
        grams.gram_strips = real_strips
    assert seen_align and all(a.get("cpu") == 16 for a in seen_align) and grams.GRAM_ALIGN == {}  # its steps only

    half = zoo.make_step(w, f"{zoo.DEFAULT_METHOD}, bf16 autocast, bf16 products", torch.device("cpu"))
    products = []
    real_mm = products_mod.bf16_matmul_float32
    try:
        products_mod.bf16_matmul_float32 = lambda a, b: products.append(a.dtype) or real_mm(a, b)
        half(zoo.make_batch(w, torch.device("cpu")))
    finally:
        products_mod.bf16_matmul_float32 = real_mm
    assert products and set(products) == {torch.bfloat16} and matmul.BF16_PRODUCTS == frozenset()  # its steps only

    import fastdp.noise as noise

    default_buckets = noise.NOISE_BUCKETS
    bucketed = zoo.make_step(w, f"{zoo.DEFAULT_METHOD}, noise buckets", torch.device("cpu"))
    draws = []
    real_buckets = noise._bucketed_noisy_means
    try:
        noise._bucketed_noisy_means = lambda *a: draws.append(1) or real_buckets(*a)
        bucketed(zoo.make_batch(w, torch.device("cpu")))
    finally:
        noise._bucketed_noisy_means = real_buckets
    assert draws and noise.NOISE_BUCKETS == default_buckets == frozenset({"cuda"})  # its steps only


def test_workload_refuses_a_width_set_without_the_model():
    with pytest.raises(ValueError, match="width set 'wide' has no 'vit'"):
        zoo.Workload("vit", 224, 8, "wide")


QUICK = {  # (extra arguments, what a row must hold) per preset; Opacus is left out where it is not installed
    "cpu": (["--models", "gpt2", "vit", "--methods", "non-private", zoo.DEFAULT_METHOD, "fastdp ghost",
             "DP-BiTFiT"], "times_s"),
    "paper": (["--models", "roberta", "--methods", "non-private", zoo.DEFAULT_METHOD], "times_s"),
    "engine": (["--no-memory"], "times_s"),
    "targets": (["--models", "tinycls", "roberta"], "memory_mb"),
    "models": (["--models", "gpt2", "vit"], "memory_mb"),
    "bitfit-trend": ([], "times_s"),
    "on-arrival": ([], "times_s"),
    "probe-cost": ([], "probe_s"),
    "noise": ([], "times_s"),
    "slack": (["--models", "gpt2"], "flops"),
    "folded": ([], "times_s"),
}


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_every_preset_runs_in_quick_mode_and_renders(name, tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("timm")
    assert set(QUICK) == set(presets.PRESETS), "a new preset needs a quick test"
    extra, key = QUICK[name]
    run.main(["--preset", name, "--quick", "--in-process", "--device", "cpu", "--results-dir", str(tmp_path),
              *extra])
    results = json.loads((tmp_path / f"run_cpu_{name}_quick.json").read_text())
    assert results["preset"] == name and results["workloads"]
    for wl in results["workloads"]:
        for m, r in wl["methods"].items():
            assert key in r, (wl["tag"], m, r)
            assert "median_s" in r and r["time_ratio"] > 0, (wl["tag"], m, r)
    if name == "probe-cost":  # the probe ran in the runs with it, and not in the others
        for wl in results["workloads"]:
            assert wl["methods"][zoo.DEFAULT_METHOD]["probe_median_s"] > 0
            # batches of B and B - 1 in turn: the probe verifies the signature at both sizes
            two = results["config"]["steps"] >= 2 and wl["workload"]["batch"] > 2
            assert wl["methods"][zoo.DEFAULT_METHOD]["probe_runs"] == (2 if two else 1)
            assert wl["methods"][f"{zoo.DEFAULT_METHOD}, no probe"]["probe_s"] == [0.0]
    text = tables.render(results)
    printed = capsys.readouterr().out
    assert text in printed
    for view in (None, "steps") if results["kind"] == "steps" else (None,):
        body = tables.render(results, view)
        assert results["json"] in body
    rows = list(csv.DictReader(open(tmp_path / f"run_cpu_{name}_quick.csv")))
    assert len(rows) == sum(len(wl["methods"]) for wl in results["workloads"])
    assert {r["status"] for r in rows} == {"ok"}


def _doc(tmp_path, body):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    doc = tmp_path / "docs" / "results" / "b.md"
    doc.write_text(body)
    return doc


def test_tables_rewrite_only_between_markers(tmp_path):
    res_dir = tmp_path / "res"
    res_dir.mkdir()
    res = {"command": "c", "json": "benchmarks/results/run_cpu_x.json", "preset": "models", "kind": "steps",
           "env": {"device": "cpu", "cpu": "x", "threads": 2, "torch": "t", "date": "d", "cpu_count": 2},
           "config": {"reps": 1, "warmup": 1, "mem_steps": 1, "preset": "models"},
           "workloads": [_result(1.1, 1.05, 2.0, 0.6)]}
    res["workloads"][0]["methods"]["non-private BiTFiT"] = {"median_s": 0.5, "time_ratio": 0.5, "memory_mb": 80.0}
    res["workloads"][0]["methods"]["DP-BiTFiT"]["memory_mb"] = 88.0
    (res_dir / "run_cpu_x.json").write_text(json.dumps(res))
    doc = _doc(tmp_path, "# T\n\nhand text 9.99x\n\n<!-- table:run_cpu_x -->\nold 1.23x\n<!-- /table -->\n\nmore "
                         "text\n<!-- table:run_cpu_x:bitfit -->\n<!-- /table -->\n")
    changed = tables.write_docs(res_dir, tmp_path)
    text = doc.read_text()
    assert {n for _, n in changed} == {"run_cpu_x", "run_cpu_x:bitfit"}
    assert "old 1.23x" not in text and "hand text 9.99x" in text and "more text" in text
    assert "| DP-BiTFiT | 600.0 | 0.60x |" in text  # the steps view
    assert "| 1.20x | 0.60x | 1.10x | 0.50x |" in text  # bitfit view: 0.6/0.5 time, 88/80 memory
    assert text.count("<!-- /table -->") == 2
    assert tables.write_docs(res_dir, tmp_path, check=True) == []  # idempotent: nothing left to change
    doc.write_text(text.replace("0.60x", "0.59x", 1))
    assert tables.write_docs(res_dir, tmp_path, check=True)  # a hand edit between markers is found


def test_tables_name_a_missing_result_or_view(tmp_path):
    (tmp_path / "res").mkdir()
    _doc(tmp_path, "<!-- table:run_cpu_nothing -->\n<!-- /table -->\n")
    with pytest.raises(FileNotFoundError, match="run_cpu_nothing"):
        tables.write_docs(tmp_path / "res", tmp_path)
    with pytest.raises(ValueError, match="unknown table view 'nope'"):
        tables.render({"workloads": []}, "nope")


def test_the_docs_tables_are_what_the_saved_results_give():
    """Every generated table in README.md and docs/ matches benchmarks/results/ (python benchmarks/tables.py)."""
    changed = tables.write_docs(check=True)
    assert changed == [], f"regenerate with python benchmarks/tables.py: {changed}"
    names = [n for doc in tables.doc_files(ROOT) for n in tables.MARKER.findall(doc.read_text())]
    assert names, "no generated tables found in the docs"


def test_a_model_the_preset_lacks_is_named(tmp_path):
    with pytest.raises(SystemExit, match="preset 'engine' has no workload.*'tinylm'"):
        run.main(["--preset", "engine", "--models", "gpt2", "--in-process", "--results-dir", str(tmp_path)])


def test_levers_ab_runs_and_restores_the_current_code(capsys, tmp_path):
    import levers

    import fastdp.clipped_sums
    import fastdp.layers._factored
    import fastdp.layers._grams
    import fastdp.layers._matmul
    import fastdp.layers._rounding
    import fastdp.noise
    import fastdp.torch_api
    from fastdp.layers.kinds import conv as conv_kind
    from fastdp.layers.kinds import groupnorm
    from fastdp.layers.kinds.conv import ConvKind
    from fastdp.layers.kinds.layernorm import LayerNormKind

    def current():
        return (fastdp.clipped_sums.norm_sq, fastdp.layers._grams.SHARE_INPUT_GRAMS, fastdp.noise.NOISE_THREADS,
                ConvKind.prepare, ConvKind.clipped_sum, fastdp.layers._matmul._scaled, fastdp.clipped_sums._drop_kept,
                fastdp.clipped_sums._net_bytes, fastdp.layers._matmul.instantiation_fits, conv_kind.CLIPPED_SUM,
                conv_kind.PIXEL_GRAMS, ConvKind.instantiation_fits, fastdp.noise.NOISE_CHUNK,
                dict(fastdp.layers._grams.GRAM_STRIP), conv_kind.PER_SAMPLE_GRADS, LayerNormKind.normalize,
                groupnorm.FOLDED_MIN_POSITIONS, fastdp.noise._runs, dict(fastdp.layers._grams.GRAM_ALIGN),
                fastdp.layers._rounding.gram_rounding, fastdp.layers._rounding.guarded_sq,
                fastdp.layers._rounding.exact_flagged, fastdp.torch_api.DENSE_LAYOUT_DEVICES,
                fastdp.layers._rounding.EXACT_WORTH, dict(fastdp.layers._grams.GRAM_CHUNK),
                fastdp.layers._rounding.symmetric_parts, fastdp.layers._guard_batch.BATCHED)

    before = current()
    levers.main(["--quick", "--models", "tinycls", "cnn", "--json", str(tmp_path / "l.json")])
    out = capsys.readouterr().out
    assert out.count("| tinycls-tiny-T16-B2 |") == 1 and "fused-norms gain" in out and "shared-gram gain" in out
    saved = json.loads((tmp_path / "l.json").read_text())["times_s"]["tinycls-tiny-T16-B2"]
    assert set(saved) == {"non-private", "after", "fused-norms before", "shared-gram before",
                         "parallel-noise before", "conv-kernels before", "reused-scratch before",
                         "drop-as-summed before", "sum-order before", "shared-input-fits before",
                         "conv-sum-kernel before", "conv-sum-measure before", "conv-pixel-grams before",
                         "conv-kept-rule before", "noise-in-place before", "gram-strips before",
                         "conv-per-sample-measure before", "ln-weighted-kernel before", "gn-folded before",
                         "balanced-noise-runs before", "cancellation-guard before", "exact-path before",
                         "bn-layout before", "exact-worth before", "gram-chunks before", "guard-ops before",
                         "guard-batch before"}
    assert out.count("| cnn-tiny-img16-B2 |") == 1  # a convolutional workload: the conv-kernels lever patches it
    assert current() == before


def test_levers_flops_mode_counts_the_strips_saving(capsys, tmp_path):
    """``--flops``: matrix-product FLOPs per configuration. At T 8 with strips of 4 rows the LM head's ghost norm
    (vocabulary 50, width 16: ``2 T^2 < p d`` and ``p d > T (p + d)``) forms its Gram matrices as two strips, 3/4 of
    the whole ones' multiply-adds, so the default mode executes fewer FLOPs than with whole Grams
    (``gram-strips before``); the switch is restored."""
    import levers

    import fastdp.layers._grams as grams

    real = dict(grams.GRAM_STRIP)
    grams.GRAM_STRIP["cpu"] = (4, 8)
    try:
        levers.main(["--flops", "--levers", "gram-strips", "--models", "tinylm", "--sizes", "8", "--widths", "tiny",
                     "--batch", "2", "--json", str(tmp_path / "f.json")])
    finally:
        grams.GRAM_STRIP.update(real)
    flops = json.loads((tmp_path / "f.json").read_text())["gflop"]["tinylm-tiny-T8-B2"]
    assert set(flops) == {"non-private", "after", "gram-strips before"}
    assert flops["after"] < flops["gram-strips before"] and flops["non-private"] < flops["gram-strips before"]
    assert "gram-strips gain" in capsys.readouterr().out and grams.GRAM_STRIP == real


def test_levers_gram_ops_times_every_strip_count_and_restores(capsys):
    import levers

    import fastdp.layers._grams as grams

    real = dict(grams.GRAM_STRIP)
    rows = levers.gram_ops_ab(1, shapes=((2, 40, 3, 5),), counts=(1, 2, 4))  # 4 strips of 10 rows: under 16, left out
    assert [set(r) for r in rows] == [{"shape", "device", "K 1", "K 2"}] and grams.GRAM_STRIP == real
    assert "| B 2, T 40, d 3, p 5 |" in capsys.readouterr().out


def test_levers_gram_align_ab_times_both_cuts_and_restores(capsys):
    import kernel_ops

    import fastdp.layers._grams as grams

    real = dict(grams.GRAM_ALIGN)
    rows = kernel_ops.gram_align_ab(1, shapes=((2, 17, 3, 5),))
    assert [set(r) for r in rows] == [{"shape", "device", "cold", "aligned", "unaligned"}] and grams.GRAM_ALIGN == real
    assert "| B 2, T 17, d 3, p 5 |" in capsys.readouterr().out


def test_phases_time_every_stage_and_restore_the_functions(capsys, tmp_path):
    """``benchmarks/phases.py``: both methods' steps in parts, fastdp's stages timed inside them (no timing is
    asserted: only that each stage ran where it must and nothing stays patched)."""
    import phases

    from fastdp.capture import Capture

    before = [getattr(owner, name) for owner, name, _ in phases.TIMED]
    phases.main(["--models", "tinycls", "--sizes", "8", "--widths", "tiny", "--batch", "2", "--reps", "1",
                 "--warmup", "1", "--json", str(tmp_path / "p.json")])
    ms = json.loads((tmp_path / "p.json").read_text())["ms"]["tinycls-tiny-T8-B2"]
    base, dp = ms["non-private"], ms[zoo.DEFAULT_METHOD]
    assert set(base) == set(dp) == set(phases.COLUMNS)
    assert all(base[s] == 0 for s in phases.STAGES)  # no engine: no stage ran
    assert all(dp[s] > 0 for s in phases.STAGES) and dp["norms"] < dp["clipping"] and dp["noise"] < dp["release"]
    assert "| tinycls-tiny-T8-B2 | extra |" in capsys.readouterr().out
    assert [getattr(owner, name) for owner, name, _ in phases.TIMED] == before
    assert Capture.on_output_grad.__name__ == "on_output_grad"


def test_levers_memory_mode_runs_and_restores(capsys, tmp_path):
    """``--memory``: peak live-tensor growth per configuration (what the drops change is checked by
    tests/engine/test_pass_memory.py; the tiny widths here only exercise the mode)."""
    import levers

    import fastdp.clipped_sums

    levers.main(["--quick", "--memory", "--levers", "drop-as-summed", "--models", "cnn", "--json",
                 str(tmp_path / "m.json")])
    live = json.loads((tmp_path / "m.json").read_text())["live_mb"]["cnn-tiny-img16-B2"]
    assert set(live) == {"non-private", "after", "drop-as-summed before"}
    assert all(v > 0 for v in live.values())
    assert fastdp.clipped_sums._drop_kept.__name__ == "_drop_kept"  # restored


def test_live_tensor_peak_counts_what_a_step_holds():
    """``workers._live_peak_bytes`` (the CPU analogue of CUDA's allocator peak): a step that holds one extra
    8 MiB tensor at its peak reads at least 8 MiB more than the same step without it."""
    import workers

    x = torch.randn(64, 64)

    def plain(data):
        (data[0] @ data[0]).sum()

    def holding(data):
        extra = torch.ones(2 * 2**20)  # 8 MiB, alive across the product
        (data[0] @ data[0]).sum()
        del extra

    a = workers._live_peak_bytes(plain, (x, x))
    b = workers._live_peak_bytes(holding, (x, x))
    assert b - a >= 8 * 2**20


def test_matmul_flops_counts_products_and_grouped_convolutions_exactly():
    """``workers.matmul_flops``: 2 per multiply-add of every matrix product a step runs, forward and backward; a
    convolution of ``g`` groups counted as its own work (torch's counter alone counts its weight gradient ``g``
    times over), so the grouped convolution that forms per-sample gradients counts what the batch's weight
    gradient does; CPU attention counted."""
    import torch.nn.functional as F
    import workers

    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert workers.matmul_flops(lambda data: data[0] @ data[1], (a, b)) == 2 * 8 * 16 * 4

    x = torch.randn(4, 3, 9, 9)
    w = torch.randn(5, 3, 3, 3, requires_grad=True)
    go = torch.randn(4, 5, 7, 7)
    per_conv = 2 * 4 * 5 * 3 * 9 * 7 * 7  # B C_out C_in k^2 T, times 2

    def batch_weight_grad(data):
        torch.autograd.grad(F.conv2d(data[0], w), w, data[1])

    def grouped_weight_grads(data):  # the per-sample gradients as one convolution of B groups
        torch.nn.grad.conv2d_weight(data[0].reshape(1, 12, 9, 9), (20, 3, 3, 3), data[1].reshape(1, 20, 7, 7),
                                    groups=4)

    assert workers.matmul_flops(batch_weight_grad, (x, go)) == 2 * per_conv  # forward + weight gradient
    assert workers.matmul_flops(grouped_weight_grads, (x, go)) == per_conv

    q = torch.randn(2, 3, 16, 8, requires_grad=True)

    def attention(data):
        F.scaled_dot_product_attention(data[0], data[0], data[0]).sum().backward()

    assert workers.matmul_flops(attention, (q, q)) > 4 * 2 * 3 * 16 * 16 * 8  # forward alone: 2 products


def test_timing_worker_reports_each_methods_flops():
    w = zoo.Workload("tinycls", 8, 2, "tiny")
    out = workers.worker_time(w, ["non-private", zoo.DEFAULT_METHOD, "DP-BiTFiT"], torch.device("cpu"), reps=1,
                              warmup=1)
    flops = {m: r["flops"] for m, r in out.items()}
    assert all(f > 0 for f in flops.values()), out
    assert flops["DP-BiTFiT"] < flops["non-private"] <= flops[zoo.DEFAULT_METHOD]  # no weight gradients; norms
    rows = {m: dict(r) for m, r in out.items()}
    import run

    run.summarize(rows, "non-private")
    assert rows["non-private"]["flop_ratio"] == 1.0 and rows[zoo.DEFAULT_METHOD]["flop_ratio"] >= 1.0


def test_conv_ops_ab_times_every_path_and_restores_the_switches():
    import levers

    from fastdp.layers.kinds import conv as conv_kind
    from fastdp.layers.kinds.conv import ConvCall

    before = (conv_kind.PIXEL_GRAMS, conv_kind.GROUPED_MIN_POSITIONS, conv_kind.PER_SAMPLE_GRADS,
              ConvCall.pixel_gram_pays)
    rows = levers.conv_ops_ab(1, shapes=((8, 2, 3, 6, 4, 3, 1), (8, 2, 3, 6, 4, 3, 2)))
    assert len(rows) == 2
    for row in rows:
        assert len(row) == 8 and all(v > 0 for k, v in row.items() if k != "shape"), row
    assert (conv_kind.PIXEL_GRAMS, conv_kind.GROUPED_MIN_POSITIONS, conv_kind.PER_SAMPLE_GRADS,
            ConvCall.pixel_gram_pays) == before


def test_slack_ab_reports_flops_and_live_memory_and_restores_the_slack():
    import levers

    import fastdp.layers._matmul as matmul

    before = matmul.INSTANTIATION_SLACK
    rows = levers.slack_ab([zoo.Workload("tinycls", 16, 2, "tiny")])
    row = rows["tinycls-tiny-T16-B2"]
    assert set(row) == {f"{k} {u}" for k in ("non-private", "slack 1", "slack 1.25") for u in ("GFLOP", "live MB")}
    assert all(v > 0 for v in row.values())
    assert matmul.INSTANTIATION_SLACK == before


def test_noise_designs_ab_draws_every_design(capsys, tmp_path):
    """``levers.py --noise``: every design timed on a real workload's parameters, saved under ``ms``; the numpy
    Box-Muller draws standard normals (its distribution, not only its time)."""
    import kernel_ops
    import levers

    levers.main(["--noise", "--models", "vit", "--reps", "1", "--json", str(tmp_path / "n.json")])
    saved = json.loads((tmp_path / "n.json").read_text())["ms"]
    assert list(saved) == ["vit-64"] and set(saved["vit-64"]) == {
        "per parameter", "flat buffer", "fastdp", "fastdp, consecutive runs", "numpy Box-Muller, 1 thread",
        "numpy Box-Muller, 2 threads", "larger run / equal share, balanced", "larger run / equal share, consecutive"}
    assert all(v > 0 for v in saved["vit-64"].values())
    assert 1 <= saved["vit-64"]["larger run / equal share, balanced"] <= saved["vit-64"][
        "larger run / equal share, consecutive"]
    import numpy as np

    z = torch.empty(200_000)
    kernel_ops._numpy_box_muller(z, np.random.PCG64DXSM(0), block=1000)
    assert abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1) < 0.01 and float(z.abs().max()) < 7


def test_norm_ops_ab_times_both_forms_and_restores_the_threshold(capsys, tmp_path):
    """``levers.py --norm-ops``: a GroupNorm's per-sample gradients recomputed and folded, per shape; the switch is
    restored."""
    import levers

    from fastdp.layers.kinds import groupnorm

    before = groupnorm.FOLDED_MIN_POSITIONS
    rows = levers.norm_ops_ab(1, shapes=((2, 32, 4), (3, 64, 1)))
    assert [r["shape"] for r in rows] == ["B 2, C 32, 4x4", "B 3, C 64, 1x1"]
    assert all(r["recompute x_hat"] > 0 and r["folded"] > 0 for r in rows)
    assert groupnorm.FOLDED_MIN_POSITIONS == before


def test_loss_check_cost_runs_and_the_check_reads_the_loss(capsys, tmp_path):
    """``benchmarks/loss_check_cost.py``: the check it times recognises the per-sample mean it is given, and the
    trace finds it separable (no timing is asserted)."""
    import loss_check_cost

    loss_check_cost.main(["--shapes", "3,8,13", "--reps", "1", "--json", str(tmp_path / "c.json")])
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [r["verdict"] for r in rows] == ["per-sample mean"] and rows[0]["check_ms"] > 0
    assert [r["trace_verdict"] for r in rows] == ["separable"] and rows[0]["traced_ms"] > 0
    assert "| 3 x 8 | 13 |" in capsys.readouterr().out


def test_cancellation_accuracy_runs_and_samples_taken_apart_are_exact(tmp_path):
    """``benchmarks/cancellation_accuracy.py``: the offset model's key projection is flagged; taken apart, the release
    is as close to ``instantiate`` as float32 allows, raised, param-wise clipping loses a large part of it."""
    import cancellation_accuracy

    cancellation_accuracy.main(["--cases", "32,40", "--width", "256", "--json", str(tmp_path / "a.json")])
    rows = json.loads((tmp_path / "a.json").read_text())["rows"]
    assert len(rows) == 8 and all(r["flagged_sample_layers"] > 0 for r in rows)
    assert max(r["worst_rel_err"] for r in rows if r["flagged_norms"] == "exact") < 1e-5
    raised = [r for r in rows if r["flagged_norms"] == "raised" and r["style"] == "param-wise"]
    assert min(r["worst_rel_err"] for r in raised) > 0.1


def test_noise_threads_times_every_configuration_and_the_ops():
    """``benchmarks/noise_threads.py``: one process's rounds of each configuration, and the small operations before
    and after a worker's parallel operation. In child processes, as the script runs them: the ``before`` pool and the
    plain worker of ``--ops`` leave an OpenMP team behind that would slow every later test of this process."""
    import subprocess
    import sys

    import noise_threads

    for config in noise_threads.CONFIGS:
        out = subprocess.run([sys.executable, noise_threads.__file__, "--child", "cnn", "32", config, "--reps", "1",
                              "--warmup", "0"], check=True, capture_output=True, text=True).stdout
        times = json.loads(out.strip().splitlines()[-1])
        assert set(times) == ({"non-private"} if config == "no engine" else {"non-private", "private"})
        assert all(len(v) == 1 and v[0] > 0 for v in times.values())
    out = subprocess.run([sys.executable, noise_threads.__file__, "--ops"], check=True, capture_output=True,
                         text=True).stdout
    assert len([line for line in out.splitlines() if line.endswith(" ms")]) == 6
