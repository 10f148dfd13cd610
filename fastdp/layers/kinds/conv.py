"""``nn.Conv1d/2d/3d``: any stride, dilation, padding (ints, tuples, "same", "valid"), padding mode and groups.

The input ``(B, C_in, *spatial)`` is padded exactly as the module pads it (``padding_mode`` included) and unfolded
into patches ``(B, T, C_in * prod(k))`` where ``T`` is the number of output positions. With ``g`` groups, group
``j`` sees input channels ``[j C_in/g, (j+1) C_in/g)`` and owns output channels ``[j C_out/g, (j+1) C_out/g)``, so
the canonical shapes of :mod:`fastdp.layers._matmul` are ``A: (B, g, T, C_in/g * prod(k))`` and
``G: (B, g, T, C_out/g)``; the per-sample weight gradient ``(B, g, C_out/g, C_in/g * prod(k))`` reshapes to
``(B, C_out, C_in/g, *k)``. Bias ``(C_out,)``: ``g_i = sum_t G_i[:, t]``.

The patches are ``prod(k)`` times the input, so they are never formed for the whole batch at once when that is
large: :class:`ConvCall` keeps the input and pads and unfolds a few samples at a time (at most
:data:`PATCH_CHUNK_BYTES` of patches), and each operation (per-sample gradient, ghost norm, clipped sum) consumes a
chunk before the next is made. Per-sample gradients of a call with many positions (``T >=``
:data:`GROUPED_MIN_POSITIONS`) come instead from one grouped convolution over the batch (torch's weight-gradient
kernel, no patches). Three paths avoid patches altogether: the clipped sum as torch's weight-gradient kernel on
per-sample scaled operands (:data:`CLIPPED_SUM`), the ghost norm's input Gram from the Gram of the padded input's
pixels (:data:`PIXEL_GRAMS`), and the default mode's memory rule counts the kept input, never patches
(:meth:`ConvKind.instantiation_fits`). Results equal the batch-at-once ones up to the order of floating-point sums.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.layers import _matmul, _rounding
from fastdp.layers._factored import Factors
from fastdp.layers.base import to_accumulation
from fastdp.layers.registry import register
from fastdp.layers.spec import DocRow, OracleCase

logger = logging.getLogger(__name__)


def unfold_patches(x: torch.Tensor, kernel: tuple[int, ...], dilation: tuple[int, ...],
                   stride: tuple[int, ...]) -> torch.Tensor:
    """Patches of an already padded input ``(B, C, *spatial)`` as ``(B, T, C * prod(kernel))``.

    Channel-major within a patch, matching the flattening of a conv weight ``(C_out, C, *kernel)``.
    """
    n = len(kernel)
    for i, (k, dil, s) in enumerate(zip(kernel, dilation, stride, strict=True)):
        span = (k - 1) * dil + 1
        x = x.unfold(2 + i, span, s)  # appends a window dimension of size `span`
        if dil > 1:
            x = x[..., ::dil]
    # x: (B, C, L_1..L_n, k_1..k_n)
    B, C = x.shape[0], x.shape[1]
    x = x.permute(0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n))
    T = math.prod(x.shape[1:1 + n])
    return x.reshape(B, T, C * math.prod(kernel))


@register
class ConvKind(_matmul.OuterProductKind):
    module_types = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    doc = DocRow(
        "`nn.Conv1d`, `nn.Conv2d`, `nn.Conv3d`", "weight, bias",
        "weight: ghost norm (input Gram from the pixels' Gram where cheaper) or instantiation on patches unfolded a "
        "few samples at a time (at T >= 256, or by one grouped convolution over the batch, the faster on CPU); "
        "clipped sum by the weight-gradient kernel or patches, the faster on CPU; bias: instantiated",
        'any stride, dilation, padding (ints, tuples, `"same"`, `"valid"`), `padding_mode`, `groups`. Needs a '
        "batched input.")

    def oracle_cases(self) -> tuple[OracleCase, ...]:
        return (OracleCase("1d, C = B", lambda: nn.Conv1d(3, 4, 3, padding=1), (3, 5)),
                OracleCase("2d, strided, dilated, reflect", lambda: nn.Conv2d(
                    2, 4, (2, 3), stride=(2, 1), dilation=(1, 2), padding=1, padding_mode="reflect"), (2, 5, 6)),
                OracleCase("2d, groups, same", lambda: nn.Conv2d(4, 6, 3, padding="same", groups=2), (4, 3, 3)),
                OracleCase("3d, circular, no bias", lambda: nn.Conv3d(
                    2, 2, 2, padding=1, padding_mode="circular", bias=False), (2, 3, 2, 3)),
                OracleCase("2d, bias only", lambda: nn.Conv2d(2, 3, 3), (2, 4, 4), frozen=("weight",)))

    def _padded(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        pad = list(module._reversed_padding_repeated_twice)
        if any(pad):
            x = F.pad(x, pad, mode=mode)
        return x

    def position_dims(self, grad_output: torch.Tensor) -> tuple[int, ...]:
        return tuple(range(2, grad_output.dim()))  # (B, C, *spatial)

    def prepare(self, module: nn.Module, activation: torch.Tensor | None, grad_output: torch.Tensor) -> Any:
        n = len(module.kernel_size)
        if grad_output.dim() != n + 2:
            raise ValueError(
                f"{type(module).__name__} needs a batched input of {n + 2} dimensions (B, C, ...); "
                f"got an output of shape {tuple(grad_output.shape)}. Add a batch dimension.")
        B, g, c_out = grad_output.shape[0], module.groups, module.out_channels
        T = math.prod(grad_output.shape[2:])  # explicit sizes throughout: B may be 0 (empty batch)
        if activation is not None:
            return ConvCall(self, module, to_accumulation(activation), to_accumulation(grad_output))
        return None, to_accumulation(grad_output).reshape(B, g, c_out // g, T).transpose(2, 3)  # (B, g, T, p)

    # The weight's operations on a ConvCall (the bias's read only G: OuterProductKind's).
    def prefers_ghost(self, module: nn.Module, ctx: Any, name: str) -> bool:
        call: ConvCall = ctx
        return 2 * call.T * call.T < call.p * call.d

    def instantiation_fits(self, module: nn.Module, ctx: Any, name: str, readers: int = 1) -> bool:
        # what book-keeping keeps per sample is the unpadded input and the output gradient (never the T x d
        # patches): instantiate where a per-sample gradient is no larger. (``readers`` does not apply: each call
        # keeps its own input here.)
        call: ConvCall = ctx
        kept = math.prod(call.x.shape[1:]) + math.prod(call.grad_output.shape[1:])
        return name == "bias" or call.module.weight.numel() <= kept

    def ghost_norm_parts(self, module: nn.Module, ctx: Any, name: str
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        call: ConvCall = ctx
        if PIXEL_GRAMS and call.pixel_gram_pays():
            G = call.G
            parts = [_rounding.symmetric_parts(call.input_gram(lo, hi), torch.matmul(G[lo:hi], G[lo:hi].transpose(
                -1, -2)), call.d, call.p) for lo, hi in call.chunks(call.pixel_gram_bytes())]
        else:
            # fresh patches per chunk: not the shared input-Gram cache (it keys on storage, which a chunk reuses)
            parts = [_matmul.ghost_norm_parts(call.patches(lo, hi), call.G[lo:hi], share=False)
                     for lo, hi in call.chunks()]
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(column) for column in zip(*parts, strict=True))

    def contraction_positions(self, module: nn.Module, ctx: Any, name: str) -> int:
        return ctx.T if isinstance(ctx, ConvCall) else super().contraction_positions(module, ctx, name)

    def sample_factors(self, module: nn.Module, ctx: Any, name: str, index: torch.Tensor) -> list[Factors] | None:
        if name == "bias":
            return super().sample_factors(module, _bias_ctx(ctx), name, index)
        call: ConvCall = ctx  # only these samples' patches (:meth:`factors` unfolds the whole batch)
        return [Factors(call.G[index], torch.cat([call.patches(i, i + 1) for i in index.tolist()]))]

    def per_sample_grad(self, module: nn.Module, ctx: Any, name: str) -> torch.Tensor:
        if name == "bias":
            return super().per_sample_grad(module, _bias_ctx(ctx), name)
        call: ConvCall = ctx
        if call.per_sample_method() == "grouped":
            return call.grouped_weight_grads()
        return call.per_sample_grads_by_patches()

    def guard_contracted(self, module: nn.Module, ctx: Any, name: str, sq: torch.Tensor) -> torch.Tensor:
        if name == "bias":
            return sq
        call: ConvCall = ctx  # a patch holds entries of x (or padding): a position of d of them
        return _rounding.guard_contracted(sq, call.x, call.d, call.patch_norms(), call.G)

    def clipped_sum(self, module: nn.Module, ctx: Any, name: str, coef: torch.Tensor) -> torch.Tensor:
        if name == "bias":
            return super().clipped_sum(module, _bias_ctx(ctx), name, coef)
        call: ConvCall = ctx
        if call.sum_method() == "kernel":
            return call.clipped_sum_by_kernel(coef)
        return call.clipped_sum_by_patches(coef)

    def factors(self, module: nn.Module, ctx: Any, name: str) -> Factors | None:
        if name == "bias":
            return super().factors(module, _bias_ctx(ctx), name)
        call: ConvCall = ctx
        return Factors(call.G, call.patches(0, call.batch))  # a shared weight's cross terms: the whole batch


def _bias_ctx(ctx: Any) -> tuple[None, torch.Tensor]:
    """The ``(A, G)`` form the bias's operations (:class:`fastdp.layers._matmul.OuterProductKind`) read."""
    return (None, ctx.G) if isinstance(ctx, ConvCall) else ctx


