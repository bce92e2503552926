"""Offline text sources: gensim's bundled corpora and local files, with readable errors."""

import json
import re

import pytest

from ctxmix.data import (
    CORPORA,
    LabelledText,
    corpus,
    hf_dataset_texts,
    lee_background,
    pang_lee,
    read_labelled,
    read_texts,
    wiki_texts,
)


def test_pang_lee_has_200_balanced_labelled_sentences():
    items = pang_lee()
    assert len(items) == 200
    assert all(isinstance(it, LabelledText) for it in items)
    assert {it.label for it in items} == {0, 1}
    assert sum(it.label == 0 for it in items) == 100
    assert all((it.label, it.label_name) in {(0, "neg"), (1, "pos")} for it in items)
    assert all(it.text and "__label__" not in it.text and it.text == it.text.strip() for it in items)
    assert items[0].text == "simplistic , silly and tedious ."  # file order is kept
    assert any("clichés" in it.text for it in items)  # cp1252 decoded, not mojibake
    assert pang_lee(limit=5) == items[:5]


def test_wiki_texts_are_clean_prose_chunks():
    texts = wiki_texts(limit=20)
    assert len(texts) == 20
    for t in texts:
        assert not re.search(r"\{\{|\}\}|\[\[|\]\]|\||<|>|==|'''", t), t
        assert 8 <= len(t.split()) <= 100
        assert t[0].isupper() and t[-1] in ".!?\"'"
    assert texts == wiki_texts(limit=20)  # deterministic (and cached)
    assert "Anarchism" in texts[0]


def test_wiki_texts_respect_max_words():
    texts = wiki_texts(limit=50, max_words=30)
    assert len(texts) == 50
    assert all(8 <= len(t.split()) <= 30 for t in texts)


def test_lee_background_lines():
    texts = lee_background(limit=3)
    assert len(texts) == 3
    assert all(t and t == t.strip() for t in texts)
    assert len(lee_background()) > 200


def test_read_texts_txt(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("first line\n\n   \nsecond line  \nthird\n", encoding="utf-8")
    assert read_texts(p) == ["first line", "second line", "third"]
    assert read_texts(str(p), limit=2) == ["first line", "second line"]


def test_read_texts_jsonl(tmp_path):
    p = tmp_path / "a.jsonl"
    rows = [{"text": "one", "id": 1}, "a bare string", {"text": "two"}, {"body": "x", "text": "three"}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert read_texts(p) == ["one", "a bare string", "two", "three"]
    q = tmp_path / "b.jsonl"
    q.write_text('{"body": "hello"}\n{"body": "world"}\n', encoding="utf-8")
    assert read_texts(q, field="body") == ["hello", "world"]


def test_read_texts_skips_empty_records_with_a_warning(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "ok"}\n{"text": "  "}\n{"text": ""}\n{"text": "fine"}\n', encoding="utf-8")
    with pytest.warns(UserWarning, match="skipped 2 empty records"):
        assert read_texts(p) == ["ok", "fine"]


def test_read_texts_missing_file(tmp_path):
    with pytest.raises(ValueError, match="file not found"):
        read_texts(tmp_path / "nope.txt")


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_read_texts_empty_file(tmp_path, suffix):
    p = tmp_path / f"empty{suffix}"
    p.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty"):
        read_texts(p)


def test_read_texts_bad_json_names_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2: not valid JSON"):
        read_texts(p)


def test_read_texts_missing_field_names_line_and_fields(tmp_path):
    p = tmp_path / "f.jsonl"
    p.write_text('{"text": "ok"}\n{"body": "x", "id": 3}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2: no field 'text'; fields on this line: 'body', 'id'"):
        read_texts(p)


def test_read_texts_non_string_field(tmp_path):
    p = tmp_path / "n.jsonl"
    p.write_text('{"text": 5}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 1: field 'text' must be a string"):
        read_texts(p)


def test_read_labelled_csv_with_string_labels(tmp_path):
    p = tmp_path / "l.csv"
    p.write_text('text,label\n"good, really",pos\nbad,neg\n,pos\nfine,pos\n', encoding="utf-8")
    with pytest.warns(UserWarning, match="skipped 1 empty record"):
        items = read_labelled(p)
    assert items == [
        LabelledText("good, really", 1, "pos"),
        LabelledText("bad", 0, "neg"),
        LabelledText("fine", 1, "pos"),
    ]


def test_read_labelled_jsonl_with_int_labels(tmp_path):
    p = tmp_path / "l.jsonl"
    p.write_text('{"sentence": "a", "y": 2}\n{"sentence": "b", "y": 0}\n', encoding="utf-8")
    items = read_labelled(p, text_field="sentence", label_field="y")
    assert [(it.text, it.label, it.label_name) for it in items] == [("a", 2, "2"), ("b", 0, "0")]


def test_read_labelled_missing_column(tmp_path):
    p = tmp_path / "l.csv"
    p.write_text("sentence,label\nhi,1\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"no column 'text'; columns: 'sentence', 'label'"):
        read_labelled(p)


def test_hf_dataset_texts_offline_suggests_offline_corpora(monkeypatch):
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("ctxmix.data._hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(RuntimeError, match=r"unreachable.*'wiki'.*local"):
        hf_dataset_texts("imdb", "test", "text", limit=3)


def test_corpus_dispatch(tmp_path):
    assert CORPORA == ("wiki", "pang_lee", "lee")
    assert corpus("pang_lee", limit=2) == [it.text for it in pang_lee(limit=2)]
    assert corpus("lee", limit=2) == lee_background(limit=2)
    assert corpus("wiki", limit=3) == wiki_texts(limit=3)
    p = tmp_path / "mine.txt"
    p.write_text("x y z\n", encoding="utf-8")
    assert corpus(str(p)) == ["x y z"]


def test_corpus_unknown_name_lists_valid_names(tmp_path):
    with pytest.raises(ValueError, match=r"unknown corpus 'nope'.*'wiki', 'pang_lee', 'lee'"):
        corpus("nope")
    with pytest.raises(ValueError, match="no such file"):
        corpus(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="hf:<dataset>:<split>:<field>"):
        corpus("hf:imdb")
