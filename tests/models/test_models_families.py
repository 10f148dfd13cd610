"""Oracle suite for the model families of issue 12 (found exact by a one-off red-team run, now tested here).

Every case: σ = 0, one engine step against the brute-force oracle (one backward per sample on a float64 copy,
clip, sum; ``model_oracle.check_engine``, which first checks that the oracle's per-sample gradients add up to the
batched gradient and that clipping changes the result by more than 1000x the tolerance).

* Hugging Face decoders: Mistral (also with a sliding window), Qwen2, Gemma (grouped-query attention, rotary), Phi
  (partial rotary), BLOOM (ALiBi); causal LM with :func:`fastdp.losses.causal_lm_loss` on the logits, attention
  masks of different lengths per sample (right padding), padded labels -100.
* Encoders: DistilBERT, ELECTRA, ALBERT (one layer applied twice) sequence classification.
* Vision / multimodal / audio: HF ViT image classification; CLIP, both towers, with a per-sample loss on the
  scaled cosine of each sample's own image and text embeddings (no in-batch negatives); Whisper encoder-decoder
  with :func:`fastdp.losses.seq2seq_loss`.
* timm ConvNeXt, MobileNetV3, EfficientNet at 16x16 images, BatchNorm in eval mode (running statistics randomised)
  with frozen BN parameters, or BN parameters trainable, or BN replaced by ``fastdp.validate.fix``.
* Activation checkpointing (HF ``gradient_checkpointing_enable`` non-reentrant; ``torch.utils.checkpoint`` with
  ``use_reentrant=False``), a block reused at several sequence lengths in one forward, every Conv padding mode.

Batch sizes: each family has a batch size ``b`` equal to no dimension of the model or its inputs (checked by
``test_batch_sizes_are_what_they_claim``), run as the physical batches ``[b, 1]`` (so batch size 1 and gradient
accumulation are covered), and a batch size ``b_eq`` equal to the sequence length (or, for convolutional nets, the
number of channels / a spatial size). Every family runs in all five clipping modes, each mode with its own
clipping function, style and loss reduction (``MODE_CONFIG``).

Out of scope / refused: CLIP's contrastive loss mixes samples. The engine refuses a model that returns the
``(B, B)`` similarity logits (structure probe). A contrastive loss computed by the user from per-sample
embeddings cannot be detected (documented in docs/internals/engine.md) and is not tested. The models' own
``return_loss=True`` loss (CLIPModel, SiglipModel) is refused by fastdp.hf_guard (it broke the sensitivity bound).

Tolerance: 1e-6 relative (float64). Families that run their softmax or RMS-norm in float32 even with float64
weights (``F32``: the HF decoders and ViT, eager attention) get, per parameter, an absolute tolerance of 1e-6 times
its largest gradient entry (as ``model_oracle.F32_INSIDE``). CLIP runs with sdpa attention, float64 throughout: with
the eager float32 softmax its key-projection biases, whose gradient is zero in exact arithmetic (softmax is shift
invariant), hold only float32 rounding noise (~1e-9) that no relative tolerance can compare.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from model_oracle import (  # noqa: E402
    FFN,
    HID,
    LABELS,
    T_CLS,
    T_DEC,
    T_LM,
    ClsWrap,
    D,
    LMWrap,
    V,
    _padded,
    _tf,
    albert,
    bert,
    bloom,
    check_engine,
    cls_batches,
    distilbert,
    electra,
    gemma,
    mistral,
    oracle_for,
    padded_lm_batches,
    phi,
    quiet_transformers,
    qwen2,
    roberta,
)
from oracle import MODES, call_model, choose_R, clipped_sum, engine_step, make_engine, released_grads  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.modules.batchnorm import _BatchNorm  # noqa: E402

import fastdp  # noqa: E402
import fastdp.losses as losses  # noqa: E402

quiet_transformers()

# mode -> (clipping function, style, loss reduction): every mode, function, style and reduction appears.
MODE_CONFIG = {
    "BK-MixOpt": ("abadi", "all-layer", "mean"),
    "BK-MixGhostClip": ("global", "layer-wise", "mean"),
    "BK-ghost": ("automatic", "layer-wise", "sum"),
    "ghost": ("abadi", "param-wise", "mean"),
    "instantiate": ("automatic", "all-layer", "sum"),
}
F32 = {"atol_rel": 1e-6}  # float32 softmax / RMS-norm inside a float64 model


def causal_loss(logits, labels):
    return losses.causal_lm_loss(logits, labels)


def seq2seq_loss(logits, labels):
    return losses.seq2seq_loss(logits, labels)


def cls_loss(logits, y):
    return losses.sequence_classification_loss(logits, y)


def _ce(logits, y):
    return F.cross_entropy(logits, y, reduction="none")


# --------------------------------------------------------------------------- wrappers and builders


class ImageCls(nn.Module):
    """HF image classifier -> logits (B, num_labels)."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, pixel_values):
        return self.m(pixel_values=pixel_values).logits


