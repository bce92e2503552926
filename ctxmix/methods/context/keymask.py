"""`key_mask_grad` and `key_mask_ig`: context attribution by gating the attention paid to each source's keys.

Each source s gets a gate a_s that multiplies the unnormalised attention weight exp(score) of every one of its
key positions, in every layer and every head; equivalently an additive bias log a_s on those keys' attention
scores, after any soft-cap, added with the causal / sliding-window mask. a = 1 is the model unchanged; a_s = 0
is AT2's attention-masking ablation of s (Cohen-Wang, Chuang, Madry 2025, "Learning to Attribute with
Attention"): no query attends s's tokens. The explained quantity is log P(response) = sum_t log p(r_t), the
response tokens' log-probabilities summed, each at the row that predicts it.

- `key_mask_grad`: score_s = d log P / d a_s at a = 1 = sum over s's key positions j of d log P / d b_j, b a
  per-key additive bias at b = 0. Attribution patching of the masking ablation: -score_s is the first-order
  prediction of log P(response | s masked) - log P(response). One forward and one backward pass.
- `key_mask_ig`: the same gradient averaged over K gate levels alpha_k = (k - 1/2) / K (midpoints of K equal
  steps of (0, 1); `levels=` gives others), every context source's gate at alpha_k, score_s = (1/K) sum_k
  d log P / d a_s at a = alpha_k: a K-point Riemann integrated gradient along the straight path from every
  source masked to none. Completeness: sum_s score_s -> log P(all kept) - log P(all sources masked) as K grows
  (the midpoint rule's error is O(1/K^2)). K forward and K backward passes, plus one forward pass with every
  source masked for the baseline term.

Template, query, separators and response positions are never gated. A per-key derivative d log P / d b_j is
kept for every position (`per_token`, one row: the whole response); summed over every position it is 0
(adding one constant to every visible key's score leaves each softmax unchanged), so these are not a
decomposition of log P: `terms` holds what makes `buckets` add up ("first_order_gap" = log P for
key_mask_grad; "all_sources_masked" = log P(every source masked) and "integration_error" for key_mask_ig, whose
row is zero outside the sources' keys).

The counterfactual is not ContextCite's: ContextCite (Cohen-Wang et al. 2024) and the metrics (LDS, top-k
drops) remove a source's TEXT and re-tokenise the prompt, so every later position moves; masking its keys
keeps the positions, the tokens' own states and what the other sources read from them, and stops only the
attention to them. A positive rescaling of the target does not change a ranking, so explaining log P rather
than ContextCite's logit P(span) matters only through the latter's non-linearity.

Spans: per-token rows would need T backward passes (one per response token) or one batched backward
(`torch.autograd.grad(..., is_grads_batched=True)`, the same T backwards' work, slower here); measured on
smollm2 with T = 32 (bench/keymask_cost.py, one CPU thread): 57 s and 741 s at 408 and 1,492 context tokens,
against ContextCite-32's 24 s and 193 s and one backward's 3.5 s and 27 s (docs/context.md, "Key-mask
gradient"). So only the whole response is scored, and `scores_for` on a sub-span refuses (`check_whole_response`).

Attention: the gate runs inside ctxmix's attention (`ctxmix.engine.attention`), set per call by this call's
pass (`Pass.key_bias`): with the eager kernel (`KEYMASK_EAGER`) the family's eager function with the bias added
to its additive mask (scaling, soft-cap, GQA, sinks and window stay the model's); with the fast kernel
(`KEYMASK_SDPA`) PyTorch's scaled-dot-product attention, the bias carried by one extra query/key column:
q' = [q, 1], k' = [k, b / scale], v' = [v, 0], padded with zero columns to a multiple of 8, so
q' k'^T scale = q k^T scale + b exactly in real arithmetic and the bias's gradient comes out of k's through
any SDPA kernel; the output's extra columns are dropped. Eager keeps every layer's n x n probabilities for the
backward: where they would take more than half the memory budget (`grad.gradient_attention`) the SDPA path
runs (O(n) per head), except on families whose attention SDPA cannot compute (soft-capped logits: Gemma 2;
transformers' `_supports_sdpa` False), which stay eager. Another thread's pass of the same model never sees the
bias.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from ctxmix.engine.attention import ctxmix_pass
from ctxmix.engine.models import Model
from ctxmix.errors import BadInput

KEYMASK_EAGER = "eager"  # the gated pass's kernel (`Pass.kernel`): the family's eager attention with the bias
KEYMASK_SDPA = "fast"  # PyTorch's SDPA with the per-key bias in an extra q/k column
KEY_MASK_METHODS = ("key_mask_grad", "key_mask_ig")
DEFAULT_LEVELS = 4
# the bias of a masked key (a = 0): exp(score - 65504) is exactly 0 in float32 and float64 (it underflows below
# e^-745) for any score a model produces, yet finite in every dtype, float16 included: a row whose visible keys are
# all masked (inside a source, under a sliding window) gets a finite uniform row instead of eager's NaN from all
# -inf, and it does not matter which: a masked position reaches the response only through its own keys, masked too
MASKED_BIAS = float(torch.finfo(torch.float16).min)


def gate_attention(model: Model, n: int, attn: str = "auto") -> str:
    """The implementation of a gated pass over n tokens: `KEYMASK_EAGER` or `KEYMASK_SDPA`. attn "auto": SDPA
    where eager's kept probabilities would take more than half the memory budget (`grad.gradient_attention`)
    and the family supports SDPA; "eager" or "sdpa" to force one (families without SDPA stay eager)."""
    from ctxmix.methods.context.grad import gradient_attention

    if attn not in ("auto", "eager", "sdpa"):
        raise BadInput(f"attn must be 'auto', 'eager' or 'sdpa', got {attn!r}")
    want = gradient_attention(model, n) if attn == "auto" else attn
    sdpa_ok = bool(getattr(model.hf, "_supports_sdpa", False))
    return KEYMASK_SDPA if want == "sdpa" and sdpa_ok else KEYMASK_EAGER


@contextmanager
def key_gate(model: Model, bias: torch.Tensor, impl: str) -> Iterator[str]:
    """Forward passes of `model` inside the block (this thread's only) run attention kernel `impl` with the per-key
    additive bias (n,) (log of the gates: 0 = unchanged, a large negative number = masked). Yields the kernel."""
    if impl not in (KEYMASK_EAGER, KEYMASK_SDPA):
        raise ValueError(f"impl must be {KEYMASK_EAGER!r} or {KEYMASK_SDPA!r}, got {impl!r}")
    with ctxmix_pass(kernel=impl, key_bias=bias):
        yield impl


def log_bias(gates: torch.Tensor) -> torch.Tensor:
    """log a per key, a = 0 as `MASKED_BIAS`."""
    return torch.log(gates).clamp(min=MASKED_BIAS)


def gated_log_probs(model: Model, ids: Sequence[int], P: int, bias: torch.Tensor, impl: str) -> torch.Tensor:
    """(T,) log p(r_t) of the response ids[P:] with the per-key bias (n,) on every layer's and head's attention
    scores (the graph to `bias` kept when it requires grad)."""
    from ctxmix.methods.context.grad import response_log_probs

    x = torch.tensor([list(ids)], device=model.device)
    with key_gate(model, bias, impl):
        E = model.hf.get_input_embeddings()(x).detach()
        return response_log_probs(model, E, P, list(ids[P:]))


def _bias_dtype(model: Model) -> torch.dtype:
    return torch.float64 if model.dtype == torch.float64 else torch.float32


def default_levels(k: int = DEFAULT_LEVELS) -> list[float]:
    """Midpoints of k equal steps of (0, 1): (i + 1/2) / k."""
    return [(i + 0.5) / k for i in range(k)]


def check_levels(levels) -> list[float]:
    if isinstance(levels, bool):
        raise BadInput(f"levels must be a count or a list of gate levels in (0, 1], got {levels!r}")
    if isinstance(levels, int):
        if levels < 1:
            raise BadInput(f"levels must be a positive count, got {levels}")
        return default_levels(levels)
    try:
        out = [float(x) for x in levels]
    except (TypeError, ValueError):
        raise BadInput(f"levels must be a count or a list of gate levels in (0, 1], got {levels!r}") from None
    if not out or not all(0 < x <= 1 for x in out):
        raise BadInput(f"levels must lie in (0, 1] (0 is the masked end of the path), got {levels!r}")
    return out


def key_mask_rows(
    model: Model,
    ids: Sequence[int],
    P: int,
    gated: Sequence[int],
    method: str = "key_mask_grad",
    levels=DEFAULT_LEVELS,
    attn: str = "auto",
) -> dict:
    """`key_mask_grad` or `key_mask_ig` on prompt + response ids (module docstring). gated: the context sources'
    token positions (the keys on the IG path). Returns {"per_token": (1, n) float64 per-key derivatives of log P
    (the whole response: one row), "terms": {name: (1,)}, "target": (T,) log p(r_t), "cost": {...}}."""
    if method not in KEY_MASK_METHODS:
        raise ValueError(f"method must be one of {KEY_MASK_METHODS}, got {method!r}")
    n = len(ids)
    impl = gate_attention(model, n, attn)
    dt = _bias_dtype(model)
    dev = model.device
    t0 = time.perf_counter()
    gated_t = torch.tensor(sorted(set(gated)), dtype=torch.long, device=dev)
    on_path = torch.zeros(n, dtype=torch.bool, device=dev)
    on_path[gated_t] = True
    lv = [1.0] if method == "key_mask_grad" else check_levels(levels)
    row = torch.zeros(n, dtype=torch.float64, device=dev)
    target = None
    with torch.enable_grad():
        for alpha in lv:
            gates = torch.where(
                on_path, torch.tensor(alpha, dtype=dt, device=dev), torch.ones((), dtype=dt, device=dev)
            )
            b = log_bias(gates).requires_grad_(True)
            lp = gated_log_probs(model, ids, P, b, impl)
            (g,) = torch.autograd.grad(lp.sum(), b)
            # d log P / d a_j = (d log P / d b_j) / a_j, b = log a
            row += (g / gates).double() / len(lv)
            if alpha == 1.0:
                target = lp.detach()
    terms: dict[str, np.ndarray] = {}
    forward = len(lv)
    if target is None:  # the IG path never reaches a = 1: the unchanged model's log-probabilities
        with torch.no_grad():
            target = gated_log_probs(model, ids, P, torch.zeros(n, dtype=dt, device=dev), impl)
        forward += 1
    target_np = target.double().cpu().numpy()
    if method == "key_mask_ig":
        row = torch.where(on_path, row, torch.zeros_like(row))  # keys off the path have no integral
        with torch.no_grad():
            masked = gated_log_probs(model, ids, P, log_bias(torch.where(on_path, 0.0, 1.0).to(dt)), impl)
        forward += 1
        base = float(masked.double().sum())
        terms = {
            "all_sources_masked": np.array([base]),
            "integration_error": np.array([float(target_np.sum()) - base - float(row.sum())]),
        }
    else:
        terms = {"first_order_gap": np.array([float(target_np.sum()) - float(row.sum())])}
    return {
        "per_token": row.cpu().numpy()[None, :],
        "terms": terms,
        "target": target_np,
        "cost": {
            "forward": forward,
            "backward": len(lv),
            "seconds": time.perf_counter() - t0,
            "span_scoring": "whole response only (one backward of the summed log-probability per level)",
            "attention": "sdpa" if impl == KEYMASK_SDPA else "eager",
            **({"levels": lv} if method == "key_mask_ig" else {}),
        },
    }


def whole_response_only(methods, a: int, b: int, T: int) -> list[str]:
    """Those of `methods` that cannot score the response's tokens a..b-1 of T: the methods whose records say they
    store the whole response's derivatives only (`ContextMethod.whole_response`), for any part of it."""
    from ctxmix.methods.registry import CONTEXT_METHODS

    return [m for m in methods if m in CONTEXT_METHODS and CONTEXT_METHODS[m].whole_response and (a, b) != (0, T)]


def check_whole_response(method: str, a: int, b: int, T: int) -> None:
    """Refuse a sub-span of the response for a method that stored the whole response's derivatives only."""
    if whole_response_only([method], a, b, T):
        raise BadInput(
            f"{method} scores the whole response only (one backward pass of its summed log-probability; per-token "
            f"rows would take T backward passes): rerun attribute_context with response= the span's text to score "
            f"that span, or use a method that stores per-token rows ({', '.join(_span_methods())})"
        )


def _span_methods() -> list[str]:
    from ctxmix.methods.registry import CONTEXT_METHODS

    return [m for m, r in CONTEXT_METHODS.items() if not r.whole_response]


def run(job, names: list[str]) -> dict:
    """The registry's run function of key_mask_grad and key_mask_ig (`ctxmix.methods.context.job`)."""
    levels = job.options.get("key_mask_levels", DEFAULT_LEVELS)  # an attribution saved before it had them: 4
    return {m: key_mask_rows(job.model, job.ids, job.P, job.gated, m, levels) for m in names}
