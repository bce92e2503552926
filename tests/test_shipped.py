"""The results that ship with ctxmix: readable, of the config as it is now, and complete. (That
their numbers are what the code computes today is checked by the slow end-to-end run in
tests/test_runner.py, which recomputes the shipped check scores.)"""

from pathlib import Path

import yaml

from ctxmix import benchmark as runner
from ctxmix.benchmark import shipped, tables

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_embedded_results_match_the_config():
    agg, meta = shipped.load_shipped("embedded")
    assert meta["config"] == "configs/embedded.yaml"
    assert meta["config_sha256"] == shipped.config_sha256(ROOT / meta["config"]), (
        "configs/embedded.yaml changed: run python bench/ship_results.py"
    )
    plan = runner.load_config(ROOT / "configs/embedded.yaml")
    assert meta["config_hash"] == plan.config_hash()
    assert shipped.stale_reasons("embedded", ROOT) == []
    assert meta["units"] == {"done": meta["units"]["done"]} and meta["units"]["done"] > 0  # every unit finished
    for model, dataset in (("minilm-sentiment", "pang_lee"), ("minilm", "agreement")):
        t = tables.method_table(agg, model, dataset, plan.metrics)
        assert len(t) >= 10 and t["n"].max() >= 50, (model, dataset)
        assert t["mean rank"].notna().all()


def test_stale_reasons_name_a_changed_config(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    raw = yaml.safe_load((ROOT / "configs/embedded.yaml").read_text())
    (tmp_path / "configs/embedded.yaml").write_text(yaml.safe_dump(raw))  # same content, other layout
    assert shipped.stale_reasons("embedded", tmp_path) == []
    raw["explain"]["ig_steps"] = 20
    (tmp_path / "configs/embedded.yaml").write_text(yaml.safe_dump(raw))
    assert shipped.stale_reasons("embedded", tmp_path) == [
        "configs/embedded.yaml changed since these results were made"
    ]


def test_paper_tables_quote_every_published_value():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        values = (cfg.get("paper") or {}).get("values", [])
        t = shipped.paper_table(cfg)
        assert t.notna().sum().sum() == len(
            {(v.get("row", v["method"]), v.get("model"), v.get("dataset"), v["metric"], v.get("layer")) for v in values}
        ), path.name


def test_shipped_embedded_lm_results_rank_the_prediction_methods():
    agg, meta = shipped.load_shipped("embedded-lm")
    assert meta["config"] == "configs/embedded-lm.yaml"
    assert meta["config_sha256"] == shipped.config_sha256(ROOT / meta["config"]), (
        "configs/embedded-lm.yaml changed: run python bench/ship_results.py --config configs/embedded-lm.yaml"
    )
    plan = runner.load_config(ROOT / "configs/embedded-lm.yaml", check_models=False)
    assert meta["config_hash"] == plan.config_hash() and shipped.stale_reasons("embedded-lm", ROOT) == []
    assert meta["units"] == {"done": meta["units"]["done"]} and meta["units"]["done"] > 0
    t = tables.method_table(agg, "smollm2", "sva", plan.metrics)
    assert {"logit", "alti_logit", "decompx", "random"} <= set(t.index) and t["n"].max() >= 50
    assert "cue_mrr" in t.attrs["metrics"]
