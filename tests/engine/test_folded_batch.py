"""The batch folded into dimension 0 (``x.reshape(-1, d)`` on ``(B, T, d)``, a multiple-choice model's
``(B, C, T) -> (B C, T)``): layers that see ``k B`` rows, sample ``i`` owning rows ``i k .. i k + k - 1``.

The engine unflattens such calls to ``(B, k, ...)`` (``fastdp.layers.batchdim.fold_factor``) for the kinds whose
middle dimensions are positions, once the structure probe has verified the fold for the input signature. Every
accepted model here is checked against the brute-force oracle (one backward pass per sample, float64, 1e-6
relative) in every clipping mode, at batch size 1, at a batch size equal to the fold factor, with a module used
both folded and unfolded (a shared parameter), and bias-only. Every refusal is checked to name its cause:
a fold in the wrong order (position-major), a fold without the probe, a fold that changes after the probe (rows
chosen by the data), a channel-first layer, a mixture-of-experts module.
"""

from __future__ import annotations

import pytest
import torch
from model_oracle import check_engine, cls_loss, mse_loss
from oracle import MODES, make_engine, user_loss
from torch import nn

from fastdp.probe import StructureError

D = torch.float64
V, T, DIM = 11, 4, 5


class FoldedMLP(nn.Module):
    """Embedding, then the positions folded into the rows before an MLP block (OPT's decoder layers do this)."""

    def __init__(self, shared: bool = False):
        super().__init__()
        self.emb = nn.Embedding(V, DIM)
        self.pre = nn.Linear(DIM, DIM)
        self.fc1 = nn.Linear(DIM, 7)
        self.ln = nn.LayerNorm(7)
        self.rms = nn.RMSNorm(7)
        self.fc2 = nn.Linear(7, DIM)
        self.head = nn.Linear(DIM, 3)
        self.shared = shared

    def forward(self, ids):
        B, t = ids.shape
        h = self.pre(self.emb(ids))  # (B, T, d): not folded
        f = h.reshape(-1, DIM)  # (B T, d)
        f = self.fc2(self.rms(self.ln(torch.tanh(self.fc1(f)))))
        if self.shared:  # the same Linear once unfolded (above) and once folded: one parameter, two uses
            f = self.pre(f)
        h = h + f.view(B, t, DIM)
        return self.head(torch.tanh(h).mean(1))


class MultipleChoice(nn.Module):
    """``(B, C, T)`` token ids folded to ``(B C, T)``, one score per choice, logits ``(B, C)`` (HF
    ``…ForMultipleChoice``)."""

    def __init__(self, choices: int = 3):
        super().__init__()
        self.emb = nn.Embedding(V, DIM)
        self.pos = nn.Embedding(T, DIM)
        self.ln = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.score = nn.Linear(DIM, 1)
        self.choices = choices

    def forward(self, ids):
        B, C, t = ids.shape
        flat = ids.view(-1, t)  # (B C, T)
        h = self.emb(flat) + self.pos(torch.arange(t).unsqueeze(0))  # (1, T, d) broadcast over the B C rows
        h = torch.tanh(self.fc(self.ln(h)))
        return self.score(h.mean(1)).view(B, C)


def _ids(sizes, seed, shape=(T,)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n, *shape), generator=g) for n in sizes]


def _mlp_batches(sizes, seed):
    g = torch.Generator().manual_seed(seed + 1)
    return [((x,), torch.randn(len(x), 3, generator=g, dtype=D)) for x in _ids(sizes, seed)]


def _mc_batches(sizes, seed, choices=3):
    g = torch.Generator().manual_seed(seed + 1)
    return [((x,), torch.randint(0, choices, (len(x),), generator=g)) for x in _ids(sizes, seed, (choices, T))]


