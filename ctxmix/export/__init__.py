"""Exports: figures (`plots`), one LaTeX writer (`latex`), saved explanations (`saved`)."""

from ctxmix.lazy import lazy_getattr

__getattr__ = lazy_getattr(__name__)  # submodules load on first use
