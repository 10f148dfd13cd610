"""Model-coverage gaps found by the red team, each against the batch-of-one oracle (float64, 1e-6 relative, R chosen
so that clipping is active) in the five clipping modes, with batch sizes equal and not equal to the models' other
dimensions and batch size 1:

1. subclasses of supported layers with their own ``forward`` (Falcon's ``FalconLinear``) go to the generic path;
2. a parameter held by a module and by its descendant (``BertLMPredictionHead.bias is decoder.bias``) is counted once;
3. parameters in ``nn.ParameterDict`` / ``nn.ParameterList`` (peft IA3, AdaLoRA, VeRA) are owned by the nearest
   called ancestor;
4. parametrizations (``weight_norm``, ``spectral_norm``, legacy ``weight_norm``, ``prune``) are exact;
6. the batch size of a forward call comes from the inputs' agreement, not the first tensor argument.

Toy sizes: input 5, hidden 6, output 3 (batch size 3 equals the output dimension).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from model_oracle import D, check_engine, mse_loss
from oracle import MODES, make_engine
from torch import nn
from torch.nn.utils import parametrize

from fastdp.layers import kind_for

DIN, HID, DOUT = 5, 6, 3


def _batches(sizes, seed=0, din=DIN, dout=DOUT):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(n, din, generator=g, dtype=D),), torch.randn(n, dout, generator=g, dtype=D)) for n in sizes]


SIZES = [[3, 1], [1], [4]]  # 3 == DOUT; a logical batch of 3 + 1; batch size 1


# --------------------------------------------------------------------------- 1. subclasses with their own forward


class TwiceBiasLinear(nn.Linear):
    """Falcon-style: an nn.Linear subclass whose forward is not nn.Linear's."""

    def forward(self, x):
        return F.linear(x, self.weight) + self.bias * 2


class ScaledConv(nn.Conv1d):
    def forward(self, x):
        return super().forward(x) * 1.5 + self.weight.sum()


class ShiftedEmbedding(nn.Embedding):
    def forward(self, ids):
        return F.embedding(ids, self.weight) * 0.5 + self.weight[0]


class PlainSub(nn.Linear):
    """Adds an attribute only: same computation as nn.Linear."""

    tag = "plain"


class SquaredLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) * self.weight


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = ScaledConv(1, 2, 3)
        self.head = nn.Linear(2 * (DIN - 2), DOUT)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x.unsqueeze(1))).flatten(1))


class EmbNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = ShiftedEmbedding(11, 4)
        self.norm = SquaredLayerNorm(4)
        self.head = nn.Linear(4, DOUT)

    def forward(self, x):
        ids = (x.abs() * 3).long().clamp(max=10)  # (B, DIN) token ids derived from the input
        return self.head(self.norm(self.emb(ids)).mean(1))


def test_kind_for_requires_the_base_forward():
    assert kind_for(TwiceBiasLinear(2, 2)) is None
    assert kind_for(ScaledConv(1, 1, 1)) is None
    assert kind_for(ShiftedEmbedding(3, 2)) is None
    assert kind_for(SquaredLayerNorm(2)) is None
    assert kind_for(PlainSub(2, 2)) is kind_for(nn.Linear(2, 2)) is not None
    for m in (nn.GroupNorm(1, 2), nn.Conv2d(1, 1, 1), nn.Embedding(2, 2), nn.LayerNorm(2)):
        assert kind_for(m) is not None

        class Own(type(m)):
            def forward(self, *a):  # noqa: D102
                return super().forward(*a)

        own = copy.copy(m)
        own.__class__ = Own
        assert kind_for(own) is None, type(m)


