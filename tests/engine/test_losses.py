"""fastdp.losses (per-sample losses) and fastdp.hf_guard (refusing Hugging Face's labels= loss).

* every helper against a hand-written per-sample loop (one sample at a time, its own token mean, log-softmax
  indexed by hand), float64, with ignore_index padding, variable numbers of label tokens, a sample without any
  label token, B = 1, B = 0 and B equal to the sequence length;
* a tiny float64 GPT-2 with padded, variable-length labels: the engine with ``causal_lm_loss(...).mean()`` releases
  the batch-of-one oracle's clipped sum (per-sample gradient = gradient of the sample's own token mean);
* the bug the refusal prevents, with plain autograd: under Hugging Face's token-mean loss each sample's gradient
  is scaled by B n_i / N, and removing one sample moves the released clipped sum by more than R;
* labels= under an attached engine raises (root model, wrapped model, peft model), naming the helper; without an
  engine, after detach() and under no_grad it works; sequence classification with labels= is allowed (and matches
  the oracle) unless a label is -100 or loss_reduction is "sum".
"""

from __future__ import annotations

import pytest
import torch

import fastdp
from fastdp import hf_guard
from fastdp.losses import (
    causal_lm_loss,
    per_sample_mean,
    seq2seq_loss,
    sequence_classification_loss,
    token_classification_loss,
)

D = torch.float64
IGN = -100


# --------------------------------------------------------------------------- hand-written per-sample loops


def _nll(row: torch.Tensor, y: int) -> torch.Tensor:
    return -(row - torch.logsumexp(row, 0))[y]


def loop_token_loss(logits, labels, shift):
    """One sample at a time: the mean over that sample's non-ignored tokens (0 if none)."""
    out = []
    for i in range(logits.shape[0]):
        terms = []
        T = logits.shape[1]
        for t in range(T - 1 if shift else T):
            y = int(labels[i, t + 1 if shift else t])
            if y != IGN:
                terms.append(_nll(logits[i, t], y))
        out.append(torch.stack(terms).mean() if terms else logits.new_zeros(()))
    return torch.stack(out) if out else logits.new_zeros((0,))


def token_case(B, T=7, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=D) * 3
    labels = torch.randint(0, V, (B, T), generator=g)
    for i in range(B):  # variable numbers of label tokens: right padding of i % 4 tokens, a prompt of i % 3
        if i % 4:
            labels[i, T - i % 4:] = IGN
        labels[i, : i % 3] = IGN
    if B >= 2:
        labels[1] = IGN  # a sample with no label token at all
    return logits, labels


HELPERS = [(causal_lm_loss, True), (seq2seq_loss, False), (token_classification_loss, False)]


@pytest.mark.parametrize("B", [0, 1, 2, 5, 7])  # 7 == T
@pytest.mark.parametrize("helper,shift", HELPERS, ids=lambda h: getattr(h, "__name__", str(h)))
def test_token_helpers_equal_per_sample_loop(helper, shift, B):
    logits, labels = token_case(B)
    got = helper(logits, labels)
    want = loop_token_loss(logits, labels, shift)
    assert got.shape == (B,) and got.dtype == D
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if B >= 2:
        assert got[1] == 0
    counts = (labels[:, 1:] if shift else labels).ne(IGN).sum(1)
    assert len(set(counts.tolist())) > 2 or B < 5  # the case really has variable token counts


def test_causal_lm_loss_matches_hf_convention_per_sample():
    """For one sample, HF's token mean (transformers' ForCausalLMLoss) is that sample's own token mean."""
    pytest.importorskip("transformers")
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits, labels = token_case(5)
    got = causal_lm_loss(logits, labels)
    for i in (0, 2, 3, 4):
        want = ForCausalLMLoss(logits[i:i + 1], labels[i:i + 1], vocab_size=logits.shape[-1])
        torch.testing.assert_close(got[i], want.to(D), rtol=1e-6, atol=0)  # HF computes it in float32


def test_no_label_token_gives_zero_loss_and_finite_gradient():
    logits, labels = token_case(3)
    labels[:] = IGN
    x = logits.clone().requires_grad_(True)
    for helper, _ in HELPERS:
        loss = helper(x, labels)
        assert torch.equal(loss, torch.zeros(3, dtype=D))
        (g,) = torch.autograd.grad(loss.sum(), x)
        assert torch.isfinite(g).all() and not g.any()


