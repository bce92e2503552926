"""The FF paper's corpus analyses (Kobayashi et al. 2024, §5-6): contextualization change,
FF-amplified token pairs, FF outlier dimensions against the next norm's gamma, and the norm
of the FF output against the vector RES2 bypasses. Layers are numbered from 1 in the tables.
(Over 500 lines: the four analyses share one length-bucketed corpus pass, `corpus_report`.)
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import pandas as pd
import torch
from scipy import stats

from ctxmix.analyses.ranks import masked_ranks, spearman_from_ranks
from ctxmix.engine.budget import batch_size_for, job_slot, memory_budget
from ctxmix.engine.models import Model
from ctxmix.engine.tokens import structural_ids
from ctxmix.engine.trace import Trace, TraceBatch, trace_batch_tensors
from ctxmix.errors import BadInput, checked_arguments
from ctxmix.methods.mixing import scope_maps_batch
from ctxmix.progress import progress_bar

POST_COMPARISONS = {  # name -> (before, after)
    "+Ff": ("Atb", "AtbFf"),
    "+Res": ("AtbFf", "AtbFfRes"),
    "+Ln": ("AtbFfRes", "AtbFfResLn"),
    "dyn:FF": ("Atb", "AtbFf"),
    "dyn:FF+RES": ("Atb", "AtbFfRes"),
    "dyn:FF+RES+LN": ("Atb", "AtbFfResLn"),
}
PRE_COMPARISONS = {  # the dynamics are relative to the map just before the FF, as in the paper's Fig. 22
    "+Ln": ("Atb", "AtbLn"),
    "+Ff": ("AtbLn", "AtbLnFf"),
    "+Res": ("AtbLnFf", "AtbLnFfRes"),
    "dyn:FF": ("AtbLn", "AtbLnFf"),
    "dyn:FF+RES": ("AtbLn", "AtbLnFfRes"),
    "dyn:FF+RES+LN": ("AtbLn", "AtbLnFfResLn"),
}


PARALLEL_COMPARISONS = {  # y = x + ATTN(LN1 x) + FF(LN2 x): the FF adds to each token's own row only
    "+Ff": ("Atb", "AtbFf"),
    "+Res": ("AtbFf", "AtbFfRes"),
    "+Ln": ("AtbFfRes", "AtbFfResLn"),
    "dyn:FF": ("Atb", "AtbFf"),
    "dyn:FF+RES": ("Atb", "AtbFfRes"),
    "dyn:FF+RES+LN": ("Atb", "AtbFfResLn"),
}


SANDWICH_COMPARISONS = {  # Gemma 2/3: the FF's output norm LNf is its own step, before RES2
    "+Ln": ("Atb", "AtbLn"),
    "+Ff": ("AtbLn", "AtbLnFf"),
    "+FfLn": ("AtbLnFf", "AtbLnFfLn"),
    "+Res": ("AtbLnFfLn", "AtbLnFfLnRes"),
    "dyn:FF": ("AtbLn", "AtbLnFf"),
    "dyn:FF+LN": ("AtbLn", "AtbLnFfLn"),
    "dyn:FF+LN+RES": ("AtbLn", "AtbLnFfLnRes"),
    "dyn:FF+LN+RES+LN": ("AtbLn", "AtbLnFfLnResLn"),
}


def comparisons(model: Model) -> dict[str, tuple[str, str]]:
    return {
        "post": POST_COMPARISONS,
        "pre": PRE_COMPARISONS,
        "parallel": PARALLEL_COMPARISONS,
        "sandwich": SANDWICH_COMPARISONS,
    }[model.spec.position]


def mask_tokens(model: Model, ids: list[int], rate: float, rng: random.Random) -> list[int]:
    """Replace max(1, int(rate * k)) of the k non-special tokens by the mask token (FF paper
    footnote 2, after its predecessor's code: mask only, no 80/10/10)."""
    mask_id = getattr(model.tokenizer, "mask_token_id", None)
    if mask_id is None:
        raise BadInput(f"{model.name!r} has no mask token; masking applies to masked language models only")
    special = structural_ids(model.tokenizer) | {mask_id}  # [UNK] stands for a word: it may be masked
    normal = [i for i, t in enumerate(ids) if t not in special]
    if not normal:
        return ids
    ids = list(ids)
    for i in rng.sample(normal, max(1, int(rate * len(normal)))):
        ids[i] = mask_id
    return ids


Progress = bool | Callable[[int, int], None]


TRACE_BATCH = None  # sequences per padded batch in corpus loops: None sizes it from the memory budget


def _cut(model: Model, ids: list[int], max_tokens: int) -> list[int]:
    """ids cut to max_tokens, keeping the closing special token where the model adds one."""
    if len(ids) <= max_tokens:
        return ids
    special = structural_ids(model.tokenizer)
    return ids[: max_tokens - 1] + [ids[-1]] if ids[-1] in special and max_tokens > 1 else ids[:max_tokens]


def encode_corpus(
    model: Model,
    texts: Iterable[str],
    mask_rate: float = 0.0,
    seed: int = 0,
    max_tokens: int | None = None,
    max_total_tokens: int | None = None,
) -> tuple[list[int], list[list[int]], list[list[str]], int]:
    """Token ids of every non-empty text, masked in text order (so masking does not depend on
    batching). `max_tokens` cuts longer sequences (with a warning: a server's cap), and a corpus
    of more than `max_total_tokens` tokens in all is refused before any work.
    Returns (text indices, ids, notes, number of empty texts skipped)."""
    if isinstance(texts, str):
        raise BadInput("texts must be a list of strings, not one string")
    texts = list(texts)
    if not texts:
        raise BadInput("the corpus is empty")
    for name, v in (("max_tokens", max_tokens), ("max_total_tokens", max_total_tokens)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 2):
            raise BadInput(f"{name} must be a whole number of at least 2, got {v!r}")
    rng = random.Random(seed)
    index, ids_list, notes, skipped, cut = [], [], [], 0, 0
    for k, text in enumerate(texts):
        if not isinstance(text, str) or not text.strip():
            skipped += 1
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # one warning for the corpus, below
            ids, note = model.encode(text)
        if max_tokens is not None and len(ids) > max_tokens:
            ids, cut = _cut(model, ids, max_tokens), cut + 1
        ids_list.append(mask_tokens(model, ids, mask_rate, rng) if mask_rate else ids)
        notes.append(note)
        index.append(k)
    if not index:
        raise BadInput(f"every text of the corpus ({len(texts)}) is empty")
    total = sum(len(ids) for ids in ids_list)
    if max_total_tokens is not None and total > max_total_tokens:
        raise BadInput(
            f"the corpus has {total} tokens in all; the cap here is {max_total_tokens}: use fewer or shorter sequences"
        )
    if cut:
        warnings.warn(f"{cut} sequence(s) cut to {max_tokens} tokens", stacklevel=3)
    long = sum(1 for note in notes if note)
    if long:
        warnings.warn(f"{long} sequence(s) truncated to the model's maximum of {model.max_length} tokens", stacklevel=3)
    return index, ids_list, notes, skipped


def plan_batches(
    model: Model, lengths: list[int], batch_size: int | None = None, max_waste: float | None = None
) -> list[list[int]]:
    """Length-bucketed batches: positions into `lengths`, sorted by length (stable). A batch grows
    while the memory budget holds it at its longest length (or up to `batch_size`) and while
    padding adds at most `max_waste` to its n^2 work (the decompositions cost n^2 per sequence:
    a 33-token text padded to 120 would cost 13 times its own work). Default waste: 10 % on a
    CPU, where batching saves only Python and launch overhead, 30 % on CUDA."""
    if batch_size is not None and batch_size < 1:
        raise BadInput("batch_size must be at least 1")
    if max_waste is None:
        max_waste = 0.3 if torch.device(model.device).type == "cuda" else 0.1
    order = sorted(range(len(lengths)), key=lambda k: lengths[k])
    budget = memory_budget(model.device) if batch_size is None else None  # read once per plan
    batches: list[list[int]] = []
    start = 0
    while start < len(order):
        # sorted ascending, so the batch's longest sequence is its last one: grow while it fits
        size, work = 1, lengths[order[start]] ** 2
        while start + size < len(order):
            n = lengths[order[start + size]]
            cap = batch_size if batch_size is not None else batch_size_for(model, n, budget=budget)
            if size + 1 > cap or (batch_size is None and (size + 1) * n * n > (1 + max_waste) * (work + n * n)):
                break
            size += 1
            work += n * n
        batches.append(order[start : start + size])
        start += size
    return batches


def corpus_batches(
    model: Model,
    texts: Iterable[str],
    mask_rate: float = 0.0,
    seed: int = 0,
    progress: Progress = True,
    desc: str = "sequences",
    batch_size: int | None = None,
    max_tokens: int | None = None,
    max_total_tokens: int | None = None,
) -> Iterator[tuple[list[int], TraceBatch]]:
    """Trace the corpus in length-bucketed padded batches: yields (text indices, TraceBatch).
    Empty texts are skipped (and counted in a warning). progress: True for a tqdm bar, or a
    callable(done, total) (the dashboard's progress bar). For an image or speech model the corpus is of images or
    clips (`_input_batches`)."""
    if model.spec.inputs != "ids":
        yield from _input_batches(model, texts, mask_rate, progress, desc)
        return
    index, ids_list, notes, skipped = encode_corpus(model, texts, mask_rate, seed, max_tokens, max_total_tokens)
    total = len(index) + skipped
    bar = progress_bar(total, desc, progress is True)
    done = skipped
    bar.update(skipped)
    batch_size = TRACE_BATCH if batch_size is None else batch_size
    for batch in plan_batches(model, [len(ids) for ids in ids_list], batch_size):
        if callable(progress):
            progress(done, total)
        tb = trace_batch_tensors(model, [ids_list[k] for k in batch], [notes[k] for k in batch])
        yield [index[k] for k in batch], tb
        done += len(batch)
        bar.update(len(batch))
    bar.close()
    if callable(progress):
        progress(total, total)
    if skipped:
        warnings.warn(f"{skipped} empty text(s) skipped", stacklevel=2)


def _input_batches(model: Model, items, mask_rate: float, progress: Progress, desc: str):
    """An image model's corpus (image paths, arrays, PIL images or `ImageInput`s) or a speech model's (WAV paths,
    WAV bytes or `AudioInput`s), traced one at a time: yields ([index], TraceBatch of one)."""
    from ctxmix.engine.inputs import audio_input, image_input, trace_input

    if mask_rate:
        raise BadInput("mask_rate masks tokens of a text model; images and clips have none")
    items = list(items)
    make = image_input if model.spec.inputs == "pixels" else audio_input
    bar = progress_bar(len(items), desc, progress is True)
    for k, item in enumerate(items):
        if callable(progress):
            progress(k, len(items))
        yield [k], TraceBatch.of(trace_input(model, make(model, item)))
        bar.update(1)
    bar.close()
    if callable(progress):
        progress(len(items), len(items))


def corpus_traces(
    model: Model,
    texts: Iterable[str],
    mask_rate: float = 0.0,
    seed: int = 0,
    progress: Progress = True,
    desc: str = "sequences",
    batch_size: int | None = None,
) -> Iterator[Trace]:
    """One-sequence Traces of the corpus (views into length-bucketed batches), in batch order."""
    for _, tb in corpus_batches(model, texts, mask_rate, seed, progress, desc, batch_size):
        errs = tb.errors.tolist()
        for b in range(tb.B):
            yield tb.trace(b, errs[b])


def low_gamma_dims(model: Model, fraction: float) -> list[torch.Tensor] | None:
    """Per layer, a (d,) mask keeping all but the `fraction` of dimensions with the lowest
    (signed) gamma of the norm that next processes the FF output (the FF paper's §6.2 ablation:
    1 % = 7 of 768 dimensions in BERT-base)."""
    if not fraction:
        return None
    keep = []
    for lw in model.layers:
        gamma = lw.ff_norm.gamma
        k = int(np.floor(fraction * gamma.numel()))
        m = torch.ones_like(gamma, dtype=torch.bool)
        m[torch.argsort(gamma)[:k]] = False
        keep.append(m)
    return keep


class _ChangeAcc:
    """1 - Spearman rho per (sequence, layer, comparison), computed and kept on the device."""

    def __init__(self, model: Model, lower_triangle: bool):
        self.comps = comparisons(model)
        self.lower = lower_triangle
        self.index: list[int] = []
        self.values: list[torch.Tensor] = []  # (B, L, K) float64 per batch
        self.names: list[str] | None = None

    def add(self, index: list[int], tb: TraceBatch, maps: dict[str, torch.Tensor]) -> None:
        names = [c for c, (a, b) in self.comps.items() if a in maps and b in maps]
        self.names = names
        mask = tb.mask
        valid = mask[:, :, None] & mask[:, None, :]  # (B, n, n)
        if self.lower:
            valid = valid & torch.ones_like(valid[0]).tril()
        valid = valid.flatten(1)[:, None]  # (B, 1, n*n)
        scopes = dict.fromkeys(s for c in names for s in self.comps[c])
        ranks = {s: masked_ranks(maps[s].flatten(2), valid) for s in scopes}
        rho = torch.stack(
            [spearman_from_ranks(ranks[self.comps[c][0]], ranks[self.comps[c][1]], valid) for c in names], -1
        )  # (B, L, K)
        self.index += index
        self.values.append(1.0 - rho)

    def frame(self) -> pd.DataFrame:
        cols = ["layer", "comparison", "change", "std", "n"]
        if not self.values:
            return pd.DataFrame(columns=cols)
        order = np.argsort(self.index, kind="stable")  # text order: the result does not depend on batching
        V = torch.cat(self.values).cpu().numpy()[order]  # (N, L, K): the one transfer of the pass
        rows = []
        for l in range(V.shape[1]):
            for k, c in enumerate(self.names):
                v = V[:, l, k]
                v = v[~np.isnan(v)]
                if len(v):
                    rows.append(
                        {
                            "layer": l + 1,
                            "comparison": c,
                            "change": float(np.mean(v)),
                            "std": float(np.std(v)),
                            "n": len(v),
                        }
                    )
        return pd.DataFrame(rows, columns=cols)


def ff_amp_matrix(before: np.ndarray, after: np.ndarray, normalise: str = "column") -> np.ndarray:
    """FF-amp of one map pair: normalised map after the FF minus normalised map before it.
    "column" makes each input token's column sum to 1 (footnote 3 read literally), "row" each output row."""
    if normalise not in ("column", "row"):
        raise BadInput("normalise must be 'column' or 'row'")
    axis = 0 if normalise == "column" else 1
    return after / np.clip(after.sum(axis, keepdims=True), 1e-30, None) - before / np.clip(
        before.sum(axis, keepdims=True), 1e-30, None
    )


def ff_amp_scopes(model: Model) -> tuple[str, str]:
    """The maps just before and after the FF: (Atb, AtbFf) post-LN and parallel, (AtbLn, AtbLnFf) pre-LN."""
    return ("AtbLn", "AtbLnFf") if model.spec.position in ("pre", "sandwich") else ("Atb", "AtbFf")


def _ff_amp_t(before: torch.Tensor, after: torch.Tensor, normalise: str) -> torch.Tensor:
    """`ff_amp_matrix` on batched maps (..., n, n) in float64 (zero padding adds nothing to a sum)."""
    dim = -2 if normalise == "column" else -1
    before, after = before.double(), after.double()
    return after / after.sum(dim, keepdim=True).clamp(min=1e-30) - before / before.sum(dim, keepdim=True).clamp(
        min=1e-30
    )


class _AmpAcc:
    """FF-amp sums and counts per (layer, output token id, input token id), i != j, kept sparse on
    the device: one int64 key per cell, coalesced (sorted, summed) when the pending cells outgrow
    the coalesced ones, never a V x V table."""

    def __init__(self, model: Model, normalise: str):
        ff_amp_matrix(np.ones((1, 1)), np.ones((1, 1)), normalise)  # validates the option early
        self.model = model
        self.before, self.after = ff_amp_scopes(model)
        self.normalise = normalise
        self.V = max(int(getattr(model.config, "vocab_size", 0) or 0), len(model.tokenizer))
        self.keys = self.sums = self.counts = None
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pending_size = 0

    def add(self, tb: TraceBatch, maps: dict[str, torch.Tensor]) -> None:
        dev = maps[self.before].device
        D = _ff_amp_t(maps[self.before], maps[self.after], self.normalise)  # (B, L, n, n)
        B, L, n, _ = D.shape
        ids = tb.ids
        mask = tb.mask
        valid = mask[:, :, None] & mask[:, None, :] & ~torch.eye(n, dtype=torch.bool, device=dev)
        layer = torch.arange(L, device=dev).view(1, L, 1, 1)
        keys = (layer * self.V + ids.view(B, 1, n, 1)) * self.V + ids.view(B, 1, 1, n)
        keys = torch.where(valid[:, None], keys, torch.full_like(keys, -1))  # -1: no cell (dropped later)
        self.pending.append((keys.flatten(), D.flatten()))
        self.pending_size += keys.numel()
        if self.pending_size > max(2**24, 0 if self.keys is None else 2 * self.keys.numel()):
            self._coalesce()

    def _coalesce(self) -> None:
        if not self.pending:
            return
        keys = torch.cat([k for k, _ in self.pending])
        vals = torch.cat([v for _, v in self.pending])
        cnts = torch.ones_like(keys)
        if self.keys is not None:
            keys = torch.cat([self.keys, keys])
            vals = torch.cat([self.sums, vals])
            cnts = torch.cat([self.counts, cnts])
        uniq, inv = torch.unique(keys, sorted=True, return_inverse=True)
        sums = torch.zeros(len(uniq), dtype=torch.float64, device=keys.device).index_add_(0, inv, vals)
        counts = torch.zeros(len(uniq), dtype=torch.long, device=keys.device).index_add_(0, inv, cnts)
        keep = uniq >= 0
        self.keys, self.sums, self.counts = uniq[keep], sums[keep], counts[keep]
        self.pending, self.pending_size = [], 0

    def frame(self, top_k: int, min_count: int) -> pd.DataFrame:
        cols = ["layer", "out_token", "in_token", "score", "count"]
        self._coalesce()
        if self.keys is None or not len(self.keys):
            return pd.DataFrame(columns=cols)
        keys, sums, counts = self.keys.cpu().numpy(), self.sums.cpu().numpy(), self.counts.cpu().numpy()
        layer, rest = np.divmod(keys, self.V * self.V)
        out_id, in_id = np.divmod(rest, self.V)
        score = sums / counts
        rows = []
        for l in range(self.model.n_layers):
            sel = np.nonzero((layer == l) & (counts >= min_count))[0]
            sel = sel[np.argsort(-score[sel], kind="stable")][:top_k]
            out_tok = self.model.tokens(out_id[sel].tolist())
            in_tok = self.model.tokens(in_id[sel].tolist())
            rows += [
                {"layer": l + 1, "out_token": o, "in_token": i, "score": float(score[k]), "count": int(counts[k])}
                for o, i, k in zip(out_tok, in_tok, sel)
            ]
        return pd.DataFrame(rows, columns=cols)


class _FFStats:
    """Sums over all real tokens, on the device: |FF input| and |FF output| per dimension,
    ||FF output|| and ||RES2 bypass|| per layer, and the token count."""

    def __init__(self, model: Model):
        L, d = model.n_layers, model.widths["d"]
        dev = model.device
        self.model = model
        self.s_in = torch.zeros(L, d, dtype=torch.float64, device=dev)
        self.s_out = torch.zeros(L, d, dtype=torch.float64, device=dev)
        self.n_out = torch.zeros(L, dtype=torch.float64, device=dev)
        self.n_byp = torch.zeros(L, dtype=torch.float64, device=dev)
        self.count = torch.zeros((), dtype=torch.float64, device=dev)

    def add(self, tb: TraceBatch) -> None:
        w = tb.mask.double()  # (B, n)
        self.count += w.sum()
        for l, st in enumerate(tb.states):
            bypass = st.z if self.model.spec.position == "post" else st.r1
            self.s_in[l] += torch.einsum("bn,bnd->d", w, st.z.abs().double())
            self.s_out[l] += torch.einsum("bn,bnd->d", w, st.ff.abs().double())
            self.n_out[l] += (st.ff.double().norm(dim=-1) * w).sum()
            self.n_byp[l] += (bypass.double().norm(dim=-1) * w).sum()

    def means(self):
        c = float(self.count.clamp(min=1))
        return (
            self.s_in.cpu().numpy() / c,
            self.s_out.cpu().numpy() / c,
            self.n_out.cpu().numpy() / c,
            self.n_byp.cpu().numpy() / c,
        )


@checked_arguments
def contextualization_change(
    model: Model,
    texts: Iterable[str],
    *,
    ignore_low_gamma: float = 0.0,
    mask_rate: float = 0.0,
    seed: int = 0,
    lower_triangle: bool = False,
    res2: str = "exact",
    progress: Progress = True,
    batch_size: int | None = None,
    precision: str | None = None,
) -> pd.DataFrame:
    """Per layer and comparison, mean and std over sequences of 1 - Spearman rho between the
    flattened scope maps before and after a component (FF paper §5.1).

    Comparisons "+Ff", "+Res", "+Ln" are the component changes (Fig. 3); "dyn:FF", "dyn:FF+RES",
    "dyn:FF+RES+LN" compare against the map just before the FF (Fig. 6). ignore_low_gamma=0.01
    leaves the lowest-gamma 1 % of dimensions out of every norm (Fig. 32). mask_rate=0.12 masks
    12 % of the tokens of masked LMs, as the paper does. lower_triangle keeps only j <= i
    (causal models' upper triangle is all zeros; the paper flattens all n^2 cells).
    Columns: layer (from 1), comparison, change, std, n (sequences with a defined rho).
    """
    return corpus_report(
        model,
        texts,
        ignore_low_gamma=ignore_low_gamma,
        mask_rate=mask_rate,
        seed=seed,
        lower_triangle=lower_triangle,
        res2=res2,
        progress=progress,
        amp=False,
        batch_size=batch_size,
        precision=precision,
    )["change"]


@checked_arguments
def ff_amp(
    model: Model,
    texts: Iterable[str],
    *,
    normalise: str = "column",
    top_k: int = 50,
    min_count: int = 2,
    mask_rate: float = 0.0,
    seed: int = 0,
    progress: Progress = True,
    batch_size: int | None = None,
    precision: str | None = None,
) -> pd.DataFrame:
    """FF-amplified token pairs (FF paper §5.2): normalised map after the FF minus before it
    (AtbFf - Atb; AtbLnFf - AtbLn in pre-LN), averaged per (output token, input token) type
    pair over the corpus, i != j, pairs seen fewer than `min_count` times dropped; top k per layer.
    normalise="column" makes each input token's column sum to 1 (the paper's footnote 3, read
    literally); "row" makes each output row sum to 1.
    Columns: layer, out_token, in_token, score, count."""
    return corpus_report(
        model,
        texts,
        mask_rate=mask_rate,
        seed=seed,
        normalise=normalise,
        top_k=top_k,
        min_count=min_count,
        progress=progress,
        change=False,
        batch_size=batch_size,
        precision=precision,
    )["ff_amp"]


def _check_fraction(name: str, v, low: float, high: float, high_open: bool = True) -> float:
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or not (low <= v < high if high_open else low <= v <= high)
    ):
        raise BadInput(f"{name} must be a number in [{low}, {high}{')' if high_open else ']'}, got {v!r}")
    return float(v)


