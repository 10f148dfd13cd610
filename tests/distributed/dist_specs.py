"""Models, shards and the oracle of the distributed worlds (shared by the ranks and the pytest process).

Everything here is deterministic from a :class:`Spec`: the model (built from a seed), every rank's shard of the
logical batch (a list of physical batches, generated from the seed in rank order), and the engine's arguments. A
rank runs its shard through a distributed engine and returns what it released; the parent computes the
brute-force batch-of-one oracle (tests/oracle.py: float64 copy, one backward per sample, clip, sum) on the UNION of
the shards and compares.

Sizes: the mixed model has vocabulary 11, T=7 positions, widths 6 / 5 / 4 and 3 classes; shards of 0-7 samples, so
batch sizes equal to a width or T occur. The noise model is a Linear(500, 400) (200,400 coordinates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from model_oracle import check_discriminates, lm_loss
from oracle import (
    choose_R,
    clipped_sum,
    make_groups,
    max_clip_factor,
    oracle_model,
    per_sample_grads,
    trainable_names,
)
from torch import nn

D = torch.float64


# --------------------------------------------------------------------------------------------- models


class Mixed(nn.Module):
    """Embedding -> Conv1d -> (+ a buffer) -> LayerNorm -> Linear -> mean over positions -> Linear head:
    ids (B, 7) -> (B, 3). The buffer is part of the function, so rank 0's must be broadcast too."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.conv = nn.Conv1d(6, 5, 3, padding=1)
        self.norm = nn.LayerNorm(5)
        self.fc = nn.Linear(5, 4)
        self.head = nn.Linear(4, 3)
        self.register_buffer("shift", 0.5 * torch.randn(5))
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.3)
            self.norm.bias.normal_(0.0, 0.3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.emb(ids).transpose(1, 2)).transpose(1, 2) * (1 + self.shift)
        h = torch.tanh(self.fc(torch.tanh(self.norm(h))))
        return self.head(h.mean(1))


class TinyViT(nn.Module):
    """Patch Linear, a raw class token (1, 1, d) and position embedding (1, P + 1, d) (the generic path), LayerNorm,
    head: patches (B, 4, 5) -> (B, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(5, 6)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 6))
        self.pos_embed = nn.Parameter(0.5 * torch.randn(1, 5, 6))
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], 1) + self.pos_embed
        h = torch.tanh(self.norm(h))
        return self.head(h[:, 0] + h.mean(1))


class TiedLM(nn.Module):
    """Embedding whose weight is also the LM head's (GPT-2's tie), one Linear between: ids (B, 7) -> (B, 7, 13)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.fc = nn.Linear(6, 6)
        self.lm_head = nn.Linear(6, 13, bias=False)
        self.lm_head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.fc(self.emb(ids))))


