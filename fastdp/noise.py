"""Gaussian noise for the released gradient: the one place noise is drawn.

The released gradient of a parameter is ``(sum_i C_i g_i + sigma * R * xi) / batch_size`` with
``xi ~ N(0, I)`` drawn once per parameter per logical step, in at least float32, on the parameter's device.

Secure mode (:func:`secure_generator`, :func:`secure_gaussian`, :func:`secure_noisy_mean`) draws from generators
whose state comes from the operating system's CSPRNG at every call, and sums four Gaussians against the
floating-point attack on the Gaussian mechanism; see docs/guide/secure-mode.md for what this does and does not protect.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import secrets
import sys
from collections.abc import Sequence
from functools import lru_cache

import torch

from fastdp.layers.base import accumulation_dtype
from fastdp.torch_api import foreach_add_, intra_op_threads_per_thread


def noise_dtype(param: torch.Tensor) -> torch.dtype:
    """float64 for float64 parameters, float32 otherwise (never half precision)."""
    return accumulation_dtype(param.dtype)


def gaussian_noise(param: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """``std * xi`` with ``xi ~ N(0, I)`` of ``param``'s shape, on ``param``'s device, in :func:`noise_dtype`.

    Raises:
        ValueError: if ``generator`` lives on another device than ``param``.
    """
    return _draw(torch.empty(param.shape, dtype=noise_dtype(param), device=param.device), std, generator)


def _draw(out: torch.Tensor, std: float, generator: torch.Generator | None) -> torch.Tensor:
    """``out`` filled with ``N(0, std^2)`` numbers (zeros for ``std == 0``) from ``generator``."""
    if generator is not None and generator.device.type != out.device.type:
        raise ValueError(f"noise_generator is on device {generator.device} but a parameter is on {out.device}; "
                         f"create it with torch.Generator(device={str(out.device)!r})")
    if std == 0.0:
        return out.zero_()
    return out.normal_(0.0, std, generator=generator)


#: a clipped sum of more numbers than this becomes its released gradient in place, its noise drawn in chunks of
#: this many into one buffer (so the step holds one chunk more, not a second tensor of the parameter's size: the
#: largest parameter, a vocabulary embedding, sets it). A multiple of 16: on CPU the chunks draw exactly the numbers
#: one draw of the whole tensor would (torch fills normals in blocks of 16); on CUDA they are other numbers of the
#: same distribution.
NOISE_CHUNK = 1 << 20


def noisy_mean(param: torch.Tensor, clipped_sum: torch.Tensor | None, std: float, batch_size: int,
               generator: torch.Generator | None = None, chunk: int | None = None) -> torch.Tensor:
    """The released gradient ``(clipped_sum + std * xi) / batch_size``, cast to ``param``'s dtype.

    The noise is drawn already divided by ``batch_size`` and the clipped sum added in one fused pass.
    ``clipped_sum=None`` means an empty batch (noise only). A contiguous clipped sum that owns its storage, of more than
    ``chunk`` (:data:`NOISE_CHUNK`) numbers in the noise dtype and ``param``'s dtype and device is overwritten with
    the result chunk by chunk (:func:`_noisy_mean_in_place`): the same numbers, one chunk of scratch.
    """
    chunk = NOISE_CHUNK if chunk is None else chunk  # (read at the call: tests and benchmarks set it)
    if (clipped_sum is not None and clipped_sum.numel() > chunk and _owns_storage(clipped_sum)
            and clipped_sum.shape == param.shape and clipped_sum.device == param.device
            and clipped_sum.dtype == noise_dtype(param) == param.dtype and not clipped_sum.requires_grad):
        return _noisy_mean_in_place(param, clipped_sum, std, batch_size, generator, chunk)
    grad = gaussian_noise(param, std / batch_size, generator)
    if clipped_sum is not None:
        grad.add_(clipped_sum.to(grad.dtype), alpha=1.0 / batch_size)
    return grad.to(param.dtype)


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is contiguous and covers its whole storage: no other tensor (a sharded bucket's other rows, a
    buffer its version counter is shared with) sees what overwriting it changes."""
    return t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _noisy_mean_in_place(param: torch.Tensor, clipped_sum: torch.Tensor, std: float, batch_size: int,
                         generator: torch.Generator | None, chunk: int) -> torch.Tensor:
    """:func:`noisy_mean` written into ``clipped_sum`` (returned): per chunk of ``chunk`` numbers (the
    last one merged into the one before when it would be shorter than 16), ``std * xi / batch_size`` drawn into a
    buffer, and the chunk of the sum added as :func:`noisy_mean` adds it (``noise + sum / batch_size``), written
    straight into the sum's chunk."""
    flat = clipped_sum.view(-1)
    n = flat.numel()
    starts = list(range(0, n, chunk))
    if len(starts) > 1 and n - starts[-1] < 16:
        starts.pop()
    ends = starts[1:] + [n]
    buf = torch.empty(max(e - s for s, e in zip(starts, ends, strict=True)), dtype=flat.dtype, device=flat.device)
    for s, e in zip(starts, ends, strict=True):
        noise = _draw(buf[:e - s], std / batch_size, generator)
        torch.add(noise, flat[s:e], alpha=1.0 / batch_size, out=flat[s:e])  # one pass: no copy back
    return clipped_sum


