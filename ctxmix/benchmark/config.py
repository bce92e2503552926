"""Benchmark configs: the schema, validation before any work, and YAML loading.

(Over 500 lines: every check of a config, with the message that names what is valid, is here,
so a config is refused whole before any work starts.)
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ctxmix.errors import BadInput

CONFIG_KINDS = ("methods", "contextualization_change")


DATASET_SOURCES = ("pang_lee", "agreement", "file", "hf", "blimp", "linzen_goldberg")


TARGETS = ("predicted", "gold")


EXPLAIN_OPTIONS = {
    "ig_baseline": ("pad", "mask", "unk", "zero"),  # text only ("blank" is for images and clips)
    "ig_steps": int,
    "blank_replacement": ("unk", "mask"),
    "cat_mask_special": (True, False),
    "grad_at": ("word", "embedding_output"),
}


DONE_STATUSES = ("done", "na", "skipped")
# a (text, method) unit its length rules out whatever the machine's state (attention flow's time):
# recorded with the message, not retried by later runs of the same ctxmix version (whose limits are
# the same); a run on another version retries it (`ResultsStore.finished_units`), and so does --fresh.
# DecompX's memory refusal depends on the memory free at the time: an error, retried.
REFUSED = "refused"


EXAMPLE_BATCH = 8  # examples of one (model, dataset) traced and decomposed together; fixed per run


METHOD_ALIASES = {"all": "every method that applies to each model"}


DERIVED_METHODS: dict[str, str] = {
    "random": "uniform random scores in [0, 1), seeded per example (value zeroing's Rand)",
    "raw_attention": "last-layer head-mean attention, explained row, own entry zeroed (AttCAT's RawAtt)",
    "norm_rollout": "N_ResLN row-normalised per layer, rolled out without identity (ALTI's Norm Rollout)",
    "norm_fixed_res": "0.5 * rownorm(N) + 0.5 * I per layer, rolled out (GlobEnc's N_FixedRes)",
    "blank_out_foil": "drop of sigma(l_target - l_foil) when a token becomes [UNK] (value zeroing's blank-out)",
}


_DERIVED_BASES = {"raw_attention": ["attention"], "norm_rollout": ["norm_res_ln"], "norm_fixed_res": ["norm"]}

BLIMP_CUES = {  # BLiMP subset -> (value zeroing UID, cue rule)
    "anaphor_number_agreement": ("ana", "subject"),
    "determiner_noun_agreement_2": ("dna", "next"),
    "determiner_noun_agreement_with_adj_2": ("dnaa", "next2"),
    "distractor_agreement_relational_noun": ("darn", "subject"),
    "regular_plural_subject_verb_agreement_1": ("rpsv", "subject"),
}


def _all_method_names() -> list[str]:
    from ctxmix import METHODS

    return list(METHODS) + list(DERIVED_METHODS)


@dataclass
class DatasetSpec:
    id: str
    source: str
    options: dict = field(default_factory=dict)
    limit: int | None = None

    def identity(self) -> str:
        """What defines the examples (not how many are taken)."""
        return json.dumps({"source": self.source, **self.options}, sort_keys=True, default=str)


@dataclass
class ModelSpec:
    label: str
    name: str
    device: str = "auto"
    dtype: str = "float32"


@dataclass
class Plan:
    """A validated config."""

    name: str
    kind: str
    models: list[ModelSpec]
    datasets: list[DatasetSpec]
    runs: list[tuple[str, str]]  # (model label, dataset id)
    methods: list[str]  # may contain "all"
    metrics: list[str]
    target: str
    explain: dict
    options: dict
    paper: dict
    raw: dict
    source: str = ""

    @property
    def run_id(self) -> str:
        return self.name

    def config_hash(self) -> str:
        """Hash of what changes per-unit results (not the lists of models, datasets, methods, limits)."""
        # no effect on results (example_batch moves them by float rounding only; a run keeps its own)
        opts = {
            k: v
            for k, v in self.options.items()
            if k not in ("batch_size", "threads", "gpus_per_task", "example_batch")
        }
        if opts.get("token_type_ids", True) is True:  # the default keeps the hashes of configs made before it
            opts.pop("token_type_ids", None)
        for k in ("deletion_stop_one_short", "raw_attention_keep_self", "contrastive"):  # only a change is hashed
            if opts.get(k) is False:
                opts.pop(k)
        keep = {
            "kind": self.kind,
            "metrics": sorted(self.metrics),
            "target": self.target,
            "explain": self.explain,
            "options": opts,
        }
        return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _suggest(name: str, valid: Iterable[str]) -> str:
    import difflib

    close = difflib.get_close_matches(str(name), list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _hub_reachable(timeout: float = 3.0) -> bool:
    from ctxmix.hub import hub_reachable

    return hub_reachable(timeout)


def _offline() -> bool:
    from ctxmix.hub import offline

    return offline()


def check_model_name(name: str) -> str | None:
    """None when `name` can be loaded (embedded, a local folder, or a hub id the hub or the
    local cache knows); otherwise the reason. Reads at most a config.json."""
    from ctxmix.engine.embedded import EMBEDDED

    if name in EMBEDDED:
        return None
    p = Path(os.path.expanduser(name))
    if p.is_dir():
        return None if (p / "config.json").is_file() else f"folder {name!r} has no config.json"
    if name.startswith(("/", "./", "../", "~")):
        return f"no such folder {name!r}"
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return None
    except Exception:  # noqa: BLE001 - a malformed id; handled below
        pass
    if _offline() or not _hub_reachable():
        what = f"model {name!r} is not available" if "/" in name else f"unknown model {name!r}"
        return (
            f"{what}: not an embedded model ({', '.join(EMBEDDED)}){_suggest(name, EMBEDDED)}, "
            "not a local folder, and not in the local Hugging Face cache while the hub is unreachable (offline)"
        )
    try:
        from huggingface_hub import model_info

        model_info(name)
        return None
    except Exception as e:  # noqa: BLE001
        return f"unknown model {name!r}: the hub says {type(e).__name__}; embedded models: {', '.join(EMBEDDED)}"


def _as_list(v, what: str, errors: list[str]) -> list:
    if v is None:
        return []
    if isinstance(v, (str, dict)):
        return [v]
    if isinstance(v, list):
        return v
    errors.append(f"{what} must be a list")
    return []


def _dataset_spec(d, errors: list[str]) -> DatasetSpec | None:
    if isinstance(d, str):
        d = {"id": d, "source": d}
    if not isinstance(d, dict):
        errors.append(f"a dataset must be a name or a mapping, got {_short(d)}")
        return None
    _text(d.get("id"), "a dataset's id", errors)
    d = dict(d)
    source = d.pop("source", None) or d.get("id")
    ident = str(d.pop("id", None) or source)
    limit = d.pop("limit", None)
    if source not in DATASET_SOURCES:
        errors.append(
            f"unknown dataset {source!r}{_suggest(source, DATASET_SOURCES)}; valid datasets: "
            f"{', '.join(DATASET_SOURCES)} (file: a CSV/JSONL with path; hf: a Hugging Face dataset)"
        )
        return None
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        errors.append(f"dataset {ident!r}: limit must be a non-negative integer")
    allowed = {"sample", "sample_seed", "min_tokens", "abs_saliency"} | {
        "pang_lee": set(),
        "agreement": {"per_phenomenon", "seed", "phenomena"},
        "file": {"path", "text_field", "label_field", "text_pair_field"},
        "hf": {"path", "name", "split", "text_field", "text_pair_field", "label_field", "label_reduce"},
        "blimp": {"subsets", "split", "per_subset"},
        "linzen_goldberg": {"path"},
    }[source]
    unknown = sorted(set(d) - allowed)
    if unknown:
        errors.append(
            f"dataset {ident!r} ({source}): unknown option(s) {', '.join(unknown)}; "
            f"valid: limit, {', '.join(sorted(allowed))}"
        )
    if "abs_saliency" in d and not isinstance(d["abs_saliency"], bool):
        errors.append(f"dataset {ident!r}: abs_saliency must be true or false")
    if source in ("file", "linzen_goldberg"):
        if not d.get("path"):
            errors.append(f"dataset {ident!r} ({source}) needs a path")
        elif not Path(os.path.expanduser(str(d["path"]))).is_file():
            errors.append(f"dataset {ident!r}: no such file {d['path']!r}")
    if source == "agreement":
        from ctxmix.benchmark.agreement import PHENOMENA

        bad = [p for p in d.get("phenomena") or [] if p not in PHENOMENA]
        if bad:
            errors.append(f"dataset {ident!r}: unknown phenomenon {', '.join(bad)}; valid: {', '.join(PHENOMENA)}")
    if source == "hf":
        for k in ("path", "split", "text_field"):
            if not d.get(k):
                errors.append(f"dataset {ident!r} (hf) needs {k}")
    if source == "blimp":
        bad = [s for s in d.get("subsets") or [] if s not in BLIMP_CUES]
        if bad or not d.get("subsets"):
            errors.append(
                f"dataset {ident!r} (blimp) needs subsets among {', '.join(BLIMP_CUES)}"
                + (f"; unknown: {', '.join(bad)}" if bad else "")
            )
    return DatasetSpec(id=ident, source=source, options=d, limit=limit)


def _check_hub_datasets(specs: list[DatasetSpec], errors: list[str]) -> None:
    hub = [s for s in specs if s.source in ("hf", "blimp")]
    if not hub:
        return
    try:
        import datasets  # noqa: F401
    except ImportError:
        errors.append(
            f"dataset(s) {', '.join(s.id for s in hub)} come from the Hugging Face hub and need the "
            "'datasets' package (pip install datasets) and network access"
        )
        return
    if os.environ.get("HF_DATASETS_OFFLINE", "").strip() in ("1", "true", "yes"):
        return  # served from the local datasets cache, if it has them
    if _offline() or not _hub_reachable():
        errors.append(
            f"dataset(s) {', '.join(s.id for s in hub)} need the Hugging Face hub, which is unreachable "
            "(offline). Offline datasets: pang_lee, agreement, file (your CSV/JSONL)"
        )


CONFIG_MAX_STRING = 4096  # any one string: hub ids and paths are far shorter; longer is a mistake or an attack


CONFIG_MAX_DESCRIPTION = 2000  # description: a paragraph of prose, stored with every run


CONFIG_MAX_NAME_BYTES = 128  # name: it names results/<name>.sqlite and results/<name>/ (file names stop at 255 bytes)


CONFIG_MAX_ITEMS = 1000  # items of one list or mapping; the largest shipped one (attcat's paper.values) has 48


CONFIG_MAX_VALUES = 50_000  # values in a whole config (shipped: at most ~730); bounds the walk to milliseconds


CONFIG_MAX_DEPTH = 20  # nesting; shipped configs nest 4 deep


_MAX_REPORTED = 5  # size problems listed before the walk gives up


_STRING_BOUNDS = {"description": CONFIG_MAX_DESCRIPTION}  # tighter bounds than CONFIG_MAX_STRING, by path


_TIGHTEST_STRING_BOUND = min(CONFIG_MAX_STRING, *_STRING_BOUNDS.values())


def _child_path(path: str, key) -> str:
    """`path` then `key`, as in paper.values[3].row; key None is `path` itself."""
    if key is None:
        return path
    if isinstance(key, int):
        return f"{path}[{key}]"
    text = str(key) if isinstance(key, str) else repr(key)
    text = text if len(text) <= 40 else text[:40] + "..."
    return f"{path}.{text}" if path else text


def _size_problems(raw) -> list[str]:
    """What makes `raw` too big to check, store or print: over-long strings, over-full lists or mappings,
    too many values in all, too deep, or a list or mapping inside itself.

    Iterative, and it stops after CONFIG_MAX_VALUES values or _MAX_REPORTED problems: a Python structure
    that shares one list many times (what an alias bomb builds) or contains itself costs milliseconds,
    where json.dumps or a message quoting it would walk gigabytes or never end. A value's path is
    formatted only for a list, a mapping or a problem, not for every string."""
    problems: list[str] = []
    # value, its parent's path, its key there (a dict key itself: key None, path ending " (a key)"), depth, ids above
    stack: list[tuple[object, str, object, int, tuple[int, ...]]] = [(raw, "", None, 1, ())]
    seen = 0
    while stack and len(problems) < _MAX_REPORTED:
        value, parent, key, depth, above = stack.pop()
        seen += 1
        if seen > CONFIG_MAX_VALUES:
            problems.append(
                f"the config holds more than {CONFIG_MAX_VALUES} values (lists or mappings repeated by reference?)"
            )
            break
        if isinstance(value, (str, bytes)):
            if len(value) <= _TIGHTEST_STRING_BOUND:
                continue
            path = _child_path(parent, key)
            bound = _STRING_BOUNDS.get(path, CONFIG_MAX_STRING)
            if len(value) > bound:
                problems.append(f"{path or 'the config'} is {len(value)} characters long; at most {bound}")
            continue
        if not isinstance(value, (dict, list, tuple, set, frozenset)):
            continue
        path = _child_path(parent, key)
        where = path or "the config"
        if id(value) in above:
            problems.append(f"{where} contains itself")
        elif depth > CONFIG_MAX_DEPTH:
            problems.append(f"{where} is nested more than {CONFIG_MAX_DEPTH} levels deep")
        elif len(value) > CONFIG_MAX_ITEMS:
            problems.append(
                f"{where} has {len(value)} items; a config list or mapping may have at most {CONFIG_MAX_ITEMS}"
            )
        else:
            below = (*above, id(value))
            if isinstance(value, dict):
                for k, v in reversed(list(value.items())):
                    stack.append((v, path, k, depth + 1, below))
                    stack.append((k, f"{_child_path(path, k)} (a key)", None, depth + 1, below))
            else:
                stack.extend((v, path, i, depth + 1, below) for i, v in reversed(list(enumerate(value))))
    return problems


def _text(value, what: str, errors: list[str]) -> None:
    """Free text (a name, a label, an id, a source), where given, must be a string: str() of a list or
    mapping would quietly turn it into a name nobody wrote."""
    if value is not None and not isinstance(value, str):
        errors.append(f"{what} must be text, got {type(value).__name__} {_short(value)}")


def _short(value) -> str:
    """repr of a value, cut short for a message (the value is known to be small: _size_problems passed)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def _check_description(value, errors: list[str]) -> None:
    """A description is prose (its length is bounded by _size_problems); a list or mapping is a mistake."""
    if value is not None and not isinstance(value, str):
        errors.append(f"description must be text (a string), got {type(value).__name__} {_short(value)}")


