"""Empty batches (B = 0) of Hugging Face models under the engine: tiny GPT-2, BERT and RoBERTa (sequence
classification), T5 (conditional generation, per-sample loss from the logits), Llama and HF ViT, float64.

Under Poisson sampling a batch can be empty. None of these models can run a batch of zero rows itself: every HF
attention layer reshapes with ``view(B, T, -1, head_dim)`` ("cannot reshape tensor of 0 elements"), with or without
an engine. What is checked, per family:

* the model's own outcome on 0 rows without an engine is what the engine gives too: the same exception type and
  message (nothing wrapped), plus a note (``__notes__``, :mod:`fastdp.empty_batch`) that says to skip the forward
  and call ``engine.empty_step()``; were a model (a later transformers) to run 0 rows, the engine must run them too;
* a logical step of physical batches of sizes (2, 0, 3), the empty one attempted in between, releases the
  brute-force oracle's clipped sum of the 5 samples (sigma = 0, float64, 1e-6): the failed call leaves nothing
  behind and does not disturb the passes before and after it;
* with noise, a failed empty forward followed by ``engine.empty_step()`` releases exactly the noise of a plain
  ``empty_step()`` (one draw, one accounted step), and a (2, 0, 3) step exactly what (2, 3) releases.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from model_oracle import F32_INSIDE, FAMILIES, HID, LABELS, D, build_hf, cls_loss, oracle_for
from oracle import call_model, choose_R, clipped_sum, make_engine, released_grads

pytest.importorskip("transformers")

from fastdp.empty_batch import EMPTY_BATCH_NOTE  # noqa: E402

IMG = 12  # ViT: 12x12 images, patch 4 -> 9 patches + the class token


class ImageCls(torch.nn.Module):
    """HF image classifier -> logits (B, num_labels)."""

    def __init__(self, m: torch.nn.Module):
        super().__init__()
        self.m = m

    def forward(self, pixel_values):
        return self.m(pixel_values=pixel_values).logits


def _vit():
    from model_oracle import quiet_transformers

    quiet_transformers()
    import transformers

    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=IMG, patch_size=4, num_channels=3, hidden_size=HID, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=HID, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0, num_labels=LABELS, attn_implementation="eager")
    model = ImageCls(transformers.ViTForImageClassification(cfg)).to(D).train()

    def batches(sizes, seed):
        g = torch.Generator().manual_seed(seed)
        return [((torch.randn(n, 3, IMG, IMG, generator=g, dtype=D),), torch.randint(0, LABELS, (n,), generator=g))
                for n in sizes]

    return model, batches, cls_loss


def build(name):
    """(float64 model in train mode, batches(sizes, seed), per-sample loss, absolute tolerance relative to the
    largest gradient entry (the float32 branches inside some families))."""
    if name == "vit":
        return (*_vit(), 1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, batches, loss = build_hf(name)
    return model, batches, loss, F32_INSIDE.get(name, 0.0)


NAMES = ["gpt2", "bert", "roberta", "t5", "llama", "vit"]
assert set(NAMES) - {"vit"} <= set(FAMILIES)


def bare_outcome(model, x0):
    """What the model does on 0 rows without an engine: ``None`` if it runs, else the exception it raises."""
    try:
        call_model(copy.deepcopy(model), x0)
    except Exception as e:  # noqa: BLE001 - the model's own error, whatever it is
        return e
    return None


def attempt_empty(model, loss, batch, bare):
    """Run the 0-row batch through the engine-attached model as a training loop would: the same outcome as the
    bare model (its exception, unchanged, with fastdp's note), or forward and backward if the model runs 0 rows."""
    x0, y0 = batch
    if bare is None:
        loss(call_model(model, x0), y0).sum().backward()  # the sum of no losses: 0
        return
    with pytest.raises(type(bare)) as info:
        call_model(model, x0)
    assert str(info.value) == str(bare), "the engine changed the model's own error on an empty batch"
    assert EMPTY_BATCH_NOTE in getattr(info.value, "__notes__", []), "no note saying to call engine.empty_step()"


def step(model, opt, loss, batches, bare):
    """One logical step over ``batches``; an empty one is attempted as a user's loop would (it may raise)."""
    for x, y in batches:
        if len(y) == 0:
            attempt_empty(model, loss, (x, y), bare)
        else:
            loss(call_model(model, x), y).sum().backward()
    opt.step()


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("name", NAMES)
def test_empty_batch_inside_a_step_matches_the_oracle(name):
    model, batches, loss, atol_rel = build(name)
    data = batches([2, 0, 3], 7)
    bare = bare_outcome(model, data[1][0])
    _om, names, groups, psg = oracle_for(model, loss, data)
    assert all(psg[n].shape[0] == 5 for n in names)
    R = choose_R(psg, groups, "middle", gap=1e-6)
    want = clipped_sum(psg, groups, "abadi", R, 5)
    unclipped = clipped_sum(psg, groups, "abadi", 1e9, 5)  # the comparison can fail: clipping changes the result
    assert any(float((unclipped[n] - want[n]).abs().max()) > 1e-4 * float(want[n].abs().max()) for n in names)
    engine = make_engine(model, batch_size=5, R=R, reduction="sum")
    params = dict(model.named_parameters())
    opt = torch.optim.SGD([params[n] for n in names], lr=0.0)
    engine.attach(opt)
    step(model, opt, loss, data, bare)
    assert engine.steps == 1 and engine.accountant.ledger.steps == 1
    got = released_grads(model, names)
    for n in names:
        scale = float(want[n].abs().max())
        atol = max(1e-10 * max(1.0, scale), atol_rel * scale)
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=atol, msg=lambda m, n=n: f"{name} {n}: {m}")


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("name", NAMES)
def test_failed_empty_forward_then_empty_step_releases_noise_once(name):
    model, batches, loss, _ = build(name)
    twin = copy.deepcopy(model)
    (x0, y0), = batches([0], 8)
    bare = bare_outcome(model, x0)
    data = batches([2, 0, 3], 9)
    sigma, R = 0.7, 0.5
    runs = []
    for m, with_empty in ((model, True), (twin, False)):
        engine = make_engine(m, batch_size=5, R=R, sigma=sigma, reduction="sum",
                             noise_generator=torch.Generator().manual_seed(11))
        names = [n for n, p in m.named_parameters() if p.requires_grad]
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.0)
        engine.attach(opt)
        if with_empty:  # step 1: the loop tries the empty batch, then calls empty_step()
            attempt_empty(m, loss, (x0, y0), bare)
            if bare is None:
                opt.step()
            else:
                engine.empty_step()
        else:
            engine.empty_step()
        first = released_grads(m, names)
        opt.zero_grad()
        # step 2: batches (2, 0, 3), the empty one attempted (with_empty) or skipped
        step(m, opt, loss, data if with_empty else [data[0], data[2]], bare)
        runs.append((first, released_grads(m, names)))
        assert engine.steps == 2 and engine.accountant.ledger.steps == 2
        assert engine.get_privacy_spent()["epsilon"] > 0
    (e1, s1), (e2, s2) = runs
    for n in e1:
        assert float(e1[n].abs().max()) > 0, f"{name} {n}: empty_step released no noise"
        torch.testing.assert_close(e1[n], e2[n], rtol=0, atol=0, msg=lambda m, n=n: f"{name} {n}: {m}")
        torch.testing.assert_close(s1[n], s2[n], rtol=1e-12, atol=1e-14, msg=lambda m, n=n: f"{name} {n}: {m}")
