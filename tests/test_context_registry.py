"""The context methods' registry: every record complete and resolvable, every consumer reading the records (no
method named outside its module, its record, its tests, docs and the benchmark), and a method added by one record
and one run function reaching the call, spans, extension, the memory estimate, the page's help and the command line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_model

import ctxmix
from ctxmix.errors import BadInput
from ctxmix.methods.context.job import ContextJob, check_names, memory_phases, resolve
from ctxmix.methods.memory import CONTEXT_PHASES
from ctxmix.methods.registry import CONTEXT_METHODS, COSTS, ContextMethod, context_methods, register_context_method

REPO = Path(__file__).resolve().parents[1]
CONTEXT = "The museum opened in 1902. The code for the staff entrance is 4817. The café closes at five."
QUERY = "What is the code?"
RESPONSE = " The code is 4817."
# the names that mean a context method only (logit, attention, alti_logit and grad_x_input are explain's too)
CONTEXT_ONLY = [m for m in CONTEXT_METHODS if m in ("key_mask_grad", "key_mask_ig", "at2_exact", "contextcite")] + [
    "leave_one_out"
]
# where a context method may be named: its module, the registry, the benchmark (its configs and scripts)
OWN = {
    "key_mask_grad": ["ctxmix/methods/context/keymask.py"],
    "key_mask_ig": ["ctxmix/methods/context/keymask.py"],
    "at2_exact": ["ctxmix/methods/context/at2.py"],
    "contextcite": ["ctxmix/methods/context/ablation.py"],
    "leave_one_out": ["ctxmix/methods/context/ablation.py"],
}


@pytest.fixture(scope="module")
def llama(tokenizer):
    return tiny_model("llama", tokenizer)


def test_every_record_is_complete_and_resolves():
    for name, r in CONTEXT_METHODS.items():
        assert r.name == name and r.title and r.paper and r.doc and r.reads and r.passes, name
        assert r.cost in COSTS and set(r.memory) <= set(CONTEXT_PHASES), name
        assert callable(resolve(r.run)), name
        if r.prepare:
            assert callable(resolve(r.prepare)), name
        if not r.per_token:  # an ablation method rescores a span from what it stored
            assert callable(resolve(r.span)) and r.cost == "ablation", name
        if r.whole_response:
            assert r.per_token, name
    assert context_methods("ablation") == ["contextcite", "leave_one_out"]
    assert set(context_methods()) == set(CONTEXT_METHODS)
    with pytest.raises(ValueError, match="cost"):
        ContextMethod("x", "X", "p", cost="cheap", reads="r", run="m:f")
    with pytest.raises(ValueError, match="span"):
        ContextMethod("x", "X", "p", cost="one_pass", reads="r", run="m:f", span="median")
    with pytest.raises(ValueError, match="registered already"):
        register_context_method(CONTEXT_METHODS["logit"])
    with pytest.raises(BadInput, match="valid: "):
        check_names(["logit", "nope"])


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """The string constants of a file's code (docstrings left out: they are documentation)."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def test_no_context_method_is_named_outside_its_module_and_record():
    """The page, the command line, the memory estimate, the exporters and the call read the records: a name in their
    code would be a list that a new method does not join. Fails on the code before the records (the page's ABLATION
    tuple, memory.py's ONE_PASS_ROWS, attribution.py's branches)."""
    files = [*REPO.glob("ctxmix/**/*.py"), *REPO.glob("pages/*.py"), REPO / "app.py"]
    found = []
    for f in files:
        rel = str(f.relative_to(REPO))
        if rel.startswith("ctxmix/benchmark/") or rel == "ctxmix/methods/registry.py":
            continue
        for line, text in _code_strings(f):
            for m in CONTEXT_ONLY:
                if (text == m or text.startswith(m + "/")) and rel not in OWN[m]:
                    found.append(f"{rel}:{line} {text!r}")
    assert not found, found


# ---------------------------------------------------------------- a method added by one record


