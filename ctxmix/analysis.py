"""The FF paper's corpus analyses (Kobayashi et al. 2024, §5-6): contextualization change,
FF-amplified token pairs, FF outlier dimensions against the next norm's gamma, and the norm
of the FF output against the vector RES2 bypasses. Layers are numbered from 1 in the tables.
"""

from __future__ import annotations

import random
import warnings
from collections import defaultdict
from typing import Callable, Iterable, Iterator

import numpy as np
import pandas as pd
import torch
from scipy import stats
from tqdm.auto import tqdm

from .errors import BadInput
from .methods import scope_layer_maps
from .models import Model
from .trace import Trace, iter_trace_batch

POST_COMPARISONS = {  # name -> (before, after)
    "+Ff": ("Atb", "AtbFf"), "+Res": ("AtbFf", "AtbFfRes"), "+Ln": ("AtbFfRes", "AtbFfResLn"),
    "dyn:FF": ("Atb", "AtbFf"), "dyn:FF+RES": ("Atb", "AtbFfRes"), "dyn:FF+RES+LN": ("Atb", "AtbFfResLn"),
}
PRE_COMPARISONS = {  # the dynamics are relative to the map just before the FF, as in the paper's Fig. 22
    "+Ln": ("Atb", "AtbLn"), "+Ff": ("AtbLn", "AtbLnFf"), "+Res": ("AtbLnFf", "AtbLnFfRes"),
    "dyn:FF": ("AtbLn", "AtbLnFf"), "dyn:FF+RES": ("AtbLn", "AtbLnFfRes"), "dyn:FF+RES+LN": ("AtbLn", "AtbLnFfResLn"),
}


def comparisons(model: Model) -> dict[str, tuple[str, str]]:
    return POST_COMPARISONS if model.spec.position == "post" else PRE_COMPARISONS


def mask_tokens(model: Model, ids: list[int], rate: float, rng: random.Random) -> list[int]:
    """Replace max(1, int(rate * k)) of the k non-special tokens by the mask token (FF paper
    footnote 2, after its predecessor's code: mask only, no 80/10/10)."""
    mask_id = getattr(model.tokenizer, "mask_token_id", None)
    if mask_id is None:
        raise BadInput(f"{model.name!r} has no mask token; masking applies to masked language models only")
    special = set(model.tokenizer.all_special_ids)
    normal = [i for i, t in enumerate(ids) if t not in special]
    if not normal:
        return ids
    ids = list(ids)
    for i in rng.sample(normal, max(1, int(rate * len(normal)))):
        ids[i] = mask_id
    return ids


Progress = bool | Callable[[int, int], None]


TRACE_BATCH = 8  # sequences per padded forward pass in corpus loops


def corpus_traces(model: Model, texts: Iterable[str], mask_rate: float = 0.0, seed: int = 0,
                  progress: Progress = True, desc: str = "sequences", batch_size: int | None = None) -> Iterator[Trace]:
    """Trace the texts in order, `batch_size` sequences per padded forward pass (one sequence's
    layer states held at a time); empty texts are skipped (and counted in a warning).
    progress: True for a tqdm bar, or a callable(done, total) (the dashboard's progress bar)."""
    texts = list(texts)
    if not texts:
        raise BadInput("the corpus is empty")
    batch_size = TRACE_BATCH if batch_size is None else batch_size
    if batch_size < 1:
        raise BadInput("batch_size must be at least 1")
    rng = random.Random(seed)
    skipped = 0
    bar = tqdm(total=len(texts), desc=desc, disable=progress is not True)
    for start in range(0, len(texts), batch_size):
        batch, notes = [], []
        for text in texts[start: start + batch_size]:
            if not isinstance(text, str) or not text.strip():
                skipped += 1
                continue
            ids, note = model.encode(text)
            batch.append(mask_tokens(model, ids, mask_rate, rng) if mask_rate else ids)
            notes.append(note)
        done = start
        for tr in iter_trace_batch(model, batch, notes) if batch else ():
            if callable(progress):
                progress(done, len(texts))
            yield tr
            done += 1
            bar.update(1)
        bar.update(min(len(texts), start + batch_size) - done)
    bar.close()
    if callable(progress):
        progress(len(texts), len(texts))
    if skipped:
        warnings.warn(f"{skipped} empty text(s) skipped", stacklevel=2)


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


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(stats.spearmanr(a, b).statistic)


class _ChangeAcc:
    """Accumulates 1 - rho per (layer, comparison) over sequences."""

    def __init__(self, model: Model, lower_triangle: bool):
        self.comps = comparisons(model)
        self.L = model.n_layers
        self.lower = lower_triangle
        self.scores: dict[tuple[int, str], list[float]] = defaultdict(list)

    def add(self, n: int, maps: dict[str, np.ndarray]) -> None:
        sel = np.tril_indices(n) if self.lower else (slice(None), slice(None))
        for l in range(self.L):
            for name, (a, b) in self.comps.items():
                if a in maps and b in maps:
                    rho = _spearman(maps[a][l][sel].ravel(), maps[b][l][sel].ravel())
                    if not np.isnan(rho):
                        self.scores[(l + 1, name)].append(1.0 - rho)

    def frame(self) -> pd.DataFrame:
        order = list(self.comps)
        rows = [{"layer": l, "comparison": c, "change": float(np.mean(v)), "std": float(np.std(v)), "n": len(v)}
                for (l, c), v in sorted(self.scores.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1])))]
        return pd.DataFrame(rows, columns=["layer", "comparison", "change", "std", "n"])


