"""What the speech and vision papers found, measured here: how far Whisper tiny.en's encoder frames mix with their
neighbours and with distant frames, layer by layer; how much its decoder reads the frames (ALTI+); and how DINOv2's
class token spreads over the patches of scikit-image's photographs by ALTI and by attention rollout.

    python bench/speech_vision_findings.py                  # tables, and the figures into docs/findings/img/
    python bench/speech_vision_findings.py --value-zeroing  # also value zeroing on one clip (minutes on a CPU)

Needs Debian's flite for the spoken sentences (the bundled clips are flite's too). docs/findings/speech_vision.md
quotes the tables of one run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from perf_common import markdown_table  # noqa: E402

import ctxmix  # noqa: E402
from ctxmix.engine.flite import SENTENCES, speak  # noqa: E402
from ctxmix.engine.inputs import SAMPLE_IMAGES, audio_input, image_input, sample_image, trace_image  # noqa: E402
from ctxmix.methods.images import patch_values  # noqa: E402

IMG = Path(__file__).resolve().parents[1] / "docs" / "findings" / "img"
NEAR = 5  # frames on each side counted as a frame's neighbourhood: +-100 ms


def locality(maps: np.ndarray, valid: int) -> pd.DataFrame:
    """Per layer, over the rows of the clip's frames: the mean share within +-NEAR frames (itself included), its
    own share, the padding's share and the mean distance in seconds of what it reads among the clip's frames."""
    i = np.arange(valid)[:, None]
    j = np.arange(maps.shape[-1])[None, :]
    near = np.abs(i - j) <= NEAR
    rows = []
    for layer, m in enumerate(maps, 1):
        r = m[:valid]
        clip = r[:, :valid]
        rows.append(
            {
                "layer": layer,
                "within 100 ms": float((r * near).sum(1).mean()),
                "itself": float(np.diag(r[:, :valid]).mean()),
                "padding": float(r[:, valid:].sum(1).mean()),
                "mean distance in the clip (s)": float(
                    ((clip * np.abs(i - j[:, :valid])).sum(1) / np.maximum(clip.sum(1), 1e-12)).mean() * 0.02
                ),
            }
        )
    return pd.DataFrame(rows)


def whisper_rows(model, clips, value_zeroing: bool) -> tuple[pd.DataFrame, pd.DataFrame]:
    enc, dec = [], []
    for k, (name, x, rate) in enumerate(clips):
        inp = audio_input(model, x, rate)
        methods = ["attention", "alti"] + (["value_zeroing"] if value_zeroing and k == 0 else [])
        ex = ctxmix.explain(model, None, methods, audio=inp)
        for m in methods:
            df = locality(ex.layer_maps[m], inp.n_valid)
            enc.append(df.assign(method=m, clip=name))
        ap = ctxmix.explain(model, None, ["alti"], audio=inp, decoder_text=True)
        S, M, R = ap.options["n_source"], ap.layer_maps["alti"], ap.global_maps["alti"]
        rows = slice(S + 1, len(ap.tokens))  # the decoder inputs after <|startoftranscript|>
        for layer in range(M.shape[0]):
            dec.append(
                {
                    "clip": name,
                    "layer": layer + 1,
                    "frames' share, layer map": float(M[layer, rows, :S].sum(1).mean()),
                    "frames' share, rollout": float(R[layer, rows, :S].sum(1).mean()),
                    "padding's share, rollout": float(R[layer, rows, inp.n_valid : S].sum(1).mean()),
                }
            )
    return pd.concat(enc), pd.DataFrame(dec)


def dinov2_rows(model) -> pd.DataFrame:
    from scipy.stats import spearmanr

    rows = []
    for name in SAMPLE_IMAGES:
        img = sample_image(name)
        ex = ctxmix.explain(model, None, ["alti", "attention_rollout"], image=img)
        _, alti = patch_values(ex, "alti", 0)
        _, roll = patch_values(ex, "attention_rollout", 0)
        tr = trace_image(model, image_input(model, img))
        norms = tr.hidden[-1][1:].norm(dim=-1).double().cpu().numpy()  # the last layer's input, per patch
        top = norms >= np.quantile(norms, 0.95)
        a, r = alti.ravel(), roll.ravel()
        rows.append(
            {
                "photograph": name,
                "Spearman(ALTI, rollout) over patches": float(spearmanr(a, r).statistic),
                "ALTI: CLS's own share": float(ex.global_maps["alti"][-1][0, 0]),
                "rollout: CLS's own share": float(ex.global_maps["attention_rollout"][-1][0, 0]),
                "ALTI: share on the 5% highest-norm patches": float(a[top].sum() / a.sum()),
                "rollout: share on the 5% highest-norm patches": float(r[top].sum() / r.sum()),
            }
        )
    return pd.DataFrame(rows)


def figures(enc: pd.DataFrame, model_img) -> None:
    import plotly.graph_objects as go

    from ctxmix.export import plots

    IMG.mkdir(parents=True, exist_ok=True)
    mean = enc.groupby(["method", "layer"]).mean(numeric_only=True).reset_index()
    fig = go.Figure()
    for m, g in mean.groupby("method"):
        fig.add_trace(go.Scatter(x=g["layer"], y=g["within 100 ms"], mode="lines+markers", name=f"{m}: within 100 ms"))
        fig.add_trace(
            go.Scatter(x=g["layer"], y=g["padding"], mode="lines+markers", line=dict(dash="dot"), name=f"{m}: padding")
        )
    fig.update_layout(xaxis_title="encoder layer", yaxis_title="mean share of a clip frame's row", height=420)
    (IMG / "whisper_locality.svg").write_bytes(plots.figure_bytes(fig, "svg"))
    ex = ctxmix.explain(model_img, None, ["alti", "attention_rollout"], image=sample_image("chelsea"))
    rgb = image_input(model_img, sample_image("chelsea")).rgb()
    for m in ("alti", "attention_rollout"):
        _, grid = patch_values(ex, m, 0)
        fig = plots.image_heat(rgb, grid, title=f"dinov2-small, [CLS] row, {m}, aggregated")
        (IMG / f"dinov2_cls_{m}.png").write_bytes(plots.figure_bytes(fig, "png"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--value-zeroing", action="store_true")
    ap.add_argument("--no-figures", action="store_true")
    ap.add_argument("--save", default=None, metavar="PREFIX", help="also write the per-clip rows as PREFIX_*.csv")
    args = ap.parse_args()
    whisper = ctxmix.load_model("whisper-tiny-en")
    clips = [(f"flite slt {k + 1}", *_spoken(text)) for k, text in enumerate(SENTENCES)]
    enc, dec = whisper_rows(whisper, clips, args.value_zeroing)
    if args.save:
        enc.to_csv(args.save + "_encoder.csv", index=False)
        dec.to_csv(args.save + "_decoder.csv", index=False)
    pd.set_option("display.precision", 3)
    print("## Whisper tiny.en's encoder: a clip frame's row, per layer (mean over frames and clips)\n")
    print(markdown_table(enc.groupby(["method", "layer"]).mean(numeric_only=True).round(3).reset_index()))
    print("\n## Whisper tiny.en's decoder (ALTI+): a transcript token's row, per layer (mean over tokens and clips)\n")
    print(markdown_table(dec.groupby("layer").mean(numeric_only=True).round(3).reset_index()))
    dino = ctxmix.load_model("dinov2-small")
    print("\n## dinov2-small: the class token's row over the patches, aggregated\n")
    print(markdown_table(dinov2_rows(dino).round(3)))
    if not args.no_figures:
        figures(enc, dino)
        print(f"\nfigures in {IMG}")


def _spoken(text: str):
    s = speak(text, "slt")
    return s.samples, s.sampling_rate


if __name__ == "__main__":
    main()
