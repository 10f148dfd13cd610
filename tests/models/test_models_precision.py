"""Mixed precision: GPT-2 and BERT trained under CPU bf16 autocast (float32 weights), and with bfloat16 weights,
compared with the float64 batch-of-one oracle at a low-precision tolerance (whole-gradient relative error
||got - want|| / ||want|| below 5e-2; the engine measures about 3e-3 here, as does a bf16 batch-of-one baseline).
The released ``.grad`` must have each parameter's dtype.

Token ids are drawn from [257, 300) with a vocabulary of 300: bf16 has an 8-bit significand, so casting such ids
to bf16 changes about half of them (257 -> 256, 259 -> 260, ...). If the engine cast integer inputs the word
embedding's gradient would go to the wrong rows; the per-parameter check on the word embedding catches that
(the deliberately wrong oracle with cast ids is off by more than 0.5 there; see test_id_cast_would_be_caught).

Every sample is clipped (R below the smallest per-sample norm; the unclipped sum is off by about 1), so the
tolerance cannot hide a missing clipping either.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from model_oracle import (  # noqa: E402
    ClsWrap,
    LMWrap,
    bert,
    cls_batches,
    cls_loss,
    gpt2,
    lm_batches,
    lm_loss,
    quiet_transformers,
    rel_err,
)
from oracle import (  # noqa: E402
    choose_R,
    clipped_sum,
    make_engine,
    make_groups,
    oracle_model,
    per_sample_grads,
    released_grads,
    trainable_names,
    user_loss,
)

quiet_transformers()

VOCAB = 300
LO = 257
TOL = 5e-2
BF16 = torch.bfloat16


def build(family, seed=0):
    torch.manual_seed(seed)
    if family == "gpt2":
        model = LMWrap(gpt2(vocab=VOCAB))
        return model, lm_batches([3, 1], 80, vocab=VOCAB, lo=LO), lm_loss, "m.transformer.wte.weight"
    model = ClsWrap(bert(vocab=VOCAB))
    data = cls_batches([3, 1], 81, vocab=VOCAB, lo=LO, pad_id=0)
    return model, data, cls_loss, "m.bert.embeddings.word_embeddings.weight"


def _ids_change_under_bf16(data):
    ids = torch.cat([x[0] for x, _ in data])
    return float((ids.to(BF16).long() != ids).float().mean())


def _oracle(model, data, loss, R=None, fn="abadi", style="all-layer", cast_ids=False):
    om = oracle_model(model)  # float64 copy of the (float32 or bf16) weights; no autocast
    names = trainable_names(model)
    groups = make_groups(om, style, names)
    if cast_ids:  # the deliberately wrong oracle: token ids through bf16
        data = [(tuple(t.to(BF16).long().clamp(max=VOCAB - 1) if t.max() > 1 else t for t in x), y)
                for x, y in data]
    psg = per_sample_grads(om, loss, data, names)
    if R is None:
        R = choose_R(psg, groups, "below")
    return clipped_sum(psg, groups, fn, R, 4), R, psg, groups


def _engine_step(model, data, loss, R, mode, reduction, autocast, fn="abadi", style="all-layer"):
    engine = make_engine(model, batch_size=4, R=R, fn=fn, style=style, mode=mode, reduction=reduction)
    names = trainable_names(model)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD([params[n] for n in names], lr=1e-3)
    engine.attach(opt)
    for x, y in data:
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            out = model(*x)
            per = loss(out, y)
        assert out.dtype == BF16  # the logits come from a bf16 matmul (autocast) or bf16 weights
        user_loss(per, reduction).backward()
    opt.step()
    return released_grads(model, names)


@pytest.mark.parametrize("mode,reduction", [("BK-MixOpt", "mean"), ("BK-ghost", "sum"), ("instantiate", "mean")])
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_bf16_autocast(family, mode, reduction):
    model, data, loss, emb = build(family)
    assert _ids_change_under_bf16(data) > 0.3
    want, R, _, _ = _oracle(model, data, loss)
    got = _engine_step(model, data, loss, R, mode, reduction, autocast=True)
    for n, p in model.named_parameters():
        assert got[n].dtype == p.dtype == torch.float32, n
    assert rel_err(got, want) < TOL, rel_err(got, want)
    assert rel_err(got, want, [emb]) < TOL, rel_err(got, want, [emb])


@pytest.mark.parametrize("mode", ["BK-MixOpt", "ghost", "instantiate"])
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_bf16_weights(family, mode):
    model, data, loss, emb = build(family, seed=1)
    model = model.to(BF16)
    assert all(p.dtype == BF16 for p in model.parameters())
    want, R, _, _ = _oracle(model, data, loss)
    got = _engine_step(model, data, loss, R, mode, "mean", autocast=False)
    for n, p in model.named_parameters():
        assert got[n].dtype == p.dtype == BF16, n
    assert rel_err(got, want) < TOL, rel_err(got, want)
    assert rel_err(got, want, [emb]) < TOL, rel_err(got, want, [emb])


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_id_cast_would_be_caught(family):
    """Oracle-only: casting the ids through bf16 changes the word-embedding gradient far beyond TOL, and skipping
    the clipping changes the whole gradient far beyond TOL, so the tests above can fail."""
    model, data, loss, emb = build(family)
    want, R, psg, groups = _oracle(model, data, loss)
    wrong, _, _, _ = _oracle(model, data, loss, R=R, cast_ids=True)
    assert rel_err(wrong, want, [emb]) > 10 * TOL
    unclipped = clipped_sum(psg, groups, "abadi", 1e12, 4)
    assert rel_err(unclipped, want) > 10 * TOL
