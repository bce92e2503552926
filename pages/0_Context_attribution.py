"""Context attribution: paste (or upload) documents, ask a question, see which sources the model's answer
rests on, for the whole answer or a span of it, then check it by removing them. Layout only: the numbers
come from `ctxmix.attribute_context` and `ctxmix.methods.context.check`, the views from
`ctxmix.export.context.view` and `ctxmix.export.plots.context_figure`."""

import streamlit as st

import ctxmix
from ctxmix.export import plots
from ctxmix.export.context import view as cv
from ctxmix.export.context.cite import messages_json, reproduce_command
from ctxmix.export.context.json_file import context_attribution_json
from ctxmix.export.context.npz_file import context_attribution_bytes
from ctxmix.methods.context.check import extend_attribution, pending_methods, prompt_token_count
from ctxmix.methods.context.defaults import page_methods
from ctxmix.methods.context.options import unescape_cue
from ctxmix.methods.context.prompt import context_message
from ctxmix.methods.registry import CONTEXT_METHODS, context_methods
from ctxmix.service.limits import check_context_request
from ctxmix_dashboard.ui import common

ABLATION = context_methods("ablation")  # slow: behind a button
STOPS = ["auto", "sentence", "line", "none"]
NO_CUE = "none"  # the link's word for an empty cue (an empty parameter reads as absent)
DEFAULT_CONTEXT = (
    "The museum opened in 1902 in a former railway station. Its collection grew slowly at first. "
    "The code for the staff entrance is 4817. Visitors enter through the main hall on the north side. "
    "The café on the top floor closes at five."
)
DEFAULT_QUERY = "What is the code for the staff entrance?"
UNITS = ["sentence", "paragraph", "document"]
ROLES = ["user", "assistant"]  # earlier turns (the system message has its own box)
MAX_TURNS = 8
MAIN_WIDTH_PX = 900  # the main column of the wide layout on a 1,280-px screen with the sidebar open
WIDTHS = {"screen (700 px)": 700, "ACL column (3.03 in)": 291, "ACL page (6.3 in)": 605, "NeurIPS / ICLR (5.5 in)": 528}

common.page_setup()
st.title("Context attribution")
st.caption(
    "Which sentences (paragraphs, documents) of a context made a causal language model give its answer: "
    "one-pass methods from ctxmix's exact decompositions, ContextCite from random ablations, each checkable "
    "by removing its top sources."
)
if "model" not in st.query_params and common.qp("model") in (None, "minilm", "minilm-sentiment"):
    st.query_params["model"] = "smollm2"  # this page needs a causal language model: the embedded one
name = common.model_picker()
model = common.load_or_stop(name)
if model.kind != "causal_lm" or model.spec.encoder_decoder:
    st.info(
        f"{name} is not a causal language model; pick `smollm2` or `gemma3` (embedded) or another decoder "
        "in the sidebar."
    )
    st.stop()
lim = common.server_limits()

# ---------------------------------------------------------------- inputs
source_kind = st.segmented_control(
    "Context",
    ["text", "files"],
    default=common.qp("ctx_from", "text") if common.qp("ctx_from", "text") in ("text", "files") else "text",
    format_func={"text": "Paste text", "files": "Upload .txt / .md files (one document each)"}.get,
    key="ctx_from",
)
source_kind = source_kind or "text"
documents: list[str] = []
file_names: list[str] = []
if source_kind == "text":
    context = st.text_area(
        "Context",
        value=common.qp_text("ctx", DEFAULT_CONTEXT, 60_000),
        height=180,
        key="ctx",
        help="Blank lines separate paragraphs; one pasted text is one document.",
    )
    documents = [context]
