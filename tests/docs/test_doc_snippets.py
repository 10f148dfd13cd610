"""Every ```python block of README.md and docs/ runs as printed.

Each block is executed, unchanged, in a fresh namespace that a *setup* fills with small stand-ins for the names the
block uses but does not define (``model``, ``optimizer``, ``train_set``, ``loader``, ``loss_fn``, ``n``, ...), at the
sizes the block prints (``batch_size=256, sample_size=len(train_set)`` gets a ``train_set`` whose rate the engine's
sample-rate monitor accepts). After the block a *check* asserts what the block claims (steps taken, parameters
trained, values in its comments). A block with no entry in :data:`SETUPS` and none in :data:`SKIP` fails, and so do
stale entries, so a new example in the docs gets a test or a reason.

Poisson loops must survive an empty batch (normal under Poisson sampling; ``optimizer.step()`` with no backward
pass is refused): every :class:`fastdp.data.PoissonSampler` built while a block runs yields one extra empty batch
at the end of the first epoch after which it has drawn ``k >= max(10, B / 16)`` batches (``B`` the expected batch
size), late enough that the sample-rate monitor stays quiet (the deficit ``B`` is then at most about ``4.2``
standard deviations of the sum of ``k`` batch sizes); the stand-in data sets are sized so that this happens (not
in the Hugging Face block, which makes one pass of 2 batches at ``B = 512``). Warnings raised while a block runs
fail the test (an example as printed should not warn), except torch's advice on ``num_workers`` for this machine.
"""

from __future__ import annotations

import re
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fastdp
from fastdp import data as fdata

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


@dataclass
class Snippet:
    key: str  # "path#k": the k-th ```python block of the page (0-based)
    line: int
    code: str


def snippets() -> list[Snippet]:
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        rel = page.relative_to(ROOT).as_posix()
        for k, m in enumerate(_BLOCK.finditer(text)):
            out.append(Snippet(f"{rel}#{k}", text.count("\n", 0, m.start()) + 2, m.group(1)))
    return out


# ---------------------------------------------------------------------------------------------- stand-ins
def _mlp(d_in: int = 4, classes: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, 8), nn.ReLU(), nn.Linear(8, classes))


def _dataset(n: int, d_in: int = 4, classes: int = 3) -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.randn(n, d_in), torch.randint(0, classes, (n,)))


def _base(n: int = 2560, d_in: int = 4) -> dict[str, Any]:
    """A model, its optimizer, a data set of ``n`` rows, one batch ``x, y`` and the loss (mean over the batch)."""
    model = _mlp(d_in)
    train_set = _dataset(n, d_in)
    x, y = train_set[:16]
    return {"torch": torch, "fastdp": fastdp, "nn": nn, "model": model, "train_set": train_set, "n": n,
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "loss_fn": nn.functional.cross_entropy,
            "x": x, "y": y, "build_model": lambda: _mlp(d_in)}


def _attached(ns: dict[str, Any], batch_size: int = 256, epochs: int = 1) -> dict[str, Any]:
    ns["engine"] = fastdp.PrivacyEngine(ns["model"], batch_size=batch_size, sample_size=ns["n"], epochs=epochs,
                                        target_epsilon=3.0)
    ns["engine"].attach(ns["optimizer"])
    ns["loader"] = fdata.poisson_loader(ns["train_set"], batch_size=batch_size)
    return ns


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _changed(before: list[torch.Tensor], model: nn.Module) -> list[bool]:
    return [not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)]


def _steps(ns: dict[str, Any]) -> int:
    return ns["engine"].get_privacy_spent()["steps"]