def run_last_layer_attention(job: ContextJob, names: list[str]) -> dict:
    """The attention of the row predicting each response token in the top layer, heads averaged: (T, n) rows that
    sum to one (the registry's worked example, docs/extending.md)."""
    from ctxmix.engine.rows import trace_rows

    T = len(job.ids) - job.P
    rows = list(range(job.P - 1, job.P - 1 + T))
    tr = trace_rows(job.model, job.ids, rows)
    top = tr.states[-1]
    per_token = top.alpha[:, tr.local(torch.tensor(rows)), :].double().mean(0).cpu().numpy()  # (T, n)
    cost = {"forward": 1, "backward": 0, "seconds": 0.0}
    return {m: {"per_token": per_token, "terms": {}, "target": np.ones(T), "cost": cost} for m in names}


@pytest.fixture
def last_layer_attention():
    record = ContextMethod(
        "last_layer_attention",
        "Attention of the top layer",
        "a worked example",
        cost="one_pass",
        reads="the response rows of one traced pass",
        run=f"{__name__}:run_last_layer_attention",
        span="mean",
        memory=("rows",),
        doc="The top layer's attention of the row predicting each response token, heads averaged.",
    )
    register_context_method(record)
    yield record
    CONTEXT_METHODS.pop(record.name)


def test_a_method_added_by_one_record_reaches_every_consumer(llama, last_layer_attention):
    from ctxmix.export.context.view import methods_help
    from ctxmix.methods.context.check import extend_attribution

    name = last_layer_attention.name
    ca = ctxmix.attribute_context(llama, CONTEXT, QUERY, response=RESPONSE, methods=["logit", name], progress=False)
    T = len(ca.response_ids)
    assert ca.methods == ["logit", name] and ca.per_token[name].shape == (T, len(ca.prompt_ids) + T)
    assert np.allclose(ca.per_token[name].sum(1), 1.0, atol=1e-6)  # attention rows
    per_source = np.stack([ca.per_token[name][:, t].sum(1) for t in ca.source_tokens], 1)
    assert np.allclose(ca.scores[name], per_source.mean(0))  # its span rule: the mean over the span's tokens
    span = (int(ca.response_offsets[1][0]), int(ca.response_offsets[2][1]))
    assert np.allclose(ca.scores_for(name, span), per_source[1:3].mean(0))
    # extension adds it to an attribution made without it, with the same scores
    first = ctxmix.attribute_context(llama, CONTEXT, QUERY, response=RESPONSE, methods=["logit"], progress=False)
    extend_attribution(first, llama, [name])
    assert np.allclose(first.scores[name], ca.scores[name])
    # the memory estimate counts its phase, the page's help lists it, the command line takes it
    assert memory_phases([name]) == ["rows"]
    est = ctxmix.estimate_memory(llama, 64, call="attribute_context", methods=[name])
    same = ctxmix.estimate_memory(llama, 64, call="attribute_context", methods=["attention"])  # its phase, too
    assert est.peak_bytes == same.peak_bytes > 0
    assert name in methods_help()
    from ctxmix.export.context.cite import check_methods

    assert check_methods([name]) == [name]


def test_a_run_function_that_skips_a_method_fails_loudly(llama, last_layer_attention, monkeypatch):
    monkeypatch.setattr(f"{__name__}.run_last_layer_attention", lambda job, names: {})
    with pytest.raises(RuntimeError, match="returned no result"):
        ctxmix.attribute_context(
            llama, CONTEXT, QUERY, response=RESPONSE, methods=[last_layer_attention.name], progress=False
        )


def test_the_methods_layer_reads_no_benchmark_output():
    """The defaults the methods layer uses are one shipped mapping (ctxmix/methods/context/defaults.json): no module
    of ctxmix/methods reads the benchmark's shipped tables or results (at2.py read the validation tables before)."""
    found = []
    for f in REPO.glob("ctxmix/methods/**/*.py"):
        for line, text in _code_strings(f):
            if (
                ("onepass-validation" in text and " " not in text)  # a file name or pattern, not a citation
                or "shipped" == text
                or text.endswith(("benchmark/shipped", ".aggregates.csv"))
            ):
                found.append(f"{f.relative_to(REPO)}:{line} {text!r}")
        src = f.read_text()
        if "ctxmix.benchmark.shipped" in src or '"benchmark" / "shipped"' in src:
            found.append(f"{f.relative_to(REPO)}: names the benchmark's shipped folder")
    assert not found, found