class ClipPair(nn.Module):
    """CLIP, both towers: per-sample score ``exp(logit_scale) * cos(image_i, text_i)`` -> (B,). Each sample is an
    (image, caption) pair and only its own pair is scored (no in-batch negatives)."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, pixel_values, input_ids, attention_mask):
        img = self.m.get_image_features(pixel_values=pixel_values)
        txt = self.m.get_text_features(input_ids=input_ids, attention_mask=attention_mask)
        img = getattr(img, "pooler_output", img)
        txt = getattr(txt, "pooler_output", txt)
        return F.cosine_similarity(img, txt, dim=-1) * self.m.logit_scale.exp()


def clip_pair_loss(score, match):
    """Per-sample logistic loss: does caption i describe image i (``match`` 1.0 / 0.0)? (B,) -> (B,)."""
    return F.binary_cross_entropy_with_logits(score - 1.0, match, reduction="none")


class WhisperWrap(nn.Module):
    """Whisper -> decoder logits (B, T_dec, V)."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, input_features, decoder_input_ids):
        return self.m(input_features=input_features, decoder_input_ids=decoder_input_ids, use_cache=False).logits


IMG = 12  # HF ViT / CLIP image size; patch 4 -> 9 patches + class token = 10 tokens
MEL, FRAMES = 4, 10  # Whisper: 4 mel bins x 10 frames -> 5 encoder positions (two convs, the second of stride 2)


def hf_vit():
    tf = _tf()
    cfg = tf.ViTConfig(image_size=IMG, patch_size=4, num_channels=3, hidden_size=HID, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=FFN, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, num_labels=LABELS, attn_implementation="eager")
    return ImageCls(tf.ViTForImageClassification(cfg))


def clip():
    tf = _tf()
    tc = dict(vocab_size=V, hidden_size=HID, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=2,
              max_position_embeddings=16, dropout=0.0, attention_dropout=0.0)
    vc = dict(hidden_size=HID, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=2, image_size=IMG,
              patch_size=4, dropout=0.0, attention_dropout=0.0)
    cfg = tf.CLIPConfig(text_config=tc, vision_config=vc, projection_dim=12)
    cfg._attn_implementation = "sdpa"  # float64 throughout (the eager path takes its softmax in float32)
    return tf.CLIPModel(cfg)


def siglip():
    """SigLIP (sigmoid image-text loss over every pair of the batch); used only for the return_loss case."""
    tf = _tf()
    tc = dict(vocab_size=V, hidden_size=HID, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=2,
              max_position_embeddings=16, attention_dropout=0.0)
    vc = dict(hidden_size=HID, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=2, image_size=IMG,
              patch_size=4, attention_dropout=0.0)
    return tf.SiglipModel(tf.SiglipConfig(text_config=tc, vision_config=vc))


def whisper():
    tf = _tf()
    cfg = tf.WhisperConfig(vocab_size=V, num_mel_bins=MEL, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=FFN,
                           decoder_ffn_dim=FFN, d_model=HID, max_source_positions=FRAMES // 2, max_target_positions=8,
                           dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
                           decoder_start_token_id=1, eos_token_id=2, bos_token_id=1, attn_implementation="eager")
    return WhisperWrap(tf.WhisperForConditionalGeneration(cfg))


def timm_convnext():
    from timm.models.convnext import ConvNeXt

    # patch 2, 16x16 -> 8x8 -> 4x4 -> 2x2, then dilation (output_stride 8); layer scale 0.5 so the blocks matter
    return ConvNeXt(num_classes=LABELS, depths=(1, 1, 1, 1), dims=(8, 8, 12, 16), kernel_sizes=3, patch_size=2,
                    ls_init_value=0.5, output_stride=8)


def hf_swin():
    """16x16 images, patch 4: 4x4 patches cut into windows of 2x2 (4 windows per image: the window attention sees
    the batch folded into its rows, 4 per sample), two blocks per stage (the second with shifted windows and their
    mask), then patch merging to one 2x2 window."""
    tf = _tf()
    cfg = tf.SwinConfig(image_size=16, patch_size=4, num_channels=3, embed_dim=8, depths=[2, 2], num_heads=[1, 2],
                        window_size=2, num_labels=LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        drop_path_rate=0.0)
    return tf.SwinForImageClassification(cfg)


def timm_swin():
    from timm.models.swin_transformer import SwinTransformer

    return SwinTransformer(img_size=16, patch_size=4, window_size=2, embed_dim=8, depths=(2, 2), num_heads=(1, 2),
                           num_classes=LABELS, drop_path_rate=0.0)


CHOICES = 3


def _multiple_choice(make):
    """A ``…ForMultipleChoice`` model of the same tiny size: ``(B, C, T)`` ids folded to ``(B C, T)`` inside."""
    def build():
        tf = _tf()
        base = make()
        cls = getattr(tf, type(base).__name__.replace("ForSequenceClassification", "ForMultipleChoice"))
        return cls(base.config)
    return build


