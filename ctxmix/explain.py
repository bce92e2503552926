"""`explain`: every requested method on one text, from one traced forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import BadInput, checked_arguments
from .methods import (MIXING_METHODS, PER_HEAD_METHODS, check_methods, head_maps_batch, mixing_maps_batch, rollout,
                      scope_layer_maps)
from .models import Model
from .trace import Trace, TraceBatch, trace, trace_batch_tensors, trace_ids


@dataclass
class Explanation:
    """Result of `explain`. Maps are numpy (L, n, n), rows = output tokens, columns = inputs.

    `position` is the row whose aggregated map gives a mixing method's saliency: [CLS] for
    encoders and classifiers, the first mask token for masked LMs, the last token for causal LMs.
    """

    tokens: list[str]
    input_ids: list[int]
    methods: list[str]
    layer_maps: dict[str, np.ndarray] = field(default_factory=dict)
    global_maps: dict[str, np.ndarray] = field(default_factory=dict)
    saliency: dict[str, np.ndarray] = field(default_factory=dict)
    prediction: dict | None = None
    position: int = 0
    target: int | None = None
    foil: int | None = None  # with a foil, the gradient and perturbation methods explain target minus foil
    model_name: str = ""
    reconstruction_error: float = 0.0
    warnings: list[str] = field(default_factory=list)
    head_maps: dict[str, np.ndarray] = field(default_factory=dict)  # (L, H, n, n), with per_head=True
    options: dict = field(default_factory=dict)  # res2, precision and the saliency options used
    provenance: dict = field(default_factory=dict)  # ctxmix version, model, dtype, date

    def save(self, path, half: bool = False) -> "Path":
        """Write everything to one compressed .npz (metadata as a JSON string entry, so it opens
        with allow_pickle=False); `half=True` stores the maps in float16, "for viewing" (about
        half the size; saliency stays float64). Reopen with `ctxmix.load_explanation`."""
        from .saved import save_explanation

        return save_explanation(self, path, half=half)

    def to_dict(self) -> dict:
        """JSON-ready dict (lists of floats)."""
        return {
            "model": self.model_name,
            "tokens": self.tokens,
            "input_ids": self.input_ids,
            "methods": self.methods,
            "position": self.position,
            "target": self.target,
            "prediction": self.prediction,
            "reconstruction_error": self.reconstruction_error,
            "warnings": self.warnings,
            "saliency": {m: v.tolist() for m, v in self.saliency.items()},
            "layer_maps": {m: v.tolist() for m, v in self.layer_maps.items()},
            "global_maps": {m: v.tolist() for m, v in self.global_maps.items()},
        }


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
    logits = tr.logits.double()
    if model.kind == "classifier":
        p = torch.softmax(logits.reshape(-1), -1).cpu().numpy()
        id2label = getattr(model.config, "id2label", None) or {}
        labels = [str(id2label.get(i, i)) for i in range(len(p))]
        k = int(p.argmax())
        return {"label": labels[k], "index": k, "probabilities": dict(zip(labels, map(float, p)))}
    if logits.ndim == 2:
        p = torch.softmax(logits[position], -1)
        top = torch.topk(p, min(top_k, p.numel()))
        toks = model.tokens(top.indices.tolist())
        what = "next token after" if model.spec.causal else "token at"
        return {"label": toks[0], "index": int(top.indices[0]), "what": f"{what} position {position}",
                "probabilities": {t: float(v) for t, v in zip(toks, top.values)}}
    return None


def explain(model: Model, text: str | None, methods, target=None, *, position: int | None = None,
            input_ids: list[int] | None = None, res2: str = "exact", precision: str | None = None,
            per_head: bool = False, foil=None, **saliency_options) -> Explanation:
    """Run `methods` on `text` (or on `input_ids`) and return maps, saliency and prediction.

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
    form (`ctxmix.methods.PER_HEAD_METHODS`: attention and norm; `python -m ctxmix methods` says how
    each relates to its layer map).
    """
    methods = check_methods(methods, model.spec.position)
    if not isinstance(per_head, bool):
        raise BadInput(f"per_head must be True or False, got {per_head!r}")
    _check_call(res2, position, saliency_options)
    if input_ids is None:
        if not isinstance(text, str):
            raise BadInput(f"text must be a string (or give input_ids=), got {type(text).__name__}")
        tr = trace(model, text)
    else:
        tr = trace_ids(model, check_input_ids(model, input_ids))
    if foil is not None:
        saliency_options = {**saliency_options, "foil": foil}
    return _explanations(model, TraceBatch.of(tr), [methods], [target], [position], res2, precision,
                         saliency_options, per_head)[0]


def check_input_ids(model: Model, input_ids) -> list[int]:
    """Token ids as a list of ints inside the vocabulary and the model's length."""
    if isinstance(input_ids, (str, bytes)) or not hasattr(input_ids, "__iter__"):
        raise BadInput("input_ids must be a list of token ids")
    ids = list(input_ids)
    if not ids:
        raise BadInput("input_ids is empty")
    V = max(int(getattr(model.config, "vocab_size", 0) or 0), len(model.tokenizer))
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= int(i) < V:
            raise BadInput(f"input_ids must be whole numbers from 0 to {V - 1}, got {i!r}")
    if len(ids) > model.max_length:
        raise BadInput(f"input_ids has {len(ids)} tokens; the model takes at most {model.max_length}")
    return [int(i) for i in ids]


