"""`run_bench` and the `bench` command: plan the units, run them, write the tables."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ctxmix.benchmark.compute import applicable_methods, get_model
from ctxmix.benchmark.config import EXAMPLE_BATCH, ModelSpec, Plan, load_config
from ctxmix.benchmark.datasets import Example, load_examples
from ctxmix.benchmark.executors import Group, run_local, run_ray
from ctxmix.benchmark.store import ResultsStore
from ctxmix.errors import BadInput
from ctxmix.progress import progress_bar


def _ensure_built(models: list[ModelSpec]) -> None:
    """Build embedded models that are built on first use once, here, before workers race to it."""
    from ctxmix.engine.embedded import BUILT_ONCE
    from ctxmix.engine.models import cache_dir

    for m in models:
        if m.name in BUILT_ONCE and not (cache_dir() / m.name / "ctxmix_meta.json").exists():
            print(f"building {m.name} once (cached in {cache_dir() / m.name}) ...", file=sys.stderr)
            get_model(m.name, "cpu" if m.device == "auto" else m.device, m.dtype)


def expand_methods(plan: Plan, spec: ModelSpec) -> list[str]:
    """The config's methods for one model, "all" expanded for its kind and LN position (loads the model)."""
    if "all" not in plan.methods:
        return list(plan.methods)
    model = get_model(spec.name, spec.device, spec.dtype)
    if plan.kind == "contextualization_change":
        from ctxmix.analyses.corpus import comparisons

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
                groups.append(
                    Group(
                        model=models[label],
                        dataset=ds,
                        example=e,
                        methods=todo,
                        batch=b,
                        members=exs[b * size : (b + 1) * size],
                    )
                )
    return groups, total


def default_db(plan: Plan) -> Path:
    return Path("results") / f"{plan.name}.sqlite"


def run_bench(
    config: str | os.PathLike | Plan,
    *,
    db: str | os.PathLike | None = None,
    executor: str = "local",
    limit: int | None = None,
    fresh: bool = False,
    ray_address: str | None = None,
    num_cpus: int | None = None,
    threads: int | None = None,
    quiet: bool = False,
) -> Path:
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
    from ctxmix.engine.budget import keep_cpu_buffers

    keep_cpu_buffers()  # a benchmark owns its process (see the docstring); a no-op once set
    with ResultsStore(path) as store:
        store.start_run(plan, fresh=fresh)
        _ensure_built(plan.models)
        groups, total = plan_groups(plan, store)
        n_units = sum(len(g.methods) for g in groups)
        if not quiet:
            print(
                f"run {plan.run_id!r}: {total} example(s) x model(s), {n_units} unit(s) to compute -> {path}",
                file=sys.stderr,
            )
        if groups:
            with progress_bar(n_units, plan.name, not quiet, unit="unit") as bar:
                try:
                    if executor == "ray":
                        run_ray(plan, groups, store, bar, address=ray_address, num_cpus=num_cpus)
                    else:
                        run_local(plan, groups, store, bar)
                except KeyboardInterrupt:
                    store.write_aggregates(plan.run_id)
                    print(
                        f"\ninterrupted; finished units are saved in {path}: run the same command to resume",
                        file=sys.stderr,
                    )
                    raise
        store.write_aggregates(plan.run_id)
    return path


def add_bench_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", required=True, help="a YAML benchmark config (see configs/)")
    s.add_argument("--db", help="SQLite results file (default results/<config name>.sqlite)")
    s.add_argument(
        "--executor",
        choices=["local", "ray"],
        default="local",
        help="local: this process; ray: Ray tasks (pip install ray==2.60.0)",
    )
    s.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: start a local one)")
    s.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance")
    s.add_argument("--limit", type=int, default=None, help="at most this many examples per dataset")
    s.add_argument("--fresh", action="store_true", help="discard this run's stored results first")
    s.add_argument("--report", action="store_true", help="only print and export the tables of the stored results")
    s.add_argument("--out", default=None, help="folder for the CSV/LaTeX tables (default results/<name>/)")
    s.add_argument("--figures", action="store_true", help="also write plotly figures (HTML) next to the tables")
    s.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (local) or per Ray worker; 1 is fastest on a busy machine",
    )
    s.add_argument("--check", action="store_true", help="validate the config and exit")
    s.add_argument(
        "--check-sizes",
        action="store_true",
        help="kind: context only: the config's `check` sizes (short contexts; what the shipped check recomputes)",
    )


def _config_kind(path) -> str | None:
    """The `kind` of a YAML config (None when it is not a readable mapping: `load_config` says why)."""
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return raw.get("kind") if isinstance(raw, dict) else None


def cmd_bench(args) -> None:
    if _config_kind(args.config) == "context":
        from ctxmix.benchmark.context.bench import cmd_context_bench

        cmd_context_bench(args)
        return
    plan = load_config(args.config, limit=args.limit)
    if args.check:
        print(
            f"config {args.config} is valid: {len(plan.runs)} model x dataset run(s), methods "
            f"{', '.join(plan.methods)}, metrics {', '.join(plan.metrics) or '(none)'}"
        )
        return
    db = Path(args.db) if args.db else default_db(plan)
    if args.report:
        if not db.is_file():
            raise BadInput(f"no results file {db}; run the benchmark first")
        with ResultsStore(db) as store:
            store.write_aggregates(plan.run_id)
    else:
        try:
            db = run_bench(
                plan,
                db=db,
                executor=args.executor,
                fresh=args.fresh,
                ray_address=args.ray_address,
                num_cpus=args.num_cpus,
                threads=args.threads,
            )
        except KeyboardInterrupt:
            raise SystemExit(130) from None
    from ctxmix.benchmark.tables import report

    out = Path(args.out) if args.out else db.parent / plan.name
    print(report(db, plan, out_dir=out, figures=args.figures))
