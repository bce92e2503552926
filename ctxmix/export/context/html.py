"""A context attribution in a notebook (and, reused, on the dashboard's page): `context_html` draws the
context with each source shaded by a method's score, `summary_html` is `ContextAttribution._repr_html_`.

Shading: a score s of a method whose largest |score| is M is drawn at s / M with the explanation views'
colour scale (`ctxmix.export.notebook._cell_style`: white at 0, blue for positive, red for negative,
RdBu's ends): diverging for a signed method (one with a negative score), and for a method whose scores
are all non-negative (`attention`) the same scale's blue half, white to blue. Separators (the text between
sources) are left unshaded. Every text is HTML-escaped (quotes too, as it also goes into attributes), so a
context holding `<script>` shows it as text. Each source's span carries `data-source` and `data-score`.
"""

from __future__ import annotations

import html

import numpy as np

from ctxmix.errors import BadInput
from ctxmix.export.notebook import _cell_style

TOP_IN_SUMMARY = 3
SNIPPET = 80  # characters of a source's text in the summary


class HTML(str):
    """An HTML string that Jupyter renders (no IPython needed to build it)."""

    def _repr_html_(self) -> str:
        return str(self)


def _scaled(scores: np.ndarray) -> np.ndarray:
    finite = np.isfinite(scores)
    top = float(np.abs(scores[finite]).max()) if finite.any() else 0.0
    return scores / top if top > 0 else np.where(finite, 0.0, np.nan)


def source_spans_html(ca, scores) -> str:
    """The context as HTML: each source a <span> shaded by its score (d,), the rest plain."""
    e = html.escape
    s = np.asarray(scores, dtype=np.float64)
    if s.shape != (ca.n_sources,):
        raise BadInput(f"scores must have one value per source ({ca.n_sources}), got shape {s.shape}")
    scaled = _scaled(s)
    out, cur = [], 0
    for i, (a, b) in enumerate(ca.source_spans):
        out.append(e(ca.context[cur:a]))
        out.append(
            f'<span data-source="{i}" data-score="{float(s[i])!r}" title="source {i}: {s[i]:.6g}" '
            f'style="{_cell_style(scaled[i])};border-radius:2px">{e(ca.context[a:b])}</span>'
        )
        cur = b
    out.append(e(ca.context[cur:]))
    return "".join(out)


def _methods(ca, method) -> list[str]:
    if method is None:
        return list(ca.methods)
    if method not in ca.methods:
        raise BadInput(f"{method!r} was not computed; this attribution has {', '.join(ca.methods)}")
    return [method]


def context_html(ca, method: str | None = None, span=None) -> HTML:
    """One block per method (or `method`'s only): its name and colour key, then the context shaded by its
    scores for the response (or a character `span` of it, `ContextAttribution.scores_for`)."""
    e = html.escape
    blocks = []
    for m in _methods(ca, method):
        s = np.asarray(ca.scores[m] if span is None else ca.scores_for(m, span), dtype=np.float64)
        signed = bool((s < 0).any())
        key = "blue raises the response, red lowers it" if signed else "darker blue: higher score"
        head = f"<b>{e(m)}</b> <span style='color:#666'>({e(key)}; scaled by the largest |score|)</span>"
        body = (
            '<div style="white-space:pre-wrap;line-height:1.6;font-family:serif;border:1px solid #eee;'
            f'padding:6px;margin:2px 0 10px 0">{source_spans_html(ca, s)}</div>'
        )
        blocks.append(f'<div class="ctxmix-context-method" data-method="{e(m)}">{head}{body}</div>')
    what = "the response" if span is None else f"characters {int(span[0])}..{int(span[1])} of the response"
    text = ca.response if span is None else ca.response[int(span[0]) : int(span[1])]
    foot = f"<div><em>{e(what)}:</em> <code style='white-space:pre-wrap'>{e(text)}</code></div>"
    return HTML(f'<div class="ctxmix-context" style="font-size:13px">{"".join(blocks)}{foot}</div>')


def summary_html(ca) -> str:
    """Model, sources, response, each method's top sources, the evaluation when computed, warnings."""
    e = html.escape
    lines = [
        f"<b>ctxmix ContextAttribution</b> · model <code>{e(ca.model_name)}</code> · {ca.n_sources} sources · "
        f"{len(ca.response_ids)} response tokens",
        "methods: " + ", ".join(f"<code>{e(m)}</code>" for m in ca.methods),
        f"response: <code style='white-space:pre-wrap'>{e(ca.response)}</code>",
    ]
    for m in ca.methods:
        top = ca.top(m, min(TOP_IN_SUMMARY, ca.n_sources))
        items = "; ".join(f"#{i} ({v:.3g}) {e(t[:SNIPPET] + ('…' if len(t) > SNIPPET else ''))}" for i, v, t in top)
        lines.append(f"<code>{e(m)}</code> top: {items}")
    ev = ca.evaluation
    if ev:
        lines.append(
            "evaluation (↑ higher is better):" + ev["table"].to_html(index=False, float_format=lambda v: f"{v:.4g}")
        )
    if ca.warnings:
        lines.append("warnings: " + "; ".join(e(str(w)) for w in ca.warnings))
    return f'<div class="ctxmix-context-attribution" style="font-size:13px">{"<br>".join(lines)}</div>'
