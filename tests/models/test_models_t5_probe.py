"""T5 under the engine the ways a user calls it, and the structure probe's fallback on it (tiny configs, float64).

* ``T5ForConditionalGeneration`` called without ``use_cache=False`` (the default, a key/value cache in training):
  the structure probe fails on the decoder and its fallback gives the encoder's and decoder's parameters to the
  ``T5Stack`` owners on the generic path, from inside the model's forward pre-hook. The engine's hooks are then
  reinstalled while torch still calls the pre-hooks it listed for that call; the ``labels=`` guard
  (:mod:`fastdp.hf_guard`) used to be removed there and was called without its keyword arguments: ``TypeError:
  _hook() missing 1 required positional argument: 'kwargs'``. The guard now stays across replans: the step matches
  the brute-force oracle, and ``labels=`` is still refused after the fallback (and allowed after ``detach``).
* ``labels=`` with grad: refused by the guard, naming ``seq2seq_loss``; under ``no_grad``: the model's own loss.
* Called without ``decoder_input_ids`` (nor ``labels``): the model's own ``ValueError`` reaches the user, not a
  :class:`fastdp.StructureError` naming no parameter (the probe's fallback could not help, and a pass of the model
  with the engine's hooks inert raises the same error).
* ``T5EncoderModel`` with a loss from its hidden states, at B = 3 and B = T = 7: the oracle.
"""

from __future__ import annotations

import functools

import pytest
import torch
from model_oracle import FFN, HID, D, V, check_engine, s2s_batches, seq_loss, t5
from oracle import make_engine

transformers = pytest.importorskip("transformers")

from fastdp import hf_guard, losses  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


class S2SWithCache(torch.nn.Module):
    """A user's module around T5: ``model(ids, mask, dec)`` -> the T5 output (no ``use_cache=False``)."""

    def __init__(self, m: torch.nn.Module):
        super().__init__()
        self.m = m

    def forward(self, ids, mask, dec):
        return self.m(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)


class Encoder(torch.nn.Module):
    """T5EncoderModel -> (B, T, d) hidden states."""

    def __init__(self):
        super().__init__()
        cfg = transformers.T5Config(vocab_size=V, d_model=HID, d_kv=8, d_ff=FFN, num_layers=1, num_heads=2,
                                    relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                    dropout_rate=0.0)
        self.m = transformers.T5EncoderModel(cfg)

    def forward(self, ids, mask):
        return self.m(input_ids=ids, attention_mask=mask).last_hidden_state


def _guards(model: torch.nn.Module) -> int:
    """The number of hf_guard pre-hooks on ``model`` itself."""
    return sum(isinstance(h, functools.partial) and h.func is hf_guard._hook for h in model._forward_pre_hooks.values())


def _generic(engine) -> set[str]:
    return {r["module"] for r in engine.plan.describe() if r["kind"] == "generic"}


@pytest.mark.parametrize("wrapped", [False, True], ids=["T5-root", "T5-in-a-wrapper"])
def test_t5_with_a_cache_falls_back_and_matches_the_oracle(wrapped):
    """Called as ``model(input_ids, attention_mask, decoder_input_ids)`` (positional, no ``use_cache=False``); the
    T5 model is the engine's root (the guard's pre-hook was listed for the call the fallback replanned in) or inside
    a user's module."""
    torch.manual_seed(0)
    m = t5().to(D).train()
    model = S2SWithCache(m) if wrapped else m
    data = [((ids, mask, dec), y) for (ids, dec, mask), y in s2s_batches([3, 2], 5)]
    engine, *_ = check_engine(model, lambda out, y: seq_loss(out.logits, y), data, mode="BK-MixOpt", atol_rel=1e-6)
    prefix = "m." if wrapped else ""
    assert {prefix + "encoder", prefix + "decoder"} <= _generic(engine)  # the probe's fallback ran
    assert _guards(m) == 1 and _guards(m.encoder) == 1  # kept across the replans, not doubled


