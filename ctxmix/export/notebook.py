"""An explanation in a notebook: `Explanation.show` (the dashboard's figures, picked by a kind) and
`Explanation._repr_html_` (a compact summary with each method's saliency as a heat row).

Imported lazily by `ctxmix.methods.explanation`, so `import ctxmix` stays free of plotly. Every
figure comes from `ctxmix.export.plots`, built as the dashboard's views build it
(`ctxmix_dashboard/ui/views.py`): a notebook and the dashboard show the same thing.
"""

from __future__ import annotations

import html
import inspect

import numpy as np

from ctxmix.errors import BadInput
from ctxmix.methods.registry import MIXING_METHODS, POST_LN_SCOPES, PRE_LN_SCOPES, SANDWICH_SCOPES

KINDS = {  # kind: what it draws, and what the explanation needs for it
    "saliency": ("every method's saliency (or one method's), a row each", "a method with a saliency"),
    "maps": ("a method's map of one layer beside its map aggregated up to that layer", "a mixing method's maps"),
    "layer": ("a method's map of one layer", "a mixing method's maps"),
    "global": ("a method's map aggregated up to one layer", "a mixing method's maps"),
    "heads": ("every head of every layer, or with head= one head's map", "explain(..., per_head=True)"),
    "scopes": ("the FF paper's scope maps of one layer", "scope methods (Atb, AtbFf, ...) among the methods"),
    "pair": ("a sentence pair's A→B and B→A mixing per layer", "a pair: explain(model, (text_a, text_b), ...)"),
    "source": ("ALTI+ source contribution per decoder layer", "an encoder-decoder explained with decoder_text="),
    "prediction": (
        "a prediction method's signed parts of each logit, a bar per input token (per class, or the explained "
        "token and foil)",
        "a prediction method's logit_contributions: explain with 'decompx' (a classifier or a causal LM), "
        "'logit' or 'alti_logit' (a causal LM)",
    ),
    "layer_saliency": (
        "Logit / ALTI-Logit's layers x tokens table, with the parts no token gets beside it",
        "a layer_saliency: explain a causal LM with 'logit' or 'alti_logit'",
    ),
    "image": (
        "one row (position=, default the explained one) over the image's patches, aggregated or of layer=; over the "
        "photograph when the explanation holds it (else inputs=image_input(model, photo))",
        "an image explained: explain(model, None, methods, image=...)",
    ),
    "clip": (
        "one row (position=) over the clip's frames, aggregated or of layer=, under its spectrogram or waveform when "
        "the explanation holds the clip (else inputs=audio_input(model, clip)), with the transcript's words",
        "a clip explained: explain(model, None, methods, audio=...)",
    ),
}
LAYERED = ("maps", "layer", "global", "heads", "scopes", "image", "clip")  # the kinds that take layer=
HTML_MAX_TOKENS = 512  # a longer heat row is unreadable and makes the notebook heavy


def _is_scope(m: str) -> bool:
    info = MIXING_METHODS.get(m)
    return info is not None and info.group == "scope"


def _has(ex, kind: str, m: str) -> bool:
    """Whether method `m` of `ex` holds what `kind` draws."""
    return {
        "saliency": m in ex.saliency,
        "maps": m in ex.layer_maps and m in ex.global_maps,
        "layer": m in ex.layer_maps,
        "global": m in ex.global_maps,
        "heads": m in ex.head_maps,
        "scopes": m in ex.layer_maps and _is_scope(m),
        "pair": m in ex.layer_maps and m in ex.global_maps,  # cross_segment_mixing reads both
        "source": m in ex.global_maps,
        "prediction": m in ex.logit_contributions,
        "layer_saliency": m in ex.layer_saliency,
        "image": m in ex.global_maps or m in ex.saliency,
        "clip": m in ex.global_maps or m in ex.saliency,
    }[kind]


def _kind_applies(ex, kind: str) -> bool:
    # an encoder-decoder's segments are source / target, not a pair: the dashboard shows source there
    seq2seq = ex.options.get("decoder_text") is not None
    if kind == "pair":
        return not seq2seq and bool(ex.segments) and {0, 1} <= set(ex.segments)
    if kind == "source":
        return seq2seq and bool(ex.segments) and 1 in ex.segments
    if kind in ("image", "clip"):
        return {"image": "image", "clip": "audio"}[kind] in ex.options
    return True


def _methods(ex) -> list[str]:
    keys = [*ex.methods, *ex.layer_maps, *ex.global_maps, *ex.saliency, *ex.head_maps]
    keys += [*ex.logit_contributions, *ex.layer_saliency]
    return list(dict.fromkeys(keys))


