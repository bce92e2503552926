"""Prediction methods: how the mixing builds one prediction of a causal language model.

`logit` and `alti_logit` (Ferrando, Gállego, Tsiamas, Costa-jussà, "Explaining How Transformers Use
Context to Build Predictions", ACL 2023; official code: mt-upc/logit-explanations) split the logit of
the target token w at position t (or the difference logit_w - logit_f against a foil f) into what
each layer's attention block writes to the residual stream at t from each source position j:

    logit_w = <x_t^0, r_w> + sum_l [ sum_j D^l_j + <b_O^l, r_w> + <m_t^l, r_w> ] + <beta_f, u_w> + b_w

with r_w = C(gamma_f * u_w) / s_f(x_t^L) the readout vector: the final norm's scale s_f frozen at its
real value on the real pre-norm state x_t^L (C centres for LayerNorm; RMSNorm has no centring and no
beta; Gemma's (1 + w) is the norm's gamma), u_w row w of the unembedding, b_w its bias (Phi). This is
exact, not a Taylor expansion (the note's N3-N7). D^l_j = sum_h alpha^{h,l}_{tj} <W_O^h (W_V^h LN1(x_j)
+ b_V^h), r_w>: LN1 acts on each source token with its own scale, so the split is exact; LN1's beta
and b_V are spread through alpha, as the official code's `aff_x_j` does.

- `logit`: layer_saliency[l, j] = D^l_j ("token identity preserved" across layers).
- `alti_logit`: layer_saliency[l] = D^l R^{l-1}, R the ALTI rollout of layers 1..l-1 (R^0 = I), so a
  layer-l source position is traced back to the model's input tokens. Rows of R sum to one, so both
  methods give the same total.
- saliency = the layers' sum, plus <x_t^0, r_w> at position t (the official code adds the predicted
  position's own embedding there; `embedding="term"` keeps it in `logit_terms` instead).
- `logit_terms`: what no token gets: per layer the attention output bias b_O and the MLP update
  (the MLP is token-wise and not attributed, as in the paper), the final norm's beta and the
  unembedding bias; for `alti_logit` also "untraced", per layer: what reached a position whose ALTI
  row is all zero (every contribution clipped), which the rollout passes to no token. The tokens'
  sum plus these terms is the explained logit (difference).

Shapes of the layer: pre-LN (GPT-2, OPT-125m+, Llama, Qwen, Mistral, Gemma 1, Phi-3): x^l = x + attn + ff.
Parallel (GPT-NeoX, Phi-1/2): attention and MLP read the same x; the same sum holds, and ALTI's block
output is x + attn. Sandwich (Gemma 2/3): attn and ff pass through their own output norms, each with its
real scale frozen, so D^l_j is taken through LNa (an extension the note derives, §2.8). Gemma 2's final
logit soft-capping c*tanh(z/c) is not linear: the pre-cap logit z is decomposed. Post-LN decoders
(OPT-350m) put a norm on the residual path after every layer: the sum above does not exist there, and
they are refused, as are masked LMs (their head's dense + GELU + LayerNorm is not linear).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ctxmix.engine.layer import head_values
from ctxmix.engine.models import Model
from ctxmix.engine.trace import Trace
from ctxmix.errors import BadInput
from ctxmix.methods.readout import (
    TARGET_KINDS,
    centred,
    explained_logits,
    norm_adjoint,
    readout,
    softcap,
    target_readout,
    unembed,
    unembedding,
)

LOGIT_METHODS = ("logit", "alti_logit")


def check_logit_model(model: Model, method: str) -> None:
    """A clear refusal where the logit decomposition is not exact (see the module docstring)."""
    if model.kind != "causal_lm":
        raise BadInput(
            f"{method} explains a causal language model's next-token logit; {model.name} is a "
            f"{model.kind.replace('_', ' ')} (masked LMs are not supported: their head is not linear)"
        )
    if model.spec.position == "post":
        raise BadInput(
            f"{method} needs a pre-LN, parallel or sandwich decoder; {model.name} normalises the residual "
            "stream after every layer (post-LN), so its logit has no exact sum over layers"
        )


@dataclass
class LogitParts:
    """The decomposition of K explained logits (the target's, and the foil's) at one position.

    per_head (K, L, H, n): D^{l,h}_j; embedding (K,): <x_t^0, r>; attention_bias, mlp (K, L);
    final_norm_bias, unembedding_bias (K,); logits (K,): the explained logits (`explained_logits`: the
    model's own, or the recomputed pre-cap logits where it soft-caps); recomputed (K,): the logits from
    ctxmix's recomputed final state. For a target kind other than the raw logit (K = 1,
    `ctxmix.methods.readout.target_readout`): logits is the model's log p (or log p - log(1 - p)), the parts
    decompose its centred logit, and `leftover` holds -H ("entropy") and, on a soft-capped model, "softcap"."""

    per_head: torch.Tensor
    embedding: torch.Tensor
    attention_bias: torch.Tensor
    mlp: torch.Tensor
    final_norm_bias: torch.Tensor
    unembedding_bias: torch.Tensor
    logits: torch.Tensor
    recomputed: torch.Tensor
    notes: list[str] = field(default_factory=list)
    leftover: dict[str, torch.Tensor] = field(default_factory=dict)  # (K,) each: -H(p) etc. (target_kind)

    def total(self) -> torch.Tensor:
        """(K,) the sum of every part: equals `recomputed` (and `logits` to the reconstruction error)."""
        return (
            self.per_head.sum((1, 2, 3))
            + self.embedding
            + self.attention_bias.sum(1)
            + self.mlp.sum(1)
            + self.final_norm_bias
            + self.unembedding_bias
            + sum((v.to(self.embedding) for v in self.leftover.values()), torch.zeros_like(self.embedding))
        )


@torch.no_grad()
def logit_parts(model: Model, tr: Trace, position: int, tokens: list[int], kind: str = "logit") -> LogitParts:
    """Decompose the logits of `tokens` (K ids) at `position` over layers, heads and source tokens; kind
    ("logit", "log_prob", "logit_prob"; the last two for one token): the quantity explained
    (`ctxmix.methods.readout.target_readout`)."""
    U_t, ub_t = unembedding(model, tokens)
    own = tr.logits[position] if tr.logits is not None and tr.logits.dim() == 2 else None
    if kind == "logit":
        rows, ro = U_t, None
    else:
        if own is None or len(tokens) != 1:
            raise ValueError("a target kind other than the logit needs the model's logits and one token")
        ro = target_readout(model, own[None], torch.tensor(tokens, device=own.device), kind)
        rows = ro["rows"]
    x_last = tr.states[-1].y[position]
    r, beta = readout(model, x_last, rows)  # (K, d), (K,)
    K, t = len(tokens), position
    heads, attn_bias, mlp = [], [], []
    for lw, st in zip(model.layers, tr.states):
        src = st.x if lw.position == "post" else st.x1
        v = head_values(lw, src, with_bias=True)  # (H, n, dh): b_V and LN1's beta spread through alpha
        Wo = lw.Wo.view(lw.n_heads, lw.head_dim, -1)  # (H, dh, d)
        r_attn = r
        bo = lw.bo
        if lw.position == "sandwich":  # through LNa with the scale of the real attention output at t
            na = lw.post_attn_norm
            s_a = na.scale(st.attn[t])
            r_attn = norm_adjoint(na, r, s_a)
            bo_vec = na.decompose_bias(lw.bo if lw.bo is not None else torch.zeros_like(st.attn[t]), s_a)
            attn_bias.append(bo_vec @ r.T)
            ff_vec = lw.post_ff_norm(st.ff[t])
        else:
            attn_bias.append(bo @ r.T if bo is not None else torch.zeros(K, dtype=r.dtype, device=r.device))
            ff_vec = st.ff[t]
        w = torch.einsum("hed,kd->khe", Wo, r_attn)  # (K, H, dh): W_O^h r
        heads.append(st.alpha[:, t, :].unsqueeze(0) * torch.einsum("hje,khe->khj", v, w))  # (K, H, n)
        mlp.append(ff_vec @ r.T)
    per_head = torch.stack(heads, 1)  # (K, L, H, n)
    notes = []
    cap = softcap(model)
    if ro is not None:  # the centred logit is decomposed; -H (and the cap's part) are left over
        assert own is not None
        norm = model.final_norm
        final = norm(x_last) if norm is not None else x_last
        z_pre = unembed(model, final)[None].to(torch.float64)  # (1, V) recomputed, pre-cap
        tg = torch.tensor(tokens, device=z_pre.device)
        leftover = dict(ro["leftover"])
        if cap is not None:
            leftover["softcap"] = centred(own[None], tg, ro["weights"]) - centred(z_pre, tg, ro["weights"])
            notes.append(
                f"{model.name} soft-caps its logits (c tanh(z/c), c = {cap:g}): the pre-cap centred logit is "
                "decomposed and the cap's part is left over ('softcap')"
            )
        leftover = {k: v.to(r.dtype) for k, v in leftover.items()}
        recomputed = (centred(z_pre, tg, ro["weights"]) + sum(v.double() for v in leftover.values())).to(r.dtype)
        return LogitParts(
            per_head=per_head,
            embedding=r @ tr.hidden[0][t],
            attention_bias=torch.stack(attn_bias, 1),
            mlp=torch.stack(mlp, 1),
            final_norm_bias=beta,
            unembedding_bias=ro["bias"].to(r.dtype),
            logits=ro["value"].to(r.dtype),
            recomputed=recomputed,
            notes=notes,
            leftover=leftover,
        )
    if cap is not None:
        notes.append(f"{model.name} soft-caps its logits (c tanh(z/c), c = {cap:g}): the pre-cap logit z is decomposed")
    recomputed = explained_logits(model, x_last, tokens, None)
    logits = explained_logits(model, x_last, tokens, own)  # the recomputed z where the model soft-caps
    return LogitParts(
        per_head=per_head,
        embedding=r @ tr.hidden[0][t],
        attention_bias=torch.stack(attn_bias, 1),
        mlp=torch.stack(mlp, 1),
        final_norm_bias=beta,
        unembedding_bias=ub_t if ub_t is not None else torch.zeros(K, dtype=r.dtype, device=r.device),
        logits=logits.to(r.dtype),
        recomputed=recomputed,
        notes=notes,
    )


def alti_trace_back(D: np.ndarray, alti_layer_maps: np.ndarray | torch.Tensor) -> np.ndarray:
    """ALTI-Logit's per-layer form: D (..., L, n) layer-l updates per source position -> (..., L, n)
    with layer l's row times R^{l-1} = C^{l-1} ... C^1 (R^0 = I), C the ALTI layer maps (L, n, n).
    Products from each layer down (L^2 n^2), never the n^3 rollout, on the maps' device in float64:
    step k multiplies the rows of every layer above k by C^k at once (one matrix product per layer,
    each row meeting the same maps in the same order as a vector-matrix loop would)."""
    C = torch.as_tensor(alti_layer_maps)
    V = torch.as_tensor(D, dtype=torch.float64).to(C.device).clone()  # (..., L, n)
    for k in range(V.shape[-2] - 2, -1, -1):
        V[..., k + 1 :, :] = V[..., k + 1 :, :] @ C[k].to(torch.float64)
    return V.cpu().numpy()


@dataclass
class LogitExplanation:
    """What `explain` stores for one logit method: rows (K, n) per explained token (target, foil),
    layer (L, n) and heads (L, H, n) of the explained quantity (target, or target - foil),
    saliency (n,), terms (what no token gets), explained (the logit or difference)."""

    rows: np.ndarray
    layer: np.ndarray
    heads: np.ndarray
    saliency: np.ndarray
    terms: dict
    explained: float


def logit_explanation(
    parts: LogitParts,
    method: str,
    position: int,
    alti_layer_maps: np.ndarray | torch.Tensor | None = None,
    embedding: str = "token",
) -> LogitExplanation:
    """`logit` or `alti_logit` from the parts of K = 1 (target) or 2 (target, foil) logits."""
    if embedding not in ("token", "term"):
        raise BadInput(f"embedding must be 'token' (added to the predicted position) or 'term', got {embedding!r}")
    H = parts.per_head.double().cpu().numpy()  # (K, L, H, n)
    untraced = None
    if method == "alti_logit":
        if alti_layer_maps is None:
            raise ValueError("alti_logit needs the ALTI layer maps")
        before = H.sum((2, 3))
        H = alti_trace_back(H.transpose(0, 2, 1, 3), alti_layer_maps).transpose(0, 2, 1, 3)
        # ALTI leaves a row all zero where every contribution is clipped (the block's output is
        # dominated by what no token gives); what reached such a position is traced to no token
        untraced = before - H.sum((2, 3))  # (K, L)
    layer = H.sum(2)  # (K, L, n)
    emb = parts.embedding.double().cpu().numpy()
    rows = layer.sum(1)
    if embedding == "token":
        rows[:, position] += emb
    sign = np.array([1.0, -1.0])[: len(rows)]  # target minus foil
    terms = {
        "attention_bias": (sign @ parts.attention_bias.double().cpu().numpy()).tolist(),
        "mlp": (sign @ parts.mlp.double().cpu().numpy()).tolist(),
        "final_norm_bias": float(sign @ parts.final_norm_bias.double().cpu().numpy()),
        "unembedding_bias": float(sign @ parts.unembedding_bias.double().cpu().numpy()),
    }
    if embedding == "term":
        terms["embedding"] = float(sign @ emb)
    if untraced is not None:
        terms["untraced"] = (sign @ untraced).tolist()
    for k, v in parts.leftover.items():  # -H(p) etc. for a target kind other than the logit
        terms[k] = float(sign @ v.double().cpu().numpy())
    return LogitExplanation(
        rows=rows,
        layer=np.tensordot(sign, layer, 1),
        heads=np.tensordot(sign, H, 1),
        saliency=sign @ rows,
        terms=terms,
        explained=float(sign @ parts.logits.double().cpu().numpy()),
    )


def unattributed(terms: dict) -> float:
    """The sum of a `logit_terms` dict (lists are per layer)."""
    return float(sum(sum(v) if isinstance(v, list) else v for v in terms.values()))


def check_prediction_call(
    model: Model,
    methods: list[str],
    embedding: str = "token",
    flow_rows: str = "position",
    n: int = 0,
    decompx: dict | None = None,
) -> None:
    """Before any work: every requested prediction method applies to this model, its options are valid,
    and attention flow on n tokens stays within its time limit (`ctxmix.methods.flow.check_flow_cost`)."""
    for m in methods:
        if m in LOGIT_METHODS:
            check_logit_model(model, m)
    if embedding not in ("token", "term"):
        raise BadInput(f"embedding must be 'token' (added to the predicted position) or 'term', got {embedding!r}")
    if flow_rows not in ("position", "all"):
        raise BadInput(f"flow_rows must be 'position' (the explained row) or 'all', got {flow_rows!r}")
    if decompx is not None and "decompx" not in methods:
        raise BadInput("decompx= gives DecompX's options; add 'decompx' to the methods")
    if "decompx" in methods:
        from ctxmix.methods.decompx import DecompXOptions, check_pieces_fit, head_kind

        if not isinstance(decompx, (dict, type(None))) or set(decompx or {}) - {"bias", "ff", "head"}:
            raise BadInput(
                f"decompx takes a dict with bias, ff and head, got {decompx!r}; "
                "e.g. decompx={'bias': 'absdot', 'ff': 'zero_origin', 'head': True} (the defaults)"
            )
        o = DecompXOptions(**(decompx or {})).check()
        if model.spec.encoder_decoder:
            raise BadInput("decompx explains encoders, classifiers and causal LMs, not encoder-decoders")
        if o.head:
            head_kind(model)  # refuses a head without a rule
        check_pieces_fit(model, n, o.ff)
    if "attention_flow" in methods:
        from ctxmix.methods.flow import FLOW_ROW_SECONDS, check_flow_cost

        # every row: n rows within the time one row may take
        check_flow_cost(n, model.n_layers, FLOW_ROW_SECONDS / (n if flow_rows == "all" else 1))


def prediction_fields(
    ex,
    model: Model,
    tr: Trace,
    methods: list[str],
    target,
    foil,
    per_head: bool,
    embedding: str = "token",
    alti_layer_maps: np.ndarray | torch.Tensor | None = None,
    target_kind: str = "logit",
) -> None:
    """Fill an Explanation's prediction fields for `methods` (its position is already set):
    target and foil resolved as the gradient methods resolve them, the explained logit (difference)
    in `ex.prediction["explained"]`. target_kind: "logit" (the raw logit), "log_prob" (T1) or
    "logit_prob" (T2) of the target, without a foil (`check_target_kind`)."""
    from ctxmix.methods.saliency import resolve_foil, resolve_target

    t = ex.position
    tgt = resolve_target(model, tr, target, t)
    f = resolve_foil(model, tr, foil, tgt, t)
    V = model.hf.get_output_embeddings().weight.shape[0]
    for tok, what in ((tgt, "target"), (f, "foil")):
        if tok is not None and not 0 <= tok < V:
            raise BadInput(f"the {what} token id {tok} is outside the vocabulary (0..{V - 1})")
    ex.target, ex.foil = tgt, f
    parts = logit_parts(model, tr, t, [tgt] + ([f] if f is not None else []), target_kind)
    for note in parts.notes:
        if note not in ex.warnings:
            ex.warnings.append(note)
    for m in methods:
        le = logit_explanation(parts, m, t, alti_layer_maps, embedding)
        ex.saliency[m] = le.saliency
        ex.layer_saliency[m] = le.layer
        ex.logit_contributions[m] = le.rows
        ex.logit_terms[m] = le.terms
        if per_head:
            ex.head_saliency[m] = le.heads
    toks = model.tokens([tgt] + ([f] if f is not None else []))
    name = {"logit": "logit", "log_prob": "log p", "logit_prob": "logit p"}[target_kind]
    what = f"{name}({toks[0]})" + (f" - logit({toks[1]})" if f is not None else "") + f" at position {t}"
    ex.prediction = {**(ex.prediction or {}), "explained": {"what": what, "value": le.explained}}
    ex.options["embedding"] = embedding
    if target_kind != "logit":  # recorded only when asked for: explanations without it read as before
        ex.options["target_kind"] = target_kind


def check_target_kind(target_kind, foil) -> None:
    """explain's target_kind, before any work: a known kind, and no foil with a kind other than the logit
    (log p_w - log p_f = z_w - z_f: the default already explains a difference against a foil). A call
    without logit or alti_logit gets a warning (`_explanations`), as a foil without a method that reads it."""
    if target_kind not in TARGET_KINDS:
        raise BadInput(f"target_kind must be one of {', '.join(TARGET_KINDS)}, got {target_kind!r}")
    if target_kind == "logit":
        return
    if foil is not None:
        raise BadInput(
            f"target_kind={target_kind!r} explains one token's {target_kind.replace('_', ' ')}; with a foil the "
            "difference of log-probabilities is the logit difference, which the default target_kind='logit' explains"
        )


def applicable_prediction_methods(model) -> list[str]:
    """The prediction methods that apply to `model` (what a page offers): DecompX on encoders (without
    a head), classifiers and causal LMs; Logit and ALTI-Logit on causal LMs that are not post-LN;
    attention flow on every model but encoder-decoders."""
    if model.spec.encoder_decoder:
        return []
    from ctxmix.methods.decompx import head_kind

    try:
        head_kind(model)
        out = ["decompx"]
    except Exception:  # noqa: BLE001 - a head without a rule: decompx only with head=False, not offered
        out = []
    if model.kind == "causal_lm" and model.spec.position != "post":
        out += ["logit", "alti_logit"]
    return out + ["attention_flow"]
