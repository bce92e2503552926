"""Exceptions with messages meant for a user, not a developer."""


class CtxmixError(Exception):
    """Base class: every error ctxmix raises on purpose has a readable message."""


class ModelLoadError(CtxmixError):
    """A model could not be found, downloaded or read safely."""


class UnsupportedArchitecture(CtxmixError):
    """The model's architecture has no declarative description in `ctxmix.arch`."""


class BadInput(CtxmixError, ValueError):
    """Empty text, unknown method names, malformed options."""
