"""Context attribution's offline benchmark: the seeded examples (`ctxmix.benchmark.context.data`) and the
runner (`ctxmix.benchmark.context.bench.run_context_benchmark`) on a tiny random float64 Llama
(tests/conftest.py), checked against a direct `attribute_context` + `evaluate` of the same example."""

import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import tiny_model

import ctxmix
from ctxmix.benchmark.context import bench as cb
from ctxmix.benchmark.context import data as cd
from ctxmix.errors import BadInput
from ctxmix.methods.context.sources import make_sources


def test_needles_are_seeded_whole_sentences_within_their_lengths():
    a = cd.needle_examples(len(cd.NEEDLES), 200, 400, seed=3)
    assert [vars(e) for e in a] == [vars(e) for e in cd.needle_examples(len(cd.NEEDLES), 200, 400, seed=3)]
    assert [e.context for e in a] != [e.context for e in cd.needle_examples(len(cd.NEEDLES), 200, 400, seed=4)]
    assert len({n.fact for n in cd.NEEDLES}) == len(cd.NEEDLES) >= 15
    for e, nd in zip(a, cd.NEEDLES):
        sents = make_sources(e.context, "sentence").texts
        assert sents[e.gold[0]] == nd.fact and sents.count(nd.fact) == 1
        assert e.query == nd.question and cd.contains_answer(nd.fact, nd.answer)
        assert 200 <= len(e.context.split()) <= 400  # default count: whitespace words


def test_documents_and_summaries():
    docs = cd.document_examples(3, n_documents=5, seed=1)
    for e, nd in zip(docs, cd.NEEDLES[::-1]):
        assert len(e.context) == 5 and e.sources == "document"
        assert [i for i, d in enumerate(e.context) if nd.fact in d] == e.gold
        # each document cut to at most 120 words before the needle went into the gold one
        assert all(len(d.split()) <= 120 + (i in e.gold) * len(nd.fact.split()) for i, d in enumerate(e.context))
    s = cd.summary_examples(2, 100, 150, seed=0)
    assert all(e.query == cd.SUMMARY_QUERY and e.gold == [] and e.answer is None for e in s)
    assert all(100 <= len(e.context.split()) <= 150 for e in s)


def test_contains_answer_needs_whole_words():
    assert cd.contains_answer("The code is 4817.", "4817")
    assert not cd.contains_answer("The code is 48170.", "4817")
    assert cd.contains_answer("held on 14 MARCH", "14 March")
    assert not cd.contains_answer("Orangery", "orange")


def test_bad_input():
    with pytest.raises(BadInput, match="min_tokens"):
        cd.needle_examples(2, 300, 200)
    with pytest.raises(BadInput, match="n_documents"):
        cd.document_examples(2, n_documents=1)
    with pytest.raises(BadInput, match="kind: context"):
        cb.validate_context_config({"kind": "bench"})
    with pytest.raises(BadInput, match="methods"):
        cb.validate_context_config({"kind": "context", "methods": ["grad"], "tasks": [{"id": "needles"}]})
    with pytest.raises(BadInput, match="a task is"):
        cb.validate_context_config({"kind": "context", "methods": ["logit"], "tasks": [{"id": "squad"}]})


def test_shipped_config_is_valid():
    cfg = cb.load_context_config(cb.Path(cb.__file__).parents[1] / "configs" / "context.yaml")
    assert {t["id"] for t in cfg["tasks"]} == set(cd.OFFLINE_TASKS)  # the offline ones, long contexts included
    # each example draws its own masks (the default); the official scheme's shared seeds are gone from the shipped run
    assert "mask_seeds" not in cfg
    with pytest.raises(BadInput, match="mask_seeds"):
        cb.validate_context_config({**cfg, "mask_seeds": "hash"})


EVAL = {"k": [1], "n_ablations": 6}


def _config(responses):
    return {
        "kind": "context",
        "model": "unused",
        "methods": ["logit", "contextcite"],
        "n_ablations": 4,
        "evaluate": EVAL,
        "tasks": [
            {"id": "needles", "n": 2, "min_tokens": 30, "max_tokens": 50, "seed": 0},
            {"id": "summaries", "n": 2, "min_tokens": 30, "max_tokens": 50, "seed": 0},
        ],
        "responses": responses,
    }


