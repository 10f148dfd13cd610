"""The exact generic path: per-sample gradients of any module's parameters through ``torch.func``.

Parameters that no layer kind covers -- raw ``nn.Parameter`` s such as a ViT's class token and position embedding,
``nn.MultiheadAttention``'s ``in_proj_weight``, a custom module's scale, a T5 relative attention bias -- are
handled at the module that owns them (the *owner*). The engine keeps the owner's inputs (positional and keyword)
and the gradients that reach its outputs in the backward pass; after the backward pass this kind replays the
owner per sample::

    g_i = vjp( theta -> owner(theta, x_i), theta )( G_i )         (vmap over i, a batch of one each)

with ``x_i`` sample ``i``'s inputs (batch dimension kept, of size 1; inputs without the batch dimension are shared)
and ``G_i`` the gradients that reached sample ``i``'s outputs. ``theta`` are only the owner's generic parameters;
everything else in the owner is a constant, so the cost is about one extra forward and backward of the owner.

Exactness is checked, not assumed: the replayed outputs must equal the outputs of the real forward pass, or the
step fails with an error naming the owner. That catches randomness (dropout) in the owner's forward, modules that
mix samples, and inputs mistaken for batched ones. Dropout inside an owner is replayed from the generators' state
at the real call (vmap's ``randomness="different"`` draws the same masks when the layout is the batch's); where the
masks differ, the output check refuses the step.

Outputs of size 1 along the batch dimension (a position embedding computed once and broadcast over the batch) are
expanded to the batch size in the real forward pass, so their gradients arrive per sample.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from fastdp import deferred
from fastdp.layers import registry
from fastdp.layers.base import LayerKind, replay_autocast, to_accumulation
from fastdp.layers.checkpointing import plain_checkpoints
from fastdp.layers.owners import parametrizations_frozen
from fastdp.layers.spec import DocRow, OracleCase, Refusal
from fastdp.torch_api import tree_flatten, tree_map

logger = logging.getLogger(__name__)

#: relative tolerance of the replay check per dtype (vmap may reorder floating-point sums).
_REPLAY_RTOL = {torch.float64: 1e-7, torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}


def subtree_owner(module: nn.Module) -> tuple[str, ...] | None:
    """Parameter paths (relative to ``module``) that ``module`` owns although they live in its submodules, because
    its forward uses them without calling the submodule (``None`` if there are none).

    * ``nn.MultiheadAttention`` reads ``out_proj.weight`` / ``out_proj.bias`` directly in
      ``F.multi_head_attention_forward``: it owns its whole subtree.
    * T5-style attention (``has_relative_attention_bias`` and a ``relative_attention_bias`` embedding): the bias
      embedding's input, a matrix of relative positions, has no batch dimension; the attention module is the
      smallest owner whose inputs are per sample.
    """
    if isinstance(module, nn.MultiheadAttention):
        return tuple(n for n, _ in module.named_parameters())
    rel = getattr(module, "relative_attention_bias", None)
    if isinstance(rel, nn.Embedding) and getattr(module, "has_relative_attention_bias", False):
        return tuple(f"relative_attention_bias.{n}" for n, _ in rel.named_parameters())
    return None


def unsupported_reason(module: nn.Module) -> str | None:
    """Why the generic path cannot own ``module``'s parameters, or ``None``: the first rule of the whole registry
    (:func:`fastdp.layers.registry.refusals`, the kinds' and :attr:`GenericKind.refusals`) that applies to it."""
    return registry.unsupported_reason(module)


def _batch_first(module: nn.Module) -> bool | None:
    """``batch_first`` of the module, or of its ``self_attn`` (Transformer layers keep it there); None if unknown."""
    for m in (module, getattr(module, "self_attn", None)):
        value = getattr(m, "batch_first", None) if m is not None else None
        if isinstance(value, bool):
            return value
    return None


def output_batch_dims(module: nn.Module, leaves: list[Any]) -> list[int | None] | None:
    """The batch dimension of each output leaf that ``module`` declares, or ``None`` (the leading-size rule).

    ``nn.RNNBase`` (``batch_first=True``): ``output`` ``(B, T, dirs*H)`` has it first; the final states ``h_n`` (and
    ``c_n``) ``(num_layers*dirs, B, H)`` second -- a leading size equal to ``B`` there is the number of layers."""
    if (isinstance(module, nn.RNNBase) and module.batch_first and len(leaves) in (2, 3)
            and all(isinstance(x, torch.Tensor) for x in leaves) and leaves[0].dim() == 3
            and all(x.dim() == 3 for x in leaves[1:])):
        return [0] + [1] * (len(leaves) - 1)
    return None


def _rnn_state_dims(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], in_dims: tuple[Any, Any],
                    batch: int) -> tuple[Any, Any]:
    """An RNN's initial state ``hx`` ``(num_layers*dirs, B, H)`` (or LSTM's ``(h_0, c_0)``) has its batch dimension
    second: mark it 1 (batched) or None (shared, size 1 there) instead of by its leading size."""
    def dim(x: Any) -> int | None:
        return 1 if isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] == batch else None

    arg_dims, kwarg_dims = in_dims
    if len(args) > 1:
        arg_dims = (arg_dims[0], tree_map(dim, args[1]), *arg_dims[2:])
    if "hx" in kwargs:
        kwarg_dims = {**kwarg_dims, "hx": tree_map(dim, kwargs["hx"])}
    return arg_dims, kwarg_dims


