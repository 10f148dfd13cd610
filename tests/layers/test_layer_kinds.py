"""The layer-kind registry is the only list of kinds: every registered kind (and the generic path) declares oracle
cases that match the brute-force oracle in every clipping mode, a row of the supported-layer table in
docs/reference/layers.md, and its refusal rules, which fastdp.validate reports and the engine refuses.

Adding a kind without cases or a docs row fails :func:`test_every_kind_declares_cases_and_a_docs_row` (its own
failure mode is tested on a kind that declares nothing)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from oracle import (
    FNS,
    MODES,
    assert_grads_close,
    choose_R,
    clipped_sum,
    make_groups,
    max_clip_factor,
    mse_per_sample,
    oracle_model,
    per_sample_grads,
    run_engine_once,
    trainable_names,
    well_conditioned,
)
from torch import nn

import fastdp.layers
from fastdp import PrivacyEngine, validate
from fastdp.layers import registry
from fastdp.layers.base import LayerKind
from fastdp.layers.generic import GENERIC
from fastdp.layers.spec import OracleCase

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reference" / "layers.md"
BEGIN, END = "<!-- supported-layers table:", "<!-- end of supported-layers table -->"


def _metadata_problems(kind: LayerKind) -> list[str]:
    """What a kind lacks of the metadata every kind must declare (empty: nothing)."""
    name = type(kind).__name__
    problems = []
    if not kind.oracle_cases():
        problems.append(f"{name} declares no oracle_cases()")
    if kind.doc is None:
        problems.append(f"{name} declares no doc row")
    elif kind.doc.markdown(kind.refusals) not in _docs_table_in_docs():
        problems.append(f"{name}'s doc row is not in the table of {DOCS.name}")
    problems += [f"{name}'s refusal rule {k} has no summary or no example" for k, r in enumerate(kind.refusals)
                 if not r.summary or r.example is None]
    if type(kind).unsupported_reason is not LayerKind.unsupported_reason:
        problems.append(f"{name} overrides unsupported_reason: declare Refusal rules instead, so validate sees them")
    return problems


def _docs_table_in_docs() -> str:
    text = DOCS.read_text()
    assert BEGIN in text and END in text, f"the generated table's markers are missing from {DOCS}"
    block = text[text.index(BEGIN):text.index(END)]
    return block[block.index("-->") + 3:].strip()


# ------------------------------------------------------------------------------------------- the registry
def test_every_kind_declares_cases_and_a_docs_row():
    kinds = registry.kinds()
    assert len(kinds) >= 9  # Linear, Conv, Embedding, HF Conv1D, LayerNorm, RMSNorm, GroupNorm, InstanceNorm, BN
    problems = [p for kind in (*kinds, GENERIC) for p in _metadata_problems(kind)]
    assert problems == []


def test_the_metadata_check_fails_on_a_kind_that_declares_nothing():
    class Bare(LayerKind):
        module_types = (nn.Bilinear,)

    class Overriding(LayerKind):
        def unsupported_reason(self, module: nn.Module) -> str | None:
            return None

    assert len(_metadata_problems(Bare())) == 2
    assert any("overrides unsupported_reason" in p for p in _metadata_problems(Overriding()))


def test_docs_table_is_generated_from_the_registry():
    want = registry.docs_table()
    assert _docs_table_in_docs() == want, (
        f"the supported-layer table of {DOCS} is out of date; replace the lines between its markers with:\n{want}")


def test_kind_files_are_discovered_and_types_are_unambiguous():
    files = sorted(p.stem for p in (Path(fastdp.layers.__file__).parent / "kinds").glob("*.py") if p.stem != "__init__")
    modules = sorted({type(k).__module__.rpartition(".")[2] for k in registry.kinds()})
    assert modules == files  # every file registers a kind, every kind comes from a file there
    claimed = [t for k in registry.kinds() for t in k.module_types] + [
        n for k in registry.kinds() for n in k.module_type_names]
    assert len(claimed) == len(set(claimed)), claimed
    assert registry.kind_for(nn.Linear(2, 2)) is next(k for k in registry.kinds() if nn.Linear in k.module_types)
    assert registry.kind_for(nn.PReLU()) is None


def test_registering_a_kind_twice_is_refused():
    kind = registry.kind_for(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="LinearKind is already registered"):
        registry.register(type(kind))
    assert sum(type(k) is type(kind) for k in registry.kinds()) == 1


def test_old_import_paths_still_work():
    from fastdp.layers import kind_for, supported_types
    from fastdp.layers.conv import ConvKind, unfold_patches  # noqa: F401
    from fastdp.layers.embedding import EmbeddingKind
    from fastdp.layers.hf_conv1d import HFConv1DKind
    from fastdp.layers.linear import LinearKind
    from fastdp.layers.norms import BatchNormEvalKind, GroupNormKind, InstanceNormKind, LayerNormKind, RMSNormKind

    assert type(kind_for(nn.Conv2d(1, 1, 1))) is ConvKind and type(kind_for(nn.Linear(1, 1))) is LinearKind
    assert type(kind_for(nn.Embedding(2, 1))) is EmbeddingKind
    assert type(kind_for(nn.BatchNorm2d(2))) is BatchNormEvalKind
    for cls in (GroupNormKind, InstanceNormKind, LayerNormKind, RMSNormKind, HFConv1DKind):
        assert any(type(k) is cls for k in registry.kinds())
    assert {"Linear", "Conv2d", "Embedding", "BatchNorm2d", "Conv1D", "RMSNorm"} <= set(supported_types())


# ------------------------------------------------------------------------------------- the refusal rules
RULES = registry.refusals()


@pytest.mark.parametrize("k", range(len(RULES)))
def test_every_rule_is_reported_by_validate_and_refused_by_the_engine(k):
    rule = RULES[k]
    assert rule.example is not None, f"rule {k} ({rule.types}) has no example module"
    module = rule.example()
    assert rule.applies(module) and any(p.requires_grad for p in module.parameters())
    model = nn.Sequential(module)
    assert f"module '0' ({type(module).__name__}) {rule.message(module)}" in validate.find_problems(model)
    with warnings.catch_warnings(), pytest.raises(ValueError, match=r"module '0'") as e:
        warnings.simplefilter("ignore")
        PrivacyEngine(model, batch_size=2, sample_size=10, noise_multiplier=1.0, accountant="rdp")
    if not isinstance(module, nn.modules.batchnorm._BatchNorm) or not module.training:  # the engine's own BN check
        assert rule.message(module) in str(e.value)


def test_generic_path_applies_every_kinds_rules():
    """nn.EmbeddingBag has no kind: its parameters take the generic path, which still refuses max_norm (the forward
    renormalises the looked-up rows in place: a change of the weight from the private data, without noise)."""
    bag = nn.EmbeddingBag(5, 3, max_norm=1.0)
    assert registry.kind_for(bag) is None
    assert "max_norm=1.0" in registry.unsupported_reason(bag)
    assert registry.unsupported_reason(nn.EmbeddingBag(5, 3, sparse=True).requires_grad_(False)) is None
    assert registry.unsupported_reason(nn.EmbeddingBag(5, 3)) is None


# ------------------------------------------------------------------------------------ the oracle cases
CASES = [(kind, case) for kind in (*registry.kinds(), GENERIC) for case in kind.oracle_cases()]


class _First(nn.Module):
    """The case's module; a tuple output (an LSTM's) is read by its first element."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        return out[0] if isinstance(out, tuple) else out


