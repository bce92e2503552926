"""Encoder-decoder models (BART, Marian, mBART, M2M-100/NLLB, Whisper): ALTI+ source and target contributions.

ALTI+ is from Ferrando, Gállego, Alastruey, Escolano and Costa-jussà, "Towards Opening the Black
Box of Neural Machine Translation: Source and Target Contributions to the Model Predictions",
EMNLP 2022. It extends ALTI (Ferrando et al. 2022) to the encoder-decoder.

Setting: S source tokens, and T decoder inputs under teacher forcing (the decoder start token,
then the target shifted right, so row t predicts target token t). ALTI scores a decomposition
y_i = sum_j T_i(x_j) + (biases, attributed to no token) as

    c_ij = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1),    C_ij = c_ij / sum_k c_ik.

Each decoder layer l has two attention blocks:

- **Self-attention** (T x T). y_i is the block output: LN_sa(x_i + SA_i) in post-LN, or the
  stream x_i + SA_i(LN_sa x) in pre-LN. T_i(x_j) = sum_h alpha^h_ij f^h(x_j), plus x_i when
  j == i. In post-LN these pass through LN_sa's linear part with the real std. This gives
  C^l_self.
- **Cross-attention** (T x (S + 1)). The block output splits over the S encoder outputs e_j
  (sum_h beta^h_ij g^h(e_j)) and one more piece: the residual, which is the self-attention
  block's output at i. This gives C^l_cross = [C^l_enc | c^l_res].

They combine into the layer's contributions over [encoder outputs; previous target states]:

    C^l = [C^l_enc | diag(c^l_res) C^l_self]    (each row sums to one).

With the encoder's own ALTI rollout R_enc (S x S), which turns encoder outputs into source tokens,
the rollout through the decoder is

    R^1 = [C^1_enc R_enc | diag(c^1_res) C^1_self]
    R^l = [C^l_enc R_enc + diag(c^l_res) C^l_self R^{l-1}_src | diag(c^l_res) C^l_self R^{l-1}_tgt].

ctxmix writes this as square maps over [source; target]:

- layer map M^l = [[I_S, 0], [C^l_enc, diag(c^l_res) C^l_self]], whose source columns are
  encoder outputs;
- global map R^l = M^l ... M^1 M^0, with M^0 = [[R_enc, 0], [0, I_T]]. Its source rows are
  R_enc and its target rows are the rollout above.

A target token's total source contribution is the sum of its row's source columns
(`source_contribution`). As in ALTI, the FF blocks are not decomposed. This follows the paper's
code (github.com/mt-upc/transformer-contributions-nmt), whose default layer-wise normalisation
("min_sum" with the resultant's L1 norm) is the formula above.
"""

from __future__ import annotations

import numpy as np
import torch

from ctxmix.engine.arch import LayerWeights
from ctxmix.engine.layer import _diag_add, alti_layer, head_vectors, mix
from ctxmix.engine.models import Model
from ctxmix.engine.seq2seq import DecoderState, decoder_weights, encode_target, trace_seq2seq
from ctxmix.errors import BadInput
from ctxmix.methods.explanation import Explanation, provenance, top_tokens
from ctxmix.methods.mixing import _chunks, clipped_rows_note, norm_layer_maps, rollout
from ctxmix.methods.registry import MIXING_METHODS


def alti_plus_pieces(sw: LayerWeights, cw: LayerWeights, st: DecoderState, rows: torch.Tensor) -> dict:
    """The two blocks' decompositions for target rows `rows`, each (pieces, bias, real):

    "self": pieces (B, c, T, d) of the self-attention block output a over the layer inputs x_j;
    "cross": pieces (B, c, S + 1, d) of the cross block output b over the encoder outputs e_j and
    the residual a_i (last). pieces.sum(-2) + bias == real (B, c, d); the biases (b_O, the norm's
    beta) belong to no token, as in ALTI."""
    post = sw.position == "post"
    N = mix(st.alpha_self[:, :, rows], head_vectors(sw, st.x if post else sw.ln1(st.x), True))
    N = _diag_add(N, rows, st.x[:, rows])
    bias_s = sw.bo.expand_as(st.a[:, rows])
    P = mix(st.alpha_cross[:, :, rows], head_vectors(cw, st.e, True))
    P = torch.cat([P, st.a[:, rows].unsqueeze(-2)], -2)
    bias_c = cw.bo.expand_as(st.b[:, rows])
    if post:  # the block's LayerNorm, linear given the real vector's std
        s = sw.ln1.scale(st.h[:, rows])
        N, bias_s = sw.ln1.decompose_pieces(N, s), sw.ln1.decompose_bias(bias_s, s)
        s = cw.ln1.scale(st.c[:, rows])
        P, bias_c = cw.ln1.decompose_pieces(P, s), cw.ln1.decompose_bias(bias_c, s)
    return {"self": (N, bias_s, st.a[:, rows]), "cross": (P, bias_c, st.b[:, rows])}


