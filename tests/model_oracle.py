"""Helpers for the whole-model oracle tests (tests/test_models_*.py).

Builds on tests/oracle.py (float64 deep copy, one batch-of-one backward per sample, clip, sum). Adds:

* thin wrappers that turn a Hugging Face model into ``module(*inputs) -> logits`` so the oracle's
  ``model(*x)`` convention applies (the wrapper adds the prefix ``m.`` to every parameter name);
* per-sample losses for language models and classifiers;
* :func:`check_engine`: oracle self-checks (the per-sample gradients sum to the ordinary batched gradient; the
  clipping actually changes the result, so the comparison can fail) and then the engine-vs-oracle comparison;
* :func:`rel_err`: whole-gradient relative error, for the low-precision tests;
* :func:`synced_copy`: an oracle copy of a model that an engine is attached to (without the engine's hooks);
* small Hugging Face models built from configs (:func:`build_hf`) and their batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from oracle import (
    _len,
    assert_grads_close,
    choose_R,
    clipped_sum,
    make_groups,
    max_clip_factor,
    oracle_model,
    per_sample_grads,
    plain_gradient,
    run_engine_once,
    trainable_names,
)
from torch import nn

D = torch.float64


# --------------------------------------------------------------------------- wrappers


class LMWrap(nn.Module):
    """Causal LM -> logits (B, T, V). ``mask`` optional (B, T) attention mask."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, ids, mask=None):
        kw = {} if mask is None else {"attention_mask": mask}
        return self.m(input_ids=ids, use_cache=False, **kw).logits


class ClsWrap(nn.Module):
    """Sequence classifier -> logits (B, num_labels). Position / token-type ids are left to the model."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, ids, mask=None):
        kw = {} if mask is None else {"attention_mask": mask}
        return self.m(input_ids=ids, **kw).logits


class Seq2SeqWrap(nn.Module):
    """Encoder-decoder -> decoder logits (B, T_dec, V)."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, ids, dec_ids, mask=None):
        kw = {} if mask is None else {"attention_mask": mask}
        return self.m(input_ids=ids, decoder_input_ids=dec_ids, use_cache=False, **kw).logits


# --------------------------------------------------------------------------- losses


def lm_loss(logits, target):
    """Per-sample mean next-token cross-entropy: logits (B, T, V), target ids (B, T) -> (B,)."""
    B, T, V = logits.shape
    lg = logits[:, :-1].reshape(-1, V)
    tg = target[:, 1:].reshape(-1)
    lg = lg if lg.dtype == D else lg.float()
    return F.cross_entropy(lg, tg, reduction="none").reshape(B, T - 1).mean(1)


def seq_loss(logits, target):
    """Per-sample mean token cross-entropy without shift (seq2seq decoder logits vs labels) -> (B,)."""
    B, T, V = logits.shape
    lg = logits.reshape(-1, V)
    lg = lg if lg.dtype == D else lg.float()
    return F.cross_entropy(lg, target.reshape(-1), reduction="none").reshape(B, T).mean(1)


def cls_loss(logits, y):
    """Per-sample cross-entropy: logits (B, C), labels (B,) -> (B,)."""
    lg = logits if logits.dtype == D else logits.float()
    return F.cross_entropy(lg, y, reduction="none")


def mse_loss(out, y):
    return 0.5 * (out - y).pow(2).flatten(1).sum(1)


# --------------------------------------------------------------------------- oracle self-checks


def check_decomposition(model, loss, batches, psg, names, rtol=1e-8):
    """The oracle's per-sample gradients must add up to the ordinary gradient of the summed loss of the batched
    model. This fails if the batched forward mixes samples, or if the batch-of-one forward is not the same
    function as the batched one (e.g. dropout left on)."""
    plain = plain_gradient(model, loss, batches, "sum", names)
    scale = math.sqrt(sum(float(v.pow(2).sum()) for v in plain.values()))
    assert scale > 0
    for n in names:
        err = float((psg[n].sum(0) - plain[n]).norm())
        assert err <= rtol * scale + 1e-12, f"oracle self-check: sum of per-sample grads of {n} != batch grad ({err})"


