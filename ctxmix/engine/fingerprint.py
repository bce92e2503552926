"""Fingerprints of weights: what names a model's weights in every cache key and record (`weights_sha256`), and
the checksums that tell a built model's files are still the ones written (`verify_weights`). Hashing files is
cached per process by size and mtime; a model built in memory is summed where its tensors live, never copied to
the host. (What names an embedded model's source file, `source_sha256`, is `embedded`'s.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ctxmix.errors import ModelLoadError

_FILE_SHA: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256, for this process


def _file_sha256(path: Path) -> str:
    import hashlib

    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FILE_SHA:  # size and mtime unchanged: the file was hashed already
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(2**22), b""):
                h.update(block)
        _FILE_SHA[key] = h.hexdigest()
    return _FILE_SHA[key]


def weights_sha256(model: Any) -> str:  # a `Model` (`models` imports this module, not the reverse)
    """A fingerprint of the weights themselves: the SHA-256 of the model folder's safetensors
    files (size and mtime as a fast path), or, for a model built in memory, of its tensors' names,
    shapes and sums. A local
    folder whose weights change gets a new fingerprint, so no cache serves maps of the old ones."""
    import hashlib

    if getattr(model, "_weights_sha256", None):  # fixed when the model was loaded (see _from_folder_or_hub)
        return model._weights_sha256
    folder = Path(str(getattr(model.hf, "name_or_path", "") or ""))
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:  # a hub id: the files transformers read from its cache
        try:
            from huggingface_hub import try_to_load_from_cache

            for fname in ("model.safetensors", "model.safetensors.index.json"):
                hit = try_to_load_from_cache(str(folder), fname)
                if isinstance(hit, str):
                    files = sorted(Path(hit).parent.glob("*.safetensors"))
                    break
        except Exception:  # noqa: BLE001 - not a hub id
            files = []
    h = hashlib.sha256()
    if files:
        for f in files:
            h.update(f.name.encode() + _file_sha256(f).encode())
    else:
        h.update(tensors_fingerprint(model.hf).encode())
    model._weights_sha256 = h.hexdigest()
    return model._weights_sha256


def tensors_fingerprint(hf: Any) -> str:
    """SHA-256 of a model built in memory: each parameter's and persistent buffer's name, shape, dtype and two
    sums, reduced where the tensor lives (hashing the bytes would copy every weight to the host: gigabytes for
    a large model on a GPU). Offloaded weights are loaded one leaf module at a time, so a model dispatched
    over devices, CPU and disk hashes like the same model in one place, without ever being whole in memory;
    torchao's tensor subclasses are summed dequantized, bitsandbytes' packed integers with their scales."""
    import hashlib

    from ctxmix.engine.weights import module_tensors, tensor_for_hash

    h = hashlib.sha256()
    rows = []
    for name, t in module_tensors(hf):
        t = tensor_for_hash(t)
        parts = [t] + [getattr(getattr(t, "quant_state", None), "absmax", None), getattr(t, "SCB", None)]
        sums = [_two_sums(x.detach()) for x in parts if isinstance(x, torch.Tensor)]
        rows.append((name, f"{name}{tuple(t.shape)}{t.dtype}".encode(), torch.cat(sums).numpy().tobytes()))
    for _, head, data in sorted(rows):
        h.update(head + data)
    return h.hexdigest()


HASH_CHUNK = 2**22  # elements summed at a time: a float64 copy of a 128k x 4,096 embedding would be 4.2 GB


def _two_sums(x: torch.Tensor) -> torch.Tensor:
    """(sum, sum of |x|) of a tensor, float64 (int64 for integers, then widened), in chunks: temporaries of
    HASH_CHUNK elements, never a widened copy of the whole tensor."""
    acc = torch.float64 if x.is_floating_point() else torch.int64
    flat = x.reshape(-1)
    out = torch.zeros(2, dtype=acc, device=x.device)
    for a in range(0, flat.numel(), HASH_CHUNK):
        c = flat[a : a + HASH_CHUNK]
        out += torch.stack([c.sum(dtype=acc), c.abs().sum(dtype=acc)])
    return out.double().cpu()


def _weights_record(folder: Path) -> dict:
    """Size, mtime and SHA-256 of a built model's weight files."""
    import hashlib

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(2**22), b""):
                h.update(block)
        st = f.stat()
        out[f.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": h.hexdigest()}
    return out


def verify_weights(folder: Path, meta: dict) -> None:
    """Check a built model's weights against the checksums its metadata records (size and mtime
    first, the SHA-256 when they moved); a model built before checksums existed gets them now."""
    recorded = meta.get("weights")
    if not recorded:
        meta["weights"] = _weights_record(folder)
        tmp = folder / ".ctxmix_meta.json.tmp"
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, folder / "ctxmix_meta.json")
        return
    files = sorted(f.name for f in folder.glob("*.safetensors"))
    if files != sorted(recorded):
        raise ModelLoadError(f"{folder}: weight files {files} differ from the recorded {sorted(recorded)}")
    for fname, rec in recorded.items():
        st = (folder / fname).stat()
        if st.st_size == rec["size"] and st.st_mtime_ns == rec["mtime_ns"]:
            continue
        if _weights_record(folder)[fname]["sha256"] != rec["sha256"]:
            raise ModelLoadError(f"{folder / fname}: the weights changed since the model was built")
