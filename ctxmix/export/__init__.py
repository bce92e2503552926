"""Exports: figures (`plots`), one LaTeX writer (`latex`), saved explanations (`saved`)."""


def __getattr__(name: str):  # submodules load on first use (`ctxmix.export.plots` after `import ctxmix`)
    import importlib

    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
