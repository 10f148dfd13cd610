"""A/B of the engine's performance levers: each lever's previous implementation against the current one, in one
process, alternating single steps with non-private training (``python benchmarks/levers.py``).

A *lever* is a change in fastdp made for speed or memory that must not change what is released. Its "before" is
kept here, as the code it replaced, and installed by patching fastdp's module attributes for the steps measured
"before"; the "after" is fastdp as it is. Every round takes one step of each configuration, in an order that
rotates each round, after warm-up steps; the table reports median step times and their ratio to non-private.

Usage::

    python benchmarks/levers.py                                   # every lever on the default workloads
    python benchmarks/levers.py --levers fused-norms --models tinycls --sizes 128 --reps 9
    python benchmarks/levers.py --json results/levers.json        # also save the raw times

``python benchmarks/levers.py --noise`` times the noise of a step drawn per parameter, into one flat buffer, by fastdp
(two threads) and by numpy Box-Muller on one and two threads.
``python benchmarks/levers.py --conv-ops`` times each operation of the convolution kind on ResNet-18's layer shapes,
every way it can be done (the clipped sum by kernel or patches, the input Gram from pixels or patches, per-sample
gradients from patches or the grouped kernel), against the batch's weight gradient. (These kernel-level measurements,
and ``--gram-ops`` below, live in ``benchmarks/kernel_ops.py``.)
``python benchmarks/levers.py --norm-ops`` times a GroupNorm's per-sample weight and bias gradients on ResNet-18's
shapes, ``x_hat`` recomputed or from one fused backward over the batch folded into the channels.
``python benchmarks/levers.py --memory`` reports, instead of times, each configuration's peak live-tensor growth
over one step (``workers._live_peak_bytes``: the allocations and frees torch's profiler records).

Levers:

* ``fused-norms``: per-sample squared norms with ``torch.linalg.vector_norm`` over rows (``fastdp.norms.norm_sq``)
  and Gram inner products with ``torch.linalg.vecdot``; before: ``t.square().sum()`` (a full-size temporary) and a
  batched ``(1 x n) @ (n x 1)`` ``bmm``.
* ``shared-gram``: one input Gram matrix for the layers that read the same input tensor (q, k, v of an attention
  block), cached for one pass of per-sample norms (``fastdp.layers._grams.shared_input_grams``); before: one per
  layer.
* ``parallel-noise``: on CPU, a step's noise drawn on ``fastdp.noise.NOISE_THREADS`` threads from child generators
  (``fastdp.noise.noisy_means``); before: one thread, one parameter after another.
* ``balanced-noise-runs``: the noise threads' runs dealt largest parameter first to the least-loaded thread
  (``fastdp.noise._runs``); before: consecutive pieces of the parameter list of about equal size (one thread
  could get a whole large tensor more; ``--noise`` prints both rules' balance).
* ``reused-scratch``: a book-keeping clipped sum scales its smaller operand (``coef_i A_i``) into one buffer
  reused from layer to layer for a pass (``fastdp.layers._matmul.reused_scratch``); before: a fresh tensor per
  layer (on CPU paid in page faults).
* ``drop-as-summed``: a record's kept input and output gradients (or per-sample gradients) are freed as soon as the
  clipped sums of its parameters are formed (``fastdp.clipped_sums._drop_kept``); before: all kept to the end of
  the pass, so the sums piled up on top of them. A memory lever: ``--memory`` reports it.
* ``sum-order``: step 3 forms the sums in increasing order of what they add to memory (``fastdp.clipped_sums.
  _net_bytes``: an embedding table's sum after the layers whose drop makes room); before: the records' order.
  A memory lever.
* ``shared-input-fits``: the default mode's memory rule for instantiating per-sample gradients counts an input
  read by several calls (``q``, ``k``, ``v``) once for all of them (``fastdp.layers._matmul.instantiation_fits``,
  ``readers``); before: once per call, so those layers were instantiated where that holds more than book-keeping
  keeps. A memory lever, with its time shown by the default A/B.
* ``conv-kernels``: a convolution's patches unfolded a few MiB of samples at a time for each operation (ghost norm,
  clipped sum, per-sample gradients), and its per-sample gradients at ``T >= 256`` by one grouped convolution over
  the batch (``fastdp.layers.kinds.conv.ConvCall``); before: the whole batch's patches unfolded once and kept for
  every operation.
* ``conv-sum-kernel``: a convolution's book-keeping clipped sum by torch's weight-gradient kernel with the smaller
  operand scaled per sample, or over patches, whichever was faster when timed once per call shape
  (``fastdp.layers.kinds.conv.CLIPPED_SUM = "measure"``); before: always one contraction over patches unfolded a
  few samples at a time (``"patches"``).
* ``conv-sum-measure``: the same against always the kernel (``"kernel"``).
* ``cancellation-guard``: not a speed lever but the cost of a privacy fix. Each ghost norm also estimates its
  rounding (``fastdp.layers._rounding.gram_rounding``: the Grams' Frobenius norms and the positions' norms) and raises
  samples that rounding rules (``guarded_sq``); the final sum over ``T^2`` products accumulates in float64
  (``_factored.gram_inner``) in both configurations; before: no bound, nothing flagged.
* ``exact-path``: also the cost of privacy fixes. Where a host read is free, the samples a ghost norm flags are
  instantiated and summed apart from the contraction, and every sample's norm is raised by the contraction's own
  rounding where that exceeds ``2^-9`` of it (``fastdp.layers._rounding.exact_flagged``); before: the guarded norm
  only.
* ``bn-layout``: the BatchNorm/InstanceNorm layout hooks (``fastdp.torch_api.batch_norm_layout_hooks``: a stride check
  of each input and output gradient, a copy where torch's CPU kernel would misread it); before: switched off
  (``DENSE_LAYOUT_DEVICES`` empty; the hooks still run and return at once).
* ``conv-per-sample-measure``: a convolution's per-sample gradients at ``T >= 256`` by the grouped kernel or from
  patches, whichever was faster when timed once per call shape (``fastdp.layers.kinds.conv.PER_SAMPLE_GRADS =
  "measure"``); before: always the grouped kernel.
* ``ln-weighted-kernel``: a LayerNorm's ``x_hat`` (for its weight's per-sample gradients) recomputed by torch's
  kernel with a weight of ones (``LayerNormKind.normalize``: the same numbers); before: without a weight, a slower
  CPU kernel.
* ``gn-folded``: a GroupNorm's per-sample weight and bias gradients from one fused group-norm backward over the
  batch folded into the channels (``fastdp.layers.kinds.groupnorm``, from ``FOLDED_MIN_POSITIONS`` positions);
  before: ``x_hat`` recomputed and ``G * x_hat`` reduced.
* ``conv-pixel-grams``: a convolution's ghost norm with the input Gram from the Gram of the padded input's pixels
  and ``prod(k)`` gathers (``fastdp.layers.kinds.conv.ConvCall.input_gram``) where that takes fewer products;
  before: from patches.
* ``conv-kept-rule``: the default mode instantiates a convolution's per-sample gradients only where they are no
  larger than what book-keeping keeps of the call, its unpadded input and output gradient
  (``ConvKind.instantiation_fits``); before: ``p d <= T (p + d)``, which counted the ``T x d`` patches as kept.
* ``noise-in-place``: a clipped sum of more than ``fastdp.noise.NOISE_CHUNK`` numbers becomes its released gradient
  in place, its noise drawn in chunks into one buffer; before: the noise drawn into a fresh tensor of the
  parameter's size and the sum added to it. A memory lever (the same numbers on CPU).
* ``gram-strips``: a ghost norm's ``T x T`` Gram matrices formed as ``K`` strips of rows against the columns from the
  strip's first row on (the upper triangle by blocks, ``(K + 1) / 2K`` of the multiply-adds;
  ``fastdp.layers._grams.GRAM_STRIP``), their inner product weighting the blocks above the diagonal twice; before:
  the full Gram matrices. ``--flops`` counts the multiply-adds; ``--widths paper --sizes 512 --batch 2`` measures
  it where the ghost norms are long.
* ``gram-chunks``: a Gram matrix whose rows are wider than ``fastdp.layers._grams.GRAM_CHUNK`` (a vocabulary-wide
  LM head's output gradients) summed in chunks of columns, its rounding bound charged with the chunk width
  (``gram_width``), so the cancellation guard no longer flags what that bound's looseness flagged (GPT-2's tied head
  at T 256); before: one product over the whole width. The exact path's cost on flagged samples goes with it.
* ``guard-ops``: the cancellation guard's small operations per ghost-norm parameter: on the CPU ``exact_flagged``
  reads "is any sample flagged?" first and, when none is, returns the computed norm with the contraction's raise
  only; ``symmetric_parts`` takes each Gram's rounding term from the sum of its diagonal's squares; before: the
  guarded norm, its raise and the flags formed every time, and the rounding terms from norms of the positions'
  norms (the same values either way; a CPU-time lever).
* ``guard-batch``: the ghost norms' guards finished once per group of like parameters on their stack
  (``fastdp.layers._guard_batch``: the element-wise rest of the rounding bound, the guarded norm and the contraction's
  raise; on the CPU one host read per group); before: each parameter's guard on its own (``_guard_batch.BATCHED``
  off). The levers above that patch the guard's functions run with it off, as they were built.

``python benchmarks/levers.py --gram-ops`` times the ghost norm's Gram products with 1 (whole), 2, 4, 8 and 16 strips on
a few layer shapes (``fastdp.layers._grams.GRAM_STRIP`` is chosen from it); ``--gram-ops --odd-t`` times them at a
ViT's odd token counts with and without a leading strip of ``T mod 16`` rows (``fastdp.layers._grams.GRAM_ALIGN``,
not adopted: whole steps are compared by ``run.py``'s method ``fastdp BK-MixOpt, aligned Grams``); ``--cold`` writes a
64 MiB buffer before each call, so that the inputs come from memory as in a step.

``python benchmarks/levers.py --slack --models gpt2 roberta --widths paper --sizes 512 --batch 2`` (an option, not a
lever: not adopted) compares the default mode's matrix-product FLOPs and peak live tensors, as ratios to
non-private training, with ``fastdp.layers._matmul.INSTANTIATION_SLACK`` at 1 (the default: instantiate a per-sample
gradient only where it is no larger than what book-keeping keeps of the call) and at 1.25.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import kernel_ops  # the kernel-level A/Bs
import torch
import zoo

# from kernel_ops, re-exported (levers.conv_ops_ab etc.), and _consecutive_runs, a lever's 'before' code
from kernel_ops import _consecutive_runs, conv_ops_ab, gram_ops_ab, noise_ab, norm_ops_ab  # noqa: F401

import fastdp.clipped_sums
import fastdp.layers._factored
import fastdp.layers._grams
import fastdp.layers._guard_batch
import fastdp.layers._matmul
import fastdp.layers._rounding
import fastdp.noise
import fastdp.torch_api
from fastdp.layers import _matmul
from fastdp.layers.base import to_accumulation
from fastdp.layers.kinds import conv as conv_kind
from fastdp.layers.kinds.conv import ConvKind, unfold_patches


# ------------------------------------------------------------------------------------------ the "before" code
def _norm_sq_before(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], math.prod(t.shape[1:])).square().sum(dim=1)


def _gram_inner_before(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    B = a.shape[0]
    n = math.prod(a.shape[1:])
    return torch.bmm(a.reshape(B, 1, n), b.reshape(B, n, 1)).reshape(B)


_patched = zoo.patched


def _fused_norms_before() -> contextlib.AbstractContextManager:
    return _patched([(fastdp.clipped_sums, "norm_sq", _norm_sq_before),
                     (fastdp.layers._factored, "gram_inner", _gram_inner_before)])


def _shared_gram_before() -> contextlib.AbstractContextManager:
    return _patched([(fastdp.layers._grams, "SHARE_INPUT_GRAMS", False)])


def _parallel_noise_before() -> contextlib.AbstractContextManager:
    return _patched([(fastdp.noise, "NOISE_THREADS", 1)])


def _balanced_noise_runs_before() -> contextlib.AbstractContextManager:
    return _patched([(fastdp.noise, "_runs", _consecutive_runs)])


def _conv_prepare_before(self: ConvKind, module: torch.nn.Module, activation: torch.Tensor | None,
                         grad_output: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The whole batch's patches unfolded at once, as ``(A, G)`` for the generic outer-product operations."""
    B, g, c_out = grad_output.shape[0], module.groups, module.out_channels
    T = math.prod(grad_output.shape[2:])
    G = to_accumulation(grad_output).reshape(B, g, c_out // g, T).transpose(2, 3)
    A = None
    if activation is not None:
        U = unfold_patches(self._padded(module, to_accumulation(activation)), module.kernel_size, module.dilation,
                           module.stride)
        A = U.reshape(B, T, g, U.shape[2] // g).transpose(1, 2)
    return A, G


def _conv_kernels_before() -> contextlib.AbstractContextManager:
    base = _matmul.OuterProductKind
    return _patched([(ConvKind, "prepare", _conv_prepare_before)]
                    + [(ConvKind, name, getattr(base, name)) for name in (
                        "prefers_ghost", "instantiation_fits", "ghost_norm_sq", "per_sample_grad", "clipped_sum",
                        "factors")])


def _reused_scratch_before() -> contextlib.AbstractContextManager:
    return _patched([(fastdp.layers._matmul, "_scaled", lambda X, c: X * c)])


def _drop_as_summed_before() -> contextlib.AbstractContextManager:
    return _patched([(fastdp.clipped_sums, "_drop_kept", lambda rec: None)])


def _sum_order_before() -> contextlib.AbstractContextManager:
    return _patched([(fastdp.clipped_sums, "_net_bytes", lambda param, plist: 0)])  # stable sort: records' order


_instantiation_fits_now = _matmul.instantiation_fits


def _shared_input_fits_before() -> contextlib.AbstractContextManager:
    return _patched([(fastdp.layers._matmul, "instantiation_fits",
                      lambda A, G, readers=1: _instantiation_fits_now(A, G))])


def _conv_sum_kernel_before() -> contextlib.AbstractContextManager:
    return _patched([(conv_kind, "CLIPPED_SUM", "patches")])


def _conv_sum_measure_before() -> contextlib.AbstractContextManager:
    return _patched([(conv_kind, "CLIPPED_SUM", "kernel")])


def _noise_in_place_before() -> contextlib.AbstractContextManager:
    return _patched([(fastdp.noise, "NOISE_CHUNK", 1 << 62)])


def _conv_per_sample_measure_before() -> contextlib.AbstractContextManager:
    return _patched([(conv_kind, "PER_SAMPLE_GRADS", "grouped")])


def _layernorm_unweighted_normalize(self: object, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, module.normalized_shape, None, None, module.eps)


def _ln_weighted_kernel_before() -> contextlib.AbstractContextManager:
    from fastdp.layers.kinds.layernorm import LayerNormKind

    return _patched([(LayerNormKind, "normalize", _layernorm_unweighted_normalize)])


def _gn_folded_before() -> contextlib.AbstractContextManager:
    from fastdp.layers.kinds import groupnorm

    return _patched([(groupnorm, "FOLDED_MIN_POSITIONS", 0)])


def _conv_pixel_grams_before() -> contextlib.AbstractContextManager:
    return _patched([(conv_kind, "PIXEL_GRAMS", False)])


def _gram_strips_before() -> contextlib.AbstractContextManager:
    return _patched([(fastdp.layers._grams, "GRAM_STRIP", {"cpu": (1, 1), "default": (1, 1)})])


def _conv_fits_before(self: ConvKind, module: torch.nn.Module, ctx: object, name: str, readers: int = 1) -> bool:
    return name == "bias" or ctx.p * ctx.d <= ctx.T * (ctx.p + ctx.d)


def _conv_kept_rule_before() -> contextlib.AbstractContextManager:
    return _patched([(ConvKind, "instantiation_fits", _conv_fits_before)])


def _cancellation_guard_before() -> contextlib.AbstractContextManager:
    # the Gram inner product alone: no rounding estimate, nothing flagged (the position norms are still formed)
    zero = lambda fro, norms_t, norms_s, width: torch.zeros(fro.shape[0], dtype=fro.dtype,  # noqa: E731
                                                              device=fro.device)
    return _patched([(fastdp.layers._rounding, "gram_rounding", zero),
                     (fastdp.layers._rounding, "guarded_sq", lambda sq, err, bound: sq), _PER_PARAMETER])


#: the guard per parameter (before guard-batch), for the levers whose "before" patches its functions
_PER_PARAMETER = (fastdp.layers._guard_batch, "BATCHED", False)


def _guard_batch_before() -> contextlib.AbstractContextManager:
    return _patched([_PER_PARAMETER])


def _exact_path_before() -> contextlib.AbstractContextManager:
    # flagged samples keep the raised norm and stay in the contraction; no contraction raise, no host read
    return _patched([(fastdp.layers._rounding, "exact_flagged",
                      lambda sq, err, bound, factors_of, shape, positions: (
                          fastdp.layers._rounding.guarded_sq(sq, err, bound), None)), _PER_PARAMETER])


def _exact_worth_before() -> contextlib.AbstractContextManager:
    # every flagged sample taken apart, however narrowly flagged (the exact path as first built)
    return _patched([(fastdp.layers._rounding, "EXACT_WORTH", 0.0)])


def _gram_chunks_before() -> contextlib.AbstractContextManager:
    # every Gram product over the whole width of its rows (the rounding bound charged with that width)
    return _patched([(fastdp.layers._grams, "GRAM_CHUNK", {})])


def _symmetric_parts_before(K: torch.Tensor, L: torch.Tensor, width_k: int, width_l: int) -> tuple:
    # each Gram's rounding term by gram_rounding from the positions' norms (two norms of norms per Gram)
    r = fastdp.layers._rounding
    nk, nl = r.diagonal_norms(K, width_k), r.diagonal_norms(L, width_l)
    err = torch.zeros(K.shape[0], dtype=K.dtype, device=K.device)
    red = r.reduction_width(K.dtype, math.prod(K.shape[1:]))
    if width_k:
        err = err + r.gram_rounding(r.frobenius(L), nk, nk, width_k + red)
        red = 0
    if width_l:
        err = err + r.gram_rounding(r.frobenius(K), nl, nl, width_l + red)
    return fastdp.layers._factored.gram_inner(K, L), err, r.triangle_bound_sq(nk, nl)


def _exact_flagged_before(sq, err, bound_sq, factors_of, shape, positions):
    # the guarded and raised norms and the flags formed first, whether or not a sample is flagged
    r = fastdp.layers._rounding
    guarded = r.guarded_sq(sq, err, bound_sq)
    raised = r.with_contraction(guarded, bound_sq, positions)
    flagged = ((sq < r.CANCELLATION_GUARD * err) & (guarded > (1.0 + r.EXACT_WORTH) ** 2 * sq.clamp(min=0))
               & err.isfinite() & bound_sq.isfinite())
    if sq.numel() == 0 or not bool(flagged.any()):
        return raised, None
    return _exact_flagged_now(sq, err, bound_sq, factors_of, shape, positions)


_exact_flagged_now = fastdp.layers._rounding.exact_flagged


def _guard_ops_before() -> contextlib.AbstractContextManager:
    return _patched([(fastdp.layers._rounding, "symmetric_parts", _symmetric_parts_before),
                     (fastdp.layers._rounding, "exact_flagged", _exact_flagged_before), _PER_PARAMETER])


def _bn_layout_before() -> contextlib.AbstractContextManager:
    return _patched([(fastdp.torch_api, "DENSE_LAYOUT_DEVICES", frozenset())])


LEVERS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "fused-norms": _fused_norms_before,
    "shared-gram": _shared_gram_before,
    "parallel-noise": _parallel_noise_before,
    "balanced-noise-runs": _balanced_noise_runs_before,
    "conv-kernels": _conv_kernels_before,
    "reused-scratch": _reused_scratch_before,
    "drop-as-summed": _drop_as_summed_before,
    "sum-order": _sum_order_before,
    "shared-input-fits": _shared_input_fits_before,
    "conv-sum-kernel": _conv_sum_kernel_before,
    "conv-sum-measure": _conv_sum_measure_before,
    "conv-pixel-grams": _conv_pixel_grams_before,
    "conv-per-sample-measure": _conv_per_sample_measure_before,
    "ln-weighted-kernel": _ln_weighted_kernel_before,
    "gn-folded": _gn_folded_before,
    "conv-kept-rule": _conv_kept_rule_before,
    "noise-in-place": _noise_in_place_before,
    "gram-strips": _gram_strips_before,
    "cancellation-guard": _cancellation_guard_before,
    "exact-path": _exact_path_before,
    "bn-layout": _bn_layout_before,
    "exact-worth": _exact_worth_before,
    "gram-chunks": _gram_chunks_before,
    "guard-ops": _guard_ops_before,
    "guard-batch": _guard_batch_before,
}

DEFAULT_WORKLOADS = (("tinycls", 64), ("tinycls", 128), ("roberta", 64), ("roberta", 256), ("gpt2", 256), ("vit", 64))


def measure(w: zoo.Workload, levers: list[str], reps: int, warmup: int) -> dict[str, list[float]]:
    """Median-ready step times: ``{"non-private": [...], "<lever> before": [...], "after": [...]}``."""
    device = torch.device("cpu")
    data = zoo.make_batch(w, device)
    configs: dict[str, tuple[Callable, Callable[[], contextlib.AbstractContextManager]]] = {
        "non-private": (zoo.make_step(w, "non-private", device), contextlib.nullcontext),
        "after": (zoo.make_step(w, zoo.DEFAULT_METHOD, device), contextlib.nullcontext),
    }
    for lever in levers:
        configs[f"{lever} before"] = (zoo.make_step(w, zoo.DEFAULT_METHOD, device), LEVERS[lever])
    times: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    for r in range(warmup + reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            step, ctx = configs[name]
            with ctx():
                t0 = time.perf_counter()
                step(data)
                dt = time.perf_counter() - t0
            if r >= warmup:
                times[name].append(dt)
    return times


def measure_memory(w: zoo.Workload, levers: list[str], warmup: int) -> dict[str, int]:
    """Peak live-tensor growth (bytes) over one step of each configuration, after ``warmup`` steps of each (the
    bytes held do not depend on the machine's load: one step each)."""
    from workers import _live_peak_bytes

    device = torch.device("cpu")
    data = zoo.make_batch(w, device)
    configs = {"non-private": (zoo.make_step(w, "non-private", device), contextlib.nullcontext),
               "after": (zoo.make_step(w, zoo.DEFAULT_METHOD, device), contextlib.nullcontext)}
    for lever in levers:
        configs[f"{lever} before"] = (zoo.make_step(w, zoo.DEFAULT_METHOD, device), LEVERS[lever])
    out = {}
    for name, (step, ctx) in configs.items():
        with ctx():
            for _ in range(warmup):
                step(data)
            out[name] = _live_peak_bytes(step, data)
    return out


def measure_flops(w: zoo.Workload, levers: list[str]) -> dict[str, int]:
    """Matrix-product FLOPs of one step of each configuration, after one unmeasured step (deterministic: counted
    from the shapes each operator ran at, ``workers.matmul_flops``)."""
    from workers import matmul_flops

    device = torch.device("cpu")
    data = zoo.make_batch(w, device)
    configs = {"non-private": ("non-private", contextlib.nullcontext),
               "after": (zoo.DEFAULT_METHOD, contextlib.nullcontext)}
    for lever in levers:
        configs[f"{lever} before"] = (zoo.DEFAULT_METHOD, LEVERS[lever])
    out = {}
    for name, (method, ctx) in configs.items():
        with ctx():
            step = zoo.make_step(w, method, device)
            step(data)
            out[name] = matmul_flops(step, data)
        del step
    return out


def slack_ab(workloads: list[zoo.Workload], slacks: tuple[float, ...] = (1.0, 1.25)) -> dict[str, dict[str, float]]:
    """Per workload, non-private training and the default mode at each ``INSTANTIATION_SLACK``: matrix-product
    FLOPs and peak live-tensor growth of one step after one unmeasured one, and their ratios to non-private."""
    from workers import _live_peak_bytes, matmul_flops

    device = torch.device("cpu")
    out = {}
    for w in workloads:
        data = zoo.make_batch(w, device)
        rows: dict[str, float] = {}
        for label, method, slack in [("non-private", "non-private", None)] + [
                (f"slack {s:g}", zoo.DEFAULT_METHOD, s) for s in slacks]:
            patches = [] if slack is None else [(fastdp.layers._matmul, "INSTANTIATION_SLACK", slack)]
            with _patched(patches):
                step = zoo.make_step(w, method, device)
                step(data)
                rows[f"{label} GFLOP"] = matmul_flops(step, data) / 1e9
                rows[f"{label} live MB"] = _live_peak_bytes(step, data) / 2**20
            del step
        cells = [w.tag]
        for s in slacks:
            cells += [f"{rows[f'slack {s:g} GFLOP'] / rows['non-private GFLOP']:.3f}x",
                      f"{rows[f'slack {s:g} live MB'] / rows['non-private live MB']:.3f}x"]
        print("| " + " | ".join(cells) + " |", flush=True)
        out[w.tag] = rows
    return out


def _print_row(tag: str, values: dict[str, float], base_cell: str, levers: list[str]) -> None:
    """One table row: the non-private value, each configuration as a ratio to it, and each lever's gain
    (``before / after``)."""
    base = values["non-private"]
    cells = [base_cell] + [f"{values[f'{lv} before'] / base:.3f}x" for lv in levers]
    cells += [f"{values['after'] / base:.3f}x"]
    cells += [f"{values[f'{lv} before'] / values['after']:.3f}" for lv in levers]
    print(f"| {tag} | {' | '.join(cells)} |", flush=True)


def _save(args: argparse.Namespace, key: str, rows: object) -> None:
    """Write ``rows`` under ``key`` to ``--json`` (when given), with the thread count and torch version."""
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": args.threads, "torch": torch.__version__, key: rows}, indent=1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levers", nargs="+", default=list(LEVERS), choices=list(LEVERS))
    p.add_argument("--models", nargs="+", default=None, choices=zoo.MODELS)
    p.add_argument("--sizes", nargs="+", type=int, default=None)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="tiny widths, size 16, batch 2, one round (a smoke test)")
    p.add_argument("--noise", action="store_true",
                   help="only the noise A/B (per parameter, flat buffer, fastdp, numpy Box-Muller)")
    p.add_argument("--memory", action="store_true", help="peak live-tensor growth of each configuration, not times")
    p.add_argument("--slack", action="store_true",
                   help="only FLOPs and live peak of the default mode at INSTANTIATION_SLACK 1 and 1.25")
    p.add_argument("--flops", action="store_true", help="matrix-product FLOPs of each configuration, not times")
    p.add_argument("--widths", default="cpu", help="the width set of the workloads (benchmarks/zoo.py WIDTHS)")
    p.add_argument("--batch", type=int, default=None, help="the batch (default: the harness's)")
    p.add_argument("--conv-ops", action="store_true",
                   help="only the convolution kind's operations on ResNet-18's layer shapes, every way (ms)")
    p.add_argument("--gram-ops", action="store_true",
                   help="only the ghost norm's Gram products with 1, 2, 4, 8, 16 strips on a few layer shapes (ms)")
    p.add_argument("--odd-t", action="store_true",
                   help="with --gram-ops: the Gram products at a ViT's odd T, with and without a leading strip (ms)")
    p.add_argument("--cold", action="store_true",
                   help="with --gram-ops --odd-t: the inputs evicted from the cache before each call")
    p.add_argument("--norm-ops", action="store_true",
                   help="only a GroupNorm's per-sample gradients on ResNet-18's shapes, recomputed or folded (ms)")
    p.add_argument("--device", default="cpu", help="--gram-ops: where the products run (cpu, cuda)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.gram_ops and args.odd_t:
        print("| layer | strips over all T | leading strip of T mod 16 | ratio |")
        print("|---" * 4 + "|")
        _save(args, "ms", kernel_ops.gram_align_ab(args.reps, device=args.device, cold=args.cold))
        return
    if args.gram_ops:
        print("| layer | whole | 2 strips | 4 strips | 8 strips | 16 strips |")
        print("|---" * 6 + "|")
        _save(args, "ms", gram_ops_ab(args.reps, device=args.device))
        return
    if args.slack:
        print("| workload | FLOPs, slack 1 | live, slack 1 | FLOPs, slack 1.25 | live, slack 1.25 |")
        print("|---|---|---|---|---|")
        chosen = [zoo.Workload(m, s, args.batch or zoo.default_batch(m, s, args.widths), args.widths)
                  for m in args.models or ("gpt2",) for s in args.sizes or (512,)]
        _save(args, "rows", slack_ab(chosen))
        return
    if args.norm_ops:
        print("| GroupNorm input | recompute x_hat | folded | folded / recompute |")
        print("|---" * 4 + "|")
        _save(args, "ms", norm_ops_ab(args.reps))
        return
    if args.conv_ops:
        print("| layer | weight gradient (non-private) | sum by kernel | sum by patches | ghost norm, pixel Gram | "
              "ghost norm, patches | per-sample, patches | per-sample, grouped |")
        print("|---" * 8 + "|")
        _save(args, "ms", conv_ops_ab(args.reps))
        return
    if args.noise:
        _save(args, "ms", {f"{model}-{size}": noise_ab(model, size, args.reps)
                           for model, size in (("gpt2", 256), ("roberta", 64), ("vit", 64), ("resnet", 32))
                           if not args.models or model in args.models})
        return
    workloads = [(m, s) for m, s in DEFAULT_WORKLOADS if not args.models or m in args.models]
    listed = {m for m, _ in workloads}
    workloads += [(m, zoo.DEFAULT_SIZES[m][0]) for m in args.models or () if m not in listed]
    if args.sizes:
        workloads = list(dict.fromkeys((m, s) for m, _ in workloads for s in args.sizes))
    results = {}
    print(f"| workload | non-private | {' | '.join(f'{lv} before' for lv in args.levers)} | after | "
          f"{' | '.join(f'{lv} gain' for lv in args.levers)} |")
    print("|---" * (3 + 2 * len(args.levers)) + "|")
    if args.quick:
        chosen = list(dict.fromkeys(zoo.Workload(m, 16, 2, "tiny") for m, _ in workloads))
        reps, warmup = 1, 0
    else:
        chosen = [zoo.Workload(m, s, args.batch or zoo.default_batch(m, s, args.widths), args.widths)
                  for m, s in workloads]
        reps, warmup = args.reps, args.warmup
    if args.flops:
        for w in chosen:
            flops = {k: v / 1e9 for k, v in measure_flops(w, args.levers).items()}
            _print_row(w.tag, flops, f"{flops['non-private']:.1f} GFLOP", args.levers)
            results[w.tag] = flops
        _save(args, "gflop", results)
        return
    if args.memory:
        for w in chosen:
            live = {k: v / 2**20 for k, v in measure_memory(w, args.levers, max(warmup, 1)).items()}
            _print_row(w.tag, live, f"{live['non-private']:.0f} MB", args.levers)
            results[w.tag] = live
        chosen = []
    for w in chosen:
        times = measure(w, args.levers, reps, warmup)
        med = {k: statistics.median(v) for k, v in times.items()}
        _print_row(w.tag, med, f"{med['non-private'] * 1e3:.0f} ms", args.levers)
        results[w.tag] = times
    _save(args, "live_mb" if args.memory else "times_s", results)


if __name__ == "__main__":
    sys.exit(main())