#: torch's convolution weight-gradient kernels by number of spatial dimensions
_WEIGHT_GRAD = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight, 3: torch.nn.grad.conv3d_weight}
#: per-sample weight gradients by one grouped convolution over the batch (:meth:`ConvCall.grouped_weight_grads`)
#: only when a call has at least this many output positions, else from patches. On a 2-core CPU (oneDNN) the grouped
#: kernel took about 0.3x the patches' time at T = 1024 and 3136, about the same at T = 64-256 and 3-6x at T <= 16,
#: and its scratch is about twice the per-sample gradients (29 MB against 18 MB for a 64-channel 3x3 layer at
#: batch 64, T 64), hence the high threshold.
GROUPED_MIN_POSITIONS = 256

#: how per-sample weight gradients of a call with at least :data:`GROUPED_MIN_POSITIONS` positions are formed:
#: ``"grouped"`` (:meth:`ConvCall.grouped_weight_grads`), ``"patches"`` (:meth:`ConvCall.per_sample_grads_by_patches`)
#: or ``"measure"`` (default): on CPU both timed once per call shape and the faster kept
#: (:meth:`ConvCall.per_sample_method`), elsewhere grouped. Both are exact; they differ in rounding only. On a 2-core
#: CPU the grouped kernel is the faster on ResNet-18's 64-channel layers (2.1 against 5.6 ms at 64² images, batch
#: 16) but not on its stem at 64², whose 3 input channels make 16 groups of 3 (6.1 against 4.1 ms;
#: ``python benchmarks/levers.py --conv-ops``).
PER_SAMPLE_GRADS = "measure"
#: the measured choice per call shape (:meth:`ConvCall.per_sample_method`)
_per_sample_choice: dict[tuple, str] = {}

