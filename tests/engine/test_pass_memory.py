"""What one clipping pass holds (the performance issue's memory levers), checked by behaviour and against the
batch-of-one oracle:

* a record's kept input and output gradient (or per-sample gradients) are dropped as soon as the clipped sums of
  its parameters exist (``fastdp.clipped_sums._drop_kept``), so the sums take their place instead of piling up on
  top of them; GhostClip's replays keep theirs until they run;
* a book-keeping clipped sum scales its smaller operand into one scratch buffer reused from layer to layer within
  a pass (``fastdp.layers._matmul.reused_scratch``), never outside one.
"""

from __future__ import annotations

import pytest
import torch
from oracle import assert_grads_close, mse_per_sample, oracle_release, run_engine_once
from torch import nn

import fastdp.clipped_sums
from fastdp.layers import _matmul


def _mlp(widths=(12, 16, 16, 16, 3)) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double()


class _Seq(nn.Module):
    """Linear layers over a sequence (T positions): book-keeping contractions over B T rows."""

    def __init__(self, d=16, T=5):
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 3)
        self.T = T

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).mean(dim=1)


@pytest.fixture
def spy(monkeypatch):
    """Per clipped-sum contraction, how many records had been dropped before it; and every drop."""
    log = {"dropped": 0, "at_sum": [], "drops": []}
    real_drop, real_sum = fastdp.clipped_sums._drop_kept, _matmul.clipped_sum

    def drop(rec):
        log["dropped"] += 1
        log["drops"].append(type(rec.module).__name__)
        real_drop(rec)
        assert rec.summed and rec.activation is None and rec.ctx is None and rec.psg is None
        assert all(g is None for g in rec.grads)

    def contraction(A, G, coef, narrow=None):
        log["at_sum"].append(log["dropped"])
        return real_sum(A, G, coef, narrow)

    monkeypatch.setattr(fastdp.clipped_sums, "_drop_kept", drop)
    monkeypatch.setattr(_matmul, "clipped_sum", contraction)
    return log


@pytest.mark.parametrize("B", [1, 3, 16])  # 16 = a layer width: the batch size equal to another dimension
@pytest.mark.parametrize("mode", ["BK-MixOpt", "BK-ghost", "BK-MixGhostClip"])
def test_records_are_dropped_as_their_sums_are_formed(spy, mode, B):
    model = _mlp()
    g = torch.Generator().manual_seed(B)
    x, y = torch.randn(B, 12, generator=g, dtype=torch.float64), torch.randn(B, 3, generator=g, dtype=torch.float64)
    want = oracle_release(model, mse_per_sample, [(x, y)], fn="abadi", R=0.1, batch_size=B)
    _, _, got = run_engine_once(model, mse_per_sample, [(x, y)], batch_size=B, R=0.1, fn="abadi",
                                style="all-layer", mode=mode, reduction="mean", verify_structure=False)
    assert_grads_close(got, want)
    # four Linear calls: each contraction (weight, by book-keeping) ran after the records before it were dropped
    assert spy["drops"] == ["Linear"] * 4
    assert spy["at_sum"] == [0, 1, 2, 3]


def test_per_position_layers_drop_in_order_and_stay_exact(spy):
    model = _Seq().double()
    B, T = 4, 5
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(B, T, 16, generator=g, dtype=torch.float64), torch.randn(B, 3, generator=g, dtype=torch.float64)
    want = oracle_release(model, mse_per_sample, [(x, y)], fn="abadi", R=0.05, batch_size=B)
    _, _, got = run_engine_once(model, mse_per_sample, [(x, y)], batch_size=B, R=0.05, fn="abadi",
                                style="all-layer", mode="BK-ghost", reduction="sum", verify_structure=False)
    assert_grads_close(got, want)
    assert spy["at_sum"] == [0, 1, 2]


def test_ghostclip_replays_keep_their_records_until_they_run(spy):
    """``"ghost"`` mode forms its sums by replaying each layer after every norm is known: nothing is dropped before
    the replays (each needs its record's input and output gradient), and the release is still exact."""
    model = _mlp()
    B = 5
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(B, 12, generator=g, dtype=torch.float64), torch.randn(B, 3, generator=g, dtype=torch.float64)
    want = oracle_release(model, mse_per_sample, [(x, y)], fn="abadi", R=0.1, batch_size=B)
    _, _, got = run_engine_once(model, mse_per_sample, [(x, y)], batch_size=B, R=0.1, fn="abadi",
                                style="all-layer", mode="ghost", reduction="mean", verify_structure=False)
    assert_grads_close(got, want)
    assert spy["drops"] == [] and spy["at_sum"] == []


def test_scaled_operands_share_one_buffer_within_a_pass_only():
    c = torch.rand(4).view(-1, 1, 1, 1)
    small, big = torch.randn(4, 1, 3, 5), torch.randn(4, 1, 7, 5)
    outside = _matmul._scaled(small, c)
    torch.testing.assert_close(outside, small * c, rtol=0, atol=0)
    assert _matmul._scaled(small, c).data_ptr() != outside.data_ptr()  # outside a pass: fresh tensors
    with _matmul.reused_scratch():
        first = _matmul._scaled(small, c)
        torch.testing.assert_close(first, small * c, rtol=0, atol=0)
        ptr = first.data_ptr()
        second = _matmul._scaled(small.flip(0), c)  # same size: written into the same buffer
        assert second.data_ptr() == ptr
        torch.testing.assert_close(second, small.flip(0) * c, rtol=0, atol=0)
        grown = _matmul._scaled(big, c)  # larger: the buffer grows
        torch.testing.assert_close(grown, big * c, rtol=0, atol=0)
        again = _matmul._scaled(small, c)  # smaller again: a view of the grown buffer
        assert again.data_ptr() == grown.data_ptr()
        torch.testing.assert_close(again, small * c, rtol=0, atol=0)
        # a low-precision operand with a float32 factor: the product is promoted, as X * c is
        half = torch.randn(4, 1, 3, 5).bfloat16()
        out = _matmul._scaled(half, c.float())
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, half * c.float(), rtol=0, atol=0)
        # a broadcast operand (stride 0 over the batch): the result is dense and per sample
        shared = torch.randn(1, 1, 3, 5).expand(4, 1, 3, 5)
        torch.testing.assert_close(_matmul._scaled(shared, c), shared * c, rtol=0, atol=0)
    assert _matmul._scratch.get() is None  # freed with the context


