"""Write the generated pages of the documentation site (run by `make docs` before `mkdocs build`).

- docs/methods/<name>.md: one page per method, from the method registry (what `ctxmix methods`
  prints): its formula and choices, its paper, how it is aggregated, its caveats;
- docs/methods/context/<name>.md: one page per context-attribution method (`attribute_context`), from the
  registry's context group and CONTEXT_DOCS below (formula, options, snippet);
- docs/families.md: the families table (what `ctxmix models` prints);
- docs/analyses/*.md: one page per analysis, each with a figure the code makes on the embedded
  MiniLM and a few Wikipedia sentences (SVG through kaleido when Chromium is there, else HTML).

Offline: the model and the texts ship in PyPI packages.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))

import ctxmix  # noqa: E402
import ctxmix.methods.decompx  # noqa: E402,F401
import ctxmix.methods.flow  # noqa: E402,F401
import ctxmix.methods.prediction  # noqa: E402,F401
from ctxmix.engine.arch import families_table  # noqa: E402
from ctxmix.export import plots  # noqa: E402
from ctxmix.methods.registry import (  # noqa: E402
    CONTEXT_METHODS,
    MIXING_METHODS,
    PREDICTION_METHODS,
    SALIENCY_METHODS,
)

PREDICTION_MODULES = {
    "logit": "ctxmix.methods.prediction",
    "alti_logit": "ctxmix.methods.prediction",
    "decompx": "ctxmix.methods.decompx",
    "attention_flow": "ctxmix.methods.flow",
}


def method_pages() -> list[str]:
    out = DOCS / "methods"
    out.mkdir(exist_ok=True)
    names = []
    for name, info in {**MIXING_METHODS, **SALIENCY_METHODS, **PREDICTION_METHODS}.items():
        if info.group == "scope":
            continue
        lines = [
            f"# {info.title} (`{name}`)",
            "",
            f"**Paper:** {info.paper}  ",
            f"**Group:** {info.group}  ",
            f"**Rows sum to one:** {'yes' if info.rows_sum_to_one else 'no'}",
            "",
            "## What ctxmix computes",
            "",
            info.doc,
            "",
        ]
        if name in MIXING_METHODS:
            agg = (
                "0.5·M + 0.5·I per layer, then the product of the layers"
                if info.rollout_identity
                else ("each layer's rows normalised, then " if info.rollout_normalise else "")
                + "the product of the layers' maps (R^l = M^l R^{l-1})"
            )
            lines += ["## Aggregation", "", agg + ".", ""]
        if info.per_head:
            lines += ["## Per head", "", f"`explain(..., per_head=True)`: {info.per_head}.", ""]
        if name in PREDICTION_METHODS:
            lines += [
                "## Formulas and choices",
                "",
                f"From `{PREDICTION_MODULES[name]}` (the options the paper and its code leave open are named there):",
                "",
                "```text",
                (sys.modules[PREDICTION_MODULES[name]].__doc__ or "").strip(),
                "```",
                "",
            ]
        if info.caveat:
            lines += ["## Caveat", "", info.caveat, ""]
        use = (
            f'ex = ctxmix.explain(model, text, ["{name}"], foil=" have")  # a causal LM; target: the predicted token'
            if name in ("logit", "alti_logit")
            else f'ex = ctxmix.explain(model, text, ["{name}"])'
        )
        lines += ["## Use", "", "```python", use, "```", ""]
        (out / f"{name}.md").write_text("\n".join(lines))
        names.append(name)
    scopes = [n for n, i in MIXING_METHODS.items() if i.group == "scope"]
    info = MIXING_METHODS[scopes[0]]
    (out / "scopes.md").write_text(
        "\n".join(
            [
                "# Scopes of the FF paper",
                "",
                f"**Paper:** {info.paper}",
                "",
                info.doc,
                "",
                "Scope names by layer shape (`ctxmix.methods.registry.scope_names`):",
                "",
                *[
                    f"- **{shape}**: {', '.join(ctxmix.methods.registry.scope_names(shape))}"
                    for shape in ("post", "pre", "parallel", "sandwich")
                ],
                "",
                "```python",
                "maps = ctxmix.scope_maps(model, text)  # {scope: (L, n, n)}",
                "```",
                "",
            ]
        )
    )
    import ctxmix.methods.alti_plus as ap

    (out / "alti_plus.md").write_text(
        "# ALTI+ for encoder-decoders (`alti` with `decoder_text`)\n\n"
        '```python\nex = ctxmix.explain(model, source, ["alti"], decoder_text=target)\n'
        "ctxmix.source_contribution(ex)  # (decoder layers, T)\n```\n\n"
        "```text\n" + (ap.__doc__ or "").strip() + "\n```\n"
    )
    import ctxmix.methods.routes as rt

    (out / "routes.md").write_text(
        "# Information flow routes (`ctxmix.routes`)\n\n"
        "```python\nr = ctxmix.routes(model, text, position=None, threshold=0.04)  # Routes\n"
        "r.edges, r.nodes  # DataFrames; r.node_detail('A3_7'), r.head_importance()\n"
        "r.figure(); r.to_networkx(); r.to_json()\n```\n\n"
        "```text\n" + (rt.__doc__ or "").strip() + "\n```\n\n"
        "On a generated continuation (`ctxmix.generate`), the routes of generated token t start at position t - 1, "
        "the row that predicted it:\n\n"
        "```python\ng = ctxmix.generate(model, prompt, max_new_tokens=10)\n"
        "t = g.generated_positions[-1]\nr = ctxmix.routes(model, input_ids=g.input_ids[: t + 1], position=t - 1)\n```\n"
    )
    return names


# Per context method: (paper, formula, options, extra caveats). The registry gives the title, the short doc and
# the cost; docs/context.md the shared parts (prompt, sources, targets, evaluation). A method without an entry
# here gets no generated page (tests/test_context_bench.py checks every context method has one).
CONTEXT_DOCS: dict[str, dict[str, str]] = {
    "contextcite": {
        "paper": "Benjamin Cohen-Wang, Harshay Shah, Kristian Georgiev, Aleksander Mądry, *ContextCite: Attributing "
        "Model Generation to Context*, NeurIPS 2024, arXiv 2409.00729; official code MadryLab/context-cite.",
        "formula": "Masks v_1..v_n ∈ {0,1}^d (1 = keep), mask i from `RandomState(seed + i)`, keep probability "
        "0.5. For each, the context is rebuilt from the kept sources, re-templated and re-tokenised, and the fixed "
        "response is scored: per-token logit-probabilities ℓ_t = log p_t − log(1 − p_t), aggregated to "
        "y_i = logit P(span) = log P − log(1 − P), log P = Σ_t log σ(ℓ_t). A LASSO (alpha 0.01) is fitted on the "
        "standardised masks to y / T; its weights, rescaled to the masks' scale and multiplied by T, are the "
        "scores (the intercept is `ca.intercepts['contextcite']`).",
        "options": "`n_ablations` (default 32; at least 2, at most the stated cap), `seed` (first mask's seed), "
        "`keep_prob` (0.5), `alpha` (0.01), `batch_size` (forward passes per batch), `compat=True` (the official "
        "package's choices exactly: float32 aggregation that overflows on a confident span, its rebuild rule, "
        "the response re-tokenised with its end-of-sequence token).",
        "caveats": "The surrogate is linear: interactions (two sources that matter only together) are "
        "averaged away. A sub-span of the response refits the LASSO on the stored per-token values "
        "(`scores_for(..., span=)`), no new pass. `ca.ablations['contextcite']` holds the masks and the "
        "per-token logit-probabilities, so anyone can refit with the official solver.",
        "snippet": 'ca = ctxmix.attribute_context(m, context, query, methods=["contextcite"], ablations={"n": 32})\n'
        'ca.top("contextcite", 3)\nca.scores_for("contextcite", span=(0, 20))  # refit on the span, no pass',
    },
    "leave_one_out": {
        "paper": "The classical reference (ContextCite's and AttriBoT's baseline: Fengyuan Liu, Nikhil Kandpal, "
        "Colin Raffel, *AttriBoT*, ICLR 2025, arXiv 2411.15102, makes it cheap).",
        "formula": "score_i = log P(span | context) − log P(span | context without source i), natural log, "
        "teacher-forced on the fixed response (d + 1 passes: every source, then each one removed, text removal "
        "as ContextCite's).",
        "options": "`batch_size`; refused above `ctxmix.methods.context.ablation.MAX_LOO_SOURCES` (256) sources.",
        "caveats": "Misses redundancy: a fact stated twice loses nothing when one copy goes. Cost grows with "
        "d × context length, so long contexts with many sentences are better served by `contextcite` or coarser "
        "sources (`sources='paragraph'`).",
        "snippet": 'ca = ctxmix.attribute_context(m, docs, query, sources="document", methods=["leave_one_out"])',
    },
    "logit": {
        "paper": "Javier Ferrando, Gerard I. Gállego, Ioannis Tsiamas, Marta R. Costa-jussà, *Explaining How "
        "Transformers Use Context to Build Predictions*, ACL 2023 (Logit); per-source scores: ctxmix.",
        "formula": "For response token r_t, explained at the row q_t that predicts it: each layer's attention "
        "update of that row split over the positions j it reads (heads summed), projected on the target's "
        "readout through the final norm frozen at its real scale: c_{t,j} = Σ_l ⟨r_w, Σ_h A^{l,h}_{q_t j} "
        "W_O^{l,h} v^{l,h}_j⟩ (plus the predicted position's embedding). score_s = Σ_{t ∈ span} Σ_{j ∈ s} c_{t,j}. "
        "Target (T1, default): log p = (z_r − Σ_v p_v z_v) − H(p), the centred logit split exactly, −H(p) "
        "unattributed; `target='logit_prob'` (T2) or `'logit'` (raw).",
        "options": "`target` ('log_prob', 'logit_prob', 'logit').",
        "caveats": "MLPs are not attributed; context relayed through earlier response positions stays on those "
        "positions (`ca.buckets('logit')['response']`). The sources plus the buckets add up to the span's summed "
        "target exactly.",
        "snippet": 'ca = ctxmix.attribute_context(m, context, query, methods=["logit"])\nca.buckets("logit")',
    },
    "alti_logit": {
        "paper": "Ferrando, Gállego, Tsiamas, Costa-jussà, ACL 2023 (ALTI-Logit); per-source scores: ctxmix.",
        "formula": "Logit's layer-l contributions D^l traced to the input tokens through ALTI's layer maps of the "
        "layers below: Σ_l D^l C^{l−1} ⋯ C^0, evaluated top-down as acc ← acc C^l + D^l; a source sums its "
        "tokens' entries over the span's tokens. Same targets as `logit`.",
        "options": "`target` ('log_prob', 'logit_prob', 'logit').",
        "caveats": "Needs every row of (L − 1) ALTI layer maps, O((L − 1) n² d): the costliest one-pass method. "
        "Mass reaching a position whose ALTI row is all clipped is `terms['untraced']`.",
        "snippet": 'ca = ctxmix.attribute_context(m, context, query, methods=["alti_logit"])',
    },
    "attention": {
        "paper": "Benjamin Cohen-Wang, Yung-Sung Chuang, Aleksander Mądry, *Learning to Attribute with "
        "Attention* (AT2), arXiv 2504.13752, 2025: its untrained (uniform-weight) baseline.",
        "formula": "score_s = mean_{t ∈ span} mean_{l, h} Σ_{j ∈ s} A^{l,h}_{q_t j}: the attention of the row "
        "predicting each response token, averaged over layers and heads, summed over the source's tokens.",
        "options": "none.",
        "caveats": "Shares, not signed effects; attention sinks (BOS) take much of the mass; no notion of what "
        "the attended values carry.",
        "snippet": 'ca = ctxmix.attribute_context(m, context, query, methods=["attention"])',
    },
    "grad_x_input": {
        "paper": "Misha Denil, Alban Demiraj, Nando de Freitas 2014; Avanti Shrikumar et al. 2017 (gradient × "
        "input); signed per-source form: ctxmix.",
        "formula": "score_s = Σ_{t ∈ span} Σ_{j ∈ s} ⟨∂ log p(r_t) / ∂e_j, e_j⟩, e_j the word embedding: the "
        "first-order effect of scaling the source's embeddings, d/dλ log P(span) at λ = 1.",
        "options": "none (the pass switches to SDPA attention where eager attention's n × n probabilities would "
        "not fit the memory budget).",
        "caveats": "First order only: saturated tokens get small gradients whatever their role; not a "
        "decomposition (`terms['first_order_gap']` closes the buckets). Cost: one forward and T backward passes.",
        "snippet": 'ca = ctxmix.attribute_context(m, context, query, methods=["grad_x_input"])\n'
        'ca.cost["grad_x_input"]  # forward 1, backward T, seconds, attention',
    },
    "key_mask_grad": {
        "paper": "Attribution patching (Neel Nanda 2023; Syed, Rager, Conmy 2023) of the attention-masking ablation "
        "of Benjamin Cohen-Wang, Yung-Sung Chuang, Aleksander Mądry, *Learning to Attribute with Attention* (AT2), "
        "arXiv 2504.13752, 2025; ctxmix.",
        "formula": "Gates a_s multiply the unnormalised attention weights exp(score) of source s's keys in every "
        "layer and head (an additive bias log a_s after any soft-cap, with the causal / window mask); a_s = 0 is "
        "AT2's masking ablation (no query attends s), a = 1 the model. score_s = ∂ log P(response) / ∂a_s at "
        "a = 1 = Σ_{j ∈ s} ∂ log P / ∂b_j, log P = Σ_t log p(r_t); −score_s is the first-order prediction of "
        "log P(response | s masked) − log P(response).",
        "options": "none (SDPA with the bias in an extra query/key column where eager attention's n × n "
        "probabilities would not fit the memory budget; soft-capped families stay eager).",
        "caveats": "The counterfactual masks attention to the source; ContextCite and the metrics remove its text "
        "and re-tokenise (positions move). Whole response only: `scores_for` on a sub-span refuses (per-token "
        "rows would take T backward passes; see Context attribution). The per-key derivatives sum to 0 over all "
        "positions (softmax shift), so `terms['first_order_gap']` = log P closes the buckets.",
        "snippet": 'ca = ctxmix.attribute_context(m, context, query, methods=["key_mask_grad"])\n'
        'ca.cost["key_mask_grad"]  # forward 1, backward 1, seconds, attention',
    },
    "key_mask_ig": {
        "paper": "Integrated gradients (Mukund Sundararajan, Ankur Taly, Qiqi Yan, ICML 2017) along AT2's "
        "attention-masking path (Cohen-Wang, Chuang, Mądry 2025); ctxmix.",
        "formula": "score_s = (1/K) Σ_k ∂ log P / ∂a_s at a = α_k·1 (every source's gate at α_k, template, query, "
        "separators and response never gated), α_k = (k − ½)/K: a K-point midpoint Riemann integrated gradient "
        "from every source masked (a = 0) to none (a = 1). Σ_s score_s → log P(all kept) − log P(all sources "
        "masked) as K grows.",
        "options": "`key_mask_levels`: K (default 4) or a list of levels in (0, 1].",
        "caveats": "K forward and K backward passes, plus one forward pass with every source masked "
        "(`terms['all_sources_masked']`; `terms['integration_error']` is the Riemann error). Whole response only. "
        "Masking, not removal (as key_mask_grad).",
        "snippet": 'ca = ctxmix.attribute_context(m, context, query, methods=["key_mask_ig"], key_mask_levels=8)\n'
        'ca.buckets("key_mask_ig")  # sources + all_sources_masked + integration_error = log P',
    },
    "at2_exact": {
        "paper": "Benjamin Cohen-Wang, Yung-Sung Chuang, Aleksander Mądry, *Learning to Attribute with "
        "Attention* (AT2), arXiv 2504.13752, 2025: its learned linear estimator; exact per-head features: ctxmix.",
        "formula": "score(U, s) = w · f(U, s), f(U, s)_{l,h} = mean_{t ∈ U} Σ_{j ∈ s} F^{l,h}(t, j), w ∈ R^{L·H}, no "
        "bias. F: `attention` A^{l,h}_{q_t j} (AT2's own), `norm` A ‖W_O^h(W_V^h n(x_j) + b_V^h)‖, `logit` "
        "A ⟨W_O^h(W_V^h n(x_j) + b_V^h), ρ_t⟩ (head h's share of the `logit` method), `alti` the per-head ALTI "
        "proximity (as routes). w trained as AT2: −Pearson over 32 removal ablations per example, Adam, cosine, "
        "L1-normalised.",
        "options": "`at2={'features': ...}` (None: the weights' default kind, the one-pass kind best on their "
        "validation table of the four test tasks' shapes, 'logit' for both shipped files and for uniform weights; "
        "'logit', 'attention', 'norm', "
        "'alti'; 'combined' and 'attention+norm+logit': trained weights only; files written before 2026-11-28 "
        "say 'attn'); `at2={'weights': ...}` (None: the weights shipped for the model, found by its weights' "
        "fingerprint, uniform where their held-out table scores the trained ones lower, with a warning; a file "
        "from `ctxmix at2-train --model M --out DIR`; 'untrained': uniform 1/(L·H)).",
        "caveats": "Scale-free scores (rank with them). Shipped weights exist for smollm2 and gemma3 (gemma3's in "
        "the base-model form it is asked in by default), each trained on 500 examples: on its validation split's "
        "held-out table each trained kind beats its uniform weights; the default kind is the best one-pass kind on "
        "the one-pass validation table of the four test tasks' shapes (docs: Context attribution).",
        "snippet": 'ca = ctxmix.attribute_context(m, context, query, methods=["at2_exact"])\n'
        'ca.options["at2"], ca.warnings  # which weights, and why',
    },
}


def context_method_pages() -> list[str]:
    """docs/methods/context/<name>.md for each context method with a CONTEXT_DOCS entry."""
    out = DOCS / "methods" / "context"
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for name, info in CONTEXT_METHODS.items():
        extra = CONTEXT_DOCS.get(name)
        if extra is None:
            continue
        token_level = name in {**MIXING_METHODS, **SALIENCY_METHODS, **PREDICTION_METHODS}
        there = "is the token-level method of the same name" if token_level else "is refused"
        lines = [
            f"# {info.title} (`{name}`, context attribution)",
            "",
            f"**Paper:** {extra['paper']}  ",
            "**Used by:** `ctxmix.attribute_context(..., methods=[...])` (not `explain`: there "
            f"`{name}` {there}). "
            "Shared parts (prompt, sources, targets, evaluation): [Context attribution](../../context.md).",
            "",
            "## What it computes",
            "",
            info.doc,
            "",
            extra["formula"],
            "",
            "## Cost and caveats",
            "",
            info.caveat,
            "",
            extra["caveats"],
            "",
            "## Options",
            "",
            extra["options"],
            "",
            "## Use",
            "",
            "```python",
            "import ctxmix",
            "",
            'm = ctxmix.load_model("smollm2")',
            'context = "The code for the staff entrance is 4817. The canteen opens at noon."',
            'query = "What is the code for the staff entrance?"',
            'docs = ["The code is 4817.", "The canteen opens at noon."]',
            extra["snippet"],
            "```",
            "",
            "Measured on your model: `ca.evaluate(m)` (top-k drop, LDS; `gold=` adds recall), and the shipped "
            "`configs/context.yaml` results on the dashboard's Benchmarks page.",
            "",
        ]
        (out / f"{name}.md").write_text("\n".join(lines))
        names.append(name)
    return names


def families_page() -> None:
    rows = families_table()
    lines = [
        "# Model families",
        "",
        "Every family is one entry of `ctxmix.engine.arch.FAMILIES`, proven exact by the reconstruction "
        "tests on a tiny random model of its real Hugging Face class.",
        "",
        "| family | model types | norms | norm | FF | attention | scopes | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                str(r[k]).replace("|", "/")
                for k in ("family", "model types", "norms", "norm", "FF", "attention", "scopes", "note")
            )
            + " |"
        )
    (DOCS / "families.md").write_text("\n".join(lines) + "\n")


def _figure(fig, stem: str) -> str:
    """Markdown that shows the figure: an SVG image, or a link to an HTML file without Chromium."""
    img = DOCS / "analyses" / "img"
    img.mkdir(parents=True, exist_ok=True)
    if plots.static_export_available():
        (img / f"{stem}.svg").write_bytes(plots.figure_bytes(fig, "svg"))
        return f"![{stem}](img/{stem}.svg)"
    (img / f"{stem}.html").write_bytes(plots.figure_bytes(fig, "html"))
    return f"[The figure (interactive HTML)](img/{stem}.html)"


def analysis_pages() -> None:
    m = ctxmix.load_model("minilm", device="cpu")
    texts = ctxmix.data.corpus("wiki", limit=8)
    report = ctxmix.corpus_report(m, texts, change=True, amp=False, norms=True, outliers=True, progress=False)
    change = report["change"]
    comps = [c for c in ctxmix.analyses.corpus.comparisons(m) if not c.startswith("dyn:")]
    pages = {
        "contextualization_change": (
            "Contextualization change",
            "How much each component changes the token-to-token map, per layer: 1 - Spearman rho between "
            "the maps of two scopes (Kobayashi et al. 2024, §5). Computed here on 8 Wikipedia sentences.",
            "ctxmix.contextualization_change(model, texts)",
            plots.change_bars(change, comps),
        ),
        "ff_outliers": (
            "FF outlier dimensions against the next norm's gamma",
            "Per dimension, the mean |FF output| against the gamma of the norm that next reads it "
            "(Kobayashi et al. 2024, §6); layer 1 shown.",
            "ctxmix.ff_outliers(model, texts)",
            plots.outlier_figure(report["outliers"][report["outliers"].layer == 1], title="Layer 1"),
        ),
        "ff_residual_norms": (
            "FF output against the vector RES2 bypasses",
            "The norm of the FF output against the norm of the vector the residual carries around it.",
            "ctxmix.ff_residual_norms(model, texts)",
            plots.res2_figure(report["residual_norms"]),
        ),
    }
    from ctxmix.analyses.corpus import ff_amp_matrix, ff_amp_scopes

    before, after = ff_amp_scopes(m)
    text = "The keys to the cabinet are on the table ."
    sc = ctxmix.scope_maps(m, text)
    tokens = m.tokens(m.encode(text)[0])
    layer = 5
    pages["ff_amp"] = (
        "FF amplification",
        "Which token pairs the FF block amplifies: the column-normalised map after the FF minus the one "
        f"before it ({after} - {before}; Kobayashi et al. 2024, §5). `ctxmix.ff_amp` ranks the pairs over a "
        f"corpus; the figure shows layer {layer} of one sentence.",
        "ctxmix.ff_amp(model, texts, top_k=20)  # the most amplified token pairs, per layer",
        plots.map_heatmap(
            tokens,
            ff_amp_matrix(sc[before][layer - 1], sc[after][layer - 1], "column"),
            f"FF-amp, layer {layer}",
            colorbar="amplification",
        ),
    )
    nli = ctxmix.explain(m, ("A man is eating .", "Someone eats food ."), ["alti", "globenc"])
    pages["cross_segment_mixing"] = (
        "Sentence pairs: cross-segment mixing",
        "For a sentence pair, the share of each text's context that comes from the other text, per layer.",
        'ex = ctxmix.explain(model, ("A man is eating .", "Someone eats food ."), ["alti"])\n'
        "ctxmix.cross_segment_mixing(ex)",
        plots.cross_mixing_figure(ctxmix.cross_segment_mixing(nli)),
    )
    out = DOCS / "analyses"
    for stem, (title, what, code, fig) in pages.items():
        (out / f"{stem}.md").write_text(
            f"# {title}\n\n{what}\n\n```python\n{code}\n```\n\n{_figure(fig, stem)}\n\n"
            "*Figure made by `docs/gen_pages.py` with the code above on the embedded MiniLM.*\n"
        )


if __name__ == "__main__":
    method_pages()
    context_method_pages()
    families_page()
    if "--no-figures" not in sys.argv:
        analysis_pages()
    print(f"wrote the generated pages under {DOCS}")
