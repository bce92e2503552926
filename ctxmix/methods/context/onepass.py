"""One-pass context attribution from ctxmix's engine (docs/context.md, "The target of the one-pass methods").

Each response token r_t (at position p_t) is explained at the row that predicts it, q_t = p_t - 1,
from one traced forward pass over prompt + response; only those T rows are decomposed (the ALTI maps
below excepted, see `alti_logit`). `logit` and `attention` alone read a rows trace
(`ctxmix.engine.rows.trace_rows`: one forward pass keeping each layer's attention rows q_t, the layers
rebuilt at those rows only, no n x n map held and no layer replayed; 3.4x faster than the streamed
full trace at 1,059 tokens on smollm2); `alti_logit` needs a full trace, which the others then share.

`logit` (Ferrando et al., ACL 2023; `ctxmix.methods.prediction`): the contribution of input position j
to the target of row q_t is sum_l D^l_{tj}, D^l_{tj} = sum_h alpha^{h,l}_{q_t j} <W_O^h (W_V^h LN1(x_j) + b_V^h),
rho_t>, with rho_t the readout of the target through the final norm frozen at its real scale, plus the
predicted position's own embedding <x^0_{q_t}, rho_t> at column q_t (explain's embedding="token"). The
target (`target=`, `ctxmix.methods.readout.target_readout`, the same as `explain(..., target_kind=)`):

- "log_prob" (T1, default): log p_{r_t} = (z_r - sum_v p_v z_v) - H(p), p the model's softmax at q_t.
  The centred logit is linear in the final state (readout of u_r - sum_v p_v u_v), so it splits exactly;
  -H(p) is one unattributed number per token ("entropy").
- "logit_prob" (T2, ContextCite's per-token quantity): log p_r - log(1 - p_r) = (z_r - sum_{v != r} q_v z_v)
  - H(q), q the softmax over the other tokens; "entropy" holds -H(q).
- "logit": the raw logit z_r (explain's default). It carries the common-mode part every token shares;
  rank with care.

What no token gets is kept per token in `terms` (attention output bias and MLP summed over layers,
final-norm beta, unembedding bias, -H; on a soft-capped model the pre-cap logit is decomposed and
"softcap" holds the rest), so the tokens' sum plus the terms is the target. On a half-precision model
(layers rebuilt in float32, `Model.work_dtype`) the target is read from the logits recomputed in float32
(the model's own bf16 logits are rounded to 2^-8 of their size; `model_target` keeps their value) and
"half_precision" holds the model's rounding of each layer's output (its output minus the float32
rebuild, read on rho), so the sum stays exact to float32 rounding. A span's source score is
the sum of its tokens' contributions over the span's target tokens.

`alti_logit` (Ferrando et al. 2023): layer l's D^l traced back to the input tokens through the ALTI maps
of the layers below, sum_l D^l C^{l-1} ... C^0 (explain's `alti_logit` per row), evaluated top-down in
Horner form, acc <- acc C^l + D^l for l = L-1 .. 0, so each layer's state and ALTI map are needed once,
one layer at a time (a streamed trace rebuilds each layer once; `trace_ids` streams above its memory
share). ALTI's C^l is needed on every row, since acc's columns cover every position a response row
attends to: the cost is bounded by (L - 1) ALTI layer maps over all n rows (O((L-1) n^2 d), the top
layer's is never needed) plus (L - 1) products (T, n) x (n, n); memory by one layer's state, one chunk
of ALTI rows and the (T, n) accumulator. "untraced" (per token) holds what reached a position whose ALTI
row is all zero (explain's "untraced", summed over layers).

`attention` (AT2's raw-attention baseline, its untrained estimator; Cohen-Wang et al. 2025): the
attention weight of row q_t on each position averaged over every layer and head; a span's score is
the mean over its tokens (as AT2 aggregates), a source's the sum over its tokens. Shares, not signed amounts.

All three are read in one loop over the layers (top-down) of one trace: methods asked together share it,
and each is charged the trace and the layer rebuilds plus its own work in `cost["seconds"]`. The other
context methods have modules of their own (their records in `ctxmix.methods.registry.CONTEXT_METHODS`).
"""

from __future__ import annotations

import numpy as np
import torch

from ctxmix.engine.layer import head_values, head_vectors, norm_family_row_maps
from ctxmix.engine.models import Model
from ctxmix.engine.timing import Stopwatch
from ctxmix.engine.trace import trace_ids
from ctxmix.errors import BadInput
from ctxmix.methods.readout import centred, norm_adjoint, softcap, target_readout, unembed

TARGETS = ("log_prob", "logit_prob", "logit")
DECOMPOSED = ("logit", "alti_logit", "attention")  # read from the traced layers (`decompose_rows`), one shared trace


