"""Ablation methods of context attribution: ContextCite and leave-one-out (docs/context.md).

Every ablation removes sources from the context *text* (the "remove" counterfactual, as ContextCite's; not AT2's
attention masking: docs/context.md, "Choices where the papers leave room"), rebuilds and re-tokenises the prompt,
appends the fixed response ids, and reads the response's per-token logit-probabilities
l_t = z_{r_t} - logsumexp_{v != r_t} z_v = log p_t - log(1 - p_t) (ContextCite's per-token logit-probability,
formed without 1 - p_t, so stable) from one forward pass. Passes are batched (sorted by length, right-padded: see
`response_logit_probs` for why not left), with explicit position ids, and form only the rows' logits that hold the
response (HF's `logits_to_keep`), taken in float32 or the model's float64.

ContextCite (Cohen-Wang, Shah, Georgiev, Madry, NeurIPS 2024; official code MadryLab/context-cite):
masks i.i.d. Bernoulli(keep_prob) drawn as the official code draws them
(`RandomState(s + i).choice([False, True], size=d, p=[1 - keep, keep])`, True = keep), from s = the
caller's seed (the official scheme, compat's) or, by default, s = `example_seed(seed, context, query)`
(each example its own masks); target
y = logit P(span) aggregated from the span's l_t; LASSO (alpha 0.01, intercept, random_state 0) on
standardised masks with y divided by the span's token count T and the weights rescaled back (w =
coef / scale * T; the effective penalty on the original scale is alpha * T). Where ctxmix's
default differs from the official package (`compat=True` reproduces it; docs/context.md, "Choices
where the papers leave room"):

- the aggregation y = log P - log(1 - P) uses a stable log(1 - P) (log(-expm1(log P)) near P = 1), in
  float64; the official float32 `log1p(-exp(log P))` overflows to +inf when P rounds to 1, and the
  LASSO then fails (compat reproduces the float32 arithmetic and refuses an infinite target, saying so);
- the text before the first source and after the last is kept (the official rebuild drops it even for
  the full context): `Sources.rebuild`;
- the response ids are the generated ids without the end-of-sequence token: `methods.context.prompt`;
- masks, logit-probabilities and the fit are float64 (the official code fits float32 masks and targets).

Leave-one-out: one pass with every source and one per removed source (d + 1 passes); a source's score
is log P(span | context) - log P(span | context without it), natural log, positive when the source
makes the span more likely (ContextCite's top-k drop with k = 1 on that source).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ctxmix.engine.attention import accepts, ctxmix_pass, current_pass, install_once, output_only
from ctxmix.engine.budget import memory_budget
from ctxmix.engine.models import Model
from ctxmix.errors import BadInput

MIN_ABLATIONS, MAX_ABLATIONS = 2, 1024
MAX_LOO_SOURCES = 256  # leave-one-out makes one full-length pass per source
LASSO_ALPHA = 0.01


def check_n_ablations(n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not MIN_ABLATIONS <= n <= MAX_ABLATIONS:
        raise BadInput(f"n_ablations must be a whole number from {MIN_ABLATIONS} to {MAX_ABLATIONS}, got {n!r}")
    return int(n)


SEED_SCHEMES = ("example", "official")
EXAMPLE_SEED_RANGE = 2**31  # example seeds stay below it: seed + i and the held-out seeds fit RandomState's 2^32


def example_seed(seed: int, *texts: str | None) -> int:
    """The first mask seed of one example under the "example" scheme: a stable hash (SHA-256, not Python's
    salted hash()) of the caller's seed and the example's texts (context, query), below 2^31. Examples with
    different texts get unrelated masks (the official package's seeds 0..n-1 give every example the same
    ones, so their errors correlate across a benchmark); the same example gets the same masks on any machine."""
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps([int(seed), *texts], ensure_ascii=False).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % EXAMPLE_SEED_RANGE


def mask_seed(options: dict) -> int:
    """The first seed of an attribution's ContextCite masks (its options; saved before "mask_seed" was
    recorded: the official seed)."""
    return int(options.get("mask_seed", options["seed"]))


def contextcite_masks(n: int, d: int, seed: int = 0, keep_prob: float = 0.5) -> np.ndarray:
    """(n, d) bool, True = keep: mask i from RandomState(seed + i), as the official `_create_mask`."""
    return np.stack(
        [np.random.RandomState(seed + i).choice([False, True], size=d, p=[1 - keep_prob, keep_prob]) for i in range(n)]
    )


def log1mexp(x: np.ndarray) -> np.ndarray:
    """log(1 - exp(x)) for x <= 0, stable on both sides (Maechler 2012: expm1 above -log 2, log1p below)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return np.where(x > -np.log(2), np.log(-np.expm1(x)), np.log1p(-np.exp(x)))


