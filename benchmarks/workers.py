"""What the benchmark harness measures inside one process (``benchmarks/run.py`` starts them, one fresh process
per workload for timings and per method for memory).

* ``worker_time``: every method takes one step per round, in an order that rotates each round, after warm-up steps;
  wall and process CPU time per step; then one more step each under ``torch.utils.flop_counter`` for the
  matrix-product FLOPs it executes (``matmul_flops``).
* ``worker_runs``: every method does whole runs of ``steps`` steps with a freshly built model and engine, rounds
  alternating; one-off costs of the first steps (the structure probe) are inside the timing.
* ``worker_memory``: peak memory growth over a few steps of one method after one unmeasured step (peak RSS on
  CPU, allocator peak on CUDA).
* ``worker_fits``: whether two steps at a batch size run without running out of memory;
  ``worker_max_batch``: the whole largest-batch search in this one process.
* ``worker_noise``: ``gaussian_noise`` against ``secure_gaussian``, alternating calls.

Each returns a JSON-able dict: per method ``{"times_s": [...]}``, ``{"unsupported": reason}`` or
``{"error": message}``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import time
from collections.abc import Callable

import torch
import zoo


def sync(device: torch.device) -> None:
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


def failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _rotations(order: list[str], rounds: int):
    for r in range(rounds):
        yield order[r % len(order):] + order[: r % len(order)] if order else []


def worker_time(w: zoo.Workload, methods: list[str], device: torch.device, reps: int, warmup: int) -> dict:
    """Alternating timing of every method in this process. Returns {method: {"times_s": [...], "cpu_times_s":
    [...]} or {"unsupported": reason} or {"error": message}}."""
    out: dict[str, dict] = {}
    steps = {}
    data = zoo.make_batch(w, device)
    for m in methods:
        try:
            steps[m] = zoo.make_step(w, m, device)
        except zoo.Unsupported as e:
            out[m] = {"unsupported": str(e)}
        except Exception as e:  # a fastdp failure is a bug: report it, keep the other rows
            out[m] = {"error": failure(e)}
    for m in list(steps):
        try:
            for _ in range(warmup):
                steps[m](data)
        except zoo.Unsupported as e:
            out[m] = {"unsupported": str(e)}
            del steps[m]
        except Exception as e:
            out[m] = {"unsupported" if m.startswith("Opacus") else "error": failure(e)}
            del steps[m]
    times: dict[str, list[float]] = {m: [] for m in steps}
    cpu_times: dict[str, list[float]] = {m: [] for m in steps}
    for order in _rotations(list(steps), reps):
        for m in order:
            sync(device)
            c0, t0 = time.process_time(), time.perf_counter()
            steps[m](data)
            sync(device)
            times[m].append(time.perf_counter() - t0)
            cpu_times[m].append(time.process_time() - c0)
    for m, ts in times.items():
        out[m] = {"times_s": ts, "cpu_times_s": cpu_times[m]}
        try:  # after the timing rounds: the counter's own cost is in no timed step
            out[m]["flops"] = matmul_flops(steps[m], data)
        except Exception as e:  # noqa: BLE001 - an optional second measurement: say why it is missing
            out[m]["flops_note"] = failure(e)
    return out


def _flop_formulas() -> dict:
    """Formulas that replace or extend torch's counter (``torch.utils.flop_counter``):

    * the CPU kernels of ``F.scaled_dot_product_attention``, which it lacks (it counts the CUDA kernels): the
      formulas of their CUDA counterparts, so attention is counted on both devices;
    * ``convolution_backward``: its weight-gradient term ignores ``groups`` (it counts a convolution of ``g``
      groups as ``g`` times its work: 64 times for the grouped convolution that forms per-sample gradients of a
      batch of 64, :meth:`fastdp.layers.kinds.conv.ConvCall.grouped_weight_grads`). Each gradient asked for is one
      forward convolution's work, which its forward formula counts correctly.
    """
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten

    def conv_backward(grad_out, x, w, _bias, _stride, _padding, _dilation, transposed, _out_pad, _groups, mask,
                      out_shape=None, **kw) -> int:
        return fc.conv_flop_count(x, w, grad_out, transposed) * (int(mask[0]) + int(mask[1]))

    out = {aten.convolution_backward: conv_backward}
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None:
        out[fwd] = lambda q, k, v, *args, out_shape=None, **kw: fc.sdpa_flop_count(q, k, v)
    if bwd is not None:
        out[bwd] = lambda g, q, k, v, *args, out_shape=None, **kw: fc.sdpa_backward_flop_count(g, q, k, v)
    return out


def matmul_flops(step: Callable[[tuple[torch.Tensor, torch.Tensor]], None],
                 data: tuple[torch.Tensor, torch.Tensor]) -> int:
    """The floating-point operations of the matrix products one step executes (``mm``, ``addmm``, ``bmm``,
    ``baddbmm``, convolutions and attention, forward and backward, counted by ``torch.utils.flop_counter`` from
    the shapes each operator ran at; 2 per multiply-add). The arithmetic a method adds or saves: fastdp's Gram
    products and per-sample gradients count, its element-wise work (norm reductions, scaling, noise) does not.
    One extra step of the method."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=_flop_formulas()) as counter:
        step(data)
    return int(counter.get_total_flops())


