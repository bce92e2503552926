"""The sources of a context: how a context is split (sentences, paragraphs, documents, or given
character spans) and how an ablated context is rebuilt from the kept sources (docs/context.md); a
conversation's sources (`ChatSources`: every attributed message split the same way). Which prompt tokens
belong to which source: `ctxmix.methods.context.prompt`.

A context is one string; a list of documents is joined with `DOCUMENT_SEPARATOR`. A source is a
character span (start, end) of that string with no surrounding whitespace. The text before a source
and after the previous one is its *separator* (ContextCite's rule: each source carries the separator
that precedes it); the text after the last source is the *trail*.

Rebuilding the context for a keep-mask v:

- `rule="official"` (the official ContextCite package): kept parts joined as part_{k1} + sep_{k2} + part_{k2}
  + ..., i.e. the first kept part loses its separator and every other kept part keeps its own; the
  text before the first source and after the last is dropped even when everything is kept.
- `rule="ctxmix"` (default; docs/context.md, "Choices where the papers leave room"): the same, except that the
  text before the first source (the first separator) and the trail are kept as fixed, non-ablatable context
  padding, so that rebuilding with every source kept gives the context exactly.

Sentences come from pysbd (rule-based, offline; `SPLITTER`), split per line first as ContextCite
and AT2 do, so a sentence never crosses a newline; a part with no letter (a list number "1.", a
rule "----") is not a source (AT2's `is_sentence`): it stays in the separator.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ctxmix.errors import BadInput

DOCUMENT_SEPARATOR = "\n\n"
SOURCE_KINDS = ("sentence", "paragraph", "document")

# per-token labels of a prompt: a source's index (>= 0) or one of these buckets (never sources, never dropped)
TEMPLATE, QUERY, SEPARATOR = -1, -2, -3
BUCKETS = {TEMPLATE: "template", QUERY: "query", SEPARATOR: "separators"}


def splitter_info() -> dict:
    """The sentence splitter's name and version (they change the sources, hence every number)."""
    try:
        from importlib.metadata import version

        v = version("pysbd")
    except Exception:  # noqa: BLE001 - not installed: reported, refused when sentences are asked for
        v = None
    return {"name": "pysbd", "version": v}


@dataclass
class Sources:
    """A context and its sources. text: the context string; spans: (start, end) per source, in text
    order, not overlapping; kind: "sentence", "paragraph", "document" or "spans"; splitter: who split it."""

    text: str
    spans: list[tuple[int, int]]
    kind: str
    splitter: dict = field(default_factory=dict)

    @property
    def texts(self) -> list[str]:
        return [self.text[s:e] for s, e in self.spans]

    def __len__(self) -> int:
        return len(self.spans)

    @property
    def separators(self) -> list[str]:
        """The text before each source, back to the previous source's end (the first: from 0)."""
        ends = [0] + [e for _, e in self.spans[:-1]]
        return [self.text[a:s] for a, (s, _) in zip(ends, self.spans)]

    @property
    def trail(self) -> str:
        return self.text[self.spans[-1][1] :] if self.spans else self.text

    def rebuild(self, keep, rule: str = "ctxmix") -> str:
        """The context with only the sources where keep (d,) is true (see the module docstring)."""
        keep = np.asarray(keep, dtype=bool)
        if keep.shape != (len(self),):
            raise ValueError(f"a mask of {keep.shape} for {len(self)} sources")
        parts, seps = self.texts, self.separators
        kept = [i for i in range(len(self)) if keep[i]]
        out = "".join(parts[i] if k == 0 else seps[i] + parts[i] for k, i in enumerate(kept))
        if rule == "official":
            return out
        if rule != "ctxmix":
            raise BadInput(f"rule must be 'ctxmix' or 'official', got {rule!r}")
        return seps[0] + out + self.trail if kept else seps[0] + self.trail

    def trimmed(self) -> Sources:
        """The sources with the text before the first and after the last dropped: the context the official
        ContextCite package shows the model (its rebuild with every source kept)."""
        a, b = self.spans[0][0], self.spans[-1][1]
        return Sources(self.text[a:b], [(s - a, e - a) for s, e in self.spans], self.kind, self.splitter)

    def source_of(self, char: int) -> int:
        """The source holding character `char`, or SEPARATOR."""
        for i, (s, e) in enumerate(self.spans):
            if s <= char < e:
                return i
            if char < s:
                break
        return SEPARATOR