def test_no_shift_position_and_T1():
    logits, labels = token_case(3, T=1)
    assert torch.equal(causal_lm_loss(logits, labels), torch.zeros(3, dtype=D))  # shift leaves no position
    torch.testing.assert_close(causal_lm_loss(logits, labels, shift=False), loop_token_loss(logits, labels, False))


def test_low_precision_logits_are_upcast():
    logits, labels = token_case(4)
    got = causal_lm_loss(logits.to(torch.bfloat16), labels)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), loop_token_loss(logits.to(torch.bfloat16).double(), labels, True),
                               rtol=1e-5, atol=1e-5)


def test_per_sample_mean():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 6.0], [7.0, 8.0, 9.0]], dtype=D)
    m = torch.tensor([[True, False, True], [False, False, True], [False, False, False]])
    assert torch.equal(per_sample_mean(v, m), torch.tensor([2.0, 6.0, 0.0], dtype=D))
    assert per_sample_mean(v[:0], m[:0]).shape == (0,)
    with pytest.raises(ValueError, match="bool mask"):
        per_sample_mean(v, m.long())


@pytest.mark.parametrize("B", [0, 1, 4, 6])
def test_sequence_classification_loss(B):
    g = torch.Generator().manual_seed(1)
    C = 6 if B != 6 else 5
    logits = torch.randn(B, C, generator=g, dtype=D)
    y = torch.randint(0, C, (B,), generator=g)
    if B >= 4:
        y[2] = IGN
    want = torch.stack([_nll(logits[i], int(y[i])) if int(y[i]) != IGN else logits.new_zeros(())
                        for i in range(B)]) if B else logits.new_zeros((0,))
    got = sequence_classification_loss(logits, y)
    assert got.shape == (B,)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # regression (C == 1, float labels (B,) or (B, 1)): squared error per sample
    out = torch.randn(B, 1, generator=g, dtype=D)
    r = torch.randn(B, generator=g, dtype=D)
    want_r = torch.stack([(out[i, 0] - r[i]) ** 2 for i in range(B)]) if B else out.new_zeros((0,))
    torch.testing.assert_close(sequence_classification_loss(out, r), want_r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sequence_classification_loss(out, r[:, None]), want_r, rtol=1e-12, atol=1e-12)
    # multi-label (float (B, C)): BCE-with-logits, mean over classes, per sample
    t = torch.rand(B, C, generator=g, dtype=D)
    want_m = []
    for i in range(B):
        p = torch.sigmoid(logits[i])
        want_m.append(-(t[i] * torch.log(p) + (1 - t[i]) * torch.log1p(-p)).mean())
    want_m = torch.stack(want_m) if B else logits.new_zeros((0,))
    torch.testing.assert_close(sequence_classification_loss(logits, t), want_m, rtol=1e-10, atol=1e-12)


