"""The prompt and the response of a context attribution (docs/context.md, "The prompt, the sources, the
response").

The messages: `attribute_context(model, context, query)` sends one user message, `PLAIN_FORMAT` ("Context:
{context}\\n\\nQuery: {query}", ContextCite's and AT2's), or the context alone when there is no query (a
continuation, or an instruction the caller placed in the context); `attribute_context(model,
messages=[...])` sends a conversation (system, user, assistant, tool turns; the last is the one answered).

The prompt is the chat template (the tokenizer's, or `chat_template=`, a Jinja string) rendered with the
generation prompt and tokenised *as one string*, exactly as `tokenizer.apply_chat_template(messages,
add_generation_prompt=True, tokenize=True)` does (nothing added: the template writes its own BOS), so the
model reads the prompt it would read in deployment; a template that puts a space before the content (Llama-2
and Mistral's "[INST] ") keeps the space merged into the next word. The one difference: text inside a
message that spells a special token (`<|im_start|>`) is tokenised as text (the template's own special tokens
stay special), as `apply_chat_template(..., sanitize_control_tokens=True)` does. Without a chat template (a
base model, or template="plain") the prompt is the tokenizer's BOS (if it has one) and the message's text
(several messages: "Role: content" blocks and a final "Assistant:").

Sources are found by character offsets: each message's content is located in the rendered text (in order,
its stripped text, so templates that trim the content (Llama-3's `| trim`), wrap it (Llama-2's `<<SYS>>`),
move it (Mistral's system text before the last user turn) or fold it into another turn (Gemma's system
text) keep their sources), and the tokenizer's offset mapping gives each token its characters. A token
belongs to the source holding its first non-space character.

compat=True (the official ContextCite package): the context/query form only; the prompt is built from the
official rebuild (the text before the first source and after the last dropped, even with every source
kept), and text that spells a special token is refused (the official package would parse it as one).

The response (default): the generated ids without a trailing end-of-sequence token, or the given text
tokenised on its own (special tokens not parsed). compat=True: the official re-tokenisation of prompt text
+ decoded response, end-of-sequence included (docs/context.md, "Choices where the papers leave room").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ctxmix.engine.models import Model
from ctxmix.errors import BadInput
from ctxmix.methods.context.sources import (
    MESSAGE_KEYS,
    QUERY,
    SEPARATOR,
    TEMPLATE,
    ChatSources,
    Sources,
    make_chat_sources,
    make_sources,
    transcript_starts,
)

PLAIN_FORMAT = "Context: {context}\n\nQuery: {query}"


@dataclass
class Prompt:
    """A tokenised prompt: ids (P,), labels (P,) (a source index or a bucket of `ctxmix.methods.context.sources`)."""

    ids: list[int]
    labels: np.ndarray


def _core(text: str) -> tuple[int, int]:
    """Where the stripped text sits in `text`: (start, end)."""
    return len(text) - len(text.lstrip()), len(text.rstrip())


def label_tokens(text: str, offsets, regions) -> np.ndarray:
    """Per token of a prompt, its source index or bucket. text: the rendered prompt; offsets (P,): each token's
    character span in it (None for a token with no text, a BOS added as an id); regions: (start, end, label)
    in text, label a source index (>= 0), SEPARATOR (the attributed text of a message: what no source holds)
    or QUERY (the query, and messages not attributed). A token belongs to the region holding its first
    non-space character (" The" to The's source); a whitespace-only token is a separator inside attributed
    text, the template elsewhere; tokens outside every region are the template's."""
    out = np.full(len(offsets), TEMPLATE, dtype=np.int64)
    rank = {SEPARATOR: 1, QUERY: 2}  # a source first, then the attributed text, then the query
    ordered = sorted(regions, key=lambda r: rank.get(r[2], 0))
    # each character's label, the first region of `ordered` holding it winning (filled last), and where the
    # attributed text lies: one pass over the characters instead of one over the regions per token
    size = max([len(text)] + [int(e) for _, e, _ in regions]) + 1
    char_label = np.full(size, TEMPLATE, dtype=np.int64)
    for s_, e_, lab in reversed(ordered):
        char_label[s_:e_] = lab
    in_separator = np.zeros(size, dtype=bool)
    for s_, e_, lab in regions:
        if lab == SEPARATOR:
            in_separator[s_:e_] = True
    for k, off in enumerate(offsets):
        if off is None or off[1] <= off[0]:
            continue
        a, b = int(off[0]), int(off[1])
        piece = text[a:b]
        if not piece.strip():
            if in_separator[a]:
                out[k] = SEPARATOR
            continue
        out[k] = char_label[a + len(piece) - len(piece.lstrip())]
    return out


class PromptBuilder:
    """Builds the prompt ids of a context (the full one, or an ablated rebuild): the context/query form
    (`query`) or a conversation (`messages`, whose contents a rebuild replaces)."""

    def __init__(
        self,
        model: Model,
        query: str | None = None,
        template: str | None = None,
        compat: bool = False,
        *,
        messages: list[dict] | None = None,
        chat_template: str | None = None,
    ):
        tok = model.tokenizer
        self.tok, self.query, self.compat = tok, query, compat
        self.messages = None if messages is None else [dict(m) for m in messages]
        if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
            raise BadInput("chat_template must be a Jinja template string (or None: the tokenizer's)")
        if template not in (None, "chat", "plain"):
            raise BadInput(
                f"template must be None (the chat template when the model has one), 'chat' or 'plain', got {template!r}"
            )
        if template == "plain" and chat_template is not None:
            raise BadInput("template='plain' and a chat_template contradict each other: give one")
        has_chat = chat_template is not None or bool(getattr(tok, "chat_template", None))
        if template == "chat" and not has_chat:
            raise BadInput(
                f"{model.name}'s tokenizer has no chat template; give chat_template= or use template='plain' (or None)"
            )
        self.kind = template or ("chat" if has_chat else "plain")
        self.chat_template = chat_template
        bos = getattr(tok, "bos_token_id", None)
        self.bos_ids: list[int] = [int(bos)] if self.kind == "plain" and isinstance(bos, int) else []
        # every string the tokenizer would read as one added token (longest first)
        added = {str(t) for t in getattr(tok, "all_special_tokens", []) if t}
        added |= {str(getattr(t, "content", t)) for t in getattr(tok, "added_tokens_decoder", {}).values()}
        spelled = sorted((t for t in added if t.strip()), key=len, reverse=True)
        self._spelled = re.compile("|".join(map(re.escape, spelled))) if spelled else None

    @property
    def info(self) -> dict:
        return {
            "template": self.kind,
            "format": "messages" if self.messages is not None else "{context}" if self.query is None else PLAIN_FORMAT,
            "chat_template": self.chat_template,
            "bos": self.bos_ids,
            "tokenised": "whole string (compat)"
            if self.compat
            else "whole string; special-token text in the messages kept as text",
        }

    # ------------------------------------------------------------ the messages and their text

    def body(self, context: str) -> tuple[str, tuple[int, int], tuple[int, int] | None]:
        """The user message for `context` (the context/query form), where the context and the query sit in it."""
        if self.query is None:
            return context, (0, len(context)), None
        head, mid = PLAIN_FORMAT.split("{context}")
        mid = mid.split("{query}")[0]
        text = head + context + mid + self.query
        cs = len(head)
        qs = cs + len(context) + len(mid)
        return text, (cs, cs + len(context)), (qs, qs + len(self.query))

    def contents(self, x) -> list[str]:
        """Every message's content for x: a (rebuilt) context string, or a list of message contents."""
        return [self.body(x)[0]] if self.messages is None else list(x)

    def turns(self, x) -> list[dict]:
        """The messages sent for x (ctxmix's own keys, such as "attribute", left out)."""
        if self.messages is None:
            return [{"role": "user", "content": self.body(x)[0]}]
        return [
            {**{k: v for k, v in m.items() if k not in MESSAGE_KEYS}, "content": c}
            for m, c in zip(self.messages, x, strict=True)
        ]

    def text(self, x) -> str:
        """The rendered prompt as text (without a BOS added as an id)."""
        turns = self.turns(x)
        if self.kind == "plain":
            if len(turns) == 1:
                return turns[0]["content"]
            return "\n\n".join(f"{t['role'].capitalize()}: {t['content']}" for t in turns) + "\n\nAssistant:"
        try:
            out = self.tok.apply_chat_template(
                turns, tokenize=False, add_generation_prompt=True, chat_template=self.chat_template
            )
        except Exception as e:  # noqa: BLE001 - jinja's TemplateError, a template's raise_exception
            raise BadInput(f"the chat template refused these messages: {type(e).__name__}: {e}") from None
        if not isinstance(out, str):
            raise BadInput("the chat template did not render to one string")
        return out

    def full(self, sources):
        """x of the full prompt: the context (compat: the official rebuild, sources only) or every content."""
        if isinstance(sources, ChatSources):
            return sources.rebuild(np.ones(len(sources), bool))
        return (sources.trimmed() if self.compat else sources).text

    # ------------------------------------------------------------ locating and tokenising

    def locate(self, text: str, contents: list[str]) -> list[int | None]:
        """Where each content's characters start in the rendered `text` (its stripped text found in message
        order; where the template moved it, anywhere not already claimed); None for an empty content."""
        out: list[int | None] = []
        claimed: list[tuple[int, int]] = []
        cur = 0
        for k, c in enumerate(contents):
            a, b = _core(c)
            core = c[a:b]
            if not core:
                out.append(None)
                continue
            at = text.find(core, cur)
            if at < 0:
                at = text.find(core)
                while at >= 0 and any(s < at + len(core) and at < e for s, e in claimed):
                    at = text.find(core, at + 1)
            if at < 0:
                raise BadInput(
                    f"the chat template changes the text of message {k}, so its sources cannot be found in the "
                    "prompt; use template='plain' or another chat_template"
                )
            claimed.append((at, at + len(core)))
            cur = at + len(core)
            out.append(at - a)
        return out

    def tokenize(self, text: str, contents: list[str], bases=None) -> tuple[list[int], list]:
        """(ids, offsets) of the rendered `text`, tokenised as one string (the template's), except that a
        special token's spelling inside a message is tokenised as text; a BOS id first without a template."""
        cuts: list[tuple[int, int]] = []
        if self._spelled is not None and any(self._spelled.search(c) for c in contents):
            bases = self.locate(text, contents) if bases is None else bases
            for c, base in zip(contents, bases):
                if base is not None:
                    a, b = _core(c)
                    cuts += [(m.start(), m.end()) for m in self._spelled.finditer(text, base + a, base + b)]
        ids, offsets, pos = [], [], 0
        for a, b in sorted(cuts) + [(len(text), len(text))]:
            for seg, start, as_text in ((text[pos:a], pos, False), (text[a:b], a, True)):
                if not seg:
                    continue
                kw = {"split_special_tokens": True} if as_text else {}
                enc = self.tok(seg, add_special_tokens=False, return_offsets_mapping=True, **kw)
                ids += list(enc["input_ids"])
                offsets += [(int(s) + start, int(e) + start) for s, e in enc["offset_mapping"]]
            pos = b
        return self.bos_ids + ids, [None] * len(self.bos_ids) + offsets

    def ids(self, x) -> list[int]:
        """The prompt ids of a (possibly ablated) context string, or of every message's (rebuilt) content."""
        return self.tokenize(self.text(x), self.contents(x))[0]

    def encode(self, sources) -> Prompt:
        """The full prompt's ids and each token's source or bucket. sources: `Sources` (the context/query
        form) or `ChatSources` (a conversation)."""
        x = self.full(sources)
        contents = self.contents(x)
        if isinstance(sources, ChatSources):
            local: list[list[tuple[int, int, int]]] = []
            i = 0
            for c, part in zip(contents, sources.parts):
                if part is None:
                    local.append([(0, len(c), QUERY)])
                    continue
                local.append([(0, len(c), SEPARATOR)] + [(s, e, i + q) for q, (s, e) in enumerate(part.spans)])
                i += len(part)
        else:
            src = sources.trimmed() if self.compat else sources
            _, (cs, ce), qrange = self.body(src.text)
            regions = [(cs, ce, SEPARATOR)] + [(cs + s, cs + e, q) for q, (s, e) in enumerate(src.spans)]
            local = [regions + ([(qrange[0], qrange[1], QUERY)] if qrange else [])]
        text = self.text(x)
        bases = self.locate(text, contents)
        ids, offsets = self.tokenize(text, contents, bases)
        regions = []
        for c, base, rs in zip(contents, bases, local):
            if base is None:
                continue
            a, b = _core(c)  # the characters the template kept
            regions += [(base + max(s, a), base + min(e, b), lab) for s, e, lab in rs if max(s, a) < min(e, b)]
        labels = label_tokens(text, offsets, regions)
        if ids != self.ids(x):  # the one-pass and the ablation paths must read the same prompt
            raise RuntimeError("the prompt's ids differ between its two tokenisations")
        return Prompt(ids=ids, labels=labels)

    def check_special_text(self, texts: dict) -> None:
        """compat=True only: refuse text that spells a special token (the whole-string tokenisation would
        parse it as one)."""
        if not self.compat:
            return
        specials = [s for s in getattr(self.tok, "all_special_tokens", []) if s]
        for what, t in texts.items():
            for s in specials:
                if t and s in t:
                    raise BadInput(
                        f"the {what} contains {s!r}, which the official ContextCite tokenisation (compat=True) would "
                        "read as a special token; remove it, or use compat=False (it is then kept as text)"
                    )


def context_message(context, query: str | None = None, sources="sentence") -> dict:
    """The context/query form as one message of a conversation: {"role": "user", "content": "Context: ...
    \\n\\nQuery: ..." (or the context alone), "sources": the context's sources as spans of that content}, so
    a system message and earlier turns can go before it (the dashboard's conversation) while the query
    stays out of the sources."""
    src = make_sources(context, sources)
    head = PLAIN_FORMAT.split("{context}")[0] if query is not None else ""
    content = src.text if query is None else PLAIN_FORMAT.format(context=src.text, query=query)
    return {"role": "user", "content": content, "sources": [[a + len(head), b + len(head)] for a, b in src.spans]}


def build_prompt(
    model: Model,
    context=None,
    query: str | None = None,
    *,
    messages=None,
    sources="sentence",
    template: str | None = None,
    chat_template: str | None = None,
    compat: bool = False,
):
    """(sources, builder) of a request: the context/query form or a conversation, checked (the context or
    the messages, not both; compat for the context/query form only; special-token text under compat)."""
    if messages is not None:
        if context is not None or query is not None:
            raise BadInput("give either messages= or context (and query), not both")
        if compat:
            raise BadInput(
                "compat=True reproduces the official ContextCite package, which takes one context and a query, "
                "not a conversation: use compat=False with messages="
            )
        chat = make_chat_sources(messages, sources)
        return chat, PromptBuilder(model, None, template, compat, messages=chat.messages, chat_template=chat_template)
    if context is None:
        raise BadInput("give a context (a string or a list of documents) or messages=")
    src = make_sources(context, sources)
    builder = PromptBuilder(model, query, template, compat, chat_template=chat_template)
    builder.check_special_text({"context": src.text, "query": query or ""})
    return src, builder


def rebuild_prompt(ca, model: Model):
    """(sources, builder) of an attribution (a live or a saved one), from what it stored."""
    info = ca.options.get("prompt") or {}
    compat = bool(ca.options.get("compat"))
    kind = str(ca.options.get("sources"))
    if info.get("format") == "messages":
        starts = transcript_starts(ca.messages)
        spans_of: dict[int, list[tuple[int, int]]] = {}
        for (a, b), k in zip(ca.source_spans, ca.source_messages):
            spans_of.setdefault(int(k), []).append((a - starts[k], b - starts[k]))
        chat = make_chat_sources(ca.messages, kind, spans_of=spans_of)
        builder = PromptBuilder(
            model, None, info.get("template"), compat, messages=chat.messages, chat_template=info.get("chat_template")
        )
        return chat, builder
    src = Sources(text=ca.context, spans=[tuple(s) for s in ca.source_spans], kind=kind)
    return src, PromptBuilder(model, ca.query, info.get("template"), compat, chat_template=info.get("chat_template"))


@dataclass
class Response:
    """ids (T,), text, offsets (T, 2): each token's character span in text; how: "given" or "generated";
    eos_dropped: whether a trailing end-of-sequence token was removed."""

    ids: list[int]
    text: str
    offsets: np.ndarray
    how: str
    eos_dropped: bool = False
    generation_seconds: float = 0.0


def _incremental_offsets(tok, ids: list[int]) -> tuple[str, np.ndarray]:
    """The decoded text of ids and each token's span in it (decoding growing prefixes of the ids, not
    re-tokenising the text)."""
    text = tok.decode(ids)
    ends, prev = [], 0
    for k in range(len(ids)):
        e = len(tok.decode(ids[: k + 1]))
        e = min(max(e, prev), len(text))  # a prefix that decodes longer (a split character) is clipped
        ends.append(e)
        prev = e
    starts = [0] + ends[:-1]
    return text, np.array(list(zip(starts, ends)), dtype=np.int64).reshape(-1, 2)


def eos_ids(model: Model) -> set[int]:
    from ctxmix.engine.generate import _eos_ids

    return _eos_ids(model)


def make_response(
    model: Model,
    builder: PromptBuilder,
    sources: Sources,
    prompt: Prompt,
    response,
    max_new_tokens: int,
    progress: bool,
) -> Response:
    """The response: `response` (a string) tokenised, or generated greedily from the prompt."""
    import time

    tok = model.tokenizer
    eos = eos_ids(model)
    seconds = 0.0
    if response is None:
        from ctxmix.engine.generate import generate

        limit = model.max_length
        if len(prompt.ids) + max_new_tokens > limit:
            raise BadInput(
                f"the prompt has {len(prompt.ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                f"{model.name}'s window of {limit} positions: shorten the context or max_new_tokens"
            )
        t0 = time.perf_counter()
        report = (lambda k, n: progress("generate", k, n)) if callable(progress) else None  # a page's bar
        g = generate(model, input_ids=prompt.ids, max_new_tokens=max_new_tokens, greedy=True, progress=report)
        seconds = time.perf_counter() - t0
        new = list(g.new_ids)
        if builder.compat:  # the official re-tokenisation of the decoded text, end-of-sequence kept
            raw = tok.decode(prompt.ids + new)
            text = raw[len(tok.decode(prompt.ids)) :]
            return _compat_response(builder, sources, prompt, text, "generated", seconds)
        dropped = bool(new) and new[-1] in eos
        ids = new[:-1] if dropped else new
        if not ids:
            raise BadInput(
                "the model's response is empty (it generated only an end-of-sequence token): nothing to attribute; "
                "give a response= or change the query"
            )
        text, offsets = _incremental_offsets(tok, ids)
        return Response(ids, text, offsets, "generated", dropped, seconds)
    if not isinstance(response, str):
        raise BadInput(f"response must be a string (or None to generate one), got {type(response).__name__}")
    if builder.compat:
        builder.check_special_text({"response": response})
        return _compat_response(builder, sources, prompt, response, "given", 0.0)
    enc = tok(response, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if not response.strip() or not ids:
        raise BadInput("the response is empty: give the text whose sources you want, or None to generate it")
    spelled = [s for s in getattr(tok, "all_special_tokens", []) if s]
    rest = response
    for s in sorted(spelled, key=len, reverse=True):
        rest = rest.replace(s, "")
    if not rest.strip():
        raise BadInput(
            "the response is only special tokens (end-of-sequence): nothing to attribute; give the response's text"
        )
    offsets = np.array(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    return Response(ids, response, offsets, "given", False, 0.0)


def _compat_response(builder: PromptBuilder, sources: Sources, prompt: Prompt, text: str, how: str, seconds: float):
    """ContextCite's response ids: tokenise prompt text + response text as one string and cut at the prompt's length."""
    tok = builder.tok
    full = builder.text(builder.full(sources)) + text
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    P = len(prompt.ids) - len(builder.bos_ids)
    ids = list(enc["input_ids"])[P:]
    special = set(getattr(tok, "all_special_ids", []))
    if not ids or all(i in special for i in ids):
        raise BadInput("the response is empty or only special tokens (end-of-sequence): nothing to attribute")
    start = enc["offset_mapping"][P][0]
    offsets = np.array(enc["offset_mapping"][P:], dtype=np.int64).reshape(-1, 2) - start
    return Response(ids, full[start:], np.clip(offsets, 0, None), how, False, seconds)


def cut_response(
    model: Model, builder: PromptBuilder, sources: Sources, prompt: Prompt, resp: Response, stop: str
) -> Response:
    """A generated response cut where the prompt form's `stop` says (`sources.cut_at_stop`: a base model's first
    sentence or line), re-tokenised as a given response of that text (as the benchmark passes its cut responses);
    unchanged where the cut keeps it whole."""
    from ctxmix.methods.context.sources import cut_at_stop

    text = cut_at_stop(resp.text, stop)
    if text == resp.text or not text.strip():
        return resp
    cut = make_response(model, builder, sources, prompt, text, 1, False)
    how = f"generated, cut at its first {stop}"
    return Response(cut.ids, cut.text, cut.offsets, how, False, resp.generation_seconds)
