"""Hostile and mistaken inputs, across the API, the command line, configs and settings: every
case ends in a short message (BadInput / ModelLoadError, or exit code 2 with one `error:` line),
never a traceback, a hang or a silent wrong number. Fast: tiny models, the CLI in-process."""

import contextlib
import io
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
from conftest import tiny_model, tiny_variant

import ctxmix
from ctxmix.errors import BadInput, CtxmixError

ROOT = Path(__file__).resolve().parents[1]
IDS = [101, 1996, 6309, 2000, 1996, 5239, 2024, 2006, 1996, 2795, 1012, 102]
TEXTS = ["the keys to the cabinet are on the table .", "a small dog barked ."]


@pytest.fixture(scope="module")
def bert(tokenizer):
    return tiny_model("bert", tokenizer, dtype=torch.float32)


@pytest.fixture(scope="module")
def gpt2(tokenizer):
    return tiny_model("gpt2", tokenizer, dtype=torch.float32)


# ----------------------------------------------------------------------------- the Python API

EXPLAIN = {  # name -> (text, methods, keyword arguments, words the message must contain)
    "text not a string": (123, ["alti"], {}, "text must be a string"),
    "no text and no ids": (None, ["alti"], {}, "text must be a string"),
    "blank text": ("   ", ["alti"], {}, "empty"),
    "lone surrogate": ("a \ud800 b", ["alti"], {}, "not valid Unicode"),
    "no methods": ("a b", [], {}, "at least one method"),
    "unknown method": ("a b", ["nope"], {}, "unknown method"),
    "method with a space": ("a b", ["alti "], {}, "unknown method"),
    "position not a number": ("a b", ["alti"], {"position": "x"}, "position must be a whole number"),
    "position a bool": ("a b", ["alti"], {"position": True}, "position must be a whole number"),
    "position past the end": ("a b", ["alti"], {"position": 999}, "outside"),
    "position before the start": ("a b", ["alti"], {"position": -999}, "outside"),
    "res2 unknown": ("a b", ["alti"], {"res2": "x"}, "res2 must be"),
    "precision unknown": ("a b", ["alti"], {"precision": "fp8"}, "precision must be one of"),
    "unknown keyword": ("a b", ["alti"], {"foo": 1}, "unknown option 'foo'"),
    "ig_steps zero": ("a b", ["integrated_gradients"], {"ig_steps": 0}, "ig_steps"),
    "ig_steps fractional": ("a b", ["integrated_gradients"], {"ig_steps": 1.5}, "ig_steps"),
    "ig_steps huge": ("a b", ["integrated_gradients"], {"ig_steps": 10**7}, "ig_steps"),
    "ig baseline unknown": ("a b", ["integrated_gradients"], {"ig_baseline": "gaussian"}, "ig_baseline"),
    "ig baseline of images on text": ("a b", ["integrated_gradients"], {"ig_baseline": "blank"}, "ig_baseline 'blank'"),
    "blank-out replacement unknown": ("a b", ["blank_out"], {"blank_replacement": "pad"}, "blank_replacement"),
    "cat_mask_special a string": ("a b", ["cat"], {"cat_mask_special": "yes"}, "cat_mask_special"),
    "input_ids empty": (None, ["alti"], {"input_ids": []}, "empty"),
    "input_ids a string": (None, ["alti"], {"input_ids": "abc"}, "list of token ids"),
    "input_ids negative": (None, ["alti"], {"input_ids": [101, -1]}, "whole numbers from 0"),
    "input_ids past the vocabulary": (None, ["alti"], {"input_ids": [101, 10**9]}, "whole numbers from 0"),
    "input_ids fractional": (None, ["alti"], {"input_ids": [101, 1.5]}, "whole numbers from 0"),
    "input_ids too long": (None, ["alti"], {"input_ids": [101] * 600}, "at most"),
    "target class out of range": ("a b", ["grad"], {"target": 99}, "target"),
    "target label unknown": ("a b", ["grad"], {"target": "nolabel"}, "unknown label"),
    "pre-LN scope on a post-LN model": ("a b", ["AtbLn"], {}, "do not exist in a post-LN model"),
}


@pytest.mark.parametrize("case", list(EXPLAIN))
def test_explain_rejects(bert, case):
    text, methods, kw, words = EXPLAIN[case]
    with pytest.raises(BadInput, match=words):
        ctxmix.explain(bert, text, methods, **kw)


