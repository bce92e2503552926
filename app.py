"""ctxmix dashboard entry (`streamlit run app.py`) and its landing page, Explain: one example's
prediction, saliency per method, per-layer and aggregated maps, rank correlations between
methods, and the FF paper's scope maps of one layer. Other pages live in pages/."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import streamlit as st  # noqa: E402

import ctxmix  # noqa: E402
from ctxmix import plots  # noqa: E402
from ctxmix.analysis import ff_amp_matrix, ff_amp_scopes  # noqa: E402
from ctxmix.cache import cached_explain  # noqa: E402
from ctxmix.methods import MIXING_METHODS, scope_names  # noqa: E402
from ui import common  # noqa: E402

common.page_setup()

st.title("Explain one example")
name = common.model_picker()
model = common.load_or_stop(name)

mixing = [m for m, i in MIXING_METHODS.items() if i.group != "scope"]
saliency_methods = list(ctxmix.SALIENCY_METHODS) if model.kind != "encoder" else []
available = mixing + saliency_methods
default = ["attention_rollout", "globenc", "alti", "value_zeroing"] + (["grad_x_input"] if saliency_methods else [])
chosen_qp = [m for m in common.qp_list("method", default) if m in available] or default

text = st.text_area("Text", value=common.qp_text("text", common.DEFAULT_TEXT), height=80, key="text",
                    help="Special tokens are added by the model's tokenizer.")
methods = st.multiselect("Methods", available, default=chosen_qp, key="methods",
                         format_func=lambda m: f"{m} ({ctxmix.METHODS[m].paper})",
                         help="Context-mixing methods give per-layer maps; their saliency is the target row of the "
                              "aggregated map. Gradient methods need a model with a head.")
if not saliency_methods:
    st.caption("This model has no head, so gradient and blank-out methods are not offered; pick "
               "`minilm-sentiment` or a language model for them.")
common.set_qp(text=text, method=methods)
if not methods:
    st.info("Choose at least one method.")
    st.stop()

with common.errors_as_messages():
    ids, _ = model.encode(text)
    lim = common.limits()
    if len(ids) > lim["max_tokens"]:
        st.error(f"The text has {len(ids)} tokens; the limit here is {lim['max_tokens']}.")
        st.stop()
    with st.spinner("Computing (cached per model, text and method)…"):
        ex = cached_explain(model, text, methods)

    for w in ex.warnings:
        st.warning(w)

    if ex.prediction:
        st.subheader("Prediction")
        probs = ex.prediction["probabilities"]
        cols = st.columns(min(5, len(probs)))
        for c, (label, p) in zip(cols, probs.items()):
            c.metric(common.plots.display_tokens([label])[0], f"{p:.1%}")
        if ex.prediction.get("what"):
            st.caption(f"Top tokens: {ex.prediction['what']}.")

    st.subheader("Saliency")
    tgt = ex.tokens[ex.position]
    st.caption(f"Mixing methods: row of token {ex.position} ({plots.display_tokens([tgt])[0]}) of the last "
               f"aggregated map. Rows are scaled by their largest |value|.")
    fig = plots.saliency_figure(ex.tokens, ex.saliency)
    common.plot(fig, "saliency", data={"tokens": ex.tokens, **ex.saliency})

    if len(ex.saliency) > 1:
        st.subheader("Rank correlation between methods (this example)")
        corr = plots.rank_correlation_table(ex.saliency)
        st.dataframe(corr.style.format("{:.2f}").background_gradient(cmap="RdBu", vmin=-1, vmax=1), width="stretch")
        common.export_table(corr, "rank_correlations", caption="Spearman rho between saliencies on one example")

    map_methods = [m for m in methods if m in ex.layer_maps]
    L = model.n_layers
    if map_methods:
        st.subheader("Token-to-token maps")
        c1, c2 = st.columns([1, 2])
        mm = c1.selectbox("Method", map_methods, index=map_methods.index(common.qp("map", map_methods[0]))
                          if common.qp("map") in map_methods else 0, key="map_method")
        layer = c2.slider("Layer", 1, L, common.qp_int("layer", L, 1, L), key="layer")
        common.set_qp(map=mm, layer=layer)
        st.caption(MIXING_METHODS[mm].doc)
        a, b = st.columns(2)
        with a:
            common.plot(plots.map_heatmap(ex.tokens, ex.layer_maps[mm][layer - 1], f"{mm}: layer {layer}"),
                        f"{mm}_layer{layer}", data={"tokens": ex.tokens, "map": ex.layer_maps[mm][layer - 1]})
        with b:
            common.plot(plots.map_heatmap(ex.tokens, ex.global_maps[mm][layer - 1], f"{mm}: aggregated up to layer {layer}"),
                        f"{mm}_global{layer}", data={"tokens": ex.tokens, "map": ex.global_maps[mm][layer - 1]})

    st.subheader("Scope maps of one layer (Kobayashi et al. 2024)")
    scopes = list(scope_names(model.spec.position))
    if st.toggle("Show the FF paper's scope maps", value=common.qp("scopes", "1") == "1", key="scopes_on"):
        layer_s = st.slider("Layer for the scopes", 1, L, common.qp_int("slayer", L, 1, L), key="slayer")
        common.set_qp(scopes="1", slayer=layer_s)
        sx = cached_explain(model, text, scopes)
        maps = {s: sx.layer_maps[s][layer_s - 1] for s in scopes}
        st.caption("Each cell is the L2 norm of input token j's exact contribution vector to output token i in "
                   "that scope; the FF is split by zero-baseline Integrated Gradients (closed form). Post-LN order "
                   "Atb → AtbFf → AtbFfRes → AtbFfResLn; pre-LN Atb → AtbLn → AtbLnFf → AtbLnFfRes.")
        common.plot(plots.maps_grid(ex.tokens, maps), f"scopes_layer{layer_s}", data={"tokens": ex.tokens, **maps})
        before, after = ff_amp_scopes(model)
        norm_axis = st.radio("FF-amp normalisation", ["column", "row"], horizontal=True, key="ffamp_norm",
                             help="column: each input token's column sums to 1 (the paper's footnote 3, literally).")
        D = ff_amp_matrix(maps[before], maps[after], norm_axis)
        common.plot(plots.map_heatmap(ex.tokens, D, f"FF-amp: norm({after}) − norm({before}), layer {layer_s}",
                                      colorbar="amplification"),
                    f"ffamp_layer{layer_s}", data={"tokens": ex.tokens, "ff_amp": D})
    else:
        common.set_qp(scopes="0")

    st.caption(f"Recomputation check: the layers rebuilt from the weights match the model's hidden states to "
               f"{ex.reconstruction_error:.1e} (max abs).")