def _runs_empty(model: nn.Module, case: OracleCase) -> bool:
    try:
        with torch.no_grad():
            model(case.inputs(0))
    except (RuntimeError, IndexError):
        return False
    return True


def _model(case: OracleCase) -> nn.Module:
    try:
        return _First(case.module())
    except ImportError as e:  # a kind of an optional package (transformers)
        pytest.skip(f"{case.name}: {e}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("j", range(len(CASES)),
                         ids=[f"{type(k).__name__}-{c.name}" for k, c in CASES])
def test_every_oracle_case_matches_the_oracle(j, mode):
    """One logical step (three physical batches of 1, 0 and 3 samples with sum reduction; 1 and 3 with mean
    reduction or where torch cannot run an empty batch) released with sigma = 0 equals the oracle's clipped sum,
    float64 to 1e-6, with the clipping function and reduction rotating over the grid."""
    kind, case = CASES[j]
    i = MODES.index(mode)
    fn = FNS[(i + j) % len(FNS)]
    reduction = ("sum", "mean")[(i + j) % 2]
    torch.manual_seed(1000 + j)
    model = _model(case)
    if type(kind) is not type(GENERIC):
        assert registry.kind_for(model.layer) is kind, f"{case.name}: {type(model.layer).__name__} is not {kind}"
    names = trainable_names(model)
    sizes = (1, 0, 3) if reduction == "sum" else (1, 3)
    if 0 in sizes and not _runs_empty(model, case):
        sizes = (1, 3)  # torch's own forward refuses an empty batch (InstanceNorm): nothing for the engine to do
    batches = []
    for n in sizes:
        x = case.inputs(n)
        with torch.no_grad():
            out = model(x)
        batches.append((x, torch.randn(out.shape, dtype=torch.float64)))
    om = oracle_model(model)
    psg = per_sample_grads(om, mse_per_sample, batches, names)
    assert well_conditioned(om, mse_per_sample, batches, names, psg), f"{case.name}: rounding-dominated case"
    groups = make_groups(om, "all-layer", names)
    R = choose_R(psg, groups, "middle", gap=1e-6)
    want = clipped_sum(psg, groups, fn, R, 4)
    _, _, got = run_engine_once(model, mse_per_sample, batches, batch_size=4, R=R, fn=fn, style="all-layer",
                                mode=mode, reduction=reduction)
    cmax = max(1.0, max_clip_factor(psg, groups, fn, R))
    assert_grads_close(got, want, rtol=1e-6, atol=1e-10 * cmax, msg=f"[{case.name} {mode} {fn} {reduction}]")


