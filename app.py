"""ctxmix dashboard entry (`streamlit run app.py` from a checkout; `ctxmix serve` and `make run`
start this same file) and its landing page, Explain: one example's prediction, saliency per method,
per-layer and aggregated maps, rank correlations between methods, and the FF paper's scope maps of
one layer. The other pages live in pages/, the layout they share in ctxmix_dashboard/ui/."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.isdir(os.path.join(_HERE, "ctxmix_dashboard")):  # a checkout: its ctxmix, even beside an installed one
    sys.path.insert(0, _HERE)

import streamlit as st  # noqa: E402

import ctxmix  # noqa: E402
from ctxmix.analyses.corpus import ff_amp_matrix, ff_amp_scopes
from ctxmix.export import plots
from ctxmix.export.saved import explanation_bytes
from ctxmix.methods.prediction import applicable_prediction_methods
from ctxmix.methods.registry import MIXING_METHODS, scope_names
from ctxmix.service.cache import cached_explain
from ctxmix_dashboard.ui import common, views  # noqa: E402

common.page_setup()

st.title("Explain one example")
name = common.model_picker()
model = common.load_or_stop(name)

seq2seq = model.kind == "seq2seq"
mixing = [m for m, i in MIXING_METHODS.items() if i.group != "scope"]
saliency_methods = list(ctxmix.SALIENCY_METHODS) if model.kind not in ("encoder", "seq2seq") else []
prediction_methods = applicable_prediction_methods(model)
available = mixing + saliency_methods + prediction_methods
default = ["attention_rollout", "globenc", "alti", "value_zeroing"] + (["grad_x_input"] if saliency_methods else [])
chosen_qp = [m for m in common.qp_list("method", default) if m in available] or default

text = st.text_area(
    "Text",
    value=common.qp_text("text", common.DEFAULT_TEXT),
    height=80,
    key="text",
    help="Special tokens are added by the model's tokenizer.",
)
pair, target_text = "", ""
if seq2seq:
    target_text = st.text_input(
        "Target text (optional: what the decoder reads, teacher-forced)",
        value=common.qp_text("decoder", ""),
        key="decoder",
        help="With a target, the page shows ALTI+ (Ferrando et al. 2022): maps over the source "
        "and target tokens, and how much each target token takes from the source. "
        "Without one, the mixing methods explain the encoder alone.",
    )
else:
    pair = st.text_input(
        "Second text (optional: a sentence pair, as for NLI, QA or paraphrase)",
        value=common.qp_text("pair", ""),
        key="pair",
        help="Tokenised together with the text as the model's tokenizer pairs them; BERT-like models "
        "read the pair's token types. The page then shows how much each text takes from the other.",
    )
source = (text, pair) if pair.strip() else text
if target_text.strip():
    methods = ["alti"]
    st.caption(
        "Encoder-decoder with a target: ALTI+ (the encoder's ALTI rollout carried through the decoder's "
        "self- and cross-attention)."
    )
else:
    methods = st.multiselect(
        "Methods",
        available,
        default=chosen_qp,
        key="methods",
        format_func=lambda m: f"{m} ({ctxmix.METHODS[m].paper})",
        help="Context-mixing methods give per-layer maps; their saliency is the target row of the "
        "aggregated map. Gradient methods need a model with a head. The prediction methods (decompx, "
        "logit, alti_logit) give signed contributions to a logit: a Prediction section shows them.",
    )
if seq2seq and not target_text.strip():
    st.caption(
        "Encoder-decoder model: without a target text the methods explain its encoder alone; gradient and "
        "blank-out methods are not offered."
    )
elif not saliency_methods:
    st.caption(
        "This model has no head, so gradient and blank-out methods are not offered; pick "
        "`minilm-sentiment` or a language model for them."
    )
common.set_qp(text=text, pair=pair, decoder=target_text, method=methods)
if not methods:
    st.info("Choose at least one method.")
    st.stop()

prompt_ids = None
with common.errors_as_messages():
    prompt_ids = model.encode_input(source).ids
if prompt_ids is None:  # the text could not be tokenised: the message is shown
    st.stop()
# the caps before any model call: a text over the cap is refused here, before Generate is offered
common.stop_over_cap(len(prompt_ids))

gen, gen_t, gen_contrast = None, None, False  # a language model's continuation and the token explained
if model.kind == "causal_lm":
    with common.errors_as_messages():
        gen, gen_t, gen_contrast = views.generation_controls(model, prompt_ids)

with common.errors_as_messages():
    ids = prompt_ids if gen_t is None else gen.input_ids[: gen_t + 1]
    if target_text.strip():
        from ctxmix.engine.seq2seq import encode_target

        ids = ids + encode_target(model, target_text)[0]
    common.stop_over_cap(len(ids), "The text and its target" if target_text.strip() else "The text")
    opts = {}
    c1, c2, c3, c4 = st.columns(4)
    if gen_t is not None:  # a generated token: its row t - 1, the token as target, the runner-up as foil
        step = gen.steps[gen_t - gen.prompt_length]
        opts.update(input_ids=ids, position=gen_t - 1, target=step["id"])
        if gen_contrast:
            opts["foil"] = step["runner_up"]
    position = (
        -1
        if gen_t is not None
        else c1.number_input(
            "Explained position",
            -1,
            len(ids) - 1,
            common.qp_int("position", -1, -1, len(ids) - 1),
            key="position",
            help="The output token whose row gives a mixing method's saliency and "
            "which a language model predicts from; -1: the model's default.",
        )
    )
    if position >= 0:
        opts["position"] = int(position)
    if gen_t is None and any(m in ctxmix.SALIENCY_METHODS or m in ("logit", "alti_logit", "decompx") for m in methods):
        if model.kind == "classifier":
            labels = [str(model.config.id2label[i]) for i in range(len(model.config.id2label))]
            t = c2.selectbox(
                "Target class",
                ["predicted"] + labels,
                key="target",
                index=common.qp_index("target", ["predicted"] + labels),
            )
            f = c3.selectbox(
                "Foil class (contrast)",
                ["none"] + labels,
                key="foil",
                index=common.qp_index("foil", ["none"] + labels),
            )
        else:
            t = (
                c2.text_input(
                    "Target token", value=common.qp_text("target", "", 100), placeholder="predicted", key="target"
                )
                or "predicted"
            )
            f = (
                c3.text_input(
                    "Foil token (contrast)", value=common.qp_text("foil", "", 100), placeholder="none", key="foil"
                )
                or "none"
            )
        common.set_qp(target=t, foil=f)
        if t != "predicted":
            opts["target"] = t
        if f != "none":
            opts["foil"] = f
    heads = False
    if target_text.strip():
        opts["decoder_text"] = target_text
    else:
        heads = c4.toggle(
            "Per-head maps",
            value=common.qp("heads", "0") == "1",
            key="heads",
            help="One map per attention head for the methods that have a per-head form (attention, "
            "norm): a layer x head grid and a head selector under the maps.",
        )
    common.set_qp(heads=int(heads), position=int(position))
    if heads:
        opts["per_head"] = True
    common.memory_caption(model, len(ids), "explain", methods)
    with st.spinner("Computing (cached per model, text and method)…"), common.engine_progress("Computing:"):
        ex = cached_explain(model, None if gen_t is not None else source, methods, **opts)

    for w in ex.warnings:
        st.warning(w)

    common.set_provenance(
        model=name,
        weights_sha256=ex.provenance.get("weights_sha256"),
        text=text,
        **({"text_pair": pair} if pair.strip() else {}),
        **({"decoder_text": target_text} if target_text.strip() else {}),
        methods=methods,
        options={k: v for k, v in opts.items() if k != "input_ids"},
        **(
            {
                "generation": {
                    "sampled": common.qp("gen_sample") == "1",
                    "seed": int(common.qp("gen_seed", 0)),
                    "continuation_ids": gen.new_ids,
                    "continuation": gen.text,
                    "explained_token": gen_t,
                }
            }
            if gen_t is not None
            else {}
        ),
        target=ex.target,
        foil=ex.foil,
        position=ex.position,
    )
    L = next((len(v) for v in ex.layer_maps.values()), model.n_layers)  # an encoder-decoder: its decoder's
    views.show_explanation(ex, L)
    if model.kind == "causal_lm":
        views.show_routes(model, name, ex.input_ids, ex.position)
    st.download_button(
        "Download this explanation (.npz)",
        data=lambda: explanation_bytes(ex),
        file_name="explanation.npz",
        mime="application/octet-stream",
        key="download_npz",
        on_click="ignore",
        help="Reopen it on the Saved explanation page or with ctxmix.load_explanation, without the model.",
    )

    st.subheader("Scope maps of one layer (Kobayashi et al. 2024)")
    scopes = list(scope_names(model.spec.position))
    if target_text.strip():
        st.caption("The scope maps decompose one stack of layers; with a target text, clear it to see the encoder's.")
    elif st.toggle("Show the FF paper's scope maps", value=common.qp("scopes", "1") == "1", key="scopes_on"):
        layer_s = st.slider("Layer for the scopes", 1, L, common.qp_int("slayer", L, 1, L), key="slayer")
        common.set_qp(scopes="1", slayer=layer_s)
        sx = cached_explain(model, source, scopes)
        maps = {s: sx.layer_maps[s][layer_s - 1] for s in scopes}
        st.caption(
            "Each cell is the L2 norm of input token j's exact contribution vector to output token i in "
            "that scope; the FF is split by zero-baseline Integrated Gradients (closed form). This model's "
            f"order ({model.spec.family}, {model.spec.position}): {' → '.join(scopes)}."
        )
        common.plot(plots.maps_grid(ex.tokens, maps), f"scopes_layer{layer_s}", data={"tokens": ex.tokens, **maps})
        before, after = ff_amp_scopes(model)
        norm_axis = st.radio(
            "FF-amp normalisation",
            ["column", "row"],
            horizontal=True,
            key="ffamp_norm",
            help="column: each input token's column sums to 1 (the paper's footnote 3, literally).",
        )
        D = ff_amp_matrix(maps[before], maps[after], norm_axis)
        common.plot(
            plots.map_heatmap(
                ex.tokens, D, f"FF-amp: norm({after}) − norm({before}), layer {layer_s}", colorbar="amplification"
            ),
            f"ffamp_layer{layer_s}",
            data={"tokens": ex.tokens, "ff_amp": D},
        )
    else:
        common.set_qp(scopes="0")

    import shlex

    cmd = [
        "python",
        "-m",
        "ctxmix",
        "explain",
        text,
        *(["--pair", pair] if pair.strip() else []),
        *(["--decoder-text", target_text] if target_text.strip() else []),
        "--model",
        name,
        "--method",
        *methods,
    ]
    for flag, key in (("--target", "target"), ("--foil", "foil"), ("--position", "position")):
        if key in opts:
            cmd += [flag, str(opts[key])]
    cmd += ["--per-head"] if opts.get("per_head") else []
    if gen_t is not None:  # the same continuation (greedy, or sampled with its seed) and the same token
        cmd = ["python", "-m", "ctxmix", "generate", text, "--model", name, "--max-new-tokens", str(len(gen.new_ids))]
        cmd += ["--sample", "--seed", str(common.qp("gen_seed", 0))] if common.qp("gen_sample") == "1" else []
        cmd += ["--explain-token", str(gen_t), "--method", *methods]
        cmd += ["--runner-up-foil"] if gen_contrast else []
    common.reproduce(" ".join(shlex.quote(c) for c in cmd + ["--out", "explanation.npz"]))
    if ex.layer_maps or ex.global_maps or ex.logit_contributions:  # gradient methods rebuild no layer
        st.caption(
            f"Recomputation check: the layers rebuilt from the weights match the model's hidden states to "
            f"{ex.reconstruction_error:.1e} (max abs)."
        )
