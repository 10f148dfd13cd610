"""Every torch API fastdp relies on that is private or outside torch's compatibility promise, one function each.

A torch upgrade that changes one of them breaks here, in one place. Each was tested with torch 2.14.1 (the version
``.ci/run`` pins); the comment on each says why a public API does not serve.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode as _TorchFunctionMode
from torch.utils import _pytree

#: Base class of the torch-function modes of the broadcast-expansion check (:mod:`fastdp.layers.expand`) and the
#: structure probe's deterministic dropout (:mod:`fastdp.probe`). Documented in ``torch.overrides`` but marked
#: experimental; its dispatch order under ``torch.compile`` is not promised.
TorchFunctionMode = _TorchFunctionMode


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (``None``: not a view). An in-place write into a view writes into it.

    Semi-private (``Tensor._base``): torch documents views but has no public accessor for a view's base.
    """
    return t._base


def grad_hooks(t: torch.Tensor) -> list[Callable[..., Any]]:
    """The functions registered on ``t`` by ``Tensor.register_hook`` (they change its gradient in a plain backward
    pass; the engine computes a trainable parameter's gradient itself, so they do not run on it).

    Private (``Tensor._backward_hooks``): torch has no public query for a tensor's hooks.
    """
    hooks = getattr(t, "_backward_hooks", None)
    return list(hooks.values()) if hooks else []


def current_graph_task_id() -> int:
    """The autograd engine's id of the backward pass running on this thread, ``-1`` outside one.

    Private (``torch._C``): there is no public "am I inside a backward pass" query.
    """
    return torch._C._current_graph_task_id()


def pass_accumulates(leaf_node: Any) -> bool:
    """Inside a backward pass: whether it will run ``leaf_node`` (a leaf's ``AccumulateGrad`` node in its graph), i.e.
    whether it accumulates into leaves' ``.grad``: ``loss.backward()`` does; ``torch.autograd.grad(loss, x)`` and
    ``loss.backward(inputs=[x])`` run only what reaches ``x``.

    Private (``torch._C._will_engine_execute_node``): torch has no public query for what a pass computes.
    """
    try:
        return bool(torch._C._will_engine_execute_node(leaf_node))
    except RuntimeError:  # (torch refuses some leaves during autograd.grad: such a pass does not accumulate)
        return False


def grad_accumulator(leaf: torch.Tensor) -> Any:
    """The ``AccumulateGrad`` node of a leaf tensor that requires grad (the one graphs built on it use while the
    returned node is alive). Call with autograd on."""
    return leaf.view_as(leaf).grad_fn.next_functions[0][0]


