"""Typed errors the engine raises to its callers.

Every error a user can cause is a subclass of :class:`TokenmillError`, so the
server maps them to 4xx answers and the Python API raises something a caller
can catch by kind.
"""

from __future__ import annotations


class TokenmillError(Exception):
    """Base class of every error tokenmill raises on purpose."""


class InvalidRequestError(TokenmillError, ValueError):
    """A request (prompt or sampling parameter) the engine cannot serve.

    ``param`` names the offending parameter so the server can report it.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidStateTransition(TokenmillError, RuntimeError):
    """A request was moved between two states that do not connect."""


class ModelNotFoundError(TokenmillError, FileNotFoundError):
    """The model path or hub id does not resolve to a checkpoint."""


class UnsupportedModelError(TokenmillError, ValueError):
    """No installed model plugin implements the checkpoint's architecture."""


class UnsupportedQuantizationError(UnsupportedModelError):
    """The checkpoint's quantization method (or the one asked for) is not installed,
    or the two disagree; ``installed`` lists the method names that are."""

    def __init__(self, message: str, installed: list[str]) -> None:
        super().__init__(message)
        self.installed = installed


class PluginError(TokenmillError, RuntimeError):
    """A plugin failed to load, or two plugins claim the same name."""


class EngineDeadError(TokenmillError, RuntimeError):
    """The engine loop died; no request can make progress any more."""


class QueueFullError(TokenmillError, RuntimeError):
    """Admission control refused a request: too many requests or prompt tokens are queued.

    ``limit`` names the bound that was hit (``max_queued_requests`` or
    ``max_queued_tokens``); the request may be retried later.
    """

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class ConfigError(TokenmillError, ValueError):
    """An engine option the installed plugins do not accept: an unknown ``plugin_options`` key,
    or a value of the wrong type for it."""
