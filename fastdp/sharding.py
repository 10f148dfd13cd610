"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under the PrivacyEngine: sharded parameters, clipped sums and noise.

After ``fully_shard`` a module's parameters are DTensors sharded along dim 0 over a 1-D device mesh: rank ``r`` of
``N`` holds rows ``[r c, min((r + 1) c, d_0))`` with ``c = ceil(d_0 / N)`` (``torch.chunk``'s split). Around each
forward (and backward) call of the module FSDP all-gathers them into *unsharded* ``nn.Parameter`` s and puts those
in the module's parameter slots; the engine's plan keeps the sharded parameters (what ``model.parameters()`` and
the optimizer hold). This module connects the two:

* **Ghost differentiation** must turn off ``requires_grad`` of the tensor the forward reads, the unsharded
  parameter (:meth:`Sharding.detach_targets`): FSDP then never receives a weight gradient and its own (non-private)
  reduce-scatter sends nothing. The sharded parameter is turned off too, because FSDP copies its flag onto the
  unsharded one when it unshards (a module that is itself ``fully_shard`` ed unshards after the engine's pre-hook).
  A tensor hook on every unsharded parameter reports a use outside its module, as for plain parameters.
* **Per-sample norms and the clipped sums** are computed from what each layer's call kept (its input and output
  gradient, full size on every rank) as on one process; the layer kinds read only the parameter's *shape* (the
  DTensor's global shape). The clipped sum ``S_p = sum_{i in this rank's samples} C_i g_i`` of every sharded
  parameter is **reduce-scattered at the end of each backward pass** (the all-layer style needs every norm first),
  as soon as the clipping stage forms it (:class:`SumStream`), in flat buckets in plan order with FSDP's dim-0
  padding, so that rank ``r`` keeps only its rows of ``sum_ranks S_p``; the full-size sums are freed bucket by
  bucket. Before the first reduce-scatter the ranks agree (:meth:`Sharding.agree_pass`): if one rank's clipping
  failed (non-finite gradients) every rank raises. The release stage accumulates the local rows over the backward
  passes of a logical step (virtual batches).
* **Noise** (:meth:`Sharding.release`): each rank draws the noise of its own rows only, once, from its own stream
  (:class:`fastdp.shard_noise.ShardNoise`, derived from the engine's noise generator or the global RNG and the
  rank; restored by a checkpoint), and sets ``p.grad`` to a DTensor with ``p``'s mesh and placements:
  ``p.grad_local = (rows_r(sum over ranks S_p) + sigma R xi_r) / B``.

What is refused, at construction (each with the reason and the fix): an engine not distributed over the FSDP mesh's
ranks, a mesh of more than one dimension (HSDP), a placement other than ``Shard(0)``, a 0-dim sharded parameter,
sharded parameters on the generic per-sample path or under the ``"ghost"`` mode (both re-run the module at the end
of backward, when its parameters are sharded), DTensor parameters FSDP does not manage, and
``verify_structure=True`` (the structure probe's extra forward passes would run FSDP's collectives on some ranks
only).