class InPlaceAfter(nn.Module):
    """Falcon's layout: the output of a generic owner is modified in place by its caller (mlp_output += attn)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(DIN, HID)
        self.mlp = TwiceBiasLinear(HID, DOUT)
        self.attn = nn.Linear(HID, DOUT)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        out = self.mlp(h)
        out += self.attn(h)
        return out


def _subclass_model(which):
    torch.manual_seed(0)
    if which == "linear":
        return nn.Sequential(nn.Linear(DIN, HID), nn.Tanh(), TwiceBiasLinear(HID, DOUT)).to(D)
    if which == "inplace":
        return InPlaceAfter().to(D)
    if which == "conv":
        return ConvNet().to(D)
    return EmbNet().to(D)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which", ["linear", "inplace", "conv", "embedding"])
def test_subclass_with_own_forward(which, mode):
    sizes = SIZES[MODES.index(mode) % len(SIZES)]
    model = _subclass_model(which)
    check_engine(model, mse_loss, _batches(sizes, seed=MODES.index(mode)), mode=mode)


# --------------------------------------------------------------------------- 2. parameter held by an ancestor too


class Head(nn.Module):
    """BertLMPredictionHead's layout: ``self.bias`` is ``self.decoder.bias``."""

    def __init__(self):
        super().__init__()
        self.transform = nn.Linear(DIN, HID)
        self.decoder = nn.Linear(HID, DOUT)
        self.bias = self.decoder.bias

    def forward(self, x):
        return self.decoder(torch.tanh(self.transform(x)))


class HeadReadsTwice(Head):
    """The ancestor also reads the shared bias outside the descendant."""

    def forward(self, x):
        return self.decoder(torch.tanh(self.transform(x))) + self.bias * x[:, :DOUT]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cls", [Head, HeadReadsTwice])
def test_parameter_shared_with_descendant(cls, mode):
    torch.manual_seed(1)
    model = cls().to(D)
    sizes = SIZES[MODES.index(mode) % len(SIZES)]
    check_engine(model, mse_loss, _batches(sizes, seed=10 + MODES.index(mode)), mode=mode)


def _mlm(family):
    from model_oracle import HID as H
    from model_oracle import V, _tf

    tf = _tf()
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                  max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if family == "bert":
        m = tf.BertForMaskedLM(tf.BertConfig(type_vocab_size=2, **common))
    else:
        m = tf.RobertaForMaskedLM(tf.RobertaConfig(pad_token_id=1, **common))
    return MLMWrap(m).to(D)


class MLMWrap(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids, mask):
        return self.m(input_ids=ids, attention_mask=mask).logits


def _mlm_loss(logits, target):
    B, T, V = logits.shape
    return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), reduction="none").reshape(B, T).mean(1)


def _mlm_batches(sizes, seed, pad_id):
    from model_oracle import cls_batches

    return [((ids, m), ids) for (ids, m), _ in cls_batches(sizes, seed, pad_id=pad_id)]


@pytest.mark.parametrize("family,mode", [("bert", "BK-MixOpt"), ("roberta", "ghost"),
                                         pytest.param("bert", "instantiate", marks=pytest.mark.slow),
                                         pytest.param("roberta", "BK-MixGhostClip", marks=pytest.mark.slow),
                                         pytest.param("bert", "BK-ghost", marks=pytest.mark.slow)])
def test_masked_lm_heads(family, mode):
    pytest.importorskip("transformers")
    model = _mlm(family)
    shared = [n for n, _ in model.named_parameters(remove_duplicate=False) if n.endswith("predictions.decoder.bias")
              or n.endswith("lm_head.decoder.bias")]
    assert shared, "the tiny MLM no longer ties the head's bias to the decoder's: the test checks nothing"
    check_engine(model, _mlm_loss, _mlm_batches([3, 1], 7, 0 if family == "bert" else 1), mode=mode)


# --------------------------------------------------------------------------- 3. ParameterDict / ParameterList


