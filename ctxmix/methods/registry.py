"""The one registry of methods: what each is, its paper, how it is aggregated, its caveats.

Both the mixing maps and the saliency methods read it; neither imports the other; the context methods' records
(`ContextMethod`) say how a call runs each. Over 500 lines because every method's record is in this one file.
"""

from __future__ import annotations

from dataclasses import dataclass

from ctxmix.engine.scopes import POST_LN_SCOPES, PRE_LN_SCOPES, SANDWICH_SCOPES, scope_names
from ctxmix.errors import BadInput


@dataclass(frozen=True)
class MethodInfo:
    """What a method is, which paper it comes from, and how it is aggregated."""

    name: str
    group: str  # "attention", "norm", "value_zeroing", "scope", "saliency", "prediction"
    title: str
    paper: str
    rollout_identity: bool = False
    rollout_normalise: bool = False
    rows_sum_to_one: bool = False
    doc: str = ""
    per_head: str = ""  # how the per-head maps relate to the layer map ("" = no per-head form)
    caveat: str = ""  # what a reader must know before trusting results (`ctxmix methods`, the Context page)
    units: str = ""  # what a score's size means where it is not self-evident (the page shows it beside the scores)


ROLLOUT_CAVEAT = (
    "On causal models the aggregated maps collapse onto the first token (the attention sink that "
    "rows attend to, compounded layer by layer): read the per-layer maps there."
)


MIXING_METHODS: dict[str, MethodInfo] = {
    m.name: m
    for m in [
        MethodInfo(
            "attention",
            "attention",
            "Attention (head mean)",
            "Abnar & Zuidema 2020",
            rows_sum_to_one=True,
            doc="Mean over heads of the attention probabilities; rolled out as is (GlobEnc's 'W').",
            per_head="head h: alpha^h; the layer map is the heads' mean",
        ),
        MethodInfo(
            "attention_rollout",
            "attention",
            "Attention rollout",
            "Abnar & Zuidema 2020",
            rows_sum_to_one=True,
            doc="Per layer 0.5*A + 0.5*I with A the head-mean attention, rolled out by matrix product.",
            caveat=ROLLOUT_CAVEAT,
        ),
        MethodInfo(
            "norm",
            "norm",
            "N (norm)",
            "Kobayashi et al. 2020; GlobEnc",
            doc="||sum_h alpha^h_ij f^h(x_j)||, b_V spread through alpha (GlobEnc code); rolled out unnormalised, "
            "no identity.",
            per_head="head h: ||alpha^h_ij f^h(x_j)|| (through LNa's share in Gemma 2/3); the heads' vectors "
            "sum to the layer's vector, whose norm is the layer map (so the layer map is at most "
            "the sum of the head maps)",
        ),
        MethodInfo(
            "norm_res",
            "norm",
            "N_Res",
            "Kobayashi et al. 2021; GlobEnc",
            doc="N plus the residual x_i on the diagonal; rolled out unnormalised, no identity (GlobEnc code).",
        ),
        MethodInfo(
            "norm_res_ln",
            "norm",
            "N_ResLN",
            "Kobayashi et al. 2021; GlobEnc",
            doc="N_Res through the LN1 decomposition (std of the real pre-LN1 vector); rolled out unnormalised.",
        ),
        MethodInfo(
            "globenc",
            "norm",
            "GlobEnc (N_Enc)",
            "Modarressi et al. 2022",
            doc="N_ResLN through LN2 with the std of the real pre-LN2 vector, FF ignored; rolled out without identity "
            "and without row normalisation, as the GlobEnc code does.",
        ),
        MethodInfo(
            "alti",
            "norm",
            "ALTI",
            "Ferrando et al. 2022",
            rows_sum_to_one=True,
            doc="max(0, |y_i|_1 - |y_i - T_i(x_j)|_1) normalised over j (exact L1), rolled out without identity. "
            "On an encoder-decoder with decoder_text: ALTI+ (Ferrando et al., EMNLP 2022), maps over "
            "[source; target] (ctxmix.methods.alti_plus).",
        ),
        MethodInfo(
            "value_zeroing",
            "value_zeroing",
            "Value zeroing",
            "Mohebbi et al. 2023",
            rows_sum_to_one=True,
            doc="Cosine distance (float64) between y_i and y_i with v_j zeroed in all heads, row-normalised, "
            "rolled out without identity; layers scored independently.",
        ),
    ]
}


