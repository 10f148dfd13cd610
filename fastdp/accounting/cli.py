"""Command line: ``python -m fastdp.accounting`` / ``fastdp-accounting``.

Given ``--sigma`` it prints epsilon under every accountant side by side; given ``--target-epsilon`` instead it
prints the calibrated noise multiplier for each accountant. Bad input exits with status 2 and a one-line
error.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from collections.abc import Sequence

from fastdp.accounting.base import check_delta, check_sample_rate, check_steps
from fastdp.accounting.calibration import get_epsilon, get_noise_multiplier, steps_from_epochs
from fastdp.accounting.gdp import GDP_WARNING
from fastdp.accounting.plot import MATPLOTLIB_MISSING, plot_data, write_plot
from fastdp.accounting.prv import PRVFallbackWarning
from fastdp.accounting.registry import ACCOUNTANTS, resolve_name

__all__ = ["build_parser", "main"]

_NOTES = {
    "rdp": "upper bound (Renyi DP, improved conversion)",
    "prv": "upper bound (PRV, eps_error=0.01); tight",
    "gdp": "APPROXIMATION (CLT), may underestimate",
}
_FALLBACK_NOTE = "upper bound from RDP: PRV not usable here (tiny sigma / huge epsilon / tiny delta)"

EXAMPLES = """\
examples:
  epsilon of 1000 steps at sigma=1.0, q=0.01, delta=1e-5 under all accountants:
    python -m fastdp.accounting --sigma 1.0 --sample-rate 0.01 --steps 1000 --delta 1e-5
  same, from batch size / dataset size / epochs (delta defaults to 1/(2*sample_size)):
    python -m fastdp.accounting --sigma 1.3 --batch-size 256 --sample-size 60000 --epochs 15
  noise multiplier for a target (epsilon=3, delta=1e-5):
    python -m fastdp.accounting --target-epsilon 3 --sample-rate 0.01 --steps 1000 --delta 1e-5
  plot epsilon against steps (and sigma against target epsilon) to a PNG (needs matplotlib):
    python -m fastdp.accounting --sigma 1.0 --sample-rate 0.01 --steps 1000 --delta 1e-5 --plot eps.png
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    parser = argparse.ArgumentParser(
        prog="fastdp-accounting",
        description=(
            "DP-SGD privacy accounting (Poisson-subsampled Gaussian mechanism). With --sigma: print epsilon "
            "under the RDP, PRV and GDP accountants. With --target-epsilon: print the noise multiplier each "
            "accountant needs. Steps from epochs use ceil(epochs / sample_rate). RDP and PRV give "
            "upper bounds; "
            "GDP (CLT) is an approximation that can underestimate epsilon."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--sigma",
        "--noise-multiplier",
        dest="sigma",
        type=float,
        help="noise multiplier (noise std / clipping norm); prints epsilon",
    )
    what.add_argument("--target-epsilon", type=float, help="target epsilon; prints the noise multiplier")
    parser.add_argument(
        "--sample-rate",
        "-q",
        type=float,
        help="Poisson sampling rate q in (0, 1] (or give --batch-size and --sample-size)",
    )
    parser.add_argument("--batch-size", type=int, help="expected batch size (q = batch_size / sample_size)")
    parser.add_argument("--sample-size", "-n", type=int, help="dataset size")
    horizon = parser.add_mutually_exclusive_group()
    horizon.add_argument("--steps", type=int, help="number of noisy steps")
    horizon.add_argument("--epochs", type=float, help="number of epochs (steps = ceil(epochs / q))")
    parser.add_argument(
        "--delta", type=float, help="delta in (0, 1); default 1/(2*sample_size) when --sample-size is given"
    )
    parser.add_argument(
        "--accountants", default="rdp,prv,gdp", help="comma-separated subset of rdp,prv,gdp (default: all)"
    )
    parser.add_argument(
        "--plot", metavar="PATH", help="also draw epsilon against steps and sigma against target epsilon for the "
        "planned run to PATH (e.g. eps.png; needs matplotlib); with --target-epsilon the run uses the first "
        "accountant's sigma"
    )
    parser.add_argument("--plot-points", type=int, default=12, help="points per curve of --plot (default 12)")
    return parser


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.6g}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 on success, 2 on bad input)."""
    parser = build_parser()
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list:
        parser.print_help()
        return 0
    args = parser.parse_args(args_list)
    try:
        if args.sigma is None and args.target_epsilon is None:
            raise ValueError("give --sigma (to compute epsilon) or --target-epsilon (to compute sigma)")
        names = [resolve_name(n) for n in args.accountants.split(",") if n.strip()]
        if not names:
            raise ValueError(f"--accountants must name at least one of {', '.join(ACCOUNTANTS)}")
        if args.sample_rate is not None:
            if args.batch_size is not None:
                raise ValueError("give either --sample-rate or --batch-size/--sample-size, not both")
            q = check_sample_rate(args.sample_rate, name="--sample-rate")
        else:
            if args.batch_size is None or args.sample_size is None:
                raise ValueError("give --sample-rate, or both --batch-size and --sample-size")
            if args.sample_size < 1:
                raise ValueError(f"--sample-size must be >= 1, got {args.sample_size}")
            if not 1 <= args.batch_size <= args.sample_size:
                raise ValueError(
                    f"--batch-size must be in [1, sample_size={args.sample_size}], got {args.batch_size}"
                )
            q = args.batch_size / args.sample_size
        if args.steps is None and args.epochs is None:
            raise ValueError("give --steps or --epochs")
        steps = (
            check_steps(args.steps, name="--steps")
            if args.steps is not None
            else steps_from_epochs(args.epochs, q)
        )
        if args.delta is None:
            if args.sample_size is None:
                raise ValueError("give --delta (or --sample-size for the default delta = 1/(2*sample_size))")
            delta = 1.0 / (2 * args.sample_size)
        else:
            delta = check_delta(args.delta, name="--delta")
        if args.plot is not None:
            try:
                import matplotlib  # noqa: F401  (fail before the computations)
            except ImportError:
                raise ValueError(MATPLOTLIB_MISSING) from None
            if args.plot_points < 2:
                raise ValueError(f"--plot-points={args.plot_points} must be >= 2")
        rows = []
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=GDP_WARNING.split(" (")[0])  # the table marks GDP
            for name in names:
                start = time.perf_counter()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", PRVFallbackWarning)
                    if args.sigma is not None:
                        value = get_epsilon(args.sigma, q, steps, delta, accountant=name)
                    else:
                        value = get_noise_multiplier(
                            args.target_epsilon, delta, q, steps=steps, accountant=name
                        )
                fell_back = any(issubclass(w.category, PRVFallbackWarning) for w in caught)
                for w in caught:
                    if not issubclass(w.category, PRVFallbackWarning):
                        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
                note = _FALLBACK_NOTE if fell_back else _NOTES[name]
                rows.append((name, value, time.perf_counter() - start, note))
    except ValueError as exc:
        parser.error(str(exc))  # exits with status 2
    if args.sigma is not None:
        print(f"epsilon for sigma={args.sigma:g}, q={q:.6g}, steps={steps}, delta={delta:.3g}")
        header = "epsilon"
    else:
        print(
            f"noise multiplier for target epsilon={args.target_epsilon:g}, q={q:.6g}, steps={steps}, "
            f"delta={delta:.3g}"
        )
        header = "sigma"
    print(f"{'accountant':<11}{header:>12}  {'time':>7}  note")
    for name, value, seconds, note in rows:
        print(f"{name:<11}{_fmt(value):>12}  {seconds:>6.2f}s  {note}")
    if args.plot is not None:
        sigma = args.sigma if args.sigma is not None else rows[0][1]
        data = plot_data(sigma=sigma, sample_rate=q, steps=steps, delta=delta, accountants=names,
                         points=args.plot_points)
        write_plot(data, args.plot)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