class Containers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIN, DOUT)
        self.scales = nn.ParameterDict({"a": nn.Parameter(torch.randn(DOUT)), "b": nn.Parameter(torch.randn(DOUT))})
        self.shifts = nn.ParameterList([nn.Parameter(torch.randn(DOUT)), nn.Parameter(torch.randn(1, DOUT))])
        self.nested = nn.ModuleDict({"inner": nn.ParameterList([nn.Parameter(torch.randn(DOUT))])})

    def forward(self, x):
        h = self.lin(x)
        return torch.tanh(h * self.scales["a"] + self.shifts[0]) * self.scales["b"] + self.shifts[1] \
            + self.nested["inner"][0] * h


@pytest.mark.parametrize("mode", MODES)
def test_parameter_containers(mode):
    torch.manual_seed(2)
    model = Containers().to(D)
    sizes = SIZES[MODES.index(mode) % len(SIZES)]
    check_engine(model, mse_loss, _batches(sizes, seed=20 + MODES.index(mode)), mode=mode)


class SharedSub(nn.Module):
    def __init__(self, pd):
        super().__init__()
        self.pd = pd  # one ParameterDict object, registered under every SharedSub that holds it
        self.lin = nn.Linear(DOUT, DOUT).requires_grad_(False)

    def forward(self, x):
        return torch.tanh(self.lin(x) * self.pd["s"])


class SharedContainer(nn.Module):
    """A ParameterDict shared by two submodules (paths ``a.pd.s`` and ``b.pd.s``), as peft's VB-LoRA vector bank
    and TinyLoRA's shared vector are: one parameter in one slot, reached twice."""

    def __init__(self):
        super().__init__()
        pd = nn.ParameterDict({"s": nn.Parameter(torch.linspace(0.5, 1.5, DOUT))})
        self.inp = nn.Linear(DIN, DOUT)
        self.a, self.b = SharedSub(pd), SharedSub(pd)

    def forward(self, x):
        return self.b(self.a(self.inp(x)))


@pytest.mark.parametrize("mode", MODES)
def test_parameter_container_shared_by_two_submodules(mode):
    """The owner's replay substitutes the shared slot once (torch.func.functional_call's tying substituted it once
    per path and restored it once: the model was left holding a plain tensor and the step crashed with "is not an
    nn.Parameter"; a red-team pass found it with peft's VB-LoRA, TinyLoRA, Lily and trainable tokens on GPT-2).
    Exact, and the model still holds its parameter afterwards."""
    torch.manual_seed(3)
    model = SharedContainer().to(D)
    sizes = SIZES[MODES.index(mode) % len(SIZES)]
    check_engine(model, mse_loss, _batches(sizes, seed=40 + MODES.index(mode)), mode=mode)
    assert type(model.a.pd._parameters["s"]) is nn.Parameter and model.a.pd["s"] is model.b.pd["s"]


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("kind", ["vblora", "trainable-tokens-tied"])
def test_peft_shared_containers(kind):
    """peft adapters whose parameter container is shared: VB-LoRA's vector bank (every adapted layer), and
    LoRA's trainable token indices on GPT-2's tied embedding and head. Exact."""
    pytest.importorskip("peft")
    from model_oracle import ClsWrap, LMWrap, bert, cls_batches, cls_loss, gpt2, lm_batches, lm_loss
    from peft import LoraConfig, VBLoRAConfig, get_peft_model

    torch.manual_seed(0)
    if kind == "vblora":
        pm = get_peft_model(bert(), VBLoRAConfig(r=2, num_vectors=8, vector_length=4, topk=2, vblora_dropout=0.0,
                                                 target_modules=["query", "value"], task_type="SEQ_CLS"))
        model, loss, data = ClsWrap(pm).to(D), cls_loss, cls_batches([3, 1], 44, pad_id=0)
    else:
        pm = get_peft_model(gpt2(), LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                               trainable_token_indices=[3, 5, 7], init_lora_weights=False,
                                               task_type="CAUSAL_LM"))
        model, loss, data = LMWrap(pm).to(D), lm_loss, lm_batches([3, 1], 45)
    g = torch.Generator().manual_seed(46)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    check_engine(model, loss, data, mode="BK-MixOpt")
    assert all(type(p) is nn.Parameter for _, p in model.named_parameters(remove_duplicate=False))


