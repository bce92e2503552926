"""`verify`: the checks ctxmix's tests run, on the user's own model and text.

Each check compares two independent computations and reports the largest error against a
tolerance for the model's dtype:

- the layers recomputed from the weights against the model's own hidden states;
- every scope of the FF paper: its contribution vectors plus its bias against the real vector
  it decomposes (layer by layer);
- value zeroing (batched, from the recomputed layer) against the per-token loop on the model
  itself (`value_zeroing_loop`: the official algorithm, one zeroed value vector at a time);
- the FF's closed-form zero-baseline Integrated Gradients against numeric IG (Gauss-Legendre,
  Jacobian-vector products of the FF);
- the rows that a method promises sum to one (attention, rollout, ALTI, value zeroing) do;
- DecompX: every token's parts summed over tokens against the model's own hidden state after each
  layer, and, where its head has a rule, the parts of each logit against the model's logits;
- on a causal language model, `logit` and `alti_logit`: the tokens' parts plus the unattributed terms
  against the model's own logit difference (predicted token minus the runner-up) at the last position.
"""

from __future__ import annotations

import contextvars

import numpy as np
import pandas as pd
import torch

from ctxmix.engine.attention import output_only
from ctxmix.engine.models import Model
from ctxmix.errors import BadInput

# the value-zeroing reference's temporary hooks act only in the context of the call that installed them
_OWNER: contextvars.ContextVar[object | None] = contextvars.ContextVar("ctxmix_verify_owner", default=None)

COLUMNS = ["check", "error", "tolerance", "passed", "detail"]


def _tolerances(model: Model) -> dict[str, float]:
    """Relative tolerances: float64 models are exact to rounding, but some Hugging Face families
    compute their norms or softmax in float32 inside; float32 models to float32 rounding; models
    held in half precision are decomposed on float32 upcasts of their half-precision states."""
    if model.dtype == torch.float64:
        inside32 = model.spec.norm == "rmsnorm" or model.spec.family in ("OPT", "ModernBERT")
        return {"state": 1e-6 if inside32 else 1e-9, "exact": 1e-9, "vz": 1e-6 if inside32 else 1e-8, "ig": 1e-6}
    if model.dtype == torch.float32:
        return {"state": 1e-4, "exact": 1e-4, "vz": 1e-4, "ig": 1e-4}
    return {"state": 5e-2, "exact": 1e-4, "vz": 5e-2, "ig": 1e-4}


def _value_columns(model: Model, width: int) -> torch.Tensor:
    """The columns of the value projection's output that hold V (all of it, or V of a fused QKV)."""
    if not model.spec.fused_qkv:
        return torch.arange(width, device=model.device)
    from ctxmix.engine.arch import value_columns

    w = model.widths
    return value_columns(model.spec, w["heads"], w["kv_heads"], w["head_dim"], model.device)


