"""The plan: which module owns which trainable parameter, and how each is clipped.

First stage of the data flow (plan -> capture -> per-sample norms -> clipping factors -> clipped sums -> noise ->
optimizer). :func:`build_plan` walks the model once and returns a plain :class:`Plan`: the trainable parameters, one
:class:`PlanEntry` per hooked module (its layer kind or the exact generic path, the parameters it owns, and why a
parameter is on the generic path), and the modules that share a parameter (tied weights). The capture stage
(:mod:`fastdp.capture`) installs its hooks from the plan; the clipping stage reads ``param_of`` and ``tied_modules``.
It holds no tensors of its own and never changes the model.

``print(engine.plan)`` shows a user how their model will be handled. Where sharded parameters (FSDP) are to be
described, this is the place: an entry would name the shard each rank owns.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from fastdp.layers import generic, kind_for, registry
from fastdp.layers import owners as ownership
from fastdp.layers.base import LayerKind
from fastdp.torch_api import is_batchnorm

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PlanEntry:
    """One hooked module: its kind (``generic.GENERIC`` for the generic path) and the trainable parameters it owns.

    ``names`` are paths relative to the module (``"weight"``, or ``"out_proj.weight"`` for a subtree owner).
    """

    name: str
    module: nn.Module
    kind: LayerKind
    names: frozenset[str]
    #: why the parameters are on the generic path (``None`` for a layer kind)
    why_generic: str | None = None

    @property
    def label(self) -> str:
        return self.name or "<root>"

    @property
    def generic(self) -> bool:
        return self.kind is generic.GENERIC


@dataclass(eq=False)
class Plan:
    """The engine's tables, built once per trainable set (see the module docstring)."""

    #: parameter path -> parameter, every trainable parameter of the model
    trainable: dict[str, nn.Parameter]
    entries: list[PlanEntry]
    #: (id(module), path relative to the module) -> parameter
    param_of: dict[tuple[int, str], nn.Parameter]
    #: ids of modules that hold a parameter another module holds too (their calls keep tensors for cross terms)
    tied_modules: set[int] = field(default_factory=set)
    #: parameter -> "ghost" / "instantiated" / "generic", as the last backward pass computed its per-sample norm
    last_norms: dict[int, str] = field(default_factory=dict)

    def entry_of(self, module: nn.Module) -> PlanEntry | None:
        return next((e for e in self.entries if e.module is module), None)

    def describe(self) -> list[dict[str, object]]:
        """One row per hooked module: name, type, kind, parameter paths, ``norm`` (path relative to the module -> how
        the last backward pass computed its per-sample norm: ghost, instantiated, generic; "shared" for a parameter
        with several uses), whether it shares a parameter, and why it is on the generic path."""
        name_of = {id(p): n for n, p in self.trainable.items()}
        rows = []
        for e in self.entries:
            params = [name_of[id(self.param_of[(id(e.module), n)])] for n in sorted(e.names)]
            norms = {n: self.last_norms.get(id(self.param_of[(id(e.module), n)]), "not run yet")
                     for n in sorted(e.names)}
            rows.append({"module": e.label, "type": type(e.module).__name__,
                         "kind": "generic" if e.generic else type(e.kind).__name__.removesuffix("Kind"),
                         "parameters": params,
                         "norm": norms, "tied": id(e.module) in self.tied_modules,
                         "why_generic": e.why_generic})
        return rows

    def __str__(self) -> str:
        rows = self.describe()
        lines = [f"fastdp plan: {len(self.trainable)} trainable tensors in {len(rows)} hooked modules"]
        for r in rows:
            extra = f"; generic because {r['why_generic']}" if r["why_generic"] else ""
            tied = "; shares a parameter with another module" if r["tied"] else ""
            norms = ", ".join(f"{n} {how}" for n, how in r["norm"].items())
            lines.append(f"  {r['module']} ({r['type']}): {r['kind']} [{norms}]{extra}{tied}")
        return "\n".join(lines)


def trainable_change(model: nn.Module, plan: Plan) -> str | None:
    """``None`` if ``model``'s parameters with ``requires_grad`` are ``plan``'s trainable set; else what changed."""
    now = {n for n, p in model.named_parameters() if p.requires_grad}
    if now == set(plan.trainable):
        return None
    frozen = sorted(set(plan.trainable) - now)
    unfrozen = sorted(now - set(plan.trainable))
    return ("the model's trainable parameters changed since the engine read them "
            f"(frozen: {frozen[:5]}{'...' if len(frozen) > 5 else ''}, "
            f"unfrozen: {unfrozen[:5]}{'...' if len(unfrozen) > 5 else ''})")


def _refuse(label: str, module: nn.Module, params: list[str], reason: str) -> ValueError:
    return ValueError(f"module {label!r} ({type(module).__name__}) with trainable parameters {params} cannot be "
                      f"trained privately: {reason}")


