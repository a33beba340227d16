"""Exceptions a user can act on. Each message names the problem and the value."""


class TokenmillError(Exception):
    """Base class for errors caused by user input or configuration."""


class ModelLoadError(TokenmillError):
    """The model path, file format, architecture or tensor type cannot be loaded."""


class InvalidRequestError(TokenmillError, ValueError):
    """A prompt or sampling parameter is invalid (maps to HTTP 400 at the server)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the request field at fault, when one is


class UnknownModelError(InvalidRequestError):
    """A request names a model (a LoRA adapter) the engine does not serve, or no longer
    does: an unload can land between the server's check and the engine (HTTP 404)."""


class EngineDeadError(RuntimeError):
    """The engine cannot go on (its loop stopped, or a worker process of a split model
    died or failed); no request can be served. Never retried request by request."""
