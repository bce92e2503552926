"""One declarative description per architecture family, and the weights it points to.
(Over 500 lines: one entry per family, the norms and the weights reader; the table is the point.)

Every decomposition in ctxmix runs on plain tensors taken from the model through these
maps of module names (the ALTI repo's idea), so adding a family is adding one entry here;
`tests/test_reconstruction.py` then proves the decompositions exact on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from ctxmix.engine.scopes import scope_names
from ctxmix.engine.weights import linear_matrix, materialized, offloaded
from ctxmix.errors import UnsupportedArchitecture


@dataclass(frozen=True)
class ArchSpec:
    """Module names of one architecture family, relative to `model.base_model`.

    Paths inside a layer are dotted attribute names. `fused_qkv` means one projection
    holds Q, K and V side by side (GPT-2's `c_attn`); `conv1d` means weights are stored
    (in, out) as in GPT-2's Conv1D instead of nn.Linear's (out, in).
    """

    family: str
    model_types: tuple[str, ...]
    position: str  # "post": LN after each residual (BERT); "pre": LN before each block (GPT-2);
    # "parallel": y = x + ATTN(LN1 x) + FF(LN2 x) (GPT-NeoX, Phi-1/2; LN1 and LN2 may be one module);
    # "sandwich": h = x + LNa(ATTN(LN1 x)), y = h + LNf(FF(LN2 h)) (Gemma 2/3)
    norm: str  # "layernorm" or "rmsnorm"
    layers: str
    value: str
    out_proj: str
    ln1: str  # the norm of the attention block (after RES1 in post-LN, before ATTN in pre-LN)
    ln2: str  # the norm of the FF block
    ff_out: str
    act: str
    ff_in: str | None = None  # W_1 of a plain FF
    ff_gate: str | None = None  # gated FF: down(act(x W_g) * (x W_u))
    ff_up: str | None = None
    final_norm: str | None = None  # pre-LN: the norm after the last layer
    fused_qkv: bool = False
    conv1d: bool = False
    causal: bool = False
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + w): gamma = w + norm_offset
    fused_gate_up: bool = False  # ff_gate names one projection [gate | up] (ModernBERT's Wi: act(first) * second)
    qkv_per_head: bool = False  # fused QKV interleaved per head, [q_h | k_h | v_h] for each head (GPT-NeoX)
    post_attn_norm: str | None = None  # "sandwich" (Gemma 2/3): the norm of the attention block's output
    post_ff_norm: str | None = None  # "sandwich": the norm of the FF block's output
    heads_attr: tuple[str, ...] = ("num_attention_heads", "n_head", "n_heads")
    # encoder-decoder models: `layers` names the encoder's; the decoder's self-attention, FF and
    # cross-attention are read through `ctxmix.engine.seq2seq.decoder_specs` (same module names under "decoder")
    encoder_decoder: bool = False
    # DINOv2's layer scale: modules whose `lambda1` (d,) multiplies the attention / FF output before its residual;
    # folded into W_O, b_O and W_2, b_2 when the weights are read, so every decomposition sees a plain layer
    layer_scale_attn: str | None = None
    layer_scale_ff: str | None = None
    # whether the model's last hidden state (hidden_states[-1]) is after `final_norm` (text models in
    # transformers) or the last layer's raw output (ViT, DINOv2: the norm is applied to last_hidden_state only)
    hidden_after_final_norm: bool = True
    inputs: str = "ids"  # what the model reads: "ids" (token ids), "pixels" (an image's pixel values) or "audio"
    # (a clip: its waveform, or Whisper's log-mel spectrogram of it)

    @property
    def gated(self) -> bool:
        return self.ff_gate is not None


_BERT_LIKE: dict[str, Any] = dict(
    position="post",
    norm="layernorm",
    layers="encoder.layer",
    value="attention.self.value",
    out_proj="attention.output.dense",
    ln1="attention.output.LayerNorm",
    ln2="output.LayerNorm",
    ff_in="intermediate.dense",
    ff_out="output.dense",
    act="intermediate.intermediate_act_fn",
)

# BART-style layers (the encoder's, and the decoder's self-attention and FF)
_ENC_DEC_LAYER: dict[str, Any] = dict(
    value="self_attn.v_proj",
    out_proj="self_attn.out_proj",
    ln1="self_attn_layer_norm",
    ln2="final_layer_norm",
    ff_in="fc1",
    ff_out="fc2",
    act="activation_fn",
)

FAMILIES: tuple[ArchSpec, ...] = (
    ArchSpec("BERT", ("bert",), **_BERT_LIKE),
    ArchSpec("RoBERTa", ("roberta", "xlm-roberta", "camembert"), **_BERT_LIKE),
    ArchSpec("ELECTRA", ("electra",), **_BERT_LIKE),
    ArchSpec(
        "DistilBERT",
        ("distilbert",),
        position="post",
        norm="layernorm",
        layers="transformer.layer",
        value="attention.v_lin",
        out_proj="attention.out_lin",
        ln1="sa_layer_norm",
        ln2="output_layer_norm",
        ff_in="ffn.lin1",
        ff_out="ffn.lin2",
        act="ffn.activation",
    ),
    ArchSpec(
        "GPT-2",
        ("gpt2",),
        position="pre",
        norm="layernorm",
        layers="h",
        value="attn.c_attn",
        out_proj="attn.c_proj",
        ln1="ln_1",
        ln2="ln_2",
        ff_in="mlp.c_fc",
        ff_out="mlp.c_proj",
        act="mlp.act",
        final_norm="ln_f",
        fused_qkv=True,
        conv1d=True,
        causal=True,
    ),
    ArchSpec(
        "OPT",
        ("opt",),
        position="pre",
        norm="layernorm",
        layers="decoder.layers",
        value="self_attn.v_proj",
        out_proj="self_attn.out_proj",
        ln1="self_attn_layer_norm",
        ln2="final_layer_norm",
        ff_in="fc1",
        ff_out="fc2",
        act="activation_fn",
        final_norm="decoder.final_layer_norm",
        causal=True,
    ),
    ArchSpec(
        # Qwen3 adds q/k norms, which the value path never reads; Llama 3 differs in rotary scaling only
        "Llama",
        ("llama", "mistral", "qwen2", "qwen3"),
        position="pre",
        norm="rmsnorm",
        layers="layers",
        value="self_attn.v_proj",
        out_proj="self_attn.o_proj",
        ln1="input_layernorm",
        ln2="post_attention_layernorm",
        ff_gate="mlp.gate_proj",
        ff_up="mlp.up_proj",
        ff_out="mlp.down_proj",
        act="mlp.act_fn",
        final_norm="norm",
        causal=True,
    ),
    ArchSpec(
        # Llama's shape with RMSNorm scaling by (1 + w) and a GeGLU FF (gelu-tanh gate)
        "Gemma",
        ("gemma",),
        position="pre",
        norm="rmsnorm",
        norm_offset=1.0,
        layers="layers",
        value="self_attn.v_proj",
        out_proj="self_attn.o_proj",
        ln1="input_layernorm",
        ln2="post_attention_layernorm",
        ff_gate="mlp.gate_proj",
        ff_up="mlp.up_proj",
        ff_out="mlp.down_proj",
        act="mlp.act_fn",
        final_norm="norm",
        causal=True,
    ),
    ArchSpec(
        # Phi-3/4: Llama's shape with a fused qkv_proj ([Q | K | V], K and V of the key-value heads)
        # and a fused gate_up_proj (act(first half) * second half)
        "Phi-3",
        ("phi3",),
        position="pre",
        norm="rmsnorm",
        layers="layers",
        value="self_attn.qkv_proj",
        out_proj="self_attn.o_proj",
        ln1="input_layernorm",
        ln2="post_attention_layernorm",
        ff_gate="mlp.gate_up_proj",
        fused_gate_up=True,
        ff_out="mlp.down_proj",
        act="mlp.activation_fn",
        final_norm="norm",
        fused_qkv=True,
        causal=True,
    ),
    ArchSpec(
        # encoder-decoder, post-LN (BART, Marian): the encoder as BERT's layers; ALTI+ through the decoder
        "BART",
        ("bart", "marian"),
        position="post",
        norm="layernorm",
        layers="encoder.layers",
        encoder_decoder=True,
        **_ENC_DEC_LAYER,
    ),
    ArchSpec(
        # encoder-decoder, pre-LN with a final norm in the encoder and in the decoder (M2M-100, NLLB, mBART)
        "M2M-100",
        ("m2m_100", "mbart"),
        position="pre",
        norm="layernorm",
        layers="encoder.layers",
        final_norm="encoder.layer_norm",
        encoder_decoder=True,
        **_ENC_DEC_LAYER,
    ),
    ArchSpec(
        # parallel residual; query_key_value interleaved per head ([q_h | k_h | v_h]), so GPT-2's
        # block slicing would take the wrong columns. use_parallel_residual=False makes it pre-LN.
        "GPT-NeoX",
        ("gpt_neox",),
        position="parallel",
        norm="layernorm",
        layers="layers",
        value="attention.query_key_value",
        out_proj="attention.dense",
        ln1="input_layernorm",
        ln2="post_attention_layernorm",
        ff_in="mlp.dense_h_to_4h",
        ff_out="mlp.dense_4h_to_h",
        act="mlp.act",
        final_norm="final_layer_norm",
        fused_qkv=True,
        qkv_per_head=True,
        causal=True,
    ),
    ArchSpec(
        # Phi-1/1.5/2: parallel, one norm shared by the attention and the FF
        "Phi",
        ("phi",),
        position="parallel",
        norm="layernorm",
        layers="layers",
        value="self_attn.v_proj",
        out_proj="self_attn.dense",
        ln1="input_layernorm",
        ln2="input_layernorm",
        ff_in="mlp.fc1",
        ff_out="mlp.fc2",
        act="mlp.activation_fn",
        final_norm="final_layernorm",
        causal=True,
    ),
    ArchSpec(
        # Gemma 2/3: pre-LN blocks whose outputs are normalised too. post_attention_layernorm normalises
        # the attention output here (in Llama the module of that name is the FF's input norm)
        "Gemma 2/3",
        ("gemma2", "gemma3_text"),
        position="sandwich",
        norm="rmsnorm",
        norm_offset=1.0,
        layers="layers",
        value="self_attn.v_proj",
        out_proj="self_attn.o_proj",
        ln1="input_layernorm",
        ln2="pre_feedforward_layernorm",
        post_attn_norm="post_attention_layernorm",
        post_ff_norm="post_feedforward_layernorm",
        ff_gate="mlp.gate_proj",
        ff_up="mlp.up_proj",
        ff_out="mlp.down_proj",
        act="mlp.act_fn",
        final_norm="norm",
        causal=True,
    ),
    # DeBERTa's attention logits carry relative-position terms; its value path is BERT's
    ArchSpec("DeBERTa-v2", ("deberta-v2",), **{**_BERT_LIKE, "value": "attention.self.value_proj"}),
    ArchSpec(
        # pre-LN encoder: fused Wqkv ([Q | K | V]), GeGLU with a fused Wi (act(first half) * second half),
        # LayerNorms without bias, layer 0's attn_norm an identity, local/global attention masks
        "ModernBERT",
        ("modernbert",),
        position="pre",
        norm="layernorm",
        layers="layers",
        value="attn.Wqkv",
        out_proj="attn.Wo",
        ln1="attn_norm",
        ln2="mlp_norm",
        ff_gate="mlp.Wi",
        fused_gate_up=True,
        ff_out="mlp.Wo",
        act="mlp.act",
        final_norm="final_norm",
        fused_qkv=True,
    ),
)


_VISION: dict[str, Any] = dict(
    position="pre", norm="layernorm", ff_in="mlp.fc1", ff_out="mlp.fc2", act="mlp.activation_fn", inputs="pixels"
)
VISION_FAMILIES: tuple[ArchSpec, ...] = (
    # the patch embedding (a convolution), the class token and the position embeddings are the layer-0 input
    ArchSpec(
        "ViT",
        ("vit",),
        layers="layers",
        value="attention.v_proj",
        out_proj="attention.o_proj",
        ln1="layernorm_before",
        ln2="layernorm_after",
        final_norm="layernorm",
        hidden_after_final_norm=False,
        **_VISION,
    ),
    ArchSpec(
        "DINOv2",
        ("dinov2", "dinov2_with_registers"),
        layers="encoder.layer",
        value="attention.v_proj",
        out_proj="attention.o_proj",
        ln1="norm1",
        ln2="norm2",
        final_norm="layernorm",
        hidden_after_final_norm=False,
        layer_scale_attn="layer_scale1",
        layer_scale_ff="layer_scale2",
        **_VISION,
    ),
    # CLIP's vision tower: pre_layrnorm (sic) normalises the embeddings (the layer-0 input); post_layernorm reads
    # the pooled class token only, so the token states have no final norm
    ArchSpec(
        "CLIP vision",
        ("clip_vision_model",),
        layers="encoder.layers",
        value="self_attn.v_proj",
        out_proj="self_attn.out_proj",
        ln1="layer_norm1",
        ln2="layer_norm2",
        **_VISION,
    ),
)
# speech encoders over a convolutional feature encoder's frames; the feature encoder, the positional convolution
# and (post-LN base models) encoder.layer_norm before layer 1 are the layer-0 input
SPEECH_FAMILIES: tuple[ArchSpec, ...] = (
    ArchSpec(
        "wav2vec2/HuBERT",
        ("wav2vec2", "hubert"),
        position="post",
        norm="layernorm",
        layers="encoder.layers",
        value="attention.v_proj",
        out_proj="attention.out_proj",
        ln1="layer_norm",
        ln2="final_layer_norm",
        ff_in="feed_forward.intermediate_dense",
        ff_out="feed_forward.output_dense",
        act="feed_forward.intermediate_act_fn",
        inputs="audio",
    ),
    ArchSpec(
        # encoder-decoder over a log-mel spectrogram (mBART's pre-LN layers): the two convolutions and the
        # sinusoidal positions are the encoder's layer-0 input; its 1,500 positions are 20 ms apart, padded to 30 s
        "Whisper",
        ("whisper",),
        position="pre",
        norm="layernorm",
        layers="encoder.layers",
        final_norm="encoder.layer_norm",
        encoder_decoder=True,
        inputs="audio",
        **_ENC_DEC_LAYER,
    ),
)
FAMILIES = FAMILIES + VISION_FAMILIES + SPEECH_FAMILIES


FAMILY_NOTES = {
    "BART": "encoder-decoder: explain(model, source, ['alti'], decoder_text=...) gives ALTI+ source and target "
    "contributions over [source; target]; without decoder_text every mixing method runs on the encoder",
    "M2M-100": "encoder-decoder, pre-LN (as BART's row otherwise)",
    "DeBERTa-v2": "attention logits carry relative-position terms; the weights come from the model",
    "ModernBERT": "alternating local/global attention masks come with the model's attention weights; "
    "layer 0 has no attention norm",
    "Gemma": "RMSNorm scales by 1 + w (the gamma ff_outliers compares is 1 + w)",
    "Llama": "Qwen3's q/k norms and Llama 3's rotary scaling leave the value path as Llama's",
    "Phi-3": "fused qkv_proj and gate_up_proj, split by the head counts",
    "GPT-NeoX": "parallel residual: the FF reads LN2(x), so within a layer it adds to each token's own row "
    "only (scopes Atb = LN1 + ATTN, +Ff, +Res, +Ln); query_key_value interleaved per head",
    "Phi": "parallel residual with one shared norm (as GPT-NeoX's scopes)",
    "ViT": "images: explain(model, None, methods, image=...); the class token, then the patches row by row; the "
    "patch and position embeddings are the layer-0 input; the mixing methods, and a classifier's gradient "
    "methods at the layer-0 input",
    "DINOv2": "images, as ViT's row; layer scale folded into W_O and W_2; use_swiglu_ffn: a gated FF; "
    "Dinov2WithRegistersModel's registers follow the class token",
    "CLIP vision": "images, as ViT's row (CLIPVisionModel, or a CLIPModel's vision_model: a CLIP checkpoint loads "
    "its image tower alone; pre_layrnorm is part of the layer-0 input, and no final norm reads the token states)",
    "wav2vec2/HuBERT": "speech: explain(model, None, methods, audio=..., sampling_rate=...); the positions are the "
    "feature encoder's frames (20 ms apart); post-LN base models, pre-LN large ones (do_stable_layer_norm); the "
    "feature encoder, positional convolution and base models' encoder.layer_norm are the layer-0 input",
    "Whisper": "speech, encoder-decoder: explain(model, None, methods, audio=...) explains the encoder's 1,500 "
    "positions (20 ms apart; those past the clip are the feature extractor's padding to 30 s, marked) and "
    "transcribes; with decoder_text (True: the model's own transcript) ALTI+ over [frames; transcript tokens]",
    "Gemma 2/3": "attention and FF outputs normalised before their residuals (scopes Atb = LN1 + ATTN + LNa + "
    "RES1, +Ln, +Ff, +FfLn, +Res); RMSNorm scales by 1 + w; ff_outliers compares LNf's gamma",
}


def families_table() -> list[dict]:
    """One row per family: model types, norm position, norm, FF and the scope names that apply
    (every mixing method applies to every family; gradient methods need a head)."""
    rows = []
    for sp in FAMILIES:
        norm = sp.norm + (f" (gamma = {sp.norm_offset:g} + w)" if sp.norm_offset else "")
        ff = ("gated, fused [gate | up]" if sp.fused_gate_up else "gated") if sp.gated else "plain"
        rows.append(
            {
                "family": sp.family,
                "model types": "/".join(sp.model_types),
                "norms": "parallel residual, pre-LN blocks" if sp.position == "parallel" else f"{sp.position}-LN",
                "norm": norm,
                "FF": ff,
                "attention": (
                    "encoder bidirectional, decoder causal + cross-attention"
                    if sp.encoder_decoder
                    else "causal"
                    if sp.causal
                    else "bidirectional"
                ),
                "scopes": ", ".join(scope_names(sp.position)),
                "note": FAMILY_NOTES.get(sp.family, ""),
            }
        )
    return rows


def supported_families() -> str:
    return ", ".join(f"{s.family} ({'/'.join(s.model_types)})" for s in FAMILIES)


def spec_for(config) -> ArchSpec:
    """The family of a Hugging Face config, or a clear error naming the supported ones."""
    mt = getattr(config, "model_type", None)
    for spec in FAMILIES:
        if mt in spec.model_types:
            if spec.family == "OPT" and not getattr(config, "do_layer_norm_before", True):
                # OPT-350m puts the norms after the residuals, like BERT
                return ArchSpec(**{**spec.__dict__, "position": "post", "final_norm": None})
            if spec.family == "GPT-NeoX" and not getattr(config, "use_parallel_residual", True):
                return ArchSpec(**{**spec.__dict__, "position": "pre"})
            if spec.family == "DINOv2" and getattr(config, "use_swiglu_ffn", False):  # the SwiGLU FF of the giant
                swiglu = dict(ff_in=None, ff_gate="mlp.gate_proj", ff_up="mlp.up_proj", ff_out="mlp.down_proj")
                return ArchSpec(**{**spec.__dict__, **swiglu, "act": "mlp.act_fn"})
            if spec.family == "wav2vec2/HuBERT":
                if getattr(config, "adapter_attn_dim", None):
                    raise UnsupportedArchitecture(
                        "wav2vec2 with attention adapters (adapter_attn_dim) is not supported: the adapters add a "
                        "branch after each layer's FF that no family describes"
                    )
                if getattr(config, "do_stable_layer_norm", False):  # the large models: pre-LN, a final norm
                    large = {"position": "pre", "final_norm": "encoder.layer_norm", "hidden_after_final_norm": False}
                    return ArchSpec(**{**spec.__dict__, **large})
            if spec.family == "OPT" and getattr(config, "word_embed_proj_dim", None) not in (None, config.hidden_size):
                raise UnsupportedArchitecture(
                    "OPT checkpoints with word_embed_proj_dim != hidden_size are not supported"
                )
            return spec
    raise UnsupportedArchitecture(
        f"model type {mt!r} is not supported; ctxmix describes these families: {supported_families()}"
    )


def _get(module: nn.Module, path: str) -> Any:
    obj = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class Norm:
    """LayerNorm (mean-centred) or RMSNorm as plain tensors: z -> (z - m)/s * gamma + beta."""

    kind: str  # "layernorm", "rmsnorm" or "identity"
    gamma: torch.Tensor | None  # (d,); None for "identity"
    beta: torch.Tensor | None  # (d,) or None for RMSNorm
    eps: float

    def centre(self, z: torch.Tensor) -> torch.Tensor:
        """z (..., d) less its own mean over d for LayerNorm; unchanged for RMSNorm and "identity". The
        mean removal is linear, so a piece's centred part is its share of the centred whole."""
        return z - z.mean(-1, keepdim=True) if self.kind == "layernorm" else z

    def scale(self, z: torch.Tensor) -> torch.Tensor:
        """s(z), shape (..., 1): std with eps inside the sqrt (biased), or RMS for RMSNorm (1 for
        "identity", a norm the model leaves out, as ModernBERT's first attn_norm)."""
        if self.kind == "identity":
            return torch.ones_like(z[..., :1])
        z = self.centre(z)
        return (z.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return self.decompose_bias(z, self.scale(z))

    def fused(self, z: torch.Tensor) -> torch.Tensor:
        """The norm of whole vectors z (..., d), as `__call__`, with the framework's fused LayerNorm kernel
        (one pass instead of eight: the per-chunk paths call it on c x n x d tensors); RMSNorm and "identity"
        as `__call__`."""
        if self.kind != "layernorm":
            return self(z)
        return torch.nn.functional.layer_norm(z, z.shape[-1:], self.gamma, self.beta, self.eps)

    def fused_with_scale(self, z: torch.Tensor, shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of z, its scale s (..., 1)), as (`__call__`, `scale`), from one fused LayerNorm kernel (its
        1/s comes with the output: faster than torch.var_mean alone on a CPU); RMSNorm and "identity" as the two
        calls. `shift` (d,): added to the output, folded into beta (no pass over the output of its own)."""
        if self.kind != "layernorm":  # not in place: "identity" returns z itself
            return (self(z) if shift is None else self(z) + shift), self.scale(z)
        beta = self.beta if shift is None else shift if self.beta is None else self.beta + shift
        out, _, rstd = torch.native_layer_norm(z, z.shape[-1:], self.gamma, beta, self.eps)
        return out, rstd.reciprocal_().view(*z.shape[:-1], 1)

    def fast_scale(self, z: torch.Tensor) -> torch.Tensor:
        """`scale` of c x n x d vectors by the fastest kernel on a CPU: LayerNorm's fused kernel (its 1/s; the
        normalised output is dropped), RMSNorm's one norm reduction (no squared copy of z written out)."""
        if self.kind == "layernorm":
            return self.fused_with_scale(z)[1]
        if self.kind == "rmsnorm":
            ms = torch.linalg.vector_norm(z, dim=-1, keepdim=True).square_().div_(z.shape[-1])
            return ms.add_(self.eps).sqrt_()
        return self.scale(z)

    def decompose_pieces(self, pieces: torch.Tensor, s: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Pieces (..., m, d) of an input whose full sum has scale s (..., 1): each piece's
        own mean is subtracted, the std of the real input divides (Kobayashi et al. 2021). `out`: where the
        result goes (`pieces` itself for a temporary the caller owns, or a workspace buffer laid out as
        `pieces`); a fresh tensor when None."""
        if self.kind == "identity":
            return pieces
        # gamma / s first: one pass over the (..., m, d) pieces instead of two (in place only on the centred
        # copy: RMSNorm's centre returns the caller's tensor)
        w = self.gamma / s.unsqueeze(-2)
        if self.kind == "layernorm":
            return torch.sub(pieces, pieces.mean(-1, keepdim=True), out=out).mul_(w)
        return pieces * w if out is None else torch.mul(pieces, w, out=out)

    def decompose_bias(self, bias: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """The bias piece (..., d) takes beta on top of its normalised share."""
        if self.kind == "identity":
            return bias
        out = self.centre(bias) / s * self.gamma
        return out + self.beta if self.beta is not None else out


@dataclass
class LayerWeights:
    """One layer's parameters in (in, out) orientation; heads split by `n_heads`, `n_kv_heads`."""

    index: int
    position: str
    n_heads: int
    n_kv_heads: int
    head_dim: int
    Wv: torch.Tensor  # (d, Hkv*dh)
    bv: torch.Tensor  # (Hkv*dh,)
    Wo: torch.Tensor  # (H*dh, d)
    bo: torch.Tensor  # (d,)
    ln1: Norm
    ln2: Norm
    act: Callable[[torch.Tensor], torch.Tensor]
    W2: torch.Tensor  # (d', d): FF output projection (down_proj for gated FFs)
    b2: torch.Tensor
    W1: torch.Tensor | None = None  # (d, d') plain FF
    b1: torch.Tensor | None = None
    Wg: torch.Tensor | None = None  # gated FF: gate and up projections
    bg: torch.Tensor | None = None
    Wu: torch.Tensor | None = None
    bu: torch.Tensor | None = None
    next_norm: Norm | None = None  # the norm that next reads this layer's output (pre-LN)
    post_attn_norm: Norm | None = None  # sandwich: LNa, the attention output's norm
    post_ff_norm: Norm | None = None  # sandwich: LNf, the FF output's norm
    extra: dict = field(default_factory=dict)

    @property
    def gated(self) -> bool:
        return self.Wg is not None

    @property
    def ff_norm(self) -> Norm:
        """The norm that next processes the FF output: LN2 in post-LN, LNf in a sandwich layer
        (Gemma 2/3: gamma = 1 + w), the next LN1 in pre-LN and parallel layers."""
        if self.position == "post":
            return self.ln2
        if self.position == "sandwich":
            return self.post_ff_norm
        assert self.next_norm is not None
        return self.next_norm


class WeightReader:
    """Reads a module's tensors for the engine (`ctxmix.engine.weights`): through the offload hook, dequantized,
    and as views where the stored tensor already is what the engine computes with. With `device` / `dtype`
    set, every tensor comes back there (a copy only where it is not there already); a tensor loaded from the
    offload is always copied, as the hook sends it back to `meta` afterwards."""

    def __init__(self, device: torch.device | None = None, dtype: torch.dtype | None = None):
        self.device, self.dtype = device, dtype

    def own(self, t: torch.Tensor, must_copy: bool = False) -> torch.Tensor:
        out = t.to(
            device=self.device if self.device is not None else t.device,
            dtype=self.dtype if (self.dtype is not None and t.is_floating_point()) else t.dtype,
        )
        return out.clone() if (must_copy and out is t) else out

    def linear(self, mod: Any, conv1d: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(W (in, out), b (out,)) of a linear layer, W the matrix its kernel multiplies by."""
        with materialized(mod):
            copy = offloaded(mod)
            W = self.own(linear_matrix(mod), copy)
            W = W if conv1d else W.T
            bias = getattr(mod, "bias", None)
            b = (
                self.own(bias.detach(), copy)
                if bias is not None
                else torch.zeros(W.shape[1], dtype=W.dtype, device=W.device)
            )
        return W, b

    def norm(self, mod: Any, kind: str, offset: float = 0.0) -> Norm:
        if isinstance(mod, nn.Identity):  # ModernBERT's first attn_norm
            return Norm("identity", None, None, 0.0)
        eps = getattr(mod, "eps", None)
        if eps is None:
            eps = mod.variance_epsilon
        with materialized(mod):
            copy = offloaded(mod)
            gamma = self.own(mod.weight.detach(), copy)
            beta = self.own(mod.bias.detach(), copy) if getattr(mod, "bias", None) is not None else None
        if kind == "layernorm" and beta is None:
            beta = torch.zeros_like(gamma)
        return Norm(kind, gamma + offset if offset else gamma, beta, float(eps))


VIEWS = WeightReader()  # the stored tensors as they are (views, no copies)


def _config_heads(config, spec: ArchSpec) -> tuple[int, int]:
    for name in spec.heads_attr:
        if getattr(config, name, None):
            H = int(getattr(config, name))
            break
    else:
        raise UnsupportedArchitecture("cannot find the number of attention heads in the config")
    if spec.encoder_decoder:  # no grouped heads; Whisper's config maps num_key_value_heads to the encoder's heads
        return H, H
    Hkv = int(getattr(config, "num_key_value_heads", None) or H)
    return H, Hkv


def value_columns(spec: ArchSpec, H: int, Hkv: int, dh: int, device=None) -> torch.Tensor:
    """The columns of a fused QKV projection that hold V: [Q | K | V] blocks (Q of the H query
    heads, K and V of the Hkv key-value heads), or per head [q_h | k_h | v_h] (GPT-NeoX)."""
    if spec.qkv_per_head:
        return (
            torch.arange(H, device=device)[:, None] * 3 * dh + 2 * dh + torch.arange(dh, device=device)[None]
        ).reshape(-1)
    v0 = (H + Hkv) * dh
    return torch.arange(v0, v0 + Hkv * dh, device=device)


def final_norm(base: nn.Module, spec: ArchSpec, reader: WeightReader = VIEWS) -> Norm | None:
    """The norm after the last layer of a pre-LN / sandwich / parallel model, or None (post-LN, or none)."""
    if spec.position == "post" or not spec.final_norm:
        return None
    return reader.norm(_get(base, spec.final_norm), spec.norm, spec.norm_offset)


def read_layer(base: nn.Module, config, spec: ArchSpec, li: int, reader: WeightReader = VIEWS) -> LayerWeights:
    """Layer `li`'s parameters through `reader`, `next_norm` included (the next layer's LN1, or the final
    norm): one layer's tensors, whatever the model's size."""
    layers = _get(base, spec.layers)
    layer = layers[li]
    H, Hkv = _config_heads(config, spec)
    Wv, bv = reader.linear(_get(layer, spec.value), spec.conv1d)
    Wo, bo = reader.linear(_get(layer, spec.out_proj), spec.conv1d)
    dh = Wo.shape[0] // H
    if spec.fused_qkv:
        cols = value_columns(spec, H, Hkv, dh, Wv.device)
        Wv, bv = Wv[:, cols], bv[cols]
    W2, b2 = reader.linear(_get(layer, spec.ff_out), spec.conv1d)
    if spec.layer_scale_attn:  # y = x + lambda * (attn W_O + b_O): the scale is W_O's and b_O's (new tensors)
        Wo, bo = _scaled(Wo, bo, _get(layer, spec.layer_scale_attn), reader)
        W2, b2 = _scaled(W2, b2, _get(layer, spec.layer_scale_ff), reader)
    norm = partial(reader.norm, kind=spec.norm, offset=spec.norm_offset)
    lw = LayerWeights(
        index=li,
        position=spec.position,
        n_heads=H,
        n_kv_heads=Hkv,
        head_dim=dh,
        Wv=Wv,
        bv=bv,
        Wo=Wo,
        bo=bo,
        ln1=norm(_get(layer, spec.ln1)),
        ln2=norm(_get(layer, spec.ln2)),
        act=_get(layer, spec.act),
        W2=W2,
        b2=b2,
    )
    if spec.post_attn_norm:
        lw.post_attn_norm = norm(_get(layer, spec.post_attn_norm))
        lw.post_ff_norm = norm(_get(layer, spec.post_ff_norm))
    if spec.fused_gate_up:
        W, b = reader.linear(_get(layer, spec.ff_gate), spec.conv1d)
        half = W.shape[1] // 2
        lw.Wg, lw.bg, lw.Wu, lw.bu = W[:, :half], b[:half], W[:, half:], b[half:]
    elif spec.gated:
        lw.Wg, lw.bg = reader.linear(_get(layer, spec.ff_gate), spec.conv1d)
        lw.Wu, lw.bu = reader.linear(_get(layer, spec.ff_up), spec.conv1d)
    else:
        lw.W1, lw.b1 = reader.linear(_get(layer, spec.ff_in), spec.conv1d)
    if spec.position != "post":
        lw.next_norm = norm(_get(layers[li + 1], spec.ln1)) if li + 1 < len(layers) else final_norm(base, spec, reader)
    return lw


def _scaled(
    W: torch.Tensor, b: torch.Tensor, scale_module: Any, reader: WeightReader
) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection (W (in, out), b (out,)) followed by an elementwise scale `lambda1` (out,), as one projection."""
    with materialized(scale_module):
        lam = reader.own(scale_module.lambda1.detach(), offloaded(scale_module)).to(W)
    return W * lam, b * lam


def layer_weights(base: nn.Module, config, spec: ArchSpec) -> list[LayerWeights]:
    """Every layer's parameters at once, as views of the stored tensors (no copies): for models whose weights
    are all plain tensors where the engine computes (`ctxmix.engine.layers.LayerList` decides)."""
    out = [read_layer(base, config, spec, li) for li in range(len(_get(base, spec.layers)))]
    if spec.position != "post":
        for lw, nxt in zip(out, out[1:]):
            lw.next_norm = nxt.ln1  # one Norm object, as the model has one module
    return out