SCOPES = {
    "text not a string": (5, {}, "text must be a string"),
    "res2 unknown": ("a b", {"res2": "x"}, "res2 must be"),
    "precision unknown": ("a b", {"precision": "x"}, "precision must be one of"),
    "input_ids empty": (None, {"input_ids": []}, "empty"),
}


@pytest.mark.parametrize("case", list(SCOPES))
def test_scope_maps_rejects(bert, case):
    text, kw, words = SCOPES[case]
    with pytest.raises(BadInput, match=words):
        ctxmix.scope_maps(bert, text, **kw)


BATCH = {
    "one string": (lambda m: ctxmix.explain_batch(m, "a string", ["alti"]), "non-empty list"),
    "empty list": (lambda m: ctxmix.explain_batch(m, [], ["alti"]), "non-empty list"),
    "methods per text of the wrong length": (
        lambda m: ctxmix.explain_batch(m, TEXTS, ["alti"], methods_per_text=[["alti"]]),
        "one list per text",
    ),
    "targets of the wrong length": (
        lambda m: ctxmix.explain_batch(m, TEXTS, ["grad"], targets=[0]),
        "one entry per text",
    ),
    "a bad option": (lambda m: ctxmix.explain_batch(m, TEXTS, ["alti"], ig_steps=-1), "ig_steps"),
}


@pytest.mark.parametrize("case", list(BATCH))
def test_explain_batch_rejects(bert, case):
    call, words = BATCH[case]
    with pytest.raises(BadInput, match=words):
        call(bert)


CORPUS = {
    "one string": (lambda m: ctxmix.contextualization_change(m, "a string", progress=False), "not one string"),
    "empty corpus": (lambda m: ctxmix.contextualization_change(m, [], progress=False), "empty"),
    "only blank texts": (lambda m: ctxmix.contextualization_change(m, ["", "  "], progress=False), "every text"),
    "ignore_low_gamma above 1": (
        lambda m: ctxmix.contextualization_change(m, TEXTS, ignore_low_gamma=1.5, progress=False),
        "ignore_low_gamma",
    ),
    "ignore_low_gamma negative": (
        lambda m: ctxmix.contextualization_change(m, TEXTS, ignore_low_gamma=-0.1, progress=False),
        "ignore_low_gamma",
    ),
    "ignore_low_gamma a string": (
        lambda m: ctxmix.contextualization_change(m, TEXTS, ignore_low_gamma="x", progress=False),
        "ignore_low_gamma",
    ),
    "mask_rate negative": (
        lambda m: ctxmix.contextualization_change(m, TEXTS, mask_rate=-1, progress=False),
        "mask_rate",
    ),
    "mask_rate above 1": (
        lambda m: ctxmix.contextualization_change(m, TEXTS, mask_rate=2, progress=False),
        "mask_rate",
    ),
    "batch_size zero": (
        lambda m: ctxmix.contextualization_change(m, TEXTS, batch_size=0, progress=False),
        "batch_size",
    ),
    "precision unknown": (
        lambda m: ctxmix.contextualization_change(m, TEXTS, precision="x", progress=False),
        "precision",
    ),
    "res2 unknown": (lambda m: ctxmix.contextualization_change(m, TEXTS, res2="x", progress=False), "res2"),
    "top_k negative": (lambda m: ctxmix.ff_amp(m, TEXTS, top_k=-1, progress=False), "top_k"),
    "top_k zero": (lambda m: ctxmix.ff_amp(m, TEXTS, top_k=0, progress=False), "top_k"),
    "min_count zero": (lambda m: ctxmix.ff_amp(m, TEXTS, min_count=0, progress=False), "min_count"),
    "normalise unknown": (lambda m: ctxmix.ff_amp(m, TEXTS, normalise="x", progress=False), "normalise"),
    "outliers of one string": (lambda m: ctxmix.ff_outliers(m, "a string", progress=False), "not one string"),
    "norms with a bad mask rate": (
        lambda m: ctxmix.ff_residual_norms(m, TEXTS, mask_rate=7, progress=False),
        "mask_rate",
    ),
}


