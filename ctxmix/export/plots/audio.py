"""A clip's spectrogram (or waveform) with the heat of one map row over its frames, on one time axis."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ctxmix.export.plots.style import _layout


def clip_heat(
    times: np.ndarray,
    values: np.ndarray,
    spectrogram: np.ndarray | None = None,
    spectrogram_step: float = 0.01,
    waveform: np.ndarray | None = None,
    sampling_rate: int = 16000,
    words: list[dict] | None = None,
    padding_from: float | None = None,
    until: float | None = None,
    title: str = "",
) -> go.Figure:
    """times (frames,) seconds of each frame, values (frames,) one row's shares; above them the spectrogram (mels,
    steps) one column every `spectrogram_step` s, or the waveform; words' spans ({"text", "start", "end"}) as
    labelled bands; frames from `padding_from` on shaded as padding; the time axis cut at `until` seconds."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.55, 0.45], vertical_spacing=0.04)
    if spectrogram is not None:
        steps = spectrogram.shape[1] if until is None else min(spectrogram.shape[1], int(until / spectrogram_step) + 1)
        fig.add_trace(
            go.Heatmap(
                z=spectrogram[:, :steps],
                x=np.arange(steps) * spectrogram_step,
                colorscale="Viridis",
                showscale=False,
                hovertemplate="%{x:.2f} s, mel bin %{y}: %{z:.2f}<extra></extra>",
            ),
            row=1,
            col=1,
        )
        fig.update_yaxes(title_text="mel bin", row=1, col=1)
    elif waveform is not None:
        stop = waveform.size if until is None else min(waveform.size, int(until * sampling_rate))
        every = max(1, stop // 4000)  # enough points to see the envelope, few enough to stay light
        t = np.arange(0, stop, every) / sampling_rate
        fig.add_trace(
            go.Scatter(x=t, y=waveform[:stop:every], mode="lines", line=dict(width=1), name="waveform"), row=1, col=1
        )
        fig.update_yaxes(title_text="amplitude", row=1, col=1)
    keep = slice(None) if until is None else times <= until
    fig.add_trace(
        go.Bar(
            x=times[keep],
            y=values[keep],
            marker_color="#d62728",
            name="share",
            hovertemplate="%{x:.3f} s: %{y:.4g}<extra></extra>",
        ),
        row=2,
        col=1,
    )
    fig.update_yaxes(title_text="share of the row", row=2, col=1)
    fig.update_xaxes(title_text="time (s)", row=2, col=1)
    for k, w in enumerate(words or []):
        fig.add_vrect(
            x0=w["start"],
            x1=w["end"],
            fillcolor="#1f77b4" if k % 2 else "#ff7f0e",
            opacity=0.08,
            line_width=0,
            annotation_text=w["text"],
            annotation_position="top left",
            row=2,
            col=1,
        )
    if padding_from is not None and (until is None or padding_from < until):
        fig.add_vrect(
            x0=padding_from,
            x1=float(times[-1]) if until is None else until,
            fillcolor="grey",
            opacity=0.25,
            line_width=0,
            annotation_text="padding",
            annotation_position="top right",
        )
    fig.update_layout(showlegend=False, bargap=0)
    return _layout(fig, title, height=520)


def explained_clip_heat(
    record: dict,
    values: np.ndarray,
    features: np.ndarray | None = None,
    spectrogram: bool = False,
    words: list[dict] | None = None,
    show_padding: bool = False,
    title: str = "",
) -> go.Figure:
    """A clip explanation's frame values (frames,) over time (`record`: `options["audio"]`), under the clip's
    log-mel spectrogram (`spectrogram=True`: Whisper's input features) or waveform (`features`: what the model
    read; None: the heat alone, as for a saved explanation), the transcript's words as bands, and the padding shaded
    (and, unless `show_padding`, cut 0.2 s after the clip)."""
    rate, stride, n = record["sampling_rate"], record["stride"], record["frames"]
    times = np.arange(n) * stride / rate
    pad_from = record["valid_frames"] * stride / rate if record["valid_frames"] < n else None
    return clip_heat(
        times,
        np.asarray(values)[:n],
        spectrogram=features if spectrogram else None,
        waveform=None if spectrogram else features,
        sampling_rate=rate,
        words=words,
        padding_from=pad_from,
        until=None if show_padding else record["samples"] / rate + 0.2,
        title=title,
    )
