"""`attribute_context`: which sources of a context (or of a conversation's messages) made a causal language
model say this (docs/context.md), and its result, `ContextAttribution`.

    ca = ctxmix.attribute_context(model, context, "What is the code?", methods=["logit", "contextcite"])
    ca = ctxmix.attribute_context(model, messages=[{"role": "user", "content": "..."}, ...])
    ca.top("contextcite", 3)          # [(source index, score, text), ...]
    ca.scores_for("logit", span=(0, 12))  # a span of the response: no new pass
    ca.save("ca.npz"); ctxmix.load_context_attribution("ca.npz")

Over 500 lines because the result (spans, views, files) and the one call that fills it are read together.
The prompt, the sources and the response are described in `ctxmix.methods.context.prompt` and
`ctxmix.methods.context.sources`; the methods in `ctxmix.methods.context.ablation` (contextcite,
leave_one_out) and `ctxmix.methods.context.onepass` (logit, alti_logit, attention), `ctxmix.methods.context.grad`
(grad_x_input), `ctxmix.methods.context.keymask` (key_mask_grad, key_mask_ig), and in the registry's
context-attribution group (`ctxmix.methods.registry.CONTEXT_METHODS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ctxmix.engine.models import Model
from ctxmix.errors import BadInput
from ctxmix.methods.context.sources import BUCKETS, QUERY, SEPARATOR, TEMPLATE
from ctxmix.methods.memory import check_memory

if TYPE_CHECKING:
    import pandas as pd

ABLATION_METHODS = ("contextcite", "leave_one_out")
DEFAULT_METHODS = ("logit", "contextcite")


def check_span(span, length: int) -> tuple[int, int]:
    """A character span (start, end) of a response of `length` characters, checked: whole numbers with
    0 <= start < end <= length (the command line checks a given response's span before loading a model)."""
    ok = isinstance(span, (tuple, list)) and len(span) == 2
    ok = ok and all(not isinstance(x, bool) and isinstance(x, (int, np.integer)) for x in span)
    if not ok:
        raise BadInput(f"span must be a pair of whole numbers (start, end) in the response's characters, got {span!r}")
    s, e = int(span[0]), int(span[1])
    if not 0 <= s < e <= length:
        raise BadInput(
            f"span ({s}, {e}) is outside the response's {length} characters (need 0 <= start < end <= len(response))"
        )
    return s, e


@dataclass
class ContextAttribution:
    """What `attribute_context` found. Shapes: d sources, P prompt tokens, T response tokens.

    context (the context string; documents joined), query, sources (d str), source_spans (d (start,
    end) in context), source_tokens (d lists of prompt positions), prompt_ids (P,), labels (P,): each
    prompt token's source or bucket (-1 template, -2 query, -3 separators), response (str),
    response_ids (T,), response_offsets (T, 2) each response token's characters in `response`;
    scores[m] (d,) for the whole response; per_token[m] (T, P + T) the one-pass methods' contributions
    of every position to each response token's target ((1, P + T) for key_mask_grad and key_mask_ig: the whole
    response's per-key derivatives, so a sub-span is refused), terms[m] {name: (T,)} (those two: (1,)) what no
    position gets,
    targets[m] (T,) the explained quantity per token; ablations[m] {"masks": (m, d) bool (True = kept),
    "logit_probs": (m, T)} behind each ablation method; intercepts[m] the surrogate's bias;
    cost[m] {"forward", "backward", "seconds"}; options (everything that changes a number); provenance;
    evaluation: what `evaluate` measured last (empty until then); messages: the messages sent (the
    conversation given, or the one user message of the context/query form); source_messages (d,): the
    message each source is in. A conversation's `context` is its transcript ("role: content" per message,
    blank lines between), which `source_spans` index."""

    model_name: str
    context: str
    query: str | None
    sources: list[str]
    source_spans: list[tuple[int, int]]
    source_tokens: list[list[int]]
    prompt_ids: list[int]
    labels: np.ndarray
    response: str
    response_ids: list[int]
    response_offsets: np.ndarray
    methods: list[str]
    scores: dict[str, np.ndarray] = field(default_factory=dict)
    per_token: dict[str, np.ndarray] = field(default_factory=dict)
    terms: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    targets: dict[str, np.ndarray] = field(default_factory=dict)
    ablations: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    intercepts: dict[str, float] = field(default_factory=dict)
    cost: dict[str, dict] = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    evaluation: dict = field(default_factory=dict)
    messages: list[dict] | None = None
    source_messages: list[int] = field(default_factory=list)

    # ------------------------------------------------------------ spans

    @property
    def n_sources(self) -> int:
        return len(self.sources)

    def token_range(self, span=None) -> tuple[int, int]:
        """The response tokens (a, b) that a character span (start, end) of `response` touches
        (every token overlapping it); None: the whole response."""
        T = len(self.response_ids)
        if span is None:
            return 0, T
        s, e = check_span(span, len(self.response))
        off = self.response_offsets
        hit = np.nonzero((off[:, 1] > s) & (off[:, 0] < e))[0]
        if not len(hit):
            raise BadInput(f"span ({s}, {e}) holds no response token (only spacing?)")
        return int(hit[0]), int(hit[-1]) + 1

    def scores_for(self, method: str, span=None) -> np.ndarray:
        """(d,) scores of `method` for a character span (start, end) of the response, or (n, d), one row per
        span, for a list of n spans [(start, end), ...]; from the stored per-token contributions or
        ablations (no model pass): one-pass methods sum (logit) or average (attention) their per-token
        source scores over the span's tokens; contextcite refits its LASSO on the span's aggregated
        logit-probabilities (T = the span's tokens); leave_one_out takes the span's log-probability drops."""
        if isinstance(span, (list, tuple)) and span and all(isinstance(sp, (list, tuple)) for sp in span):
            self._check_method(method)
            return np.stack([self.scores_for(method, sp) for sp in span]).reshape(len(span), self.n_sources)
        self._check_method(method)
        a, b = self.token_range(span)
        if method in self.per_token:
            from ctxmix.methods.context.keymask import check_whole_response

            check_whole_response(method, a, b, len(self.response_ids))
            from ctxmix.methods.context.at2 import SPAN_AGGREGATION as AT2_AGGREGATION
            from ctxmix.methods.context.onepass import SPAN_AGGREGATION

            M = self.per_token[method][a:b]
            per_source = np.stack([M[:, toks].sum(1) for toks in self.source_tokens], 1)  # (b - a, d)
            agg = {**SPAN_AGGREGATION, **AT2_AGGREGATION}[method]
            return per_source.mean(0) if agg == "mean" else per_source.sum(0)
        if method == "contextcite":
            from ctxmix.methods.context.ablation import contextcite_scores

            w, _ = contextcite_scores(
                self.ablations[method], a, b, bool(self.options.get("compat")), self.options["alpha"]
            )
            return w
        from ctxmix.methods.context.ablation import leave_one_out_scores

        return leave_one_out_scores(self.ablations[method], a, b)

    def buckets(self, method: str, span=None) -> dict[str, float]:
        """A one-pass method's span total split into sources and what belongs to no source: "sources"
        (their sum), "template", "query", "separators", "response" (positions of the response: the
        explained rows' own tokens and the response before them), and each unattributed term; they
        sum to "target", the span's summed target (logit: summed log-probability or logit)."""
        self._check_method(method)
        if method not in self.per_token:
            raise BadInput(f"{method} is an ablation method: it has no per-position contributions to bucket")
        a, b = self.token_range(span)
        from ctxmix.methods.context.keymask import check_whole_response

        check_whole_response(method, a, b, len(self.response_ids))
        M = self.per_token[method][a:b].sum(0)  # (P + T,)
        P = len(self.prompt_ids)
        out = {"sources": float(M[:P][self.labels >= 0].sum())}
        for code, name in BUCKETS.items():
            out[name] = float(M[:P][self.labels == code].sum())
        out["response"] = float(M[P:].sum())
        for k, v in self.terms.get(method, {}).items():
            out[k] = float(np.asarray(v)[a:b].sum())
        out["target"] = float(self.targets[method][a:b].sum())
        return out

    def top(self, method: str, k: int = 5, span=None) -> list[tuple[int, float, str]]:
        """The k highest-scoring sources: (index, score, text), best first (ties: the earlier source)."""
        s = self.scores[method] if span is None else self.scores_for(method, span)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise BadInput(f"k must be a positive whole number, got {k!r}")
        order = np.argsort(-s, kind="stable")[:k]
        return [(int(i), float(s[i]), self.sources[i]) for i in order]

    def _check_method(self, method: str) -> None:
        if method not in self.methods:
            raise BadInput(f"{method!r} was not computed; this attribution has {', '.join(self.methods)}")

    # ------------------------------------------------------------ views

    def to_frame(self) -> pd.DataFrame:
        """One row per (method, source): method, source, start, end, text, score, rank (1 = highest)."""
        import pandas as pd

        rows = []
        for m in self.methods:
            s = self.scores[m]
            ranks = np.empty(len(s), dtype=int)
            ranks[np.argsort(-s, kind="stable")] = np.arange(1, len(s) + 1)
            for i, (text, (a, b)) in enumerate(zip(self.sources, self.source_spans)):
                rows.append(
                    {
                        "method": m,
                        "source": i,
                        "start": a,
                        "end": b,
                        "text": text,
                        "score": float(s[i]),
                        "rank": int(ranks[i]),
                    }
                )
        return pd.DataFrame(rows, columns=["method", "source", "start", "end", "text", "score", "rank"])

    def __repr__(self) -> str:
        return (
            f"ContextAttribution({self.model_name}, {self.n_sources} sources, "
            f"{len(self.response_ids)} response tokens, methods {', '.join(self.methods)}: {self.response[:60]!r})"
        )

    # ------------------------------------------------------------ evaluation, notebook, file

    def evaluate(
        self,
        model: Model,
        k=(1, 3, 5),
        n_ablations: int = 100,
        gold=None,
        *,
        span=None,
        seed: int | None = None,
        batch_size: int = 8,
        progress: bool = True,
    ) -> pd.DataFrame:
        """How faithful each method's scores are on this example, measured with `model` (the one that made
        this attribution: checked): one row per method, columns `topk_drop@k` for each k (log P(response |
        context) - log P(response | context without the method's top-k sources), natural log, higher is
        better; NaN for k >= the number of sources), `lds` (Spearman, over `n_ablations` held-out random
        ablations drawn with seeds disjoint from ContextCite's, of the summed scores of the kept sources
        against the measured logit P(response); NaN where a method scores every source the same) and,
        with `gold` (a source index or a list of them), `recall@1` and `recall@3`. span: a character span
        of the response (the statement evaluated; None: all of it). Kept in `.evaluation` (the table, the
        held-out masks and logit-probabilities, options, cost, notes) and saved with the attribution;
        `to_frame()` stays per source. See `ctxmix.benchmark.context.metrics`."""
        from ctxmix.benchmark.context.metrics import evaluate_context

        return evaluate_context(self, model, k, n_ablations, gold, span, seed, batch_size, progress)

    def ablate(
        self, model: Model, method: str, k: int = 3, span=None, max_new_tokens: int | None = None, progress=None
    ):
        """Check `method` by ablation: remove its k highest-scoring sources (for a character span of the
        response, or all of it), measure log P(response) with and without them (the top-k drop) and
        regenerate the answer without them. Returns a `ctxmix.methods.context.check.AblationCheck`."""
        from ctxmix.methods.context.check import ablate

        return ablate(self, model, method, k, span, max_new_tokens, progress)

    def show(self, method: str | None = None, span=None):
        """The context with each source shaded by `method`'s score (every method when None): blue raises
        the response, red lowers it, white 0, scaled by the method's largest |score|; hover for the value.
        Returns an HTML string a notebook renders (`ctxmix.export.context.html`)."""
        from ctxmix.export.context.html import context_html

        return context_html(self, method, span)

    def _repr_html_(self) -> str:
        from ctxmix.export.context.html import summary_html

        return summary_html(self)

    def save(self, path) -> Path:
        """One compressed .npz (metadata as a JSON string entry, opened with allow_pickle=False), or, for a
        .json name, the same contents as JSON (`ctxmix.export.context.json_file`, floats exact); the evaluation
        included once computed; reopen either with `ctxmix.load_context_attribution`
        (`ctxmix.export.context.npz_file`)."""
        if str(path).lower().endswith(".json"):
            from ctxmix.export.context.json_file import save_context_attribution_json

            return save_context_attribution_json(self, path)
        from ctxmix.export.context.npz_file import save_context_attribution

        return save_context_attribution(self, path)


# ---------------------------------------------------------------- the call


def _check_call(model: Model, methods, max_new_tokens, n_ablations, batch_size, keep_prob, query) -> list[str]:
    from ctxmix.engine.generate import MAX_NEW_TOKENS
    from ctxmix.methods.context.ablation import check_n_ablations
    from ctxmix.methods.registry import CONTEXT_METHODS

    if model.kind != "causal_lm" or model.spec.encoder_decoder:
        raise BadInput(
            f"attribute_context explains what a causal language model generates from its context; {model.name} is "
            f"a {model.kind.replace('_', ' ')} (encoder-only and encoder-decoder models are not supported)"
        )
    names = [methods] if isinstance(methods, str) else list(methods or [])
    if not names:
        raise BadInput("choose at least one method")
    bad = [m for m in names if m not in CONTEXT_METHODS]
    if bad:
        raise BadInput(
            f"unknown context-attribution method(s) {', '.join(map(repr, bad))}; valid: {', '.join(CONTEXT_METHODS)}"
        )
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or not 1 <= max_new_tokens <= MAX_NEW_TOKENS
    ):
        raise BadInput(f"max_new_tokens must be a whole number from 1 to {MAX_NEW_TOKENS}, got {max_new_tokens!r}")
    check_n_ablations(n_ablations)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise BadInput(f"batch_size must be a positive whole number, got {batch_size!r}")
    if isinstance(keep_prob, bool) or not isinstance(keep_prob, (int, float)) or not 0 < keep_prob < 1:
        raise BadInput(f"keep_prob must be between 0 and 1 (exclusive), got {keep_prob!r}")
    if query is not None and (not isinstance(query, str) or not query.strip()):
        raise BadInput("query must be a non-empty string, or None (the context alone is the prompt)")
    return list(dict.fromkeys(names))