def _peft(kind, family):
    from model_oracle import ClsWrap, LMWrap, bert, gpt2
    from peft import AdaLoraConfig, IA3Config, VeraConfig, get_peft_model

    torch.manual_seed(0)
    base = gpt2() if family == "gpt2" else bert()
    tm = ["c_attn", "c_proj"] if family == "gpt2" else ["query", "value"]
    kw = dict(target_modules=tm, task_type="CAUSAL_LM" if family == "gpt2" else "SEQ_CLS",
              fan_in_fan_out=family == "gpt2")
    if kind == "ia3":
        cfg = IA3Config(feedforward_modules=[], init_ia3_weights=False, **kw)
    elif kind == "adalora":
        cfg = AdaLoraConfig(init_r=2, target_r=1, total_step=10, lora_dropout=0.0, init_lora_weights=False, **kw)
    else:
        cfg = VeraConfig(r=4, vera_dropout=0.0, init_weights=False, **kw)
    pm = get_peft_model(base, cfg)
    return (LMWrap(pm) if family == "gpt2" else ClsWrap(pm)).to(D)


PEFT_CASES = [("ia3", "gpt2", "BK-MixOpt"), ("adalora", "bert", "ghost"), ("vera", "gpt2", "instantiate")]
PEFT_SLOW = [("ia3", "bert", "BK-ghost"), ("adalora", "gpt2", "BK-MixGhostClip"), ("vera", "bert", "BK-MixOpt"),
             ("ia3", "gpt2", "BK-MixGhostClip"), ("adalora", "bert", "instantiate"), ("vera", "gpt2", "ghost")]


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("kind,family,mode", PEFT_CASES + [pytest.param(*c, marks=pytest.mark.slow)
                                                           for c in PEFT_SLOW])
def test_peft_parameterdict_adapters(kind, family, mode):
    pytest.importorskip("peft")
    from model_oracle import cls_batches, cls_loss, lm_batches, lm_loss

    model = _peft(kind, family)
    assert any(p.requires_grad for n, p in model.named_parameters()
               if any(k in n for k in ("ia3_l", "lora_E", "vera_lambda")))
    data = lm_batches([3, 1], 30) if family == "gpt2" else cls_batches([3, 1], 31, pad_id=0)
    check_engine(model, lm_loss if family == "gpt2" else cls_loss, data, mode=mode)


# --------------------------------------------------------------------------- 4. parametrizations


def _leafy(model):
    """Legacy weight_norm / prune keep ``weight`` as a computed tensor; a no-grad forward makes it a leaf, so the
    oracle's deepcopy works (torch refuses to deepcopy a non-leaf attribute)."""
    with torch.no_grad():
        model(torch.zeros(1, DIN, dtype=D))
    return model


def _parametrized(which):
    from torch.nn.utils import parametrizations, prune

    torch.manual_seed(3)
    first = nn.Linear(DIN, HID)
    last = nn.Linear(HID, DOUT)
    if which == "weight_norm":
        first = parametrizations.weight_norm(first)
    elif which == "spectral_norm":
        first = parametrizations.spectral_norm(first)
    elif which == "orthogonal":
        last = parametrizations.orthogonal(nn.Linear(HID, HID))
        return nn.Sequential(first.to(D), nn.Tanh(), last.to(D), nn.Linear(HID, DOUT).to(D)).to(D)
    elif which == "legacy_weight_norm":
        with pytest.warns(FutureWarning):
            first = torch.nn.utils.weight_norm(first)
    elif which == "prune":
        prune.random_unstructured(first, "weight", 0.4)
        prune.l1_unstructured(last, "weight", 0.3)
    model = nn.Sequential(first, nn.Tanh(), last).to(D)
    if which == "spectral_norm":
        model.eval()  # power iteration off: the batch-of-one oracle would iterate once per sample
    return _leafy(model)


