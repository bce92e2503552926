"""The views of a saved context attribution on the Saved explanation page (no model: only what the file
holds): the response, the context shaded by a chosen method, its top sources, the evaluation when it was
run. Layout only; the numbers come from the ContextAttribution and `ctxmix.export.context.view`."""

from __future__ import annotations

import streamlit as st

import ctxmix
from ctxmix.export.context import view as cv
from ctxmix.methods.registry import CONTEXT_METHODS
from ctxmix_dashboard.ui import common


def show_saved_context(ca, file_name: str) -> None:
    pv = ca.provenance
    st.markdown(
        f"**{ca.model_name}** · context attribution · {ca.n_sources} sources · "
        f"{len(ca.response_ids)} response tokens · methods: {', '.join(ca.methods)}"
    )
    st.caption(
        f"Made by ctxmix {pv.get('ctxmix_version', '?')} on {pv.get('date', '?')}; weights "
        f"{str(pv.get('weights_sha256', '?'))[:12]}…. This ctxmix: {ctxmix.__version__}."
    )
    common.set_provenance(
        **{**pv, "methods": ca.methods, "from_saved_file": file_name, "shown_with_ctxmix": ctxmix.__version__}
    )
    for w in ca.warnings:
        st.warning(w)
    st.subheader("Response")
    st.markdown(f"> {ca.response}")
    if ca.query:
        st.caption(f"Query: {ca.query}")
    if ca.messages is not None and ca.options.get("prompt", {}).get("format") == "messages":
        roles = ", ".join(m["role"] for m in ca.messages)
        st.caption(f"A conversation of {len(ca.messages)} messages ({roles}); the context below is its transcript.")
    st.subheader("Sources")
    view = st.selectbox(
        "Shade by",
        ca.methods,
        format_func=lambda m: f"{m} ({CONTEXT_METHODS[m].paper})" if m in CONTEXT_METHODS else m,
        key="saved_view",
    )
    scores = cv.span_scores(ca, view)
    st.caption(cv.colour_key(scores))
    shaded = cv.context_view_html(ca, scores)
    with st.container(height=cv.context_box_height(shaded, 900), border=True):
        st.html(shaded)
    top = cv.top_table(ca, view, min(10, ca.n_sources))
    st.dataframe(top.style.format({"score": "{:.4g}"}), hide_index=True, width="stretch")
    common.export_table(top, f"top_sources_{view}", caption=f"Top sources by {view}")
    if ca.evaluation:
        st.subheader("Evaluation (saved)")
        st.dataframe(ca.evaluation["table"].style.format(precision=3), hide_index=True, width="stretch")
