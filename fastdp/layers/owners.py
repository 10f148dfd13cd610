"""Which module owns a parameter when the module that holds it is not the module that uses it.

The engine hooks, for every trainable parameter, one module whose forward call uses it (its *owner*). Usually that is
the module holding the parameter directly. Three structures break that rule; for each, the owner is an ancestor on
the exact generic path (:mod:`fastdp.layers.generic`), whose per-sample replay covers every use inside its forward:

* **Containers that are never called** (``nn.ParameterDict``, ``nn.ParameterList``, ``nn.ModuleDict`` /
  ``nn.ModuleList`` of them; peft IA3, AdaLoRA, VeRA keep their adapters in ``ParameterDict`` s): a module without
  a ``forward`` of its own has no forward hook, so its parameters are owned by the nearest ancestor that has one.
* **Parametrizations** (``torch.nn.utils.parametrize``: ``weight_norm``, ``spectral_norm``, orthogonal, ...): the
  parametrized module reads ``module.weight``, computed from ``parametrizations.weight.original*`` by a
  ``ParametrizationList`` that is called without any batch; the parametrized module owns the originals
  (``functional_call`` recomputes the weight from the substituted originals).
* **A parameter held by a module and by its descendant** (``BertLMPredictionHead.bias is decoder.bias``): hooking
  both counts each use twice. The ancestor owns it alone: its replay (``functional_call`` substitutes tied
  parameters everywhere) covers the descendant's use too; whether the ancestor also reads it outside the
  descendant cannot be known statically, so the descendant cannot own it.

Legacy ``torch.nn.utils.weight_norm`` (``weight_g`` / ``weight_v``) and ``torch.nn.utils.prune`` (``weight_orig``) keep
their originals as direct parameters and recompute ``weight`` in a forward pre-hook, so the module already owns them
(the engine's pre-hooks run before the module's own, see ``PrivacyEngine._install_hooks``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.nn.utils import parametrize


def forwardless(module: nn.Module) -> bool:
    """Whether ``module`` has no ``forward`` of its own (a container that is never called)."""
    return type(module).forward is nn.Module.forward


def _container_params(module: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter]]:
    """Parameters of a forwardless container and of its forwardless descendants (paths with ``prefix``)."""
    out = [(f"{prefix}{n}", p) for n, p in module.named_parameters(recurse=False)]
    for cname, child in module.named_children():
        if forwardless(child):
            out += _container_params(child, f"{prefix}{cname}.")
    return out


def extra_owned(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters ``module`` owns although it does not hold them directly, as ``(path relative to module,
    parameter)``: those of its never-called containers and of its parametrizations (see the module docstring).
    Empty for a module that is itself forwardless (its nearest called ancestor owns them)."""
    if forwardless(module):
        return []
    out: list[tuple[str, nn.Parameter]] = []
    parametrized = parametrize.is_parametrized(module)
    if parametrized:
        out += [(f"parametrizations.{n}", p) for n, p in module.parametrizations.named_parameters()]
    for cname, child in module.named_children():
        if parametrized and cname == "parametrizations":
            continue
        if forwardless(child):
            out += _container_params(child, f"{cname}.")
    return out


def shared_with_descendants(module: nn.Module, direct: list[tuple[str, nn.Parameter]]) -> bool:
    """Whether one of ``module``'s direct parameters ``direct`` is also held by a descendant of ``module``."""
    ids = {id(p) for _, p in direct}
    if not ids:
        return False
    for child in module.children():
        for _, p in child.named_parameters(remove_duplicate=False):
            if id(p) in ids:
                return True
    return False


@contextlib.contextmanager
def parametrizations_frozen(module: nn.Module) -> Iterator[None]:
    """Run the per-sample replay of ``module`` with its parametrizations in eval mode.

    ``spectral_norm`` runs a power iteration in train mode that updates its buffers ``u``, ``v`` in place (it does
    not depend on the data, so it mixes no samples). The real forward call already did that iteration and left the
    ``u``, ``v`` it used in the buffers; in eval mode the replay uses exactly those, computes the same weight, and
    does not iterate again (which would also change the next step's weight)."""
    subs = [s for pl in module.modules() if isinstance(pl, parametrize.ParametrizationList) for s in pl.modules()]
    states = [(s, s.training) for s in subs]
    for s in subs:
        s.training = False
    try:
        yield
    finally:
        for s, t in states:
            s.training = t


__all__ = ["extra_owned", "forwardless", "parametrizations_frozen", "shared_with_descendants"]