def alti_plus_layer(sw: LayerWeights, cw: LayerWeights, st: DecoderState) -> torch.Tensor:
    """C^l = [C^l_enc | diag(c^l_res) C^l_self], (B, T, S + T): each target row's contributions from
    the encoder outputs and from the layer's target inputs; rows sum to one."""
    B, T, d = st.x.shape
    S = st.e.shape[1]
    acc = torch.promote_types(st.x.dtype, torch.float32)
    out = torch.zeros(B, T, S + T, dtype=acc, device=st.x.device)
    # a chunk of c rows holds (B, c, S + 1 + T, d) pieces: _chunks sizes (B, c, T, width) blocks
    for rows in _chunks(T, d * -(-(S + 1 + T) // T), copies=6, batch=B, device=st.x.device):
        rows = rows.to(st.x.device)
        P = alti_plus_pieces(sw, cw, st, rows)
        C_self = alti_layer(P["self"][0], P["self"][2])  # (B, c, T)
        C_cross = alti_layer(P["cross"][0], P["cross"][2])  # (B, c, S + 1)
        out[:, rows, :S] = C_cross[..., :S]
        out[:, rows, S:] = C_cross[..., S:] * C_self
    return out


def _only_alti(methods) -> None:
    methods = [methods] if isinstance(methods, str) else list(methods)
    if methods != ["alti"]:
        raise BadInput(
            f"with decoder_text, ctxmix computes ALTI+ (methods=['alti']), got {methods}; the other "
            "mixing methods explain the encoder alone (call explain without decoder_text)"
        )


def explain_seq2seq(model: Model, text: str, methods, decoder_text: str, position: int | None = None):
    """ALTI+ on one source text and its target (see the module docstring): an `Explanation` whose
    tokens are [source; decoder inputs] with segments 0 / 1, layer maps M^l and global maps R^l over
    them (one per decoder layer), and the saliency of row `position` (the last decoder input by
    default, the one that predicts the target's last token)."""
    _only_alti(methods)
    if not isinstance(text, str):
        raise BadInput("on an encoder-decoder model the source must be one string")
    src_ids, notes = model.encode(text)
    dec_ids, target_ids, more = encode_target(model, decoder_text)
    tr = trace_seq2seq(model, src_ids, dec_ids, notes + more)
    return alti_plus_explanation(model, tr, target_ids, position, {"decoder_text": decoder_text})


def explain_transcript(model: Model, inp, methods, decoder_text, position: int | None = None):
    """ALTI+ on a clip (`AudioInput`) and its transcript, Whisper's own (decoder_text=True, greedy) or one given as
    text (teacher-forced): the source positions are the encoder's frames."""
    from ctxmix.engine.transcribe import given_transcript, transcribe

    _only_alti(methods)
    script = transcribe(model, inp) if decoder_text is True else given_transcript(model, decoder_text)
    notes = [] if script.ended else [f"the transcript reached the decoder's {len(script.decoder_ids)} tokens unended"]
    from ctxmix.methods.speech import align_words

    tr = trace_seq2seq(model, inp, script.decoder_ids, notes)
    options = {"decoder_text": script.text, "transcript": script.text, "transcribed": decoder_text is True}
    options["words"] = [w.record() for w in align_words(model, tr, script, inp)]
    return alti_plus_explanation(model, tr, script.target_ids, position, options)


def alti_plus_explanation(model: Model, tr, target_ids: list[int], position: int | None, options: dict):
    """The ALTI+ `Explanation` of a traced source and decoder input (`Seq2SeqTrace`); target_ids[t]: what decoder
    row t predicts (-1: unknown)."""
    S, T = tr.n_source, len(tr.decoder_ids)
    n = S + T
    pos = n - 1 if position is None else position
    if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) or not -n <= pos < n:
        raise BadInput(f"position must be a token index in the {n} source and target tokens, got {position!r}")
    pos = int(pos) % n
    enc = norm_layer_maps(tr.encoder, ["alti"])["alti"]
    R_enc = rollout(enc, row_normalise=MIXING_METHODS["alti"].rollout_normalise)[-1]
    L = len(tr.decoder)
    M = np.zeros((L, n, n))
    M[:, :S, :S] = np.eye(S)
    for l, ((sw, cw), st) in enumerate(zip(decoder_weights(model), tr.decoder)):
        M[l, S:] = alti_plus_layer(sw, cw, st)[0].double().cpu().numpy()
    R = np.empty_like(M)
    prev = np.eye(n)
    prev[:S, :S] = R_enc
    for l in range(L):
        prev = R[l] = M[l] @ prev
    ex = Explanation(
        tokens=tr.encoder.tokens + model.tokens(tr.decoder_ids),
        input_ids=tr.encoder.input_ids + tr.decoder_ids,
        methods=["alti"],
        layer_maps={"alti": M},
        global_maps={"alti": R},
        saliency={"alti": R[-1, pos].copy()},
        position=pos,
        model_name=model.name,
        reconstruction_error=tr.reconstruction_error,
        warnings=list(tr.encoder.notes),
        segments=[0] * S + [1] * T,
        options={**options, "n_source": S, "method_variant": "ALTI+"},
        provenance=provenance(model),
    )
    notes = [
        clipped_rows_note(enc, R_enc[None], tr.encoder.tokens, "ALTI (encoder)"),
        clipped_rows_note(M[:, S:, :], R[:, S:, :], ex.tokens[S:], "ALTI+ (decoder)"),
    ]
    ex.warnings += [w for w in notes if w]
    if pos >= S and target_ids[pos - S] >= 0:
        t = pos - S
        ex.target = int(target_ids[t])
        ex.prediction = top_tokens(model, tr.logits[t], f"next token after position {pos}")
        ex.prediction["target_probability"] = float(torch.softmax(tr.logits[t].double(), -1)[ex.target])
    return ex


def source_contribution(ex, method: str = "alti") -> np.ndarray:
    """Each target token's total source contribution, (L, T): the sum of the source columns of
    its row in the global map after each decoder layer (ALTI+; 1 - this is the target prefix's share)."""
    if ex.segments is None or 1 not in ex.segments or method not in ex.global_maps:
        raise BadInput("source_contribution needs an explanation from explain(..., decoder_text=...)")
    seg = np.asarray(ex.segments)
    src, tgt = seg == 0, seg == 1
    return ex.global_maps[method][:, tgt][:, :, src].sum(-1)
