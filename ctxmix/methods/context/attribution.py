"""`attribute_context`: which sources of a context (or of a conversation's messages) made a causal language
model say this (docs/context.md), and its result, `ContextAttribution`.

    ca = ctxmix.attribute_context(model, context, "What is the code?", methods=["logit", "contextcite"],
                                  ablations={"n": 64})
    ca = ctxmix.attribute_context(model, messages=[{"role": "user", "content": "..."}, ...])
    ca.top("contextcite", 3)          # [(source index, score, text), ...]
    ca.scores_for("logit", span=(0, 12))  # a span of the response: no new pass
    ca.save("ca.npz"); ctxmix.load_context_attribution("ca.npz")

Over 500 lines because the result (spans, views, files) and the one call that fills it are read together.
The prompt, the sources and the response are described in `ctxmix.methods.context.prompt` and
`ctxmix.methods.context.sources`; each method in its record (`ctxmix.methods.registry.CONTEXT_METHODS`), which
names its module and run function; the call runs them through `ctxmix.methods.context.job`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ctxmix.engine.models import Model
from ctxmix.errors import BadInput
from ctxmix.methods.context.defaults import fallback_methods
from ctxmix.methods.context.options import AT2, Ablations, PromptForm
from ctxmix.methods.context.sources import BUCKETS, QUERY, SEPARATOR, TEMPLATE
from ctxmix.methods.memory import check_memory

if TYPE_CHECKING:
    import pandas as pd

# the methods of a model with no shipped entry (`ctxmix.methods.context.defaults`): the best one-pass method that
# needs no trained weights on the shipped validation table, and ContextCite
DEFAULT_METHODS = fallback_methods()


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
        from ctxmix.methods.context.job import resolve
        from ctxmix.methods.registry import CONTEXT_METHODS

        rule = CONTEXT_METHODS[method].span
        if not CONTEXT_METHODS[method].per_token:  # an ablation method rescores the span from what it stored
            return np.asarray(resolve(rule)(self, a, b), dtype=np.float64)
        from ctxmix.methods.context.keymask import check_whole_response

        check_whole_response(method, a, b, len(self.response_ids))
        M = self.per_token[method][a:b]
        per_source = np.stack([M[:, toks].sum(1) for toks in self.source_tokens], 1)  # (b - a, d)
        return per_source.mean(0) if rule == "mean" else per_source.sum(0)

    def buckets(self, method: str, span=None) -> dict[str, float]:
        """A one-pass method's span total split into sources and what belongs to no source: "sources"
        (their sum), "template", "query", "separators", "response" (positions of the response: the
        explained rows' own tokens and the response before them), and each unattributed term; they
        sum to "target", the span's summed target (logit: summed log-probability or logit)."""
        self._check_method(method)
        if method not in self.per_token:
            raise BadInput(f"{method} scores sources by ablation: it has no per-position contributions to bucket")
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


def _check_call(model: Model, methods, max_new_tokens, query) -> list[str]:
    from ctxmix.engine.generate import MAX_NEW_TOKENS
    from ctxmix.methods.context.job import check_names

    if model.kind != "causal_lm" or model.spec.encoder_decoder:
        raise BadInput(
            f"attribute_context explains what a causal language model generates from its context; {model.name} is "
            f"a {model.kind.replace('_', ' ')} (encoder-only and encoder-decoder models are not supported)"
        )
    names = check_names(methods)
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or not 1 <= max_new_tokens <= MAX_NEW_TOKENS
    ):
        raise BadInput(f"max_new_tokens must be a whole number from 1 to {MAX_NEW_TOKENS}, got {max_new_tokens!r}")
    if query is not None and (not isinstance(query, str) or not query.strip()):
        raise BadInput("query must be a non-empty string, or None (the context alone is the prompt)")
    return names


