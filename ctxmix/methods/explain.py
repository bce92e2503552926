"""`explain`: every requested method on one text, from one traced forward pass.
(Over 500 lines: explain, explain_batch and scope_maps share their checks, encoding and per-sequence assembly.)"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from ctxmix.engine.encoding import check_input_ids, check_segments, encode_one  # noqa: F401 - callers import them here
from ctxmix.engine.models import Model
from ctxmix.engine.trace import Trace, TraceBatch, trace_batch_tensors, trace_ids
from ctxmix.errors import BadInput, checked_arguments
from ctxmix.methods.explanation import Explanation, provenance, top_tokens
from ctxmix.methods.memory import check_memory
from ctxmix.methods.mixing import (
    clipped_rows_note,
    head_maps_batch,
    mixing_maps_batch,
    rollout_tensor,
    scope_layer_maps,
)
from ctxmix.methods.registry import MIXING_METHODS, PER_HEAD_METHODS, PREDICTION_METHODS, check_methods


def default_position(model: Model, input_ids: list[int]) -> int:
    if model.spec.causal:
        return len(input_ids) - 1
    mask_id = getattr(model.tokenizer, "mask_token_id", None)
    if model.kind == "masked_lm" and mask_id is not None and mask_id in input_ids:
        return input_ids.index(mask_id)
    return 0


def prediction_of(model: Model, tr: Trace, position: int, top_k: int = 5) -> dict | None:
    """Label probabilities for classifiers; the top tokens at `position` for language models."""
    if tr.logits is None:
        return None
    logits = tr.logits
    if model.kind == "classifier":
        probs = torch.softmax(logits.reshape(-1).double(), -1).cpu().numpy()
        id2label = getattr(model.config, "id2label", None) or {}
        labels = [str(id2label.get(i, i)) for i in range(len(probs))]
        k = int(probs.argmax())
        return {"label": labels[k], "index": k, "probabilities": dict(zip(labels, map(float, probs)))}
    if logits.ndim == 2:
        what = "next token after" if model.spec.causal else "token at"
        # the row first: only (V,) goes to float64, never the (n, V) logits (4 GB at 4k tokens, V = 128k)
        return top_tokens(model, logits[position], f"{what} position {position}", top_k)
    return None


def explain(
    model: Model,
    text,
    methods,
    target=None,
    *,
    position: int | None = None,
    input_ids: list[int] | None = None,
    token_type_ids: list[int] | None = None,
    segments: list[int] | None = None,
    res2: str = "exact",
    precision: str | None = None,
    per_head: bool = False,
    foil=None,
    decoder_text: str | bool | None = None,
    embedding: str = "token",
    flow_rows: str = "position",
    decompx: dict | None = None,
    target_kind: str = "logit",
    image=None,
    audio=None,
    sampling_rate: int | None = None,
    **saliency_options,
) -> Explanation:
    """Run `methods` on `text` (or on `input_ids`, an `image` or `audio`) and return maps, saliency and prediction.

    text: one string, or a sentence pair (text_a, text_b) tokenised as the model's tokenizer pairs
    them; `Explanation.segments` then says which tokens belong to which text (0 / 1, -1 for special
    tokens), and every forward pass (trace, gradients, IG, CAT, blank-out) reads the pair's
    token_type_ids where the model has them. `cross_segment_mixing(ex)` summarises A->B and B->A mixing.
    input_ids: token ids instead of a text; with `segments=` (and optionally the model's own
    `token_type_ids=`) they are a pair: see `check_segments` for how one is derived from the other.

    target: the class (index or label) for gradient methods on classifiers, or the token id
    for language models; the predicted one by default.
    foil: a contrasting class or token ("why positive rather than negative", "why keys rather
    than key"): the gradient and perturbation methods then explain the logit difference
    l_target - l_foil (its sigmoid where a probability is needed); `Explanation.foil` records it.
    position: the output row whose aggregated map is a mixing method's saliency.
    precision: "float32" (exact), "tf32" or "bf16" for the large products of the scope and
    value-zeroing decompositions; the model's default (`load_model(..., precision=)`) if None.
    For a model loaded in float16/bfloat16 the decompositions run on float32 activations, and
    `reconstruction_error` then includes the model's own half-precision rounding.
    per_head: also fill `head_maps[m]` (L, H, n, n) for the requested methods that have a per-head
    form (`ctxmix.methods.registry.PER_HEAD_METHODS`: attention and norm; `python -m ctxmix methods` says how
    each relates to its layer map).
    decoder_text: on an encoder-decoder model (BART, Marian, mBART, M2M-100/NLLB), the target the
    decoder reads (teacher-forced): methods=["alti"] then gives ALTI+ (Ferrando et al., EMNLP 2022;
    `ctxmix.methods.alti_plus`), maps square over [source; decoder inputs] with segments 0 / 1, one per decoder
    layer; `ctxmix.source_contribution(ex)` is each target token's total source contribution.
    Without it, an encoder-decoder's mixing methods explain its encoder alone.

    The prediction methods (`ctxmix.methods.registry.PREDICTION_METHODS`: `logit`, `alti_logit` on causal
    language models) explain the target token's logit at `position` (minus the foil's), signed:
    `saliency[m]` (n,), `layer_saliency[m]` (L, n), `head_saliency[m]` (L, H, n) with per_head,
    `logit_contributions[m]` (the target's row, and the foil's), `logit_terms[m]` (what no token gets).
    embedding: "token" (the official code: the predicted position's own embedding is its token's part)
    or "term" (kept in logit_terms). See `ctxmix.methods.prediction`.
    `attention_flow` (Abnar & Zuidema 2020) fills `global_maps` (no rollout) and the saliency with the
    explained position's row; flow_rows="all" computes every row (the cost grows as about n^3 per row;
    `ctxmix.methods.flow`), else the other rows are NaN.
    decompx: DecompX's options {"bias": "absdot" | "none", "ff": "zero_origin" | "tangent", "head": bool}
    (`ctxmix.methods.decompx`).
    target_kind: what `logit` and `alti_logit` explain for the target token: "logit" (the raw logit, the
    default), "log_prob" (T1: log p = centred logit - H(p), -H(p) in logit_terms as "entropy") or
    "logit_prob" (T2: log p - log(1 - p)); the last two without a foil. `attribute_context` explains the
    same quantities per response token (`ctxmix.methods.readout.target_readout`).
    image: for a vision model (ViT, DINOv2, CLIP's vision tower), a path, PIL image or (H, W[, C]) array in place
    of `text`; the positions are the class token (and registers) and the patches row by row ("r{row}c{col}"),
    the mixing methods apply, and `options["image"]` records the grid (`ctxmix.engine.inputs`). The default
    position is the class token.
    audio: for a speech encoder (wav2vec2, HuBERT), a WAV path or a 1-D array with its `sampling_rate` (resampled
    to the model's 16 kHz); the positions are the feature encoder's frames ("0.000s", "0.020s", ...: each
    frame's start), and `options["audio"]` records the rate, the frames' stride and receptive field in samples,
    and the clip's sha256. The default position is the first frame.
    On Whisper, audio (up to 30 s) gives the encoder's 1,500 positions, 20 ms apart ("... pad": the feature
    extractor's padding past the clip), and the greedy transcript (`ex.transcript`); decoder_text=True (the model's
    own transcript) or a transcript string (teacher-forced) with methods=["alti"] gives ALTI+ over [frames;
    decoder inputs], as for text encoder-decoders.
    """
    if image is not None or audio is not None or model.spec.inputs != "ids":
        text_only = {"input_ids": input_ids, "token_type_ids": token_type_ids, "segments": segments, "decompx": decompx}
        given = [k for k, v in text_only.items() if v is not None]
        if decoder_text is not None and not (audio is not None and model.spec.encoder_decoder):
            given.append("decoder_text")
        if image is not None and audio is not None:
            raise BadInput("give an image or audio, not both")
        call = (text, image, audio, sampling_rate, decoder_text)
        saliency = {"target": target, "foil": foil, **saliency_options}
        return _input_call(model, call, methods, position, res2, precision, per_head, given, saliency)
    if decoder_text is not None or model.spec.encoder_decoder:
        unused = {
            "input_ids": input_ids,
            "token_type_ids": token_type_ids,
            "segments": segments,
            "foil": foil,
            "per_head": per_head or None,
            **saliency_options,
        }
        ex = _encoder_decoder_call(model, text, methods, decoder_text, position, unused)
        if ex is not None:
            return ex
    methods = check_methods(methods, model.spec.position)
    from ctxmix.methods.prediction import check_target_kind

    check_target_kind(target_kind, foil)
    if not isinstance(per_head, bool):
        raise BadInput(f"per_head must be True or False, got {per_head!r}")
    _check_call(res2, position, saliency_options)
    e = encode_one(model, text if input_ids is None else input_ids, token_type_ids, segments, ids=input_ids is not None)
    # attention flow's cost and DecompX's memory (and its options), refused before the forward pass
    check_batch_methods(model, [len(e.ids)], [list(methods)], embedding, flow_rows, decompx)
    check_memory(model, len(e.ids), call="explain", methods=methods)
    # the gradient and perturbation methods read the ids and the prediction only: no layer rebuilt for them
    layers = any(m in MIXING_METHODS or m in PREDICTION_METHODS for m in methods)
    tr = trace_ids(model, e.ids, e.notes, e.token_type_ids, e.segments, layers=layers)
    if foil is not None:
        saliency_options = {**saliency_options, "foil": foil}
    return _explanations(
        model,
        TraceBatch.of(tr),
        [methods],
        [target],
        [position],
        res2,
        precision,
        saliency_options,
        per_head,
        embedding=embedding,
        flow_rows=flow_rows,
        decompx=decompx,
        checked=True,
        target_kind=target_kind,
    )[0]


def _input_call(
    model: Model, call: tuple, methods, position, res2, precision, per_head, given, saliency: dict
) -> Explanation:
    """explain on an image or a clip (`call`: text, image, audio, sampling_rate, decoder_text): the mixing methods,
    from one traced pass over the input's positions, and on a classifier the gradient methods at layer 0's input;
    `given`: explain's text-only options the caller set (refused); `saliency`: target, foil and the saliency
    options (`_input_saliency`)."""
    from ctxmix.engine.inputs import audio_input, image_input, trace_input

    text, image, audio, sampling_rate, decoder_text = call
    kind, value = ("image", image) if image is not None else ("audio", audio)
    reads = {"pixels": "images", "audio": "audio", "ids": "text"}[model.spec.inputs]
    if (kind == "image" and model.spec.inputs != "pixels") or (kind == "audio" and model.spec.inputs != "audio"):
        raise BadInput(f"{model.name} is a {model.spec.family} model: it reads {reads}, not {kind}")
    if value is None or text is not None:
        how = "image=path_or_array" if model.spec.inputs == "pixels" else "audio=wav_path_or_array, sampling_rate=..."
        raise BadInput(f"{model.name} reads {reads}: explain(model, None, methods, {how})")
    if sampling_rate is not None and kind != "audio":
        given = [*given, "sampling_rate"]
    methods = check_methods(methods, model.spec.position)
    target, foil, options = _input_saliency(model, kind, methods, saliency, decoder_text)
    if given:
        raise BadInput(
            f"on {kind}, explain takes methods, position, res2, precision, per_head, target, foil and the gradient "
            f"options (got {', '.join(given)})"
        )
    _check_call(res2, position, options, inputs=True)
    inp = image_input(model, image) if kind == "image" else audio_input(model, audio, sampling_rate)
    if decoder_text is not None:  # Whisper's decoder: ALTI+ over the frames and the transcript
        from ctxmix.methods.alti_plus import explain_transcript

        check_memory(model, inp.n, call="explain", methods=["alti"])
        ex = explain_transcript(model, inp, methods, decoder_text, position)
    else:
        check_memory(model, inp.n, call="explain", methods=methods)  # before the pass
        tr = trace_input(model, inp)
        if foil is not None:
            options = {**options, "foil": foil}
        ex = _explanations(
            model, TraceBatch.of(tr), [methods], [target], [position], res2, precision, options, per_head
        )[0]
        if model.spec.encoder_decoder:  # Whisper: what the model heard, beside its encoder's mixing
            from ctxmix.engine.transcribe import transcribe

            ex.options["transcript"] = transcribe(model, inp).text
    ex.options[kind] = inp.record()  # what the positions are, in the saved explanation too
    ex.inputs = inp  # the picture `show` draws under the heat (not saved)
    return ex


GRADIENT_ON_INPUTS = ("grad", "grad_x_input", "integrated_gradients", "cat", "attcat")


def input_methods(model: Model) -> list[str]:
    """The methods explain runs on `model`'s images or clips: the mixing maps (the scopes of its norm position) and,
    on a classifier without a decoder, the gradient methods."""
    from ctxmix.methods.registry import scope_names

    methods = [m for m in MIXING_METHODS if not m.startswith("Atb")] + list(scope_names(model.spec.position))
    if model.kind == "classifier" and not model.spec.encoder_decoder:
        methods += list(GRADIENT_ON_INPUTS)
    return methods


def _input_saliency(model: Model, kind: str, methods: list[str], saliency: dict, decoder_text) -> tuple:
    """(target, foil, saliency options) of explain on an image or a clip: the gradient methods differentiate at layer
    0's input (the patch or frame embeddings: there are no word embeddings), IG from a blank input's (the mean
    colour, silence: a pre-LN model's first norm makes an all-zero layer-0 input a discontinuity), CAT with
    no position masked (these models take no attention mask); refused where there is no head to differentiate."""
    target, foil = saliency.pop("target"), saliency.pop("foil")
    what = "an image" if kind == "image" else "audio"
    other = [m for m in methods if m not in MIXING_METHODS and m not in GRADIENT_ON_INPUTS]
    grads = [m for m in methods if m in GRADIENT_ON_INPUTS]
    if other:
        raise BadInput(
            f"{', '.join(other)}: on {what}, explain runs the mixing methods ({', '.join(MIXING_METHODS)}) and, on a "
            f"classifier, {', '.join(GRADIENT_ON_INPUTS)}; the others read token ids"
        )
    if grads and (model.kind != "classifier" or decoder_text is not None or model.spec.encoder_decoder):
        raise BadInput(
            f"{', '.join(grads)}: the gradient methods explain a classifier's class; {model.name} "
            f"({model.kind}) has no class to differentiate. The mixing methods apply."
        )
    if not grads:
        set_ = [k for k, v in {"target": target, "foil": foil, **saliency}.items() if v is not None]
        if set_:
            raise BadInput(f"{', '.join(set_)}: options of the gradient methods, and none was asked for")
        return None, None, {}
    if saliency.get("grad_at", "embedding_output") != "embedding_output":
        raise BadInput(f"on {what} the gradients are taken at layer 0's input (grad_at='embedding_output')")
    if saliency.get("blank_replacement") is not None:
        raise BadInput("blank_replacement: blank-out replaces token ids, which images and clips do not have")
    if saliency.get("cat_mask_special"):
        raise BadInput(f"on {what} CAT and AttCAT mask no position (the model takes no attention mask)")
    options = {"grad_at": "embedding_output", **saliency}
    if "integrated_gradients" in grads:
        options.setdefault("ig_baseline", "blank")
    if {"cat", "attcat"} & set(grads):
        options["cat_mask_special"] = False
    return target, foil, options


def _encoder_decoder_call(model: Model, text, methods, decoder_text, position, unused: dict) -> Explanation | None:
    """explain's encoder-decoder cases: ALTI+ with decoder_text (`unused`: explain's other options,
    which must not be given then); None when the encoder alone is explained (mixing methods only:
    the gradient and perturbation methods need the decoder's output)."""
    if not model.spec.encoder_decoder:
        raise BadInput(
            f"decoder_text applies to encoder-decoder models (BART, Marian, mBART, M2M-100); "
            f"{model.name} is a {model.spec.family} model"
        )
    if decoder_text is None:
        _encoder_only_methods(methods)
        return None
    from ctxmix.methods.alti_plus import explain_seq2seq

    given = [k for k, v in unused.items() if v is not None]
    if given:
        raise BadInput(
            f"with decoder_text, explain takes a source text, methods and position only (got {', '.join(given)})"
        )
    return explain_seq2seq(model, text, methods, decoder_text, position)


def _encoder_only_methods(methods) -> None:
    names = [methods] if isinstance(methods, str) else list(methods or [])
    other = [m for m in names if m not in MIXING_METHODS]
    if other:
        raise BadInput(
            f"{', '.join(map(str, other))}: on an encoder-decoder model the gradient and perturbation "
            "methods are not available; give decoder_text= for ALTI+ over source and target, or use "
            "mixing methods to explain the encoder alone"
        )


def _trace_one(
    model: Model, text, input_ids, token_type_ids, segments, layers: bool = True, memory_call: str | None = None
) -> Trace:
    """The trace of one text, pair, or id list (with its segments / token types); layers=False: the
    logits only (`trace_ids`). memory_call: the call whose memory estimate is checked before the pass."""
    e = encode_one(model, text if input_ids is None else input_ids, token_type_ids, segments, ids=input_ids is not None)
    if memory_call is not None:
        check_memory(model, len(e.ids), call=memory_call)
    return trace_ids(model, e.ids, e.notes, e.token_type_ids, e.segments, layers=layers)


def _check_call(res2, position, saliency_options: dict, inputs: bool = False) -> None:
    """explain's options, checked before any work: a wrong value names the argument and what it takes (`inputs`: an
    image's or a clip's call, whose IG baselines are its own)."""
    from ctxmix.methods.saliency import INPUT_IG_BASELINES, check_saliency_options

    if res2 not in ("exact", "diagonal"):
        raise BadInput(f"res2 must be 'exact' or 'diagonal', got {res2!r}")
    if position is not None and (isinstance(position, bool) or not isinstance(position, (int, np.integer))):
        raise BadInput(
            f"position must be a whole number (a token index; negative counts from the end), got {position!r}"
        )
    # every keyword explain takes, read off its signature so the message cannot go stale
    own = ("model", "text", "methods", "saliency_options")
    keywords = [p for p in inspect.signature(explain).parameters if p not in own]
    check_saliency_options(saliency_options, keywords)
    baseline = saliency_options.get("ig_baseline")
    if inputs and baseline is not None and baseline not in INPUT_IG_BASELINES:
        raise BadInput(f"on an image or a clip ig_baseline is one of {', '.join(INPUT_IG_BASELINES)}, not {baseline!r}")
    if not inputs and baseline == "blank":
        raise BadInput("ig_baseline 'blank' is an image's or a clip's; on text choose pad, mask, unk or zero")


@checked_arguments
def explain_batch(
    model: Model,
    texts: list,
    methods,
    targets: list | None = None,
    positions: list | None = None,
    *,
    methods_per_text: list[list[str]] | None = None,
    res2: str = "exact",
    precision: str | None = None,
    per_head: bool = False,
    foils: list | None = None,
    token_type_ids: list | None = None,
    segments: list | None = None,
    embedding: str = "token",
    flow_rows: str = "position",
    decompx: dict | None = None,
    target_kind: str = "logit",
    **saliency_options,
) -> list[Explanation]:
    """`explain` on several texts (strings, pairs (a, b), or lists of token ids, these with
    optional `token_type_ids` / `segments`, one entry or None per text) with one padded forward pass and
    one batched decomposition for all their mixing methods; the gradient and perturbation methods
    still run per text. targets / positions / foils: one per text (None for the defaults; a foil
    makes the gradient and perturbation methods explain target minus foil, as in `explain`).
    methods_per_text: the methods each text needs, when they differ (a text with none only pads the
    batch); `methods` then is their union. Each Explanation equals `explain` on its text alone up to
    float rounding, every option of `explain` included (tests/test_batched.py); target_kind applies to every
    text (no foils with a kind other than "logit").
    The cost and memory checks of the prediction methods (attention flow's time, DecompX's memory)
    apply to each text at its own length, for the methods it asks for (`method_refusals`): a text that
    only pads the batch, or asks for other methods, never fails it; a text that asks for a method it is
    too long for is refused (BadInput naming it), as `explain` refuses it."""
    if isinstance(texts, (str, tuple)) or not texts:
        raise BadInput("explain_batch takes a non-empty list of texts (a sentence pair is one entry: [(a, b)])")
    methods = check_methods(methods, model.spec.position)
    if model.spec.encoder_decoder:
        _encoder_only_methods(methods)
    _check_call(res2, None, saliency_options)
    from ctxmix.methods.prediction import check_target_kind

    check_target_kind(target_kind, next((f for f in (foils or []) if f is not None), None))
    per = (
        [methods] * len(texts)
        if methods_per_text is None
        else [[m for m in methods if m in set(ms)] for ms in methods_per_text]
    )
    if len(per) != len(texts):
        raise BadInput("methods_per_text needs one list per text")
    for name, rows in (("token_type_ids", token_type_ids), ("segments", segments)):
        if rows is not None and len(rows) != len(texts):
            raise BadInput(f"{name} needs one entry (or None) per text")
    encs = [
        encode_one(
            model, t, None if token_type_ids is None else token_type_ids[k], None if segments is None else segments[k]
        )
        for k, t in enumerate(texts)
    ]
    # each text's cost and memory checks at its own length, before the forward pass
    check_batch_methods(model, [len(e.ids) for e in encs], per, embedding, flow_rows, decompx)
    tb = trace_batch_tensors(
        model,
        [e.ids for e in encs],
        [e.notes for e in encs],
        [e.token_type_ids for e in encs],
        [e.segments for e in encs],
    )
    targets = [None] * len(texts) if targets is None else list(targets)
    positions = [None] * len(texts) if positions is None else list(positions)
    foils = [None] * len(texts) if foils is None else list(foils)
    if len(targets) != len(texts) or len(positions) != len(texts) or len(foils) != len(texts):
        raise BadInput("targets, positions and foils need one entry per text")
    return _explanations(
        model,
        tb,
        per,
        targets,
        positions,
        res2,
        precision,
        saliency_options,
        bool(per_head),
        foils,
        embedding,
        flow_rows,
        decompx,
        checked=True,
        target_kind=target_kind,
    )


def method_refusals(
    model: Model,
    n: int,
    methods,
    *,
    embedding: str = "token",
    flow_rows: str = "position",
    decompx: dict | None = None,
) -> dict[str, str]:
    """{method: why not} for the methods of ONE text of n tokens that its length rules out (attention
    flow's time limit, DecompX's memory budget: `ctxmix.methods.prediction.check_prediction_call`);
    {} when every method fits. Attention flow's answer depends on (model, n, options) only; DecompX's
    also on the memory free at the time. The benchmark runner records these per (text, method) instead
    of failing the batch (`ctxmix.benchmark.compute.STABLE_REFUSALS`: which are kept, which retried).
    The options and the methods' fit to the model are checked first, at one token: an error there is no
    text's length and raises (BadInput)."""
    from ctxmix.methods.prediction import check_prediction_call

    predicting = [m for m in methods if m in PREDICTION_METHODS]
    if decompx is not None and "decompx" not in predicting:
        predicting.append("decompx")  # its options are checked even where this text does not ask for it
    if not predicting:
        return {}
    check_prediction_call(model, predicting, embedding, flow_rows, 1, decompx)
    out = {}
    for m in predicting:
        if m not in methods:
            continue
        try:
            check_prediction_call(model, [m], embedding, flow_rows, n, decompx if m == "decompx" else None)
        except BadInput as e:
            out[m] = str(e)
    return out


def check_batch_methods(
    model: Model,
    lengths: list[int],
    per: list[list[str]],
    embedding: str = "token",
    flow_rows: str = "position",
    decompx: dict | None = None,
) -> None:
    """Refuse (BadInput), before any work, the texts of a batch that ask for a method their own length
    rules out (`method_refusals`), naming each text, its length and the limit. A text checks only the
    methods it asks for; a text that asks for none (it pads the batch) is never checked."""
    from ctxmix.methods.prediction import check_prediction_call

    union = list(dict.fromkeys(m for ms in per for m in ms))
    predicting = [m for m in union if m in PREDICTION_METHODS]
    if not predicting:
        if decompx is not None:
            check_prediction_call(model, predicting, embedding, flow_rows, 1, decompx)  # "add 'decompx'"
        return
    if len(per) == 1:  # explain: the message of the check itself
        check_prediction_call(model, predicting, embedding, flow_rows, lengths[0], decompx)
        return
    check_prediction_call(model, predicting, embedding, flow_rows, 1, decompx)  # options, once
    why = [
        f"text {b} ({n} tokens), {m}: {msg}"
        for b, (n, ms) in enumerate(zip(lengths, per))
        for m, msg in method_refusals(model, n, ms, embedding=embedding, flow_rows=flow_rows, decompx=decompx).items()
    ]
    if why:
        raise BadInput("; ".join(why) + ". Leave the method out for those texts (methods_per_text=) or shorten them.")


def call_notes(methods, per_head: bool, foil, target_kind: str = "logit") -> list[str]:
    """The notes an explanation gets from its call's options, whatever was computed before: per_head
    on methods without a per-head form, a foil or a target_kind that no asked-for method reads."""
    notes = []
    if target_kind != "logit":
        if not any(m in ("logit", "alti_logit") for m in methods):
            notes.append(
                f"target_kind={target_kind!r} applies to the logit and alti_logit methods only; none was asked for"
            )
        elif "decompx" in methods:
            notes.append(f"target_kind={target_kind!r} applies to logit and alti_logit; decompx explains the logit")
    if per_head and not any(m in PER_HEAD_METHODS for m in methods):
        notes.append(
            f"per_head: none of {', '.join(methods)} has a per-head form (those that do: {', '.join(PER_HEAD_METHODS)})"
        )
    sal = [m for m in methods if m not in MIXING_METHODS and m not in PREDICTION_METHODS]
    pred = [m for m in methods if m in PREDICTION_METHODS and m != "attention_flow"]
    if foil is not None and not sal and not pred:
        notes.append("the foil applies to the gradient, perturbation and prediction methods only; none was asked for")
    return notes


def _explanations(
    model: Model,
    tb: TraceBatch,
    per: list[list[str]],
    targets: list,
    positions: list,
    res2: str,
    precision: str | None,
    saliency_options: dict,
    per_head: bool = False,
    foils: list | None = None,
    embedding: str = "token",
    flow_rows: str = "position",
    decompx: dict | None = None,
    checked: bool = False,
    target_kind: str = "logit",
) -> list[Explanation]:
    """Explanations of the sequences of one traced batch: the mixing maps of every method any
    sequence asks for in one batched computation, then per sequence its rollout, saliency and prediction.
    checked: the caller ran `check_batch_methods` already (explain_batch, before its forward pass)."""
    from ctxmix.engine.precision import resolve_precision

    precision = resolve_precision(model, precision)
    union = list(dict.fromkeys(m for ms in per for m in ms))
    if not checked:
        check_batch_methods(model, list(tb.lengths), per, embedding, flow_rows, decompx)
    # ALTI-Logit reads the ALTI layer maps, attention flow the head-mean attention: computed with the
    # others, reported only when asked for
    needed = list(union)
    needed += ["alti"] if "alti_logit" in union and "alti" not in union else []
    needed += ["attention"] if "attention_flow" in union and "attention" not in union else []
    maps = mixing_maps_batch(tb, needed, res2, precision) if needed else {}
    heads = head_maps_batch(tb, union) if per_head else {}
    errs = tb.sequence_errors()
    out = []
    shared = saliency_options
    for b, methods in enumerate(per):
        saliency_options = shared if foils is None or foils[b] is None else {**shared, "foil": foils[b]}
        tr = tb.trace(b, errs[b])
        n = tr.n
        pos = default_position(model, tr.input_ids) if positions[b] is None else int(positions[b])
        if not -n <= pos < n:
            raise BadInput(f"position {pos} is outside the {n} tokens")
        pos %= n
        ex = Explanation(
            tokens=tr.tokens,
            input_ids=tr.input_ids,
            methods=methods,
            position=pos,
            model_name=model.name,
            reconstruction_error=tr.reconstruction_error,
            warnings=list(tr.notes),
            segments=None if tr.segments is None else list(tr.segments),
            options={"res2": res2, "precision": precision, **saliency_options},
            provenance=provenance(model),
        )
        ex.prediction = prediction_of(model, tr, pos)
        for m in methods:
            if m in maps:
                lm = maps[m][b, :, :n, :n].double().cpu().numpy()
                # on the maps' device; attention_rollout's layer map already holds 0.5*A + 0.5*I
                rn = MIXING_METHODS[m].rollout_normalise
                gm = rollout_tensor(maps[m][b, :, :n, :n], row_normalise=rn).cpu().numpy()
                ex.layer_maps[m], ex.global_maps[m] = lm, gm
                ex.saliency[m] = gm[-1][pos].copy()
                note = clipped_rows_note(lm, gm, tr.tokens, m) if m == "alti" else None
                if note:
                    ex.method_warnings[m] = [note]
                    ex.warnings.append(note)
            if m in heads:
                ex.head_maps[m] = heads[m][b, :, :, :n, :n].cpu().numpy()
        ex.warnings += call_notes(methods, per_head, saliency_options.get("foil"), target_kind)
        ex.warnings += model.quantization_notes(tr.reconstruction_error)
        sal = [m for m in methods if m not in MIXING_METHODS and m not in PREDICTION_METHODS]
        pred = [m for m in methods if m in PREDICTION_METHODS]
        if "attention_flow" in pred:
            from ctxmix.methods.flow import attention_flow, flow_warnings

            A = maps["attention"][b, :, :n, :n].double().cpu().numpy()
            G = attention_flow(A, rows=None if flow_rows == "all" else [pos])
            ex.global_maps["attention_flow"], ex.saliency["attention_flow"] = G, G[-1][pos].copy()
            ex.options["flow_rows"] = flow_rows
            ex.method_warnings["attention_flow"] = flow_warnings(model.spec.causal)
            ex.warnings += [w for w in ex.method_warnings["attention_flow"] if w not in ex.warnings]
        if "decompx" in pred:
            from ctxmix.methods.decompx import decompx_fields

            before = len(ex.warnings)
            decompx_fields(ex, model, tr, targets[b], saliency_options.get("foil"), decompx)
            ex.method_warnings["decompx"] = ex.warnings[before:]
        logit = [m for m in pred if m in ("logit", "alti_logit")]
        if logit:
            from ctxmix.methods.prediction import prediction_fields

            alti = maps["alti"][b, :, :n, :n] if "alti_logit" in logit else None  # traced back on its device
            before = len(ex.warnings)
            prediction_fields(
                ex, model, tr, logit, targets[b], saliency_options.get("foil"), per_head, embedding, alti, target_kind
            )
            for m in logit:  # a soft-cap note concerns both
                ex.method_warnings[m] = ex.warnings[before:]
        if sal:
            from ctxmix.methods.saliency import resolve_foil, saliency_scores

            ex.target, scores = saliency_scores(model, tr, sal, target=targets[b], position=pos, **saliency_options)
            ex.foil = resolve_foil(model, tr, saliency_options.get("foil"), ex.target, pos)
            ex.saliency.update(scores)
        out.append(ex)
    return out


@checked_arguments
def scope_maps(
    model: Model,
    text=None,
    *,
    input_ids: list[int] | None = None,
    token_type_ids: list[int] | None = None,
    segments: list[int] | None = None,
    res2: str = "exact",
    precision: str | None = None,
) -> dict[str, np.ndarray]:
    """The FF paper's per-layer scope maps {scope: (L, n, n)} (no rollout: each attributes
    layer l's outputs to layer l's inputs). Post-LN keys Atb, AtbFf, AtbFfRes, AtbFfResLn;
    pre-LN keys Atb, AtbLn, AtbLnFf, AtbLnFfRes. res2="diagonal" gives the paper's printed RES2.
    text: one string or a sentence pair (text_a, text_b); precision: see `explain`."""
    from ctxmix.engine.precision import resolve_precision

    precision = resolve_precision(model, precision)
    _check_call(res2, None, {})
    tr = _trace_one(model, text, input_ids, token_type_ids, segments, memory_call="scope_maps")
    return scope_layer_maps(tr, res2=res2, precision=precision)
