"""The benchmark runner: models x methods x datasets x metrics, resumable, in SQLite.

    python -m ctxmix bench --config configs/embedded.yaml            # offline, a few minutes
    python -m ctxmix bench --config configs/alti-table2.yaml --executor ray
    python -m ctxmix bench --config configs/embedded.yaml --report   # tables from the store only

A config (YAML) names models, datasets, methods and metrics (see ``configs/`` and
`validate_config`). The whole config is checked before any work starts: an unknown model,
method, metric or dataset stops the run with a message that lists the valid names.

Work is split into *units*, one per (run, model, dataset, example, method). The methods of
one example are computed together (one `ctxmix.explain` call, every perturbed input of every
method in one batched prediction call), and each unit is then committed to the results store
in its own transaction. Killed and restarted, the runner reads which units are finished and
computes only the others; a method added to the config later costs only that method.
Reference saliencies (for ``spearman:REF``) are stored with the units and reused.

Results store (SQLite, stdlib ``sqlite3``, WAL journal):

- ``runs``: run id, name, config JSON, its hash, ctxmix version.
- ``units``: one row per finished unit: status ``done``, ``na`` (the method does not apply
  to the model, e.g. gradients on an encoder without a head) or ``skipped`` (the example was
  filtered for this model: too few tokens, target not one token...), model revision, seconds.
- ``scores``: one row per run x model x dataset x example x method x metric x layer
  (layer -1 = the whole model; 1..L for per-layer metrics), with the model name, its
  revision/fingerprint and the ctxmix version; the run's config JSON is in ``runs``
  (view ``scores_with_config`` joins it).
- ``saliency``: every saliency vector with its tokens (role ``method`` or ``reference``), from
  which agreement between methods and between models is computed.
- ``skips``: examples skipped and why (empty text rows are counted here, model ``*``).
- ``aggregates``: mean, std (population), n and NaN count per run x model x dataset x method
  x metric x layer, plus ``agree:<method>`` (mean Spearman between two methods' saliency) and
  ``model_agree:<model>`` (the same method on two models with the same tokens).
- ``computations``: an append-only log of every unit computed (pid, time): a unit appears
  there once unless a run was killed before its commit.

Executors: ``local`` (this process) and ``ray`` (each example a Ray task; each worker
process loads a model once and keeps it; the driver alone writes to SQLite). Ray is an
optional dependency (requirements-dev.txt): ``pip install ray==2.60.0``.

Derived methods (computed here from ctxmix's maps, for the paper tables; not in
`ctxmix.METHODS`): ``random`` (uniform scores, seeded per example), ``raw_attention``
(AttCAT's RawAtt: last-layer head-mean attention, explained row, own entry zeroed),
``norm_rollout`` (ALTI's Norm Rollout: N_ResLN row-normalised per layer, rolled out),
``norm_fixed_res`` (GlobEnc's N_FixedRes: 0.5 rownorm(N) + 0.5 I, rolled out) and
``blank_out_foil`` (value zeroing's blank-out: drop of sigma(l_target - l_foil) when a token
is replaced by [UNK]; agreement data on language models).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import signal
import sqlite3
import sys
import time
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .errors import BadInput, CtxmixError

CONFIG_KINDS = ("methods", "contextualization_change")
DATASET_SOURCES = ("pang_lee", "agreement", "file", "hf", "blimp", "linzen_goldberg")
TARGETS = ("predicted", "gold")
EXPLAIN_OPTIONS = {"ig_baseline": ("pad", "mask", "unk", "zero"), "ig_steps": int, "blank_replacement": ("unk", "mask"),
                   "cat_mask_special": (True, False), "grad_at": ("word", "embedding_output")}
DONE_STATUSES = ("done", "na", "skipped")
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


def _all_method_names() -> list[str]:
    from . import METHODS

    return list(METHODS) + list(DERIVED_METHODS)


# =============================================================================================
# configuration
# =============================================================================================


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
        opts = {k: v for k, v in self.options.items() if k not in ("batch_size", "threads", "example_batch")}
        if opts.get("token_type_ids", True) is True:  # the default keeps the hashes of configs made before it
            opts.pop("token_type_ids", None)
        for k in ("deletion_stop_one_short", "raw_attention_keep_self"):  # the same: only a change is hashed
            if opts.get(k) is False:
                opts.pop(k)
        keep = {"kind": self.kind, "metrics": sorted(self.metrics), "target": self.target, "explain": self.explain,
                "options": opts}
        return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _suggest(name: str, valid: Iterable[str]) -> str:
    import difflib

    close = difflib.get_close_matches(str(name), list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _hub_reachable(timeout: float = 3.0) -> bool:
    from .hub import hub_reachable

    return hub_reachable(timeout)


def _offline() -> bool:
    from .hub import offline

    return offline()


def check_model_name(name: str) -> str | None:
    """None when `name` can be loaded (embedded, a local folder, or a hub id the hub or the
    local cache knows); otherwise the reason. Reads at most a config.json."""
    from .models import EMBEDDED

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
        return (f"{what}: not an embedded model ({', '.join(EMBEDDED)}){_suggest(name, EMBEDDED)}, "
                "not a local folder, and not in the local Hugging Face cache while the hub is unreachable (offline)")
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
        errors.append(f"a dataset must be a name or a mapping, got {d!r}")
        return None
    d = dict(d)
    source = d.pop("source", None) or d.get("id")
    ident = str(d.pop("id", None) or source)
    limit = d.pop("limit", None)
    if source not in DATASET_SOURCES:
        errors.append(f"unknown dataset {source!r}{_suggest(source, DATASET_SOURCES)}; valid datasets: "
                      f"{', '.join(DATASET_SOURCES)} (file: a CSV/JSONL with path; hf: a Hugging Face dataset)")
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
        errors.append(f"dataset {ident!r} ({source}): unknown option(s) {', '.join(unknown)}; "
                      f"valid: limit, {', '.join(sorted(allowed))}")
    if "abs_saliency" in d and not isinstance(d["abs_saliency"], bool):
        errors.append(f"dataset {ident!r}: abs_saliency must be true or false")
    if source in ("file", "linzen_goldberg"):
        if not d.get("path"):
            errors.append(f"dataset {ident!r} ({source}) needs a path")
        elif not Path(os.path.expanduser(str(d["path"]))).is_file():
            errors.append(f"dataset {ident!r}: no such file {d['path']!r}")
    if source == "agreement":
        from .agreement import PHENOMENA

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
            errors.append(f"dataset {ident!r} (blimp) needs subsets among {', '.join(BLIMP_CUES)}"
                          + (f"; unknown: {', '.join(bad)}" if bad else ""))
    return DatasetSpec(id=ident, source=source, options=d, limit=limit)


def _check_hub_datasets(specs: list[DatasetSpec], errors: list[str]) -> None:
    hub = [s for s in specs if s.source in ("hf", "blimp")]
    if not hub:
        return
    try:
        import datasets  # noqa: F401
    except ImportError:
        errors.append(f"dataset(s) {', '.join(s.id for s in hub)} come from the Hugging Face hub and need the "
                      "'datasets' package (pip install datasets) and network access")
        return
    if os.environ.get("HF_DATASETS_OFFLINE", "").strip() in ("1", "true", "yes"):
        return  # served from the local datasets cache, if it has them
    if _offline() or not _hub_reachable():
        errors.append(f"dataset(s) {', '.join(s.id for s in hub)} need the Hugging Face hub, which is unreachable "
                      "(offline). Offline datasets: pang_lee, agreement, file (your CSV/JSONL)")


def validate_config(raw: dict, *, limit: int | None = None, check_models: bool = True, source: str = "") -> Plan:
    """Check a whole config and return the Plan; raise BadInput listing every problem found."""
    from . import METHODS
    from .metrics import get_metric, metric_names

    if not isinstance(raw, dict):
        raise BadInput("a benchmark config must be a YAML mapping")
    errors: list[str] = []
    known = {"name", "description", "kind", "models", "datasets", "runs", "methods", "metrics", "target",
             "explain", "options", "paper", "batch_size", "min_tokens", "seed", "mask_rate", "lower_triangle",
             "device", "dtype", "threads", "example_batch", "token_type_ids", "deletion_stop_one_short",
             "raw_attention_keep_self"}
    unknown = sorted(set(raw) - known)
    if unknown:
        errors.append(f"unknown config key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(known))}")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip() or not all(c.isalnum() or c in "-_." for c in name):
        errors.append("the config needs a name (letters, digits, - _ .): it names the run and its results")
        name = "unnamed"
    kind = raw.get("kind", "methods")
    if kind not in CONFIG_KINDS:
        errors.append(f"unknown kind {kind!r}; valid kinds: {', '.join(CONFIG_KINDS)}")

    models: list[ModelSpec] = []
    for m in _as_list(raw.get("models"), "models", errors):
        if isinstance(m, str):
            m = {"name": m}
        if not isinstance(m, dict) or not m.get("name"):
            errors.append(f"a model must be a name or a mapping with a name, got {m!r}")
            continue
        spec = ModelSpec(label=str(m.get("label") or m["name"]), name=str(m["name"]),
                         device=str(m.get("device", raw.get("device", "auto"))), dtype=str(m.get("dtype", raw.get("dtype", "float32"))))
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
                errors.append(f"each run must be a mapping with model and dataset, got {r!r}")
                continue
            if r["model"] not in labels:
                errors.append(f"run names model {r['model']!r}, which is not among the models ({', '.join(sorted(labels))})")
            if r["dataset"] not in ids:
                errors.append(f"run names dataset {r['dataset']!r}, which is not among the datasets ({', '.join(sorted(ids))})")
            runs.append((str(r["model"]), str(r["dataset"])))

    methods = [str(x) for x in _as_list(raw.get("methods", ["all"]), "methods", errors)]
    if kind == "contextualization_change":
        from .analysis import POST_COMPARISONS, PRE_COMPARISONS

        valid = list(dict.fromkeys(list(POST_COMPARISONS) + list(PRE_COMPARISONS)))
        bad = [m for m in methods if m not in valid and m != "all"]
        if bad:
            errors.append(f"unknown comparison(s) {', '.join(map(repr, bad))}; a contextualization_change config "
                          f"takes comparisons: {', '.join(valid)}")
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
            spec = f"spearman:{'|' + ref + '|' if spec.get('absolute') else ref}" + ("/nopos" if spec.get("exclude_position") else "")
        spec = str(spec)
        if spec == "agreement":
            continue  # agreement between methods and models is always computed from the stored saliency
        try:
            met = get_metric(spec)
        except BadInput:
            errors.append(f"unknown metric {spec!r}{_suggest(spec, metric_names())}; valid metrics: "
                          f"{', '.join(metric_names())}, agreement")
            continue
        if met.reference and met.reference not in _all_method_names():
            errors.append(f"metric {spec!r}: unknown reference method {met.reference!r}{_suggest(met.reference, _all_method_names())}")
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
    options = {"batch_size": raw.get("batch_size", 32), "min_tokens": raw.get("min_tokens", 0),
               "seed": raw.get("seed", 0), "mask_rate": raw.get("mask_rate", 0.0),
               "lower_triangle": bool(raw.get("lower_triangle", False)), "threads": raw.get("threads"),
               "example_batch": raw.get("example_batch", EXAMPLE_BATCH),
               "token_type_ids": raw.get("token_type_ids", True),
               "deletion_stop_one_short": raw.get("deletion_stop_one_short", False),
               "raw_attention_keep_self": raw.get("raw_attention_keep_self", False)}
    for k in ("deletion_stop_one_short", "raw_attention_keep_self"):
        if not isinstance(options[k], bool):
            errors.append(f"{k} must be true or false")
    if not isinstance(options["token_type_ids"], bool):
        errors.append("token_type_ids must be true (sentence pairs reach the model with their token types, the "
                      "default) or false (pairs run without them, as the AttCAT code does)")
    if options["threads"] is not None and (isinstance(options["threads"], bool) or not isinstance(options["threads"], int)
                                           or options["threads"] < 1):
        errors.append("threads must be a positive integer")
    for k in ("batch_size", "min_tokens", "seed"):
        if isinstance(options[k], bool) or not isinstance(options[k], int) or options[k] < 0:
            errors.append(f"{k} must be a non-negative integer")
    eb = options["example_batch"]
    if isinstance(eb, bool) or not isinstance(eb, int) or not 1 <= eb <= 1024:
        errors.append("example_batch must be a whole number from 1 to 1024 (examples per engine batch)")
    if not isinstance(options["mask_rate"], (int, float)) or not 0 <= options["mask_rate"] < 1:
        errors.append("mask_rate must be a number in [0, 1)")
    paper = raw.get("paper") or {}
    if not isinstance(paper, dict) or not isinstance(paper.get("values", []), list):
        errors.append("paper must be a mapping with a list of values")
        paper = {}
    _check_hub_datasets(datasets, errors)
    if errors:
        where = f" {source}" if source else ""
        raise BadInput(f"invalid benchmark config{where}:\n  - " + "\n  - ".join(errors))
    return Plan(name=name, kind=kind, models=models, datasets=datasets, runs=runs, methods=methods, metrics=metrics,
                target=target, explain=explain_opts, options=options, paper=paper, raw=raw, source=source)


CONFIG_MAX_BYTES = 1 << 20  # a benchmark config is a page of YAML
CONFIG_MAX_ALIASES = 100  # YAML aliases expand by reference; nested ones blow up whatever walks the tree
CONFIG_MAX_DEPTH = 20


def _yaml_limits(text: str, where: str) -> None:
    """Refuse YAML that would be expensive to walk: many aliases (an alias bomb) or deep nesting."""
    import yaml

    aliases, depth, deepest = 0, 0, 0
    for ev in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(ev, yaml.AliasEvent):
            aliases += 1
        elif isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            deepest = max(deepest, depth)
        elif isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
        if aliases > CONFIG_MAX_ALIASES:
            raise BadInput(f"{where}: more than {CONFIG_MAX_ALIASES} YAML aliases; write the config out in full")
        if deepest > CONFIG_MAX_DEPTH:
            raise BadInput(f"{where}: nested more than {CONFIG_MAX_DEPTH} levels deep")


def load_config(path: str | os.PathLike, *, limit: int | None = None, check_models: bool = True) -> Plan:
    """Read and validate a YAML config: size, aliases and depth checked before it is built."""
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
        _yaml_limits(text, str(p))
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise BadInput(f"{p}: not valid YAML: {e}") from None
    except UnicodeDecodeError:
        raise BadInput(f"{p}: not UTF-8 text") from None
    return validate_config(raw, limit=limit, check_models=check_models, source=str(p))


# =============================================================================================
# datasets
# =============================================================================================


@dataclass
class Example:
    id: str
    text: str
    label: int | None = None
    label_name: str | None = None
    text_pair: str | None = None
    item: dict | None = None  # an AgreementItem as a dict (agreement-style data)


BLIMP_CUES = {  # BLiMP subset -> (value zeroing UID, cue rule)
    "anaphor_number_agreement": ("ana", "subject"),
    "determiner_noun_agreement_2": ("dna", "next"),
    "determiner_noun_agreement_with_adj_2": ("dnaa", "next2"),
    "distractor_agreement_relational_noun": ("darn", "subject"),
    "regular_plural_subject_verb_agreement_1": ("rpsv", "subject"),
}
_CONTRACTIONS = {"wouldn't": "would not", "couldn't": "could not", "shouldn't": "should not", "won't": "will not",
                 "can't": "cannot", "don't": "do not", "doesn't": "does not", "didn't": "did not",
                 "isn't": "is not", "aren't": "are not", "wasn't": "was not", "weren't": "were not",
                 "hasn't": "has not", "haven't": "have not", "hadn't": "had not"}
_DETERMINERS = {"the", "a", "an", "some", "many", "these", "those", "this", "that", "every", "all", "most", "few",
                "several", "no", "each"}


def _blimp_item(uid: str, subset: str, good: str, bad: str) -> "Any":
    """A BLiMP pair as an AgreementItem: target = the one differing word; cue by a rule (no
    parser: the subject head is the first word, or the second after a leading determiner;
    det-noun cues are the next (dna) or second next (dnaa) word)."""
    from .agreement import AgreementItem

    def words(s):
        for a, b in _CONTRACTIONS.items():
            s = s.replace(a, b).replace(a.capitalize(), b.capitalize())
        return s.replace(".", " .").replace(",", " ,").replace("?", " ?").split()

    g, b = words(good), words(bad)
    diff = [i for i, (x, y) in enumerate(zip(g, b)) if x != y]
    if len(g) != len(b) or len(diff) != 1:
        return None
    t = diff[0]
    rule = BLIMP_CUES[subset][1]
    cue = t + 1 if rule == "next" else t + 2 if rule == "next2" else (1 if g[0].lower() in _DETERMINERS else 0)
    if cue >= len(g) or cue == t:
        return None
    return AgreementItem(uid=uid, phenomenon=BLIMP_CUES[subset][0], words=tuple(g), target_index=t, target=g[t],
                         foil=b[t], cue_indices=(cue,), number="?")


def _label_of(value, reduce: str | None):
    if isinstance(value, dict) and "label" in value:
        value = value["label"]
    if isinstance(value, (list, tuple)):
        if reduce == "mode" and value:
            from collections import Counter

            return Counter(value).most_common(1)[0][0]
        return value[0] if value else None
    return value


def _dig(record: dict, path: str):
    v: Any = record
    for part in path.split("."):
        v = v[part] if isinstance(v, dict) else v
    return v


def _hf_examples(spec: DatasetSpec) -> tuple[list[Example], int]:
    import datasets

    o = spec.options
    try:
        data = datasets.load_dataset(o["path"], o.get("name"), split=o["split"])
    except Exception as e:  # noqa: BLE001
        raise BadInput(f"dataset {spec.id!r}: could not load {o['path']}/{o.get('name')} split {o['split']} from the "
                       f"Hugging Face hub ({type(e).__name__}: {e}); offline datasets: pang_lee, agreement, file") from None
    out, empty = [], 0
    for i, rec in enumerate(data):
        text = _dig(rec, o["text_field"])
        if isinstance(text, (list, tuple)):
            text = " ".join(map(str, text))
        pair = _dig(rec, o["text_pair_field"]) if o.get("text_pair_field") else None
        label = _label_of(_dig(rec, o["label_field"]), o.get("label_reduce")) if o.get("label_field") else None
        if not isinstance(text, str) or not text.strip():
            empty += 1
            continue
        if isinstance(label, int) and label < 0:
            label = None  # GLUE test splits hide their labels as -1
        out.append(Example(id=f"{i:06d}", text=text.strip(), label=label if isinstance(label, int) else None,
                           label_name=None if label is None else str(label), text_pair=pair))
    return out, empty


def _blimp_examples(spec: DatasetSpec) -> tuple[list[Example], int]:
    import datasets

    out, dropped = [], 0
    for subset in spec.options["subsets"]:
        try:
            data = datasets.load_dataset("blimp", subset, split=spec.options.get("split", "train"))
        except Exception as e:  # noqa: BLE001
            raise BadInput(f"dataset {spec.id!r}: could not load blimp/{subset} ({type(e).__name__}: {e})") from None
        n = spec.options.get("per_subset")
        for i, rec in enumerate(data):
            if n is not None and i >= n:
                break
            it = _blimp_item(f"{subset}-{i:04d}", subset, rec["sentence_good"], rec["sentence_bad"])
            if it is None:
                dropped += 1
                continue
            out.append(Example(id=it.uid, text=it.good, item=it.to_dict()))
    if dropped:
        warnings.warn(f"dataset {spec.id!r}: {dropped} BLiMP pair(s) do not differ in exactly one word; left out",
                      stacklevel=2)
    return out, 0


def _linzen_goldberg(spec: DatasetSpec) -> tuple[list[Example], int]:
    """lgd_dataset.tsv (Goldberg 2019): n_attractors, sentence, masked sentence (***mask***),
    correct verb, wrong verb. No cue positions (cue metrics are NA)."""
    from .agreement import AgreementItem

    out, empty = [], 0
    for i, line in enumerate(Path(os.path.expanduser(spec.options["path"])).read_text(encoding="utf-8").splitlines()):
        parts = line.rstrip("\n").split("\t")
        if len(parts) < 5 or "***mask***" not in parts[2]:
            empty += 1
            continue
        words = parts[2].split()
        t = words.index("***mask***")
        words[t] = parts[3]
        it = AgreementItem(uid=f"lgd-{i:06d}", phenomenon="sva", words=tuple(words), target_index=t, target=parts[3],
                           foil=parts[4], cue_indices=(), number="?", meta={"attractors": parts[0]})
        out.append(Example(id=it.uid, text=it.good, item=it.to_dict()))
    return out, empty


def load_examples(spec: DatasetSpec) -> tuple[list[Example], int]:
    """(examples, number of rows with empty text left out) of one dataset spec, limit applied."""
    from . import data

    o = spec.options
    empty = 0
    if spec.source == "pang_lee":
        items = data.pang_lee(None)
        neg = [i for i, x in enumerate(items) if x.label == 0]
        pos = [i for i, x in enumerate(items) if x.label != 0]
        order = [i for pair in zip(neg, pos) for i in pair] + neg[len(pos):] + pos[len(neg):]  # balanced prefixes
        exs = [Example(id=f"pl-{i:04d}", text=items[i].text, label=items[i].label, label_name=items[i].label_name)
               for i in order]
    elif spec.source == "agreement":
        from .agreement import agreement_items

        its = agreement_items(int(o.get("per_phenomenon", 50)), int(o.get("seed", 0)), o.get("phenomena"))
        by: dict[str, list] = {}
        for it in its:
            by.setdefault(it.phenomenon, []).append(it)
        rr = [x for tup in __import__("itertools").zip_longest(*by.values()) for x in tup if x is not None]
        exs = [Example(id=it.uid, text=it.good, item=it.to_dict()) for it in rr]  # phenomena interleaved
    elif spec.source == "file":
        import re

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if o.get("label_field", "label") is None and o.get("text_pair_field"):
                raise BadInput(f"dataset {spec.id!r}: a text_pair_field needs a label_field (pairs are read as "
                               "labelled rows)")
            if o.get("label_field", "label") is None:
                texts = data.read_texts(o["path"], field=o.get("text_field", "text"))
                exs = [Example(id=f"{i:06d}", text=t) for i, t in enumerate(texts)]
            else:
                rows = data.read_labelled(o["path"], o.get("text_field", "text"), o.get("label_field", "label"),
                                          pair_field=o.get("text_pair_field"))
                exs = [Example(id=f"{i:06d}", text=r.text, label=r.label, label_name=r.label_name,
                               text_pair=r.text_pair) for i, r in enumerate(rows)]
        for w in caught:  # ctxmix.data reports the empty records it skipped in a warning
            mm = re.search(r"skipped (\d+) empty record", str(w.message))
            if mm:
                empty += int(mm.group(1))
            else:
                warnings.warn(w.message, w.category, stacklevel=2)
    elif spec.source == "hf":
        exs, empty = _hf_examples(spec)
    elif spec.source == "blimp":
        exs, empty = _blimp_examples(spec)
    elif spec.source == "linzen_goldberg":
        exs, empty = _linzen_goldberg(spec)
    else:  # validated before
        raise BadInput(f"unknown dataset source {spec.source!r}")
    kept = [e for e in exs if isinstance(e.text, str) and e.text.strip()]
    empty += len(exs) - len(kept)
    if o.get("sample") is not None and o["sample"] < len(kept):
        rnd = random.Random(o.get("sample_seed", 0))  # ALTI: random.seed(10); random.sample(range(N), 500)
        kept = [kept[i] for i in rnd.sample(range(len(kept)), int(o["sample"]))]
    if spec.limit is not None:
        kept = kept[: spec.limit]
    return kept, empty


# =============================================================================================
# computing one example (runs in the driver or in a Ray worker)
# =============================================================================================

_MODEL_CACHE: "OrderedDict[tuple, Any]" = OrderedDict()
_MODEL_CACHE_SIZE = 2


def get_model(name: str, device: str = "auto", dtype: str = "float32"):
    """A model loaded once per process (the few most recently used are kept)."""
    from .models import load_model

    key = (name, device, dtype)
    if key in _MODEL_CACHE:
        _MODEL_CACHE.move_to_end(key)
        return _MODEL_CACHE[key]
    m = load_model(name, device=device, dtype=dtype)
    _MODEL_CACHE[key] = m
    while len(_MODEL_CACHE) > _MODEL_CACHE_SIZE:
        _MODEL_CACHE.popitem(last=False)
    return m


def model_revision(model) -> tuple[str, str]:
    """(revision, fingerprint): the hub commit or the embedded build's source, and ctxmix's
    fingerprint of name, dtype, commit and build metadata."""
    from .cache import model_fingerprint

    c = model.hf.config
    fp = model_fingerprint(model)
    return str(getattr(c, "_commit_hash", "") or "") or f"local:{fp}", fp


def applicable_methods(model, methods: list[str], has_foil: bool) -> tuple[list[str], dict[str, str]]:
    """(methods that apply to `model`, {method: why not} for the others). "all" expands to every
    ctxmix method of the model's kind and LN position plus `random`."""
    from .methods import MIXING_METHODS, scope_names
    from .saliency import SALIENCY_METHODS

    scopes = set(scope_names(model.spec.position))
    if "all" in methods:
        expanded = [m for m, info in MIXING_METHODS.items() if info.group != "scope" or m in scopes]
        if model.kind != "encoder":
            expanded += list(SALIENCY_METHODS)
        expanded += ["random"]
        methods = list(dict.fromkeys([m for m in methods if m != "all"] + expanded))
    ok, na = [], {}
    for m in methods:
        info = MIXING_METHODS.get(m)
        if info is not None and info.group == "scope" and m not in scopes:
            na[m] = f"not a scope of a {model.spec.position}-LN model (its scopes: {', '.join(sorted(scopes))})"
        elif (m in SALIENCY_METHODS or m == "blank_out_foil") and model.kind == "encoder":
            na[m] = "needs a model with a head (classifier or language model)"
        elif m == "blank_out_foil" and (not has_foil or model.kind == "classifier"):
            na[m] = "needs agreement data (target and foil) and a language model"
        else:
            ok.append(m)
    return ok, na


