"""The result of `explain`: the `Explanation` dataclass, its provenance, and how it is written.

A saved explanation is one compressed .npz: arrays as `layer/<method>`, `global/<method>`,
`saliency/<method>`, `head/<method>`; everything else (tokens, methods, prediction, options,
provenance) as one JSON string entry, `meta`, so the file opens with
`numpy.load(..., allow_pickle=False)` and can run no code. `ctxmix.export.saved` reopens it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ctxmix.engine.models import Model
from ctxmix.errors import BadInput

FORMAT = "ctxmix-explanation"
VERSION = 1  # layout version
KINDS = ("layer", "global", "saliency", "head")


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
    segments: list[int] | None = None  # per token: 0 = text A, 1 = text B (of a pair), -1 = special token
    options: dict = field(default_factory=dict)  # res2, precision and the saliency options used
    provenance: dict = field(default_factory=dict)  # ctxmix version, model, dtype, date

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
        }


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
        "maps_dtype": "float16" if half else "float64",
    }
    arrays = {"meta": np.array(json.dumps(meta, default=str))}
    for kind, maps in (
        ("layer", ex.layer_maps),
        ("global", ex.global_maps),
        ("saliency", ex.saliency),
        ("head", ex.head_maps),
    ):
        for m, a in maps.items():
            a = np.asarray(a, dtype=np.float64)
            arrays[f"{kind}/{m}"] = a.astype(np.float16) if half and kind != "saliency" else a
    return arrays


def provenance(model: Model) -> dict:
    """Who made an explanation: ctxmix version, model, its weights' SHA-256, dtype, date."""
    import datetime

    from ctxmix import __version__
    from ctxmix.engine.models import weights_sha256

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
