"""Many spans and many examples: `ContextAttribution.scores_for` with a list of spans, and
`ctxmix.attribute_contexts` (a list or a JSON-lines file, one table, resumable through its store) against
single `attribute_context` calls, on a tiny random float64 Llama (tests/conftest.py)."""

import json

import numpy as np
import pandas as pd
import pytest
from conftest import tiny_model

import ctxmix
from ctxmix.errors import BadInput
from ctxmix.methods.context import attribution

SENTENCES = [
    "The cat sat on the mat.",
    "The code is 4817.",
    "Birds fly south in winter.",
    "The museum opened in 1902.",
    "Rain fell all night.",
    "The café closes at five.",
]
OPTIONS = dict(methods=["logit", "contextcite"], n_ablations=4)


@pytest.fixture(scope="module")
def llama(tokenizer):
    return tiny_model("llama", tokenizer)


def examples(n=20):
    out = []
    for i in range(n):
        picked = [SENTENCES[(i + j) % len(SENTENCES)] for j in range(2 + i % 3)]
        ex = {"context": " ".join(picked), "query": "What is the code?", "response": f"the code is {i}"}
        if i % 5 == 4:  # a conversation now and then
            ex = {
                "messages": [
                    {"role": "user", "content": " ".join(picked)},
                    {"role": "assistant", "content": "Noted."},
                    {"role": "user", "content": "What is the code?", "attribute": False},
                ],
                "response": f"the code is {i}",
            }
        out.append(ex)
    return out


def _single(llama, ex):
    kw = {k: v for k, v in ex.items() if k != "id"}
    return attribution.attribute_context(llama, **kw, **OPTIONS, progress=False)


def test_scores_for_a_list_of_spans(llama):
    ca = _single(llama, examples(1)[0])
    spans = [(0, 3), (4, 8), (9, len(ca.response))]
    for m in ca.methods:
        rows = ca.scores_for(m, spans)
        assert rows.shape == (3, ca.n_sources)
        for row, sp in zip(rows, spans):
            assert np.array_equal(row, ca.scores_for(m, sp))
    assert ca.scores_for("logit", (0, 3)).shape == (ca.n_sources,)
    with pytest.raises(BadInput, match="outside the response"):
        ca.scores_for("logit", [(0, 3), (0, 999)])


def test_twenty_examples_are_twenty_single_calls(llama, tmp_path):
    exs = examples(20)
    path = tmp_path / "examples.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in exs) + "\n", encoding="utf-8")
    table = ctxmix.attribute_contexts(llama, path, progress=False, **OPTIONS)
    assert list(table.columns) == ["example", "message", "method", "source", "start", "end", "text", "score", "rank"]
    assert table["example"].nunique() == 20
    for k, ex in enumerate(exs):
        ca = _single(llama, ex)
        mine = table[table["example"] == str(k)].drop(columns=["example", "message"]).reset_index(drop=True)
        pd.testing.assert_frame_equal(mine, ca.to_frame(), check_exact=True)
        assert table.attrs["responses"][str(k)] == ca.response
        rows = table[(table["example"] == str(k)) & (table["method"] == "logit")]
        assert list(rows["message"]) == ca.source_messages


def test_a_killed_run_resumes_where_it_stopped(llama, tmp_path, monkeypatch):
    exs = examples(20)
    store = tmp_path / "run.jsonl"
    real = attribution.attribute_context
    calls = []

    def counting(*args, **kw):
        calls.append(kw.get("response"))
        if len(calls) > 8 and kill:
            raise KeyboardInterrupt("killed")
        return real(*args, **kw)

    monkeypatch.setattr(attribution, "attribute_context", counting)
    kill = True
    with pytest.raises(KeyboardInterrupt):
        ctxmix.attribute_contexts(llama, exs, store=store, progress=False, **OPTIONS)
    assert len(store.read_text().splitlines()) == 8
    kill, calls[:] = False, []
    resumed = ctxmix.attribute_contexts(llama, exs, store=store, progress=False, **OPTIONS)
    assert calls == [e["response"] for e in exs[8:]]  # only the twelve it lacked
    monkeypatch.setattr(attribution, "attribute_context", real)
    fresh = ctxmix.attribute_contexts(llama, exs, progress=False, **OPTIONS)
    pd.testing.assert_frame_equal(resumed, fresh, check_exact=True)
    calls[:] = []
    monkeypatch.setattr(attribution, "attribute_context", counting)
    ctxmix.attribute_contexts(llama, exs, store=store, progress=False, **{**OPTIONS, "n_ablations": 5})
    assert len(calls) == 20  # other options: nothing reused


def test_bad_examples_are_refused(llama, tmp_path):
    for bad, match in [
        ([], "non-empty"),
        ([{"context": "a. b.", "messages": []}], "either"),
        ([{"context": "a. b.", "colour": 1}], "unknown keys"),
        ([{"id": "x", "context": "a. b."}, {"id": "x", "context": "c. d."}], "twice"),
        (str(tmp_path / "missing.jsonl"), "no such"),
    ]:
        with pytest.raises(BadInput, match=match):
            ctxmix.attribute_contexts(llama, bad, progress=False)


def test_a_store_is_not_reused_by_another_model_of_the_same_name(llama, tokenizer, tmp_path):
    """The resume key is the model's identity (its fingerprint: weights, dtype, precision, quantization), not
    its name: the same name with other weights computes anew and gets its own scores."""
    import torch

    store = tmp_path / "run.jsonl"
    exs = examples(2)
    first = ctxmix.attribute_contexts(llama, exs, store=store, progress=False, **OPTIONS)
    other = tiny_model("llama", tokenizer)
    with torch.no_grad():
        for p in other.hf.parameters():
            p.mul_(1.5)
    assert other.name == llama.name
    again = ctxmix.attribute_contexts(other, exs, store=store, progress=False, **OPTIONS)
    fresh = ctxmix.attribute_contexts(other, exs, progress=False, **OPTIONS)
    assert not np.allclose(first["score"].to_numpy(), again["score"].to_numpy())
    np.testing.assert_allclose(again["score"].to_numpy(), fresh["score"].to_numpy(), rtol=0, atol=0)