def _encode_example(model, ex: dict, options: dict) -> dict:
    """{ids, position, cues, target, foil, why (reason skipped or None), types, segments}. A pair
    is tokenised as the tokenizer pairs it; its token_type_ids reach every forward pass unless
    the config says `token_type_ids: false` (the AttCAT code runs its pairs without them)."""
    from .explain import default_position

    out = {"ids": None, "position": None, "cues": None, "target": None, "foil": None, "why": None, "types": None,
           "segments": None}
    if ex.get("item"):
        from .agreement import AgreementItem

        it = AgreementItem.from_dict(ex["item"])
        enc = it.encode(model.tokenizer, causal=model.spec.causal, max_length=model.max_length)
        if isinstance(enc, str):
            return {**out, "why": enc}
        lm = model.kind in ("masked_lm", "causal_lm")
        return {**out, "ids": enc.input_ids, "position": enc.position, "cues": enc.cues or None,
                "target": enc.target_id if lm else None, "foil": enc.foil_id if lm else None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = model.encode_input((ex["text"], ex["text_pair"]) if ex.get("text_pair") else ex["text"])
    types = e.token_type_ids
    if types is not None and not options.get("token_type_ids", True):
        types = [0] * len(e.ids)  # all one type, as a model called without them reads them
    return {**out, "ids": e.ids, "position": default_position(model, e.ids), "types": types, "segments": e.segments}


def _logits(model, ids: list[int], types: list[int] | None = None):
    import torch

    with torch.no_grad():
        x = torch.tensor([ids], device=model.device)
        return model.hf(input_ids=x, attention_mask=torch.ones_like(x),
                        **model.type_ids_kwargs([types])).logits[0].double()


def _resolve_target(model, ids, position, ex: dict, target_mode: str, lm_target: int | None,
                    types: list[int] | None = None) -> tuple[int, str]:
    if model.kind == "classifier":
        if target_mode == "gold" and ex.get("label") is not None:
            return int(ex["label"]), "gold"
        note = "predicted" if target_mode == "predicted" else "predicted (no gold label)"
        return int(_logits(model, ids, types).reshape(-1).argmax()), note
    if lm_target is not None:
        return int(lm_target), "gold"
    return int(_logits(model, ids, types)[position].argmax()), "predicted"


def _example_seed(seed: int, *parts) -> int:
    return int(hashlib.sha256(json.dumps([seed, *parts]).encode()).hexdigest()[:12], 16)


def _derived(name: str, ex_obj, position: int, n: int, seed_key: int, model=None, ids=None, target=None,
             foil=None, batch_size: int = 32, keep_self: bool = False):
    """(saliency, layer maps or None) of a derived method. keep_self: raw_attention keeps the
    explained token's attention to itself (the ALTI repository's baseline) instead of zeroing it."""
    from .methods import rollout

    if name == "random":
        return np.random.default_rng(seed_key).random(n), None
    if name == "raw_attention":
        A = ex_obj.layer_maps["attention"]
        s = A[-1][position].copy()
        if not keep_self:
            s[position] = 0.0
        return s, A
    if name in ("norm_rollout", "norm_fixed_res"):
        base = ex_obj.layer_maps["norm_res_ln" if name == "norm_rollout" else "norm"]
        M = base / np.clip(base.sum(-1, keepdims=True), np.finfo(float).tiny, None)
        if name == "norm_fixed_res":
            M = 0.5 * M + 0.5 * np.eye(n)
        return rollout(M)[-1][position].copy(), M
    if name == "blank_out_foil":
        from .metrics import TargetProbability

        unk = model.tokenizer.unk_token_id
        if unk is None:
            raise BadInput("blank_out_foil needs an [UNK] token")
        predict = TargetProbability(model, target, foil=foil, batch_size=batch_size)
        seqs = [list(ids)] + [[unk if j == i else t for j, t in enumerate(ids)] for i in range(n)]
        p = predict(seqs, [position] * len(seqs))
        return p[0] - p[1:], None
    raise BadInput(f"unknown derived method {name!r}")


def compute_example(task: dict) -> dict:
    """Compute the units of one example (see `compute_batch`)."""
    return compute_batch([task])[0]


def compute_batch(tasks: list[dict]) -> list[dict | None]:
    """Compute the units of a batch of examples of one (model, dataset). Each task: model (label,
    name, device, dtype), dataset, example (Example as dict), methods (to compute; none for an
    example that only fills its batch), references {ref: saliency list} already stored, metrics,
    target, explain options, options, seed. The examples are traced in one padded forward pass and
    their mixing maps decomposed together; the rest runs per example. Batch membership is fixed by
    example index (`plan_groups`), so a resumed run recomputes whole batches and gets results
    bit-identical to an uninterrupted run. Returns one result per task (None for the fillers),
    plain data (picklable)."""
    t0 = time.time()
    ms = tasks[0]["model"]
    model = get_model(ms["name"], ms.get("device", "auto"), ms.get("dtype", "float32"))
    rev, fp = model_revision(model)
    base = {"model_revision": rev, "fingerprint": fp, "pid": os.getpid(), "methods": {}, "references": {}}
    if tasks[0].get("kind") == "contextualization_change":
        return [None if r is None else {**base, **r} for r in _compute_change_batch(model, tasks)]
    preps = [_prepare_example(model, t) for t in tasks]
    members = [k for k, p in enumerate(preps) if p.get("ids") is not None]
    exos: dict[int, Any] = {}
    if members and any(preps[k]["explain_methods"] for k in members):
        from .explain import explain_batch

        opts = dict(tasks[0].get("explain") or {})
        union = list(dict.fromkeys(m for k in members for m in preps[k]["explain_methods"]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = explain_batch(model, [preps[k]["ids"] for k in members], union,
                                targets=[preps[k].get("target") for k in members],
                                positions=[preps[k]["position"] for k in members],
                                token_type_ids=[preps[k].get("types") for k in members],
                                segments=[preps[k].get("segments") for k in members],
                                methods_per_text=[preps[k]["explain_methods"] for k in members], **opts)
        exos = dict(zip(members, got))
    out: list[dict | None] = []
    for k, (task, prep) in enumerate(zip(tasks, preps)):
        if not task["methods"]:
            out.append(None)
        elif "result" in prep:
            out.append({**base, **prep["result"], "seconds": time.time() - t0})
        else:
            out.append({**base, **_finish_example(model, task, prep, exos.get(k)), "seconds": time.time() - t0})
    return out


def _prepare_example(model, task: dict) -> dict:
    """Encode one example and decide what it needs: {"ids": None, "result": skipped} or ids,
    position, target, the methods explain must compute and the rest `_finish_example` needs."""
    ex = task["example"]
    enc = _encode_example(model, ex, task["options"])
    ids, position, cues, lm_target, foil, why = (enc[k] for k in ("ids", "position", "cues", "target", "foil", "why"))
    types, segments = enc["types"], enc["segments"]
    if why is None and len(ids) < task["options"].get("min_tokens", 0):
        why = f"fewer than {task['options']['min_tokens']} tokens"
    if why is not None:
        return {"ids": None, "result": {"status": "skipped", "reason": why}}
    if not task["methods"]:  # fills its batch only
        return {"ids": ids, "position": position, "explain_methods": [], "types": types, "segments": segments}
    from .metrics import get_metric
    from . import METHODS

    ok, na = applicable_methods(model, task["methods"], has_foil=foil is not None)
    metrics = [get_metric(m) for m in task["metrics"]]
    refs_needed = {m.reference for m in metrics if m.reference}
    have = {k: np.asarray(v) for k, v in (task.get("references") or {}).items()}
    ref_ok, ref_na = applicable_methods(model, sorted(refs_needed - set(have)), has_foil=foil is not None)
    compute = list(dict.fromkeys(ok + [r for r in ref_ok if r not in ok]))
    has_head = model.kind != "encoder"
    target, target_note = (None, "none (no head)") if not has_head else _resolve_target(
        model, ids, position, ex, task["target"], lm_target, types)
    explain_methods = [m for m in compute if m in METHODS]
    for m in compute:
        explain_methods += [b for b in _DERIVED_BASES.get(m, []) if b not in explain_methods]
    return {"ids": ids, "position": position, "cues": cues, "foil": foil, "ok": ok, "na": na, "metrics": metrics,
            "refs_needed": refs_needed, "have": have, "ref_na": ref_na, "compute": compute, "has_head": has_head,
            "target": target, "target_note": target_note, "explain_methods": explain_methods, "types": types,
            "segments": segments}


def _finish_example(model, task: dict, p: dict, exo) -> dict:
    """Saliency of the derived methods, the metrics and the result record of one example."""
    from .metrics import (CUE_METRICS, DELETION_METRICS, TargetProbability, cue_alignment, cue_alignment_layers,
                          deletion_metrics, pad_token_id, protected_positions, reference_spearman)
    from . import METHODS

    ex = task["example"]
    ids, position, target, foil, ok = p["ids"], p["position"], p["target"], p["foil"], p["ok"]
    n = len(ids)
    saliency: dict[str, np.ndarray] = {}
    layer_maps: dict[str, np.ndarray] = {}
    for m in p["compute"]:
        if m in METHODS:
            saliency[m] = np.asarray(exo.saliency[m], dtype=np.float64)
            if m in exo.layer_maps:
                layer_maps[m] = exo.layer_maps[m]
        else:
            s, L = _derived(m, exo, position, n, _example_seed(task["seed"], task["dataset"], ex["id"], m), model=model,
                            ids=ids, target=target, foil=foil, batch_size=task["options"].get("batch_size", 32),
                            keep_self=task["options"].get("raw_attention_keep_self", False))
            saliency[m] = np.asarray(s, dtype=np.float64)
            if L is not None:
                layer_maps[m] = L
    refs = {**p["have"], **{r: saliency[r] for r in p["refs_needed"] if r in saliency}}
    scores: dict[str, list] = {m: [] for m in ok}
    metrics = p["metrics"]
    del_metrics = [x.name for x in metrics if x.name in DELETION_METRICS]
    if del_metrics and p["has_head"] and ok:
        predict = TargetProbability(model, target, batch_size=task["options"].get("batch_size", 32))
        dm, p0 = deletion_metrics(predict, ids, {m: saliency[m] for m in ok}, del_metrics,
                                  protected=protected_positions(model, ids, position), position=position,
                                  pad_id=pad_token_id(model.tokenizer), token_type_ids=p.get("types"),
                                  abs_saliency=task["options"].get("abs_saliency", False),
                                  stop_one_short=task["options"].get("deletion_stop_one_short", False))
        for m, vals in dm.items():
            scores[m] += [(k, -1, v) for k, v in vals.items()]
    cue_metrics = [x.name for x in metrics if x.name in CUE_METRICS]
    cues = p["cues"]
    for m in ok:
        for met in metrics:
            if met.family == "reference" and met.reference != m and met.reference in refs:
                scores[m].append((met.name, -1, reference_spearman(saliency[m], refs[met.reference], met, position)))
        if cue_metrics and cues:
            for k, v in cue_alignment(saliency[m], cues, cue_metrics).items():
                scores[m].append((k, -1, v))
            if m in layer_maps:
                for k, arr in cue_alignment_layers(layer_maps[m], position, cues, cue_metrics).items():
                    scores[m] += [(k, l + 1, float(v)) for l, v in enumerate(arr)]
    out = {"status": "ok", "tokens": model.tokens(ids), "position": position, "target": target,
           "target_note": p["target_note"], "n_tokens": n, "methods": {}}
    for m in ok:
        out["methods"][m] = {"status": "done", "saliency": saliency[m].tolist(), "scores": scores[m]}
    for m, why in p["na"].items():
        out["methods"][m] = {"status": "na", "detail": why}
    out["references"] = {r: saliency[r].tolist() for r in p["refs_needed"]
                         if r in saliency and r not in ok and r not in p["have"]}
    out["reference_na"] = p["ref_na"]
    return out


def _compute_change_batch(model, tasks: list[dict]) -> list[dict | None]:
    """FF paper §5.1 on a batch of texts: per comparison and layer, 1 - rho of the two scope maps
    (scope maps and ranks of the whole batch on the device, one transfer per batch)."""
    import torch

    from .analysis import comparisons, mask_tokens
    from .methods import scope_maps_batch
    from .ranks import spearman
    from .trace import trace_batch_tensors

    comps = comparisons(model)
    out: list[dict | None] = [None] * len(tasks)
    members, batch, types = [], [], []
    for k, task in enumerate(tasks):
        ex = task["example"]
        enc = _encode_example(model, ex, task["options"])
        ids, why = enc["ids"], enc["why"]
        if why is None and len(ids) < task["options"].get("min_tokens", 0):
            why = f"fewer than {task['options']['min_tokens']} tokens"
        if why is not None:
            if task["methods"]:
                out[k] = {"status": "skipped", "reason": why}
            continue
        rate = task["options"].get("mask_rate", 0.0)
        if rate and model.kind == "masked_lm":
            ids = mask_tokens(model, ids, rate, random.Random(_example_seed(task["seed"], task["dataset"], ex["id"])))
        members.append(k)
        batch.append(ids)
        types.append(enc["types"])
    if not members:
        return out
    lower = bool(tasks[0]["options"].get("lower_triangle"))
    with torch.no_grad():
        tb = trace_batch_tensors(model, batch, token_type_ids=types)
        maps = scope_maps_batch(tb, next_ln=model.spec.position != "post")
        mask = tb.mask
        valid = mask[:, :, None] & mask[:, None, :]
        if lower:
            valid = valid & torch.ones_like(valid[0]).tril()
        valid = valid.flatten(1)[:, None]  # (B, 1, n*n)
        names = [c for c, (a, b) in comps.items() if a in maps and b in maps]
        change = torch.stack([1.0 - spearman(maps[comps[c][0]].flatten(2), maps[comps[c][1]].flatten(2), valid)
                              for c in names], -1).cpu().numpy()  # (B, L, K): one transfer per batch
    for b, k in enumerate(members):
        task = tasks[k]
        if not task["methods"]:
            continue
        wanted = list(comps) if "all" in task["methods"] else task["methods"]
        r = {"status": "ok", "tokens": model.tokens(batch[b]), "position": None, "target": None, "target_note": "",
             "n_tokens": len(batch[b]), "methods": {}, "references": {}, "reference_na": {}}
        for c in wanted:
            if c not in names:
                r["methods"][c] = {"status": "na", "detail": f"no comparison {c!r} for a {model.spec.position}-LN model"}
                continue
            vals = [float(v) for v in change[b, :, names.index(c)]]
            sc = [("change", l + 1, v) for l, v in enumerate(vals)]
            finite = [v for v in vals if np.isfinite(v)]
            sc.append(("change", -1, float(np.mean(finite)) if finite else float("nan")))
            r["methods"][c] = {"status": "done", "saliency": None, "scores": sc}
        out[k] = r
    return out


def _ray_task(tasks: list[dict]) -> list[dict | None]:
    try:
        import torch

        torch.set_num_threads(max(1, int(os.environ.get("CTXMIX_WORKER_THREADS", "1"))))
    except Exception:  # noqa: BLE001
        pass
    try:
        return compute_batch(tasks)
    except (CtxmixError, RuntimeError) as e:
        return [None if not t["methods"] else {"status": "error", "reason": f"{type(e).__name__}: {e}", "methods": {}}
                for t in tasks]


# =============================================================================================
# the results store
# =============================================================================================

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs(run_id TEXT PRIMARY KEY, name TEXT, config_json TEXT, config_hash TEXT,
    ctxmix_version TEXT, created REAL, updated REAL);
CREATE TABLE IF NOT EXISTS datasets(run_id TEXT, dataset TEXT, identity TEXT, n_examples INTEGER, n_empty INTEGER,
    PRIMARY KEY(run_id, dataset));
CREATE TABLE IF NOT EXISTS examples(run_id TEXT, dataset TEXT, example_id TEXT, text TEXT, label INTEGER,
    meta_json TEXT, PRIMARY KEY(run_id, dataset, example_id));
CREATE TABLE IF NOT EXISTS units(run_id TEXT, model TEXT, dataset TEXT, example_id TEXT, method TEXT, status TEXT,
    detail TEXT, model_name TEXT, model_revision TEXT, fingerprint TEXT, ctxmix_version TEXT, target INTEGER,
    seconds REAL, finished REAL, PRIMARY KEY(run_id, model, dataset, example_id, method));
CREATE TABLE IF NOT EXISTS scores(run_id TEXT, model TEXT, model_name TEXT, model_revision TEXT, ctxmix_version TEXT,
    dataset TEXT, example_id TEXT, method TEXT, metric TEXT, layer INTEGER, value REAL,
    PRIMARY KEY(run_id, model, dataset, example_id, method, metric, layer));
CREATE TABLE IF NOT EXISTS saliency(run_id TEXT, model TEXT, dataset TEXT, example_id TEXT, method TEXT, role TEXT,
    tokens_json TEXT, values_json TEXT, position INTEGER, target INTEGER,
    PRIMARY KEY(run_id, model, dataset, example_id, method));
CREATE TABLE IF NOT EXISTS skips(run_id TEXT, model TEXT, dataset TEXT, example_id TEXT, reason TEXT,
    PRIMARY KEY(run_id, model, dataset, example_id));
CREATE TABLE IF NOT EXISTS errors(run_id TEXT, model TEXT, dataset TEXT, example_id TEXT, message TEXT, at REAL);
CREATE TABLE IF NOT EXISTS computations(run_id TEXT, model TEXT, dataset TEXT, example_id TEXT, method TEXT,
    pid INTEGER, at REAL);
CREATE TABLE IF NOT EXISTS aggregates(run_id TEXT, model TEXT, dataset TEXT, method TEXT, metric TEXT, layer INTEGER,
    mean REAL, std REAL, n INTEGER, n_nan INTEGER, higher_is_better INTEGER,
    PRIMARY KEY(run_id, model, dataset, method, metric, layer));
CREATE VIEW IF NOT EXISTS scores_with_config AS
    SELECT s.*, r.config_json FROM scores s JOIN runs r USING(run_id);
"""


class ResultsStore:
    """The SQLite results file. One writer (the driver); each unit in its own transaction."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.is_dir():
            raise BadInput(f"{self.path} is a folder; --db takes a results file (.sqlite)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.conn = sqlite3.connect(str(self.path), timeout=60)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.executescript(_SCHEMA)
            self.conn.commit()
        except sqlite3.Error as e:
            raise BadInput(f"{self.path} is not a ctxmix results file (SQLite): {e}") from None

    def close(self) -> None:
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    # -- runs and examples --------------------------------------------------------------------

    def start_run(self, plan: Plan, fresh: bool = False) -> None:
        from . import __version__

        cfg = json.dumps(plan.raw, sort_keys=True, default=str)
        h = plan.config_hash()
        row = self.conn.execute("SELECT config_hash FROM runs WHERE run_id=?", (plan.run_id,)).fetchone()
        if row and fresh:
            self.delete_run(plan.run_id)
            row = None
        if row and row[0] != h:
            raise BadInput(
                f"{self.path} already holds a run named {plan.run_id!r} with other settings (target, explain options, "
                "metrics or options changed), so its finished units would not match. Rerun with --fresh to discard "
                "it, or give the config another name.")
        with self.conn:
            if row:
                self.conn.execute("UPDATE runs SET config_json=?, updated=?, ctxmix_version=? WHERE run_id=?",
                                  (cfg, time.time(), __version__, plan.run_id))
            else:
                self.conn.execute("INSERT INTO runs VALUES(?,?,?,?,?,?,?)",
                                  (plan.run_id, plan.name, cfg, h, __version__, time.time(), time.time()))

    def delete_run(self, run_id: str) -> None:
        with self.conn:
            for t in ("runs", "datasets", "examples", "units", "scores", "saliency", "skips", "errors",
                      "computations", "aggregates"):
                self.conn.execute(f"DELETE FROM {t} WHERE run_id=?", (run_id,))

    def record_dataset(self, run_id: str, spec: DatasetSpec, examples: list[Example], n_empty: int) -> None:
        ident = spec.identity()
        row = self.conn.execute("SELECT identity FROM datasets WHERE run_id=? AND dataset=?", (run_id, spec.id)).fetchone()
        if row and row[0] != ident:
            raise BadInput(f"dataset {spec.id!r} of run {run_id!r} was defined differently before; rerun with --fresh "
                           "or give the dataset another id")
        with self.conn:
            self.conn.execute("INSERT OR REPLACE INTO datasets VALUES(?,?,?,?,?)",
                              (run_id, spec.id, ident, len(examples), n_empty))
            self.conn.executemany(
                "INSERT OR IGNORE INTO examples VALUES(?,?,?,?,?,?)",
                [(run_id, spec.id, e.id, e.text, e.label,
                  json.dumps({"label_name": e.label_name, "text_pair": e.text_pair, "item": e.item})) for e in examples])
            if n_empty:
                self.conn.execute("INSERT OR REPLACE INTO skips VALUES(?,?,?,?,?)",
                                  (run_id, "*", spec.id, "*", f"{n_empty} row(s) with empty text"))

    def finished_units(self, run_id: str) -> set[tuple[str, str, str, str]]:
        q = f"SELECT model, dataset, example_id, method FROM units WHERE run_id=? AND status IN ({','.join('?' * len(DONE_STATUSES))})"
        return {tuple(r) for r in self.conn.execute(q, (run_id, *DONE_STATUSES))}

    def skipped_examples(self, run_id: str) -> set[tuple[str, str, str]]:
        return {tuple(r) for r in self.conn.execute(
            "SELECT model, dataset, example_id FROM skips WHERE run_id=? AND example_id != '*'", (run_id,))}

    def stored_saliency(self, run_id: str, model: str, dataset: str, example_id: str, methods: Iterable[str]) -> dict:
        methods = list(methods)
        if not methods:
            return {}
        q = (f"SELECT method, values_json FROM saliency WHERE run_id=? AND model=? AND dataset=? AND example_id=? "
             f"AND method IN ({','.join('?' * len(methods))})")
        return {m: json.loads(v) for m, v in self.conn.execute(q, (run_id, model, dataset, example_id, *methods))}

    # -- committing ---------------------------------------------------------------------------

    def commit_result(self, run_id: str, model: ModelSpec, dataset: str, example_id: str, res: dict,
                      wanted: list[str]) -> int:
        """Write one example's result: each unit in its own transaction. Returns units committed."""
        from . import __version__

        now = time.time()
        if res.get("status") == "error":
            with self.conn:
                self.conn.execute("INSERT INTO errors VALUES(?,?,?,?,?,?)",
                                  (run_id, model.label, dataset, example_id, res.get("reason", ""), now))
            return 0
        rev, fp = res.get("model_revision", ""), res.get("fingerprint", "")
        if res.get("status") == "skipped":
            with self.conn:
                self.conn.execute("INSERT OR REPLACE INTO skips VALUES(?,?,?,?,?)",
                                  (run_id, model.label, dataset, example_id, res.get("reason", "")))
                for m in wanted:
                    self.conn.execute("INSERT OR REPLACE INTO units VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                                      (run_id, model.label, dataset, example_id, m, "skipped", res.get("reason", ""),
                                       model.name, rev, fp, __version__, None, 0.0, now))
            return len(wanted)
        with self.conn:  # reference saliencies first, so a later unit of this example can reuse them
            for r, vals in (res.get("references") or {}).items():
                self.conn.execute("INSERT OR REPLACE INTO saliency VALUES(?,?,?,?,?,?,?,?,?,?)",
                                  (run_id, model.label, dataset, example_id, r, "reference",
                                   json.dumps(res.get("tokens")), json.dumps(vals), res.get("position"), res.get("target")))
        n_done = sum(1 for m in res["methods"].values() if m["status"] == "done") or 1
        per = res.get("seconds", 0.0) / n_done
        count = 0
        for m, r in res["methods"].items():
            with self.conn:
                self.conn.execute("INSERT OR REPLACE INTO units VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                                  (run_id, model.label, dataset, example_id, m, r["status"],
                                   r.get("detail", res.get("target_note", "")), model.name, rev, fp, __version__,
                                   res.get("target"), per if r["status"] == "done" else 0.0, now))
                if r["status"] == "done":
                    self.conn.executemany(
                        "INSERT OR REPLACE INTO scores VALUES(?,?,?,?,?,?,?,?,?,?,?)",
                        [(run_id, model.label, model.name, rev, __version__, dataset, example_id, m, k, int(layer),
                          None if v is None or not math.isfinite(v) else float(v)) for k, layer, v in r["scores"]])
                    if r.get("saliency") is not None:
                        self.conn.execute("INSERT OR REPLACE INTO saliency VALUES(?,?,?,?,?,?,?,?,?,?)",
                                          (run_id, model.label, dataset, example_id, m, "method",
                                           json.dumps(res.get("tokens")), json.dumps(r["saliency"]),
                                           res.get("position"), res.get("target")))
                    self.conn.execute("INSERT INTO computations VALUES(?,?,?,?,?,?,?)",
                                      (run_id, model.label, dataset, example_id, m, res.get("pid"), now))
            count += 1
        return count

    # -- reading ------------------------------------------------------------------------------

    def frame(self, sql: str, params: tuple = ()):
        import pandas as pd

        return pd.read_sql_query(sql, self.conn, params=params)

    def write_aggregates(self, run_id: str) -> None:
        """Recompute the aggregates of a run from its scores and saliency vectors."""
        from .metrics import get_metric
        from .tables import agreement_long, aggregate_scores, model_agreement_long

        scores = self.frame("SELECT model, dataset, example_id, method, metric, layer, value FROM scores WHERE run_id=?",
                            (run_id,))
        agg = aggregate_scores(scores)
        sal = self.frame("SELECT model, dataset, example_id, method, tokens_json, values_json FROM saliency "
                         "WHERE run_id=? AND role='method'", (run_id,))
        extra = [agreement_long(sal), model_agreement_long(sal)]
        import pandas as pd

        agg = pd.concat([agg] + [aggregate_scores(e) for e in extra if len(e)], ignore_index=True)

        def hib(metric: str):
            if metric.startswith(("agree:", "model_agree:")):
                return 1
            try:
                h = get_metric(metric).higher_is_better
            except BadInput:
                return None
            return None if h is None else int(h)

        with self.conn:
            self.conn.execute("DELETE FROM aggregates WHERE run_id=?", (run_id,))
            self.conn.executemany(
                "INSERT INTO aggregates VALUES(?,?,?,?,?,?,?,?,?,?,?)",
                [(run_id, r.model, r.dataset, r.method, r.metric, int(r.layer),
                  None if pd.isna(r["mean"]) else float(r["mean"]), None if pd.isna(r["std"]) else float(r["std"]),
                  int(r.n), int(r.n_nan), hib(r.metric)) for _, r in agg.iterrows()])

    def counts(self, run_id: str) -> dict:
        c = dict(self.conn.execute("SELECT status, COUNT(*) FROM units WHERE run_id=? GROUP BY status", (run_id,)).fetchall())
        c["errors"] = self.conn.execute("SELECT COUNT(*) FROM errors WHERE run_id=?", (run_id,)).fetchone()[0]
        c["empty_rows"] = self.conn.execute("SELECT COALESCE(SUM(n_empty),0) FROM datasets WHERE run_id=?", (run_id,)).fetchone()[0]
        c["skipped_examples"] = self.conn.execute(
            "SELECT COUNT(*) FROM skips WHERE run_id=? AND example_id != '*'", (run_id,)).fetchone()[0]
        return c


# =============================================================================================
# executors
# =============================================================================================


@dataclass
class Group:
    """One example of one (model, dataset): the units still to compute. `batch` numbers the
    engine batch it belongs to (its index in the dataset // example_batch) and `members` are all
    the examples of that batch, finished ones included, so the batch is always traced whole."""

    model: ModelSpec
    dataset: str
    example: Example
    methods: list[str]
    batch: int = 0
    members: list = field(default_factory=list)


def _batches(groups: list[Group]) -> list[list[Group]]:
    """Consecutive groups of one (model, dataset, batch number)."""
    out: list[list[Group]] = []
    for g in groups:
        if out and (out[-1][0].model.label, out[-1][0].dataset, out[-1][0].batch) == (g.model.label, g.dataset, g.batch):
            out[-1].append(g)
        else:
            out.append([g])
    return out


def _batch_tasks(plan: Plan, gs: list[Group], store: ResultsStore) -> list[dict]:
    """One task per member example of the batch: the unfinished ones with their methods, the
    others with none (they only keep the batch's padding, hence its numbers, the same)."""
    todo = {g.example.id: g for g in gs}
    tasks = []
    for e in gs[0].members:
        g = todo.get(e.id) or Group(model=gs[0].model, dataset=gs[0].dataset, example=e, methods=[], batch=gs[0].batch)
        tasks.append(_task(plan, g, store))
    return tasks


def _commit_batch(plan: Plan, gs: list[Group], tasks: list[dict], results: list, store: ResultsStore, bar) -> None:
    by_id = {g.example.id: g for g in gs}
    for task, res in zip(tasks, results):
        g = by_id.get(task["example"]["id"])
        if g is None:
            continue
        store.commit_result(plan.run_id, g.model, g.dataset, g.example.id, res, g.methods)
        bar.update(len(g.methods))


def _task(plan: Plan, g: Group, store: ResultsStore) -> dict:
    from .metrics import get_metric

    refs = {get_metric(m).reference for m in plan.metrics if get_metric(m).reference}
    options = dict(plan.options)
    spec = next((d for d in plan.datasets if d.id == g.dataset), None)
    if spec is not None and spec.options.get("min_tokens") is not None:
        options["min_tokens"] = int(spec.options["min_tokens"])  # a dataset's own filter wins
    if spec is not None and spec.options.get("abs_saliency"):
        options["abs_saliency"] = True  # rank by |score| for the deletion metrics (AttCAT's QQP notebook)
    return {"kind": plan.kind, "model": asdict(g.model), "dataset": g.dataset, "example": asdict(g.example),
            "methods": g.methods, "metrics": plan.metrics, "target": plan.target, "explain": plan.explain,
            "options": options, "seed": plan.options["seed"],
            "references": store.stored_saliency(plan.run_id, g.model.label, g.dataset, g.example.id, refs)
            if g.methods else {}}


class _Stop:
    """SIGINT/SIGTERM ask the loop to stop after the unit being committed."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, *_):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *a):
        for s, h in self._old.items():
            signal.signal(s, h)


def _progress(total: int, desc: str, quiet: bool = False):
    from tqdm.auto import tqdm

    tty = sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="unit", dynamic_ncols=True, disable=quiet,
                mininterval=0.2 if tty else 15.0)


def _throttle() -> None:
    d = float(os.environ.get("CTXMIX_BENCH_THROTTLE", "0") or 0)  # seconds per example; for tests of resuming
    if d > 0:
        time.sleep(d)


def run_local(plan: Plan, groups: list[Group], store: ResultsStore, bar) -> None:
    with _Stop() as stop:
        for gs in _batches(groups):
            if stop.requested:
                break
            tasks = _batch_tasks(plan, gs, store)
            try:
                results = compute_batch(tasks)
            except (CtxmixError, RuntimeError) as e:  # recorded, not committed: retried by the next run
                results = [{"status": "error", "reason": f"{type(e).__name__}: {e}"} for _ in tasks]
            _throttle()
            _commit_batch(plan, gs, tasks, results, store, bar)
        if stop.requested:
            raise KeyboardInterrupt


def _ray_env() -> dict:
    root = str(Path(__file__).resolve().parent.parent)
    env = {"PYTHONPATH": os.pathsep.join([root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for k in ("CTXMIX_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
              "CTXMIX_WORKER_THREADS"):
        if os.environ.get(k):
            env[k] = os.environ[k]
    return env


def run_ray(plan: Plan, groups: list[Group], store: ResultsStore, bar, address: str | None = None,
            num_cpus: int | None = None) -> None:
    """Each batch of examples is a Ray task (one CPU); at most 2 x CPUs in flight; the driver commits."""
    try:
        import ray
    except ImportError:
        raise BadInput("--executor ray needs Ray: pip install ray==2.60.0 (see requirements-dev.txt)") from None
    started = not ray.is_initialized()
    if started:
        kw = dict(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": _ray_env()})
        if address:
            ray.init(address=address, **kw)
        else:
            ray.init(num_cpus=num_cpus or os.cpu_count() or 1, **kw)
    try:
        remote = ray.remote(num_cpus=1, max_retries=1)(_ray_task)
        cap = max(1, int(2 * (ray.available_resources().get("CPU", 1) or 1)))
        pending: dict = {}
        todo = _batches(groups)
        with _Stop() as stop:
            while (todo and not stop.requested) or pending:
                while todo and len(pending) < cap and not stop.requested:
                    gs = todo.pop(0)
                    tasks = _batch_tasks(plan, gs, store)
                    pending[remote.remote(tasks)] = (gs, tasks)
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    gs, tasks = pending.pop(ref)
                    try:
                        results = ray.get(ref)
                    except Exception as e:  # noqa: BLE001 - a worker crash is recorded, the run goes on
                        results = [{"status": "error", "reason": f"ray task failed: {type(e).__name__}: {e}"}
                                   for _ in tasks]
                    _commit_batch(plan, gs, tasks, results, store, bar)
            if stop.requested:
                raise KeyboardInterrupt
    finally:
        if started:
            ray.shutdown()


def _ensure_built(models: list[ModelSpec]) -> None:
    """Build embedded models that are built on first use once, here, before workers race to it."""
    from .models import cache_dir

    for m in models:
        folder = {"minilm-sentiment": "minilm-sentiment", "smollm2": "smollm2"}.get(m.name)
        if folder and not (cache_dir() / folder / "ctxmix_meta.json").exists():
            print(f"building {m.name} once (cached in {cache_dir() / folder}) ...", file=sys.stderr)
            get_model(m.name, "cpu" if m.device == "auto" else m.device, m.dtype)


def expand_methods(plan: Plan, spec: ModelSpec) -> list[str]:
    """The config's methods for one model, "all" expanded for its kind and LN position (loads the model)."""
    if "all" not in plan.methods:
        return list(plan.methods)
    model = get_model(spec.name, spec.device, spec.dtype)
    if plan.kind == "contextualization_change":
        from .analysis import comparisons

        full = list(comparisons(model))
    else:
        full, _ = applicable_methods(model, ["all"], has_foil=False)
    return list(dict.fromkeys([m for m in plan.methods if m != "all"] + full))


def plan_groups(plan: Plan, store: ResultsStore) -> tuple[list[Group], int]:
    """Load every dataset, record it, and list the units still to compute (example by example)."""
    models = {m.label: m for m in plan.models}
    loaded: dict[str, list[Example]] = {}
    for spec in plan.datasets:
        if not any(d == spec.id for _, d in plan.runs):
            continue
        exs, empty = load_examples(spec)
        store.record_dataset(plan.run_id, spec, exs, empty)
        loaded[spec.id] = exs
    finished = store.finished_units(plan.run_id)
    skipped = store.skipped_examples(plan.run_id)
    methods = {label: expand_methods(plan, models[label]) for label in dict.fromkeys(l for l, _ in plan.runs)}
    groups, total = [], 0
    size = plan.options.get("example_batch", EXAMPLE_BATCH)
    for label, ds in plan.runs:
        exs = loaded[ds]
        for k, e in enumerate(exs):
            total += 1
            if (label, ds, e.id) in skipped:
                continue
            todo = [m for m in methods[label] if (label, ds, e.id, m) not in finished]
            if todo:
                b = k // size
                groups.append(Group(model=models[label], dataset=ds, example=e, methods=todo, batch=b,
                                    members=exs[b * size: (b + 1) * size]))
    return groups, total


def default_db(plan: Plan) -> Path:
    return Path("results") / f"{plan.name}.sqlite"


def run_bench(config: str | os.PathLike | Plan, *, db: str | os.PathLike | None = None, executor: str = "local",
              limit: int | None = None, fresh: bool = False, ray_address: str | None = None,
              num_cpus: int | None = None, threads: int | None = None, quiet: bool = False) -> Path:
    """Run (or resume) a benchmark; returns the path of its SQLite store.

    threads: torch threads of this process (local executor) or of each Ray worker (default 1
    there); results do not depend on it, so it is not part of the config."""
    plan = config if isinstance(config, Plan) else load_config(config, limit=limit)
    threads = threads or plan.options.get("threads")
    if threads:
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(int(threads))
        os.environ["CTXMIX_WORKER_THREADS"] = str(int(threads))
        try:
            return _run_bench(plan, db, executor, fresh, ray_address, num_cpus, quiet)
        finally:
            torch.set_num_threads(before)
    return _run_bench(plan, db, executor, fresh, ray_address, num_cpus, quiet)


def _run_bench(plan: Plan, db, executor: str, fresh: bool, ray_address, num_cpus, quiet: bool) -> Path:
    if executor not in ("local", "ray"):
        raise BadInput("executor must be 'local' or 'ray'")
    if executor == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise BadInput("--executor ray needs Ray: pip install ray==2.60.0 (see requirements-dev.txt)") from None
    path = Path(db) if db else default_db(plan)
    from .models import keep_cpu_buffers

    keep_cpu_buffers()  # a benchmark owns its process (see the docstring); a no-op once set
    with ResultsStore(path) as store:
        store.start_run(plan, fresh=fresh)
        _ensure_built(plan.models)
        groups, total = plan_groups(plan, store)
        n_units = sum(len(g.methods) for g in groups)
        if not quiet:
            print(f"run {plan.run_id!r}: {total} example(s) x model(s), {n_units} unit(s) to compute "
                  f"-> {path}", file=sys.stderr)
        if groups:
            with _progress(n_units, plan.name, quiet) as bar:
                try:
                    if executor == "ray":
                        run_ray(plan, groups, store, bar, address=ray_address, num_cpus=num_cpus)
                    else:
                        run_local(plan, groups, store, bar)
                except KeyboardInterrupt:
                    store.write_aggregates(plan.run_id)
                    print(f"\ninterrupted; finished units are saved in {path}: run the same command to resume",
                          file=sys.stderr)
                    raise
        store.write_aggregates(plan.run_id)
    return path


# =============================================================================================
# command line
# =============================================================================================


def add_bench_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", required=True, help="a YAML benchmark config (see configs/)")
    s.add_argument("--db", help="SQLite results file (default results/<config name>.sqlite)")
    s.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="local: this process; ray: Ray tasks (pip install ray==2.60.0)")
    s.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: start a local one)")
    s.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance")
    s.add_argument("--limit", type=int, default=None, help="at most this many examples per dataset")
    s.add_argument("--fresh", action="store_true", help="discard this run's stored results first")
    s.add_argument("--report", action="store_true", help="only print and export the tables of the stored results")
    s.add_argument("--out", default=None, help="folder for the CSV/LaTeX tables (default results/<name>/)")
    s.add_argument("--figures", action="store_true", help="also write plotly figures (HTML) next to the tables")
    s.add_argument("--threads", type=int, default=None,
                   help="torch threads (local) or per Ray worker; 1 is fastest on a busy machine")
    s.add_argument("--check", action="store_true", help="validate the config and exit")