def queue_engine_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass in progress completes (dropped if the pass raises).

    Private (the execution engine's callback queue): no public hook fires once at the end of a whole backward pass
    whose reached tensors are not known in advance (see :mod:`fastdp.session`).
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def torch_function_subclasses_off() -> Any:
    """A context in which torch functions treat tensor subclasses as plain tensors (no ``__torch_function__``
    dispatch to them): the loss trace (:mod:`fastdp.loss_trace`) runs each function on its traced arguments so.

    Private (``torch._C``): it is what ``torch.Tensor.__torch_function__`` itself uses; no public API disables the
    dispatch for subclasses only.
    """
    return torch._C.DisableTorchFunctionSubclass()


def run_by_torch_compile() -> bool:
    """Whether the calling code runs under ``torch.compile``: traced by Dynamo, or run eagerly by Dynamo's fallback
    after a graph break (a frame of ``torch/_dynamo/eval_frame.py`` on the Python stack).

    ``torch.compiler.is_compiling()`` is public but true only while Dynamo traces; after a graph break Dynamo runs
    the rest of the frame eagerly, where it reads false. The stack walk (``sys._getframe``, CPython) is the part
    outside torch's promise.
    """
    if torch.compiler.is_compiling():
        return True
    import sys

    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.replace("\\", "/").endswith("torch/_dynamo/eval_frame.py"):
            return True
        f = f.f_back
    return False


#: the backends whose float32 matrix products, convolutions and RNNs may run at reduced precision
#: (``torch.backends.<backend>.<op>.fp32_precision``: ``"tf32"``, ``"bf16"``; cuDNN convolutions default to TF32)
_FP32_PRECISION_BACKENDS = (("cuda", "matmul"), ("cudnn", "conv"), ("cudnn", "rnn"), ("mkldnn", "matmul"),
                            ("mkldnn", "conv"), ("mkldnn", "rnn"))


@functools.cache
def _fp32_precision_targets() -> tuple[Any, ...]:
    """The ``torch.backends.<backend>.<op>`` objects that have an ``fp32_precision`` setting (torch >= 2.9); the
    same objects for the life of the process, so looked up once (the lookup was 40 % of :func:`ieee_float32`'s
    cost, which the backward pass pays once per hooked module)."""
    out = []
    for backend, op in _FP32_PRECISION_BACKENDS:
        target = getattr(getattr(torch.backends, backend, None), op, None)
        if target is not None and hasattr(target, "fp32_precision"):
            out.append(target)
    return tuple(out)


def _legacy_setting(read: Callable[[], Any], untouched: Any) -> Any:
    """A legacy TF32 setting (``torch.get_float32_matmul_precision()``, ``torch.backends.cudnn.allow_tf32``).
    torch >= 2.9 refuses to read one once the new ``fp32_precision`` settings disagree with it ("a mix of the
    legacy and new APIs"): the user then set only the new ones, so the legacy one still holds its default."""
    try:
        return read()
    except RuntimeError:
        return untouched


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """Inside, float32 matrix products, convolutions and RNNs run at full IEEE precision on every backend, whatever
    the user set (TF32 on CUDA, bf16 or TF32 in oneDNN on CPU); the settings are restored on exit.

    torch keeps two sets of settings: the legacy ones (``torch.set_float32_matmul_precision``,
    ``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``) and, from torch 2.9, the
    ``fp32_precision`` ones, and it raises ("a mix of the legacy and new APIs") when it consults a legacy one that
    disagrees with the new one, which cuBLAS does for every float32 product on CUDA. Both are therefore set, to
    agree (legacy: ``"highest"`` and no cuDNN TF32; new: ``"ieee"`` everywhere), and both are restored: the legacy
    ones first (their setters also write the new ones), then the new ones exactly as they were. The settings are
    process-wide, so another thread's products inside the block run at IEEE precision too (slower, never less
    exact).
    """
    targets = _fp32_precision_targets()
    saved_new = [(t, t.fp32_precision) for t in targets]
    saved_matmul = _legacy_setting(torch.get_float32_matmul_precision, "highest")
    saved_cudnn = _legacy_setting(lambda: torch.backends.cudnn.allow_tf32, True)
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    for t, _ in saved_new:
        t.fp32_precision = "ieee"
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved_matmul)
        torch.backends.cudnn.allow_tf32 = saved_cudnn
        for t, value in saved_new:
            t.fp32_precision = value