def attribute_context(
    model: Model,
    context=None,
    query: str | None = None,
    *,
    messages: list[dict] | None = None,
    chat_template: str | None = None,
    response: str | None = None,
    sources="sentence",
    methods=DEFAULT_METHODS,
    template: str | None = None,
    max_new_tokens: int = 64,
    n_ablations: int = 32,
    seed: int = 0,
    keep_prob: float = 0.5,
    alpha: float = 0.01,
    target: str = "log_prob",
    compat: bool = False,
    batch_size: int = 8,
    progress: bool = True,
    at2_features: str | None = None,
    at2_weights=None,
    seeds: str | None = None,
    key_mask_levels=4,
    share_trace: bool = True,
) -> ContextAttribution:
    """Score each source of `context` by how much it made `model` produce the response.

    context: one string, or a list of documents (joined with a blank line). sources: "sentence"
    (pysbd, offline; per line), "paragraph" (blank-line separated), "document" (each document of a
    list), or explicit character spans [(start, end), ...] of the context string (in order, not
    overlapping). The template's tokens, the query and the response are never sources.

    query: the question, placed as "Context: {context}\\n\\nQuery: {query}" (ContextCite's format) in
    one user message. query=None: the context alone is the message, so the caller places any instruction
    ("Summarize the article.") or the text to continue in the context itself.

    messages: a conversation instead of context/query: [{"role": "system" | "user" | "assistant" | "tool",
    "content": str, ...}, ...], the last one the turn being answered (other keys go to the template).
    Every message's content is split into sources by `sources` ("document": each message one source)
    except those marked "attribute": False; `.source_messages` says which message each source is in.

    The prompt is the chat template (the tokenizer's, or chat_template=, a Jinja string; template=None or
    "chat") rendered with the generation prompt and tokenised as one string: the ids of
    `tokenizer.apply_chat_template(messages, add_generation_prompt=True)`. template="plain" or a tokenizer
    without a template: the tokenizer's BOS and the message (several: "Role: content" blocks, then
    "Assistant:"). Text in a message or the response that spells a special token is kept as text (there
    only the ids differ from the template's). Ablations remove sources from their messages and render the
    template again (`ctxmix.methods.context.prompt`).

    response: the text to attribute; None generates it greedily (ctxmix.generate, max_new_tokens), the
    final end-of-sequence token dropped.

    methods (the registry's CONTEXT_METHODS): "logit" and "alti_logit" (one traced pass, ALTI-Logit
    streamed one layer at a time; target="log_prob" (T1) explains each token's log-probability exactly,
    "logit_prob" (T2) its log p - log(1 - p), "logit" its raw logit), "attention" (AT2's raw-attention
    baseline), "grad_x_input" (gradient x input of each token's log-probability: one forward and T
    backward passes, `ctxmix.methods.context.grad`), "key_mask_grad" (d log P(response) / d a_s, a_s a gate on
    the attention weights of source s's keys in every layer and head: attribution patching of AT2's
    attention-masking ablation, one forward and one backward pass, whole response only), "key_mask_ig" (the
    same gradient averaged over `key_mask_levels` gate levels, a count K (midpoints of K steps of (0, 1), default
    4) or a list of levels in (0, 1]: a Riemann integrated gradient from every source masked to none;
    `ctxmix.methods.context.keymask`), "contextcite" (n_ablations random ablations, seed,
    keep_prob, LASSO alpha), and
    "leave_one_out" (one pass per source, at most MAX_LOO_SOURCES), "at2_exact" (AT2's learned per-head
    estimator on ctxmix's exact per-head features, one traced pass, `ctxmix.methods.context.at2`: at2_features
    "logit", "attn", "norm", "alti", "combined" (all four, trained weights only) or "attn+norm+logit" (the three
    of one forward pass, trained weights only), None (default): the weights' own default kind, the one-pass kind
    that scores best on their validation table (`at2.default_kind`; logit for both shipped files;
    uniform weights: logit); at2_weights None
    (the weights shipped for the model, or uniform ones where their held-out table scores the trained ones
    lower, with a warning), a file from `ctxmix at2-train`, or "untrained" (uniform)).

    compat=True reproduces the official ContextCite package (context/query form only): the prompt, the
    generated response and every ablation are built from the official rebuild of the context, which keeps
    only the sources and the text between them (text before the first source and after the last is never
    shown to the model, even unablated); the response is re-tokenised with the prompt text, its
    end-of-sequence token kept; the target is aggregated in float32 (it overflows on confident spans);
    context or query text that spells a special token is refused. The sources themselves still come from
    ctxmix's splitter (pysbd; the official package uses nltk's punkt, whose data cannot be installed
    offline): pass explicit spans to match its sources. On a GPU the official package runs its forward
    passes under CUDA autocast (float16) while ctxmix runs the model in its own dtype, so GPU numbers differ
    by that rounding; on a CPU they agree to float32 rounding. The default differs where docs/context.md
    says ("Choices where the papers leave room"; `ctxmix.methods.context.ablation`).

    seeds: how ContextCite's masks (and `evaluate`'s held-out masks) are seeded: "example" (the default;
    compat=True: "official"): mask i from RandomState(s + i) with s = `example_seed(seed, context, query)`,
    a stable hash of the texts, so every example gets its own masks; "official": s = seed for every example
    (the official package's seed + i). The first seed is kept in `options["mask_seed"]`.

    share_trace: True (the default) lets the one-pass methods share one traced pass (alti_logit's full trace when
    it is asked for); False gives the methods that read only the response rows their own rows pass, so each
    method's cost["seconds"] is what it costs alone (the benchmark's time columns). Scores are the same.

    progress: True (terminal bars), False, or a callable progress(stage, done, total) called as the
    response is generated (stage "generate", done = new tokens) and as ablation passes finish ("contextcite",
    "leave_one_out"): the dashboard's bars.

    Raises BadInput, before any model pass, for an empty context, a single source, an empty or
    end-of-sequence-only response, a prompt + response over the model's window, bad spans, an encoder or
    encoder-decoder model, and n_ablations outside 2..MAX_ABLATIONS.
    """

    from ctxmix.methods.context.ablation import (
        LASSO_ALPHA,
        SEED_SCHEMES,
        example_seed,
        leave_one_out_scores,
        run_contextcite,
        run_leave_one_out,
        store_contextcite,
    )
    from ctxmix.methods.context.onepass import TARGETS, run_one_pass
    from ctxmix.methods.context.prompt import build_prompt, make_response
    from ctxmix.methods.explanation import provenance

    methods = _check_call(model, methods, max_new_tokens, n_ablations, batch_size, keep_prob, query)
    if chat_template is not None and not isinstance(chat_template, str):
        raise BadInput("chat_template must be a Jinja template string (or None: the tokenizer's)")
    if target not in TARGETS:
        raise BadInput(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    if not isinstance(compat, bool):
        raise BadInput(f"compat must be True or False, got {compat!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise BadInput(f"seed must be a non-negative whole number, got {seed!r}")
    seeds = seeds or ("official" if compat else "example")
    if seeds not in SEED_SCHEMES:
        raise BadInput(f"seeds must be one of {', '.join(SEED_SCHEMES)} (or None), got {seeds!r}")
    if seeds == "official" and seed + n_ablations > 2**32:  # ablation i draws with RandomState(seed + i): < 2^32
        raise BadInput(f"seed must be at most 2^32 - n_ablations = {2**32 - n_ablations}, got {seed}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise BadInput(f"alpha must be a positive number, got {alpha!r}")
    from ctxmix.methods.context.keymask import check_levels

    check_levels(key_mask_levels)
    if "at2_exact" in methods:  # the weights checked before any pass
        from ctxmix.methods.context.at2 import resolve_weights

        at2_w, at2_info = resolve_weights(model, at2_features, at2_weights)
        at2_features = at2_info["kind"]  # None resolved: the weights' default kind
    from ctxmix.methods.prediction import check_logit_model

    for m in ("logit", "alti_logit"):
        if m in methods:
            check_logit_model(model, m)
    src, builder = build_prompt(
        model,
        context,
        query,
        messages=messages,
        sources=sources,
        template=template,
        chat_template=chat_template,
        compat=compat,
    )
    first_seed = example_seed(seed, src.text, query) if seeds == "example" else seed
    prompt = builder.encode(src)
    window = model.max_length
    if len(prompt.ids) >= window:
        raise BadInput(
            f"the prompt has {len(prompt.ids)} tokens, over {model.name}'s window of {window} positions: "
            "shorten the context"
        )
    # refused before any forward pass (the generation's included) when the estimate exceeds what the devices give
    n_response = max_new_tokens if response is None else len(model.tokenizer(response)["input_ids"])
    from ctxmix.methods.context.at2 import estimator_kinds

    # F-alti reads a full trace: counted as alti_logit's (a bound)
    full_at2 = "at2_exact" in methods and "alti" in estimator_kinds(str(at2_features))
    check_memory(
        model,
        len(prompt.ids) + n_response,
        call="attribute_context",
        methods=[("alti_logit" if m == "at2_exact" and full_at2 else m) for m in methods],
        n_response=n_response,
        n_ablations=n_ablations,
        batch_size=batch_size,
        n_sources=len(src.spans),
    )
    resp = make_response(model, builder, src, prompt, response, max_new_tokens, progress)
    P, T = len(prompt.ids), len(resp.ids)
    if P + T > window:
        raise BadInput(
            f"prompt ({P} tokens) + response ({T} tokens) exceed {model.name}'s window of {window} positions: "
            "shorten the context or the response"
        )
    rule = "contextcite" if compat else "ctxmix"
    if compat and src.rebuild(np.ones(len(src), bool), rule) != src.text:
        note = (
            "compat: the official rebuild drops the text before the first source and after the last, even with "
            "every source kept: the prompt and the response are built without it"
        )
    else:
        note = None
    if builder.ids(src.rebuild(np.ones(len(src), bool), rule)) != prompt.ids:
        raise RuntimeError("rebuilding the context with every source kept does not give the prompt's ids")
    chat = messages is not None
    source_tokens = [np.nonzero(prompt.labels == i)[0].tolist() for i in range(len(src))]
    empty = [i for i, t in enumerate(source_tokens) if not t]
    ca = ContextAttribution(
        model_name=model.name,
        context=src.text,
        query=None if chat else query,
        sources=src.texts,
        source_spans=list(src.spans),
        source_tokens=source_tokens,
        prompt_ids=list(prompt.ids),
        labels=prompt.labels,
        response=resp.text,
        response_ids=list(resp.ids),
        response_offsets=resp.offsets,
        methods=methods,
        options={
            "sources": src.kind if isinstance(sources, str) else "spans",
            "splitter": src.splitter,
            "prompt": builder.info,
            "response": resp.how,
            "eos_dropped": resp.eos_dropped,
            "max_new_tokens": max_new_tokens if resp.how == "generated" else None,
            "generation_seconds": resp.generation_seconds,
            "target": target,
            "n_ablations": n_ablations,
            "seed": seed,
            "seeds": seeds,
            "mask_seed": first_seed,
            "keep_prob": keep_prob,
            "alpha": float(alpha),
            "lasso_alpha_default": LASSO_ALPHA,
            "compat": compat,
            "ablation": "remove",
            "rebuild": "contextcite" if compat else "ctxmix",
            "model_dtype": str(model.dtype).replace("torch.", ""),
            "batch_size": batch_size,
            "key_mask_levels": key_mask_levels,  # key_mask_ig's, also when it is added later (extend_attribution)
        },
        provenance=provenance(model),
        messages=src.messages if chat else builder.turns(builder.full(src)),
        source_messages=list(src.message_of) if chat else [0] * len(src),
    )
    if note:
        ca.warnings.append(note)
    if empty:
        ca.warnings.append(f"source(s) {empty} have no token of their own (merged into a neighbour's token)")
    one_pass = [m for m in methods if m not in ABLATION_METHODS and m != "at2_exact"]
    if one_pass:
        gated = [j for toks in source_tokens for j in toks]
        res_all = run_one_pass(
            model,
            one_pass,
            prompt.ids + resp.ids,
            P,
            target,
            gated=gated,
            levels=key_mask_levels,
            share_trace=share_trace,
        )
        for m, res in res_all.items():
            ca.per_token[m] = res["per_token"]
            ca.terms[m] = res["terms"]
            ca.targets[m] = res["target"]
            ca.cost[m] = res["cost"]
            ca.scores[m] = ca.scores_for(m)
            if "reconstruction_error" in res:  # the rebuilt layers against the model's states (max abs)
                ca.options.setdefault("reconstruction_error", {})[m] = res["reconstruction_error"]
    if "at2_exact" in methods:
        from ctxmix.methods.context.at2 import run_at2, store_at2

        store_at2(ca, run_at2(model, prompt.ids + resp.ids, P, at2_features, at2_w, target), at2_info)
    if "contextcite" in methods:
        ab = run_contextcite(
            model, builder, src, resp.ids, n_ablations, first_seed, keep_prob, batch_size, compat, progress
        )
        store_contextcite(ca, ab, compat, alpha)
        y = ab["logit_probs"]
        if np.ptp(y.sum(1)) == 0:
            ca.warnings.append("contextcite: the target is the same under every ablation; the scores are all zero")
    if "leave_one_out" in methods:
        ab = run_leave_one_out(model, builder, src, resp.ids, batch_size, compat, progress)
        ca.ablations["leave_one_out"] = {"masks": ab["masks"], "logit_probs": ab["logit_probs"]}
        ca.scores["leave_one_out"] = leave_one_out_scores(ab, 0, T)
        ca.cost["leave_one_out"] = ab["cost"]
    return ca


__all__ = ["ContextAttribution", "attribute_context", "TEMPLATE", "QUERY", "SEPARATOR"]