for _s in dict.fromkeys(POST_LN_SCOPES + PRE_LN_SCOPES + SANDWICH_SCOPES):
    MIXING_METHODS[_s] = MethodInfo(
        _s,
        "scope",
        f"Scope {_s}",
        "Kobayashi et al. 2024",
        rollout_normalise=True,
        doc="FF paper scope (within one layer, exact, b_V in the bias); aggregated here by row-normalised rollout, "
        "which the paper does not do.",
    )


def check_methods(methods, position: str | None = None) -> list[str]:
    """Validate method names; unknown ones get a message listing the valid names."""
    if isinstance(methods, str):
        methods = [methods]
    methods = list(dict.fromkeys(methods))
    if not methods:
        raise BadInput("choose at least one method")
    valid = list(MIXING_METHODS) + list(SALIENCY_METHODS) + list(PREDICTION_METHODS)
    bad = [m for m in methods if m not in valid]
    context_only = [m for m in bad if m in CONTEXT_METHODS]
    if context_only:
        raise BadInput(
            f"{', '.join(context_only)}: a context-attribution method (which sources of a context made a model "
            f"say its response); use ctxmix.attribute_context(model, context, query, methods=[...]), not explain"
        )
    if bad:
        raise BadInput(f"unknown method(s) {', '.join(map(repr, bad))}; valid methods: {', '.join(valid)}")
    if position is not None:
        wrong = [
            m
            for m in methods
            if MIXING_METHODS.get(m, MethodInfo("", "", "", "")).group == "scope" and m not in scope_names(position)
        ]
        if wrong:
            raise BadInput(
                f"scope(s) {', '.join(wrong)} do not exist in a {position}-LN model; "
                f"its scopes are {', '.join(scope_names(position))}"
            )
    return methods


PER_HEAD_METHODS = ("attention", "norm")


SALIENCY_METHODS: dict[str, MethodInfo] = {
    m.name: m
    for m in [
        MethodInfo(
            "grad",
            "saliency",
            "Gradient (L2)",
            "Bastings et al. 2022; ALTI",
            doc="||d p_target / d e_i||_2 over the word embedding e_i (or layer 0's input: grad_at).",
        ),
        MethodInfo(
            "grad_x_input",
            "saliency",
            "Gradient x input (L2)",
            "GlobEnc Eq. 17",
            doc="||(d p_target / d e_i) * e_i||_2, GlobEnc's reference saliency.",
        ),
        MethodInfo(
            "integrated_gradients",
            "saliency",
            "Integrated gradients",
            "Sundararajan et al. 2017 (captum)",
            doc="captum IntegratedGradients (Gauss-Legendre) from a [PAD], [MASK] or [UNK] baseline "
            "(special tokens kept) or all-zero word embeddings; per token |sum over dimensions| "
            "as in the ALTI code.",
        ),
        MethodInfo(
            "blank_out",
            "saliency",
            "Blank-out",
            "Abnar & Zuidema 2020; ALTI",
            doc="p_target(x) - p_target(x with token i replaced by [UNK] or [MASK]); signed drop.",
        ),
        MethodInfo(
            "cat",
            "saliency",
            "CAT",
            "Qiang et al. 2022",
            doc="sum over layers of <d logit / d h^l_i, h^l_i>, h^l the input of layer l; signed. "
            "As in the AttCAT code, the explanation pass masks [CLS]/[SEP] as keys.",
        ),
        MethodInfo(
            "attcat",
            "saliency",
            "AttCAT",
            "Qiang et al. 2022",
            doc="CAT weighted per layer by the attention token i receives (mean over heads and queries); signed.",
        ),
    ]
}