class DoubleHeads(nn.Module):
    """HF ``GPT2DoubleHeadsModel`` -> its multiple-choice logits ``(B, C)``: each choice's hidden state read at its
    ``mc_token_ids`` position (a gather after the fold) and scored."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, ids, tok):
        return self.m(input_ids=ids, mc_token_ids=tok).mc_logits


def gpt2_double_heads():
    tf = _tf()
    return tf.GPT2DoubleHeadsModel(tf.GPT2Config(vocab_size=V, n_embd=HID, n_layer=2, n_head=2, n_positions=16,
                                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                 summary_first_dropout=0.0, attn_implementation="eager"))


def double_heads_batches(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randint(2, V, (n, CHOICES, T_CLS), generator=g),
              torch.randint(1, T_CLS, (n, CHOICES), generator=g)), torch.randint(0, CHOICES, (n,), generator=g))
            for n in sizes]


def mc_batches(sizes, seed):
    """``CHOICES`` answers of ``T_CLS`` tokens per sample (right padding of 0-2 tokens per answer), the label the
    right answer."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        ids, mask = _padded(torch.randint(2, V, (n * CHOICES, T_CLS), generator=g), 0, g)
        out.append(((ids.view(n, CHOICES, T_CLS), mask.view(n, CHOICES, T_CLS)),
                    torch.randint(0, CHOICES, (n,), generator=g)))
    return out


def mamba():
    """HF Mamba: its mixer reads its causal convolution's weight directly (``F.conv1d(x, self.conv1d.weight)``), a
    use outside the ``nn.Conv1d``'s call; the structure probe gives that weight to the mixer (the generic path),
    which owns ``A_log``, ``D`` and replays the selective scan per sample."""
    tf = _tf()
    return tf.MambaForCausalLM(tf.MambaConfig(vocab_size=V, hidden_size=HID, state_size=5, num_hidden_layers=2,
                                              expand=2, conv_kernel=4, time_step_rank=4, use_cache=False))


def timm_mobilenetv3():
    from timm.models._efficientnet_blocks import SqueezeExcite
    from timm.models._efficientnet_builder import decode_arch_def, round_channels
    from timm.models.mobilenetv3 import MobileNetV3

    arch = [["ds_r1_k3_s2_e1_c8_se0.25_nre"], ["ir_r1_k3_s2_e3_c8_nre"], ["ir_r1_k5_s2_e3_c16_se0.25"]]
    se = partial(SqueezeExcite, gate_layer="hard_sigmoid", force_act_layer=nn.ReLU, rd_round_fn=round_channels)
    return MobileNetV3(decode_arch_def(arch), num_classes=LABELS, stem_size=8, num_features=24, act_layer=nn.Hardswish,
                       se_layer=se)


def timm_efficientnet():
    from timm.models._efficientnet_builder import decode_arch_def
    from timm.models.efficientnet import EfficientNet

    arch = [["ds_r1_k3_s1_e1_c8_se0.25"], ["ir_r1_k3_s2_e4_c12_se0.25"], ["ir_r1_k5_s2_e4_c16_se0.25"]]
    return EfficientNet(decode_arch_def(arch), num_classes=LABELS, stem_size=8, num_features=24, act_layer=nn.SiLU)


def bn_eval(model: nn.Module, *, freeze: bool) -> nn.Module:
    """Train mode, except every BatchNorm: eval mode (random running statistics), parameters frozen or not."""
    model.train()
    g = torch.Generator().manual_seed(3)
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            m.eval()
            with torch.no_grad():
                m.running_mean.copy_(0.3 * torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(0.5 + 1.5 * torch.rand(m.running_var.shape, generator=g))
            for p in m.parameters(recurse=False):
                p.requires_grad_(not freeze)
    return model


def bn_fixed(model: nn.Module) -> nn.Module:
    return fastdp.validate.fix(model).train()


# --------------------------------------------------------------------------- batches


def images(sizes, seed, hw=IMG):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(n, 3, hw, hw, generator=g, dtype=D),), torch.randint(0, LABELS, (n,), generator=g))
            for n in sizes]


def clip_batches(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        px = torch.randn(n, 3, IMG, IMG, generator=g, dtype=D)
        ids, mask = _padded(torch.randint(2, V, (n, T_CLS), generator=g), 0, g)
        out.append(((px, ids, mask), torch.randint(0, 2, (n,), generator=g).to(D)))
    return out


def audio_batches(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(n, MEL, FRAMES, generator=g, dtype=D), torch.randint(3, V, (n, T_DEC), generator=g)),
             torch.randint(3, V, (n, T_DEC), generator=g)) for n in sizes]


# --------------------------------------------------------------------------- the families


@dataclass(frozen=True)
class Family:
    build: Callable[[], nn.Module]  # -> float64 model in the mode it is trained in
    batches: Callable[[list[int], int], list]  # (physical batch sizes, seed) -> [(inputs, targets)]
    loss: Callable  # (output, targets) -> (B,)
    b: int  # a batch size equal to no dimension of the model or its inputs
    b_eq: int  # a batch size equal to one
    eq: str  # ... which one
    tol: dict = field(default_factory=dict)  # check_engine tolerance arguments