def _check_call(res2, position, saliency_options: dict) -> None:
    """explain's options, checked before any work: a wrong value names the argument and what it takes."""
    from .saliency import check_saliency_options

    if res2 not in ("exact", "diagonal"):
        raise BadInput(f"res2 must be 'exact' or 'diagonal', got {res2!r}")
    if position is not None and (isinstance(position, bool) or not isinstance(position, (int, np.integer))):
        raise BadInput(f"position must be a whole number (a token index; negative counts from the end), got {position!r}")
    check_saliency_options(saliency_options)


@checked_arguments
def explain_batch(model: Model, texts: list, methods, targets: list | None = None, positions: list | None = None, *,
                  methods_per_text: list[list[str]] | None = None, res2: str = "exact", precision: str | None = None,
                  per_head: bool = False, foils: list | None = None, **saliency_options) -> list[Explanation]:
    """`explain` on several texts (strings, or lists of token ids) with one padded forward pass and
    one batched decomposition for all their mixing methods; the gradient and perturbation methods
    still run per text. targets / positions / foils: one per text (None for the defaults; a foil
    makes the gradient and perturbation methods explain target minus foil, as in `explain`).
    methods_per_text: the methods each text needs, when they differ (a text with none only pads the
    batch); `methods` then is their union. Each Explanation equals `explain` on its text alone up to
    float rounding (tests/test_batched.py)."""
    if isinstance(texts, (str, tuple)) or not texts:
        raise BadInput("explain_batch takes a non-empty list of texts")
    methods = check_methods(methods, model.spec.position)
    _check_call(res2, None, saliency_options)
    per = [methods] * len(texts) if methods_per_text is None else [
        [m for m in methods if m in set(ms)] for ms in methods_per_text]
    if len(per) != len(texts):
        raise BadInput("methods_per_text needs one list per text")
    batch, notes = [], []
    for t in texts:
        if isinstance(t, str):
            ids, note = model.encode(t)
        else:
            ids, note = check_input_ids(model, t), []
        batch.append(ids)
        notes.append(note)
    tb = trace_batch_tensors(model, batch, notes)
    targets = [None] * len(texts) if targets is None else list(targets)
    positions = [None] * len(texts) if positions is None else list(positions)
    foils = [None] * len(texts) if foils is None else list(foils)
    if len(targets) != len(texts) or len(positions) != len(texts) or len(foils) != len(texts):
        raise BadInput("targets, positions and foils need one entry per text")
    return _explanations(model, tb, per, targets, positions, res2, precision, saliency_options, bool(per_head),
                         foils)


