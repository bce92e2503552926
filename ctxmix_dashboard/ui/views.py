"""The views of one explanation, shared by the Explain page and the Saved explanation page:
prediction, saliency, rank correlations between methods, per-layer and aggregated maps, and
per-head maps. Layout only; every number comes from the Explanation."""

from __future__ import annotations

import streamlit as st

from ctxmix.analyses.pairs import cross_segment_mixing
from ctxmix.export import plots
from ctxmix.export.notebook import logit_row_labels
from ctxmix.methods.registry import MIXING_METHODS, PREDICTION_METHODS
from ctxmix_dashboard.ui import common


def show_explanation(ex, layers: int) -> None:
    if ex.prediction:
        st.subheader("Prediction")
        probs = ex.prediction["probabilities"]
        cols = st.columns(min(5, len(probs)))
        for c, (label, p) in zip(cols, probs.items()):
            c.metric(plots.display_tokens([label])[0], f"{p:.1%}")
        if ex.prediction.get("what"):
            st.caption(f"Top tokens: {ex.prediction['what']}.")

    st.subheader("Saliency")
    tgt = ex.tokens[ex.position]
    what = f" Gradient and perturbation methods explain output {ex.target}" if ex.target is not None else ""
    if what and ex.foil is not None:
        what += f" minus output {ex.foil} (logit difference)"
    st.caption(
        f"Mixing methods: row of token {ex.position} ({plots.display_tokens([tgt])[0]}) of the last "
        f"aggregated map. Rows are scaled by their largest |value|.{what + '.' if what else ''}"
    )
    common.plot(plots.saliency_figure(ex.tokens, ex.saliency), "saliency", data={"tokens": ex.tokens, **ex.saliency})

    if len(ex.saliency) > 1:
        st.subheader("Rank correlation between methods (this example)")
        corr = plots.rank_correlation_table(ex.saliency)
        st.dataframe(corr.style.format("{:.2f}").background_gradient(cmap="RdBu", vmin=-1, vmax=1), width="stretch")
        common.export_table(corr, "rank_correlations", caption="Spearman rho between saliencies on one example")

    # methods with maps: the mixing methods (per layer and aggregated), and decompx and attention
    # flow, whose maps are aggregated by the method itself (global maps only)
    map_methods = [m for m in ex.methods if m in ex.layer_maps or m in ex.global_maps]
    L = layers
    if map_methods:
        st.subheader("Token-to-token maps")
        c1, c2 = st.columns([1, 2])
        mm = c1.selectbox(
            "Method",
            map_methods,
            index=common.qp_index("map", map_methods),
            key="map_method",
        )
        layer = c2.slider("Layer", 1, L, common.qp_int("layer", L, 1, L), key="layer")
        common.set_qp(map=mm, layer=layer)
        if mm in MIXING_METHODS:
            st.caption(MIXING_METHODS[mm].doc)
            if MIXING_METHODS[mm].caveat and ex.provenance.get("model_causal"):
                st.warning(MIXING_METHODS[mm].caveat)
        elif mm in PREDICTION_METHODS:
            st.caption(PREDICTION_METHODS[mm].doc + (" Rows not computed are blank." if mm == "attention_flow" else ""))
        same = st.checkbox(
            "Same colour scale for every layer",
            value=common.qp("scale", "layers") == "layers",
            key="same_scale",
            help="Off: each map uses its own range.",
        )
        common.set_qp(scale="layers" if same else "own")
        zg = plots.color_range(ex.global_maps[mm]) if same else None
        glob = plots.map_heatmap(
            ex.tokens,
            ex.global_maps[mm][layer - 1],
            f"{mm}: " + ("aggregated up to" if mm in ex.layer_maps else "after") + f" layer {layer}",
            zmax=zg,
        )
        glob_data = {"tokens": ex.tokens, "map": ex.global_maps[mm][layer - 1]}
        if mm in ex.layer_maps:
            zl = plots.color_range(ex.layer_maps[mm]) if same else None
            a, b = st.columns(2)
            with a:
                common.plot(
                    plots.map_heatmap(ex.tokens, ex.layer_maps[mm][layer - 1], f"{mm}: layer {layer}", zmax=zl),
                    f"{mm}_layer{layer}",
                    data={"tokens": ex.tokens, "map": ex.layer_maps[mm][layer - 1]},
                )
            with b:
                common.plot(glob, f"{mm}_global{layer}", data=glob_data)
        else:
            common.plot(glob, f"{mm}_global{layer}", data=glob_data)
        if mm in ex.head_maps:
            H = ex.head_maps[mm].shape[1]
            st.caption(
                f"Per head ({MIXING_METHODS[mm].per_head}). Every layer (rows) and head (columns), on one "
                "colour scale; pick a head below to open it."
            )
            common.plot(
                plots.head_grid(ex.tokens, ex.head_maps[mm], f"{mm}: every head"),
                f"{mm}_heads",
                data={"tokens": ex.tokens, "head_maps": ex.head_maps[mm]},
            )
            head = st.selectbox("Head", list(range(1, H + 1)), index=common.qp_int("head", 1, 1, H) - 1, key="head")
            common.set_qp(head=head)
            hm = ex.head_maps[mm][layer - 1, head - 1]
            zh = plots.color_range(ex.head_maps[mm]) if same else None
            common.plot(
                plots.map_heatmap(ex.tokens, hm, f"{mm}: layer {layer}, head {head}", zmax=zh),
                f"{mm}_layer{layer}_head{head}",
                data={"tokens": ex.tokens, "map": hm},
            )

    predicted = [m for m in ex.methods if m in ex.logit_contributions or m in ex.layer_saliency]
    if predicted:
        show_prediction(ex, predicted)
    if ex.options.get("decoder_text") is not None:  # an encoder-decoder's source and target
        show_source_contribution(ex)
    elif ex.segments and {0, 1} <= set(ex.segments) and map_methods:
        show_pair_mixing(ex)


