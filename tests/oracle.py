"""Brute-force oracle for the PrivacyEngine's released gradient.

Independent of the engine's implementation: per-sample gradients come from one batch-of-one
forward/backward per sample (``torch.autograd.grad``), in float64, on a deep copy of the model.

Released gradient (contract, noise excluded)::

    sum_i  C_{i,k(p)} * g_{i,p}  /  batch_size

with ``C`` from the clipping function applied to the per-group norm ``||g_{i,k}||`` with threshold
``R_k = R / sqrt(K)``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from fastdp.modes import CLIPPING_MODES

ABADI_EPS = 1e-6
AUTOMATIC_GAMMA = 0.01


# --------------------------------------------------------------------------- parameters and groups


def trainable_names(model: nn.Module) -> list[str]:
    """Names (as ``model.named_parameters()`` spells them) of the parameters with requires_grad."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def make_groups(model: nn.Module, style, names: Sequence[str] | None = None) -> list[list[str]]:
    """Clipping groups (lists of parameter names) for a style, following the contract."""
    if names is None:
        names = trainable_names(model)
    names = list(names)
    if isinstance(style, (list, tuple)):
        groups = [list(g) for g in style]
        flat = [n for g in groups for n in g]
        assert sorted(flat) == sorted(names), "explicit groups must partition the trainable parameters"
        return groups
    if style == "all-layer":
        return [names]
    if style == "param-wise":
        return [[n] for n in names]
    if style == "layer-wise":
        by_id = {id(p): n for n, p in model.named_parameters()}
        wanted = set(names)
        seen: set[str] = set()
        groups = []
        for _mname, mod in model.named_modules():
            g = []
            for _pn, p in mod.named_parameters(recurse=False):
                n = by_id[id(p)]
                if n in wanted and n not in seen:
                    g.append(n)
                    seen.add(n)
            if g:
                groups.append(g)
        assert seen == wanted
        return groups
    raise ValueError(f"unknown style {style!r}")


# --------------------------------------------------------------------------- per-sample gradients


def _index(x, i: int):
    if isinstance(x, torch.Tensor):
        return x[i : i + 1]
    if isinstance(x, (tuple, list)):
        return type(x)(_index(t, i) for t in x)
    raise TypeError(type(x))