def test_t5_labels_refused_after_the_fallback_and_allowed_after_detach():
    torch.manual_seed(0)
    m = t5(decoder_start_token_id=0).to(D).train()
    (ids, dec, mask), labels = s2s_batches([3], 6)[0]
    engine = make_engine(m, batch_size=3)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    engine.attach(opt)
    losses.seq2seq_loss(m(input_ids=ids, decoder_input_ids=dec, attention_mask=mask).logits, labels).mean().backward()
    opt.step()
    assert "encoder" in _generic(engine) and engine.steps == 1  # the fallback replanned inside that forward call
    with pytest.raises(ValueError, match=r"'<root>' \(T5ForConditionalGeneration\) was called with labels=.*"
                                         r"seq2seq_loss"):
        m(input_ids=ids, attention_mask=mask, labels=labels)
    with torch.no_grad():
        own = m(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert torch.isfinite(own)
    engine.detach()
    assert _guards(m) == 0 and _guards(m.encoder) == 0
    m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()  # no engine: HF's own loss trains


def test_t5_without_decoder_inputs_raises_the_models_own_error():
    torch.manual_seed(0)
    m = t5().to(D).train()
    (ids, _dec, mask), _ = s2s_batches([3], 7)[0]
    with pytest.raises(ValueError) as bare:
        m(input_ids=ids, attention_mask=mask)
    engine = make_engine(m, batch_size=3)
    engine.attach(torch.optim.SGD(m.parameters(), lr=0.0))
    with pytest.raises(ValueError) as got:
        m(input_ids=ids, attention_mask=mask)
    assert type(got.value) is ValueError and str(got.value) == str(bare.value)  # not a StructureError
    assert not engine._release.holds_gradients() and engine._capture.pending == []


@pytest.mark.parametrize("b", [3, 7], ids=["B-distinct", "B-eq-T"])
def test_t5_encoder_model_matches_the_oracle(b):
    torch.manual_seed(0)
    model = Encoder().to(D).train()
    g = torch.Generator().manual_seed(b)
    ids = torch.randint(2, V, (b, 7), generator=g)
    mask = torch.ones(b, 7, dtype=torch.long)
    mask[1:, -1] = 0
    data = [((ids, mask), torch.randn(b, 7, HID, generator=g, dtype=D))]
    check_engine(model, lambda h, y: 0.5 * (h - y).pow(2).flatten(1).sum(1), data, mode="BK-MixOpt", atol_rel=1e-6)


def test_an_engine_pass_failing_in_a_kv_cache_names_use_cache():
    """Found by a red-team pass: T5 with a cache under bf16 autocast (B 8, T 20) was refused by the probe's engine
    pass failing inside transformers' cache (the fallback's replay repeats the cache update), with a message that
    named only the attention modules. An engine-pass failure raised in a ``cache_utils.py`` now names the fix."""
    from fastdp import probe

    code = compile("def update():\n    raise RuntimeError('Sizes of tensors must match')\n",
                   "/site-packages/transformers/cache_utils.py", "exec")
    scope: dict = {}
    exec(code, scope)  # noqa: S102 - a function whose frames are in a file named cache_utils.py
    try:
        scope["update"]()
    except RuntimeError as e:
        finding = probe._engine_failed(e)
    assert "use_cache=False for training" in finding.detail
    try:
        raise RuntimeError("elsewhere")
    except RuntimeError as e:
        assert "use_cache" not in probe._engine_failed(e).detail


@pytest.mark.parametrize("use_cache", [None, False])
def test_t5_under_bf16_autocast_trains_with_and_without_a_cache(use_cache):
    """Found by a red-team pass: T5 called without ``use_cache=False`` under bf16 autocast (B 8, T 20) was refused.
    The probe's fallback gives its stacks to the generic path (as in float64), whose replay check compared float32
    outputs computed through bf16 products at float32's tolerance (they differed by 0.008): it now uses the autocast
    dtype's. Both calls train."""
    import random

    vocab = 97
    torch.manual_seed(0)
    m = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=vocab, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0)).train()
    engine = make_engine(m, batch_size=8, R=1.0, sigma=0.0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    engine.attach(opt)
    rng = random.Random(0)
    ids = torch.randint(3, vocab, (8, 20))
    mask = torch.zeros(8, 20, dtype=torch.long)
    labels = torch.randint(3, vocab, (8, 10))
    for i in range(8):
        mask[i, :rng.randint(2, 20)] = 1
        labels[i, rng.randint(1, 10):] = -100
    dec = torch.cat([torch.zeros(8, 1, dtype=torch.long), labels[:, :-1].clamp_min(0)], 1)
    kw = {} if use_cache is None else {"use_cache": use_cache}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(input_ids=ids * mask, attention_mask=mask, decoder_input_ids=dec, **kw)
    losses.seq2seq_loss(out.logits, labels).mean().backward()
    opt.step()
    assert engine.steps == 1 and engine.probe_stats["loss_verdicts"]["per-sample mean"] == 1
