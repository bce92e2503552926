"""Decompositions -> methods: one registry (`registry`), the context-mixing maps (`mixing`), gradient
and perturbation saliency (`saliency`), ALTI+ for encoder-decoders (`alti_plus`) and the
`explain` API that runs them on one text or a batch.
"""


def __getattr__(name: str):  # submodules load on first use (`ctxmix.methods.registry` after `import ctxmix`)
    import importlib

    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
