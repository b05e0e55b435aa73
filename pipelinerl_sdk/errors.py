"""Typed errors of the SDK. Each carries what a caller needs to act: the field, the server, the
HTTP status the server answers with."""

from __future__ import annotations


class PipelineRLError(Exception):
    """Base of every error this SDK raises on purpose."""


class UpdateRejected(PipelineRLError):
    """A weight update refused before any receive started; the old weights keep serving.

    ``status`` is the HTTP status the server answers with (409: version or state conflict,
    422: params do not match the model, 400: malformed plan)."""

    def __init__(self, message: str, *, status: int = 422, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.field = field


class UpdateFailed(PipelineRLError):
    """A weight update accepted but not completed (timeout, peer lost, apply error); the old
    weights keep serving and the server is unpaused."""


class UpdateAborted(UpdateFailed):
    """The trainer called the update off before sending (another server refused it)."""


class InvalidRequest(PipelineRLError, ValueError):
    """A request the backend cannot serve as asked (answered 400); ``field`` names the offending
    request field. Adapters raise it (or :class:`PromptTooLong`) instead of a bare ValueError."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class PromptTooLong(InvalidRequest):
    """The prompt plus the token budget does not fit the context (``max_model_len``)."""


class RequestTooLarge(PipelineRLError):
    """A request body past the server's size limit (answered 413), refused before it is parsed."""

    def __init__(self, message: str, *, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


class Overloaded(PipelineRLError):
    """The server's admission limits are reached (answered 429 with ``Retry-After``): nothing of
    the request ran; retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class GroupError(PipelineRLError):
    """The weight-update process group is missing, broken, or could not be formed."""


class DecisionTimeout(GroupError):
    """No decision signed by the trainer arrived within the request's ``timeout_s`` (answered 408:
    the caller never decided); the group is marked broken, as for any lost decision."""


class ServerError(PipelineRLError):
    """A server of a fan-out failed; ``url`` names it, ``status`` is its HTTP status (or None
    when it could not be reached)."""

    def __init__(self, url: str, message: str, *, status: int | None = None) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.status = status


class FanOutError(PipelineRLError):
    """One or more servers of a fan-out failed; ``errors`` holds one :class:`ServerError` each."""

    def __init__(self, errors: list[ServerError]) -> None:
        super().__init__("; ".join(str(e) for e in errors))
        self.errors = errors


class PluginError(PipelineRLError):
    """A backend could not be registered or created; the message names the plugin and the
    remedy."""
