"""`at2_exact`: AT2's learned linear estimator (Cohen-Wang, Chuang, Madry 2025) with ctxmix's exact per-head
source contributions as features in place of raw attention weights (docs/context.md, "`at2_exact`").

Features. For head (l, h), the row q_t that predicts response token t and a position j, from one traced pass
(shapes: T response rows, L layers, H query heads, n positions):

- "attention": A^{l,h}_{q_t j}, AT2's own feature ("attn" in files written before 2026-11-28; parity: uniform
  weights give the `attention` method);
- "norm": A^{l,h}_{q_t j} ||W_O^h (W_V^h n(x_j) + b_V^h)||_2, the value-weighted norm per head (grouped-query
  attention: the value of h's KV group, `ctxmix.engine.layer.head_values`);
- "logit" (default): A^{l,h}_{q_t j} <W_O^h (W_V^h n(x_j) + b_V^h), rho_t>, ctxmix's per-head `logit`
  contribution towards the same per-token target as the `logit` context method (T1 log-probability by
  default; the readout rho_t of `methods.context.onepass._readout`, sandwich layers through their post-attention norm);
  summed over heads and layers it is the `logit` method's per_token without the embedding column;
- "alti": the per-head ALTI proximity of the sub-edge alpha^h_{q_t j} f^h(x_j) into the attention node of row
  q_t, normalised per node, as information-flow routes compute it (`ctxmix.methods.routes.attention_importance`,
  p = 1, eps = 1e-5, b_V unattributed), at the response rows only.

Aggregation (AT2's): f(u, s)_{l,h} = (1/|u|) sum_{t in u} sum_{j in s} F^{l,h}(t, j): the mean over the target
unit's tokens, the sum over the source's tokens. Estimator (AT2's, linear): score(u, s) = w . f(u, s),
w in R^{L H}, no bias; untrained w = 1 / (L H). In a `ContextAttribution`, at2_exact's per_token (T, P + T) is
sum_{l,h} w_{l,h} F^{l,h}(t, j), and a span's score is the mean over its tokens of the per-source sums
(its record's span rule), so `scores_for(span)` needs no new pass.

"combined": all four kinds at once, w in R^{4 L H} (a trained combination of exact features; it has no untrained
form, and it costs F-alti's full trace). "attention+norm+logit": the three kinds one forward pass over the response rows
gives (`trace_rows`), w in R^{3 L H}: a trained combination at the cost of `logit`.

Weights: trained by `ctxmix at2-train` (`ctxmix.benchmark.context.at2_train`) for each feature kind; those for
smollm2 and gemma3 ship with the package (ctxmix/methods/context/at2_weights/). Scores are scale-free (the weights
are L1-normalised).
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from ctxmix.engine.models import Model
from ctxmix.errors import BadInput

KINDS = ("attention", "norm", "logit", "alti")  # named as the methods they weigh per head
# every kind at once: w in R^{4 L H} over the four kinds' features (kind-major), trained on the same examples
# with each kind's features divided by their RMS over the training set (the kinds' scales differ by orders of
# magnitude; the scales are folded back into the stored weights, so scoring is sum_k w_k . F_k)
COMBINED = "combined"
ONE_PASS_COMBINED = "attention+norm+logit"  # the kinds of one rows pass (no full trace), combined the same way
COMBINATIONS = {COMBINED: KINDS, ONE_PASS_COMBINED: ("attention", "norm", "logit")}
# the names the shipped files, tables and results of before 2026-11-28 use: read as the new ones (the files'
# bytes, and so the hashes that match them to their tables, stay as they are)
KIND_ALIASES = {"attn": "attention", "attn+norm+logit": "attention+norm+logit"}
ESTIMATORS = (*KINDS, *COMBINATIONS)  # what at2_features takes
# the estimators of one forward pass over the response rows (`logit`'s cost): the candidates for a default kind;
# "alti" and "combined" need a full trace, which costs as much as alti_logit
ONE_PASS_KINDS = ("attention", "norm", "logit", ONE_PASS_COMBINED)
DEFAULT_KIND = "logit"  # where a weights file has no validation table (and for uniform weights)
TRAIN_COMMAND = "ctxmix at2-train --model {model} --out DIR"
WEIGHTS_PACKAGE = "ctxmix.methods.context.at2_weights"


# ---------------------------------------------------------------- per-head features


def _attn_rows(st, Q: torch.Tensor) -> torch.Tensor:
    """(T, H, n): the attention of each explained row."""
    return st.alpha[:, Q, :].transpose(0, 1)


def _norm_rows(lw, st, Q: torch.Tensor) -> torch.Tensor:
    """(T, H, n): A^h_{q_t j} ||f^h(x_j)||, f^h the head's value vector with b_V through W_O^h."""
    from ctxmix.engine.layer import head_vectors

    src = st.x if lw.position == "post" else st.x1
    size = torch.linalg.vector_norm(head_vectors(lw, src, with_bias=True), dim=-1)  # (H, n)
    return _attn_rows(st, Q) * size.unsqueeze(0)


