"""Every benchmark table in the docs, regenerated from the harness's JSON (``benchmarks/results/run_*.json``).

A doc marks a generated table with ``<!-- table:STEM -->`` ... ``<!-- /table -->``, where ``STEM`` is a result
file's name without ``.json`` (``run_cpu_models``), optionally followed by ``:VIEW`` for another view of the same
result (``run_cpu_models:bitfit``). ``python benchmarks/tables.py`` (or ``run.py --write-docs``) rewrites the text
between the markers in README.md and docs/**/*.md; nothing in between is written by hand. Plots
(``docs/results/img/bench_<device>_<preset>_<model>.png``) are redrawn when matplotlib is installed.

Usage::

    python benchmarks/tables.py                    # all docs, from benchmarks/results/
    python benchmarks/tables.py --check            # exit 1 if a doc's table differs from what the JSON gives
    python benchmarks/tables.py --print run_cpu_engine
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import presets  # noqa: E402
import zoo  # noqa: E402

logger = logging.getLogger("benchmarks.tables")
RESULTS = ROOT / "benchmarks" / "results"
MARKER = re.compile(r"<!-- table:([\w.-]+)(?::([\w-]+))? -->\n.*?<!-- /table -->", re.S)
#: the performance targets (see :func:`evaluate_targets`)
TARGET_TIME, TARGET_MEMORY, TARGET_RESNET, TARGET_OPACUS, TARGET_BITFIT, TARGET_MIN_T = 1.1, 1.1, 1.4, 1.4, 1.05, 64
D = zoo.DEFAULT_METHOD


# ---------------------------------------------------------------------------------------------------- helpers
def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _short(reason: str, limit: int = 160) -> str:
    """The first sentence of a reason (the JSON and CSV keep it whole)."""
    first = reason.split(". ")[0]
    return first if len(first) <= limit else first[: limit - 3] + "..."


def _ms(r: dict, spec: str = ".1f") -> str:
    return _fmt(1000 * r["median_s"] if "median_s" in r else None, spec)


def _ratio(r: dict, key: str = "time_ratio") -> str:
    return _fmt(r.get(key), ".2f", "x")


def header(results: dict) -> str:
    """Where, when and how a result was measured (one paragraph)."""
    env, cfg = results["env"], results["config"]
    model = f" ({env['cpu_model']})" if env.get("cpu_model") else ""
    where = env.get("gpu") or (f"a shared {env.get('cpu_count')}-core {env['cpu']}{model} CPU machine (other jobs ran "
                               f"at the same time), {env['threads']} threads")
    text = (f"Generated from `{results['json']}`, measured by `{results['command']}` on {env['date']}: {where}, "
            f"torch {env['torch']}, transformers {env.get('transformers')}, timm {env.get('timm')}, opacus "
            f"{env.get('opacus')}, fastdp commit {env.get('commit')}"
            f"{' (modified)' if env.get('fastdp_modified') else ''}.")
    kind = results.get("kind", "steps")
    if kind == "steps":
        text += (f" Time: {cfg['reps']} alternating rounds after {cfg['warmup']} warm-up steps, median step time "
                 "and its ratio to non-private training in the same process.")
        if any("flops" in r for wl in results["workloads"] for r in wl["methods"].values()):
            text += (" FLOPs: the matrix products (matmuls, convolutions, attention; 2 per multiply-add) one more "
                     "step executes, counted by torch.utils.flop_counter from the shapes each operator ran at: the "
                     "arithmetic a method adds or saves, not its element-wise work (norm reductions, scaling, "
                     "noise).")
        if any("memory_mb" in r for wl in results["workloads"] for r in wl["methods"].values()):
            warm = (f" after {cfg['mem_warmup']} unmeasured step" if cfg.get("mem_warmup") else
                    " from the first step (before the structure probe existed)")
            where_mem = ("in the timing process, one method after another (--in-process)" if cfg.get("in_process")
                         else "in a fresh process per method")
            text += (f" Memory: peak growth over {cfg['mem_steps']} steps{warm}, {where_mem} "
                     f"({'allocator peak' if env['device'] == 'cuda' else 'peak RSS'}).")
            if any("live_mb" in r for wl in results["workloads"] for r in wl["methods"].values()):
                text += (" Live tensors: peak growth of the bytes held by tensors over one more step, from the "
                         "allocations and frees torch's profiler records (the CPU analogue of CUDA's allocator "
                         "peak; the peak RSS also counts memory glibc's malloc keeps after tensors free it).")
    elif kind == "runs":
        text += (f" {cfg['reps']} alternating rounds of whole {cfg['steps']}-step runs, each with a freshly built "
                 "model and engine; medians.")
        if any(r.get("probe_runs") is not None for wl in results["workloads"] for r in wl["methods"].values()):
            text += " Batches of B and B - 1 samples in turn, as batch sizes change under Poisson sampling."
    else:
        text += f" Median of {cfg['reps']} alternating calls after {cfg['warmup']} warm-up call(s)."
    if any(u for u in results.get("updates", [])):
        text += " Some workloads were re-measured later (`--update`): their own line says so."
    return text


def _load_note(results: dict, wl: dict) -> str:
    upd = wl.get("updated")
    note = f" Re-measured by `{upd['command']}` on {upd['date']} (commit {upd['commit']})." if upd else ""
    if wl.get("load") and results["env"]["device"] == "cpu":
        note += f" Load average {wl['load'][0]:.1f} before, {wl['load'][1]:.1f} after the timing."
    return note


# ---------------------------------------------------------------------------------------------------- views
def evaluate_targets(results: dict) -> list[dict]:
    """The performance targets, each checked per workload from the measured ratios:

    * default mode step time and peak memory growth <= ``TARGET_TIME`` / ``TARGET_MEMORY`` x non-private on the
      transformers (GPT-2, RoBERTa and the plain-torch classifier at T >= ``TARGET_MIN_T``; the ViT at every size),
      and <= ``TARGET_RESNET`` x on the ResNet-GroupNorm;
    * DP-BiTFiT time and memory <= ``TARGET_BITFIT`` x non-private BiTFiT;
    * the default mode >= ``TARGET_OPACUS`` x faster than each Opacus mode where Opacus runs.
    """
    rows = []

    def check(target: str, tag: str, value: float, limit: float) -> None:
        rows.append({"target": target, "workload": tag, "value": value, "met": value <= limit,
                     "shown": f"{value:.2f}x"})

    for wl in results["workloads"]:
        ms, tag, model = wl["methods"], wl["tag"], wl["workload"]["model"]
        default = ms.get(D, {})
        transformer = model == "vit" or (model in ("gpt2", "roberta", "tinycls") and wl["tokens"] >= TARGET_MIN_T)
        limits = ((TARGET_TIME, TARGET_MEMORY, f"transformers, T >= {TARGET_MIN_T}") if transformer else
                  (TARGET_RESNET, TARGET_RESNET, "ResNet-GroupNorm") if model == "resnet" else None)
        if limits is not None:
            for key, limit, what in (("time_ratio", limits[0], "step time"),
                                     ("memory_ratio", limits[1], "peak memory growth"),
                                     ("live_ratio", limits[1], "peak live-tensor growth")):
                if default.get(key) is not None:
                    check(f"default mode {what} <= {limit}x non-private ({limits[2]})", tag, default[key], limit)
        for om in ("Opacus hooks", "Opacus ghost"):
            o = ms.get(om, {})
            if o.get("median_s") and default.get("median_s"):
                speedup = o["median_s"] / default["median_s"]
                rows.append({"target": f"default mode >= {TARGET_OPACUS}x faster than {om}", "workload": tag,
                             "value": speedup, "met": speedup >= TARGET_OPACUS, "shown": f"{speedup:.2f}x faster"})
        b, nb = ms.get("DP-BiTFiT", {}), ms.get("non-private BiTFiT", {})
        for key, what in (("median_s", "time"), ("memory_mb", "memory"), ("live_mb", "live-tensor memory")):
            if b.get(key) and nb.get(key):
                check(f"DP-BiTFiT {what} <= {TARGET_BITFIT}x non-private BiTFiT", tag, b[key] / nb[key],
                      TARGET_BITFIT)
    return rows


def render_steps(results: dict, targets: bool = False) -> str:
    """Per workload, one row per method: median step, time ratio, CPU-time ratio, memory (when measured)."""
    lines = [header(results), ""]
    if targets and (checks := evaluate_targets(results)):
        lines += ["**Targets** (checked from the ratios below):", "",
                  "| target | workload | measured | met |", "|---|---|---|---|"]
        lines += [f"| {t['target']} | {t['workload']} | {t['shown']} | {'yes' if t['met'] else '**no**'} |"
                  for t in checks]
        lines += ["", f"{sum(t['met'] for t in checks)} of {len(checks)} checks met.", ""]
    rows_all = [r for wl in results["workloads"] for r in wl["methods"].values()]
    has_mem = any("memory_mb" in r for r in rows_all)
    has_live = any("live_mb" in r for r in rows_all)
    has_max = any("max_batch" in r for r in rows_all)
    has_flops = any("flop_ratio" in r for r in rows_all)
    cols = ["method", "median step (ms)", "time ratio", "CPU-time ratio"]
    cols += ["matrix-product FLOPs (G)", "FLOP ratio"] if has_flops else []
    cols += ["peak memory growth (MB)", "memory ratio"] if has_mem else []
    cols += ["peak live-tensor growth (MB)", "live ratio"] if has_live else []
    cols += ["largest batch"] if has_max else []
    for wl in results["workloads"]:
        lines += [f"**{wl['tag']}**: {wl['describe']}, batch {wl['workload']['batch']}.{_load_note(results, wl)}",
                  "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for m, r in wl["methods"].items():
            if "median_s" not in r:
                why = _short(r.get("unsupported") or r.get("error") or "?").replace("|", "/")
                label = "not supported" if "unsupported" in r else "**error**"
                lines.append(f"| {m} | {label}: {why} |" + " |" * (len(cols) - 2))
                continue
            cells = [m, _ms(r), _ratio(r), _ratio(r, "cpu_time_ratio")]
            if has_flops:
                cells += [_fmt(r["flops"] / 1e9 if r.get("flops") else None, ".1f"), _ratio(r, "flop_ratio")]
            if has_mem:
                cells += [_fmt(r.get("memory_mb"), ".0f"), _ratio(r, "memory_ratio")]
            if has_live:
                cells += [_fmt(r.get("live_mb"), ".0f"), _ratio(r, "live_ratio")]
            if has_max:
                cells += [str(r.get("max_batch") or "-")]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip()


def _speedup(other: dict, default: dict) -> str:
    if "unsupported" in other:
        return "Opacus fails"
    ok = other.get("median_s") and default.get("median_s")
    return _fmt(other["median_s"] / default["median_s"] if ok else None, ".2f", "x")


def render_summary(results: dict) -> str:
    """One row per workload: the default mode's time and memory ratio, DP-BiTFiT against non-private full and
    BiTFiT training, and the default mode's speed-up over Opacus (columns only where the run measured Opacus)."""
    opacus = [om for om in ("Opacus hooks", "Opacus ghost")
              if any(om in wl["methods"] for wl in results["workloads"])]
    live = any("live_mb" in r for wl in results["workloads"] for r in wl["methods"].values())
    head = ["workload", "default mode time / non-private", "memory / non-private",
            *(["live-tensor memory / non-private"] if live else []),
            *(f"speed-up over {om}" for om in opacus), "DP-BiTFiT time / non-private",
            "DP-BiTFiT time / non-private BiTFiT"]
    lines = [f"From `{results['json']}` ({results['env']['date']}, {results['env'].get('gpu') or 'CPU'}; full "
             "tables in docs/results/benchmarks.md).", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for wl in results["workloads"]:
        ms = wl["methods"]
        d, b, nb = ms.get(D, {}), ms.get("DP-BiTFiT", {}), ms.get("non-private BiTFiT", {})
        over = [_speedup(ms.get(om, {}), d) for om in opacus]
        vs_bitfit = b["median_s"] / nb["median_s"] if b.get("median_s") and nb.get("median_s") else None
        cells = [wl["tag"], _ratio(d), _ratio(d, "memory_ratio"), *([_ratio(d, "live_ratio")] if live else []),
                 *over, _ratio(b), _fmt(vs_bitfit, ".2f", "x")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_bitfit(results: dict) -> str:
    """DP-BiTFiT against non-private BiTFiT and non-private full fine-tuning, per workload."""
    lines = [f"From `{results['json']}` ({results['env']['date']}; full tables in docs/results/benchmarks.md).", "",
             "| workload | DP-BiTFiT time / non-private BiTFiT | DP-BiTFiT time / non-private full | DP-BiTFiT "
             "memory / non-private BiTFiT | non-private BiTFiT time / non-private full |", "|---|---|---|---|---|"]
    for wl in results["workloads"]:
        ms = wl["methods"]
        b, nb = ms.get("DP-BiTFiT", {}), ms.get("non-private BiTFiT", {})
        t = b["median_s"] / nb["median_s"] if b.get("median_s") and nb.get("median_s") else None
        m = b["memory_mb"] / nb["memory_mb"] if b.get("memory_mb") and nb.get("memory_mb") else None
        lines.append(f"| {wl['describe']}, B {wl['workload']['batch']} | {_fmt(t, '.2f', 'x')} | {_ratio(b)} | "
                     f"{_fmt(m, '.2f', 'x')} | {_ratio(nb)} |")
    return "\n".join(lines)


def render_trend(results: dict) -> str:
    """Per model, one row per size: non-private full, DP full and DP-BiTFiT step times and two ratios."""
    lines = [header(results), ""]
    for model in dict.fromkeys(wl["workload"]["model"] for wl in results["workloads"]):
        wls = [wl for wl in results["workloads"] if wl["workload"]["model"] == model]
        what = "T" if model in zoo.TEXT_MODELS else "image side"
        lines += [f"**{model}**: {wls[0]['describe'].rsplit(',', 1)[0]}, batch {wls[0]['workload']['batch']}.", "",
                  f"| {what} | non-private full (ms) | DP full (ms) | DP-BiTFiT (ms) | DP-BiTFiT / DP full | "
                  "DP-BiTFiT / non-private full |", "|---|---|---|---|---|---|"]
        for wl in wls:
            ms = wl["methods"]
            n, f, b = ms.get("non-private", {}), ms.get(D, {}), ms.get("DP-BiTFiT", {})
            over_f = b["median_s"] / f["median_s"] if b.get("median_s") and f.get("median_s") else None
            lines.append(f"| {wl['workload']['size']} | {_ms(n)} | {_ms(f)} | {_ms(b)} | {_fmt(over_f, '.2f', 'x')} "
                         f"| {_ratio(b)} |")
        lines.append("")
    return "\n".join(lines).rstrip()


def render_on_arrival(results: dict) -> str:
    off = f"{D}, on arrival off"
    lines = [header(results), "",
             "| workload | non-private (ms) | default mode, on arrival / non-private | on arrival off / non-private | "
             "on / off |", "|---|---|---|---|---|"]
    for wl in results["workloads"]:
        ms = wl["methods"]
        on, of = ms.get(D, {}), ms.get(off, {})
        r = on["median_s"] / of["median_s"] if on.get("median_s") and of.get("median_s") else None
        lines.append(f"| {wl['tag']} | {_ms(ms.get('non-private', {}))} | {_ratio(on)} | {_ratio(of)} | "
                     f"{_fmt(r, '.2f', 'x')} |")
    return "\n".join(lines)


def render_probe(results: dict) -> str:
    off = f"{D}, no probe"
    lines = [header(results), "",
             "| workload | run with the probe (s) | without (s) | ratio | the probe itself (s) | probe runs | "
             "probe / run without |",
             "|---|---|---|---|---|---|---|"]
    for wl in results["workloads"]:
        on, of = wl["methods"].get(D, {}), wl["methods"].get(off, {})
        p, t = on.get("probe_median_s"), of.get("median_s")
        share = _fmt(100 * p / t if p is not None and t else None, ".2f", " %")
        lines.append(f"| {wl['describe']}, B {wl['workload']['batch']} | {_fmt(on.get('median_s'), '.2f')} | "
                     f"{_fmt(t, '.2f')} | {_ratio(on, 'time_ratio')} | {_fmt(p, '.3f')} | "
                     f"{_fmt(on.get('probe_runs'), '.0f')} | {share} |")
    return "\n".join(lines)


def render_noise(results: dict) -> str:
    lines = [header(results), "",
             "| noise elements | `gaussian_noise` (ms) | `secure_gaussian` (ms) | ratio |", "|---|---|---|---|"]
    for wl in results["workloads"]:
        n, s = wl["methods"].get("gaussian_noise", {}), wl["methods"].get("secure_gaussian", {})
        lines.append(f"| {wl['elements']:.0e} | {_ms(n, '.2f')} | {_ms(s, '.2f')} | "
                     f"{_fmt(s.get('time_ratio'), '.1f', 'x')} |")
    return "\n".join(lines)


def render_flops(results: dict) -> str:
    """Per workload, the arithmetic against the time: the default mode's matrix-product FLOPs and step time as
    ratios to non-private training, and DP-BiTFiT's to non-private BiTFiT. A time ratio above the FLOP ratio is
    work other than the products (per-sample norms' reductions, scaling, noise, copies, hooks) or products run at a
    lower rate (many small per-sample ones instead of one large one)."""
    lines = [f"From `{results['json']}` ({results['env']['date']}, {results['env'].get('gpu') or 'CPU'}).", "",
             "| workload | default mode FLOPs / non-private | default mode time / non-private | time less FLOPs | "
             "DP-BiTFiT FLOPs / non-private BiTFiT | DP-BiTFiT time / non-private BiTFiT |",
             "|---|---|---|---|---|---|"]
    for wl in results["workloads"]:
        ms = wl["methods"]
        d, b, nb = ms.get(D, {}), ms.get("DP-BiTFiT", {}), ms.get("non-private BiTFiT", {})
        gap = d["time_ratio"] - d["flop_ratio"] if d.get("time_ratio") and d.get("flop_ratio") else None
        bf = b["flops"] / nb["flops"] if b.get("flops") and nb.get("flops") else None
        bt = b["median_s"] / nb["median_s"] if b.get("median_s") and nb.get("median_s") else None
        lines.append(f"| {wl['tag']} | {_fmt(d.get('flop_ratio'), '.3f', 'x')} | {_ratio(d)} | "
                     f"{_fmt(gap, '+.2f')} | {_fmt(bf, '.3f', 'x')} | {_fmt(bt, '.2f', 'x')} |")
    return "\n".join(lines)


def render(results: dict, view: str | None = None) -> str:
    """The markdown of one result: its preset's default view, or ``view``."""
    views: dict[str, Callable[[dict], str]] = {"summary": render_summary, "bitfit": render_bitfit,
                                               "steps": render_steps, "flops": render_flops}
    if view is not None:
        if view not in views:
            raise ValueError(f"unknown table view {view!r}; choose from {sorted(views)}")
        return views[view](results)
    kind = results.get("kind", "steps")
    if kind == "distributed":
        from dist_bench import table

        return table(results)
    preset = results.get("preset") or results["config"].get("preset")
    if kind == "noise":
        return render_noise(results)
    if kind == "runs":
        return render_probe(results)
    if preset == "bitfit-trend":
        return render_trend(results)
    if preset == "on-arrival":
        return render_on_arrival(results)
    return render_steps(results, targets=presets.PRESETS[preset].targets if preset in presets.PRESETS else False)


# ---------------------------------------------------------------------------------------------------- files
def write_csv(results: dict, path: Path) -> None:
    """One row per workload and method."""
    fields = ["tag", "model", "size", "tokens", "batch", "elements", "method", "median_ms", "time_ratio",
              "cpu_time_ratio", "memory_mb", "memory_ratio", "live_mb", "live_ratio", "flops", "flop_ratio",
              "max_batch", "probe_median_s", "status"]
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=fields)
        wr.writeheader()
        for wl in results["workloads"]:
            w = wl.get("workload", {})
            for m, r in wl["methods"].items():
                status = ("ok" if "median_s" in r else
                          f"not supported: {r['unsupported']}" if "unsupported" in r else f"error: {r.get('error')}")
                wr.writerow({"tag": wl["tag"], "model": w.get("model"), "size": w.get("size"),
                             "tokens": wl.get("tokens"), "batch": w.get("batch"), "elements": wl.get("elements"),
                             "method": m, "median_ms": None if "median_s" not in r else round(1000 * r["median_s"], 3),
                             "time_ratio": r.get("time_ratio"), "cpu_time_ratio": r.get("cpu_time_ratio"),
                             "memory_mb": r.get("memory_mb"), "memory_ratio": r.get("memory_ratio"),
                             "live_mb": r.get("live_mb"), "live_ratio": r.get("live_ratio"),
                             "flops": r.get("flops"), "flop_ratio": r.get("flop_ratio"),
                             "max_batch": r.get("max_batch"), "probe_median_s": r.get("probe_median_s"),
                             "status": status})


def plot(results: dict, img_dir: Path) -> list[Path]:
    """Ratios to the base method against the size, one figure per model (needs matplotlib; else none)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: plots not redrawn")
        return []
    if results.get("kind", "steps") != "steps":
        return []
    paths = []
    preset = results.get("preset") or results["config"]["preset"]
    for model in dict.fromkeys(wl["workload"]["model"] for wl in results["workloads"]):
        wls = sorted([wl for wl in results["workloads"] if wl["workload"]["model"] == model],
                     key=lambda wl: wl["workload"]["size"])
        if len(wls) < 2:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, key, title in ((axes[0], "time_ratio", "step time / non-private"),
                               (axes[1], "memory_ratio", "peak memory growth / non-private")):
            for m in dict.fromkeys(m for wl in wls for m in wl["methods"]):
                pts = [(wl["workload"]["size"], wl["methods"][m][key]) for wl in wls
                       if m in wl["methods"] and wl["methods"][m].get(key) is not None]
                if pts:
                    style = "-" if m.startswith(("fastdp", "DP-")) else "--" if m.startswith("Opacus") else ":"
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=m,
                            linewidth=2.5 if m == D else 1.2)
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("T (tokens)" if model in zoo.TEXT_MODELS else "image side (pixels)")
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7, loc="best")
        fig.suptitle(f"{model}: ratios to non-private training ({results['env']['device']}, preset {preset}, "
                     f"{results['env']['date']})")
        fig.tight_layout()
        path = img_dir / f"bench_{results['env']['device']}_{preset}_{model}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        logger.warning("matplotlib is not installed: plots not redrawn")
        return False
    return True


def _images(results: dict, img_dir: Path, doc: Path) -> str:
    if results.get("kind") == "distributed":
        return ""
    preset = results.get("preset") or results["config"].get("preset")
    found = sorted(img_dir.glob(f"bench_{results['env']['device']}_{preset}_*.png"))
    return "\n".join(f"![{p.stem}]({os.path.relpath(p, doc.parent)})" for p in found)


def doc_files(root: Path) -> list[Path]:
    return [p for p in [root / "README.md", *sorted((root / "docs").rglob("*.md"))] if p.exists()]


def regenerate(text: str, doc: Path, results_dir: Path, img_dir: Path) -> tuple[str, list[str]]:
    """``text`` with every marked table rewritten from ``results_dir``; and the tables' names."""
    names: list[str] = []

    def sub(m: re.Match) -> str:
        stem, view = m.group(1), m.group(2)
        names.append(stem + (f":{view}" if view else ""))
        path = results_dir / f"{stem}.json"
        if not path.exists():
            raise FileNotFoundError(f"{doc}: table {stem!r} needs {path}, which does not exist; run the preset "
                                    f"that writes it (python benchmarks/run.py --preset ...)")
        results = json.loads(path.read_text())
        body = render(results, view)
        if view is None and (imgs := _images(results, img_dir, doc)):
            body += "\n\n" + imgs
        return f"<!-- table:{stem}{':' + view if view else ''} -->\n{body}\n<!-- /table -->"

    return MARKER.sub(sub, text), names


def write_docs(results_dir: Path = RESULTS, root: Path = ROOT, check: bool = False) -> list[tuple[Path, str]]:
    """Rewrite every marked table under ``root`` (README.md, docs/); with ``check``, write nothing and return
    only the tables that differ."""
    img_dir = root / "docs" / "results" / "img"
    if not check and _has_matplotlib():
        for path in sorted(results_dir.glob("run_*.json")):
            if "_quick" not in path.stem:
                plot(json.loads(path.read_text()), img_dir)
    changed = []
    for doc in doc_files(root):
        old = doc.read_text()
        new, names = regenerate(old, doc, results_dir, img_dir)
        if new != old:
            changed += [(doc, n) for n in names]
            if not check:
                doc.write_text(new)
                logger.info("%s: rewrote %s", doc.relative_to(root), ", ".join(names))
    return changed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--check", action="store_true", help="exit 1 if a doc's table is not what the JSON gives")
    p.add_argument("--print", dest="show", default=None, help="print one result's table (STEM or STEM:VIEW)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.show:
        stem, _, view = args.show.partition(":")
        print(render(json.loads((args.results_dir / f"{stem}.json").read_text()), view or None))
        return
    changed = write_docs(args.results_dir, check=args.check)
    if args.check and changed:
        logger.error("tables out of date: %s", ", ".join(f"{d.name}:{n}" for d, n in changed))
        sys.exit(1)


if __name__ == "__main__":
    main()