def test_runner_on_a_tiny_model(tokenizer):
    llama = tiny_model("llama", tokenizer)
    # a random model answers nothing: stored responses, one needle's without its answer (dropped)
    responses = {
        "needle-0": cd.NEEDLES[0].fact,
        "needle-1": "I do not know.",
        "summary-0": "A short summary.",
        "summary-1": "Another summary.",
    }
    table = cb.run_context_benchmark(_config(responses), model=llama, limit=2)
    assert table.attrs["dropped"] == {"needles": ["needle-1"], "summaries": []}
    assert table.attrs["responses"] == responses
    ex = table.attrs["examples"]
    assert set(ex["example"]) == {"needle-0", "summary-0", "summary-1"}
    # recall only where a gold source is known
    cost = {"seconds", "time_vs_contextcite"}  # each method's time, and its ratio to ContextCite's on the example
    assert set(ex[ex.task == "summaries"].metric) == {"topk_drop@1", "lds"} | cost
    assert set(ex[ex.task == "needles"].metric) == {"topk_drop@1", "lds", "recall@1", "recall@3"} | cost
    ratio = ex[ex.metric == "time_vs_contextcite"].pivot(index="example", columns="method", values="value")
    secs = ex[ex.metric == "seconds"].pivot(index="example", columns="method", values="value")
    assert (ratio["contextcite"] == 1.0).all() and (secs > 0).all().all()
    assert np.allclose(ratio["logit"], secs["logit"] / secs["contextcite"], rtol=1e-15, atol=0)
    # the aggregate is the mean of the examples
    for r in table.itertuples():
        v = ex[(ex.task == r.task) & (ex.method == r.method) & (ex.metric == r.metric)].value
        assert r.n == v.notna().sum() and r.nan == v.isna().sum()
        assert (math.isnan(r.mean) and r.n == 0) or r.mean == pytest.approx(v.mean(), abs=0)
    # a row is the direct attribution + evaluation of that example (same seeds: the same numbers exactly)
    e = cd.needle_examples(
        1, 30, 50, seed=0, count_tokens=lambda t: len(tokenizer(t, add_special_tokens=False)["input_ids"])
    )[0]
    ca = ctxmix.attribute_context(
        llama,
        e.context,
        e.query,
        response=responses["needle-0"],
        methods=["logit", "contextcite"],
        ablations={"n": 4},
        prompt={"query_suffix": "", "stop": None},  # the benchmark's explicit form (prompt_form.call_form)
        progress=False,
    )
    # each example its own ContextCite seeds (the default), recorded in the check rows
    chk = table.attrs["check"]
    seeds = chk[chk.metric == "mask_seed"].set_index("example")["value"]
    assert sorted(seeds.index) == ["needle-0", "summary-0", "summary-1"] and seeds.nunique() == 3
    assert seeds["needle-0"] == ca.options["mask_seed"]
    direct = ca.evaluate(llama, gold=e.gold, progress=False, **EVAL).set_index("method")
    got = ex[ex.example == "needle-0"].pivot(index="method", columns="metric", values="value")
    for m in ("logit", "contextcite"):
        for k in ("topk_drop@1", "lds", "recall@1", "recall@3"):
            assert np.isclose(got.loc[m, k], direct.loc[m, k], rtol=0, atol=0, equal_nan=True), (m, k)


# ---------------------------------------------------------------------------------------------------------
# check sizes, resume, the CLI, the shipped check's tolerances, the papers' dataset configs (offline)


def _check_config(responses):
    cfg = _config(responses)
    cfg["check"] = {"tasks": {"needles": {"min_tokens": 20, "max_tokens": 30}}, "evaluate": {"n_ablations": 5}}
    cfg["tasks"][1]["methods"] = ["logit"]  # a task's own subset of the methods
    return cfg


def test_check_sizes_prefix_ids_and_a_resumed_run_recomputes_nothing(tokenizer, tmp_path, monkeypatch):
    llama = tiny_model("llama", tokenizer)
    responses = {"check/needle-0": cd.NEEDLES[0].fact, "check/needle-1": cd.NEEDLES[1].fact}
    cfg = _check_config(responses)
    lines = []
    db = tmp_path / "r.jsonl"
    table = cb.run_context_benchmark(cfg, model=llama, limit=2, check=True, resume=db, log=lines.append)
    ex, chk = table.attrs["examples"], table.attrs["check"]
    assert set(ex["example"]) >= {"check/needle-0", "check/needle-1", "check/summary-0"}
    assert len(lines) == 4 and all(" in " in line for line in lines)
    assert set(ex[ex.task == "summaries"].method) == {"logit"} and set(ex[ex.task == "needles"].method) == {
        "logit",
        "contextcite",
    }
    # the check's overrides: shorter needles, 5 held-out ablations
    assert len(chk[(chk.example == "check/needle-0") & (chk.metric == "heldout")]) == 5
    count = lambda t: len(tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    short = cd.needle_examples(2, 20, 30, seed=0, count_tokens=count)
    assert [count(e.context) <= 31 for e in short] == [True, True]
    # every method's scores, the measured quantities and the metrics are in the check rows
    one = chk[chk.example == "check/needle-0"]
    assert {"score", "log_prob_full", "heldout", "heldout_seed", "cc_target", "lds", "topk_drop@1"} <= set(one.metric)
    assert len(one[(one.metric == "cc_target")]) == cfg["n_ablations"]
    # resumed from the file: no model pass at all, the same tables
    monkeypatch.setattr(cb, "_one_example", lambda *a, **k: pytest.fail("recomputed a finished example"))
    again = cb.run_context_benchmark(cfg, model=llama, limit=2, check=True, resume=db)
    assert again.equals(table) and again.attrs["check"].equals(chk)
    # another config (a changed response) does not reuse them
    cfg2 = _check_config({**responses, "check/needle-0": cd.NEEDLES[0].fact + " Yes."})
    with pytest.raises(pytest.fail.Exception):
        cb.run_context_benchmark(cfg2, model=llama, limit=2, check=True, resume=db)


def test_bench_command_runs_a_context_config(tmp_path, monkeypatch, capsys):
    """`ctxmix bench --config <kind: context>` goes to the context runner, prints one line per example and the
    tables (directions in the headers), and writes the CSVs where --out says."""
    import argparse

    import pandas as pd
    import yaml

    from ctxmix.benchmark import command

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_config({})))
    seen = {}

    def fake(config, *, limit=None, check=False, resume=None, log=None, **_):
        seen.update(limit=limit, check=check, resume=resume)
        log("needles needle-0: done in 1.0 s")
        agg = pd.DataFrame(
            [("needles", "logit", "lds", 0.5, 0.1, 2, 0, 1), ("needles", "logit", "recall@1", 1.0, 0.0, 2, 0, 1)],
            columns=["task", "method", "metric", "mean", "std", "n", "nan", "higher_is_better"],
        )
        agg.attrs.update(
            examples=pd.DataFrame(columns=["task", "example", "method", "metric", "value"]),
            check=pd.DataFrame(columns=["task", "example", "method", "metric", "index", "value"]),
            dropped={"needles": []},
            responses={"needle-0": "x"},
            seconds=1.0,
        )
        return agg

    monkeypatch.setattr(cb, "run_context_benchmark", fake)
    p = argparse.ArgumentParser()
    command.add_bench_arguments(p)
    args = p.parse_args(["--config", str(path), "--limit", "1", "--out", str(tmp_path / "o"), "--check-sizes"])
    command.cmd_bench(args)
    out = capsys.readouterr().out
    assert "needles needle-0: done" in out and "lds ↑" in out and "recall@1 ↑" in out
    assert seen == {"limit": 1, "check": True, "resume": cb.Path("results") / "context-check.jsonl"} or (
        seen["limit"] == 1 and seen["check"] is True
    )
    assert (tmp_path / "o" / "aggregates.csv").is_file() and (tmp_path / "o" / "responses.yaml").is_file()