#: device types on which one step's noise is drawn in buckets (:func:`_bucketed_noisy_means`): the parameters of up
#: to :data:`BUCKET_NUMBERS` numbers each, several to a bucket, one ``normal_`` call and one fused add of their clipped
#: sums per bucket; larger ones in place in chunks of that many. On a GPU each call is a kernel launch the host pays
#: (an H200's GPT-2-small step spent 19 ms of GPU time in the release of 148 tensors): there, at GPT-2-small width,
#: T 512, batch 16, the default mode's step took 207.8 ms with buckets against 217.0 ms without (1.28x against 1.33x
#: non-private, the same allocator peak; one run, docs/results/cuda.md, 2026-11-28). On CUDA only; on the CPU the
#: draws themselves cost (one core's Mersenne Twister), and two threads draw them (:data:`NOISE_THREADS`). The
#: released distribution is the same; a seed gives other numbers than per-parameter draws.
NOISE_BUCKETS: frozenset[str] = frozenset({"cuda"})
#: the most numbers a noise bucket (and an in-place chunk) holds where :data:`NOISE_BUCKETS` applies
BUCKET_NUMBERS = 1 << 24

#: CPU noise of one step is drawn on this many threads at once (torch's CPU ``normal_`` runs on one core); 1 draws
#: everything on the calling thread from the noise generator itself
NOISE_THREADS = 2
#: below this many numbers in a step the noise is drawn on one thread (the threads' overhead would dominate)
PARALLEL_NOISE_MIN = 1 << 20


