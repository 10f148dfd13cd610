"""fastdp's one benchmark command: fastdp against non-private PyTorch and Opacus, and the narrower measurements, as
presets of one harness.

Usage::

    python benchmarks/run.py                                # preset cpu: every model, size and method (~45 min)
    python benchmarks/run.py --quick                        # tiny smoke run of the same (a minute or two)
    python benchmarks/run.py --models gpt2 --sizes 64 256
    python benchmarks/run.py --preset paper                 # GPT-2 small / RoBERTa-base / ViT-Base widths (a GPU)
    python benchmarks/run.py --preset engine                # every clipping mode, a plain-torch LM
    python benchmarks/run.py --preset models                # default mode and DP-BiTFiT, T 512 and 224x224 images
    python benchmarks/run.py --preset bitfit-trend          # DP-BiTFiT as T or the image size grows
    python benchmarks/run.py --preset on-arrival            # A/B of instantiation on arrival
    python benchmarks/run.py --preset probe-cost            # the structure probe's cost over whole runs
    python benchmarks/run.py --preset noise                 # secure-mode noise against normal noise
    python benchmarks/run.py --list                         # the presets, one line each
    python benchmarks/run.py --profile --models gpt2 --sizes 64 --by-function   # where the time goes
    python benchmarks/run.py --preset engine --write-docs   # measure, then regenerate every table in the docs
    python benchmarks/tables.py                             # regenerate the docs' tables from the saved JSON only

Method (workloads and methods: ``benchmarks/zoo.py``; presets: ``benchmarks/presets.py``; in-process measurements:
``benchmarks/workers.py``):

* **Time** (``steps`` presets). For each workload one fresh process builds every method's own model and optimizer,
  runs ``--warmup`` steps of each, then ``--reps`` rounds in which every method takes one step (the order rotates
  each round, so no method always runs first). We report each method's median step time and its ratio to the base
  method's median (non-private training), since absolute times on a shared machine drift; the ratio of median
  process CPU time too. On CUDA each step is bracketed by ``torch.cuda.synchronize()``.
* **Memory.** Each method runs ``--mem-steps`` steps in its own fresh process; we report peak growth during those
  steps over what was allocated before them (model and data): the peak resident set size (Linux ``VmHWM``, reset
  first) on CPU, ``torch.cuda.max_memory_allocated`` on CUDA.
* **Largest batch** (CUDA only, or ``--max-batch``): per method, doubling then bisection over the batch size, each
  probe two steps (without the structure probe), all in one fresh process per method (or, with
  ``--max-batch-probes process``, each in its own); the largest that did not run out of memory.
* ``runs`` presets time whole runs of ``--steps`` steps, each with a fresh model and engine; ``noise`` times the
  two noise generators (alternating calls in one process).
* A method that cannot run a workload (Opacus on some models) is reported as "not supported" with the reason.

Results go to ``benchmarks/results/run_<device>_<preset>.json`` and ``.csv``; ``--write-docs`` (or
``benchmarks/tables.py``) regenerates every table in the docs between ``<!-- table:NAME -->`` and ``<!-- /table -->``
from the saved JSON (never by hand).
"""

from __future__ import annotations

import argparse
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

import presets  # noqa: E402
import tables  # noqa: E402
import workers  # noqa: E402
import zoo  # noqa: E402
from results_file import cpu_model  # noqa: E402

logger = logging.getLogger("benchmarks.run")
RESULTS = ROOT / "benchmarks" / "results"


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ---------------------------------------------------------------------------------------------------- driver
def _run_worker(kind: str, w: zoo.Workload | None, methods: list[str], device: torch.device,
                args: argparse.Namespace) -> dict:
    if kind == "time":
        return workers.worker_time(w, methods, device, args.reps, args.warmup)
    if kind == "runs":
        return workers.worker_runs(w, methods, device, args.reps, args.steps)
    if kind == "memory":
        return workers.worker_memory(w, methods[0], device, args.mem_steps)
    if kind == "fits":
        return workers.worker_fits(w, methods[0], device)
    if kind == "max_batch":
        return workers.worker_max_batch(w, methods[0], device, args.elements)
    if kind == "noise":
        return workers.worker_noise(args.elements, device, args.reps, args.warmup)
    raise ValueError(f"unknown worker kind {kind!r}")


