"""Computing units: one example's methods and metrics (and the contextualization-change
kind), batched per (model, dataset); what a Ray task runs.

Over 500 lines because a unit's whole life stands here together (the methods a text may run, their
refusals per text, the metrics, the references): splitting it would scatter one protocol.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
import warnings
from collections import OrderedDict
from typing import Any

import numpy as np

from ctxmix.benchmark.config import _DERIVED_BASES, REFUSED
from ctxmix.errors import BadInput, CtxmixError

_MODEL_CACHE_SIZE = 2
_MODEL_CACHE: OrderedDict[tuple, Any] = OrderedDict()


def get_model(name: str, device: str = "auto", dtype: str = "float32"):
    """A model loaded once per process (the few most recently used are kept)."""
    from ctxmix.engine.models import load_model

    key = (name, device, dtype)
    if key in _MODEL_CACHE:
        _MODEL_CACHE.move_to_end(key)
        return _MODEL_CACHE[key]
    m = load_model(name, device=device, dtype=dtype)
    _MODEL_CACHE[key] = m
    while len(_MODEL_CACHE) > _MODEL_CACHE_SIZE:
        _MODEL_CACHE.popitem(last=False)
    return m


def model_revision(model) -> tuple[str, str]:
    """(revision, fingerprint): the hub commit or the embedded build's source, and ctxmix's
    fingerprint of name, dtype, commit and build metadata."""
    from ctxmix.service.cache import model_fingerprint

    c = model.hf.config
    fp = model_fingerprint(model)
    return str(getattr(c, "_commit_hash", "") or "") or f"local:{fp}", fp


def applicable_methods(model, methods: list[str], has_foil: bool) -> tuple[list[str], dict[str, str]]:
    """(methods that apply to `model`, {method: why not} for the others). "all" expands to every
    ctxmix method of the model's kind and LN position plus `random`, except attention flow on a
    causal model (a caveat of its paper; it runs where the config names it)."""
    from ctxmix.methods.prediction import applicable_prediction_methods
    from ctxmix.methods.registry import MIXING_METHODS, PREDICTION_METHODS, SALIENCY_METHODS, scope_names

    scopes = set(scope_names(model.spec.position))
    # the logit methods: causal LMs whose residual stream is not normalised between layers
    logit_ok = model.kind == "causal_lm" and model.spec.position != "post"
    if "all" in methods:
        expanded = [m for m, info in MIXING_METHODS.items() if info.group != "scope" or m in scopes]
        if model.kind != "encoder":
            expanded += list(SALIENCY_METHODS)
        # decompx where its head has a rule (or a model without a head: the norms of its parts),
        # attention flow on encoders (its paper defines it there and warns that on causal models it
        # favours early tokens, P-AF6: named explicitly, it still runs), the logit methods on causal LMs
        flow = [] if model.spec.causal else ["attention_flow"]
        expanded += [m for m in ["decompx", *flow] if m in applicable_prediction_methods(model)]
        if logit_ok:
            expanded += ["logit", "alti_logit"]
        expanded += ["random"]
        methods = list(dict.fromkeys([m for m in methods if m != "all"] + expanded))
    ok, na = [], {}
    for m in methods:
        info = MIXING_METHODS.get(m)
        if info is not None and info.group == "scope" and m not in scopes:
            na[m] = f"not a scope of a {model.spec.position}-LN model (its scopes: {', '.join(sorted(scopes))})"
        elif m in ("logit", "alti_logit") and not logit_ok:
            na[m] = "needs a causal language model with pre-LN, parallel or sandwich layers"
        elif m in PREDICTION_METHODS and m not in applicable_prediction_methods(model):
            na[m] = "does not apply to an encoder-decoder"
        elif (m in SALIENCY_METHODS or m == "blank_out_foil") and model.kind == "encoder":
            na[m] = "needs a model with a head (classifier or language model)"
        elif m == "blank_out_foil" and (not has_foil or model.kind == "classifier"):
            na[m] = "needs agreement data (target and foil) and a language model"
        else:
            ok.append(m)
    return ok, na


def _encode_example(model, ex: dict, options: dict) -> dict:
    """{ids, position, cues, target, foil, why (reason skipped or None), types, segments}. A pair
    is tokenised as the tokenizer pairs it; its token_type_ids reach every forward pass unless
    the config says `token_type_ids: false` (the AttCAT code runs its pairs without them)."""
    from ctxmix.methods.explain import default_position

    out = {
        "ids": None,
        "position": None,
        "cues": None,
        "target": None,
        "foil": None,
        "why": None,
        "types": None,
        "segments": None,
    }
    if ex.get("item"):
        from ctxmix.benchmark.agreement import AgreementItem

        it = AgreementItem.from_dict(ex["item"])
        enc = it.encode(model.tokenizer, causal=model.spec.causal, max_length=model.max_length)
        if isinstance(enc, str):
            return {**out, "why": enc}
        lm = model.kind in ("masked_lm", "causal_lm")
        return {
            **out,
            "ids": enc.input_ids,
            "position": enc.position,
            "cues": enc.cues or None,
            "target": enc.target_id if lm else None,
            "foil": enc.foil_id if lm else None,
        }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = model.encode_input((ex["text"], ex["text_pair"]) if ex.get("text_pair") else ex["text"])
    types = e.token_type_ids
    if types is not None and not options.get("token_type_ids", True):
        types = [0] * len(e.ids)  # all one type, as a model called without them reads them
    return {**out, "ids": e.ids, "position": default_position(model, e.ids), "types": types, "segments": e.segments}


def _logits(model, ids: list[int], types: list[int] | None = None):
    import torch

    from ctxmix.engine.attention import output_only

    with torch.no_grad(), output_only(model):
        x = torch.tensor([ids], device=model.device)
        return (
            model.hf(input_ids=x, attention_mask=torch.ones_like(x), **model.type_ids_kwargs([types]))
            .logits[0]
            .double()
        )


def _resolve_target(
    model, ids, position, ex: dict, target_mode: str, lm_target: int | None, types: list[int] | None = None
) -> tuple[int, str]:
    if model.kind == "classifier":
        if target_mode == "gold" and ex.get("label") is not None:
            return int(ex["label"]), "gold"
        note = "predicted" if target_mode == "predicted" else "predicted (no gold label)"
        return int(_logits(model, ids, types).reshape(-1).argmax()), note
    if lm_target is not None:
        return int(lm_target), "gold"
    return int(_logits(model, ids, types)[position].argmax()), "predicted"


def _gold_label(model, ex: dict, target: int | None, target_note: str) -> int | None:
    """The class (or token) the accuracy metrics compare against: a classifier's gold label, a
    language model's data-given target; None where the data gives none."""
    if model.kind == "classifier":
        return None if ex.get("label") is None else int(ex["label"])
    return target if target_note == "gold" else None