def check_discriminates(psg, groups, fn, R, batch_size, want, rtol):
    """The clipped oracle must differ (far beyond the tolerance) from the unclipped sum, so an engine that forgot to
    clip could not pass: R must actually clip some samples."""
    unclipped = {n: v.sum(0) / batch_size for n, v in psg.items()}
    num = math.sqrt(sum(float((want[n] - unclipped[n]).pow(2).sum()) for n in want))
    den = math.sqrt(sum(float(want[n].pow(2).sum()) for n in want))
    assert num > 1e3 * rtol * den, f"test not discriminative: clipping changes the result by {num} (of {den})"


# --------------------------------------------------------------------------- engine vs oracle


def synced_copy(template: nn.Module, model: nn.Module) -> nn.Module:
    """A copy of ``template`` (a deep copy of ``model`` taken before an engine was attached, so without the engine's
    hooks) with ``model``'s current parameter values and requires_grad flags. Deep-copying an attached model would
    copy the engine's hooks too (the copy's forward would run ghost differentiation and the oracle would see no
    gradients)."""
    import copy

    out = copy.deepcopy(template)
    mine = dict(out.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for n, p in model.named_parameters(remove_duplicate=False):
            mine[n].copy_(p)
            mine[n].requires_grad_(p.requires_grad)
    return out


def oracle_for(model, loss, batches, *, style="all-layer", names=None):
    names = trainable_names(model) if names is None else list(names)
    om = oracle_model(model)
    groups = make_groups(om, style, names)
    psg = per_sample_grads(om, loss, batches, names)
    return om, names, groups, psg


def check_engine(
    model: nn.Module,
    loss: Callable,
    batches: Sequence[tuple],
    *,
    mode: str,
    fn: str = "abadi",
    style="all-layer",
    reduction: str = "mean",
    where: str = "middle",
    batch_size: int | None = None,
    R: float | None = None,
    rtol: float = 1e-6,
    atol: float = 1e-10,
    decompose: bool = True,
    decompose_rtol: float = 1e-8,
    atol_rel: float = 0.0,
    **kw,
):
    """Oracle self-checks, then one engine step (sigma=0): the released gradient must equal the oracle's,
    elementwise within ``rtol`` plus ``atol`` (times the largest clip factor, as in oracle.compare_engine_to_oracle).

    ``atol_rel``: for models that compute parts of their forward in float32 even when their weights are float64
    (see F32_INSIDE), the gradient itself is only defined to float32 rounding in those branches; there, each
    parameter's absolute tolerance is ``atol_rel`` times its largest gradient entry.

    Returns (engine, optimizer, got, want, R)."""
    if batch_size is None:
        batch_size = sum(_len(x) for x, _ in batches)
    om, names, groups, psg = oracle_for(model, loss, batches, style=style)
    assert all(psg[n].shape[0] == sum(_len(x) for x, _ in batches) for n in names)
    if decompose:
        check_decomposition(model, loss, batches, psg, names, rtol=decompose_rtol)
    if R is None:
        R = choose_R(psg, groups, where, gap=1e-6 if rtol < 1e-5 else 1e-3)
    want = clipped_sum(psg, groups, fn, R, batch_size)
    check_discriminates(psg, groups, fn, R, batch_size, want, rtol)
    atol = atol * max(1.0, max_clip_factor(psg, groups, fn, R))
    engine, opt, got = run_engine_once(
        model, loss, batches, batch_size=batch_size, R=R, fn=fn, style=style, mode=mode, reduction=reduction, **kw
    )
    msg = f"[{mode} {fn} {style} {reduction} R={R:.4g}]"
    if atol_rel:
        # per parameter: an absolute tolerance of atol_rel times the parameter's largest gradient entry
        for n in names:
            a = max(atol, atol_rel * float(want[n].abs().max())) if want[n].numel() else atol
            assert_grads_close({n: got[n]}, {n: want[n]}, rtol=rtol, atol=a / max(1.0, float(want[n].abs().max())),
                               msg=msg)
    else:
        assert_grads_close(got, want, rtol=rtol, atol=atol, msg=msg)
    return engine, opt, got, want, R


def rel_err(got: dict, want: dict, names=None) -> float:
    """||got - want|| / ||want|| over the whole gradient (all names)."""
    names = list(want) if names is None else names
    num = sum(float((got[n].double() - want[n].double()).pow(2).sum()) for n in names)
    den = sum(float(want[n].double().pow(2).sum()) for n in names)
    return math.sqrt(num / den)


def quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:  # pragma: no cover
        pass


# =========================================================================== Hugging Face models
# Small configs: no two dimensions coincide with a physical batch size used by the tests (1, 3, 4): T=7 or 6,
# hidden 16, 2 heads of 8, ffn 24, 5 labels, vocabulary 61.


def _tf():
    import transformers

    quiet_transformers()
    return transformers


V = 61  # vocabulary
HID = 16  # hidden size; 2 heads of 8
FFN = 24
LABELS = 5
T_LM = 7  # language-model sequence length
T_CLS = 6  # classifier sequence length
T_DEC = 5  # T5 decoder length


# --------------------------------------------------------------------------- Hugging Face builders (dropout 0)


def gpt2(attn="eager", vocab=V, **kw):
    tf = _tf()
    cfg = tf.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=HID, n_layer=2, n_head=2, n_inner=FFN, attn_pdrop=0.0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation=attn, **kw)
    return tf.GPT2LMHeadModel(cfg)


