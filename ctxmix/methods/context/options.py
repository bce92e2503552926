"""The option groups of `attribute_context`: how the prompt is formed (`PromptForm`), ContextCite's and
leave-one-out's ablations (`Ablations`) and AT2's weights (`AT2`). Each is given as the dataclass, a dict of its
fields, or None (the defaults); the flat keywords they replace (n_ablations=, at2_features=, template=, ...) are
still taken, with a FutureWarning, for one release.

    ctxmix.attribute_context(model, ctx, q, methods=["logit", "contextcite"], ablations={"n": 64, "seed": 1})
    ctxmix.attribute_context(model, ctx, q, prompt=PromptForm(query_suffix="", stop=None))  # a base model, as is
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ctxmix.errors import BadInput

AUTO = "auto"  # a prompt-form field taken from the shipped defaults for the model (`ctxmix.methods.context.defaults`)
STOPS = ("sentence", "line")


@dataclass(frozen=True)
class PromptForm:
    """How the prompt is formed and where a generated response ends.

    template: None (the chat template where the tokenizer has one, else "plain"), "chat" or "plain" (the tokenizer's
    BOS, then "Context: ...\\n\\nQuery: ..."). chat_template: a Jinja string used instead of the tokenizer's.
    query_suffix: text appended to the query (an answer cue, never a source); stop: where a generated response is
    cut, "sentence" (its first sentence), "line" (its first line) or None (where the model stops). "auto" (both
    defaults): the shipped defaults for the model: nothing for a model with a chat template; for one without (a base
    model, which reads the prompt as a document to continue and rambles past its answer) the cue "\\nAnswer:" and
    the first sentence, as the benchmark asks it, so its response is its answer (compat=True: neither)."""

    template: str | None = None
    chat_template: str | None = None
    query_suffix: str | None = AUTO
    stop: str | None = AUTO

    def __post_init__(self) -> None:
        if self.template not in (None, "chat", "plain"):
            raise BadInput(f"template must be None, 'chat' or 'plain', got {self.template!r}")
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template):
            raise BadInput("chat_template must be a Jinja template string (or None: the tokenizer's)")
        if self.query_suffix is not None and not isinstance(self.query_suffix, str):
            raise BadInput(f"query_suffix must be a string, 'auto' or None, got {self.query_suffix!r}")
        if self.stop not in (AUTO, None, *STOPS):
            raise BadInput(f"stop must be 'auto', 'sentence', 'line' or None, got {self.stop!r}")

    def resolved(self, has_chat_template: bool, compat: bool = False) -> PromptForm:
        """This form with "auto" replaced by the shipped default for a model with or without a chat template (under
        compat, which reproduces the official ContextCite package: no cue, no cut, as it does)."""
        from ctxmix.methods.context.defaults import prompt_form_for

        form = {} if compat else prompt_form_for(has_chat_template)
        return replace(
            self,
            query_suffix=form.get("query_suffix", "") if self.query_suffix == AUTO else (self.query_suffix or ""),
            stop=form.get("stop") if self.stop == AUTO else self.stop,
        )


def unescape_cue(text: str) -> str:
    """A cue typed on one line, its escapes read: "\\n" a line break, "\\t" a tab ("auto" as it is)."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


def escape_cue(text: str) -> str:
    """The one-line spelling of a cue (`unescape_cue` reads it back)."""
    return text.replace("\n", "\\n").replace("\t", "\\t")


def model_form(model, prompt, compat: bool = False) -> PromptForm:
    """The prompt form a call asks `model` with: `prompt` (a PromptForm, a dict of its fields or None) with "auto"
    resolved for the model (a chat template, given or the tokenizer's, unless template="plain")."""
    form = as_group("prompt", prompt)
    has_chat = form.chat_template is not None or bool(getattr(model.tokenizer, "chat_template", None))
    return form.resolved(has_chat and form.template != "plain", compat)


def cued(query: str | None, form: PromptForm) -> str | None:
    """The query as the prompt holds it: the form's query_suffix (an answer cue) appended."""
    return query + form.query_suffix if query is not None and form.query_suffix else query