def _len(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.shape[0]
    return _len(x[0])


def _to_double(x):
    if isinstance(x, torch.Tensor):
        return x.double() if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_to_double(t) for t in x)
    return x


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if its strides are exactly the row-major ones, else a row-major copy. (``is_contiguous()`` is no
    test here: it ignores the stride of a size-1 dimension, which is what the kernel below misreads.)"""
    strides, step = [], 1
    for n in reversed(t.shape):
        strides.append(step)
        step *= max(n, 1)
    if t.stride() == tuple(reversed(strides)):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _row_major_operands(module: nn.Module) -> None:
    """Hand a batch-norm kernel row-major input and output-gradient tensors.

    torch 2.14.1's CPU ``batch_norm`` backward (BatchNorm*, and InstanceNorm*, which runs on it) returns wrong
    gradients when an operand is dense but a size-1 dimension carries another stride than its own: a batch of one
    after ``flatten(2).transpose(1, 2)`` and a LayerNorm (XCiT's and LeViT's patch embeddings). The oracle's
    batch-of-one passes would read them (its self-check then fails: the samples' gradients do not add up to the
    batch's). Written here apart from the engine's own workaround (``fastdp.torch_api.batch_norm_layout_hooks``), so
    the oracle does not depend on the code it checks."""

    def pre(_m, args):
        return (_row_major(args[0]), *args[1:]) if args and isinstance(args[0], torch.Tensor) else None

    def post(_m, _args, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(_row_major)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def oracle_model(model: nn.Module) -> nn.Module:
    """Float64 deep copy (ties between parameters are preserved by deepcopy's memo), whose batch-norm kernels get
    row-major operands (:func:`_row_major_operands`)."""
    om = copy.deepcopy(model).double()
    for m in om.modules():
        if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)):
            _row_major_operands(m)
    return om


def call_model(model, x):
    return model(*x) if isinstance(x, tuple) else model(x)


def per_sample_grads(
    model: nn.Module,
    per_sample_loss: Callable,
    batches: Sequence[tuple],
    names: Sequence[str],
) -> dict[str, torch.Tensor]:
    """Per-sample gradients g_i of every sample of every (x, y) batch, stacked along dim 0.

    ``per_sample_loss(output, y)`` must return a tensor of shape (B,) (the per-sample losses L_i).
    ``model`` should already be the float64 oracle copy. Returns ``{name: (N, *param.shape)}``.
    """
    params = dict(model.named_parameters())
    plist = [params[n] for n in names]
    out: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for x, y in batches:
        x = _to_double(x)
        y = _to_double(y)
        for i in range(_len(x)):
            xi, yi = _index(x, i), _index(y, i)
            li = per_sample_loss(call_model(model, xi), yi)
            assert li.shape == (1,), li.shape
            grads = torch.autograd.grad(li[0], plist, allow_unused=True)
            for n, p, g in zip(names, plist, grads, strict=True):
                out[n].append(torch.zeros_like(p) if g is None else g.detach().clone())
    return {
        n: (torch.stack(v) if v else torch.zeros((0, *params[n].shape), dtype=params[n].dtype)) for n, v in out.items()
    }


def well_conditioned(model: nn.Module, per_sample_loss, batches, names, psg=None, rel=1e-12, tol=1e-7) -> bool:
    """Whether the per-sample gradients are numerically stable: perturbing every float parameter and input
    by a relative ``rel`` must change them by less than ``tol`` relative to each parameter's largest
    per-sample gradient. Degenerate models (e.g. LayerNorm of a constant vector applied repeatedly) turn
    float64 rounding into O(1e-7) differences; no implementation can match the oracle there.

    An embedding's output is perturbed too, row by row: it stands for the input when the input is token indices,
    and perturbing its weight cannot reveal a degeneracy of repeated tokens (a sample whose tokens are all equal
    has an exactly constant embedded input, and a norm of it is rounding noise)."""
    if psg is None:
        psg = per_sample_grads(model, per_sample_loss, batches, names)
    g = torch.Generator().manual_seed(12345)
    m2 = copy.deepcopy(model)
    with torch.no_grad():
        for p in m2.parameters():
            if p.is_floating_point():
                p.mul_(1 + rel * torch.randn(p.shape, generator=g, dtype=p.dtype))

    def pert_out(module, args, out):
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            return out * (1 + rel * torch.randn(out.shape, generator=g, dtype=out.dtype))
        return out

    for mod in m2.modules():
        if isinstance(mod, nn.Embedding):
            mod.register_forward_hook(pert_out)

    def pert(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x * (1 + rel * torch.randn(x.shape, generator=g, dtype=x.dtype))
        return x

    b2 = [(pert(x), y) for x, y in batches]
    psg2 = per_sample_grads(m2, per_sample_loss, b2, names)
    glob = max([1e-30] + [float(v.abs().max()) for v in psg.values() if v.numel()])
    if glob < 1e-9:  # every per-sample gradient is float64 rounding (a norm of a constant vector: a padding row)
        return False
    for n in names:
        if psg[n].numel() == 0:
            continue
        scale = max(float(psg[n].abs().max()), 1e-12 * glob, 1e-30)  # per parameter, as assert_grads_close
        if float((psg2[n] - psg[n]).abs().max()) > tol * scale:
            return False
    return True


def group_norms(psg: dict[str, torch.Tensor], groups: Sequence[Sequence[str]]) -> torch.Tensor:
    """(N, K) matrix of ||g_{i,k}||."""
    cols = []
    for g in groups:
        sq = sum(psg[n].reshape(psg[n].shape[0], -1).pow(2).sum(1) for n in g)  # (reshape: 0-dim parameters too)
        cols.append(sq.sqrt())
    return torch.stack(cols, 1)


def clip_factors(norms: torch.Tensor, fn: str, r_k: float) -> torch.Tensor:
    if fn == "abadi":
        return torch.clamp(r_k / (norms + ABADI_EPS), max=1.0)
    if fn == "automatic":
        return r_k / (norms + AUTOMATIC_GAMMA)
    if fn == "global":
        return (norms <= r_k).to(norms.dtype)
    raise ValueError(fn)


def clipped_sum(
    psg: dict[str, torch.Tensor], groups: Sequence[Sequence[str]], fn: str, R: float, batch_size: int
) -> dict[str, torch.Tensor]:
    """sum_i C_{i,k} g_i / batch_size for every parameter (noise-free released gradient)."""
    K = len(groups)
    r_k = R / math.sqrt(K)
    C = clip_factors(group_norms(psg, groups), fn, r_k)  # (N, K)
    res = {}
    for k, g in enumerate(groups):
        for n in g:
            t = psg[n]
            c = C[:, k].reshape(-1, *([1] * (t.dim() - 1)))
            res[n] = (c * t).sum(0) / batch_size
    return res


def max_clip_factor(psg, groups, fn: str, R: float) -> float:
    """Largest C_{i,k}: rounding errors in g_i are multiplied by C_i (automatic clipping can amplify a
    tiny, rounding-dominated per-sample gradient by up to R_k / 0.01), so absolute tolerances scale with it."""
    if not groups or next(iter(psg.values())).shape[0] == 0:
        return 1.0
    return float(clip_factors(group_norms(psg, groups), fn, R / math.sqrt(len(groups))).max())


def choose_R(psg, groups, where: str = "middle", gap: float = 1e-3) -> float:
    """A threshold R such that no scaled group norm sqrt(K)*||g_{i,k}|| lies within a relative ``gap``
    of R (so that "global" clipping is not decided by rounding).

    ``where``: "middle" (between two norms near the median, so some samples are clipped and some are
    not), "above" (no sample clipped by abadi), "below" (every sample clipped).
    """
    K = len(groups)
    v = (group_norms(psg, groups) * math.sqrt(K)).flatten()
    # Norms far below the largest one are ill-conditioned for ghost norms (||g||^2 obtained from a Gram
    # sum whose terms can be ~1e6 times larger than ||g||^2 loses relative precision in float64), so R is
    # never placed among them: such groups stay unclipped (abadi, global) or are insensitive (automatic).
    allv = v[v > 1e-12].tolist()
    v = v[v > max(1e-12, 1e-3 * float(v.max()) if v.numel() else 0.0)]
    if v.numel() == 0:
        return 1.0
    R = _choose_R(v, where, gap)
    while any(abs(x / R - 1) <= 2 * gap for x in allv):  # keep clear of the small norms too
        R *= 1 - 10 * gap
    return R


def _choose_R(v, where, gap):
    v, _ = torch.sort(v)
    vals = v.tolist()
    if where == "above":
        return vals[-1] * 2.0 + 1e-3
    if where == "below":
        return vals[0] * 0.5
    n = len(vals)
    if n == 1:
        return vals[0] * 0.5
    # best ratio among adjacent pairs in the middle half
    lo, hi = max(0, n // 4 - 1), min(n - 1, (3 * n) // 4 + 1)
    best, best_j = 0.0, None
    for j in range(lo, hi):
        r = vals[j + 1] / vals[j]
        if r > best:
            best, best_j = r, j
    if best_j is None or best < 1 + 2 * gap:
        return vals[0] * 0.5
    return math.sqrt(vals[best_j] * vals[best_j + 1])


def oracle_release(
    model: nn.Module,
    per_sample_loss: Callable,
    batches: Sequence[tuple],
    *,
    style="all-layer",
    fn: str = "abadi",
    R: float = 1.0,
    batch_size: int,
    names: Sequence[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Convenience wrapper: float64 copy, per-sample grads, groups, clipped sum."""
    om = oracle_model(model)
    if names is None:
        names = trainable_names(model)
    groups = make_groups(om, style, names)
    psg = per_sample_grads(om, per_sample_loss, batches, names)
    return clipped_sum(psg, groups, fn, R, batch_size)


def plain_gradient(model: nn.Module, per_sample_loss: Callable, batches, reduction: str, names=None):
    """Ordinary autograd gradient (float64 copy) of the user's loss, summed over the batches."""
    om = oracle_model(model)
    if names is None:
        names = trainable_names(model)
    params = dict(om.named_parameters())
    plist = [params[n] for n in names]
    total = [torch.zeros_like(p) for p in plist]
    for x, y in batches:
        per = per_sample_loss(call_model(om, _to_double(x)), _to_double(y))
        loss = per.mean() if reduction == "mean" else per.sum()
        gs = torch.autograd.grad(loss, plist, allow_unused=True)
        for t, g in zip(total, gs, strict=True):
            if g is not None:
                t += g
    return dict(zip(names, total, strict=True))


# =========================================================================== engine harness
# (helpers shared by tests/test_engine_*.py; they only use the public contract of PrivacyEngine)

MODES = list(CLIPPING_MODES)  # every clipping mode (fastdp.modes), default first
FNS = ["abadi", "automatic", "global"]
STYLES = ["all-layer", "layer-wise", "param-wise", "explicit"]


def mse_per_sample(out, y):
    """0.5 * ||out_i - y_i||^2 per sample -> (B,)."""
    return 0.5 * (out - y).pow(2).flatten(1).sum(1)


def ce_per_sample(logits, y):
    """Cross entropy summed over positions: logits (B, T, V), y (B, T) -> (B,)."""
    B, T, V = logits.shape
    return (
        torch.nn.functional.cross_entropy(logits.reshape(B * T, V), y.reshape(B * T), reduction="none")
        .reshape(B, T)
        .sum(1)
    )


def user_loss(per, reduction):
    return per.mean() if reduction == "mean" else per.sum()


def make_engine(
    model,
    *,
    batch_size,
    R=1.0,
    fn="abadi",
    style="all-layer",
    mode="BK-MixOpt",
    reduction="mean",
    sigma=0.0,
    sample_size=10_000,
    check_rate=False,
    **kw,
):
    import warnings

    from fastdp import PrivacyEngine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(
            model,
            batch_size=batch_size,
            sample_size=sample_size,
            noise_multiplier=sigma,
            max_grad_norm=R,
            clipping_fn=fn,
            clipping_style=style,
            clipping_mode=mode,
            loss_reduction=reduction,
            **kw,
        )
    if not check_rate:
        engine._release.sampling = UncheckedRate(engine.batch_size, engine.sample_size)
    return engine


def _unchecked_rate_cls():
    from fastdp.sampling_check import SampleRateMonitor, Verdict

    class _UncheckedRate(SampleRateMonitor):
        """Test double of the engine's sample-rate monitor: counts, never flags. The oracle tests choose
        ``batch_size`` (the divisor of the released mean) independently of the batches they feed; the rate
        check itself is tested in tests/accounting/test_accounting_guards.py."""

        def observe(self, size):
            self.steps += 1
            self.total += int(size)
            return Verdict()

    return _UncheckedRate


def UncheckedRate(batch_size, sample_size):  # noqa: N802 - reads like the class it builds
    return _unchecked_rate_cls()(batch_size, sample_size)


def engine_step(model, optimizer, per_sample_loss, batches, reduction):
    """One logical step: one forward/backward per physical batch, then optimizer.step()."""
    for x, y in batches:
        per = per_sample_loss(call_model(model, x), y)
        user_loss(per, reduction).backward()
    optimizer.step()


def released_grads(model, names):
    params = dict(model.named_parameters())
    out = {}
    for n in names:
        g = params[n].grad
        assert g is not None, f"{n}: .grad is None after optimizer.step()"
        out[n] = g.detach().clone()
    return out


def run_engine_once(
    model, per_sample_loss, batches, *, batch_size, R, fn, style, mode, reduction, sigma=0.0, lr=1.0, **kw
):
    """Attach an engine + SGD(lr) to ``model``, run one logical step, return (engine, opt, released grads)."""
    names = trainable_names(model)
    engine = make_engine(
        model, batch_size=batch_size, R=R, fn=fn, style=style, mode=mode, reduction=reduction, sigma=sigma, **kw
    )
    params = dict(model.named_parameters())
    opt = torch.optim.SGD([params[n] for n in names], lr=lr)
    engine.attach(opt)
    engine_step(model, opt, per_sample_loss, batches, reduction)
    return engine, opt, released_grads(model, names)


def release_of(model, run, *, batch_size, R, **kw):
    """The released gradient (noise 0) of one logical step that ``run(model, engine)`` takes (its forward and
    backward passes) before ``optimizer.step()``: an engine and SGD(lr=0) attached to ``model``. ``{name: grad}``."""
    engine = make_engine(model, batch_size=batch_size, R=R, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    run(model, engine)
    opt.step()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_grads_close(got: dict, want: dict, rtol=1e-6, atol=1e-10, msg=""):
    assert set(got) == set(want), (sorted(got), sorted(want))
    for n in want:
        w = want[n].double()
        g = got[n].double()
        assert g.shape == w.shape, f"{msg} {n}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
        scale = max(1.0, float(w.abs().max())) if w.numel() else 1.0
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol * scale, msg=lambda m, n=n: f"{msg} param {n}: {m}")


def explicit_groups(names, draw):
    """A random partition of ``names`` into explicit groups (hypothesis draw)."""
    from hypothesis import strategies as st

    perm = draw(st.permutations(list(names)))
    k = draw(st.integers(1, len(perm)))
    cuts = (
        sorted(draw(st.lists(st.integers(1, max(1, len(perm) - 1)), min_size=k - 1, max_size=k - 1, unique=True)))
        if len(perm) > 1 and k > 1
        else []
    )
    groups, prev = [], 0
    for c in cuts + [len(perm)]:
        if c > prev:
            groups.append(list(perm[prev:c]))
            prev = c
    return groups


# =========================================================================== layer cases


class RawScale(nn.Module):
    """``h * s`` with a raw parameter ``s``: no layer kind owns it, so the generic path (vmap replay) clips it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, h):
        return h * self.s


class Wrap(nn.Module):
    """layer -> (tanh -> Linear readout over the last dim)?"""

    def __init__(self, layer: nn.Module, readout: nn.Module | None):
        super().__init__()
        self.layer = layer
        self.readout = readout

    def forward(self, x):
        h = self.layer(x)
        if self.readout is not None:
            h = self.readout(torch.tanh(h))
        return h


class Case:
    def __init__(self, model, per_sample_loss, make_x, out_tail=None, kind=""):
        self.model = model
        self.per_sample_loss = per_sample_loss
        self.make_x = make_x  # n -> input batch of n samples
        self.kind = kind
        with torch.no_grad():
            self.out_tail = tuple(call_model(model, make_x(1)).shape[1:]) if out_tail is None else out_tail

    def batch(self, n, dtype=torch.float64):
        x = self.make_x(n)
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x = x.to(dtype)
        y = torch.randn((n, *self.out_tail), dtype=dtype)
        return x, y


LAYER_KINDS = [
    "linear2d",
    "linear3d",
    "linear4d",
    "conv1d",
    "conv2d",
    "conv3d",
    "embedding",
    "layernorm",
    "groupnorm",
    "instancenorm1d",
    "instancenorm2d",
    "instancenorm3d",
    "rmsnorm",
]


def _conv_params(draw, nd: int):
    from hypothesis import strategies as st

    kmax = 3 if nd < 3 else 2
    smax = 4 if nd < 3 else 3
    g = draw(st.integers(1, 3))
    depthwise = draw(st.booleans())
    a = 1 if depthwise else draw(st.integers(1, 2))
    b = draw(st.integers(1, 2))
    cin, cout = g * a, g * b
    k = tuple(draw(st.integers(1, kmax)) for _ in range(nd))
    pad_kind = draw(st.sampled_from(["int", "tuple", "valid", "same"]))
    if pad_kind == "same":
        s = (1,) * nd
    else:
        s = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    d = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    if pad_kind == "int":
        p0 = draw(st.integers(0, 2))
        padding, pads = p0, (p0,) * nd
    elif pad_kind == "tuple":
        pads = tuple(draw(st.integers(0, 2)) for _ in range(nd))
        padding = pads
    elif pad_kind == "valid":
        padding, pads = "valid", (0,) * nd
    else:
        padding = "same"
        pads = tuple((dd * (kk - 1) + 1) // 2 for kk, dd in zip(k, d, strict=True))  # max of left/right
    mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    if all(p == 0 for p in pads):
        mode = "zeros" if mode == "reflect" else mode
    sizes = []
    for kk, dd, pp in zip(k, d, pads, strict=True):
        eff = dd * (kk - 1) + 1
        lo = max(1, eff - 2 * pp if pad_kind != "same" else 1, pp + 1 if mode in ("reflect", "circular") else 1)
        sizes.append(draw(st.integers(lo, lo + smax - 1)))
    bias = draw(st.booleans())
    return dict(
        in_channels=cin,
        out_channels=cout,
        kernel_size=k,
        stride=s,
        dilation=d,
        padding=padding,
        padding_mode=mode,
        groups=g,
        bias=bias,
    ), tuple(sizes)


def build_case(kind: str, draw, dtype=torch.float64, readout: bool | None = None) -> Case:
    """A small random model around one layer of ``kind`` (hypothesis ``draw``; uses torch's global RNG)."""
    from hypothesis import strategies as st

    if readout is None:
        readout = draw(st.booleans())
    loss = mse_per_sample
    if kind.startswith("linear"):
        din, dout = draw(st.integers(1, 8)), draw(st.integers(1, 8))
        lead = {
            "linear2d": (),
            "linear3d": (draw(st.integers(1, 6)),),
            "linear4d": (draw(st.integers(1, 4)), draw(st.integers(1, 4))),
        }[kind]
        layer = nn.Linear(din, dout, bias=draw(st.booleans()))

        def make_x(n, lead=lead, din=din):
            return torch.randn((n, *lead, din), dtype=dtype)
    elif kind.startswith("conv"):
        nd = int(kind[4])
        kw, sizes = _conv_params(draw, nd)
        layer = getattr(nn, f"Conv{nd}d")(**kw)
        cin = kw["in_channels"]

        def make_x(n, sizes=sizes, cin=cin):
            return torch.randn((n, cin, *sizes), dtype=dtype)
    elif kind == "embedding":
        V, dim = draw(st.integers(2, 8)), draw(st.integers(1, 6))
        pidx = draw(st.one_of(st.none(), st.integers(-V, V - 1)))
        layer = nn.Embedding(V, dim, padding_idx=pidx)
        tshape = draw(st.sampled_from([(), (draw(st.integers(1, 6)),)]))

        def make_x(n, V=V, tshape=tshape):
            return torch.randint(0, V, (n, *tshape))
    elif kind in ("layernorm", "rmsnorm"):
        T, dim = draw(st.integers(1, 5)), draw(st.integers(1, 6))
        two = draw(st.booleans())
        shape = (T, dim) if two else (dim,)
        if dtype != torch.float64 and kind == "layernorm" and math.prod(shape) < 2:
            # a single normalized element has x_hat = 0 exactly; float32 rounding of x - mean is then amplified
            # by 1/sqrt(eps) (torch's own LayerNorm does the same), so avoid the degenerate case in float32
            dim = 2
            shape = (T, dim) if two else (dim,)
        if kind == "layernorm":
            layer = nn.LayerNorm(shape, bias=draw(st.booleans()))
        else:
            # eps=None means finfo(dtype).eps: 1.2e-7 in float32 but 2.2e-16 in the float64 oracle, a different
            # function when x^2 is that small; keep eps=None for float64 only
            eps_choices = [None, 1e-5] if dtype == torch.float64 else [1e-5]
            layer = nn.RMSNorm(shape, eps=draw(st.sampled_from(eps_choices)))
        with torch.no_grad():
            layer.weight.normal_()
            if getattr(layer, "bias", None) is not None:
                layer.bias.normal_()
        extra = draw(st.sampled_from([(), (2,)])) if not two else ()

        def make_x(n, extra=extra, T=T, dim=dim):
            return 2 * torch.randn((n, *extra, T, dim), dtype=dtype) + 0.5
    elif kind == "groupnorm":
        G, m = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        C = G * m
        spatial = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=2)))
        if m * math.prod(spatial) < 2:
            spatial = spatial + (2,)
        layer = nn.GroupNorm(G, C, affine=True)
        with torch.no_grad():
            layer.weight.normal_()
            layer.bias.normal_()

        def make_x(n, C=C, spatial=spatial):
            return 2 * torch.randn((n, C, *spatial), dtype=dtype) + 0.5
    elif kind.startswith("instancenorm"):
        nd = int(kind[12])
        C = draw(st.integers(1, 4))
        spatial = tuple(draw(st.integers(1, 3 if nd == 3 else 4)) for _ in range(nd))
        if math.prod(spatial) < 2:
            spatial = (*spatial[:-1], 2)
        layer = getattr(nn, f"InstanceNorm{nd}d")(C, affine=True)
        with torch.no_grad():
            layer.weight.normal_()
            layer.bias.normal_()

        def make_x(n, C=C, spatial=spatial):
            return 2 * torch.randn((n, C, *spatial), dtype=dtype) + 0.5
    else:
        raise ValueError(kind)
    layer = layer.to(dtype)
    ro = None
    if readout:
        with torch.no_grad():
            tail = Wrap(layer, None)(make_x(1)).shape[-1]
        ro = nn.Linear(tail, 2, dtype=dtype)
    model = Wrap(layer, ro)
    return Case(model, loss, make_x, kind=kind)


