"""Lazy package attributes (PEP 562): names and submodules load on first use, so `import ctxmix`
imports neither torch nor plotly nor streamlit until something needs them."""

from __future__ import annotations

from importlib import import_module


def lazy_getattr(package: str, api: dict[str, str] | None = None, aliases: dict[str, str] | None = None):
    """A module `__getattr__` for `package`: a name of `api` (name -> submodule defining it), a
    submodule under another name (`aliases`: name -> submodule), or any submodule itself."""
    api, aliases = api or {}, aliases or {}

    def __getattr__(name: str):
        if name in api:
            return getattr(import_module(f"{package}.{api[name]}"), name)
        target = f"{package}.{aliases.get(name, name)}"
        try:
            return import_module(target)
        except ModuleNotFoundError as e:
            if e.name != target:
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__
