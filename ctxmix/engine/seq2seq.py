"""Encoder-decoders (BART, Marian, mBART, M2M-100/NLLB, Whisper): the decoder's weights, its layers
recomputed from them, and one teacher-forced trace of source and target. ALTI+ over it lives in
`ctxmix.methods.alti_plus`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ctxmix.engine.arch import ArchSpec, LayerWeights, _get, read_layer
from ctxmix.engine.layer import attention_output, ff_forward, head_values
from ctxmix.engine.models import Model
from ctxmix.engine.trace import Trace
from ctxmix.errors import BadInput


def decoder_specs(spec: ArchSpec) -> tuple[ArchSpec, ArchSpec]:
    """The decoder's self-attention + FF layers, and its cross-attention, named like the encoder's
    layers under "decoder" (the cross-attention is `encoder_attn`, its norm `encoder_attn_layer_norm`)."""
    own = replace(
        spec,
        layers="decoder.layers",
        final_norm="decoder.layer_norm" if spec.final_norm else None,
        heads_attr=("decoder_attention_heads",),
        causal=True,
    )
    cross = replace(own, value="encoder_attn.v_proj", out_proj="encoder_attn.out_proj", ln1="encoder_attn_layer_norm")
    return own, cross


class DecoderLayers(Sequence):
    """(self-attention + FF, cross-attention) weights of decoder layer i, read when asked for: a half-precision
    or quantized model's decoder is copied to the engine's dtype one layer at a time (as `Model.layers` does
    for the encoder), never as a second copy of the decoder."""

    def __init__(self, model: Model):
        self.model = model
        self.own, self.cross = decoder_specs(model.spec)
        self.n = len(_get(model.hf.base_model, self.own.layers))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(f"decoder layer {i} of {self.n}")
        i %= self.n
        base, config, reader = self.model.hf.base_model, self.model.hf.config, self.model.layers.reader
        return read_layer(base, config, self.own, i, reader), read_layer(base, config, self.cross, i, reader)

    def __iter__(self):
        for i in range(self.n):
            yield self[i]


def decoder_weights(model: Model) -> Sequence[tuple[LayerWeights, LayerWeights]]:
    """(self-attention + FF, cross-attention) weights of every decoder layer: views of a plain model's tensors,
    read once per model; a model read one layer at a time (half precision, quantized, offloaded) gets
    `DecoderLayers`, which copies a layer when it is reached."""
    if not model.spec.encoder_decoder:
        raise BadInput(f"{model.name} is not an encoder-decoder model")
    if not model.layers.resident:
        return DecoderLayers(model)
    cached = getattr(model, "_decoder_weights", None)
    if cached is None:
        cached = list(DecoderLayers(model))
        model._decoder_weights = cached
    return cached


@dataclass
class DecoderState:
    """The real vectors of one decoder layer, batch-first (B, T, d); attention (B, H, T, T | S).

    post-LN: h = x + SA(x), a = LN_sa(h), c = a + CA(a, e), b = LN_ca(c), y = LN_ff(b + FF(b))
    pre-LN:  h = x + SA(LN_sa x), a = h, c = a + CA(LN_ca a, e), b = c, y = b + FF(LN_ff b)
    """

    x: torch.Tensor
    e: torch.Tensor  # (B, S, d): the encoder output the cross-attention reads
    alpha_self: torch.Tensor
    alpha_cross: torch.Tensor
    h: torch.Tensor
    a: torch.Tensor  # the self-attention block's output
    c: torch.Tensor
    b: torch.Tensor  # the cross-attention block's output
    y: torch.Tensor


def decoder_layer_forward(
    sw: LayerWeights,
    cw: LayerWeights,
    x: torch.Tensor,
    e: torch.Tensor,
    alpha_self: torch.Tensor,
    alpha_cross: torch.Tensor,
) -> DecoderState:
    """Recompute a decoder layer from its input x (B, T, d), the encoder output e (B, S, d) and the
    model's attention probabilities."""
    post = sw.position == "post"
    h = x + attention_output(sw, alpha_self, head_values(sw, x if post else sw.ln1(x), True))
    a = sw.ln1(h) if post else h
    c = a + attention_output(cw, alpha_cross, head_values(cw, e, True))
    b = cw.ln1(c) if post else c
    ff = ff_forward(sw, b if post else sw.ln2(b))[0]
    y = sw.ln2(b + ff) if post else b + ff
    return DecoderState(x=x, e=e, alpha_self=alpha_self, alpha_cross=alpha_cross, h=h, a=a, c=c, b=b, y=y)