PARAMETRIZATIONS = ["weight_norm", "spectral_norm", "orthogonal", "legacy_weight_norm", "prune"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which", PARAMETRIZATIONS)
def test_parametrizations(which, mode):
    model = _parametrized(which)
    sizes = SIZES[MODES.index(mode) % len(SIZES)]
    check_engine(model, mse_loss, _batches(sizes, seed=40 + MODES.index(mode)), mode=mode)


def test_spectral_norm_train_mode_iterates_once_per_forward():
    """In train mode spectral_norm updates its power-iteration buffers ``u``, ``v`` in each forward call. The
    per-sample replay must not update them again (the buffers after a step equal those after one plain forward),
    and the released gradient equals the oracle's on the weight that forward used (eval mode, same buffers)."""
    from model_oracle import oracle_for
    from oracle import clipped_sum, released_grads

    model = _parametrized("spectral_norm").train()
    reference = copy.deepcopy(model)
    (x,), y = _batches([4], seed=50)[0]
    with torch.no_grad():
        reference(x)  # one power iteration, as the engine's forward will do
    want_u = reference[0].parametrizations.weight[0]._u.clone()
    engine = make_engine(model, batch_size=4, R=0.05, mode="BK-MixOpt")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    mse_loss(model(x), y).mean().backward()
    opt.step()
    torch.testing.assert_close(model[0].parametrizations.weight[0]._u, want_u, rtol=0, atol=0)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    _, names, groups, psg = oracle_for(reference.eval(), mse_loss, [((x,), y)])
    want = clipped_sum(psg, groups, "abadi", 0.05, 4)
    got = released_grads(model, names)
    for n in names:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-10)


def test_parametrized_module_is_the_owner():
    model = _parametrized("weight_norm")
    engine = make_engine(model, batch_size=2)
    owned = {e.name: sorted(e.names) for e in engine.plan.entries}
    assert owned["0"] == ["bias", "parametrizations.weight.original0", "parametrizations.weight.original1"]
    assert "0.parametrizations.weight" not in owned
    assert parametrize.is_parametrized(model[0])


# --------------------------------------------------------------------------- 6. batch size from the inputs' agreement

T_POS, VOC = 7, 13


class PositionsFirst(nn.Module):
    """``forward(pos, ids)``: shared position ids ``(1, T)`` come first, the per-sample ids ``(B, T)`` second."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOC, 4)
        self.pos = nn.Embedding(T_POS, 4)
        self.scale = nn.Parameter(torch.randn(1, T_POS, 1))  # a raw parameter (generic path) broadcast over B
        self.head = nn.Linear(4, DOUT)

    def forward(self, pos, ids):
        h = torch.tanh(self.tok(ids) + self.pos(pos)) * self.scale
        return self.head(h.mean(1))


class IdsOnly(nn.Module):
    """The oracle's view: the same parameters, the shared positions made inside (so every input is per sample)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        return self.inner(torch.arange(T_POS).unsqueeze(0), ids)


