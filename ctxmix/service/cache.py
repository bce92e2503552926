"""Results cached in memory and on disk, keyed by (model, text or corpus, method, options), and for
explanations also by ctxmix's version and a fingerprint of its computing code (`explain_key`).

A restart does not recompute, and asking for one more method computes only that one.
Files are written atomically (temporary name, then rename), so a killed process never leaves
a half-written entry; every entry's metadata records the SHA-256 of its data file, and an entry
that does not match (truncated, edited, half-copied) is dropped and recomputed. Formats are
npz + json and csv + json (no pickle), so a shared cache folder cannot run code.

Both caches are bounded: the in-memory one by bytes (CTXMIX_MEMCACHE_MB, default 256), the
folder by CTXMIX_CACHE_MAX_MB (default 1024), least recently used entries removed first.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pandas as pd

from ctxmix.engine.models import Model, cache_dir
from ctxmix.methods.explain import GRADIENT_ON_INPUTS, explain
from ctxmix.methods.explanation import KIND_FIELDS, Explanation, provenance
from ctxmix.methods.saliency import SALIENCY_OPTIONS

_MEM: OrderedDict[str, tuple[object, int]] = OrderedDict()  # key -> (value, bytes)
_MEM_BYTES = 0
_LOCK = threading.Lock()
_DISK_LOCK = threading.Lock()


def _env_mb(name: str, default: float) -> int:
    try:
        v = float(os.environ.get(name, default))
    except ValueError:
        v = default
    return int(max(0.0, v) * 2**20)


def mem_limit_bytes() -> int:
    return _env_mb("CTXMIX_MEMCACHE_MB", 256)


def disk_limit_bytes() -> int:
    return _env_mb("CTXMIX_CACHE_MAX_MB", 1024)


def _size_of(v) -> int:
    """Bytes an entry holds: its arrays and metadata, or a DataFrame's memory."""
    if isinstance(v, pd.DataFrame):
        return int(v.memory_usage(deep=True).sum())
    if isinstance(v, tuple):
        meta, arrays = v
        return sum(int(np.asarray(a).nbytes) for a in arrays.values()) + len(json.dumps(meta, default=str))
    return 1024