class _OOMOnce(nn.Module):
    """A model whose first forward on more than 4 samples runs its first layer, then raises OutOfMemoryError."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.raised = nn.Linear(4, 8), nn.Linear(8, 3), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if x.shape[0] > 4 and not self.raised:
            self.raised = True
            raise torch.OutOfMemoryError("stand-in: out of memory")
        return self.head(torch.relu(h))


def setup_readme(tmp_path: Path) -> dict[str, Any]:
    ns = _base(50_000)
    ns["loader"] = fdata.poisson_loader(ns["train_set"], batch_size=1024, steps=64)  # 1024 / 16 = 64
    ns["before"] = _params(ns["model"])
    return ns


def check_readme(ns: dict[str, Any]) -> None:
    assert len(_INJECTED) == 1 and _steps(ns) == 65  # 64 Poisson batches + the injected empty one
    assert all(_changed(ns["before"], ns["model"]))
    assert all(p.isfinite().all() for p in ns["model"].parameters())  # the empty batch's NaN loss released nothing


def setup_accounting(tmp_path: Path) -> dict[str, Any]:
    ns = _base()
    ns["PrivacyEngine"] = fastdp.PrivacyEngine
    return ns


def check_accounting(ns: dict[str, Any], capsys: Any) -> None:
    assert f"{ns['engine'].get_privacy_spent()['delta']:.1e}" == "8.3e-06"  # the comment's delta = 1/(2 n)
    assert float(capsys.readouterr().out.splitlines()[0]) == ns["engine"].noise_multiplier > 0


class _BitFitNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 8, bias=False)  # DP-BiTFiT-Add gives it a bias
        self.classifier = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.relu(self.encoder(x)))


def setup_bitfit(tmp_path: Path) -> dict[str, Any]:
    ns = _base()
    ns["model"] = _BitFitNet()
    del ns["optimizer"]
    return ns


def check_bitfit(ns: dict[str, Any]) -> None:
    trainable = sorted(name for name, p in ns["model"].named_parameters() if p.requires_grad)
    assert trainable == ["classifier.bias", "classifier.weight", "encoder.bias"]
    assert ns["engine"].optimizer is ns["optimizer"]


def setup_bitfit_phases(tmp_path: Path) -> dict[str, Any]:
    ns = _attached(_base(512), epochs=4)
    ns["freeze_all_but_bias"] = __import__("fastdp.bitfit", fromlist=["x"]).freeze_all_but_bias
    ns["x_epochs"], ns["bitfit_epochs"] = 2, 2

    def train_one_epoch(*_: Any) -> None:
        for x, y in ns["loader"]:
            ns["loss_fn"](ns["model"](x), y).backward()
            ns["optimizer"].step()
            ns["optimizer"].zero_grad()
        ns["marks"].append((_steps(ns), _params(ns["model"])))

    ns["train_one_epoch"], ns["marks"] = train_one_epoch, [(0, _params(ns["model"]))]
    return ns


def check_bitfit_phases(ns: dict[str, Any]) -> None:
    marks, model = ns["marks"], ns["model"]
    assert [s for s, _ in marks] == [0, 2, 4, 6, 8]  # 2 Poisson batches per epoch
    is_bias = [name.endswith("bias") for name, _ in model.named_parameters()]
    phase2 = [not torch.equal(a, b) for a, b in zip(marks[2][1], marks[4][1], strict=True)]
    assert phase2 == is_bias  # phase 2 trains the biases only
    assert ns["engine"].get_privacy_spent()["steps"] == 8


def setup_checkpoint_save(tmp_path: Path, monkeypatch: Any) -> dict[str, Any]:
    monkeypatch.chdir(tmp_path)
    ns = _base()
    ns["x"], ns["y"] = ns["train_set"][:256]  # a batch of the expected size 256
    return ns


def check_checkpoint_save(ns: dict[str, Any]) -> None:
    ckpt = torch.load("checkpoint.pt")
    assert ckpt["engine"]["steps"] == _steps(ns) == 1
    assert ckpt["engine"]["noise_generator"] is not None  # the reproducible noise stream is saved


def setup_checkpoint_resume(tmp_path: Path, monkeypatch: Any) -> dict[str, Any]:
    """Run the saving block first (as printed) in its own namespace; the resuming block then loads its file."""
    ns = setup_checkpoint_save(tmp_path, monkeypatch)
    exec(compile(_BY_KEY["docs/guide/checkpoints.md#0"].code, "<checkpoints.md#0>", "exec"), ns)
    fresh = _base()
    fresh["saved_model"], fresh["saved_steps"] = ns["model"], _steps(ns)
    return fresh


def check_checkpoint_resume(ns: dict[str, Any]) -> None:
    assert _steps(ns) == ns["saved_steps"] == 1
    for p, q in zip(ns["model"].parameters(), ns["saved_model"].parameters(), strict=True):
        assert torch.equal(p, q)


class _BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.norm, self.head = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.body(x).unsqueeze(-1)).squeeze(-1)))


def setup_data_loop(tmp_path: Path) -> dict[str, Any]:
    ns = _base(2560)
    ns["model"] = _BNNet()
    del ns["optimizer"]
    return ns


def check_data_loop(ns: dict[str, Any]) -> None:
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in ns["model"].modules())
    assert len(_INJECTED) == 1 and _steps(ns) == 101  # 10 epochs of 10 Poisson batches + the empty one


def setup_virtual(tmp_path: Path) -> dict[str, Any]:
    ns = _attached(_base(4096))  # 16 batches: the empty one comes after them
    ns["VirtualBatches"] = fdata.VirtualBatches
    ns["before"] = _params(ns["model"])
    return ns


def check_virtual(ns: dict[str, Any]) -> None:
    assert len(_INJECTED) == 1 and _steps(ns) == 17  # 16 Poisson batches + the injected empty one
    assert all(_changed(ns["before"], ns["model"]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_process_group(monkeypatch: Any) -> None:
    """The environment torchrun sets for a world of one process (gloo, this machine)."""
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)


def setup_dist_data(tmp_path: Path, monkeypatch: Any) -> dict[str, Any]:
    _one_process_group(monkeypatch)
    ns = _base(512)
    ns["PrivacyEngine"], ns["poisson_loader"] = fastdp.PrivacyEngine, fdata.poisson_loader
    return ns


def check_dist_data(ns: dict[str, Any]) -> None:
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
    assert ns["loader"].batch_sampler.sample_rate == 256 / 512


def setup_dist_loop(tmp_path: Path, monkeypatch: Any) -> dict[str, Any]:
    _one_process_group(monkeypatch)
    ns = _base(512)
    ns["before"] = _params(ns["model"])
    return ns


def check_dist_loop(ns: dict[str, Any], capsys: Any) -> None:
    assert _steps(ns) == 2  # one pass over the loader: 512 / 256 batches
    assert all(_changed(ns["before"], ns["model"]))
    assert "'steps'" in capsys.readouterr().out


def _tiny_gpt2_dir(tmp_path: Path) -> str:
    transformers = pytest.importorskip("transformers", reason="the Hugging Face example needs transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    return str(tmp_path / "gpt2")


def _pad_collate(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad token sequences; padding gets attention 0 and label -100."""
    t = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), t, dtype=torch.long)
    mask = torch.zeros(len(examples), t, dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, :len(e["input_ids"])], mask[i, :len(e["input_ids"])] = e["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def setup_hf(tmp_path: Path) -> dict[str, Any]:
    path = _tiny_gpt2_dir(tmp_path)
    g = torch.Generator().manual_seed(0)
    train_set = [{"input_ids": torch.randint(0, 50, (int(torch.randint(2, 7, (), generator=g)),), generator=g)}
                 for _ in range(1024)]
    return {"path": path, "train_set": train_set, "pad_collate": _pad_collate}


def check_hf(ns: dict[str, Any]) -> None:
    # one pass over the loader, 2 batches: too few for an empty batch the monitor accepts at B = 512 (32 needed)
    assert not _INJECTED and _steps(ns) == 2


def setup_quickstart(tmp_path: Path) -> dict[str, Any]:
    ns = {"train_set": torch.utils.data.TensorDataset(torch.randn(2560, 1, 28, 28), torch.randint(0, 10, (2560,)))}
    return ns


def check_quickstart(ns: dict[str, Any], capsys: Any) -> None:
    assert len(_INJECTED) == 1 and _steps(ns) == 101  # 10 epochs of 10 Poisson batches + the empty one
    assert "'accountant': 'prv'" in capsys.readouterr().out


def setup_refusals(tmp_path: Path) -> dict[str, Any]:
    ns = _base()
    ns["model"] = _BNNet()
    return ns


def check_refusals(ns: dict[str, Any], capsys: Any) -> None:
    assert isinstance(ns["model"].norm, nn.GroupNorm)
    assert capsys.readouterr().out == ""  # nothing left to report


def setup_secure(tmp_path: Path) -> dict[str, Any]:
    return _base(2560)


def check_secure(ns: dict[str, Any]) -> None:
    assert ns["engine"].state_dict()["config"]["secure_mode"] is True
    assert ns["loader"].batch_sampler.secure_mode


def setup_oom(tmp_path: Path) -> dict[str, Any]:
    ns = _base()  # x: 16 rows; the engine expects 8 a batch, as the half batch the example releases
    ns["model"] = _OOMOnce()
    ns["optimizer"] = torch.optim.SGD(ns["model"].parameters(), lr=0.1)
    ns["engine"] = fastdp.PrivacyEngine(ns["model"], batch_size=8, sample_size=ns["n"], epochs=1, noise_multiplier=1.0)
    ns["engine"].attach(ns["optimizer"])
    ns["before"] = _params(ns["model"])
    return ns


def check_oom(ns: dict[str, Any]) -> None:
    assert ns["model"].raised and _steps(ns) == 1
    assert all(_changed(ns["before"], ns["model"]))


def setup_gan(tmp_path: Path) -> dict[str, Any]:
    ns = _base()
    D, G = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), nn.Linear(2, 4)
    opt_d, opt_g = torch.optim.SGD(D.parameters(), lr=0.1), torch.optim.SGD(G.parameters(), lr=0.1)
    engine = fastdp.PrivacyEngine(D, batch_size=8, sample_size=ns["n"], epochs=1, noise_multiplier=1.0)
    engine.attach(opt_d)
    ns.update(D=D, G=G, opt_d=opt_d, opt_g=opt_g, engine=engine, real=torch.randn(8, 4), labels=torch.ones(8, 1),
              z=torch.randn(8, 2), ones=torch.ones(8, 1), loss_fn=nn.functional.binary_cross_entropy_with_logits,
              before_g=_params(G), before_d=_params(D))
    return ns


