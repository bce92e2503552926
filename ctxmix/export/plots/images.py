"""An image with the heat of one map row over its patches."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from ctxmix.export.plots.style import _layout


def image_heat(rgb: np.ndarray, values: np.ndarray, title: str = "", opacity: float = 0.55) -> go.Figure:
    """rgb (H, W, 3) uint8, the image as the model read it; values (rows, cols) one per patch, drawn over the
    patch each belongs to (cells of H / rows by W / cols pixels)."""
    H, W = rgb.shape[:2]
    rows, cols = values.shape
    ph, pw = H / rows, W / cols
    signed = bool(np.nanmin(values) < 0)
    scale = dict(colorscale="RdBu", zmid=0) if signed else dict(colorscale="Inferno", zmin=0)
    fig = go.Figure(go.Image(z=rgb, hoverinfo="skip"))
    fig.add_trace(
        go.Heatmap(
            z=values,
            x=(np.arange(cols) + 0.5) * pw,
            y=(np.arange(rows) + 0.5) * ph,
            opacity=opacity,
            colorbar=dict(title="value"),
            customdata=np.stack(np.meshgrid(np.arange(cols), np.arange(rows)), -1),
            hovertemplate="patch r%{customdata[1]}c%{customdata[0]}: %{z:.4g}<extra></extra>",
            **scale,
        )
    )
    fig.update_xaxes(visible=False, range=[0, W])
    fig.update_yaxes(visible=False, range=[H, 0], scaleanchor="x")
    return _layout(fig, title, height=max(380, int(520 * H / max(W, 1))))


def explained_image_heat(record: dict, values: np.ndarray, rgb: np.ndarray | None = None, title: str = "") -> go.Figure:
    """An image explanation's patch values (rows, cols) over the image as the model read it (`ImageInput.rgb()`), or
    over a grey canvas of its size (`record`: `options["image"]`) when the picture is not at hand (a saved
    explanation holds the grid, not the pixels)."""
    if rgb is None:
        H, W = record["pixels"]
        rgb = np.full((H, W, 3), 210, dtype=np.uint8)
    return image_heat(rgb, values, title=title)
