"""Benchmark datasets: labelled examples from files, the hub, BLiMP and Linzen-Goldberg."""

from __future__ import annotations

import os
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctxmix.benchmark.config import BLIMP_CUES, DatasetSpec
from ctxmix.errors import BadInput


@dataclass
class Example:
    id: str
    text: str
    label: int | None = None
    label_name: str | None = None
    text_pair: str | None = None
    item: dict | None = None  # an AgreementItem as a dict (agreement-style data)


_CONTRACTIONS = {
    "wouldn't": "would not",
    "couldn't": "could not",
    "shouldn't": "should not",
    "won't": "will not",
    "can't": "cannot",
    "don't": "do not",
    "doesn't": "does not",
    "didn't": "did not",
    "isn't": "is not",
    "aren't": "are not",
    "wasn't": "was not",
    "weren't": "were not",
    "hasn't": "has not",
    "haven't": "have not",
    "hadn't": "had not",
}


_DETERMINERS = {
    "the",
    "a",
    "an",
    "some",
    "many",
    "these",
    "those",
    "this",
    "that",
    "every",
    "all",
    "most",
    "few",
    "several",
    "no",
    "each",
}


def _blimp_item(uid: str, subset: str, good: str, bad: str) -> Any:
    """A BLiMP pair as an AgreementItem: target = the one differing word; cue by a rule (no
    parser: the subject head is the first word, or the second after a leading determiner;
    det-noun cues are the next (dna) or second next (dnaa) word)."""
    from ctxmix.benchmark.agreement import AgreementItem

    def words(s):
        for a, b in _CONTRACTIONS.items():
            s = s.replace(a, b).replace(a.capitalize(), b.capitalize())
        return s.replace(".", " .").replace(",", " ,").replace("?", " ?").split()

    g, b = words(good), words(bad)
    diff = [i for i, (x, y) in enumerate(zip(g, b)) if x != y]
    if len(g) != len(b) or len(diff) != 1:
        return None
    t = diff[0]
    rule = BLIMP_CUES[subset][1]
    cue = t + 1 if rule == "next" else t + 2 if rule == "next2" else (1 if g[0].lower() in _DETERMINERS else 0)
    if cue >= len(g) or cue == t:
        return None
    return AgreementItem(
        uid=uid,
        phenomenon=BLIMP_CUES[subset][0],
        words=tuple(g),
        target_index=t,
        target=g[t],
        foil=b[t],
        cue_indices=(cue,),
        number="?",
    )


def _label_of(value, reduce: str | None):
    if isinstance(value, dict) and "label" in value:
        value = value["label"]
    if isinstance(value, (list, tuple)):
        if reduce == "mode" and value:
            from collections import Counter

            return Counter(value).most_common(1)[0][0]
        return value[0] if value else None
    return value


def _dig(record: dict, path: str):
    v: Any = record
    for part in path.split("."):
        v = v[part] if isinstance(v, dict) else v
    return v


def _hf_examples(spec: DatasetSpec) -> tuple[list[Example], int]:
    import datasets

    o = spec.options
    try:
        data = datasets.load_dataset(o["path"], o.get("name"), split=o["split"])
    except Exception as e:  # noqa: BLE001
        raise BadInput(
            f"dataset {spec.id!r}: could not load {o['path']}/{o.get('name')} split {o['split']} from the "
            f"Hugging Face hub ({type(e).__name__}: {e}); offline datasets: pang_lee, agreement, file"
        ) from None
    out, empty = [], 0
    for i, rec in enumerate(data):
        text = _dig(rec, o["text_field"])
        if isinstance(text, (list, tuple)):
            text = " ".join(map(str, text))
        pair = _dig(rec, o["text_pair_field"]) if o.get("text_pair_field") else None
        label = _label_of(_dig(rec, o["label_field"]), o.get("label_reduce")) if o.get("label_field") else None
        if not isinstance(text, str) or not text.strip():
            empty += 1
            continue
        if isinstance(label, int) and label < 0:
            label = None  # GLUE test splits hide their labels as -1
        out.append(
            Example(
                id=f"{i:06d}",
                text=text.strip(),
                label=label if isinstance(label, int) else None,
                label_name=None if label is None else str(label),
                text_pair=pair,
            )
        )
    return out, empty


def _blimp_examples(spec: DatasetSpec) -> tuple[list[Example], int]:
    import datasets

    out, dropped = [], 0
    for subset in spec.options["subsets"]:
        try:
            data = datasets.load_dataset("blimp", subset, split=spec.options.get("split", "train"))
        except Exception as e:  # noqa: BLE001
            raise BadInput(f"dataset {spec.id!r}: could not load blimp/{subset} ({type(e).__name__}: {e})") from None
        n = spec.options.get("per_subset")
        for i, rec in enumerate(data):
            if n is not None and i >= n:
                break
            it = _blimp_item(f"{subset}-{i:04d}", subset, rec["sentence_good"], rec["sentence_bad"])
            if it is None:
                dropped += 1
                continue
            out.append(Example(id=it.uid, text=it.good, item=it.to_dict()))
    if dropped:
        warnings.warn(
            f"dataset {spec.id!r}: {dropped} BLiMP pair(s) do not differ in exactly one word; left out", stacklevel=2
        )
    return out, 0