def test_scaling_refuses_the_buffer_for_tensors_that_need_grad():
    """An operand that requires grad is scaled out of place (``out=`` cannot take part in autograd)."""
    c = torch.rand(2).view(-1, 1, 1, 1)
    x = torch.randn(2, 1, 3, 4, requires_grad=True)
    with _matmul.reused_scratch():
        y = _matmul._scaled(x, c)
    assert y.requires_grad
    torch.testing.assert_close(y, x * c)


class _EmbedThenLinear(nn.Module):
    """A wide embedding table (its clipped sum is large, what it keeps is small) read before two Linear layers."""

    def __init__(self, V=500, d=8):
        super().__init__()
        torch.manual_seed(2)
        self.emb, self.a, self.b = nn.Embedding(V, d), nn.Linear(d, d), nn.Linear(d, 2)

    def forward(self, ids):
        return self.b(torch.tanh(self.a(self.emb(ids)))).sum(dim=1)


def test_a_large_sum_over_small_kept_tensors_is_formed_after_the_others_are_dropped(spy, monkeypatch):
    """The embedding is the first record of the pass, but its ``V x d`` sum is formed last, once the Linear
    records are dropped (step 3's order, ``fastdp.clipped_sums._net_bytes``); the release is exact either way."""
    from fastdp.layers.kinds.embedding import EmbeddingKind

    seen = []
    real = EmbeddingKind.clipped_sum

    def embedding_sum(self, module, ctx, name, coef):
        seen.append(spy["dropped"])
        return real(self, module, ctx, name, coef)

    monkeypatch.setattr(EmbeddingKind, "clipped_sum", embedding_sum)
    model = _EmbedThenLinear().double()
    B, T = 3, 4
    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 500, (B, T), generator=g), torch.randn(B, 2, generator=g, dtype=torch.float64)
    want = oracle_release(model, mse_per_sample, [(ids, y)], fn="abadi", R=0.05, batch_size=B)
    _, _, got = run_engine_once(model, mse_per_sample, [(ids, y)], batch_size=B, R=0.05, fn="abadi",
                                style="all-layer", mode="BK-MixOpt", reduction="sum", verify_structure=False)
    assert_grads_close(got, want)
    assert seen == [2]  # both Linear records were dropped before the table's sum was allocated
    assert spy["drops"][-1] == "Embedding"


class _QKV(nn.Module):
    """Separate q, k, v projections of one input, and an output projection of another."""

    def __init__(self, d=16):
        super().__init__()
        torch.manual_seed(4)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        att = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / x.shape[-1] ** 0.5, dim=-1)
        return self.o(att @ self.v(x)).sum(dim=1)


@pytest.mark.parametrize("T, slack, qkv_how", [
    (10, 1.0, "ghost"),          # p d = 256 > T (p + d / 3) = 213: keeping A once and three G is less than three g_i
    (14, 1.0, "instantiated"),   # 256 <= 14 (16 + 16 / 3) = 299: the per-sample gradients fit
    (10, 1.25, "instantiated"),  # 256 <= 1.25 * 213 = 267: within the slack
    (8, 1.25, "ghost"),          # 256 > 1.25 * 8 (16 + 16 / 3) = 213
])
def test_an_input_read_by_three_calls_counts_once_in_the_memory_rule(T, slack, qkv_how, monkeypatch):
    """The default mode instantiates a per-sample gradient only where it is no larger than what book-keeping keeps:
    for ``q``, ``k``, ``v`` reading one input that is the three output gradients and the input once (not three
    times). ``o`` reads its own input: instantiated at every T here (``p d = 256 <= T (p + d)``). With
    ``INSTANTIATION_SLACK`` above 1 a per-sample gradient up to that many times larger is instantiated."""
    import fastdp.layers._matmul as matmul

    monkeypatch.setattr(matmul, "INSTANTIATION_SLACK", slack)
    model = _QKV().double()
    B = 3
    g = torch.Generator().manual_seed(T)
    x, y = torch.randn(B, T, 16, generator=g, dtype=torch.float64), torch.randn(B, 16, generator=g,
                                                                                dtype=torch.float64)
    want = oracle_release(model, mse_per_sample, [(x, y)], fn="abadi", R=0.05, batch_size=B)
    engine, _, got = run_engine_once(model, mse_per_sample, [(x, y)], batch_size=B, R=0.05, fn="abadi",
                                     style="all-layer", mode="BK-MixOpt", reduction="sum", verify_structure=False)
    assert_grads_close(got, want)
    how = {name: engine.plan.last_norms[id(p)] for name, p in model.named_parameters()}
    assert {how[f"{m}.weight"] for m in "qkv"} == {qkv_how}
    assert how["o.weight"] == "instantiated"