def model_fingerprint(model: Model) -> str:
    """Name, dtype, the engine's default precision, the hub commit and build metadata, and the
    SHA-256 of the weights themselves (`ctxmix.engine.fingerprint.weights_sha256`), so a local folder whose
    weights change never gets the old folder's cached maps."""
    from ctxmix.engine.fingerprint import weights_sha256

    c = model.hf.config
    info = {k: v for k, v in model.info.items() if k != "weights"}  # file times are not identity
    parts = [
        model.name,
        str(model.dtype),
        str(getattr(c, "_commit_hash", "") or ""),
        json.dumps(info, sort_keys=True, default=str),
        weights_sha256(model),
    ]
    if getattr(model, "precision", "float32") != "float32":  # float32 keys stay as they were
        parts.append(f"precision={model.precision}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


# what a method's result is computed by: the engine (trace, layer maths) and the methods (their code,
# their options and the checks of those options); any change there changes the fingerprint
_CODE_PACKAGES = ("engine", "methods")


@functools.cache
def code_fingerprint() -> str:
    """SHA-256 (16 hex digits) of the source of every module of ctxmix.engine and ctxmix.methods,
    read once per process. A method's numbers can depend on any of them (the trace, the shared
    decompositions, its options' schema in `explain`), so a cached result is keyed by all of them:
    an edited checkout or an upgrade misses, even where the version string did not move."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for pkg in _CODE_PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode() + b"\0")
            h.update(f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def explain_key(fp: str, text, method: str, options: dict) -> str:
    """The cache key of one method's result: the model's fingerprint, the text, the method, the
    options, ctxmix's version and `code_fingerprint` (so neither an upgrade nor a code change is
    served numbers computed by other code)."""
    from ctxmix import __version__

    return key("explain", fp, text, method, options, __version__, code_fingerprint())


def _root() -> Path:
    return Path(os.environ.get("CTXMIX_RESULTS") or cache_dir() / "results")


def _dir(kind: str) -> Path:
    p = _root() / kind
    p.mkdir(parents=True, exist_ok=True)
    return p


def _mem_get(k):
    with _LOCK:
        if k in _MEM:
            _MEM.move_to_end(k)
            return _MEM[k][0]
    return None


def _mem_put(k, v) -> None:
    global _MEM_BYTES
    size = _size_of(v)
    with _LOCK:
        if k in _MEM:
            _MEM_BYTES -= _MEM.pop(k)[1]
        if size > mem_limit_bytes():
            return  # larger than the whole budget: kept on disk only
        _MEM[k] = (v, size)
        _MEM_BYTES += size
        while _MEM_BYTES > mem_limit_bytes() and _MEM:
            _MEM_BYTES -= _MEM.popitem(last=False)[1][1]


def mem_clear() -> None:
    global _MEM_BYTES
    with _LOCK:
        _MEM.clear()
        _MEM_BYTES = 0


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def _touch(*paths: Path) -> None:
    """Mark an entry as used now (its files' mtime): the folder is trimmed by it."""
    for p in paths:
        try:
            os.utime(p)
        except OSError:
            pass


def trim_disk(limit: int | None = None) -> int:
    """Remove least recently used entries (all files of one key together) until the results
    folder fits `limit` bytes (CTXMIX_CACHE_MAX_MB). Returns the bytes removed."""
    limit = disk_limit_bytes() if limit is None else limit
    root = _root()
    if not root.is_dir():
        return 0
    with _DISK_LOCK:
        entries: dict[Path, list] = {}  # (folder / key) -> [last use, bytes, files]
        for f in root.glob("*/*"):
            if not f.is_file() or f.name.startswith("."):
                continue
            try:
                st = f.stat()
            except OSError:
                continue
            e = entries.setdefault(f.parent / f.name.split(".")[0], [0.0, 0, []])
            e[0] = max(e[0], st.st_mtime)
            e[1] += st.st_size
            e[2].append(f)
        total = sum(e[1] for e in entries.values())
        removed = 0
        for _, (_, size, files) in sorted(entries.items(), key=lambda kv: kv[1][0]):
            if total - removed <= limit:
                break
            for f in files:
                f.unlink(missing_ok=True)
            removed += size
        return removed


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# the options explain records for some methods only ({option: the methods that record it})
METHOD_OPTIONS: dict[str, tuple[str, ...]] = {
    "flow_rows": ("attention_flow",),
    "decompx": ("decompx",),
    "embedding": ("logit", "alti_logit"),
    "target_kind": ("logit", "alti_logit"),
}


def _method_warnings(ex: Explanation, m: str) -> list[str]:
    """ex's warnings that concern method m: all but the other methods' own and the call's option notes."""
    from ctxmix.methods.explain import call_notes

    others = {w for k, ws in ex.method_warnings.items() if k != m for w in ws}
    # per_head's note whichever the call; target_kind's as the call gave it
    call = set(call_notes(ex.methods, True, ex.options.get("foil"), ex.options.get("target_kind", "logit")))
    own = set(ex.method_warnings.get(m, []))
    return [w for w in ex.warnings if w in own or (w not in others and w not in call)]


def _entry(ex: Explanation, m: str) -> tuple[dict, dict]:
    """What the cache keeps of one method's result: shared metadata and its arrays."""
    meta = {
        "tokens": ex.tokens,
        "input_ids": ex.input_ids,
        "prediction": ex.prediction,
        "position": ex.position,
        "target": ex.target,
        "foil": ex.foil,
        "model_name": ex.model_name,
        "reconstruction_error": ex.reconstruction_error,
        # this method's warnings: the trace's notes and its own (a soft-cap note, attention flow's
        # caveat), not another method's of the same call nor the call's option notes (`call_notes`,
        # made anew on a read); and its options: the call's, less what another method recorded
        "warnings": _method_warnings(ex, m),
        "options": {k: v for k, v in ex.options.items() if k not in METHOD_OPTIONS or m in METHOD_OPTIONS[k]},
        "segments": ex.segments,
    }
    if m in ex.logit_terms:
        meta["logit_terms"] = ex.logit_terms[m]
    arrays = {"saliency": ex.saliency[m]}
    # every array kind an Explanation holds for a method (a prediction method may have global maps only)
    for name, field in KIND_FIELDS.items():
        if name != "saliency" and m in getattr(ex, field):
            arrays[name] = getattr(ex, field)[m]
    return meta, arrays


def _save_method(k: str, entry: tuple[dict, dict]) -> None:
    d = _dir("explain")
    meta, arrays = entry

    def write_npz(p):
        with open(p, "wb") as fh:
            np.savez_compressed(fh, **arrays)

    _atomic_write(d / f"{k}.npz", write_npz)
    meta = {**meta, "_sha256": _sha256(d / f"{k}.npz")}  # written after the data: a json names a whole npz
    _atomic_write(d / f"{k}.json", lambda p: p.write_text(json.dumps(meta, default=str)))
    trim_disk()


def _load_method(k: str):
    d = _dir("explain")
    try:
        meta = json.loads((d / f"{k}.json").read_text())
        if meta.pop("_sha256", None) != _sha256(d / f"{k}.npz"):
            raise ValueError("checksum mismatch")
        with np.load(d / f"{k}.npz", allow_pickle=False) as z:
            arrays = {n: z[n] for n in z.files}
        _touch(d / f"{k}.json", d / f"{k}.npz")
        return meta, arrays
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - a corrupt, truncated or unverified entry is recomputed
        for suffix in (".json", ".npz"):
            (d / f"{k}{suffix}").unlink(missing_ok=True)
        return None


def _typed_input(model: Model, options: dict) -> tuple[dict, dict]:
    """(explain's options, the options a key reads): an `image=` or `audio=` (a path, an array, bytes) is read once
    into its `ImageInput` / `AudioInput`, which the call takes, and keyed by its fingerprint (the sha256 of what
    the model reads, after the processor: the same photo as a file or an array is one entry)."""
    from ctxmix.engine.inputs import audio_input, image_input

    if options.get("image") is not None:
        inp = image_input(model, options["image"])
        return {**options, "image": inp}, {**options, "image": inp.fingerprint()}
    if options.get("audio") is not None:
        inp = audio_input(model, options["audio"], options.get("sampling_rate"))
        call = {k: v for k, v in options.items() if k != "sampling_rate"}
        return {**call, "audio": inp}, {**call, "audio": inp.fingerprint()}
    return options, options


def cached_explain(model: Model, text, methods: list[str], disk: bool = True, **options) -> Explanation:
    """`explain` with a per-method cache: methods already computed for this (model, text,
    options) come from memory or disk; the rest are computed together in one call. An image or a clip
    (`image=`, `audio=`) is keyed by what the model reads of it (`ImageInput.fingerprint`)."""
    from ctxmix.methods.explain import call_notes
    from ctxmix.methods.registry import check_methods

    methods = check_methods(methods, model.spec.position)
    fp = model_fingerprint(model)
    options, keyed = _typed_input(model, options)
    keys = {m: explain_key(fp, text, m, keyed) for m in methods}
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
        # DecompX's options go with DecompX: explain refuses them for a call without it; so are the gradient
        # options on an image or a clip when only mixing methods are left to compute
        call = options if "decompx" in missing else {k: v for k, v in options.items() if k != "decompx"}
        if keyed is not options and not set(missing) & set(GRADIENT_ON_INPUTS):
            call = {k: v for k, v in call.items() if k not in ("target", "foil", *SALIENCY_OPTIONS)}
        ex = explain(model, text, missing, **call)
        for m in missing:
            found[m] = _entry(ex, m)
            _mem_put(keys[m], found[m])
            if disk:
                try:
                    _save_method(keys[m], found[m])
                except OSError:
                    pass  # a read-only or full disk only costs the cache
    meta = found[methods[0]][0]
    # the target and foil come from an entry that explained one (a mixing method's entry has none)
    tmeta = next((found[m][0] for m in methods if found[m][0].get("target") is not None), meta)
    # a prediction method's entry also says which logit it explained
    pmeta = next((found[m][0] for m in methods if (found[m][0].get("prediction") or {}).get("explained")), meta)
    out = Explanation(
        tokens=list(meta["tokens"]),
        input_ids=list(meta["input_ids"]),
        methods=methods,
        prediction=pmeta["prediction"],
        position=meta["position"],
        target=tmeta["target"],
        foil=tmeta.get("foil"),
        segments=meta.get("segments"),
        model_name=meta["model_name"],
        # the largest over the entries: a gradient method's entry rebuilt no layer and says 0
        reconstruction_error=max(float(found[m][0]["reconstruction_error"]) for m in methods),
        # every method's warnings (a soft-cap note stays when a mixing method was cached first), each
        # once, and the notes of this call's options
        warnings=list(
            dict.fromkeys(
                [w for m in methods for w in found[m][0]["warnings"]]
                + call_notes(
                    methods, bool(options.get("per_head")), options.get("foil"), options.get("target_kind", "logit")
                )
            )
        ),
        # the options the call gave (an image or clip as explain records it), and every option explain recorded for
        # each method
        options=copy.deepcopy(
            {
                **{k: v for k, v in keyed.items() if k not in ("image", "audio", "sampling_rate")},
                **{k: v for m in methods for k, v in found[m][0].get("options", {}).items()},
            }
        ),
        provenance=provenance(model),
        inputs=options.get("image", options.get("audio")),  # the ImageInput / AudioInput read: show's picture
    )
    for m in methods:
        m_meta, arrays = found[m]
        out.saliency[m] = np.asarray(arrays["saliency"])
        for name, field in KIND_FIELDS.items():
            if name != "saliency" and name in arrays:
                getattr(out, field)[m] = np.asarray(arrays[name])
        if "logit_terms" in m_meta:
            out.logit_terms[m] = m_meta["logit_terms"]
    return out


def _frame_get(k: str, kind: str, disk: bool) -> pd.DataFrame | None:
    hit = _mem_get(k)
    if hit is not None:
        return hit.copy()
    path, meta_path = _dir(kind) / f"{k}.csv", _dir(kind) / f"{k}.json"
    if disk and path.exists():
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("sha256") != _sha256(path):
                raise ValueError("checksum mismatch")
            df = pd.read_csv(path, keep_default_na=False, na_values=[""])
            if len(df) != meta.get("rows"):
                raise ValueError("row count mismatch")
            _touch(path, meta_path)
            _mem_put(k, df)
            return df.copy()
        except Exception:  # noqa: BLE001 - truncated, edited or unverified: recomputed
            path.unlink(missing_ok=True)
            meta_path.unlink(missing_ok=True)
    return None


def _frame_put(k: str, kind: str, df: pd.DataFrame, disk: bool) -> None:
    _mem_put(k, df)
    if disk:
        d = _dir(kind)
        try:
            _atomic_write(d / f"{k}.csv", lambda p: df.to_csv(p, index=False))
            meta = {"sha256": _sha256(d / f"{k}.csv"), "rows": len(df)}
            _atomic_write(d / f"{k}.json", lambda p: p.write_text(json.dumps(meta)))
            trim_disk()
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
