"""The Images and Speech pages' corpus view: the FF paper's contextualization change (1 - Spearman rho per layer)
over the bundled photographs or clips, computed on request. Layout only; the numbers are
`ctxmix.contextualization_change`'s."""

from __future__ import annotations

import streamlit as st

import ctxmix
from ctxmix.export import plots
from ctxmix_dashboard.ui import common

COMPONENTS = ["+Ff", "+Res", "+Ln"]


@st.cache_data(show_spinner=False, max_entries=4)
def _change(_model, model_name: str, names: tuple, _items, _progress=None):
    return ctxmix.contextualization_change(_model, list(_items), progress=_progress or False)


def change_section(model, name: str, items: dict, what: str, cost: str) -> None:
    """`items`: label -> image or clip; `cost`: what one item costs here, said before the button."""
    st.subheader(f"Contextualization change over the bundled {what}")
    st.caption(
        "How much each component (FF, RES2, LN2) reorders a layer's scope map, 1 - Spearman rho per layer, averaged "
        f"over {len(items)} {what} (Kobayashi et al. 2024, Fig. 3). {cost}"
    )
    if common.hosted():
        st.info("Computed on a local copy only: it takes minutes of the server's time.")
        return
    key = f"change_{what}"
    if not st.button("Compute", key=key) and not st.session_state.get(f"{key}_done"):
        return
    bar = st.progress(0.0, text=f"Scope maps over the {what}…")

    def progress(done, total):
        bar.progress(done / max(total, 1), text=f"{done}/{total} {what}")

    with common.errors_as_messages():
        df = _change(model, name, tuple(items), tuple(items.values()), progress)
        st.session_state[f"{key}_done"] = True
        bar.empty()
        shown = df[df.comparison.isin(COMPONENTS)]
        common.plot(plots.change_bars(df, COMPONENTS), f"contextualization_change_{what}", data=shown)