def is_broadcast(t: torch.Tensor, batch: int) -> bool:
    """Whether ``t`` is taken as one value for the whole batch: leading size 1 and ``batch > 1``, whatever its other
    sizes (sizes never decide: a coincidence such as ``T == B`` is a new input signature, which the structure probe,
    :mod:`fastdp.probe`, verifies; an RNN's ``(layers, B, H)`` state is excluded by the engine's generic hook)."""
    return batch > 1 and t.dim() >= 1 and t.shape[0] == 1


@dataclass(eq=False)
class GenericCall:
    """What the engine keeps from one forward call of an owner (the record's ``activation``)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    in_dims: tuple[Any, Any]  # pytree of 0 (batched input) / None (shared) matching (args, kwargs)
    batch: int
    leaf_index: list[int]  # hooked output leaves (indices into the flattened output)
    outputs: list[torch.Tensor]  # their values in the real forward pass (detached, expanded to the batch)
    names: tuple[str, ...] = ()  # the owner's generic parameters (paths relative to the owner)
    label: str = ""  # the owner's name in the model, for errors
    grads: list[torch.Tensor | None] = field(default_factory=list)  # filled by the backward pass
    autocast: tuple[tuple[str, torch.dtype], ...] = ()
    rng: Any = None  # (device, CPU generator state, CUDA generator state or None) at the start of the call
    #: names whose per-sample gradients arrive in ``grads`` directly (verified expansion, fastdp.layers.expand):
    #: ``grads[k]`` is the ``(B, *rest)`` gradient of ``expanded[k]``'s expansion; nothing is replayed
    expanded: tuple[str, ...] = ()
    #: batch dimension of each hooked output (0 unless the owner declares another, see output_batch_dims)
    out_dims: list[int] = field(default_factory=list)
    #: the owner's call count in the model's forward pass (``k``: its ``k``-th call), keys its learned layout
    call_index: int = -1
    #: rows per sample when the call saw the batch folded into dimension 0 (:func:`fastdp.layers.batchdim.fold_factor`):
    #: its hooked outputs have ``fold * batch`` rows, and so may its inputs (``in_fold``: inputs of ``in_fold * batch``
    #: rows; an owner that pools each sample's folded rows into one has ``fold = 1``); each sample is replayed on its
    #: rows (inputs of leading size ``batch`` on their one row)
    fold: int = 1
    in_fold: int = 1


def rng_state(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The default generators' states now (CPU, and the CUDA device of the first CUDA input if any)."""
    device = next((x.device for x in tree_flatten((args, kwargs))[0]
                   if isinstance(x, torch.Tensor) and x.device.type == "cuda"), None)
    return (device, torch.get_rng_state(), torch.cuda.get_rng_state(device) if device is not None else None)


