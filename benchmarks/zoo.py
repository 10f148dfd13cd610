"""Workloads and methods of the benchmark harness (``benchmarks/run.py``).

A *workload* is a model family, a size (sequence length T for text, image side for images), a batch size and a
width set (``WIDTHS``: ``cpu`` scaled for a 2-core CPU; ``paper`` GPT-2 small / RoBERTa-base / ViT-Base widths for a
GPU; ``wide`` GPT-2-small width with 2 layers; ``p16`` a ViT with patch 16; ``tiny`` for smoke runs and tests).
Every model is built from a config with random weights: nothing is downloaded.

A *method* is how one training step is taken:

* ``non-private``: ordinary PyTorch training of every parameter;
* ``non-private BiTFiT``: ordinary training of the biases only;
* ``fastdp <mode>``: fastdp's ``PrivacyEngine`` with that ``clipping_mode`` (``BK-MixOpt`` is the default);
* ``DP-BiTFiT``: fastdp's default mode on the biases only;
* ``Opacus hooks`` / ``Opacus ghost``: Opacus 1.6 (``benchmarks/opacus_runner.py``), per-sample gradients
  instantiated by hooks, or its two-backward ghost clipping;
* variants of the default mode for A/B measurements (``VARIANTS``): ``fastdp BK-MixOpt, on arrival off``
  (instantiation on arrival switched off, docs/internals/clipping.md), ``fastdp BK-MixOpt, no probe``
  (``verify_structure=False``), ``fastdp BK-MixOpt, no loss check`` (``verify_loss=False``), ``fastdp BK-MixOpt,
  strict loss check`` (``verify_loss="strict"``: the loss traced at every step), ``fastdp BK-MixOpt, slack 1.25``
  (``fastdp.layers._matmul.INSTANTIATION_SLACK`` 1.25 during its steps, ``MODULE_SWITCHES``) and ``fastdp BK-MixOpt,
  full Grams`` (ghost norms from whole ``T x T`` Gram matrices instead of strips: ``fastdp.layers._grams.GRAM_STRIP``
  at one strip) and ``fastdp BK-MixOpt, aligned Grams`` (at a ``T`` that is not a multiple of 16, a leading strip of
  ``T mod 16`` rows: ``fastdp.layers._grams.GRAM_ALIGN``, not adopted) and ``fastdp BK-MixOpt, no fold guard``
  (``fastdp.layers.fold_guard.RowGuard`` replaced by :class:`NoRowGuard`: what the guard costs a model whose layers
  see the batch folded, OPT); ``non-private, bf16 autocast`` and ``fastdp BK-MixOpt, bf16 autocast`` (the forward
  pass and the loss under ``torch.autocast(dtype=torch.bfloat16)`` on the workload's device, ``AUTOCAST``; the
  parameters stay float32), and ``fastdp BK-MixOpt, bf16 autocast, bf16 products`` (the same with the clipping
  stage's products of bf16 calls in bf16 with float32 accumulation: ``fastdp.layers._matmul.BF16_PRODUCTS``), and
  ``fastdp BK-MixOpt, noise buckets`` and ``fastdp BK-MixOpt, noise per parameter`` (one step's noise drawn in buckets
  of parameters on the CPU too, or per parameter on CUDA too: ``fastdp.noise.NOISE_BUCKETS``, CUDA's default), and
  ``fastdp BK-MixOpt, Gram chunks 1024`` / ``4096`` (Gram rows wider than that summed in chunks of columns on every
  device: ``fastdp.layers._grams.GRAM_CHUNK``, the CPU's default at 1024, CUDA's at 4096), and ``fastdp BK-MixOpt,
  guard per parameter`` (each ghost norm's cancellation guard on its own: ``fastdp.layers._guard_batch.BATCHED``
  off).

Every method uses SGD (no momentum), per-sample clipping to norm 1 and noise multiplier 1 where private, and the
same loss: cross-entropy, mean over the batch (classification) or over all B·T tokens (language modelling).
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastdp.modes import CLIPPING_MODES as _MODES

TEXT_MODELS = ("gpt2", "roberta", "tinylm", "tinycls", "opt")
IMAGE_MODELS = ("vit", "resnet", "cnn")
MODELS = TEXT_MODELS + IMAGE_MODELS
FASTDP_MODES: tuple[str, ...] = tuple(_MODES)
DEFAULT_METHOD = f"fastdp {FASTDP_MODES[0]}"
class NoRowGuard:
    """The rows-chosen-by-the-data guard (``fastdp.layers.fold_guard.RowGuard``) replaced by nothing, for the A/B
    variant ``no fold guard``: no mode entered, no row taken as chosen."""

    def start(self, args: object, kwargs: object, batch: int | None = None) -> None:
        return None

    def row_chosen(self, tree: object) -> bool:
        return False

    def unowned(self, tree: object, rows: int, fold: int) -> str | None:
        return None

    def __enter__(self) -> NoRowGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


#: A/B variants of the default mode: method name -> (engine keyword arguments, engine attributes set after attach)
VARIANTS: dict[str, tuple[dict, dict]] = {
    f"{DEFAULT_METHOD}, on arrival off": ({}, {"_capture.on_arrival": False}),
    f"{DEFAULT_METHOD}, no probe": ({"verify_structure": False}, {}),
    f"{DEFAULT_METHOD}, no loss check": ({"verify_loss": False}, {}),
    f"{DEFAULT_METHOD}, strict loss check": ({"verify_loss": "strict"}, {}),  # every pass traced
    f"{DEFAULT_METHOD}, slack 1.25": ({}, {}),
    f"{DEFAULT_METHOD}, full Grams": ({}, {}),
    f"{DEFAULT_METHOD}, aligned Grams": ({}, {}),
    f"{DEFAULT_METHOD}, no fold guard": ({}, {}),
    f"{DEFAULT_METHOD}, bf16 autocast": ({}, {}),
    f"{DEFAULT_METHOD}, bf16 autocast, bf16 products": ({}, {}),
    f"{DEFAULT_METHOD}, noise buckets": ({}, {}),
    f"{DEFAULT_METHOD}, noise per parameter": ({}, {}),
    f"{DEFAULT_METHOD}, Gram chunks 1024": ({}, {}),
    f"{DEFAULT_METHOD}, Gram chunks 4096": ({}, {}),
    f"{DEFAULT_METHOD}, guard per parameter": ({}, {}),
}
#: methods whose forward pass and loss run under ``torch.autocast`` in this dtype (mixed precision)
AUTOCAST: dict[str, torch.dtype] = {
    "non-private, bf16 autocast": torch.bfloat16,
    f"{DEFAULT_METHOD}, bf16 autocast": torch.bfloat16,
    f"{DEFAULT_METHOD}, bf16 autocast, bf16 products": torch.bfloat16,
}
#: A/B variants that set a fastdp module constant for the duration of each of their steps: method -> [(module,
#: attribute, value)]
MODULE_SWITCHES: dict[str, list[tuple[str, str, object]]] = {
    f"{DEFAULT_METHOD}, slack 1.25": [("fastdp.layers._matmul", "INSTANTIATION_SLACK", 1.25)],
    f"{DEFAULT_METHOD}, full Grams": [("fastdp.layers._grams", "GRAM_STRIP", {"cpu": (1, 1), "default": (1, 1)})],
    f"{DEFAULT_METHOD}, aligned Grams": [("fastdp.layers._grams", "GRAM_ALIGN", {"cpu": 16, "cuda": 16})],
    # what the rows-chosen-by-the-data guard costs a model with folded calls (OPT): it replaced by a no-op
    f"{DEFAULT_METHOD}, no fold guard": [("fastdp.layers.fold_guard", "RowGuard", NoRowGuard)],
    # the clipping stage's products of bf16 calls in bf16 with float32 accumulation (off by default)
    f"{DEFAULT_METHOD}, bf16 autocast, bf16 products": [("fastdp.layers._matmul", "BF16_PRODUCTS",
                                                          frozenset({"cpu", "cuda"}))],
    # one step's noise in buckets of parameters, one draw and one fused add each (off by default)
    f"{DEFAULT_METHOD}, noise buckets": [("fastdp.noise", "NOISE_BUCKETS", frozenset({"cpu", "cuda"}))],
    f"{DEFAULT_METHOD}, noise per parameter": [("fastdp.noise", "NOISE_BUCKETS", frozenset())],
    # wide Gram rows summed in chunks of columns on every device (the CPU's default is 1024, CUDA's 4096)
    f"{DEFAULT_METHOD}, Gram chunks 1024": [("fastdp.layers._grams", "GRAM_CHUNK", {"cpu": 1024, "cuda": 1024})],
    f"{DEFAULT_METHOD}, Gram chunks 4096": [("fastdp.layers._grams", "GRAM_CHUNK", {"cpu": 4096, "cuda": 4096})],
    # each ghost norm's guard on its own (before fastdp/layers/_guard_batch.py): about 40 small operations each
    f"{DEFAULT_METHOD}, guard per parameter": [("fastdp.layers._guard_batch", "BATCHED", False)],
}
METHODS = ("non-private", "non-private BiTFiT", *(f"fastdp {m}" for m in FASTDP_MODES), "DP-BiTFiT",
           "Opacus hooks", "Opacus ghost", *VARIANTS, "non-private, bf16 autocast")
DEFAULT_SIZES = {"gpt2": (64, 256, 1024), "roberta": (64, 256, 1024), "vit": (32, 64, 128),
                 "resnet": (32, 64, 128), "tinylm": (64, 128), "tinycls": (64, 128, 256), "cnn": (32,)}
#: (vocab or classes, width d, layers, heads, ViT patch) per width set; a set need not define every model
WIDTHS = {
    "cpu": {"gpt2": (8000, 256, 4, 4, 0), "roberta": (8000, 256, 4, 4, 0), "vit": (10, 192, 4, 3, 8),
            "resnet": (10, 0, 0, 0, 0), "tinylm": (8000, 256, 4, 4, 0), "tinycls": (8000, 256, 4, 4, 0),
            "cnn": (10, 16, 0, 0, 0), "opt": (8000, 256, 4, 4, 0)},
    "paper": {"gpt2": (50257, 768, 12, 12, 0), "roberta": (50265, 768, 12, 12, 0), "vit": (10, 768, 12, 12, 16),
              "resnet": (10, 0, 0, 0, 0)},
    "wide": {"gpt2": (8000, 768, 2, 12, 0)},
    "p16": {"vit": (10, 192, 4, 3, 16)},
    "probe": {"gpt2": (256, 64, 2, 4, 0)},
    "tiny": {"gpt2": (50, 16, 1, 2, 0), "roberta": (50, 16, 1, 2, 0), "vit": (10, 16, 1, 2, 4),
             "resnet": (10, 0, 0, 0, 0), "tinylm": (50, 16, 1, 2, 0), "tinycls": (50, 16, 1, 2, 0),
             "cnn": (10, 4, 0, 0, 0), "opt": (50, 16, 2, 2, 0)},
}


class Unsupported(Exception):
    """A method cannot run a workload; the message says why (shown in the results as "not supported")."""


@dataclass(frozen=True)
class Workload:
    """One model at one size. ``size`` is T (text) or the image side (images); ``widths`` names a ``WIDTHS`` set."""

    model: str
    size: int
    batch: int
    widths: str = "cpu"

    def __post_init__(self) -> None:
        if self.model not in WIDTHS.get(self.widths, {}):
            raise ValueError(f"width set {self.widths!r} has no {self.model!r}; sets with it: "
                             f"{[k for k, v in WIDTHS.items() if self.model in v]}")

    @property
    def is_text(self) -> bool:
        return self.model in TEXT_MODELS

    @property
    def tag(self) -> str:
        wid = "" if self.widths == "cpu" else f"-{self.widths}"
        return f"{self.model}{wid}-{'T' if self.is_text else 'img'}{self.size}-B{self.batch}"

    @property
    def tokens(self) -> int:
        """Sequence length seen by the transformer blocks (ViT: patches + class token; ResNet: 0)."""
        if self.is_text:
            return self.size
        if self.model == "vit":
            return (self.size // WIDTHS[self.widths]["vit"][4]) ** 2 + 1
        return 0

    @property
    def is_transformer(self) -> bool:
        return self.model in ("gpt2", "roberta", "vit", "tinylm", "tinycls", "opt")

    def describe(self) -> str:
        vocab, d, layers, heads, patch = WIDTHS[self.widths][self.model]
        if self.model == "gpt2":
            return f"HF GPT-2 LM (vocab {vocab}, d {d}, {layers} layers, {heads} heads, tied head), T {self.size}"
        if self.model == "opt":
            return (f"HF OPT LM (vocab {vocab}, d {d}, {layers} layers, {heads} heads, tied head; its MLP and final "
                    f"norms see the batch folded into (B*T, d)), T {self.size}")
        if self.model == "roberta":
            return f"HF RoBERTa classifier (vocab {vocab}, d {d}, {layers} layers, {heads} heads), T {self.size}"
        if self.model == "vit":
            return (f"timm ViT (patch {patch}, d {d}, {layers} layers, {heads} heads), {self.size}x{self.size} "
                    f"images ({self.tokens} tokens)")
        if self.model == "tinylm":
            return (f"plain-torch LM (Embedding/Linear/LayerNorm, vocab {vocab}, d {d}, {layers} layers, {heads} "
                    f"heads), T {self.size}")
        if self.model == "tinycls":
            return (f"plain-torch classifier (untied Embedding, separate q/k/v Linear, LayerNorm, 2-class head; vocab "
                    f"{vocab}, d {d}, {layers} layers, {heads} heads), T {self.size}")
        if self.model == "cnn":
            return f"small CNN (2 conv + GroupNorm + linear, {d} channels), {self.size}x{self.size} images"
        return f"timm ResNet-18 with GroupNorm, {self.size}x{self.size} images"


def default_batch(model: str, size: int, widths: str) -> int:
    """Batch sizes with about the same work per step at every size: B·T = 2048 tokens for text, about 2048 tokens
    for the ViT (B 64, 32, 8 at 32², 64², 128² with patch 8), 64k pixels for the ResNet (B 64, 16, 4)."""
    if widths == "paper":
        return {"gpt2": 16, "roberta": 32}.get(model, 64) if model in TEXT_MODELS else 64
    if model in TEXT_MODELS:
        return max(2, 2048 // size)
    if model == "vit":
        return {32: 64, 64: 32, 128: 8}.get(size, max(2, 2048 // ((size // 8) ** 2 + 1)))
    return max(2, 65536 // (size * size))


def make_model(w: Workload) -> nn.Module:
    """Build the workload's model from its config, random weights, in train mode."""
    vocab, d, layers, heads, patch = WIDTHS[w.widths][w.model]
    if w.model == "tinylm":
        return TinyLM(vocab, d, layers, heads, w.size).train()
    if w.model == "tinycls":
        return TinyClassifier(vocab, d, layers, heads, w.size, classes=2).train()
    if w.model == "cnn":
        return nn.Sequential(nn.Conv2d(3, d, 3, padding=1), nn.GroupNorm(4, d), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(d, 2 * d, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                             nn.Linear(32 * d, vocab)).train()
    if w.model in TEXT_MODELS:
        import transformers

        transformers.logging.set_verbosity_error()
        if w.model == "gpt2":
            cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=max(w.size, 16), n_embd=d, n_layer=layers,
                                          n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            model = transformers.GPT2LMHeadModel(cfg)
        elif w.model == "opt":
            cfg = transformers.OPTConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers,
                                         num_attention_heads=heads, ffn_dim=4 * d, max_position_embeddings=w.size,
                                         word_embed_proj_dim=d, dropout=0.0, attention_dropout=0.0, layerdrop=0.0)
            model = transformers.OPTForCausalLM(cfg)
        else:
            cfg = transformers.RobertaConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers,
                                             num_attention_heads=heads, intermediate_size=4 * d,
                                             max_position_embeddings=w.size + 2, num_labels=2,
                                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
            model = transformers.RobertaForSequenceClassification(cfg)
    elif w.model == "vit":
        import timm

        model = timm.models.vision_transformer.VisionTransformer(
            img_size=w.size, patch_size=patch, embed_dim=d, depth=layers, num_heads=heads, num_classes=vocab)
    elif w.model == "resnet":
        import timm

        model = timm.models.resnet.ResNet(timm.models.resnet.BasicBlock, [2, 2, 2, 2], num_classes=vocab,
                                          norm_layer=_group_norm)
    else:
        raise ValueError(f"unknown model {w.model!r}; choose from {MODELS}")
    return model.train()


