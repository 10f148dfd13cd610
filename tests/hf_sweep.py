"""Sweep every transformers architecture that builds from a tiny config through the exact-or-refused rule.

Usage (from the repository root)::

    OMP_NUM_THREADS=1 nice -n 10 python tests/hf_sweep.py --write            # all architectures
    python tests/hf_sweep.py --write --only gpt2,bert,llama --timeout 40     # a few
    python tests/hf_sweep.py --write --limit 50                             # the first 50
    python tests/hf_sweep.py --write --batch 7 --seq 7 --name models_sweep_b_eq_t   # B == T
    python tests/hf_sweep.py --write --mask --name models_sweep_mask                # padding + attention_mask
    python tests/hf_sweep.py --write --mode ghost --name models_sweep_ghost         # another clipping mode
    python tests/hf_sweep.py --write --prefer cls --mask --name models_sweep_cls_mask  # classifier heads, padded

(the docs/results/models_sweep_*.md variants were run with ``--only`` the 221 types that were exact, silent or
refused in the default sweep). A run starts afresh unless ``--resume`` (then it continues its progress file).

Writes ``docs/results/models_sweep.md`` (the table) and ``docs/results/models_sweep.json`` (the raw rows). No
network: every model is built from its config class (``transformers.CONFIG_MAPPING_NAMES``) with shrunk sizes
(hidden 16, 2 layers, 2 heads, vocabulary 64, feed-forward 32, dropout 0), in float64 where the model runs in
float64 (else float32), in ``eval()`` mode. The head is, in this order of preference, the architecture's causal LM,
seq2seq LM, sequence classifier, else its base model. Per-sample losses come from the outputs (never the model's
``labels=`` loss):

* causal LM: mean next-token cross-entropy over the sample's own 6 shifted tokens;
* seq2seq LM: mean cross-entropy of the sample's 5 decoder logits against random labels;
* classifier: cross-entropy of the sample's logits (5 labels);
* base model: mean over the sample's tokens of ``<h_t, w>`` for a fixed random ``w`` (last hidden state).

Batch: 3 samples of 7 tokens by default (``--batch``, ``--seq``; ids >= 2; no padding unless ``--mask``: sample i
then has i % 3 right-padded tokens (id 0) and the attention mask, and the losses average over its own tokens).
Outcomes per architecture:

* ``exact``: the engine (BK-MixOpt or ``--mode``, abadi, all-layer, noise 0) released the oracle's clipped sum,
  whole-gradient relative error <= max(1e-6, 100 * control error);
* ``refused``: the engine raised, naming a module or parameter of the model (first line of the message);
* ``engine-crash``: the engine raised with a message that names nothing of the model (an internal error);
* ``silent``: released but wrong (relative error given);
* ``crash-in-model``: the model fails without the engine (forward or backward; exception type and where);
* ``control-failed``: plain autograd's per-sample gradients (batches of one) do not sum to the batched gradient
  (relative error > 1e-4): the model couples samples, not the engine's fault;
* ``build-failed``: the tiny config or the model could not be built; ``timeout``: over the per-model limit.

Each architecture runs in a worker process under ``signal.alarm``; the parent restarts the worker if it dies or
hangs. The rule itself is :mod:`layout_oracle` (tests/layout_oracle.py).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = ROOT / "docs" / "results"  # where --write puts the tables and the raw rows
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

# batch and sequence length: --batch / --seq (passed to the workers through the environment)
B, T = int(os.environ.get("HF_SWEEP_BATCH", "3")), int(os.environ.get("HF_SWEEP_SEQ", "7"))
MODE = os.environ.get("HF_SWEEP_MODE", "BK-MixOpt")  # --mode
PREFER = os.environ.get("HF_SWEEP_PREFER", "")  # --prefer cls: the sequence classifier first
MASK = os.environ.get("HF_SWEEP_MASK", "") == "1"  # --mask: right padding (sample i: i % 3 pads) + attention_mask
T_DEC, VOCAB, HID, LABELS = 5, 64, 16, 5

SIZES = {
    "hidden_size": HID, "n_embd": HID, "d_model": HID, "dim": HID, "embed_dim": HID, "embedding_size": HID,
    "word_embed_proj_dim": HID, "projection_dim": HID,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "num_decoder_layers": 2, "num_encoder_layers": 2,
    "num_attention_heads": 2, "n_head": 2, "n_heads": 2, "num_heads": 2, "encoder_attention_heads": 2,
    "decoder_attention_heads": 2, "num_key_value_heads": 1, "head_dim": HID // 2, "d_kv": HID // 2,
    "attention_head_dim": HID // 2, "kv_channels": HID // 2,
    "intermediate_size": 32, "n_inner": 32, "ffn_dim": 32, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "d_ff": 32,
    "hidden_dim": 32, "dim_feedforward": 32, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "vocab_size": VOCAB, "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "max_seq_len": 64,
    "rotary_dim": 4, "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "n_routed_experts": 4,
    "num_labels": LABELS, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1, "decoder_start_token_id": 1,
    "sep_token_id": 1, "cls_token_id": 1, "layerdrop": 0.0, "type_vocab_size": 2,
    "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16,
}


# --------------------------------------------------------------------------- building


def list_archs() -> list[tuple[str, str, str]]:
    """(model_type, head, class name) for every model type with a text head, in CONFIG_MAPPING_NAMES order."""
    from transformers.models.auto import configuration_auto as ca
    from transformers.models.auto import modeling_auto as ma

    heads = [("causal", ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), ("s2s", ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
             ("cls", ma.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES), ("base", ma.MODEL_MAPPING_NAMES)]
    if PREFER:
        heads.sort(key=lambda h: h[0] != PREFER)
    out = []
    for mt in ca.CONFIG_MAPPING_NAMES:
        for head, mapping in heads:
            if mt in mapping:
                cls = mapping[mt]
                cls = cls[0] if isinstance(cls, (tuple, list)) else cls
                out.append((mt, head, cls))
                break
    return out


def _shrink_kwargs(cfg_cls) -> dict:
    params = set(inspect.signature(cfg_cls.__init__).parameters) | set(getattr(cfg_cls, "attribute_map", {}))
    try:
        default = cfg_cls()
    except Exception:  # noqa: BLE001
        default = None
    kw = {k: v for k, v in SIZES.items() if k in params}
    for k in list(vars(default) if default is not None else []) + list(params):
        v = getattr(default, k, None)
        if ("dropout" in k or "pdrop" in k or k.endswith("_drop")) and isinstance(v, float):
            kw[k] = 0.0
    return kw


def tiny_config(model_type: str):
    """The model type's config with the sizes of ``SIZES`` (where its __init__ takes them), dropout 0, eager
    attention; sub-configs (``text_config``, ``vision_config``, ...) shrunk the same way."""
    from transformers import CONFIG_MAPPING, PretrainedConfig

    cfg_cls = CONFIG_MAPPING[model_type]
    kw = _shrink_kwargs(cfg_cls)
    kw["num_labels"] = LABELS  # a generic PretrainedConfig argument
    kw["attn_implementation"] = "eager"
    kw["experts_implementation"] = "eager"  # MoE: torch's grouped_mm has no float64 kernel
    cfg = cfg_cls(**kw)
    for name, sub in list(vars(cfg).items()):
        if isinstance(sub, PretrainedConfig):
            try:
                skw = _shrink_kwargs(type(sub))
                new = type(sub)(**skw)
                new._attn_implementation = "eager"
                new._experts_implementation = "eager"
                setattr(cfg, name, new)
            except Exception:  # noqa: BLE001 - keep the default sub-config; the size guard catches what is too big
                pass
    return cfg


MAX_PARAMS = 3_000_000


def _count_on_meta(cls, cfg) -> int | None:
    import torch

    try:
        with torch.device("meta"):
            m = cls(cfg)
        return sum(p.numel() for p in m.parameters())
    except Exception:  # noqa: BLE001
        return None


class Wrap:
    pass


def _wrap_cls():
    import torch
    from torch import nn

    class HFWrap(nn.Module):
        """model(ids[, dec][, mask]) -> logits or last hidden state; parameter names get the prefix ``m.``."""

        def __init__(self, m, head):
            super().__init__()
            self.m, self.head = m, head

        def forward(self, ids, *rest):
            dec = rest[0] if self.head == "s2s" else None
            rest = rest[1:] if self.head == "s2s" else rest
            kw = {"attention_mask": rest[0]} if rest else {}
            if self.head == "s2s":
                out = self.m(input_ids=ids, decoder_input_ids=dec, use_cache=False, **kw)
            elif self.head == "causal":
                out = self.m(input_ids=ids, use_cache=False, **kw)
            else:
                out = self.m(input_ids=ids, **kw)
            if self.head in ("causal", "s2s", "cls"):
                return out.logits
            h = getattr(out, "last_hidden_state", None)
            if h is None:
                h = out[0]
            return h

    del torch
    return HFWrap


def build(model_type: str, head: str, cls_name: str, dtype):
    import torch
    import transformers

    cfg = tiny_config(model_type)
    cls = getattr(transformers, cls_name)
    n = _count_on_meta(cls, cfg)
    if n is not None and n > MAX_PARAMS:
        raise ValueError(f"still {n} parameters after shrinking the config (limit {MAX_PARAMS})")
    torch.manual_seed(0)
    model = cls(cfg)
    model = _wrap_cls()(model, head).to(dtype)
    model.eval()
    return model, cfg


def make_data(head: str, cfg, dtype, hdim: int | None):
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    vocab = int(getattr(cfg, "vocab_size", None) or VOCAB)
    ids = torch.randint(2, max(3, min(vocab, VOCAB)), (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if MASK:
        for i in range(B):
            if i % 3:
                mask[i, T - i % 3:] = 0
        ids = ids.masked_fill(mask == 0, 0)  # pad_token_id 0
    extra = (mask,) if MASK else ()
    if head == "causal":
        tgt_ids = ids.masked_fill(mask == 0, -100)

        def loss(lg, tgt):  # mean over the sample's own (non-pad) shifted tokens
            n, t, v = lg.shape
            ce = F.cross_entropy(lg[:, :-1].reshape(-1, v).double(), tgt[:, 1:].reshape(-1), reduction="none",
                                 ignore_index=-100).reshape(n, t - 1)
            return ce.sum(1) / (tgt[:, 1:] != -100).sum(1).clamp(min=1)
        return [((ids, *extra), tgt_ids)], loss
    if head == "s2s":
        dec = torch.randint(2, max(3, min(vocab, VOCAB)), (B, T_DEC), generator=g)
        lab = torch.randint(2, max(3, min(vocab, VOCAB)), (B, T_DEC), generator=g)

        def loss(lg, tgt):
            n, t, v = lg.shape
            return F.cross_entropy(lg.reshape(-1, v).double(), tgt.reshape(-1), reduction="none").reshape(n, t).mean(1)
        return [((ids, dec, *extra), lab)], loss
    if head == "cls":
        y = torch.randint(0, LABELS, (B,), generator=g)

        def loss(lg, tgt):
            return F.cross_entropy(lg.double(), tgt, reduction="none")
        return [((ids, *extra), y)], loss
    w = torch.randn(hdim, generator=g, dtype=torch.float64)

    def loss(h, tgt):  # mean of <h_t, w> over the sample's own tokens (tgt: the mask as weights)
        h = (h.double() * w).sum(-1).reshape(h.shape[0], -1)
        if h.shape[1] != tgt.shape[1]:  # hidden states not per token (pooled, downsampled): all positions
            return h.mean(1)
        return (h * tgt).sum(1) / tgt.sum(1).clamp(min=1)
    return [((ids, *extra), mask.double())], loss


def _where(tb) -> str:
    frames = traceback.extract_tb(tb)
    if not frames:
        return ""
    f = frames[-1]
    return f"{Path(f.filename).name}:{f.lineno} {f.name}"


def _first_line(s: str, n: int = 200) -> str:
    s = (s.strip().splitlines() or [""])[0]
    return s[:n]


class _Timeout(Exception):
    pass


def run_one(model_type: str, head: str, cls_name: str) -> dict:
    """One architecture through build, plain-autograd control and the engine (see the module docstring)."""
    import torch
    from layout_oracle import _rel, control_error, useful_names
    from oracle import (
        call_model,
        choose_R,
        clipped_sum,
        make_groups,
        oracle_model,
        per_sample_grads,
        run_engine_once,
        trainable_names,
    )

    row = {"arch": model_type, "head": head, "class": cls_name, "outcome": "", "detail": "", "rel_err": None,
           "control_err": None, "dtype": "", "params": None}
    t0 = time.time()
    try:
        model = cfg = None
        errs: list = []
        for dtype in (torch.float64, torch.float32):
            stage = "forward"
            try:
                model, cfg = build(model_type, head, cls_name, dtype)
                hdim = None
                if head == "base":
                    with torch.no_grad():
                        hdim = call_model(model, (torch.randint(2, 10, (1, T)),)).shape[-1]
                batches, loss = make_data(head, cfg, dtype, hdim)
                with torch.no_grad():
                    out = call_model(model, batches[0][0])
                    loss(out, batches[0][1])
                stage = "backward"
                names = trainable_names(model)
                om = oracle_model(model) if dtype == torch.float64 else copy.deepcopy(model)
                psg = per_sample_grads(om, loss, batches, names)
                ctrl = control_error(om, loss, batches, psg, names)
                row["dtype"] = str(dtype).replace("torch.", "")
                break
            except _Timeout:
                raise
            except Exception as e:  # noqa: BLE001 - float64 may be what fails: try float32
                errs.append((e, sys.exc_info()[2], stage))
                model = None
        if model is None:
            e, tb, stage = errs[0]  # the float64 attempt's error; the float32 one after it
            kind = "build-failed" if cfg is None else "crash-in-model"
            where = "" if kind == "build-failed" else f"{stage}: "
            detail = f"{where}{type(e).__name__} at {_where(tb)}: {_first_line(str(e))}"
            if len(errs) > 1 and str(errs[1][0]) != str(e):
                detail += f" [float32: {errs[1][2]}: {type(errs[1][0]).__name__}: {_first_line(str(errs[1][0]), 80)}]"
            row.update(outcome=kind, detail=detail)
            return row
        row["params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        row["control_err"] = ctrl
        if not math.isfinite(ctrl) or ctrl > 1e-4:
            row.update(outcome="control-failed", detail=f"sum of batch-of-one grads vs batched: rel err {ctrl:.3g}")
            return row
        groups = make_groups(om, "all-layer", names)
        R = choose_R(psg, groups, "middle", gap=1e-3)
        want = clipped_sum(psg, groups, "abadi", R, B)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            _e, _o, got = run_engine_once(model, loss, batches, batch_size=B, R=R, fn="abadi", style="all-layer",
                                          mode=MODE, reduction="mean")
        except _Timeout:
            raise
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
            named = any(s in msg for s in useful_names(model))
            kind = "silent" if moved else ("refused" if named else "engine-crash")
            row.update(outcome=kind, detail=f"{type(e).__name__} at {_where(sys.exc_info()[2])}: {_first_line(msg)}"
                       + (f" (after releasing: {moved[:3]} moved)" if moved else ""))
            return row
        rel = _rel(got, want, names)
        row["rel_err"] = rel
        tol = max(1e-6, 100 * ctrl)
        if rel <= tol:
            row.update(outcome="exact", detail=f"rel err {rel:.2g} (tol {tol:.2g})")
        else:
            worst = max(names, key=lambda n: float((got[n].double() - want[n].double()).norm()))
            wrel = float((got[worst].double() - want[worst].double()).norm()) / max(1e-300, float(
                want[worst].double().norm()))
            row.update(outcome="silent", detail=f"rel err {rel:.3g} (tol {tol:.2g}); largest error in {worst} "
                       f"(its rel err {wrel:.2g})")
        return row
    except _Timeout:
        row.update(outcome="timeout", detail="over the per-model limit")
        return row
    finally:
        row["seconds"] = round(time.time() - t0, 1)


# --------------------------------------------------------------------------- worker / parent


def worker(out_path: str, items: list[str], limit: int) -> None:
    """Run architectures ``mt:head:cls`` in order, one JSON line each (a ``started`` line before)."""
    from model_oracle import quiet_transformers

    quiet_transformers()
    import warnings

    warnings.simplefilter("ignore")
    import logging

    logging.disable(logging.WARNING)

    def on_alarm(*_):
        raise _Timeout()

    signal.signal(signal.SIGALRM, on_alarm)
    import resource

    gib = 2**30
    resource.setrlimit(resource.RLIMIT_AS, (6 * gib, 6 * gib))  # a model that did not shrink must not eat the machine
    with open(out_path, "a") as f:
        for it in items:
            mt, head, cls = it.split(":")
            f.write(json.dumps({"started": mt}) + "\n")
            f.flush()
            signal.alarm(limit)
            try:
                row = run_one(mt, head, cls)
            except _Timeout:
                row = {"arch": mt, "head": head, "class": cls, "outcome": "timeout", "detail": "over the limit"}
            except BaseException as e:  # noqa: BLE001
                row = {"arch": mt, "head": head, "class": cls, "outcome": "crash-in-model",
                       "detail": f"uncaught {type(e).__name__}: {_first_line(str(e))}"}
            finally:
                signal.alarm(0)
            f.write(json.dumps(row) + "\n")
            f.flush()


def sweep(items: list[tuple[str, str, str]], limit: int, progress: Path) -> list[dict]:
    """Run every item in worker processes; restart after a worker dies or hangs (that item: timeout/crash)."""
    rows: dict[str, dict] = {}
    if progress.exists():  # resume
        for line in progress.read_text().splitlines():
            d = json.loads(line)
            if "outcome" in d:
                rows[d["arch"]] = d
    todo = [it for it in items if it[0] not in rows]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    while todo:
        args = [sys.executable, str(Path(__file__).resolve()), "--worker", str(progress), "--timeout", str(limit),
                *[":".join(it) for it in todo]]
        p = subprocess.Popen(args, env=env, cwd=str(ROOT))
        last, size = time.time(), progress.stat().st_size if progress.exists() else 0
        while p.poll() is None:
            time.sleep(2)
            s = progress.stat().st_size if progress.exists() else 0
            if s != size:
                size, last = s, time.time()
            elif time.time() - last > limit + 90:
                p.kill()
                p.wait()
                break
        started = None
        for line in progress.read_text().splitlines() if progress.exists() else []:
            d = json.loads(line)
            if "started" in d:
                started = d["started"]
            elif "outcome" in d:
                rows[d["arch"]] = d
                started = None
        if started is not None and started not in rows:
            it = next(i for i in todo if i[0] == started)
            rc = p.returncode
            kind = "timeout" if rc in (-9, None) else "crash-in-model"
            rows[started] = {"arch": started, "head": it[1], "class": it[2], "outcome": kind,
                             "detail": f"worker died (exit {rc})"}
            with open(progress, "a") as f:
                f.write(json.dumps(rows[started]) + "\n")
        todo = [it for it in todo if it[0] not in rows]
    return [rows[it[0]] for it in items if it[0] in rows]


ORDER = ["exact", "refused", "engine-crash", "silent", "control-failed", "crash-in-model", "build-failed", "timeout"]


def write_table(rows: list[dict], md: Path, js: Path, total: int, name: str = "models_sweep", subset: bool = False
                ) -> None:
    import torch
    import transformers

    js.write_text(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__, "batch": B,
                              "seq": T, "rows": rows},
                             indent=1) + "\n")
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ORDER}
    lines = [
        "# Hugging Face architecture sweep: exact or refused, never silent",
        "",
        "Generated by `python tests/hf_sweep.py --write"
        + ("" if (B, T, MODE, MASK, PREFER) == (3, 7, "BK-MixOpt", False, "")
           else f" --batch {B} --seq {T} --mode {MODE}{' --mask' if MASK else ''}"
           f"{' --prefer ' + PREFER if PREFER else ''} --name {name}")
        + f"` (transformers {transformers.__version__}, torch "
        f"{torch.__version__}); raw rows in `docs/results/{name}.json`. How the models, batches and losses are built "
        f"and what each outcome means: the docstring of `tests/hf_sweep.py`. Engine: {MODE}, abadi, all-layer, "
        f"noise 0, R between the per-sample norms (some samples clipped), batch of {B} samples x {T} tokens.",
        "",
        f"Covered {len(rows)} of {total} model types (each with its first auto class of: causal LM, seq2seq LM, "
        "sequence classifier, base model; vision and audio models fail for want of their inputs)"
        + ("; a subset chosen with --only." if subset else "."),
        "",
        "| outcome | count |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in counts.items()],
        "",
        "| architecture | head | class | dtype | outcome | rel err | control err | detail |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def fmt(v):
        return "" if v is None else f"{v:.2g}"

    for r in sorted(rows, key=lambda r: (ORDER.index(r["outcome"]) if r["outcome"] in ORDER else 99, r["arch"])):
        det = str(r.get("detail", "")).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['arch']} | {r.get('head', '')} | {r.get('class', '')} | {r.get('dtype', '')} | "
                     f"{r['outcome']} | {fmt(r.get('rel_err'))} | {fmt(r.get('control_err'))} | {det} |")
    md.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write docs/results/models_sweep.md and .json")
    ap.add_argument("--only", default="", help="comma-separated model types")
    ap.add_argument("--limit", type=int, default=0, help="only the first N architectures")
    ap.add_argument("--timeout", type=int, default=60, help="seconds per architecture")
    ap.add_argument("--progress", default=None,
                    help="JSON-lines progress file (default: a file under the temporary directory named after --name)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows already in the progress file (default: start afresh, so that rows from an "
                         "older engine are never mixed in)")
    ap.add_argument("--batch", type=int, default=B, help="samples per batch (default 3)")
    ap.add_argument("--seq", type=int, default=T, help="tokens per sample (default 7; --batch 7 --seq 7: B == T)")
    ap.add_argument("--mode", default=MODE, help="clipping mode (default BK-MixOpt)")
    ap.add_argument("--mask", action="store_true", default=MASK, help="right padding with an attention_mask")
    ap.add_argument("--prefer", default=PREFER, choices=["", "causal", "s2s", "cls", "base"],
                    help="the head to take first where a model type has it (default: causal, s2s, cls, base)")
    ap.add_argument("--name", default="models_sweep", help="output docs/results/NAME.md and .json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("items", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker, a.items, a.timeout)
        return 0
    if (a.batch, a.seq, a.mode, a.mask, a.prefer) != (B, T, MODE, MASK, PREFER):  # re-run, settings in the env
        env = dict(os.environ, HF_SWEEP_BATCH=str(a.batch), HF_SWEEP_SEQ=str(a.seq), HF_SWEEP_MODE=a.mode,
                   HF_SWEEP_MASK="1" if a.mask else "", HF_SWEEP_PREFER=a.prefer)
        return subprocess.call([sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:])], env=env)
    items = list_archs()
    total = len(items)
    if a.only:
        want = set(a.only.split(","))
        items = [it for it in items if it[0] in want]
    if a.limit:
        items = items[: a.limit]
    import tempfile

    progress = Path(a.progress or Path(tempfile.gettempdir()) / f"hf_sweep_{a.name}.progress.jsonl")
    if not a.resume and progress.exists():
        progress.unlink()
    rows = sweep(items, a.timeout, progress)
    for r in rows:
        print(f"{r['arch']:30s} {r['outcome']:15s} {str(r.get('detail', ''))[:150]}")
    if a.write:
        write_table(rows, RESULTS / f"{a.name}.md", RESULTS / f"{a.name}.json", total, a.name, bool(a.only))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