@torch.no_grad()
def value_zeroing_loop(model: Model, input_ids: list[int]) -> np.ndarray:
    """Value zeroing by the official algorithm (Mohebbi et al. 2023), on the model itself: for each
    layer l and token t, the whole model runs with a forward hook on layer l's value projection
    that zeroes v_t (all heads, bias included; queries, keys and the attention weights untouched),
    and layer l's output is compared with the unperturbed one: C[l, i, t] = 1 - cos(y_i', y_i) in
    float64, clipped at 0, rows normalised to sum to one. Returns (L, n, n).

    The n zeroings of one layer run as one batch of n copies (row t zeroes token t), so the loop
    costs L forward passes of n sequences. Works on every family ctxmix describes: separate or
    fused value projections ([Q | K | V] columns), grouped-query attention (a value head shared by
    several query heads is zeroed for all of them, as it is one vector)."""
    from ctxmix.engine.arch import _get

    ids = torch.tensor([list(input_ids)], device=model.device)
    n = ids.shape[1]
    layers = _get(model.hf.base_model, model.spec.layers)
    L = len(layers)
    captured: dict[int, torch.Tensor] = {}
    mine = object()  # the hooks act on this call's passes only (another thread's pass of the model is untouched)
    token = _OWNER.set(mine)

    def capture(l):
        def hook(mod, inp, out):
            if _OWNER.get() is mine:
                captured[l] = (out[0] if isinstance(out, tuple) else out).detach()

        return hook

    handles = [layer.register_forward_hook(capture(l)) for l, layer in enumerate(layers)]
    net = model.hf.get_encoder() if model.spec.encoder_decoder else model.hf  # an encoder-decoder: its encoder
    try:
        with output_only(model):
            net(input_ids=ids, attention_mask=torch.ones_like(ids), **model.type_ids_kwargs([None]))
        ref = {l: captured[l][0].double() for l in range(L)}
        C = torch.zeros(L, n, n, dtype=torch.float64, device=model.device)
        batch = ids.expand(n, -1)
        rows = torch.arange(n, device=model.device)
        for l, layer in enumerate(layers):
            value = _get(layer, model.spec.value)

            def zero_v(mod, inp, out):
                if _OWNER.get() is not mine:
                    return None
                out = out.clone()
                cols = _value_columns(model, out.shape[-1])
                out[rows[:, None], rows[:, None], cols[None, :]] = 0.0  # copy t: token t's value vector
                return out

            h = value.register_forward_hook(zero_v)
            try:
                with output_only(model):
                    net(input_ids=batch, attention_mask=torch.ones_like(batch))
            finally:
                h.remove()
            y = captured[l].double()  # (n copies, n tokens, d)
            cos = torch.nn.functional.cosine_similarity(y, ref[l][None], dim=-1)  # (t, i)
            C[l] = (1.0 - cos).clamp(min=0.0).T
    finally:
        for h in handles:
            h.remove()
        _OWNER.reset(token)
    C = C.cpu().numpy()
    s = C.sum(-1, keepdims=True)
    return C / np.where(s > 0, s, 1.0)


def _ff_numeric_ig(lw, st, rows: torch.Tensor, F: torch.Tensor, nodes: int = 96) -> torch.Tensor:
    """Zero-baseline IG of the FF's activation along the straight path to its pre-activation,
    split over the input pieces F (B, c, m, d) (each piece's share of the pre-activation is F_j W),
    by Jacobian-vector products at `nodes` Gauss-Legendre points, times W_2: (B, c, m, d_out).
    The reference `ctxmix.engine.layer.ff_pieces`' closed forms (g(u)/u; SwiGLU/GeGLU weights) must meet."""
    x, w = np.polynomial.legendre.leggauss(nodes)
    if lw.gated:
        g, up = st.u[:, rows].unsqueeze(2), st.u_up[:, rows].unsqueeze(2)
        tang = (F @ lw.Wg, F @ lw.Wu)

        def phi(a, b):
            return lw.act(a) * b
    else:
        g, up = st.u[:, rows].unsqueeze(2), None
        tang = (F @ lw.W1,)

        def phi(a):
            return lw.act(a)

    out = torch.zeros_like(tang[0])
    for a, wk in zip((x + 1) / 2, w / 2):
        primal = tuple(float(a) * t.expand_as(tang[0]).contiguous() for t in ((g, up) if lw.gated else (g,)))
        _, jv = torch.func.jvp(phi, primal, tang)
        out += float(wk) * jv
    return out @ lw.W2


def _check(name: str, error: float, tol: float, detail: str = "") -> dict:
    ok = bool(np.isfinite(error) and error <= tol)
    return {"check": name, "error": float(error), "tolerance": tol, "passed": ok, "detail": detail}


