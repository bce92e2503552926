"""The result of `explain`: the `Explanation` dataclass, its provenance, and how it is written.

A saved explanation is one compressed .npz: arrays as `layer/<method>`, `global/<method>`,
`saliency/<method>`, `head/<method>`; everything else (tokens, methods, prediction, options,
provenance) as one JSON string entry, `meta`, so the file opens with
`numpy.load(..., allow_pickle=False)` and can run no code. `ctxmix.export.saved` reopens it.

In a notebook: `show` draws the dashboard's figures, `_repr_html_` is a summary with the saliency
as heat rows (both in `ctxmix.export.notebook`, imported on use so `import ctxmix` needs no plotly),
and `to_frame` gives every array as one long table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ctxmix.engine.models import Model
from ctxmix.errors import BadInput

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

FORMAT = "ctxmix-explanation"
VERSION = 2  # layout version: 2 adds the prediction methods' arrays and logit_terms (version 1 still reads)
KINDS = ("layer", "global", "saliency", "head", "logit", "layer_saliency", "head_saliency")
# entry kind in the file -> Explanation attribute
KIND_FIELDS = {
    "layer": "layer_maps",
    "global": "global_maps",
    "saliency": "saliency",
    "head": "head_maps",
    "logit": "logit_contributions",
    "layer_saliency": "layer_saliency",
    "head_saliency": "head_saliency",
}

# How each array field becomes rows of `Explanation.to_frame`: (attribute, kind, the names of the
# array's axes after the method key). A field a later version adds needs one line here; fields not
# there yet are skipped (getattr), so the prediction methods' fields are listed already.
FRAME_FIELDS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("layer_maps", "layer_map", ("layer", "i", "j")),
    ("global_maps", "global_map", ("layer", "i", "j")),
    ("head_maps", "head_map", ("layer", "head", "i", "j")),
    ("saliency", "saliency", ("j",)),
    ("logit_contributions", "logit_contribution", ("class", "j")),
    ("layer_saliency", "layer_saliency", ("layer", "j")),
    ("head_saliency", "head_saliency", ("layer", "head", "j")),
)
FRAME_COLUMNS = ("kind", "method", "layer", "head", "class", "i", "j", "value")
FRAME_AXES = ("layer", "head", "class", "i", "j")
ONE_BASED = ("layer", "head")  # as the dashboard numbers them; token and class indices stay 0-based


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
    # {method: the warnings that method added} (a soft-cap note, attention flow's caveat): what the
    # results cache keeps per method; `warnings` holds them all with the trace's and the call's notes
    method_warnings: dict[str, list[str]] = field(default_factory=dict, repr=False)
    head_maps: dict[str, np.ndarray] = field(default_factory=dict)  # (L, H, n, n), with per_head=True
    segments: list[int] | None = None  # per token: 0 = text A, 1 = text B (of a pair), -1 = special token
    options: dict = field(default_factory=dict)  # res2, precision and the saliency options used
    provenance: dict = field(default_factory=dict)  # ctxmix version, model, dtype, date
    # the prediction methods (`ctxmix.methods.registry.PREDICTION_METHODS`): signed contributions to a logit
    logit_contributions: dict[str, np.ndarray] = field(default_factory=dict)  # (C, n) classes; LMs: target (, foil)
    layer_saliency: dict[str, np.ndarray] = field(default_factory=dict)  # (L, n) per layer and source token
    head_saliency: dict[str, np.ndarray] = field(default_factory=dict)  # (L, H, n), with per_head=True
    logit_terms: dict[str, dict] = field(default_factory=dict)  # what no token gets (lists: per layer)
    # the image or clip explained (`ImageInput`, `AudioInput`), for `show`'s picture: held in memory, never saved
    inputs: Any = field(default=None, repr=False, compare=False)

    def row(self, method: str, position: int | None = None, layer: int | None = None) -> np.ndarray:
        """Row `position` (default: the explained one) of `method`'s aggregated map, or of layer `layer`'s (1-based):
        (n,); a gradient method's scores (`map_row`)."""
        return map_row(self, method, position, layer)

    @property
    def transcript(self) -> str | None:
        """A speech recogniser's transcript of the clip explained (Whisper), else None."""
        return self.options.get("transcript")

    def save(self, path, half: bool = False) -> Path:
        """Write everything to one compressed .npz (metadata as a JSON string entry, so it opens
        with allow_pickle=False); `half=True` stores the maps in float16, "for viewing" (about
        half the size; saliency stays float64). Reopen with `ctxmix.load_explanation`."""
        p = Path(path)
        if p.suffix != ".npz":
            p = p.with_name(p.name + ".npz")
        if p.is_dir():
            raise BadInput(f"{p} is a folder; give a file name")
        arrays = _arrays(self, half)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp")
        with open(tmp, "wb") as fh:
            np.savez_compressed(fh, **arrays)
        tmp.replace(p)
        return p

    def to_bytes(self, half: bool = False) -> bytes:
        """The saved-explanation file as bytes (what `save` writes)."""
        import io

        buf = io.BytesIO()
        np.savez_compressed(buf, **_arrays(self, half))
        return buf.getvalue()

    def to_dict(self) -> dict:
        """JSON-ready dict (lists of floats)."""
        return {
            "model": self.model_name,
            "tokens": self.tokens,
            "input_ids": self.input_ids,
            "methods": self.methods,
            "position": self.position,
            "target": self.target,
            "foil": self.foil,
            "segments": self.segments,
            "prediction": self.prediction,
            "reconstruction_error": self.reconstruction_error,
            "warnings": self.warnings,
            "saliency": {m: v.tolist() for m, v in self.saliency.items()},
            "layer_maps": {m: v.tolist() for m, v in self.layer_maps.items()},
            "global_maps": {m: v.tolist() for m, v in self.global_maps.items()},
            "logit_contributions": {m: v.tolist() for m, v in self.logit_contributions.items()},
            "layer_saliency": {m: v.tolist() for m, v in self.layer_saliency.items()},
            "head_saliency": {m: v.tolist() for m, v in self.head_saliency.items()},
            "logit_terms": self.logit_terms,
        }

    def __repr__(self) -> str:
        # the dataclass's own repr prints every array in full: pages for one sentence
        L = next((a.shape[0] for a in (*self.layer_maps.values(), *self.global_maps.values())), None)
        head = " ".join(self.tokens[:8]) + (" …" if len(self.tokens) > 8 else "")
        pred = f", prediction={self.prediction.get('label')!r}" if self.prediction else ""
        return (
            f"Explanation(model={self.model_name!r}, {len(self.tokens)} tokens {head!r}, methods={self.methods}"
            + (f", layers={L}" if L else "")
            + pred
            + f", position={self.position}, target={self.target}, foil={self.foil})"
        )

    def _repr_html_(self) -> str:
        """The notebook's view: model, tokens, methods, prediction, target / foil / position, and each
        method's saliency as a row of tokens coloured by value (scaled by the row's max |value|; blue
        positive, red negative; hover for the exact value). Tokens are HTML-escaped; at most 512 shown."""
        from ctxmix.export.notebook import summary_html

        return summary_html(self)

    def show(
        self,
        method: str | None = None,
        kind: str | None = None,
        layer: int | None = None,
        head: int | None = None,
        **kw,
    ) -> go.Figure:
        """The plotly figure the dashboard shows for one view of this explanation.

        kind (None: "image" for an image, "clip" for a clip, else "saliency"):
          "saliency": every method's saliency, a row each (only `method`'s when given);
          "maps": `method`'s map of `layer` beside its map aggregated up to `layer`;
          "layer" / "global": one of those two (n, n) maps, on the colour scale of all its layers;
          "heads": every layer and head of `head_maps[method]` (explain(..., per_head=True)), or with
            `head=` that head's (n, n) map at `layer`;
          "scopes": the FF paper's scope maps (Atb, AtbFf, ...; explain them as methods) of `layer`;
          "pair": A→B and B→A mixing of a sentence pair per layer (`cross_segment_mixing`);
          "source": ALTI+ source contribution of each target token per decoder layer (an
            encoder-decoder explained with decoder_text);
          "prediction": a prediction method's `logit_contributions[method]`, one bar chart per row (a
            classifier's classes for decompx; a causal LM's explained token and foil), blue up, red down;
          "layer_saliency": Logit / ALTI-Logit's `layer_saliency[method]` (L, n) as a layers x tokens
            heat map, with `logit_terms` (what no token gets, per layer) beside it.
          The last two are the dashboard's "How the context builds the prediction" figures: explain with
          "decompx" (classifiers, causal LMs), "logit" or "alti_logit" (causal LMs) to get them.
          "image" / "clip": one row (`position=`, default the explained one) of `method`'s aggregated map, or of
            `layer`'s, over the image's patches or under the clip's spectrogram or waveform with the transcript's
            words, as the Images and Speech pages draw it; a saved explanation holds no pixels: give
            `inputs=ctxmix.engine.inputs.image_input(model, photo)` (or `audio_input`) to draw them.
        method: None picks the first method that has what the kind needs (for "saliency", "scopes"
        and "pair": all of them). layer, head: 1-based, as the dashboard numbers them; layer
        defaults to the last, head to 1. kw: passed to the figure builder in `ctxmix.export.plots`
        (e.g. title=, zmax=, normalise=).
        Raises BadInput, naming the valid choices, for an unknown kind or method, a layer or head out
        of range, or a kind this explanation has no data for.
        """
        from ctxmix.export.notebook import show

        return show(self, method, kind, layer, head, **kw)

    def to_frame(self) -> pd.DataFrame:
        """Every array as one tidy long table, a row per cell, columns exactly
        `kind, method, layer, head, class, i, j, value`.

        kind: "layer_map" and "global_map" (layer, i, j), "head_map" (layer, head, i, j), "saliency"
        (j); and once the prediction methods fill them "logit_contribution" (class, j),
        "layer_saliency" (layer, j), "head_saliency" (layer, head, j). A column that does not apply
        to a kind is empty (<NA>; pandas' nullable Int64). layer and head are 1-based, as the
        dashboard shows them: array index + 1; i (output token), j (input token) and class are
        0-based array indices, so `ex.tokens[j]` names token j and the layer_map row (layer=l, i, j)
        is `layer_maps[method][l - 1, i, j]`. kind and method are categoricals. Rows go field by
        field, method by method, cells in array (C) order.
        """
        import pandas as pd

        kinds, methods, values = [], [], []
        axes: dict[str, list[np.ndarray]] = {a: [] for a in FRAME_AXES}
        masks: dict[str, list[np.ndarray]] = {a: [] for a in FRAME_AXES}
        counts = []
        for attr, kind, names in FRAME_FIELDS:
            for m, a in (getattr(self, attr, None) or {}).items():
                a = np.asarray(a, dtype=np.float64)
                if a.ndim != len(names):
                    raise BadInput(f"{attr}[{m!r}] has shape {a.shape}; expected axes {names}")
                size = a.size
                idx = dict(zip(names, np.unravel_index(np.arange(size), a.shape)))  # C order, as a.ravel()
                for ax in FRAME_AXES:
                    got = idx.get(ax)
                    axes[ax].append(np.zeros(size, np.int64) if got is None else got + (ax in ONE_BASED))
                    masks[ax].append(np.full(size, got is None))
                kinds.append(kind)
                methods.append(m)
                values.append(a.ravel())
                counts.append(size)
        cat = {c: list(dict.fromkeys(v)) for c, v in (("kind", kinds), ("method", methods))}
        kind_codes = np.repeat([cat["kind"].index(k) for k in kinds], counts).astype(np.int64)
        method_codes = np.repeat([cat["method"].index(m) for m in methods], counts).astype(np.int64)
        cols = {
            "kind": pd.Categorical.from_codes(kind_codes, categories=cat["kind"]),
            "method": pd.Categorical.from_codes(method_codes, categories=cat["method"]),
        }
        for ax in FRAME_AXES:
            v = np.concatenate(axes[ax]) if axes[ax] else np.zeros(0, np.int64)
            mask = np.concatenate(masks[ax]) if masks[ax] else np.zeros(0, bool)
            cols[ax] = pd.arrays.IntegerArray(v, mask)
        cols["value"] = np.concatenate(values) if values else np.zeros(0)
        return pd.DataFrame(cols, columns=list(FRAME_COLUMNS), copy=False)  # the columns are fresh arrays already


