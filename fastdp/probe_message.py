"""The structure probe's refusal (:mod:`fastdp.probe`): the :class:`~fastdp.probe.StructureError` message that names
the parameters and modules at stake, the worst disagreements, and the likely causes and fixes."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from fastdp.probe_passes import Finding
from fastdp.torch_api import grad_hooks


def _user_grad_hooks(engine: Any, p: torch.Tensor) -> list[Any]:
    """The gradient hooks on ``p`` other than the engine's own (its outside-use check: ``Capture._outside_use``)."""
    return [h for h in grad_hooks(p)
            if not (isinstance(h, partial) and getattr(h.func, "__self__", None) is engine._capture)]


def _message(engine: Any, findings: list[Finding], B: int, sig: tuple[Any, ...], random_ops: set[str],
             suspects: Sequence[str] = (), fell_back: bool = False, verified_at: Sequence[int] = ()) -> str:
    owner = {n: (n.rpartition(".")[0] or "<root>") for n in engine._trainable}
    worst = sorted(findings, key=lambda f: -f.error)[:5]
    params = sorted({f.where.strip("'") for f in findings if f.where.strip("'") in owner}
                    | {n for f in findings for n in f.params if n in owner})
    if not params and suspects:  # a pass failed: the expanded modules' parameters are the ones at stake
        params = sorted(n for n in owner if owner[n] in suspects)
    modules = sorted({owner[n] for n in params} | set(suspects))
    hooked = [n for n in params if _user_grad_hooks(engine, engine._trainable[n])]
    hooks = (f"\nParameters {hooked[:8]} have gradient hooks (Tensor.register_hook, as peft's OSF adapter registers): "
             "the engine computes their per-sample gradients itself, so the hooks do not run on them, while the "
             "batch-of-one reference runs them. Remove the hooks or freeze those parameters." if hooked else "")
    retry = (", and replaying those modules' parameters per sample from their ancestors, up to the whole model, did "
             "not pass either" if fell_back else "")
    exp = (f"\nModules {list(suspects)[:8]} do not see the batch as the engine assumes: it expanded their outputs of "
           f"leading size 1 to the batch size {B} (taken as one value shared by the batch), or they saw fewer rows "
           f"than the batch{retry}. An output of leading size 1 that is a part of the batch (a chunk of one sample, "
           "x.chunk(2) of an odd batch) or is combined with the batch along dimension 0 (torch.cat) is not a "
           "broadcast value, and the rows of a part of the batch are not the samples' rows." if suspects else "")
    size = (f"\nThis input signature was verified at batch size{'s' if len(verified_at) > 1 else ''} "
            f"{list(verified_at)} and fails at batch size {B}: what the model does to the rows depends on the batch "
            "size (rows rolled, reordered, repeated or reshaped by a constant that the first size hid, e.g. "
            "x.roll(4, 0) is the identity at batch size 2 and 4)." if verified_at else "")
    lines = "\n".join(f"  - {f.line()}" for f in worst)
    more = f" (and {len(findings) - len(worst)} more)" if len(findings) > len(worst) else ""
    rnd = (f"\nRandom operations other than dropout ran in forward ({sorted(random_ops)}); the probe was retried in "
           "eval mode and still disagreed." if random_ops else "")
    return (
        f"structure probe: the engine's per-sample gradients of this model do not match a brute-force batch-of-one "
        f"computation (batch size {B}), so training would not be private as stated. Parameters: "
        f"{params[:8]}{'...' if len(params) > 8 else ''}; modules: {modules[:8]}{'...' if len(modules) > 8 else ''}.\n"
        f"Evidence{more}:\n{lines}{size}{rnd}{exp}{hooks}\n"
        "Likely causes: the batch axis is not the first dimension of the model's first tensor input (a "
        "sequence-first model: pass batch_first inputs); the model mixes samples (x.chunk/split over the batch, "
        "BatchNorm, reordering or any cross-sample operation); a forward hook changes a layer's output; an output of "
        "a layer is used without its batch dimension (e.g. emb(position_ids)[0]), or a tensor built inside the "
        "model has a leading size equal to the batch size by coincidence (arange(T) with T == batch size: use "
        "position_ids of shape (1, T) or (B, T)).\n"
        "Fix: keep the batch dimension first and every sample's computation independent of the others' (and the "
        "probe then passes), or freeze the parameters named above. PrivacyEngine(verify_structure=False) turns this "
        f"check off, at the risk of silently wrong per-sample clipping. (input signature: {sig[1]})")
