"""What the dashboard and a hosted copy need, without Streamlit: the results cache (`cache`),
hosted limits and login (`limits`) and the `serve` launcher.
"""


def __getattr__(name: str):  # submodules load on first use (`ctxmix.service.cache` after `import ctxmix`)
    import importlib

    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