def log_probs(logit_probs: np.ndarray) -> np.ndarray:
    """Sum over the last axis of log sigmoid(l_t) = log p_t: (..., T) -> (...,), float64."""
    lp = np.asarray(logit_probs, dtype=np.float64)
    return -np.logaddexp(0.0, -lp).sum(-1)


def aggregate(logit_probs: np.ndarray, compat: bool = False) -> np.ndarray:
    """ContextCite's target y = logit P(span) from per-token logit-probs (m, T) -> (m,).
    compat: the official float32 torch arithmetic (infinite when P rounds to 1 in float32)."""
    if compat:
        t = torch.tensor(np.asarray(logit_probs, dtype=np.float32))
        lpt = torch.nn.functional.logsigmoid(t).sum(dim=1)
        return (lpt - torch.log1p(-torch.exp(lpt))).numpy()
    lp = log_probs(logit_probs)
    return lp - log1mexp(lp)


def lasso_fit(masks: np.ndarray, y: np.ndarray, n_tokens: int, alpha: float = LASSO_ALPHA, compat: bool = False):
    """The official solver: StandardScaler -> Lasso(alpha, fit_intercept=True, random_state=0) on y / T,
    weights rescaled to the masks' scale and multiplied back by T. Returns (weights (d,), bias)."""
    from sklearn.linear_model import Lasso
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    y = np.asarray(y)
    if not np.all(np.isfinite(y)):
        raise BadInput(
            "the ContextCite target logit P(span) is infinite: the span is so likely that P rounds to 1 in float32 "
            "(the official aggregation's overflow, reproduced by compat=True); use compat=False (stable) or a longer "
            "span"
        )
    X = masks.astype(np.float32 if compat else np.float64)
    Y = y / n_tokens
    scaler = StandardScaler()
    lasso = Lasso(alpha=alpha, random_state=0, fit_intercept=True)
    make_pipeline(scaler, lasso).fit(X, Y)
    w = lasso.coef_ / scaler.scale_
    b = lasso.intercept_ - (scaler.mean_ / scaler.scale_) @ lasso.coef_.T
    return np.asarray(w * n_tokens, dtype=np.float64), float(b * n_tokens)


def ablation_sequence_bytes(model: Model, n: int, K: int) -> int:
    """Bytes one sequence of n tokens holds during an output-only (SDPA) ablation pass that keeps K rows of logits
    (`ctxmix.engine.memory.ablation_sequence_bytes`: one layer's activations and the kept logits with their
    float32 copies; nothing of n x n)."""
    from ctxmix.engine import memory

    return memory.ablation_sequence_bytes(memory.widths_of(model), n, K)


def ablation_batch_size(model: Model, n: int, K: int, most: int) -> int:
    """Sequences per ablation pass: as many as the memory budget holds (`ablation_sequence_bytes`; nothing else
    is held during these passes, but a soft-capped family's block of eager attention rows, shared by the batch),
    at least 1, at most `most` (the caller's batch_size)."""
    from ctxmix.engine import memory

    W = memory.widths_of(model)
    room = memory_budget(model.device) - memory.attention_block_bytes(W, n) * W.eager_blocks
    fit = room // max(1, ablation_sequence_bytes(model, n, K))
    return int(max(1, min(most, fit)))


