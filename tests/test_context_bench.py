"""Context attribution's offline benchmark: the seeded examples (`ctxmix.benchmark.context_data`) and the
runner (`ctxmix.benchmark.context_bench.run_context_benchmark`) on a tiny random float64 Llama
(tests/conftest.py), checked against a direct `attribute_context` + `evaluate` of the same example."""

import math

import numpy as np
import pytest
from conftest import tiny_model

import ctxmix
from ctxmix.benchmark import context_bench as cb
from ctxmix.benchmark import context_data as cd
from ctxmix.errors import BadInput
from ctxmix.methods.sources import make_sources


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
    cfg = cb.load_context_config(cb.Path(cb.__file__).parent / "configs" / "context.yaml")
    assert {t["id"] for t in cfg["tasks"]} == set(cd.TASKS)


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
    assert set(ex[ex.task == "summaries"].metric) == {"topk_drop@1", "lds"}
    assert set(ex[ex.task == "needles"].metric) == {"topk_drop@1", "lds", "recall@1", "recall@3"}
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
        n_ablations=4,
        progress=False,
    )
    direct = ca.evaluate(llama, gold=e.gold, progress=False, **EVAL).set_index("method")
    got = ex[ex.example == "needle-0"].pivot(index="method", columns="metric", values="value")
    for m in ("logit", "contextcite"):
        for k in ("topk_drop@1", "lds", "recall@1", "recall@3"):
            assert np.isclose(got.loc[m, k], direct.loc[m, k], rtol=0, atol=0, equal_nan=True), (m, k)
