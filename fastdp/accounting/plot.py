"""Plots of a planned run for ``python -m fastdp.accounting --plot eps.png``: epsilon against steps, and the noise
multiplier sigma against the target epsilon.

:func:`plot_data` computes the curves (no matplotlib needed; tested against :func:`get_epsilon` and
:func:`get_noise_multiplier`), :func:`write_plot` draws them to an image with matplotlib (an optional dependency:
``pip install matplotlib``; the non-interactive ``Agg`` backend is used, no display needed).

Left panel: ``epsilon(t)`` of ``t = 1 .. steps`` steps at the run's sigma, per accountant (GDP marked as an
approximation). Right panel: the sigma each accountant calibrates for ``steps`` steps at target epsilons spread
from 1/4 to 4 times the run's final epsilon (first accountant). PRV costs 0.3-8 s per point; ``--accountants rdp``
draws in well under a second.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

from fastdp.accounting.calibration import get_epsilon, get_noise_multiplier

__all__ = ["plot_data", "write_plot", "MATPLOTLIB_MISSING"]

MATPLOTLIB_MISSING = ("--plot needs matplotlib, which is not installed: pip install matplotlib (or run without "
                      "--plot for the table only)")

_LABEL = {"prv": "PRV (tight upper bound)", "rdp": "RDP (upper bound)", "gdp": "GDP (APPROXIMATION)"}


def plot_data(*, sigma: float, sample_rate: float, steps: int, delta: float, accountants: list[str],
              points: int = 12) -> dict[str, Any]:
    """The curves to plot.

    Returns:
        ``{"sigma", "sample_rate", "steps", "delta", "step_grid": [t...], "epsilon": {name: [eps(t)...]},
        "targets": [e...], "sigma_for_target": {name: [sigma(e)...]}}``; ``step_grid`` is ``points`` distinct
        integers from 1 to ``steps`` (fewer if ``steps < points``); the targets are ``min(points, 7)`` values
        geometrically spaced from 1/4 to 4 times the final epsilon of ``accountants[0]``; a target an accountant
        cannot reach gives NaN.
    """
    if isinstance(points, bool) or not isinstance(points, int) or points < 2:
        raise ValueError(f"--plot-points={points!r} must be an integer >= 2")
    grid = sorted({int(round(t)) for t in np.linspace(1, steps, min(points, steps))})
    curves: dict[str, list[float]] = {}
    sig_curves: dict[str, list[float]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GDP's approximation warning (labelled) and PRV's fallback (still a bound)
        for name in accountants:
            curves[name] = [get_epsilon(sigma, sample_rate, t, delta, accountant=name) for t in grid]
        final = curves[accountants[0]][-1]
        targets = [] if not (math.isfinite(final) and final > 0) else \
            [float(x) for x in final * np.geomspace(0.25, 4.0, min(points, 7))]
        for name in accountants:
            sig_curves[name] = []
            for e in targets:
                try:
                    sig_curves[name].append(get_noise_multiplier(e, delta, sample_rate, steps=steps,
                                                                 accountant=name))
                except ValueError:  # not reachable with any sigma
                    sig_curves[name].append(float("nan"))
    return {"sigma": sigma, "sample_rate": sample_rate, "steps": steps, "delta": delta, "step_grid": grid,
            "epsilon": curves, "targets": targets, "sigma_for_target": sig_curves}


def write_plot(data: dict[str, Any], path: str) -> None:
    """Draw :func:`plot_data`'s curves to ``path`` (format from its suffix, e.g. ``.png``).

    Raises:
        RuntimeError: matplotlib is not installed (:data:`MATPLOTLIB_MISSING`).
    """
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(MATPLOTLIB_MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, eps in data["epsilon"].items():
        ax1.plot(data["step_grid"], eps, marker=".", label=_LABEL.get(name, name))
    ax1.set_xlabel("steps")
    ax1.set_ylabel(f"epsilon (delta={data['delta']:.3g})")
    ax1.set_title(f"sigma={data['sigma']:.4g}, q={data['sample_rate']:.4g}")
    ax1.legend()
    for name, sig in data["sigma_for_target"].items():
        ax2.plot(data["targets"], sig, marker=".", label=_LABEL.get(name, name))
    ax2.set_xlabel("target epsilon")
    ax2.set_ylabel("noise multiplier sigma")
    ax2.set_title(f"{data['steps']} steps, q={data['sample_rate']:.4g}")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