#: how a weight's clipped sum ``sum_i coef_i g_i`` is formed: ``"kernel"``, torch's weight-gradient kernel on the
#: per-sample scaled operand (:meth:`ConvCall.clipped_sum_by_kernel`: the non-private weight gradient's own kernel,
#: no patches); ``"patches"``, one contraction over patches unfolded a few samples at a time
#: (:meth:`ConvCall.clipped_sum_by_patches`); ``"measure"`` (default): on CPU, both timed once per call shape and
#: the faster kept (:meth:`ConvCall.sum_method`), elsewhere the kernel. Both are exact; they differ in rounding only.
#: On a 2-core CPU (oneDNN) the kernel took 0.25-1.03x the patches' time on ResNet-18's layers of up to 256 output
#: channels but 1.06-2.0x on its 512-channel ones (``python benchmarks/levers.py --conv-ops``).
CLIPPED_SUM = "measure"
#: the measured choice per call shape (:meth:`ConvCall.sum_method`)
_sum_choice: dict[tuple, str] = {}
#: the most call shapes measured by each measured choice (the clipped sum's, the per-sample gradients'); beyond, the
#: default (the kernel; grouped) without a timing (inputs of ever new shapes would otherwise pay four extra
#: operations per layer on every step)
SUM_CHOICE_MAX = 1024

