"""`ctxmix cite` (ctxmix/export/context/cite.py): the command end to end on a tiny random Llama (in process, the model
loader replaced so loads can be counted), every --out format reopened to the scores `attribute_context`
gives directly, every bad input answered with its message and exit code 2 before any model load (or, for
what needs the model, before any pass); and, slow, on smollm2 with a shipped Lee news text and a needle."""

import copy
import html.parser
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import tiny_model

import ctxmix
from ctxmix.cli import main
from ctxmix.engine import models as engine_models
from ctxmix.export.context.load import load_context_attribution as load_context_attribution_json

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["The cat sat on the mat. The code is 4817.", "Birds fly south in winter. Rain fell all day."]
QUERY = "What is the code?"
RESPONSE = "the code is 4817"
CHAT = (
    "{% for m in messages %}[CLS] {{ m['role'] }} : {{ m['content'] }} [SEP]{% endfor %}"
    "{% if add_generation_prompt %} assistant :{% endif %}"
)


@pytest.fixture(scope="module")
def llama(tokenizer):
    t = copy.deepcopy(tokenizer)
    t.chat_template = CHAT
    return tiny_model("llama", t)


class Calls:
    """How often the command loaded a model, and how many forward passes reached its embeddings."""

    def __init__(self):
        self.loads = 0
        self.passes = 0


@pytest.fixture
def served(monkeypatch, llama):
    """`ctxmix cite` gets `model` (default: the tiny Llama) from the loader; returns the call counts."""
    calls = Calls()
    state = {"model": llama}

    def load_model(name, **kw):
        calls.loads += 1
        return state["model"]

    def count(*_):
        calls.passes += 1

    monkeypatch.setattr(engine_models, "load_model", load_model)
    hooks = []

    def use(model):
        state["model"] = model
        hooks.append(model.hf.get_input_embeddings().register_forward_pre_hook(count))

    use(llama)
    calls.use = use
    yield calls
    for h in hooks:
        h.remove()


def _files(tmp_path, texts=DOCS):
    out = []
    for i, t in enumerate(texts):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(t, encoding="utf-8")
        out.append(str(p))
    return out


def _cite(*args):
    return main(["cite", "--device", "cpu", *args])


def _direct(llama, **kw):
    kw = {"methods": ["logit", "contextcite"], "n_ablations": 4, "response": RESPONSE, "progress": False, **kw}
    return ctxmix.attribute_context(llama, DOCS, QUERY, **kw)