def test_sequence_classification_mean_equals_hf_loss():
    """The batch mean of the per-sample losses is exactly HF's classification loss (no ignored label)."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from transformers.loss.loss_utils import ForSequenceClassificationLoss

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 4, generator=g, dtype=D)
    y = torch.randint(0, 4, (5,), generator=g)
    t = torch.rand(5, 4, generator=g, dtype=D)
    for lab in (y, t):
        cfg = SimpleNamespace(num_labels=4, problem_type=None)
        want = ForSequenceClassificationLoss(lab, logits, cfg)
        torch.testing.assert_close(sequence_classification_loss(logits, lab).mean(), want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("call,match", [
    (lambda: causal_lm_loss(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long)), r"shape \(B, T, V\)"),
    (lambda: causal_lm_loss(torch.zeros(2, 3, 4), torch.zeros(2, 3)), "integer tensor"),
    (lambda: causal_lm_loss(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long)), "do not match"),
    (lambda: causal_lm_loss(torch.zeros(2, 3, 4), torch.full((2, 3), 4)), "label 4 is not a class index"),
    (lambda: seq2seq_loss(torch.zeros(2, 3, 4, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)),
     "floating-point"),
    (lambda: token_classification_loss(torch.zeros(2, 3, 4), torch.full((2, 3), -5)), "label -5"),
    (lambda: sequence_classification_loss(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long)), r"\(B, C\)"),
    (lambda: sequence_classification_loss(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long)), "batch size 2"),
    (lambda: sequence_classification_loss(torch.zeros(2, 1), torch.zeros(2, dtype=torch.long)), "float labels"),
    (lambda: sequence_classification_loss(torch.zeros(2, 3), torch.zeros(2, 2)), r"shape \(2, 3\)"),
    (lambda: sequence_classification_loss(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), problem_type="x"),
     "unknown problem_type"),
])
def test_bad_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_exported():
    assert fastdp.losses.causal_lm_loss is causal_lm_loss
    assert "losses" in fastdp.__all__


# --------------------------------------------------------------------------- the guard's decisions (no model)


@pytest.mark.parametrize("cls,enc_dec,helper", [
    ("GPT2LMHeadModel", False, "causal_lm_loss"),
    ("LlamaForCausalLM", False, "causal_lm_loss"),
    ("T5ForConditionalGeneration", True, "seq2seq_loss"),
    ("LlavaForConditionalGeneration", False, "causal_lm_loss"),
    ("BartForConditionalGeneration", True, "seq2seq_loss"),
    ("BertForMaskedLM", False, "token_classification_loss"),
    ("RobertaForTokenClassification", False, "token_classification_loss"),
    ("BertForSequenceClassification", False, "sequence_classification_loss"),
    ("ViTForImageClassification", False, "sequence_classification_loss"),
    ("BertForQuestionAnswering", False, "start_logits, start_positions"),
    ("BertForPreTraining", False, "per-sample loss of shape (B,)"),
])
def test_helper_for(cls, enc_dec, helper):
    assert helper in hf_guard.helper_for(cls, enc_dec)


@pytest.mark.parametrize("key,target", [
    ("labels", True), ("label", True), ("start_positions", True), ("end_positions", True),
    ("next_sentence_label", True), ("mc_labels", True), ("class_labels", True),
    ("input_labels", False), ("input_boxes_labels", False), ("num_labels", False), ("input_ids", False),
    ("position_ids", False), ("attention_mask", False),
])
def test_target_keys(key, target):
    assert hf_guard._target_key(key) is target


# =========================================================================== Hugging Face models

transformers = pytest.importorskip("transformers")

from model_oracle import LMWrap, V, bert, check_engine, cls_loss, gpt2  # noqa: E402
from oracle import make_engine, oracle_model, per_sample_grads, trainable_names  # noqa: E402

T = 7


def lm_data(n, seed, *, long_first=False):
    """(ids, attention mask) and labels with right padding and prompts: sample i has its own number of label
    tokens; sample 1 (if any) has none."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n, T), generator=g)
    mask = torch.ones(n, T, dtype=torch.long)
    labels = ids.clone()
    for i in range(n):
        pad = 0 if (long_first and i == 0) else i % 3
        if pad:
            mask[i, T - pad:] = 0
            labels[i, T - pad:] = IGN
        prompt = 0 if (long_first and i == 0) else 1 + i % 4
        labels[i, :prompt] = IGN
    if n >= 2:
        labels[1] = IGN
    return (ids, mask), labels


def lm_model(seed=0):
    torch.manual_seed(seed)
    return LMWrap(gpt2()).to(D).train()


def causal(logits, labels):
    return causal_lm_loss(logits, labels)


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost", "BK-ghost", "instantiate"])
def test_engine_with_causal_lm_loss_matches_oracle(mode):
    model = lm_model()
    batches = [lm_data(3, 10), lm_data(1, 11)]  # a logical batch of two physical batches (B = 3, B = 1)
    n_tokens = [int(y[:, 1:].ne(IGN).sum(1)[i]) for _, y in batches for i in range(y.shape[0])]
    assert len(set(n_tokens)) >= 3 and 0 in n_tokens
    check_engine(model, causal, batches, mode=mode)


class LMWrapPos(torch.nn.Module):
    """GPT-2 -> logits, with explicit per-sample position ids (B, T)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids, mask):
        pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        return self.m(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost"])
def test_engine_with_causal_lm_loss_batch_equal_to_T(mode):
    torch.manual_seed(1)
    check_engine(LMWrapPos(gpt2()).to(D), causal, [lm_data(T, 12)], mode=mode, fn="automatic")


def test_engine_gpt2_default_position_ids_batch_equal_to_T():
    check_engine(lm_model(1), causal, [lm_data(T, 12)], mode="BK-MixOpt")


def test_engine_with_causal_lm_loss_empty_batch():
    """B = 0 (HF GPT-2 cannot run an empty batch itself, so a small embedding + linear LM)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(V, 8), torch.nn.Linear(8, V)).to(D)
    engine = make_engine(model, batch_size=4, reduction="sum")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    (ids, _), labels = lm_data(0, 3)
    loss = causal_lm_loss(model(ids), labels)
    assert loss.shape == (0,)
    loss.sum().backward()
    opt.step()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())  # sigma = 0: nothing released


