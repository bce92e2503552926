"""Benchmarks: method x metric tables from the benchmark runner's results store (or, on a fresh
install, the results that ship with ctxmix), the papers' published numbers alongside and on
their own, and a button that runs the embedded benchmark in the background."""

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pandas as pd
import streamlit as st
import yaml

from ctxmix_dashboard.ui import common

common.page_setup()

from ctxmix.benchmark import shipped, tables

# the configs ship inside ctxmix (a config's "configs/<name>.yaml" is relative to that package folder);
# results go where the dashboard was started, or to CTXMIX_BENCH_DIR
ROOT = shipped.PACKAGE_DIR
RESULTS = Path(os.environ.get("CTXMIX_BENCH_DIR") or "results").resolve()

st.title("Benchmarks")
st.caption(
    "Every method scored on a dataset by faithfulness and agreement metrics (`python -m ctxmix bench "
    "--config configs/<name>.yaml`). Means ± std over examples; * marks the best of each column by the "
    "metric's own direction (↑ higher is better, ↓ lower)."
)


def _background_run() -> None:
    """Start the embedded benchmark as its own process: it survives page reloads, and the
    runner resumes where it stopped if it is killed."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    log = open(RESULTS / "embedded.log", "ab")
    subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ctxmix",
            "bench",
            "--config",
            str(ROOT / "configs" / "embedded.yaml"),
            "--db",
            str(RESULTS / "embedded.sqlite"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    st.session_state["bench_started"] = True


with st.expander(
    "Run the embedded benchmark (offline, a few minutes on 2 CPU cores)", expanded=not list(RESULTS.glob("*.sqlite"))
):
    st.write(
        "minilm-sentiment on the Pang & Lee sentences and minilm on the template agreement set, every "
        "method that applies, every metric that applies. It runs in the background; finished work is kept "
        "if it is stopped, and a new start resumes it."
    )
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
sources = [f"computed here: {f.name}" for f in files] + [f"shipped with ctxmix: {n}" for n in shipped.shipped_names()]
if not sources:
    st.info(f"No results yet in {RESULTS}. Run a benchmark (button above, or the command line).")
    st.stop()

with common.errors_as_messages():
    qp_src = common.qp("db")
    src = st.selectbox(
        "Results",
        sources,
        key="results_source",
        index=next((k for k, x in enumerate(sources) if x.endswith(f": {qp_src}")), 0),
        help="'computed here': a results store of this machine (results/); 'shipped': the results "
        "that come with ctxmix, computed by the runner from a config of this repository.",
    )
    pick = src.split(": ", 1)[1]
    if src.startswith("shipped"):
        agg, meta = shipped.load_shipped(pick)
        run, version = meta["name"], meta["ctxmix_version"]
        cfg = yaml.safe_load((ROOT / meta["config"]).read_text()) if (ROOT / meta["config"]).exists() else {}
        st.info(
            f"Shipped results: computed by `{meta['command']}` with ctxmix {version} on {meta['date'][:10]} "
            f"({meta.get('machine', '')}); config hash {meta['config_hash']}. Run the benchmark above to "
            "recompute them on this machine."
        )
        for why in shipped.stale_reasons(pick, ROOT):
            st.warning(f"These shipped results may be stale: {why}.")
    else:
        db = RESULTS / pick
        with sqlite3.connect(str(db)) as c:
            runs = pd.read_sql_query("SELECT run_id, config_json, ctxmix_version FROM runs", c)
        if runs.empty:
            st.info("This results file holds no finished run yet.")
            st.stop()
        run = st.selectbox("Run", list(runs.run_id), index=0)
        cfg = json.loads(runs.set_index("run_id").at[run, "config_json"])
        version = runs.set_index("run_id").at[run, "ctxmix_version"]
        agg = tables.load_aggregates(db, run)
        st.caption(f"Computed on this machine by ctxmix {version}: {db}.")
    if agg.empty:
        st.info("No aggregates yet: the run is still going, or was stopped before its first aggregate.")
        st.stop()
    c1, c2 = st.columns(2)
    in_runs = [r.get("model") for r in (cfg.get("runs") or []) if isinstance(r, dict)]  # the config's order first
    models = sorted(agg.model.unique(), key=lambda m: (in_runs.index(m) if m in in_runs else len(in_runs), m))
    model = c1.selectbox("Model", models)
    datasets = sorted(agg[agg.model == model].dataset.unique())
    dataset = c2.selectbox("Dataset", datasets)
    common.set_qp(db=pick)
    common.set_provenance(
        results=src, run=run, results_ctxmix_version=version, config_name=cfg.get("name"), model=model, dataset=dataset
    )
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
        st.caption("'paper': quoted from the publication; 'ctxmix': computed by ctxmix (above).")
        comp = tables.paper_comparison(table, paper, model, dataset)
        if comp.empty:
            st.caption("The config's published numbers do not cover this model and dataset.")
        else:
            st.dataframe(comp, width="stretch")
            common.export_table(comp, f"{run}_paper_vs_ctxmix")

    per_layer = sorted(
        m for m in agg[(agg.model == model) & (agg.dataset == dataset) & (agg.layer >= 0)].metric.unique()
    )
    if per_layer:
        st.subheader("Per-layer metrics")
        metric = st.selectbox("Metric", per_layer)
        lt = tables.layer_table(agg, metric, model, dataset)
        common.plot(tables.layer_figure(lt), f"{run}_{metric}_layers", data=lt.reset_index())

    M = tables.agreement_matrix(agg, model, dataset)
    if not M.empty and M.shape[0] > 1:
        st.subheader("Agreement between methods")
        common.plot(tables.agreement_figure(M), f"{run}_agreement", data=M.reset_index())


st.divider()
st.subheader("Published numbers (quoted from the papers, not computed here)")
papers = {}
for path in sorted((ROOT / "configs").glob("*.yaml")):
    try:
        c = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        continue
    if isinstance(c, dict) and isinstance(c.get("paper"), dict) and c["paper"].get("values"):
        papers[path.stem] = c
if papers:
    with common.errors_as_messages():
        name = st.selectbox(
            "Paper config",
            list(papers),
            key="paper_config",
            format_func=lambda k: f"{k}: {papers[k]['paper'].get('source') or papers[k]['paper'].get('title', '')}",
        )
        pv = shipped.paper_table(papers[name])
        st.caption(
            f"Quoted from {papers[name]['paper'].get('source') or papers[name]['paper'].get('title', name)}. "
            f"Recompute them with `python -m ctxmix bench --config configs/{name}.yaml` (most need the "
            "papers' checkpoints and datasets from the Hugging Face hub)."
        )
        st.dataframe(pv, width="stretch")
        common.export_table(
            pv.reset_index(), f"{name}_published", caption=f"Published numbers of {name}", key=f"paper_{name}"
        )
        with st.expander("Every published value with its std"):
            st.dataframe(shipped.paper_values(papers[name]), width="stretch", hide_index=True)


st.divider()
st.subheader("Context attribution (configs/context*.yaml)")
with common.errors_as_messages():
    from ctxmix.benchmark.context import summary as context_summary
    from ctxmix.benchmark.context.bench import context_table

    names = shipped.shipped_names("context")
    if not names:
        st.info(
            "No shipped context-attribution results in this install. Make them with "
            "`python bench/ship_results.py --context` (about 35 minutes on 2 CPU cores), or run "
            "`python -m ctxmix bench --config configs/context.yaml` to see them in the terminal and results/context/."
        )
    else:
        name = st.radio(
            "Model",
            names,
            horizontal=True,
            key="context_results",
            format_func=lambda n: f"{n} ({shipped.load_context_shipped(n)[1].get('model', n)})",
            help="One shipped benchmark per model: the same tasks, scored the same way.",
        )
        cagg, cmeta = shipped.load_context_shipped(name)
        st.caption(
            f"Shipped results: computed by `{cmeta['command']}` with ctxmix {cmeta['ctxmix_version']} on "
            f"{cmeta['date'][:10]} ({cmeta.get('cpu', cmeta.get('machine', ''))}); {cmeta.get('counts', '')} "
            f"Which sources of a context made {cmeta.get('model', 'the model')} answer as it did, each method "
            "scored against removal ablations: topk_drop@k (log P(response) minus log P(response) without the "
            "method's top-k sources), lds (Spearman over held-out random ablations), recall@k (the gold source among "
            "the top k), seconds and time_vs_contextcite (each method's time, and its ratio to ContextCite's, where "
            "recorded). Means over examples; ↑ higher is better, ↓ lower."
        )
        for why in shipped.stale_reasons(name, ROOT):
            st.warning(f"These shipped results may be stale: {why}.")
        summary = context_summary.summary_table(cagg)
        st.markdown("**Every task** (means over tasks)")
        st.dataframe(summary.style.format(precision=3, subset=[c for c in summary.columns if c != "tasks"]))
        common.export_table(summary.reset_index(), f"{name}_summary", caption=f"{name}: means over tasks")
        st.caption(context_summary.moonshot(summary).sentence())
        if "long" in set(cagg["task"]):
            long_verdict = context_summary.moonshot(context_summary.summary_table(cagg, ["long"]))
            st.caption("Long contexts (1,000-4,000 tokens) alone: " + long_verdict.sentence())
        for task in dict.fromkeys(cagg["task"]):
            ct = context_table(cagg, task)
            st.markdown(f"**{task}**")
            st.dataframe(ct.style.format(precision=3, subset=[c for c in ct.columns if c != "n"]), width="stretch")
            common.export_table(ct, f"{name}_{task}", caption=f"{name} on {task}: methods x metrics")
