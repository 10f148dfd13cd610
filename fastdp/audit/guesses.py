r"""From canary scores to membership guesses to the one-run bound: :func:`audit_from_scores` and its result.

A one-run audit (Steinke, Nasr & Jagielski 2023; :mod:`fastdp.audit.bounds`) draws each of ``m`` canaries into
the training set with probability 1/2 (:func:`draw_membership`), trains once, scores each canary (higher = more
likely included), guesses "included" for the ``k_pos`` highest scores and "excluded" for the ``k_neg`` lowest,
abstains on the rest (:func:`guesses_from_scores`), and bounds epsilon from the ``r = k_pos + k_neg`` guesses and
the ``v`` correct ones.

Trying several ``(k_pos, k_neg)`` on the same run and keeping the best would overstate the confidence, so
:func:`audit_from_scores` tests each of the ``G`` candidates at level ``beta / G`` (Bonferroni): the best bound
then holds with probability ``>= 1 - beta`` (a union bound over the ``G`` tests). The paper fixes ``k_pos`` and
``k_neg`` in advance (``G = 1``), which the argument ``guess_counts=[(k_pos, k_neg)]`` reproduces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastdp.audit.bounds import epsilon_lower_bound_one_run

__all__ = ["AuditResult", "audit_from_scores", "default_guess_counts", "draw_membership", "guesses_from_scores"]


@dataclass(frozen=True)
class AuditResult:
    """An empirical lower bound on epsilon, with what it was computed from.

    ``epsilon_lower_bound``: with probability at least ``confidence`` over the canaries' random inclusion (and
    the audited algorithm's randomness), an algorithm that is (epsilon, ``delta``)-DP gives a bound ``<=``
    epsilon. A bound above ``claimed_epsilon`` therefore refutes the claim (up to that confidence); a small
    bound proves nothing about privacy. ``num_guesses``/``num_correct``/``k_pos``/``k_neg``: the best of the
    ``candidates`` guess counts tried (each at level ``(1 - confidence) / candidates``).
    """

    epsilon_lower_bound: float
    confidence: float
    delta: float
    num_canaries: int
    num_guesses: int
    num_correct: int
    k_pos: int
    k_neg: int
    candidates: int
    claimed_epsilon: float | None = None
    method: str = "one-run (Steinke, Nasr & Jagielski 2023)"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def exceeds_claim(self) -> bool:
        """True when the measured lower bound is above the claimed epsilon (the claim is refuted)."""
        return self.claimed_epsilon is not None and self.epsilon_lower_bound > self.claimed_epsilon

    def __str__(self) -> str:
        claimed = "n/a" if self.claimed_epsilon is None else f"{self.claimed_epsilon:.3f}"
        return (f"epsilon >= {self.epsilon_lower_bound:.3f} with {100 * self.confidence:.0f}% confidence "
                f"(claimed {claimed}, delta={self.delta:.3g}; {self.num_correct}/{self.num_guesses} correct "
                f"guesses on {self.num_canaries} canaries, k_pos={self.k_pos}, k_neg={self.k_neg}; {self.method})")


def draw_membership(num_canaries: int, generator: np.random.Generator | int | None = None) -> np.ndarray:
    """``(m,)`` bool: canary ``i`` is included with probability 1/2, independently (the one-run audit's ``S``)."""
    if isinstance(num_canaries, bool) or not isinstance(num_canaries, int) or num_canaries < 1:
        raise ValueError(f"num_canaries={num_canaries!r} must be a positive integer")
    rng = generator if isinstance(generator, np.random.Generator) else np.random.default_rng(generator)
    return rng.random(num_canaries) < 0.5


def guesses_from_scores(scores: Any, k_pos: int, k_neg: int) -> np.ndarray:
    """``(m,)`` int8 guesses from ``(m,)`` scores: +1 for the ``k_pos`` highest, -1 for the ``k_neg`` lowest, else 0.

    Ties are broken by position (a stable sort), never by membership. ``k_pos + k_neg <= m``.
    """
    s = _scores(scores)
    m = s.shape[0]
    for name, k in (("k_pos", k_pos), ("k_neg", k_neg)):
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"{name}={k!r} must be a non-negative integer")
    if k_pos + k_neg > m:
        raise ValueError(f"k_pos + k_neg = {k_pos + k_neg} guesses exceed the {m} canaries")
    order = np.argsort(s, kind="stable")  # ascending
    g = np.zeros(m, dtype=np.int8)
    if k_neg:
        g[order[:k_neg]] = -1
    if k_pos:
        g[order[m - k_pos:]] = 1
    return g


