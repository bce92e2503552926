"""The benchmark runner: config validation, datasets, the SQLite store, resuming, executors, tables."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import tiny_model

import ctxmix
import ctxmix.cli
from ctxmix import benchmark as runner
from ctxmix.benchmark import tables
from ctxmix.benchmark.agreement import PHENOMENA, AgreementItem, agreement_items, encode_items
from ctxmix.errors import BadInput

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer):
    """A tiny random BERT classifier saved as a folder, so any process can load it by name."""
    d = tmp_path_factory.mktemp("models")
    out = {}
    for fam in ("bert", "roberta"):
        m = tiny_model(fam, tokenizer, dtype=torch.float32)
        m.hf.config.architectures = [type(m.hf).__name__]
        m.hf.save_pretrained(d / fam, safe_serialization=True)
        tokenizer.save_pretrained(d / fam)
        out[fam] = str(d / fam)
    return out


def cfg(tmp_path, model, **kw):
    c = {
        "name": "t",
        "models": [model],
        "datasets": [{"id": "pl", "source": "pang_lee", "limit": 3}],
        "methods": ["attention", "alti", "grad", "random"],
        "metrics": ["spearman:grad_x_input", "aopc", "comprehensiveness"],
        "explain": {"ig_steps": 4},
    }
    c.update(kw)
    p = tmp_path / f"{c['name']}.yaml"
    p.write_text(yaml.safe_dump(c))
    return p


def q(db, sql, *args):
    with sqlite3.connect(str(db)) as c:
        return c.execute(sql, args).fetchall()


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------


def test_config_errors_are_all_listed_before_any_work(tmp_path):
    raw = {
        "name": "bad",
        "models": ["minilm", "no-such-model-xyz"],
        "datasets": ["pang_lee", {"id": "x", "source": "sst9"}],
        "methods": ["alti", "alit"],
        "metrics": ["aopc", "aopcc", "spearman:nomethod"],
    }
    with pytest.raises(BadInput) as e:
        runner.validate_config(raw)
    msg = str(e.value)
    assert "unknown model 'no-such-model-xyz'" in msg and "minilm-sentiment" in msg
    assert "unknown dataset 'sst9'" in msg and "pang_lee" in msg and "agreement" in msg
    assert "unknown method 'alit' (did you mean 'alti'?)" in msg and "value_zeroing" in msg
    assert "unknown metric 'aopcc'" in msg and "comprehensiveness" in msg
    assert "unknown reference method 'nomethod'" in msg
    db = tmp_path / "bad.sqlite"
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(raw))
    assert ctxmix.cli.main(["bench", "--config", str(p), "--db", str(db)]) == 2
    assert not db.exists()  # nothing was started


def test_config_shape_errors(tmp_path):
    with pytest.raises(BadInput, match="needs a name"):
        runner.validate_config({"models": ["minilm"], "datasets": ["pang_lee"]})
    with pytest.raises(BadInput, match="unknown config key"):
        runner.validate_config({"name": "a", "models": ["minilm"], "datasets": ["pang_lee"], "methodz": []})
    with pytest.raises(BadInput, match="no such file"):
        runner.validate_config(
            {"name": "a", "models": ["minilm"], "datasets": [{"source": "file", "path": "/nope.csv"}]}
        )
    with pytest.raises(BadInput, match="not among the models"):
        runner.validate_config(
            {
                "name": "a",
                "models": ["minilm"],
                "datasets": ["pang_lee"],
                "runs": [{"model": "x", "dataset": "pang_lee"}],
            }
        )
    with pytest.raises(BadInput, match="explain.ig_baseline"):
        runner.validate_config(
            {"name": "a", "models": ["minilm"], "datasets": ["pang_lee"], "explain": {"ig_baseline": "blank"}}
        )
    with pytest.raises(BadInput, match="no such config file"):
        runner.load_config(tmp_path / "missing.yaml")


def test_hub_datasets_fail_clearly_offline(monkeypatch):
    monkeypatch.setattr(runner.config, "_hub_reachable", lambda timeout=3.0: False)
    raw = {
        "name": "a",
        "models": ["minilm"],
        "datasets": [
            {
                "id": "sst2",
                "source": "hf",
                "path": "glue",
                "name": "sst2",
                "split": "validation",
                "text_field": "sentence",
            }
        ],
    }
    with pytest.raises(BadInput, match="Hugging Face hub") as e:
        runner.validate_config(raw)
    assert "pang_lee" in str(e.value) or "pip install datasets" in str(e.value)


def test_shipped_configs_are_valid(monkeypatch, tmp_path):
    monkeypatch.setattr(runner.config, "_check_hub_datasets", lambda specs, errors: None)
    lgd = tmp_path / "lgd.tsv"
    lgd.write_text("1\tthe keys to the cabinet are here\tthe keys to the cabinet ***mask*** here\tare\tis\n")
    paths = sorted((ROOT / "configs").glob("*.yaml"))
    assert {p.stem for p in paths} >= {
        "embedded",
        "globenc-table1",
        "decompx-table1",
        "alti-table2",
        "attcat-table1",
        "value-zeroing-table3",
        "ff-fig3-sst2",
    }
    for p in paths:
        raw = yaml.safe_load(p.read_text())
        if raw.get("kind") == "context":  # context attribution's own runner (tests/test_context_bench.py)
            from ctxmix.benchmark.context.bench import load_context_config

            load_context_config(p)
            continue
        for d in raw["datasets"]:
            if isinstance(d, dict) and d.get("source") == "linzen_goldberg":
                d["path"] = str(lgd)
        plan = runner.validate_config(raw, check_models=False, source=str(p))
        labels, ids = {m.label for m in plan.models}, {d.id for d in plan.datasets}
        for v in plan.paper.get("values", []):  # every published number points at something the run computes
            assert v["method"] in plan.methods, (p.name, v)
            assert v["metric"] in plan.metrics, (p.name, v)
            assert v.get("model", next(iter(labels))) in labels and v.get("dataset", next(iter(ids))) in ids
        if p.stem != "embedded":
            assert plan.paper.get("values"), p.name


# ---------------------------------------------------------------------------------------------
# datasets
# ---------------------------------------------------------------------------------------------


def test_agreement_set_is_seeded_and_marks_cues(tokenizer):
    a, b = agreement_items(10, seed=3), agreement_items(10, seed=3)
    assert a == b and a != agreement_items(10, seed=4)
    assert {it.phenomenon for it in a} == set(PHENOMENA) and len(a) == 40
    kept, dropped = encode_items(a, tokenizer)
    assert len(kept) == 40 and not dropped
    for it, e in kept:
        toks = tokenizer.convert_ids_to_tokens(e.input_ids)
        assert toks[e.position] == "[MASK]"
        # the first sub-word of each cue word ("waitresses" -> "waitress", "##es")
        assert [toks[c] for c in e.cues] == [tokenizer.tokenize(it.words[i])[0] for i in it.cue_indices]
        assert tokenizer.convert_ids_to_tokens([e.target_id, e.foil_id]) == [it.target, it.foil]
        assert it.good.split()[it.target_index] == it.target and it.bad.split()[it.target_index] == it.foil
        if it.phenomenon == "sva_attractor":  # the attractor has the other number
            assert it.attractor_index is not None
    # det-noun cues follow the target: no causal input for them
    kept_c, dropped_c = encode_items(a, tokenizer, causal=True)
    assert all(it.phenomenon in ("sva_attractor", "anaphor") for it, _ in kept_c)
    assert dropped_c == {"the cue follows the target (causal model)": 20}
    odd = AgreementItem(
        "x", "anaphor", ("The", "boys", "hurt", "themselves", "."), 3, "themselves", "xylophonically", (1,), "pl"
    )
    assert "not one token" in odd.encode(tokenizer)
    assert AgreementItem.from_dict(a[0].to_dict()) == a[0]


def test_blimp_pairs_become_agreement_items():
    cases = [
        (
            "anaphor_number_agreement",
            "Many teenagers were helping themselves.",
            "Many teenagers were helping herself.",
            "themselves",
            "herself",
            "teenagers",
        ),
        (
            "determiner_noun_agreement_2",
            "Jeffrey has not passed these museums.",
            "Jeffrey has not passed this museums.",
            "these",
            "this",
            "museums",
        ),
        (
            "determiner_noun_agreement_with_adj_2",
            "Sara noticed these white hospitals.",
            "Sara noticed this white hospitals.",
            "these",
            "this",
            "hospitals",
        ),
        (
            "distractor_agreement_relational_noun",
            "The pictures of Martha don't disgust Anne.",
            "The pictures of Martha doesn't disgust Anne.",
            "do",
            "does",
            "pictures",
        ),
        (
            "regular_plural_subject_verb_agreement_1",
            "Kristen has fixed this chair.",
            "Kristen have fixed this chair.",
            "has",
            "have",
            "Kristen",
        ),
    ]
    for subset, good, bad, target, foil, cue in cases:
        it = runner.datasets._blimp_item("x", subset, good, bad)
        assert (it.target, it.foil, it.words[it.cue_indices[0]]) == (target, foil, cue), subset
    assert runner.datasets._blimp_item("x", "anaphor_number_agreement", "A b c.", "A d e.") is None


def test_linzen_goldberg_file(tmp_path, tiny_dir):
    f = tmp_path / "lgd.tsv"
    f.write_text(
        "1\tthe keys to the cabinet are here\tthe keys to the cabinet ***mask*** here\tare\tis\n"
        "2\tthe man near the doors is old\tthe man near the doors ***mask*** old\tis\tare\n"
    )
    p = cfg(
        tmp_path,
        tiny_dir["roberta"],
        datasets=[{"id": "sva", "source": "linzen_goldberg", "path": str(f)}],
        methods=["alti", "blank_out"],
        metrics=["spearman:|blank_out|", "cue_dot"],
        explain={"blank_replacement": "mask"},
    )
    db = tmp_path / "r.sqlite"
    runner.run_bench(p, db=db, quiet=True)
    assert q(db, "SELECT status, COUNT(*) FROM units GROUP BY 1") == [("done", 4)]
    # no cue words in this file: Spearman only; the explained row is the [MASK]
    assert q(db, "SELECT DISTINCT metric FROM scores") == [("spearman:|blank_out|",)]
    targets = {t for (t,) in q(db, "SELECT DISTINCT target FROM saliency")}  # the correct verb of each line
    assert targets == set(runner.get_model(tiny_dir["roberta"]).tokenizer.convert_tokens_to_ids(["are", "is"]))


def test_csv_empty_rows_are_skipped_and_counted(tmp_path, tiny_dir):
    data = tmp_path / "d.csv"
    pd.DataFrame({"text": ["a fine film .", "", "dull and long .", "   "], "label": [1, 0, 0, 1]}).to_csv(
        data, index=False
    )
    p = cfg(
        tmp_path,
        tiny_dir["bert"],
        datasets=[{"id": "mine", "source": "file", "path": str(data)}],
        methods=["attention"],
        metrics=["aopc"],
    )
    db = tmp_path / "r.sqlite"
    runner.run_bench(p, db=db, quiet=True)
    assert q(db, "SELECT n_examples, n_empty FROM datasets") == [(2, 2)]
    assert q(db, "SELECT COUNT(*) FROM units WHERE status='done'") == [(2,)]
    assert "empty rows skipped 2" in tables.report(db, runner.load_config(p))


# ---------------------------------------------------------------------------------------------
# running and resuming
# ---------------------------------------------------------------------------------------------


def test_run_store_and_resume(tmp_path, tiny_dir):
    p = cfg(tmp_path, tiny_dir["bert"])
    db = tmp_path / "r.sqlite"
    runner.run_bench(p, db=db, quiet=True)
    assert q(db, "SELECT status, COUNT(*) FROM units GROUP BY status") == [("done", 12)]
    # one row per example x method x metric; no Spearman of a method with itself
    assert q(db, "SELECT COUNT(*) FROM scores") == [(36,)]
    row = q(db, "SELECT model, model_name, model_revision, ctxmix_version FROM scores LIMIT 1")[0]
    assert row[0] == row[1] == tiny_dir["bert"] and row[2] and row[3] == ctxmix.__version__
    cfg_json = q(db, "SELECT config_json FROM scores_with_config LIMIT 1")[0][0]
    assert json.loads(cfg_json)["metrics"] == ["spearman:grad_x_input", "aopc", "comprehensiveness"]
    # the reference saliency is stored once per example, marked as a reference
    assert q(db, "SELECT method, role, COUNT(*) FROM saliency WHERE role='reference' GROUP BY 1, 2") == [
        ("grad_x_input", "reference", 3)
    ]
    agg = tables.load_aggregates(db, "t")
    assert {"agree:alti", "aopc"} <= set(agg["metric"])
    # a second run computes nothing; a method added later costs only that method
    runner.run_bench(p, db=db, quiet=True)
    assert q(db, "SELECT COUNT(*) FROM computations") == [(12,)]
    p2 = cfg(tmp_path, tiny_dir["bert"], methods=["attention", "alti", "grad", "random", "globenc"])
    runner.run_bench(p2, db=db, quiet=True)
    assert q(db, "SELECT method, COUNT(*) FROM computations GROUP BY method HAVING COUNT(*) != 3") == []
    assert q(db, "SELECT COUNT(*) FROM computations") == [(15,)]
    # the stored reference was reused: grad_x_input was not recomputed for globenc
    assert q(db, "SELECT COUNT(*) FROM saliency WHERE role='reference'") == [(3,)]
    # other settings under the same name are refused unless --fresh
    p3 = cfg(tmp_path, tiny_dir["bert"], target="gold")
    with pytest.raises(BadInput, match="--fresh"):
        runner.run_bench(p3, db=db, quiet=True)
    runner.run_bench(p3, db=db, fresh=True, quiet=True)
    assert q(db, "SELECT COUNT(*) FROM computations") == [(12,)]


def test_interrupted_run_resumes_without_recomputing(tmp_path, tiny_dir, monkeypatch):
    p = cfg(tmp_path, tiny_dir["bert"], datasets=[{"id": "pl", "source": "pang_lee", "limit": 5}], example_batch=2)
    db = tmp_path / "r.sqlite"
    real = runner.compute_batch
    calls = {"n": 0}

    def flaky(tasks):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(tasks)

    monkeypatch.setattr(runner.executors, "compute_batch", flaky)
    with pytest.raises(KeyboardInterrupt):
        runner.run_bench(p, db=db, quiet=True)
    done_before = set(q(db, "SELECT example_id, method FROM units"))
    assert len(done_before) == 8  # the first batch: two examples x four methods, each committed
    monkeypatch.setattr(runner.executors, "compute_batch", real)
    runner.run_bench(p, db=db, quiet=True)
    log = q(db, "SELECT example_id, method, COUNT(*) FROM computations GROUP BY 1, 2")
    assert len(log) == 20 and all(n == 1 for *_, n in log)


@pytest.mark.parametrize("kind", ["methods", "contextualization_change"])
def test_resumed_batches_are_bit_identical(tmp_path, tiny_dir, kind, monkeypatch):
    """Examples go through the engine in batches of fixed membership: after units of one example
    are lost (a kill between the commits of one batch), the resumed run recomputes its whole batch
    and stores exactly the numbers of an uninterrupted run."""
    extra = (
        {"methods": ["attention", "alti", "value_zeroing", "random"], "metrics": ["spearman:grad_x_input"]}
        if kind == "methods"
        else {"kind": kind, "methods": ["all"], "metrics": ["change"]}
    )
    p = cfg(
        tmp_path, tiny_dir["bert"], datasets=[{"id": "pl", "source": "pang_lee", "limit": 7}], example_batch=3, **extra
    )
    db = tmp_path / "r.sqlite"
    runner.run_bench(p, db=db, quiet=True)
    sql = (
        "SELECT example_id, method, metric, layer, value FROM scores ORDER BY 1, 2, 3, 4"
        if kind != "methods"
        else "SELECT example_id, method, values_json FROM saliency ORDER BY 1, 2"
    )
    whole = q(db, sql)
    assert len(whole) > 20
    lost = q(db, "SELECT DISTINCT example_id FROM units ORDER BY example_id")[4][0]  # one member of the 2nd batch
    for table in ("units", "scores", "saliency"):
        q(db, f"DELETE FROM {table} WHERE example_id = ?", lost)
    seen = []
    real = runner.compute_batch
    monkeypatch.setattr(runner.executors, "compute_batch", lambda tasks: seen.append(tasks) or real(tasks))
    runner.run_bench(p, db=db, quiet=True)
    assert q(db, sql) == whole  # exactly, not approximately
    # the whole batch (examples 3-5) went through the engine again, only the lost one with methods
    assert len(seen) == 1 and len(seen[0]) == 3
    assert [t["example"]["id"] for t in seen[0] if t["methods"]] == [lost]
    recomputed = q(db, "SELECT DISTINCT example_id FROM computations GROUP BY example_id, method HAVING COUNT(*) > 1")
    assert [e for (e,) in recomputed] == [lost]


def test_methods_that_do_not_apply_are_marked_na(tmp_path):
    p = cfg(
        tmp_path,
        "minilm",
        datasets=[{"id": "agr", "source": "agreement", "per_phenomenon": 2}],
        methods=["attention", "value_zeroing", "grad", "random"],
        metrics=["cue_dot", "cue_ap", "cue_probes", "aopc"],
    )
    db = tmp_path / "r.sqlite"
    runner.run_bench(p, db=db, quiet=True)
    st = dict(q(db, "SELECT method, GROUP_CONCAT(DISTINCT status) FROM units GROUP BY method"))
    assert st == {"attention": "done", "value_zeroing": "done", "grad": "na", "random": "done"}
    # cue alignment per layer for mixing methods (6 layers) and globally; none for deletion (no head)
    layers = q(db, "SELECT DISTINCT layer FROM scores WHERE method='value_zeroing' AND metric='cue_ap' ORDER BY layer")
    assert [l for (l,) in layers] == [-1, 1, 2, 3, 4, 5, 6]
    assert q(db, "SELECT COUNT(*) FROM scores WHERE metric='aopc'") == [(0,)]
    assert q(db, "SELECT DISTINCT layer FROM scores WHERE method='random'") == [(-1,)]
    lt = tables.layer_table(tables.load_aggregates(db), "cue_dot")
    assert list(lt.index) == [1, 2, 3, 4, 5, 6] and set(lt.columns) == {"attention", "value_zeroing"}


def test_derived_methods(tmp_path, tiny_dir, tokenizer):
    from ctxmix.methods.mixing import rollout

    # masked LM on agreement data: blank_out_foil against a direct computation
    it = agreement_items(1, seed=0, phenomena=["sva_attractor"])[0]
    task = {
        "model": {"label": "r", "name": tiny_dir["roberta"]},
        "dataset": "agr",
        "example": {"id": it.uid, "text": it.good, "item": it.to_dict()},
        "methods": ["blank_out_foil", "norm_rollout", "raw_attention", "grad"],
        "metrics": ["spearman:grad"],
        "target": "predicted",
        "explain": {},
        "options": {"batch_size": 4},
        "seed": 0,
        "references": {},
    }
    res = runner.compute_example(task)
    enc = it.encode(tokenizer)
    m = runner.get_model(tiny_dir["roberta"])
    ids, pos = enc.input_ids, enc.position

    def p2(x):
        with torch.no_grad():
            lg = m.hf(input_ids=torch.tensor([x])).logits[0, pos].double()
        return torch.sigmoid(lg[enc.target_id] - lg[enc.foil_id]).item()

    unk = tokenizer.unk_token_id
    direct = [p2(ids) - p2([unk if j == i else t for j, t in enumerate(ids)]) for i in range(len(ids))]
    np.testing.assert_allclose(res["methods"]["blank_out_foil"]["saliency"], direct, atol=1e-6)
    assert res["target"] == enc.target_id  # language models explain the agreement target
    ex = ctxmix.explain(m, None, ["norm_res_ln", "attention"], input_ids=ids, position=pos)
    N = ex.layer_maps["norm_res_ln"]
    want = rollout(N / N.sum(-1, keepdims=True))[-1][pos]
    np.testing.assert_allclose(res["methods"]["norm_rollout"]["saliency"], want, atol=1e-9)
    raw = ex.layer_maps["attention"][-1][pos].copy()
    raw[pos] = 0
    np.testing.assert_allclose(res["methods"]["raw_attention"]["saliency"], raw, atol=1e-9)


def test_contextualization_change_kind_matches_the_analysis(tmp_path, tiny_dir):
    p = cfg(
        tmp_path,
        tiny_dir["bert"],
        kind="contextualization_change",
        methods=["+Ff", "+Ln"],
        metrics=["change"],
        datasets=[{"id": "pl", "source": "pang_lee", "limit": 2}],
    )
    db = tmp_path / "r.sqlite"
    runner.run_bench(p, db=db, quiet=True)
    agg = tables.load_aggregates(db)
    m = runner.get_model(tiny_dir["bert"])
    texts = [e.text for e in runner.load_examples(runner.load_config(p).datasets[0])[0]]
    ref = ctxmix.contextualization_change(m, texts, progress=False)
    for comp in ("+Ff", "+Ln"):
        lt = tables.layer_table(agg, "change")[comp]
        want = ref[ref.comparison == comp].set_index("layer")["change"]
        np.testing.assert_allclose(lt.values, want.loc[lt.index].values, atol=1e-6)
        whole = agg[(agg.method == comp) & (agg.layer == -1)]["mean"].item()
        assert whole == pytest.approx(want.mean(), abs=1e-6)


# ---------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------


def _agg():
    rows = []
    for meth, (a, l, s) in {"x": (0.5, -1.0, 0.9), "y": (0.3, -2.0, 0.2), "z": (0.4, 0.1, 0.5)}.items():
        rows += [
            ("m", "d", meth, "aopc", -1, a, 0.1, 5, 0),
            ("m", "d", meth, "lodds", -1, l, 0.2, 5, 0),
            ("m", "d", meth, "sufficiency", -1, s, 0.05, 5, 0),
        ]
    return pd.DataFrame(rows, columns=["model", "dataset", "method", "metric", "layer", "mean", "std", "n", "n_nan"])


def test_table_marks_best_by_direction_and_ranks():
    t = tables.method_table(_agg(), "m", "d", ["aopc", "lodds", "sufficiency"])
    assert t.attrs["best"] == {"aopc": "x", "lodds": "y", "sufficiency": "y"}  # higher / lower / lower is better
    # ranks: x (1, 2, 3), y (3, 1, 1), z (2, 3, 2) -> means 2, 5/3, 7/3
    assert list(t.index) == ["y", "x", "z"]
    assert t.loc["y", "mean rank"] == pytest.approx(5 / 3)
    f = tables.format_table(t)
    assert f.loc["x", "aopc ↑"] == "0.500 ± 0.100*" and f.loc["y", "lodds ↓"].endswith("*")
    tex = tables.to_latex(t, caption="a_b")
    assert r"\toprule" in tex and r"\textbf{0.500 $\pm$ 0.100}" in tex and r"a\_b" in tex and r"\bottomrule" in tex
    csv = tables.to_csv(t)
    assert csv.splitlines()[0].startswith("method,aopc,aopc std")
    fig = tables.table_figure(t)
    assert len(fig.data) == 3 and fig.data[0].error_x.array is not None and fig.data[0].orientation == "h"
    cmp_ = tables.paper_comparison(t, {"values": [{"method": "x", "metric": "aopc", "mean": 0.45}]}, "m", "d")
    assert cmp_.loc[0, "difference"] == pytest.approx(0.05)


def test_aggregate_scores_ignores_nan():
    s = pd.DataFrame(
        {
            "model": "m",
            "dataset": "d",
            "example_id": ["1", "2", "3"],
            "method": "a",
            "metric": "aopc",
            "layer": -1,
            "value": [1.0, 3.0, np.nan],
        }
    )
    a = tables.aggregate_scores(s).iloc[0]
    assert a["mean"] == 2.0 and a["std"] == 1.0 and a["n"] == 2 and a["n_nan"] == 1


# ---------------------------------------------------------------------------------------------
# slow: a real kill, Ray, the embedded config
# ---------------------------------------------------------------------------------------------


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(extra)
    return env


@pytest.mark.slow
def test_resume_after_kill(tmp_path, tiny_dir):
    p = cfg(
        tmp_path,
        tiny_dir["bert"],
        datasets=[{"id": "pl", "source": "pang_lee", "limit": 12}],
        methods=["attention", "alti", "grad"],
    )
    db = tmp_path / "r.sqlite"
    cmd = [sys.executable, "-m", "ctxmix", "bench", "--config", str(p), "--db", str(db), "--threads", "1"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(CTXMIX_BENCH_THROTTLE="0.7"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 240
        done = 0
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.3)
            if db.exists():
                try:
                    done = q(db, "SELECT COUNT(*) FROM units")[0][0]
                except sqlite3.OperationalError:
                    continue
                if done >= 6:
                    break
        assert proc.poll() is None, "the run finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    before = q(db, "SELECT example_id, method, finished FROM units")
    assert 6 <= len(before) < 36
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    after = q(db, "SELECT example_id, method, finished FROM units")
    assert len(after) == 36 and set(before) <= set(after)  # finished units untouched
    log = q(db, "SELECT example_id, method, COUNT(*), COUNT(DISTINCT pid) FROM computations GROUP BY 1, 2")
    assert len(log) == 36 and all(n == 1 for *_, n, _ in log)  # nothing computed twice
    assert len({pid for (pid,) in q(db, "SELECT DISTINCT pid FROM computations")}) == 2
    assert q(db, "SELECT COUNT(*) FROM scores") == [(36 * 3,)]


@pytest.mark.slow
def test_ray_executor_matches_local(tmp_path, tiny_dir):
    ray = pytest.importorskip("ray")
    p = cfg(tmp_path, tiny_dir["bert"], methods=["attention", "alti", "grad", "value_zeroing"])
    local_db, ray_db = tmp_path / "local.sqlite", tmp_path / "ray.sqlite"
    runner.run_bench(p, db=local_db, quiet=True)
    runner.run_bench(p, db=ray_db, executor="ray", num_cpus=2, quiet=True)
    assert not ray.is_initialized()  # the runner stopped the instance it started
    a = q(local_db, "SELECT example_id, method, metric, layer, value FROM scores ORDER BY 1, 2, 3, 4")
    b = q(ray_db, "SELECT example_id, method, metric, layer, value FROM scores ORDER BY 1, 2, 3, 4")
    assert [r[:4] for r in a] == [r[:4] for r in b] and len(a) == 36
    np.testing.assert_allclose([r[4] for r in a], [r[4] for r in b], atol=1e-6)
    pids = {pid for (pid,) in q(ray_db, "SELECT DISTINCT pid FROM computations")}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2  # worker processes, each loading the model once
    # resuming with Ray computes nothing more
    runner.run_bench(p, db=ray_db, executor="ray", num_cpus=2, quiet=True)
    assert q(ray_db, "SELECT COUNT(*) FROM computations") == [(12,)]


def _assert_matches_shipped(db: Path, name: str) -> None:
    """The check scores of a `--limit 2` run in `db` against the shipped ones (`shipped.check_moves`).

    What can move between machines: minilm and smollm2 are the same bits everywhere, so only their float32
    reductions run in another order (ATen's kernels, MKL's GEMM path, the thread count): within
    shipped.FIXED_WEIGHTS_RTOL = 4 d_ff u = 3.7e-4 of the scale of each (model, method, metric). minilm-sentiment
    is fine-tuned anew on the machine that runs this (unless its cache holds a build), so its weights move
    too (measured: 3.2e-5 of the scale at worst between ATen's default, AVX2 and AVX-512 kernels):
    shipped.FINE_TUNED_RTOL = 1e-3. Both stay below a 1% change of a method's numbers, which fails
    (tests/test_shipped.py shows it on the shipped scores). The old check (rtol 1e-4 of each value) failed
    on a value near 0 (lodds -0.006, moved by 2.9e-4 of itself but 3e-6 of its scale)."""
    from ctxmix.benchmark import shipped

    assert shipped.CHECK_LIMIT == 2
    got = tables.load_scores(db, name)
    want = shipped.load_check(name)
    keys = shipped.CHECK_KEYS
    assert set(map(tuple, got[keys].astype(str).values)) == set(map(tuple, want[keys].astype(str).values)), (
        f"methods or metrics changed: run python bench/ship_results.py --config configs/{name}.yaml"
    )
    bad = shipped.check_moves(got, want)
    assert bad.empty, (
        f"the shipped results are stale: {len(bad)} check scores moved beyond their tolerance; run python "
        f"bench/ship_results.py --config configs/{name}.yaml\n{bad.head(20).to_string()}"
    )


@pytest.mark.slow
@pytest.mark.stored_numbers
def test_embedded_config_end_to_end(tmp_path):
    db = tmp_path / "e.sqlite"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ctxmix",
            "bench",
            "--config",
            "configs/embedded.yaml",
            "--limit",
            "2",
            "--db",
            str(db),
            "--out",
            str(tmp_path / "out"),
            "--threads",
            "1",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "== minilm-sentiment on pang_lee ==" in r.stdout and "== minilm on agreement ==" in r.stdout
    plan = runner.load_config(ROOT / "configs/embedded.yaml")
    t = tables.method_table(tables.load_aggregates(db, "embedded"), "minilm-sentiment", "pang_lee", plan.metrics)
    assert {"globenc", "alti", "value_zeroing", "attcat", "integrated_gradients", "random", "AtbFfResLn"} <= set(
        t.index
    )
    assert {"aopc", "lodds", "comprehensiveness", "sufficiency", "spearman:grad_x_input"} <= set(t.attrs["metrics"])
    assert t["mean rank"].notna().all()
    assert (tmp_path / "out" / "minilm-sentiment__pang_lee.tex").read_text().count(r"\textbf") >= 5
    # the shipped results are not stale: the same --limit 2 run gives the shipped check scores, within what
    # may move between machines (minilm-sentiment fine-tuned here, float32 reduction order: see the helper)
    _assert_matches_shipped(db, "embedded")


def test_example_batch_is_checked(tmp_path):
    for bad in (0, -2, True, 1.5, 10**6):
        with pytest.raises(BadInput, match="example_batch"):
            runner.load_config(cfg(tmp_path, "minilm", example_batch=bad), check_models=False)
    plan = runner.load_config(cfg(tmp_path, "minilm", example_batch=4), check_models=False)
    assert plan.options["example_batch"] == 4
    assert plan.config_hash() == runner.load_config(cfg(tmp_path, "minilm"), check_models=False).config_hash()


def test_fidelity_options_are_checked_and_only_a_change_is_hashed():
    base = {
        "name": "h",
        "models": ["minilm"],
        "datasets": [{"id": "pl", "source": "pang_lee"}],
        "methods": ["alti"],
        "metrics": ["aopc"],
    }
    h0 = runner.validate_config(base).config_hash()
    for k in ("deletion_stop_one_short", "raw_attention_keep_self"):
        assert runner.validate_config({**base, k: False}).config_hash() == h0
        assert runner.validate_config({**base, k: True}).config_hash() != h0
        with pytest.raises(BadInput, match=f"{k} must be true or false"):
            runner.validate_config({**base, k: "yes"})
    plan = runner.validate_config({**base, "datasets": [{"id": "pl", "source": "pang_lee", "abs_saliency": True}]})
    assert plan.datasets[0].options["abs_saliency"] is True
    with pytest.raises(BadInput, match="abs_saliency must be true or false"):
        runner.validate_config({**base, "datasets": [{"id": "pl", "source": "pang_lee", "abs_saliency": 1}]})


@pytest.mark.slow
@pytest.mark.stored_numbers
def test_embedded_lm_config_ranks_the_prediction_methods_by_cue_mrr(tmp_path):
    """configs/embedded-lm.yaml on smollm2 (contrastive: target minus foil), --limit 2: the prediction
    methods are scored by the signed-score MRR, and the shipped check scores are recomputed."""
    from ctxmix.benchmark import shipped

    db = tmp_path / "lm.sqlite"
    plan = runner.load_config(ROOT / "configs/embedded-lm.yaml", limit=shipped.CHECK_LIMIT)
    assert plan.options["contrastive"] is True
    runner.run_bench(ROOT / "configs/embedded-lm.yaml", db=db, limit=shipped.CHECK_LIMIT, quiet=True)
    t = tables.method_table(tables.load_aggregates(db, "embedded-lm"), "smollm2", "sva", plan.metrics)
    assert {"logit", "alti_logit", "decompx", "alti", "random"} <= set(t.index) and "cue_mrr" in t.attrs["metrics"]
    # smollm2's weights are the same bits on every machine: only float32 reduction order moves its scores,
    # within shipped.FIXED_WEIGHTS_RTOL of each (method, metric)'s scale (cue_mrr and cue_probes are ranks
    # and counts: they hold exactly unless two tokens' scores tie to float32 rounding)
    _assert_matches_shipped(db, "embedded-lm")


def test_contrastive_is_a_checked_switch_hashed_only_when_on():
    base = {"name": "a", "models": ["minilm"], "datasets": ["agreement"]}
    h0 = runner.validate_config(base).config_hash()
    assert runner.validate_config({**base, "contrastive": False}).config_hash() == h0
    assert runner.validate_config({**base, "contrastive": True}).config_hash() != h0
    with pytest.raises(BadInput, match="contrastive must be true or false"):
        runner.validate_config({**base, "contrastive": "yes"})


def test_decompx_masking_protocol_runs_on_a_classifier(tmp_path, tiny_dir):
    """DecompX Table 1's metrics through the runner: the gold label reaches the accuracy metrics, which
    land in [0, 1] (accuracy_mask: 9 ratios, so a multiple of 1/9 per example), the AOPCs are finite, and
    the report compares them with a paper row."""
    data = tmp_path / "d.csv"
    pd.DataFrame({"text": ["a fine film and a good cast .", "dull , long and badly acted ."], "label": [1, 0]}).to_csv(
        data, index=False
    )
    p = cfg(
        tmp_path,
        tiny_dir["bert"],
        datasets=[{"id": "mine", "source": "file", "path": str(data)}],
        methods=["decompx", "random"],
        metrics=["aopc_mask", "accuracy_mask", "aopc_mask_least", "accuracy_mask_least"],
        paper={"source": "t", "values": [{"method": "decompx", "metric": "aopc_mask", "mean": 0.627}]},
    )
    db = tmp_path / "r.sqlite"
    runner.run_bench(p, db=db, quiet=True)
    rows = q(db, "SELECT method, metric, value FROM scores")
    assert {(m, k) for m, k, _ in rows} == {
        (m, k)
        for m in ("decompx", "random")
        for k in ("aopc_mask", "accuracy_mask", "aopc_mask_least", "accuracy_mask_least")
    }
    for m, k, v in rows:
        assert np.isfinite(v), (m, k)
        if k.startswith("accuracy"):
            assert 0.0 <= v <= 1.0 and abs(v * 9 - round(v * 9)) < 1e-9
    assert "0.627" in tables.report(db, runner.load_config(p))
