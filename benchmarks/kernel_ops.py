"""Kernel-level A/B measurements behind some of ``benchmarks/levers.py``'s levers: each operation timed every way it
can be done on fixed shapes, alternating calls, median milliseconds (``python benchmarks/levers.py --noise``,
``--conv-ops``, ``--gram-ops``; the levers themselves are A/B'd in whole steps by ``levers.py``).

* :func:`noise_ab`: a step's noise drawn per parameter, into one flat buffer, by fastdp, or by numpy Box-Muller;
* :func:`conv_ops_ab`: the convolution kind's operations on ResNet-18's layer shapes;
* :func:`gram_ops_ab`: the ghost norm's Gram products with 1, 2, 4, 8, 16 strips;
* :func:`gram_align_ab`: the same at odd ``T``, with and without a leading strip of ``T mod 16`` rows;
* :func:`norm_ops_ab`: a GroupNorm's per-sample weight and bias gradients, recomputing ``x_hat`` or folded.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable

import torch
import zoo

import fastdp.layers._grams
import fastdp.layers._matmul
from fastdp.layers import _grams
from fastdp.layers.kinds import conv as conv_kind
from fastdp.layers.kinds.conv import ConvKind

_patched = zoo.patched

def _numpy_box_muller(out: torch.Tensor, bits: object, block: int = 1 << 15) -> None:
    """``out`` (contiguous float32, CPU) filled with N(0, 1) numbers: numpy bit-generator words (``bits``, e.g.
    ``numpy.random.PCG64DXSM``) through Box-Muller in float32 with numpy's vectorised functions, ``block`` pairs at
    a time (the design measured against torch's ``normal_`` and not adopted)."""
    import numpy as np

    flat = out.view(-1).numpy()
    r, t = np.empty(block, np.float32), np.empty(block, np.float32)
    for start in range(0, flat.size - 1, 2 * block):
        k = min(block, (flat.size - start) // 2)
        words = bits.random_raw(k).view(np.uint32)  # 2k words: radii from the first k, angles from the rest
        # (an odd count leaves the last number unfilled: for timing only)
        rk, tk = r[:k], t[:k]
        np.copyto(rk, words[:k], casting="unsafe")
        rk *= np.float32(2.0 ** -32)
        rk += np.float32(2.0 ** -33)
        np.log(rk, out=rk)
        rk *= np.float32(-2.0)
        np.sqrt(rk, out=rk)
        np.copyto(tk, words[k:], casting="unsafe")
        tk *= np.float32(2.0 * math.pi * 2.0 ** -32)
        np.cos(tk, out=flat[start:start + k])
        flat[start:start + k] *= rk
        np.sin(tk, out=flat[start + k:start + 2 * k])
        flat[start + k:start + 2 * k] *= rk


def _consecutive_runs(params: list[torch.Tensor], k: int) -> list[list[int]]:
    """The noise threads' runs before the ``balanced-noise-runs`` lever: consecutive pieces of the parameter list of
    about equal size (``fastdp.noise._runs`` deals the largest parameters first to the least-loaded thread)."""
    total = sum(p.numel() for p in params)
    runs: list[list[int]] = [[]]
    filled = 0
    for i, p in enumerate(params):
        if runs[-1] and filled >= total * len(runs) / k and len(runs) < k:
            runs.append([])
        runs[-1].append(i)
        filled += p.numel()
    return runs


def noise_ab(model: str, size: int, reps: int) -> dict[str, float]:
    """The noise of one step of a workload's trainable parameters drawn several ways, alternating (median
    milliseconds of each):

    * ``per parameter``: one fresh tensor and one torch ``normal_`` call per parameter, on one thread;
    * ``flat buffer``: one fresh flat buffer and one call for all of them (a lever, not adopted);
    * ``fastdp``: ``fastdp.noise.noisy_means`` (noise only, one fresh tensor per parameter), on ``NOISE_THREADS``
      threads from child generators; ``fastdp, consecutive runs``: the same with the threads' runs cut as before
      the ``balanced-noise-runs`` lever (consecutive pieces of the parameter list);
    * ``numpy Box-Muller, 1 thread`` / ``2 threads``: numpy ``PCG64DXSM`` words through Box-Muller in float32
      (:func:`_numpy_box_muller`), one fresh tensor per parameter, the parameters on one thread or split in two
      runs on two as ``fastdp`` splits them (a design not adopted: faster than ``normal_`` on one thread, no
      faster than ``fastdp`` on two).
    """
    import concurrent.futures

    import numpy as np

    import fastdp.noise

    w = zoo.Workload(model, size, zoo.default_batch(model, size, "cpu"))
    params = [p.detach() for p in zoo.make_model(w).parameters() if p.requires_grad]
    shapes = [p.shape for p in params]
    total = sum(math.prod(s) for s in shapes)
    gen = torch.Generator().manual_seed(0)
    runs = [[params[i] for i in run] for run in fastdp.noise._runs(params, 2)]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def per_parameter() -> None:
        [torch.empty(s).normal_(0.0, 1.0, generator=gen) for s in shapes]

    def flat() -> None:
        torch.empty(total).normal_(0.0, 1.0, generator=gen)

    def library() -> None:
        fastdp.noise.noisy_means(params, {}, 1.0, 1, gen)

    def library_consecutive() -> None:
        with _patched([(fastdp.noise, "_runs", _consecutive_runs)]):
            fastdp.noise.noisy_means(params, {}, 1.0, 1, gen)

    def numpy_run(run: list[torch.Tensor], seed: int) -> None:
        bits = np.random.PCG64DXSM(seed)
        for p in run:
            _numpy_box_muller(torch.empty(p.shape), bits)

    def numpy_one() -> None:
        numpy_run(params, 0)

    def numpy_two() -> None:
        f = pool.submit(numpy_run, runs[-1], 1)
        numpy_run(runs[0], 2)
        f.result()

    forms = {"per parameter": per_parameter, "flat buffer": flat, "fastdp": library,
             "fastdp, consecutive runs": library_consecutive,
             "numpy Box-Muller, 1 thread": numpy_one, "numpy Box-Muller, 2 threads": numpy_two}
    names = list(forms)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps + 1):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            forms[name]()
            if r:
                times[name].append(time.perf_counter() - t0)
    pool.shutdown()
    out = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    balance = {}  # the larger of the two runs' numbers, over an equal share
    for rule, deal in (("balanced", fastdp.noise._runs), ("consecutive", _consecutive_runs)):
        balance[rule] = max(sum(params[i].numel() for i in run) for run in deal(params, 2)) / (total / 2)
    print(f"noise for {w.tag} ({len(shapes)} tensors, {total:,} numbers): "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in out.items())
          + f"; larger run / equal share: balanced {balance['balanced']:.3f}, consecutive "
          + f"{balance['consecutive']:.3f}", flush=True)
    return {**out, **{f"larger run / equal share, {k}": v for k, v in balance.items()}}


