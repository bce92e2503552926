"""Results cached in memory and on disk, keyed by (model, text or corpus, method, options).

A restart does not recompute, and asking for one more method computes only that one.
Files are written atomically (temporary name, then rename), so a killed process never leaves
a half-written entry; an unreadable entry is dropped and recomputed. Formats are npz + json
and csv (no pickle), so a shared cache folder cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pandas as pd

from .explain import Explanation, explain
from .models import Model, cache_dir

_MEM: "OrderedDict[str, object]" = OrderedDict()
_MEM_MAX = 256
_LOCK = threading.Lock()


def model_fingerprint(model: Model) -> str:
    """Name, dtype, the engine's default precision and what identifies the weights (hub commit,
    or the build's metadata)."""
    c = model.hf.config
    parts = [model.name, str(model.dtype), str(getattr(c, "_commit_hash", "") or ""),
             json.dumps(model.info, sort_keys=True, default=str)]
    if getattr(model, "precision", "float32") != "float32":  # float32 keys stay as they were
        parts.append(f"precision={model.precision}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _dir(kind: str) -> Path:
    p = Path(os.environ.get("CTXMIX_RESULTS") or cache_dir() / "results") / kind
    p.mkdir(parents=True, exist_ok=True)
    return p


def _mem_get(k):
    with _LOCK:
        if k in _MEM:
            _MEM.move_to_end(k)
            return _MEM[k]
    return None


def _mem_put(k, v) -> None:
    with _LOCK:
        _MEM[k] = v
        _MEM.move_to_end(k)
        while len(_MEM) > _MEM_MAX:
            _MEM.popitem(last=False)


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _entry(ex: Explanation, m: str) -> tuple[dict, dict]:
    """What the cache keeps of one method's result: shared metadata and its arrays."""
    meta = {"tokens": ex.tokens, "input_ids": ex.input_ids, "prediction": ex.prediction, "position": ex.position,
            "target": ex.target, "model_name": ex.model_name, "reconstruction_error": ex.reconstruction_error,
            "warnings": ex.warnings}
    arrays = {"saliency": ex.saliency[m]}
    if m in ex.layer_maps:
        arrays["layer"] = ex.layer_maps[m]
        arrays["global"] = ex.global_maps[m]
    return meta, arrays


def _save_method(k: str, entry: tuple[dict, dict]) -> None:
    d = _dir("explain")
    meta, arrays = entry

    def write_npz(p):
        with open(p, "wb") as fh:
            np.savez_compressed(fh, **arrays)

    _atomic_write(d / f"{k}.npz", write_npz)
    _atomic_write(d / f"{k}.json", lambda p: p.write_text(json.dumps(meta, default=str)))


def _load_method(k: str):
    d = _dir("explain")
    try:
        meta = json.loads((d / f"{k}.json").read_text())
        with np.load(d / f"{k}.npz", allow_pickle=False) as z:
            arrays = {n: z[n] for n in z.files}
        return meta, arrays
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - a corrupt entry is recomputed
        for suffix in (".json", ".npz"):
            (d / f"{k}{suffix}").unlink(missing_ok=True)
        return None


def cached_explain(model: Model, text: str, methods: list[str], disk: bool = True, **options) -> Explanation:
    """`explain` with a per-method cache: methods already computed for this (model, text,
    options) come from memory or disk; the rest are computed together in one call."""
    from .methods import check_methods

    methods = check_methods(methods, model.spec.position)
    fp = model_fingerprint(model)
    keys = {m: key("explain", fp, text, m, options) for m in methods}
    found: dict[str, tuple[dict, dict]] = {}
    for m, k in keys.items():
        hit = _mem_get(k)
        if hit is None and disk:
            hit = _load_method(k)
            if hit is not None:
                _mem_put(k, hit)
        if hit is not None:
            found[m] = hit
    missing = [m for m in methods if m not in found]
    if missing:
        ex = explain(model, text, missing, **options)
        for m in missing:
            found[m] = _entry(ex, m)
            _mem_put(keys[m], found[m])
            if disk:
                try:
                    _save_method(keys[m], found[m])
                except OSError:
                    pass  # a read-only or full disk only costs the cache
    meta = found[methods[0]][0]
    out = Explanation(tokens=list(meta["tokens"]), input_ids=list(meta["input_ids"]), methods=methods,
                      prediction=meta["prediction"], position=meta["position"], target=meta["target"],
                      model_name=meta["model_name"], reconstruction_error=meta["reconstruction_error"],
                      warnings=list(meta["warnings"]))
    for m in methods:
        _, arrays = found[m]
        out.saliency[m] = np.asarray(arrays["saliency"])
        if "layer" in arrays:
            out.layer_maps[m] = np.asarray(arrays["layer"])
            out.global_maps[m] = np.asarray(arrays["global"])
    return out


def _frame_get(k: str, kind: str, disk: bool) -> pd.DataFrame | None:
    hit = _mem_get(k)
    if hit is not None:
        return hit.copy()
    path = _dir(kind) / f"{k}.csv"
    if disk and path.exists():
        try:
            df = pd.read_csv(path, keep_default_na=False, na_values=[""])
            _mem_put(k, df)
            return df.copy()
        except Exception:  # noqa: BLE001
            path.unlink(missing_ok=True)
    return None


def _frame_put(k: str, kind: str, df: pd.DataFrame, disk: bool) -> None:
    _mem_put(k, df)
    if disk:
        try:
            _atomic_write(_dir(kind) / f"{k}.csv", lambda p: df.to_csv(p, index=False))
        except OSError:
            pass


def cached_frame(kind: str, parts: tuple, compute, disk: bool = True) -> pd.DataFrame:
    """A DataFrame computed once per key (e.g. a corpus analysis), kept in memory and as csv."""
    k = key(kind, *parts)
    df = _frame_get(k, kind, disk)
    if df is None:
        df = compute()
        _frame_put(k, kind, df, disk)
    return df.copy()


def cached_frames(entries: dict[str, tuple], compute, disk: bool = True) -> dict[str, pd.DataFrame]:
    """Several DataFrames, each under its own key {kind: key parts}; those not cached are computed
    together by compute(missing kinds) -> {kind: DataFrame} (one corpus pass for several reports)."""
    keys = {kind: key(kind, *parts) for kind, parts in entries.items()}
    out = {kind: _frame_get(k, kind, disk) for kind, k in keys.items()}
    missing = [kind for kind, df in out.items() if df is None]
    if missing:
        new = compute(missing)
        for kind in missing:
            _frame_put(keys[kind], kind, new[kind], disk)
            out[kind] = new[kind].copy()
    return out