def verify(
    model: Model,
    text: str = "The keys to the cabinet are on the table .",
    max_tokens: int = 48,
    decoder_text: str | None = None,
) -> pd.DataFrame:
    """Run ctxmix's correctness checks on `model` and `text`; one row per check with the largest
    relative error, its tolerance and whether it passed (columns check, error, tolerance, passed,
    detail). Errors are relative to the largest |value| of what is compared. On an encoder-decoder
    the checks above run on its encoder, and the decoder's are added (`decoder_text`, by default
    the text itself): its layers recomputed, ALTI+'s two decompositions per layer exact, its rows
    summing to one."""
    from ctxmix.engine.layer import ff_pieces, scope_pieces
    from ctxmix.engine.trace import trace
    from ctxmix.methods.explain import explain
    from ctxmix.methods.mixing import _scope_targets
    from ctxmix.methods.registry import MIXING_METHODS

    e = model.encode_input(text)
    if len(e.ids) > max_tokens:
        raise BadInput(f"verify runs on short texts (at most {max_tokens} tokens; this one has {len(e.ids)})")
    tol = _tolerances(model)
    rows = []
    tr = trace(model, text)
    scale = max(float(h.abs().max()) for h in tr.hidden)
    rows.append(
        _check(
            "layers recomputed from the weights = the model's hidden states",
            tr.reconstruction_error / max(scale, 1e-30),
            tol["state"],
            f"{model.n_layers} layers, {tr.n} tokens, largest |state| {scale:.3g}",
        )
    )
    idx = torch.arange(tr.n, device=tr.states[0].x.device)
    worst: dict[str, float] = {}
    ig_err, ig_scale = 0.0, 1e-30
    with torch.no_grad():
        for lw, st1 in zip(model.layers, tr.states):
            st = st1.as_batch()
            pieces = scope_pieces(lw, st, idx, next_ln=True)
            real = {
                s: v[:, idx] if v is not None else None
                for s, v in _scope_targets(lw, st, torch.arange(st.x.shape[1], device=idx.device)).items()
            }
            for name, (F, b) in pieces.items():
                target = real.get(name)
                if target is None:
                    continue
                err = float((F.sum(-2) + b - target).abs().max()) / max(float(target.abs().max()), 1e-30)
                worst[name] = max(worst.get(name, 0.0), err)
            if lw.position == "parallel":  # the FF reads LN2(x_i): one piece per row, token i's own
                x = st.x[:, idx]
                F_in = lw.ln2.decompose_pieces(x.unsqueeze(-2), lw.ln2.scale(x))
                b_in = (lw.ln2.beta if lw.ln2.beta is not None else torch.zeros_like(x[0, 0])).expand_as(x)
            else:
                F_in, b_in = pieces["Atb" if lw.position == "post" else "AtbLn"]
            closed = ff_pieces(lw, st, idx, F_in, b_in)[0]
            with torch.enable_grad():
                numeric = _ff_numeric_ig(lw, st, idx, F_in)
            ig_err = max(ig_err, float((closed - numeric).abs().max()))
            ig_scale = max(ig_scale, float(closed.abs().max()))
    for name, err in worst.items():
        rows.append(
            _check(
                f"scope {name}: contributions + bias = its real vector", err, tol["exact"], "every layer, every token"
            )
        )
    rows.append(
        _check(
            "FF closed-form IG = numeric IG (96-node Gauss-Legendre)",
            ig_err / ig_scale,
            tol["ig"],
            "every layer, every piece",
        )
    )
    ex = explain(model, text, ["value_zeroing", "attention", "attention_rollout", "alti"])
    loop = value_zeroing_loop(model, e.ids)
    vz = ex.layer_maps["value_zeroing"]
    rows.append(
        _check(
            "value zeroing = the per-token loop on the model",
            float(np.abs(vz - loop).max()),
            tol["vz"],
            "hooks zero one value vector at a time; rows normalised",
        )
    )
    for m in ("attention", "attention_rollout", "alti", "value_zeroing"):
        if MIXING_METHODS[m].rows_sum_to_one:
            err = max(
                float(np.abs(ex.layer_maps[m].sum(-1) - 1).max()), float(np.abs(ex.global_maps[m].sum(-1) - 1).max())
            )
            rows.append(
                _check(
                    f"{m}: rows sum to one (per layer and aggregated)",
                    err,
                    1e-5 if model.dtype != torch.float64 else 1e-6,
                    "",
                )
            )
    if not model.spec.encoder_decoder:
        rows += _decompx_checks(model, tr, tol)
    if model.kind == "causal_lm" and model.spec.position != "post":
        rows += _logit_checks(model, text, tr, tol)
    if model.spec.encoder_decoder:
        rows += _decoder_checks(model, text, text if decoder_text is None else decoder_text, tol)
    return pd.DataFrame(rows, columns=COLUMNS)


