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
    model: Model, context, query: str | None, sources="sentence", template=None, *, messages=None, chat_template=None
) -> int:
    """The number of prompt tokens (template, context, query; or the messages) `attribute_context` would
    build: tokenising only, no model call (the dashboard's caps are checked on it). Raises BadInput where
    attribute_context would (an empty context, one source, special-token text under compat)."""
    from ctxmix.methods.context.prompt import build_prompt

    src, builder = build_prompt(
        model, context, query, messages=messages, sources=sources, template=template, chat_template=chat_template
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
    rule = "contextcite" if builder.compat else "ctxmix"
    if builder.ids(src.rebuild(np.ones(len(src), bool), rule)) != list(ca.prompt_ids):
        raise BadInput(f"{model.name}'s tokenizer or template does not rebuild this attribution's prompt")
    return src, builder


def extend_attribution(
    ca,
    model: Model,
    methods,
    n_ablations: int | None = None,
    progress=False,
    *,
    at2_features: str | None = None,
    at2_weights=None,
):
    """Add `methods` (any of the registry's CONTEXT_METHODS) to `ca` in place (and return it), on its own prompt
    and response ids: the one-pass methods from one traced pass, `at2_exact` from one traced pass (at2_features:
    the attribution's own when it has them, else "logit"; at2_weights as attribute_context's), `contextcite`
    from `n_ablations` ablations (default: the attribution's `options["n_ablations"]`) with its masks' seed,
    keep_prob, alpha and compat, `leave_one_out` from d + 1 passes. A method already computed is recomputed only
    when asked again with another n_ablations (contextcite). The scores equal those of one `attribute_context`
    call with every method (tests/test_context_page.py). An evaluation `ca` holds is measured again with its
    own options when a method was added or recomputed (its held-out passes read, not rerun: only the new top-k
    removals run), so it always covers `ca.methods`; nothing changed, nothing runs.
    progress: as attribute_context's (a callable gets progress(stage, done, total))."""
    from ctxmix.methods.context.ablation import (
        check_n_ablations,
        leave_one_out_scores,
        mask_seed,
        run_contextcite,
        run_leave_one_out,
        store_contextcite,
    )
    from ctxmix.methods.context.onepass import ONE_PASS_METHODS, run_one_pass
    from ctxmix.methods.registry import CONTEXT_METHODS

    names = [methods] if isinstance(methods, str) else list(dict.fromkeys(methods or []))
    bad = [m for m in names if m not in CONTEXT_METHODS]
    if not names or bad:
        raise BadInput(
            f"unknown context-attribution method(s) {', '.join(map(repr, bad)) or '(none given)'}; "
            f"valid: {', '.join(CONTEXT_METHODS)}"
        )
    n = check_n_ablations(int(ca.options["n_ablations"]) if n_ablations is None else n_ablations)
    _check_model(ca, model)
    redo_cc = "contextcite" in names and "contextcite" in ca.methods and n != int(ca.options["n_ablations"])
    todo = [m for m in names if m not in ca.methods or (m == "contextcite" and redo_cc)]
    if not todo:
        return ca
    unhandled = [m for m in todo if m not in (*ONE_PASS_METHODS, "at2_exact", "contextcite", "leave_one_out")]
    if unhandled:  # a method added to the registry must be added here too, never silently skipped
        raise NotImplementedError(f"extend_attribution cannot add {', '.join(unhandled)} yet")
    if "at2_exact" in todo:  # the weights checked before any pass
        from ctxmix.methods.context.at2 import resolve_weights

        kind = at2_features or (ca.options.get("at2") or {}).get("kind")  # None: the weights' default kind
        at2_w, at2_info = resolve_weights(model, kind, at2_weights)
        kind = at2_info["kind"]
    src, builder = _rebuild(ca, model)
    compat = bool(ca.options.get("compat"))
    batch = int(ca.options.get("batch_size", 8))
    P, T = len(ca.prompt_ids), len(ca.response_ids)
    ids = list(ca.prompt_ids) + list(ca.response_ids)
    one_pass = [m for m in todo if m in ONE_PASS_METHODS]
    if one_pass:
        gated = [j for toks in ca.source_tokens for j in toks]
        levels = ca.options.get("key_mask_levels", 4)  # the call's (an attribution saved before it had none: 4)
        res = run_one_pass(model, one_pass, ids, P, ca.options["target"], gated=gated, levels=levels)
        for m, r in res.items():
            ca.per_token[m], ca.terms[m], ca.targets[m], ca.cost[m] = r["per_token"], r["terms"], r["target"], r["cost"]
            if "reconstruction_error" in r:
                ca.options.setdefault("reconstruction_error", {})[m] = r["reconstruction_error"]
            _add(ca, m)
            ca.scores[m] = ca.scores_for(m)
    if "at2_exact" in todo:
        from ctxmix.methods.context.at2 import run_at2, store_at2

        _add(ca, "at2_exact")
        store_at2(ca, run_at2(model, ids, P, kind, at2_w, ca.options["target"]), at2_info)
    if "contextcite" in todo:
        seed, keep, alpha = mask_seed(ca.options), float(ca.options["keep_prob"]), float(ca.options["alpha"])
        ab = run_contextcite(model, builder, src, ca.response_ids, n, seed, keep, batch, compat, progress)
        store_contextcite(ca, ab, compat, alpha)
        ca.options["n_ablations"] = n
        _add(ca, "contextcite")
    if "leave_one_out" in todo:
        ab = run_leave_one_out(model, builder, src, ca.response_ids, batch, compat, progress)
        ca.ablations["leave_one_out"] = {"masks": ab["masks"], "logit_probs": ab["logit_probs"]}
        ca.scores["leave_one_out"] = leave_one_out_scores(ab, 0, T)
        ca.cost["leave_one_out"] = ab["cost"]
        _add(ca, "leave_one_out")
    if ca.evaluation:  # measured on the old methods (or contextcite's old scores): measure it again, same options
        _evaluate_again(ca, model)
    return ca


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
    reduced_ids = builder.ids(src.rebuild(keep, "contextcite" if builder.compat else "ctxmix"))
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
