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
  filtered for this model: too few tokens, target not one token...), ``refused`` (this text is
  too long for attention flow's time limit; the message is in ``detail``, and later runs of the same
  ctxmix version do not retry it) or ``error`` (e.g. DecompX's memory budget at that moment: retried),
  model revision, seconds.
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

from ctxmix.lazy import lazy_getattr

_API = {
    "run_bench": "command",
    "cmd_bench": "command",
    "add_bench_arguments": "command",
    "validate_config": "config",
    "load_config": "config",
    "Plan": "config",
    "load_examples": "datasets",
    "get_model": "compute",
    "compute_batch": "compute",
    "compute_example": "compute",
    "ResultsStore": "store",
}


__getattr__ = lazy_getattr(__name__, _API)  # the runner's API and the submodules, on first use