def show_pair_mixing(ex) -> None:
    st.subheader("Sentence pair: how much each text takes from the other")
    st.caption(
        "Each map's rows normalised to sum to one over tokens; A→B is the share of text B's tokens' "
        "context that comes from text A, B→A the reverse. Special tokens belong to neither text: their "
        "share is the column 'special'. Per layer (each layer's own map) and aggregated up to the layer."
    )
    df = cross_segment_mixing(ex)
    common.plot(plots.cross_mixing_figure(df), "pair_mixing", data=df)
    view = st.radio(
        "Table",
        ["aggregated", "layer"],
        horizontal=True,
        key="pair_table",
        format_func=lambda v: {"aggregated": "aggregated maps", "layer": "each layer's map"}[v],
    )
    table = (
        df[df["map"] == view]
        .pivot_table(index=["method", "layer"], columns="direction", values=["other", "special"])
        .round(3)
    )
    table.columns = [f"{d} {what}" for what, d in table.columns]
    st.dataframe(table, width="stretch")
    common.export_table(table.reset_index(), "pair_mixing", caption="Share of each text's context from the other text")


def show_source_contribution(ex) -> None:
    """ALTI+ on an encoder-decoder: each target token's source share, per decoder layer."""
    from ctxmix import source_contribution

    st.subheader("Source and target contributions (ALTI+, Ferrando et al. 2022)")
    S = ex.segments.count(0)
    share = source_contribution(ex)
    st.caption(
        "How much of each target token's representation comes from the source sentence (the rest comes "
        "from the target prefix the decoder has read), after each decoder layer, rolled out through the "
        "encoder. The maps above are square over [source; target]: source rows are the encoder's ALTI "
        "rollout, target rows ALTI+."
    )
    tokens = ex.tokens[S:]
    common.plot(
        plots.source_contribution_figure(tokens, share),
        "source_contribution",
        data={"tokens": tokens, **{f"layer {l + 1}": row for l, row in enumerate(share)}},
    )


def show_prediction(ex, methods: list[str]) -> None:
    """The prediction methods: DecompX's signed parts per class (or per explained token), and Logit /
    ALTI-Logit's layers x tokens table with the parts no token gets beside it (the ALTI-Logit paper's
    Table 1), with the totals and terms as a table."""
    st.subheader("How the context builds the prediction")
    explained = (ex.prediction or {}).get("explained")
    if explained:
        st.caption(f"Explained: {explained['what']} = {explained['value']:.4g} (the model's own value).")
    for m in methods:
        info = PREDICTION_METHODS[m]
        st.markdown(f"**{info.title}** ({info.paper})")
        st.caption(info.doc)
        if m in ex.logit_contributions:
            rows = ex.logit_contributions[m]
            labels = logit_row_labels(ex, m)  # the notebook's show(kind="prediction") names them the same
            common.plot(
                plots.logit_contributions_figure(ex.tokens, rows, labels, f"{m}: signed parts of each logit"),
                f"{m}_logit_parts",
                data={"tokens": ex.tokens, "rows": labels, "parts": rows},
            )
        if m in ex.layer_saliency:
            terms = ex.logit_terms.get(m, {})
            common.plot(
                plots.layer_saliency_figure(ex.tokens, ex.layer_saliency[m], terms, f"{m}: per layer and token"),
                f"{m}_layers",
                data={"tokens": ex.tokens, "layer_saliency": ex.layer_saliency[m], **terms},
            )
        terms = ex.logit_terms.get(m) or {}
        if terms or m in ex.saliency:
            import pandas as pd

            table = pd.DataFrame(
                [{"part": "input tokens (sum)", "value": float(ex.saliency[m].sum())}]
                + [{"part": k, "value": float(sum(v) if isinstance(v, list) else v)} for k, v in terms.items()]
            )
            st.dataframe(table.style.format({"value": "{:.4g}"}), hide_index=True)
            common.export_table(table, f"{m}_parts", caption=f"{info.title}: what the explained logit is made of")