def cmd_bench(args) -> None:
    plan = load_config(args.config, limit=args.limit)
    if args.check:
        print(f"config {args.config} is valid: {len(plan.runs)} model x dataset run(s), methods "
              f"{', '.join(plan.methods)}, metrics {', '.join(plan.metrics) or '(none)'}")
        return
    db = Path(args.db) if args.db else default_db(plan)
    if args.report:
        if not db.is_file():
            raise BadInput(f"no results file {db}; run the benchmark first")
        with ResultsStore(db) as store:
            store.write_aggregates(plan.run_id)
    else:
        try:
            db = run_bench(plan, db=db, executor=args.executor, fresh=args.fresh, ray_address=args.ray_address,
                           num_cpus=args.num_cpus, threads=args.threads)
        except KeyboardInterrupt:
            raise SystemExit(130) from None
    from .tables import report

    out = Path(args.out) if args.out else db.parent / plan.name
    print(report(db, plan, out_dir=out, figures=args.figures))


__all__ = ["Plan", "DatasetSpec", "ModelSpec", "Example", "ResultsStore", "DERIVED_METHODS", "validate_config",
           "load_config", "load_examples", "compute_example", "compute_batch", "run_bench", "plan_groups", "add_bench_arguments",
           "cmd_bench", "get_model", "applicable_methods", "check_model_name"]