Every rank must run the same number of backward passes per logical step (FSDP's own all-gathers require the same
of the forward passes): a rank with an empty shard runs the forward and backward on its empty batch. A rank that
runs fewer is a mismatch of FSDP's own collectives when FSDP all-gathers in the backward pass (the default), as under
non-private FSDP2 (gloo aborts; other backends fail at the process group's timeout); otherwise the end-of-backward
agreement names the rank already in ``optimizer.step()``. Nothing of the step is released.

Only public ``torch.distributed`` collectives and DTensor APIs are used, plus FSDP2's parameter map through
:mod:`fastdp.torch_api`. It may touch: ``requires_grad`` of the unsharded parameters inside their module's call
(through the capture stage), the clipped sums handed to it, and ``.grad`` of sharded parameters in the release.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from fastdp import distributed, torch_api
from fastdp.clipped_sums import BackwardResult
from fastdp.noise import noise_dtype, noisy_mean, secure_noisy_mean
from fastdp.shard_noise import ShardNoise

logger = logging.getLogger(__name__)

#: slot 1 of the end-of-backward agreement's message (a step header's sample count there is never negative)
_AGREE_MARK = -7.0
#: bytes of full-size clipped sums reduce-scattered per collective (FSDP2 reduce-scatters one module at a time)
BUCKET_BYTES = 25 * 1024 * 1024


def fsdp_module_type() -> type | None:
    """``torch.distributed.fsdp.FSDPModule`` (``None`` if this torch has no FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return FSDPModule


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or one of its submodules."""
    cls = fsdp_module_type()
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


def is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


@dataclass(eq=False)
class ShardedParam:
    """One trainable parameter sharded by FSDP2: the plan's (sharded) parameter, FSDP's record of it, its rows."""

    name: str
    param: nn.Parameter  # the sharded DTensor parameter (the plan's and the optimizer's)
    fsdp: Any  # FSDP2's FSDPParam (its unsharded parameter: torch_api.fsdp_unsharded_param)
    group: Any  # the mesh's process group
    world: int
    rank: int
    chunk: int  # rows per rank after FSDP's padding: ceil(d_0 / world)
    local_rows: int  # rows this rank holds (chunk, fewer, or 0 at the end)

    @property
    def row_numel(self) -> int:
        return math.prod(self.param.shape[1:])

    def local_shape(self) -> tuple[int, ...]:
        return (self.local_rows, *self.param.shape[1:])


class ShardingError(ValueError):
    """A fully_shard model the engine cannot train privately as configured."""


class Sharding:
    """The engine's view of its FSDP2-sharded parameters (see the module docstring).

    Args:
        engine: the owning :class:`fastdp.PrivacyEngine` (read: ``plan``, ``_group``, ``clip_config``,
            ``verify_structure``, ``noise_generator``, ``secure_mode``, ``model``).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._plan: Any = None
        self.params: dict[nn.Parameter, ShardedParam] = {}
        self._watched: set[int] = set()  # ids of unsharded parameters with an outside-use hook
        #: the ``.grad`` each sharded parameter was given at the last step (weakly), and its version counter then
        self._released: dict[nn.Parameter, tuple[weakref.ref[torch.Tensor], int]] = {}
        self.bytes_scattered = 0  # bytes of full-size sums this rank put into reduce-scatters
        self.refresh()
        self.noise = ShardNoise(engine)

    # ------------------------------------------------------------------ the map
    def refresh(self) -> None:
        """(Re)build the map from the engine's current plan and check what is refused (module docstring)."""
        eng = self.engine
        plan = eng.plan
        if plan is self._plan:
            return
        group = eng._group
        if group is None:
            raise ShardingError(
                "the model is sharded with fully_shard (FSDP2) but the PrivacyEngine is not distributed: the clipped "
                "sums of a sharded parameter must be reduce-scattered over its mesh. Build the engine after "
                "torch.distributed.init_process_group(...) on every rank, without distributed=False.")
        if eng.verify_structure:
            raise ShardingError(
                "verify_structure=True with a fully_shard (FSDP2) model: the structure probe runs extra forward and "
                "backward passes when a rank sees a new input signature, and under FSDP each of them all-gathers "
                "parameters, a collective the other ranks would not join (a hang). Verify the model's structure "
                "once on one process before fully_shard: fastdp.validate.verify_structure(model, batch) with a "
                "batch of the training shapes; then shard and build the engine with verify_structure=False.")
        if eng.clip_config.mode.sums == "replay":
            raise ShardingError(
                f"clipping_mode={eng.clipping_mode!r} with a fully_shard (FSDP2) model: its clipped sums re-run each "
                "layer at the end of the backward pass, when FSDP has resharded the layer's parameters. Use a "
                "book-keeping mode (clipping_mode='BK-MixOpt', 'BK-MixGhostClip', 'BK-ghost' or 'instantiate').")
        fsdp_cls = fsdp_module_type()
        by_id: dict[int, Any] = {}
        for m in eng.model.modules():
            if fsdp_cls is not None and isinstance(m, fsdp_cls):
                for fp in torch_api.fsdp_params(m):
                    by_id[id(fp.sharded_param)] = fp
        name_of = {id(p): n for n, p in plan.trainable.items()}
        params: dict[nn.Parameter, ShardedParam] = {}
        for name, p in plan.trainable.items():
            if not is_dtensor(p):
                continue
            fp = by_id.get(id(p))
            if fp is None:
                raise ShardingError(
                    f"trainable parameter {name!r} is a DTensor that fully_shard does not manage (tensor "
                    "parallelism, or a parameter replaced after fully_shard): the engine can only reduce-scatter "
                    "FSDP2's dim-0 shards. Apply fully_shard last, to the modules holding every trainable DTensor, "
                    "and build the engine after it.")
            params[p] = self._describe(name, p, fp, group)
        for entry in plan.entries:
            if entry.generic:
                sharded = [name_of[id(plan.param_of[(id(entry.module), n)])] for n in sorted(entry.names)
                           if plan.param_of[(id(entry.module), n)] in params]
                if sharded:
                    raise ShardingError(
                        f"module {entry.label!r} ({type(entry.module).__name__}) holds sharded trainable parameters "
                        f"{sharded} on the generic per-sample path ({entry.why_generic}); that path re-runs the "
                        "module at the end of the backward pass, when fully_shard has resharded its parameters. "
                        "Freeze them, replace the module by supported layers (fastdp.layers.supported_types()), or "
                        "keep the module out of fully_shard (then its parameters are all-reduced, data-parallel).")
        self.params = params
        self._plan = plan
        logger.info("fully_shard: %d of %d trainable tensors sharded over %d ranks (reduce-scatter of the clipped "
                    "sums, shard noise per rank)", len(params), len(plan.trainable), group.world_size)

    @staticmethod
    def _describe(name: str, p: nn.Parameter, fp: Any, group: Any) -> ShardedParam:
        from torch.distributed.tensor import Shard

        dist = torch.distributed
        mesh = p.device_mesh
        if mesh.ndim != 1:
            raise ShardingError(
                f"trainable parameter {name!r} is sharded over a {mesh.ndim}-D device mesh (HSDP or a "
                "replicate dimension); the engine reduce-scatters over a 1-D mesh only. Call fully_shard with a "
                "1-D mesh of every rank (init_device_mesh(device_type, (world_size,))).")
        placements = tuple(p.placements)
        if placements != (Shard(0),):
            raise ShardingError(
                f"trainable parameter {name!r} has placements {placements}; the engine supports FSDP2's default "
                "Shard(0) only. Drop shard_placement_fn from fully_shard.")
        if p.dim() == 0:
            raise ShardingError(f"trainable parameter {name!r} is a 0-dim tensor sharded by fully_shard; keep it "
                                "out of fully_shard (it is then all-reduced) or freeze it.")
        pg = mesh.get_group(0)
        mesh_ranks = dist.get_process_group_ranks(pg)
        engine_ranks = (dist.get_process_group_ranks(group.pg) if group.pg is not None
                        else list(range(dist.get_world_size())))
        if sorted(mesh_ranks) != sorted(engine_ranks):
            raise ShardingError(
                f"trainable parameter {name!r} is sharded over ranks {mesh_ranks} but the engine trains over "
                f"ranks {engine_ranks}: its clipped sums must be reduced over exactly the engine's ranks. Use the "
                "same process group for fully_shard's mesh and the engine (process_group=).")
        world, rank = mesh.size(), mesh.get_local_rank()
        d0 = p.shape[0]
        chunk = -(-d0 // world)
        rows = max(0, min(chunk, d0 - rank * chunk))
        local = p.to_local()
        if local.shape != (rows, *p.shape[1:]):
            raise ShardingError(  # pragma: no cover - FSDP2 changed its layout
                f"trainable parameter {name!r}: rank {rank} holds a shard of shape {tuple(local.shape)}, not the "
                f"rows [{rank * chunk}, {rank * chunk + rows}) of {tuple(p.shape)} that torch.chunk's split gives; "
                "this torch's FSDP2 layout is not the one fastdp knows.")
        return ShardedParam(name, p, fp, pg, world, rank, chunk, rows)

    def is_sharded(self, p: nn.Parameter) -> bool:
        return p in self.params

    # ------------------------------------------------------------------ ghost differentiation (capture stage)
    def detach_targets(self, p: nn.Parameter, on_outside_use: Callable[[str, torch.Tensor], Any],
                       hooks: list[Any]) -> list[torch.Tensor]:
        """The tensors whose ``requires_grad`` ghost differentiation turns off for ``p``'s module call: ``p`` and,
        for a sharded ``p``, its unsharded parameter (once FSDP has made it; before that FSDP copies ``p``'s flag).
        A new unsharded parameter gets the outside-use hook (appended to ``hooks``, removed with the others)."""
        self.refresh()  # the trainable set may have changed (update_trainable)
        sp = self.params.get(p)
        if sp is None:
            return [p]
        full = torch_api.fsdp_unsharded_param(sp.fsdp)
        if full is None or full is p:
            return [p]
        if id(full) not in self._watched:
            self._watched.add(id(full))
            hooks.append(full.register_hook(lambda g, n=sp.name: on_outside_use(n, g)))
        return [p, full]

    def unsharded_of(self, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
        """The unsharded parameters (made since the pre-hook) to restore at the end of a call."""
        out = []
        for p in params:
            sp = self.params.get(p)
            full = None if sp is None else torch_api.fsdp_unsharded_param(sp.fsdp)
            if full is not None and full is not p:
                out.append(full)
        return out

    def _leaked_gradients(self) -> list[str]:
        """Sharded parameters whose ``.grad`` is not what the engine released (FSDP reduce-scattered a gradient
        of their unsharded parameter: a use outside their module, before its outside-use hook existed)."""
        out = []
        for p, sp in self.params.items():
            g = p.grad
            if g is None:
                continue
            mine = self._released.get(p)
            if mine is None or mine[0]() is not g or mine[1] != g.to_local()._version:
                out.append(sp.name)
        return out

    def _watch_unsharded(self) -> None:
        """Outside-use hooks on every unsharded parameter FSDP has made (from the second pass on they catch a use
        outside the module when it happens; :meth:`_leaked_gradients` is the net before)."""
        capture = self.engine._capture
        for p in self.params:
            self.detach_targets(p, capture._outside_use, capture._handles)

    def forget_hooks(self) -> None:
        """The capture stage removed its hooks: outside-use hooks are registered again on the next call."""
        self._watched.clear()

    # ------------------------------------------------------------------ end of a backward pass
    def stream(self, records: Sequence[Any], param_of: dict[tuple[int, str], nn.Parameter]) -> SumStream:
        """The consumer of one backward pass's clipped sums (:func:`fastdp.clipped_sums.clipped_sums`'s
        ``stream``): see :class:`SumStream`."""
        self.refresh()
        return SumStream(self, records, param_of)

    def agree_pass(self, failed: bool) -> None:
        """The ranks' agreement before the reduce-scatters of a backward pass: one small ``all_gather`` of a
        failure flag (this rank's clipping failed, or a sharded parameter got a non-private gradient).

        Raises:
            RuntimeError: on every rank, when some rank failed (nothing of the pass is released anywhere).
        """
        group = self.engine._group
        leaked = [] if failed else self._leaked_gradients()
        like = next(iter(self.params)).device if self.params else None
        # The message has the size of the release stage's step header, so that a rank already in optimizer.step()
        # (it ran fewer backward passes) is told apart instead of a size mismatch in the collective: slot 0 reads
        # as "refused" in a header, slot 1 (a header's sample count, never negative) marks this agreement.
        msg = torch.zeros(len(dataclasses.fields(distributed.StepHeader)), dtype=torch.float64,
                          device=group.header_device(like))  # NCCL: on the GPU
        msg[0], msg[1], msg[2] = 1.0, _AGREE_MARK, float(failed or bool(leaked))
        got = [torch.empty_like(msg) for _ in range(group.world_size)]
        group._run("agreement at the end of a backward pass (sharded clipped sums)",
                   lambda: torch.distributed.all_gather(got, msg, group=group.pg))
        self._watch_unsharded()
        stepping = [r for r, v in enumerate(got) if float(v[1]) != _AGREE_MARK]
        if stepping:
            raise RuntimeError(
                f"rank(s) {stepping} called optimizer.step() (or engine.empty_step()) while rank {group.rank} ended "
                "a backward pass: under fully_shard every rank must run the same number of backward passes per "
                "step (a rank with an empty shard runs the forward and backward on its empty batch). Nothing of "
                "this step is released.")
        bad = [r for r, v in enumerate(got) if float(v[2]) != 0.0]
        if failed:
            return
        if leaked:
            raise RuntimeError(
                f"sharded parameters {leaked[:5]}{'...' if len(leaked) > 5 else ''} received a gradient from "
                "FSDP's own (non-private) reduce-scatter: autograd differentiated their unsharded parameter outside "
                "the module that owns it (e.g. a weight read directly by another module, as in weight tying "
                "through F.linear), a use fastdp cannot clip per sample. Tie weights through modules, or freeze "
                "the parameter (or: its .grad was changed in place since the last step; call "
                "optimizer.zero_grad() after optimizer.step()). Nothing of this backward pass is released.")
        if bad:
            raise RuntimeError(
                f"rank(s) {bad} failed to clip this backward pass (see their error); rank {group.rank} discards it "
                "too, so nothing of the pass is released on any rank.")

    def scatter_bucket(self, bucket: list[ShardedParam], sums: dict[nn.Parameter, torch.Tensor],
                       out_rows: dict[nn.Parameter, torch.Tensor]) -> None:
        """Reduce-scatter one bucket of full-size sums (popped from ``sums``; a missing one is zeros) into this
        rank's rows (``out_rows``). The flat buffer is rank-major: rank ``r``'s part holds rows
        ``[r c, (r + 1) c)`` of each member, zero padded to ``c`` rows (FSDP2's layout)."""
        first = bucket[0]
        world, dev = first.world, first.param.device
        dtype = noise_dtype(first.param)  # the same on every rank, whatever this rank's pass reached
        per_rank = sum(sp.chunk * sp.row_numel for sp in bucket)
        flat = torch.zeros(world, per_rank, dtype=dtype, device=dev)
        off = 0
        for sp in bucket:
            s = sums.pop(sp.param, None)
            if s is not None:
                rows = s.reshape(s.shape[0], -1)
                for r in range(world):
                    part = rows[r * sp.chunk:(r + 1) * sp.chunk].reshape(-1)
                    flat[r, off:off + part.numel()].copy_(part)
                del s, rows
            off += sp.chunk * sp.row_numel
        out = torch.empty(per_rank, dtype=dtype, device=dev)
        self.engine._group._run("reduce-scatter of the sharded clipped sums",
                                partial(torch.distributed.reduce_scatter_single, out, flat.view(-1), group=first.group))
        self.bytes_scattered += flat.numel() * flat.element_size()
        del flat
        off = 0
        for sp in bucket:
            out_rows[sp.param] = out[off:off + sp.local_rows * sp.row_numel].view(sp.local_shape())
            off += sp.chunk * sp.row_numel

    # ------------------------------------------------------------------ the step (release stage)
    def release(self, sums: dict[nn.Parameter, torch.Tensor], std: float, batch_size: int) -> None:
        """``p.grad`` of every sharded parameter: a DTensor of ``p``'s mesh and placements whose local rows are
        ``(summed rows + std * xi_rank) / batch_size``, the noise drawn here, by the rank that owns the rows.
        Pops the sharded parameters' entries from ``sums`` (their accumulated local rows)."""
        from torch.distributed.tensor import DTensor

        self.refresh()
        secure = self.engine.secure_mode
        for p in self.params:
            local = p.to_local()
            acc = sums.pop(p, None)
            if secure:
                g = secure_noisy_mean(local, acc, std, batch_size)
            else:
                g = noisy_mean(local, acc, std, batch_size, self.noise.generator(local.device))
            p.grad = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                        stride=p.stride())
            self._released[p] = (weakref.ref(p.grad), p.grad.to_local()._version)  # weak: zero_grad frees it

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"world_size": self.engine._group.world_size, "rank": self.engine._group.rank,
                "noise": self.noise.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Apply a state checked by :func:`check_checkpoint_state`."""
        self.noise.load_state_dict(state["noise"])


class SumStream:
    """One backward pass's sharded clipped sums, reduce-scattered as soon as they are formed.

    The clipping stage hands each parameter's full-size sum to :meth:`take` as soon as it is formed. The sums are
    reduce-scattered in buckets of consecutive sharded parameters in plan order (the same collectives, in the same
    order, on every rank): a bucket goes once every member this rank's pass reached has arrived (a member it did not
    reach contributes zeros), and its full-size sums are freed. With sums formed in plan order (a model's forward
    order), at most about one bucket of full-size sums exists at a time. :meth:`begin` is the ranks' agreement
    before the first reduce-scatter; :meth:`finish` flushes what is left and puts this rank's rows into the pass's
    result; :meth:`fail` tells the other ranks this rank's clipping failed before :meth:`begin`.
    """

    def __init__(self, sharding: Sharding, records: Sequence[Any],
                 param_of: dict[tuple[int, str], nn.Parameter]) -> None:
        self.sharding = sharding
        self.expected = {p for r in records for n in r.names
                         if (p := param_of[(id(r.module), n)]) in sharding.params}
        self.buckets = _buckets(list(sharding.params.values()), lambda sp: noise_dtype(sp.param), BUCKET_BYTES)
        self.next = 0
        self.held: dict[nn.Parameter, torch.Tensor] = {}
        self.rows: dict[nn.Parameter, torch.Tensor] = {}
        self.begun = False

    def begin(self) -> None:
        self.begun = True
        self.sharding.agree_pass(failed=False)

    def take(self, param: nn.Parameter, value: torch.Tensor) -> bool:
        if param not in self.sharding.params:
            return False
        self.held[param] = value
        self._flush(final=False)
        return True

    def _flush(self, final: bool) -> None:
        while self.next < len(self.buckets):
            bucket = self.buckets[self.next]
            if not final and any(sp.param in self.expected and sp.param not in self.held for sp in bucket):
                return
            self.sharding.scatter_bucket(bucket, self.held, self.rows)
            self.next += 1

    def finish(self, result: BackwardResult) -> BackwardResult:
        if not self.begun:
            self.begin()
        for p in list(result.sums):  # sums formed without take() (none today): scattered like the others
            if p in self.sharding.params:
                self.held[p] = result.sums.pop(p)
        self._flush(final=True)
        result.sums.update(self.rows)
        return result

    def fail(self) -> None:
        if not self.begun:
            self.sharding.agree_pass(failed=True)
        elif 0 < self.next < len(self.buckets):  # pragma: no cover - failed between reduce-scatters (a bug, OOM)
            logger.error("the clipping of a backward pass failed between the reduce-scatters of the sharded sums; "
                         "the other ranks' next collective fails or times out")


def _buckets(order: list[ShardedParam], dtype_of: Callable[[ShardedParam], torch.dtype],
             cap: int) -> list[list[ShardedParam]]:
    """Consecutive runs of ``order`` with one (dtype, device, group), each at most ``cap`` bytes of padded sums."""
    def nbytes(sp: ShardedParam) -> int:
        return sp.world * sp.chunk * sp.row_numel * torch.empty((), dtype=dtype_of(sp)).element_size()

    return distributed.bucket_runs(order, lambda sp: (dtype_of(sp), sp.param.device, id(sp.group)), nbytes, cap)


__all__ = ["BUCKET_BYTES", "ShardedParam", "Sharding", "ShardingError", "SumStream", "is_dtensor",
           "is_fully_sharded"]