def bf16_matmul_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two bfloat16 matrices ``(n, k) @ (k, m)`` or batches ``(N, n, k) @ (N, k, m)`` as float32: each
    product of two bfloat16 numbers is exact in float32, and the sums are accumulated and returned in float32.

    On CUDA the ATen overloads ``aten::mm.dtype`` / ``aten::bmm.dtype`` (outside the documented API: bfloat16 inputs,
    float32 output, one tensor-core product), with cuBLAS's reduced-precision bfloat16 reductions switched off for
    the call. Elsewhere, or where torch has no such overload: both operands cast to float32 and multiplied there,
    which gives the same exact products at float32's rate.
    """
    if a.dim() not in (2, 3) or a.dim() != b.dim():
        raise ValueError(f"bf16_matmul_float32 takes two matrices or two batches, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    op = getattr(torch.ops.aten.mm if a.dim() == 2 else torch.ops.aten.bmm, "dtype", None)
    if a.device.type != "cuda" or op is None:
        return torch.matmul(a.float(), b.float())
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        return op(a.to(torch.bfloat16), b.to(torch.bfloat16), torch.float32)
    finally:
        matmul.allow_bf16_reduced_precision_reduction = saved


def foreach_add_(tensors: list[torch.Tensor], others: list[torch.Tensor], alpha: float) -> None:
    """``t += alpha * o`` for each pair, in place, by one fused call where torch has one (``torch._foreach_add_``,
    outside the documented API: on CUDA a few kernels for the whole list instead of one per tensor)."""
    torch._foreach_add_(tensors, others, alpha=alpha)


def grad_scaler_scale(scaler: Any) -> torch.Tensor | float:
    """A ``torch.amp.GradScaler``'s current scale ``S`` without a host read where it can be had: its scale tensor
    (the private ``_scale``, a ``(1,)`` float32 tensor on the device once ``scale()`` has run) as a 0-dim float64
    tensor; otherwise ``get_scale()`` (a Python float: 1 when the scaler is disabled, its initial scale before the
    first ``scale()``), which on an accelerator reads the tensor on the host."""
    scale = getattr(scaler, "_scale", None)
    if scaler.is_enabled() and isinstance(scale, torch.Tensor) and scale.numel() == 1:
        return scale.reshape(()).to(torch.float64)
    return float(scaler.get_scale())


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """Leaves and spec of a nested structure of tensors (``torch.utils._pytree``, private but stable since 2.0);
    it knows torch's own containers and Hugging Face ``ModelOutput`` s, which a hand-written walk would not."""
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    """Inverse of :func:`tree_flatten`."""
    return _pytree.tree_unflatten(leaves, spec)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` applied to every leaf of ``tree`` (see :func:`tree_flatten`)."""
    return _pytree.tree_map(fn, tree)


@functools.lru_cache(maxsize=1)
def intra_op_threads_per_thread() -> bool:
    """Whether ``torch.set_num_threads`` acts on the calling thread only: torch's CPU parallel backend is OpenMP,
    whose thread count is a per-thread setting (torch's native pool is shared by every thread). Read from
    ``torch.__config__.parallel_info()``, whose text names the backend."""
    return "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()


def is_batchnorm(module: nn.Module) -> bool:
    """Whether ``module`` is a BatchNorm of any dimension (their common base ``_BatchNorm`` is private)."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


#: the private common base of BatchNorm1d/2d/3d (for ``isinstance`` checks and type hints)
BatchNormBase = nn.modules.batchnorm._BatchNorm


def _row_major(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def dense_layout(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """``t``, or a contiguous copy where its strides are not exactly a contiguous tensor's of its shape (nor, with
    ``channels_last`` and 4 dimensions, a channels-last one's).

    torch 2.14.1's CPU batch-norm kernels give silently wrong gradients (input, weight and bias, off by 1-15 times
    their norm) when the input or the output gradient is dense but a size-1 dimension carries another stride than its
    contiguous or channels-last one: torch's contiguity rule ignores those strides, the kernel does not. A batch of
    one, or an axis of one pixel, reached through a view does it: XCiT's and LeViT's patch embeddings (``x.flatten(2)
    .transpose(1, 2)`` after a BatchNorm) at batch size 1 gave stem gradients 1.3-2.3 times the batch's off, and the
    brute-force batch-of-one oracle (and the engine's structure probe) with them. InstanceNorm runs on the same
    kernels over a reshaped input and needs the contiguous layout exactly. No public API says which layouts the
    kernel reads correctly; found by trying every dense layout of small shapes (tests/layers/test_norm_strides.py)."""
    shape, strides = t.shape, t.stride()
    if strides == _row_major(shape):
        return t
    if channels_last and t.dim() == 4:
        n, c, h, w = shape
        if strides == (h * w * c, 1, w * c, c):
            return t
    return t.clone(memory_format=torch.contiguous_format)


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``) is running: its wrapped tensors have no strides to
    read and take no tensor hooks. (``torch._C._are_functorch_transforms_active`` is private; no public query.)"""
    return bool(torch._C._are_functorch_transforms_active())


#: device types whose batch-norm kernels get :func:`dense_layout` operands from :func:`batch_norm_layout_hooks` (read
#: at each call; the CUDA kernels were not seen to misread a layout, and were not checked)
DENSE_LAYOUT_DEVICES = frozenset({"cpu"})


def batch_norm_layout_hooks(root: nn.Module) -> list[Any]:
    """Forward hooks on every BatchNorm and InstanceNorm module under ``root`` that hand its CPU kernels the layouts
    they read correctly (:func:`dense_layout`): the input in a forward pre-hook, the output gradient in a hook on the
    output. A copy only where the layout is one the kernel misreads, and only on :data:`DENSE_LAYOUT_DEVICES`.
    Returns the hook handles."""
    handles = []
    for module in root.modules():
        if isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)):
            cl = isinstance(module, nn.modules.batchnorm._BatchNorm)
            handles.append(module.register_forward_pre_hook(functools.partial(_dense_input, cl)))
            handles.append(module.register_forward_hook(functools.partial(_dense_grad_output, cl)))
    return handles


def _dense_input(channels_last: bool, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.device.type not in DENSE_LAYOUT_DEVICES or functorch_active():
        return None
    dense = dense_layout(x, channels_last)
    return None if dense is x else (dense, *args[1:])


def _dense_grad_output(channels_last: bool, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
    if (isinstance(out, torch.Tensor) and out.requires_grad and out.device.type in DENSE_LAYOUT_DEVICES
            and not functorch_active()):
        out.register_hook(functools.partial(dense_layout, channels_last=channels_last))


def set_parameter_slot(module: nn.Module, name: str, value: Any) -> None:
    """Put ``value`` (a parameter or, during a verified expansion, a plain tensor) in ``module``'s own parameter
    slot ``name`` without ``register_parameter``'s checks: the expansion must put a non-leaf tensor where the module's
    forward reads its parameter, and restore the parameter object afterwards (``module._parameters`` is private)."""
    module._parameters[name] = value


def set_requires_grad(param: torch.Tensor, flag: bool) -> None:
    """Ghost differentiation toggles ``requires_grad`` of a layer's parameters in its forward pre-hook and restores it
    in its forward hook. Public API, but relied upon in an undocumented way: autograd records no edge to a tensor
    that does not require grad *when the op runs*, and a later toggle does not change the recorded graph."""
    param.requires_grad_(flag)


def fsdp_params(module: nn.Module) -> list[Any]:
    """The ``FSDPParam`` s that ``fully_shard(module)`` manages (empty if it manages none).

    Private (FSDP2's state and parameter group): FSDP2 has no public map from a sharded parameter to the unsharded
    parameter that the module's forward actually reads. fastdp needs it for ghost differentiation, which must turn
    off ``requires_grad`` of the tensor the forward uses (:mod:`fastdp.sharding`).
    """
    group = module._get_fsdp_state()._fsdp_param_group
    return [] if group is None else list(group.fsdp_params)


def fsdp_unsharded_param(fsdp_param: Any) -> nn.Parameter | None:
    """The unsharded parameter of an ``FSDPParam`` (the tensor its module's forward reads between FSDP's all-gather
    and reshard), or ``None`` before its first all-gather.

    Private (``FSDPParam._unsharded_param``): created once at the first all-gather and reused afterwards (its storage
    is freed and refilled); see :func:`fsdp_params`.
    """
    return getattr(fsdp_param, "_unsharded_param", None)


def group_norm_affine_grads(x: torch.Tensor, grad_out: torch.Tensor, groups: int,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_s grad_out * x_hat, sum_s grad_out)`` per channel of a group norm: each of shape ``(C,)`` for
    ``x``, ``grad_out`` of shape ``(1, C, HxW)`` with ``groups`` groups of consecutive channels, ``x_hat`` the
    input normalised per group (no affine). These are torch's own weight and bias gradients of
    ``F.group_norm`` for a batch of one; :class:`fastdp.layers.kinds.groupnorm.GroupNormKind` gets per-sample ones
    by folding the batch into the channels.

    ATen ops outside the documented API (``torch.native_group_norm``, ``aten::native_group_norm_backward``): the
    public ``F.group_norm`` gives no statistics, and its autograd gradient is summed over the batch. Both read ``x``
    and ``grad_out`` in one fused pass each, where recomputing ``x_hat`` and reducing ``grad_out * x_hat`` writes two
    tensors of the input's size.
    """
    _, C, hw = x.shape
    # contiguous: off the CPU both kernels refuse another layout (a (1, B C, S) view of a sliced input can be one)
    x, grad_out = x.contiguous(), grad_out.contiguous()
    _, mean, rstd = torch.native_group_norm(x, None, None, 1, C, hw, groups, eps)
    # a weight of ones: the weight and bias gradients do not depend on it, and torch allocates them like the weight
    # (``empty_like(gamma)``), which off the CPU fails for none ("tensor does not have a device", CUDA, torch 2.11)
    ones = torch.ones(C, dtype=x.dtype, device=x.device)
    _, weight_grad, bias_grad = torch.ops.aten.native_group_norm_backward(
        grad_out, x, mean, rstd, ones, 1, C, hw, groups, [False, True, True])
    return weight_grad, bias_grad


__all__ = ["BatchNormBase", "TorchFunctionMode", "bf16_matmul_float32", "current_graph_task_id", "foreach_add_",
           "fsdp_params", "fsdp_unsharded_param", "grad_accumulator", "grad_hooks", "group_norm_affine_grads",
           "ieee_float32", "is_batchnorm", "pass_accumulates", "queue_engine_callback", "set_parameter_slot",
           "set_requires_grad", "tree_flatten", "tree_map", "tree_unflatten", "view_base"]
