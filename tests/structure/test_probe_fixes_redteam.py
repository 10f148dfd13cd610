"""Red-team cases for the structure probe's fixes of 2026-11-28 (commits 54c3234, d613b00: the probe re-run on the
finite samples under ``on_nonfinite="zero"``/``"scaler"``; a signature verified at two batch sizes). Each case
states what the library promises (a release equal to the float64 brute-force oracle, 1e-6, or a refusal); each
failed on those commits and passes since the fixes in fastdp/probe_passes.py (``_rel``: a non-finite error is a
mismatch; ``_restore_buffers``: an unchanged buffer is not written).
"""

from __future__ import annotations

import copy

import pytest
import torch
from model_oracle import mse_loss
from oracle import assert_grads_close, make_engine, user_loss
from test_probe_batch_sizes_redteam import _oracle
from torch import nn

from fastdp.probe import StructureError

D = torch.float64
T, DM = 4, 5


class _FoldRollSqrt(nn.Module):
    """A Linear on the rows folded to (B T, d), rolled by half a sample (2 of T = 4 rows) before and back after:
    outputs are row-correct, per-sample gradients of ``inner`` mix neighbouring samples (the probe refuses it on
    finite batches). ``sqrt(h^2 m)`` is finite forward and gives NaN gradients at masked (m = 0) positions only."""

    def __init__(self):
        super().__init__()
        self.inner, self.head = nn.Linear(DM, DM), nn.Linear(DM, 2)

    def forward(self, x, m):
        B = x.shape[0]
        h = self.inner(x.flatten(0, 1).roll(2, 0)).roll(-2, 0).view(B, T, DM)
        return self.head((h.pow(2) * m[:, :, None]).sqrt()).mean(1)


# SHOWED A PROBLEM (change 2, the retry on the finite samples): batch 2, sample 0 padded at positions 2, 3 (its own
# gradient is NaN; the engine's row 0 is finite because the fold put sample 0's NaN rows into row 1). The retry
# probes sample 0, whose batch-of-one reference gradient is NaN; _rel returns NaN and `NaN > rtol` is False, so the
# comparison passes and the signature is verified at batch size 2. Released 1.18 off the oracle over the finite
# sample (step 0), then 0.173 off on a fully finite batch of 2 (step 1), no error, every clipping mode; the same
# under attach(scaler=GradScaler("cpu")) (0.41 off at step 1, float32). Without the padding the probe refuses.
@pytest.mark.parametrize("mode", ["BK-MixOpt", "BK-ghost"])
def test_a_nonfinite_reference_does_not_verify_a_mixing_model(mode):
    torch.manual_seed(0)
    model = _FoldRollSqrt().to(D)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, T, DM, generator=g, dtype=D), torch.randn(2, 2, generator=g, dtype=D)
    x2, y2 = torch.randn(2, T, DM, generator=g, dtype=D), torch.randn(2, 2, generator=g, dtype=D)
    m, m2 = torch.ones(2, T, dtype=D), torch.ones(2, T, dtype=D)
    m[0, 2:] = 0
    R, N = 0.05, 2
    wants = [_oracle(model, [((x, m), y)], R, N, good=[1]), _oracle(model, [((x2, m2), y2)], R, N)]
    engine = make_engine(model, batch_size=N, R=R, mode=mode, on_nonfinite="zero")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    for (xx, mm, yy), want in zip([(x, m, y), (x2, m2, y2)], wants, strict=True):
        try:
            user_loss(mse_loss(model(xx, mm), yy), "mean").backward()
        except StructureError:
            opt.zero_grad()
            continue
        opt.step()
        assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want)
        opt.zero_grad()


class _Scaled(nn.Module):
    """A buffer multiplied into the activations: autograd saves it for the backward pass."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(3, 3), nn.Linear(3, 2)
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x) * self.scale))


# SHOWED A PROBLEM (made reachable by change 1, the second batch size): forward A (batch 8), forward B (batch 5),
# then A's and B's backward passes. B's call is the signature's first call at another size, so the probe runs
# between A's forward and backward and its _restore_buffers() copy_()s every buffer in place: A's backward fails
# with torch's "one of the variables needed for gradient computation has been modified by an inplace operation:
# [torch.DoubleTensor [3]] is at version 8; expected version 4" (not a fastdp message). With batch size 5 verified
# before (or 8 twice) the same flow runs and is exact.
def test_a_second_size_probe_between_a_forward_and_its_backward_keeps_saved_buffers():
    torch.manual_seed(0)
    model = _Scaled().to(D)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 3, generator=g, dtype=D), torch.randn(n, 2, generator=g, dtype=D)) for n in (8, 8, 5)]
    R, N = 0.5, 8
    template = copy.deepcopy(model)
    want = _oracle(template, [((x,), y) for x, y in batches[1:]], R, N)
    engine = make_engine(model, batch_size=N, R=R)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    (x0, y0) = batches[0]
    user_loss(mse_loss(model(x0), y0), "mean").backward()  # an ordinary step at batch size 8: verified at one size
    opt.step()
    opt.zero_grad()
    (xa, ya), (xb, yb) = batches[1:]
    la = user_loss(mse_loss(model(xa), ya), "mean")
    lb = user_loss(mse_loss(model(xb), yb), "mean")  # the second size's probe runs here
    la.backward()
    lb.backward()
    opt.step()
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want)