def default_guess_counts(num_canaries: int) -> list[tuple[int, int]]:
    """``(k_pos, k_neg)`` candidates: equal counts ``k`` on each side, ``2k`` = 2%, 5%, 10%, 20%, 50%, 100% of m."""
    out = []
    for frac in (0.02, 0.05, 0.1, 0.2, 0.5, 1.0):
        k = max(1, int(frac * num_canaries) // 2)
        if 2 * k <= num_canaries and (k, k) not in out:
            out.append((k, k))
    return out


def _scores(scores: Any) -> np.ndarray:
    s = np.asarray(scores.detach().cpu().double() if hasattr(scores, "detach") else scores, dtype=np.float64)
    if s.ndim != 1 or s.shape[0] == 0:
        raise ValueError(f"scores must be a non-empty 1-D array (one score per canary), got shape {s.shape}")
    if not np.all(np.isfinite(s)):
        raise ValueError(f"scores contain {int(np.sum(~np.isfinite(s)))} non-finite values (NaN/inf): a score "
                         "must rank every canary; fix the scoring function")
    return s


def audit_from_scores(scores: Any, membership: Any, delta: float, *, beta: float = 0.05,
                      guess_counts: Sequence[tuple[int, int]] | None = None,
                      claimed_epsilon: float | None = None) -> AuditResult:
    r"""The one-run lower bound on epsilon from ``(m,)`` canary scores and their true ``(m,)`` bool membership.

    For each ``(k_pos, k_neg)`` in ``guess_counts`` (default :func:`default_guess_counts`): guesses
    (:func:`guesses_from_scores`), ``v`` = correct ones, and
    ``epsilon_lower_bound_one_run(m, k_pos + k_neg, v, delta, beta / len(guess_counts))``; the largest is
    returned, valid with confidence ``1 - beta`` (module docstring).
    """
    s = _scores(scores)
    mem = np.asarray(membership.cpu() if hasattr(membership, "cpu") else membership)
    if mem.shape != s.shape or mem.dtype != np.bool_:
        raise ValueError(f"membership must be a bool array of the scores' shape {s.shape}, got {mem.dtype} "
                         f"{mem.shape}")
    m = s.shape[0]
    counts = default_guess_counts(m) if guess_counts is None else [tuple(c) for c in guess_counts]
    if not counts:
        raise ValueError("guess_counts is empty: give at least one (k_pos, k_neg)")
    if isinstance(beta, bool) or not (isinstance(beta, float | int) and math.isfinite(beta) and 0 < beta < 1):
        raise ValueError(f"beta={beta!r} must be in (0, 1) (1 - confidence)")
    level = beta / len(counts)
    truth = np.where(mem, 1, -1)
    best: AuditResult | None = None
    for k_pos, k_neg in counts:
        g = guesses_from_scores(s, k_pos, k_neg)
        r = int(np.count_nonzero(g))
        v = int(np.count_nonzero(g == truth))
        eps = epsilon_lower_bound_one_run(m, r, v, delta, level)
        if best is None or eps > best.epsilon_lower_bound:
            best = AuditResult(epsilon_lower_bound=eps, confidence=1 - beta, delta=delta, num_canaries=m,
                               num_guesses=r, num_correct=v, k_pos=k_pos, k_neg=k_neg, candidates=len(counts),
                               claimed_epsilon=claimed_epsilon)
    assert best is not None
    return best
