"""Metrics that score a saliency vector or a context-mixing map, each an object with its metadata.
(Over 500 lines: one registry of every metric with its formula; a new metric is one entry here.)

Every metric is a `Metric` (name, title, direction, range, description, family), in the
style of ferret, so tables can mark the best value of each column by the metric's own
direction. The functions below are pure (numpy in, float out) except the deletion metrics,
which need the model's predictions on perturbed inputs; those are collected for every
method of an example and run in padded, masked batches of bounded size (`TargetProbability`).

Families
--------
- ``reference``: Spearman's rho between a method's saliency and a reference saliency of the
  same example (GlobEnc: grad_x_input; ALTI: grad and blank_out). Spec ``spearman:REF``;
  ``spearman:|REF|`` ranks the reference by absolute value (ALTI's blank-out is |p - p'|);
  a ``/nopos`` suffix leaves the explained position out (value zeroing's [MASK] row).
  scipy's average-rank Spearman; equal to ALTI's dense-rank formula when there are no ties.
  A constant vector gives NaN (counted, not averaged).
- ``deletion``: faithfulness by erasing the tokens a method ranks highest.
  ``comprehensiveness`` / ``sufficiency`` (DeYoung et al. 2020, ERASER) average over the
  bins 1, 5, 10, 20, 50 % of the deletable tokens, k = max(1, round(b * m)), the change
  p(x) - p(x without the top k) (comprehensiveness, higher is better) and
  p(x) - p(x with only the top k kept) (sufficiency, lower is better).
  ``aopc`` / ``lodds`` are AttCAT's (Qiang et al. 2022, code): nine levels
  k = round(j/9 * n), j = 1..9, n = all tokens special ones included (deduplicated, k = 0
  dropped), each capped at the number of deletable tokens; AOPC = mean |p(x) - p(x_k)| with
  the top k *deleted* (the code's absolute value), LOdds = mean log(p(x_k) / p(x)) with the
  top k *replaced by [PAD]* (attended to, as in the code). ``aopc_pad`` and
  ``lodds_delete`` are the other two pairings the AttCAT code also computes.
  Tokens are ranked by descending signed score (ties by position; by |score| where a dataset
  asks for ``abs_saliency``, as the AttCAT QQP notebook does). Structural tokens ([CLS], [SEP],
  [PAD], BOS, EOS: ``ctxmix.engine.tokens.structural_ids``; [UNK] is a word and may be deleted) and, for
  language models, the explained position are never deleted. ``stop_one_short`` caps the
  deletions at all but one deletable token, as the AttCAT code's loop does (i != n - 1).
  **Re-tokenisation:** none. Perturbations work on token ids: deleting removes the ids
  from the sequence (it gets shorter; the explained position moves left accordingly),
  replacing overwrites them with the pad id. Text is never decoded and tokenised again,
  so a word split into sub-words can lose some of its pieces, exactly as in the
  AttCAT code. p is the softmax probability of the explained target (class, or token at
  the explained position), or sigma(l_target - l_foil) when a foil token is given.
- ``cue``: alignment of a score vector with the cue words of an agreement example (value
  zeroing §5, App. A.2): ``cue_dot`` = S . xi with S = |v| / sum |v| (the score mass on
  cue tokens), ``cue_ap`` = average precision of the ranking by S against the binary cue
  vector xi (ties grouped, as sklearn does), ``cue_probes`` = probes needed: the number of
  non-cue tokens scored strictly above the best cue token (lower is better), ``cue_mrr`` = the
  reciprocal rank of the best cue token by the *signed* score (ALTI-Logit §4.2; its mean over
  examples is the paper's MRR; the other three rank |v|). Computed per
  layer on the explained row of a mixing method's *layer* map (no rollout), and once on the
  final saliency vector (layer = -1, "global"). Every position is included, the explained
  one and special tokens too (the official value-zeroing matrix includes them).

Agreement between methods (`method_agreement`) and between models (`model_agreement`) is
Spearman between saliency vectors of the same example; the runner computes them from the
saliency vectors it stores.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from scipy import stats

from ctxmix.errors import BadInput

DEYOUNG_BINS = (0.01, 0.05, 0.10, 0.20, 0.50)
ATTCAT_LEVELS = 9
MASK_RATIOS_TENTHS = tuple(range(1, 10))  # DecompX's K = 10 %, ..., 90 % (K = 0 is the unmasked input)
MASK_METRICS = ("aopc_mask", "accuracy_mask", "aopc_mask_least", "accuracy_mask_least")
ACCURACY_METRICS = ("accuracy_mask", "accuracy_mask_least")
PROB_FLOOR = 1e-12  # probabilities are clipped here before a log (LOdds)


@dataclass(frozen=True)
class Metric:
    """A metric and what a table needs to know about it.

    higher_is_better: True, False, or None when neither (a descriptive quantity).
    range: the values it can take (math.inf for unbounded).
    family: "reference", "deletion", "cue" or "analysis".
    per_layer: also reported per layer (cue alignment; contextualization change).
    """

    name: str
    title: str
    higher_is_better: bool | None
    range: tuple[float, float]
    description: str
    family: str
    per_layer: bool = False
    reference: str | None = None
    reference_abs: bool = False
    exclude_position: bool = False
    needs_head: bool = False
    needs_cues: bool = False

    @property
    def direction(self) -> str:
        return {True: "higher", False: "lower", None: "none"}[self.higher_is_better]

    @property
    def arrow(self) -> str:
        return {True: "↑", False: "↓", None: ""}[self.higher_is_better]


_FIXED = [
    Metric(
        "comprehensiveness",
        "Comprehensiveness (AOPC)",
        True,
        (-1.0, 1.0),
        "DeYoung et al. 2020: mean over bins 1/5/10/20/50 % of p(x) - p(x without the top-k tokens); "
        "token ids deleted.",
        "deletion",
        needs_head=True,
    ),
    Metric(
        "sufficiency",
        "Sufficiency (AOPC)",
        False,
        (-1.0, 1.0),
        "DeYoung et al. 2020: mean over bins 1/5/10/20/50 % of p(x) - p(only the top-k tokens kept); "
        "token ids deleted.",
        "deletion",
        needs_head=True,
    ),
    Metric(
        "aopc",
        "AOPC (AttCAT)",
        True,
        (0.0, 1.0),
        "AttCAT code: mean over 9 levels round(j/9 n) of |p(x) - p(x with the top-k ids deleted)|.",
        "deletion",
        needs_head=True,
    ),
    Metric(
        "aopc_pad",
        "AOPC, [PAD] replacement",
        True,
        (0.0, 1.0),
        "As aopc, with the top-k ids replaced by the pad id instead of deleted.",
        "deletion",
        needs_head=True,
    ),
    Metric(
        "lodds",
        "LOdds (AttCAT)",
        False,
        (-math.inf, math.inf),
        "AttCAT code: mean over 9 levels of log(p(x_k) / p(x)), the top-k ids replaced by the pad id.",
        "deletion",
        needs_head=True,
    ),
    Metric(
        "lodds_delete",
        "LOdds, deletion",
        False,
        (-math.inf, math.inf),
        "As lodds, with the top-k ids deleted instead of replaced.",
        "deletion",
        needs_head=True,
    ),
    Metric(
        "aopc_mask",
        "AOPC, [MASK] (DecompX)",
        True,
        (-1.0, 1.0),
        "DecompX §4.4-4.5 (Modarressi et al. 2023): the most important floor(K m) of the m non-special "
        "tokens replaced by [MASK], K = 10 %, ..., 90 %; plain mean over the 9 ratios of p(x) - p(x masked) "
        "(signed). NaN where the tokenizer has no mask token.",
        "deletion",
        needs_head=True,
    ),
    Metric(
        "accuracy_mask",
        "Accuracy, [MASK] (DecompX)",
        False,
        (0.0, 1.0),
        "DecompX §4.5: whether the inputs masked as in aopc_mask are still classified as the gold label, "
        "mean over the 9 ratios (the mean over examples is the paper's accuracy). NaN without a gold label.",
        "deletion",
        needs_head=True,
    ),
    Metric(
        "aopc_mask_least",
        "AOPC, least important [MASK]ed (DecompX)",
        False,
        (-1.0, 1.0),
        "DecompX Table A.2: as aopc_mask with the least important floor(K m) tokens masked.",
        "deletion",
        needs_head=True,
    ),
    Metric(
        "accuracy_mask_least",
        "Accuracy, least important [MASK]ed (DecompX)",
        True,
        (0.0, 1.0),
        "DecompX Table A.2: as accuracy_mask with the least important floor(K m) tokens masked.",
        "deletion",
        needs_head=True,
    ),
    Metric(
        "cue_dot",
        "Cue alignment: dot product",
        True,
        (0.0, 1.0),
        "Value zeroing §5: score mass on the cue tokens, S = |v| / sum|v|; per layer and global.",
        "cue",
        per_layer=True,
        needs_cues=True,
    ),
    Metric(
        "cue_ap",
        "Cue alignment: average precision",
        True,
        (0.0, 1.0),
        "Value zeroing Eq. 12: average precision of the ranking by score against the cue vector.",
        "cue",
        per_layer=True,
        needs_cues=True,
    ),
    Metric(
        "cue_probes",
        "Cue alignment: probes needed",
        False,
        (0.0, math.inf),
        "Value zeroing App. A.2: non-cue tokens ranked strictly above the best cue token.",
        "cue",
        per_layer=True,
        needs_cues=True,
    ),
    Metric(
        "cue_mrr",
        "Cue reciprocal rank (signed scores)",
        True,
        (0.0, 1.0),
        "ALTI-Logit §4.2 (Ferrando et al. 2023): 1 / the best rank of a cue token, the tokens ranked by the "
        "signed score (negative evidence ranks low), as the official code: dense ranks, rank = n - dense + 1; "
        "the mean over examples is the MRR.",
        "cue",
        per_layer=True,
        needs_cues=True,
    ),
    Metric(
        "change",
        "Contextualization change (1 - rho)",
        None,
        (0.0, 2.0),
        "FF paper §5.1: 1 - Spearman rho between the flattened n x n maps of two scopes, per layer.",
        "analysis",
        per_layer=True,
    ),
]

METRICS: dict[str, Metric] = {m.name: m for m in _FIXED}
DELETION_METRICS = tuple(m.name for m in _FIXED if m.family == "deletion")
CUE_METRICS = tuple(m.name for m in _FIXED if m.family == "cue")

SPEARMAN_HELP = (
    "spearman:REF (Spearman rho against method REF's saliency), spearman:|REF| (against |REF|), "
    "either with a /nopos suffix to leave the explained position out"
)


def metric_names() -> list[str]:
    """Valid metric names, the parametrised Spearman form first."""
    return ["spearman:REF"] + list(METRICS)


def get_metric(spec: str) -> Metric:
    """The Metric of a name: a fixed name (`METRICS`) or ``spearman:REF`` / ``spearman:|REF|``
    with an optional ``/nopos`` suffix. REF is not checked against the method list here."""
    if not isinstance(spec, str) or not spec.strip():
        raise BadInput(f"a metric name must be a non-empty string; valid: {', '.join(metric_names())}")
    spec = spec.strip()
    if spec in METRICS:
        return METRICS[spec]
    if spec.startswith("spearman:"):
        ref = spec[len("spearman:") :]
        nopos = ref.endswith("/nopos")
        if nopos:
            ref = ref[: -len("/nopos")]
        absolute = len(ref) > 2 and ref.startswith("|") and ref.endswith("|")
        if absolute:
            ref = ref[1:-1]
        if not ref or not ref.replace("_", "").replace("+", "").isalnum():
            raise BadInput(f"malformed metric {spec!r}: expected {SPEARMAN_HELP}")
        shown = f"|{ref}|" if absolute else ref
        return Metric(
            spec,
            f"Spearman vs {shown}" + (" (explained position left out)" if nopos else ""),
            True,
            (-1.0, 1.0),
            f"Spearman's rho between the method's saliency and {shown}'s, per example.",
            "reference",
            reference=ref,
            reference_abs=absolute,
            exclude_position=nopos,
        )
    raise BadInput(f"unknown metric {spec!r}; valid metrics: {', '.join(metric_names())} ({SPEARMAN_HELP})")


# ---------------------------------------------------------------------------------------------
# rank correlation and agreement
# ---------------------------------------------------------------------------------------------


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rho (average ranks); NaN when either vector is constant or lengths differ."""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    if a.shape != b.shape or a.size < 2 or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(stats.spearmanr(a, b).statistic)


