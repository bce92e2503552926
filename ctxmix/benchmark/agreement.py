"""A template-generated number-agreement set in the style of BLiMP, with cue words marked.

Value zeroing (Mohebbi et al. 2023, §4) evaluates context-mixing methods on BLiMP minimal
pairs where one word (the *cue*) decides which of two words (the *target* and the *foil*)
is grammatical at one position. BLiMP does not ship offline, so ctxmix generates pairs of
the same kinds from small word lists, seeded and deterministic:

- ``sva_attractor``: subject-verb agreement across an attractor noun of the other number in
  a prepositional phrase or a relative clause ("The keys to the cabinet [MASK] old ." is/are);
  cue = the head noun of the subject (BLiMP darn, Linzen et al. 2016).
- ``anaphor``: reflexive number agreement, sometimes across an attractor
  ("The boys near the teacher hurt [MASK] ." themselves/himself); cue = the antecedent noun
  (BLiMP ana).
- ``det_noun`` / ``det_adj_noun``: demonstrative-noun agreement, the cue *after* the target
  ("Sara saw [MASK] (white) books ." these/this); cue = the head noun only, as the value
  zeroing code marks it (BLiMP dna, dnaa).

Every item is a good/bad minimal pair (`good`, `bad`) plus word indices of the target, the
cue(s) and the attractor. `AgreementItem.encode(tokenizer)` turns it into model input for
one tokenizer: the target word replaced by the mask token (masked LMs and encoders) or the
prefix before it (causal LMs), the cue *token* positions (first sub-word of each cue word,
found through the fast tokenizer's offsets, so RoBERTa's "Ġ" words work), and the target and
foil token ids. Items whose target or foil is not a single token of that vocabulary are
filtered out (value zeroing does the same), and so are, for causal models, items whose cue
comes after the target. `encode` returns the reason instead of raising.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from ctxmix.errors import BadInput

PHENOMENA = ("sva_attractor", "anaphor", "det_noun", "det_adj_noun")

# (singular, plural)
_SUBJECTS = [
    ("key", "keys"),
    ("book", "books"),
    ("picture", "pictures"),
    ("door", "doors"),
    ("box", "boxes"),
    ("letter", "letters"),
    ("window", "windows"),
    ("bottle", "bottles"),
    ("lamp", "lamps"),
    ("chair", "chairs"),
    ("painting", "paintings"),
    ("car", "cars"),
    ("song", "songs"),
    ("map", "maps"),
]
_ATTRACTORS = [
    ("cabinet", "cabinets"),
    ("shelf", "shelves"),
    ("house", "houses"),
    ("teacher", "teachers"),
    ("room", "rooms"),
    ("garden", "gardens"),
    ("student", "students"),
    ("man", "men"),
    ("woman", "women"),
    ("doctor", "doctors"),
    ("office", "offices"),
    ("child", "children"),
]
_PREPS = ["of", "near", "behind", "from", "for", "beside"]
# (singular verb, plural verb, continuation that fits both)
_VERBS = [
    ("is", "are", "old"),
    ("was", "were", "broken"),
    ("has", "have", "disappeared"),
    ("is", "are", "on the table"),
    ("was", "were", "found yesterday"),
    ("seems", "seem", "new"),
    ("has", "have", "been moved"),
    ("looks", "look", "expensive"),
]
_REL_VERBS = ["liked", "saw", "bought", "wanted", "mentioned", "found"]
# (singular, plural, gender)
_ANTECEDENTS = [
    ("boy", "boys", "m"),
    ("girl", "girls", "f"),
    ("man", "men", "m"),
    ("woman", "women", "f"),
    ("king", "kings", "m"),
    ("queen", "queens", "f"),
    ("actor", "actors", "m"),
    ("actress", "actresses", "f"),
    ("waiter", "waiters", "m"),
    ("waitress", "waitresses", "f"),
    ("father", "fathers", "m"),
    ("mother", "mothers", "f"),
]
_REFL_VERBS = ["hurt", "saw", "liked", "helped", "blamed", "praised", "admired", "watched", "described", "hated"]
_REFLEXIVE = {"m": "himself", "f": "herself", "pl": "themselves"}
_NAMES = ["Sara", "John", "Mary", "David", "Emma", "Peter", "Lisa", "Tom", "Anna", "Mark"]
_DET_VERBS = ["saw", "liked", "found", "bought", "broke", "cleaned", "sold", "moved", "noticed", "wanted"]
_DETS = [("this", "these"), ("that", "those")]
_ADJS = ["old", "new", "big", "small", "red", "white", "broken", "heavy", "cheap", "strange"]


@dataclass(frozen=True)
class EncodedAgreement:
    """One item for one tokenizer: ids with the mask (or the prefix), positions, token ids."""

    input_ids: list[int]
    position: int  # the row explained: the mask token, or the last prefix token (causal)
    cues: list[int]  # token positions of the cue words (first sub-word each)
    target_id: int
    foil_id: int
    attractor: int | None = None


@dataclass(frozen=True)
class AgreementItem:
    """A minimal pair: `words` is the good sentence; `foil` replaces words[target_index] in the bad one."""

    uid: str
    phenomenon: str
    words: tuple[str, ...]
    target_index: int
    target: str
    foil: str
    cue_indices: tuple[int, ...]
    number: str  # "sg" or "pl": the number the cue imposes
    attractor_index: int | None = None
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def good(self) -> str:
        return " ".join(self.words)

    @property
    def bad(self) -> str:
        w = list(self.words)
        w[self.target_index] = self.foil
        return " ".join(w)

    def masked(self, mask_token: str) -> str:
        w = list(self.words)
        w[self.target_index] = mask_token
        return " ".join(w)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["words"] = list(self.words)
        d["cue_indices"] = list(self.cue_indices)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> AgreementItem:
        d = dict(d)
        d["words"] = tuple(d["words"])
        d["cue_indices"] = tuple(d["cue_indices"])
        return cls(**d)

    # -- encoding for one tokenizer ------------------------------------------------------------

    def encode(self, tokenizer, causal: bool = False, max_length: int | None = None) -> EncodedAgreement | str:
        """Model input for `tokenizer`, or a string saying why this item does not fit it."""
        if not getattr(tokenizer, "is_fast", False):
            return "needs a fast tokenizer (offsets)"
        target_id = _single_token(tokenizer, self.words, self.target_index, self.target)
        foil_id = _single_token(tokenizer, self.words, self.target_index, self.foil)
        if target_id is None:
            return f"target {self.target!r} is not one token"
        if foil_id is None:
            return f"foil {self.foil!r} is not one token"
        if causal:
            if any(c > self.target_index for c in self.cue_indices):
                return "the cue follows the target (causal model)"
            words = list(self.words[: self.target_index])
            ids, starts = _encode_words(tokenizer, words)
            if not ids:
                return "empty prefix"
            position = len(ids) - 1
        else:
            mask = getattr(tokenizer, "mask_token", None)
            if mask is None:
                return "the tokenizer has no mask token"
            words = list(self.words)
            words[self.target_index] = mask
            ids, starts = _encode_words(tokenizer, words)
            mask_id = tokenizer.mask_token_id
            if ids.count(mask_id) != 1:
                return "the mask token did not survive tokenisation"
            position = ids.index(mask_id)
        if max_length is not None and len(ids) > max_length:
            return f"longer than {max_length} tokens"
        cues = [starts[c] for c in self.cue_indices if c < len(words)]
        if len(cues) != len(self.cue_indices) or any(c is None for c in cues):
            return "a cue word has no token"  # items without cue words (cue_indices = ()) are fine
        att = (
            starts[self.attractor_index]
            if self.attractor_index is not None and self.attractor_index < len(words)
            else None
        )
        return EncodedAgreement(
            input_ids=ids, position=position, cues=cues, target_id=target_id, foil_id=foil_id, attractor=att
        )


def _char_spans(words: list[str]) -> list[tuple[int, int]]:
    spans, pos = [], 0
    for w in words:
        spans.append((pos, pos + len(w)))
        pos += len(w) + 1
    return spans


def _encode_words(tokenizer, words: list[str]) -> tuple[list[int], list[int | None]]:
    """Token ids (special tokens included) of " ".join(words), and each word's first token index."""
    text = " ".join(words)
    enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    ids, offs = list(enc["input_ids"]), list(enc["offset_mapping"])
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    mask_id = getattr(tokenizer, "mask_token_id", None)
    starts: list[int | None] = []
    for a, b in _char_spans(words):
        hit = None
        for k, (s, e) in enumerate(offs):
            if e <= s or (ids[k] in special and ids[k] != mask_id):
                continue
            if s < b and e > a:
                hit = k
                break
        starts.append(hit)
    return ids, starts


