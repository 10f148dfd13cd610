"""``PrivacyEngine.privacy_report()``: everything about a run's privacy in one dict with a readable ``str``.

Contents (keys of :class:`PrivacyReport`):

* ``noise_multiplier`` (sigma of the next step), ``sigma_history`` (``[(sigma, q, steps)]`` of the noised steps),
  ``sample_rate`` q, ``batch_size``, ``sample_size``;
* ``steps`` taken, ``planned_steps`` (the steps sigma was calibrated for; ``None`` if sigma was given),
  ``noiseless_steps``, ``other_releases`` (recorded with ``record_release``);
* ``delta``, ``target_epsilon``, ``accountant`` (the engine's);
* ``epsilon``: per accountant ``{"value", "kind"}`` for ``"prv"`` (tight upper bound), ``"rdp"`` (upper bound)
  and ``"gdp"`` (an APPROXIMATION that can underestimate); the engine's own accountant instance is used for its
  name (its settings, its cache), fresh default ones for the others. ``epsilon_live``: the cheap RDP bound
  (:mod:`fastdp.accounting.live`);
* ``clipping``: ``max_grad_norm`` R, ``clipping_fn``, ``clipping_style``, ``clipping_mode``, ``groups`` K,
  ``group_threshold`` R/sqrt(K), ``loss_reduction``;
* ``clipped``: the fraction of samples whose per-sample norm exceeded their group's threshold, over the run and
  at the last step (:mod:`fastdp.clip_stats`). Computed from the raw norms it is a **NON-PRIVATE diagnostic**
  (``private: False``) unless an adaptive-clipping mechanism registered a noisy count (``private: True``).

PRV costs 0.3-8 s per new step count; the report computes each accountant once per call.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from fastdp.accounting.gdp import warning_labelled_elsewhere
from fastdp.accounting.live import LIVE_BOUND, live_epsilon
from fastdp.accounting.prv import PRVFallbackWarning
from fastdp.accounting.registry import ACCOUNTANTS

__all__ = ["PrivacyReport", "privacy_report"]

KINDS = {"prv": "upper bound (PRV; tight)", "rdp": "upper bound (RDP)",
         "gdp": "APPROXIMATION (GDP CLT; may underestimate)"}


def _fmt(x: Any, spec: str = ".4g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


class PrivacyReport(dict):
    """A plain ``dict`` (see the module docstring for its keys) whose ``str`` is a readable summary."""

    def __str__(self) -> str:
        c, k = self["clipping"], self["clipped"]
        lines = [
            f"fastdp privacy report ({self['accountant']} accountant, delta={self['delta']:.3g})",
            f"  steps: {self['steps']} taken / {_fmt(self['planned_steps'])} planned "
            f"({self['noiseless_steps']} without noise, {self['other_releases']} other releases)",
            f"  noise multiplier sigma={self['noise_multiplier']:.4g}, sample rate q={self['sample_rate']:.4g} "
            f"(batch {self['batch_size']} of {self['sample_size']})",
            f"  target epsilon: {_fmt(self['target_epsilon'])}",
            "  epsilon spent:",
        ]
        for name, e in self["epsilon"].items():
            lines.append(f"    {name:<4} {_fmt(e['value']):>10}  {e['kind']}")
        lines.append(f"    live {_fmt(self['epsilon_live']):>10}  {LIVE_BOUND}")
        lines.append(f"  clipping: R={c['max_grad_norm']:g}, {c['clipping_fn']}, {c['clipping_style']} "
                     f"({c['groups']} group(s) at R_k={c['group_threshold']:.4g}), mode {c['clipping_mode']}, "
                     f"loss reduction {c['loss_reduction']}")
        def pct(x: float | None) -> str:
            return "-" if x is None else f"{100 * x:.1f}%"

        frac = pct(k["fraction"])
        label = "private" if k["private"] else "NON-PRIVATE diagnostic, do not publish"
        detail = "" if k["private"] else f" of {k['samples']} samples; last step {pct(k['last_step_fraction'])}"
        lines.append(f"  samples clipped (norm > R_k): {frac}{detail} [{label}: {k['source']}]")
        return "\n".join(lines)


def _epsilons(engine: Any, delta: float) -> dict[str, dict[str, Any]]:
    ledger = engine.accountant.ledger
    out: dict[str, dict[str, Any]] = {}
    for name in ("prv", "rdp", "gdp"):
        acc = engine.accountant if engine.accountant.name == name else ACCOUNTANTS[name]()
        with warnings.catch_warnings(record=True) as caught, warning_labelled_elsewhere():  # GDP labelled below
            warnings.simplefilter("always", PRVFallbackWarning)
            value = acc.get_epsilon(delta) if acc is engine.accountant else acc.epsilon_of(ledger, delta)
        kind = KINDS[name]
        if any(issubclass(w.category, PRVFallbackWarning) for w in caught):
            kind = "upper bound (RDP: PRV not usable for this history)"
        out[name] = {"value": float(value), "kind": kind}
    return out


def privacy_report(engine: Any, delta: float | None = None) -> PrivacyReport:
    """The :class:`PrivacyReport` of ``engine`` at ``delta`` (default: the engine's ``target_delta``)."""
    delta = engine.target_delta if delta is None else delta
    ledger = engine.accountant.ledger
    rel = engine._release
    style = engine.clipping_style
    groups = engine._groups
    return PrivacyReport(
        noise_multiplier=engine.noise_multiplier, sigma_history=ledger.step_history(),
        sample_rate=engine.sample_rate, batch_size=engine.batch_size, sample_size=engine.sample_size,
        steps=engine.steps, planned_steps=rel.planned_steps or None, noiseless_steps=engine.noiseless_steps,
        other_releases=ledger.releases, delta=delta, target_epsilon=engine.target_epsilon,
        accountant=engine.accountant.name, epsilon=_epsilons(engine, delta),
        epsilon_live=live_epsilon(ledger, delta),
        clipping={"max_grad_norm": engine.max_grad_norm, "clipping_fn": engine.clipping_fn,
                  "clipping_style": style if isinstance(style, str) else "custom groups",
                  "clipping_mode": engine.clipping_mode, "groups": len(groups),
                  "group_threshold": engine.clip_config.thresholds[0] if groups else engine.max_grad_norm,
                  "loss_reduction": engine.loss_reduction},
        clipped=rel.clip_counter.summary())