def ff_amp_matrix(before: np.ndarray, after: np.ndarray, normalise: str = "column") -> np.ndarray:
    """FF-amp of one map pair: normalised map after the FF minus normalised map before it.
    "column" makes each input token's column sum to 1 (footnote 3 read literally), "row" each output row."""
    if normalise not in ("column", "row"):
        raise BadInput("normalise must be 'column' or 'row'")
    axis = 0 if normalise == "column" else 1
    return (after / np.clip(after.sum(axis, keepdims=True), 1e-30, None)
            - before / np.clip(before.sum(axis, keepdims=True), 1e-30, None))


def ff_amp_scopes(model: Model) -> tuple[str, str]:
    """The maps just before and after the FF: (Atb, AtbFf) post-LN, (AtbLn, AtbLnFf) pre-LN."""
    return ("Atb", "AtbFf") if model.spec.position == "post" else ("AtbLn", "AtbLnFf")


class _AmpAcc:
    """Accumulates FF-amp scores per (layer, output token type, input token type), i != j."""

    def __init__(self, model: Model, normalise: str):
        ff_amp_matrix(np.ones((1, 1)), np.ones((1, 1)), normalise)  # validates the option early
        self.before, self.after = ff_amp_scopes(model)
        self.normalise = normalise
        self.acc = [defaultdict(lambda: [0.0, 0]) for _ in range(model.n_layers)]

    def add(self, tokens: list[str], maps: dict[str, np.ndarray]) -> None:
        ii, jj = np.nonzero(~np.eye(len(tokens), dtype=bool))
        for l, acc in enumerate(self.acc):
            D = ff_amp_matrix(maps[self.before][l], maps[self.after][l], self.normalise)
            for i, j, v in zip(ii, jj, D[ii, jj]):
                cell = acc[(tokens[i], tokens[j])]
                cell[0] += v
                cell[1] += 1

    def frame(self, top_k: int, min_count: int) -> pd.DataFrame:
        rows = []
        for l, d in enumerate(self.acc):
            pairs = sorted(((k, s / c, c) for k, (s, c) in d.items() if c >= min_count), key=lambda t: -t[1])
            rows += [{"layer": l + 1, "out_token": k[0], "in_token": k[1], "score": s, "count": c}
                     for k, s, c in pairs[:top_k]]
        return pd.DataFrame(rows, columns=["layer", "out_token", "in_token", "score", "count"])


def contextualization_change(model: Model, texts: Iterable[str], *, ignore_low_gamma: float = 0.0,
                             mask_rate: float = 0.0, seed: int = 0, lower_triangle: bool = False,
                             res2: str = "exact", progress: Progress = True) -> pd.DataFrame:
    """Per layer and comparison, mean and std over sequences of 1 - Spearman rho between the
    flattened scope maps before and after a component (FF paper §5.1).

    Comparisons "+Ff", "+Res", "+Ln" are the component changes (Fig. 3); "dyn:FF", "dyn:FF+RES",
    "dyn:FF+RES+LN" compare against the map just before the FF (Fig. 6). ignore_low_gamma=0.01
    leaves the lowest-gamma 1 % of dimensions out of every norm (Fig. 32). mask_rate=0.12 masks
    12 % of the tokens of masked LMs, as the paper does. lower_triangle keeps only j <= i
    (causal models' upper triangle is all zeros; the paper flattens all n^2 cells).
    Columns: layer (from 1), comparison, change, std, n (sequences with a defined rho).
    """
    return corpus_report(model, texts, ignore_low_gamma=ignore_low_gamma, mask_rate=mask_rate, seed=seed,
                         lower_triangle=lower_triangle, res2=res2, progress=progress, amp=False)["change"]


def ff_amp(model: Model, texts: Iterable[str], *, normalise: str = "column", top_k: int = 50, min_count: int = 2,
           mask_rate: float = 0.0, seed: int = 0, progress: Progress = True) -> pd.DataFrame:
    """FF-amplified token pairs (FF paper §5.2): normalised map after the FF minus before it
    (AtbFf - Atb; AtbLnFf - AtbLn in pre-LN), averaged per (output token, input token) type
    pair over the corpus, i != j, pairs seen fewer than `min_count` times dropped; top k per layer.
    normalise="column" makes each input token's column sum to 1 (the paper's footnote 3, read
    literally); "row" makes each output row sum to 1.
    Columns: layer, out_token, in_token, score, count."""
    return corpus_report(model, texts, mask_rate=mask_rate, seed=seed, normalise=normalise, top_k=top_k,
                         min_count=min_count, progress=progress, change=False)["ff_amp"]


