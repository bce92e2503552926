"""The checks that refuse a loaded model folder that would give silently wrong numbers (`check_loaded`)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ctxmix.errors import ModelLoadError


def _listing(keys, most: int = 8) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")


def check_loaded(name: str, hf: Any, loading: dict, tokenizer) -> list[str]:
    """Refuse a model folder that would give silently wrong numbers; warn about what is normal.

    ModelLoadError for: tensors the model (its head included) reads but the checkpoint lacks
    (transformers would initialise them at random: a classifier head that is not the trained
    one, a layer left out), tensors of the wrong shape, non-finite weights, and a tokenizer that
    does not match the embedding (a missing tokenizer falls back to a handful of tokens).
    A warning lists unexpected tensors: real checkpoints carry some (bert-base-uncased's NSP
    head and pooler when loaded as a masked LM). Returns the warnings."""
    problems = []
    missing = set(loading.get("missing_keys") or ())
    if missing:
        problems.append(f"tensors missing from the checkpoint (they would be random): {_listing(missing)}")
    mismatched = [k[0] if isinstance(k, tuple) else k for k in (loading.get("mismatched_keys") or ())]
    if mismatched:
        problems.append(f"tensors of the wrong shape: {_listing(mismatched)}")
    if loading.get("error_msgs"):
        problems.append("; ".join(map(str, loading["error_msgs"]))[:500])
    from ctxmix.engine.weights import module_tensors, tensor_for_hash

    # each offloaded leaf loaded in turn (never the whole model at once); packed quantized tensors are integers,
    # torchao's subclasses are checked dequantized
    bad = [
        n for n, p in module_tensors(hf) if p.is_floating_point() and not bool(torch.isfinite(tensor_for_hash(p)).all())
    ]
    if bad:
        problems.append(f"non-finite weights (NaN or inf) in: {_listing(bad)}")
    rows = hf.get_input_embeddings().weight.shape[0] if tokenizer is not None else 0
    n_tok = len(tokenizer) if tokenizer is not None else 0  # an image model reads no tokens
    if tokenizer is not None and (n_tok > rows or n_tok < 0.9 * rows):
        problems.append(
            f"the tokenizer has {n_tok} tokens but the embedding has {rows} rows: the tokenizer files are "
            "missing or belong to another model"
        )
    if problems:
        raise ModelLoadError(f"{name!r} cannot be used as it is: " + "; ".join(problems))
    notes = []
    unexpected = set(loading.get("unexpected_keys") or ())
    if unexpected:
        notes.append(
            f"{name!r}: the checkpoint has tensors this model does not use (normal for a checkpoint saved "
            f"with another head): {_listing(unexpected)}"
        )
        warnings.warn(notes[-1], stacklevel=3)
    return notes
