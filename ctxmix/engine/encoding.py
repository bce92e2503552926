"""Inputs as token ids: a text, a pair (text_a, text_b) or a list of ids (with optional segments / token
types) checked against the model's vocabulary and length, as one `Encoded`. In the engine so that
`generate` and every method read input the same way."""

from __future__ import annotations

import numpy as np

from ctxmix.engine.models import Model
from ctxmix.engine.tokens import Encoded, non_word_ids, types_from_segments
from ctxmix.errors import BadInput


def encode_one(model: Model, item, token_type_ids=None, segments=None, ids: bool | None = None) -> Encoded:
    """A text, a pair (text_a, text_b) or a list of token ids (with optional segments / token
    types) as an `Encoded`. ids: whether `item` is token ids (None: guess from its type)."""
    if ids is None:
        ids = not isinstance(item, (str, tuple))
    if not ids:
        if token_type_ids is not None or segments is not None:
            raise BadInput("token_type_ids and segments go with input_ids; a text or pair is tokenised here")
        if not isinstance(item, (str, tuple)):
            raise BadInput(
                f"text must be a string or a pair (text_a, text_b) (or give input_ids=), got {type(item).__name__}"
            )
        return model.encode_input(item)
    ids_ = check_input_ids(model, item)
    types, segs = check_segments(model, ids_, token_type_ids, segments)
    return Encoded(ids_, types, segs, [])


def check_segments(model: Model, ids: list[int], token_type_ids=None, segments=None):
    """(token_type_ids or None, segments) for token ids. segments: 0 / 1 / -1 per token (text A,
    text B, special). Without segments: -1 at special tokens, else the token type (0 for one text).
    Without token_type_ids, on a model that reads them, a pair's are derived as BERT's tokenizer
    makes them (`types_from_segments`)."""
    n = len(ids)

    def ints(v, name, ok):
        if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
            raise BadInput(f"{name} must be a list of whole numbers, one per token")
        v = list(v)
        if len(v) != n:
            raise BadInput(f"{name} has {len(v)} entries for {n} tokens")
        for x in v:
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or int(x) not in ok:
                raise BadInput(f"{name} entries must be one of {sorted(ok)}, got {x!r}")
        return [int(x) for x in v]

    if token_type_ids is not None:
        if not model.uses_token_types:
            raise BadInput(f"{model.name} reads no token_type_ids; give segments= to mark a pair")
        token_type_ids = ints(token_type_ids, "token_type_ids", set(range(int(model.config.type_vocab_size))))
    special = non_word_ids(model.tokenizer)
    if segments is None:
        segments = [
            -1 if t in special else (0 if token_type_ids is None else min(1, token_type_ids[i]))
            for i, t in enumerate(ids)
        ]
    else:
        segments = ints(segments, "segments", {-1, 0, 1})
    if token_type_ids is None and model.uses_token_types and 1 in segments:
        token_type_ids = types_from_segments(segments)
    return token_type_ids, segments


def check_input_ids(model: Model, input_ids) -> list[int]:
    """Token ids as a list of ints inside the vocabulary and the model's length."""
    if isinstance(input_ids, (str, bytes)) or not hasattr(input_ids, "__iter__"):
        raise BadInput("input_ids must be a list of token ids")
    ids = list(input_ids)
    if not ids:
        raise BadInput("input_ids is empty")
    V = max(int(getattr(model.config, "vocab_size", 0) or 0), len(model.tokenizer))
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= int(i) < V:
            raise BadInput(f"input_ids must be whole numbers from 0 to {V - 1}, got {i!r}")
    if len(ids) > model.max_length:
        raise BadInput(f"input_ids has {len(ids)} tokens; the model takes at most {model.max_length}")
    return [int(i) for i in ids]
