"""Progress of the engine's long loops, per call: `ctxmix.progress.reporting` hears its own call's stages, in order,
up to 1.0, and nothing of another thread's call on the same model (two dashboard sessions)."""

import threading

import pytest
from conftest import tiny_model

import ctxmix
from ctxmix.progress import report, reporting

TEXT = "the keys to the cabinet are on the table ."


def test_each_stage_reports_rising_fractions_up_to_one(tokenizer):
    m = tiny_model("bert", tokenizer)
    heard: list[tuple[str, float]] = []
    with reporting(lambda stage, f: heard.append((stage, f))):
        ctxmix.explain(m, TEXT, ["alti", "value_zeroing", "AtbFfRes"])
    stages = list(dict.fromkeys(s for s, _ in heard))
    assert stages == ["ALTI and the norm family", "value zeroing", "FF scopes"]
    for s in stages:
        f = [x for t, x in heard if t == s]
        assert f == sorted(f) and 0 <= f[0] < 0.5 and f[-1] == 1.0, (s, f)
        assert len(f) >= m.n_layers + 1  # a report per layer's chunk, and the end
    heard.clear()
    ctxmix.explain(m, TEXT, ["alti"])  # outside the block: nobody hears
    assert heard == []


def test_another_threads_call_is_not_heard(tokenizer):
    """A call in another thread (another session) on the same model, during this block, reports to nobody here;
    its own block hears only its own stages."""
    m = tiny_model("bert", tokenizer)
    mine: list[str] = []
    theirs: list[str] = []
    started, release = threading.Event(), threading.Event()

    def other():
        with reporting(lambda stage, f: theirs.append(stage)):
            started.set()
            release.wait(30)
            ctxmix.explain(m, TEXT, ["value_zeroing"])

    t = threading.Thread(target=other)
    t.start()
    started.wait(30)
    with reporting(lambda stage, f: mine.append(stage)):
        release.set()
        ctxmix.explain(m, TEXT, ["alti"])
        t.join(60)
    assert set(mine) == {"ALTI and the norm family"} and set(theirs) == {"value zeroing"}


@pytest.mark.parametrize("done, total, heard", [(3, 4, [0.75]), (5, 4, [1.0]), (1, 0, [])])
def test_report_is_a_fraction_of_the_stage(done, total, heard):
    got: list[float] = []
    with reporting(lambda stage, f: got.append(f)):
        report("x", done, total)
    assert got == heard