def worker_runs(w: zoo.Workload, methods: list[str], device: torch.device, reps: int, steps: int) -> dict:
    """``reps`` alternating rounds; in each, every method builds its model and engine afresh and runs ``steps``
    steps, on batches of ``B`` and ``B - 1`` samples in turn (batch sizes change from step to step under Poisson
    sampling, and the structure probe verifies each input signature at two of them). Returns {method: {"times_s":
    [run seconds], "probe_s": [engine.probe_stats["seconds"] per run], "probes": [engine.probe_stats["probes"] per
    run]}}."""
    out: dict[str, dict] = {m: {"times_s": [], "probe_s": [], "probes": []} for m in methods}
    full = zoo.make_batch(w, device)
    batches = [full, tuple(t[:-1] for t in full)] if w.batch > 2 else [full]
    for order in _rotations(list(methods), reps):
        for m in order:
            if "error" in out[m]:
                continue
            try:
                step = zoo.make_step(w, m, device)
                sync(device)
                t0 = time.perf_counter()
                for k in range(steps):
                    step(batches[k % len(batches)])
                sync(device)
                out[m]["times_s"].append(time.perf_counter() - t0)
                engine = getattr(step, "engine", None)
                out[m]["probe_s"].append(engine.probe_stats["seconds"] if engine is not None else None)
                out[m]["probes"].append(engine.probe_stats["probes"] if engine is not None else None)
            except Exception as e:
                out[m] = {"error": failure(e)}
    return out