# ---------------------------------------------------------------- generation and routes (language models)


def _parse_ids(text: str | None) -> list[int]:
    """Token ids from a link's comma-separated list ([] for anything else)."""
    try:
        return [int(x) for x in str(text or "").split(",") if x.strip()]
    except ValueError:
        st.warning("The link's continuation `cont` is not a list of token ids; it is ignored.")
        return []


def generation_controls(model, prompt_ids: list[int]):
    """A language model's Generate box: the continuation as clickable tokens. Returns (Generation or
    None, the chosen generated position t or None, whether to contrast with the runner-up). The
    continuation's ids and the chosen token live in the link (`cont`, `tok`)."""
    import ctxmix
    from ctxmix.engine.generate import MAX_NEW_TOKENS, prompt_key
    from ctxmix.service.limits import GENERATE_MAX_NEW, check_generation, generation_room

    lim = common.server_limits()
    for_prompt = prompt_key(prompt_ids)
    with st.container(border=True):
        st.markdown("**Generate** a continuation, then click a generated token to explain it")
        room = generation_room(len(prompt_ids), lim, min(MAX_NEW_TOKENS, GENERATE_MAX_NEW))
        if room < 1:  # no continuation fits: nothing is offered, nothing runs
            st.info(
                f"The prompt has {len(prompt_ids)} tokens; the limit here is {lim.max_tokens} tokens for the "
                "prompt and its continuation together, so there is no room to generate. Shorten the prompt."
            )
            return None, None, False
        c1, c2, c3, c4 = st.columns([1, 1, 1, 1], vertical_alignment="bottom")
        n_new = c1.number_input(
            "New tokens",
            1,
            room,
            min(10, room),
            key="gen_n",
            help=f"At most {room} here: the prompt's {len(prompt_ids)} tokens and the new ones count together "
            f"against the limit of {lim.max_tokens} tokens.",
        )
        sampled = c2.toggle("Sample", value=common.qp("gen_sample", "0") == "1", key="gen_sample")
        seed = c3.number_input(
            "Seed", 0, 2**31 - 1, common.qp_int("gen_seed", 0, 0, 2**31 - 1), key="gen_seed", disabled=not sampled
        )
        go_ = c4.button("Generate", key="generate", type="primary")
        common.set_qp(gen_sample=int(sampled), gen_seed=int(seed))
        if go_:
            check_generation(len(prompt_ids), int(n_new), lim)  # before any generation step
            bar = st.progress(0.0, text="Generating…")
            g = ctxmix.generate(
                model,
                input_ids=prompt_ids,
                max_new_tokens=int(n_new),
                greedy=not sampled,
                seed=int(seed),
                progress=lambda k, n: bar.progress(k / n, text=f"Generating… {k}/{n} tokens"),
            )
            bar.empty()
            st.session_state.pop("gen_token", None)  # a new continuation: its last token, not the old pick
            common.set_qp(cont=",".join(map(str, g.new_ids)), tok=g.generated_positions[-1], gen_for=for_prompt)
        new_ids = _parse_ids(common.qp("cont"))
        if not new_ids or common.qp("gen_for") != for_prompt:  # none yet, or made for another prompt
            return None, None, False
        if len(prompt_ids) + len(new_ids) > lim.max_tokens:  # a link's continuation: checked before its forward pass
            st.warning(f"The continuation would pass the {lim.max_tokens}-token limit here; generate again.")
            return None, None, False
        g = _continuation(model, model.name, tuple(prompt_ids), tuple(new_ids))
        positions = g.generated_positions
        chosen = common.qp_int("tok", positions[-1], positions[0], positions[-1])
        step = {s["position"]: s for s in g.steps}
        t = st.pills(
            "Continuation (click a token to explain it)",
            positions,
            selection_mode="single",
            default=chosen,
            format_func=lambda t: plots.display_tokens([step[t]["token"]])[0],
            key="gen_token",
        )
        if t is None:
            st.caption("No token chosen: the page explains the prompt.")
            return g, None, False
        common.set_qp(tok=int(t))
        s = step[t]
        contrast = st.toggle(
            f"Contrast with the runner-up {plots.display_tokens([s['runner_up_token']])[0]!r} "
            f"(p = {s['runner_up_probability']:.1%})",
            value=common.qp("gen_foil", "1") == "1",
            key="gen_foil",
            help="The prediction methods and gradients then explain logit(token) − logit(runner-up).",
        )
        common.set_qp(gen_foil=int(contrast))
        st.caption(
            f"Explaining generated token {t} {plots.display_tokens([s['token']])[0]!r} (p = {s['probability']:.1%}): "
            f"the row at position {t - 1} predicts it, so the maps and methods explain position {t - 1}."
        )
        return g, int(t), contrast