def bert(attn="eager", vocab=V, **kw):
    tf = _tf()
    cfg = tf.BertConfig(vocab_size=vocab, hidden_size=HID, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=FFN, max_position_embeddings=16, type_vocab_size=2, num_labels=LABELS,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation=attn, **kw)
    return tf.BertForSequenceClassification(cfg)


def roberta(attn="eager", vocab=V, **kw):
    tf = _tf()
    cfg = tf.RobertaConfig(vocab_size=vocab, hidden_size=HID, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=FFN, max_position_embeddings=16, num_labels=LABELS, pad_token_id=1,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation=attn, **kw)
    return tf.RobertaForSequenceClassification(cfg)


def t5(attn="eager", vocab=V, **kw):
    tf = _tf()
    cfg = tf.T5Config(vocab_size=vocab, d_model=HID, d_kv=8, d_ff=FFN, num_layers=2, num_decoder_layers=2, num_heads=2,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                      attn_implementation=attn, **kw)
    return tf.T5ForConditionalGeneration(cfg)


def llama(attn="eager", vocab=V, **kw):
    tf = _tf()
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=HID, intermediate_size=FFN, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                         attention_dropout=0.0, attn_implementation=attn, **kw)
    return tf.LlamaForCausalLM(cfg)


def opt(attn="eager", vocab=V, **kw):
    tf = _tf()
    cfg = tf.OPTConfig(vocab_size=vocab, hidden_size=HID, ffn_dim=FFN, num_hidden_layers=2, num_attention_heads=2,
                       max_position_embeddings=16, word_embed_proj_dim=HID, dropout=0.0, attention_dropout=0.0,
                       layerdrop=0.0, attn_implementation=attn, **kw)
    return tf.OPTForCausalLM(cfg)


def neox(attn="eager", vocab=V, **kw):
    tf = _tf()
    cfg = tf.GPTNeoXConfig(vocab_size=vocab, hidden_size=HID, intermediate_size=FFN, num_hidden_layers=2,
                           num_attention_heads=2, max_position_embeddings=16, attention_dropout=0.0,
                           hidden_dropout=0.0, attn_implementation=attn, **kw)
    return tf.GPTNeoXForCausalLM(cfg)