@pytest.mark.parametrize("mode", MODES)
def test_batch_size_from_agreeing_inputs(mode):
    from model_oracle import oracle_for
    from oracle import assert_grads_close, choose_R, clipped_sum, run_engine_once

    # B == DOUT, B == 1, B == the embedding width 4. (B == T is refused, not silently wrong: an output (1, T, d)
    # with T == B is indistinguishable from an (L, B, H) RNN state, see generic.is_broadcast.)
    sizes = [[3, 1], [1], [4], [2, 1], [5]][MODES.index(mode)]
    torch.manual_seed(5)
    model = PositionsFirst().to(D)
    g = torch.Generator().manual_seed(60 + MODES.index(mode))
    data = [((torch.randint(0, VOC, (n, T_POS), generator=g),), torch.randn(n, DOUT, generator=g, dtype=D))
            for n in sizes]
    _, names, groups, psg = oracle_for(IdsOnly(model), mse_loss, data)
    R = choose_R(psg, groups)
    want = {n.removeprefix("inner."): v for n, v in clipped_sum(psg, groups, "abadi", R, sum(sizes)).items()}
    pos = torch.arange(T_POS).unsqueeze(0)
    engine_data = [((pos, ids), y) for (ids,), y in data]
    _, _, got = run_engine_once(model, mse_loss, engine_data, batch_size=sum(sizes), R=R, fn="abadi",
                                style="all-layer", mode=mode, reduction="mean")
    unclipped = {n.removeprefix("inner."): v.sum(0) / sum(sizes) for n, v in psg.items()}
    assert any(not torch.allclose(want[n], unclipped[n], rtol=1e-3) for n in want), "R does not clip"
    assert_grads_close(got, want, rtol=1e-6, atol=1e-10)


def test_infer_batch_size_rules():
    from fastdp.layers.batchdim import AmbiguousBatchError, infer_batch_size

    t = torch.zeros
    assert infer_batch_size((t(1, 7), t(3, 7)), {}) == 3
    assert infer_batch_size((t(1, 7),), {"ids": t(1, 7)}) == 1
    assert infer_batch_size((t(0, 7), t(1, 7)), {}) == 0
    assert infer_batch_size((t(4, 2), t(4, 9), t(9, 2)), {}) == 4
    assert infer_batch_size((3, "x"), {"t": t(())}) is None
    with pytest.raises(AmbiguousBatchError, match=r"\(3, 5\).*\(4, 5\).*\[3, 4\]"):
        infer_batch_size((t(3, 5), t(4, 5)), {})


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, DOUT)
        self.b = nn.Linear(5, DOUT)

    def forward(self, x, z):
        return self.a(x).sum(0) + self.b(z).sum(0)


def test_disagreeing_inputs_are_refused():
    from fastdp.layers.batchdim import AmbiguousBatchError

    model = TwoInputs().to(D)
    engine = make_engine(model, batch_size=3)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(AmbiguousBatchError, match=r"shapes \[\(3, 5\), \(4, 5\)\]"):
        model(torch.randn(3, 5, dtype=D), torch.randn(4, 5, dtype=D))
    assert engine._capture.roots == []  # the refused call left no state behind


# --------------------------------------------------------------------------- 5. RNN classifiers on the final state

RNN_IN, RNN_H, RNN_T = 5, 4, 6


class RNNClassifier(nn.Module):
    """``head(h_n[-1])``: h_n is ``(num_layers*dirs, B, H)``, batch on dim 1. ``with_h0``: a per-sample initial
    state (batch on dim 1 too) computed from the input."""

    def __init__(self, cell, layers, bidirectional, with_h0=False):
        super().__init__()
        self.rnn = getattr(nn, cell)(RNN_IN, RNN_H, num_layers=layers, bidirectional=bidirectional, batch_first=True)
        self.head = nn.Linear(RNN_H, DOUT)
        self.with_h0 = with_h0

    def forward(self, x):
        if self.with_h0:
            L = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
            h0 = torch.tanh(x[:, 0, :RNN_H]).unsqueeze(0).expand(L, -1, -1).contiguous()
            out = self.rnn(x, (h0, 2 * h0) if isinstance(self.rnn, nn.LSTM) else h0)
        else:
            out = self.rnn(x)
        h_n = out[1][0] if isinstance(self.rnn, nn.LSTM) else out[1]
        return self.head(h_n[-1])


def _seq_batches(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(n, RNN_T, RNN_IN, generator=g, dtype=D),), torch.randn(n, DOUT, generator=g, dtype=D))
            for n in sizes]


RNN_FAST = [("LSTM", 2, True, False, [4]), ("GRU", 2, False, True, [2]), ("RNN", 1, False, False, [3, 1]),
            ("LSTM", 1, False, True, [1]), ("GRU", 2, True, False, [3, 1])]  # B == L*dirs == H, B == L, B == 1


