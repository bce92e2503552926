"""The Images and Speech pages' corpus view: the FF paper's contextualization change (1 - Spearman rho per layer)
over the bundled photographs or clips, or the user's own, computed on request. Layout only; the numbers are
`ctxmix.contextualization_change`'s."""

from __future__ import annotations

import hashlib

import streamlit as st

import ctxmix
from ctxmix.export import plots
from ctxmix_dashboard.ui import common

COMPONENTS = ["+Ff", "+Res", "+Ln"]
MAX_OWN_FILES = 50  # a local run: each file costs what `cost` says


@st.cache_data(show_spinner=False, max_entries=4)
def _change(_model, model_name: str, names: tuple, _items, _progress=None):
    return ctxmix.contextualization_change(_model, list(_items), progress=_progress or False)


def _own_files(what: str, types: list[str]) -> dict | None:
    """The user's files as {name: bytes}, or None (none uploaded yet: the page says so)."""
    ups = st.file_uploader(
        f"Your {what} (several files; at most {MAX_OWN_FILES})",
        type=types,
        accept_multiple_files=True,
        key=f"own_{what}",
        max_upload_size=max(1, int(common.limits()["max_upload_mb"] + 0.999)),
    )
    if not ups or len(ups) < 2:
        st.info(f"Upload two or more {what} to compare them.")
        return None
    if len(ups) > MAX_OWN_FILES:
        st.error(f"{len(ups)} files: at most {MAX_OWN_FILES} at a time.")
        return None
    files: dict = {}
    for u in ups:  # two files of one name stay two items
        label = u.name if u.name not in files else f"{u.name} ({sum(k.startswith(u.name) for k in files) + 1})"
        files[label] = u.getvalue()
    return files


def change_section(model, name: str, items: dict, what: str, cost: str, upload_types: list[str] | None = None) -> None:
    """`items`: label -> image or clip; `cost`: what one item costs here, said before the button; `upload_types`:
    the file types a user may give instead (None: the bundled items only)."""
    st.subheader(f"Contextualization change over a set of {what}")
    if common.hosted():
        st.caption(
            "How much each component (FF, RES2, LN2) reorders a layer's scope map, 1 - Spearman rho per layer "
            "(Kobayashi et al. 2024, Fig. 3)."
        )
        st.info("Computed on a local copy only: it takes minutes of the server's time.")
        return
    if upload_types:
        source = st.radio("Set", [f"The bundled {what}", f"Your own {what}"], horizontal=True, key=f"set_{what}")
        if source.startswith("Your own"):
            own = _own_files(what, upload_types)
            if own is None:
                return
            items = own
    st.caption(
        "How much each component (FF, RES2, LN2) reorders a layer's scope map, 1 - Spearman rho per layer, averaged "
        f"over {len(items)} {what} (Kobayashi et al. 2024, Fig. 3). {cost}"
    )
    key = f"change_{what}"
    # the set's identity: every item's name and content (two uploads of one name are two sets)
    ident = tuple((k, hashlib.sha256(v).hexdigest() if isinstance(v, bytes) else str(v)) for k, v in items.items())
    if not st.button("Compute", key=key) and st.session_state.get(f"{key}_done") != ident:
        return
    bar = st.progress(0.0, text=f"Scope maps over the {what}…")

    def progress(done, total):
        bar.progress(done / max(total, 1), text=f"{done}/{total} {what}")

    with common.errors_as_messages():
        df = _change(model, name, ident, tuple(items.values()), progress)
        st.session_state[f"{key}_done"] = ident
        bar.empty()
        shown = df[df.comparison.isin(COMPONENTS)]
        common.plot(plots.change_bars(df, COMPONENTS), f"contextualization_change_{what}", data=shown)
