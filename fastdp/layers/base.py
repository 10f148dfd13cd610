"""The interface every supported layer kind implements.

A *layer kind* holds the per-sample math of one family of modules. The engine calls it with

* ``activation``: what :meth:`LayerKind.capture` kept from the forward pass (the module's input, detached), or
  ``None`` when no trainable parameter of the module needs it (bias-only training, DP-BiTFiT);
* ``grad_output``: the gradient of the loss with respect to the module's output, shape ``(B, ...)``, where ``B`` is
  the physical batch size. It is the gradient of the *summed* per-sample losses up to one global scale that the
  engine applies afterwards, so row ``i`` depends on sample ``i`` only.

From these, per parameter ``name`` of the module, a kind gives

* :meth:`per_sample_grad`: the per-sample gradients ``g_i``, shape ``(B, *param.shape)`` (instantiation);
* :meth:`ghost_norm_sq`: ``||g_i||^2`` without forming ``g_i`` (only for names in :meth:`ghost_names`);
* :meth:`clipped_sum`: ``sum_i c_i g_i`` for per-sample factors ``c`` of shape ``(B,)`` -- by default from
  :meth:`per_sample_grad`, overridden by kinds that have a cheaper contraction (book-keeping).

Kinds first turn ``(activation, grad_output)`` into a kind-specific context with :meth:`prepare`, computed once per
recorded call and shared by all three operations.

Adding a layer type means writing one subclass in its own file under ``fastdp/layers/kinds/``, decorated with
:func:`fastdp.layers.register`; the file also declares the kind's :attr:`LayerKind.refusals`, its
:attr:`LayerKind.doc` row and its :meth:`LayerKind.oracle_cases` (:mod:`fastdp.layers.spec`). Nothing else lists
kinds: the package imports every file of that folder, and validate, the docs table and the oracle test read the
registry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from fastdp.layers import _factored, _rounding, batchdim
from fastdp.layers._factored import Factors
from fastdp.layers.spec import DocRow, OracleCase, Refusal
from fastdp.torch_api import ieee_float32

#: dtypes computed in float32 for norms and sums (mixed precision).
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype per-sample norms and clipped sums are computed in: at least float32."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocast regions active now, as ``((device_type, dtype), ...)``, to replay a forward call faithfully."""
    state = []
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            state.append((device_type, torch.get_autocast_dtype(device_type)))
    return tuple(state)


@contextlib.contextmanager
def replay_autocast(state: tuple[tuple[str, torch.dtype], ...]) -> Iterator[None]:
    """Re-enter the autocast regions recorded by :func:`autocast_state` (and no others)."""
    with contextlib.ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        for device_type, dtype in state:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        yield


@contextlib.contextmanager
def clipping_precision() -> Iterator[None]:
    """The numerics of the clipping stage: outside every active autocast region, and float32 products at full
    IEEE precision (:func:`fastdp.torch_api.ieee_float32`). A backward pass called inside ``torch.autocast``, or a
    user's TF32 / bf16 setting for float32 products (cuDNN convolutions use TF32 by default), would otherwise form
    the per-sample norms' Gram products and the contractions at about three significant digits: a norm
    underestimated by 0.1-0.4 % lets a clipped gradient exceed the threshold by as much."""
    with replay_autocast(()), ieee_float32():
        yield


def to_accumulation(t: torch.Tensor) -> torch.Tensor:
    """Cast a floating tensor to :func:`accumulation_dtype`; integer tensors (token ids) are never cast."""
    if t.is_floating_point() and t.dtype in _LOW_PRECISION:
        return t.float()
    return t


