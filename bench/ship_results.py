"""Make the benchmark results that ship with ctxmix (ctxmix/benchmark/shipped/), so the Benchmarks page
shows method x metric tables on a fresh install before anyone runs anything.

    python bench/ship_results.py                      # runs configs/embedded.yaml in full (~10 min, 2 cores)
    python bench/ship_results.py --db results/embedded.sqlite   # from a finished run of the same config

Writes ctxmix/benchmark/shipped/<name>.aggregates.csv (the runner's aggregates), <name>.check.csv (every
per-example score of a `--limit 2` run, which the slow tests of tests/test_runner.py recompute: a method or
metric whose numbers moved beyond what moves between machines (`shipped.check_moves`) makes the shipped
results stale) and <name>.json (ctxmix version, config hashes, date, command, machine: its CPU and the
kernels torch picked, since minilm-sentiment is fine-tuned on the machine that runs this).

Context attribution (configs/context.yaml, kind: context; about 35 minutes on one thread of a 2-core CPU):

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/ship_results.py --context   # check run, then the full run
    python bench/ship_results.py --context --from results/context      # from a finished full run's folder
    python bench/ship_results.py --context --check-only                # context.check.csv alone (~2.5 min)

After changing the config's examples or methods, first store the new responses: python bench/context_responses.py.

The full run is `python -m ctxmix bench --config configs/context.yaml --threads 1` (resumable: its finished
examples stay in results/context.jsonl); the check run is the same with `--check-sizes --limit 2` (the
config's `check` sizes: short contexts, under 2 minutes), whose `check.csv` rows (every method's source
scores, the measured log-probabilities, the metrics) tests/test_context_bench.py recomputes and compares
with `shipped.context_check_moves`. Writes context.aggregates.csv, context.check.csv and context.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ctxmix import __version__
from ctxmix import benchmark as runner
from ctxmix.benchmark import tables
from ctxmix.benchmark.shipped import CHECK_LIMIT, SHIPPED, config_sha256


def _bench(config: Path, db: Path, limit: int | None) -> None:
    cmd = [sys.executable, "-m", "ctxmix", "bench", "--config", str(config), "--db", str(db), "--threads", "1"]
    cmd += ["--limit", str(limit)] if limit is not None else []
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def _cpu() -> str:
    """The CPU's model name and the ATen kernel set torch picked on it (e.g. "AMD EPYC, AVX512")."""
    import torch

    name = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {torch.backends.cpu.get_cpu_capability()}"


