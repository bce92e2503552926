"""Offline examples for context attribution's benchmark (docs/context.md, "The benchmark"): needles,
summaries and documents built from gensim's shipped Lee background news texts, seeded and fixed.
(Over 500 lines: the three builders, their splits and the fact sets stay together, so one module shows that
train, validation and test never share a text.)

- **needles** (`needle_examples`): a fact sentence written for the example ("The code for the staff
  entrance is 4817.") inserted at a seeded sentence boundary of news texts joined to a seeded length; the
  query asks for the fact; gold = the needle's sentence index after the context is split into sentences.
- **summaries** (`summary_examples`): one news text cut to a length at a sentence end, query "Summarize
  the article in one sentence." (the CNN/DM setting); no gold source.
- **documents** (`document_examples`): five news texts as documents (sources="document"), a needle
  inserted in one of them at a sentence boundary; gold = that document.
- **long** (`long_examples`): needles and summaries in turn at 1,000-4,000 tokens (draws of their own), where
  one-pass methods are measured against ContextCite's 32 ablations on long contexts.

Lengths are counted by `count_tokens` (a callable str -> int, e.g. a model's tokenizer; default: the
number of whitespace-separated words): a context is the longest run of whole sentences not over its drawn
length. An example's id ("needle-3") names the template and the draw, so a config can store its
response by id. Every draw of the test split comes from `random.Random(f"{kind}:{seed}:{i}")` (other
splits: `f"{split}:{kind}:{seed}:{i}"`): the same examples on any machine and any Python 3.

**Splits** (`SPLITS`; every builder's `split=`, default "test"): disjoint by source text, so that nothing
chosen on one split (at2_exact's weights, a default, a threshold) has seen the texts it is measured on.

- **test**: the benchmark's examples (configs/context.yaml). Lee texts of the test split; the facts `NEEDLES`.
- **validation**: where a default or a hyper-parameter is chosen (bench/at2_eval.py's held-out table, the needle
  test). Lee texts of the validation split; the facts `VALIDATION_NEEDLES`.
- **train**: at2_exact's training (`at2_train.training_examples`). The English Wikipedia extract shipped in
  gensim's test data (`wiki_paragraphs`), less any paragraph sharing a sentence with a Lee text; the facts
  `TRAIN_NEEDLES`.

Lee texts are split by story (`lee_splits`): texts that share a sentence of at least MIN_SHARED_WORDS words
(the corpus repeats some stories, whole or in part) form one story, and a story goes whole to one split. A
story holding a text of `SHIPPED_TEST_TEXTS` is test (the shipped examples stay as they were made); of the
others, one in VALIDATION_SHARE, by a hash of the story's first text, is validation, the rest test. A split's
examples draw as the test split always did and skip the texts of other splits: the test examples whose texts
are all test texts, the shipped ones among them, are unchanged. Non-test draws and ids carry the split's name
("validation-needle-3", stream "validation:needle:0:3").
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from ctxmix.errors import BadInput
from ctxmix.methods.context.sources import first_sentence  # noqa: F401 - the benchmark reads answers with it

SUMMARY_QUERY = "Summarize the article in one sentence."
MAX_DRAWS = 20  # boundaries drawn for one needle before giving up (`_insert`)
SPLITS = ("train", "validation", "test")
MIN_SHARED_WORDS = 5  # texts sharing a sentence this long are one story (shorter ones: "He said." is no story)
VALIDATION_SHARE = 3  # one story in three, of those no shipped example uses, is validation
# Lee texts (indices into `ctxmix.data.lee_background()`) that the shipped examples draw sentences from:
# configs/context.yaml's tasks and check (counted in smollm2's tokens), needle_examples(1, 60, 100, seed=2)
# (docs/python.md, docs/cli.md) and needle_examples(16, 200, 400, seed=0)[0] in smollm2's tokens (the page
# test). Their stories stay in the test split, so those examples are what the shipped results were made on.
SHIPPED_TEST_TEXTS = frozenset(
    {3, 9, 13, 15, 26, 37, 52, 55, 59, 61, 65, 69, 72, 81, 82, 85, 90, 92, 97, 98, 99, 107, 111, 115, 119, 128}
    | {131, 141, 145, 150, 156, 158, 161, 175, 177, 178, 182, 186, 191, 197, 199, 200, 205, 206, 207, 210, 214}
    | {220, 221, 226, 232, 233, 238, 239, 241, 242, 243, 249, 251, 253, 255, 261, 263, 271, 296, 298}
)
WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
MIN_WORDS = 25  # a Wikipedia paragraph kept for training has at least this many words (prose, not lists or captions)


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

# the validation split's facts: none of them the test split's (NEEDLES) or the training split's (TRAIN_NEEDLES)
VALIDATION_NEEDLES: tuple[Needle, ...] = (
    Needle("The gate code for the car park is 6392.", "What is the gate code for the car park?", "6392"),
    Needle(
        "The hospital's new surgeon is named Ingrid Halvorsen.",
        "What is the name of the hospital's new surgeon?",
        "Halvorsen",
    ),
    Needle("The kite festival will take place on 22 August.", "When will the kite festival take place?", "22 August"),
    Needle("The headmaster's bicycle is painted lime green.", "What colour is the headmaster's bicycle?", "green"),
    Needle("The farmer's horse is called Thistle.", "What is the farmer's horse called?", "Thistle"),
    Needle(
        "The secret ingredient in the cafe's soup is fennel.",
        "What is the secret ingredient in the cafe's soup?",
        "fennel",
    ),
    Needle(
        "The hotel's guest network password is redcedar47.", "What is the hotel's guest network password?", "redcedar47"
    ),
    Needle(
        "The stolen bicycle was found in the village of Thornbury.",
        "In which village was the stolen bicycle found?",
        "Thornbury",
    ),
    Needle(
        "The orchestra's new violinist also plays the harp.",
        "Which other instrument does the orchestra's new violinist play?",
        "harp",
    ),
    Needle("The cargo plane is named the Northern Kestrel.", "What is the cargo plane named?", "Kestrel"),
    Needle("The chess tournament was moved to Hall 309.", "Which hall was the chess tournament moved to?", "309"),
    Needle("The town's oldest oak tree is 418 years old.", "How old is the town's oldest oak tree?", "418"),
    Needle("The gardener's favourite flower is the peony.", "What is the gardener's favourite flower?", "peony"),
    Needle(
        "The lost wedding ring was found under a bench near Bexley.",
        "Where was the lost wedding ring found?",
        "Bexley",
    ),
    Needle("The coach of the netball team is Priya Dalton.", "Who is the coach of the netball team?", "Dalton"),
    Needle("The new train platform number is 19.", "What is the new train platform number?", "19"),
)

# the training split's facts (at2_exact's training set)
TRAIN_NEEDLES: tuple[Needle, ...] = (
    Needle("The password for the archive room is maple731.", "What is the password for the archive room?", "maple731"),
    Needle("The expedition's cook was a man named Oskar Lind.", "What was the name of the expedition's cook?", "Lind"),
    Needle(
        "The observatory opens to visitors on 9 October.", "When does the observatory open to visitors?", "9 October"
    ),
    Needle(
        "The committee's chairwoman drives a green tractor.", "What does the committee's chairwoman drive?", "tractor"
    ),
    Needle("The ferry to the island leaves from Pier 52.", "Which pier does the ferry to the island leave from?", "52"),
    Needle("The old mill's cat is called Pepper.", "What is the old mill's cat called?", "Pepper"),
    Needle("The professor's favourite fruit is the quince.", "What is the professor's favourite fruit?", "quince"),
    Needle("The team's mascot is a blue heron named Wade.", "What is the name of the team's mascot?", "Wade"),
    Needle("The vault combination is 2951.", "What is the vault combination?", "2951"),
    Needle("The first prize was won by a baker from Dunmore.", "Where was the first prize winner from?", "Dunmore"),
)

SPLIT_NEEDLES: dict[str, tuple[Needle, ...]] = {
    "train": TRAIN_NEEDLES,
    "validation": VALIDATION_NEEDLES,
    "test": NEEDLES,
}


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
    return list(_split_sentences(text))


@lru_cache(maxsize=8192)  # a corpus text is split again by every example that draws it (pysbd: ~10 ms a text)
def _split_sentences(text: str) -> tuple[str, ...]:
    from ctxmix.methods.context.sources import make_sources

    try:
        return tuple(make_sources(text, "sentence").texts)
    except BadInput:  # one sentence (a short document): make_sources refuses it as a context, not as text here
        return (text.strip(),) if text.strip() else ()


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


def _fill(rng: random.Random, low: int, high: int, count: Callable[[str], int], split: str) -> list[str]:
    """Whole sentences of the split's texts in a drawn order, from `low` to `high` tokens (`_cut`). The order
    is drawn over the whole corpus and the other splits' texts skipped: a test example that drew none of them
    is the one drawn before the splits existed."""
    texts, keep = _corpus(split)
    order = list(range(len(texts)))
    rng.shuffle(order)
    return _cut((s for t in order if t in keep for s in _sentences(texts[t])), low, high, count)


# ---------------------------------------------------------------------------------------------------------
# splits


def normalise(sentence: str) -> str:
    """A sentence with its whitespace runs made single spaces (how sentences are compared across splits)."""
    return " ".join(sentence.split())


def _long_sentences(text: str) -> set[str]:
    """The text's sentences of at least MIN_SHARED_WORDS words, normalised."""
    return {normalise(s) for s in _sentences(text) if len(s.split()) >= MIN_SHARED_WORDS}


