"""The loss check (fastdp.loss_check): the weight a softmax cross-entropy gives each label row, read from the
gradient at the model's logits, and the refusal of a token mean over the whole batch.

* The weights it reads are the weights of the loss: an autograd oracle ``L = Σ_r w_r CE(Y_r, y_r)`` with random
  ``w_r`` (zeros included), float64 and float32; rows that are no plain cross-entropy's (label smoothing, MSE,
  a temperature) do not fit.
* Verdicts against what the loss is, over random padded batches (Hypothesis), cross-checked with
  ``fastdp.losses.check_per_sample_loss``: a token mean over the batch is refused exactly when the samples' counts
  make it differ from every per-sample form; per-sample means and sums are never refused.
* Through the engine: read in the first backward pass, refused at its step, before anything is released (no
  ``.grad``, no step, no ledger entry), under ``"mean"`` and ``"sum"``, again after a caught refusal, not with
  ``verify_loss=False``; a token mean divided by a constant is refused at the second batch with another label count,
  a per-sample sum divided by one is not; equal counts say nothing and are checked again; Hugging Face GPT-2's
  ``ModelOutput`` under bf16/fp16 autocast with a ``GradScaler``.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import fastdp
from fastdp import loss_check, loss_verdicts
from fastdp.losses import causal_lm_loss, check_per_sample_loss

V, T, IGN = 11, 6, -100


class TinyLM(nn.Module):
    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, 8)
        self.head = nn.Linear(8, V)
        self.to(dtype)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def batch(counts, seed=0):
    """ids (B, T) and labels whose sample i has ``counts[i]`` label tokens after the shift (the rest ignored)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (len(counts), T), generator=g)
    labels = ids.clone()
    for i, n in enumerate(counts):
        labels[i, 1 + n:] = IGN
    return ids, labels


def token_mean(o, y):
    return F.cross_entropy(o[:, :-1].reshape(-1, o.shape[-1]), y[:, 1:].reshape(-1), ignore_index=IGN)


def token_sums(o, y):
    per = F.cross_entropy(o[:, :-1].reshape(-1, o.shape[-1]), y[:, 1:].reshape(-1), ignore_index=IGN,
                          reduction="none")
    return per.view(o.shape[0], -1).sum(1)


LOSSES = {"token mean": token_mean,
          "per-sample mean": lambda o, y: causal_lm_loss(o, y).mean(),
          "per-sample sum": lambda o, y: token_sums(o, y).mean()}