def _group_norm(num_channels: int, **kwargs: object) -> nn.Module:
    return nn.GroupNorm(min(32, num_channels), num_channels)


class _Block(nn.Module):
    """Pre-norm transformer block of plain torch layers; attention itself is parameter-free (SDPA, causal)."""

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
    """A language model of ``nn.Embedding``, ``nn.Linear`` and ``nn.LayerNorm`` only: ids (B, T) -> logits
    (B, T, vocab); position ids are built per sample, (B, T), so nothing is broadcast over the batch."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(T, device=ids.device).expand(B, T))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class _QKVBlock(nn.Module):
    """Post-norm encoder block as people write it in plain torch: separate ``q``, ``k``, ``v`` projections of one
    input, bidirectional SDPA, an output projection and a GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = (m(x).reshape(B, T, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, d)
        x = self.ln1(x + self.o(att))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


class TinyClassifier(nn.Module):
    """A sequence classifier of torch layers only: untied token and position embeddings, :class:`_QKVBlock` s, the
    first token's state through a small head. ids (B, T) -> logits (B, classes)."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, max_len: int, classes: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(_QKVBlock(d, heads) for _ in range(layers))
        self.head = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, classes))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(T, device=ids.device).expand(B, T))
        for blk in self.blocks:
            x = blk(x)
        return self.head(x[:, 0])


def forward_fn(w: Workload) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """``forward(model, inputs) -> logits``."""
    if w.model in ("gpt2", "roberta", "opt"):
        return lambda m, x: m(input_ids=x).logits
    return lambda m, x: m(x)


def task(w: Workload) -> str:
    """``"lm"`` (logits (B, T, V), targets (B, T)) or ``"cls"`` (logits (B, C), targets (B,))."""
    return "lm" if w.model in ("gpt2", "tinylm", "opt") else "cls"


def make_batch(w: Workload, device: torch.device, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic batch ``(inputs, targets)`` on ``device``."""
    g = torch.Generator().manual_seed(seed)
    vocab = WIDTHS[w.widths][w.model][0]
    if w.model in ("gpt2", "tinylm", "opt"):
        ids = torch.randint(0, vocab, (w.batch, w.size + 1), generator=g)
        x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    elif w.model in ("roberta", "tinycls"):
        x = torch.randint(3, vocab, (w.batch, w.size), generator=g)
        y = torch.randint(0, 2, (w.batch,), generator=g)
    else:
        x = torch.randn(w.batch, 3, w.size, w.size, generator=g)
        y = torch.randint(0, vocab, (w.batch,), generator=g)
    return x.to(device), y.to(device)


def loss_fn(w: Workload) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if task(w) == "lm":
        return lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return F.cross_entropy


@contextlib.contextmanager
def patched(patches: list[tuple[object, str, object]]) -> Iterator[None]:
    """Within the context, each ``(owner, attribute, value)`` set; the previous values restored after."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def make_step(w: Workload, method: str, device: torch.device, seed: int = 0, lr: float = 1e-4,
              verify_structure: bool = True) -> Callable[[tuple[torch.Tensor, torch.Tensor]], None]:
    """Build the model and optimizer of one method and return ``step(batch)``: one full training step.
    ``verify_structure=False`` builds fastdp's engine without the structure probe (the largest-batch search).

    Raises:
        Unsupported: the method cannot run this workload (the message says why).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    torch.manual_seed(seed)
    model = make_model(w).to(device)
    if "BiTFiT" in method:
        from fastdp.bitfit import freeze_all_but_bias

        freeze_all_but_bias(model)
    forward, loss = forward_fn(w), loss_fn(w)
    if method.startswith("Opacus"):
        from opacus_runner import OpacusUnsupported, make_opacus_step

        try:
            opacus_step = make_opacus_step(model, method.split()[1], task=task(w), batch_size=w.batch,
                                           sample_size=100 * w.batch, noise_multiplier=1.0, max_grad_norm=1.0,
                                           lr=lr, forward=forward)
        except OpacusUnsupported as e:
            raise Unsupported(str(e)) from e

        def checked_step(data: tuple[torch.Tensor, torch.Tensor]) -> None:
            try:  # some refusals only show on the first step
                opacus_step(data)
            except OpacusUnsupported as e:
                raise Unsupported(str(e)) from e

        return checked_step
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    engine = None
    if method.startswith("fastdp") or method == "DP-BiTFiT":
        from fastdp import PrivacyEngine

        mode = method.split()[1].rstrip(",") if method.startswith("fastdp") else FASTDP_MODES[0]
        kwargs, attrs = VARIANTS.get(method, ({}, {}))
        if not verify_structure:
            kwargs = {**kwargs, "verify_structure": False}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = PrivacyEngine(model, batch_size=w.batch, sample_size=100 * w.batch, noise_multiplier=1.0,
                                   max_grad_norm=1.0, clipping_mode=mode, accountant="rdp", **kwargs)
        engine.attach(opt)
        for name, value in attrs.items():  # private switches (dotted paths), for A/B measurements only
            owner_path, _, attr = name.rpartition(".")
            owner = engine
            for part in filter(None, owner_path.split(".")):
                owner = getattr(owner, part, None)
            if owner is None or not hasattr(owner, attr):
                raise RuntimeError(f"method {method!r} sets PrivacyEngine.{name}, which this fastdp does not have; "
                                   "update zoo.VARIANTS")
            setattr(owner, attr, value)

    cast = AUTOCAST.get(method)

    def plain_step(data: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = data
        with torch.autocast(device.type, dtype=cast) if cast is not None else contextlib.nullcontext():
            value = loss(forward(model, x), y)
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    switches = [(importlib.import_module(mod), attr, value) for mod, attr, value in MODULE_SWITCHES.get(method, [])]

    def step(data: tuple[torch.Tensor, torch.Tensor]) -> None:
        with patched(switches):
            plain_step(data)

    step.engine = engine  # type: ignore[attr-defined]  # (None for non-private methods; probe_stats for reports)
    step.parts = (model, opt)  # type: ignore[attr-defined]  # (benchmarks/phases.py times a step's parts)
    return step
