"""Token ids by role and a tokenised input: which ids frame a sequence (`structural_ids`, `non_word_ids`),
the `Encoded` record of ids, token types and segments, and a pair's token types from its segments. Below both
`models` (whose `Model.encode_input` makes an `Encoded`) and `encoding` (which checks inputs against a
`Model`), so that neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass


def structural_ids(tokenizer) -> set[int]:
    """The ids of the tokens that frame a sequence ([CLS], [SEP], [PAD], BOS, EOS): what ctxmix
    treats as special. Not [UNK], which stands for a real word (deletion metrics may delete it,
    IG baselines replace it, masking may mask it, CAT keeps it as a key), and not [MASK], which is
    a language model's question: it is never deleted as the explained position, IG baselines keep
    it (the baseline asks the same question), and it stays a key in CAT."""
    out = set()
    for attr in ("cls_token_id", "sep_token_id", "pad_token_id", "bos_token_id", "eos_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            out.add(v)
    return out


def non_word_ids(tokenizer) -> set[int]:
    """`structural_ids` and [MASK]: the tokens that belong to no text of a pair (segment -1) and
    that IG baselines keep as they are."""
    return structural_ids(tokenizer) | (
        {tokenizer.mask_token_id} if getattr(tokenizer, "mask_token_id", None) is not None else set()
    )


@dataclass
class Encoded:
    """A tokenised input: ids, the token_type_ids the model reads (or None), segments (0 = text A,
    1 = text B, -1 = special token) and notes (truncation, unknown words)."""

    ids: list[int]
    token_type_ids: list[int] | None
    segments: list[int]
    notes: list[str]


def types_from_segments(segments: list[int]) -> list[int]:
    """BERT's token_type_ids for a pair from its segments: 0 up to the first token of text B, 1
    from there on (so [CLS] and the first [SEP] get 0, the last [SEP] 1, as BERT's tokenizer does)."""
    first_b = next((i for i, s in enumerate(segments) if s == 1), len(segments))
    return [0 if i < first_b else 1 for i in range(len(segments))]