@pytest.mark.parametrize("case", list(CORPUS))
def test_corpus_analyses_reject(bert, case):
    call, words = CORPUS[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BadInput, match=words):
            call(bert)


@pytest.mark.parametrize(
    "call",
    [
        "contextualization_change",
        "ff_amp",
        "ff_outliers",
        "ff_residual_norms",
        "corpus_report",
        "scope_maps",
        "explain_batch",
        "load_model",
    ],
)
def test_unknown_keywords_are_the_same_message_everywhere(bert, call):
    """Every public function answers an unknown keyword with a BadInput naming what it takes."""
    fn = getattr(ctxmix, call)
    args = {"load_model": ("minilm",), "scope_maps": (bert, "a b"), "explain_batch": (bert, TEXTS, ["alti"])}.get(
        call, (bert, TEXTS)
    )
    words = "unknown option 'colour'" if call == "explain_batch" else f"{call}: .*unexpected keyword.*; it takes"
    with pytest.raises(BadInput, match=words):  # explain and explain_batch name their saliency options too
        fn(*args, colour="red")


def test_masking_a_causal_model(gpt2):
    with pytest.raises(BadInput, match="is causal"):
        ctxmix.contextualization_change(gpt2, TEXTS, mask_rate=0.12, progress=False)


LOAD = {
    "empty name": (dict(name_or_path=""), BadInput, "give a model name"),
    "name not a string": (dict(name_or_path=5), BadInput, "give a model name"),
    "dtype unknown": (dict(name_or_path="minilm", dtype="float8"), BadInput, "dtype must be one of"),
    "device unknown": (dict(name_or_path="minilm", device="tpu"), BadInput, "device must be"),
    "device malformed": (dict(name_or_path="minilm", device="cuda:x"), BadInput, "device must be"),
    "precision unknown": (dict(name_or_path="minilm", precision="x"), BadInput, "precision must be one of"),
    "missing folder": (dict(name_or_path="./no/such/folder"), CtxmixError, "no such folder"),
    "a folder that is no model": (dict(name_or_path=str(ROOT / "configs")), CtxmixError, "could not load"),
}


