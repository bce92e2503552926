"""`grad_x_input` for context attribution: gradient x input of each response token's log-probability.

For response token r_t, predicted by row q_t, the contribution of input position j is

    g_t(j) = <d log p(r_t | x_<=q_t) / d e_j, e_j>

with e_j the word embedding of position j (the input embedding module's output; position embeddings and
everything after stay as the model computes them; explain's `grad_at="word"`). Signed, summed over the
embedding dimensions, unlike explain's `grad_x_input`, which is the L2 norm of the product for one token's
probability (GlobEnc's saliency).

How a span is scored: the per-token rows g_t (T, n) are stored, from one forward pass and T backward
passes through it (the graph kept between them), so that `scores_for(span)` sums the span's rows with no
new pass: the gradient is linear, so a span's sum of per-token grad x input equals grad x input of the
span's summed log-probability. `cost` counts 1 forward and T backward passes.

What it is not: grad x input is a first-order (Taylor) quantity, not a decomposition. The sum over every
position of g_t(j) is the derivative of log p(r_t) along the inputs' own direction, d/d lambda log p(r_t |
lambda e) at lambda = 1 (Euler's identity for the directional derivative), and a source's score is the
same derivative with only that source's embeddings scaled: the first-order effect of shrinking the
source towards the zero embedding. It does not sum to log p (the model is not homogeneous); `terms`
holds the difference per token ("first_order_gap" = log p - sum_j g_t(j)) so that `buckets` adds up, and
it is no one's contribution.

Memory: eager attention (what ctxmix loads models with) keeps every layer's n x n probabilities for the
backward: ~18 GB at 4,096 tokens on smollm2 (measured here: +1.5 GB peak at 1,027 tokens, against +0.97 GB
with SDPA). Where those probabilities would take more than half the memory budget (`gradient_attention`;
from about 1,000 tokens on smollm2 with the CPU's 4 GB budget) the pass runs with PyTorch's
scaled-dot-product attention (`sdpa`, or the memory-efficient implementation the user's model was
configured with), whose fused kernels keep O(n) per head; below, eager, which is faster on a CPU (SDPA's
backward took ~1.8x eager's at 1,027 tokens here). The kernel is chosen per call (`ctxmix.engine.attention`'s
`Pass.kernel`): another thread's pass of the same model is untouched. Only the response rows' logits are formed
(HF's `logits_to_keep`).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ctxmix.engine.attention import accepts, ctxmix_pass, fast_name
from ctxmix.engine.budget import memory_budget
from ctxmix.engine.models import Model


def gradient_attention(model: Model, n: int) -> str:
    """ "eager" where its backward's attention probabilities (L x H x n^2 in the model's dtype, counted twice:
    the softmax's output and its float32 copy on some families) fit in half of the memory budget, else "sdpa"."""
    from ctxmix.engine.memory import kept_attention_bytes, widths_of

    return "eager" if 2 * kept_attention_bytes(widths_of(model), n) <= memory_budget(model.device) // 2 else "sdpa"


def response_log_probs(model: Model, E: torch.Tensor, P: int, response_ids: list[int]) -> torch.Tensor:
    """(T,) log p(r_t) at rows P - 1 .. P + T - 2 of the model run on word embeddings E (1, n, d), with the
    graph to E (log-softmax in float32 at least)."""
    hf, T = model.hf, len(response_ids)
    n = E.shape[1]
    kw: dict[str, object] = {"use_cache": False} if accepts(hf, "use_cache") else {}
    if accepts(hf, "logits_to_keep"):
        kw["logits_to_keep"] = T + 1  # rows n - T - 1 .. n - 1: the response rows and the last (dropped)
    mask = torch.ones((1, n), dtype=torch.long, device=E.device)
    logits = hf(inputs_embeds=E, attention_mask=mask, **kw).logits[0]
    z = logits[logits.shape[0] - T - 1 : -1]  # (T, V)
    z = z if z.dtype == torch.float64 else z.float()
    r = torch.tensor(response_ids, device=z.device)
    return torch.log_softmax(z, -1).gather(-1, r[:, None])[:, 0]


def grad_x_input_rows(model: Model, ids: list[int], P: int, attn: str = "auto") -> dict:
    """Per-token gradient x input (T, n) of each response token's log-probability (module docstring):
    one forward pass, T backward passes. ids: prompt (P) + response (T). attn: the attention
    implementation of the gradient pass ("auto": `gradient_attention`, "sdpa", or "eager")."""
    T = len(ids) - P
    if attn == "auto":
        attn = gradient_attention(model, len(ids))
    t0 = time.perf_counter()
    x = torch.tensor([ids], device=model.device)
    kernel = "eager" if attn == "eager" else "fast"  # fast: SDPA, or the memory-efficient one the user configured
    used = "eager" if kernel == "eager" else fast_name(model)
    with torch.enable_grad(), ctxmix_pass(kernel=kernel):
        E = model.hf.get_input_embeddings()(x).detach().requires_grad_(True)  # (1, n, d)
        lp = response_log_probs(model, E, P, list(ids[P:]))
        per_token = np.zeros((T, len(ids)), dtype=np.float64)
        for t in range(T):
            (g,) = torch.autograd.grad(lp[t], E, retain_graph=t < T - 1)
            per_token[t] = (g[0].double() * E[0].detach().double()).sum(-1).cpu().numpy()
    target = lp.detach().double().cpu().numpy()
    return {
        "per_token": per_token,
        "terms": {"first_order_gap": target - per_token.sum(1)},
        "target": target,
        "cost": {
            "forward": 1,
            "backward": T,
            "seconds": time.perf_counter() - t0,
            "span_scoring": "stored per-token gradients (T backward passes); a span sums its rows",
            "attention": used,
        },
    }


def run(job, names: list[str]) -> dict:
    """The registry's run function of this module's method (`ctxmix.methods.context.job`)."""
    return {m: grad_x_input_rows(job.model, job.ids, job.P) for m in names}