@checked_arguments
def corpus_report(
    model: Model,
    texts: Iterable[str],
    *,
    ignore_low_gamma: float = 0.0,
    mask_rate: float = 0.0,
    seed: int = 0,
    lower_triangle: bool = False,
    res2: str = "exact",
    normalise: str = "column",
    top_k: int = 50,
    min_count: int = 2,
    change: bool = True,
    amp: bool = True,
    norms: bool = False,
    outliers: bool = False,
    progress: Progress = True,
    batch_size: int | None = None,
    precision: str | None = None,
    max_tokens: int | None = None,
    max_total_tokens: int | None = None,
) -> dict[str, pd.DataFrame]:
    """The FF paper's corpus reports from one pass over the corpus: "change"
    (`contextualization_change`), "ff_amp" (`ff_amp`), "residual_norms" (`ff_residual_norms`) and
    "outliers" (`ff_outliers`), each asked for by its flag.

    Sequences go through in length-bucketed padded batches (`batch_size` per batch, or as many as
    the memory budget holds); the scope maps, their ranks and every sum stay on the model's device
    and only the final tables come back. The scope maps are computed once per batch (twice only
    when the outlier ablation needs norms without the lowest-gamma dimensions and FF-amp needs
    them with). `precision` ("float32", "tf32", "bf16"; the model's default if None) applies to
    the large products of the scope decomposition. `max_tokens` cuts longer sequences and
    `max_total_tokens` refuses a larger corpus before any work (a shared server's caps)."""
    from ctxmix.engine.precision import resolve_precision

    precision = resolve_precision(model, precision)
    _check_fraction("ignore_low_gamma", ignore_low_gamma, 0.0, 1.0)
    _check_fraction("mask_rate", mask_rate, 0.0, 1.0, high_open=False)
    if mask_rate and model.spec.causal:
        raise BadInput(
            f"mask_rate applies to bidirectional models (the FF paper masks BERT's and RoBERTa's input); "
            f"{model.name!r} is causal"
        )
    if res2 not in ("exact", "diagonal"):
        raise BadInput(f"res2 must be 'exact' or 'diagonal', got {res2!r}")
    for name, v in (("top_k", top_k), ("min_count", min_count)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise BadInput(f"{name} must be a whole number of at least 1, got {v!r}")
    keep = low_gamma_dims(model, ignore_low_gamma)
    ch = _ChangeAcc(model, lower_triangle) if change else None
    am = _AmpAcc(model, normalise) if amp else None
    st = _FFStats(model) if (norms or outliers) else None
    with job_slot(), torch.no_grad():
        for index, tb in corpus_batches(
            model,
            texts,
            mask_rate,
            seed,
            progress,
            desc="FF analyses",
            batch_size=batch_size,
            max_tokens=max_tokens,
            max_total_tokens=max_total_tokens,
        ):
            if ch is not None or am is not None:
                maps = scope_maps_batch(tb, res2=res2, keep_dims=keep, next_ln=change, precision=precision)
                if ch is not None:
                    ch.add(index, tb, maps)
                if am is not None:
                    am.add(tb, maps if keep is None else scope_maps_batch(tb, res2=res2, precision=precision))
                del maps
            if st is not None:
                st.add(tb)
    out = {}
    if ch is not None:
        out["change"] = ch.frame()
    if am is not None:
        out["ff_amp"] = am.frame(top_k, min_count)
    if st is not None:
        m_in, m_out, n_out, n_byp = st.means()
        if norms:
            out["residual_norms"] = pd.DataFrame(
                {
                    "layer": np.arange(1, model.n_layers + 1),
                    "ff_out_norm": n_out,
                    "bypass_norm": n_byp,
                    "ratio": n_byp / np.clip(n_out, 1e-30, None),
                }
            )
        if outliers:
            frames = []
            for l, lw in enumerate(model.layers):
                gamma = lw.ff_norm.gamma.double().cpu().numpy()
                frames.append(
                    pd.DataFrame(
                        {
                            "layer": l + 1,
                            "dim": np.arange(len(gamma)),
                            "gamma": gamma,
                            "ff_in_mean_abs": m_in[l],
                            "ff_out_mean_abs": m_out[l],
                        }
                    )
                )
            out["outliers"] = pd.concat(frames, ignore_index=True)
    return out


@checked_arguments
def ff_report(
    model: Model, texts: Iterable[str], *, mask_rate: float = 0.0, seed: int = 0, progress: Progress = True, **caps
) -> dict[str, pd.DataFrame]:
    """`ff_outliers` ("outliers") and `ff_residual_norms` ("residual_norms") from one pass;
    `caps`: max_tokens, max_total_tokens (see corpus_report)."""
    return corpus_report(
        model,
        texts,
        mask_rate=mask_rate,
        seed=seed,
        change=False,
        amp=False,
        norms=True,
        outliers=True,
        progress=progress,
        **caps,
    )


@checked_arguments
def ff_outliers(
    model: Model, texts: Iterable[str], *, mask_rate: float = 0.0, seed: int = 0, progress: Progress = True
) -> pd.DataFrame:
    """Per layer and dimension: gamma of the norm that next processes the FF output (LN2 in
    post-LN; the next layer's LN1, or the final norm, in pre-LN), and the mean |FF input| and
    mean |FF output| over all tokens of the corpus (FF paper §6.2, Fig. 8).
    Columns: layer (from 1), dim, gamma, ff_in_mean_abs, ff_out_mean_abs."""
    return corpus_report(
        model, texts, mask_rate=mask_rate, seed=seed, change=False, amp=False, outliers=True, progress=progress
    )["outliers"]


def ff_outlier_correlations(outliers: pd.DataFrame) -> pd.DataFrame:
    """Per layer, Pearson and Spearman r between gamma and mean |FF output| over dimensions
    (the paper reports Pearson; RoBERTa needs Spearman). Columns: layer, pearson, spearman."""
    rows = []
    for l, g in outliers.groupby("layer"):
        x, y = g["gamma"].to_numpy(), g["ff_out_mean_abs"].to_numpy()
        ok = np.ptp(x) > 0 and np.ptp(y) > 0
        rows.append(
            {
                "layer": int(l),
                "pearson": float(stats.pearsonr(x, y).statistic) if ok else float("nan"),
                "spearman": float(stats.spearmanr(x, y).statistic) if ok else float("nan"),
            }
        )
    return pd.DataFrame(rows, columns=["layer", "pearson", "spearman"])


@checked_arguments
def ff_residual_norms(
    model: Model, texts: Iterable[str], *, mask_rate: float = 0.0, seed: int = 0, progress: Progress = True
) -> pd.DataFrame:
    """Per layer, mean L2 norm over tokens of the FF output and of the vector RES2 bypasses
    around it (the attention-block output in post-LN, the residual stream in pre-LN; §6.1).
    Columns: layer, ff_out_norm, bypass_norm, ratio (bypass / FF)."""
    return corpus_report(
        model, texts, mask_rate=mask_rate, seed=seed, change=False, amp=False, norms=True, progress=progress
    )["residual_norms"]