# How the mixing builds a prediction: signed contributions to a logit (or a logit difference), with
# their own dispatch in `explain` (never rolled out like the mixing maps, never a map row as saliency)
PREDICTION_METHODS: dict[str, MethodInfo] = {
    m.name: m
    for m in [
        MethodInfo(
            "logit",
            "prediction",
            "Logit",
            "Ferrando et al. 2023",
            doc="Causal LMs: the target's logit (or target - foil) at the explained position split over layers "
            "and source positions: sum_h alpha^h_tj <W_O^h(W_V^h LN1(x_j) + b_V^h), r>, r the unembedding row "
            "through the final norm with its real scale frozen (exact). layer_saliency (L, n), per head "
            "(L, H, n); saliency = the layers' sum plus the predicted position's own embedding (the official "
            "code; embedding='term' keeps it apart); logit_terms: b_O and MLP per layer, final-norm beta, "
            "unembedding bias. Layer-l position j is read as input token j (token identity preserved).",
            caveat="Causal LMs only (pre-LN, parallel and sandwich layers); MLP updates are not attributed to "
            "tokens (logit_terms).",
        ),
        MethodInfo(
            "alti_logit",
            "prediction",
            "ALTI-Logit",
            "Ferrando et al. 2023",
            doc="Causal LMs: Logit's layer-l row traced back to the input tokens through the ALTI rollout of "
            "layers 1..l-1 (R^0 = I): layer_saliency[l] = D^l R^{l-1}; the same total as Logit (rows of R sum "
            "to one). Sign kept (rank by signed score, as the paper's MRR does).",
            caveat="Causal LMs only (pre-LN, parallel and sandwich layers); MLP updates are not attributed to "
            "tokens (logit_terms).",
        ),
        MethodInfo(
            "decompx",
            "prediction",
            "DecompX",
            "Modarressi et al. 2023",
            doc="Every input token's vector carried through every layer (biases spread by AbsDot, the FF by "
            "f(u)/u, norms with the real scale) and through the head: logit_contributions (C, n) whose rows "
            "sum to the logits; saliency = the target class's row (minus the foil's), signed. global_maps = "
            "the norms of token k's part of hidden state i after each layer (not rolled out). Options "
            "(explain(..., decompx={...})): bias 'absdot' (default) or 'none' (remainder in logit_terms); "
            "ff 'zero_origin' (the paper's GeLU_ZO, default) or 'tangent' (GeLU_LA); head True or False "
            "(then the saliency is the norm of the explained row's parts). Post-LN is the paper's; pre-LN, "
            "RMSNorm, gated, parallel and sandwich layers follow the same rules (ctxmix.methods.decompx).",
            caveat="Heads with a rule: BERT pooler + classifier, RoBERTa / XLM-R / CamemBERT / ELECTRA "
            "classification heads, DistilBERT, a causal LM's unembedding; decompx={'head': False} elsewhere. "
            "Memory n^2 d per layer.",
        ),
        MethodInfo(
            "attention_flow",
            "flow",
            "Attention flow",
            "Abnar & Zuidema 2020",
            rows_sum_to_one=True,
            doc="Max-flow through the layered attention graph (capacities 0.5*A + 0.5*I of the head-mean "
            "attention): one max-flow per output node and input token (scipy's Dinic on capacities scaled "
            "by 2^30; not one flow to a super-sink), rows normalised over input tokens, as the official code. "
            "global_maps (L, n, n) are already aggregated (no rollout); by default only the explained "
            "position's row is computed (flow_rows='all' for every row; the others are NaN), as the cost "
            "grows as about n^3 per row (ctxmix.methods.flow).",
            caveat="Rows saturate in deep models (flat, tied scores); refused where one row would take over a "
            "minute (about 460 tokens for 6 layers, 300 for 12).",
        ),
    ]
}


METHODS: dict[str, MethodInfo] = {**MIXING_METHODS, **SALIENCY_METHODS, **PREDICTION_METHODS}  # every method


COSTS = ("one_pass", "gradient", "ablation")  # a context method's cost class
SPAN_RULES = ("sum", "mean")  # how a per-token method's rows make a span's score (else a rescoring function)