def engine_for(model, reduction="mean", **kw):
    eng = fastdp.PrivacyEngine(model, batch_size=4, sample_size=100, steps=10, noise_multiplier=1.0,
                               loss_reduction=reduction, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng.attach(opt)
    return eng, opt


# ------------------------------------------------------------------------------------ the weights read
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_row_weights_are_the_losss_weights(dtype, tol):
    g = torch.Generator().manual_seed(1)
    Y = (3 * torch.randn(5, 4, V, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    y = torch.randint(0, V, (5, 4), generator=g)
    w = torch.rand(5, 4, generator=g, dtype=torch.float64) + 0.1
    w[1] = 0  # a sample without label rows
    w[3, 2:] = 0
    loss = (w.to(dtype) * F.cross_entropy(Y.transpose(1, 2), y, reduction="none")).sum()
    (G,) = torch.autograd.grad(loss, Y)
    got, labelled, fits = loss_check.row_weights(G, loss_check.summarise("out", Y))
    assert torch.equal(labelled, (w != 0).flatten())
    assert bool(fits.all())
    torch.testing.assert_close(got[labelled].double(), w.flatten()[labelled], rtol=tol, atol=0)


def test_a_nan_row_is_labelled_and_does_not_fit():
    """A non-finite gradient row is never taken for an unlabelled one (which would change the counts)."""
    g = torch.Generator().manual_seed(3)
    Y = torch.randn(2, 3, V, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, V, (2, 3), generator=g)
    (G,) = torch.autograd.grad(F.cross_entropy(Y.transpose(1, 2), y), Y)
    G = G.clone()
    G[0, 1, 4] = float("nan")
    G[1, 2] = 0.0
    _, labelled, fits = loss_check.row_weights(G, loss_check.summarise("out", Y))
    assert labelled.tolist() == [True, True, True, True, True, False]
    assert fits.tolist() == [True, False, True, True, True, True]


@pytest.mark.parametrize("loss", ["label smoothing", "temperature", "mse"])
def test_rows_of_other_losses_do_not_fit(loss):
    g = torch.Generator().manual_seed(2)
    Y = torch.randn(4, 3, V, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, V, (4, 3), generator=g)
    if loss == "label smoothing":
        L = F.cross_entropy(Y.transpose(1, 2), y, label_smoothing=0.1)
    elif loss == "temperature":
        L = F.cross_entropy(Y.transpose(1, 2) / 2, y)
    else:
        L = F.mse_loss(Y, F.one_hot(y, V).double())
    (G,) = torch.autograd.grad(L, Y)
    _, labelled, fits = loss_check.row_weights(G, loss_check.summarise("out", Y))
    assert bool(labelled.all()) and not bool(fits.any())


# ------------------------------------------------------------------------------------ verdicts
def verdict_of(loss, counts, reduction="mean", dtype=torch.float64, seed=0):
    """The verdict on one backward pass, judged as the step's only pass with no earlier step (as ``settle`` does)."""
    ids, labels = batch(counts, seed)
    model = TinyLM(seed, dtype)
    out = model(ids)
    (G,) = torch.autograd.grad(LOSSES[loss](out, labels) * (len(counts) if reduction == "sum" and
                                                            loss != "token mean" else 1), out)
    w, lab, fits = loss_check.row_weights(G, loss_check.summarise("out", out))
    tol = loss_check._tol(G.dtype)
    v = loss_verdicts.verdict(w, lab, fits, len(counts), 1.0, reduction == "mean", tol)
    if v.kind == "equal weights":
        s = len(counts) if reduction == "mean" else 1
        v.kind = loss_verdicts.judge(loss_verdicts.observe(v, s, v.total, 1), [], tol)
    return v, (model, ids, labels)


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, T - 1), min_size=2, max_size=6), loss=st.sampled_from(sorted(LOSSES)),
       reduction=st.sampled_from(["mean", "sum"]), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_verdicts_follow_the_loss(counts, loss, reduction, dtype):
    v, (model, ids, labels) = verdict_of(loss, counts, reduction, dtype)
    B, N = len(counts), sum(counts)
    s = B if reduction == "mean" else 1
    labelled = {c for c in counts if c}
    if len(set(counts)) == 1 or sum(1 for c in counts if c) <= 1:  # a token mean is a per-sample mean here
        assert v.kind == "uninformative", (counts, loss, reduction, v)
        return
    if len(labelled) == 1:  # every labelled sample has as many rows: the three differ by constants only
        assert v.kind == "equal weights", (counts, loss, reduction, v)  # told apart by a later step
        return
    if loss == "per-sample mean":
        assert v.kind == "per-sample mean", (counts, reduction, v)
        return
    # equal weights: told apart by the step's label count, unless it equals s (then both read the same)
    want = "equal weights" if N == s else ("per-sample sum" if loss == "per-sample sum" else "batch token mean")
    assert v.kind == want, (counts, loss, reduction, v)
    if v.kind == "batch token mean":  # the independent check (one backward per sample) agrees
        with pytest.raises(ValueError, match="not the"):
            check_per_sample_loss(token_mean, model(ids).double(), labels, reduction=reduction)


def test_equal_counts_say_nothing():
    for loss in LOSSES:
        assert verdict_of(loss, [3, 3, 3])[0].kind == "uninformative"
    assert verdict_of("token mean", [0, 0])[0].kind == "uninformative"


# ------------------------------------------------------------------------------------ through the engine
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_token_mean_refused_before_anything_is_released(reduction, dtype):
    model = TinyLM(0, dtype)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    eng, opt = engine_for(model, reduction)
    ids, labels = batch([5, 0, 2, 3])
    token_mean(model(ids), labels).backward()  # read in the backward pass, judged at the step
    with pytest.raises(fastdp.StructureError,
                       match=r"token mean over the whole batch.*1/10.*0 to 5.*Nothing was released.*causal_lm_loss"):
        opt.step()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert eng.steps == 0 and eng.accountant.ledger.steps == 0
    token_mean(model(ids), labels).backward()
    with pytest.raises(fastdp.StructureError):  # a caught refusal does not end the check
        opt.step()
    # the same batch with the per-sample mean trains, on the same engine; the refused sums were discarded
    loss = causal_lm_loss(model(ids), labels)
    (loss.mean() if reduction == "mean" else loss.sum()).backward()
    opt.step()
    assert eng.steps == 1
    assert eng.probe_stats["loss_verdicts"] == {"batch token mean": 2, "per-sample mean": 1}


def test_verify_loss_false_trains_the_token_mean_silently():
    model = TinyLM()
    eng, opt = engine_for(model, verify_loss=False)
    ids, labels = batch([5, 0, 2, 3])
    token_mean(model(ids), labels).backward()
    opt.step()
    assert eng.steps == 1 and eng.probe_stats["loss_checks"] == 0


def test_a_batch_with_equal_counts_is_checked_again():
    """Equal counts say nothing (the token mean is exact there): the next pass is checked; after SPARSE_AFTER such
    passes, one forward call in SPARSE_EVERY."""
    model = TinyLM()
    eng, opt = engine_for(model)
    refused_at = []
    for n in range(1, 2 * loss_check.SPARSE_EVERY + 1):
        ids, labels = batch([5, 5, 5, 5] if n <= loss_check.SPARSE_AFTER else [5, 1, 5, 5])
        token_mean(model(ids), labels).backward()  # exact for equal counts: B n_i / N = 1
        try:
            opt.step()
        except fastdp.StructureError as e:
            assert "token mean" in str(e)
            refused_at.append(n)
    assert refused_at == [loss_check.SPARSE_EVERY, 2 * loss_check.SPARSE_EVERY]  # the checked calls
    assert eng.probe_stats["loss_verdicts"] == {"uninformative": loss_check.SPARSE_AFTER, "batch token mean": 2}


@pytest.mark.parametrize("loss,outcome", [("token mean", "refused"), ("per-sample sum", "per-sample sum (scaled)"),
                                          ("per-sample mean", "per-sample mean (scaled)")])
def test_a_loss_divided_by_a_constant(loss, outcome):
    """Divided by 2 (accumulation steps): a token mean reads as a per-sample sum times a constant in one batch; the
    second batch with another label count tells them apart (the token mean keeps ``c N``)."""
    model = TinyLM()
    eng, opt = engine_for(model)
    seen = []
    for counts in ([5, 1, 3, 2], [4, 0, 3, 2]):
        ids, labels = batch(counts)
        (LOSSES[loss](model(ids), labels) / 2).backward()
        try:
            opt.step()
        except fastdp.StructureError as e:
            seen.append(str(e))
    verdicts = eng.probe_stats["loss_verdicts"]
    if outcome == "refused":
        assert len(seen) == 1 and "weight 0.0555556, a constant over the label rows (9 in this pass)" in seen[0]
        assert verdicts == {"equal weights": 1, "batch token mean": 1} and eng.steps == 1
    else:
        assert not seen and outcome in verdicts


def test_classifier_mean_over_labelled_samples_refused_at_the_second_step():
    """A classifier's cross-entropy with ignored labels averages over the labelled samples: weight ``1/m``. One
    step cannot tell it from a per-sample loss times a constant (one row per labelled sample: the token mean, the
    per-sample sum and mean differ by constants only), so it is released; the next step with another ``m`` keeps
    ``c m = 1`` and is refused. A per-sample cross-entropy with the same ignored labels is verified instead."""
    def run(loss_fn):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        eng, opt = engine_for(model)
        x = torch.randn(4, 5)
        for y in (torch.tensor([0, 2, IGN, 1]), torch.tensor([IGN, 2, IGN, 1])):
            loss_fn(model(x), y).backward()
            opt.step()
        return eng

    with pytest.raises(fastdp.StructureError, match="1/2, one over the batch's 2 label rows"):
        run(lambda o, y: F.cross_entropy(o, y, ignore_index=IGN))
    per_sample = run(lambda o, y: F.cross_entropy(o, y, ignore_index=IGN, reduction="none").mean())
    assert per_sample.steps == 2
    assert per_sample.probe_stats["loss_verdicts"] == {"equal weights": 1, "per-sample sum": 1}


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_hf_gpt2_model_output_under_autocast_and_grad_scaler(amp):
    pytest.importorskip("transformers")
    from model_oracle import gpt2

    def run(loss_fn):
        torch.manual_seed(0)
        model = gpt2().float().train()
        eng = fastdp.PrivacyEngine(model, batch_size=4, sample_size=100, steps=5, noise_multiplier=1.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        eng.attach(opt, scaler=scaler)
        ids = torch.randint(0, model.config.vocab_size, (4, 7))
        mask = torch.ones(4, 7, dtype=torch.long)
        mask[0, 4:] = 0
        labels = ids.masked_fill(mask == 0, IGN)
        labels[2, :5] = IGN
        with torch.autocast("cpu", dtype=amp):
            loss = loss_fn(model(input_ids=ids, attention_mask=mask).logits, labels)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return eng

    with pytest.raises(fastdp.StructureError, match=r"output\['logits'\].*1/17"):
        run(lambda o, y: token_mean(o.float(), y))
    assert run(lambda o, y: causal_lm_loss(o, y).mean()).probe_stats["loss_verdicts"] == {"per-sample mean": 1}


# ------------------------------------------------------------------------------------ found by a red-team pass
def test_token_mean_over_accumulated_micro_batches_refused():
    """Hugging Face Trainer's form under gradient accumulation: the token sum of each micro-batch divided by the
    label tokens of all micro-batches of the step (``num_items_in_batch``). The micro-batches of one step share the
    divisor, so ``c B`` is the same in each; the step's label count gives it away at the first step."""
    model = TinyLM()
    eng, opt = engine_for(model)
    micro = [batch(c, seed=k) for k, c in enumerate(([5, 1, 3, 2], [4, 0, 3, 2], [2, 2, 5, 1]))]
    n_items = sum(int(y[:, 1:].ne(IGN).sum()) for _, y in micro)
    for ids, y in micro:
        o = model(ids)
        (F.cross_entropy(o[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1), ignore_index=IGN, reduction="sum")
         / n_items).backward()
    with pytest.raises(fastdp.StructureError, match=f"1/{n_items}, one over the {n_items} label rows of this "
                                                    "step's 3 checked backward passes"):
        opt.step()
    assert eng.steps == 0


def test_forward_passes_without_backward_and_caught_refusals_do_not_use_up_the_check():
    model = TinyLM()
    eng, opt = engine_for(model)
    ids, labels = batch([5, 0, 2, 3])
    for _ in range(loss_check.MAX_TRIES + 2):  # grad-enabled forward passes that no backward pass follows
        model(ids)
    for _ in range(loss_check.MAX_TRIES + 2):
        token_mean(model(ids), labels).backward()
        with pytest.raises(fastdp.StructureError, match="token mean"):
            opt.step()
    assert eng.steps == 0 and eng.probe_stats["loss_verdicts"] == {"batch token mean": loss_check.MAX_TRIES + 2}


def test_a_saturated_row_is_read():
    """A label predicted with probability 1.0 in float32 (a margin of 40 nats): its gradient entry is 0 and none is
    negative; the row is read at the most probable class, and the token mean is still refused."""
    class Confident(TinyLM):
        def forward(self, ids):
            return super().forward(ids) + (ids == 0)[..., None] * F.one_hot(torch.tensor(0), V) * 40.0

    model = Confident()
    eng, opt = engine_for(model)
    ids, labels = batch([5, 1, 3, 2])
    ids[ids == 0] = 1
    ids[0, :2] = 0
    labels[0, :2] = 0
    out = model(ids)
    assert out[0, 0].softmax(-1)[0].item() == 1.0
    (G,) = torch.autograd.grad(token_mean(out, labels), out, retain_graph=True)
    assert float(G[0, 0].min()) == 0.0
    _, labelled, fits = loss_check.row_weights(G, loss_check.summarise("out", out))
    assert bool(labelled[0]) and bool(fits.all())
    token_mean(out, labels).backward()
    with pytest.raises(fastdp.StructureError, match="1/11"):
        opt.step()


@pytest.mark.parametrize("upcast", [False, True])
def test_bf16_model_with_near_uniform_logits(upcast):
    """A model in bfloat16 from scratch (near-uniform logits over V = 8192), the token mean on its bf16 logits:
    the bf16 log-softmax's rounding (about 2 %) stays within the half-precision tolerance."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 8192)).to(torch.bfloat16)
    eng, opt = engine_for(model)
    ids = torch.randint(0, 64, (4, 8))
    labels = torch.randint(0, 8192, (4, 8))
    for i, n in enumerate([7, 2, 5, 3]):
        labels[i, 1 + n:] = IGN

    def loss(o, y):
        o = o.float() if upcast else o
        return F.cross_entropy(o[:, :-1].reshape(-1, 8192), y[:, 1:].reshape(-1), ignore_index=IGN)

    loss(model(ids), labels).backward()
    with pytest.raises(fastdp.StructureError, match="1/17"):
        opt.step()


def test_an_earlier_step_keeps_a_coincidence_from_being_refused():
    """A per-sample token sum divided by K = 4 (B = 4): the first step (N = 10) rules out a plain token mean
    (``c N != 1``); the second has N = 16 = B K, where one step alone reads as a token mean, and is verified as a
    per-sample sum times a constant instead."""
    model = TinyLM()
    eng, opt = engine_for(model)
    for counts in ([1, 2, 3, 4], [5, 5, 3, 3]):
        ids, labels = batch(counts)
        (token_sums(model(ids), labels).mean() / 4).backward()
        opt.step()
    assert eng.steps == 2
    assert eng.probe_stats["loss_verdicts"] == {"equal weights": 1, "per-sample sum (scaled)": 1}


FAMILIES = {"mean * k": lambda o, y, k: causal_lm_loss(o, y) * k,
            "sum * k": lambda o, y, k: token_sums(o, y) * k,
            "mean + k sum": lambda o, y, k: causal_lm_loss(o, y) + k * token_sums(o, y),
            "own weights": lambda o, y, k: (1 + (y[:, 0] % 2).to(o.dtype) * k) * causal_lm_loss(o, y)}


@settings(max_examples=25, deadline=None)
@given(family=st.sampled_from(sorted(FAMILIES)), k=st.sampled_from([0.125, 0.25, 1 / 3, 0.5, 1.0, 2.0]),
       reduction=st.sampled_from(["mean", "sum"]),
       steps=st.lists(st.lists(st.integers(0, T - 1), min_size=2, max_size=5), min_size=2, max_size=3))
def test_per_sample_losses_times_constants_are_never_refused(family, k, reduction, steps):
    """Never refused, except the documented coincidences: a per-sample token sum times ``k`` whose first informative
    pass (labelled counts that differ) has every label row's weight ``k / s`` equal to ``1/N``; own-data weights
    that happen to be the same for every labelled sample of a pass."""
    if family == "own weights":
        for j, counts in enumerate(steps):
            own = batch(counts, seed=j)[1][:, 0] % 2
            assume(len({int(own[i]) for i, c in enumerate(counts) if c}) != 1)
    for counts in steps:
        labelled = {c for c in counts if c}
        if len(set(counts)) > 1 and labelled:
            s = len(counts) if reduction == "mean" else 1
            assume(not (family == "sum * k" and len(labelled) > 1 and abs(k * sum(counts) / s - 1) < 1e-9))
            break
    model = TinyLM()
    eng, opt = engine_for(model, reduction)
    for j, counts in enumerate(steps):
        ids, labels = batch(counts, seed=j)
        per = FAMILIES[family](model(ids), labels, k)
        (per.mean() if reduction == "mean" else per.sum()).backward()
        opt.step()  # never refused
    assert eng.steps == len(steps)


# ------------------------------------------------------------------------------------ found by a second pass
@pytest.mark.parametrize("dtype,counts", [(torch.float32, [1599, 1599, 1599, 1598]),
                                          (torch.bfloat16, [39, 38, 37, 39]), (torch.bfloat16, [63, 60, 62, 63])])
def test_nearly_equal_counts_do_not_refuse_a_per_sample_mean(dtype, counts):
    """Counts within the weights' tolerance of each other: the per-sample mean's weights read as equal, and its
    ``c N`` as 1. Such a pass cannot tell a per-sample mean from a token mean: judged at later passes, not refused
    (before the fix: refused at step 1)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, 8), nn.Linear(8, V)).to(dtype)
    eng, opt = engine_for(model)
    T_ = max(counts) + 1
    for step in range(3):
        ids = torch.randint(0, V, (4, T_), generator=torch.Generator().manual_seed(step))
        labels = ids.clone()
        for i, n in enumerate(counts):
            labels[i, 1 + n:] = IGN
        causal_lm_loss(model(ids), labels).mean().backward()
        opt.step()
    assert eng.steps == 3 and "batch token mean" not in eng.probe_stats["loss_verdicts"]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_token_mean_of_each_micro_batch_refused_under_accumulation(k):
    """The hand-written token mean per backward pass (divided by the pass's own label rows, and by ``k``), ``k``
    micro-batches per step: two passes of the step with different label counts keep ``c N``; refused at step 1."""
    model = TinyLM()
    eng, opt = engine_for(model)
    for j, counts in enumerate(([5, 1, 3, 2], [4, 0, 3, 2], [2, 2, 5, 1], [5, 5, 1, 1])[:max(k, 2)]):
        ids, labels = batch(counts, seed=j)
        (token_mean(model(ids), labels) / k).backward()
    with pytest.raises(fastdp.StructureError, match="token mean"):
        opt.step()
    assert eng.steps == 0