@torch.no_grad()
def response_logit_probs(
    model: Model, prompts: list[list[int]], response_ids: list[int], batch_size: int = 8, progress=None
) -> np.ndarray:
    """(m, T) float64 per-token logit-probabilities of the fixed response after each prompt.

    Sequences are sorted by length and batched with right padding (pad keys come after every real
    token, so the causal mask already hides them, and they are not masked otherwise, so no row is left with
    every key masked: left padding, or masked right padding longer than a sliding window, gives such rows,
    whose softmax is NaN and leaks through 0 * NaN), explicit
    position ids 0..len-1; only the last rows that hold some sequence's response rows are turned into
    logits (HF's `logits_to_keep`), and each sequence's T rows are gathered. The passes read no attention
    probabilities: they run the model's memory-efficient attention (`output_only`), and a batch holds at most
    `batch_size` sequences, fewer where the memory budget holds fewer (`ablation_batch_size`). progress(k):
    passes done."""
    T = len(response_ids)
    seqs = [list(p) + list(response_ids) for p in prompts]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    pad = getattr(model.tokenizer, "pad_token_id", None)
    pad = int(pad) if isinstance(pad, int) else 0
    hf = model.hf
    can_keep = accepts(hf, "logits_to_keep")
    cache = {"use_cache": False} if accepts(hf, "use_cache") else {}
    out = np.empty((len(seqs), T), dtype=np.float64)
    longest = max(len(q) for q in seqs)
    if _head_input(hf) is not None:  # the head runs on the T response rows only (`_response_rows_only`)
        kept = T
    else:
        kept = min(longest, longest - min(len(q) for q in seqs) + T + 1) if can_keep else longest  # most rows kept
    batch_size = ablation_batch_size(model, longest, kept, batch_size)
    done = 0
    with output_only(model):
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            out[idx] = _batch_logit_probs(model, [seqs[i] for i in idx], response_ids, pad, can_keep, cache)
            done += len(idx)
            if progress is not None:
                progress(done)
    return out


def _batch_logit_probs(model: Model, seqs: list[list[int]], response_ids: list[int], pad, can_keep, cache):
    """(B, T) float64 logit-probabilities of one right-padded batch (`response_logit_probs`)."""
    T, hf = len(response_ids), model.hf
    lens = [len(q) for q in seqs]
    width = max(lens)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    for b, q in enumerate(seqs):
        ids[b, : lens[b]] = torch.tensor(q)
    # no padding mask: right padding comes after every real token, so the causal mask hides it from every real
    # row; masking it too would leave a pad row with every key masked wherever the padding is longer than a
    # sliding window (Mistral, Gemma 2/3), whose NaN then leaks into real rows through 0 * NaN in the next layer.
    # An all-ones mask also lets SDPA run its causal kernel with no (B, n, n) mask.
    mask = torch.ones((len(seqs), width), dtype=torch.long)
    pos = torch.arange(width).expand(len(seqs), -1)
    wanted = torch.stack([torch.arange(n - T - 1, n - 1) for n in lens]).to(model.device)  # (B, T) response rows
    K = width - min(lens) + T + 1  # the kept rows cover every sequence's response rows
    gathered: list[bool] = []
    cut = _install_head_rows_hook(model)
    with ctxmix_pass(head_rows=(wanted, gathered) if cut else None):  # this call's pass only
        logits = hf(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            position_ids=pos.to(model.device),
            **({"logits_to_keep": 0 if cut else K} if can_keep else {}),
            **cache,
        ).logits
    if gathered and logits.shape[1] == T:  # the head ran on the response rows only: (B, T, V)
        z = logits
    else:
        first = width - logits.shape[1]  # the position of the first kept row
        rows = (wanted - first).to(logits.device)
        z = logits.gather(1, rows[..., None].expand(-1, -1, logits.shape[-1]))
    z = z if z.dtype == torch.float64 else z.float()  # log-softmax and sums in float32 at least (bf16 models too)
    r = torch.tensor(response_ids, device=z.device).expand(len(seqs), T)[..., None]
    correct = z.gather(-1, r)[..., 0]
    other = z.scatter(-1, r, -torch.inf).logsumexp(-1)
    return (correct - other).double().cpu().numpy()