def _padded(ids, pad_id, g):
    """Right-padding mask, different per sample (sample 0 unpadded); padded ids set to pad_id."""
    n, T = ids.shape
    mask = torch.ones(n, T, dtype=torch.long)
    for i in range(n):
        mask[i, T - (i % 3):] = 0
    if pad_id is not None:
        ids = ids.masked_fill(mask == 0, pad_id)
    return ids, mask


def lm_batches(sizes, seed, *, mask=False, pad_id=None, lo=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        ids = torch.randint(lo, vocab, (n, T_LM), generator=g)
        if mask:
            ids, m = _padded(ids, pad_id, g)
            out.append(((ids, m), ids))
        else:
            out.append(((ids,), ids))
    return out


def cls_batches(sizes, seed, *, pad_id=None, mask=True, vocab=V, lo=2):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        ids = torch.randint(lo, vocab, (n, T_CLS), generator=g)  # ids 0 / 1 are the pad tokens of BERT / RoBERTa
        y = torch.randint(0, LABELS, (n,), generator=g)
        if mask:
            ids, m = _padded(ids, pad_id, g)
            out.append(((ids, m), y))
        else:
            out.append(((ids,), y))
    return out


def s2s_batches(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        ids = torch.randint(2, V, (n, T_LM), generator=g)
        ids, m = _padded(ids, 0, g)
        dec = torch.randint(2, V, (n, T_DEC), generator=g)
        lab = torch.randint(2, V, (n, T_DEC), generator=g)
        out.append(((ids, dec, m), lab))
    return out


# family -> (build(attn) -> wrapped float64 model, batches(sizes, seed), per-sample loss)
FAMILIES = {
    "gpt2": (lambda a: LMWrap(gpt2(a)), lambda s, k: lm_batches(s, k), lm_loss),
    "bert": (lambda a: ClsWrap(bert(a)), lambda s, k: cls_batches(s, k, pad_id=0), cls_loss),
    "roberta": (lambda a: ClsWrap(roberta(a)), lambda s, k: cls_batches(s, k, pad_id=1), cls_loss),
    "t5": (lambda a: Seq2SeqWrap(t5(a)), s2s_batches, seq_loss),
    "llama": (lambda a: LMWrap(llama(a)), lambda s, k: lm_batches(s, k, mask=True, pad_id=0), lm_loss),
    "opt": (lambda a: LMWrap(opt(a)), lambda s, k: lm_batches(s, k, mask=True, pad_id=1), lm_loss),
    "neox": (lambda a: LMWrap(neox(a)), lambda s, k: lm_batches(s, k, mask=True, pad_id=0), lm_loss),
}


# Families whose float64 model still runs some operations in float32: LlamaRMSNorm and T5LayerNorm cast the hidden
# states to float32 for the variance (Llama normalises in float32), and the eager attention of Llama / OPT /
# GPT-NeoX takes its softmax in float32. Gradients through those branches carry float32 rounding (~1e-7 relative),
# which any correct implementation may round differently.
F32_INSIDE = {"t5": 1e-6, "llama": 1e-6, "opt": 1e-6, "neox": 1e-6}


def build_hf(family, attn="eager", seed=0):
    torch.manual_seed(seed)
    make, batches, loss = FAMILIES[family]
    model = make(attn).to(D)
    model.train()  # dropout is 0: train mode is deterministic
    return model, batches, loss


# --------------------------------------------------------------------------- issue-12 families (dropout 0)
# Decoders with grouped-query attention and rotary embeddings, ALiBi (BLOOM), partial rotary (Phi); encoders with
# factorised / shared layers (ALBERT), a separate embedding width (ELECTRA), no token types (DistilBERT). Same small
# sizes as above: vocabulary 61, hidden 16, 2 heads of 8 (1 key/value head where the family has GQA), ffn 24.


def _decoder_common(**kw):
    return dict(vocab_size=V, hidden_size=HID, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=16, attention_dropout=0.0, **kw)


def mistral(attn="eager", **kw):
    tf = _tf()
    return tf.MistralForCausalLM(tf.MistralConfig(attn_implementation=attn, **_decoder_common(**kw)))


def qwen2(attn="eager", **kw):
    tf = _tf()
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(attn_implementation=attn, **_decoder_common(**kw)))


def gemma(attn="eager", **kw):
    """Gemma: head_dim given explicitly, (1 + w) RMS-norm scale, embeddings scaled by sqrt(d), LM head tied."""
    tf = _tf()
    return tf.GemmaForCausalLM(tf.GemmaConfig(attn_implementation=attn, head_dim=8, **_decoder_common(**kw)))


def phi(attn="eager", **kw):
    """Phi: partial rotary embedding (half of each head), parallel attention / MLP, LayerNorm, biases."""
    tf = _tf()
    cfg = tf.PhiConfig(vocab_size=V, hidden_size=HID, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=2,
                       max_position_embeddings=16, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                       partial_rotary_factor=0.5, attn_implementation=attn, **kw)
    return tf.PhiForCausalLM(cfg)


def bloom(attn="eager", **kw):
    """BLOOM: ALiBi position bias computed from the attention mask, fused query_key_value, LM head tied."""
    tf = _tf()
    cfg = tf.BloomConfig(vocab_size=V, hidden_size=HID, n_layer=2, n_head=2, hidden_dropout=0.0, attention_dropout=0.0,
                         attn_implementation=attn, **kw)
    return tf.BloomForCausalLM(cfg)


def _encoder_common(**kw):
    return dict(vocab_size=V, hidden_size=HID, num_hidden_layers=2, num_attention_heads=2, intermediate_size=FFN,
                max_position_embeddings=16, num_labels=LABELS, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, **kw)


def distilbert(attn="eager", **kw):
    tf = _tf()
    cfg = tf.DistilBertConfig(vocab_size=V, dim=HID, n_layers=2, n_heads=2, hidden_dim=FFN, max_position_embeddings=16,
                              num_labels=LABELS, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0,
                              attn_implementation=attn, **kw)
    return tf.DistilBertForSequenceClassification(cfg)


def electra(attn="eager", **kw):
    """ELECTRA: embedding width 12 projected to the hidden width 16."""
    tf = _tf()
    return tf.ElectraForSequenceClassification(tf.ElectraConfig(embedding_size=12, attn_implementation=attn,
                                                                **_encoder_common(**kw)))


def albert(attn="eager", **kw):
    """ALBERT: factorised embedding (12 -> 16) and ONE layer group applied num_hidden_layers = 2 times."""
    tf = _tf()
    return tf.AlbertForSequenceClassification(tf.AlbertConfig(embedding_size=12, classifier_dropout_prob=0.0,
                                                               attn_implementation=attn, **_encoder_common(**kw)))


def padded_lm_batches(sizes, seed, *, pad_id=0, T=T_LM, vocab=V):
    """Causal-LM batches ``((ids, mask), labels)`` with attention masks of different lengths per sample: sample i
    has ``i % 3`` padding positions on the right, padded ids are ``pad_id`` and their labels -100 (the
    ``ignore_index`` of :func:`fastdp.losses.causal_lm_loss`). (Not left padding: the eager attention of
    transformers 5.23 gives NaN for the fully masked rows of the leading pad positions.)"""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        ids = torch.randint(2, vocab, (n, T), generator=g)
        mask = torch.ones(n, T, dtype=torch.long)
        for i in range(n):
            mask[i, T - i % 3:] = 0
        ids = ids.masked_fill(mask == 0, pad_id)
        out.append(((ids, mask), ids.masked_fill(mask == 0, -100)))
    return out