@dataclass
class Seq2SeqTrace:
    """One source and one decoder input, traced: the encoder as a `Trace`, the decoder's layers
    as `DecoderState`s (batch of one)."""

    model: Model
    encoder: Trace  # the source's
    decoder_ids: list[int]
    decoder: list[DecoderState]
    logits: torch.Tensor  # (T, vocab)
    reconstruction_error: float  # the largest of the encoder's and the decoder's

    @property
    def n_source(self) -> int:
        return self.encoder.n


@torch.no_grad()
def trace_seq2seq(model: Model, source, decoder_ids: list[int], notes: list[str] | None = None) -> Seq2SeqTrace:
    """Run the model once (teacher forcing) and rebuild the encoder's and the decoder's layers. source: the source's
    token ids, or an input that is not ids (Whisper's `AudioInput`), whose positions the encoder's trace takes."""
    from ctxmix.engine.attention import ctxmix_pass, every_row
    from ctxmix.engine.inputs import NOT_AN_ID
    from ctxmix.engine.trace import Trace, _activations, _rebuild

    dec = torch.tensor([decoder_ids], device=model.device)
    if hasattr(source, "forward_kwargs"):
        src_kwargs, inputs = source.forward_kwargs(model.device, model.dtype), source
        source_ids, tokens = [NOT_AN_ID] * source.n, source.labels()
    else:
        src = torch.tensor([source], device=model.device)
        src_kwargs, inputs = {"input_ids": src, "attention_mask": torch.ones_like(src)}, None
        source_ids, tokens = list(source), model.tokens(source)
    with ctxmix_pass(rows=every_row()):  # every row's probabilities: self-, cross- and decoder attention
        out = model.hf(**src_kwargs, decoder_input_ids=dec, output_hidden_states=True, output_attentions=True)
    if any(a is None for a in (out.encoder_attentions or [None])) or any(
        a is None for a in (out.cross_attentions or [None])
    ):
        raise RuntimeError(
            "the model returned no attention weights: wrap it with ctxmix.model_from_hf "
            "or load it with ctxmix.load_model"
        )
    ehs = [_activations(model, h[0]) for h in out.encoder_hidden_states]
    states, enc_err = _rebuild(model, ehs, [_activations(model, a[0]) for a in out.encoder_attentions], None)
    enc = Trace(
        model=model,
        input_ids=source_ids,
        tokens=tokens,
        hidden=ehs[:-1] + [states[-1].y],
        states=states,
        logits=None,
        reconstruction_error=float(enc_err),
        notes=list(notes or []),
        inputs=inputs,
    )
    e = _activations(model, out.encoder_last_hidden_state)
    dhs = [_activations(model, h) for h in out.decoder_hidden_states]
    err = float(enc_err)
    dstates = []
    layers = decoder_weights(model)
    for l, (sw, cw) in enumerate(layers):
        st = decoder_layer_forward(
            sw,
            cw,
            dhs[l],
            e,
            _activations(model, out.decoder_attentions[l]),
            _activations(model, out.cross_attentions[l]),
        )
        dstates.append(st)
        mine = st.y if l < len(layers) - 1 or sw.next_norm is None else sw.next_norm(st.y)
        err = max(err, float((mine - dhs[l + 1]).abs().max()))
    return Seq2SeqTrace(
        model=model,
        encoder=enc,
        decoder_ids=list(decoder_ids),
        decoder=dstates,
        logits=out.logits[0],
        reconstruction_error=err,
    )


def encode_target(model: Model, decoder_text: str) -> tuple[list[int], list[int], list[str]]:
    """(decoder input ids, target ids, notes): the target as the tokenizer makes labels, and the
    decoder's teacher-forced input, [decoder start] + target[:-1], so row t predicts target[t]."""
    if not isinstance(decoder_text, str) or not decoder_text.strip():
        raise BadInput("decoder_text must be a non-empty string (the target the decoder reads, teacher-forced)")
    labels = list(model.tokenizer(text_target=decoder_text, add_special_tokens=True)["input_ids"])
    notes = []
    if len(labels) > model.max_length:
        notes.append(f"decoder_text has {len(labels)} tokens; truncated to the model's maximum of {model.max_length}")
        labels = labels[: model.max_length]
    start = getattr(model.config, "decoder_start_token_id", None)
    if start is None:
        raise BadInput(f"{model.name}'s config has no decoder_start_token_id; the decoder's input cannot be built")
    return [int(start)] + labels[:-1], labels, notes