def _fake_check(d=6, n_cc=32, m=20, seed=0):
    """Check rows of one example: scores spread apart (no near-ties), targets, metrics."""
    from ctxmix.methods.context.ablation import contextcite_masks, lasso_fit

    rng = np.random.default_rng(seed)
    rows = [("-", "log_prob_full", -1, -12.0), ("-", "heldout_seed", -1, 10_032.0)]
    w = np.array([3.1, -1.07, 0.53, 2.29, -2.61, 1.37])[:d]  # no two mask sums equal
    hm = contextcite_masks(m, d, 10_032)
    rows += [("-", "heldout", j, float(v)) for j, v in enumerate(hm @ w + rng.normal(0, 0.01, m) - 10)]
    masks = contextcite_masks(n_cc, d, seed)
    y = masks @ w + rng.normal(0, 0.3, n_cc) - 10
    rows += [("contextcite", "cc_target", j, float(v)) for j, v in enumerate(y)]
    cc, _ = lasso_fit(masks, y, 5)
    for meth, s in (("logit", w), ("contextcite", cc)):
        rows += [(meth, "score", i, float(v)) for i, v in enumerate(s)]
        rows += [(meth, "topk_drop@1", -1, 2.5), (meth, "lds", -1, 0.8), (meth, "recall@1", -1, 1.0)]
    df = pd.DataFrame(rows, columns=["method", "metric", "index", "value"])
    return df.assign(task="needles", example="check/needle-0")[
        ["task", "example", "method", "metric", "index", "value"]
    ]


import pandas as pd  # noqa: E402

from ctxmix.benchmark import shipped  # noqa: E402


def test_context_check_tolerances_pass_float32_moves_and_fail_a_one_percent_change():
    want = _fake_check()
    bad, skipped = shipped.context_check_moves(want, want, 32, 0)
    assert bad.empty and skipped.empty
    # measured quantities moved by 1/4 of the float32 bound: holds; by 1%: fails, naming those rows
    meas = want.metric.isin(shipped.CONTEXT_MEASURED)
    scale = want["value"].abs().groupby([want.task, want.method, want.metric]).transform("max")
    near = want.assign(value=np.where(meas, want["value"] + 0.25 * shipped.FIXED_WEIGHTS_RTOL * scale, want["value"]))
    assert shipped.context_check_moves(near, want, 32, 0)[0].empty
    far = want.assign(value=np.where(want.metric == "heldout", want["value"] * 1.01, want["value"]))
    bad, _ = shipped.context_check_moves(far, want, 32, 0)
    assert len(bad) and set(bad.metric) == {"heldout"}
    # logit's scores scaled by 1.01 fail; a missing row fails; the seed must match exactly
    s = want.assign(
        value=np.where((want.method == "logit") & (want.metric == "score"), want["value"] * 1.01, want.value)
    )
    assert set(shipped.context_check_moves(s, want, 32, 0)[0].method) == {"logit"}
    assert len(shipped.context_check_moves(want.iloc[1:], want, 32, 0)[0]) == 1
    seed = want.assign(value=np.where(want.metric == "heldout_seed", want["value"] + 1, want["value"]))
    assert set(shipped.context_check_moves(seed, want, 32, 0)[0].metric) == {"heldout_seed"}
    # a near-tie at the top: the rank metrics of that method are skipped (said), not compared
    tie = want.copy()
    sel = (tie.method == "logit") & (tie.metric == "score")
    tie.loc[sel & (tie["index"] == 3), "value"] = 3.1  # ties the top score
    bad, skipped = shipped.context_check_moves(tie.assign(value=tie.value), tie, 32, 0)
    assert bad.empty and {("logit", "topk_drop@1"), ("logit", "recall@1"), ("logit", "lds")} <= set(
        zip(skipped.method, skipped.metric)
    )


def test_lasso_bound_holds_for_a_refit_on_moved_targets():
    """`shipped.lasso_bound`: the official LASSO refitted on targets moved by at most y_move stays within the
    bound of the first fit (random moves, several seeds); and the bound is finite on well-posed masks."""
    from ctxmix.methods.context.ablation import contextcite_masks, lasso_fit

    rng = np.random.default_rng(1)
    for seed in range(5):
        masks = contextcite_masks(32, 6, seed)
        y = masks @ rng.normal(0, 2, 6) + rng.normal(0, 0.5, 32) - 30
        move = 1e-3 * np.abs(y).max()
        b = shipped.lasso_bound(masks, y, move)
        assert np.isfinite(b) and b > 0
        w0, _ = lasso_fit(masks, y, 7)
        w1, _ = lasso_fit(masks, y + rng.uniform(-move, move, 32), 7)
        assert np.abs(w1 - w0).max() <= b, seed
    assert shipped.lasso_bound(contextcite_masks(4, 6, 0), np.zeros(4), 0.0) == float("inf")  # d > n


PAPER_CONFIGS = ["context-cnn_dm.yaml", "context-hotpotqa.yaml", "context-tydiqa.yaml"]


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_paper_dataset_configs_are_valid_offline(name):
    cfg = cb.load_context_config(cb.Path(cb.__file__).parents[1] / "configs" / name)
    (task,) = cfg["tasks"]
    assert task["id"] in cd.HUB and task["n"] == 1000 and task["split"] == "validation"
    assert cfg["model"] == "smollm2" and "contextcite" in cfg["methods"]