# --------------------------------------------------------------------------- the bug the refusal prevents


def hf_view_grads(model, ids, mask, labels, names):
    """Per-sample gradients the engine would see (loss_reduction="mean": B times the loss) under Hugging Face's
    own token-mean loss, by plain autograd: the gradient of B * L_hf through sample i's logits only (GPT-2 does
    not mix samples, so that is sample i's share of the batch gradient)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    params = dict(model.named_parameters())
    plist = [params[n] for n in names]
    logits = model(ids, mask)
    hf_loss = model.m(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    torch.testing.assert_close(ForCausalLMLoss(logits, labels, vocab_size=V).to(D), hf_loss.to(D))
    B = ids.shape[0]
    out = []
    for i in range(B):
        sel = (torch.arange(B) == i)[:, None, None]
        mixed = torch.where(sel, logits, logits.detach())
        grads = torch.autograd.grad(B * ForCausalLMLoss(mixed, labels, vocab_size=V), plist, retain_graph=True)
        out.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(out)


def flat(psg, names):
    return torch.cat([psg[n].reshape(psg[n].shape[0], -1) for n in names], 1)


def clipped(rows, R):
    norms = rows.norm(dim=1, keepdim=True)
    return (rows * torch.clamp(R / (norms + 1e-6), max=1.0)).sum(0)


def test_hf_token_mean_loss_mixes_samples():
    """Hugging Face's labels= loss: the per-sample gradient the engine would see is the true per-sample gradient
    (of the sample's own token mean) times B n_i / N, N the batch's label-token count, so the clipping acts on the
    wrong vectors; and removing the long sample rescales every other sample, moving the released clipped sum by
    more than R. With the per-sample loss (the oracle) it moves by at most R."""
    model = lm_model(3)
    om = oracle_model(model)
    names = trainable_names(om)
    B = 7
    g = torch.Generator().manual_seed(20)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    labels = ids.clone()
    labels[1:, : T - 1] = IGN  # sample 0: T - 1 label tokens; the others a prompt and one label token
    n = labels[:, 1:].ne(IGN).sum(1).to(D)
    N = float(n.sum())
    assert n.tolist() == [T - 1] + [1] * (B - 1)
    true = flat(per_sample_grads(om, causal, [((ids, mask), labels)], names), names)
    seen = hf_view_grads(om, ids, mask, labels, names)
    # the true gradient rescaled by a factor that depends on the other samples' token counts (HF's loss runs in
    # float32, hence the tolerance)
    torch.testing.assert_close(seen, true * (B * n / N)[:, None], rtol=1e-4, atol=1e-6 * float(true.abs().max()))
    rel = (seen - true).norm(dim=1) / true.norm(dim=1)
    assert float(rel.min()) > 0.4, rel
    # the neighbouring batch without the long sample 0; R above every short sample's norm (they are not clipped),
    # the long sample is clipped in its HF view
    seen_nb = hf_view_grads(om, ids[1:], mask[1:], labels[1:], names)
    R = 1.01 * float(torch.cat([seen[1:].norm(dim=1), seen_nb.norm(dim=1), true.norm(dim=1)]).max())
    moved_hf = float((clipped(seen, R) - clipped(seen_nb, R)).norm())
    moved_true = float((clipped(true, R) - clipped(true[1:], R)).norm())
    assert moved_true <= R * (1 + 1e-9)
    assert moved_hf > 1.2 * R, (moved_hf, R)


# --------------------------------------------------------------------------- refusal


def _attach(model, **kw):
    engine = make_engine(model, batch_size=3, **kw)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine.attach(opt)
    return engine, opt


def test_labels_refused_on_attached_hf_model_and_allowed_otherwise():
    torch.manual_seed(0)
    m = gpt2().to(D)
    (ids, mask), labels = lm_data(3, 30)
    before = m(input_ids=ids, attention_mask=mask, labels=labels).loss  # no engine: HF's loss works
    assert torch.isfinite(before)
    engine, opt = _attach(m)
    with pytest.raises(ValueError, match=r"causal_lm_loss") as ei:
        m(input_ids=ids, attention_mask=mask, labels=labels)
    assert "mixes samples" in str(ei.value) and "GPT2LMHeadModel" in str(ei.value)
    with torch.no_grad():  # evaluation: no gradient, nothing to clip
        torch.testing.assert_close(m(input_ids=ids, attention_mask=mask, labels=labels).loss, before)
    # after a refusal the engine still works: the per-sample loss trains and matches a fresh run
    causal_lm_loss(m(input_ids=ids, attention_mask=mask).logits, labels).mean().backward()
    opt.step()
    assert all(p.grad is not None for p in m.parameters())
    engine.detach()
    assert torch.isfinite(m(input_ids=ids, attention_mask=mask, labels=labels).loss)


def test_labels_positional_and_other_targets_refused():
    torch.manual_seed(0)
    m = gpt2().to(D)
    (ids, _), labels = lm_data(3, 31)
    _attach(m)
    names = list(hf_guard._arg_names(m))
    args = [None] * (names.index("labels") + 1)
    args[0], args[-1] = ids, labels
    with pytest.raises(ValueError, match="labels="):
        m(*args)
    m(input_ids=ids, labels=None)  # labels=None is no target


def test_labels_refused_when_hf_model_is_wrapped():
    model = lm_model()
    (ids, mask), labels = lm_data(3, 32)
    _attach(model)
    with pytest.raises(ValueError, match=r"'m' \(GPT2LMHeadModel\).*causal_lm_loss"):
        model.m(input_ids=ids, attention_mask=mask, labels=labels)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers deprecation inside peft
def test_labels_refused_through_peft():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    pm = get_peft_model(gpt2(), LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["c_attn"],
                                           fan_in_fan_out=True, task_type="CAUSAL_LM")).to(D)
    (ids, mask), labels = lm_data(3, 33)
    _attach(pm)
    with pytest.raises(ValueError, match="causal_lm_loss"):
        pm(input_ids=ids, attention_mask=mask, labels=labels)
    loss = causal_lm_loss(pm(input_ids=ids, attention_mask=mask).logits, labels)
    loss.mean().backward()


def test_seq2seq_refusal_names_seq2seq_loss():
    from model_oracle import t5

    torch.manual_seed(0)
    m = t5().to(D)
    _attach(m)
    ids = torch.randint(2, V, (3, 5))
    lab = torch.randint(2, V, (3, 4))
    with pytest.raises(ValueError, match="seq2seq_loss"):
        m(input_ids=ids, labels=lab)


# --------------------------------------------------------------------------- sequence classification: allowed


class ClsLabels(torch.nn.Module):
    """BERT classifier called with labels=: returns HF's internal loss, as (B,) 'per-sample' values whose mean is
    that loss (so the oracle's batch-of-one loss is HF's loss of one sample)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids, mask, y):
        loss = self.m(input_ids=ids, attention_mask=mask, labels=y).loss
        return loss.expand(ids.shape[0])


