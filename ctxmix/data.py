"""Offline text sources: small corpora shipped with gensim, local files, and (optionally) the HF hub.
(Over 500 lines: one small reader per corpus, each with its cleaning rules; they share the
corpus() entry point and its limits.)

ctxmix must work without internet, so every analysis and test can draw its inputs from the
test corpora that gensim ships in ``gensim/test/test_data`` (Pang & Lee movie-review
polarity sentences, a shortened English Wikipedia dump, Lee news background texts), or from
a user's own ``.txt`` / ``.jsonl`` / ``.csv`` file.  The Hugging Face dataset hub is only
used when the ``datasets`` package is installed and the network is reachable.
"""

from __future__ import annotations

import bz2
import functools
import importlib.util
import json
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctxmix.errors import BadInput

__all__ = [
    "CORPORA",
    "LabelledText",
    "corpus",
    "gensim_test_data_dir",
    "hf_dataset_texts",
    "lee_background",
    "pang_lee",
    "read_labelled",
    "read_texts",
    "wiki_texts",
]

CORPORA: tuple[str, ...] = ("wiki", "pang_lee", "lee")
"""Names of the built-in offline corpora accepted by :func:`corpus`."""

PANG_LEE_FILE = "pang_lee_polarity.cor"
WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
LEE_FILE = "lee_background.cor"

PANG_LEE_LABELS: dict[str, int] = {"neg": 0, "pos": 1}

_TEXT_SUFFIXES = {".txt", ".text", ".md", ""}
_JSONL_SUFFIXES = {".jsonl", ".json", ".ndjson"}
_CSV_SUFFIXES = {".csv", ".tsv"}


@dataclass(frozen=True, slots=True)
class LabelledText:
    """One text with an integer class label and the label's human-readable name."""

    text: str
    label: int
    label_name: str
    text_pair: str | None = None  # the second text of a sentence pair (read_labelled's pair_field)


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def _check_limit(limit: int | None) -> int | None:
    """Validate a ``limit`` argument (None = everything)."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise BadInput(f"limit must be None or a non-negative integer, got {limit!r}")
    return limit


def _take(items: list[Any], limit: int | None) -> list[Any]:
    """First ``limit`` items as a fresh list (callers may mutate it without touching caches)."""
    limit = _check_limit(limit)
    return list(items) if limit is None else list(items[:limit])


def gensim_test_data_dir() -> Path:
    """Folder of gensim's bundled test corpora, found without importing gensim itself."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the offline corpora come from the gensim package, which is not installed "
            "(pip install gensim), or pass a local .txt/.jsonl file instead"
        )
    for location in spec.submodule_search_locations:
        folder = Path(location) / "test" / "test_data"
        if folder.is_dir():
            return folder
    raise RuntimeError(
        "gensim is installed but its test data folder (gensim/test/test_data) is missing; "
        "reinstall gensim or pass a local .txt/.jsonl file instead"
    )


def _gensim_file(name: str) -> Path:
    """Path of one file in gensim's test data folder, with a clear error if it is missing."""
    path = gensim_test_data_dir() / name
    if not path.is_file():
        raise RuntimeError(f"gensim test data file not found: {path}; reinstall gensim")
    return path


# --------------------------------------------------------------------------------------
# Pang & Lee polarity sentences
# --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _pang_lee_all() -> tuple[LabelledText, ...]:
    """Parse the whole Pang & Lee file once (200 lines of ``__label__neg text``)."""
    path = _gensim_file(PANG_LEE_FILE)
    items: list[LabelledText] = []
    # cp1252: the file has a few Latin-1 letters and an em dash (0x97).
    with open(path, encoding="cp1252") as handle:
        for lineno, line in enumerate(handle, start=1):
            line = line.strip()
            if not line:
                continue
            tag, _, text = line.partition(" ")
            name = tag.removeprefix("__label__")
            if not tag.startswith("__label__") or name not in PANG_LEE_LABELS:
                raise RuntimeError(f"{path}:{lineno}: unexpected label {tag!r}")
            text = text.strip()
            if text:
                items.append(LabelledText(text=text, label=PANG_LEE_LABELS[name], label_name=name))
    return tuple(items)