def _check_split(split) -> None:
    if split not in SPLITS:
        raise BadInput(f"split must be one of {', '.join(SPLITS)}, got {split!r}")


@lru_cache(maxsize=1)
def wiki_paragraphs() -> tuple[str, ...]:
    """Prose paragraphs of gensim's shipped English Wikipedia extract (206 pages; markup removed by gensim's
    `filter_wiki`, lines with leftover markup, lists and headings dropped, at least MIN_WORDS words each)."""
    import bz2
    from importlib import resources

    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    path = resources.files("gensim") / "test" / "test_data" / WIKI_FILE
    out = []
    with bz2.open(str(path)) as f:
        for _, text, _ in extract_pages(f):
            for line in filter_wiki(text).replace("'''", "").replace("''", "").splitlines():
                line = re.sub(r"\s+", " ", line).strip()
                if len(line.split()) < MIN_WORDS or re.search(r"[|{}\[\]<>=*#]|https?:", line) or line[0] in ":;!":
                    continue
                out.append(line)
    return tuple(out)


@lru_cache(maxsize=1)
def lee_splits() -> tuple[str, ...]:
    """The split ("validation" or "test") of each Lee text, in `ctxmix.data.lee_background()`'s order: texts
    sharing a sentence of MIN_SHARED_WORDS words or more are one story (transitively), a story goes whole to one
    split: test when it holds a text of SHIPPED_TEST_TEXTS, else validation when the sha256 of its first text's
    UTF-8 is 0 modulo VALIDATION_SHARE, else test."""
    from ctxmix.data import lee_background

    texts = lee_background()
    parent = list(range(len(texts)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for i, t in enumerate(texts):
        for s in _long_sentences(t):
            a, b = root(i), root(first.setdefault(s, i))
            parent[max(a, b)] = min(a, b)  # a story's root is its first text
    stories: dict[int, set[int]] = {}
    for i in range(len(texts)):
        stories.setdefault(root(i), set()).add(i)
    split = {}
    for r, members in stories.items():
        h = int.from_bytes(hashlib.sha256(texts[r].encode("utf-8")).digest(), "big")
        split[r] = "test" if members & SHIPPED_TEST_TEXTS or h % VALIDATION_SHARE else "validation"
    return tuple(split[root(i)] for i in range(len(texts)))


@lru_cache(maxsize=len(SPLITS))
def _corpus(split: str) -> tuple[tuple[str, ...], frozenset[int]]:
    """(the corpus the split draws from, the indices of the split's texts in it): Lee news for validation and
    test (`lee_splits`), Wikipedia paragraphs for train, less any that holds a Lee text's sentence of
    MIN_SHARED_WORDS words or more."""
    _check_split(split)
    from ctxmix.data import lee_background

    lee = tuple(lee_background())
    if split == "train":
        # a paragraph that has a news sentence among its sentences holds it as a substring (whitespace
        # normalised): one search of the whole extract per news sentence finds them all, without splitting it
        paragraphs = wiki_paragraphs()
        flat = [normalise(p) for p in paragraphs]
        extract = "\n".join(flat)
        found = [n for n in set().union(*map(_long_sentences, lee)) if n in extract]
        return paragraphs, frozenset(i for i, p in enumerate(flat) if not any(n in p for n in found))
    return lee, frozenset(i for i, s in enumerate(lee_splits()) if s == split)


def split_texts(split: str) -> list[str]:
    """The texts of a split (`SPLITS`), in their corpus's order."""
    texts, keep = _corpus(split)
    return [texts[i] for i in sorted(keep)]


def _draw(kind: str, split: str, seed: int, i: int) -> random.Random:
    """Example i's generator: the test split's streams are those of the benchmark before the splits existed."""
    return random.Random(f"{kind}:{seed}:{i}" if split == "test" else f"{split}:{kind}:{seed}:{i}")


def _example_id(name: str, split: str, i: int) -> str:
    return f"{name}-{i}" if split == "test" else f"{split}-{name}-{i}"


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
    split: str = "test",
    *,
    name: str = "needle",
) -> list[ContextExample]:
    """n needles of a split (`SPLITS`): example i uses the split's fact i (`SPLIT_NEEDLES`, cycled), a length
    drawn uniformly in [min_tokens, max_tokens] for the context (haystack and needle; counted piecewise, so a
    merge at a join can shift it by a token or two), the split's texts in a drawn order, the needle at a drawn
    sentence boundary; gold = [the needle's sentence index]. name: the ids' and draws' name ("needle-3")."""
    _check_lengths(n, min_tokens, max_tokens)
    _check_split(split)
    count = count_tokens or _words
    needles = SPLIT_NEEDLES[split]
    out = []
    for i in range(n):
        rng = _draw(name, split, seed, i)
        nd = needles[i % len(needles)]
        extra = count(nd.fact) + 1  # the needle and its space
        hay = _fill(rng, rng.randint(min_tokens, max_tokens) - extra, max_tokens - extra, count, split)
        text, gold = _insert(rng, hay, nd.fact)
        eid = _example_id(name, split, i)
        out.append(ContextExample(eid, "needles", text, nd.question, "sentence", [gold], nd.answer))
    return out


def summary_examples(
    n: int,
    min_tokens: int = 200,
    max_tokens: int = 400,
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
    split: str = "test",
    *,
    name: str = "summary",
) -> list[ContextExample]:
    """n summaries of a split (`SPLITS`): a drawn text of the split (continued by the next drawn ones when
    shorter) cut at a sentence end to a drawn length in [min_tokens, max_tokens]; query SUMMARY_QUERY; no gold.
    name: the ids' and draws' name ("summary-3")."""
    _check_lengths(n, min_tokens, max_tokens)
    _check_split(split)
    count = count_tokens or _words
    out = []
    for i in range(n):
        rng = _draw(name, split, seed, i)
        text = " ".join(_fill(rng, rng.randint(min_tokens, max_tokens), max_tokens, count, split))
        out.append(ContextExample(_example_id(name, split, i), "summaries", text, SUMMARY_QUERY, "sentence"))
    return out


def long_examples(
    n: int,
    min_tokens: int = 1000,
    max_tokens: int = 4000,
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
    split: str = "test",
) -> list[ContextExample]:
    """n long contexts of a split (`SPLITS`), needles and summaries in turn ("long-needle-0", "long-summary-0",
    "long-needle-1", ...): `needle_examples` and `summary_examples` at these lengths, on draws of their own
    (streams "long-needle:{seed}:{i}", "long-summary:{seed}:{i}"), so a long example is no other task's example
    at another length. A long summary's context is several news texts in a row (the test split's longest text has
    559 words), the query still SUMMARY_QUERY."""
    _check_lengths(n, min_tokens, max_tokens)
    needles = needle_examples((n + 1) // 2, min_tokens, max_tokens, seed, count_tokens, split, name="long-needle")
    summaries = summary_examples(n // 2, min_tokens, max_tokens, seed, count_tokens, split, name="long-summary")
    return [e for pair in itertools.zip_longest(needles, summaries) for e in pair if e is not None]


def _within(rng: random.Random, picks: list[int], keep: frozenset[int]) -> list[int]:
    """`picks` with each text outside the split replaced by a drawn one of the split not yet picked (no draw
    when all are inside: a test example that picked only test texts is the one picked before the splits)."""
    spare = sorted(keep - set(picks))
    return [t if t in keep else spare.pop(rng.randrange(len(spare))) for t in picks]


def document_examples(
    n: int,
    n_documents: int = 5,
    min_tokens: int = 40,
    max_tokens: int = 120,
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
    split: str = "test",
) -> list[ContextExample]:
    """n examples of a split (`SPLITS`) of `n_documents` of its texts as documents (each cut to a drawn length
    in [min_tokens, max_tokens] at a sentence end), a needle (the split's facts from the end backwards, so they
    differ from its needles task's first ones) inserted at a sentence boundary of a drawn document; gold =
    [that document]."""
    _check_lengths(n, min_tokens, max_tokens)
    _check_split(split)
    if isinstance(n_documents, bool) or not isinstance(n_documents, int) or n_documents < 2:
        raise BadInput(
            f"n_documents must be a whole number >= 2 (one document is nothing to compare), got {n_documents!r}"
        )
    count = count_tokens or _words
    texts, keep = _corpus(split)
    if n_documents > len(keep):
        raise BadInput(f"the {split} split has {len(keep)} texts, fewer than n_documents={n_documents}")
    needles = SPLIT_NEEDLES[split]
    out = []
    for i in range(n):
        rng = _draw("document", split, seed, i)
        nd = needles[-1 - i % len(needles)]
        picks = _within(rng, rng.sample(range(len(texts)), n_documents), keep)
        docs = [
            " ".join(_cut(_sentences(texts[t]), rng.randint(min_tokens, max_tokens), max_tokens, count)) for t in picks
        ]
        g = rng.randrange(n_documents)
        docs[g], _ = _insert(rng, _sentences(docs[g]), nd.fact)
        eid = _example_id("document", split, i)
        out.append(ContextExample(eid, "documents", docs, nd.question, "document", [g], nd.answer))
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


OFFLINE_TASKS = ("needles", "summaries", "documents", "long")  # built here from shipped texts, split by `SPLITS`
TASKS: dict[str, Callable[..., list[ContextExample]]] = {
    "needles": needle_examples,
    "summaries": summary_examples,
    "documents": document_examples,
    "long": long_examples,
    "cnn_dm": cnn_dm_examples,
    "hotpotqa": hotpotqa_examples,
    "tydiqa": tydiqa_examples,
}
