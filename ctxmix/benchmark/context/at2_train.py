"""Training `at2_exact`'s per-head weights as AT2 trains its estimator (Cohen-Wang et al. 2025, "Learning to
Attribute with Attention"; docs/context.md, "`at2_exact`"; `ctxmix at2-train`).

Training set, offline: the train split of `ctxmix.benchmark.context.data` (disjoint by source text from the
validation split, where the held-out table is built, and the test split, the benchmark's: those use gensim's Lee
background news; training uses the English Wikipedia extract shipped in gensim's test data, `data.wiki_paragraphs`,
less any paragraph sharing a sentence with a Lee text): needles (a fact sentence written for training,
`data.TRAIN_NEEDLES`, none of them another split's, inserted at a drawn sentence boundary of Wikipedia sentences,
and its question) and summaries ("Summarize the article in one sentence."), alternating, contexts of a drawn
length in [min, max] tokens. Per example
(`build_example`): the response generated greedily; one traced pass over prompt + response gives every feature kind
(`ctxmix.methods.context.at2.head_features`), aggregated per (unit, source) as AT2 aggregates (the mean over the
unit's tokens of the sum over the source's tokens), the units being the response's sentences; n_masks masks
(ContextCite's seeds 0..n-1, True = kept) labelled by REMOVAL: the sources deleted from the text, the prompt
re-tokenised, the fixed response ids appended (`methods.context.ablation._ablated`, the path of ContextCite and the
metrics), the per-token logit-probabilities stored. AT2's own "remove" path reads the original target rows of the
shortened sequence (the wrong rows) and AT2 trains on attention-masking labels; removal labels are the counterfactual
the benchmark's LDS measures. One .npz per example: a killed run resumes and skips finished examples.

Fit (`fit`), per feature kind, as AT2's trainer: mask-level features X(u, v) = sum_s (2 v_s - 1) f(u, s) (AT2's +-1
coding of the masks), prediction w . X, loss -Pearson over the masks (population std, 1e-8 in the denominator)
averaged over a batch of up to 512 examples drawn without replacement, one random target unit each; Adam lr 1e-3,
CosineAnnealingLR(T_max=steps), gradient norm clipped at 1.0, w initialised at 1/(L H), float32; seeded (AT2's
trainer has no seed); w L1-normalised at the end. The target of a unit is ContextCite's logit P(unit) (stable
aggregation, `methods.context.ablation.aggregate`).
"""

from __future__ import annotations

import datetime
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ctxmix.benchmark.context.data import (
    SPLIT_NEEDLES,
    SUMMARY_QUERY,
    WIKI_FILE,
    ContextExample,
    _cut,
    _insert,
    _sentences,
    split_texts,
)
from ctxmix.benchmark.context.prompt_form import cut_at_stop, example_query, prompt_form
from ctxmix.errors import BadInput
from ctxmix.methods.context.at2 import COMBINATIONS, ESTIMATORS, KINDS, estimator_kinds, stacked_features

BATCH = 512  # AT2's batch: examples per step, drawn without replacement


def _split(paragraph: str) -> list[str]:
    """A paragraph's sentences (itself when the splitter finds one)."""
    try:
        return _sentences(paragraph)
    except BadInput:
        return [paragraph]


