"""Model -> trace -> exact decompositions: one declarative map of module names per family
(`arch`), the layers recomputed from the weights (`layer`), one traced forward pass (`trace`),
model loading (`models`, `sentiment`), encoder-decoders' decoders (`seq2seq`), precision and
memory budgets.
"""


def __getattr__(name: str):  # submodules load on first use (`ctxmix.engine.models` after `import ctxmix`)
    import importlib

    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