def pang_lee(limit: int | None = None) -> list[LabelledText]:
    """Pang & Lee movie-review sentences with polarity labels (0 = neg, 1 = pos), file order.

    200 lower-cased, tokenised sentences, 100 per label; the first 100 are negative, so
    take a stratified sample yourself if you need both labels with a small ``limit``.
    """
    return _take(list(_pang_lee_all()), limit)


# --------------------------------------------------------------------------------------
# Wikipedia prose
# --------------------------------------------------------------------------------------

# Bold/italic quotes left by filter_wiki.
_RE_QUOTES = re.compile(r"'{2,}")
# Anything that betrays leftover wiki/HTML markup.
_RE_MARKUP = re.compile(r"[|{}\[\]<>=*#_\\]|&[a-z]+;|https?:|www\.")
# Holes left where templates (e.g. language glosses, conversions) were removed.
_RE_HOLES = re.compile(r"\s[,.;:)]|\(\s*[,;:)]|\(\s|\s{2,}|,\s*,|\(\)|^[^A-Za-z0-9\"'(]")
# Sentence boundary: end punctuation (optionally closed by a quote/bracket), space, capital.
_RE_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]?\s+(?=[\"'(]?[A-Z0-9])")
# Common abbreviations that must not end a sentence.
_ABBREVIATIONS = (
    "e.g.", "i.e.", "etc.", "vs.", "Mr.", "Mrs.", "Ms.", "Dr.", "St.", "Jr.", "Sr.",
    "c.", "ca.", "No.", "Vol.", "pp.", "p.", "U.S.", "U.K.", "Gen.", "Col.", "Lt.", "Fig.",
)  # fmt: skip


def _split_sentences(paragraph: str) -> list[str]:
    """Split a prose paragraph into sentences with a conservative regex."""
    pieces: list[str] = []
    start = 0
    for match in _RE_SENTENCE_END.finditer(paragraph):
        candidate = paragraph[start : match.start()].rstrip()
        last_word = candidate.rsplit(" ", 1)[-1]
        # "J. R. R. Tolkien", "e.g. Foo", "U.S. Army": not a sentence end.
        if last_word.lstrip("(\"'") in _ABBREVIATIONS or re.fullmatch(r"[A-Z]\.", last_word):
            continue
        end = match.end() - len(match.group(0).lstrip("\"')]"))
        pieces.append(paragraph[start:end].strip())
        start = match.end()
    pieces.append(paragraph[start:].strip())
    return [p for p in pieces if p]


def _clean_sentence(sentence: str) -> str | None:
    """Return the sentence if it looks like clean English prose, else None."""
    words = sentence.split()
    if len(words) < 4 or not sentence[0].isupper() and not sentence[0].isdigit():
        return None
    if sentence[-1] not in ".!?\"'" or _RE_MARKUP.search(sentence) or _RE_HOLES.search(sentence):
        return None
    if sentence.count("(") != sentence.count(")") or sentence.count('"') % 2:
        return None
    letters = sum(ch.isalpha() for ch in sentence)
    if letters < 0.7 * len(sentence.replace(" ", "")):
        return None  # mostly numbers / symbols: tables, coordinates, lists of dates
    if sum(not ch.isascii() for ch in sentence) > 0.1 * len(sentence):
        return None  # long non-Latin glosses
    return sentence


def _article_paragraphs(text: str) -> Iterator[list[str | None]]:
    """Paragraphs of one filtered article as lists of sentences (None = dropped sentence)."""
    text = _RE_QUOTES.sub("", text).replace("\xa0", " ")
    for block in re.split(r"\n\s*\n|\n(?=[=*#:;|!{])", text):
        block = " ".join(line.strip() for line in block.splitlines()).strip()
        if not block or block[0] in "=*#:;|!{}[<":
            continue  # headings, lists, tables, leftover templates
        yield [_clean_sentence(s) for s in _split_sentences(block)]


@functools.lru_cache(maxsize=1)
def _wiki_paragraphs() -> tuple[tuple[str | None, ...], ...]:
    """Parse the bundled Wikipedia dump once: article paragraphs as sentence tuples."""
    # Deferred import: gensim.corpora pulls in scipy and friends.
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    paragraphs: list[tuple[str | None, ...]] = []
    with bz2.open(_gensim_file(WIKI_FILE), "rb") as handle:
        for _title, raw, _pageid in extract_pages(handle, filter_namespaces=("0",)):
            if not raw or raw.lstrip()[:9].upper() == "#REDIRECT":
                continue
            for sentences in _article_paragraphs(filter_wiki(raw)):
                paragraphs.append(tuple(sentences))
    return tuple(paragraphs)


@functools.lru_cache(maxsize=8)
def _wiki_chunks(max_words: int, min_words: int) -> tuple[str, ...]:
    """Pack consecutive clean sentences of each paragraph into chunks of <= max_words words."""
    chunks: list[str] = []
    for paragraph in _wiki_paragraphs():
        current: list[str] = []
        n_words = 0

        def flush() -> None:
            nonlocal current, n_words
            if n_words >= min_words:
                chunks.append(" ".join(current))
            current, n_words = [], 0

        for sentence in paragraph:
            if sentence is None:
                flush()  # never glue text across a dropped sentence
                continue
            length = len(sentence.split())
            if length > max_words:
                flush()  # a sentence longer than a chunk is skipped, not truncated
                continue
            if n_words + length > max_words:
                flush()
            current.append(sentence)
            n_words += length
        flush()
    return tuple(chunks)


def wiki_texts(limit: int | None = None, max_words: int = 100) -> list[str]:
    """Clean English Wikipedia prose chunks of at most ``max_words`` whitespace words.

    From gensim's shortened 2016 enwiki dump (main-namespace articles, redirects skipped).
    Markup is stripped with gensim's ``filter_wiki``; headings, lists, tables and sentences
    with leftover markup or holes are dropped; consecutive sentences of one paragraph are
    packed into chunks (the FF-blocks paper used Wikipedia sequences of up to 128 subword
    tokens, hence ~100 words).  Chunks shorter than 8 words are dropped.  Deterministic
    order; the parse (~3 s) is cached in memory.
    """
    if isinstance(max_words, bool) or not isinstance(max_words, int) or max_words < 1:
        raise BadInput(f"max_words must be a positive integer, got {max_words!r}")
    _check_limit(limit)
    return _take(list(_wiki_chunks(max_words, min(8, max_words))), limit)


# --------------------------------------------------------------------------------------
# Lee background news corpus
# --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _lee_all() -> tuple[str, ...]:
    """Non-empty stripped lines of lee_background.cor."""
    with open(_gensim_file(LEE_FILE), encoding="utf-8", errors="replace") as handle:
        return tuple(line.strip() for line in handle if line.strip())


def lee_background(limit: int | None = None) -> list[str]:
    """Lee background news texts (one Australian news article per line, ~300 lines)."""
    return _take(list(_lee_all()), limit)


# --------------------------------------------------------------------------------------
# local files
# --------------------------------------------------------------------------------------


def _existing_file(path: str | os.PathLike[str]) -> Path:
    """Resolve ``path`` to an existing regular file or raise a readable error."""
    p = Path(path).expanduser()
    if not p.exists():
        raise BadInput(f"file not found: {str(p)!r}")
    if not p.is_file():
        raise BadInput(f"not a regular file: {str(p)!r}")
    return p


def _read_text_file(p: Path) -> str:
    """Whole file as text (UTF-8, BOM tolerated), with a readable error for other encodings."""
    try:
        content = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{p}: not valid UTF-8 (byte {exc.start}); re-save the file as UTF-8") from exc
    if not content.strip():
        raise BadInput(f"{p}: the file is empty")
    return content


def _jsonl_records(p: Path, content: str) -> Iterator[tuple[int, Any]]:
    """(line number, decoded JSON value) for each non-blank line, or a JSON array's items."""
    stripped = content.lstrip()
    if p.suffix.lower() == ".json" and stripped.startswith("["):
        try:
            array = json.loads(content)
        except json.JSONDecodeError:
            array = None  # fall through: maybe JSON lines whose first record is an array
        if isinstance(array, list):
            yield from enumerate(array, start=1)
            return
    for lineno, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInput(
                f"{p}, line {lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                "expected one JSON object (or string) per line"
            ) from None


def _field_of(p: Path, lineno: int, record: Any, field: str, what: str = "field") -> Any:
    """``record[field]`` with errors that name the line and the fields that do exist."""
    if isinstance(record, dict):
        if field not in record:
            fields = ", ".join(repr(k) for k in record) or "none"
            raise BadInput(f"{p}, line {lineno}: no {what} {field!r}; fields on this line: {fields}")
        return record[field]
    raise BadInput(f"{p}, line {lineno}: expected a JSON object with a {field!r} {what}, got {type(record).__name__}")


def _warn_skipped(p: Path, skipped: int) -> None:
    """One warning for all empty records that were dropped."""
    if skipped:
        warnings.warn(
            f"{p}: skipped {skipped} empty record{'s' if skipped != 1 else ''}",
            stacklevel=3,
        )


def _read_table(p: Path) -> Any:
    """CSV/TSV as a pandas DataFrame with empty cells as empty strings."""
    import pandas as pd  # deferred: only needed for tabular files

    try:
        return pd.read_csv(
            p, sep="\t" if p.suffix.lower() == ".tsv" else ",", keep_default_na=False,
            encoding="utf-8-sig",
        )  # fmt: skip
    except pd.errors.EmptyDataError:
        raise BadInput(f"{p}: the file is empty") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise BadInput(f"{p}: cannot parse as {p.suffix.lstrip('.').upper()}: {exc}") from None


def read_texts(path: str | os.PathLike[str], field: str = "text", limit: int | None = None) -> list[str]:
    """Texts from a local file: one per non-empty line (.txt) or per JSON line (.jsonl/.json).

    JSON lines may be objects (the text is taken from ``field``) or bare strings.  A ``.json``
    file holding a single JSON array is accepted too, and so is a ``.csv``/``.tsv`` with a
    ``field`` column.  Empty records are skipped with a warning; malformed input raises a
    ``ValueError`` that names the line.
    """
    limit = _check_limit(limit)
    p = _existing_file(path)
    suffix = p.suffix.lower()
    texts: list[str] = []
    skipped = 0

    if suffix in _CSV_SUFFIXES:
        frame = _read_table(p)
        if field not in frame.columns:
            cols = ", ".join(repr(str(c)) for c in frame.columns)
            raise BadInput(f"{p}: no column {field!r}; columns: {cols}")
        if frame.empty:
            raise BadInput(f"{p}: the file has a header but no rows")
        for value in frame[field]:
            text = str(value).strip()
            if text:
                texts.append(text)
            else:
                skipped += 1
            if limit is not None and len(texts) >= limit:
                break
    elif suffix in _JSONL_SUFFIXES:
        for lineno, record in _jsonl_records(p, _read_text_file(p)):
            value = record if isinstance(record, str) else _field_of(p, lineno, record, field)
            if value is None:
                value = ""
            if not isinstance(value, str):
                raise BadInput(f"{p}, line {lineno}: field {field!r} must be a string, got {type(value).__name__}")
            if value.strip():
                texts.append(value.strip())
            else:
                skipped += 1
            if limit is not None and len(texts) >= limit:
                break
    else:
        # .txt and anything else: one sequence per line.
        for line in _read_text_file(p).splitlines():
            if line.strip():
                texts.append(line.strip())
                if limit is not None and len(texts) >= limit:
                    break
        # Blank lines separate records in a .txt file, so they are not "skipped records".

    _warn_skipped(p, skipped)
    if not texts and limit != 0:
        raise BadInput(f"{p}: no non-empty texts found")
    return texts


def _labels_to_ints(raw: list[Any]) -> tuple[list[int], list[str]]:
    """Map raw labels to ints: integer labels stay, anything else is indexed in sorted order."""

    def is_int(v: Any) -> bool:
        if isinstance(v, bool):
            return False
        if isinstance(v, int):
            return True
        return isinstance(v, float) and v.is_integer()  # pandas may read ints as floats

    if raw and all(is_int(v) for v in raw):
        ints = [int(v) for v in raw]
        return ints, [str(v) for v in ints]
    names = [str(v).strip() for v in raw]
    index = {name: i for i, name in enumerate(sorted(set(names)))}
    return [index[n] for n in names], names


def read_labelled(
    path: str | os.PathLike[str],
    text_field: str = "text",
    label_field: str = "label",
    limit: int | None = None,
    pair_field: str | None = None,
) -> list[LabelledText]:
    """Labelled texts from a CSV/TSV (pandas) or JSONL file with text and label columns.

    Integer labels are kept as they are; string labels are mapped to 0..k-1 in sorted order
    and kept as ``label_name``.  Rows with empty text are skipped with a warning.
    pair_field: the column of a sentence pair's second text (rows where it is empty are skipped too).
    """
    limit = _check_limit(limit)
    p = _existing_file(path)
    suffix = p.suffix.lower()
    rows: list[tuple[str, Any]] = []
    skipped = 0

    def missing_label(where: str) -> BadInput:
        return BadInput(f"{p}, {where}: the label {label_field!r} is empty")

    if suffix in _CSV_SUFFIXES:
        frame = _read_table(p)
        missing = [c for c in (text_field, label_field, pair_field) if c is not None and c not in frame.columns]
        if missing:
            cols = ", ".join(repr(str(c)) for c in frame.columns)
            raise BadInput(f"{p}: no column {', '.join(map(repr, missing))}; columns: {cols}")
        if frame.empty:
            raise BadInput(f"{p}: the file has a header but no rows")
        pairs = frame[pair_field] if pair_field else [None] * len(frame)
        for row_no, (text, label, pair) in enumerate(
            zip(frame[text_field], frame[label_field], pairs),
            start=2,  # line 1 is the header
        ):
            text = str(text).strip()
            pair = None if pair_field is None else ("" if pair is None or pair != pair else str(pair).strip())
            if not text or pair == "":
                skipped += 1
                continue
            if isinstance(label, str) and not label.strip():
                raise missing_label(f"line {row_no}")
            rows.append((text, label.item() if hasattr(label, "item") else label, pair))
            if limit is not None and len(rows) >= limit:
                break
    elif suffix in _JSONL_SUFFIXES:
        for lineno, record in _jsonl_records(p, _read_text_file(p)):
            text = _field_of(p, lineno, record, text_field)
            label = _field_of(p, lineno, record, label_field)
            text = "" if text is None else str(text).strip()
            pair = None
            if pair_field is not None:
                pair = _field_of(p, lineno, record, pair_field)
                pair = "" if pair is None else str(pair).strip()
            if not text or pair == "":
                skipped += 1
                continue
            if label is None or (isinstance(label, str) and not label.strip()):
                raise missing_label(f"line {lineno}")
            if not isinstance(label, (str, int, float)):
                raise BadInput(f"{p}, line {lineno}: label must be a string or an integer, got {type(label).__name__}")
            rows.append((text, label, pair))
            if limit is not None and len(rows) >= limit:
                break
    else:
        raise BadInput(f"{p}: unsupported file type {suffix or '(none)'!r} for labelled data; use .csv, .tsv or .jsonl")

    _warn_skipped(p, skipped)
    if not rows and limit != 0:
        raise BadInput(f"{p}: no non-empty texts found")
    labels, names = _labels_to_ints([label for _, label, _ in rows])
    return [
        LabelledText(text=text, label=label, label_name=name, text_pair=pair)
        for (text, _, pair), label, name in zip(rows, labels, names)
    ]


# --------------------------------------------------------------------------------------
# Hugging Face datasets (optional, online)
# --------------------------------------------------------------------------------------


def _offline_hint(reason: str) -> RuntimeError:
    """The RuntimeError raised whenever the dataset hub cannot be used."""
    return RuntimeError(
        f"the Hugging Face dataset hub is unreachable ({reason}); use an offline corpus "
        f"({', '.join(repr(c) for c in CORPORA)}, e.g. 'wiki' or 'pang_lee') or a local "
        ".txt/.jsonl file instead"
    )


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One probe through huggingface_hub's session (ctxmix.hub), so mirrors and proxies count."""
    from ctxmix.hub import hub_reachable

    return hub_reachable(timeout)


def hf_dataset_texts(name: str, split: str, field: str, limit: int | None = None) -> list[str]:
    """Texts of one field of a Hugging Face dataset split (needs ``datasets`` and a network).

    With ``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1`` set, the network probe is skipped
    and ``datasets`` may serve the split from its local cache.
    """
    limit = _check_limit(limit)
    try:
        import datasets  # type: ignore[import-not-found]  # optional, not a dependency
    except ImportError:
        raise _offline_hint("the 'datasets' package is not installed") from None
    from ctxmix.hub import endpoint, offline

    if not offline() and not _hub_reachable():
        raise _offline_hint(f"cannot connect to {endpoint()}")
    try:
        data = datasets.load_dataset(name, split=split)
    except Exception as exc:  # noqa: BLE001 - any hub/cache failure means "not available"
        raise _offline_hint(f"loading {name!r} split {split!r} failed: {exc}") from exc
    if field not in data.column_names:
        raise BadInput(
            f"dataset {name!r} split {split!r} has no field {field!r}; fields: {', '.join(data.column_names)}"
        )
    texts: list[str] = []
    for value in data[field] if limit is None else data.select(range(min(limit, len(data))))[field]:
        if isinstance(value, str) and value.strip():
            texts.append(value.strip())
    return texts


# --------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------


def corpus(name: str, limit: int | None = None) -> list[str]:
    """Texts of a named corpus: 'wiki', 'pang_lee', 'lee', a file path, or 'hf:NAME:SPLIT:FIELD'."""
    limit = _check_limit(limit)
    valid = (
        f"valid names: {', '.join(repr(c) for c in CORPORA)}, a path to a .txt/.jsonl/.csv "
        "file, or 'hf:<dataset>:<split>:<field>'"
    )
    if not isinstance(name, (str, os.PathLike)):
        raise BadInput(f"corpus name must be a string, got {type(name).__name__}; {valid}")
    key = os.fspath(name).strip()
    if key == "wiki":
        return wiki_texts(limit)
    if key == "pang_lee":
        return [item.text for item in pang_lee(limit)]
    if key == "lee":
        return lee_background(limit)
    if key.startswith("hf:"):
        parts = key[3:].split(":", 1)
        rest = parts[1].rsplit(":", 1) if len(parts) == 2 else []
        if len(rest) != 2 or not all([parts[0], *rest]):
            raise BadInput(f"malformed hub corpus {key!r}: expected 'hf:<dataset>:<split>:<field>'")
        return hf_dataset_texts(parts[0], rest[0], rest[1], limit)
    if key and Path(key).expanduser().is_file():
        return read_texts(key, limit=limit)
    looks_like_path = (
        os.sep in key
        or "/" in key
        or Path(key).suffix.lower() in (_TEXT_SUFFIXES | _JSONL_SUFFIXES | _CSV_SUFFIXES) - {""}
    )
    if looks_like_path:
        raise BadInput(f"unknown corpus {key!r}: no such file; {valid}")
    raise BadInput(f"unknown corpus {key!r}; {valid}")
