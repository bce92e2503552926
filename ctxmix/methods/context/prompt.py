"""The prompt and the response of a context attribution (docs/context.md, "The prompt, the sources, the
response").

The user message is `PLAIN_FORMAT` ("Context: {context}\\n\\nQuery: {query}", ContextCite's and AT2's),
or the context alone when there is no query (a continuation, or an instruction the caller placed in the
context). It is wrapped in the model's chat template (one user turn, no system message, the generation
prompt added) when the tokenizer has one and `template` is not "plain"; without a chat template the
prompt is the tokenizer's BOS (if it has one) followed by the message, and the response follows it.

Tokenisation (default): the template's text before and after the message is tokenised with its special
tokens parsed, the message itself with special tokens *not* parsed (`split_special_tokens=True`), so a
context or query that spells `<|im_start|>` is read as text; nothing is added (`add_special_tokens=False`,
as ContextCite does after templating), and a BOS doubled at position 0 is dropped. `compat=True`
tokenises the whole templated string at once, as the official package does; text that spells a
special token is then refused (the official package would parse it as one).

The response (default): the generated ids without a trailing end-of-sequence token, or the given text
tokenised on its own (special tokens not parsed). compat=True: the official re-tokenisation of prompt text
+ decoded response, end-of-sequence included (docs/context.md, "Choices where the papers leave room").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ctxmix.engine.models import Model
from ctxmix.errors import BadInput
from ctxmix.methods.context.sources import TEMPLATE, Sources, token_labels

PLAIN_FORMAT = "Context: {context}\n\nQuery: {query}"
MARKER = "CTXMIXMESSAGEMARKER"


@dataclass
class Prompt:
    """A tokenised prompt: ids (P,), labels (P,) (a source index or a bucket of `ctxmix.methods.context.sources`)."""

    ids: list[int]
    labels: np.ndarray


class PromptBuilder:
    """Builds the prompt ids of a context (the full one, or an ablated rebuild) for one query."""

    def __init__(self, model: Model, query: str | None, template: str | None = None, compat: bool = False):
        tok = model.tokenizer
        self.tok, self.query, self.compat = tok, query, compat
        has_chat = bool(getattr(tok, "chat_template", None))
        if template not in (None, "chat", "plain"):
            raise BadInput(
                f"template must be None (the chat template when the model has one), 'chat' or 'plain', got {template!r}"
            )
        if template == "chat" and not has_chat:
            raise BadInput(f"{model.name}'s tokenizer has no chat template; use template='plain' (or None)")
        self.kind = template or ("chat" if has_chat else "plain")
        if self.kind == "chat":
            rendered = tok.apply_chat_template(
                [{"role": "user", "content": MARKER}], tokenize=False, add_generation_prompt=True
            )
            if not isinstance(rendered, str) or rendered.count(MARKER) != 1:
                raise BadInput(
                    f"{model.name}'s chat template changes the message text, so the context's place in the prompt "
                    "cannot be found; use template='plain'"
                )
            self.prefix, self.suffix = rendered.split(MARKER)
            self.bos_ids: list[int] = []
        else:
            self.prefix = self.suffix = ""
            bos = getattr(tok, "bos_token_id", None)
            self.bos_ids = [int(bos)] if isinstance(bos, int) else []
        self.prefix_ids = self._encode(self.prefix, special=True)
        self.suffix_ids = self._encode(self.suffix, special=True)
        bos = getattr(tok, "bos_token_id", None)
        lead = self.bos_ids + self.prefix_ids
        if isinstance(bos, int) and len(lead) >= 2 and lead[0] == lead[1] == bos:
            self.prefix_ids = self.prefix_ids[1:]  # a template that writes BOS text after a BOS id: one BOS

    @property
    def info(self) -> dict:
        return {
            "template": self.kind,
            "format": "{context}" if self.query is None else PLAIN_FORMAT,
            "prefix": self.prefix,
            "suffix": self.suffix,
            "bos": self.bos_ids,
            "tokenised": "whole string (compat)"
            if self.compat
            else "template pieces; message with special tokens as text",
        }

    def _encode(self, text: str, special: bool) -> list[int]:
        if not text:
            return []
        return list(self.tok(text, add_special_tokens=False, split_special_tokens=not special)["input_ids"])

    def body(self, context: str) -> tuple[str, tuple[int, int], tuple[int, int] | None]:
        """The user message for `context`, where the context and the query sit in it."""
        if self.query is None:
            return context, (0, len(context)), None
        head, mid = PLAIN_FORMAT.split("{context}")
        mid = mid.split("{query}")[0]
        text = head + context + mid + self.query
        cs = len(head)
        qs = cs + len(context) + len(mid)
        return text, (cs, cs + len(context)), (qs, qs + len(self.query))

    def text(self, context: str) -> str:
        """The templated prompt as text (what compat tokenises)."""
        return self.prefix + self.body(context)[0] + self.suffix

    def ids(self, context: str) -> list[int]:
        """The prompt ids of a (possibly ablated) context."""
        if self.compat:
            return self.bos_ids + list(self.tok(self.text(context), add_special_tokens=False)["input_ids"])
        return self.bos_ids + self.prefix_ids + self._encode(self.body(context)[0], special=False) + self.suffix_ids

    def encode(self, sources: Sources) -> Prompt:
        """The full context's prompt ids and each token's source or bucket."""
        body, crange, qrange = self.body(sources.text)
        if self.compat:
            full = self.prefix + body + self.suffix
            enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
            shift = len(self.prefix)
            offs = [
                (a - shift, b - shift) if shift <= a and b <= shift + len(body) and b > a else None
                for a, b in enc["offset_mapping"]
            ]
            ids = self.bos_ids + list(enc["input_ids"])
            labels = np.concatenate(
                [np.full(len(self.bos_ids), TEMPLATE), token_labels(body, offs, crange, qrange, sources)]
            )
        else:
            enc = self.tok(body, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
            head = self.bos_ids + self.prefix_ids
            ids = head + list(enc["input_ids"]) + self.suffix_ids
            labels = np.concatenate(
                [
                    np.full(len(head), TEMPLATE),
                    token_labels(body, enc["offset_mapping"], crange, qrange, sources),
                    np.full(len(self.suffix_ids), TEMPLATE),
                ]
            )
        if ids != self.ids(sources.text):  # the one-pass and the ablation paths must read the same prompt
            raise RuntimeError("the prompt's ids differ between its two tokenisations")
        return Prompt(ids=ids, labels=labels.astype(np.int64))

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
    full = builder.text(sources.text) + text
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    P = len(prompt.ids) - len(builder.bos_ids)
    ids = list(enc["input_ids"])[P:]
    special = set(getattr(tok, "all_special_ids", []))
    if not ids or all(i in special for i in ids):
        raise BadInput("the response is empty or only special tokens (end-of-sequence): nothing to attribute")
    start = enc["offset_mapping"][P][0]
    offsets = np.array(enc["offset_mapping"][P:], dtype=np.int64).reshape(-1, 2) - start
    return Response(ids, full[start:], np.clip(offsets, 0, None), how, False, seconds)
