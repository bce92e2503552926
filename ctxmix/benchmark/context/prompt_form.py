"""The prompt form a context benchmark asks its model with, shared by the benchmark (`bench`) and AT2's trainer
(`at2_train`), so a base model's weights are trained on the prompt they are benchmarked with: the config's
`template`, `query_suffix` (an answer cue appended to the query) and `stop` (where a generated response is cut)."""

from __future__ import annotations

from pathlib import Path

from ctxmix.benchmark.context.data import ContextExample
from ctxmix.errors import BadInput
from ctxmix.methods.context.sources import cut_at_stop  # noqa: F401 - the benchmark's name for it

PROMPT_KEYS = ("template", "query_suffix", "stop")  # a context config's prompt form (configs/context-gemma3.yaml)


def prompt_form(config: dict | None) -> dict:
    """The prompt form a context config asks its model with: the keys of PROMPT_KEYS it sets ({}: the model's
    default, the chat template where it has one). A base model is trained on the form it is benchmarked with.
    Raises BadInput for a stop other than "line" or "sentence" (the benchmark's)."""
    form = {k: config[k] for k in PROMPT_KEYS if config and config.get(k) is not None}
    if form.get("stop") not in (None, "line", "sentence"):
        raise BadInput(f"stop must be line or sentence, got {form['stop']!r}")
    return form


def runs_at2(config: dict) -> bool:
    """Whether any task of a context config runs at2_exact."""
    lists = [config.get("methods") or []] + [t.get("methods") or [] for t in config.get("tasks") or []]
    return any("at2_exact" in m for m in lists)


def call_form(config: dict | None) -> dict:
    """The prompt form `attribute_context` is called with for a config: its template and no cue or cut of the call's
    own (the benchmark appends the cue to the query itself, `example_query`, and cuts a generated response itself,
    `cut_at_stop`), so its results never depend on the shipped defaults of a model's form."""
    return {"template": (config or {}).get("template"), "query_suffix": "", "stop": None}


def example_query(config: dict, ex: ContextExample) -> str:
    """The query an example is asked with: its own, then the config's `query_suffix` (a base model's answer
    cue, "\nAnswer:"; part of the query, never a source)."""
    return ex.query + config.get("query_suffix", "")


def check_at2_prompt(config: dict) -> None:
    """Raises BadInput where the config's at2_exact reads a weights file trained on another prompt form than the
    config asks with (`prompt_form`: a base model's answer cue and cut): the estimator would read
    features of a prompt it never saw. A file from before the form was recorded counts as the default form."""
    path = config_weights_file(config)
    if path is not None:  # (a missing file: at2_exact names it itself)
        check_weights_form(path, prompt_form(config), "this config asks with")


def config_weights_file(config: dict) -> Path | None:
    """The AT2 weights file a config's at2_exact reads (its `at2_weights`, else the model's shipped file), or None
    where no task runs at2_exact, its weights are uniform ("untrained") or the file is not there."""
    from ctxmix.methods.context.at2 import shipped_weights_path

    weights = config.get("at2_weights")
    if not runs_at2(config) or weights == "untrained":
        return None
    path = shipped_weights_path(str(config.get("model"))) if weights is None else Path(weights)
    return path if path is not None and path.is_file() else None


def check_weights_form(path, form: dict, asked: str = "the prompt asked with is") -> None:
    """Raises BadInput where the AT2 weights file at `path` was trained on another prompt form than `form` (a
    `prompt_form`; a file from before the form was recorded counts as the default form {})."""
    from ctxmix.methods.context.at2 import load_weights

    trained_on = load_weights(path)[2].get("prompt", {})
    if trained_on != form:
        raise BadInput(
            f"the AT2 weights {str(path)!r} were trained with the prompt form {trained_on}, and {asked} {form}: "
            "train them with `ctxmix at2-train --prompt-from <the config>` (bench scripts: give --prompt-from)"
        )


def at2_default_kind(config: dict) -> str | None:
    """The kind at2_exact runs where the config names no `at2_features`: the weights file's default
    (`at2.default_kind`, chosen on its validation table); None where the config names one or reads no file."""
    from ctxmix.benchmark.context.validation import shipped_tables
    from ctxmix.methods.context.at2 import default_kind, file_sha16, load_weights

    path = None if config.get("at2_features") else config_weights_file(config)
    if path is None:
        return None
    ws, _, meta = load_weights(path)
    sha = file_sha16(path)
    return default_kind(meta, ws, next((t for t in shipped_tables() if t.get("at2_weights_sha256") == sha), None))