@dataclass(frozen=True)
class ContextMethod:
    """One context-attribution method (`ctxmix.attribute_context`): what it is and how a call runs it. Every list
    of context methods (the page's, the command line's, the memory estimate's, the exporters') reads these records;
    adding a method is one module (its run function), one record and its test (docs/extending.md).

    cost: "one_pass" (forward passes only, no ablation), "gradient" (backward passes), "ablation" (one pass per
    ablated text: the dashboard runs these behind a button). reads: what its scores are computed from, in words.
    run: "module:function", called as run(job, names) -> {name: result} (`ctxmix.methods.context.job`) once per
    call with every asked method naming the same function (logit, alti_logit and attention share one trace).
    span: "sum" or "mean" of the stored per-token rows over a span's tokens, or "module:function" rescoring a
    span (ca, a, b) -> (d,) from what the method stored (ContextCite refits its LASSO). whole_response: it stores
    one row for the whole response, so a sub-span is refused. memory: its phases in `ctxmix.methods.memory`
    ("rows", "full_trace", "backward", "ablations", "ablations_whole"). passes: its cost in passes, for people.
    options: the call options (`ContextAttribution.options` keys) its scores depend on: the page recomputes it when
    one changes. prepare: "module:function", prepare(model, name, options) -> dict, run before any pass (checks; AT2's
    weights), options holding what the call gives before its prompt is built (at2_features, at2_weights and the
    resolved "prompt_form"; the rest is in `job.options` at run time), its result handed to `run` in
    `job.prepared[name]` ("memory" there overrides the record's). needs_weights: its scores come from trained weights
    (shipped per model, or the user's): never a default for a model without them."""

    name: str
    title: str
    paper: str
    cost: str
    reads: str
    run: str
    span: str = "sum"
    whole_response: bool = False
    memory: tuple[str, ...] = ("rows",)
    passes: str = "1 forward"
    options: tuple[str, ...] = ()
    prepare: str = ""
    needs_weights: bool = False
    doc: str = ""
    caveat: str = ""  # what a reader must know before trusting results (`ctxmix methods`, the Context page)
    units: str = ""  # what a score's size means where it is not self-evident (the page shows it beside the scores)
    group: str = "context"

    def __post_init__(self) -> None:
        if self.cost not in COSTS:
            raise ValueError(f"{self.name}: cost must be one of {COSTS}, got {self.cost!r}")
        if self.span not in SPAN_RULES and ":" not in self.span:
            raise ValueError(f"{self.name}: span must be one of {SPAN_RULES} or 'module:function', got {self.span!r}")

    @property
    def per_token(self) -> bool:
        """Whether it stores per-token rows (a span sums or averages them: no new pass)."""
        return self.span in SPAN_RULES


ONEPASS = "ctxmix.methods.context.onepass:run"  # logit, alti_logit and attention: one traced pass, shared
KEYMASK = "ctxmix.methods.context.keymask:run"
LOGIT_CHECK = "ctxmix.methods.context.onepass:prepare"  # a head to read the logit through


def context_methods(cost: str | None = None, *, per_token: bool | None = None) -> list[str]:
    """The context methods' names, in the registry's order, of one cost class and/or storing per-token rows."""
    return [
        m
        for m, r in CONTEXT_METHODS.items()
        if (cost is None or r.cost == cost) and (per_token is None or r.per_token == per_token)
    ]


def register_context_method(record: ContextMethod) -> None:
    """Add a context method (a plugin, or a test's) to the registry: the page, the command line, the memory
    estimate and `attribute_context` see it at once. Refuses a name already taken."""
    if record.name in CONTEXT_METHODS:
        raise ValueError(f"a context method named {record.name!r} is registered already")
    CONTEXT_METHODS[record.name] = record