def compare_engine_to_oracle(
    model,
    per_sample_loss,
    batches,
    *,
    mode,
    fn,
    style="all-layer",
    reduction="mean",
    batch_size=None,
    R=None,
    where="middle",
    rtol=1e-6,
    atol=1e-10,
    lr=1.0,
    **kw,
):
    """Run one logical step of the engine (sigma=0) and assert its released gradient equals the oracle's.

    Returns (engine, optimizer, got, want, R)."""
    names = trainable_names(model)
    if batch_size is None:
        batch_size = max(1, sum(_len(x) for x, _ in batches))
    om = oracle_model(model)
    groups = make_groups(om, style, names)
    psg = per_sample_grads(om, per_sample_loss, batches, names)
    if R is None:
        R = choose_R(psg, groups, where, gap=1e-6 if rtol < 1e-5 else 1e-3)
    want = clipped_sum(psg, groups, fn, R, batch_size)
    atol = atol * max(1.0, max_clip_factor(psg, groups, fn, R))
    engine, opt, got = run_engine_once(
        model,
        per_sample_loss,
        batches,
        batch_size=batch_size,
        R=R,
        fn=fn,
        style=style,
        mode=mode,
        reduction=reduction,
        lr=lr,
        **kw,
    )
    assert_grads_close(got, want, rtol=rtol, atol=atol, msg=f"[{mode} {fn} {style} {reduction} R={R}]")
    return engine, opt, got, want, R