def _provenance(model: Model) -> dict:
    import datetime

    from . import __version__
    from .models import weights_sha256

    return {"ctxmix_version": __version__, "model": model.name, "model_family": model.spec.family,
            "weights_sha256": weights_sha256(model),
            "model_dtype": str(model.dtype).replace("torch.", ""), "model_info": {k: v for k, v in model.info.items()
                                                                                if k != "weights"},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _explanations(model: Model, tb: TraceBatch, per: list[list[str]], targets: list, positions: list, res2: str,
                  precision: str | None, saliency_options: dict, per_head: bool = False,
                  foils: list | None = None) -> list[Explanation]:
    """Explanations of the sequences of one traced batch: the mixing maps of every method any
    sequence asks for in one batched computation, then per sequence its rollout, saliency and prediction."""
    from .precision import resolve_precision

    precision = resolve_precision(model, precision)
    union = list(dict.fromkeys(m for ms in per for m in ms))
    maps = mixing_maps_batch(tb, union, res2, precision) if union else {}
    heads = head_maps_batch(tb, union) if per_head else {}
    errs = tb.errors.tolist()
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
        ex = Explanation(tokens=tr.tokens, input_ids=tr.input_ids, methods=methods, position=pos,
                         model_name=model.name, reconstruction_error=tr.reconstruction_error, warnings=list(tr.notes),
                         options={"res2": res2, "precision": precision, **saliency_options},
                         provenance=_provenance(model))
        ex.prediction = prediction_of(model, tr, pos)
        for m in methods:
            if m in maps:
                lm = maps[m][b, :, :n, :n].double().cpu().numpy()
                # attention_rollout's layer map already holds 0.5*A + 0.5*I
                gm = rollout(lm, row_normalise=MIXING_METHODS[m].rollout_normalise)
                ex.layer_maps[m], ex.global_maps[m] = lm, gm
                ex.saliency[m] = gm[-1][pos].copy()
            if m in heads:
                ex.head_maps[m] = heads[m][b, :, :, :n, :n].cpu().numpy()
        if per_head and not any(m in heads for m in methods):
            ex.warnings.append(f"per_head: none of {', '.join(methods)} has a per-head form "
                               f"(those that do: {', '.join(PER_HEAD_METHODS)})")
        sal = [m for m in methods if m not in MIXING_METHODS]
        if saliency_options.get("foil") is not None and not sal:
            ex.warnings.append("the foil applies to the gradient and perturbation methods only; none was asked for")
        if sal:
            from .saliency import saliency_scores

            from .saliency import resolve_foil

            ex.target, scores = saliency_scores(model, tr, sal, target=targets[b], position=pos, **saliency_options)
            ex.foil = resolve_foil(model, tr, saliency_options.get("foil"), ex.target, pos)
            ex.saliency.update(scores)
        out.append(ex)
    return out


@checked_arguments
def scope_maps(model: Model, text: str | None = None, *, input_ids: list[int] | None = None,
               res2: str = "exact", precision: str | None = None) -> dict[str, np.ndarray]:
    """The FF paper's per-layer scope maps {scope: (L, n, n)} (no rollout: each attributes
    layer l's outputs to layer l's inputs). Post-LN keys Atb, AtbFf, AtbFfRes, AtbFfResLn;
    pre-LN keys Atb, AtbLn, AtbLnFf, AtbLnFfRes. res2="diagonal" gives the paper's printed RES2.
    precision: see `explain`."""
    from .precision import resolve_precision

    precision = resolve_precision(model, precision)
    _check_call(res2, None, {})
    if input_ids is None and not isinstance(text, str):
        raise BadInput(f"text must be a string (or give input_ids=), got {type(text).__name__}")
    tr = trace(model, text) if input_ids is None else trace_ids(model, check_input_ids(model, input_ids))
    return scope_layer_maps(tr, res2=res2, precision=precision)