def test_the_cases_cover_batchnorm_eval_and_hf_conv1d():
    """The two kinds the hypothesis grid of tests/oracle.py does not build."""
    names = {type(k).__name__ for k, _ in CASES}
    assert {"BatchNormEvalKind", "HFConv1DKind"} <= names
    assert re.search("bias only", " ".join(c.name for _, c in CASES))


# ------------------------------------------------------------------------------------------- frozen modules
@pytest.mark.parametrize("make", [
    lambda: nn.Embedding(5, 3, max_norm=1.0),
    lambda: nn.EmbeddingBag(5, 3, max_norm=1.0, mode="sum"),
    lambda: nn.InstanceNorm1d(3, affine=True, track_running_stats=True),
], ids=["embedding-max_norm", "embeddingbag-max_norm", "instancenorm-running-stats"])
def test_frozen_module_that_changes_from_private_data_is_refused(make):
    """A frozen module whose forward rewrites its state from the private data (max_norm renormalises rows in place;
    running statistics track the batch) leaks whoever trains: the engine refuses it at construction, naming it."""
    inner = make()
    for p in inner.parameters():
        p.requires_grad_(False)
    full = nn.ModuleDict({"frozen": inner, "head": nn.Linear(3, 2)})
    with pytest.raises(ValueError, match=r"'frozen' .*has no trainable parameter but cannot run"):
        PrivacyEngine(full, batch_size=2, sample_size=10, noise_multiplier=1.0)