def _single_token(tokenizer, words, index: int, word: str) -> int | None:
    """The id of `word` at word position `index` when it is exactly one token there."""
    w = list(words)
    w[index] = word
    text = " ".join(w)
    a, b = _char_spans(w)[index]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    hits = [t for t, (s, e) in zip(enc["input_ids"], enc["offset_mapping"]) if e > s and s < b and e > a]
    if len(hits) != 1:
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    return None if hits[0] == unk else int(hits[0])


# ---------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------


def _cap(words: list[str]) -> list[str]:
    return [words[0][:1].upper() + words[0][1:]] + words[1:]


def _sva(rng: random.Random) -> dict:
    (s_sg, s_pl), (a_sg, a_pl) = rng.choice(_SUBJECTS), rng.choice(_ATTRACTORS)
    sg = rng.random() < 0.5
    subj, attr = (s_sg, a_pl) if sg else (s_pl, a_sg)  # the attractor always has the other number
    v_sg, v_pl, rest = rng.choice(_VERBS)
    if rng.random() < 0.7:
        head = ["the", subj, rng.choice(_PREPS), "the", attr]
    else:
        head = ["the", subj, "that", "the", attr, rng.choice(_REL_VERBS)]
    words = head + [v_sg if sg else v_pl] + rest.split() + ["."]
    return dict(
        words=_cap(words),
        target_index=len(head),
        target=v_sg if sg else v_pl,
        foil=v_pl if sg else v_sg,
        cue_indices=(1,),
        number="sg" if sg else "pl",
        attractor_index=4,
    )


