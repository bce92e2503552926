"""The FF paper's scope names (Kobayashi et al., ICLR 2024) for each layer shape: what
`ctxmix.engine.layer.scope_pieces` decomposes, named where the layer maths lives. Torch-free, so the
method registry and the families table read them without loading a model's code."""

from __future__ import annotations

POST_LN_SCOPES = ("Atb", "AtbFf", "AtbFfRes", "AtbFfResLn")


PRE_LN_SCOPES = ("Atb", "AtbLn", "AtbLnFf", "AtbLnFfRes")


SANDWICH_SCOPES = ("Atb", "AtbLn", "AtbLnFf", "AtbLnFfLn", "AtbLnFfLnRes")  # Gemma 2/3: LNf after the FF


def scope_names(position: str) -> tuple[str, ...]:
    """The FF paper's scopes of a layer shape: post-LN, pre-LN, or parallel (post-LN's names in
    post-LN's order: Atb = LN1 + ATTN, +Ff, +Res, and +Ln with the next norm; see
    `ctxmix.engine.layer._parallel_scopes`)."""
    return {"pre": PRE_LN_SCOPES, "parallel": POST_LN_SCOPES[:3], "sandwich": SANDWICH_SCOPES}.get(
        position, POST_LN_SCOPES
    )