def test_frozen_batch_first_false_is_left_to_the_probe():
    """A frozen seq-first attention is a layout its caller may honour by transposing: not refused at construction
    (what it does is checked by the structure probe at the first forward)."""
    full = nn.ModuleDict({"attn": nn.MultiheadAttention(4, 2), "head": nn.Linear(4, 2)})
    for p in full["attn"].parameters():
        p.requires_grad_(False)
    engine = PrivacyEngine(full, batch_size=2, sample_size=10, noise_multiplier=1.0)
    assert [e.name for e in engine.plan.entries] == ["head"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,normalized", [((3, 5, 8), (8,)), ((2, 4, 3, 6), (3, 6)), ((7,), (7,))])
def test_layernorm_normalize_is_the_unweighted_layer_norm(dtype, shape, normalized):
    """``LayerNormKind.normalize`` calls torch's kernel with a weight of ones (the faster CPU path); its ``x_hat``
    must be the affine-free layer norm's, to rounding (observed: bit-identical)."""
    from fastdp.layers.kinds.layernorm import LayerNormKind

    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=dtype) * 3 + 1
    module = nn.LayerNorm(normalized, eps=1e-5, dtype=dtype)
    want = torch.nn.functional.layer_norm(x, normalized, None, None, 1e-5)
    torch.testing.assert_close(LayerNormKind().normalize(module, x), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape,groups", [((1, 4, 5, 5), 2), ((3, 6, 17), 3), ((2, 8, 3, 2, 4), 8), ((5, 6, 4, 4), 1),
                                          ((3, 6, 16), 6)])
def test_groupnorm_folded_grads_are_the_recomputed_ones(shape, groups, monkeypatch):
    """From ``FOLDED_MIN_POSITIONS`` positions the per-sample weight and bias gradients come from one fused backward
    over the batch folded into the channels; they must equal ``sum_s G * x_hat`` and ``sum_s G`` per sample
    (float64, to 1e-10), for a batch of one, 1d/2d/3d inputs, one group and one group per channel."""
    from fastdp.layers.kinds import groupnorm

    torch.manual_seed(1)
    module = nn.GroupNorm(groups, shape[1], eps=1e-4).double()
    x = torch.randn(*shape, dtype=torch.float64) * 2 + 0.7
    G = torch.randn(*shape, dtype=torch.float64)
    kind = groupnorm.GroupNormKind()
    folded = kind.prepare(module, x, G)
    assert isinstance(folded, groupnorm.FoldedGrads)
    monkeypatch.setattr(groupnorm, "FOLDED_MIN_POSITIONS", 0)
    recomputed = kind.prepare(module, x, G)
    assert not isinstance(recomputed, groupnorm.FoldedGrads)
    for name in ("weight", "bias"):
        torch.testing.assert_close(kind.per_sample_grad(module, folded, name),
                                   kind.per_sample_grad(module, recomputed, name), rtol=1e-10, atol=1e-12)


def test_groupnorm_folded_kernel_gets_contiguous_tensors(monkeypatch):
    """Off the CPU, torch's group-norm kernels refuse a non-contiguous input. A sliced input or output gradient
    (``(B, C, L)`` cut along ``L``) folds into a ``(1, B C, L)`` view that is not contiguous: the kernels must get
    contiguous copies, with the same per-sample gradients (the CPU kernel, which accepts the view, checks them)."""
    from fastdp import torch_api
    from fastdp.layers.kinds import groupnorm

    seen = []
    real = torch.native_group_norm

    def checking(x, *args):
        seen.append(x.is_contiguous())
        return real(x, *args)

    monkeypatch.setattr(torch, "native_group_norm", checking)
    module = nn.GroupNorm(2, 4).double()
    x = torch.randn(3, 4, 40, dtype=torch.float64)[:, :, :20]
    G = torch.randn(3, 4, 40, dtype=torch.float64)[:, :, 5:25]
    assert not x.reshape(1, 12, 20).is_contiguous()
    kind = groupnorm.GroupNormKind()
    folded = kind.prepare(module, x, G)
    assert isinstance(folded, groupnorm.FoldedGrads) and seen == [True]
    want = kind.prepare(module, x.contiguous(), G.contiguous())
    for name in ("weight", "bias"):
        torch.testing.assert_close(kind.per_sample_grad(module, folded, name), kind.per_sample_grad(module, want, name),
                                   rtol=1e-12, atol=1e-12)
    assert torch_api.group_norm_affine_grads.__module__ == "fastdp.torch_api"
