"""A context attribution's files and views: .npz and JSON, HTML shading, the paper figure, `ctxmix cite`."""

from ctxmix.lazy import lazy_getattr

__getattr__ = lazy_getattr(__name__)  # submodules load on first use