def test_a_second_head_does_not_hide_a_token_mean():
    """BertForPreTraining's loss by hand: the masked-LM token mean plus a sentence head's batch mean. Each output
    is judged on its own label rows."""
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.lm, self.cls = nn.Embedding(V, 8), nn.Linear(8, V), nn.Linear(8, 2)

        def forward(self, ids):
            h = torch.tanh(self.emb(ids))
            return {"prediction_logits": self.lm(h), "seq_relationship_logits": self.cls(h[:, 0])}

    model = TwoHeads()
    eng, opt = engine_for(model)
    ids, labels = batch([5, 1, 3, 2])
    out = model(ids)
    (token_mean(out["prediction_logits"], labels)
     + F.cross_entropy(out["seq_relationship_logits"], torch.tensor([0, 1, 1, 0]))).backward()
    with pytest.raises(fastdp.StructureError, match=r"output\['prediction_logits'\].*1/11"):
        opt.step()


def test_passes_of_a_discarded_step_are_not_judged_later():
    """detach() (or a step refused for another reason) discards the step: its checked passes go with it."""
    model = TinyLM()
    eng, opt = engine_for(model)
    ids, labels = batch([5, 1, 3, 2])
    token_mean(model(ids), labels).backward()
    eng.detach()
    assert eng._capture.loss.pending == []
    eng.attach(opt)
    eng.empty_step()  # nothing of the discarded pass is judged here
    causal_lm_loss(model(ids), labels).mean().backward()
    opt.step()
    assert eng.steps == 2 and eng.probe_stats["loss_verdicts"] == {"per-sample mean": 1}