else:
    ups = st.file_uploader(
        "Documents",
        type=["txt", "md"],
        accept_multiple_files=True,
        key="ctx_files",
        max_upload_size=max(1, int(lim.max_upload_mb + 0.999)),
        help=f"At most {lim.max_documents} files; each is one document (a source when the unit is 'document').",
    )
    linked = common.qp_list("files", [])
    if not ups:
        if linked:
            st.info(
                "This link's documents were uploaded (" + ", ".join(linked) + "); links do not carry files: "
                "upload them again to see the same view."
            )
        else:
            st.info("Upload one or more .txt or .md files.")
        st.stop()
    for up in ups:
        if up.size > lim.max_upload_mb * 2**20:  # a client can skip the browser's check
            st.error(f"{up.name} is {up.size / 2**20:.1f} MB; the limit here is {lim.max_upload_mb:g} MB per file.")
            st.stop()
        try:
            documents.append(up.getvalue().decode("utf-8"))
        except UnicodeDecodeError:
            st.error(f"{up.name} is not UTF-8 text.")
            st.stop()
        file_names.append(up.name)
query = st.text_input("Query", value=common.qp_text("query", DEFAULT_QUERY, 2_000), key="query")
linked_turns, linked_roles = common.qp_list("turn", []), common.qp_list("trole", [])
with st.expander(
    "Conversation (optional): a system message and earlier turns", expanded=bool(common.qp("sys") or linked_turns)
):
    system = st.text_area(
        "System message",
        value=common.qp_text("sys", "", 4_000),
        key="sys",
        help="Sent first. With a system message or earlier turns the prompt is a conversation, and their "
        "sentences (paragraphs) are sources too; the context and query form the last user message.",
    )
    n_turns = st.number_input(
        "Earlier turns", 0, MAX_TURNS, common.qp_int("turns", len(linked_turns), 0, MAX_TURNS), key="turns"
    )
    turns: list[dict] = []
    for i in range(int(n_turns)):
        t1, t2 = st.columns([1, 4])
        default_role = linked_roles[i] if i < len(linked_roles) and linked_roles[i] in ROLES else ROLES[i % 2]
        role = t1.selectbox(f"Turn {i + 1}", ROLES, index=ROLES.index(default_role), key=f"trole{i}")
        text = t2.text_area(
            f"Turn {i + 1} text",
            value=linked_turns[i] if i < len(linked_turns) else "",
            key=f"turn{i}",
            height=68,
            label_visibility="collapsed",
        )
        turns.append({"role": role, "content": text})
# the shipped defaults for this model, matched by its weights' fingerprint (ctxmix.methods.context.defaults)
default_methods, chosen_on = page_methods(model)
methods = st.multiselect(  # its own full-width row, chips named by the method alone: no label cut with "…"
    "Methods",
    list(CONTEXT_METHODS),
    default=[m for m in common.qp_list("cmethod", default_methods) if m in CONTEXT_METHODS] or default_methods,
    key="cmethods",
    help=cv.methods_help() + f" Default for this model: {', '.join(default_methods)} (chosen on {chosen_on}).",
)
c1, c3, c4 = st.columns(3)
unit = c1.selectbox("Source unit", UNITS, index=common.qp_index("unit", UNITS), key="unit")
n_new = c3.number_input(
    "New tokens",
    1,
    lim.max_context_new_tokens,
    common.qp_int("new", min(24, lim.max_context_new_tokens), 1, lim.max_context_new_tokens),
    key="new",
)
n_abl = c4.number_input(
    "Ablations (ContextCite)",
    2,
    lim.max_ablations,
    common.qp_int("nabl", min(32, lim.max_ablations), 2, lim.max_ablations),
    key="nabl",
)
with st.expander("Response (optional)", expanded=bool(common.qp("resp"))):
    given = st.text_area(
        "Attribute this response instead of generating one",
        value=common.qp_text("resp", "", 4_000),
        key="resp",
        help="Empty: the model's greedy answer. A stored answer keeps the view the same on another machine.",
    )
    f1, f2 = st.columns(2)
    cue = f1.text_input(
        "Answer cue after the query",
        value="" if common.qp("cue") == NO_CUE else common.qp_text("cue", "auto", 200),
        key="cue",
        help="auto: '\\nAnswer:' for a model without a chat template (a base model reads the prompt as a document "
        "to continue), none with one. Empty: no cue. \\n is a line break.",
    )
    stop = f2.selectbox(
        "Cut a generated response at",
        STOPS,
        index=STOPS.index(common.qp("stop", "auto")) if common.qp("stop", "auto") in STOPS else 0,
        key="stop",
        help="auto: its first sentence for a model without a chat template (it rambles past its answer), none "
        "with one.",
    )
