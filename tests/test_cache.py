"""The results cache: bounded in memory (bytes) and on disk (least recently used first), and
every entry verified by the checksum its metadata records."""

import time

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import tiny_model

from ctxmix.service import cache


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXMIX_RESULTS", str(tmp_path))
    cache.mem_clear()
    yield tmp_path
    cache.mem_clear()


def _frame(n: int) -> pd.DataFrame:
    return pd.DataFrame({"layer": np.arange(n), "change": np.linspace(0, 1, n)})


def test_a_truncated_or_edited_table_is_recomputed(results):
    calls = []

    def compute():
        calls.append(1)
        return _frame(50)

    a = cache.cached_frame("change", ("k",), compute)
    (csv,) = (results / "change").glob("*.csv")
    text = csv.read_text()
    csv.write_text(text[: len(text) // 2])  # half a file, still parseable
    cache.mem_clear()
    b = cache.cached_frame("change", ("k",), compute)
    assert len(calls) == 2 and len(b) == 50
    pd.testing.assert_frame_equal(a, b)
    cache.mem_clear()
    cache.cached_frame("change", ("k",), compute)  # verified: served from disk
    assert len(calls) == 2


def test_an_npz_that_does_not_match_its_checksum_is_recomputed(results, tokenizer):
    m = tiny_model("bert", tokenizer)
    a = cache.cached_explain(m, "the keys are here", ["alti"])
    (npz,) = (results / "explain").glob("*.npz")
    with np.load(npz) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["layer"] = arrays["layer"] * 0 + 0.5  # a valid file with other numbers
    with open(npz, "wb") as fh:
        np.savez_compressed(fh, **arrays)
    cache.mem_clear()
    b = cache.cached_explain(m, "the keys are here", ["alti"])
    np.testing.assert_array_equal(a.layer_maps["alti"], b.layer_maps["alti"])


def test_the_folder_is_trimmed_least_recently_used_first(results, monkeypatch):
    for i in range(6):
        cache.cached_frame("change", (i,), lambda: _frame(2000))
        time.sleep(0.02)
    sizes = sum(f.stat().st_size for f in results.glob("*/*"))
    one = sizes / 6
    # reading entry 0 makes it recent; then a budget of about three entries keeps 0 and the newest
    cache.mem_clear()
    cache.cached_frame("change", (0,), lambda: pytest.fail("entry 0 should come from disk"))
    monkeypatch.setenv("CTXMIX_CACHE_MAX_MB", str(3.5 * one / 2**20))
    cache.cached_frame("change", (6,), lambda: _frame(2000))
    left = sum(f.stat().st_size for f in results.glob("*/*"))
    assert left <= 3.5 * one
    kept = {f.stem for f in (results / "change").glob("*.csv")}
    assert cache.key("change", 0) in kept and cache.key("change", 6) in kept
    assert cache.key("change", 1) not in kept
    assert all((results / "change" / f"{k}.json").exists() for k in kept)  # entries go whole


def test_memory_is_bounded_in_bytes(results, monkeypatch):
    monkeypatch.setenv("CTXMIX_MEMCACHE_MB", "0.5")
    for i in range(20):
        cache.cached_frame("change", (i,), lambda: _frame(5000), disk=False)  # ~80 kB each
    assert 0 < cache._MEM_BYTES <= 0.5 * 2**20
    assert len(cache._MEM) < 20


def test_changed_weights_in_a_local_folder_are_not_served_old_maps(results, tokenizer, tmp_path):
    """The fingerprint hashes the weights: edit a folder's weights and the cache recomputes."""
    from safetensors.torch import load_file, save_file

    import ctxmix

    m = tiny_model("bert", tokenizer, dtype=torch.float32)
    d = tmp_path / "m"
    m.hf.save_pretrained(d, safe_serialization=True)
    tokenizer.save_pretrained(d)
    m1 = ctxmix.load_model(str(d), device="cpu")
    a = cache.cached_explain(m1, "the keys are here", ["norm"])
    sd = load_file(d / "model.safetensors")
    sd["bert.encoder.layer.0.attention.self.value.weight"] *= 3
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    m2 = ctxmix.load_model(str(d), device="cpu")
    # a model keeps the fingerprint of the weights it was loaded with, even after the files change
    assert cache.model_fingerprint(m2) != cache.model_fingerprint(m1)
    b = cache.cached_explain(m2, "the keys are here", ["norm"])
    assert not np.allclose(a.layer_maps["norm"], b.layer_maps["norm"])  # recomputed with the new weights
    assert b.layer_maps["norm"].shape == a.layer_maps["norm"].shape


def test_in_memory_models_are_fingerprinted_by_their_tensors(tokenizer):
    from ctxmix.engine.fingerprint import weights_sha256

    a, b = tiny_model("bert", tokenizer), tiny_model("bert", tokenizer)
    assert weights_sha256(a) == weights_sha256(b)  # same seed, same weights
    c = tiny_model("bert", tokenizer)
    with torch.no_grad():
        c.hf.classifier.weight[0, 0] += 1.0
    assert weights_sha256(c) != weights_sha256(a)


def _counting(monkeypatch):
    """Count the methods `cached_explain` computes (calls of explain, by method)."""
    computed: list[str] = []
    real = cache.explain

    def counted(model, text, methods, **kw):
        computed.extend(methods)
        return real(model, text, methods, **kw)

    monkeypatch.setattr(cache, "explain", counted)
    return computed


def test_a_new_version_or_code_misses_the_cache(results, tokenizer, monkeypatch):
    """The key holds ctxmix's version and the fingerprint of its computing code: after an upgrade, or
    an edit of the engine or methods, the old numbers are not served (the old key had neither)."""
    import ctxmix

    m = tiny_model("bert", tokenizer)
    computed = _counting(monkeypatch)
    cache.cached_explain(m, "the keys are here", ["alti"])
    cache.mem_clear()
    cache.cached_explain(m, "the keys are here", ["alti"])  # from disk
    assert computed == ["alti"]
    monkeypatch.setattr(ctxmix, "__version__", ctxmix.__version__ + ".post1")
    cache.cached_explain(m, "the keys are here", ["alti"])
    assert computed == ["alti"] * 2
    monkeypatch.setattr(cache, "code_fingerprint", lambda: "0" * 16)
    cache.cached_explain(m, "the keys are here", ["alti"])
    assert computed == ["alti"] * 3


def test_the_code_fingerprint_reads_every_engine_and_methods_module(tmp_path, monkeypatch):
    """An edit of any module of ctxmix.engine or ctxmix.methods changes the fingerprint (here on a copy)."""
    import shutil
    from pathlib import Path

    src = Path(cache.__file__).resolve().parents[1]
    for pkg in ("engine", "methods", "service"):
        shutil.copytree(src / pkg, tmp_path / "ctxmix" / pkg)
    monkeypatch.setattr(cache, "__file__", str(tmp_path / "ctxmix" / "service" / "cache.py"))
    fp = cache.code_fingerprint.__wrapped__
    before = fp()
    assert before == cache.code_fingerprint()  # the copy is the same code
    with open(tmp_path / "ctxmix" / "methods" / "flow.py", "a") as fh:
        fh.write("\n# an edit\n")
    assert fp() != before


def test_every_method_keeps_its_warnings(results, tokenizer):
    """A soft-capping model's logit note stays when a mixing method of the same text was cached first
    (the old cache kept the first method's warnings only); the result carries what explain gives."""
    import ctxmix

    m = tiny_model("gemma2", tokenizer)
    text = "the keys are here"
    cache.cached_explain(m, text, ["alti"])
    ex = cache.cached_explain(m, text, ["alti", "logit"])
    ref = ctxmix.explain(m, text, ["alti", "logit"])
    assert any("soft-caps" in w for w in ref.warnings)
    assert set(ex.warnings) == set(ref.warnings)
    cache.mem_clear()
    assert set(cache.cached_explain(m, text, ["alti", "logit"]).warnings) == set(ref.warnings)  # from disk


def _options():
    from test_batched import NO_BATCH_PATH, _explain_options

    return [o for o in _explain_options() if o not in NO_BATCH_PATH]


@pytest.mark.parametrize("option", _options())
def test_every_option_is_saved(results, tokenizer, option):
    """Each option of explain (introspected, as in test_batched) round-trips: what explain records
    (decompx, embedding and flow_rows were dropped) is in the cached explanation, computed, from memory
    and from disk, also when another method of the same text and options was cached first."""
    from test_batched import _option_cases

    import ctxmix

    family, methods, kw, _, _ = _option_cases()[option]
    m = tiny_model(family, tokenizer)
    text = None if "input_ids" in kw else "the keys are here ."
    ref = ctxmix.explain(m, text, methods, **kw).options
    cache.cached_explain(m, text, ["attention"], **{k: v for k, v in kw.items() if k != "decompx"})
    for ex in (
        cache.cached_explain(m, text, ["attention", *methods], **kw),
        cache.cached_explain(m, text, ["attention", *methods], **kw),  # memory
        (cache.mem_clear(), cache.cached_explain(m, text, ["attention", *methods], **kw))[1],  # disk
    ):
        for k, v in ref.items():
            assert ex.options.get(k) == v, f"{option}: {k} = {ex.options.get(k)!r}, explain recorded {v!r}"
        # and what the call gave, where explain records nothing of it (target, position, input_ids...)
        assert all(ex.options.get(k) == v for k, v in kw.items() if k not in ref), option


def test_a_method_reads_back_its_own_warnings_and_options_only(results, tokenizer):
    """Computed together with attention flow on a causal model, ALTI's entry keeps neither flow's
    caveat nor its flow_rows; read alone later it equals explain's ALTI alone (review of the first
    per-method cache, which stored the whole call's warnings under every method)."""
    import ctxmix

    m = tiny_model("gpt2", tokenizer)
    text = "the keys are here"
    both = cache.cached_explain(m, text, ["alti", "attention_flow"])
    assert any("causal" in w for w in both.warnings)
    alone = cache.cached_explain(m, text, ["alti"])
    ref = ctxmix.explain(m, text, ["alti"])
    assert alone.warnings == ref.warnings
    assert "flow_rows" not in alone.options and alone.options == {**ref.options}
    cache.mem_clear()
    assert cache.cached_explain(m, text, ["alti"]).warnings == ref.warnings  # from disk


def test_the_call_notes_follow_the_call_not_the_cache(results, tokenizer):
    """The notes of a call's options (per_head on methods without a per-head form, a foil no method
    reads) are made for the call that reads the cache, not kept from the call that filled it."""
    import ctxmix

    m = tiny_model("gpt2", tokenizer)
    text = "the keys are here"
    cache.cached_explain(m, text, ["alti"], per_head=True)  # "per_head: none of alti has a per-head form"
    ex = cache.cached_explain(m, text, ["alti", "attention"], per_head=True)
    assert ex.warnings == ctxmix.explain(m, text, ["alti", "attention"], per_head=True).warnings
    assert not any("per_head" in w for w in ex.warnings)


def test_the_reconstruction_error_is_the_largest_of_the_entries(results, tokenizer):
    """A gradient method rebuilds no layer (its trace says 0); read with ALTI, whose layers were
    rebuilt, the explanation reports ALTI's error, not the first entry's 0."""
    import ctxmix

    m = tiny_model("bert", tokenizer, dtype=torch.float32)
    text = "the keys are here"
    cache.cached_explain(m, text, ["grad"])
    ex = cache.cached_explain(m, text, ["grad", "alti"])
    ref = ctxmix.explain(m, text, ["alti"]).reconstruction_error
    assert ref > 0 and ex.reconstruction_error == ref


def test_an_image_or_a_clip_is_keyed_by_what_the_model_reads(results, monkeypatch, tmp_path):
    """cached_explain on an image (a file, then the same pixels as an array) or a clip: one entry each, the second
    call served from disk with the same maps, the saved record and the gradient options; another photo misses."""
    from PIL import Image
    from test_speech import clip, speech_model
    from test_vision import photo, vision_model

    computed = _counting(monkeypatch)
    vit = vision_model("vit-classifier")
    Image.fromarray(photo()).save(tmp_path / "p.png")
    a = cache.cached_explain(vit, None, ["alti", "grad"], image=tmp_path / "p.png")
    cache.mem_clear()
    b = cache.cached_explain(vit, None, ["alti", "grad"], image=photo())
    assert computed == ["alti", "grad"]
    direct = __import__("ctxmix").explain(vit, None, ["alti", "grad"], image=photo())
    for ex in (a, b):
        np.testing.assert_array_equal(ex.layer_maps["alti"], direct.layer_maps["alti"])
        np.testing.assert_array_equal(ex.saliency["grad"], direct.saliency["grad"])
        assert ex.options == direct.options and ex.target == direct.target and ex.tokens == direct.tokens
    cache.cached_explain(vit, None, ["alti"], image=photo(seed=1))
    assert computed == ["alti", "grad", "alti"]
    # a gradient option with only a mixing method left to compute: the option is the cached method's, not refused
    cache.cached_explain(vit, None, ["grad"], image=photo(seed=2), target=1, ig_steps=8)
    both = cache.cached_explain(vit, None, ["alti", "grad"], image=photo(seed=2), target=1, ig_steps=8)
    assert computed[-2:] == ["grad", "alti"] and both.target == 1
    w2v = speech_model("wav2vec2")
    c = cache.cached_explain(w2v, None, ["norm"], audio=clip(), sampling_rate=16000)
    cache.mem_clear()
    d = cache.cached_explain(w2v, None, ["norm"], audio=clip(), sampling_rate=16000)
    assert computed[-1:] == ["norm"] and len(computed) == 6
    assert c.options == d.options and "sampling_rate" not in d.options and d.options["audio"]["frames"] == len(d.tokens)
    np.testing.assert_array_equal(c.global_maps["norm"], d.global_maps["norm"])