def noisy_means(params: Sequence[torch.Tensor], sums: dict[torch.Tensor, torch.Tensor], std: float, batch_size: int,
                generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """:func:`noisy_mean` of every parameter of one step, ``(sums[p] + std * xi_p) / batch_size`` (a parameter
    without an entry in ``sums`` gets noise only), in the order of ``params``. Each sum is popped from ``sums`` as
    it is used, so it is freed as soon as its gradient exists.

    On CPU, with at least :data:`PARALLEL_NOISE_MIN` numbers and :data:`NOISE_THREADS` > 1, the parameters are
    dealt to that many threads in runs of about equal numbers (:func:`_runs`) and each run is drawn on its own
    thread from a *child* generator whose whole Mersenne-Twister state (624 words) is drawn from ``generator``
    (torch's default generator when ``None``) in a fixed order: a seeded run stays reproducible and a checkpoint of
    ``generator`` still restores the stream, while the draws of one step take about 1 / NOISE_THREADS of the time.
    The released distribution is the same, N(0, std^2 I) independent per entry; only which numbers a given seed
    produces changes. Elsewhere (CUDA, fewer numbers, one thread) each parameter is drawn in turn from
    ``generator``.
    """
    params = list(params)
    if std > 0 and params and all(p.device.type in NOISE_BUCKETS for p in params) and (
            generator is None or generator.device.type == params[0].device.type):
        return _bucketed_noisy_means(params, sums, std, batch_size, generator)
    total = sum(p.numel() for p in params)
    runs = _runs(params, NOISE_THREADS) if (
        NOISE_THREADS > 1 and total >= PARALLEL_NOISE_MIN and std > 0 and _cpu_state_layout_ok()
        and all(p.device.type == "cpu" for p in params)
        and (generator is None or generator.device.type == "cpu")) else []
    if len(runs) < 2:
        return [noisy_mean(p, sums.pop(p, None), std, batch_size, generator) for p in params]
    children = [_child_generator(generator) for _ in runs]
    out: list[torch.Tensor | None] = [None] * len(params)

    def draw(run: list[int], child: torch.Generator) -> None:
        for i in run:
            out[i] = noisy_mean(params[i], sums.pop(params[i], None), std, batch_size, child)

    threads = torch.get_num_threads()
    pool = _noise_pool()
    futures = [pool.submit(draw, run, child) for run, child in zip(runs[1:], children[1:], strict=True)]
    draw(runs[0], children[0])
    for f in futures:
        f.result()
    _restore_default_threads(threads)
    return out  # type: ignore[return-value]  # every slot is filled: the runs partition the indices


def _bucketed_noisy_means(params: list[torch.Tensor], sums: dict[torch.Tensor, torch.Tensor], std: float,
                          batch_size: int, generator: torch.Generator | None) -> list[torch.Tensor]:
    """:func:`noisy_means` in buckets (:data:`NOISE_BUCKETS`): the parameters of at most :data:`BUCKET_NUMBERS`
    numbers, grouped by device and dtype in their order, are cut into buckets of at most that many numbers; each
    bucket's noise ``std * xi / batch_size`` is one ``normal_`` draw into a flat buffer, each parameter's gradient a
    view of it, and the bucket's clipped sums are added by one fused call (:func:`fastdp.torch_api.foreach_add_`).
    A larger parameter is released by :func:`noisy_mean` in chunks of :data:`BUCKET_NUMBERS`. The same
    distribution, N(0, std^2 I) independent per entry; other numbers for a given seed than the per-parameter draws."""
    out: list[torch.Tensor | None] = [None] * len(params)
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        if p.numel() > BUCKET_NUMBERS:
            out[i] = noisy_mean(p, sums.pop(p, None), std, batch_size, generator, chunk=BUCKET_NUMBERS)
        else:
            groups.setdefault((p.device, noise_dtype(p), p.dtype), []).append(i)
    for (device, dtype, param_dtype), members in groups.items():
        bucket: list[int] = []
        filled = 0
        for i in [*members, None]:
            n = 0 if i is None else params[i].numel()
            if bucket and (i is None or filled + n > BUCKET_NUMBERS):
                flat = _draw(torch.empty(filled, dtype=dtype, device=device), std / batch_size, generator)
                views, offset = [], 0
                for k in bucket:
                    views.append(flat[offset:offset + params[k].numel()].view(params[k].shape))
                    offset += params[k].numel()
                pairs = [(v, sums.pop(params[k])) for k, v in zip(bucket, views, strict=True) if params[k] in sums]
                if pairs:
                    foreach_add_([v for v, _ in pairs], [s.to(device=device, dtype=dtype) for _, s in pairs],
                                 1.0 / batch_size)
                for k, v in zip(bucket, views, strict=True):
                    out[k] = v if param_dtype == dtype else v.to(param_dtype)
                bucket, filled = [], 0
            if i is not None:
                bucket.append(i)
                filled += n
    return out  # type: ignore[return-value]  # every index is released once


def _runs(params: list[torch.Tensor], k: int) -> list[list[int]]:
    """The indices of ``params`` dealt into at most ``k`` runs of about equal numbers of elements: largest
    parameter first, each to the run with the fewest elements so far (ties: the lower run), each run then in the
    parameters' order. Deterministic (the same sizes give the same runs), and no run exceeds an equal share by more
    than the largest parameter (consecutive pieces of the list, the rule before, could leave one thread a whole
    large tensor more than the other: ``benchmarks/levers.py``, lever ``balanced-noise-runs``)."""
    order = sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))
    loads = [0] * max(1, min(k, len(params)))
    members: list[list[int]] = [[] for _ in loads]
    for i in order:
        j = min(range(len(loads)), key=lambda r: (loads[r], r))
        members[j].append(i)
        loads[j] += params[i].numel()
    return [sorted(m) for m in members if m]