def corpus_report(model: Model, texts: Iterable[str], *, ignore_low_gamma: float = 0.0, mask_rate: float = 0.0,
                  seed: int = 0, lower_triangle: bool = False, res2: str = "exact", normalise: str = "column",
                  top_k: int = 50, min_count: int = 2, change: bool = True, amp: bool = True,
                  progress: Progress = True) -> dict[str, pd.DataFrame]:
    """The contextualization change and the FF-amp pairs from one pass over the corpus
    (the scope maps, the expensive part, are computed once per sequence; twice only when the
    outlier ablation needs norms without the lowest-gamma dimensions)."""
    keep = low_gamma_dims(model, ignore_low_gamma)
    ch = _ChangeAcc(model, lower_triangle) if change else None
    am = _AmpAcc(model, normalise) if amp else None
    for tr in corpus_traces(model, texts, mask_rate, seed, progress, desc="FF analyses"):
        maps = scope_layer_maps(tr, res2=res2, keep_dims=keep, next_ln=change)
        if ch is not None:
            ch.add(tr.n, maps)
        if am is not None:
            am.add(tr.tokens, maps if keep is None else scope_layer_maps(tr, res2=res2))
    out = {}
    if ch is not None:
        out["change"] = ch.frame()
    if am is not None:
        out["ff_amp"] = am.frame(top_k, min_count)
    return out


def _ff_stats(model: Model, texts, mask_rate, seed, progress, desc):
    """Sums over all tokens: |FF input|, |FF output| per dimension; ||FF out||, ||bypass|| per token."""
    L = model.n_layers
    d = model.layers[0].Wo.shape[1]
    s_in = np.zeros((L, d))
    s_out = np.zeros((L, d))
    n_out, n_byp = np.zeros(L), np.zeros(L)
    count = 0
    with torch.no_grad():
        for tr in corpus_traces(model, texts, mask_rate, seed, progress, desc=desc):
            count += tr.n
            for l, st in enumerate(tr.states):
                bypass = st.z if model.spec.position == "post" else st.r1
                s_in[l] += st.z.abs().sum(0).double().cpu().numpy()
                s_out[l] += st.ff.abs().sum(0).double().cpu().numpy()
                n_out[l] += st.ff.norm(dim=-1).sum().item()
                n_byp[l] += bypass.norm(dim=-1).sum().item()
    return s_in / count, s_out / count, n_out / count, n_byp / count


def ff_outliers(model: Model, texts: Iterable[str], *, mask_rate: float = 0.0, seed: int = 0,
                progress: Progress = True) -> pd.DataFrame:
    """Per layer and dimension: gamma of the norm that next processes the FF output (LN2 in
    post-LN; the next layer's LN1, or the final norm, in pre-LN), and the mean |FF input| and
    mean |FF output| over all tokens of the corpus (FF paper §6.2, Fig. 8).
    Columns: layer (from 1), dim, gamma, ff_in_mean_abs, ff_out_mean_abs."""
    m_in, m_out, _, _ = _ff_stats(model, texts, mask_rate, seed, progress, "FF outliers")
    frames = []
    for l, lw in enumerate(model.layers):
        gamma = lw.ff_norm.gamma.double().cpu().numpy()
        frames.append(pd.DataFrame({"layer": l + 1, "dim": np.arange(len(gamma)), "gamma": gamma,
                                    "ff_in_mean_abs": m_in[l], "ff_out_mean_abs": m_out[l]}))
    return pd.concat(frames, ignore_index=True)


def ff_outlier_correlations(outliers: pd.DataFrame) -> pd.DataFrame:
    """Per layer, Pearson and Spearman r between gamma and mean |FF output| over dimensions
    (the paper reports Pearson; RoBERTa needs Spearman). Columns: layer, pearson, spearman."""
    rows = []
    for l, g in outliers.groupby("layer"):
        x, y = g["gamma"].to_numpy(), g["ff_out_mean_abs"].to_numpy()
        ok = np.ptp(x) > 0 and np.ptp(y) > 0
        rows.append({"layer": int(l), "pearson": float(stats.pearsonr(x, y).statistic) if ok else float("nan"),
                     "spearman": float(stats.spearmanr(x, y).statistic) if ok else float("nan")})
    return pd.DataFrame(rows, columns=["layer", "pearson", "spearman"])


def ff_residual_norms(model: Model, texts: Iterable[str], *, mask_rate: float = 0.0, seed: int = 0,
                      progress: Progress = True) -> pd.DataFrame:
    """Per layer, mean L2 norm over tokens of the FF output and of the vector RES2 bypasses
    around it (the attention-block output in post-LN, the residual stream in pre-LN; §6.1).
    Columns: layer, ff_out_norm, bypass_norm, ratio (bypass / FF)."""
    _, _, n_out, n_byp = _ff_stats(model, texts, mask_rate, seed, progress, "RES2 norms")
    return pd.DataFrame({"layer": np.arange(1, model.n_layers + 1), "ff_out_norm": n_out,
                         "bypass_norm": n_byp, "ratio": n_byp / np.clip(n_out, 1e-30, None)})
