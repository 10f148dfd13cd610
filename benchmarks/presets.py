"""The benchmark harness's presets: what ``python benchmarks/run.py --preset NAME`` measures.

A preset names a *kind* of measurement, its workloads (``zoo.Workload``), its methods (``zoo.METHODS``), the
method the ratios are taken against, and its default rounds. Kinds:

* ``steps``: alternating single training steps of every method in one process (median step time and its ratio to
  the base method's median), plus peak memory growth per method in a fresh process when ``memory`` is on;
* ``runs``: alternating whole runs of ``steps`` steps, each with a freshly built model and engine, so one-off
  costs paid in the first steps (the structure probe) are inside the timing; also records ``engine.probe_stats``;
* ``noise``: ``fastdp.noise.gaussian_noise`` against ``secure_gaussian`` on tensors of ``sizes`` elements.

``--quick`` turns every preset into a smoke run: the ``tiny`` width set, sizes 16, batch 2, one round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import zoo

D = zoo.DEFAULT_METHOD
ALL_STEP_METHODS = tuple(m for m in zoo.METHODS if m not in zoo.VARIANTS)


@dataclass(frozen=True)
class Preset:
    """One named measurement. ``workloads``: (model, sizes, batch or None for ``zoo.default_batch``, width set)."""

    name: str
    kind: Literal["steps", "runs", "noise"]
    what: str
    methods: tuple[str, ...] = ()
    workloads: tuple[tuple[str, tuple[int, ...], int | None, str], ...] = ()
    base: str = "non-private"
    reps: int = 5
    warmup: int = 2
    memory: bool = True
    steps: int = 0
    sizes: tuple[int, ...] = field(default=())  # noise: tensor elements
    targets: bool = False  # check the engine issue's targets (the main table)

    def make_workloads(self, models: list[str] | None = None, sizes: list[int] | None = None,
                       batch: int | None = None, quick: bool = False) -> list[zoo.Workload]:
        """The preset's workloads, filtered to ``models``, with ``sizes``/``batch`` replacing the preset's."""
        out = []
        for model, own_sizes, own_batch, widths in self.workloads:
            if models and model not in models:
                continue
            if quick:
                widths = "tiny"
            for s in sizes or ((16,) if quick else own_sizes):
                b = batch or (2 if quick else own_batch or zoo.default_batch(model, s, widths))
                out.append(zoo.Workload(model, s, b, widths))
        return list(dict.fromkeys(out))


def _main_workloads(widths: str) -> tuple[tuple[str, tuple[int, ...], None, str], ...]:
    return tuple((m, zoo.DEFAULT_SIZES[m], None, widths) for m in ("gpt2", "roberta", "vit", "resnet", "tinycls")
                 if m in zoo.WIDTHS[widths])


def _main(name: str, widths: str) -> Preset:
    return Preset(name, "steps", f"every method on every main model and size ({widths} widths)",
                  ALL_STEP_METHODS, _main_workloads(widths), targets=True)


PRESETS: dict[str, Preset] = {p.name: p for p in (
    _main("cpu", "cpu"),
    _main("paper", "paper"),
    Preset("targets", "steps", "the performance targets: the default mode and DP-BiTFiT against non-private "
           "full and BiTFiT training on every main model and size (cpu widths)",
           ("non-private", D, "non-private BiTFiT", "DP-BiTFiT"), _main_workloads("cpu"), targets=True),
    Preset("engine", "steps", "every clipping mode on a language model of plain torch layers (no HF code)",
           ("non-private", *(f"fastdp {m}" for m in zoo.FASTDP_MODES), "non-private BiTFiT", "DP-BiTFiT"),
           (("tinylm", (64,), 32, "cpu"), ("tinylm", (128,), 16, "cpu")), reps=5, warmup=2),
    Preset("models", "steps", "default mode and DP-BiTFiT on larger inputs: GPT-2 at T 128 and 512 (also at "
           "GPT-2-small width), ViT and ResNet at 224x224",
           ("non-private", D, "non-private BiTFiT", "DP-BiTFiT"),
           (("gpt2", (128,), 16, "cpu"), ("vit", (224,), 8, "p16"), ("resnet", (224,), 8, "cpu"),
            ("gpt2", (512,), 8, "cpu"), ("gpt2", (512,), 4, "wide")), reps=3, warmup=1),
    Preset("bitfit-trend", "steps", "DP-BiTFiT against DP and non-private full fine-tuning as T or the image grows",
           ("non-private", D, "DP-BiTFiT"),
           (("gpt2", (64, 128, 256, 512), 8, "cpu"), ("vit", (32, 64, 128, 224), 8, "p16")),
           reps=3, warmup=1, memory=False),
    Preset("on-arrival", "steps", "A/B of instantiation on arrival: the default mode with it on and off",
           ("non-private", D, f"{D}, on arrival off"),
           (("roberta", (256,), 8, "cpu"), ("vit", (64,), 32, "cpu"), ("gpt2", (256,), 8, "cpu")),
           reps=7, warmup=2, memory=False),
    Preset("slack", "steps", "the default mode with INSTANTIATION_SLACK 1 and 1.25 (per-sample gradients up to "
           "1.25x what book-keeping keeps) at GPT-2-small and RoBERTa-base widths, T 512 (a GPU)",
           ("non-private", D, f"{D}, slack 1.25"),
           (("gpt2", (512,), 16, "paper"), ("roberta", (512,), 8, "paper")), reps=5, warmup=2),
    Preset("probe-cost", "runs", "the structure probe's cost: whole runs with and without verify_structure",
           (D, f"{D}, no probe"), (("gpt2", (64,), 16, "probe"), ("cnn", (32,), 16, "cpu")),
           base=f"{D}, no probe", reps=3, warmup=0, memory=False, steps=100),
    Preset("folded", "steps", "a model whose layers see the batch folded into dimension 0 (HF OPT: its MLP and final "
           "norms see (B*T, d)) against GPT-2 of the same width: the default mode, and without the guard against "
           "rows chosen by the data (fastdp.layers.fold_guard)",
           ("non-private", D, f"{D}, no fold guard"),
           (("opt", (64,), 32, "cpu"), ("gpt2", (64,), 32, "cpu"), ("opt", (64,), 32, "tiny")),
           reps=11, warmup=2, memory=False),
    Preset("noise", "noise", "secure-mode noise (secure_gaussian) against the engine's normal noise",
           ("gaussian_noise", "secure_gaussian"), base="gaussian_noise", reps=7, warmup=1, memory=False,
           sizes=(10**5, 10**6, 10**7)),
)}
