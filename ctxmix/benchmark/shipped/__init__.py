"""Benchmark results that ship with ctxmix, so a fresh install shows tables at once.

`<name>.aggregates.csv` holds the runner's aggregates of `configs/<name>.yaml`, computed by
`bench/ship_results.py`; `<name>.json` says which ctxmix version, config (hash of its whole
content) and date made them; `<name>.check.csv` holds the per-example scores of a `--limit 2`
run, which tests/test_shipped.py recomputes, so the tests fail when a method or metric changed
since the results were made. Published numbers are not here: they live in each config's
`paper.values` and are shown as quoted (`paper_values`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd

SHIPPED = Path(__file__).resolve().parent
PACKAGE_DIR = SHIPPED.parent  # ctxmix/benchmark: a result's "config" path (configs/<name>.yaml) is relative to it
CHECK_LIMIT = 2  # examples per dataset in the check run


def config_sha256(path: str | Path) -> str:
    """Hash of a config's content (parsed YAML, so comments and layout do not count)."""
    import yaml

    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]


def shipped_names() -> list[str]:
    return sorted(
        p.name[: -len(".json")]
        for p in SHIPPED.glob("*.json")
        if (SHIPPED / p.name.replace(".json", ".aggregates.csv")).exists()
    )


def load_shipped(name: str = "embedded") -> tuple[pd.DataFrame, dict]:
    """(aggregates as `tables.load_aggregates` gives them, metadata) of a shipped result."""
    meta = json.loads((SHIPPED / f"{name}.json").read_text(encoding="utf-8"))
    agg = pd.read_csv(SHIPPED / f"{name}.aggregates.csv")
    agg.insert(0, "run_id", meta["name"])
    return agg, meta


def load_check(name: str = "embedded") -> pd.DataFrame:
    return pd.read_csv(SHIPPED / f"{name}.check.csv", dtype={"example_id": str})


def stale_reasons(name: str, root: str | Path = PACKAGE_DIR) -> list[str]:
    """Why a shipped result may no longer be what its config computes (empty: none known).
    The numbers themselves are checked by the tests (`load_check`)."""
    from ctxmix import __version__

    _, meta = load_shipped(name)
    why = []
    cfg = Path(root) / meta["config"]
    if not cfg.exists():
        why.append(f"{meta['config']} is gone")
    elif config_sha256(cfg) != meta["config_sha256"]:
        why.append(f"{meta['config']} changed since these results were made")
    if meta.get("ctxmix_version") != __version__:
        why.append(f"made by ctxmix {meta.get('ctxmix_version')}, this is {__version__}")
    return why


def paper_values(cfg: dict) -> pd.DataFrame:
    """A config's published numbers (`paper.values`), quoted, one row per value."""
    rows = [
        {
            "model": v.get("model", ""),
            "dataset": v.get("dataset", ""),
            "paper row": v.get("row", v.get("method")),
            "method": v.get("method"),
            "metric": v.get("metric"),
            "layer": v.get("layer", ""),
            "mean": v.get("mean"),
            "std": v.get("std"),
        }
        for v in ((cfg or {}).get("paper") or {}).get("values", [])
        if isinstance(v, dict)
    ]
    df = pd.DataFrame(rows, columns=["model", "dataset", "paper row", "method", "metric", "layer", "mean", "std"])
    return df.dropna(axis=1, how="all").loc[:, lambda d: [c for c in d.columns if (d[c].astype(str) != "").any()]]


def paper_table(cfg: dict) -> pd.DataFrame:
    """A config's published means as a table: one row per paper row (method), one column per
    (model, dataset, metric, layer) that varies; NaN where the paper prints none."""
    df = paper_values(cfg)
    if df.empty:
        return df
    keys = [c for c in ("model", "dataset", "metric", "layer") if c in df.columns and df[c].astype(str).nunique() > 1]
    if not keys:
        keys = ["metric"]
    df = df.assign(column=df[keys].astype(str).agg(" · ".join, axis=1))
    out = df.pivot_table(index="paper row", columns="column", values="mean", sort=False, aggfunc="first")
    out.columns.name = None
    return out