class Big(nn.Module):
    """Linear(500, 400): 200,400 coordinates for the noise statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(500, 400)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Many(nn.Module):
    """60 Linear(2, 2) layers named layer000 ... layer059 in a chain: 120 trainable tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({f"layer{i:03d}": nn.Linear(2, 2) for i in range(60)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


class SmallCNN(nn.Module):
    """Conv2d(1, 2, 3) on 16 x 16 images (T = 256: its per-sample gradients by the grouped kernel or patches, the
    faster timed once per shape on each rank), GroupNorm(1, 2) over 256 positions (per-sample gradients from the
    fused backward over the batch folded into the channels), a strided Conv2d (T = 64), mean pool, Linear head:
    (B, 1, 16, 16) -> (B, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 2, 3, padding=1)
        self.gn = nn.GroupNorm(1, 2)
        self.c2 = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.head = nn.Linear(3, 3)
        with torch.no_grad():
            self.gn.weight.normal_(1.0, 0.3)
            self.gn.bias.normal_(0.0, 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.c2(torch.tanh(self.gn(self.c1(x)))))
        return self.head(h.mean((2, 3)))


class Folded(nn.Module):
    """Embedding, then the positions folded into the rows before a Linear and a LayerNorm (``x.reshape(-1, d)``, as
    OPT's decoder layers): ids (B, 7) -> (B, 3). Each rank's probe verifies its own fold."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.fc = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        h = torch.tanh(self.norm(self.fc(self.emb(ids).reshape(-1, 6))))
        return self.head(h.view(B, T, 5).mean(1))


class OutsideUse(nn.Module):
    """A Linear's weight also read by its parent with ``F.linear`` (outside the Linear's call, as HF Mamba's mixer reads
    its convolution's weight): ids (B, 7) -> (B, 3). Each rank's structure probe gives the weight to the root's
    per-sample replay."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.lin = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.emb(ids)).mean(1)
        return self.head(torch.tanh(F.linear(self.lin(h), self.lin.weight)))


class Chosen(nn.Module):
    """Rows chosen by the data: each sample's token of the largest id (``h[one_hot_mask]``, one row per sample) through
    a trainable Linear, and the tokens of id below 5 (``h[ids < 5]``, a different number per sample) through a
    frozen Linear, written back into ``(B, d)`` by each row's sample (``index_add``): ids (B, 7) -> (B, 3). Each
    rank's guard checks every call's rows (fastdp.layers.row_owners)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.pick = nn.Linear(6, 6)
        self.unpadded = nn.Linear(6, 6).requires_grad_(False)
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        one = F.one_hot(ids.argmax(1), ids.shape[1]).bool()
        picked = torch.tanh(self.pick(h[one]))  # (B, d): one row per sample
        real = ids < 5
        f = torch.tanh(self.unpadded(h[real]))  # (N, d): the real tokens of every sample
        pooled = torch.zeros_like(picked).index_add(0, real.nonzero()[:, 0], f)
        return self.head(picked + pooled)


class Cancel(nn.Module):
    """float32 (the others are float64): a Linear and a 1x1 Conv1d read the same inputs ``(B, 6, 64)``, which share a
    large offset (as trained embeddings do), and return ``(B, 6, 32)`` each (wide enough that every mode takes
    their ghost norms); the loss is their inner product with
    targets ``y`` (:func:`cancel_loss`). A sample whose targets sum to 0 over the positions has a gradient that
    cancels to far below its terms: the ghost norms' rounding bound flags it, and on the CPU its gradients are
    instantiated and summed apart from the contraction (``fastdp.layers._rounding.exact_flagged``), on each rank
    before the all-reduce."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 32)
        self.conv = nn.Conv1d(64, 32, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.proj(x), 0.5 * self.conv(x.transpose(1, 2)).transpose(1, 2)], dim=-1)


def cancel_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out * y.unsqueeze(-1)).flatten(1).sum(1)


def _gpt2() -> nn.Module:
    from model_oracle import LMWrap, gpt2

    return LMWrap(gpt2())


BUILDERS = {"mixed": Mixed, "vit": TinyViT, "tied": TiedLM, "big": Big, "gpt2": _gpt2, "many": Many, "cnn": SmallCNN,
            "folded": Folded, "outside": OutsideUse, "chosen": Chosen, "cancel": Cancel}
#: models kept in float32 (the rounding of float32 ghost norms is what they test)
FLOAT32 = frozenset({"cancel"})


def build(kind: str, seed: int) -> nn.Module:
    """The float64 model ``kind`` with parameters from ``seed`` (the same on every process)."""
    torch.manual_seed(seed)
    model = BUILDERS[kind]()
    if kind not in FLOAT32:
        model = model.to(D)
    model.train()
    return model


def cls_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y, reduction="none")


def mse_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (out - y).pow(2).flatten(1).sum(1)


LOSSES = {"mixed": cls_loss, "vit": cls_loss, "tied": lm_loss, "big": mse_loss, "gpt2": lm_loss, "cnn": cls_loss,
          "folded": cls_loss, "outside": cls_loss, "chosen": cls_loss, "cancel": cancel_loss}


def make_batch(kind: str, n: int, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """One physical batch of ``n`` samples ``((x,), y)`` for model ``kind``."""
    g = torch.Generator().manual_seed(seed)
    if kind in ("mixed", "folded", "outside", "chosen"):
        return (torch.randint(0, 11, (n, 7), generator=g),), torch.randint(0, 3, (n,), generator=g)
    if kind == "vit":
        return (torch.randn(n, 4, 5, generator=g, dtype=D),), torch.randint(0, 3, (n,), generator=g)
    if kind == "cnn":
        return (torch.randn(n, 1, 16, 16, generator=g, dtype=D),), torch.randint(0, 3, (n,), generator=g)
    if kind == "tied":
        ids = torch.randint(0, 13, (n, 7), generator=g)
        return (ids,), ids
    if kind == "gpt2":
        ids = torch.randint(0, 61, (n, 7), generator=g)
        return (ids,), ids
    if kind == "cancel":  # samples 0, 2, 4, ... of each batch: targets summing to 0 over positions (they cancel)
        x = torch.randn(n, 6, 64, generator=g) + 300 * torch.randn(1, 1, 64, generator=g)
        y = torch.randn(n, 6, 32, generator=g)
        y[0::2] -= y[0::2].mean(1, keepdim=True)
        return (x,), y
    if kind == "big":
        return (torch.randn(n, 500, generator=g, dtype=D),), torch.randn(n, 400, generator=g, dtype=D)
    raise ValueError(kind)


# --------------------------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class Spec:
    """One logical step on N ranks.

    ``shards[r]``: rank r's physical batch sizes (several = virtual batches; 0 = a 0-row batch run through forward
    and backward), or ``None``: rank r calls ``engine.empty_step()`` instead of ``optimizer.step()``.
    ``model_seeds``: a different model seed per rank (rank 0's parameters must be broadcast; the oracle uses them).
    ``style="groups"``: an explicit partition of the trainable names (even / odd positions).
    ``frozen``: parameter names frozen (``requires_grad=False``) before the engine is built.
    """

    model: str
    shards: tuple[tuple[int, ...] | None, ...]
    seed: int = 0
    mode: str = "BK-MixOpt"
    fn: str = "abadi"
    style: str = "all-layer"
    reduction: str = "mean"
    bitfit: bool = False
    batch_size: int | None = None
    model_seeds: tuple[int, ...] | None = None
    where: str = "middle"
    frozen: tuple[str, ...] = ()
    #: ``views > 1``: each physical batch is run as that many identical calls inside ``engine.same_samples()``, the
    #: loss the sum over them (each sample's gradient ``views`` times its own), after a clean pass of the batch that
    #: ``optimizer.zero_grad()`` forgets (dist_cases.run_views); one physical batch per rank
    views: int = 1

    @property
    def world_size(self) -> int:
        return len(self.shards)

    @property
    def samples(self) -> int:
        return sum(sum(s) for s in self.shards if s is not None)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size if self.batch_size is not None else max(1, self.samples)


def shard_batches(spec: Spec) -> list[list[tuple]]:
    """Every rank's physical batches (generated in rank order from ``spec.seed``)."""
    out, k = [], 0
    for shard in spec.shards:
        mine = []
        for n in shard or ():
            mine.append(make_batch(spec.model, n, 1000 * spec.seed + k))
            k += 1
        out.append(mine)
    return out


def prepare(model: nn.Module, spec: Spec) -> None:
    """Freeze what the spec freezes (``frozen``; DP-BiTFiT: biases and the head train)."""
    params = dict(model.named_parameters())
    for n in spec.frozen:
        params[n].requires_grad_(False)
    if spec.bitfit:
        from fastdp.bitfit import freeze_all_but_bias

        freeze_all_but_bias(model, keep=("head",) if hasattr(model, "head") else ())


def resolve_style(spec: Spec, names: list[str]) -> Any:
    if spec.style == "groups":
        return [names[0::2], names[1::2]] if len(names) > 1 else [names]
    return spec.style


def oracle_for(spec: Spec, R: float | None = None) -> dict[str, Any]:
    """The oracle of one logical step on the union of the shards: R (chosen so that clipping matters, unless
    given), the wanted released gradient ``sum_i C_i g_i / B`` and the absolute tolerance."""
    model = build(spec.model, spec.model_seeds[0] if spec.model_seeds else spec.seed)
    prepare(model, spec)
    names = trainable_names(model)
    union = [b for bs in shard_batches(spec) for b in bs]
    om = oracle_model(model)
    style = resolve_style(spec, names)
    groups = make_groups(om, style, names)
    psg = per_sample_grads(om, lambda out, y: spec.views * LOSSES[spec.model](out, y), union, names)
    B = spec.global_batch_size
    if spec.samples:
        if R is None:
            R = choose_R(psg, groups, spec.where, gap=1e-6)
            want = clipped_sum(psg, groups, spec.fn, R, B)
            check_discriminates(psg, groups, spec.fn, R, B, want, 1e-6)
        else:
            want = clipped_sum(psg, groups, spec.fn, R, B)
        atol = 1e-10 * max(1.0, max_clip_factor(psg, groups, spec.fn, R))
    else:
        R, atol = (1.0 if R is None else R), 1e-10
        want = {n: torch.zeros_like(p) for n, p in om.named_parameters() if n in names}
    return {"R": R, "want": want, "atol": atol, "names": names}


def noise_std_bound(n: int) -> float:
    """Relative bound on |std_hat / std - 1| for ``n`` Gaussian coordinates: 8 standard errors (1 / sqrt(2n))."""
    return 8.0 / math.sqrt(2 * n)
