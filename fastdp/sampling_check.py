r"""Checking the declared sample rate against the logical batch sizes a :class:`~fastdp.PrivacyEngine` sees.

The accountant is told ``q = batch_size / sample_size`` and assumes Poisson sampling at that rate: at each step
every one of the ``N = sample_size`` examples joins the logical batch independently with probability ``q``. Then
the logical batch sizes ``n_1, n_2, ...`` are independent ``Binomial(N, q)`` and their running sum
``S_k = n_1 + ... + n_k`` is ``Binomial(kN, q)``. A loader that draws more than declared (a ``DataLoader`` with a
larger batch size, several Poisson micro-batches accumulated into one step) makes the reported epsilon too small;
one that draws fewer makes it too large (safe, but wrong). :class:`SampleRateMonitor` tests, after every step:

* **rate too high** (refuse): ``P(Binomial(kN, q) >= S_k) < alpha_k / 3``;
* **rate too low** (warn once): ``P(Binomial(kN, q) <= S_k) < alpha_k / 3``;
* **one batch too large** (refuse): ``P(Binomial(N, q) >= n_k) < alpha_k / 3``,

with ``alpha_k = alpha / (k (k + 1))``. Since ``sum_k alpha / (k (k + 1)) = alpha``, a correct Poisson loader
is flagged at *any* step of an arbitrarily long run with probability at most ``alpha`` (default ``1e-6``): the
test is valid from the first step on, with no fixed horizon. A 2x mismatch at ``B = 16`` is flagged at step 2-3
(too many) or about step 8 (too few); a 4x one at step 1.

**Fixed-size batches** (a plain shuffled ``DataLoader``) have the right mean but no variance, and the accountant's
Poisson assumption does not hold for them. The monitor warns when the first ``k*`` logical batches all have the
same size, where ``k*`` is the smallest ``k >= 2`` with ``P(n_1 = ... = n_k) = sum_v P(n = v)^k <
FIXED_SIZE_ALPHA`` under Poisson sampling (``k* = 4`` at ``B = 16``, so epochs of 4 batches are caught). The
events "the first k are equal" are nested, so this single test has false-alarm probability below
``FIXED_SIZE_ALPHA = 1e-3`` (it only warns). When ``q = 1`` every batch is the whole data set and nothing is tested
for fixed size.

Empty steps count as size 0. The check needs nothing but the sizes; it costs at most three ``scipy.stats.binom``
calls per step, and none for a step whose size and running total are on the side of their mean that a test cannot
reject (the median bound in :meth:`SampleRateMonitor.observe`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats

__all__ = ["DEFAULT_ALPHA", "FIXED_SIZE_ALPHA", "SampleRateMonitor", "Verdict"]

#: overall false-alarm probability of the rate test for a correct Poisson loader (over the whole run)
DEFAULT_ALPHA = 1e-6
#: false-alarm probability of the fixed-size-batch warning for a correct Poisson loader
FIXED_SIZE_ALPHA = 1e-3
#: the fixed-size test is not run when it would need more leading steps than this
MAX_FIXED_SIZE_STEPS = 64


@dataclass
class Verdict:
    """Outcome of one observation: ``refuse`` (an error message: the step must not be released), ``warnings``."""

    refuse: str | None = None
    warnings: list[str] = field(default_factory=list)


def _fixed_size_steps(n: int, q: float, alpha: float) -> int | None:
    """Smallest ``k >= 2`` with ``sum_v P(Binomial(n, q) = v)^k < alpha`` (``None`` if above the cap)."""
    if q >= 1.0:
        return None
    lo, hi = stats.binom.ppf([1e-12, 1 - 1e-12], n, q)
    v = np.arange(max(lo - 1, 0), min(hi + 1, n) + 1)
    pmf = stats.binom.pmf(v, n, q)
    for k in range(2, MAX_FIXED_SIZE_STEPS + 1):
        if float(np.sum(pmf ** k)) + 2e-12 < alpha:  # + the mass outside [lo, hi]
            return k
    return None


class SampleRateMonitor:
    """Sequential test of the logical batch sizes against Poisson sampling at ``q = batch_size / sample_size``.

    Args:
        batch_size: the declared expected logical batch size ``B``.
        sample_size: the data set size ``N``.
        alpha: overall false-alarm probability of the rate test (see the module docstring).
    """

    def __init__(self, batch_size: int, sample_size: int, alpha: float = DEFAULT_ALPHA) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha={alpha!r} must be in (0, 1)")
        self.batch_size = int(batch_size)
        self.sample_size = int(sample_size)
        self.q = self.batch_size / self.sample_size
        self.alpha = float(alpha)
        self.steps = 0  # observed logical steps
        self.total = 0  # S_k, the sum of their sizes
        self.first_sizes: list[int] = []  # sizes of the leading steps (fixed-size test)
        self.warned_low = False
        self.warned_fixed = False
        self.refused: str | None = None  # sticky: once refused, every further step is refused
        self._fixed_k = _fixed_size_steps(self.sample_size, self.q, FIXED_SIZE_ALPHA)

    # ------------------------------------------------------------------ test
    def observe(self, size: int) -> Verdict:
        """Record the logical batch size of one step and test; the caller releases the step only without
        ``refuse``."""
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise ValueError(f"logical batch size {size!r} must be an integer >= 0")
        size = int(size)
        self.steps += 1
        self.total += size
        k, n, q, s = self.steps, self.sample_size, self.q, self.total
        out = Verdict()
        if self.refused is not None:
            out.refuse = self.refused
            return out
        if q >= 1.0:  # every batch must be the whole data set: more is impossible under the declared rate
            if size > n:
                out.refuse = self._too_many(f"a logical batch of {size} samples, more than sample_size={n}")
            return out
        a_k = self.alpha / (k * (k + 1)) / 3.0
        mean = s / k
        # A binomial's median m lies in [floor(nq), ceil(nq)] and P(X >= m), P(X <= m) >= 1/2 > a_k: a count at
        # most floor(nq) cannot fail the upper tests, one at least ceil(nq) not the lower one (nq = batch_size
        # here, k * batch_size for the total), so the scipy calls are made only where they can decide.
        B = self.batch_size
        if size > n:
            out.refuse = self._too_many(f"a logical batch of {size} samples, more than sample_size={n}")
        elif size > B and stats.binom.sf(size - 1, n, q) < a_k:
            out.refuse = self._too_many(
                f"a logical batch of {size} samples at step {k}, which Poisson sampling at rate "
                f"q={q:.4g} (mean {self.batch_size}) produces with probability "
                f"{stats.binom.sf(size - 1, n, q):.2g}")
        elif s > k * B and stats.binom.sf(s - 1, k * n, q) < a_k:
            out.refuse = self._too_many(
                f"a mean logical batch size of {mean:.4g} over the first {k} steps (total {s}; probability "
                f"{stats.binom.sf(s - 1, k * n, q):.2g} under the declared rate)")
        if out.refuse is not None:
            self.refused = out.refuse
            return out
        if not self.warned_low and s < k * B and stats.binom.cdf(s, k * n, q) < a_k:
            self.warned_low = True
            out.warnings.append(
                f"the logical batches average {mean:.4g} samples over the first {k} steps, far below the declared "
                f"batch_size={self.batch_size} (probability {stats.binom.cdf(s, k * n, q):.2g} under Poisson "
                f"sampling at q={q:.4g}). The reported epsilon assumes the declared rate and overstates the "
                "privacy loss (safe, but loose); declare the true expected logical batch size.")
        if len(self.first_sizes) < MAX_FIXED_SIZE_STEPS:
            self.first_sizes.append(size)
            if (not self.warned_fixed and self._fixed_k is not None and len(self.first_sizes) == self._fixed_k
                    and len(set(self.first_sizes)) == 1):
                self.warned_fixed = True
                out.warnings.append(
                    f"the first {self._fixed_k} logical batches all had exactly {size} samples, which looks like "
                    "fixed-size batches (a plain shuffled DataLoader): under Poisson sampling at "
                    f"q={q:.4g} that has probability below {FIXED_SIZE_ALPHA:g}. The reported epsilon assumes "
                    "Poisson sampling (each example joins each batch independently with probability "
                    "batch_size/sample_size); with fixed-size batches it does not hold as stated. Use "
                    "fastdp.data.poisson_loader (docs/guide/data.md).")
        return out

    def _too_many(self, what: str) -> str:
        return (
            f"the engine saw {what}, but it was built with batch_size={self.batch_size} and "
            f"sample_size={self.sample_size} (sample rate q={self.q:.4g}); the observed mean logical batch size is "
            f"{self.total / self.steps:.4g}. The loader draws more than declared, so the reported epsilon would be "
            "too small: this step was refused and nothing was released (steps already taken were accounted at the "
            "declared rate and understate epsilon). Fix: build a new engine declaring the true expected LOGICAL "
            "batch size (with gradient accumulation over k micro-batches per optimizer.step() the logical batch is "
            "their sum, k times the micro-batch size), or sample with fastdp.data.poisson_loader(dataset, "
            "batch_size=..., sample_size=...).")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Plain-python snapshot (saved in the engine's checkpoint)."""
        return {"steps": self.steps, "total": self.total, "first_sizes": list(self.first_sizes),
                "warned_low": self.warned_low, "warned_fixed": self.warned_fixed, "refused": self.refused}

    def load_state_dict(self, state: dict[str, Any], *, max_steps: int) -> None:
        """Restore :meth:`state_dict`, validating it (``steps <= max_steps``, sizes non-negative integers)."""
        if not isinstance(state, dict):
            raise ValueError(f"state['sampling'] must be a dict, got {type(state).__name__}")

        def count(key: str, upper: float = math.inf) -> int:
            v = state.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= upper:
                raise ValueError(f"state['sampling'][{key!r}]={v!r} must be an integer in [0, {upper}]")
            return v

        steps = count("steps", max_steps)
        total = count("total")
        sizes = state.get("first_sizes")
        if (not isinstance(sizes, list) or len(sizes) > min(steps, MAX_FIXED_SIZE_STEPS)
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in sizes)
                or sum(sizes) > total):
            raise ValueError(f"state['sampling']['first_sizes']={sizes!r} must be a list of at most "
                             f"min(steps, {MAX_FIXED_SIZE_STEPS}) non-negative integers summing to <= total")
        refused = state.get("refused")
        if refused is not None and not isinstance(refused, str):
            raise ValueError(f"state['sampling']['refused']={refused!r} must be None or a message")
        self.steps, self.total, self.first_sizes = steps, total, list(sizes)
        self.warned_low = bool(state.get("warned_low", False))
        self.warned_fixed = bool(state.get("warned_fixed", False))
        self.refused = refused