def _hf(make, wrap=None, prep=None):
    def build():
        torch.manual_seed(0)
        m = make()
        m = wrap(m) if wrap is not None else m
        m = m.to(D)
        return prep(m) if prep is not None else m.train()

    return build


def _lm(s, k):
    return padded_lm_batches(s, k)


def _cls(s, k):
    return cls_batches(s, k, pad_id=0)


FAMILIES = {
    "mistral": Family(_hf(mistral, LMWrap), _lm, causal_loss, 3, T_LM, "T", F32),
    "mistral-sliding-window": Family(_hf(partial(mistral, sliding_window=4), LMWrap), _lm, causal_loss, 3, T_LM, "T",
                                     F32),
    "qwen2": Family(_hf(qwen2, LMWrap), _lm, causal_loss, 3, T_LM, "T", F32),
    "gemma": Family(_hf(gemma, LMWrap), _lm, causal_loss, 3, T_LM, "T", F32),
    "phi": Family(_hf(phi, LMWrap), _lm, causal_loss, 3, T_LM, "T", F32),
    "bloom": Family(_hf(bloom, LMWrap), _lm, causal_loss, 3, T_LM, "T", F32),
    "distilbert": Family(_hf(distilbert, ClsWrap), _cls, cls_loss, 3, T_CLS, "T"),
    "electra": Family(_hf(electra, ClsWrap), _cls, cls_loss, 3, T_CLS, "T"),
    "albert": Family(_hf(albert, ClsWrap), _cls, cls_loss, 3, T_CLS, "T"),
    "vit": Family(_hf(hf_vit), images, cls_loss, 7, 10, "T (9 patches + class token)", F32),
    "clip": Family(_hf(clip, ClipPair), clip_batches, clip_pair_loss, 7, T_CLS, "T (text)"),
    "whisper": Family(_hf(whisper, None), audio_batches, seq2seq_loss, 7, T_DEC, "T (decoder and encoder)"),
    "convnext": Family(_hf(timm_convnext), partial(images, hw=16), cls_loss, 7, 8, "channels, 8x8 after the stem"),
    "mobilenetv3": Family(_hf(timm_mobilenetv3, prep=partial(bn_eval, freeze=True)), partial(images, hw=16),
                          cls_loss, 7, 8, "channels, 8x8 after the stem"),
    "efficientnet": Family(_hf(timm_efficientnet, prep=partial(bn_eval, freeze=True)), partial(images, hw=16),
                           cls_loss, 7, 8, "channels, 8x8 after the stem"),
    # BatchNorm variants: eval mode with trainable affine parameters; BN replaced by GroupNorm (validate.fix)
    "mobilenetv3-bn-trainable": Family(_hf(timm_mobilenetv3, prep=partial(bn_eval, freeze=False)),
                                       partial(images, hw=16), cls_loss, 7, 8, "channels, 8x8 after the stem"),
    "efficientnet-validate-fix": Family(_hf(timm_efficientnet, prep=bn_fixed), partial(images, hw=16), cls_loss, 7,
                                        8, "channels, 8x8 after the stem"),
    "mamba": Family(_hf(mamba, LMWrap), _lm, causal_loss, 3, T_LM, "T", F32),
    # the batch folded into dimension 0 (fastdp.layers.batchdim.fold_factor)
    "swin": Family(_hf(hf_swin, ImageCls), partial(images, hw=16), cls_loss, 7, 4,
                   "windows per image (and window size, patch size)"),
    "swin-timm": Family(_hf(timm_swin), partial(images, hw=16), cls_loss, 7, 4,
                        "windows per image (and window size, patch size)"),
    "bert-multiple-choice": Family(_hf(_multiple_choice(bert), ClsWrap), mc_batches, cls_loss, 7, CHOICES,
                                   "choices (the fold factor)"),
    "roberta-multiple-choice": Family(_hf(_multiple_choice(roberta), ClsWrap), mc_batches, cls_loss, 7, CHOICES,
                                      "choices (the fold factor)"),
    "gpt2-double-heads": Family(_hf(gpt2_double_heads, DoubleHeads), double_heads_batches, cls_loss, 7, CHOICES,
                                "choices (the fold factor)"),
}
TIMM = {"convnext", "mobilenetv3", "efficientnet", "mobilenetv3-bn-trainable", "efficientnet-validate-fix",
        "swin-timm"}
# all five modes in the default run; the rest run the default mode (their other modes are @slow)
ALL_MODES_FAST = {"mistral", "albert", "clip", "whisper", "convnext", "efficientnet", "swin", "bert-multiple-choice"}


def _needs(name):
    if name in TIMM:
        pytest.importorskip("torchvision")
        pytest.importorskip("timm")


