"""Offline examples for context attribution's benchmark (docs/context.md, "The benchmark"): needles,
summaries and documents built from gensim's shipped Lee background news texts, seeded and fixed.

- **needles** (`needle_examples`): a fact sentence written for the example ("The code for the staff
  entrance is 4817.") inserted at a seeded sentence boundary of news texts joined to a seeded length; the
  query asks for the fact; gold = the needle's sentence index after the context is split into sentences.
- **summaries** (`summary_examples`): one news text cut to a length at a sentence end, query "Summarize
  the article in one sentence." (the CNN/DM setting); no gold source.
- **documents** (`document_examples`): five news texts as documents (sources="document"), a needle
  inserted in one of them at a sentence boundary; gold = that document.

Lengths are counted by `count_tokens` (a callable str -> int, e.g. a model's tokenizer; default: the
number of whitespace-separated words): a context is the longest run of whole sentences not over its drawn
length. An example's id ("needle-3") names the template and the draw, so a config can store its
response by id. Every draw comes from `random.Random(f"{kind}:{seed}:{i}")`: the same examples on any
machine and any Python 3.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ctxmix.errors import BadInput

SUMMARY_QUERY = "Summarize the article in one sentence."
MAX_DRAWS = 20  # boundaries drawn for one needle before giving up (`_insert`)


@dataclass(frozen=True)
class Needle:
    """A fact written for a test, its question and the answer text whose presence in a response (case
    folded, at word boundaries) says the model found it."""

    fact: str
    question: str
    answer: str


NEEDLES: tuple[Needle, ...] = (
    Needle("The code for the staff entrance is 4817.", "What is the code for the staff entrance?", "4817"),
    Needle("The museum's new director is named Clara Voss.", "What is the name of the museum's new director?", "Voss"),
    Needle("The harbour festival will be held on 14 March.", "When will the harbour festival be held?", "14 March"),
    Needle("The mayor's new car is painted bright orange.", "What colour is the mayor's new car?", "orange"),
    Needle("The lighthouse keeper's dog is called Biscuit.", "What is the lighthouse keeper's dog called?", "Biscuit"),
    Needle(
        "The secret ingredient in the bakery's famous pie is cardamom.",
        "What is the secret ingredient in the bakery's famous pie?",
        "cardamom",
    ),
    Needle("The library's Wi-Fi password is bluefern22.", "What is the library's Wi-Fi password?", "bluefern22"),
    Needle(
        "The winning lottery ticket was sold in the town of Merrivale.",
        "In which town was the winning lottery ticket sold?",
        "Merrivale",
    ),
    Needle(
        "The school choir's conductor plays the bassoon.",
        "Which instrument does the school choir's conductor play?",
        "bassoon",
    ),
    Needle("The research ship is named the Southern Albatross.", "What is the research ship named?", "Albatross"),
    Needle("The council meeting was moved to Room 214.", "Which room was the council meeting moved to?", "214"),
    Needle("The zoo's oldest tortoise is 112 years old.", "How old is the zoo's oldest tortoise?", "112"),
    Needle("The chef's favourite spice is saffron.", "What is the chef's favourite spice?", "saffron"),
    Needle(
        "The missing painting was found in a barn near Ashford.",
        "Where was the missing painting found?",
        "Ashford",
    ),
    Needle("The captain of the rowing team is Marcus Feld.", "Who is the captain of the rowing team?", "Feld"),
    Needle("The new bus route number is 738.", "What is the new bus route number?", "738"),
)


@dataclass
class ContextExample:
    """One example: context (str, or a list of documents), query, how it is split into sources, the gold
    source indices (empty: unknown), the answer a response must contain (None: no filter), and the stored
    response (None: generate it)."""

    id: str
    kind: str
    context: str | list[str]
    query: str
    sources: str
    gold: list[int] = field(default_factory=list)
    answer: str | None = None
    response: str | None = None


def contains_answer(response: str, answer: str) -> bool:
    """Whether `answer` appears in `response`, case folded, not inside a longer word or number."""
    return re.search(rf"(?<!\w){re.escape(answer.casefold())}(?!\w)", response.casefold()) is not None


def _words(text: str) -> int:
    return len(text.split())


def _sentences(text: str) -> list[str]:
    from ctxmix.methods.context.sources import make_sources

    try:
        return make_sources(text, "sentence").texts
    except BadInput:  # one sentence (a short document): make_sources refuses it as a context, not as text here
        return [text.strip()] if text.strip() else []


def _check_lengths(n: int, min_tokens: int, max_tokens: int) -> None:
    ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (n, min_tokens, max_tokens))
    if not ok or n < 0 or not 0 < min_tokens <= max_tokens:
        raise BadInput(
            f"need whole numbers n >= 0 and 0 < min_tokens <= max_tokens, got n={n!r}, "
            f"min_tokens={min_tokens!r}, max_tokens={max_tokens!r}"
        )


def _cut(sentences, low: int, high: int, count: Callable[[str], int]) -> list[str]:
    """Sentences taken in order while their space-joined text is under `low` tokens, skipping any that would
    take it over `high`: the result has from `low` to `high` tokens unless the sentences run out."""
    out: list[str] = []
    n = 0
    for s in sentences:
        if n >= low:
            break
        m = count(" ".join(out + [s]))
        if m <= high:
            out.append(s)
            n = m
    return out


def _fill(rng: random.Random, low: int, high: int, count: Callable[[str], int]) -> list[str]:
    """Whole sentences of news texts in a drawn order, from `low` to `high` tokens (`_cut`)."""
    from ctxmix.data import lee_background

    texts = lee_background()
    order = list(range(len(texts)))
    rng.shuffle(order)
    return _cut((s for t in order for s in _sentences(texts[t])), low, high, count)


def _insert(rng: random.Random, sentences: list[str], fact: str) -> tuple[str, int]:
    """The sentences joined by spaces with `fact` placed at a drawn boundary (before sentence j, j in
    0..len), and the needle's sentence index once that text is split again. A boundary where the splitter
    does not keep the needle as one whole sentence (it merges it with a neighbour that lacks a sentence end)
    is drawn again, at most MAX_DRAWS times."""
    for _ in range(MAX_DRAWS):
        j = rng.randint(0, len(sentences))
        text = " ".join(sentences[:j] + [fact] + sentences[j:])
        hits = [i for i, s in enumerate(_sentences(text)) if s == fact]
        if len(hits) == 1:
            return text, hits[0]
    raise RuntimeError(f"the needle {fact!r} is not one whole sentence at any of {MAX_DRAWS} drawn boundaries")


def needle_examples(
    n: int,
    min_tokens: int = 200,
    max_tokens: int = 400,
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
) -> list[ContextExample]:
    """n needles: example i uses template NEEDLES[i % len(NEEDLES)], a length drawn uniformly in
    [min_tokens, max_tokens] for the context (haystack and needle; counted piecewise, so a merge at a
    join can shift it by a token or two), news texts in a drawn order,
    the needle at a drawn sentence boundary; gold = [the needle's sentence index]."""
    _check_lengths(n, min_tokens, max_tokens)
    count = count_tokens or _words
    out = []
    for i in range(n):
        rng = random.Random(f"needle:{seed}:{i}")
        nd = NEEDLES[i % len(NEEDLES)]
        extra = count(nd.fact) + 1  # the needle and its space
        hay = _fill(rng, rng.randint(min_tokens, max_tokens) - extra, max_tokens - extra, count)
        text, gold = _insert(rng, hay, nd.fact)
        out.append(ContextExample(f"needle-{i}", "needles", text, nd.question, "sentence", [gold], nd.answer))
    return out


def summary_examples(
    n: int,
    min_tokens: int = 200,
    max_tokens: int = 400,
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
) -> list[ContextExample]:
    """n summaries: a drawn news text (continued by the next drawn ones when shorter) cut at a sentence end
    to a drawn length in [min_tokens, max_tokens]; query SUMMARY_QUERY; no gold."""
    _check_lengths(n, min_tokens, max_tokens)
    count = count_tokens or _words
    out = []
    for i in range(n):
        rng = random.Random(f"summary:{seed}:{i}")
        text = " ".join(_fill(rng, rng.randint(min_tokens, max_tokens), max_tokens, count))
        out.append(ContextExample(f"summary-{i}", "summaries", text, SUMMARY_QUERY, "sentence"))
    return out


def document_examples(
    n: int,
    n_documents: int = 5,
    min_tokens: int = 40,
    max_tokens: int = 120,
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
) -> list[ContextExample]:
    """n examples of `n_documents` news texts as documents (each cut to a drawn length in [min_tokens,
    max_tokens] at a sentence end), a needle (templates from the end of NEEDLES backwards, so they differ
    from the needles task's first ones) inserted at a sentence boundary of a drawn document; gold = [that
    document]."""
    _check_lengths(n, min_tokens, max_tokens)
    if isinstance(n_documents, bool) or not isinstance(n_documents, int) or n_documents < 2:
        raise BadInput(
            f"n_documents must be a whole number >= 2 (one document is nothing to compare), got {n_documents!r}"
        )
    from ctxmix.data import lee_background

    count = count_tokens or _words
    texts = lee_background()
    n_texts = len(texts)
    out = []
    for i in range(n):
        rng = random.Random(f"document:{seed}:{i}")
        nd = NEEDLES[-1 - i % len(NEEDLES)]
        picks = rng.sample(range(n_texts), n_documents)
        docs = [
            " ".join(_cut(_sentences(texts[t]), rng.randint(min_tokens, max_tokens), max_tokens, count)) for t in picks
        ]
        g = rng.randrange(n_documents)
        docs[g], _ = _insert(rng, _sentences(docs[g]), nd.fact)
        out.append(ContextExample(f"document-{i}", "documents", docs, nd.question, "document", [g], nd.answer))
    return out


# ---------------------------------------------------------------------------------------------------------
# the papers' datasets (ContextCite's Fig. 4), from the Hugging Face hub: they need network access (or the
# `datasets` cache)

CNN_DM_QUERY = "Summarize the article in up to three sentences."  # AT2's notebooks and tests
# task -> (hub id, config, default split): the datasets the papers' code loads (cnn_dailymail, hotpot_qa, tydiqa),
# as the hub now spells them under their owners (the bare names were script datasets, which datasets >= 3 no
# longer runs)
HUB = {
    "cnn_dm": ("abisee/cnn_dailymail", "3.0.0", "validation"),
    "hotpotqa": ("hotpotqa/hotpot_qa", "distractor", "validation"),
    "tydiqa": ("google-research-datasets/tydiqa", "primary_task", "validation"),
}


def hub_rows(task: str, split: str | None = None):
    """The rows of a hub dataset (`HUB[task]`), loaded lazily with `datasets`; BadInput naming the dataset
    when `datasets` is missing or the hub is unreachable (offline: HF_DATASETS_OFFLINE / HF_HUB_OFFLINE)."""
    path, name, default = HUB[task]
    split = split or default
    try:
        import datasets
    except ImportError:
        raise BadInput(f"the {task} task reads {path}/{name} from the Hugging Face hub: pip install datasets") from None
    try:
        return datasets.load_dataset(path, name, split=split)
    except Exception as e:  # noqa: BLE001  (offline, missing split, hub errors: all say the same to the user)
        raise BadInput(
            f"the {task} task could not load {path}/{name} split {split} from the Hugging Face hub "
            f"({type(e).__name__}: {e}); it needs network access or a cached copy of that dataset. Offline "
            "context tasks: needles, summaries, documents (configs/context.yaml)"
        ) from None


def _sample(rows, n: int, seed: int, keep=None) -> list:
    """n rows drawn without replacement (`random.Random(seed)` over the row order), those `keep` accepts."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    out = []
    for i in order:
        if len(out) >= n:
            break
        rec = rows[i]
        if keep is None or keep(rec):
            out.append((i, rec))
    return out


def _cut_text(text: str, max_tokens: int | None, count: Callable[[str], int]) -> str:
    """The longest run of whole leading sentences within `max_tokens` (None: the whole text)."""
    if max_tokens is None:
        return text
    return " ".join(_cut(_sentences(text), max_tokens, max_tokens, count))


def cnn_dm_examples(
    n: int,
    seed: int = 0,
    split: str | None = None,
    max_tokens: int | None = None,
    query: str = CNN_DM_QUERY,
    count_tokens: Callable[[str], int] | None = None,
) -> list[ContextExample]:
    """CNN/DailyMail (cnn_dailymail 3.0.0, validation): n drawn articles (sources: sentences; cut to
    max_tokens at a sentence end when given), query CNN_DM_QUERY; no gold."""
    count = count_tokens or _words
    rows = hub_rows("cnn_dm", split)
    return [
        ContextExample(f"cnn_dm-{i}", "cnn_dm", _cut_text(r["article"], max_tokens, count), query, "sentence")
        for i, r in _sample(rows, n, seed)
    ]


def hotpotqa_examples(
    n: int,
    seed: int = 0,
    split: str | None = None,
    max_tokens: int | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> list[ContextExample]:
    """HotpotQA (hotpot_qa distractor, validation): the 10 passages (2 gold, 8 distractors; a passage is its
    sentences joined by spaces) as documents, the question as query; gold = the passages whose title has a
    supporting fact. max_tokens: examples whose passages exceed it are skipped."""
    count = count_tokens or _words
    rows = hub_rows("hotpotqa", split)

    def passages(r) -> list[str]:
        return [" ".join(s).strip() for s in r["context"]["sentences"]]

    def fits(r) -> bool:
        return max_tokens is None or count("\n\n".join(passages(r))) <= max_tokens

    out = []
    for i, r in _sample(rows, n, seed, fits):
        titles = set(r["supporting_facts"]["title"])
        gold = [k for k, t in enumerate(r["context"]["title"]) if t in titles]
        out.append(ContextExample(f"hotpotqa-{i}", "hotpotqa", passages(r), r["question"], "document", gold))
    return out


def tydiqa_examples(
    n: int,
    seed: int = 0,
    split: str | None = None,
    max_tokens: int | None = 4000,
    count_tokens: Callable[[str], int] | None = None,
) -> list[ContextExample]:
    """TyDi QA (tydiqa primary_task, validation), English only: the Wikipedia article's plain text (sources:
    sentences; cut to max_tokens at a sentence end: smollm2's window is 8,192), the question as query; no
    gold (the annotated passage is not mapped onto sentences)."""
    count = count_tokens or _words
    rows = hub_rows("tydiqa", split)
    return [
        ContextExample(
            f"tydiqa-{i}",
            "tydiqa",
            _cut_text(r["document_plaintext"], max_tokens, count),
            r["question_text"],
            "sentence",
        )
        for i, r in _sample(rows, n, seed, lambda r: r["language"] == "english")
    ]


TASKS: dict[str, Callable[..., list[ContextExample]]] = {
    "needles": needle_examples,
    "summaries": summary_examples,
    "documents": document_examples,
    "cnn_dm": cnn_dm_examples,
    "hotpotqa": hotpotqa_examples,
    "tydiqa": tydiqa_examples,
}