def _arrays(ex: Explanation, half: bool) -> dict:
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "tokens": ex.tokens,
        "input_ids": ex.input_ids,
        "methods": ex.methods,
        "prediction": ex.prediction,
        "position": ex.position,
        "target": ex.target,
        "foil": ex.foil,
        "segments": ex.segments,
        "model_name": ex.model_name,
        "reconstruction_error": ex.reconstruction_error,
        "warnings": ex.warnings,
        "options": ex.options,
        "provenance": ex.provenance,
        "logit_terms": ex.logit_terms,
        "maps_dtype": "float16" if half else "float64",
    }
    arrays = {"meta": np.array(json.dumps(meta, default=str))}
    for kind, attr in KIND_FIELDS.items():
        for m, a in getattr(ex, attr).items():
            a = np.asarray(a, dtype=np.float64)
            maps = kind in ("layer", "global", "head")  # half=True rounds the maps only: signed scores stay exact
            arrays[f"{kind}/{m}"] = a.astype(np.float16) if half and maps else a
    return arrays


def map_row(ex: Explanation, method: str, position: int | None = None, layer: int | None = None) -> np.ndarray:
    """Row `position` (default: the explanation's) of `method`'s aggregated map, or of layer `layer`'s own map
    (1-based): (n,) float64. A gradient method (no map) gives its saliency, which is the explained position's
    (a classifier's class) only."""
    pos = ex.position if position is None else int(position)
    n = len(ex.tokens)
    if not 0 <= pos < n:
        raise BadInput(f"position {pos} is outside the {n} positions")
    if method in ex.saliency and method not in ex.global_maps and method not in ex.layer_maps:
        if pos != ex.position or layer is not None:
            raise BadInput(f"{method} scores the explained output (position {ex.position}) only: it has no map")
        return np.asarray(ex.saliency[method], dtype=float)
    if layer is None:
        if method not in ex.global_maps:
            raise BadInput(f"{method!r} was not computed for this explanation ({', '.join(ex.global_maps)})")
        return np.asarray(ex.global_maps[method][-1][pos], dtype=float)
    if method not in ex.layer_maps:
        raise BadInput(f"{method!r} has no layer maps in this explanation ({', '.join(ex.layer_maps)})")
    L = ex.layer_maps[method].shape[0]
    if not 1 <= layer <= L:
        raise BadInput(f"layer {layer} is outside 1..{L}")
    return np.asarray(ex.layer_maps[method][layer - 1][pos], dtype=float)


def provenance(model: Model) -> dict:
    """Who made an explanation: ctxmix version, model, its weights' SHA-256, dtype, date."""
    import datetime

    from ctxmix import __version__
    from ctxmix.engine.fingerprint import weights_sha256

    return {
        "ctxmix_version": __version__,
        "model": model.name,
        "model_family": model.spec.family,
        "model_causal": model.spec.causal,
        "weights_sha256": weights_sha256(model),
        "model_dtype": str(model.dtype).replace("torch.", ""),
        "model_info": {k: v for k, v in model.info.items() if k != "weights"},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def top_tokens(model: Model, logits: torch.Tensor, what: str, top_k: int = 5) -> dict:
    """An `Explanation.prediction` for one row of language-model logits (vocab,): the top tokens
    and their probabilities (softmax in float64); `what` says which position predicts them."""
    p = torch.softmax(logits.double(), -1)
    top = torch.topk(p, min(top_k, p.numel()))
    toks = model.tokens(top.indices.tolist())
    return {
        "label": toks[0],
        "index": int(top.indices[0]),
        "what": what,
        "probabilities": {t: float(v) for t, v in zip(toks, top.values)},
    }