common.set_qp(
    ctx_from=source_kind,
    ctx=documents[0] if source_kind == "text" else None,
    files=file_names or None,
    query=query,
    unit=unit,
    cmethod=methods,
    new=int(n_new),
    nabl=int(n_abl),
    resp=given,
    cue=None if cue == "auto" else (cue or NO_CUE),
    stop=None if stop == "auto" else stop,
    sys=system or None,
    turns=int(n_turns) or None,
    turn=[t["content"] for t in turns] or None,
    trole=[t["role"] for t in turns] or None,
)
if source_kind == "files":
    st.query_params.pop("ctx", None)
for k, v in {"cue": cue != "auto", "stop": stop != "auto"}.items():
    if not v:  # back to auto: out of the link too
        st.query_params.pop(k, None)
for k, v in {"sys": system, "turns": int(n_turns), "turn": turns, "trole": turns}.items():
    if not v:  # cleared: out of the link too
        st.query_params.pop(k, None)
if not methods:
    st.info("Choose at least one method.")
    st.stop()
context = documents if len(documents) > 1 else documents[0]
query_arg = query.strip() or None
response_arg = given if given.strip() else None
messages_arg = None  # the context/query form, unless there is a system message or an earlier turn
if system.strip() or any(t["content"].strip() for t in turns):
    with common.errors_as_messages():
        head = [{"role": "system", "content": system}] if system.strip() else []
        earlier = [t for t in turns if t["content"].strip()]
        messages_arg = [*head, *earlier, context_message(context, query_arg, unit)]
    if messages_arg is None:
        st.stop()

form_arg = {"query_suffix": unescape_cue(cue), "stop": None if stop == "none" else stop}  # "auto": the model's

# ---------------------------------------------------------------- caps, before any model call
capped = True
with common.errors_as_messages():
    if messages_arg is None:
        n_prompt = prompt_token_count(model, context, query_arg, unit, prompt=form_arg)
    else:
        n_prompt = prompt_token_count(model, None, None, unit, messages=messages_arg, prompt=form_arg)
    wants_abl = any(m in ABLATION for m in methods)
    check_context_request(n_prompt, len(documents), int(n_abl) if wants_abl else None, int(n_new), lim)
    capped = False
if capped:  # the message naming the limit is shown; nothing ran
    st.stop()

# ---------------------------------------------------------------- the attribution (cached in this session)
cache = st.session_state.setdefault("_ctx_cache", {})
key = (name, tuple(documents), query_arg, unit, response_arg, int(n_new), repr(messages_arg), repr(form_arg))
ca = cache.get(key)


def _bar(what: str):
    bar = st.progress(0.0, text=what)

    def report(stage, done, total):
        label = "Generating the response" if stage == "generate" else cv.stage_label(stage)
        bar.progress(min(1.0, done / max(total, 1)), text=f"{label}… {done}/{total}")

    return bar, report


def _attribute(ca, todo: list[str], what: str):
    """The cached attribution with `todo` added (a new one when there is none), behind a progress bar."""
    bar, report = _bar(what)
    if ca is None:
        what = {"context": context, "query": query_arg} if messages_arg is None else {"messages": messages_arg}
        ca = ctxmix.attribute_context(
            model,
            **what,
            response=response_arg,
            sources=unit,
            methods=todo,
            max_new_tokens=int(n_new),
            prompt=form_arg,
            ablations={"n": int(n_abl)},
            progress=report,
        )
    else:
        extend_attribution(ca, model, todo, n_ablations=int(n_abl), progress=report)
    cache.clear()  # one attribution per session: the latest inputs
    cache[key] = ca
    bar.empty()
    return ca


