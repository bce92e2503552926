"""What the Context attribution page (and a notebook) does with a `ContextAttribution` after the first pass:
count a request's prompt tokens before any model call, add methods to an attribution without redoing its
generation or its trace, and check a method by ablation (remove its top-k sources, measure the response's
log-probability again and regenerate the answer without them).

Everything here reuses the attribution's own prompt and response ids: the prompt is rebuilt from the stored
context, sources, query and template, and checked to give the stored ids exactly, so added scores and the
ablation check explain the same tokens as the first pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ctxmix.engine.models import Model
from ctxmix.errors import BadInput


def prompt_token_count(
    model: Model, context, query: str | None, sources="sentence", *, messages=None, prompt=None, **deprecated
) -> int:
    """The number of prompt tokens (template, context, query and its answer cue; or the messages) `attribute_context`
    would build with the prompt form `prompt` (as its argument): tokenising only, no model call (the dashboard's caps
    are checked on it). Raises BadInput where attribute_context would (an empty context, one source). template= and
    chat_template= (the earlier keywords) are taken into `prompt`, with a FutureWarning."""
    from ctxmix.methods.context.options import cued, groups_from, model_form
    from ctxmix.methods.context.prompt import build_prompt

    prompt = groups_from("prompt_token_count", {"prompt": prompt}, deprecated)["prompt"]

    form = model_form(model, prompt)
    src, builder = build_prompt(
        model,
        context,
        cued(query, form),
        messages=messages,
        sources=sources,
        template=form.template,
        chat_template=form.chat_template,
    )
    return len(builder.encode(src).ids)


def _check_model(ca, model: Model) -> None:
    from ctxmix.engine.fingerprint import weights_sha256

    if model.name != ca.model_name:
        raise BadInput(f"this attribution was made with {ca.model_name}; use that model, not {model.name}")
    want = ca.provenance.get("weights_sha256")
    if want and weights_sha256(model) != want:
        raise BadInput(f"{model.name}'s weights differ from those this attribution was made with (weights_sha256)")


def _rebuild(ca, model: Model):
    """(Sources, PromptBuilder) of the attribution, checked to give its prompt ids exactly."""
    from ctxmix.methods.context.prompt import rebuild_prompt

    src, builder = rebuild_prompt(ca, model)
    rule = "official" if builder.compat else "ctxmix"
    if builder.ids(src.rebuild(np.ones(len(src), bool), rule)) != list(ca.prompt_ids):
        raise BadInput(f"{model.name}'s tokenizer or template does not rebuild this attribution's prompt")
    return src, builder


def pending_methods(ca, methods, **changed) -> list[str]:
    """Those of `methods` that `extend_attribution(ca, ..., **changed)` would run: not in `ca` yet, or computed with
    another value of an option their record depends on (`ContextMethod.options`; `changed`: e.g. n_ablations=64)."""
    from ctxmix.methods.registry import CONTEXT_METHODS

    if ca is None:
        return list(methods)
    new = {**ca.options, **{k: v for k, v in changed.items() if v is not None}}
    return [
        m
        for m in methods
        if m not in ca.methods or any(new.get(o) != ca.options.get(o) for o in CONTEXT_METHODS[m].options)
    ]


def extend_attribution(
    ca,
    model: Model,
    methods,
    n_ablations: int | None = None,
    progress=False,
    *,
    at2=None,
    **deprecated,
):
    """Add `methods` (any of the registry's CONTEXT_METHODS) to `ca` in place (and return it), on its own prompt
    and response ids, with the attribution's own options (n_ablations: ContextCite's count, default the
    attribution's; at2: `AT2` or a dict, features default the attribution's own kind when it has one, else the
    weights' default; at2_features= and at2_weights= still taken with a FutureWarning). Each method runs as in
    `attribute_context` (its record's run function: the one-pass methods share one traced pass). A method already
    computed is recomputed only when an option its record depends on changed (`pending_methods`). The scores equal
    those of one `attribute_context` call with every method (tests/test_context_page.py). An evaluation `ca` holds
    is measured again with its own options when a method was added or recomputed (its held-out passes read, not
    rerun: only the new top-k removals run), so it always covers `ca.methods`; nothing changed, nothing runs.
    progress: as attribute_context's (a callable gets progress(stage, done, total))."""
    from ctxmix.methods.context.ablation import check_n_ablations
    from ctxmix.methods.context.job import ContextJob, check_names, prepare_methods, run_methods, store_result
    from ctxmix.methods.context.options import AT2, groups_from
    from ctxmix.methods.registry import CONTEXT_METHODS

    at2_opts = groups_from("extend_attribution", {"at2": at2}, deprecated)["at2"]
    names = check_names(methods)
    n = check_n_ablations(int(ca.options["n_ablations"]) if n_ablations is None else n_ablations)
    _check_model(ca, model)
    todo = pending_methods(ca, names, n_ablations=n)
    if at2_opts != AT2():  # AT2 options asked anew: a method reading trained weights is computed again with them
        todo += [m for m in names if m not in todo and CONTEXT_METHODS[m].needs_weights and _at2_changed(ca, at2_opts)]
    if not todo:
        return ca
    kind = at2_opts.features or (ca.options.get("at2") or {}).get("kind")  # None: the weights' default kind
    options = {**ca.options, "n_ablations": n}
    form = ca.options.get("prompt_form") or {"query_suffix": "", "stop": None}  # saved before it was recorded: none
    given = ca.options.get("response") == "given"
    at2_asked = {"at2_features": kind, "at2_weights": at2_opts.weights}
    prepared = prepare_methods(model, todo, {**at2_asked, "prompt_form": form, "response_given": given})
    src, builder = _rebuild(ca, model)
    job = ContextJob(
        model=model,
        ids=list(ca.prompt_ids) + list(ca.response_ids),
        P=len(ca.prompt_ids),
        target=ca.options["target"],
        source_tokens=[list(t) for t in ca.source_tokens],
        builder=builder,
        sources=src,
        options=options,
        prepared=prepared,
        progress=progress,
    )
    results = run_methods(job, todo)
    for m in todo:
        store_result(ca, m, results[m])
    if ca.evaluation:  # measured on the old methods (or contextcite's old scores): measure it again, same options
        _evaluate_again(ca, model)
    return ca


def _at2_changed(ca, asked) -> bool:
    """Whether AT2 options asked of `extend_attribution` differ from those the attribution's AT2 scores were made
    with (its kind; weights other than the default, or other than the file it read)."""
    from ctxmix.methods.context.at2 import canonical_kind

    had = ca.options.get("at2") or {}
    if asked.features is not None and canonical_kind(asked.features) != canonical_kind(had.get("kind")):
        return True
    if asked.weights is None:
        return False
    used = str(had.get("weights", ""))
    return str(asked.weights) != used and not (str(asked.weights) == "untrained" and used.startswith("untrained"))


def _evaluate_again(ca, model: Model) -> None:
    """`ca.evaluate` again with the options of the evaluation `ca` holds (its k, held-out count and seed, gold,
    span), reading its held-out passes."""
    o = ca.evaluation["options"]
    span = o.get("span")
    if "span" not in o and list(o["span_tokens"]) != [0, len(ca.response_ids)]:  # saved before "span" was kept
        a, b = o["span_tokens"]
        span = (int(ca.response_offsets[a][0]), int(ca.response_offsets[b - 1][1]))
    seed = o.get("seed", o["heldout_seeds"][0])
    batch = int(ca.options.get("batch_size", 8))
    ca.evaluate(
        model, o["k"], int(o["n_ablations"]), o.get("gold"), span=span, seed=seed, batch_size=batch, progress=False
    )


def _add(ca, m: str) -> None:
    if m not in ca.methods:
        ca.methods.append(m)


@dataclass
class AblationCheck:
    """What removing a method's top-k sources did. removed: the source indices (best first); log_prob_before
    / log_prob_after: log P(span | context) and log P(span | context without them) (natural log, the span's
    response tokens teacher-forced); drop = before - after (`topk_drop@k` of `evaluate`); response_after:
    the answer generated greedily from the reduced context (its end-of-sequence token dropped), with
    `changed` saying whether it differs from the response; prompt_tokens_after: the reduced prompt's length."""

    method: str
    k: int
    span: tuple[int, int] | None
    removed: list[int]
    removed_texts: list[str]
    log_prob_before: float
    log_prob_after: float
    drop: float
    response: str
    response_after: str
    changed: bool
    prompt_tokens_after: int
    cost: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def ablate(ca, model: Model, method: str, k: int = 3, span=None, max_new_tokens: int | None = None, progress=None):
    """Remove `method`'s k highest-scoring sources (for a character `span` of the response, or all of it),
    measure the response's log-probability with and without them (2 forward passes: the same passes and
    arithmetic as `evaluate`'s topk_drop) and regenerate the answer from the reduced context greedily
    (max_new_tokens: the response's own length by default, at least 1). Returns an `AblationCheck`.
    progress(stage, done, total): "generate" as tokens are generated."""
    from ctxmix.engine.generate import MAX_NEW_TOKENS, generate
    from ctxmix.methods.context.ablation import log_probs, response_logit_probs
    from ctxmix.methods.context.prompt import eos_ids

    ca._check_method(method)
    d = ca.n_sources
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k < d:
        raise BadInput(f"k must be a whole number from 1 to {d - 1} (below the {d} sources), got {k!r}")
    T = len(ca.response_ids)
    n_new = max(1, T) if max_new_tokens is None else max_new_tokens
    if isinstance(n_new, bool) or not isinstance(n_new, int) or not 1 <= n_new <= MAX_NEW_TOKENS:
        raise BadInput(f"max_new_tokens must be a whole number from 1 to {MAX_NEW_TOKENS}, got {n_new!r}")
    a, b = ca.token_range(span)  # checks the span
    _check_model(ca, model)
    src, builder = _rebuild(ca, model)
    scores = ca.scores[method] if span is None else ca.scores_for(method, span)
    # highest first, ties to the earlier source, NaN last: the order of `top` and of evaluate's topk_drop
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    keep = np.ones(d, dtype=bool)
    keep[order[: int(k)]] = False
    full_ids = list(ca.prompt_ids)  # checked by _rebuild
    reduced_ids = builder.ids(src.rebuild(keep, "official" if builder.compat else "ctxmix"))
    t0 = time.perf_counter()
    lp = response_logit_probs(model, [full_ids, reduced_ids], list(ca.response_ids))
    before, after = (float(v) for v in log_probs(lp[:, a:b]))
    t1 = time.perf_counter()
    report = (lambda i, n: progress("generate", i, n)) if callable(progress) else None
    g = generate(model, input_ids=reduced_ids, max_new_tokens=n_new, greedy=True, progress=report)
    new = list(g.new_ids)
    if new and new[-1] in eos_ids(model):
        new = new[:-1]
    text = model.tokenizer.decode(new)
    stop = (ca.options.get("prompt_form") or {}).get("stop")
    if stop and ca.options.get("response", "").startswith("generated"):  # cut as the attribution's response was
        from ctxmix.methods.context.sources import cut_at_stop

        text = cut_at_stop(text, stop)
    removed = [int(i) for i in order[: int(k)]]  # best first
    return AblationCheck(
        method=method,
        k=int(k),
        span=None if span is None else (int(span[0]), int(span[1])),
        removed=removed,
        removed_texts=[ca.sources[i] for i in removed],
        log_prob_before=before,
        log_prob_after=after,
        drop=before - after,
        response=ca.response,
        response_after=text,
        changed=text.strip() != ca.response.strip(),
        prompt_tokens_after=len(reduced_ids),
        cost={
            "forward": 2,
            "generated_tokens": len(g.new_ids),
            "seconds": time.perf_counter() - t0,
            "generation_seconds": time.perf_counter() - t1,
        },
    )