def _engine8(ns: dict[str, Any]) -> dict[str, Any]:
    """``ns``'s model with an engine of batch size 8 (noise 1) attached to its optimizer; ``x, y``: 8 rows."""
    ns["x"], ns["y"] = ns["x"][:8], ns["y"][:8]
    ns["engine"] = fastdp.PrivacyEngine(ns["model"], batch_size=8, sample_size=ns["n"], epochs=1,
                                        noise_multiplier=1.0)
    ns["engine"].attach(ns["optimizer"])
    ns["before"] = _params(ns["model"])
    return ns


def setup_views(tmp_path: Path) -> dict[str, Any]:
    ns = _engine8(_base())
    x, y = ns["x"], ns["y"]
    ns.update(F=nn.functional, view1=lambda t: t + 0.1, view2=lambda t: t * 0.9,
              per_sample_loss=lambda a, b: (a - b).pow(2).sum(1), x_labelled=x[:4], x_unlabelled=x[4:],
              x_a=x[:4], y_a=y[:4], x_b=x[4:], y_b=y[4:])
    return ns


def check_views(ns: dict[str, Any]) -> None:
    assert _steps(ns) == 2 and all(_changed(ns["before"], ns["model"]))


def setup_adversarial(tmp_path: Path) -> dict[str, Any]:
    ns = _engine8(_base())
    ns["x"] = ns["x"].clone()
    ns["eps"] = 0.1
    return ns