def build_plan(model: nn.Module, extra_owned: Mapping[str, tuple[str, ...]] | None = None) -> Plan:
    """Walk ``model`` once: trainable parameters, the modules that own them, and how each is clipped.

    A module whose trainable parameters a layer kind covers is hooked with that kind; any other module with
    trainable parameters (raw ``nn.Parameter`` s, unsupported layers, custom modules) is an *owner* on the exact
    generic path (:mod:`fastdp.layers.generic`). ``extra_owned`` (module name -> parameter paths) adds owners chosen
    by the structure probe's fallback. Raises ValueError naming a parameter that cannot be trained privately
    (BatchNorm in train mode, Embedding with max_norm, ...).
    """
    extra_owned = extra_owned or {}
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if not trainable:
        raise ValueError("the model has no parameter with requires_grad=True: nothing to train")
    trainable_ids = {id(p) for p in trainable.values()}
    name_of = {id(p): n for n, p in trainable.items()}
    entries: list[PlanEntry] = []
    param_of: dict[tuple[int, str], nn.Parameter] = {}
    covered: set[int] = set()
    in_subtree: set[int] = set()  # parameters owned by an ancestor's generic entry
    for mname, module in model.named_modules():
        label = mname or "<root>"
        if is_batchnorm(module) and module.training:
            owned = [name_of[id(p)] for p in module.parameters(recurse=False) if id(p) in trainable_ids]
            raise ValueError(
                f"module {label!r} ({type(module).__name__}"
                f"{', trainable parameters ' + ', '.join(map(repr, owned)) if owned else ''}) "
                "is in train mode: batch normalisation mixes the "
                "samples of a batch, so per-sample gradients (and the privacy guarantee) do not exist. "
                "Replace it with GroupNorm (fastdp.validate.fix), or call .eval() on it and freeze its "
                "parameters.")
        found: list[tuple[LayerKind, list[tuple[str, object]], str | None]] = []
        sub = generic.subtree_owner(module)
        why_sub = "its forward uses its submodules' parameters without calling them" if sub else None
        fallback = extra_owned.get(mname, ())
        if fallback:
            sub = (*(sub or ()), *fallback)
            why_sub = "the structure probe moved them here (a broadcast output or a use outside the layer)"
        if sub:
            owned_sub = [(rel, module.get_parameter(rel)) for rel in sub]
            owned_sub = [(rel, p) for rel, p in owned_sub if id(p) in trainable_ids and id(p) not in in_subtree]
            if owned_sub:
                found.append((generic.GENERIC, owned_sub, why_sub))
                in_subtree.update(id(p) for _, p in owned_sub)
        direct = [(a, p) for a, p in module.named_parameters(recurse=False)
                  if id(p) in trainable_ids and id(p) not in in_subtree]
        # never-called containers, parametrizations, parameters also held by a descendant (layers/owners.py)
        extra = [(a, p) for a, p in ownership.extra_owned(module) if id(p) in trainable_ids
                 and id(p) not in in_subtree and all(p is not q for _, q in direct)]
        whole = bool(extra) or ownership.shared_with_descendants(module, direct)
        direct += extra
        if whole:
            in_subtree.update(id(p) for _, p in direct)
        if direct:
            kind = None if whole else kind_for(module)
            if kind is not None and all(a in ("weight", "bias") for a, _ in direct):
                reason = kind.unsupported_reason(module)
                if reason is not None:
                    raise _refuse(label, module, [name_of[id(p)] for _, p in direct], reason)
                found.append((kind, direct, None))
            else:
                why = ("it holds parameters its submodules also hold, or parameters of a parametrization or "
                       "container it never calls" if whole else
                       f"no layer kind covers {type(module).__name__}" if kind is None else
                       "it has parameters other than weight and bias")
                found.append((generic.GENERIC, direct, why))
        if not found:
            reason = registry.frozen_reason(module)
            if reason is not None:
                raise ValueError(f"module {label!r} ({type(module).__name__}) has no trainable parameter but cannot "
                                 f"run under a PrivacyEngine: {reason}")
        for kind, plist, why in found:
            if kind is generic.GENERIC:
                reason = generic.unsupported_reason(module)
                if reason is not None:
                    raise _refuse(label, module, [name_of[id(p)] for _, p in plist], reason)
                logger.info("module %r (%s): parameters %s on the generic per-sample path", label,
                            type(module).__name__, [n for n, _ in plist])
            for rel, p in plist:
                param_of[(id(module), rel)] = p
                covered.add(id(p))
            entries.append(PlanEntry(mname, module, kind, frozenset(rel for rel, _ in plist), why))
    owners: dict[int, set[int]] = {}
    for (mid, _), p in param_of.items():
        owners.setdefault(id(p), set()).add(mid)
    tied = {mid for mids in owners.values() if len(mids) > 1 for mid in mids}
    missing = [n for n, p in trainable.items() if id(p) not in covered]
    if missing:  # pragma: no cover - every parameter is owned by some module
        raise ValueError(f"trainable parameters {missing} are not owned by any module")
    return Plan(trainable=trainable, entries=entries, param_of=param_of, tied_modules=tied)


__all__ = ["Plan", "PlanEntry", "build_plan"]