def _logit_rows(lw, st, Q: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """(T, H, n): head h's attention update from position j projected on row t's readout R (T, d), as
    the `logit` method forms it before its head sum (`methods.context.onepass.head_logit_rows`)."""
    from ctxmix.methods.context.onepass import head_logit_rows

    return head_logit_rows(lw, st, Q, R)


def _alti_rows(model: Model, lw, st, rows: list[int]) -> torch.Tensor:
    """(T, H, n): the routes' per-head sub-edge importance into each explained row's attention node."""
    from ctxmix.methods.routes import CHUNK_ELEMENTS, EPS, attention_importance, layer_parts

    P = layer_parts(lw, st, "unattributed", st.x.dtype)
    sub, _, _ = attention_importance(P, rows, model.spec.causal, 1, EPS, CHUNK_ELEMENTS)  # (T, n, H)
    return sub.transpose(1, 2)


def _layers(model: Model, tr, rows: list[int], targets: list[int], kinds, target: str):
    """Yields (l, {kind: (T, H, n) tensor}) for every layer, top-down (a streamed trace rebuilds each once)."""
    from ctxmix.methods.context.onepass import TARGETS, _readout

    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise BadInput(f"feature kind(s) must be among {', '.join(KINDS)}, got {list(kinds)!r}")
    if target not in TARGETS:
        raise BadInput(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    if "alti" in kinds and getattr(tr, "rows", None) is not None:
        raise ValueError("F-alti needs every row's state: a full trace (trace_ids), not trace_rows")
    dev = tr.states[-1].y.device
    Q = torch.tensor(rows, device=dev)
    Ql = tr.local(Q)  # the rows in the states (a RowsTrace holds only them)
    if "logit" in kinds:
        R, _, _ = _readout(model, tr, Q, torch.tensor(targets, device=dev), target)
    for l in reversed(range(len(model.layers))):
        st, lw = tr.states[l], model.layers[l]
        out = {}
        for k in kinds:
            if k == "attention":
                out[k] = _attn_rows(st, Ql)
            elif k == "norm":
                out[k] = _norm_rows(lw, st, Ql)
            elif k == "logit":
                out[k] = _logit_rows(lw, st, Ql, R)
            else:
                out[k] = _alti_rows(model, lw, st, rows)
        yield l, out


@torch.no_grad()
def head_features(
    model: Model, tr, rows: list[int], targets: list[int], kinds=KINDS, target: str = "log_prob"
) -> dict[str, np.ndarray]:
    """{kind: (T, L, H, n) float32}: the per-head features of the rows q_t (T,) (predicting `targets` (T,))
    from one trace."""
    T, n, L, H = len(rows), tr.n, model.n_layers, model.n_heads
    out = {k: np.zeros((T, L, H, n), dtype=np.float32) for k in kinds}
    for l, feats in _layers(model, tr, rows, targets, kinds, target):
        for k, F in feats.items():
            out[k][:, l] = F.float().cpu().numpy()
    return out


@torch.no_grad()
def weighted_features(
    model: Model, tr, rows: list[int], targets: list[int], kind: str, w: np.ndarray, target: str = "log_prob"
) -> np.ndarray:
    """(T, n) float64: sum_{l,h} w_{l,h} F^{l,h}(t, j) (for a combination, summed over its kinds too),
    accumulated one layer at a time (never (T, L, H, n))."""
    L, H = model.n_layers, model.n_heads
    kinds = estimator_kinds(kind)
    W = torch.tensor(np.asarray(w, dtype=np.float64).reshape(len(kinds), L, H))
    acc = None
    for l, feats in _layers(model, tr, rows, targets, kinds, target):
        for i, k in enumerate(kinds):
            F = feats[k].double()
            part = torch.einsum("thn,h->tn", F, W[i, l].to(F.device))
            acc = part if acc is None else acc + part
    return acc.cpu().numpy()


def canonical_kind(kind: str | None) -> str | None:
    """An estimator's name (`ESTIMATORS`), an old spelling ("attn") read as its new one; BadInput for others."""
    if kind is None:
        return None
    kind = KIND_ALIASES.get(kind, kind)
    if kind not in ESTIMATORS:
        raise BadInput(f"at2_features must be one of {', '.join(ESTIMATORS)}, got {kind!r}")
    return kind


def estimator_kinds(kind: str) -> tuple[str, ...]:
    """The feature kinds an estimator reads: a combination's (`COMBINATIONS`), else the one."""
    return COMBINATIONS.get(kind, (kind,))


def stacked_features(features: dict[str, np.ndarray], kind: str) -> np.ndarray:
    """An estimator's features from {kind: (..., L H)} arrays: the kind's own, or for a combination its kinds
    concatenated on the last axis (kind-major, as the combined weights are stored)."""
    return np.concatenate([features[k] for k in estimator_kinds(kind)], axis=-1)


def source_matrix(source_tokens: list[list[int]], n: int) -> np.ndarray:
    """(n, d) float32 indicator: position j belongs to source s."""
    S = np.zeros((n, len(source_tokens)), dtype=np.float32)
    for s, toks in enumerate(source_tokens):
        S[toks, s] = 1.0
    return S


def unit_features(F: np.ndarray, source_tokens: list[list[int]], units: list[tuple[int, int]]) -> np.ndarray:
    """AT2's aggregation: F (T, L, H, n) -> (U, d, L H) float32, the mean over each unit's rows a..b-1 of the sum
    over each source's positions."""
    T, L, H, n = F.shape
    per_row = F.reshape(T, L * H, n) @ source_matrix(source_tokens, n)  # (T, LH, d)
    return np.stack([per_row[a:b].mean(0).T for a, b in units]).astype(np.float32)


def weighted_rows(F: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(T, n) float64: sum_{l,h} w_{l,h} F^{l,h}(t, j), F (T, L, H, n), w (L H,)."""
    T, L, H, n = F.shape
    return np.einsum("tkn,k->tn", F.reshape(T, L * H, n).astype(np.float64), np.asarray(w, dtype=np.float64))


# ---------------------------------------------------------------- weights


def uniform_weights(n_layers: int, n_heads: int) -> np.ndarray:
    """AT2's initialisation: 1 / (L H) everywhere (head- and layer-averaged features)."""
    return np.full(n_layers * n_heads, 1.0 / (n_layers * n_heads))


def shipped_weights_path(model_name: str) -> Path | None:
    """The package's weights file named for an embedded model (at2_weights/<name>.npz), or None (also for a name
    that is a path): what a benchmark config naming an embedded model reads. at2_exact itself finds a model's
    shipped file by the model's fingerprint (`ctxmix.methods.context.defaults.at2_weights_file`), never its name."""
    if not model_name or Path(model_name).name != model_name or model_name in (".", ".."):
        return None
    p = resources.files(WEIGHTS_PACKAGE) / f"{model_name}.npz"
    return Path(str(p)) if p.is_file() else None


def _not_shipped_for(model) -> BadInput:
    """The refusal of a model with no shipped weights, naming the options (and, where a shipped file bears its name,
    that the file was trained on another model)."""
    named = shipped_weights_path(model.name)
    same_name = (
        f"the shipped {named.name} was trained on {named.stem} as ctxmix builds it from its packaged file, and "
        f"{model.name}'s weights are not those; "
        if named is not None
        else ""
    )
    return BadInput(
        f"at2_exact has no trained weights for {model.name}: {same_name}train them with "
        f"`{TRAIN_COMMAND.format(model=model.name)}` and pass at2={{'weights': 'DIR/at2_weights.npz'}}, "
        "or at2={'weights': 'untrained'} for uniform weights (head-averaged features; ctxmix cite: --at2-weights)"
    )


def default_kind(meta: dict, held=ESTIMATORS, table: dict | None = None) -> str:
    """A weights file's default estimator, chosen on validation: of the kinds one forward pass gives
    (`ONE_PASS_KINDS`, `logit`'s cost) that the file holds (`held`), the one whose trained weights score best
    (`kind_scores`: on `table`, the file's one-pass validation table, else on the file's own held-out table; the
    first in ONE_PASS_KINDS on a tie); DEFAULT_KIND (or the first one-pass kind held) where neither scores any."""
    lds = kind_scores(meta, table)
    cands = [k for k in ONE_PASS_KINDS if k in held]
    scored = [(lds[k], -i, k) for i, k in enumerate(cands) if k in lds]
    if scored:
        return max(scored)[2]
    return DEFAULT_KIND if DEFAULT_KIND in held or not cands else cands[0]


VALIDATION_TASKS = ("needles", "summaries", "documents", "long")  # bench/onepass_eval.py's, the benchmark's shapes


def kind_scores(meta: dict, table: dict | None = None) -> dict[str, float]:
    """{kind: the validation LDS of its trained weights}. With `table` (a one-pass validation table of the same
    file, `validation_table`): the mean over the table's tasks (VALIDATION_TASKS, those it measured) of each
    task's mean LDS, as the benchmark's headline weighs its tasks. Else the mean LDS on the file's held-out table
    (bench/at2_eval.py: needles and summaries)."""
    if table is not None:
        out = {}
        for k in ESTIMATORS:
            rows = table.get("methods") or {}
            old = next((a for a, new in KIND_ALIASES.items() if new == k), None)  # a table's rows of before
            row = rows.get(f"at2_exact/{k}") or rows.get(f"at2_exact/{old}") or {}
            per_task = [row.get(f"lds_{t}") for t in VALIDATION_TASKS]
            per_task = [float(v) for v in per_task if isinstance(v, (int, float)) and v == v]
            if per_task:
                out[k] = float(np.mean(per_task))
        return out
    rows = (meta.get("heldout") or {}).get("rows", [])
    return {
        r["features"]: float(r["lds"])
        for r in rows
        if r.get("weights") == "trained" and isinstance(r.get("lds"), (int, float))
    }


def file_sha16(path: Path) -> str:
    """The first 16 hex digits of a file's sha256 (how results and tables name the weights they used)."""
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def weights_file_sha16(model, weights=None) -> str | None:
    """The first 16 hex digits of the sha256 of the file at2_exact reads for `model` (a `Model`, or an embedded
    model's name: a benchmark config's) with `at2_weights` `weights` (None: its shipped file; a path is read as
    at2_exact reads it, from the working directory), None ("untrained", or no shipped file), or "missing:<path>":
    what a stored result computed with the weights depends on beyond its config."""
    if isinstance(weights, str) and weights == "untrained":
        return None
    if weights is not None:
        path: Path | None = Path(weights)
    elif isinstance(model, str):
        path = shipped_weights_path(model)
    else:
        from ctxmix.methods.context.defaults import at2_weights_file

        path = at2_weights_file(model)
    if path is None:
        return None
    if not path.is_file():  # not "untrained": a stored result made with the file is not current
        return f"missing:{path}"
    return file_sha16(path)


def save_weights(path, weights: dict[str, np.ndarray], n_layers: int, n_heads: int, meta: dict) -> Path:
    """weights {kind: (L H,)} into an .npz (allow_pickle=False) with "shape" (L, H) and the JSON `meta`."""
    path = Path(path)
    arrays: dict[str, np.ndarray] = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    arrays.update(shape=np.array([n_layers, n_heads]), meta=np.array(json.dumps(meta)))
    np.savez(path, **arrays)  # type: ignore[arg-type]  # numpy's stub reads ** as its allow_pickle flag
    return path


def load_weights(path) -> tuple[dict[str, np.ndarray], tuple[int, int], dict]:
    """({kind: (L H,)}, (L, H), meta) from a file written by `save_weights`."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"AT2 weights file not found: {str(p)!r}")
    with np.load(p, allow_pickle=False) as z:
        L, H = (int(x) for x in z["shape"])
        meta = json.loads(str(z["meta"])) if "meta" in z.files else {}
        for r in (meta.get("heldout") or {}).get("rows", []):  # a file written before the kinds took the methods' names
            r["features"] = KIND_ALIASES.get(r.get("features"), r.get("features"))
        ws = {KIND_ALIASES.get(k, k): z[k].astype(np.float64) for k in z.files if KIND_ALIASES.get(k, k) in ESTIMATORS}
        return ws, (L, H), meta


def resolve_weights(model: Model, kind: str | None = None, weights=None) -> tuple[np.ndarray, dict]:
    """The estimator's w (L H,) for `kind` (None: the file's default kind: for a shipped file the one its entry in
    the shipped defaults records, chosen on its validation table; for another file `default_kind` on its own
    held-out table; DEFAULT_KIND for uniform weights) and what it is: weights None (the shipped file trained on this
    model, found by the model's fingerprint; uniform 1/(L H) instead where the shipped defaults record that its
    trained weights scored below uniform ones, said in the info's "note"), a path, or "untrained" (uniform 1/(L H)).
    Raises BadInput, naming the training command, when no shipped file was trained on the model and none is given,
    and when the file's shape or kinds do not fit the model."""
    from ctxmix.methods.context.defaults import at2_file_defaults, at2_weights_file

    kind = canonical_kind(kind)
    L, H = model.n_layers, model.n_heads
    if isinstance(weights, str) and weights == "untrained":
        kind = kind or DEFAULT_KIND
        if kind in COMBINATIONS:
            raise BadInput(
                f"AT2 features {kind!r} have no untrained form (their weights mix kinds of different scales): "
                "use the shipped or your trained weights, or one kind with untrained weights"
            )
        return uniform_weights(L, H), {"weights": "untrained", "kind": kind}
    if weights is None:
        path = at2_weights_file(model)
        if path is None:
            raise _not_shipped_for(model)
        how = f"shipped:{path.name}"
    elif isinstance(weights, (str, Path)):
        path, how = Path(weights), str(weights)
    else:
        raise BadInput(f"at2_weights must be None (shipped), a file path or 'untrained', got {weights!r}")
    ws, shape, meta = load_weights(path)
    shipped = at2_file_defaults(file_sha16(path)) if path.is_file() else None
    chosen = kind is None
    if kind is None:
        kind = canonical_kind(shipped["kind"]) if shipped else default_kind(meta, ws)
    if shape != (L, H):
        raise BadInput(
            f"the AT2 weights in {str(path)!r} are for {shape[0]} layers x {shape[1]} heads; {model.name} has {L} x {H}"
        )
    if kind not in ws:
        raise BadInput(
            f"the AT2 weights in {str(path)!r} hold no {kind!r} weights (they hold {', '.join(ws)}); "
            f"train them with `{TRAIN_COMMAND.format(model=model.name)}`"
        )
    want = len(estimator_kinds(kind)) * L * H
    if len(ws[kind]) != want:
        raise BadInput(f"the {kind!r} weights in {str(path)!r} have {len(ws[kind])} values, not {want}")
    worse = (shipped or {}).get("below_uniform", {}).get(kind) if weights is None else None
    if worse:  # the default follows the shipped held-out evidence, and says so
        note = (
            f"at2_exact ({kind}): the shipped trained weights scored below uniform weights on "
            f"{shipped['heldout_texts']} (LDS {worse[0]:.3f} against {worse[1]:.3f}), so uniform weights are used; "
            f"at2={{'weights': '{path}'}} forces the trained ones"
        )
        return uniform_weights(L, H), {"weights": "untrained (auto)", "kind": kind, "note": note}
    info = {"weights": how, "kind": kind, "trained_on": meta.get("model")}
    if chosen:  # what chose the kind, for a reader of the result
        if shipped:
            info["kind_chosen_on"] = f"{shipped['kind_chosen_on']} (the shipped defaults, {shipped.get('date')})"
        elif meta.get("heldout"):
            info["kind_chosen_on"] = heldout_texts(meta)
        else:
            info["kind_chosen_on"] = "no validation table: the default"
    return ws[kind], info


def heldout_texts(meta: dict) -> str:
    """Which texts a weights file's held-out table (bench/at2_eval.py) was built on: the validation split of the
    context benchmark's data (`ctxmix.benchmark.context.data`), or, for a table that names no split, the
    needles and summaries drawn before the splits existed, which overlap the benchmark's test examples."""
    split = (meta.get("heldout") or {}).get("split")
    if split is None:
        return "held-out texts that overlap the benchmark's test examples (a table built before the splits)"
    return f"the {split} split's texts"


def _below_uniform(meta: dict, kind: str) -> tuple[float, float] | None:
    """(trained LDS, uniform LDS) for `kind` from a weights file's held-out table when trained is lower; else None
    (no table, or trained at least as good)."""
    rows = {(r.get("features"), r.get("weights")): r.get("lds") for r in (meta.get("heldout") or {}).get("rows", [])}
    t, u = rows.get((kind, "trained")), rows.get((kind, "untrained"))
    if isinstance(t, (int, float)) and isinstance(u, (int, float)) and t < u:
        return float(t), float(u)
    return None


# ---------------------------------------------------------------- the method


def run_at2(model: Model, ids: list[int], P: int, kind: str, w: np.ndarray, target: str = "log_prob") -> dict:
    """at2_exact on prompt + response ids: {"per_token" (T, n) float64 = sum_{l,h} w F^{l,h}, "terms": {},
    "target": (T,) the per-token total (a scale-free score explains no quantity), "cost"} from one traced pass."""
    from ctxmix.methods.context.onepass import _trace
    from ctxmix.methods.prediction import check_logit_model

    if "logit" in estimator_kinds(kind):
        check_logit_model(model, "logit")
    t0 = time.perf_counter()
    T = len(ids) - P
    rows = list(range(P - 1, P - 1 + T))
    # F-alti (alone or in the combination) reads every row; the others the response's
    tr = _trace(model, ids, rows, None, full="alti" in estimator_kinds(kind))
    per_token = weighted_features(model, tr, rows, list(ids[P:]), kind, w, target)
    cost = {"forward": 1, "backward": 0, "seconds": time.perf_counter() - t0, "streamed": bool(tr.streamed)}
    # no explained quantity: the per-token total of the estimator, so `buckets` add up to it
    return {"per_token": per_token, "terms": {}, "target": per_token.sum(1), "cost": cost}


def prepare(model: Model, name: str, options: dict) -> dict:
    """Before any pass: the weights (`resolve_weights` with the call's at2_features and at2_weights) and, for the
    kinds that read every row (alti, combined), a full trace's memory phase. Weights trained in another prompt form
    than the call's ("prompt_form": its answer cue and cut) read features of prompts they never saw: said in the
    info's note (a benchmark config refuses them, `prompt_form.check_at2_prompt`)."""
    w, info = resolve_weights(model, options.get("at2_features"), options.get("at2_weights"))
    form = options.get("prompt_form")
    trained = _trained_form(model, info)
    given = bool(options.get("response_given"))  # a given response is not cut: only the cue can differ
    if form is not None and trained is not None and _cue_and_cut(trained, given) != _cue_and_cut(form, given):
        info["note"] = (
            f"at2_exact: its weights were trained with the prompt form {trained} and this call asks with {form}: "
            "the estimator reads features of a prompt it was not trained on (train weights in this form, "
            "`ctxmix at2-train --prompt-from`, or ask in theirs)"
        )
    full = "alti" in estimator_kinds(info["kind"])
    return {"w": w, "info": info, **({"memory": ("full_trace",)} if full else {})}


def _trained_form(model: Model, info: dict) -> dict | None:
    """The prompt form the weights `info` describes were trained in (None: uniform weights, trained in none)."""
    how = str(info.get("weights", ""))
    if how.startswith("untrained"):
        return None
    if how.startswith("shipped:"):
        from ctxmix.methods.context.defaults import at2_weights_file

        path = at2_weights_file(model)
    else:
        path = Path(how)
    return load_weights(path)[2].get("prompt", {}) if path is not None else None


def _cue_and_cut(form: dict, response_given: bool = False) -> tuple[str, str | None]:
    return form.get("query_suffix") or "", None if response_given else form.get("stop")


def run(job, names: list[str]) -> dict:
    """The registry's run function of this module's method (`ctxmix.methods.context.job`)."""
    out = {}
    for m in names:
        p = job.prepared[m]
        res = run_at2(job.model, job.ids, job.P, p["info"]["kind"], p["w"], job.target)
        res["options"] = {"at2": p["info"]}
        res["warnings"] = [p["info"]["note"]] if p["info"].get("note") else []
        out[m] = res
    return out