def cls_data(n, seed, C=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (n, 6), generator=g)
    mask = torch.ones(n, 6, dtype=torch.long)
    mask[n - 1:, 4:] = 0
    y = torch.randint(0, C, (n,), generator=g)
    return ids, mask, y


def test_sequence_classification_labels_allowed_and_exact():
    """HF's classifier loss is the batch mean of per-sample cross entropies: allowed, and the engine's release
    equals the oracle's (the oracle's per-sample loss is sequence_classification_loss on the logits)."""
    torch.manual_seed(0)
    model = ClsLabels(bert().to(D).train())
    data = [cls_data(3, 40), cls_data(1, 41)]
    batches = [((ids, mask, y), y) for ids, mask, y in data]

    def per_sample(out, y):  # the model returned HF's loss, expanded; its mean is what backward sees
        return out

    # oracle: per-sample gradients of sequence_classification_loss on the logits of the same BERT
    from model_oracle import ClsWrap

    om = ClsWrap(model.m)
    want_batches = [((ids, mask), y) for ids, mask, y in data]
    names = trainable_names(om)
    psg = per_sample_grads(oracle_model(om), sequence_classification_loss, want_batches, names)
    psg2 = per_sample_grads(oracle_model(model), lambda o, y: o, batches, names)
    for n in names:
        torch.testing.assert_close(psg2[n], psg[n], rtol=1e-10, atol=1e-13)
    # The wrapper's output row i is HF's batch mean, which depends on every sample: the structure probe rightly
    # refuses that layout (test_sequence_classification_wrapper_refused_by_probe); only its mean is per sample.
    check_engine(model, per_sample, batches, mode="BK-MixOpt", verify_structure=False)


