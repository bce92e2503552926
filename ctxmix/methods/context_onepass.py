"""One-pass context attribution from ctxmix's engine (`papers/notes/context-attribution.md` §6.1).

Each response token r_t (at position p_t) is explained at the row that predicts it, q_t = p_t - 1,
from one traced forward pass over prompt + response; only those T rows are decomposed.

`logit` (Ferrando et al., ACL 2023; `ctxmix.methods.prediction`): the contribution of input position j
to the target of row q_t is sum_l sum_h alpha^{h,l}_{q_t j} <W_O^h (W_V^h LN1(x_j) + b_V^h), r_t>, with
r_t the readout of the target through the final norm frozen at its real scale, plus the predicted
position's own embedding <x^0_{q_t}, r_t> at column q_t (explain's embedding="token"). The target
(`target=`):

- "log_prob" (T1, default): log p_{r_t} = (z_r - sum_v p_v z_v) - H(p), p the model's softmax at q_t.
  The centred logit is linear in the final state (readout of u_r - sum_v p_v u_v), so it splits exactly;
  -H(p) is one unattributed number per token ("entropy").
- "logit": the raw logit z_r (explain's `logit` with that target at that position). It carries the
  common-mode part every token shares; rank with care.

What no token gets is kept per token in `terms` (attention output bias and MLP summed over layers,
final-norm beta, unembedding bias, -H(p); on a soft-capped model the pre-cap logit is decomposed and
"softcap" holds the rest), so the tokens' sum plus the terms is the target. A span's source score is
the sum of its tokens' contributions over the span's target tokens (S2).

`attention` (AT2's raw-attention baseline, its untrained estimator; Cohen-Wang et al. 2025): the
attention weight of row q_t on each position averaged over every layer and head; a span's score is
the mean over its tokens (AT2's (A1)), a source's the sum over its tokens. Shares, not signed amounts.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ctxmix.engine.layer import head_values
from ctxmix.engine.models import Model
from ctxmix.engine.trace import trace_ids
from ctxmix.errors import BadInput
from ctxmix.methods.readout import norm_adjoint, softcap, unembedding

TARGETS = ("log_prob", "logit")
ONE_PASS_METHODS = ("logit", "attention")
SPAN_AGGREGATION = {"logit": "sum", "attention": "mean"}


@torch.no_grad()
def logit_rows(model: Model, tr, rows: list[int], targets: list[int], target: str = "log_prob") -> dict:
    """Per-token contributions of every position to the target of each row.

    rows (T,): the explained rows q_t; targets (T,): the token each predicts. Returns
    {"per_token": (T, n) float64, "terms": {name: (T,) float64}, "target": (T,) the explained quantity
    (log p or the pre-cap logit), "model_target": (T,) the same from the model's own logits}."""
    if target not in TARGETS:
        raise BadInput(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    dt = model.work_dtype
    U, ub = unembedding(model)
    Q = torch.tensor(rows, device=U.device)
    tg = torch.tensor(targets, device=U.device)
    T = len(rows)
    logits = tr.logits[Q].to(torch.float64)  # (T, V): the model's (capped) logits
    cap = softcap(model)
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    x_last = tr.states[-1].y[Q]  # (T, d) the real pre-norm states
    if target == "log_prob":
        ubar = U[tg] - (p.to(dt) @ U)  # (T, d): u_r - sum_v p_v u_v
        bias = (ub[tg] - p.to(dt) @ ub) if ub is not None else torch.zeros(T, dtype=dt, device=U.device)
    else:
        ubar, bias = U[tg], (ub[tg] if ub is not None else torch.zeros(T, dtype=dt, device=U.device))
    norm = model.layers[-1].next_norm
    if norm is None:
        R, beta = ubar.clone(), torch.zeros(T, dtype=dt, device=U.device)
    else:
        R = norm_adjoint(norm, ubar, norm.scale(x_last))
        beta = ubar @ norm.beta if norm.beta is not None else torch.zeros(T, dtype=dt, device=U.device)
    n = tr.n
    per_token = torch.zeros((T, n), dtype=torch.float64, device=U.device)
    per_token[torch.arange(T), Q] += (tr.hidden[0][Q] * R).sum(-1).double()  # the predicted position's embedding
    attn_bias = torch.zeros(T, dtype=torch.float64, device=U.device)
    mlp = torch.zeros(T, dtype=torch.float64, device=U.device)
    for lw, st in zip(model.layers, tr.states):
        src = st.x if lw.position == "post" else st.x1
        v = head_values(lw, src, with_bias=True)  # (H, n, dh)
        Wo = lw.Wo.view(lw.n_heads, lw.head_dim, -1)  # (H, dh, d)
        if lw.position == "sandwich":  # through LNa with the real attention output's scale at each row
            na = lw.post_attn_norm
            s_a = na.scale(st.attn[Q])  # (T, 1)
            R_attn = norm_adjoint(na, R, s_a)
            bo = lw.bo if lw.bo is not None else torch.zeros_like(st.attn[0])
            attn_bias += (na.decompose_bias(bo.expand(T, -1), s_a) * R).sum(-1).double()
            ff_vec = lw.post_ff_norm(st.ff[Q])
        else:
            R_attn = R
            if lw.bo is not None:
                attn_bias += (lw.bo @ R.T).double()
            ff_vec = st.ff[Q]
        w = torch.einsum("hed,td->the", Wo, R_attn)  # (T, H, dh): W_O^h r_t
        vw = torch.einsum("hje,the->thj", v, w)  # (T, H, n)
        A = st.alpha[:, Q, :].transpose(0, 1)  # (T, H, n): the explained rows only
        per_token += (A * vw).sum(1).double()
        mlp += (ff_vec * R).sum(-1).double()
    final = norm(x_last) if norm is not None else x_last
    z_pre = (final @ U.T + (ub if ub is not None else 0)).to(torch.float64)  # (T, V) recomputed pre-cap logits
    terms = {
        "attention_bias": attn_bias,
        "mlp": mlp,
        "final_norm_bias": beta.double(),
        "unembedding_bias": bias.double(),
    }
    if target == "log_prob":
        terms["entropy"] = (p * logp).sum(-1)  # -H(p)
        if cap is not None:  # the model's centred logit minus the recomputed pre-cap one
            zr = z_pre.gather(-1, tg[:, None])[:, 0] - (p * z_pre).sum(-1)
            cr = logits.gather(-1, tg[:, None])[:, 0] - (p * logits).sum(-1)
            terms["softcap"] = cr - zr
        explained = logp.gather(-1, tg[:, None])[:, 0]
        model_target = explained
    else:
        explained = z_pre.gather(-1, tg[:, None])[:, 0]
        model_target = logits.gather(-1, tg[:, None])[:, 0]
        if cap is not None:
            model_target = cap * torch.atanh((model_target / cap).clamp(-1 + 1e-15, 1 - 1e-15))
    return {
        "per_token": per_token.cpu().numpy(),
        "terms": {k: v.double().cpu().numpy() for k, v in terms.items()},
        "target": explained.double().cpu().numpy(),
        "model_target": model_target.double().cpu().numpy(),
    }


@torch.no_grad()
def attention_rows(tr, rows: list[int]) -> np.ndarray:
    """(T, n): row q_t's attention averaged over layers and heads (AT2's features with uniform weights)."""
    Q = torch.tensor(rows)
    acc = None
    for st in tr.states:
        a = st.alpha[:, Q.to(st.alpha.device), :].double().mean(0)  # (T, n)
        acc = a if acc is None else acc + a
    return (acc / len(tr.states)).cpu().numpy()


def run_one_pass(model: Model, methods: list[str], ids: list[int], P: int, target: str) -> dict:
    """{method: {"per_token", "terms", "target", "cost"}} from one traced pass over ids (prompt + response)."""
    from ctxmix.methods.prediction import check_logit_model

    if "logit" in methods:
        check_logit_model(model, "logit")
    t0 = time.perf_counter()
    tr = trace_ids(model, ids)
    T = len(ids) - P
    rows = list(range(P - 1, P - 1 + T))
    targets = list(ids[P:])
    trace_secs = time.perf_counter() - t0
    out = {}
    for m in methods:
        t1 = time.perf_counter()
        if m == "logit":
            res = logit_rows(model, tr, rows, targets, target)
            res["reconstruction_error"] = float(tr.reconstruction_error)
        elif m == "attention":
            res = {"per_token": attention_rows(tr, rows), "terms": {}, "target": np.ones(T)}
        else:  # pragma: no cover - the caller checks the names
            raise ValueError(m)
        # the traced pass is shared: each method is charged the whole of it (a method run alone costs that)
        res["cost"] = {"forward": 1, "backward": 0, "seconds": trace_secs + time.perf_counter() - t1}
        out[m] = res
    return out