def _decompx_checks(model: Model, tr, tol: dict) -> list[dict]:
    """DecompX's parts against the model's own states (each layer but the last, whose output the model
    hands back through its final norm) and logits (predicted and runner-up rows of an LM)."""
    from ctxmix.methods.decompx import DecompXOptions, decompx_layer, head_kind

    try:
        has_rule = head_kind(model) != "none"
    except BadInput:
        has_rule = False
    o = DecompXOptions(head=has_rule)
    V, err = None, 0.0
    with torch.no_grad():
        for l, (lw, st) in enumerate(zip(model.layers, tr.states)):
            V = decompx_layer(lw, st, V, o)
            real = tr.hidden[l + 1] if l + 1 < model.n_layers else st.y
            err = max(err, float((V.sum(1) - real).abs().max() / real.abs().max().clamp(min=1e-30)))
    out = [_check("decompx: token parts summed = the model's state after each layer", err, tol["state"], "")]
    if has_rule:
        from ctxmix.methods.decompx import decompx

        t = tr.n - 1 if model.kind == "causal_lm" else 0
        tokens = torch.topk(tr.logits[t], 2).indices.tolist() if model.kind == "causal_lm" else None
        r = decompx(model, tr, t, tokens, o)
        gap = float(np.abs(r.parts.sum(1) - r.logits).max() / max(float(np.abs(r.logits).max()), 1.0))
        out.append(_check("decompx: token parts summed = the model's logits", gap, tol["state"], head_kind(model)))
    return out


def _logit_checks(model: Model, text: str, tr, tol: dict) -> list[dict]:
    """Completeness of the logit methods against the model's own logits (predicted minus runner-up)."""
    from ctxmix.methods.explain import explain
    from ctxmix.methods.prediction import unattributed

    top2 = torch.topk(tr.logits[-1], 2).indices.tolist()
    ex = explain(model, text, ["logit", "alti_logit"], target=top2[0], foil=top2[1])
    want = ex.prediction["explained"]["value"]
    out = []
    for m in ("logit", "alti_logit"):
        got = float(ex.saliency[m].sum()) + unattributed(ex.logit_terms[m])
        out.append(
            _check(
                f"{m}: tokens + unattributed terms = the model's logit difference",
                abs(got - want) / max(abs(want), 1.0),
                tol["state"],
                f"{ex.prediction['explained']['what']}: {want:.6g}",
            )
        )
    return out


def _decoder_checks(model: Model, text: str, decoder_text: str, tol: dict) -> list[dict]:
    """An encoder-decoder's decoder: recomputed layers, ALTI+'s decompositions, its rows."""
    from ctxmix.engine.seq2seq import decoder_weights, encode_target, trace_seq2seq
    from ctxmix.methods.alti_plus import alti_plus_pieces, explain_seq2seq

    dec_ids = encode_target(model, decoder_text)[0]
    tr = trace_seq2seq(model, model.encode(text)[0], dec_ids)
    scale = max(max(float(st.x.abs().max()), float(st.y.abs().max())) for st in tr.decoder)
    out = [
        _check(
            "decoder layers recomputed from the weights = the model's hidden states",
            tr.reconstruction_error / max(scale, 1e-30),
            tol["state"],
            f"{len(tr.decoder)} decoder layers, {len(dec_ids)} target tokens (encoder included)",
        )
    ]
    worst = {"self": 0.0, "cross": 0.0}
    with torch.no_grad():
        for (sw, cw), st in zip(decoder_weights(model), tr.decoder):
            P = alti_plus_pieces(sw, cw, st, torch.arange(st.x.shape[1], device=st.x.device))
            for k, (F, b, real) in P.items():
                worst[k] = max(
                    worst[k], float((F.sum(-2) + b - real).abs().max()) / max(float(real.abs().max()), 1e-30)
                )
    for k, what in (
        ("self", "self-attention block: target pieces"),
        ("cross", "cross-attention block: source pieces + residual"),
    ):
        out.append(_check(f"ALTI+ {what} + bias = its real output", worst[k], tol["exact"], "every decoder layer"))
    ex = explain_seq2seq(model, text, ["alti"], decoder_text)
    err = max(
        float(np.abs(ex.layer_maps["alti"].sum(-1) - 1).max()), float(np.abs(ex.global_maps["alti"].sum(-1) - 1).max())
    )
    out.append(
        _check(
            "ALTI+: rows sum to one (per decoder layer and rolled out)",
            err,
            1e-5 if model.dtype != torch.float64 else 1e-6,
            "",
        )
    )
    return out