@st.cache_resource(max_entries=32, show_spinner=False)
def _continuation(_model, model_name: str, prompt_ids: tuple, new_ids: tuple):
    """The Generation of a link's continuation: one forward pass per (model, ids), not one per rerun."""
    from ctxmix.engine.generate import continuation

    return continuation(_model, list(prompt_ids), list(new_ids))


@st.cache_resource(max_entries=32, show_spinner=False)
def _routes(_model, model_name: str, ids: tuple, position: int, threshold: float):
    from ctxmix.methods.routes import routes

    return routes(_model, input_ids=list(ids), position=position, threshold=threshold)


def show_routes(model, model_name: str, ids: list[int], position: int) -> None:
    """The Routes view: the information flow routes to the residual state at `position`, a threshold
    slider, a node's incoming parts by head and FFN, and the graph's exports (figure and JSON)."""
    st.subheader("Information flow routes (Ferrando & Voita 2024)")
    if not st.toggle("Show the routes", value=common.qp("routes", "1") == "1", key="routes_on"):
        common.set_qp(routes="0")
        return
    try:
        tau0 = min(0.10, max(0.01, round(float(common.qp("tau", 0.04)), 2)))
    except (ValueError, OverflowError):  # a link's tau that is not a number
        tau0 = 0.04
    tau = st.slider(
        "Threshold τ",
        0.01,
        0.10,
        tau0,
        0.01,
        key="tau",
        help="Edges whose importance is at most τ are dropped (per head, then renormalised: the paper's rule). "
        "The tool's default is 0.04; the paper uses 0.01-0.04.",
    )
    common.set_qp(routes="1", tau=f"{tau:.2f}")
    with st.spinner("Extracting the routes…"):
        r = _routes(model, model_name, tuple(ids), int(position), round(float(tau), 4))
    st.caption(
        f"The routes explain the top residual state at position {position} "
        f"({plots.display_tokens([r.tokens[position]])[0]}), not one token's logit: every edge whose importance "
        f"(ALTI's L1 proximity, normalised per node) is above τ = {tau:.2f}, followed down from that state. "
        f"{len(r.nodes)} nodes, {len(r.graph_edges())} edges. Green: attention and residual; purple: FFN."
    )
    common.plot(r.figure(), f"routes_pos{position}", data=r.to_dict())
    st.download_button(
        "Graph (JSON)",
        data=lambda: r.to_json(indent=1).encode(),
        file_name=f"routes_pos{position}.json",
        mime="application/json",
        key="routes_json",
        on_click="ignore",
    )
    nodes = [s for s in r.nodes["node"] if s[0] in "AI"]
    if nodes:
        node = st.selectbox(
            "Node: its incoming edges by head and FFN",
            nodes,
            index=nodes.index(r.start) if r.start in nodes else 0,
            key="routes_node",
            help="A<l>_t: the residual after layer l's attention at token t; I<l>_t: after its FFN.",
        )
        d = r.node_detail(node)
        st.dataframe(d.style.format({"importance": "{:.4f}", "weight": "{:.4f}"}), hide_index=True, width="stretch")
        common.export_table(d, f"routes_{node}", caption=f"Parts into {node} (importance before τ, kept weight)")