def _call_worker(args: argparse.Namespace, kind: str, w: zoo.Workload | None, methods: list[str],
                 elements: int = 0) -> dict:
    """Run one worker in a fresh process (or in this one with ``--in-process``); its JSON answer."""
    if args.in_process:
        ns = argparse.Namespace(**{**vars(args), "elements": elements})
        return _run_worker(kind, w, methods, _device(args.device), ns)
    cmd = [sys.executable, __file__, "--worker", kind, "--workload", json.dumps(asdict(w) if w else None),
           "--methods", *methods, "--device", args.device, "--threads", str(args.threads), "--reps", str(args.reps),
           "--warmup", str(args.warmup), "--mem-steps", str(args.mem_steps), "--steps", str(args.steps),
           "--elements", str(elements)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    lines = res.stdout.strip().splitlines()
    if res.returncode != 0 or not lines:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        if kind == "fits" and "OutOfMemory" in res.stderr:
            return {"fits": False}
        return {"error": f"worker exited with {res.returncode}: {' | '.join(tail)}"[:400]}
    return json.loads(lines[-1])


def max_batch(args: argparse.Namespace, w: zoo.Workload, method: str, cap: int) -> int | None:
    """Largest batch size (doubling from the workload's, then bisection; ``workers.largest_batch``) at which
    ``method`` fits: every probe in a fresh process (``--max-batch-probes process``, the faithful one: nothing left
    over from an earlier probe), or all of them in one fresh process per method (``one-process``, the default:
    a process costs imports, CUDA start-up and a model build; after an out-of-memory probe the allocator's cache is
    emptied, and what fragmentation remains can only make the result smaller)."""
    if getattr(args, "max_batch_probes", "process") == "one-process":
        r = _call_worker(args, "max_batch", w, [method], elements=cap)
        if "error" in r:
            logger.error("%s %s: the largest-batch search failed: %s", w.tag, method, r["error"])
        return r.get("max_batch")

    def fits(b: int) -> bool:
        r = _call_worker(args, "fits", zoo.Workload(w.model, w.size, b, w.widths), [method])
        return bool(r.get("fits"))

    return workers.largest_batch(fits, w.batch, cap)


def summarize(rows: dict[str, dict], base: str) -> None:
    """Add medians and ratios to the base method (in place): ``median_s``, ``time_ratio``, ``cpu_time_ratio``,
    ``memory_ratio``, ``live_ratio``, ``flop_ratio`` (matrix-product FLOPs), ``probe_median_s``, ``probe_runs``
    (the probe's runs in one whole run)."""
    b = rows.get(base, {})
    base_t = statistics.median(b["times_s"]) if b.get("times_s") else None
    base_c = statistics.median(b["cpu_times_s"]) if b.get("cpu_times_s") else None
    base_m = b.get("memory_mb")
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
        if r.get("live_mb") is not None and b.get("live_mb"):
            r["live_ratio"] = r["live_mb"] / b["live_mb"]
        if r.get("flops") is not None and b.get("flops"):
            r["flop_ratio"] = r["flops"] / b["flops"]
        probes = [p for p in r.get("probe_s", []) if p is not None]
        if probes:
            r["probe_median_s"] = statistics.median(probes)
        runs = [n for n in r.get("probes", []) if n is not None]
        if runs:
            r["probe_runs"] = statistics.median(runs)


def run_workload(args: argparse.Namespace, preset: presets.Preset, w: zoo.Workload, methods: list[str]) -> dict:
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    timed = _call_worker(args, "runs" if preset.kind == "runs" else "time", w, methods)
    if "error" in timed and len(timed) == 1:
        rows = {m: {"error": timed["error"]} for m in methods}
    else:
        rows = {m: dict(timed.get(m, {"error": "missing from the timing worker"})) for m in methods}
    load_after = os.getloadavg()[0]
    for m in methods:
        if not args.memory or "times_s" not in rows[m]:
            continue
        mem = _call_worker(args, "memory", w, [m])
        if "memory_bytes" in mem:
            rows[m]["memory_mb"] = mem["memory_bytes"] / 2**20
        if "live_bytes" in mem:
            rows[m]["live_mb"] = mem["live_bytes"] / 2**20
        elif "live_note" in mem:
            rows[m]["live_note"] = mem["live_note"]
        else:
            rows[m]["memory_note"] = mem.get("unsupported") or mem.get("error")
        if args.max_batch:
            rows[m]["max_batch"] = max_batch(args, w, m, args.max_batch_cap)
    summarize(rows, preset.base)
    logger.info("%s done in %.0f s", w.tag, time.perf_counter() - t0)
    # the 1-minute load average around the timing: above the thread count, other work shared the cores
    return {"workload": asdict(w), "tag": w.tag, "describe": w.describe(), "tokens": w.tokens,
            "load": [round(load_before, 2), round(load_after, 2)], "methods": rows}


def run_noise(args: argparse.Namespace, preset: presets.Preset, elements: int) -> dict:
    load_before = os.getloadavg()[0]
    rows = _call_worker(args, "noise", None, list(preset.methods), elements=elements)
    if "error" in rows and len(rows) == 1:
        rows = {m: {"error": rows["error"]} for m in preset.methods}
    summarize(rows, preset.base)
    return {"tag": f"noise-{elements:.0e}", "elements": elements, "describe": f"{elements:.0e} noise elements",
            "load": [round(load_before, 2), round(os.getloadavg()[0], 2)], "methods": rows}


def environment(device: torch.device, threads: int) -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "python": platform.python_version(), "device": device.type, "threads": threads,
           "cpu": platform.processor() or platform.machine(), "cpu_model": cpu_model(), "cpu_count": os.cpu_count()}
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


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu", choices=sorted(presets.PRESETS))
    p.add_argument("--list", action="store_true", help="list the presets and exit")
    p.add_argument("--models", nargs="+", default=None, choices=zoo.MODELS, help="only these of the preset's models")
    p.add_argument("--sizes", nargs="+", type=int, default=None, help="sizes replacing the preset's")
    p.add_argument("--batch", type=int, default=None, help="batch size for every workload (default: the preset's)")
    p.add_argument("--methods", nargs="+", default=None, choices=zoo.METHODS + presets.PRESETS["noise"].methods)
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    p.add_argument("--reps", type=int, default=None, help="alternating rounds (default: the preset's)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: the preset's)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (runs presets; default: the preset's)")
    p.add_argument("--mem-steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--max-batch", action="store_true", default=None,
                   help="search the largest batch per method (default: on CUDA only)")
    p.add_argument("--no-max-batch", dest="max_batch", action="store_false",
                   help="skip the largest-batch search (on by default on CUDA)")
    p.add_argument("--max-batch-cap", type=int, default=4096)
    p.add_argument("--max-batch-probes", choices=["one-process", "process"], default="one-process",
                   help="the largest-batch search: all probes of a method in one fresh process (default), or a "
                        "fresh process per probe")
    p.add_argument("--quick", action="store_true", help="tiny smoke run: tiny widths, size 16, batch 2, 1 round")
    p.add_argument("--write-docs", action="store_true", help="regenerate every table in the docs afterwards")
    p.add_argument("--from-json", type=Path, default=None, help="print (and with --write-docs use) a saved result")
    p.add_argument("--update", action="store_true",
                   help="re-measure only the chosen workloads and replace them (by tag) in the saved result")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--in-process", action="store_true", help="run the workers in this process (tests)")
    p.add_argument("--profile", action="store_true", help="profile the first workload's methods instead")
    p.add_argument("--top", type=int, default=20, help="--profile: operators and functions shown")
    p.add_argument("--by-function", action="store_true", help="--profile: also fastdp's functions (cProfile)")
    p.add_argument("--worker", choices=["time", "runs", "memory", "fits", "max_batch", "noise"],
                   help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--elements", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _apply_preset(args: argparse.Namespace, preset: presets.Preset) -> None:
    """Fill the options the command line left open from the preset (and ``--quick``)."""
    args.methods = args.methods or list(preset.methods)
    args.reps = args.reps if args.reps is not None else (1 if args.quick else preset.reps)
    args.warmup = args.warmup if args.warmup is not None else (min(1, preset.warmup) if args.quick
                                                                else preset.warmup)
    args.steps = args.steps if args.steps is not None else (3 if args.quick else preset.steps)
    args.memory = preset.memory and not args.no_memory
    args.mem_warmup = 1  # (workers.worker_memory: one unmeasured step before the peak is measured)
    if args.quick:
        args.mem_steps = 1


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    warnings.filterwarnings("ignore", message=".*Poisson.*")  # fixed batches on purpose (timing)
    torch.set_num_threads(args.threads)
    if args.worker:
        w = json.loads(args.workload)
        args.memory = False
        print(json.dumps(_run_worker(args.worker, zoo.Workload(**w) if w else None, args.methods,
                                     _device(args.device), args)))
        return
    if args.list:
        for p in presets.PRESETS.values():
            print(f"{p.name:13s} {p.kind:6s} {p.what}")
        return
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        print(tables.render(results))
        if args.write_docs:
            tables.write_docs(args.from_json.parent)
        return
    preset = presets.PRESETS[args.preset]
    device = _device(args.device)
    args.device = device.type
    if args.max_batch is None:
        args.max_batch = device.type == "cuda" and preset.kind == "steps" and preset.memory
    _apply_preset(args, preset)
    workloads = preset.make_workloads(args.models, args.sizes, args.batch, args.quick)
    if not workloads and preset.kind != "noise":
        sys.exit(f"preset {preset.name!r} has no workload for --models {args.models}; its models: "
                 f"{sorted({w[0] for w in preset.workloads})}")
    if args.profile:
        import profile_step

        for m in args.methods:
            try:
                print(profile_step.profile_method(workloads[0], m, device, args.warmup, max(1, args.reps),
                                                  args.top, args.by_function))
            except zoo.Unsupported as exc:
                print(f"== {m}: not supported ({exc})")
        return
    results = measure(args, preset, workloads, argv)
    print(tables.render(results))
    if args.write_docs:
        tables.write_docs(args.results_dir)
    errors = [(wl["tag"], m) for wl in results["workloads"] for m, r in wl["methods"].items() if "error" in r]
    if errors:
        logger.error("methods that failed (not 'not supported'): %s", errors)
        sys.exit(1)


def measure(args: argparse.Namespace, preset: presets.Preset, workloads: list[zoo.Workload],
            argv: list[str] | None) -> dict:
    """Run the preset's workloads; save (after each one, so partial results survive) and return the results."""
    command = "python benchmarks/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    env = environment(_device(args.device), args.threads)
    name = f"run_{args.device}_{preset.name}{'_quick' if args.quick else ''}"
    args.results_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.results_dir / f"{name}.json"
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k not in ("worker", "workload", "from_json", "update", "elements", "profile")}
    shown = json_path.relative_to(ROOT) if json_path.is_relative_to(ROOT) else json_path
    results = {"command": command, "json": str(shown), "preset": preset.name, "kind": preset.kind, "env": env,
               "config": config, "workloads": []}
    if args.update and json_path.exists():
        # keep the other workloads; each updated one records its own command and environment
        results = json.loads(json_path.read_text())
        results.setdefault("updates", []).append({"command": command, "env": env})
    todo = ([(n, None) for n in ((10**3, 10**4) if args.quick else args.sizes or preset.sizes)]
            if preset.kind == "noise" else [(0, w) for w in workloads])
    for elements, w in todo:
        if w is not None:
            logger.info("%s: %s", w.tag, w.describe())
        row = run_noise(args, preset, elements) if w is None else run_workload(args, preset, w, args.methods)
        if args.update:
            row["updated"] = {"command": command, "date": env["date"], "commit": env.get("commit")}
        tags = [wl["tag"] for wl in results["workloads"]]
        if row["tag"] in tags:
            results["workloads"][tags.index(row["tag"])] = row
        else:
            results["workloads"].append(row)
        json_path.write_text(json.dumps(results, indent=1, default=str))
    tables.write_csv(results, json_path.with_suffix(".csv"))
    return results


if __name__ == "__main__":
    main()