@dataclass(frozen=True)
class Ablations:
    """ContextCite's and leave-one-out's ablation passes (and `evaluate`'s batch).

    n: ContextCite's random ablations (2..MAX_ABLATIONS); seed, seeds: how its masks are seeded ("example": each
    example its own, hashed from seed and the texts; "official": seed + i, the official package's; None: "example",
    or "official" with compat=True); keep_prob: each source's chance to be kept; alpha: the LASSO penalty;
    batch_size: ablated prompts per forward pass."""

    n: int = 32
    seed: int = 0
    seeds: str | None = None
    keep_prob: float = 0.5
    alpha: float = 0.01
    batch_size: int = 8

    def __post_init__(self) -> None:
        from ctxmix.methods.context.ablation import SEED_SCHEMES, check_n_ablations

        check_n_ablations(self.n)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise BadInput(f"seed must be a non-negative whole number, got {self.seed!r}")
        if self.seeds is not None and self.seeds not in SEED_SCHEMES:
            raise BadInput(f"seeds must be one of {', '.join(SEED_SCHEMES)} (or None), got {self.seeds!r}")
        if self.seeds == "official" and self.seed + self.n > 2**32:  # ablation i draws with RandomState(seed + i)
            raise BadInput(f"seed must be at most 2^32 - n_ablations = {2**32 - self.n}, got {self.seed}")
        kp = self.keep_prob
        if isinstance(kp, bool) or not isinstance(kp, (int, float)) or not 0 < kp < 1:
            raise BadInput(f"keep_prob must be between 0 and 1 (exclusive), got {kp!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise BadInput(f"alpha must be a positive number, got {self.alpha!r}")
        bs = self.batch_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise BadInput(f"batch_size must be a positive whole number, got {bs!r}")


@dataclass(frozen=True)
class AT2:
    """AT2's estimator (the method of its name). features: "logit", "attention", "norm", "alti", "combined" or
    "attention+norm+logit" (None: the weights' default kind); weights: None (those shipped for the model, matched
    by its weights' fingerprint), a file from `ctxmix at2-train`, or "untrained" (uniform)."""

    features: str | None = None
    weights: str | Path | None = None


# the flat keywords each group replaces: {old keyword: (group, field)}
LEGACY = {
    "template": ("prompt", "template"),
    "chat_template": ("prompt", "chat_template"),
    "n_ablations": ("ablations", "n"),
    "seed": ("ablations", "seed"),
    "seeds": ("ablations", "seeds"),
    "keep_prob": ("ablations", "keep_prob"),
    "alpha": ("ablations", "alpha"),
    "batch_size": ("ablations", "batch_size"),
    "at2_features": ("at2", "features"),
    "at2_weights": ("at2", "weights"),
}
GROUPS = {"prompt": PromptForm, "ablations": Ablations, "at2": AT2}


def as_group(kind: str, value):
    """A group from its dataclass, a dict of its fields or None (its defaults); BadInput names unknown fields."""
    cls = GROUPS[kind]
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        names = {f.name for f in fields(cls)}
        bad = [k for k in value if k not in names]
        if bad:
            raise BadInput(f"{kind}: unknown field(s) {', '.join(map(repr, bad))}; it takes {', '.join(sorted(names))}")
        return cls(**value)
    raise BadInput(f"{kind} must be a {cls.__name__}, a dict of its fields or None, got {type(value).__name__}")


def renamed_target(call: str, target_kind: str, legacy: dict) -> str:
    """target_kind, or the earlier keyword target= (taken out of `legacy`, with a FutureWarning): `explain` names
    the explained quantity target_kind and the predicted token target, so one name means one thing."""
    if "target" not in legacy:
        return target_kind
    warnings.warn(f"{call}(target=...) is deprecated: use target_kind=...", FutureWarning, stacklevel=3)
    old = legacy.pop("target")
    if target_kind != "log_prob" and old != target_kind:
        raise BadInput("target= is target_kind=, and target_kind= is given too: give target_kind= only")
    return old


def groups_from(call: str, groups: dict, legacy: dict) -> dict:
    """{group name: group} from the group arguments and any flat keywords of the old signature (each moved into its
    group with a FutureWarning; giving both for one field is an error; an unknown keyword a TypeError, as Python's)."""
    unknown = [k for k in legacy if k not in LEGACY]
    if unknown:
        raise TypeError(f"{call}() got an unexpected keyword argument {unknown[0]!r}")
    out = {k: as_group(k, v) for k, v in groups.items()}
    for old, value in legacy.items():
        kind, name = LEGACY[old]
        if kind not in out:
            raise TypeError(f"{call}() got an unexpected keyword argument {old!r}")
        spelled = {"prompt": "PromptForm", "ablations": "Ablations", "at2": "AT2"}[kind]
        warnings.warn(
            f"{call}({old}=...) is deprecated: use {kind}={spelled}({name}=...) or {kind}={{{name!r}: ...}}",
            FutureWarning,
            stacklevel=3,
        )
        if groups.get(kind) is not None:  # the group given too: which of the two is meant cannot be told
            raise BadInput(f"{old}= is {kind}.{name}, and {kind}= is given too: put {name} in {kind}=")
        out[kind] = replace(out[kind], **{name: value})
    return out