def _child_generator(parent: torch.Generator | None) -> torch.Generator:
    """A CPU generator whose Mersenne-Twister state is 624 words drawn from ``parent`` (see :func:`noisy_means`)."""
    words = torch.randint(0, 2**32, (_MT_WORDS,), dtype=torch.int64, generator=parent)
    child = torch.Generator()
    child.manual_seed(0)  # resets 'left', 'next' and the cached normals
    state = child.get_state()
    state[_MT_OFFSET:_MT_OFFSET + 8 * _MT_WORDS] = words.view(torch.uint8)
    child.set_state(state)
    return child


@lru_cache(maxsize=1)
def _noise_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=max(1, NOISE_THREADS - 1),
                                                 thread_name_prefix="fastdp-noise", initializer=_worker_threads)


def _worker_threads() -> None:
    """A noise worker's torch operations run on the worker alone (it is itself one of the step's noise threads).

    Under OpenMP (torch's CPU parallel backend on Linux and Windows) every thread that runs a parallel operation
    gets its own team of ``torch.get_num_threads()`` threads, kept for the life of the process. With the worker's
    team beside the main thread's there are more OpenMP threads than cores, and libgomp then spins only briefly
    before sleeping: every later parallel operation of the main thread (the training step's, not only the engine's)
    waits for its team to be woken. On a 2-core machine small operations took 4-8 times as long after one noise
    step (``benchmarks/noise_threads.py``). The setting is per thread under OpenMP; elsewhere (torch's native pool,
    shared by all threads) nothing is changed."""
    if intra_op_threads_per_thread():
        torch.set_num_threads(1)


def _restore_default_threads(threads: int) -> None:
    """Undo what a worker's :func:`_worker_threads` set beyond itself: ``torch.set_num_threads`` also stores its
    value as the count every thread that starts later begins with (and sizes torch's shared pthreadpool). Called on
    the thread that drew the noise with its own count (unchanged by the worker): the same count for it, and its
    count again for threads started later."""
    if intra_op_threads_per_thread() and torch.get_num_threads() == threads:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------- secure mode
#: Layout of the CPU generator state (``CPUGeneratorImplState`` in ATen): int64 initial seed, int32 ``left``,
#: int32 ``seeded``, uint64 ``next``, then the 624 Mersenne-Twister words, each stored in a uint64 slot.
_MT_WORDS = 624
_MT_OFFSET = 24


@lru_cache(maxsize=1)
def _cpu_state_layout_ok() -> bool:
    """Whether this torch's CPU generator state has the layout :func:`_seed_cpu_generator` writes.

    Checked against the Mersenne-Twister initialisation of a known seed (MT19937 reference init, seed 5489).
    """
    if sys.byteorder != "little":
        return False
    g = torch.Generator()
    g.manual_seed(5489)
    st = g.get_state()
    if st.dtype != torch.uint8 or st.numel() < _MT_OFFSET + 8 * _MT_WORDS:
        return False
    words = st[_MT_OFFSET:_MT_OFFSET + 8 * 3].view(torch.int64).tolist()
    left_seeded = st[8:16].view(torch.int32).tolist()
    expected1 = (1812433253 * (5489 ^ (5489 >> 30)) + 1) & 0xFFFFFFFF
    expected2 = (1812433253 * (expected1 ^ (expected1 >> 30)) + 2) & 0xFFFFFFFF
    return words == [5489, expected1, expected2] and left_seeded == [1, 1]


def _seed_cpu_generator(gen: torch.Generator) -> None:
    """Fill the whole Mersenne-Twister state of a CPU generator (624 x 32 bits) from ``os.urandom``.

    ``torch.Generator.manual_seed`` on CPU keeps only the low 32 bits of the seed (seeds ``s`` and ``s + 2**32``
    give the same stream), so seeding it with 64 random bits would give 32 bits of entropy.
    """
    if not _cpu_state_layout_ok():
        raise RuntimeError(
            f"secure mode: the CPU torch.Generator state of torch {torch.__version__} does not have the layout "
            "fastdp knows, so its full Mersenne-Twister state cannot be filled from the OS CSPRNG (manual_seed "
            "alone keeps only 32 bits of the seed on CPU). Use an accelerator device for secure noise, or a torch "
            "version whose layout fastdp supports.")
    gen.manual_seed(secrets.randbits(63))  # resets 'left', 'next' and the cached normals
    state = gen.get_state()
    words = torch.frombuffer(bytearray(os.urandom(4 * _MT_WORDS)), dtype=torch.int32).to(torch.int64) & 0xFFFFFFFF
    state[_MT_OFFSET:_MT_OFFSET + 8 * _MT_WORDS] = words.view(torch.uint8)
    gen.set_state(state)


