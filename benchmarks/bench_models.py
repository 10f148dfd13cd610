"""Step time and peak memory of fastdp on real model classes (from configs, no downloads) against non-private
training, side by side in one run.

Models:

* ``gpt2``: Hugging Face ``GPT2LMHeadModel`` (Conv1D layers, LM head tied to the word embedding, position ids of
  shape (1, T) broadcast over the batch), scaled for a 2-core CPU by default: vocab 8000, d 256, 4 layers, 4 heads.
* ``vit``: timm ``VisionTransformer`` (patch 16, ``--d`` wide, ``--layers`` deep, class token and position
  embedding as raw parameters), images ``--image-size`` square, 10 classes.
* ``resnet``: timm ResNet-18 layout with GroupNorm (``--image-size`` images, 10 classes).

Method (same as ``bench_engine.py``): every configuration gets its own model and optimizer in this process; after
warm-up they take turns, one step each, for ``--reps`` rounds; we report median step times and ratios to
non-private training. Peak memory growth (peak RSS during ``--mem-steps`` steps minus RSS before them) is measured
per configuration in a fresh process.

Usage::

    python benchmarks/bench_models.py --model gpt2                # prints a table, writes JSON
    python benchmarks/bench_models.py --model gpt2 --write-docs   # also rewrites its table in docs/benchmarks.md
    python benchmarks/bench_models.py --model gpt2 --quick        # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_engine import _peak_rss_bytes, _reset_peak_rss, _rss_bytes, write_docs  # noqa: E402

from fastdp import PrivacyEngine  # noqa: E402

CONFIGS = ["non-private", "fastdp BK-MixOpt (default)", "non-private BiTFiT", "DP-BiTFiT"]


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    if args.model == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=args.vocab, n_positions=max(args.T, 16), n_embd=args.d,
                                      n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    import timm

    if args.model == "vit":
        return timm.models.vision_transformer.VisionTransformer(
            img_size=args.image_size, patch_size=16, embed_dim=args.d, depth=args.layers, num_heads=args.heads,
            num_classes=10)
    if args.model == "resnet":
        return timm.models.resnet.ResNet(timm.models.resnet.BasicBlock, [2, 2, 2, 2], num_classes=10,
                                         norm_layer=_group_norm)
    raise ValueError(f"unknown model {args.model!r}")


def _group_norm(num_channels: int, **kwargs: object) -> torch.nn.Module:
    return torch.nn.GroupNorm(min(32, num_channels), num_channels)


def build(args: argparse.Namespace, config: str, seed: int = 0):
    torch.manual_seed(seed)
    model = make_model(args)
    model.train()
    if "BiTFiT" in config:
        for n, p in model.named_parameters():
            p.requires_grad_("bias" in n)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    if not config.startswith("non-private"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = PrivacyEngine(model, batch_size=args.B, sample_size=100 * args.B, noise_multiplier=1.0,
                                   accountant="rdp")
        engine.attach(opt)
    return model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = data
    if x.dtype == torch.long:  # language model: next-token prediction
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    else:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if args.model == "gpt2":
        ids = torch.randint(0, args.vocab, (args.B, args.T + 1), generator=g)
        return ids[:, :-1], ids[:, 1:]
    x = torch.randn(args.B, 3, args.image_size, args.image_size, generator=g)
    return x, torch.randint(0, 10, (args.B,), generator=g)


def time_all(args: argparse.Namespace, configs: list[str]) -> dict[str, list[float]]:
    ids = batch(args)
    runs = {c: build(args, c) for c in configs}
    for c in configs:
        for _ in range(args.warmup):
            step(*runs[c], ids)
    times: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(args.reps):
        for c in configs:
            t0 = time.perf_counter()
            step(*runs[c], ids)
            times[c].append(time.perf_counter() - t0)
    return times


def memory_one(args: argparse.Namespace, config: str) -> dict[str, float]:
    ids = batch(args)
    model, opt = build(args, config)
    before = _rss_bytes()
    _reset_peak_rss()
    for _ in range(args.mem_steps):
        step(model, opt, ids)
    peak = _peak_rss_bytes()
    return {"growth_mb": (peak - before) / 2**20}


def describe(args: argparse.Namespace) -> str:
    if args.model == "gpt2":
        return (f"HF GPT-2 from config (vocab {args.vocab}, d {args.d}, {args.layers} layers, {args.heads} heads), "
                f"T {args.T}")
    if args.model == "vit":
        return (f"timm ViT (patch 16, d {args.d}, {args.layers} layers, {args.heads} heads), "
                f"{args.image_size}x{args.image_size} images")
    return f"timm ResNet-18 with GroupNorm, {args.image_size}x{args.image_size} images"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", choices=["gpt2", "vit", "resnet"])
    p.add_argument("--image-size", type=int, default=224)
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
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--write-docs", action="store_true")
    p.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.vocab, args.d, args.layers, args.T, args.B, args.reps, args.warmup = 300, 32, 1, 16, 4, 3, 1
        args.image_size = 32
    torch.set_num_threads(args.threads)
    # fixed-size batches on purpose (timing): silence the engine's "not Poisson-sampled" warning
    warnings.filterwarnings("ignore", message=".*Poisson.*")
    passthrough = [f"--model={args.model}", f"--image-size={args.image_size}", f"--vocab={args.vocab}",
                   f"--d={args.d}", f"--layers={args.layers}",
                   f"--heads={args.heads}", f"--T={args.T}", f"--B={args.B}", f"--mem-steps={args.mem_steps}",
                   f"--threads={args.threads}"]
    if args.memory_of:
        print(json.dumps(memory_one(args, args.memory_of)))
        return
    times = time_all(args, CONFIGS)
    mem: dict[str, dict[str, float]] = {}
    if not args.no_memory:
        for c in CONFIGS:
            res = subprocess.run([sys.executable, __file__, "--memory-of", c, *passthrough], capture_output=True,
                                 text=True, check=True)
            mem[c] = json.loads(res.stdout.strip().splitlines()[-1])
    base_t = statistics.median(times["non-private"])
    base_m = mem.get("non-private", {}).get("growth_mb")
    lines = [f"Model: {describe(args)}, B {args.B}; {args.reps} alternating repetitions after "
             f"{args.warmup} warm-up steps, torch {torch.__version__}, {torch.get_num_threads()} threads.",
             "",
             "| configuration | median step (ms) | time ratio | peak memory growth (MB) | memory ratio |",
             "|---|---|---|---|---|"]
    for c, ts in times.items():
        t = statistics.median(ts)
        m = mem.get(c, {}).get("growth_mb")
        mtxt = f"{m:.0f}" if m is not None else "-"
        mratio = f"{m / base_m:.2f}x" if m is not None and base_m else "-"
        lines.append(f"| {c} | {1000 * t:.1f} | {t / base_t:.2f}x | {mtxt} | {mratio} |")
    text = "\n".join(lines)
    print(text)
    size = f"T{args.T}" if args.model == "gpt2" else f"img{args.image_size}"
    out = ROOT / "benchmarks" / "results" / f"models_cpu_{args.model}_{size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "times_s": times, "memory": mem}, indent=1))
    if args.write_docs:
        write_docs(text, "python benchmarks/bench_models.py " + " ".join(argv or sys.argv[1:]),
                   tag=f"{args.model}-{size}-B{args.B}-d{args.d}")


if __name__ == "__main__":
    main()
