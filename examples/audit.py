"""Audit training runs: the claimed epsilon next to an empirical lower bound measured from ONE run each.

Setting (white-box, gradient-space Dirac canaries; Steinke, Nasr & Jagielski 2023; Nasr et al. 2023): a small
classifier (an MLP on a synthetic two-class task) is trained together with ``m`` canaries, each included with
probability 1/2. Canary ``j`` is a training row whose gradient is exactly ``R e_j`` on a parameter vector
``theta`` that no real sample touches (``fastdp.audit.DiracCanaries``); its score is how far ``theta_j`` moved.
Training is full-batch (every row in every step, sample rate 1), so DP-SGD's T steps are exactly a Gaussian
mechanism with ``mu = sqrt(T) / sigma`` per canary and the engine's PRV epsilon is tight: the strongest case for
an audit. The bound comes from the one-run theorem at 95 % confidence (``delta`` = the claim's delta).

Rows: (a) non-private training (plain SGD, no clipping or noise), (b) fastdp's DP-SGD (``fastdp.PrivacyEngine``)
at epsilon = 1, 4, 8, full-batch and with Poisson batches of rate 1/4 (``fastdp.data.poisson_loader``, 4x the
steps; the sampling and the amplification it is accounted with are then audited too, a weaker audit), (c) DP-FP
(``fastdp.dpfp``) with a frozen encoder, (d) DP-FP with the encoder trained (not covered).

Run::

    python examples/audit.py            # m = 5000 canaries, 20 steps
    python examples/audit.py --quick    # m = 500, 5 steps (a smoke test)
    python examples/audit.py --no-dpfp  # rows (a) and (b) only

A bound above the claimed epsilon for a DP row would be a privacy bug; a bound below it proves nothing (an audit
is a lower bound: one run with m canaries cannot certify more than about log(m)-ish epsilon, see
docs/guide/audit.md).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

try:
    import fastdp
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fastdp
from fastdp.audit import AuditResult, DiracCanaries, audit_from_scores, audit_training

DELTA = 1e-5
LR = 0.5
CLIP = 1.0


class AuditedMLP(nn.Module):
    """An MLP classifier plus ``m`` Dirac canaries; ``forward(x, y, idx) -> (B,)`` per-sample losses."""

    def __init__(self, d_in: int, num_canaries: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, 16), nn.ReLU(), nn.Linear(16, 2))
        self.canaries = DiracCanaries(num_canaries, scale=CLIP)  # gradient norm = R: clipped to exactly R e_j

    def forward(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        task = nn.functional.cross_entropy(self.net(x), y, reduction="none")
        return self.canaries.loss_term(task, idx)


def real_data(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, generator=g)
    return x, (x @ w > 0).long()


def make_train_fn(num_canaries: int, steps: int, epsilon: float | None, seed: int, n_real: int = 500,
                  d: int = 10, sample_rate: float = 1.0):
    """``train_fn(membership) -> (model, claimed epsilon)``: SGD, private (``fastdp.PrivacyEngine``) when ``epsilon``
    is set; full batch at ``sample_rate = 1``, else ``steps`` Poisson batches (``fastdp.data.poisson_loader``)."""

    def train(membership: np.ndarray) -> tuple[AuditedMLP, float]:
        torch.manual_seed(seed)
        x_r, y_r = real_data(n_real, d, seed)
        inc = torch.from_numpy(np.flatnonzero(membership)).long()
        x = torch.cat([x_r, torch.zeros(len(inc), d)])
        y = torch.cat([y_r, torch.zeros(len(inc), dtype=torch.long)])
        idx = torch.cat([torch.full((n_real,), -1, dtype=torch.long), inc])
        n = x.shape[0]
        model = AuditedMLP(d, num_canaries)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        batch = n if sample_rate == 1.0 else max(1, round(sample_rate * n))
        engine = None
        if epsilon is not None:
            engine = fastdp.PrivacyEngine(model, batch_size=batch, sample_size=n, steps=steps, target_epsilon=epsilon,
                                          target_delta=DELTA, max_grad_norm=CLIP,
                                          noise_generator=torch.Generator().manual_seed(seed + 1))
            engine.attach(opt)
        if sample_rate == 1.0:  # every row in every step
            batches = [(x, y, idx)] * steps
        else:
            data = torch.utils.data.TensorDataset(x, y, idx)
            batches = fastdp.data.poisson_loader(data, batch_size=batch, steps=steps,
                                                 generator=torch.Generator().manual_seed(seed + 2))
        for xb, yb, ib in batches:
            model(xb, yb, ib).mean().backward()  # loss_reduction="mean": the mean over the batch drawn
            opt.step()
            opt.zero_grad()
        claimed = math.inf if engine is None else engine.get_privacy_spent()["epsilon"]
        if engine is not None:
            engine.detach()
        return model, claimed

    return train


# ------------------------------------------------------------------------------------------------------- DP-FP
class CanaryEncoder(nn.Module):
    """``h = [W x_real, g * x_canary]``: a linear map of the real features and one weight ``g_j`` per canary input.

    Real rows use the first ``d`` input features; canary ``j``'s input lives only in feature ``d + j`` (0 elsewhere),
    so its representation is ``g_j x_{d+j} e_{k+j}``: a direction no real row and no other canary uses.
    """

    def __init__(self, d: int, k: int, num_canaries: int) -> None:
        super().__init__()
        self.d = d
        self.real = nn.Linear(d, k, bias=False)
        self.gain = nn.Parameter(torch.ones(num_canaries))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.real(x[:, :self.d]), x[:, self.d:] * self.gain], dim=1)


class DPFPNet(nn.Module):
    def __init__(self, d: int, k: int, num_canaries: int) -> None:
        super().__init__()
        self.encoder = CanaryEncoder(d, k, num_canaries)
        self.classifier = nn.Linear(k + num_canaries, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(x))


DPFP_CLIP = 1.0
DPFP_A = 0.99  # canary input amplitude: |h| = 0.99 C, unclipped, so the encoder's canary gain gets a gradient


def train_dpfp(membership: np.ndarray, *, epsilon: float, steps: int, seed: int, train_encoder: bool,
               antipodal: bool, n_real: int = 500, d: int = 10, k: int = 16, micro_batches: int = 2,
               batch_size: int | None = None) -> dict:
    """DP-FP (``fastdp.dpfp.DPForwardPass``) on real rows + replace-one canaries.

    Returns ``{"model", "initial" (parameters before training), "privacy" (DPFPPrivacy), "release" ((m,) the sum
    over canary ``j``'s appearances of coordinate ``k + j`` of its released noisy representation)}``.

    Adjacency of fastdp's DP-FP claim: replace one record's input, its label unchanged. Canary ``j`` is always in
    the data with label 1; its input is ``+A e_{d+j}`` when included, and ``-A e_{d+j}`` (``antipodal``, the
    largest change, ``2A`` after the encoder) or ``0`` when not.
    """
    from fastdp.dpfp import DPForwardPass

    torch.manual_seed(seed)
    m = membership.shape[0]
    x_r, y_r = real_data(n_real, d, seed)
    sign = torch.from_numpy(np.where(membership, 1.0, -1.0 if antipodal else 0.0)).float()
    x_c = torch.zeros(m, d + m)
    x_c[torch.arange(m), d + torch.arange(m)] = DPFP_A * sign
    x = torch.cat([torch.cat([x_r, torch.zeros(n_real, m)], dim=1), x_c])
    y = torch.cat([y_r, torch.ones(m, dtype=torch.long)])
    n = x.shape[0]
    model = DPFPNet(d, k, m)
    with torch.no_grad():
        model.encoder.real.weight.mul_(0.5)
    model.encoder.requires_grad_(train_encoder)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    bs = batch_size or n // 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the opt-in's "not covered" warning: reported in the table instead
        dp = DPForwardPass(model, "classifier", clip_norm=DPFP_CLIP, target_epsilon=epsilon, sample_size=n,
                           micro_batches=micro_batches, batch_size=bs, steps=steps, delta=DELTA,
                           allow_uncovered_encoder_training=train_encoder,
                           generator=torch.Generator().manual_seed(seed + 1))
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        release = torch.zeros(m, dtype=torch.float64)
        current: dict[str, torch.Tensor] = {}

        def record(module: nn.Module, args: tuple) -> None:  # runs after DP-FP's hook: sees the noised input
            rows = current["idx"] - n_real
            keep = rows >= 0
            z = args[0].detach()[keep, k + rows[keep]]
            release.index_add_(0, rows[keep], z.double())

        handle = model.classifier.register_forward_pre_hook(record)
        for step in dp.sampler(generator=torch.Generator().manual_seed(seed + 2)).iter_steps():
            for mb in step:
                if mb:
                    idx = current["idx"] = torch.as_tensor(mb)
                    (nn.functional.cross_entropy(model(x[idx]), y[idx], reduction="sum") / bs).backward()
            opt.step()
            opt.zero_grad()
            dp.step()
    handle.remove()
    privacy = dp.get_privacy_spent()
    dp.remove()
    return {"model": model, "initial": initial, "privacy": privacy, "release": release}


def head_scores(model: DPFPNet, initial: dict, d_k: int) -> torch.Tensor:
    """White-box head score of canary ``j``: how much the head's weight on direction ``e_{k+j}`` moved to class 1."""
    w, w0 = model.classifier.weight.detach(), initial["classifier.weight"]
    delta = (w[1] - w[0]) - (w0[1] - w0[0])
    return delta[d_k:].double()


def encoder_scores(model: DPFPNet, initial: dict) -> torch.Tensor:
    """White-box encoder score of canary ``j``: ``|g_j(T) - g_j(0)|`` (nonzero only if its input was seen)."""
    return (model.encoder.gain.detach() - initial["encoder.gain"]).abs().double()


def audit_dpfp_row(num_canaries: int, steps: int, epsilon: float, seed: int, train_encoder: bool,
                   ) -> tuple[list[tuple[str, AuditResult]], float, object]:
    """One DP-FP run, audited with several scores; returns ``([(score name, result)], seconds, privacy)``.

    (c) frozen encoder, antipodal canaries: the head score (what the trained model shows) and the release score
    (the released noisy representations, the threat model of fastdp's claim: each appearance of a record is
    visible). (d) encoder trained, canaries ``+A`` vs ``0``: the encoder score.
    """
    box: dict = {}

    def train(membership: np.ndarray) -> dict:
        box.update(train_dpfp(membership, epsilon=epsilon, steps=steps, seed=seed, train_encoder=train_encoder,
                              antipodal=not train_encoder))
        return box

    t0 = time.perf_counter()
    if train_encoder:
        res = audit_training(train, lambda run: encoder_scores(run["model"], run["initial"]), num_canaries, DELTA,
                             seed=seed)
        return [("encoder", res)], time.perf_counter() - t0, box["privacy"]
    res = audit_training(train, lambda run: head_scores(run["model"], run["initial"], 16), num_canaries, DELTA,
                         seed=seed)
    rel = audit_from_scores(box["release"], res.extra["membership"], DELTA)
    return [("head", res), ("release", rel)], time.perf_counter() - t0, box["privacy"]


def audit_row(num_canaries: int, steps: int, epsilon: float | None, seed: int,
              sample_rate: float = 1.0) -> tuple[AuditResult, float, float]:
    """One training run with Dirac canaries, audited; returns (result, seconds, claimed epsilon)."""
    claimed: dict[str, float] = {}

    def train(membership: np.ndarray) -> AuditedMLP:
        model, claimed["eps"] = make_train_fn(num_canaries, steps, epsilon, seed,
                                              sample_rate=sample_rate)(membership)
        return model

    t0 = time.perf_counter()
    res = audit_training(train, lambda model: model.canaries.scores(), num_canaries, DELTA, seed=seed)
    return res, time.perf_counter() - t0, claimed["eps"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="m = 500 canaries, 5 steps (a smoke test)")
    p.add_argument("--canaries", type=int, default=None, help="number of canaries m (default 5000, quick 500)")
    p.add_argument("--steps", type=int, default=None, help="full-batch steps (default 20, quick 5)")
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 8.0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-dpfp", action="store_true", help="only rows (a) and (b)")
    args = p.parse_args(argv)
    m = args.canaries or (500 if args.quick else 5000)
    steps = args.steps or (5 if args.quick else 20)
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", message=".*GDP.*")
    rows = [("(a) non-private SGD", None, 1.0)] + [(f"(b) DP-SGD eps={e:g}", e, 1.0) for e in args.epsilons]
    rows += [(f"(b) DP-SGD eps={e:g} q=1/4", e, 0.25) for e in args.epsilons]
    print(f"one-run audit: m = {m} canaries, {steps} steps ({4 * steps} at q=1/4), delta = {DELTA:g}, "
          f"95% confidence")
    print(f"{'setting':<24}{'claimed eps':>12}{'eps lower bound':>17}{'correct/guesses':>17}{'time (s)':>10}")
    bad = []
    for name, eps, q in rows:
        res, secs, claimed = audit_row(m, steps if q == 1.0 else 4 * steps, eps, args.seed, sample_rate=q)
        print(f"{name:<24}{claimed:>12.3f}{res.epsilon_lower_bound:>17.3f}"
              f"{f'{res.num_correct}/{res.num_guesses}':>17}{secs:>10.1f}")
        if res.epsilon_lower_bound > claimed:
            bad.append(name)
    if not args.no_dpfp:
        for eps in args.epsilons:
            results, secs, privacy = audit_dpfp_row(m, steps, eps, args.seed, train_encoder=False)
            for score, res in results:
                name = f"(c) DP-FP eps={eps:g} {score}"
                print(f"{name:<24}{privacy.epsilon:>12.3f}{res.epsilon_lower_bound:>17.3f}"
                      f"{f'{res.num_correct}/{res.num_guesses}':>17}{secs:>10.1f}")
                if res.epsilon_lower_bound > privacy.epsilon:
                    bad.append(name)
        for eps in args.epsilons:
            results, secs, privacy = audit_dpfp_row(m, steps, eps, args.seed, train_encoder=True)
            res = results[0][1]
            name = f"(d) DP-FP s={privacy.noise_multiplier:.3g} enc"
            print(f"{name:<24}{'not covered':>12}{res.epsilon_lower_bound:>17.3f}"
                  f"{f'{res.num_correct}/{res.num_guesses}':>17}{secs:>10.1f}")
        print("(c): encoder frozen; 'head' scores the trained head, 'release' the released noisy representations "
              "(fastdp's DP-FP claim: replace-one-input, labels public).\n(d): encoder trained (opt-in, not "
              "covered), with the noise multiplier s of the (c) row of the same target; 'enc' scores the encoder.")
    if bad:
        print(f"PRIVACY BUG: measured lower bound above the claimed epsilon for {bad}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
