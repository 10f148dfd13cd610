"""torch's CPU batch-norm kernels misread some dense layouts in the backward pass, and the engine's layout hooks.

torch 2.14.1's CPU ``batch_norm`` backward (BatchNorm*, and InstanceNorm*, which runs on it) returns wrong gradients
when its input or output gradient is dense but a size-1 dimension carries another stride than the contiguous (or
channels-last) one: a batch of one reached through a view, as XCiT's and LeViT's patch embeddings do
(``x.flatten(2).transpose(1, 2)`` after a BatchNorm). The batch's gradient was right and each sample's alone wrong, so
the brute-force batch-of-one oracle and the engine's structure probe disagreed with the engine's per-sample gradients.
``fastdp.torch_api.batch_norm_layout_hooks`` (installed by the engine) hands the kernels layouts they read correctly.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from oracle import make_engine
from torch import nn

from fastdp import torch_api

D = torch.float64


def _strided(src: torch.Tensor, order: tuple[int, ...], junk: bool) -> torch.Tensor:
    """``src``'s values in a dense layout whose dimensions are nested in ``order`` (outermost first); ``junk``: every
    size-1 dimension's stride 7."""
    shape, strides, step = src.shape, [0] * src.dim(), 1
    for d in reversed(order):
        strides[d] = step
        step *= shape[d]
    if junk:
        strides = [7 if shape[d] == 1 else strides[d] for d in range(src.dim())]
    out = torch.empty_strided(shape, strides, dtype=src.dtype)
    return out.copy_(src)


def _mismatches(make, fix: bool) -> int:
    bad = 0
    for shape in [(1, 4, 3, 1), (3, 4, 1, 2), (1, 4, 2, 2), (2, 4, 3, 1)]:
        for order, junk, which in itertools.product(itertools.permutations(range(4)), (False, True), ("x", "g")):
            torch.manual_seed(0)
            mod = make().to(D)
            x0, g = torch.randn(shape, dtype=D), torch.randn(shape, dtype=D)
            x = x0.clone().requires_grad_()
            want = torch.autograd.grad(mod(x), [x, *mod.parameters()], g)
            xs = (_strided(x0, order, junk) if which == "x" else x0.clone()).requires_grad_()
            gs = _strided(g, order, junk) if which == "g" else g
            cl = isinstance(mod, nn.BatchNorm2d)
            inp = torch_api.dense_layout(xs, cl) if fix else xs
            got = torch.autograd.grad(mod(inp), [xs, *mod.parameters()], torch_api.dense_layout(gs, cl) if fix else gs)
            bad += any(float((u - v).norm()) > 1e-12 * float(u.norm()) for u, v in zip(want, got, strict=True))
    return bad


@pytest.mark.parametrize("name,make", [("bn-eval", lambda: nn.BatchNorm2d(4).eval()),
                                       ("bn-train", lambda: nn.BatchNorm2d(4)),
                                       ("instance", lambda: nn.InstanceNorm2d(4, affine=True))])
def test_the_kernel_misreads_some_layouts_and_dense_layout_fixes_them(name, make):
    # if a torch upgrade fixes the kernel, the first assertion fails: the hooks can then go (fastdp/torch_api.py)
    assert _mismatches(make, fix=False) > 0
    assert _mismatches(make, fix=True) == 0


class PatchEmbed(nn.Module):
    """Conv -> BatchNorm (eval) -> tokens ``x.flatten(2).transpose(1, 2)`` -> LayerNorm -> Linear -> mean -> head
    (XCiT's patch embedding: at batch size 1 the LayerNorm's backward gives the BatchNorm an output gradient whose
    batch dimension's stride is the channels', not the sample's size)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8).eval()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 6)
        self.head = nn.Linear(6, 2)
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.normal_(1, 0.3)
            self.bn.bias.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x))
        return self.head(torch.tanh(self.fc(self.norm(h.flatten(2).transpose(1, 2)))).mean(1))


def _oracle(model: nn.Module, x: torch.Tensor, y: torch.Tensor, R: float) -> torch.Tensor:
    """Each sample's gradient from the whole batch's backward (one more sample appended) with the other samples'
    targets 0 (a batch of two or more has layouts the kernel reads correctly), clipped as ``abadi`` clips (``R /
    (norm + 1e-6)``, at most 1), summed, divided by the batch size."""
    total = None
    xb = torch.cat([x, torch.randn_like(x[:1])])  # one more sample (target 0): a batch of at least 2
    for i in range(x.shape[0]):
        m = PatchEmbed().to(D)
        m.load_state_dict(model.state_dict())
        w = torch.zeros(xb.shape[0], *y.shape[1:], dtype=y.dtype)
        w[i] = y[i]
        (m(xb) * w).sum().backward()
        g = torch.cat([p.grad.flatten() for p in m.parameters()])
        g = g * min(1.0, R / (float(g.norm()) + 1e-6))
        total = g if total is None else total + g
    return total / x.shape[0]


def _release(model: nn.Module, x: torch.Tensor, y: torch.Tensor, **kw) -> torch.Tensor:
    """One private step (noise 0, ``R`` 1e-4, every sample clipped): the released gradient, flattened."""
    engine = make_engine(model, batch_size=x.shape[0], R=1e-4, reduction="sum", **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    (model(x) * y).sum().backward()
    opt.step()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("mode", ["BK-MixOpt", "instantiate"])
def test_a_patch_embedding_at_batch_size_one_is_clipped_exactly(mode):
    torch.manual_seed(0)
    model = PatchEmbed().to(D)
    x, y = torch.randn(1, 3, 4, 4, dtype=D), torch.randn(1, 2, dtype=D)
    want = _oracle(model, x, y, 1e-4)
    got = _release(model, x, y, mode=mode)
    assert float((got - want).norm()) <= 1e-6 * float(want.norm())


@pytest.mark.parametrize("B", [1, 3])
def test_without_the_hooks_the_probe_refuses_a_patch_embedding(B, monkeypatch):
    # the check can fail: without the hooks the probe's batch-of-one backward (the kernel's wrong gradients)
    # disagrees with the engine's per-sample gradients of the BatchNorm, and the probe refuses the model
    from fastdp.probe import StructureError
    monkeypatch.setattr("fastdp.capture.batch_norm_layout_hooks", lambda root: [])
    torch.manual_seed(0)
    model = PatchEmbed().to(D)
    x, y = torch.randn(B, 3, 4, 4, dtype=D), torch.randn(B, 2, dtype=D)
    with pytest.raises(StructureError, match="bn"):
        _release(model, x, y)


def test_the_structure_probe_passes_a_patch_embedding():
    torch.manual_seed(1)
    model = PatchEmbed().to(D)
    x, y = torch.randn(3, 3, 4, 4, dtype=D), torch.randn(3, 2, dtype=D)
    want = _oracle(model, x, y, 1e-4)
    got = _release(model, x, y)
    assert float((got - want).norm()) <= 1e-6 * float(want.norm())