#: ResNet-18's convolution shapes at 32², 64² and 128² images and the harness's batch for each:
#: (image side, batch, C_in, input side, C_out, kernel, stride); the first is the stem (7 x 7, stride 2, on the image)
RESNET_CONVS = tuple((img, batch, c_in, img // div, c_out, k, s) for img, batch in ((32, 64), (64, 16), (128, 4))
                     for c_in, div, c_out, k, s in ((3, 1, 64, 7, 2), (64, 4, 64, 3, 1), (64, 4, 128, 3, 2),
                                                    (128, 8, 128, 3, 1), (128, 8, 256, 3, 2), (256, 16, 256, 3, 1),
                                                    (256, 16, 512, 3, 2), (512, 32, 512, 3, 1), (64, 4, 128, 1, 2)))


def _conv_ops(conv: torch.nn.Conv2d, call: object, x: torch.Tensor, go: torch.Tensor,
              coef: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The operations :func:`conv_ops_ab` times on one call (the path switches are set around each)."""
    kind = ConvKind()
    norm = functools.partial(kind.ghost_norm_sq, conv, call, "weight")
    return {"weight gradient (non-private)": functools.partial(
                torch.nn.grad.conv2d_weight, x, conv.weight.shape, go, stride=conv.stride, padding=conv.padding),
            "sum by kernel": functools.partial(call.clipped_sum_by_kernel, coef),
            "sum by patches": functools.partial(call.clipped_sum_by_patches, coef),
            "ghost norm, pixel Gram": norm,
            "ghost norm, patches": norm,
            "per-sample, patches": functools.partial(kind.per_sample_grad, conv, call, "weight"),
            "per-sample, grouped": call.grouped_weight_grads}


def conv_ops_ab(reps: int, shapes: tuple[tuple[int, ...], ...] = RESNET_CONVS) -> list[dict[str, object]]:
    """Each operation of the convolution kind on ResNet-18's layer shapes, every way it can be done, alternating
    calls (median milliseconds): the clipped sum by the weight-gradient kernel or by patches, the ghost norm with
    the input Gram from the pixels' Gram or from patches, per-sample gradients from patches or the grouped kernel,
    and the batch's plain weight gradient (what non-private training pays) for scale."""
    from fastdp.layers.kinds.conv import ConvCall

    rows = []
    for img, B, c_in, side, c_out, k, stride in shapes:
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2, bias=False)
        x = torch.randn(B, c_in, side, side)
        with torch.no_grad():
            go = torch.randn_like(conv(x))
        call: ConvCall = ConvKind().prepare(conv, x, go)
        ops = _conv_ops(conv, call, x, go, torch.rand(B))
        times: dict[str, list[float]] = {name: [] for name in ops}
        for r in range(reps + 1):
            for name in list(ops)[r % len(ops):] + list(ops)[:r % len(ops)]:
                patches = [(conv_kind, "PIXEL_GRAMS", name != "ghost norm, patches"),
                           (conv_kind, "GROUPED_MIN_POSITIONS", 10**9 if name == "per-sample, patches" else 0),
                           (conv_kind, "PER_SAMPLE_GRADS", "grouped"),
                           (ConvCall, "pixel_gram_pays", lambda self: True)]
                with _patched(patches):
                    t0 = time.perf_counter()
                    ops[name]()
                    if r:
                        times[name].append(time.perf_counter() - t0)
        row = {"shape": f"img{img} B{B} {c_in}->{c_out} k{k} s{stride} at {side}x{side} (T {call.T})"}
        row.update({name: 1e3 * statistics.median(ts) for name, ts in times.items()})
        rows.append(row)
        print("| " + " | ".join([row["shape"]] + [f"{row[name]:.2f}" for name in ops]) + " |", flush=True)
    return rows


#: (B, T, d, p) of ghost-norm layers: the CPU-width workloads' (T 64 to 256, d 256, p 256 / 1024 / the LM head's
#: 8000) and the paper widths' at batch 2 (GPT-2-small's c_fc at T 512, a narrow layer at T 1024)
GRAM_SHAPES = ((32, 64, 256, 256), (32, 64, 256, 1024), (16, 128, 256, 256), (16, 128, 256, 1024),
               (8, 256, 256, 8000), (2, 512, 768, 3072), (2, 1024, 256, 1024))


def gram_ops_ab(reps: int, shapes: tuple[tuple[int, int, int, int], ...] = GRAM_SHAPES,
                counts: tuple[int, ...] = (1, 2, 4, 8, 16), device: str = "cpu") -> list[dict[str, object]]:
    """The ghost norm's Gram products and their inner product (``strips_inner(gram_strips(A), gram_strips(G))``)
    with ``K`` strips for each ``K`` in ``counts`` (1: the whole Gram matrices; only strips of at least 16 rows),
    alternating calls, median milliseconds per layer shape, float32 on ``device`` (synchronised on CUDA)."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for B, T, d, p in shapes:
        gen = torch.Generator().manual_seed(0)
        A = torch.randn(B, 1, T, d, generator=gen).to(dev)
        G = torch.randn(B, 1, T, p, generator=gen).to(dev)
        ks = [k for k in counts if T // k >= 16]
        times: dict[int, list[float]] = {k: [] for k in ks}
        for r in range(reps + 1):
            for k in ks[r % len(ks):] + ks[:r % len(ks)]:
                with _patched([(fastdp.layers._grams, "GRAM_STRIP", {"cpu": (1, k), "default": (1, k)})]):
                    sync()
                    t0 = time.perf_counter()
                    _grams.strips_inner(_grams.gram_strips(A), _grams.gram_strips(G))
                    sync()
                    if r:
                        times[k].append(time.perf_counter() - t0)
        row: dict[str, object] = {"shape": f"B {B}, T {T}, d {d}, p {p}", "device": str(dev)}
        row.update({f"K {k}": 1e3 * statistics.median(ts) for k, ts in times.items()})
        rows.append(row)
        cells = [f"{row[f'K {k}']:.2f} ({row[f'K {k}'] / row['K 1']:.2f}x)" if f"K {k}" in row else "-"
                 for k in counts]
        print("| " + " | ".join([str(row["shape"])] + cells) + " |", flush=True)
    return rows


#: ResNet-18's GroupNorm inputs (B, C, side) at 32², 64² and 128² images with the harness's batches (32 groups)
RESNET_NORMS = tuple((batch, c, img // div) for img, batch in ((32, 64), (64, 16), (128, 4))
                     for c, div in ((64, 2), (64, 4), (128, 8), (256, 16), (512, 32)))


#: (B, T, d, p) of ghost-norm layers at a token count that is not a multiple of 16: the CPU-width ViT's (patch 8 and a
#: class token: T 17, 65 and 257 at 32², 64² and 128² images, width 192, MLP 768, q/k/v 576) and ViT-Base's at 224²
#: (patch 16: T 197, width 768, batch 2)
ODD_T_SHAPES = ((64, 17, 192, 576), (64, 17, 192, 768), (64, 17, 768, 192), (32, 65, 192, 576), (32, 65, 192, 768),
                (32, 65, 768, 192), (8, 257, 192, 768), (8, 257, 768, 192), (2, 197, 768, 2304),
                (2, 197, 768, 3072))


def gram_align_ab(reps: int, shapes: tuple[tuple[int, int, int, int], ...] = ODD_T_SHAPES,
                  device: str = "cpu", cold: bool = False) -> list[dict[str, object]]:
    """The ghost norm's Gram products and their inner product at odd ``T``, with a leading strip of ``T mod 16`` rows
    (:data:`fastdp.layers._grams.GRAM_ALIGN` at 16, not the default) and without, alternating calls, median
    milliseconds per layer shape, float32 on ``device``; the strips of ``GRAM_STRIP`` either way. ``cold``: a 64 MiB
    buffer is written before each call, so that ``A`` and ``G`` are not in the cache (as in a step, where they were
    written long before)."""
    dev = torch.device(device)
    flush = torch.zeros(16 << 20, device=dev) if cold else None
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    align = {dev.type: 16}
    configs = {"aligned": [(fastdp.layers._grams, "GRAM_ALIGN", align)],
               "unaligned": [(fastdp.layers._grams, "GRAM_ALIGN", {})]}
    rows = []
    for B, T, d, p in shapes:
        gen = torch.Generator().manual_seed(0)
        A = torch.randn(B, 1, T, d, generator=gen).to(dev)
        G = torch.randn(B, 1, T, p, generator=gen).to(dev)
        times: dict[str, list[float]] = {k: [] for k in configs}
        names = list(configs)
        for r in range(reps + 2):  # two warm-up rounds
            for name in names[r % 2:] + names[:r % 2]:
                with _patched(configs[name]):
                    if flush is not None:
                        flush.add_(1.0)
                    sync()
                    t0 = time.perf_counter()
                    _grams.strips_inner(_grams.gram_strips(A), _grams.gram_strips(G))
                    sync()
                    if r >= 2:
                        times[name].append(time.perf_counter() - t0)
        row: dict[str, object] = {"shape": f"B {B}, T {T}, d {d}, p {p}", "device": str(dev), "cold": cold}
        row.update({k: 1e3 * statistics.median(ts) for k, ts in times.items()})
        rows.append(row)
        print(f"| {row['shape']} | {row['unaligned']:.3f} | {row['aligned']:.3f} | "
              f"{row['aligned'] / row['unaligned']:.2f}x |", flush=True)
    return rows


def norm_ops_ab(reps: int, shapes: tuple[tuple[int, int, int], ...] = RESNET_NORMS) -> list[dict[str, object]]:
    """A GroupNorm's per-sample weight and bias gradients (``GroupNormKind.prepare`` then ``per_sample_grad`` of
    both) two ways, alternating calls, median milliseconds per shape: ``x_hat`` recomputed and ``G * x_hat``
    reduced (``FOLDED_MIN_POSITIONS = 0``), or one fused group-norm backward over the batch folded into the
    channels (``FOLDED_MIN_POSITIONS = 1``)."""
    from fastdp.layers.kinds import groupnorm

    kind = groupnorm.GroupNormKind()
    rows = []
    for B, C, side in shapes:
        gen = torch.Generator().manual_seed(0)
        module = torch.nn.GroupNorm(32, C)
        x = torch.randn(B, C, side, side, generator=gen)
        G = torch.randn(B, C, side, side, generator=gen)
        forms = {"recompute x_hat": 0, "folded": 1}
        times: dict[str, list[float]] = {name: [] for name in forms}
        for r in range(reps + 1):
            for name in list(forms)[r % 2:] + list(forms)[:r % 2]:
                with _patched([(groupnorm, "FOLDED_MIN_POSITIONS", forms[name])]):
                    t0 = time.perf_counter()
                    ctx = kind.prepare(module, x, G)
                    kind.per_sample_grad(module, ctx, "weight")
                    kind.per_sample_grad(module, ctx, "bias")
                    if r:
                        times[name].append(time.perf_counter() - t0)
        row: dict[str, object] = {"shape": f"B {B}, C {C}, {side}x{side}"}
        row.update({name: 1e3 * statistics.median(ts) for name, ts in times.items()})
        rows.append(row)
        print(f"| {row['shape']} | {row['recompute x_hat']:.3f} | {row['folded']:.3f} | "
              f"{row['folded'] / row['recompute x_hat']:.2f}x |", flush=True)
    return rows
