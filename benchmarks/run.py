"""One command for fastdp's benchmark table: fastdp against non-private PyTorch and Opacus, side by side.

Usage::

    python benchmarks/run.py                       # every model and size, CPU preset (about 40 minutes, 2 cores)
    python benchmarks/run.py --quick               # tiny smoke run (a minute or two)
    python benchmarks/run.py --models gpt2 --sizes 64 256
    python benchmarks/run.py --preset paper        # GPT-2 small / RoBERTa-base / ViT-Base widths (for a GPU)
    python benchmarks/run.py --write-docs          # also regenerate docs/benchmarks.md's table and the plots
    python benchmarks/run.py --from-json benchmarks/results/run_cpu_cpu.json --write-docs   # docs from a result

Method (see ``benchmarks/zoo.py`` for the workloads and methods):

* **Time.** For each workload one fresh process builds every method's own model and optimizer, runs ``--warmup``
  steps of each, then ``--reps`` rounds in which every method takes one step (the order rotates each round, so no
  method always runs first). We report each method's median step time and its ratio to non-private training's
  median, since absolute times on a shared machine drift. On CUDA each step is bracketed by
  ``torch.cuda.synchronize()``.
* **Memory.** Each method runs ``--mem-steps`` steps in its own fresh process; we report peak growth during those
  steps over what was allocated before them (model and data): the peak resident set size (Linux ``VmHWM``, reset
  first) on CPU, ``torch.cuda.max_memory_allocated`` on CUDA.
* **Largest batch** (CUDA only, or ``--max-batch``): per method, doubling then bisection over the batch size, each
  probe two steps in a fresh process; the largest that did not run out of memory.
* A method that cannot run a workload (Opacus on some models) is reported as "not supported" with the reason.

Results go to ``benchmarks/results/run_<device>_<preset>.json`` and ``.csv``; ``--write-docs`` regenerates the
section of docs/benchmarks.md between ``<!-- run:<device>-<preset>:start/end -->`` and the plots
``docs/results/img/bench_<device>_<preset>_<model>.png`` from that JSON (never by hand).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import zoo  # noqa: E402

logger = logging.getLogger("benchmarks.run")
RESULTS = ROOT / "benchmarks" / "results"
TARGET_TIME, TARGET_MEMORY, TARGET_OPACUS, TARGET_BITFIT, TARGET_T = 1.2, 1.2, 1.4, 0.7, 256


# ---------------------------------------------------------------------------------------------------- workers
def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # Linux: "5" resets VmHWM
        f.write("5")


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status: peak RSS needs Linux")


def _failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def worker_time(w: zoo.Workload, methods: list[str], device: torch.device, reps: int, warmup: int) -> dict:
    """Alternating timing of every method in this process. Returns {method: {"times_s": [...]} or
    {"unsupported": reason} or {"error": message}}."""
    out: dict[str, dict] = {}
    steps = {}
    data = zoo.make_batch(w, device)
    for m in methods:
        try:
            steps[m] = zoo.make_step(w, m, device)
        except zoo.Unsupported as e:
            out[m] = {"unsupported": str(e)}
        except Exception as e:  # a fastdp failure is a bug: report it, keep the other rows
            out[m] = {"error": _failure(e)}
    for m in list(steps):
        try:
            for _ in range(warmup):
                steps[m](data)
        except zoo.Unsupported as e:
            out[m] = {"unsupported": str(e)}
            del steps[m]
        except Exception as e:
            out[m] = {"unsupported" if m.startswith("Opacus") else "error": _failure(e)}
            del steps[m]
    times: dict[str, list[float]] = {m: [] for m in steps}
    cpu_times: dict[str, list[float]] = {m: [] for m in steps}
    order = list(steps)
    for r in range(reps):
        for m in order[r % len(order):] + order[: r % len(order)] if order else []:
            _sync(device)
            c0, t0 = time.process_time(), time.perf_counter()
            steps[m](data)
            _sync(device)
            times[m].append(time.perf_counter() - t0)
            cpu_times[m].append(time.process_time() - c0)
    for m, ts in times.items():
        out[m] = {"times_s": ts, "cpu_times_s": cpu_times[m]}
    return out


def worker_memory(w: zoo.Workload, method: str, device: torch.device, mem_steps: int) -> dict:
    """Peak memory growth (bytes) over ``mem_steps`` steps of one method, in this (fresh) process."""
    data = zoo.make_batch(w, device)
    try:
        step = zoo.make_step(w, method, device)
    except zoo.Unsupported as e:
        return {"unsupported": str(e)}
    if device.type == "cuda":
        _sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        before = _rss_bytes()
        _reset_peak_rss()
    try:
        for _ in range(mem_steps):
            step(data)
    except Exception as e:
        return {"unsupported" if method.startswith("Opacus") else "error": _failure(e)}
    if device.type == "cuda":
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = _peak_rss_bytes()
    return {"memory_bytes": peak - before}


def worker_fits(w: zoo.Workload, method: str, device: torch.device) -> dict:
    """Whether two steps of ``method`` at this batch size run without running out of memory."""
    try:
        data = zoo.make_batch(w, device)
        step = zoo.make_step(w, method, device)
        for _ in range(2):
            step(data)
        _sync(device)
    except torch.cuda.OutOfMemoryError:  # (the same class as torch.OutOfMemoryError)
        return {"fits": False}
    except zoo.Unsupported as e:
        return {"unsupported": str(e)}
    return {"fits": True}


# ---------------------------------------------------------------------------------------------------- driver
def _call_worker(args: argparse.Namespace, kind: str, w: zoo.Workload, methods: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--workload", json.dumps(asdict(w)),
           "--methods", *methods, "--device", args.device, "--threads", str(args.threads),
           "--reps", str(args.reps), "--warmup", str(args.warmup), "--mem-steps", str(args.mem_steps)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    lines = res.stdout.strip().splitlines()
    if res.returncode != 0 or not lines:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        if kind == "fits" and "OutOfMemory" in res.stderr:
            return {"fits": False}
        return {"error": f"worker exited with {res.returncode}: {' | '.join(tail)}"[:400]}
    return json.loads(lines[-1])


def max_batch(args: argparse.Namespace, w: zoo.Workload, method: str, cap: int) -> int | None:
    """Largest batch size (doubling from the workload's, then bisection) at which ``method`` fits."""
    def fits(b: int) -> bool:
        r = _call_worker(args, "fits", zoo.Workload(w.model, w.size, b, w.preset), [method])
        return bool(r.get("fits"))

    lo, hi = 0, None
    b = w.batch
    while b <= cap:
        if fits(b):
            lo, b = b, 2 * b
        else:
            hi = b
            break
    if lo == 0:  # not even the workload's batch: bisect below it
        lo_b, hi_b = 0, w.batch
        while hi_b - lo_b > 1:
            mid = (lo_b + hi_b) // 2
            lo_b, hi_b = (mid, hi_b) if fits(mid) else (lo_b, mid)
        return lo_b or None
    if hi is None:
        return lo  # reached the cap
    while hi - lo > max(1, lo // 16):  # to within about 6 %
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def run_workload(args: argparse.Namespace, w: zoo.Workload, methods: list[str]) -> dict:
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    timed = _call_worker(args, "time", w, methods)
    rows: dict[str, dict] = {}
    if "error" in timed and len(timed) == 1:
        rows = {m: {"error": timed["error"]} for m in methods}
    else:
        rows = {m: dict(timed.get(m, {"error": "missing from the timing worker"})) for m in methods}
    for m in methods:
        if args.no_memory or "times_s" not in rows[m]:
            continue
        mem = _call_worker(args, "memory", w, [m])
        if "memory_bytes" in mem:
            rows[m]["memory_mb"] = mem["memory_bytes"] / 2**20
        else:
            rows[m]["memory_note"] = mem.get("unsupported") or mem.get("error")
        if args.max_batch:
            rows[m]["max_batch"] = max_batch(args, w, m, args.max_batch_cap)
    base = rows.get("non-private", {})
    base_t = statistics.median(base["times_s"]) if base.get("times_s") else None
    base_m = base.get("memory_mb")
    base_c = statistics.median(base["cpu_times_s"]) if base.get("cpu_times_s") else None
    for r in rows.values():
        if r.get("times_s"):
            r["median_s"] = statistics.median(r["times_s"])
            if base_t:
                r["time_ratio"] = r["median_s"] / base_t
        if r.get("cpu_times_s") and base_c:
            # process CPU time (all threads): less sensitive than wall time to other work on a shared machine
            r["cpu_time_ratio"] = statistics.median(r["cpu_times_s"]) / base_c
        if r.get("memory_mb") is not None and base_m:
            r["memory_ratio"] = r["memory_mb"] / base_m
    logger.info("%s done in %.0f s", w.tag, time.perf_counter() - t0)
    # the 1-minute load average around the timing: above the thread count, other work shared the cores
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return {"workload": asdict(w), "tag": w.tag, "describe": w.describe(), "tokens": w.tokens, "load": load,
            "methods": rows}


def environment(device: torch.device, threads: int) -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "python": platform.python_version(), "device": device.type, "threads": threads,
           "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    for pkg in ("transformers", "timm", "opacus"):
        try:
            env[pkg] = __import__(pkg).__version__
        except Exception:
            env[pkg] = None
    try:
        env["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "fastdp"],
                               capture_output=True, text=True).stdout.strip()
        env["fastdp_modified"] = bool(dirty)
    except OSError:
        env["commit"] = None
    return env


# ---------------------------------------------------------------------------------------------------- reporting
def evaluate_targets(results: dict) -> list[dict]:
    """The issue's targets, each checked per workload from the measured ratios."""
    rows = []
    for wl in results["workloads"]:
        ms, tag = wl["methods"], wl["tag"]
        default = ms.get(zoo.DEFAULT_METHOD, {})
        if wl["workload"]["model"] in ("gpt2", "roberta", "vit") and wl["tokens"] <= TARGET_T:
            for key, limit, what in (("time_ratio", TARGET_TIME, "step time"),
                                     ("memory_ratio", TARGET_MEMORY, "peak memory growth")):
                if default.get(key) is not None:
                    rows.append({"target": f"default mode {what} <= {limit}x non-private (transformers, T <= "
                                           f"{TARGET_T})", "workload": tag, "value": default[key],
                                 "met": default[key] <= limit, "shown": f"{default[key]:.2f}x"})
        for om in ("Opacus hooks", "Opacus ghost"):
            o = ms.get(om, {})
            if o.get("median_s") and default.get("median_s"):
                speedup = o["median_s"] / default["median_s"]
                rows.append({"target": f"default mode >= {TARGET_OPACUS}x faster than {om}", "workload": tag,
                             "value": speedup, "met": speedup >= TARGET_OPACUS, "shown": f"{speedup:.2f}x faster"})
        b = ms.get("DP-BiTFiT", {})
        if b.get("time_ratio") is not None:
            rows.append({"target": f"DP-BiTFiT <= {TARGET_BITFIT}x non-private full time", "workload": tag,
                         "value": b["time_ratio"], "met": b["time_ratio"] <= TARGET_BITFIT,
                         "shown": f"{b['time_ratio']:.2f}x"})
    return rows


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _short(reason: str, limit: int = 160) -> str:
    """The first sentence of a reason (the JSON and CSV keep it whole)."""
    first = reason.split(". ")[0]
    return first if len(first) <= limit else first[: limit - 3] + "..."


def render_markdown(results: dict, command: str) -> str:
    env, cfg = results["env"], results["config"]
    where = env.get("gpu") or f"{env['cpu']} CPU, {env['threads']} threads"
    lines = [f"Generated by `{command}` on {env['date']} from `{results['json']}`: {where}, torch {env['torch']}, "
             f"transformers {env.get('transformers')}, timm {env.get('timm')}, opacus {env.get('opacus')}, fastdp "
             f"commit {env.get('commit')}{' (modified)' if env.get('fastdp_modified') else ''}. Time: "
             f"{cfg['reps']} alternating rounds after {cfg['warmup']} warm-up steps, median step time and its ratio "
             f"to non-private training. Memory: peak growth over {cfg['mem_steps']} steps in a fresh process "
             f"({'allocator peak' if env['device'] == 'cuda' else 'peak RSS'}).", ""]
    targets = evaluate_targets(results)
    if targets:
        lines += ["**Targets** (checked from the ratios below):", "",
                  "| target | workload | measured | met |", "|---|---|---|---|"]
        lines += [f"| {t['target']} | {t['workload']} | {t['shown']} | {'yes' if t['met'] else '**no**'} |"
                  for t in targets]
        met = sum(t["met"] for t in targets)
        lines += ["", f"{met} of {len(targets)} checks met.", ""]
    has_max = any("max_batch" in r for wl in results["workloads"] for r in wl["methods"].values())
    for wl in results["workloads"]:
        upd = wl.get("updated")
        note = f" Re-measured by `{upd['command']}` on {upd['date']} (commit {upd['commit']})." if upd else ""
        if wl.get("load") and env["device"] == "cpu":
            note += f" Load average {wl['load'][0]:.1f} before, {wl['load'][1]:.1f} after the timing."
        lines += [f"**{wl['tag']}**: {wl['describe']}, batch {wl['workload']['batch']}.{note}", "",
                  "| method | median step (ms) | time ratio | CPU-time ratio | peak memory growth (MB) | memory ratio |"
                  + (" largest batch |" if has_max else ""),
                  "|---|---|---|---|---|---|" + ("---|" if has_max else "")]
        for m, r in wl["methods"].items():
            if "median_s" not in r:
                why = _short(r.get("unsupported") or r.get("error") or "?")
                label = "not supported" if "unsupported" in r else "**error**"
                lines.append(f"| {m} | {label}: {why.replace('|', '/')} | | | | |" + (" |" if has_max else ""))
                continue
            lines.append(f"| {m} | {1000 * r['median_s']:.1f} | {_fmt(r.get('time_ratio'), '.2f', 'x')} | "
                         f"{_fmt(r.get('cpu_time_ratio'), '.2f', 'x')} | "
                         f"{_fmt(r.get('memory_mb'), '.0f')} | {_fmt(r.get('memory_ratio'), '.2f', 'x')} |"
                         + (f" {r.get('max_batch') or '-'} |" if has_max else ""))
        lines.append("")
    return "\n".join(lines).rstrip()


def write_csv(results: dict, path: Path) -> None:
    fields = ["tag", "model", "size", "tokens", "batch", "method", "median_ms", "time_ratio", "cpu_time_ratio",
              "memory_mb",
              "memory_ratio", "max_batch", "status"]
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=fields)
        wr.writeheader()
        for wl in results["workloads"]:
            for m, r in wl["methods"].items():
                status = ("ok" if "median_s" in r else
                          f"not supported: {r['unsupported']}" if "unsupported" in r else f"error: {r.get('error')}")
                wr.writerow({"tag": wl["tag"], "model": wl["workload"]["model"], "size": wl["workload"]["size"],
                             "tokens": wl["tokens"], "batch": wl["workload"]["batch"], "method": m,
                             "median_ms": None if "median_s" not in r else round(1000 * r["median_s"], 2),
                             "time_ratio": r.get("time_ratio"), "cpu_time_ratio": r.get("cpu_time_ratio"),
                             "memory_mb": r.get("memory_mb"),
                             "memory_ratio": r.get("memory_ratio"), "max_batch": r.get("max_batch"),
                             "status": status})


def plot(results: dict, stem: str) -> list[Path]:
    """One figure per model: time and memory ratio to non-private training against the size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plots")
        return []
    paths = []
    models = sorted({wl["workload"]["model"] for wl in results["workloads"]}, key=zoo.MODELS.index)
    for model in models:
        wls = sorted([wl for wl in results["workloads"] if wl["workload"]["model"] == model],
                     key=lambda wl: wl["workload"]["size"])
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, key, title in ((axes[0], "time_ratio", "step time / non-private"),
                               (axes[1], "memory_ratio", "peak memory growth / non-private")):
            for m in zoo.METHODS:
                pts = [(wl["workload"]["size"], wl["methods"][m][key]) for wl in wls
                       if m in wl["methods"] and wl["methods"][m].get(key) is not None]
                if pts:
                    style = "-" if m.startswith(("fastdp", "DP-")) else "--" if m.startswith("Opacus") else ":"
                    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                    ax.plot(xs, ys, style, marker="o", label=m, linewidth=2.5 if m == zoo.DEFAULT_METHOD else 1.2)
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("T (tokens)" if model in zoo.TEXT_MODELS else "image side (pixels)")
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
        axes[1].legend(fontsize=7, loc="best")
        names = {"gpt2": "HF GPT-2 language model", "roberta": "HF RoBERTa classifier", "vit": "timm ViT",
                 "resnet": "timm ResNet-18 with GroupNorm"}
        fig.suptitle(f"{names[model]}: ratios to non-private training ({results['env']['device']}, preset "
                     f"{results['config']['preset']}, {results['env']['date']})")
        fig.tight_layout()
        path = ROOT / "docs" / "results" / "img" / f"{stem}_{model}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def write_docs(results: dict, command: str) -> None:
    device, preset = results["env"]["device"], results["config"]["preset"]
    stem = f"bench_{device}_{preset}"
    images = plot(results, stem)
    text = render_markdown(results, command)
    if images:
        text += "\n\n" + "\n".join(f"![{p.stem}](img/{p.name})" for p in images)
    path = ROOT / "docs" / "benchmarks.md"
    tag = f"run:{device}-{preset}"
    start, end = f"<!-- {tag}:start -->", f"<!-- {tag}:end -->"
    body = f"{start}\n{text}\n{end}"
    old = path.read_text() if path.exists() else "# Benchmarks\n\n"
    new = (old[: old.index(start)] + body + old[old.index(end) + len(end):] if start in old
           else old.rstrip() + "\n\n" + body + "\n")
    path.write_text(new)
    logger.info("wrote docs/benchmarks.md section %s and %d plots", tag, len(images))


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(zoo.MODELS), choices=zoo.MODELS)
    p.add_argument("--sizes", nargs="+", type=int, default=None,
                   help="sizes for every chosen model (default: T 64 256 1024; images 32 64 128)")
    p.add_argument("--batch", type=int, default=None, help="batch size for every workload (default: per size)")
    p.add_argument("--methods", nargs="+", default=list(zoo.METHODS), choices=zoo.METHODS)
    p.add_argument("--preset", default="cpu", choices=sorted(zoo.WIDTHS))
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--mem-steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--max-batch", action="store_true", default=None,
                   help="search the largest batch per method (default: on CUDA only)")
    p.add_argument("--max-batch-cap", type=int, default=4096)
    p.add_argument("--quick", action="store_true", help="tiny smoke run: small sizes, 1 round")
    p.add_argument("--write-docs", action="store_true")
    p.add_argument("--from-json", type=Path, default=None, help="regenerate outputs from a saved result")
    p.add_argument("--update", action="store_true",
                   help="re-measure only the chosen workloads and replace them (by tag) in the saved result")
    p.add_argument("--worker", choices=["time", "memory", "fits"], help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    warnings.filterwarnings("ignore", message=".*Poisson.*")  # fixed batches on purpose (timing)
    torch.set_num_threads(args.threads)
    if args.worker:
        w, device = zoo.Workload(**json.loads(args.workload)), _device(args.device)
        out = (worker_time(w, args.methods, device, args.reps, args.warmup) if args.worker == "time"
               else worker_memory(w, args.methods[0], device, args.mem_steps) if args.worker == "memory"
               else worker_fits(w, args.methods[0], device))
        print(json.dumps(out))
        return
    command = "python benchmarks/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        print(render_markdown(results, results["command"]))
        if args.write_docs:
            write_docs(results, results["command"])
        return
    device = _device(args.device)
    args.device = device.type
    if args.max_batch is None:
        args.max_batch = device.type == "cuda"
    if args.quick:
        args.reps, args.warmup, args.mem_steps = 1, 1, 1
    workloads = []
    for model in args.models:
        sizes = args.sizes or ([16, 32] if args.quick else zoo.DEFAULT_SIZES[model])
        for s in sizes:
            b = args.batch or (2 if args.quick else zoo.default_batch(model, s, args.preset))
            workloads.append(zoo.Workload(model, s, b, args.preset))
    env = environment(device, args.threads)
    name = f"run_{device.type}_{args.preset}{'_quick' if args.quick else ''}"
    json_path = RESULTS / f"{name}.json"
    config = {k: v for k, v in vars(args).items() if k not in ("worker", "workload", "from_json", "update")}
    results = {"command": command, "json": str(json_path.relative_to(ROOT)), "env": env, "config": config,
               "workloads": []}
    if args.update and json_path.exists():
        # keep the other workloads; each updated one records its own command and environment
        results = json.loads(json_path.read_text())
        results.setdefault("updates", []).append({"command": command, "env": env,
                                                  "tags": [w.tag for w in workloads]})
    RESULTS.mkdir(parents=True, exist_ok=True)
    for w in workloads:
        logger.info("%s: %s", w.tag, w.describe())
        row = run_workload(args, w, args.methods)
        if args.update:
            row["updated"] = {"command": command, "date": env["date"], "commit": env.get("commit")}
        tags = [wl["tag"] for wl in results["workloads"]]
        if w.tag in tags:
            results["workloads"][tags.index(w.tag)] = row
        else:
            results["workloads"].append(row)
        json_path.write_text(json.dumps(results, indent=1, default=str))  # partial results survive a crash
    write_csv(results, json_path.with_suffix(".csv"))
    print(render_markdown(results, command))
    if args.write_docs:
        write_docs(results, command)
    errors = [(wl["tag"], m) for wl in results["workloads"] for m, r in wl["methods"].items() if "error" in r]
    if errors:
        logger.error("methods that failed (not 'not supported'): %s", errors)
        sys.exit(1)


if __name__ == "__main__":
    main()