@pytest.mark.parametrize("case", list(LOAD))
def test_load_model_rejects(case):
    kw, exc, words = LOAD[case]
    with pytest.raises(exc, match=words):
        ctxmix.load_model(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_a_device():
    with pytest.raises(BadInput, match="no CUDA device"):
        ctxmix.load_model("minilm", device="cuda")


# ----------------------------------------------------------------------------- caps before any forward pass
# Each refusal below must come before the model runs: a forward pre-hook on every module counts the calls,
# and a control call beside each refusal shows that the counter sees the model when it does run.


@contextlib.contextmanager
def forward_calls(model=None):
    """The forward calls made inside the block: every module of `model.hf` (or of any model when None)."""
    mine = None if model is None else {id(m) for m in model.hf.modules()}
    calls: list[str] = []

    def hook(module, args):
        if mine is None or id(module) in mine:
            calls.append(type(module).__name__)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def lm(tokenizer):
    """A tiny random Llama with a window of 128 positions."""
    return tiny_model("llama", tokenizer, dtype=torch.float32)


@pytest.fixture(scope="module")
def long_lm(tokenizer):
    """A tiny random Llama whose window (512, the tokenizer's) holds inputs over routes' dense limit."""
    return tiny_variant("llama", tokenizer, name="tiny-llama-long", max_position_embeddings=1024)


def test_generate_over_the_window_is_refused_before_any_forward(lm):
    assert lm.max_length == 128
    prompt = [101] + [1996] * 119  # 120 tokens: 8 new ones fit the window
    for kw, words in [
        ({"max_new_tokens": 9}, "120 prompt tokens \\+ 9 new ones = 129 exceed tiny-llama's window of 128.*at most 8"),
        ({"max_new_tokens": 10**6}, "from 1 to 127 .*window of 128"),
        ({"max_new_tokens": 128}, "from 1 to 127 .*window of 128"),
    ]:
        with forward_calls(lm) as calls, pytest.raises(BadInput, match=words):
            ctxmix.generate(lm, input_ids=prompt, **kw)
        assert calls == [], kw
    with pytest.raises(BadInput, match="shorten the prompt"):
        ctxmix.generate(lm, input_ids=[101] * 128, max_new_tokens=1)
    with forward_calls(lm) as calls:
        assert len(ctxmix.generate(lm, input_ids=prompt, max_new_tokens=8).new_ids) == 8
    assert calls  # the control: the counter sees generation


def test_server_caps_for_one_request():
    """The hosted caps the pages apply before any model call: prompt + new tokens <= max_tokens."""
    from ctxmix.service.limits import HOSTED, LOCAL, check_generation, check_tokens, generation_room

    assert HOSTED.max_tokens == 128
    assert generation_room(120, HOSTED) == 8 and generation_room(128, HOSTED) == 0 and generation_room(440, HOSTED) == 0
    assert generation_room(3, HOSTED) == 64 and generation_room(3, HOSTED, most=10) == 10
    check_generation(120, 8, HOSTED)
    with pytest.raises(BadInput, match="120 prompt tokens \\+ 9 new ones = 129; the limit here is 128 .*at most 8"):
        check_generation(120, 9, HOSTED)
    with pytest.raises(BadInput, match="prompt has 440 tokens; the limit here is 128 .*continuation together"):
        check_generation(440, 1, HOSTED)
    check_tokens(128, HOSTED)
    with pytest.raises(BadInput, match="has 440 tokens; the limit here is 128 tokens per sequence \\(max_tokens"):
        check_tokens(440, HOSTED)
    check_tokens(440, LOCAL)


def test_dense_routes_are_refused_before_any_forward(long_lm, monkeypatch):
    import ctxmix.methods.routes as routes_mod

    ids = [101] + [1996] * 299  # 300 tokens, over DENSE_MAX_TOKENS
    assert routes_mod.DENSE_MAX_TOKENS == 256 and routes_mod.DENSE_THRESHOLD == 0.01
    rows = 2 * 4 * 300 * 301 // 2  # layers x heads x causal token pairs
    for tau in (0.0, 0.005):
        with forward_calls(long_lm) as calls, pytest.raises(BadInput, match=f"{rows:,} rows.*dense=True"):
            ctxmix.routes(long_lm, input_ids=ids, threshold=tau)
        assert calls == [], tau
    with pytest.raises(BadInput, match="dense must be True or False"):
        ctxmix.routes(long_lm, input_ids=ids, threshold=0.0, dense="yes")
    # the boundary, and dense=True passing the guard (the graph itself is not built here: too slow)
    routes_mod.check_dense(long_lm, 256, 0.0, False)
    routes_mod.check_dense(long_lm, 257, 0.01, False)
    routes_mod.check_dense(long_lm, 5000, 0.0, True)
    with pytest.raises(BadInput, match="on 257 tokens"):
        routes_mod.check_dense(long_lm, 257, 0.0099, False)
    monkeypatch.setattr(routes_mod, "routes_from_trace", lambda *a, **k: "built")
    with forward_calls(long_lm) as calls:
        assert ctxmix.routes(long_lm, input_ids=ids, threshold=0.0, dense=True) == "built"
    assert calls  # the control: with dense=True the model is traced


def test_cli_routes_dense_flag(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = " ".join(["word"] * 300)  # 302 tokens with [CLS] and [SEP] on minilm
    with forward_calls() as calls:
        code, err = _cli(["routes", text, "--threshold", "0"])
    assert code == 2 and "--dense" in err and f"{6 * 12 * 302 * 302:,} rows" in err, err
    assert calls == []
    seen = {}

    def fake(model, text, **kw):
        seen.update(kw)
        raise BadInput("stop here")

    monkeypatch.setattr(ctxmix, "routes", fake)
    code, err = _cli(["routes", text, "--threshold", "0", "--dense"])
    assert code == 2 and "stop here" in err and seen["dense"] is True and seen["threshold"] == 0.0


def test_explain_costs_are_refused_before_any_forward(bert, monkeypatch):
    """Attention flow's time limit, DecompX's memory budget and the model's window: refused before the
    trace (attention flow and DecompX were checked after it)."""
    ids = [101] + [1996] * 198 + [102]  # 200 tokens: every row of attention flow on 2 layers is over its limit
    with forward_calls(bert) as calls, pytest.raises(BadInput, match="attention flow on 200 tokens"):
        ctxmix.explain(bert, None, ["attention_flow"], input_ids=ids, flow_rows="all")
    assert calls == []
    with forward_calls(bert) as calls, pytest.raises(BadInput, match="at most 512"):
        ctxmix.explain(bert, None, ["alti"], input_ids=[101] * 600)
    assert calls == []
    import ctxmix.engine.budget as budget

    monkeypatch.setattr(budget, "memory_budget", lambda device: 1)  # no byte to spare
    with forward_calls(bert) as calls, pytest.raises(BadInput, match="(?s)decompx.*budget"):
        ctxmix.explain(bert, "a b", ["decompx"])
    assert calls == []
    monkeypatch.undo()
    with forward_calls(bert) as calls:
        ctxmix.explain(bert, None, ["attention_flow"], input_ids=ids[:20])
    assert calls  # the control


def test_corpus_caps_before_any_forward(bert):
    """The dashboard's corpus caps (corpus_report's max_total_tokens, max_tokens): a job over its token cap
    is refused before the first batch; a sequence over the per-sequence cap is cut, so no forward pass sees
    more tokens than the cap."""
    with forward_calls(bert) as calls, pytest.raises(BadInput, match="the cap here is 10"):
        ctxmix.corpus_report(bert, TEXTS, change=True, amp=True, max_total_tokens=10, progress=False)
    assert calls == []
    lengths: list[int] = []
    handle = bert.hf.register_forward_pre_hook(
        lambda mod, args, kwargs: lengths.append(
            (kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[-1]
        ),
        with_kwargs=True,
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the cut's warning
            ctxmix.corpus_report(bert, TEXTS, change=True, max_tokens=6, progress=False)
    finally:
        handle.remove()
    assert lengths and max(lengths) == 6, lengths


# ----------------------------------------------------------------------------- the command line


def _cli(argv) -> tuple[int, str]:
    from ctxmix.cli import main

    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: usage line + one error line
            code = e.code
    return code, err.getvalue()


def _bomb(tmp: Path) -> Path:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, 12):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 12) + "]")
    p = tmp / "bomb.yaml"
    p.write_text("\n".join(lines + ["name: bomb", "models: [minilm]", "datasets: [pang_lee]"]) + "\n")
    return p


CLI = {
    "explain an empty text": ["explain", "  "],
    "explain an unknown method": ["explain", "hi", "--method", "nope"],
    "explain a position that is no number": ["explain", "hi", "--position", "abc"],
    "explain with an unknown dtype": ["explain", "hi", "--dtype", "float8"],
    "explain with an unknown precision": ["explain", "hi", "--precision", "x"],
    "explain on an unknown device": ["explain", "hi", "--device", "tpu"],
    "explain a missing model folder": ["explain", "hi", "--model", "./no/such/folder"],
    "change with a negative limit": ["change", "--limit", "-3"],
    "change with a limit that is no number": ["change", "--limit", "abc"],
    "change with a mask rate of 5": ["change", "--mask-rate", "5", "--limit", "2"],
    "change ignoring twice every dimension": ["change", "--ignore-low-gamma", "2", "--limit", "2"],
    "change on a missing corpus file": ["change", "--corpus", "no_such_file.txt"],
    "change on a hub corpus offline": ["change", "--corpus", "hf:x:y:z", "--limit", "2"],
    "scopes written to a folder": ["scopes", "hi", "--out", "/"],
    "outliers written to a folder": ["outliers", "--limit", "2", "--out", "/tmp"],
    "ff-amp with a negative top-k": ["ff-amp", "--top-k", "-1", "--limit", "2"],
    "ff-amp with an unknown normalisation": ["ff-amp", "--normalise", "x"],
    "serve on port 0": ["serve", "--dry-run", "--port", "0"],
    "no verb": [],
    "an unknown verb": ["frobnicate"],
    "bench without a config": ["bench"],
    "bench a missing config": ["bench", "--config", "no_such.yaml", "--check"],
    "bench with a negative limit": ["bench", "--config", "configs/embedded.yaml", "--check", "--limit", "-3"],
    "bench with an unknown executor": ["bench", "--config", "configs/embedded.yaml", "--executor", "x"],
}


@pytest.mark.parametrize("case", list(CLI))
def test_cli_answers_with_a_message(case, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, err = _cli(CLI[case])
    assert code == 2, (case, code, err)
    assert "Traceback" not in err and "error" in err, (case, err)


@pytest.mark.parametrize("case", ["bomb", "folder db", "not a database", "binary config", "huge config"])
def test_cli_bench_files(case, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["bench", "--config", "configs/embedded.yaml", "--limit", "1"]
    if case == "bomb":
        argv = ["bench", "--config", str(_bomb(tmp_path)), "--check"]
        words = "aliases"
    elif case == "folder db":
        argv += ["--db", str(tmp_path)]
        words = "is a folder"
    elif case == "not a database":
        (tmp_path / "x.sqlite").write_text("hello")
        argv += ["--db", str(tmp_path / "x.sqlite")]
        words = "not a ctxmix results file"
    elif case == "binary config":
        (tmp_path / "c.yaml").write_bytes(b"\xff\xfe\x00garbage")
        argv = ["bench", "--config", str(tmp_path / "c.yaml"), "--check"]
        words = "UTF-8"
    else:
        (tmp_path / "c.yaml").write_text("name: x\n" + "# padding\n" * 200_000)
        argv = ["bench", "--config", str(tmp_path / "c.yaml"), "--check"]
        words = "at most"
    code, err = _cli(argv)
    assert code == 2 and words in err and "Traceback" not in err, err


# ----------------------------------------------------------------------------- configs and settings

BASE = {"name": "t", "models": ["minilm"], "datasets": ["pang_lee"], "methods": ["alti"], "metrics": []}
CONFIGS = {
    "not a mapping": (None, "must be a YAML mapping"),
    "a list": ([1, 2], "must be a YAML mapping"),
    "unknown key": ({**BASE, "colour": "red"}, "unknown config key"),
    "no models": ({**BASE, "models": []}, "model"),
    "no datasets": ({**BASE, "datasets": []}, "dataset"),
    "unknown method": ({**BASE, "methods": ["nope"]}, "nope"),
    "unknown metric": ({**BASE, "metrics": ["nope"]}, "nope"),
    "unknown dataset source": ({**BASE, "datasets": [{"id": "x", "source": "sst9"}]}, "sst9"),
    "unknown kind": ({**BASE, "kind": "x"}, "kind"),
    "unknown target": ({**BASE, "target": "x"}, "target"),
    "example_batch zero": ({**BASE, "example_batch": 0}, "example_batch"),
    "negative seed": ({**BASE, "seed": -1}, "seed"),
    "mask_rate 5": ({**BASE, "mask_rate": 5}, "mask_rate"),
    "threads zero": ({**BASE, "threads": 0}, "threads"),
    "negative batch_size": ({**BASE, "batch_size": -1}, "batch_size"),
    "ig_steps zero": ({**BASE, "explain": {"ig_steps": 0}}, "ig_steps"),
    "unknown explain option": ({**BASE, "explain": {"foo": 1}}, "foo"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_configs_are_validated_before_any_work(case):
    from ctxmix.benchmark.config import validate_config

    raw, words = CONFIGS[case]
    with pytest.raises(BadInput, match=words):
        validate_config(raw, check_models=False)


@pytest.mark.parametrize(
    "secrets, words",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_sequences": 2.5}, "max_sequences"),
        ({"max_upload_mb": "big"}, "max_upload_mb"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_server_caps_in_secrets_are_checked(secrets, words):
    from ctxmix.service.limits import load_limits

    with pytest.raises(BadInput, match=words):
        load_limits(True, secrets)


def test_the_suite_is_large_enough():
    n = len(EXPLAIN) + len(SCOPES) + len(BATCH) + len(CORPUS) + 8 + 1 + len(LOAD) + 1 + len(CLI) + 5 + len(CONFIGS) + 4
    assert n >= 100, n


def test_an_unknown_option_names_every_keyword_explain_takes(bert):
    """The message of an unknown option lists explain's real keywords (read off its signature), so
    following it never leads to another "unknown option"; it once named five of fifteen."""
    import inspect

    with pytest.raises(BadInput) as err:
        ctxmix.explain(bert, "a b", ["alti"], colour=1)
    msg = str(err.value)
    keywords = [p for p in inspect.signature(ctxmix.explain).parameters if p not in ("model", "text", "methods")]
    keywords.remove("saliency_options")
    missing = [k for k in keywords if k not in msg]
    assert not missing, f"the message leaves out {missing}: {msg}"