# Context attribution (`ctxmix.attribute_context`, docs/context.md): which sources of a
# context made a causal LM generate its response. Its own group, never merged into METHODS: `logit` and
# `attention` here are the one-pass source scores built from explain's methods of the same names.
CONTEXT_METHODS: dict[str, ContextMethod] = {
    m.name: m
    for m in [
        ContextMethod(
            "logit",
            "Logit (per source)",
            "Ferrando et al. 2023; ctxmix",
            cost="one_pass",
            reads="the response rows of one traced pass",
            run=ONEPASS,
            span="sum",
            memory=("rows",),
            passes="1 forward",
            options=("target",),
            prepare=LOGIT_CHECK,
            doc="One traced pass; each response token explained at the row before it, towards its log-probability "
            "(T1: centred logit minus the entropy; target='logit' for the raw logit). A source's score is the sum of "
            "its tokens' contributions over the span's tokens; template, query, separators, response positions and "
            "the unattributed terms (biases, MLP, -H) are kept apart (ContextAttribution.buckets).",
            caveat="Cost: one forward pass (no backward). Context relayed through response positions stays on them "
            "(not traced back to the sources); MLPs are not attributed. Causal LMs, pre-LN/parallel/sandwich.",
        ),
        ContextMethod(
            "alti_logit",
            "ALTI-Logit (per source)",
            "Ferrando, Gállego, Tsiamas, Costa-jussà, ACL 2023; ctxmix",
            cost="one_pass",
            reads="every row of one traced pass (a full trace: every layer's ALTI map)",
            run=ONEPASS,
            span="sum",
            memory=("full_trace",),
            passes="1 forward + (L - 1) ALTI layer maps",
            options=("target",),
            prepare=LOGIT_CHECK,
            doc="Logit's per-layer contributions traced back to the input tokens through the ALTI maps of the "
            "layers below (explain's alti_logit at each response row, towards the same target: T1 by default), "
            "evaluated top-down one layer at a time (streamed on long contexts); context relayed through "
            "response positions reaches the sources.",
            caveat="Cost: one forward pass plus (L - 1) ALTI layer maps over every row (O((L-1) n^2 d), the same "
            "maps explain's alti needs: the response rows save only the top layer's); memory one layer and one "
            "chunk of ALTI rows. MLPs are not attributed; mass reaching a position whose ALTI row is all clipped "
            "is 'untraced'. Causal LMs, pre-LN/parallel/sandwich.",
        ),
        ContextMethod(
            "grad_x_input",
            "Gradient x input (per source)",
            "Shrikumar et al. 2017; Denil et al. 2014 (signed)",
            cost="gradient",
            reads="its own forward pass and T backward passes",
            run="ctxmix.methods.context.grad:run",
            span="sum",
            memory=("backward",),
            passes="1 forward + T backward",
            doc="<d log p(r_t) / d e_j, e_j> for each response token and word embedding e_j, signed, summed over "
            "a source's tokens and the span's tokens (stored per token: a span needs no new pass). A source's score "
            "is the first-order effect of scaling its embeddings towards zero; not a decomposition of log p.",
            caveat="Cost: one forward and T backward passes (T response tokens); where eager attention's n x n "
            "probabilities would not fit the memory budget, the pass runs with SDPA attention (the model's attention "
            "implementation is switched for it). "
            "First-order only: saturated tokens get small gradients whatever their role.",
        ),
        ContextMethod(
            "key_mask_grad",
            "Key-mask gradient (per source)",
            "attribution patching of AT2's attention masking (Cohen-Wang, Chuang, Madry 2025); ctxmix",
            cost="gradient",
            reads="its own gated forward pass and one backward pass",
            run=KEYMASK,
            span="sum",
            whole_response=True,
            memory=("backward",),
            passes="1 forward + 1 backward",
            doc="d log P(response) / d a_s at a = 1, a_s a gate multiplying the attention weights of source s's "
            "keys in every layer and head (a_s = 0: no query attends s, AT2's masking ablation): -score is the "
            "first-order prediction of log P(response | s masked) - log P(response).",
            caveat="Cost: one forward and one backward pass (SDPA with the bias in an extra key column where eager's "
            "n x n probabilities would not fit the memory budget). Whole response only: a sub-span needs a new call "
            "with that span as the response. Masks attention to the source, where ContextCite and the metrics "
            "remove its text; first-order only (held-out LDS on smollm2 0.47 against ContextCite-32's 0.90: "
            "docs/context.md, onepass-validation.json).",
        ),
        ContextMethod(
            "key_mask_ig",
            "Key-mask integrated gradient (per source)",
            "integrated gradients (Sundararajan et al. 2017) on AT2's attention masking; ctxmix",
            cost="gradient",
            reads="its own gated passes at K gate levels",
            run=KEYMASK,
            span="sum",
            whole_response=True,
            memory=("backward",),
            passes="K + 1 forward + K backward",
            options=("key_mask_levels",),
            doc="The key-mask gradient averaged over K gate levels (midpoints of K steps of (0, 1), every source's "
            "gate at the level; key_mask_levels=, default 4): a Riemann integrated gradient from every source "
            "masked to none, whose sum over sources approaches log P(all kept) - log P(all sources masked).",
            caveat="Cost: K forward and K backward passes, plus one forward pass with every source masked. Whole "
            "response only. Masks attention to the sources, where ContextCite and the metrics remove their text. "
            "Held-out LDS on smollm2 0.76 (K = 4) against ContextCite-32's 0.90 and logit's 0.81 (docs/context.md, "
            "onepass-validation.json).",
        ),
        ContextMethod(
            "attention",
            "Attention (AT2 baseline)",
            "Cohen-Wang, Chuang, Madry 2025 (AT2, untrained)",
            cost="one_pass",
            reads="the response rows of one traced pass",
            run=ONEPASS,
            span="mean",
            memory=("rows",),
            passes="1 forward",
            doc="Attention of the row predicting each response token, averaged over layers and heads, summed over a "
            "source's tokens and averaged over the span's tokens (AT2's features with uniform weights).",
            caveat="Cost: one forward pass. Shares, not signed amounts; attention sinks (BOS) take much of the mass.",
        ),
        ContextMethod(
            "contextcite",
            "ContextCite",
            "Cohen-Wang, Shah, Georgiev, Madry, NeurIPS 2024",
            cost="ablation",
            reads="the response re-scored on texts with random halves of the sources removed",
            run="ctxmix.methods.context.ablation:run_contextcite_job",
            span="ctxmix.methods.context.ablation:contextcite_span",
            memory=("ablations",),
            passes="n_ablations forward",
            options=("n_ablations", "mask_seed", "keep_prob", "alpha", "compat"),
            doc="n_ablations random halves of the sources removed from the text (official masks), the response's "
            "logit P re-scored each time, a LASSO (alpha 0.01, standardised masks, target / T) fitted; spans refit "
            "on the stored per-token logit-probabilities. compat=True reproduces the official package.",
            caveat="Cost: n_ablations forward passes (no backward), about half the context each. Default differs "
            "from the official package in the aggregation's overflow, the text kept around the sources, and the "
            "response ids (no end-of-sequence): ctxmix.methods.context.ablation.",
        ),
        ContextMethod(
            "leave_one_out",
            "Leave-one-out",
            "e.g. AttriBoT (Liu, Kandpal, Raffel, ICLR 2025) as the reference",
            cost="ablation",
            reads="the response re-scored on the text without each source in turn",
            run="ctxmix.methods.context.ablation:run_leave_one_out_job",
            span="ctxmix.methods.context.ablation:leave_one_out_span",
            memory=("ablations_whole",),
            passes="d + 1 forward",
            options=("compat",),
            doc="One pass with every source and one per removed source: score = log P(span | context) - "
            "log P(span | context without the source).",
            caveat="Cost: d + 1 near-full-length forward passes; refused above 256 sources. Misses sources that "
            "matter only together (redundant facts).",
        ),
        ContextMethod(
            "at2_exact",
            "AT2 on exact per-head features",
            "Cohen-Wang, Chuang, Madry 2025 (AT2); ctxmix exact features",
            cost="one_pass",
            reads="the response rows of one traced pass (its alti kinds: every row)",
            run="ctxmix.methods.context.at2:run",
            span="mean",
            memory=("rows",),
            passes="1 forward",
            options=("target", "at2"),
            prepare="ctxmix.methods.context.at2:prepare",
            needs_weights=True,
            doc="AT2's learned linear estimator, w . f(unit, source) over the L x H heads, with ctxmix's exact "
            "per-head contributions as features: 'logit' (each head's logit contribution towards the "
            "response token's log-probability), 'attention' (AT2's raw attention), 'norm' (attention x value-vector "
            "norm), 'alti' (the routes' per-head ALTI proximity), 'combined' (all four kinds, 4 L H trained weights: a "
            "learned combination of exact features) or 'attention+norm+logit' (the three kinds of one forward pass, "
            "3 L H trained weights); summed over a source's tokens, averaged over the span's "
            "tokens. Weights trained on removal ablations of Wikipedia texts (`ctxmix at2-train`), shipped for "
            "smollm2 and gemma3 (gemma3's in the base-model form it is asked in by default: the plain template, the "
            "'Answer:' cue, the first-sentence cut), found by the model's fingerprint. "
            "Default kind: per weights file, the one-pass kind that scores best on its validation table of the four "
            "test tasks' shapes ('logit' for both shipped files).",
            caveat="Cost: one forward pass plus the per-head features of the response rows ('alti' and 'combined': "
            "a full trace, about alti_logit's cost). Scores are scale-free (L1-normalised weights); weights are per "
            "model and per prompt form: others need `ctxmix at2-train` (or at2={'weights': 'untrained'}). Trained on "
            "500 Wikipedia examples, every kind beats its uniform weights on the held-out validation table (smollm2: "
            "F-logit 0.83 -> 0.87, F-attn 0.70 -> 0.87; gemma3: F-logit 0.68 -> 0.73, F-attn 0.61 -> 0.76). On "
            "the benchmark's test examples the gain is smaller than on validation, and on gemma3 trained F-logit "
            "fell below the `logit` method (docs/context.md).",
            units="scale-free (the learned head weights are L1-normalised, so a score's size carries no unit): "
            "compare sources by rank",
        ),
    ]
}
