"""Whole Hugging Face transformers models, built from small configs, against the batch-of-one oracle (float64,
1e-6 relative): GPT-2 (Conv1D, LM head tied to the word embedding, position ids of shape (1, T)), BERT and
RoBERTa sequence classification (position / token-type ids broadcast from (1, T) or derived from the input ids),
T5 (relative attention bias, T5LayerNorm, one embedding shared by encoder, decoder and LM head), Llama
(LlamaRMSNorm, no biases, rotary embeddings), OPT (learned positional embedding subclass, tied head) and
GPT-NeoX.

Sizes are chosen so that no two dimensions coincide with a physical batch size (batches of 1, 3 and 4; T=7 or 6,
hidden 16, 2 heads of 8, ffn 24, 5 labels, vocabulary 61). Dropout is 0 everywhere (the oracle needs a
deterministic forward).

Tolerance: elementwise rtol 1e-6 and atol 1e-10 (times the largest clip factor) for GPT-2, BERT and RoBERTa, which
are float64 throughout. T5, Llama, OPT and GPT-NeoX run some operations in float32 even with float64 weights
(RMS-norm variance, eager softmax; see model_oracle.F32_INSIDE): for them each parameter's absolute tolerance is
1e-6 times its largest gradient entry. Structural errors (a missing cross term, a mis-attributed row, a missing
clip) are 1e-3 or larger (test_tied_embedding_cross_terms_matter).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

pytest.importorskip("transformers")

import transformers as tf  # noqa: E402
from model_oracle import (  # noqa: E402
    F32_INSIDE,
    FAMILIES,
    FFN,
    HID,
    LABELS,
    T_CLS,
    T_LM,
    D,
    LMWrap,
    V,
    bert,
    build_hf,
    check_decomposition,
    check_engine,
    cls_batches,
    cls_loss,
    gpt2,
    llama,
    lm_batches,
    lm_loss,
    oracle_for,
    quiet_transformers,
    rel_err,
)
from oracle import FNS, MODES, choose_R, clipped_sum, group_norms, per_sample_grads  # noqa: E402
from torch import nn  # noqa: E402

quiet_transformers()


def build(family, attn="eager", seed=0):
    return build_hf(family, attn=attn, seed=seed)


# (mode, fn, style, reduction, physical batch sizes): together every family gets BK-MixOpt, two ghost modes and
# instantiate, both reductions, batch size 1, all-layer / layer-wise / param-wise, all three clipping functions.
CONFIGS = [
    ("BK-MixOpt", "abadi", "all-layer", "mean", [3, 1]),
    ("BK-ghost", "automatic", "layer-wise", "sum", [4]),
    ("ghost", "abadi", "param-wise", "mean", [1]),
    ("instantiate", "automatic", "all-layer", "sum", [3]),
    ("BK-MixGhostClip", "global", "layer-wise", "mean", [3, 4]),
]


@pytest.mark.parametrize("mode,fn,style,reduction,sizes", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_model_matches_oracle(family, mode, fn, style, reduction, sizes):
    model, batches, loss = build(family)
    data = batches(sizes, 100 + len(sizes))
    if family in REFUSED:
        _assert_refused_at_backward(model, loss, data, mode=mode, fn=fn, style=style, reduction=reduction)
        return
    check_engine(model, loss, data, mode=mode, fn=fn, style=style, reduction=reduction,
                 where="below" if sizes == [1] else "middle", atol_rel=F32_INSIDE.get(family, 0.0))


# OPT's decoder layers fold the batch into the sequence (hidden_states.reshape(-1, d) before final_layer_norm, fc1
# and fc2): those calls see B*T rows, row r sample r // T's, which the engine unflattens to (B, T, d) once the
# structure probe has verified the fold (fastdp.layers.batchdim.fold_factor). No family is refused any more.
REFUSED: dict[str, str] = {}


def _assert_refused_at_backward(model, loss, data, *, mode, fn, style, reduction):
    from oracle import make_engine, user_loss

    engine = make_engine(model, batch_size=sum(len(y) for _, y in data), mode=mode, fn=fn, style=style,
                         reduction=reduction)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    (x, y) = data[0]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=REFUSED["opt"]):
        user_loss(loss(model(*x), y), reduction).backward()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("mode", ["BK-MixOpt", "BK-ghost", "instantiate"])
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_hf_model_default_sdpa_attention(family, mode):
    """The default attention implementation (scaled_dot_product_attention) instead of eager."""
    model, batches, loss = build(family, attn="sdpa")
    assert model.m.config._attn_implementation == "sdpa"
    check_engine(model, loss, batches([3, 1], 7), mode=mode, fn="abadi", style="all-layer")


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost", "instantiate"])
def test_gpt2_with_padding_mask(mode):
    torch.manual_seed(1)
    model = LMWrap(gpt2()).to(D)
    check_engine(model, lm_loss, lm_batches([4], 8, mask=True, pad_id=0), mode=mode, fn="automatic",
                 style="layer-wise", reduction="sum")


@pytest.mark.parametrize("mode", ["BK-MixOpt", "BK-ghost", "instantiate"])
def test_bert_explicit_token_type_ids(mode):
    """token_type_ids given per sample (B, T) with both types used; position ids still from the (1, T) buffer."""

    class WithTypes(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, types):
            return self.m(input_ids=ids, token_type_ids=types).logits

    torch.manual_seed(2)
    model = WithTypes(bert()).to(D)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(2, V, (4, T_CLS), generator=g)
    types = (torch.arange(T_CLS) >= torch.tensor([[2], [3], [6], [4]])).long()
    y = torch.randint(0, LABELS, (4,), generator=g)
    check_engine(model, cls_loss, [((ids[:3], types[:3]), y[:3]), ((ids[3:], types[3:]), y[3:])], mode=mode,
                 fn="abadi", style="layer-wise")


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost", "instantiate"])
def test_t5_encoder_with_head(mode):
    """T5EncoderModel (relative attention bias computed once and reused by every layer) + mean-pool head."""

    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            cfg = tf.T5Config(vocab_size=V, d_model=HID, d_kv=8, d_ff=FFN, num_layers=2, num_heads=2,
                              relative_attention_num_buckets=8, relative_attention_max_distance=16,
                              dropout_rate=0.0, feed_forward_proj="gated-gelu", attn_implementation="eager")
            self.enc = tf.T5EncoderModel(cfg)
            self.head = nn.Linear(HID, LABELS)

        def forward(self, ids, mask):
            h = self.enc(input_ids=ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).to(h.dtype)
            return self.head((h * m).sum(1) / m.sum(1))

    torch.manual_seed(3)
    model = Enc().to(D)
    check_engine(model, cls_loss, cls_batches([3, 1], 10, pad_id=0), mode=mode, fn="automatic",
                 reduction="sum", style="all-layer", atol_rel=F32_INSIDE["t5"])


@pytest.mark.parametrize("mode", ["BK-MixOpt", "BK-ghost", "instantiate"])
def test_llama_tied_embeddings(mode):
    torch.manual_seed(4)
    model = LMWrap(llama(tie_word_embeddings=True)).to(D)
    assert model.m.lm_head.weight is model.m.model.embed_tokens.weight
    check_engine(model, lm_loss, lm_batches([3, 1], 11), mode=mode, fn="abadi", style="all-layer",
                 atol_rel=F32_INSIDE["llama"])


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost", "instantiate"])
def test_opt_with_projection(mode):
    """OPT with word_embed_proj_dim != hidden (project_in / project_out), post-norm: its decoder layers' folded
    calls match the oracle."""
    torch.manual_seed(5)
    cfg = tf.OPTConfig(vocab_size=V, hidden_size=HID, ffn_dim=FFN, num_hidden_layers=2, num_attention_heads=2,
                       max_position_embeddings=16, word_embed_proj_dim=12, dropout=0.0, attention_dropout=0.0,
                       attn_implementation="eager", do_layer_norm_before=False)
    model = LMWrap(tf.OPTForCausalLM(cfg)).to(D)
    check_engine(model, lm_loss, lm_batches([4, 1], 12, mask=True, pad_id=1), mode=mode, fn="abadi",
                 style="all-layer", reduction="sum", atol_rel=F32_INSIDE["opt"])


# --------------------------------------------------------------------------- oracle self-checks (no engine)


def _untie(model, get_out_module):
    """A float64 copy whose output-layer weight is a separate parameter (the input-side uses keep the original)."""
    om = copy.deepcopy(model).to(D)
    head = get_out_module(om)
    head.weight = nn.Parameter(head.weight.detach().clone())
    return om


@pytest.mark.parametrize("family", ["gpt2", "opt", "t5"])
def test_tied_embedding_cross_terms_matter(family):
    """For the tied word embedding / LM head, the per-sample gradient is the SUM of both uses and its norm includes
    the cross term 2<g_in, g_out>. Check that the oracle's tied gradient is that sum, and that treating the two
    uses as separate (sum of squared norms) gives per-sample norms and a clipped gradient that differ beyond the
    test tolerance: an engine that drops the cross terms cannot pass test_hf_model_matches_oracle."""
    model, batches, loss = build(family)
    data = batches([4], 13)
    om, names, groups, psg = oracle_for(model, loss, data)
    tied = {"gpt2": "m.transformer.wte.weight", "opt": "m.model.decoder.embed_tokens.weight", "t5": "m.shared.weight"}[
        family
    ]
    assert tied in names
    head_of = {"gpt2": lambda m: m.m.lm_head, "opt": lambda m: m.m.lm_head, "t5": lambda m: m.m.lm_head}[family]
    assert head_of(model).weight is dict(model.named_parameters())[tied]
    un = _untie(model, head_of)
    un_names = names + ["m.lm_head.weight"]
    psg_un = per_sample_grads(un, loss, data, un_names)
    g_in, g_out = psg_un[tied], psg_un["m.lm_head.weight"]
    torch.testing.assert_close(g_in + g_out, psg[tied], rtol=1e-9, atol=1e-12)
    cross = 2 * (g_in * g_out).flatten(1).sum(1)
    sq = psg[tied].flatten(1).pow(2).sum(1)
    assert (cross.abs() > 1e-5 * sq).all() and cross.abs().max() > 1e-2 * sq.max(), (cross, sq)
    # the wrong oracle: norms without the cross term
    R = choose_R(psg, groups, "middle")
    right = clipped_sum(psg, groups, "abadi", R, 4)
    n_right = group_norms(psg, groups)[:, 0]
    n_wrong = (n_right.pow(2) - cross).sqrt()
    C_wrong = torch.clamp(R / (n_wrong + 1e-6), max=1.0)
    wrong = {n: (C_wrong.reshape(-1, *[1] * (psg[n].dim() - 1)) * psg[n]).sum(0) / 4 for n in names}
    diff = max(float((wrong[n] - right[n]).abs().max() / (right[n].abs().max() + 1e-30)) for n in names)
    assert diff > 1e-4, diff


@pytest.mark.parametrize("family", list(FAMILIES))
def test_oracle_per_sample_grads_add_up(family):
    """Oracle self-check per family: per-sample gradients sum to the ordinary batched gradient (eager and sdpa),
    and eager and sdpa give the same per-sample gradients (to float32 precision, see below)."""
    res = {}
    for attn in ("eager", "sdpa"):
        model, batches, loss = build(family, attn=attn)
        data = batches([3, 1], 14)
        om, names, groups, psg = oracle_for(model, loss, data)
        check_decomposition(model, loss, data, psg, names, rtol=1e-9)
        res[attn] = psg
    # eager attention of Llama / OPT / GPT-NeoX runs its softmax in float32 even for a float64 model, so the two
    # implementations agree only to float32 precision
    assert rel_err(res["sdpa"], res["eager"]) < 1e-5


def test_position_ids_are_broadcast_from_one_row():
    """Documents what the engine has to cope with (transformers 5): GPT-2 / BERT / Llama build position ids of
    shape (1, T); BERT's token-type ids are an expand() of a (1, T) buffer (batch stride 0); RoBERTa and OPT derive
    (B, T) positions from the input ids / attention mask."""
    seen = {}

    def hook(name):
        def f(mod, args, out):
            seen[name] = tuple(args[0].shape), args[0].stride()

        return f

    for family, emb_path in [
        ("gpt2", "m.transformer.wpe"),
        ("bert", "m.bert.embeddings.position_embeddings"),
        ("bert_tt", "m.bert.embeddings.token_type_embeddings"),
        ("roberta", "m.roberta.embeddings.position_embeddings"),
        ("opt", "m.model.decoder.embed_positions"),
    ]:
        fam = family.split("_")[0]
        model, batches, loss = build(fam)
        mod = model.get_submodule(emb_path)
        h = mod.register_forward_hook(hook(family))
        (x, _), = batches([3], 15)
        with torch.no_grad():
            model(*x)
        h.remove()
    assert seen["gpt2"][0] == (1, T_LM)
    assert seen["bert"][0] == (1, T_CLS)
    assert seen["bert_tt"][0] == (3, T_CLS) and seen["bert_tt"][1][0] == 0  # expanded: stride 0 over the batch
    assert seen["roberta"][0] == (3, T_CLS)
    assert seen["opt"][0] == (3, T_LM)


# --------------------------------------------------------------------------- slow: the full grid


@pytest.mark.slow
@pytest.mark.parametrize("style", ["all-layer", "layer-wise", "param-wise"])
@pytest.mark.parametrize("mode,fn", list(itertools.product(MODES, FNS)))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_model_full_grid_slow(family, mode, fn, style):
    model, batches, loss = build(family, seed=20)
    red = ["mean", "sum"][(MODES.index(mode) + FNS.index(fn)) % 2]
    check_engine(model, loss, batches([3, 1], 16), mode=mode, fn=fn, style=style, reduction=red,
                 atol_rel=F32_INSIDE.get(family, 0.0))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_model_sdpa_slow(family, mode):
    model, batches, loss = build(family, attn="sdpa", seed=21)
    check_engine(model, loss, batches([4], 17), mode=mode, fn="automatic", style="layer-wise", reduction="sum",
                 atol_rel=F32_INSIDE.get(family, 0.0))


def test_configs_cover_the_requirements():
    modes = {c[0] for c in CONFIGS}
    assert {"BK-MixOpt", "instantiate"} <= modes and modes & {"BK-ghost", "ghost"}
    assert {c[3] for c in CONFIGS} == {"mean", "sum"}
    assert any(c[4] == [1] for c in CONFIGS)
    assert {"all-layer", "layer-wise"} <= {c[2] for c in CONFIGS}


# --------------------------------------------------------------------------- DP training with noise


def test_gpt2_noisy_training_runs():
    """Several DP steps with sigma=1 (float32, Adam): losses stay finite, the weights move, the accountant counts,
    and the first step's noise has the contract's scale: ||released - noise-free oracle|| ~ sigma R sqrt(d) / B."""
    import warnings

    from fastdp import PrivacyEngine

    torch.manual_seed(30)
    model = LMWrap(gpt2()).float()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    d = sum(p.numel() for p in model.parameters() if p.requires_grad)
    B, R, sigma = 4, 1.0, 1.0
    data = [lm_batches([3, 1], 200 + s) for s in range(5)]
    om, _, groups, psg = oracle_for(model, lm_loss, data[0])
    want = clipped_sum(psg, groups, "abadi", R, B)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, batch_size=B, sample_size=1000, noise_multiplier=sigma, max_grad_norm=R,
                               noise_generator=torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine.attach(opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step, batches in enumerate(data):
        for (x, y) in batches:
            loss = lm_loss(model(*x), y).mean()
            assert torch.isfinite(loss)
            loss.backward()
        opt.step()
        if step == 0:  # .grad holds the released gradient (written by the step pre-hook; Adam leaves it)
            g = {n: p.grad for n, p in model.named_parameters()}
            noise = torch.sqrt(sum(((g[n].double() - want[n]) ** 2).sum() for n in names))
            ratio = float(noise) / (sigma * R * d**0.5 / B)
            assert 0.9 < ratio < 1.1, ratio
        opt.zero_grad()
    assert engine.steps == 5
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    eps = engine.get_privacy_spent()["epsilon"]
    assert 0 < eps < float("inf")