def secure_generator(device: torch.device | str | None = None) -> torch.Generator:
    """A new ``torch.Generator`` on ``device`` (default CPU) whose state comes from the OS CSPRNG.

    * CPU: all 624 32-bit words of the Mersenne-Twister state are drawn from ``os.urandom`` (the state layout is
      verified at run time; ``RuntimeError`` if this torch's layout is unknown).
    * Other devices (CUDA: Philox, whose seed is 64 bits): ``manual_seed(secrets.randbits(64))``.

    The generator's *output* is that of torch's ordinary PRNG (MT19937 or Philox), not a cryptographic stream;
    the point is that its state cannot be predicted or reproduced. Make a fresh one per use.
    """
    dev = torch.device("cpu" if device is None else device)
    gen = torch.Generator(device=dev)
    if dev.type == "cpu":
        _seed_cpu_generator(gen)
    else:
        gen.manual_seed(secrets.randbits(64))
    return gen


def secure_gaussian(shape: int | Sequence[int] | torch.Size, std: float, device: torch.device | str | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``N(0, std^2 I)`` noise of ``shape`` drawn with the floating-point attack mitigation.

    Returns ``(z_1 + z_2 + z_3 + z_4) / 2`` with ``z_k ~ N(0, std^2 I)`` independent, each drawn from its own fresh
    :func:`secure_generator` (so four CSPRNG-seeded generators per call). The sum has variance ``4 std^2 / 4 =
    std^2``. A single floating-point Gaussian sample leaves gaps and an uneven spacing in the set of values it can
    take, which reveal the noiseless value it was added to (Mironov, CCS 2012); summing independent samples fills
    them (the recipe of Opacus' secure mode, after arXiv 2107.10138 section 5.1 with n = 2).

    The draws are made in float64 on CPU and in ``dtype`` promoted to at least float32 on other devices; the result
    has ``dtype`` promoted to at least float32 (half-precision noise is never returned), on ``device``.

    Raises:
        ValueError: ``std`` negative or not finite, or ``dtype`` not a floating dtype.
    """
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not math.isfinite(std) or std < 0:
        raise ValueError(f"std={std!r} must be a finite number >= 0")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is not a floating dtype; use torch.float32 or torch.float64")
    dev = torch.device("cpu" if device is None else device)
    out_dtype = accumulation_dtype(dtype)
    work_dtype = torch.float64 if dev.type == "cpu" else out_dtype
    if std == 0:
        return torch.zeros(shape, dtype=out_dtype, device=dev)
    acc = torch.empty(shape, dtype=work_dtype, device=dev).normal_(0.0, float(std), generator=secure_generator(dev))
    buf = torch.empty_like(acc)
    for _ in range(3):
        acc.add_(buf.normal_(0.0, float(std), generator=secure_generator(dev)))
    acc.mul_(0.5)
    return acc.to(out_dtype)


def secure_noisy_mean(param: torch.Tensor, clipped_sum: torch.Tensor | None, std: float,
                      batch_size: int) -> torch.Tensor:
    """:func:`noisy_mean` with :func:`secure_gaussian` noise: ``(clipped_sum + std * xi) / batch_size``.

    The noise ``std * xi`` is drawn at full scale (the attack mitigation concerns the released noise, so it is not
    pre-divided), added to the clipped sum in :func:`noise_dtype`, then divided by ``batch_size`` and cast to
    ``param``'s dtype. ``clipped_sum=None`` means an empty batch (noise only).
    """
    grad = secure_gaussian(param.shape, std, param.device, noise_dtype(param))
    if clipped_sum is not None:
        grad.add_(clipped_sum.to(grad.dtype))
    return grad.div_(batch_size).to(param.dtype)
