"""Open a saved explanation (an .npz from the Explain page's download, `Explanation.save` or the
CLI's `explain --out x.npz`) and see every view of the Explain page, without loading any model; a saved
context attribution (the Context attribution page's download, `ContextAttribution.save`) shows its sources."""

import streamlit as st

import ctxmix
from ctxmix.export.context.load import load_context_attribution
from ctxmix.export.saved import load_explanation
from ctxmix.service.limits import load_limits
from ctxmix_dashboard.ui import common, views
from ctxmix_dashboard.ui.context import show_saved_context

common.page_setup()

st.title("Saved explanation")
st.caption("Open a file someone computed (on a GPU, on another machine): no model is loaded here.")
lim = common.limits()
up = st.file_uploader(
    "Saved explanation or context attribution (.npz; a context attribution also as .json)",
    type=["npz", "json"],
    key="saved_file",
    max_upload_size=max(1, int(lim["max_archive_mb"] + 0.999)),
)
if up is None:
    st.info("Upload a saved explanation to see it.")
    st.stop()

try:  # a saved context attribution (the Context attribution page's download, ContextAttribution.save)?
    ca = load_context_attribution(up.getvalue(), limits=load_limits(common.hosted(), common._secrets()), name=up.name)
except ctxmix.CtxmixError:
    ca = None
if ca is not None:
    with common.errors_as_messages():
        show_saved_context(ca, up.name)
    st.stop()

with common.errors_as_messages():
    ex = load_explanation(up.getvalue(), limits=load_limits(common.hosted(), common._secrets()), name=up.name)
    pv = ex.provenance
    st.markdown(f"**{ex.model_name or 'unknown model'}** · {len(ex.tokens)} tokens · methods: {', '.join(ex.methods)}")
    if pv:
        st.caption(
            f"Made by ctxmix {pv.get('ctxmix_version', '?')} on {pv.get('date', '?')}; weights "
            f"{str(pv.get('weights_sha256', '?'))[:12]}…; options {ex.options}. This ctxmix: {ctxmix.__version__}."
        )
    common.set_provenance(
        **{
            **pv,
            "options": ex.options,
            "tokens": len(ex.tokens),
            "methods": ex.methods,
            "from_saved_file": up.name,
            "shown_with_ctxmix": ctxmix.__version__,
        }
    )
    for w in ex.warnings:
        st.warning(w)
    layers = next((v.shape[0] for v in ex.layer_maps.values()), 1)
    views.show_explanation(ex, layers)
