"""Figures and tables as files: PNG/SVG/PDF (kaleido, with the provenance written into the file),
HTML, the data behind a figure (JSON/CSV), tables as CSV/LaTeX/JSON, and paper-sized presets."""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ctxmix.export.latex import dataframe_booktabs


def chromium_path() -> str | None:
    """A Chrome/Chromium kaleido can drive (kaleido 1.x needs one on the machine)."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


def static_export_available() -> bool:
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return False
    return chromium_path() is not None


STATIC_HINT = (
    "PNG, SVG and PDF export needs Chrome or Chromium on the server "
    "(Debian/Ubuntu: `apt install chromium`; macOS: install Google Chrome). HTML works without it."
)


# Widths of paper columns and pages, in inches (ACL: 3.03 / 6.3; NeurIPS and ICLR: 5.5)
PAPER_PRESETS = {"acl-column": 3.03, "acl-page": 6.3, "neurips": 5.5, "iclr": 5.5}
PAPER_FONT_PT = 9  # between the 8-10 pt figures take in these templates


def paper_figure(fig: go.Figure, preset: str) -> go.Figure:
    """A copy of `fig` sized for a paper: the preset's width at 96 px per inch (how the static
    export maps pixels to inches), the height scaled with it (at most the width x 1.4), 9 pt text."""
    if preset not in PAPER_PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PAPER_PRESETS)}")
    out = go.Figure(fig)
    width = int(round(PAPER_PRESETS[preset] * 96))
    w0 = fig.layout.width or 700
    h0 = fig.layout.height or 450
    height = int(min(width * 1.4, max(width * 0.5, h0 * width / w0)))
    px = PAPER_FONT_PT * 96 / 72
    subtitles = any(a.yref == "paper" and (a.y or 0) >= 0.99 for a in fig.layout.annotations)
    out.update_layout(
        width=width,
        height=height,
        font=dict(size=px),
        title_font=dict(size=px + 1),
        title_pad=dict(t=4),  # no toolbar on paper
        margin=dict(l=40, r=10, t=(24 if fig.layout.title.text else 6) + (16 if subtitles else 0), b=40),
    )
    out.update_annotations(font_size=px)
    return out


def provenance_line(provenance: dict | None) -> str:
    """What made a figure or table, as one line: "ctxmix provenance: {json}" ("" without one)."""
    if not provenance:
        return ""
    import json

    return "ctxmix provenance: " + json.dumps(provenance, sort_keys=True, default=str, ensure_ascii=False)


def _png_with_text(png: bytes, text: str) -> bytes:
    """A PNG with a tEXt chunk (key "ctxmix-provenance"), written with Pillow when it is there."""
    try:
        import io

        from PIL import Image, PngImagePlugin
    except ImportError:  # no Pillow: the sidecar download still carries it
        return png
    im = Image.open(io.BytesIO(png))
    info = PngImagePlugin.PngInfo()
    info.add_text("ctxmix-provenance", text)
    out = io.BytesIO()
    im.save(out, format="PNG", pnginfo=info)
    return out.getvalue()


def figure_bytes(
    fig: go.Figure, fmt: str, scale: float = 2.0, preset: str | None = None, provenance: dict | None = None
) -> bytes:
    """The figure as png, svg, pdf (kaleido + Chromium) or html (always works); `preset` sizes it
    for a paper (PAPER_PRESETS: "acl-column", "acl-page", "neurips", "iclr"). `provenance` goes into
    the file: an HTML or SVG comment, a PNG text chunk, the PDF's subject (its document information)."""
    if preset is not None:
        fig = paper_figure(fig, preset)
    line = provenance_line(provenance)
    fmt = fmt.lower()
    if fmt == "html":
        html = fig.to_html(include_plotlyjs="cdn", full_html=True)
        return (f"<!-- {line.replace('--', '- -')} -->\n" + html if line else html).encode()
    if fmt not in ("png", "svg", "pdf"):
        raise ValueError("format must be png, svg, pdf or html")
    if not static_export_available():
        raise RuntimeError(STATIC_HINT)
    import os

    os.environ.setdefault("BROWSER_PATH", chromium_path() or "")
    data = fig.to_image(format=fmt, scale=scale if fmt == "png" else 1)
    if not line:
        return data
    if fmt == "svg":
        text = data.decode()
        i = text.find("<svg")
        return (text[:i] + f"<!-- {line.replace('--', '- -')} -->" + text[i:]).encode()
    if fmt == "png":
        return _png_with_text(data, line)
    return _pdf_with_subject(data, line)