# ---------------------------------------------------------------- splitting


def _lines(text: str):
    """(offset, line) for every line of text, without its line break (str.splitlines' breaks)."""
    pos = 0
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
        yield pos, body
        pos += len(line)


def _is_sentence(part: str) -> bool:
    """A part that holds a letter (AT2 keeps parts with a character outside whitespace, digits and
    punctuation; a letter is what that means for text)."""
    return any(ch.isalpha() for ch in part)


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Sentence spans of `text`: per line, pysbd's segments (clean=False, so they are substrings),
    stripped and found in order; parts without a letter are left to the separators."""
    try:
        import pysbd
    except ImportError:  # pragma: no cover - a dependency in requirements.txt
        raise BadInput("sources='sentence' needs pysbd (pip install pysbd==0.3.4)") from None
    seg = pysbd.Segmenter(language="en", clean=False)
    spans: list[tuple[int, int]] = []
    for off, line in _lines(text):
        if not line.strip():
            continue
        cur = 0
        for part in seg.segment(line):
            p = part.strip()
            if not p:
                continue
            at = line.find(p, cur)
            if at < 0:  # pysbd returned text that is not in the line (it should not, with clean=False)
                raise RuntimeError(f"pysbd returned a segment that is not in the text: {p!r}")
            cur = at + len(p)
            if _is_sentence(p):
                spans.append((off + at, off + cur))
    return spans


def first_sentence(text: str) -> str:
    """The first sentence of an answer `text` as the sentence sources split it (the whole text when it is one).
    Split after a word ("Answer: "), as the answer is read, so one that opens with a number ("4817. A rare
    calm ...") is not taken for a numbered list's "1. " (pysbd keeps such an item with what follows)."""
    head = "Answer: "
    spans = sentence_spans(head + text)
    first = (head + text)[spans[0][0] : spans[0][1]][len(head) :] if spans and spans[0][0] == 0 else ""
    return first if first.strip() and text.startswith(first) else text


def cut_at_stop(text: str, stop: str | None) -> str:
    """A generated response cut where a base model's answer ends (it never emits end-of-sequence: it goes on
    with more text of the context or another "Query:"): stop "line", the text up to its first line break;
    "sentence", its first sentence (which also ends at a line break); None, the whole text. Leading whitespace
    is kept (the response's own first token)."""
    lead = len(text) - len(text.lstrip())
    body = text[lead:]
    if stop == "line":
        body = body.split("\n", 1)[0]
    elif stop == "sentence":
        body = first_sentence(body)
    return text[:lead] + body


_BLANK = re.compile(r"\n[ \t\r\f\v]*\n")


def paragraph_spans(text: str) -> list[tuple[int, int]]:
    """Paragraphs: text between blank lines, stripped."""
    spans, start = [], 0
    for m in list(_BLANK.finditer(text)) + [None]:
        end = len(text) if m is None else m.start()
        chunk = text[start:end]
        if chunk.strip():
            lead = len(chunk) - len(chunk.lstrip())
            spans.append((start + lead, start + len(chunk.rstrip())))
        if m is not None:
            start = m.end()
    return spans


def check_spans(text: str, spans) -> list[tuple[int, int]]:
    """Explicit source spans: pairs of whole numbers 0 <= start < end <= len(text), in text order, not
    overlapping, each holding some non-whitespace text."""
    if isinstance(spans, (str, bytes)) or not hasattr(spans, "__iter__"):
        raise BadInput("sources must be 'sentence', 'paragraph', 'document' or a list of (start, end) spans")
    out: list[tuple[int, int]] = []
    for k, sp in enumerate(spans):
        ok = isinstance(sp, (tuple, list)) and len(sp) == 2
        ok = ok and all(not isinstance(x, bool) and isinstance(x, (int, np.integer)) for x in sp)
        if not ok:
            raise BadInput(f"source span {k} must be a pair of whole numbers (start, end), got {sp!r}")
        s, e = int(sp[0]), int(sp[1])
        if not 0 <= s < e <= len(text):
            raise BadInput(
                f"source span {k} ({s}, {e}) is outside the context's {len(text)} characters "
                "(need 0 <= start < end <= len(context))"
            )
        if out and s < out[-1][1]:
            raise BadInput(
                f"source span {k} ({s}, {e}) overlaps or precedes span {k - 1} {out[-1]}: give spans in text "
                "order, not overlapping"
            )
        if not text[s:e].strip():
            raise BadInput(f"source span {k} ({s}, {e}) holds only whitespace")
        out.append((s, e))
    return out


def _check_text(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadInput(f"the {what} holds a character that is not valid Unicode at position {e.start}") from None


def split_spans(text: str, unit: str) -> tuple[list[tuple[int, int]], dict]:
    """(spans, splitter info) of `text` by `unit`: "sentence", "paragraph" or "document" (the whole text,
    stripped, one source)."""
    if unit not in SOURCE_KINDS:
        raise BadInput(f"sources must be one of {', '.join(SOURCE_KINDS)} or a list of (start, end) spans")
    if unit == "sentence":
        return sentence_spans(text), splitter_info()
    if unit == "paragraph":
        return paragraph_spans(text), {}
    lead = len(text) - len(text.lstrip())
    return ([(lead, len(text.rstrip()))] if text.strip() else []), {}


def make_sources(context, sources="sentence") -> Sources:
    """The context string and its sources. context: a string, or a list of documents (joined with
    DOCUMENT_SEPARATOR; each a source with sources="document"). sources: "sentence", "paragraph",
    "document", or a list of (start, end) character spans of the context string."""
    if isinstance(context, str):
        text, docs = context, None
    elif isinstance(context, (list, tuple)) and all(isinstance(d, str) for d in context):
        if not context or not any(d.strip() for d in context):
            raise BadInput("the context is empty: give a string or a list of documents with some text")
        empty = [k for k, d in enumerate(context) if not d.strip()]
        if empty:
            raise BadInput(f"document {empty[0]} of the context is empty")
        docs = list(context)
        text = DOCUMENT_SEPARATOR.join(docs)
    else:
        raise BadInput(f"context must be a string or a list of document strings, got {type(context).__name__}")
    if not text.strip():
        raise BadInput("the context is empty: give the text the response should be attributed to")
    _check_text(text, "context")
    info: dict = {}
    if isinstance(sources, str):
        if sources not in SOURCE_KINDS:
            raise BadInput(f"sources must be one of {', '.join(SOURCE_KINDS)} or a list of (start, end) spans")
        if sources == "document":
            if docs is None:
                raise BadInput("sources='document' needs the context as a list of documents (one string each)")
            spans, pos = [], 0
            for d in docs:
                lead = len(d) - len(d.lstrip())
                spans.append((pos + lead, pos + len(d.rstrip())))
                pos += len(d) + len(DOCUMENT_SEPARATOR)
        else:
            spans, info = split_spans(text, sources)
        kind = sources
    else:
        spans, kind = check_spans(text, sources), "spans"
    if not spans:
        raise BadInput(f"the context has no {kind} with a letter in it: nothing to attribute to")
    if len(spans) < 2:
        raise BadInput(
            f"the context has one {kind} source only: there is nothing to compare it with; give a longer "
            "context or a finer split (sources='sentence' or explicit spans)"
        )
    return Sources(text=text, spans=spans, kind=kind, splitter=info)


# ---------------------------------------------------------------- conversations

MESSAGE_KEYS = ("attribute", "sources")  # ctxmix's own keys of a message: never sent to the chat template


def check_messages(messages) -> list[dict]:
    """Copies of the messages, checked: a non-empty list of dicts, each with a string "role" and a string
    "content"; "attribute" (default True) says whether the content's text is split into sources, "sources"
    (optional) gives them as (start, end) character spans of the content instead of the unit's split."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise BadInput("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadInput(f"message {k} must be a dict with a string 'role' and a string 'content', got {m!r}")
        if not isinstance(m.get("attribute", True), bool):
            raise BadInput(f"message {k}: 'attribute' must be True or False, got {m['attribute']!r}")
        _check_text(m["content"], f"message {k}")
        out.append(dict(m))
    return out


def transcript_starts(messages) -> list[int]:
    """Where each message's content starts in a conversation's transcript (`ChatSources.text`)."""
    starts, pos = [], 0
    for m in messages:
        head = f"{m['role']}: "
        starts.append(pos + len(head))
        pos += len(head) + len(m["content"]) + len(DOCUMENT_SEPARATOR)
    return starts


@dataclass
class ChatSources:
    """The sources of a conversation: the content of every attributed message split by one unit.

    messages: the messages (role, content, ...); parts[k]: the `Sources` of message k's content, or None
    (a message with "attribute": False, or no source in it). Derived: `text`, a transcript ("role: content"
    per message, blank lines between) that the views shade; `spans`, each source's span in it; `message_of`
    (d,), each source's message; `starts` (K,), where each message's content starts in `text`. Sources
    are numbered in message order."""

    messages: list[dict]
    parts: list[Sources | None]
    kind: str
    splitter: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.text = DOCUMENT_SEPARATOR.join(f"{m['role']}: {m['content']}" for m in self.messages)
        self.starts = transcript_starts(self.messages)
        self.spans: list[tuple[int, int]] = []
        self.message_of: list[int] = []
        for k, part in enumerate(self.parts):
            if part is not None:
                self.spans += [(self.starts[k] + a, self.starts[k] + b) for a, b in part.spans]
                self.message_of += [k] * len(part)

    @property
    def texts(self) -> list[str]:
        return [self.text[s:e] for s, e in self.spans]

    def __len__(self) -> int:
        return len(self.spans)

    def rebuild(self, keep, rule: str = "ctxmix") -> list[str]:
        """Every message's content with only the sources where keep (d,) is true (`Sources.rebuild`'s
        ctxmix rule in each message: its text around the sources stays)."""
        keep = np.asarray(keep, dtype=bool)
        if keep.shape != (len(self),):
            raise ValueError(f"a mask of {keep.shape} for {len(self)} sources")
        if rule != "ctxmix":
            raise BadInput("a conversation's sources are rebuilt by ctxmix's rule only (compat=False)")
        out, i = [], 0
        for m, part in zip(self.messages, self.parts):
            if part is None:
                out.append(m["content"])
                continue
            out.append(part.rebuild(keep[i : i + len(part)]))
            i += len(part)
        return out


def make_chat_sources(messages, sources="sentence", spans_of=None) -> ChatSources:
    """The sources of a conversation: each attributed message's content split by `sources` ("sentence",
    "paragraph" or "document": the whole message one source), or its own "sources" spans. spans_of:
    {message index: spans} given instead (a saved attribution's). At least two sources in all."""
    messages = check_messages(messages)
    if not isinstance(sources, str):
        raise BadInput("with messages=, sources is a unit: 'sentence', 'paragraph' or 'document' (a whole message)")
    parts: list[Sources | None] = []
    info: dict = {}
    for k, m in enumerate(messages):
        if spans_of is not None:
            spans = [tuple(sp) for sp in spans_of.get(k, [])]
        elif "sources" in m and m.get("attribute", True):
            try:
                spans = check_spans(m["content"], m["sources"])
            except BadInput as e:
                raise BadInput(f"message {k}: {e}") from None
        elif m.get("attribute", True):
            spans, info = split_spans(m["content"], sources)
        else:
            spans = []
        parts.append(Sources(m["content"], spans, sources, info) if spans else None)
    out = ChatSources(messages, parts, sources, info)
    if len(out) < 2:
        raise BadInput(
            f"the messages hold {len(out)} {sources} source(s) to attribute to: give more text, a finer unit, or "
            "mark fewer messages 'attribute': False"
        )
    return out