def _family_cases():
    for name in FAMILIES:
        for mode in MODES:
            marks = () if (mode == "BK-MixOpt" or name in ALL_MODES_FAST) else (pytest.mark.slow,)
            yield pytest.param(name, mode, id=f"{name}-{mode}", marks=marks)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("which", ["b", "b_eq"])
@pytest.mark.parametrize("name,mode", list(_family_cases()))
def test_family_matches_oracle(name, mode, which):
    """B distinct from every dimension (physical batches [b, 1]) or B equal to the sequence length / channels."""
    _needs(name)
    fam = FAMILIES[name]
    fn, style, reduction = MODE_CONFIG[mode]
    sizes = [fam.b, 1] if which == "b" else [fam.b_eq]
    data = fam.batches(sizes, 10 + MODES.index(mode) + 7 * len(sizes))
    check_engine(fam.build(), fam.loss, data, mode=mode, fn=fn, style=style, reduction=reduction, **fam.tol)


def _dims(model: nn.Module, data) -> set[int]:
    """Every size of every parameter and every non-batch size of every input tensor."""
    sizes = {s for p in model.parameters() for s in p.shape}
    for x, _ in data:
        sizes |= {s for t in x for s in t.shape[1:]}
    return sizes


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_batch_sizes_are_what_they_claim(name):
    _needs(name)
    fam = FAMILIES[name]
    model = fam.build()
    data = fam.batches([2], 0)
    dims = _dims(model, data)
    assert fam.b not in dims, f"{name}: b={fam.b} equals a dimension of the model or its inputs {sorted(dims)}"
    assert fam.b_eq in dims, f"{name}: b_eq={fam.b_eq} is no dimension of the model or its inputs {sorted(dims)}"


def test_families_cover_the_issue():
    fast = [n for n in FAMILIES if n in ALL_MODES_FAST]
    assert len(fast) >= 4 and set(MODE_CONFIG) == set(MODES)
    for k in range(3):  # every clipping function, style and reduction appears
        assert len({c[k] for c in MODE_CONFIG.values()}) == (3 if k < 2 else 2)


# --------------------------------------------------------------------------- BatchNorm refusals, validate.fix


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("make", [timm_mobilenetv3, timm_efficientnet], ids=["mobilenetv3", "efficientnet"])
def test_timm_batchnorm_in_train_mode_is_refused(make):
    pytest.importorskip("timm")
    torch.manual_seed(0)
    model = make().to(D).train()
    want = (r"module 'bn1' \(BatchNormAct2d, trainable parameters 'bn1.weight', 'bn1.bias'\) is in train mode"
            r".*mixes the samples.*fastdp.validate.fix")
    with pytest.raises(ValueError, match=want):
        make_engine(model, batch_size=4)


def test_validate_fix_keeps_timm_fused_activation(caplog):
    """timm's BatchNormAct2d is act(drop(BN(x))): fix keeps its activation (and drop layer) around the GroupNorm,
    whose parameters stay in a plain nn.GroupNorm (``.norm``: the state dict holds ``bn1.norm.weight``), so the
    engine clips them with its GroupNorm kind, not on the generic path."""
    pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm_efficientnet().to(D)
    bn = model.bn1
    act = bn.act
    assert isinstance(act, nn.SiLU)
    with caplog.at_level(logging.INFO, logger="fastdp.validate"):
        fastdp.validate.fix(model)
    assert "bn1 BatchNormAct2d" in caplog.text and "fused activation SiLU and drop layer Identity kept" in caplog.text
    assert model.bn1.act is act and type(model.bn1.norm) is nn.GroupNorm
    x = torch.randn(2, bn.num_features, 4, 4, dtype=D)
    gn = nn.GroupNorm(model.bn1.num_groups, bn.num_features, eps=bn.eps).to(D)
    gn.load_state_dict(model.bn1.norm.state_dict())
    torch.testing.assert_close(model.bn1(x), F.silu(gn(x)))
    engine = make_engine(model, batch_size=3)
    kinds = {row["module"]: row["kind"] for row in engine.plan.describe()}
    assert kinds["bn1.norm"] == "GroupNorm" and "bn1" not in kinds, kinds


# --------------------------------------------------------------------------- CLIP contrastive losses