def _head_input(hf) -> torch.nn.Module | None:
    """The module whose last hidden states the LM head reads (the decoder: OPT's `model.decoder`, Llama's
    `model`), when it is a separate module a hook can cut to some rows; None otherwise."""
    try:
        dec = hf.get_decoder()
    except (AttributeError, NotImplementedError):
        dec = getattr(hf, "base_model", None)
    return dec if isinstance(dec, torch.nn.Module) and dec is not hf else None


def _install_head_rows_hook(model: Model) -> bool:
    """Once per model: `_response_rows_only` on the module the LM head reads. Whether there is one."""
    head_input = _head_input(model.hf)
    if head_input is None:
        return False
    install_once(model.hf, "_ctxmix_head_rows_hook", lambda: head_input.register_forward_hook(_response_rows_only))
    return True


def _response_rows_only(module, args, out):
    """A forward hook on the base model, inert outside a pass that sets `head_rows`: its last hidden states
    (B, n, d) cut to each sequence's response rows (B, T) before the LM head reads them, so the head forms
    B x T x V logits, not B x K x V over the padded window K (which the ablations' different lengths widen to
    hundreds of rows). Another thread's forward of the same model is untouched."""
    p = current_pass()
    if p is None or p.head_rows is None:
        return None
    rows, done = p.head_rows
    h = getattr(out, "last_hidden_state", None)
    if not isinstance(h, torch.Tensor) or h.dim() != 3 or h.shape[0] != rows.shape[0]:
        return None
    out.last_hidden_state = h.gather(1, rows.to(h.device)[..., None].expand(-1, -1, h.shape[-1]))
    done.append(True)
    return out


def _passes(model, builder, prompts, response_ids, batch_size, progress, desc) -> tuple[np.ndarray, float]:
    from ctxmix.progress import progress_bar

    t0 = time.perf_counter()
    n = len(prompts)
    with progress_bar(n, desc, enabled=bool(progress) and not callable(progress), unit="pass") as bar:

        def report(k: int) -> None:
            bar.update(k - bar.n)
            if callable(progress):  # a page's bar: progress(stage, done, total)
                progress(desc, k, n)

        lp = response_logit_probs(model, prompts, response_ids, batch_size, report)
    return lp, time.perf_counter() - t0


def run_contextcite(
    model, builder, sources, response_ids, n_ablations, seed, keep_prob, batch_size, compat, progress
) -> dict:
    """The masks and the per-token logit-probabilities of ContextCite's ablations."""
    d = len(sources)
    masks = contextcite_masks(n_ablations, d, seed, keep_prob)
    return _ablated(model, builder, sources, masks, response_ids, batch_size, compat, progress, "contextcite")


def _ablated(model, builder, sources, masks, response_ids, batch_size, compat, progress, what: str) -> dict:
    """The response's per-token logit-probabilities under each mask (rows: masks, True = kept), the
    prompts rebuilt by the official rule (compat) or ctxmix's, with the passes' cost."""
    rule = "official" if compat else "ctxmix"
    prompts = [builder.ids(sources.rebuild(m, rule)) for m in masks]
    lp, secs = _passes(model, builder, prompts, response_ids, batch_size, progress, what)
    return {
        "masks": masks,
        "logit_probs": lp,
        "cost": {"forward": len(prompts), "backward": 0, "seconds": secs},
        "rule": rule,
    }


