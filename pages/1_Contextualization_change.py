"""Contextualization change over a corpus (Kobayashi et al. 2024, §5-6): per-layer 1 - rho
for each component, the dynamics against the pre-FF map, RES2 norms, FF-amplified pairs."""

import streamlit as st

from ctxmix.analyses.corpus import comparisons, corpus_report
from ctxmix.engine.fingerprint import weights_sha256
from ctxmix.export import plots
from ctxmix.service.cache import cached_frames, model_fingerprint
from ctxmix_dashboard.ui import common

common.page_setup()

st.title("Contextualization change")
st.caption(
    "How much each component of a layer changes the token-to-token map: 1 − Spearman ρ between the "
    "flattened scope maps before and after it, averaged over sequences (FF paper, Fig. 3 and 6)."
)
name = common.model_picker()
model = common.load_or_stop(name)

c1, c2 = st.columns(2)
with c1:
    texts, corpus_key = common.corpus_picker()
with c2:
    has_mask = getattr(model.tokenizer, "mask_token_id", None) is not None and not model.spec.causal
    mask = st.checkbox(
        "Mask 12 % of the tokens (as the paper does for masked LMs)",
        value=common.qp("mask", "0") == "1",
        disabled=not has_mask,
        key="mask",
    )
    ignore = st.checkbox(
        "Ignore the 1 % of dimensions with the lowest γ (Fig. 32)", value=common.qp("ignore", "0") == "1", key="ignore"
    )
    lower = st.checkbox(
        "Lower triangle only (causal models)",
        value=common.qp("tril", "0") == "1",
        disabled=not model.spec.causal,
        key="tril",
    )
    common.set_qp(mask=int(mask), ignore=int(ignore), tril=int(lower))

opts = dict(
    mask_rate=0.12 if mask and has_mask else 0.0,
    ignore_low_gamma=0.01 if ignore else 0.0,
    lower_triangle=bool(lower and model.spec.causal),
)
fp = model_fingerprint(model)

with common.errors_as_messages():
    bar = st.progress(0.0, text="Computing scope maps over the corpus…")

    def progress(done, total):
        bar.progress(done / max(total, 1), text=f"{done}/{total} sequences")

    def compute(missing):
        with common.corpus_job():
            out = corpus_report(
                model,
                texts,
                change="change" in missing,
                amp="ff_amp" in missing,
                norms="res2" in missing,
                progress=progress,
                **opts,
                **common.corpus_caps(),
            )
        return {{"residual_norms": "res2"}.get(k, k): v for k, v in out.items()}

    # one pass over the corpus for whichever of the three reports is not cached yet; each keeps its own key
    caps = common.corpus_caps()
    report = cached_frames(
        {
            "change": (fp, corpus_key, len(texts), opts, caps),
            "ff_amp": (fp, corpus_key, len(texts), opts["mask_rate"], caps),
            "res2": (fp, corpus_key, len(texts), opts["mask_rate"], caps),
        },
        compute,
    )
    res2 = report["res2"]
    bar.empty()
    common.set_provenance(
        model=name,
        weights_sha256=weights_sha256(model),
        corpus=corpus_key,
        sequences=len(texts),
        options=opts,
        caps=caps,
    )

    df = report["change"]
    comps = [c for c in comparisons(model) if not c.startswith("dyn:")]
    dyn = [c for c in comparisons(model) if c.startswith("dyn:")]
    st.subheader("Change caused by each component")
    common.plot(plots.change_bars(df, comps), "contextualization_change", data=df[df.comparison.isin(comps)])
    avg = df.groupby("comparison", sort=False)["change"].mean().rename("by-layer average").to_frame()
    st.dataframe(avg.style.format("{:.3f}"))
    st.caption("Paper's by-layer averages: BERT-base +Ff 0.21, +Ln 0.27; GPT-2 +Ff 0.15, +Ln 0.38 (Wikipedia, masked).")
    common.export_table(df, "contextualization_change", caption="Per-layer mean of 1 - Spearman rho")

    st.subheader("Dynamics against the map before the FF")
    common.plot(plots.grouped_bars(df, dyn), "dynamics", data=df[df.comparison.isin(dyn)])

    st.subheader("FF output vs the vector RES2 bypasses")
    common.plot(plots.res2_figure(res2), "res2_norms", data=res2)

    st.subheader("Token pairs the FF amplifies most")
    amp = report["ff_amp"]
    layer = st.slider("Layer", 1, model.n_layers, common.qp_int("layer", 1, 1, model.n_layers), key="amp_layer")
    common.set_qp(layer=layer)
    top = amp[amp.layer == layer].reset_index(drop=True)
    st.dataframe(top, width="stretch")
    common.export_table(top, f"ff_amp_layer{layer}", caption=f"Top FF-amplified token pairs, layer {layer}")

    corpus_arg = "YOUR_FILE.txt" if corpus_key.startswith("upload:") else corpus_key
    flags = (
        ([f"--mask-rate {opts['mask_rate']}"] if opts["mask_rate"] else [])
        + ([f"--ignore-low-gamma {opts['ignore_low_gamma']}"] if opts["ignore_low_gamma"] else [])
        + (["--lower-triangle"] if opts["lower_triangle"] else [])
    )
    common.reproduce(
        " ".join(
            [
                "python -m ctxmix change --model",
                name,
                "--corpus",
                corpus_arg,
                "--limit",
                str(len(texts)),
                *flags,
                "--out change.csv",
            ]
        )
    )