class ClipFull(nn.Module):
    """CLIPModel called as a whole: returns the (B, B) image-text similarity logits, or its own contrastive loss."""

    def __init__(self, m: nn.Module, out: str):
        super().__init__()
        self.m = m
        self.out = out

    def forward(self, pixel_values, input_ids, attention_mask):
        o = self.m(pixel_values=pixel_values, input_ids=input_ids, attention_mask=attention_mask,
                   return_loss=self.out == "loss")
        return o.loss if self.out == "loss" else o.logits_per_image


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_clip_in_batch_similarity_logits_are_refused():
    """logits_per_image[i] holds sample i's image against every caption of the batch: the structure probe refuses."""
    torch.manual_seed(0)
    model = ClipFull(clip().to(D), "logits")
    (x, _), = clip_batches([3], 1)
    engine = make_engine(model, batch_size=3)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(fastdp.StructureError, match="structure probe.*do not match a brute-force batch-of-one"):
        logits = model(*x)
        lab = torch.arange(3)
        (F.cross_entropy(logits, lab) + F.cross_entropy(logits.t(), lab)).backward()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_clip_contrastive_loss_on_the_embeddings_is_refused_by_the_loss_trace():
    """The in-batch contrastive loss written by the user on the model's per-sample embeddings (the towers called
    as ClipPair calls them): the structure probe passes (each embedding is its sample's), and the loss trace
    (fastdp.loss_trace) refuses the step."""
    torch.manual_seed(0)
    model = ClipEmbeds(clip().to(D))
    (x, _), = clip_batches([3], 1)
    engine = make_engine(model, batch_size=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    img, txt = model(*x)
    img, txt = F.normalize(img, dim=-1), F.normalize(txt, dim=-1)
    lab = torch.arange(3)
    logits = img @ txt.t() / 0.07
    (F.cross_entropy(logits, lab) + F.cross_entropy(logits.t(), lab)).backward()
    with pytest.raises(fastdp.StructureError, match="the loss couples samples: cross_entropy across samples"):
        opt.step()
    assert all(p.grad is None for p in model.parameters()) and engine.steps == 0


class ClipEmbeds(ClipPair):
    """CLIP, both towers: the per-sample image and text embeddings ``(B, d)`` each, for a loss written outside."""

    def forward(self, pixel_values, input_ids, attention_mask):
        img = self.m.get_image_features(pixel_values=pixel_values)
        txt = self.m.get_text_features(input_ids=input_ids, attention_mask=attention_mask)
        return getattr(img, "pooler_output", img), getattr(txt, "pooler_output", txt)


class ClipWholeEmbeds(nn.Module):
    """CLIPModel called as a whole, returning its embeddings (its forward also builds the (B, B) logits)."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, pixel_values, input_ids, attention_mask):
        o = self.m(pixel_values=pixel_values, input_ids=input_ids, attention_mask=attention_mask)
        return o.image_embeds, o.text_embeds


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_clip_model_called_whole_needs_logit_scale_frozen():
    """CLIPModel's own forward multiplies the (B, B) similarities by its raw parameter logit_scale, so the whole
    model is that parameter's owner and cannot be replayed per sample: the structure probe refuses, naming
    m.logit_scale and its owner's failed replay (it named only the position embeddings before 2026-11-27).
    Frozen, the call passes the probe, and a contrastive loss on the embeddings is refused by the loss trace."""
    torch.manual_seed(0)
    (x, _), = clip_batches([4], 1)
    model = ClipWholeEmbeds(clip().to(D))
    engine = make_engine(model, batch_size=4)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(fastdp.StructureError, match=r"structure probe.*Parameters: \['m\.logit_scale'\]") as err:
        model(*x)
    assert "module 'm' (CLIPModel) could not be replayed on one sample" in str(err.value)
    model = ClipWholeEmbeds(clip().to(D))
    model.m.logit_scale.requires_grad_(False)
    engine = make_engine(model, batch_size=4)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine.attach(opt)
    img, txt = model(*x)
    logits = F.normalize(img, dim=-1) @ F.normalize(txt, dim=-1).t()
    F.cross_entropy(logits, torch.arange(4)).backward()
    with pytest.raises(fastdp.StructureError, match="the loss couples samples"):
        opt.step()
    assert engine.steps == 0


def _release_sum(base, x, R):
    model = ClipFull(copy.deepcopy(base), "loss")
    engine = make_engine(model, batch_size=1, R=R)  # batch_size 1: the release is the clipped sum itself
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    model(*x).backward()
    opt.step()
    engine.detach()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("make", [clip, siglip], ids=["clip", "siglip"])
def test_internal_contrastive_loss_is_refused(make):
    """CLIPModel / SiglipModel(return_loss=True) compute the in-batch contrastive loss inside the model and return a
    scalar whose per-sample split does not exist: released, the sum moved by 2.9 R (CLIP) and 1.4 R (SigLIP) between
    neighbouring batches of 4 and 3 samples. fastdp.hf_guard refuses the call, naming return_loss."""
    torch.manual_seed(0)
    base = make().to(D)
    (x, _), = clip_batches([4], 1)
    with pytest.raises(ValueError, match=r"return_loss=True.*contrastive"):
        _release_sum(base, x, 1e-3)


# --------------------------------------------------------------------------- activation checkpointing


def _hf_checkpointed(make, wrap, reentrant):
    torch.manual_seed(0)
    base = make()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert base.is_gradient_checkpointing
    return wrap(base).to(D).train()


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["mistral", "electra"])
def test_hf_gradient_checkpointing_non_reentrant(family, mode):
    make, wrap, batches, loss, tol = {
        "mistral": (mistral, LMWrap, _lm, causal_loss, F32),
        "electra": (electra, ClsWrap, _cls, cls_loss, {}),
    }[family]
    model = _hf_checkpointed(make, wrap, reentrant=False)
    fn, style, reduction = MODE_CONFIG[mode]
    sizes = [3, 1] if MODES.index(mode) % 2 == 0 else [T_LM if family == "mistral" else T_CLS]
    check_engine(model, loss, batches(sizes, 40 + MODES.index(mode)), mode=mode, fn=fn, style=style,
                 reduction=reduction, **tol)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_hf_gradient_checkpointing_reentrant_is_refused():
    model = _hf_checkpointed(mistral, LMWrap, reentrant=True)
    ((ids, mask), _), = padded_lm_batches([3], 1)
    engine = make_engine(model, batch_size=3)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"use_reentrant=True.*use_reentrant=False"):
        model(ids, mask)


class CheckpointedEncoder(nn.Module):
    """Conv1d stem, two ``nn.TransformerEncoderLayer`` (``MultiheadAttention`` on the generic path) each under
    ``checkpoint(use_reentrant=False)``, a raw position parameter (1, T, d) added before, a mean-pooled head."""

    def __init__(self, d=8, T=5):
        super().__init__()
        self.stem = nn.Conv1d(2, d, 3, padding=1)
        self.pos = nn.Parameter(torch.randn(1, T, d))
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 2, 12, dropout=0.0, batch_first=True,
                                                               norm_first=i == 1) for i in range(2))
        self.head = nn.Linear(d, LABELS)

    def forward(self, x):  # x: (B, 2, T)
        from torch.utils.checkpoint import checkpoint

        h = self.stem(x).transpose(1, 2) + self.pos
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False)
        return self.head(h.mean(1))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("b", [7, 5], ids=["B-distinct", "B-eq-T"])
def test_torch_checkpoint_non_reentrant(b, mode):
    torch.manual_seed(1)
    model = CheckpointedEncoder().to(D)
    g = torch.Generator().manual_seed(50 + b)
    data = [((torch.randn(n, 2, 5, generator=g, dtype=D),), torch.randint(0, LABELS, (n,), generator=g))
            for n in ([b, 1] if b == 7 else [b])]
    fn, style, reduction = MODE_CONFIG[mode]
    check_engine(model, _ce, data, mode=mode, fn=fn, style=style, reduction=reduction)


class DropoutCheckpointed(CheckpointedEncoder):
    """:class:`CheckpointedEncoder` with dropout 0.1 inside the (checkpointed, unless ``checkpointed=False``)
    layers: ``nn.TransformerEncoderLayer``'s default."""

    def __init__(self, d=8, T=5, checkpointed=True):
        super().__init__(d, T)
        self.checkpointed = checkpointed
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 2, 12, dropout=0.1, batch_first=True)
                                    for _ in range(2))

    def forward(self, x):
        if self.checkpointed:
            return super().forward(x)
        h = self.stem(x).transpose(1, 2) + self.pos
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("family", ["torch", "torch-no-checkpoint", "gpt2"])
def test_dropout_inside_non_reentrant_checkpoints_passes_the_probe(family):
    """The probe makes dropout the identity with a torch-function mode, which does not reach the backward pass,
    where non-reentrant checkpointing recomputes the block with a real dropout: the first passes disagree (for GPT-2
    the recomputation even saves other tensors). The probe then runs again with the blocks' activations kept, and
    passes; training proceeds in train mode (dropout on). Before, a StructureError named the position embedding.
    Without checkpoints, ``nn.TransformerEncoderLayer``'s default dropout 0.1 was refused too: the attention's
    dropout runs inside ``F.multi_head_attention_forward``, where the mode did not reach."""
    torch.manual_seed(2)
    if family.startswith("torch"):
        model = DropoutCheckpointed(checkpointed=family == "torch").to(D).train()
        g = torch.Generator().manual_seed(3)
        x = torch.randn(4, 2, 5, generator=g, dtype=D)

        def step():
            return _ce(model(x), torch.randint(0, LABELS, (4,), generator=g)).mean()
    else:
        import transformers

        cfg = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                      attn_implementation="eager")  # dropout 0.1 (the default)
        model = transformers.GPT2LMHeadModel(cfg).to(D).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = torch.randint(0, 40, (8, 6), generator=torch.Generator().manual_seed(3))

        def step():
            return losses.causal_lm_loss(model(input_ids=ids, use_cache=False).logits, ids).mean()
    engine = make_engine(model, batch_size=4 if family.startswith("torch") else 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step().backward()
    opt.step()
    assert engine.probe_stats["signatures"] == 1 and engine.steps == 1
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)