def test_sequence_classification_wrapper_refused_by_probe():
    """The same wrapper with the probe on: each output row mixes the batch's losses, so it is refused."""
    torch.manual_seed(0)
    model = ClsLabels(bert().to(D).train())
    ids, mask, y = cls_data(3, 40)
    engine = make_engine(model, batch_size=3)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(fastdp.StructureError, match="batch-of-one"):
        model(ids, mask, y)


def test_sequence_classification_labels_refused_when_unsafe():
    torch.manual_seed(0)
    m = bert().to(D)
    ids, mask, y = cls_data(3, 42)
    _attach(m)
    m(input_ids=ids, attention_mask=mask, labels=y).loss.backward()  # allowed
    y[1] = IGN
    with pytest.raises(ValueError, match=r"-100.*sequence_classification_loss"):
        m(input_ids=ids, attention_mask=mask, labels=y)
    torch.manual_seed(0)
    m2 = bert().to(D)
    _attach(m2, reduction="sum")
    with pytest.raises(ValueError, match="loss_reduction='sum'"):
        m2(input_ids=ids, attention_mask=mask, labels=y.clamp(min=0))


def test_cls_helper_is_the_oracle_loss():
    """Sanity: model_oracle.cls_loss (used by the whole-model tests) is sequence_classification_loss."""
    g = torch.Generator().manual_seed(5)
    lg = torch.randn(4, 5, generator=g, dtype=D)
    y = torch.randint(0, 5, (4,), generator=g)
    torch.testing.assert_close(cls_loss(lg, y), sequence_classification_loss(lg, y), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------- check_per_sample_loss
def _padded_lm_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 11, generator=g)
    labels = torch.randint(0, 11, (4, 6), generator=g)
    labels[0, 3:] = -100  # samples with different numbers of label tokens
    labels[2, 1:] = -100
    return logits, labels


def test_check_per_sample_loss_accepts_per_sample_means():
    from fastdp.losses import causal_lm_loss, check_per_sample_loss

    logits, labels = _padded_lm_batch()
    check_per_sample_loss(lambda o, y: causal_lm_loss(o, y).mean(), logits, labels)
    check_per_sample_loss(lambda o, y: causal_lm_loss(o, y).sum(), logits, labels, reduction="sum")
    x, y = torch.randn(5, 3), torch.randint(0, 3, (5,))
    check_per_sample_loss(torch.nn.functional.cross_entropy, x, y)  # a classifier's batch mean
    check_per_sample_loss(torch.nn.functional.cross_entropy, x[:1], y[:1])  # a batch of one


def test_check_per_sample_loss_refuses_a_token_mean_over_the_batch():
    """The hand-written token mean over the whole batch: each sample's gradient is scaled by ``B n_i / N``; with
    padding the check names the samples and the factors. Without padding the same loss is exact (and accepted)."""
    from fastdp.losses import check_per_sample_loss

    logits, labels = _padded_lm_batch()

    def token_mean(o, y):
        return torch.nn.functional.cross_entropy(o[:, :-1].reshape(-1, o.shape[-1]), y[:, 1:].reshape(-1),
                                                 ignore_index=-100)

    with pytest.raises(ValueError, match=r"not the mean over samples.*sample 0: x.*causal_lm_loss"):
        check_per_sample_loss(token_mean, logits, labels)
    full = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(1))
    check_per_sample_loss(token_mean, logits, full)  # equal counts: B n_i / N = 1
    with pytest.raises(ValueError, match="not the sum over samples"):
        check_per_sample_loss(lambda o, y: token_mean(o, y), logits, full, reduction="sum")  # mean, not sum


def test_check_per_sample_loss_refuses_in_batch_coupling_and_bad_arguments():
    from fastdp.losses import check_per_sample_loss

    emb = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))

    def contrastive(o):  # in-batch negatives
        sim = o @ o.t()
        return torch.nn.functional.cross_entropy(sim, torch.arange(o.shape[0]))

    with pytest.raises(ValueError, match="not the mean over samples"):
        check_per_sample_loss(contrastive, emb)
    with pytest.raises(ValueError, match="must return a scalar"):
        check_per_sample_loss(lambda o: o.sum(1), emb)
    with pytest.raises(ValueError, match="reduction='max'"):
        check_per_sample_loss(lambda o: o.sum(), emb, reduction="max")
    with pytest.raises(ValueError, match="floating tensor"):
        check_per_sample_loss(lambda o: o.sum(), torch.arange(4))
