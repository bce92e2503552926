"""The embedded classifier minilm-sentiment: built from scratch, accurate, reloadable."""

import json
import os
import time

import pytest

from ctxmix.engine.sentiment import (
    ID2LABEL,
    META_FILE,
    TrainConfig,
    accuracy,
    build_minilm_sentiment,
    heldout_split,
    load_meta,
)


def test_heldout_split_is_stratified_and_seeded():
    train, test = heldout_split(seed=0)
    assert (len(train), len(test)) == (150, 50)
    assert sum(it.label for it in test) == 25
    assert not {it.text for it in train} & {it.text for it in test}
    assert heldout_split(seed=0) == (train, test)
    assert heldout_split(seed=1)[1] != test


def test_load_meta_missing_or_corrupt(tmp_path):
    assert load_meta(tmp_path) is None
    (tmp_path / META_FILE).write_text("{not json", encoding="utf-8")
    assert load_meta(tmp_path) is None
    (tmp_path / META_FILE).write_text(json.dumps({"a": 1}), encoding="utf-8")
    assert load_meta(tmp_path) == {"a": 1}
    assert load_meta(tmp_path / META_FILE) == {"a": 1}


@pytest.mark.slow
@pytest.mark.stored_numbers  # rerun with a fresh cache under other kernels: the fine-tune redone there
def test_built_minilm_sentiment_is_accurate_and_reloads():
    """The session's own build (load_model builds it once into the cache, as every user's first call
    does; the other tests reuse it), checked from its files: no second training run here."""
    import transformers as T

    import ctxmix

    ctxmix.load_model("minilm-sentiment", device="cpu")
    out = ctxmix.engine.models.cache_dir() / "minilm-sentiment"
    meta = load_meta(out)
    # Chance is 0.5; the frozen-encoder head reaches ~0.6, fine-tuning ~0.74 (seed 0: 0.76). The fine-tune is
    # redone on each machine and its weights move with the kernels (the scores by ~1e-5, see shipped.py);
    # seed 0 gave 0.76 under ATen's default, AVX2 and AVX-512 kernels; 0.7 leaves 3 sentences (0.02 each).
    assert meta["heldout_accuracy"] >= 0.7
    assert meta["train_accuracy"] >= meta["heldout_accuracy"]
    assert meta["split"]["train"] == 150 and meta["split"]["heldout"] == 50
    assert meta["method"] == "finetune" and meta["seed"] == 0
    model = T.BertForSequenceClassification.from_pretrained(out, attn_implementation="eager", use_safetensors=True)
    tok = T.AutoTokenizer.from_pretrained(out)
    assert model.config.id2label == ID2LABEL
    assert (out / "model.safetensors").exists()
    _, test = heldout_split(seed=0)
    assert accuracy(model, tok, test) == meta["heldout_accuracy"]


def test_a_build_is_atomic_and_clears_stale_partial_folders(tmp_path):
    """The build writes beside its target and renames at the end, and removes a partial folder left by
    a build killed over an hour ago, not a younger one (the cheap "head" method, one epoch: the same
    saving path as the fine-tuned build)."""
    out = tmp_path / "minilm-sentiment"
    stale = tmp_path / ".minilm-sentiment.partial-killed"  # a build killed while saving, 2 h ago
    stale.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    young = tmp_path / ".minilm-sentiment.partial-running"  # a concurrent build's: kept
    young.mkdir()
    meta = build_minilm_sentiment(out, progress=False, seed=0, method="head", config=TrainConfig(epochs=1))
    assert load_meta(out) == meta and meta["method"] == "head"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".minilm-sentiment.partial-running", "minilm-sentiment"]