def run_leave_one_out(model, builder, sources, response_ids, batch_size, compat, progress) -> dict:
    """Row 0: every source kept; row 1 + i: source i removed."""
    d = len(sources)
    if d > MAX_LOO_SOURCES:
        raise BadInput(
            f"leave_one_out makes one pass per source; the context has {d} sources, over the limit of "
            f"{MAX_LOO_SOURCES}: use contextcite, or coarser sources (sources='paragraph')"
        )
    masks = np.ones((d + 1, d), dtype=bool)
    masks[np.arange(1, d + 1), np.arange(d)] = False
    return _ablated(model, builder, sources, masks, response_ids, batch_size, compat, progress, "leave_one_out")


def contextcite_scores(ablation: dict, a: int, b: int, compat: bool, alpha: float = LASSO_ALPHA):
    """(weights (d,), bias) of the LASSO for the response tokens a..b-1."""
    y = aggregate(ablation["logit_probs"][:, a:b], compat)
    return lasso_fit(ablation["masks"], y, b - a, alpha, compat)


def leave_one_out_scores(ablation: dict, a: int, b: int) -> np.ndarray:
    """log P(span | all) - log P(span | without source i), (d,)."""
    lp = log_probs(ablation["logit_probs"][:, a:b])
    return lp[0] - lp[1:]


def run_contextcite_job(job, names: list[str]) -> dict:
    """The registry's run function of ContextCite (`ctxmix.methods.context.job`): the ablations with the call's
    n_ablations, mask seed, keep_prob and compat, and the LASSO fitted on them for the whole response."""
    o = job.options
    compat = bool(o.get("compat"))
    n, keep, batch = int(o["n_ablations"]), float(o["keep_prob"]), int(o.get("batch_size", 8))
    ab = run_contextcite(
        job.model, job.builder, job.sources, job.response_ids, n, mask_seed(o), keep, batch, compat, job.progress
    )
    t0 = time.perf_counter()
    w, b = contextcite_scores(ab, 0, len(job.response_ids), compat, float(o["alpha"]))
    res = {
        "ablations": {"masks": ab["masks"], "logit_probs": ab["logit_probs"]},
        "scores": w,
        "intercept": b,
        "cost": {**ab["cost"], "seconds": ab["cost"]["seconds"] + time.perf_counter() - t0},
        "options": {"n_ablations": n},
    }
    if np.ptp(ab["logit_probs"].sum(1)) == 0:
        res["warnings"] = ["contextcite: the target is the same under every ablation; the scores are all zero"]
    return {names[0]: res}


def run_leave_one_out_job(job, names: list[str]) -> dict:
    """The registry's run function of leave-one-out (`ctxmix.methods.context.job`)."""
    o = job.options
    ab = run_leave_one_out(
        job.model,
        job.builder,
        job.sources,
        job.response_ids,
        int(o.get("batch_size", 8)),
        bool(o.get("compat")),
        job.progress,
    )
    T = len(job.response_ids)
    return {
        names[0]: {
            "ablations": {"masks": ab["masks"], "logit_probs": ab["logit_probs"]},
            "scores": leave_one_out_scores(ab, 0, T),
            "cost": ab["cost"],
        }
    }


def contextcite_span(ca, a: int, b: int) -> np.ndarray:
    """ContextCite's scores (d,) for the response tokens a..b-1: its LASSO refitted on the stored ablations."""
    w, _ = contextcite_scores(ca.ablations["contextcite"], a, b, bool(ca.options.get("compat")), ca.options["alpha"])
    return w


def leave_one_out_span(ca, a: int, b: int) -> np.ndarray:
    """Leave-one-out's scores (d,) for the response tokens a..b-1: the span's stored log-probability drops."""
    return leave_one_out_scores(ca.ablations["leave_one_out"], a, b)