def attribute_context(
    model: Model,
    context=None,
    query: str | None = None,
    *,
    messages: list[dict] | None = None,
    response: str | None = None,
    sources="sentence",
    methods=DEFAULT_METHODS,
    target_kind: str = "log_prob",
    prompt: PromptForm | dict | None = None,
    max_new_tokens: int = 64,
    ablations: Ablations | dict | None = None,
    at2: AT2 | dict | None = None,
    key_mask_levels=4,
    compat: bool = False,
    progress=True,
    share_trace: bool = True,
    **deprecated,
) -> ContextAttribution:
    """Score each source of `context` by how much it made `model` produce the response.

    What is attributed:
    context: one string, or a list of documents (joined with a blank line). query: the question, placed as
    "Context: {context}\\n\\nQuery: {query}" (ContextCite's format) in one user message; None: the context alone is
    the message, so the caller places any instruction ("Summarize the article.") in the context itself.
    messages: a conversation instead of context/query: [{"role": "system" | "user" | "assistant" | "tool",
    "content": str, ...}, ...], the last one the turn being answered (other keys go to the template). Every
    message's content is split into sources except those marked "attribute": False; `.source_messages` says which
    message each source is in.
    sources: "sentence" (pysbd, offline; per line), "paragraph" (blank-line separated), "document" (each document
    of a list; each message), or explicit character spans [(start, end), ...] of the context string (in order, not
    overlapping). The template's tokens, the query and the response are never sources.
    response: the text to attribute; None generates it greedily (ctxmix.generate, max_new_tokens), the final
    end-of-sequence token dropped and the text cut where the prompt form says.

    prompt (`PromptForm`, a dict of its fields, or None): the chat template (the tokenizer's, or chat_template=, a
    Jinja string) rendered with the generation prompt and tokenised as one string, or template="plain" (also for a
    tokenizer without a template): the tokenizer's BOS and the message (several: "Role: content" blocks, then
    "Assistant:"). Text in a message or the response that spells a special token is kept as text. query_suffix and
    stop ("auto"): a model without a chat template (a base model) gets the answer cue "\\nAnswer:" after the query and
    its generated response cut at its first sentence, so its response is its answer; a model with one gets neither
    (the shipped defaults, `ctxmix.methods.context.defaults`); `options["prompt_form"]` records what was used. Ablations
    remove sources from their messages and render the template again (`ctxmix.methods.context.prompt`).

    methods: names from the registry's CONTEXT_METHODS (`ctxmix methods` lists them; each record says what the
    method reads, its cost class and passes, and how a span is scored): the one-pass methods share one traced pass,
    the gradient methods make their own backward passes, the ablation methods one pass per ablated text. Default: the
    shipped defaults' methods for a model with no entry (`ctxmix.methods.context.defaults`). key_mask_levels: the
    key-mask integrated gradient's gate levels, a count K or a list in (0, 1]. target_kind: what the logit methods
    explain per response token, "log_prob" (T1, exactly), "logit_prob" (T2: log p - log(1 - p)) or "logit" (the raw
    logit).

    ablations (`Ablations`, a dict of its fields, or None): ContextCite's n random ablations (keep_prob, LASSO
    alpha), their seeds ("example": each example its own masks from a hash of seed and the texts; "official": seed +
    i for every example; default "example", "official" under compat), and the passes' batch_size.
    at2 (`AT2`, a dict, or None): AT2's features ("logit", "attention", "norm", "alti", "combined",
    "attention+norm+logit"; None: the weights' default kind) and weights (None: the shipped file trained on this
    model, matched by its weights' fingerprint; a file from `ctxmix at2-train`; "untrained": uniform).

    compat=True reproduces the official ContextCite package (context/query form only): the prompt, the generated
    response and every ablation are built from the official rebuild of the context, which keeps only the sources
    and the text between them; the response is re-tokenised with the prompt text, its end-of-sequence token kept;
    the target is aggregated in float32; context or query text that spells a special token is refused. The sources
    still come from ctxmix's splitter (pysbd; the official package uses nltk's punkt, whose data cannot be installed
    offline): pass explicit character spans to match its sources. On a GPU the official
    package runs under CUDA autocast (float16), so GPU numbers differ by that rounding (docs/context.md, "Choices
    where the papers leave room").

    share_trace: True lets the one-pass methods share one traced pass; False gives each its own, so each method's
    cost["seconds"] is what it costs alone (the benchmark's time columns). Scores are the same.
    progress: True (terminal bars), False, or a callable progress(stage, done, total) (stage "generate", or an
    ablation method's name): the dashboard's bars.

    The keywords of the earlier signature (template=, chat_template=, n_ablations=, seed=, seeds=, keep_prob=,
    alpha=, batch_size=, at2_features=, at2_weights=, and target= for target_kind=, the name `explain` gives the
    same choice: its target= is the predicted token) still work, with a FutureWarning, for one release.

    Raises BadInput, before any model pass, for an empty context, a single source, an empty or
    end-of-sequence-only response, a prompt + response over the model's window, bad spans or options, an encoder
    or encoder-decoder model, and a call whose memory estimate exceeds what the devices give.
    """
    from ctxmix.methods.context.ablation import LASSO_ALPHA, example_seed
    from ctxmix.methods.context.job import ContextJob, memory_phases, prepare_methods, run_methods, store_result
    from ctxmix.methods.context.keymask import check_levels
    from ctxmix.methods.context.onepass import TARGETS
    from ctxmix.methods.context.options import cued, groups_from, model_form, renamed_target
    from ctxmix.methods.context.prompt import build_prompt, cut_response, make_response
    from ctxmix.methods.explanation import provenance

    target = renamed_target("attribute_context", target_kind, deprecated)
    g = groups_from("attribute_context", {"prompt": prompt, "ablations": ablations, "at2": at2}, deprecated)
    form, abl, at2_opts = g["prompt"], g["ablations"], g["at2"]
    methods = _check_call(model, methods, max_new_tokens, query)
    if target not in TARGETS:
        raise BadInput(f"target_kind must be one of {', '.join(TARGETS)}, got {target!r}")
    if not isinstance(compat, bool):
        raise BadInput(f"compat must be True or False, got {compat!r}")
    seeds = abl.seeds or ("official" if compat else "example")
    if seeds == "official" and abl.seed + abl.n > 2**32:  # ablation i draws with RandomState(seed + i): < 2^32
        raise BadInput(f"seed must be at most 2^32 - n_ablations = {2**32 - abl.n}, got {abl.seed}")
    check_levels(key_mask_levels)
    form = model_form(model, form, compat)
    # checks and resolved inputs (AT2's weights, checked against the prompt form) before any pass
    # what is applied: the cue follows a query (not a conversation, not a context alone), the cut a generated response
    cue = form.query_suffix if query is not None and messages is None else ""
    asked = {"query_suffix": cue, "stop": form.stop if response is None else None}
    at2_asked = {"at2_features": at2_opts.features, "at2_weights": at2_opts.weights}
    prepared = prepare_methods(
        model, methods, {**at2_asked, "prompt_form": asked, "response_given": response is not None}
    )
    query_cued = cued(query, form)
    src, builder = build_prompt(
        model,
        context,
        query_cued,
        messages=messages,
        sources=sources,
        template=form.template,
        chat_template=form.chat_template,
        compat=compat,
    )
    first_seed = example_seed(abl.seed, src.text, query_cued) if seeds == "example" else abl.seed
    prompt_ids = builder.encode(src)
    window = model.max_length
    if len(prompt_ids.ids) >= window:
        raise BadInput(
            f"the prompt has {len(prompt_ids.ids)} tokens, over {model.name}'s window of {window} positions: "
            "shorten the context"
        )
    # refused before any forward pass (the generation's included) when the estimate exceeds what the devices give
    n_response = max_new_tokens if response is None else len(model.tokenizer(response)["input_ids"])
    check_memory(
        model,
        len(prompt_ids.ids) + n_response,
        call="attribute_context",
        methods=methods,
        n_response=n_response,
        n_ablations=abl.n,
        batch_size=abl.batch_size,
        n_sources=len(src.spans),
        phases=memory_phases(methods, prepared),
    )
    resp = make_response(model, builder, src, prompt_ids, response, max_new_tokens, progress)
    if response is None and form.stop:  # a base model's answer, not its ramble after it
        resp = cut_response(model, builder, src, prompt_ids, resp, form.stop)
    P, T = len(prompt_ids.ids), len(resp.ids)
    if P + T > window:
        raise BadInput(
            f"prompt ({P} tokens) + response ({T} tokens) exceed {model.name}'s window of {window} positions: "
            "shorten the context or the response"
        )
    rule = "official" if compat else "ctxmix"
    if compat and src.rebuild(np.ones(len(src), bool), rule) != src.text:
        note = (
            "compat: the official rebuild drops the text before the first source and after the last, even with "
            "every source kept: the prompt and the response are built without it"
        )
    else:
        note = None
    if builder.ids(src.rebuild(np.ones(len(src), bool), rule)) != prompt_ids.ids:
        raise RuntimeError("rebuilding the context with every source kept does not give the prompt's ids")
    chat = messages is not None
    source_tokens = [np.nonzero(prompt_ids.labels == i)[0].tolist() for i in range(len(src))]
    empty = [i for i, t in enumerate(source_tokens) if not t]
    ca = ContextAttribution(
        model_name=model.name,
        context=src.text,
        query=None if chat else query_cued,
        sources=src.texts,
        source_spans=list(src.spans),
        source_tokens=source_tokens,
        prompt_ids=list(prompt_ids.ids),
        labels=prompt_ids.labels,
        response=resp.text,
        response_ids=list(resp.ids),
        response_offsets=resp.offsets,
        methods=[],
        options={
            "sources": src.kind if isinstance(sources, str) else "spans",
            "splitter": src.splitter,
            "prompt": builder.info,
            "prompt_form": asked,
            "response": resp.how,
            "eos_dropped": resp.eos_dropped,
            "max_new_tokens": max_new_tokens if resp.how.startswith("generated") else None,
            "generation_seconds": resp.generation_seconds,
            "target": target,
            "n_ablations": abl.n,
            "seed": abl.seed,
            "seeds": seeds,
            "mask_seed": first_seed,
            "keep_prob": abl.keep_prob,
            "alpha": float(abl.alpha),
            "lasso_alpha_default": LASSO_ALPHA,
            "compat": compat,
            "ablation": "remove",
            "rebuild": "official" if compat else "ctxmix",
            "model_dtype": str(model.dtype).replace("torch.", ""),
            "batch_size": abl.batch_size,
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
    job = ContextJob(
        model=model,
        ids=prompt_ids.ids + resp.ids,
        P=P,
        target=target,
        source_tokens=source_tokens,
        builder=builder,
        sources=src,
        options=ca.options,
        prepared=prepared,
        progress=progress,
        share_trace=share_trace,
    )
    results = run_methods(job, methods)
    for m in methods:  # in the order asked
        store_result(ca, m, results[m])
    return ca


__all__ = ["ContextAttribution", "attribute_context", "TEMPLATE", "QUERY", "SEPARATOR"]
