"""The results store: SQLite (WAL), resumable units, scores, saliencies, aggregates."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path

from ctxmix.benchmark.config import DONE_STATUSES, REFUSED, DatasetSpec, ModelSpec, Plan
from ctxmix.benchmark.datasets import Example
from ctxmix.errors import BadInput

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
        from ctxmix import __version__

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
                "it, or give the config another name."
            )
        with self.conn:
            if row:
                self.conn.execute(
                    "UPDATE runs SET config_json=?, updated=?, ctxmix_version=? WHERE run_id=?",
                    (cfg, time.time(), __version__, plan.run_id),
                )
            else:
                self.conn.execute(
                    "INSERT INTO runs VALUES(?,?,?,?,?,?,?)",
                    (plan.run_id, plan.name, cfg, h, __version__, time.time(), time.time()),
                )

    def delete_run(self, run_id: str) -> None:
        with self.conn:
            for t in (
                "runs",
                "datasets",
                "examples",
                "units",
                "scores",
                "saliency",
                "skips",
                "errors",
                "computations",
                "aggregates",
            ):
                self.conn.execute(f"DELETE FROM {t} WHERE run_id=?", (run_id,))

    def record_dataset(self, run_id: str, spec: DatasetSpec, examples: list[Example], n_empty: int) -> None:
        ident = spec.identity()
        row = self.conn.execute(
            "SELECT identity FROM datasets WHERE run_id=? AND dataset=?", (run_id, spec.id)
        ).fetchone()
        if row and row[0] != ident:
            raise BadInput(
                f"dataset {spec.id!r} of run {run_id!r} was defined differently before; rerun with --fresh "
                "or give the dataset another id"
            )
        with self.conn:
            self.conn.execute(
                "INSERT OR REPLACE INTO datasets VALUES(?,?,?,?,?)", (run_id, spec.id, ident, len(examples), n_empty)
            )
            self.conn.executemany(
                "INSERT OR IGNORE INTO examples VALUES(?,?,?,?,?,?)",
                [
                    (
                        run_id,
                        spec.id,
                        e.id,
                        e.text,
                        e.label,
                        json.dumps({"label_name": e.label_name, "text_pair": e.text_pair, "item": e.item}),
                    )
                    for e in examples
                ],
            )
            if n_empty:
                self.conn.execute(
                    "INSERT OR REPLACE INTO skips VALUES(?,?,?,?,?)",
                    (run_id, "*", spec.id, "*", f"{n_empty} row(s) with empty text"),
                )

    def finished_units(self, run_id: str) -> set[tuple[str, str, str, str]]:
        """(model, dataset, example, method) of the units not to compute again: done, na, skipped, and
        refused by this ctxmix version (a refusal is deterministic for its limits; another version's
        limits may differ, so its refusals are retried)."""
        from ctxmix import __version__

        marks = ",".join("?" * len(DONE_STATUSES))
        q = (
            "SELECT model, dataset, example_id, method FROM units WHERE run_id=? AND "
            f"(status IN ({marks}) OR (status=? AND ctxmix_version=?))"
        )
        return {tuple(r) for r in self.conn.execute(q, (run_id, *DONE_STATUSES, REFUSED, __version__))}

    def skipped_examples(self, run_id: str) -> set[tuple[str, str, str]]:
        return {
            tuple(r)
            for r in self.conn.execute(
                "SELECT model, dataset, example_id FROM skips WHERE run_id=? AND example_id != '*'", (run_id,)
            )
        }

    def stored_saliency(self, run_id: str, model: str, dataset: str, example_id: str, methods: Iterable[str]) -> dict:
        methods = list(methods)
        if not methods:
            return {}
        q = (
            f"SELECT method, values_json FROM saliency WHERE run_id=? AND model=? AND dataset=? AND example_id=? "
            f"AND method IN ({','.join('?' * len(methods))})"
        )
        return {m: json.loads(v) for m, v in self.conn.execute(q, (run_id, model, dataset, example_id, *methods))}

    # -- committing ---------------------------------------------------------------------------

    def commit_result(
        self, run_id: str, model: ModelSpec, dataset: str, example_id: str, res: dict, wanted: list[str]
    ) -> int:
        """Write one example's result: each unit in its own transaction. Returns units committed."""
        from ctxmix import __version__

        now = time.time()
        if res.get("status") == "error":
            with self.conn:
                self.conn.execute(
                    "INSERT INTO errors VALUES(?,?,?,?,?,?)",
                    (run_id, model.label, dataset, example_id, res.get("reason", ""), now),
                )
            return 0
        rev, fp = res.get("model_revision", ""), res.get("fingerprint", "")

        def unit(method: str, status: str, detail: str, target, seconds: float) -> None:  # one row of `units`
            self.conn.execute(
                "INSERT OR REPLACE INTO units VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    run_id,
                    model.label,
                    dataset,
                    example_id,
                    method,
                    status,
                    detail,
                    model.name,
                    rev,
                    fp,
                    __version__,
                    target,
                    seconds,
                    now,
                ),
            )

        if res.get("status") == "skipped":
            with self.conn:
                self.conn.execute(
                    "INSERT OR REPLACE INTO skips VALUES(?,?,?,?,?)",
                    (run_id, model.label, dataset, example_id, res.get("reason", "")),
                )
                for m in wanted:
                    unit(m, "skipped", res.get("reason", ""), None, 0.0)
            return len(wanted)
        with self.conn:  # reference saliencies first, so a later unit of this example can reuse them
            for r, vals in (res.get("references") or {}).items():
                self.conn.execute(
                    "INSERT OR REPLACE INTO saliency VALUES(?,?,?,?,?,?,?,?,?,?)",
                    (
                        run_id,
                        model.label,
                        dataset,
                        example_id,
                        r,
                        "reference",
                        json.dumps(res.get("tokens")),
                        json.dumps(vals),
                        res.get("position"),
                        res.get("target"),
                    ),
                )
        n_done = sum(1 for m in res["methods"].values() if m["status"] == "done") or 1
        per = res.get("seconds", 0.0) / n_done
        count = 0
        for m, r in res["methods"].items():
            with self.conn:
                unit(
                    m,
                    r["status"],
                    r.get("detail", res.get("target_note", "")),
                    res.get("target"),
                    per if r["status"] == "done" else 0.0,
                )
                if r["status"] == "done":
                    self.conn.executemany(
                        "INSERT OR REPLACE INTO scores VALUES(?,?,?,?,?,?,?,?,?,?,?)",
                        [
                            (
                                run_id,
                                model.label,
                                model.name,
                                rev,
                                __version__,
                                dataset,
                                example_id,
                                m,
                                k,
                                int(layer),
                                None if v is None or not math.isfinite(v) else float(v),
                            )
                            for k, layer, v in r["scores"]
                        ],
                    )
                    if r.get("saliency") is not None:
                        self.conn.execute(
                            "INSERT OR REPLACE INTO saliency VALUES(?,?,?,?,?,?,?,?,?,?)",
                            (
                                run_id,
                                model.label,
                                dataset,
                                example_id,
                                m,
                                "method",
                                json.dumps(res.get("tokens")),
                                json.dumps(r["saliency"]),
                                res.get("position"),
                                res.get("target"),
                            ),
                        )
                    self.conn.execute(
                        "INSERT INTO computations VALUES(?,?,?,?,?,?,?)",
                        (run_id, model.label, dataset, example_id, m, res.get("pid"), now),
                    )
            count += 1
        return count

    # -- reading ------------------------------------------------------------------------------

    def frame(self, sql: str, params: tuple = ()):
        import pandas as pd

        return pd.read_sql_query(sql, self.conn, params=params)

    def write_aggregates(self, run_id: str) -> None:
        """Recompute the aggregates of a run from its scores and saliency vectors."""
        from ctxmix.benchmark.metrics import get_metric
        from ctxmix.benchmark.tables import aggregate_scores, agreement_long, model_agreement_long

        scores = self.frame(
            "SELECT model, dataset, example_id, method, metric, layer, value FROM scores WHERE run_id=?", (run_id,)
        )
        agg = aggregate_scores(scores)
        sal = self.frame(
            "SELECT model, dataset, example_id, method, tokens_json, values_json FROM saliency "
            "WHERE run_id=? AND role='method'",
            (run_id,),
        )
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
                [
                    (
                        run_id,
                        r.model,
                        r.dataset,
                        r.method,
                        r.metric,
                        int(r.layer),
                        None if pd.isna(r["mean"]) else float(r["mean"]),
                        None if pd.isna(r["std"]) else float(r["std"]),
                        int(r.n),
                        int(r.n_nan),
                        hib(r.metric),
                    )
                    for _, r in agg.iterrows()
                ],
            )

    def counts(self, run_id: str) -> dict:
        c = dict(
            self.conn.execute("SELECT status, COUNT(*) FROM units WHERE run_id=? GROUP BY status", (run_id,)).fetchall()
        )
        c["errors"] = self.conn.execute("SELECT COUNT(*) FROM errors WHERE run_id=?", (run_id,)).fetchone()[0]
        c["empty_rows"] = self.conn.execute(
            "SELECT COALESCE(SUM(n_empty),0) FROM datasets WHERE run_id=?", (run_id,)
        ).fetchone()[0]
        c["skipped_examples"] = self.conn.execute(
            "SELECT COUNT(*) FROM skips WHERE run_id=? AND example_id != '*'", (run_id,)
        ).fetchone()[0]
        return c
