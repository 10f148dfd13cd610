"""``nn.Embedding``: token ids ``(B, *)`` (any integer dtype, never cast), output ``(B, *, d)``.

With ``T`` positions per sample and output gradient ``G_i`` ``(T, d)``, the per-sample weight gradient is
``g_i[v] = sum_{t: x_i[t] = v} G_i[t]`` (rows of ``padding_idx`` excluded: they get no gradient), so

* ghost norm (Li et al. 2021): ``||g_i||^2 = sum_{s,t} 1[x_i[s] = x_i[t]] <G_i[s], G_i[t]>`` -- the token-equality
  mask replaces the activation Gram matrix; cost ``T^2`` per sample, no vocabulary term;
* instantiation: scatter-add into ``(B, V, d)`` (memory heavy for large vocabularies);
* clipped sum: ``index_add`` of ``c_i G_i[t]`` into row ``x_i[t]``, no one-hot tensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fastdp.layers import _rounding
from fastdp.layers._factored import Factors, OneHot
from fastdp.layers.base import LayerKind, to_accumulation
from fastdp.layers.registry import register
from fastdp.layers.spec import DocRow, OracleCase, Refusal

#: the rules also cover ``nn.EmbeddingBag``, which takes the generic path (no kind of its own)
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


@register
class EmbeddingKind(LayerKind):
    module_types = (nn.Embedding,)
    foldable = True
    refusals = (
        Refusal(_EMBEDDINGS, lambda m: m.max_norm is not None,
                lambda m: f"has max_norm={m.max_norm}: forward renormalises the looked-up rows of the weight in place, "
                          "so the weight changes with the private data. Fix: max_norm=None",
                example=lambda: nn.EmbeddingBag(5, 3, max_norm=1.0),
                summary="`max_norm` (also on `nn.EmbeddingBag`)"),
        Refusal(_EMBEDDINGS, lambda m: m.scale_grad_by_freq,
                lambda m: "has scale_grad_by_freq=True: the gradient is scaled by token frequencies over the batch, "
                          "which mixes samples. Fix: scale_grad_by_freq=False", when_trainable=("weight",),
                example=lambda: nn.Embedding(5, 3, scale_grad_by_freq=True), summary="`scale_grad_by_freq=True`"),
        Refusal(_EMBEDDINGS, lambda m: m.sparse,
                lambda m: "has sparse=True: sparse gradients are not supported. Fix: sparse=False",
                when_trainable=("weight",), example=lambda: nn.Embedding(5, 3, sparse=True),
                summary="`sparse=True`"),
    )
    doc = DocRow(
        "`nn.Embedding`", "weight",
        "ghost norm `Σ_{s,t} 1[x_i[s] = x_i[t]] ⟨G_i[s], G_i[t]⟩` (token-equality mask instead of the activation Gram "
        "matrix) or instantiation by scatter-add into `(B, V, d)`; cost model `2T² < V·d`",
        "integer ids `(B, *)`, never cast; rows of `padding_idx` get no gradient; clipped sum by `index_add` (no "
        "one-hot).")

    def oracle_cases(self) -> tuple[OracleCase, ...]:
        return (OracleCase("T = B, repeated ids", lambda: nn.Embedding(4, 3), (3,), vocab=4),
                OracleCase("padding_idx, 2 position dims", lambda: nn.Embedding(6, 2, padding_idx=1), (2, 4), vocab=6),
                OracleCase("one id per sample", lambda: nn.Embedding(5, 4), (), vocab=5))

    def needs_activation(self, module: nn.Module, trainable: frozenset[str]) -> bool:
        return bool(trainable)

    def prepare(self, module: nn.Module, activation: torch.Tensor | None, grad_output: torch.Tensor) -> Any:
        ids = activation
        if ids.dim() < 1 or ids.is_floating_point():
            raise ValueError(f"Embedding expects integer token ids with a batch dimension, got {ids.dtype} "
                             f"of shape {tuple(ids.shape)}")
        B, d = grad_output.shape[0], grad_output.shape[-1]
        T = math.prod(ids.shape[1:])  # explicit: B may be 0 (empty batch)
        ids = ids.reshape(B, T)
        G = to_accumulation(grad_output).reshape(B, T, d)
        if module.padding_idx is not None:
            keep = ids != module.padding_idx
            G = G * keep.unsqueeze(-1).to(G.dtype)
        return ids, G

    def ghost_names(self, module: nn.Module) -> frozenset[str]:
        return frozenset({"weight"})

    def prefers_ghost(self, module: nn.Module, ctx: Any, name: str) -> bool:
        ids, G = ctx
        T = ids.shape[1]
        return 2 * T * T < module.num_embeddings * module.embedding_dim

    def contraction_positions(self, module: nn.Module, ctx: Any, name: str) -> int:
        return ctx[1].shape[1]

    def ghost_norm_parts(self, module: nn.Module, ctx: Any, name: str
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, G = ctx
        same = (ids.unsqueeze(2) == ids.unsqueeze(1)).unsqueeze(1)  # (B, 1, T, T), exact integer comparison
        ggt = torch.matmul(G, G.transpose(1, 2)).unsqueeze(1)
        # rows of one token whose gradients cancel: only the output gradients' Gram rounds (the mask is exact)
        return _rounding.symmetric_parts(same.to(ggt.dtype), ggt, 0, G.shape[-1])

    def factors(self, module: nn.Module, ctx: Any, name: str) -> Factors | None:
        ids, G = ctx  # g_i = sum_t onehot(x_i[t]) (x) G_i[t]
        return Factors(OneHot(ids.unsqueeze(1), module.num_embeddings), G.unsqueeze(1))

    def per_sample_grad(self, module: nn.Module, ctx: Any, name: str) -> torch.Tensor:
        ids, G = ctx
        B, T, d = G.shape
        out = G.new_zeros(B, module.num_embeddings, d)
        return out.scatter_add_(1, ids.unsqueeze(-1).expand(B, T, d), G)

    def guard_contracted(self, module: nn.Module, ctx: Any, name: str, sq: torch.Tensor) -> torch.Tensor:
        # rows of one token whose gradients cancel: the sum's rounding (index_add_ of coef_i G_t) is not the
        # instantiation's (scatter_add_ of G_t): the norm at least 2^12 u sum_t ||G_t||, which covers the difference
        ids, G = ctx
        bound = _rounding.triangle_bound_sq(torch.linalg.vector_norm(G, dim=-1).unsqueeze(1), 1.0)
        return _rounding.with_contraction(_rounding.guarded_instantiated_sq(sq, bound), bound, G.shape[1], copies=2)

    def clipped_sum(self, module: nn.Module, ctx: Any, name: str, coef: torch.Tensor) -> torch.Tensor:
        ids, G = ctx
        d = G.shape[-1]
        scaled = (G * coef.to(G.dtype).view(-1, 1, 1)).reshape(-1, d)
        out = G.new_zeros(module.num_embeddings, d)
        return out.index_add_(0, ids.reshape(-1), scaled)