def _pdf_with_subject(pdf: bytes, text: str) -> bytes:
    """The PDF with `text` appended as an incremental update of its document information
    (/Subject): readers show it under the document's properties; the pages are untouched."""
    import re

    m = re.search(rb"/Info\s+(\d+)\s+0\s+R", pdf)
    start = pdf.rfind(b"startxref")
    root = re.search(rb"/Root\s+(\d+\s+0\s+R)", pdf)
    size = re.search(rb"/Size\s+(\d+)", pdf)
    if start < 0 or root is None or size is None:
        return pdf
    prev = int(pdf[start + 9 :].split()[0])
    n = int(size.group(1))
    esc = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)").encode("latin-1", "replace")
    obj = n if m is None else int(m.group(1))
    body = f"{obj} 0 obj\n<< /Producer (ctxmix) /Subject (".encode() + esc + b") >>\nendobj\n"
    offset = len(pdf) + 1
    xref = f"xref\n{obj} 1\n{offset:010d} 00000 n \n".encode()
    trailer = (
        f"trailer\n<< /Size {max(n, obj + 1)} /Root {root.group(1).decode()} /Info {obj} 0 R /Prev {prev} >>\n"
        f"startxref\n{offset + len(body)}\n%%EOF\n"
    ).encode()
    return pdf + b"\n" + body + xref + trailer


def table_bytes(df: pd.DataFrame, fmt: str, caption: str | None = None, provenance: dict | None = None) -> bytes:
    """A table as csv, json or LaTeX (booktabs, written directly: no jinja2 needed). `provenance`
    goes in as a first comment line ("# ..." in CSV: pandas reads it with comment="#"; "% ..." in
    LaTeX) or, in JSON, as {"provenance": ..., "rows": [...]}."""
    line = provenance_line(provenance)
    if fmt == "csv":
        body = df.to_csv(index=df.index.name is not None or not isinstance(df.index, pd.RangeIndex))
        return ((f"# {line}\n" if line else "") + body).encode()
    if fmt == "json":
        if not line:
            return df.reset_index().to_json(orient="records", indent=1).encode()
        import json

        rows = json.loads(df.reset_index().to_json(orient="records"))
        return json.dumps({"provenance": provenance, "rows": rows}, indent=1, default=str).encode()
    if fmt == "tex":
        return ((f"% {line}\n" if line else "") + dataframe_booktabs(df, caption)).encode()
    raise ValueError("format must be csv, json or tex")


def figure_data_bytes(data: dict | pd.DataFrame, fmt: str = "json", provenance: dict | None = None) -> bytes:
    """The data behind a figure: a DataFrame as csv/json, or a dict of arrays as json (with a
    "provenance" entry when given)."""
    if isinstance(data, pd.DataFrame):
        return table_bytes(data, fmt, provenance=provenance)
    import json

    if provenance:
        data = {"provenance": provenance, **data}

    def conv(v):
        if isinstance(v, np.ndarray):
            return v.tolist()
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return json.dumps(conv(data), indent=1).encode()


def save_figure(fig: go.Figure, path: str) -> None:
    """Write a figure; the format comes from the extension (png, svg, pdf, html)."""
    from pathlib import Path

    p = Path(path)
    p.write_bytes(figure_bytes(fig, p.suffix.lstrip(".")))
