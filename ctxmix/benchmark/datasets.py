"""Benchmark datasets: labelled examples from files, the hub, BLiMP and Linzen-Goldberg."""

from __future__ import annotations

import os
import random
import re
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
    # a ClassLabel column names its classes (MNLI: entailment, neutral, contradiction): kept as label_name,
    # so the runner can check them against the model's id2label (`check_label_order`)
    feature = getattr(data, "features", {}).get(o.get("label_field") or "")
    class_names = list(getattr(feature, "names", None) or [])
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
                label_name=None
                if label is None
                else class_names[label]
                if isinstance(label, int) and 0 <= label < len(class_names)
                else str(label),
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


# ------------------------------------------------------------------------------------------------
# label order: a dataset's label numbering against a classifier's id2label
# ------------------------------------------------------------------------------------------------


def label_names(examples: list[Example]) -> dict[int, str]:
    """{label index: name} of a dataset where its examples name their labels (pang_lee's neg / pos, a
    file's string labels, a hub ClassLabel's names); numbers are no names and are left out."""
    out: dict[int, str] = {}
    for e in examples:
        if e.label is not None and e.label_name is not None and not _unnamed(e.label_name):
            out.setdefault(int(e.label), str(e.label_name))
    return out


def _unnamed(name) -> bool:
    """A label with no name: a number, or transformers' default LABEL_k."""
    return re.fullmatch(r"(?i)\s*(label_?)?-?\d+\s*", str(name)) is not None


def _same_label(a: str, b: str) -> bool:
    """Two names of one class: equal ignoring case, or one a prefix of the other of at least 3
    letters (pang_lee's "neg" is a checkpoint's "negative", "contra" is "contradiction")."""
    a, b = a.strip().casefold(), b.strip().casefold()
    short, long = sorted((a, b), key=len)
    return a == b or (len(short) >= 3 and long.startswith(short))


def check_label_order(dataset: str, names: dict[int, str], model: str, id2label: dict | None) -> None:
    """Refuse (BadInput) a dataset whose label numbering differs from a classifier's, where both name
    the labels: a name of the dataset that is a name of the model under another index. The gold label
    of an example is the dataset's index, which `accuracy_mask` (and target: gold) read as the model's
    class index; MNLI checkpoints, for one, order their classes differently. Both orders are in the
    message. Names only one side has are not compared (nothing to check them against)."""
    model_names = {int(k): str(v) for k, v in (id2label or {}).items() if not _unnamed(v)}
    clashes = [
        (i, a, j, b)
        for i, a in names.items()
        for j, b in model_names.items()
        if i != j and _same_label(a, b) and not _same_label(a, model_names.get(i, ""))
    ]
    if not clashes:
        return

    def order(d: dict[int, str]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(d.items()))

    i, a, j, b = clashes[0]
    raise BadInput(
        f"dataset {dataset!r} and model {model!r} number their labels differently: the dataset's order is "
        f"[{order(names)}], the model's id2label [{order(model_names)}] (e.g. {a!r} is {i} in the dataset and "
        f"{b!r} is {j} in the model), so gold labels (accuracy_mask, target: gold) would name other classes. "
        "Give the dataset's labels as integers in the model's numbering, or use a model in the dataset's order."
    )