def _readout(model: Model, tr, Q: torch.Tensor, tg: torch.Tensor, target: str) -> tuple[torch.Tensor, dict, dict]:
    """The readout rho (T, d) of each row's target through the final norm (its scale frozen at the real
    pre-norm state), the per-token terms no position gets at the top ({name: (T,)}), and {"target": the
    explained quantity (T,), "model_target": the same from the model's own logits} (float64)."""
    dt = model.work_dtype
    T = len(Q)
    logits = tr.logits_at(Q)  # (T, V): the model's (capped) logits
    x_last = tr.states[-1].y[tr.local(Q)]  # (T, d) the real pre-norm states
    norm = model.final_norm
    final = norm(x_last) if norm is not None else x_last
    z_pre = unembed(model, final).to(torch.float64)  # (T, V) recomputed pre-cap logits
    cap = softcap(model)
    model_logits = logits
    if model.dtype != dt:
        # a half-precision model's logits are rounded to 2^-8 of their size (0.03 on a logit of 10): the target
        # is read from the logits recomputed in the work dtype, which the contributions add up to
        logits = z_pre if cap is None else cap * torch.tanh(z_pre / cap)
    ro = target_readout(model, logits, tg, target)
    ubar = ro["rows"]
    zeros = torch.zeros(T, dtype=dt, device=ubar.device)
    if norm is None:
        R, beta = ubar.clone(), zeros
    else:
        R = norm_adjoint(norm, ubar, norm.scale(x_last))
        beta = ubar @ norm.beta if norm.beta is not None else zeros
    terms = {"final_norm_bias": beta.double(), "unembedding_bias": ro["bias"].double(), **ro["leftover"]}
    if target == "logit":
        explained = centred(z_pre, tg, None)
        # with a soft-cap the recomputed pre-cap logit is what is explained (readout.explained_logits):
        # undoing the cap on the model's own logit with atanh is ill-conditioned near saturation
        model_target = ro["value"] if cap is None and logits is model_logits else explained
    else:
        if cap is not None:  # the model's centred logit minus the recomputed pre-cap one
            w = ro["weights"]
            terms["softcap"] = centred(logits, tg, w) - centred(z_pre, tg, w)
        explained = model_target = ro["value"]
    if logits is not model_logits:  # what the model's own rounded logits give
        model_target = target_readout(model, model_logits, tg, target)["value"]
    return R, terms, {"target": explained, "model_target": model_target}