class _Scores(html.parser.HTMLParser):
    """data-score of every shaded source, per method block, from the written HTML."""

    def __init__(self):
        super().__init__()
        self.method, self.scores = None, {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-method" in a:
            self.method = a["data-method"]
        if "data-score" in a:
            self.scores.setdefault(self.method, []).append(float(a["data-score"]))


def test_every_out_format_reopens_to_the_direct_scores(tmp_path, served, llama, capsys):
    """Two files are two documents; the printed table and each --out format carry attribute_context's scores."""
    files = _files(tmp_path)
    ref = _direct(llama)
    base = ["--context", *files, "--query", QUERY, "--response", RESPONSE, "--method", "logit", "contextcite"]
    for ext in (".json", ".npz", ".csv", ".html"):
        out = tmp_path / f"ca{ext}"
        assert _cite(*base, "--n-ablations", "4", "--top", "2", "--out", str(out)) == 0
        printed = capsys.readouterr().out
        assert f"response (given, {len(ref.response_ids)} tokens): {RESPONSE}" in printed
        assert f"wrote {out}" in printed
        for m in ref.methods:  # each method's block: its two best sources, best first, by index
            block = printed.split(f"\n{m}  (")[1].splitlines()[1:3]
            assert [int(r.split("#")[1].split()[0]) for r in block] == [i for i, _, _ in ref.top(m, 2)]
        if ext == ".json":
            got = load_context_attribution_json(out)
        elif ext == ".npz":
            got = ctxmix.load_context_attribution(out)
        if ext in (".json", ".npz"):  # the whole result: scores bit for bit, and what a span refit needs
            assert got.sources == ref.sources and got.response == ref.response
            for m in ref.methods:
                np.testing.assert_array_equal(got.scores[m], ref.scores[m])
            np.testing.assert_array_equal(got.per_token["logit"], ref.per_token["logit"])
            np.testing.assert_array_equal(got.ablations["contextcite"]["masks"], ref.ablations["contextcite"]["masks"])
            np.testing.assert_array_equal(got.scores_for("contextcite", (4, 8)), ref.scores_for("contextcite", (4, 8)))
        elif ext == ".csv":  # pandas writes floats by repr, and reads them back exactly (its default since 3.0)
            df = pd.read_csv(out)
            assert list(df.columns) == ["source", "start", "end", "text", *ref.methods]
            assert df["text"].tolist() == ref.sources
            for m in ref.methods:
                np.testing.assert_array_equal(df[m].to_numpy(), ref.scores[m])
        else:
            p = _Scores()
            p.feed(out.read_text(encoding="utf-8"))
            assert set(p.scores) == set(ref.methods)
            for m in ref.methods:
                np.testing.assert_array_equal(p.scores[m], ref.scores[m])
    assert served.loads == 4


def test_span_and_evaluate(tmp_path, served, llama, capsys):
    """--span scores a part of the response (the CSV holds the span's scores); --evaluate prints topk_drop
    and LDS per method and no recall columns (no gold source on the command line)."""
    files = _files(tmp_path)
    ref = _direct(llama)
    out = tmp_path / "span.csv"
    args = ["--context", *files, "--query", QUERY, "--response", RESPONSE, "--method", "logit", "contextcite"]
    code = _cite(
        *args, "--n-ablations", "4", "--span", "4", "8", "--evaluate", "--eval-ablations", "6", "--out", str(out)
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "for characters 4..8: 'code'" in printed
    df = pd.read_csv(out)
    for m in ref.methods:
        np.testing.assert_array_equal(df[m].to_numpy(), ref.scores_for(m, (4, 8)))
        assert not np.array_equal(ref.scores_for(m, (4, 8)), ref.scores[m])  # the span is not the whole
    table = printed.split("evaluation (6 held-out ablations")[1]
    header = table.splitlines()[1].split()
    assert header == ["method", "topk_drop@1", "topk_drop@3", "topk_drop@5", "lds"]
    assert [r.split()[0] for r in table.splitlines()[2:4]] == ref.methods


def test_a_generated_response(tmp_path, served, capsys):
    files = _files(tmp_path)
    assert _cite("--context", *files, "--query", QUERY, "--method", "logit", "--max-new-tokens", "3") == 0
    assert "response (generated, " in capsys.readouterr().out and served.loads == 1


def test_every_option_of_attribute_context_has_a_flag(tmp_path, served, llama, capsys):
    """The options the page and the library use reach attribute_context: a chat template file, the target,
    the seed, keep-prob, alpha, the ablation batch, at2_exact with its features and weights (any model:
    'untrained'); the scores equal a direct call with the same options, and --help lists at2_exact."""
    files = _files(tmp_path)
    (tmp_path / "chat.jinja").write_text(CHAT.replace("[CLS]", "[CLS] turn"), encoding="utf-8")
    kw = dict(
        methods=["logit", "contextcite", "at2_exact"],
        chat_template=CHAT.replace("[CLS]", "[CLS] turn"),
        target_kind="logit",
        seed=3,
        seeds="official",
        keep_prob=0.6,
        alpha=0.02,
        batch_size=2,
        at2_features="attention",
        at2_weights="untrained",
    )
    ref = _direct(llama, **kw)
    out = tmp_path / "ca.npz"
    args = ["--context", *files, "--query", QUERY, "--response", RESPONSE, "--n-ablations", "4"]
    args += ["--method", "logit", "contextcite", "at2_exact", "--chat-template", str(tmp_path / "chat.jinja")]
    args += ["--target-kind", "logit", "--seed", "3", "--seeds", "official", "--keep-prob", "0.6", "--alpha", "0.02"]
    args += ["--batch-size", "2", "--at2-features", "attention", "--at2-weights", "untrained", "--out", str(out)]
    assert _cite(*args) == 0
    got = ctxmix.load_context_attribution(out)
    assert got.prompt_ids == ref.prompt_ids and got.options["seed"] == 3 and got.options["target"] == "logit"
    assert got.options["seeds"] == "official" and got.options["mask_seed"] == 3
    for m in ref.methods:
        np.testing.assert_array_equal(got.scores[m], ref.scores[m])
    with pytest.raises(SystemExit):
        main(["cite", "--help"])
    assert "at2_exact" in capsys.readouterr().out


def test_messages_and_batch(tmp_path, served, llama, capsys):
    """--messages FILE.json attributes a conversation; --batch FILE.jsonl runs attribute_contexts into one CSV
    table, resumable through --store (a second run makes no pass)."""
    messages = [
        {"role": "system", "content": "Be brief. Use the notes."},
        {"role": "user", "content": DOCS[0] + " " + DOCS[1]},
        {"role": "user", "content": QUERY, "attribute": False},
    ]
    (tmp_path / "m.json").write_text(json.dumps(messages), encoding="utf-8")
    out = tmp_path / "m.npz"
    assert (
        _cite("--messages", str(tmp_path / "m.json"), "--response", RESPONSE, "--method", "logit", "--out", str(out))
        == 0
    )
    ref = ctxmix.attribute_context(llama, messages=messages, response=RESPONSE, methods=["logit"], progress=False)
    got = ctxmix.load_context_attribution(out)
    assert got.messages == messages and got.source_messages == ref.source_messages
    np.testing.assert_array_equal(got.scores["logit"], ref.scores["logit"])
    batch = tmp_path / "b.jsonl"
    rows = [{"context": DOCS[0], "query": QUERY, "response": RESPONSE}, {"messages": messages, "response": RESPONSE}]
    batch.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    table_path, store = tmp_path / "t.csv", tmp_path / "store.jsonl"
    base = ["--batch", str(batch), "--method", "logit", "--store", str(store), "--out", str(table_path)]
    assert _cite(*base) == 0
    table = pd.read_csv(table_path)
    assert sorted(table["example"].unique()) == [0, 1]
    mine = table[table["example"] == 1]["score"].to_numpy()
    np.testing.assert_array_equal(mine, ref.scores["logit"])
    passes = served.passes
    assert _cite(*base) == 0 and served.passes == passes  # both examples read from the store
    capsys.readouterr()
    assert _cite("--batch", str(batch), "--out", str(tmp_path / "t.json")) == 2
    assert "--out FILE.csv" in capsys.readouterr().err


LONG = " ".join(f"Sentence number {i} is here." for i in range(40))  # over the tiny Llama's 128 positions


@pytest.mark.parametrize(
    "case, args, message, loads",
    [
        ("missing", ["--context", "{tmp}/nope.txt"], r"--context: no such file: .*nope\.txt", 0),
        ("folder", ["--context", "{tmp}"], r"is a folder; give text files", 0),
        ("empty", ["--context", "{empty}"], r"empty\.txt is empty: nothing to attribute", 0),
        ("binary", ["--context", "{binary}"], r"looks binary \(it holds NUL bytes\)", 0),
        ("latin1", ["--context", "{latin1}"], r"is not UTF-8 text \(byte 0xe9 at offset 3\)", 0),
        (
            "unknown method",
            ["--method", "logit", "magic"],
            r"unknown context-attribution method\(s\) 'magic'; valid: logit",
            0,
        ),
        (
            "token-level",
            ["--method", "alti", "value_zeroing"],
            r"alti, value_zeroing: a token-level method .*ctxmix explain",
            0,
        ),
        ("extension", ["--out", "{tmp}/x.pdf"], r"unknown extension '\.pdf'; valid: \.json, \.npz, \.html, \.csv", 0),
        ("ablations low", ["--n-ablations", "1"], r"n_ablations must be a whole number from 2 to 1024, got 1", 0),
        ("ablations cap", ["--n-ablations", "5000"], r"n_ablations must be a whole number from 2 to 1024, got 5000", 0),
        ("eval ablations", ["--evaluate", "--eval-ablations", "1"], r"n_ablations must be a whole number from 2 to", 0),
        ("new tokens", ["--max-new-tokens", "0"], r"max_new_tokens must be a whole number from 1 to 512", 0),
        ("top", ["--top", "0"], r"--top must be a positive whole number", 0),
        ("span", ["--response", RESPONSE, "--span", "3", "40"], r"span \(3, 40\) is outside the response's 16 char", 0),
        ("empty query", ["--query", "  "], r"--query is empty", 0),
        ("window", ["--context", "{long}"], r"over tiny-llama's window of 128 positions: shorten the context", 1),
        ("encoder", ["--model", "bert"], r"encoder-only and encoder-decoder models are not supported", 1),
        (
            "one source",
            ["--context", "{one}", "--sources", "document"],
            r"one document source only: there is nothing to compare it with",
            0,
        ),
    ],
)
def test_bad_input_is_a_message_before_any_model_work(tmp_path, served, tokenizer, capsys, case, args, message, loads):
    """Exit code 2, one line `error: ...` naming the problem; no model loaded for what the files and options
    alone show, and no forward pass where the model is needed to tell (its window, its kind)."""
    import re

    (tmp_path / "empty.txt").write_text(" \n\n ")
    (tmp_path / "binary.txt").write_bytes(b"PK\x03\x04\x00\x00abc")
    (tmp_path / "latin1.txt").write_bytes("Caf\u00e9 au lait. Good.".encode("latin-1"))
    (tmp_path / "long.txt").write_text(LONG)
    (tmp_path / "one.txt").write_text(DOCS[0])
    paths = {k: str(tmp_path / f"{k}.txt") for k in ("empty", "binary", "latin1", "long", "one")}
    args = [a.format(tmp=tmp_path, **paths) for a in args]
    if "--context" not in args:
        args = ["--context", *_files(tmp_path), *args]
    if "--model" in args:
        served.use(tiny_model("bert", tokenizer))
    code = _cite(*args, "--query", QUERY) if case != "empty query" else _cite(*args)
    err = capsys.readouterr().err
    assert code == 2
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and re.search(message, lines[0]), err
    assert served.loads == loads and served.passes == 0


def test_bad_input_from_the_shell_is_one_line_and_exit_code_2(tmp_path):
    """The real command: the message on stderr, no traceback (argparse's own errors also exit with 2)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "ctxmix", "cite", "--context", str(tmp_path / "missing.txt")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "error: --context: no such file" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------- smollm2, a shipped text


@pytest.mark.slow
def test_smollm2_finds_the_needle(tmp_path):
    """A 88-word Lee news text (gensim's, shipped) with the staff-entrance needle as its 4th of 6 sentences
    (`needle_examples(1, 60, 100, seed=2)`), the response stored (so greedy decoding cannot vary between
    CPUs): the needle is the top source for logit and alti_logit, and the JSON reloads to the printed order.
    About 21 s on 2 shared cores (the model load and one traced pass per method)."""
    from ctxmix.benchmark.context.data import NEEDLES, needle_examples

    e = needle_examples(1, 60, 100, seed=2)[0]
    assert e.gold == [3] and NEEDLES[0].question == e.query
    (tmp_path / "news.txt").write_text(e.context, encoding="utf-8")
    out = tmp_path / "ca.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "ctxmix", "cite", "--context", str(tmp_path / "news.txt"), "--query", e.query]
        + ["--response", "The code for the staff entrance is 4817.", "--method", "logit", "alti_logit"]
        + ["--model", "smollm2", "--device", "cpu", "--top", "3", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    ca = load_context_attribution_json(out)
    assert ca.sources[3] == NEEDLES[0].fact
    for m in ("logit", "alti_logit"):
        assert int(np.argmax(ca.scores[m])) == 3, (m, ca.scores[m])
        first = r.stdout.split(f"\n{m}  (")[1].splitlines()[1]
        assert "#3 " in first and NEEDLES[0].fact[:30] in first
    assert json.loads(out.read_text())["meta"]["model_name"] == "smollm2"


def test_a_foreign_or_damaged_json_is_refused(tmp_path):
    from ctxmix.errors import BadInput

    (tmp_path / "other.json").write_text(json.dumps({"format": "something else"}))
    (tmp_path / "cut.json").write_text('{"format": "ctxmix-context-attribution-json", "meta": {')
    with pytest.raises(BadInput, match="is not a ctxmix context attribution's JSON"):
        load_context_attribution_json(tmp_path / "other.json")
    with pytest.raises(BadInput, match="could not be read as a context attribution's JSON: JSONDecodeError"):
        load_context_attribution_json(tmp_path / "cut.json")


def test_the_reproduce_command_names_at2_exacts_kind_and_weights():
    """at2_exact's kind is always in the command (the default one is the weights', chosen on their validation
    table, and may change with them); the weights only where they are not the shipped default."""
    from types import SimpleNamespace

    from ctxmix.export.context.cite import reproduce_command

    opts = {"sources": "sentence", "max_new_tokens": 8, "at2": {"weights": "shipped:x.npz", "kind": "logit"}}
    ca = SimpleNamespace(options=opts, methods=["at2_exact"], query="Q?", response=" A.")
    cmd = reproduce_command(ca, "smollm2")
    assert "--at2-features logit" in cmd and "--at2-weights" not in cmd
    opts["at2"] = {"weights": "w.npz", "kind": "attn+norm+logit"}  # a file of before: written in today's names
    assert "--at2-features attention+norm+logit --at2-weights w.npz" in reproduce_command(ca, "smollm2")
