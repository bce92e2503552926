"""The runner checks a dataset's label numbering against a classifier's id2label before any work:
accuracy_mask and target: gold read the dataset's label index as the model's class index, and MNLI
checkpoints, for one, order their classes differently."""

import json
import sqlite3

import pytest
import torch
import yaml
from conftest import tiny_variant

import ctxmix
from ctxmix import benchmark as runner
from ctxmix.benchmark.config import DatasetSpec
from ctxmix.benchmark.datasets import Example, check_label_order, label_names, load_examples
from ctxmix.errors import BadInput

MNLI = {0: "entailment", 1: "neutral", 2: "contradiction"}


def test_a_different_order_is_refused_with_both_orders():
    sorted_names = {0: "contradiction", 1: "entailment", 2: "neutral"}  # a file's string labels, sorted
    with pytest.raises(BadInput) as e:
        check_label_order("nli", sorted_names, "mnli-model", MNLI)
    msg = str(e.value)
    assert "[0 contradiction, 1 entailment, 2 neutral]" in msg and "[0 entailment, 1 neutral, 2 contradiction]" in msg
    assert "'nli'" in msg and "'mnli-model'" in msg
    with pytest.raises(BadInput, match="number their labels differently"):  # abbreviations are names too
        check_label_order("pl", {0: "neg", 1: "pos"}, "m", {0: "POSITIVE", 1: "NEGATIVE"})


@pytest.mark.parametrize(
    "names, id2label",
    [
        (dict(MNLI), MNLI),  # the same order
        ({0: "neg", 1: "pos"}, {"0": "negative", "1": "positive"}),  # pang_lee and minilm-sentiment
        ({0: "contradiction", 1: "entailment"}, {0: "LABEL_0", 1: "LABEL_1"}),  # the model names none
        ({0: "spam", 1: "ham"}, {0: "negative", 1: "positive"}),  # no name in common: nothing to compare
        ({}, MNLI),  # the dataset names none
    ],
)
def test_orders_that_agree_or_cannot_be_compared_pass(names, id2label):
    check_label_order("d", names, "m", id2label)


def test_label_names_leave_numbers_out():
    exs = [Example("a", "x", 1, "pos"), Example("b", "y", 0, "neg"), Example("c", "z", 2, "2"), Example("d", "w")]
    assert label_names(exs) == {0: "neg", 1: "pos"}


def test_a_hub_datasets_class_names_are_its_label_names(monkeypatch):
    """A ClassLabel column's names become the examples' label names (they were the numbers)."""
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict(
        {"premise": ["a", "b"], "label": [2, 0]},
        features=datasets.Features(
            {"premise": datasets.Value("string"), "label": datasets.ClassLabel(names=list(MNLI.values()))}
        ),
    )
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: data)
    spec = DatasetSpec("nli", "hf", {"path": "x", "split": "train", "text_field": "premise", "label_field": "label"})
    exs, _ = load_examples(spec)
    assert [(e.label, e.label_name) for e in exs] == [(2, "contradiction"), (0, "entailment")]


def test_the_runner_refuses_before_computing_anything(tokenizer, tmp_path):
    """A file with string labels (numbered in sorted order) against a classifier in MNLI's order: the
    run stops with both orders named, and no unit, error or computation is recorded."""
    m = tiny_variant("bert", tokenizer, num_labels=3, id2label=MNLI, label2id={v: k for k, v in MNLI.items()})
    m.hf.config.architectures = [type(m.hf).__name__]
    m.hf.to(torch.float32).save_pretrained(tmp_path / "nli", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "nli")
    assert ctxmix.load_model(str(tmp_path / "nli"), device="cpu").config.id2label[0] == "entailment"
    rows = [("the cat sat", "entailment"), ("a dog ran", "contradiction"), ("it rained", "neutral")]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t, "label": lab}) + "\n" for t, lab in rows))
    cfg = {
        "name": "labels",
        "models": [str(tmp_path / "nli")],
        "datasets": [{"id": "d", "source": "file", "path": str(tmp_path / "d.jsonl")}],
        "methods": ["attention"],
        "metrics": ["accuracy_mask"],
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    db = tmp_path / "r.sqlite"
    with pytest.raises(BadInput, match=r"\[0 contradiction, 1 entailment, 2 neutral\].*\[0 entailment, 1 neutral"):
        runner.run_bench(tmp_path / "c.yaml", db=db, quiet=True)
    with sqlite3.connect(str(db)) as c:
        for table in ("units", "errors", "computations"):
            assert c.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] == 0, table