def _layer_rows(lw, st, Q: torch.Tensor, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer l's attention update of the rows Q projected on their readouts R (T, d): D (T, n) float64, per
    source position (heads summed, b_V and LN1's beta spread through alpha as explain's), and the attention
    output bias and the MLP update projected (T,) each. Q indexes the state's rows (`Trace.local`)."""
    T = len(Q)
    if lw.position == "sandwich":  # through LNa with the real attention output's scale at each row
        na = lw.post_attn_norm
        s_a = na.scale(st.attn[Q])  # (T, 1)
        bo = lw.bo if lw.bo is not None else torch.zeros_like(st.attn[0])
        attn_bias = (na.decompose_bias(bo.expand(T, -1), s_a) * R).sum(-1)
        ff_vec = lw.post_ff_norm(st.ff[Q])
    else:
        attn_bias = lw.bo @ R.T if lw.bo is not None else torch.zeros(T, dtype=R.dtype, device=R.device)
        ff_vec = st.ff[Q]
    D = head_logit_rows(lw, st, Q, R).sum(1)
    return D.double(), attn_bias.double(), (ff_vec * R).sum(-1).double()


def head_logit_rows(lw, st, Q: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """(T, H, n): head h's attention update of row Q_t from position j projected on the row's readout R_t,
    alpha^h_{q_t j} <W_O^h (W_V^h src_j + b_V^h), rho_t> (sandwich layers: rho through the post-attention norm
    at the real attention output's scale); `_layer_rows` sums it over heads, at2_exact weighs each head.
    Q indexes the state's rows (`Trace.local`)."""
    src = st.x if lw.position == "post" else st.x1
    v = head_values(lw, src, with_bias=True)  # (H, n, dh)
    Wo = lw.Wo.view(lw.n_heads, lw.head_dim, -1)  # (H, dh, d)
    if lw.position == "sandwich":
        na = lw.post_attn_norm
        R = norm_adjoint(na, R, na.scale(st.attn[Q]))
    w = torch.einsum("hed,td->the", Wo, R)  # (T, H, dh): W_O^h rho_t
    vw = torch.einsum("hje,the->thj", v, w)  # (T, H, n)
    return st.alpha[:, Q, :].transpose(0, 1) * vw  # the explained rows' attention only


def _times_alti(model: Model, lw, st, acc: torch.Tensor) -> torch.Tensor:
    """acc (T, n) float64 times layer l's ALTI map C^l (n, n), the map built in chunks of rows
    (`ctxmix.engine.layer.norm_family_row_maps`, as explain's ALTI) and never held whole."""
    from ctxmix.methods.mixing import _chunks, _span

    stb = st.as_batch()
    dev = stb.x.device
    f = head_vectors(lw, stb.x if lw.position == "post" else stb.x1, with_bias=True)  # (1, H, n, d), once a layer
    n, d = stb.x.shape[-2], stb.x.shape[-1]
    out = torch.zeros_like(acc)
    for rows in _chunks(n, d, copies=6, batch=1, device=dev):
        J = int(rows[-1]) + 1 if model.spec.causal else n  # later columns are zero in a causal model's rows
        C = norm_family_row_maps(lw, stb, rows.to(dev), ["alti"], f, J)["alti"][0]  # (c, J)
        out[:, :J] += acc[:, _span(rows)] @ C.to(acc)
    return out


@torch.no_grad()
def decompose_rows(
    model: Model, tr, rows: list[int], targets: list[int], target: str = "log_prob", methods=DECOMPOSED
) -> dict:
    """`logit`, `alti_logit` and `attention` of the rows q_t (T,) towards their targets (T,), from one loop
    over the traced layers, top-down (see the module docstring). Returns {method: {"per_token": (T, n)
    float64, "terms": {name: (T,) float64}, "target": (T,), "model_target": (T,) (logit methods),
    "seconds": that method's own time}, "shared_seconds": the readout and the layer rebuilds}."""
    if target not in TARGETS:
        raise BadInput(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    want = [m for m in DECOMPOSED if m in methods]
    logit_like = bool({"logit", "alti_logit"} & set(want))
    sw = Stopwatch(model.device)  # CUDA events on a GPU: no synchronisation inside the layer loop
    t0 = sw.mark()
    T, n, L = len(rows), tr.n, len(model.layers)
    if "alti_logit" in want and getattr(tr, "rows", None) is not None:
        raise ValueError("alti_logit needs every row's ALTI map: a full trace (trace_ids), not trace_rows")
    dev = tr.states[-1].y.device  # builds the top layer (kept: the loop starts there)
    Q = torch.tensor(rows, device=dev)
    Ql = tr.local(Q)  # the rows in the states (a RowsTrace holds only them)
    tg = torch.tensor(targets, device=dev)

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float64, device=dev)

    if logit_like:
        R, top_terms, values = _readout(model, tr, Q, tg, target)
        per_logit, acc, attn_bias, mlp = zeros(T, n), zeros(T, n), zeros(T), zeros(T)
        half = model.dtype != model.work_dtype
        if half:
            top_terms["half_precision"] = zeros(T)
    attn = zeros(T, n)
    sw.add(t0, "shared")
    for l in reversed(range(L)):
        t1 = sw.mark()
        st, lw = tr.states[l], model.layers[l]
        sw.add(t1, "shared")
        if logit_like:
            t1 = sw.mark()
            D, ab, ml = _layer_rows(lw, st, Ql, R)
            per_logit += D
            attn_bias += ab
            mlp += ml
            if half and l < L - 1:  # the model's half-precision output of layer l minus its rebuilt one
                top_terms["half_precision"] += ((tr.hidden[l + 1][Q].to(R) - st.y[Ql]) * R).sum(-1).double()
            sw.add(t1, *(m for m in ("logit", "alti_logit") if m in want))
        if "alti_logit" in want:
            t1 = sw.mark()
            if l < L - 1:  # the top layer's map is never needed (acc is zero there)
                acc = _times_alti(model, lw, st, acc)
            acc += D
            sw.add(t1, "alti_logit")
        if "attention" in want:
            t1 = sw.mark()
            attn += st.alpha[:, Ql, :].double().mean(0)
            sw.add(t1, "attention")
    own = dict.fromkeys(want, 0.0) | sw.seconds()  # read once, after the loop
    out: dict = {"shared_seconds": own.pop("shared")}
    if logit_like:
        emb = (tr.hidden[0][Q].to(R) * R).sum(-1).double()  # the predicted position's own embedding, at column q_t
        terms = {"attention_bias": attn_bias, "mlp": mlp, **top_terms}
        for m, M in (("logit", per_logit), ("alti_logit", acc)):
            if m not in want:
                continue
            t_m = dict(terms)
            if m == "alti_logit":  # what reached a position whose ALTI row is all zero (explain's "untraced")
                t_m["untraced"] = per_logit.sum(1) - acc.sum(1)
            M = M.clone()
            M[torch.arange(T, device=dev), Q] += emb
            out[m] = {
                "per_token": M.cpu().numpy(),
                "terms": {k: v.double().cpu().numpy() for k, v in t_m.items()},
                "target": values["target"].double().cpu().numpy(),
                "model_target": values["model_target"].double().cpu().numpy(),
                "seconds": own[m],
            }
    if "attention" in want:
        out["attention"] = {"per_token": (attn / L).cpu().numpy(), "terms": {}, "target": np.ones(T)}
        out["attention"]["seconds"] = own["attention"]
    return out


def logit_rows(model: Model, tr, rows: list[int], targets: list[int], target: str = "log_prob") -> dict:
    """`logit`'s per-token contributions (T, n) of every position to the target of each row
    (`decompose_rows`)."""
    return decompose_rows(model, tr, rows, targets, target, ("logit",))["logit"]


def attention_rows(tr, rows: list[int]) -> np.ndarray:
    """(T, n): row q_t's attention averaged over layers and heads (AT2's features with uniform weights)."""
    return decompose_rows(tr.model, tr, rows, [0] * len(rows), "logit", ("attention",))["attention"]["per_token"]


def _trace(model: Model, ids: list[int], rows: list[int], streamed: bool | None, full: bool):
    """The trace the decomposed methods read: `logit` and `attention` need the response rows only
    (`ctxmix.engine.rows.trace_rows`: one forward pass, no n x n map held, no layer replayed); `alti_logit`
    needs every row's ALTI map, so a full trace (streamed above its memory share), which the others share.
    streamed=True asks for the full streamed trace (tests compare the paths)."""
    from ctxmix.engine.rows import NoAttentionRows, trace_rows

    if not full and streamed is None:
        try:
            return trace_rows(model, ids, rows)
        except NoAttentionRows:
            pass
    return trace_ids(model, ids, streamed=streamed, logits_from=rows[0])  # the response rows' logits only


def run_one_pass(
    model: Model,
    methods: list[str],
    ids: list[int],
    P: int,
    target: str,
    streamed: bool | None = None,
    *,
    share_trace: bool = True,
) -> dict:
    """{method: {"per_token", "terms", "target", "cost"}} of the decomposed methods (`DECOMPOSED`) from one traced
    pass over ids (prompt + response). streamed: trace_ids' choice (None: streamed above its memory share).
    share_trace False: `alti_logit`'s full trace is not shared with the methods that need only the response rows
    (they get their own rows pass), so each method's seconds are what it costs run alone (the benchmark's time
    columns); the scores are the same either way."""
    bad = [m for m in methods if m not in DECOMPOSED]
    if bad:
        raise ValueError(f"run_one_pass runs {', '.join(DECOMPOSED)}; not {', '.join(bad)}")
    for m in ("logit", "alti_logit"):
        if m in methods:
            prepare(model, m, {})
    T = len(ids) - P
    rows = list(range(P - 1, P - 1 + T))
    targets = list(ids[P:])
    out = {}
    dec = [m for m in DECOMPOSED if m in methods]
    groups = [dec] if share_trace else [[m for m in dec if m != "alti_logit"], [m for m in dec if m == "alti_logit"]]
    for group in filter(None, groups):
        sw = Stopwatch(model.device)
        t0 = sw.mark()
        tr = _trace(model, ids, rows, streamed, full="alti_logit" in group)
        sw.add(t0, "trace")
        res = decompose_rows(model, tr, rows, targets, target, group)
        trace_secs = sw.seconds()["trace"]  # read after decompose_rows, which has waited for the GPU
        for m in group:
            r = res[m]
            if m != "attention":
                r["reconstruction_error"] = float(tr.reconstruction_error)
            # the traced pass and the layer rebuilds are shared: each method is charged them (a method run alone
            # costs that, unless it shares alti_logit's full trace: share_trace=False) plus its own work
            secs = trace_secs + res["shared_seconds"] + r.pop("seconds")
            r["cost"] = {"forward": 1, "backward": 0, "seconds": secs, "streamed": bool(tr.streamed)}
            out[m] = r
        del tr
    return out


def prepare(model: Model, name: str, options: dict) -> dict:
    """Before any pass: `logit` and `alti_logit` read the target through the model's head (BadInput without one)."""
    from ctxmix.methods.prediction import check_logit_model

    check_logit_model(model, name)
    return {}


def run(job, names: list[str]) -> dict:
    """The registry's run function of logit, alti_logit and attention (`ctxmix.methods.context.job`)."""
    return run_one_pass(job.model, names, job.ids, job.P, job.target, share_trace=job.share_trace)