def check_adversarial(ns: dict[str, Any]) -> None:
    assert _steps(ns) == 1 and all(_changed(ns["before"], ns["model"]))  # (exactness: test_training_passes.py)


def check_gan(ns: dict[str, Any]) -> None:
    assert _steps(ns) == 1
    assert all(_changed(ns["before_g"], ns["G"]))
    assert all(p.grad is None for p in ns["D"].parameters())


def check_ledger(ns: dict[str, Any]) -> None:
    acc = ns["acc"]
    assert (acc.ledger.steps, acc.ledger.noiseless_steps, acc.ledger.releases) == (301, 1, 1)
    assert (acc.history, acc.steps) == ([(1.0, 0.01, 300)], 300)


def check_accountant(ns: dict[str, Any]) -> None:
    acc = ns["acc"]
    assert acc.history == [(1.0, 0.01, 300), (2.0, 0.05, 300)] and acc.steps == 600
    assert 0 < acc.get_epsilon(1e-5) < float("inf")


def setup_losses(tmp_path: Path) -> dict[str, Any]:
    transformers = pytest.importorskip("transformers", reason="the Hugging Face example needs transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(_tiny_gpt2_dir(tmp_path))
    input_ids = torch.randint(0, 50, (4, 6))
    mask = torch.ones_like(input_ids)
    return {"model": model, "input_ids": input_ids, "mask": mask, "labels": input_ids.clone()}


def check_losses(ns: dict[str, Any]) -> None:
    assert all(p.grad is not None for p in ns["model"].parameters())


def setup_autocast(tmp_path: Path) -> dict[str, Any]:
    ns = _attached(_base(), batch_size=16)  # x, y: 16 rows
    ns["before"] = _params(ns["model"])
    return ns


def check_autocast(ns: dict[str, Any]) -> None:
    assert _steps(ns) == 1 and all(_changed(ns["before"], ns["model"]))


def setup_scaler(tmp_path: Path) -> dict[str, Any]:
    ns = _base()
    ns["engine"] = fastdp.PrivacyEngine(ns["model"], batch_size=256, sample_size=ns["n"], epochs=1,
                                        target_epsilon=3.0)
    ns["loader"] = fdata.poisson_loader(ns["train_set"], batch_size=256)
    ns["before"] = _params(ns["model"])
    return ns


def check_scaler(ns: dict[str, Any]) -> None:
    assert _steps(ns) == len(ns["loader"]) + len(_INJECTED)  # skipped steps count too
    assert all(_changed(ns["before"], ns["model"]))


def setup_make_private(tmp_path: Path) -> dict[str, Any]:
    ns = _base()
    ns["train_loader"] = torch.utils.data.DataLoader(ns["train_set"], batch_size=256)
    ns["DataLoader"] = torch.utils.data.DataLoader
    ns["before"] = _params(ns["model"])
    return ns


def check_make_private(ns: dict[str, Any], capsys: Any) -> None:
    assert ns["engine"].steps >= 3 and all(_changed(ns["before"], ns["model"]))
    assert "epsilon" in capsys.readouterr().out


def check_adaptive(ns: dict[str, Any], capsys: Any) -> None:
    state = ns["engine"].adaptive_clipping
    assert len(state.thresholds) == 3 and len(state.noisy_unclipped_fractions) == 3
    assert "'steps': 3" in capsys.readouterr().out


def check_audit_bounds(ns: dict[str, Any], capsys: Any) -> None:
    out = capsys.readouterr().out.splitlines()
    assert float(out[0]) == pytest.approx(3.4654, abs=1e-4) and 0 < float(out[1]) < 5
    assert ns["result"].epsilon_lower_bound == pytest.approx(1.782, abs=1e-3) and "1.782" in out[2]


def check_audit_training(ns: dict[str, Any], capsys: Any) -> None:
    res = ns["result"]
    assert 0 < res.epsilon_lower_bound <= 8.0 and res.num_canaries == 400 and res.claimed_epsilon == 8.0
    assert "epsilon >= " in capsys.readouterr().out


def check_dpfp_api(ns: dict[str, Any], capsys: Any) -> None:
    dp = ns["dp"]
    assert dp.steps_taken == dp.planned_steps == 32
    spent = dp.get_privacy_spent()
    assert spent.covered and 2.9 < spent.epsilon <= 3.0 and "(2.99" in capsys.readouterr().out


def check_dpfp_accounting(ns: dict[str, Any], capsys: Any) -> None:
    from fastdp.dpfp import dpfp_epsilon

    assert abs(ns["sigma"] - 10.57) < 0.05
    assert abs(dpfp_epsilon(0.346, ns["p"], ns["M"], ns["T"], ns["delta"]) / 234 - 1) < 0.01
    out = capsys.readouterr().out.split()
    assert abs(float(out[3]) - 1.73) < 0.01  # the paper's GDP-CLT epsilon at sigma/C = 0.346


#: "page#k" -> (setup(tmp_path[, monkeypatch]) -> namespace, check(namespace[, capsys]) or None)
SETUPS: dict[str, tuple[Callable[..., dict[str, Any]], Callable[..., None] | None]] = {
    "README.md#0": (setup_readme, check_readme),
    "README.md#1": (setup_make_private, check_make_private),
    "docs/guide/clipping.md#0": (lambda tmp_path: {}, check_adaptive),
    "docs/guide/quickstart.md#1": (setup_make_private, check_make_private),
    "docs/guide/accounting.md#0": (setup_accounting, check_accounting),
    "docs/guide/audit.md#0": (lambda tmp_path: {}, check_audit_bounds),
    "docs/guide/audit.md#1": (lambda tmp_path: {}, check_audit_training),
    "docs/guide/bitfit.md#0": (setup_bitfit, check_bitfit),
    "docs/guide/bitfit.md#1": (setup_bitfit_phases, check_bitfit_phases),
    "docs/guide/checkpoints.md#0": (setup_checkpoint_save, check_checkpoint_save),
    "docs/guide/checkpoints.md#1": (setup_checkpoint_resume, check_checkpoint_resume),
    "docs/guide/data.md#0": (setup_data_loop, check_data_loop),
    "docs/guide/dpfp.md#0": (lambda tmp_path: {}, check_dpfp_api),
    "docs/guide/dpfp.md#1": (lambda tmp_path: {}, check_dpfp_accounting),
    "docs/guide/data.md#1": (setup_virtual, check_virtual),
    "docs/guide/data.md#2": (setup_dist_data, check_dist_data),
    "docs/guide/distributed.md#0": (setup_dist_loop, check_dist_loop),
    "docs/guide/huggingface.md#0": (setup_hf, check_hf),
    "docs/guide/integrations.md#0": (setup_autocast, check_autocast),
    "docs/guide/integrations.md#1": (setup_scaler, check_scaler),
    "docs/guide/quickstart.md#0": (setup_quickstart, check_quickstart),
    "docs/guide/refusals.md#0": (setup_refusals, check_refusals),
    "docs/guide/secure-mode.md#0": (setup_secure, check_secure),
    "docs/guide/training-loop.md#0": (setup_oom, check_oom),
    "docs/guide/training-loop.md#1": (setup_views, check_views),
    "docs/guide/training-loop.md#2": (setup_adversarial, check_adversarial),
    "docs/guide/training-loop.md#3": (setup_gan, check_gan),
    "docs/internals/accounting.md#0": (lambda tmp_path: {}, check_ledger),
    "docs/internals/engine.md#0": (setup_oom, check_oom),
    "docs/internals/engine.md#1": (setup_gan, check_gan),
    "docs/reference/accounting.md#0": (lambda tmp_path: {}, check_accountant),
    "docs/reference/losses.md#0": (setup_losses, check_losses),
}

#: "page#k" -> why the block is not run here
SKIP: dict[str, str] = {
    "docs/guide/huggingface.md#1": "a 3-epoch Trainer run; the same DPTrainer calls run on tiny models in "
                                   "tests/models/test_hf_trainer.py",
    "docs/guide/distributed.md#1": "needs torchrun with CUDA (init_device_mesh('cuda')); the same steps run on CPU in "
                                   "examples/fully_shard.py and tests/distributed",
}

#: warnings about this machine, not the example (torch's advice for num_workers=4 on a 2-core machine)
_MACHINE_WARNING = re.compile(r"This DataLoader will create \d+ worker processes in total")

_ALL = snippets()
_INJECTED: list[Any] = []  # the samplers that yielded the extra empty batch
_BY_KEY = {s.key: s for s in _ALL}


def test_every_block_has_a_setup_or_a_reason() -> None:
    keys = set(_BY_KEY)
    assert not (keys - SETUPS.keys() - SKIP.keys()), f"blocks without a setup or a skip reason: {keys - SETUPS.keys()}"
    assert not (SETUPS.keys() | SKIP.keys()) - keys, f"stale entries: {(SETUPS.keys() | SKIP.keys()) - keys}"
    assert not SETUPS.keys() & SKIP.keys()


@pytest.fixture
def empty_batch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each PoissonSampler yields one extra empty batch once ``max(10, B / 16)`` batches are drawn (module doc)."""
    original = fdata.PoissonSampler.__iter__

    def patched(self: fdata.PoissonSampler):  # noqa: ANN202
        for batch in original(self):
            self._doc_drawn = getattr(self, "_doc_drawn", 0) + 1
            yield batch
        if not getattr(self, "_doc_injected", False) and self._doc_drawn >= max(
                10, self.sample_size * self.sample_rate / 16):
            self._doc_injected = True
            _INJECTED.append(self)
            yield []

    _INJECTED.clear()
    monkeypatch.setattr(fdata.PoissonSampler, "__iter__", patched)


def _call(fn: Callable[..., Any], *args: Any, **extra: Any) -> Any:
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    return fn(*args, **{k: v for k, v in extra.items() if k in names})


@pytest.mark.parametrize("key", [s.key for s in _ALL])
def test_snippet_runs_as_printed(key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any,
                                 empty_batch_once: None) -> None:
    if key in SKIP:
        pytest.skip(f"{key}: {SKIP[key]}")
    snippet = _BY_KEY[key]
    setup, check = SETUPS[key]
    torch.manual_seed(0)
    ns = _call(setup, tmp_path, monkeypatch=monkeypatch)
    ns.setdefault("__name__", "__doc_snippet__")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(compile(snippet.code, f"<{key} (line {snippet.line})>", "exec"), ns)
        assert not [str(w.message) for w in caught if not _MACHINE_WARNING.search(str(w.message))], f"{key} warned"
        if check is not None:
            _call(check, ns, capsys=capsys)
    finally:
        engine = ns.get("engine")
        if engine is not None and getattr(engine, "optimizer", None) is not None:
            engine.detach()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
