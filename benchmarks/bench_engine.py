"""Step time and peak memory of every fastdp clipping mode against non-private training, side by side.

Model: a transformer-like language model built only from Embedding / Linear / LayerNorm (plus parameter-free
attention), by default vocab 8000, d 256, 4 layers, T 128, B 16, on the CPU.

Time: every configuration gets its own copy of the model and optimizer in this one process; after warm-up the
configurations take turns, one step each, for ``--reps`` rounds (alternating repetitions, so drift on a shared
machine hits all of them alike). We report the median step time (forward + backward + optimizer step) and its
ratio to non-private training.

Memory: each configuration runs again in a fresh process; the peak resident set size during ``--mem-steps``
steps minus the resident size just before the first step is its *memory growth* (activations, gradients,
optimizer state, book-keeping), reported with its ratio to non-private training.

Usage::

    python benchmarks/bench_engine.py                 # default size, prints a table, writes JSON
    python benchmarks/bench_engine.py --quick         # tiny model, a smoke run
    python benchmarks/bench_engine.py --write-docs    # also rewrite the table in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastdp import PrivacyEngine  # noqa: E402

MODES = ["BK-MixOpt", "BK-MixGhostClip", "BK-ghost", "ghost", "instantiate"]
CONFIGS = ["non-private"] + MODES + ["non-private BiTFiT", "DP-BiTFiT"]


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.reshape(B, T, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
        x = x + self.proj(att)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device).expand(B, T)  # per-sample position ids
        x = self.tok(ids) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def build(args: argparse.Namespace, config: str, seed: int = 0):
    """Model, optimizer and (for DP configurations) an attached engine."""
    torch.manual_seed(seed)
    model = TinyLM(args.vocab, args.d, args.layers, args.heads, args.T)
    if "BiTFiT" in config:
        for n, p in model.named_parameters():
            p.requires_grad_("bias" in n)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3)
    engine = None
    if config not in ("non-private", "non-private BiTFiT"):
        mode = "BK-MixOpt" if config == "DP-BiTFiT" else config
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = PrivacyEngine(model, batch_size=args.B, sample_size=100 * args.B, noise_multiplier=1.0,
                                   clipping_mode=mode, accountant="rdp")
        engine.attach(opt)
    return model, opt, engine


def step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def batch(args: argparse.Namespace) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, args.vocab, (args.B, args.T + 1), generator=g)


def time_all(args: argparse.Namespace, configs: list[str]) -> dict[str, list[float]]:
    ids = batch(args)
    runs = {c: build(args, c) for c in configs}
    for c in configs:  # warm-up
        for _ in range(args.warmup):
            step(runs[c][0], runs[c][1], ids)
    times: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(args.reps):
        for c in configs:
            t0 = time.perf_counter()
            step(runs[c][0], runs[c][1], ids)
            times[c].append(time.perf_counter() - t0)
    return times


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process (Linux: write 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_one(args: argparse.Namespace, config: str) -> dict[str, float]:
    """Run in a fresh process: peak RSS growth over the steps of one configuration."""
    ids = batch(args)
    model, opt, _ = build(args, config)
    before = _rss_bytes()
    _reset_peak_rss()
    for _ in range(args.mem_steps):
        step(model, opt, ids)
    peak = _peak_rss_bytes()
    return {"rss_before_mb": before / 2**20, "peak_mb": peak / 2**20, "growth_mb": (peak - before) / 2**20}


def memory_all(args: argparse.Namespace, configs: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for c in configs:
        cmd = [sys.executable, __file__, "--memory-of", c, *args.passthrough]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[c] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def table(args: argparse.Namespace, times: dict[str, list[float]], mem: dict[str, dict[str, float]]) -> str:
    base_t = statistics.median(times["non-private"])
    base_m = mem.get("non-private", {}).get("growth_mb")
    lines = [f"Model: Embedding/Linear/LayerNorm transformer, vocab {args.vocab}, d {args.d}, {args.layers} layers, "
             f"T {args.T}, B {args.B}; {args.reps} alternating repetitions after {args.warmup} warm-up steps, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}.",
             "",
             "| configuration | median step (ms) | time ratio | peak memory growth (MB) | memory ratio |",
             "|---|---|---|---|---|"]
    for c, ts in times.items():
        t = statistics.median(ts)
        m = mem.get(c, {}).get("growth_mb")
        mtxt = f"{m:.0f}" if m is not None else "-"
        mratio = f"{m / base_m:.2f}x" if m is not None and base_m else "-"
        lines.append(f"| {c} | {1000 * t:.1f} | {t / base_t:.2f}x | {mtxt} | {mratio} |")
    return "\n".join(lines)


def write_docs(text: str, command: str, tag: str) -> None:
    """Replace (or append) the section between this tag's markers in docs/benchmarks.md."""
    path = ROOT / "docs" / "benchmarks.md"
    start, end = f"<!-- bench_engine:{tag}:start -->", f"<!-- bench_engine:{tag}:end -->"
    body = f"{start}\nGenerated by `{command}` on {time.strftime('%Y-%m-%d')}.\n\n{text}\n{end}"
    old = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if start in old:
        new = old[: old.index(start)] + body + old[old.index(end) + len(end):]
    else:
        new = old.rstrip() + "\n\n" + body + "\n"
    path.write_text(new)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--T", type=int, default=128)
    p.add_argument("--B", type=int, default=16)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--mem-steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny model and few repetitions (smoke run)")
    p.add_argument("--write-docs", action="store_true")
    p.add_argument("--out", default=None, help="JSON results (default benchmarks/results/engine_cpu_T{T}.json)")
    p.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.vocab, args.d, args.layers, args.T, args.B, args.reps, args.warmup = 500, 32, 1, 16, 4, 3, 1
    torch.set_num_threads(args.threads)
    # fixed-size batches on purpose (timing): silence the engine's "not Poisson-sampled" warning
    warnings.filterwarnings("ignore", message=".*Poisson.*")
    args.passthrough = [f"--vocab={args.vocab}", f"--d={args.d}", f"--layers={args.layers}", f"--heads={args.heads}",
                        f"--T={args.T}", f"--B={args.B}", f"--mem-steps={args.mem_steps}",
                        f"--threads={args.threads}"]
    if args.memory_of:
        print(json.dumps(memory_one(args, args.memory_of)))
        return
    configs = list(dict.fromkeys(["non-private", *args.configs]))
    times = time_all(args, configs)
    mem = {} if args.no_memory else memory_all(args, configs)
    text = table(args, times, mem)
    print(text)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"engine_cpu_T{args.T}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "passthrough"},
                               "times_s": times, "memory": mem}, indent=1))
    if args.write_docs:
        write_docs(text, "python benchmarks/bench_engine.py " + " ".join(argv or sys.argv[1:]),
                   tag=f"T{args.T}-B{args.B}-d{args.d}")


if __name__ == "__main__":
    main()