# --------------------------------------------------------------------------- a block reused at several lengths


class MultiLength(nn.Module):
    """The same Embedding, Linear, LayerNorm, Conv1d and MultiheadAttention applied to the prefixes of length 7, 4
    and 1 of each sample in one forward; the Linear once more on (B, d) (no sequence axis)."""

    def __init__(self, vocab=11, d=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, LABELS)

    def forward(self, ids):  # (B, 7)
        pooled = []
        for t in (7, 4, 1):
            h = self.norm(self.proj(self.emb(ids[:, :t])))
            h = torch.tanh(self.conv(h.transpose(1, 2)).transpose(1, 2))
            pooled.append(self.attn(h, h, h, need_weights=False)[0].mean(1))
        return self.head(torch.tanh(self.proj(pooled[0] + pooled[1]) + pooled[2]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("b", [6, 7, 4], ids=["B-distinct", "B-eq-T", "B-eq-short-T"])
def test_block_reused_at_several_sequence_lengths(b, mode):
    torch.manual_seed(2)
    model = MultiLength().to(D)
    g = torch.Generator().manual_seed(60 + b)
    data = [((torch.randint(0, 11, (n, 7), generator=g),), torch.randint(0, LABELS, (n,), generator=g))
            for n in ([b, 1] if b == 6 else [b])]
    fn, style, reduction = MODE_CONFIG[mode]
    check_engine(model, _ce, data, mode=mode, fn=fn, style=style, reduction=reduction)


# --------------------------------------------------------------------------- every Conv padding mode

CONVS = {  # dim -> (conv kwargs, input spatial size): dilation, stride, groups, asymmetric kernels
    1: (dict(in_channels=2, out_channels=4, kernel_size=3, padding=2, dilation=2), (9,)),
    2: (dict(in_channels=2, out_channels=4, kernel_size=(3, 2), stride=(2, 1), padding=(1, 1), groups=2), (7, 6)),
    3: (dict(in_channels=2, out_channels=3, kernel_size=2, padding=1), (4, 5, 3)),
}


class ConvNet(nn.Module):
    def __init__(self, dim, padding_mode):
        super().__init__()
        kw, size = CONVS[dim]
        self.conv = getattr(nn, f"Conv{dim}d")(padding_mode=padding_mode, **kw)
        with torch.no_grad():
            n = self.conv(torch.zeros(1, kw["in_channels"], *size)).numel()
        self.head = nn.Linear(n, LABELS)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(1))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_conv_padding_modes(dim, padding_mode, mode):
    torch.manual_seed(dim)
    model = ConvNet(dim, padding_mode).to(D)
    kw, size = CONVS[dim]
    b = 11 if MODES.index(mode) % 2 == 0 else size[0]  # 11: no dimension; size[0]: B equals the first spatial size
    g = torch.Generator().manual_seed(70 + dim)
    data = [((torch.randn(n, kw["in_channels"], *size, generator=g, dtype=D),),
             torch.randint(0, LABELS, (n,), generator=g)) for n in ([b, 1] if b == 11 else [b])]
    fn, style, reduction = MODE_CONFIG[mode]
    check_engine(model, _ce, data, mode=mode, fn=fn, style=style, reduction=reduction)


# --------------------------------------------------------------------------- the empty batch


@pytest.mark.parametrize("name", sorted(TIMM - {"swin-timm"}))  # (Swin cannot run zero rows: see below)
def test_timm_empty_physical_batch(name):
    """A batch of zero rows, forward and backward (Poisson sampling), accumulated with a non-empty one."""
    _needs(name)
    fam = FAMILIES[name]
    check_engine(fam.build(), fam.loss, fam.batches([fam.b, 0], 80), mode="BK-MixOpt", reduction="sum")


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("name", ["mistral", "distilbert", "clip", "whisper", "swin-timm"])
def test_hf_empty_batch_then_step(name):
    """Hugging Face models (and timm's Swin) cannot run a batch of zero rows themselves (a reshape with -1 of an
    empty tensor), with or without an engine. The failed forward leaves nothing behind, ``engine.empty_step()``
    releases zero (σ = 0), and the next step on a real batch matches the oracle."""
    _needs(name)
    fam = FAMILIES[name]
    model = fam.build()
    (x0, _), = fam.batches([0], 81)
    with pytest.raises(RuntimeError, match="cannot reshape tensor of 0 elements"):
        call_model(copy.deepcopy(model), x0)  # the model itself, no engine
    data = fam.batches([fam.b], 82)
    om, names, groups, psg = oracle_for(model, fam.loss, data)
    R = choose_R(psg, groups, "middle", gap=1e-6)
    want = clipped_sum(psg, groups, "abadi", R, fam.b)
    engine = make_engine(model, batch_size=fam.b, R=R)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD([params[n] for n in names], lr=0.0)
    engine.attach(opt)
    with pytest.raises(RuntimeError, match="cannot reshape tensor of 0 elements"):
        call_model(model, x0)
    engine.empty_step()
    assert all(float(params[n].grad.abs().max()) == 0.0 for n in names)
    opt.zero_grad()
    engine_step(model, opt, fam.loss, data, "mean")
    got = released_grads(model, names)
    atol_rel = fam.tol.get("atol_rel", 0.0)
    for n in names:
        w = want[n]
        atol = max(1e-10 * max(1.0, float(w.abs().max())), atol_rel * float(w.abs().max()))
        torch.testing.assert_close(got[n], w, rtol=1e-6, atol=atol, msg=lambda m, n=n: f"{name} {n}: {m}")