CONFIGS = [("BK-MixOpt", "abadi", "all-layer", "mean"), ("BK-MixGhostClip", "automatic", "layer-wise", "sum"),
           ("BK-ghost", "global", "param-wise", "mean"), ("ghost", "abadi", "layer-wise", "sum"),
           ("instantiate", "automatic", "all-layer", "mean")]
assert {c[0] for c in CONFIGS} == set(MODES)


@pytest.mark.parametrize("mode,fn,style,reduction", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("sizes", [[3, 1], [T], [1]], ids=["B=3,1", "B=T", "B=1"])
def test_folded_positions_match_the_oracle(mode, fn, style, reduction, sizes):
    torch.manual_seed(0)
    check_engine(FoldedMLP().to(D), mse_loss, _mlp_batches(sizes, 1), mode=mode, fn=fn, style=style,
                 reduction=reduction, where="below" if sizes == [1] else "middle")


@pytest.mark.parametrize("mode", MODES)
def test_module_used_folded_and_unfolded_matches_the_oracle(mode):
    """``pre`` sees ``(B, T, d)`` and then ``(B T, d)``: its per-sample gradient is the sum over both uses, and the
    norm has the cross term of the two (both records are unflattened to the batch first)."""
    torch.manual_seed(1)
    check_engine(FoldedMLP(shared=True).to(D), mse_loss, _mlp_batches([3, 2], 2), mode=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sizes", [[3, 1], [3]], ids=["B=3,1", "B=C"])
def test_multiple_choice_matches_the_oracle(mode, sizes):
    """The choices folded into the rows, a position table of leading size 1 broadcast over them."""
    torch.manual_seed(2)
    check_engine(MultipleChoice().to(D), cls_loss, _mc_batches(sizes, 3), mode=mode)


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost"])
def test_bias_only_folded_matches_the_oracle(mode):
    """DP-BiTFiT: no input kept; the output gradients are unflattened before they are summed over positions."""
    torch.manual_seed(3)
    model = FoldedMLP().to(D)
    for n, p in model.named_parameters():
        p.requires_grad_(n.endswith("bias"))
    check_engine(model, mse_loss, _mlp_batches([3, 1], 4), mode=mode)


def _step(model, batches, loss=mse_loss, **kw):
    engine = make_engine(model, batch_size=sum(len(y) for _, y in batches), mode="BK-MixOpt", fn="abadi",
                         style="all-layer", reduction="mean", **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    for (x,), y in batches:
        user_loss(loss(model(x), y), "mean").backward()
    opt.step()
    return engine


class PositionMajor(FoldedMLP):
    """The positions folded into the rows in the other order: row r is sample r % B's."""

    def forward(self, ids):
        B, t = ids.shape
        h = self.emb(ids)
        f = h.transpose(0, 1).reshape(-1, DIM)  # (T B, d), position-major
        f = self.fc2(torch.tanh(self.fc1(f)))
        return self.head(f.view(t, B, DIM).transpose(0, 1).mean(1))


def test_position_major_fold_is_refused_by_the_probe():
    torch.manual_seed(4)
    with pytest.raises(StructureError, match="fc1|fc2"):
        _step(PositionMajor().to(D), _mlp_batches([3], 5))


def test_fold_without_the_probe_is_refused():
    torch.manual_seed(5)
    with pytest.raises(RuntimeError, match=r"folded into dimension 0 \(size 12 = 4 \* 3\) before module 'fc1'.*"
                                           r"verify_structure=False"):
        _step(FoldedMLP().to(D), _mlp_batches([3], 6), verify_structure=False)


class Routed(nn.Module):
    """Each sample's rows repeated ``self.copies`` times (sample-major), the count set from outside: a fold the
    probe verifies at one factor, and the data (here: the attribute) changes it afterwards."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, 2)
        self.copies = 2

    def forward(self, x):
        rows = x.repeat_interleave(self.copies, dim=0)
        return self.fc(rows).view(len(x), self.copies, 2).mean(1)


def test_fold_factor_changed_after_the_probe_is_refused():
    torch.manual_seed(6)
    model = Routed().to(D)
    engine = make_engine(model, batch_size=3, mode="BK-MixOpt", fn="abadi", style="all-layer", reduction="mean")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    x, y = torch.randn(3, DIM, dtype=D), torch.randn(3, 2, dtype=D)
    user_loss(mse_loss(model(x), y), "mean").backward()  # the probe verified fold factor 2
    opt.step()
    opt.zero_grad()
    model.copies = 3
    with pytest.raises(RuntimeError, match=r"size 9 = 3 \* 3.*verified this input signature with fold factors "
                                           r"\[2\]"):
        model(x)
    assert all(p.grad is None for p in model.parameters())


def test_routed_fold_matches_the_oracle():
    """The same model at one fold factor is exact (row r is sample r // k's)."""
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(8)
    batches = [((torch.randn(n, DIM, dtype=D, generator=g),), torch.randn(n, 2, dtype=D, generator=g))
               for n in (3, 1)]
    check_engine(Routed().to(D), mse_loss, batches, mode="BK-MixOpt")


class FoldedConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 3, padding=1)

    def forward(self, x):  # (B, 3, 2, L) -> (3 B, 2, L)
        B = x.shape[0]
        return self.conv(x.flatten(0, 1)).view(B, -1).sum(1, keepdim=True)


def test_channel_first_fold_is_refused():
    torch.manual_seed(9)
    x = torch.randn(2, 3, 2, 5, dtype=D)
    with pytest.raises(RuntimeError, match=r"size 6 = 3 \* 2\) before module 'conv' \(Conv1d\), a channel-first"):
        _step(FoldedConv().to(D), [((x,), torch.randn(2, 1, dtype=D))])


class MoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.expert = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.expert(x)


class TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = MoeBlock()

    def forward(self, x):
        return self.moe(x.reshape(-1, DIM)).view(x.shape[0], -1).sum(1, keepdim=True)


def test_fold_into_a_mixture_of_experts_module_is_refused():
    torch.manual_seed(10)
    x = torch.randn(3, 2, DIM, dtype=D)
    with pytest.raises(RuntimeError, match="mixture-of-experts"):
        _step(TinyMoE().to(D), [((x,), torch.randn(3, 1, dtype=D))])



class WindowAttention(nn.Module):
    """A generic owner (a raw parameter) called on folded rows, as Swin's window attention: each sample's
    positions cut into ``W`` windows, ``(B, W * N, d) -> (B W, N, d)``, a learned bias per window position."""

    def __init__(self, n: int = 2):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.bias = nn.Parameter(torch.randn(n, n))
        self.n = n

    def forward(self, x):  # (B W, N, d)
        q, k, v = self.qkv(x).chunk(3, -1)
        att = (q @ k.transpose(-1, -2) / DIM ** 0.5 + self.bias).softmax(-1)
        return att @ v


class Windowed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, DIM)
        self.attn = WindowAttention()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 3)

    def forward(self, ids):  # (B, T)
        B, t = ids.shape
        h = self.emb(ids)
        w = self.attn(h.view(B * (t // 2), 2, DIM))  # windows of 2 positions, sample-major
        h = h + w.view(B, t, DIM)
        return self.head(self.norm(h).mean(1))


@pytest.mark.parametrize("mode,fn,style,reduction", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("sizes", [[3, 1], [2]], ids=["B=3,1", "B=windows"])
def test_generic_owner_on_folded_rows_matches_the_oracle(mode, fn, style, reduction, sizes):
    """The owner is replayed per sample on that sample's ``W`` windows (its ``(W, N, d)`` rows)."""
    torch.manual_seed(12)
    check_engine(Windowed().to(D), mse_loss, _mlp_batches(sizes, 13), mode=mode, fn=fn, style=style,
                 reduction=reduction, where="below" if sizes == [1] else "middle")