one_pass = [m for m in methods if m not in ABLATION]
ablation = [m for m in methods if m in ABLATION]
common.memory_caption(
    model,
    model.count_tokens(" ".join([context] if isinstance(context, str) else context) + " " + str(messages_arg or ""))
    + int(n_new),
    "attribute_context",
    methods,
    n_response=int(n_new),
    n_ablations=int(n_abl),
)
with common.errors_as_messages():
    todo = [m for m in one_pass if ca is None or m not in ca.methods]
    if todo:
        ca = _attribute(ca, todo, "Tracing…")
    pending = pending_methods(ca, ablation, n_ablations=int(n_abl))
    if pending:
        label = " and ".join(pending)
        passes = cv.passes_label(pending, int(n_abl))
        run = common.qp("abl") == "1" or st.button(f"Run {label} ({passes})", key="run_ablations", type="primary")
        if run:
            ca = _attribute(ca, pending, "Ablations…")
            common.set_qp(abl=1)
        else:
            st.caption(f"{label}: not run yet (one forward pass per ablation; the button runs it).")
    elif ablation:
        common.set_qp(abl=1)
if ca is None:
    st.stop()

shown = [m for m in ca.methods if m in methods] or list(ca.methods)
for w in ca.warnings:
    st.warning(w)

# ---------------------------------------------------------------- the response and its span
st.subheader("Response")
st.markdown(f"> {ca.response}" if ca.response.strip() else "*(empty)*")
st.caption(
    f"{len(ca.response_ids)} tokens, {ca.options['response']}; prompt {len(ca.prompt_ids)} tokens, "
    f"{ca.n_sources} sources ({unit}s)."
)
span_units = list(cv.SPAN_UNITS)
span_unit = st.segmented_control(
    "Explain",
    span_units,
    default=common.qp("span_unit", "response") if common.qp("span_unit") in span_units else "response",
    format_func={"response": "the whole response", "sentence": "a sentence", "word": "words"}.get,
    key="span_unit",
)
span_unit = span_unit or "response"
span = None
if span_unit != "response":
    pieces = cv.response_pieces(ca.response, span_unit)
    labels = cv.unique_labels([p[2] for p in pieces])
    linked = [int(x) for x in common.qp_list("pick", []) if str(x).isdigit() and int(x) < len(pieces)]
    picked = st.pills(
        "Click the pieces to explain (a span runs from the first to the last one picked)",
        list(range(len(pieces))),
        selection_mode="multi",
        default=linked,
        format_func=lambda i: labels[i],
        key="span_pick",
    )
    common.set_qp(pick=list(picked))
    span = cv.span_of(pieces, picked)
    # key-mask methods score the whole response only: a part is explained by the others, or (none) not at all
    shown, whole_only = cv.span_methods(ca, shown, span)
    if whole_only and not shown:
        st.info(
            f"{', '.join(whole_only)} {'scores' if len(whole_only) == 1 else 'score'} the whole response only, so "
            "the whole response is explained. For a "
            f"part of it, add a method that scores spans ({', '.join(cv.span_scoring_methods())})."
        )
        shown, span = whole_only, None
    elif span is None:
        st.caption("Nothing picked: the whole response is explained.")
    else:
        left_out = f" ({', '.join(whole_only)}: whole response only, not shown)" if whole_only else ""
        st.caption(f"Explaining characters {span[0]}-{span[1]}: “{ca.response[span[0] : span[1]]}”{left_out}")
common.set_qp(span_unit=span_unit)
if span_unit == "response":
    st.query_params.pop("pick", None)

common.set_provenance(
    model=name,
    weights_sha256=ca.provenance.get("weights_sha256"),
    context=ca.context if source_kind == "text" else None,
    documents=file_names or None,
    query=ca.query,
    messages=ca.messages if messages_arg is not None else None,
    response=ca.response,
    span=list(span) if span else None,
    methods=ca.methods,
    options={
        k: ca.options.get(k)
        for k in ("sources", "target", "n_ablations", "seed", "seeds", "mask_seed", "keep_prob", "alpha")
    },
)