@contextlib.contextmanager
def replayed_rng(state: Any) -> Iterator[None]:
    """Run with the generators as they were at the start of the real call; restore them afterwards."""
    if state is None:
        yield
        return
    device, cpu, cuda = state
    with torch.random.fork_rng(devices=[device] if device is not None else [], device_type="cuda"):
        torch.set_rng_state(cpu)
        if device is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


def capture_inputs(args: tuple[Any, ...], kwargs: dict[str, Any], batch: int, module: nn.Module | None = None,
                   shared: frozenset[int] | tuple[int, ...] = (), fold: int = 1) -> tuple[Any, Any, tuple[Any, Any]]:
    """Detach the tensors of a forward call and mark which are batched (leading dimension ``batch``, or
    ``fold * batch`` in a folded call; an RNN's initial state: second dimension). ``shared``: flat indices
    (``tree_flatten((args, kwargs))``) of tensors known to be shared by the batch whatever their leading size
    (learned by the structure probe, :mod:`fastdp.layers.layout`)."""
    def detach(x: Any) -> Any:
        return x.detach() if isinstance(x, torch.Tensor) else x

    args_d, kwargs_d = tree_map(detach, (tuple(args), dict(kwargs)))
    flat, spec = tree_flatten((args_d, kwargs_d))
    rows = {batch, batch * fold}
    dims = spec.unflatten([0 if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] in rows
                           and j not in shared else None for j, x in enumerate(flat)])
    if isinstance(module, nn.RNNBase):
        dims = _rnn_state_dims(module, args_d, kwargs_d, dims, batch)
    return args_d, kwargs_d, dims