def _rnn_cases():
    """Every case in BK-MixOpt; the other modes for half of the cases in the default run, the rest slow."""
    out = []
    for i, case in enumerate(RNN_FAST):
        for k, mode in enumerate(MODES):
            fast = mode == "BK-MixOpt" or (i + k) % 2 == 0
            out.append(pytest.param(*case, mode, marks=() if fast else pytest.mark.slow))
    return out


@pytest.mark.parametrize("cell,layers,bidir,h0,sizes,mode", _rnn_cases())
def test_rnn_final_state(cell, layers, bidir, h0, sizes, mode):
    torch.manual_seed(7)
    model = RNNClassifier(cell, layers, bidir, h0).to(D)
    check_engine(model, mse_loss, _seq_batches(sizes, 70 + MODES.index(mode)), mode=mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cell", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("layers,bidir", [(1, False), (1, True), (2, False), (2, True)])
@pytest.mark.parametrize("h0", [False, True])
def test_rnn_final_state_grid(cell, layers, bidir, h0, mode):
    for sizes in ([3, 1], [layers], [RNN_H], [1]):
        torch.manual_seed(8)
        model = RNNClassifier(cell, layers, bidir, h0).to(D)
        check_engine(model, mse_loss, _seq_batches(sizes, 80), mode=mode)


class ScaleWithSideOutput(nn.Module):
    """A generic owner in the first layer whose second output (no batch dimension) depends on its parameter."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(DIN))

    def forward(self, x):
        return x * self.scale, self.scale.sum().expand(2)


class SideOutputNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = ScaleWithSideOutput()
        self.head = nn.Linear(DIN, DOUT)

    def forward(self, x):
        h, side = self.first(x)
        return self.head(h) + side.sum()


def test_unattributable_output_of_first_layer_is_refused():
    """Before: the side output did not require grad (parameters detached, input constant), so its gradient was
    dropped silently and ``scale`` released without that use."""
    model = SideOutputNet().to(D)
    engine = make_engine(model, batch_size=3)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    (x,), y = _batches([3])[0]
    with pytest.raises(RuntimeError, match=r"output 1 of module 'first' has no batch dimension"):
        mse_loss(model(x), y).mean().backward()


# --------------------------------------------------------------------------- 7. activation checkpointing


class Checkpointed(nn.Module):
    """A raw parameter of the model (generic path, detached during the model's forward) feeds a checkpointed
    layer: under ghost differentiation the checkpoint's input does not require grad."""

    def __init__(self, reentrant):
        super().__init__()
        self.shift = nn.Parameter(torch.randn(DIN))
        self.a = nn.Linear(DIN, HID)
        self.b = nn.Linear(HID, DOUT)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.a, x + self.shift, use_reentrant=self.reentrant)
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("mode", MODES)
def test_non_reentrant_checkpoint_is_exact(mode):
    torch.manual_seed(9)
    model = Checkpointed(reentrant=False).to(D)
    check_engine(model, mse_loss, _batches(SIZES[MODES.index(mode) % len(SIZES)], 90), mode=mode)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_reentrant_checkpoint_is_refused():
    model = Checkpointed(reentrant=True).to(D)
    (x,), y = _batches([3])[0]
    model(x).sum().backward()
    assert model.a.weight.grad is not None and model.a.weight.grad.abs().sum() > 0  # plain autograd: a gradient
    model.zero_grad()
    engine = make_engine(model, batch_size=3)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"module 'a' \(Linear\) with trainable parameters \['a.weight', 'a.bias'\]"
                                           r".*use_reentrant=True.*use_reentrant=False"):
        model(x)
    assert engine._capture.roots == [] and engine._capture.calls == []
    with torch.no_grad():  # evaluation without autograd is not refused
        model(x)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_hf_gradient_checkpointing_is_exact():
    pytest.importorskip("transformers")
    from model_oracle import LMWrap, gpt2, lm_batches, lm_loss

    torch.manual_seed(0)
    base = gpt2()
    getattr(base, "activation_checkpointing_enable", base.gradient_checkpointing_enable)()
    assert base.transformer.gradient_checkpointing
    model = LMWrap(base).to(D).train()
    check_engine(model, lm_loss, lm_batches([3, 1], 91), mode="BK-MixOpt")