def training_examples(
    n: int,
    min_tokens: int = 200,
    max_tokens: int = 400,
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
) -> list[ContextExample]:
    """n examples of the train split (`data.split_texts("train")`: Wikipedia paragraphs sharing no sentence with
    the validation and test splits' news texts): even i a needle (TRAIN_NEEDLES[(i // 2) % 10]), odd i a summary;
    contexts of whole sentences from consecutive paragraphs from a drawn one on, a drawn length in
    [min_tokens, max_tokens]."""
    count = count_tokens or (lambda s: len(s.split()))
    paras = split_texts("train")
    needles = SPLIT_NEEDLES["train"]
    out = []
    for i in range(n):
        rng = random.Random(f"at2-train:{seed}:{i}")
        start = rng.randrange(len(paras))  # consecutive paragraphs: mostly one article, as a summary needs
        sents = (s for k in range(start, start + len(paras)) for s in _split(paras[k % len(paras)]))
        if i % 2 == 0:
            nd = needles[(i // 2) % len(needles)]
            extra = count(nd.fact) + 1
            hay = _cut(sents, rng.randint(min_tokens, max_tokens) - extra, max_tokens - extra, count)
            text, gold = _insert(rng, hay, nd.fact)
            out.append(ContextExample(f"train-needle-{i}", "needles", text, nd.question, "sentence", [gold], nd.answer))
        else:
            text = " ".join(_cut(sents, rng.randint(min_tokens, max_tokens), max_tokens, count))
            out.append(ContextExample(f"train-summary-{i}", "summaries", text, SUMMARY_QUERY, "sentence"))
    return out


# ---------------------------------------------------------------- one example


def response_units(resp, how: str) -> list[tuple[int, int]]:
    """Target units (a, b) of response tokens: "response" the whole response; "sentences" each sentence of it
    (the offline splitter; every token touching the sentence), the whole response when it has one."""
    T = len(resp.ids)
    if how == "response":
        return [(0, T)]
    from ctxmix.methods.context.sources import make_sources

    try:
        spans = make_sources(resp.text, "sentence").spans
    except BadInput:
        return [(0, T)]
    off = np.asarray(resp.offsets)
    units = []
    for s, e in spans:
        hit = np.nonzero((off[:, 1] > s) & (off[:, 0] < e))[0]
        if len(hit):
            units.append((int(hit[0]), int(hit[-1]) + 1))
    return units or [(0, T)]


def build_example(
    model,
    ex: ContextExample,
    n_masks: int = 32,
    mask_seed: int = 0,
    units: str = "sentences",
    max_new_tokens: int = 48,
    batch_size: int = 8,
    prompt: dict | None = None,
) -> dict:
    """Everything AT2's trainer needs for one example, as arrays: features_<kind> (U, d, L H) float32,
    masks (m, d) bool (True = kept), logit_probs (m, T) float64 (removal ablations), units (U, 2), response_ids
    (T,), and "meta"
    (a JSON string: id, kind, gold, prompt/response lengths, response text, seconds, the prompt form). prompt: a
    `prompt_form` (query_suffix appended to the query, a generated response cut at `stop` as the benchmark cuts
    its stored responses)."""
    from ctxmix.engine.trace import trace_ids
    from ctxmix.methods.context.ablation import _ablated, contextcite_masks
    from ctxmix.methods.context.at2 import head_features, unit_features
    from ctxmix.methods.context.prompt import PromptBuilder, make_response
    from ctxmix.methods.context.sources import make_sources

    t0 = time.perf_counter()
    src = make_sources(ex.context, ex.sources)
    form = prompt_form(prompt)
    builder = PromptBuilder(model, example_query(form, ex), form.get("template"))
    prompt = builder.encode(src)
    response = ex.response
    if response is None and form.get("stop"):
        generated = make_response(model, builder, src, prompt, None, max_new_tokens, False)
        response = cut_at_stop(generated.text, form["stop"])
        if not response.strip():  # nothing before the stop: the whole response rather than no example
            response = generated.text
    resp = make_response(model, builder, src, prompt, response, max_new_tokens, False)
    P, T, d = len(prompt.ids), len(resp.ids), len(src)
    source_tokens = [np.nonzero(prompt.labels == i)[0].tolist() for i in range(d)]
    us = response_units(resp, units)
    t1 = time.perf_counter()
    ids = prompt.ids + resp.ids
    tr = trace_ids(model, ids)
    feats = head_features(model, tr, list(range(P - 1, P + T - 1)), list(resp.ids), KINDS)
    out = {f"features_{k}": unit_features(F, source_tokens, us) for k, F in feats.items()}
    del feats, tr
    t2 = time.perf_counter()
    masks = contextcite_masks(n_masks, d, mask_seed)
    ab = _ablated(model, builder, src, masks, resp.ids, batch_size, False, False, "at2")
    t3 = time.perf_counter()
    meta = {
        "id": ex.id,
        "kind": ex.kind,
        "gold": list(ex.gold),
        "answer": ex.answer,
        "query": ex.query,
        "prompt_tokens": P,
        "response_tokens": T,
        "sources": d,
        "response": resp.text,
        "mask_seed": mask_seed,
        "prompt": form,
        "seconds": {"generate": t1 - t0, "features": t2 - t1, "ablations": t3 - t2},
    }
    return {
        **out,
        "masks": masks,
        "logit_probs": ab["logit_probs"],
        "units": np.array(us, dtype=np.int64),
        "response_ids": np.array(resp.ids, dtype=np.int64),
        "meta": np.array(json.dumps(meta)),
    }


def build_set(
    model,
    examples: list[ContextExample],
    folder,
    n_masks: int = 32,
    mask_seed: int = 0,
    units: str = "sentences",
    max_new_tokens: int = 48,
    progress: bool = True,
    prompt: dict | None = None,
) -> list[Path]:
    """One <id>.npz per example in `folder` (written whole, then renamed: a killed run leaves no partial file);
    examples whose file exists are skipped, unless it was built with another prompt form (BadInput: one folder,
    one form; files from before the form was recorded count as the default {}). Returns the files in order."""
    from ctxmix.progress import progress_bar

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    form = prompt_form(prompt)
    # the folder's form, checked before any work: a shard started without --prompt-from fails at once
    stamp = folder / "prompt.json"
    if stamp.exists() and json.loads(stamp.read_text()) != form:
        raise BadInput(f"{folder} holds examples built with the prompt form {stamp.read_text().strip()}, not {form}")
    stamp.write_text(json.dumps(form) + "\n")
    paths = [folder / f"{ex.id}.npz" for ex in examples]
    with progress_bar(len(examples), "at2 examples", enabled=bool(progress), unit="example") as bar:
        for ex, p in zip(examples, paths):
            if p.exists():
                with np.load(p, allow_pickle=False) as z:
                    have = json.loads(str(z["meta"])).get("prompt", {})
                if have != form:  # files from before the folder's stamp
                    raise BadInput(f"{p} was built with the prompt form {have}, not {form}: use another folder")
            else:
                arrays = build_example(model, ex, n_masks, mask_seed, units, max_new_tokens, prompt=form)
                tmp = p.with_suffix(".tmp.npz")
                np.savez(tmp, **arrays)
                tmp.replace(p)
            bar.update(1)
    return paths


def load_set(paths) -> list[dict]:
    """The stored examples (features, masks, logit_probs, units, meta as a dict)."""
    out = []
    for p in paths:
        with np.load(p, allow_pickle=False) as z:
            e = {k: z[k] for k in z.files}
        e["meta"] = json.loads(str(e["meta"]))
        out.append(e)
    return out


# ---------------------------------------------------------------- fit


def pearson_loss(pred, y):
    """-(mean over the batch) of Pearson's rho between pred (B, m) and y (B, m) across the masks: population
    std, 1e-8 added to the product of the stds (AT2's `PearsonCorrelationLoss`)."""
    pc = pred - pred.mean(1, keepdim=True)
    yc = y - y.mean(1, keepdim=True)
    cov = (pc * yc).mean(1)
    rho = cov / (pred.std(1, unbiased=False) * y.std(1, unbiased=False) + 1e-8)
    return -rho.mean()


@dataclass
class FitData:
    """Per example, its units' mask-level features X (U, m, K) and targets y (U, m), float32."""

    X: list[np.ndarray]
    y: list[np.ndarray]


def kind_scales(examples: list[dict], kind: str) -> np.ndarray:
    """(K,) the divisor of each feature for fitting `kind`: 1 for a single kind (AT2's raw features); for
    a combination, each kind's RMS over every example's (unit, source, head) features, so that its kinds enter
    the fit on one scale (their raw values differ by orders of magnitude: attention in [0, 1], logit
    contributions in nats)."""
    kinds = estimator_kinds(kind)
    if kind not in COMBINATIONS:
        return np.ones(examples[0][f"features_{kind}"].shape[-1]) if examples else np.ones(0)
    parts = []
    for k in kinds:
        sq = np.concatenate([e[f"features_{k}"].astype(np.float64).ravel() ** 2 for e in examples])
        rms = float(np.sqrt(sq.mean())) if sq.size else 1.0
        parts.append(np.full(examples[0][f"features_{k}"].shape[-1], rms if rms > 0 else 1.0))
    return np.concatenate(parts)


def fit_data(examples: list[dict], kind: str, scales: np.ndarray | None = None) -> FitData:
    """AT2's mask-level features X(u, v) = sum_s (2 v_s - 1) f(u, s) and y(u, v) = logit P(unit u | ablation v);
    f the kind's features (for a combination, its kinds' concatenated), divided by `scales` (K,) if given."""
    from ctxmix.methods.context.ablation import aggregate

    Xs, ys = [], []
    for e in examples:
        f = stacked_features({k: e[f"features_{k}"] for k in estimator_kinds(kind)}, kind).astype(np.float64)
        if scales is not None:
            f = f / scales  # (U, d, K)
        pm = 2.0 * e["masks"].astype(np.float64) - 1.0  # (m, d)
        Xs.append(np.einsum("md,udk->umk", pm, f).astype(np.float32))
        ys.append(np.stack([aggregate(e["logit_probs"][:, a:b]) for a, b in e["units"]]).astype(np.float32))
    return FitData(Xs, ys)


def fit(data: FitData, steps: int = 1000, lr: float = 1e-3, batch: int = BATCH, seed: int = 0) -> dict:
    """AT2's trainer on `data`: returns {"w" (K,) float64 L1-normalised, "loss_start", "loss_final" (the batch
    losses of the first and last step), "losses" (steps,)}."""
    import torch

    if not data.X:
        raise BadInput("no training examples to fit")
    K = data.X[0].shape[-1]
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    w = torch.nn.Parameter(torch.full((K,), 1.0 / K))
    opt = torch.optim.Adam([w], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    X = [torch.from_numpy(x) for x in data.X]
    Y = [torch.from_numpy(y) for y in data.y]
    N = len(X)
    losses = []
    for _ in range(steps):
        pick = torch.randperm(N, generator=gen)[: min(batch, N)].tolist()
        units = [int(rng.integers(len(Y[i]))) for i in pick]
        xb = torch.stack([X[i][u] for i, u in zip(pick, units)])  # (B, m, K)
        yb = torch.stack([Y[i][u] for i, u in zip(pick, units)])  # (B, m)
        loss = pearson_loss(xb @ w, yb)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([w], 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    wf = w.detach().double().numpy()
    wf = wf / max(np.abs(wf).sum(), 1e-300)
    return {"w": wf, "loss_start": losses[0], "loss_final": losses[-1], "losses": losses}


def fit_kind(data: list[dict], kind: str, steps: int = 1000, seed: int = 0) -> tuple[np.ndarray, dict]:
    """(w, {"start", "final"} losses) for one estimator: AT2's fit on the kind's features, scaled per kind for
    a combination and the scales folded back into w (so that scoring is w . f on the raw features), L1-normalised."""
    scales = kind_scales(data, kind)
    r = fit(fit_data(data, kind, scales), steps=steps, seed=seed)
    w = r["w"] / scales
    return w / max(np.abs(w).sum(), 1e-300), {"start": r["loss_start"], "final": r["loss_final"]}


# ---------------------------------------------------------------- the command


def train(
    model,
    out,
    n_examples: int = 120,
    n_masks: int = 32,
    min_tokens: int = 200,
    max_tokens: int = 400,
    steps: int = 1000,
    seed: int = 0,
    max_new_tokens: int = 48,
    progress: bool = True,
    shard: tuple[int, int] | None = None,
    prompt: dict | None = None,
) -> dict:
    """`ctxmix at2-train`: builds (or resumes) the training set under out/examples/, fits every feature kind and
    writes out/at2_weights.npz (kinds, shape, provenance) and out/at2_weights.json (the provenance). shard (k, m):
    build only examples k, k + m, k + 2m, ... and return without fitting (m processes share the building; a last
    run without a shard fits on all of them); returns {"built": count} then. prompt: the `prompt_form` of the config
    the weights are for (a base model's answer cue and stop), recorded in the weights file."""
    from ctxmix import __version__
    from ctxmix.methods.context.at2 import save_weights

    out = Path(out)
    tok = model.tokenizer
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    t0 = time.perf_counter()
    exs = training_examples(n_examples, min_tokens, max_tokens, seed, count)
    if shard is not None:
        k, m = shard
        mine = exs[k::m]
        build_set(model, mine, out / "examples", n_masks, 0, "sentences", max_new_tokens, progress, prompt)
        return {"built": len(mine), "shard": [k, m]}
    paths = build_set(model, exs, out / "examples", n_masks, 0, "sentences", max_new_tokens, progress, prompt)
    run_s = time.perf_counter() - t0
    data = load_set(paths)
    t1 = time.perf_counter()
    weights, losses = {}, {}
    for k in ESTIMATORS:
        weights[k], losses[k] = fit_kind(data, k, steps, seed)
    fit_s = time.perf_counter() - t1
    L, H = model.n_layers, model.n_heads
    meta = {
        "model": model.name,
        "texts": f"gensim test data {WIKI_FILE} (English Wikipedia extract); the evaluation uses Lee background news",
        "tasks": {
            "needles": sum(e["meta"]["kind"] == "needles" for e in data),
            "summaries": sum(e["meta"]["kind"] == "summaries" for e in data),
        },
        "examples": len(data),
        "units": int(sum(len(e["units"]) for e in data)),
        "masks": n_masks,
        "mask_seeds": [0, n_masks - 1],
        "labels": "removal ablation (sources deleted, prompt re-tokenised, response ids fixed); logit P(unit) stable",
        "context_tokens": [min_tokens, max_tokens],
        "prompt_tokens": [
            int(min(e["meta"]["prompt_tokens"] for e in data)),
            int(max(e["meta"]["prompt_tokens"] for e in data)),
        ],
        "response_tokens": [
            int(min(e["meta"]["response_tokens"] for e in data)),
            int(max(e["meta"]["response_tokens"] for e in data)),
        ],
        "max_new_tokens": max_new_tokens,
        "prompt": prompt_form(prompt),
        "steps": steps,
        "lr": 1e-3,
        "batch": BATCH,
        "seed": seed,
        "training_loss": losses,
        # each example's own build time (its file's record: shards and resumed runs built most of them in other
        # processes), and this run's: what a reader compares with another machine
        "build_seconds": float(sum(sum(e["meta"].get("seconds", {}).values()) for e in data)),
        "run_seconds": run_s,
        "fit_seconds": fit_s,
        "date": datetime.date.today().isoformat(),
        "ctxmix_version": __version__,
        "shape": [L, H],
    }
    save_weights(out / "at2_weights.npz", weights, L, H, meta)
    (out / "at2_weights.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def add_at2_arguments(s) -> None:
    """`ctxmix at2-train`'s options (the model's come from the CLI's model_args)."""
    s.add_argument("--out", required=True, help="folder: examples/ (one file each, resumable) and at2_weights.npz/json")
    s.add_argument("--examples", type=int, default=120, help="training examples (needles and summaries alternate)")
    s.add_argument("--masks", type=int, default=32, help="removal ablations per example (ContextCite's seeds 0..n-1)")
    s.add_argument("--min-tokens", type=int, default=200, help="shortest context (tokens)")
    s.add_argument("--max-tokens", type=int, default=400, help="longest context (tokens; ~400 keeps a CPU run short)")
    s.add_argument(
        "--max-new-tokens", type=int, default=None, help="longest greedy response (48; --prompt-from: the config's)"
    )
    s.add_argument("--steps", type=int, default=1000, help="optimiser steps per feature kind")
    s.add_argument("--seed", type=int, default=0, help="examples' draws and the trainer's sampler")
    s.add_argument("--threads", type=int, default=None, help="torch threads (1 on a shared CPU)")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument(
        "--shard",
        default=None,
        metavar="K/M",
        help="build only examples K, K+M, ... (M processes share the building; run once more without it to fit)",
    )
    s.add_argument(
        "--prompt-from",
        default=None,
        metavar="CONFIG",
        help="a context config whose prompt form (template, query_suffix, stop) the examples use: a base model's",
    )


def cmd_at2_train(args) -> None:
    import torch

    from ctxmix.engine.models import load_model

    if args.threads is not None:
        if args.threads < 1:
            raise BadInput(f"--threads must be a positive whole number, got {args.threads}")
        torch.set_num_threads(args.threads)
    shard = None
    if args.shard is not None:
        k, _, m = str(args.shard).partition("/")
        if not (k.isdigit() and m.isdigit() and int(m) >= 1 and int(k) < int(m)):
            raise BadInput(f"--shard is K/M with 0 <= K < M whole numbers, got {args.shard!r}")
        shard = (int(k), int(m))
    for name in ("examples", "masks", "min_tokens", "max_tokens", "steps"):
        if getattr(args, name) < (2 if name == "masks" else 1):
            raise BadInput(f"--{name.replace('_', '-')} must be a positive whole number (masks: at least 2)")
    from ctxmix.engine.placement import loading_options

    prompt, max_new_tokens = {}, 48
    if args.prompt_from is not None:  # the config's form and response length: its responses are cut the same way
        from ctxmix.benchmark.context.bench import load_context_config

        config = load_context_config(args.prompt_from)
        prompt, max_new_tokens = prompt_form(config), int(config.get("max_new_tokens", 64))
    if args.max_new_tokens is not None:
        max_new_tokens = args.max_new_tokens
    model = load_model(
        args.model, device=args.device, dtype=args.dtype, precision=args.precision, **loading_options(args)
    )
    if args.prompt_from is None and not getattr(model.tokenizer, "chat_template", None):
        # a base model is trained in the form attribute_context asks it in by default (the shipped defaults)
        from ctxmix.methods.context.defaults import prompt_form_for

        prompt = prompt_form(prompt_form_for(False))
    meta = train(
        model,
        args.out,
        args.examples,
        args.masks,
        args.min_tokens,
        args.max_tokens,
        args.steps,
        args.seed,
        max_new_tokens,
        not args.quiet,
        shard,
        prompt,
    )
    if shard is not None:
        print(f"built shard {shard[0]}/{shard[1]}: {meta['built']} examples; run again without --shard to fit")
        return
    print(
        json.dumps(
            {k: meta[k] for k in ("examples", "units", "masks", "training_loss", "build_seconds", "fit_seconds")},
            indent=2,
        )
    )
    print(f"weights: {Path(args.out) / 'at2_weights.npz'}")