def _linzen_goldberg(spec: DatasetSpec) -> tuple[list[Example], int]:
    """lgd_dataset.tsv (Goldberg 2019): n_attractors, sentence, masked sentence (***mask***),
    correct verb, wrong verb. No cue positions (cue metrics are NA)."""
    from ctxmix.benchmark.agreement import AgreementItem

    out, empty = [], 0
    for i, line in enumerate(Path(os.path.expanduser(spec.options["path"])).read_text(encoding="utf-8").splitlines()):
        parts = line.rstrip("\n").split("\t")
        if len(parts) < 5 or "***mask***" not in parts[2]:
            empty += 1
            continue
        words = parts[2].split()
        t = words.index("***mask***")
        words[t] = parts[3]
        it = AgreementItem(
            uid=f"lgd-{i:06d}",
            phenomenon="sva",
            words=tuple(words),
            target_index=t,
            target=parts[3],
            foil=parts[4],
            cue_indices=(),
            number="?",
            meta={"attractors": parts[0]},
        )
        out.append(Example(id=it.uid, text=it.good, item=it.to_dict()))
    return out, empty


def load_examples(spec: DatasetSpec) -> tuple[list[Example], int]:
    """(examples, number of rows with empty text left out) of one dataset spec, limit applied."""
    from ctxmix import data

    o = spec.options
    empty = 0
    if spec.source == "pang_lee":
        items = data.pang_lee(None)
        neg = [i for i, x in enumerate(items) if x.label == 0]
        pos = [i for i, x in enumerate(items) if x.label != 0]
        order = [i for pair in zip(neg, pos) for i in pair] + neg[len(pos) :] + pos[len(neg) :]  # balanced prefixes
        exs = [
            Example(id=f"pl-{i:04d}", text=items[i].text, label=items[i].label, label_name=items[i].label_name)
            for i in order
        ]
    elif spec.source == "agreement":
        from ctxmix.benchmark.agreement import agreement_items

        its = agreement_items(int(o.get("per_phenomenon", 50)), int(o.get("seed", 0)), o.get("phenomena"))
        by: dict[str, list] = {}
        for it in its:
            by.setdefault(it.phenomenon, []).append(it)
        rr = [x for tup in __import__("itertools").zip_longest(*by.values()) for x in tup if x is not None]
        exs = [Example(id=it.uid, text=it.good, item=it.to_dict()) for it in rr]  # phenomena interleaved
    elif spec.source == "file":
        import re

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if o.get("label_field", "label") is None and o.get("text_pair_field"):
                raise BadInput(
                    f"dataset {spec.id!r}: a text_pair_field needs a label_field (pairs are read as labelled rows)"
                )
            if o.get("label_field", "label") is None:
                texts = data.read_texts(o["path"], field=o.get("text_field", "text"))
                exs = [Example(id=f"{i:06d}", text=t) for i, t in enumerate(texts)]
            else:
                rows = data.read_labelled(
                    o["path"],
                    o.get("text_field", "text"),
                    o.get("label_field", "label"),
                    pair_field=o.get("text_pair_field"),
                )
                exs = [
                    Example(id=f"{i:06d}", text=r.text, label=r.label, label_name=r.label_name, text_pair=r.text_pair)
                    for i, r in enumerate(rows)
                ]
        for w in caught:  # ctxmix.data reports the empty records it skipped in a warning
            mm = re.search(r"skipped (\d+) empty record", str(w.message))
            if mm:
                empty += int(mm.group(1))
            else:
                warnings.warn(w.message, w.category, stacklevel=2)
    elif spec.source == "hf":
        exs, empty = _hf_examples(spec)
    elif spec.source == "blimp":
        exs, empty = _blimp_examples(spec)
    elif spec.source == "linzen_goldberg":
        exs, empty = _linzen_goldberg(spec)
    else:  # validated before
        raise BadInput(f"unknown dataset source {spec.source!r}")
    kept = [e for e in exs if isinstance(e.text, str) and e.text.strip()]
    empty += len(exs) - len(kept)
    if o.get("sample") is not None and o["sample"] < len(kept):
        rnd = random.Random(o.get("sample_seed", 0))  # ALTI: random.seed(10); random.sample(range(N), 500)
        kept = [kept[i] for i in rnd.sample(range(len(kept)), int(o["sample"]))]
    if spec.limit is not None:
        kept = kept[: spec.limit]
    return kept, empty
