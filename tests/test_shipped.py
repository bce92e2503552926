"""The results that ship with ctxmix: readable, of the config as it is now, and complete. (That
their numbers are what the code computes today is checked by the slow end-to-end run in
tests/test_runner.py, which recomputes the shipped check scores; here, that its tolerance passes
what moves between machines and fails a real change.)

Stored numbers: `make test-stored-isas` reruns these under ATen's default and AVX2 kernels."""

from pathlib import Path

import numpy as np
import pytest
import yaml

from ctxmix import benchmark as runner
from ctxmix.benchmark import shipped, tables

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.stored_numbers


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


@pytest.mark.parametrize("name", ["embedded", "embedded-lm"])
def test_check_tolerance_passes_machine_moves_and_fails_a_one_percent_change(name):
    """`shipped.check_moves`, the end-to-end tests' comparison, on the shipped check scores themselves. Passes:
    every score moved by 5x the worst move measured between kernel sets (3.2e-5 of its (model, method, metric)'s
    scale, either sign), and every score moved by 1e-4 of itself (beyond the old rtol, as a rerun on another
    machine moved one). Fails: each method's numbers scaled by 1.01 (a real regression), for every method with a
    nonzero score, and a score that went missing or became NaN."""
    want = shipped.load_check(name)
    assert shipped.check_moves(want, want).empty
    scale = want["value"].abs().groupby([want["model"], want["method"], want["metric"]]).transform("max")
    sign = np.where(np.random.default_rng(0).random(len(want)) < 0.5, -1.0, 1.0)
    assert shipped.check_moves(want.assign(value=want["value"] + sign * 5 * 3.2e-5 * scale), want).empty
    assert shipped.check_moves(want.assign(value=want["value"] * (1 + 1e-4)), want).empty
    for (model, method), rows in want.groupby(["model", "method"]):
        if not (rows["value"] != 0).any():
            continue
        moved = want.assign(value=np.where(want.index.isin(rows.index), want["value"] * 1.01, want["value"]))
        bad = shipped.check_moves(moved, want)
        assert len(bad) and set(zip(bad["model"], bad["method"])) == {(model, method)}, (model, method)
    assert len(shipped.check_moves(want.iloc[1:], want)) == 1
    assert len(shipped.check_moves(want.assign(value=want["value"].where(want.index != 3)), want)) == 1


def test_a_context_config_pinning_the_official_seeds_keeps_its_identity(tmp_path):
    """`mask_seeds: official` names how the shipped context results were made (before the key existed): the
    config's hash is unchanged by it, and changed by the per-example scheme. The same for an offline task's
    `split: test` and the `examples` record."""
    from ctxmix.benchmark.shipped import config_sha256

    base = "kind: context\nmodel: smollm2\n"
    (tmp_path / "a.yaml").write_text(base)
    (tmp_path / "b.yaml").write_text(base + "mask_seeds: official\n")
    (tmp_path / "c.yaml").write_text(base + "mask_seeds: example\n")
    assert config_sha256(tmp_path / "a.yaml") == config_sha256(tmp_path / "b.yaml")
    assert config_sha256(tmp_path / "a.yaml") != config_sha256(tmp_path / "c.yaml")
    # an offline task's split: test (the builders' default) and the `examples` record keep it too; another
    # split, or a hub task's split (a dataset split of its own), changes it
    task = "tasks:\n  - {id: needles, n: 2%s}\n  - {id: cnn_dm, n: 2%s}\n"
    identity = {
        "d": base + task % ("", ""),
        "e": base + task % (", split: test", "") + "examples: {tasks: {needles: {n: 2}}}\n",
        "f": base + task % (", split: validation", ""),
        "g": base + task % ("", ", split: test"),
    }
    for name, text in identity.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    sha = {name: config_sha256(tmp_path / f"{name}.yaml") for name in identity}
    assert sha["d"] == sha["e"] and len({sha["d"], sha["f"], sha["g"]}) == 3


def test_numbers_quoted_in_the_code_are_the_shipped_ones():
    """A number the code quotes to users (a method's caveat, a module's account of what ships) comes from a shipped
    file, and stays pinned to it here: the key-mask caveats' held-out LDS are smollm2's validation table's (they
    quoted an older table's 0.38 / 0.79 / 0.82), the AT2 module names every weights file that ships, and the rows
    trace's block holds the rows its docstring says at 32 heads and 4,096 keys."""
    import json
    import re
    from pathlib import Path

    import ctxmix
    import ctxmix.methods.context.at2 as at2
    from ctxmix.engine import attention
    from ctxmix.methods.registry import CONTEXT_METHODS

    root = Path(ctxmix.__file__).parent
    lds = json.loads((root / "benchmark" / "shipped" / "onepass-validation.json").read_text())["methods"]
    quoted = {
        "key_mask_grad": {"key_mask_grad": 0, "contextcite": 1},
        "key_mask_ig": {"key_mask_ig": 0, "contextcite": 1, "logit": 2},
    }
    for method, where in quoted.items():
        caveat = CONTEXT_METHODS[method].caveat
        numbers = [float(x) for x in re.findall(r"(?<![\d.=])0\.\d\d(?!\d)", caveat)]
        for name, i in where.items():
            assert numbers[i] == round(lds[name]["lds"], 2), (method, name, numbers, lds[name]["lds"])
    shipped = sorted(p.stem for p in (root / "methods" / "context" / "at2_weights").glob("*.npz"))
    assert shipped == ["gemma3", "smollm2"] and all(name in at2.__doc__ for name in shipped)
    said = re.findall(r"(\d+) rows at 32 heads and 4,096", Path(attention.__file__).read_text())
    assert said == [str(attention.query_block_rows(32, 4096, 4))]  # float32 scores, 4 copies, 64 MiB
