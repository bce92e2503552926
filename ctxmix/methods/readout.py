"""How a model reads its last hidden state into logits, for the prediction methods (`logit`,
`alti_logit`, `decompx`): the unembedding, Gemma 2's soft-capping, and the final norm's adjoint with
its scale frozen at the real value (so a logit is a dot product with one readout vector)."""

from __future__ import annotations

import contextlib

import torch

from ctxmix.engine.models import Model
from ctxmix.errors import BadInput

VOCAB_CHUNK = 8192  # unembedding rows cast to the engine's dtype at a time (128 MB at d = 4,096 in float32)


@contextlib.contextmanager
def _stored_unembedding(model: Model):
    """The unembedding as the model stores it ((V, d), dequantized if quantized, loaded from the offload for
    the duration) and its bias, or BadInput when the model has none."""
    from ctxmix.engine.weights import linear_matrix, materialized

    head = model.hf.get_output_embeddings()
    if head is None:
        raise BadInput(f"{model.name} has no unembedding (output embeddings) to explain")
    with materialized(head):
        b = getattr(head, "bias", None)
        yield linear_matrix(head), None if b is None else b.detach()


def _engine(model: Model, t: torch.Tensor) -> torch.Tensor:
    return t.to(device=model.device, dtype=model.work_dtype)


def unembedding(model: Model, tokens=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows `tokens` of the unembedding U (K, d) and of its bias (K,) or None, in the engine's dtype on its
    device, indexed before any cast (a bf16 model's 128k x 4,096 unembedding would be 2.1 GB in float32).
    tokens=None: the whole (V, d) matrix (a copy where the stored one is in another dtype or place)."""
    with _stored_unembedding(model) as (W, b):
        if tokens is not None:
            idx = torch.as_tensor(tokens, device=W.device)
            W, b = W[idx], None if b is None else b[idx]
        return _engine(model, W), None if b is None else _engine(model, b)


def unembed(model: Model, x: torch.Tensor) -> torch.Tensor:
    """x (..., d) -> x U^T + b (..., V), the unembedding cast VOCAB_CHUNK rows at a time."""
    with _stored_unembedding(model) as (W, b):
        out = torch.empty(*x.shape[:-1], W.shape[0], dtype=x.dtype, device=x.device)
        for a in range(0, W.shape[0], VOCAB_CHUNK):
            out[..., a : a + VOCAB_CHUNK] = x @ _engine(model, W[a : a + VOCAB_CHUNK]).T
            if b is not None:
                out[..., a : a + VOCAB_CHUNK] += _engine(model, b[a : a + VOCAB_CHUNK])
    return out


def unembedding_mean(model: Model, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(w U (K, d), w b (K,) or None) for weights w (K, V) over the vocabulary, in the engine's dtype, the
    unembedding cast VOCAB_CHUNK rows at a time."""
    with _stored_unembedding(model) as (W, b):
        w = w.to(device=model.device, dtype=model.work_dtype)
        mean = torch.zeros(w.shape[0], W.shape[1], dtype=w.dtype, device=w.device)
        bias = None if b is None else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
        for a in range(0, W.shape[0], VOCAB_CHUNK):
            mean += w[:, a : a + VOCAB_CHUNK] @ _engine(model, W[a : a + VOCAB_CHUNK])
            if bias is not None:
                bias += w[:, a : a + VOCAB_CHUNK] @ _engine(model, b[a : a + VOCAB_CHUNK])
    return mean, bias


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
    norm = model.final_norm
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
    if own is not None and softcap(model) is None:
        return own[tokens].to(model.work_dtype)
    U, ub = unembedding(model, tokens)
    norm = model.final_norm
    final = norm(x_last) if norm is not None else x_last
    return U @ final + (ub if ub is not None else 0)


TARGET_KINDS = ("logit", "log_prob", "logit_prob")


def target_readout(model: Model, logits: torch.Tensor, tokens: torch.Tensor, kind: str = "logit") -> dict:
    """What the logit decompositions project on for each explained row (docs/context.md, "The target and the
    metrics"), from the model's own logits (K, V) at the K rows and the K target ids:

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
    z = logits.to(torch.float64)
    tg = tokens.to(z.device)
    K = len(tg)
    u_r, ub_r = unembedding(model, tg)
    zeros = torch.zeros(K, dtype=u_r.dtype, device=u_r.device)
    b_r = ub_r if ub_r is not None else zeros
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
    mean, mean_b = unembedding_mean(model, w)
    rows = u_r - mean
    bias = b_r - mean_b if mean_b is not None else zeros
    # 0 * log 0 = 0 (q_r = 0 exactly; far tails of p underflow)
    neg_entropy = torch.where(w > 0, w * logw, torch.zeros_like(w)).sum(-1)
    return {"rows": rows, "bias": bias, "weights": w, "leftover": {"entropy": neg_entropy}, "value": value}


def centred(z: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """(K,) z_r - sum_v w_v z_v for logits z (K, V) (z_r where weights is None): the linear part of a target."""
    z = z.to(torch.float64)
    z_r = z.gather(-1, tokens.to(z.device)[:, None])[:, 0]
    return z_r if weights is None else z_r - (weights * z).sum(-1)