def test_hub_loaders_fail_clearly_offline_and_read_rows(monkeypatch):
    import sys
    import types

    fake = types.ModuleType("datasets")

    def offline(path, name=None, split=None):
        raise ConnectionError("Couldn't reach the Hugging Face Hub (offline mode is enabled)")

    fake.load_dataset = offline
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(BadInput, match=r"cnn_dm task could not load abisee/cnn_dailymail/3\.0\.0 split validation"):
        cd.cnn_dm_examples(2)
    with pytest.raises(BadInput, match="hotpotqa/hotpot_qa.*network access"):
        cd.hotpotqa_examples(2)
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(BadInput, match="pip install datasets"):
        cd.tydiqa_examples(2)
    # rows as the hub gives them (mocked): gold passages from the supporting facts' titles
    row = {
        "question": "Which?",
        "context": {"title": ["A", "B", "C"], "sentences": [["a1.", " a2."], ["b1."], ["c1."]]},
        "supporting_facts": {"title": ["C", "A"], "sent_id": [0, 1]},
    }
    fake.load_dataset = lambda path, name=None, split=None: [row]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    (ex,) = cd.hotpotqa_examples(1)
    assert ex.context == ["a1.  a2.", "b1.", "c1."] and ex.gold == [0, 2] and ex.sources == "document"
    fake.load_dataset = lambda path, name=None, split=None: [
        {"language": "finnish", "document_plaintext": "x", "question_text": "q"},
        {"language": "english", "document_plaintext": "One. Two. Three.", "question_text": "Q?"},
    ]
    (ex,) = cd.tydiqa_examples(5, max_tokens=2)
    assert ex.query == "Q?" and ex.context == "One. Two."


@pytest.mark.slow
@pytest.mark.stored_numbers
def test_shipped_context_check_is_what_the_code_computes_now():
    """configs/context.yaml's check (`--check-sizes --limit 2`: short contexts, every method, stored responses)
    recomputed on smollm2 and compared with ctxmix/benchmark/shipped/context.check.csv by
    `shipped.context_check_moves` (tolerances derived there: the float32 bound of smollm2's forward pass for
    what a pass measures and the one-pass scores, the LASSO's stopping-rule bound for ContextCite's weights,
    rank metrics only where no near-tie could reorder them, LDS within the Spearman bound of the pairs that could
    swap). Under 2 minutes on one thread."""
    import torch

    from ctxmix.engine.models import load_model

    path = cb.Path(cb.__file__).parents[1] / "configs" / "context.yaml"
    cfg = cb.load_context_config(path)
    want = shipped.load_context_check("context")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        table = cb.run_context_benchmark(cfg, model=load_model(cfg["model"]), limit=shipped.CHECK_LIMIT, check=True)
    finally:
        torch.set_num_threads(before)
    assert sum(map(len, table.attrs["dropped"].values())) <= 1, table.attrs["dropped"]  # check/document-1, stored
    # every check example explains its stored response (a near-tie in greedy decoding changes nothing)
    assert all(cfg["responses"].get(k) == v for k, v in table.attrs["responses"].items())
    now = table.attrs["check"]
    bad, skipped = shipped.context_check_moves(now, want, int(cfg["n_ablations"]), int(cfg["seed"]))
    assert bad.empty, (
        f"the shipped context results are stale: {len(bad)} check rows moved beyond their tolerance; run python "
        f"bench/ship_results.py --context\n{bad.head(20).to_string()}"
    )
    # what was compared: every measured quantity and score, and most rank metrics (the skipped ones are named)
    compared = len(want) - len(skipped)
    assert compared >= 0.8 * len(want), skipped.to_string()


