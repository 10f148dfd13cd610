"""peft LoRA adapters on GPT-2 (Conv1D base layers, fan_in_fan_out) and BERT (Linear base layers; the classifier
is a trainable ModulesToSaveWrapper copy) against the batch-of-one oracle (float64, 1e-6 relative), with and
without trainable biases (bias="lora_only" / "all", or biases unfrozen by hand). lora_dropout=0 and
init_lora_weights=False (so lora_B is not zero and every adapter parameter has a non-zero gradient).
Frozen base weights must come out of the step unchanged with ``.grad is None``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from model_oracle import (  # noqa: E402
    ClsWrap,
    D,
    LMWrap,
    bert,
    check_engine,
    cls_batches,
    cls_loss,
    gpt2,
    lm_batches,
    lm_loss,
    quiet_transformers,
)
from oracle import FNS, MODES  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

quiet_transformers()
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers deprecation inside peft

BIASES = ["none", "lora_only", "all", "by_hand"]


def lora_model(family, bias, seed=0):
    torch.manual_seed(seed)
    if family == "gpt2":
        base = gpt2()
        cfg = dict(target_modules=["c_attn", "c_proj"], fan_in_fan_out=True, task_type="CAUSAL_LM")
    else:
        base = bert()
        cfg = dict(target_modules=["query", "value"], task_type="SEQ_CLS")
    pm = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, init_lora_weights=False,
                                         bias="none" if bias == "by_hand" else bias, **cfg))
    if bias == "by_hand":
        for n, p in pm.named_parameters():
            if n.endswith(".bias"):
                p.requires_grad_(True)
    model = (LMWrap(pm) if family == "gpt2" else ClsWrap(pm)).to(D)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in trainable) and any("lora_B" in n for n in trainable)
    has_bias = any(n.endswith(".bias") and "lora_" not in n and "modules_to_save" not in n for n in trainable)
    assert has_bias == (bias != "none"), trainable
    if family == "gpt2":
        loss, data = lm_loss, lm_batches([3, 1], 40 + BIASES.index(bias))
    else:
        loss, data = cls_loss, cls_batches([3, 1], 50 + BIASES.index(bias), pad_id=0)
    return model, loss, data


def _check_frozen(model, frozen_before):
    for n, p in model.named_parameters():
        if n in frozen_before:
            assert p.grad is None, f"frozen {n} got a .grad"
            assert torch.equal(p.detach(), frozen_before[n]), f"frozen {n} changed"


@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_lora(family, bias):
    model, loss, data = lora_model(family, bias)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    i = BIASES.index(bias)
    mode = ["BK-MixOpt", "ghost", "instantiate", "BK-ghost"][i]
    fn = ["abadi", "automatic", "abadi", "global"][i]
    style = ["all-layer", "layer-wise", "param-wise", "all-layer"][i]
    check_engine(model, loss, data, mode=mode, fn=fn, style=style, reduction=["mean", "sum"][i % 2])
    _check_frozen(model, frozen)


@pytest.mark.parametrize("mode", ["BK-MixOpt", "BK-ghost", "instantiate"])
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_lora_modes(family, mode):
    model, loss, data = lora_model(family, "lora_only", seed=1)
    check_engine(model, loss, data, mode=mode, fn="automatic", style="all-layer", reduction="sum")


@pytest.mark.slow
@pytest.mark.parametrize("style", ["all-layer", "layer-wise", "param-wise"])
@pytest.mark.parametrize("mode,fn", list(itertools.product(MODES, FNS)))
@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_lora_full_grid_slow(family, bias, mode, fn, style):
    model, loss, data = lora_model(family, bias, seed=2)
    red = ["mean", "sum"][(MODES.index(mode) + FNS.index(fn)) % 2]
    check_engine(model, loss, data, mode=mode, fn=fn, style=style, reduction=red)