def _example_seed(seed: int, *parts) -> int:
    return int(hashlib.sha256(json.dumps([seed, *parts]).encode()).hexdigest()[:12], 16)


def _derived(
    name: str,
    ex_obj,
    position: int,
    n: int,
    seed_key: int,
    model=None,
    ids=None,
    target=None,
    foil=None,
    batch_size: int = 32,
    keep_self: bool = False,
):
    """(saliency, layer maps or None) of a derived method. keep_self: raw_attention keeps the
    explained token's attention to itself (the ALTI repository's baseline) instead of zeroing it."""
    from ctxmix.methods.mixing import rollout

    if name == "random":
        return np.random.default_rng(seed_key).random(n), None
    if name == "raw_attention":
        A = ex_obj.layer_maps["attention"]
        s = A[-1][position].copy()
        if not keep_self:
            s[position] = 0.0
        return s, A
    if name in ("norm_rollout", "norm_fixed_res"):
        base = ex_obj.layer_maps["norm_res_ln" if name == "norm_rollout" else "norm"]
        M = base / np.clip(base.sum(-1, keepdims=True), np.finfo(float).tiny, None)
        if name == "norm_fixed_res":
            M = 0.5 * M + 0.5 * np.eye(n)
        return rollout(M)[-1][position].copy(), M
    if name == "blank_out_foil":
        from ctxmix.benchmark.metrics import TargetProbability

        unk = model.tokenizer.unk_token_id
        if unk is None:
            raise BadInput("blank_out_foil needs an [UNK] token")
        predict = TargetProbability(model, target, foil=foil, batch_size=batch_size)
        seqs = [list(ids)] + [[unk if j == i else t for j, t in enumerate(ids)] for i in range(n)]
        p = predict(seqs, [position] * len(seqs))
        return p[0] - p[1:], None
    raise BadInput(f"unknown derived method {name!r}")


