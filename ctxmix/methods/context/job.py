"""How `attribute_context` and `extend_attribution` run the context methods: from their records alone.

Each method is a `ContextMethod` record (`ctxmix.methods.registry.CONTEXT_METHODS`) naming its `prepare`
function (checks and resolved inputs, before any pass), its `run` function and its span rule. A call builds one
`ContextJob` (the prompt + response ids, the sources, the call's options) and hands it to each run function once,
with every asked method that names it, so methods that share a pass (logit, alti_logit and attention: one trace)
run together. A run function returns, per method, a result: "per_token" (T, P + T) or (1, P + T), "terms",
"target", "cost", and where it has them "ablations", "intercept", "scores", "options" (merged into the
attribution's), "warnings" and "reconstruction_error". `store_result` puts it in the `ContextAttribution`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any

from ctxmix.engine.models import Model
from ctxmix.errors import BadInput


@dataclass
class ContextJob:
    """What one call gives every context method: the model, prompt + response ids (P prompt tokens), the target,
    the sources' token positions, the prompt builder and the sources (the ablation methods rebuild the text), the
    call's options (`ContextAttribution.options`), what each method's `prepare` returned, the progress callback
    and whether the decomposed methods share one trace."""

    model: Model
    ids: list[int]
    P: int
    target: str
    source_tokens: list[list[int]]
    builder: Any = None
    sources: Any = None
    options: dict = field(default_factory=dict)
    prepared: dict[str, dict] = field(default_factory=dict)
    progress: Any = False
    share_trace: bool = True

    @property
    def response_ids(self) -> list[int]:
        return list(self.ids[self.P :])

    @property
    def gated(self) -> list[int]:
        """Every source token position (the keys the key-mask methods gate)."""
        return [j for toks in self.source_tokens for j in toks]


def resolve(path: str) -> Callable:
    """The function a record names as "package.module:function"."""
    module, _, name = path.partition(":")
    return getattr(import_module(module), name)


def check_names(methods, what: str = "context-attribution") -> list[str]:
    """The asked method names, de-duplicated in order; BadInput for none or an unknown one (listing the valid)."""
    from ctxmix.methods.registry import CONTEXT_METHODS

    names = [methods] if isinstance(methods, str) else list(methods or [])
    if not names:
        raise BadInput("choose at least one method")
    bad = [m for m in names if m not in CONTEXT_METHODS]
    if bad:
        raise BadInput(f"unknown {what} method(s) {', '.join(map(repr, bad))}; valid: {', '.join(CONTEXT_METHODS)}")
    return list(dict.fromkeys(names))


def prepare_methods(model: Model, names: list[str], options: dict) -> dict[str, dict]:
    """{method: what its record's `prepare` returned} (checks and resolved inputs such as AT2's weights), before
    any pass; a method without one gets {}."""
    from ctxmix.methods.registry import CONTEXT_METHODS

    prep = {m: CONTEXT_METHODS[m].prepare for m in names}
    return {m: resolve(prep[m])(model, m, options) if prep[m] else {} for m in names}


def memory_phases(names: list[str], prepared: dict[str, dict] | None = None) -> list[str]:
    """The memory phases (`ctxmix.methods.memory`) of the methods: each record's, or what its `prepare` said
    (AT2's F-alti reads a full trace)."""
    from ctxmix.methods.registry import CONTEXT_METHODS

    prepared = prepared or {}
    out: list[str] = []
    for m in names:
        out += [p for p in prepared.get(m, {}).get("memory", CONTEXT_METHODS[m].memory) if p not in out]
    return out


def run_methods(job: ContextJob, names: list[str]) -> dict[str, dict]:
    """{method: result} for `names`, each run function called once with all the asked methods that name it (in
    the registry's order of first appearance)."""
    from ctxmix.methods.registry import CONTEXT_METHODS

    groups: dict[str, list[str]] = {}
    for m in names:
        groups.setdefault(CONTEXT_METHODS[m].run, []).append(m)
    out: dict[str, dict] = {}
    for path, group in groups.items():
        res = resolve(path)(job, group)
        missing = [m for m in group if m not in res]
        if missing:  # a run function that skips a method must fail loudly, never leave it silently unscored
            raise RuntimeError(f"{path} returned no result for {', '.join(missing)}")
        out.update({m: res[m] for m in group})
    return out


def store_result(ca, method: str, res: dict) -> None:
    """Put one method's result in `ca` (a `ContextAttribution`): its per-token rows, terms, target, cost,
    ablations, intercept, options and warnings; its scores for the whole response (given, or from its span rule)."""
    if "per_token" in res:
        ca.per_token[method] = res["per_token"]
        ca.terms[method] = res.get("terms", {})
        ca.targets[method] = res["target"]
    if "ablations" in res:
        ca.ablations[method] = res["ablations"]
    if "intercept" in res:
        ca.intercepts[method] = res["intercept"]
    ca.cost[method] = res["cost"]
    ca.options.update(res.get("options", {}))
    if "reconstruction_error" in res:  # the rebuilt layers against the model's states (max abs)
        ca.options.setdefault("reconstruction_error", {})[method] = res["reconstruction_error"]
    if method not in ca.methods:
        ca.methods.append(method)
    ca.scores[method] = res["scores"] if "scores" in res else ca.scores_for(method)
    for w in res.get("warnings", []):
        if w not in ca.warnings:
            ca.warnings.append(w)
