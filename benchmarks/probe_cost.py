"""Cost of the structure probe (fastdp/probe.py): 100 steps with and without it, same process, alternating.

Models: a tiny-config HF GPT-2 (d=64, 2 layers, T=64, B=16) and a small CNN (2 conv + linear, 32x32 images, B=16).
Prints, per model, the median time of a 100-step run with the probe on and off and their ratio, plus the probe's own
time from ``engine.probe_stats`` (paid once per input signature). Run: ``python benchmarks/probe_cost.py [--steps N]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

from fastdp import PrivacyEngine


def gpt2():
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).logits

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (16, 64), generator=g)

    def loss(m):
        logits = m(ids)
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    return Wrap(), loss


def cnn():
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                          nn.Linear(512, 10))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    return model, lambda m: nn.functional.cross_entropy(m(x), y)


def run(build, verify: bool, steps: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model, loss = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, batch_size=16, sample_size=10_000, noise_multiplier=1.0,
                               verify_structure=verify)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine.attach(opt)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss(model).backward()
        opt.step()
        opt.zero_grad()
    return time.perf_counter() - t0, engine.probe_stats["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    for name, build in (("gpt2 d=64 L=2 T=64 B=16", gpt2), ("cnn 32x32 B=16", cnn)):
        on, off, probe = [], [], []
        for _ in range(a.rounds):  # alternating
            t, p = run(build, True, a.steps)
            on.append(t)
            probe.append(p)
            off.append(run(build, False, a.steps)[0])
        m_on, m_off = statistics.median(on), statistics.median(off)
        print(f"{name}: {a.steps} steps with probe {m_on:.2f}s, without {m_off:.2f}s, ratio {m_on / m_off:.4f}; "
              f"probe itself {statistics.median(probe):.3f}s ({100 * statistics.median(probe) / m_off:.2f}% of the "
              "run)")


if __name__ == "__main__":
    main()