def _release_free_heap() -> None:
    """Hand memory that the C allocator holds but no tensor uses back to the OS (glibc ``malloc_trim``), so the
    resident size measures live memory; a no-op where it is unavailable."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def worker_memory(w: zoo.Workload, method: str, device: torch.device, mem_steps: int) -> dict:
    """Peak memory growth (bytes) over ``mem_steps`` steps of one method, in this (fresh) process, after one
    unmeasured step: the steady state, without one-off costs of the first step (fastdp's structure probe, which the
    probe-cost preset measures; lazily built state)."""
    data = zoo.make_batch(w, device)
    try:
        step = zoo.make_step(w, method, device)
        step(data)
    except zoo.Unsupported as e:
        return {"unsupported": str(e)}
    except Exception as e:
        return {"unsupported" if method.startswith("Opacus") else "error": failure(e)}
    gc.collect()
    if device.type == "cuda":
        sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _release_free_heap()
        before = _rss_bytes()
        _reset_peak_rss()
    try:
        for _ in range(mem_steps):
            step(data)
    except Exception as e:
        return {"unsupported" if method.startswith("Opacus") else "error": failure(e)}
    if device.type == "cuda":
        sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        return {"memory_bytes": peak - before}
    out = {"memory_bytes": _peak_rss_bytes() - before}
    try:
        out["live_bytes"] = _live_peak_bytes(step, data)
    except Exception as e:  # noqa: BLE001 - an optional second measurement: say why it is missing
        out["live_note"] = failure(e)
    return out


def _live_peak_bytes(step: Callable[[tuple[torch.Tensor, torch.Tensor]], None],
                     data: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Peak growth of the bytes held by tensors over one more step on CPU: the running sum of the allocations (+)
    and frees (-) that ``torch.profiler`` records with ``profile_memory``, from the step's start. The CPU analogue
    of ``torch.cuda.max_memory_allocated``: unlike the peak RSS it does not count memory that the C allocator
    (glibc malloc) keeps after tensors free it. The profiler records the calling thread only, so fastdp's noise
    (drawn on worker threads, ``fastdp.noise.NOISE_THREADS``) is drawn on this thread for this step: the same
    tensors, one at a time."""
    from torch._C._profiler import _EventType  # private, as the profiler's own memory tools use it
    from torch.profiler import ProfilerActivity, profile

    import fastdp.noise as noise

    threads, noise.NOISE_THREADS = noise.NOISE_THREADS, 1
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step(data)
    finally:
        noise.NOISE_THREADS = threads
    events: list[tuple[int, int]] = []

    def walk(node) -> None:
        if node.typed[0] == _EventType.Allocation:
            events.append((node.start_time_ns, node.typed[1].alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    if not events:
        raise RuntimeError("the profiler recorded no allocation")
    held = peak = 0
    for _, size in sorted(events):
        held += size
        peak = max(peak, held)
    return peak


def worker_fits(w: zoo.Workload, method: str, device: torch.device) -> dict:
    """Whether two steps of ``method`` at this batch size run without running out of memory."""
    try:
        data = zoo.make_batch(w, device)
        step = zoo.make_step(w, method, device)
        for _ in range(2):
            step(data)
        sync(device)
    except torch.cuda.OutOfMemoryError:  # (the same class as torch.OutOfMemoryError)
        return {"fits": False}
    except zoo.Unsupported as e:
        return {"unsupported": str(e)}
    return {"fits": True}


def largest_batch(fits: Callable[[int], bool], start: int, cap: int) -> int | None:
    """The largest batch size ``<= cap`` for which ``fits`` holds, assuming it holds up to some size and not
    beyond: doubling from ``start``, then bisection to within about 6 % (``None`` if not even 1 fits)."""
    lo, hi = 0, None
    b = start
    while b <= cap:
        if fits(b):
            lo, b = b, 2 * b
        else:
            hi = b
            break
    if lo == 0:  # not even the start: bisect below it
        lo_b, hi_b = 0, start
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


def worker_max_batch(w: zoo.Workload, method: str, device: torch.device, cap: int) -> dict:
    """``largest_batch`` for ``method`` with every probe in this process: each probe builds the model and engine
    (structure probe off: a one-off of the first step, not the steady state), runs two steps, and is then dropped
    with its data, the engine detached, and the allocator's cache emptied."""
    def fits(b: int) -> bool:
        wb = zoo.Workload(w.model, w.size, b, w.widths)
        step = None
        try:
            data = zoo.make_batch(wb, device)
            step = zoo.make_step(wb, method, device, verify_structure=False)
            for _ in range(2):
                step(data)
            sync(device)
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            if step is not None and getattr(step, "engine", None) is not None:
                step.engine.detach()
            step = data = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    try:
        return {"max_batch": largest_batch(fits, w.batch, cap)}
    except zoo.Unsupported as e:
        return {"unsupported": str(e)}


def worker_noise(elements: int, device: torch.device, reps: int, warmup: int) -> dict:
    """``gaussian_noise`` (one float32 draw from a torch generator, the engine's normal path) against
    ``secure_gaussian`` (four float64 draws from freshly CSPRNG-seeded generators, summed and halved) for a tensor
    of ``elements`` elements, alternating calls."""
    from fastdp.noise import gaussian_noise, secure_gaussian

    param = torch.empty(elements, dtype=torch.float32, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    fns: dict[str, Callable[[], object]] = {
        "gaussian_noise": lambda: gaussian_noise(param, 1.0, gen),
        "secure_gaussian": lambda: secure_gaussian((elements,), 1.0, device, torch.float32)}
    for f in fns.values():
        for _ in range(warmup):
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for order in _rotations(list(fns), reps):
        for k in order:
            sync(device)
            t0 = time.perf_counter()
            fns[k]()
            sync(device)
            times[k].append(time.perf_counter() - t0)
    return {k: {"times_s": ts} for k, ts in times.items()}