# ---------------------------------------------------------------- the shaded context and the top sources
st.subheader("Sources")
c1, c2, c3 = st.columns([2, 1, 1], vertical_alignment="bottom")
view = c1.selectbox(
    "Shade by",
    shown,
    index=common.qp_index("view", shown),
    format_func=lambda m: f"{m} ({CONTEXT_METHODS[m].paper})",
    key="view",
)
k_top = c2.number_input("Top sources", 1, ca.n_sources, min(5, ca.n_sources), key="top_k")
fold = c3.toggle(
    "Fold low-score stretches",
    value=common.qp("fold", "1") == "1",
    key="fold",
    help="Runs of 3 or more sources under 10% of the largest |score| fold into one line; click it to open.",
)
common.set_qp(view=view, fold=int(fold))
with common.errors_as_messages():
    scores = cv.span_scores(ca, view, span)
    info = CONTEXT_METHODS[view]
    units = f" Scores are {info.units}." if info.units else ""
    st.caption(f"{info.title}: {cv.colour_key(scores)}.{units} Hover a source for its score.")
    if info.caveat:
        with st.expander(f"What to know about {view}"):
            st.markdown(info.caveat)
    shaded = cv.context_view_html(ca, scores, collapse=fold)
    with st.container(height=cv.context_box_height(shaded, MAIN_WIDTH_PX), border=True, key="shading_box"):
        st.html(shaded)
    top = cv.top_table(ca, view, int(k_top), span)
    st.dataframe(top.style.format({"score": "{:.4g}"}), hide_index=True, width="stretch", key="top_table")
    common.export_table(top, f"top_sources_{view}", caption=f"Top sources by {view}")
    with st.expander("Export the shaded context (figure for a paper, HTML)", icon=":material/download:"):
        width_name = st.selectbox("Width", list(WIDTHS), key="ctx_fig_width")
        fig = plots.context_figure(ca, view, span, width_px=WIDTHS[width_name])
        # at the chosen paper width, not stretched: a preview of the exported size (and no re-layout on resize)
        st.plotly_chart(fig, key="chart_context_figure", width="content", config={"displaylogo": False})
        common.export_figure(fig, f"context_{view}", data=top, key="context_fig", presets=False)
        prov = common._provenance()
        st.download_button(
            "Shaded context (HTML page)",
            data=lambda: cv.context_html_bytes(ca, view, span, prov),
            file_name=f"context_{view}.html",
            mime="text/html",
            key="context_html",
            on_click="ignore",
        )

    if len(shown) >= 2:
        st.subheader("Two methods side by side")
        a, b = st.columns(2)
        left = a.selectbox("Left", shown, index=common.qp_index("left", shown), key="left")
        right_default = common.qp("right") if common.qp("right") in shown else shown[1]
        right = b.selectbox("Right", shown, index=shown.index(right_default), key="right")
        common.set_qp(left=left, right=right)
        for col, m in ((a, left), (b, right)):
            with col:
                s = cv.span_scores(ca, m, span)
                st.caption(cv.colour_key(s))
                shaded = cv.context_view_html(ca, s, collapse=fold)
                with st.container(height=cv.context_box_height(shaded, MAIN_WIDTH_PX // 2, 400), border=True):
                    st.html(shaded)
                st.dataframe(
                    cv.top_table(ca, m, int(k_top), span).style.format({"score": "{:.4g}"}),
                    hide_index=True,
                    width="stretch",
                    key=f"side_{'l' if col is a else 'r'}",
                )
        if left != right:
            st.caption(f"Spearman ρ between their source scores: {cv.rank_agreement(ca, [left, right], span):.2f}")
        both = cv.side_by_side(ca, [left, right] if left != right else [left], int(k_top), span)
        common.export_table(both, "top_sources_side_by_side", caption=f"Top sources: {left} and {right}")

# ---------------------------------------------------------------- check by ablation
st.subheader("Check by ablation")
st.caption(
    "Remove the chosen method's top-k sources from the context, measure log P(response) again (the top-k "
    "drop: higher means the sources mattered) and regenerate the answer without them."
)
c1, c2, c3 = st.columns([2, 1, 1], vertical_alignment="bottom")
amethod = c1.selectbox("Method", shown, index=common.qp_index("amethod", shown), key="amethod")
max_k = max(1, ca.n_sources - 1)
k = c2.number_input("k", 1, max_k, common.qp_int("k", min(3, max_k), 1, max_k), key="abl_k")
common.set_qp(amethod=amethod, k=int(k))
checks = st.session_state.setdefault("_ctx_checks", {})
ckey = (key, amethod, int(k), span)
if c3.button("Remove and regenerate", key="ablate", type="primary"):
    with common.errors_as_messages():
        bar, report = _bar("Regenerating…")
        checks.clear()
        checks[ckey] = ca.ablate(model, amethod, int(k), span, progress=report)
        bar.empty()
chk = checks.get(ckey)
if chk is not None:
    m1, m2, m3 = st.columns(3)
    m1.metric("log P(response), full context", f"{chk.log_prob_before:.3f}")
    m2.metric(f"without the top {chk.k}", f"{chk.log_prob_after:.3f}")
    m3.metric(f"top-{chk.k} drop", f"{chk.drop:.3f}")
    st.markdown("**Removed:** " + " · ".join(f"#{i} “{t}”" for i, t in zip(chk.removed, chk.removed_texts)))
    st.markdown(f"**Answer without them:** {chk.response_after or '*(empty)*'}")
    if chk.changed:
        st.success("The answer changed without these sources.", icon=":material/swap_horiz:")
    else:
        st.info("The answer is the same without these sources.")

with st.expander("Evaluate every method on this example (top-k drop, LDS)", icon=":material/fact_check:"):
    n_eval = st.number_input("Held-out ablations", 2, lim.max_ablations, min(32, lim.max_ablations), key="eval_n")
    if st.button("Evaluate", key="evaluate"):
        with common.errors_as_messages(), st.spinner(f"{int(n_eval)} held-out ablations…"):
            ca.evaluate(model, k=(1, 3, 5), n_ablations=int(n_eval), span=span, progress=False)
    if ca.evaluation:
        ev = ca.evaluation["table"]
        st.dataframe(ev.style.format(precision=3), hide_index=True, width="stretch", key="evaluation")
        st.caption("Higher is better in every column. " + " ".join(ca.evaluation.get("notes", [])))
        common.export_table(ev, "context_evaluation", caption="Faithfulness of each method on one example")

# ---------------------------------------------------------------- the whole result, and the command
chat = ca.messages is not None and ca.options["prompt"].get("format") == "messages"
downloads = [  # label, data, file name, mime, key, help
    (
        "Download this attribution (.npz)",
        lambda: context_attribution_bytes(ca),
        "context_attribution.npz",
        "application/octet-stream",
        "download_ctx_npz",
        "Reopen it on the Saved explanation page or with ctxmix.load_context_attribution, without the model.",
    ),
    (
        "Download this attribution (.json)",
        lambda: context_attribution_json(ca),
        "context_attribution.json",
        "application/json",
        "download_ctx_json",
        "The same contents as the .npz as JSON (floats exact); reopens the same ways.",
    ),
]
if chat:
    downloads.append(
        (
            "Download the conversation (messages.json)",
            lambda: messages_json(ca),
            "messages.json",
            "application/json",
            "download_ctx_messages",
            "The messages sent, as `ctxmix cite --messages messages.json` reads them.",
        )
    )
for label, data, file_name, mime, dkey, tip in downloads:
    st.download_button(label, data=data, file_name=file_name, mime=mime, key=dkey, on_click="ignore", help=tip)
command = reproduce_command(ca, name, file_names or None, max_new_tokens=int(n_new), tokenizer=model.tokenizer)
note = "messages.json: the conversation's download above" if chat else "context.txt: the pasted context"
common.reproduce(command + ("" if file_names and not chat else f"  # {note}"))