# --------------------------------------------------------------------------- 8. folded batch axis, MoE routing


def _refusal(model, x, match):
    engine = make_engine(model, batch_size=x.shape[0])
    engine.attach(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
    with pytest.raises(RuntimeError, match=match):
        out = model(x)
        (out.logits if hasattr(out, "logits") else out).float().pow(2).sum().backward()


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_routing_is_refused_by_name(family):
    pytest.importorskip("transformers")
    from model_oracle import FFN as F_
    from model_oracle import HID as H
    from model_oracle import V, _tf

    tf = _tf()
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=H, intermediate_size=F_, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=16, attn_implementation="eager")
    if family == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common))
    else:
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                                         shared_expert_intermediate_size=8, **common))
    ids = torch.randint(0, V, (3, 7), generator=torch.Generator().manual_seed(1))  # float32: HF's grouped matmul
    _refusal(model, ids, r"mixture-of-experts layer .*\(size 21 = 7 \* 3\) and the router sends them to experts")


def test_swin_window_folding_is_refused_without_the_probe():
    """Swin's window partition folds the batch into the windows (``(B W, N, C)``): exact where the structure probe
    verified the fold (``swin-timm``, ``swin`` in test_models_families.py), refused without it."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, patch_size=4,
                              window_size=2, embed_dim=8, depths=(1, 1), num_heads=(1, 2), num_classes=3).eval()
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    engine = make_engine(model, batch_size=3, verify_structure=False)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    # 32/4 = 8x8 patches in 2x2 windows: 16 windows per image
    with pytest.raises(RuntimeError, match=r"the batch axis is folded into dimension 0 \(size 48 = 16 \* 3\) before "
                                           r"module 'layers.0.blocks.0.attn.qkv' \(Linear\).*verify_structure=False"):
        model(x)


class Gathered(nn.Module):
    """Rows of the batch gathered into a set of another size before a generic owner."""

    def __init__(self):
        super().__init__()
        self.scale = ScaleWithSideOutput()

    def forward(self, x):
        return self.scale(x[torch.tensor([0, 1, 0, 1, 2])])[0].sum(0, keepdim=True).expand(x.shape[0], -1)


def test_gathered_rows_are_refused_by_name():
    _refusal(Gathered().to(D), torch.randn(3, DIN, dtype=D), r"leading size 5, neither the batch size 3")


@pytest.mark.slow
def test_hf_falcon_linear_subclass():
    """HF Falcon's MLP uses FalconLinear (an nn.Linear subclass with its own forward): generic path, exact. (Its
    decoder adds the attention output to dense_4h_to_h's output in place; that used to lose the hook.)"""
    pytest.importorskip("transformers")
    from model_oracle import F32_INSIDE, HID, LMWrap, V, _tf, lm_batches, lm_loss

    tf = _tf()
    torch.manual_seed(0)
    cfg = tf.FalconConfig(vocab_size=V, hidden_size=HID, num_hidden_layers=2, num_attention_heads=2,
                          hidden_dropout=0.0, attention_dropout=0.0, attn_implementation="eager", bias=True)
    model = LMWrap(tf.FalconForCausalLM(cfg)).to(D)
    linears = [m for m in model.modules() if type(m).__name__ == "FalconLinear"]
    assert linears and all(kind_for(m) is None for m in linears)
    check_engine(model, lm_loss, lm_batches([3, 1], 95), mode="BK-MixOpt", atol_rel=F32_INSIDE["llama"])