class GenericKind(LayerKind):
    """Per-sample gradients of an owner's parameters by a vmapped per-sample replay (see the module docstring).

    Not registered (it handles what no registered kind does), but it declares refusals, a docs row and oracle cases
    as the kinds do."""

    replayable = False  # GhostClip's layer-local replay does not apply; the kind keeps its per-sample gradients
    refusals = (
        Refusal((nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.RNNBase),
                lambda m: _batch_first(m) is False,
                lambda m: "has batch_first=False: its tensors are (T, B, ...) while fastdp takes dimension 0 as the "
                          "batch, so layers that see them would treat time steps as samples. Fix: construct it with "
                          "batch_first=True and feed (B, T, ...) tensors", covers_subtree=True, frozen_too=False,
                example=lambda: nn.MultiheadAttention(4, 2),
                summary="`batch_first=False` (`nn.MultiheadAttention`, `nn.RNN`/`LSTM`/`GRU`, `nn.Transformer*Layer`)"),
    )
    doc = DocRow(
        "anything else (raw `nn.Parameter`s, `nn.MultiheadAttention`, HF `LlamaRMSNorm`/`T5LayerNorm`, `nn.PReLU`, "
        "`nn.LSTM`, custom modules)", "any", "instantiated by the [generic path](../internals/generic-path.md)",
        "exact; costs about one extra forward and backward of the owning module. Every kind's refusal rule applies "
        "here too (`nn.EmbeddingBag` with `max_norm`).")

    def oracle_cases(self) -> tuple[OracleCase, ...]:
        return (OracleCase("PReLU, C = B", lambda: nn.PReLU(3, init=0.1), (3, 2)),
                OracleCase("LSTM, T = B", lambda: nn.LSTM(2, 2, batch_first=True), (3, 2)),
                OracleCase("EmbeddingBag", lambda: nn.EmbeddingBag(5, 2, mode="sum"), (3,), vocab=5))

    def batch_size(self, activation: Any, grad_output: torch.Tensor | None) -> int:
        return activation.batch

    def prepare(self, module: nn.Module, activation: Any, grad_output: Any) -> dict[str, torch.Tensor]:
        call: GenericCall = activation
        names_l, label = sorted(call.names), repr(call.label)
        B = call.batch
        if call.expanded:
            return _expanded_grads(module, call)
        primals = {n: module.get_parameter(n).detach() for n in names_l}
        if B == 0:
            return {n: to_accumulation(p.new_zeros(0, *p.shape)) for n, p in primals.items()}
        out_dims = call.out_dims or [0] * len(call.outputs)
        # per-sample cotangents: batch dimension d moved first, a batch of one kept at d: (B, ..., 1 at d, ...)
        # (a folded call: (k B, ...) tensors as (B, k, ...), each sample replayed on its k rows)
        cots = tuple(_per_sample((g if g is not None else torch.zeros_like(o)).to(o.dtype), d, call.fold)
                     for g, o, d in zip(call.grads, call.outputs, out_dims, strict=True))
        arg_dims, kwarg_dims = call.in_dims
        args_b, kwargs_b = tree_map(lambda x: x, (call.args, call.kwargs))
        args_b = _unsqueeze_batched(args_b, arg_dims, B, call.in_fold)
        kwargs_b = _unsqueeze_batched(kwargs_b, kwarg_dims, B, call.in_fold)
        leaf_index = call.leaf_index
        aliases = slot_aliases(module, names_l)

        def one(args_i: tuple[Any, ...], kwargs_i: dict[str, Any], cot_i: tuple[torch.Tensor, ...]) -> Any:
            def f(theta: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
                every = {a: t for n, t in theta.items() for a in aliases[n]}
                leaves = tree_flatten(functional_call(module, every, args_i, kwargs_i, tie_weights=False))[0]
                return tuple(leaves[j] for j in leaf_index)

            outs, pullback = vjp(f, primals)
            return pullback(cot_i)[0], outs

        with (torch.no_grad(), replay_autocast(call.autocast), warnings.catch_warnings(),
              parametrizations_frozen(module), plain_checkpoints()):
            warnings.filterwarnings("ignore", message=".*performance drop.*")  # functorch's batching fallbacks
            try:
                # Random operations (dropout) draw from the generators as they were at the real call; vmap's
                # "different" randomness then reproduces the batch's masks when the layout matches, and the
                # output check below refuses the step when it does not.
                with replayed_rng(call.rng):
                    grads, outs = vmap(one, in_dims=(arg_dims, kwarg_dims, 0), randomness="different")(
                        args_b, kwargs_b, cots)
            except RuntimeError as e:
                # An operation without a vmap batching rule that fails batched: one sample at a time instead
                # (random operations then cannot reproduce the batch's draws: the output check refuses them).
                logger.info("module %s (%s): vmap failed (%s); replaying one sample at a time", label,
                            type(module).__name__, str(e).splitlines()[0][:200])
                with replayed_rng(call.rng):
                    try:
                        grads, outs = _loop(one, args_b, kwargs_b, cots, (arg_dims, kwarg_dims), B)
                    except RuntimeError as e1:  # named: which owner, which parameters (the probe's evidence)
                        err = RuntimeError(
                            f"module {label} ({type(module).__name__}) could not be replayed on one sample to get "
                            f"the per-sample gradients of its parameters {names_l}: {str(e1).rstrip('.')}. "
                            + _replay_hint(e1))
                        err.fastdp_params = tuple(f"{call.label}.{n}" if call.label else n for n in names_l)
                        raise err from e1
        for j, (got, want) in enumerate(zip(outs, call.outputs, strict=True)):
            d = out_dims[j]
            got = got.reshape(want.shape) if d == 0 else got.squeeze(d + 1).movedim(0, d)
            # on an accelerator the verdict is read when the step is released (fastdp.deferred): no host read here
            deferred.check(_mismatch(got, want, call.autocast),
                           _replay_error(label, module, j, _max_difference(got, want)))
        return {n: to_accumulation(g) for n, g in grads.items()}

    def per_sample_grad(self, module: nn.Module, ctx: Any, name: str) -> torch.Tensor:
        return ctx[name]


def _replay_hint(error: BaseException) -> str:
    """What to do when an owner's per-sample replay raised ``error``."""
    if "autograd.Function" in str(error) or "setup_context" in str(error):
        return ("The module computes with a custom torch.autograd.Function that torch.func cannot differentiate "
                "(peft's LoHa, RandLoRA and C3A adapters do): its per-sample gradients cannot be computed. Freeze "
                "those parameters, or use an adapter built from ordinary torch operations (LoRA, LoKr, DoRA, IA3)")
    return ("Its output for one sample is not that sample's row of its output for the batch (an output that mixes "
            "samples, such as a (B, B) similarity matrix scaled by one of these parameters); freeze them or compute "
            "that part outside the model")


def slot_aliases(module: nn.Module, names: list[str]) -> dict[str, list[str]]:
    """For each parameter path in ``names``, one path per distinct slot of ``module``'s tree that holds the same
    parameter (a weight tied through two modules: two slots, both substituted by the replay). A container registered
    under two paths (a ``ParameterDict`` or module shared by two submodules, as peft's VB-LoRA vector bank or
    TinyLoRA's shared vector) is one slot: substituted once. (``functional_call``'s own tying substitutes it once
    per path and restores it once, leaving a plain tensor in the model: the replay then failed with "is not an
    nn.Parameter" and the model lost the parameter.)"""
    paths: dict[int, list[str]] = {}
    slots: set[tuple[int, str]] = set()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for pname, p in sub._parameters.items():
            if p is None or (id(sub), pname) in slots:
                continue
            slots.add((id(sub), pname))
            paths.setdefault(id(p), []).append(f"{prefix}.{pname}" if prefix else pname)
    return {n: paths.get(id(module.get_parameter(n)), [n]) for n in names}


def _expanded_grads(module: nn.Module, call: GenericCall) -> dict[str, torch.Tensor]:
    """Per-sample gradients of a verified expansion: the gradient ``(B, *rest)`` that reached
    ``E = P.expand(B, *rest)`` in the backward pass (zeros if none reached it); row ``i`` is ``g_i`` of ``P`` (shape
    ``(1, *rest)``), returned as ``(B, 1, *rest)``."""
    if set(call.expanded) != set(call.names):  # pragma: no cover - the engine expands all or none
        raise RuntimeError(f"module {call.label!r}: expanded {call.expanded} but owns {call.names}")
    out = {}
    for n, g in zip(call.expanded, call.grads, strict=True):
        p = module.get_parameter(n)
        want = (call.batch, *p.shape)
        if g is None:
            g = p.detach().new_zeros(want)
        g = g.reshape(want)  # (B, *rest) -> (B, 1, *rest): one gradient of P's shape per sample
        out[n] = to_accumulation(g)
    return out


def _loop(one: Any, args_b: Any, kwargs_b: Any, cots: tuple[torch.Tensor, ...], dims: tuple[Any, Any],
          B: int) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """:func:`vmap` of ``one`` by a Python loop over the samples (same results, no batching rules needed)."""
    def pick(tree: Any, tree_dims: Any, i: int) -> Any:
        flat, spec = tree_flatten(tree)
        flat_dims = tree_flatten(tree_dims)[0]
        return spec.unflatten([x.select(d, i) if d is not None else x for x, d in zip(flat, flat_dims, strict=True)])

    results = [one(pick(args_b, dims[0], i), pick(kwargs_b, dims[1], i), tuple(c[i] for c in cots))
               for i in range(B)]
    grads = {n: torch.stack([r[0][n] for r in results]) for n in results[0][0]}
    outs = tuple(torch.stack([r[1][j] for r in results]) for j in range(len(results[0][1])))
    return grads, outs


def _per_sample(t: torch.Tensor, d: int, fold: int) -> torch.Tensor:
    """A batched tensor with its batch dimension ``d`` first, split per sample: ``(B, ...)`` as ``(B, 1, ...)`` (a
    1 inserted after ``d``, a batch of one each), or, folded (``fold = k``, ``d = 0``), ``(k B, ...)`` as
    ``(B, k, ...)``: sample ``i``'s rows ``i k .. i k + k - 1``."""
    if fold > 1:
        return t.unflatten(0, (t.shape[0] // fold, fold))
    return t.movedim(d, 0).unsqueeze(d + 1)


def _unsqueeze_batched(tree: Any, dims: Any, batch: int = -1, fold: int = 1) -> Any:
    """Batched tensors ``(B, ...)`` become ``(B, 1, ...)`` (batch dimension ``d``: a 1 inserted after it), folded
    ones ``(k B, ...)`` (``fold = k``) become ``(B, k, ...)``: vmap then hands each sample a batch of one (of its
    ``k`` rows)."""
    flat, spec = tree_flatten(tree)
    flat_dims = tree_flatten(dims)[0] if dims is not None else [None] * len(flat)
    if len(flat_dims) != len(flat):  # dims is a prefix (None for a whole subtree)
        flat_dims = [None] * len(flat)
    out = [x if d is None else x.unflatten(0, (batch, fold)) if fold > 1 and d == 0 and x.shape[0] == batch * fold
           else x.unsqueeze(d + 1) for x, d in zip(flat, flat_dims, strict=True)]
    return spec.unflatten(out)


def _mismatch(got: torch.Tensor, want: torch.Tensor,
              autocast: tuple[tuple[str, torch.dtype], ...] = ()) -> torch.Tensor:
    """0-dim bool tensor on the device, without a host read: whether the replayed output ``got`` differs from the
    real one ``want`` by more than ``atol + rtol |want|`` somewhere (``rtol`` by dtype, ``atol = rtol max|want|``).
    Where ``want`` has NaN/inf, the two must have them at the same places and agree elsewhere (``atol = rtol``).
    Under autocast (the call's ``autocast`` state) ``rtol`` is at least the autocast dtype's: a float32 output
    computed through bf16 products carries their rounding, which a replay of one sample (other kernels, other
    sums) does not reproduce bit for bit (T5's attention blocks under bf16 differed by 0.008 and were refused)."""
    rtol = max([_REPLAY_RTOL.get(want.dtype, 1e-3)] + [_REPLAY_RTOL.get(d, 5e-2) for _, d in autocast])
    if want.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=want.device)
    acc = torch.promote_types(want.dtype, torch.float32)
    g, w = got.to(acc), want.to(acc)
    finite = w.isfinite()
    scale = w.abs().max()
    all_finite = scale.isfinite()
    atol = torch.where(all_finite, rtol * scale.clamp(min=1e-30), torch.full((), rtol, dtype=acc, device=w.device))
    close = (g - w).abs() <= atol + rtol * w.abs()  # False where either is NaN
    ok_finite = close.all()
    ok_nonfinite = (g.isfinite() == finite).all() & torch.where(finite, close, True).all()
    return ~torch.where(all_finite, ok_finite, ok_nonfinite)


def _max_difference(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor | None:
    """``max |got - want|`` as a 0-dim tensor (read only if the check fails), ``None`` for empty outputs."""
    if want.numel() == 0:
        return None
    acc = torch.promote_types(want.dtype, torch.float32)
    return (got.to(acc) - want.to(acc)).abs().max()


def _replay_error(label: str, module: nn.Module, j: int, diff: torch.Tensor | None) -> Callable[[], RuntimeError]:
    def error() -> RuntimeError:
        shown = "n/a" if diff is None else f"{float(diff):.3g}"
        return RuntimeError(
            f"module {label} ({type(module).__name__}): replaying its forward one sample at a time does not "
            f"reproduce output {j} of the real forward pass (max difference {shown}). Its per-sample gradients "
            "would be wrong, so fastdp stops. Causes: randomness in forward that the replay cannot reproduce "
            "(dropout on a transposed or batch-mixed layout: set it to 0 or call .eval()), a forward that mixes "
            "the samples of a batch (batch statistics), state changed between forward and backward (a cache: pass "
            "use_cache=False), or an input without a batch dimension whose leading size equals the batch size.")
    return error


GENERIC = GenericKind()