class LayerKind:
    """Per-sample gradient math for one family of modules (see the module docstring)."""

    #: module classes this kind handles; subclasses of them are accepted only if they keep the same ``forward``.
    module_types: ClassVar[tuple[type[nn.Module], ...]] = ()
    #: whether GhostClip's layer-local replay (``"ghost"`` mode) can recompute this kind's gradients.
    replayable: ClassVar[bool] = True
    #: whether every dimension of the input and output between the batch and the kind's own trailing dimensions is
    #: a position the math sums over (Linear, Embedding, LayerNorm, RMSNorm): then a call that sees the batch
    #: folded into dimension 0 (``k B`` rows, sample ``i`` owning rows ``i k .. i k + k - 1``, as
    #: ``x.reshape(-1, d)`` makes them) is the same call on ``(B, k, ...)``: the engine unflattens dimension 0 and
    #: the kind sees ``k`` more positions (:mod:`fastdp.layers.batchdim`, :meth:`unfold_rows`). Eval-mode
    #: BatchNorm is too (the same affine map at every row; its rows go behind the channel). Convolutions,
    #: GroupNorm and InstanceNorm are not: each row is convolved or normalised on its own.
    foldable: ClassVar[bool] = False
    #: qualified class names (``"package.module.Class"``) of optional packages' modules this kind handles.
    module_type_names: ClassVar[tuple[str, ...]] = ()
    #: configurations of (possibly wider) module types that cannot be trained privately; the only source of the
    #: refusal rules (:meth:`unsupported_reason`, :mod:`fastdp.validate`).
    refusals: ClassVar[tuple[Refusal, ...]] = ()
    #: the kind's row of the supported-layer table (docs/reference/layers.md).
    doc: ClassVar[DocRow | None] = None

    def oracle_cases(self) -> tuple[OracleCase, ...]:
        """Tiny configurations the tests run against the brute-force oracle in every clipping mode."""
        return ()

    def unsupported_reason(self, module: nn.Module) -> str | None:
        """Why this module's configuration cannot be trained privately (the first of :attr:`refusals` that fires,
        as ``"it <message>"``), or ``None`` if it can. Kinds declare rules rather than override this, so that
        :mod:`fastdp.validate` sees the same rules."""
        for rule in self.refusals:
            if rule.applies(module):
                return f"it {rule.message(module)}"
        return None

    def needs_activation(self, module: nn.Module, trainable: frozenset[str]) -> bool:
        """Whether the input must be kept to compute the gradients of the ``trainable`` parameter names."""
        return bool(trainable - {"bias"})

    def capture(self, module: nn.Module, args: tuple[Any, ...]) -> torch.Tensor:
        """The activation to keep from the forward call ``module(*args)`` (detached, never cast)."""
        x = args[0]
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{type(module).__name__} got a non-tensor input of type {type(x).__name__}")
        return x.detach()

    def batch_size(self, activation: torch.Tensor | None, grad_output: torch.Tensor) -> int:
        """The per-sample dimension of a recorded call."""
        return grad_output.shape[0]

    def unfold_rows(self, t: torch.Tensor, fold: int) -> torch.Tensor:
        """A :attr:`foldable` call's kept input or output gradient, ``(k B, ...)`` as the module saw it, in the layout
        :meth:`prepare` reads (``fold`` is ``k``; 1: unchanged). Default ``(B, k, ...)``: the ``k`` rows of a sample
        become a position dimension after the batch (:func:`fastdp.layers.batchdim.unfold_rows`), where kinds whose
        trailing dimensions are the parameter's sum over it."""
        return batchdim.unfold_rows(t, fold)

    def fold_rows(self, t: torch.Tensor, fold: int) -> torch.Tensor:
        """The inverse of :meth:`unfold_rows`: a kept tensor back in the ``(k B, ...)`` layout the module saw (a
        replay calls the module on it)."""
        return t.flatten(0, 1) if fold > 1 else t

    def prepare(self, module: nn.Module, activation: torch.Tensor | None, grad_output: torch.Tensor) -> Any:
        """Kind-specific canonical form of a recorded call, shared by the operations below."""
        raise NotImplementedError

    def reduce_without_activation(self, module: nn.Module, grad_output: torch.Tensor) -> torch.Tensor:
        """Shrink an output gradient as it arrives when no activation was kept (bias-only training, DP-BiTFiT):
        sum it over positions, keeping the dimensions, so the engine holds ``B x p`` instead of ``B x T x p`` until
        the backward pass ends. :meth:`prepare` must accept the result. It runs outside :func:`clipping_precision`
        (in the backward pass's own autocast and precision settings), so it may sum but not multiply: no products,
        which those settings would round. Default: unchanged."""
        return grad_output

    def ghost_names(self, module: nn.Module) -> frozenset[str]:
        """Parameter names that have a ghost norm."""
        return frozenset()

    def prefers_ghost(self, module: nn.Module, ctx: Any, name: str) -> bool:
        """Cost model: ``True`` when the ghost norm is cheaper than instantiating (2 T^2 < p d)."""
        return False

    def instantiation_fits(self, module: nn.Module, ctx: Any, name: str, readers: int = 1) -> bool:
        """Whether the per-sample gradients of ``name`` take no more memory than what book-keeping keeps of this call
        anyway (its input and output gradient; an input read by ``readers`` recorded calls is kept once for all of
        them, so each call's share is ``1 / readers`` of it). The default mode then instantiates them as soon as the
        output gradient arrives and drops the kept tensors, which costs no memory and saves the ghost norm's time.
        Default: ``False`` (only :meth:`prefers_ghost` decides)."""
        return False

    def ghost_norm_sq(self, module: nn.Module, ctx: Any, name: str) -> torch.Tensor:
        """``||g_i||^2`` for each sample, shape ``(B,)``, without forming ``g_i``: :meth:`ghost_norm_parts` guarded
        where rounding rules it (:func:`fastdp.layers._rounding.guarded_sq`; the clipping stage takes the flagged
        samples apart where that costs no host synchronisation, :func:`fastdp.layers._rounding.exact_flagged`)."""
        return _rounding.guarded_sq(*self.ghost_norm_parts(module, ctx, name))

    def contraction_positions(self, module: nn.Module, ctx: Any, name: str) -> int:
        """How many terms of each sample the clipped sum of ``name`` adds (a ghost norm's positions ``T``): its
        rounding grows with them (:func:`fastdp.layers._rounding.with_contraction`). Kinds with :meth:`ghost_names`
        implement it."""
        raise NotImplementedError

    def sample_factors(self, module: nn.Module, ctx: Any, name: str, index: torch.Tensor) -> list[Factors] | None:
        """:meth:`factors` of the samples ``index`` ``(k,)`` only, as the one-use list
        :func:`fastdp.layers._rounding.exact_flagged` takes (``None``: no factored form). Kinds whose :meth:`factors`
        builds something for the whole batch (a convolution's patches) override it to build only these samples'."""
        f = self.factors(module, ctx, name)
        return None if f is None or f.right is None or f.left is None else [_factored.select(f, index)]

    def ghost_norm_parts(self, module: nn.Module, ctx: Any, name: str
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sq, err, bound_sq)``, ``(B,)`` each: the ghost norm as its Gram matrices give it, a bound of its
        rounding (:func:`fastdp.layers._rounding.gram_rounding`) and the square of the triangle bound ``sum_t ||l_t||
        ||r_t||`` of ``||g_i||``. Kinds with :meth:`ghost_names` implement it."""
        raise NotImplementedError

    def ghost_norm_pieces(self, module: nn.Module, ctx: Any, name: str) -> Any:
        """:meth:`ghost_norm_parts`, or, where the kind has them, the reductions its element-wise rest needs
        (:class:`fastdp.layers._rounding.SymmetricReductions`), which the clipping stage finishes together with
        other parameters' (:mod:`fastdp.layers._guard_batch`). This default: :meth:`ghost_norm_parts`."""
        return self.ghost_norm_parts(module, ctx, name)

    def factors(self, module: nn.Module, ctx: Any, name: str) -> Factors | None:
        """``g_i`` as a sum of outer products (:class:`fastdp.layers._factored.Factors`), or ``None``.

        Used for parameters shared by several calls: the cross terms ``<g_i^u, g_i^v>`` of their norm then have a
        ghost form. Kinds without one fall back to instantiating :meth:`per_sample_grad`.
        """
        return None

    def guard_contracted(self, module: nn.Module, ctx: Any, name: str, sq: torch.Tensor) -> torch.Tensor:
        """``sq`` ``(B,)``, the squared norms of instantiated per-sample gradients of ``name``, made safe for a clipped
        sum that contracts the operands instead of summing those gradients (``BK-MixGhostClip``'s instantiated
        layers): infinite for a sample whose operands leave the range the clipping stage can bound
        (:func:`fastdp.layers._rounding.beyond_norm_range`: a ghost norm's Gram would overflow there), and at least
        ``2^12 u`` times the triangle bound where the gradient cancels so far that the contraction's rounding may
        exceed it (:func:`fastdp.layers._rounding.guarded_instantiated_sq`). This default: ``sq`` as it is (a kind whose
        clipped sum is ``sum_i coef_i g_i`` of :meth:`per_sample_grad` itself, exact to rounding at any magnitude)."""
        return sq

    def per_sample_grad(self, module: nn.Module, ctx: Any, name: str) -> torch.Tensor:
        """Per-sample gradients ``g_i`` of parameter ``name``, shape ``(B, *param.shape)``."""
        raise NotImplementedError

    def clipped_sum(self, module: nn.Module, ctx: Any, name: str, coef: torch.Tensor) -> torch.Tensor:
        """``sum_i coef_i g_i``, shape ``param.shape``; ``coef`` has shape ``(B,)``."""
        psg = self.per_sample_grad(module, ctx, name)
        return torch.einsum("b,b...->...", coef.to(psg.dtype), psg)