def _context_bench(config: Path, out: Path, db: Path, *extra: str) -> None:
    cmd = [sys.executable, "-m", "ctxmix", "bench", "--config", str(config), "--threads", "1"]
    cmd += ["--out", str(out), "--db", str(db), *extra]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def ship_context(config: Path, finished: Path | None, check_only: bool = False) -> None:
    """context.{aggregates.csv,check.csv,json} from a full run (`finished`: its --out folder; else run now,
    resumable in results/context.jsonl) and a `--check-sizes --limit 2` run; `check_only`: context.check.csv
    alone (the page shows no context results until the full run's files are there)."""
    import pandas as pd
    import yaml

    from ctxmix.benchmark.context.bench import at2_weights_sha256, load_context_config

    cfg = load_context_config(config)
    name = cfg.get("name") or config.stem
    with tempfile.TemporaryDirectory() as tmp:
        chk = Path(tmp) / "check"
        _context_bench(config, chk, Path(tmp) / "check.jsonl", "--check-sizes", "--limit", str(CHECK_LIMIT))
        check = pd.read_csv(chk / "check.csv")
        check_dropped = yaml.safe_load((chk / "dropped.yaml").read_text(encoding="utf-8"))
    if any(check_dropped.values()):  # stored responses without the answer: the same on every machine
        print(f"note: the check run drops {check_dropped} (their stored responses lack the answer)")
    check.to_csv(SHIPPED / f"{name}.check.csv", index=False, float_format="%.17g")  # float64 exactly
    if check_only:
        print(f"wrote {SHIPPED}/{name}.check.csv: {len(check)} rows")
        return
    full = finished or ROOT / "results" / name
    if finished is None:
        _context_bench(config, full, ROOT / "results" / f"{name}.jsonl")
    agg = pd.read_csv(full / "aggregates.csv")
    dropped = yaml.safe_load((full / "dropped.yaml").read_text(encoding="utf-8"))
    agg.to_csv(SHIPPED / f"{name}.aggregates.csv", index=False, float_format="%.10g")
    counts = agg.groupby("task")["n"].max().to_dict()
    meta = {
        "name": name,
        "kind": "context",
        "config": f"configs/{config.name}",
        "model": cfg["model"],
        "ctxmix_version": __version__,
        "config_sha256": config_sha256(config),
        "at2_weights_sha256": at2_weights_sha256(cfg),  # None: no at2_exact, or untrained weights
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": f"python -m ctxmix bench --config configs/{config.name} --threads 1",
        "check": f"check.csv of --check-sizes --limit {CHECK_LIMIT}",
        "counts": "examples kept per task: "
        + ", ".join(f"{t} {n} ({len(dropped.get(t) or [])} dropped)" for t, n in counts.items())
        + ".",
        "dropped": dropped,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu": _cpu(),
        "python": platform.python_version(),
    }
    (SHIPPED / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {SHIPPED}/{name}.{{aggregates.csv,check.csv,json}}: {len(agg)} aggregates, {len(check)} check rows")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--config", default=None, help="default configs/embedded.yaml (configs/context.yaml with --context)"
    )
    ap.add_argument("--db", help="a finished results store of the same config (else the config is run in full)")
    ap.add_argument("--context", action="store_true", help="a kind: context config (configs/context.yaml)")
    ap.add_argument("--from", dest="finished", help="--context: the --out folder of a finished full run")
    ap.add_argument("--check-only", action="store_true", help="--context: write context.check.csv only")
    args = ap.parse_args()
    if args.context:
        cfg = Path(args.config or ROOT / "configs" / "context.yaml")
        ship_context(cfg, Path(args.finished) if args.finished else None, args.check_only)
        return
    args.config = args.config or str(ROOT / "configs" / "embedded.yaml")
    config = Path(args.config)
    plan = runner.load_config(config)
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(args.db) if args.db else Path(tmp) / "full.sqlite"
        if not args.db:
            _bench(config, db, None)
        check_db = Path(tmp) / "check.sqlite"
        _bench(config, check_db, CHECK_LIMIT)
        agg = tables.load_aggregates(db, plan.name).drop(columns=["run_id"])
        check = tables.load_scores(check_db, plan.name)[
            ["model", "dataset", "example_id", "method", "metric", "layer", "value"]
        ]
        with sqlite3.connect(str(db)) as c:
            units = dict(
                c.execute("SELECT status, COUNT(*) FROM units WHERE run_id=? GROUP BY status", (plan.name,)).fetchall()
            )
    SHIPPED.mkdir(exist_ok=True)
    agg.sort_values(["model", "dataset", "method", "metric", "layer"]).to_csv(
        SHIPPED / f"{plan.name}.aggregates.csv", index=False, float_format="%.10g"
    )
    check.sort_values(["model", "dataset", "example_id", "method", "metric", "layer"]).to_csv(
        SHIPPED / f"{plan.name}.check.csv", index=False, float_format="%.10g"
    )
    meta = {
        "name": plan.name,
        "config": f"configs/{config.name}",  # relative to ctxmix/benchmark (shipped.PACKAGE_DIR), as configs/ links
        "ctxmix_version": __version__,
        "config_hash": plan.config_hash(),
        "config_sha256": config_sha256(config),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": f"python -m ctxmix bench --config configs/{config.name}",
        "check": f"the per-example scores of --limit {CHECK_LIMIT}",
        "units": units,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu": _cpu(),
        "python": platform.python_version(),
    }
    (SHIPPED / f"{plan.name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(
        f"wrote {SHIPPED}/{plan.name}.{{aggregates.csv,check.csv,json}}: "
        f"{len(agg)} aggregates, {len(check)} check scores"
    )


if __name__ == "__main__":
    main()