#: the ghost norm's input Gram from the Gram of the input's pixels (:meth:`ConvCall.input_gram`: no patches) where
#: that is fewer products (:meth:`ConvCall.pixel_gram_pays`); off, from patches (``benchmarks/levers.py``)
PIXEL_GRAMS = True

#: the most bytes of patches a :class:`ConvCall` forms at once, per device type (others: ``"default"``). On CPU,
#: glibc serves every allocation above 32 MiB by a fresh ``mmap``, so a batch's patches (often hundreds of MiB) are
#: page-faulted in anew on every use; chunks of a few MiB are reused from the heap and stay in cache.
PATCH_CHUNK_BYTES: dict[str, int] = {"cpu": 8 * 2**20, "default": 256 * 2**20}


def _timed_choice(store: dict[tuple, str], key: tuple, forms: dict[str, Any], what: str,
                  default: str = "kernel") -> str:
    """The name of the fastest of ``forms`` (name -> a call with no arguments) for ``key``, timed once (two runs
    of each, alternating, the best of each) and kept in ``store``; ``default`` without a timing once ``store`` holds
    :data:`SUM_CHOICE_MAX` shapes (inputs of ever new shapes would otherwise pay the timing on every step)."""
    choice = store.get(key)
    if choice is not None:
        return choice
    if len(store) >= SUM_CHOICE_MAX:
        return default
    best = dict.fromkeys(forms, math.inf)
    for _ in range(2):
        for name, form in forms.items():
            t0 = time.perf_counter()
            form()
            best[name] = min(best[name], time.perf_counter() - t0)
    choice = store[key] = min(best, key=best.__getitem__)
    logger.debug("%s by %s (%s)", what, choice, ", ".join(f"{n} {1e3 * t:.2f} ms" for n, t in best.items()))
    return choice