def test_every_context_method_has_a_docs_page():
    """docs/gen_pages.py writes one page per context method from CONTEXT_DOCS; a method added to the registry
    without an entry would silently get none (and mkdocs.yml's nav must name it)."""
    import importlib.util

    from ctxmix.methods.registry import CONTEXT_METHODS

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("gen_pages", root / "docs" / "gen_pages.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert sorted(gen.CONTEXT_DOCS) == sorted(CONTEXT_METHODS)
    nav = (root / "mkdocs.yml").read_text()
    assert all(f"methods/context/{m}.md" in nav for m in CONTEXT_METHODS)


def test_the_shipped_defaults_are_what_the_validation_tables_choose():
    """The methods layer reads one shipped mapping (ctxmix/methods/context/defaults.json) and no benchmark output;
    it is what `ctxmix.benchmark.context.defaults` writes from the shipped validation tables (validation, never the
    benchmark's test examples): rebuilt here, it is the shipped file, date aside. smollm2 (a chat model) gets the
    best method without ablations on its table, at2_exact with its shipped weights' default kind; gemma3 (a base
    model) gets it on its table asked in the base-model form, the form it is asked in by default; any other model
    the best of smollm2's table that needs no trained weights."""
    import json

    from ctxmix.benchmark.context.defaults import DEFAULTS_FILE, build_defaults, shipped_tables
    from ctxmix.methods.context import at2
    from ctxmix.methods.context.defaults import page_methods, shipped

    built, ships = build_defaults(), json.loads(DEFAULTS_FILE.read_text())
    assert {k: v for k, v in built.items() if k != "written"} == {k: v for k, v in ships.items() if k != "written"}
    assert shipped() == ships
    tables = {t["name"]: t for t in shipped_tables()}
    rec = tables["onepass-validation"]
    assert rec["split"] == "validation" and rec["model"] == "smollm2" and rec["examples"] >= 30
    assert all(rec["tasks"][t] >= 4 for t in at2.VALIDATION_TASKS)  # the four test tasks' shapes
    free = {m: v["lds"] for m, v in rec["methods"].items() if m in ("logit", "alti_logit", "attention", "key_mask_ig")}
    assert ships["fallback"]["page_methods"] == [max(free, key=lambda m: free[m]), "contextcite"]
    entries = {e["name"]: e for e in ships["models"]}
    smol = entries["smollm2"]
    kind = ships["at2_weights"][smol["at2_weights"]]["kind"]
    assert rec["at2_weights_sha256"] == smol["at2_weights"] == at2.weights_file_sha16("smollm2")
    assert rec["methods"][f"at2_exact/{kind}"]["lds"] > max(free.values())
    assert smol["page_methods"] == ["at2_exact", "contextcite"] and smol["prompt"] == {}
    g = entries["gemma3"]
    table = tables["onepass-validation-gemma3"]
    from ctxmix.methods.context.defaults import prompt_form_for

    assert g["prompt"] == table["prompt"] == prompt_form_for(False)  # gemma3 has no chat template
    assert g["page_methods_chosen_on"].startswith("onepass-validation-gemma3.json")
    # a model that matches no entry: the fallback (no trained weights), whatever its name
    other = SimpleNamespace(name="smollm2", n_layers=3, n_heads=2, info={})
    assert page_methods(other)[0] == ships["fallback"]["page_methods"]
    page = (Path(__file__).resolve().parents[1] / "pages" / "0_Context_attribution.py").read_text()
    assert "default_methods, chosen_on = page_methods(model)" in page
    # the docs quote the shipped table as it renders now
    docs = (Path(__file__).resolve().parents[1] / "docs" / "context.md").read_text()
    assert _onepass_eval().markdown(rec["methods"]) in docs


def test_gemma3_validation_tables_its_benchmark_form_and_the_pages():
    """gemma3 has two validation tables. onepass-validation-gemma3.json is asked in its benchmark config's prompt
    form (the answer cue, the first-sentence cut), which is also the form a model without a chat template is asked
    in by default since 2026-11-28, with the rows of the shipped gemma3 weights (by hash): it chooses their default
    kind and the page's default methods for gemma3. onepass-validation-gemma3-page.json was asked in the page's
    former form (no cue, no cut, 24 new tokens): a record that chose the same method (key_mask_ig). The docs quote
    both as they render now."""
    import json

    from ctxmix.benchmark.context.prompt_form import prompt_form
    from ctxmix.methods.context import at2
    from ctxmix.methods.context.defaults import prompt_form_for, shipped

    rec = json.loads((shipped_dir() / "onepass-validation-gemma3.json").read_text())
    assert rec["split"] == "validation" and rec["model"] == "gemma3" and rec["examples"] >= 30
    assert all(rec["tasks"][t] >= 4 for t in at2.VALIDATION_TASKS)
    config = cb.load_context_config(Path(cb.__file__).parents[1] / "configs" / "context-gemma3.yaml")
    assert rec["prompt"] == prompt_form(config) == prompt_form_for(False) and rec["max_new_tokens"] == 48
    assert rec["at2_weights_sha256"] == at2.weights_file_sha16("gemma3")
    names = {at2.KIND_ALIASES.get(n.split("/")[1], n.split("/")[1]) for n in rec["methods"] if n.startswith("at2_")}
    assert names == set(at2.ESTIMATORS) and {"logit", "contextcite"} <= set(rec["methods"])
    free = {m: v["lds"] for m, v in rec["methods"].items() if m in ("logit", "alti_logit", "attention", "key_mask_ig")}
    entry = next(e for e in shipped()["models"] if e["name"] == "gemma3")
    best = max(free, key=lambda m: free[m])
    if free[best] < rec["methods"]["at2_exact/logit"]["lds"]:
        best = "at2_exact"
    assert entry["page_methods"] == [best, "contextcite"] == ["key_mask_ig", "contextcite"]
    page_rec = json.loads((shipped_dir() / "onepass-validation-gemma3-page.json").read_text())
    assert page_rec["prompt"] == {} and page_rec["max_new_tokens"] == 24
    old = {m: v["lds"] for m, v in page_rec["methods"].items() if m in free}
    assert max(old, key=lambda m: old[m]) == "key_mask_ig"  # the former form chose the same
    docs = (Path(__file__).resolve().parents[1] / "docs" / "context.md").read_text()
    assert _onepass_eval().markdown(rec["methods"]) in docs
    assert _onepass_eval().markdown(page_rec["methods"]) in docs


def shipped_dir() -> Path:
    return shipped.SHIPPED


def _onepass_eval():
    """bench/onepass_eval.py as a module (bench/ is no package)."""
    spec = importlib.util.spec_from_file_location(
        "onepass_eval", Path(__file__).resolve().parents[1] / "bench" / "onepass_eval.py"
    )
    oe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(oe)
    return oe


def test_the_page_default_needs_usable_weights_in_the_models_form(tmp_path):
    """The benchmark's choice of a model's page methods (`model_entry`): the best method without ablations on the
    model's own validation table in the form it is asked in; at2_exact competes only where that table scored the
    model's shipped file (by hash), whose default kind's trained weights are in use and were trained in that form;
    a table of another form, or none, chooses nothing (the fallback then)."""
    from ctxmix.benchmark.context.defaults import file_sha16, model_entry, weights_entry
    from ctxmix.methods.context import at2

    w = {at2.DEFAULT_KIND: at2.uniform_weights(2, 2)}
    rows = [{"features": at2.DEFAULT_KIND, "weights": w_, "lds": v} for w_, v in (("trained", 0.9), ("untrained", 0.8))]
    meta = {"model": "m", "heldout": {"rows": rows}}
    good = at2.save_weights(tmp_path / "good.npz", w, 2, 2, meta)
    low = [dict(r, lds=0.7) if r["weights"] == "trained" else r for r in rows]
    below = at2.save_weights(tmp_path / "below.npz", w, 2, 2, {**meta, "heldout": {"rows": low}})
    cue = at2.save_weights(tmp_path / "cue.npz", w, 2, 2, {**meta, "prompt": {"stop": "sentence"}})
    methods = {"logit": {"lds": 0.8}, "key_mask_ig": {"lds": 0.7}, "contextcite": {"lds": 0.95}}
    methods["at2_exact/logit"] = {"lds": 0.85, "lds_needles": 0.85}
    model = SimpleNamespace(name="m", n_layers=2, n_heads=2, info={}, _weights_sha256="f" * 64)
    for path, want in ((good, "at2_exact"), (below, "logit"), (cue, "logit")):
        table = {"name": "t", "model": "m", "prompt": {}, "methods": methods, "at2_weights_sha256": file_sha16(path)}
        weights = {file_sha16(path): weights_entry(path, [table])}
        entry = model_entry(model, {}, weights, [table])
        assert entry["page_methods"] == [want, "contextcite"] and entry["weights_sha256"] == "f" * 64, path
        # the table of another file (a retrained one): at2_exact does not compete
        other = {**table, "at2_weights_sha256": "0" * 16}
        assert model_entry(model, {}, weights, [other])["page_methods"][0] == "logit"
        # a table asked in another form than the model's is not its table: no page methods of its own
        assert "page_methods" not in model_entry(model, {"stop": "sentence"}, weights, [table])


def test_a_config_refuses_at2_weights_of_another_prompt_form(tmp_path):
    """A context config whose at2_exact reads weights trained on another prompt form than it asks with is refused
    before any model is loaded (a base model's cue and cut change every feature); the same form runs."""
    from ctxmix.methods.context import at2

    root = Path(cb.__file__).parents[1] / "configs"
    cfg = cb.load_context_config(root / "context-gemma3.yaml")
    w = {at2.DEFAULT_KIND: at2.uniform_weights(2, 2)}
    plain = at2.save_weights(tmp_path / "plain.npz", w, 2, 2, {})
    with pytest.raises(BadInput, match="prompt form"):
        cb.run_context_benchmark({**cfg, "at2_weights": str(plain)}, model=object())
    from ctxmix.benchmark.context.prompt_form import prompt_form

    cued = at2.save_weights(tmp_path / "cued.npz", w, 2, 2, {"prompt": prompt_form(cfg)})
    cb.check_at2_prompt({**cfg, "at2_weights": str(cued)})  # no error
    cb.check_at2_prompt(cfg)  # untrained: nothing to check


# ---------------------------------------------------------------------------------------------------------
# the long task, a base model's prompt (configs/context-gemma3.yaml)


def test_long_examples_alternate_needles_and_summaries_on_draws_of_their_own():
    a = cd.long_examples(3, 1000, 1500, seed=0)
    assert [e.id for e in a] == ["long-needle-0", "long-summary-0", "long-needle-1"]
    assert [vars(e) for e in a] == [vars(e) for e in cd.long_examples(3, 1000, 1500, seed=0)]
    assert all(1000 <= len(e.context.split()) <= 1500 for e in a)  # default count: whitespace words
    for e, nd in zip(a[::2], cd.NEEDLES):
        sents = make_sources(e.context, "sentence").texts
        assert sents[e.gold[0]] == nd.fact and e.answer == nd.answer and e.query == nd.question
    assert a[1].query == cd.SUMMARY_QUERY and a[1].gold == [] and a[1].answer is None
    # not the needles (summaries) task's examples at these lengths: their draws differ
    assert a[0].context != cd.needle_examples(1, 1000, 1500, seed=0)[0].context
    assert a[1].context != cd.summary_examples(1, 1000, 1500, seed=0)[0].context
    assert cd.TASKS["long"] is cd.long_examples and "long" in cd.OFFLINE_TASKS


def test_a_base_models_answer_is_cut_at_its_first_sentence_or_line():
    # gemma3 (a base model) never ends its answer: it goes on with news text or another "Query:"
    assert cb.cut_at_stop(" 4817. A rare calm in the territories", "sentence") == " 4817."
    assert cb.cut_at_stop(" 4817. A rare calm in the territories", "line") == " 4817. A rare calm in the territories"
    assert cb.cut_at_stop(" Clara Voss.\n\nQuery: What is", "sentence") == " Clara Voss."
    assert cb.cut_at_stop(" Clara Voss\nQuery: What is", "line") == " Clara Voss"
    assert cb.cut_at_stop(" The U.S. envoy met Dr. Smith on Monday. Then", "sentence") == (
        " The U.S. envoy met Dr. Smith on Monday."
    )
    assert cb.cut_at_stop("no end", "sentence") == "no end" and cb.cut_at_stop("a. b", None) == "a. b"
    assert cd.first_sentence("738. The bus runs daily.") == "738."  # not a numbered list's "1. "


def test_the_configs_prompt_keys_reach_the_prompt_and_the_response(tokenizer, monkeypatch):
    """template, query_suffix (a base model's answer cue), stop, at2_weights and at2_features: the prompt
    generate_response builds, the generated text cut, and the same query, template, weights and kind passed to
    attribute_context."""
    from ctxmix.methods.context import prompt as cp

    llama = tiny_model("llama", tokenizer)
    cfg = {**_config({}), "template": "plain", "query_suffix": "\nAnswer:", "stop": "sentence"}
    cfg["at2_weights"] = "untrained"
    ex = cd.needle_examples(1, 30, 50, seed=0)[0]
    seen = {}

    def fake_response(model, builder, src, prompt, response, max_new_tokens, progress):
        seen.update(query=builder.query, kind=builder.kind, text=builder.text(builder.full(src)))
        return type("R", (), {"text": f" {ex.answer}. And then the news goes on.\nQuery: more"})()

    monkeypatch.setattr(cp, "make_response", fake_response)
    text, n_prompt, n_sources = cb.generate_response(llama, cfg, ex)
    assert text == f" {ex.answer}." and seen["query"] == ex.query + "\nAnswer:" and seen["kind"] == "plain"
    assert seen["text"].endswith(ex.query + "\nAnswer:") and n_sources == len(make_sources(ex.context).texts)
    got = {}

    def fake_attribute(model, context, query, **kw):
        got.update(query=query, **kw)
        return type("CA", (), {"response": "nothing"})()  # lacks the answer: dropped before evaluate

    rec = cb._one_example(llama, cfg, ["logit"], ex, None, {}, False, fake_attribute)
    assert rec["dropped"] and got["response"] == f" {ex.answer}." and got["prompt"]["template"] == "plain"
    # the cue is in the query already and the response cut: the call adds neither (never the shipped defaults)
    assert got["prompt"]["query_suffix"] == "" and got["prompt"]["stop"] is None
    assert got["query"] == ex.query + "\nAnswer:" and got["at2"]["weights"] == "untrained"
    assert got["at2"]["features"] is None  # not named: the weights' default kind
    cb._one_example(llama, {**cfg, "at2_features": "norm"}, ["logit"], ex, None, {}, False, fake_attribute)
    assert got["at2"]["features"] == "norm"
    with pytest.raises(BadInput, match="at2_features must be one of"):
        cb.validate_context_config({**cfg, "at2_features": "grad"})
    stamp = cb.config_stamp(cfg, False, cfg["tasks"][0], None)  # a named kind is part of the results' identity
    assert cb.config_stamp({**cfg, "at2_features": "norm"}, False, cfg["tasks"][0], None) != stamp
    with pytest.raises(BadInput, match="stop must be"):
        cb.validate_context_config({**cfg, "stop": "\n"})
    with pytest.raises(BadInput, match="template must be"):
        cb.validate_context_config({**cfg, "template": "base"})
    with pytest.raises(BadInput, match="query_suffix"):
        cb.validate_context_config({**cfg, "query_suffix": ""})


class _WordModel:
    """A stand-in with a tokenizer that counts words: the example ids a config builds do not depend on it."""

    @staticmethod
    def tokenizer(text, add_special_tokens=False):
        return {"input_ids": text.split()}


@pytest.mark.parametrize("name", ["context.yaml", "context-gemma3.yaml"])
def test_every_example_of_the_context_configs_has_its_stored_response(name):
    """Run and check examples alike (`--check-sizes --limit 2`), so a run explains stored text only; the long
    task's recorded lengths lie in [1,000, 4,000] tokens of the config's model (tests/test_context_splits.py
    recomputes the record) and the long task is not in the check."""
    from ctxmix.benchmark import shipped

    cfg = cb.load_context_config(cb.Path(cb.__file__).parents[1] / "configs" / name)
    keys = [
        cb.example_key(e, check)
        for check in (False, True)
        for t in cb.run_tasks(cfg, check)
        for e in cb.task_examples(t, _WordModel, shipped.CHECK_LIMIT if check else None)
    ]
    assert len(keys) == len(set(keys)) and sorted(cfg["responses"]) == sorted(keys)
    assert [k for k in keys if k.startswith("long")] == [
        "long-needle-0",
        "long-summary-0",
        "long-needle-1",
        "long-summary-1",
    ]
    lo, _, hi = cfg["examples"]["tasks"]["long"]["context_tokens"]
    assert 1000 <= lo and hi <= 4000 and cfg["examples"]["check"]["long"] == {"n": 0}


def test_the_gemma3_config_is_the_smollm2_benchmark_on_a_base_model():
    """configs/context-gemma3.yaml: the same tasks and methods as configs/context.yaml, on gemma3 with the plain
    prompt, an answer cue and the first sentence of each response; per-example mask seeds (the default)."""
    root = cb.Path(cb.__file__).parents[1] / "configs"
    a, b = (cb.load_context_config(root / n) for n in ("context.yaml", "context-gemma3.yaml"))
    assert b["model"] == "gemma3" and b["template"] == "plain" and b["query_suffix"] == "\nAnswer:"
    assert b["stop"] == "sentence" and "mask_seeds" not in b
    same = ("methods", "n_ablations", "seed", "max_new_tokens", "batch_size", "evaluate", "tasks", "check")
    assert {k: a[k] for k in same} == {k: b[k] for k in same}
    # at2_exact reads gemma3's shipped weights, trained in this config's prompt form (else the run is refused)
    assert "at2_weights" not in b and cb.at2_weights_sha256(b) is not None
    cb.check_at2_prompt(b)


def test_a_retrained_at2_weights_file_makes_stored_results_stale(tmp_path, monkeypatch):
    """at2_exact's numbers depend on its weights file, not only on the config: the resume stamp and the shipped
    results' record carry the file's hash, so a retrained shipped file is neither reused nor shown as current."""
    import hashlib
    import json
    import shutil

    from ctxmix.methods.context import at2

    root = Path(cb.__file__).parents[1] / "configs"
    cfg = cb.load_context_config(root / "context.yaml")
    shipped_file = at2.shipped_weights_path("smollm2")
    assert cb.at2_weights_sha256(cfg) == hashlib.sha256(shipped_file.read_bytes()).hexdigest()[:16]
    assert cb.at2_weights_sha256({**cfg, "at2_weights": "untrained"}) is None
    no_at2 = {**cfg, "methods": ["logit"], "tasks": [{**t, "methods": ["logit"]} for t in cfg["tasks"]]}
    assert cb.at2_weights_sha256(no_at2) is None
    assert cb.at2_weights_sha256({**cfg, "at2_weights": str(tmp_path / "gone.npz")}).startswith("missing:")
    # a config whose at2_exact reads no file keeps the stamp it had before the hash joined it
    t0 = no_at2["tasks"][0]
    rest = {k: v for k, v in no_at2.items() if k != "responses"}
    old = hashlib.sha256(json.dumps([rest, False, t0, "x"], sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert cb.config_stamp(no_at2, False, t0, "x") == old
    task = cfg["tasks"][0]
    before = cb.config_stamp(cfg, False, task, "x")
    # the same config, another weights file: another stamp (a resumed run recomputes the example)
    other = tmp_path / "w.npz"
    shutil.copy(shipped_file, other)
    with_file = {**cfg, "at2_weights": str(other)}
    stamp = cb.config_stamp(with_file, False, task, "x")
    with other.open("ab") as f:
        f.write(b"\0")
    assert cb.config_stamp(with_file, False, task, "x") != stamp and stamp != before
    # the kind the validation table chose: F-logit keeps the stamp; another kind (a table rerun that turns the
    # default) changes it, and so does naming a kind in the config
    assert cb.at2_default_kind(cfg) == "logit" and cb.at2_default_kind({**cfg, "at2_features": "attn"}) is None
    monkeypatch.setattr(cb, "at2_default_kind", lambda config: "attn+norm+logit")
    assert cb.config_stamp(cfg, False, task, "x") != before
    monkeypatch.undo()
    assert (
        cb.config_stamp(cfg, False, task, "x")
        == before
        != cb.config_stamp({**cfg, "at2_features": "attn"}, False, task, "x")
    )
    # a shipped result records the hash; stale_reasons names a changed file
    folder = tmp_path / "shipped"
    folder.mkdir()
    (tmp_path / "configs").mkdir()
    shutil.copy(root / "context.yaml", tmp_path / "configs" / "context.yaml")
    meta = {
        "name": "context",
        "kind": "context",
        "config": "configs/context.yaml",
        "config_sha256": shipped.config_sha256(root / "context.yaml"),
        "ctxmix_version": ctxmix.__version__,
        "at2_weights_sha256": cb.at2_weights_sha256(cfg),
    }
    (folder / "context.json").write_text(json.dumps(meta))
    (folder / "context.aggregates.csv").write_text("task,method,metric,mean,std,n,nan,higher_is_better\n")
    monkeypatch.setattr(shipped, "SHIPPED", folder)
    assert shipped.stale_reasons("context", tmp_path) == []
    (folder / "context.json").write_text(json.dumps({**meta, "at2_weights_sha256": "0" * 16}))
    assert shipped.stale_reasons("context", tmp_path) == [
        "at2_exact's weights file changed since these results were made"
    ]


@pytest.mark.parametrize("name", shipped.shipped_names("context"))
def test_shipped_context_results_are_of_the_config_and_weights_as_they_are(name):
    _, meta = shipped.load_context_shipped(name)
    assert "at2_weights_sha256" in meta  # None where at2_exact's weights are untrained
    assert shipped.stale_reasons(name, Path(cb.__file__).parents[1]) == []


def test_onepass_eval_scores_at2_estimators_against_the_same_heldout_ablations(tokenizer, tmp_path):
    """bench/onepass_eval.py's at2_exact/<kind> rows use the main call's held-out ablations: uniform F-logit
    weights rank sources as `logit` does, so their LDS and recall equal logit's row exactly."""
    from dataclasses import replace

    from ctxmix.methods.context import at2

    oe = _onepass_eval()
    llama = tiny_model("llama", tokenizer)
    L, H = len(llama.layers), llama.layers[0].n_heads
    count = lambda s: len(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    ex = cd.needle_examples(1, 30, 50, seed=0, count_tokens=count, split="validation")[0]
    ex = replace(ex, response=f"The answer is {ex.answer}.")  # a random model answers nothing: a given response
    w = {"logit": at2.uniform_weights(L, H), "attn": at2.uniform_weights(L, H)}
    p = at2.save_weights(tmp_path / "w.npz", w, L, H, {"model": "tiny"})
    rec = oe.score_example(llama, ex, ["logit", "attention", "contextcite"], 4, 8, at2_weights=str(p))
    got = rec["methods"]
    assert set(got) == {"logit", "attention", "contextcite", "at2_exact/logit", "at2_exact/attention"}
    assert got["at2_exact/logit"]["lds"] == pytest.approx(got["logit"]["lds"], abs=1e-12)
    assert got["at2_exact/attention"]["lds"] == pytest.approx(got["attention"]["lds"], abs=1e-12)
    assert got["at2_exact/logit"]["recall@1"] == got["logit"]["recall@1"]
    assert math.isnan(got["at2_exact/logit"]["topk_drop@1"]) and got["at2_exact/logit"]["seconds"] > 0
    # the table's cost column: each method's seconds over ContextCite's on the same example; "-" where not measured
    summ = oe.summary([rec], list(got))
    assert summ["contextcite"]["time_vs_contextcite"] == 1.0
    want = got["at2_exact/logit"]["seconds"] / got["contextcite"]["seconds"]
    assert summ["at2_exact/logit"]["time_vs_contextcite"] == pytest.approx(want, rel=1e-12)
    row = next(line for line in oe.table([rec], list(got)).splitlines() if line.startswith("| `at2_exact/logit`"))
    assert row.split(" | ")[5:7] == ["-", "-"] and row.endswith(f"| {want:.3f} |")
    # a task's own LDS column appears where some example was shaped like it (--documents, --long): its mean there
    docs_rec = {**rec, "id": "validation-document-0", "task": "documents"}
    head, _, first = oe.table([rec, docs_rec], list(got)).splitlines()[:3]
    assert "| LDS documents |" in head and "LDS long" not in head
    assert first.split(" | ")[4] == f"{got['logit']['lds']:.3f}"  # logit's LDS on its one documents example
    # a base model's prompt form: the benchmark's query cue, template and cut response (bench.generate_response)
    config = {"template": "plain", "query_suffix": "\nAnswer:", "stop": "sentence", "max_new_tokens": 8}
    asked = replace(ex, response=None)
    rec = oe.score_example(
        llama, asked, ["logit"], 4, 8, prompt={k: config[k] for k in ("template", "query_suffix", "stop")}
    )
    text, n_prompt, _ = cb.generate_response(llama, config, asked)
    assert (rec["response"], rec["tokens"]) == (text, n_prompt)
