"""Gradient and perturbation saliency: one score per input token for one target.

The target scalar is the softmax probability of the target class (classifiers) or of the
target token at `position` (language models), as the ALTI and GlobEnc code use; CAT and
AttCAT use the logit, as the AttCAT code does. Gradients are taken with respect to the word
embeddings (`get_input_embeddings()`, grad_at="word", the default: position and segment embeddings
stay fixed; GlobEnc's Eq. 17 does not say which embedding e_i is) or, with
grad_at="embedding_output", with respect to layer 0's input (after BERT's embedding LayerNorm),
where the ALTI code differentiates and value zeroing's code reads its input (configs alti-table2 and
value-zeroing-table3 use it). Every forward pass reads the sequence's token_type_ids
(`Trace.type_ids_kwargs`), so a sentence pair is explained as the model reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ctxmix.engine.attention import ctxmix_pass, every_row
from ctxmix.engine.models import Model
from ctxmix.engine.tokens import non_word_ids, structural_ids
from ctxmix.engine.trace import Trace
from ctxmix.errors import BadInput

Target = int | tuple[int, int]  # a class or token id, or (target, foil): explain the logit difference


def _needs_head(model: Model) -> None:
    if model.kind == "encoder":
        raise BadInput(
            f"gradient and blank-out methods need a model with a head (a classifier or a language "
            f"model); {model.name!r} has none. Try 'minilm-sentiment'."
        )


def resolve_target(model: Model, tr: Trace, target, position: int) -> int:
    """The class index (classifiers) or token id (language models) to explain."""
    _needs_head(model)
    logits = tr.logits
    if model.kind == "classifier":
        n_labels = logits.reshape(-1).shape[0]
        if target is None:
            return int(logits.reshape(-1).argmax())
        if isinstance(target, str):
            l2i = {str(k): int(v) for k, v in (getattr(model.config, "label2id", None) or {}).items()}
            if target not in l2i:
                raise BadInput(f"unknown label {target!r}; labels: {', '.join(l2i)}")
            return l2i[target]
        if not 0 <= int(target) < n_labels:
            raise BadInput(f"target class {target} is outside 0..{n_labels - 1}")
        return int(target)
    if target is None:
        return int(logits[position].argmax())
    if isinstance(target, str):
        unk = getattr(model.tokenizer, "unk_token_id", None)
        ids = model.tokenizer.convert_tokens_to_ids([target])
        if ids and ids[0] is not None and ids[0] != unk:
            return int(ids[0])
        # as typed, e.g. " have": what the tokenizer makes of the text, when that is one token
        ids = model.tokenizer(target, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and ids[0] != unk:
            return int(ids[0])
        raise BadInput(
            f"target token {target!r} is not one token of the vocabulary (as a token, nor as text: {len(ids)} tokens)"
        )
    return int(target)


def _score(model: Model, logits: torch.Tensor, target, position: int, prob: bool = True) -> torch.Tensor:
    """Target scalar per batch element: logits (b, labels) or (b, n, vocab) -> (b,).

    target: a class / token id, or a (target, foil) pair: then the scalar is the logit difference
    l_t - l_f, and its sigmoid where a probability is needed (the runner's foil metrics use the same)."""
    z = logits if model.kind == "classifier" else logits[:, position]
    if isinstance(target, tuple):
        t, f = target
        d = z[:, t].double() - z[:, f].double()
        return torch.sigmoid(d) if prob else d
    z = torch.softmax(z.double(), -1) if prob else z
    return z[:, target]


def _embed(model: Model, ids: torch.Tensor) -> torch.Tensor:
    return model.hf.get_input_embeddings()(ids)


def _pass(model: Model, n: int, **fields):
    """This call's pass for a saliency forward over n tokens: the fast kernel (the model's own forward, SDPA where
    the family has it), or an enclosing pass's kernel."""
    from ctxmix.engine.attention import current_pass

    outer = current_pass()
    return ctxmix_pass(kernel=outer.kernel if outer is not None else "fast", **fields)


def _forward_embeds(model: Model, tr: Trace, E: torch.Tensor, mask: torch.Tensor | None = None, **kw):
    """The model on word embeddings E (b, n, d) of `tr`'s sequence, with its token_type_ids."""
    mask = torch.ones(E.shape[:2], dtype=torch.long, device=E.device) if mask is None else mask
    with _pass(model, E.shape[1]):
        return model.hf(inputs_embeds=E, attention_mask=mask, **tr.type_ids_kwargs(batch=E.shape[0]), **kw)


# "blank": layer 0's input of an all-zero image (the processor's mean colour) or clip (silence); images and clips only
IG_BASELINES = ("pad", "mask", "unk", "zero", "blank")
INPUT_IG_BASELINES = ("blank", "zero")


def _baseline_ids(model: Model, ids: list[int], baseline: str) -> list[int]:
    """The input with every non-special token replaced by the baseline token."""
    tok = model.tokenizer
    rep = {"pad": tok.pad_token_id, "mask": getattr(tok, "mask_token_id", None), "unk": tok.unk_token_id}.get(baseline)
    if rep is None:
        raise BadInput(f"this tokenizer has no {baseline} token; choose another baseline")
    keep = non_word_ids(tok)  # [UNK] is a word: it gets the baseline
    return [t if t in keep else rep for t in ids]


GRAD_AT = ("word", "embedding_output")


def _layer0_input(mod, args, kwargs):
    """A forward pre-hook on layer 0, inert outside a pass that sets `layer0_input`: layer 0 reads that (b, n, d)
    instead of the embedding module's output. Gradients and IG at the embedding output (after BERT's embedding
    LayerNorm and the position embeddings; the word embeddings for Llama-like models) run the model from there.
    Another thread's pass of the same model is untouched."""
    from ctxmix.engine.attention import current_pass

    p = current_pass()
    if p is None or p.layer0_input is None:
        return None
    X = p.layer0_input
    if args:
        return (X.to(args[0].dtype), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": X.to(kwargs["hidden_states"].dtype)}


def _install_layer0_hook(model: Model) -> None:
    from ctxmix.engine.arch import _get
    from ctxmix.engine.attention import install_once

    layer0 = _get(model.hf.base_model, model.spec.layers)[0]
    install_once(
        model.hf, "_ctxmix_layer0_hook", lambda: layer0.register_forward_pre_hook(_layer0_input, with_kwargs=True)
    )


def _input_kwargs(model: Model, tr: Trace, blank: bool = False) -> dict[str, torch.Tensor]:
    """The forward keywords of a trace's image or clip (pixel values, input values or features); blank: all zero
    (the processor's mean colour, silence)."""
    kw = tr.inputs.forward_kwargs(model.device, model.dtype)
    return {k: torch.zeros_like(v) if blank else v for k, v in kw.items()}


def _embedding_output(model: Model, tr: Trace, ids: list[int] | None, blank: bool = False) -> torch.Tensor:
    """Layer 0's input for `ids` (with the trace's token types), or for the trace's image or clip (`blank`: of an
    all-zero one, IG's "blank" baseline): (1, n, d)."""
    if tr.inputs is not None:  # the patch or frame embeddings (with positions, CLIP's pre-norm, ...)
        if not blank and tr.hidden:  # the trace holds the model's own, cast losslessly up: no forward pass again
            return tr.hidden[0].to(device=model.device, dtype=model.dtype)[None].clone()
        with torch.no_grad(), _pass(model, tr.n):
            out = model.hf(**_input_kwargs(model, tr, blank=blank), output_hidden_states=True)
        return out.hidden_states[0].detach()
    x = torch.tensor([ids], device=model.device)
    with torch.no_grad(), _pass(model, len(ids)):
        out = model.hf(
            input_ids=x, attention_mask=torch.ones_like(x), output_hidden_states=True, **tr.type_ids_kwargs()
        )
    return out.hidden_states[0].detach()


def _forward_at(model: Model, tr: Trace, X: torch.Tensor, grad_at: str):
    """The model run from word embeddings or from layer 0's input X (b, n, d) (an image's or a clip's: grad_at
    "embedding_output" only; its own embeddings are computed, then replaced)."""
    if grad_at == "word":
        return _forward_embeds(model, tr, X)
    _install_layer0_hook(model)
    if tr.inputs is not None:  # the embeddings of one input, then replaced by the b rows of X: IG's steps never
        # run the patch convolution or a speech model's feature encoder b times
        with _pass(model, X.shape[1], layer0_input=X):
            return model.hf(**_input_kwargs(model, tr))
    ids = torch.tensor([tr.input_ids], device=model.device).expand(X.shape[0], -1)
    with _pass(model, X.shape[1], layer0_input=X):
        return model.hf(input_ids=ids, attention_mask=torch.ones_like(ids), **tr.type_ids_kwargs(batch=X.shape[0]))


def _gradients(
    model: Model, tr: Trace, target: Target, position: int, grad_at: str = "word"
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.enable_grad():
        if grad_at == "word":
            E = _embed(model, torch.tensor([tr.input_ids], device=model.device))
        else:
            E = _embedding_output(model, tr, tr.input_ids)
        E = E.detach().requires_grad_(True)
        p = _score(model, _forward_at(model, tr, E, grad_at).logits, target, position)
        (g,) = torch.autograd.grad(p.sum(), E)
    return g[0], E[0].detach()


def ig_batch_size(model: Model, n: int, n_steps: int) -> int | None:
    """Interpolation steps per forward/backward pass of IG: all of them in one pass (captum's own
    default, and its speed) unless their activations, kept for the backward pass (about three
    times a traced sequence's states), would not fit half the memory budget; then as many as fit."""
    from ctxmix.engine.budget import memory_budget, sequence_bytes

    per_step = 3 * sequence_bytes(model, n, n_maps=0)
    fit = max(1, (memory_budget(model.device) // 2) // max(1, per_step))
    return None if fit >= n_steps else int(fit)


def integrated_gradients(
    model: Model,
    tr: Trace,
    target: Target,
    position: int,
    baseline: str = "pad",
    n_steps: int = 50,
    internal_batch_size: int | None = None,
    grad_at: str = "word",
) -> np.ndarray:
    """captum's IntegratedGradients on the word embeddings (or on layer 0's input, grad_at=
    "embedding_output": the baseline is then the baseline ids' embedding output, or zeros); per
    token |sum over dimensions|. internal_batch_size: steps per pass; by default all in one pass
    when memory allows (`ig_batch_size`)."""
    from captum.attr import IntegratedGradients

    if baseline not in IG_BASELINES:
        raise BadInput(f"unknown IG baseline {baseline!r}; choose one of {', '.join(IG_BASELINES)}")
    if n_steps < 1:
        raise BadInput("IG needs at least one step")
    if tr.inputs is not None and baseline not in INPUT_IG_BASELINES:
        raise BadInput(f"on an image or a clip ig_baseline is one of {', '.join(INPUT_IG_BASELINES)}, not {baseline!r}")
    if tr.inputs is None and baseline == "blank":
        raise BadInput("ig_baseline 'blank' is an image's or a clip's; on text choose pad, mask, unk or zero")
    if grad_at == "word":
        E = _embed(model, torch.tensor([tr.input_ids], device=model.device)).detach()
    else:
        E = _embedding_output(model, tr, tr.input_ids)
    if baseline == "zero":  # all zero, special tokens included (word embeddings: position embeddings stay)
        B = torch.zeros_like(E)
    elif baseline == "blank":
        B = _embedding_output(model, tr, None, blank=True)
    elif grad_at == "word":
        B = _embed(model, torch.tensor([_baseline_ids(model, tr.input_ids, baseline)], device=model.device)).detach()
    else:
        B = _embedding_output(model, tr, _baseline_ids(model, tr.input_ids, baseline))

    def f(x):
        return _score(model, _forward_at(model, tr, x, grad_at).logits, target, position).to(x.dtype)

    if internal_batch_size is None:
        internal_batch_size = ig_batch_size(model, len(tr.input_ids), n_steps)
    with torch.enable_grad():
        attr = IntegratedGradients(f).attribute(
            E, baselines=B, n_steps=n_steps, method="gausslegendre", internal_batch_size=internal_batch_size
        )
    return attr[0].sum(-1).abs().double().cpu().numpy()


@torch.no_grad()
def blank_out(
    model: Model, tr: Trace, target: Target, position: int, replacement: str = "unk", batch: int = 32
) -> np.ndarray:
    """Drop of p_target when each token in turn is replaced by [UNK] (or [MASK])."""
    if tr.inputs is not None:
        raise BadInput("blank-out replaces token ids; an image's patches and a clip's frames have none")
    tok = model.tokenizer
    rep = tok.unk_token_id if replacement == "unk" else getattr(tok, "mask_token_id", None)
    if replacement not in ("unk", "mask"):
        raise BadInput(f"unknown blank-out replacement {replacement!r}; choose 'unk' or 'mask'")
    if rep is None:
        raise BadInput(f"this tokenizer has no {replacement} token; choose the other replacement")
    ids = torch.tensor(tr.input_ids, device=model.device)
    n = len(ids)
    mask = torch.ones(1, n, dtype=torch.long, device=model.device)
    with _pass(model, n):
        p0 = _score(
            model, model.hf(input_ids=ids[None], attention_mask=mask, **tr.type_ids_kwargs()).logits, target, position
        )[0]
    out = []
    for s in range(0, n, batch):
        js = torch.arange(s, min(n, s + batch), device=model.device)
        X = ids.repeat(len(js), 1)
        X[torch.arange(len(js)), js] = rep
        with _pass(model, n):
            logits = model.hf(
                input_ids=X, attention_mask=mask.expand(len(js), -1), **tr.type_ids_kwargs(batch=len(js))
            ).logits
        out.append(p0 - _score(model, logits, target, position))
    return torch.cat(out).double().cpu().numpy()


def cat_scores(
    model: Model, tr: Trace, target: Target, position: int, mask_special: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer CAT and AttCAT rows (L, n): <d logit/d h^l, h^l> on layer inputs, AttCAT times the
    attention each token receives (mean over heads, then queries).

    mask_special: the AttCAT code explains with attention_mask 0 at [CLS] and [SEP] (no query
    attends to them as keys, so they get about zero AttCAT); False explains the unmasked pass.
    On an image or a clip (which take no attention mask) no position is masked: `mask_special` must be False."""
    if tr.inputs is not None:
        if mask_special:
            raise BadInput("on an image or a clip CAT and AttCAT mask no position: cat_mask_special=False")
        return _cat_of(model, tr, target, position, _input_cat_pass(model, tr))
    ids = torch.tensor([tr.input_ids], device=model.device)
    mask = torch.ones_like(ids)
    if mask_special and model.kind != "causal_lm":  # a causal LM's first token is its attention sink
        special = structural_ids(model.tokenizer) - {model.tokenizer.pad_token_id}  # [CLS]/[SEP] (BOS/EOS)
        keep = torch.tensor([[t not in special for t in tr.input_ids]], device=model.device)
        if keep.any():
            mask = keep.long()
    with torch.enable_grad():
        E = _embed(model, ids).detach().requires_grad_(True)
        with _pass(model, len(tr.input_ids), rows=every_row()):  # the attention each token receives is read
            out = _forward_embeds(model, tr, E, mask, output_hidden_states=True, output_attentions=True)
        hs = list(out.hidden_states[: model.n_layers])
    return _cat_of(model, tr, target, position, (out, hs))


def _input_cat_pass(model: Model, tr: Trace):
    """CAT's pass on an image or a clip: from its layer-0 input, which then is the first layer input."""
    X = _embedding_output(model, tr, tr.input_ids).requires_grad_(True)
    _install_layer0_hook(model)
    with torch.enable_grad(), _pass(model, tr.n, rows=every_row(), layer0_input=X):
        out = model.hf(**_input_kwargs(model, tr), output_hidden_states=True, output_attentions=True)
    return out, [X, *out.hidden_states[1 : model.n_layers]]


def _cat_of(model: Model, tr: Trace, target: Target, position: int, run) -> tuple[np.ndarray, np.ndarray]:
    """CAT and AttCAT (L, n) from a pass `run` = (its output, the layer inputs it differentiates)."""
    out, hs = run
    with torch.enable_grad():
        y = _score(model, out.logits, target, position, prob=False).sum()
        grads = torch.autograd.grad(y, hs, allow_unused=True)
    cat = torch.stack(
        [(g[0] * h[0]).sum(-1) if g is not None else torch.zeros_like(h[0, :, 0]) for g, h in zip(grads, hs)]
    ).detach()
    received = torch.stack([a[0].mean(0).mean(0) for a in out.attentions]).detach()
    return cat.double().cpu().numpy(), (cat * received).double().cpu().numpy()


SALIENCY_OPTIONS: dict[str, tuple[Any, ...]] = {
    "ig_baseline": IG_BASELINES,
    "ig_steps": (1, 10_000),
    "blank_replacement": ("unk", "mask"),
    "cat_mask_special": (True, False),
    "grad_at": GRAD_AT,
}


def check_saliency_options(options: dict, keywords: Sequence[str] = ()) -> dict:
    """The options of the gradient and perturbation methods, checked by name, type and range.
    keywords: the caller's own keyword arguments, named in the message of an unknown option."""
    for k, v in options.items():
        if k not in SALIENCY_OPTIONS:
            takes = f"{', '.join(keywords)} and " if keywords else ""
            listed = ", ".join(SALIENCY_OPTIONS)
            raise BadInput(f"unknown option {k!r}; explain takes {takes}the saliency options {listed}")
        allowed = SALIENCY_OPTIONS[k]
        if k == "ig_steps":
            lo, hi = int(allowed[0]), int(allowed[1])
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise BadInput(f"ig_steps must be a whole number from {allowed[0]} to {allowed[1]}, got {v!r}")
        elif not any(v is a or (type(v) is type(a) and v == a) for a in allowed):
            raise BadInput(f"{k} must be one of {', '.join(map(repr, allowed))}, got {v!r}")
    return options


def resolve_foil(model: Model, tr: Trace, foil, target: int, position: int) -> int | None:
    """The foil class or token (as `resolve_target` reads a target), or None; never the target itself."""
    if foil is None:
        return None
    f = resolve_target(model, tr, foil, position)
    if f == target:
        raise BadInput(f"the foil is the target ({foil!r}); a contrastive explanation needs two different outputs")
    return f


def saliency_scores(
    model: Model,
    tr: Trace,
    methods: list[str],
    target=None,
    position: int = 0,
    ig_baseline: str = "pad",
    ig_steps: int = 50,
    blank_replacement: str = "unk",
    cat_mask_special: bool = True,
    foil=None,
    grad_at: str = "word",
) -> tuple[int, dict]:
    """{method: (n,)} for the saliency methods among `methods`; returns (target, scores).
    With a foil every method explains target minus foil (`_score`); `saliency_scores.foil` is
    not returned: call `resolve_foil` for it."""
    tgt = resolve_target(model, tr, target, position)
    f = resolve_foil(model, tr, foil, tgt, position)
    scored = tgt if f is None else (tgt, f)
    out: dict[str, np.ndarray] = {}
    if {"grad", "grad_x_input"} & set(methods):
        g, E = _gradients(model, tr, scored, position, grad_at)
        if "grad" in methods:
            out["grad"] = g.norm(dim=-1).double().cpu().numpy()
        if "grad_x_input" in methods:
            out["grad_x_input"] = (g * E).norm(dim=-1).double().cpu().numpy()
    if "integrated_gradients" in methods:
        out["integrated_gradients"] = integrated_gradients(
            model, tr, scored, position, ig_baseline, ig_steps, grad_at=grad_at
        )
    if "blank_out" in methods:
        out["blank_out"] = blank_out(model, tr, scored, position, blank_replacement)
    if {"cat", "attcat"} & set(methods):
        c, a = cat_scores(model, tr, scored, position, cat_mask_special)
        out["cat"], out["attcat"] = c.sum(0), a.sum(0)
    return tgt, {m: out[m] for m in methods if m in out}