@dataclass
class ConvCall:
    """A recorded convolution call with its input kept (not unfolded): ``x`` ``(B, C_in, *spatial)`` and ``G``
    ``(B, g, T, p)``. :meth:`patches` unfolds samples ``[lo, hi)`` to ``(hi - lo, g, T, d)``, ``d = C_in/g *
    prod(k)``; :meth:`chunks` cuts the batch so that each chunk's patches take at most
    ``PATCH_CHUNK_BYTES`` (one chunk if a sample's alone take more)."""

    kind: ConvKind
    module: nn.Module
    x: torch.Tensor
    grad_output: torch.Tensor  # (B, C_out, *spatial), in the accumulation dtype

    @property
    def G(self) -> torch.Tensor:
        """``(B, g, T, p)``: the output gradient as the canonical form of :mod:`fastdp.layers._matmul`."""
        go, g = self.grad_output, self.module.groups
        B, c_out = go.shape[0], go.shape[1]
        return go.reshape(B, g, c_out // g, self.T).transpose(2, 3)

    @property
    def batch(self) -> int:
        return self.grad_output.shape[0]

    @property
    def T(self) -> int:
        return math.prod(self.grad_output.shape[2:])

    @property
    def p(self) -> int:
        return self.grad_output.shape[1] // self.module.groups

    @property
    def d(self) -> int:
        return self.x.shape[1] // self.module.groups * math.prod(self.module.kernel_size)

    def _weight_grad_input(self) -> tuple[torch.Tensor, tuple[int, ...]]:
        """The input and padding for torch's weight-gradient kernel: zero padding that is the same on both sides
        of every dimension is passed to it; any other (``padding_mode``, an uneven ``"same"``) is applied first."""
        m = self.module
        pad = list(m._reversed_padding_repeated_twice)  # (left, right) per dimension, last dimension first
        if m.padding_mode == "zeros" and pad[0::2] == pad[1::2]:
            return self.x, tuple(reversed(pad[0::2]))
        return self.kind._padded(m, self.x), (0,) * len(m.kernel_size)

    def grouped_weight_grads(self) -> torch.Tensor:
        """Per-sample weight gradients ``(B, C_out, C_in/g, *k)`` as the weight gradient of one convolution with
        ``B * g`` groups over the batch laid side by side in the channels: sample ``i``'s channels form groups
        ``i g .. i g + g - 1``, whose weight gradient is ``g_i``."""
        m = self.module
        B = self.batch
        shape = tuple(m.weight.shape)
        if B == 0:
            return self.G.new_zeros(0, *shape)
        x, padding = self._weight_grad_input()
        go = self.grad_output
        grads = _WEIGHT_GRAD[len(m.kernel_size)](
            x.reshape(1, B * x.shape[1], *x.shape[2:]), (B * shape[0], *shape[1:]),
            go.reshape(1, B * go.shape[1], *go.shape[2:]), stride=m.stride, padding=padding, dilation=m.dilation,
            groups=B * m.groups)
        return grads.reshape(B, *shape)

    def clipped_sum_by_kernel(self, coef: torch.Tensor) -> torch.Tensor:
        """``sum_i coef_i g_i``, shape of the weight, as the weight gradient of the whole batch with sample ``i``'s
        input (or output gradient, whichever is smaller) scaled by ``coef_i``: ``sum_i G_i^T (coef_i A_i)`` is
        linear in each sample's operand, and padding (any ``padding_mode``) commutes with the scaling. The scaled
        operand goes to the pass's reused buffer (:func:`fastdp.layers._matmul.reused_scratch`)."""
        m = self.module
        x, padding = self._weight_grad_input()
        go = self.grad_output
        c = coef.to(go.dtype).view(-1, *([1] * (go.dim() - 1)))
        if self._scale_input(x, go):
            x = _matmul._scaled(x, c)
        else:
            go = _matmul._scaled(go, c)
        return _WEIGHT_GRAD[len(m.kernel_size)](x, tuple(m.weight.shape), go, stride=m.stride, padding=padding,
                                                 dilation=m.dilation, groups=m.groups)

    def clipped_sum_by_patches(self, coef: torch.Tensor) -> torch.Tensor:
        """``sum_i coef_i g_i``, shape of the weight, as one contraction per chunk of unfolded patches."""
        total = None
        for lo, hi in self.chunks():
            part = _matmul.clipped_sum(self.patches(lo, hi), self.G[lo:hi], coef[lo:hi])
            total = part if total is None else total.add_(part)
        return total.reshape(self.module.weight.shape)

    def sum_method(self) -> str:
        """``"kernel"`` or ``"patches"`` for this call's clipped sum (see :data:`CLIPPED_SUM`). Measured once per
        call shape on CPU: two timed runs of each on samples' coefficients of 1, the faster kept; not measured
        (the kernel) under ``torch.use_deterministic_algorithms``, so that the summation order does not depend on
        a timing."""
        if CLIPPED_SUM != "measure":
            return CLIPPED_SUM
        if self.batch == 0:
            return "patches"
        if self.x.device.type != "cpu" or torch.are_deterministic_algorithms_enabled():
            return "kernel"
        m = self.module
        key = (self.x.dtype, tuple(self.x.shape), tuple(self.grad_output.shape), tuple(m.weight.shape), m.stride,
               m.dilation, m.groups, m.padding_mode, tuple(m._reversed_padding_repeated_twice))
        ones = self.x.new_ones(self.batch)
        return _timed_choice(_sum_choice, key, {"kernel": lambda: self.clipped_sum_by_kernel(ones),
                                                "patches": lambda: self.clipped_sum_by_patches(ones)},
                             f"{type(m).__name__} {key[1:3]}: clipped sum")

    def per_sample_method(self) -> str:
        """``"grouped"`` or ``"patches"`` for this call's per-sample weight gradients: patches below
        :data:`GROUPED_MIN_POSITIONS` positions, else as :data:`PER_SAMPLE_GRADS` says; measured once per call shape
        on CPU (two timed runs of each, the faster kept), grouped elsewhere, for an empty batch and under
        ``torch.use_deterministic_algorithms``."""
        if self.T < GROUPED_MIN_POSITIONS:
            return "patches"
        if PER_SAMPLE_GRADS != "measure":
            return PER_SAMPLE_GRADS
        if self.batch == 0 or self.x.device.type != "cpu" or torch.are_deterministic_algorithms_enabled():
            return "grouped"
        m = self.module
        key = (self.x.dtype, tuple(self.x.shape), tuple(self.grad_output.shape), tuple(m.weight.shape), m.stride,
               m.dilation, m.groups, m.padding_mode, tuple(m._reversed_padding_repeated_twice))
        return _timed_choice(_per_sample_choice, key, {"grouped": self.grouped_weight_grads,
                                                       "patches": self.per_sample_grads_by_patches},
                             f"{type(m).__name__} {key[1:3]}: per-sample gradients", default="grouped")

    def per_sample_grads_by_patches(self) -> torch.Tensor:
        """Per-sample weight gradients ``(B, C_out, C_in/g, *k)`` as ``G_i^T A_i`` on patches unfolded a chunk of
        samples at a time."""
        G = self.G
        B, g, _, p = G.shape
        out = G.new_empty(B, g, p, self.d)
        for lo, hi in self.chunks():
            torch.matmul(G[lo:hi].transpose(-1, -2), self.patches(lo, hi), out=out[lo:hi])
        return out.reshape(B, *self.module.weight.shape)

    def _scale_input(self, x: torch.Tensor, go: torch.Tensor) -> bool:
        """Whether :meth:`clipped_sum_by_kernel` scales the input (the smaller operand) or the output gradient."""
        return x.numel() < go.numel()

    @property
    def pixels(self) -> int:
        """``N``: pixels of one channel of the padded input."""
        return math.prod(s + a + b for s, a, b in zip(
            self.x.shape[2:], reversed(self.module._reversed_padding_repeated_twice[0::2]),
            reversed(self.module._reversed_padding_repeated_twice[1::2]), strict=True))

    def pixel_gram_pays(self) -> bool:
        """Whether :meth:`input_gram` takes fewer products than the patches' Gram: ``N^2 < prod(k) T^2`` (both
        times ``C_in / g``); typically a stride-1 convolution with a kernel larger than 1."""
        return self.pixels ** 2 < math.prod(self.module.kernel_size) * self.T ** 2

    def pixel_gram_bytes(self) -> int:
        """Bytes per sample that :meth:`input_gram` holds: the pixel Gram and the patch Gram, per group."""
        return self.module.groups * (self.pixels ** 2 + 2 * self.T ** 2) * self.x.element_size()

    def patch_norms(self) -> torch.Tensor:
        """``(B, g, T)``: upper bounds of the norms of the patches (the rows of :meth:`patches`), without unfolding
        them: the padded input squared, summed over each group's channels and kernel window by a convolution with a
        kernel of ones, raised by the rounding and underflow of those ``d`` squares and their sum
        (:func:`fastdp.layers._rounding.upper_sq`: never below the true norms, also where the squares underflow)."""
        m = self.module
        x = self.kind._padded(m, self.x)
        ones = x.new_ones(m.groups, x.shape[1] // m.groups, *m.kernel_size)
        conv = (F.conv1d, F.conv2d, F.conv3d)[len(m.kernel_size) - 1]
        sq = conv(x.square(), ones, stride=m.stride, dilation=m.dilation, groups=m.groups)
        return _rounding.upper_sq(sq.reshape(self.batch, m.groups, self.T), self.d + 1).sqrt()

    def input_gram(self, lo: int, hi: int) -> torch.Tensor:
        """``A_i A_i^T`` per sample and group, ``(hi - lo, g, T, T)``, for samples ``[lo, hi)``, without patches.

        Patch row ``t`` of sample ``i`` holds, per channel ``c`` and kernel offset ``delta``, the padded input's
        pixel ``pix(delta, t)``. So ``<A_i[t], A_i[s]> = sum_delta P_i[pix(delta, t), pix(delta, s)]``, where
        ``P_i = X_i^T X_i`` ``(N, N)`` is the Gram of the padded input's pixels over the group's channels: ``N^2
        C_in/g`` products instead of ``T^2 C_in/g prod(k)``, then the sum of ``prod(k)`` strided ``T x T`` windows of
        ``P_i`` (one per kernel offset: the pixels it reads form a strided window of the padded input).
        """
        m = self.module
        x = self.kind._padded(m, self.x[lo:hi])  # (b, C_in, *padded)
        b, g = hi - lo, m.groups
        padded = tuple(x.shape[2:])
        N, T = math.prod(padded), self.T
        X = x.reshape(b, g, x.shape[1] // g, N)
        P = torch.matmul(X.transpose(-1, -2), X).view(b * g, *padded, *padded)
        out_shape = self.grad_output.shape[2:]
        out = None
        for delta in itertools.product(*(range(k) for k in m.kernel_size)):
            # the pixels kernel offset delta reads at every output position: a strided window of the padded input
            window = tuple(slice(d * dil, d * dil + (L - 1) * s + 1, s) for d, dil, L, s in zip(
                delta, m.dilation, out_shape, m.stride, strict=True))
            part = P[(slice(None), *window, *window)]  # (b g, *out_shape, *out_shape)
            out = part.clone(memory_format=torch.contiguous_format) if out is None else out.add_(part)
        return out.view(b, g, T, T)

    def chunks(self, per_sample: int | None = None) -> list[tuple[int, int]]:
        """Sample ranges whose working set takes at most :data:`PATCH_CHUNK_BYTES` (``per_sample`` bytes each;
        by default a sample's patches)."""
        B = self.batch
        budget = PATCH_CHUNK_BYTES.get(self.x.device.type, PATCH_CHUNK_BYTES["default"])
        if per_sample is None:
            per_sample = self.module.groups * self.T * self.d * self.x.element_size()
        step = max(1, budget // max(1, per_sample))
        if B <= step:
            return [(0, B)]
        return [(lo, min(lo + step, B)) for lo in range(0, B, step)]

    def patches(self, lo: int, hi: int) -> torch.Tensor:
        m = self.module
        x = self.kind._padded(m, self.x[lo:hi])
        U = unfold_patches(x, m.kernel_size, m.dilation, m.stride)  # (b, T, C_in*K)
        b, T, g = hi - lo, self.T, m.groups
        return U.reshape(b, T, g, U.shape[2] // g).transpose(1, 2)  # (b, g, T, C_in/g*K)
