"""Peak memory per rank of the private FSDP2 step against non-private FSDP2, N = 1, 2, 4 CPU processes (gloo).

The model (an Embedding, ``L`` blocks of Linear(d, 4d) -> GELU -> Linear(4d, d) -> LayerNorm with a residual, a
head) is built on the meta device, ``fully_shard`` ed per block and at the root, then materialised: no rank ever
holds the whole model outside FSDP's all-gathers. Each rank runs a fixed batch (weak scaling: what falls with N is
the model's share). One fresh world per (N, method); each rank runs a warm-up step, then resets its peak RSS
(``/proc/self/clear_refs``) and runs the measured step (forward, backward, ``optimizer.step()``). Reported per
method: the largest rank's peak RSS during the step, and its growth over the RSS before the step. glibc is told to
map large blocks directly (``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the RSS at once.

    python benchmarks/fsdp_memory.py                 # d 512, L 4, N 1 2 4
    python benchmarks/fsdp_memory.py --quick         # a smoke run

Results go to ``benchmarks/results/fsdp-memory-cpu.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

METHODS = ("non-private FSDP2", "fastdp FSDP2")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.ln(h + self.down(nn.functional.gelu(self.up(h))))


class Model(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _worker(rank: int, world: int, port: int, method: str, cfg: dict, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    with torch.device("meta"):
        model = Model(cfg["vocab"], cfg["d"], cfg["layers"])
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if method == "fastdp FSDP2":
        import fastdp

        engine = fastdp.PrivacyEngine(model, batch_size=cfg["batch"] * world, sample_size=10_000,
                                      noise_multiplier=1.0, verify_structure=False)
        engine.attach(opt)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    y = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)

    def step() -> None:
        logits = model(x)
        nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()

    step()  # warm-up: FSDP's buffers, the engine's first pass
    dist.barrier()
    before = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    step()
    peak = _rss("VmHWM")
    res = [None] * world
    dist.all_gather_object(res, {"rank": rank, "rss_before": before, "peak": peak})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.barrier()  # every rank done with its collectives: gloo can abort a rank torn down while a peer still talks
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, method: str, cfg: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "res.json")
        mp.spawn(_worker, args=(world, _free_port(), method, cfg, out), nprocs=world, join=True)
        with open(out) as f:
            ranks = json.load(f)
    top = max(ranks, key=lambda r: r["peak"])
    return {"world": world, "method": method, "peak_mb": top["peak"] / 2**20,
            "growth_mb": max(r["peak"] - r["rss_before"] for r in ranks) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=4, help="samples per rank")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.d, a.layers, a.worlds = 64, 2, [1, 2]
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the spawned ranks
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = {"d": a.d, "layers": a.layers, "vocab": a.vocab, "batch": a.batch, "seq": a.seq}
    params = a.vocab * a.d * 2 + a.vocab + a.layers * (8 * a.d * a.d + 7 * a.d)
    rows = []
    for world in a.worlds:
        for method in METHODS:
            r = measure(world, method, cfg)
            rows.append(r)
            print(f"N={world} {method:18s} peak RSS {r['peak_mb']:8.1f} MB  growth during the step "
                  f"{r['growth_mb']:7.1f} MB", flush=True)
    res = {"config": cfg, "parameters": params, "fp32_model_mb": params * 4 / 2**20, "torch": torch.__version__,
           "rows": rows}
    if not a.quick:
        path = HERE / "results" / "fsdp-memory-cpu.json"
        path.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
