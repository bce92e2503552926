"""Exceptions with messages meant for a user, not a developer."""


class CtxmixError(Exception):
    """Base class: every error ctxmix raises on purpose has a readable message."""


class ModelLoadError(CtxmixError):
    """A model could not be found, downloaded or read safely."""


class UnsupportedArchitecture(CtxmixError):
    """The model's architecture has no declarative description in `ctxmix.engine.arch`."""


class BadInput(CtxmixError, ValueError):
    """Empty text, unknown method names, malformed options."""


def checked_arguments(fn):
    """Unknown or missing arguments of a public function become a BadInput that names the valid
    ones, the same for every function (Python would raise a TypeError)."""
    import functools
    import inspect

    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            sig.bind(*args, **kwargs)
        except TypeError as e:
            valid = [p for p in sig.parameters if sig.parameters[p].kind is not inspect.Parameter.VAR_KEYWORD]
            raise BadInput(f"{fn.__name__}: {e}; it takes {', '.join(valid)}") from None
        return fn(*args, **kwargs)

    return wrapper