def reference_spearman(saliency, reference, metric: Metric, position: int | None = None) -> float:
    """A ``reference``-family metric on one example."""
    s = np.asarray(saliency, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    if metric.reference_abs:
        r = np.abs(r)
    if metric.exclude_position and position is not None:
        keep = np.ones(len(s), dtype=bool)
        keep[position] = False
        s, r = s[keep], r[keep]
    return spearman(s, r)


def method_agreement(saliency: dict[str, np.ndarray]) -> pd.DataFrame:
    """Pairwise Spearman between the methods' saliency vectors of one example (methods x methods)."""
    names = list(saliency)
    M = np.full((len(names), len(names)), np.nan)
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            M[i, j] = 1.0 if i == j else spearman(saliency[a], saliency[b])
    return pd.DataFrame(M, index=names, columns=names)


def model_agreement(saliency_a, saliency_b, tokens_a=None, tokens_b=None) -> float:
    """Spearman between two models' saliency of one example; NaN unless the token sequences
    agree (the models must share a tokenizer, as BERT and DistilBERT in ALTI's Fig. 7)."""
    if tokens_a is not None and tokens_b is not None and list(tokens_a) != list(tokens_b):
        return float("nan")
    return spearman(saliency_a, saliency_b)


# ---------------------------------------------------------------------------------------------
# cue alignment
# ---------------------------------------------------------------------------------------------


def normalise_scores(v) -> np.ndarray:
    """|v| / sum |v| (uniform when all are zero): non-negative, sums to one."""
    a = np.abs(np.nan_to_num(np.asarray(v, dtype=np.float64)))
    s = a.sum()
    return a / s if s > 0 else np.full_like(a, 1.0 / max(1, a.size))


def _cue_vector(n: int, cues: Iterable[int]) -> np.ndarray:
    xi = np.zeros(n, dtype=bool)
    for c in cues:
        if not -n <= int(c) < n:
            raise BadInput(f"cue position {c} is outside the {n} tokens")
        xi[int(c)] = True
    if not xi.any():
        raise BadInput("an example needs at least one cue position")
    return xi


def cue_dot(scores, cues: Iterable[int]) -> float:
    """Score mass on the cue tokens after |v|/sum|v| normalisation."""
    S = normalise_scores(scores)
    return float(S[_cue_vector(len(S), cues)].sum())


def average_precision(scores, relevant) -> float:
    """AP = sum_n (R_n - R_{n-1}) P_n over the distinct score thresholds, descending
    (sklearn's average_precision_score, tied scores form one threshold)."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(relevant, dtype=bool)
    if not y.any():
        return float("nan")
    order = np.argsort(-s, kind="stable")
    s, y = s[order], y[order]
    last = np.r_[np.nonzero(np.diff(s))[0], len(s) - 1]  # last index of each tie group
    tp = np.cumsum(y)[last]
    precision = tp / (last + 1)
    recall = tp / y.sum()
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def cue_ap(scores, cues: Iterable[int]) -> float:
    S = normalise_scores(scores)
    return average_precision(S, _cue_vector(len(S), cues))


def cue_probes(scores, cues: Iterable[int]) -> float:
    """Non-cue tokens scored strictly above the best-scored cue token (ties favour the cue)."""
    S = normalise_scores(scores)
    xi = _cue_vector(len(S), cues)
    return float(np.sum(S[~xi] > S[xi].max()))


def cue_rr(scores, cues: Iterable[int]) -> float:
    """Reciprocal rank of the best-ranked cue token by the *signed* scores, as the ALTI-Logit code:
    rank_desc = n - rankdata(scores, "dense") + 1 (so with tied scores the top rank can exceed 1)."""
    s = np.asarray(scores, dtype=np.float64)
    xi = _cue_vector(len(s), cues)
    rank_desc = len(s) - stats.rankdata(s, method="dense") + 1
    return float(1.0 / rank_desc[xi].min())


_CUE_FUNCS: dict[str, Callable] = {"cue_dot": cue_dot, "cue_ap": cue_ap, "cue_probes": cue_probes, "cue_mrr": cue_rr}


def cue_alignment(scores, cues: Iterable[int], metrics: Iterable[str] = CUE_METRICS) -> dict[str, float]:
    cues = list(cues)
    return {m: _CUE_FUNCS[m](scores, cues) for m in metrics}


def cue_alignment_layers(
    layer_maps: np.ndarray, position: int, cues: Iterable[int], metrics: Iterable[str] = CUE_METRICS
) -> dict[str, np.ndarray]:
    """Per layer (1..L) cue alignment of row `position` of each layer map (L, n, n)."""
    cues = list(cues)
    metrics = list(metrics)
    out = {m: np.empty(len(layer_maps)) for m in metrics}
    for l, M in enumerate(np.asarray(layer_maps)):
        for m in metrics:
            out[m][l] = _CUE_FUNCS[m](M[position], cues)
    return out


# ---------------------------------------------------------------------------------------------
# deletion metrics
# ---------------------------------------------------------------------------------------------


def ranked_positions(saliency, deletable: Sequence[int]) -> list[int]:
    """Deletable positions by descending signed score, ties by position (NaN last)."""
    s = np.asarray(saliency, dtype=np.float64)
    key = np.where(np.isnan(s), -np.inf, s)
    return sorted(deletable, key=lambda i: (-key[i], i))


def deyoung_ks(m: int, bins: Sequence[float] = DEYOUNG_BINS) -> list[int]:
    """Tokens removed (comprehensiveness) or kept (sufficiency) per bin: max(1, round(b m)), <= m."""
    return [min(m, max(1, int(round(b * m)))) for b in bins] if m else []


def attcat_ks(n: int, m: int, levels: int = ATTCAT_LEVELS) -> list[int]:
    """AttCAT's deletion sizes: round(j/levels * n) for j = 0..levels (n counts special tokens),
    deduplicated, 0 dropped, then each capped at the m deletable tokens."""
    if m <= 0:
        return []
    ks = list(dict.fromkeys(int(round(j / levels * n)) for j in range(levels + 1)))
    return [min(k, m) for k in ks if k > 0]


def decompx_mask_counts(m: int) -> list[int]:
    """Tokens masked per DecompX ratio: floor(K m) for K = 0.1..0.9, in exact integer arithmetic
    (floor(j m / 10)); zeros stay (the paper's mean runs over all 9 ratios, K m < 1 included)."""
    return [j * m // 10 for j in MASK_RATIOS_TENTHS]


def perturb(
    ids: Sequence[int],
    positions: Iterable[int],
    mode: str,
    pad_id: int,
    position: int | None = None,
    types: Sequence[int] | None = None,
):
    """Delete the ids at `positions` (mode "delete") or overwrite them with `pad_id` ("pad").
    Returns the new ids and where the explained `position` is now; with a pair's token_type_ids
    `types`, also the new types (deleting tokens moves the segment boundary with them)."""
    drop = set(int(p) for p in positions)
    if mode == "pad":
        new, pos, ty = [pad_id if i in drop else t for i, t in enumerate(ids)], position, types
    elif mode != "delete":
        raise ValueError("mode must be 'delete' or 'pad'")
    else:
        new = [t for i, t in enumerate(ids) if i not in drop]
        ty = None if types is None else [t for i, t in enumerate(types) if i not in drop]
        pos = None if position is None else position - sum(1 for p in drop if p < position)
    return (new, pos) if types is None else (new, pos, None if ty is None else list(ty))


def pad_token_id(tokenizer) -> int:
    for attr in ("pad_token_id", "unk_token_id", "eos_token_id"):
        v = getattr(tokenizer, attr, None)
        if v is not None:
            return int(v)
    return 0


def protected_positions(model, ids: Sequence[int], position: int | None) -> set[int]:
    """Positions deletion metrics never touch: special tokens, and the explained position of a
    language model (the [MASK] or the last token)."""
    from ctxmix.engine.tokens import structural_ids

    special = structural_ids(model.tokenizer)  # [UNK] is a word: it may be deleted
    keep = {i for i, t in enumerate(ids) if t in special}
    if model.kind in ("masked_lm", "causal_lm") and position is not None:
        keep.add(int(position))
    return keep


class TargetProbability:
    """p(target | ids) for many id sequences: right-padded batches with an attention mask,
    sorted by length, at most `batch_size` sequences and `max_tokens` padded tokens a batch.

    Classifiers: softmax over the labels. Language models: softmax over the vocabulary at each
    sequence's own position; with `foil`, sigma(l_target - l_foil) (value zeroing's two-way
    probability). Probabilities in float64.
    """

    def __init__(self, model, target: int, foil: int | None = None, batch_size: int = 32, max_tokens: int = 16384):
        if model.kind == "encoder":
            raise BadInput(f"deletion metrics need a model with a head; {model.name!r} has none")
        self.model = model
        self.target = int(target)
        self.foil = None if foil is None else int(foil)
        self.batch_size = max(1, int(batch_size))
        self.max_tokens = max(1, int(max_tokens))
        self.pad = pad_token_id(model.tokenizer)
        self.calls = 0  # forward passes, for tests and timing

    @torch.no_grad()
    def __call__(
        self,
        seqs: Sequence[Sequence[int]],
        positions: Sequence[int | None] | None = None,
        token_type_ids: Sequence[Sequence[int] | None] | None = None,
        with_class: bool = False,
    ):
        """token_type_ids: one row (or None) per sequence, for sentence pairs on BERT-like models.
        with_class: also return each sequence's argmax class (token, for a language model), for the
        accuracy metrics: (probabilities, classes)."""
        n = len(seqs)
        positions = list(positions) if positions is not None else [None] * n
        types = list(token_type_ids) if token_type_ids is not None else [None] * n
        out = np.full(n, np.nan)
        classes = np.full(n, -1, dtype=np.int64)
        order = sorted(range(n), key=lambda i: len(seqs[i]))
        start = 0
        while start < n:
            stop = start + 1
            while (
                stop < n
                and stop - start < self.batch_size
                and (stop - start + 1) * max(1, len(seqs[order[stop]])) <= self.max_tokens
            ):
                stop += 1
            idx = order[start:stop]
            out[idx], classes[idx] = self._batch(
                [list(seqs[i]) or [self.pad] for i in idx],
                [positions[i] for i in idx],
                [types[i] if seqs[i] else None for i in idx],
            )
            start = stop
        return (out, classes) if with_class else out

    def _batch(
        self, seqs: list[list[int]], positions: list[int | None], types: list | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        m = self.model
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[b, : len(s)] = 1
        self.calls += 1
        tt = m.type_ids_kwargs(types, width) if types and any(t is not None for t in types) else {}
        from ctxmix.engine.attention import output_only

        with output_only(m):  # no probabilities read: the fast kernel, this call's pass only
            logits = m.hf(input_ids=ids.to(m.device), attention_mask=mask.to(m.device), **tt).logits.double()
        if m.kind != "classifier":
            rows = [
                len(s) - 1 if p is None or m.kind == "causal_lm" and p >= len(s) else p for s, p in zip(seqs, positions)
            ]
            logits = logits[torch.arange(len(seqs)), torch.tensor(rows)]
        classes = logits.argmax(-1).cpu().numpy()
        if self.foil is not None:
            return torch.sigmoid(logits[:, self.target] - logits[:, self.foil]).cpu().numpy(), classes
        return torch.softmax(logits, -1)[:, self.target].cpu().numpy(), classes


def _plan(metric: str, ranked: list[int], n: int, m: int, stop_one_short: bool = False) -> tuple[str, list[list[int]]]:
    """(mode, list of position sets to remove) for one deletion metric. stop_one_short: AttCAT's
    levels never remove the last of the m deletable tokens (the AttCAT code's i != n - 1)."""
    if metric == "comprehensiveness":
        return "delete", [ranked[:k] for k in deyoung_ks(m)]
    if metric == "sufficiency":
        return "delete", [ranked[k:] for k in deyoung_ks(m)]
    if metric in ("aopc_mask", "accuracy_mask"):
        return "mask", [ranked[:k] for k in decompx_mask_counts(m)]
    if metric in ("aopc_mask_least", "accuracy_mask_least"):
        return "mask", [ranked[len(ranked) - k :] for k in decompx_mask_counts(m)]
    mode = "pad" if metric in ("aopc_pad", "lodds") else "delete"
    ks = attcat_ks(n, m)
    if stop_one_short:
        ks = list(dict.fromkeys(k for k in (min(k, m - 1) for k in ks) if k > 0))
    return mode, [ranked[:k] for k in ks]


def _reduce(metric: str, p0: float, ps: np.ndarray) -> float:
    if len(ps) == 0:
        return float("nan")
    if metric in ("comprehensiveness", "sufficiency"):
        return float(np.mean(p0 - ps))
    if metric in ("aopc", "aopc_pad"):
        return float(np.mean(np.abs(p0 - ps)))
    if metric in ("aopc_mask", "aopc_mask_least"):
        return float(np.mean(p0 - ps))
    if metric in ("lodds", "lodds_delete"):
        return float(np.mean(np.log(np.clip(ps, PROB_FLOOR, None) / max(p0, PROB_FLOOR))))
    raise BadInput(f"{metric!r} is not a deletion metric; those are {', '.join(DELETION_METRICS)}")


def deletion_metrics(
    predict: Callable,
    ids: Sequence[int],
    saliency: dict[str, np.ndarray],
    metrics: Iterable[str],
    protected: set[int] = frozenset(),
    position: int | None = None,
    pad_id: int = 0,
    p0: float | None = None,
    token_type_ids: Sequence[int] | None = None,
    abs_saliency: bool = False,
    stop_one_short: bool = False,
    mask_id: int | None = None,
    gold: int | None = None,
) -> tuple[dict[str, dict[str, float]], float]:
    """Deletion metrics of several methods on one example, every perturbed input predicted in
    one batched call. `predict(seqs, positions[, token_type_ids][, with_class=True]) -> probabilities
    [, classes]` (a `TargetProbability`). token_type_ids: a sentence pair's, deleted along with their
    tokens. abs_saliency: rank by |score| (the AttCAT QQP notebook); stop_one_short: see `_plan`.
    mask_id: the tokenizer's mask token (the [MASK] metrics are NaN without one); gold: the example's
    label (the accuracy metrics are NaN without one).

    Returns ({method: {metric: value}}, p0). No deletable token -> NaN.
    """
    metrics = [m for m in metrics if m in DELETION_METRICS]
    unavailable = {m for m in metrics if m in MASK_METRICS and mask_id is None}
    unavailable |= {m for m in metrics if m in ACCURACY_METRICS and gold is None}
    metrics = [m for m in metrics if m not in unavailable]
    ids = list(ids)
    n = len(ids)
    deletable = [i for i in range(n) if i not in protected]
    index: dict[tuple, int] = {}  # identical perturbed inputs (shared by metrics or methods) run once
    seqs: list[list[int]] = []
    poss: list[int | None] = []
    typs: list = []

    def slot(seq: list[int], pos: int | None, ty=None) -> int:
        key = (tuple(seq), pos, None if ty is None else tuple(ty))
        if key not in index:
            index[key] = len(seqs)
            seqs.append(seq)
            poss.append(pos)
            typs.append(ty)
        return index[key]

    types = None if token_type_ids is None else list(token_type_ids)
    if types is not None and len(types) != n:
        raise BadInput(f"token_type_ids has {len(types)} entries for {n} tokens")
    orig = slot(ids, position, types)
    slots: dict[tuple[str, str], list[int]] = {}
    for meth, s in saliency.items():
        s = np.asarray(s, dtype=np.float64)
        if s.shape != (n,):
            raise BadInput(f"saliency of {meth!r} has shape {s.shape}, expected ({n},)")
        ranked = ranked_positions(np.abs(s) if abs_saliency else s, deletable)
        for metric in metrics:
            mode, removals = _plan(metric, ranked, n, len(deletable), stop_one_short)
            if not deletable:
                removals = []
            fill = mask_id if mode == "mask" else pad_id
            mode = "pad" if mode == "mask" else mode  # [MASK] overwrites in place, as the pad id does
            slots[(meth, metric)] = [slot(*perturb(ids, rem, mode, fill, position, types)) for rem in removals]
    want_class = any(m in ACCURACY_METRICS for m in metrics)
    classes = None
    if p0 is not None and len(seqs) == 1 and not want_class:
        probs = np.array([p0])
    else:
        args = (seqs, poss) if types is None else (seqs, poss, typs)
        got = predict(*args, with_class=True) if want_class else predict(*args)
        probs, classes = got if want_class else (got, None)
    if p0 is None:
        p0 = float(probs[orig])
    out: dict[str, dict[str, float]] = {meth: {m: float("nan") for m in sorted(unavailable)} for meth in saliency}
    for (meth, metric), sl in slots.items():
        if metric in ACCURACY_METRICS:
            out[meth][metric] = float(np.mean(classes[sl] == gold)) if sl else float("nan")
        else:
            out[meth][metric] = _reduce(metric, p0, probs[sl])
    return out, float(p0)


def describe(names: Iterable[str] | None = None) -> pd.DataFrame:
    """The metrics' metadata as a table (name, title, direction, range, family, description)."""
    ms = [get_metric(n) for n in names] if names is not None else list(METRICS.values())
    return pd.DataFrame(
        [
            {
                "metric": m.name,
                "title": m.title,
                "better": m.direction,
                "range": f"[{m.range[0]}, {m.range[1]}]",
                "family": m.family,
                "description": m.description,
            }
            for m in ms
        ]
    )


__all__ = [
    "Metric",
    "METRICS",
    "DELETION_METRICS",
    "CUE_METRICS",
    "DEYOUNG_BINS",
    "ATTCAT_LEVELS",
    "get_metric",
    "metric_names",
    "spearman",
    "reference_spearman",
    "method_agreement",
    "model_agreement",
    "normalise_scores",
    "cue_dot",
    "cue_ap",
    "cue_probes",
    "cue_rr",
    "average_precision",
    "cue_alignment",
    "cue_alignment_layers",
    "ranked_positions",
    "deyoung_ks",
    "attcat_ks",
    "perturb",
    "pad_token_id",
    "protected_positions",
    "TargetProbability",
    "deletion_metrics",
    "describe",
]