def compute_example(task: dict) -> dict:
    """Compute the units of one example (see `compute_batch`)."""
    return compute_batch([task])[0]


def compute_batch(tasks: list[dict]) -> list[dict | None]:
    """Compute the units of a batch of examples of one (model, dataset). Each task: model (label,
    name, device, dtype), dataset, example (Example as dict), methods (to compute; none for an
    example that only fills its batch), references {ref: saliency list} already stored, metrics,
    target, explain options, options, seed. The examples are traced in one padded forward pass and
    their mixing maps decomposed together; the rest runs per example. Batch membership is fixed by
    example index (`plan_groups`), so a resumed run recomputes whole batches and gets results
    bit-identical to an uninterrupted run. Returns one result per task (None for the fillers),
    plain data (picklable)."""
    t0 = time.time()
    ms = tasks[0]["model"]
    model = get_model(ms["name"], ms.get("device", "auto"), ms.get("dtype", "float32"))
    rev, fp = model_revision(model)
    base = {
        "model_revision": rev,
        "fingerprint": fp,
        "pid": os.getpid(),
        "device": str(model.device),
        "methods": {},
        "references": {},
    }
    if tasks[0].get("kind") == "contextualization_change":
        return [None if r is None else {**base, **r} for r in _compute_change_batch(model, tasks)]
    preps = [_prepare_example(model, t) for t in tasks]
    members = [k for k, p in enumerate(preps) if p.get("ids") is not None]
    opts = dict(tasks[0].get("explain") or {})
    for k in members:  # a method this text is too long for is refused for it alone, before any work
        _refuse_by_length(model, preps[k], opts)
    exos: dict[int, Any] = {}
    if members and any(preps[k]["explain_methods"] for k in members):
        from ctxmix.methods.explain import explain_batch

        union = list(dict.fromkeys(m for k in members for m in preps[k]["explain_methods"]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = explain_batch(
                model,
                [preps[k]["ids"] for k in members],
                union,
                targets=[preps[k].get("target") for k in members],
                positions=[preps[k]["position"] for k in members],
                token_type_ids=[preps[k].get("types") for k in members],
                segments=[preps[k].get("segments") for k in members],
                methods_per_text=[preps[k]["explain_methods"] for k in members],
                foils=[preps[k].get("foil") for k in members]
                if tasks[0].get("options", {}).get("contrastive")
                else None,
                **opts,
            )
        exos = dict(zip(members, got))
    out: list[dict | None] = []
    for k, (task, prep) in enumerate(zip(tasks, preps)):
        if not task["methods"]:
            out.append(None)
        elif "result" in prep:
            out.append({**base, **prep["result"], "seconds": time.time() - t0})
        else:
            out.append({**base, **_finish_example(model, task, prep, exos.get(k)), "seconds": time.time() - t0})
    return out


# methods whose refusal for a text's length does not depend on the machine's state at the time
STABLE_REFUSALS = frozenset({"attention_flow"})


def _refuse_by_length(model, prep: dict, explain_opts: dict) -> None:
    """Take out of `prep`'s explain methods those its length rules out (attention flow's time,
    DecompX's memory: `ctxmix.methods.explain.method_refusals`), kept in prep["refused"] {method: why};
    `_finish_example` records them, and the methods derived from them, as refused units."""
    from ctxmix.methods.explain import method_refusals

    keys = ("embedding", "flow_rows", "decompx")  # the options those checks read
    refused = method_refusals(
        model, len(prep["ids"]), prep["explain_methods"], **{k: explain_opts[k] for k in keys if k in explain_opts}
    )
    prep["refused"] = refused
    prep["explain_methods"] = [m for m in prep["explain_methods"] if m not in refused]


def _blocked(compute: list[str], refused: dict[str, str]) -> dict[str, str]:
    """{method: why} for the methods of `compute` refused for this text, or derived from one that is."""
    out = {}
    for m in compute:
        if m in refused:
            out[m] = refused[m]
        else:
            base = next((b for b in _DERIVED_BASES.get(m, []) if b in refused), None)
            if base is not None:
                out[m] = f"derived from {base}, refused: {refused[base]}"
    return out


def _prepare_example(model, task: dict) -> dict:
    """Encode one example and decide what it needs: {"ids": None, "result": skipped} or ids,
    position, target, the methods explain must compute and the rest `_finish_example` needs."""
    ex = task["example"]
    enc = _encode_example(model, ex, task["options"])
    ids, position, cues, lm_target, foil, why = (enc[k] for k in ("ids", "position", "cues", "target", "foil", "why"))
    types, segments = enc["types"], enc["segments"]
    if why is None and len(ids) < task["options"].get("min_tokens", 0):
        why = f"fewer than {task['options']['min_tokens']} tokens"
    if why is not None:
        return {"ids": None, "result": {"status": "skipped", "reason": why}}
    if not task["methods"]:  # fills its batch only
        return {"ids": ids, "position": position, "explain_methods": [], "types": types, "segments": segments}
    from ctxmix import METHODS
    from ctxmix.benchmark.metrics import get_metric

    ok, na = applicable_methods(model, task["methods"], has_foil=foil is not None)
    metrics = [get_metric(m) for m in task["metrics"]]
    refs_needed = {m.reference for m in metrics if m.reference}
    have = {k: np.asarray(v) for k, v in (task.get("references") or {}).items()}
    ref_ok, ref_na = applicable_methods(model, sorted(refs_needed - set(have)), has_foil=foil is not None)
    compute = list(dict.fromkeys(ok + [r for r in ref_ok if r not in ok]))
    has_head = model.kind != "encoder"
    target, target_note = (
        (None, "none (no head)")
        if not has_head
        else _resolve_target(model, ids, position, ex, task["target"], lm_target, types)
    )
    explain_methods = [m for m in compute if m in METHODS]
    for m in compute:
        explain_methods += [b for b in _DERIVED_BASES.get(m, []) if b not in explain_methods]
    return {
        "ids": ids,
        "position": position,
        "cues": cues,
        "foil": foil,
        "ok": ok,
        "na": na,
        "metrics": metrics,
        "refs_needed": refs_needed,
        "have": have,
        "ref_na": ref_na,
        "compute": compute,
        "has_head": has_head,
        "target": target,
        "target_note": target_note,
        "explain_methods": explain_methods,
        "types": types,
        "segments": segments,
    }


def _finish_example(model, task: dict, p: dict, exo) -> dict:
    """Saliency of the derived methods, the metrics and the result record of one example."""
    from ctxmix import METHODS
    from ctxmix.benchmark.metrics import (
        CUE_METRICS,
        DELETION_METRICS,
        TargetProbability,
        cue_alignment,
        cue_alignment_layers,
        deletion_metrics,
        pad_token_id,
        protected_positions,
        reference_spearman,
    )

    ex = task["example"]
    blocked = _blocked(p["compute"], p.get("refused") or {})
    ids, position, target, foil = p["ids"], p["position"], p["target"], p["foil"]
    ok = [m for m in p["ok"] if m not in blocked]
    n = len(ids)
    saliency: dict[str, np.ndarray] = {}
    layer_maps: dict[str, np.ndarray] = {}
    for m in p["compute"]:
        if m in blocked:
            continue
        if m in METHODS:
            saliency[m] = np.asarray(exo.saliency[m], dtype=np.float64)
            if m in exo.layer_maps:
                layer_maps[m] = exo.layer_maps[m]
        else:
            s, L = _derived(
                m,
                exo,
                position,
                n,
                _example_seed(task["seed"], task["dataset"], ex["id"], m),
                model=model,
                ids=ids,
                target=target,
                foil=foil,
                batch_size=task["options"].get("batch_size", 32),
                keep_self=task["options"].get("raw_attention_keep_self", False),
            )
            saliency[m] = np.asarray(s, dtype=np.float64)
            if L is not None:
                layer_maps[m] = L
    refs = {**p["have"], **{r: saliency[r] for r in p["refs_needed"] if r in saliency}}
    scores: dict[str, list] = {m: [] for m in ok}
    metrics = p["metrics"]
    del_metrics = [x.name for x in metrics if x.name in DELETION_METRICS]
    if del_metrics and p["has_head"] and ok:
        predict = TargetProbability(model, target, batch_size=task["options"].get("batch_size", 32))
        dm, p0 = deletion_metrics(
            predict,
            ids,
            {m: saliency[m] for m in ok},
            del_metrics,
            protected=protected_positions(model, ids, position),
            position=position,
            pad_id=pad_token_id(model.tokenizer),
            token_type_ids=p.get("types"),
            abs_saliency=task["options"].get("abs_saliency", False),
            stop_one_short=task["options"].get("deletion_stop_one_short", False),
            mask_id=model.tokenizer.mask_token_id,
            gold=_gold_label(model, ex, target, p["target_note"]),
        )
        for m, vals in dm.items():
            scores[m] += [(k, -1, v) for k, v in vals.items()]
    cue_metrics = [x.name for x in metrics if x.name in CUE_METRICS]
    cues = p["cues"]
    for m in ok:
        for met in metrics:
            if met.family == "reference" and met.reference != m and met.reference in refs:
                scores[m].append((met.name, -1, reference_spearman(saliency[m], refs[met.reference], met, position)))
        if cue_metrics and cues:
            for k, v in cue_alignment(saliency[m], cues, cue_metrics).items():
                scores[m].append((k, -1, v))
            if m in layer_maps:
                for k, arr in cue_alignment_layers(layer_maps[m], position, cues, cue_metrics).items():
                    scores[m] += [(k, l + 1, float(v)) for l, v in enumerate(arr)]
    out = {
        "status": "ok",
        "tokens": model.tokens(ids),
        "position": position,
        "target": target,
        "target_note": p["target_note"],
        "n_tokens": n,
        "methods": {},
    }
    for m in ok:
        out["methods"][m] = {"status": "done", "saliency": saliency[m].tolist(), "scores": scores[m]}
    for m, why in p["na"].items():
        out["methods"][m] = {"status": "na", "detail": why}
    refused = p.get("refused") or {}
    for m in p["ok"]:
        if m in blocked:
            # attention flow's refusal follows a fixed cost model of the length: deterministic, not
            # retried (store.finished_units); DecompX's memory check reads the memory free now and the
            # jobs running beside it, so its refusal is an error that a later run retries
            base = m if m in refused else next(b for b in _DERIVED_BASES.get(m, []) if b in refused)
            status = REFUSED if base in STABLE_REFUSALS else "error"
            out["methods"][m] = {"status": status, "detail": blocked[m]}
    out["references"] = {
        r: saliency[r].tolist() for r in p["refs_needed"] if r in saliency and r not in ok and r not in p["have"]
    }
    out["reference_na"] = {**p["ref_na"], **{r: blocked[r] for r in p["refs_needed"] if r in blocked}}
    return out


def _compute_change_batch(model, tasks: list[dict]) -> list[dict | None]:
    """FF paper §5.1 on a batch of texts: per comparison and layer, 1 - rho of the two scope maps
    (scope maps and ranks of the whole batch on the device, one transfer per batch)."""
    import torch

    from ctxmix.analyses.corpus import comparisons, mask_tokens
    from ctxmix.analyses.ranks import spearman
    from ctxmix.engine.trace import trace_batch_tensors
    from ctxmix.methods.mixing import scope_maps_batch

    comps = comparisons(model)
    out: list[dict | None] = [None] * len(tasks)
    members, batch, types = [], [], []
    for k, task in enumerate(tasks):
        ex = task["example"]
        enc = _encode_example(model, ex, task["options"])
        ids, why = enc["ids"], enc["why"]
        if why is None and len(ids) < task["options"].get("min_tokens", 0):
            why = f"fewer than {task['options']['min_tokens']} tokens"
        if why is not None:
            if task["methods"]:
                out[k] = {"status": "skipped", "reason": why}
            continue
        rate = task["options"].get("mask_rate", 0.0)
        if rate and model.kind == "masked_lm":
            ids = mask_tokens(model, ids, rate, random.Random(_example_seed(task["seed"], task["dataset"], ex["id"])))
        members.append(k)
        batch.append(ids)
        types.append(enc["types"])
    if not members:
        return out
    lower = bool(tasks[0]["options"].get("lower_triangle"))
    with torch.no_grad():
        tb = trace_batch_tensors(model, batch, token_type_ids=types)
        maps = scope_maps_batch(tb, next_ln=model.spec.position != "post")
        mask = tb.mask
        valid = mask[:, :, None] & mask[:, None, :]
        if lower:
            valid = valid & torch.ones_like(valid[0]).tril()
        valid = valid.flatten(1)[:, None]  # (B, 1, n*n)
        names = [c for c, (a, b) in comps.items() if a in maps and b in maps]
        change = (
            torch.stack(
                [1.0 - spearman(maps[comps[c][0]].flatten(2), maps[comps[c][1]].flatten(2), valid) for c in names], -1
            )
            .cpu()
            .numpy()
        )  # (B, L, K): one transfer per batch
    for b, k in enumerate(members):
        task = tasks[k]
        if not task["methods"]:
            continue
        wanted = list(comps) if "all" in task["methods"] else task["methods"]
        r = {
            "status": "ok",
            "tokens": model.tokens(batch[b]),
            "position": None,
            "target": None,
            "target_note": "",
            "n_tokens": len(batch[b]),
            "methods": {},
            "references": {},
            "reference_na": {},
        }
        for c in wanted:
            if c not in names:
                r["methods"][c] = {
                    "status": "na",
                    "detail": f"no comparison {c!r} for a {model.spec.position}-LN model",
                }
                continue
            vals = [float(v) for v in change[b, :, names.index(c)]]
            sc = [("change", l + 1, v) for l, v in enumerate(vals)]
            finite = [v for v in vals if np.isfinite(v)]
            sc.append(("change", -1, float(np.mean(finite)) if finite else float("nan")))
            r["methods"][c] = {"status": "done", "saliency": None, "scores": sc}
        out[k] = r
    return out


def _ray_task(tasks: list[dict], cpus: int = 1) -> list[dict | None]:
    """A Ray worker's batch: torch runs `cpus` threads, its share of the CPUs (`ray_task_options`), on
    the device the executor put in the tasks. Each result also says the resources Ray gave the task."""
    import ray
    import torch

    torch.set_num_threads(max(1, int(cpus)))
    try:
        results = compute_batch(tasks)
    except (CtxmixError, RuntimeError) as e:
        results = [
            None if not t["methods"] else {"status": "error", "reason": f"{type(e).__name__}: {e}", "methods": {}}
            for t in tasks
        ]
    worker = {"threads": torch.get_num_threads(), "resources": ray.get_runtime_context().get_assigned_resources()}
    return [None if r is None else {**r, "worker": worker} for r in results]