def _anaphor(rng: random.Random) -> dict:
    sg_w, pl_w, gender = rng.choice(_ANTECEDENTS)
    sg = rng.random() < 0.5
    subj = sg_w if sg else pl_w
    target = _REFLEXIVE[gender] if sg else _REFLEXIVE["pl"]
    foil = _REFLEXIVE["pl"] if sg else _REFLEXIVE[gender]
    att = None
    head = ["the", subj]
    if rng.random() < 0.5:
        a_sg, a_pl = rng.choice(_ATTRACTORS)
        head += [rng.choice(["near", "behind", "with", "beside"]), "the", a_pl if sg else a_sg]
        att = 4
    words = head + [rng.choice(_REFL_VERBS), target, "."]
    return dict(
        words=_cap(words),
        target_index=len(head) + 1,
        target=target,
        foil=foil,
        cue_indices=(1,),
        number="sg" if sg else "pl",
        attractor_index=att,
    )


def _det(rng: random.Random, adjective: bool) -> dict:
    n_sg, n_pl = rng.choice(_SUBJECTS)
    d_sg, d_pl = rng.choice(_DETS)
    sg = rng.random() < 0.5
    mid = [rng.choice(_ADJS)] if adjective else []
    words = [rng.choice(_NAMES), rng.choice(_DET_VERBS), d_sg if sg else d_pl] + mid + [n_sg if sg else n_pl, "."]
    return dict(
        words=words,
        target_index=2,
        target=d_sg if sg else d_pl,
        foil=d_pl if sg else d_sg,
        cue_indices=(3 + len(mid),),
        number="sg" if sg else "pl",
        attractor_index=None,
    )


_GENERATORS = {
    "sva_attractor": _sva,
    "anaphor": _anaphor,
    "det_noun": lambda r: _det(r, False),
    "det_adj_noun": lambda r: _det(r, True),
}


def agreement_items(per_phenomenon: int = 50, seed: int = 0, phenomena=None) -> list[AgreementItem]:
    """`per_phenomenon` distinct minimal pairs of each phenomenon (fewer if the templates run
    out), generated with `random.Random(seed)`; the same arguments give the same list."""
    phenomena = list(PHENOMENA if phenomena is None else phenomena)
    bad = [p for p in phenomena if p not in _GENERATORS]
    if bad:
        raise BadInput(f"unknown agreement phenomenon {', '.join(map(repr, bad))}; valid: {', '.join(PHENOMENA)}")
    if isinstance(per_phenomenon, bool) or not isinstance(per_phenomenon, int) or per_phenomenon < 0:
        raise BadInput(f"per_phenomenon must be a non-negative integer, got {per_phenomenon!r}")
    items: list[AgreementItem] = []
    for ph in phenomena:
        rng = random.Random(f"{seed}:{ph}")
        seen: set[str] = set()
        tries = 0
        while len(seen) < per_phenomenon and tries < 50 * per_phenomenon + 100:
            tries += 1
            d = _GENERATORS[ph](rng)
            key = " ".join(d["words"])
            if key in seen:
                continue
            seen.add(key)
            items.append(
                AgreementItem(
                    uid=f"{ph}-{len(seen) - 1:04d}",
                    phenomenon=ph,
                    words=tuple(d["words"]),
                    target_index=d["target_index"],
                    target=d["target"],
                    foil=d["foil"],
                    cue_indices=tuple(d["cue_indices"]),
                    number=d["number"],
                    attractor_index=d["attractor_index"],
                )
            )
    return items


def encode_items(
    items: list[AgreementItem], tokenizer, causal: bool = False
) -> tuple[list[tuple[AgreementItem, EncodedAgreement]], dict[str, int]]:
    """Encode every item for one tokenizer; returns the kept pairs and {reason: count} of the rest."""
    kept, dropped = [], {}
    for it in items:
        e = it.encode(tokenizer, causal=causal)
        if isinstance(e, str):
            dropped[e] = dropped.get(e, 0) + 1
        else:
            kept.append((it, e))
    return kept, dropped


__all__ = ["PHENOMENA", "AgreementItem", "EncodedAgreement", "agreement_items", "encode_items"]