def _check_paper(paper, errors: list[str]) -> dict:
    """The paper's numbers, compared with the run's in the report: a mapping with a source (text) and a list of
    value mappings whose mean and std are numbers, so that the report after a run cannot fail on them."""
    if not paper:
        return {}
    if not isinstance(paper, dict) or not isinstance(paper.get("values", []), list):
        errors.append("paper must be a mapping with a list of values")
        return {}
    _text(paper.get("source"), "paper.source", errors)
    for i, v in enumerate(paper.get("values") or []):
        if not isinstance(v, dict):
            errors.append(f"paper.values[{i}] must be a mapping (model, dataset, method, metric, mean, ...)")
            continue
        for k in ("mean", "std"):
            if v.get(k) is not None and (isinstance(v[k], bool) or not isinstance(v[k], (int, float))):
                errors.append(f"paper.values[{i}].{k} must be a number, got {_short(v[k])}")
    return paper


def _invalid(errors: list[str], source: str) -> BadInput:
    where = f" {source}" if source else ""
    return BadInput(f"invalid benchmark config{where}:\n  - " + "\n  - ".join(errors))


def validate_config(raw: dict, *, limit: int | None = None, check_models: bool = True, source: str = "") -> Plan:
    """Check a whole config and return the Plan; raise BadInput listing every problem found.

    Sizes are checked first, on any dict (YAML or not): a config too big to walk is refused with its size
    problems alone, since the other checks quote and walk its values."""
    if not isinstance(raw, dict):
        raise BadInput("a benchmark config must be a YAML mapping")
    errors: list[str] = _size_problems(raw)
    if errors:
        raise _invalid(errors, source)
    from ctxmix.benchmark.metrics import get_metric, metric_names

    known = {
        "name",
        "description",
        "kind",
        "models",
        "datasets",
        "runs",
        "methods",
        "metrics",
        "target",
        "explain",
        "options",
        "paper",
        "batch_size",
        "min_tokens",
        "seed",
        "mask_rate",
        "lower_triangle",
        "device",
        "dtype",
        "threads",
        "gpus_per_task",
        "example_batch",
        "token_type_ids",
        "deletion_stop_one_short",
        "raw_attention_keep_self",
        "contrastive",
    }
    unknown = sorted(map(str, set(raw) - known))
    if unknown:
        errors.append(f"unknown config key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(known))}")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip() or not all(c.isalnum() or c in "-_." for c in name):
        errors.append("the config needs a name (letters, digits, - _ .): it names the run and its results")
        name = "unnamed"
    elif len(name.encode("utf-8")) > CONFIG_MAX_NAME_BYTES:
        errors.append(
            f"the config name is {len(name.encode('utf-8'))} bytes long; at most {CONFIG_MAX_NAME_BYTES} "
            "(it names the results file and folder)"
        )
    _check_description(raw.get("description"), errors)
    kind = raw.get("kind", "methods")
    if kind not in CONFIG_KINDS:
        errors.append(f"unknown kind {kind!r}; valid kinds: {', '.join(CONFIG_KINDS)}")

    models: list[ModelSpec] = []
    for m in _as_list(raw.get("models"), "models", errors):
        if isinstance(m, str):
            m = {"name": m}
        if not isinstance(m, dict) or not m.get("name"):
            errors.append(f"a model must be a name or a mapping with a name, got {_short(m)}")
            continue
        _text(m["name"], "a model's name", errors)
        _text(m.get("label"), f"model {_short(m['name'])}: label", errors)
        spec = ModelSpec(
            label=str(m.get("label") or m["name"]),
            name=str(m["name"]),
            device=str(m.get("device", raw.get("device", "auto"))),
            dtype=str(m.get("dtype", raw.get("dtype", "float32"))),
        )
        if check_models:
            why = check_model_name(spec.name)
            if why:
                errors.append(why)
        models.append(spec)
    if not models:
        errors.append("the config names no models")
    if len({m.label for m in models}) != len(models):
        errors.append("two models share a label; give each a distinct label")

    datasets = [s for s in (_dataset_spec(d, errors) for d in _as_list(raw.get("datasets"), "datasets", errors)) if s]
    if not datasets and not any("unknown dataset" in e for e in errors):
        errors.append("the config names no datasets")
    if len({d.id for d in datasets}) != len(datasets):
        errors.append("two datasets share an id; give each a distinct id")
    if limit is not None:
        for d in datasets:
            d.limit = limit if d.limit is None else min(d.limit, limit)

    labels, ids = {m.label for m in models}, {d.id for d in datasets}
    runs: list[tuple[str, str]] = []
    if raw.get("runs") is None:
        runs = [(m.label, d.id) for m in models for d in datasets]
    else:
        for r in _as_list(raw.get("runs"), "runs", errors):
            if not isinstance(r, dict) or set(r) != {"model", "dataset"}:
                errors.append(f"each run must be a mapping with model and dataset, got {_short(r)}")
                continue
            if not isinstance(r["model"], str) or not isinstance(r["dataset"], str):
                errors.append(f"a run names its model and dataset by label and id (text), got {_short(r)}")
                continue
            if r["model"] not in labels:
                errors.append(
                    f"run names model {r['model']!r}, which is not among the models ({', '.join(sorted(labels))})"
                )
            if r["dataset"] not in ids:
                errors.append(
                    f"run names dataset {r['dataset']!r}, which is not among the datasets ({', '.join(sorted(ids))})"
                )
            runs.append((str(r["model"]), str(r["dataset"])))

    methods = [str(x) for x in _as_list(raw.get("methods", ["all"]), "methods", errors)]
    if kind == "contextualization_change":
        from ctxmix.analyses.corpus import POST_COMPARISONS, PRE_COMPARISONS

        valid = list(dict.fromkeys(list(POST_COMPARISONS) + list(PRE_COMPARISONS)))
        bad = [m for m in methods if m not in valid and m != "all"]
        if bad:
            errors.append(
                f"unknown comparison(s) {', '.join(map(repr, bad))}; a contextualization_change config "
                f"takes comparisons: {', '.join(valid)}"
            )
    else:
        valid = _all_method_names()
        bad = [m for m in methods if m not in valid and m != "all"]
        for b in bad:
            errors.append(f"unknown method {b!r}{_suggest(b, valid)}; valid methods: all, {', '.join(valid)}")
    if not methods:
        errors.append("the config names no methods")

    metrics: list[str] = []
    for spec in _as_list(raw.get("metrics", []), "metrics", errors):
        if isinstance(spec, dict):
            ref = spec.get("reference")
            if spec.get("name") != "spearman" or not ref:
                errors.append(f"a metric mapping must be {{name: spearman, reference: METHOD}}, got {spec!r}")
                continue
            spec = f"spearman:{'|' + ref + '|' if spec.get('absolute') else ref}" + (
                "/nopos" if spec.get("exclude_position") else ""
            )
        spec = str(spec)
        if spec == "agreement":
            continue  # agreement between methods and models is always computed from the stored saliency
        try:
            met = get_metric(spec)
        except BadInput:
            errors.append(
                f"unknown metric {spec!r}{_suggest(spec, metric_names())}; valid metrics: "
                f"{', '.join(metric_names())}, agreement"
            )
            continue
        if met.reference and met.reference not in _all_method_names():
            errors.append(
                f"metric {spec!r}: unknown reference method {met.reference!r}"
                f"{_suggest(met.reference, _all_method_names())}"
            )
        if kind == "contextualization_change" and met.name != "change":
            errors.append(f"a contextualization_change config takes the metric 'change' only, not {spec!r}")
        if kind == "methods" and met.name == "change":
            errors.append("the metric 'change' belongs to kind: contextualization_change")
        metrics.append(met.name)
    if kind == "contextualization_change" and not metrics:
        metrics = ["change"]

    target = raw.get("target", "predicted")
    if target not in TARGETS:
        errors.append(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    explain_opts = dict(raw.get("explain") or {})
    for k, v in explain_opts.items():
        if k not in EXPLAIN_OPTIONS:
            errors.append(f"unknown explain option {k!r}; valid: {', '.join(EXPLAIN_OPTIONS)}")
        elif EXPLAIN_OPTIONS[k] is int:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                errors.append(f"explain.{k} must be a positive integer")
        elif v not in EXPLAIN_OPTIONS[k]:
            errors.append(f"explain.{k} must be one of {', '.join(map(str, EXPLAIN_OPTIONS[k]))}")
    options = {
        "batch_size": raw.get("batch_size", 32),
        "min_tokens": raw.get("min_tokens", 0),
        "seed": raw.get("seed", 0),
        "mask_rate": raw.get("mask_rate", 0.0),
        "lower_triangle": bool(raw.get("lower_triangle", False)),
        "threads": raw.get("threads"),
        "gpus_per_task": raw.get("gpus_per_task"),
        "example_batch": raw.get("example_batch", EXAMPLE_BATCH),
        "token_type_ids": raw.get("token_type_ids", True),
        "deletion_stop_one_short": raw.get("deletion_stop_one_short", False),
        "raw_attention_keep_self": raw.get("raw_attention_keep_self", False),
        # agreement data on a language model: every method explains target minus foil (the ALTI-Logit
        # paper's setting); off, only the deletion metrics' probabilities use the foil
        "contrastive": raw.get("contrastive", False),
    }
    for k in ("deletion_stop_one_short", "raw_attention_keep_self", "contrastive"):
        if not isinstance(options[k], bool):
            errors.append(f"{k} must be true or false")
    if not isinstance(options["token_type_ids"], bool):
        errors.append(
            "token_type_ids must be true (sentence pairs reach the model with their token types, the "
            "default) or false (pairs run without them, as the AttCAT code does)"
        )
    if options["threads"] is not None and (
        isinstance(options["threads"], bool) or not isinstance(options["threads"], int) or options["threads"] < 1
    ):
        errors.append("threads must be a positive integer")
    share = options["gpus_per_task"]
    if share is not None and (
        isinstance(share, bool)
        or not isinstance(share, (int, float))
        or not (0 < share <= 1 or float(share).is_integer() and share > 1)
    ):
        errors.append("gpus_per_task must be a share of one GPU in (0, 1] or a whole number of GPUs")
    for k in ("batch_size", "min_tokens", "seed"):
        if isinstance(options[k], bool) or not isinstance(options[k], int) or options[k] < 0:
            errors.append(f"{k} must be a non-negative integer")
    eb = options["example_batch"]
    if isinstance(eb, bool) or not isinstance(eb, int) or not 1 <= eb <= 1024:
        errors.append("example_batch must be a whole number from 1 to 1024 (examples per engine batch)")
    if not isinstance(options["mask_rate"], (int, float)) or not 0 <= options["mask_rate"] < 1:
        errors.append("mask_rate must be a number in [0, 1)")
    paper = _check_paper(raw.get("paper"), errors)
    _check_hub_datasets(datasets, errors)
    if errors:
        raise _invalid(errors, source)
    return Plan(
        name=name,
        kind=kind,
        models=models,
        datasets=datasets,
        runs=runs,
        methods=methods,
        metrics=metrics,
        target=target,
        explain=explain_opts,
        options=options,
        paper=paper,
        raw=raw,
        source=source,
    )


CONFIG_MAX_BYTES = 1 << 20  # a benchmark config is a page of YAML


def _yaml_limits(text: str, where: str) -> None:
    """Refuse YAML anchors and aliases, and nesting deeper than CONFIG_MAX_DEPTH, from the parser's events,
    before anything is built.

    An alias repeats a value by reference: nine of them nested nine deep make 9**9 strings of a 1 kB file,
    which validation, json.dumps and the results store would each walk. No shipped config uses one, and a
    config is short enough to write out in full."""
    import yaml

    depth = 0
    for ev in yaml.parse(text, Loader=yaml.SafeLoader):
        anchor = getattr(ev, "anchor", None)  # AliasEvent: the name it refers to; a node's start: its own
        if isinstance(ev, yaml.AliasEvent) or anchor:
            mark = f"*{anchor}" if isinstance(ev, yaml.AliasEvent) else f"&{anchor}"
            mark = mark if len(mark) <= 40 else mark[:40] + "..."
            line = ev.start_mark.line + 1 if ev.start_mark else "?"
            raise BadInput(
                f"{where}, line {line}: YAML anchors and aliases are not accepted in a benchmark config, found "
                f"{mark} (they repeat values by reference, which can blow a small file up to gigabytes); "
                "write the value out in full"
            )
        if isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > CONFIG_MAX_DEPTH:
                raise BadInput(
                    f"{where}, line {ev.start_mark.line + 1}: nested more than {CONFIG_MAX_DEPTH} levels deep"
                )
        elif isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def load_config(path: str | os.PathLike, *, limit: int | None = None, check_models: bool = True) -> Plan:
    """Read and validate a YAML config: size, anchors and depth checked before it is built; then
    `validate_config`, the checks every config gets (`bench --check` and a run both come here)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise BadInput(f"no such config file: {str(p)!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise BadInput(f"--limit must be a whole number of at least 1, got {limit!r}")
    if p.stat().st_size > CONFIG_MAX_BYTES:
        raise BadInput(f"{p}: {p.stat().st_size} bytes; a config may have at most {CONFIG_MAX_BYTES}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"{p}: not UTF-8 text") from None
    try:
        _yaml_limits(text, str(p))
        raw = yaml.safe_load(text)
    except BadInput:
        raise
    except yaml.YAMLError as e:
        raise BadInput(f"{p}: not valid YAML: {e}") from None
    except ValueError as e:  # parsed, but Python cannot build it: a 5,000-digit integer, a 13th month
        raise BadInput(f"{p}: a value YAML cannot build: {str(e).split(';')[0]}") from None
    return validate_config(raw, limit=limit, check_models=check_models, source=str(p))
