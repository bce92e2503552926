"""How a model reads its last hidden state into logits, for the prediction methods (`logit`,
`alti_logit`, `decompx`): the unembedding, Gemma 2's soft-capping, and the final norm's adjoint with
its scale frozen at the real value (so a logit is a dot product with one readout vector)."""

from __future__ import annotations

import torch

from ctxmix.engine.models import Model
from ctxmix.errors import BadInput


def unembedding(model: Model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unembedding U (V, d) and its bias (V,) or None, in the engine's dtype."""
    head = model.hf.get_output_embeddings()
    if head is None:
        raise BadInput(f"{model.name} has no unembedding (output embeddings) to explain")
    W = head.weight.detach().to(model.work_dtype)
    b = getattr(head, "bias", None)
    return W, None if b is None else b.detach().to(model.work_dtype)


def softcap(model: Model) -> float | None:
    """Gemma 2's final logit soft-capping c (logits = c tanh(z / c)), or None."""
    c = getattr(model.config, "final_logit_softcapping", None)
    return float(c) if c else None


def norm_adjoint(norm, u: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """r with <piece through `norm` at scale s, u> = <piece, r> for every piece: the norm's linear part
    is diag(gamma) C / s (C centres for LayerNorm), so r = C (gamma * u) / s. u (..., d), s (1,)."""
    if norm is None or norm.kind == "identity":
        return u.clone()
    g = u * norm.gamma
    if norm.kind == "layernorm":
        g = g - g.mean(-1, keepdim=True)
    return g / s


def readout(model: Model, x_last: torch.Tensor, U_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Readout vectors r (K, d) and the final norm's beta terms <beta_f, u> (K,) for unembedding rows
    U_rows (K, d), the final norm's scale frozen at its value on x_last (d,), the real pre-norm state."""
    norm = model.layers[-1].next_norm
    zeros = torch.zeros(len(U_rows), dtype=U_rows.dtype, device=U_rows.device)
    if norm is None:  # no final norm: the state is read as it is
        return U_rows.clone(), zeros
    beta = U_rows @ norm.beta if norm.beta is not None else zeros
    return norm_adjoint(norm, U_rows, norm.scale(x_last)), beta


def explained_logits(model: Model, x_last: torch.Tensor, tokens: list[int], own: torch.Tensor | None) -> torch.Tensor:
    """(K,) the logits of `tokens` that `logit`, `alti_logit` and `decompx` explain at one position, in
    the engine's dtype. x_last (d,): ctxmix's recomputed last state there (before the final norm);
    own (V,) or None: the model's own logits there.

    Without soft-capping: the model's own logits (None: recomputed). With it (Gemma 2's c tanh(z / c)):
    z recomputed from the last state as U (norm(x_last)) + b, which is what the token parts sum to.
    Undoing the cap with c atanh(own / c) would be ill-conditioned: a logit saturated in its dtype
    (|z| / c above about 9 in float32, 19 in float64) has tanh = 1 exactly, and atanh gives inf (or,
    clamped, an arbitrary 17.6 c in float64), and near saturation atanh multiplies the rounding of
    `own` by 1 / (1 - tanh^2) (bfloat16's 2^-8 becomes order one)."""
    U, ub = unembedding(model)
    if own is not None and softcap(model) is None:
        return own[tokens].to(model.work_dtype)
    norm = model.layers[-1].next_norm
    final = norm(x_last) if norm is not None else x_last
    return U[tokens] @ final + (ub[tokens] if ub is not None else 0)


TARGET_KINDS = ("logit", "log_prob", "logit_prob")


def target_readout(model: Model, logits: torch.Tensor, tokens: torch.Tensor, kind: str = "logit") -> dict:
    """What the logit decompositions project on for each explained row (`papers/notes/context-attribution.md`
    §6.1), from the model's own logits (K, V) at the K rows and the K target ids:

    - "logit": the raw logit z_r: the unembedding row u_r and its bias;
    - "log_prob" (T1): log p_r = (z_r - sum_v p_v z_v) - H(p): u_r - sum_v p_v u_v, its bias, and
      leftover "entropy" = -H(p) (one number per row, attributed to no token);
    - "logit_prob" (T2, ContextCite's per-token quantity): log p_r - log(1 - p_r) = (z_r - sum_{v != r}
      q_v z_v) - H(q) with q = softmax over v != r: u_r - sum_v q_v u_v, leftover "entropy" = -H(q).

    p (or q) is frozen at the model's value, so the first part is linear in the final state. Returns
    {"rows" (K, d) and "bias" (K,) in the engine's dtype, "weights" (K, V) float64 (p or q; None for the raw
    logit), "leftover" {name: (K,) float64}, "value" (K,) float64: the explained quantity from the model's
    logits (the capped ones on a soft-capped model)}."""
    if kind not in TARGET_KINDS:
        raise BadInput(f"the target kind must be one of {', '.join(TARGET_KINDS)}, got {kind!r}")
    U, ub = unembedding(model)
    z = logits.to(torch.float64)
    tg = tokens.to(z.device)
    K = len(tg)
    zeros = torch.zeros(K, dtype=U.dtype, device=U.device)
    u_r = U[tg.to(U.device)]
    b_r = ub[tg.to(U.device)] if ub is not None else zeros
    z_r = z.gather(-1, tg[:, None])[:, 0]
    if kind == "logit":
        return {"rows": u_r, "bias": b_r, "weights": None, "leftover": {}, "value": z_r}
    if kind == "log_prob":
        logw = torch.log_softmax(z, -1)
        value = logw.gather(-1, tg[:, None])[:, 0]
    else:  # q: the softmax over every other token (the target's own logit masked out)
        logw = torch.log_softmax(z.scatter(-1, tg[:, None], -torch.inf), -1)
        value = z_r - torch.logsumexp(z.scatter(-1, tg[:, None], -torch.inf), -1)
    w = logw.exp()
    rows = u_r - (w.to(U.dtype) @ U)
    bias = b_r - (w.to(U.dtype) @ ub) if ub is not None else zeros
    # 0 * log 0 = 0 (q_r = 0 exactly; far tails of p underflow)
    neg_entropy = torch.where(w > 0, w * logw, torch.zeros_like(w)).sum(-1)
    return {"rows": rows, "bias": bias, "weights": w, "leftover": {"entropy": neg_entropy}, "value": value}


def centred(z: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """(K,) z_r - sum_v w_v z_v for logits z (K, V) (z_r where weights is None): the linear part of a target."""
    z = z.to(torch.float64)
    z_r = z.gather(-1, tokens.to(z.device)[:, None])[:, 0]
    return z_r if weights is None else z_r - (weights * z).sum(-1)