def test_a_loss_the_check_cannot_read_is_named_once(caplog):
    """Label smoothing: "not recognised" at every checked pass; when the signature's check ends, one warning says
    the loss was not verified and names the check to run."""
    model = TinyLM()
    eng, opt = engine_for(model)
    ids, labels = batch([5, 1, 3, 2])
    with caplog.at_level("WARNING", logger="fastdp.loss_check"):
        for _ in range(loss_check.MAX_TRIES + 2):
            o = model(ids)
            F.cross_entropy(o[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=IGN,
                            label_smoothing=0.1).backward()
            opt.step()
    warned = [r for r in caplog.records if "not verify" in r.getMessage()]
    assert len(warned) == 1 and "check_per_sample_loss" in warned[0].getMessage()
    assert eng.probe_stats["loss_verdicts"] == {"not recognised": loss_check.MAX_TRIES}


# ------------------------------------------------------------------------------------ found by a third pass
def test_a_hidden_state_output_is_dropped_once_the_logits_are_read(caplog):
    """T5/BART return ``encoder_last_hidden_state``, which the decoder read (so it gets a gradient): not
    recognised where the logits were. It is no longer checked, no warning, and the signature's check ends."""
    class WithHidden(TinyLM):
        def forward(self, ids):
            h = torch.tanh(self.emb(ids))
            return {"logits": self.head(h), "hidden": h}

    model = WithHidden()
    eng, opt = engine_for(model)
    ids, labels = batch([5, 1, 3, 2])
    with caplog.at_level("WARNING", logger="fastdp.loss_check"):
        for _ in range(3):
            causal_lm_loss(model(ids)["logits"], labels).mean().backward()
            opt.step()
    assert eng.probe_stats["loss_verdicts"] == {"per-sample mean": 1, "not recognised": 1}
    assert eng.probe_stats["loss_checks"] == 2 and not caplog.records


def test_the_budget_counts_passes_not_outputs_and_full_batches_apart():
    """A classifier whose batches are mostly fully labelled (uninformative) with a mean over its labelled samples:
    those passes do not use up the 8 judged passes, so the two later batches with ignored labels are compared and
    refused. Two outputs per pass (QA's start and end logits) count as one pass."""
    torch.manual_seed(0)

    class TwoLogits(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 3), nn.Linear(5, 3)

        def forward(self, x):
            return self.a(x), self.b(x)

    model = TwoLogits()
    eng, opt = engine_for(model)
    x = torch.randn(4, 5)
    full = torch.tensor([0, 2, 1, 1])

    def loss(y):
        o1, o2 = model(x)
        return (F.cross_entropy(o1, y, ignore_index=IGN) + F.cross_entropy(o2, y, ignore_index=IGN)) / 2

    for _ in range(loss_check.MAX_TRIES + 4):
        loss(full).backward()
        opt.step()
    # none counted against the 8 judged passes; after SPARSE_AFTER uninformative ones, one forward call in
    # SPARSE_EVERY is checked; two outputs each
    checked = sum(1 for n in range(1, loss_check.MAX_TRIES + 5)
                  if n <= loss_check.SPARSE_AFTER or n % loss_check.SPARSE_EVERY == 0)
    assert eng._capture.loss.tries == {} and eng.probe_stats["loss_checks"] == 2 * checked
    refused = []
    for j in range(4 * loss_check.SPARSE_EVERY):  # batches with ignored labels: 3 or 2 labelled samples
        loss(torch.tensor([IGN, 2, IGN, 1]) if j % 3 == 1 else torch.tensor([0, 2, IGN, 1])).backward()
        try:
            opt.step()
        except fastdp.StructureError as e:
            refused.append((j, str(e)))
    assert refused and re.search(r"output\[[01]\] has weight 0.\d+, a constant", refused[0][1])
    assert list(eng._capture.loss.tries.values()) == [0]
