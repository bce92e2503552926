"""Benchmarks: method x metric tables from the benchmark runner's results store, the papers'
numbers alongside, and a button that runs the embedded benchmark in the background."""

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pandas as pd
import streamlit as st

from ui import common

common.page_setup()

from ctxmix import tables  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("CTXMIX_BENCH_DIR") or ROOT / "results")

st.title("Benchmarks")
st.caption("Every method scored on a dataset by faithfulness and agreement metrics (`python -m ctxmix bench "
           "--config configs/<name>.yaml`). Means ± std over examples; * marks the best of each column by the "
           "metric's own direction (↑ higher is better, ↓ lower).")


def _background_run() -> None:
    """Start the embedded benchmark as its own process: it survives page reloads, and the
    runner resumes where it stopped if it is killed."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    log = open(RESULTS / "embedded.log", "ab")
    subprocess.Popen([sys.executable, "-m", "ctxmix", "bench", "--config", str(ROOT / "configs" / "embedded.yaml"),
                      "--db", str(RESULTS / "embedded.sqlite")], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                     start_new_session=True)
    st.session_state["bench_started"] = True


with st.expander("Run the embedded benchmark (offline, a few minutes on 2 CPU cores)",
                 expanded=not list(RESULTS.glob("*.sqlite"))):
    st.write("minilm-sentiment on the Pang & Lee sentences and minilm on the template agreement set, every "
             "method that applies, every metric that applies. It runs in the background; finished work is kept "
             "if it is stopped, and a new start resumes it.")
    if common.hosted():
        st.info("Starting benchmarks is disabled in hosted mode; run them on the server with the command above.")
    else:
        st.button("Run configs/embedded.yaml", on_click=_background_run, type="primary")


@st.fragment(run_every=3)
def progress() -> None:
    db = RESULTS / "embedded.sqlite"
    if not st.session_state.get("bench_started") or not db.exists():
        return
    try:
        with sqlite3.connect(str(db), timeout=5) as c:
            done = dict(c.execute("SELECT status, COUNT(*) FROM units GROUP BY status").fetchall())
    except sqlite3.Error:
        done = {}
    log = (RESULTS / "embedded.log").read_text(errors="replace")[-4000:] if (RESULTS / "embedded.log").exists() else ""
    tail = log.replace("\r", "\n").strip().splitlines()[-1:] if log else []
    st.info(f"Embedded benchmark: {sum(done.values())} work units finished. " + (tail[0] if tail else ""))


progress()

files = sorted(RESULTS.glob("*.sqlite"))
if not files:
    st.info(f"No results yet in {RESULTS}. Run a benchmark (button above, or the command line).")
    st.stop()

with common.errors_as_messages():
    names = [f.name for f in files]
    pick = st.selectbox("Results file", names, index=names.index(common.qp("db")) if common.qp("db") in names else 0)
    db = RESULTS / pick
    with sqlite3.connect(str(db)) as c:
        runs = pd.read_sql_query("SELECT run_id, config_json, ctxmix_version FROM runs", c)
    if runs.empty:
        st.info("This results file holds no finished run yet.")
        st.stop()
    run = st.selectbox("Run", list(runs.run_id), index=0)
    cfg = json.loads(runs.set_index("run_id").at[run, "config_json"])
    agg = tables.load_aggregates(db, run)
    if agg.empty:
        st.info("No aggregates yet: the run is still going, or was stopped before its first aggregate.")
        st.stop()
    c1, c2 = st.columns(2)
    model = c1.selectbox("Model", sorted(agg.model.unique()))
    datasets = sorted(agg[agg.model == model].dataset.unique())
    dataset = c2.selectbox("Dataset", datasets)
    common.set_qp(db=pick)
    common.set_provenance(results_file=pick, run=run, results_ctxmix_version=runs.set_index("run_id").at[run, "ctxmix_version"],
                          config_name=cfg.get("name"), model=model, dataset=dataset)
    common.reproduce(f"python -m ctxmix bench --config configs/{cfg.get('name', run)}.yaml --report")

    table = tables.method_table(agg, model, dataset)
    metrics = table.attrs.get("metrics", [])
    chosen = st.multiselect("Metrics", metrics, default=metrics)
    if chosen != metrics:
        table = tables.method_table(agg, model, dataset, metrics=chosen)
    st.subheader(f"{model} on {dataset}")
    st.dataframe(tables.format_table(table), width="stretch")
    common.export_table(table, f"{run}_{model}_{dataset}", caption=f"{model} on {dataset}: methods x metrics")
    if table.attrs.get("metrics"):
        common.plot(tables.table_figure(table), f"{run}_{model}_{dataset}_bars", data=table.reset_index())

    paper = cfg.get("paper")
    if paper:
        st.subheader(f"Paper vs ctxmix: {paper.get('title', '')}")
        comp = tables.paper_comparison(table, paper, model, dataset)
        if comp.empty:
            st.caption("The config's published numbers do not cover this model and dataset.")
        else:
            st.dataframe(comp, width="stretch")
            common.export_table(comp, f"{run}_paper_vs_ctxmix")

    per_layer = sorted(m for m in agg[(agg.model == model) & (agg.dataset == dataset) & (agg.layer >= 0)].metric.unique())
    if per_layer:
        st.subheader("Per-layer metrics")
        metric = st.selectbox("Metric", per_layer)
        lt = tables.layer_table(agg, metric, model, dataset)
        common.plot(tables.layer_figure(lt), f"{run}_{metric}_layers", data=lt.reset_index())

    M = tables.agreement_matrix(agg, model, dataset)
    if not M.empty and M.shape[0] > 1:
        st.subheader("Agreement between methods")
        common.plot(tables.agreement_figure(M), f"{run}_agreement", data=M.reset_index())