def available_kinds(ex) -> list[str]:
    """The kinds `show` can draw for this explanation."""
    return [k for k in KINDS if _kind_applies(ex, k) and any(_has(ex, k, m) for m in _methods(ex))]


def _no_data(ex, kind: str) -> BadInput:
    can = ", ".join(available_kinds(ex)) or "none"
    return BadInput(f"kind={kind!r} needs {KINDS[kind][1]}; this explanation can show kind= {can}")


def _index(value, name: str, top: int, default: int) -> int:
    """A 1-based layer or head number, checked against 1..top."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise BadInput(f"{name} must be an integer from 1 to {top} (1-based), not {value!r}")
    if not 1 <= value <= top:
        raise BadInput(f"{name}={value} is out of range: this explanation has {name}s 1 to {top} (1-based)")
    return int(value)


def _call(builder, data: dict, kw: dict, defaults: dict | None = None):
    """builder(**data, **defaults, **kw): `data` is what the kind draws, `defaults` the dashboard's
    options (title, zmax) that `kw` may override; keywords the builder does not take are reported."""
    allowed = [p for p in inspect.signature(builder).parameters if p not in data]
    unknown = [k for k in kw if k not in allowed]
    if unknown:
        raise BadInput(
            f"{builder.__name__} takes no {', '.join(map(repr, unknown))}; "
            f"extra keywords it takes: {', '.join(allowed) or 'none'}"
        )
    return builder(**data, **{**(defaults or {}), **kw})


def _scope_order(names: list[str]) -> list[str]:
    # the order of the layer shape the scopes belong to (Atb first, the widest last), as the dashboard shows them
    for order in (POST_LN_SCOPES, PRE_LN_SCOPES, SANDWICH_SCOPES):
        if set(names) <= set(order):
            return [s for s in order if s in names]
    return names


def explained_tokens(ex, k: int) -> list[str]:
    """Names of the k tokens a language model's logit rows explain: the target's (and the foil's),
    read from `prediction["explained"]["what"]` ("logit(a) - logit(b) at position t"), else their ids."""
    ids = [ex.target] + ([ex.foil] if ex.foil is not None else [])
    names = [str(i) for i in ids]
    what = ((ex.prediction or {}).get("explained") or {}).get("what", "")
    if what.startswith("logit("):
        names = [p.split(")")[0] for p in what.split("logit(")[1:]]
    return (names + [""] * k)[:k]


def logit_row_labels(ex, m: str) -> list[str]:
    """The subplot title of each row of `ex.logit_contributions[m]`, as the dashboard names them:
    DecompX on a classifier has a row per class (the prediction's labels, in order); a language
    model's rows are the explained token's logit and the foil's."""
    rows = ex.logit_contributions[m]
    probs = (ex.prediction or {}).get("probabilities") or {}
    if m == "decompx" and len(rows) == len(probs):
        return [str(k) for k in probs]
    return [f"logit of {t}" for t in explained_tokens(ex, len(rows))]


def show(ex, method: str | None = None, kind: str | None = None, layer=None, head=None, **kw):
    """See `Explanation.show`."""
    if kind is None:  # an image's or a clip's rows read best over the picture
        kind = "image" if "image" in ex.options else "clip" if "audio" in ex.options else "saliency"
    if kind not in KINDS:
        raise BadInput(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    names = _methods(ex)
    if method is not None and method not in names:
        raise BadInput(f"method {method!r} is not in this explanation; it has {', '.join(names) or 'none'}")
    if not _kind_applies(ex, kind):
        raise _no_data(ex, kind)
    fit = [m for m in names if _has(ex, kind, m)]
    if not fit:
        raise _no_data(ex, kind)
    if method is not None and method not in fit:
        raise BadInput(f"kind={kind!r}: method {method!r} has no data for it; methods that do: {', '.join(fit)}")
    if layer is not None and kind not in LAYERED:
        raise BadInput(f"layer= applies to kind= {', '.join(LAYERED)}, not {kind!r}")
    if head is not None and kind != "heads":
        raise BadInput("head= applies to kind='heads' only")
    if kind == "heads" and layer is not None and head is None:
        raise BadInput("kind='heads' shows every layer and head; give head= (and layer=) to open one head's map")

    from ctxmix.export import plots

    m = method if method is not None else fit[0]
    toks = ex.tokens
    if kind in ("image", "clip"):
        if method is None and layer is not None:  # a layer's map: the first method that has layer maps
            m = next((x for x in fit if x in ex.layer_maps), m)
        return _picture(ex, kind, m, layer, kw)
    if kind == "saliency":
        sal = {m: ex.saliency[m]} if method is not None else dict(ex.saliency)  # the dashboard's order
        return _call(plots.saliency_figure, {"tokens": toks, "saliency": sal}, kw)
    if kind == "pair":
        from ctxmix.analyses.pairs import cross_segment_mixing

        df = cross_segment_mixing(ex, [m] if method is not None else fit)
        return _call(plots.cross_mixing_figure, {"df": df}, kw)
    if kind == "prediction":
        rows = ex.logit_contributions[m]
        data = {"tokens": toks, "rows": rows, "labels": logit_row_labels(ex, m)}
        return _call(plots.logit_contributions_figure, data, kw, {"title": f"{m}: signed parts of each logit"})
    if kind == "layer_saliency":
        data = {"tokens": toks, "layer_saliency": ex.layer_saliency[m], "terms": ex.logit_terms.get(m, {})}
        return _call(plots.layer_saliency_figure, data, kw, {"title": f"{m}: per layer and token"})
    if kind == "source":
        # by the lazy public name: ctxmix.methods.alti_plus imports ctxmix.methods.explanation, which calls
        # this module, so naming alti_plus here would close an import cycle (tests/test_layout.py)
        from ctxmix import source_contribution

        S = ex.segments.count(0)  # the source comes first: [source; target]
        return _call(plots.source_contribution_figure, {"tokens": toks[S:], "share": source_contribution(ex, m)}, kw)

    if kind == "scopes":
        scopes = [method] if method is not None else _scope_order(fit)
        L = ex.layer_maps[scopes[0]].shape[0]
        l = _index(layer, "layer", L, L)
        maps = {s: ex.layer_maps[s][l - 1] for s in scopes}
        return _call(plots.maps_grid, {"tokens": toks, "maps": maps}, kw, {"title": f"Scopes of layer {l}"})
    if kind == "heads":
        A = ex.head_maps[m]
        L, H = A.shape[:2]
        if head is None:
            return _call(plots.head_grid, {"tokens": toks, "head_maps": A}, kw, {"title": f"{m}: every head"})
        l, h = _index(layer, "layer", L, L), _index(head, "head", H, 1)
        opts = {"title": f"{m}: layer {l}, head {h}", "zmax": plots.color_range(A)}
        return _call(plots.map_heatmap, {"tokens": toks, "M": A[l - 1, h - 1]}, kw, opts)

    L = (ex.layer_maps[m] if kind != "global" else ex.global_maps[m]).shape[0]
    l = _index(layer, "layer", L, L)
    if kind == "maps":
        maps = {
            f"{m}: layer {l}": ex.layer_maps[m][l - 1],
            f"{m}: aggregated up to layer {l}": ex.global_maps[m][l - 1],
        }
        return _call(plots.maps_grid, {"tokens": toks, "maps": maps}, kw)
    # one map, on the colour scale of all the method's layers (the dashboard's default)
    if kind == "layer":
        maps_all, title = ex.layer_maps[m], f"{m}: layer {l}"
    else:
        maps_all, title = ex.global_maps[m], f"{m}: aggregated up to layer {l}"
    opts = {"title": title, "zmax": plots.color_range(maps_all)}
    return _call(plots.map_heatmap, {"tokens": toks, "M": maps_all[l - 1]}, kw, opts)


def _picture(ex, kind: str, m: str, layer, kw: dict):
    """kind "image" / "clip": row `position` (kw; the explained one by default) of m's aggregated map, or of layer
    `layer`'s, over the image's patches or the clip's frames (a gradient method: its scores); kw `inputs`: the
    `ImageInput` / `AudioInput` to draw under it when the explanation does not hold one (a saved one)."""
    from ctxmix.export import plots

    kw = dict(kw)
    position, inputs = kw.pop("position", None), kw.pop("inputs", None)
    inputs = inputs if inputs is not None else ex.inputs
    if layer is not None:
        if m not in ex.layer_maps:
            raise BadInput(f"layer= needs a method with layer maps; {m} has none")
        layer = _index(layer, "layer", ex.layer_maps[m].shape[0], 1)
    v = ex.row(m, position, layer)
    pos = ex.position if position is None else int(position)
    what = f"{m}, row {ex.tokens[pos]}" if m in ex.global_maps else f"{m}, the class's score"
    title = f"{what}, {'layer ' + str(layer) if layer else 'aggregated'}"
    record = ex.options[kind if kind == "image" else "audio"]
    if kind == "image":
        if inputs is not None and inputs.fingerprint() != record["sha256"]:
            raise BadInput("inputs= is not the image this explanation explained (its sha256 differs)")
        prefix = record["prefix"]
        data = {
            "record": record,
            "values": v[prefix:].reshape(record["grid"]),
            "rgb": None if inputs is None else inputs.rgb(),
        }
        return _call(plots.explained_image_heat, data, kw, {"title": title})
    if inputs is not None and inputs.fingerprint() != record["sha256"]:
        raise BadInput("inputs= is not the clip this explanation explained (its sha256 differs)")
    data = {
        "record": record,
        "values": v,
        "features": None if inputs is None else inputs.input_values[0].numpy(),
        "spectrogram": inputs is not None and inputs.feature == "input_features",
        "words": ex.options.get("words"),
    }
    return _call(plots.explained_clip_heat, data, kw, {"title": title})


# ---------------------------------------------------------------- HTML summary


def _cell_style(s: float) -> str:
    """Background for a value scaled to [-1, 1]: white at 0, blue for positive, red for negative
    (RdBu's ends, as the figures use)."""
    if not np.isfinite(s):
        return "background:#ddd"
    end = (33, 102, 172) if s >= 0 else (178, 24, 43)
    a = min(1.0, abs(s))
    r, g, b = (round(255 + (e - 255) * a) for e in end)
    return f"background:rgb({r},{g},{b});color:{'#fff' if a > 0.6 else '#222'}"


def _heat_rows(ex, limit: int) -> str:
    from ctxmix.export.plots import display_tokens

    labels = [html.escape(t, quote=True) for t in display_tokens(ex.tokens[:limit])]
    td = "padding:1px 3px;border:1px solid #eee;white-space:pre"
    rows = []
    for m, v in ex.saliency.items():
        v = np.asarray(v, dtype=float)[:limit]
        scale = np.nanmax(np.abs(v)) if np.isfinite(v).any() else 0.0
        scaled = v / scale if scale > 0 else np.zeros_like(v)
        cells = "".join(
            f'<td style="{td};{_cell_style(s)}" title="{html.escape(m)} · {t}: {x:.6g}">{t}</td>'
            for t, x, s in zip(labels, v, scaled)
        )
        rows.append(
            f'<tr><th style="text-align:right;padding-right:6px;white-space:nowrap">{html.escape(m)}</th>{cells}</tr>'
        )
    return "".join(rows)


def summary_html(ex, max_tokens: int = HTML_MAX_TOKENS) -> str:
    """A compact HTML summary: model, tokens, methods, prediction, target / foil / position, and
    each method's saliency as a row of tokens coloured by value / the row's max |value| (blue
    positive, red negative, white 0; hover gives the exact value). Every text is HTML-escaped."""
    e = html.escape
    n = len(ex.tokens)
    L = next((a.shape[0] for a in (*ex.layer_maps.values(), *ex.global_maps.values())), None)
    lines = [
        f"<b>ctxmix Explanation</b> · model <code>{e(ex.model_name or '?')}</code> · {n} tokens"
        + (f" · {L} layers" if L else ""),
        "methods: " + (", ".join(f"<code>{e(m)}</code>" for m in ex.methods) or "none"),
    ]
    p = ex.prediction
    if p:
        label = str(p.get("label", "?"))
        prob = (p.get("probabilities") or {}).get(label)
        what = f" ({e(p['what'])})" if p.get("what") else ""
        tp = p.get("target_probability")  # ALTI+: the teacher-forced target's probability
        line = f"prediction: <b>{e(label)}</b>" + (f" {prob:.1%}" if prob is not None else "") + what
        lines.append(line + (f" · target probability {tp:.1%}" if tp is not None else ""))
    where = [f"position {ex.position}" + (f" ({e(ex.tokens[ex.position])})" if 0 <= ex.position < n else "")]
    where += [f"{k} {v}" for k, v in (("target", ex.target), ("foil", ex.foil)) if v is not None]
    lines.append(" · ".join(where))
    if ex.warnings:
        lines.append("warnings: " + "; ".join(e(str(w)) for w in ex.warnings))
    body = "<br>".join(lines)
    if ex.saliency:
        note = f"<br><i>first {max_tokens} of {n} tokens shown</i>" if n > max_tokens else ""
        table = '<table style="border-collapse:collapse;font-family:monospace;font-size:12px;margin-top:4px">'
        body += f'<div style="overflow-x:auto">{table}{_heat_rows(ex, max_tokens)}</table></div>{note}'
    return f'<div class="ctxmix-explanation" style="font-size:13px">{body}</div>'
